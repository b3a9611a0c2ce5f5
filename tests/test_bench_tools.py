"""The benchmark harness on the CPU: interleaved timing, backend variants, a smoke run.

The numbers in ``benchmarks/RESULTS.md`` come from ``benchmarks/bench.py`` on the H100;
these tests check the harness's bookkeeping (which cases are sampled how often and in what
order, which settings a variant applies), not any timing.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from benchmarks import bench
from suite_options import suite_xla_flags

ROOT = Path(__file__).resolve().parents[1]


def test_interleaved_timing_samples_every_case_in_rotating_rounds():
    calls = []

    def case(name):
        def f(x):
            calls.append(name)
            return x

        return f, (1,)

    cases = {k: case(k) for k in ("a", "b", "c")}
    out = bench.interleaved_median_ms(cases, iters=6, rounds=3, warmup=2, min_sample_ms=0.0)
    assert set(out) == {"a", "b", "c"} and all(v >= 0.0 for v in out.values())
    warm = calls[:9]  # per case: 2 warm-up calls + 1 timed call that sizes the samples
    assert warm == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    timed = calls[9:]
    assert len(timed) == 3 * 6  # 6 samples per case, one call per sample (reps = 1 at min_sample_ms=0)
    # Round r starts at case r: a a b b c c | b b c c a a | c c a a b b
    assert timed == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]


def test_per_round_medians_are_taken_from_each_round():
    clock = iter(range(10_000))
    # A fake clock: each perf_counter call advances 1 s, so every sample of one call lasts 1 s;
    # case "b" makes two extra clock reads per call, so its samples last 3 s.
    import time as _time

    def tick():
        return float(next(clock))

    def case(extra):
        def f(x):
            for _ in range(extra):
                tick()
            return x

        return f, (1,)

    per_round = {}
    orig = _time.perf_counter
    try:
        bench.time.perf_counter = tick
        bench.interleaved_median_ms({"a": case(0), "b": case(2)}, iters=6, rounds=3, warmup=1,
                                    min_sample_ms=0.0, per_round=per_round)
    finally:
        bench.time.perf_counter = orig
    assert per_round == {"a": [1000.0] * 3, "b": [3000.0] * 3}


def test_backend_variant_runs_cutedsl_on_a_lowering_with_its_tuning():
    """``cutedsl@256s3`` runs the CuTeDSL ops on a lowering with that ``CuteDslTuning``
    (:func:`coda_jax.backend.use_lowering`) inside the block only; the lowering the benchmarks
    time keeps the tuning and runs plain GEMMs on its kernel."""
    from coda_jax.ffi.tuning import CuteDslTuning

    with bench.backend_variant("cutedsl@256s3") as base:
        assert base == "cutedsl"
        low = bench._kernel_lowering(base)
        assert low.tuning == CuteDslTuning(tile_n=256, max_stages=3) and low.plain_gemm == "kernel"
        with bench.backend_variant("cutedsl@s4"):  # the innermost variant wins
            assert bench._kernel_lowering("cutedsl").tuning == CuteDslTuning(max_stages=4)
        assert bench._kernel_lowering("cutedsl").tuning.max_stages == 3
    assert bench._kernel_lowering("cutedsl").tuning == CuteDslTuning()
    with bench.backend_variant("cutedsl@256g16p"):
        assert bench._kernel_lowering("cutedsl").tuning == CuteDslTuning(tile_n=256, group_m=16, schedule="pingpong")
    with bench.backend_variant("pallas") as base:
        assert base == "pallas" and bench._kernel_lowering(base).plain_gemm == "kernel"
    for bad in ("pallas@128", "cutedsl@x4", "cutedsl@g", "xla@untuned"):
        with pytest.raises(ValueError, match="backend variant"):
            with bench.backend_variant(bad):
                pass
    with pytest.raises(ValueError, match="tile_n must be 128, 256"):
        with bench.backend_variant("cutedsl@64"):
            pass


def test_backend_variant_switches_the_tuned_tables(tmp_path):
    """``pallas@untuned`` (no tuned table) and ``pallas@table=<path>`` (another table) set the
    option ``pallas.tuned_tables`` inside the block only."""
    from coda_jax.options import current_options
    from coda_jax.pallas.tuned import SHIPPED_TABLES, active_table_paths

    shipped = tuple(str(p) for p in SHIPPED_TABLES)
    assert active_table_paths() == shipped
    old = tmp_path / "old.json"
    old.write_text("{}")
    with bench.backend_variant(f"pallas@table={old}") as base:
        assert base == "pallas" and active_table_paths() == (str(old),)
    with bench.backend_variant("pallas@untuned") as base:
        assert base == "pallas" and active_table_paths() == ()
    assert active_table_paths() == shipped and current_options().pallas.tuned_tables == "shipped"


def test_plain_gemm_route_sets_the_routing_option():
    from coda_jax.options import current_options

    with bench.plain_gemm_route("pallas", "pallas"):
        assert current_options().routing.plain_gemm == "kernel"
    with bench.plain_gemm_route("pallas", None):
        assert current_options().routing.plain_gemm == "xla"
    assert [v[0] for v in bench.block_variants(["xla", "pallas", "cutedsl@s4"])] == [
        "xla", "pallas", "cutedsl@s4", "pallas+pallasplain", "cutedsl@s4+cutedslplain"]


def test_bench_smoke_runs_on_cpu(tmp_path):
    """``bench.py --smoke`` (tiny shapes, XLA) runs end to end and writes its table."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--smoke", "--backends", "xla",
                        "--parts", "ops", "--ops", "residual_rms,norm_matmul", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    assert "| residual_rms | 256 | xla |" in table and "| norm_matmul | 256 | xla |" in table
    assert "norm_swiglu" not in table  # --ops filters


def _all_consts(closed) -> list:
    """The constants of a closed jaxpr and of every jaxpr nested in its equations."""
    out = list(closed.consts)
    for eqn in closed.jaxpr.eqns:
        for v in eqn.params.values():
            if hasattr(v, "consts") and hasattr(v, "jaxpr"):
                out += _all_consts(v)
    return out


def test_timed_fwd_bwd_takes_its_cotangent_as_a_bf16_argument():
    """The op and block benchmarks weight the output by a cotangent passed in, in the
    output's dtype: closed over, it became a float32 constant that XLA folded into the
    backward (run 174: the RoPE backward read 200 MB where a model reads 50)."""
    import jax.numpy as jnp

    f = lambda x, w: (jnp.tanh(x @ w), x)  # noqa: E731  (a further output, returned beside the loss)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (16, 8), jnp.bfloat16)
    w = jax.random.normal(kw, (8, 32), jnp.bfloat16)
    cot = bench.random_cotangent(f, (x, w))
    assert cot.shape == (16, 32) and cot.dtype == jnp.bfloat16
    fb = bench.timed_fwd_bwd(f, (0, 1))
    assert not [c for c in _all_consts(jax.make_jaxpr(fb)(x, w, cot)) if getattr(c, "size", 1) >= cot.size], \
        "a cotangent-sized constant in the timed program"
    (_, rest), (dx, dw) = fb(x, w, cot)
    _, vjp = jax.vjp(lambda x, w: f(x, w)[0], x, w)
    want_dx, want_dw = vjp(cot)
    assert rest[0] is not None and dx.dtype == jnp.bfloat16
    for got, want in ((dx, want_dx), (dw, want_dw)):
        got, want = got.astype(jnp.float32), want.astype(jnp.float32)
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2


def test_repeat_probe_digest_sees_one_bit_and_one_swap():
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import repeat_probe

    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 48)), jnp.bfloat16)
    d = int(repeat_probe.digest(x))
    assert int(repeat_probe.digest(x)) == d
    bits = np.asarray(x).view(np.uint16).copy()
    bits[17, 5] ^= 1  # the last mantissa bit of one element
    assert int(repeat_probe.digest(jnp.asarray(bits.view(jnp.bfloat16)))) != d
    swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])  # same values, other positions
    assert int(repeat_probe.digest(swapped)) != d
    assert int(repeat_probe.digest(x.astype(jnp.float32))) != d
    with pytest.raises(ValueError, match="16 or 32 bits"):
        repeat_probe.digest(jnp.zeros(3, jnp.int8))


def test_repeat_probe_compare_names_the_first_differing_step(tmp_path):
    import json

    from benchmarks import repeat_probe

    base = {"fwd/block00/x": 1, "fwd/block01/x": 2, "fwd/loss": 3, "bwd/loss": 4, "grad/embed": 5,
            "grad/lm_head": 6, "grad/blocks/0/w": 7, "grad/blocks/1/w": 8, "loss_value": 1.5}
    files = []
    for i, changed in enumerate([{}, {"fwd/block01/x": 9, "grad/blocks/0/w": 9, "grad/embed": 9}, {}]):
        f = tmp_path / f"p{i}.json"
        f.write_text(json.dumps({"backend": "cutedsl", "in_process_repeatable": True, "in_process_differs": [],
                                 "digests": base | changed}))
        files.append(f)
    (tmp_path / "x.json").write_text(json.dumps({"backend": "xla", "in_process_repeatable": True,
                                                 "in_process_differs": [], "digests": base}))
    table = repeat_probe.compare(files + [tmp_path / "x.json"])
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    assert "3 of 8" in rows["cutedsl"] and "fwd/block01/x grad/blocks/0/w grad/embed" in rows["cutedsl"]
    assert "0 of 8" in rows["xla"]
    order = sorted(base.keys() - {"loss_value"}, key=repeat_probe.step_order)
    assert order == ["fwd/block00/x", "fwd/block01/x", "fwd/loss", "bwd/loss", "grad/lm_head",
                     "grad/blocks/1/w", "grad/blocks/0/w", "grad/embed"]


def test_compare_losses_reports_signed_differences_and_curves(tmp_path):
    import json

    from benchmarks import compare_losses

    dirs = []
    for name, loss in (("train_xla", [10.0] * 60), ("train_cutedsl", [10.0] * 6 + [9.9] * 54)):
        d = tmp_path / name
        d.mkdir()
        (d / "history.json").write_text(json.dumps({"step": list(range(60)), "loss": loss, "val_step": [60],
                                                    "val_loss": [loss[-1]]}))
        (d / "summary.json").write_text(json.dumps({"backend": name[6:], "tokens_per_s": 1.0, "mfu": None}))
        dirs.append(d)
    rows = compare_losses.compare(dirs)
    assert rows[1]["label"] == "cutedsl" and rows[1]["early_max_rel_diff"] == 0.0
    assert rows[1]["last_window_rel_diff"] == pytest.approx(-0.01) and rows[1]["val_rel_diff"] == pytest.approx(-0.01)
    compare_losses.main([str(d) for d in dirs] + ["--curves", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["cutedsl"]["loss"][6] == 9.9


def test_compare_losses_pools_reruns_across_calls(tmp_path, capsys):
    import json

    from benchmarks import compare_losses

    def run(level):
        return {"loss": [level] * 60, "val_step": [60], "val_loss": [level - 0.5], "summary": {}}

    (tmp_path / "a.json").write_text(json.dumps({"xla": run(6.0), "cutedsl": run(6.3), "xla_run2": run(6.2)}))
    (tmp_path / "b.json").write_text(json.dumps({"xla": run(6.1), "cutedsl_run2_x_run3": run(6.6)}))
    rows = {r["label"]: r for r in compare_losses.pooled([tmp_path / "a.json", tmp_path / "b.json"])}
    assert rows["xla"]["runs"] == 3 and rows["xla"]["loss_50_59"]["mean"] == pytest.approx(6.1)
    assert rows["xla"]["loss_50_59"]["sd"] == pytest.approx(0.1) and rows["xla"]["val_loss"]["min"] == pytest.approx(5.5)
    assert rows["cutedsl"]["runs"] == 1 and rows["cutedsl_run2_x"]["runs"] == 1  # only a trailing _runN is a rerun
    compare_losses.main(["--pool", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    out = capsys.readouterr().out
    assert "| cutedsl | 1 |" in out and "+3.28%" in out  # 6.3 vs the xla mean 6.1


def test_grad_error_probe_measures_the_bf16_rounding_of_a_training_step(capsys):
    """float32 compute on the xla backend is the reference up to summation order; bf16
    compute is off by its rounding (~1e-2): the probe's numbers separate the two."""
    import json

    from benchmarks import grad_error_probe

    assert grad_error_probe.gradient_kind("blocks/12/w_gu") == "w_gu"
    assert grad_error_probe.gradient_kind("final_norm") == "final_norm"
    common = ["--preset", "tiny", "--layers", "1", "--batch", "1", "--seq", "32", "--backends", "xla"]
    f32 = grad_error_probe.probe(grad_error_probe.parse_args(common + ["--dtype", "float32"]))
    bf16 = grad_error_probe.probe(grad_error_probe.parse_args(common + ["--dtype", "bfloat16"]))
    e32, e16 = f32["backends"]["xla"]["grad_rel_err"], bf16["backends"]["xla"]["grad_rel_err"]
    assert set(e16) >= {"w_qkv", "w_o", "w_gu", "w_down", "attn_norm", "mlp_norm", "embed", "final_norm"}
    assert all(v < 1e-4 for v in e32.values()), e32
    assert all(2e-3 < v < 5e-2 for v in e16.values()), e16
    bf16["backends"]["again"] = bf16["backends"]["xla"]
    out = grad_error_probe.table(json.loads(json.dumps(bf16)))
    assert "| gradient | xla | again | again / xla | again vs xla |" in out and "| w_gu |" in out
    assert "| 1.000 |" in out
    # FP8 (histories filled by one step first): off by FP8's rounding, an order above bf16's;
    # and each later run's distance from the first run's gradients.
    fp8 = grad_error_probe.probe(grad_error_probe.parse_args(
        common[:-1] + ["xla,xla:fp8", "--dtype", "float32"]))["backends"]["xla:fp8"]
    assert all(2e-2 < v < 0.5 for v in fp8["grad_rel_err"].values()), fp8
    assert fp8["grad_rel_err_vs_first"].keys() == fp8["grad_rel_err"].keys()
    with pytest.raises(SystemExit):
        grad_error_probe.parse_args(["--backends", "xla:fp16"])
    # The plain Llama's gradients under CodaLlama's names: in float32 the same as CodaLlama's up
    # to summation order; the plain FP8 baseline off by FP8's rounding.
    runs = grad_error_probe.probe(grad_error_probe.parse_args(
        common[:-1] + ["xla,plain,plain_fp8", "--dtype", "float32"]))["backends"]
    assert runs["plain"]["grad_rel_err_vs_first"].keys() == e32.keys()
    assert all(v < 1e-4 for v in runs["plain"]["grad_rel_err_vs_first"].values()), runs["plain"]
    assert all(2e-2 < v < 0.5 for v in runs["plain_fp8"]["grad_rel_err"].values()), runs["plain_fp8"]



@pytest.mark.filterwarnings("ignore:PGLE collected an empty trace")  # a CPU trace has no GPU kernels
def test_train_step_bench_runs_plain_and_coda_under_each_runs_options(tmp_path, monkeypatch):
    import json

    from benchmarks import train_step_bench as tsb
    from coda_jax.options import current_options

    seen = []  # the options in force where each CodaLlama is built (inside its run's context)
    coda = tsb.CodaLlama

    def recording(*a, **k):
        o = current_options()
        seen.append((o.cross_entropy.save_logits, o.routing.xla_output_below))
        return coda(*a, **k)

    monkeypatch.setattr(tsb, "CodaLlama", recording)
    run = "xla:cross_entropy.save_logits=false,routing.xla_output_below=12345"
    outside = current_options().routing.xla_output_below
    rows = tsb.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "1",
                     "--rounds", "1", "--runs", f"plain,{run},xla", "--out", str(tmp_path)])
    assert [r["run"] for r in rows] == ["plain", run, "xla"]
    # the options of each run, none after it (the plain run builds a CodaLlama too: its weights)
    assert seen == [("auto", outside), (False, 12345), ("auto", outside)]
    assert all(r["tokens_per_s"] > 0 and r["first_loss"] > 0 for r in rows)
    assert rows[1]["first_loss"] == pytest.approx(rows[2]["first_loss"], rel=1e-6)  # the same step
    # the plain model starts from CodaLlama's weights: the same loss up to the two implementations' rounding
    assert rows[0]["first_loss"] == pytest.approx(rows[2]["first_loss"], rel=2e-3)
    # every step run applied (compile, first, two warm-up, one timed): none skipped
    assert [(r["steps_run"], r["steps_applied"]) for r in rows] == [(5, 5)] * 3
    assert all(len(r["losses"]) == 5 and r["losses"][0] == pytest.approx(r["first_loss"], rel=1e-5)
               and r["losses"][-1] == pytest.approx(r["last_loss"], rel=1e-5) for r in rows)
    assert current_options().cross_entropy.save_logits == "auto"
    assert list(json.loads((tmp_path / "train_step.json").read_text())) == ["tiny-1L 2x16"]
    assert f"| {run} |" in (tmp_path / "train_step.md").read_text()
    # --profile traces whole steps, each feeding its donated state to the next (a CPU trace
    # holds no GPU kernels: zeros, but the chain of steps must run).
    prof = tsb.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "2",
                     "--rounds", "1", "--runs", "xla", "--profile", "--profile-top", "3"])
    assert set(prof[0]["profile"]) == {"device_ms", "busy_ms", "overlap_ms", "idle_ms", "by_class", "top_kernels",
                                         "kernel_calls", "fusions"}
    assert len(prof[0]["profile"]["top_kernels"]) <= 3
    # JAX_ENABLE_PGLE=1: the step called through jit dispatch (profiled runs, then compiled
    # again); the PGLE settings are JAX's again afterwards.
    before = jax.config.jax_enable_pgle, jax.config.jax_pgle_profiling_runs
    pgle = tsb.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "1",
                     "--rounds", "1", "--runs", "xla:JAX_ENABLE_PGLE=1"])
    assert pgle[0]["tokens_per_s"] > 0 and pgle[0]["first_loss"] == rows[2]["first_loss"]
    assert pgle[0]["steps_applied"] == pgle[0]["steps_run"] > 5  # the profiled runs counted too
    # --remat block: every model's blocks rematerialized (the plain baseline's too); same losses.
    remat = tsb.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "1",
                      "--rounds", "1", "--runs", f"plain,{run}", "--remat", "block", "--out", str(tmp_path)])
    assert [r["first_loss"] for r in remat] == pytest.approx([r["first_loss"] for r in rows[:2]], rel=1e-6)
    assert "tiny-1L 2x16 remat block" in json.loads((tmp_path / "train_step.json").read_text())
    assert (jax.config.jax_enable_pgle, jax.config.jax_pgle_profiling_runs) == before
    # PGLE_AOT=2: two traced steps, their profile (empty on a CPU) handed to a second
    # ahead-of-time compile, which is the step timed.
    aot = tsb.main(["--preset", "tiny", "--layers", "1", "--batch", "2", "--seq", "16", "--steps", "1",
                    "--rounds", "1", "--runs", "xla:PGLE_AOT=2"])
    assert aot[0]["tokens_per_s"] > 0 and aot[0]["first_loss"] == rows[2]["first_loss"]
    assert aot[0]["pgle_profile"]["custom_calls"] == 0


def test_train_step_bench_run_specs():
    """``--runs``: commas separate runs and a run's settings alike (an item naming a model
    starts a run); settings are coda-jax options, ``xla_*`` compile options or the PGLE ones,
    and a bad one is refused with the rule."""
    from benchmarks import train_step_bench as tsb
    from coda_jax.options import CrossEntropyOptions, RoutingOptions

    assert tsb.split_runs("plain,pallas:cross_entropy.save_logits=false,routing.plain_gemm=kernel,xla,plain") == [
        "plain", "pallas:cross_entropy.save_logits=false,routing.plain_gemm=kernel", "xla", "plain"]
    r = tsb.parse_run("pallas:cross_entropy.save_logits=false,routing.xla_programs=rms_rope+rms_dgrad_res<64,"
                      "xla_gpu_enable_command_buffer=,PGLE_AOT=2")
    assert r.model == "pallas" and r.aot_steps == 2 and r.pgle_runs == 0
    assert r.options == {"cross_entropy": CrossEntropyOptions(save_logits=False),
                         "routing": RoutingOptions(xla_programs={"rms_rope": None, "rms_dgrad_res": 64.0})}
    assert r.xla_options == {"xla_gpu_enable_command_buffer": ""}
    assert tsb.parse_run("xla:JAX_ENABLE_PGLE=1,JAX_PGLE_PROFILING_RUNS=2").pgle_runs == 2
    assert tsb.parse_run("plain") == tsb.RunSpec("plain", "plain", {}, {})
    # A CodaLlama run in FP8: delayed scaling (true) or current; false is no FP8.
    assert tsb.parse_run("pallas:fp8=true").model_args == {"fp8": "delayed"}
    assert tsb.parse_run("pallas:fp8=current").model_args == {"fp8": "current"}
    assert tsb.parse_run("pallas:fp8=false").model_args == {}
    assert tsb.parse_run("pallas:fp8=true,swiglu_input=e4m3").model_args == {"fp8": "delayed", "swiglu_input": "e4m3"}
    with pytest.raises(ValueError, match="swiglu_input must be one of compute, e4m3"):
        tsb.parse_run("pallas:fp8=true,swiglu_input=e5m2")
    with pytest.raises(ValueError, match="swiglu_input is a setting of FP8 runs"):
        tsb.parse_run("pallas:swiglu_input=e4m3")
    assert tsb.parse_run("cutedsl:fp8=true,fp8_kernel=true").model_args == {"fp8": "delayed", "fp8_kernel": True}
    assert tsb.parse_run("cutedsl:fp8=true,fp8_kernel=false").model_args == {"fp8": "delayed", "fp8_kernel": False}
    with pytest.raises(ValueError, match="fp8_kernel is a setting of cutedsl runs"):
        tsb.parse_run("pallas:fp8=true,fp8_kernel=true")
    with pytest.raises(ValueError, match="fp8 must be true .delayed scaling., current or false"):
        tsb.parse_run("pallas:fp8=maybe")
    with pytest.raises(ValueError, match="plain, xla, pallas or cutedsl"):
        tsb.parse_run("torch")
    with pytest.raises(ValueError, match="name=value"):
        tsb.parse_run("xla:FOO")
    with pytest.raises(ValueError, match="unknown coda_jax option 'CODA_JAX_CE_SAVE_LOGITS'.*xla_"):
        tsb.parse_run("pallas:CODA_JAX_CE_SAVE_LOGITS=0")
    with pytest.raises(ValueError, match="save_logits must be"):
        tsb.parse_run("pallas:cross_entropy.save_logits=maybe")
    with pytest.raises(ValueError, match="is not a run"):
        tsb.split_runs("routing.plain_gemm=kernel,plain")
    with pytest.raises(SystemExit):
        tsb.main(["--runs", "plain,pallas:routing.no_such=1"])


def test_backend_variant_replaces_and_restores_pallas_config_fields():
    from coda_jax.pallas import tuning

    saved = tuning.CONFIG_TABLE["default"]
    with bench.backend_variant("pallas@cluster_dimension=None+grid_tile_width=8+grid_minor_dim=m") as base:
        cfg = tuning.CONFIG_TABLE["default"]
        assert base == "pallas"
        assert (cfg.cluster_dimension, cfg.grid_tile_width, cfg.grid_minor_dim) == (None, 8, "m")
        assert cfg.tile_n == saved.tile_n  # other fields kept
    assert tuning.CONFIG_TABLE["default"] is saved
    with pytest.raises(ValueError, match="grid_minor_dim must be"):
        with bench.backend_variant("pallas@grid_minor_dim=k"):
            pass
    # Each value parsed as its field's type (tuning.config_overrides, the autotuner's too).
    for bad, rule in [("pallas@grid_tile_width=wide", "backend variant .* takes an integer"),
                      ("pallas@no_field=1", "TuningConfig field")]:
        with pytest.raises(ValueError, match=rule):
            with bench.backend_variant(bad):
                pass
    assert tuning.CONFIG_TABLE["default"] is saved


def test_summarize_reports_device_time_beside_wall_clock():
    from benchmarks import summarize

    rows = [{"op": "norm_qkv_rope", "d": 2048, "backend": "plain", "fwdbwd_ms": 0.735, "fwdbwd_device_ms": 0.610},
            {"op": "norm_qkv_rope", "d": 2048, "backend": "pallas", "fwdbwd_ms": 0.933, "fwdbwd_device_ms": 0.736},
            {"op": "swiglu_mlp", "d": 2048, "backend": "plain", "fwdbwd_ms": 4.69},
            {"op": "swiglu_mlp", "d": 2048, "backend": "pallas", "fwdbwd_ms": 4.255}]
    wall = summarize.op_ratios(rows)
    dev = summarize.op_ratios(rows, "fwdbwd_device_ms")
    assert wall["norm_qkv_rope d=2048"]["pallas"] == pytest.approx(0.735 / 0.933)
    assert dev == {"norm_qkv_rope d=2048": {"pallas": pytest.approx(0.610 / 0.736)}}  # only rows that have it
    md = summarize.markdown({}, rows, "test")
    assert "**Fused ops fwd+bwd**" in md and "**Fused ops fwd+bwd, device time**" in md
    assert f"| norm_qkv_rope d=2048 | {0.610 / 0.736:.3f}x |" in md
    # Without device times (a CPU run, or older results) there is no device table.
    assert "device time" not in summarize.markdown({}, [{k: v for k, v in r.items() if k != "fwdbwd_device_ms"}
                                                        for r in rows], "test")


def test_summarize_puts_fp8_runs_against_plain_fp8_too():
    """A configuration that ran the plain JAX FP8 Llama gets a "vs plain FP8" column; one
    without it shows "-" there; with no FP8 configuration the column is not there."""
    from benchmarks import summarize

    def run(name, tps):
        return {"run": name, "tokens_per_s": tps, "ms_per_step": 8192.0 / tps, "first_step_s": 1.0}

    steps = {"1b fp8": [run("plain_fp8", 80.0), run("plain", 64.0), run("pallas:fp8=true", 88.0)],
             "1b": [run("plain", 60.0), run("pallas", 63.0)]}
    md = summarize.markdown(steps, [], "test")
    assert "| config | run | ms/step | tokens/s | vs plain JAX | vs plain FP8 | compile + first step s |" in md
    assert "| 1b fp8 | pallas:fp8=true | 93.1 | 88 | 1.375x | 1.100x | 1.0 |" in md
    assert "| 1b fp8 | plain | 128.0 | 64 | 1.000x | 0.800x | 1.0 |" in md
    assert "| 1b | pallas | 130.0 | 63 | 1.050x | - | 1.0 |" in md
    assert "vs plain FP8" not in summarize.markdown({"1b": steps["1b"]}, [], "test")


def test_summarize_update_replaces_only_the_current_section_of_results_md(tmp_path):
    """``summarize --update`` on benchmarks/RESULTS.md's layout: the section between the
    markers is replaced, the chart copied beside it, and the notes and the run index (whose
    links point into HISTORY.md) kept."""
    from benchmarks import summarize

    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    head, rest = results.split(summarize.BEGIN)
    _, tail = rest.split(summarize.END)
    assert "## Run index" in tail and "](HISTORY.md#run-1--" in tail
    md, png = tmp_path / "RESULTS.md", tmp_path / "current.png"
    md.write_text(results)
    png.write_bytes(b"png")
    summarize.update(md, "Current numbers (test)", png)
    assert md.read_text() == f"{head}{summarize.BEGIN}\nCurrent numbers (test)\n{summarize.END}{tail}"
    assert (tmp_path / "results.png").read_bytes() == b"png"


def test_results_index_links_every_history_heading():
    """RESULTS.md's run index has one line per run heading (``## Run...``) of HISTORY.md, in
    order, each linking to that heading's anchor (GitHub's: lower case, punctuation dropped,
    spaces as hyphens, a repeated anchor numbered)."""
    history = (ROOT / "benchmarks" / "HISTORY.md").read_text().splitlines()
    seen, anchors = {}, []
    for line in history:
        m = re.match(r"(#+) (.*)", line)
        if not m:
            continue
        base = "".join(c for c in m.group(2).lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        if m.group(1) == "##":
            anchors.append(base if n == 0 else f"{base}-{n}")
    index = re.findall(r"^- \[Runs? [0-9-]+\]\(HISTORY\.md#([^)]+)\)", (ROOT / "benchmarks" / "RESULTS.md").read_text(),
                       re.MULTILINE)
    assert index == anchors and len(index) > 100


def test_per_gpu_trace_analysis_counts_overlapping_streams_once():
    """kernels_by_gpu splits a trace's GPU stream events by device; busy time is the union
    of the kernel intervals (a collective beside a GEMM on another stream counts once), the
    overlap the rest; gpu_summary classes NCCL kernels as collectives."""
    from benchmarks.device_time import busy_us, kernels_by_gpu
    from benchmarks.profile_block import gpu_summary

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:1"}},
            {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "Stream #8(nccl)"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
            {"ph": "M", "name": "thread_name", "pid": 3, "tid": 1, "args": {"name": "python"}}]
    x = lambda pid, tid, name, ts, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = meta + [x(1, 7, "coda_rms_swiglu_train", 0, 100), x(1, 8, "ncclDevKernel_AllReduce_Sum_bf16", 50, 100),
                     x(1, 7, "loop_add_fusion", 300, 50), x(2, 7, "coda_rms_swiglu_train", 10, 100),
                     x(3, 1, "PjitFunction(step)", 0, 400)]
    gpus = kernels_by_gpu(events)
    assert sorted(gpus) == ["/device:GPU:0", "/device:GPU:1"]
    assert len(gpus["/device:GPU:0"]) == 3 and len(gpus["/device:GPU:1"]) == 1
    assert busy_us(gpus["/device:GPU:0"]) == 200.0  # [0, 150) and [300, 350)
    g = gpu_summary(gpus["/device:GPU:0"], steps=1)
    assert g["device_ms"] == 0.25 and g["busy_ms"] == 0.2
    assert abs(g["overlap_ms"] - 0.05) < 1e-12 and abs(g["idle_ms"] - 0.15) < 1e-12  # span 350 us, busy 200
    assert g["by_class"] == {"coda": 0.1, "collective": 0.1, "other": 0.05}


def test_collective_placement_within_the_step():
    """collective_placement: a collective's time per tenth of the step where it starts, the
    part of it that compute kernels cover, and which classes run beside it; the mean over
    GPUs keeps it."""
    from benchmarks.profile_block import collective_placement, gpu_summary, mean_over_gpus

    # Two back-to-back steps of 1000 us: compute [0, 900) then an all-reduce [900, 1000) that
    # nothing covers; in step 2 the all-reduce starts at 1150 beside a GEMM [1100, 1200) and
    # a fused kernel [1200, 1900), then the rest of the compute.
    ks = [("coda_residual_rms", 0, 900), ("ncclDevKernel_AllReduce_Sum_bf16", 900, 100),
          ("nvjet_sm90_gemm", 1100, 100), ("ncclDevKernel_AllReduce_Sum_bf16", 1150, 100),
          ("coda_rms_swiglu_train", 1200, 700), ("loop_add_fusion", 1900, 100)]
    p = collective_placement(ks, steps=2)
    assert abs(p["ms"] - 0.1) < 1e-12 and abs(p["hidden_ms"] - 0.05) < 1e-12  # (100 + 100 us) / 2; 100 us hidden / 2
    assert [round(v, 6) for v in p["by_part"]] == [0, 0.05, 0, 0, 0, 0, 0, 0, 0, 0.05]
    assert [round(v, 6) for v in p["hidden_by_part"]] == [0, 0.05, 0, 0, 0, 0, 0, 0, 0, 0]
    assert {k: round(v, 6) for k, v in p["beside"].items()} == {"coda": 0.025, "gemm": 0.025}
    assert collective_placement([("coda_x", 0, 10)], steps=1) is None
    m = mean_over_gpus([gpu_summary(ks, 2), gpu_summary(ks[:2], 1)])
    assert abs(m["collectives"]["ms"] - 0.1) < 1e-12 and abs(m["collectives"]["hidden_ms"] - 0.025) < 1e-12


def test_model_profile_on_a_mesh_runs_on_cpu_devices(tmp_path):
    """``profile_block.py --model ... --mesh data=2`` builds the sharded step (state and tokens
    placed over two CPU devices) and writes its profile; the CPU trace has no GPU kernels,
    so only the bookkeeping runs here."""
    import json

    r = subprocess.run([sys.executable, "-m", "benchmarks.profile_block", "--model", "tiny",
                        "--mesh", "data=2", "--batch", "4", "--seq", "32", "--backends", "plain,xla", "--steps", "1",
                        "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                                XLA_FLAGS=suite_xla_flags(devices=2)))
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads((tmp_path / "profile_tiny_data2.json").read_text())
    assert result["mesh"] == "data=2" and {"plain", "xla"} <= set(result)
    assert result["xla"]["wall_ms"] > 0 and "busy_ms" in result["xla"]
    assert "mesh data=2, per GPU (mean)" in r.stdout


def test_activation_gathers_count_computed_arrays_not_the_state():
    """An all-gather of a ``[batch*seq, ...]`` array computed in the step counts; one of a
    step parameter (FSDP gathering a weight whose dimension happens to equal the token
    count, run 143) does not; ``floating_only`` drops integer arrays."""
    from benchmarks.train_step_bench import activation_gathers

    hlo = "\n".join([
        "  %all-gather.1 = bf16[16384,2048]{1,0} all-gather(%fusion.7), channel_id=1, dimensions={0}",
        "  %all-gather.2 = f32[16384,1024]{1,0} all-gather(%param.834), channel_id=2, dimensions={0}",
        "  %all-gather-start.3 = s32[16,1024]{1,0} all-gather-start(%copy.5), channel_id=3, dimensions={0}",
        "  %all-gather.4 = f32[2048,8192]{1,0} all-gather(%fusion.9), channel_id=4, dimensions={0}",
    ])
    assert [g.split(" =")[0] for g in activation_gathers(hlo, 16, 1024)] == ["%all-gather.1", "%all-gather-start.3"]
    assert [g.split(" =")[0] for g in activation_gathers(hlo, 16, 1024, floating_only=True)] == ["%all-gather.1"]


def test_hlo_fusions_names_a_profiled_xla_kernel():
    """A profile's XLA kernel name maps to its fusion instructions in the compiled HLO: by
    instruction name (``_N`` -> ``.N``) or as the deduplicated kernel several share."""
    from benchmarks import train_step_bench as tsb

    hlo = "\n".join([
        '  %input_transpose_fusion.33 = bf16[4096,2048]{1,0} fusion(%param.11), kind=kInput, calls=%f.33, '
        'metadata={op_name="jit(step)/convert_element_type" deduplicated_name="input_transpose_fusion.2"}',
        '  %input_transpose_fusion.2 = bf16[4096,2048]{1,0} fusion(%param.12), kind=kInput, calls=%f.2, '
        'metadata={op_name="jit(step)/convert_element_type"}',
        '  %loop_add_fusion.7 = f32[8,16]{1,0} fusion(%a, %b), kind=kLoop, calls=%g, metadata={op_name="jit(step)/add"}',
        '  %loop_add_fusion.9 = (f32[64]{0}, f32[64]{0}, f32[64]{0}) fusion(%p, %m, %v), kind=kLoop, calls=%h, '
        'metadata={op_name="jit(step)/optimizer/add"}',
    ])
    f = tsb.hlo_fusions(hlo, "input_transpose_fusion_2")
    assert f == {"count": 2, "shape": "bf16[4096,2048]{1,0}", "operands": "%param.11",
                 "op_name": "jit(step)/convert_element_type"}
    assert tsb.hlo_fusions(hlo, "loop_add_fusion_7")["operands"] == "%a, %b"
    assert tsb.hlo_fusions(hlo, "loop_add_fusion_70") is None
    # A multi-output fusion (the optimizer's update) has a tuple shape.
    assert tsb.hlo_fusions(hlo, "loop_add_fusion_9")["op_name"] == "jit(step)/optimizer/add"
    assert tsb.hlo_fusions(hlo, "nvjet_sm90_tst_256x128") is None


def test_collective_windows_count_what_the_schedule_overlaps():
    """hlo_schedule: the instructions scheduled between each async collective's start and
    done, by kind (a Mosaic GPU custom call, XLA's GEMM fusion, other fusions)."""
    from benchmarks.hlo_schedule import collective_windows, kind_timeline, window_summary

    hlo = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_kernel.5 (x: bf16[8,8]) -> bf16[8,8] {
  %x = bf16[8,8]{1,0} parameter(0)
  ROOT %custom-call.9 = bf16[8,8]{1,0} custom-call(%x), custom_call_target="mosaic_gpu_v2"
}

ENTRY %main (p: bf16[8,8]) -> (bf16[8,8], bf16[4,8]) {
  %p = bf16[8,8]{1,0} parameter(0)
  %all-reduce-start = bf16[8,8]{1,0} all-reduce-start(%p), channel_id=1, to_apply=%add
  %custom-call.1 = (bf16[8,8]{1,0}, f32[8]{0}) custom-call(%p), custom_call_target="mosaic_gpu_v2", api_version=API_VERSION_TYPED_FFI
  %get-tuple-element.1 = bf16[8,8]{1,0} get-tuple-element(%custom-call.1), index=0
  %fusion.2 = bf16[8,8]{1,0} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused
  %all-reduce-done = bf16[8,8]{1,0} all-reduce-done(%all-reduce-start)
  %reduce-scatter-start = ((bf16[8,8]{1,0}), bf16[4,8]{1,0}) async-start(%fusion.2), calls=%reduce-scatter.3
  %reduce-scatter-done = bf16[4,8]{1,0} async-done(%reduce-scatter-start)
  %fusion.8 = bf16[8,8]{1,0} fusion(%p), kind=kLoop, calls=%fused
  %all-gather-start = (bf16[4,8]{1,0}, bf16[8,8]{1,0}) all-gather-start(%reduce-scatter-done), dimensions={0}
  %gemm_fusion_dot.4 = bf16[8,8]{1,0} fusion(%fusion.2, %fusion.2), kind=kCustom, calls=%gemm_fusion_dot_computation
  %call.6 = bf16[8,8]{1,0} call(%gemm_fusion_dot.4), to_apply=%wrapped_kernel.5
  %all-gather-done = bf16[8,8]{1,0} all-gather-done(%all-gather-start)
  ROOT %t = (bf16[8,8]{1,0}, bf16[4,8]{1,0}) tuple(%all-gather-done, %reduce-scatter-done)
}
"""
    ws = collective_windows(hlo)
    assert [(w["op"], w["between"], w["after"]) for w in ws] == [
        ("all-reduce", {"mosaic": 1, "other": 1, "fusion": 1}, "collective"), ("async:reduce-scatter.3", {}, "fusion"),
        ("all-gather", {"gemm_fusion": 1, "mosaic": 1}, "other")]  # the call of a jitted kernel counts as mosaic
    # slack: kernels after the operands are ready and before the start; after the done and
    # before its first user (the all-reduce's result has none: to the end)
    assert [(w["before_start"], w["before_use"]) for w in ws] == [
        ({}, {"fusion": 1, "gemm_fusion": 1, "mosaic": 1}), ({}, {"fusion": 1}), ({"fusion": 1}, {})]
    s = window_summary(ws).splitlines()
    assert s[0].endswith("kernels between operands ready and start: fusion 1.0; between done and first use: none")
    assert s[0].startswith("all-gather: 1 async, 0 with no kernel inside; mean ops inside: gemm_fusion 1.0  mosaic 1.0")
    assert "after the done: other 1;" in s[0]
    assert s[1].startswith("all-reduce: 1 async, 0 with no kernel inside; mean ops inside: fusion 1.0  mosaic 1.0")
    assert s[2].startswith("reduce-scatter: 1 async, 1 with no kernel inside; mean ops inside: none")
    assert window_summary([]) == "no async collectives"
    # the same schedule drawn one letter per kernel (the call of a jitted kernel as M)
    assert kind_timeline(hlo) == "[Mf][]f[GM]"
    assert kind_timeline(hlo.replace("%all-reduce-start = bf16[8,8]{1,0} all-reduce-start(%p)",
                                     "%all-reduce.0 = bf16[8,8]{1,0} all-reduce(%p)")) == "SMf][]f[GM]"


def test_plain_residual_rms_computes_the_carry_the_fused_op_writes():
    """The per-op baseline of ``residual_rms`` does the fused op's whole job (``x``, and the
    next RMSNorm's ``h`` and row sums of squares as a forward-only cache), and the timed
    fwd+bwd returns every output, so XLA cannot drop the plain version's carry."""
    import jax.numpy as jnp

    import coda_jax as cj
    from benchmarks import plain_ops

    r = bench.Inputs(5)
    y, w, res, g = r.normal((64, 128)), r.normal((128, 128), 128 ** -0.5), r.normal((64, 128)), r.normal((128,), 0.1, 1.0)
    x, h, ss = plain_ops.matmul_residual_rms(y, w, res, g)
    fx, carry = cj.matmul_residual_rms(y, w, res, g, backend="xla")
    f32 = lambda a: a.astype(jnp.float32)
    assert float(jnp.max(jnp.abs(f32(x) - f32(fx)))) < 0.05
    assert float(jnp.max(jnp.abs(f32(h) - f32(carry.h)))) < 0.05
    assert float(jnp.max(jnp.abs(ss - carry.sumsq.sum(0)) / ss)) < 1e-2
    rnd = jax.random.normal(jax.random.key(0), x.shape)
    # the carry comes back beside the loss (materialized), and is not differentiated
    for fn in (plain_ops.matmul_residual_rms,
               lambda *a: bench._residual_out(cj.matmul_residual_rms(*a, backend="xla"))):
        (val, aux), grads = jax.jit(jax.value_and_grad(lambda *a: bench._loss(fn(*a), rnd), (0, 1, 2, 3),
                                                       has_aux=True))(y, w, res, g)
        assert [a.shape for a in aux] == [a.shape for a in fn(y, w, res, g)[1:]]
        ref = jax.grad(lambda *a: jnp.sum(f32(fn(*a)[0]) * rnd), (0, 1, 2, 3))(y, w, res, g)
        for a, b in zip(grads, ref):
            assert float(jnp.max(jnp.abs(f32(a) - f32(b)))) == 0.0


def _trace_events(pid, tid, spans):
    """B/E events of ``spans`` [(name, begin, end)] on one warpgroup, in time order."""
    ev = [(b, 0, n) for n, b, _ in spans] + [(e, 1, n) for n, _, e in spans]
    ev.sort(key=lambda x: (x[0], -x[1]))  # at one instant an end closes before a begin opens
    return [{"name": n, "ph": "E" if end else "B", "ts": float(t), "pid": pid, "tid": tid} for t, end, n in ev]


def test_kernel_timeline_summary_of_a_synthetic_ping_pong_trace():
    from benchmarks import kernel_timeline

    # One SM, ping-pong: consumer 1 runs mainloop 0-10 (waiting 0-2 for a stage) and its
    # epilogue 10-16; consumer 2 runs mainloop 10-20 and epilogue 20-30 (nothing overlaps
    # 20-30: the tensor cores wait there). The producer waits on a free stage 12-14.
    c1 = [("mainloop", 0, 10), ("full_wait", 0, 2), ("epilogue", 10, 16), ("load_wait", 10, 11)]
    c2 = [("mainloop", 10, 20), ("epilogue", 20, 30), ("store_wait", 25, 27)]
    events = _trace_events(1, 1, c1) + _trace_events(1, 2, c2) + _trace_events(1, 3, [("free_wait", 12, 14)])
    s = kernel_timeline.summarize({"traceEvents": events})
    assert s["span_kcycles"] == 30 and s["sms"] == 1 and s["consumer_tiles"] == 2
    assert s["mainloop_kcycles_per_tile"] == 10 and s["epilogue_kcycles_per_tile"] == 8
    assert s["full_wait_kcycles_per_tile"] == 1 and s["load_wait_kcycles_per_tile"] == 0.5
    assert s["store_wait_kcycles_per_tile"] == 1
    assert s["mma_busy"] == round(18 / 30, 4)  # 2-20 in a mainloop, not waiting
    assert s["exposed_epilogue"] == round(10 / 30, 4)  # 20-30
    assert s["starved"] == round(2 / 30, 4)  # 0-2: c1 waits for a stage, nobody issues MMAs
    assert s["producer_free_wait_kcycles_per_sm"] == 2
    assert s["both_in_mainloop"] == 0  # c1's MMAs 2-10, c2's 10-20
    assert s["both_in_epilogue"] == 0


def test_kernel_timeline_counts_a_scope_reentered_inside_itself_once():
    from benchmarks import kernel_timeline

    ev = [("B", 0.0), ("B", 1.0), ("E", 9.0), ("E", 10.0)]  # mainloop inside mainloop
    spans = kernel_timeline._intervals([{"name": "mainloop", "ph": ph, "ts": t, "pid": 1, "tid": 1} for ph, t in ev])
    assert spans[(1, 1)]["mainloop"] == [(0.0, 10.0)]


def test_kernel_timeline_sees_consumers_in_lockstep():
    from benchmarks import kernel_timeline

    # Both consumers run MMAs 0-10 and epilogues 10-20 at once: a cooperative-like lockstep.
    c = [("mainloop", 0, 10), ("epilogue", 10, 20)]
    s = kernel_timeline.summarize({"traceEvents": _trace_events(1, 1, c) + _trace_events(1, 2, c)})
    assert s["both_in_mainloop"] == 0.5 and s["both_in_epilogue"] == 0.5
    assert s["mma_busy"] == 0.5 and s["exposed_epilogue"] == 0.5


def test_a_config_variant_reaches_the_tuned_tables_entries():
    # The table's entries are the default config with their fields replaced, memoized: a
    # variant must not leave (or find) entries parsed under another default.
    from coda_jax.pallas import tuned

    entries = lambda: [e.config for path in tuned.SHIPPED_TABLES  # noqa: E731
                       for e in tuned.load_table(str(path)).entries if e.config is not None]
    # A field no shipped entry sets (tuned entries do set swizzle_epilogue, epilogue_regs and
    # grid_tile_width), so every entry takes the variant's value.
    raw = [e.get("config") or {} for path in tuned.SHIPPED_TABLES for e in json.loads(Path(path).read_text())["entries"]]
    from coda_jax.pallas.tuning import CONFIG_TABLE

    flipped = not CONFIG_TABLE["default"].col_sum_tiles
    assert not any("col_sum_tiles" in c for c in raw)
    assert entries() and not any(c.col_sum_tiles == flipped for c in entries())
    with bench.backend_variant(f"pallas@col_sum_tiles={flipped}"):
        assert all(c.col_sum_tiles == flipped for c in entries())
    assert not any(c.col_sum_tiles == flipped for c in entries())


def test_tune_sweep_programs_get_the_loads_they_declare():
    """tune.py's epilogue sweep builds each program's loads by hand: they must match its
    declaration (swiglu_dgrad's rstd was missing there, so the sweep skipped it)."""
    from benchmarks import tune

    progs, _, _ = tune.block_programs(m=256)
    for name, epi, _, _, _, loads in progs:
        declared = {l.name for l in epi.loads}
        assert set(loads) == declared, (name, sorted(loads), sorted(declared))


def test_tune_epilogue_sweep_times_the_variants_it_is_given(monkeypatch):
    """The sweep's loop runs each program (and its identity GEMM) under each --variants
    entry; its --programs check once reused the variants' name for the program list, and the
    loop then looked programs up as variants (KeyError)."""
    import argparse

    from benchmarks import tune

    timed = []
    monkeypatch.setattr(tune, "M", 256)
    small = tune.block_programs
    monkeypatch.setattr(tune, "block_programs", lambda: small(m=256))
    monkeypatch.setattr(tune, "_time_program", lambda row, *a: timed.append((row["program"], row["variant"])) or row)
    args = argparse.Namespace(variants="default,swizzled", programs="swiglu_dgrad", iters=1)
    tune.epilogue_sweep(args, lambda row: row)
    assert timed == [("identity", "default"), ("identity", "swizzled"),
                     ("swiglu_dgrad", "default"), ("swiglu_dgrad", "swizzled")]
    with pytest.raises(SystemExit, match="unknown"):
        tune.epilogue_sweep(argparse.Namespace(variants="default", programs="nope", iters=1), lambda row: row)


def test_step_ceiling_splits_a_profile_and_bounds_the_ratio():
    """step_ceiling.py: the optimizer's kernels (its named scope), the parameter casts and the
    other passes of a profiled step, and the device-time bounds against plain JAX."""
    from benchmarks import step_ceiling as sc

    def prof(gemm, coda, other, kernels):
        fus = {k: {"op_name": op, "operands": operands, "shape": "f32[8]", "count": 1}
               for k, (_, op, operands) in kernels.items()}
        return {"device_ms": gemm + coda + 10.0 + other, "by_class": {"gemm": gemm, "coda": coda, "attention": 10.0,
                                                                      "other": other},
                "top_kernels": [[k, ms] for k, (ms, _, _) in kernels.items()], "fusions": fus}

    common = {"loop_add_fusion_1": (12.0, "jit(train_step)/optimizer/add", "%p, %m"),
              "wrapped_convert_2": (3.0, "jit(train_step)/jvp()/convert_element_type", "%state_0___w___value.1"),
              "wrapped_convert_3": (0.5, "jit(train_step)/transpose(jvp())/convert_element_type", "%g")}
    plain = prof(80.0, 0.0, 35.0, {**common, "loop_mul_fusion": (10.0, "jit(train_step)/jvp()/mul", "%x")})
    fused = prof(20.0, 70.0, 18.0, common)
    steps = {"1b": [{"run": "plain", "profile": plain}, {"run": "pallas", "profile": fused}]}
    p, f = sc.split_run(plain), sc.split_run(fused)
    assert (f["optimizer"], f["casts"], f["passes"], f["gemms"]) == (12.0, 3.0, 3.0, 90.0) and f["named"]
    c = sc.ceilings(p, f)
    assert c["now"] == pytest.approx(125.0 / 118.0)
    assert c["cublas_speed"] == pytest.approx(125.0 / (80 + 10 + 12 + 3 + 3))
    assert c["free_fusion"] == pytest.approx(125.0 / (80 + 10 + 12 + 3))
    text = sc.report(steps)
    assert "| pallas | 118.00 | 90.00 | 10.00 | 12.00 | 3.00 | 3.00 | 1.059x | 1.157x | 1.190x |" in text
    assert "no kernel of the `optimizer` scope" not in text


def test_step_ceiling_baseline_is_plain_else_plain_fp8():
    """step_ceiling.py: an FP8 comparison profiled without plain bf16 is measured against
    ``plain_fp8``; without either baseline the report says so instead of printing nothing."""
    from benchmarks import step_ceiling as sc

    def prof(gemm, other):
        return {"device_ms": gemm + other, "by_class": {"gemm": gemm, "other": other}, "top_kernels": []}

    text = sc.report({"8b": [{"run": "pallas:fp8=true", "profile": prof(30.0, 20.0)},
                             {"run": "plain_fp8", "profile": prof(40.0, 20.0)}]})
    assert "Baseline: `plain_fp8`." in text and "| plain_fp8 | 60.00 |" in text
    assert "| pallas:fp8=true | 50.00 | 30.00 |" in text and "1.200x" in text
    text = sc.report({"8b": [{"run": "pallas", "profile": prof(30.0, 20.0)}]})
    assert "no profiled `plain` or `plain_fp8` run" in text and "pallas" in text


def test_step_ceiling_fp8_bounds_use_the_fp8_baselines_gemms():
    """step_ceiling.py: an FP8 run profiled beside ``plain`` and ``plain_fp8`` is bounded with
    ``plain_fp8``'s GEMMs, and coda-jax's epilogue passes (K <= PASS_MAX_K) count as passes,
    not GEMMs."""
    from benchmarks import step_ceiling as sc

    def prof(by_class, top=()):
        return {"device_ms": sum(by_class.values()), "by_class": by_class, "top_kernels": [list(t) for t in top]}

    plain = prof({"gemm": 60.0, "attention": 5.0, "other": 35.0})
    plain_fp8 = prof({"gemm": 40.0, "attention": 5.0, "other": 40.0})
    fused = prof({"coda": 44.0, "attention": 5.0, "other": 21.0},
                 [("coda_quantize_e4m3_nt_4096x28672x64_mosaic_gpu_kernel", 4.0),
                  ("coda_identity_fp8_nt_4096x4096x4096_mosaic_gpu_kernel", 40.0)])
    f = sc.split_run(fused)
    assert (f["gemms"], f["passes"]) == (40.0, 25.0)
    c = sc.ceilings(sc.split_run(plain), f, gemms=sc.split_run(plain_fp8))
    assert c["now"] == pytest.approx(100.0 / 70.0)
    assert c["cublas_speed"] == pytest.approx(100.0 / (40 + 5 + 25)) and c["free_fusion"] == pytest.approx(100.0 / 45)
    text = sc.report({"8b": [{"run": "plain", "profile": plain}, {"run": "plain_fp8", "profile": plain_fp8},
                             {"run": "pallas:fp8=true", "profile": fused}]})
    assert "| pallas:fp8=true | 1.429x | 1.429x | 2.222x |" in text
    # without plain_fp8 there is no FP8 bound to give
    assert "FP8 bounds" not in sc.report({"8b": [{"run": "plain", "profile": plain},
                                                  {"run": "pallas:fp8=true", "profile": fused}]})


def test_step_ceiling_lists_fused_gemms_by_call_site():
    """step_ceiling.py: Pallas kernels named ``coda_<program>_<layout>_<M>x<N>x<K>`` become
    one line each, with launches, ms per launch and TFLOP/s; other kernels are not listed,
    and a profile without launch counts gives dashes."""
    from benchmarks import step_ceiling as sc

    name = "coda_swiglu_dgrad_nt_8192x8192x2048_mosaic_gpu_kernel"
    prof = {"top_kernels": [[name, 8.0], ["nvjet_sm90_tst_128x256", 5.0], ["coda_rms_rope_nn_64x128x64", 1.0]],
            "kernel_calls": {name: 16.0, "nvjet_sm90_tst_128x256": 3.0}}
    rows = sc.fused_calls(prof)
    assert [(r["program"], r["layout"], r["shape"]) for r in rows] == [
        ("swiglu_dgrad", "nt", (8192, 8192, 2048)), ("rms_rope", "nn", (64, 128, 64))]
    assert rows[0]["ms_per_call"] == pytest.approx(0.5)
    assert rows[0]["tflops"] == pytest.approx(2 * 8192 * 8192 * 2048 * 16 / 8e-3 / 1e12)
    assert rows[1]["calls"] is None and rows[1]["tflops"] is None
    plain = {"device_ms": 10.0, "by_class": {"gemm": 10.0}, "top_kernels": []}
    text = sc.report({"1b": [{"run": "plain", "profile": plain},
                             {"run": "pallas", "profile": {"device_ms": 9.0, "by_class": {"coda": 9.0}, **prof}}]})
    assert "| swiglu_dgrad | nt | 8192x8192x2048 | 8.000 | 16 | 0.500 | 550 |" in text
    assert "| rms_rope | nn | 64x128x64 | 1.000 | - | - | - |" in text


def test_clock_sampler_parses_nvidia_smi_and_is_silent_without_it(monkeypatch):
    """``gpu_clock``: medians of nvidia-smi's ``MHz, W`` lines (other lines skipped); on a
    machine without nvidia-smi the sampler runs its block and reports nothing."""
    from benchmarks import gpu_clock

    samples = gpu_clock.parse_samples("1545, 694.12\n1980, 120.5\n[N/A], 70.1\n\n1500, 699.90\n")
    assert samples == [(1545.0, 694.12), (1980.0, 120.5), (1500.0, 699.9)]
    assert gpu_clock.summarize(samples) == {"sm_clock_mhz": 1545.0, "power_w": 694.1, "samples": 3}
    assert gpu_clock.summarize([]) is None
    monkeypatch.setattr(gpu_clock.shutil, "which", lambda name: None)
    ran = []
    with gpu_clock.ClockSampler() as clock:
        ran.append(1)
    assert ran == [1] and clock.summary is None
    # It samples only the GPUs the process sees (nvidia-smi itself ignores CUDA_VISIBLE_DEVICES).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0, 1")
    assert gpu_clock.command(100)[-2:] == ["-i", "0,1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "-i" not in gpu_clock.command(100)


def test_tune_op_spec_traces_the_op_benchmarks_kernel_calls(monkeypatch):
    """``tune.py --model op:norm_matmul:2048`` tunes the GEMMs the op benchmark times: the
    forward, the narrow-side norm backward and the wgrad, at the benchmark's shapes."""
    from benchmarks import tune
    from coda_jax.pallas import autotune as at

    monkeypatch.setattr(bench, "TOKENS", 256)
    monkeypatch.setattr(bench, "VOCAB", 512)
    monkeypatch.setenv("CODA_JAX_PALLAS_INTERPRET", "1")
    fn, args = tune.op_step("op:norm_matmul:2048")
    calls = sorted((c.epilogue.name, c.transpose_a, c.transpose_b, c.mnk) for c in at.kernel_calls(fn, *args))
    f = bench.WIDTHS[2048][0]
    assert calls == [("norm_dgrad", False, True, (256, 2048, f)), ("norm_wgrad", True, False, (2048, f, 256)),
                     ("row_scale", False, False, (256, f, 2048))], calls
    with pytest.raises(ValueError, match="op:name:d"):
        tune.op_step("op:norm_matmul:1000")


def test_sass_hotspots_reads_ncu_source_csv(tmp_path):
    # benchmarks/sass_hotspots.py: samples per opcode (predicates and modifiers stripped) and
    # the top instructions, from ncu's source-page CSV (a banner line before the header).
    csv = tmp_path / "sass.csv"
    csv.write_text(
        "==PROF== Connected to process 1\n"
        '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
        '"Instructions Executed","stall_barrier","stall_wait"\n'
        '"0x10","WARPGROUP.DEPBAR.LE gsb0, 0x0","60","50","8","55","5"\n'
        '"0x20","@!P2  BRA 0x100","30","20","8","0","30"\n'
        '"0x30","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24","1,000","0","64","0","1,000"\n')
    out = subprocess.run([sys.executable, "-m", "benchmarks.sass_hotspots", str(csv), "--top", "2"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "samples 1090 in 3 instructions" in out
    lines = out.splitlines()
    ops = lines[lines.index(next(l for l in lines if l.startswith("samples"))) + 1:][:3]
    assert [l.split()[0] for l in ops] == ["HGMMA", "WARPGROUP", "BRA"]  # by samples; '@!P2' dropped
    top = out.split("top 2 instructions by samples:")[1]
    assert "HGMMA" in top and "WARPGROUP.DEPBAR" in top and "BRA" not in top and "stall_barrier=55" in top


def _device_stubs(tmp_path) -> Path:
    """A folder with stand-ins for the device's ``nvidia-smi`` and ``python3`` (this venv's)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA Stub GPU, 1.0, 80 MiB'\n")
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    for f in ("nvidia-smi", "python3"):
        (bin_dir / f).chmod(0o755)
    return bin_dir


def test_gpu_tests_script_adds_cutedsl_when_carried_and_exits_with_pytests_status(tmp_path):
    """``gpu_tests.sh`` in a stand-in checkout: the carried CuTeDSL archive is unpacked (with the
    carried ``zstd``; a stub that passes the tar through) and adds ``test_gpu_cutedsl.py`` to
    the default files; the script exits with pytest's status: 1 with a failing test, 5 when
    ``GPU_TESTS_K`` selects none."""
    import shutil
    import tarfile

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for f in ("gpu_tests.sh", "gpu_common.sh"):
        shutil.copy(ROOT / "benchmarks" / f, repo / "benchmarks" / f)
    (repo / "tests").mkdir()
    for name, body in (("pallas", "assert True"), ("cutedsl", "assert False"), ("multi", "assert True"),
                       ("multi_process", "assert True")):
        (repo / "tests" / f"test_gpu_{name}.py").write_text(
            f"import pytest\n\n\n@pytest.mark.gpu\ndef test_{name}_case():\n    {body}\n")
    (repo / ".whl").mkdir()
    pkg = tmp_path / "pkg" / "nvidia_cutlass_dsl" / "dsl_packages"
    pkg.mkdir(parents=True)
    (pkg / "marker.txt").write_text("unpacked")
    with tarfile.open(repo / ".whl" / "cutlass_dsl.tar.zst", "w") as tar:  # "compressed" by the stub below
        tar.add(tmp_path / "pkg" / "nvidia_cutlass_dsl", arcname="nvidia_cutlass_dsl")
    (repo / ".whl" / "zstd").write_text('#!/usr/bin/env bash\ncat "${@: -1}"\n')
    (repo / ".whl" / "zstd").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{_device_stubs(tmp_path)}:{os.environ['PATH']}", OUT=str(out),
               TMPDIR=str(tmp_path), GPU_TEST_WORKERS="0", JAX_PLATFORMS="cpu")
    run = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_tests.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "site" / "nvidia_cutlass_dsl" / "dsl_packages" / "marker.txt").exists()
    log = (out / "tests_full.log").read_text()
    assert "test_pallas_case PASSED" in log and "test_cutedsl_case FAILED" in log and "test_multi_case PASSED" in log
    assert "test_multi_process_case PASSED" in log
    assert "xla,pallas,cutedsl" in (out / "tests.log").read_text() and "NVIDIA Stub GPU" in (out / "gpu.txt").read_text()
    env.update(GPU_TESTS="tests/test_gpu_pallas.py", GPU_TESTS_K="no_such_test")
    run = subprocess.run(["bash", str(repo / "benchmarks" / "gpu_tests.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 5, run.stdout[-2000:]


@pytest.mark.filterwarnings("ignore")
def test_gpu_bench_script_runs_step_op_bench_and_summary_and_packs_its_files(tmp_path):
    """``gpu_bench.sh`` on the CPU: a tiny train step against plain JAX (a run with an option),
    the op bench (its arguments passed through), the summary; with more than 8 files under
    ``$OUT`` (the device tool returns 8), one archive of all of them, named to sort first."""
    import tarfile

    out = tmp_path / "out"
    (out / "tune").mkdir(parents=True)
    for i in range(6):
        (out / "tune" / f"f{i}.txt").write_text(str(i))
    env = dict(os.environ, PATH=f"{_device_stubs(tmp_path)}:{os.environ['PATH']}", OUT=str(out),
               TMPDIR=str(tmp_path), JAX_PLATFORMS="cpu", STEP_BENCH="tiny-1:2:16",
               STEP_RUNS="plain,xla:cross_entropy.save_logits=false", STEP_ARGS="--steps 1 --rounds 1",
               BENCH_PARTS="ops", LABEL="stub run")
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_bench.sh"), "--smoke", "--backends", "plain,xla",
                          "--ops", "norm_matmul"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "| xla:cross_entropy.save_logits=false |" in (out / "train_step.md").read_text()
    current = (out / "current.md").read_text()
    assert "Current numbers (stub run)" in current and "| tiny-1L 2x16 | xla:cross_entropy.save_logits=false |" in current
    assert re.search(r"\| norm_matmul d=256 \| [0-9.]+x \|", current)  # bench.py's arguments reached it
    assert sorted(p.name for p in out.iterdir())[0] == "0_all.tgz"
    with tarfile.open(out / "0_all.tgz") as tar:
        assert {"./current.md", "./bench.json", "./train_step.json", "./tune/f5.txt"} <= set(tar.getnames())


def test_kernel_plans_prints_each_calls_plan(capsys):
    """``benchmarks/kernel_plans.py`` prints one row per kernel call of the step with each
    variant's planned configuration; one output slot shows as ``1o``, an unknown variant is
    refused by name."""
    from benchmarks import kernel_plans
    from coda_jax.options import current_options
    from coda_jax.pallas.interpret import interpret_enabled

    before = current_options(), interpret_enabled()
    kernel_plans.main(["--model", "1b-1:8:1024", "--variants", "heuristic,one_out_slot"])
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ") and "program" not in l]
    assert len(rows) >= 8
    by_name = {(r.split(" | ")[0][2:], r.split(" | ")[2]): r.split(" | ")[3:] for r in rows}
    heuristic, one = by_name[("residual_rms", "8192x2048x2048")]
    assert heuristic.endswith("2o") and one.rstrip(" |").endswith("1o")
    assert ("rms_lse_logits", "8192x128256x2048") in by_name  # the logits are kept, as on the H100
    assert (current_options(), interpret_enabled()) == before  # restored
    # --options: the step traced without its logits kept (the recompute path's programs)
    kernel_plans.main(["--model", "1b-1:8:1024", "--variants", "heuristic", "--options",
                       "cross_entropy.save_logits=false"])
    recompute = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| ") and "program" not in l]
    assert not any(l.startswith("| rms_lse_logits |") for l in recompute)
    # A candidate with overrides, of the heuristic's configuration too (the autotuner's names)
    kernel_plans.main(["--model", "1b-1:8:1024", "--variants", "heuristic+epilogue_out_slots=1"])
    over = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| residual_rms | ")]
    assert over and all(l.rstrip(" |").endswith("1o") for l in over)
    for bad in ("heuristic,no_such_candidate", "one_out_slot+no_such_field=1"):
        with pytest.raises(SystemExit):
            kernel_plans.main(["--model", "1b-1:8:1024", "--variants", bad])
    with pytest.raises(SystemExit):
        kernel_plans.main(["--model", "1b-1:8:1024", "--options", "cross_entropy.save_logits=maybe"])


def test_write_hlo_strips_kernel_modules(tmp_path):
    """train_step_bench --hlo-out: each Mosaic GPU kernel's serialized module and hash are cut
    from the written schedule (escaped quotes inside them included), other lines are kept
    whole, and a line still over 8000 characters keeps its two ends."""
    import gzip

    from benchmarks import train_step_bench as tsb

    kernel = ('  %mpmd_map.1 = bf16[8,8]{1,0} custom-call(%p), custom_call_target="mosaic_gpu_v2", '
              'backend_config={kernel_hash = "\\12\\22\\ab", module = "ML\\EFR' + "x" * 50000 + '\\22tail", '
              'use_custom_barrier = false}, metadata={op_name="coda_rms_rope"}')
    long_line = "  %fusion.9 = f32[8]{0} fusion(%p), kind=kLoop, " + "y" * 9000 + " END"
    hlo = "\n".join(["HloModule m, is_scheduled=true", "ENTRY %main (p: bf16[8,8]) -> bf16[8,8] {", kernel,
                     long_line, "}"])
    tsb.write_hlo(hlo, tmp_path / "a" / "hlo_pallas.txt.gz")
    lines = gzip.open(tmp_path / "a" / "hlo_pallas.txt.gz", "rt").read().splitlines()
    assert lines[2] == ('  %mpmd_map.1 = bf16[8,8]{1,0} custom-call(%p), custom_call_target="mosaic_gpu_v2", '
                        'backend_config={kernel_hash = "<stripped>", module = "<stripped>", '
                        'use_custom_barrier = false}, metadata={op_name="coda_rms_rope"}')
    assert lines[3].startswith("  %fusion.9 = f32[8]{0} fusion(%p)") and lines[3].endswith(" END")
    assert " <...> " in lines[3] and len(lines[3]) == 6007
    assert lines[:2] == hlo.splitlines()[:2] and lines[4] == "}"
    assert tsb.file_name("pallas:xla_gpu_x=0+A=1") == "pallas_xla_gpu_x_0_A_1"


def test_fp8_accuracy_compares_window_means_against_the_first_run():
    from benchmarks.fp8_accuracy import compare

    ref = {"run": "plain", "losses": [4.0] * 100, "val_loss": 4.0}
    off = {"run": "xla:fp8", "losses": [4.0] * 75 + [4.2] * 25, "val_loss": 4.4}
    rows = compare([ref, off])
    assert rows[0]["max_window_rel"] == 0 and rows[0]["val_rel"] == 0
    assert abs(rows[1]["last_window_rel"] - 0.05) < 1e-9 and abs(rows[1]["max_window_rel"] - 0.05) < 1e-9
    assert abs(rows[1]["val_rel"] - 0.1) < 1e-9 and rows[1]["nonfinite_steps"] == 0
    # signed changes: above the reference is positive
    assert rows[1]["last_window_change"] == pytest.approx(0.05) and rows[1]["val_change"] == pytest.approx(0.1)
    below = compare([ref, dict(off, losses=[3.8] * 100, val_loss=3.6, saturated=[0, 2, 1, 0] * 25)])
    assert below[1]["last_window_change"] == pytest.approx(-0.05) and below[1]["val_change"] == pytest.approx(-0.1)
    assert below[1]["saturated_steps"] == 50 and rows[1]["saturated_steps"] is None


def test_fp8_accuracy_counts_saturated_tensors(capsys):
    """A delayed scale lets values through up to ``fp8_max / scale`` (scale a power of two of
    the history's max): a new amax beyond that saturated; rows without history do not count.
    A delayed-scaling run records each step's count, a current-scaling run none."""
    import numpy as np
    from flax import nnx

    from benchmarks import fp8_accuracy as fa
    from coda_jax.fp8 import E4M3, fp8_max, scale_from_history
    from coda_jax.layers import CodaLlama, LlamaConfig

    hist = np.array([[3.0, 1.0], [0.0, 0.0], [100.0, 5.0], [1.0, 1.0]], np.float32)
    bounds = [fp8_max(E4M3) / float(scale_from_history(h, E4M3)) for h in hist[[0, 2, 3]]]
    assert bounds == pytest.approx([3.5, 112.0, 1.75])
    new = np.array([[3.4, 3.0], [9.0, 0.0], [113.0, 100.0], [1.75, 1.0]], np.float32)
    assert fa.saturations([hist], [new]) == 1  # only 113 > 112 (row 1 has no history; 3.4 and 1.75 fit)
    assert fa.saturations([hist, hist], [new, hist]) == 1
    assert fa.saturated_rows([hist, hist], [hist, new]) == [(1, 2)]
    # a margin of 1 halves the scale: twice the headroom (113 < 224), 3.6 beyond row 0's 3.5 still fits
    margin_bounds = [fp8_max(E4M3) / float(scale_from_history(h, E4M3, 1)) for h in hist[[0, 2, 3]]]
    assert margin_bounds == pytest.approx([7.0, 224.0, 3.5])
    assert fa.saturations([hist], [new], margin=1) == 0
    assert fa.saturations([hist], [np.array([[7.1, 0], [0, 0], [224.5, 0], [3.4, 0]], np.float32)], margin=1) == 2
    cfg = LlamaConfig.tiny(vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           num_kv_heads=1, head_dim=16)
    ref = CodaLlama(cfg, rngs=nnx.Rngs(0), backend="xla")
    rng = np.random.default_rng(0)
    data = lambda: iter([(lambda t: (t[:, :-1], t[:, 1:]))(rng.integers(0, 64, (2, 17))) for _ in range(3)])  # noqa: E731
    val = data().__next__()
    r = fa.train("xla:fp8", cfg, ref, data, val, steps=3, lr=1e-3, warmup=1)
    assert len(r["saturated"]) == 3 and all(isinstance(c, int) and c >= 0 for c in r["saturated"])
    # per tensor: the steps each saturated in, named by block and row; their sum is the per-step counts'
    assert sum(r["saturated_by_tensor"].values()) == sum(r["saturated"])
    names = fa.tensor_names(nnx.state(CodaLlama(cfg.replace(fp8=fa.RECIPES["fp8"]), rngs=nnx.Rngs(0),
                                                backend="xla")))
    assert names == [[f"blocks/0/fp8_meta:{t}" for t in fa.TENSORS]]
    assert set(r["saturated_by_tensor"]) <= set(names[0])
    assert fa.most_saturated({"blocks/0/fp8_meta:y": 3, "blocks/1/fp8_meta:y": 2, "blocks/1/fp8_meta:o": 4}) == (
        "blocks/1/fp8_meta:o 4, blocks/0/fp8_meta:y 3, blocks/1/fp8_meta:y 2; per kind: y 5, o 4")
    assert "saturated" not in fa.train("xla:fp8-current", cfg, ref, data, val, steps=2, lr=1e-3, warmup=1)


def test_fp8_accuracy_over_seeds_and_recipes(capsys, tmp_path, monkeypatch):
    """--seeds: per run the largest difference over the seeds (losses averaged); runs take
    ':fp8' or ':fp8-current' (current scaling); a tiny run of two seeds end to end."""
    from benchmarks import fp8_accuracy as fa

    a = [{"run": "plain", "max_window_rel": 0.0, "last_window_rel": 0.0, "last_window_loss": 4.0, "val_loss": 4.0,
          "val_rel": 0.0, "nonfinite_steps": 0},
         {"run": "xla:fp8", "max_window_rel": 0.02, "last_window_rel": 0.01, "last_window_loss": 4.1,
          "val_loss": 4.2, "val_rel": 0.05, "nonfinite_steps": 1}]
    b = [dict(a[0]), dict(a[1], max_window_rel=0.03, last_window_rel=0.005, val_loss=4.0, val_rel=0.01,
                          nonfinite_steps=0)]
    rows = fa.worst_over_seeds([a, b])
    assert rows[1]["max_window_rel"] == 0.03 and rows[1]["last_window_rel"] == 0.01 and rows[1]["val_rel"] == 0.05
    assert rows[1]["val_loss"] == pytest.approx(4.1) and rows[1]["nonfinite_steps"] == 1
    assert fa.RECIPES["fp8-current"].scaling == "current" and fa.RECIPES["fp8"].scaling == "delayed"
    with pytest.raises(ValueError, match=":fp8-current"):
        fa._model("xla:fp16", None, None)
    with pytest.raises(ValueError, match=":fp8-current"):  # the plain FP8 ablations are the baseline's only
        fa._model("xla:forward", None, None)
    import jax.numpy as jnp
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig
    cfg = LlamaConfig.tiny(vocab_size=64, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           num_kv_heads=1, head_dim=16)
    ref = CodaLlama(cfg, rngs=nnx.Rngs(0), backend="xla")
    assert [fa._model(f"plain_fp8:{q}", cfg, ref).quantized for q in ("forward", "backward")] == ["forward", "backward"]
    assert fa._model("plain_fp8", cfg, ref).quantized == "both"
    # :f32, the float32-compute ground truth, for plain and a backend; the weights stay the reference's
    for run in ("plain:f32", "xla:f32"):
        m = fa._model(run, cfg, ref)
        assert m.config.dtype == jnp.float32 and m.embed[...].dtype == jnp.float32
        assert m.config.remat == "block"  # recomputed in the backward (the 1B float32 run, H100 memory)
        assert bool(jnp.array_equal(m.embed[...], ref.embed[...]))
    assert fa._model("plain", cfg, ref).config.dtype == cfg.dtype
    assert fa._model("plain", cfg, ref).config.remat == cfg.remat == "none"
    with pytest.raises(ValueError, match=":f32"):
        fa._model("plain_fp8:f32", None, None)
    rows = fa.main(["--steps", "2", "--batch", "2", "--seq", "16", "--layers", "1", "--runs", "xla,xla:fp8-current,xla:f32",
                    "--seeds", "0,1", "--lr", "1e-3", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert [r["run"] for r in rows] == ["xla", "xla:fp8-current", "xla:f32"] and rows[0]["val_rel"] == 0.0
    saved = json.loads((tmp_path / "fp8_accuracy.json").read_text())
    assert [[r["run"] for r in s] for s in saved["runs"]] == [["xla", "xla:fp8-current", "xla:f32"]] * 2
    assert saved["rows"] == rows
    # A call stopped in its third run keeps the two it ended (the JSON is written after each run).
    real, calls = fa.train, []
    monkeypatch.setattr(fa, "train", lambda *a, **k: (calls.append(1), real(*a, **k))[1] if len(calls) < 2
                        else (_ for _ in ()).throw(TimeoutError("stopped")))
    with pytest.raises(TimeoutError):
        fa.main(["--steps", "2", "--batch", "2", "--seq", "16", "--layers", "1", "--runs", "xla,xla:f32,plain",
                 "--out", str(tmp_path / "stopped")])
    stopped = json.loads((tmp_path / "stopped" / "fp8_accuracy.json").read_text())
    assert [r["run"] for r in stopped["runs"][0]] == ["xla", "xla:f32"] and stopped["rows"] is None
    assert "seed 1" in printed and "the largest difference over seeds 0,1" in printed and "lr 0.001" in printed


def test_fp8_block_gemms_time_each_fp8_call_against_the_bare_gemm(monkeypatch, tmp_path):
    # The FP8 step's kernel calls (traced with the Pallas kernels in the interpreter), each run
    # once on the xla backend beside the bare FP8 dot of its shape; the timer is stubbed. The
    # JSON is written as the rows come (a run stopped by a time limit keeps them).
    from benchmarks import fp8_gemms
    from coda_jax.pallas import interpret_mode

    monkeypatch.setattr(fp8_gemms, "median_ms", lambda f, *a, iters: (jax.block_until_ready(f(*a)), 2.0)[1])
    with interpret_mode():
        rows = fp8_gemms.block_gemms("1b-1:1:128", ["xla"], iters=1, out=tmp_path)
    gemms = [r for r in rows if not r.get("pass")]
    assert gemms and all(r["call"].split()[0].endswith("_fp8") for r in gemms)
    assert all(r["vs_bare"]["xla"] == 1.0 and r["bare_cublaslt_ms"] == 2.0 for r in gemms)
    # each call's floor: the bytes it moves at least at the copy's rate (2 x 4 MiB in 2.0 ms)
    # beside the bare GEMM; a fused call moves more than its two operands
    for r in gemms:
        m, n, k = map(int, r["call"].split()[2].split("x"))
        at_least = m * k + n * k + m * n  # FP8 operands, an output of one byte an element or more
        assert r["bytes"] >= at_least, r
        if r["call"].startswith("identity"):  # a bf16 output (and the operands' scales)
            assert 0 <= r["bytes"] - (m * k + n * k + 2 * m * n) < 1024, r
        assert r["bytes_ms"] == pytest.approx(r["bytes"] / (2 * (1 << 22) / 2.0))
        assert r["floor_ms"] == max(2.0, r["bytes_ms"]) and r["vs_floor"]["xla"] == 2.0 / r["floor_ms"]
    # then the step's quantizing passes: the four weights and the attention output (e4m3), the
    # last block's output gradient (e5m2), the first block's norm input (e4m3) and the QKV
    # gradient (e5m2), each against its XLA form
    passes = sorted(r["call"].split()[0] for r in rows if r.get("pass"))
    assert passes == ["quantize_e4m3"] * 5 + ["quantize_e5m2", "rms_input_q8", "rope_grad_q8"], passes
    assert all(r["vs_xla"] == {"xla": 1.0} for r in rows if r.get("pass"))
    assert json.loads((tmp_path / "fp8_block_gemms.json").read_text()) == rows
    # --programs: only those epilogues' calls
    with interpret_mode():
        some = fp8_gemms.block_gemms("1b-1:1:128", ["xla"], iters=1, only=frozenset({"identity_fp8", "quantize_e5m2"}))
    assert {r["call"].split()[0] for r in some} == {"identity_fp8", "quantize_e5m2"}


def test_fp8_gemms_cutedsl_is_the_cutedsl_kernels_own_fp8_path(monkeypatch):
    # "cutedsl" runs the FP8 GEMMs on the CuTeDSL kernel (its default), not on XLA.
    pytest.importorskip("cutlass")
    from benchmarks import fp8_gemms
    from coda_jax import backend as B

    real = B.backend_unavailable_reason  # a Hopper GPU for cutedsl and pallas, here
    monkeypatch.setattr(B, "backend_unavailable_reason", lambda n: None if n in ("cutedsl", "pallas") else real(n))
    assert fp8_gemms.backend_lowering("cutedsl").inner.fp8_kernel is True
    assert fp8_gemms.backend_lowering("pallas").inner.name == "pallas"


def test_kernel_module_stats_counts_each_variant():
    # The step's FP8 SwiGLU backward lowered for CUDA under two variants; the lean epilogue's
    # module has fewer barriers, shuffles and FP8 casts. A variant that cannot run a call says so.
    from benchmarks import kernel_module_stats as kms

    rows = kms.stats("1b-1:1:128:fp8", ["pingpong", "pingpong_lean"], {"swiglu_dgrad_q8_fp8"})
    assert [r["variant"] for r in rows] == ["pingpong", "pingpong_lean"] and not any("error" in r for r in rows), rows
    base, lean = rows
    assert base["program"] == "swiglu_dgrad_q8_fp8" and base["mnk"] == "128x8192x2048"
    for what in ("bar.sync", "shfl", "fp8 cast"):
        assert 0 < lean[what] < base[what], (what, lean[what], base[what])
    assert kms.module_counts("bar.sync $0, 128;\nnvvm.shfl.sync\n") == {**{k: 0 for k in kms.COUNTS}, "bar.sync": 1,
                                                                         "shfl": 1, "lines": 2}


def test_kernel_counters_summary_reads_ncu_raw_csv(tmp_path):
    # ncu's raw page: a header, a units row, a row per kernel; the stall columns found by name.
    from benchmarks import kernel_counters as kc

    cols = ["ID", "Kernel Name", kc.DURATION, kc.DRAM_PCT, kc.SM_PCT, kc.DRAM_RATE, kc.SPILLS, kc.REGISTERS,
            f"{kc.STALL_PREFIX}long_scoreboard{kc.STALL_SUFFIX}", f"{kc.STALL_PREFIX}barrier{kc.STALL_SUFFIX}",
            f"{kc.STALL_PREFIX}wait{kc.STALL_SUFFIX}"]
    units = ["", "", "ns", "%", "%", "byte/s", "", "register/thread", "", "", ""]
    row = ["0", "coda_swiglu_dgrad_q8_fp8_nt_8192x8192x2048", "500,000", "40.5", "55.0", "1,100,000,000,000.5",
           "580,832", "168", "1.5", "3.25", "0.5"]
    path = tmp_path / "raw.csv"
    path.write_text("\n".join(",".join(f'"{v}"' for v in r) for r in (cols, units, row)) + "\n")
    (k,) = kc.summarize(path, top_stalls=2)
    assert k["kernel"].startswith("coda_swiglu_dgrad")
    assert k["ms"] == pytest.approx(0.5) and k["dram_pct"] == pytest.approx(40.5)
    assert k["dram_gb"] == pytest.approx(0.55) and k["dram_tb_s"] == pytest.approx(1.1)
    assert k["registers"] == 168 and k["spill_requests"] == 580832
    assert k["stalls"] == [("barrier", 3.25), ("long_scoreboard", 1.5)]
    with pytest.raises(SystemExit, match="--shapes"):
        kc.parse_shapes("8192x2048")


def test_kernel_counters_launches_each_call_on_its_table_and_candidate_configs(tmp_path, monkeypatch):
    # The process ncu runs: each selected call launched on the table's configuration, then on
    # each named candidate that can run it, labelled in launch order (here in the interpreter).
    import jax.numpy as jnp

    from benchmarks import kernel_counters as kc
    from coda_jax import programs
    from coda_jax.pallas import interpret_mode
    from coda_jax.pallas.kernel_calls import KernelCall, record_kernel_calls

    sds = jax.ShapeDtypeStruct
    call = KernelCall(programs.quantize_q8("e4m3"), sds((128, 64), jnp.bfloat16), sds((256, 64), jnp.bfloat16),
                      (("q_scale", sds((), jnp.float32)), ("x", sds((128, 256), jnp.float32))), False, True, (),
                      (128, 256, 64))
    monkeypatch.setattr(kc, "selected_calls", lambda *a: [call])
    with interpret_mode(), record_kernel_calls() as ran:
        kc.launch("unused", ["quantize_e4m3"], set(), ["pingpong_lean"], tmp_path)
    assert ran == [call]  # run on the Pallas kernel (interpreted), not routed to XLA
    assert json.loads((tmp_path / "launches.json").read_text()) == [
        "quantize_e4m3 128x256x64 table", "quantize_e4m3 128x256x64 pingpong_lean"]
