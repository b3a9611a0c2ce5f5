"""Sharding a model's state and batch over a device mesh (data, FSDP and tensor parallel).

Mesh axes by name: ``"data"`` (data parallel: batch split, parameters replicated),
``"fsdp"`` (ZeRO-3: batch split *and* every parameter, with its optimizer moments, split
along the model width by default, along its features with the FSDP split ``"features"``
(the option ``mesh.fsdp_split``), along its largest dimension for a plain
pytree; the partitioner gathers a weight where a GEMM needs it and reduce-scatters its
gradient), ``"tensor"`` (Megatron tensor parallelism,
:mod:`coda_jax.layers.tensor_parallel`: ``w_gu`` split by columns, ``w_o`` and ``w_down``
by rows, :data:`TENSOR_SPLIT_DIM`). Tokens are split over ``("data", "fsdp")``, the
axes :mod:`coda_jax.partitioning` runs the kernels over.

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    with jax.set_mesh(mesh):
        state = shard_state(nnx.state((model, optimizer)), mesh)
        tokens = jax.device_put(tokens, batch_sharding(mesh))

Several processes (``jax.distributed.initialize``; a mesh over ``jax.devices()``, every
process's devices): :func:`shard_state` places a state that each process built whole and
alike (the same seed) without a cross-process check, and :func:`batch_from_rows` builds the
global batch from the rows each process's devices hold, so no process cuts the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coda_jax import mesh_axes
from coda_jax.mesh_axes import FSDP_AXIS, TENSOR_AXIS, context_mesh, explicit_sharding, features_split

# Logical axis names the layers attach to their parameters (``nnx.Param`` metadata
# ``out_sharding``, :func:`logical_param`) and the mesh axis each maps to: FSDP splits the
# model width (``qkv_embed`` is the width as ``w_qkv``'s rows), tensor parallelism the MLP
# features, the attention heads (of ``w_o``; the ``qkv`` columns split inside the block,
# see :data:`TENSOR_SPLIT_DIM`) and the vocabulary.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("embed", "fsdp"), ("qkv_embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("qkv", None),
    ("vocab", "tensor"), ("norm", None), ("head_dim", None),
)
# (The vocabulary over "tensor": the vocab-parallel LM head takes the table split so, and a
# table whole over "tensor" had its head gradient, V x d, gathered whole every step.)
# Under FSDP with ``mesh_axes.fsdp_split() == "features"`` (and no tensor axis): the MLP
# weights, ``w_o`` and the embedding split along their features, not the width (see
# coda_jax.mesh_axes.FSDP_SPLITS). ``w_qkv`` keeps its rows split, as plain JAX places
# its separate Q, K and V weights: split by columns, its gradient's reduce-scatter wants a
# column-major layout and the optimizer update then transposes the parameter and both
# moments, and the attention input is resharded by all-to-alls (slower:
# docs/performance.md#fsdp-split).
FEATURE_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("embed", None), ("qkv_embed", "fsdp"), ("mlp", "fsdp"), ("heads", "fsdp"), ("qkv", None),
    ("vocab", "fsdp"), ("norm", None), ("head_dim", None),
)
# The dimension each block weight splits along under tensor parallelism, by parameter name
# (a path's last name, so optimizer moments follow their parameter). ``w_qkv`` is absent: its
# Q, K and V column groups split separately, inside the block.
TENSOR_SPLIT_DIM = {"w_gu": 1, "w_o": 0, "w_down": 0}


def _axis_size(mesh, name: str) -> int:
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)


def axis_rules(mesh=None) -> tuple[tuple[str, str | None], ...]:
    """The logical axis rules in force on ``mesh``: :data:`LOGICAL_AXIS_RULES`, or
    :data:`FEATURE_AXIS_RULES` where :func:`coda_jax.mesh_axes.features_split` (the FSDP
    split ``"features"``, no tensor axis)."""
    if mesh is not None and features_split(mesh):
        return FEATURE_AXIS_RULES
    return LOGICAL_AXIS_RULES


def fsdp_spec(shape: tuple[int, ...], mesh, axis: str = FSDP_AXIS, *, skip: int | None = None) -> P:
    """``P`` splitting the largest dimension of ``shape`` (other than ``skip``) that
    ``axis``'s size divides (replicated when none does, or for scalars and the mesh without
    the axis)."""
    n = _axis_size(mesh, axis)
    if n <= 1 or not shape:
        return P()
    dims = sorted((i for i in range(len(shape)) if i != skip), key=lambda i: -shape[i])
    for i in dims:
        if shape[i] % n == 0:
            return P(*(axis if j == i else None for j in range(len(shape))))
    return P()


def param_spec(name: str | None, shape: tuple[int, ...], mesh, axis: str = FSDP_AXIS,
               tensor_split_dims: Mapping[str, int] | None = None) -> P:
    """Where a parameter (or its optimizer moment) named ``name`` lives on ``mesh``: its
    dimension in ``tensor_split_dims`` (default :data:`TENSOR_SPLIT_DIM`) over ``"tensor"``
    (when the axis divides it), and the largest other dimension over ``axis``
    (:func:`fsdp_spec`)."""
    t = _axis_size(mesh, TENSOR_AXIS)
    split_dims = TENSOR_SPLIT_DIM if tensor_split_dims is None else tensor_split_dims
    tdim = split_dims.get(name) if t > 1 else None
    if tdim is not None and (len(shape) <= tdim or shape[tdim] % t):
        tdim = None
    spec = list(fsdp_spec(shape, mesh, axis, skip=tdim)) + [None] * len(shape)
    if tdim is not None:
        spec[tdim] = TENSOR_AXIS
    return P(*spec[:len(shape)]) if any(spec) else P()


def logical_param(value: jax.Array, names: tuple[str, ...]):
    """``nnx.Param(value)`` carrying logical axis ``names`` (one per dimension) as its
    ``out_sharding`` metadata, resolved only when sharded (:func:`logical_partition_specs`)."""
    from flax import nnx

    if len(names) != value.ndim:
        raise ValueError(f"logical names {names} must name each of the {value.ndim} dimensions")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def rows_first(spec: P, shape: tuple[int, ...], mesh) -> P:
    """``spec`` of a 2-D weight split over ``"fsdp"`` along its columns, moved to its rows
    where the rows divide, under the width split (``w_o``, ``w_down`` and the embedding,
    whose logical columns are the width); any other ``spec`` as it is.

    On a mesh without a tensor axis ``P(None, "fsdp")`` becomes ``P("fsdp", None)``. With a
    tensor axis the rows may already be split over ``"tensor"`` (``w_o``, ``w_down``:
    ``P("tensor", "fsdp")``), and FSDP joins it there: ``P(("tensor", "fsdp"), None)``,
    tensor-major, so that gathering over ``"fsdp"`` leaves each tensor shard its own
    contiguous rows, the ``P("tensor", None)`` the block's ``shard_map`` takes (the
    embedding, split by vocabulary over ``"tensor"``, likewise: the vocab-parallel head's).

    The width split gathers each weight whole (over ``"fsdp"``), so which dimension holds
    the split changes only the layouts: split along the columns of a row-major array, the
    gathers and the gradient's reduce-scatter want column-major buffers, and XLA then makes
    the optimizer update read the parameter and both moments transposed (as it did for
    ``w_qkv`` under the features split: docs/performance.md#fsdp-split); the vocabulary-parallel
    LM head's ``shard_map`` wants the table split by vocabulary, and resharded a width-split
    one by all-to-alls. Plain JAX's largest-dimension placement splits all three along their
    rows."""
    spec = tuple(spec)
    if (len(shape) != 2 or len(spec) != 2 or spec[1] != FSDP_AXIS or spec[0] not in (None, TENSOR_AXIS)
            or features_split(mesh)):
        return P(*spec)
    rows = (spec[0], FSDP_AXIS) if spec[0] else FSDP_AXIS
    if shape[0] % (_axis_size(mesh, FSDP_AXIS) * (_axis_size(mesh, spec[0]) if spec[0] else 1)):
        return P(*spec)
    return P(rows, None)


def logical_partition_specs(state: Any, mesh, rules=None) -> Any:
    """``nnx.get_partition_spec(state)`` under ``rules``, made valid for ``mesh``: a mesh axis
    the mesh lacks (or of size 1), or one that does not divide its dimension, becomes
    ``None``. Variables without logical names get ``P()``. With ``rules=None`` (the rules in
    force, :func:`axis_rules`) each spec also passes through :func:`rows_first`. As any Flax
    model:

        specs = logical_partition_specs(nnx.state(model), mesh)
        state = jax.device_put(nnx.state(model), jax.tree.map(lambda p: NamedSharding(mesh, p), specs))
    """
    from flax import nnx
    from flax.core import spmd

    with spmd.logical_axis_rules(axis_rules(mesh) if rules is None else rules):
        specs = nnx.get_partition_spec(state)

    if rules is not None:
        return jax.tree.map(lambda x, spec: _fit_spec(x.shape, spec, mesh), state, specs)
    return jax.tree.map(lambda x, spec: _spec_in_force(x.shape, spec, mesh), state, specs)


def _spec_in_force(shape: tuple[int, ...], spec, mesh) -> P:
    """A parameter's placement on ``mesh`` from ``spec`` (its logical names under
    :func:`axis_rules`): :func:`_fit_spec`, then :func:`rows_first`."""
    return rows_first(_fit_spec(shape, spec, mesh), shape, mesh)


def _fit_spec(shape: tuple[int, ...], spec, mesh) -> P:
    """``spec`` with every mesh axis the mesh lacks, of size 1, or not dividing its
    dimension replaced by ``None``."""
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    out = [a if a is not None and a in mesh.axis_names and _axis_size(mesh, a) > 1 and shape[i] % _axis_size(mesh, a) == 0
           else None for i, a in enumerate(spec[:len(shape)])]
    return P(*out) if any(out) else P()


def cast_for_use(var, dtype=None, whole: bool = True) -> jax.Array:
    """The value of parameter ``var`` (an ``nnx.Variable``) as a layer uses it: cast to
    ``dtype``, then whole on every device (:func:`gathered`; ``whole=False`` leaves the cast
    copy on its parameter's split, for a ``shard_map`` that takes its own slice of it).

    The cast comes before the gather (a 16-bit copy moves half the bytes). Under an Auto
    mesh the partitioner places the gather, and it gathered the float32 parameter and cast
    after. So the cast copy is pinned to the parameter's own split (:func:`param_split`), and
    the gather has to follow the cast."""
    keep = gathered if whole else (lambda a: a)
    v = var[...]
    if dtype is None or v.dtype == dtype:
        return keep(v)
    c = v.astype(dtype)
    split = param_split(var)
    if split is not None:
        c = jax.lax.with_sharding_constraint(c, split)
    return keep(c)


def param_split(var) -> P | None:
    """Where parameter ``var`` (an ``nnx.Variable``) lies on the context mesh under Auto axis
    types: the ``PartitionSpec`` of its logical axis names (:data:`LOGICAL_AXIS_RULES`), to pin
    a copy derived from it (a cast, a quantized copy) to the same split. None without an Auto
    mesh (under Explicit axes an array's type carries its split), inside a ``shard_map``, or
    for a parameter stored whole."""
    mesh = context_mesh()
    names = var.get_metadata().get("out_sharding") if hasattr(var, "get_metadata") else None
    if mesh is None or not names or mesh.are_all_axes_explicit or getattr(mesh, "manual_axes", ()):
        return None
    spec = _spec_in_force(var[...].shape, [dict(axis_rules(mesh)).get(n) for n in names], mesh)
    return spec if any(spec) else None


def gathered_from_split(x: jax.Array, split: P | None) -> jax.Array:
    """``x``, computed elementwise from a parameter that lies on ``split`` (:func:`param_split`),
    whole on every device, gathered as ``x``: under an Auto mesh pinned to ``split`` first, so
    that the partitioner moves ``x`` (a cast or quantized copy: fewer bytes) and not the
    parameter it came from; under an Explicit mesh :func:`gathered`."""
    if split is None:
        return gathered(x)
    return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(x, split), P())


def _leaf_name(path) -> str | None:
    """The last name in a pytree path (``[...]['w_gu'].value`` -> ``"w_gu"``)."""
    for key in reversed(path):
        k = getattr(key, "key", getattr(key, "name", None))
        if isinstance(k, str) and k not in ("value", "raw_value"):
            return k
    return None


def _has_logical_names(state: Any) -> bool:
    from flax import nnx

    found = []
    jax.tree.map(lambda v: found.append(bool(v.get_metadata().get("out_sharding"))), state,
                 is_leaf=lambda v: isinstance(v, nnx.Variable))
    return any(found)


def shard_state(state: Any, mesh, axis: str = FSDP_AXIS, tensor_split_dims: Mapping[str, int] | None = None) -> Any:
    """``state`` (e.g. ``nnx.state((model, optimizer))``) placed on ``mesh``.

    An ``nnx.State`` whose parameters carry logical axis names (the coda-jax layers'
    parameters do, and so do their optimizer moments) is placed by
    :func:`logical_partition_specs` (:data:`LOGICAL_AXIS_RULES`: FSDP over the model width,
    moved to each weight's rows by :func:`rows_first`; tensor parallel over MLP features,
    heads and the vocabulary; :data:`FEATURE_AXIS_RULES` under the features split). A plain pytree of arrays is placed by
    :func:`param_spec` (the largest dimension over ``axis``, the block weights'
    :data:`TENSOR_SPLIT_DIM` over ``"tensor"``, or ``tensor_split_dims``: ``{leaf name:
    dimension}``). Everything else is replicated."""
    if axis == FSDP_AXIS and _has_logical_names(state):
        specs = logical_partition_specs(state, mesh)
        return jax.tree.map(lambda x, p: place_whole(x, NamedSharding(mesh, p)), state, specs)

    def place(path, x):
        return place_whole(x, NamedSharding(mesh, param_spec(_leaf_name(path), x.shape, mesh, axis,
                                                             tensor_split_dims)))

    return jax.tree_util.tree_map_with_path(place, state)


def place_whole(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """``jax.device_put(x, sharding)`` of a value each process holds whole.

    With one process (or a ``sharding`` on this process's devices only) it is that. When
    ``sharding`` spans other processes' devices, each process puts its own devices' slices
    of its ``x`` (:func:`jax.make_array_from_callback`). ``jax.device_put`` would instead
    gather the whole value from every process to check that they agree (one collective per
    array, the whole model's size; and it refuses an array committed to a device, such as an
    orbax-restored one). The values must agree: the callers build them from the same seed.
    An ``x`` already spread over several processes is resharded by ``jax.device_put``."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index])


def batch_from_rows(rows: Callable[[int, int], np.ndarray], shape: tuple[int, ...], mesh) -> jax.Array:
    """The global ``[batch, ...]`` array of ``shape`` split over ``mesh`` as
    :func:`batch_sharding`, built from ``rows(lo, hi)``: the host array of rows ``lo:hi``.

    ``rows`` is called only for the row ranges this process's devices hold (once for each,
    however many devices hold it): under several processes each process makes only its part
    of the global batch, which must be the same rows a single process would cut there (e.g.
    drawn from a seed all processes share). With one process it equals
    ``jax.device_put(rows(0, batch), batch_sharding(mesh, len(shape)))``."""
    made: dict[tuple[int, int], np.ndarray] = {}

    def block(index: tuple[slice, ...]) -> np.ndarray:
        lo, hi, _ = index[0].indices(shape[0])
        if (lo, hi) not in made:
            got = np.asarray(rows(lo, hi))
            if got.shape != (hi - lo, *shape[1:]):
                raise ValueError(f"rows({lo}, {hi}) gave shape {got.shape}; expected {(hi - lo, *shape[1:])}")
            made[lo, hi] = got
        return made[lo, hi][(slice(None), *index[1:])]

    return jax.make_array_from_callback(tuple(shape), batch_sharding(mesh, len(shape)), block)


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[batch, ...]`` array: the batch over the mesh's token axes."""
    axes = tuple(a for a in mesh_axes.TOKEN_AXES if _axis_size(mesh, a) > 1)
    first = axes if len(axes) > 1 else (axes[0] if axes else None)
    return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def typed_like(v: jax.Array, like: jax.Array) -> jax.Array:
    """``v`` with ``like``'s sharding type under an Explicit-mode mesh (a reshard where the
    specs differ), else ``v`` itself. A kernel called unpartitioned (no token axis in the
    mesh, see :mod:`coda_jax.partitioning`) returns replicated types; an op's output that
    stands for one of its inputs (the residual stream) keeps that input's type, so the
    cotangent passed through to the input in the custom backward has the input's type."""
    return typed_as(v, explicit_sharding(like))


def typed_on_mesh(x: jax.Array) -> jax.Array:
    """Under an Explicit-mode mesh, ``x`` made outside it (no mesh type: a batch given as a
    plain array) typed as what it is there, replicated on every device; else ``x`` itself.
    The layers then see one kind of input: every array typed on the mesh."""
    mesh = context_mesh()
    if mesh is None or not mesh.are_all_axes_explicit or explicit_sharding(x) is not None:
        return x
    return jax.sharding.reshard(x, P())


def typed_as(v: jax.Array, sharding) -> jax.Array:
    """``v`` with ``sharding`` (an Explicit-mode ``NamedSharding``, or ``None`` for ``v`` itself):
    :func:`typed_like` for a custom backward that kept the input's sharding, not the input."""
    if sharding is None:
        return v
    own = explicit_sharding(v)
    return v if own is not None and own.spec == sharding.spec else jax.sharding.reshard(v, sharding.spec)


def reshape_tokens(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``x.reshape(shape)`` where both shapes lead with tokens (``[B, S, ...]`` <-> ``[B*S, ...]``).

    Under an Explicit-mode mesh the reshape names its output sharding: the token axes'
    split moves to the new leading dimension, every other dimension is unsplit (the batch
    split of ``[B, S]`` is the row split of ``[B*S]``)."""
    sh = explicit_sharding(x)
    if sh is None:
        return x.reshape(shape)
    lead = tuple(sh.spec)[0] if len(sh.spec) else None
    return jax.lax.reshape(x, shape, out_sharding=P(lead, *([None] * (len(shape) - 1))))


def gathered(w: jax.Array) -> jax.Array:
    """A parameter as a layer uses it: whole on every device. Under an Explicit-mode mesh an
    FSDP-split weight is gathered here (ZeRO-3's per-layer gather; its gradient is
    reduce-scattered back by the transpose); elsewhere ``w`` unchanged (the partitioner
    places the gather itself)."""
    sh = explicit_sharding(w)
    if sh is None or all(a is None for a in sh.spec):
        return w
    return jax.sharding.reshard(w, P())


MESH_AXES = ("data", "fsdp", "tensor")


def mesh_from_spec(spec: str | None, devices=None, *, explicit: bool = False):
    """``"data=2,fsdp=4"`` -> a mesh over ``devices`` (default: all, every process's under
    ``jax.distributed``) with those axes (Auto axis types; ``explicit``: Explicit, sharding in
    types); ``None`` or ``""`` -> data parallel over all devices (``None`` if only one). The
    sizes must multiply to the number of devices. The devices fill the mesh in
    ``jax.devices()`` order (process by process), the last axis fastest: an axis listed last
    (e.g. ``tensor``) stays within a process where its size divides the process's devices."""
    devices = list(devices if devices is not None else jax.devices())
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    if not spec:
        return None if len(devices) == 1 else jax.make_mesh((len(devices),), ("data",),
                                                            axis_types=(kind,), devices=devices)
    names, sizes = [], []
    for item in spec.split(","):
        name, eq, size = item.partition("=")
        if not eq or not size.isdigit() or int(size) < 1 or name not in MESH_AXES or name in names:
            raise ValueError(f"mesh entries are {' or '.join(a + '=N' for a in MESH_AXES)} (N >= 1, each axis "
                             f"once), got {item!r}")
        names.append(name)
        sizes.append(int(size))
    n = 1
    for x in sizes:
        n *= x
    if n != len(devices):
        raise ValueError(f"mesh {spec!r} has {n} devices; there are {len(devices)}")
    return jax.make_mesh(tuple(sizes), tuple(names), axis_types=(kind,) * len(names), devices=devices)


def token_shards(mesh) -> int:
    """How many ways the mesh splits the batch (the product of its token axes' sizes)."""
    if mesh is None:
        return 1
    n = 1
    for a in mesh_axes.TOKEN_AXES:
        n *= _axis_size(mesh, a)
    return n
