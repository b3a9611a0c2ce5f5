"""Shared test fixtures: float32 math on the CPU, GPU tests skipped without a Hopper GPU."""

import os

import jax
import numpy as np
import pytest

from coda_jax.pallas.interpret import ensure_interpreter_threads
from tiers import default_tier
from suite_options import apply_suite_compile_cache, apply_suite_options, apply_suite_xla_flags, suite_compile_cache_env

# The Mosaic GPU interpreter blocks one CPU-client pool thread per simulated warpgroup at a
# barrier; with the default pool (one thread per core) a 2-core machine hung about one run in
# 16 of the warp-specialized kernel tests. The pool is sized when JAX creates its CPU client,
# so this must run before any test touches a device (see coda_jax/pallas/interpret.py).
ensure_interpreter_threads()
# With CODA_JAX_TESTS_XLA_OPT=fast, XLA's CPU code unoptimized (tests/suite_options.py: opt-in),
# also before any test touches a device; subprocesses inherit it.
apply_suite_xla_flags()

# The Pallas kernel cache is on by default (in ~/.cache/coda_jax/kernels); tests that lower
# kernels for CUDA must neither read nor fill a developer's cache: off here and in every
# subprocess, on only where tests/test_kernel_cache.py turns it on.
os.environ["CODA_JAX_KERNEL_CACHE_DIR"] = "off"

# The routing rules off for the suite's small shapes (tests/suite_options.py).
apply_suite_options()
# One JAX persistent compilation cache for the session's processes (tests/suite_options.py):
# made here in the first process, before xdist starts its workers (they inherit its path).
apply_suite_compile_cache()


def _hopper() -> bool:
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


# The CPU suite's longest tests (15-80 s each on 2 cores, `--durations=0` of 6bfab39's suite),
# run first: with pytest-xdist's two workers, a long test left for the end keeps one worker
# busy while the other idles.
SLOW_FIRST = (
    "test_autotune.py::test_extended_candidates_lower_for_cuda",
    "test_partitioning.py::test_on_eight_devices",
    "test_cutedsl_lowering.py::test_kernels_do_not_spill",
    "test_bench_tools.py::test_train_step_bench_runs_plain_and_coda_under_each_runs_options",
    "test_partitioning.py::test_train_example_on_meshes_matches_one_device",
    "test_cutedsl_fp8.py::test_quantizing_kernels_do_not_spill",
    "test_multi_process.py::test_two_processes_train_as_one_process",  # two processes of two devices each
    "test_fp8.py::test_fp8_model_step_on_pallas_matches_xla",
    "test_partitioning.py::test_mesh_fuzz",
    "test_multi_process.py::test_the_two_processes_see_the_batches_of_one_device",
    "test_bench_tools.py::test_fp8_accuracy_over_seeds_and_recipes",
    "test_ops_pallas.py::test_block_on_pallas_matches_xla_backend",
    "test_shape_fuzz.py::test_model_draw_on_pallas",
    "test_bench_tools.py::test_grad_error_probe_measures_the_bf16_rounding_of_a_training_step",
    "test_train_example.py::test_short_training_run_learns_and_resumes",
    "test_train_example.py::test_sample_from_a_training_run",
    "test_cutedsl_fp8.py::test_fp8_model_step_lowers_on_the_fp8_kernel",
    "test_bench_tools.py::test_fp8_block_gemms_time_each_fp8_call_against_the_bare_gemm",
    "test_partitioning.py::test_small_outputs_are_handed_to_xla_per_shard",
)


def _slow_rank(item) -> int:
    nodeid = item.nodeid.rsplit("/", 1)[-1]
    return next((i for i, p in enumerate(SLOW_FIRST) if nodeid.startswith(p)), len(SLOW_FIRST))


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="the full tier: also the tests tests/tiers.py leaves out of the default run "
                          "(also CODA_JAX_TESTS=full); they are marked slow")


def full_tier(config) -> bool:
    """Whether this run is the full tier (tests/tiers.py)."""
    return config.getoption("--full") or os.environ.get("CODA_JAX_TESTS", "default") == "full"


def _apply_tiers(config, items) -> None:
    """The default tier deselects what tests/tiers.py leaves to the full one; the full tier
    marks those tests ``slow`` (``--full -m slow`` runs only them). GPU tests are not tiered."""
    ids = [item.nodeid.split("tests/", 1)[-1] for item in items]
    config.coda_collected_ids = ids  # every worker collects the whole run (tests/test_tiers.py)
    keep = default_tier(ids)
    kept, extra = [], []
    for item, i in zip(items, ids):
        (kept if i in keep or "gpu" in item.keywords else extra).append(item)
    if full_tier(config):
        for item in extra:
            item.add_marker(pytest.mark.slow)
    elif extra:
        config.hook.pytest_deselected(items=extra)
        items[:] = kept


@pytest.hookimpl(tryfirst=True)  # before -m and -k select: they see the tier's marks
def pytest_collection_modifyitems(config, items):
    _apply_tiers(config, items)
    items.sort(key=_slow_rank)  # stable: the rest keep their order
    if _hopper():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (run benchmarks/gpu_tests.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_backend_state(monkeypatch):
    """Each test starts with the suite's options only: no process-wide backend, no env overrides."""
    import coda_jax

    monkeypatch.delenv("CODA_JAX_BACKEND", raising=False)
    monkeypatch.delenv("CODA_JAX_ALLOW_FALLBACK", raising=False)
    coda_jax.reset_options()
    apply_suite_options()
    yield
    coda_jax.reset_options()
    apply_suite_options()


@pytest.fixture(scope="session")
def subprocess_compile_cache() -> dict[str, str]:
    """Environment variables that give the suite's subprocesses (tests/multi_device_cases.py's
    8-device processes) the session's JAX persistent compilation cache
    (tests/suite_options.py: :func:`suite_compile_cache_env`); ``{}`` where it is off
    (``CODA_JAX_TESTS_COMPILE_CACHE=off``, or a machine with a GPU). Most of such a process's
    time is XLA compiling, and many of its programs recur from process to process (each
    model's eager initialization ops, the one-device references)."""
    return suite_compile_cache_env()


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
