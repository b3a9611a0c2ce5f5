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
