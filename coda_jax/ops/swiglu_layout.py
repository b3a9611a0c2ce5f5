"""The fused gate/up weight layout of the SwiGLU op.

``w_gu [d, 2f]`` stores gate and up columns in alternating blocks of
``SWIGLU_BLOCK = 64``: ``[gate 0:64, up 0:64, gate 64:128, up 64:128, ...]``, so that every
128-wide N-tile of the GEMM holds both halves of its (gate, up) pairs and the SwiGLU
epilogue never needs a column from another tile.
"""

from __future__ import annotations

import jax

from coda_jax.epilogue import join_pairs, split_pairs
from coda_jax.programs import SWIGLU_BLOCK


def _check_f(f: int, name: str) -> None:
    if f % SWIGLU_BLOCK:
        raise ValueError(f"{name}: the SwiGLU hidden size must be a multiple of {SWIGLU_BLOCK}, got {f}")


def interleave_gate_up(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """``w_gate, w_up [d, f]`` -> fused ``w_gu [d, 2f]`` in the block-interleaved layout."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate and w_up must have the same shape, got {w_gate.shape} and {w_up.shape}")
    f = w_gate.shape[-1]
    _check_f(f, "w_gate")
    lo = w_gate.reshape(w_gate.shape[:-1] + (f // SWIGLU_BLOCK, SWIGLU_BLOCK))
    hi = w_up.reshape(lo.shape)
    return join_pairs(lo, hi)


def split_gate_up(w_gu: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inverse of :func:`interleave_gate_up`: ``[..., 2f] -> (gate, up) [..., f]``."""
    _check_f(w_gu.shape[-1] // 2, "w_gu")
    lo, hi = split_pairs(w_gu, SWIGLU_BLOCK)
    return lo.reshape(lo.shape[:-2] + (-1,)), hi.reshape(hi.shape[:-2] + (-1,))
