"""cuBLAS against the Pallas kernel, timed in a burst and at the power cap (CUPTI kernel time).

    python benchmarks/heat_probe.py [--heat 1.5] [--iters 20]

For the 1B step's long GEMMs (identity epilogue, in the layouts the step runs them) and two
of their fused programs: each is timed after idle (a burst, at the full SM clock) and after
``--heat`` seconds of back-to-back calls (:func:`coda_jax.pallas.autotune.sustained_kernel_ms`,
at the power-capped clock). A kernel that slows more than cuBLAS under heat spends more
energy per FLOP: under a power cap that, not its cycle count, sets its speed.
Prints one ``HEATPROBE`` line per GEMM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune import M, _cublas_fn, _kernel_fn, _operands, block_programs  # noqa: E402

from coda_jax import programs  # noqa: E402
from coda_jax.pallas import autotune as at  # noqa: E402

# (label, K, N, transpose_a, transpose_b): the 1B MLP GEMMs (fwd gate/up, dgrad, wgrad, down).
SHAPES = [("fwd 8192x16384x2048", 2048, 16384, False, False), ("dgrad 8192x2048x16384", 16384, 2048, False, True),
          ("wgrad 2048x16384x8192", M, 16384, True, False), ("down 8192x2048x8192", 8192, 2048, False, False)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heat", type=float, default=1.5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)

    def probe(label, fn, *fargs, flops):
        heat = []  # the HEAT line: burst time, sustained time, clock
        ms = at.sustained_kernel_ms(fn, *fargs, iters=args.iters, heat_s=args.heat, log=heat.append)
        print(f"HEATPROBE {label:44s} sustained {ms:.4f} ms {flops / ms / 1e9:5.0f} TFLOP/s | {heat[0]}", flush=True)

    for label, k, n, ta, tb in SHAPES:
        m = 2048 if ta else M
        a, b = _operands(m, k, n, ta, tb)
        flops = 2 * m * k * n
        probe(f"cublas {label}", _cublas_fn(ta, tb), a, b, flops=flops)
        probe(f"pallas identity {label}", _kernel_fn(None, programs.IDENTITY, ta, tb), a, b, {}, flops=flops)
    progs, _, d = block_programs()
    for name, epi, (k, n), ta, tb, loads in progs:
        if name not in ("rms_dgrad_res", "swiglu_dgrad"):
            continue
        m = d if ta else M
        a, b = _operands(m, k, n, ta, tb)
        probe(f"pallas {name} {m}x{n}x{k}", _kernel_fn(None, epi, ta, tb), a, b, loads, flops=2 * m * k * n)


if __name__ == "__main__":
    main()
