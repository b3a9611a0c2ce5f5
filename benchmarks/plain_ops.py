"""Each fused op written the plain JAX way: the per-op baseline of ``bench.py --parts ops``.

What a JAX user writes without coda-jax, in the style of :mod:`plain_llama` (bfloat16
GEMMs through ``@``, RMSNorm with float32 statistics, rotate-half RoPE, full-logit
cross-entropy on bfloat16 logits), differentiated by ``jax.grad``. Each function takes the
arguments of the fused op's benchmark case (same shapes, same fused weight layouts: the
gate/up product is one GEMM whose columns are split afterwards, as a user with a fused
``w_gu`` would), so the same inputs time both and the errors against float32 math compare.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from coda_jax.ops.swiglu_layout import split_gate_up
from benchmarks.plain_llama import rms_norm

EPS = 1e-5


def matmul_residual(y, w, residual, gamma_next):
    """``residual + y @ w`` (the next RMSNorm is the next op's work here)."""
    del gamma_next
    return residual + y @ w


def matmul_residual_rms(y, w, residual, gamma_next):
    """``residual + y @ w`` and what the fused op also hands the next RMSNorm: ``h = x *
    gamma_next`` and the per-row sum of ``x^2`` (float32). Like the fused op's carry, they are
    a forward-only cache (no gradient flows through them)."""
    x = residual + y @ w
    xs, gs = jax.lax.stop_gradient((x, gamma_next))
    h = (xs.astype(jnp.float32) * gs.astype(jnp.float32)).astype(x.dtype)
    return x, h, jnp.sum(jnp.square(xs.astype(jnp.float32)), axis=1)


def rms_norm_matmul(x, gamma, w):
    return rms_norm(x, gamma, EPS) @ w


def rms_norm_matmul_swiglu(x, gamma, w_gu):
    gate, up = split_gate_up(rms_norm(x, gamma, EPS) @ w_gu)
    return jax.nn.silu(gate) * up


def swiglu_mlp(x, gamma, w_gu, w_down):
    return x + rms_norm_matmul_swiglu(x, gamma, w_gu) @ w_down


def rms_norm_matmul_rope(x, gamma, w_qkv, positions, inv_freq, *, num_heads, num_kv_heads):
    """RMSNorm -> one QKV GEMM -> RoPE on Q and K; ``[M, (h + 2 kv) * hd]`` like the fused op."""
    hd = 2 * inv_freq.shape[0]
    m = x.shape[0]
    z = rms_norm(x, gamma, EPS) @ w_qkv
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]

    def rope(t, heads):
        t1, t2 = jnp.split(t.reshape(m, heads, hd).astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1).reshape(m, -1).astype(t.dtype)

    q = rope(z[:, : num_heads * hd], num_heads)
    k = rope(z[:, num_heads * hd: (num_heads + num_kv_heads) * hd], num_kv_heads)
    return jnp.concatenate([q, k, z[:, (num_heads + num_kv_heads) * hd:]], axis=1)


def linear_cross_entropy(x, gamma, w_vocab, targets):
    """Mean cross-entropy of the bfloat16 logits ``RMSNorm(x) @ w_vocab^T``, upcast (as
    :class:`plain_llama.PlainLlama`'s loss)."""
    logits = (rms_norm(x, gamma, EPS) @ w_vocab.T).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
