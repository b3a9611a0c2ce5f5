"""Static instruction counts of a training step's Pallas kernels, per configuration, without a GPU.

    python -m benchmarks.kernel_module_stats --model 1b-2:8:1024:fp8 --programs swiglu_dgrad_q8_fp8 \
        --variants pingpong_minor_m,pingpong_minor_m_manual,pingpong_minor_m_bytes,pingpong_minor_m_lean

Each distinct kernel call of the step (``--model`` as in ``benchmarks/tune.py``; ``--programs``
keeps those epilogues) is lowered for CUDA on the CPU under each configuration variant
(``table``, ``heuristic`` or an autotuner candidate, :func:`coda_jax.pallas.autotune.resolve_candidate`),
and the Mosaic GPU module that Pallas hands to Mosaic GPU (before LLVM's optimizations) is
counted: warpgroup barriers, lane shuffles, selects, FP8 pair casts, byte permutes, float
multiplies and adds, NaN-propagating maxes, and lines. A consumer's epilogue is emitted once
per tile, so the counts compare what one tile's epilogue issues under each variant. They are
not times: a kernel's speed is measured on the GPU (``benchmarks/tune.py``). Reads the module
through Mosaic GPU's ``_run_serde_pass`` (an internal of ``jax.experimental.mosaic.gpu``).
"""

from __future__ import annotations

import argparse
import contextlib

# What is counted: name -> substring of the module's text.
COUNTS = {
    "bar.sync": "bar.sync",
    "shfl": "nvvm.shfl.sync",
    "select": "arith.select",
    "fp8 cast": "satfinite.e",
    "prmt": "prmt.b32",
    "mulf": "arith.mulf",
    "addf": "arith.addf",
    "max": "max.NaN.f32",
}


@contextlib.contextmanager
def captured_modules():
    """Within: the text of every Mosaic GPU module lowered (appended to the yielded list)."""
    import jax.experimental.mosaic.gpu.core as mgpu_core

    if not hasattr(mgpu_core, "_run_serde_pass"):
        raise RuntimeError("this jax's Mosaic GPU has no _run_serde_pass: the module cannot be read")
    modules: list[str] = []
    serde = mgpu_core._run_serde_pass

    def spy(module, *, serialize, **kw):
        if serialize:
            modules.append(str(module))
        return serde(module, serialize=serialize, **kw)

    mgpu_core._run_serde_pass = spy
    try:
        yield modules
    finally:
        mgpu_core._run_serde_pass = serde


def module_counts(text: str) -> dict[str, int]:
    """:data:`COUNTS` in a module's text, and its lines."""
    return {**{k: text.count(v) for k, v in COUNTS.items()}, "lines": text.count("\n")}


def call_module(call, cfg) -> str:
    """The Mosaic GPU module of kernel call ``call`` (:class:`coda_jax.pallas.kernel_calls.KernelCall`)
    under configuration ``cfg``, lowered for CUDA."""
    import jax

    from coda_jax.options import options
    from coda_jax.pallas import interpret_mode
    from coda_jax.pallas.lowering import PallasLowering

    low = PallasLowering(cfg, plain_gemm="kernel")
    out_dtypes = dict(call.out_dtypes) or None

    def gemm(a, b, loads):
        return low.gemm(call.epilogue, a, b, loads, transpose_a=call.transpose_a, transpose_b=call.transpose_b,
                        out_dtypes=out_dtypes, promote_k=call.promote_k)

    # No kernel cache: a module read from disk is not lowered, so it would not be seen.
    with interpret_mode(False), options(kernel_cache={"directory": "off"}), captured_modules() as modules:
        jax.jit(gemm).trace(call.a, call.b, dict(call.loads)).lower(lowering_platforms=("cuda",))
    if len(modules) != 1:
        raise RuntimeError(f"{call.epilogue.name}: expected one kernel module, got {len(modules)}")
    return modules[0]


def stats(spec: str, variants: list[str], programs: set[str] | None = None) -> list[dict]:
    """One row per (distinct kernel call of ``spec``'s step, variant): program, layout,
    M x N x K, the variant and its :func:`module_counts` (or ``error``)."""
    from benchmarks.kernel_plans import trace_settings, variant_config
    from benchmarks.tune import model_step
    from coda_jax.pallas import autotune as at
    from coda_jax.pallas.tuned import layout_name

    with trace_settings():
        fn, args = model_step(spec)
        calls = at.kernel_calls(fn, *args)
    rows = []
    for call in calls:
        if programs and call.epilogue.name not in programs:
            continue
        m, n, k = call.mnk
        for name in variants:
            row = {"program": call.epilogue.name, "layout": layout_name(call.transpose_a, call.transpose_b),
                   "mnk": f"{m}x{n}x{k}", "variant": name}
            cfg = variant_config(name, call)
            if cfg is None:
                row["error"] = "the variant cannot run this call"
            else:
                try:
                    row.update(module_counts(call_module(call, cfg)))
                except Exception as e:  # a configuration that does not lower: say so, go on
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="preset[-layers]:batch:seq[:fp8] or op:name:d (as tune.py)")
    ap.add_argument("--programs", default="", help="comma-separated epilogue names to keep (default: all)")
    ap.add_argument("--variants", default="table,heuristic",
                    help="comma-separated: table, heuristic, or candidate names of coda_jax.pallas.autotune")
    args = ap.parse_args(argv)
    from coda_jax.pallas.autotune import candidate_name_errors

    variants = [v for v in args.variants.split(",") if v]
    errors = candidate_name_errors(variants, also=("table", "heuristic"))
    if errors:
        ap.error("--variants: " + "; ".join(errors))
    rows = stats(args.model, variants, {p for p in args.programs.split(",") if p} or None)
    cols = list(COUNTS) + ["lines"]
    print(f"\n{args.model}: the Mosaic GPU module of each kernel call, per variant (counts of its text)\n")
    print("| program | layout | M x N x K | variant | " + " | ".join(cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = [str(r.get(c, "")) for c in cols] if "error" not in r else [r["error"]] + [""] * (len(cols) - 1)
        print(f"| {r['program']} | {r['layout']} | {r['mnk']} | {r['variant']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
