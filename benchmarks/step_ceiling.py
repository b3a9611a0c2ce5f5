"""What bounds a train step's ratio to plain JAX: its profiled kernel time by part.

    python -m benchmarks.step_ceiling RESULT_DIR [...]

Reads the ``train_step.json`` of each directory, written by ``train_step_bench.py --profile``
(each run's whole step traced, optimizer included: ``gpu_bench.sh`` with ``STEP_ARGS=--profile``;
merged as ``summarize.py`` merges them: a later directory's configuration replaces an
earlier one's, so each table compares runs of one process) and splits
each run's GPU kernel time per step (against `plain`, or `plain_fp8` where only the FP8
baseline was profiled) into

* GEMMs: the fused kernels (coda-jax's) and the GEMMs left to XLA / cuBLAS;
* attention (cuDNN);
* optimizer: XLA kernels inside the train step's ``optimizer`` named scope
  (``examples/train_llama.py``: AdamW's update and the gradient clipping norm);
* parameter casts: the float32 parameters' conversions to bfloat16 for the forward;
* other passes: every other XLA kernel (what epilogue fusion can remove), and coda-jax's
  epilogue passes (a Pallas kernel over a zero accumulator, K <= ``PASS_MAX_K`` in its name:
  e.g. the FP8 weights' quantizing passes), which are kernels of ours but no GEMM.

The optimizer and the casts are the same work in every run (same optimizer, same float32
parameters), and no GEMM epilogue removes them. So against plain JAX's step (its device
time ``T_plain``) a kernel backend's run is bounded by

    free fusion:   T_plain / (plain GEMMs + attention + optimizer + casts)
    cuBLAS-speed:  T_plain / (plain GEMMs + attention + optimizer + casts + other passes)

the first if every fused GEMM cost what cuBLAS's GEMM costs and no other pass were left,
the second with the run's other passes as they are. Attention, optimizer and casts are the
run's own. Ratios here are of device time (summed kernel durations), not tokens/s.

An FP8 run (``fp8`` in its name) profiled beside both ``plain`` and ``plain_fp8`` gets the
same two bounds with the FP8 baseline's GEMMs (cuBLASLt's FP8 GEMMs, its LM head's bf16 ones)
in place of plain JAX's: what the run would reach if each of its GEMMs ran at cuBLASLt's
rate, against plain JAX in bf16.

Both bounds keep every kernel's measured duration. On a GPU held at its power cap (an H100
in a training step) that is optimistic: the memory-bound passes that fusion removes drew
less power than the GEMMs, so without them the GEMMs run at a lower clock (HISTORY.md, run
222: Pallas's 1B step at 1530 MHz, plain JAX's at 1635 MHz, both at 690 W).

Below each table, the fused GEMMs per call site: a Pallas kernel is named
``coda_<program>_<layout>_<M>x<N>x<K>`` (padded sizes), so each line gives one GEMM's
launches per step (recorded by ``train_step_bench.py --profile`` after run 214; earlier
profiles show dashes), its time per launch and its rate.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from benchmarks.summarize import load
from coda_jax.pallas.tuning import PASS_MAX_K

GEMM_CLASSES = ("gemm", "coda", "cutedsl")
PARTS = ("gemms", "attention", "optimizer", "casts", "passes")


def split_run(profile: dict) -> dict[str, float]:
    """``{part: ms per step}`` of one profiled run (see the module docstring), plus
    ``device`` (all kernels) and ``named`` (whether the optimizer scope was found)."""
    by_class = profile["by_class"]
    fusions = profile.get("fusions", {})
    optimizer = casts = 0.0
    named = False
    for name, ms in profile.get("top_kernels", []):
        f = fusions.get(name)
        if f is None:
            continue
        op = f.get("op_name", "")
        if "/optimizer/" in op:
            optimizer += ms
            named = True
        elif op.endswith("convert_element_type") and "transpose(" not in op and "state_" in f.get("operands", ""):
            casts += ms
    other = by_class.get("other", 0.0)
    # coda-jax's epilogue passes: our kernels, but no GEMM (only those in the profile's top list)
    epilogue_passes = sum(r["ms"] for r in fused_calls(profile) if r["shape"][2] <= PASS_MAX_K)
    return {
        "device": profile["device_ms"],
        "gemms": sum(by_class.get(c, 0.0) for c in GEMM_CLASSES) - epilogue_passes,
        "attention": by_class.get("attention", 0.0),
        "optimizer": optimizer,
        "casts": casts,
        "passes": max(other - optimizer - casts, 0.0) + epilogue_passes,
        "named": named,
    }


_FUSED_NAME = re.compile(r"^coda_(?P<program>.+)_(?P<layout>[nt]{2})_(?P<m>\d+)x(?P<n>\d+)x(?P<k>\d+)")


def fused_calls(profile: dict) -> list[dict]:
    """The profile's Pallas kernels named by call site (see the module docstring), heaviest
    first: program, layout, ``(m, n, k)``, ms per step, launches per step (None in profiles
    that did not record them), ms per launch and TFLOP/s (``2 m n k`` per launch)."""
    calls = profile.get("kernel_calls", {})
    out = []
    for name, ms in profile.get("top_kernels", []):
        hit = _FUSED_NAME.match(name)
        if hit is None:
            continue
        m, n, k = (int(hit[x]) for x in "mnk")
        c = calls.get(name)
        row = {"program": hit["program"], "layout": hit["layout"], "shape": (m, n, k), "ms": ms, "calls": c,
               "ms_per_call": None, "tflops": None}
        if c:
            row["ms_per_call"] = ms / c
            row["tflops"] = 2 * m * n * k * c / (ms * 1e-3) / 1e12
        out.append(row)
    return out


def ceilings(plain: dict[str, float], run: dict[str, float], gemms: dict[str, float] | None = None
             ) -> dict[str, float]:
    """Device-time ratios to plain JAX (``plain``): ``now``, ``cublas_speed`` and
    ``free_fusion``, the bounds with the GEMMs of ``gemms`` (default: ``plain``'s own;
    ``plain_fp8``'s for the FP8 bounds)."""
    fixed = (gemms or plain)["gemms"] + run["attention"] + run["optimizer"] + run["casts"]
    return {"now": plain["device"] / run["device"],
            "cublas_speed": plain["device"] / (fixed + run["passes"]),
            "free_fusion": plain["device"] / fixed}


def report(steps: dict[str, list[dict]]) -> str:
    """A markdown table per configuration with a profiled plain run."""
    out = []
    for tag, runs in steps.items():
        prof = [(r["run"], split_run(r["profile"])) for r in runs if r.get("profile")]
        # The baseline: plain JAX in bf16, else plain JAX in FP8 (an FP8 comparison profiled alone)
        base = next((b for b in ("plain", "plain_fp8") if any(name == b for name, _ in prof)), None)
        if base is None:
            out += [f"### {tag}", "", f"(no profiled `plain` or `plain_fp8` run: nothing to compare with; runs: "
                    f"{', '.join(name for name, _ in prof) or 'none profiled'})", ""]
            continue
        plain = next(s for name, s in prof if name == base)
        out += [f"### {tag}", "", f"Baseline: `{base}`.", "",
                "| run | device ms | GEMMs | attention | optimizer | param casts | other passes | "
                "now | bound: cuBLAS-speed GEMMs | bound: free fusion |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for name, s in prof:
            cells = [f"{s[k]:.2f}" for k in ("device", *PARTS)]
            if name == base:
                ratios = ["1.000x", "", ""]
            else:
                c = ceilings(plain, s)
                ratios = [f"{c['now']:.3f}x", f"{c['cublas_speed']:.3f}x", f"{c['free_fusion']:.3f}x"]
            out.append(f"| {name} | " + " | ".join(cells + ratios) + " |")
        fp8_base = next((s for name, s in prof if name == "plain_fp8"), None)
        fp8_runs = [(name, s) for name, s in prof if "fp8" in name and name != "plain_fp8"]
        if base == "plain" and fp8_base is not None and fp8_runs:
            out += ["", "FP8 bounds against `plain` with `plain_fp8`'s GEMMs (cuBLASLt's rate):", "",
                    "| run | now | bound: cuBLASLt-speed GEMMs | bound: free fusion |", "|---|---|---|---|"]
            for name, s in fp8_runs:
                c = ceilings(plain, s, gemms=fp8_base)
                out.append(f"| {name} | {c['now']:.3f}x | {c['cublas_speed']:.3f}x | {c['free_fusion']:.3f}x |")
        if not all(s["named"] for _, s in prof):
            out.append("\n(no kernel of the `optimizer` scope was found in a run: a profile from before "
                       "the scope was named counts the optimizer as other passes)")
        for r in runs:
            rows = fused_calls(r.get("profile") or {})
            if not rows:
                continue
            fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
            out += ["", f"{r['run']}: fused GEMMs by call site", "",
                    "| program | layout | M x N x K | ms a step | launches a step | ms a launch | TFLOP/s |",
                    "|---|---|---|---|---|---|---|"]
            out += [f"| {x['program']} | {x['layout']} | {'x'.join(map(str, x['shape']))} | {x['ms']:.3f} | "
                    f"{fmt(x['calls'], 'g')} | {fmt(x['ms_per_call'], '.3f')} | {fmt(x['tflops'], '.0f')} |"
                    for x in rows]
        out.append("")
    return "\n".join(out)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="directories holding a train_step.json")
    args = ap.parse_args(argv)
    text = report(load(args.dirs)[0])
    print(text)
    return text


if __name__ == "__main__":
    main()
