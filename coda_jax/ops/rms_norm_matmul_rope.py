"""RMSNorm -> fused QKV GEMM -> (QK-norm) -> RoPE on Q and K (attention input, CODA step 4).

    z = rstd * (h @ w_qkv)                          [M, (H + 2*KV) * hd]: Q heads, K heads, V heads
    u = z, or per-head RMSNorm(z) * w for Q/K heads (QK-norm)
    qkv = RoPE(u) for Q/K heads (rotate-half pairs (i, i+hd/2)), u for V heads

The epilogue runs in pair mode with ``pair_block = hd/2``, so one head is one pair block;
``cos``/``sin`` tables ``[M, hd/2]`` are computed once per token (XLA, tiny) and read by
the epilogue as row_block loads (computing sin/cos per head in the epilogue costs several
times the GEMM: docs/performance.md#kernels); V heads (``rot`` = 0) pass unrotated with
QK-norm off. Backward (no QK-norm): RoPE is a rotation, ``dz = R^T dqkv`` and
``sum(z*dz) = sum(qkv*dqkv)`` (CODA's zdz trick: nothing but the output is saved). With
QK-norm the pre-norm ``z`` is saved and the per-head norm is differentiated inside each head
(block-local).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.epilogue import join_pairs, split_pairs
from coda_jax.lowering import pair_width_rule
from coda_jax.ops.checks import check_vector
from coda_jax.ops.names import RMS_NORM_MATMUL_ROPE
from coda_jax.ops.norm_carry import NormCarry, resolve_carry
from coda_jax.ops.normed_gemm import normed_gemm
from coda_jax.ops.rms_norm_matmul import check_norm_inputs


@dataclasses.dataclass(frozen=True)
class RopeVariant:
    half_head: int
    qk_norm_eps: float | None
    splits: tuple[int, ...] | None = None  # Q, K, V column widths when returned apart

    @property
    def out_splits(self):
        return None if self.splits is None else {"qkv": self.splits}

    def program(self, train):
        return programs.rms_rope(self.half_head, self.qk_norm_eps, train and self.qk_norm_eps is not None)

    def loads(self, aux):
        out = {"cos": aux["cos"], "sin": aux["sin"], "rot": aux["rot"]}
        if self.qk_norm_eps is not None:
            out["qk_w"] = aux["qk_w"]
        return out

    def primal(self, outs):
        return outs["qkv"]

    def saved(self, outs):
        return (outs["qkv"], outs.get("z"))

    def backward(self, saved, dqkv, aux):
        qkv, z = saved
        if self.splits is not None:  # (q, k, v) side by side again: fused into the pass below
            qkv, dqkv = jnp.concatenate(qkv, axis=1), jnp.concatenate(dqkv, axis=1)
        b = self.half_head
        zero_aux = jax.tree.map(jnp.zeros_like, aux)
        if self.qk_norm_eps is None:
            zdz = jnp.sum(qkv.astype(jnp.float32) * dqkv.astype(jnp.float32), axis=1)
            return _rope_transpose(dqkv, aux, b), zdz, zero_aux
        on = aux["rot"].reshape(-1, b)[None] > 0  # [1, heads, b]
        du_lo, du_hi = split_pairs(_rope_transpose(dqkv, aux, b), b)  # R^T dqkv
        z_lo, z_hi = (v.astype(jnp.float32) for v in split_pairs(z, b))
        w_lo, w_hi = (v[None] for v in split_pairs(aux["qk_w"], b))
        r = jax.lax.rsqrt((jnp.sum(z_lo * z_lo, -1, keepdims=True) + jnp.sum(z_hi * z_hi, -1, keepdims=True))
                          / (2 * b) + self.qk_norm_eps)
        zh_lo, zh_hi = z_lo * r, z_hi * r
        dzh_lo, dzh_hi = du_lo * w_lo, du_hi * w_hi
        mean = (jnp.sum(zh_lo * dzh_lo, -1, keepdims=True) + jnp.sum(zh_hi * dzh_hi, -1, keepdims=True)) / (2 * b)
        dz_lo = jnp.where(on, r * (dzh_lo - zh_lo * mean), du_lo)
        dz_hi = jnp.where(on, r * (dzh_hi - zh_hi * mean), du_hi)
        dqk_w = join_pairs(jnp.where(on, du_lo * zh_lo, 0.0).sum(0), jnp.where(on, du_hi * zh_hi, 0.0).sum(0))
        zdz = jnp.sum(z_lo * dz_lo + z_hi * dz_hi, axis=(1, 2))
        daux = dict(zero_aux, qk_w=dqk_w.astype(aux["qk_w"].dtype))
        return join_pairs(dz_lo, dz_hi), zdz, daux


def _rope_transpose(dqkv: jax.Array, aux, b: int) -> jax.Array:
    """``R^T dqkv`` ``[M, N]`` float32: per head, ``du_lo = d_lo c + d_hi s`` and
    ``du_hi = d_hi c - d_lo s`` (V heads: ``c = 1, s = 0``).

    Computed on the ``[M, heads, 2, b]`` view with the pair axis reversed for the partner
    half, and reshaped back: one elementwise pass, where splitting into halves and
    joining them again cost XLA a concatenation, one more pass over the whole gradient
    (docs/performance.md#kernels)."""
    m, n = dqkv.shape
    y = dqkv.astype(jnp.float32).reshape(m, n // (2 * b), 2, b)
    on = (aux["rot"].reshape(-1, b)[:, :1] > 0)[None, :, :, None]  # [1, heads, 1, 1]
    c = jnp.where(on, aux["cos"][:, None, None, :], 1.0)
    s = jnp.where(on, aux["sin"][:, None, None, :], 0.0)
    sign = jnp.array([1.0, -1.0], jnp.float32)[:, None]  # [2, 1]: + for the lo half, - for hi
    return (y * c + sign * y[:, :, ::-1, :] * s).reshape(m, n)


def rope_rotated_columns(num_heads: int, num_kv_heads: int, half_head: int) -> jax.Array:
    """Per-pair-column ``[(H + 2*KV) * hd/2]`` float32: 1 for Q/K heads, 0 for V heads."""
    qk = (num_heads + num_kv_heads) * half_head
    return jnp.concatenate([jnp.ones((qk,), jnp.float32), jnp.zeros((num_kv_heads * half_head,), jnp.float32)])


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``cos``/``sin`` of ``positions[:, None] * inv_freq[None]``: ``[M, hd/2]`` float32 each.

    Computed once per token (not once per head): the epilogue reads them as row_block loads.
    """
    ang = positions.astype(jnp.float32)[:, None] * inv_freq.astype(jnp.float32)[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def rms_norm_matmul_rope(
    x: jax.Array,
    gamma: jax.Array,
    w_qkv: jax.Array,
    positions: jax.Array,
    inv_freq: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    q_norm: jax.Array | None = None,
    k_norm: jax.Array | None = None,
    qk_norm_eps: float = 1e-6,
    carry: NormCarry | None = None,
    eps: float = 1e-5,
    return_residual: bool = False,
    split_qkv: bool = False,
    backend: str | None = None,
):
    """``RoPE(QKnorm?(RMSNorm(x) @ w_qkv))`` on Q and K heads; V heads untouched.

    Args:
      x: ``[M, d]`` residual stream.
      gamma: ``[d]`` RMSNorm weight.
      w_qkv: ``[d, (H + 2*KV) * hd]`` fused weight: columns of the ``H`` query heads, then
        the ``KV`` key heads, then the ``KV`` value heads, each head in Hugging Face order
        (rotate-half: dimension ``i`` pairs with ``i + hd/2``).
      positions: ``[M]`` integer position of each token (any order: packed sequences work).
      inv_freq: ``[hd/2]`` rotary inverse frequencies (:func:`coda_jax.rope_inv_freq`).
      num_heads, num_kv_heads: ``H`` and ``KV`` (GQA: ``H % KV == 0``).
      q_norm, k_norm: optional ``[hd]`` QK-norm weights (both or neither).
      qk_norm_eps: QK-norm epsilon.
      carry, eps, return_residual, backend: as in :func:`coda_jax.rms_norm_matmul`.
      split_qkv: return ``(q [M, H*hd], k [M, KV*hd], v [M, KV*hd])`` instead of ``qkv``:
        the same columns, as three arrays. The Pallas kernel writes them apart (no
        slicing pass before attention, which needs each one contiguous); other backends
        slice their output.

    Returns:
      ``qkv [M, (H + 2*KV) * hd]`` (or ``(q, k, v)``, see ``split_qkv``) in ``x.dtype``,
      and ``x`` if ``return_residual``.
    """
    check_norm_inputs(x, gamma, w_qkv)
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    half = inv_freq.shape[0] if inv_freq.ndim == 1 else -1
    hd = 2 * half
    n = (num_heads + 2 * num_kv_heads) * hd
    if half <= 0 or w_qkv.shape[1] != n:
        raise ValueError(
            f"w_qkv must have (num_heads + 2*num_kv_heads) * head_dim = {n} columns with head_dim = "
            f"2 * inv_freq.shape[0] = {hd}; got w_qkv {tuple(w_qkv.shape)}, inv_freq {tuple(inv_freq.shape)}")
    if positions.shape != (x.shape[0],) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer array of shape ({x.shape[0]},), got {positions.dtype}{tuple(positions.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm, or neither")
    cos, sin = rope_tables(positions, inv_freq)
    aux = {"cos": cos, "sin": sin, "rot": rope_rotated_columns(num_heads, num_kv_heads, half)}
    qk_eps = None
    if q_norm is not None:
        check_vector("q_norm", q_norm, hd)
        check_vector("k_norm", k_norm, hd)
        aux["qk_w"] = jnp.concatenate([jnp.tile(q_norm.astype(jnp.float32), num_heads),
                                       jnp.tile(k_norm.astype(jnp.float32), num_kv_heads),
                                       jnp.ones((num_kv_heads * hd,), jnp.float32)])
        qk_eps = float(qk_norm_eps)
    carry = resolve_carry(x, gamma, carry)
    lowering = lowering_for(RMS_NORM_MATMUL_ROPE, backend)
    rule = pair_width_rule(lowering, hd)  # the epilogue pairs the two halves of a head
    if rule:
        raise ValueError(f"head_dim={hd} is not supported by backend {lowering.name!r}: the RoPE epilogue's pair "
                         f"width (head_dim) {rule}; use backend='xla'")
    splits = (num_heads * hd, num_kv_heads * hd, num_kv_heads * hd) if split_qkv else None
    return normed_gemm(lowering, RopeVariant(half, qk_eps, splits), float(eps), return_residual,
                       x, gamma, w_qkv, carry.h, carry.sumsq, aux)
