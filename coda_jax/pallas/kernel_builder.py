"""The compiled Pallas kernel of one GEMM-epilogue program, as the ``"pallas"`` backend calls it.

:func:`compiled_kernel` is what :class:`~coda_jax.pallas.lowering.PallasLowering` runs and
what a kernel-cache worker (:mod:`coda_jax.pallas.kernel_workers`) exports: both build the
same kernel from the same arguments, so an entry a worker writes is the kernel the lowering
would have made.
"""

from __future__ import annotations

import functools

import jax

from coda_jax.epilogue import Epilogue
from coda_jax.lowering import with_latency_hint
from coda_jax.pallas.gemm_epilogue import KernelShape, ProfileSettings, build_kernel
from coda_jax.pallas.tuning import TuningConfig


@functools.lru_cache(maxsize=256)
def compiled_kernel(epi: Epilogue, shape: KernelShape, cfg: TuningConfig, interpret: bool, load_dtypes,
                    latency_ns: int | None = None, profile: ProfileSettings | None = None):
    """The kernel as a callable; ``latency_ns``: the estimate XLA's scheduler is given
    (:func:`coda_jax.lowering.with_latency_hint`), or None for none; ``profile``: record its
    timeline (:class:`coda_jax.pallas.gemm_epilogue.ProfileSettings`), or None."""
    kernel = build_kernel(epi, shape, cfg, interpret, load_dtypes, profile)
    # Compiled: one jitted function per distinct kernel, so a model that calls the same
    # kernel in every layer carries one copy of its Mosaic GPU module in the StableHLO, not
    # one per call (smaller modules, faster compiles: docs/performance.md#compile-time).
    # Interpreted: not wrapped; the interpreter's IO callbacks dispatch JAX ops of their own,
    # which deadlocked under an eager call of the jitted kernel
    # (tests/test_ops_pallas.py::test_vmap_pallas).
    if interpret:
        return kernel
    if latency_ns is not None:  # the scheduler is told what the kernel costs
        kernel = with_latency_hint(kernel, latency_ns)
    return jax.jit(kernel)
