"""Compare the loss curves of training runs on different backends (same seed and data).

    python -m benchmarks.compare_losses [--curves FILE] runs/xla runs/pallas [runs/cutedsl ...]

Reads ``history.json`` and ``summary.json`` of each run directory (written by
``examples/train_llama.py``); the first run is the reference. Prints, per run, the relative
difference of the training loss averaged over windows of 25 steps (the largest window after
the first 50 steps, and the last window), the largest per-step difference over the first
``EARLY`` steps (before a loss spike can amplify rounding differences), the final validation
loss, and the steady-state tokens/s and MFU. Writes ``loss_compare.json`` beside the first
run and, with ``--curves``, every run's per-step losses in one JSON file. ``--pool`` reads
such files from several device calls and prints each backend's mean and spread over all
its runs (``benchmarks/curves/`` keeps those behind HISTORY.md).

The runs are ``examples/train_llama.py`` runs, one per backend, e.g. ``python3
examples/train_llama.py --backend pallas --preset 1b --steps 300 --ckpt-every 0 --no-resume
--out /tmp/train_pallas``; a directory named ``train_<label>`` is labelled ``<label>``, else by
its backend. A rerun of the same backend, or the reference under other GEMM algorithms
(``XLA_FLAGS=--xla_gpu_autotune_level=0``), measures how far two equally exact runs drift
apart: the noise floor a backend's difference is judged against.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

WINDOW = 25
EARLY = 6


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[i:i + WINDOW]) / len(losses[i:i + WINDOW]) for i in range(0, len(losses), WINDOW)]


def _label(d: Path, summ: dict) -> str:
    # a run directory named train_<label> (the device runs' convention) is labelled <label>
    return d.name.removeprefix("train_") if d.name.startswith("train_") else str(summ.get("backend"))


def compare(dirs: list[Path]) -> list[dict]:
    """One row per run directory: its loss curve against the first directory's."""
    runs = [(json.loads((d / "history.json").read_text()), json.loads((d / "summary.json").read_text())) for d in dirs]
    ref_hist, _ = runs[0]
    ref_w = _windows(ref_hist["loss"])
    rows = []
    for d, (hist, summ) in zip(dirs, runs):
        w = _windows(hist["loss"])
        n = min(len(w), len(ref_w))
        rel = [abs(w[i] - ref_w[i]) / abs(ref_w[i]) for i in range(n)]
        later = rel[2:] or rel  # skip the first 50 steps (warm-up transients)
        early = [abs(a - b) / abs(b) for a, b in zip(hist["loss"][:EARLY], ref_hist["loss"][:EARLY])]
        val = hist["val_loss"][-1] if hist["val_loss"] else float("nan")
        ref_val = ref_hist["val_loss"][-1] if ref_hist["val_loss"] else float("nan")
        rows.append({"run": str(d), "label": _label(d, summ), "backend": summ.get("backend"),
                     "steps": len(hist["loss"]),
                     "last_window_loss": w[n - 1] if n else float("nan"),
                     "max_window_rel_diff": max(later) if later else float("nan"),
                     "last_window_rel_diff": (w[n - 1] - ref_w[n - 1]) / abs(ref_w[n - 1]) if n else float("nan"),
                     "early_max_rel_diff": max(early) if early else float("nan"),
                     "val_loss": val, "val_rel_diff": (val - ref_val) / abs(ref_val),
                     "tokens_per_s": summ.get("tokens_per_s"), "mfu": summ.get("mfu")})
    return rows


def curves(dirs: list[Path]) -> dict[str, dict]:
    """Every run's per-step training losses and validation losses, keyed by run label."""
    out = {}
    for d in dirs:
        hist = json.loads((d / "history.json").read_text())
        summ = json.loads((d / "summary.json").read_text())
        out[_label(d, summ)] = {"loss": hist["loss"], "val_step": hist["val_step"], "val_loss": hist["val_loss"],
                                "summary": summ}
    return out


def table(rows: list[dict]) -> str:
    lines = [f"| run | steps | loss (last window of <= {WINDOW}) | max abs rel diff (windows of {WINDOW}, after 50) | "
             f"last window rel diff | max rel diff steps 0-{EARLY - 1} | val loss | val rel diff | tokens/s | MFU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "-"
        lines.append(f"| {r['label']} | {r['steps']} | {r['last_window_loss']:.4f} | {r['max_window_rel_diff']:.2%} | "
                     f"{r['last_window_rel_diff']:+.2%} | {r['early_max_rel_diff']:.4%} | {r['val_loss']:.4f} | "
                     f"{r['val_rel_diff']:+.2%} | {tps} | {mfu} |")
    return "\n".join(lines)


def pooled(curve_files: list[Path]) -> list[dict]:
    """Per backend (run labels with their ``_runN`` suffix dropped), over every run in the
    ``--curves`` files of several device calls: mean, standard deviation, min and max of the
    mean training loss over steps 25-49 and 50-59 and of the final validation loss."""
    import statistics

    groups: dict[str, list[dict]] = {}
    for f in curve_files:
        for label, run in json.loads(f.read_text()).items():
            groups.setdefault(re.sub(r"_run\d+$", "", label), []).append(run)
    rows = []
    for label, runs in groups.items():
        row = {"label": label, "runs": len(runs)}
        for name, values in (("loss_25_49", [statistics.fmean(r["loss"][25:50]) for r in runs]),
                             ("loss_50_59", [statistics.fmean(r["loss"][50:60]) for r in runs]),
                             ("val_loss", [r["val_loss"][-1] for r in runs])):
            row[name] = {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "min": min(values), "max": max(values)}
        rows.append(row)
    return rows


def pooled_table(rows: list[dict]) -> str:
    ref = rows[0]
    lines = ["| backend | runs | loss steps 25-49: mean (sd) | loss steps 50-59: mean (sd) [min, max] | "
             "vs first, 50-59 | val loss: mean (sd) | vs first, val |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        a, b, v = r["loss_25_49"], r["loss_50_59"], r["val_loss"]
        lines.append(f"| {r['label']} | {r['runs']} | {a['mean']:.4f} ({a['sd']:.4f}) | {b['mean']:.4f} ({b['sd']:.4f}) "
                     f"[{b['min']:.4f}, {b['max']:.4f}] | {b['mean'] / ref['loss_50_59']['mean'] - 1:+.2%} | "
                     f"{v['mean']:.4f} ({v['sd']:.4f}) | {v['mean'] / ref['val_loss']['mean'] - 1:+.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", type=Path, help="run directories; the first is the reference")
    p.add_argument("--curves", type=Path, default=None, help="write every run's per-step losses here (JSON)")
    p.add_argument("--pool", nargs="+", type=Path, default=None,
                   help="instead: --curves files of several calls; mean and spread per backend over all their runs")
    args = p.parse_args(argv)
    if args.pool:
        print(pooled_table(pooled(args.pool)))
        return
    if len(args.runs) < 2:
        p.error("runs: give the reference run directory and at least one other")
    rows = compare(args.runs)
    (args.runs[0] / "loss_compare.json").write_text(json.dumps(rows, indent=1))
    if args.curves is not None:
        args.curves.write_text(json.dumps(curves(args.runs)))
    print(table(rows))


if __name__ == "__main__":
    main()
