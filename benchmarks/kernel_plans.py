"""What each Pallas kernel call of a training step runs as, per configuration, without a GPU.

    python3 -m benchmarks.kernel_plans --model 1b:8:1024 --variants table,heuristic,one_out_slot,direct_loads

A configuration asks for a pipeline depth and an epilogue chunk width; ``plan_kernel`` fits
them to the SM's shared memory beside the epilogue's staging (fewer stages, narrower chunks,
fewer load slots, or the single-warpgroup kernel). This prints, for every distinct kernel call
of the step (``--model`` as in ``tune.py``: ``preset[-layers]:batch:seq`` or ``op:name:d``),
what each variant becomes on an H100 (132 SMs): schedule, operand stages, chunk width, load
slots and output slots. Variants: ``table`` (the shipped tuned table's entry for an H100, else
the heuristics), ``heuristic`` (the heuristics alone: shape class, per-program changes, wave
fit) and the autotuner's candidate names (:func:`coda_jax.pallas.autotune.resolve_candidate`:
known candidates, with ``+field=value`` overrides, also of ``heuristic``).

It needs no GPU: the step is traced abstractly with the Pallas backend in interpret mode
(set here), and only the plans are computed. The cross-entropy keeps its logits, as on the
H100 at the presets' batches (``--options cross_entropy.save_logits=false`` shows the
recompute path; ``--options`` takes any :func:`coda_jax.options.parse_overrides` string). Use
it before spending device time on a sweep:
a candidate that plans to the same kernel as the incumbent need not be timed.
"""

from __future__ import annotations

import argparse
import contextlib

H100_KIND, H100_SMS = "NVIDIA H100 80GB HBM3", 132
# While tracing: the cross-entropy keeping its logits, as it does on an H100 at the presets'
# batches (1/8 of its memory; on a CPU the memory is unknown).
TRACE_OPTIONS = {"cross_entropy": {"save_logits": True}}


@contextlib.contextmanager
def trace_settings(overrides: dict | None = None):
    """Within: the Pallas backend in interpret mode (it traces on a CPU), the options of
    :data:`TRACE_OPTIONS`, then ``overrides`` (keyword arguments of
    :func:`coda_jax.options.options`)."""
    from coda_jax.options import options
    from coda_jax.pallas.interpret import interpret_mode

    with interpret_mode(), options(**TRACE_OPTIONS), options(**(overrides or {})):
        yield


def variant_config(name: str, call, num_sms: int = H100_SMS):
    """The configuration variant ``name`` asks for on ``call`` (before planning), or None where
    it cannot run the call (a candidate whose tile or K step does not fit it)."""
    from coda_jax.epilogue import FP8_DTYPES
    from coda_jax.pallas import autotune as at
    from coda_jax.pallas.lowering import table_or_heuristic_config

    if name in ("heuristic", "table"):
        m, n, k = call.mnk
        # FP8 operands: the FP8 heuristics and K step, as the lowering picks them
        return table_or_heuristic_config(call.epilogue, m, n, k, call.transpose_a, call.transpose_b,
                                         H100_KIND if name == "table" else None, num_sms,
                                         fp8_operands=call.a.dtype in FP8_DTYPES, promote_k=call.promote_k,
                                         loads=dict(call.loads))
    return at.candidate_configs(call, [name]).get(name)


def describe(cfg) -> str:
    """``coop 3st 16c 2l 2o`` (schedule, operand stages, chunk columns, load slots, output
    slots), ``1wg ...`` for the single-warpgroup kernel; a CTA tile other than 128 x 256 and
    a direct-load/store or ring setting are appended."""
    sched = ("pp" if cfg.pingpong else "coop") if cfg.warp_specialized else "1wg"
    out = f"{sched} {cfg.max_concurrent_steps}st {cfg.epilogue_cols}c {cfg.epilogue_load_slots}l {cfg.epilogue_out_slots}o"
    cm, cn = cfg.cta_tile()
    if (cm, cn) != (128, 256):
        out += f" {cm}x{cn}"
    extras = [x for x, on in (("ring", cfg.delay_release), ("dl", cfg.direct_loads), ("ds", cfg.direct_stores)) if on]
    return out + (" " + "+".join(extras) if extras else "")


def plans(spec: str, variants: list[str], num_sms: int = H100_SMS, overrides: dict | None = None) -> list[dict]:
    """One row per distinct kernel call of ``spec``'s step: program, layout, M x N x K and
    each variant's planned configuration (:func:`describe`; ``-`` where it cannot run).
    ``overrides``: options the step is traced under (:func:`trace_settings`)."""
    from benchmarks.tune import model_step
    from coda_jax.pallas import autotune as at
    from coda_jax.pallas.tuned import layout_name

    with trace_settings(overrides):
        fn, args = model_step(spec)
        calls = at.kernel_calls(fn, *args)
    rows = []
    for call in calls:
        m, n, k = call.mnk
        row = {"program": call.epilogue.name, "layout": layout_name(call.transpose_a, call.transpose_b),
               "mnk": f"{m}x{n}x{k}"}
        for name in variants:
            cfg = variant_config(name, call, num_sms)
            row[name] = "-" if cfg is None else describe(at.planned_config(call, cfg, num_sms))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="preset[-layers]:batch:seq or op:name:d")
    ap.add_argument("--variants", default="table,heuristic,default,one_out_slot",
                    help="comma-separated: table, heuristic, or candidate names of coda_jax.pallas.autotune")
    ap.add_argument("--options", default="",
                    help="coda-jax options the step is traced under, e.g. cross_entropy.save_logits=false "
                         "(coda_jax.options.parse_overrides)")
    args = ap.parse_args(argv)
    from coda_jax.options import OptionError, parse_overrides
    from coda_jax.pallas.autotune import candidate_name_errors

    try:
        overrides = parse_overrides(args.options, source="--options")
    except OptionError as e:
        ap.error(str(e))

    variants = [v for v in args.variants.split(",") if v]
    errors = candidate_name_errors(variants, also=("table", "heuristic"))
    if errors:
        ap.error("--variants: " + "; ".join(errors))
    for spec in args.model:
        rows = plans(spec, variants, overrides=overrides)
        print(f"\n{spec}: planned configuration per kernel call (schedule, stages, chunk columns, "
              "load slots, output slots)\n")
        print("| program | layout | M x N x K | " + " | ".join(variants) + " |")
        print("|---|---|---|" + "---|" * len(variants))
        for r in rows:
            print(f"| {r['program']} | {r['layout']} | {r['mnk']} | " + " | ".join(r[v] for v in variants) + " |")


if __name__ == "__main__":
    main()
