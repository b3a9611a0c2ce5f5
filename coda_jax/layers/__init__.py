"""Flax NNX layers built on coda-jax's fused ops."""

from coda_jax.layers.block import CodaLlamaBlock
from coda_jax.layers.config import PRESETS, LlamaConfig
from coda_jax.layers.model import CodaLlama

__all__ = ["CodaLlama", "CodaLlamaBlock", "LlamaConfig", "PRESETS"]
