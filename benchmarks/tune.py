"""Sweeps TuningConfig candidates of the Pallas GEMM on the H100 and prints the best per shape.

    python benchmarks/tune.py [--out DIR]

For each GEMM shape class (M=8192 and the Llama K, N pairs), times the identity-epilogue
kernel under every candidate (median of 10 after warm-up), skipping configs that do not
fit in SMEM, and prints the winners; copy them into ``coda_jax/pallas/tuning.py``'s
``CONFIG_TABLE``. Results go to ``<out>/tune.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import median_ms  # noqa: E402
from coda_jax import programs  # noqa: E402
from coda_jax.pallas.lowering import PallasLowering  # noqa: E402
from coda_jax.pallas.tuning import TuningConfig  # noqa: E402

SHAPES = [(8192, 2048, 8192), (8192, 4096, 14336), (8192, 8192, 28672)]
CANDIDATES = [TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=st, grid_tile_width=gw)
              for tm, tn, st, gw in itertools.product((64, 128), (128, 256), (3, 4, 6), (4, 16))
              if tm * tn <= 128 * 128]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for m, k, n in SHAPES:
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.bfloat16)
        best = None
        for cfg in CANDIDATES:
            try:
                low = PallasLowering(cfg)
                f = jax.jit(lambda a, b: low.gemm(programs.IDENTITY, a, b, {})["out"])
                ms = median_ms(f, a, b, iters=10)
            except Exception as e:  # SMEM overflow and friends: skip the candidate
                rows.append({"shape": [m, k, n], "config": cfg.__dict__, "error": str(e)[:200]})
                continue
            tf = 2 * m * k * n / ms / 1e9
            rows.append({"shape": [m, k, n], "config": cfg.__dict__, "ms": ms, "tflops": tf})
            print(json.dumps(rows[-1]), flush=True)
            if best is None or ms < best[0]:
                best = (ms, tf, cfg)
        if best:
            print(f"BEST m={m} k={k} n={n}: {best[1]:.0f} TFLOP/s {best[2]}", flush=True)
    (out / "tune.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
