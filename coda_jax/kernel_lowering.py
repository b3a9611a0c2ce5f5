"""What the kernel backends' lowerings share: the seam between an op's GEMM call and a kernel.

:class:`KernelLowering` is the base of the ``"pallas"`` and ``"cutedsl"`` lowerings. It
checks the call (:func:`coda_jax.lowering.check_kernel_gemm`), hands the GEMMs that XLA runs
better to the reference lowering (:func:`coda_jax.lowering.routes_to_xla`, by the routing
options), and leaves the rest to the subclass's :meth:`KernelLowering.kernel_gemm`, which
pads (:func:`pad_operands`, :func:`pad_loads`), launches its kernel and slices the padded
outputs back (:func:`slice_outputs`).

Launch settings that are not per-GEMM tuning are the lowering's constructor arguments:
``plain_gemm`` (overrides the option ``routing.plain_gemm``), ``latency_hints`` (tell XLA's
scheduler each kernel's estimated run time) and ``reserved_sms`` (SMs the persistent grid
leaves to kernels on other streams). A variant is a lowering built with them, run under
:func:`coda_jax.backend.use_lowering`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import FP8_DTYPES, Epilogue, LoadKind, OutputKind
from coda_jax.log import log_once
from coda_jax.lowering import (check_kernel_gemm, check_out_splits, check_plain_gemm, check_promote_k,
                               kernel_latency_hint, persistent_grid_sms, routes_to_xla)
from coda_jax.reference import REFERENCE, xla_backend_lowering


def _log_fp8_fallback(backend: str, program: str, why: str) -> None:
    log_once(("fp8_fallback", backend, program), logging.INFO,  # once per program
             "coda_jax: %s runs the FP8 GEMMs of %r on XLA: %s", backend, program, why)


def _pad2(x: jax.Array, rows: int, cols: int) -> jax.Array:
    return x if x.shape == (rows, cols) else jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def pad_operands(a: jax.Array, b: jax.Array, mp: int, np_: int, kp: int, transpose_a: bool,
                 transpose_b: bool) -> tuple[jax.Array, jax.Array]:
    """``a`` (``[M, K]``, or ``[K, M]`` transposed) and ``b`` (``[K, N]``, or ``[N, K]``)
    zero-padded to ``[mp, kp]`` and ``[kp, np_]`` in their own layouts (zeros add nothing to
    the accumulator)."""
    a_p = _pad2(a, kp, mp) if transpose_a else _pad2(a, mp, kp)
    b_p = _pad2(b, np_, kp) if transpose_b else _pad2(b, kp, np_)
    return a_p, b_p


def pad_loads(epilogue: Epilogue, loads: Mapping[str, jax.Array], m: int, n: int, mp: int,
              np_: int) -> list[jax.Array]:
    """The epilogue's loads in declaration order, zero-padded to the padded GEMM: rows to
    ``mp``, columns to ``np_`` (half of it for half-width loads); scalars as given. A tile
    load given as column parts (a tuple) stays one: each part's rows padded (its columns
    cannot be: N must then be unpadded)."""
    out = []
    for load in epilogue.loads:
        v = loads[load.name]
        if isinstance(v, (tuple, list)):
            if epilogue.width(np_, load.half) != epilogue.width(n, load.half):
                raise ValueError(f"load {load.name!r} in column parts needs N unpadded (N={n}, padded {np_}); "
                                 "join the parts first (coda_jax.lowering.join_columns)")
            out.append(tuple(_pad2(jnp.asarray(p), mp, p.shape[1]) for p in v))
            continue
        v = jnp.asarray(v)
        if load.kind is LoadKind.ROW:
            v = jnp.pad(v, (0, mp - m))
        elif load.kind is LoadKind.ROW_BLOCK:
            v = jnp.pad(v, ((0, mp - m), (0, 0)))
        elif load.kind is LoadKind.COL:
            v = jnp.pad(v, (0, epilogue.width(np_, load.half) - epilogue.width(n, load.half)))
        elif load.kind is LoadKind.TILE:
            v = _pad2(v, mp, epilogue.width(np_, load.half))
        out.append(v)
    return out


def slice_output(epilogue: Epilogue, name: str, value: jax.Array, m: int, n: int) -> jax.Array:
    """One padded kernel output cut back to the GEMM's ``m`` rows / ``n`` columns: tiles
    ``[M, N]``, column-sum partials ``[P, N]``, row partials ``[P, M]``."""
    out = next(o for o in epilogue.outputs if o.name == name)
    if out.kind is OutputKind.TILE:
        return value[:m, : epilogue.width(n, out.half)]
    if out.kind is OutputKind.COL_SUM:
        return value[:, :n]
    return value[:, :m]


class KernelLowering:
    """Base of the kernel backends' :class:`~coda_jax.lowering.GemmLowering`.

    Args:
      plain_gemm: where GEMMs with the identity epilogue run: ``"xla"``, ``"kernel"`` (or the
        backend's name), or ``None`` (default: the option ``routing.plain_gemm``).
      latency_hints: annotate each kernel call with its estimated run time for XLA's
        latency-hiding scheduler (:func:`coda_jax.lowering.with_latency_hint`). Off by default.
      reserved_sms: SMs the persistent grid leaves free for kernels on other streams (NCCL's
        collectives); default 0.
    """

    name: str = ""
    title: str = ""  # the backend's name in error messages

    def __init__(self, *, plain_gemm: str | None = None, latency_hints: bool = False, reserved_sms: int = 0):
        self.plain_gemm = check_plain_gemm(self.name, plain_gemm)
        self.latency_hints = bool(latency_hints)
        persistent_grid_sms(1 << 20, reserved_sms)  # checks the argument
        self.reserved_sms = reserved_sms

    def grid_sms(self, num_sms: int) -> int:
        """SMs the persistent grid covers on a GPU of ``num_sms`` (less :attr:`reserved_sms`)."""
        return persistent_grid_sms(num_sms, self.reserved_sms)

    def latency_hint(self, m: int, n: int, k: int, arrays: Sequence[Any]) -> int | None:
        """The estimate XLA's scheduler is told for this kernel, or None without
        :attr:`latency_hints`."""
        return kernel_latency_hint(m, n, k, arrays) if self.latency_hints else None

    def fuses_at(self, epilogue: Epilogue, m: int, n: int, k: int) -> bool:
        """False where this backend hands the ``[m, k] @ [k, n]`` GEMM to XLA
        (:func:`~coda_jax.lowering.routes_to_xla`); see
        :func:`~coda_jax.lowering.fuses_epilogue_at`."""
        return not routes_to_xla(self.name, epilogue, m, n, k, self.plain_gemm)

    def gemm(
        self,
        epilogue: Epilogue,
        a: jax.Array,
        b: jax.Array,
        loads: Mapping[str, jax.Array],
        *,
        transpose_a: bool = False,
        transpose_b: bool = False,
        out_dtypes: Mapping[str, Any] | None = None,
        out_splits: Mapping[str, tuple[int, ...]] | None = None,
        promote_k: int = 0,
    ) -> dict[str, Any]:
        """See :class:`coda_jax.lowering.GemmLowering`: checks the call, routes it to XLA where
        the routing options say so, else runs :meth:`kernel_gemm`."""
        m, n, k = check_kernel_gemm(self.title, epilogue, a, b, loads, transpose_a, transpose_b)
        promote_k = check_promote_k(promote_k) if a.dtype in FP8_DTYPES else 0
        splits = check_out_splits(epilogue, out_splits, n)
        fp8_rule = None
        if a.dtype in FP8_DTYPES or epilogue.quantizes:
            fp8_rule = self.fp8_rule(epilogue, a, b, transpose_a, transpose_b)
            if fp8_rule is not None:
                _log_fp8_fallback(self.name, epilogue.name, fp8_rule)
        if fp8_rule is not None:  # XLA's FP8 GEMM writing bf16, as the xla backend runs it
            return xla_backend_lowering().gemm(epilogue, a, b, loads, transpose_a=transpose_a,
                                               transpose_b=transpose_b, out_dtypes=out_dtypes, out_splits=splits,
                                               promote_k=promote_k)
        if routes_to_xla(self.name, epilogue, m, n, k, self.plain_gemm):
            return REFERENCE.gemm(epilogue, a, b, loads, transpose_a=transpose_a, transpose_b=transpose_b,
                                  out_dtypes=out_dtypes, out_splits=splits, promote_k=promote_k)
        return self.kernel_gemm(epilogue, a, b, loads, (m, n, k), transpose_a=transpose_a, transpose_b=transpose_b,
                                out_dtypes=out_dtypes, out_splits=splits, promote_k=promote_k)

    def fp8_rule(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, transpose_a: bool,
                 transpose_b: bool) -> str | None:
        """Why this backend's kernel cannot run an FP8 GEMM (FP8 operands, or an epilogue with
        quantizing outputs), or None where it can. Such a GEMM then runs on XLA (cuBLASLt's
        FP8 GEMM and a fusion of the body), logged once per program. The base kernel has no
        FP8 path; a backend that has one overrides this with its layout rules."""
        return f"the {self.title} kernel has no FP8 path yet"

    def kernel_gemm(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, loads: Mapping[str, jax.Array],
                    dims: tuple[int, int, int], *, transpose_a: bool, transpose_b: bool,
                    out_dtypes: Mapping[str, Any] | None,
                    out_splits: dict[str, tuple[int, ...]], promote_k: int = 0) -> dict[str, Any]:
        """Runs the checked GEMM (``dims``: its ``(m, n, k)``; ``out_splits`` and ``promote_k``
        checked, ``promote_k`` 0 for 16-bit operands) on the backend's kernel."""
        raise NotImplementedError
