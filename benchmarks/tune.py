"""Sweeps TuningConfig candidates of the Pallas GEMM-epilogue kernel on the H100.

    python benchmarks/tune.py [--out DIR] [--quick]

For M=8192 tokens and the Llama (K, N) pairs, in the three operand layouts a training step
uses (forward ``a @ b``, dgrad ``a @ b^T``, wgrad ``a^T @ b``), times the identity-epilogue
kernel under every candidate (skipping those that do not fit in SMEM), and two fused
programs (``residual_rms``, ``rms_swiglu_train``) under the best candidates, next to
``jnp.dot`` and the JAX-shipped Hopper matmul (``hopper_matmul_mgpu``, forward layout
only) as yardsticks, all in the same process. Prints one line per measurement and the
winners; copy them into ``coda_jax/pallas/tuning.py``'s ``CONFIG_TABLE``. Results go to
``<out>/tune.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import Inputs, median_ms  # noqa: E402
from coda_jax import programs  # noqa: E402
from coda_jax.pallas.gemm_epilogue import KernelShape, plan_kernel  # noqa: E402
from coda_jax.pallas.lowering import PallasLowering  # noqa: E402
from coda_jax.pallas.tuning import TuningConfig  # noqa: E402

M = 8192
SHAPES = [(2048, 8192), (4096, 14336), (8192, 28672), (2048, 16384)]  # (K, N)
LAYOUTS = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, False)}
_WS = TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, warp_specialized=True)
CANDIDATES = {
    "single_wg_128x128_s4": TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4),
    "ws_m_s4": _WS,
    "ws_n_s4": dataclasses.replace(_WS, wg_dimension="n"),
    "ws_n_s4_gw8": dataclasses.replace(_WS, wg_dimension="n", grid_tile_width=8),
    "ws_n_s4_swizzled": dataclasses.replace(_WS, wg_dimension="n", swizzle_epilogue=True),
    "ws_n_64x128_s6": TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=6, warp_specialized=True,
                                   wg_dimension="n"),
}


def _planned(epi, m, k, n, ta, tb, cfg, out_dtypes):
    shape = KernelShape(m=m, n=n, k=k, m_real=m, n_real=n, transpose_a=ta, transpose_b=tb,
                        operand_dtype=jnp.dtype(jnp.bfloat16), out_dtypes=out_dtypes, num_sms=jax.devices()[0].core_count)
    return plan_kernel(epi, shape, cfg, ())


def _jax_example(a, b):
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    cfg = hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4,
                          wg_dimension=hm.MatmulDimension.N, grid_tile_width=4)
    return hm.matmul(a, b, None, cfg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_out")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="first two shapes only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "tune.json").write_text(json.dumps(rows, indent=1))

    for k, n in SHAPES[:2] if args.quick else SHAPES:
        flops = 2 * M * k * n
        for layout, (ta, tb) in LAYOUTS.items():
            r = Inputs(k + n)
            a = r.normal((k, M) if ta else (M, k))
            b = r.normal((n, k) if tb else (k, n))
            base = {"k": k, "n": n, "layout": layout}
            dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
            dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
                          .astype(jnp.bfloat16))
            ref = dot(a, b)
            dot_ms = median_ms(dot, a, b, iters=args.iters)
            record({**base, "impl": "jnp.dot", "ms": dot_ms, "tflops": flops / dot_ms / 1e9})
            if layout == "fwd":
                try:
                    ex = jax.jit(_jax_example)
                    ms = median_ms(ex, a, b, iters=args.iters)
                    record({**base, "impl": "jax_example_128x256_wgN_s4", "ms": ms, "tflops": flops / ms / 1e9,
                            "vs_dot": dot_ms / ms})
                except Exception as e:
                    record({**base, "impl": "jax_example", "error": f"{type(e).__name__}: {str(e)[:200]}"})
            for name, cfg in CANDIDATES.items():
                row = {**base, "impl": name}
                try:
                    planned = _planned(programs.IDENTITY, M, k, n, ta, tb, cfg, (("out", jnp.dtype(jnp.bfloat16)),))
                    row["planned"] = {f: getattr(planned, f) for f in ("tile_m", "max_concurrent_steps",
                                                                        "warp_specialized", "wg_dimension")}
                    low = PallasLowering(cfg, plain_gemm="pallas")
                    f = jax.jit(lambda a, b, low=low: low.gemm(programs.IDENTITY, a, b, {}, transpose_a=ta,
                                                               transpose_b=tb)["out"])
                    got = f(a, b)
                    row["rel_err"] = float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                           / jnp.linalg.norm(ref.astype(jnp.float32)))
                    row["ms"] = median_ms(f, a, b, iters=args.iters)
                    row["tflops"] = flops / row["ms"] / 1e9
                    row["vs_dot"] = dot_ms / row["ms"]
                except Exception as e:  # SMEM overflow, lowering failures: record and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                record(row)
        # Fused programs (forward layout) under each candidate, against the identity GEMM.
        r = Inputs(n)
        a, b = r.normal((M, k)), r.normal((k, n))
        fused = {
            "residual_rms": (programs.RESIDUAL_RMS, {"residual": r.normal((M, n)),
                                                     "gamma": r.normal((n,), 0.1, 1.0, jnp.float32)}),
            "rms_swiglu_train": (programs.rms_swiglu(True), {"rstd": r.normal((M,), 0.1, 1.0, jnp.float32)}),
        }
        for pname, (epi, loads) in fused.items():
            for name, cfg in CANDIDATES.items():
                row = {"k": k, "n": n, "layout": "fwd", "program": pname, "impl": name}
                try:
                    low = PallasLowering(cfg)
                    f = jax.jit(lambda a, b, l, low=low, epi=epi: low.gemm(epi, a, b, l))
                    row["ms"] = median_ms(f, a, b, loads, iters=args.iters)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                record(row)
    best = {}
    for row in rows:
        if "ms" in row and row["impl"] in CANDIDATES:
            key = (row["k"], row["n"], row["layout"], row.get("program", "identity"))
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
    for key, row in sorted(best.items()):
        vs = f" ({row['vs_dot']:.2f}x jnp.dot)" if "vs_dot" in row else ""
        print(f"BEST k={key[0]} n={key[1]} {key[2]} {key[3]}: {row['impl']} {row['tflops']:.0f} TFLOP/s{vs}", flush=True)

if __name__ == "__main__":
    main()
