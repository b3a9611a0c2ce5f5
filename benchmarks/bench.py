"""coda-jax benchmarks and GPU correctness checks at real shapes (run on the H100).

    python benchmarks/bench.py --out $OUT [--widths 2048,4096,8192] [--backends xla,pallas]

For every op: forward and forward+backward time on each backend, the XLA reference
(the same op on backend "xla", jitted) in the same run, the ratio, and the relative error
of the forward output and of the gradients against a float32 computation of the naive
definition on the same bf16 inputs (fresh random inputs, never zeros). Also the plain GEMM
against ``jnp.dot``, the cross-entropy's compiled temp memory against the logits' size, and
``CodaLlamaBlock`` against the plain XLA Llama block (``xla_llama_block.py``).
Timing: median of ``--iters`` runs after warm-up, with ``jax.block_until_ready``.
Results go to ``<out>/bench.json``; a short table is printed last.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coda_jax as cj  # noqa: E402
from coda_jax import naive, programs  # noqa: E402

WIDTHS = {  # d: (f, heads, kv_heads, head_dim)
    2048: (8192, 32, 8, 64),
    4096: (14336, 32, 8, 128),
    8192: (28672, 64, 8, 128),
}
TOKENS = 8192
VOCAB = 128256


def median_ms(f, *args, iters=20, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


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
    """(name, fused(backend) -> fn(*args), naive fn, args, differentiable argnums)."""
    f, h, kv, hd = WIDTHS[d]
    r = Inputs(d)
    m = TOKENS
    x, g = r.normal((m, d)), r.normal((d,), 0.1, 1.0)
    cases = []
    y, wo = r.normal((m, d)), r.normal((d, d), d ** -0.5)
    cases.append(("residual_rms", lambda b: lambda y, w, res, g: _residual_out(cj.matmul_residual_rms(y, w, res, g, backend=b)),
                  lambda y, w, res, g: naive.matmul_residual(y, w, res), (y, wo, x, g), (0, 1, 2)))
    wgu = r.normal((d, 2 * f), d ** -0.5)
    cases.append(("norm_swiglu", lambda b: lambda x, g, w: cj.rms_norm_matmul_swiglu(x, g, w, backend=b),
                  naive.rms_norm_matmul_swiglu, (x, g, wgu), (0, 1, 2)))
    wqkv = r.normal((d, (h + 2 * kv) * hd), d ** -0.5)
    pos = r.ints((m,), 8192)
    inv = jnp.asarray(cj.rope_inv_freq(hd, 500000.0, cj.Llama3RopeScaling()))
    kw = dict(num_heads=h, num_kv_heads=kv)
    cases.append(("norm_qkv_rope", lambda b: lambda x, g, w: cj.rms_norm_matmul_rope(x, g, w, pos, inv, backend=b, **kw),
                  lambda x, g, w: naive.rms_norm_matmul_rope(x, g, w, pos, inv, **kw), (x, g, wqkv), (0, 1, 2)))
    wd = r.normal((d, f), d ** -0.5)
    cases.append(("norm_matmul", lambda b: lambda x, g, w: cj.rms_norm_matmul(x, g, w, backend=b),
                  naive.rms_norm_matmul, (x, g, wd), (0, 1, 2)))
    if d == min(WIDTHS):  # the LM head at the 1B width (vocab 128256)
        wv = r.normal((VOCAB, d), d ** -0.5 * 2)
        t = r.ints((m,), VOCAB)
        cases.append(("lm_head_ce", lambda b: lambda x, g, w: cj.linear_cross_entropy(x, g, w, t, backend=b),
                      lambda x, g, w: naive.linear_cross_entropy(x, g, w, t), (x, g, wv), (0, 1, 2)))
    return cases


def _residual_out(res):
    x, carry = res
    return x, carry.h, carry.sumsq


def bench_op(name, fused, ref, args, argnums, backends, iters, check):
    rows = []
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    first = lambda o: o[0] if isinstance(o, tuple) else o
    out_ref = jax.jit(ref)(*f32) if check else None
    rnd = None
    if check:
        rnd = jax.random.normal(jax.random.key(11), first(out_ref).shape if isinstance(out_ref, tuple) else out_ref.shape)
        scal = lambda fn: (lambda *a: jnp.sum(first(fn(*a)).astype(jnp.float32) * rnd) if rnd.ndim else first(fn(*a)))
        grads_ref = jax.jit(jax.grad(scal(ref), argnums))(*f32)
    for b in backends:
        row = {"op": name, "backend": b, "d": args[0].shape[1]}
        try:
            fn = fused(b)
            fwd = jax.jit(fn)
            scalar = lambda *a: jnp.sum(first(fn(*a)).astype(jnp.float32) * (rnd if rnd is not None else 1.0)) \
                if first(jax.eval_shape(fn, *args)).ndim else first(fn(*a))
            fb = jax.jit(jax.value_and_grad(scalar, argnums))
            if check:
                row["fwd_rel_err"] = rel(first(fwd(*args)), first(out_ref))
                _, grads = fb(*args)
                row["grad_rel_err"] = max(rel(a, r_) for a, r_ in zip(grads, grads_ref))
            row["fwd_ms"] = median_ms(fwd, *args, iters=iters)
            row["fwdbwd_ms"] = median_ms(fb, *args, iters=iters)
        except Exception as e:  # record and go on: one failing kernel must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench_gemm(backends, iters):
    from coda_jax.backend import _ensure_registered, _lowerings

    rows = []
    for (k, n) in [(2048, 8192), (4096, 14336), (8192, 28672), (4096, 4096)]:
        r = Inputs(k + n)
        a, b = r.normal((TOKENS, k)), r.normal((k, n))
        flops = 2 * TOKENS * k * n
        ref = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
        row = {"op": "gemm", "k": k, "n": n, "xla_ms": median_ms(jax.jit(jnp.dot), a, b, iters=iters)}
        for name in backends:
            if name == "xla":
                continue
            try:
                _ensure_registered(name)
                low = _lowerings[name]()
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


def ce_memory(backends):
    """Compiled temp memory of the LM-head CE fwd+bwd vs the [tokens, vocab] bf16 logits."""
    rows = []
    d = min(WIDTHS)
    r = Inputs(5)
    x, g, w, t = r.normal((TOKENS, d)), r.normal((d,), 0.1, 1.0), r.normal((VOCAB, d), 0.05), r.ints((TOKENS,), VOCAB)
    for b in backends:
        try:
            fn = jax.jit(jax.value_and_grad(lambda x, g, w: cj.linear_cross_entropy(x, g, w, t, backend=b), (0, 1, 2)))
            mem = fn.lower(x, g, w).compile().memory_analysis()
            rows.append({"op": "ce_memory", "backend": b, "temp_MiB": mem.temp_size_in_bytes / 2 ** 20,
                         "logits_bf16_MiB": TOKENS * VOCAB * 2 / 2 ** 20})
        except Exception as e:
            rows.append({"op": "ce_memory", "backend": b, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_block(widths, backends, iters):
    from flax import nnx

    import xla_llama_block as base
    from coda_jax.layers import CodaLlamaBlock, LlamaConfig

    rows = []
    bsz, seq = 4, TOKENS // 4
    for d in widths:
        f, h, kv, hd = WIDTHS[d]
        row = {"op": "block", "d": d}
        p = base.init_params(jax.random.key(0), d, f, h, kv)
        x = jax.random.normal(jax.random.key(3), (bsz, seq, d), jnp.bfloat16)
        cos, sin = base.rope_tables(seq, hd)
        blk = functools.partial(base.llama_block, cos=cos, sin=sin, heads=h, kv_heads=kv, attention=True)
        row["baseline_fwd_ms"] = median_ms(jax.jit(blk), p, x, iters=iters)
        loss = lambda p, x: jnp.sum(blk(p, x).astype(jnp.float32))
        row["baseline_fwdbwd_ms"] = median_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), p, x, iters=iters)
        cfg = LlamaConfig(hidden_size=d, intermediate_size=f, num_heads=h, num_kv_heads=kv, head_dim=hd,
                          num_layers=1, param_dtype=jnp.bfloat16, attention_implementation="cudnn")
        for b in backends:
            try:
                model = CodaLlamaBlock(cfg, rngs=nnx.Rngs(0), backend=b)
                gdef, state = nnx.split(model)
                fwd = jax.jit(lambda s, x: nnx.merge(gdef, s)(x)[0])
                lf = lambda s, x: jnp.sum(nnx.merge(gdef, s)(x)[0].astype(jnp.float32))
                row[f"{b}_fwd_ms"] = median_ms(fwd, state, x, iters=iters)
                row[f"{b}_fwdbwd_ms"] = median_ms(jax.jit(jax.value_and_grad(lf, argnums=(0, 1))), state, x, iters=iters)
            except Exception as e:
                row[f"{b}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows):
    lines = ["| op | d | backend | fwd ms | xla fwd ms | fwd x | fwd+bwd ms | xla fwd+bwd ms | fwd+bwd x | fwd err | grad err |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = {(r["op"], r["d"]): r for r in rows if r.get("backend") == "xla" and "fwd_ms" in r}
    for r in rows:
        if "fwd_ms" not in r and "error" not in r:
            continue
        if r.get("op") in ("gemm", "block", "ce_memory"):
            continue
        x = ref.get((r["op"], r["d"]), {})
        if "error" in r:
            lines.append(f"| {r['op']} | {r['d']} | {r['backend']} | ERROR {r['error'][:80]} |")
            continue
        lines.append(
            f"| {r['op']} | {r['d']} | {r['backend']} | {r['fwd_ms']:.3f} | {x.get('fwd_ms', float('nan')):.3f} | "
            f"{x.get('fwd_ms', float('nan')) / r['fwd_ms']:.2f} | {r['fwdbwd_ms']:.3f} | {x.get('fwdbwd_ms', float('nan')):.3f} | "
            f"{x.get('fwdbwd_ms', float('nan')) / r['fwdbwd_ms']:.2f} | {r.get('fwd_rel_err', float('nan')):.1e} | "
            f"{r.get('grad_rel_err', float('nan')):.1e} |")
    for r in rows:
        if r.get("op") == "gemm":
            cols = " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "op")
            lines.append(f"gemm: {cols}")
        if r.get("op") in ("block", "ce_memory"):
            cols = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items() if k != "op")
            lines.append(f"{r['op']}: {cols}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--widths", default="2048,4096,8192")
    ap.add_argument("--backends", default="xla,pallas")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--parts", default="gemm,ops,ce_memory,block")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    args = ap.parse_args()
    if args.smoke:
        global TOKENS, VOCAB
        TOKENS, VOCAB = 256, 1000
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
            for name, fused, ref, a, argnums in op_cases(d):
                rows += bench_op(name, fused, ref, a, argnums, backends, args.iters, not args.no_check)
                save()
    if "ce_memory" in parts:
        rows += ce_memory(backends)
        save()
    if "block" in parts:
        rows += bench_block(widths, backends, args.iters)
    save()
    t = table(rows)
    print("\n" + json.dumps(meta) + "\n" + t, flush=True)


if __name__ == "__main__":
    main()
