"""Runs one forward program's kernel a few times: a target for ``ncu`` (Nsight Compute).

    ncu -k regex:coda_ -c 1 --section SpeedOfLight --section WarpStateStats \\
        python3 -m benchmarks.probes.kernel_probe 'rms_dgrad_res dgrad' --backend cutedsl

Programs and shapes are the epilogue benchmark's (``bench.py --parts epilogues``), by label
(``identity`` takes the first case of that label, the QKV projection's shape).
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("program", help="a label of bench._epilogue_cases, e.g. 'rms_dgrad_res dgrad'")
    ap.add_argument("--backend", default="cutedsl", help="pallas, cutedsl or a variant such as cutedsl@128s4")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    cases = {}
    for label, *rest in bench._epilogue_cases(args.d):
        cases.setdefault(label, rest)
    if args.program not in cases:
        raise SystemExit(f"unknown program {args.program!r}; one of {sorted(cases)}")
    epi, m, k, n, ta, tb = cases[args.program]
    a, b, loads = bench.epilogue_inputs(epi, m, k, n, ta, tb)
    with bench.backend_variant(args.backend) as base:
        low = bench._kernel_lowering(base)
        f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_a=ta, transpose_b=tb))
        for _ in range(args.iters):
            jax.block_until_ready(f(a, b, loads))
    print(f"ran {args.program} ({m}x{k}x{n}) on {args.backend} {args.iters} times")


if __name__ == "__main__":
    main()
