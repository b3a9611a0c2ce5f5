"""How the Pallas backend evaluates an epilogue body's math in registers.

The epilogue body is the same function every backend runs (:mod:`coda_jax.programs`). On
the Pallas backend it runs once per register chunk of the accumulator, so each float32
instruction of its math is paid per accumulator element, and the SwiGLU epilogues are
instruction-bound (RESULTS.md, run 182: about 20 instructions per element).

Mosaic GPU lowers ``lax.logistic`` (``jax.nn.sigmoid``) as ``1 / (1 + exp(-x))`` with an
IEEE-rounded division, which the GPU runs as a reciprocal plus Newton refinement, a range
check and a slow-path branch. With ``TuningConfig.approx_math`` this module instead lowers
the sigmoid as

    sigmoid(x) = rsqrt(1 + exp(-x))^2

``exp`` and ``rsqrt`` then use the approximate hardware units (``ex2.approx`` and
``rsqrt.approx``, relative error about 1e-7 each), so one sigmoid is two special-function
instructions and three multiply/adds. ``1 + exp(-x) >= 1``, so the square root never sees a
zero or a negative number; ``exp(-x) = inf`` (``x < -88``) gives ``rsqrt(inf)^2 = 0``, the
limit; NaN stays NaN. The CuTeDSL backend does the same with ``rcp.approx`` (its lowering
reaches that instruction; Pallas exposes no approximate reciprocal).

:func:`call_body` traces the body to a jaxpr and evaluates it, replacing each logistic
(also inside ``jit``-wrapped helpers such as ``jax.nn.sigmoid`` and custom-derivative
functions such as ``jax.nn.silu``) with :func:`fast_logistic`; every other operation is
bound unchanged. Off (``approx_math=False``), the body is called directly.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

# Parameters that hold a sub-jaxpr to evaluate inline (pjit: "jaxpr"; custom_jvp_call /
# custom_vjp_call: "call_jaxpr"). Forward evaluation only: the derivative rules are not
# needed inside a kernel.
_SUB_JAXPR_PARAMS = ("jaxpr", "call_jaxpr")


def fast_logistic(x: jax.Array) -> jax.Array:
    """``sigmoid(x) = rsqrt(1 + exp(-x))^2`` (float32 ``x`` of any shape): no division."""
    r = lax.rsqrt(1.0 + jnp.exp(-x))
    return r * r


def _sub_jaxpr(eqn) -> Any | None:
    for name in _SUB_JAXPR_PARAMS:
        sub = eqn.params.get(name)
        if sub is not None and hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
            return sub
    return None


def _contains_logistic(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is lax.logistic_p:
            return True
        sub = _sub_jaxpr(eqn)
        if sub is not None and _contains_logistic(sub.jaxpr):
            return True
    return False


def _eval(jaxpr, consts, args) -> list:
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if eqn.primitive is lax.logistic_p:
            outs = [fast_logistic(ins[0])]
        elif sub is not None and _contains_logistic(sub.jaxpr):
            # Inline only what holds a logistic; custom_vjp_call's operands start with its
            # residual-free primal inputs, the same as the sub-jaxpr's invars.
            outs = _eval(sub.jaxpr, sub.consts, ins[len(ins) - len(sub.jaxpr.invars):])
        else:
            res = eqn.primitive.bind(*ins, **eqn.params)
            outs = list(res) if eqn.primitive.multiple_results else [res]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def call_body(body: Callable[..., dict], acc: Any, ctx: Any, loads: dict[str, Any], *,
              approx_math: bool) -> dict:
    """``body(acc, ctx, **loads)``, with its sigmoids lowered as :func:`fast_logistic` when
    ``approx_math`` (see the module docstring). ``acc`` and ``loads`` are register chunks
    (arrays or tuples of arrays); ``ctx`` is the chunk's epilogue context, closed over."""
    if not approx_math:
        return body(acc, ctx, **loads)
    flat, tree = jax.tree.flatten((acc, loads))

    def flat_body(*xs):
        a, kw = jax.tree.unflatten(tree, xs)
        return body(a, ctx, **kw)

    closed, out_shape = jax.make_jaxpr(flat_body, return_shape=True)(*flat)
    if not _contains_logistic(closed.jaxpr):
        return body(acc, ctx, **loads)
    outs = _eval(closed.jaxpr, closed.consts, flat)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
