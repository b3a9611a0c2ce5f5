"""RMSNorm-scaled GEMM: ``z = RMSNorm(x; gamma) @ w`` computed as ``rstd * ((x*gamma) @ w)``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.ops.checks import check_2d, check_float, check_same_dtype, check_vector, check_weight
from coda_jax.ops.names import RMS_NORM_MATMUL
from coda_jax.ops.norm_carry import NormCarry, resolve_carry
from coda_jax.ops.normed_gemm import normed_gemm


@dataclasses.dataclass(frozen=True)
class PlainVariant:
    """f = identity: the op's output is z itself, which is also all backward needs."""

    out_splits = None
    cotangent_is_dz = True

    def program(self, train):
        return programs.ROW_SCALE

    def loads(self, aux):
        return {}

    def primal(self, outs):
        return outs["z"]

    def saved(self, outs):
        return outs["z"]

    def backward(self, z, dz, aux):
        dz = dz.astype(jnp.float32)
        return dz, jnp.sum(z.astype(jnp.float32) * dz, axis=1), {}


def check_norm_inputs(x: jax.Array, gamma: jax.Array, w: jax.Array) -> None:
    check_2d("x", x)
    check_float("x", x)
    check_vector("gamma", gamma, x.shape[1])
    check_weight("w", w, x.shape[1])
    check_same_dtype(x=x, w=w)


def rms_norm_matmul(
    x: jax.Array,
    gamma: jax.Array,
    w: jax.Array,
    *,
    carry: NormCarry | None = None,
    eps: float = 1e-5,
    return_residual: bool = False,
    backend: str | None = None,
):
    """``RMSNorm(x; gamma, eps) @ w`` with the norm folded into the GEMM's epilogue.

    Args:
      x: ``[M, d]`` residual stream (bf16/f16/f32).
      gamma: ``[d]`` RMSNorm weight.
      w: ``[d, N]`` weight, same dtype as ``x``.
      carry: the :class:`NormCarry` written by the GEMM that produced ``x``
        (:func:`coda_jax.matmul_residual_rms`); ``None`` computes it in one pass.
      eps: RMSNorm epsilon.
      return_residual: also return ``x`` (a pass-through whose gradient is accumulated
        into the norm backward's epilogue; use it for the residual path).
      backend: see :mod:`coda_jax.backend`.

    Returns:
      ``z [M, N]`` in ``x.dtype`` (and ``x`` if ``return_residual``).
    """
    check_norm_inputs(x, gamma, w)
    carry = resolve_carry(x, gamma, carry)
    lowering = lowering_for(RMS_NORM_MATMUL, backend)
    return normed_gemm(lowering, PlainVariant(), float(eps), return_residual, x, gamma, w, carry.h, carry.sumsq, {})
