"""The options every test process runs under (the suite's own, set by tests/conftest.py and by
the scripts the tests start in subprocesses, e.g. tests/multi_device_cases.py).

Kernel backends hand fused GEMMs with small outputs to XLA by default (the option
``routing.xla_output_below``); every test shape is that small, so the rule is off here and
tests/test_pallas_kernels.py tests it. Under FSDP, GEMMs go to XLA's partitioner, or to the
xla backend's lowering, below some tokens a device (``mesh.fsdp_xla_tokens_below``,
``mesh.fsdp_xla_gemms_below``); the mesh tests' batches are that small and test the
token-split kernel rules, so these are off too, and the FSDP gathers case tests them.
``CODA_JAX_TESTS_ROUTING=default`` keeps the library's defaults instead (the GPU shape fuzz
with the routing rules as users get them).
"""

import os

from coda_jax.options import MeshOptions, RoutingOptions, set_options

SUITE_ROUTING = {"routing": RoutingOptions(xla_output_below=0),
                 "mesh": MeshOptions(fsdp_xla_tokens_below=0, fsdp_xla_gemms_below=0)}


def routing_defaults() -> bool:
    """Whether the suite runs with the library's routing defaults (``CODA_JAX_TESTS_ROUTING=default``)."""
    return os.environ.get("CODA_JAX_TESTS_ROUTING", "off") == "default"


def apply_suite_options() -> None:
    """Sets the suite's process-wide options (nothing with ``CODA_JAX_TESTS_ROUTING=default``)."""
    if not routing_defaults():
        set_options(**SUITE_ROUTING)


# The CPU suite's time is mostly XLA compiling tiny programs (a warm persistent cache runs
# tests/multi_device_cases.py's FP8 model cases in 8 s instead of 48 s), and LLVM's
# optimization of the generated CPU code is a large part of each compile. The suite's
# programs run for milliseconds, so unoptimized code costs nothing noticeable: the same
# programs, the same HLO (the HLO passes do not depend on this level; compiled HLO text is
# unchanged) and the same checks, compiled faster. (Float results may differ from an
# optimized build's in the last bits, as they may between CPUs; every tolerance stays.)
# Opt-in, ``CODA_JAX_TESTS_XLA_OPT=fast`` (never on a machine with an NVIDIA GPU: the level
# would reach its kernels' compiles too): the first fresh-clone CI run with it on by default
# (27 min instead of 32) lost an xdist worker to a segmentation fault inside XLA's CPU compile,
# called from the Mosaic GPU interpreter's thread pool (test_shipped_tuned_configs
# [rms_lse_logits-nt-cfg9]; the test alone passed four times), and an exact comparison of two
# float paths (test_fp8_lm_head's carry test) changed in its last bit. A rarely used XLA
# setting under concurrent compiles is not one the suite's verdict should rest on.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",)
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    return platforms == "cpu" or not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0"))


def suite_xla_flags(devices: int | None = None) -> str:
    """``XLA_FLAGS`` for a process the suite starts: the environment's flags (with the suite's
    fast-compile flags, see :func:`apply_suite_xla_flags`), and with ``devices`` that many host
    devices (any device count the environment names replaced)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    if devices is not None:
        flags.append(f"{_DEVICE_COUNT}={devices}")
    return " ".join(flags)


def apply_suite_xla_flags() -> None:
    """Adds :data:`FAST_COMPILE_FLAGS` to ``XLA_FLAGS`` (read when JAX creates its backends,
    so before any test touches a device; subprocesses inherit them) on CPU-only machines."""
    if os.environ.get("CODA_JAX_TESTS_XLA_OPT", "default") != "fast" or not _cpu_only():
        return
    flags = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in flags}
    flags += [f for f in FAST_COMPILE_FLAGS if f.split("=", 1)[0] not in names]
    os.environ["XLA_FLAGS"] = " ".join(flags)


# The suite's JAX persistent compilation cache: one directory per test session, shared by the
# xdist workers and the subprocesses the tests start, removed when the session's first process
# (the one that made it) exits. Many programs recur across tests (the XLA references, the
# models' initialization and optimizer programs, the one-device references of the mesh cases):
# a hit loads the executable a compile would have made (an entry is keyed by the whole
# program, its compile options, XLA flags and JAX's version). On CPU-only machines, and
# ``CODA_JAX_TESTS_COMPILE_CACHE=off`` turns it off. Tests that measure JAX's cache
# (tests/test_compile_time.py) point their own processes at their own directories.
COMPILE_CACHE_DIR_ENV = "CODA_JAX_TESTS_COMPILE_CACHE_DIR"


def _compile_cache_on() -> bool:
    return os.environ.get("CODA_JAX_TESTS_COMPILE_CACHE", "on") != "off" and _cpu_only()


def suite_compile_cache_env() -> dict[str, str]:
    """The environment variables that give a JAX process the suite's compilation cache (set up
    by :func:`apply_suite_compile_cache` in this session), or ``{}`` where it is off.

    No size bound: a bound turns on JAX's LRU eviction, whose every write lists the directory
    and reads each entry's access time under a file lock, a cost that grows with the session's
    thousands of entries. Without it a process may find an entry that another is still
    writing; JAX then warns that the entry does not load and compiles (a truncated entry
    does not deserialize), so a race costs a compile, never a wrong executable."""
    d = os.environ.get(COMPILE_CACHE_DIR_ENV)
    if not (_compile_cache_on() and d):
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": d, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def apply_suite_compile_cache() -> None:
    """Turns on the suite's compilation cache in this process (before its first compile): the
    session's directory if a parent process made one (:data:`COMPILE_CACHE_DIR_ENV`), else a
    fresh one, removed at this process's exit."""
    if not _compile_cache_on():
        return
    import atexit
    import shutil
    import tempfile

    if not os.environ.get(COMPILE_CACHE_DIR_ENV):
        d = tempfile.mkdtemp(prefix="coda-jax-tests-jax-cache-")
        os.environ[COMPILE_CACHE_DIR_ENV] = d
        atexit.register(shutil.rmtree, d, ignore_errors=True)
    import jax

    env = suite_compile_cache_env()
    jax.config.update("jax_compilation_cache_dir", env["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", int(env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))
