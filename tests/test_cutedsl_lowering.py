"""CuTeDSL backend on the CPU: every op (forward and jax.grad) traces and lowers for CUDA.

No GPU is needed: with ``CUTE_DSL_ARCH=sm_90a`` CuTeDSL compiles each kernel while JAX
lowers the ``cutlass_call`` custom call, so a successful lowering means every kernel
(mainloop and lowered epilogue) is well-formed. Execution is covered by
``test_gpu_cutedsl.py`` on a Hopper GPU. The epilogue interpreter is also checked on
NumPy values against the reference backend's body evaluation.
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

import coda_jax as cj  # noqa: E402
from coda_jax import backend as B  # noqa: E402
from coda_jax import epilogue as E  # noqa: E402
from coda_jax import programs as P  # noqa: E402
from coda_jax.ffi import interpret as I  # noqa: E402
from coda_jax.ops.names import ALL_OPS  # noqa: E402
from op_cases import abstract_loads, kernel_probes  # noqa: E402

BF = jnp.bfloat16


@pytest.fixture(autouse=True)
def _cutedsl_without_gpu(monkeypatch):
    """Lets backend='cutedsl' resolve on a machine without a GPU (we only lower)."""
    real = B.backend_unavailable_reason
    monkeypatch.setattr(B, "backend_unavailable_reason", lambda n: None if n == "cutedsl" else real(n))


def _lower(f, *args):
    txt = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call" in txt and "CuteDSL" in txt, "no CuTeDSL custom call in the lowered module"
    return txt


def _both(f, args, argnums):
    """Lowers the forward and the gradient of sum(f(*args))."""
    _lower(f, *args)
    g = jax.grad(lambda *a: jnp.sum(jnp.asarray(f(*a), jnp.float32)), argnums)
    _lower(g, *args)


def _normal(key, shape, dtype=BF, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def test_backend_registers_every_op():
    assert B.registered_ops("cutedsl") == frozenset(ALL_OPS)


def test_rms_norm_matmul_lowers():
    m, d, n = 200, 128, 192  # ragged M and N: padding path
    x, g, w = _normal(0, (m, d)), _normal(1, (d,)), _normal(2, (d, n))
    _both(lambda x, g, w: cj.rms_norm_matmul(x, g, w, backend="cutedsl"), (x, g, w), (0, 1, 2))


def test_swiglu_lowers():
    m, d, f = 128, 128, 128
    x, g, w = _normal(0, (m, d)), _normal(1, (d,)), _normal(2, (d, 2 * f))
    _both(lambda x, g, w: cj.rms_norm_matmul_swiglu(x, g, w, backend="cutedsl"), (x, g, w), (0, 1, 2))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_lowers(qk_norm):
    m, d, hd, heads, kv = 128, 128, 64, 2, 1
    n = (heads + 2 * kv) * hd
    x, g, w = _normal(0, (m, d)), _normal(1, (d,)), _normal(2, (d, n))
    pos = jnp.arange(m) % 17
    inv = jnp.asarray(cj.rope_inv_freq(hd, 500000.0, cj.Llama3RopeScaling()))
    kw = dict(num_heads=heads, num_kv_heads=kv, backend="cutedsl")
    if qk_norm:
        qn, kn = _normal(3, (hd,)), _normal(4, (hd,))
        _both(lambda x, g, w, qn, kn: cj.rms_norm_matmul_rope(x, g, w, pos, inv, q_norm=qn, k_norm=kn, **kw),
              (x, g, w, qn, kn), (0, 1, 2, 3, 4))
    else:
        _both(lambda x, g, w: cj.rms_norm_matmul_rope(x, g, w, pos, inv, **kw), (x, g, w), (0, 1, 2))


def test_matmul_residual_rms_lowers():
    m, k, d = 128, 128, 128
    y, w, res, g = _normal(0, (m, k)), _normal(1, (k, d)), _normal(2, (m, d)), _normal(3, (d,))

    def f(y, w, res, g):
        x, carry = cj.matmul_residual_rms(y, w, res, g, backend="cutedsl")
        z = cj.rms_norm_matmul(x, g, w, carry=carry, backend="cutedsl")
        return z

    _both(f, (y, w, res, g), (0, 1, 2, 3))


def test_linear_cross_entropy_lowers():
    m, d, v = 128, 128, 300
    x, g, w = _normal(0, (m, d)), _normal(1, (d,)), _normal(2, (v, d))
    t = (jnp.arange(m) * 7) % v
    _both(lambda x, g, w: cj.linear_cross_entropy(x, g, w, t, z_loss=1e-3, backend="cutedsl"), (x, g, w), (0, 1, 2))


# ------------------------------------------------------------- lowering errors ------
def test_float32_operands_are_refused():
    from coda_jax.ffi.lowering import CUTEDSL

    a = jnp.zeros((128, 64), jnp.float32)
    with pytest.raises(TypeError, match="backend='xla'"):
        CUTEDSL.gemm(P.IDENTITY, a, a.T, {})


def test_contraction_mismatch_is_refused():
    from coda_jax.ffi.lowering import CUTEDSL

    with pytest.raises(ValueError, match="contraction"):
        CUTEDSL.gemm(P.IDENTITY, jnp.zeros((128, 64), BF), jnp.zeros((32, 128), BF), {})


def test_plain_gemms_route_to_xla_by_default():
    import coda_jax as cj
    from coda_jax.ffi.lowering import CuteDslLowering

    a, b = _normal(0, (128, 64)), _normal(1, (64, 128))
    plain = jax.jit(lambda a, b: CuteDslLowering().gemm(P.IDENTITY, a, b, {})["out"])
    assert "CuteDSL" not in plain.trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    np.testing.assert_allclose(np.asarray(plain(a, b), np.float32),
                               np.asarray(jnp.dot(a, b, preferred_element_type=jnp.float32).astype(BF), np.float32))
    _lower(lambda a, b: CuteDslLowering(plain_gemm="cutedsl").gemm(P.IDENTITY, a, b, {})["out"], a, b)
    with cj.options(routing=cj.RoutingOptions(plain_gemm="kernel")):
        _lower(lambda a, b: CuteDslLowering().gemm(P.IDENTITY, a, b, {})["out"], a, b)
    with pytest.raises(ValueError, match="plain_gemm must be 'xla', 'kernel' or 'cutedsl'"):
        CuteDslLowering(plain_gemm="pallas")
    with pytest.raises(cj.OptionError, match="routing.plain_gemm must be one of: 'xla', 'kernel'"):
        cj.options(routing={"plain_gemm": "cublas"})


def test_unsupported_primitive_names_the_primitive():
    epi = E.Epilogue("uses_cumsum", (), (E.tile_out("out"),), lambda acc, ctx: {"out": jnp.cumsum(acc, axis=1)})
    traced = I.trace_body(epi, (8, 16))
    with pytest.raises(I.UnsupportedPrimitiveError, match="cumsum"):
        I.check_lowerable(traced, "epilogue 'uses_cumsum'")
    from coda_jax.ffi.lowering import CUTEDSL

    with pytest.raises(NotImplementedError, match="cumsum"):
        CUTEDSL.gemm(epi, jnp.zeros((128, 64), BF), jnp.zeros((64, 128), BF), {})


# ------------------------------------------- interpreter vs reference (NumPy) -------
class _WholeTile:
    """ElementContext where one 'thread' holds a whole non-pair tile, element by element."""

    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols

    def coord(self, dim):
        return [np.int32(v) for v in (self.rows if dim == 0 else self.cols)]

    def row_reduce(self, op, values):
        raise NotImplementedError


def _interpret_whole(epi, acc, loads, col0=0):
    mt, nt = acc.shape
    rows, cols = np.divmod(np.arange(mt * nt), nt)
    traced = I.trace_body(epi, (mt, nt), {k: np.asarray(v).dtype for k, v in loads.items()})
    vals = {("acc", None, None): list(acc.reshape(-1)), ("col0", None, None): [np.int32(col0)] * (mt * nt)}
    for l in epi.loads:
        v = np.asarray(loads[l.name])
        per = {E.LoadKind.ROW: lambda: v[rows], E.LoadKind.COL: lambda: v[cols], E.LoadKind.TILE: lambda: v[rows, cols],
               E.LoadKind.SCALAR: lambda: np.full(mt * nt, v)}[l.kind]()
        if np.issubdtype(per.dtype, np.floating):
            per = per.astype(np.float32)
        vals[("load", l.name, None)] = list(per)
    res = I.interpret(traced, vals, mt * nt, I.NumpyOps(), _WholeTile(rows, cols))
    return {k[0]: np.asarray(v, np.float32).reshape(mt, nt) for k, v in res.items()}


@pytest.mark.parametrize("epi", [P.RESIDUAL_RMS, P.ROW_SCALE, P.CE_GRAD, P.rms_dgrad(True), P.RMS_LSE, P.RMS_LSE_LOGITS,
                                 P.NORM_WGRAD, P.NORM_DGRAD],
                         ids=lambda e: e.name)
def test_interpreter_matches_reference_body(epi):
    from coda_jax.reference import _WholeArrayContext, _prepare_loads

    mt, nt = 8, 16
    rng = np.random.default_rng(0)
    acc = rng.standard_normal((mt, nt)).astype(np.float32)
    loads = {}
    for l in epi.loads:
        shape = {E.LoadKind.ROW: (mt,), E.LoadKind.COL: (nt,), E.LoadKind.TILE: (mt, nt), E.LoadKind.SCALAR: ()}[l.kind]
        loads[l.name] = (rng.integers(0, nt, shape).astype(np.int32) if l.name == "target"
                         else rng.standard_normal(shape).astype(np.float32))
    got = _interpret_whole(epi, acc, loads)
    ref = epi.body(jnp.asarray(acc), _WholeArrayContext(nt), **_prepare_loads(epi, {k: jnp.asarray(v) for k, v in loads.items()}))
    for name, v in ref.items():
        want = np.broadcast_to(np.asarray(v, np.float32), (mt, nt))
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=name)


# ---------------------------------------------- every program, every layout ---------
def _chunked(epi):
    from coda_jax.ffi.kernel import chunked_epilogue

    return chunked_epilogue(epi)


def _spy(fn, seen):
    def wrapped(epi, traced, plan):
        seen.append(plan)
        return fn(epi, traced, plan)

    return wrapped


_PROGRAMS = [
    (P.IDENTITY, {}), (P.RESIDUAL, {}), (P.RESIDUAL_RMS, {}), (P.ROW_SCALE, {}), (P.rms_swiglu(False), {}),
    (P.rms_swiglu(True), {}), (P.rms_rope(64, None, False), {}), (P.rms_rope(64, 1e-6, True), {}),
    (P.rms_rope(32, None, False), {}), (P.RMS_LSE, {"transpose_b": True}),
    (P.RMS_LSE_LOGITS, {"transpose_b": True}), (P.rms_dgrad(False), {"transpose_b": True}),
    (P.rms_dgrad(True), {"transpose_b": True}), (P.CE_GRAD, {"transpose_b": True}), (P.ACCUMULATE, {}),
    (P.NORM_WGRAD, {"transpose_a": True}), (P.NORM_DGRAD, {"transpose_b": True}), (P.SWIGLU_DGRAD, {"transpose_b": True}), (P.IDENTITY, {"transpose_a": True}), (P.IDENTITY, {"transpose_a": True, "transpose_b": True}),
]


@pytest.mark.parametrize("tile_n", ["auto", "256"])
@pytest.mark.parametrize("epi,kw", _PROGRAMS, ids=[f"{e.name}-{'-'.join(k) or 'nn'}" for e, k in _PROGRAMS])
def test_program_lowers(epi, kw, tile_n):
    """Every program lowers with the automatic tile (128 wide at these small shapes) and
    with the 128 x 256 tile forced wherever it fits."""
    from coda_jax.ffi.lowering import CuteDslLowering
    from coda_jax.ffi.tuning import CuteDslTuning

    # the identity program on the kernel too
    kernel = CuteDslLowering(CuteDslTuning(tile_n=None if tile_n == "auto" else int(tile_n)), plain_gemm="kernel")

    m, n, k = 200, (256 if epi.pair_block else 300), 136
    ta, tb = kw.get("transpose_a", False), kw.get("transpose_b", False)
    a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), BF)
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), BF)
    _lower(lambda a, b, l: kernel.gemm(epi, a, b, l, **kw), a, b, abstract_loads(epi, m, n))


@pytest.mark.parametrize("epi,kw", [c for c in _PROGRAMS if _chunked(c[0])],
                         ids=[f"{e.name}-{'-'.join(k) or 'nn'}" for e, k in _PROGRAMS if _chunked(e)])
def test_pingpong_schedule_lowers(epi, kw, monkeypatch):
    """Every chunked program lowers with the ping-pong schedule (128-wide tiles, one
    warpgroup per tile); the fallback of the others is in ``test_schedule_choice``."""
    from coda_jax.ffi import kernel as K
    from coda_jax.ffi.lowering import CuteDslLowering
    from coda_jax.ffi.tuning import CuteDslTuning

    plans = []
    monkeypatch.setattr(K, "build_launcher", _spy(K.build_launcher, plans))
    m, n, k = 300, 384, 200
    ta, tb = kw.get("transpose_a", False), kw.get("transpose_b", False)
    a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), BF)
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), BF)
    low = CuteDslLowering(CuteDslTuning(schedule="pingpong"), plain_gemm="kernel")
    _lower(lambda a, b, l: low.gemm(epi, a, b, l, **kw), a, b, abstract_loads(epi, m, n))
    assert [(p.pingpong, p.tile_n) for p in plans] == [(True, 128)]


def test_schedule_choice():
    from coda_jax.ffi.kernel import choose_schedule
    from coda_jax.ffi.tuning import CuteDslTuning

    assert not choose_schedule(P.rms_swiglu(True), "pingpong")  # pair mode: cooperative
    assert choose_schedule(P.RESIDUAL_RMS, "pingpong")
    assert not choose_schedule(P.RESIDUAL_RMS, "cooperative")
    # auto: cooperative everywhere (ping-pong is opt-in, see choose_schedule)
    assert not any(choose_schedule(e) for e, _ in _PROGRAMS)
    assert choose_schedule(P.RMS_LSE, "pingpong") and not choose_schedule(P.RMS_LSE, "cooperative")
    with pytest.raises(ValueError, match="CuteDslTuning.schedule must be one of auto, cooperative, pingpong"):
        CuteDslTuning(schedule="zigzag")
    assert CuteDslTuning().schedule == "auto"


def test_element_swizzle_matches_the_tma_swizzle():
    """The ping-pong schedule writes its half of a staging ring through a plain pointer, so
    the swizzle sits in the layout and acts on element offsets: every element must land
    where the 128B TMA swizzle (on byte addresses) puts it, for bf16 and f32 outputs."""
    import cutlass
    import cutlass.cute as cute

    from coda_jax.ffi.kernel import _element_swizzled, _staging_layout

    found = {}

    @cute.jit
    def check():
        for dt in (cutlass.BFloat16, cutlass.Float32):
            ring, nb = _staging_layout(dt, 64, 2), dt.width // 8
            own = _element_swizzled(ring, dt)
            bad = 0
            for r in cutlass.range_constexpr(16):
                for c in cutlass.range_constexpr(0, 64, 4):
                    byte = int(str(ring.outer((r, c, 1)))) * nb
                    want = (byte ^ (((byte >> 7) & 7) << 4)) // nb
                    bad += int(int(str(own((r, c, 1)))) != want)
            found[dt.width] = bad

    check()
    assert found == {16: 0, 32: 0}


def test_odd_pair_block_lowers():
    """pair_block % 8 != 0: a pair's halves sit in different lanes, so the exchange and the
    body's row sum go through the SMEM scratch instead of registers."""
    from coda_jax.ffi.kernel import needs_scratch, register_layout_ok
    from coda_jax.ffi.lowering import CuteDslLowering

    epi = P.rms_rope(12, 1e-6, True)
    assert not register_layout_ok(epi) and needs_scratch(epi)
    m, n, k = 200, 288, 136
    a, b = jax.ShapeDtypeStruct((m, k), BF), jax.ShapeDtypeStruct((k, n), BF)
    _lower(lambda a, b, l: CuteDslLowering().gemm(epi, a, b, l), a, b, abstract_loads(epi, m, n))


def test_kernel_plan_stages_outputs_and_is_persistent(monkeypatch):
    """Every program of the op set stages its tile outputs for TMA stores beside >= 3 operand
    stages, with no SMEM scratch; the grid is min(tiles, SMs) persistent CTAs."""
    from coda_jax.ffi import kernel as K
    from coda_jax.ffi import lowering as L
    from coda_jax.ffi.lowering import CuteDslLowering

    for epi, _ in _PROGRAMS:
        dts = tuple((o.name, jnp.dtype(o.dtype or BF)) for o in epi.outputs)
        for tn in {K.narrow_tile_n(epi), K.choose_tile_n(epi, 8192, 8192, 2, dts, 132)}:
            stages, staged = K.plan_smem(epi, tn, 2, dts)
            assert staged and stages >= K.MIN_STAGED_STAGES, (epi.name, tn)
        assert not K.needs_scratch(epi), epi.name
    assert K.needs_scratch(_COL_SUM_PROBE)

    plans = []
    real = K.build_launcher
    monkeypatch.setattr(K, "build_launcher", lambda e, t, plan: plans.append(plan) or real(e, t, plan))
    monkeypatch.setattr(L, "gpu_sm_count", lambda: 7)
    for m in (256, 2048):  # 2 x 3 tiles -> 6 CTAs; 16 x 3 tiles -> 7 CTAs
        a, b = jax.ShapeDtypeStruct((m, 64), BF), jax.ShapeDtypeStruct((64, 384), BF)
        _lower(lambda a, b: CuteDslLowering(plain_gemm="cutedsl").gemm(P.IDENTITY, a, b, {}), a, b)
    assert [p.ctas for p in plans] == [6, 7]
    # latency_hints=True: the kernel's custom call tells XLA's scheduler its cost
    assert "latency_metadata" not in _lower(lambda a, b: CuteDslLowering(plain_gemm="cutedsl").gemm(P.IDENTITY, a, b, {}), a, b)
    hinted = _lower(lambda a, b: CuteDslLowering(plain_gemm="cutedsl", latency_hints=True).gemm(P.IDENTITY, a, b, {}),
                    a, b)
    assert any("latency_metadata" in line and "custom_call" in line for line in hinted.splitlines())
    # reserved_sms leaves SMs free for kernels beside it (NCCL): 7 - 2 -> 5 CTAs
    _lower(lambda a, b: CuteDslLowering(plain_gemm="cutedsl", reserved_sms=2).gemm(P.IDENTITY, a, b, {}), a, b)
    assert plans[-1].ctas == 5


def test_tile_width_choice(monkeypatch):
    """128 x 256 tiles for large outputs when the program fits them; 128-wide tiles for small
    outputs (too few CTAs), scratch programs, and outputs too big to stage beside 3 stages."""
    from coda_jax.ffi import kernel as K
    from coda_jax.ffi.tuning import CuteDslTuning

    def pick(epi, m, n, request=None):
        dts = tuple((o.name, jnp.dtype(o.dtype or BF)) for o in epi.outputs)
        return K.choose_tile_n(epi, m, n, 2, dts, 132, request)

    assert pick(P.IDENTITY, 8192, 8192) == 256
    assert pick(P.NORM_WGRAD, 2048, 16384) == 256  # chunked epilogue: tile load, output, row sum
    assert pick(P.RESIDUAL, 8192, 2048) == 256
    assert pick(P.CE_GRAD, 8192, 16384) == 128  # NARROW_PROGRAMS: spills at 256
    assert pick(P.rms_dgrad(True), 8192, 2048) == 256  # two outputs, staged a sub-tile at a time
    assert pick(P.RMS_LSE, 8192, 128256) == 256
    assert pick(P.rms_swiglu(False), 8192, 16384) == 256  # two (gate, up) pair segments per tile
    assert pick(P.IDENTITY, 256, 512) == 128  # 2 x 2 wide tiles would leave 128 SMs idle
    assert pick(P.IDENTITY, 8192, 8192, request=128) == 128
    assert pick(P.IDENTITY, 256, 512, request=256) == 256
    assert pick(_COL_SUM_PROBE, 8192, 8192, request=256) == 128  # needs the [128, tn + 1] f32 scratch
    assert pick(P.rms_rope(12, None, False), 8192, 8192) == 144  # odd pair block: scratch
    # SWIGLU_DGRAD (half_acc): chunked, its [128, 2 * tile_n] output staged as lo and hi
    # sub-tiles, so 128 x 256 tiles fit beside 3 stages.
    assert pick(P.SWIGLU_DGRAD, 8192, 8192) == 256
    with pytest.raises(ValueError, match="tile_n must be 128, 256"):
        pick(P.IDENTITY, 8192, 8192, request=192)
    for bad, rule in ((dict(tile_n=96), "tile_n must be 128, 256 or None"),
                      (dict(max_stages=1), "max_stages must be an integer >= 2"),
                      (dict(group_m=0), "group_m must be an integer >= 1")):
        with pytest.raises(ValueError, match=rule):
            CuteDslTuning(**bad)
    assert CuteDslTuning(tile_n=256, max_stages=4, group_m=16).group_m == 16


def _spill_runs():
    """``[(name, lower)]``: every program at an 8192^3 GEMM on its automatic plan, then every
    chunked one on the ping-pong schedule (:func:`cutedsl_spills.kernel_spill_lines` runs them)."""
    from coda_jax.ffi.kernel import chunked_epilogue
    from coda_jax.ffi.lowering import CuteDslLowering
    from coda_jax.ffi.tuning import CuteDslTuning

    m = n = k = 8192
    runs = [(epi, kw, "auto") for epi, kw in _PROGRAMS]
    runs += [(epi, kw, "pingpong") for epi, kw in _PROGRAMS if chunked_epilogue(epi)]

    def lower(epi, kw, schedule):
        ta, tb = kw.get("transpose_a", False), kw.get("transpose_b", False)
        a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), BF)
        b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), BF)
        low = CuteDslLowering(CuteDslTuning(schedule=schedule), plain_gemm="kernel")
        f = lambda a, b, l: low.gemm(epi, a, b, l, **kw)  # noqa: E731
        return lambda: jax.jit(f).trace(a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",))

    return [(f"{epi.name}-{s}-" + "-".join(kw), lower(epi, kw, s)) for epi, kw, s in runs]


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit) on PATH")
def test_kernels_do_not_spill(tmp_path):
    """Every program's kernel at an 8192^3 GEMM (its automatic tile: 128 x 256 where
    ``choose_tile_n`` takes it; the chunked ones also on the ping-pong schedule) compiles for
    sm_90a without register spills: ``ptxas -v``
    on the PTX that CuTeDSL keeps. Guards :func:`coda_jax.ffi.kernel.wide_registers_ok`."""
    from cutedsl_spills import assert_no_spills, kernel_spill_lines

    lines = kernel_spill_lines(tmp_path, "test_cutedsl_lowering:_spill_runs")
    assert len(lines) > len(_PROGRAMS)
    assert_no_spills(lines)


_COL_SUM_PROBE = E.Epilogue(name="col_sum_probe_cpu", loads=(), outputs=(E.tile_out("out"), E.col_sum("c")),
                            body=lambda acc, ctx: {"out": acc, "c": acc})


@pytest.mark.parametrize("probe", kernel_probes(), ids=lambda e: e.name)
def test_kernel_probe_lowers(probe):
    """The odd-pair-block probe (SMEM exchange, register row sums) and the unstaged probe
    (element-wise global stores) lower; the second is planned without staging."""
    from coda_jax.ffi.kernel import narrow_tile_n, plan_smem
    from coda_jax.ffi.lowering import CuteDslLowering

    dts = tuple((o.name, jnp.dtype(o.dtype or BF)) for o in probe.outputs)
    assert plan_smem(probe, narrow_tile_n(probe), 2, dts)[1] is (probe.name != "wide_f32_outputs")
    m, n, k = 200, 288, 136
    a, b = jax.ShapeDtypeStruct((m, k), BF), jax.ShapeDtypeStruct((k, n), BF)
    _lower(lambda a, b, l: CuteDslLowering().gemm(probe, a, b, l), a, b, abstract_loads(probe, m, n))
