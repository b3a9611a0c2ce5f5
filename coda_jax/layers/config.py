"""The Llama configuration of coda-jax's layers, with presets."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from coda_jax.fp8 import Fp8Recipe
from coda_jax.ops.rope_frequencies import Llama3RopeScaling


# LlamaConfig.remat: no activation checkpointing, or each block recomputed in the backward.
REMAT_MODES = ("none", "block")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and numerics of a Llama-3-style decoder.

    Attributes:
      vocab_size, hidden_size (d), intermediate_size (f, a multiple of 64), num_layers,
      num_heads, num_kv_heads (GQA), head_dim: the usual Llama sizes.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta, rope_scaling: rotary base and Llama-3 frequency scaling (None: plain).
      tie_word_embeddings: LM head shares the embedding table (Llama-3.2-1B).
      qk_norm: per-head RMSNorm of Q and K before RoPE (Qwen3/OLMo-2 style).
      dtype: compute dtype of activations and GEMM operands.
      param_dtype: storage dtype of parameters.
      attention_implementation: passed to ``jax.nn.dot_product_attention``; ``"auto"``
        picks ``"cudnn"`` on a GPU for 16-bit dtypes where it supports the shape, else XLA
        (:mod:`coda_jax.ops.attention`; odd lengths are padded by one for cuDNN).
      remat: activation checkpointing of :class:`~coda_jax.layers.CodaLlama`'s blocks.
        ``"none"``: every block keeps what its backward reads (``[tokens, qkv + 4d + 2f]``
        values a layer). ``"block"``: each block keeps only its input and norm carry, and its
        forward (every fused kernel of it) runs again in the backward: about a third more
        GEMM work for ``[tokens, 2d]`` a layer, plus one layer's activations at a time.
      fp8: train the blocks' projections in FP8 with this recipe (:class:`coda_jax.fp8.Fp8Recipe`;
        :mod:`coda_jax.ops.fp8_llama_block`), or None (the compute dtype). Attention, the
        norms and the embedding stay in the compute dtype, and the LM head unless
        ``Fp8Recipe(lm_head=True)``.
    """

    vocab_size: int = 128256
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_layers: int = 16
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    attention_implementation: str | None = "auto"
    remat: str = "none"
    fp8: Fp8Recipe | None = None

    def __post_init__(self):
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise TypeError(f"fp8 must be an Fp8Recipe or None, got {type(self.fp8).__name__}")
        if self.remat not in REMAT_MODES:
            raise ValueError(f"remat must be one of {REMAT_MODES}, got {self.remat!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.intermediate_size % 64:
            raise ValueError(f"intermediate_size must be a multiple of 64 (SwiGLU pair blocks), got {self.intermediate_size}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def block_weights_per_width(self) -> int:
        """A block's weight elements over the width ``d``: ``W_qkv [d, qkv]``, ``W_o [H hd, d]``,
        ``W_gu [d, 2f]``, ``W_down [f, d]`` hold ``d * (qkv + H hd + 3 f)`` elements (the 1B
        preset: 29,696; the 8B: 53,248). Compared with a batch's tokens it says whether moving
        the activations or the weights costs less (:func:`coda_jax.partitioning.choose_fsdp_split`)."""
        return self.qkv_size + self.num_heads * self.head_dim + 3 * self.intermediate_size

    def replace(self, **kw) -> "LlamaConfig":
        return dataclasses.replace(self, **kw)

    # ------------------------------------------------------------------ presets ----
    @classmethod
    def tiny(cls, vocab_size: int = 4096, **kw) -> "LlamaConfig":
        """A few-million-parameter model that trains on a CPU in minutes (float32); its
        ``intermediate_size`` (768 = 12 x 64) splits over a tensor axis of up to 4."""
        base = dict(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=8,
                    num_kv_heads=4, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True,
                    dtype=jnp.float32, param_dtype=jnp.float32)
        return cls(**{**base, **kw})

    @classmethod
    def llama_3_2_1b(cls, **kw) -> "LlamaConfig":
        base = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                    num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                    rope_scaling=Llama3RopeScaling(factor=32.0))
        return cls(**{**base, **kw})

    @classmethod
    def llama_3_1_8b(cls, **kw) -> "LlamaConfig":
        base = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, rope_theta=500000.0, rope_scaling=Llama3RopeScaling(factor=8.0))
        return cls(**{**base, **kw})

    @classmethod
    def llama_70b_width(cls, num_layers: int = 2, **kw) -> "LlamaConfig":
        """Llama-3.1-70B layer shapes (d=8192, f=28672, 64 heads / 8 KV), few layers."""
        base = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=num_layers,
                    num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                    rope_scaling=Llama3RopeScaling(factor=8.0))
        return cls(**{**base, **kw})


PRESETS = {
    "tiny": LlamaConfig.tiny,
    "1b": LlamaConfig.llama_3_2_1b,
    "8b": LlamaConfig.llama_3_1_8b,
    "70b-width": LlamaConfig.llama_70b_width,
}
