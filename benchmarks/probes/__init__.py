"""One-off probes kept for a measurement that may be repeated (``python -m benchmarks.probes.<name>``).

* ``kernel_probe``: runs one epilogue-benchmark kernel a few times, a target for Nsight
  Compute (``ncu ... python -m benchmarks.probes.kernel_probe 'identity dgrad-f' --backend
  pallas``; its warp stalls per SASS instruction: ``python -m benchmarks.sass_hotspots``).
  Findings: HISTORY.md, runs 182, 241 and 245.
"""
