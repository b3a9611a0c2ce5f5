"""The baseline of record: a plain, unfused JAX Llama, as a JAX user writes it in an afternoon.

Flax NNX, the same :class:`coda_jax.layers.LlamaConfig` (shapes, tied embeddings, Llama-3 RoPE
scaling, float32 parameters with bfloat16 compute), separate Q/K/V and gate/up projections,
RMSNorm written out in ``jnp``, ``jax.nn.dot_product_attention`` (cuDNN on a GPU, the same
choice :class:`coda_jax.layers.CodaLlamaBlock` makes), and full-logit cross-entropy in XLA
(``optax.softmax_cross_entropy_with_integer_labels`` on the bf16 logits, upcast). On a mesh
its state is placed by :func:`shard_plain_state`: FSDP over the largest dimension, and with a
tensor axis Megatron's split of the block weights (Q/K/V and gate/up by columns, ``wo`` and
``w_down`` by rows), which the partitioner under an Auto mesh follows with sharded heads and
MLP features and an all-reduce after each row-parallel GEMM. Under an Explicit mesh (sharding
in types) each weight is gathered whole where it is used, as a user writes FSDP there
(``jax.sharding.reshard``); with a tensor axis that is FSDP over it, not Megatron. No coda-jax
op runs in it: every speed target of coda-jax is "this model's train step, same config, same
optimizer, same batch, same process" (``benchmarks/train_step_bench.py``).

:meth:`PlainLlama.from_coda` copies a :class:`coda_jax.layers.CodaLlama`'s weights, so a test
checks that both compute the same function (``tests/test_plain_llama.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from coda_jax.layers import CodaLlama, LlamaConfig
from coda_jax.ops.attention import causal_attention
from coda_jax.ops.rope_frequencies import rope_inv_freq
from coda_jax.ops.swiglu_layout import split_gate_up
from coda_jax.sharding import explicit_sharding, gathered, shard_state

# Megatron's tensor split of the block weights ([in, out] each): Q, K, V, gate and up by
# columns (heads, MLP features), the o and down projections by rows. The embedding is not
# split over "tensor": split by vocabulary, under an Auto mesh the partitioner gathered
# activations around the lookup and the tied head (28 activation all-gathers in a 2-layer
# step on fsdp=2 x tensor=2 CPU devices, none without).
TENSOR_SPLIT_DIM = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 0}


def shard_plain_state(state, mesh):
    """``state`` (the plain model's, optionally with its optimizer's) placed on ``mesh``:
    :func:`coda_jax.sharding.shard_state` with :data:`TENSOR_SPLIT_DIM` (FSDP over each
    weight's largest other dimension)."""
    return shard_state(state, mesh, tensor_split_dims=TENSOR_SPLIT_DIM)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``x / rms(x) * w`` over the last axis (float32 statistics, result in ``x.dtype``)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of ``x [B, S, H, hd]`` with ``cos, sin [B, S, 1, hd/2]``."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _use(w: nnx.Variable, dtype) -> jax.Array:
    """Weight ``w`` in ``dtype``; under an Explicit mesh gathered whole
    (:func:`coda_jax.sharding.gathered`: FSDP's all-gather, whose transpose reduce-scatters the
    gradient), since sharding in types refuses a matmul whose contracted axis is split."""
    return gathered(w[...].astype(dtype))


def _param(rngs: nnx.Rngs, shape, std, dtype) -> nnx.Param:
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * std)


class PlainLlamaBlock(nnx.Module):
    """Pre-norm Llama decoder layer: RMSNorm -> Q/K/V -> RoPE -> attention -> o-proj + residual
    -> RMSNorm -> SwiGLU MLP + residual. Weights ``[in, out]``."""

    def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = c
        d, f, hd, pd = c.hidden_size, c.intermediate_size, c.head_dim, c.param_dtype
        self.attn_norm = nnx.Param(jnp.ones((d,), pd))
        self.wq = _param(rngs, (d, c.num_heads * hd), d ** -0.5, pd)
        self.wk = _param(rngs, (d, c.num_kv_heads * hd), d ** -0.5, pd)
        self.wv = _param(rngs, (d, c.num_kv_heads * hd), d ** -0.5, pd)
        self.wo = _param(rngs, (c.num_heads * hd, d), (c.num_heads * hd) ** -0.5 / (2 * c.num_layers) ** 0.5, pd)
        self.mlp_norm = nnx.Param(jnp.ones((d,), pd))
        self.w_gate = _param(rngs, (d, f), d ** -0.5, pd)
        self.w_up = _param(rngs, (d, f), d ** -0.5, pd)
        self.w_down = _param(rngs, (f, d), f ** -0.5 / (2 * c.num_layers) ** 0.5, pd)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """``x [B, S, d]`` (compute dtype) -> ``[B, S, d]``."""
        c = self.config
        b, s, _ = x.shape
        dt, hd = c.dtype, c.head_dim
        f32 = jnp.float32
        h = rms_norm(x, _use(self.attn_norm, f32), c.rms_norm_eps)
        q = rope((h @ _use(self.wq, dt)).reshape(b, s, c.num_heads, hd), cos, sin)
        k = rope((h @ _use(self.wk, dt)).reshape(b, s, c.num_kv_heads, hd), cos, sin)
        v = (h @ _use(self.wv, dt)).reshape(b, s, c.num_kv_heads, hd)
        o = causal_attention(q, k, v, c.attention_implementation)  # the choice CodaLlamaBlock makes
        x = x + o.reshape(b, s, -1) @ _use(self.wo, dt)
        h = rms_norm(x, _use(self.mlp_norm, f32), c.rms_norm_eps)
        y = jax.nn.silu(h @ _use(self.w_gate, dt)) * (h @ _use(self.w_up, dt))
        return x + y @ _use(self.w_down, dt)


def _run_block(block: PlainLlamaBlock, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return block(x, cos, sin)


class PlainLlama(nnx.Module):
    """Embedding, :class:`PlainLlamaBlock` stack, final RMSNorm, LM head, full-logit loss."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        if c.qk_norm:
            raise ValueError("PlainLlama is the Llama-3 baseline: config.qk_norm must be False")
        self.config = c
        self.embed = _param(rngs, (c.vocab_size, c.hidden_size), 0.02, c.param_dtype)
        self.blocks = nnx.List([self._make_block(c, rngs) for _ in range(c.num_layers)])
        self.final_norm = nnx.Param(jnp.ones((c.hidden_size,), c.param_dtype))
        if not c.tie_word_embeddings:
            self.lm_head = _param(rngs, (c.vocab_size, c.hidden_size), c.hidden_size ** -0.5, c.param_dtype)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)))

    def _make_block(self, c: LlamaConfig, rngs: nnx.Rngs) -> PlainLlamaBlock:
        """One decoder layer (a subclass builds its own: ``plain_fp8_llama.PlainFp8Llama``)."""
        return PlainLlamaBlock(c, rngs=rngs)

    def logits(self, tokens: jax.Array) -> jax.Array:
        """``tokens [B, S]`` int -> logits ``[B, S, V]`` in the compute dtype."""
        c = self.config
        b, s = tokens.shape
        explicit = explicit_sharding(tokens)
        if explicit is not None:  # one gathered bf16 table for the lookup and the tied head
            table = _use(self.embed, c.dtype)
            # the rows land where their tokens lie
            x = table.at[tokens].get(out_sharding=PartitionSpec(*explicit.spec, None))
        else:
            x = jnp.take(self.embed[...], tokens, axis=0).astype(c.dtype)
        ang = jnp.arange(s, dtype=jnp.float32)[:, None] * _use(self.inv_freq, jnp.float32)[None, :]
        cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
        # config.remat == "block": each block's forward runs again in the backward, as CodaLlama's
        run = nnx.remat(_run_block) if c.remat == "block" else _run_block
        for block in self.blocks:
            x = run(block, x, cos, sin)
        h = rms_norm(x, _use(self.final_norm, jnp.float32), c.rms_norm_eps)
        if not c.tie_word_embeddings:
            return self._head(h, _use(self.lm_head, c.dtype))
        return self._head(h, table if explicit is not None else self.embed[...].astype(c.dtype))

    def _head(self, h: jax.Array, w_vocab: jax.Array) -> jax.Array:
        """The LM head: ``h [B, S, d] @ w_vocab [V, d]^T`` (a subclass runs it in FP8)."""
        return h @ w_vocab.T

    def loss(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy (float32) over all ``[B, S]`` positions."""
        logits = self.logits(tokens).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @classmethod
    def from_coda(cls, model: CodaLlama, **kwargs) -> "PlainLlama":
        """The same weights as ``model`` (fused ``w_qkv`` / ``w_gu`` split back); ``kwargs``
        go to the constructor (a subclass's own arguments)."""
        c = model.config
        plain = cls(c, rngs=nnx.Rngs(0), **kwargs)
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        plain.embed[...] = model.embed[...]
        plain.final_norm[...] = model.final_norm[...]
        if not c.tie_word_embeddings:
            plain.lm_head[...] = model.lm_head[...]
        for p, q in zip(plain.blocks, model.blocks):
            w = q.w_qkv[...]
            p.wq[...], p.wk[...], p.wv[...] = w[:, :nq], w[:, nq:nq + nkv], w[:, nq + nkv:]
            p.w_gate[...], p.w_up[...] = split_gate_up(q.w_gu[...])
            for name in ("attn_norm", "mlp_norm", "w_down"):
                getattr(p, name)[...] = getattr(q, name)[...]
            p.wo[...] = q.w_o[...]
        return plain
