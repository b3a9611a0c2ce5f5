"""One process of tests/test_kernel_cache.py: lowers Pallas kernels for CUDA (no GPU
needed) and prints, as JSON, a digest of each Mosaic GPU custom call's module, the number
of kernel call sites and the kernel cache's counters. Each run is a fresh process: Mosaic
GPU numbers the kernels it generates in a process (the number is part of the module), and
JAX's trace caches would otherwise keep an earlier trace's kernels.

    python tests/kernel_cache_probe.py CASE [CACHE_DIR]     (no CACHE_DIR: the cache is off)

CASE: ``one_kernel`` (a residual + RMS GEMM) or ``swiglu_step`` (``swiglu_mlp``'s
forward and backward kernels under ``jax.grad(jax.checkpoint(...))``) or
``swiglu_step_vmap`` (the same under ``jax.vmap``). Workers: ``$CODA_JAX_KERNEL_CACHE_WORKERS``.
"""

import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

from suite_options import apply_suite_options  # tests/suite_options.py: the suite's routing options

apply_suite_options()
MODULE = re.compile(r'module = "((?:[^"\\]|\\.)*)"')
BF = jnp.bfloat16


def module_digests(text: str) -> list[str]:
    """SHA-256 of each ``mosaic_gpu`` custom call's module in a lowered StableHLO text."""
    return [hashlib.sha256(m.encode()).hexdigest() for m in MODULE.findall(text)]


def residual_rms_args(m=512, n=256, k=128):
    """Abstract operands and loads of a residual + RMS GEMM (``programs.RESIDUAL_RMS``)."""
    return (jax.ShapeDtypeStruct((m, k), BF), jax.ShapeDtypeStruct((k, n), BF),
            {"residual": jax.ShapeDtypeStruct((m, n), BF), "gamma": jax.ShapeDtypeStruct((n,), jnp.float32)})


def one_kernel():
    from coda_jax import programs
    from coda_jax.pallas.lowering import PallasLowering

    low = PallasLowering(plain_gemm="kernel")
    return jax.jit(lambda a, b, l: low.gemm(programs.RESIDUAL_RMS, a, b, l)), residual_rms_args()


def swiglu_step(vmap: bool):
    import coda_jax as cj
    from coda_jax import backend as B

    real = B.backend_unavailable_reason
    B.backend_unavailable_reason = lambda n: None if n == "pallas" else real(n)  # lowering needs no GPU

    def loss(x, g, w, w_down):
        y, _ = cj.swiglu_mlp(x, g, w, w_down, g, backend="pallas")
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2, 3))
    x = jax.ShapeDtypeStruct((2, 128, 128) if vmap else (256, 128), BF)
    if vmap:
        step = jax.vmap(step, in_axes=(0, None, None, None))
    args = (x, jax.ShapeDtypeStruct((128,), BF), jax.ShapeDtypeStruct((128, 512), BF),
            jax.ShapeDtypeStruct((256, 128), BF))
    return jax.jit(step), args


CASES = {"one_kernel": one_kernel, "swiglu_step": lambda: swiglu_step(False),
         "swiglu_step_vmap": lambda: swiglu_step(True)}


def main() -> None:
    from coda_jax.pallas import kernel_cache

    case, cache_dir = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    cache = kernel_cache.enable_kernel_cache(cache_dir) if cache_dir else None
    if cache is None:
        kernel_cache.disable_kernel_cache()
    fn, args = CASES[case]()
    lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    if cache is not None:
        cache.wait()
    # The step without debug info: what JAX's persistent compilation cache keys on.
    step = hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()
    # Whether the step's results come back committed to a device (then the next call of a
    # jitted step on them would trace again): as without the cache.
    committed = lowered._lowering.compile_args["committed"]
    print(json.dumps({"modules": module_digests(text), "calls": text.count("@mosaic_gpu_v2"), "step": step,
                      "committed": committed,
                      "stats": vars(cache.stats) if cache is not None else None,
                      "workers_started": bool(cache is not None and cache._pool is not None)}))


if __name__ == "__main__":
    main()
