"""coda-jax's benchmark tools (a folder of the repository, not part of the installed package).

Run each from the repository root as a module, e.g. ``python -m benchmarks.train_step_bench
--preset 1b --runs plain,pallas,plain`` (``--help`` says what it measures); tests import them
as ``from benchmarks import bench``. Variants of a run are typed coda-jax options
(:func:`coda_jax.options.parse_overrides`), not environment variables.

The tools of record:

* ``train_step_bench``: train-step tokens/s per backend against the plain JAX Llama;
* ``plain_llama``, ``plain_ops``, ``xla_llama_block``: the plain JAX baselines (the model, each
  fused op, the block);
* ``bench``: each fused op, the GEMM, the epilogues and the block against their baselines;
* ``summarize``: the current section of ``RESULTS.md`` and its chart;
* ``compile_time``: first-step compile time per backend, cold and warm caches;
* ``compare_losses``: loss curves of training runs against a reference;
* ``tune``: the Pallas autotuner's sweeps and tuned tables; ``kernel_plans``: what each kernel
  call plans to, without a GPU;
* where the time goes: ``profile_block`` (kernel profiles), ``device_time`` (CUPTI kernel
  time), ``step_ceiling`` (a profiled step's bounds), ``kernel_timeline`` (the Pallas
  kernel's in-kernel profiler), ``hlo_schedule`` (XLA's schedule around collectives),
  ``gpu_clock`` (SM clock and power), ``sass_hotspots`` (ncu's warp stalls per instruction);
* one training step looked at closely: ``first_step`` (the example's first batch),
  ``repeat_probe`` (bit-repeatability per block), ``grad_error_probe`` (each gradient's error).

``probes/`` keeps one-off probes that may be run again. ``gpu_tests.sh`` and ``gpu_bench.sh``
are the device scripts. ``RESULTS.md`` holds the current numbers, the chart and an index of
``HISTORY.md``, the run-by-run log.
"""
