"""FP8 training: formats, per-tensor delayed scaling, and the recipe state.

The recipe is TransformerEngine's "hybrid" delayed scaling, as Flax's FP8 dot and MaxText's
``quantization=fp8`` use it: activations and weights in ``float8_e4m3fn`` (max 448, 3
mantissa bits), gradients in ``float8_e5m2`` (max 57344, the range backward values need).
Each quantized tensor has a per-tensor scale chosen *before* the tensor exists, from the
history of its amax (max |value|) over the last ``history`` steps:

    scale = fp8_max / (max(history) * 2**margin)      stored = saturate(value * scale)

so the GEMM that produces the tensor can cast it in its epilogue with a known scale, and
reduce this step's amax in the same pass (:func:`coda_jax.epilogue.fp8_out`). A GEMM of two
FP8 operands multiplies its accumulator by ``1 / (scale_a * scale_b)`` (``scale_inv``).

Recipe state: one amax history per quantized tensor, an :class:`Fp8Meta` variable (not an
``nnx.Param``: the optimizer never sees it). The ops return a tensor's next history as the
*gradient* of its history (:func:`next_history`), so one ``nnx.value_and_grad`` over
``(nnx.Param, Fp8Meta)`` yields both, and the train step overwrites the histories with their
"gradients" (:func:`coda_jax.training.make_steps`). Each history is read by exactly one op
call, so no two gradients of one history are ever summed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from coda_jax.epilogue import saturate_cast

__all__ = ["E4M3", "E5M2", "Fp8Recipe", "Fp8Meta", "Fp8Tensor", "scale_from_history", "quantize",
           "quantize_tensor", "next_history", "NONFINITE_POLICIES", "SCALINGS", "SWIGLU_INPUTS", "fp8_device_rule",
           "check_fp8_device"]

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)

# What the train step does when a new amax or a gradient is not finite.
NONFINITE_POLICIES = ("skip", "apply")
# Where a tensor's scale comes from: its amax history, or its own amax.
SCALINGS = ("delayed", "current")
# How the SwiGLU input (the gate/up projection's output, which the SwiGLU backward reads) is saved.
SWIGLU_INPUTS = ("compute", "e4m3")


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How a model trains in FP8 (``LlamaConfig(fp8=Fp8Recipe())``).

    Attributes:
      history: steps of amax history a scale is taken from (the max over them).
      margin: scales are divided by ``2**margin`` (headroom against growth between steps).
      on_nonfinite: ``"skip"``: a step whose new amaxes or gradients are not all finite
        leaves the parameters, optimizer moments and histories as they were (the loss it
        returns shows the non-finite value); ``"apply"``: no check.
      scaling: ``"delayed"`` (default): each scale from the tensor's amax history, known before
        the tensor exists, so the GEMM that produces it writes it in FP8 from its epilogue.
        ``"current"``: each scale from the tensor's own amax (TransformerEngine's current
        scaling: no lag behind a change of range). A producing GEMM then writes the tensor in
        the compute dtype and a pass after it quantizes it, once its amax is reduced: one more
        write and two more reads of the tensor each (docs/fp8.md). The histories are still
        recorded (``history`` and ``margin`` apply to the scale as with one step of history).
      lm_head: also run the LM head's three GEMMs (logits, their dgrad and wgrad) in FP8
        (:mod:`coda_jax.ops.fp8_cross_entropy`): the last block writes the head's ``h`` in
        e4m3 from its epilogue, and the head quantizes its weight (e4m3) and the logits'
        gradient (e5m2). Off by default, as in TransformerEngine's and MaxText's recipes: the
        logits are the tensor FP8 rounding hurts most (docs/fp8.md#lm-head). The
        vocab-parallel head (a ``"tensor"`` or ``"fsdp"`` axis that splits the vocabulary)
        runs in FP8 too, its amaxes reduced over the mesh.
      promote_k: the long-K backward GEMMs (dgrad and wgrad with ``K >= promote_min_k``, the LM
        head's too) add their FP8 accumulator into a float32 total every ``promote_k`` K
        elements, as TransformerEngine's split accumulator does: Hopper's FP8 MMA keeps about 14
        bits of its running sum, so the error of an unpromoted product grows with K (the
        wgrads' K is the token count, the head's dgrad K is the vocabulary; measured in
        docs/fp8.md#accumulation). A multiple of 128 (the kernels' FP8 K step); ``0``: no
        promotion (the whole K in the tensor core, as the forward GEMMs always run). The
        CuTeDSL mainloop does not promote (logged).
      promote_min_k: the shortest K that is promoted (default 8192: the wgrads of 8192 tokens,
        the gate/up dgrad and the head's dgrad; the dgrads with K = d or the QKV width accumulate
        in the tensor core, where the error is below the e5m2 gradient's own rounding and
        promotion costs the fused kernels most: docs/fp8.md#accumulation).
      swiglu_input: how the SwiGLU input ``z`` (the gate/up projection's output ``[M, 2F]``,
        the widest activation of the block) is saved for the SwiGLU backward: ``"compute"``
        (default) in the compute dtype; ``"e4m3"`` in e4m3 with a delayed per-tensor scale of
        its own (one more amax history a block), written by the gate/up GEMM's epilogue beside
        ``y`` and read back by the down projection's dgrad epilogue. Half the bytes that
        forward GEMM writes and that backward GEMM reads for ``z``, and half its memory; the
        forward's ``y`` still comes from the unrounded ``z`` (only the backward reads the
        rounded one), as DeepSeek-V3 caches the SwiGLU input in FP8. A memory option: the
        epilogue that quantizes ``z`` costs about what the backward's smaller read saves
        (docs/fp8.md#the-recipe).
        Needs ``scaling="delayed"``.

    Activations and weights are quantized to e4m3, gradients to e5m2. Attention (its
    softmax and both of its GEMMs) and the norms stay in the compute dtype, and the LM head
    unless ``lm_head``. A fresh model has no amax history (every scale 1): its first
    :func:`coda_jax.training.make_steps` step only fills the histories and applies no update
    (docs/fp8.md#the-first-step).
    """

    history: int = 16
    margin: int = 0
    on_nonfinite: str = "skip"
    scaling: str = "delayed"
    lm_head: bool = False
    promote_k: int = 512
    promote_min_k: int = 8192
    swiglu_input: str = "compute"

    def __post_init__(self):
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"Fp8Recipe.history must be a positive int, got {self.history!r}")
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"Fp8Recipe.margin must be a non-negative int, got {self.margin!r}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"Fp8Recipe.on_nonfinite must be one of {NONFINITE_POLICIES}, got {self.on_nonfinite!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        if not isinstance(self.lm_head, bool):
            raise ValueError(f"Fp8Recipe.lm_head must be a bool, got {self.lm_head!r}")
        if (not isinstance(self.promote_k, int) or isinstance(self.promote_k, bool) or self.promote_k < 0
                or self.promote_k % 128):
            raise ValueError(f"Fp8Recipe.promote_k must be 0 or a positive multiple of 128 (K elements between "
                             f"float32 promotions of the backward GEMMs' accumulators), got {self.promote_k!r}")
        if not isinstance(self.promote_min_k, int) or isinstance(self.promote_min_k, bool) or self.promote_min_k < 0:
            raise ValueError(f"Fp8Recipe.promote_min_k must be a non-negative int, got {self.promote_min_k!r}")
        check_swiglu_input(self.swiglu_input, self.scaling, "Fp8Recipe")

    def promotion(self, k: int) -> int:
        """The ``promote_k`` a backward GEMM of contraction size ``k`` runs with (0: none)."""
        return promotion(k, self.promote_k, self.promote_min_k)


def check_swiglu_input(swiglu_input: str, scaling: str, owner: str) -> None:
    """Raises ValueError (naming ``owner``'s field) unless ``swiglu_input`` is one of
    :data:`SWIGLU_INPUTS` and, saved in FP8, under delayed scaling."""
    if swiglu_input not in SWIGLU_INPUTS:
        raise ValueError(f"{owner}.swiglu_input must be one of {SWIGLU_INPUTS}, got {swiglu_input!r}")
    if swiglu_input != "compute" and scaling != "delayed":
        raise ValueError(f"{owner}.swiglu_input={swiglu_input!r} needs scaling='delayed': the gate/up GEMM writes z "
                         f"in FP8 from its epilogue, before a current scale of z could exist")


def promotion(k: int, promote_k: int, promote_min_k: int) -> int:
    """The promotion interval of a backward GEMM of contraction size ``k`` under
    ``Fp8Recipe(promote_k, promote_min_k)``: ``promote_k`` from ``promote_min_k`` on, else 0."""
    return promote_k if k >= promote_min_k else 0


class Fp8Meta(nnx.Variable):
    """The amax history ``[history]`` float32 of one quantized tensor (newest first).

    Updated by the train step from its gradient (:func:`next_history`), never by the optimizer."""


def fp8_device_rule(platform: str, compute_capability: str | None) -> str | None:
    """Why a device cannot train in FP8, or None: a GPU needs FP8 tensor cores (compute
    capability 8.9: Ada, Hopper and later); the CPU runs XLA's FP8 emulation (tests)."""
    if platform != "gpu":
        return None
    try:
        major, minor = (int(v) for v in str(compute_capability).split(".")[:2])
    except ValueError:
        return None  # unknown: let XLA decide
    if (major, minor) < (8, 9):
        return (f"config.fp8 needs a GPU with FP8 tensor cores (compute capability >= 8.9), this one is "
                f"{compute_capability}; use fp8=None")
    return None


def check_fp8_device() -> None:
    """Raises ``ValueError`` where the default device cannot train in FP8 (:func:`fp8_device_rule`)."""
    dev = jax.local_devices()[0]
    rule = fp8_device_rule(dev.platform, getattr(dev, "compute_capability", None))
    if rule:
        raise ValueError(rule)


def fp8_max(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def scale_from_history(history: jax.Array, dtype: Any, margin: int = 0) -> jax.Array:
    """``fp8_max(dtype) / (max(history) * 2**margin)`` as a float32 scalar; 1 while the
    history holds no positive amax. The scale is a power of two (the largest not above that
    ratio), as TransformerEngine rounds it: then ``1 / scale`` is exact and dequantizing
    ``value * scale`` returns the value's own bits."""
    amax = jnp.max(history.astype(jnp.float32))
    ratio = (fp8_max(dtype) / (amax * 2.0 ** margin)).astype(jnp.float32)
    # 2**floor(log2(ratio)) exactly: ratio's exponent bits with its mantissa cleared (a
    # positive normal float32). exp2(floor(log2(ratio))) is not exact in XLA (on the CPU
    # log2(8192.0) < 13 and exp2(17.0) = 131072.06): most scales were not powers of two.
    scale = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(ratio, jnp.uint32) & jnp.uint32(0x7F800000), jnp.float32)
    return jnp.where((amax > 0) & jnp.isfinite(scale), scale, 1.0).astype(jnp.float32)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``saturate(x * scale)`` cast to the FP8 ``dtype`` (float32 math), as a quantizing
    epilogue stores it (:func:`coda_jax.epilogue.saturate_cast`)."""
    return saturate_cast(x, scale, dtype)


def next_history(history: jax.Array, amax: jax.Array) -> jax.Array:
    """The history after a step that saw ``amax``: shifted by one, ``amax`` first."""
    return jnp.concatenate([jnp.reshape(amax, (1,)).astype(jnp.float32), history[:-1]])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Tensor:
    """A matrix quantized per tensor: ``value ~= data * scale_inv``.

    Attributes:
      data: ``[R, C]`` FP8 (row-major, as the value).
      data_t: ``[C, R]`` the same bits transposed, or None: the K-major copy a GEMM reads
        where the matrix is its operand contracted over ``R`` (Hopper's FP8 MMA takes both
        operands K-major).
      scale_inv: float32 scalar, ``1 / scale``.
    """

    data: jax.Array
    data_t: jax.Array | None
    scale_inv: jax.Array

    @property
    def T(self) -> "Fp8Tensor":
        """The transposed matrix (its two copies swapped; no data moves)."""
        return Fp8Tensor(self.data_t, self.data, self.scale_inv)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape) if self.data is not None else tuple(reversed(self.data_t.shape))

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return (self.data.astype(jnp.float32) * self.scale_inv).astype(dtype)


def quantize_tensor(x: jax.Array, history: jax.Array | None, dtype: Any, margin: int = 0, *,
                    transpose: bool = True, rows: bool = True) -> tuple[Fp8Tensor, jax.Array]:
    """A standalone quantizing pass (where no GEMM epilogue produces ``x``): ``(Fp8Tensor,
    amax)`` of the matrix ``x`` ``[R, C]`` with the delayed scale from ``history``, or with
    ``history=None`` the current scale from ``x``'s own amax.

    ``transpose``: also the ``[C, R]`` copy; ``rows=False`` leaves the row-major copy out
    (where only the transposed one is read). With a delayed scale XLA writes both copies and
    reduces the amax in one fusion; a current scale needs the amax first (two passes)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = scale_from_history(amax[None] if history is None else history, dtype, margin)
    q = quantize(x, scale, dtype)
    return Fp8Tensor(q if rows else None, q.T if transpose else None, 1.0 / scale), amax
