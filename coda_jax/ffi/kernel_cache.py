"""A disk cache of the CuTeDSL kernels' compiled objects (on by default, beside the Pallas one).

Why. ``cutlass_call`` compiles each CuTeDSL kernel while JAX lowers the step: the DSL builds
the kernel's MLIR in Python and compiles it, one to three seconds a kernel. It compiles through
``cute.compile``, which bypasses CuTeDSL's own file cache (``CUTE_DSL_CACHE_DIR``), and keeps
what it compiled in memory only, keyed also by the process's whole environment. Without this
cache every process compiles every kernel again, before JAX's persistent cache is asked.

How. coda-jax's calls carry the compile key ``("coda_jax.ffi", epilogue, plan, body_key)``
(:mod:`coda_jax.ffi.lowering`). :func:`install` wraps cutlass.jax's compile step
(``cutlass.jax.primitive.get_or_compile_kernel``); for those keys the compiled object (the
bytes XLA's FFI call loads) is read from ``<key>.cutedsl.bin`` when present, else compiled
and written there. Other keys, and everything while the cache is off, pass through unchanged.
The key is a SHA-256 of the entry format, the coda-jax, jax and nvidia-cutlass-dsl versions,
the kernel generator's source (``coda_jax/ffi/*.py``, ``coda_jax/epilogue.py``), the
architecture CuTeDSL compiles for and its ``CUTE_DSL_*`` settings, the epilogue's declaration
and its body's jaxpr with its constants (``body_key``), the kernel plan and the call's argument
and result specs.

Where: ``<kernel cache directory>/cutedsl`` (:func:`coda_jax.kernel_cache_dir.default_directory`:
the option ``kernel_cache.directory``, ``"off"`` turns it off). An entry is raw bytes behind a
header and a checksum (nothing is unpickled). A bad entry is reported (``RuntimeWarning``),
compiled again and rewritten; a directory that cannot be written is reported once and the
kernels are then compiled in the process, as without the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import struct
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np

import coda_jax
from coda_jax.epilogue import Epilogue
from coda_jax.kernel_cache_dir import (clear_entries, default_directory, describe_entries, gpu_arch, write_atomically,
                                       writable)

SUBDIR = "cutedsl"
KEY_TAG = "coda_jax.ffi"  # the first item of every compile key coda-jax passes to cutlass_call
_MAGIC = b"coda-jax cutedsl kernel 1\n"  # bump the number when the entry layout or key changes
_SUFFIX = ".cutedsl.bin"
_SOURCES = ("ffi/*.py", "epilogue.py")  # the kernel generator, relative to the package


@dataclasses.dataclass
class CacheStats:
    """Counts since the cache was made: kernels read from disk, compiled here, entries
    written, and entries that could not be read (compiled again)."""

    hits: int = 0
    misses: int = 0
    writes: int = 0
    bad_entries: int = 0


def body_key(traced) -> str:
    """A SHA-256 of an epilogue body as traced for the kernel (a
    :class:`~coda_jax.ffi.interpret.TracedBody`): its jaxpr, its constants' values (a jaxpr
    prints constants by name only) and the meaning of its inputs and outputs."""
    h = hashlib.sha256()
    h.update(f"{traced.jaxpr}\n{traced.inputs!r}\n{traced.outputs!r}\n{traced.shape!r}".encode())
    for c in traced.jaxpr.consts:
        a = np.asarray(c)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _declaration(epi: Epilogue) -> str:
    """The epilogue without its body (whose repr names a function's address; body_key holds its math)."""
    return repr((epi.name, epi.loads, epi.outputs, epi.pair_block, epi.uses_col_index, epi.half_acc, epi.linear,
                 epi.reads_acc))


@functools.cache
def _source_hash() -> str:
    root = Path(coda_jax.__file__).parent
    h = hashlib.sha256()
    for path in sorted(p for pattern in _SOURCES for p in root.glob(pattern)):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _dsl_version() -> str:
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:  # unpacked on PYTHONPATH (benchmarks/gpu_common.sh)
        import cutlass

        return f"cutlass={getattr(cutlass, '__version__', 'unknown')}:{Path(cutlass.__file__).parent}"


def _spec_description(spec) -> str:
    """cutlass.jax's ``FunctionSpec`` of a call, as text that is the same in every process."""
    def args(items):
        return [(a.idx, tuple(a.shape), str(np.dtype(a.dtype)), repr(a.spec)) for a in items]

    return repr((args(spec.in_args), str(spec.input_tree), args(spec.out_args), str(spec.output_tree),
                 spec.input_output_aliases, repr(spec.input_spec), repr(spec.output_spec), spec.compile_options,
                 spec.use_static_tensors, repr(spec.kwargs)))


def entry_key(compile_key: tuple, spec) -> str:
    """The entry's name for one of coda-jax's calls (``compile_key``, see the module docstring)."""
    _, epilogue, plan, body = compile_key
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("CUTE_DSL_") and k != "CUTE_DSL_CACHE_DIR")
    parts = [_MAGIC.decode().strip(), f"coda_jax={coda_jax.__version__}", f"jax={jax.__version__}",
             f"dsl={_dsl_version()}", f"source={_source_hash()}", f"arch={gpu_arch()}", repr(settings),
             _declaration(epilogue), repr(plan), body, _spec_description(spec)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def ours(compile_key: Any) -> bool:
    """Whether ``compile_key`` is one that coda-jax's CuTeDSL lowering passes."""
    return isinstance(compile_key, tuple) and len(compile_key) == 4 and compile_key[0] == KEY_TAG


class CuteKernelCache:
    """Compiled CuTeDSL kernels on disk under ``directory``, and in memory for this process."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory).expanduser()
        self.stats = CacheStats()
        self._memo: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._can_write: bool | None = None  # checked on the first miss

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def module_for(self, compile_key: tuple, spec, compile_module) -> bytes:
        """The compiled object of one call: from memory, from disk, or ``compile_module()``
        (then written)."""
        key = entry_key(compile_key, spec)
        with self._lock:
            module = self._memo.get(key)
        if module is None:
            module = self._read(key)
            if module is not None:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                module = compile_module()
                self._write(key, module)
            with self._lock:
                self._memo[key] = module
        return module

    def _read(self, key: str) -> bytes | None:
        path = self.path(key)
        head = len(_MAGIC) + 8
        try:
            data = path.read_bytes()
            reason = "not an entry of this format"
        except (FileNotFoundError, NotADirectoryError):  # no entry (or no cache directory) yet
            return None
        except OSError as err:
            data, reason = b"", str(err)
        if data.startswith(_MAGIC) and len(data) >= head + 32:
            (size,) = struct.unpack("<Q", data[len(_MAGIC):head])
            module, digest = data[head:head + size], data[head + size:]
            if len(module) == size and hashlib.sha256(module).digest() == digest:
                return module
            reason = "truncated or corrupted"
        self.stats.bad_entries += 1
        warnings.warn(f"coda-jax CuTeDSL kernel cache: {path} is unreadable ({reason}); compiling the kernel again",
                      RuntimeWarning, stacklevel=2)
        return None

    def _write(self, key: str, module: bytes) -> None:
        if not self._writable():
            return
        data = _MAGIC + struct.pack("<Q", len(module)) + module + hashlib.sha256(module).digest()
        try:
            write_atomically(self.path(key), lambda f: f.write(data))
        except OSError as err:  # a full disk, a directory removed meanwhile: keep going without it
            self._can_write = False
            warnings.warn(f"coda-jax CuTeDSL kernel cache: could not write {self.path(key)} ({err}); not writing "
                          "more entries in this process", RuntimeWarning, stacklevel=3)
            return
        self.stats.writes += 1

    def _writable(self) -> bool:
        if self._can_write is None:
            self._can_write = writable(self.directory, "coda-jax CuTeDSL kernel cache",
                                       "kernels are compiled in this process and not kept")
        return self._can_write


_active: CuteKernelCache | None = None
_active_dir: str | None = None


def active_cache() -> CuteKernelCache | None:
    """The cache in ``<default_directory()>/cutedsl`` (re-made when that changes), or None when off."""
    global _active, _active_dir
    base = default_directory()
    if base != _active_dir:
        _active, _active_dir = (CuteKernelCache(Path(base).expanduser() / SUBDIR) if base else None), base
    return _active


_installed: bool | None = None


def install() -> bool:
    """Wraps cutlass.jax's compile step with the cache (once a process); False, with a
    warning, where this nvidia-cutlass-dsl has no such step (kernels then compile as before)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from cutlass.jax import compile as cute_compile
        from cutlass.jax import primitive

        original = primitive.get_or_compile_kernel
        result_type = cute_compile.CompileResult
    except (ImportError, AttributeError) as err:
        warnings.warn(f"coda-jax CuTeDSL kernel cache: off, this nvidia-cutlass-dsl has no compile step to wrap "
                      f"({err})", RuntimeWarning, stacklevel=2)
        _installed = False
        return False

    @functools.wraps(original)
    def get_or_compile_kernel(fn, spec, *, compile_key=None):
        cache = active_cache() if ours(compile_key) else None
        if cache is None:
            return original(fn, spec, compile_key=compile_key)
        module = cache.module_for(compile_key, spec, lambda: original(fn, spec, compile_key=compile_key).module)
        return result_type(module=module, fingerprint=hashlib.sha256(module).digest(), spec=spec)

    primitive.get_or_compile_kernel = get_or_compile_kernel
    _installed = True
    return True


def describe(directory: str | os.PathLike) -> dict[str, Any]:
    """``{"directory", "entries", "bytes"}`` of a cache directory (missing: 0 entries)."""
    return describe_entries(directory, _SUFFIX)


def clear(directory: str | os.PathLike) -> int:
    """Removes a cache directory's entries (and leftover temporary files); returns how many
    entries it removed."""
    return clear_entries(directory, _SUFFIX)
