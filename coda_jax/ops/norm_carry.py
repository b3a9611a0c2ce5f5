"""The cross-layer carry of CODA's RMSNorm fusion: ``h = x * gamma`` and partial stats.

The GEMM that produces the residual stream ``x`` writes, in its epilogue, ``h`` and the
per-row sums of squares of ``x`` over each of its N-tiles (``sumsq [P, M]``, float32).
The next norm then costs no pass over ``x``: :func:`rstd_from_partials` reduces the
partials (``P`` numbers per row) and the next GEMM runs on ``h`` with ``rstd`` applied
in its epilogue.

A carry is a *cache* of values that are functions of ``x`` and ``gamma``: ops that take
one differentiate through ``x`` and ``gamma``, never through the carry.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class NormCarry(NamedTuple):
    """``h [M, d]`` (dtype of x) and ``sumsq [P, M]`` float32 partial sums of x^2."""

    h: jax.Array
    sumsq: jax.Array


def rstd_from_partials(sumsq: jax.Array, d: int, eps: float) -> jax.Array:
    """``[P, M]`` partial sums of squares -> ``rstd [M]`` float32 = 1/sqrt(mean(x^2) + eps)."""
    return jax.lax.rsqrt(jnp.sum(sumsq, axis=0) / d + eps)


def norm_carry(x: jax.Array, gamma: jax.Array) -> NormCarry:
    """The plain pass the first layer needs: ``h = x * gamma`` and one partial per row.

    Args:
      x: ``[M, d]`` residual stream.
      gamma: ``[d]`` RMSNorm weight.
    """
    xf = x.astype(jnp.float32)
    h = (xf * gamma.astype(jnp.float32)).astype(x.dtype)
    return NormCarry(h, jnp.sum(xf * xf, axis=1)[None])


def resolve_carry(x: jax.Array, gamma: jax.Array, carry: NormCarry | None) -> NormCarry:
    """The given carry, validated against ``x``, or one plain pass when there is none.

    Under ``stop_gradient``: the ops' custom VJPs send the exact gradients to ``x`` and
    ``gamma`` and a zero cotangent to the carry, and differentiating the carry's own pass
    with that zero would cost XLA a pass over ``x`` for nothing (``0 * x`` is not folded
    away in floating point)."""
    m, d = x.shape
    if carry is None:
        carry = norm_carry(x, gamma)
    elif not isinstance(carry, NormCarry):
        raise TypeError(f"carry must be a NormCarry or None, got {type(carry).__name__}")
    elif carry.h.shape != x.shape:
        raise ValueError(f"carry.h must have the shape of x {tuple(x.shape)}, got {tuple(carry.h.shape)}")
    elif carry.sumsq.ndim != 2 or carry.sumsq.shape[1] != m:
        raise ValueError(f"carry.sumsq must be [P, {m}] float32 partials, got {tuple(carry.sumsq.shape)}")
    return NormCarry(jax.lax.stop_gradient(carry.h.astype(x.dtype)),
                     jax.lax.stop_gradient(carry.sumsq.astype(jnp.float32)))
