"""The block's attention: cuDNN where it supports the shape, exact padding of odd lengths,
XLA for head dims cuDNN refuses, each decision logged once (CPU: the selection and the padding)."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import log as coda_log
from coda_jax.ops import attention as A

BF = jnp.bfloat16


def _plan(requested="auto", seq_len=77, head_dim=128, platform="gpu", cc="9.0", dtype=BF):
    return A.plan_attention(requested, dtype=dtype, seq_len=seq_len, head_dim=head_dim, platform=platform,
                            compute_capability=cc)


def test_auto_picks_cudnn_and_pads_odd_lengths():
    assert _plan(seq_len=1000) == A.AttentionPlan("cudnn", 1000)
    p = _plan(seq_len=77)
    assert (p.implementation, p.seq_len) == ("cudnn", 78) and "even sequence length" in p.note
    assert _plan(seq_len=1).seq_len == 2
    assert _plan("cudnn", seq_len=77).seq_len == 78  # an explicit cuDNN request is padded too


@pytest.mark.parametrize("head_dim,cc", [(60, "9.0"), (264, "9.0"), (192, "8.0")])
def test_auto_falls_back_to_xla_for_head_dims_cudnn_refuses(head_dim, cc):
    p = _plan(seq_len=77, head_dim=head_dim, cc=cc)
    assert (p.implementation, p.seq_len) == (None, 77) and f"got {head_dim}" in p.note


def test_auto_off_gpu_or_in_float32_is_xla_without_a_note():
    assert _plan(platform="cpu") == A.AttentionPlan(None, 77)
    assert _plan(dtype=jnp.float32) == A.AttentionPlan(None, 77)
    assert _plan("xla", seq_len=77) == A.AttentionPlan("xla", 77)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        _plan(seq_len=0)


def test_padding_an_odd_length_at_the_end_is_exact_under_the_causal_mask(monkeypatch):
    # Forced onto the padded path with XLA's attention: outputs and gradients of the real
    # rows match the unpadded attention.
    monkeypatch.setattr(A, "plan_attention", lambda *a, **kw: A.AttentionPlan(None, kw["seq_len"] + 1, "pad"))
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (2, 77, 4, 32))
    k, v = jax.random.normal(ks[1], (2, 77, 2, 32)), jax.random.normal(ks[2], (2, 77, 2, 32))
    ct = jax.random.normal(ks[3], (2, 77, 4, 32))
    padded = lambda q, k, v: jnp.sum(A.causal_attention(q, k, v, "auto") * ct)  # noqa: E731
    plain = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) * ct)  # noqa: E731
    assert A.causal_attention(q, k, v, "auto").shape == q.shape
    np.testing.assert_allclose(padded(q, k, v), plain(q, k, v), rtol=1e-5)
    for g, w in zip(jax.grad(padded, (0, 1, 2))(q, k, v), jax.grad(plain, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_each_decision_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(coda_log, "_logged", set())
    monkeypatch.setattr(A, "plan_attention", lambda *a, **kw: A.AttentionPlan(None, kw["seq_len"], "note x"))
    q = jnp.ones((1, 5, 2, 8))
    with caplog.at_level(logging.WARNING, logger="coda_jax"):
        A.causal_attention(q, q, q, "auto")
        A.causal_attention(q, q, q, "auto")
    assert [r.getMessage() for r in caplog.records] == ["note x"]
