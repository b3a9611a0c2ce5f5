"""The Pallas kernel's FP8 path (GPU interpret mode) against the reference lowering.

* FP8 operands (``float8_e4m3fn`` x ``float8_e4m3fn``, ``float8_e5m2`` x ``float8_e4m3fn``), K-major
  (``a`` ``[M, K]``, ``b`` ``[N, K]``), under :func:`coda_jax.epilogue.dequantized` programs;
* quantizing outputs (:func:`coda_jax.epilogue.fp8_out`): the FP8 tile, its transposed copy
  ``{name}_t`` and its amax partials ``{name}_amax``, on 16-bit and on FP8 operands, in every
  kernel (single warpgroup, cooperative, ping-pong ring, direct stores, one output slot, swizzled
  staging) and in pair mode (half-width, full-width ``(lo, hi)``, ``half_acc``);
* :meth:`PallasLowering.fp8_rule`: the layouts it refuses, and that such a GEMM still gives the
  reference's values through XLA;
* the FP8 kernels lower for CUDA (Mosaic GPU's checks of the 8-bit wgmma's swizzle and
  transposes, which the interpreter does not make).

Inputs are fresh random values (never zeros); shapes are ragged (M, N, K not tile multiples), so
padded rows and columns exist, and the probes' bodies give padding a large value (``1e4``) that
an unmasked amax would report. Outputs are poisoned: the interpreter fills every kernel output
with NaN before the kernel runs (``InterpretGPUParams(uninitialized_memory="nan")``), so an
element left unwritten fails the finiteness checks.

Bounds. A quantizing output's scale is set from the reference's amax so that the top fifth of
the values saturate (``1.25 * finfo.max / amax``). The kernel's float32 tile differs from the
reference's only by accumulation order (FP8 x FP8 products are exact in float32; bf16 sums differ
in their last bits), so an FP8 value can differ only where the float32 value lies within a few
float32 ulps of an FP8 rounding midpoint: every FP8 element must be within one FP8 code of the
reference's (one ulp: 2^-3 relative for e4m3, 2^-2 for e5m2) and >= 99.9 % bit-equal (in practice
all are). That bounds the dequantized relative error by ``ulp * sqrt(0.001)`` (< 1e-2, asserted).
Float32 outputs and reductions: relative error 1e-5; bf16 outputs: 1e-2 (as
``test_pallas_kernels.py``); the amax (max over the partials): rtol 1e-5 against the reference's.
"""

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coda_jax as cj
from coda_jax import log as coda_log
from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.epilogue import FP8_DTYPES, LoadKind, OutputKind
from coda_jax.pallas import interpret_mode
from coda_jax.pallas.autotune import WIDE_CHUNKS, known_candidates
from coda_jax.pallas.gemm_epilogue import KernelShape, _chunks, plan_kernel
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuning import (CONFIG_TABLE, FP8_EPILOGUE_CONFIG, FP8_PROGRAM_CONFIGS, LEAN_EPILOGUE, TuningConfig,
                                    for_fp8_operands)
from coda_jax.reference import REFERENCE, xla_backend_lowering
from op_cases import PASS_PROGRAMS, abstract_loads, rel_err
from test_pallas_kernels import PINGPONG, RING, SMALL, WS, WS_N, _loads

E4M3, E5M2, BF16, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32

# The 16-bit test configurations with an FP8 K step (128 elements: one 128-byte swizzled row).
SMALL8, WS8, WS_N8, PINGPONG8, RING8 = map(for_fp8_operands, (SMALL, WS, WS_N, PINGPONG, RING))
DIRECT = dataclasses.replace(PINGPONG, direct_loads=True, direct_stores=True, epilogue_cols=32)
ONE_SLOT = dataclasses.replace(WS, epilogue_out_slots=1, epilogue_cols=16)
SWIZZLED = dataclasses.replace(WS_N, swizzle_epilogue=True, epilogue_cols=16)  # 16-byte FP8 rows: row-major
MANUAL = dataclasses.replace(PINGPONG8, manual_barriers=True)  # staged chunks synchronized by hand
FOLDED = dataclasses.replace(WS_N8, fold_row_reductions=True, epilogue_cols=16)  # amax partials [tm, 8] across chunks
# Epilogue passes without the zero GEMM under them (TuningConfig.skip_pass_gemm), on both ring kernels.
NO_GEMM = dataclasses.replace(PINGPONG, skip_pass_gemm=True)
NO_GEMM_RING = dataclasses.replace(RING, skip_pass_gemm=True)


@pytest.fixture(autouse=True)
def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield
    reset_gpu_interpret_mode_state()


# ------------------------------------------------------------------ probes ---------
# Padding (rows past M, columns past N) gets SHIFT * 2: the amax of an unmasked kernel would be
# about 1e4 where the real values stay below a few hundred. ``ones_r`` / ``ones_c`` are ones
# (zero-padded by the lowering like every row / column load).
SHIFT = 1e4


def _probe_body(acc, ctx, ones_r, ones_c, q_scale):
    return {"q": acc + SHIFT * (2.0 - ones_r - ones_c)}


AMAX_PROBE = E.Epilogue(name="fp8_amax_probe", loads=(E.row("ones_r"), E.col("ones_c"), E.scalar("q_scale")),
                        outputs=(E.fp8_out("q", E4M3, scale="q_scale", transpose=True),), body=_probe_body)
"""A quantizing output whose padding is far from zero (transposed copy and amax)."""


def _pair_probe_body(acc, ctx, ones_r, ones_c, q_scale):
    lo, hi = acc
    return {"q": lo - 0.5 * hi + SHIFT * (2.0 - ones_r - ones_c)}


PAIR_PROBE = E.Epilogue(name="fp8_pair_probe", loads=(E.row("ones_r"), E.col("ones_c", half=True), E.scalar("q_scale")),
                        outputs=(E.fp8_out("q", E5M2, scale="q_scale", transpose=True, half=True),),
                        body=_pair_probe_body, pair_block=64)
"""Pair mode: a half-width e5m2 output with its copy and amax, padding far from zero."""


def _two_body(acc, ctx, rstd, s):
    lo, hi = acc
    return {"q": (lo * rstd, hi), "r": lo * hi * rstd}


TWO_PROBE = E.Epilogue(name="fp8_two_probe", loads=(E.row("rstd"), E.scalar("s")),
                       outputs=(E.fp8_out("q", E4M3, scale="s", transpose=True),
                                E.fp8_out("r", E5M2, scale="s", amax=False, half=True)),
                       body=_two_body, pair_block=64)
"""Pair mode: a full-width ``(lo, hi)`` output with its copy, and a second quantizing output of
the same scale without copy or amax (result order: q, q_t, q_amax, r)."""


# ---------------------------------------------------------------- helpers ----------
def _operands(m, n, k, transpose_a, transpose_b, dtypes, seed):
    """Fresh random ``a`` and ``b`` in their layouts: FP8 values spanning a few binades, or bf16
    scaled so that the accumulator stays O(1)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (k, m) if transpose_a else (m, k))
    b = jax.random.normal(kb, (n, k) if transpose_b else (k, n))
    da, db = dtypes
    if jnp.dtype(da) in FP8_DTYPES:
        return (2 * a).astype(da), (2 * b).astype(db)
    return (a / k ** 0.25).astype(da), (b / k ** 0.25).astype(db)


def _fp8_loads(epi, m, n, seed):
    """``test_pallas_kernels``'s loads with the scalars and the probes' ones set: ``acc_scale``
    (an inverse operand scale, not a power of two) and each quantizing output's scale (1 here;
    :func:`_set_scales` replaces it)."""
    loads = _loads(epi, m, n, jax.random.key(seed + 1))
    for l in epi.loads:
        if l.kind is LoadKind.SCALAR:
            loads[l.name] = jnp.float32(0.0371 if l.name == "acc_scale" else 1.0)
        elif l.name.startswith("ones_"):
            loads[l.name] = jnp.ones(loads[l.name].shape, F32)
    if "z_scale_inv" in loads:  # z saved in e4m3 (programs.SWIGLU_DGRAD_ZQ8) at scale 8
        loads["z"] = (loads["z"].astype(F32) * 8.0).astype(E4M3)
        loads["z_scale_inv"] = jnp.float32(0.125)
    return loads


def _set_scales(epi, run, loads):
    """Each quantizing output's scale from the reference's amax: ``1.25 * finfo.max / amax``, so
    that the values above 0.8 amax saturate. Returns the reference's results under those scales."""
    want = run(REFERENCE, loads)
    for o in epi.outputs:
        if o.quantize is not None:
            amax = float(jnp.max(want[f"{o.name}_amax"])) if o.quantize.amax else float(
                jnp.max(jnp.abs(want[o.name].astype(F32))))
            loads[o.quantize.scale] = jnp.float32(1.25 * float(jnp.finfo(o.dtype).max) / amax)
    return run(REFERENCE, loads)


def _fp8_codes(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8).astype(np.int32)


# float32 rounding of an epilogue's math, relative to the output's amax: 8 ulps at 1.0.
_F32_ROUNDING = 8 * float(np.finfo(np.float32).eps)


def _check_fp8(name, got, want, scale) -> None:
    """An FP8 tile (or copy): no NaN (poison) or inf, every element within one code of the
    reference's or, near zero, within float32 rounding of the epilogue's math (``_F32_ROUNDING``
    times the output's amax, before scaling), >= 99.9 % bit-equal, the dequantized values within
    relative error 1e-2; and the reference does saturate some values (the test's scale works)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    g = np.asarray(got.astype(F32))
    assert np.isfinite(g).all(), f"{name}: NaN / inf in the kernel's FP8 output (an unwritten element?)"
    w = np.asarray(want.astype(F32))
    gc, wc = _fp8_codes(got), _fp8_codes(want)
    mag_g, mag_w = gc & 0x7F, wc & 0x7F
    one_code = ((gc >> 7) == (wc >> 7)) & (np.abs(mag_g - mag_w) <= 1)
    # +-0 and the smallest subnormal may differ in sign. Near zero the FP8 grid is also finer
    # than float32's error on the terms of a cancelling sum (RoPE's x cos - y sin, a fused
    # multiply-add in one lowering and not in the other): after scaling, a few float32 ulps of
    # the output's amax span many subnormal codes, and the sign may differ.
    near_zero = ((mag_g <= 1) & (mag_w <= 1)) | (np.abs(g - w) <= _F32_ROUNDING * np.abs(w).max())
    bad = ~(one_code | near_zero)
    assert not bad.any(), (f"{name}: {bad.sum()} elements off by > 1 code, e.g. (kernel, reference) scaled "
                           f"{list(zip(g[bad][:4].tolist(), w[bad][:4].tolist()))}")
    equal = (gc == wc).mean()
    assert equal >= 0.999, f"{name}: only {equal:.4%} bit-equal"
    assert np.isclose(np.abs(w).max(), float(jnp.finfo(want.dtype).max)), f"{name}: nothing saturated"
    assert rel_err(g / scale, w / scale) < 1e-2


def _compare(epi, m, n, k, *, transpose_a=False, transpose_b=True, dtypes=(E4M3, E4M3), config=None,
             out_dtypes=None, seed=0, promote_k=0, reference=None):
    """``epi`` on the Pallas kernel (interpreted) vs :data:`REFERENCE` on the same inputs (or vs
    the lowering ``reference``, with the scales still set from :data:`REFERENCE`'s amax)."""
    a, b = _operands(m, n, k, transpose_a, transpose_b, dtypes, seed)
    loads = _fp8_loads(epi, m, n, seed)
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, out_dtypes=out_dtypes, promote_k=promote_k)

    def run(lowering, loads):
        return lowering.gemm(epi, a, b, loads, **kw)

    want = _set_scales(epi, run, loads)
    if reference is not None:
        want = jax.jit(lambda a, b, l: reference.gemm(epi, a, b, l, **kw))(a, b, loads)
    low = PallasLowering(config, plain_gemm="kernel")
    got = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, **kw))(a, b, loads)
    assert set(got) == set(want) == set(epi.result_names()), (sorted(got), sorted(want))
    for o in epi.outputs:
        g, w = got[o.name], want[o.name]
        if o.quantize is not None:
            scale = float(loads[o.quantize.scale])
            _check_fp8(o.name, g, w, scale)
            if o.quantize.transpose:
                _check_fp8(f"{o.name}_t", got[f"{o.name}_t"], w.T, scale)
            if o.quantize.amax:
                amax = got[f"{o.name}_amax"]
                assert amax.ndim == 1 and amax.dtype == F32 and bool(jnp.all(jnp.isfinite(amax)))
                np.testing.assert_allclose(float(jnp.max(amax)), float(jnp.max(want[f"{o.name}_amax"])), rtol=1e-5)
        elif o.kind in (OutputKind.ROW_SUM, OutputKind.COL_SUM):
            assert rel_err(g.sum(0), w.sum(0)) < 1e-5, o.name
        elif o.kind is OutputKind.ROW_LOGSUMEXP:  # partials per N-tile: their log-sum-exp
            assert bool(jnp.all(~jnp.isnan(g))), o.name
            assert rel_err(jax.nn.logsumexp(g, axis=0), jax.nn.logsumexp(w, axis=0)) < 1e-5, o.name
        else:
            assert g.shape == w.shape and g.dtype == w.dtype, (o.name, g.shape, w.shape, g.dtype, w.dtype)
            assert rel_err(g, w) < (1e-5 if g.dtype == F32 else 1e-2), o.name


# ---------------------------------------------------------- FP8 operands -----------
@pytest.mark.parametrize("dtypes,out", [((E4M3, E4M3), F32), ((E5M2, E4M3), BF16)],
                         ids=["e4m3xe4m3", "e5m2xe4m3"])
def test_fp8_operands_identity(dtypes, out):
    # The lowering's own configuration (the small shape class, K step doubled to 128): the
    # single-warpgroup kernel over two K steps (K 200 -> 256), ragged M and N.
    _compare(E.dequantized(programs.IDENTITY), 100, 150, 200, dtypes=dtypes, out_dtypes={"out": out}, seed=1)


@pytest.mark.parametrize("promote_k", [0, 512])
def test_plain_fp8_gemms_go_to_cublaslt_by_default(promote_k, monkeypatch):
    """The option ``routing.plain_gemm`` (default ``"xla"``) covers the FP8 plain GEMM
    (``dequantized(IDENTITY)``, the wgrads and plain dgrads): the kernel backend hands it to
    XLA as a dot of the FP8 operands that writes bf16 itself, times the scale (the form XLA
    folds into one cuBLASLt FP8 GEMM; ``Precision.HIGHEST`` where promoted), not a float32
    product and a pass. ``plain_gemm="kernel"`` keeps it on the kernel; a float32 output is a
    float32 product."""
    ran = []
    real = PallasLowering.kernel_gemm
    monkeypatch.setattr(PallasLowering, "kernel_gemm", lambda self, epi, *a, **k: (ran.append(epi.name),
                                                                                      real(self, epi, *a, **k))[1])
    a, b = _operands(136, 256, 384, False, True, (E5M2, E4M3), seed=4)
    scale = jnp.float32(0.37)
    epi = E.dequantized(programs.IDENTITY)
    exact = jnp.dot(a.astype(F32), b.astype(F32).T, precision="highest") * scale

    def gemm(lowering, out=BF16):
        f = jax.jit(lambda a, b, s: lowering.gemm(epi, a, b, {"acc_scale": s}, transpose_b=True,
                                                  out_dtypes={"out": out}, promote_k=promote_k)["out"])
        return f(a, b, scale), f.lower(a, b, scale).as_text()

    routed, hlo = gemm(PallasLowering(SMALL8))
    assert ran == [] and routed.dtype == BF16 and rel_err(routed, exact) < 1e-2
    dots = [ln for ln in hlo.splitlines() if "dot_general" in ln]
    assert len(dots) == 1 and "-> tensor<136x256xbf16>" in dots[0], dots  # the dot writes bf16 itself
    assert ("HIGHEST" in dots[0]) == bool(promote_k), dots
    assert "stablehlo.multiply" in hlo and "f32>" not in hlo.split("dot_general")[1].split("\n")[0]
    kernel, _ = gemm(PallasLowering(SMALL8, plain_gemm="kernel"))
    assert ran == ["identity_fp8"] and rel_err(kernel, exact) < 1e-2
    wide, hlo32 = gemm(PallasLowering(SMALL8), out=F32)
    assert ran == ["identity_fp8"] and rel_err(wide, exact) < 1e-5  # float32 out: the exact product, on XLA
    assert "-> tensor<136x256xf32>" in hlo32


@pytest.mark.parametrize("dtypes,config", [((E4M3, E4M3), WS_N8), ((E5M2, E4M3), WS_N8), ((E5M2, E4M3), PINGPONG8),
                                           ((E4M3, E4M3), RING8)],
                         ids=["cooperative-e4m3xe4m3", "cooperative-e5m2xe4m3", "pingpong-e5m2xe4m3",
                              "ring-e4m3xe4m3"])
def test_fp8_operands_row_scale(dtypes, config):
    # Warp-specialized kernels: JAX's pipeline (cooperative) and the hand-written stage ring
    # (ping-pong, delay_release), whose B stages take B's own dtype (e4m3 beside an e5m2 A);
    # three K steps, ragged M and N.
    _compare(E.dequantized(programs.ROW_SCALE), 130, 200, 260, dtypes=dtypes, config=config,
             out_dtypes={"z": BF16}, seed=3)


# Promotion: K = 700 pads to 6 steps of 128; every 4 steps leaves a group of 2, every step
# makes 6 groups of 1. The kernel's sums differ from the reference's only by order. K steps of
# 256 (the autotuner's "k128" candidates for promoting GEMMs): 3 steps, groups of 2 and 1;
# promote_k=128 is rounded up to one step of 256.
@pytest.mark.parametrize("config", [SMALL8, WS8, PINGPONG8, dataclasses.replace(WS8, tile_k=256),
                                    dataclasses.replace(PINGPONG8, tile_k=256)],
                         ids=["single", "cooperative", "pingpong", "cooperative_k256", "pingpong_k256"])
@pytest.mark.parametrize("promote_k", [128, 512])
def test_promoted_accumulation(config, promote_k):
    _compare(E.dequantized(programs.IDENTITY), 200, 136, 700, config=config, out_dtypes={"out": F32},
             promote_k=promote_k)
    if promote_k == 128:
        return  # groups of one step: the grouping above; the epilogues below run on groups of two
    _compare(AMAX_PROBE, 200, 136, 700, config=config, promote_k=promote_k, seed=1)
    # A column sum (the norm backward's dgamma): as summand tiles in the warp-specialized kernels.
    _compare(E.dequantized(programs.rms_dgrad(True, True)), 200, 136, 700, config=config, promote_k=promote_k,
             out_dtypes={"dx": BF16}, seed=2)


def test_promoting_plan_halves_the_consumer_tile_and_runs_the_ring():
    # Two accumulators a consumer: a 128 x 128 tile (128 registers each) is halved along M; the
    # cooperative kernel runs on the ring's mainloop, which promotes between K steps.
    shape = KernelShape(m=1024, n=1024, k=1024, m_real=1024, n_real=1024, transpose_a=False, transpose_b=True,
                        operand_dtype=jnp.dtype(E4M3), out_dtypes=(("out", jnp.dtype(F32)),), num_sms=4,
                        promote_k=512)
    epi = E.dequantized(programs.IDENTITY)
    for cfg in (WS8, PINGPONG8, SMALL8):
        plan = plan_kernel(epi, shape, cfg)
        assert plan.tile_m * plan.tile_n <= 64 * 128 and plan.tile_n == cfg.tile_n, (cfg, plan)
        assert plan.warp_specialized == cfg.warp_specialized and (plan.pingpong or plan.delay_release or
                                                                  not plan.warp_specialized), plan
    assert shape.promote_steps(128) == 4 and dataclasses.replace(shape, promote_k=64).promote_steps(128) == 1
    assert plan_kernel(epi, dataclasses.replace(shape, promote_k=0), WS8) == plan_kernel(epi, dataclasses.replace(
        shape, promote_k=0), WS8)  # unpromoted plans unchanged
    assert plan_kernel(epi, dataclasses.replace(shape, promote_k=0), WS8).tile_m == WS8.tile_m


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_promote_k_is_checked(bad):
    a = jnp.ones((64, 128), E4M3)
    with pytest.raises(ValueError, match="promote_k must be a non-negative int"):
        PallasLowering(SMALL8, plain_gemm="kernel").gemm(E.dequantized(programs.IDENTITY), a, a,
                                                          {"acc_scale": jnp.float32(1)}, transpose_b=True,
                                                          promote_k=bad)


@pytest.mark.parametrize("config", [SMALL8, WS8, PINGPONG8, dataclasses.replace(WS8, tile_k=256)],
                         ids=["single", "cooperative", "pingpong", "cooperative_k256"])
@pytest.mark.parametrize("k", [1024, 1152])
def test_promoting_kernel_lowers_for_cuda(config, k):
    """Mosaic GPU's code generation accepts the promoting mainloops: a fresh accumulator a
    group, the float32 total carried through the group loop (WGMMA layout), a last partial
    group (K = 1152: 9 steps, groups of 4)."""
    m, n = 1024, 1024
    epi = E.dequantized(programs.IDENTITY)
    a, b = jax.ShapeDtypeStruct((m, k), E4M3), jax.ShapeDtypeStruct((n, k), E5M2)
    low = PallasLowering(config, plain_gemm="pallas")
    with interpret_mode(False):
        txt = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes={"out": F32},
                                               promote_k=512)).trace(
            a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


def test_fp8_operands_plan_like_bf16():
    # A 128-element FP8 K step is the bytes of a 64-element bf16 one: the same stages fit.
    def shape(dt):
        return KernelShape(m=8192, n=8192, k=2048, m_real=8192, n_real=8192, transpose_a=False, transpose_b=True,
                           operand_dtype=jnp.dtype(dt), out_dtypes=(("out", jnp.dtype(BF16)),), num_sms=132)

    cfg = CONFIG_TABLE["default"]
    bf16, fp8 = plan_kernel(programs.IDENTITY, shape(BF16), cfg), plan_kernel(programs.IDENTITY, shape(E4M3),
                                                                              for_fp8_operands(cfg))
    assert fp8.tile_k == 2 * bf16.tile_k == 128
    assert fp8.smem_bytes(1) == bf16.smem_bytes(2) and fp8.max_concurrent_steps == bf16.max_concurrent_steps
    default = PallasLowering.default_config(programs.IDENTITY, 8192, 8192, 2048, False, True, True, fp8_operands=True)
    assert default.tile_k == 2 * PallasLowering.default_config(programs.IDENTITY, 8192, 8192, 2048, False, True,
                                                               True).tile_k


# ------------------------------------------------------- quantizing outputs --------
@pytest.mark.parametrize("config", [SMALL, WS], ids=["single", "cooperative"])
def test_quantizing_epilogue_bf16_operands(config):
    # residual + RMSNorm writing h in e4m3 with its transposed copy and amax beside x (bf16) and
    # the row sums, on bf16 operands (the FP8 block's O projection).
    _compare(programs.RESIDUAL_RMS_Q8, 100, 150, 80, transpose_b=False, dtypes=(BF16, BF16), config=config, seed=4)


def test_quantizing_epilogue_fp8_operands():
    # FP8 operands and quantizing outputs in one GEMM (dequantized, then quantized again).
    _compare(E.dequantized(programs.RESIDUAL_RMS_Q8), 200, 300, 130, config=WS_N8, out_dtypes={"x": BF16}, seed=5)


@pytest.mark.parametrize("config", [SMALL8, WS_N8, PINGPONG8, DIRECT, ONE_SLOT, SWIZZLED,
                                    dataclasses.replace(PINGPONG8, swizzle_epilogue=True), MANUAL, FOLDED],
                         ids=["single", "cooperative", "pingpong", "direct_stores", "one_out_slot", "swizzled",
                              "pingpong_swizzled", "manual_barriers", "folded_rows"])
def test_amax_and_copy_mask_padding(config):
    # Ragged M and N (200 x 300 on 64- and 128-wide tiles): the padding's 1e4 must reach
    # neither the amax (masked columns, sliced rows) nor the copy (sliced).
    if config.tile_k == 64:  # the 16-bit configurations run this program on FP8 operands as given
        config = for_fp8_operands(config)
    _compare(AMAX_PROBE, 200, 300, 130, config=config, seed=6)


@pytest.mark.parametrize("config", [WS_N8, DIRECT], ids=["cooperative", "direct_stores"])
def test_quantizing_half_width_pair_output(config):
    # A half-width e5m2 output with copy and amax on FP8 operands; N 384 -> 512 on the
    # cooperative kernel's 64 x 256 CTA tile: one pair block of padding, far from zero.
    _compare(PAIR_PROBE, 100, 384, 200, config=config, seed=7)


def test_quantizing_full_width_pair_output():
    # A full-width (lo, hi) e4m3 output with its copy, and a second quantizing output (e5m2,
    # half-width) of the same scale without copy or amax.
    _compare(TWO_PROBE, 128, 256, 128, config=SMALL8, seed=8)


def test_quantizing_swiglu_backward():
    # half_acc: dz is full-width ((lo, hi) blocks of its [M, 2N]); dz' in e5m2 with copy and amax
    # beside the row sums, bf16 operands, on the ping-pong ring.
    _compare(programs.SWIGLU_DGRAD_Q8, 200, 192, 130, transpose_b=True, dtypes=(BF16, BF16), config=PINGPONG, seed=9)


def test_quantizing_swiglu_forward_on_fp8_operands():
    # y (half-width) in e4m3 with copy and amax, z saved in bf16, FP8 operands.
    _compare(E.dequantized(programs.rms_swiglu_q8(True)), 100, 256, 200, config=SMALL8, out_dtypes={"z": BF16},
             seed=10)


@pytest.mark.parametrize("config", [SMALL8, dataclasses.replace(PINGPONG8, **FP8_EPILOGUE_CONFIG)],
                         ids=["single", "pingpong_lean"])
def test_swiglu_forward_saves_z_in_e4m3(config):
    # Fp8Recipe(swiglu_input="e4m3"): z (full width, gate/up blocks) in e4m3 at its own scale
    # with its amax and no copy, beside y (half width, e4m3 with copy and amax).
    epi = E.dequantized(programs.rms_swiglu_q8(True, True))
    assert epi.output("z").quantize == E.Quantize("z_scale", transpose=False, amax=True)
    _compare(epi, 100, 256, 200, config=config, seed=12)


def test_skip_pass_gemm_leaves_a_program_that_reads_the_accumulator_alone():
    # TuningConfig.skip_pass_gemm skips the GEMM only under a program that declares
    # reads_acc=False; this one reads it, so its kernel still multiplies (ping-pong, FP8).
    cfg = for_fp8_operands(NO_GEMM)
    _compare(E.dequantized(programs.RESIDUAL_RMS_Q8), 200, 256, 130, config=cfg, out_dtypes={"x": BF16}, seed=16)


@pytest.mark.parametrize("name", ["pingpong_minor_m_bytes_m64", "pingpong_minor_m_lean_m64",
                                  "pingpong_minor_m_bytes_wide_s3", "pingpong_lean_wide_s3"])
def test_swiglu_fp8_programs_on_pingpong_candidates(name):
    # The autotuner's candidates for the spilling FP8 SwiGLU programs on both of them: 64 x 128
    # ping-pong tiles (half the accumulator registers) and 32-column pair chunks past the
    # register budget with one output slot. Pair blocks, quantizing outputs with copies and
    # amax, ragged M.
    cfg = for_fp8_operands(known_candidates()[name])
    assert cfg.pingpong and (cfg.tile_m == 64 or name in _WIDE_CANDIDATES)
    _compare(E.dequantized(programs.SWIGLU_DGRAD_Q8), 200, 256, 130, dtypes=(E5M2, E4M3), config=cfg, seed=14)
    _compare(E.dequantized(programs.rms_swiglu_q8(True)), 100, 256, 200, config=cfg, out_dtypes={"z": BF16}, seed=15)


@pytest.mark.parametrize("config", [SMALL8, dataclasses.replace(PINGPONG8, **FP8_PROGRAM_CONFIGS["swiglu_dgrad_zq8_fp8"])],
                         ids=["single", "heuristic_pingpong"])
def test_swiglu_backward_reads_z_in_e4m3(config):
    # The SwiGLU backward whose tile load z is e4m3 (dequantized by z_scale_inv in the body):
    # dz' in e5m2 with copy and amax, and the norm's row term, against the reference.
    _compare(E.dequantized(programs.SWIGLU_DGRAD_ZQ8), 200, 192, 130, dtypes=(E5M2, E4M3), config=config, seed=13)


def test_rms_swiglu_q8_z_fp8_needs_the_saved_preactivation():
    with pytest.raises(ValueError, match="z_fp8 stores the saved pre-activation"):
        programs.rms_swiglu_q8(False, True)


# ---------------------------------------------------------------- fp8_rule ---------
def _rule(epi, ta, tb, dtypes=(E4M3, E4M3)):
    a = jnp.zeros((128, 64) if ta else (64, 128), dtypes[0])
    b = jnp.zeros((96, 128) if tb else (128, 96), dtypes[1])
    return PallasLowering().fp8_rule(epi, a, b, ta, tb)


@pytest.mark.parametrize("ta,tb", [(False, False), (True, True), (True, False)], ids=["b_kn", "a_km", "both"])
def test_fp8_rule_refuses_non_k_major_operands(ta, tb):
    why = _rule(E.dequantized(programs.IDENTITY), ta, tb)
    assert why is not None and "must both be K-major" in why
    assert "a as [M, K] (transpose_a=False) and b as [N, K] (transpose_b=True)" in why
    assert f"got a {'[K, M]' if ta else '[M, K]'}, b {'[N, K]' if tb else '[K, N]'}" in why


def test_fp8_rule_accepts():
    for dtypes in [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)]:
        assert _rule(E.dequantized(programs.IDENTITY), False, True, dtypes) is None
    for epi in (programs.RESIDUAL_RMS_Q8, programs.rms_swiglu_q8(True), programs.SWIGLU_DGRAD_Q8,
                programs.rms_dgrad_q8(True)):
        assert _rule(E.dequantized(epi), False, True) is None
        for ta, tb in [(False, False), (True, False), (False, True)]:  # 16-bit operands: any layout
            assert _rule(epi, ta, tb, (BF16, BF16)) is None


def test_refused_layout_runs_on_xla(monkeypatch, caplog):
    """An FP8 GEMM with b [K, N] never reaches the kernel: XLA's FP8 GEMM (the xla backend's
    lowering, writing bf16) runs it, logged once, with the reference's values."""
    epi = E.dequantized(programs.ROW_SCALE)
    m, n, k = 100, 150, 200
    a, b = _operands(m, n, k, False, False, (E4M3, E4M3), seed=11)
    loads = _fp8_loads(epi, m, n, 11)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the refused FP8 GEMM reached the Pallas kernel")

    low = PallasLowering(SMALL8, plain_gemm="kernel")
    monkeypatch.setattr(low, "kernel_gemm", no_kernel)
    monkeypatch.setattr(coda_log, "_logged", set())  # logged once per program
    with caplog.at_level(logging.INFO, logger="coda_jax"):
        got = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, out_dtypes={"z": F32}))(a, b, loads)["z"]
    assert any("runs the FP8 GEMMs of 'row_scale_fp8' on XLA" in r.getMessage() and "K-major" in r.getMessage()
               for r in caplog.records)
    xla = xla_backend_lowering().gemm(epi, a, b, loads, out_dtypes={"z": F32})["z"]
    assert rel_err(got, xla) < 1e-6  # the xla backend's own lowering
    assert rel_err(got, REFERENCE.gemm(epi, a, b, loads, out_dtypes={"z": F32})["z"]) < 1e-2  # bf16-rounded product


# ------------------------------------------------------------ CUDA lowering --------
# Current scaling (Fp8Recipe(scaling="current")): the block's quantizing programs unquantized
# (E.unquantized: the FP8 output written in the compute dtype, quantized after the GEMM).
UNQUANTIZED = {name: E.dequantized(E.unquantized(p)) for name, p in (
    ("residual_rms_q8", programs.RESIDUAL_RMS_Q8), ("rms_swiglu_q8_train", programs.rms_swiglu_q8(True)),
    ("swiglu_dgrad_q8", programs.SWIGLU_DGRAD_Q8))}


LOWERED = [
    ("identity_e5m2xe4m3", E.dequantized(programs.IDENTITY), (E5M2, E4M3), CONFIG_TABLE["default"]),
    ("rms_swiglu_train", E.dequantized(programs.rms_swiglu(True)), (E4M3, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None)),
    ("residual_rms_q8", programs.RESIDUAL_RMS_Q8, (BF16, BF16),
     dataclasses.replace(CONFIG_TABLE["default"], swizzle_epilogue=True)),
    ("swiglu_dgrad_q8_fp8_pingpong_swizzled", E.dequantized(programs.SWIGLU_DGRAD_Q8), (E5M2, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None, swizzle_epilogue=True)),
    ("swiglu_dgrad_q8", programs.SWIGLU_DGRAD_Q8, (BF16, BF16),
     dataclasses.replace(CONFIG_TABLE["default"], delay_release=1, direct_stores=True)),
    # dgamma as its float32 summand tile on the two-consumer kernels
    ("rms_dgrad_res_q8_dgamma_fp8", E.dequantized(programs.rms_dgrad_q8(True)), (E5M2, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], col_sum_tiles=True)),
    ("swiglu_dgrad_q8_unquantized_fp8", UNQUANTIZED["swiglu_dgrad_q8"], (E5M2, E4M3), CONFIG_TABLE["default"]),
    # Fp8Recipe(swiglu_input="e4m3"): z written in e4m3 by the forward, read as an e4m3 tile load
    ("rms_swiglu_q8_train_zq8_fp8_pingpong_lean", E.dequantized(programs.rms_swiglu_q8(True, True)),
     (E4M3, E4M3), dataclasses.replace(CONFIG_TABLE["default"], **FP8_EPILOGUE_CONFIG)),
    ("swiglu_dgrad_zq8_fp8_heuristic", E.dequantized(programs.SWIGLU_DGRAD_ZQ8), (E5M2, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], **FP8_PROGRAM_CONFIGS["swiglu_dgrad_zq8_fp8"])),
    ("swiglu_dgrad_zq8_fp8_cooperative", E.dequantized(programs.SWIGLU_DGRAD_ZQ8), (E5M2, E4M3),
     CONFIG_TABLE["default"]),
    # the autotuner's 64 x 128 ping-pong candidates (half the accumulator registers) on both SwiGLU GEMMs
    ("swiglu_dgrad_q8_fp8_pingpong_m64", E.dequantized(programs.SWIGLU_DGRAD_Q8), (E5M2, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], tile_m=64, schedule="pingpong", cluster_dimension=None,
                         grid_minor_dim="m", fp8_byte_transpose=True)),
    ("rms_swiglu_q8_train_fp8_pingpong_m64_lean", E.dequantized(programs.rms_swiglu_q8(True)), (E4M3, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], tile_m=64, schedule="pingpong", cluster_dimension=None,
                         **LEAN_EPILOGUE)),
    # the FP8 LM head (Fp8Recipe(lm_head=True)): the logits GEMM with its online LSE, the
    # recompute path's CE-gradient GEMM and the accumulating dgrad
    ("rms_lse_logits_fp8", E.dequantized(programs.RMS_LSE_LOGITS), (E4M3, E4M3), CONFIG_TABLE["default"]),
    ("ce_grad_fp8", E.dequantized(programs.CE_GRAD), (E4M3, E4M3), CONFIG_TABLE["default"]),
    ("accumulate_fp8", E.dequantized(programs.ACCUMULATE), (E5M2, E4M3), CONFIG_TABLE["default"]),
    ("rms_dgrad_res_dgamma_fp8_pingpong_swizzled", E.dequantized(programs.rms_dgrad(True, True)), (E5M2, E4M3),
     dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None, swizzle_epilogue=True,
                         col_sum_tiles=True)),
]


def _check_pass_lowers_for_cuda(epi, m, n, loads, config=None):
    """Epilogue pass ``epi`` over ``[m, n]`` (``loads``: shape structs) passes Mosaic GPU's code
    generation under ``config`` (None: the lowering's table or heuristic), compiled, not interpreted."""
    from coda_jax.ops.epilogue_pass import epilogue_pass

    low = PallasLowering(config, plain_gemm="pallas")
    with interpret_mode(False):
        txt = jax.jit(lambda l: epilogue_pass(low, epi, m, n, l)).trace(loads).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("config", [None, dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong",
                                                                cluster_dimension=None, swizzle_epilogue=True)],
                         ids=["heuristic", "pingpong_swizzled"])
def test_rope_grad_pass_lowers_for_cuda(config):
    """The QKV gradient's epilogue pass at 1B shapes (K = one step: the heuristic's small
    single-warpgroup configuration) passes Mosaic GPU's code generation: the pair-mode tile
    load and the e5m2 copy's transposed stores."""
    m, half = 8192, 32
    epi = programs.rope_grad_q8(half)
    n = 48 * 2 * half
    loads = {"dqkv": jax.ShapeDtypeStruct((m, n), BF16), "qkv": jax.ShapeDtypeStruct((m, n), BF16),
             "rstd": jax.ShapeDtypeStruct((m,), F32),
             "cos": jax.ShapeDtypeStruct((m, half), F32), "sin": jax.ShapeDtypeStruct((m, half), F32),
             "rot": jax.ShapeDtypeStruct((n // 2,), F32), "dz_scale": jax.ShapeDtypeStruct((), F32)}
    _check_pass_lowers_for_cuda(epi, m, n, loads, config)


@pytest.mark.parametrize("fp8,config", [
    ("e4m3", None), ("e5m2", None),
    ("e4m3", dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None,
                                 prefetch_next_tile=True, epilogue_cols=32, epilogue_load_slots=3, **LEAN_EPILOGUE))],
    ids=["e4m3", "e5m2", "e4m3_prefetch"])
def test_quantize_pass_lowers_for_cuda(fp8, config):
    """The standalone quantizing pass at 1B shapes (``[8192, 2048]`` bf16) passes Mosaic GPU's
    code generation on the heuristic's configuration, and with the next tile's loads issued
    from this tile's epilogue (TuningConfig.prefetch_next_tile)."""
    m, n = 8192, 2048
    loads = {"x": jax.ShapeDtypeStruct((m, n), BF16), "q_scale": jax.ShapeDtypeStruct((), F32)}
    _check_pass_lowers_for_cuda(programs.quantize_q8(fp8), m, n, loads, config)


# The autotuner's pass candidates without the zero GEMM (test_autotune checks there are some).
_NO_GEMM_CANDIDATES = tuple(n for n, c in known_candidates().items() if c.skip_pass_gemm)
# The autotuner's wide candidates (32-column pair chunks past the register budget, one output slot).
_WIDE_CANDIDATES = tuple(n for n, c in known_candidates().items()
                         if all(getattr(c, f) == v for f, v in WIDE_CHUNKS.items()))


@pytest.mark.parametrize("name", _NO_GEMM_CANDIDATES)
def test_passes_without_their_gemm_lower_for_cuda(name):
    """The autotuner's pass candidates without the zero GEMM (TuningConfig.skip_pass_gemm) pass
    Mosaic GPU's code generation at 1B shapes: a weight's quantizing pass (float32 in) and the
    QKV gradient's pass (pair mode)."""
    cfg = known_candidates()[name]
    loads = {"x": jax.ShapeDtypeStruct((2048, 16384), F32), "q_scale": jax.ShapeDtypeStruct((), F32)}
    _check_pass_lowers_for_cuda(programs.quantize_q8("e4m3"), 2048, 16384, loads, cfg)
    m, half = 8192, 32
    n = 48 * 2 * half
    epi = programs.rope_grad_q8(half)
    _check_pass_lowers_for_cuda(epi, m, n, abstract_loads(epi, m, n), cfg)


@pytest.mark.parametrize("logits_dtype", [F32, BF16])
def test_ce_grad_pass_lowers_for_cuda(logits_dtype):
    """The FP8 LM head's gradient pass over the saved logits at 1B shapes (``[8192, 128256]``
    float32 or bf16 logits, e5m2 copies) passes Mosaic GPU's code generation on the heuristic's
    configuration."""
    from coda_jax.ops.epilogue_pass import epilogue_pass

    m, v = 8192, 128256
    row = jax.ShapeDtypeStruct((m,), F32)
    loads = {"logits": jax.ShapeDtypeStruct((m, v), logits_dtype), "lse": row, "gscale": row, "zcoef": row,
             "target": jax.ShapeDtypeStruct((m,), jnp.int32), "dlogits_scale": jax.ShapeDtypeStruct((), F32)}
    low = PallasLowering(None, plain_gemm="pallas")
    with interpret_mode(False):
        txt = jax.jit(lambda l: epilogue_pass(low, programs.CE_GRAD_Q8, m, v, l)).trace(loads).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


@pytest.mark.parametrize("name,epi,dtypes,config", LOWERED, ids=[c[0] for c in LOWERED])
def test_fp8_kernel_lowers_for_cuda(name, epi, dtypes, config):
    """Mosaic GPU's code generation accepts the FP8 kernels at real tile sizes: the 8-bit wgmma
    (K-major operands, 128-byte swizzle, 128-element K groups), the FP8 casts, the transposed
    copy's stores through a transposed view and the amax rows (the interpreter checks none)."""
    m, n, k = 1024, 1024, 512
    tb = epi.name != "residual_rms_q8"  # 16-bit operands in the forward's [K, N] layout
    a = jax.ShapeDtypeStruct((m, k), dtypes[0])
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), dtypes[1])
    cfg = for_fp8_operands(config) if jnp.dtype(dtypes[0]) in FP8_DTYPES else config
    low = PallasLowering(cfg, plain_gemm="pallas")
    with interpret_mode(False):  # compiled, not interpreted
        txt = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=tb)).trace(
            a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt, name


def test_unscaled_outputs_of_fp8_operands_default_to_bf16():
    # A tile output given no dtype is stored in bf16 on FP8 operands (epilogue.default_out_dtype),
    # as the reference stores it, not in the operands' FP8 dtype (run 318: the kernel wrote e4m3).
    from coda_jax.pallas.lowering import kernel_shape

    epi = E.dequantized(programs.rms_dgrad_q8(True))
    shape = kernel_shape(epi, 2048, 2048, 1024, WS_N8, False, True, E4M3, None, 132)
    assert dict(shape.out_dtypes) == {"dx": jnp.dtype(BF16), "dxq": jnp.dtype(E5M2), "dgamma": jnp.dtype(F32)}
    a, b = jax.ShapeDtypeStruct((256, 256), E4M3), jax.ShapeDtypeStruct((256, 256), E4M3)
    loads = abstract_loads(epi, 256, 256)
    low = PallasLowering(WS_N8, plain_gemm="kernel")
    got = jax.eval_shape(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True), a, b, loads)
    want = jax.eval_shape(lambda a, b, l: REFERENCE.gemm(epi, a, b, l, transpose_b=True), a, b, loads)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert got["dx"].dtype == BF16


def _shipped_fp8_configs():
    """(program, layout, config, promote_k) of each distinct FP8 configuration in the shipped
    tuned tables (programs on FP8 operands: :func:`coda_jax.epilogue.dequantized`'s
    ``<name>_fp8``; ``promote_k``: the promotion interval an entry was measured with)."""
    from coda_jax.pallas.tuned import SHIPPED_TABLES, load_table
    from test_pallas_kernels import CASES

    inner = [c[0] for c in CASES] + [programs.RMS_LSE_LOGITS, programs.RESIDUAL_RMS_Q8, programs.rms_swiglu_q8(True), programs.SWIGLU_DGRAD_Q8,
                                     programs.rms_swiglu_q8(True, True), programs.SWIGLU_DGRAD_ZQ8,
                                     programs.rms_dgrad_q8(True), programs.rms_dgrad_q8(False),
                                     programs.rms_dgrad(True, True)]
    seen = {}
    for e in (e for path in SHIPPED_TABLES for e in load_table(str(path)).entries):
        if e.config is not None and e.program.endswith("_fp8"):
            epi = next((E.dequantized(i) for i in inner if i.name == e.program.removesuffix("_fp8")), None)
            assert epi is not None, f"tuned table entry for unknown FP8 program {e.program!r}"
            assert e.config.tile_k in (128, 256), f"{e.program}: an FP8 entry holds the K step it was measured with"
            seen.setdefault((e.program, e.config, e.promote_k), (epi, e.layout, e.config, e.promote_k))
    return list(seen.values())


@pytest.mark.parametrize("epi,layout,cfg,promote_k", _shipped_fp8_configs(),
                         ids=lambda x: getattr(x, "name", None) or (x if isinstance(x, str) else None))
def test_shipped_fp8_tuned_configs(epi, layout, cfg, promote_k):
    # Each FP8 configuration of the shipped tables on the program it was tuned for, FP8 operands,
    # ragged M and N, promoted as measured (then over K steps that make more than one group;
    # tests/test_gpu_pallas_fp8.py runs the kernels compiled).
    assert layout == "nt"
    out = {o.name: BF16 for o in epi.outputs if o.kind is OutputKind.TILE and o.quantize is None}
    _compare(epi, 200, 384, 3 * max(cfg.tile_k, promote_k) if promote_k else 256, config=cfg, out_dtypes=out,
             seed=30, promote_k=promote_k)


def _check_pass(epi, m, n, loads, out, scale, config, before_kernel):
    """Epilogue pass ``epi`` (:func:`coda_jax.ops.epilogue_pass.epilogue_pass`) on the Pallas
    kernel under ``config`` against the reference: its FP8 output ``out``, the copy and amax,
    with the scale load ``scale`` set from the reference's amax so that some values saturate.
    Returns ``(got, want)``."""
    from coda_jax.ops.epilogue_pass import epilogue_pass

    loads = dict(loads, **{scale: jnp.float32(1.0)})
    want = epilogue_pass(REFERENCE, epi, m, n, loads)
    fmax = float(jnp.finfo(epi.output(out).dtype).max)
    loads[scale] = jnp.float32(1.25 * fmax / float(jnp.max(want[f"{out}_amax"])))
    want = epilogue_pass(REFERENCE, epi, m, n, loads)
    before_kernel(m, n)
    low = PallasLowering(config, plain_gemm="kernel")
    got = jax.jit(lambda l: epilogue_pass(low, epi, m, n, l))(loads)
    s = float(loads[scale])
    _check_fp8(out, got[out], want[out], s)
    _check_fp8(f"{out}_t", got[f"{out}_t"], want[out].T, s)
    np.testing.assert_allclose(float(jnp.max(got[f"{out}_amax"])), float(jnp.max(want[f"{out}_amax"])), rtol=1e-5)
    return got, want


def check_rope_grad_pass(config, m, heads, kv, half, seed, before_kernel=lambda m, n: None):
    """The FP8 block's QKV gradient as an epilogue pass (zero accumulator, the gradient a tile
    load, pair mode per head) on the Pallas kernel under ``config`` against the reference
    (:func:`_check_pass`). ``before_kernel(m, n)`` runs just before the kernel (the GPU tests
    poison there)."""
    from test_fp8 import rope_grad_inputs

    loads = rope_grad_inputs(m, heads, kv, half, seed, parts=True)  # dq, dk, dv (and q, k, v) as the block gives them
    n = (heads + 2 * kv) * 2 * half
    got, want = _check_pass(programs.rope_grad_q8(half), m, n, loads, "dz", "dz_scale", config, before_kernel)
    # The norm's row term, against the reference and against float64 math of sum(qkv * dqkv).
    assert rel_err(got["zdz"].sum(0), want["zdz"].sum(0)) < 1e-5
    naive = sum(np.sum(np.asarray(z, np.float64) * np.asarray(d, np.float64), axis=1)
                for z, d in zip(loads["qkv"], loads["dqkv"]))
    zdz = np.asarray(jnp.sum(got["zdz"], axis=0), np.float64)
    assert np.isfinite(zdz).all() and np.linalg.norm(zdz - naive) / np.linalg.norm(naive) < 1e-5


def check_quantize_pass(config, fp8, m, n, seed, before_kernel=lambda m, n: None, dtype=BF16):
    """A standalone quantizing pass (:func:`programs.quantize_q8`: a tile load, bf16 or float32
    (the weights' pass), written in FP8 with its copy and amax) on the Pallas kernel under
    ``config`` against the reference (:func:`_check_pass`)."""
    x = (jax.random.normal(jax.random.key(seed), (m, n), F32) * 3.0).astype(dtype)
    _check_pass(programs.quantize_q8(fp8), m, n, {"x": x}, "q", "q_scale", config, before_kernel)


def check_input_norm_pass(config, m, n, seed, before_kernel=lambda m, n: None):
    """The first FP8 block's norm input as an epilogue pass (:data:`programs.RMS_INPUT_Q8`: a bf16
    tile load and a column load, ``h = x * gamma`` in e4m3 with copy and amax, the row sums of
    ``x^2``) on the Pallas kernel under ``config`` against the reference (:func:`_check_pass`),
    and the row sums against float64 math of the naive definition."""
    k = jax.random.split(jax.random.key(seed), 2)
    x = (jax.random.normal(k[0], (m, n), F32) * 3.0).astype(BF16)
    gamma = jax.random.uniform(k[1], (n,), F32, 0.5, 1.5)
    got, _ = _check_pass(programs.RMS_INPUT_Q8, m, n, {"x": x, "gamma": gamma}, "h", "h_scale", config,
                         before_kernel)
    # h against the naive definition: x * gamma in float64, scaled as _check_pass scales it, cast.
    h64 = np.asarray(x, np.float64) * np.asarray(gamma, np.float64)
    fmax = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scale = np.float32(1.25 * fmax / np.float32(np.abs(h64).max()))
    naive = jnp.asarray(np.clip(h64 * np.float64(scale), -fmax, fmax), F32).astype(jnp.float8_e4m3fn)
    _check_fp8("h (naive)", got["h"], naive, scale)
    sumsq = np.asarray(jnp.sum(got["sumsq"], axis=0), np.float64)
    want = np.sum(np.asarray(x, np.float64) ** 2, axis=1)
    assert np.isfinite(sumsq).all()
    assert np.linalg.norm(sumsq - want) / np.linalg.norm(want) < 1e-5


def shipped_pass_configs(program: str) -> list[TuningConfig]:
    """The distinct configurations of epilogue pass ``program`` (one of :data:`PASS_PROGRAMS`)
    in the shipped tables."""
    assert program in PASS_PROGRAMS, program
    from coda_jax.pallas.tuned import SHIPPED_TABLES, load_table

    entries = (e for path in SHIPPED_TABLES for e in load_table(str(path)).entries)
    return list(dict.fromkeys(e.config for e in entries if e.program == program and e.config is not None))


def shipped_rope_grad_configs() -> list[TuningConfig]:
    return shipped_pass_configs("rope_grad_q8")


def check_ce_grad_pass(config, m, v, seed, before_kernel=lambda m, n: None):
    """The FP8 LM head's gradient pass over saved float32 logits (:data:`programs.CE_GRAD_Q8`:
    tile load, row loads, the column index, an e5m2 output with copy and amax, a row sum) on the
    Pallas kernel under ``config`` against the reference (:func:`_check_pass`), and ``zdz``."""
    k = jax.random.split(jax.random.key(seed), 3)
    logits = jax.random.normal(k[0], (m, v), F32) * 3.0
    lse = jax.nn.logsumexp(logits, axis=1)
    loads = {"logits": logits, "lse": lse, "target": jax.random.randint(k[1], (m,), -1, v),
             "gscale": jax.random.uniform(k[2], (m,), F32, 0.5, 1.5) / m, "zcoef": 1.0 + 2e-3 * lse}
    got, want = _check_pass(programs.CE_GRAD_Q8, m, v, loads, "dlogits", "dlogits_scale", config, before_kernel)
    zdz = jnp.sum(got["zdz"], axis=0)
    assert bool(jnp.all(jnp.isfinite(zdz)))
    assert rel_err(zdz, jnp.sum(want["zdz"], axis=0)) < 1e-5


_CE_GRAD_CONFIGS = {"single": SMALL, "cooperative": WS_N, "pingpong": PINGPONG, "pingpong_no_gemm": NO_GEMM,
                    **{f"shipped{i}": c for i, c in enumerate(shipped_pass_configs("ce_grad_q8"))}}


@pytest.mark.parametrize("config", _CE_GRAD_CONFIGS.values(), ids=list(_CE_GRAD_CONFIGS))
def test_ce_grad_pass(config):
    # Ragged M and V (200 x 520), some targets ignored (-1).
    check_ce_grad_pass(config, 200, 520, 13)


_ROPE_GRAD_CONFIGS = {"single": SMALL, "cooperative": WS_N, "pingpong": PINGPONG,
                      "manual_barriers": dataclasses.replace(PINGPONG, manual_barriers=True),
                      # one K step a tile: the ping-pong ring on one stage (what fits at 1B shapes)
                      "pingpong_one_stage": dataclasses.replace(PINGPONG, max_concurrent_steps=1),
                      "pingpong_prefetch": dataclasses.replace(PINGPONG, prefetch_next_tile=True),
                      "pingpong_no_gemm": NO_GEMM, "cooperative_ring_no_gemm": NO_GEMM_RING,
                      "pingpong_turns_no_gemm_prefetch": dataclasses.replace(NO_GEMM, pingpong_turns=True,
                                                                              prefetch_next_tile=True),
                      **{f"shipped{i}": c for i, c in enumerate(shipped_rope_grad_configs())}}


@pytest.mark.parametrize("config", _ROPE_GRAD_CONFIGS.values(), ids=list(_ROPE_GRAD_CONFIGS))
def test_rope_grad_pass(config):
    # Ragged M (200 rows), 4 Q, 1 K and 1 V heads of 64; the test configurations, then the tuned ones.
    check_rope_grad_pass(config, 200, 4, 1, 32, 12)


_QUANTIZE_CONFIGS = [("e4m3", SMALL, "e4m3_single"), ("e5m2", WS_N, "e5m2_cooperative"),
                     ("e4m3", PINGPONG, "e4m3_pingpong"), ("e5m2", NO_GEMM, "e5m2_pingpong_no_gemm"),
                     ("e4m3", NO_GEMM_RING, "e4m3_cooperative_ring_no_gemm"),
                     # the next tile's first loads from this tile's epilogue (TuningConfig.prefetch_next_tile)
                     ("e5m2", dataclasses.replace(PINGPONG, prefetch_next_tile=True, epilogue_cols=32),
                      "e5m2_pingpong_prefetch"),
                     *((fp8, c, f"{fp8}_shipped{i}") for fp8 in ("e4m3", "e5m2")
                       for i, c in enumerate(shipped_pass_configs(f"quantize_{fp8}")))]


@pytest.mark.parametrize("fp8,config", [c[:2] for c in _QUANTIZE_CONFIGS], ids=[c[2] for c in _QUANTIZE_CONFIGS])
def test_quantize_pass(fp8, config):
    # Ragged M and N (200 x 320): the attention output's and the last block's gradient's pass;
    # the test configurations, then the tuned ones.
    check_quantize_pass(config, fp8, 200, 320, 14)


_INPUT_NORM_CONFIGS = {"single": SMALL, "cooperative": WS_N, "pingpong": PINGPONG, "pingpong_no_gemm": NO_GEMM,
                       **{f"shipped{i}": c for i, c in enumerate(shipped_pass_configs("rms_input_q8"))}}


@pytest.mark.parametrize("config", _INPUT_NORM_CONFIGS.values(), ids=list(_INPUT_NORM_CONFIGS))
def test_input_norm_pass(config):
    # Ragged M and N (200 x 320): the first FP8 block's h of the embedding's output.
    check_input_norm_pass(config, 200, 320, 15)


def test_input_norm_pass_lowers_for_cuda():
    """The first block's norm-input pass at 1B shapes (``[8192, 2048]`` bf16) passes Mosaic GPU's
    code generation on the heuristic's configuration."""
    m, n = 8192, 2048
    loads = {"x": jax.ShapeDtypeStruct((m, n), BF16), "gamma": jax.ShapeDtypeStruct((n,), F32),
             "h_scale": jax.ShapeDtypeStruct((), F32)}
    _check_pass_lowers_for_cuda(programs.RMS_INPUT_Q8, m, n, loads)


def test_quantize_pass_checks_its_dtype():
    with pytest.raises(ValueError, match="fp8 must be one of"):
        programs.quantize_q8("e3m4")


@pytest.mark.parametrize("name", UNQUANTIZED)
@pytest.mark.parametrize("config", [WS_N8, PINGPONG8], ids=["cooperative", "pingpong"])
def test_unquantized_programs(name, config):
    # The quantizing output comes back as a plain tile (here bf16: no copy, no amax).
    epi = UNQUANTIZED[name]
    assert not any(o.quantize for o in epi.outputs) and epi.name.endswith("_unquantized_fp8")
    outs = {o.name: BF16 for o in epi.outputs if o.kind is OutputKind.TILE}
    _compare(epi, 200, 384, 256, config=config, out_dtypes=outs, seed=35)


def test_unquantized_needs_a_quantizing_output():
    with pytest.raises(ValueError, match="has no quantizing output"):
        E.unquantized(programs.RESIDUAL_RMS)


@pytest.mark.parametrize("config", [*(dataclasses.replace(c, col_sum_tiles=True) for c in (WS_N8, PINGPONG8, SWIZZLED)),
                                    WS_N8], ids=["cooperative", "pingpong", "swizzled", "single_warpgroup_sum"])
def test_dgamma_beside_a_quantizing_dgrad(config):
    # The FP8 block's norm backward: dx (bf16), dx in e5m2 with copy and amax, and dgamma's
    # column sum, on FP8 operands; on the warp-specialized kernels dgamma is written as its
    # summand tile ([M, N] float32 partials), else summed in the single-warpgroup kernel.
    _compare(E.dequantized(programs.rms_dgrad_q8(True)), 200, 320, 256, transpose_b=True, config=config,
             out_dtypes={"dx": BF16}, seed=34)


@pytest.mark.parametrize("save", [True, False], ids=["saved_logits", "recompute"])
def test_fp8_lm_head_on_the_kernel(save, monkeypatch):
    check_fp8_lm_head(136, 128, 320, save, monkeypatch)


def check_fp8_lm_head(m: int, d: int, v: int, save: bool, monkeypatch) -> None:
    """The FP8 LM head (:func:`coda_jax.ops.fp8_cross_entropy.fp8_linear_cross_entropy`) with
    every GEMM on the Pallas kernel against the same op on the ``xla`` backend: loss 1e-4,
    gradients 2e-2 (bf16 operands and outputs, and the e5m2 gradient's 2-bit mantissa: an
    element that rounds the other way moves by a quarter), the histories' gradients (amaxes)
    1e-2. The histories hold amaxes near the tensors' own (scales that use the FP8 range)."""
    from coda_jax.fp8 import Fp8Recipe
    from coda_jax.ops.fp8_cross_entropy import fp8_linear_cross_entropy

    ran = []
    real = PallasLowering.kernel_gemm

    def spy(self, epi, *a, **k):
        ran.append(epi.name)
        return real(self, epi, *a, **k)

    monkeypatch.setattr(PallasLowering, "kernel_gemm", spy)
    k = jax.random.split(jax.random.key(5), 4)
    x = (jax.random.normal(k[0], (m, d)) * 1.5).astype(BF16)
    g = (1 + 0.1 * jax.random.normal(k[1], (d,))).astype(BF16)
    w = (jax.random.normal(k[2], (v, d)) * d ** -0.5 * 3).astype(BF16)
    t = jax.random.randint(k[3], (m,), 0, v)
    amax_g = 1.0 / m  # |rstd * dlogits| <= rstd / M: rstd ~ 1/1.5 here
    meta = jnp.ones((3, 4), F32) * jnp.asarray([[6.0], [1.0], [amax_g]], F32)

    def run(backend):
        def f(x, g, w, meta):
            return fp8_linear_cross_entropy(x, g, w, t, meta, recipe=Fp8Recipe(), save_logits=save, backend=backend)
        return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))(x, g, w, meta)

    with cj.options(routing=cj.RoutingOptions(plain_gemm="kernel")):  # its plain FP8 GEMMs too
        got = run("pallas")
    with interpret_mode(False):
        want = run("xla")
    kernels = {"rms_lse_logits_fp8", "ce_grad_q8", "identity_fp8"} if save else {"rms_lse_fp8", "ce_grad_fp8", "accumulate_fp8",
                                                                   "identity_fp8"}
    assert kernels <= set(ran), ran
    assert abs(float(got[0]) / float(want[0]) - 1) < 1e-4
    for name, a, b in zip(("dx", "dgamma", "dw"), got[1][:3], want[1][:3]):
        assert bool(jnp.all(jnp.isfinite(a.astype(F32)))), name
        assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))
    np.testing.assert_allclose(got[1][3], want[1][3], rtol=1e-2)


def _kernel_module(epi, m, n, k, config, out_dtypes=None, promote_k=0) -> str:
    """The Mosaic GPU module of ``epi``'s FP8 kernel under ``config`` (lowered for CUDA on the
    CPU; the module as Pallas hands it to Mosaic GPU, read as ``benchmarks/kernel_module_stats.py``
    reads it), as text; ``promote_k``: the accumulator promoted every that many K elements."""
    from benchmarks.kernel_module_stats import captured_modules

    a, b = jax.ShapeDtypeStruct((m, k), E5M2), jax.ShapeDtypeStruct((n, k), E4M3)
    loads = abstract_loads(epi, m, n)
    loads.update({l.name: jax.ShapeDtypeStruct((), F32) for l in epi.loads if l.kind is LoadKind.SCALAR})
    low = PallasLowering(config, plain_gemm="kernel")
    try:
        with interpret_mode(False), captured_modules() as modules:
            jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes=out_dtypes,
                                             promote_k=promote_k)).trace(a, b, loads).lower(lowering_platforms=("cuda",))
    except RuntimeError as e:
        if "_run_serde_pass" in str(e):
            pytest.skip(str(e))
        raise
    assert len(modules) == 1, len(modules)
    return modules[0]


@pytest.mark.parametrize("program", ["swiglu_dgrad_q8", "residual_rms_q8"])
def test_manual_barriers_leave_two_a_chunk(program):
    """TuningConfig.manual_barriers on the ping-pong kernel at 1B shapes: the quantizing SwiGLU
    backward (8 chunks a consumer tile: 16-column slices of its pair blocks) and the O
    projection's epilogue lower with at most two warpgroup barriers a chunk and a few a tile,
    where Pallas's automatic barriers put several times as many."""
    epi, kw = {"swiglu_dgrad_q8": (E.dequantized(programs.SWIGLU_DGRAD_Q8), {}),
               "residual_rms_q8": (E.dequantized(programs.RESIDUAL_RMS_Q8), {"x": BF16})}[program]
    auto = for_fp8_operands(dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None))
    manual = dataclasses.replace(auto, manual_barriers=True)
    m, n, k = 8192, 2048, 2048
    shape = KernelShape(m=m, n=n, k=k, m_real=m, n_real=n, transpose_a=False, transpose_b=True,
                        operand_dtype=jnp.dtype(E5M2), out_dtypes=tuple((o.name, BF16) for o in epi.outputs),
                        num_sms=132)
    load_dtypes = tuple((l.name, jnp.dtype(BF16 if l.kind is LoadKind.TILE else F32)) for l in epi.loads)
    planned = plan_kernel(epi, shape, manual, load_dtypes)
    chunks = len(_chunks(epi, planned.tile_n, planned.epilogue_cols))
    n_auto = _kernel_module(epi, m, n, k, auto, kw or None).count("bar.sync")
    n_manual = _kernel_module(epi, m, n, k, manual, kw or None).count("bar.sync")
    assert n_manual <= 2 * chunks + 4 and 3 * n_manual < n_auto, (chunks, n_manual, n_auto)


@pytest.mark.parametrize("kernel", ["pingpong", "cooperative", "ring", "single"])
def test_fp8_byte_transpose_lowers_for_cuda(kernel):
    """TuningConfig.fp8_byte_transpose: the quantizing SwiGLU backward's transposed e5m2 copy
    relaid from the FP8 values (one shuffle and one byte permute per two of a thread's
    vectors) lowers for CUDA on every kernel; the float32 relayout's selects and its second
    FP8 cast are gone. The GPU suite checks the copies' bits (tests/test_gpu_pallas_fp8.py)."""
    epi = E.dequantized(programs.SWIGLU_DGRAD_Q8)
    d = CONFIG_TABLE["default"]
    base = for_fp8_operands({"pingpong": dataclasses.replace(d, schedule="pingpong", cluster_dimension=None),
                             "cooperative": d, "ring": dataclasses.replace(d, delay_release=1),
                             "single": CONFIG_TABLE["small"]}[kernel])
    m, n, k = 8192, 2048, 2048
    f32_relayout = _kernel_module(epi, m, n, k, base)
    byte_relayout = _kernel_module(epi, m, n, k, dataclasses.replace(base, fp8_byte_transpose=True))
    count = lambda txt, what: txt.count(what)  # noqa: E731
    assert count(f32_relayout, "prmt.b32") == 0 and count(byte_relayout, "prmt.b32") > 0
    assert count(byte_relayout, "arith.select") * 4 < count(f32_relayout, "arith.select")
    # Each e5m2 value is cast once (two layouts of two pair halves: half the pairwise casts).
    assert 2 * count(byte_relayout, "cvt.rn.satfinite.e5m2x2") == count(f32_relayout, "cvt.rn.satfinite.e5m2x2")


def test_folded_row_reductions_shuffle_once_a_tile():
    """TuningConfig.fold_row_reductions on the quantizing SwiGLU backward (an amax and the
    row sum ``zdz``, eight 16-column chunks a consumer tile): the module lowers for CUDA with a
    fraction of the lane shuffles, which now run once a tile."""
    epi = E.dequantized(programs.SWIGLU_DGRAD_Q8)
    base = for_fp8_operands(dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None,
                                                fp8_byte_transpose=True))
    m, n, k = 8192, 2048, 2048
    per_chunk = _kernel_module(epi, m, n, k, base).count("nvvm.shfl.sync")
    folded = _kernel_module(epi, m, n, k, dataclasses.replace(base, fold_row_reductions=True))
    assert 3 * folded.count("nvvm.shfl.sync") < per_chunk, (folded.count("nvvm.shfl.sync"), per_chunk)


def test_rope_grad_pass_keeps_ping_pong_at_1b_shapes():
    """The QKV gradient's pass at 1B shapes (two bf16 tile loads, cos/sin row blocks, an e5m2
    output with its copy): its staging leaves no room for two operand stages beside it, and a
    pass has one K step, so the ping-pong ring runs on one stage rather than falling back to
    the single-warpgroup kernel."""
    epi = programs.rope_grad_q8(32)
    m, n = 8192, 3072
    shape = KernelShape(m=m, n=n, k=64, m_real=m, n_real=n, transpose_a=False, transpose_b=True,
                        operand_dtype=jnp.dtype(BF16), out_dtypes=(("dz", jnp.dtype(E5M2)), ("zdz", jnp.dtype(F32))),
                        num_sms=132)
    ldt = tuple((l.name, jnp.dtype(BF16 if l.kind is LoadKind.TILE else F32)) for l in epi.loads)
    cfg = plan_kernel(epi, shape, dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong",
                                                      cluster_dimension=None), ldt)
    assert cfg.warp_specialized and cfg.pingpong and cfg.max_concurrent_steps == 1, cfg
    # A GEMM with more than one K step never gets one stage.
    long_k = plan_kernel(epi, dataclasses.replace(shape, k=128), dataclasses.replace(cfg, max_concurrent_steps=4), ldt)
    assert long_k.max_concurrent_steps >= 2 or not long_k.warp_specialized, long_k


@pytest.mark.parametrize("config", ["pingpong", "cooperative"])
def test_consumer_col_sums_keep_two_consumers(config):
    """TuningConfig.consumer_col_sums: the FP8 norm backward with ``dgamma`` (a column sum)
    plans to the warp-specialized kernel and gives the reference's results (ragged M and N;
    the interpreter sums plainly), and lowers for CUDA with each consumer's own scratch."""
    base = PINGPONG8 if config == "pingpong" else WS_N8
    cfg = dataclasses.replace(base, consumer_col_sums=True)
    epi = E.dequantized(programs.rms_dgrad_q8(True))
    _compare(epi, 200, 384, 256, config=cfg, out_dtypes={"dx": BF16}, seed=31)
    m, n, k = 2048, 2048, 1024
    shape = KernelShape(m=m, n=n, k=k, m_real=m, n_real=n, transpose_a=False, transpose_b=True,
                        operand_dtype=jnp.dtype(E5M2), out_dtypes=(("dx", jnp.dtype(BF16)), ("dxq", jnp.dtype(E5M2)),
                                                                   ("dgamma", jnp.dtype(F32))), num_sms=132)
    ldt = tuple((l.name, jnp.dtype(BF16 if l.kind is LoadKind.TILE else F32)) for l in epi.loads)
    big = for_fp8_operands(dataclasses.replace(CONFIG_TABLE["default"], consumer_col_sums=True,
                                               **({"schedule": "pingpong", "cluster_dimension": None}
                                                  if config == "pingpong" else {})))
    assert plan_kernel(epi, shape, big, ldt).warp_specialized
    assert not plan_kernel(epi, shape, dataclasses.replace(big, consumer_col_sums=False), ldt).warp_specialized
    # It lowers (one Mosaic GPU module) as a warp-specialized kernel: its consumers raise their registers.
    assert "setmaxnreg.inc" in _kernel_module(epi, m, n, k, big, {"dx": BF16})


def test_consumer_col_sums_keep_a_promoting_kernels_dgamma_in_the_kernel():
    """A promoting FP8 norm backward with ``dgamma`` (the long-K gate/up dgrad) on the cooperative
    ring: without TuningConfig.consumer_col_sums it writes ``dgamma`` as a float32 summand tile
    (``[M, N]``, summed outside); with it the two consumers sum it in the kernel, and the kernel
    lowers for CUDA (the autotuner's ``ring_deep*_sums`` candidates)."""
    from coda_jax.pallas.autotune import PROMOTED_CANDIDATES
    from coda_jax.pallas.gemm_epilogue import plan_epilogue

    epi = E.dequantized(programs.rms_dgrad_q8(True))
    m, n, k, promote_k = 2048, 2048, 2048, 512
    shape = KernelShape(m=m, n=n, k=k, m_real=m, n_real=n, transpose_a=False, transpose_b=True,
                        operand_dtype=jnp.dtype(E5M2), out_dtypes=(("dx", jnp.dtype(BF16)), ("dxq", jnp.dtype(E5M2)),
                                                                   ("dgamma", jnp.dtype(F32))), num_sms=132,
                        promote_k=promote_k)
    ldt = tuple((l.name, jnp.dtype(BF16 if l.kind is LoadKind.TILE else F32)) for l in epi.loads)
    for name in ("ring_deep_sums", "ring_deep_no_cluster_sums"):
        cfg = for_fp8_operands(PROMOTED_CANDIDATES[name])
        ran, planned = plan_epilogue(epi, shape, cfg, ldt)
        assert ran is epi and planned.warp_specialized and planned.consumer_col_sums, name
        tiles, planned = plan_epilogue(epi, shape, dataclasses.replace(cfg, consumer_col_sums=False), ldt)
        assert planned.warp_specialized and tiles.output("dgamma").kind is OutputKind.TILE, name
    module = _kernel_module(epi, m, n, k, cfg, {"dx": BF16}, promote_k=promote_k)
    assert "setmaxnreg.inc" in module
    # In the interpreter (whose sums share nothing): the reference's results, ragged, two groups.
    _compare(epi, 200, 384, 1024, config=cfg, out_dtypes={"dx": BF16}, seed=33, promote_k=promote_k)
