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

from coda_jax import programs
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
    txt = _lower(epi, kw, config, 1024, 1024, 512).as_text()
    assert "mosaic_gpu" in txt, "no Mosaic GPU custom call in the lowered module"


@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[0].pair_block is None or 64 % c[0].pair_width == 0],
                         ids=[c[0].name for c in CASES if c[0].pair_block is None or 64 % c[0].pair_width == 0])
def test_half_width_tile_lowers_for_cuda(epi, kw):
    """``fit_waves``'s 64-wide consumer tile (128 x 128 CTA tiles) lowers for every program
    whose pair width it holds."""
    _assert_lowers(epi, kw, dataclasses.replace(CONFIG_TABLE["default"], tile_n=64))


def test_latency_hint_on_the_kernel_call_only():
    """``PallasLowering(latency_hints=True)``: the Mosaic GPU custom call, and no other op, carries
    ``latency_metadata`` (nanoseconds), the roofline estimate of its run time that XLA's
    GPU latency estimators read; without the setting, nothing does."""
    import re

    from coda_jax import programs
    from coda_jax.lowering import estimated_kernel_ns
    from coda_jax.pallas.kernel_builder import compiled_kernel

    epi, (m, n, k) = programs.RESIDUAL_RMS, (8192, 2048, 8192)
    a, b = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)

    def lowered(low):
        compiled_kernel.cache_clear()
        f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l))
        return f.trace(a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",)).as_text()

    assert "latency_metadata" not in lowered(PallasLowering(CONFIG_TABLE["default"]))
    hinted = [line for line in lowered(PallasLowering(CONFIG_TABLE["default"], latency_hints=True)).splitlines()
              if "latency_metadata" in line]
    assert len(hinted) == 1 and "mosaic_gpu" in hinted[0]
    ns = int(re.search(r'latency_metadata = "(\d+)"', hinted[0]).group(1))
    # compute-bound: 2 * 8192 * 2048 * 8192 flops at 75 % of 989 TFLOP/s, 0.371 ms (the
    # kernel measured 0.378 ms on the H100, tuned_h100.json)
    assert ns == estimated_kernel_ns(m, n, k, 0) and abs(ns - 370_580) < 1_000


def test_latency_estimate():
    from coda_jax.lowering import HINT_BYTES_PER_S, estimated_kernel_ns

    compute = estimated_kernel_ns(8192, 8192, 2048, 0)
    assert abs(compute - 2 * 8192 * 8192 * 2048 / (0.75 * 989e12) * 1e9) <= 1
    assert estimated_kernel_ns(8192, 8192, 2048, 0, num_sms=66) == pytest.approx(2 * compute, abs=2)
    memory = estimated_kernel_ns(8192, 128, 64, 10**9)  # a skinny GEMM: memory-bound
    assert memory == round(1e9 * 10**9 / HINT_BYTES_PER_S)
    assert not PallasLowering().latency_hints and PallasLowering(latency_hints=True).latency_hints


def test_kernel_name_says_program_layout_and_shape():
    """A profile names each Pallas kernel by program, layout and padded GEMM shape, so the
    step's time splits per call site (``benchmarks/step_ceiling.py`` and profiles)."""
    import re

    from coda_jax import programs

    epi, (m, n, k) = programs.rms_dgrad(True), (1000, 2048, 512)  # M padded to the 128-row tile: 1024
    a, b = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16)
    low = PallasLowering(CONFIG_TABLE["default"])
    f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_b=True))
    txt = f.trace(a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r"coda_[a-z_]+_n[nt]_\d+x\d+x\d+", txt)) == {f"coda_{epi.name}_nt_1024x2048x512"}


def _lower(epi, kw, config, m, n, k):
    """``epi``'s kernel at ``[m, k] @ [k, n]`` (``kw``: the layout), lowered for CUDA."""
    ta, tb = kw.get("transpose_a", False), kw.get("transpose_b", False)
    a = jax.ShapeDtypeStruct((k, m) if ta else (m, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((n, k) if tb else (k, n), jnp.bfloat16)
    low = PallasLowering(config, plain_gemm="pallas")
    return jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, **kw)).trace(a, b, abstract_loads(epi, m, n)).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("cfg", ["default", "pingpong"])
def test_smem_plan_covers_what_mosaic_allocates(cfg, monkeypatch):
    """The plan's SMEM estimate (operand stages, both consumers' epilogue staging, the
    reserve of ``_reserved_smem``) is at least what Mosaic GPU allocates, for every program.
    (Pallas reserves its cross-warp reduction scratch in kernels that reduce: without it in
    the estimate, a plan at the limit failed to compile, RESULTS.md run 231.) The SMEM
    bound set to 1 byte makes Mosaic report the kernel's size in its error."""
    import re

    import jax.experimental.mosaic.gpu.core as mosaic_core

    from coda_jax.pallas import gemm_epilogue as G
    from coda_jax.pallas import lowering as L

    planned = {}

    def spy(epi, shape, c, ldt=()):
        epi, p = G.plan_epilogue(epi, shape, c, ldt)
        planned["bytes"] = G.smem_estimate(epi, shape, p, dict(ldt))
        return epi, p

    monkeypatch.setattr(L, "plan_epilogue", spy)
    monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", 1)
    for epi, kw in CASES:
        with pytest.raises(ValueError, match="exceeds available shared memory") as err:
            _lower(epi, kw, CONFIGS[cfg], 1024, 1024, 512)
        used = int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))
        assert used <= planned["bytes"], (epi.name, used, planned["bytes"])


@pytest.mark.parametrize("name,epi,kw", [
    ("split_m_64x256", programs.SWIGLU_DGRAD, {"transpose_b": True}),
    ("pingpong_64x256_turns_deep", programs.RESIDUAL_RMS, {})])
def test_a_plan_at_the_smem_limit_compiles(name, epi, kw):
    """Two tuning candidates whose plan for a reducing program at a 1B shape sat exactly at
    the SMEM limit before the reduction scratch was counted: Mosaic refused them (run 231)."""
    from coda_jax.pallas.autotune import known_candidates

    _lower(epi, kw, known_candidates()[name], 8192, 8192 if kw else 2048, 2048)
