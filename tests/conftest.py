"""Shared test fixtures: float32 math on the CPU, GPU tests skipped without a Hopper GPU."""

import jax
import numpy as np
import pytest

# The Mosaic GPU interpreter runs each simulated thread's jitted step from its own Python
# thread and makes them meet at barriers (io_callbacks). With asynchronous CPU dispatch those
# steps queue on the CPU client's small thread pool (2 threads on a 2-core CI machine): the
# threads already at a barrier hold it while the others wait for a slot, and the test hangs
# (seen intermittently in test_pallas_kernels.py under two pytest-xdist workers). Synchronous
# dispatch runs each step on its own calling thread.
jax.config.update("jax_cpu_enable_async_dispatch", False)


def _hopper() -> bool:
    try:
        d = jax.devices()[0]
    except RuntimeError:
        return False
    return d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("9")


def pytest_collection_modifyitems(config, items):
    if _hopper():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (run benchmarks/gpu_suite.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_backend_state(monkeypatch):
    """Each test starts with no process-wide backend and no env overrides."""
    import coda_jax

    monkeypatch.delenv("CODA_JAX_BACKEND", raising=False)
    monkeypatch.delenv("CODA_JAX_ALLOW_FALLBACK", raising=False)
    coda_jax.set_backend(None)
    yield
    coda_jax.set_backend(None)


def rel_err(out, ref) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
