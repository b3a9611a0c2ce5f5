"""Measures TuningConfig variants of the Pallas GEMM-epilogue kernel on the H100 (CUPTI kernel time).

    python -m benchmarks.tune [--out DIR] [--mainloop] [--epilogue-sweep] [--plain] [--variants a,b]
    python -m benchmarks.tune --model 1b:8:1024 [--model 8b-4:4:1024] [--table PATH] [--out DIR]

``--model preset[-layers]:batch:seq[:fp8]`` (repeatable; ``:fp8``: the step in FP8, ``:fp8-head``: with its LM head too, ``:fp8-zq8``: with the SwiGLU input saved in e4m3; ``op:name:d`` for one fused op of the op
benchmark, e.g. ``op:norm_matmul:2048``): autotunes every Pallas kernel call of
that CodaLlama training step (:func:`coda_jax.pallas.autotune.autotune`: each call under the
heuristic configuration and the candidates, outputs checked against the heuristic's, CUPTI
time) and writes the winners to ``<out>/tuned_<gpu>.json`` (``tuned_h100.json`` on an H100,
``tuned_h200.json`` on an H200: :func:`coda_jax.pallas.tuned.table_file_name`), merged with
``--table`` (default: the package's shipped table for this GPU, if any; ``none``: no merge),
ready to copy to ``coda_jax/pallas/``. Every measurement goes to ``<out>/tune_model.json``.

``--mainloop`` (the default when no sweep is named): the identity GEMM at M=8192 tokens and
the Llama (K, N) pairs, in the forward, dgrad (``a @ b^T``) and wgrad (``a^T @ b``) layouts,
under tile-order / cluster / warpgroup-split variants (``VARIANTS``), next to cuBLAS (XLA's
bf16 GEMM) and the JAX-shipped Hopper matmul (``hopper_matmul_mgpu``, forward layout), all
in one process. Prints one ``MAINLOOP`` line per measurement and the best variant per case;
copy the winner into ``coda_jax/pallas/tuning.py``'s ``CONFIG_TABLE``.

``--untuned-only`` (with ``--model``): only the calls the table merged into has no entry for
(a new program's or shape's), where a session's device time is short.

``--heat S`` (with ``--model``): each candidate is called back to back for ``S`` seconds before
it is timed (:func:`coda_jax.pallas.autotune.sustained_kernel_ms`), at the power-capped SM
clock of a training step instead of the idle GPU's full clock; ``HEAT`` lines give both
times and the clock. ``--programs`` limits the sweep to those epilogues.

``--epilogue-sweep``: the block's fused GEMMs at d=2048 (forward, dgrad and wgrad programs
at their real shapes) under epilogue variants (chunk register budget, load slots, swizzled
staging), each next to the identity GEMM of the same shape.

``--plain``: the block's plain backward GEMMs at d=2048 and 4096 on cuBLAS and on the kernel
(the data behind the plain-GEMM route).

Results go to ``<out>/tune.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.bench import Inputs, median_ms
from coda_jax import programs
from coda_jax.pallas import autotune as at
from coda_jax.pallas.autotune import kernel_ms
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuned import SHIPPED_TABLES, table_file_name
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig

M = 8192
SHAPES = [(2048, 8192), (4096, 14336)]  # (K, N): d=2048 gate/up-like, d=4096 MLP-like
LAYOUTS = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, False)}
_D = CONFIG_TABLE["default"]
# Variants of the table's default: tile order, 2-CTA clusters, epilogue chunking.
VARIANTS = {
    "default": _D,
    "gw8": dataclasses.replace(_D, grid_tile_width=8),
    "gw16": dataclasses.replace(_D, grid_tile_width=16),
    "minor_m": dataclasses.replace(_D, grid_minor_dim="m"),
    "minor_m_gw8": dataclasses.replace(_D, grid_minor_dim="m", grid_tile_width=8),
    "no_cluster": dataclasses.replace(_D, cluster_dimension=None),
    "cluster_m": dataclasses.replace(_D, cluster_dimension="m"),
    "cluster_m_minor_m": dataclasses.replace(_D, cluster_dimension="m", grid_minor_dim="m"),
    "cluster_n": dataclasses.replace(_D, cluster_dimension="n"),
    "split_m": dataclasses.replace(_D, wg_dimension="m"),
    "split_m_cluster_n": dataclasses.replace(_D, wg_dimension="m", cluster_dimension="n"),
    "slots_2": dataclasses.replace(_D, epilogue_load_slots=2),  # double-buffered loads (before load rings)
    "wide_chunks": dataclasses.replace(_D, epilogue_regs=1 << 20),  # no register-budget narrowing
    "regs_64": dataclasses.replace(_D, epilogue_regs=64),
    "swizzled": dataclasses.replace(_D, swizzle_epilogue=True),
    # Pipeline depth: what a fused epilogue's staging costs the mainloop (it leaves 3 stages).
    "stages3": dataclasses.replace(_D, max_concurrent_steps=3),
    # Other tile shapes (name them with --variants).
    "single_wg_128x128": TuningConfig(tile_m=128, tile_n=128, max_concurrent_steps=4, approx_math=True),
    "ws_n_64x128_s6": dataclasses.replace(_D, tile_m=64, max_concurrent_steps=6),
}
# The autotuner's candidates by name too (e.g. "pingpong", the stage ring: "ring", "ring_k32").
VARIANTS.update({k: v for k, v in at.known_candidates().items() if k not in VARIANTS})
MAINLOOP_VARIANTS = ["default", "no_cluster", "gw8", "minor_m", "minor_m_gw8", "cluster_m_minor_m", "cluster_n",
                     "split_m", "split_m_cluster_n"]


def _jax_example(a, b, tile_m=128, tile_n=128, wg="n", minor="n", width=4, cluster=None, stages=4):
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    dim = {"m": hm.MatmulDimension.M, "n": hm.MatmulDimension.N, None: None}
    cfg = hm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=stages,
                          wg_dimension=dim[wg], grid_minor_dim=dim[minor], grid_tile_width=width,
                          cluster_dimension=dim[cluster])
    return hm.matmul(a, b, None, cfg)


JAX_EXAMPLE = {  # the JAX-shipped kernel's configurations, as yardsticks (forward layout)
    "ex_wgN_gw4": {},
    "ex_wgN_gw8_minorM": {"minor": "m", "width": 8},
    "ex_wgM_gw4": {"wg": "m"},
    "ex_wgN_clusterM": {"cluster": "m"},
    "ex_wgM_clusterN": {"wg": "m", "cluster": "n"},
}


def _operands(m, k, n, ta, tb):
    """Random bf16 operands of an ``[m, k] @ [k, n]`` GEMM (A as ``[k, m]`` if ``ta``, B as
    ``[n, k]`` if ``tb``)."""
    r = Inputs(m + k + n)
    return r.normal((k, m) if ta else (m, k)), r.normal((n, k) if tb else (k, n))


def _cublas_fn(ta, tb):
    """XLA's GEMM of the layout, bf16 out with f32 accumulation (cuBLAS's own epilogue
    converts): the GEMM XLA emits in a model. Called as ``fn(a, b)``."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims))


def _kernel_fn(cfg, epi, ta, tb):
    """``epi`` on the Pallas kernel under ``cfg`` (plain GEMMs too), called as ``fn(a, b, loads)``."""
    low = PallasLowering(cfg, plain_gemm="pallas")
    return jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_a=ta, transpose_b=tb))


def _time_program(row, cfg, epi, a, b, loads, ta, tb, flops, iters):
    """``row`` with the program's time on the Pallas kernel under ``cfg`` (or the error)."""
    try:
        fn = _kernel_fn(cfg, epi, ta, tb)
        row["ms"] = median_ms(fn, a, b, loads, iters=iters)
        row["tflops"] = flops / row["ms"] / 1e9
        row["kernel_ms"] = kernel_ms(fn, a, b, loads, iters=2 * iters)
        row["kernel_tflops"] = flops / row["kernel_ms"] / 1e9
    except Exception as e:  # SMEM overflow, lowering failures: record and go on
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    return row


def block_programs(d=2048, f=8192, heads=32, kv=8, hd=64, m=M):
    """(name, epilogue, (K, N), transpose_a, transpose_b, loads) of the block's fused GEMMs."""
    r = Inputs(d)
    qkv = (heads + 2 * kv) * hd
    f32 = jnp.float32
    rstd = r.normal((m,), 0.1, 1.0, f32)
    return [
        ("rms_swiglu_train", programs.rms_swiglu(True), (d, 2 * f), False, False, {"rstd": rstd}),
        ("rms_rope", programs.rms_rope(hd // 2, None, False), (d, qkv), False, False,
         {"rstd": rstd, "cos": r.normal((m, hd // 2)), "sin": r.normal((m, hd // 2)),
          "rot": (jnp.arange(qkv // 2) < (heads + kv) * hd // 2).astype(f32)}),
        ("residual_rms", programs.RESIDUAL_RMS, (d, d), False, False,
         {"residual": r.normal((m, d)), "gamma": r.normal((d,), 0.1, 1.0, f32)}),
        ("rms_dgrad_res", programs.rms_dgrad(True), (2 * f, d), False, True,
         {"x": r.normal((m, d)), "xcoef": r.normal((m,), 0.1, 0.0, f32),
          "gamma": r.normal((d,), 0.1, 1.0, f32), "dres": r.normal((m, d))}),
        ("swiglu_dgrad", programs.SWIGLU_DGRAD, (d, f), False, True, {"z": r.normal((m, 2 * f)), "rstd": rstd}),
        ("norm_wgrad", programs.NORM_WGRAD, (m, 2 * f), True, False,  # A^T = x [tokens, d] (B = rstd * dz)
         {"gamma": r.normal((d,), 0.1, 1.0, f32), "w": r.normal((d, 2 * f))}),
    ], r, d


def epilogue_sweep(args, record):
    """The block's fused GEMMs under ``args.variants``, each next to the identity GEMM of its
    shape under the same variants."""
    names = args.variants.split(",") if args.variants else ["default", "wide_chunks", "regs_64", "swizzled"]
    progs, r, d = block_programs()
    only = set(args.programs.split(",")) if args.programs else None
    known = [p[0] for p in progs]
    if only and only - set(known):
        raise SystemExit(f"--programs: unknown {sorted(only - set(known))}; one of {known}")
    for name, epi, (k, n), ta, tb, loads in progs:
        if only is not None and name not in only:
            continue
        m = d if ta else M  # the wgrad GEMM's rows are the norm's width
        a = r.normal((k, m) if ta else (m, k))
        b = r.normal((n, k) if tb else (k, n))
        flops = 2 * m * k * n
        for label, e in (("identity", programs.IDENTITY), (name, epi)):
            for vname in names:
                if e is not epi and (VARIANTS[vname].epilogue_regs != _D.epilogue_regs
                                     or VARIANTS[vname].epilogue_load_slots != _D.epilogue_load_slots):
                    continue  # the identity GEMM has no epilogue to narrow
                row = {"program": label, "k": k, "n": n, "m": m, "variant": vname}
                record(_time_program(row, VARIANTS[vname], e, a, b, loads if e is epi else {}, ta, tb, flops,
                                     args.iters))
                if "ms" in row:
                    print(f"SWEEP {label:18s} {vname:18s} {row['kernel_ms']:.3f} ms {row['kernel_tflops']:.0f} "
                          f"TFLOP/s (wall {row['ms']:.3f})", flush=True)


def mainloop_sweep(args, record):
    """The identity GEMM under tile-order / cluster variants, next to cuBLAS (``jnp.dot``)
    and the JAX-shipped kernel, CUPTI-timed: where the mainloop loses to cuBLAS."""
    names = args.variants.split(",") if args.variants else MAINLOOP_VARIANTS
    k0, n0 = SHAPES[0]
    cases = [(k, n, "fwd") for k, n in SHAPES] + [(k0, n0, "dgrad"), (k0, n0, "wgrad")]
    if args.cases:
        cases = [(int(k), int(n), layout) for layout, k, n in (c.split(":") for c in args.cases.split(","))]
    for k, n, layout in cases:
        ta, tb = LAYOUTS[layout]
        m = k if ta else M  # wgrad: [d, tokens] @ [tokens, n]
        kk = M if ta else k
        flops = 2 * m * kk * n
        a, b = _operands(m, kk, n, ta, tb)
        base = {"m": m, "k": kk, "n": n, "layout": layout}

        def report(impl, fn, fargs):
            row = {**base, "impl": impl}
            try:
                row["kernel_ms"] = kernel_ms(fn, *fargs, iters=2 * args.iters)
                row["kernel_tflops"] = flops / row["kernel_ms"] / 1e9
                print(f"MAINLOOP {layout:5s} k={kk:5d} n={n:5d} {impl:22s} {row['kernel_ms']:.3f} ms "
                      f"{row['kernel_tflops']:.0f} TFLOP/s", flush=True)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"MAINLOOP {layout:5s} k={kk:5d} n={n:5d} {impl:22s} {row['error'][:120]}", flush=True)
            record(row)
            return row

        cublas = report("jnp.dot", _cublas_fn(ta, tb), (a, b))
        if layout == "fwd":
            for ename, kw in JAX_EXAMPLE.items():
                report(ename, jax.jit(functools.partial(_jax_example, **kw)), (a, b))
        ours = []
        for vname in names:
            ours.append(report(vname, _kernel_fn(VARIANTS[vname], programs.IDENTITY, ta, tb), (a, b, {})))
        done = [r for r in ours if "kernel_ms" in r]
        if done and "kernel_ms" in cublas:
            w = min(done, key=lambda r: r["kernel_ms"])
            print(f"BEST {layout} k={kk} n={n}: {w['impl']} {w['kernel_tflops']:.0f} TFLOP/s "
                  f"({cublas['kernel_ms'] / w['kernel_ms']:.2f}x cuBLAS)", flush=True)


def plain_sweep(args, record):
    """The block's plain (identity-epilogue) backward GEMMs at d=2048 and 4096 on XLA's GEMM
    (cuBLAS, bf16 out) and on the Pallas kernel, CUPTI-timed: the data behind
    ``PallasLowering``'s plain-GEMM route."""
    for d, f in ((2048, 8192), (4096, 14336)):
        gemms = [  # (name, rows, K, N, transpose_a, transpose_b)
            ("o_proj_dgrad", M, d, d, False, True),
            ("o_proj_wgrad", d, M, d, True, False),
            ("down_wgrad", f, M, d, True, False),
        ]
        for name, m, k, n, ta, tb in gemms:
            a, b = _operands(m, k, n, ta, tb)
            flops = 2 * m * k * n
            routes = {"xla": (_cublas_fn(ta, tb), (a, b)),
                      "pallas": (_kernel_fn(_D, programs.IDENTITY, ta, tb), (a, b, {}))}
            for route, (fn, fargs) in routes.items():
                row = {"d": d, "gemm": name, "m": m, "k": k, "n": n, "route": route}
                row["kernel_ms"] = kernel_ms(fn, *fargs, iters=2 * args.iters)
                row["kernel_tflops"] = flops / row["kernel_ms"] / 1e9
                record(row)
                print(f"PLAIN d={d} {name:13s} [{m}x{k}]x[{k}x{n}] {route:6s} {row['kernel_ms']:.3f} ms "
                      f"{row['kernel_tflops']:.0f} TFLOP/s", flush=True)


def op_step(spec: str):
    """``(fwd+bwd, args)`` of one fused op of the op benchmark on Pallas, for
    ``"op:norm_matmul:2048"`` (``op:name:d``), as ``bench.py --parts ops`` times it: the op's
    first output weighted by a random cotangent (:func:`bench.timed_fwd_bwd`)."""
    from benchmarks.bench import WIDTHS, op_cases, random_cotangent, timed_fwd_bwd

    try:
        _, name, d = spec.split(":")
        d = int(d)
        cases = {c[0]: c for c in op_cases(d)} if d in WIDTHS else None
        _, fused, _, args, argnums, plain = cases[name]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--model {spec!r}: expected op:name:d with d in {sorted(WIDTHS)} and a name of "
                         "bench.op_cases") from e
    fn = fused("pallas")
    return timed_fwd_bwd(fn, argnums), (*args, random_cotangent(plain, args))


# --model suffixes for a step in FP8: the Fp8Recipe fields each sets.
FP8_MODEL_SUFFIXES = {":fp8": {}, ":fp8-head": {"lm_head": True}, ":fp8-zq8": {"swiglu_input": "e4m3"}}


def model_step(spec: str):
    """``(train_step, (state, inputs, targets))`` of CodaLlama on Pallas for ``"1b:8:1024"``
    or ``"8b-4:4:1024"`` (preset[-layers]:batch:seq; ``"1b:8:1024:fp8"``: in FP8, ``":fp8-head"``: with
    the LM head in FP8), as
    ``benchmarks/train_step_bench.py`` runs it, with abstract state (nothing is allocated); ``"op:name:d"``: one fused op of
    the op benchmark (:func:`op_step`)."""
    if spec.startswith("op:"):
        return op_step(spec)
    from flax import nnx

    from coda_jax import training
    from coda_jax.layers import PRESETS, CodaLlama

    # the step in FP8 (LlamaConfig.fp8): its FP8 kernel calls; ":fp8-head": the LM head's too;
    # ":fp8-zq8": the SwiGLU input saved in e4m3 (its own z-writing and z-reading programs)
    suffix = next((s for s in FP8_MODEL_SUFFIXES if spec.endswith(s)), None)
    try:
        preset_layers, batch, seq = (spec.removesuffix(suffix) if suffix else spec).split(":")
        preset, _, layers = preset_layers.partition("-")
        cfg = PRESETS[preset]()
        batch, seq = int(batch), int(seq)
    except (ValueError, KeyError) as e:
        raise ValueError(f"--model {spec!r}: expected preset[-layers]:batch:seq[{'|'.join(FP8_MODEL_SUFFIXES)}] "
                         f"with a preset of {sorted(PRESETS)}") from e
    if layers:
        cfg = cfg.replace(num_layers=int(layers))
    if suffix:
        from coda_jax.fp8 import Fp8Recipe

        cfg = cfg.replace(fp8=Fp8Recipe(**FP8_MODEL_SUFFIXES[suffix]))

    def build():
        model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend="pallas")
        return model, nnx.Optimizer(model, training.adamw_cosine(3e-4, 10, 1000), wrt=nnx.Param)

    model, opt = nnx.eval_shape(build)
    train_step, _, _ = training.make_steps(model, opt)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return train_step, (nnx.state((model, opt)), tokens, tokens)


def model_sweep(args, out: Path):
    """Autotunes the training steps of ``args.model`` and writes the merged table."""
    name = table_file_name(jax.devices()[0].device_kind)
    if args.table == "none":
        table_path = None
    else:
        table_path = Path(args.table) if args.table else next((p for p in SHIPPED_TABLES if p.name == name), None)
    table = json.loads(table_path.read_text()) if table_path and table_path.exists() else None
    rows = json.loads(Path(args.resume).read_text()) if args.resume else []  # calls measured before: not again
    names = args.variants.split(",") if args.variants else None
    log = functools.partial(print, flush=True)
    # --heat: every candidate timed at the power-capped clock of a training step
    timer = functools.partial(at.sustained_kernel_ms, heat_s=args.heat, log=log) if args.heat else at.kernel_ms
    for spec in args.model:
        step, step_args = model_step(spec)
        new = at.autotune(step, *step_args, names=names, iters=2 * args.iters, budget_s=args.budget,
                          rows=rows, log=log, timer=timer,
                          incumbent=at.incumbents(table) if args.with_incumbents else None,
                          skip_programs=tuple(p for p in args.skip_programs.split(",") if p),
                          only_programs=tuple(p for p in args.programs.split(",") if p),
                          skip_keys=at.table_keys(table) if args.untuned_only else frozenset(),
                          neighbours=tuple(x for x in args.neighbours.split(",") if x))
        if args.heat:
            new["heat_s"] = args.heat
        table = at.merge_tables(table, new)
        at.write_table(table, out / name, merge=False)
        (out / "tune_model.json").write_text(json.dumps(rows, indent=1))
        for e in new["entries"]:
            print(f"TUNED {spec} {e['program']:18s} {e['layout']} {e['m']}x{e['n']}x{e['k']}{at.key_suffix(e)} "
                  f"{e['candidate']:18s} "
                  f"{e['ms']:.4f} ms vs heuristic {e['heuristic_ms']:.4f} ms "
                  f"({e['heuristic_ms'] / e['ms']:.3f}x)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_out")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--epilogue-sweep", action="store_true", help="the block's fused GEMMs under epilogue variants")
    ap.add_argument("--programs", default="", help="--epilogue-sweep, --model: only these programs (comma-separated names)")
    ap.add_argument("--heat", type=float, default=0.0,
                    help="--model: call each candidate back to back for this many seconds before timing it, so it "
                         "is timed at the power-capped clock a training step runs at (0: timed from idle)")
    ap.add_argument("--mainloop", action="store_true", help="identity GEMM: tile order / cluster variants vs cuBLAS")
    ap.add_argument("--plain", action="store_true", help="the block's plain backward GEMMs: cuBLAS vs the kernel")
    ap.add_argument("--cases", default="", help="--mainloop: layout:K:N cases in place of the default ones, "
                    "e.g. fwd:2048:8192,dgrad:2048:8320 (M = 8192 tokens)")
    ap.add_argument("--variants", default="", help="comma-separated names of VARIANTS for --mainloop / --epilogue-sweep "
                    "(of coda_jax.pallas.autotune.CANDIDATES for --model)")
    ap.add_argument("--model", action="append", default=[],
                    help="autotune this CodaLlama training step: preset[-layers]:batch:seq, or one fused op of "
                         "the op benchmark: op:name:d (repeatable)")
    ap.add_argument("--table", default=None, help="--model: the table to merge into (default: the shipped one "
                    "for this GPU; 'none': start empty)")
    ap.add_argument("--budget", type=float, default=None, help="--model: seconds per model before it stops tuning")
    ap.add_argument("--untuned-only", action="store_true",
                    help="--model: tune only the GEMMs the table merged into has no entry for (new programs "
                         "or shapes, first, where device time is short)")
    ap.add_argument("--with-incumbents", action="store_true",
                    help="--model: also time each GEMM's winner in the table merged into (so a sweep of "
                         "other --variants keeps the best of both)")
    ap.add_argument("--neighbours", default="",
                    help="--model: comma-separated overrides, each field=value[+field=value], that every GEMM also "
                         "tries on its table's winner (with --with-incumbents) and on its heuristic configuration, "
                         "e.g. grid_tile_width=8,grid_tile_width=16,grid_minor_dim=m; alone, only those are timed")
    ap.add_argument("--skip-programs", default="", help="--model: comma-separated epilogue names not to tune")
    ap.add_argument("--resume", default=None, help="--model: an earlier tune_model.json; its calls that have every wanted candidate are not measured again")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "tune.json").write_text(json.dumps(rows, indent=1))

    if args.model:
        model_sweep(args, out)
    if not (args.epilogue_sweep or args.plain or args.model):
        args.mainloop = True
    if args.plain:
        plain_sweep(args, record)
    if args.mainloop:
        mainloop_sweep(args, record)
    if args.epilogue_sweep:
        epilogue_sweep(args, record)


if __name__ == "__main__":
    main()
