"""Compare the loss curves of training runs on different backends (same seed and data).

    python benchmarks/compare_losses.py runs/xla runs/pallas [runs/cutedsl]

Reads ``history.json`` and ``summary.json`` of each run directory (written by
``examples/train_llama.py``); the first run is the reference. Prints, per backend, the
relative difference of the training loss averaged over windows of 25 steps (the largest
window after the first 50 steps, and the last window), of the final validation loss, and
the steady-state tokens/s and MFU. Writes ``loss_compare.json`` beside the first run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

WINDOW = 25


def _windows(losses: list[float]) -> list[float]:
    return [sum(losses[i:i + WINDOW]) / len(losses[i:i + WINDOW]) for i in range(0, len(losses), WINDOW)]


def compare(dirs: list[Path]) -> list[dict]:
    runs = [(json.loads((d / "history.json").read_text()), json.loads((d / "summary.json").read_text())) for d in dirs]
    ref_hist, _ = runs[0]
    ref_w = _windows(ref_hist["loss"])
    rows = []
    for d, (hist, summ) in zip(dirs, runs):
        w = _windows(hist["loss"])
        n = min(len(w), len(ref_w))
        rel = [abs(w[i] - ref_w[i]) / abs(ref_w[i]) for i in range(n)]
        later = rel[2:] or rel  # skip the first 50 steps (warm-up transients)
        val = hist["val_loss"][-1] if hist["val_loss"] else float("nan")
        ref_val = ref_hist["val_loss"][-1] if ref_hist["val_loss"] else float("nan")
        # gpu_suite.sh names run directories train_<backend or variant spec>
        label = d.name.removeprefix("train_") if d.name.startswith("train_") else summ.get("backend")
        rows.append({"run": str(d), "label": label, "backend": summ.get("backend"), "steps": len(hist["loss"]),
                     "last_window_loss": w[n - 1] if n else float("nan"),
                     "max_window_rel_diff": max(later) if later else float("nan"),
                     "last_window_rel_diff": rel[-1] if rel else float("nan"),
                     "val_loss": val, "val_rel_diff": abs(val - ref_val) / abs(ref_val),
                     "tokens_per_s": summ.get("tokens_per_s"), "mfu": summ.get("mfu")})
    return rows


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: compare_losses.py REF_RUN_DIR OTHER_RUN_DIR [...]")
    dirs = [Path(a) for a in argv]
    rows = compare(dirs)
    (dirs[0] / "loss_compare.json").write_text(json.dumps(rows, indent=1))
    print(f"| run | steps | loss (last window of <= {WINDOW}) | max rel diff (windows of {WINDOW}, after 50) | "
          "last rel diff | val loss | val rel diff | tokens/s | MFU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] is not None else "-"
        print(f"| {r['label']} | {r['steps']} | {r['last_window_loss']:.4f} | {r['max_window_rel_diff']:.2%} | "
              f"{r['last_window_rel_diff']:.2%} | {r['val_loss']:.4f} | {r['val_rel_diff']:.2%} | {tps} | {mfu} |")


if __name__ == "__main__":
    main(sys.argv[1:])
