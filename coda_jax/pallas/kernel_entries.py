"""One entry of the Pallas kernel cache: a kernel exported for CUDA, and its file.

Written by the cache (:mod:`coda_jax.pallas.kernel_cache`) and by its worker processes
(:mod:`coda_jax.pallas.kernel_workers`), read by the cache. An entry is a pickle of
``{"format", "key", "exported"}`` named ``<key>.kernel.pkl``, written atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path

import jax

from coda_jax.kernel_cache_dir import write_atomically

# The Mosaic GPU custom call has no export compatibility guarantee: entries are keyed by the
# exact jax / jaxlib versions, so one is only ever read by the versions that wrote it.
CUSTOM_CALL = "mosaic_gpu_v2"
FORMAT = 1  # bump when the entry layout changes


ENTRY_SUFFIX = ".kernel.pkl"


def entry_path(directory: Path, key: str) -> Path:
    return directory / f"{key}{ENTRY_SUFFIX}"


def export_kernel(kernel: Callable, avals: Sequence[jax.ShapeDtypeStruct]):
    """``jax.export`` of ``kernel`` at ``avals`` for CUDA, outside any mesh.

    The kernel is lowered on its own (a single-device, unsharded function): inside a
    ``shard_map`` it is then called on each shard's block, as the jitted kernel is.
    """
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), _native_ir():
        return jax.export.export(
            jax.jit(kernel), platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(CUSTOM_CALL)],
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


def write_entry(directory: Path, key: str, exported) -> None:
    """Writes one entry atomically (a reader never sees a partial file)."""
    directory.mkdir(parents=True, exist_ok=True)
    # The VJP hook is a closure (not picklable) and never used: the ops have custom VJPs.
    entry = {"format": FORMAT, "key": key, "exported": dataclasses.replace(exported, _get_vjp=None)}
    write_atomically(entry_path(directory, key), lambda f: pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL))


def read_entry(directory: Path, key: str):
    """The :class:`jax.export.Exported` of entry ``key``, or None where there is no such
    file; raises where the file is not an entry of this format and key."""
    path = entry_path(directory, key)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        entry = pickle.load(f)
    if entry.get("format") != FORMAT or entry.get("key") != key:
        raise ValueError("entry of another format or key")
    exported = entry["exported"]
    if not isinstance(exported, jax.export.Exported):
        raise TypeError(f"entry holds {type(exported).__name__}, not jax.export.Exported")
    return exported
