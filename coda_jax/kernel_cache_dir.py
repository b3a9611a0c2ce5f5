"""Where coda-jax's kernel caches live, for both kernel backends, and how their entries sit on disk.

The Pallas kernel cache (:mod:`coda_jax.pallas.kernel_cache`) keeps its entries in this
directory, the CuTeDSL kernel cache (:mod:`coda_jax.ffi.kernel_cache`) in its ``cutedsl``
subdirectory. One option chooses both: ``kernel_cache.directory`` (docs/compile_cache.md).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import jax

from coda_jax.options import current_options

JAX_CACHE_SUBDIR = "coda_jax_kernels"  # the default directory, inside JAX's persistent cache dir
OFF = ("off", "0", "false", "none")


def default_directory() -> str | None:
    """The kernel caches' directory, or None (off):

    1. the option ``kernel_cache.directory`` (``$CODA_JAX_KERNEL_CACHE_DIR``) unless it is
       ``"default"``; ``off``, ``0``, ``false`` or ``none``: no cache;
    2. else ``<JAX's persistent cache dir>/coda_jax_kernels`` when JAX's persistent
       compilation cache is on in a local directory;
    3. else ``$XDG_CACHE_HOME/coda_jax/kernels`` (``~/.cache/coda_jax/kernels``), as Triton
       keeps its kernels in ``~/.triton/cache``.
    """
    chosen = current_options().kernel_cache.directory
    if chosen != "default":
        return None if chosen.lower() in OFF else chosen
    jax_dir = None
    try:
        if jax.config.jax_enable_compilation_cache:
            jax_dir = jax.config.jax_compilation_cache_dir
    except AttributeError:  # a jax without these options
        pass
    if jax_dir and "://" not in str(jax_dir):  # (a remote JAX cache, gs://...: not written by coda-jax)
        return os.path.join(os.path.expanduser(str(jax_dir)), JAX_CACHE_SUBDIR)
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "coda_jax", "kernels")


def gpu_arch() -> str:
    """The default device's compute capability (the kernels are built for it), or ``none``."""
    try:
        return str(getattr(jax.local_devices()[0], "compute_capability", "none"))
    except RuntimeError:
        return "none"


def writable(directory: Path, title: str, without: str) -> bool:
    """Makes ``directory`` and says whether a cache can write its entries there; if not (a
    read-only or foreign directory), warns: ``title`` names the cache, ``without`` what the
    process does instead."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        ok, reason = os.access(directory, os.W_OK | os.X_OK), "not writable"
    except OSError as err:
        ok, reason = False, str(err)
    if not ok:
        warnings.warn(f"{title}: cannot write to {directory} ({reason}); {without} (set the option "
                      "kernel_cache.directory or $CODA_JAX_KERNEL_CACHE_DIR to another directory, or to 'off')",
                      RuntimeWarning, stacklevel=5)
    return ok


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Writes one entry through ``write(file)`` so that a reader never sees a partial file
    (a temporary file in the same directory, renamed; removed if writing fails)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def describe_entries(directory: str | os.PathLike, suffix: str) -> dict[str, Any]:
    """``{"directory", "entries", "bytes"}`` of the files ending in ``suffix`` in a cache
    directory (missing: 0 entries)."""
    d = Path(directory).expanduser()
    files = list(d.glob(f"*{suffix}")) if d.is_dir() else []
    return {"directory": str(d), "entries": len(files), "bytes": sum(f.stat().st_size for f in files)}


def clear_entries(directory: str | os.PathLike, suffix: str) -> int:
    """Removes a cache directory's entries (files ending in ``suffix``) and leftover temporary
    files; returns how many entries it removed. Other files are left alone."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        return 0
    entries = list(d.glob(f"*{suffix}"))
    for f in [*entries, *d.glob("*.tmp")]:
        f.unlink(missing_ok=True)
    return len(entries)
