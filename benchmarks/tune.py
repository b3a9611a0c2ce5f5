"""Sweeps TuningConfig candidates of the Pallas GEMM-epilogue kernel on the H100.

    python benchmarks/tune.py [--out DIR] [--quick]

For M=8192 tokens and the Llama (K, N) pairs, in the three operand layouts a training step
uses (forward ``a @ b``, dgrad ``a @ b^T``, wgrad ``a^T @ b``), times the identity-epilogue
kernel under every candidate (skipping those that do not fit in SMEM), and two fused
programs (``residual_rms``, ``rms_swiglu_train``) under the best candidates, next to
``jnp.dot`` and the JAX-shipped Hopper matmul (``hopper_matmul_mgpu``, forward layout
only) as yardsticks, all in the same process. Prints one line per measurement and the
winners; copy them into ``coda_jax/pallas/tuning.py``'s ``CONFIG_TABLE``. Results go to
``<out>/tune.json``.

``--mainloop``: instead, the identity GEMM under tile-order and cluster variants (VARIANTS) next
to cuBLAS and the JAX-shipped kernel, timed by CUPTI (kernel time only).

``--epilogue-sweep``: instead, the block's fused GEMMs at d=2048 (forward, dgrad and wgrad
programs at their real shapes) under the table's configuration and its epilogue variants
(chunk register budget, swizzled staging), each next to the identity GEMM of the same shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import Inputs, median_ms  # noqa: E402
from coda_jax import programs  # noqa: E402
from coda_jax.pallas.gemm_epilogue import KernelShape, plan_kernel  # noqa: E402
from coda_jax.pallas.lowering import PallasLowering  # noqa: E402
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig  # noqa: E402

M = 8192
SHAPES = [(2048, 8192), (4096, 14336), (8192, 28672), (2048, 16384)]  # (K, N)
LAYOUTS = {"fwd": (False, False), "dgrad": (False, True), "wgrad": (True, False)}
_WS = TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, warp_specialized=True)
CANDIDATES = {
    "single_wg_128x128_s4": TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4),
    "ws_m_s4": _WS,
    "ws_n_s4": dataclasses.replace(_WS, wg_dimension="n"),
    "ws_n_s4_gw8": dataclasses.replace(_WS, wg_dimension="n", grid_tile_width=8),
    "ws_n_s4_swizzled": dataclasses.replace(_WS, wg_dimension="n", swizzle_epilogue=True),
    "ws_n_64x128_s6": TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=6, warp_specialized=True,
                                   wg_dimension="n"),
}
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
}
MAINLOOP_VARIANTS = ["default", "no_cluster", "gw8", "minor_m", "minor_m_gw8", "cluster_m_minor_m", "cluster_n",
                     "split_m", "split_m_cluster_n"]


def kernel_ms(fn, *args, iters: int = 20) -> float:
    """Median GPU time of one call (CUPTI: the sum of its kernels' durations, no launch gaps)."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, times = profiler.measure(fn, iterations=iters)(*args)
    return statistics.median(times)


def _planned(epi, m, k, n, ta, tb, cfg, out_dtypes):
    shape = KernelShape(m=m, n=n, k=k, m_real=m, n_real=n, transpose_a=ta, transpose_b=tb,
                        operand_dtype=jnp.dtype(jnp.bfloat16), out_dtypes=out_dtypes, num_sms=jax.devices()[0].core_count)
    return plan_kernel(epi, shape, cfg, ())


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


def _time_program(row, cfg, epi, a, b, loads, ta, tb, flops, iters):
    """``row`` with the program's time on the Pallas kernel under ``cfg`` (or the error)."""
    try:
        low = PallasLowering(cfg, plain_gemm="pallas")
        fn = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, transpose_a=ta, transpose_b=tb))
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
         {"x": r.normal((m, d)), "rstd": rstd, "zdz": r.normal((m,), 0.1, 0.0, f32),
          "gamma": r.normal((d,), 0.1, 1.0, f32), "dres": r.normal((m, d))}),
        ("swiglu_dgrad", programs.SWIGLU_DGRAD, (d, f), False, True, {"z": r.normal((m, 2 * f))}),
        ("norm_wgrad", programs.NORM_WGRAD, (m, 2 * f), True, False,  # A^T = x_hat [tokens, d]
         {"gamma": r.normal((d,), 0.1, 1.0, f32), "w": r.normal((d, 2 * f))}),
    ], r, d


def epilogue_sweep(args, record):
    """The block's fused GEMMs under ``args.variants``, each next to the identity GEMM of its
    shape under the same variants."""
    names = args.variants.split(",") if args.variants else ["default", "wide_chunks", "regs_64", "swizzled"]
    progs, r, d = block_programs()
    for name, epi, (k, n), ta, tb, loads in progs:
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
    cases = [(k, n, "fwd") for k, n in SHAPES[:2]] + [(k0, n0, "dgrad"), (k0, n0, "wgrad")]
    for k, n, layout in cases:
        ta, tb = LAYOUTS[layout]
        m = k if ta else M  # wgrad: [d, tokens] @ [tokens, n]
        kk = M if ta else k
        flops = 2 * m * kk * n
        r = Inputs(kk + n)
        a = r.normal((kk, m) if ta else (m, kk))
        b = r.normal((n, kk) if tb else (kk, n))
        dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
        # bf16 out, f32 accumulation (cuBLAS's own epilogue converts): the GEMM XLA emits in a model.
        dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims))
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

        report("jnp.dot", dot, (a, b))
        if layout == "fwd":
            for ename, kw in JAX_EXAMPLE.items():
                report(ename, jax.jit(functools.partial(_jax_example, **kw)), (a, b))
        for vname in names:
            low = PallasLowering(VARIANTS[vname], plain_gemm="pallas")
            fn = jax.jit(lambda a, b, low=low: low.gemm(programs.IDENTITY, a, b, {}, transpose_a=ta,
                                                        transpose_b=tb)["out"])
            report(vname, fn, (a, b))


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
            r = Inputs(m + k + n)
            a = r.normal((k, m) if ta else (m, k))
            b = r.normal((n, k) if tb else (k, n))
            flops = 2 * m * k * n
            dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
            routes = {"xla": jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims))}
            low = PallasLowering(_D, plain_gemm="pallas")
            routes["pallas"] = jax.jit(lambda a, b, low=low: low.gemm(programs.IDENTITY, a, b, {}, transpose_a=ta,
                                                                      transpose_b=tb)["out"])
            for route, fn in routes.items():
                row = {"d": d, "gemm": name, "m": m, "k": k, "n": n, "route": route}
                row["kernel_ms"] = kernel_ms(fn, a, b, iters=2 * args.iters)
                row["kernel_tflops"] = flops / row["kernel_ms"] / 1e9
                record(row)
                print(f"PLAIN d={d} {name:13s} [{m}x{k}]x[{k}x{n}] {route:6s} {row['kernel_ms']:.3f} ms "
                      f"{row['kernel_tflops']:.0f} TFLOP/s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune_out")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="first two shapes only")
    ap.add_argument("--epilogue-sweep", action="store_true", help="the block's fused GEMMs under epilogue variants")
    ap.add_argument("--mainloop", action="store_true", help="identity GEMM: tile order / cluster variants vs cuBLAS")
    ap.add_argument("--plain", action="store_true", help="the block's plain backward GEMMs: cuBLAS vs the kernel")
    ap.add_argument("--variants", default="", help="comma-separated names of VARIANTS for the two sweeps above")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / "tune.json").write_text(json.dumps(rows, indent=1))

    if args.epilogue_sweep or args.mainloop or args.plain:
        if args.plain:
            plain_sweep(args, record)
        if args.mainloop:
            mainloop_sweep(args, record)
        if args.epilogue_sweep:
            epilogue_sweep(args, record)
        return

    for k, n in SHAPES[:2] if args.quick else SHAPES:
        flops = 2 * M * k * n
        for layout, (ta, tb) in LAYOUTS.items():
            r = Inputs(k + n)
            a = r.normal((k, M) if ta else (M, k))
            b = r.normal((n, k) if tb else (k, n))
            base = {"k": k, "n": n, "layout": layout}
            dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
            dot = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
                          .astype(jnp.bfloat16))
            ref = dot(a, b)
            dot_ms = median_ms(dot, a, b, iters=args.iters)
            record({**base, "impl": "jnp.dot", "ms": dot_ms, "tflops": flops / dot_ms / 1e9})
            if layout == "fwd":
                try:
                    ex = jax.jit(_jax_example)
                    ms = median_ms(ex, a, b, iters=args.iters)
                    record({**base, "impl": "jax_example_128x256_wgN_s4", "ms": ms, "tflops": flops / ms / 1e9,
                            "vs_dot": dot_ms / ms})
                except Exception as e:
                    record({**base, "impl": "jax_example", "error": f"{type(e).__name__}: {str(e)[:200]}"})
            for name, cfg in CANDIDATES.items():
                row = {**base, "impl": name}
                try:
                    planned = _planned(programs.IDENTITY, M, k, n, ta, tb, cfg, (("out", jnp.dtype(jnp.bfloat16)),))
                    row["planned"] = {f: getattr(planned, f) for f in ("tile_m", "max_concurrent_steps",
                                                                        "warp_specialized", "wg_dimension")}
                    low = PallasLowering(cfg, plain_gemm="pallas")
                    f = jax.jit(lambda a, b, low=low: low.gemm(programs.IDENTITY, a, b, {}, transpose_a=ta,
                                                               transpose_b=tb)["out"])
                    got = f(a, b)
                    row["rel_err"] = float(jnp.linalg.norm((got - ref).astype(jnp.float32))
                                           / jnp.linalg.norm(ref.astype(jnp.float32)))
                    row["ms"] = median_ms(f, a, b, iters=args.iters)
                    row["tflops"] = flops / row["ms"] / 1e9
                    row["vs_dot"] = dot_ms / row["ms"]
                except Exception as e:  # SMEM overflow, lowering failures: record and go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                record(row)
        # Fused programs (forward layout) under each candidate, against the identity GEMM.
        r = Inputs(n)
        a, b = r.normal((M, k)), r.normal((k, n))
        fused = {
            "residual_rms": (programs.RESIDUAL_RMS, {"residual": r.normal((M, n)),
                                                     "gamma": r.normal((n,), 0.1, 1.0, jnp.float32)}),
            "rms_swiglu_train": (programs.rms_swiglu(True), {"rstd": r.normal((M,), 0.1, 1.0, jnp.float32)}),
        }
        for pname, (epi, loads) in fused.items():
            for name, cfg in CANDIDATES.items():
                row = {"k": k, "n": n, "layout": "fwd", "program": pname, "impl": name}
                record(_time_program(row, cfg, epi, a, b, loads, False, False, flops, args.iters))
    best = {}
    for row in rows:
        if "ms" in row and row["impl"] in CANDIDATES:
            key = (row["k"], row["n"], row["layout"], row.get("program", "identity"))
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
    for key, row in sorted(best.items()):
        vs = f" ({row['vs_dot']:.2f}x jnp.dot)" if "vs_dot" in row else ""
        print(f"BEST k={key[0]} n={key[1]} {key[2]} {key[3]}: {row['impl']} {row['tflops']:.0f} TFLOP/s{vs}", flush=True)

if __name__ == "__main__":
    main()
