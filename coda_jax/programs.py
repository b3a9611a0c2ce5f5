"""Every epilogue program of the op set, declared once (forward and backward).

Notation (CODA): tokens are rows. ``x`` residual stream ``[M, d]``, ``gamma`` an RMSNorm
weight ``[d]``, ``rstd = 1/sqrt(mean(x^2) + eps)`` per row, ``h = x * gamma``.
RMSNorm(x) @ W = rstd * ((x * gamma) @ W): the row scale commutes with the GEMM, so the
GEMM that produces ``x`` writes ``h`` and per-tile partial sums of squares, and the GEMM
that consumes the norm multiplies its accumulator by ``rstd``.

Programs with parameters are built by ``@E.program_factory`` functions: the same
parameters give the *same* object (kernel caches key on it), and the object pickles as a
call of its factory (a kernel can be generated in a worker process, although its body is
a closure: ``coda_jax/pallas/kernel_workers.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from coda_jax import epilogue as E

# Width of one half of a SwiGLU pair block: the fused gate/up weight stores columns as
# [gate 0..63, up 0..63, gate 64..127, up 64..127, ...] so that one N-tile holds both
# halves of its pairs (CODA interleaves single columns; blocks of 64 keep the kernel's
# register tiles whole). See :func:`coda_jax.ops.swiglu_layout.interleave_gate_up`.
SWIGLU_BLOCK = 64


def _silu(g: jax.Array) -> jax.Array:
    return g * jax.nn.sigmoid(g)


# ---------------------------------------------------------------- forward ----------
def _residual_rms_body(acc, ctx, residual, gamma):
    x = acc + residual  # x = residual + y @ W
    return {"x": x, "h": x * gamma, "sumsq": x * x}


RESIDUAL_RMS = E.Epilogue(
    name="residual_rms",
    loads=(E.tile("residual"), E.col("gamma")),
    outputs=(E.tile_out("x"), E.tile_out("h"), E.row_sum("sumsq")),
    body=_residual_rms_body,
)
"""x = residual + acc; outputs x, h = x * gamma and per-tile sum(x^2) (next norm's stats)."""


def _residual_body(acc, ctx, residual):
    return {"x": acc + residual}


RESIDUAL = E.Epilogue(
    name="residual",
    loads=(E.tile("residual"),),
    outputs=(E.tile_out("x"),),
    body=_residual_body,
)
"""x = residual + acc (last block: no next norm)."""


def _identity_body(acc, ctx):
    return {"out": acc}


IDENTITY = E.Epilogue(name="identity", loads=(), outputs=(E.tile_out("out"),), body=_identity_body, linear=True)
"""Plain GEMM (wgrad/dgrad GEMMs without an epilogue)."""


def _row_scale_body(acc, ctx, rstd):
    return {"z": acc * rstd}


ROW_SCALE = E.Epilogue(
    name="row_scale",
    loads=(E.row("rstd"),),
    outputs=(E.tile_out("z"),),
    body=_row_scale_body,
)
"""RMSNorm-scaled GEMM: z = rstd * (h @ W)."""


@E.program_factory
def rms_swiglu(save_preactivation: bool) -> E.Epilogue:
    """z = rstd * (h @ W_gu); y = silu(z_gate) * z_up (gate/up in SWIGLU_BLOCK pairs)."""

    def body(acc, ctx, rstd):
        lo, hi = acc
        gate, up = lo * rstd, hi * rstd
        out = {"y": _silu(gate) * up}
        if save_preactivation:
            out["z"] = (gate, up)
        return out

    outputs = (E.tile_out("y", half=True),) + ((E.tile_out("z"),) if save_preactivation else ())
    return E.Epilogue(
        name=f"rms_swiglu{'_train' if save_preactivation else ''}",
        loads=(E.row("rstd"),),
        outputs=outputs,
        body=body,
        pair_block=SWIGLU_BLOCK,
    )


@E.program_factory
def rms_rope(half_head: int, qk_norm_eps: float | None, save_preactivation: bool) -> E.Epilogue:
    """qkv = RoPE(rstd * (h @ W_qkv)) with rotate-half pairs inside each head.

    Pair mode with ``pair_block = head_dim / 2``: ``lo``/``hi`` are the two halves of a
    head. Loads: ``rstd`` (row), ``cos``/``sin`` (row_block ``[M, hd/2]``: the rotation of
    each token at each frequency, the same for every head, computed once per token by the
    op), ``rot`` (per pair column: 1 for Q/K heads, 0 for V heads, which pass unrotated).
    With QK-norm (``qk_norm_eps`` set), each Q/K head is RMS-normalized over head_dim
    with weight ``qk_w`` (col, full width) before the rotation.
    """

    def body(acc, ctx, rstd, cos, sin, rot, **kw):
        lo, hi = acc
        zr, zi = lo * rstd, hi * rstd
        out = {}
        if save_preactivation:
            out["z"] = (zr, zi)
        on = rot > 0
        if qk_norm_eps is not None:
            w_lo, w_hi = kw["qk_w"]
            ms = (ctx.row_sum(zr * zr) + ctx.row_sum(zi * zi)) / (2 * half_head)
            r = jax.lax.rsqrt(ms + qk_norm_eps)
            zr = jnp.where(on, zr * r * w_lo, zr)
            zi = jnp.where(on, zi * r * w_hi, zi)
        c, s = jnp.where(on, cos, 1.0), jnp.where(on, sin, 0.0)
        out["qkv"] = (zr * c - zi * s, zi * c + zr * s)
        return out

    loads = (E.row("rstd"), E.row_block("cos"), E.row_block("sin"), E.col("rot", half=True))
    if qk_norm_eps is not None:
        loads += (E.col("qk_w"),)
    outputs = (E.tile_out("qkv"),) + ((E.tile_out("z"),) if save_preactivation else ())
    return E.Epilogue(
        name=f"rms_rope{'_qknorm' if qk_norm_eps is not None else ''}{'_train' if save_preactivation else ''}",
        loads=loads,
        outputs=outputs,
        body=body,
        pair_block=half_head,
    )


def _rms_lse_body(acc, ctx, rstd, target):
    logits = acc * rstd
    hit = ctx.col_index() == target
    return {"lse": logits, "target_logit": jnp.where(hit, logits, 0.0)}


RMS_LSE = E.Epilogue(
    name="rms_lse",
    loads=(E.row("rstd"), E.row("target")),
    outputs=(E.row_logsumexp("lse"), E.row_sum("target_logit")),
    body=_rms_lse_body,
    uses_col_index=True,
)
"""LM head: logits = rstd * (h @ W_vocab^T); online row LSE and the target's logit."""


def _rms_lse_logits_body(acc, ctx, rstd, target):
    out = _rms_lse_body(acc, ctx, rstd, target)
    out["logits"] = out["lse"]
    return out


RMS_LSE_LOGITS = E.Epilogue(
    name="rms_lse_logits",
    loads=(E.row("rstd"), E.row("target")),
    outputs=(E.row_logsumexp("lse"), E.row_sum("target_logit"), E.tile_out("logits")),
    body=_rms_lse_logits_body,
    uses_col_index=True,
)
"""LM head when the logits fit in memory: :data:`RMS_LSE` that also writes the logits tile, so
the backward reads them instead of recomputing the GEMM (:func:`ce_grad_from_logits`)."""



# ---------------------------------------------------------------- backward ---------
@E.program_factory
def rms_dgrad(with_residual_grad: bool, with_dgamma: bool = False) -> E.Epilogue:
    """RMSNorm (+ residual) backward on the dgrad GEMM ``g' = dz' @ W^T``.

    The GEMM's left operand is the *row-scaled* gradient ``dz' = rstd * dz`` (made where
    ``dz`` is made, so it costs no pass of its own), hence ``g' = rstd * g``. With
    ``zdz = sum_N(z * dz) / d`` (equal to mean_d(x_hat*gamma*g): the inner product is
    preserved through the GEMM, so no row reduction of g is needed here):

        dx = dres + rstd * (gamma * g - rstd * x * zdz) = dres + gamma * g' - x * xcoef,

    with the row coefficient ``xcoef = rstd^2 * zdz``. The wgrad GEMM (:data:`NORM_WGRAD`)
    contracts ``x^T @ dz'`` (= ``x_hat^T @ dz``): it reads ``x`` itself, so this epilogue
    writes one tile (``dx``), not a second ``x_hat`` tile for the wgrad.

    ``with_dgamma``: also the column partials of ``d_gamma = sum_M(x * g')`` (= ``sum_M(x_hat
    * g)``). Where the body runs as passes over whole arrays (the ``"xla"`` backend), that
    reduction joins the pass that writes ``dx``, and the wgrad becomes a plain GEMM
    ``(x * gamma)^T @ dz'`` with no ``[d, N]`` pass after it (see
    :func:`coda_jax.ops.normed_gemm.norm_gemm_backward`).
    """

    def body(acc, ctx, x, xcoef, gamma, **kw):
        dx = gamma * acc - x * xcoef
        if with_residual_grad:
            dx = dx + kw["dres"]
        return {"dx": dx, "dgamma": x * acc} if with_dgamma else {"dx": dx}

    loads = (E.tile("x"), E.row("xcoef"), E.col("gamma"))
    if with_residual_grad:
        loads += (E.tile("dres"),)
    return E.Epilogue(
        name=f"rms_dgrad{'_res' if with_residual_grad else ''}{'_dgamma' if with_dgamma else ''}",
        loads=loads,
        outputs=(E.tile_out("dx"),) + ((E.col_sum("dgamma"),) if with_dgamma else ()),
        body=body,
    )


def _norm_dgrad_body(acc, ctx, x, gamma):
    # acc = g = dz @ W^T [M, d] of the *unscaled* dz: the gradient of the normalized input
    # (times gamma). The norm's row term S = sum_d(x * gamma * g) is reduced per tile; the
    # op finishes dx = dres + rstd * gamma * g - x * (rstd^3 * S / d) on [M, d] arrays.
    return {"g": acc, "xgg": x * gamma * acc}


NORM_DGRAD = E.Epilogue(
    name="norm_dgrad",
    loads=(E.tile("x"), E.col("gamma")),
    outputs=(E.tile_out("g"), E.row_sum("xgg")),
    body=_norm_dgrad_body,
)
"""dgrad of an RMSNorm-scaled GEMM whose ``dz`` arrives unscaled (the op's own cotangent, made
by no pass where ``rstd`` could be applied): ``g = dz @ W^T`` and the row partials of
``sum_d(x * gamma * g)``, from which the op computes ``dx`` (see
:func:`coda_jax.ops.normed_gemm.norm_gemm_backward_unscaled`)."""


def _norm_wgrad_body(acc, ctx, gamma, w):
    # acc = P = x^T @ dz' = x_hat^T @ dz  [d, N] (dz' = rstd * dz).  dW = gamma_row * P, and
    # d_gamma_j = sum_i g_ij x_hat_ij = sum_i x_hat_ij sum_n dz_in W_jn = sum_n W_jn P_jn:
    # a row sum over this tile (d_gamma moves from a column reduction of the dgrad
    # epilogue to a row reduction of the wgrad epilogue).
    return {"dw": acc * gamma, "dgamma": acc * w}


NORM_WGRAD = E.Epilogue(
    name="norm_wgrad",
    loads=(E.row("gamma"), E.tile("w")),
    outputs=(E.tile_out("dw"), E.row_sum("dgamma")),
    body=_norm_wgrad_body,
    linear=True,
)
"""wgrad of an RMSNorm-scaled GEMM: ``dW = gamma * (x^T @ dz')`` with ``dz' = rstd * dz`` (that is,
``gamma * (x_hat^T @ dz)``), and d_gamma partials."""


def swiglu_grad(gate, up, dy):
    """(d_gate, d_up, y) of y = silu(gate) * up, given dy; float32 math."""
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_up = dy * silu
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    return d_gate, d_up, silu * up


def _swiglu_dgrad_body(acc, ctx, z, rstd):
    # acc = dy = dout @ W_down^T [M, f] (one column per gate/up pair); z = (gate, up).
    gate, up = z
    d_gate, d_up, _ = swiglu_grad(gate, up, acc)
    # zdz: the MLP norm's row term sum_2f(z * dz) of the unscaled dz, reduced per tile (see
    # rms_dgrad); the dz written is row-scaled by rstd, the operand of the norm's backward.
    return {"dz": (d_gate * rstd, d_up * rstd), "zdz": gate * d_gate + up * d_up}


SWIGLU_DGRAD = E.Epilogue(
    name="swiglu_dgrad",
    loads=(E.tile("z"), E.row("rstd")),
    outputs=(E.tile_out("dz"), E.row_sum("zdz")),
    body=_swiglu_dgrad_body,
    pair_block=SWIGLU_BLOCK,
    half_acc=True,
)
"""SwiGLU backward on the down projection's dgrad GEMM ``dy = dout @ W_down^T``: loads the
saved pre-activation ``z [M, 2f]`` (gate/up pairs) and the MLP norm's ``rstd [M]``; writes
``dz' = rstd * dz [M, 2f]`` (the left operand of the norm's backward GEMMs, see
:func:`rms_dgrad`) and the row partials of ``sum(z * dz)``; ``dy`` never reaches HBM."""


def _dlogits(logits, col_index, target, lse, gscale, zcoef):
    """Cross-entropy gradient of float32 logits: ``(softmax * zcoef - onehot) * gscale``."""
    p = jnp.exp(logits - lse)
    onehot = (col_index == target).astype(jnp.float32)
    return (p * zcoef - onehot) * gscale  # zcoef = 1 + 2 * z_loss * lse


def _ce_grad_body(acc, ctx, rstd, lse, target, gscale, zcoef):
    logits = acc * rstd
    dlogits = _dlogits(logits, ctx.col_index(), target, lse, gscale, zcoef)
    # zdz: the final norm's row term sum_V(logits * dlogits), reduced per vocab tile.
    return {"dlogits": dlogits, "zdz": logits * dlogits}


CE_GRAD = E.Epilogue(
    name="ce_grad",
    loads=(E.row("rstd"), E.row("lse"), E.row("target"), E.row("gscale"), E.row("zcoef")),
    outputs=(E.tile_out("dlogits"), E.row_sum("zdz")),
    body=_ce_grad_body,
    uses_col_index=True,
)
"""Cross-entropy backward on the recomputed logits GEMM, one vocab chunk at a time:
dlogits = (softmax * (1 + 2 z lse) - onehot) * dloss_row, from the saved LSE."""


def ce_grad_from_logits(logits, col_index, target, lse, gscale, zcoef):
    """``dlogits`` and the final norm's row term from saved logits, elementwise (float32).

    The math of :data:`CE_GRAD`'s epilogue, on logits that were kept instead of recomputed:
    ``dlogits = (softmax * zcoef - onehot) * gscale`` and ``zdz = sum_V(logits * dlogits)``.
    Shapes: ``logits [M, V]``, ``col_index [1, V]`` int, row vectors ``[M, 1]``.
    """
    lf = logits.astype(jnp.float32)
    dlogits = _dlogits(lf, col_index, target, lse, gscale, zcoef)
    return dlogits, jnp.sum(lf * dlogits, axis=-1)


def _accumulate_body(acc, ctx, prev):
    return {"out": acc + prev}


ACCUMULATE = E.Epilogue(
    name="accumulate",
    loads=(E.tile("prev"),),
    outputs=(E.tile_out("out"),),
    body=_accumulate_body,
)
"""out = prev + acc (float32 accumulation across vocab chunks)."""


# ---------------------------------------------------------------- FP8 --------------
# Programs whose GEMM also writes the FP8 copies its consumers read (coda_jax.fp8): the
# tensor cast with its delayed scale, its transposed (K-major) copy for the backward's
# GEMMs, and its amax for the next step's scale. The GEMMs that read FP8 operands run these
# (or the programs above) through E.dequantized.
_E4M3, _E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _residual_rms_q8_body(acc, ctx, residual, gamma, h_scale):
    return _residual_rms_body(acc, ctx, residual, gamma)  # h_scale: read by the backend's cast


RESIDUAL_RMS_Q8 = E.Epilogue(
    name="residual_rms_q8",
    loads=(E.tile("residual"), E.col("gamma"), E.scalar("h_scale")),
    outputs=(E.tile_out("x"), E.fp8_out("h", _E4M3, scale="h_scale", transpose=True), E.row_sum("sumsq")),
    body=_residual_rms_q8_body,
)
""":data:`RESIDUAL_RMS` whose ``h = x * gamma`` (the next GEMM's operand) is written in e4m3 with
its transposed copy (the wgrad's operand) and amax."""


@E.program_factory
def rms_swiglu_q8(save_preactivation: bool, z_fp8: bool = False) -> E.Epilogue:
    """:func:`rms_swiglu` whose ``y`` (the down projection's operand) is written in e4m3 with
    its transposed copy (the down projection's wgrad operand) and amax. ``z`` (the SwiGLU
    backward's load, with ``save_preactivation``) in the compute dtype, or with ``z_fp8`` in
    e4m3 at the scale load ``z_scale`` with its amax (no transposed copy: only
    :data:`SWIGLU_DGRAD_ZQ8`'s epilogue reads it, row-major); ``y`` is computed from the
    unrounded ``z`` either way."""
    if z_fp8 and not save_preactivation:
        raise ValueError("rms_swiglu_q8: z_fp8 stores the saved pre-activation; it needs save_preactivation")
    inner = rms_swiglu(save_preactivation)

    def body(acc, ctx, rstd, y_scale, z_scale=None):
        return inner.body(acc, ctx, rstd)

    z_out = E.fp8_out("z", _E4M3, scale="z_scale") if z_fp8 else E.tile_out("z")
    outputs = ((E.fp8_out("y", _E4M3, scale="y_scale", transpose=True, half=True),)
               + ((z_out,) if save_preactivation else ()))
    return E.Epilogue(name=f"rms_swiglu_q8{'_train' if save_preactivation else ''}{'_zq8' if z_fp8 else ''}",
                      loads=(E.row("rstd"), E.scalar("y_scale")) + ((E.scalar("z_scale"),) if z_fp8 else ()),
                      outputs=outputs, body=body, pair_block=SWIGLU_BLOCK)


def _swiglu_dgrad_q8_body(acc, ctx, z, rstd, dz_scale):
    return _swiglu_dgrad_body(acc, ctx, z, rstd)


SWIGLU_DGRAD_Q8 = E.Epilogue(
    name="swiglu_dgrad_q8",
    loads=(E.tile("z"), E.row("rstd"), E.scalar("dz_scale")),
    outputs=(E.fp8_out("dz", _E5M2, scale="dz_scale", transpose=True), E.row_sum("zdz")),
    body=_swiglu_dgrad_q8_body,
    pair_block=SWIGLU_BLOCK,
    half_acc=True,
)
""":data:`SWIGLU_DGRAD` whose ``dz' = rstd * dz`` (the gate/up projection's dgrad and wgrad
operand) is written in e5m2 with its transposed copy and amax."""


def _swiglu_dgrad_zq8_body(acc, ctx, z, z_scale_inv, rstd, dz_scale):
    # z saved in e4m3 (rms_swiglu_q8(True, True)): dequantized by its scale's inverse.
    gate, up = (v.astype(jnp.float32) * z_scale_inv for v in z)
    return _swiglu_dgrad_body(acc, ctx, (gate, up), rstd)


SWIGLU_DGRAD_ZQ8 = E.Epilogue(
    name="swiglu_dgrad_zq8",
    loads=(E.tile("z"), E.scalar("z_scale_inv"), E.row("rstd"), E.scalar("dz_scale")),
    outputs=(E.fp8_out("dz", _E5M2, scale="dz_scale", transpose=True), E.row_sum("zdz")),
    body=_swiglu_dgrad_zq8_body,
    pair_block=SWIGLU_BLOCK,
    half_acc=True,
)
""":data:`SWIGLU_DGRAD_Q8` reading the saved ``z`` in e4m3 (``Fp8Recipe(swiglu_input="e4m3")``),
``z_scale_inv`` its dequantizing factor: half the bytes of its largest load."""


@E.program_factory
def rms_dgrad_q8(with_dgamma: bool) -> E.Epilogue:
    """:func:`rms_dgrad` (with the residual gradient) that also writes ``dx`` in e5m2 with its
    transposed copy and amax (``dxq``): the gradient of a residual stream that the previous
    projection's dgrad and wgrad read in FP8."""
    inner = rms_dgrad(True, with_dgamma)

    def body(acc, ctx, x, xcoef, gamma, dres, dx_scale):
        out = dict(inner.body(acc, ctx, x, xcoef, gamma, dres=dres))
        out["dxq"] = out["dx"]
        return out

    outputs = (E.tile_out("dx"), E.fp8_out("dxq", _E5M2, scale="dx_scale", transpose=True))
    outputs += (E.col_sum("dgamma"),) if with_dgamma else ()
    return E.Epilogue(name=f"rms_dgrad_res_q8{'_dgamma' if with_dgamma else ''}",
                      loads=(E.tile("x"), E.row("xcoef"), E.col("gamma"), E.tile("dres"), E.scalar("dx_scale")),
                      outputs=outputs, body=body)


_FP8_NAMES = {"e4m3": _E4M3, "e5m2": _E5M2}


def _rms_input_q8_body(acc, ctx, x, gamma, h_scale):
    xf = x.astype(jnp.float32)
    return {"h": xf * gamma, "sumsq": xf * xf}  # h_scale: read by the backend's cast


RMS_INPUT_Q8 = E.Epilogue(
    name="rms_input_q8",
    loads=(E.tile("x"), E.col("gamma"), E.scalar("h_scale")),
    outputs=(E.fp8_out("h", _E4M3, scale="h_scale", transpose=True), E.row_sum("sumsq")),
    body=_rms_input_q8_body,
    reads_acc=False,
)
"""The first FP8 block's norm input as an epilogue pass (run by
:func:`coda_jax.ops.epilogue_pass.epilogue_pass`: the accumulator is zero and ignored): the tile
load ``x`` ``[M, d]`` (the embedding's output, which no GEMM produces) gives ``h = x * gamma``
in e4m3 with its transposed copy and amax, and the per-tile partial sums of ``x^2`` (the
norm's statistics; the QKV GEMM applies ``1/rms`` in its epilogue). What
:data:`RESIDUAL_RMS_Q8` writes for every later block, without the GEMM."""


@E.program_factory
def quantize_q8(fp8: str) -> E.Epilogue:
    """A standalone quantizing pass as an epilogue (run by
    :func:`coda_jax.ops.epilogue_pass.epilogue_pass`: the accumulator is zero and ignored):
    the tile load ``x`` ``[M, N]`` written as ``q`` in ``fp8`` (``"e4m3"`` or ``"e5m2"``) at
    the scale ``q_scale``, with its transposed copy and amax. For the tensors of an FP8 block
    that no GEMM of ours produces (cuDNN's attention output): XLA's fusion of the same cast
    writes the transposed copy through its own transpose, where the kernel stages it in SMEM
    and stores it with TMA."""
    if fp8 not in _FP8_NAMES:
        raise ValueError(f"quantize_q8: fp8 must be one of {sorted(_FP8_NAMES)}, got {fp8!r}")

    def body(acc, ctx, x, q_scale):
        return {"q": x}

    return E.Epilogue(name=f"quantize_{fp8}", loads=(E.tile("x"), E.scalar("q_scale")),
                      outputs=(E.fp8_out("q", _FP8_NAMES[fp8], scale="q_scale", transpose=True),), body=body,
                      reads_acc=False)


@E.program_factory
def rope_grad_q8(half_head: int) -> E.Epilogue:
    """The QKV gradient of an FP8 block: ``dz = rstd * R^T dqkv`` in e5m2 with its transposed
    copy and amax, and the QKV norm's row term ``zdz = sum(qkv * dqkv)`` per row, where
    ``dqkv`` ``[M, N]`` (the attention backward's dq, dk, dv) and ``qkv`` (the attention's
    inputs, RoPE applied) are tile loads, each may be given as its column parts (dq, dk, dv
    as they are), and no GEMM contributes (run by :func:`coda_jax.ops.epilogue_pass.epilogue_pass`:
    the accumulator is zero and ignored).

    Pair mode with ``pair_block = head_dim / 2``: per head, the rotation's transpose
    ``du_lo = d_lo c + d_hi s``, ``du_hi = d_hi c - d_lo s`` (Q/K heads; V heads, ``rot = 0``,
    pass unrotated), the loads of :func:`rms_rope` (``cos``/``sin`` row blocks ``[M, hd/2]``,
    ``rot`` per pair column) and ``rstd`` (row), the forward's ``1/rms``. The rotation is
    orthogonal, so ``sum(qkv * dqkv)`` over a row equals the same sum before RoPE (``z . du``
    of :func:`rms_dgrad`'s row term). One pass writes both FP8 layouts the QKV dgrad and wgrad
    read, the amax and the row term: where XLA, given this math on the attention backward's
    outputs, wrote the float32 gradient transposed first, and joined dq, dk, dv and reduced
    the row term in passes of their own."""

    def body(acc, ctx, dqkv, qkv, rstd, cos, sin, rot, dz_scale):
        d_lo, d_hi = (d.astype(jnp.float32) for d in dqkv)
        z_lo, z_hi = (z.astype(jnp.float32) for z in qkv)
        on = rot > 0
        c, s = jnp.where(on, cos, 1.0), jnp.where(on, sin, 0.0)
        return {"dz": ((d_lo * c + d_hi * s) * rstd, (d_hi * c - d_lo * s) * rstd),
                "zdz": z_lo * d_lo + z_hi * d_hi}

    return E.Epilogue(
        name="rope_grad_q8",
        loads=(E.tile("dqkv"), E.tile("qkv"), E.row("rstd"), E.row_block("cos"), E.row_block("sin"),
               E.col("rot", half=True), E.scalar("dz_scale")),
        outputs=(E.fp8_out("dz", _E5M2, scale="dz_scale", transpose=True), E.row_sum("zdz")),
        body=body,
        pair_block=half_head,
        reads_acc=False,
    )


def _ce_grad_q8_body(acc, ctx, logits, lse, target, gscale, zcoef, dlogits_scale):
    lf = logits.astype(jnp.float32)
    dlogits = _dlogits(lf, ctx.col_index(), target, lse, gscale, zcoef)
    return {"dlogits": dlogits, "zdz": lf * dlogits}


CE_GRAD_Q8 = E.Epilogue(
    name="ce_grad_q8",
    loads=(E.tile("logits"), E.row("lse"), E.row("target"), E.row("gscale"), E.row("zcoef"),
           E.scalar("dlogits_scale")),
    outputs=(E.fp8_out("dlogits", _E5M2, scale="dlogits_scale", transpose=True), E.row_sum("zdz")),
    body=_ce_grad_q8_body,
    uses_col_index=True,
    reads_acc=False,
)
"""The FP8 LM head's cross-entropy backward from the saved logits, run as an epilogue pass
(:func:`coda_jax.ops.epilogue_pass.epilogue_pass`: no GEMM under it, the accumulator is zero and
ignored): :func:`ce_grad_from_logits`'s ``dlogits`` (with the final norm's ``rstd`` folded into
``gscale`` by the caller) written in e5m2 with its transposed copy (the wgrad's operand) and amax,
and the row partials of ``zdz = sum_V(logits * dlogits)``. One read of the logits: as XLA
fusions, the transposed copy made XLA transpose the float32 logits first (docs/fp8.md#lm-head)."""


# ---------------------------------------------------------------- optimizer --------
ADAMW_SCALARS = ("g_div", "g_mul", "bc1", "bc2", "wd", "neg_lr")  # the scalar loads of every AdamW program


def _adamw_body(b1: float, b2: float, eps: float):
    """The AdamW step of :func:`adamw_q8` and :func:`adamw_cast`, its new weight also under
    the name ``copy`` (the output a backend writes in the copy's dtype)."""

    def body(acc, ctx, p, g, mu, nu, g_div, g_mul, bc1, bc2, wd, neg_lr, copy_scale=None):
        g = g / g_div * g_mul
        mu_new = (1.0 - b1) * g + b1 * mu
        nu_new = (1.0 - b2) * (g * g) + b2 * nu
        p_new = p + neg_lr * ((mu_new / bc1) / (jnp.sqrt(nu_new / bc2) + eps) + wd * p)
        return {"p_new": p_new, "mu_new": mu_new, "nu_new": nu_new, "copy": p_new}

    return body


def _adamw_program(name: str, b1: float, b2: float, eps: float, copy: E.Output, scale: tuple) -> E.Epilogue:
    f32 = jnp.float32
    return E.Epilogue(
        name=name,
        loads=(E.tile("p"), E.tile("g"), E.tile("mu"), E.tile("nu"), *map(E.scalar, ADAMW_SCALARS + scale)),
        outputs=(E.tile_out("p_new", f32), E.tile_out("mu_new", f32), E.tile_out("nu_new", f32), copy),
        body=_adamw_body(b1, b2, eps),
        reads_acc=False,
    )


@E.program_factory
def adamw_q8(b1: float, b2: float, eps: float) -> E.Epilogue:
    """One AdamW step of a float32 weight ``p`` ``[M, N]`` (the update of ``optax.adamw``
    after ``optax.clip_by_global_norm``) that also writes the new weight in e4m3 as ``copy``,
    with its transposed copy and amax: the FP8 copies an FP8 GEMM reads, from the pass that
    produces the weight (run by :func:`coda_jax.ops.epilogue_pass.epilogue_pass`: no GEMM
    under it).

    Tile loads: ``p``, the gradient ``g``, the moments ``mu``, ``nu`` (float32). Scalars:
    ``g_div``, ``g_mul`` (the clip: ``g / g_div * g_mul``; 1 and 1 when the global norm is
    under the limit, else the norm and the limit), ``bc1``, ``bc2`` (the bias corrections
    ``1 - b1^t``, ``1 - b2^t``), ``wd`` (weight decay), ``neg_lr`` (minus the step's
    learning rate) and ``copy_scale`` (the e4m3 copy's scale). The math, in optax's order::

        mu' = (1 - b1) g + b1 mu        nu' = (1 - b2) g^2 + b2 nu
        p'  = p + neg_lr * ((mu' / bc1) / (sqrt(nu' / bc2) + eps) + wd p)

    ``b1``, ``b2``, ``eps`` are constants of the program (Python floats)."""
    copy = E.fp8_out("copy", _E4M3, scale="copy_scale", transpose=True)
    return _adamw_program("adamw_q8", b1, b2, eps, copy, ("copy_scale",))


@E.program_factory
def adamw_cast(b1: float, b2: float, eps: float) -> E.Epilogue:
    """:func:`adamw_q8`'s step with the new weight's bfloat16 copy as ``copy`` (what a bf16
    GEMM reads of a float32 weight, e.g. the LM head's): no scale, no transposed copy."""
    return _adamw_program("adamw_cast", b1, b2, eps, E.tile_out("copy", jnp.bfloat16), ())
