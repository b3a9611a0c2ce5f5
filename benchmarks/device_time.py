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


def device_kernels(trace_dir: str) -> list[tuple[str, float, float]]:
    """(kernel name, start, duration) in microseconds of every event on a GPU stream."""
    paths = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))
    if not paths:
        return []
    events = json.load(gzip.open(paths[-1]))["traceEvents"]
    gpu_pids = {e["pid"] for e in events
                if e.get("ph") == "M" and e.get("name") == "process_name" and "GPU" in e["args"].get("name", "")}
    streams = {(e["pid"], e["tid"]) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpu_pids
               and e["args"].get("name", "").lower().startswith("stream")}
    return [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
            if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams]


def trace_kernels(fn, args, calls: int) -> list[tuple[str, float, float]]:
    """:func:`device_kernels` of ``calls`` calls of ``fn(*args)`` dispatched back to back
    under ``jax.profiler`` (no warm-up: compile before)."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        jax.profiler.stop_trace()
        return device_kernels(tmp)


def device_ms_per_call(fn, args, calls: int = 5) -> float | None:
    """Summed GPU kernel time of one ``fn(*args)`` call (ms, the mean over ``calls`` calls
    dispatched back to back after a warm-up), or None where the trace holds no GPU kernels
    (a CPU run)."""
    jax.block_until_ready(fn(*args))
    kernels = trace_kernels(fn, args, calls)
    if not kernels:
        return None
    return sum(d for _, _, d in kernels) / 1e3 / calls
