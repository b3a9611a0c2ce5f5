"""Worked example of docs/epilogues.md: a new fused op, ``gelu(rstd * (h @ W) + bias)``.

One forward epilogue declaration and one backward declaration; no kernel code. Every
backend that lowers the epilogue spec runs it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.lowering import GemmLowering
from coda_jax.reference import REFERENCE


# 1. Forward epilogue: loads a row vector (rstd) and a column vector (bias); writes the
#    activation and the pre-activation (saved for backward).
def _fwd_body(acc, ctx, rstd, bias):
    z = acc * rstd + bias
    return {"y": jax.nn.gelu(z, approximate=True), "z": z}


NORM_BIAS_GELU = E.Epilogue(
    name="norm_bias_gelu",
    loads=(E.row("rstd"), E.col("bias")),
    outputs=(E.tile_out("y"), E.tile_out("z")),
    body=_fwd_body,
)


# 2. Backward: GELU' is elementwise in z, and d_bias is a column reduction: both fit the
#    epilogue of a GEMM whose accumulator is... nothing yet (dy arrives as a tile). So the
#    backward runs dgrad/wgrad GEMMs on dz = dy * gelu'(z), computed with jnp, and the
#    row scale rstd is re-applied in the dgrad epilogue (it commutes with the GEMM).
def _dgrad_body(acc, ctx, rstd):
    return {"dh": acc * rstd}


ROW_SCALE_DGRAD = E.Epilogue(name="row_scale_dgrad", loads=(E.row("rstd"),), outputs=(E.tile_out("dh"),),
                             body=_dgrad_body)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def norm_bias_gelu(lowering: GemmLowering, h, rstd, w, bias):
    """``gelu(rstd[:, None] * (h @ w) + bias)``; h [M, K], rstd [M] f32, w [K, N], bias [N]."""
    return lowering.gemm(NORM_BIAS_GELU, h, w, {"rstd": rstd, "bias": bias})["y"]


def _fwd(lowering, h, rstd, w, bias):
    out = lowering.gemm(NORM_BIAS_GELU, h, w, {"rstd": rstd, "bias": bias})
    return out["y"], (h, rstd, w, bias, out["z"])


def _bwd(lowering, res, dy):
    h, rstd, w, bias, z = res
    _, gelu_vjp = jax.vjp(lambda z: jax.nn.gelu(z, approximate=True), z.astype(jnp.float32))
    dz = gelu_vjp(dy.astype(jnp.float32))[0]
    dzc = dz.astype(w.dtype)
    dh = lowering.gemm(ROW_SCALE_DGRAD, dzc, w, {"rstd": rstd}, transpose_b=True)["dh"]
    # dW = (rstd * h)^T @ dz: the row scale sits on the contraction axis, so scale h first.
    hs = (h.astype(jnp.float32) * rstd[:, None]).astype(h.dtype)
    dw = lowering.gemm(programs.IDENTITY, hs, dzc, {}, transpose_a=True)["out"]
    drstd = jnp.sum(dz * (z.astype(jnp.float32) - bias.astype(jnp.float32)), axis=1) / rstd
    return dh, drstd, dw, jnp.sum(dz, axis=0).astype(bias.dtype)


norm_bias_gelu.defvjp(_fwd, _bwd)


if __name__ == "__main__":
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (64, 32))
    rstd = jax.random.uniform(k[1], (64,), minval=0.5, maxval=2.0)
    w = jax.random.normal(k[2], (32, 48)) / 32 ** 0.5
    bias = jax.random.normal(k[3], (48,))
    naive = lambda h, rstd, w, bias: jax.nn.gelu(rstd[:, None] * (h @ w) + bias, approximate=True)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.grad(loss(functools.partial(norm_bias_gelu, REFERENCE)), (0, 1, 2, 3))(h, rstd, w, bias)
    want = jax.grad(loss(naive), (0, 1, 2, 3))(h, rstd, w, bias)
    for a, b in zip(got, want):
        print(f"grad rel err {float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)):.2e}")
