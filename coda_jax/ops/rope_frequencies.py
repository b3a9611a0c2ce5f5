"""Rotary embedding frequencies, with Llama-3's long-context frequency scaling."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1/3.2 ``rope_scaling`` ({"rope_type": "llama3", ...})."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> np.ndarray:
    """``[head_dim/2]`` float32 inverse frequencies ``theta^(-2i/head_dim)``, Llama-3 scaled.

    Llama-3 scaling keeps high frequencies (wavelength < original_len/high_freq_factor),
    divides low ones (wavelength > original_len/low_freq_factor) by ``factor`` and
    interpolates smoothly in between, as in Hugging Face's ``_compute_llama3_parameters``.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wl = old / scaling.low_freq_factor
        high_wl = old / scaling.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / scaling.factor, inv)
        smooth = (old / wl - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)
