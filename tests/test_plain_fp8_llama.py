"""The plain JAX FP8 baseline (benchmarks/plain_fp8_llama.py): its FP8 dense op against float32
math within FP8's rounding, its recipe state (every amax history gets its own tensor's amax
from one train step), its loss against the bf16 baseline on the same weights, training, and
the HLO check the step benchmark runs on a GPU.

FP8 bounds: rounding to ``p`` mantissa bits leaves a relative error of at most ``2**-(p+1)``
an element (e4m3: p = 3, 2**-4 = 6.25 %; e5m2: p = 2, 2**-3 = 12.5 %), about a third of
that on average; a GEMM's output error is about that of its operands' combined (the
elements' errors are independent). So e4m3 x e4m3 stays under 2**-4 and e5m2 x e4m3 under
2**-3 * 0.8 in relative Frobenius norm, and both are far above bf16's (2**-9 an element):
a GEMM run in bf16 fails the lower bound."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import benchmarks.plain_fp8_llama as pf8
from benchmarks.plain_fp8_llama import (FUSED_PROJECTIONS, PlainFp8Llama, expected_fp8_gemms, fp8_dot, fp8_gemm_calls,
                                        fp8_gemm_kinds, gemm_call_targets)
from benchmarks.plain_llama import PlainLlama
from coda_jax import training
from coda_jax.fp8 import E4M3, Fp8Meta
from coda_jax.layers import CodaLlama, LlamaConfig
from conftest import rel_err

E4M3_BOUND = 2.0 ** -4  # e4m3 x e4m3 (forward)
E5M2_BOUND = 2.0 ** -3 * 0.8  # e5m2 x e4m3 (dgrad, wgrad)
FP8_FLOOR = 2.0 ** -7  # an FP8 GEMM's error is above this; a bf16 GEMM's (~2**-9) is not

CFG = LlamaConfig.tiny(vocab_size=300, num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4,
                       num_kv_heads=2, head_dim=32, dtype=jnp.bfloat16)
CFG1 = CFG.replace(num_layers=1)  # the train-step tests' (compile time)


def _tokens(batch=2, seq=32, seed=2):
    t = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, CFG.vocab_size)
    return t[:, :-1], t[:, 1:]


def _amax(a) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32))))


@pytest.mark.parametrize("idiom", pf8.IDIOMS)
def test_fp8_dot_matches_float32_math_within_fp8_bounds(idiom):
    m, k, n = 96, 256, 160  # all different: a swapped layout cannot pass
    ks = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16) * 3.0
    w = (jax.random.normal(ks[1], (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    dy = (jax.random.normal(ks[2], (m, n), jnp.float32) * 1e-7).astype(jnp.bfloat16)  # below e5m2 at scale 1
    xf, wf, dyf = (a.astype(jnp.float32) for a in (x, w, dy))
    ref = {"y": xf @ wf, "dx": dyf @ wf.T, "dw": xf.T @ dyf}
    amaxes = [_amax(x), _amax(w), _amax(dy)]

    @jax.jit
    def run(x, w, meta, dy):
        y, vjp = jax.vjp(lambda x, w, meta: fp8_dot(x, w, meta, idiom=idiom), x, w, meta)
        dx, dw, dmeta = vjp(dy)
        return {"y": y, "dx": dx, "dw": dw}, dmeta

    # Calibrated histories (this step's amaxes among older ones): errors within FP8's bounds.
    hist = jnp.asarray([[amaxes[0] / 2, amaxes[0], 0.1, 0.0], [amaxes[1], 0.0, 0.0, 0.0], [0.0, amaxes[2], 0.0, 0.0]])
    out, dmeta = run(x, w, hist, dy)
    assert all(out[key].dtype == jnp.bfloat16 for key in out)
    errs = {key: rel_err(out[key], ref[key]) for key in ref}
    assert errs["y"] < E4M3_BOUND and errs["dx"] < E5M2_BOUND and errs["dw"] < E5M2_BOUND, errs
    assert min(errs.values()) > FP8_FLOOR, errs  # the GEMMs did run in FP8
    # The gradient of the histories: each shifted by one, this call's amax first.
    np.testing.assert_array_equal(np.asarray(dmeta[:, 0]), np.asarray(amaxes, np.float32))
    np.testing.assert_array_equal(np.asarray(dmeta[:, 1:]), np.asarray(hist[:, :-1]))
    # Empty histories (scale 1): the 1e-7 gradient underflows e5m2 -- the scales are applied.
    out0, dmeta0 = run(x, w, jnp.zeros((3, 4)), dy)
    assert rel_err(out0["dx"], ref["dx"]) > 0.5 and rel_err(out0["y"], ref["y"]) < E4M3_BOUND
    np.testing.assert_array_equal(np.asarray(dmeta0[:, 0]), np.asarray(amaxes, np.float32))


def test_fp8_dot_idioms_agree_and_refuse_bad_arguments():
    ks = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(ks[0], (32, 64), jnp.bfloat16)
    w = jax.random.normal(ks[1], (64, 48), jnp.bfloat16) * 0.125
    meta = jnp.asarray([[4.0], [0.5], [1.0]])
    a, b = (jax.jit(functools.partial(fp8_dot, idiom=i))(x, w, meta) for i in pf8.IDIOMS)
    assert rel_err(a, b) < 1e-2
    with pytest.raises(ValueError, match="idiom"):
        fp8_dot(x, w, meta, idiom="scaled")
    with pytest.raises(ValueError, match=r"\[3, history\]"):
        fp8_dot(x, w, meta[:2])
    with pytest.raises(TypeError, match="compute dtype"):
        fp8_dot(x, w.astype(jnp.float32), meta)


def test_fp8_dot_ablations_quantize_only_the_forward_or_only_the_backward():
    """``quantized="forward"``: the forward of ``"both"``, the backward of the plain bf16 dot;
    ``"backward"``: the reverse. Both keep the three amax histories."""
    ks = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(ks[0], (64, 96), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (96, 80), jnp.float32) * 0.1).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (64, 80), jnp.bfloat16)
    meta = jnp.asarray([[4.0, 3.0], [0.5, 0.4], [4.0, 4.0]])

    def run(f):
        y, vjp = jax.vjp(f, x, w, meta)
        return (y, *vjp(dy))

    def plain(x, w, meta):  # bf16's dot, its meta gradient zero
        return (jnp.dot(x, w, preferred_element_type=jnp.float32) + 0.0 * jnp.sum(meta)).astype(x.dtype)

    both, fwd, bwd, bf16 = (run(jax.jit(f)) for f in (
        fp8_dot, functools.partial(fp8_dot, quantized="forward"), functools.partial(fp8_dot, quantized="backward"),
        plain))
    assert FP8_FLOOR < rel_err(both[0], bf16[0]) < E4M3_BOUND  # the forward is FP8 in "both"
    np.testing.assert_array_equal(np.asarray(fwd[0], np.float32), np.asarray(both[0], np.float32))
    assert rel_err(bwd[0], bf16[0]) < 1e-2  # bf16's forward
    for i in (1, 2):  # dx, dw
        assert FP8_FLOOR < rel_err(both[i], bf16[i]) < E5M2_BOUND
        assert rel_err(fwd[i], bf16[i]) < 1e-2  # bf16's backward
        np.testing.assert_array_equal(np.asarray(bwd[i], np.float32), np.asarray(both[i], np.float32))
    for got in (fwd[3], bwd[3]):  # the next histories: this call's amaxes first, as "both" writes them
        np.testing.assert_array_equal(np.asarray(got), np.asarray(both[3]))
    with pytest.raises(ValueError, match="quantized"):
        fp8_dot(x, w, meta, quantized="weights")


def test_plain_fp8_ablations_count_their_fp8_gemms():
    for quantized, per_projection in (("both", 3), ("forward", 1), ("backward", 2)):
        m = PlainFp8Llama(CFG, rngs=nnx.Rngs(0), quantized=quantized)
        assert m.expected_fp8_gemms() == per_projection * CFG.num_layers * len(FUSED_PROJECTIONS)
    with pytest.raises(ValueError, match="quantized"):
        PlainFp8Llama(CFG, rngs=nnx.Rngs(0), quantized="none")


def _recording_fp8_dot(monkeypatch):
    """``plain_fp8_llama.fp8_dot`` replaced by one that records, per call (in call order),
    the amax of its input and weight and of its output's gradient (debug callbacks: they run
    inside the jitted train step)."""
    seen: dict = {}
    calls = []
    original = pf8.fp8_dot

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def tap(y, i):
        return y

    def tap_fwd(y, i):
        return y, None

    def tap_bwd(i, _, g):
        jax.debug.callback(lambda a: seen.__setitem__((i, "g"), float(a)), jnp.max(jnp.abs(g)).astype(jnp.float32))
        return (g,)

    tap.defvjp(tap_fwd, tap_bwd)

    def recording(x, w, meta, **kw):
        i = len(calls)
        calls.append(i)
        jax.debug.callback(lambda a, b: seen.update({(i, "x"): float(a), (i, "w"): float(b)}),
                           jnp.max(jnp.abs(x)).astype(jnp.float32), jnp.max(jnp.abs(w)).astype(jnp.float32))
        return tap(original(x, w, meta, **kw), i)

    monkeypatch.setattr(pf8, "fp8_dot", recording)
    return seen, calls


@pytest.mark.parametrize("fuse", [True, False])
def test_one_train_step_writes_each_tensors_amax_into_its_history(monkeypatch, fuse):
    seen, calls = _recording_fp8_dot(monkeypatch)
    model = PlainFp8Llama(CFG1, rngs=nnx.Rngs(0), fuse=fuse)
    # The weights as the projections read them (bf16; Q/K/V and gate/up concatenated when fused).
    weights = []
    for blk in model.blocks:
        ws = {n: blk_w[...].astype(jnp.bfloat16) for n, blk_w in
              (("q", blk.wq), ("k", blk.wk), ("v", blk.wv), ("o", blk.wo), ("gate", blk.w_gate), ("up", blk.w_up),
               ("down", blk.w_down))}
        ws["qkv"] = jnp.concatenate([ws["q"], ws["k"], ws["v"]], axis=1)
        ws["gu"] = jnp.concatenate([ws["gate"], ws["up"]], axis=1)
        weights += [_amax(ws[name]) for name in blk.projections]
    opt = nnx.Optimizer(model, training.adamw_cosine(1e-3, 1, 10), wrt=nnx.Param)
    step, _, _ = training.make_steps(model, opt)
    state, loss = step(nnx.state((model, opt)), *_tokens())
    jax.block_until_ready(loss)
    nnx.update((model, opt), state)
    metas = [(blk, name) for blk in model.blocks for name in blk.projections]
    assert len(calls) == len(metas) == expected_fp8_gemms(CFG1, fuse) // 3  # each history read by one call
    assert len(jax.tree.leaves(nnx.state(model, Fp8Meta))) == len(metas)
    for i, (blk, name) in enumerate(metas):
        h = np.asarray(getattr(blk, f"fp8_{name}")[...])
        first = [seen[(i, "x")], seen[(i, "w")], seen[(i, "g")]]
        assert np.all(h[:, 0] > 0) and np.all(np.isfinite(h)), (name, h[:, 0])
        np.testing.assert_array_equal(h[:, 0], np.asarray(first, np.float32), err_msg=f"block projection {name}")
        assert h[1, 0] == np.float32(weights[i]), name  # the weight's amax, from the weights before the step
        np.testing.assert_array_equal(h[:, 1:], 0.0)  # zeros shifted along


def test_fp8_loss_is_within_a_few_percent_of_the_bf16_baseline():
    coda = CodaLlama(CFG, rngs=nnx.Rngs(1), backend="xla")
    inputs, targets = _tokens()

    def out(model):
        """Logits and loss; an FP8 model's with the amax histories of one gradient evaluation
        first (the delayed scales of a model in training, not the empty histories' scale 1)."""
        graphdef, metas, rest = nnx.split(model, Fp8Meta, ...)

        def run(metas, rest):
            if jax.tree.leaves(metas):
                metas = jax.grad(lambda m: nnx.merge(graphdef, m, rest).loss(inputs, targets))(metas)
            m = nnx.merge(graphdef, metas, rest)
            return m.logits(inputs), m.loss(inputs, targets)

        return jax.jit(run)(metas, rest)

    plain = PlainLlama.from_coda(coda)
    lg, loss = out(plain)
    for fuse, idiom in ((True, "direct"), (False, "dequant")):
        fp8 = PlainFp8Llama.from_coda(coda, fuse=fuse, idiom=idiom)
        assert fp8.config.fp8 is not None and (fp8.fuse, fp8.idiom) == (fuse, idiom)
        for name in ("wq", "w_up", "w_down"):
            np.testing.assert_array_equal(getattr(fp8.blocks[1], name)[...], getattr(plain.blocks[1], name)[...])
        lg8, loss8 = out(fp8)
        assert abs(float(loss8) - float(loss)) < 0.02 * float(loss), (fuse, idiom, float(loss8), float(loss))
        # The logits, through every block's chained GEMMs: e4m3 rounds 16x coarser than bf16
        # (3 mantissa bits against 7), and the bf16 model's logits are ~1 % off float32 math
        # here (10-13 % for FP8 at 1-4 layers).
        assert FP8_FLOOR < rel_err(lg8, lg) < 0.2, (fuse, idiom)


def test_a_few_fp8_train_steps_decrease_the_loss():
    model = PlainFp8Llama(CFG1, rngs=nnx.Rngs(0), idiom="dequant")
    opt = nnx.Optimizer(model, training.adamw_cosine(1e-2, 2, 100), wrt=nnx.Param)
    step, _, _ = training.make_steps(model, opt)
    state = nnx.state((model, opt))
    inputs, targets = _tokens(seed=4)
    losses = []
    for _ in range(7):
        state, loss = step(state, inputs, targets)  # the loss before the step's update
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
    nnx.update((model, opt), state)
    for h in jax.tree.leaves(nnx.state(model, Fp8Meta)):
        assert np.all(np.isfinite(h)) and np.all(np.asarray(h)[:, :7] > 0)  # 7 steps of amaxes recorded


_HLO = """
  %cublas-lt-matmul.1 = (bf16[2048,3072]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[2048,2048]{1,0} %fusion.3, f8e4m3fn[3072,2048]{1,0} %fusion.4, f32[] %p.1, f32[] %c.2), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %cublas-lt-matmul.2 = (bf16[2048,2048]{1,0}, s8[4194304]{0}) custom-call(bf16[2048,8192]{1,0} %a, bf16[2048,8192]{1,0} %b), custom_call_target="__cublas$lt$matmul", backend_config={}
  %cublas-gemm.3 = (bf16[128,256]{1,0}, s8[0]{0}) custom-call(bf16[128,64]{1,0} %c, bf16[64,256]{1,0} %d), custom_call_target="__cublas$gemm"
  %fusion.f8 = f8e5m2[2048,3072]{1,0} fusion(bf16[2048,3072]{1,0} %g), kind=kLoop, calls=%fused_f8
  %cublas-lt-matmul.5 = (bf16[2048,2048]{1,0}, s8[33554432]{0}) custom-call(f8e5m2[2048,3072]{1,0} %fusion.f8, f8e4m3fn[2048,3072]{1,0} %w), custom_call_target="__cublas$lt$matmul$f8", backend_config={}
  %custom-call.6 = f32[8] custom-call(f32[8] %e), custom_call_target="__cublas$lt$matmul$f8_probe"
"""


_FUSED_HLO = """
%triton_gemm_computation (param_0: f8e4m3fn[2048,2048], param_1: f8e5m2[512,2048]) -> bf16[2048,512] {
  %param_0 = f8e4m3fn[2048,2048]{1,0} parameter(0)
  %param_1 = f8e5m2[512,2048]{1,0} parameter(1)
  ROOT %dot.7 = bf16[2048,512]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
%fallback_computation (param_0.1: f8e4m3fn[64,32], param_1.1: bf16[16,32]) -> bf16[64,16] {
  %param_0.1 = f8e4m3fn[64,32]{1,0} parameter(0)
  %param_1.1 = bf16[16,32]{1,0} parameter(1)
  %convert.1 = bf16[64,32]{1,0} convert(%param_0.1)
  ROOT %dot.8 = bf16[64,16]{1,0} dot(%convert.1, %param_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
%quantize_computation (param_0.2: bf16[64,32]) -> f8e4m3fn[64,32] {
  %param_0.2 = bf16[64,32]{1,0} parameter(0)
  ROOT %convert.2 = f8e4m3fn[64,32]{1,0} convert(%param_0.2)
}
ENTRY %main (a: f8e4m3fn[2048,2048], b: f8e5m2[512,2048], c: bf16[64,32], d: bf16[16,32]) -> bf16[2048,512] {
  %a = f8e4m3fn[2048,2048]{1,0} parameter(0)
  %b = f8e5m2[512,2048]{1,0} parameter(1)
  %c = bf16[64,32]{1,0} parameter(2)
  %d = bf16[16,32]{1,0} parameter(3)
  %cublas-lt-matmul.1 = (bf16[2048,512]{1,0}, s8[33554432]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}
  %gemm_fusion.2 = bf16[2048,512]{1,0} fusion(%a, %b), kind=kCustom, calls=%triton_gemm_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"64"}}}
  %q = f8e4m3fn[64,32]{1,0} fusion(%c), kind=kLoop, calls=%quantize_computation
  %gemm_fusion.3 = bf16[64,16]{1,0} fusion(%q, %d), kind=kCustom, calls=%fallback_computation, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %add = bf16[2048,512]{1,0} add(%cublas-lt-matmul.1, %gemm_fusion.2)
}
"""


def test_fp8_gemm_kinds_counts_fused_fp8_gemms():
    # cuBLASLt's FP8 call and a Triton GEMM fusion over two FP8 operands count; a dot whose FP8
    # operand is converted to bf16 first (XLA's 16-bit fallback) and the quantizing fusion do not.
    assert fp8_gemm_kinds(_FUSED_HLO) == {"cublaslt": 1, "__triton_gemm": 1}
    assert fp8_gemm_kinds(_HLO) == {"cublaslt": 2}
    f = jax.jit(lambda a, b: lax.dot_general(a.astype(E4M3), b.astype(E4M3), (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.bfloat16))
    # on the CPU, XLA runs the FP8 dot as a bf16 one: no FP8 GEMM
    assert fp8_gemm_kinds(f.lower(jnp.ones((64, 32)), jnp.ones((16, 32))).compile().as_text()) == {}


def test_fp8_gemm_calls_finds_the_cublaslt_fp8_calls():
    calls = fp8_gemm_calls(_HLO)
    assert [c.split(" = ")[0] for c in calls] == ["%cublas-lt-matmul.1", "%cublas-lt-matmul.5"]
    assert all("backend_config" not in c for c in calls)
    assert gemm_call_targets(_HLO) == {"__cublas$lt$matmul$f8": 2, "__cublas$lt$matmul": 1, "__cublas$gemm": 1,
                                       "__cublas$lt$matmul$f8_probe": 1}
    assert fp8_gemm_calls("ROOT %dot.1 = bf16[8,8]{1,0} dot(f8e4m3fn[8,8] %a, f8e4m3fn[8,8] %b)") == []
    one_b = LlamaConfig.llama_3_2_1b()
    assert expected_fp8_gemms(one_b) == 16 * 4 * 3 == 192 and expected_fp8_gemms(one_b, fuse=False) == 16 * 7 * 3


def test_train_step_bench_runs_plain_fp8():
    from benchmarks import train_step_bench as tsb

    r = tsb.parse_run("plain_fp8:idiom=dequant,fuse=false,xla_gpu_enable_command_buffer=")
    assert (r.model, r.model_args, r.options, r.xla_options) == (
        "plain_fp8", {"idiom": "dequant", "fuse": False}, {}, {"xla_gpu_enable_command_buffer": ""})
    assert tsb.parse_run("plain_fp8").model_args == {} and tsb.parse_run("plain").model_args == {}
    assert tsb.split_runs("plain,plain_fp8:fuse=false,idiom=direct,plain") == [
        "plain", "plain_fp8:fuse=false,idiom=direct", "plain"]
    with pytest.raises(ValueError, match="idiom must be one of"):
        tsb.parse_run("plain_fp8:idiom=fast")
    with pytest.raises(ValueError, match="fuse must be true or false"):
        tsb.parse_run("plain_fp8:fuse=maybe")
    with pytest.raises(ValueError, match="unknown coda_jax option 'idiom'"):
        tsb.parse_run("xla:idiom=direct")  # plain_fp8's settings only
    with pytest.raises(ValueError, match="plain, xla, pallas or cutedsl, or plain_fp8"):
        tsb.parse_run("torch")
    rows = tsb.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "1",
                     "--rounds", "1", "--runs", "plain_fp8:fuse=false"])
    assert [r["run"] for r in rows] == ["plain_fp8:fuse=false"]
    assert rows[0]["fp8_gemm_calls_expected"] == 21 and "fp8_gemm_calls" not in rows[0]  # counted on a GPU only
    # a fresh model's loss: about log(vocab) (the tiny preset's 4096)
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["first_loss"] == pytest.approx(np.log(4096), rel=0.05)


def test_plain_fp8_lm_head_is_one_more_fp8_dot(monkeypatch):
    """``lm_head=True``: the head is a fifth :func:`fp8_dot` after the blocks', its history
    records the final norm's output, the weight and the logits' gradient; the loss stays within
    FP8's error of the bf16-head model's, and the step has 3 more FP8 GEMMs."""
    seen, calls = _recording_fp8_dot(monkeypatch)
    coda = CodaLlama(CFG1, rngs=nnx.Rngs(1), backend="xla")
    inputs, targets = _tokens()
    loss_of = nnx.jit(lambda m: m.loss(inputs, targets))
    l16 = float(loss_of(PlainFp8Llama.from_coda(coda)))
    l8 = float(loss_of(PlainFp8Llama.from_coda(coda, lm_head=True)))
    assert 1e-5 < abs(l8 / l16 - 1) < 0.02, (l8, l16)
    calls.clear()
    model = PlainFp8Llama.from_coda(coda, lm_head=True)
    assert model.config.fp8.lm_head and model.fp8_lm_head[...].shape == (3, model.config.fp8.history)
    assert model.expected_fp8_gemms() == expected_fp8_gemms(CFG1) + 3
    opt = nnx.Optimizer(model, training.adamw_cosine(1e-3, 1, 10), wrt=nnx.Param)
    step, _, _ = training.make_steps(model, opt)
    state, loss = step(jax.tree.map(jnp.copy, nnx.state((model, opt))), inputs, targets)
    jax.block_until_ready(loss)
    nnx.update((model, opt), state)
    assert len(calls) == len(FUSED_PROJECTIONS) * CFG1.num_layers + 1
    head = np.asarray(model.fp8_lm_head[...])
    i = len(calls) - 1
    np.testing.assert_array_equal(head[:, 0], np.asarray([seen[(i, "x")], seen[(i, "w")], seen[(i, "g")]], np.float32))


def test_train_step_bench_lm_head_setting():
    from benchmarks import train_step_bench as tsb

    assert tsb.parse_run("plain_fp8:lm_head=true").model_args == {"lm_head": True}
    assert tsb.parse_run("pallas:fp8=true,lm_head=true").model_args == {"fp8": "delayed", "lm_head": True}
    with pytest.raises(ValueError, match="lm_head is a setting of FP8 runs"):
        tsb.parse_run("pallas:lm_head=true")
    with pytest.raises(ValueError, match="lm_head must be true or false"):
        tsb.parse_run("plain_fp8:lm_head=perhaps")
    # Fp8Recipe.promote_k, for both models.
    assert tsb.parse_run("plain_fp8:promote_k=0").model_args == {"promote_k": 0}
    assert tsb.parse_run("pallas:fp8=true,promote_k=0").model_args == {"fp8": "delayed", "promote_k": 0}
    with pytest.raises(ValueError, match="promote_k is a setting of FP8 runs"):
        tsb.parse_run("pallas:promote_k=0")
    with pytest.raises(ValueError, match="promote_k must be an integer"):
        tsb.parse_run("plain_fp8:promote_k=some")
