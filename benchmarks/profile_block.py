"""Where the block's time goes: a per-kernel GPU profile of one fwd+bwd step (run on the H100).

    python -m benchmarks.profile_block --out $OUT [--width 2048] [--backends xla,pallas]
    python -m benchmarks.profile_block --out $OUT --model 1b [--layers 4] [--batch 8 --seq 1024]
    python -m benchmarks.profile_block --out $OUT --model 1b --mesh data=2 --batch 16 --backends plain,pallas

Traces ``--steps`` fwd+bwd steps of the plain XLA block (``baseline``) and of
``CodaLlamaBlock`` on each backend with ``jax.profiler`` (CUPTI kernel events), then sums
the device time of every kernel per step. Kernels are put in classes by name: ``coda``
(this library's Pallas and CuTeDSL kernels, named ``coda_<epilogue>...``), ``collective``
(NCCL), ``gemm`` (cuBLAS / XLA GEMMs), ``attention`` (cuDNN), ``cutedsl`` and ``other`` (XLA
fusions: elementwise passes, reductions, transposes, copies). Prints, per variant, the class
totals, the busy time (kernels on concurrent streams counted once), the overlap and the idle
time, and the top kernels; writes ``<out>/profile_<width>.json``. With ``--model``, the same
for one training step's fwd+bwd (no optimizer update) of ``CodaLlama`` on each backend and
of the plain JAX Llama (``--backends plain,xla,pallas``), to find where an end-to-end
difference comes from; writes ``<out>/profile_<model>.json``. ``--mesh`` runs that step on a
mesh over all GPUs (gradients all-reduced or reduce-scattered inside it) and reports the
mean over the GPUs and each GPU's totals: how much of the collectives overlaps compute.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import functools
import json
from pathlib import Path

import jax

from benchmarks import bench
from benchmarks.device_time import busy_us, trace_kernels

CLASSES = (  # first match wins; matched against the lower-cased kernel name
    ("coda", ("coda_",)),
    ("collective", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reducescatter", "reduce_scatter")),
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


def gpu_summary(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """One GPU's kernels of ``steps`` back-to-back steps, per step (milliseconds): the
    summed kernel time by kernel and by class, the busy time (the union of the kernels'
    intervals: a collective beside a GEMM on another stream counts once), the overlap
    (summed minus busy) and the idle time (the span not covered by any kernel: launch gaps,
    host waits, a collective waiting for the other GPUs)."""
    span_ms = (max(t + d for _, t, d in kernels) - min(t for _, t, _ in kernels)) / 1e3 / steps if kernels else 0.0
    by_kernel = collections.defaultdict(float)
    count = collections.Counter()
    for name, _, us in kernels:
        by_kernel[name] += us / 1e3 / steps
        count[name] += 1
    by_class = collections.defaultdict(float)
    for name, ms in by_kernel.items():
        by_class[kernel_class(name)] += ms
    device_ms = sum(by_kernel.values())
    busy_ms = busy_us(kernels) / 1e3 / steps
    out = {"device_ms": device_ms, "busy_ms": busy_ms, "overlap_ms": device_ms - busy_ms,
           "idle_ms": max(span_ms - busy_ms, 0.0), "by_class": dict(by_class), "by_kernel": dict(by_kernel),
           "calls": {n: c / steps for n, c in count.items()}}
    placement = collective_placement(kernels, steps)
    if placement is not None:
        out["collectives"] = placement
    return out


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _covered(a: float, b: float, union: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of ``[a, b)`` that the disjoint sorted intervals ``union`` cover."""
    i, total = max(bisect.bisect_right(starts, a) - 1, 0), 0.0
    while i < len(union) and union[i][0] < b:
        total += max(0.0, min(b, union[i][1]) - max(a, union[i][0]))
        i += 1
    return total


def collective_placement(kernels: list[tuple[str, float, float]], steps: int, parts: int = 10) -> dict | None:
    """Where one GPU's collectives fall in its ``steps`` back-to-back steps (milliseconds per
    step), or None without collectives: their time (``ms``), the part of it that other
    kernels cover (``hidden_ms``), both per tenth of the step (``by_part``, ``hidden_by_part``:
    a collective is counted in the part where it starts; steps are cut into equal spans of
    the traced time), and the time of each class of kernel that runs beside a collective
    (``beside``). Tells collectives bunched at the end of the backward pass (nothing left to
    hide them behind) from collectives that run beside compute yet do not overlap it."""
    coll = [(t, t + d) for n, t, d in kernels if kernel_class(n) == "collective"]
    if not coll:
        return None
    compute = sorted((t, t + d, kernel_class(n)) for n, t, d in kernels if kernel_class(n) != "collective")
    union = _merged([(a, b) for a, b, _ in compute])
    starts = [a for a, _ in union]
    t0 = min(t for _, t, _ in kernels)
    step_us = (max(t + d for _, t, d in kernels) - t0) / steps
    by_part, hidden_by_part = [0.0] * parts, [0.0] * parts
    beside: dict[str, float] = collections.defaultdict(float)
    c_starts = [a for a, _, _ in compute]
    longest = max((b - a for a, b, _ in compute), default=0.0)
    for a, b in coll:
        part = min(int(((a - t0) % step_us) / step_us * parts), parts - 1) if step_us > 0 else 0
        by_part[part] += (b - a) / 1e3 / steps
        hidden_by_part[part] += _covered(a, b, union, starts) / 1e3 / steps
        for j in range(bisect.bisect_left(c_starts, a - longest), bisect.bisect_left(c_starts, b)):
            ca, cb, cls = compute[j]
            beside[cls] += max(0.0, min(b, cb) - max(a, ca)) / 1e3 / steps
    return {"ms": sum(by_part), "hidden_ms": sum(hidden_by_part), "by_part": by_part,
            "hidden_by_part": hidden_by_part, "beside": {k: v for k, v in sorted(beside.items()) if v > 0}}


def mean_over_gpus(gpus) -> dict:
    """The mean of :func:`gpu_summary` results (one per GPU): device, busy, overlap and idle
    ms, and ms (and calls) by class and by kernel. One GPU: its own summary."""
    gpus = list(gpus)
    n = max(len(gpus), 1)
    out = {k: sum(g[k] for g in gpus) / n for k in ("device_ms", "busy_ms", "overlap_ms", "idle_ms")}
    for key in ("by_class", "by_kernel", "calls"):
        acc = collections.defaultdict(float)
        for g in gpus:
            for name, v in g[key].items():
                acc[name] += v / n
        out[key] = dict(acc)
    placements = [g["collectives"] for g in gpus if "collectives" in g]
    if placements:  # the mean over the GPUs that ran collectives
        k = len(placements)
        out["collectives"] = {
            "ms": sum(p["ms"] for p in placements) / k, "hidden_ms": sum(p["hidden_ms"] for p in placements) / k,
            **{key: [sum(v) / k for v in zip(*(p[key] for p in placements))] for key in ("by_part", "hidden_by_part")},
            "beside": {c: sum(p["beside"].get(c, 0.0) for p in placements) / k
                       for c in sorted({c for p in placements for c in p["beside"]})}}
    return out


def profile(fn, args, steps: int, hlo_path: Path | None = None) -> dict:
    """Per-step device time by kernel and by class (milliseconds), the wall time, and the
    busy, overlap and idle times (:func:`gpu_summary`): the steps are dispatched back to
    back. With several GPUs (a step on a mesh), each figure is the mean over the GPUs, and
    ``per_gpu`` holds each GPU's class totals."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    wall_ms = bench.median_ms(fn, *args, iters=10, min_sample_ms=30.0)
    if hlo_path is not None:  # to look up which ops an XLA fusion holds
        hlo_path.write_text(fn.lower(*args).compile().as_text())
    gpus = {name: gpu_summary(ks, steps) for name, ks in sorted(trace_kernels(fn, args, steps).items())}
    m = mean_over_gpus(gpus.values())
    top = sorted(m["by_kernel"].items(), key=lambda kv: -kv[1])
    out = {"wall_ms": wall_ms, **{k: m[k] for k in ("device_ms", "busy_ms", "overlap_ms", "idle_ms", "by_class")},
           "kernels": [{"name": k[:160], "ms": ms, "calls_per_step": m["calls"][k], "class": kernel_class(k)}
                       for k, ms in top]}
    if len(gpus) > 1:
        out["per_gpu"] = {name: {k: g[k] for k in ("device_ms", "busy_ms", "overlap_ms", "idle_ms", "by_class")}
                          for name, g in gpus.items()}
    return out


def on_mesh(args, mesh, plain: bool = False):
    """A model fwd+bwd's ``(state, tokens)`` with the state placed by ``shard_state`` (the
    plain JAX Llama's, ``plain``: by :func:`plain_llama.shard_plain_state`) and the tokens
    split by ``batch_sharding`` over ``mesh``."""
    from benchmarks.plain_llama import shard_plain_state
    from coda_jax.sharding import batch_sharding, shard_state

    state, tokens = args
    placed = shard_plain_state(state, mesh) if plain else shard_state(state, mesh)
    return placed, jax.device_put(tokens, batch_sharding(mesh))


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
    ap.add_argument("--mesh", default=None,
                    help="with --model: the step on a mesh over all GPUs (e.g. data=2 or fsdp=2; --batch is global), "
                         "state and tokens placed as in train_step_bench.py; reports each GPU and the collectives")
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
        # bench.py's loss (bench._loss): a random cotangent, passed as an argument in the
        # output's dtype (with sum() XLA would fold the ones into the plain op's dgrad, a
        # reduction instead of a GEMM; closed over, it folds the constant into the backward),
        # the value too (with grad alone XLA drops the forward GEMM of a linear op, where a
        # custom_vjp's kernel still runs it), and further outputs returned beside it.
        cot = bench.random_cotangent(plain, a)
        for b in args.backends.split(","):
            fn = plain if b == "plain" else fused(b)
            results[b] = profile(bench.timed_fwd_bwd(fn, argnums), (*a, cot), args.steps, out / f"hlo_{tag}_{b}.txt")
    elif args.model:
        from coda_jax.sharding import mesh_from_spec

        mesh = mesh_from_spec(args.mesh) if args.mesh else None
        tag = args.model + (f"_{args.mesh.replace('=', '').replace(',', '_')}" if args.mesh else "")
        results.update(model=args.model, layers=args.layers, batch=args.batch, seq=args.seq, mesh=args.mesh)
        for b in args.backends.split(","):  # "plain": the plain JAX Llama (benchmarks/plain_llama.py)
            model = bench.plain_model if b == "plain" else functools.partial(bench.coda_model, backend=b)
            with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
                fb, a = model(args.model, batch=args.batch, seq=args.seq, layers=args.layers)
                if mesh is not None:
                    a = on_mesh(a, mesh, plain=b == "plain")
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
        if args.mesh:
            what += f", mesh {args.mesh}, per GPU (mean)"
        print(f"\n## {label} ({what}, fwd+bwd): wall {r['wall_ms']:.3f} ms, device {r['device_ms']:.3f} ms, "
              f"busy {r['busy_ms']:.3f} ms (overlap {r['overlap_ms']:.3f}), idle {r['idle_ms']:.3f} ms: {classes}")
        for gpu, g in r.get("per_gpu", {}).items():
            gc = "  ".join(f"{c} {ms:.3f}" for c, ms in sorted(g["by_class"].items(), key=lambda kv: -kv[1]))
            print(f"  {gpu}: busy {g['busy_ms']:.3f} overlap {g['overlap_ms']:.3f} idle {g['idle_ms']:.3f}: {gc}")
        for k in r["kernels"][: args.top]:
            print(f"  {k['ms']:8.3f} ms  x{k['calls_per_step']:<4g} {k['class']:9s} {k['name'][:110]}")


if __name__ == "__main__":
    main()
