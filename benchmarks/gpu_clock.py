"""The SM clock and power draw of the GPUs while a block of code runs (``nvidia-smi``).

    with ClockSampler() as clock:
        ...  # the timed steps
    clock.summary  # {"sm_clock_mhz": 1545.0, "power_w": 694.0, "samples": 75} or None

A training step keeps an H100 at its power cap, where the SM clock falls well below its
1980 MHz boost (benchmarks/HISTORY.md, run 216); two runs compared in tokens/s may run at
different clocks. The sampler runs ``nvidia-smi --query-gpu=clocks.sm,power.draw -lms
PERIOD`` beside the block and reports the medians over every sample of every GPU the process
sees: ``nvidia-smi`` ignores ``CUDA_VISIBLE_DEVICES``, so the sampler passes its list as
``-i`` (run 276 ran on two of four GPUs and its medians mixed in the two idle ones). Without
``nvidia-smi`` (a CPU machine) the summary is ``None``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess


def parse_samples(text: str) -> list[tuple[float, float]]:
    """``(MHz, W)`` per line of ``nvidia-smi --format=csv,noheader,nounits`` output
    (``"1545, 694.12"``); lines that are not two numbers are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            out.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return out


def command(period_ms: int) -> list[str]:
    """The ``nvidia-smi`` command line that samples the GPUs this process sees: those of
    ``$CUDA_VISIBLE_DEVICES`` (indices or UUIDs, as ``nvidia-smi -i`` takes them) if set."""
    cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", str(period_ms)]
    visible = ",".join(d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip())
    return cmd + ["-i", visible] if visible else cmd


def summarize(samples: list[tuple[float, float]]) -> dict | None:
    """Medians of the samples' clock and power, and their count (``None`` if there are none)."""
    if not samples:
        return None
    return {"sm_clock_mhz": statistics.median(c for c, _ in samples),
            "power_w": round(statistics.median(p for _, p in samples), 1), "samples": len(samples)}


class ClockSampler:
    """Context manager: samples every ``period_ms`` while its block runs (see the module)."""

    def __init__(self, period_ms: int = 100):
        self.period_ms = period_ms
        self.summary: dict | None = None
        self._proc = None

    def __enter__(self) -> "ClockSampler":
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(command(self.period_ms), stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.summary = summarize(parse_samples(out or ""))
