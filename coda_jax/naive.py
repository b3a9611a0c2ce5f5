"""Naive, unfused pure-JAX definitions of every fused op: the semantics the ops must match.

These are what a user would write without coda-jax (norm -> matmul -> activation ...),
with float32 math and ``jax.grad`` for gradients. Tests compare every backend's forward
and custom backward against them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from coda_jax.ops.swiglu_layout import split_gate_up


def rms_norm(x: jax.Array, gamma: jax.Array, eps: float = 1e-5) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * gamma`` over the last axis, in float32."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * gamma.astype(jnp.float32)


def _mm(a, b):
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def matmul_residual(y, w, residual):
    """``residual + y @ w``."""
    return residual.astype(jnp.float32) + _mm(y, w)


def rms_norm_matmul(x, gamma, w, eps=1e-5):
    """``RMSNorm(x) @ w``."""
    return _mm(rms_norm(x, gamma, eps), w)


def rms_norm_matmul_swiglu(x, gamma, w_gu, eps=1e-5):
    """``silu(n @ W_gate) * (n @ W_up)`` with ``n = RMSNorm(x)``, ``w_gu`` block-interleaved."""
    w_gate, w_up = split_gate_up(w_gu)
    n = rms_norm(x, gamma, eps)
    return jax.nn.silu(_mm(n, w_gate)) * _mm(n, w_up)


def swiglu_mlp(x, gamma, w_gu, w_down, eps=1e-5):
    """``x + SwiGLU(RMSNorm(x)) @ w_down`` (the Llama MLP with its residual)."""
    return matmul_residual(rms_norm_matmul_swiglu(x, gamma, w_gu, eps), w_down, x)


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE of ``x [..., M, heads, hd]`` at ``positions [M]``."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_norm_matmul_rope(x, gamma, w_qkv, positions, inv_freq, *, num_heads, num_kv_heads,
                         q_norm=None, k_norm=None, qk_norm_eps=1e-6, eps=1e-5):
    """RMSNorm -> separate Q, K, V projections -> optional QK-norm -> RoPE on Q and K."""
    hd = 2 * inv_freq.shape[0]
    m = x.shape[0]
    z = rms_norm_matmul(x, gamma, w_qkv, eps)
    q = z[:, : num_heads * hd].reshape(m, num_heads, hd)
    k = z[:, num_heads * hd: (num_heads + num_kv_heads) * hd].reshape(m, num_kv_heads, hd)
    v = z[:, (num_heads + num_kv_heads) * hd:]
    if q_norm is not None:
        q = rms_norm(q, q_norm, qk_norm_eps)
        k = rms_norm(k, k_norm, qk_norm_eps)
    q = apply_rope(q, positions, inv_freq).reshape(m, -1)
    k = apply_rope(k, positions, inv_freq).reshape(m, -1)
    return jnp.concatenate([q, k, v], axis=1)


def linear_cross_entropy(x, gamma, w_vocab, targets, *, eps=1e-5, ignore_index=-100, reduction="mean", z_loss=0.0):
    """Full-logits cross-entropy of ``RMSNorm(x) @ w_vocab^T`` (materializes ``[M, V]``)."""
    logits = _mm(rms_norm(x, gamma, eps), w_vocab.T)
    lse = jax.nn.logsumexp(logits, axis=-1)
    valid = targets != ignore_index
    tl = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[:, None], axis=-1)[:, 0]
    losses = jnp.where(valid, lse - tl + z_loss * lse ** 2, 0.0)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / jnp.maximum(valid.sum(), 1)
