"""Where a kernel's warps stall, per SASS instruction: reads Nsight Compute's source page.

    ncu --clock-control none -k regex:coda_ -c 1 --section SourceCounters -o prof python3 ...
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 -m benchmarks.sass_hotspots sass.csv [--top 40]

Prints the warp-stall samples summed per opcode (the part before the first '.'), then the
``--top`` instructions by samples with their address, text and the stall-reason columns that
hold samples. Column names are found by substring, so ncu versions that rename a column
slightly still parse.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import sys


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def read_rows(path: str) -> tuple[list[str], list[dict[str, str]]]:
    """The CSV's header and rows (lines before the header, e.g. ncu's banner, are skipped)."""
    text = open(path, encoding="utf-8", errors="replace").read().splitlines()
    start = next((i for i, line in enumerate(text) if '"Source"' in line or line.startswith('"Address"')), 0)
    reader = csv.DictReader(io.StringIO("\n".join(text[start:])))
    return list(reader.fieldnames or []), list(reader)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    cols, rows = read_rows(args.csv)
    if not rows:
        sys.exit(f"{args.csv}: no rows")
    print("columns:", cols)
    samp = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    src = next((c for c in cols if c == "Source"), None) or next((c for c in cols if "Source" in c), cols[0])
    if samp is None:
        sys.exit("no 'Warp Stall Sampling (All Samples)' column")
    total = sum(_num(r[samp]) for r in rows)
    by_op: dict[str, float] = collections.Counter()
    for r in rows:
        text = r[src].strip()
        op = text.split()[0] if text else "?"
        if op.startswith("@"):  # predicate
            op = text.split()[1] if len(text.split()) > 1 else op
        by_op[op.split(".")[0]] += _num(r[samp])
    print(f"\nsamples {total:.0f} in {len(rows)} instructions; per opcode:")
    for op, s in sorted(by_op.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {op:12s} {s:9.0f}  {100 * s / max(total, 1):5.1f} %")
    reason_cols = [c for c in cols if "stall" in c.lower() and "Sampling" not in c]
    reason_cols = [c for c in reason_cols if sum(_num(r[c]) for r in rows) > 0]
    addr = next((c for c in cols if c.lower().startswith("address")), None)
    print(f"\ntop {args.top} instructions by samples:")
    for i, r in sorted(enumerate(rows), key=lambda ir: -_num(ir[1][samp]))[:args.top]:
        s = _num(r[samp])
        reasons = sorted(((c, _num(r[c])) for c in reason_cols if _num(r[c]) > 0), key=lambda t: -t[1])[:3]
        rs = ", ".join(f"{c}={v:.0f}" for c, v in reasons)
        print(f"  #{i:5d} {r.get(addr, '') if addr else '':>8s} {s:7.0f} {100 * s / max(total, 1):5.1f}%  "
              f"{r[src].strip()[:70]:70s} {rs}")


if __name__ == "__main__":
    main()
