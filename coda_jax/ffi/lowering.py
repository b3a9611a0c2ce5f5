"""``CuteDslLowering``: the ``"cutedsl"`` backend's GemmLowering (validation, padding, caching).

Shape rules (the same as the Pallas backend): M, N and K need not be tile multiples; the
wrapper zero-pads the operands and loads to multiples of the CTA tile (``128 x tile_n``,
``K`` to 64) and slices the outputs, and the kernel masks padded rows/columns out of row
sums, column sums and log-sum-exps. Pair-mode epilogues need N to be a multiple of
``2 * pair_block``. Operands must be bfloat16 or float16; float32 operands raise a
``TypeError`` that points at ``backend="xla"``.

Plain GEMMs (the identity epilogue) go to XLA's GEMM (cuBLAS) by default, as on the Pallas
backend (:func:`coda_jax.lowering.plain_gemm_route`); ``plain_gemm="cutedsl"`` or
``CODA_JAX_CUTEDSL_PLAIN_GEMM=cutedsl`` runs them on this backend's kernel.

Tuning knobs, read when a call is traced: ``CODA_JAX_CUTEDSL_TILE_N=128|256`` forces the
CTA tile width where the program fits it (default: :func:`coda_jax.ffi.kernel.choose_tile_n`),
``CODA_JAX_CUTEDSL_MAX_STAGES=n`` caps the operand pipeline's depth,
``CODA_JAX_CUTEDSL_GROUP_M=n`` sets the raster group (tile rows), and
``CODA_JAX_CUTEDSL_SCHEDULE=cooperative|pingpong|auto`` picks the consumer schedule
(default ``auto``: :func:`coda_jax.ffi.kernel.choose_schedule`, cooperative for now).

Kernels are built once per (epilogue, padded shapes, layouts, dtypes, tile config) and
cached here; ``cutlass_call`` then compiles each one once (``compile_key`` skips IR
regeneration on cache hits), so a training step does not recompile.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import Epilogue, LoadKind, OutputKind
from coda_jax.lowering import (check_kernel_gemm, check_out_splits, check_plain_gemm, gpu_sm_count,
                               kernel_latency_hint, persistent_grid_sms, routes_to_xla, split_columns,
                               with_latency_hint)
from coda_jax.reference import REFERENCE

# Tile constants mirror coda_jax.ffi.kernel (kept importable without cutlass).
TILE_M = 128
TILE_K = 64
MAX_TILE_N = 256
TILE_N_ENV = "CODA_JAX_CUTEDSL_TILE_N"
MAX_STAGES_ENV = "CODA_JAX_CUTEDSL_MAX_STAGES"
GROUP_M_ENV = "CODA_JAX_CUTEDSL_GROUP_M"
SCHEDULE_ENV = "CODA_JAX_CUTEDSL_SCHEDULE"
SCHEDULES = ("auto", "cooperative", "pingpong")


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def pair_width_rule(width: int) -> str | None:
    """Why a pair-mode epilogue ``width = 2 * pair_block`` columns wide cannot run on the
    CuTeDSL kernel, or None."""
    if width > MAX_TILE_N or width % 8:
        return f"must be a multiple of 8 and at most {MAX_TILE_N} (the CuTeDSL kernel's widest tile)"
    return None


def _check_pair_width(epi: Epilogue) -> None:
    if epi.pair_block is None:
        return
    w = 2 * epi.pair_block
    if pair_width_rule(w):
        raise NotImplementedError(
            f"epilogue {epi.name!r}: pair_block={epi.pair_block} needs a 2*pair_block={w} column tile; the "
            f"CuTeDSL backend supports pair blocks that are multiples of 4 up to {MAX_TILE_N // 2}")


def max_stages_request() -> int | None:
    """``CODA_JAX_CUTEDSL_MAX_STAGES``: caps the operand ring's depth (a tuning knob: the
    planner otherwise takes as many stages as fit beside the epilogue's SMEM, up to 6)."""
    raw = os.environ.get(MAX_STAGES_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 2:
        raise ValueError(f"{MAX_STAGES_ENV} must be an integer >= 2, got {raw!r}")
    return int(raw)


def group_m_request() -> int | None:
    """``CODA_JAX_CUTEDSL_GROUP_M``: tile rows per raster group of the persistent tile walk
    (a tuning knob; default :data:`coda_jax.ffi.kernel.GROUP_M`)."""
    raw = os.environ.get(GROUP_M_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{GROUP_M_ENV} must be an integer >= 1, got {raw!r}")
    return int(raw)


def schedule_request() -> str:
    """``CODA_JAX_CUTEDSL_SCHEDULE``: ``cooperative`` (both consumer warpgroups on one tile),
    ``pingpong`` (each warpgroup on its own 128-wide tiles, one's epilogue beside the other's
    mainloop; programs it cannot run fall back to cooperative) or ``auto`` (the default:
    :func:`coda_jax.ffi.kernel.choose_schedule`)."""
    raw = os.environ.get(SCHEDULE_ENV, "auto").strip().lower() or "auto"
    if raw not in SCHEDULES:
        raise ValueError(f"{SCHEDULE_ENV} must be one of {', '.join(SCHEDULES)}, got {raw!r}")
    return raw


def tile_n_request() -> int | None:
    """``CODA_JAX_CUTEDSL_TILE_N``: ``128`` or ``256`` forces the CTA tile width (where it
    fits); unset or ``auto`` lets :func:`coda_jax.ffi.kernel.choose_tile_n` pick."""
    raw = os.environ.get(TILE_N_ENV, "auto").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw not in ("128", "256"):
        raise ValueError(f"{TILE_N_ENV} must be 128, 256 or auto, got {raw!r}")
    return int(raw)


@functools.lru_cache(maxsize=256)
def _build(epi: Epilogue, plan):
    from coda_jax.ffi.interpret import check_lowerable, trace_body
    from coda_jax.ffi.kernel import build_launcher

    shape = (TILE_M, epi.pair_block if epi.pair_block is not None else plan.tile_n)
    traced = trace_body(epi, shape, dict(plan.load_dtypes))
    check_lowerable(traced, f"epilogue {epi.name!r}")
    return build_launcher(epi, traced, plan)


def _cutlass_call(launch, out_types, in_specs, out_specs, key):
    from cutlass.jax import cutlass_call

    return cutlass_call(launch, output_shape_dtype=tuple(out_types), input_spec=tuple(in_specs),
                        output_spec=tuple(out_specs), compile_key=key)


class CuteDslLowering:
    """Runs GEMM-epilogue programs as CuTeDSL Hopper kernels through XLA's FFI."""

    name = "cutedsl"

    def __init__(self, plain_gemm: str | None = None):
        check_plain_gemm(self.name, plain_gemm)
        self.plain_gemm = plain_gemm

    def pair_width_rule(self, width: int) -> str | None:
        """See :func:`pair_width_rule`."""
        return pair_width_rule(width)

    def fuses_at(self, epilogue: Epilogue, m: int, n: int, k: int) -> bool:
        """False where this backend hands the ``[m, k] @ [k, n]`` GEMM to XLA
        (:func:`~coda_jax.lowering.routes_to_xla`); see
        :func:`~coda_jax.lowering.fuses_epilogue_at`."""
        return not routes_to_xla(self.name, epilogue, m, n, k, self.plain_gemm)

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
    ) -> dict[str, Any]:
        """See :class:`coda_jax.lowering.GemmLowering`. ``out_splits``: the kernel writes one
        array per output and XLA slices it into the parts."""
        from cutlass.jax import TensorSpec

        from coda_jax.ffi.kernel import KernelPlan, choose_schedule, choose_tile_n, plan_smem

        m, n, k = check_kernel_gemm("CuTeDSL", epilogue, a, b, loads, transpose_a, transpose_b)
        splits = check_out_splits(epilogue, out_splits, n)
        if routes_to_xla(self.name, epilogue, m, n, k, self.plain_gemm):
            return REFERENCE.gemm(epilogue, a, b, loads, transpose_a=transpose_a, transpose_b=transpose_b,
                                  out_dtypes=out_dtypes, out_splits=splits)
        _check_pair_width(epilogue)
        dtypes = tuple((o.name, jnp.dtype((out_dtypes or {}).get(o.name, o.dtype) or a.dtype))
                       for o in epilogue.outputs)
        for name, dt in dtypes:
            if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
                raise TypeError(f"epilogue {epilogue.name!r}: output {name!r} dtype {dt} is not bf16/f16/f32")
        op_dt = jnp.dtype(a.dtype)
        itemsize = op_dt.itemsize
        sms = persistent_grid_sms(gpu_sm_count())  # $CODA_JAX_RESERVED_SMS left free
        pingpong = choose_schedule(epilogue, schedule_request())
        tn = 128 if pingpong else choose_tile_n(epilogue, m, n, itemsize, dtypes, sms, tile_n_request())
        mp, np_, kp = _round_up(m, TILE_M), _round_up(n, tn), _round_up(k, TILE_K)

        def pad2(x, rows, cols):
            return x if x.shape == (rows, cols) else jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))

        a_p = pad2(a, kp, mp) if transpose_a else pad2(a, mp, kp)
        b_p = pad2(b, np_, kp) if transpose_b else pad2(b, kp, np_)
        args = []
        for l in epilogue.loads:
            v = jnp.asarray(loads[l.name])
            if l.kind is LoadKind.SCALAR:
                v = v.reshape(1)
            elif l.kind is LoadKind.ROW:
                v = jnp.pad(v, (0, mp - m))
            elif l.kind is LoadKind.ROW_BLOCK:
                v = jnp.pad(v, ((0, mp - m), (0, 0)))
            elif l.kind is LoadKind.COL:
                v = jnp.pad(v, (0, epilogue.width(np_, l.half) - epilogue.width(n, l.half)))
            else:
                v = pad2(v, mp, epilogue.width(np_, l.half))
            if jnp.issubdtype(v.dtype, jnp.floating):
                if l.kind not in (LoadKind.TILE, LoadKind.ROW_BLOCK) or v.dtype not in (
                        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
                    v = v.astype(jnp.float32)
            elif v.dtype == jnp.dtype(jnp.bool_) or jnp.issubdtype(v.dtype, jnp.integer):
                v = v.astype(jnp.int32)
            else:
                raise TypeError(f"epilogue {epilogue.name!r}: load {l.name!r} has unsupported dtype {v.dtype}")
            args.append(v)
        load_dtypes = tuple((l.name, jnp.dtype(v.dtype)) for l, v in zip(epilogue.loads, args))
        stages, stage_outputs = plan_smem(epilogue, tn, itemsize, dtypes, pingpong)
        stages = min(stages, max_stages_request() or stages)
        plan = KernelPlan(m=mp, n=np_, k=kp, m_real=m, n_real=n, tile_n=tn, stages=stages,
                          sms=sms, stage_outputs=stage_outputs, transpose_a=transpose_a, transpose_b=transpose_b, operand_dtype=op_dt,
                          load_dtypes=load_dtypes, out_dtypes=dtypes,
                          pingpong=pingpong, **({"group_m": group_m} if (group_m := group_m_request()) else {}))
        launch = _build(epilogue, plan)
        out_types = []
        for o in epilogue.outputs:
            if o.kind is OutputKind.TILE:
                out_types.append(jax.ShapeDtypeStruct((mp, epilogue.width(np_, o.half)), dict(dtypes)[o.name]))
            elif o.kind is OutputKind.COL_SUM:
                out_types.append(jax.ShapeDtypeStruct((mp // TILE_M, np_), jnp.float32))
            else:
                out_types.append(jax.ShapeDtypeStruct((np_ // tn, mp), jnp.float32))
        # Logical operand modes: a as (M, K), b as (N, K), whatever the physical layout.
        in_specs = [TensorSpec(static=True, mode=(1, 0) if transpose_a else None),
                    TensorSpec(static=True, mode=None if transpose_b else (1, 0))]
        in_specs += [TensorSpec(static=True) for _ in args]
        out_specs = [TensorSpec(static=True) for _ in out_types]
        call = _cutlass_call(launch, out_types, in_specs, out_specs, ("coda_jax.ffi", epilogue, plan))
        if (hint := kernel_latency_hint(mp, np_, kp, (a_p, b_p, *args, *out_types))) is not None:
            call = with_latency_hint(call, hint)  # XLA's scheduler is told what the kernel costs
        res = call(a_p, b_p, *args)
        out = {}
        for o, v in zip(epilogue.outputs, res):
            if o.kind is OutputKind.TILE:
                out[o.name] = v[:m, : epilogue.width(n, o.half)]
            elif o.kind is OutputKind.COL_SUM:
                out[o.name] = v[:, :n]
            else:
                out[o.name] = v[:, :m]
        return split_columns(out, splits)


CUTEDSL = CuteDslLowering()
