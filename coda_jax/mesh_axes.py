"""Mesh axes by name, the context mesh and the FSDP split in force.

The leaf that both the placement of a model's state (:mod:`coda_jax.sharding`) and the
GEMMs' partitioning rules (:mod:`coda_jax.partitioning`) read, so that the two agree:

* axis names: :data:`TOKEN_AXES` (the axes that split activations' token rows,
  ``("data", "fsdp")``; :func:`set_token_axes` changes them), :data:`FSDP_AXIS` (the token
  axis that also splits the parameters, ZeRO-3) and :data:`TENSOR_AXIS` (Megatron tensor
  parallelism);
* the mesh: :func:`context_mesh` (``jax.set_mesh``), :func:`axis_size`, :func:`token_axes`,
  :func:`token_shards`, and :func:`explicit_sharding` (an array's sharding type under an
  Explicit-mode mesh);
* the FSDP split (the option ``mesh.fsdp_split``, :data:`FSDP_SPLITS`): :func:`fsdp_split`,
  :func:`features_split`, :func:`fsdp_split_on`, :func:`fsdp_split_as`.

It imports nothing of coda-jax but its options.
"""

from __future__ import annotations

import math

import jax

from coda_jax.options import MeshOptions, current_options, options

TOKEN_AXES: tuple[str, ...] = ("data", "fsdp")
# The token axis over which the parameters are split too (FSDP, ZeRO-3).
FSDP_AXIS = "fsdp"
# Megatron tensor parallelism (coda_jax.layers.tensor_parallel): MLP features, attention heads
# and the vocabulary.
TENSOR_AXIS = "tensor"


def set_token_axes(axes: tuple[str, ...]) -> None:
    """The mesh axes over which activations' token (row) dimension is sharded."""
    global TOKEN_AXES
    if not all(isinstance(a, str) for a in axes):
        raise TypeError(f"token axes must be mesh axis names (str), got {axes!r}")
    TOKEN_AXES = tuple(axes)


def context_mesh():
    """The mesh set by ``jax.set_mesh`` / ``jax.sharding.use_mesh``, or ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty else mesh


def axis_size(mesh, name: str) -> int:
    """Size of ``mesh``'s axis ``name``: 1 without a mesh, without the axis, or where the axis
    is already manual (inside a ``shard_map`` over it, e.g. the tensor-parallel block's, code
    sees its shard only and must not split it again)."""
    if mesh is None or name not in mesh.axis_names or name in set(getattr(mesh, "manual_axes", ()) or ()):
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes))[name]


def token_axes(mesh) -> tuple[str, ...]:
    """:data:`TOKEN_AXES` present in ``mesh`` with more than one device and not already
    manual (:func:`axis_size`)."""
    return tuple(a for a in TOKEN_AXES if axis_size(mesh, a) > 1)


def token_shards(mesh) -> int:
    """How many ways ``mesh`` splits the tokens: the product of :func:`token_axes`' sizes (1
    without a mesh or token axes)."""
    return math.prod(axis_size(mesh, a) for a in token_axes(mesh))


def explicit_sharding(x: jax.Array):
    """``x``'s sharding when it is typed under an Explicit-mode mesh (the layers and the
    reference lowering must then name output shardings themselves), else ``None``."""
    sh = getattr(jax.typeof(x), "sharding", None)
    if sh is None or sh.mesh.empty or not sh.mesh.are_all_axes_explicit:
        return None
    return sh


FSDP_SPLITS = ("width", "features")
# Which dimension of each weight FSDP splits (the option mesh.fsdp_split). "width": the model
# width (``embed``; each 2-D weight's split then moves to its rows, beside a tensor split
# where there is one, sharding.rows_first), every weight gathered whole where a GEMM uses it
# (ZeRO-3). "features": the MLP, attention and vocabulary features, where plain JAX's
# largest-dimension placement puts them; every GEMM is then XLA ops left to the partitioner,
# which with few tokens in the FSDP group runs the MLP as tensor parallelism over the FSDP
# axis (gathering activations, not its weights). Features win with few tokens a step and lose
# with many; with the kernels split by tokens the features placement is slower (a gather
# along a weight's minor dimension costs transposes), so it always comes with the
# partitioner. coda_jax.partitioning.choose_fsdp_split picks by the tokens a step.


def fsdp_split_as(split: str | None):
    """The option ``mesh.fsdp_split`` set to ``split`` for the ``with`` block (``None``: left as
    it is). Set it before the state is sharded (:func:`coda_jax.sharding.shard_state`) and keep
    it while the step is traced: the placement and the GEMMs' partitioning rules follow it
    together."""
    return options(mesh=MeshOptions(fsdp_split=split))


def fsdp_split() -> str:
    """The FSDP split in force (the option ``mesh.fsdp_split``, see :data:`FSDP_SPLITS`)."""
    return current_options().mesh.fsdp_split


def fsdp_without_tensor(mesh) -> bool:
    """Whether ``mesh`` has an FSDP axis and no tensor axis: where the split can be the
    features (tensor parallelism keeps its own placement, :mod:`coda_jax.layers.tensor_parallel`)."""
    return mesh is not None and axis_size(mesh, FSDP_AXIS) > 1 and axis_size(mesh, TENSOR_AXIS) <= 1


def features_split(mesh) -> bool:
    """Whether the weights on ``mesh`` are split along their features: :func:`fsdp_split` is
    ``"features"`` on a mesh with an FSDP axis and no tensor axis."""
    return fsdp_without_tensor(mesh) and fsdp_split() == "features"


def fsdp_split_on(mesh) -> str:
    """The split the weights on ``mesh`` actually take: ``"features"`` where
    :func:`features_split`, else ``"width"``."""
    return "features" if features_split(mesh) else "width"
