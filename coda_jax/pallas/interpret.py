"""GPU interpret mode: run the Mosaic-GPU kernels on the CPU (slow; semantics only).

On when the environment has ``CODA_JAX_PALLAS_INTERPRET=1`` or inside
:func:`interpret_mode`. Interpret mode checks what a kernel computes, not its layouts,
register pressure or shared-memory budget: every kernel also needs the GPU suite.

Threads. The interpreter runs each simulated warpgroup of a CTA (three in the
warp-specialized kernel, six in a cluster of two) as its own jitted CPU computation, and
they meet at barriers inside io_callbacks. XLA's CPU client may run parts of those
computations on its thread pool, which has one thread per core; a warpgroup blocked at a
barrier holds a pool thread, and on a machine with fewer cores than the CTA has
warpgroups the last warpgroup can wait forever for a thread: a hang, intermittent because
it depends on which computations run inline (2-core CI: about one run in 16 of the
warp-specialized kernel tests under two pytest workers). The pool's size is read once,
from ``PJRT_NPROC``, when JAX creates its CPU client. :func:`ensure_interpreter_threads`
sets it before that, and warns when it is too late.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from collections.abc import Iterator

from coda_jax.options import INTERPRET_ENV as ENV_INTERPRET  # one of the five variables coda-jax reads
ENV_POOL = "PJRT_NPROC"
# Warpgroups the interpreter may block at once (a cluster of two warp-specialized CTAs),
# plus the grid loop that waits for them, plus one to run.
INTERPRETER_THREADS = 8

_interpret: contextvars.ContextVar[bool | None] = contextvars.ContextVar("coda_jax_pallas_interpret", default=None)
_warned = False


def interpret_enabled() -> bool:
    """Whether Pallas kernels run in the GPU interpreter."""
    v = _interpret.get()
    if v is not None:
        return v
    return os.environ.get(ENV_INTERPRET, "").strip().lower() in ("1", "true", "yes")


def _pool_size() -> int:
    try:
        return int(os.environ[ENV_POOL])
    except (KeyError, ValueError):
        return os.cpu_count() or 1


def ensure_interpreter_threads() -> bool:
    """Gives the CPU client's thread pool room for the interpreter's blocked warpgroups.

    Before JAX has created its backends: sets ``PJRT_NPROC`` to at least
    :data:`INTERPRETER_THREADS` (unless the user set it). After: the pool is fixed; warns
    once if it is smaller. Returns whether the pool is (or will be) large enough.
    """
    global _warned
    if _pool_size() >= INTERPRETER_THREADS:
        return True
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        os.environ[ENV_POOL] = str(INTERPRETER_THREADS)
        return True
    if not _warned:
        _warned = True
        warnings.warn(
            f"coda_jax: the Pallas GPU interpreter may hang on this machine: JAX's CPU client has "
            f"{_pool_size()} pool threads and a warp-specialized CTA can block {INTERPRETER_THREADS - 1}. Set "
            f"{ENV_POOL}={INTERPRETER_THREADS} (or {ENV_INTERPRET}=1) in the environment before JAX starts.",
            RuntimeWarning, stacklevel=3)
    return False


@contextlib.contextmanager
def interpret_mode(enabled: bool = True) -> Iterator[None]:
    """Runs the Pallas kernels traced inside the block in the GPU interpreter."""
    if enabled:
        ensure_interpreter_threads()
    token = _interpret.set(enabled)
    try:
        yield
    finally:
        _interpret.reset(token)


if interpret_enabled():  # asked for by the environment: usually before JAX has started
    ensure_interpreter_threads()
