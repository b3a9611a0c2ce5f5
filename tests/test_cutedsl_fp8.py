"""The CuTeDSL backend's FP8 path: FP8 operands (K-major e4m3 / e5m2, mixed allowed) and
quantizing outputs (``epilogue.fp8_out``: the FP8 tile, its transposed copy, its amax).

CPU (CI, like ``test_cutedsl_lowering.py``: skipped where ``cutlass`` cannot be imported): with
``CUTE_DSL_ARCH=sm_90a`` every supported configuration traces and lowers for CUDA (CuTeDSL
compiles each kernel to a cubin while JAX lowers the custom call): every FP8 program of
``programs.py`` on FP8 and bf16 operands, with the automatic tile, 128 x 256 and the ping-pong
schedule, and probes for the other epilogue paths (pair mode, ``half_acc`` with whole-tile
staging, odd pair blocks, outputs stored element by element); ``CuteDslLowering.fp8_rule``
accepts and rejects what it should, with its messages.

GPU (``@pytest.mark.gpu``, Hopper; skipped elsewhere): the kernel against
``coda_jax.reference.REFERENCE.gemm`` of the same program on the same fresh random inputs:
dequantized (plain) outputs within relative error 1e-2, FP8 outputs and transposed copies
bit-equal on >= 99 % of their elements, the max of the amax partials within rtol 1e-3.
"""

import os
import shutil

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass")
pytest.importorskip("cutlass.jax")

from coda_jax import backend as B  # noqa: E402
from coda_jax import epilogue as E  # noqa: E402
from coda_jax import programs as P  # noqa: E402
from coda_jax.epilogue import OutputKind  # noqa: E402
from coda_jax.reference import REFERENCE  # noqa: E402
from op_cases import abstract_loads, poison_allocator, reduced_output, rel_err  # noqa: E402

BF = jnp.bfloat16
F32 = jnp.float32
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
TOL = 1e-2


@pytest.fixture(autouse=True)
def _cutedsl_without_gpu(monkeypatch):
    """Lets backend='cutedsl' resolve on a machine without a GPU (we only lower)."""
    real = B.backend_unavailable_reason
    monkeypatch.setattr(B, "backend_unavailable_reason", lambda n: None if n == "cutedsl" else real(n))


def _lower(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _spy(monkeypatch):
    """Records the KernelPlan of every kernel built (the lowering's kernel cache emptied)."""
    from coda_jax.ffi import kernel as K
    from coda_jax.ffi import lowering as L

    L._build.cache_clear()
    plans = []
    real = K.build_launcher
    monkeypatch.setattr(K, "build_launcher", lambda e, t, plan: plans.append(plan) or real(e, t, plan))
    return plans


def _plain_dtypes(epi, dtype=BF) -> dict:
    """``out_dtypes`` for the tile outputs of ``epi`` that declare no dtype (they would take the
    FP8 operand dtype), as the FP8 block passes them."""
    return {o.name: dtype for o in epi.outputs if o.kind is OutputKind.TILE and o.dtype is None}


def _abstract(epi, m, n, k, da=E4M3, db=E4M3):
    a, b = jax.ShapeDtypeStruct((m, k), da), jax.ShapeDtypeStruct((n, k), db)
    return a, b, abstract_loads(epi, m, n)


def _kernel(tuning=None):
    from coda_jax.ffi.lowering import CuteDslLowering

    return CuteDslLowering(tuning, plain_gemm="kernel", fp8_kernel=True)


# ------------------------------------------------------------- FP8 operands ---------
@pytest.mark.parametrize("da,db", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)],
                         ids=["e4m3-e4m3", "e5m2-e4m3", "e4m3-e5m2", "e5m2-e5m2"])
def test_fp8_operands_lower(da, db, monkeypatch):
    """The dequantized identity on FP8 operands of either format (mixed too): one CuTeDSL
    kernel, K padded to its 128-element K-tile, the plan naming both operand dtypes."""
    plans = _spy(monkeypatch)
    epi = E.dequantized(P.IDENTITY)
    m, n, k = 200, 300, 136
    a, b, loads = _abstract(epi, m, n, k, da, db)
    low = _kernel()
    txt = _lower(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes={"out": BF}), a, b, loads)
    assert "CuteDSL" in txt
    (plan,) = plans
    assert plan.tile_k == 128 and plan.k == 256 and plan.operand_dtypes == (da, db)


_FP8_PROGRAMS = [P.IDENTITY, P.RESIDUAL_RMS, P.rms_swiglu(True), P.rms_dgrad(True), P.SWIGLU_DGRAD, P.RMS_LSE,
                 P.RMS_LSE_LOGITS, P.CE_GRAD, P.ACCUMULATE,  # the FP8 LM head's
                 P.rms_rope(64, 1e-6, True),
                 # current scaling's programs (E.unquantized: the FP8 output written in the compute dtype)
                 E.unquantized(P.rms_swiglu_q8(True)), E.unquantized(P.SWIGLU_DGRAD_Q8)]


@pytest.mark.parametrize("tuning", ["auto", "256", "pingpong"])
@pytest.mark.parametrize("inner", _FP8_PROGRAMS, ids=lambda e: e.name)
def test_dequantized_programs_lower(inner, tuning):
    """Every kind of epilogue (chunked, pair mode, half_acc, row reductions) on FP8 operands,
    with the automatic tile, 128 x 256 and the ping-pong schedule (where the program runs it)."""
    from coda_jax.ffi.tuning import CuteDslTuning

    epi = E.dequantized(inner)
    t = {"auto": CuteDslTuning(), "256": CuteDslTuning(tile_n=256),
         "pingpong": CuteDslTuning(schedule="pingpong")}[tuning]
    m, n, k = 200, (256 if epi.pair_block else 300), 136
    a, b, loads = _abstract(epi, m, n, k)
    low = _kernel(t)
    txt = _lower(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes=_plain_dtypes(epi)), a, b, loads)
    assert "CuteDSL" in txt


def test_fp8_smem_plan_matches_bf16():
    """An FP8 K-tile (128 elements) holds the bytes of a bf16 one (64): the same stages fit."""
    from coda_jax.ffi import kernel as K

    assert K.tile_k(1) == 128 and K.tile_k(2) == 64
    for epi in (P.IDENTITY, P.RESIDUAL_RMS, P.rms_dgrad(True)):
        dts = tuple((o.name, jnp.dtype(o.dtype or BF)) for o in epi.outputs)
        for tn in (128, 256):
            assert K.plan_smem(epi, tn, 1, dts) == K.plan_smem(epi, tn, 2, dts)
        assert K.choose_tile_n(epi, 8192, 8192, 1, dts, 132) == K.choose_tile_n(epi, 8192, 8192, 2, dts, 132)


# ------------------------------------------------------------------ fp8_rule -------
def _rule(epi, ta=False, tb=True, da=E4M3, db=E4M3):
    from coda_jax.ffi.lowering import CuteDslLowering

    m, n, k = 256, 256, 128
    a = jnp.zeros((k, m) if ta else (m, k), da)
    b = jnp.zeros((n, k) if tb else (k, n), db)
    return CuteDslLowering(fp8_kernel=True).fp8_rule(epi, a, b, ta, tb)


def test_fp8_rule_accepts_k_major_operands():
    for da, db in [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)]:
        assert _rule(E.dequantized(P.IDENTITY), da=da, db=db) is None
    assert _rule(E.dequantized(P.rms_swiglu(True))) is None
    assert _rule(P.IDENTITY, da=BF, db=BF, tb=False) is None  # not an FP8 GEMM: nothing to refuse


@pytest.mark.parametrize("ta,tb", [(True, True), (False, False), (True, False)], ids=["a_t", "b_kn", "both"])
def test_fp8_rule_refuses_mn_major_operands(ta, tb):
    why = _rule(E.dequantized(P.IDENTITY), ta, tb)
    assert why is not None and "K-major" in why and "transpose_a=False" in why and "transpose_b=True" in why
    assert ("a [K, M]" if ta else "a [M, K]") in why and ("b [N, K]" if tb else "b [K, N]") in why


def test_fp8_rule_accepts_quantizing_outputs():
    for epi in _Q8_PROGRAMS:
        assert _rule(E.dequantized(epi)) is None
        assert _rule(epi, da=BF, db=BF, tb=False) is None  # bf16 operands: any layout
    why = _rule(E.dequantized(P.RESIDUAL_RMS_Q8), tb=False)  # FP8 operands: still K-major only
    assert why is not None and "K-major" in why


def test_refused_fp8_gemm_runs_on_xla():
    """A refused FP8 GEMM (b [K, N]) goes to XLA's FP8 GEMM: no CuTeDSL custom call, the
    reference's values."""
    epi = E.dequantized(P.IDENTITY)
    a = (jax.random.normal(jax.random.key(0), (128, 128)) * 2).astype(E4M3)
    b = (jax.random.normal(jax.random.key(1), (128, 256)) * 2).astype(E4M3)
    s = jnp.float32(0.5)
    low = _kernel()
    f = lambda a, b, s: low.gemm(epi, a, b, {"acc_scale": s}, out_dtypes={"out": F32})["out"]
    assert "CuteDSL" not in _lower(f, a, b, s)
    want = REFERENCE.gemm(epi, a, b, {"acc_scale": s}, out_dtypes={"out": F32})["out"]
    np.testing.assert_allclose(np.asarray(jax.jit(f)(a, b, s)), np.asarray(want), rtol=2e-2, atol=1e-2)


# ------------------------------------------------------- quantizing outputs --------
_Q8_PROGRAMS = [P.RESIDUAL_RMS_Q8, P.rms_swiglu_q8(True), P.rms_swiglu_q8(False), P.SWIGLU_DGRAD_Q8,
                P.rms_dgrad_q8(True), P.rms_dgrad_q8(False), P.CE_GRAD_Q8,
                P.rms_swiglu_q8(True, True), P.SWIGLU_DGRAD_ZQ8]  # Fp8Recipe(swiglu_input="e4m3"): z in e4m3


def _q8_probes():
    """Quantizing outputs on the epilogue paths the programs above do not take:

    * ``q_half_acc32``: ``half_acc`` with pair block 32 (not chunked: whole-tile staging,
      the lo / hi blocks of the FP8 tile written by one vectorized copy each), e5m2;
    * ``q_pair_full``: a full-width FP8 output in pair mode (the register pair exchange);
    * ``q_odd_half``: pair block 12 (SMEM exchange) with a half-width FP8 output 72 columns
      wide per tile: not whole 16-byte rows, so nothing is staged (element-wise stores);
    * ``q_unstaged``: four float32 outputs beside the FP8 one, too big to stage beside 3
      operand stages: element-wise stores of the FP8 tile and its transposed copy;
    * ``q_two``: two quantizing outputs of one scale, one without transpose or amax.
    """
    s = E.scalar("s")
    return [
        E.Epilogue("q_half_acc32", (s,), (E.fp8_out("y", E5M2, scale="s", transpose=True), E.row_sum("r")),
                   lambda acc, ctx, s: {"y": (acc * 2.0, acc - 1.0), "r": (acc, acc)}, pair_block=32, half_acc=True),
        E.Epilogue("q_pair_full", (s,), (E.fp8_out("y", E4M3, scale="s", transpose=True),),
                   lambda acc, ctx, s: {"y": (acc[0] * acc[1], acc[1] + 1.0)}, pair_block=64),
        E.Epilogue("q_odd_half", (s, E.row("rstd")), (E.fp8_out("y", E4M3, scale="s", transpose=True, half=True),
                                                      E.row_sum("t")),
                   lambda acc, ctx, s, rstd: {"y": acc[0] * acc[1] * rstd, "t": acc[0]}, pair_block=12),
        E.Epilogue("q_unstaged", (s,), tuple(E.tile_out(f"o{i}", F32) for i in range(4))
                   + (E.fp8_out("q", E4M3, scale="s", transpose=True),),
                   lambda acc, ctx, s: {**{f"o{i}": acc * (i + 1.0) for i in range(4)}, "q": acc}),
        E.Epilogue("q_two", (s,), (E.fp8_out("q", E4M3, scale="s", transpose=False, amax=False),
                                   E.fp8_out("p", E5M2, scale="s", transpose=True)),
                   lambda acc, ctx, s: {"q": acc, "p": -3.0 * acc}),
    ]


def _q8_n(epi) -> int:
    return 288 if epi.pair_block == 12 else 256 if epi.pair_block else 300


def _check_results(epi, out_info, m, n, tile_n):
    """The results of a quantizing program: the FP8 tile, its transposed copy [N, M], one
    float32 amax partial per 128 x tile_n tile."""
    assert set(out_info) == set(epi.result_names())
    tiles = -(-m // 128) * -(-n // tile_n)
    for o in epi.outputs:
        if o.quantize is None:
            continue
        w = epi.width(n, o.half)
        assert (out_info[o.name].shape, out_info[o.name].dtype) == ((m, w), o.dtype)
        if o.quantize.transpose:
            assert (out_info[f"{o.name}_t"].shape, out_info[f"{o.name}_t"].dtype) == ((w, m), o.dtype)
        if o.quantize.amax:
            assert (out_info[f"{o.name}_amax"].shape, out_info[f"{o.name}_amax"].dtype) == ((tiles,), F32)


@pytest.mark.parametrize("operands", ["fp8", "bf16"])
@pytest.mark.parametrize("tuning", ["auto", "256", "pingpong"])
@pytest.mark.parametrize("inner", _Q8_PROGRAMS, ids=lambda e: e.name)
def test_quantizing_programs_lower(inner, tuning, operands, monkeypatch):
    """Every FP8 program of programs.py (dequantized on FP8 operands, and as it is on bf16
    operands) lowers on the kernel, with its results' shapes."""
    from coda_jax.ffi.tuning import CuteDslTuning

    plans = _spy(monkeypatch)
    epi = E.dequantized(inner) if operands == "fp8" else inner
    t = {"auto": CuteDslTuning(), "256": CuteDslTuning(tile_n=256),
         "pingpong": CuteDslTuning(schedule="pingpong")}[tuning]
    m, n, k = 200, _q8_n(epi), 136
    dt = E4M3 if operands == "fp8" else BF
    a, b, loads = _abstract(epi, m, n, k, dt, dt)
    low = _kernel(t)
    f = lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes=_plain_dtypes(epi))
    traced = jax.jit(f).trace(a, b, loads)
    assert "CuteDSL" in traced.lower(lowering_platforms=("cuda",)).as_text()
    (plan,) = plans
    assert plan.stage_outputs
    _check_results(epi, traced.out_info, m, n, plan.tile_n)


@pytest.mark.parametrize("tuning", ["auto", "256", "pingpong"])
@pytest.mark.parametrize("probe", _q8_probes(), ids=lambda e: e.name)
def test_quantizing_probes_lower(probe, tuning, monkeypatch):
    from coda_jax.ffi.tuning import CuteDslTuning

    plans = _spy(monkeypatch)
    t = {"auto": CuteDslTuning(), "256": CuteDslTuning(tile_n=256),
         "pingpong": CuteDslTuning(schedule="pingpong")}[tuning]
    m, n, k = 200, _q8_n(probe), 136
    a, b = jax.ShapeDtypeStruct((m, k), BF), jax.ShapeDtypeStruct((k, n), BF)
    low = _kernel(t)
    traced = jax.jit(lambda a, b, l: low.gemm(probe, a, b, l)).trace(a, b, abstract_loads(probe, m, n))
    assert "CuteDSL" in traced.lower(lowering_platforms=("cuda",)).as_text()
    (plan,) = plans
    assert plan.stage_outputs is (probe.name not in ("q_odd_half", "q_unstaged")), plan
    _check_results(probe, traced.out_info, m, n, plan.tile_n)


def test_quantizing_smem_plan():
    """A transposed copy has a staging ring (or tile) of its own, as big as its output's;
    the amax partials take one scratch float per consumer warp; FP8 staging rows must be
    whole 16-byte units."""
    from coda_jax.ffi import kernel as K

    epi = P.RESIDUAL_RMS_Q8
    staged = K.staged_outputs(epi, 256)
    assert [(name, w, nbuf, tr) for _, name, _, w, nbuf, tr in staged] == [
        ("x", 64, 2, False), ("h", 64, 2, False), ("h_t", 64, 2, True)]
    dts = (("x", BF), ("h", E4M3), ("sumsq", F32))
    assert K.staging_sizes(epi, 256, dts) == [128 * 64 * 2 * 2, 128 * 64 * 2, 128 * 64 * 2]
    assert K.scratch_len(epi, 256) == 1 + K.AMAX_SLOTS
    assert K.scratch_len(P.RESIDUAL_RMS, 256) == 1
    sdq = K.staged_outputs(P.SWIGLU_DGRAD_Q8, 256)  # half_acc: lo and hi rings, each transposed too
    assert [(name, part, tr) for _, name, part, _, _, tr in sdq] == [
        ("dz", 0, False), ("dz", 1, False), ("dz_t", 0, True), ("dz_t", 1, True)]
    odd = _q8_probes()[2]
    dts = (("y", E4M3), ("t", F32))
    assert not K.staging_aligned(odd, 144, dts) and K.plan_smem(odd, 144, 2, dts)[1] is False
    assert K.staging_aligned(P.rms_swiglu_q8(False), 128, (("y", E4M3),))
    # FP8 programs take the tiles their bf16 versions take (P.SWIGLU_DGRAD_Q8 too: 256 wide)
    for q8, plain in ((P.RESIDUAL_RMS_Q8, P.RESIDUAL_RMS), (P.SWIGLU_DGRAD_Q8, P.SWIGLU_DGRAD),
                      (P.rms_dgrad_q8(False), P.rms_dgrad(True))):
        pick = lambda e: K.choose_tile_n(e, 8192, 8192, 2, tuple((o.name, jnp.dtype(o.dtype or BF)) for o in e.outputs),
                                         132)
        assert pick(q8) == pick(plain) == 256


@pytest.mark.parametrize("inner", [P.IDENTITY, P.rms_dgrad_q8(True)], ids=lambda e: e.name)
def test_promoted_fp8_gemms_lower(inner, monkeypatch):
    """``promote_k`` on FP8 operands: the kernel adds its accumulator into a float32 total
    every ``promote_k / 128`` K-tiles, on the cooperative schedule's narrow tile whatever the
    tuning asks (the total doubles the accumulator's registers), and lowers; 16-bit operands
    are never promoted; a ``promote_k`` that is not a multiple of the K-tile is refused."""
    from coda_jax.ffi import kernel as K
    from coda_jax.ffi.tuning import CuteDslTuning

    plans = _spy(monkeypatch)
    epi = E.dequantized(inner)
    m, n, k = 200, 300, 1100  # 9 K-tiles: two groups of 4 and one of 1
    a, b, loads = _abstract(epi, m, n, k)
    for tuning in (CuteDslTuning(schedule="pingpong"), CuteDslTuning(tile_n=256)):
        low = _kernel(tuning)
        f = lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes=_plain_dtypes(epi),  # noqa: E731
                                     promote_k=512)
        assert "CuteDSL" in _lower(f, a, b, loads)
    assert {(p.promote_every, p.tile_n, p.pingpong) for p in plans} == {(4, 128, False)}
    assert K.promotion_tiles(128, 1) == 1 and K.promotion_tiles(512, 2) == 0 and K.promotion_tiles(0, 1) == 0
    with pytest.raises(ValueError, match="promote_k=100 must be a positive multiple"):
        K.promotion_tiles(100, 1)


def _spill_runs():
    """``[(name, lower)]``: every FP8 program on FP8 operands at an 8192^3 GEMM, automatic and
    (where it runs) ping-pong (:func:`cutedsl_spills.kernel_spill_lines` runs them)."""
    from coda_jax.ffi.kernel import chunked_epilogue
    from coda_jax.ffi.lowering import CuteDslLowering
    from coda_jax.ffi.tuning import CuteDslTuning

    m = n = k = 8192
    a = jax.ShapeDtypeStruct((m, k), E4M3)
    b = jax.ShapeDtypeStruct((n, k), E4M3)

    def lower(epi, schedule, promote_k=0):
        low = CuteDslLowering(CuteDslTuning(schedule=schedule), plain_gemm="kernel", fp8_kernel=True)
        f = lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True, out_dtypes=_plain_dtypes(epi),  # noqa: E731
                                     promote_k=promote_k)
        return lambda: jax.jit(f).trace(a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",))

    runs = [(E.dequantized(e), s) for e in _Q8_PROGRAMS for s in ("auto", "pingpong") if s == "auto" or chunked_epilogue(e)]
    # and the long-K backward GEMMs' float32 promotion (a second accumulator's registers)
    return ([(f"{epi.name}-{s}", lower(epi, s)) for epi, s in runs]
            + [(f"{e.name}-promoted", lower(E.dequantized(e), "auto", 512)) for e in (P.IDENTITY, P.rms_dgrad_q8(True))])


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit) on PATH")
def test_quantizing_kernels_do_not_spill(tmp_path):
    """Every FP8 program on FP8 operands at an 8192^3 GEMM (its automatic tile, and the
    ping-pong schedule where it runs) compiles for sm_90a without register spills (as
    ``test_cutedsl_lowering.test_kernels_do_not_spill``; the transposed copy's swizzled
    staging spilled 380 bytes in ``swiglu_dgrad_q8`` at 128 x 256 before it was unswizzled).
    Skipped where ptxas is older than the PTX CuTeDSL writes."""
    from cutedsl_spills import assert_no_spills, kernel_spill_lines

    assert_no_spills(kernel_spill_lines(tmp_path, "test_cutedsl_fp8:_spill_runs"))


# --------------------------------------------------------------------- GPU ---------
def _fp8_operands(m, n, k, seed, da=E4M3, db=E4M3):
    """Fresh random ``a`` ``[M, K]`` and ``b`` ``[N, K]`` in FP8 (values spread over the
    format's range) and an ``acc_scale`` that brings the product back to O(1)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    a = (8.0 * jax.random.normal(ka, (m, k), F32)).astype(da)
    b = (8.0 * jax.random.normal(kb, (n, k), F32)).astype(db)
    return a, b, jnp.float32(1.0 / (64.0 * k ** 0.5))


def _gpu_loads(epi, m, n, seed):
    """Random loads (tests/test_pallas_kernels.py's rules); scalar loads 1 (the scales are
    set from the reference's amax)."""
    from test_pallas_kernels import _loads

    loads = _loads(epi, m, n, jax.random.key(seed + 100))
    scalars = set(epi.load_names(E.LoadKind.SCALAR))
    loads = {k: (jnp.float32(1.0) if k in scalars else v) for k, v in loads.items()}
    if "z_scale_inv" in scalars:  # z saved in e4m3 (P.SWIGLU_DGRAD_ZQ8)
        loads["z"] = loads["z"].astype(E4M3)
    return loads


def _fp8_equal(got, want) -> float:
    """The fraction of elements with equal FP8 bits."""
    g, w = np.asarray(got), np.asarray(want)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    return float(np.mean(g.view(np.uint8) == w.view(np.uint8)))


def _check_against_reference(epi, got, want, *, tol=TOL, equal=0.99):
    assert set(got) == set(want) == set(epi.result_names()), (sorted(got), sorted(want))
    for o in epi.outputs:
        if o.quantize is not None:
            names = (o.name,) + ((f"{o.name}_t",) if o.quantize.transpose else ())
            for name in names:
                frac = _fp8_equal(got[name], want[name])
                assert frac >= equal, f"{epi.name}.{name}: {frac:.4%} of FP8 elements equal"
            if o.quantize.transpose:  # written from the same registers: the same bits, transposed
                assert _fp8_equal(got[f"{o.name}_t"], jnp.asarray(got[o.name]).T) == 1.0, f"{epi.name}.{o.name}_t"
            if o.quantize.amax:
                g, w = float(jnp.max(got[f"{o.name}_amax"])), float(want[f"{o.name}_amax"][0])
                np.testing.assert_allclose(g, w, rtol=1e-3, err_msg=f"{epi.name}.{o.name}_amax")
            continue
        g, w = reduced_output(o.kind, got[o.name]), reduced_output(o.kind, want[o.name])
        if o.kind is OutputKind.TILE:
            assert g.shape == w.shape and g.dtype == w.dtype, (o.name, g.shape, w.shape, g.dtype, w.dtype)
        e = rel_err(g, w)
        assert e <= tol, f"{epi.name}.{o.name}: rel err {e:.3g}"


def _with_scales(epi, run_ref, loads):
    """``loads`` with each quantizing output's scale chosen from the reference's amax so that
    the values use the FP8 range and the largest third of them saturate (``1.5 * fmax /
    amax``)."""
    probe = run_ref(loads)
    scales: dict = {}
    for o in epi.outputs:
        if o.quantize is not None:
            amax = (probe[f"{o.name}_amax"] if o.quantize.amax  # else the scale-1 FP8 values themselves
                    else jnp.abs(jnp.asarray(probe[o.name], F32)))
            s = 1.5 * float(jnp.finfo(o.dtype).max) / max(float(jnp.max(amax)), 1e-30)
            scales[o.quantize.scale] = min(s, scales.get(o.quantize.scale, s))  # a shared scale: the smallest
    return {**loads, **{k: jnp.float32(v) for k, v in scales.items()}}
    return loads


def _compare_fp8(inner, m, n, k, seed=0, da=E4M3, db=E4M3, tuning=None, operands="fp8", edit_loads=None,
                 promote_k=0):
    """The kernel against the reference on the same fresh random inputs (FP8 operands through
    ``E.dequantized(inner)``, or bf16 operands through ``inner``): every result. ``promote_k``:
    the kernel's promoted accumulation (the reference then runs at ``Precision.HIGHEST``)."""
    epi = E.dequantized(inner) if operands == "fp8" else inner
    if operands == "fp8":
        a, b, s = _fp8_operands(m, n, k, seed, da, db)
        loads = dict(_gpu_loads(inner, m, n, seed), acc_scale=s)
    else:
        ka, kb = jax.random.split(jax.random.key(seed))
        a = (jax.random.normal(ka, (m, k)) / k ** 0.25).astype(BF)
        b = (jax.random.normal(kb, (n, k)) / k ** 0.25).astype(BF)
        loads = _gpu_loads(inner, m, n, seed)
    kw = dict(transpose_b=True, out_dtypes=_plain_dtypes(epi), promote_k=promote_k)
    if epi.quantizes:
        loads = _with_scales(epi, lambda l: REFERENCE.gemm(epi, a, b, l, **kw), loads)
    if edit_loads is not None:
        loads = edit_loads(loads)
    want = REFERENCE.gemm(epi, a, b, loads, **kw)
    poison_allocator([(m, n)] * (3 * len(epi.outputs)))
    low = _kernel(tuning)
    got = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, **kw))(a, b, loads)
    _check_against_reference(epi, got, want)
    return got, want


def _tuning(name):
    from coda_jax.ffi.tuning import CuteDslTuning

    return {"auto": CuteDslTuning(), "128": CuteDslTuning(tile_n=128), "256": CuteDslTuning(tile_n=256),
            "pingpong": CuteDslTuning(schedule="pingpong")}[name]


@pytest.mark.gpu
@pytest.mark.parametrize("da,db", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["e4m3", "e5m2-e4m3", "e4m3-e5m2"])
def test_fp8_identity_on_gpu(da, db):
    """E.dequantized(IDENTITY) on FP8 operands, bf16 and float32 outputs."""
    _compare_fp8(P.IDENTITY, 2048, 2048, 2048, da=da, db=db)
    epi = E.dequantized(P.IDENTITY)
    a, b, s = _fp8_operands(1024, 768, 512, 9, da, db)
    kw = dict(transpose_b=True, out_dtypes={"out": F32})
    want = REFERENCE.gemm(epi, a, b, {"acc_scale": s}, **kw)["out"]
    got = jax.jit(lambda a, b: _kernel().gemm(epi, a, b, {"acc_scale": s}, **kw))(a, b)["out"]
    assert got.dtype == F32 and rel_err(got, want) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", ["auto", "256"])
def test_fp8_operands_ragged_on_gpu(tile_n):
    """Ragged M, N, K (K not a multiple of the 128-element K-tile), 128- and 256-wide tiles."""
    t = _tuning(tile_n)
    _compare_fp8(P.IDENTITY, 1000, 1500, 520, seed=1, tuning=t)
    _compare_fp8(P.RESIDUAL_RMS, 777, 900, 333, seed=2, tuning=t)
    _compare_fp8(P.rms_swiglu(True), 1000, 1024, 200, seed=3, tuning=t)
    _compare_fp8(P.SWIGLU_DGRAD, 1000, 640, 333, seed=4, tuning=t)


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", ["auto", "128", "256", "pingpong"])
def test_residual_rms_q8_on_gpu(tuning):
    """E.dequantized(RESIDUAL_RMS_Q8): x (bf16), h in e4m3 with its transposed copy and
    amax, the row sums; at 2048^3, then ragged (padded rows and columns masked out of the
    amax)."""
    _compare_fp8(P.RESIDUAL_RMS_Q8, 2048, 2048, 2048, seed=10, tuning=_tuning(tuning))
    _compare_fp8(P.RESIDUAL_RMS_Q8, 1000, 1500, 520, seed=11, tuning=_tuning(tuning))


@pytest.mark.gpu
@pytest.mark.parametrize("inner", _Q8_PROGRAMS[1:], ids=lambda e: e.name)
@pytest.mark.parametrize("tuning", ["auto", "256"])
def test_q8_programs_on_gpu(inner, tuning):
    """The other FP8 programs (pair mode: y half-width in e4m3; half_acc: dz in e5m2; the
    norm backward's dxq beside dx and dgamma) on FP8 operands, square and ragged."""
    n = 1024 if inner.pair_block else 1536
    _compare_fp8(inner, 2048, 2 * n, 1024, seed=12, tuning=_tuning(tuning))
    _compare_fp8(inner, 1000, 640 if inner.pair_block else 900, 333, seed=13, tuning=_tuning(tuning))


@pytest.mark.gpu
@pytest.mark.parametrize("inner", [P.RESIDUAL_RMS_Q8, P.SWIGLU_DGRAD_Q8, P.rms_dgrad_q8(False)], ids=lambda e: e.name)
def test_q8_pingpong_on_gpu(inner):
    """The ping-pong schedule (each warpgroup's own staging rings and amax slots): several
    tiles per CTA, and ragged."""
    _compare_fp8(inner, 4096, 2048, 1024, seed=14, tuning=_tuning("pingpong"))
    _compare_fp8(inner, 1000, 640 if inner.pair_block else 1500, 520, seed=15, tuning=_tuning("pingpong"))


@pytest.mark.gpu
def test_q8_on_bf16_operands_on_gpu():
    """Quantizing outputs of a GEMM of bf16 operands (the block's first h)."""
    _compare_fp8(P.RESIDUAL_RMS_Q8, 1000, 1500, 520, seed=16, operands="bf16")
    _compare_fp8(P.rms_swiglu_q8(True), 1000, 1024, 200, seed=17, operands="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("probe", _q8_probes(), ids=lambda e: e.name)
def test_q8_probes_on_gpu(probe):
    _compare_fp8(probe, 1000, 4 * _q8_n(probe), 320, seed=18, operands="bf16")


@pytest.mark.gpu
def test_q8_amax_keeps_nan_on_gpu():
    """A NaN in the tile makes its amax partial NaN (the recipe skips such steps), and
    nowhere else: the other tiles' partials stay finite."""
    def poison(loads):
        r = loads["residual"]
        return dict(loads, residual=r.at[300, 700].set(jnp.nan))

    epi = E.dequantized(P.RESIDUAL_RMS_Q8)
    a, b, s = _fp8_operands(1024, 1024, 256, 19)
    loads = dict(_gpu_loads(P.RESIDUAL_RMS_Q8, 1024, 1024, 19), acc_scale=s, h_scale=jnp.float32(1.0))
    loads = poison(loads)
    kw = dict(transpose_b=True, out_dtypes=_plain_dtypes(epi))
    got = jax.jit(lambda a, b, l: _kernel().gemm(epi, a, b, l, **kw))(a, b, loads)
    amax = np.asarray(got["h_amax"])
    assert np.isnan(amax).sum() == 1 and np.isnan(np.max(amax))
    assert np.isnan(np.asarray(got["h"][300, 700], F32)) and np.isnan(np.asarray(got["h_t"][700, 300], F32))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [32768, 32768 + 640], ids=["whole_groups", "ragged_last_group"])
def test_promoted_accumulation_on_gpu(k):
    """Promotion every 512 (4 K-tiles) against the tensor core's own FP8 accumulation on
    all-positive e4m3 inputs (every product adds: the worst case for an accumulator that drops
    its addends' low bits), against the exact (float64) product: ten times closer and within
    1e-2, the Pallas kernel's bound (``test_gpu_pallas_fp8.py``); K a whole number of groups,
    and not (the last group's 5 K-tiles: its partial sum added after the loop)."""
    from benchmarks.fp8_accumulation import errors, exact_product, fp8_inputs

    a8, b8 = fp8_inputs(256, 384, k, "positive", seed=5)
    ref = exact_product(a8, b8)
    epi = E.dequantized(P.IDENTITY)
    one = {"acc_scale": jnp.ones((), F32)}

    def product(pk):
        return jax.jit(lambda a, b: _kernel().gemm(epi, a, b, one, transpose_b=True, out_dtypes={"out": F32},
                                                   promote_k=pk)["out"])(a8, b8)

    plain, promoted = errors(product(0), ref)["rel"], errors(product(512), ref)["rel"]
    assert promoted < 1e-2 and promoted < plain / 10, (plain, promoted)


@pytest.mark.gpu
def test_promoted_fused_program_on_gpu():
    """A fused long-K backward program (the gate/up dgrad with the norm backward: dx, its e5m2
    copies and amax, dgamma) promoted every 512, ragged K of 21 K-tiles (five groups and one
    K-tile), against the reference at HIGHEST."""
    _compare_fp8(P.rms_dgrad_q8(True), 1000, 900, 2600, seed=20, promote_k=512)


def test_the_default_lowering_runs_fp8_gemms_on_the_kernel():
    # The default lowering takes K-major FP8 GEMMs; fp8_kernel=False hands them all to XLA.
    from coda_jax.ffi.lowering import CUTEDSL, CuteDslLowering

    a = jnp.zeros((256, 128), E4M3)
    b = jnp.zeros((256, 128), E4M3)
    assert CUTEDSL.fp8_kernel and CUTEDSL.fp8_rule(E.dequantized(P.IDENTITY), a, b, False, True) is None
    assert "fp8_kernel=False" in CuteDslLowering(fp8_kernel=False).fp8_rule(E.dequantized(P.IDENTITY), a, b, False, True)


def test_unscaled_outputs_of_fp8_operands_default_to_bf16():
    """A tile output given no dtype is stored in bf16 on FP8 operands
    (:func:`coda_jax.epilogue.default_out_dtype`), as the reference stores it."""
    from coda_jax.reference import REFERENCE

    epi = E.dequantized(P.rms_dgrad_q8(True))
    a, b, loads = _abstract(epi, 256, 256, 256)
    low = _kernel()
    got = jax.eval_shape(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True), a, b, loads)
    want = jax.eval_shape(lambda a, b, l: REFERENCE.gemm(epi, a, b, l, transpose_b=True), a, b, loads)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert got["dx"].dtype == BF


def test_fp8_model_step_lowers_on_the_fp8_kernel(monkeypatch):
    """A whole FP8 CodaLlama's loss and gradients on ``backend="cutedsl"`` (its FP8 GEMMs on the
    kernel, the default) lower for CUDA with the block's fused FP8 programs on the kernel, the long-K backward
    GEMMs promoted (``Fp8Recipe(promote_min_k=256)``: the wgrads over 256 tokens)."""
    from flax import nnx

    from coda_jax.backend import use_lowering
    from coda_jax.fp8 import Fp8Meta, Fp8Recipe
    from coda_jax.layers import CodaLlama, LlamaConfig

    plans = _spy(monkeypatch)
    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=64, dtype=BF, fp8=Fp8Recipe(promote_min_k=256))
    model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend="cutedsl")
    tokens = jnp.zeros((2, 129), jnp.int32)  # 256 tokens
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
    with use_lowering(_kernel()):
        txt = _lower(lambda m, t: nnx.value_and_grad(lambda mm: mm.loss(t[:, :-1], t[:, 1:]), argnums=wrt)(m),
                     model, tokens)
    assert "CuteDSL" in txt
    fp8 = [p for p in plans if p.operand_dtypes[0] in (E4M3, E5M2)]
    # forward: QKV, O, gate/up, down; backward: down dgrad, gate/up dgrad, O, QKV dgrads; four wgrads
    # the block's 12 FP8 GEMMs; promoted (every 512 / 128 K-tiles) those of the backward with
    # K >= 256: the four wgrads (K = 256 tokens), the gate/up dgrad (K = 2f = 512) and the QKV
    # dgrad (K = the QKV width, 256)
    assert len(fp8) == 12, [(p.m, p.n, p.k) for p in fp8]
    assert sorted(p.promote_every for p in fp8) == [0] * 6 + [4] * 6, [(p.m, p.n, p.k, p.promote_every) for p in fp8]


@pytest.mark.gpu
def test_fp8_model_step_on_the_fp8_kernel_on_gpu():
    """One FP8 step of a 2-layer model on the CuTeDSL kernel's FP8 path (the default) against the ``xla``
    backend's (cuBLASLt FP8 GEMMs, XLA epilogues): :func:`test_fp8.fp8_model_step_against_xla`,
    the long-K backward GEMMs promoted on both (``promote_min_k=1024``: the wgrads over 2048
    tokens)."""
    from coda_jax.backend import use_lowering
    from coda_jax.fp8 import Fp8Recipe
    from coda_jax.layers import LlamaConfig
    from test_fp8 import fp8_model_step_against_xla

    cfg = LlamaConfig.tiny(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                           num_kv_heads=2, head_dim=64, dtype=BF, fp8=Fp8Recipe(promote_min_k=1024))
    tokens = jax.random.randint(jax.random.key(3), (4, 513), 0, cfg.vocab_size)
    fp8_model_step_against_xla("cutedsl", cfg, tokens, lambda: use_lowering(_kernel()))
