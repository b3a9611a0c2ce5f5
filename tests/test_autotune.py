"""The Pallas backend's tuned table (lookup, validation) and the autotuner's CPU-side parts:
the kernel-call log, candidates, the choice of winners, table merging. The GPU timing itself
runs in ``benchmarks/tune.py --model`` on the device; every shipped entry runs through
``tests/test_gpu_pallas.py::test_shipped_tuned_configs_on_gpu``."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import coda_jax as cj

from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.pallas import autotune as at
from coda_jax.pallas import lowering
from coda_jax.pallas import tuned as T
from coda_jax.pallas.kernel_calls import record_kernel_calls
from coda_jax.pallas.tuning import CONFIG_TABLE
from op_cases import PASS_PROGRAMS

H100 = "NVIDIA H100 80GB HBM3"


def _table(entries, kinds=(H100,), sms=132):
    return {"device_kinds": list(kinds), "num_sms": sms, "entries": entries}


def _entry(program="rms_rope", layout="nn", m=8192, n=3072, k=2048, **config):
    return {"program": program, "layout": layout, "m": m, "n": n, "k": k, "config": config}


@pytest.fixture
def table_file(tmp_path):
    """Writes a table and points the option pallas.tuned_tables at it (process-wide; the
    suite's fixture resets options after each test)."""

    def write(data):
        p = tmp_path / f"t{len(list(tmp_path.iterdir()))}.json"
        p.write_text(json.dumps(data))
        cj.set_options(pallas=cj.PallasOptions(tuned_tables=(str(p),)))
        return p

    return write


def test_lookup_takes_the_nearest_entry_within_a_factor_of_two():
    t = T.parse_table(_table([_entry(m=8192, grid_minor_dim="m"), _entry(m=2048, grid_tile_width=8),
                              _entry(layout="tn", cluster_dimension=None)]), "t")
    assert t.lookup("rms_rope", "nn", 8192, 3072, 2048).config.grid_minor_dim == "m"
    assert t.lookup("rms_rope", "nn", 6000, 3072, 2048).config.grid_minor_dim == "m"  # log-nearer to 8192
    assert t.lookup("rms_rope", "nn", 3000, 3072, 2048).config.grid_tile_width == 8
    assert t.lookup("rms_rope", "nn", 8192, 3072, 5000) is None  # K off by more than 2x
    assert t.lookup("rms_rope", "tn", 8192, 3072, 2048).config.cluster_dimension is None
    assert t.lookup("residual_rms", "nn", 8192, 3072, 2048) is None
    # the fields not named keep the default's values
    e = t.lookup("rms_rope", "nn", 8192, 3072, 2048)
    assert e.config == dataclasses.replace(CONFIG_TABLE["default"], grid_minor_dim="m")


def test_promoted_gemms_take_only_entries_measured_promoted(table_file):
    """A promoting FP8 GEMM runs another plan (halved consumer tiles): an entry measured
    unpromoted does not serve it, nor a promoted entry an unpromoted GEMM or one promoted at
    another interval."""
    t = T.parse_table(_table([_entry(grid_minor_dim="m"), _entry(grid_tile_width=8) | {"promote_k": 512}]), "t")
    assert t.lookup("rms_rope", "nn", 8192, 3072, 2048).config.grid_minor_dim == "m"
    assert t.lookup("rms_rope", "nn", 8192, 3072, 2048, promote_k=512).config.grid_tile_width == 8
    assert t.lookup("rms_rope", "nn", 8192, 3072, 2048, promote_k=128) is None
    table_file(_table([_entry(grid_minor_dim="m")]))
    args = ("rms_rope", 8192, 3072, 2048, False, False, H100, 132)
    assert T.tuned_config(*args).grid_minor_dim == "m" and T.tuned_config(*args, promote_k=512) is None
    with pytest.raises(ValueError, match="entry 0: promote_k must be a non-negative int"):
        T.parse_table(_table([_entry() | {"promote_k": -128}]), "t")


def test_promoted_rows_keep_their_interval_through_the_table(tmp_path):
    row = _row(1.0, band8=0.8) | {"promote_k": 512}
    entry = at.best_entry(row)
    assert entry["promote_k"] == 512 and at.row_key(entry) == at.row_key(row) != at.row_key(_row(1.0))
    assert "promote_k" not in at.best_entry(_row(1.0, band8=0.8))  # unpromoted entries as before
    p = tmp_path / "t.json"
    at.write_table(at.table_from_rows([_row(1.0, band8=0.8)], H100, 132), p, merge=False)
    at.write_table(at.table_from_rows([row], H100, 132), p)  # the same GEMM promoted: a second entry
    got = T.parse_table(json.loads(p.read_text()), "t")
    assert sorted(e.promote_k for e in got.entries) == [0, 512]


def _quantize_call(dtype, m=8192, n=2048):
    """The epilogue pass quantize_e4m3 over an [m, n] tile load ``x`` of ``dtype`` (as the FP8
    block runs it on a float32 weight or a bf16 activation)."""
    zeros = jax.ShapeDtypeStruct((m, 64), jnp.bfloat16)
    return at.KernelCall(programs.quantize_q8("e4m3"), zeros, jax.ShapeDtypeStruct((n, 64), jnp.bfloat16),
                         (("q_scale", jax.ShapeDtypeStruct((), jnp.float32)),
                          ("x", jax.ShapeDtypeStruct((m, n), dtype))),
                         False, True, (), (m, n, 64))


def test_loads_signature_names_the_tile_loads_dtypes():
    """Tile loads only, in name order, a load given as column parts by its parts' dtype."""
    q8 = programs.quantize_q8("e4m3")
    assert T.loads_signature(q8, {"x": jnp.float32, "q_scale": jnp.float32}) == "x:float32"
    assert T.loads_signature(q8, {"x": jnp.zeros((2, 2), jnp.bfloat16), "q_scale": 1.0}) == "x:bfloat16"
    rope = programs.rope_grad_q8(32)
    tiles = {"qkv": jax.ShapeDtypeStruct((8, 64), jnp.bfloat16),
             "dqkv": tuple(jax.ShapeDtypeStruct((8, 32), jnp.float16) for _ in range(2))}
    assert T.loads_signature(rope, {**tiles, "rstd": jnp.float32}) == "dqkv:float16,qkv:bfloat16"
    assert T.loads_signature(programs.RMS_LSE, {}) == ""  # no tile loads
    with pytest.raises(ValueError, match=r"'quantize_e4m3': no dtype for its tile loads \['x'\]"):
        T.loads_signature(q8, {"q_scale": jnp.float32})
    # the autotuner keys a call by the same signature
    assert at.call_key(_quantize_call(jnp.float32))[-1] == "x:float32"


def test_entries_with_a_loads_signature_serve_only_their_dtypes(table_file, monkeypatch):
    """Two entries of one shape measured on float32 and bf16 tile loads: each GEMM takes its
    own (a lookup that ignored the signature would give both the first); an entry without a
    signature serves the other dtypes, and loses to an exact signature at equal distance."""
    gemm = dict(program="quantize_e4m3", layout="nt", m=8192, n=2048, k=64)
    f32 = _entry(**gemm, grid_tile_width=8) | {"loads": "x:float32"}
    bf16 = _entry(**gemm, grid_minor_dim="m") | {"loads": "x:bfloat16"}
    anyd = _entry(**gemm, cluster_dimension=None)
    t = T.parse_table(_table([anyd, f32, bf16]), "t")
    look = lambda sig, m=8192: t.lookup("quantize_e4m3", "nt", m, 2048, 64, 0, sig)  # noqa: E731
    assert look("x:float32").loads == "x:float32" and look("x:bfloat16").loads == "x:bfloat16"
    assert look("x:float16").loads is None and look(None).loads is None
    assert look("x:float32", m=6000).loads == "x:float32"  # nearby shapes too
    assert T.parse_table(_table([f32]), "t").lookup("quantize_e4m3", "nt", 8192, 2048, 64, 0, "x:bfloat16") is None
    # Through the lowering: the GEMM's loads pick the entry (quantize_e4m3 holds no pair block).
    table_file(_table([f32, bf16]))
    monkeypatch.setattr(lowering, "_default_device", lambda: _FakeGpu())
    monkeypatch.setattr(lowering, "_num_sms", lambda interpret: 4 if interpret else 132)
    epi = programs.quantize_q8("e4m3")
    for dtype, want in ((jnp.float32, ("n", 8)), (jnp.bfloat16, ("m", CONFIG_TABLE["default"].grid_tile_width))):
        call = _quantize_call(dtype)
        cfg = lowering.PallasLowering.default_config(epi, *call.mnk, False, True, interpret=False,
                                                     loads=dict(call.loads))
        assert (cfg.grid_minor_dim, cfg.grid_tile_width) == want, dtype
        # the benchmarks' plans look it up alike
        from benchmarks.kernel_plans import H100_SMS, variant_config

        assert variant_config("table", call, H100_SMS) == cfg


def test_kernel_plans_plans_fp8_calls_on_the_fp8_heuristics():
    """``benchmarks/kernel_plans.py``'s ``heuristic`` (and a table miss) for a GEMM of FP8
    operands is the lowering's: the FP8 heuristics (a quantizing epilogue over K <= 4096 on
    ping-pong) with the K step doubled, not the 16-bit choice."""
    from benchmarks.kernel_plans import H100_SMS, variant_config

    m, n, k = 8192, 2048, 2048
    fp8 = jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn)
    call = at.KernelCall(programs.quantize_q8("e4m3"), fp8, jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
                         (("q_scale", jax.ShapeDtypeStruct((), jnp.float32)),
                          ("x", jax.ShapeDtypeStruct((m, n), jnp.bfloat16))), False, True, (), (m, n, k))
    cfg = variant_config("heuristic", call, H100_SMS)
    assert cfg == lowering.table_or_heuristic_config(call.epilogue, m, n, k, False, True, None, H100_SMS,
                                                     fp8_operands=True, loads=dict(call.loads))
    assert cfg.pingpong and cfg.tile_k == 2 * CONFIG_TABLE["default"].tile_k


def test_kernel_gemm_looks_up_with_its_loads(monkeypatch):
    """``PallasLowering.kernel_gemm`` hands its loads (here a column-split tile load) to the lookup."""
    seen = []

    class Stop(Exception):
        pass

    def spy(epilogue, *a, loads=None, **kw):
        seen.append(T.loads_signature(epilogue, loads))
        raise Stop

    monkeypatch.setattr(lowering.PallasLowering, "default_config", staticmethod(spy))
    x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
    a, b = jax.ShapeDtypeStruct((128, 64), jnp.bfloat16), jax.ShapeDtypeStruct((128, 64), jnp.bfloat16)
    low = lowering.PallasLowering()
    with pytest.raises(Stop):
        jax.eval_shape(lambda a, b, x: low.kernel_gemm(programs.quantize_q8("e4m3"), a, b,
                                                       {"x": (x, x), "q_scale": jnp.float32(1)}, (128, 128, 64),
                                                       transpose_a=False, transpose_b=True, out_dtypes=None,
                                                       out_splits={}), a, b, x)
    assert seen == ["x:float32"]


def _old_lookup(table, program, layout, m, n, k, promote_k):
    """The lookup before tile-load signatures: the first nearest entry of the program, layout and
    promotion interval (the reference for entries without a signature)."""
    best, best_d = None, None
    for e in table.entries:
        if e.program != program or e.layout != layout or e.promote_k != promote_k or e.loads is not None:
            continue
        d = e.distance(m, n, k)
        if d is not None and (best_d is None or d < best_d):
            best, best_d = e, d
    return best


@pytest.mark.parametrize("path", [p for p in T.SHIPPED_TABLES if p.name == "tuned_h200.json"], ids=lambda p: p.name)
def test_shipped_entries_serve_every_gemm_as_before_signatures(path):
    """Backward compatibility: each entry of the shipped table written without a loads'
    signature answers its own GEMM as the lookup before signatures did (the first of duplicate
    entries too), whatever signature the GEMM has (none, or any the table has no entry for)."""
    t = T.load_table(str(path))
    plain = [e for e in t.entries if e.loads is None]
    assert len(plain) >= 50
    signed = {e.loads for e in t.entries}
    for e in plain:
        key = (e.program, e.layout, e.m, e.n, e.k, e.promote_k)
        want = _old_lookup(t, *key)
        assert want is not None
        for sig in (None, "", "x:float32", "x:bfloat16", "dqkv:bfloat16,qkv:bfloat16"):
            if sig not in signed:
                got = t.lookup(*key, sig)
                assert got is want, (key, sig)
                dims = key[2:5]
                ta, tb = e.layout[0] == "t", e.layout[1] == "t"
                with cj.options(pallas={"tuned_tables": (str(path),)}):
                    assert T.tuned_config(e.program, *dims, ta, tb, t.device_kinds[0], t.num_sms,
                                          promote_k=e.promote_k, loads=sig) == want.config


def test_merge_tells_entries_apart_by_their_loads(tmp_path):
    """The autotuner writes each entry's signature, and a merge replaces an old entry by one of
    the same signature, or one without a signature (a table from before signatures) by one with:
    a float32 entry does not replace a bf16 one."""
    row = lambda sig, ms: _row(1.0, band8=ms) | ({"loads": sig} if sig else {})  # noqa: E731
    entry = at.best_entry(row("x:float32", 0.8))
    assert entry["loads"] == "x:float32" and "loads" not in at.best_entry(row(None, 0.8))
    assert at.row_key(entry) != at.row_key(row("x:bfloat16", 0.8)) != at.row_key(row(None, 0.8))
    p = tmp_path / "t.json"
    at.write_table(at.table_from_rows([row(None, 0.8), row("x:bfloat16", 0.8)], H100, 132), p, merge=False)
    at.write_table(at.table_from_rows([row("x:float32", 0.7)], H100, 132), p)
    ms = {e.get("loads"): e["ms"] for e in json.loads(p.read_text())["entries"]}
    assert ms == {"x:bfloat16": 0.8, "x:float32": 0.7}  # the unsigned entry gave way, the bf16 one stayed
    at.write_table(at.table_from_rows([row("x:bfloat16", 0.6)], H100, 132), p)
    got = T.parse_table(json.loads(p.read_text()), "t")
    assert sorted((e.loads or "", e.config is not None) for e in got.entries) == [
        ("x:bfloat16", True), ("x:float32", True)]
    ms = {e.get("loads"): e["ms"] for e in json.loads(p.read_text())["entries"]}
    assert ms == {"x:bfloat16": 0.6, "x:float32": 0.7}


@pytest.mark.parametrize("data,match", [
    ({"entries": {}}, "'entries' list"),
    ({"device_kinds": "H100", "num_sms": 132, "entries": []}, "device_kinds"),
    ({"device_kinds": [H100], "num_sms": "132", "entries": []}, "num_sms"),
    (_table([{"program": "x", "layout": "nn", "m": 1, "n": 1}]), "entry 0: needs program"),
    (_table([_entry(layout="xn")]), "entry 0: layout must be"),
    (_table([_entry(tile_q=64)]), r"unknown TuningConfig fields \['tile_q'\]"),
    (_table([_entry(schedule="zigzag")]), "entry 0: invalid configuration"),
    (_table([_entry() | {"loads": 3}]), "entry 0: 'loads' must be the tile loads' dtypes"),
    (_table([_entry(), _entry() | {"loads": "x"}]), "entry 1: 'loads' must be"),
    (_table([_entry() | {"loads": "x:float99"}]), "entry 0: 'loads' must be"),
    (_table([_entry() | {"loads": "y:float32,x:float32"}]), "entry 0: 'loads' must be"),  # not in name order
])
def test_a_malformed_table_names_the_rule(data, match):
    with pytest.raises(ValueError, match=match):
        T.parse_table(data, "my.json")


def test_tuned_config_applies_only_where_measured(table_file, monkeypatch):
    table_file(_table([_entry(grid_minor_dim="m"), _entry(program="rms_swiglu_train", n=16384, tile_n=64)]))
    args = ("rms_rope", 8192, 3072, 2048, False, False)
    assert T.tuned_config(*args, H100, 132).grid_minor_dim == "m"
    assert T.tuned_config(*args, "NVIDIA H200", 132) is None  # another GPU kind
    assert T.tuned_config(*args, H100, 114) is None  # another SM count (H100 PCIe): other waves
    assert T.tuned_config("rms_rope", 8192, 3072, 2048, True, False, H100, 132) is None  # another layout
    # an entry whose tile cannot hold the epilogue's pair block is skipped
    assert T.tuned_config("rms_swiglu_train", 8192, 16384, 2048, False, False, H100, 132, pair_width=128) is None
    with T.tables_disabled():
        assert T.tuned_config(*args, H100, 132) is None
    with cj.options(pallas={"tuned_tables": "none"}):
        assert T.tuned_config(*args, H100, 132) is None
    with cj.options(pallas={"tuned_tables": ("/nonexistent/table.json",)}):
        with pytest.raises(ValueError, match="pallas.tuned_tables: '/nonexistent/table.json': no such file"):
            T.tuned_config(*args, H100, 132)


def test_each_gpu_kind_takes_its_own_shipped_table(tmp_path, monkeypatch):
    """With the option pallas.tuned_tables="shipped" every shipped table is looked at, and the one measured
    on the GPU's kind (and SM count) answers; a GPU no table lists gets the heuristics."""
    h100, h200 = tmp_path / "tuned_h100.json", tmp_path / "tuned_h200.json"
    h100.write_text(json.dumps(_table([_entry(grid_minor_dim="m")])))
    h200.write_text(json.dumps(_table([_entry(cluster_dimension=None)], kinds=("NVIDIA H200",))))
    monkeypatch.setattr(T, "SHIPPED_TABLES", (h100, h200))
    args = ("rms_rope", 8192, 3072, 2048, False, False)
    assert T.tuned_config(*args, H100, 132).grid_minor_dim == "m"
    got = T.tuned_config(*args, "NVIDIA H200", 132)
    assert got.cluster_dimension is None and got.grid_minor_dim == CONFIG_TABLE["default"].grid_minor_dim
    assert T.tuned_config(*args, "NVIDIA A100-SXM4-80GB", 108) is None
    with cj.options(pallas={"tuned_tables": (str(h100),)}):  # the option names one table: only it applies
        assert T.tuned_config(*args, "NVIDIA H200", 132) is None


def test_an_h100_table_is_shipped():
    assert any(Path(p).name == "tuned_h100.json" for p in T.SHIPPED_TABLES), T.SHIPPED_TABLES
    assert T.table_file_name(H100) == "tuned_h100.json" and T.table_file_name("NVIDIA H200") == "tuned_h200.json"
    assert T.table_file_name("NVIDIA H100 PCIe") == "tuned_h100.json"
    assert T.table_file_name("Some GPU") == "tuned_some_gpu.json"


@pytest.mark.parametrize("path", T.SHIPPED_TABLES, ids=lambda p: p.name)
def test_shipped_table_is_valid(path):
    """Each of the package's tables parses, is named for the GPU kinds it lists, and every
    entry names a program the library has."""
    t = T.load_table(str(path))
    names = {e.name for e in (programs.RESIDUAL_RMS, programs.rms_swiglu(True), programs.rms_swiglu(False),
                              programs.rms_rope(64, None, False), programs.rms_rope(64, 1e-6, True),
                              programs.RMS_LSE, programs.RMS_LSE_LOGITS, programs.rms_dgrad(True),
                              programs.rms_dgrad(False), programs.CE_GRAD, programs.ACCUMULATE, programs.NORM_WGRAD,
                              programs.SWIGLU_DGRAD, programs.IDENTITY, programs.RESIDUAL, programs.ROW_SCALE)}
    # The FP8 block's programs on FP8 operands (E.dequantized: "<name>_fp8").
    names |= {E.dequantized(e).name for e in (programs.IDENTITY, programs.RESIDUAL_RMS, programs.RESIDUAL_RMS_Q8,
                                              programs.rms_swiglu_q8(True), programs.SWIGLU_DGRAD_Q8,
                                              programs.rms_swiglu_q8(True, True), programs.SWIGLU_DGRAD_ZQ8,
                                              programs.rms_dgrad_q8(True), programs.rms_dgrad(True, True),
                                              programs.rms_rope(32, None, False), programs.RMS_LSE_LOGITS,
                                              programs.RMS_LSE, programs.CE_GRAD, programs.ACCUMULATE)}
    # The epilogue passes (16-bit zero operands): the FP8 block's QKV gradient, the FP8 LM head's
    # dlogits, the standalone quantizing passes, the first block's norm input.
    names |= {programs.rope_grad_q8(32).name, programs.CE_GRAD_Q8.name, programs.quantize_q8("e4m3").name,
              programs.quantize_q8("e5m2").name, programs.RMS_INPUT_Q8.name}
    assert names >= set(PASS_PROGRAMS), set(PASS_PROGRAMS) - names
    assert t.entries and {e.program for e in t.entries} <= names
    assert t.num_sms == 132 and {T.table_file_name(k) for k in t.device_kinds} == {path.name}, t.device_kinds


class _FakeGpu:
    platform = "gpu"
    device_kind = H100
    core_count = 132


def test_pallas_lowering_takes_the_tuned_config_on_a_listed_gpu(table_file, monkeypatch):
    table_file(_table([_entry(program="residual_rms", grid_minor_dim="m", grid_tile_width=8)]))
    monkeypatch.setattr(lowering, "_default_device", lambda: _FakeGpu())
    monkeypatch.setattr(lowering, "_num_sms", lambda interpret: 4 if interpret else 132)
    epi = programs.RESIDUAL_RMS
    cfg = lowering.PallasLowering.default_config(epi, 8192, 3072, 2048, False, False, interpret=False)
    assert (cfg.grid_minor_dim, cfg.grid_tile_width) == ("m", 8)
    # no entry: the heuristics (the shape-class table, the wave fit)
    other = lowering.PallasLowering.default_config(epi, 8192, 3072, 16384, False, False, interpret=False)
    assert other == CONFIG_TABLE["default"]
    # the interpreter never takes a table
    assert lowering.PallasLowering.default_config(epi, 8192, 3072, 2048, False, False, interpret=True).grid_minor_dim == "n"


def test_kernel_calls_of_a_model_step(monkeypatch):
    """The recorder sees each distinct kernel call of a CodaLlama training step, traced
    abstractly (nothing runs), with shapes, layouts and loads."""
    from benchmarks import tune

    monkeypatch.setenv("CODA_JAX_PALLAS_INTERPRET", "1")

    step, args = tune.model_step("1b-2:2:512")
    calls = at.kernel_calls(step, *args)
    by = {(c.epilogue.name, c.transpose_a, c.transpose_b, c.mnk) for c in calls}
    assert ("rms_rope", False, False, (1024, 3072, 2048)) in by  # QKV: 32 + 2*8 heads of 64
    assert ("norm_wgrad", True, False, (2048, 16384, 1024)) in by  # gate/up wgrad over the tokens
    assert ("rms_swiglu_train", False, False, (1024, 16384, 2048)) in by
    assert len(calls) == len(set(calls))  # distinct (two layers make the same calls)
    rope = next(c for c in calls if c.epilogue.name == "rms_rope")
    assert dict(rope.loads)["cos"].shape == (1024, 32)
    with record_kernel_calls() as outer:  # nothing is recorded outside a recorder...
        pass
    assert outer == []


def test_candidates_respect_the_pair_block():
    step_call = lambda epi: at.KernelCall(epi, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),  # noqa: E731
                                          jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), (), False, False, (),
                                          (256, 512, 256))
    swiglu = at.candidate_configs(step_call(programs.rms_swiglu(True)))
    assert swiglu and all(c.tile_n % 128 == 0 for c in swiglu.values())
    assert "narrow" not in swiglu and "narrow" in at.candidate_configs(step_call(programs.RESIDUAL_RMS))
    with pytest.raises(ValueError, match="unknown candidate 'bogus'"):
        at.candidate_configs(step_call(programs.RESIDUAL_RMS), ["bogus"])


def test_candidate_names_take_field_overrides():
    # "base+field=value": a known candidate with TuningConfig fields changed, so a sweep can try
    # a winner's neighbours (its tile band, its stages) without a new named candidate.
    call = at.KernelCall(programs.RESIDUAL_RMS, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                         jax.ShapeDtypeStruct((256, 512), jnp.bfloat16), (), False, False, (), (256, 512, 256))
    name = "pingpong_minor_m+grid_tile_width=16+pingpong_turns=true+cluster_dimension=none"
    got = at.candidate_configs(call, ["pingpong_minor_m", name])
    base = at.known_candidates()["pingpong_minor_m"]
    assert got[name] == dataclasses.replace(base, grid_tile_width=16, pingpong_turns=True, cluster_dimension=None)
    assert got[name] != got["pingpong_minor_m"]
    for bad, rule in [("bogus+grid_tile_width=8", "unknown candidate 'bogus'"),
                      ("default+tile_q=8", "TuningConfig field"), ("default+grid_tile_width", "TuningConfig field"),
                      ("default+grid_tile_width=wide", "takes an integer"),
                      ("default+pingpong_turns=2", "true or false"),
                      ("default+schedule=serial", "schedule must be")]:
        with pytest.raises(ValueError, match=rule):
            at.candidate_configs(call, [bad])
    # "heuristic+...": the call's own heuristic configuration (as the tuner times it) with overrides;
    # an FP8 call's K step doubled after, as every candidate's.
    from coda_jax.lowering import gpu_sm_count
    from coda_jax.pallas.lowering import heuristic_config, table_or_heuristic_config

    heur = heuristic_config(programs.RESIDUAL_RMS, 256, 512, 256, gpu_sm_count())
    assert heur == table_or_heuristic_config(programs.RESIDUAL_RMS, 256, 512, 256, False, False, None, gpu_sm_count())
    got = at.candidate_configs(call, ["heuristic+grid_minor_dim=m"])
    assert got == {"heuristic+grid_minor_dim=m": dataclasses.replace(heur, grid_minor_dim="m")}
    fp8 = dataclasses.replace(call, epilogue=E.dequantized(programs.IDENTITY),
                              a=jax.ShapeDtypeStruct((256, 256), jnp.float8_e4m3fn),
                              b=jax.ShapeDtypeStruct((512, 256), jnp.float8_e4m3fn), loads=(), transpose_b=True)
    heur8 = heuristic_config(fp8.epilogue, 256, 512, 256, gpu_sm_count(), fp8_operands=True)
    got8 = at.candidate_configs(fp8, ["heuristic+grid_tile_width=8"])["heuristic+grid_tile_width=8"]
    assert got8 == dataclasses.replace(heur8, grid_tile_width=8, tile_k=2 * heur8.tile_k)
    with pytest.raises(ValueError, match="needs \\+field=value overrides"):
        at.candidate_configs(call, ["heuristic"])
    # A table entry won by such a name is an incumbent of the next sweep ("heuristic" alone is not).
    entry = {"program": "residual_rms", "layout": "nn", "m": 256, "n": 512, "k": 256, "config": {}, "ms": 1.0,
             "heuristic_ms": 1.1}
    for cand, want in [(name, [name]), ("heuristic+grid_minor_dim=m", ["heuristic+grid_minor_dim=m"]),
                       ("heuristic", [])]:
        assert list(at.incumbents({"entries": [dict(entry, candidate=cand)]}).values()) == want


def test_fp8_calls_get_candidates_with_the_fp8_k_step():
    # An FP8 call is timed with each candidate's K step doubled (as the heuristics run FP8), so
    # that its table entry holds what was measured; K steps under 64 (FP8 rows < 128 B) are left out.
    from coda_jax import epilogue as E

    fp8 = jnp.float8_e4m3fn
    call = at.KernelCall(E.dequantized(programs.IDENTITY), jax.ShapeDtypeStruct((256, 256), fp8),
                         jax.ShapeDtypeStruct((512, 256), fp8), (("acc_scale", jax.ShapeDtypeStruct((), jnp.float32)),),
                         False, True, (), (256, 512, 256))
    got = at.candidate_configs(call, ["all"])
    bf16 = at.candidate_configs(dataclasses.replace(call, a=jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                                                    b=jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)), ["all"])
    assert got and set(got) == {n for n, c in bf16.items() if c.tile_k >= 64}
    assert all(got[n].tile_k == 2 * bf16[n].tile_k for n in got)
    assert "k32" in bf16 and "k32" not in got


def test_promoted_candidates_only_for_promoting_calls():
    fp8 = jnp.float8_e4m3fn
    call = at.KernelCall(E.dequantized(programs.IDENTITY), jax.ShapeDtypeStruct((1024, 8192), fp8),
                         jax.ShapeDtypeStruct((1024, 8192), fp8), (("acc_scale", jax.ShapeDtypeStruct((), jnp.float32)),),
                         False, True, (), (1024, 1024, 8192), promote_k=512)
    got = at.candidate_configs(call, ["promoted"])
    sums = {n for n, c in at.PROMOTED_CANDIDATES.items() if c.consumer_col_sums}  # column-sum programs only
    assert sums and set(got) == set(at.PROMOTED_CANDIDATES) - sums and got["k128"].tile_k == 256  # FP8: K step x2
    dgamma = dataclasses.replace(call, epilogue=E.dequantized(programs.rms_dgrad_q8(True)))
    assert sums <= set(at.candidate_configs(dgamma, ["promoted"]))
    assert at.candidate_configs(dataclasses.replace(call, promote_k=0), ["promoted"]) == {}
    # What runs: the consumer tile halved to two accumulators' registers, the ring's mainloop.
    planned = at.planned_config(call, got["k128"])
    assert planned.tile_m * planned.tile_n <= 64 * 128 and planned.tile_k == 256 and planned.delay_release == 1
    assert at.planned_config(dataclasses.replace(call, promote_k=0), got["k128"]).tile_m == 128


def test_combined_compares_a_quantizing_outputs_copy_and_amax():
    epi = programs.RESIDUAL_RMS_Q8
    outs = {"x": jnp.ones((4, 8)), "h": jnp.ones((4, 8)), "h_t": jnp.ones((8, 4)),
            "h_amax": jnp.array([[1.0, 2.0, 0.5, 1.0], [3.0, 0.0, 1.0, 1.0]]), "sumsq": jnp.ones((2, 4))}
    got = at.combined(epi, outs)
    assert set(got) == {"x", "h", "h_t", "h_amax", "sumsq"}
    assert got["h_amax"].tolist() == [3.0, 2.0, 1.0, 1.0] and got["h_t"].shape == (8, 4)


def test_random_arguments_fit_the_call():
    call = at.KernelCall(programs.RMS_LSE, jax.ShapeDtypeStruct((64, 128), jnp.bfloat16),
                         jax.ShapeDtypeStruct((1000, 128), jnp.bfloat16),
                         (("rstd", jax.ShapeDtypeStruct((64,), jnp.float32)),
                          ("target", jax.ShapeDtypeStruct((64,), jnp.int32))), False, True, (), (64, 1000, 128))
    a, b, loads = at.random_arguments(call)
    assert a.shape == (64, 128) and b.shape == (1000, 128) and a.dtype == jnp.bfloat16
    t = loads["target"]
    assert t.dtype == jnp.int32 and int(t.min()) >= 0 and int(t.max()) < 1000 and len(set(t.tolist())) > 10
    r = loads["rstd"]
    assert float(r.min()) >= 0.5 and float(r.max()) < 1.5 and float(jnp.std(r)) > 0.1


def test_max_relative_error_flags_wrong_and_nan_outputs():
    ref = {"y": jnp.arange(1.0, 9.0), "lse": jnp.array([1.0, -jnp.inf])}
    assert at.max_relative_error(ref, ref) == 0.0  # -inf in both: ignored
    assert at.max_relative_error({**ref, "y": ref["y"] * 1.01}, ref) == pytest.approx(0.01, rel=1e-3)
    assert math.isinf(at.max_relative_error({**ref, "y": ref["y"].at[3].set(jnp.nan)}, ref))


def _row(heuristic, **results):
    return {"program": "p", "layout": "nn", "m": 1, "n": 2, "k": 3, "heuristic_ms": heuristic,
            "results": {k: ({"ms": v, "config": {"grid_tile_width": 8}} if isinstance(v, float) else {"error": v})
                        for k, v in results.items()}}


def test_best_entry_needs_a_real_gain():
    e = at.best_entry(_row(1.0, default=1.0, band8=0.9, pingpong="outputs differ"))
    assert e["candidate"] == "band8" and e["ms"] == 0.9 and e["config"] == {"grid_tile_width": 8}
    # 1 % is within the noise; nothing ran: the heuristic stays, marked as measured
    for row in (_row(1.0, default=0.99), _row(1.0, pingpong="SMEM")):
        e = at.best_entry(row)
        assert e["config"] is None and e["candidate"] == "heuristic" and e["ms"] == 1.0


def test_a_heuristic_entry_keeps_the_heuristic_and_blocks_neighbours(table_file):
    """A GEMM measured without a winner keeps the heuristics even next to an entry that won."""
    table_file(at.table_from_rows([_row(1.0, band8=0.8) | {"m": 4096},
                                   _row(1.0, band8=0.99) | {"m": 8192}], H100, 132))
    assert T.tuned_config("p", 8192, 2, 3, False, False, H100, 132) is None
    assert T.tuned_config("p", 4096, 2, 3, False, False, H100, 132).grid_tile_width == 8
    assert T.tuned_config("p", 3000, 2, 3, False, False, H100, 132).grid_tile_width == 8  # nearest: 4096


def test_write_table_merges_and_validates(tmp_path):
    p = tmp_path / "t.json"
    old = _table([_entry(m=1024, grid_tile_width=8), _entry(m=8192, grid_tile_width=16)])
    at.write_table(old, p, merge=False)
    new = _table([_entry(m=8192, grid_minor_dim="m")], kinds=(H100, "NVIDIA H100 PCIe"))
    at.write_table(new, p)
    got = json.loads(p.read_text())
    assert sorted((e["m"], tuple(e["config"])) for e in got["entries"]) == [(1024, ("grid_tile_width",)),
                                                                            (8192, ("grid_minor_dim",))]
    assert got["device_kinds"] == [H100, "NVIDIA H100 PCIe"]
    at.write_table(_table([_entry(m=4096)], sms=114), p)  # another SM count: replaces
    assert [e["m"] for e in json.loads(p.read_text())["entries"]] == [4096]
    with pytest.raises(ValueError, match="unknown TuningConfig fields"):
        at.write_table(_table([_entry(bogus=1)]), p)


def test_autotune_refuses_a_cpu():
    with pytest.raises(RuntimeError, match="on a GPU"):
        at.autotune(lambda x: x, jnp.ones(3))


def test_partials_are_combined_before_comparing():
    """Row-sum / LSE partials have one row per tile: a narrower tile gives more rows, the
    same combination."""
    x = jax.random.normal(jax.random.key(0), (8, 64))
    wide = {"sumsq": x.reshape(4, 2, 64).sum(1), "x": x, "h": x}  # 4 tiles of 2 "columns" each
    narrow = {"sumsq": x, "x": x, "h": x}  # 8 tiles of 1
    assert at.max_relative_error(at.combined(programs.RESIDUAL_RMS, wide),
                                 at.combined(programs.RESIDUAL_RMS, narrow)) < 1e-6
    lse4 = {"lse": jax.nn.logsumexp(x.reshape(4, 2, 64), axis=1), "target_logit": wide["sumsq"]}
    lse8 = {"lse": x, "target_logit": x}
    assert at.max_relative_error(at.combined(programs.RMS_LSE, lse4), at.combined(programs.RMS_LSE, lse8)) < 1e-6
    assert math.isinf(at.max_relative_error(wide, narrow))  # uncombined: the shapes differ


def test_tune_call_checks_each_candidate_against_the_heuristic(monkeypatch):
    """End to end in the interpreter, with a wall-clock timer: the candidates run and are
    timed, one that fails to lower is recorded as an error, and one whose outputs differ
    from the heuristic's is rejected, not timed."""
    import time as _time

    from coda_jax.pallas import interpret_mode

    monkeypatch.setitem(at.CANDIDATES, "broken", dataclasses.replace(CONFIG_TABLE["default"], tile_n=4096))
    call = at.KernelCall(programs.RESIDUAL_RMS, jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                         jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
                         (("gamma", jax.ShapeDtypeStruct((256,), jnp.float32)),
                          ("residual", jax.ShapeDtypeStruct((256, 256), jnp.bfloat16))), False, False, (),
                         (256, 256, 256))
    real_runner = at._runner

    def runner(c, cfg):  # the "band8" candidate returns x off by 1 %
        run, timed = real_runner(c, cfg)
        if cfg is at.CANDIDATES["band8"]:
            return (lambda a, b, l: {**run(a, b, l), "x": run(a, b, l)["x"] * 1.01}), timed
        return run, timed

    monkeypatch.setattr(at, "_runner", runner)
    calls = []

    def wall_ms(fn, *args, iters):
        calls.append(iters)
        t = _time.perf_counter()
        jax.block_until_ready(fn(*args))
        return (_time.perf_counter() - t) * 1e3

    with interpret_mode():
        row = at.tune_call(call, ["default", "band8", "broken"], iters=3, log=lambda s: None, timer=wall_ms)
    r = row["results"]
    assert r["default"]["ms"] > 0 and r["default"]["config"] == {}
    assert "differ from the heuristic" in r["band8"]["error"] and "ms" not in r["band8"]
    assert "error" in r["broken"]
    assert row["heuristic_ms"] > 0 and calls == [3, 3]  # the heuristic and "default" only
    assert (row["program"], row["layout"], row["m"]) == ("residual_rms", "nn", 256)


def test_tune_call_checks_a_candidate_on_several_launches_on_a_gpu(monkeypatch):
    """On a GPU a candidate's outputs are checked on CHECK_LAUNCHES launches: one that is wrong
    only on its second launch (a race) is rejected. Elsewhere one launch is checked."""
    from coda_jax.pallas import interpret_mode

    call = at.KernelCall(programs.IDENTITY, jax.ShapeDtypeStruct((128, 128), jnp.bfloat16),
                         jax.ShapeDtypeStruct((128, 128), jnp.bfloat16), (), False, False, (), (128, 128, 128))
    real_runner = at._runner
    launches = []

    def runner(c, cfg):  # the "band8" candidate is off by 1 % on its second launch only
        run, timed = real_runner(c, cfg)
        if cfg is not at.CANDIDATES["band8"]:
            return run, timed

        def flaky(a, b, l):
            launches.append(1)
            out = run(a, b, l)
            return {**out, "out": out["out"] * 1.01} if len(launches) == 2 else out
        return flaky, timed

    monkeypatch.setattr(at, "_runner", runner)
    timer = lambda fn, *args, iters: 1.0  # noqa: E731
    with interpret_mode():
        row = at.tune_call(call, ["band8"], iters=1, log=lambda s: None, timer=timer)
        assert "ms" in row["results"]["band8"] and launches == [1]  # the CPU: one launch checked
        launches.clear()
        monkeypatch.setattr(at.jax, "default_backend", lambda: "gpu")
        row = at.tune_call(call, ["band8"], iters=1, log=lambda s: None, timer=timer)
    assert "differ from the heuristic" in row["results"]["band8"]["error"]
    assert len(launches) == at.CHECK_LAUNCHES


def test_extended_candidates_lower_for_cuda():
    """Every candidate the tuner may time (the extended set too) lowers for CUDA for a
    heavy-epilogue program, so a tuning run on the GPU does not spend its time on configs that
    cannot compile."""
    from op_cases import abstract_loads

    call = at.KernelCall(programs.rms_dgrad(True), jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
                         jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16), (), False, True, (), (1024, 1024, 512))
    cands = at.candidate_configs(call, ["all"])
    # Summand tiles or consumers' own sums for column sums only where the program has one (else
    # the same kernel again).
    col_tiles = {n for n, c in at.EXTENDED_CANDIDATES.items() if c.col_sum_tiles or c.consumer_col_sums}
    # Passes without their GEMM only for programs that ignore the accumulator (lowered on passes
    # in test_pallas_fp8.test_passes_without_their_gemm_lower_for_cuda).
    no_gemm = {n for n, c in at.EXTENDED_CANDIDATES.items() if c.skip_pass_gemm}
    assert col_tiles and no_gemm and set(cands) == (set(at.CANDIDATES) | set(at.EXTENDED_CANDIDATES)) - col_tiles - no_gemm
    assert list(at.candidate_configs(call, ["extended", "slots3"])) == [
        n for n in at.EXTENDED_CANDIDATES if n not in col_tiles | no_gemm]  # no repeats
    dgamma = dataclasses.replace(call, epilogue=programs.rms_dgrad(True, True))
    assert col_tiles <= set(at.candidate_configs(dgamma, ["all"]))
    a_pass = dataclasses.replace(call, epilogue=programs.quantize_q8("e4m3"))
    assert no_gemm <= set(at.candidate_configs(a_pass, ["all"]))
    # The base candidates differ from each other in tile order, cluster, schedule and tile
    # width: these three cover their kernel bodies (the rest lower in other tests' models).
    lowered = [(call, k, cands[k]) for k in ("default", "pingpong", "narrow_no_cluster")]
    lowered += [(dgamma if n in col_tiles else call, n, c) for n, c in at.EXTENDED_CANDIDATES.items()
                if n not in no_gemm]
    for c, name, cfg in lowered:
        low = lowering.PallasLowering(cfg)
        f = jax.jit(lambda a, b, l: low.gemm(c.epilogue, a, b, l, transpose_b=True))
        txt = f.trace(c.a, c.b, abstract_loads(c.epilogue, 1024, 1024)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in txt, name


def test_tune_model_spec_fp8_zq8_tunes_the_z_programs(monkeypatch):
    """``--model ...:fp8-zq8``: the step under ``Fp8Recipe(swiglu_input="e4m3")``, whose kernel
    calls are the z-writing forward and the z-reading SwiGLU backward (the table keys them apart)."""
    from benchmarks import tune

    monkeypatch.setenv("CODA_JAX_PALLAS_INTERPRET", "1")
    names = {c.epilogue.name for c in at.kernel_calls(*_flat(tune.model_step("1b-1:2:512:fp8-zq8")))}
    assert {"rms_swiglu_q8_train_zq8_fp8", "swiglu_dgrad_zq8_fp8"} <= names, names
    assert not {"rms_swiglu_q8_train_fp8", "swiglu_dgrad_q8_fp8"} & names, names


def _flat(step_args):
    fn, args = step_args
    return (fn, *args)


@pytest.mark.parametrize("spec", ["1b:8", "huge:8:1024", "1b:x:1024"])
def test_tune_model_spec_errors_name_the_format(spec):
    from benchmarks import tune

    with pytest.raises(ValueError, match=r"preset\[-layers\]:batch:seq"):
        tune.model_step(spec)


_RESIDUAL_LOAD = (("residual", jax.ShapeDtypeStruct((8, 8), jnp.bfloat16)),)


def _fake_sweep(monkeypatch, calls, ms, **fields):
    """:func:`autotune` on a fake GPU over ``calls``, each call's candidates timed by a fake
    ``tune_call`` at ``ms(name)`` (the heuristic at 1.0; ``fields``: more fields of each row).
    Returns the list that receives ``(mnk, sorted candidate names)`` per call measured."""
    monkeypatch.setattr(at.jax, "local_devices", lambda: [_FakeGpu()])
    monkeypatch.setattr(at, "kernel_calls", lambda fn, *a: list(calls))
    measured = []

    def fake_tune(call, names, *a):
        measured.append((call.mnk, sorted(names)))
        return {"program": call.epilogue.name, "layout": "nn", "m": call.mnk[0], "n": 8, "k": 8, "heuristic_ms": 1.0,
                **fields, "results": {n: {"ms": ms(n), "config": {}} for n in names}}

    monkeypatch.setattr(at, "tune_call", fake_tune)
    return measured


def _residual_calls():
    """Two residual_rms calls, 8 and 16 rows."""
    c1 = at.KernelCall(programs.RESIDUAL_RMS, jax.ShapeDtypeStruct((8, 8), jnp.bfloat16),
                       jax.ShapeDtypeStruct((8, 8), jnp.bfloat16), _RESIDUAL_LOAD, False, False, (), (8, 8, 8))
    return c1, dataclasses.replace(c1, mnk=(16, 8, 8))


def test_autotune_resumes_only_calls_with_every_wanted_candidate(monkeypatch):
    """``rows`` from an earlier run: a call with all wanted candidates is not measured again;
    one that lacks some is measured again in full (old candidates too, in the same run)."""
    measured = _fake_sweep(monkeypatch, _residual_calls(), lambda n: 0.5 if n == "band8" else 1.0,
                           loads="residual:bfloat16")
    sig = {"loads": "residual:bfloat16"}
    old = [{"program": "residual_rms", "layout": "nn", "m": 8, "n": 8, "k": 8, **sig, "heuristic_ms": 1.0,
            "results": {"default": {"ms": 1.0, "config": {}}, "band8": {"ms": 0.9, "config": {}}}},
           {"program": "residual_rms", "layout": "nn", "m": 16, "n": 8, "k": 8, **sig, "heuristic_ms": 1.0,
            "results": {"pingpong": {"ms": 0.9, "config": {}}}}]
    rows = [dict(r) for r in old]
    table = at.autotune(lambda: None, names=["default", "band8"], rows=rows, log=lambda s: None)
    assert measured == [((16, 8, 8), ["band8", "default", "pingpong"])]  # c1 had both: skipped
    assert len(rows) == 2 and rows[0] == old[0] and sorted(rows[1]["results"]) == ["band8", "default", "pingpong"]
    assert [e["candidate"] for e in table["entries"]] == ["band8", "band8"]


def test_autotune_measures_each_gemms_incumbent_beside_the_sweep(monkeypatch):
    """A sweep of other candidates also times the table's current winner of each GEMM (and
    only that GEMM's), so the entry written is the best of both; skipped programs are not
    measured and get no entry. The table's entries have no loads' signature (tables from before
    signatures): they stand for the GEMM's calls of any tile-load dtypes."""
    c1, c2 = _residual_calls()
    c3 = dataclasses.replace(c1, epilogue=programs.RMS_LSE, mnk=(32, 8, 8))
    measured = _fake_sweep(monkeypatch, (c1, c2, c3), lambda n: 0.5 if n == "pingpong" else 0.9)
    table = {"entries": [{"program": "residual_rms", "layout": "nn", "m": 8, "n": 8, "k": 8, "candidate": "pingpong"},
                         {"program": "residual_rms", "layout": "nn", "m": 16, "n": 8, "k": 8, "candidate": "heuristic"}]}
    assert at.incumbents(table) == {("residual_rms", "nn", 8, 8, 8, 0, None): "pingpong"}
    out = at.autotune(lambda: None, names=["slots3"], log=lambda s: None, incumbent=at.incumbents(table),
                      skip_programs=("rms_lse",))
    assert measured == [((8, 8, 8), ["pingpong", "slots3"]), ((16, 8, 8), ["slots3"])]
    assert [(e["m"], e["candidate"]) for e in out["entries"]] == [(8, "pingpong"), (16, "slots3")]
    # Only the GEMMs the table has no entry for (its heuristic-kept entry counts as one).
    measured.clear()
    assert at.table_keys(table) == {("residual_rms", "nn", 8, 8, 8, 0, None), ("residual_rms", "nn", 16, 8, 8, 0, None)}
    out = at.autotune(lambda: None, names=["slots3"], log=lambda s: None, skip_keys=at.table_keys(table))
    assert measured == [((32, 8, 8), ["slots3"])]
    assert [(e["program"], e["m"]) for e in out["entries"]] == [("rms_lse", 32)]


def test_neighbours_are_tried_on_each_gemms_incumbent_and_heuristic(monkeypatch):
    """``neighbours``: every GEMM also times its incumbent and its own heuristic configuration
    with each neighbour's overrides (a neighbour's field replacing the incumbent's own override
    of it); without ``names`` only those and the incumbents are timed; a bad neighbour is
    refused before anything is traced."""
    bases = ["a+grid_tile_width=16+tile_k=128", "heuristic"]
    nbs = ("grid_tile_width=8", "grid_minor_dim=m+pingpong_turns=true")
    assert at.neighbour_names(bases, nbs) == [
        "a+grid_tile_width=8+tile_k=128", "a+grid_tile_width=16+tile_k=128+grid_minor_dim=m+pingpong_turns=true",
        "heuristic+grid_tile_width=8", "heuristic+grid_minor_dim=m+pingpong_turns=true"]
    measured = _fake_sweep(monkeypatch, _residual_calls(), lambda n: 0.5 if n == "heuristic+grid_minor_dim=m" else 0.9)
    table = {"entries": [{"program": "residual_rms", "layout": "nn", "m": 8, "n": 8, "k": 8,
                          "candidate": "pingpong+grid_tile_width=16"}]}
    out = at.autotune(lambda: None, log=lambda s: None, incumbent=at.incumbents(table),
                      neighbours=("grid_tile_width=8", "grid_minor_dim=m"))
    assert measured == [((8, 8, 8), sorted(["pingpong+grid_tile_width=16", "pingpong+grid_tile_width=8",
                                            "pingpong+grid_tile_width=16+grid_minor_dim=m",
                                            "heuristic+grid_tile_width=8", "heuristic+grid_minor_dim=m"])),
                        ((16, 8, 8), ["heuristic+grid_minor_dim=m", "heuristic+grid_tile_width=8"])]
    assert [e["candidate"] for e in out["entries"]] == ["heuristic+grid_minor_dim=m"] * 2
    measured.clear()
    with pytest.raises(ValueError, match="neighbours: .*TuningConfig field"):
        at.autotune(lambda: None, log=lambda s: None, neighbours=("tile_q=8",))
    assert measured == []


def test_sustained_timer_heats_before_timing(monkeypatch):
    """``sustained_kernel_ms`` calls the kernel back to back for ``heat_s`` seconds, then
    returns the CUPTI timer's reading taken after the heat; with ``log`` it also reports the
    burst time taken before the heat and the clock."""
    import time as _time

    events = []
    readings = iter([0.50, 0.60])  # burst (cool GPU), then sustained (power-capped)

    def fake_kernel_ms(fn, *args, iters):
        events.append(("timed", iters))
        return next(readings)

    def kernel(x):
        events.append("call")
        return x

    monkeypatch.setattr(at, "kernel_ms", fake_kernel_ms)
    monkeypatch.setattr(at, "_gpu_clock", lambda: "1500 MHz, 699.00 W")
    lines = []
    t = _time.perf_counter()
    ms = at.sustained_kernel_ms(kernel, jnp.ones(4), iters=7, heat_s=0.05, log=lines.append)
    assert _time.perf_counter() - t >= 0.05
    assert ms == 0.60
    assert events[0] == ("timed", 7) and events[-1] == ("timed", 7)
    assert events[1:-1] and all(e == "call" for e in events[1:-1])  # the heat, between the two timings
    assert lines == ["HEAT burst 0.5000 ms, sustained 0.6000 ms (0.833x), 1500 MHz, 699.00 W"]
    events.clear()
    readings = iter([0.70])
    assert at.sustained_kernel_ms(kernel, jnp.ones(4), iters=3, heat_s=0.0) == 0.70  # no log: no burst timing
    assert events == [("timed", 3)] or events == ["call", ("timed", 3)]


@pytest.mark.parametrize("spec,names", [
    ("1b-1:8:1024", ["default", "one_out_slot", "direct_loads_one_out_slot"]),
    # in FP8: the promoted backward GEMMs (K >= 8192) plan halved tiles
    ("1b-1:8:1024:fp8", ["default", "pingpong", "k128", "pingpong_k128"]),
])
def test_planned_config_is_what_the_lowering_builds(monkeypatch, spec, names):
    """:func:`autotune.planned_config` (no GPU, no operands) plans every kernel call of a
    one-layer 1B step as :class:`PallasLowering` does when it builds the call, for the
    default configuration and two that free SMEM (in FP8: promoted calls too, the plain
    GEMMs' kept on the kernel for it: by default they run on cuBLASLt)."""
    from benchmarks.tune import model_step

    monkeypatch.setenv("CODA_JAX_PALLAS_INTERPRET", "1")
    fn, args = model_step(spec)
    with cj.options(routing=cj.RoutingOptions(plain_gemm="kernel")):
        _check_planned_configs(at.kernel_calls(fn, *args), names, spec, monkeypatch)


def _check_planned_configs(calls, names, spec, monkeypatch) -> None:
    """The body of :func:`test_planned_config_is_what_the_lowering_builds` on ``calls``."""
    from coda_jax.pallas import lowering as pl_lowering

    assert len(calls) >= 8
    built = []
    orig = pl_lowering.plan_epilogue

    def spy(*a, **k):  # records the configuration the lowering plans
        epi, cfg = orig(*a, **k)
        built.append(cfg)
        return epi, cfg

    monkeypatch.setattr(pl_lowering, "plan_epilogue", spy)
    checked = promoted = 0
    for call in calls:
        promote = {"promote_k": call.promote_k} if call.promote_k else {}
        for name, cfg in at.candidate_configs(call, names).items():
            low = lowering.PallasLowering(cfg)
            built.clear()
            jax.eval_shape(lambda a, b, l: low.gemm(call.epilogue, a, b, l, transpose_a=call.transpose_a,
                                                    transpose_b=call.transpose_b, out_dtypes=dict(call.out_dtypes),
                                                    **promote),
                           call.a, call.b, dict(call.loads))
            assert built == [at.planned_config(call, cfg)], (call.epilogue.name, call.mnk, name)
            checked += 1
            promoted += bool(call.promote_k)
    fp8 = spec.endswith(":fp8")  # an unpromoted FP8 call runs "default" and "pingpong" alone
    assert checked >= (2 if fp8 else 3) * len(calls) - 3
    assert promoted >= (20 if fp8 else 0)
