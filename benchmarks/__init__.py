"""coda-jax's benchmark tools (not part of the installed package).

Run each from the repository root as a module, e.g. ``python -m benchmarks.train_step_bench
--preset 1b --runs plain,pallas,plain``; tests import them as ``from benchmarks import bench``.
The tools of record:

* ``train_step_bench``: train-step tokens/s per backend against the plain JAX Llama;
* ``plain_llama``, ``plain_ops``, ``xla_llama_block``: the plain JAX baselines;
* ``bench``: each fused op, the GEMM, the epilogues and the block against their baselines;
* ``summarize``: the current section of ``benchmarks/RESULTS.md`` and its chart;
* ``compile_time``: first-step compile time, cold and warm caches;
* ``compare_losses``: loss curves of training runs against a reference;
* ``tune``: the Pallas autotuner's sweeps (tuned tables);
* ``profile_block``, ``device_time``, ``step_ceiling``, ``kernel_timeline``, ``hlo_schedule``,
  ``gpu_clock``: where the time goes (kernel profiles, schedules, clocks).

``gpu_tests.sh`` and ``gpu_bench.sh`` are the device scripts; ``RESULTS.md`` holds the current
numbers and an index of ``HISTORY.md``, the run-by-run log.
"""
