"""coda-jax's typed options: one frozen dataclass per concern, scoped like the backend.

Every setting of the library that is not an argument of one call lives here::

    import coda_jax as cj

    with cj.options(cross_entropy=cj.CrossEntropyOptions(save_logits=False)):
        loss = model.loss(inputs, targets)            # traced inside: the logits are recomputed

    cj.set_options(mesh=cj.MeshOptions(fsdp_split="features"))   # process-wide
    cj.current_options().routing.xla_output_below                 # what is in force: 4194304

A setting is resolved, field by field, from (first match wins):

1. the argument of the op or layer, where it has one (``backend=``, ``save_logits=``, ...);
2. the innermost :func:`options` context that sets the field;
3. :func:`set_options` (process-wide);
4. an environment variable, for the five settings that must be known before Python code runs
   or that are process-wide by nature (:data:`ENVIRONMENT`);
5. the default of the field's dataclass.

In a group passed to :func:`options` / :func:`set_options`, a field left ``None`` is not set
there (an outer layer or the default decides); :func:`current_options` returns every field
resolved. Options are read when an op is *traced*: a ``jax.jit`` function traced before a
change keeps what it saw (trace it inside the ``with`` block, or jit a fresh function).

Strings (the environment, benchmark command lines) go through one parser,
:func:`parse_overrides` (``"routing.xla_output_below=0,cross_entropy.save_logits=false"``),
which checks each value against its field and names the field and its rule when it fails.

Per-kernel tuning (tiles, stages, schedules) is not an option: it belongs to each kernel
backend's tuning configuration (``coda_jax.pallas.TuningConfig``,
``coda_jax.ffi.CuteDslTuning``), passed to its lowering and run under
:func:`coda_jax.use_lowering`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

BACKEND_NAMES = ("xla", "pallas", "cutedsl", "auto")


class OptionError(ValueError):
    """A bad option value: the message names the option (or environment variable) and its rule."""


# ----------------------------------------------------------------------------- groups ----
# Every field defaults to None ("not set here"); DEFAULTS holds what an unset field means.


@dataclasses.dataclass(frozen=True)
class RoutingOptions:
    """Which GEMMs a kernel backend (``"pallas"``, ``"cutedsl"``) hands to XLA: XLA's GEMM
    (cuBLAS on a GPU) plus an XLA fusion of the same epilogue body, instead of its own kernel.

    Attributes:
      plain_gemm: where GEMMs with nothing to fuse (the identity epilogue: backward dgrad /
        wgrad GEMMs; in FP8 the same GEMMs scaled by one scalar, which cuBLASLt's FP8 GEMM
        applies itself) run: ``"xla"`` (default: cuBLAS / cuBLASLt is faster on a bare GEMM)
        or ``"kernel"`` (the backend's own kernel).
      xla_output_below: fused GEMMs whose output (``M * N`` elements on one device) is smaller
        than this run on XLA (default ``2**22``: below it the kernel's small-tile class is
        slower than cuBLAS and the fusion saves little); ``0`` keeps every fused GEMM on the
        kernel. Why: docs/performance.md#routing.
      xla_programs: fused programs handed to XLA by name, each with the largest GEMM it
        applies to (``m*n*k`` in units of ``2**30``; ``None``: any size), e.g.
        ``{"rms_rope": None, "rms_dgrad_res": 64}``. Default: none (every hand-off measured
        slowed the 1B step).
    """

    plain_gemm: Literal["xla", "kernel"] | None = None
    xla_output_below: int | None = None
    xla_programs: Mapping[str, float | None] | None = None


@dataclasses.dataclass(frozen=True)
class CrossEntropyOptions:
    """What :func:`coda_jax.linear_cross_entropy` saves for its backward (its ``save_logits=``
    and ``logits_dtype=`` arguments, where given, win).

    Attributes:
      save_logits: ``True``: save the logits (the backward is one fused pass plus two GEMMs);
        ``False``: save only the row log-sum-exp and recompute the logits per vocabulary chunk;
        ``"auto"`` (default): save them when they fit ``logits_budget_mb``.
      logits_dtype: storage dtype of saved logits, ``"float32"`` (default) or ``"bfloat16"``.
      logits_budget_mb: memory the saved logits may take (MiB); ``"auto"`` (default): 1/8 of
        the default device's memory (2 GiB where the device reports none).
    """

    save_logits: bool | Literal["auto"] | None = None
    logits_dtype: Literal["float32", "bfloat16"] | None = None
    logits_budget_mb: float | Literal["auto"] | None = None


@dataclasses.dataclass(frozen=True)
class MeshOptions:
    """How the ops and the model are split over a device mesh (:mod:`coda_jax.partitioning`).

    Attributes:
      fsdp_split: which dimension FSDP splits each weight along: ``"width"`` (default; the
        model width, every weight gathered whole where a GEMM uses it, ZeRO-3) or
        ``"features"`` (the weights' feature dimensions; every GEMM left to XLA's
        partitioner). Set it before the state is sharded and keep it while the step is traced.
        :func:`coda_jax.partitioning.choose_fsdp_split` says which is faster for a step.
      partial_sums: dtype of the shards' partial sums of a token-contracting GEMM (the weight
        gradients under data parallelism): ``"output"`` (default: the gradient's own dtype,
        as XLA's partitioner does for plain JAX) or ``"float32"``.
      fsdp_xla_tokens_below: under FSDP, with fewer tokens a device than this, every GEMM runs
        as XLA ops left to the partitioner (default 1024; ``0``: never).
      fsdp_xla_gemms_below: under FSDP, with fewer tokens a device than this, a kernel
        backend's GEMMs run as XLA GEMMs and fusions, still split by tokens, where XLA overlaps
        the weight gathers with them (default 4096; ``0``: never).
      vocab_parallel_head: under FSDP with the width split, the LM head and loss run split over
        the vocabulary (default ``True``); ``False`` keeps the token-split head.
    """

    fsdp_split: Literal["width", "features"] | None = None
    partial_sums: Literal["output", "float32"] | None = None
    fsdp_xla_tokens_below: int | None = None
    fsdp_xla_gemms_below: int | None = None
    vocab_parallel_head: bool | None = None


@dataclasses.dataclass(frozen=True)
class XlaOptions:
    """The ``"xla"`` reference backend.

    Attributes:
      accumulate: its GEMMs' outputs: ``"operand"`` (default: rounded to the 16-bit operand
        dtype, as a plain JAX ``x @ w``) or ``"float32"`` (the exact float32 accumulators the
        kernels' epilogues see; slower, for comparisons).
    """

    accumulate: Literal["operand", "float32"] | None = None


@dataclasses.dataclass(frozen=True)
class KernelCacheOptions:
    """The on-disk caches of the kernels: the Pallas kernels' generated modules
    (:mod:`coda_jax.pallas.kernel_cache`) and the CuTeDSL kernels' compiled objects
    (:mod:`coda_jax.ffi.kernel_cache`, in the ``cutedsl`` subdirectory).

    Attributes:
      directory: where they live; ``"off"``: no cache; ``"default"`` (default): beside JAX's
        persistent compilation cache when that is on, else ``$XDG_CACHE_HOME/coda_jax/kernels``
        (``~/.cache/coda_jax/kernels``); entries are keyed by GPU and versions.
      workers: processes that build Pallas kernels for the cache in parallel while a step is
        traced (``0``: build in this process); ``"auto"`` (default): from the CPU count.
    """

    directory: str | None = None
    workers: int | Literal["auto"] | None = None


@dataclasses.dataclass(frozen=True)
class PallasOptions:
    """The ``"pallas"`` backend.

    Attributes:
      tuned_tables: the measured per-GEMM tables (:mod:`coda_jax.pallas.tuned`) to look
        configurations up in: ``"shipped"`` (default: the tables shipped for each GPU kind),
        ``"none"`` (the heuristics alone), or a tuple of table file paths (``benchmarks/tune.py``
        writes them).
    """

    tuned_tables: Literal["shipped", "none"] | tuple[str, ...] | None = None


GROUPS: dict[str, type] = {
    "routing": RoutingOptions,
    "cross_entropy": CrossEntropyOptions,
    "mesh": MeshOptions,
    "xla": XlaOptions,
    "kernel_cache": KernelCacheOptions,
    "pallas": PallasOptions,
}


@dataclasses.dataclass(frozen=True)
class Options:
    """Every coda-jax option; :func:`current_options` returns one with each field resolved.

    Attributes:
      backend: ``"xla"``, ``"pallas"``, ``"cutedsl"`` or ``"auto"`` (default: Pallas on a
        Hopper GPU, else XLA). See :func:`coda_jax.resolve_backend`.
      allow_fallback: ops the chosen backend lacks run on ``"xla"`` with a warning (default
        ``False``: they raise :class:`coda_jax.BackendOpMissingError`).
      routing, cross_entropy, mesh, xla, kernel_cache, pallas: the groups above.
    """

    backend: Literal["xla", "pallas", "cutedsl", "auto"] | None = None
    allow_fallback: bool | None = None
    routing: RoutingOptions = RoutingOptions()
    cross_entropy: CrossEntropyOptions = CrossEntropyOptions()
    mesh: MeshOptions = MeshOptions()
    xla: XlaOptions = XlaOptions()
    kernel_cache: KernelCacheOptions = KernelCacheOptions()
    pallas: PallasOptions = PallasOptions()


DEFAULTS = Options(
    backend="auto",
    allow_fallback=False,
    routing=RoutingOptions(plain_gemm="xla", xla_output_below=1 << 22, xla_programs={}),
    cross_entropy=CrossEntropyOptions(save_logits="auto", logits_dtype="float32", logits_budget_mb="auto"),
    mesh=MeshOptions(fsdp_split="width", partial_sums="output", fsdp_xla_tokens_below=1024,
                     fsdp_xla_gemms_below=4096, vocab_parallel_head=True),
    xla=XlaOptions(accumulate="operand"),
    kernel_cache=KernelCacheOptions(directory="default", workers="auto"),
    pallas=PallasOptions(tuned_tables="shipped"),
)

# The only environment variables coda-jax reads: settings that must be in place before Python
# code runs (a launcher, a CI job) or that are process-wide by nature. The Pallas interpreter's
# switch, CODA_JAX_PALLAS_INTERPRET, is read by coda_jax.pallas.interpret (it must be set before
# JAX starts its CPU thread pool).
ENVIRONMENT: dict[str, str] = {
    "CODA_JAX_BACKEND": "backend",
    "CODA_JAX_ALLOW_FALLBACK": "allow_fallback",
    "CODA_JAX_KERNEL_CACHE_DIR": "kernel_cache.directory",
    "CODA_JAX_KERNEL_CACHE_WORKERS": "kernel_cache.workers",
}
INTERPRET_ENV = "CODA_JAX_PALLAS_INTERPRET"


# ----------------------------------------------------------------------------- checks ----


def _field_type(group: str | None, name: str) -> Any:
    cls = GROUPS[group] if group else Options
    return typing.get_type_hints(cls)[name]


def _describe(tp: Any) -> str:
    parts = []
    for t in _alternatives(tp):
        if typing.get_origin(t) is Literal:
            parts.extend(repr(a) for a in typing.get_args(t))
        elif t is bool:
            parts.append("True/False")
        elif t in (int, float):
            parts.append("a number >= 0" if t is float else "an integer >= 0")
        elif typing.get_origin(t) in (Mapping, dict):
            parts.append("{program: max giga-m*n*k or None}")
        elif typing.get_origin(t) is tuple:
            parts.append("a tuple of file paths")
        elif t is str:
            parts.append("a path")
    return ", ".join(parts)


def _alternatives(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [t for t in typing.get_args(tp) if t is not type(None)]
    return [tp]


def _check_value(path: str, tp: Any, value: Any) -> Any:
    """``value`` if it fits field type ``tp`` (normalized: mappings to dicts, lists to tuples),
    else an :class:`OptionError` naming ``path`` and the rule."""
    for t in _alternatives(tp):
        origin = typing.get_origin(t)
        if origin is Literal and isinstance(value, str) and value in typing.get_args(t):
            return value
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
        if t is str and isinstance(value, str) and value:
            return value
        if origin is tuple and isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        if origin in (Mapping, dict) and isinstance(value, Mapping):
            out = {}
            for k, cap in value.items():
                if not isinstance(k, str) or not (cap is None or (isinstance(cap, (int, float))
                                                               and not isinstance(cap, bool) and cap > 0)):
                    break
                out[k] = None if cap is None else float(cap)
            else:
                return out
    raise OptionError(f"coda_jax option {path} must be one of: {_describe(tp)}; got {value!r}")


def _check_group(name: str, value: Any) -> Any:
    cls = GROUPS[name]
    if isinstance(value, Mapping):
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise OptionError(f"coda_jax option {name} has no field {sorted(unknown)[0]!r} "
                              f"(its fields: {', '.join(f.name for f in dataclasses.fields(cls))})")
        value = cls(**value)
    if not isinstance(value, cls):
        raise OptionError(f"coda_jax option {name} must be a coda_jax.{cls.__name__} or a mapping of its fields, "
                          f"got {type(value).__name__}")
    changes = {}
    for f in dataclasses.fields(cls):
        v = getattr(value, f.name)
        if v is not None:
            changes[f.name] = _check_value(f"{name}.{f.name}", _field_type(name, f.name), v)
    return cls(**changes)


def _checked(kwargs: Mapping[str, Any]) -> Options:
    """An :class:`Options` layer from keyword overrides (groups as dataclasses or mappings)."""
    top = {f.name for f in dataclasses.fields(Options)}
    out = {}
    for key, value in kwargs.items():
        if key not in top:
            raise OptionError(f"unknown coda_jax option {key!r} (the options: {', '.join(sorted(top))})")
        if key in GROUPS:
            out[key] = _check_group(key, value)
        elif value is not None:
            out[key] = _check_value(key, _field_type(None, key), value)
    return Options(**out)


# ----------------------------------------------------------------------------- parser ----
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_scalar(path: str, tp: Any, text: str) -> Any:
    """One option value from text, by its field's type."""
    raw = text.strip()
    low = raw.lower()
    for t in _alternatives(tp):
        origin = typing.get_origin(t)
        if origin is Literal and low in typing.get_args(t):
            return low
        if t is bool and low in _TRUE + _FALSE:
            return low in _TRUE
        if t is int and low.isdigit():
            return int(low)
        if t is float:
            try:
                return float(low)
            except ValueError:
                pass
        if origin in (Mapping, dict):
            return _parse_programs(path, raw)
        if origin is tuple and raw:
            return tuple(p for p in raw.split(os.pathsep) if p)
        if t is str and raw:
            return raw
    raise OptionError(f"coda_jax option {path} must be one of: {_describe(tp)}; got {text!r}")


def _parse_programs(path: str, text: str) -> dict[str, float | None]:
    """``"rms_rope+rms_dgrad_res<64"`` -> ``{"rms_rope": None, "rms_dgrad_res": 64.0}``;
    ``""``/``"none"`` -> ``{}`` (``+`` separates the items: the overrides are comma-separated)."""
    out: dict[str, float | None] = {}
    if text.strip().lower() in ("", "none"):
        return out
    for item in text.split("+"):
        name, _, cap = item.strip().partition("<")
        try:
            out[name.strip()] = float(cap) if cap.strip() else None
        except ValueError:
            name = ""
        if not name.strip():
            raise OptionError(f"coda_jax option {path}: {item.strip()!r} must be 'program' or 'program<N' "
                              f"(N: the largest m*n*k in units of 2^30), items joined by '+'")
    return out


def parse_overrides(text: str | Mapping[str, str], *, source: str = "") -> dict[str, Any]:
    """Keyword arguments for :func:`options` / :func:`set_options` from ``"path=value"`` items
    (comma-separated, or a mapping), e.g.
    ``"backend=pallas,routing.xla_output_below=0,cross_entropy.save_logits=false"``.

    ``source`` (e.g. ``"--runs"``) prefixes errors, which name the option and its rule."""
    items = (list(text.items()) if isinstance(text, Mapping)
             else [tuple(p.split("=", 1)) if "=" in p else (p, None) for p in text.split(",") if p.strip()])
    groups: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    where = f"{source}: " if source else ""
    for path, value in items:
        path = path.strip()
        if value is None:
            raise OptionError(f"{where}{path!r} must be 'option=value'")
        group, _, name = path.rpartition(".")
        try:
            if group:
                if group not in GROUPS or name not in {f.name for f in dataclasses.fields(GROUPS[group])}:
                    raise OptionError(f"unknown coda_jax option {path!r}")
                groups.setdefault(group, {})[name] = _parse_scalar(path, _field_type(group, name), value)
            else:
                if name not in {f.name for f in dataclasses.fields(Options)} or name in GROUPS:
                    raise OptionError(f"unknown coda_jax option {path!r}")
                top[name] = _parse_scalar(path, _field_type(None, name), value)
        except OptionError as e:
            raise OptionError(f"{where}{e}") from None
    out = dict(top)
    for g, fields in groups.items():
        out[g] = GROUPS[g](**fields)
    _checked(out)  # the same checks as a Python call
    return out


def _environment_layer() -> Options:
    """The layer :data:`ENVIRONMENT` gives (read on every resolution: cheap, and a test or a
    launcher may set a variable after import)."""
    found = {}
    for var, path in ENVIRONMENT.items():
        text = os.environ.get(var, "").strip()
        if text:
            found[path] = text
    if not found:
        return _EMPTY
    try:
        return _checked(parse_overrides(found))
    except OptionError as e:
        var = next(v for v, p in ENVIRONMENT.items() if p in str(e))
        raise OptionError(f"${var}={os.environ[var]!r}: {e}") from None


# ----------------------------------------------------------------------------- layers ----
_EMPTY = Options()
_context: contextvars.ContextVar[tuple[Options, ...]] = contextvars.ContextVar("coda_jax_options", default=())
_process: Options = _EMPTY


def _merge(base: Options, top: Options) -> Options:
    """``base`` with every field ``top`` sets (groups merged field by field)."""
    changes = {}
    for f in dataclasses.fields(Options):
        v = getattr(top, f.name)
        if f.name in GROUPS:
            set_fields = {g.name: getattr(v, g.name) for g in dataclasses.fields(v) if getattr(v, g.name) is not None}
            if set_fields:
                changes[f.name] = dataclasses.replace(getattr(base, f.name), **set_fields)
        elif v is not None:
            changes[f.name] = v
    return dataclasses.replace(base, **changes) if changes else base


class options:  # noqa: N801  (used as a function: ``with coda_jax.options(...)``)
    """Sets options for the ops traced inside the ``with`` block (innermost wins, field by
    field); ``__enter__`` returns the options then in force. Keywords: the fields of
    :class:`Options` (groups as their dataclass or a mapping of its fields), checked when
    this is called, before the block."""

    def __init__(self, **overrides: Any):
        self._layer = _checked(overrides)
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> Options:
        self._tokens.append(_context.set(_context.get() + (self._layer,)))
        return current_options()

    def __exit__(self, *exc) -> None:
        _context.reset(self._tokens.pop())


def set_options(**overrides: Any) -> None:
    """Sets options process-wide (under any :func:`options` context), merged field by field
    into what :func:`set_options` set before. :func:`reset_options` clears them."""
    global _process
    _process = _merge(_process, _checked(overrides))


def reset_options(*paths: str) -> None:
    """Clears the process-wide options that :func:`set_options` set: those named (``"backend"``,
    ``"mesh.fsdp_split"``, a whole group ``"routing"``), or all of them."""
    global _process
    if not paths:
        _process = _EMPTY
        return
    for path in paths:
        group, _, name = path.partition(".")
        valid = group in GROUPS and (not name or name in {f.name for f in dataclasses.fields(GROUPS[group])})
        if not (valid or (not name and group in {f.name for f in dataclasses.fields(Options)})):
            raise OptionError(f"unknown coda_jax option {path!r}")
        if group in GROUPS:
            cleared = GROUPS[group]() if not name else dataclasses.replace(getattr(_process, group), **{name: None})
            _process = dataclasses.replace(_process, **{group: cleared})
        else:
            _process = dataclasses.replace(_process, **{group: None})


def current_options() -> Options:
    """The options in force here, every field resolved (contexts, process, environment,
    defaults)."""
    resolved = _merge(DEFAULTS, _environment_layer())
    resolved = _merge(resolved, _process)
    for layer in _context.get():
        resolved = _merge(resolved, layer)
    return resolved


def is_set(path: str) -> bool:
    """Whether option ``path`` (``"mesh.fsdp_split"``) is set by a context, the process or the
    environment, rather than left to its default."""
    group, _, name = path.rpartition(".")
    layers = (_environment_layer(), _process, *_context.get())
    for layer in layers:
        v = getattr(getattr(layer, group), name) if group else getattr(layer, name)
        if v is not None:
            return True
    return False
