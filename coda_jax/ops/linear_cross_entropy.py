"""Final RMSNorm + LM-head GEMM + cross-entropy, never holding all ``[M, V]`` logits.

Forward: one GEMM ``logits = rstd * (h @ W^T)`` whose epilogue keeps an online row
log-sum-exp across vocab tiles (stateful transform) and the target's logit (a masked row
reduction); only ``[P, M]`` partials reach memory.

    loss_i = lse_i - logit_i[target_i] + z_loss * lse_i^2     (rows with ignore_index: 0)

Backward, one vocab chunk at a time (only ``[M, chunk]`` alive): the logits GEMM is
recomputed and its epilogue writes ``dlogits = (softmax * (1 + 2 z lse) - onehot) * g``
(from the saved LSE) and the final norm's row term ``sum_V(logits * dlogits)``; then
``g_h += dlogits @ W_c`` and ``dW_c = dlogits^T @ (x_hat * gamma)``. The final RMSNorm
backward ``dx = dres + rstd*(gamma*g_h - x_hat*zdz)`` closes it.

When the logits fit a memory budget (``save_logits``, automatic by default) the forward's
epilogue also writes them (:data:`~coda_jax.programs.RMS_LSE_LOGITS`), and the backward is
one elementwise pass (``dlogits`` and ``zdz`` from the saved logits, fused by XLA) and two
plain GEMMs, with no second LM-head GEMM: the recompute path trades that GEMM (a third of
the op's FLOPs) for memory, which pays only when memory is short.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.lowering import GemmLowering
from coda_jax.ops.checks import check_2d, check_float, check_same_dtype, check_vector
from coda_jax.ops.names import LINEAR_CROSS_ENTROPY
from coda_jax.ops.norm_carry import NormCarry, resolve_carry, rstd_from_partials
from coda_jax.ops.plain_gemm import matmul, wgrad
from coda_jax.options import current_options
from coda_jax.sharding import typed_like

REDUCTIONS = ("mean", "sum", "none")
# Vocab columns per backward chunk: the largest dlogits block alive is [M, VOCAB_CHUNK].
VOCAB_CHUNK = 16384
# Saved logits allowed by default: this fraction of the device's memory, or
# DEFAULT_LOGITS_BUDGET bytes where the device does not report its memory (CPU).
LOGITS_BUDGET_FRACTION = 1 / 8
DEFAULT_LOGITS_BUDGET = 2 << 30


def resolve_logits_dtype(logits_dtype) -> jnp.dtype:
    """Storage dtype of saved logits: the argument, else the option
    ``cross_entropy.logits_dtype`` (float32 by default)."""
    if logits_dtype is None:
        return jnp.dtype(current_options().cross_entropy.logits_dtype)
    try:
        dt = jnp.dtype(logits_dtype)
    except TypeError:
        dt = None
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"logits_dtype must be float32 or bfloat16, got {logits_dtype!r}")
    return dt


def logits_budget_bytes() -> int:
    """Bytes of saved logits that ``save_logits="auto"`` allows: the option
    ``cross_entropy.logits_budget_mb`` if set, else 1/8 of this process's first device's
    memory (``memory_stats()["bytes_limit"]``: the 1B model's 8192 x 128256 float32 logits,
    3.9 GiB, fit on an 80 GB GPU), else 2 GiB.
    """
    mb = current_options().cross_entropy.logits_budget_mb
    if mb != "auto":
        return int(mb * (1 << 20))
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without memory statistics)
        stats = {}
    limit = stats.get("bytes_limit")
    return int(limit * LOGITS_BUDGET_FRACTION) if limit else DEFAULT_LOGITS_BUDGET


def resolve_save_logits(save_logits: bool | None, m: int, v: int, logits_dtype) -> bool:
    """Whether the forward keeps the ``[m, v]`` logits: the argument, else the option
    ``cross_entropy.save_logits`` (``"auto"``: whether they fit :func:`logits_budget_bytes`)."""
    if save_logits is not None:
        return bool(save_logits)
    choice = current_options().cross_entropy.save_logits
    if choice != "auto":
        return choice
    return m * v * jnp.dtype(logits_dtype).itemsize <= logits_budget_bytes()


def vocab_shard(w, vocab_axis) -> tuple[jax.Array | int, int]:
    """(first vocab id of this shard's rows of ``w`` ``[V_s, d]``, an array or an FP8 tensor; total vocab size)."""
    if vocab_axis is None:
        return 0, w.shape[0]
    return jax.lax.axis_index(vocab_axis) * w.shape[0], w.shape[0] * jax.lax.axis_size(vocab_axis)


def _forward(lowering, eps, z_loss, save, logits_dtype, vocab_axis, x, gamma, w, h, sumsq, targets):
    rstd = rstd_from_partials(sumsq, x.shape[1], eps)
    offset, _ = vocab_shard(w, vocab_axis)
    # A target on another shard (or -1, ignored) matches no column of this one.
    loads = {"rstd": rstd, "target": targets - offset}
    if save:
        outs = lowering.gemm(programs.RMS_LSE_LOGITS, h, w, loads, transpose_b=True,
                             out_dtypes={"logits": logits_dtype})
    else:
        outs = lowering.gemm(programs.RMS_LSE, h, w, loads, transpose_b=True)
    losses, lse = row_losses_from_partials(outs, targets, z_loss, w.shape[0], vocab_axis)
    return losses, rstd, lse, outs.get("logits")


def row_losses_from_partials(outs: dict, targets: jax.Array, z_loss: float, v_local: int,
                             vocab_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """``(losses [M], lse [M])`` float32 from the LM-head GEMM's ``lse`` and ``target_logit``
    partials ``[P, M]`` (one per vocab tile; with ``vocab_axis``, combined over its shards of
    ``v_local`` columns each)."""
    v = v_local if vocab_axis is None else v_local * jax.lax.axis_size(vocab_axis)
    lse = jax.nn.logsumexp(outs["lse"], axis=0)
    target_logit = jnp.sum(outs["target_logit"], axis=0)
    if vocab_axis is not None:  # combine the shards' LSEs ([M] each) and target logits
        top = jax.lax.pmax(lse, vocab_axis)
        lse = top + jnp.log(jax.lax.psum(jnp.exp(lse - top), vocab_axis))
        target_logit = jax.lax.psum(target_logit, vocab_axis)
    valid = targets >= 0
    losses = jnp.where(valid, lse - target_logit + z_loss * lse * lse, 0.0)
    # A target outside [0, V) that is not ignore_index cannot be reported under jit: its
    # row's loss is NaN, so the error shows instead of a silently wrong loss.
    losses = jnp.where(targets >= v, jnp.nan, losses)
    return losses, lse


def grad_loads(lse: jax.Array, targets: jax.Array, dloss: jax.Array, z_loss: float, v: int) -> dict:
    """The row loads of the cross-entropy backward (:data:`coda_jax.programs.CE_GRAD`'s
    ``lse``, ``gscale``, ``zcoef``): ignored and out-of-range rows get no gradient."""
    valid = (targets >= 0) & (targets < v)
    return {"lse": lse, "gscale": jnp.where(valid, dloss, 0.0).astype(jnp.float32), "zcoef": 1.0 + 2.0 * z_loss * lse}


def final_norm_backward(x: jax.Array, gamma: jax.Array, rstd: jax.Array, g_h: jax.Array,
                        zdz: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(dx [M, d] x.dtype, dgamma [d] gamma.dtype)`` of the final RMSNorm from the gradient
    ``g_h [M, d]`` of its output ``x_hat * gamma`` and the row term ``zdz = sum_V(logits *
    dlogits)`` ``[M]`` (float32): ``dx = rstd * (gamma * g_h - x_hat * zdz / d)``,
    ``dgamma = sum_M(g_h * x_hat)``, elementwise over ``[M, d]``."""
    d = x.shape[1]
    xh = x.astype(jnp.float32) * rstd[:, None]
    dx = rstd[:, None] * (gamma.astype(jnp.float32) * g_h - xh * (zdz / d)[:, None])
    return dx.astype(x.dtype), jnp.sum(g_h * xh, axis=0).astype(gamma.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _row_losses(lowering: GemmLowering, eps: float, z_loss: float, save: bool, logits_dtype, vocab_axis,
                x, gamma, w, h, sumsq, targets):
    # Not differentiated (evaluation): nothing to save.
    return _forward(lowering, eps, z_loss, False, logits_dtype, vocab_axis, x, gamma, w, h, sumsq, targets)[0]


def _row_losses_fwd(lowering, eps, z_loss, save, logits_dtype, vocab_axis, x, gamma, w, h, sumsq, targets):
    losses, rstd, lse, logits = _forward(lowering, eps, z_loss, save, logits_dtype, vocab_axis, x, gamma, w, h,
                                         sumsq, targets)
    return losses, (x, gamma, w, h, sumsq, targets, rstd, lse, logits)


def _row_losses_bwd(lowering, eps, z_loss, save, logits_dtype, vocab_axis, res, dloss):
    x, gamma, w, h, sumsq, targets, rstd, lse, logits = res
    offset, v = vocab_shard(w, vocab_axis)
    if vocab_axis is not None:
        # Every row's loss depends on every shard's columns; the caller hands each shard the
        # cotangent of its own rows only (see the vocab_axis argument), so gather them all.
        dloss = jax.lax.psum(dloss, vocab_axis)
    loads = {"rstd": rstd, **grad_loads(lse, targets, dloss, z_loss, v)}
    xg = (x.astype(jnp.float32) * rstd[:, None] * gamma.astype(jnp.float32)).astype(w.dtype)  # x_hat * gamma
    local = targets - offset  # this shard's column of each target (none if elsewhere)
    if save:
        g_h, zdz, dw = _grads_from_logits(lowering, logits, w, xg, local, loads)
    else:
        g_h, zdz, dw = _grads_by_recompute(lowering, h, w, xg, local, loads)
    # Linear in (g_h, zdz): with a vocab axis, each shard's dx and d_gamma are its partial
    # sums over its columns, and the caller's shard_map sums them.
    dx, dgamma = final_norm_backward(x, gamma, rstd, g_h, zdz)
    return typed_like(dx, x), dgamma, dw, jnp.zeros_like(h), jnp.zeros_like(sumsq), None


def _grads_from_logits(lowering, logits, w, xg, targets, loads):
    """``(g_h [M, d] f32, zdz [M] f32, dW [V, d])`` from the saved ``[M, V]`` logits."""
    col = jnp.arange(w.shape[0], dtype=jnp.int32)[None, :]
    dlog, zdz = programs.ce_grad_from_logits(logits, col, targets[:, None], loads["lse"][:, None],
                                             loads["gscale"][:, None], loads["zcoef"][:, None])
    dlog = dlog.astype(w.dtype)
    g_h = matmul(lowering, dlog, w, out_dtype=jnp.float32)
    dw = wgrad(lowering, dlog, xg, w)
    return g_h, zdz, dw


def _grads_by_recompute(lowering, h, w, xg, targets, loads):
    """``(g_h [M, d] f32, zdz [M] f32, dW [V, d])``, recomputing the logits GEMM one vocab
    chunk at a time (only ``[M, VOCAB_CHUNK]`` alive)."""
    m, d = h.shape
    v = w.shape[0]
    g_h = jnp.zeros((m, d), jnp.float32)
    zdz = jnp.zeros((m,), jnp.float32)
    dw_chunks = []
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(v, c0 + VOCAB_CHUNK)
        w_c = w[c0:c1]
        outs = lowering.gemm(programs.CE_GRAD, h, w_c, dict(loads, target=targets - c0), transpose_b=True,
                             out_dtypes={"dlogits": w.dtype})
        dlog = outs["dlogits"]
        zdz = zdz + jnp.sum(outs["zdz"], axis=0)
        g_h = lowering.gemm(programs.ACCUMULATE, dlog, w_c, {"prev": g_h}, out_dtypes={"out": jnp.float32})["out"]
        dw_chunks.append(wgrad(lowering, dlog, xg, w))
    dw = jnp.concatenate(dw_chunks, axis=0) if len(dw_chunks) > 1 else dw_chunks[0]
    return g_h, zdz, dw


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


def linear_cross_entropy(
    x: jax.Array,
    gamma: jax.Array,
    w_vocab: jax.Array,
    targets: jax.Array,
    *,
    carry: NormCarry | None = None,
    eps: float = 1e-5,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    save_logits: bool | None = None,
    logits_dtype=None,
    vocab_axis: str | None = None,
    backend: str | None = None,
) -> jax.Array:
    """Cross-entropy of ``RMSNorm(x; gamma) @ w_vocab^T`` against ``targets``.

    Args:
      x: ``[M, d]`` final residual stream.
      gamma: ``[d]`` final-norm weight.
      w_vocab: ``[V, d]`` LM-head weight (Hugging Face ``lm_head.weight`` layout; a tied
        embedding table works as is), same dtype as ``x``.
      targets: ``[M]`` integer class ids in ``[0, V)`` or ``ignore_index``.
      carry: optional :class:`NormCarry` of ``x`` (from the last block's GEMM).
      eps: final-norm epsilon.
      ignore_index: rows whose target equals it contribute no loss and no gradient.
      reduction: ``"mean"`` (over non-ignored rows), ``"sum"`` or ``"none"`` (``[M]``).
      z_loss: coefficient of the auxiliary ``lse^2`` term (PaLM's z-loss); 0 disables it.
      save_logits: keep the ``[M, V]`` logits from the forward for the backward (no second
        LM-head GEMM; ``M * V`` elements of ``logits_dtype`` alive between the passes) or
        recompute them chunk by chunk in the backward (``[M, 16384]`` alive). ``None``
        (default): the option ``cross_entropy.save_logits`` (by default, save when they fit
        :func:`logits_budget_bytes`, 1/8 of device memory). The forward is the same GEMM
        either way.
      logits_dtype: storage dtype of saved logits: float32 (the gradient is the
        recompute path's up to float32 rounding) or bfloat16 (half the memory and traffic;
        the gradient then carries bf16 rounding of the logits, ~1e-2 relative at logit
        scales of a trained model, as in a plain JAX loss on bf16 logits; the loss itself
        stays exact: the LSE and the target logit come from the float32 accumulator).
        ``None`` (default): the option ``cross_entropy.logits_dtype`` (float32).
      vocab_axis: inside a ``shard_map`` (``check_vma=False``) whose axis of this name splits
        ``w_vocab``'s rows (shard ``i`` holds vocab ids ``[i V_s, (i+1) V_s)``): each shard
        runs the LM-head GEMM on its columns only, and the shards' row LSEs and target
        logits are combined across the axis (``[M]`` vectors). ``targets`` are global ids.
        The per-row losses are then the same on every shard; the gradients with respect to
        ``x`` and ``gamma`` are each shard's partial sums (``shard_map``'s transpose sums them
        over the axis, as it does for an input replicated along it). The backward sums the
        losses' cotangent over the axis, so each row's loss must reach the output from one
        shard only: keep ``reduction="none"`` and return each shard's own slice of rows
        (:func:`coda_jax.layers.vocab_parallel.vocab_parallel_cross_entropy` does).
      backend: see :mod:`coda_jax.backend`.

    Returns:
      float32 scalar (``mean`` / ``sum``) or ``[M]`` float32 per-row losses.
    """
    check_args(x, gamma, w_vocab, targets, reduction, z_loss)
    logits_dtype = resolve_logits_dtype(logits_dtype)
    carry = resolve_carry(x, gamma, carry)
    lowering = lowering_for(LINEAR_CROSS_ENTROPY, backend)
    _, v = vocab_shard(w_vocab, vocab_axis)
    t = prepared_targets(targets, ignore_index, v)
    save = resolve_save_logits(save_logits, x.shape[0], w_vocab.shape[0], logits_dtype)
    losses = _row_losses(lowering, float(eps), float(z_loss), save, jnp.dtype(logits_dtype), vocab_axis, x, gamma,
                         w_vocab, carry.h, carry.sumsq, t)
    return reduce_losses(losses, t, reduction)


def check_args(x, gamma, w_vocab, targets, reduction: str, z_loss: float) -> None:
    """The argument rules of :func:`linear_cross_entropy` (``ValueError`` / ``TypeError`` naming
    the argument)."""
    check_2d("x", x)
    check_float("x", x)
    check_vector("gamma", gamma, x.shape[1])
    if w_vocab.ndim != 2 or w_vocab.shape[1] != x.shape[1]:
        raise ValueError(f"w_vocab must be [vocab, d={x.shape[1]}], got shape {tuple(w_vocab.shape)}")
    check_same_dtype(x=x, w_vocab=w_vocab)
    if targets.shape != (x.shape[0],) or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be an integer array of shape ({x.shape[0]},), got {targets.dtype}{tuple(targets.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if z_loss < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")


def prepared_targets(targets: jax.Array, ignore_index: int, v: int) -> jax.Array:
    """``[M]`` int32 targets as the programs read them: ignored rows -1 (no column matches,
    the loss masks them), other ids outside ``[0, v)`` ``v`` (the forward marks their loss NaN)."""
    return jnp.where(targets == ignore_index, -1, jnp.where((targets < 0) | (targets >= v), v, targets)).astype(jnp.int32)


def reduce_losses(losses: jax.Array, targets: jax.Array, reduction: str) -> jax.Array:
    """Row losses ``[M]`` reduced as ``reduction`` asks (``"mean"`` over the rows whose prepared
    target is not ignored)."""
    if reduction == "none":
        return losses
    total = jnp.sum(losses)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(targets >= 0), 1).astype(jnp.float32)
