"""Device time of jitted calls: the GPU kernels a ``jax.profiler`` trace records (CUPTI).

Wall-clock timing of a sub-millisecond call includes its dispatch; summing the kernels'
durations does not (``bench.py``'s ops part reports both; ``profile_block.py`` breaks the
sum down by kernel).
"""

from __future__ import annotations

import glob
import gzip
import json
import tempfile

import jax


def kernels_by_gpu(events: list[dict]) -> dict[str, list[tuple[str, float, float]]]:
    """``{GPU process name: [(kernel name, start, duration), ...]}`` (microseconds) of the
    events on each GPU's streams in a Perfetto trace's ``traceEvents``: one entry per GPU
    that ran something (a trace of a step on a mesh has one per device)."""
    gpu_names = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"].get("name", "")}
    streams = {(e["pid"], e["tid"]) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu_names
               and e["args"].get("name", "").lower().startswith("stream")}
    out: dict[str, list[tuple[str, float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams:
            out.setdefault(gpu_names[e["pid"]], []).append((e["name"], float(e["ts"]), float(e["dur"])))
    return out


def trace_events(trace_dir: str) -> list[dict]:
    """The ``traceEvents`` of the newest Perfetto trace under ``trace_dir`` ([] if none)."""
    paths = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))
    return json.load(gzip.open(paths[-1]))["traceEvents"] if paths else []


def busy_us(kernels: list[tuple[str, float, float]]) -> float:
    """Microseconds in which at least one of ``kernels`` runs (the union of their
    intervals: kernels on concurrent streams, e.g. a collective beside a GEMM, count once)."""
    total, end = 0.0, None
    for _, t, d in sorted(kernels, key=lambda k: k[1]):
        if end is None or t >= end:
            total, end = total + d, t + d
        elif t + d > end:
            total, end = total + (t + d - end), t + d
    return total


def trace_kernels(fn, args, calls: int) -> dict[str, list[tuple[str, float, float]]]:
    """:func:`kernels_by_gpu` of ``calls`` calls of ``fn(*args)`` dispatched back to back
    under ``jax.profiler`` (no warm-up: compile before)."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        jax.profiler.stop_trace()
        return kernels_by_gpu(trace_events(tmp))


def device_ms_per_call(fn, args, calls: int = 5) -> float | None:
    """Summed GPU kernel time of one ``fn(*args)`` call (ms, the mean over ``calls`` calls
    dispatched back to back after a warm-up), or None where the trace holds no GPU kernels
    (a CPU run)."""
    jax.block_until_ready(fn(*args))
    kernels = [k for ks in trace_kernels(fn, args, calls).values() for k in ks]
    if not kernels:
        return None
    return sum(d for _, _, d in kernels) / 1e3 / calls
