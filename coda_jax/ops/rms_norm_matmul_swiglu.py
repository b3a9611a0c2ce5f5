"""RMSNorm -> GEMM -> SwiGLU on the fused gate/up weight (the MLP input, CODA step 2).

    z = rstd * (h @ w_gu)            [M, 2f], gate/up in blocks (see swiglu_layout)
    y = silu(z_gate) * z_up          [M, f]

Training forward writes ``y`` and the pre-activation ``z`` (saved for backward, CODA's
choice: the backward needs silu'(gate), and z costs one write instead of a GEMM).
Backward: dz = (dy * up * silu'(gate), dy * silu(gate)), zdz = sum(z * dz), then the
shared RMSNorm dgrad/wgrad epilogues (:mod:`coda_jax.ops.normed_gemm`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.epilogue import join_pairs, split_pairs
from coda_jax.ops.names import RMS_NORM_MATMUL_SWIGLU
from coda_jax.ops.norm_carry import NormCarry, resolve_carry
from coda_jax.ops.normed_gemm import normed_gemm
from coda_jax.ops.rms_norm_matmul import check_norm_inputs
from coda_jax.programs import SWIGLU_BLOCK, swiglu_grad


@dataclasses.dataclass(frozen=True)
class SwiGLUVariant:
    out_splits = None

    def program(self, train):
        return programs.rms_swiglu(train)

    def loads(self, aux):
        return {}

    def primal(self, outs):
        return outs["y"]

    def saved(self, outs):
        return outs["z"]

    def backward(self, z, dy, aux):
        gate, up = (v.astype(jnp.float32) for v in split_pairs(z, SWIGLU_BLOCK))
        dyb = dy.astype(jnp.float32).reshape(gate.shape)
        d_gate, d_up, _ = swiglu_grad(gate, up, dyb)
        zdz = jnp.sum(gate * d_gate + up * d_up, axis=(1, 2))
        return join_pairs(d_gate, d_up), zdz, {}


def rms_norm_matmul_swiglu(
    x: jax.Array,
    gamma: jax.Array,
    w_gu: jax.Array,
    *,
    carry: NormCarry | None = None,
    eps: float = 1e-5,
    return_residual: bool = False,
    backend: str | None = None,
):
    """``silu(RMSNorm(x) @ W_gate) * (RMSNorm(x) @ W_up)`` as one GEMM + epilogue.

    Args:
      x: ``[M, d]`` residual stream.
      gamma: ``[d]`` RMSNorm weight.
      w_gu: ``[d, 2f]`` fused gate/up weight in the block-interleaved layout of
        :func:`coda_jax.interleave_gate_up` (``f`` a multiple of 64).
      carry, eps, return_residual, backend: as in :func:`coda_jax.rms_norm_matmul`.

    Returns:
      ``y [M, f]`` in ``x.dtype`` (and ``x`` if ``return_residual``).
    """
    check_norm_inputs(x, gamma, w_gu)
    if w_gu.shape[1] % (2 * SWIGLU_BLOCK):
        raise ValueError(f"w_gu must have 2f columns with f a multiple of {SWIGLU_BLOCK}, got {w_gu.shape}")
    carry = resolve_carry(x, gamma, carry)
    lowering = lowering_for(RMS_NORM_MATMUL_SWIGLU, backend)
    return normed_gemm(lowering, SwiGLUVariant(), float(eps), return_residual, x, gamma, w_gu, carry.h, carry.sumsq, {})
