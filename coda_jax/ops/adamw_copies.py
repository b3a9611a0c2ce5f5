"""One AdamW step of a float32 weight that also writes the copy a GEMM reads of it.

An FP8 GEMM reads each weight in e4m3, in both layouts (Hopper's FP8 wgmma takes both
operands K-major: the forward reads ``W^T``, the dgrad ``W``). Quantized at the start of a
step, the float32 weight is read once more for that (4 bytes an element, against the 2 the
copies write). The optimizer's update is the pass that produces the weight: run as an epilogue
pass (:func:`coda_jax.programs.adamw_q8`) it writes the new weight, its moments and the copies
from the same registers, and the read is gone. :func:`adamw_cast_step` does the same for a
weight a bf16 GEMM reads (the LM head's bf16 cast).

The train step does not use them: on the Pallas kernel the pass streams its 30 bytes an
element at about three quarters of a copy's rate, slower than optax's XLA update followed by
the quantizing passes (docs/fp8.md#the-weights-copies-from-the-optimizer-built-and-measured-slower-not-in-the-step).

The math is ``optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(lr, b1, b2, eps,
weight_decay=wd))`` followed by ``optax.apply_updates``, for one leaf; the global norm of
the gradients (over every leaf) and the step's learning rate come in as scalars
(:func:`adamw_scalars`). ``tests/test_adamw_copies.py`` checks it against optax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.fp8 import Fp8Tensor
from coda_jax.lowering import GemmLowering
from coda_jax.ops.epilogue_pass import epilogue_pass


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(programs.ADAMW_SCALARS),
                   meta_fields=["b1", "b2", "eps"])
@dataclasses.dataclass(frozen=True)
class AdamWScalars:
    """One step's scalar loads of :func:`coda_jax.programs.adamw_q8` and ``adamw_cast``
    (float32 ``[]`` each), and the AdamW constants the program is built with (Python floats:
    the bias corrections ``bc1``, ``bc2`` are computed from the same ``b1``, ``b2``)."""

    g_div: jax.Array
    g_mul: jax.Array
    bc1: jax.Array
    bc2: jax.Array
    wd: jax.Array
    neg_lr: jax.Array
    b1: float
    b2: float
    eps: float

    def program_args(self) -> tuple[float, float, float]:
        return self.b1, self.b2, self.eps

    def loads(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name) for name in programs.ADAMW_SCALARS}


def adamw_scalars(count: Any, lr: Any, *, b1: float, b2: float, weight_decay: float, grad_norm: Any,
                  max_norm: float, eps: float = 1e-8) -> AdamWScalars:
    """The scalars of one step: ``count`` the optimizer's step count *before* it (optax's
    ``ScaleByAdamState.count``; int32), ``lr`` the learning rate at that count, ``grad_norm``
    the global norm of all gradients (``optax.tree.norm``), ``max_norm`` the clip; ``b1``,
    ``b2``, ``eps`` as given to ``optax.adamw``."""
    f32 = jnp.float32
    t = (jnp.asarray(count, jnp.int32) + 1).astype(f32)  # optax's count_inc
    grad_norm = jnp.asarray(grad_norm, f32)
    under = grad_norm < max_norm  # optax.clip_by_global_norm's trigger: the gradient unchanged
    return AdamWScalars(
        g_div=jnp.where(under, 1.0, grad_norm).astype(f32),
        g_mul=jnp.where(under, 1.0, max_norm).astype(f32),
        bc1=(1.0 - jnp.asarray(b1, f32) ** t).astype(f32),
        bc2=(1.0 - jnp.asarray(b2, f32) ** t).astype(f32),
        wd=jnp.asarray(weight_decay, f32),
        neg_lr=-jnp.asarray(lr, f32),
        b1=float(b1), b2=float(b2), eps=float(eps),
    )


def _check(p, g, mu, nu) -> None:
    if p.ndim != 2:
        raise ValueError(f"adamw: p must be a matrix [M, N], got shape {p.shape}")
    for name, x in (("p", p), ("g", g), ("mu", mu), ("nu", nu)):
        if x.shape != p.shape or x.dtype != jnp.float32:
            raise ValueError(f"adamw: {name} must be float32 of p's shape {p.shape}, got {x.dtype} {x.shape}")


def adamw_q8_step(lowering: GemmLowering, p: jax.Array, g: jax.Array, mu: jax.Array, nu: jax.Array,
                  scalars: AdamWScalars, q_scale: jax.Array,
                  **kw: Any) -> tuple[jax.Array, jax.Array, jax.Array, Fp8Tensor, jax.Array]:
    """AdamW on weight ``p`` ``[M, N]`` (float32; ``g``, ``mu``, ``nu`` likewise) and the new
    weight in e4m3 at ``q_scale`` (a float32 scalar: delayed scaling, chosen before the step).

    Returns ``(p_new, mu_new, nu_new, Fp8Tensor, amax)``: the Fp8Tensor holds ``p_new`` in
    e4m3 ``[M, N]``, its transpose ``[N, M]`` and ``1 / q_scale``; ``amax`` is ``max|p_new|``.
    ``kw`` goes to :func:`coda_jax.ops.epilogue_pass.epilogue_pass` (e.g. ``replicated``)."""
    _check(p, g, mu, nu)
    if jnp.shape(q_scale) != ():
        raise ValueError(f"adamw: q_scale must be a scalar, got shape {jnp.shape(q_scale)}")
    m, n = p.shape
    q_scale = jnp.asarray(q_scale, jnp.float32)
    outs = epilogue_pass(lowering, programs.adamw_q8(*scalars.program_args()), m, n,
                         {"p": p, "g": g, "mu": mu, "nu": nu, **scalars.loads(), "copy_scale": q_scale}, **kw)
    return (outs["p_new"], outs["mu_new"], outs["nu_new"], Fp8Tensor(outs["copy"], outs["copy_t"], 1.0 / q_scale),
            jnp.max(outs["copy_amax"]))


def adamw_cast_step(lowering: GemmLowering, p: jax.Array, g: jax.Array, mu: jax.Array, nu: jax.Array,
                    scalars: AdamWScalars, **kw: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`adamw_q8_step` with the new weight's bfloat16 copy ``[M, N]`` instead of the FP8
    copies (a bf16 GEMM's operand, e.g. the LM head's): ``(p_new, mu_new, nu_new, copy)``."""
    _check(p, g, mu, nu)
    m, n = p.shape
    outs = epilogue_pass(lowering, programs.adamw_cast(*scalars.program_args()), m, n,
                         {"p": p, "g": g, "mu": mu, "nu": nu, **scalars.loads()}, **kw)
    return outs["p_new"], outs["mu_new"], outs["nu_new"], outs["copy"]
