"""Hardware counters of chosen kernel calls of a CodaLlama step, read by Nsight Compute (on the GPU).

    python -m benchmarks.kernel_counters --model 1b-2:8:1024:fp8 \
        --programs swiglu_dgrad_q8_fp8,quantize_e4m3 [--shapes 8192x8192x2048] --out $OUT

The step's Pallas kernel calls (:func:`coda_jax.pallas.autotune.kernel_calls`, the model as
``benchmarks/tune.py --model`` names it), those whose program is in ``--programs`` (and, with
``--shapes``, whose ``MxNxK`` is listed), each compiled with the configuration the shipped
table or the heuristic gives it (and on each of ``--candidates``, the autotuner's named
configurations, e.g. to see which of them spills) and launched once on random operands
(:func:`~coda_jax.pallas.autotune.random_arguments`) inside ``ncu`` (``--clock-control none``:
the clocks stay where the GPU puts them; kernels named ``coda_*`` only, so the operands'
random draws are not profiled). Writes ``<out>/counters.ncu-rep``, ``details.txt`` (ncu's
sections with its rule notes: speed of light, memory, warp stalls, source counters),
``raw.csv`` (every metric), ``launches.json`` (each launch's call and configuration), and
``sass_<i>.csv`` / ``sass_<i>.txt`` per kernel (ncu's source page and
:mod:`benchmarks.sass_hotspots`' summary of it: warp-stall samples per opcode and
instruction); prints a line per kernel: duration, DRAM and SM throughput as a share of peak,
DRAM bytes moved and the rate, registers, local-memory spill requests, and the largest
warp-stall reasons (cycles a warp spends stalled per instruction issued, by reason).

Each kernel is replayed once per counter pass: minutes for a handful of calls. Without
``ncu`` on the PATH (or under ``/opt/nvidia/nsight-compute``) it stops with that message.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "ComputeWorkloadAnalysis", "WarpStateStats",
            "SchedulerStats", "Occupancy", "LaunchStats", "SourceCounters")
# Columns of ncu's raw page that the summary line reads (the stall columns are found by name).
DURATION = "gpu__time_duration.sum"
DRAM_PCT = "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"
SM_PCT = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
DRAM_RATE = "dram__bytes.sum.per_second"  # bytes/s, read and written
SPILLS = "derived__local_spilling_requests"  # local-memory requests of register spills
REGISTERS = "launch__registers_per_thread"
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def find_ncu() -> str:
    """The ``ncu`` executable: on the PATH, else the newest under /opt/nvidia/nsight-compute."""
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)), None)
    if found is None:
        raise SystemExit("kernel_counters.py: error: Nsight Compute's ncu is not on the PATH "
                         "nor under /opt/nvidia/nsight-compute")
    return found


def parse_shapes(text: str) -> set[tuple[int, int, int]]:
    shapes = set()
    for s in filter(None, text.split(",")):
        try:
            m, n, k = (int(v) for v in s.lower().split("x"))
        except ValueError:
            raise SystemExit(f"kernel_counters.py: error: --shapes: {s!r} is not MxNxK") from None
        shapes.add((m, n, k))
    return shapes


def selected_calls(model: str, programs: list[str], shapes: set[tuple[int, int, int]]) -> list:
    """The model step's kernel calls of those programs (and shapes, if given), in step order."""
    from benchmarks.tune import model_step
    from coda_jax.pallas import autotune as at

    fn, args = model_step(model)
    calls = [c for c in at.kernel_calls(fn, *args)
             if c.epilogue.name in programs and (not shapes or tuple(c.mnk) in shapes)]
    if not calls:
        raise SystemExit(f"kernel_counters.py: error: no kernel call of {model!r} runs programs {programs}"
                         + (f" at shapes {sorted(shapes)}" if shapes else ""))
    return calls


def launch(model: str, programs: list[str], shapes: set[tuple[int, int, int]], candidates: list[str],
           out: Path) -> None:
    """Inside ncu: each selected call compiled, then launched once on the configuration the
    tables or heuristics give it, then once on each of the autotuner's ``candidates`` that can
    run it. The launches' labels, in launch order, go to ``out/launches.json`` (ncu's rows
    come in that order; the kernel's name does not say its configuration)."""
    import jax

    import coda_jax as cj
    from coda_jax.pallas import autotune as at
    from coda_jax.pallas.lowering import PallasLowering

    labels = []
    for call in selected_calls(model, programs, shapes):
        a, b, loads = at.random_arguments(call)
        configs = {"table": None, **(at.candidate_configs(call, candidates) if candidates else {})}
        for label, cfg in configs.items():
            low = PallasLowering(cfg)

            def first(a, b, loads, call=call, low=low):
                res = low.gemm(call.epilogue, a, b, loads, transpose_a=call.transpose_a,
                               transpose_b=call.transpose_b, out_dtypes=dict(call.out_dtypes) or None,
                               promote_k=call.promote_k)
                return jax.tree.map(lambda x: x.reshape(-1)[:1], res)  # outputs not kept alive

            with cj.options(routing=dict(xla_output_below=0)):  # the kernel, whatever the size
                jax.block_until_ready(jax.jit(first)(a, b, loads))
            m, n, k = call.mnk
            labels.append(f"{call.epilogue.name} {m}x{n}x{k} {label}")
            print(f"LAUNCHED {labels[-1]}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.json").write_text(json.dumps(labels, indent=1))


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(raw_csv: Path, top_stalls: int = 5) -> list[dict]:
    """One dict per profiled kernel of ncu's raw page (``--page raw --csv --print-units base``):
    name, duration (ms), DRAM and SM throughput (% of peak), DRAM GB moved and TB/s,
    registers per thread, and the ``top_stalls`` largest stall reasons."""
    with open(raw_csv, newline="") as f:
        rows = list(csv.reader(f))
    header, data = rows[0], rows[2:]  # the second row holds the units
    col = {h: i for i, h in enumerate(header)}
    out = []
    for r in data:
        def get(name):
            return _number(r[col[name]]) if name in col and col[name] < len(r) else None

        ns, rate = get(DURATION), get(DRAM_RATE)
        stalls = sorted(((h[len(STALL_PREFIX):-len(STALL_SUFFIX)], _number(r[i]) or 0.0) for h, i in col.items()
                         if h.startswith(STALL_PREFIX) and h.endswith(STALL_SUFFIX) and i < len(r)),
                        key=lambda kv: -kv[1])[:top_stalls]
        out.append({"kernel": r[col["Kernel Name"]] if "Kernel Name" in col else "?",
                    "ms": ns / 1e6 if ns else None, "dram_pct": get(DRAM_PCT), "sm_pct": get(SM_PCT),
                    "dram_gb": rate * ns * 1e-18 if rate and ns else None,
                    "dram_tb_s": rate / 1e12 if rate else None, "spill_requests": get(SPILLS),
                    "registers": get(REGISTERS), "stalls": stalls})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b-2:8:1024:fp8", help="as benchmarks/tune.py --model")
    p.add_argument("--programs", required=True, help="comma-separated program names (as the tuned tables key them)")
    p.add_argument("--shapes", default="", help="comma-separated MxNxK: only these calls")
    p.add_argument("--candidates", default="",
                   help="comma-separated autotuner candidates (coda_jax.pallas.autotune) to profile each call on too")
    p.add_argument("--out", default="counters_out")
    p.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)  # the process ncu runs
    args = p.parse_args(argv)
    programs = [s for s in args.programs.split(",") if s]
    shapes = parse_shapes(args.shapes)
    candidates = [s for s in args.candidates.split(",") if s]
    if args.launch:
        launch(args.model, programs, shapes, candidates, Path(args.out))
        return
    ncu = find_ncu()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "counters"
    cmd = [ncu, "--clock-control", "none", "--target-processes", "all", "-k", "regex:^coda_", "-f", "-o", str(report),
           *[a for s in SECTIONS for a in ("--section", s)],
           sys.executable, "-m", "benchmarks.kernel_counters", "--launch", "--model", args.model,
           "--programs", args.programs, "--shapes", args.shapes, "--candidates", args.candidates, "--out", str(out)]
    # ncu saves and restores what a kernel may write between its passes: no preallocated pool.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    rep = f"{report}.ncu-rep"
    with open(out / "details.txt", "w") as f:
        subprocess.run([ncu, "--import", rep, "--page", "details"], check=True, stdout=f)
    with open(out / "raw.csv", "w") as f:
        subprocess.run([ncu, "--import", rep, "--page", "raw", "--csv", "--print-units", "base"], check=True, stdout=f)
    kernels = summarize(out / "raw.csv")
    labels = json.loads((out / "launches.json").read_text())
    if len(labels) != len(kernels):
        raise SystemExit(f"kernel_counters.py: error: {len(labels)} launches but ncu profiled {len(kernels)} kernels")
    seen = set()
    for i, k in enumerate(kernels):  # where each kernel's warps stall, per SASS instruction
        k["label"] = labels[i]
        if k["kernel"] in seen:  # the same kernel name on another configuration: ncu's filter would mix them
            continue
        seen.add(k["kernel"])
        sass = out / f"sass_{i}.csv"
        with open(sass, "w") as f:
            done = subprocess.run([ncu, "--import", rep, "-k", f"regex:^{k['kernel']}$", "--page", "source", "--csv",
                                   "--print-source", "sass"], stdout=f).returncode == 0
        if done:
            with open(out / f"sass_{i}.txt", "w") as f:
                f.write(k["kernel"] + "\n")
                f.flush()
                subprocess.run([sys.executable, "-m", "benchmarks.sass_hotspots", str(sass), "--top", "30"], stdout=f,
                               stderr=subprocess.STDOUT)
    for k in kernels:
        stalls = "  ".join(f"{name} {v:.2f}" for name, v in k["stalls"])
        print(f"COUNTERS {k['label']}: {k['ms'] or 0:.4f} ms, DRAM {k['dram_pct'] or 0:.1f} % "
              f"({k['dram_gb'] or 0:.3f} GB, {k['dram_tb_s'] or 0:.2f} TB/s), SM {k['sm_pct'] or 0:.1f} %, "
              f"{k['registers'] or 0:.0f} regs, {k['spill_requests'] or 0:,.0f} spill requests; "
              f"stalls/issue: {stalls}", flush=True)


if __name__ == "__main__":
    main()
