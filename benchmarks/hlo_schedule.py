"""What XLA's schedule puts between each async collective's start and its done.

A compiled module's HLO text (``compiled.as_text()``) lists each computation's instructions
in schedule order. A collective overlaps compute only where the scheduler placed compute
between its ``*-start`` and ``*-done``; this module counts, for each async collective, the
instructions in that window by kind, so a profile that shows collectives never running
beside some kernel (e.g. the Mosaic GPU custom calls) can be told apart: the scheduler kept
those kernels out of the windows, or the runtime serialized them although they were in.

    from benchmarks.hlo_schedule import collective_windows, window_summary
    print(window_summary(collective_windows(compiled.as_text())))

:func:`kind_timeline` draws the entry computation's schedule one letter per kernel, so
where the collectives fall against the kernels shows at a glance; from the command line,
``python -m benchmarks.hlo_schedule hlo.txt[.gz]`` (``train_step_bench.py --hlo-out``)
prints both.
"""

from __future__ import annotations

import collections
import gzip
import re
import sys

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*.*?\s([a-z][a-z0-9-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_WRAPPED = re.compile(r"calls=%([\w.\-]+)")
# The collectives' synchronous opcodes (the async ones end in -start / -done).
_SYNC_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def op_kind(opcode: str, line: str) -> str:
    """An instruction's kind for the window counts: ``mosaic`` (a Mosaic GPU custom call:
    a Pallas kernel), ``ffi`` (another custom call that is not cuBLAS: e.g. a CuTeDSL
    kernel), ``cublas``, ``gemm_fusion`` (XLA's Triton or cuBLAS GEMM fusions), ``fusion``
    (other fusions), ``collective``, or ``other``."""
    if opcode == "custom-call":
        target = (_TARGET.search(line) or [None, ""])[1]
        if target.startswith("mosaic_gpu"):
            return "mosaic"
        if "cublas" in target or "gemm" in target.lower():
            return "cublas"
        if "cudnn" in target:
            return "cudnn"
        return "ffi"
    if opcode == "fusion":
        return "gemm_fusion" if "gemm_fusion" in line.split("=", 1)[0] or '"kind":"__triton_gemm"' in line \
            or "__cublas" in line else "fusion"
    if opcode.endswith("-start") or opcode.endswith("-done") or opcode in _SYNC_COLLECTIVES:
        return "collective"
    return "other"


def _computation_name(header: str) -> str:
    """The name in a computation's header line (``ENTRY %main (p: ...) -> ... {`` -> ``main``)."""
    return header.strip().split("(", 1)[0].replace("ENTRY", "").strip().lstrip("%")


def _computations(hlo: str):
    """``(name, [lines])`` of each computation of the module text, in order."""
    name, body = None, []
    for line in hlo.splitlines():
        stripped = line.strip()
        if name is None:
            if stripped.endswith("{") and not stripped.startswith("HloModule"):
                name, body = _computation_name(stripped), []
            continue
        if stripped == "}":
            yield name, body
            name = None
        else:
            body.append(line)


_CALLED = re.compile(r"to_apply=%([\w.\-]+)")
# The kind a call takes from the kernels of the computation it calls (the first found).
_KERNEL_KINDS = ("mosaic", "ffi", "cublas", "cudnn", "gemm_fusion", "fusion", "collective")


def _kinds(comps: dict[str, list[tuple[str, str, str, str]]]) -> dict[str, str]:
    """The kind of each computation's kernels: a ``call`` of it counts as that kind."""
    memo: dict[str, str] = {}

    def kind_of(name: str, depth: int = 0) -> str:
        if name in memo:
            return memo[name]
        found = set()
        for _, opcode, _, line in comps.get(name, ()):
            k = op_kind(opcode, line)
            if opcode == "call" and depth < 8 and (c := _CALLED.search(line)):
                k = kind_of(c.group(1), depth + 1)
            found.add(k)
        memo[name] = next((k for k in _KERNEL_KINDS if k in found), "other")
        return memo[name]

    return {name: kind_of(name) for name in comps}


def _parsed(hlo: str):
    """``(comps, kind)``: each computation's instructions ``(name, opcode, rest, line)`` in
    schedule order, and ``kind(opcode, line)``, :func:`op_kind` with a ``call`` counted as the
    kind of the kernels it calls."""
    comps = {}
    for comp, lines in _computations(hlo):
        comps[comp] = [(m.group(1), m.group(2), m.group(3), line) for line in lines if (m := _INSTR.match(line))]
    call_kinds = _kinds(comps)

    def kind(opcode: str, line: str) -> str:
        if opcode == "call" and (c := _CALLED.search(line)):
            return call_kinds.get(c.group(1), "other")
        return op_kind(opcode, line)

    return comps, kind


def collective_windows(hlo: str) -> list[dict]:
    """One record per async collective of ``hlo`` (scheduled module text): its computation,
    ``op`` (e.g. ``all-reduce`` or the wrapped op of an ``async-start``), ``between``, the
    count of each :func:`op_kind` scheduled between its start and its done (a ``call``
    counts as the kind of the kernels it calls, e.g. a jitted Pallas kernel as ``mosaic``),
    and ``after``: the kind of the instruction just after the done."""
    comps, kind = _parsed(hlo)
    out = []
    for comp, parsed in comps.items():
        open_at: dict[str, tuple[int, str]] = {}
        defined = {name: i for i, (name, *_) in enumerate(parsed)}

        def kernels(lo: int, hi: int) -> dict[str, int]:
            # what runs on the GPU between two schedule positions (exclusive)
            c = collections.Counter(kind(o, ln) for _, o, _, ln in parsed[lo + 1:hi])
            return {k: v for k, v in c.items() if k in _KERNEL_KINDS and k != "collective"}

        for i, (name, opcode, rest, line) in enumerate(parsed):
            if opcode.endswith("-start") and opcode != "copy-start":
                op = opcode[:-len("-start")]
                if opcode == "async-start":
                    wrapped = _WRAPPED.search(line)
                    op = f"async:{wrapped.group(1) if wrapped else '?'}"
                open_at[name] = (i, op)
            elif opcode.endswith("-done") and opcode != "copy-done":
                first = _OPERAND.search(rest)
                if first and first.group(1) in open_at:
                    j, op = open_at.pop(first.group(1))
                    between = collections.Counter(kind(o, ln) for _, o, _, ln in parsed[j + 1:i])
                    after = kind(parsed[i + 1][1], parsed[i + 1][3]) if i + 1 < len(parsed) else "none"
                    # Slack on either side: the kernels scheduled after the start's operands
                    # were ready but before the start, and after the done but before its
                    # first user (both empty: the window is as wide as the data allows).
                    ready = max((defined[o] for o in _OPERAND.findall(parsed[j][2].split("),", 1)[0])
                                 if defined.get(o, j) < j), default=-1)
                    user = next((u for u in range(i + 1, len(parsed)) if f"%{name}" in parsed[u][2]
                                 and re.search(rf"%{re.escape(name)}(?![\w.\-])", parsed[u][2])), len(parsed))
                    out.append({"computation": comp, "op": op, "start": parsed[j][0], "between": dict(between),
                                "after": after, "before_start": kernels(ready, j), "before_use": kernels(i, user)})
    return out


def window_summary(windows: list[dict]) -> str:
    """One line per collective op kind: how many, and the mean count of each instruction kind
    in their windows (e.g. ``mosaic 0.0`` where no Pallas kernel is ever overlapped)."""
    by_op: dict[str, list[dict]] = collections.defaultdict(list)
    for w in windows:
        op = w["op"]
        if op.startswith("async:"):
            op = re.sub(r"[.\d]+$", "", op[len("async:"):]) or "async"
        by_op[op].append(w)
    lines = []
    for op, ws in sorted(by_op.items()):
        bs = [w["between"] for w in ws]
        kinds = sorted({k for b in bs for k in b})
        mean = "  ".join(f"{k} {sum(b.get(k, 0) for b in bs) / len(bs):.1f}" for k in kinds)
        empty = sum(1 for b in bs if not any(v for k, v in b.items() if k != "other"))
        after = collections.Counter(w["after"] for w in ws)

        def mean_of(key: str) -> str:
            got = sorted({k for w in ws for k in w.get(key, {})})
            return "  ".join(f"{k} {sum(w[key].get(k, 0) for w in ws) / len(ws):.1f}" for k in got) or "none"

        lines.append(f"{op}: {len(bs)} async, {empty} with no kernel inside; mean ops inside: {mean or 'none'}; "
                     f"after the done: " + " ".join(f"{k} {v}" for k, v in after.most_common())
                     + f"; kernels between operands ready and start: {mean_of('before_start')}"
                     + f"; between done and first use: {mean_of('before_use')}")
    return "\n".join(lines) if lines else "no async collectives"


# One letter per kernel kind in kind_timeline; "[" and "]" an async collective's start and done.
TIMELINE_LETTERS = {"mosaic": "M", "ffi": "K", "cublas": "C", "cudnn": "A", "gemm_fusion": "G", "fusion": "f"}


def kind_timeline(hlo: str) -> str:
    """The entry computation of ``hlo`` in schedule order, one letter per kernel
    (:data:`TIMELINE_LETTERS`; a ``call`` as the kind of the kernels it calls), ``[`` at each
    async collective's start and ``]`` at its done, ``S`` at a synchronous collective; other
    instructions (bitcasts, tuples, parameters) are left out. E.g. ``MMfM[Gf][G]`` is three
    Pallas kernels and a fusion, then two gradient all-reduces in a row, each beside one GEMM
    fusion."""
    comps, kind = _parsed(hlo)
    entry = next((_computation_name(line) for line in hlo.splitlines() if line.startswith("ENTRY")), None)
    out = []
    for _, opcode, _, line in comps.get(entry, ()):
        if opcode.endswith("-start") and opcode != "copy-start":
            out.append("[")
        elif opcode.endswith("-done") and opcode != "copy-done":
            out.append("]")
        elif opcode in _SYNC_COLLECTIVES:
            out.append("S")
        else:
            out.append(TIMELINE_LETTERS.get(kind(opcode, line), ""))
    return "".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        text = (gzip.open if path.endswith(".gz") else open)(path, "rt").read()
        print(f"== {path}\n{window_summary(collective_windows(text))}\n{kind_timeline(text)}")
