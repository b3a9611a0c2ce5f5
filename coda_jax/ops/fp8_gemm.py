"""A GEMM of two per-tensor-scaled FP8 matrices (:class:`coda_jax.fp8.Fp8Tensor`).

Hopper's FP8 MMA (and cuBLASLt's FP8 GEMM) takes both operands K-major: for
``C [M, N] = A [M, K] @ B [K, N]`` it reads ``A`` as ``[M, K]`` and ``B`` as ``[N, K]``. An
:class:`~coda_jax.fp8.Fp8Tensor` carries both layouts where they are needed (written by the
epilogue that produced it), so each of a projection's three GEMMs picks the K-major copy
of each operand: forward ``x @ W`` reads ``x.data`` and ``W.data_t``, dgrad ``dy @ W^T``
reads ``dy.data`` and ``W.data``, wgrad ``x^T @ dy`` reads ``x.data_t`` and ``dy.data_t``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax import epilogue as E
from coda_jax.fp8 import Fp8Tensor, promotion
from coda_jax.lowering import GemmLowering


def fp8_gemm(lowering: GemmLowering, epilogue: E.Epilogue, a: Fp8Tensor, b: Fp8Tensor,
             loads: Mapping[str, jax.Array], *, contracts_tokens: bool = False, **kw: Any) -> dict[str, Any]:
    """``epilogue`` on ``a @ b`` (``a`` ``[M, K]``, ``b`` ``[K, N]`` as matrices; use ``.T`` for
    a transposed operand): the GEMM reads ``a.data`` ``[M, K]`` and ``b.data_t`` ``[N, K]``,
    and the body sees the float32 accumulator times ``a.scale_inv * b.scale_inv``
    (:func:`coda_jax.epilogue.dequantized`). ``kw``: ``out_dtypes`` / ``out_splits`` / ``promote_k`` as in
    :meth:`coda_jax.lowering.GemmLowering.gemm`. ``contracts_tokens``: ``K`` is the tokens (a
    wgrad ``x^T @ dy``): under a mesh that splits the tokens each device then contracts its own
    (:class:`coda_jax.partitioning.PartitionedLowering`), where the shapes alone would have
    its rows taken for the tokens and the other operand gathered."""
    if contracts_tokens and getattr(lowering, "splits_tokens", False):
        kw["contracts_tokens"] = True
    if a.data is None or b.data_t is None:
        raise ValueError(f"fp8_gemm: operand copy missing (a needs its row-major copy, b its transposed one) "
                         f"for epilogue {epilogue.name!r}")
    return lowering.gemm(E.dequantized(epilogue), a.data, b.data_t,
                         {**loads, "acc_scale": a.scale_inv * b.scale_inv}, transpose_b=True, **kw)


def backward_gemm(promote_k: int, promote_min_k: int) -> Callable[..., dict[str, Any]]:
    """:func:`fp8_gemm` for a backward GEMM under ``Fp8Recipe(promote_k, promote_min_k)``: its
    accumulator promoted every ``promote_k`` K elements where its K (``a``'s columns) is at
    least ``promote_min_k``, in the tensor core's accumulator otherwise."""
    def gemm(lowering: GemmLowering, epilogue: E.Epilogue, a: Fp8Tensor, b: Fp8Tensor,
             loads: Mapping[str, jax.Array], **kw: Any) -> dict[str, Any]:
        pk = promotion(a.shape[1], promote_k, promote_min_k)
        if pk:  # else not passed: any GemmLowering runs it
            kw["promote_k"] = pk
        return fp8_gemm(lowering, epilogue, a, b, loads, **kw)
    return gemm


def quantizing_run(run: Callable[[E.Epilogue, dict, dict], dict], program: E.Epilogue, loads: Mapping[str, Any],
                   out: str, dtype: Any, *, scale: jax.Array | None = None,
                   quantize: Callable[[jax.Array], tuple[Fp8Tensor, jax.Array]] | None = None
                   ) -> tuple[dict, Fp8Tensor, jax.Array]:
    """``(results, Fp8Tensor, amax)`` of ``program`` and its quantizing output ``out``, where
    ``run(program, loads, out_dtypes)`` runs a program (a GEMM or an epilogue pass).

    Delayed scaling (``scale`` given): ``program`` as declared, its scale load set to ``scale``:
    the epilogue writes both FP8 layouts and the amax partials. Current scaling (``quantize``
    given): :func:`coda_jax.epilogue.unquantized` ``program`` writes ``out`` in ``dtype``, and
    ``quantize(values)`` returns its FP8 tensor and amax (a pass with the scale of its own amax)."""
    if (scale is None) == (quantize is None):
        raise ValueError("quantizing_run takes exactly one of scale (delayed) and quantize (current)")
    q = program.output(out).quantize
    if scale is not None:
        outs = run(program, {**loads, q.scale: scale}, {})
        return outs, Fp8Tensor(outs[out], outs[f"{out}_t"], 1.0 / scale), jnp.max(outs[f"{out}_amax"])
    outs = run(E.unquantized(program), {**loads, q.scale: jnp.ones((), jnp.float32)}, {out: dtype})
    return (outs, *quantize(outs[out]))
