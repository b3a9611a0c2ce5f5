"""CodaLlamaBlock / CodaLlama against a naive unfused Llama written with plain jnp."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from coda_jax import naive
from coda_jax.layers import CodaLlama, CodaLlamaBlock, LlamaConfig
from coda_jax.ops.norm_carry import norm_carry
from op_cases import rel_err

CFG = LlamaConfig.tiny(vocab_size=320, hidden_size=128, intermediate_size=192, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=32, attention_implementation=None,
                       rope_scaling=None)


def naive_block(p, x, positions, cfg):
    """Unfused Llama layer: norm -> q/k/v -> RoPE -> attention -> o + residual -> norm -> SwiGLU MLP."""
    b, s, d = x.shape
    m = b * s
    x2 = x.reshape(m, d)
    qk = dict(q_norm=p["q_norm"], k_norm=p["k_norm"], qk_norm_eps=cfg.qk_norm_eps) if cfg.qk_norm else {}
    qkv = naive.rms_norm_matmul_rope(x2, p["attn_norm"], p["w_qkv"], positions.reshape(m), p["inv_freq"],
                                     num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, eps=cfg.rms_norm_eps, **qk)
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = qkv[:, : nh * hd].reshape(b, s, nh, hd)
    k = qkv[:, nh * hd: (nh + nkv) * hd].reshape(b, s, nkv, hd)
    v = qkv[:, (nh + nkv) * hd:].reshape(b, s, nkv, hd)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(m, nh * hd)
    x1 = naive.matmul_residual(o, p["w_o"], x2)
    y = naive.rms_norm_matmul_swiglu(x1, p["mlp_norm"], p["w_gu"], eps=cfg.rms_norm_eps)
    return naive.matmul_residual(y, p["w_down"], x1).reshape(b, s, d)


def _block_params(block):
    return {k: v[...] for k, v in nnx.state(block, nnx.Variable).items()}


def _randomize(module, seed=1):
    """Norm weights start at one; perturb every parameter so the test sees them."""
    graphdef, state = nnx.split(module)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [l + 0.05 * jax.random.normal(k, l.shape, l.dtype) if l.ndim == 1 and l.shape[0] != CFG.head_dim // 2 else l
              for k, l in zip(keys, leaves)]
    nnx.update(module, jax.tree.unflatten(tree, leaves))
    return module


@pytest.mark.parametrize("qk_norm", [False, True])
def test_block_forward_and_grads_match_naive(qk_norm):
    cfg = CFG.replace(qk_norm=qk_norm)
    block = _randomize(CodaLlamaBlock(cfg, rngs=nnx.Rngs(0), backend="xla"))
    x = jax.random.normal(jax.random.key(2), (2, 24, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    r = jax.random.normal(jax.random.key(3), x.shape)
    out, carry = block(x, pos)
    assert carry is None
    ref = naive_block(_block_params(block), x, pos, cfg)
    assert rel_err(out, ref) < 2e-5

    def loss_fused(block, x):
        return jnp.sum(block(x, pos)[0] * r)

    def loss_naive(p, x):
        return jnp.sum(naive_block(p, x, pos, cfg) * r)

    gb, gx = nnx.grad(loss_fused, argnums=(0, 1))(block, x)
    gp, gx_ref = jax.grad(loss_naive, argnums=(0, 1))(_block_params(block), x)
    assert rel_err(gx, gx_ref) < 2e-4
    for name, g in nnx.state(gb, nnx.Param).items():
        assert rel_err(g[...], gp[name]) < 2e-4, name


def test_block_carry_is_the_next_norms_stats():
    block = _randomize(CodaLlamaBlock(CFG, rngs=nnx.Rngs(0), backend="xla"))
    x = jax.random.normal(jax.random.key(2), (2, 16, CFG.hidden_size))
    gamma_next = 1 + 0.1 * jax.random.normal(jax.random.key(4), (CFG.hidden_size,))
    out, carry = block(x, next_norm=gamma_next)
    want = norm_carry(out.reshape(-1, CFG.hidden_size), gamma_next)
    assert rel_err(carry.h, want.h) < 1e-5
    assert rel_err(carry.sumsq.sum(0), want.sumsq.sum(0)) < 1e-5
    # Feeding the carry to the next block equals recomputing it.
    nxt = CodaLlamaBlock(CFG, rngs=nnx.Rngs(5), backend="xla")
    nxt.attn_norm[...] = gamma_next
    assert rel_err(nxt(out, carry=carry)[0], nxt(out)[0]) < 1e-5


def test_block_validates_width():
    block = CodaLlamaBlock(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must be \[batch, seq, 128\]"):
        block(jnp.ones((1, 4, 64)))


def _naive_model_loss(model, tokens, targets):
    cfg = model.config
    x = jnp.take(model.embed[...], tokens, axis=0)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for blk in model.blocks:
        x = naive_block(_block_params(blk), x, pos, cfg)
    return naive.linear_cross_entropy(x.reshape(-1, cfg.hidden_size), model.final_norm[...], model.vocab_weight(),
                                      targets.reshape(-1), eps=cfg.rms_norm_eps)


@pytest.mark.parametrize("tied", [True, False])
def test_model_loss_logits_and_grads_match_naive(tied):
    cfg = CFG.replace(tie_word_embeddings=tied)
    model = _randomize(CodaLlama(cfg, rngs=nnx.Rngs(0), backend="xla"))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    loss = model.loss(inp, tgt)
    assert rel_err(loss, _naive_model_loss(model, inp, tgt)) < 1e-5
    logits = model(inp)
    assert logits.shape == (2, 32, cfg.vocab_size)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()
    assert rel_err(ce, loss) < 1e-5
    g = nnx.grad(lambda m: m.loss(inp, tgt))(model)
    g_ref = nnx.grad(lambda m: _naive_model_loss(m, inp, tgt))(model)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(g, nnx.Param)), nnx.to_flat_state(nnx.state(g_ref, nnx.Param))):
        assert rel_err(a[...], b[...]) < 5e-4, path


def test_jit_train_step_with_remat_lowers_the_loss():
    model = CodaLlama(CFG, rngs=nnx.Rngs(0), backend="xla")
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64)  # small alphabet: learnable

    @nnx.jit
    def step(model, opt, tokens):
        loss_fn = nnx.remat(lambda m: m.loss(tokens[:, :-1], tokens[:, 1:]))
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, tokens)) for _ in range(15)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_block_remat_recomputes_blocks_with_the_same_gradients():
    """``LlamaConfig.remat="block"``: the loss and every gradient equal the model without it,
    the backward recomputes each block (a remat in the jaxpr) and the compiled step needs
    less temporary memory (each block saves only its input and norm carry)."""
    tokens = jax.random.randint(jax.random.key(1), (4, 65), 0, CFG.vocab_size)
    got, temp = {}, {}
    for remat in ("none", "block"):
        graphdef, state = nnx.split(_randomize(CodaLlama(CFG.replace(remat=remat), rngs=nnx.Rngs(0), backend="xla")))
        fn = jax.value_and_grad(lambda st, t: nnx.merge(graphdef, st).loss(t[:, :-1], t[:, 1:]))
        got[remat] = jax.jit(fn)(state, tokens)
        temp[remat] = jax.jit(fn).lower(state, tokens).compile().memory_analysis().temp_size_in_bytes
        assert ("remat" in str(jax.make_jaxpr(fn)(state, tokens))) == (remat == "block")
    assert rel_err(got["block"][0], got["none"][0]) < 1e-6
    for a, b in zip(jax.tree.leaves(got["block"][1]), jax.tree.leaves(got["none"][1])):
        assert rel_err(a, b) < 1e-5
    assert temp["block"] < 0.8 * temp["none"], temp
    with pytest.raises(ValueError, match="remat must be one of"):
        CFG.replace(remat="full")


def test_bf16_model_runs_and_is_close_to_f32():
    m32 = CodaLlama(CFG, rngs=nnx.Rngs(0), backend="xla")
    m16 = CodaLlama(CFG.replace(dtype=jnp.bfloat16), rngs=nnx.Rngs(0), backend="xla")
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, CFG.vocab_size)
    l32, l16 = m32.loss(tokens[:, :-1], tokens[:, 1:]), m16.loss(tokens[:, :-1], tokens[:, 1:])
    assert l16.dtype == jnp.float32 and abs(float(l16) - float(l32)) / float(l32) < 2e-2
