"""coda-jax benchmarks and GPU correctness checks at real shapes (run on the H100).

    python -m benchmarks.bench --out $OUT [--widths 2048,4096,8192] [--backends xla,pallas]

For every op: forward and forward+backward time on each backend, the XLA reference
(the same op on backend "xla", jitted) in the same run, the ratio, and the relative error
of the forward output and of the gradients against a float32 computation of the naive
definition on the same bf16 inputs (fresh random inputs, never zeros). Also the plain GEMM
against ``jnp.dot``, the cross-entropy's compiled temp memory against the logits' size, and
``CodaLlamaBlock`` against the plain XLA Llama block (``xla_llama_block.py``).
Timing (:func:`median_ms`): median of ``--iters`` samples after warm-up, each sample a
batch of back-to-back calls closed by ``jax.block_until_ready``.
Results go to ``<out>/bench.json``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import statistics
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

import coda_jax as cj
from benchmarks import plain_ops
from benchmarks.device_time import device_ms_per_call
from coda_jax import naive, programs

WIDTHS = {  # d: (f, heads, kv_heads, head_dim)
    2048: (8192, 32, 8, 64),
    4096: (14336, 32, 8, 128),
    8192: (28672, 64, 8, 128),
}
TOKENS = 8192
VOCAB = 128256
ATTENTION = "cudnn"  # the blocks' attention; --smoke (CPU) uses XLA's


def interleaved_median_ms(cases, iters=20, rounds=4, warmup=3, min_sample_ms=3.0, per_round=None):
    """``{key: median milliseconds per call}`` of each ``cases[key] = (f, args)``.

    Each sample dispatches ``reps`` calls back to back and blocks once
    (``jax.block_until_ready``), with ``reps`` chosen so that a sample lasts at least
    ``min_sample_ms``: the host-side sync then costs a small fraction of a sub-millisecond
    kernel instead of being counted once per call. The ``iters`` samples of each case are
    taken in ``rounds`` interleaved rounds (each round visits every case, in a rotating
    order), so a drift of the GPU's clocks or temperature during the run affects all cases
    alike rather than whichever was measured last. ``per_round`` (a dict), if given, receives
    ``{key: [median ms of each round]}``: ratios between cases round by round show whether a
    difference is larger than the run's drift.
    """
    reps = {}
    for key, (f, args) in cases.items():
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        one = time.perf_counter() - t
        reps[key] = max(1, min(50, int(min_sample_ms / 1e3 / max(one, 1e-6))))
    keys = list(cases)
    samples = {key: [] for key in keys}
    samples_per_round = max(1, -(-iters // rounds))
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            f, args = cases[key]
            for _ in range(samples_per_round):
                t = time.perf_counter()
                for _ in range(reps[key]):
                    out = f(*args)
                jax.block_until_ready(out)
                samples[key].append((time.perf_counter() - t) / reps[key])
    if per_round is not None:
        for key, v in samples.items():
            per_round[key] = [statistics.median(v[i:i + samples_per_round]) * 1e3
                              for i in range(0, len(v), samples_per_round)]
    return {key: statistics.median(v) * 1e3 for key, v in samples.items()}


def median_ms(f, *args, iters=20, warmup=3, min_sample_ms=3.0):
    """Median milliseconds per call of ``f(*args)`` (one case of :func:`interleaved_median_ms`)."""
    return interleaved_median_ms({0: (f, args)}, iters, 1, warmup, min_sample_ms)[0]


def rel(a, b):
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


class Inputs:
    def __init__(self, seed):
        self.key = jax.random.key(seed)

    def normal(self, shape, scale=1.0, offset=0.0, dtype=jnp.bfloat16):
        self.key, k = jax.random.split(self.key)
        return (offset + scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

    def ints(self, shape, hi):
        self.key, k = jax.random.split(self.key)
        return jax.random.randint(k, shape, 0, hi)


def op_cases(d):
    """(name, fused(backend) -> fn(*args), naive fn, args, differentiable argnums, plain fn).

    naive: float32 math of the definition (the error reference); plain: the same op as a
    JAX user writes it (:mod:`plain_ops`, bf16 GEMMs, ``jax.grad``), timed as backend
    ``"plain"``."""
    f, h, kv, hd = WIDTHS[d]
    r = Inputs(d)
    m = TOKENS
    x, g = r.normal((m, d)), r.normal((d,), 0.1, 1.0)
    cases = []
    y, wo = r.normal((m, d)), r.normal((d, d), d ** -0.5)
    cases.append(("residual_rms", lambda b: lambda y, w, res, g: _residual_out(cj.matmul_residual_rms(y, w, res, g, backend=b)),
                  lambda y, w, res, g: naive.matmul_residual(y, w, res), (y, wo, x, g), (0, 1, 2),
                  plain_ops.matmul_residual_rms))
    wgu = r.normal((d, 2 * f), d ** -0.5)
    cases.append(("norm_swiglu", lambda b: lambda x, g, w: cj.rms_norm_matmul_swiglu(x, g, w, backend=b),
                  naive.rms_norm_matmul_swiglu, (x, g, wgu), (0, 1, 2), plain_ops.rms_norm_matmul_swiglu))
    wdown = r.normal((f, d), f ** -0.5)
    cases.append(("swiglu_mlp", lambda b: lambda x, g, w, wd: cj.swiglu_mlp(x, g, w, wd, backend=b)[0],
                  naive.swiglu_mlp, (x, g, wgu, wdown), (0, 1, 2, 3), plain_ops.swiglu_mlp))
    wqkv = r.normal((d, (h + 2 * kv) * hd), d ** -0.5)
    pos = r.ints((m,), 8192)
    inv = jnp.asarray(cj.rope_inv_freq(hd, 500000.0, cj.Llama3RopeScaling()))
    kw = dict(num_heads=h, num_kv_heads=kv)
    cases.append(("norm_qkv_rope", lambda b: lambda x, g, w: cj.rms_norm_matmul_rope(x, g, w, pos, inv, backend=b, **kw),
                  lambda x, g, w: naive.rms_norm_matmul_rope(x, g, w, pos, inv, **kw), (x, g, wqkv), (0, 1, 2),
                  lambda x, g, w: plain_ops.rms_norm_matmul_rope(x, g, w, pos, inv, **kw)))
    wd = r.normal((d, f), d ** -0.5)
    cases.append(("norm_matmul", lambda b: lambda x, g, w: cj.rms_norm_matmul(x, g, w, backend=b),
                  naive.rms_norm_matmul, (x, g, wd), (0, 1, 2), plain_ops.rms_norm_matmul))
    if d == min(WIDTHS):  # the LM head at the 1B width (vocab 128256)
        wv = r.normal((VOCAB, d), d ** -0.5 * 2)
        t = r.ints((m,), VOCAB)
        cases.append(("lm_head_ce", lambda b: lambda x, g, w: cj.linear_cross_entropy(x, g, w, t, backend=b),
                      lambda x, g, w: naive.linear_cross_entropy(x, g, w, t), (x, g, wv), (0, 1, 2),
                      lambda x, g, w: plain_ops.linear_cross_entropy(x, g, w, t)))
    return cases


def _loss(out, rnd):
    """``(scalar, further outputs)``: the scalar an op's fwd+bwd is timed on, its first output
    weighted by ``rnd`` (a random cotangent; XLA cannot fold it into the backward), and the
    op's further outputs returned beside it (the carry a fused op writes for the next op:
    each version must materialize it, as the model does, and neither differentiates it).

    ``rnd`` is an argument of the timed function, in the output's dtype, as the cotangent
    arriving from the next layer is in a model: closed over, it is a compile-time constant
    that XLA folds into the backward (a float32 copy of it, and of its RoPE-reversed halves,
    read from memory: 2 x 100 MB at the QKV shape of d=2048, where the model reads 50)."""
    main, *rest = out if isinstance(out, tuple) else (out,)
    if not main.ndim:
        return main, tuple(rest)
    return jnp.sum(main.astype(jnp.float32) * rnd.astype(jnp.float32)), tuple(rest)


def random_cotangent(fn, args) -> jax.Array:
    """A random cotangent for ``fn(*args)``'s first output, in that output's dtype."""
    out = jax.eval_shape(fn, *args)
    main = out[0] if isinstance(out, tuple) else out
    return jax.random.normal(jax.random.key(11), main.shape, jnp.float32).astype(main.dtype)


def timed_fwd_bwd(fn, argnums):
    """``jit(value_and_grad)`` of :func:`_loss` on ``fn``, called ``(*args, cotangent)``."""
    scalar = lambda *a: _loss(fn(*a[:-1]), a[-1])  # noqa: E731
    return jax.jit(jax.value_and_grad(scalar, argnums, has_aux=True))


def _residual_out(res):
    x, carry = res
    return x, carry.h, carry.sumsq


def bench_op(name, fused, ref, args, argnums, backends, iters, check, plain=None):
    """Times and checks one op on each backend; backend ``"plain"`` is ``plain`` (the op as
    plain JAX)."""
    rows = []
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    first = lambda o: o[0] if isinstance(o, tuple) else o
    out_ref = jax.jit(ref)(*f32) if check else None
    rnd = random_cotangent(plain if plain is not None else fused("xla"), args)
    if check:  # the timed loss, on the same (rounded) cotangent
        grads_ref = jax.jit(jax.grad(lambda *a: _loss(ref(*a), rnd)[0], argnums))(*f32)
    cases = {}
    for b in backends:
        row = {"op": name, "backend": b, "d": args[0].shape[1]}
        try:
            with (contextlib.nullcontext(None) if b == "plain" else backend_variant(b)) as base:
                # traced and compiled inside the variant's settings
                fn = plain if b == "plain" else fused(base)
                if fn is None:
                    raise ValueError(f"op {name!r} has no plain JAX version")
                fwd = jax.jit(fn)
                fb = timed_fwd_bwd(fn, argnums)
                out, (_, grads) = fwd(*args), fb(*args, rnd)
                if check:
                    row["fwd_rel_err"] = rel(first(out), first(out_ref))
                    row["grad_rel_err"] = max(rel(a, r_) for a, r_ in zip(grads, grads_ref))
                cases[(b, "fwd_ms")], cases[(b, "fwdbwd_ms")] = (fwd, args), (fb, (*args, rnd))
        except Exception as e:  # record and go on: one failing kernel must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        rows.append(row)
    # All backends' timings interleaved (same conditions for every ratio of the table).
    for (b, key), ms in interleaved_median_ms(cases, iters).items():
        next(r for r in rows if r["backend"] == b)[key] = ms
    # Device time of fwd+bwd (the GPU kernels' summed durations, no dispatch): on a GPU only.
    for (b, key), (fn, fargs) in cases.items():
        if key == "fwdbwd_ms" and jax.devices()[0].platform == "gpu":
            dev = device_ms_per_call(fn, fargs)
            if dev is not None:
                next(r for r in rows if r["backend"] == b)["fwdbwd_device_ms"] = dev
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def bench_gemm(backends, iters):
    rows = []
    for (k, n) in [(2048, 8192), (4096, 14336), (8192, 28672), (4096, 4096)]:
        r = Inputs(k + n)
        a, b = r.normal((TOKENS, k)), r.normal((k, n))
        flops = 2 * TOKENS * k * n
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        row = {"op": "gemm", "k": k, "n": n, "xla_ms": median_ms(jax.jit(jnp.dot), a, b, iters=iters)}
        for name in backends:
            if name in ("xla", "plain"):  # XLA's GEMM is the row's reference; plain JAX has no GEMM of its own
                continue
            try:
                with backend_variant(name) as base:
                    low = _kernel_lowering(base)
                    f = jax.jit(lambda a, b: low.gemm(programs.IDENTITY, a, b, {})["out"])
                    row[f"{name}_rel_err"] = rel(f(a, b), ref)
                    row[f"{name}_ms"] = median_ms(f, a, b, iters=iters)
                row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
            except Exception as e:
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
        row["xla_tflops"] = flops / row["xla_ms"] / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _epilogue_cases(d):
    """(label, epilogue, K, N) of every forward program at width ``d``, plus RoPE probes."""
    import dataclasses

    from coda_jax import epilogue as E

    f, h, kv, hd = WIDTHS[d]
    qkv = (h + 2 * kv) * hd
    rope = programs.rms_rope(hd // 2, None, True)

    def no_trig(acc, ctx, rstd, cos, sin, rot):  # RoPE without the V-head select
        lo, hi = acc
        zr, zi = lo * rstd, hi * rstd
        c, s = cos, sin
        return {"qkv": (zr * c - zi * s, zi * c + zr * s), "z": (zr, zi)}

    pair_id = E.Epilogue(name="pair_identity", loads=(), outputs=(E.tile_out("out"),),
                         body=lambda acc, ctx: {"out": acc}, pair_block=hd // 2)
    t = TOKENS
    return [  # (label, program, M, K, N, transpose_a, transpose_b)
        ("identity", programs.IDENTITY, t, d, qkv, False, False),
        ("pair_identity", pair_id, t, d, qkv, False, False),
        ("rms_rope_train", rope, t, d, qkv, False, False),
        ("rms_rope_train_no_trig", dataclasses.replace(rope, name="rope_no_trig", body=no_trig), t, d, qkv, False, False),
        ("identity", programs.IDENTITY, t, h * hd, d, False, False),
        ("residual_rms", programs.RESIDUAL_RMS, t, h * hd, d, False, False),
        ("identity", programs.IDENTITY, t, d, 2 * f, False, False),
        ("rms_swiglu_train", programs.rms_swiglu(True), t, d, 2 * f, False, False),
        ("rms_swiglu", programs.rms_swiglu(False), t, d, 2 * f, False, False),
        ("identity", programs.IDENTITY, t, d, VOCAB, False, False),
        ("rms_lse", programs.RMS_LSE, t, d, VOCAB, False, False),
        # backward layouts: dgrad (B transposed) and wgrad (A transposed, K = tokens)
        ("identity dgrad", programs.IDENTITY, t, 2 * f, d, False, True),
        ("identity wgrad", programs.IDENTITY, d, t, 2 * f, True, False),
        # the norm backward on the dgrad GEMM (K = 2f, N = d), with and without the residual gradient
        ("rms_dgrad_res dgrad", programs.rms_dgrad(True), t, 2 * f, d, False, True),
        ("rms_dgrad dgrad", programs.rms_dgrad(False), t, 2 * f, d, False, True),
        ("ce_grad dgrad-chunk", programs.CE_GRAD, t, d, 16384, False, True),
        # the SwiGLU backward on the down projection's dgrad (K = d, N = f; z and dz are [t, 2f])
        ("identity dgrad-f", programs.IDENTITY, t, d, f, False, True),
        ("identity fwd-f", programs.IDENTITY, t, d, f, False, False),  # the same GEMM, B not transposed
        ("swiglu_dgrad dgrad-f", programs.SWIGLU_DGRAD, t, d, f, False, True),
        # the RMSNorm-scaled wgrad (A = x_hat^T, K = tokens), beside "identity wgrad"
        ("norm_wgrad wgrad", programs.NORM_WGRAD, d, t, 2 * f, True, False),
        # the QKV projection's backward (few output tiles at d=2048: the wave fit's case)
        ("identity wgrad-qkv", programs.IDENTITY, d, t, qkv, True, False),
        ("norm_wgrad wgrad-qkv", programs.NORM_WGRAD, d, t, qkv, True, False),
        ("rms_dgrad_res dgrad-qkv", programs.rms_dgrad(True), t, qkv, d, False, True),
    ]


def bench_epilogues(widths, backends, iters, labels=None):
    """Time of each forward program's GEMM on every kernel backend (and variant, e.g.
    ``cutedsl@s4``) vs the identity-epilogue GEMM of the same shape (``labels``: only the
    cases with these labels). Each case's backends are compiled under their own settings,
    then timed in interleaved rounds (and XLA's dot beside the identity cases)."""
    rows = []
    kernels = [b for b in backends if b not in ("xla", "plain")]
    for d in widths:
        for label, epi, m, k, n, ta, tb in _epilogue_cases(d):
            if labels and label not in labels:
                continue
            a, b, loads = epilogue_inputs(epi, m, k, n, ta, tb)
            cases, case_rows = {}, {}
            for name in kernels:
                row = {"op": "epilogue", "backend": name, "d": d, "program": label, "m": m, "k": k, "n": n}
                case_rows[name] = row
                try:
                    with backend_variant(name) as base:
                        low = _kernel_lowering(base)
                        fn = jax.jit(lambda a, b, loads, epi=epi, ta=ta, tb=tb, low=low: low.gemm(
                            epi, a, b, loads, transpose_a=ta, transpose_b=tb))
                        jax.block_until_ready(fn(a, b, loads))  # compiled under the variant's settings
                    cases[name] = (fn, (a, b, loads))
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
            if epi is programs.IDENTITY:
                cases["xla_dot"] = (jax.jit(lambda a, b, ta=ta, tb=tb: jnp.dot(a.T if ta else a, b.T if tb else b)),
                                    (a, b))
            times = interleaved_median_ms(cases, iters) if cases else {}
            for name, row in case_rows.items():
                if name in times:
                    row["ms"] = times[name]
                    row["tflops"] = 2 * m * k * n / row["ms"] / 1e9
                row["xla_dot_ms"] = times.get("xla_dot")
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def epilogue_inputs(epi, m, k, n, ta, tb):
    """Random ``(a, b, loads)`` for one program's GEMM (operands in their stored layouts)."""
    from coda_jax.epilogue import LoadKind

    r = Inputs(k + n)
    a = r.normal((k, m) if ta else (m, k))
    b = r.normal((n, k) if tb else (k, n), 0.05)
    loads = {}
    for l in epi.loads:
        width = epi.width(n, l.half)
        if l.kind is LoadKind.ROW:
            loads[l.name] = r.ints((m,), n) if l.name == "target" else r.normal((m,), 0.1, 1.0, jnp.float32)
        elif l.kind is LoadKind.COL:
            loads[l.name] = r.normal((width,), 0.1, 1.0, jnp.float32)
        elif l.kind is LoadKind.ROW_BLOCK:
            loads[l.name] = r.normal((m, epi.pair_block), 0.5, 0.0, jnp.float32)
        else:
            loads[l.name] = r.normal((m, width))
    return a, b, loads


def ce_memory(backends):
    """Compiled temp memory of the LM-head CE fwd+bwd vs the [tokens, vocab] bf16 logits."""
    rows = []
    d = min(WIDTHS)
    r = Inputs(5)
    x, g, w, t = r.normal((TOKENS, d)), r.normal((d,), 0.1, 1.0), r.normal((VOCAB, d), 0.05), r.ints((TOKENS,), VOCAB)
    for b in (b for b in backends if b != "plain"):  # the logits' size is the reference
        try:
            fn = jax.jit(jax.value_and_grad(lambda x, g, w: cj.linear_cross_entropy(x, g, w, t, backend=b), (0, 1, 2)))
            mem = fn.lower(x, g, w).compile().memory_analysis()
            rows.append({"op": "ce_memory", "backend": b, "temp_MiB": mem.temp_size_in_bytes / 2 ** 20,
                         "logits_bf16_MiB": TOKENS * VOCAB * 2 / 2 ** 20})
        except Exception as e:
            rows.append({"op": "ce_memory", "backend": b, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def baseline_block(d):
    """The plain XLA Llama block at width ``d``: (fwd, fwd+bwd, args) jitted callables."""
    from benchmarks import xla_llama_block as base

    f, h, kv, hd = WIDTHS[d]
    bsz, seq = 4, TOKENS // 4
    p = base.init_params(jax.random.key(0), d, f, h, kv)
    x = jax.random.normal(jax.random.key(3), (bsz, seq, d), jnp.bfloat16)
    cos, sin = base.rope_tables(seq, hd)
    blk = functools.partial(base.llama_block, cos=cos, sin=sin, heads=h, kv_heads=kv, attention=ATTENTION == "cudnn")
    return _block_callables(blk, p, x)


def _block_callables(blk, p, x):
    """(fwd, fwd+bwd, args) of ``blk(p, x)``, both called ``(p, x, cotangent)``: the loss
    weights the block's output by a random bf16 cotangent passed in (:func:`_loss`), as the
    next layer's gradient arrives in a model. With ``sum()`` (runs before 176) the fused
    blocks' backward started from a broadcast constant and read 1-4 % faster; the plain
    block's time did not move."""
    cot = random_cotangent(blk, (p, x))
    fwd = jax.jit(lambda p, x, cot: blk(p, x))
    return fwd, timed_fwd_bwd(blk, (0, 1)), (p, x, cot)


def coda_block(d, backend):
    """``CodaLlamaBlock`` at width ``d`` on ``backend``: (fwd, fwd+bwd, args) jitted callables."""
    from flax import nnx

    from coda_jax.layers import CodaLlamaBlock, LlamaConfig

    f, h, kv, hd = WIDTHS[d]
    x = jax.random.normal(jax.random.key(3), (4, TOKENS // 4, d), jnp.bfloat16)
    cfg = LlamaConfig(hidden_size=d, intermediate_size=f, num_heads=h, num_kv_heads=kv, head_dim=hd,
                      num_layers=1, param_dtype=jnp.bfloat16, attention_implementation=ATTENTION or "xla")
    gdef, state = nnx.split(CodaLlamaBlock(cfg, rngs=nnx.Rngs(0), backend=backend))
    return _block_callables(lambda s, x: nnx.merge(gdef, s)(x)[0], state, x)


def coda_model(preset, backend, batch, seq, layers=None):
    """``CodaLlama`` (a preset of ``coda_jax.layers.PRESETS``, optionally fewer layers):
    (jitted fwd+bwd of the mean next-token loss, args) on random tokens."""
    from flax import nnx

    from coda_jax.layers import PRESETS, CodaLlama

    cfg = PRESETS[preset]()
    if layers is not None:
        cfg = cfg.replace(num_layers=layers)
    gdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend))
    tokens = jax.random.randint(jax.random.key(5), (batch, seq + 1), 0, cfg.vocab_size)
    loss = lambda s, t: nnx.merge(gdef, s).loss(t[:, :-1], t[:, 1:])  # noqa: E731
    return jax.jit(jax.value_and_grad(loss)), (state, tokens)


def plain_model(preset, batch, seq, layers=None):
    """The plain JAX Llama (``plain_llama.PlainLlama``) of a preset: (jitted fwd+bwd of the
    mean next-token loss, args) on random tokens, as :func:`coda_model`."""
    from flax import nnx

    from benchmarks.plain_llama import PlainLlama

    from coda_jax.layers import PRESETS

    cfg = PRESETS[preset]()
    if layers is not None:
        cfg = cfg.replace(num_layers=layers)
    gdef, state = nnx.split(PlainLlama(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(5), (batch, seq + 1), 0, cfg.vocab_size)
    loss = lambda s, t: nnx.merge(gdef, s).loss(t[:, :-1], t[:, 1:])  # noqa: E731
    return jax.jit(jax.value_and_grad(loss)), (state, tokens)


def plain_gemm_route(backend, plain):
    """Within: ``backend``'s plain GEMMs (the identity epilogue) run on its own kernel when
    ``plain`` names a kernel backend (the option ``routing.plain_gemm="kernel"``); None:
    unchanged."""
    if plain is None or plain == "xla":
        return contextlib.nullcontext()
    return cj.options(routing={"plain_gemm": "kernel"})


@contextlib.contextmanager
def _default_config(cfg):
    """``CONFIG_TABLE["default"]`` is ``cfg`` inside the block. The tuned table's entries are
    the default with their fields replaced, parsed once and memoized: the memo is dropped on
    entry and exit, so that a GEMM with an entry runs the variant too (with the entry's
    fields on top), not the configuration of whichever variant parsed the table first."""
    from coda_jax.pallas import tuned, tuning

    saved = tuning.CONFIG_TABLE["default"]
    tuning.CONFIG_TABLE["default"] = cfg
    tuned.load_table.cache_clear()
    try:
        yield
    finally:
        tuning.CONFIG_TABLE["default"] = saved
        tuned.load_table.cache_clear()


CUTEDSL_VARIANT = re.compile(r"(\d+)?(?:s(\d+))?(?:g(\d+))?([pc])?")


def cutedsl_tuning(variant: str):
    """``"256s4g16p"`` -> ``CuteDslTuning(tile_n=256, max_stages=4, group_m=16,
    schedule="pingpong")`` (every part optional; ``c``: cooperative); None if ``variant`` is
    not of that form."""
    from coda_jax.ffi.tuning import CuteDslTuning

    parsed = CUTEDSL_VARIANT.fullmatch(variant)
    if not parsed:
        return None
    tile, stages, group, schedule = parsed.groups()
    return CuteDslTuning(tile_n=int(tile) if tile else None, max_stages=int(stages) if stages else None,
                         group_m=int(group) if group else None,
                         schedule={"p": "pingpong", "c": "cooperative"}.get(schedule, "auto"))


VARIANTS_HELP = ("a backend; pallas@untuned (no tuned table), pallas@table=<path>[:<path>...] (these tuned "
                 "tables), pallas@<field>=<value>[+...] (the default Pallas TuningConfig with those fields "
                 "replaced), or cutedsl@[<tile_n>][s<max stages>][g<group_m>][p|c] (a CuteDslTuning)")


@contextlib.contextmanager
def backend_variant(label):
    """Within, ops traced on the backend of ``label`` run as that variant; yields the
    backend's name. ``label`` is a backend, or:

    * ``"pallas@untuned"``: Pallas without tuned tables (the option
      ``pallas.tuned_tables="none"``: the heuristics of :mod:`coda_jax.pallas.tuning`);
    * ``"pallas@table=<path>[:<path>...]"``: Pallas on those tuned tables (e.g. an older one);
    * ``"pallas@<field>=<value>[+...]"``: the default Pallas ``TuningConfig`` with those fields
      replaced (e.g. ``pallas@cluster_dimension=None+grid_tile_width=8``; the tuned table's
      entries are built on it too);
    * ``"cutedsl@[<tile_n>][s<max stages>][g<group_m>][p|c]"``: the CuTeDSL lowering with that
      :class:`~coda_jax.ffi.tuning.CuteDslTuning` (e.g. ``cutedsl@128``: 128-wide CTA tiles;
      ``cutedsl@s4``: at most 4 operand stages; ``cutedsl@256g16``: 256-wide tiles walked in
      raster groups of 16 tile rows; ``cutedsl@p`` / ``cutedsl@c``: the ping-pong /
      cooperative schedule), run under :func:`coda_jax.backend.use_lowering`,

    to compare kernel configurations in one run."""
    base, _, variant = label.partition("@")
    if not variant:
        yield base
        return
    if base == "pallas" and (variant == "untuned" or variant.startswith("table=")):
        tables = "none" if variant == "untuned" else tuple(p for p in variant[len("table="):].split(os.pathsep) if p)
        with cj.options(pallas={"tuned_tables": tables}):
            yield base
        return
    if base == "pallas" and "=" in variant:  # e.g. pallas@cluster_dimension=None+grid_tile_width=8
        import dataclasses

        from coda_jax.pallas import tuning

        fields = tuning.config_overrides(variant.split("+"), f"backend variant {label!r}")
        with _default_config(dataclasses.replace(tuning.CONFIG_TABLE["default"], **fields)):
            yield base
        return
    tuning_ = cutedsl_tuning(variant) if base == "cutedsl" else None
    if tuning_ is None:
        raise ValueError(f"backend variant {label!r}: one of {VARIANTS_HELP}")
    from coda_jax.backend import use_lowering
    from coda_jax.ffi.lowering import CuteDslLowering

    with use_lowering(CuteDslLowering(tuning_)):
        yield base


def _kernel_lowering(name):
    """The lowering backend ``name`` runs on here (a variant's, inside
    :func:`backend_variant`), with its plain GEMMs on its own kernel (what we measure)."""
    import copy

    from coda_jax.backend import _ensure_registered, _lowering_overrides, _lowerings

    _ensure_registered(name)
    low = copy.copy(_lowering_overrides.get().get(name) or _lowerings[name]())
    if hasattr(low, "plain_gemm"):  # a kernel lowering (coda_jax.kernel_lowering.KernelLowering)
        low.plain_gemm = "kernel"
    return low


def block_variants(backends):
    """(label, backend, plain-GEMM route): "<backend>" sends plain GEMMs to XLA (the default),
    "<backend>+<backend>plain" runs them on the backend's kernel too."""
    return [(b, b, None) for b in backends] + [(f"{b}+{b.partition('@')[0]}plain", b, b.partition("@")[0])
                                               for b in backends if b.partition("@")[0] in ("pallas", "cutedsl")]


def bench_block(widths, backends, iters, rounds=4):
    """Block forward and forward+backward of every backend variant, interleaved in ``rounds``
    rounds; besides each case's median, ``"<a>/<b>_fwdbwd_rounds"`` holds the fwd+bwd time
    ratio of the kernel backends round by round (e.g. cutedsl/pallas: below 1 in every round
    means cutedsl was faster throughout the run, not only in the pooled median)."""
    rows = []
    for d in widths:
        row = {"op": "block", "d": d}
        fwd, fb, args = baseline_block(d)
        cases = {"baseline_fwd_ms": (fwd, args), "baseline_fwdbwd_ms": (fb, args)}
        for label, b, plain in block_variants(backends):
            try:
                with backend_variant(b) as base, plain_gemm_route(base, plain):
                    fwd, fb, args = coda_block(d, base)
                    jax.block_until_ready((fwd(*args), fb(*args)))  # compiled with these settings
                cases[f"{label}_fwd_ms"], cases[f"{label}_fwdbwd_ms"] = (fwd, args), (fb, args)
            except Exception as e:
                row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
        by_round = {}
        row.update(interleaved_median_ms(cases, iters, rounds, per_round=by_round))  # same conditions for all
        kernels = [label for label, _, _ in block_variants(backends) if label != "xla" and "+" not in label]
        for i, a in enumerate(kernels):
            for b in kernels[i + 1:]:
                ka, kb = f"{a}_fwdbwd_ms", f"{b}_fwdbwd_ms"
                if ka in by_round and kb in by_round:
                    row[f"{a}/{b}_fwdbwd_rounds"] = [round(x / y, 4) for x, y in zip(by_round[ka], by_round[kb])]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows):
    # "bwd x": the backward alone, (xla fwd+bwd - xla fwd) / (fwd+bwd - fwd), from the same medians.
    # "vs plain": the plain JAX op's (plain_ops.py) time over this row's, fwd and fwd+bwd.
    # "device fwd+bwd": summed GPU kernel time (no dispatch), and its ratio to plain's.
    lines = ["| op | d | backend | fwd ms | xla fwd ms | fwd x | fwd+bwd ms | xla fwd+bwd ms | fwd+bwd x | bwd x | "
             "fwd vs plain | fwd+bwd vs plain | device fwd+bwd ms | device vs plain | fwd err | grad err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = {(r["op"], r["d"]): r for r in rows if r.get("backend") == "xla" and "fwd_ms" in r}
    plain = {(r["op"], r["d"]): r for r in rows if r.get("backend") == "plain" and "fwd_ms" in r}
    for r in rows:
        if "fwd_ms" not in r and "error" not in r:
            continue
        if r.get("op") in ("gemm", "block", "ce_memory", "epilogue"):
            continue
        x = ref.get((r["op"], r["d"]), {})
        pl = plain.get((r["op"], r["d"]), {})
        if "error" in r:
            lines.append(f"| {r['op']} | {r['d']} | {r['backend']} | ERROR {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['op']} | {r['d']} | {r['backend']} | {r['fwd_ms']:.3f} | {x.get('fwd_ms', float('nan')):.3f} | "
            f"{x.get('fwd_ms', float('nan')) / r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.3f} | {x.get('fwdbwd_ms', float('nan')):.3f} | "
            f"{x.get('fwdbwd_ms', float('nan')) / r['fwdbwd_ms']:.2f} | "
            f"{(x.get('fwdbwd_ms', float('nan')) - x.get('fwd_ms', 0.0)) / max(r['fwdbwd_ms'] - r['fwd_ms'], 1e-9):.2f} | "
            f"{pl.get('fwd_ms', float('nan')) / r['fwd_ms']:.3f} | {pl.get('fwdbwd_ms', float('nan')) / r['fwdbwd_ms']:.3f} | "
            f"{r.get('fwdbwd_device_ms', float('nan')):.3f} | "
            f"{pl.get('fwdbwd_device_ms', float('nan')) / r.get('fwdbwd_device_ms', float('nan')):.3f} | "
            f"{r.get('fwd_rel_err', float('nan')):.1e} | "
            f"{r.get('grad_rel_err', float('nan')):.1e} |")
    for r in rows:
        if r.get("op") == "gemm":
            cols = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "op")
            lines.append(f"gemm: {cols}")
        if r.get("op") == "epilogue":
            dot = f" (jnp.dot {r['xla_dot_ms']:.3f} ms)" if r.get("xla_dot_ms") else ""
            lines.append(f"epilogue: {r['backend']} d={r['d']} {r['program']} M={r['m']} K={r['k']} N={r['n']} "
                         + (f"{r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s{dot}" if "ms" in r else r.get("error", "")[:120]))
        if r.get("op") in ("block", "ce_memory"):
            cols = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                            if k != "op" and not k.endswith("_rounds"))
            lines.append(f"{r['op']}: {cols}")
            for k, v in r.items():
                if k.endswith("_fwdbwd_rounds"):
                    pair = k[:-len("_fwdbwd_rounds")]
                    lines.append(f"{r['op']} d={r['d']} {pair} fwd+bwd time ratio by round: "
                                 f"below 1 in {sum(x < 1 for x in v)} of {len(v)}, median {statistics.median(v):.4f}, "
                                 f"range {min(v):.4f}-{max(v):.4f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--widths", default="2048,4096,8192")
    ap.add_argument("--backends", default="xla,pallas",
                    help=f"comma-separated, each {VARIANTS_HELP}; plain: the op written in plain JAX (ops part)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--block-rounds", type=int, default=4, help="block part: interleaved rounds (iters split over them)")
    ap.add_argument("--block-backends", default="", help="block part: these backends instead of --backends")
    ap.add_argument("--parts", default="gemm,ops,ce_memory,block")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--ops", default="", help="ops part: only these ops (comma-separated)")
    ap.add_argument("--programs", default="", help="epilogues part: only these case labels (comma-separated)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = ap.parse_args()
    if args.smoke:
        global TOKENS, VOCAB, ATTENTION
        TOKENS, VOCAB, ATTENTION = 256, 1000, None
        WIDTHS.clear()
        WIDTHS[256] = (512, 4, 2, 64)
        args.widths, args.iters = "256", 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    widths = [int(w) for w in args.widths.split(",")]
    backends = args.backends.split(",")
    parts = args.parts.split(",")
    dev = jax.devices()[0]
    meta = {"device": dev.device_kind, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(meta), flush=True)
    rows = []

    def save():  # after every part, so a run cut short still leaves its results
        (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "table.md").write_text(table(rows) + "\n")

    if "gemm" in parts:
        rows += bench_gemm(backends, args.iters)
        save()
    if "ops" in parts:
        for d in widths:
            for name, fused, ref, a, argnums, plain in op_cases(d):
                if args.ops and name not in args.ops.split(","):
                    continue
                rows += bench_op(name, fused, ref, a, argnums, backends, args.iters, not args.no_check, plain)
                save()
    if "epilogues" in parts:
        rows += bench_epilogues(widths, backends, args.iters,
                                args.programs.split(",") if args.programs else None)
        save()
    if "ce_memory" in parts:
        rows += ce_memory(backends)
        save()
    if "block" in parts:
        # the block's baseline is the plain XLA Llama block, always timed
        rows += bench_block(widths, [b for b in (args.block_backends.split(",") if args.block_backends else backends)
                                     if b != "plain"], args.iters, args.block_rounds)
    save()
    t = table(rows)
    print("\n" + json.dumps(meta) + "\n" + t, flush=True)


if __name__ == "__main__":
    main()
