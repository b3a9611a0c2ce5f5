"""The whole Llama MLP as one op: RMSNorm -> gate/up GEMM -> SwiGLU -> down GEMM -> residual.

    y = silu(z_gate) * z_up,  z = rstd * (h @ w_gu)          (GEMM 1, ``rms_swiglu`` epilogue)
    x_out = x + y @ w_down,   carry_out = (x_out * gamma_next, sumsq partials)   (GEMM 2)

Why one op instead of :func:`rms_norm_matmul_swiglu` followed by
:func:`matmul_residual_rms`: the SwiGLU backward then runs in the epilogue of the down
projection's dgrad GEMM (CODA's SwiGLU-backward kernel). With the two ops apart, the down
projection's backward must hand ``dy = dout @ w_down^T`` ``[M, f]`` across the op boundary
and the SwiGLU backward is an elementwise pass over ``dy`` and ``z`` (plus a second pass
for ``sum(z * dz)``). Here:

    dz', zdz = swiglu_dgrad(dout @ w_down^T; z, rstd)   one GEMM: dy never reaches HBM; zdz
                                                 per row; dz' = rstd * dz (see normed_gemm)
    dw_down = y^T @ dout                         wgrad GEMM
    dx, dgamma, dw_gu = RMSNorm backward GEMMs (:func:`norm_gemm_backward`), dres = dout

Saved for backward: ``x``, ``rstd`` (one float per row), ``z`` ``[M, 2f]`` and ``y``
``[M, f]`` (both written by the forward GEMM anyway; ``y`` is the wgrad operand), weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.lowering import GemmLowering
from coda_jax.ops.checks import check_vector, check_weight
from coda_jax.ops.names import SWIGLU_MLP
from coda_jax.ops.norm_carry import NormCarry, resolve_carry, rstd_from_partials
from coda_jax.ops.normed_gemm import norm_gemm_backward
from coda_jax.ops.plain_gemm import matmul, wgrad
from coda_jax.ops.rms_norm_matmul import check_norm_inputs
from coda_jax.programs import SWIGLU_BLOCK
from coda_jax.sharding import typed_like


def _down(lowering: GemmLowering, y, w_down, x, gamma_next, residual: bool):
    """``x + y @ w_down`` and the next norm's carry (None without ``gamma_next``); without
    ``residual``, the float32 partial product ``y @ w_down`` alone (no carry)."""
    if not residual:
        return matmul(lowering, y, w_down, out_dtype=jnp.float32), None
    # The output is the residual stream: it keeps x's sharding type (as matmul_residual_rms's).
    if gamma_next is None:
        out = lowering.gemm(programs.RESIDUAL, y, w_down, {"residual": x}, out_dtypes={"x": x.dtype})
        return typed_like(out["x"], x), None
    out = lowering.gemm(programs.RESIDUAL_RMS, y, w_down, {"residual": x, "gamma": gamma_next},
                        out_dtypes={"x": x.dtype, "h": x.dtype})
    return typed_like(out["x"], x), NormCarry(out["h"], out["sumsq"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _swiglu_mlp(lowering: GemmLowering, eps: float, residual: bool, x, gamma, w_gu, w_down, gamma_next, h, sumsq):
    rstd = rstd_from_partials(sumsq, x.shape[1], eps)
    y = lowering.gemm(programs.rms_swiglu(False), h, w_gu, {"rstd": rstd})["y"]
    return _down(lowering, y, w_down, x, gamma_next, residual)


def _swiglu_mlp_fwd(lowering, eps, residual, x, gamma, w_gu, w_down, gamma_next, h, sumsq):
    rstd = rstd_from_partials(sumsq, x.shape[1], eps)
    outs = lowering.gemm(programs.rms_swiglu(True), h, w_gu, {"rstd": rstd})
    y, z = outs["y"], outs["z"]
    out = _down(lowering, y, w_down, x, gamma_next, residual)
    return out, (x, gamma, w_gu, w_down, gamma_next, rstd, z, y, h, sumsq)


def _swiglu_mlp_bwd(lowering, eps, residual, res, cot):
    x, gamma, w_gu, w_down, gamma_next, rstd, z, y, h, sumsq = res
    dx_out, _ = cot  # the carry is a cache: no gradient flows through it
    dout = dx_out.astype(y.dtype)
    sd = lowering.gemm(programs.SWIGLU_DGRAD, dout, w_down, {"z": z, "rstd": rstd}, transpose_b=True,
                       out_dtypes={"dz": w_gu.dtype})
    dw_down = wgrad(lowering, y, dout, w_down)
    dx, dgamma, dw_gu = norm_gemm_backward(lowering, x, gamma, w_gu, rstd, sd["dz"], jnp.sum(sd["zdz"], axis=0),
                                           dres=dx_out if residual else None, h=h)
    dgn = None if gamma_next is None else jnp.zeros_like(gamma_next)
    return typed_like(dx, x), dgamma, dw_gu, dw_down, dgn, jnp.zeros_like(h), jnp.zeros_like(sumsq)


_swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


def _check_mlp(x, gamma, w_gu, w_down) -> None:
    check_norm_inputs(x, gamma, w_gu)
    if w_gu.shape[1] % (2 * SWIGLU_BLOCK):
        raise ValueError(f"w_gu must have 2f columns with f a multiple of {SWIGLU_BLOCK}, got {w_gu.shape}")
    f = w_gu.shape[1] // 2
    check_weight("w_down", w_down, f)
    if w_down.shape[1] != x.shape[1]:
        raise ValueError(f"w_down must be [{f}, {x.shape[1]}] (f, d), got {tuple(w_down.shape)}")
    if w_down.dtype != x.dtype:
        raise TypeError(f"w_down must have the dtype of x ({x.dtype}), got {w_down.dtype}")


def swiglu_mlp(
    x: jax.Array,
    gamma: jax.Array,
    w_gu: jax.Array,
    w_down: jax.Array,
    gamma_next: jax.Array | None = None,
    *,
    carry: NormCarry | None = None,
    eps: float = 1e-5,
    backend: str | None = None,
) -> tuple[jax.Array, NormCarry | None]:
    """``x + SwiGLU(RMSNorm(x)) @ w_down`` and the next norm's carry, as two fused GEMMs.

    Args:
      x: ``[M, d]`` residual stream (float dtype; ``w_gu``/``w_down`` share it).
      gamma: ``[d]`` weight of the MLP's RMSNorm.
      w_gu: ``[d, 2f]`` fused gate/up weight, block-interleaved
        (:func:`coda_jax.interleave_gate_up`, ``f`` a multiple of 64).
      w_down: ``[f, d]`` down projection.
      gamma_next: ``[d]`` weight of the RMSNorm that reads the output (next block's input
        norm or the final norm), or ``None`` (no carry).
      carry: the :class:`NormCarry` of ``x`` for ``gamma`` (from the GEMM that produced
        ``x``); ``None`` computes it with one pass.
      eps: RMSNorm epsilon.
      backend: ``"xla"``, ``"pallas"``, ``"cutedsl"`` or ``None`` (:mod:`coda_jax.backend`).

    Returns:
      ``(x_out [M, d] x.dtype, NormCarry of x_out for gamma_next or None)``.
    """
    _check_mlp(x, gamma, w_gu, w_down)
    if gamma_next is not None:
        check_vector("gamma_next", gamma_next, x.shape[1])
    carry = resolve_carry(x, gamma, carry)
    lowering = lowering_for(SWIGLU_MLP, backend)
    return _swiglu_mlp(lowering, float(eps), True, x, gamma, w_gu, w_down, gamma_next, carry.h, carry.sumsq)


def swiglu_mlp_partial(
    x: jax.Array,
    gamma: jax.Array,
    w_gu: jax.Array,
    w_down: jax.Array,
    *,
    carry: NormCarry | None = None,
    eps: float = 1e-5,
    backend: str | None = None,
) -> jax.Array:
    """``SwiGLU(RMSNorm(x)) @ w_down`` without the residual, in float32: the MLP of one
    tensor-parallel shard (``w_gu`` / ``w_down`` hold this shard's ``f / T`` features), whose
    output is one partial sum of the down projection, to be reduced across shards.

    The same two GEMMs as :func:`swiglu_mlp` (the SwiGLU backward still runs in the epilogue
    of the down projection's dgrad GEMM); only the residual add and the next norm's carry are
    left out, since they belong after the reduction.

    Args:
      x: ``[M, d]`` residual stream (whole rows).
      gamma: ``[d]`` RMSNorm weight.
      w_gu: ``[d, 2f_shard]`` block-interleaved gate/up columns of this shard.
      w_down: ``[f_shard, d]`` the matching rows of the down projection.
      carry, eps, backend: as in :func:`swiglu_mlp`.

    Returns:
      ``[M, d]`` float32.
    """
    _check_mlp(x, gamma, w_gu, w_down)
    carry = resolve_carry(x, gamma, carry)
    lowering = lowering_for(SWIGLU_MLP, backend)
    return _swiglu_mlp(lowering, float(eps), False, x, gamma, w_gu, w_down, None, carry.h, carry.sumsq)[0]
