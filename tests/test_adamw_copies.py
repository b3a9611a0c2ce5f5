"""AdamW steps that also write the weight's copies, as epilogue passes
(``coda_jax.ops.adamw_copies``: e4m3 in both layouts, or bf16): the reference lowering against
optax's AdamW after global-norm clipping, over several steps; the Pallas kernel (GPU interpret
mode, outputs poisoned) against the reference; the Pallas and CuTeDSL kernels' code generation
for CUDA; the checks on its inputs; and the probe that times it on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import coda_jax as cj
from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.ops.adamw_copies import adamw_cast_step, adamw_q8_step, adamw_scalars
from coda_jax.pallas import interpret_mode
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.reference import REFERENCE
from op_cases import rel_err

E4M3, F32 = jnp.float8_e4m3fn, jnp.float32
B1, B2, EPS = 0.9, 0.95, 1e-8


def _optax_steps(p, b, grads, lr, wd, max_norm):
    """``optax.chain(clip_by_global_norm, adamw)`` over ``{"w": p, "b": b}`` for each gradient
    pair in ``grads``: the parameters, and the state's (count, mu, nu) of ``w`` before each step."""
    tx = optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(lr, b1=B1, b2=B2, eps=EPS, weight_decay=wd))
    params = {"w": p, "b": b}
    state = tx.init(params)
    before = []
    for gw, gb in grads:
        adam = state[1][0]
        before.append((adam.count, adam.mu["w"], adam.nu["w"], params["w"]))
        updates, state = tx.update({"w": gw, "b": gb}, state, params)
        params = optax.apply_updates(params, updates)
    return params, state[1][0], before


def _ours(lowering, p, mu, nu, count, g, g_other, lr, wd, max_norm, q_scale):
    norm = optax.tree.norm({"w": g, "b": g_other})
    s = adamw_scalars(count, lr, b1=B1, b2=B2, weight_decay=wd, grad_norm=norm, max_norm=max_norm, eps=EPS)
    return adamw_q8_step(lowering, p, g, mu, nu, s, q_scale)


@pytest.mark.parametrize("max_norm", [1.0, 1e9], ids=["clipped", "unclipped"])
def test_reference_matches_optax_adamw(max_norm):
    """Three steps of the reference lowering against optax on fresh random inputs: the weight
    and both moments, whether the clip applies or not; the e4m3 copy is the new weight at the
    scale, its transpose the copy's, the amax the new weight's."""
    m, n, lr, wd = 48, 80, 3e-3, 0.1
    ks = jax.random.split(jax.random.key(0), 8)
    p = jax.random.normal(ks[0], (m, n), F32) * 0.02
    b = jax.random.normal(ks[1], (n,), F32)
    grads = [(jax.random.normal(ks[2 + 2 * i], (m, n), F32), jax.random.normal(ks[3 + 2 * i], (n,), F32))
             for i in range(3)]
    params, adam, before = _optax_steps(p, b, grads, lr, wd, max_norm)
    w, mu, nu = p, jnp.zeros_like(p), jnp.zeros_like(p)
    for i, (gw, gb) in enumerate(grads):
        count, mu_o, nu_o, w_o = before[i]
        assert rel_err(w, w_o) < 1e-6 and (i == 0 or rel_err(mu, mu_o) < 1e-6 and rel_err(nu, nu_o) < 1e-6)
        q_scale = jnp.float32(2.0 ** (i + 6))
        w, mu, nu, t, amax = jax.jit(_ours, static_argnums=(0, 9))(REFERENCE, w, mu, nu, count, gw, gb, lr, wd,
                                                                    max_norm, q_scale)
        np.testing.assert_array_equal(np.asarray(t.data.astype(F32)), np.asarray(E.saturate_cast(w, q_scale, E4M3)
                                                                                  .astype(F32)))
        np.testing.assert_array_equal(np.asarray(t.data_t.astype(F32)), np.asarray(t.data.astype(F32)).T)
        assert float(t.scale_inv) == 1.0 / float(q_scale)
        assert float(amax) == float(jnp.max(jnp.abs(w)))
    assert rel_err(w, params["w"]) < 1e-6, rel_err(w, params["w"])
    assert rel_err(mu, adam.mu["w"]) < 1e-6 and rel_err(nu, adam.nu["w"]) < 1e-6
    assert rel_err(w, p) > 1e-3  # the steps moved the weight


@pytest.fixture
def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield
    reset_gpu_interpret_mode_state()


def test_pallas_pass_matches_reference(_interpret):
    """The Pallas kernel (interpreted; every output poisoned first, so an unwritten tile
    shows) against the reference at a ragged shape: the float32 weight and moments to float32
    rounding, the e4m3 copy, its transpose and the amax as the other FP8 passes are held to,
    with a scale at which some values saturate."""
    from test_pallas_fp8 import _check_fp8

    m, n = 200, 384
    ks = jax.random.split(jax.random.key(1), 5)
    p = jax.random.normal(ks[0], (m, n), F32) * 0.02
    g = jax.random.normal(ks[1], (m, n), F32)
    mu = jax.random.normal(ks[2], (m, n), F32) * 0.1
    nu = jax.random.uniform(ks[3], (m, n), F32) * 0.5
    g_other = jax.random.normal(ks[4], (n,), F32)
    args = (p, mu, nu, jnp.int32(4), g, g_other, 3e-3, 0.1, 1.0)
    p_ref, *_ = _ours(REFERENCE, *args, jnp.float32(1.0))
    q_scale = jnp.float32(1.25 * 448.0 / float(jnp.max(jnp.abs(p_ref))))
    want = _ours(REFERENCE, *args, q_scale)
    low = PallasLowering(None, plain_gemm="kernel")
    with cj.options(routing=dict(xla_output_below=0)):  # this small weight on the kernel, not on XLA
        step = jax.jit(lambda *a: _ours(low, *a))
        assert "dot_general" not in str(step.trace(*args, q_scale).jaxpr)  # the XLA route's zero GEMM
        got = step(*args, q_scale)
    for name, x, y in zip(("p", "mu", "nu"), got[:3], want[:3]):
        assert np.isfinite(np.asarray(x)).all(), f"{name}: NaN (poison) in the kernel's output"
        assert rel_err(x, y) < 1e-6, (name, rel_err(x, y))
    _check_fp8("q", got[3].data, want[3].data, float(q_scale))
    _check_fp8("q_t", got[3].data_t, want[3].data.T, float(q_scale))
    np.testing.assert_allclose(float(got[4]), float(want[4]), rtol=1e-6)


@pytest.mark.parametrize("program,m,n", [("adamw_q8", 4096, 28672), ("adamw_cast", 128256, 4096)])
def test_pallas_pass_lowers_for_cuda(program, m, n):
    """The kernels of an 8B-width gate/up weight (``adamw_q8``: four float32 tile loads, three
    float32 tile outputs and the e4m3 copies) and of its LM head weight (``adamw_cast``, the bf16
    copy) plan into the SMEM and pass Mosaic GPU's code generation, compiled, not interpreted."""
    from coda_jax.ops.epilogue_pass import epilogue_pass

    epi = getattr(programs, program)(B1, B2, EPS)
    tile = jax.ShapeDtypeStruct((m, n), F32)
    one = jax.ShapeDtypeStruct((), F32)
    loads = {"p": tile, "g": tile, "mu": tile, "nu": tile,
             **{l.name: one for l in epi.loads if l.kind is E.LoadKind.SCALAR}}
    low = PallasLowering(None, plain_gemm="pallas")
    with interpret_mode(False), cj.options(routing=dict(xla_output_below=0)):
        txt = jax.jit(lambda l: epilogue_pass(low, epi, m, n, l)).trace(loads).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt


def test_cast_step_matches_optax_and_writes_the_bf16_copy(_interpret):
    """``adamw_cast_step``: on the reference, optax's step and the new weight in bf16; on the
    Pallas kernel (interpreted), the reference's outputs to float32 rounding, the bf16 copy
    within one bf16 rounding."""
    m, n, lr, wd = 136, 256, 3e-3, 0.1
    ks = jax.random.split(jax.random.key(2), 4)
    p = jax.random.normal(ks[0], (m, n), F32) * 0.02
    b = jax.random.normal(ks[1], (n,), F32)
    grads = [(jax.random.normal(ks[2], (m, n), F32), jax.random.normal(ks[3], (n,), F32))]
    params, adam, _ = _optax_steps(p, b, grads, lr, wd, 1.0)
    (gw, gb), zero = grads[0], jnp.zeros_like(p)

    def step(low):
        s = adamw_scalars(0, lr, b1=B1, b2=B2, weight_decay=wd, grad_norm=optax.tree.norm({"w": gw, "b": gb}),
                          max_norm=1.0, eps=EPS)
        return adamw_cast_step(low, p, gw, zero, zero, s)

    want = step(REFERENCE)
    assert rel_err(want[0], params["w"]) < 1e-6 and rel_err(want[1], adam.mu["w"]) < 1e-6
    assert want[3].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(want[3].astype(F32)), np.asarray(want[0].astype(jnp.bfloat16).astype(F32)))
    with cj.options(routing=dict(xla_output_below=0)):
        got = jax.jit(lambda: step(PallasLowering(None, plain_gemm="kernel")))()
    for name, x, y in zip(("p", "mu", "nu"), got[:3], want[:3]):
        assert np.isfinite(np.asarray(x)).all() and rel_err(x, y) < 1e-6, name
    np.testing.assert_allclose(np.asarray(got[3].astype(F32)), np.asarray(want[3].astype(F32)), rtol=2 ** -7)


def test_bad_inputs_name_the_argument_and_the_rule():
    p = jnp.zeros((8, 16), F32)
    s = adamw_scalars(0, 1e-3, b1=B1, b2=B2, weight_decay=0.0, grad_norm=1.0, max_norm=1.0)
    with pytest.raises(ValueError, match="adamw: p must be a matrix"):
        adamw_q8_step(REFERENCE, p[0], p[0], p[0], p[0], s, 1.0)
    with pytest.raises(ValueError, match="nu must be float32 of p's shape"):
        adamw_q8_step(REFERENCE, p, p, p, p.astype(jnp.bfloat16), s, 1.0)
    with pytest.raises(ValueError, match="g must be float32 of p's shape"):
        adamw_q8_step(REFERENCE, p, p[:4], p, p, s, 1.0)
    with pytest.raises(ValueError, match="q_scale must be a scalar"):
        adamw_q8_step(REFERENCE, p, p, p, p, s, jnp.ones((2,), F32))


def test_optimizer_copies_probe_checks_and_times_each_variant(monkeypatch, tmp_path, capsys):
    """``benchmarks/probes/optimizer_fp8_copies.py`` on the tiny model (XLA lowering; the
    timer faked, the GPU's own): the fused update passes its checks against optax and the
    passes, and each variant is timed and written."""
    import json

    from benchmarks.probes import optimizer_fp8_copies as probe
    from coda_jax.pallas import autotune as at

    cand = "pingpong_minor_m_lean_m64_no_gemm"
    want = {"optax": 3.0, "optax+passes": 5.0, "fused": 3.5, "xla_copies": 4.5, "passes": 2.0, "fused_alone": 1.5,
            f"fused@{cand}": 3.25, f"fused_alone@{cand}": 1.25}
    times = iter(t for t in want.values() for _ in range(2))  # --iters 2: two measurements a variant
    monkeypatch.setattr(at, "kernel_ms", lambda f, *a, iters: next(times))
    row = probe.main(["--preset", "tiny", "--layers", "1", "--backend", "xla", "--out", str(tmp_path), "--iters", "2",
                      "--candidates", cand])
    assert row["ms"] == want
    assert row["saved_ms"] == 1.75  # optax+passes against the fastest fused update (not its kernels alone)
    assert row["saved_by_xla_copies_ms"] == 0.5
    assert json.loads((tmp_path / "optimizer_fp8_copies.json").read_text())["saved_ms"] == 1.75
    assert 0 < row["block_weight_elements"] < row["parameter_elements"]
    assert "100.0000% bit-equal" in capsys.readouterr().out


@pytest.mark.parametrize("program", ["adamw_q8", "adamw_cast"])
def test_cutedsl_pass_lowers_for_cuda(program, monkeypatch):
    """The CuTeDSL kernel lowers the same declarations for CUDA (on the CPU, compiled for
    Hopper: ``CUTE_DSL_ARCH=sm_90a``), with the results' shapes and dtypes."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    pytest.importorskip("cutlass")
    pytest.importorskip("cutlass.jax")
    from coda_jax.ffi.lowering import CuteDslLowering
    from coda_jax.ops.epilogue_pass import epilogue_pass

    epi = getattr(programs, program)(B1, B2, EPS)
    m, n = 200, 384
    tile = jax.ShapeDtypeStruct((m, n), F32)
    one = jax.ShapeDtypeStruct((), F32)
    loads = {"p": tile, "g": tile, "mu": tile, "nu": tile,
             **{l.name: one for l in epi.loads if l.kind is E.LoadKind.SCALAR}}
    low = CuteDslLowering(None, plain_gemm="kernel")
    with cj.options(routing=dict(xla_output_below=0)):
        traced = jax.jit(lambda l: epilogue_pass(low, epi, m, n, l)).trace(loads)
        assert "CuteDSL" in traced.lower(lowering_platforms=("cuda",)).as_text()
    out = traced.out_info
    for name in ("p_new", "mu_new", "nu_new"):
        assert (out[name].shape, out[name].dtype) == ((m, n), F32)
    if program == "adamw_q8":
        assert (out["copy"].dtype, out["copy_t"].shape) == (E4M3, (n, m))
    else:
        assert (out["copy"].shape, out["copy"].dtype) == ((m, n), jnp.bfloat16)
