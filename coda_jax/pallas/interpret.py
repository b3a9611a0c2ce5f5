"""GPU interpret mode: run the Mosaic-GPU kernels on the CPU (slow; semantics only).

On when the environment has ``CODA_JAX_PALLAS_INTERPRET=1`` or inside
:func:`interpret_mode`. Interpret mode checks what a kernel computes, not its layouts,
register pressure or shared-memory budget: every kernel also needs the GPU suite.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

ENV_INTERPRET = "CODA_JAX_PALLAS_INTERPRET"

_interpret: contextvars.ContextVar[bool | None] = contextvars.ContextVar("coda_jax_pallas_interpret", default=None)


def interpret_enabled() -> bool:
    """Whether Pallas kernels run in the GPU interpreter."""
    v = _interpret.get()
    if v is not None:
        return v
    return os.environ.get(ENV_INTERPRET, "").strip().lower() in ("1", "true", "yes")


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Runs the Pallas kernels traced inside the block in the GPU interpreter."""
    token = _interpret.set(enabled)
    try:
        yield
    finally:
        _interpret.reset(token)
