"""``out_splits``: a tile output returned as column parts (attention's Q, K and V).

The Pallas kernel writes the parts as separate arrays where its stores allow (each chunk's
stores inside one part), else it writes the output whole and XLA slices it; every backend
returns the same values as the whole output's columns. Interpret mode for the values,
CUDA lowering on the CPU for the kernel's outputs under each schedule.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import programs
from coda_jax.lowering import check_out_splits
from coda_jax.pallas import interpret_mode
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig
from coda_jax.reference import REFERENCE
from op_cases import abstract_loads, pallas_kernel_eqn
from test_pallas_kernels import _loads

ROPE = programs.rms_rope(32, None, False)  # head_dim 64: pair blocks of 2 x 32 columns
SMALL = TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)


@pytest.fixture
def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield
    reset_gpu_interpret_mode_state()


def _operands(epi, m, n, k, seed=0):
    key = jax.random.key(seed)
    a = jax.random.normal(jax.random.fold_in(key, 1), (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(jax.random.fold_in(key, 2), (k, n), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    return a, b, _loads(epi, m, n, jax.random.fold_in(key, 3))


def _kernel_outputs(fn, *args) -> int:
    return len(pallas_kernel_eqn(fn, *args).outvars)


@pytest.mark.parametrize("splits,native", [((128, 64, 64), True), ((96, 160), True), ((120, 136), False),
                                           ((192, 64, 64), False)],
                         ids=["qkv", "two", "unaligned", "n_padded"])
def test_pallas_parts_are_the_whole_outputs_columns(_interpret, splits, native):
    """The parts equal the unsplit output's columns bit for bit; aligned boundaries are
    written by the kernel as separate arrays (3 or 2 outputs). An unaligned one (120, not a
    multiple of the 16- or 32-column chunk), or N = 320 padded to the 128-column tile, falls
    back to one output sliced by XLA."""
    m, n, k = 128, sum(splits), 128
    a, b, loads = _operands(ROPE, m, n, k)
    low = PallasLowering(SMALL)
    whole = low.gemm(ROPE, a, b, loads)["qkv"]
    split = lambda a, b, l: low.gemm(ROPE, a, b, l, out_splits={"qkv": splits})["qkv"]  # noqa: E731
    parts = split(a, b, loads)
    assert [p.shape for p in parts] == [(m, w) for w in splits]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(parts, axis=1), np.float32),
                                  np.asarray(whole, np.float32))
    assert np.isfinite(np.asarray(whole, np.float32)).all()  # poisoned (NaN) tiles would show
    assert _kernel_outputs(split, a, b, loads) == (len(splits) if native else 1)


def test_reference_parts_are_slices():
    m, n, k = 32, 256, 64
    a, b, loads = _operands(ROPE, m, n, k, seed=1)
    whole = REFERENCE.gemm(ROPE, a, b, loads)["qkv"]
    q, kk, v = REFERENCE.gemm(ROPE, a, b, loads, out_splits={"qkv": (128, 64, 64)})["qkv"]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate([q, kk, v], 1), np.float32), np.asarray(whole, np.float32))


@pytest.mark.parametrize("splits,rule", [
    ({"nope": (256,)}, "no tile output 'nope'"),
    ({"qkv": (128, 64)}, "summing to the output's 256 columns"),
    ({"qkv": (128, 0, 128)}, "positive int"),
    ({"qkv": (128.0, 128)}, "positive int"),
])
def test_bad_splits_name_the_rule(splits, rule):
    with pytest.raises(ValueError, match=rule):
        check_out_splits(ROPE, splits, 256)


def test_row_sum_output_cannot_be_split():
    with pytest.raises(ValueError, match="no tile output 'zdz'"):
        check_out_splits(programs.SWIGLU_DGRAD, {"zdz": (64, 64)}, 128)


CUDA_CONFIGS = {
    "cooperative": CONFIG_TABLE["default"],
    "pingpong": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None),
    "ring": dataclasses.replace(CONFIG_TABLE["default"], delay_release=1),
    "direct_stores": dataclasses.replace(CONFIG_TABLE["default"], direct_stores=True),
}


@pytest.mark.parametrize("cfg", list(CUDA_CONFIGS))
def test_split_kernel_lowers_for_cuda(cfg):
    """The 1B model's QKV column widths (2048, 512, 512), here as 16 query and 4 KV heads of
    head_dim 128: the kernel lowers with three outputs under every schedule."""
    epi = programs.rms_rope(64, None, False)
    m, n, k = 1024, 3072, 512
    a, b = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    low = PallasLowering(CUDA_CONFIGS[cfg])
    f = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, out_splits={"qkv": (2048, 512, 512)})["qkv"])
    txt = f.trace(a, b, abstract_loads(epi, m, n)).lower(lowering_platforms=("cuda",)).as_text()
    call = next(line for line in txt.splitlines() if "mosaic_gpu" in line and "custom_call" in line)
    results = call.rsplit("->", 1)[1]
    assert results.count("tensor<1024x2048xbf16>") == 1 and results.count("tensor<1024x512xbf16>") == 2, results
