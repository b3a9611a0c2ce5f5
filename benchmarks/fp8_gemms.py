"""FP8 GEMMs on the GPU: XLA's (cuBLASLt) against coda-jax's lowerings, plain and fused.

    python -m benchmarks.fp8_gemms [--backends xla,pallas] [--shapes 8192x2048x3072,...] [--out DIR]
    python -m benchmarks.fp8_gemms --block 1b:8:1024 [--backends xla,pallas,cutedsl]

Per ``M x K x N`` shape (``[M, K] @ [K, N]``), one process, interleaved medians
(:func:`benchmarks.bench.interleaved_median_ms`):

* ``bf16``: ``a @ b`` in bfloat16 (XLA, cuBLAS): the baseline of record;
* ``xla_fp8``: e4m3 x e4m3 -> bf16 with both operands K-major (``a [M, K]``, ``b`` stored
  ``[N, K]``), scaled: the FP8 GEMM plain JAX gets at its best;
* ``xla_fp8_rowmajor_b``: the same with ``b`` stored ``[K, N]`` (XLA transposes it first);
* ``<backend>``: coda-jax's FP8 GEMM through that backend's lowering
  (:func:`coda_jax.ops.fp8_gemm.fp8_gemm`, identity epilogue);
* ``<backend>_fused``: the ``RESIDUAL_RMS_Q8`` epilogue (residual add, ``h = x * gamma`` in e4m3
  with its transposed copy and amax, row sums of squares), against ``xla_fp8_unfused``: the
  same outputs in plain JAX after the FP8 GEMM.

The compiled HLO of ``xla_fp8`` is checked for XLA's FP8 GEMM custom call (``f8`` in its
target): XLA silently runs some FP8 patterns as bf16 GEMMs.

``--block 1b:8:1024`` (preset[-layers]:batch:seq): instead, every FP8 GEMM of that CodaLlama FP8
training step (the calls its Pallas kernels get, with their programs, shapes and loads;
:func:`coda_jax.pallas.autotune.kernel_calls`) on random inputs of those shapes, each against
cuBLASLt's bare FP8 GEMM of the same shape and layout (``a [M, K] @ b[N, K]^T`` -> bf16): the
issue's "each FP8 fused GEMM within 10 % of cuBLASLt's FP8 GEMM". Per call and backend: the
fused GEMM's time (``xla``: cuBLASLt's GEMM and the epilogue as XLA passes), and its ratio to
the bare GEMM; and the call's *floor*: the larger of the bare GEMM's time and the bytes the fused
call must move at least (operands, loads, outputs, each once) at the memory's rate that a copy
measures in the same run (:func:`copy_bytes_per_ms`). A heavy epilogue's floor is above the bare
GEMM: ``vs_floor`` says how far each backend is from what that call can reach. Then the step's
quantizing *epilogue passes* (programs over a zero accumulator,
:mod:`coda_jax.ops.epilogue_pass`: the attention output, the QKV gradient, ...), each per
backend against ``xla``, the same math as XLA fusions (the zero operands made inside the jitted
function, so XLA folds the GEMM away). Times are CUPTI kernel time on a GPU
(:func:`coda_jax.pallas.autotune.kernel_ms`: the sum of the call's kernels), wall-clock
medians elsewhere.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp

import coda_jax as cj
from benchmarks.bench import interleaved_median_ms, median_ms, rel
from coda_jax import programs
from coda_jax.backend import lowering_for
from coda_jax.fp8 import E4M3, Fp8Tensor, quantize
from coda_jax.ops.epilogue_pass import K_STEP, epilogue_pass
from coda_jax.ops.fp8_gemm import fp8_gemm
from coda_jax.ops.names import FP8_LLAMA_BLOCK

# The shapes and the Llama-3.2-1B block's at 8192 tokens: QKV, O, gate/up, down
# forward, and a wgrad (K = tokens).
SHAPES = ("8192x2048x3072", "8192x2048x2048", "8192x2048x16384", "8192x8192x2048", "2048x8192x16384")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def backend_lowering(name: str):
    """The lowering that runs the FP8 block's GEMMs for ``--backends`` entry ``name``."""
    with cj.options(backend=name, routing=dict(xla_output_below=0)):
        return lowering_for(FP8_LLAMA_BLOCK, name)


def fp8_gemm_targets(hlo: str) -> list[str]:
    """The custom-call targets of ``hlo`` (compiled HLO text) that are FP8 GEMMs."""
    return [t for t in _CUSTOM_CALL.findall(hlo) if "f8" in t.lower()]


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--shapes: {text!r} is not MxKxN") from None
    return m, k, n


def _cases(m: int, k: int, n: int, backends: list[str]):
    ks = jax.random.split(jax.random.key(m + 7 * k + 13 * n), 5)
    a = jax.random.normal(ks[0], (m, k), jnp.float32)
    b = jax.random.normal(ks[1], (k, n), jnp.float32) * k ** -0.5
    res = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    gamma = 1.0 + 0.1 * jax.random.normal(ks[3], (n,), jnp.float32)
    sa, sb = jnp.float32(64.0), jnp.float32(256.0)
    a8, b8 = quantize(a, sa, E4M3), quantize(b, sb, E4M3)
    b8t = jax.block_until_ready(jnp.array(b8.T))  # stored [N, K]
    A, B = Fp8Tensor(a8, None, 1 / sa), Fp8Tensor(None, b8t, 1 / sb)
    ab, bb = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    h_scale = jnp.float32(8.0)

    def xla_fp8(a8, b8t, s):
        return (jax.lax.dot_general(a8, b8t, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
                * s).astype(jnp.bfloat16)

    def xla_fp8_rowmajor(a8, b8, s):
        return (jax.lax.dot_general(a8, b8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)
                * s).astype(jnp.bfloat16)

    def xla_unfused(a8, b8t, s, res, gamma, hs):
        x = xla_fp8(a8, b8t, s).astype(jnp.float32) + res.astype(jnp.float32)
        h = x * gamma
        hq = quantize(h, hs, E4M3)
        return x.astype(jnp.bfloat16), hq, hq.T, jnp.max(jnp.abs(h)), jnp.sum(x * x, axis=1)

    s = sa ** -1 * sb ** -1
    cases = {
        "bf16": (jax.jit(lambda x, y: x @ y), (ab, bb)),
        "xla_fp8": (jax.jit(xla_fp8), (a8, b8t, s)),
        "xla_fp8_rowmajor_b": (jax.jit(xla_fp8_rowmajor), (a8, b8, s)),
        "xla_fp8_unfused": (jax.jit(xla_unfused), (a8, b8t, s, res, gamma, h_scale)),
    }
    for name in backends:
        lw = backend_lowering(name)
        plain = jax.jit(lambda A, B, lw=lw: fp8_gemm(lw, programs.IDENTITY, A, B, {}, out_dtypes={"out": jnp.bfloat16})["out"])
        fused = jax.jit(lambda A, B, res, gamma, hs, lw=lw: fp8_gemm(
            lw, programs.RESIDUAL_RMS_Q8, A, B, {"residual": res, "gamma": gamma, "h_scale": hs},
            out_dtypes={"x": jnp.bfloat16}))
        cases[name] = (plain, (A, B))
        cases[f"{name}_fused"] = (fused, (A, B, res, gamma, h_scale))
    return cases


def copy_bytes_per_ms(timer, iters: int, nbytes: int) -> float:
    """The memory's rate (bytes read plus bytes written, per ms) of one copy of an ``nbytes``
    bf16 array, timed with ``timer`` (:func:`coda_jax.pallas.autotune.kernel_ms` on a GPU)."""
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * jnp.bfloat16(-1))  # read once, write once; not elided
    return 2 * x.nbytes / timer(copy, x, iters=iters)


def moved_bytes(a: jax.Array, b: jax.Array, loads, outputs) -> int:
    """What a fused GEMM reads and writes at least: its operands, loads and outputs once each."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves((a, b, loads, outputs)))


def block_gemms(spec: str, backends: list[str], iters: int, out: Path | None = None,
                only: frozenset[str] | None = None) -> list[dict]:
    """Rows of ``--block spec``: each FP8 kernel call of the CodaLlama FP8 step, per backend its
    fused time and the ratio to cuBLASLt's bare FP8 GEMM of the same shape (see the module doc).
    With ``out``, ``fp8_block_gemms.json`` there is rewritten after each row, so a run cut short
    keeps what it measured. (Two layers give every call of a deeper model of the same width:
    ``1b-2:8:1024``.) ``only``: the calls (GEMMs and passes) of these epilogues alone. The
    kernel backends run every call on their kernels, the plain ones too (which the step hands
    to cuBLASLt by default, the option ``routing.plain_gemm``: the ``xla`` column is that
    route); a promoted call is run promoted and set against cuBLASLt at ``HIGHEST``."""
    from benchmarks.tune import model_step
    from coda_jax.pallas import autotune as at

    on_gpu = jax.devices()[0].platform == "gpu"
    timer = at.kernel_ms if on_gpu else median_ms
    fn, args = model_step(spec if spec.endswith((":fp8", ":fp8-head")) else spec + ":fp8")
    with cj.options(routing=cj.RoutingOptions(plain_gemm="kernel")):
        return _block_rows(fn, args, backends, iters, out, only, timer, on_gpu)


def _block_rows(fn, args, backends, iters, out, only, timer, on_gpu) -> list[dict]:
    from coda_jax.epilogue import FP8_DTYPES
    from coda_jax.pallas import autotune as at

    every = at.kernel_calls(fn, *args)
    if only is not None:
        every = [c for c in every if c.epilogue.name in only]
    calls = [c for c in every if c.a.dtype in FP8_DTYPES]
    rows = []
    xla = backend_lowering("xla")  # its outputs' shapes: what each call writes
    rate = copy_bytes_per_ms(timer, iters, 1 << 30 if on_gpu else 1 << 22)
    print(f"BLOCK the memory's rate (a copy): {rate / 1e9:.2f} TB/s", flush=True)

    def emit(row):
        rows.append(row)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "fp8_block_gemms.json").write_text(json.dumps(rows, indent=1))

    for call in calls:
        if call.transpose_a or not call.transpose_b:
            raise ValueError(f"{call.epilogue.name}: an FP8 call with a non-K-major operand")
        a, b, loads = at.random_arguments(call)
        # A promoted call (Fp8Recipe.promote_k) against cuBLASLt's promoting GEMM (HIGHEST).
        precision = jax.lax.Precision.HIGHEST if call.promote_k else None
        bare = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                                        preferred_element_type=jnp.bfloat16))
        kw = dict(transpose_b=True, out_dtypes=dict(call.out_dtypes) or None, promote_k=call.promote_k)
        m, n, k = call.mnk
        label = f"{call.epilogue.name} nt {m}x{n}x{k}{' promoted' if call.promote_k else ''}"  # K-major operands
        outputs = jax.eval_shape(lambda a, b, l: xla.gemm(call.epilogue, a, b, l, **kw), a, b, loads)
        nbytes = moved_bytes(a, b, loads, outputs)
        row = {"call": label, "bare_cublaslt_ms": timer(bare, a, b, iters=iters), "bytes": nbytes,
               "bytes_ms": nbytes / rate, "ms": {}, "vs_bare": {}, "vs_floor": {}}
        row["floor_ms"] = max(row["bare_cublaslt_ms"], row["bytes_ms"])
        for name in backends:
            lw = backend_lowering(name)
            f = jax.jit(lambda a, b, l, lw=lw: lw.gemm(call.epilogue, a, b, l, **kw))
            row["ms"][name] = timer(f, a, b, loads, iters=iters)
            row["vs_bare"][name] = row["ms"][name] / row["bare_cublaslt_ms"]
            row["vs_floor"][name] = row["ms"][name] / row["floor_ms"]
        emit(row)
        print(f"BLOCK {label:48s} cuBLASLt bare {row['bare_cublaslt_ms']:.4f} ms, bytes {row['bytes_ms']:.4f} ms  "
              + "  ".join(f"{nm} {row['ms'][nm]:.4f} ms ({row['vs_bare'][nm]:.2f}x bare, "
                          f"{row['vs_floor'][nm]:.2f}x floor)" for nm in backends), flush=True)
    for call in pass_calls(every):
        _, _, loads = at.random_arguments(call)
        m, n, _ = call.mnk
        row = {"call": f"{call.epilogue.name} pass {m}x{n}", "pass": True, "ms": {}, "vs_xla": {}}
        for name in dict.fromkeys(["xla", *backends]):
            lw = backend_lowering(name)
            f = jax.jit(lambda l, lw=lw: epilogue_pass(lw, call.epilogue, m, n, l,
                                                       out_dtypes=dict(call.out_dtypes) or None))
            row["ms"][name] = timer(f, loads, iters=iters)
        row["vs_xla"] = {nm: row["ms"][nm] / row["ms"]["xla"] for nm in row["ms"]}
        emit(row)
        print(f"PASS  {row['call']:48s} " + "  ".join(
            f"{nm} {row['ms'][nm]:.4f} ms ({row['vs_xla'][nm]:.2f}x xla)" for nm in row["ms"]), flush=True)
    return rows


def pass_calls(calls: list) -> list:
    """The epilogue passes among a step's kernel calls: quantizing programs over one K step of
    bf16 operands (:data:`coda_jax.ops.epilogue_pass.K_STEP`; no GEMM of the FP8 step has so
    short a K)."""
    return [c for c in calls if c.mnk[2] == K_STEP and c.a.dtype == jnp.bfloat16
            and any(o.quantize for o in c.epilogue.outputs)]


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="xla,pallas",
                   help="comma-separated: xla, pallas, cutedsl")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--block", default=None, help="preset[-layers]:batch:seq: the FP8 GEMMs of that step instead")
    p.add_argument("--programs", default="", help="--block: only the calls of these epilogues (comma-separated names)")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if args.block:
        return block_gemms(args.block, backends, args.iters, Path(args.out) if args.out else None,
                           frozenset(args.programs.split(",")) if args.programs else None)
    rows = []
    for text in args.shapes.split(","):
        m, k, n = parse_shape(text)
        cases = _cases(m, k, n, backends)
        f, fargs = cases["xla_fp8"]
        targets = fp8_gemm_targets(f.lower(*fargs).compile().as_text())
        ref = cases["xla_fp8"][0](*cases["xla_fp8"][1]).astype(jnp.float32)
        errs = {name: rel(cases[name][0](*cases[name][1]), ref) for name in backends}
        ms = interleaved_median_ms(cases, iters=args.iters)
        tf = {key: 2 * m * n * k / (v * 1e-3) / 1e12 for key, v in ms.items()}
        row = {"shape": text, "ms": ms, "tflops": tf, "xla_fp8_targets": targets, "rel_err_vs_xla_fp8": errs,
               "device": jax.devices()[0].device_kind}
        rows.append(row)
        print(f"{text}: FP8 GEMM calls {targets or 'NONE (bf16 fallback?)'}; rel. error against xla_fp8: "
              + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        for key in ms:
            base = "xla_fp8_unfused" if key.endswith("_fused") else "xla_fp8"
            print(f"  {key:22s} {ms[key]:8.3f} ms {tf[key]:7.0f} TF/s  x{ms['bf16'] / ms[key]:.2f} bf16  "
                  f"x{ms[base] / ms[key]:.2f} {base}", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_gemms.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
