"""Plain GEMMs of the fused ops' backward passes, through the op's lowering.

The backward of an op often has GEMMs with nothing to fuse: the wgrad ``dW = a^T @ b`` and
the dgrad ``dy = dx @ W^T`` of a plain ``x = y @ W``. They run the
:data:`~coda_jax.programs.IDENTITY` program on the same lowering as the op's fused GEMMs (so a
backend's plain-GEMM route, e.g. cuBLAS through XLA, applies to them alike).
"""

from __future__ import annotations

from typing import Any

import jax

from coda_jax import programs
from coda_jax.lowering import GemmLowering


def matmul(lowering: GemmLowering, a: jax.Array, b: jax.Array, *, transpose_a: bool = False,
           transpose_b: bool = False, out_dtype: Any = None) -> jax.Array:
    """``op(a) @ op(b)``, ``op`` transposing where asked.

    Args:
      a: ``[M, K]`` (``[K, M]`` with ``transpose_a``).
      b: ``[K, N]`` (``[N, K]`` with ``transpose_b``), the same dtype as ``a``.
      out_dtype: the result's dtype (default: the operands'); accumulation is float32.
    Returns: ``[M, N]``.
    """
    out_dtypes = None if out_dtype is None else {"out": out_dtype}
    return lowering.gemm(programs.IDENTITY, a, b, {}, transpose_a=transpose_a, transpose_b=transpose_b,
                         out_dtypes=out_dtypes)["out"]


def wgrad(lowering: GemmLowering, a: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
    """``dW = a^T @ b`` in ``w.dtype``: the weight gradient of ``z = a @ W`` from ``b = dz``.

    Shapes: ``a [M, d]``, ``b [M, N]`` -> ``[d, N]`` (``w``'s shape).
    """
    return matmul(lowering, a, b, transpose_a=True, out_dtype=w.dtype)


def linear_grads(lowering: GemmLowering, y: jax.Array, w: jax.Array, dx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(dy [M, K] y.dtype, dw [K, N] w.dtype)``: the gradients of ``x = y @ w`` from ``dx [M, N]``
    (cast to ``y.dtype`` for the GEMMs)."""
    dx_op = dx.astype(y.dtype)
    return matmul(lowering, dx_op, w, transpose_b=True), wgrad(lowering, y, dx_op, w)
