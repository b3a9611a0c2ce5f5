"""The LM head in FP8 (:mod:`coda_jax.ops.fp8_cross_entropy`, ``Fp8Recipe(lm_head=True)``) on the
CPU: the op against a pure-``jnp`` float32 definition with fake quantization at exactly the
points where the op quantizes (``h`` and ``W`` in e4m3 forward, the logits' row-scaled gradient
in e5m2 backward, each with the scale of its history row), on the ``xla`` backend with float32
accumulation and on the Pallas kernel in the GPU interpreter; then the model with the option.

Bounds as ``test_fp8.py``'s: against the fake-quant definition the op differs only where a value
sits on an FP8 rounding boundary and the two summation orders put it on different sides (loss
1e-5, gradients 1e-2); against float32 math FP8's own error is several times larger.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import coda_jax as cj
from coda_jax.fp8 import E4M3, E5M2, Fp8Meta, Fp8Recipe, quantize, quantize_tensor, scale_from_history
from coda_jax.layers import CodaLlama, LlamaConfig
from coda_jax.ops import fp8_cross_entropy as fce
from coda_jax.ops.fp8_cross_entropy import HEAD_TENSORS, fp8_linear_cross_entropy
from coda_jax.ops.fp8_llama_block import Fp8Carry
from conftest import rel_err

f32 = jnp.float32
H, W, G = (HEAD_TENSORS.index(n) for n in ("h", "w", "dlogits"))
EPS, Z_LOSS = 1e-5, 1e-3


@pytest.fixture(autouse=True)
def _xla_float32():
    with cj.options(backend="xla", xla=dict(accumulate="float32")):
        yield


def _inputs(m=136, d=128, v=640, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (m, d), f32) * 1.5
    gamma = 1.0 + 0.2 * jax.random.normal(k[1], (d,), f32)
    w = jax.random.normal(k[2], (v, d), f32) * d ** -0.5 * 3.0
    t = jax.random.randint(k[3], (m,), 0, v).at[5].set(-100)  # one ignored row
    return x, gamma, w, t


def _fake_quant(v, scale, dtype):
    """``v`` rounded to the FP8 grid at ``scale`` (straight-through: the gradient passes as is)."""
    return v + jax.lax.stop_gradient(quantize(v, scale, dtype).astype(f32) / scale - v)


@jax.custom_vjp
def _grad_quant(v, scale):
    return v


def _grad_quant_fwd(v, scale):
    return v, scale


def _grad_quant_bwd(scale, ct):  # the cotangent rounded to e5m2 at ``scale``
    return quantize(ct, scale, E5M2).astype(f32) / scale, jnp.zeros_like(scale)


_grad_quant.defvjp(_grad_quant_fwd, _grad_quant_bwd)


def naive_fp8_head(x, gamma, w, t, probe, scales, quant=True):
    """Mean cross-entropy of ``RMSNorm(x) @ w^T`` with FP8 rounding where the op rounds.
    ``probe`` (zeros ``[M, V]``) is added to ``h @ W^T``: its gradient is ``rstd * dlogits``
    (the tensor quantized in the backward) before rounding."""
    s_h, s_w, s_g = scales
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=1) + EPS)
    h, wq = x * gamma, w
    if quant:
        h, wq = _fake_quant(h, s_h, E4M3), _fake_quant(w, s_w, E4M3)
    acc = jnp.dot(h, wq.T, precision="highest")
    if quant:
        acc = _grad_quant(acc, s_g)
    acc = acc + probe
    logits = rstd[:, None] * acc
    lse = jax.nn.logsumexp(logits, axis=1)
    valid = t >= 0
    tl = jnp.take_along_axis(logits, jnp.maximum(t, 0)[:, None], axis=1)[:, 0]
    losses = jnp.where(valid, lse - tl + Z_LOSS * lse * lse, 0.0)
    return jnp.sum(losses) / jnp.sum(valid)


def _scales(meta):
    return (scale_from_history(meta[H], E4M3), scale_from_history(meta[W], E4M3), scale_from_history(meta[G], E5M2))


def _op(save, scaling="delayed", carry=None, backend=None):
    def f(x, gamma, w, meta, t):
        return fp8_linear_cross_entropy(x, gamma, w, t, meta, recipe=Fp8Recipe(scaling=scaling), carry=carry,
                                        eps=EPS, z_loss=Z_LOSS, save_logits=save, backend=backend)
    return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3)))


def _calibrated_meta(x, gamma, w, t, hist=4):
    """Histories around this step's amaxes (some steps above, some below), so that no scale is 1."""
    _, (_, _, _, dmeta) = _op(True)(x, gamma, w, jnp.zeros((3, hist), f32), t)
    now = dmeta[:, 0]
    return now[:, None] * jnp.asarray([0.9, 1.3, 0.6, 1.1][:hist], f32)[None, :]


def _naive(x, gamma, w, t, meta, quant=True):
    probe = jnp.zeros((x.shape[0], w.shape[0]), f32)
    loss, (dx, dg, dw, dprobe) = jax.value_and_grad(
        lambda *a: naive_fp8_head(*a, _scales(meta), quant), (0, 1, 2, 4))(x, gamma, w, t, probe)
    return loss, (dx, dg, dw), float(jnp.max(jnp.abs(dprobe)))


@pytest.mark.parametrize("save,chunk", [(True, None), (False, None), (False, 256)],
                         ids=["saved_logits", "recompute", "recompute_chunks_of_256"])
def test_fp8_head_matches_naive_fake_quant(save, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(fce, "VOCAB_CHUNK", chunk)  # three chunks of 640 columns, the last ragged
    x, gamma, w, t = _inputs()
    meta = _calibrated_meta(x, gamma, w, t)
    loss, (dx, dg, dw, dmeta) = _op(save)(x, gamma, w, meta, t)
    want_loss, want, g_amax = _naive(x, gamma, w, t, meta)
    ref_loss, ref, _ = _naive(x, gamma, w, t, meta, quant=False)
    assert abs(float(loss) / float(want_loss) - 1) < 1e-5, (float(loss), float(want_loss))
    assert abs(float(loss) / float(ref_loss) - 1) > 1e-5  # FP8 did round
    for name, got, w_, r in zip(("dx", "dgamma", "dw"), (dx, dg, dw), want, ref):
        e, e32 = rel_err(got, w_), rel_err(got, r)
        print(f"{name}: vs fake-quant {e:.2e}, vs float32 {e32:.2e}")
        assert e < 1e-2 and e < 0.25 * e32 and e32 > 1e-3, (name, e, e32)
    # The histories' gradients: this step's amaxes first (h here: no carry), the rest shifted.
    np.testing.assert_array_equal(dmeta[:, 1:], meta[:, :-1])
    np.testing.assert_allclose(dmeta[H, 0], jnp.max(jnp.abs(x * gamma)), rtol=1e-6)
    assert float(dmeta[W, 0]) == float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(dmeta[G, 0], g_amax, rtol=1e-4)


@pytest.mark.parametrize("row", ["h", "w", "dlogits"])
def test_each_history_row_sets_its_tensors_scale(row):
    """A history row cut to 1/8 of its amax saturates its tensor's largest values: the result
    moves, and still matches the fake-quant definition at the cut scales (a scale off by a
    power of two moves no rounding boundary: only saturation shows which row a tensor reads)."""
    x, gamma, w, t = _inputs(seed=1)
    meta = _calibrated_meta(x, gamma, w, t)
    base = _op(True)(x, gamma, w, meta, t)
    cut = meta.at[HEAD_TENSORS.index(row)].multiply(0.125)
    loss, (dx, dg, dw, _) = _op(True)(x, gamma, w, cut, t)
    want_loss, want, _ = _naive(x, gamma, w, t, cut)
    assert abs(float(loss) / float(want_loss) - 1) < 1e-5
    moved = max(rel_err(a, b) for a, b in zip((dx, dg, dw), base[1][:3]))
    assert moved > 2e-2 or abs(float(loss) / float(base[0]) - 1) > 1e-3, (row, moved)
    for got, w_ in zip((dx, dg, dw), want):
        assert rel_err(got, w_) < 1e-2


@pytest.mark.parametrize("save", [True, False], ids=["saved_logits", "recompute"])
def test_current_scaling_ignores_the_histories(save, monkeypatch):
    """``scaling="current"``: every scale from its tensor's own amax. The results do not depend on
    the histories; with saved logits (one quantizing pass over all of dlogits) they match the
    fake-quant definition at the current scales; recomputing in chunks (each chunk by its own
    amax) stays within FP8's error of float32."""
    monkeypatch.setattr(fce, "VOCAB_CHUNK", 256)
    x, gamma, w, t = _inputs(seed=2)
    metas = [jax.random.uniform(jax.random.key(k), (3, 4), f32, 0.01, 100.0) for k in range(2)]
    a = _op(save, "current")(x, gamma, w, metas[0], t)
    b = _op(save, "current")(x, gamma, w, metas[1], t)
    for u, v in zip(jax.tree.leaves((a[0], a[1][:3])), jax.tree.leaves((b[0], b[1][:3]))):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    now = a[1][3][:, :1]  # this step's amaxes: the current scales
    loss, (dx, dg, dw, _) = a
    ref_loss, ref, _ = _naive(x, gamma, w, t, now, quant=False)
    if save:
        want_loss, want, _ = _naive(x, gamma, w, t, now)
        assert abs(float(loss) / float(want_loss) - 1) < 1e-5
        for got, w_ in zip((dx, dg, dw), want):
            assert rel_err(got, w_) < 1e-2
    assert abs(float(loss) / float(ref_loss) - 1) < 1e-2
    for got, r in zip((dx, dg, dw), ref):
        assert 1e-3 < rel_err(got, r) < 0.1


def test_fp8_carry_is_the_quantized_h():
    """With the last block's :class:`Fp8Carry` (``h = x * gamma`` in e4m3 at the block's scale)
    the op equals the one that quantizes ``h`` itself at that scale, and leaves the history row
    ``h`` as it was (the block records that tensor)."""
    x, gamma, w, t = _inputs(seed=3)
    meta = _calibrated_meta(x, gamma, w, t)
    hq, _ = quantize_tensor(x * gamma, meta[H], E4M3)
    carry = Fp8Carry(hq, jnp.sum(x * x, axis=1)[None])
    for save in (True, False):
        own = _op(save)(x, gamma, w, meta, t)
        got = _op(save, carry=carry)(x, gamma, w, meta, t)
        # The carry's sum of squares is reduced outside the op, the op's own inside it: the
        # losses may differ in their last float32 bit.
        assert abs(float(got[0]) - float(own[0])) <= 1e-6 * abs(float(own[0]))
        for u, v in zip(got[1][:3], own[1][:3]):
            assert rel_err(u, v) < 1e-6
        np.testing.assert_array_equal(got[1][3][H], meta[H])  # the h row: untouched
        np.testing.assert_array_equal(got[1][3][W], own[1][3][W])  # the weight's amax: the same tensor
        # dlogits comes through the row scale, whose sum of squares is reduced in two places (as
        # the loss above): its amax may differ in the last float32 bit too.
        np.testing.assert_allclose(got[1][3][G], own[1][3][G], rtol=1e-6)


def test_fp8_head_argument_rules():
    x, gamma, w, t = _inputs(m=16, d=32, v=64)
    with pytest.raises(ValueError, match=r"meta must be \[3, history\]"):
        fp8_linear_cross_entropy(x, gamma, w, t, jnp.zeros((4, 2)), recipe=Fp8Recipe())
    with pytest.raises(TypeError, match="carry must be an Fp8Carry"):
        fp8_linear_cross_entropy(x, gamma, w, t, jnp.zeros((3, 2)), recipe=Fp8Recipe(), carry=(x, x))
    hq, _ = quantize_tensor(x * gamma, None, E4M3)
    asking = Fp8Carry(hq, jnp.sum(x * x, axis=1)[None], jnp.float32(1.0))  # written under grad_through_carry
    with pytest.raises(ValueError, match="grad_through_carry=False"):
        fp8_linear_cross_entropy(x, gamma, w, t, jnp.zeros((3, 2)), recipe=Fp8Recipe(), carry=asking)
    with pytest.raises(ValueError, match="w_vocab must be"):
        fp8_linear_cross_entropy(x, gamma, w.T, t, jnp.zeros((3, 2)), recipe=Fp8Recipe())
    with pytest.raises(ValueError, match="Fp8Recipe.lm_head must be a bool"):
        Fp8Recipe(lm_head="yes")


# ---------------------------------------------------------------- the model ----------
_loss_and_grads = nnx.jit(lambda m, t: nnx.value_and_grad(
    lambda mm: mm.loss(t[:, :-1], t[:, 1:]), argnums=nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta)))(m))


def test_model_with_fp8_head():
    """``Fp8Recipe(lm_head=True)``: the last block writes an FP8 carry for the head; the loss and
    every gradient stay within FP8's error of the float32 model on the same weights; the
    head's histories record the weight's and the logits' gradient amaxes (``h``: the last block's
    ``h_out`` row); ``__call__`` (evaluation logits) runs the compute-dtype head and agrees with
    the loss."""
    cfg = LlamaConfig.tiny(vocab_size=512, num_layers=2, dtype=f32)
    tokens = jax.random.randint(jax.random.key(1), (4, 65), 0, cfg.vocab_size)
    ref = CodaLlama(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(ref, nnx.Param)
    model = CodaLlama(cfg.replace(fp8=Fp8Recipe(lm_head=True)), rngs=nnx.Rngs(0))
    nnx.update(model, params)
    assert model.blocks[-1].fp8_carry_out and not ref.blocks[-1].fp8_carry_out
    _, g = _loss_and_grads(model, jax.random.randint(jax.random.key(2), (4, 65), 0, cfg.vocab_size))
    head = np.asarray(g["fp8_head_meta"][...])
    assert head[W, 0] == float(jnp.max(jnp.abs(model.vocab_weight()))) and head[G, 0] > 0 and head[H, 0] == 0
    assert np.asarray(g["blocks"][1]["fp8_meta"][...])[8, 0] > 0  # TENSORS[8] == "h_out": the head's h
    nnx.update(model, nnx.filter_state(g, Fp8Meta))
    l32, g32 = _loss_and_grads(ref, tokens)
    l8, g8 = _loss_and_grads(model, tokens)
    assert 1e-5 < abs(float(l8) / float(l32) - 1) < 1e-2
    want = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(g32)}
    got = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(nnx.filter_state(g8, nnx.Param))}
    assert set(got) == set(want)
    for k in want:
        assert 1e-3 < rel_err(got[k], want[k]) < 0.35, (k, rel_err(got[k], want[k]))
    x = tokens[:, :-1]
    logits = nnx.jit(lambda m, x: m(x))(model, x)
    ce = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0])
    assert abs(float(ce) / float(l8) - 1) < 2e-2


def test_fp8_head_trains():
    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=32, dtype=f32, fp8=Fp8Recipe(history=4, lm_head=True))
    model = CodaLlama(cfg, rngs=nnx.Rngs(0))
    import optax

    from coda_jax import training
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step, _, graphdef = training.make_steps(model, opt)
    state = nnx.state((model, opt))
    tokens = jax.random.randint(jax.random.key(3), (4, 33), 0, 256)
    losses = []
    for _ in range(10):
        state, loss = step(state, tokens[:, :-1], tokens[:, 1:])
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
    m, _ = nnx.merge(graphdef, state)
    head = np.asarray(m.fp8_head_meta[...])
    assert (head[W] > 0).all() and (head[G] > 0).all() and (head[H] == 0).all(), head


def test_quantizing_run_takes_one_scaling():
    from coda_jax import programs
    from coda_jax.ops.fp8_gemm import quantizing_run

    for kw in ({}, {"scale": jnp.float32(1.0), "quantize": lambda x: x}):
        with pytest.raises(ValueError, match="exactly one of scale"):
            quantizing_run(lambda p, l, od: {}, programs.CE_GRAD_Q8, {}, "dlogits", f32, **kw)
