"""Every op's forward and custom gradient on the reference ("xla") backend vs the naive model.

Shapes include token counts and widths that are not multiples of 128.
"""

import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import op_cases as C

DTYPES = [jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,f,next_norm", [(128, 96, 128, True), (77, 72, 64, False)])
def test_swiglu_mlp(m, d, f, next_norm, dtype):
    C.case_swiglu_mlp("xla", m, d, f, dtype, next_norm=next_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,n", [(128, 256, 384), (77, 200, 130), (1, 64, 8)])
def test_rms_norm_matmul(m, d, n, dtype):
    C.case_rms_norm_matmul("xla", m, d, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,f", [(128, 256, 128), (93, 160, 192)])
def test_swiglu(m, d, f, dtype):
    C.case_swiglu("xla", m, d, f, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("m,d,h,kv,hd", [(96, 128, 4, 2, 32), (50, 200, 4, 1, 64)])
def test_rope(m, d, h, kv, hd, qk_norm, dtype):
    C.case_rope("xla", m, d, h, kv, hd, dtype, qk_norm=qk_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,d,n", [(128, 128, 256, 128), (70, 96, 136, 50)])
def test_residual_chain(m, k, d, n, dtype):
    C.case_residual_chain("xla", m, k, d, n, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction, dtype):
    C.case_cross_entropy("xla", 100, 96, 1000, dtype, reduction=reduction, z_loss=1e-3)


def test_cross_entropy_chunked_vocab(monkeypatch):
    """Vocab larger than the reference's LSE chunk and the backward's vocab chunk."""
    import importlib

    from coda_jax import reference

    lce = importlib.import_module("coda_jax.ops.linear_cross_entropy")

    monkeypatch.setattr(reference, "LSE_CHUNK", 256)
    monkeypatch.setattr(lce, "VOCAB_CHUNK", 300)
    C.case_cross_entropy("xla", 64, 64, 1000, jnp.float32, z_loss=1e-4)


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 160), d=st.integers(2, 40).map(lambda v: 4 * v), n=st.integers(1, 200),
       seed=st.integers(0, 2 ** 16))
def test_rms_norm_matmul_random_shapes(m, d, n, seed):
    C.case_rms_norm_matmul("xla", m, d, n, jnp.float32, seed=seed)


@settings(max_examples=4, deadline=None)
@given(m=st.integers(1, 130), f=st.integers(1, 3).map(lambda v: 64 * v), seed=st.integers(0, 2 ** 16))
def test_swiglu_random_shapes(m, f, seed):
    C.case_swiglu("xla", m, 72, f, jnp.float32, seed=seed)
