"""SPMD partitioning of GEMM-epilogue programs: the kernel calls under a device mesh.

A kernel backend's GEMM is one opaque custom call (a Mosaic GPU kernel, a CuTeDSL FFI call):
XLA's SPMD partitioner cannot split it, so without rules it gathers every operand and each
device computes the whole problem. :class:`PartitionedLowering` wraps a backend's
:class:`~coda_jax.lowering.GemmLowering` at the one seam every op goes through and runs the
kernel under :func:`jax.shard_map` over the context mesh (``jax.set_mesh``), with
shardings derived from the epilogue declaration:

* **Tokens are rows** (``a [M, K]``, ``M`` = tokens): ``a``, row loads ``[M]``, row-block
  loads ``[M, b]`` and tile loads / outputs ``[M, N]`` are split over the token axes; column
  loads ``[N]`` and the weight ``b`` are replicated (under FSDP the partitioner gathers the
  weight before the call: ZeRO-3's per-layer gather). Row reductions (``row_sum``,
  ``row_logsumexp``, ``[P, M]`` partials) stay split along ``M``; column sums (``[P, N]``
  partials, one row per M-tile) from every shard are concatenated along ``P``, so the op's
  ``sum(axis=0)`` adds the shards' partials: nothing is reduced across devices inside the call.
* **Tokens are contracted** (``transpose_a``: ``a [K, M]`` with ``K`` = tokens, the wgrad
  GEMMs; or ``contracts_tokens``: ``a [M, K]`` and ``b [N, K]``, the FP8 wgrads' K-major
  operands): each shard's accumulator is a partial sum over its tokens. An epilogue declared
  ``linear`` (its outputs are linear in ``acc``: ``body(acc1 + acc2) = body(acc1) +
  body(acc2)``, e.g. ``dW = gamma * acc``) runs on the partial accumulator; the shards'
  outputs leave the ``shard_map`` stacked along a shard axis and are summed outside it, so
  XLA picks the collective (all-reduce, or reduce-scatter into an FSDP-split gradient) and
  schedules it with the other gradients'. The partials are summed in the dtype the op asked
  for (a bfloat16 weight gradient is all-reduced in bfloat16, as XLA's partitioner does for
  plain JAX's wgrad dots: half the bytes of float32); reductions (``row_sum``,
  ``col_sum``) stay float32. :func:`partial_sum_dtype` says which, and the option
  ``mesh.partial_sums="float32"`` sums every partial in float32. Any other epilogue is
  not partitioned: the partitioner gathers its operands (correct, not fast).

Which mesh axes shard tokens: :data:`TOKEN_AXES` (``("data", "fsdp")``), those present in
the context mesh with size > 1; :func:`set_token_axes` changes them (both kept in
:mod:`coda_jax.mesh_axes`, with the context mesh and the FSDP split). Without a context mesh,
or when the token count is not a multiple of the token axes' size, the kernel runs
unpartitioned (logged once).

GEMMs that are ordinary XLA ops (every GEMM of the ``"xla"`` backend; the plain GEMMs that
the kernel backends route to XLA's dot) follow the same rules when the mesh splits the
parameters (an :data:`FSDP_AXIS` among the token axes). Left to the partitioner there, they
gather activations instead of the weight, which is slow. With few tokens a device
(:func:`fsdp_xla_tokens_below`) that is the faster choice: there every GEMM, a kernel
backend's too, runs as XLA ops left to it. With a middling number
(:func:`fsdp_xla_gemms_below`) a kernel backend's GEMMs run as XLA ops split by tokens, as
the ``xla`` backend's do, since XLA overlaps the weight gathers with those and not with the
kernels. With the weights split along their features (the option ``mesh.fsdp_split``,
``"features"``), every GEMM is left to the partitioner. With the weights whole (data parallel)
the partitioner splits them by tokens itself. ``docs/multi_gpu.md`` has the rules per op and
docs/performance.md#fsdp-split the measurements behind them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from coda_jax import mesh_axes
from coda_jax.epilogue import FP8_DTYPES, Epilogue, LoadKind, OutputKind, default_out_dtype
from coda_jax.log import log_once
from coda_jax.lowering import PLAIN_PROGRAMS, GemmLowering, gemm_dims, routes_to_xla
# The mesh axes, the context mesh and the FSDP split live in coda_jax.mesh_axes (read by
# coda_jax.sharding too); they stay importable from here.
from coda_jax.mesh_axes import (FSDP_AXIS, FSDP_SPLITS, axis_size, context_mesh, features_split,  # noqa: F401
                                fsdp_split, fsdp_split_as, fsdp_split_on, fsdp_without_tensor, set_token_axes,
                                token_axes, token_shards)
from coda_jax.options import current_options, is_set
from coda_jax.reference import xla_backend_lowering


def __getattr__(name: str):
    # TOKEN_AXES is rebound by set_token_axes: read it where it lives, not as a copy.
    if name == "TOKEN_AXES":
        return mesh_axes.TOKEN_AXES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def fsdp_xla_tokens_below() -> int:
    """Tokens a device below which, under FSDP, every GEMM runs as XLA ops left to XLA's
    partitioner: the option ``mesh.fsdp_xla_tokens_below``. With few tokens the partitioner
    gathers the activations and leaves each weight shard in place, as it does for plain JAX,
    which beats gathering the weights (docs/performance.md#fsdp-split)."""
    return current_options().mesh.fsdp_xla_tokens_below


# choose_fsdp_split (the splits: coda_jax.mesh_axes.FSDP_SPLITS): "features" while each FSDP
# group's tokens a step (tokens a device times the FSDP axis size) are at most this fraction of
# a block's weight elements over the width (LlamaConfig.block_weights_per_width): the group's
# activations [tokens, d] against a block's weights (the crossover measured at the 1B and 8B
# widths: docs/performance.md#fsdp-split). Without the model's sizes: the 1B bound,
# FEATURES_SPLIT_MAX_GROUP_TOKENS.
FEATURES_SPLIT_WEIGHT_FRACTION = 0.21
FEATURES_SPLIT_MAX_GROUP_TOKENS = 6144


def choose_fsdp_split(mesh, tokens_per_step: int, block_weights_per_width: int | None = None) -> str:
    """The faster FSDP split for a step of ``tokens_per_step`` tokens (the global batch) on
    ``mesh``: ``"features"`` when each FSDP group (the devices of one data shard) holds at
    most :data:`FEATURES_SPLIT_WEIGHT_FRACTION` of ``block_weights_per_width`` tokens (a
    block's weight elements over the width, ``LlamaConfig.block_weights_per_width``; without
    it :data:`FEATURES_SPLIT_MAX_GROUP_TOKENS`, the 1B model's bound), on an Auto mesh with an
    FSDP axis and no tensor axis, or where each device holds fewer tokens than
    :func:`fsdp_xla_tokens_below` (every GEMM is then left to the partitioner on either
    split, and the features placement is the one made for it); else ``"width"``. (On an
    Explicit mesh the layers gather every weight themselves, so the partitioner has no
    choice to make.)"""
    if not fsdp_without_tensor(mesh) or getattr(mesh, "are_all_axes_explicit", False):
        return "width"
    group_tokens = tokens_per_step // max(1, axis_size(mesh, "data"))
    if group_tokens // axis_size(mesh, FSDP_AXIS) < fsdp_xla_tokens_below():
        return "features"
    bound = (FEATURES_SPLIT_MAX_GROUP_TOKENS if block_weights_per_width is None
             else FEATURES_SPLIT_WEIGHT_FRACTION * block_weights_per_width)
    return "features" if group_tokens <= bound else "width"


def auto_fsdp_split(mesh, tokens_per_step: int, block_weights_per_width: int | None = None) -> str | None:
    """What ``fsdp_split="auto"`` sets (:func:`fsdp_split_as`): ``None`` where the option
    ``mesh.fsdp_split`` is already set (a context, the process), else :func:`choose_fsdp_split`."""
    if is_set("mesh.fsdp_split"):
        return None
    return choose_fsdp_split(mesh, tokens_per_step, block_weights_per_width)


def _few_fsdp_tokens(axes: tuple[str, ...], shards: int, tokens: int) -> bool:
    """Whether the token axes ``axes`` (``shards`` devices in all) include FSDP's and leave
    every GEMM to the partitioner: the weights split along their features
    (:func:`features_split`), or fewer than :func:`fsdp_xla_tokens_below` tokens a device."""
    return FSDP_AXIS in axes and (features_split(context_mesh()) or tokens // shards < fsdp_xla_tokens_below())


def fsdp_xla_gemms_below() -> int:
    """Tokens a device below which, under FSDP, a kernel backend's GEMMs run on the ``xla``
    backend's lowering (XLA's GEMM and fusions of the same epilogue bodies), still split by
    tokens with the weight gathered: the option ``mesh.fsdp_xla_gemms_below``. XLA's scheduler
    overlaps the weight all-gathers and gradient reduce-scatters with its own GEMMs and
    fusions, not with the kernels, and with fewer tokens a device those collectives are a
    larger part of the step (docs/performance.md#fsdp-split)."""
    return current_options().mesh.fsdp_xla_gemms_below


def partial_sum_dtype(out_dtype) -> jnp.dtype:
    """The dtype in which the shards' partial sums of a token-contracting GEMM output leave
    the kernel and are summed across devices.

    ``out_dtype`` (what the op asked for: a bfloat16 weight gradient is all-reduced in
    bfloat16, which is what XLA's partitioner does for a plain ``jnp.dot`` whose contracted
    dimension is sharded, so the kernel backends move the bytes plain JAX moves), unless the
    option ``mesh.partial_sums`` is ``"float32"`` (every partial summed in float32: twice the
    bytes, one rounding at the end). Float32 outputs (the reductions) stay float32.
    """
    choice = current_options().mesh.partial_sums
    return jnp.dtype(jnp.float32 if choice == "float32" else out_dtype)


def _sum_shards(v: jax.Array) -> jax.Array:
    """Sum over the leading shard axis in ``v``'s own dtype (``jnp.sum`` would upcast a
    16-bit array to float32 first, and the all-reduce would then move float32). The
    concrete (NumPy) zero makes this a ``reduce_sum``: with a traced one, an Explicit mesh
    puts a sharding constraint inside the reduction's body, which XLA's CPU compiler
    rejects."""
    return lax.reduce(v, np.zeros((), v.dtype), lax.add, (0,))


def _warn_once(key: str, msg: str) -> None:
    log_once(("partitioning", key), logging.WARNING, "%s", msg)


def _row_specs(epi: Epilogue, tok) -> tuple[dict[str, P], dict[str, P]]:
    """(load specs, output specs) when rows (M) are tokens split over ``tok``."""
    load = {LoadKind.ROW: P(tok), LoadKind.ROW_BLOCK: P(tok, None), LoadKind.TILE: P(tok, None),
            LoadKind.COL: P(None), LoadKind.SCALAR: P()}
    out = {OutputKind.TILE: P(tok, None), OutputKind.ROW_SUM: P(None, tok),
           OutputKind.ROW_LOGSUMEXP: P(None, tok), OutputKind.COL_SUM: P(tok, None)}
    specs = {o.name: out[o.kind] for o in epi.outputs}
    for o in epi.outputs:  # a quantizing output's transposed copy [N, M] and amax partials [P]
        if o.quantize is not None:
            specs.update({r: P(None, tok) if r.endswith("_t") else P(tok) for r in o.result_names()[1:]})
    return {l.name: load[l.kind] for l in epi.loads}, specs


class PartitionedLowering:
    """A backend's :class:`GemmLowering`, partitioned over the context mesh.

    Its :meth:`gemm` also takes ``contracts_tokens`` (callers check :attr:`splits_tokens`
    first): the FP8 wgrads read both operands K-major (``a [M, K]``, ``b [N, K]``), so their
    tokens are ``K``, the second dimension of each, and nothing in the shapes says so."""

    splits_tokens = True

    def __init__(self, inner: GemmLowering):
        self.inner = inner
        self.name = inner.name

    def gemm(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, loads: Mapping[str, jax.Array], *,
             transpose_a: bool = False, transpose_b: bool = False,
             out_dtypes: Mapping[str, Any] | None = None,
             out_splits: Mapping[str, tuple[int, ...]] | None = None, promote_k: int = 0,
             contracts_tokens: bool = False, replicated: bool = False) -> dict[str, Any]:
        """The inner lowering's ``gemm`` under the context mesh. ``contracts_tokens``: ``a
        [M, K]`` and ``b [N, K]`` (``transpose_b``) contract the tokens (``K``), as a wgrad's
        K-major FP8 operands do; otherwise the tokens are ``a``'s rows (``a [M, K]``) or, with
        ``transpose_a``, its contracted rows (``a [K, M]``). ``replicated``: no dimension is
        tokens (a replicated weight's quantizing pass): every device runs the whole call on
        its own copy of every operand (a ``shard_map`` with nothing split), as XLA's
        partitioner runs plain JAX's weight casts."""
        if contracts_tokens and (transpose_a or not transpose_b):
            raise ValueError("contracts_tokens: a [M, K] and b [N, K] (transpose_b=True, transpose_a=False), got "
                             f"transpose_a={transpose_a}, transpose_b={transpose_b}")
        kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, out_dtypes=out_dtypes, out_splits=out_splits)
        if promote_k:  # only when asked: a lowering written before promote_k existed runs the rest
            kw["promote_k"] = promote_k
        # A split output's spec: one per part (the parts are its column ranges: split as it is).
        split_specs = lambda specs: {k: (v,) * len(out_splits[k]) if k in (out_splits or {}) else v  # noqa: E731
                                     for k, v in specs.items()}
        mesh = context_mesh()
        axes = token_axes(mesh)
        if not axes:
            return self.inner.gemm(epilogue, a, b, loads, **kw)
        if replicated:
            args = (a, b, dict(loads))
            return shard_map_over(mesh, lambda a, b, l: self.inner.gemm(epilogue, a, b, l, **kw),
                                  jax.tree.map(lambda _: P(), args), P(), *args)
        shards = token_shards(mesh)
        tokens = a.shape[1] if contracts_tokens else a.shape[0]  # else a's first dimension in both layouts
        inner = self._lowering_at(axes, shards, tokens)
        if _few_fsdp_tokens(axes, shards, tokens):
            # FSDP with few tokens a device: every GEMM as XLA ops (a kernel backend's fused
            # programs on the `xla` backend's lowering), left to the partitioner, which gathers
            # the activations and leaves each weight shard in place (fsdp_xla_tokens_below).
            return inner.gemm(epilogue, a, b, loads, **kw)
        if a.dtype in FP8_DTYPES and self._xla_ops(epilogue, a, b, transpose_a, transpose_b):
            # An FP8 GEMM (K-major operands: a wgrad's tokens are the contracted dimension of
            # both) that runs as XLA ops: XLA's partitioner splits it by the operands' own
            # shardings, contracting split tokens into partial sums it reduces.
            return inner.gemm(epilogue, a, b, loads, **kw)
        if FSDP_AXIS not in axes and self._xla_ops(epilogue, a, b, transpose_a, transpose_b):
            # XLA ops with the weights whole (data parallel), which the partitioner splits by
            # tokens itself, as fast as plain JAX's step.
            return inner.gemm(epilogue, a, b, loads, **kw)
        tok = axes if len(axes) > 1 else axes[0]
        if tokens % shards:
            _warn_once(f"ragged:{epilogue.name}",
                       f"coda-jax: {tokens} tokens do not split evenly over mesh axes {axes} "
                       f"({shards} shards): epilogue {epilogue.name!r} runs unpartitioned (operands gathered)")
            return inner.gemm(epilogue, a, b, loads, **kw)
        loads = dict(loads)
        # A load given as column parts: one spec per part (each split as the whole load is).
        part_specs = lambda specs: {k: (v,) * len(loads[k]) if isinstance(loads[k], (tuple, list)) else v  # noqa: E731
                                    for k, v in specs.items()}
        loads = {k: tuple(v) if isinstance(v, list) else v for k, v in loads.items()}
        if not transpose_a and not contracts_tokens:
            load_specs, out_specs = _row_specs(epilogue, tok)
            load_specs, out_specs = part_specs(load_specs), split_specs(out_specs)
            body = lambda a, b, l: inner.gemm(epilogue, a, b, l, **kw)  # noqa: E731
            in_specs = (P(tok, None), P(None, None), load_specs)
        else:
            if not epilogue.linear:
                _warn_once(f"contract:{epilogue.name}",
                           f"coda-jax: epilogue {epilogue.name!r} contracts the sharded token axis and is not "
                           "declared linear in acc: it runs unpartitioned (operands gathered)")
                return inner.gemm(epilogue, a, b, loads, **kw)
            dtypes = {o.name: jnp.dtype((out_dtypes or {}).get(o.name) or o.dtype or default_out_dtype(a.dtype)) for o in epilogue.outputs}
            partial = {name: partial_sum_dtype(dt) for name, dt in dtypes.items()}

            def body(a, b, l):  # this shard's partial sums, stacked along a new leading shard axis
                outs = inner.gemm(epilogue, a, b, l, **{**kw, "out_dtypes": partial})
                return jax.tree.map(lambda v: v[None], outs)

            # the tokens: a [K, M]'s rows (transpose_a) or a [M, K]'s columns (contracts_tokens);
            # b [K, N]'s rows or b [N, K]'s columns (transpose_b)
            in_specs = (P(None, tok) if contracts_tokens else P(tok, None),
                        P(None, tok) if transpose_b else P(tok, None), part_specs({name: P() for name in loads}))
            out_specs = split_specs({o.name: P(tok, None, None) for o in epilogue.outputs})
            partials = shard_map_over(mesh, body, in_specs, out_specs, a, b, loads)
            # The sum over shards is left to XLA (an all-reduce, or a reduce-scatter where the
            # gradient is FSDP-split), which it can schedule and combine with the other gradients'.
            return {k: jax.tree.map(lambda v, k=k: _sum_shards(v).astype(dtypes[k]), v) for k, v in partials.items()}
        return shard_map_over(mesh, body, in_specs, out_specs, a, b, loads)

    def fuses_at(self, epilogue: Epilogue, m: int, n: int, k: int) -> bool:
        """The backend's :func:`~coda_jax.lowering.fuses_epilogue_at` for each device's rows:
        ``m`` tokens split over the mesh's token axes (all ``m`` where they do not split
        evenly, as :meth:`gemm` then runs the GEMM unpartitioned)."""
        mesh = context_mesh()
        axes = token_axes(mesh)
        shards = token_shards(mesh)
        if self._lowering_at(axes, shards, m) is not self.inner:  # the `xla` lowering (see gemm)
            return False
        if shards > 1 and m % shards == 0:
            m //= shards
        rule = getattr(self.inner, "fuses_at", None)
        return True if rule is None else bool(rule(epilogue, m, n, k))

    def _lowering_at(self, axes: tuple[str, ...], shards: int, tokens: int) -> GemmLowering:
        """The lowering that runs a GEMM of ``tokens`` rows split over ``axes`` (``shards``
        devices): the backend's own, or under FSDP with fewer tokens a device than
        :func:`fsdp_xla_tokens_below` or :func:`fsdp_xla_gemms_below`, a kernel backend's
        GEMMs on the ``xla`` backend's lowering."""
        if self.inner.name == "xla" or FSDP_AXIS not in axes:
            return self.inner
        if _few_fsdp_tokens(axes, shards, tokens) or tokens // shards < fsdp_xla_gemms_below():
            return xla_backend_lowering()
        return self.inner

    def _xla_ops(self, epilogue: Epilogue, a, b, transpose_a: bool, transpose_b: bool) -> bool:
        """Whether this GEMM runs as ordinary XLA ops (the ``xla`` backend; a kernel backend's
        plain GEMMs and the programs it routes to XLA by name), not as an opaque kernel. A
        program handed to XLA for its small output (:func:`~coda_jax.lowering.xla_output_below`)
        takes the kernel's path here: that rule is about each device's shard, and the backend's
        lowering applies it there, inside the ``shard_map`` (left to XLA's partitioner, the
        reference formulation of the wgrad programs gathered the tokens, 8 CPU devices). So do
        the plain FP8 GEMMs a kernel backend hands to cuBLASLt (``routing.plain_gemm``): each
        device runs its own on its tokens; left to the partitioner, the wgrads' K-major
        operands were gathered along the tokens (8 CPU devices)."""
        if self.inner.name == "xla":
            return True
        if a.dtype in FP8_DTYPES and epilogue.name in PLAIN_PROGRAMS:
            return False
        fp8_rule = getattr(self.inner, "fp8_rule", None)  # a lowering without one runs FP8 GEMMs itself
        if (a.dtype in FP8_DTYPES or epilogue.quantizes) and fp8_rule is not None and fp8_rule(
                epilogue, a, b, transpose_a, transpose_b) is not None:
            return True  # the backend hands its FP8 GEMMs of this kind to XLA
        m, n, k = gemm_dims(a, b, transpose_a, transpose_b)
        return routes_to_xla(self.inner.name, epilogue, m, n, k, getattr(self.inner, "plain_gemm", None),
                             by_size=False)


def shard_map_over(mesh, body, in_specs, out_specs, *args):
    """``jax.shard_map(body)(*args)`` over every axis of ``mesh``, in Auto and Explicit mode.

    ``check_vma=False``: the kernels (custom calls) carry no varying-axes types. Its
    transpose then sums an input's cotangent over the axes its spec does not name (a
    replicated weight's gradient is the sum of the shards' partials) and divides a
    replicated output's cotangent by their size, so gradients stay exact."""
    if mesh.are_all_axes_explicit:  # shard_map takes arrays already split as in_specs say
        args = jax.tree.map(jax.sharding.reshard, args, in_specs)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
