"""Backend selection and the op registry.

A backend name is resolved per op call, at trace time, from (first match wins):

1. the explicit ``backend=`` argument of the op / layer;
2. the innermost :func:`use_backend` context manager;
3. the process-wide :func:`set_backend`;
4. the ``CODA_JAX_BACKEND`` environment variable;
5. ``"auto"``: ``"pallas"`` on a Hopper GPU, else ``"xla"`` (logged once, with the reason).

Backends register the ops they implement in one registry (:func:`register_op`). If the
resolved backend lacks an op, the call raises :class:`BackendOpMissingError`, unless
fallback is allowed (``allow_fallback=True`` in :func:`use_backend` / :func:`set_backend`,
or ``CODA_JAX_ALLOW_FALLBACK=1``), in which case the op runs on ``"xla"`` and a warning
says so once per (op, backend).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable, Iterator

import jax

from coda_jax.lowering import GemmLowering

logger = logging.getLogger("coda_jax")

BACKENDS = ("xla", "pallas", "cutedsl")
ENV_BACKEND = "CODA_JAX_BACKEND"
ENV_FALLBACK = "CODA_JAX_ALLOW_FALLBACK"


class BackendError(RuntimeError):
    """Base class of backend selection errors."""


class UnknownBackendError(BackendError, ValueError):
    pass


class BackendUnavailableError(BackendError):
    """The named backend cannot run here (no GPU, not Hopper, package missing)."""


class BackendOpMissingError(BackendError, NotImplementedError):
    """The backend does not implement this op and fallback is not allowed."""


@dataclasses.dataclass(frozen=True)
class _Setting:
    backend: str | None = None
    allow_fallback: bool | None = None


_context: contextvars.ContextVar[_Setting] = contextvars.ContextVar("coda_jax_backend", default=_Setting())
_process = _Setting()
_auto_logged: set[str] = set()
_fallback_warned: set[tuple[str, str]] = set()


def _check_name(name: str) -> str:
    if name not in BACKENDS + ("auto",):
        raise UnknownBackendError(
            f"unknown coda-jax backend {name!r}; choose one of {', '.join(BACKENDS + ('auto',))}"
        )
    return name


def set_backend(name: str | None, *, allow_fallback: bool | None = None) -> None:
    """Sets the process-wide backend (``None`` clears it)."""
    global _process
    _process = _Setting(None if name is None else _check_name(name), allow_fallback)


@contextlib.contextmanager
def use_backend(name: str, *, allow_fallback: bool | None = None) -> Iterator[None]:
    """Selects a backend for the ops traced inside the ``with`` block."""
    token = _context.set(_Setting(_check_name(name), allow_fallback))
    try:
        yield
    finally:
        _context.reset(token)


def _requested() -> str:
    for s in (_context.get(), _process):
        if s.backend is not None:
            return s.backend
    env = os.environ.get(ENV_BACKEND)
    if env:
        try:
            return _check_name(env.strip().lower())
        except UnknownBackendError as e:
            raise UnknownBackendError(f"{ENV_BACKEND}={env!r}: {e}") from None
    return "auto"


def _fallback_allowed() -> bool:
    for s in (_context.get(), _process):
        if s.allow_fallback is not None:
            return s.allow_fallback
    return os.environ.get(ENV_FALLBACK, "").strip().lower() in ("1", "true", "yes")


def _gpu_description() -> tuple[bool, str]:
    """(is a Hopper GPU, what the default device is)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError as e:  # pragma: no cover - no backend at all
        return False, f"no JAX device ({e})"
    if dev.platform != "gpu":
        return False, f"the default JAX device is {dev.platform}"
    cc = getattr(dev, "compute_capability", None)
    kind = getattr(dev, "device_kind", "gpu")
    if cc is None or not str(cc).startswith("9"):
        return False, f"the GPU is {kind} (compute capability {cc}), not Hopper (9.x)"
    return True, f"the GPU is {kind} (compute capability {cc})"


def backend_unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run here, or ``None`` if it can."""
    _check_name(name)
    if name == "xla":
        return None
    if name == "pallas":
        from coda_jax.pallas.interpret import interpret_enabled

        if interpret_enabled():
            return None
        ok, what = _gpu_description()
        if ok:
            return None
        return (
            f"backend 'pallas' needs an NVIDIA Hopper GPU (H100/H200) and {what}. Install "
            "`pip install 'coda-jax[cuda]'` on a Hopper machine, use backend='xla', or set "
            "CODA_JAX_PALLAS_INTERPRET=1 to run the kernels in the (slow) GPU interpreter"
        )
    if name == "cutedsl":
        if importlib.util.find_spec("cutlass") is None:
            return (
                "backend 'cutedsl' needs the nvidia-cutlass-dsl package: "
                "`pip install 'coda-jax[cutedsl]'` (and a Hopper GPU), or use backend='pallas' / 'xla'"
            )
        ok, what = _gpu_description()
        if not ok:
            return f"backend 'cutedsl' needs an NVIDIA Hopper GPU and {what}; use backend='xla'"
        return None
    return None


def resolve_backend(backend: str | None = None) -> str:
    """The backend name an op call uses (see the module docstring for the order)."""
    name = _check_name(backend) if backend is not None else _requested()
    if name == "auto":
        ok, what = _gpu_description()
        name = "pallas" if ok else "xla"
        if what not in _auto_logged:
            _auto_logged.add(what)
            logger.info("coda-jax backend 'auto' picked %r because %s", name, what)
        return name
    reason = backend_unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(reason)
    return name


# ------------------------------------------------------------------ registry -------
_lowerings: dict[str, Callable[[], GemmLowering]] = {}
_ops: dict[str, set[str]] = {b: set() for b in BACKENDS}


def register_lowering(backend: str, factory: Callable[[], GemmLowering], ops: Iterator[str] | tuple[str, ...]) -> None:
    """Registers a backend's GEMM lowering and the ops it implements."""
    _check_name(backend)
    _lowerings[backend] = factory
    _ops[backend].update(ops)


def registered_ops(backend: str) -> frozenset[str]:
    _ensure_registered(backend)
    return frozenset(_ops[backend])


def _ensure_registered(backend: str) -> None:
    if backend in _lowerings:
        return
    # Backends register themselves on import; import lazily so that a missing optional
    # package only matters when its backend is asked for.
    import importlib

    module = {"xla": "coda_jax.reference_backend", "pallas": "coda_jax.pallas.backend",
              "cutedsl": "coda_jax.ffi.backend"}[backend]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise BackendUnavailableError(f"backend {backend!r} failed to import ({e})") from e


def lowering_for(op: str, backend: str | None = None) -> GemmLowering:
    """The GEMM lowering that runs ``op`` (resolving the backend, applying fallback)."""
    name = resolve_backend(backend)
    _ensure_registered(name)
    from coda_jax.partitioning import PartitionedLowering

    if op in _ops[name]:
        return PartitionedLowering(_lowerings[name]())
    if not _fallback_allowed():
        raise BackendOpMissingError(
            f"op {op!r} is not implemented by backend {name!r} (it has: {sorted(_ops[name])}); "
            f"use backend='xla' for it, or allow the reference fallback with "
            f"use_backend({name!r}, allow_fallback=True) or {ENV_FALLBACK}=1"
        )
    if (op, name) not in _fallback_warned:
        _fallback_warned.add((op, name))
        logger.warning("coda-jax: op %r is not implemented by backend %r; falling back to 'xla'", op, name)
    _ensure_registered("xla")
    return PartitionedLowering(_lowerings["xla"]())
