"""``CuteDslLowering``: the ``"cutedsl"`` backend's GemmLowering (validation, padding, caching).

Shape rules (the same as the Pallas backend): M, N and K need not be tile multiples; the
wrapper zero-pads the operands and loads to multiples of the CTA tile (``128 x tile_n``,
``K`` to the K-tile: 64 for 16-bit operands, 128 for FP8) and slices the outputs, and the
kernel masks padded rows/columns out of row sums, column sums and log-sum-exps. Pair-mode
epilogues need N to be a multiple of ``2 * pair_block``. Operands must be bfloat16 or
float16, or FP8 (``float8_e4m3fn`` / ``float8_e5m2``, mixed allowed) as K-major ``a [M, K]``
and ``b [N, K]`` (:func:`fp8_rule`; other FP8 GEMMs run on XLA); float32 operands raise a
``TypeError`` that points at ``backend="xla"``. A quantizing output (``epilogue.fp8_out``)
returns its FP8 tile, its transposed copy ``{name}_t`` ``[N, M]`` and its amax partials
``{name}_amax`` (one float32 per ``128 x tile_n`` output tile; their max is the amax).

Plain GEMMs (the identity epilogue) go to XLA's GEMM (cuBLAS) by default, as on the Pallas
backend (:func:`coda_jax.lowering.routes_to_xla`, the option ``routing.plain_gemm``).

Tuning (tile width, pipeline depth, raster group, consumer schedule) is a
:class:`~coda_jax.ffi.tuning.CuteDslTuning` passed to the lowering; a variant runs under
:func:`coda_jax.backend.use_lowering`.

Kernels are built once per (epilogue, padded shapes, layouts, dtypes, tile config) and
cached here; ``cutlass_call`` then compiles each one once (``compile_key`` skips IR
regeneration on cache hits), so a training step does not recompile, and the compiled kernels
are kept on disk for later processes (:mod:`coda_jax.ffi.kernel_cache`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import FP8_DTYPES, Epilogue, LoadKind, OutputKind, default_out_dtype
from coda_jax.ffi.interpret import check_lowerable, trace_body
from coda_jax.ffi.kernel_cache import KEY_TAG, body_key
from coda_jax.ffi.kernel_cache import install as install_kernel_cache
from coda_jax.ffi.tuning import CuteDslTuning
from coda_jax.kernel_lowering import KernelLowering, pad_loads, pad_operands, slice_output
from coda_jax.lowering import gpu_sm_count, join_columns, split_columns, with_latency_hint

# Tile constants mirror coda_jax.ffi.kernel (kept importable without cutlass).
TILE_M = 128
TILE_K = 64  # 16-bit operands; FP8 operands: 128 (kernel.tile_k: 128 bytes per K-tile row)
K_TILE_BYTES = 128
MAX_TILE_N = 256


def _tile_k(itemsize: int) -> int:
    return K_TILE_BYTES // itemsize


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def pair_width_rule(width: int) -> str | None:
    """Why a pair-mode epilogue ``width = 2 * pair_block`` columns wide cannot run on the
    CuTeDSL kernel, or None."""
    if width > MAX_TILE_N or width % 8:
        return f"must be a multiple of 8 and at most {MAX_TILE_N} (the CuTeDSL kernel's widest tile)"
    return None


def fp8_rule(epilogue: Epilogue, a, b, transpose_a: bool, transpose_b: bool) -> str | None:
    """Why the CuTeDSL kernel cannot run this FP8 GEMM, or None where it can.

    FP8 operands (``float8_e4m3fn`` / ``float8_e5m2``, mixed allowed: wgmma's FP8 MMA takes
    either dtype for either operand) must both be K-major, as Hopper's FP8 wgmma reads them:
    ``a`` ``[M, K]`` (``transpose_a=False``) and ``b`` ``[N, K]`` (``transpose_b=True``), the
    layout :func:`coda_jax.ops.fp8_gemm.fp8_gemm` issues; the other three layouts would need a
    transposing copy of an operand and run on XLA. Quantizing outputs
    (:func:`coda_jax.epilogue.fp8_out`: the FP8 tile, its transposed copy, its amax partials)
    run on the kernel with any operands and in every epilogue mode (chunked, pair mode,
    ``half_acc``, staged or stored element by element), so they add no rule.
    """
    if a.dtype in FP8_DTYPES:
        if transpose_a or not transpose_b:
            got = f"a {'[K, M]' if transpose_a else '[M, K]'}, b {'[N, K]' if transpose_b else '[K, N]'}"
            return ("Hopper's FP8 wgmma reads both operands K-major: the CuTeDSL kernel takes FP8 a as [M, K] "
                    f"(transpose_a=False) and b as [N, K] (transpose_b=True), got {got}")
    return None


def _check_pair_width(epi: Epilogue) -> None:
    if epi.pair_block is None:
        return
    w = 2 * epi.pair_block
    if pair_width_rule(w):
        raise NotImplementedError(
            f"epilogue {epi.name!r}: pair_block={epi.pair_block} needs a 2*pair_block={w} column tile; the "
            f"CuTeDSL backend supports pair blocks that are multiples of 4 up to {MAX_TILE_N // 2}")


@functools.lru_cache(maxsize=256)
def _build(epi: Epilogue, plan):
    from coda_jax.ffi.kernel import build_launcher  # needs the optional cutlass package: imported on use

    shape = (TILE_M, epi.pair_block if epi.pair_block is not None else plan.tile_n)
    traced = trace_body(epi, shape, dict(plan.load_dtypes))
    check_lowerable(traced, f"epilogue {epi.name!r}")
    return build_launcher(epi, traced, plan), body_key(traced)


def _cutlass_call(launch, out_types, in_specs, out_specs, key):
    from cutlass.jax import cutlass_call  # optional package: imported on use

    install_kernel_cache()  # compiled kernels kept on disk across processes (coda_jax/ffi/kernel_cache.py)
    return cutlass_call(launch, output_shape_dtype=tuple(out_types), input_spec=tuple(in_specs),
                        output_spec=tuple(out_specs), compile_key=key)


class CuteDslLowering(KernelLowering):
    """Runs GEMM-epilogue programs as CuTeDSL Hopper kernels through XLA's FFI.

    Args:
      tuning: the kernel's :class:`~coda_jax.ffi.tuning.CuteDslTuning` (default: every choice
        left to the kernel's rules).
      plain_gemm, latency_hints, reserved_sms: see :class:`~coda_jax.kernel_lowering.KernelLowering`.
      fp8_kernel: run FP8 GEMMs (FP8 operands, quantizing outputs) on this kernel (the default);
        False hands every FP8 GEMM to XLA (cuBLASLt's FP8 GEMM, XLA epilogues).
    """

    name = "cutedsl"
    title = "CuTeDSL"

    def __init__(self, tuning: CuteDslTuning | None = None, *, plain_gemm: str | None = None,
                 latency_hints: bool = False, reserved_sms: int = 0, fp8_kernel: bool = True):
        super().__init__(plain_gemm=plain_gemm, latency_hints=latency_hints, reserved_sms=reserved_sms)
        # Its fused FP8 epilogues trail the Pallas kernel's, but a train step on them beats the
        # same step with every FP8 GEMM on XLA (docs/cutedsl.md#fp8): the kernel by default.
        self.fp8_kernel = bool(fp8_kernel)
        if tuning is not None and not isinstance(tuning, CuteDslTuning):
            raise TypeError(f"tuning must be a CuteDslTuning, got {type(tuning).__name__}")
        self.tuning = tuning or CuteDslTuning()

    def pair_width_rule(self, width: int) -> str | None:
        """See :func:`pair_width_rule`."""
        return pair_width_rule(width)

    def fp8_rule(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, transpose_a: bool,
                 transpose_b: bool) -> str | None:
        """See :meth:`coda_jax.kernel_lowering.KernelLowering.fp8_rule`: :func:`fp8_rule`; on a
        lowering built with ``fp8_kernel=False`` every FP8 GEMM runs on XLA."""
        if not self.fp8_kernel:
            return "this lowering was built with fp8_kernel=False: its FP8 GEMMs run on XLA (docs/cutedsl.md#fp8)"
        return fp8_rule(epilogue, a, b, transpose_a, transpose_b)

    def kernel_gemm(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, loads: Mapping[str, jax.Array],
                    dims: tuple[int, int, int], *, transpose_a: bool, transpose_b: bool,
                    out_dtypes: Mapping[str, Any] | None,
                    out_splits: dict[str, tuple[int, ...]], promote_k: int = 0) -> dict[str, Any]:
        """See :class:`coda_jax.lowering.GemmLowering`. ``out_splits``: the kernel writes one
        array per output and XLA slices it into the parts. ``promote_k`` (FP8 operands): the
        accumulator is added into a float32 register total every ``promote_k`` K elements
        (:func:`coda_jax.ffi.kernel.promotion_tiles`), on the cooperative schedule's narrow
        tile (the total doubles the accumulator's registers)."""
        # The optional cutlass package, and the kernel module that needs it: imported on use.
        from cutlass.jax import TensorSpec

        from coda_jax.ffi.kernel import (KernelPlan, choose_schedule, choose_tile_n, narrow_tile_n, plan_smem,
                                         promotion_tiles)

        m, n, k = dims
        tuning = self.tuning
        _check_pair_width(epilogue)
        loads = join_columns(loads)  # loads given as column parts: the kernel reads one array
        # A quantizing output is stored in its own FP8 dtype (as the reference stores it); an
        # unscaled one of FP8 operands in bf16 (default_out_dtype).
        dtypes = tuple((o.name, jnp.dtype(o.dtype) if o.quantize is not None else
                        jnp.dtype((out_dtypes or {}).get(o.name, o.dtype) or default_out_dtype(a.dtype)))
                       for o in epilogue.outputs)
        for o, (name, dt) in zip(epilogue.outputs, dtypes):
            if o.quantize is None and dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                                                 jnp.dtype(jnp.float32)):
                raise TypeError(f"epilogue {epilogue.name!r}: output {name!r} dtype {dt} is not bf16/f16/f32 "
                                "(give its dtype in out_dtypes; FP8 outputs are declared with epilogue.fp8_out)")
        op_dt, b_dt = jnp.dtype(a.dtype), jnp.dtype(b.dtype)
        itemsize = op_dt.itemsize
        sms = self.grid_sms(gpu_sm_count())
        every = promotion_tiles(promote_k, itemsize)
        pingpong = not every and choose_schedule(epilogue, tuning.schedule)
        if every:  # two 128 x 128 accumulators a consumer thread pair: the narrow tile
            tn = narrow_tile_n(epilogue)
        else:
            tn = 128 if pingpong else choose_tile_n(epilogue, m, n, itemsize, dtypes, sms, tuning.tile_n)
        mp, np_, kp = _round_up(m, TILE_M), _round_up(n, tn), _round_up(k, _tile_k(itemsize))
        a_p, b_p = pad_operands(a, b, mp, np_, kp, transpose_a, transpose_b)
        args = [_kernel_load(epilogue, l, v) for l, v in zip(epilogue.loads, pad_loads(epilogue, loads, m, n, mp, np_))]
        load_dtypes = tuple((l.name, jnp.dtype(v.dtype)) for l, v in zip(epilogue.loads, args))
        stages, stage_outputs = plan_smem(epilogue, tn, itemsize, dtypes, pingpong)
        stages = min(stages, tuning.max_stages or stages)
        plan = KernelPlan(m=mp, n=np_, k=kp, m_real=m, n_real=n, tile_n=tn, stages=stages,
                          sms=sms, stage_outputs=stage_outputs, transpose_a=transpose_a, transpose_b=transpose_b,
                          operand_dtype=op_dt, load_dtypes=load_dtypes, out_dtypes=dtypes,
                          pingpong=pingpong, b_dtype=None if b_dt == op_dt else b_dt, promote_every=every,
                          **({"group_m": tuning.group_m} if tuning.group_m else {}))
        launch, body = _build(epilogue, plan)
        out_types = []  # one per result (Epilogue.result_names)
        for o in epilogue.outputs:
            if o.kind is OutputKind.TILE:
                w = epilogue.width(np_, o.half)
                out_types.append(jax.ShapeDtypeStruct((mp, w), dict(dtypes)[o.name]))
                if o.quantize is not None and o.quantize.transpose:  # {name}_t
                    out_types.append(jax.ShapeDtypeStruct((w, mp), dict(dtypes)[o.name]))
                if o.quantize is not None and o.quantize.amax:  # {name}_amax: one partial per tile
                    out_types.append(jax.ShapeDtypeStruct(((mp // TILE_M) * (np_ // tn),), jnp.float32))
            elif o.kind is OutputKind.COL_SUM:
                out_types.append(jax.ShapeDtypeStruct((mp // TILE_M, np_), jnp.float32))
            else:
                out_types.append(jax.ShapeDtypeStruct((np_ // tn, mp), jnp.float32))
        # Logical operand modes: a as (M, K), b as (N, K), whatever the physical layout.
        in_specs = [TensorSpec(static=True, mode=(1, 0) if transpose_a else None),
                    TensorSpec(static=True, mode=None if transpose_b else (1, 0))]
        in_specs += [TensorSpec(static=True) for _ in args]
        out_specs = [TensorSpec(static=True) for _ in out_types]
        call = _cutlass_call(launch, out_types, in_specs, out_specs, (KEY_TAG, epilogue, plan, body))
        if (hint := self.latency_hint(mp, np_, kp, (a_p, b_p, *args, *out_types))) is not None:
            call = with_latency_hint(call, hint)  # XLA's scheduler is told what the kernel costs
        res = dict(zip(epilogue.result_names(), call(a_p, b_p, *args)))
        out = {}
        for o in epilogue.outputs:
            out[o.name] = slice_output(epilogue, o.name, res[o.name], m, n)
            if f"{o.name}_t" in res:
                out[f"{o.name}_t"] = res[f"{o.name}_t"][: epilogue.width(n, o.half), :m]
            if f"{o.name}_amax" in res:
                out[f"{o.name}_amax"] = res[f"{o.name}_amax"]
        return split_columns(out, out_splits)


def _kernel_load(epilogue: Epilogue, load, v: jax.Array) -> jax.Array:
    """A padded load as the CuTeDSL kernel takes it: scalars as ``[1]``; floating tile and
    row-block loads in their 16/32-bit dtype, other floating loads in float32; integer and
    boolean loads as int32."""
    if load.kind is LoadKind.SCALAR:
        v = v.reshape(1)
    if jnp.issubdtype(v.dtype, jnp.floating):
        if load.kind not in (LoadKind.TILE, LoadKind.ROW_BLOCK) or v.dtype not in (
                jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
            v = v.astype(jnp.float32)
    elif v.dtype == jnp.dtype(jnp.bool_) or jnp.issubdtype(v.dtype, jnp.integer):
        v = v.astype(jnp.int32)
    else:
        raise TypeError(f"epilogue {epilogue.name!r}: load {load.name!r} has unsupported dtype {v.dtype}")
    return v


CUTEDSL = CuteDslLowering()
