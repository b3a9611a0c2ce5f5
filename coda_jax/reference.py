"""The reference ("xla") lowering: epilogue bodies run on whole arrays with ``jnp``.

The GEMM is one ``jnp.dot`` with float32 accumulation; the body then sees the whole
``[M, N]`` accumulator as its "tile". :data:`REFERENCE` keeps that accumulator in float32
(the exact math the kernels are tested against). The ``"xla"`` backend's lowering
(:func:`xla_backend_lowering`) by default has cuBLAS round it to the 16-bit operand dtype as
it writes it, as a plain JAX model's ``x @ w`` does: the accumulator crosses HBM in half the
bytes, and the body upcasts it to float32. Epilogues with an online log-sum-exp are run in
column chunks under ``lax.scan``, so the full ``[M, N]`` logits never exist at once:
that is the stateful transform, carried across chunks as (running max, running sum).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from coda_jax.epilogue import FP8_DTYPES, Epilogue, LoadKind, Output, OutputKind, default_out_dtype, saturate_cast
from coda_jax.lowering import check_out_splits, check_promote_k, is_scaled_fp8_gemm, join_columns, split_columns
from coda_jax.mesh_axes import explicit_sharding
from coda_jax.options import current_options

# Column chunk of the reference's online log-sum-exp (the largest logits block alive).
LSE_CHUNK = 8192


def _dot(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool, round_acc: bool = False,
         promote: bool = False) -> jax.Array:
    """float32 ``op(a) @ op(b)``; full float32 precision for float32 operands, unless the
    caller chose one with ``jax.default_matmul_precision`` (e.g. ``"tensorfloat32"``), which
    then applies as to any JAX GEMM. With ``round_acc`` and 16-bit operands, the product is
    written in the operand dtype (float32 accumulation inside the GEMM, one rounding on the way
    out) and upcast after. ``promote`` (FP8 operands): at ``Precision.HIGHEST``, no fast
    accumulation."""
    ca = 0 if transpose_a else 1
    cb = 1 if transpose_b else 0
    full_f32 = a.dtype == jnp.float32 and jax.config.jax_default_matmul_precision is None
    precision = lax.Precision.HIGHEST if full_f32 or promote else None
    if a.dtype in FP8_DTYPES:  # an FP8 GEMM (cuBLASLt's on a GPU), scaled by the body afterwards
        out_dtype = jnp.bfloat16 if round_acc else jnp.float32
    else:
        out_dtype = a.dtype if round_acc and jnp.dtype(a.dtype).itemsize == 2 and a.dtype == b.dtype else jnp.float32
    out = lax.dot_general(
        a, b, (((ca,), (cb,)), ((), ())), precision=precision, preferred_element_type=out_dtype,
        out_sharding=_contracted_out_sharding(a, b, ca, cb),
    )
    return out.astype(jnp.float32)


def _scaled_fp8_dot(a: jax.Array, b: jax.Array, scale: jax.Array, transpose_a: bool, transpose_b: bool,
                    out_dtype: Any, promote: bool) -> jax.Array:
    """``(op(a) @ op(b)) * scale`` of FP8 operands written in the 16-bit ``out_dtype``: the dot
    writes ``out_dtype`` and the scalar multiplies its output, the form XLA's GEMM rewriter
    turns into one cuBLASLt FP8 GEMM with ``scale`` as its ``alpha`` (a float32 product scaled
    afterwards is a pass over ``[M, N]`` float32 of its own: docs/performance.md#routing).
    The recipes' scales are powers of two (:func:`coda_jax.fp8.scale_from_history`), so
    ``scale`` is exact in ``out_dtype`` and the product is rounded once, as the exact path
    rounds it; another scale is rounded to ``out_dtype`` first (and on the CPU the product
    twice). ``promote``: at ``Precision.HIGHEST``, no fast accumulation."""
    ca, cb = (0 if transpose_a else 1), (1 if transpose_b else 0)
    out = lax.dot_general(a, b, (((ca,), (cb,)), ((), ())),
                          precision=lax.Precision.HIGHEST if promote else None, preferred_element_type=out_dtype,
                          out_sharding=_contracted_out_sharding(a, b, ca, cb))
    return out * jnp.asarray(scale).astype(out_dtype)


def _contracted_out_sharding(a: jax.Array, b: jax.Array, ca: int, cb: int):
    """Under an Explicit-mode mesh, a GEMM that contracts a sharded axis (a wgrad over
    sharded tokens) must name its output sharding: the operands' free axes keep theirs
    (the partial sums are reduced across the contracted axis's devices). ``None`` otherwise."""
    sa, sb = explicit_sharding(a), explicit_sharding(b)
    if sa is None or sb is None:
        return None
    spec_a, spec_b = tuple(sa.spec) + (None,) * 2, tuple(sb.spec) + (None,) * 2
    if spec_a[ca] is None and spec_b[cb] is None:
        return None
    return jax.sharding.NamedSharding(sa.mesh, jax.sharding.PartitionSpec(spec_a[1 - ca], spec_b[1 - cb]))


def quantize_tile(o: Output, v: jax.Array, scale: jax.Array) -> dict[str, jax.Array]:
    """A quantizing output's results from its float32 tile ``v`` ``[M, N]`` (see
    :class:`coda_jax.epilogue.Quantize`): ``saturate(v * scale)`` in ``o.dtype``, its
    transpose, and the amax as one partial ``[1]``."""
    v = v.astype(jnp.float32)
    q = saturate_cast(v, scale, o.dtype)
    res = {o.name: q}
    if o.quantize.transpose:
        res[f"{o.name}_t"] = q.T
    if o.quantize.amax:
        res[f"{o.name}_amax"] = jnp.max(jnp.abs(v))[None]
    return res


def _as_compute(v: jax.Array) -> jax.Array:
    return v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v


@dataclasses.dataclass(frozen=True)
class _WholeArrayContext:
    """EpilogueContext for whole arrays; ``col_offset`` is the chunk's first column."""

    n: int
    col_offset: Any = 0

    def row_sum(self, x: jax.Array) -> jax.Array:
        return jnp.sum(x, axis=-1, keepdims=True)

    def col_index(self) -> jax.Array:
        return (lax.broadcasted_iota(jnp.int32, (1, self.n), 1) + self.col_offset).astype(jnp.int32)


# Pair mode on whole arrays: a width-N array is viewed as ``[..., C, 2, b]`` (C = N/(2b)
# pairs of b-column blocks). The body runs in that joined space: ``lo`` and ``hi`` are each
# broadcast along the pair axis to ``[..., C, 2, b]``, so every intermediate of the body has
# the shape of the tile it writes. A pair output ``(lo, hi)`` is then a select on the pair
# index, a row sum reduces over the same space, and XLA fuses the tile outputs and row sums
# of one epilogue into one pass over the operands. (With half-shaped intermediates, an
# intermediate feeding both halves of the joined tile is read twice per element; XLA does not
# fuse an expensive producer, such as the sigmoid of the SwiGLU backward, into such a
# consumer, and the float32 halves went through HBM.) The body's math is done twice per pair
# (once at each pair index), which costs nothing in a memory-bound pass.


def _pair_view(x: jax.Array, b: int) -> jax.Array:
    """``[..., N] -> [..., N/(2b), 2, b]``."""
    n = x.shape[-1]
    if n % (2 * b):
        raise ValueError(f"pair mode needs a width divisible by 2*{b}, got {n}")
    return x.reshape(x.shape[:-1] + (n // (2 * b), 2, b))


def _both(x: jax.Array) -> jax.Array:
    """``[..., C, 1, b]`` broadcast along the pair axis to ``[..., C, 2, b]``."""
    return jnp.broadcast_to(x, x.shape[:-2] + (2, x.shape[-1]))


def _split_pairs(x: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """``[..., N] -> (lo, hi)``, each ``[..., N/(2b), 2, b]`` (constant along the pair axis).

    Built from the pair view and its reverse along the pair axis (a select of the two), not
    as a broadcast of a slice: XLA's simplifier moves elementwise math above a broadcast,
    which would shrink the body back to half-shaped intermediates."""
    y = _pair_view(x, b)
    swapped = lax.rev(y, (y.ndim - 2,))
    first = _first_of_pair(y)
    return jnp.where(first, y, swapped), jnp.where(first, swapped, y)


def _split_half(x: jax.Array, b: int) -> jax.Array:
    """One value per pair: ``[..., N/2] -> [..., N/(2b), 2, b]`` (constant along the pair axis)."""
    return _both(x.reshape(x.shape[:-1] + (x.shape[-1] // b, 1, b)))


def _first_of_pair(like: jax.Array) -> jax.Array:
    """Boolean mask of the ``lo`` half of a ``[..., C, 2, b]`` array, sharded like ``like``
    under an Explicit-mode mesh (a select needs its mask sharded like its cases)."""
    iota = lax.broadcasted_iota(jnp.int32, like.shape, like.ndim - 2, out_sharding=explicit_sharding(like))
    return iota == 0


def _join_pairs(lo: jax.Array, hi: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``(lo, hi)`` -> ``shape = [M, C, 2, b]``, as an elementwise select on the pair index
    rather than a concatenation: XLA emits a loop fusion that writes the interleaved tile in
    one vectorized pass (a concatenate-rooted fusion of the same bytes runs far below HBM
    bandwidth: docs/performance.md#routing)."""
    lo, hi = jnp.broadcast_to(lo, shape), jnp.broadcast_to(hi, shape)
    return jnp.where(_first_of_pair(lo), lo, hi)


def _prepare_loads(epi: Epilogue, loads: Mapping[str, jax.Array]) -> dict[str, Any]:
    """Loads made broadcastable against the accumulator (or its pair halves)."""
    out = {}
    b = epi.pair_block
    for l in epi.loads:
        v = _as_compute(loads[l.name])
        if l.kind is LoadKind.SCALAR:
            out[l.name] = v
        elif b is None:
            out[l.name] = {LoadKind.ROW: lambda v: v[:, None], LoadKind.COL: lambda v: v[None, :],
                           LoadKind.TILE: lambda v: v}[l.kind](v)
        elif l.kind is LoadKind.ROW:
            out[l.name] = v[:, None, None, None]
        elif l.kind is LoadKind.ROW_BLOCK:
            out[l.name] = v[:, None, None, :]
        elif l.half:  # one value per pair (the accumulator's width when half_acc)
            out[l.name] = _split_half(v[None] if l.kind is LoadKind.COL else v, b)
        elif l.kind is LoadKind.COL:
            out[l.name] = _split_pairs(v[None], b)
        else:
            out[l.name] = _split_pairs(v, b)
    return out


def _pair_value(v: Any, shape: tuple[int, ...]) -> jax.Array:
    """A pair-mode body value over the joined ``shape = [M, C, 2, b]``: a ``(lo, hi)`` output
    joined; a single value (constant along the pair axis) counted once per pair, at ``lo``."""
    if isinstance(v, tuple):
        return _join_pairs(*v, shape)
    v = jnp.broadcast_to(v, shape)
    return jnp.where(_first_of_pair(v), v, 0.0)


def _half_tile(v: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A one-value-per-pair output ``[M, N/2]`` from a value constant along the pair axis."""
    v = jnp.broadcast_to(v, shape)[..., 0:1, :]
    return v.reshape(shape[0], -1)


class ReferenceLowering:
    """The ``"xla"`` backend's :class:`~coda_jax.lowering.GemmLowering`."""

    name = "xla"
    # The body runs on whole arrays after the GEMM: each output is a pass of XLA's own
    # (fused where XLA can), so ops choose formulations with fewer of them
    # (coda_jax.lowering.fuses_epilogues).
    fuses_epilogues = False

    def __init__(self, round_acc: bool = False):
        self.round_acc = round_acc

    def gemm(
        self,
        epilogue: Epilogue,
        a: jax.Array,
        b: jax.Array,
        loads: Mapping[str, jax.Array],
        *,
        transpose_a: bool = False,
        transpose_b: bool = False,
        out_dtypes: Mapping[str, Any] | None = None,
        out_splits: Mapping[str, tuple[int, ...]] | None = None,
        promote_k: int = 0,
    ) -> dict[str, Any]:
        """See :class:`~coda_jax.lowering.GemmLowering`. ``promote_k`` on FP8 operands: XLA's
        FP8 GEMM at ``Precision.HIGHEST``, which XLA runs as cuBLASLt's FP8 GEMM without fast
        accumulation (its own periodic float32 promotion; docs/fp8.md#accumulation)."""
        promote = bool(check_promote_k(promote_k)) and a.dtype in FP8_DTYPES
        m = a.shape[1] if transpose_a else a.shape[0]
        n = b.shape[0] if transpose_b else b.shape[1]
        epilogue.validate_loads(loads, m, n)
        loads = join_columns(loads)  # XLA fuses the concatenation into the body's fusion
        splits = check_out_splits(epilogue, out_splits, n)
        if splits:  # XLA fuses the slices into whatever reads the parts
            return split_columns(self.gemm(epilogue, a, b, loads, transpose_a=transpose_a, transpose_b=transpose_b,
                                           out_dtypes=out_dtypes, promote_k=promote_k), splits)
        dtypes = {o.name: (out_dtypes or {}).get(o.name, o.dtype) or default_out_dtype(a.dtype) for o in epilogue.outputs}
        if (any(o.kind is OutputKind.ROW_LOGSUMEXP for o in epilogue.outputs) and n > LSE_CHUNK
                and not any(o.kind is OutputKind.TILE for o in epilogue.outputs)):  # [M, N] is written anyway
            return self._chunked_rows(epilogue, a, b, loads, transpose_a, transpose_b, m, n)
        # A plain GEMM asked for a 16-bit product of 16-bit operands: the dot writes that dtype
        # itself (float32 accumulation, one rounding: the same values as rounding a float32
        # product). Then XLA moves, and the SPMD partitioner all-reduces for a wgrad over
        # split tokens, the bytes plain JAX's dot does; a float32 product was all-reduced in
        # float32, twice the bytes (the W_o / W_down / LM-head gradients:
        # docs/performance.md#multi-gpu).
        plain_16 = (epilogue.name == "identity" and a.dtype == b.dtype == jnp.dtype(dtypes["out"])
                    and jnp.dtype(a.dtype).itemsize == 2)
        if is_scaled_fp8_gemm(epilogue, a, dtypes):
            return {"out": _scaled_fp8_dot(a, b, loads["acc_scale"], transpose_a, transpose_b, dtypes["out"], promote)}
        acc = _dot(a, b, transpose_a, transpose_b, self.round_acc or plain_16, promote)
        res = self._run_body(epilogue, acc, _prepare_loads(epilogue, loads), n, 0)
        return self._finish(epilogue, res, m, n, dtypes, loads)

    def _run_body(self, epi: Epilogue, acc, prepared, n, col_offset):
        ctx = _WholeArrayContext(n, col_offset)
        if epi.half_acc:  # one column per pair: shaped like one pair half
            acc = _split_half(acc, epi.pair_block)
        elif epi.pair_block is not None:
            acc = _split_pairs(acc, epi.pair_block)
        res = dict(epi.body(acc, ctx, **prepared))
        if set(res) != {o.name for o in epi.outputs}:
            raise ValueError(f"epilogue {epi.name!r} body returned {sorted(res)}, declared {[o.name for o in epi.outputs]}")
        return res

    def _finish(self, epi: Epilogue, res, m, n, dtypes, loads):
        out = {}
        b = epi.pair_block
        # Pair mode: the joined [M, C, 2, b] space of the full-width tile (2n wide with half_acc).
        shape = None if b is None else (m, (2 * n if epi.half_acc else n) // (2 * b), 2, b)
        for o in epi.outputs:
            v = res[o.name]
            if o.kind is OutputKind.TILE:
                if shape is not None:
                    v = _half_tile(v, shape) if o.half else _pair_value(v, shape).reshape(m, -1)
                v = jnp.broadcast_to(v, (m,) + v.shape[1:])
                if o.quantize is not None:
                    out.update(quantize_tile(o, v, loads[o.quantize.scale]))
                else:
                    out[o.name] = v.astype(dtypes[o.name])
            elif o.kind is OutputKind.ROW_SUM:
                v = _pair_value(v, shape) if shape is not None else jnp.broadcast_to(v, (m,) + v.shape[1:])
                out[o.name] = v.reshape(m, -1).sum(axis=1)[None].astype(jnp.float32)
            elif o.kind is OutputKind.COL_SUM:
                if shape is None:
                    v = jnp.broadcast_to(v, (m,) + v.shape[1:])
                else:
                    v = _pair_value(v, shape) if isinstance(v, tuple) else _half_tile(v, shape)
                out[o.name] = v.reshape(m, -1).sum(axis=0)[None].astype(jnp.float32)
            else:  # ROW_LOGSUMEXP, unchunked
                out[o.name] = jax.nn.logsumexp(v, axis=-1)[None].astype(jnp.float32)
        return out

    def _chunked_rows(self, epi, a, b, loads, transpose_a, transpose_b, m, n):
        """Online (max, sum-exp) and row sums across column chunks; no [M, N] array."""
        if epi.pair_block is not None or any(
            o.kind not in (OutputKind.ROW_SUM, OutputKind.ROW_LOGSUMEXP) for o in epi.outputs
        ):
            raise NotImplementedError(
                f"epilogue {epi.name!r}: the reference chunks only epilogues whose outputs are row reductions"
            )
        chunk = LSE_CHUNK
        n_chunks = -(-n // chunk)
        pad = n_chunks * chunk - n
        col_loads = {l.name for l in epi.loads if l.kind in (LoadKind.COL, LoadKind.TILE)}
        if col_loads:
            raise NotImplementedError(f"epilogue {epi.name!r}: chunked reference takes only row/scalar loads")
        bp = jnp.pad(b, ((0, pad), (0, 0)) if transpose_b else ((0, 0), (0, pad)))
        prepared = _prepare_loads(epi, loads)
        lse_names = [o.name for o in epi.outputs if o.kind is OutputKind.ROW_LOGSUMEXP]
        sum_names = [o.name for o in epi.outputs if o.kind is OutputKind.ROW_SUM]

        def step(carry, i):
            mx, se, sums = carry
            start = i * chunk
            bc = (lax.dynamic_slice_in_dim(bp, start, chunk, axis=0) if transpose_b
                  else lax.dynamic_slice_in_dim(bp, start, chunk, axis=1))
            acc = _dot(a, bc, transpose_a, transpose_b, self.round_acc)
            res = self._run_body(epi, acc, prepared, chunk, start)
            valid = (lax.broadcasted_iota(jnp.int32, (1, chunk), 1) + start) < n
            new_mx, new_se = {}, {}
            for name in lse_names:
                v = jnp.where(valid, res[name], -jnp.inf)
                cm = jnp.maximum(mx[name], jnp.max(v, axis=1))
                new_se[name] = se[name] * jnp.exp(mx[name] - cm) + jnp.sum(jnp.exp(v - cm[:, None]), axis=1)
                new_mx[name] = cm
            new_sums = {name: sums[name] + jnp.sum(jnp.where(valid, res[name], 0.0), axis=1) for name in sum_names}
            return (new_mx, new_se, new_sums), None

        init = ({k: jnp.full((m,), -jnp.inf, jnp.float32) for k in lse_names},
                {k: jnp.zeros((m,), jnp.float32) for k in lse_names},
                {k: jnp.zeros((m,), jnp.float32) for k in sum_names})
        (mx, se, sums), _ = lax.scan(step, init, jnp.arange(n_chunks))
        out = {k: (mx[k] + jnp.log(se[k]))[None] for k in lse_names}
        out.update({k: v[None] for k, v in sums.items()})
        return out


REFERENCE = ReferenceLowering()
"""The exact reference: float32 accumulators end to end (what kernels are tested against)."""

def xla_backend_lowering() -> ReferenceLowering:
    """The ``"xla"`` backend's lowering: :data:`REFERENCE`'s math with the GEMM output
    rounded to the 16-bit operand dtype (the option ``xla.accumulate="operand"``, the
    default), or kept in float32 (``"float32"``: exact, slower). Read at trace time."""
    return REFERENCE if current_options().xla.accumulate == "float32" else _XLA_ROUNDED


_XLA_ROUNDED = ReferenceLowering(round_acc=True)
