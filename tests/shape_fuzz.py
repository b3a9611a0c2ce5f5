"""Seeded random shapes for the fused ops and the model, and the checks that run them.

One generator serves two scales:

* ``"gpu"`` (tests/test_gpu_shape_fuzz.py, ``GPU_TESTS=tests/test_gpu_shape_fuzz.py bash benchmarks/gpu_tests.sh``): tokens
  1 .. 4000, never a multiple of 64; widths that are multiples of 64 but not of the
  256-column CTA tile or of a cluster's 512 (1536, 2560, 3072, 5120, 1600, 960);
  head_dim 64 / 128; vocab 32000, 32003, 50257, 151936; GQA ratios 1-8; QK-norm on / off.
* ``"cpu"`` (tests/test_shape_fuzz.py, GPU interpret mode): the same draws at a size the
  interpreter runs in seconds (tokens 1 .. 150, widths 64 .. 320, vocab 131 .. 300), with
  the Pallas kernel forced onto a warp-specialized ``[64, 256]`` CTA tile in some cases
  so that partial and all-padding consumer tiles occur.

Every case compares a backend against float32 math (the naive definitions in
:mod:`coda_jax.naive`, or the model in float32 on ``xla``), forward and gradients, and
``op_cases.rel_err`` fails on any NaN / Inf in an output or gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np

import op_cases as C

OPS = ("rms_norm_matmul", "swiglu", "swiglu_mlp", "rope", "residual_chain", "cross_entropy")

SCALES = {
    "gpu": dict(tokens=(1, 4000), widths=(1536, 2560, 3072, 5120, 1600, 960), ffn=(1536, 2560, 4096, 5632, 1600),
                head_dims=(64, 128), vocabs=(32000, 32003, 50257, 151936), max_heads=32, layers=2),
    "cpu": dict(tokens=(1, 150), widths=(64, 192, 320), ffn=(64, 192), head_dims=(64,), vocabs=(131, 257, 300),
                max_heads=4, layers=1),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One draw: ``m`` tokens (``batch x seq`` at model level), widths, attention and vocab."""

    op: str  # one of OPS, or "model"
    m: int
    d: int
    n: int  # output width of rms_norm_matmul / residual_chain
    f: int  # SwiGLU hidden size
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool
    vocab: int
    batch: int = 1
    layers: int = 1
    ws_tile: bool = False  # CPU: Pallas forced onto a warp-specialized [64, 256] CTA tile

    @property
    def seq(self) -> int:
        return self.m // self.batch


def _tokens(rng: random.Random, lo: int, hi: int) -> int:
    m = rng.randint(lo, hi)
    return m + 1 if m % 64 == 0 else m  # never a tile multiple


def draw(seed: int, count: int, scale: str, ops: tuple[str, ...] = OPS) -> list[Shape]:
    """``count`` shapes from ``seed``; ops cycle through ``ops`` ("model" for the model)."""
    s = SCALES[scale]
    rng = random.Random(f"{scale}-{seed}")
    out = []
    for i in range(count):
        op = ops[i % len(ops)]
        hd = rng.choice(s["head_dims"])
        kv = rng.choice([k for k in (1, 2, 4, 8) if k <= s["max_heads"]])
        ratio = rng.choice([r for r in range(1, 9) if kv * r <= s["max_heads"]])
        batch = rng.choice((1, 2, 3)) if op == "model" else 1
        m = _tokens(rng, *s["tokens"])
        if op == "model":
            m = batch * max(1, m // batch)
        out.append(Shape(op=op, m=m, d=rng.choice(s["widths"]), n=rng.choice(s["widths"]), f=rng.choice(s["ffn"]),
                         heads=kv * ratio, kv_heads=kv, head_dim=hd, qk_norm=rng.random() < 0.5,
                         vocab=rng.choice(s["vocabs"]), batch=batch, layers=s["layers"],
                         ws_tile=scale == "cpu" and rng.random() < 0.5))
    return out


def run_op(shape: Shape, backend: str, seed: int = 0) -> None:
    """The op of ``shape`` on ``backend`` (bf16) against float32 math, forward and gradients."""
    bf, s = jnp.bfloat16, shape
    if s.op == "rms_norm_matmul":
        C.case_rms_norm_matmul(backend, s.m, s.d, s.n, bf, seed=seed)
    elif s.op == "swiglu":
        C.case_swiglu(backend, s.m, s.d, s.f, bf, seed=seed)
    elif s.op == "swiglu_mlp":
        C.case_swiglu_mlp(backend, s.m, s.d, s.f, bf, seed=seed)
    elif s.op == "rope":
        C.case_rope(backend, s.m, s.d, s.heads, s.kv_heads, s.head_dim, bf, qk_norm=s.qk_norm, seed=seed)
    elif s.op == "residual_chain":
        C.case_residual_chain(backend, s.m, s.f, s.d, s.n, bf, seed=seed)
    elif s.op == "cross_entropy":
        C.case_cross_entropy(backend, s.m, s.d, s.vocab, bf, z_loss=1e-4, seed=seed)
    else:
        raise ValueError(f"unknown op {s.op!r}")


def forward_gemms(shape: Shape) -> list[tuple]:
    """``(program, m, n, k, transpose kwargs)`` of the fused GEMMs of ``shape``'s op forward
    (for kernel-level checks: the GPU interpreter deadlocks when XLA runs two of its
    warp-specialized kernels at once, as a jitted backward may; on a GPU they run in order)."""
    from coda_jax import programs as P

    s = shape
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    return {
        "rms_norm_matmul": [(P.ROW_SCALE, s.m, s.n, s.d, {})],
        "swiglu": [(P.rms_swiglu(True), s.m, 2 * s.f, s.d, {})],
        "swiglu_mlp": [(P.rms_swiglu(True), s.m, 2 * s.f, s.d, {}), (P.RESIDUAL_RMS, s.m, s.d, s.f, {})],
        "rope": [(P.rms_rope(s.head_dim // 2, 1e-6 if s.qk_norm else None, True), s.m, qkv, s.d, {})],
        "residual_chain": [(P.RESIDUAL_RMS, s.m, s.d, s.f, {}), (P.ROW_SCALE, s.m, s.n, s.d, {})],
        "cross_entropy": [(P.RMS_LSE, s.m, s.vocab, s.d, {"transpose_b": True}),
                          (P.CE_GRAD, s.m, s.vocab, s.d, {"transpose_b": True})],
    }[s.op]


# Model level: loss and every parameter's gradient against the float32 model on xla.
MODEL_LOSS_TOL = 1e-2
MODEL_GRAD_TOL = 6e-2


def model_config(shape: Shape):
    from coda_jax.layers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.d, intermediate_size=shape.f,
                       num_layers=shape.layers, num_heads=shape.heads, num_kv_heads=shape.kv_heads,
                       head_dim=shape.head_dim, rope_theta=10000.0, qk_norm=shape.qk_norm, tie_word_embeddings=False,
                       dtype=jnp.bfloat16)


def _loss_and_grads(model, tokens):
    from flax import nnx

    loss, g = jax.jit(nnx.value_and_grad(lambda m: m.loss(tokens[:, :-1], tokens[:, 1:])))(model)
    return float(loss), {"/".join(map(str, p)): np.asarray(v[...], np.float32)
                         for p, v in nnx.to_flat_state(nnx.state(g, nnx.Param))}


def run_model(shape: Shape, backend: str, seed: int = 0) -> dict[str, float]:
    """``CodaLlama`` of ``shape`` (bf16) on ``backend``, one ``batch x seq`` loss and its
    gradients, against the same parameters in float32 on ``xla`` (XLA attention).

    Returns the loss's and each gradient's relative error; raises on NaN / Inf or an error
    above ``MODEL_LOSS_TOL`` / ``MODEL_GRAD_TOL``."""
    from flax import nnx

    from coda_jax.layers import CodaLlama

    cfg = model_config(shape)
    tokens = jax.random.randint(jax.random.key(seed), (shape.batch, shape.seq + 1), 0, shape.vocab)
    loss, grads = _loss_and_grads(CodaLlama(cfg, rngs=nnx.Rngs(seed), backend=backend), tokens)
    ref_cfg = cfg.replace(dtype=jnp.float32, attention_implementation=None)
    with jax.default_matmul_precision("highest"):
        ref_loss, ref = _loss_and_grads(CodaLlama(ref_cfg, rngs=nnx.Rngs(seed), backend="xla"), tokens)
    assert np.isfinite(loss), f"{backend}: loss {loss}"
    errs = {"loss": abs(loss - ref_loss) / abs(ref_loss)}
    for k, r in ref.items():
        errs[k] = C.rel_err(grads[k], r)  # fails on NaN / Inf
    bad = {k: e for k, e in errs.items() if e > (MODEL_LOSS_TOL if k == "loss" else MODEL_GRAD_TOL)}
    assert not bad, f"{backend} {shape}: errors above tolerance {bad}"
    return errs


def run_model_fp8(shape: Shape, backend: str, seed: int = 0, context=contextlib.nullcontext) -> None:
    """``CodaLlama`` of ``shape`` trained in FP8 (the default recipe with a 4-step history; at least two layers, so
    that a block's output gradient comes back through the FP8 carry) on ``backend``, one step
    traced under ``context()``, against the ``xla`` backend's FP8 step on the same weights,
    tokens and calibrated scales (loss, every gradient, the new amax histories:
    ``test_fp8.fp8_model_step_against_xla``, whose bounds apply). Ragged token counts make the
    wgrads' K (the tokens) and the epilogues' rows ragged."""
    from coda_jax.fp8 import Fp8Recipe
    from test_fp8 import fp8_model_step_against_xla

    cfg = model_config(shape).replace(fp8=Fp8Recipe(history=4), num_layers=max(2, shape.layers))
    tokens = jax.random.randint(jax.random.key(seed), (shape.batch, shape.seq + 1), 0, shape.vocab)
    fp8_model_step_against_xla(backend, cfg, tokens, context)
