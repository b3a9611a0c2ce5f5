"""The optimizer and the jitted train / eval steps shared by the example and the benchmarks.

    tx = training.adamw_cosine(lr=1e-3, warmup=50, steps=1000)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train_step, eval_step, graphdef = training.make_steps(model, optimizer)
    state = nnx.state((model, optimizer))
    state, loss = train_step(state, inputs, targets)     # inputs, targets: int32 [batch, seq]

Any NNX model with a ``loss(inputs, targets) -> scalar`` method works (``CodaLlama``, the
plain JAX baseline of ``benchmarks/plain_llama.py``), so a benchmark times both on one step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coda_jax.fp8 import Fp8Meta, Fp8Recipe


def cosine_schedule(lr: float, warmup: int, steps: int) -> optax.Schedule:
    """The learning rate of :func:`adamw_cosine` by step: linear warm-up from 0 to ``lr`` over
    ``warmup`` steps, cosine decay to ``lr / 10`` at ``steps``."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.1)


def adamw_cosine(lr: float, warmup: int, steps: int, *, weight_decay: float = 0.1,
                 clip_norm: float = 1.0) -> optax.GradientTransformation:
    """AdamW (``b1`` 0.9, ``b2`` 0.95, ``weight_decay``) after global-norm clipping at
    ``clip_norm``, with linear warm-up from 0 to ``lr`` over ``warmup`` steps and cosine decay
    to ``lr / 10`` at ``steps``: the Llama recipe."""
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(cosine_schedule(lr, warmup, steps), b1=0.9, b2=0.95, weight_decay=weight_decay))


def make_steps(model: nnx.Module, optimizer: nnx.Optimizer,
               state_shardings: Any = None) -> tuple[Callable, Callable, nnx.GraphDef]:
    """Jitted functional steps over ``state = nnx.state((model, optimizer))``.

    Returns ``(train_step, eval_step, graphdef)``: ``train_step(state, inputs, targets) ->
    (new_state, loss)`` donates ``state`` (parameters and optimizer moments are updated in
    place, no second copy); ``eval_step(state, inputs, targets) -> loss`` (a float32 scalar).
    ``inputs`` and ``targets`` are the model's ``loss`` arguments (int32 ``[batch, seq]`` for
    a Llama). Functional ``jax.jit`` rather than ``nnx.jit``: no graph traversal of the model
    on the host per step.

    ``state_shardings``: the placement of ``state`` on a mesh (a pytree of shardings, e.g.
    ``jax.tree.map(lambda x: x.sharding, state)`` after :func:`coda_jax.sharding.shard_state`).
    The updated state then keeps it. Without it, XLA may place some updated parameters
    differently (FSDP-split norm weights came back replicated, tensor-split ones gathered):
    the next call would recompile, and an ahead-of-time compiled step would refuse its own
    output.

    A model with FP8 recipe state (:class:`coda_jax.fp8.Fp8Meta` variables) gets them
    updated in the same step, from the gradients its ops return for them, and its
    ``config.fp8.on_nonfinite`` policy applied (:class:`coda_jax.fp8.Fp8Recipe`).

    FP8 calibration: under delayed scaling a fresh model (every amax history still zero) has
    no scale yet, and quantizes each tensor with scale 1: small gradients flush to zero in
    e5m2 and the step's weight gradients are mostly noise (docs/fp8.md#the-first-step). So a
    step that starts from all-zero histories (one rule for every FP8 state, current scaling's
    too) only records the amaxes: it returns its loss and the filled histories, and leaves the
    parameters and the optimizer state (its step count too) as they were.
    :func:`fp8_uncalibrated` tells such a state apart, so that a loop can spend that step on its
    first batch and then train on it (``train_llama.py``, the benchmarks). A restored
    checkpoint keeps its histories: no step is spent.
    """
    graphdef, _ = nnx.split((model, optimizer))
    jit_kw = {} if state_shardings is None else {"out_shardings": (state_shardings, None)}
    fp8 = bool(jax.tree.leaves(nnx.state(model, Fp8Meta)))
    recipe = getattr(getattr(model, "config", None), "fp8", None) or Fp8Recipe()

    @functools.partial(jax.jit, donate_argnums=0, **jit_kw)
    def train_step(state, inputs, targets):
        # copy=True: merge() otherwise builds the model on ``state``'s own Variables, which the
        # updates below mutate, and the non-finite skip would "keep" the updated values.
        m, opt = nnx.merge(graphdef, state, copy=True)
        if not fp8:
            loss, grads = nnx.value_and_grad(lambda mm: mm.loss(inputs, targets))(m)
            # Named so that profiles tell the optimizer's kernels from the model's.
            with jax.named_scope("optimizer"):
                opt.update(m, grads)
            return nnx.state((m, opt)), loss
        # FP8: the gradient of each amax history is its next history (coda_jax.fp8).
        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
        loss, grads = nnx.value_and_grad(lambda mm: mm.loss(inputs, targets), argnums=wrt)(m)
        param_grads, histories = nnx.filter_state(grads, nnx.Param, Fp8Meta)
        with jax.named_scope("optimizer"):
            opt.update(m, param_grads)
        nnx.update(m, histories)
        new_state = nnx.state((m, opt))
        # In the optimizer's scope: XLA fuses these selects with the update, and profiles
        # name a fusion by its root (benchmarks/step_ceiling.py counts the optimizer by scope).
        with jax.named_scope("optimizer"):
            finite = jnp.bool_(True)
            if recipe.on_nonfinite == "skip":  # keep everything as it was: no inf reaches a weight or a scale
                finite = jnp.isfinite(optax.global_norm(param_grads))
                for h in jax.tree.leaves(histories):
                    finite &= jnp.all(jnp.isfinite(h))
            # A calibration step (no history yet: see the docstring) keeps the weights and moments.
            update = finite & ~_uncalibrated(state)
            params_new, metas_new = nnx.filter_state(new_state, nnx.Not(Fp8Meta), Fp8Meta)
            params_old, metas_old = nnx.filter_state(state, nnx.Not(Fp8Meta), Fp8Meta)
            kept, metas = _select(update, params_new, params_old), _select(finite, metas_new, metas_old)
            new_state = nnx.merge_state(kept, metas)
        return new_state, loss

    @jax.jit
    def eval_step(state, inputs, targets):
        m, _ = nnx.merge(graphdef, state)
        return m.loss(inputs, targets)

    return train_step, eval_step, graphdef


def _select(keep_new: jax.Array, new: Any, old: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(keep_new, a, b), new, old)


def _uncalibrated(state: Any) -> jax.Array:
    """Whether ``state`` holds FP8 amax histories and every one is all zero (a bool scalar)."""
    leaves = jax.tree.leaves(nnx.filter_state(state, Fp8Meta))
    if not leaves:
        return jnp.bool_(False)
    return jnp.logical_not(functools.reduce(jnp.logical_or, [jnp.any(h != 0) for h in leaves]))


def fp8_uncalibrated(state: Any) -> bool:
    """Whether ``state`` (``nnx.state((model, optimizer))``) is an FP8 model's that has no amax
    history yet: its next :func:`make_steps` train step is a calibration step, which fills the
    histories and applies no update. False for a model without FP8 state. The host-side twin of
    the step's own (traced) check; it reads the histories to the host, so call it before a
    loop, not per step. Under several processes each reads its own copy of the (replicated)
    histories."""
    leaves = jax.tree.leaves(nnx.filter_state(state, Fp8Meta))
    return bool(leaves) and not any(np.any(_host_value(h)) for h in leaves)


def _host_value(x: jax.Array) -> np.ndarray:
    """``x`` on this host: a replicated array's local copy when other processes hold shards."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
