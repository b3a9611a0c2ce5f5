"""Backend selection and the op registry.

A backend name is resolved per op call, at trace time, from (first match wins):

1. the explicit ``backend=`` argument of the op / layer;
2. the option ``backend`` (:func:`coda_jax.options`, :func:`coda_jax.set_options`; or their
   shorthands :func:`use_backend` and :func:`set_backend`), whose last fallback is the
   ``CODA_JAX_BACKEND`` environment variable;
3. ``"auto"``: ``"pallas"`` on a Hopper GPU, else ``"xla"`` (logged once, with the reason).

Backends register the ops they implement in one registry (:func:`register_lowering`). If the
resolved backend lacks an op, the call raises :class:`BackendOpMissingError`, unless the
option ``allow_fallback`` is on (``allow_fallback=True`` in :func:`use_backend` /
:func:`set_backend`, or ``CODA_JAX_ALLOW_FALLBACK=1``), in which case the op runs on ``"xla"``
and a warning says so once per (op, backend).

:func:`use_lowering` runs a backend's ops on a lowering built with other launch or tuning
settings (a benchmark's variant, a profiled run), for the ops traced inside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import logging
from collections.abc import Callable, Iterator

import jax

from coda_jax.log import log_once
from coda_jax.lowering import GemmLowering
from coda_jax.options import current_options, options, reset_options, set_options
from coda_jax.partitioning import PartitionedLowering


BACKENDS = ("xla", "pallas", "cutedsl")


class BackendError(RuntimeError):
    """Base class of backend selection errors."""


class UnknownBackendError(BackendError, ValueError):
    pass


class BackendUnavailableError(BackendError):
    """The named backend cannot run here (no GPU, not Hopper, package missing)."""


class BackendOpMissingError(BackendError, NotImplementedError):
    """The backend does not implement this op and fallback is not allowed."""


_lowering_overrides: contextvars.ContextVar[dict[str, GemmLowering]] = contextvars.ContextVar(
    "coda_jax_lowerings", default={})


def _check_name(name: str) -> str:
    if name not in BACKENDS + ("auto",):
        raise UnknownBackendError(
            f"unknown coda-jax backend {name!r}; choose one of {', '.join(BACKENDS + ('auto',))}"
        )
    return name


def set_backend(name: str | None, *, allow_fallback: bool | None = None) -> None:
    """Sets the process-wide backend: the option ``backend`` (``None`` clears it, and the
    fallback setting with it, back to the environment or the default)."""
    if name is None:
        reset_options("backend", "allow_fallback")
    set_options(backend=None if name is None else _check_name(name), allow_fallback=allow_fallback)


def use_backend(name: str, *, allow_fallback: bool | None = None):
    """Selects a backend for the ops traced inside the ``with`` block: the option
    ``backend`` for the block."""
    return options(backend=_check_name(name), allow_fallback=allow_fallback)


@contextlib.contextmanager
def use_lowering(lowering: GemmLowering) -> Iterator[None]:
    """Inside the ``with`` block, ops that resolve to backend ``lowering.name`` run on
    ``lowering`` (e.g. ``PallasLowering(latency_hints=True)``, a CuTeDSL lowering with another
    :class:`~coda_jax.ffi.tuning.CuteDslTuning`) instead of the backend's default lowering."""
    _check_name(lowering.name)
    token = _lowering_overrides.set({**_lowering_overrides.get(), lowering.name: lowering})
    try:
        yield
    finally:
        _lowering_overrides.reset(token)


def _requested() -> str:
    try:
        return current_options().backend
    except ValueError as e:  # a bad $CODA_JAX_BACKEND
        raise UnknownBackendError(str(e)) from None


def _fallback_allowed() -> bool:
    return current_options().allow_fallback


def _gpu_description() -> tuple[bool, str]:
    """(is a Hopper GPU, what the default device is)."""
    try:
        dev = jax.local_devices()[0]  # this process's (jax.devices()[0] may be another process's)
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
        # The registry imports a backend's package only when that backend is asked for.
        from coda_jax.pallas.interpret import interpret_enabled

        if interpret_enabled():
            return None
        ok, what = _gpu_description()
        if ok:
            return None
        return (
            f"backend 'pallas' needs an NVIDIA Hopper GPU (H100/H200) and {what}. Install "
            "`pip install 'coda-jax[cuda]'` on a Hopper machine, use backend='xla', or set "
            "CODA_JAX_PALLAS_INTERPRET=1 (before JAX starts) to run the kernels in the (slow) GPU interpreter"
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
        log_once(("auto", what), logging.INFO, "coda-jax backend 'auto' picked %r because %s", name, what)
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
    if op in _ops[name]:
        return PartitionedLowering(_lowering_overrides.get().get(name) or _lowerings[name]())
    if not _fallback_allowed():
        raise BackendOpMissingError(
            f"op {op!r} is not implemented by backend {name!r} (it has: {sorted(_ops[name])}); "
            f"use backend='xla' for it, or allow the reference fallback with "
            f"use_backend({name!r}, allow_fallback=True) or CODA_JAX_ALLOW_FALLBACK=1"
        )
    log_once(("fallback", op, name), logging.WARNING,
             "coda-jax: op %r is not implemented by backend %r; falling back to 'xla'", op, name)
    _ensure_registered("xla")
    return PartitionedLowering(_lowerings["xla"]())
