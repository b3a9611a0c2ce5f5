"""Where a Pallas GEMM-epilogue kernel spends its time, per phase, from Mosaic GPU's
in-kernel profiler (:class:`coda_jax.pallas.gemm_epilogue.ProfileSettings`, the ``profile=``
argument of :class:`coda_jax.pallas.lowering.PallasLowering`).

    python3 -m benchmarks.kernel_timeline 'identity dgrad-f' 'swiglu_dgrad dgrad-f' \\
        --backends pallas,pallas@schedule=pingpong+cluster_dimension=None --out /tmp/tl

Programs and shapes are the epilogue benchmark's (``bench.py --parts epilogues``), by label,
as in ``probes/kernel_probe.py``. Each (program, backend) runs with the profiler on, in this
process; the last launch's trace is summarized. Times are kilocycles of the SM clock:
Mosaic GPU stamps each event with ``%clock`` and writes ``(start + cycles) / 1e3`` as the
trace's microseconds, ``start`` being each warpgroup's ``%globaltimer`` (ns) at its first
event, so durations within a warpgroup are cycles / 1000, and warpgroups of one CTA (which
start together) line up to within their start skew. Only the first ``--ranges`` ranges of
each warpgroup are kept (the profiler's buffer shares the kernel's SMEM), so a summary
covers the first tiles of each CTA:

* ``span_kcycles``: first begin to last end over all warpgroups (the profiled kernel; each event
  reads the clock, so it runs a little slower than unprofiled);
* per consumer tile, mean kilocycles in ``mainloop`` (of which ``full_wait``: waiting for
  an operand stage) and ``epilogue`` (of which ``load_wait`` and ``store_wait``);
* ``mma_busy``: per SM, the fraction of its span during which some consumer is in its
  mainloop and not waiting for a stage (the tensor cores' work, as the warpgroups see it),
  averaged over SMs; ``exposed_epilogue``: the fraction during which a consumer runs an
  epilogue and no consumer is in a mainloop (time the tensor cores wait on epilogues);
  ``starved``: the fraction during which a consumer waits for an operand stage and no
  consumer is in its mainloop outside such a wait (no MMAs being issued: the operands are
  late; with ``full_wait`` recorded); ``both_in_mainloop`` / ``both_in_epilogue``: the
  fractions during which both consumers run MMAs (not waiting) / epilogues at once (a
  ping-pong kernel should have neither);
* the producer's ``free_wait`` per SM (ring kernels: the ring full, waiting on consumers).

Writes ``timeline.json`` (the summaries) under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np

from benchmarks import bench
from coda_jax.pallas.gemm_epilogue import ProfileSettings

PHASES = ("mainloop", "full_wait", "epilogue", "load_wait", "store_wait", "free_wait")


def _intervals(events: list[dict]) -> dict[tuple[int, int], dict[str, list[tuple[float, float]]]]:
    """{(pid, tid): {scope name: [(begin, end), ...]}} from Chrome-trace B/E events."""
    by_thread: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    out: dict[tuple[int, int], dict[str, list]] = {}
    for key, evs in by_thread.items():
        # A scope re-entered inside itself (a nested jaxpr that inherits the name stack)
        # counts once: its outermost begin and end.
        stack, spans = [], defaultdict(list)
        for e in evs:
            if e["ph"] == "B":
                stack.append((e["name"], e["ts"]))
            elif stack:
                name, t0 = stack.pop()
                if all(n != name for n, _ in stack):
                    spans[name].append((t0, e["ts"]))
        out[key] = dict(spans)
    return out


def _union_length(iv: list[tuple[float, float]]) -> float:
    total, end = 0.0, -np.inf
    for a, b in sorted(iv):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _intersection_length(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of the unions of ``x`` and ``y``."""
    return _union_length(x) - _union_length(_subtract(x, y))


def _subtract(iv: list[tuple[float, float]], cut: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of intervals ``iv`` outside the union of ``cut``."""
    cut = sorted(cut)
    res = []
    for a, b in iv:
        pieces = [(a, b)]
        for c, d in cut:
            if d <= a or c >= b:
                continue
            nxt = []
            for x, y in pieces:
                if d <= x or c >= y:
                    nxt.append((x, y))
                    continue
                if x < c:
                    nxt.append((x, c))
                if d < y:
                    nxt.append((d, y))
            pieces = nxt
        res += pieces
    return res


def summarize(trace: dict) -> dict:
    """Phase statistics of one kernel launch's trace (see the module docstring)."""
    events = trace["traceEvents"]
    spans = _intervals(events)
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] for e in events)
    # Warpgroups of one CTA are consecutive tids (3 per CTA: consumers 0, 1 and the producer 2).
    by_sm: dict[int, list[dict]] = defaultdict(list)
    for (pid, tid), sp in spans.items():
        by_sm[pid].append({"tid": tid, **sp})
    per_tile = defaultdict(list)
    busy, exposed, free_wait, both_mma, both_epi, starved = [], [], [], [], [], []
    for pid, wgs in by_sm.items():
        consumers = [w for w in wgs if "mainloop" in w]
        producers = [w for w in wgs if "mainloop" not in w]
        sm_t0 = min(s[0] for w in wgs for k, v in w.items() if k != "tid" for s in v)
        sm_t1 = max(s[1] for w in wgs for k, v in w.items() if k != "tid" for s in v)
        length = max(sm_t1 - sm_t0, 1e-9)
        mma = []
        epi = []
        for w in consumers:
            mma += _subtract(w.get("mainloop", []), w.get("full_wait", []))
            epi += w.get("epilogue", [])
            n = max(len(w.get("mainloop", [])), 1)
            for ph in PHASES[:5]:
                per_tile[ph].append(sum(b - a for a, b in w.get(ph, [])) / n)
        busy.append(_union_length(mma) / length)
        waits = [s for w in consumers for s in w.get("full_wait", [])]
        starved.append(_union_length(_subtract(waits, mma)) / length)
        if len(consumers) == 2:  # time both consumers spend in the same phase at once
            w0, w1 = consumers
            m0 = _subtract(w0.get("mainloop", []), w0.get("full_wait", []))
            m1 = _subtract(w1.get("mainloop", []), w1.get("full_wait", []))
            both_mma.append(_intersection_length(m0, m1) / length)
            both_epi.append(_intersection_length(w0.get("epilogue", []), w1.get("epilogue", [])) / length)
        exposed.append(_union_length(_subtract(epi, [s for w in consumers for s in w.get("mainloop", [])])) / length)
        free_wait.append(sum(b - a for w in producers for a, b in w.get("free_wait", [])))
    tiles = sum(len(w.get("mainloop", [])) for wgs in by_sm.values() for w in wgs)
    return {
        "span_kcycles": round(t1 - t0, 2),
        "sms": len(by_sm),
        "consumer_tiles": tiles,
        **{f"{ph}_kcycles_per_tile": round(float(np.mean(v)), 3) for ph, v in per_tile.items()},
        "mma_busy": round(float(np.mean(busy)), 4),
        "exposed_epilogue": round(float(np.mean(exposed)), 4),
        "starved": round(float(np.mean(starved)), 4),
        "both_in_mainloop": round(float(np.mean(both_mma)), 4) if both_mma else None,
        "both_in_epilogue": round(float(np.mean(both_epi)), 4) if both_epi else None,
        "producer_free_wait_kcycles_per_sm": round(float(np.mean(free_wait)), 2) if free_wait else 0.0,
    }


def sm_listing(trace: dict, sm: int) -> list[dict]:
    """The phases of the ``sm``-th SM of the trace (in SM id order) in time order: per
    warpgroup range, its begin, end and the waits inside it (a mainloop's ``full_wait``, an
    epilogue's ``load_wait``); times from the SM's first event."""
    spans = _intervals(trace["traceEvents"])
    pids = sorted({pid for pid, _ in spans})
    mine = {tid: sp for (pid, tid), sp in spans.items() if pid == pids[sm % len(pids)]}
    if not mine:
        return []
    t0 = min(a for sp in mine.values() for iv in sp.values() for a, _ in iv)
    rows = []
    for tid, sp in sorted(mine.items()):
        for name in ("mainloop", "epilogue"):
            for a, b in sp.get(name, []):
                inner = "full_wait" if name == "mainloop" else "load_wait"
                waited = sum(min(b, d) - max(a, c) for c, d in sp.get(inner, []) if c < b and d > a)
                rows.append({"wg": tid, "phase": name, "begin": round(a - t0, 2), "end": round(b - t0, 2),
                             inner: round(waited, 2)})
        fw = sp.get("free_wait", [])
        if fw:
            rows.append({"wg": tid, "phase": "free_wait", "begin": round(fw[0][0] - t0, 2),
                         "end": round(fw[-1][1] - t0, 2), "total": round(sum(b - a for a, b in fw), 2)})
    return sorted(rows, key=lambda r: r["begin"])


def profile_program(label: str, backend: str, d: int, iters: int, scopes: str, ranges: int,
                    dump_sm: int | None = None) -> dict:
    """Runs one epilogue-benchmark program ``iters`` times with the profiler on, recording
    ``scopes`` (comma-separated) in at most ``ranges`` ranges per warpgroup (halved until
    they fit in the SMEM the kernel leaves); the summary of the last launch."""
    cases = {}
    for lab, *rest in bench._epilogue_cases(d):
        cases.setdefault(lab, rest)
    if label not in cases:
        raise SystemExit(f"unknown program {label!r}; one of {sorted(cases)}")
    epi, m, k, n, ta, tb = cases[label]
    a, b, loads = bench.epilogue_inputs(epi, m, k, n, ta, tb)
    while True:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                with bench.backend_variant(backend) as base:
                    if base != "pallas":
                        raise ValueError(f"{backend!r}: the in-kernel profiler is the Pallas kernel's")
                    low = bench._kernel_lowering(base)
                    low.profile = ProfileSettings(tmp, ranges, frozenset(filter(None, scopes.split(","))))
                    f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_a=ta, transpose_b=tb))
                    for _ in range(iters):
                        jax.block_until_ready(f(a, b, loads))
                    jax.effects_barrier()
            except ValueError as e:
                if "exceeds available shared memory" not in str(e) or ranges <= 4:
                    raise
                ranges //= 2  # the profile buffer shares the kernel's SMEM
                continue
            files = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))
            if not files:
                raise RuntimeError(f"{label} on {backend}: the profiler wrote no trace")
            with open(files[-1]) as fh:
                trace = json.load(fh)
        row = {"program": label, "backend": backend, "m": m, "k": k, "n": n, "scopes": scopes,
               "ranges": ranges, **summarize(trace)}
        if dump_sm is not None:
            row["sm_listing"] = sm_listing(trace, dump_sm)
        return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("programs", nargs="+", help="labels of bench._epilogue_cases, e.g. 'swiglu_dgrad dgrad-f'")
    ap.add_argument("--backends", default="pallas", help="comma-separated Pallas variants (bench.backend_variant)")
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--scopes", default="mainloop,epilogue",
                    help="ranges to record (coda_jax.pallas.gemm_epilogue.PROFILE_SCOPES); ';' separates passes")
    ap.add_argument("--ranges", type=int, default=40, help="ranges per warpgroup (halved until they fit)")
    ap.add_argument("--dump-sm", type=int, default=None, help="also list this SM's phases in time order")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for scopes, backend, label in itertools.product(args.scopes.split(";"), args.backends.split(","), args.programs):
        try:
            rows.append(profile_program(label, backend, args.d, args.iters, scopes, args.ranges, args.dump_sm))
        except Exception as e:  # noqa: BLE001 - one failing variant should not hide the rest
            print(f"FAILED {label} on {backend}: {type(e).__name__}: {e}"[:800], flush=True)
            continue
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "sm_listing"}), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "timeline.json").write_text(json.dumps(rows, indent=1))
    cols = ["scopes", "ranges", "consumer_tiles", "span_kcycles", "mainloop_kcycles_per_tile",
            "full_wait_kcycles_per_tile", "epilogue_kcycles_per_tile", "load_wait_kcycles_per_tile",
            "store_wait_kcycles_per_tile", "mma_busy", "exposed_epilogue", "starved",
            "both_in_mainloop", "both_in_epilogue", "producer_free_wait_kcycles_per_sm"]
    print("| program | backend | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['program']} | {r['backend']} | " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")


if __name__ == "__main__":
    main()
