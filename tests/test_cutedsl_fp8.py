"""The CuTeDSL backend's FP8 path: FP8 operands (K-major e4m3 / e5m2, mixed allowed).

CPU (CI, like ``test_cutedsl_lowering.py``: skipped where ``cutlass`` cannot be imported): with
``CUTE_DSL_ARCH=sm_90a`` every supported configuration traces and lowers for CUDA (CuTeDSL
compiles each kernel to a cubin while JAX lowers the custom call), and
``CuteDslLowering.fp8_rule`` accepts and rejects what it should, with its messages.

GPU (``@pytest.mark.gpu``, Hopper; skipped elsewhere): the kernel against
``coda_jax.reference.REFERENCE.gemm`` of the same program on the same fresh random FP8 inputs:
dequantized outputs within relative error 1e-2.
"""

import os

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
from op_cases import abstract_loads, poison_allocator, rel_err  # noqa: E402

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
    """Records the KernelPlan of every kernel built."""
    from coda_jax.ffi import kernel as K

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

    return CuteDslLowering(tuning, plain_gemm="kernel")


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
                 P.rms_rope(64, 1e-6, True)]


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
    from coda_jax.ffi.lowering import CUTEDSL

    m, n, k = 256, 256, 128
    a = jnp.zeros((k, m) if ta else (m, k), da)
    b = jnp.zeros((n, k) if tb else (k, n), db)
    return CUTEDSL.fp8_rule(epi, a, b, ta, tb)


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


def test_fp8_rule_refuses_quantizing_outputs():
    why = _rule(E.dequantized(P.RESIDUAL_RMS_Q8))
    assert why is not None and "quantizing" in why and "h" in why


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


# --------------------------------------------------------------------- GPU ---------
def _fp8_operands(m, n, k, seed, da=E4M3, db=E4M3):
    """Fresh random ``a`` ``[M, K]`` and ``b`` ``[N, K]`` in FP8 (values spread over the
    format's range) and an ``acc_scale`` that brings the product back to O(1)."""
    ka, kb = jax.random.split(jax.random.key(seed))
    a = (8.0 * jax.random.normal(ka, (m, k), F32)).astype(da)
    b = (8.0 * jax.random.normal(kb, (n, k), F32)).astype(db)
    return a, b, jnp.float32(1.0 / (64.0 * k ** 0.5))


def _gpu_loads(epi, m, n, seed):
    from test_pallas_kernels import _loads

    return _loads(epi, m, n, jax.random.key(seed + 100))


def _reduced(kind, x):
    if kind in (OutputKind.ROW_SUM, OutputKind.COL_SUM):
        return x.sum(0)
    if kind is OutputKind.ROW_LOGSUMEXP:
        return jax.nn.logsumexp(x, axis=0)
    return x


def _compare_fp8(inner, m, n, k, seed=0, da=E4M3, db=E4M3, tuning=None, loads=None):
    """The kernel against the reference on the same FP8 operands: every output, dequantized
    (plain) outputs within relative error TOL."""
    epi = E.dequantized(inner)
    a, b, s = _fp8_operands(m, n, k, seed, da, db)
    loads = dict(_gpu_loads(inner, m, n, seed) if loads is None else loads, acc_scale=s)
    kw = dict(transpose_b=True, out_dtypes=_plain_dtypes(epi))
    want = REFERENCE.gemm(epi, a, b, loads, **kw)
    poison_allocator([(m, n)] * (3 * len(epi.outputs)))
    low = _kernel(tuning)
    got = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, **kw))(a, b, loads)
    assert set(got) == set(want)
    for o in epi.outputs:
        g, w = _reduced(o.kind, got[o.name]), _reduced(o.kind, want[o.name])
        if o.kind is OutputKind.TILE:
            assert g.shape == w.shape and g.dtype == w.dtype, (o.name, g.shape, w.shape, g.dtype, w.dtype)
        e = rel_err(g, w)
        assert e <= TOL, f"{epi.name}.{o.name}: rel err {e:.3g}"
    return got, want


@pytest.mark.gpu
@pytest.mark.parametrize("da,db", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)], ids=["e4m3", "e5m2-e4m3", "e4m3-e5m2"])
def test_fp8_identity_on_gpu(da, db):
    _compare_fp8(P.IDENTITY, 2048, 2048, 2048, da=da, db=db)


@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", ["auto", "256"])
def test_fp8_ragged_on_gpu(tile_n):
    """Ragged M, N, K (K not a multiple of the 128-element K-tile), 128- and 256-wide tiles."""
    from coda_jax.ffi.tuning import CuteDslTuning

    t = CuteDslTuning(tile_n=None if tile_n == "auto" else int(tile_n))
    _compare_fp8(P.IDENTITY, 1000, 1500, 520, seed=1, tuning=t)
    _compare_fp8(P.RESIDUAL_RMS, 777, 900, 333, seed=2, tuning=t)
    _compare_fp8(P.rms_swiglu(True), 1000, 1024, 200, seed=3, tuning=t)
    _compare_fp8(P.SWIGLU_DGRAD, 1000, 640, 333, seed=4, tuning=t)


@pytest.mark.gpu
def test_fp8_pingpong_on_gpu():
    from coda_jax.ffi.tuning import CuteDslTuning

    _compare_fp8(P.RESIDUAL_RMS, 4096, 2048, 1024, seed=5, tuning=CuteDslTuning(schedule="pingpong"))
