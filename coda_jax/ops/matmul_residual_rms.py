"""GEMM + residual add + partial RMS statistics of the result (CODA step 1 / 3).

    x = residual + y @ w
    carry = (h = x * gamma_next, sumsq partials of x)   # for the next RMSNorm

Forward: one GEMM with the ``residual_rms`` epilogue (tile load, column-vector load, two
extra tile outputs, a block row reduction). Backward: ``dy = dx @ w^T`` and
``dw = y^T @ dx`` (plain dgrad / wgrad GEMMs), ``dresidual = dx``. The carry is a cache
(its cotangent is ignored); the norm's gradient reaches ``x`` and ``gamma_next`` through
the consuming op (:mod:`coda_jax.ops.rms_norm_matmul`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.lowering import GemmLowering
from coda_jax.ops.checks import check_2d, check_float, check_same_dtype, check_vector, check_weight
from coda_jax.ops.names import MATMUL_RESIDUAL_RMS
from coda_jax.ops.norm_carry import NormCarry
from coda_jax.ops.plain_gemm import linear_grads
from coda_jax.sharding import typed_like


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _residual_rms(lowering: GemmLowering, y, w, residual, gamma):
    out = lowering.gemm(programs.RESIDUAL_RMS, y, w, {"residual": residual, "gamma": gamma},
                        out_dtypes={"x": residual.dtype, "h": residual.dtype})
    # x is the residual stream: it keeps the residual's type, and so does the cotangent that
    # the backward passes through to it.
    return typed_like(out["x"], residual), NormCarry(out["h"], out["sumsq"])


def _residual_rms_fwd(lowering, y, w, residual, gamma):
    return _residual_rms(lowering, y, w, residual, gamma), (y, w, gamma)


def _residual_rms_bwd(lowering, res, cot):
    y, w, gamma = res
    dx, _ = cot  # the carry is a cache: no gradient flows through it
    dy, dw = linear_grads(lowering, y, w, dx)
    return typed_like(dy, y), dw, dx, jnp.zeros_like(gamma)


_residual_rms.defvjp(_residual_rms_fwd, _residual_rms_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _residual(lowering: GemmLowering, y, w, residual):
    x = lowering.gemm(programs.RESIDUAL, y, w, {"residual": residual}, out_dtypes={"x": residual.dtype})["x"]
    return typed_like(x, residual)  # the residual stream (see _residual_rms)


def _residual_fwd(lowering, y, w, residual):
    return _residual(lowering, y, w, residual), (y, w)


def _residual_bwd(lowering, res, dx):
    y, w = res
    dy, dw = linear_grads(lowering, y, w, dx)
    return typed_like(dy, y), dw, dx


_residual.defvjp(_residual_fwd, _residual_bwd)


def matmul_residual_rms(
    y: jax.Array,
    w: jax.Array,
    residual: jax.Array,
    gamma_next: jax.Array | None = None,
    *,
    backend: str | None = None,
) -> tuple[jax.Array, NormCarry | None]:
    """``x = residual + y @ w``, plus the carry for the next RMSNorm.

    Args:
      y: ``[M, K]`` GEMM input (e.g. attention output or SwiGLU activation).
      w: ``[K, N]`` weight, same dtype as ``y``.
      residual: ``[M, N]`` residual stream; ``x`` gets its dtype.
      gamma_next: ``[N]`` weight of the RMSNorm that consumes ``x``; ``None`` for a plain
        residual GEMM (no carry).
      backend: ``"xla"``, ``"pallas"``, ``"cutedsl"`` or ``None`` (see
        :mod:`coda_jax.backend`).

    Returns:
      ``(x [M, N], NormCarry(h [M, N], sumsq [P, M] float32))``, carry ``None`` if no
      ``gamma_next``.
    """
    check_2d("y", y)
    check_float("y", y)
    check_weight("w", w, y.shape[1])
    check_same_dtype(y=y, w=w)
    check_2d("residual", residual, features=w.shape[1], tokens=y.shape[0])
    check_float("residual", residual)
    lowering = lowering_for(MATMUL_RESIDUAL_RMS, backend)
    if gamma_next is None:
        return _residual(lowering, y, w, residual), None
    check_vector("gamma_next", gamma_next, w.shape[1])
    return _residual_rms(lowering, y, w, residual, gamma_next)
