"""The RMSNorm-scaled GEMM and its backward, shared by every "norm -> GEMM -> f" op.

Math (CODA section 1 and 3). With ``h = x * gamma``, ``rstd = 1/sqrt(mean(x^2)+eps)``:

    forward:   z = rstd * (h @ W)          (epilogue: row scale), then out = f(z)
    backward:  dz = f'(z)^T dout           (variant-specific, elementwise)
               zdz = sum_N(z * dz) / d      (row term; = mean_d(x_hat*gamma*g) because the
                                            inner product is preserved through the GEMM)
               dz' = rstd * dz              row-scaled where dz is made (no pass of its own)
               g' = dz' @ W^T = rstd * g    dgrad GEMM, whose epilogue does the norm backward:
               dx = dres + gamma*g' - x * (rstd^2 * zdz)
               P = x^T @ dz' = x_hat^T @ dz  wgrad GEMM (reads x itself), whose epilogue writes
               dW = gamma * P,  d_gamma = sum_N(W * P)   (row partials; = sum_M(g * x_hat))

Scaling dz by rstd (instead of x by rstd) spares the dgrad epilogue a second output: it
would otherwise write x_hat ``[M, d]`` for the wgrad to read.

Where ``dz`` is the op's cotangent itself (a variant with ``cotangent_is_dz``: ``f`` is the
identity), no elementwise pass makes it, so ``dz'`` and ``zdz`` would cost a pass of their
own over the ``[M, N]`` arrays (read ``z`` and ``dz``, write ``dz'``). When ``N > d`` the
backward runs on the ``[M, d]`` side instead (:func:`norm_gemm_backward_unscaled`):

               g = dz @ W^T                 dgrad GEMM (:data:`~coda_jax.programs.NORM_DGRAD`),
                                            epilogue: g and the row partials S = sum_d(x*gamma*g)
               dx = dres + rstd*gamma*g - x * (rstd^3 * S / d)     (one pass over [M, d])
               P = x_hat^T @ dz             wgrad GEMM (x_hat = rstd * x, an [M, d] pass), same
                                            epilogue as above

``dres`` is the residual-stream gradient: the ops return ``x`` itself as a second output
(``return_residual=True``) so that the gradient of everything downstream that reads the
residual stream arrives here and is accumulated in the same epilogue.

A *variant* supplies ``f``: its forward epilogue program and its backward ``dz``. Saved for
backward: ``x``, ``gamma``, ``W``, ``rstd`` (one float per row) and what the variant needs
(the output itself for plain / RoPE, the pre-activation ``z`` for SwiGLU / QK-norm).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.epilogue import Epilogue
from coda_jax.lowering import GemmLowering, fuses_epilogue_at
from coda_jax.ops.norm_carry import rstd_from_partials
from coda_jax.ops.plain_gemm import wgrad
from coda_jax.sharding import typed_like


class NormedGemmVariant(Protocol):
    """What follows the RMSNorm-scaled GEMM (hashable: it is a static argument).

    ``out_splits``: tile outputs the forward GEMM returns as column parts
    (:class:`coda_jax.lowering.GemmLowering`), or None.
    """

    out_splits: Mapping[str, tuple[int, ...]] | None
    # True where ``backward`` returns the cotangent itself as ``dz`` (``f`` is the identity).
    cotangent_is_dz: bool = False

    def program(self, train: bool) -> Epilogue:
        """The forward epilogue; ``train=True`` also outputs what backward needs."""

    def loads(self, aux: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Extra epilogue loads (besides ``rstd``) computed from the aux inputs."""

    def primal(self, outs: Mapping[str, jax.Array]) -> jax.Array:
        """The op's output from the epilogue's outputs."""

    def saved(self, outs: Mapping[str, jax.Array]) -> Any:
        """What the backward keeps from the forward outputs."""

    def backward(self, saved: Any, dout: jax.Array, aux: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, dict]:
        """``(dz [M, N] float32, sum_N(z*dz) [M] float32, aux cotangents)``."""


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def normed_gemm(lowering: GemmLowering, variant: NormedGemmVariant, eps: float, return_residual: bool,
                x, gamma, w, h, sumsq, aux):
    """``f(rstd * (h @ w))`` (and ``x``) with CODA's backward; see the module docstring.

    ``h``/``sumsq`` are the carry (cache of ``x * gamma`` and partial sums of ``x^2``):
    they get zero cotangents; the exact gradients go to ``x`` and ``gamma``.
    """
    rstd = rstd_from_partials(sumsq, x.shape[1], eps)
    outs = lowering.gemm(variant.program(False), h, w, {"rstd": rstd, **variant.loads(aux)},
                         out_splits=variant.out_splits)
    out = variant.primal(outs)
    return (out, x) if return_residual else out


def _normed_gemm_fwd(lowering, variant, eps, return_residual, x, gamma, w, h, sumsq, aux):
    rstd = rstd_from_partials(sumsq, x.shape[1], eps)
    outs = lowering.gemm(variant.program(True), h, w, {"rstd": rstd, **variant.loads(aux)},
                         out_splits=variant.out_splits)
    out = variant.primal(outs)
    res = (x, gamma, w, rstd, variant.saved(outs), aux, h, sumsq)
    return ((out, x) if return_residual else out), res


def norm_gemm_backward(lowering: GemmLowering, x, gamma, w, rstd, dz_scaled, zdz_sum, dres=None, h=None):
    """The two backward GEMMs of ``z = rstd * ((x * gamma) @ w)`` given the row-scaled ``dz``.

    Args:
      x: ``[M, d]`` norm input; gamma ``[d]``; w ``[d, N]``; rstd ``[M]`` float32.
      dz_scaled: ``[M, N]`` ``rstd * dz``, the gradient of z row-scaled by ``rstd`` (cast to
        ``w.dtype`` for the GEMMs; see the module docstring).
      zdz_sum: ``[M]`` float32 ``sum_N(z * dz)`` (of the unscaled ``dz``).
      dres: ``[M, d]`` residual-stream gradient to add to ``dx``, or None.
      h: ``[M, d]`` ``x * gamma`` in ``w.dtype`` where the caller has it (the forward's GEMM
        operand), or None; read only where the lowering does not fuse epilogues.

    Returns ``(dx [M, d] x.dtype, dgamma [d] gamma.dtype, dw [d, N] w.dtype)``.

    Where the lowering runs the dgrad's epilogue body as passes over whole arrays (the ``"xla"``
    backend, or a kernel backend handing this GEMM to XLA:
    :func:`~coda_jax.lowering.fuses_epilogue_at` False), ``dW = gamma * P`` and
    ``d_gamma = sum_N(W * P)`` would be two passes over ``[d, N]`` arrays after the wgrad GEMM.
    There the wgrad is the plain GEMM ``dW = h^T @ dz'`` (``gamma * (x^T dz') = (x * gamma)^T
    dz'``), and ``d_gamma = sum_M(x * g')`` is reduced in the pass that writes ``dx``, as a
    plain JAX RMSNorm's backward does.
    """
    dz_scaled = dz_scaled.astype(w.dtype)
    loads = {"x": x, "xcoef": rstd * rstd * zdz_sum / x.shape[1], "gamma": gamma}
    if dres is not None:
        loads["dres"] = dres
    unfused = not fuses_epilogue_at(lowering, programs.rms_dgrad(dres is not None), *_dgrad_dims(x, w))
    outs = lowering.gemm(programs.rms_dgrad(dres is not None, unfused), dz_scaled, w, loads, transpose_b=True,
                         out_dtypes={"dx": x.dtype})
    if unfused:
        h = (x * gamma if h is None else h).astype(w.dtype)
        return outs["dx"], jnp.sum(outs["dgamma"], axis=0).astype(gamma.dtype), wgrad(lowering, h, dz_scaled, w)
    return (outs["dx"], *_norm_wgrad(lowering, x.astype(w.dtype), dz_scaled, gamma, w))


def _dgrad_dims(x, w) -> tuple[int, int, int]:
    """``(m, n, k)`` of the dgrad GEMM ``[M, N] @ W^T -> [M, d]``. Where the lowering does not
    fuse its epilogue (the ``xla`` backend; a kernel backend handing it to XLA, as for small
    batches, :func:`~coda_jax.lowering.xla_output_below`), the backward takes the formulation
    without ``[d, N]`` passes, since there each extra pass is one more trip through HBM
    (docs/performance.md#routing)."""
    return x.shape[0], w.shape[0], w.shape[1]


def _norm_wgrad(lowering: GemmLowering, a, b, gamma, w):
    """``(dgamma [d] gamma.dtype, dw [d, N] w.dtype)`` from the wgrad GEMM ``P = a^T @ b``
    (:data:`~coda_jax.programs.NORM_WGRAD`), with ``P = x_hat^T @ dz`` either as ``x`` against
    ``rstd * dz`` or as ``x_hat`` against ``dz``."""
    wg = lowering.gemm(programs.NORM_WGRAD, a, b, {"gamma": gamma, "w": w}, transpose_a=True,
                       out_dtypes={"dw": w.dtype})
    return jnp.sum(wg["dgamma"], axis=0).astype(gamma.dtype), wg["dw"]


def norm_gemm_backward_unscaled(lowering: GemmLowering, x, gamma, w, rstd, dz, dres=None):
    """The backward of ``z = rstd * ((x * gamma) @ w)`` from the unscaled ``dz``, on the ``[M, d]``
    side (see the module docstring): no pass over the ``[M, N]`` arrays.

    Args as :func:`norm_gemm_backward`, with ``dz [M, N]`` the gradient of ``z`` itself.
    Returns ``(dx [M, d] x.dtype, dgamma [d] gamma.dtype, dw [d, N] w.dtype)``.

    Where the lowering does not fuse epilogues (see :func:`norm_gemm_backward`), the wgrad is
    the plain GEMM ``(x_hat * gamma)^T @ dz`` and ``d_gamma = sum_M(x_hat * g)`` joins the
    ``[M, d]`` pass that writes ``dx``: no pass over ``[d, N]`` arrays.
    """
    d = x.shape[1]
    dz = dz.astype(w.dtype)
    outs = lowering.gemm(programs.NORM_DGRAD, dz, w, {"x": x, "gamma": gamma}, transpose_b=True,
                         out_dtypes={"g": x.dtype})
    s = jnp.sum(outs["xgg"], axis=0)  # [M] float32: sum_d(x * gamma * g)
    xf, r, gf = x.astype(jnp.float32), rstd[:, None], gamma.astype(jnp.float32)
    g = outs["g"].astype(jnp.float32)
    dx = r * gf * g - xf * (r ** 3 * s[:, None] / d)
    if dres is not None:
        dx = dx + dres.astype(jnp.float32)
    x_hat = xf * r
    if not fuses_epilogue_at(lowering, programs.NORM_DGRAD, *_dgrad_dims(x, w)):
        dgamma = jnp.sum(x_hat * g, axis=0).astype(gamma.dtype)
        return dx.astype(x.dtype), dgamma, wgrad(lowering, (x_hat * gf).astype(w.dtype), dz, w)
    return (dx.astype(x.dtype), *_norm_wgrad(lowering, x_hat.astype(w.dtype), dz, gamma, w))


def _normed_gemm_bwd(lowering, variant, eps, return_residual, res, cot):
    x, gamma, w, rstd, saved, aux, h, sumsq = res
    dout, dres = cot if return_residual else (cot, None)
    if getattr(variant, "cotangent_is_dz", False) and w.shape[1] > x.shape[1]:
        dx, dgamma, dw = norm_gemm_backward_unscaled(lowering, x, gamma, w, rstd, dout, dres)
        daux = jax.tree.map(jnp.zeros_like, aux)
        return typed_like(dx, x), dgamma, dw, jnp.zeros_like(h), jnp.zeros_like(sumsq), daux
    dz, zdz_sum, daux = variant.backward(saved, dout, aux)
    # rstd * dz fuses into the XLA pass that makes dz (the variants' backward is elementwise).
    dx, dgamma, dw = norm_gemm_backward(lowering, x, gamma, w, rstd, dz * rstd[:, None], zdz_sum, dres, h)
    return typed_like(dx, x), dgamma, dw, jnp.zeros_like(h), jnp.zeros_like(sumsq), daux


normed_gemm.defvjp(_normed_gemm_fwd, _normed_gemm_bwd)
