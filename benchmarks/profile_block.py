"""Where the block's time goes: a per-kernel GPU profile of one fwd+bwd step (run on the H100).

    python benchmarks/profile_block.py --out $OUT [--width 2048] [--backends xla,pallas]
    python benchmarks/profile_block.py --out $OUT --model 1b [--layers 4] [--batch 8 --seq 1024]

Traces ``--steps`` fwd+bwd steps of the plain XLA block (``baseline``) and of
``CodaLlamaBlock`` on each backend with ``jax.profiler`` (CUPTI kernel events), then sums
the device time of every kernel per step. Kernels are put in classes by name: ``coda``
(this library's Pallas and CuTeDSL kernels, named ``coda_<epilogue>...``), ``gemm`` (cuBLAS / XLA GEMMs),
``attention`` (cuDNN), ``cutedsl`` and ``other`` (XLA fusions: elementwise passes,
reductions, transposes, copies). Prints, per variant, the class totals and the top kernels;
writes ``<out>/profile_<width>.json``. With ``--model``, the same for one training step's
fwd+bwd (no optimizer update) of ``CodaLlama`` on each backend and of the plain JAX Llama
(``--backends plain,xla,pallas``), to find where an end-to-end difference comes from; writes
``<out>/profile_<model>.json``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402
from device_time import trace_kernels  # noqa: E402

CLASSES = (  # first match wins; matched against the lower-cased kernel name
    ("coda", ("coda_",)),
    ("attention", ("cudnn", "flash", "fmha", "sdpa", "attn")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "wgmma")),
    ("cutedsl", ("kernel_cutlass", "cute")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile(fn, args, steps: int, hlo_path: Path | None = None) -> dict:
    """Per-step device time by kernel and by class (milliseconds), the wall time, and the
    idle time: the steps are dispatched back to back, so GPU time not covered by a kernel
    within their span is launch gaps and host waits."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    wall_ms = bench.median_ms(fn, *args, iters=10, min_sample_ms=30.0)
    if hlo_path is not None:  # to look up which ops an XLA fusion holds
        hlo_path.write_text(fn.lower(*args).compile().as_text())
    kernels = trace_kernels(fn, args, steps)
    span_ms = (max(t + d for _, t, d in kernels) - min(t for _, t, _ in kernels)) / 1e3 / steps if kernels else 0.0
    by_kernel = collections.defaultdict(float)
    count = collections.Counter()
    for name, _, us in kernels:
        by_kernel[name] += us / 1e3 / steps
        count[name] += 1
    by_class = collections.defaultdict(float)
    for name, ms in by_kernel.items():
        by_class[kernel_class(name)] += ms
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1])
    device_ms = sum(by_kernel.values())
    return {"wall_ms": wall_ms, "device_ms": device_ms, "idle_ms": max(span_ms - device_ms, 0.0), "by_class": dict(by_class),
            "kernels": [{"name": n[:160], "ms": ms, "calls_per_step": count[n] / steps, "class": kernel_class(n)}
                        for n, ms in top]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--backends", default="xla,pallas")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--model", default=None, help="profile a CodaLlama preset's training fwd+bwd instead")
    ap.add_argument("--layers", type=int, default=None, help="with --model: fewer layers than the preset")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--op", default=None,
                    help="profile one op of bench.py's ops part (e.g. norm_qkv_rope) at --width instead; "
                         "backend 'plain' is its plain JAX version (plain_ops.py)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = ap.parse_args()
    if args.smoke:
        bench.TOKENS, bench.ATTENTION = 256, None
        bench.WIDTHS.clear()
        bench.WIDTHS[256] = (512, 4, 2, 64)
        args.width, args.steps = 256, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": str(jax.devices()[0].device_kind), "width": args.width}
    if args.op:
        tag = f"{args.op}_{args.width}"
        results["op"] = args.op
        case = next((c for c in bench.op_cases(args.width) if c[0] == args.op), None)
        if case is None:
            raise SystemExit(f"profile_block.py: error: --op {args.op!r} is not an op of bench.op_cases")
        _, fused, _, a, argnums, plain = case
        first = lambda o: jax.tree.leaves(o)[0].astype(jax.numpy.float32)  # noqa: E731
        # A random cotangent, as bench.py's: with sum() XLA would fold the ones into the plain
        # op's dgrad (a reduction instead of a GEMM) but not into an opaque kernel. The value
        # too, as bench.py's value_and_grad: with grad alone XLA drops the forward GEMM of an
        # op whose output the gradient does not need (a linear one), where a custom_vjp's
        # kernel still runs it.
        cot = jax.random.normal(jax.random.key(11), jax.eval_shape(lambda *x: first(plain(*x)), *a).shape)
        for b in args.backends.split(","):
            fn = plain if b == "plain" else fused(b)
            loss = lambda *x, fn=fn: jax.numpy.sum(first(fn(*x)) * cot)  # noqa: E731
            results[b] = profile(jax.jit(jax.value_and_grad(loss, argnums)), a, args.steps,
                                 out / f"hlo_{tag}_{b}.txt")
    elif args.model:
        tag = args.model
        results.update(model=args.model, layers=args.layers, batch=args.batch, seq=args.seq)
        for b in args.backends.split(","):  # "plain": the plain JAX Llama (benchmarks/plain_llama.py)
            model = bench.plain_model if b == "plain" else functools.partial(bench.coda_model, backend=b)
            fb, a = model(args.model, batch=args.batch, seq=args.seq, layers=args.layers)
            results[b] = profile(fb, a, args.steps, out / f"hlo_{tag}_{b}.txt")
    else:
        tag = str(args.width)
        _, fb, a = bench.baseline_block(args.width)
        results["baseline"] = profile(fb, a, args.steps, out / f"hlo_{tag}_baseline.txt")
        for label, b, plain in bench.block_variants(args.backends.split(",")):
            with bench.plain_gemm_route(b, plain):
                _, fb, a = bench.coda_block(args.width, b)
                results[label] = profile(fb, a, args.steps, out / f"hlo_{tag}_{label.replace('+', '_')}.txt")
    (out / f"profile_{tag}.json").write_text(json.dumps(results, indent=1))
    for label, r in results.items():
        if not isinstance(r, dict):
            continue
        classes = "  ".join(f"{c} {ms:.3f}" for c, ms in sorted(r["by_class"].items(), key=lambda kv: -kv[1]))
        what = (f"{args.model} x{args.layers or 'all'} layers, {args.batch}x{args.seq}" if args.model
                else f"{args.op}, d={args.width}" if args.op else f"d={args.width}")
        print(f"\n## {label} ({what}, fwd+bwd): wall {r['wall_ms']:.3f} ms, device {r['device_ms']:.3f} ms, "
              f"idle {r['idle_ms']:.3f} ms: {classes}")
        for k in r["kernels"][: args.top]:
            print(f"  {k['ms']:8.3f} ms  x{k['calls_per_step']:<4g} {k['class']:9s} {k['name'][:110]}")


if __name__ == "__main__":
    main()
