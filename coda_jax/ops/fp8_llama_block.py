"""A Llama decoder block whose four projections run in FP8, as one op with its backward.

The block's math is :class:`coda_jax.layers.CodaLlamaBlock`'s; its twelve projection GEMMs
(QKV, O, gate/up, down: forward, dgrad, wgrad) read per-tensor-scaled FP8 operands
(:mod:`coda_jax.fp8`: e4m3 forward, e5m2 gradients, delayed scaling) and every tensor that a
GEMM of the block produces and an FP8 GEMM reads is quantized in that GEMM's epilogue,
both layouts and its amax, while the tile is on chip:

    forward    O GEMM        x1 = x + o @ W_o          writes h1 = x1 * g_mlp     (e4m3, + h1^T)
               gate/up GEMM  y = SwiGLU(rstd1 * h1 @ W_gu)  writes y             (e4m3, + y^T)
               down GEMM     x2 = x1 + y @ W_down      writes the next block's h  (e4m3, + h^T)
    backward   down dgrad    dz' = SwiGLU'(dx2 @ W_down^T) * rstd1              (e5m2, + dz'^T)
               gate/up dgrad dx1 = dx2 + RMSNorm'(dz' @ W_gu^T)                (bf16 and e5m2, + ^T)
               QKV dgrad     dx = dx1 + RMSNorm'(dz_qkv' @ W_qkv^T)            (bf16; under grad_carry
                                                                                also e5m2, + ^T)

The QKV gradient comes from no GEMM (attention's backward): its RoPE transpose and
quantization run as an epilogue pass of their own (:func:`coda_jax.ops.epilogue_pass.epilogue_pass`,
:func:`coda_jax.programs.rope_grad_q8`), which reads dq, dk, dv where cuDNN wrote them and
writes both layouts, the amax and the QKV norm's row term from registers; with QK-norm, one
XLA pass does its backward and the quantization.

The block's output gradient ``dx2`` is the next block's input gradient, which that block's
QKV dgrad writes. Under ``BlockShape.grad_carry`` (CodaLlama's blocks but the last) the
carry asks for it at this block's scale (:attr:`Fp8Carry.grad_scale`) and the next block's
epilogue writes it in e5m2, both layouts and its amax, returned as the carry's cotangent.
The attention output ``o`` (cuDNN's) and ``dx2`` without ``grad_carry`` (the last block's
comes from the LM head) are quantized by epilogue passes of their own
(:func:`coda_jax.programs.quantize_q8`, :func:`_quantize_pass`), and so is the first block's
``h`` with its norm statistics (:data:`coda_jax.programs.RMS_INPUT_Q8`, :func:`_input_norm_pass`:
the embedding's output). So are the weights, once a step, where each device holds them whole
(:func:`_quantize_weight`: the float32 parameter read once for both layouts and the amax).
Standalone XLA quantizing passes remain for FSDP-split weights (each device quantizes its own
rows and the e4m3 copy is gathered), for the ``xla`` backend, and, under current scaling, for
every tensor no GEMM produces.
Attention, RoPE, the norms and the residual stream stay in the compute dtype.

The backward GEMMs with a long K (``Fp8Recipe.promote_min_k``: the wgrads over the tokens, the
gate/up dgrad) promote their FP8 accumulators to float32 every ``Fp8Recipe.promote_k`` K elements
(:func:`coda_jax.ops.fp8_gemm.backward_gemm`; docs/fp8.md#accumulation).

Recipe state: ``meta [len(TENSORS), history]`` float32, one amax history per quantized tensor
(:data:`TENSORS`; one more, the SwiGLU input's, under ``BlockShape.swiglu_input == "e4m3"``:
:func:`block_tensors`); the op's gradient for ``meta`` is its next value (:mod:`coda_jax.fp8`).
Under current scaling (``BlockShape.scaling``) no scale is known before its tensor exists: each
quantizing GEMM above runs its program unquantized and a pass quantizes the tensor with the
scale of its own amax (:func:`_quantizing`).

``Fp8Recipe(swiglu_input="e4m3")`` (``BlockShape.swiglu_input``, delayed scaling only): the
gate/up GEMM also writes the SwiGLU input ``z`` in e4m3 with its amax (no transposed copy), and
the down dgrad's epilogue reads it back (:data:`coda_jax.programs.SWIGLU_DGRAD_ZQ8`); ``y`` is
still computed from the unrounded ``z``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.fp8 import (E4M3, E5M2, Fp8Tensor, check_swiglu_input, next_history, quantize_tensor,
                          scale_from_history)
from coda_jax.lowering import GemmLowering, fuses_epilogues
from coda_jax.mesh_axes import explicit_sharding
from coda_jax.ops.attention import causal_attention
from coda_jax.ops.epilogue_pass import epilogue_pass
from coda_jax.ops.fp8_gemm import backward_gemm, fp8_gemm, quantizing_run
from coda_jax.ops.norm_carry import NormCarry, rstd_from_partials
from coda_jax.ops.rms_norm_matmul_rope import RopeVariant
from coda_jax.sharding import gathered_from_split, reshape_tokens, typed_as, typed_like

# The quantized tensors of one block, in the order of the rows of its ``meta``; with
# Fp8Recipe(swiglu_input="e4m3") one more row, the saved SwiGLU input z's (block_tensors).
TENSORS = ("h_in", "w_qkv", "o", "w_o", "h1", "w_gu", "y", "w_down", "h_out", "dz_qkv", "dx1", "dz_gu", "dx2")
SWIGLU_INPUT = "z"
_ROW = {name: i for i, name in enumerate(TENSORS + (SWIGLU_INPUT,))}


def block_tensors(swiglu_input: str = "compute") -> tuple[str, ...]:
    """The rows of a block's ``meta`` under ``Fp8Recipe(swiglu_input=...)``: :data:`TENSORS`,
    and :data:`SWIGLU_INPUT` last where ``z`` is saved in e4m3."""
    return TENSORS + ((SWIGLU_INPUT,) if swiglu_input == "e4m3" else ())


_GRADS = ("dz_qkv", "dx1", "dz_gu", "dx2")  # e5m2; the others e4m3


class Fp8Carry(NamedTuple):
    """The norm carry between FP8 blocks: ``h = x * gamma`` as an e4m3 :class:`Fp8Tensor`
    (``[M, d]`` and its ``[d, M]`` copy, written by the previous block's down GEMM) and the
    float32 partial sums of squares ``[P, M]``.

    ``grad_scale`` (float32 scalar, or None): the e5m2 scale that the writing block asks for
    the gradient of its output ``x`` (``BlockShape.grad_carry``). The reading block then
    writes that gradient in e5m2, both layouts, in its QKV dgrad's epilogue and returns it,
    with its amax, as the carry's cotangent (:func:`_carry_cotangent`)."""

    h: Fp8Tensor
    sumsq: jax.Array
    grad_scale: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """The static arguments of :func:`fp8_llama_block`."""

    batch: int
    seq: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qk_norm_eps: float | None
    attention: str | None
    margin: int
    carry_out: str  # "fp8" (the next block reads it), "norm" (a compute-dtype NormCarry), "none"
    scaling: str = "delayed"  # Fp8Recipe.scaling: "delayed" or "current"
    promote_k: int = 0  # Fp8Recipe.promote_k / promote_min_k: the backward GEMMs' float32 promotion
    promote_min_k: int = 0
    # None: the weights arrive as the GEMMs use them (whole, or on their tensor splits for XLA's
    # partitioner) and are quantized there. Else ((name, PartitionSpec or None), ...) per weight:
    # they arrive on their stored (FSDP) splits, each device quantizes its own part, and the
    # e4m3 copy is gathered (_quantize_weight).
    weight_splits: tuple | None = None
    # The output's gradient comes back quantized through the carry's cotangent: the block that
    # reads the carry is the only reader of x_out (CodaLlama's loop; see Fp8Carry.grad_scale).
    # Needs carry_out == "fp8"; under current scaling (no scale before the tensor) it does nothing.
    grad_carry: bool = False
    swiglu_input: str = "compute"  # Fp8Recipe.swiglu_input: "e4m3" saves z in e4m3 (needs delayed scaling)

    @property
    def grad_from_carry(self) -> bool:
        """Whether ``x_out``'s gradient arrives in e5m2 through the carry's cotangent."""
        return self.grad_carry and self.carry_out == "fp8" and self.scaling == "delayed"


def _dtype(name: str):
    return E5M2 if name in _GRADS else E4M3


def _scale(meta: jax.Array, name: str, margin: int) -> jax.Array:
    return scale_from_history(meta[_ROW[name]], _dtype(name), margin)


def _quantize(meta: jax.Array, name: str, x: jax.Array, st: BlockShape, **kw) -> tuple[Fp8Tensor, jax.Array]:
    """A standalone quantizing pass of tensor ``name``: its delayed scale, or its current one."""
    history = None if st.scaling == "current" else meta[_ROW[name]]
    return quantize_tensor(x, history, _dtype(name), st.margin, **kw)


def _pass_runner(lw: GemmLowering, m: int, n: int, replicated: bool = False):
    """``run(program, loads, out_dtypes)`` for :func:`quantizing_run`: an epilogue pass over
    ``[m, n]``. ``replicated``: its rows are not tokens (a weight): under a mesh every device
    runs it whole (a partitioned lowering's ``replicated``)."""
    kw = {"replicated": True} if replicated and getattr(lw, "splits_tokens", False) else {}
    return lambda p, l, od: epilogue_pass(lw, p, m, n, l, out_dtypes=od or None, **kw)


def _quantize_pass(lw: GemmLowering, st: BlockShape, meta: jax.Array, name: str, x: jax.Array,
                   replicated: bool = False) -> tuple[Fp8Tensor, jax.Array]:
    """Activation or gradient ``name`` ``[M, N]`` (or a whole weight, ``replicated``), produced
    by no GEMM of ours, quantized in both layouts with its amax: under delayed scaling as an
    epilogue pass (:func:`coda_jax.programs.quantize_q8`: on a kernel backend the transposed
    copy leaves through the kernel's SMEM staging), under current scaling by :func:`_quantize`
    (the amax must exist before the cast)."""
    if st.scaling == "current":
        return _quantize(meta, name, x, st)
    m, n = x.shape
    _, t, amax = quantizing_run(_pass_runner(lw, m, n, replicated),
                                programs.quantize_q8("e5m2" if name in _GRADS else "e4m3"), {"x": x}, "q",
                                x.dtype, scale=_scale(meta, name, st.margin))
    return t, amax


def _input_norm_pass(lw: GemmLowering, st: BlockShape, meta: jax.Array, amax: dict, x: jax.Array,
                     gamma: jax.Array) -> tuple[Fp8Tensor, jax.Array]:
    """The first block's ``h = x * gamma`` in e4m3 (both layouts; its amax put in ``amax``) and
    the partial sums of ``x^2`` per row ``[P, M]``, for ``x`` ``[M, d]`` that no GEMM of ours
    produces (the embedding's output). Under delayed scaling one epilogue pass
    (:data:`coda_jax.programs.RMS_INPUT_Q8`), under current scaling XLA (the amax must exist
    before the cast)."""
    if st.scaling == "current":
        xf = x.astype(jnp.float32)
        h, amax["h_in"] = _quantize(meta, "h_in", xf * gamma.astype(jnp.float32), st)
        return h, jnp.sum(xf * xf, axis=1)[None]
    m, d = x.shape
    outs, h, amax["h_in"] = quantizing_run(_pass_runner(lw, m, d),
                                           programs.RMS_INPUT_Q8, {"x": x, "gamma": gamma}, "h", x.dtype,
                                           scale=_scale(meta, "h_in", st.margin))
    return h, outs["sumsq"]


def _quantize_weight(lw: GemmLowering, meta: jax.Array, name: str, w: jax.Array, st: BlockShape
                     ) -> tuple[Fp8Tensor, jax.Array]:
    """Weight ``name``'s FP8 copies (``[K, N]`` and its ``[N, K]`` transpose) and amax. Whole
    (one device, or replicated under data parallelism) and under delayed scaling on a kernel
    backend: one epilogue pass (:func:`_quantize_pass`, on every device whole: its rows are
    not tokens), which reads the float32 parameter once; else an XLA pass. With
    ``st.weight_splits`` ``w`` arrives on its stored split (FSDP): each device quantizes its own
    rows (the amax a max over the mesh) and the e4m3 copy is gathered, one byte an element where
    the float32 parameter took four; the transposed copy is made after the gather, where
    gathering it would gather along its minor dimension."""
    split = dict(st.weight_splits or {}).get(name)
    explicit = explicit_sharding(w)
    if split is None and (explicit is None or not any(explicit.spec)):  # whole on every device
        if st.scaling == "delayed" and fuses_epilogues(lw):
            return _quantize_pass(lw, st, meta, name, w, replicated=True)
        return _quantize(meta, name, w, st)
    t, amax = _quantize(meta, name, w, st, transpose=False)
    data = gathered_from_split(t.data, split)
    return Fp8Tensor(data, data.T, t.scale_inv), amax


def _quantizing(st: BlockShape, meta: jax.Array, amax: dict, name: str, run, program: E.Epilogue, loads: dict,
                out: str, dtype) -> tuple[dict, Fp8Tensor]:
    """``program``'s results and its quantizing output ``out``, the FP8 tensor ``name``, with
    that tensor's amax put in ``amax`` (:func:`coda_jax.ops.fp8_gemm.quantizing_run`: delayed
    scaling writes both FP8 layouts and the amax from the epilogue, current scaling quantizes
    after). ``run(program, loads, out_dtypes)`` runs a program."""
    delayed = st.scaling == "delayed"
    outs, t, amax[name] = quantizing_run(run, program, loads, out, dtype,
                                         scale=_scale(meta, name, st.margin) if delayed else None,
                                         quantize=None if delayed else lambda x: _quantize(meta, name, x, st))
    return outs, t


def _forward(lw: GemmLowering, st: BlockShape, x, params, next_norm, carry, aux, meta):
    m, d = x.shape
    dt = x.dtype
    hd, nh, nkv = st.head_dim, st.num_heads, st.num_kv_heads
    amax = {}
    if carry is None:  # the first block: h of the embedding's output, one pass
        h, sumsq = _input_norm_pass(lw, st, meta, amax, x, params["attn_norm"])
    else:
        h, sumsq = carry.h, carry.sumsq
    rstd = rstd_from_partials(sumsq, d, st.eps)
    w_qkv, amax["w_qkv"] = _quantize_weight(lw, meta, "w_qkv", params["w_qkv"], st)
    variant = RopeVariant(hd // 2, st.qk_norm_eps, (nh * hd, nkv * hd, nkv * hd))
    qkv_out = fp8_gemm(lw, variant.program(True), h, w_qkv, {"rstd": rstd, **variant.loads(aux)},
                       out_dtypes={"qkv": dt, **({"z": dt} if st.qk_norm_eps is not None else {})},
                       out_splits=variant.out_splits)
    q, k, v = qkv_out["qkv"]
    b, s = st.batch, st.seq
    o, attn_vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, st.attention),
                          reshape_tokens(q, (b, s, nh, hd)), reshape_tokens(k, (b, s, nkv, hd)),
                          reshape_tokens(v, (b, s, nkv, hd)))
    o, amax["o"] = _quantize_pass(lw, st, meta, "o", reshape_tokens(o, (m, nh * hd)))
    w_o, amax["w_o"] = _quantize_weight(lw, meta, "w_o", params["w_o"], st)
    r1, h1 = _quantizing(st, meta, amax, "h1",
                         lambda p, l, od: fp8_gemm(lw, p, o, w_o, l, out_dtypes={"x": dt, **od}),
                         programs.RESIDUAL_RMS_Q8, {"residual": x, "gamma": params["mlp_norm"]}, "h", dt)
    x1, sumsq1 = r1["x"], r1["sumsq"]
    rstd1 = rstd_from_partials(sumsq1, d, st.eps)
    w_gu, amax["w_gu"] = _quantize_weight(lw, meta, "w_gu", params["w_gu"], st)
    # z for the SwiGLU backward: in the compute dtype, or in e4m3 from the same epilogue.
    z_fp8 = st.swiglu_input == "e4m3"
    z_load = {"z_scale": _scale(meta, SWIGLU_INPUT, st.margin)} if z_fp8 else {}
    g, y = _quantizing(st, meta, amax, "y",
                       lambda p, l, od: fp8_gemm(lw, p, h1, w_gu, l, out_dtypes={**({} if z_fp8 else {"z": dt}), **od}),
                       programs.rms_swiglu_q8(True, z_fp8), {"rstd": rstd1, **z_load}, "y", dt)
    if z_fp8:
        amax[SWIGLU_INPUT] = jnp.max(g["z_amax"])
        z_saved = Fp8Tensor(g["z"], None, 1.0 / z_load["z_scale"])
    else:
        z_saved = g["z"]
    w_down, amax["w_down"] = _quantize_weight(lw, meta, "w_down", params["w_down"], st)
    if st.carry_out == "fp8":
        r2, h_out = _quantizing(st, meta, amax, "h_out",
                                lambda p, l, od: fp8_gemm(lw, p, y, w_down, l, out_dtypes={"x": dt, **od}),
                                programs.RESIDUAL_RMS_Q8, {"residual": x1, "gamma": next_norm}, "h", dt)
        # Under grad_carry the next block writes x_out's gradient at this block's "dx2" scale.
        carry_out = Fp8Carry(h_out, r2["sumsq"], _scale(meta, "dx2", st.margin) if st.grad_from_carry else None)
    elif st.carry_out == "norm":
        r2 = fp8_gemm(lw, programs.RESIDUAL_RMS, y, w_down, {"residual": x1, "gamma": next_norm},
                      out_dtypes={"x": dt, "h": dt})
        carry_out = NormCarry(r2["h"], r2["sumsq"])
    else:
        r2 = fp8_gemm(lw, programs.RESIDUAL, y, w_down, {"residual": x1}, out_dtypes={"x": dt})
        carry_out = None
    saved = dict(x=x, x1=x1, h_t=Fp8Tensor(None, h.data_t, h.scale_inv), rstd=rstd, rstd1=rstd1,
                 qkv=(q, k, v), z_qk=qkv_out.get("z"), attn_vjp=attn_vjp,
                 o_t=Fp8Tensor(None, o.data_t, o.scale_inv), h1_t=Fp8Tensor(None, h1.data_t, h1.scale_inv),
                 y_t=Fp8Tensor(None, y.data_t, y.scale_inv), z=z_saved,
                 w_qkv=Fp8Tensor(w_qkv.data, None, w_qkv.scale_inv), w_o=Fp8Tensor(w_o.data, None, w_o.scale_inv),
                 w_gu=Fp8Tensor(w_gu.data, None, w_gu.scale_inv),
                 w_down=Fp8Tensor(w_down.data, None, w_down.scale_inv), amax=amax,
                 dx_scale=None if carry is None else carry.grad_scale)
    return (r2["x"], carry_out), saved


def _backward(lw: GemmLowering, st: BlockShape, saved, params, aux, meta, dx2, dx2_q=None):
    """The block's gradients. ``dx2_q``: ``(Fp8Tensor, amax)`` of ``dx2`` in e5m2 where the next
    block wrote it (``st.grad_from_carry``). Returns ``(dx, grads, daux, new_meta, dx_q)``:
    ``dx_q`` the same for ``dx`` where the previous block asked for it (``saved["dx_scale"]``),
    else None."""
    # The long-K dgrads and wgrads promote their FP8 accumulators (Fp8Recipe.promote_k).
    bw_gemm = backward_gemm(st.promote_k, st.promote_min_k)
    m, d = saved["x"].shape
    dt, hd = dx2.dtype, st.head_dim
    amax = dict(saved["amax"])
    # MLP: dx2 in e5m2, written by the next block's QKV dgrad, or here by a standalone pass.
    g2, amax["dx2"] = dx2_q if dx2_q is not None else _quantize_pass(lw, st, meta, "dx2", dx2)
    z = saved["z"]
    program, z_loads = ((programs.SWIGLU_DGRAD_ZQ8, {"z": z.data, "z_scale_inv": z.scale_inv})
                        if isinstance(z, Fp8Tensor) else (programs.SWIGLU_DGRAD_Q8, {"z": z}))
    sd, dz = _quantizing(st, meta, amax, "dz_gu",
                         lambda p, l, od: bw_gemm(lw, p, g2, saved["w_down"].T, l, out_dtypes=od or None),
                         program, {**z_loads, "rstd": saved["rstd1"]}, "dz", dt)
    dw_down = bw_gemm(lw, programs.IDENTITY, saved["y_t"].T, g2, {}, out_dtypes={"out": dt},
                      contracts_tokens=True)["out"]
    zdz = jnp.sum(sd["zdz"], axis=0)
    r1 = saved["rstd1"]
    nb_loads = {"x": saved["x1"], "xcoef": r1 * r1 * zdz / d, "gamma": params["mlp_norm"], "dres": dx2}
    if st.scaling == "delayed":
        nb, dx1q = _quantizing(st, meta, amax, "dx1",
                               lambda p, l, od: bw_gemm(lw, p, dz, saved["w_gu"].T, l, out_dtypes={"dx": dt, **od}),
                               programs.rms_dgrad_q8(True), nb_loads, "dxq", dt)
    else:  # dx once, in the compute dtype, quantized after (rms_dgrad_q8 unquantized would write it twice)
        nb = bw_gemm(lw, programs.rms_dgrad(True, True), dz, saved["w_gu"].T, nb_loads, out_dtypes={"dx": dt})
        dx1q, amax["dx1"] = _quantize(meta, "dx1", nb["dx"], st)
    dx1 = nb["dx"]
    dmlp_norm = jnp.sum(nb["dgamma"], axis=0)
    dw_gu = bw_gemm(lw, programs.IDENTITY, saved["h1_t"].T, dz, {}, out_dtypes={"out": dt},
                    contracts_tokens=True)["out"]
    # O projection and attention.
    do = bw_gemm(lw, programs.IDENTITY, dx1q, saved["w_o"].T, {}, out_dtypes={"out": dt})["out"]
    dw_o = bw_gemm(lw, programs.IDENTITY, saved["o_t"].T, dx1q, {}, out_dtypes={"out": dt},
                   contracts_tokens=True)["out"]
    b, s, nh = st.batch, st.seq, st.num_heads
    dq, dk, dv = saved["attn_vjp"](reshape_tokens(do, (b, s, nh, hd)))
    variant = RopeVariant(hd // 2, st.qk_norm_eps, tuple(t.shape[1] for t in saved["qkv"]))
    dqkv = tuple(reshape_tokens(t, (m, t.shape[2] * t.shape[3])) for t in (dq, dk, dv))
    r0 = saved["rstd"]
    if st.qk_norm_eps is None:
        # QKV: the RoPE backward as an epilogue pass that writes rstd * dz in e5m2, both layouts
        # and the amax, and sum(z * dz) over each row (the norm's backward); it reads dq, dk, dv
        # and q, k, v as the column parts of its two tile loads.
        n_qkv = sum(t.shape[1] for t in dqkv)
        pq, dzq = _quantizing(st, meta, amax, "dz_qkv",
                              _pass_runner(lw, m, n_qkv),
                              programs.rope_grad_q8(hd // 2),
                              {"dqkv": dqkv, "qkv": tuple(saved["qkv"]), "rstd": r0, **variant.loads(aux)}, "dz", dt)
        zdz0 = jnp.sum(pq["zdz"], axis=0)
        daux = jax.tree.map(jnp.zeros_like, aux)
    else:
        # RoPE and QK-norm backward in one XLA pass that also quantizes rstd * dz.
        dz_qkv, zdz0, daux = variant.backward((saved["qkv"], saved["z_qk"]), dqkv, aux)
        dzq, amax["dz_qkv"] = _quantize(meta, "dz_qkv", dz_qkv * r0[:, None], st)
    nb0_loads = {"x": saved["x"], "xcoef": r0 * r0 * zdz0 / d, "gamma": params["attn_norm"], "dres": dx1}
    dx_q = None
    if saved["dx_scale"] is None:
        nb0 = bw_gemm(lw, programs.rms_dgrad(True, True), dzq, saved["w_qkv"].T, nb0_loads, out_dtypes={"dx": dt})
    else:  # the previous block reads dx in e5m2: both layouts and the amax from this epilogue
        nb0, dxq, dx_amax = quantizing_run(
            lambda p, l, od: bw_gemm(lw, p, dzq, saved["w_qkv"].T, l, out_dtypes={"dx": dt, **od}),
            programs.rms_dgrad_q8(True), nb0_loads, "dxq", dt, scale=saved["dx_scale"])
        dx_q = (dxq, dx_amax)
    dattn_norm = jnp.sum(nb0["dgamma"], axis=0)
    dw_qkv = bw_gemm(lw, programs.IDENTITY, saved["h_t"].T, dzq, {}, out_dtypes={"out": dt},
                     contracts_tokens=True)["out"]
    grads = {"attn_norm": dattn_norm, "w_qkv": dw_qkv, "w_o": dw_o, "mlp_norm": dmlp_norm, "w_gu": dw_gu,
             "w_down": dw_down}
    # The wgrads come out in the compute dtype, as the bf16 block's and plain JAX FP8's do: under
    # data parallel their partial sums cross devices in it (coda_jax.partitioning: half the
    # bytes of float32), and the cast to the parameters' dtype follows the sum.
    # A weight that arrived on its FSDP split (BlockShape.weight_splits) gets its gradient there.
    grads = {k: typed_like(v.astype(params[k].dtype), params[k]) for k, v in grads.items()}
    new_meta = jnp.stack([next_history(meta[i], amax[name]) if name in amax else jnp.zeros_like(meta[i])
                          for i, name in enumerate(block_tensors(st.swiglu_input))])
    return nb0["dx"], grads, daux, new_meta, dx_q


@jax.custom_vjp
def _block(lw_st, x, params, next_norm, carry, aux, meta):
    lw, st = lw_st.value
    return _forward(lw, st, x, params, next_norm, carry, aux, meta)[0]


def _block_fwd(lw_st, x, params, next_norm, carry, aux, meta):
    lw, st = lw_st.value
    out, saved = _forward(lw, st, x, params, next_norm, carry, aux, meta)
    # x's sharding type under an Explicit mesh: its cotangent must have it (a replicated x
    # gets a token-split gradient from the partitioned kernels otherwise)
    return out, (lw_st, saved, params, aux, meta, next_norm, carry, _Static(explicit_sharding(x)))


def _carry_cotangent(carry: Fp8Carry, dx_q: tuple[Fp8Tensor, jax.Array] | None) -> Fp8Carry:
    """The cotangent returned for ``carry``: zeros (the carry is a cache of ``x``), or under
    ``grad_carry`` the quantized gradient of ``x`` in its slots. Its e5m2 copies travel as
    the e4m3 ``h`` copies' cotangents (a bitcast: the same bytes, never added to anything,
    as the carry has this one reader) and its amax as ``grad_scale``'s."""
    zeros = jax.tree.map(jnp.zeros_like, carry)
    if dx_q is None:
        return zeros
    dxq, dx_amax = dx_q
    as_e4m3 = lambda a: jax.lax.bitcast_convert_type(a, E4M3)  # noqa: E731
    return Fp8Carry(Fp8Tensor(as_e4m3(dxq.data), as_e4m3(dxq.data_t), zeros.h.scale_inv), zeros.sumsq, dx_amax)


def _gradient_from_carry(st: BlockShape, meta: jax.Array, dcarry: Fp8Carry) -> tuple[Fp8Tensor, jax.Array]:
    """``x_out``'s gradient in e5m2 and its amax, from the cotangent of the carry this block
    wrote (:func:`_carry_cotangent` of the next block); its scale is this block's "dx2" one."""
    as_e5m2 = lambda a: jax.lax.bitcast_convert_type(a, E5M2)  # noqa: E731
    scale_inv = 1.0 / _scale(meta, "dx2", st.margin)
    return Fp8Tensor(as_e5m2(dcarry.h.data), as_e5m2(dcarry.h.data_t), scale_inv), dcarry.grad_scale


def _block_bwd(res, cot):
    lw_st, saved, params, aux, meta, next_norm, carry, x_sharding = res
    lw, st = lw_st.value
    dx2, dcarry = cot  # the carry is a cache of x_out: its cotangent holds data only under grad_carry
    dx2_q = _gradient_from_carry(st, meta, dcarry) if st.grad_from_carry else None
    dx, grads, daux, new_meta, dx_q = _backward(lw, st, saved, params, aux, meta, dx2, dx2_q)
    dx = typed_as(dx, x_sharding.value)
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)  # noqa: E731
    dcarry_in = None if carry is None else _carry_cotangent(carry, dx_q)
    return (None, dx, grads, zeros(next_norm), dcarry_in, daux, new_meta)


_block.defvjp(_block_fwd, _block_bwd)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Static:
    """The lowering and the :class:`BlockShape`, passed through ``custom_vjp`` as a static leaf."""

    value: Any


def fp8_llama_block(lowering: GemmLowering, shape: BlockShape, x: jax.Array, params: dict[str, jax.Array],
                    aux: dict[str, jax.Array], meta: jax.Array, *, carry: Fp8Carry | None = None,
                    next_norm: jax.Array | None = None):
    """One Llama block in FP8 (see the module docstring).

    Args:
      lowering: the backend's lowering (:func:`coda_jax.backend.lowering_for`).
      shape: the static sizes and settings (:class:`BlockShape`).
      x: ``[M, d]`` residual stream (``M = batch * seq``), compute dtype.
      params: ``attn_norm [d]``, ``w_qkv [d, (H + 2 KV) hd]``, ``w_o [H hd, d]``, ``mlp_norm [d]``,
        ``w_gu [d, 2f]`` (block-interleaved), ``w_down [f, d]``: the stored parameters (any
        float dtype; quantized from it, gradients returned in it and, with
        ``shape.weight_splits``, on the weights' own splits).
      aux: RoPE tables and columns (:func:`coda_jax.ops.rms_norm_matmul_rope.rope_tables`,
        ``rot``, and ``qk_w`` with QK-norm), as :class:`RopeVariant` reads them.
      meta: ``[len(block_tensors(shape.swiglu_input)), history]`` float32 amax histories.
      carry: the previous FP8 block's :class:`Fp8Carry`, or None (computed, one pass).
      next_norm: ``[d]`` weight of the norm that reads the output; required unless
        ``shape.carry_out == "none"``.

    Returns:
      ``(x_out [M, d], carry_out)``: an :class:`Fp8Carry`, a :class:`NormCarry` or None by
      ``shape.carry_out``.
    """
    check_swiglu_input(shape.swiglu_input, shape.scaling, "shape")
    rows = block_tensors(shape.swiglu_input)
    if meta.ndim != 2 or meta.shape[0] != len(rows):
        raise ValueError(f"meta must be [{len(rows)}, history] amax histories (one per tensor of "
                         f"block_tensors({shape.swiglu_input!r})), got {tuple(meta.shape)}")
    if (next_norm is None) != (shape.carry_out == "none"):
        raise ValueError(f"next_norm is required exactly when carry_out != 'none' (carry_out={shape.carry_out!r})")
    if shape.grad_carry and shape.carry_out != "fp8":
        raise ValueError(f"shape.grad_carry needs carry_out='fp8' (the gradient comes back through the "
                         f"FP8 carry), got carry_out={shape.carry_out!r}")
    if carry is not None and carry.grad_scale is None:
        # A cache of x: no gradient flows through it. (With a grad_scale its cotangent brings
        # back x's gradient in e5m2 to the block that wrote it.)
        carry = Fp8Carry(jax.tree.map(jax.lax.stop_gradient, carry.h), jax.lax.stop_gradient(carry.sumsq))
    return _block(_Static((lowering, shape)), x, params, next_norm, carry, aux, meta)
