"""The embedding lookup, also on a table split by vocabulary under an Explicit-mode mesh.

Under an Auto mesh (or none) the lookup is ``jnp.take`` and the partitioner places it. Under
an Explicit mesh the gather's output sharding must be named, and a table split along its
rows (the vocabulary: FSDP's rows, ``sharding.rows_first``; the tensor axis,
``LOGICAL_AXIS_RULES``) cannot be indexed as it lies. Gathering it whole costs the whole
``[V, d]`` table every step and, in the backward, a reduce-scatter of a dense ``[V, d]``
cotangent (the 1B model's float32 table: 1 GiB each way). :func:`embedding_lookup` instead
looks each token up where its row lives (:func:`_split_table_lookup`): the tokens are
gathered over the table's row axes that split the batch, every device takes the rows it
holds (zero elsewhere), and the partial rows are summed back to the tokens' own devices,
``[tokens, d]`` moved instead of ``[V, d]``. The backward is its transpose: the cotangent
gathered, scattered into the local rows in the table's dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coda_jax import mesh_axes, partitioning
from coda_jax.sharding import explicit_sharding


def embedding_lookup(table: jax.Array, tokens: jax.Array, dtype=None) -> jax.Array:
    """``table [V, d]`` rows at ``tokens [B, S]`` -> ``[B, S, d]``, cast to ``dtype`` (default:
    the table's).

    Under an Explicit-mode mesh the output follows the tokens' sharding (batch split as the
    tokens are, ``d`` unsplit); a table split along its rows alone is looked up in place
    (:func:`_split_table_lookup`), any other split table is gathered first.
    """
    dtype = table.dtype if dtype is None else dtype
    sh = explicit_sharding(tokens)
    if sh is None:
        return jnp.take(table, tokens, axis=0).astype(dtype)
    spec = tuple(sh.spec) + (None,) * (tokens.ndim - len(sh.spec))
    tsh = explicit_sharding(table)
    tspec = tuple(tsh.spec) + (None,) * (2 - len(tsh.spec)) if tsh is not None else (None, None)
    if tspec[0] is not None and tspec[1] is None:
        return _split_table_lookup(table, tokens, tspec[0], spec, dtype)
    return _whole_table_lookup(table, tokens, spec, dtype)


def _whole_table_lookup(table: jax.Array, tokens: jax.Array, spec: tuple, dtype) -> jax.Array:
    """The lookup on the table gathered whole, the output split as the tokens (``spec``)."""
    table = jax.sharding.reshard(table, P())
    return table.at[tokens].get(out_sharding=P(*spec, None)).astype(dtype)


def _axes(entry) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, tuple) else ((entry,) if entry else ())


def _split_table_lookup(table: jax.Array, tokens: jax.Array, rows, spec: tuple, dtype) -> jax.Array:
    """The lookup of ``tokens`` (split as ``spec``) in ``table`` split along its rows over the
    mesh axes ``rows``, inside one ``shard_map``.

    Per device: its tokens are gathered over ``gather`` (the row axes that also split the
    batch), each is looked up in the local rows ``[offset, offset + V / n)`` (zero if
    another device holds it), and the partial rows are summed over the row axes,
    scattered back over ``gather`` to the tokens' own devices. A token's row is nonzero on
    exactly one device, so the sum is exact in any dtype; it is taken in ``dtype``.
    """
    mesh = mesh_axes.context_mesh()
    row_axes = _axes(rows)
    batch_axes = _axes(spec[0])
    gather = tuple(a for a in row_axes if a in batch_axes)  # row axes that also split the batch
    summed = tuple(a for a in row_axes if a not in batch_axes)  # the tokens are replicated over these
    if gather and batch_axes[-len(gather):] != gather:
        # The batch's split must end with the gathered axes, so that gathering them is a
        # tiled all-gather along the batch (it does for ("data", "fsdp") and rows over fsdp).
        return _whole_table_lookup(table, tokens, spec, dtype)
    n_rows = table.shape[0] // math.prod(mesh_axes.axis_size(mesh, a) for a in row_axes)

    def body(tab, tok):
        if gather:
            tok = jax.lax.all_gather(tok, gather, axis=0, tiled=True)
        ids = tok - jax.lax.axis_index(row_axes) * n_rows
        here = (ids >= 0) & (ids < n_rows)
        part = jnp.where(here[..., None], jnp.take(tab, jnp.clip(ids, 0, n_rows - 1), axis=0), 0).astype(dtype)
        if gather:
            part = jax.lax.psum_scatter(part, gather, scatter_dimension=0, tiled=True)
        if summed:
            part = jax.lax.psum(part, summed)
        return part

    return partitioning.shard_map_over(mesh, body, (P(rows, None), P(*spec)), P(*spec, None), table, tokens)
