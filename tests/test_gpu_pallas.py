"""GPU suite (H100): every epilogue program through the compiled Pallas kernel, against the
reference backend, with both mainloops (the single-warpgroup kernel and the table's
warp-specialized default), at sizes that exercise the persistent grid.

Outputs are poisoned: before each kernel runs, NaN-filled buffers of the output sizes are
allocated and freed, so an output element the kernel fails to write keeps a NaN from the
allocator and fails ``rel_err``'s finiteness check.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from coda_jax import programs
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig
from test_pallas_kernels import CASES, _compare

pytestmark = pytest.mark.gpu

CONFIGS = {
    "single_wg": TuningConfig(),
    "warp_specialized": CONFIG_TABLE["default"],
    "ws_split_m_swizzled": dataclasses.replace(CONFIG_TABLE["default"], wg_dimension="m", swizzle_epilogue=True),
}


def _poison(m, n, count=8):
    bufs = [jnp.full((m, n), jnp.nan, jnp.float32) for _ in range(count)]
    jax.block_until_ready(bufs)
    del bufs


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("epi,kw", CASES, ids=[c[0].name for c in CASES])
def test_program_on_gpu(epi, kw, cfg):
    _poison(2048, 1024)
    _compare(epi, 2048, 1024, 1024, config=CONFIGS[cfg], **kw)


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
def test_ragged_shapes_on_gpu(cfg):
    _poison(1024, 5000)
    _compare(programs.RESIDUAL_RMS, 1000, 1500, 520, config=CONFIGS[cfg])
    _compare(programs.RMS_LSE, 777, 5000, 256, transpose_b=True, config=CONFIGS[cfg])
    _compare(programs.rms_dgrad(True), 1000, 1500, 520, transpose_b=True, config=CONFIGS[cfg])
    _compare(programs.IDENTITY, 1000, 1500, 520, transpose_a=True, config=CONFIGS[cfg])


def test_ops_under_remat_and_vmap_on_gpu():
    from test_ops_pallas import _remat_vmap_case

    _remat_vmap_case("pallas")
