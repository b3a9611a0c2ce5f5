"""The LM head and cross-entropy split by vocabulary over one mesh axis.

Each shard of the *vocab axis* runs the fused norm + LM-head GEMM on its ``V / n`` rows of
``W_vocab`` for every row of its data shard, and the per-row LSEs and target logits combine
across the axis (``[M]`` float32 vectors; :func:`coda_jax.linear_cross_entropy` with
``vocab_axis``). ``CodaLlama.loss`` picks the axis (:func:`vocab_parallel_axis`):

* ``"tensor"`` (tensor parallelism): a replicated head would repeat the model's largest GEMM
  whole on every tensor shard.
* ``"fsdp"`` (FSDP without a tensor axis): the FLOPs per device are the same either way
  (``M/n`` rows by ``V`` columns, or ``M`` rows by ``V/n`` columns), but the bytes that
  cross devices are not. Token-split, every device needs the whole head: an all-gather of
  ``W`` ``[V, d]`` (the 1B model's tied embedding, 501 MiB in bfloat16) and a
  reduce-scatter of its gradient, the last collective of the step. Vocab-split, it needs
  the final hidden states of its data shard's rows instead (an all-gather of ``x [M, d]``:
  128 MiB at 32 x 1024 tokens), their gradient's partial sums come back (``shard_map``'s
  transpose sums ``dx`` over the axis), and the head moves from its stored split (FSDP
  splits the model width) to a vocab split. The option ``mesh.vocab_parallel_head=False``
  keeps the token-split head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coda_jax import mesh_axes, partitioning
from coda_jax.fp8 import Fp8Recipe, Fp8Tensor
from coda_jax.mesh_axes import TENSOR_AXIS
from coda_jax.ops.fp8_cross_entropy import fp8_linear_cross_entropy
from coda_jax.ops.fp8_llama_block import Fp8Carry
from coda_jax.ops.linear_cross_entropy import linear_cross_entropy
from coda_jax.options import current_options


def vocab_parallel_axis(mesh, vocab_size: int) -> str | None:
    """The axis ``CodaLlama.loss`` splits the vocabulary over: ``"tensor"`` when its size
    ``T > 1`` divides ``vocab_size``; else ``"fsdp"`` when that axis (size > 1) divides it and
    the option ``mesh.vocab_parallel_head`` is on (the default); else ``None`` (token-split head)."""
    t = mesh_axes.axis_size(mesh, TENSOR_AXIS)
    if t > 1:
        return TENSOR_AXIS if vocab_size % t == 0 else None
    f = mesh_axes.axis_size(mesh, mesh_axes.FSDP_AXIS)
    if f > 1 and vocab_size % f == 0 and mesh_axes.FSDP_AXIS in mesh_axes.token_axes(mesh) \
            and current_options().mesh.vocab_parallel_head:
        return mesh_axes.FSDP_AXIS
    return None


def vocab_parallel_cross_entropy(x: jax.Array, gamma: jax.Array, w_vocab: jax.Array, targets: jax.Array, *,
                                 eps: float, ignore_index: int = -100, z_loss: float = 0.0,
                                 backend: str | None = None, vocab_axis: str = TENSOR_AXIS,
                                 fp8: tuple[jax.Array, Fp8Recipe, Fp8Carry | None] | None = None) -> jax.Array:
    """Mean cross-entropy of ``RMSNorm(x; gamma) @ w_vocab^T``, the vocab split over ``vocab_axis``.

    Each shard of ``vocab_axis`` (size ``n``) runs the fused LM-head GEMM on its ``V / n``
    vocab rows of ``w_vocab`` for all rows of its data shard (the rows split over the other
    token axes). The row LSEs and target logits (``[M_d]`` vectors) combine across shards;
    in the backward each shard's ``dlogits`` block gives its own ``dW`` rows and its partial
    ``dx``, summed over the shards.

    Args:
      x: ``[M, d]`` final residual stream (tokens split over the data axes, if any).
      gamma: ``[d]`` final-norm weight.
      w_vocab: ``[V, d]`` LM-head weight, ``V`` a multiple of ``n``.
      targets: ``[M]`` global class ids, or ``ignore_index``.
      vocab_axis: ``"tensor"`` or ``"fsdp"`` (see the module docstring).
      fp8: ``(meta [3, history], recipe, carry)``: the head's GEMMs in FP8
        (:func:`coda_jax.ops.fp8_cross_entropy.fp8_linear_cross_entropy`), each amax reduced
        over the whole mesh so that every shard quantizes with one device's scales; the
        gradient of ``meta`` is its next value. ``carry``: the last FP8 block's
        :class:`Fp8Carry` of ``x`` (its e4m3 ``h`` gathered for each shard's rows as ``x`` is:
        half the bytes), or None (the head quantizes ``h``).

    Returns:
      float32 scalar: the mean over rows whose target is not ``ignore_index``.
    """
    mesh = mesh_axes.context_mesh()
    n = mesh_axes.axis_size(mesh, vocab_axis)
    m, v = x.shape[0], w_vocab.shape[0]
    if v % n:
        raise ValueError(f"vocab-parallel cross-entropy: the vocabulary ({v}) must be a multiple of the "
                         f"{vocab_axis!r} axis size ({n})")
    dp = tuple(a for a in mesh_axes.token_axes(mesh) if a != vocab_axis)  # the rows' split
    data_shards = math.prod(mesh_axes.axis_size(mesh, a) for a in dp)
    if m % (data_shards * n):
        raise ValueError(f"vocab-parallel cross-entropy: tokens ({m}) must be a multiple of the data axes' size x "
                         f"the {vocab_axis!r} axis size ({data_shards * n})")
    tok = dp if len(dp) > 1 else (dp[0] if dp else None)
    # The output's rows: each data shard's rows, split again over the vocab axis (under FSDP
    # that is the batch's own split, ("data", "fsdp")).
    rows_spec = tuple(a for a in mesh_axes.TOKEN_AXES + (TENSOR_AXIS,) if a in dp or a == vocab_axis)

    def body(x, gamma, w, targets, meta, carry):
        kw = dict(eps=eps, ignore_index=ignore_index, z_loss=z_loss, reduction="none", vocab_axis=vocab_axis,
                  backend=backend)
        if fp8 is None:
            losses = linear_cross_entropy(x, gamma, w, targets, **kw)
        else:
            losses = fp8_linear_cross_entropy(x, gamma, w, targets, meta, recipe=fp8[1], carry=carry,
                                              amax_axes=tuple(mesh.axis_names), **kw)
        rows = x.shape[0] // n  # this shard's own rows of the (replicated) losses
        return jax.lax.dynamic_slice_in_dim(losses, jax.lax.axis_index(vocab_axis) * rows, rows)

    meta, carry = (fp8[0], fp8[2]) if fp8 is not None else (jnp.zeros((), jnp.float32), None)
    carry_spec = None
    if carry is not None:  # a cache, not differentiated: [M, d] rows and [d, M] / [P, M] columns by tokens
        carry = jax.tree.map(jax.lax.stop_gradient, carry)
        carry_spec = Fp8Carry(Fp8Tensor(P(tok, None), P(None, tok), P()), P(None, tok))
    losses = partitioning.shard_map_over(mesh, body, (P(tok, None), P(), P(vocab_axis, None), P(tok), P(), carry_spec),
                                         P(rows_spec), x, gamma, w_vocab, targets, meta, carry)
    return jnp.sum(losses) / jnp.maximum(jnp.sum(targets != ignore_index), 1).astype(jnp.float32)
