"""The Pallas backend's evaluation of an epilogue body (coda_jax/pallas/body_math.py): with
approximate math, each sigmoid is lowered as rsqrt(1 + exp(-x))^2 (no division), also
inside jit-wrapped and custom-derivative helpers; the results equal the body's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import programs
from coda_jax.pallas.body_math import call_body, fast_logistic


def _primitives(jaxpr) -> set[str]:
    """Names of every primitive in ``jaxpr`` and its sub-jaxprs."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", None)
            if sub is not None and hasattr(sub, "eqns"):
                names |= _primitives(sub)
    return names


def test_fast_logistic_matches_sigmoid_over_the_whole_range():
    x = jnp.concatenate([jnp.linspace(-120.0, 120.0, 4001, dtype=jnp.float32),
                         jnp.array([-jnp.inf, jnp.inf, 0.0, -0.0, 88.7, -88.7, -89.0, 1e-30], jnp.float32)])
    got, want = fast_logistic(x), jax.nn.sigmoid(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-30)
    assert np.isnan(np.asarray(fast_logistic(jnp.array([jnp.nan], jnp.float32)))).all()


def _chunk(key, shape=(64, 32)):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    acc = jax.random.normal(k1, shape, jnp.float32)
    z = (4 * jax.random.normal(k2, shape, jnp.float32), jax.random.normal(k3, shape, jnp.float32))
    rstd = jnp.broadcast_to(jax.random.uniform(k4, (shape[0], 1), jnp.float32, 0.5, 2.0), shape)
    return acc, {"z": z, "rstd": rstd}


class _Ctx:
    def row_sum(self, x):
        return jnp.broadcast_to(x.sum(axis=1, keepdims=True), x.shape)


@pytest.mark.parametrize("epi", [programs.SWIGLU_DGRAD, programs.rms_swiglu(True)], ids=lambda e: e.name)
def test_call_body_replaces_every_sigmoid(epi):
    acc, loads = _chunk(jax.random.key(0))
    if epi is not programs.SWIGLU_DGRAD:
        loads = {"rstd": loads["rstd"]}
        acc = (acc, loads["rstd"] * 3.0)  # a (gate, up) accumulator pair
    ctx = _Ctx()
    want = epi.body(acc, ctx, **loads)
    got = call_body(epi.body, acc, ctx, loads, approx_math=True)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)

    def traced(approx):
        return jax.make_jaxpr(lambda a, l: call_body(epi.body, a, ctx, l, approx_math=approx))(acc, loads).jaxpr

    fast, exact = _primitives(traced(True)), _primitives(traced(False))
    assert "logistic" in exact and "logistic" not in fast
    assert "rsqrt" in fast and "div" not in fast


def test_call_body_inlines_custom_derivative_helpers():
    def body(acc, ctx):  # jax.nn.silu is a custom_jvp of a jit-wrapped sigmoid
        return {"y": jax.nn.silu(acc) + jax.nn.sigmoid(2.0 * acc)}

    acc = jax.random.normal(jax.random.key(1), (8, 16), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda a: call_body(body, a, None, {}, approx_math=True))(acc).jaxpr
    assert "logistic" not in _primitives(jaxpr)
    np.testing.assert_allclose(np.asarray(call_body(body, acc, None, {}, approx_math=True)["y"]),
                               np.asarray(body(acc, None)["y"]), rtol=1e-5, atol=1e-6)


def test_bodies_without_a_sigmoid_are_called_as_they_are():
    calls = []

    def body(acc, ctx, gamma):
        calls.append(1)
        return {"out": acc * gamma}

    acc = jnp.ones((4, 8), jnp.float32)
    out = call_body(body, acc, None, {"gamma": acc * 2}, approx_math=False)
    assert calls == [1] and float(out["out"][0, 0]) == 2.0
