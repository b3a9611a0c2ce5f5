"""The "current numbers" of ``benchmarks/RESULTS.md``: one short table and one chart.

    python -m benchmarks.summarize RESULT_DIR [RESULT_DIR ...] --label "run 74, H100, <commit>" \
        [--update benchmarks/RESULTS.md]

Reads what ``gpu_bench.sh`` left in each directory (``train_step.json`` from
``train_step_bench.py``, ``bench.json`` from ``bench.py``; later directories win on the same
key) and writes ``current.md`` and ``current.png`` into the first one: each backend against
plain JAX, for the train step (tokens/s over the plain JAX Llama's, same process), the block
(fwd+bwd time of the plain XLA Llama block over ``CodaLlamaBlock``'s) and each fused op
(fwd+bwd of the op in plain JAX, ``plain_ops.py``, over the backend's). With ``--update``, the section between
``<!-- current:begin -->`` and ``<!-- current:end -->`` of that file is replaced and the chart
is copied beside it as ``results.png``; the rest of the file (the notes on the current numbers,
the index of ``HISTORY.md``'s runs) is kept as it is.

``benchmarks/current/run<N>/`` keeps the inputs of runs whose numbers the section may be
rebuilt from (run 168: the train step at one commit, every backend). To rebuild the section
from one of them and a new run, list it first (later directories win on the same key) and
name ``--out``, since outputs go to the first directory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import textwrap
from pathlib import Path

BEGIN, END = "<!-- current:begin -->", "<!-- current:end -->"
PLAIN_FP8 = "plain_fp8"  # train_step_bench.py's run of the plain JAX FP8 Llama


def load(dirs: list[Path]) -> tuple[dict, list[dict]]:
    """``({config tag: [train-step rows]}, [bench.py rows])`` merged over ``dirs``."""
    steps, rows = {}, []
    for d in dirs:
        if (d / "train_step.json").exists():
            steps.update(json.loads((d / "train_step.json").read_text()))
        if (d / "bench.json").exists():
            rows += json.loads((d / "bench.json").read_text())["rows"]
    return steps, rows


def step_ratios(steps: dict) -> dict[str, dict[str, float]]:
    """``{config: {run: tokens/s over the mean of that config's plain runs}}``."""
    out = {}
    for tag, runs in steps.items():
        plain = [r["tokens_per_s"] for r in runs if r["run"] == "plain"]
        if not plain:
            continue
        base = statistics.mean(plain)
        out[tag] = {r["run"]: r["tokens_per_s"] / base for r in runs if r["run"] != "plain"}
    return out


def block_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """``{"block d=2048": {backend: plain block fwd+bwd ms / backend's}}``."""
    out = {}
    for r in rows:
        if r.get("op") != "block" or "baseline_fwdbwd_ms" not in r:
            continue
        out[f"block d={r['d']}"] = {k[:-len("_fwdbwd_ms")]: r["baseline_fwdbwd_ms"] / v for k, v in r.items()
                                    if k.endswith("_fwdbwd_ms") and not k.startswith("baseline")}
    return out


def op_ratios(rows: list[dict], key: str = "fwdbwd_ms") -> dict[str, dict[str, float]]:
    """``{"<op> d=<d>": {backend: baseline fwd+bwd ms / backend's}}``: the baseline is the op
    written in plain JAX (backend ``"plain"``, ``benchmarks/plain_ops.py``) where the run has
    it, else the ``xla`` backend's op. ``key``: ``"fwdbwd_ms"`` (wall clock) or
    ``"fwdbwd_device_ms"`` (summed GPU kernel time, where ``bench.py`` measured it)."""
    times: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("backend") and key in r and "op" in r:
            times.setdefault((r["op"], r["d"]), {})[r["backend"]] = r[key]
    out = {}
    for (op, d), t in times.items():
        base = "plain" if "plain" in t else "xla" if "xla" in t else None
        if base is not None:
            out[f"{op} d={d}"] = {b: t[base] / ms for b, ms in t.items() if b != base}
    return out


def markdown(steps: dict, rows: list[dict], label: str) -> str:
    lines = [f"Current numbers ({label}); chart: `benchmarks/results.png`. Ratios above 1 mean faster than the "
             "baseline named in the heading.", ""]
    if steps:
        # A second baseline where a configuration ran the plain JAX FP8 Llama too
        # (benchmarks/plain_fp8_llama.py, run "plain_fp8"): every run against it as well.
        fp8 = any(r["run"] == PLAIN_FP8 for runs in steps.values() for r in runs)
        lines += ["**Train step** (tokens/s; baseline: the plain JAX Llama, `benchmarks/plain_llama.py`, same "
                  "process, same config, optimizer and batch"
                  + ("; FP8 configurations also against the plain JAX FP8 Llama, `benchmarks/plain_fp8_llama.py`, "
                     f"run `{PLAIN_FP8}`)" if fp8 else ")"), "",
                  "| config | run | ms/step | tokens/s | vs plain JAX | " + ("vs plain FP8 | " if fp8 else "")
                  + "compile + first step s |", "|---|---|---|---|---|" + ("---|" if fp8 else "") + "---|"]
        for tag, runs in steps.items():
            plain = [r["tokens_per_s"] for r in runs if r["run"] == "plain"]
            base = statistics.mean(plain) if plain else None
            plain8 = [r["tokens_per_s"] for r in runs if r["run"] == PLAIN_FP8]
            base8 = statistics.mean(plain8) if plain8 else None
            seen_plain = False
            for r in runs:
                if r["run"] == "plain":
                    if seen_plain:
                        continue
                    seen_plain = True
                    r = dict(r, tokens_per_s=base, ms_per_step=statistics.mean(
                        x["ms_per_step"] for x in runs if x["run"] == "plain"))
                x = f"{r['tokens_per_s'] / base:.3f}x" if base else "-"
                x8 = (f"{r['tokens_per_s'] / base8:.3f}x | " if base8 else "- | ") if fp8 else ""
                lines.append(f"| {tag} | {r['run']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {x} | {x8}"
                             f"{r['first_step_s']:.1f} |")
        lines.append("")
    lines += _ratio_table("**Block fwd+bwd** (baseline: the plain XLA Llama block, `benchmarks/xla_llama_block.py`)",
                          "width", block_ratios(rows))
    lines += _ratio_table("**Fused ops fwd+bwd** (baseline: the same op written in plain JAX, `benchmarks/plain_ops.py`, "
                          "same inputs, `jax.grad`)", "op", op_ratios(rows))
    lines += _ratio_table("**Fused ops fwd+bwd, device time** (the same runs: summed GPU kernel time; the "
                          "wall-clock times above also count the time between and around the kernels)", "op",
                          op_ratios(rows, "fwdbwd_device_ms"))
    return "\n".join(lines)


def _ratio_table(heading: str, first: str, ratios: dict[str, dict[str, float]]) -> list[str]:
    """A markdown table of ``{row: {column: ratio}}`` under ``heading`` (none if empty)."""
    if not ratios:
        return []
    cols = sorted({b for v in ratios.values() for b in v})
    lines = [heading, "", f"| {first} | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for k, v in ratios.items():
        lines.append(f"| {k} | " + " | ".join(f"{v[c]:.3f}x" if c in v else "-" for c in cols) + " |")
    return lines + [""]


def chart(steps: dict, rows: list[dict], path: Path, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The op panel plots device time (kernel time) where the runs measured it, else wall-clock.
    op_device = op_ratios(rows, "fwdbwd_device_ms")
    panels = [("train step vs plain JAX", step_ratios(steps)), ("block fwd+bwd vs plain XLA block", block_ratios(rows)),
              ("fused op fwd+bwd vs plain JAX op, device time", op_device) if op_device
              else ("fused op fwd+bwd vs plain JAX op", op_ratios(rows))]
    panels = [(t, d) for t, d in panels if d]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * max(len(panels), 1)), squeeze=False)
    # One colour per run label across panels (a backend keeps its colour from chart to chart).
    every_run = sorted({r for _, d in panels for v in d.values() for r in v})
    palette = plt.get_cmap("tab10")
    colour = {run: palette(i % 10) for i, run in enumerate(every_run)}
    for ax, (title, data) in zip(axes[:, 0], panels):
        groups = list(data)
        runs = sorted({r for v in data.values() for r in v})
        width = 0.8 / max(len(runs), 1)
        for i, run in enumerate(runs):
            xs = [g + (i - (len(runs) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [data[g].get(run, 0.0) for g in groups], width, label=run, color=colour[run])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(groups)), groups, fontsize=7)
        ax.set_ylabel("speed-up")
        ax.set_title(title, fontsize=9)
        lo = min([v for d in data.values() for v in d.values()] + [1.0])
        ax.set_ylim(max(0.0, lo - 0.15), None)
        ax.legend(fontsize=6, ncol=4)
    fig.suptitle(textwrap.fill(label, 120), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update(results_md: Path, section: str, png: Path) -> None:
    text = results_md.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{results_md} has no {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    results_md.write_text(f"{head}{BEGIN}\n{section}\n{END}{tail}")
    shutil.copyfile(png, results_md.parent / "results.png")


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--label", required=True, help="run number, device, date and commit")
    ap.add_argument("--out", type=Path, default=None, help="where current.md/png go (default: the first dir)")
    ap.add_argument("--update", type=Path, default=None, help="RESULTS.md whose current section is replaced")
    args = ap.parse_args(argv)
    steps, rows = load(args.dirs)
    if not steps and not rows:
        ap.error(f"no train_step.json or bench.json in {', '.join(map(str, args.dirs))}")
    out = args.out or args.dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(steps, rows, args.label)
    (out / "current.md").write_text(md + "\n")
    chart(steps, rows, out / "current.png", args.label)
    if args.update:
        update(args.update, md, out / "current.png")
    print(md)
    return md


if __name__ == "__main__":
    main()
