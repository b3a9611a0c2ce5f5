"""The LM head in FP8: :func:`coda_jax.linear_cross_entropy` with its three GEMMs on FP8 operands.

The math is :mod:`coda_jax.ops.linear_cross_entropy`'s (final RMSNorm folded into the
logits GEMM, online LSE in its epilogue); the operands are per-tensor-scaled FP8
(:mod:`coda_jax.fp8`), K-major as Hopper's FP8 MMA reads them:

    forward  logits = rstd * (h @ W^T)       h: e4m3 [M, d]   W: e4m3 [V, d]
    dgrad    g'     = dlogits' @ W            dlogits': e5m2 [M, V]   W^T copy [d, V]
    wgrad    dW     = dlogits'^T @ h          dlogits'^T copy [V, M]   h^T copy [d, M]

``h = x * gamma`` comes from the last FP8 block's down GEMM, both layouts written in its
epilogue (:class:`coda_jax.ops.fp8_llama_block.Fp8Carry`; without one, a standalone pass
quantizes it). The backward quantizes ``dlogits' = rstd * dlogits``: with the row scale in
the left operand, the wgrad needs no normalized copy of ``h`` (``x_hat * gamma = rstd * h``),
and the dgrad gives ``g' = rstd * g_h``, which the final norm's backward divides back out.

With saved logits (the default where they fit, :func:`coda_jax.linear_cross_entropy`'s
``save_logits``) one epilogue pass over them (:data:`coda_jax.programs.CE_GRAD_Q8`) computes
``dlogits'`` and writes its two e5m2 layouts and amax from registers; with recomputed logits each vocab chunk's CE-gradient GEMM runs on the FP8
operands, writes its ``dlogits'`` in float32, and a pass quantizes it (delayed scaling: one scale for every chunk;
current scaling: each chunk by its own amax).

Recipe state: ``meta [3, history]`` float32, the amax histories of :data:`HEAD_TENSORS`; its
gradient is its next value (:mod:`coda_jax.fp8`). The row ``h`` is recorded only where this
op quantizes ``h`` itself (else the last block's ``h_out`` row holds it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.fp8 import E4M3, E5M2, Fp8Recipe, Fp8Tensor, next_history, quantize_tensor, scale_from_history
from coda_jax.lowering import GemmLowering
from coda_jax.ops.epilogue_pass import epilogue_pass
from coda_jax.ops.fp8_gemm import backward_gemm, fp8_gemm, quantizing_run
from coda_jax.ops.fp8_llama_block import Fp8Carry
from coda_jax.ops.linear_cross_entropy import (VOCAB_CHUNK, check_args, final_norm_backward, grad_loads,
                                               prepared_targets, reduce_losses, resolve_logits_dtype,
                                               resolve_save_logits, row_losses_from_partials, vocab_shard)
from coda_jax.ops.names import LINEAR_CROSS_ENTROPY
from coda_jax.ops.norm_carry import rstd_from_partials
from coda_jax.sharding import typed_like

__all__ = ["HEAD_TENSORS", "fp8_linear_cross_entropy"]

# The quantized tensors of the LM head, in the order of the rows of its ``meta``.
HEAD_TENSORS = ("h", "w", "dlogits")
_ROW = {name: i for i, name in enumerate(HEAD_TENSORS)}
_DTYPE = {"h": E4M3, "w": E4M3, "dlogits": E5M2}


@dataclasses.dataclass(frozen=True)
class _Static:
    lowering: GemmLowering
    eps: float
    z_loss: float
    save: bool
    logits_dtype: jnp.dtype
    margin: int
    scaling: str
    w_dtype: jnp.dtype  # w's, the dtype of its gradient
    vocab_axis: str | None = None
    amax_axes: tuple[str, ...] = ()  # inside a shard_map: the axes an amax is reduced over
    promote_k: int = 0  # Fp8Recipe.promote_k / promote_min_k: the dgrad's and wgrad's float32 promotion
    promote_min_k: int = 0


def _global_amax(st: _Static, amax: jax.Array) -> jax.Array:
    """A shard's amax made the whole tensor's (a max over the shard_map's axes, if any)."""
    return jax.lax.pmax(amax, st.amax_axes) if st.amax_axes else amax


def _quantize(st: _Static, meta, name: str, x, **kw) -> tuple[Fp8Tensor, jax.Array]:
    """``x`` quantized as tensor ``name`` and its (whole tensor's) amax: the delayed scale (from
    its history), or the current one (from that amax)."""
    amax = _global_amax(st, jnp.max(jnp.abs(x)).astype(jnp.float32))
    history = amax[None] if st.scaling == "current" else meta[_ROW[name]]
    return quantize_tensor(x, history, _DTYPE[name], st.margin, **kw)[0], amax


def _forward(st: _Static, x, gamma, w, h, sumsq, targets, meta):
    amax = {}
    if h is None:  # no FP8 carry: h = x * gamma quantized here, its sums of squares with it
        xf = x.astype(jnp.float32)
        sumsq = jnp.sum(xf * xf, axis=1)[None]
        h, amax["h"] = _quantize(st, meta, "h", xf * gamma.astype(jnp.float32))
    rstd = rstd_from_partials(sumsq, x.shape[1], st.eps)
    wq, amax["w"] = _quantize(st, meta, "w", w)  # [V, d] (the forward's B) and [d, V] (the dgrad's)
    # A target on another vocab shard (or -1, ignored) matches no column of this one.
    loads = {"rstd": rstd, "target": targets - vocab_shard(w, st.vocab_axis)[0]}
    if st.save:
        outs = fp8_gemm(st.lowering, programs.RMS_LSE_LOGITS, h, wq.T, loads, out_dtypes={"logits": st.logits_dtype})
    else:
        outs = fp8_gemm(st.lowering, programs.RMS_LSE, h, wq.T, loads)
    losses, lse = row_losses_from_partials(outs, targets, st.z_loss, w.shape[0], st.vocab_axis)
    if st.save:  # the backward reads h^T (wgrad) and W^T (dgrad) only; recomputing, h and W too
        h, wq = Fp8Tensor(None, h.data_t, h.scale_inv), Fp8Tensor(None, wq.data_t, wq.scale_inv)
    saved = (x, gamma, h, wq, targets, rstd, lse, outs.get("logits"), amax)
    return losses, saved


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_losses(st: _Static, x, gamma, w, h, sumsq, targets, meta):
    return _forward(st, x, gamma, w, h, sumsq, targets, meta)[0]


def _row_losses_fwd(st, x, gamma, w, h, sumsq, targets, meta):
    losses, saved = _forward(st, x, gamma, w, h, sumsq, targets, meta)
    return losses, (saved, meta, h, sumsq)


def _row_losses_bwd(st, res, dloss):
    (x, gamma, h, wq, targets, rstd, lse, logits, amax), meta, h_in, sumsq_in = res
    amax = dict(amax)
    offset, v = vocab_shard(wq, st.vocab_axis)
    if st.vocab_axis is not None:
        # Every row's loss depends on every shard's columns; the caller hands each shard the
        # cotangent of its own rows only, so gather them all (as linear_cross_entropy does).
        dloss = jax.lax.psum(dloss, st.vocab_axis)
    loads = grad_loads(lse, targets, dloss, st.z_loss, v)
    targets = targets - offset  # this shard's column of each target
    # rstd folded into the row scale: dlogits' = rstd * dlogits, zdz' = rstd * zdz.
    loads["gscale"] = loads["gscale"] * rstd
    if st.save:
        dq, zdz = _grads_from_logits(st, meta, amax, logits, targets, loads)
        bw_gemm = backward_gemm(st.promote_k, st.promote_min_k)
        g_h = bw_gemm(st.lowering, programs.IDENTITY, dq, wq, {}, out_dtypes={"out": jnp.float32})["out"]
        dw = bw_gemm(st.lowering, programs.IDENTITY, dq.T, h, {}, out_dtypes={"out": st.w_dtype},
                     contracts_tokens=True)["out"]
    else:
        g_h, zdz, dw = _grads_by_recompute(st, meta, amax, h, wq, targets, rstd, loads)
    # g' = rstd * g_h and zdz' = rstd * zdz: the final norm's backward takes the unscaled ones.
    dx, dgamma = final_norm_backward(x, gamma, rstd, g_h / rstd[:, None], zdz / rstd)
    new_meta = jnp.stack([next_history(meta[i], amax[name]) if name in amax else meta[i]
                          for i, name in enumerate(HEAD_TENSORS)])
    if st.amax_axes:
        # meta enters the shard_map replicated: its transpose sums the shards' cotangents, so
        # the first shard alone returns the histories (the others zeros; the sum is exact).
        first = functools.reduce(jnp.logical_and, [jax.lax.axis_index(a) == 0 for a in st.amax_axes])
        new_meta = jnp.where(first, new_meta, 0.0)
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
    return typed_like(dx, x), dgamma, dw, zeros(h_in), zeros(sumsq_in), None, new_meta


def _grads_from_logits(st: _Static, meta, amax: dict, logits, targets, loads) -> tuple[Fp8Tensor, jax.Array]:
    """``(dlogits' in e5m2 with its transposed copy, zdz' [M] f32)`` from the saved logits, in one
    epilogue pass over them (:data:`coda_jax.programs.CE_GRAD_Q8`); under current scaling the pass
    writes ``dlogits'`` in float32 and a pass after it quantizes it with its own amax."""
    m, v = logits.shape
    loads = {"logits": logits, "lse": loads["lse"], "target": targets, "gscale": loads["gscale"],
             "zcoef": loads["zcoef"]}
    delayed = st.scaling == "delayed"
    outs, dq, a = quantizing_run(lambda p, l, od: epilogue_pass(st.lowering, p, m, v, l, out_dtypes=od or None),
                                 programs.CE_GRAD_Q8, loads, "dlogits", jnp.float32,
                                 scale=scale_from_history(meta[_ROW["dlogits"]], E5M2, st.margin) if delayed else None,
                                 quantize=None if delayed else lambda x: _quantize(st, meta, "dlogits", x))
    amax["dlogits"] = _global_amax(st, a) if delayed else a  # _quantize's amax is the whole tensor's already
    return dq, jnp.sum(outs["zdz"], axis=0)


def _grads_by_recompute(st: _Static, meta, amax: dict, h: Fp8Tensor, wq: Fp8Tensor, targets, rstd, loads):
    """``(g' [M, d] f32, zdz' [M] f32, dW [V, d])``, recomputing the FP8 logits GEMM one vocab
    chunk at a time: each chunk's ``dlogits'`` quantized (both layouts) before its two GEMMs."""
    m, d = h.data.shape
    v = wq.shape[0]
    g_h = jnp.zeros((m, d), jnp.float32)
    zdz = jnp.zeros((m,), jnp.float32)
    dw_chunks, amaxes = [], []
    bw_gemm = backward_gemm(st.promote_k, st.promote_min_k)
    for c0 in range(0, v, VOCAB_CHUNK):
        c1 = min(v, c0 + VOCAB_CHUNK)
        w_c = Fp8Tensor(wq.data[c0:c1], wq.data_t[:, c0:c1], wq.scale_inv)
        outs = fp8_gemm(st.lowering, programs.CE_GRAD, h, w_c.T, dict(loads, rstd=rstd, target=targets - c0),
                        out_dtypes={"dlogits": jnp.float32})  # float32: one rounding, to e5m2
        zdz = zdz + jnp.sum(outs["zdz"], axis=0)
        dq, a = _quantize(st, meta, "dlogits", outs["dlogits"])
        amaxes.append(a)
        g_h = bw_gemm(st.lowering, programs.ACCUMULATE, dq, w_c, {"prev": g_h}, out_dtypes={"out": jnp.float32})["out"]
        dw_chunks.append(bw_gemm(st.lowering, programs.IDENTITY, dq.T, h, {}, out_dtypes={"out": st.w_dtype},
                                 contracts_tokens=True)["out"])
    amax["dlogits"] = jnp.max(jnp.stack(amaxes))
    dw = jnp.concatenate(dw_chunks, axis=0) if len(dw_chunks) > 1 else dw_chunks[0]
    return g_h, zdz, dw


_row_losses.defvjp(_row_losses_fwd, _row_losses_bwd)


def fp8_linear_cross_entropy(
    x: jax.Array,
    gamma: jax.Array,
    w_vocab: jax.Array,
    targets: jax.Array,
    meta: jax.Array,
    *,
    recipe: Fp8Recipe,
    carry: Fp8Carry | None = None,
    eps: float = 1e-5,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    save_logits: bool | None = None,
    logits_dtype=None,
    vocab_axis: str | None = None,
    amax_axes: tuple[str, ...] = (),
    backend: str | None = None,
) -> jax.Array:
    """Cross-entropy of ``RMSNorm(x; gamma) @ w_vocab^T`` with the LM head's GEMMs in FP8.

    Arguments and result as :func:`coda_jax.linear_cross_entropy` (``vocab_axis`` included:
    :func:`coda_jax.layers.vocab_parallel.vocab_parallel_cross_entropy` runs it), and:

    Args:
      meta: ``[3, history]`` float32 amax histories of :data:`HEAD_TENSORS` (newest first);
        its gradient is its next value.
      recipe: the :class:`coda_jax.fp8.Fp8Recipe` (``margin``, ``scaling``).
      carry: the last FP8 block's :class:`Fp8Carry` of ``x`` (``h = x * gamma`` in e4m3, both
        layouts), or None (one pass quantizes ``h``).
      amax_axes: inside a ``shard_map`` over these mesh axes (``check_vma=False``, ``meta``
        passed in replicated): each amax is reduced over them (a max over the whole tensor,
        so every shard quantizes with one device's scales), and the first shard alone returns
        the histories' gradient (the map's transpose sums a replicated input's cotangents).
        ``vocab_axis`` must be one of them.
    """
    check_args(x, gamma, w_vocab, targets, reduction, z_loss)
    m, d = x.shape
    if meta.ndim != 2 or meta.shape[0] != len(HEAD_TENSORS):
        raise ValueError(f"meta must be [{len(HEAD_TENSORS)}, history] amax histories, got {tuple(meta.shape)}")
    if carry is not None:
        if not isinstance(carry, Fp8Carry):
            raise TypeError(f"carry must be an Fp8Carry or None, got {type(carry).__name__}")
        if carry.h.shape != (m, d) or carry.h.data_t is None:
            raise ValueError(f"carry.h must be an Fp8Tensor of shape {(m, d)} with its transposed copy, "
                             f"got shape {carry.h.shape}")
        if carry.grad_scale is not None:  # its writer would take a zero gradient for its output
            raise ValueError("carry asks for its block's output gradient through the carry (the block ran with "
                             "grad_through_carry=True), which the LM head does not return: run the last block "
                             "with grad_through_carry=False")
    amax_axes = tuple(amax_axes)
    if vocab_axis is not None and vocab_axis not in amax_axes:
        raise ValueError(f"amax_axes must include vocab_axis {vocab_axis!r} (the shard_map's axes), got {amax_axes}")
    logits_dtype = resolve_logits_dtype(logits_dtype)
    lowering = lowering_for(LINEAR_CROSS_ENTROPY, backend)
    t = prepared_targets(targets, ignore_index, vocab_shard(w_vocab, vocab_axis)[1])
    save = resolve_save_logits(save_logits, m, w_vocab.shape[0], logits_dtype)
    st = _Static(lowering, float(eps), float(z_loss), save, jnp.dtype(logits_dtype), recipe.margin, recipe.scaling,
                 jnp.dtype(w_vocab.dtype), vocab_axis, amax_axes, recipe.promote_k,
                 recipe.promote_min_k)
    h = sumsq = None
    if carry is not None:
        h = jax.tree.map(jax.lax.stop_gradient, carry.h)
        sumsq = jax.lax.stop_gradient(carry.sumsq.astype(jnp.float32))
    losses = _row_losses(st, x, gamma, w_vocab, h, sumsq, t, meta)
    return reduce_losses(losses, t, reduction)
