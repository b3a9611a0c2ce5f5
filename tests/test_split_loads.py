"""A tile load given as column parts (attention's dq, dk, dv read where cuDNN wrote them).

The Pallas kernel reads the parts from their own arrays where its loads allow (each chunk's
TMA load inside one part, staged loads), else the lowering joins them first, as the reference
and CuTeDSL backends always do; every backend gives the joined load's results. Interpret mode
for the values, CUDA lowering on the CPU for the kernel's inputs under each schedule.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import programs
from coda_jax.lowering import join_columns, load_parts
from coda_jax.pallas import interpret_mode
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig
from coda_jax.reference import REFERENCE
from op_cases import abstract_loads, pallas_kernel_eqn
from test_split_outputs import CUDA_CONFIGS  # the schedules the split outputs lower under
from test_pallas_kernels import _loads

SMALL = TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)
# The QKV gradient's pass: pair blocks of 2 x 32 columns, two tile loads (dqkv, qkv).
ROPE_GRAD = programs.rope_grad_q8(32)


@pytest.fixture
def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield
    reset_gpu_interpret_mode_state()


def _split(x: jax.Array, widths: tuple[int, ...]) -> tuple[jax.Array, ...]:
    starts = np.cumsum((0,) + widths[:-1])
    return tuple(x[:, s:s + w] for s, w in zip(starts, widths))


def _kernel_inputs(fn, *args) -> int:
    return len(pallas_kernel_eqn(fn, *args).invars)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("splits,native", [((128, 64, 64), True), ((96, 160), True), ((120, 136), False),
                                           ((192, 64, 64), False)],
                         ids=["qkv", "two", "unaligned", "n_padded"])
def test_pallas_parts_give_the_joined_loads_results(_interpret, splits, native):
    """The residual tile given as parts: the same outputs, bit for bit, as given whole on the
    same kernel; aligned boundaries are read by the kernel from the parts (its inputs grow by
    the extra parts), an unaligned one (120: not a multiple of the chunk width) or N = 320
    (padded to the 128-column tile) is joined first."""
    epi = programs.RESIDUAL_RMS
    m, n, k = 128, sum(splits), 128
    key = jax.random.key(3)
    a = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(jax.random.fold_in(key, 2), (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    loads = _loads(epi, m, n, jax.random.fold_in(key, 3))
    low = PallasLowering(SMALL, plain_gemm="kernel")
    run = lambda a, b, l: low.gemm(epi, a, b, l)  # noqa: E731
    whole = run(a, b, loads)
    parted = dict(loads, residual=_split(loads["residual"], splits))
    got = run(a, b, parted)
    for name in whole:
        assert np.isfinite(np.asarray(got[name], np.float32)).all(), name  # poisoned tiles would show
        np.testing.assert_array_equal(_bits(got[name]), _bits(whole[name]), err_msg=name)
    extra = len(splits) - 1 if native else 0
    assert _kernel_inputs(run, a, b, parted) == _kernel_inputs(run, a, b, loads) + extra


@pytest.mark.parametrize("config", ["small", "pingpong"])
def test_pallas_pass_reads_qkv_parts(_interpret, config):
    """The QKV gradient's epilogue pass with both tile loads as parts (4 query and 2 + 2 KV
    heads of head_dim 64): bit for bit its results with the loads joined, read from the parts
    (two more inputs each)."""
    from coda_jax.ops.epilogue_pass import epilogue_pass

    cfg = SMALL if config == "small" else dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong",
                                                              cluster_dimension=None)
    m, widths = 128, (256, 128, 128)
    n = sum(widths)
    loads = _loads(ROPE_GRAD, m, n, jax.random.key(4))
    loads["dz_scale"] = jnp.float32(4.0)
    low = PallasLowering(cfg, plain_gemm="kernel")
    run = lambda l: epilogue_pass(low, ROPE_GRAD, m, n, l)  # noqa: E731
    whole = run(loads)
    parted = dict(loads, dqkv=_split(loads["dqkv"], widths), qkv=_split(loads["qkv"], widths))
    got = run(parted)
    assert set(got) == set(whole) == set(ROPE_GRAD.result_names())
    for name in whole:
        assert np.isfinite(np.asarray(got[name], np.float32)).all(), name
        np.testing.assert_array_equal(_bits(got[name]), _bits(whole[name]), err_msg=name)
    assert _kernel_inputs(run, parted) == _kernel_inputs(run, loads) + 4


def test_reference_joins_the_parts():
    m, n, k = 32, 256, 64
    key = jax.random.key(5)
    a = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 2), (k, n), jnp.float32).astype(jnp.bfloat16)
    loads = _loads(programs.RESIDUAL_RMS, m, n, jax.random.fold_in(key, 3))
    parted = dict(loads, residual=_split(loads["residual"], (128, 64, 64)))
    assert load_parts(parted) == {"residual": (128, 64, 64)} and load_parts(loads) == {}
    np.testing.assert_array_equal(np.asarray(join_columns(parted)["residual"], np.float32),
                                  np.asarray(loads["residual"], np.float32))
    whole, got = (REFERENCE.gemm(programs.RESIDUAL_RMS, a, b, l) for l in (loads, parted))
    for name in whole:
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), np.asarray(whole[name], np.float32))


def _bad(m, n, **parts):
    loads = abstract_loads(programs.RESIDUAL_RMS, m, n)
    return {**{k: jnp.zeros(v.shape, v.dtype) for k, v in loads.items()}, **parts}


@pytest.mark.parametrize("case", ["widths", "rows", "dtypes", "empty", "row_load"])
def test_bad_parts_name_the_rule(case):
    m, n = 32, 256
    z = lambda r, c, dt=jnp.bfloat16: jnp.zeros((r, c), dt)  # noqa: E731
    loads = {"widths": _bad(m, n, residual=(z(m, 128), z(m, 64))),
             "rows": _bad(m, n, residual=(z(m, 128), z(m - 1, 128))),
             "dtypes": _bad(m, n, residual=(z(m, 128), z(m, 128, jnp.float32))),
             "empty": _bad(m, n, residual=()),
             "row_load": _bad(m, n, gamma=(jnp.zeros((128,)), jnp.zeros((128,))))}[case]
    with pytest.raises(ValueError, match=r"given as parts must be a tile load and a non-empty tuple of \[32, w_i\]"):
        programs.RESIDUAL_RMS.validate_loads(loads, m, n)


@pytest.mark.parametrize("cfg", list(CUDA_CONFIGS))
def test_parts_kernel_lowers_for_cuda(cfg):
    """The 1B model's QKV widths (2048, 512, 512) as the QKV gradient pass's two tile loads:
    the kernel lowers reading six bf16 inputs under every schedule."""
    from coda_jax.ops.epilogue_pass import epilogue_pass

    epi = programs.rope_grad_q8(32)
    m, widths = 1024, (2048, 512, 512)
    n = sum(widths)
    loads = abstract_loads(epi, m, n)
    for name in ("dqkv", "qkv"):
        loads[name] = tuple(jax.ShapeDtypeStruct((m, w), jnp.bfloat16) for w in widths)
    low = PallasLowering(CUDA_CONFIGS[cfg], plain_gemm="kernel")
    with interpret_mode(False):
        txt = jax.jit(lambda l: epilogue_pass(low, epi, m, n, l)).trace(loads).lower(
            lowering_platforms=("cuda",)).as_text()
    call = next(line for line in txt.splitlines() if "mosaic_gpu" in line and "custom_call" in line)
    operands = call.rsplit("->", 1)[0]
    assert operands.count("tensor<1024x2048xbf16>") == 2 and operands.count("tensor<1024x512xbf16>") == 4, operands
