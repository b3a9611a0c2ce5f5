"""One process of tests/test_kernel_cache.py: lowers one Pallas kernel for CUDA (no GPU
needed) and prints, as JSON, a digest of each Mosaic GPU custom call's module and the
kernel cache's counters. Run fresh each time, so that Mosaic GPU's per-process kernel
counter (part of the module) starts from zero in every process.

    python tests/kernel_cache_probe.py [CACHE_DIR]     (no CACHE_DIR: the cache is off)
"""

import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.pallas import kernel_cache
from coda_jax.pallas.lowering import PallasLowering

MODULE = re.compile(r'module = "((?:[^"\\]|\\.)*)"')


def module_digests(text: str) -> list[str]:
    """SHA-256 of each ``mosaic_gpu`` custom call's module in a lowered StableHLO text."""
    return [hashlib.sha256(m.encode()).hexdigest() for m in MODULE.findall(text)]


def main() -> None:
    cache = kernel_cache.enable_kernel_cache(sys.argv[1]) if len(sys.argv) > 1 else None
    if cache is None:
        kernel_cache.disable_kernel_cache()
    m, n, k = 512, 256, 128
    epi = programs.RESIDUAL_RMS
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16),
            {"residual": jax.ShapeDtypeStruct((m, n), jnp.bfloat16), "gamma": jax.ShapeDtypeStruct((n,), jnp.float32)})
    low = PallasLowering(plain_gemm="pallas")
    f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    stats = vars(cache.stats) if cache is not None else None
    print(json.dumps({"modules": module_digests(text), "calls": text.count("@mosaic_gpu_v2"), "stats": stats}))


if __name__ == "__main__":
    main()
