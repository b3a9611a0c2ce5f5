"""A disk cache of the Pallas kernels' lowered Mosaic GPU modules (opt-in).

Why. JAX's persistent compilation cache is looked up *after* lowering, and lowering a Pallas
Mosaic-GPU kernel runs Mosaic GPU's code generation in Python (its layout inference and
dialect lowering, about a second per distinct kernel). The 1B train step has 11-14
distinct kernels, so a process that finds every XLA executable in JAX's cache still spends
~10 s lowering them (benchmarks/RESULTS.md: warm-cache first step 14.6 s on ``pallas``
against 2.4 s for the plain JAX step, H100).

How. Each distinct kernel (program, padded shape, planned :class:`TuningConfig`, operand and
load dtypes) is exported once with :func:`jax.export.export` for CUDA; the
:class:`jax.export.Exported` (its StableHLO holds the kernel's ``mosaic_gpu`` custom call,
already generated) is pickled under the cache directory. A later trace of the same kernel
loads it and calls it instead of lowering the kernel again; the step's StableHLO then
carries the same custom call, byte for byte, in every process, so JAX's persistent cache
can hit too. The key is a SHA-256 of the kernel's jaxpr (so an edit of a kernel or of an
epilogue body is a new key), its argument types, the planned configuration, the GPU
architecture and the jax / jaxlib / coda-jax versions.

Use. Set ``CODA_JAX_KERNEL_CACHE_DIR=/path`` (read when a kernel is traced), or call
:func:`enable_kernel_cache` / :func:`disable_kernel_cache`. Never used in interpret mode.
The entries are pickles: point the cache only at a directory you trust, as with any
pickle. A stale or unreadable entry is reported (``RuntimeWarning``) and re-exported.

Status: on the CPU the cached kernels lower for CUDA to the same custom calls as the
uncached ones (tests/test_kernel_cache.py); the cache has not yet run on a GPU (no device
time was left in the session that wrote it), so it stays off unless asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

ENV_DIR = "CODA_JAX_KERNEL_CACHE_DIR"
# The Mosaic GPU custom call has no export compatibility guarantee: entries are keyed by the
# exact jax / jaxlib versions, so one is only ever read by the versions that wrote it.
_CUSTOM_CALL = "mosaic_gpu_v2"
_FORMAT = 1  # bump when the entry layout changes


@dataclasses.dataclass
class CacheStats:
    """Counts since the cache was enabled: kernels found on disk, exported, written, and
    entries that could not be read."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    bad_entries: int = 0


class KernelCache:
    """Exported kernels on disk under ``directory``, and in memory for this process."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        self.stats = CacheStats()
        self._memo: dict[Any, Callable] = {}
        self._lock = threading.Lock()

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.kernel.pkl"

    def callable_for(self, kernel: Callable, ident: tuple, args: Sequence[Any]) -> Callable:
        """A function that computes ``kernel(*args)`` from the cached export.

        ``ident``: hashable facts that determine the kernel (program, shape, config, dtypes);
        with the argument types it keys the in-memory memo. The disk key adds the kernel's
        jaxpr and the versions (:func:`kernel_key`).
        """
        avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)
        memo_key = (ident, avals)
        with self._lock:
            fn = self._memo.get(memo_key)
        if fn is not None:
            return fn
        key = kernel_key(kernel, ident, avals)
        exported = self._load(key)
        if exported is None:
            exported = export_kernel(kernel, avals)
            self.stats.misses += 1
            self._store(key, exported)
        else:
            self.stats.hits += 1
        fn = _with_batching_fallback(jax.jit(exported.call), kernel)
        with self._lock:
            self._memo[memo_key] = fn
        return fn

    def contains(self, kernel: Callable, ident: tuple, args: Sequence[Any]) -> bool:
        avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)
        return self.path_for(kernel_key(kernel, ident, avals)).is_file()

    def _load(self, key: str):
        path = self.path_for(key)
        if not path.is_file():
            return None
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if entry.get("format") != _FORMAT or entry.get("key") != key:
                raise ValueError("entry of another format or key")
            exported = entry["exported"]
            if not isinstance(exported, jax.export.Exported):
                raise TypeError(f"entry holds {type(exported).__name__}, not jax.export.Exported")
            return exported
        except Exception as err:  # noqa: BLE001 - any unreadable entry is re-exported
            self.stats.bad_entries += 1
            warnings.warn(f"coda-jax kernel cache: ignoring unreadable entry {path} ({err}); exporting the "
                          "kernel again", RuntimeWarning, stacklevel=3)
            return None

    def _store(self, key: str, exported) -> None:
        self.store_entry(self.directory, key, exported)
        self.stats.writes += 1

    @staticmethod
    def store_entry(directory: Path, key: str, exported) -> None:
        """Writes one entry atomically (a reader never sees a partial file)."""
        directory.mkdir(parents=True, exist_ok=True)
        # The VJP hook is a closure (not picklable) and never used: the ops have custom VJPs.
        entry = {"format": _FORMAT, "key": key, "exported": dataclasses.replace(exported, _get_vjp=None)}
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, directory / f"{key}.kernel.pkl")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _with_batching_fallback(cached: Callable, kernel: Callable) -> Callable:
    """``cached`` (the exported kernel, jitted: every call site of a kernel shares one
    lowered function in the step's StableHLO, as the uncached jitted kernel does, not one
    copy per layer), and under ``jax.vmap`` the kernel itself: an exported call has no
    batching rule, the Pallas kernel has one (a vmapped kernel is generated, not cached)."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return cached(*args)

    @call.def_vmap
    def _batched(axis_size, in_batched, *args):
        out = jax.vmap(kernel, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return call


def export_kernel(kernel: Callable, avals: Sequence[jax.ShapeDtypeStruct]):
    """``jax.export`` of ``kernel`` at ``avals`` for CUDA, outside any mesh.

    The kernel is lowered on its own (a single-device, unsharded function): inside a
    ``shard_map`` it is then called on each shard's block, as the jitted kernel is.
    """
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), _native_ir():
        return jax.export.export(
            jax.jit(kernel), platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_CUSTOM_CALL)],
        )(*avals)


def _native_ir():
    """Export lowers Mosaic GPU kernels to a forward-compatible IR version by default; the
    entries are only read by the jax version that wrote them, so keep the IR the jitted
    kernel gets (the same custom call, byte for byte, as without the cache)."""
    try:
        from jax._src import config as jax_config

        return jax_config.export_ignore_forward_compatibility(True)
    except (ImportError, AttributeError):  # a jax without the option: the portable IR
        return contextlib.nullcontext()


def _gpu_arch() -> str:
    """The default device's compute capability (Mosaic GPU lowers for it), or ``none``."""
    try:
        return str(getattr(jax.devices()[0], "compute_capability", "none"))
    except RuntimeError:
        return "none"


def kernel_key(kernel: Callable, ident: tuple, avals: Sequence[jax.ShapeDtypeStruct]) -> str:
    """The entry's name: SHA-256 of the kernel's jaxpr, ``ident``, the argument types,
    the GPU architecture and the library versions."""
    import jaxlib

    import coda_jax

    jaxpr = jax.make_jaxpr(kernel)(*avals)
    parts = [f"format={_FORMAT}", f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}",
             f"coda_jax={coda_jax.__version__}", f"arch={_gpu_arch()}", repr(_stable(ident)),
             repr([(tuple(a.shape), str(a.dtype)) for a in avals]), str(jaxpr)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _stable(x):
    """``x`` with every epilogue replaced by its name (an epilogue's repr names its body
    function's address, which differs between processes; the jaxpr holds the body's math)."""
    from coda_jax.epilogue import Epilogue

    if isinstance(x, Epilogue):
        return f"epilogue:{x.name}"
    if isinstance(x, tuple):
        return tuple(_stable(v) for v in x)
    return x


_active: KernelCache | None = None
_env_seen: str | None = None


def enable_kernel_cache(directory: str | os.PathLike) -> KernelCache:
    """Turns the cache on for this process, in ``directory`` (created on first write)."""
    global _active
    _active = KernelCache(directory)
    return _active


def disable_kernel_cache() -> None:
    """Turns the cache off (``$CODA_JAX_KERNEL_CACHE_DIR`` is then ignored until it changes)."""
    global _active, _env_seen
    _active = None
    _env_seen = os.environ.get(ENV_DIR) or None


def active_kernel_cache() -> KernelCache | None:
    """The cache in use: the one :func:`enable_kernel_cache` set, or one in
    ``$CODA_JAX_KERNEL_CACHE_DIR`` (when the variable changes), or None."""
    global _active, _env_seen
    env = os.environ.get(ENV_DIR) or None
    if env != _env_seen:
        _env_seen = env
        _active = KernelCache(env) if env else None
    return _active
