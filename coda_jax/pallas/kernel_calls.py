"""A log of the Pallas kernel calls a traced function makes (what the autotuner times).

    with record_kernel_calls() as calls:
        jax.jit(train_step).lower(state, inputs, targets)
    for c in calls: ...   # KernelCall(program, shapes, layout), one per distinct call

:class:`coda_jax.pallas.lowering.PallasLowering` appends every GEMM it sends to the kernel
(not those routed to XLA) while a recorder is open. Abstract values only: recording works
under ``jax.jit(...).lower`` and ``jax.eval_shape`` on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import Epilogue

_RECORDERS: list[list[KernelCall]] = []


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One GEMM-epilogue call: its program, the abstract operands and loads, the layout."""

    epilogue: Epilogue
    a: jax.ShapeDtypeStruct
    b: jax.ShapeDtypeStruct
    loads: tuple[tuple[str, jax.ShapeDtypeStruct | tuple[jax.ShapeDtypeStruct, ...]], ...]  # parts: a tuple
    transpose_a: bool
    transpose_b: bool
    out_dtypes: tuple[tuple[str, Any], ...]
    mnk: tuple[int, int, int]
    promote_k: int = 0  # FP8 accumulator promotion (coda_jax.lowering.GemmLowering)


def _abstract(x) -> jax.ShapeDtypeStruct | tuple[jax.ShapeDtypeStruct, ...]:
    """``x``'s shape and dtype (a load given as column parts: a tuple, one per part)."""
    if isinstance(x, (tuple, list)):
        return tuple(_abstract(p) for p in x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def note_call(epilogue: Epilogue, a, b, loads: Mapping[str, Any], transpose_a: bool, transpose_b: bool,
              out_dtypes: Mapping[str, Any] | None, mnk: tuple[int, int, int], promote_k: int = 0) -> None:
    """Appends the call to every open recorder (a no-op when none is open), once per
    distinct call."""
    if not _RECORDERS:
        return
    call = KernelCall(epilogue, _abstract(a), _abstract(b), tuple((k, _abstract(v)) for k, v in sorted(loads.items())),
                      transpose_a, transpose_b, tuple(sorted((k, jnp.dtype(v)) for k, v in (out_dtypes or {}).items())),
                      tuple(mnk), promote_k)
    for calls in _RECORDERS:
        if call not in calls:
            calls.append(call)


@contextlib.contextmanager
def record_kernel_calls() -> Iterator[list[KernelCall]]:
    """Collects the distinct kernel calls traced inside the ``with`` block."""
    calls: list[KernelCall] = []
    _RECORDERS.append(calls)
    try:
        yield calls
    finally:
        _RECORDERS.remove(calls)
