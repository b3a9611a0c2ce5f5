"""Every epilogue program's Pallas kernel lowers for CUDA on the CPU, at real tile sizes.

Interpret mode checks what a kernel computes, not whether Mosaic GPU accepts its layouts:
this lowers the compiled kernel (``lowering_platforms=("cuda",)``, no GPU needed), which
runs Mosaic GPU's code generation for the wgmma layouts, the TMA descriptors, clusters
and the SMEM plan. Execution is covered by ``test_gpu_pallas.py`` on the H100.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuning import CONFIG_TABLE
from op_cases import abstract_loads
from test_pallas_kernels import CASES

CONFIGS = {
    "default": CONFIG_TABLE["default"],
    "cluster_m": dataclasses.replace(CONFIG_TABLE["default"], cluster_dimension="m", grid_minor_dim="m"),
    "split_m_cluster_n_swizzled": dataclasses.replace(CONFIG_TABLE["default"], wg_dimension="m",
                                                      cluster_dimension="n", swizzle_epilogue=True),
    "default_swizzled": dataclasses.replace(CONFIG_TABLE["default"], swizzle_epilogue=True),
    "no_cluster": dataclasses.replace(CONFIG_TABLE["default"], cluster_dimension=None),
    "pingpong": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None),
    "pingpong_cluster_m": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong"),
    "ring": dataclasses.replace(CONFIG_TABLE["default"], delay_release=1),
}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("epi,kw", CASES, ids=[c[0].name for c in CASES])
def test_kernel_lowers_for_cuda(epi, kw, cfg):
    _assert_lowers(epi, kw, CONFIGS[cfg])


def _assert_lowers(epi, kw, config):
    m, n, k = 1024, 1024, 512
    ta, tb = kw.get("transpose_a", False), kw.get("transpose_b", False)
    a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), jnp.bfloat16)
    low = PallasLowering(config, plain_gemm="pallas")
    f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, **kw))
    txt = f.trace(a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in txt, "no Mosaic GPU custom call in the lowered module"


@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[0].pair_block is None or 64 % c[0].pair_width == 0],
                         ids=[c[0].name for c in CASES if c[0].pair_block is None or 64 % c[0].pair_width == 0])
def test_half_width_tile_lowers_for_cuda(epi, kw):
    """``fit_waves``'s 64-wide consumer tile (128 x 128 CTA tiles) lowers for every program
    whose pair width it holds."""
    _assert_lowers(epi, kw, dataclasses.replace(CONFIG_TABLE["default"], tile_n=64))
