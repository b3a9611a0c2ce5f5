"""The FP8 baseline of record: the plain JAX Llama (``plain_llama.py``) trained in FP8 the way a
JAX user does it without custom kernels (Flax's FP8 dot, MaxText's ``quantization=fp8``,
TransformerEngine's recipe), so that coda-jax's FP8 speed is measured against the strongest
FP8 model plain JAX gets, not only against plain bf16.

The recipe (:mod:`coda_jax.fp8`): per-tensor *delayed* scaling, one amax history per quantized
tensor, ``scale = fp8_max / max(history)`` (a power of two), activations and weights in e4m3,
gradients in e5m2. Every block projection is one :func:`fp8_dot` (a ``jax.custom_vjp``):

    forward  y  = x_e4m3 @ w_e4m3        ([M, K] . [N, K]: the weight's transposed FP8 copy)
    dgrad    dx = dy_e5m2 @ w_e4m3^T     ([M, N] . [K, N]: the weight's own FP8 copy)
    wgrad    dw = x_e4m3^T @ dy_e5m2     ([K, M] . [N, M]: both transposed copies)

each an XLA ``dot_general`` on FP8 operands with float32 accumulation (cuBLASLt's), written
in the compute dtype (bf16) with the two inverse scales applied. Every dot contracts the
minor dimension of both operands: Hopper's FP8 MMA takes both operands K-major, and where
one is not, XLA's GEMM rewriter transposes it first (a full pass; run 313: 0.5-1.1x bf16
instead of 1.2-1.7x). So the weight is quantized into both layouts at once, the input's
FP8 copy is saved for the wgrad already transposed (one byte an element instead of the bf16
activation's two), and the gradient is quantized once into both layouts.

How the scaled FP8 GEMM is written (:data:`IDIOMS`; ``PlainFp8Llama(..., idiom=...)``, default
:data:`DEFAULT_IDIOM`):

* ``"direct"``: ``dot_general(a_f8, b_f8, preferred_element_type=bf16) * (sa_inv * sb_inv)``.
  XLA's GEMM rewriter (``xla/service/gpu/transforms/gemm_rewriter.cc``) turns a dot of FP8
  operands into a ``__cublas$lt$matmul$f8`` custom call with unit scales, and folds the
  multiply of its output by a broadcast scalar into that call (``F8ScaleD``): no pass of its
  own. The form coda-jax's ``xla`` backend uses (run 314: 192 FP8 GEMM calls at 1B).
* ``"dequant"``: ``dot(convert(a_f8) * sa_inv, convert(b_f8) * sb_inv)`` in bf16, Flax's
  ``fp8_ops`` pattern: the rewriter's ``MatchFp8Param`` matches each ``multiply(convert(f8),
  broadcast(scalar))`` operand and passes the scalars to cuBLASLt as ``a_scale`` /
  ``b_scale``.

Q/K/V and gate/up are fused into one GEMM each by default (``fuse=True``, as
TransformerEngine's ``LayerNormDenseGeneral`` / ``LayerNormMLP`` and CodaLlama do): the
normed input is quantized once for the three (twice for the two) projections, and the
step has 4 x 3 = 12 FP8 GEMMs a layer, CodaLlama's FP8 count. ``fuse=False`` keeps the
bf16 baseline's 7 projections (Flax / MaxText's default: each ``Dense`` quantizes its own
input with its own history), 7 x 3 = 21 a layer. The parameters are the bf16 baseline's
either way (``wq``, ``wk``, ``wv``, ``w_gate``, ``w_up`` apart: fused, they are concatenated
inside the fusion that quantizes them), so :meth:`PlainFp8Llama.from_coda` and the same
sharding rules apply. Attention, the norms, RoPE and the embedding stay in the compute dtype;
the LM head too unless ``lm_head=True`` (``config.fp8.lm_head``): then it is one more
:func:`fp8_dot` (``h [M, d] @ W^T``, its weight quantized from the stored ``[V, d]``), as a
user would write it beside CodaLlama's ``Fp8Recipe(lm_head=True)``.

Recipe state: per projection one :class:`coda_jax.fp8.Fp8Meta` ``[3, history]`` (rows: the
input, the weight, the output gradient; newest first), read by exactly one :func:`fp8_dot`
call a step; its gradient is its next value, which :func:`coda_jax.training.make_steps`
writes back (and skips on a non-finite step, ``config.fp8.on_nonfinite``).

:func:`fp8_gemm_calls` finds XLA's FP8 GEMM calls in compiled HLO text, and
:func:`expected_fp8_gemms` says how many the step should have: XLA runs an FP8 dot it cannot
rewrite as a 16-bit GEMM (``TurnF8DotIntoF16Dot``) and a dequantize-then-dot pattern it does not
match as a bf16 GEMM, silently.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from benchmarks.plain_llama import PlainLlama, PlainLlamaBlock, _use, rms_norm, rope
from coda_jax.fp8 import E4M3, E5M2, Fp8Meta, Fp8Recipe, next_history, promotion, quantize, scale_from_history
from coda_jax.layers import LlamaConfig
from coda_jax.ops.attention import causal_attention
from coda_jax.sharding import reshape_tokens

__all__ = ["IDIOMS", "DEFAULT_IDIOM", "FP8_GEMM_TARGET", "fp8_dot", "fp8_gemm_calls", "fp8_gemm_kinds", "expected_fp8_gemms",
           "PlainFp8LlamaBlock", "PlainFp8Llama"]

# How the scaled FP8 GEMM is written for XLA (module docstring).
IDIOMS = ("direct", "dequant")
DEFAULT_IDIOM = "direct"

# XLA's cuBLASLt FP8 GEMM custom call (kCublasLtMatmulF8CallTarget, xla/service/gpu/cublas_cudnn.cc).
FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"
_TARGET = re.compile(r'custom_call_target="([^"]+)"')

# The rows of a projection's Fp8Meta [3, history].
X, W, G = 0, 1, 2

# The projections of a block, in call order: fused (QKV, gate/up in one GEMM each) or not.
FUSED_PROJECTIONS = ("qkv", "o", "gu", "down")
SEPARATE_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def fp8_gemm_calls(hlo_text: str) -> list[str]:
    """The FP8 GEMM calls (``custom_call_target="__cublas$lt$matmul$f8"``) of compiled HLO
    text, one line each (the instruction up to its backend config), in program order."""
    out = []
    for line in hlo_text.splitlines():
        m = _TARGET.search(line)
        if m and m.group(1) == FP8_GEMM_TARGET:
            out.append(line.split(", backend_config=")[0].strip())
    return out


_COMPUTATION = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (.+?) ([\w\-]+)\((.*?)\)(.*)$")
_NAME = re.compile(r"%[\w.\-]+")
_CALLS = re.compile(r"calls=(%[\w.\-]+)")
_FUSION_KIND = re.compile(r'"kind":"([^"]+)"')


def _computations(hlo_text: str) -> dict[str, list[tuple[str, str, str, list[str], str]]]:
    """Compiled HLO text as ``{computation: [(name, type, opcode, operand names, rest)]}``
    (operand types, where printed, are ignored: they are looked up by name)."""
    comps: dict = {"": []}  # "": lines outside any computation (an excerpt)
    current = comps[""]
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) is not None:
            current = comps.setdefault(m.group(1), [])
        elif line.strip() == "}":
            current = comps[""]
        elif (m := _INSTRUCTION.match(line)) is not None:
            operands = _NAME.findall(m.group(4))
            current.append((m.group(1), m.group(2), m.group(3), operands, m.group(5)))
    return comps


def fp8_gemm_kinds(hlo_text: str) -> dict[str, int]:
    """The GEMMs of compiled HLO text that read FP8 operands, by how XLA runs them:
    ``"cublaslt"`` (:data:`FP8_GEMM_TARGET` custom calls), or a fusion's kind (``"__triton_gemm"``,
    ``"__cudnn$fusion"``, ...) whose fused computation holds a ``dot`` of two FP8 operands.
    A dot that XLA turned into a 16-bit GEMM (its FP8 operands converted first) counts in none."""
    comps = _computations(hlo_text)
    types = {c: {name: ty for name, ty, *_ in ins} for c, ins in comps.items()}

    def fp8_dot_in(comp: str, seen: frozenset = frozenset()) -> bool:
        for name, _, op, operands, rest in comps.get(comp, []):
            if op == "dot" and len(operands) >= 2 and all(types[comp].get(o, "").startswith("f8") for o in operands[:2]):
                return True
            if (callee := _CALLS.search(rest)) and callee.group(1) not in seen and fp8_dot_in(callee.group(1), seen | {comp}):
                return True
        return False

    kinds: dict[str, int] = {}
    for comp, ins in comps.items():
        for _, _, op, _, rest in ins:
            kind = None
            if op == "custom-call" and (t := _TARGET.search(rest)) and t.group(1) == FP8_GEMM_TARGET:
                kind = "cublaslt"
            elif op == "fusion" and (callee := _CALLS.search(rest)) and fp8_dot_in(callee.group(1)):
                k = _FUSION_KIND.search(rest)
                kind = k.group(1) if k else re.search(r"kind=(\w+)", rest).group(1)
            if kind is not None:
                kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def gemm_call_targets(hlo_text: str) -> dict[str, int]:
    """How many custom calls of each cuBLAS target (``__cublas$...``) compiled HLO text holds:
    the FP8 GEMMs beside the bf16 ones (``__cublas$gemm``, ``__cublas$lt$matmul``)."""
    counts: dict[str, int] = {}
    for t in _TARGET.findall(hlo_text):
        if t.startswith("__cublas$"):
            counts[t] = counts.get(t, 0) + 1
    return counts


def expected_fp8_gemms(config: LlamaConfig, fuse: bool = True, lm_head: bool = False, quantized: str = "both") -> int:
    """FP8 GEMMs of one train step of :class:`PlainFp8Llama`: forward, dgrad and wgrad of each
    projection (4 a layer fused, 7 not; with ``quantized`` (:data:`QUANTIZED`) the forward or the
    two backward GEMMs only), and the LM head's three with ``lm_head``."""
    per_projection = {"both": 3, "forward": 1, "backward": 2}[quantized]
    projections = config.num_layers * len(FUSED_PROJECTIONS if fuse else SEPARATE_PROJECTIONS)
    return per_projection * projections + 3 * bool(lm_head)


# Which GEMMs of an fp8_dot run in FP8 (an accuracy ablation, benchmarks/fp8_accuracy.py): all
# three, the forward only (the backward as bf16's, on the unquantized input and weight), or the
# backward only (the forward as bf16's; the backward as FP8's).
QUANTIZED = ("both", "forward", "backward")


@dataclasses.dataclass(frozen=True)
class _DotConfig:
    idiom: str
    margin: int
    promote_k: int = 0  # Fp8Recipe.promote_k / promote_min_k: which backward GEMMs run at Precision.HIGHEST
    promote_min_k: int = 0
    quantized: str = "both"  # QUANTIZED


def _gemm(a: jax.Array, b: jax.Array, a_inv: jax.Array, b_inv: jax.Array, idiom: str, out_dtype,
          promote: bool = False) -> jax.Array:
    """``(a * a_inv) @ (b * b_inv)^T`` for FP8 ``a [M, K]``, ``b [N, K]`` (both contracted over
    their minor dimension: K-major), float32 accumulation, written in ``out_dtype``. ``promote``:
    at ``Precision.HIGHEST``, which XLA runs as cuBLASLt's FP8 GEMM without fast accumulation
    (docs/fp8.md#accumulation)."""
    dims = (((1,), (1,)), ((), ()))
    precision = lax.Precision.HIGHEST if promote else None
    if idiom == "direct":
        # The scalar multiply right on the dot's output: XLA folds it into the cuBLASLt call.
        y = lax.dot_general(a, b, dims, precision=precision, preferred_element_type=out_dtype)
        return y * (a_inv * b_inv).astype(out_dtype)
    # dequantize-then-dot: convert(f8) * broadcast(scalar) per operand, the pattern XLA's
    # GEMM rewriter turns into a scaled FP8 GEMM.
    da = a.astype(out_dtype) * a_inv.astype(out_dtype)
    db = b.astype(out_dtype) * b_inv.astype(out_dtype)
    return lax.dot_general(da, db, dims, precision=precision, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_dot(cfg: _DotConfig, x: jax.Array, w: jax.Array, meta: jax.Array) -> jax.Array:
    return _fp8_dot_fwd(cfg, x, w, meta)[0]


def _fp8_dot_fwd(cfg: _DotConfig, x, w, meta):
    sx = scale_from_history(meta[X], E4M3, cfg.margin)
    sw = scale_from_history(meta[W], E4M3, cfg.margin)
    xq = quantize(x, sx, E4M3)  # [M, K]: the forward's A
    wq = quantize(w, sw, E4M3)  # [K, N]: the dgrad's B (contracted over N)
    if cfg.quantized == "backward":
        y = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    else:
        y = _gemm(xq, wq.T, 1.0 / sx, 1.0 / sw, cfg.idiom, x.dtype)  # B = [N, K], the transposed copy
    hist_x = next_history(meta[X], jnp.max(jnp.abs(x)).astype(jnp.float32))
    hist_w = next_history(meta[W], jnp.max(jnp.abs(w)).astype(jnp.float32))
    if cfg.quantized == "forward":  # the backward reads the unquantized input and weight
        return y, (x.T, w, None, None, hist_x, hist_w, meta[G])
    # Saved: the input's FP8 copy transposed ([K, M], the wgrad's A), the weight's [K, N].
    return y, (xq.T, wq, 1.0 / sx, 1.0 / sw, hist_x, hist_w, meta[G])


def _fp8_dot_bwd(cfg: _DotConfig, res, dy):
    xq_t, wq, sx_inv, sw_inv, hist_x, hist_w, hist_g = res
    if cfg.quantized == "forward":  # bf16's backward: xq_t and wq hold x^T and w
        f32 = jnp.float32
        dx = jnp.dot(dy, wq.T, preferred_element_type=f32).astype(dy.dtype)
        dw = jnp.dot(xq_t, dy, preferred_element_type=f32).astype(dy.dtype)
        hist_g = next_history(hist_g, jnp.max(jnp.abs(dy)).astype(f32))
        return dx, dw, jnp.stack([hist_x, hist_w, hist_g])
    sg = scale_from_history(hist_g, E5M2, cfg.margin)
    gq = quantize(dy, sg, E5M2)  # [M, N], and its transpose [N, M] in the same pass
    promote = lambda k: promotion(k, cfg.promote_k, cfg.promote_min_k) > 0  # noqa: E731
    dx = _gemm(gq, wq, 1.0 / sg, sw_inv, cfg.idiom, dy.dtype, promote(gq.shape[1]))  # [M, N] . [K, N] -> [M, K]
    dw = _gemm(xq_t, gq.T, sx_inv, 1.0 / sg, cfg.idiom, dy.dtype, promote(gq.shape[0]))  # [K, M] . [N, M] -> [K, N]
    hist_g = next_history(hist_g, jnp.max(jnp.abs(dy)).astype(jnp.float32))
    # The "gradient" of the recipe state is its next value (coda_jax.fp8).
    return dx, dw, jnp.stack([hist_x, hist_w, hist_g])


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot(x: jax.Array, w: jax.Array, meta: jax.Array, *, idiom: str = DEFAULT_IDIOM, margin: int = 0,
            promote: tuple[int, int] = (0, 0), quantized: str = "both") -> jax.Array:
    """``x [M, K] @ w [K, N]`` in FP8 with delayed per-tensor scaling: e4m3 ``x`` and ``w``
    forward, e5m2 output gradient backward, each GEMM accumulated in float32 and written in
    ``x.dtype``. ``meta [3, history]`` float32: the amax histories of ``x``, ``w`` and the
    output gradient; its gradient is the three next histories (the amaxes of this call's
    tensors first). ``x`` and ``w`` share a dtype (the compute dtype: the gradients come
    back in it). ``promote``: ``(Fp8Recipe.promote_k, promote_min_k)``; the backward GEMMs that
    rule promotes (:func:`coda_jax.fp8.promotion`) run without fast accumulation
    (``Precision.HIGHEST``: cuBLASLt's own float32 promotion), as CodaLlama's promote.
    ``quantized`` (an accuracy ablation, :data:`QUANTIZED`): ``"forward"`` runs only the forward
    GEMM in FP8 and the backward on the unquantized ``x`` and ``w`` in the compute dtype;
    ``"backward"`` the reverse. The amax histories are kept either way."""
    if idiom not in IDIOMS:
        raise ValueError(f"idiom must be one of {IDIOMS}, got {idiom!r}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fp8_dot takes x [M, K] and w [K, N], got x{tuple(x.shape)} w{tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"x and w must share the compute dtype, got {x.dtype} and {w.dtype}")
    if meta.ndim != 2 or meta.shape[0] != 3:
        raise ValueError(f"meta must be [3, history] (x, w, gradient), got {tuple(meta.shape)}")
    if quantized not in QUANTIZED:
        raise ValueError(f"quantized must be one of {QUANTIZED}, got {quantized!r}")
    return _fp8_dot(_DotConfig(idiom, int(margin), *promote, quantized), x, w, meta)


class PlainFp8LlamaBlock(PlainLlamaBlock):
    """:class:`plain_llama.PlainLlamaBlock` with its projections in FP8 (:func:`fp8_dot`); one
    ``fp8_<projection>`` :class:`coda_jax.fp8.Fp8Meta` ``[3, history]`` per projection;
    ``quantized``: :func:`fp8_dot`'s."""

    def __init__(self, c: LlamaConfig, *, rngs: nnx.Rngs, fuse: bool = True, idiom: str = DEFAULT_IDIOM,
                 quantized: str = "both"):
        super().__init__(c, rngs=rngs)
        if idiom not in IDIOMS:
            raise ValueError(f"idiom must be one of {IDIOMS}, got {idiom!r}")
        recipe = c.fp8 or Fp8Recipe()
        if quantized not in QUANTIZED:
            raise ValueError(f"quantized must be one of {QUANTIZED}, got {quantized!r}")
        self.fuse, self.idiom, self.margin, self.quantized = bool(fuse), idiom, recipe.margin, quantized
        self.promote = (recipe.promote_k, recipe.promote_min_k)
        self.projections = FUSED_PROJECTIONS if fuse else SEPARATE_PROJECTIONS
        for name in self.projections:
            setattr(self, f"fp8_{name}", Fp8Meta(jnp.zeros((3, recipe.history), jnp.float32)))

    def _dense(self, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
        # fp8_dot looked up at call time (the tests record its calls).
        return fp8_dot(x, w, getattr(self, f"fp8_{name}")[...], idiom=self.idiom, margin=self.margin,
                       promote=self.promote, quantized=self.quantized)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """``x [B, S, d]`` (compute dtype) -> ``[B, S, d]``."""
        c = self.config
        b, s, d = x.shape
        m = b * s
        dt, hd, f32 = c.dtype, c.head_dim, jnp.float32
        nq, nkv = c.num_heads * hd, c.num_kv_heads * hd
        h = reshape_tokens(rms_norm(x, _use(self.attn_norm, f32), c.rms_norm_eps), (m, d))
        if self.fuse:
            w_qkv = jnp.concatenate([_use(self.wq, dt), _use(self.wk, dt), _use(self.wv, dt)], axis=1)
            q, k, v = jnp.split(self._dense("qkv", h, w_qkv), [nq, nq + nkv], axis=1)
        else:
            q, k, v = (self._dense(n, h, _use(getattr(self, f"w{n}"), dt)) for n in ("q", "k", "v"))
        q = rope(reshape_tokens(q, (b, s, c.num_heads, hd)), cos, sin)
        k = rope(reshape_tokens(k, (b, s, c.num_kv_heads, hd)), cos, sin)
        v = reshape_tokens(v, (b, s, c.num_kv_heads, hd))
        o = causal_attention(q, k, v, c.attention_implementation)
        x = x + reshape_tokens(self._dense("o", reshape_tokens(o, (m, nq)), _use(self.wo, dt)), (b, s, d))
        h = reshape_tokens(rms_norm(x, _use(self.mlp_norm, f32), c.rms_norm_eps), (m, d))
        if self.fuse:
            w_gu = jnp.concatenate([_use(self.w_gate, dt), _use(self.w_up, dt)], axis=1)
            gate, up = jnp.split(self._dense("gu", h, w_gu), 2, axis=1)
        else:
            gate, up = self._dense("gate", h, _use(self.w_gate, dt)), self._dense("up", h, _use(self.w_up, dt))
        y = jax.nn.silu(gate) * up
        return x + reshape_tokens(self._dense("down", y, _use(self.w_down, dt)), (b, s, d))


class PlainFp8Llama(PlainLlama):
    """:class:`plain_llama.PlainLlama` with :class:`PlainFp8LlamaBlock` blocks: the block
    projections in FP8, the rest as the bf16 baseline. ``config.fp8`` (default
    ``Fp8Recipe()``) gives the history length, margin and non-finite policy; ``fuse``: Q/K/V
    and gate/up as one GEMM each; ``idiom``: how the FP8 GEMMs are written for XLA
    (:data:`IDIOMS`); ``lm_head``: the LM head in FP8 too (default: ``config.fp8.lm_head``);
    ``promote_k``: the recipe's (default ``config.fp8.promote_k``); above 0 the backward GEMMs run
    without fast accumulation (:func:`fp8_dot`'s ``promote``); ``quantized``: which GEMMs of the
    block projections run in FP8 (:func:`fp8_dot`'s; an accuracy ablation, default all)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, fuse: bool = True, idiom: str = DEFAULT_IDIOM,
                 lm_head: bool | None = None, promote_k: int | None = None, quantized: str = "both"):
        if idiom not in IDIOMS:
            raise ValueError(f"idiom must be one of {IDIOMS}, got {idiom!r}")
        if quantized not in QUANTIZED:
            raise ValueError(f"quantized must be one of {QUANTIZED}, got {quantized!r}")
        self.fuse, self.idiom, self.quantized = bool(fuse), idiom, quantized
        recipe = config.fp8 or Fp8Recipe()
        if lm_head is not None:
            recipe = dataclasses.replace(recipe, lm_head=bool(lm_head))
        if promote_k is not None:
            recipe = dataclasses.replace(recipe, promote_k=promote_k)
        super().__init__(config.replace(fp8=recipe), rngs=rngs)
        if recipe.lm_head:
            self.fp8_lm_head = Fp8Meta(jnp.zeros((3, recipe.history), jnp.float32))

    def _head(self, h: jax.Array, w_vocab: jax.Array) -> jax.Array:
        if not self.config.fp8.lm_head:
            return super()._head(h, w_vocab)
        b, s, d = h.shape
        y = fp8_dot(reshape_tokens(h, (b * s, d)), w_vocab.T, self.fp8_lm_head[...], idiom=self.idiom,
                    margin=self.config.fp8.margin, promote=(self.config.fp8.promote_k, self.config.fp8.promote_min_k))
        return reshape_tokens(y, (b, s, y.shape[-1]))

    def _make_block(self, c: LlamaConfig, rngs: nnx.Rngs) -> PlainFp8LlamaBlock:
        return PlainFp8LlamaBlock(c, rngs=rngs, fuse=self.fuse, idiom=self.idiom, quantized=self.quantized)

    def expected_fp8_gemms(self) -> int:
        """FP8 GEMM calls a train step of this model should compile to (:func:`expected_fp8_gemms`)."""
        return expected_fp8_gemms(self.config, self.fuse, self.config.fp8.lm_head, self.quantized)
