"""How much an FP8 GEMM's accumulation loses over a long K, against exact math.

    python -m benchmarks.fp8_accumulation [--ks 2048,8192,32768,131072] [--mn 512]
                                          [--backends xla_fp8,pallas] [--out DIR]

Hopper's FP8 ``wgmma`` accumulates with fewer bits than float32 (TransformerEngine and
DeepSeek-V3 move the partial sum to float32 registers every few MMAs for that reason). This
measures the effect where coda-jax meets it: the wgrad GEMMs (K = tokens) and the FP8 LM
head's dgrad (K = vocabulary).

Per K and input distribution, ``a [M, K]`` and ``b [N, K]`` are random e4m3 tensors (the
inputs are FP8 values, so every product is exact and only the accumulation can err). The
reference is their product in float64 on the host. Rows:

* ``bf16_f32acc``: the same values as bfloat16 (exact: e4m3 fits in bf16), a bf16 dot with a
  float32 output: float32 accumulation where XLA runs it as a bf16 GEMM (on a GPU XLA rewrites a
  dot of FP8 values converted to bf16 into its FP8 GEMM at some sizes: then this row equals
  ``xla_fp8``'s, as at K >= 8192 in run 335);
* ``xla_fp8``: XLA's FP8 GEMM (cuBLASLt on a GPU), float32 output: the plain JAX FP8 baseline's;
* ``xla_fp8_highest``: the same at ``Precision.HIGHEST`` (what the ``xla`` backend runs for a
  promoting GEMM);
* ``<backend>[:promote_k]``: coda-jax's FP8 GEMM on that backend (identity epilogue, float32
  output, on the kernel), its accumulator promoted to float32 every ``promote_k`` K elements
  where given.

With ``--time``, each row's median kernel time (M = N = ``--mn``) beside its error.

Distributions: ``normal`` (zero mean: the partial sums wander like a random walk) and
``positive`` (|normal|: every product adds, the partial sum grows linearly, the worst case for
an accumulator that drops the low bits of small addends). Errors: ``||out - ref|| / ||ref||``
and the largest ``|out - ref|`` over ``rms(ref)``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import coda_jax as cj
from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.fp8 import E4M3, Fp8Tensor
from coda_jax.ops.fp8_gemm import fp8_gemm
from coda_jax.ops.names import FP8_LLAMA_BLOCK

DISTRIBUTIONS = ("normal", "positive")


def fp8_inputs(m: int, n: int, k: int, dist: str, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """``(a [m, k], b [n, k])`` in e4m3: ``dist`` ``normal`` or ``positive`` (its absolute value)."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"dist: {dist!r} is not one of {DISTRIBUTIONS}")
    ka, kb = jax.random.split(jax.random.key(seed + k))
    a = jax.random.normal(ka, (m, k), jnp.float32)
    b = jax.random.normal(kb, (n, k), jnp.float32)
    if dist == "positive":
        a, b = jnp.abs(a), jnp.abs(b)
    return a.astype(E4M3), b.astype(E4M3)


def exact_product(a8: jax.Array, b8: jax.Array) -> np.ndarray:
    """``a @ b.T`` in float64 on the host (each FP8 value and product is exact there)."""
    a = np.asarray(a8.astype(jnp.float32), np.float64)
    b = np.asarray(b8.astype(jnp.float32), np.float64)
    return a @ b.T


def errors(out: jax.Array, ref: np.ndarray) -> dict[str, float]:
    d = np.asarray(out, np.float64) - ref
    rms = float(np.sqrt(np.mean(ref * ref)))
    return {"rel": float(np.linalg.norm(d) / np.linalg.norm(ref)), "max_over_rms": float(np.max(np.abs(d)) / rms)}


def products(backends: list[str]) -> dict:
    """name -> jitted ``f(a8 [M, K], b8 [N, K]) -> [M, N]`` float32."""
    dims = (((1,), (1,)), ((), ()))
    fns = {
        "bf16_f32acc": jax.jit(lambda a, b: jax.lax.dot_general(
            a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims, preferred_element_type=jnp.float32)),
        "xla_fp8": jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)),
        "xla_fp8_highest": jax.jit(lambda a, b: jax.lax.dot_general(
            a, b, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)),
    }
    for spec in backends:
        if spec in fns:
            continue
        name, _, promote = spec.partition(":")  # "pallas:512": promote every 512 K elements
        fns[spec] = jax.jit(functools.partial(_kernel_product, name, int(promote or 0)))
    return fns


def _kernel_product(backend: str, promote_k: int, a8: jax.Array, b8: jax.Array) -> jax.Array:
    """coda-jax's FP8 GEMM ``a8 @ b8.T`` on ``backend``'s kernel (options in force while traced)."""
    one = jnp.ones((), jnp.float32)
    with cj.options(backend=backend, routing=dict(xla_output_below=0, plain_gemm="kernel")):
        lw = lowering_for(FP8_LLAMA_BLOCK, backend)
        return fp8_gemm(lw, programs.IDENTITY, Fp8Tensor(a8, None, one), Fp8Tensor(None, b8, one), {},
                        out_dtypes={"out": jnp.float32}, promote_k=promote_k)["out"]


def _timer():
    """Kernel time on a GPU (CUPTI), wall clock elsewhere."""
    if jax.devices()[0].platform == "gpu":
        from coda_jax.pallas.autotune import kernel_ms
        return kernel_ms
    from benchmarks.bench import median_ms
    return median_ms


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="2048,8192,32768,131072")
    p.add_argument("--mn", type=int, default=512, help="M = N")
    p.add_argument("--backends", default="xla_fp8,xla_fp8_highest,pallas,pallas:512,pallas:128")
    p.add_argument("--time", action="store_true", help="also time each product (kernel time on a GPU)")
    p.add_argument("--dists", default=",".join(DISTRIBUTIONS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    fns = products([b for b in args.backends.split(",") if b])
    rows = []
    for dist in args.dists.split(","):
        for k in (int(v) for v in args.ks.split(",")):
            a8, b8 = fp8_inputs(args.mn, args.mn, k, dist)
            ref = exact_product(a8, b8)
            row = {"dist": dist, "k": k, "mn": args.mn, "device": jax.devices()[0].device_kind,
                   "errors": {name: errors(f(a8, b8), ref) for name, f in fns.items()}}
            if args.time:
                timer = _timer()
                row["ms"] = {name: timer(f, a8, b8) for name, f in fns.items()}
            rows.append(row)
            print(f"ACC {dist:8s} K={k:7d}", flush=True)
            for nm, e in row["errors"].items():
                ms = f"  {row['ms'][nm]:.4f} ms" if args.time else ""
                print(f"    {nm:18s} rel {e['rel']:.2e}  max/rms {e['max_over_rms']:.2e}{ms}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_accumulation.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
