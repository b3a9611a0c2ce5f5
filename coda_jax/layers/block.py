"""``CodaLlamaBlock``: a Llama decoder layer whose non-attention ops live in GEMM epilogues."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from coda_jax.layers.attention import causal_attention
from coda_jax.layers.config import LlamaConfig
from coda_jax.ops.matmul_residual_rms import matmul_residual_rms
from coda_jax.ops.norm_carry import NormCarry
from coda_jax.ops.rms_norm_matmul_rope import rms_norm_matmul_rope
from coda_jax.ops.swiglu_mlp import swiglu_mlp
from coda_jax.ops.rope_frequencies import rope_inv_freq
from coda_jax.sharding import gathered, reshape_tokens


def _normal(rngs: nnx.Rngs, shape, std, dtype):
    return jax.random.normal(rngs.params(), shape, dtype) * std


class CodaLlamaBlock(nnx.Module):
    """One Llama decoder layer: four GEMM-epilogue programs around attention.

    1. ``qkv = RoPE(rstd * (h @ w_qkv))``        (input norm folded into the QKV GEMM)
    2. ``o = dot_product_attention(q, k, v)``     (causal, GQA; cuDNN on GPU)
    3. ``x1 = x + o @ w_o``  -> carry ``(x1 * mlp_norm, sumsq(x1))``
    4. ``y = silu(.) * (.)`` of ``rstd1 * (h1 @ w_gu)``
    5. ``x2 = x1 + y @ w_down`` -> carry for the *next* norm (``next_norm``)

    Steps 4-5 are one op (:func:`coda_jax.swiglu_mlp`), so that the SwiGLU backward runs in
    the epilogue of the down projection's dgrad GEMM.

    Parameters follow Llama checkpoint names (``input_layernorm`` = ``attn_norm``,
    ``post_attention_layernorm`` = ``mlp_norm``), with Q/K/V fused into ``w_qkv``
    ``[d, (H + 2*KV) * hd]`` and gate/up into ``w_gu`` ``[d, 2f]`` (64-column blocks).
    Weights are ``[in, out]``.

    Call: ``block(x [B, S, d], positions [B, S] int, carry=None, next_norm=None)``
    returns ``(x_out [B, S, d], carry_out)``. ``carry`` is the :class:`NormCarry` of ``x``
    for this block's input norm (from the previous block; ``None`` computes it), and
    ``next_norm`` the ``[d]`` weight of the norm that reads ``x_out`` (the next block's
    ``attn_norm`` or the final norm): with it, the last GEMM's epilogue writes the next
    carry, so no standalone norm pass runs between blocks.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, backend: str | None = None):
        c = config
        self.config = c
        self.backend = backend
        d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
        pd = c.param_dtype
        self.attn_norm = nnx.Param(jnp.ones((d,), pd))
        self.w_qkv = nnx.Param(_normal(rngs, (d, c.qkv_size), d ** -0.5, pd))
        self.w_o = nnx.Param(_normal(rngs, (c.num_heads * hd, d), (c.num_heads * hd) ** -0.5 / (2 * c.num_layers) ** 0.5, pd))
        self.mlp_norm = nnx.Param(jnp.ones((d,), pd))
        self.w_gu = nnx.Param(_normal(rngs, (d, 2 * f), d ** -0.5, pd))
        self.w_down = nnx.Param(_normal(rngs, (f, d), f ** -0.5 / (2 * c.num_layers) ** 0.5, pd))
        if c.qk_norm:
            self.q_norm = nnx.Param(jnp.ones((hd,), pd))
            self.k_norm = nnx.Param(jnp.ones((hd,), pd))
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(hd, c.rope_theta, c.rope_scaling)))

    def _param(self, name: str, dtype=None) -> jax.Array:
        """Parameter ``name`` as the layer uses it: cast to ``dtype`` (before any gather: half
        the bytes), then whole on every device (:func:`coda_jax.sharding.gathered`)."""
        v = getattr(self, name)[...]
        return gathered(v if dtype is None else v.astype(dtype))

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        carry: NormCarry | None = None,
        next_norm: jax.Array | None = None,
    ) -> tuple[jax.Array, NormCarry | None]:
        c = self.config
        b, s, d = x.shape
        if d != c.hidden_size:
            raise ValueError(f"x must be [batch, seq, {c.hidden_size}], got {x.shape}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        dt = c.dtype
        m = b * s
        x2 = reshape_tokens(x, (m, d)).astype(dt)
        w = self._param  # a parameter as used: cast, and gathered if FSDP-split under an Explicit mesh
        qk = dict(q_norm=w("q_norm"), k_norm=w("k_norm"), qk_norm_eps=c.qk_norm_eps) if c.qk_norm else {}
        qkv, x2 = rms_norm_matmul_rope(
            x2, w("attn_norm"), w("w_qkv", dt), reshape_tokens(positions, (m,)), w("inv_freq"),
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, carry=carry, eps=c.rms_norm_eps,
            return_residual=True, backend=self.backend, **qk)
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        q = reshape_tokens(qkv[:, : nh * hd], (b, s, nh, hd))
        k = reshape_tokens(qkv[:, nh * hd: (nh + nkv) * hd], (b, s, nkv, hd))
        v = reshape_tokens(qkv[:, (nh + nkv) * hd:], (b, s, nkv, hd))
        o = causal_attention(q, k, v, c.attention_implementation)  # cuDNN where it supports the shape
        x1, carry1 = matmul_residual_rms(reshape_tokens(o, (m, nh * hd)), w("w_o", dt), x2, w("mlp_norm"),
                                         backend=self.backend)
        out, carry2 = swiglu_mlp(x1, w("mlp_norm"), w("w_gu", dt), w("w_down", dt),
                                 next_norm, carry=carry1, eps=c.rms_norm_eps, backend=self.backend)
        return reshape_tokens(out, (b, s, d)), carry2
