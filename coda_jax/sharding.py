"""Sharding a model's state and batch over a device mesh (data parallel and FSDP).

Mesh axes by name: ``"data"`` (data parallel: batch split, parameters replicated),
``"fsdp"`` (ZeRO-3: batch split *and* every parameter, with its optimizer moments, split
along its largest dimension that the axis divides; the partitioner gathers a weight where a
GEMM needs it and reduce-scatters its gradient), ``"tensor"`` (reserved for tensor
parallelism; not used by these rules). Tokens are split over ``("data", "fsdp")``, the
axes :mod:`coda_jax.partitioning` runs the kernels over.

    mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    with jax.set_mesh(mesh):
        state = shard_state(nnx.state((model, optimizer)), mesh)
        tokens = jax.device_put(tokens, batch_sharding(mesh))
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from coda_jax import partitioning

FSDP_AXIS = "fsdp"


def _axis_size(mesh, name: str) -> int:
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(name, 1)


def fsdp_spec(shape: tuple[int, ...], mesh, axis: str = FSDP_AXIS) -> P:
    """``P`` splitting the largest dimension of ``shape`` that ``axis``'s size divides
    (replicated when none does, or for scalars and the mesh without the axis)."""
    n = _axis_size(mesh, axis)
    if n <= 1 or not shape:
        return P()
    dims = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in dims:
        if shape[i] % n == 0:
            return P(*(axis if j == i else None for j in range(len(shape))))
    return P()


def shard_state(state: Any, mesh, axis: str = FSDP_AXIS) -> Any:
    """``state`` (a pytree of arrays, e.g. ``nnx.state((model, optimizer))``) placed on
    ``mesh``: split by :func:`fsdp_spec` along ``axis``, replicated over the other axes."""
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x.shape, mesh, axis))), state)


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[batch, ...]`` array: the batch over the mesh's token axes."""
    axes = tuple(a for a in partitioning.TOKEN_AXES if _axis_size(mesh, a) > 1)
    first = axes if len(axes) > 1 else (axes[0] if axes else None)
    return NamedSharding(mesh, P(first, *([None] * (ndim - 1))))


def explicit_sharding(x: jax.Array):
    """``x``'s sharding when it is typed under an Explicit-mode mesh (the layers and the
    reference lowering must then name output shardings themselves), else ``None``."""
    sh = getattr(jax.typeof(x), "sharding", None)
    if sh is None or sh.mesh.empty or not sh.mesh.are_all_axes_explicit:
        return None
    return sh


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


MESH_AXES = ("data", "fsdp")


def mesh_from_spec(spec: str | None, devices=None):
    """``"data=2,fsdp=4"`` -> a mesh over ``devices`` (default: all) with those axes (Auto
    axis types); ``None`` or ``""`` -> data parallel over all devices (``None`` if only one).
    The sizes must multiply to the number of devices."""
    devices = list(devices if devices is not None else jax.devices())
    if not spec:
        return None if len(devices) == 1 else jax.make_mesh((len(devices),), ("data",),
                                                            axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
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
    return jax.make_mesh(tuple(sizes), tuple(names), axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                         devices=devices)


def token_shards(mesh) -> int:
    """How many ways the mesh splits the batch (the product of its token axes' sizes)."""
    if mesh is None:
        return 1
    n = 1
    for a in partitioning.TOKEN_AXES:
        n *= _axis_size(mesh, a)
    return n
