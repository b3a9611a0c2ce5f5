"""The worked example of docs/epilogues.md computes what its naive version computes."""

import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import custom_epilogue_op as ex  # noqa: E402
from coda_jax.reference import REFERENCE  # noqa: E402
from op_cases import rel_err  # noqa: E402


def test_custom_epilogue_op_matches_naive():
    k = jax.random.split(jax.random.key(3), 5)
    h = jax.random.normal(k[0], (40, 24))
    rstd = jax.random.uniform(k[1], (40,), minval=0.5, maxval=2.0)
    w = jax.random.normal(k[2], (24, 36)) / 24 ** 0.5
    bias = jax.random.normal(k[3], (36,))
    r = jax.random.normal(k[4], (40, 36))
    naive = lambda h, rstd, w, bias: jax.nn.gelu(rstd[:, None] * (h @ w) + bias, approximate=True)
    fused = functools.partial(ex.norm_bias_gelu, REFERENCE)
    assert rel_err(fused(h, rstd, w, bias), naive(h, rstd, w, bias)) < 1e-5
    got = jax.grad(lambda *a: jnp.sum(fused(*a) * r), (0, 1, 2, 3))(h, rstd, w, bias)
    want = jax.grad(lambda *a: jnp.sum(naive(*a) * r), (0, 1, 2, 3))(h, rstd, w, bias)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4
