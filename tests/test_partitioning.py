"""The fused ops under a device mesh (coda_jax.partitioning, coda_jax.sharding).

The multi-device checks run in subprocesses with 8 CPU devices
(``tests/multi_device_cases.py``): the device count is fixed when JAX starts, and the rest
of the suite runs on one.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import coda_jax as cj

from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.reference import REFERENCE
from coda_jax.sharding import fsdp_spec
from suite_options import suite_xla_flags

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    # The groups named *_auto and *_more run in the full tier only (tests/tiers.py).
    "ops": ["ops_dp_explicit", "cutedsl_lowers", "wgrad_partials"],
    "ops_auto": ["ops_dp_auto"],
    "fsdp_gathers": ["fsdp_gathers_xla", "fsdp_gathers_pallas"],
    "fsdp_gathers_more": ["fsdp_head_explicit", "embedding_explicit"],
    "fsdp_features": ["fsdp_features_xla", "fsdp_features_pallas"],
    # Pallas on the 2-D meshes only (its 8-way data / FSDP paths run on GPUs: tests/test_gpu_multi.py).
    "model_auto": ["model_xla_8_auto", "model_xla_2x4_auto", "model_pallas_2x4_auto"],
    "model_explicit": ["model_xla_8_explicit", "model_xla_2x4_explicit", "model_pallas_2x4_explicit",
                       "model_pallas_2x4_explicit_replicated"],  # the batch given unsharded
    # FP8 (LlamaConfig(fp8=...)): loss, gradients and amax histories against one device.
    "model_fp8": ["model_fp8_xla_8_auto", "model_fp8_xla_2x4_explicit", "model_fp8_pallas_2x4_auto"],
    # Data parallel FP8 wgrads contract each device's tokens: no gathered FP8 operands; under
    # FSDP the block weights are gathered as their e4m3 copies, not as float32 parameters; a
    # batch given unsharded (replicated) under an Explicit mesh trains as one device.
    "fp8_wgrads": ["fp8_wgrads_explicit", "fp8_fsdp_gathers_explicit", "model_fp8_pallas_8_explicit_replicated"],
    "fp8_wgrads_auto": ["fp8_wgrads_auto", "fp8_fsdp_gathers_auto"],
    # Fp8Recipe(swiglu_input="e4m3"): z saved in e4m3 under data and FSDP axes.
    "model_fp8_zq8": ["model_fp8_zq8_xla_2x4_explicit", "model_fp8_zq8_pallas_2x4_auto"],
    # FP8 under a tensor axis (the partitioner splits the FP8 block by the weights' tensor splits).
    "model_fp8_tensor": ["model_fp8_xla_2x2x2_auto", "model_fp8_xla_1x2x4_explicit",
                         "model_fp8_pallas_2x1x4_explicit"],
    # The FP8 LM head: token-split (GSPMD) and vocab-parallel over fsdp and over tensor.
    "model_fp8_head": ["model_fp8_head_xla_8_auto", "model_fp8_head_xla_2x4_explicit", "model_fp8_head_xla_2x2x2_auto",
                       "vocab_ce_fp8_2x4x1_explicit_fsdp_delayed", "vocab_ce_fp8_2x2x2_auto_tensor_current"],
    "vocab_parallel": ["vocab_ce_2x1x4_explicit", "vocab_ce_2x2x2_auto", "vocab_ce_2x4x1_auto_fsdp",
                       "vocab_ce_1x8x1_explicit_fsdp"],
    "step_bench": ["step_bench", "plain_explicit", "plain_tensor"],
    "kernel_cache": ["kernel_cache_auto", "kernel_cache_explicit"],
    # Pallas under Explicit (Auto tensor parallel on Pallas runs on GPUs: tests/test_gpu_multi.py).
    "tensor_parallel": ["tp_pallas_2x2x2_explicit_bfloat16", "tp_xla_2x1x4_explicit_float32", "tp_step_embedding"],
    "tensor_parallel_auto": ["tp_xla_2x2x2_auto_float32"],
}


_COMPILE_CACHE: dict[str, str] = {}


@pytest.fixture(autouse=True, scope="module")
def _subprocesses_share_compiles(subprocess_compile_cache):
    """The subprocesses below share one persistent compilation cache (conftest.py)."""
    _COMPILE_CACHE.update(subprocess_compile_cache)
    yield
    _COMPILE_CACHE.clear()


def _run_cases(cases, reset=()):
    """Runs ``tests/multi_device_cases.py`` on 8 CPU devices, with the options named in ``reset``
    back at the library's defaults (the suite's own otherwise)."""
    env = dict(os.environ, XLA_FLAGS=suite_xla_flags(devices=8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **_COMPILE_CACHE)
    flags = [f"--reset={','.join(reset)}"] if reset else []
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "multi_device_cases.py"), *flags, *cases],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout


@pytest.mark.parametrize("group", list(GROUPS))
def test_on_eight_devices(group):
    out = _run_cases(GROUPS[group])
    for case in GROUPS[group]:
        want = {"ops_dp_auto": "ops_data_parallel_auto", "ops_dp_explicit": "ops_data_parallel_explicit",
                "cutedsl_lowers": "cutedsl_lowers_under_mesh", "step_bench": "step_bench_on_meshes",
                "kernel_cache_auto": "kernel_cache_under_mesh_auto",
                "fp8_wgrads_auto": "fp8_wgrads_split_by_tokens_auto",
                "fp8_wgrads_explicit": "fp8_wgrads_split_by_tokens_explicit",
                "fp8_fsdp_gathers_auto": "fp8_fsdp_weight_gathers_auto",
                "fp8_fsdp_gathers_explicit": "fp8_fsdp_weight_gathers_explicit",
                "kernel_cache_explicit": "kernel_cache_under_mesh_explicit"}.get(case, case)
        assert f"OK {want}" in out, out


def test_mesh_fuzz():
    """Seeded random models on random meshes against one device
    (``tests/multi_device_cases.py::case_mesh_fuzz``, four draws a seed). The seeds:
    ``$CODA_JAX_MESH_FUZZ_SEEDS`` (comma-separated), default ``0`` (CI; more seeds by hand)."""
    seeds = [int(x) for x in os.environ.get("CODA_JAX_MESH_FUZZ_SEEDS", "0").split(",") if x.strip()]
    out = _run_cases([f"mesh_fuzz_{seed}" for seed in seeds])
    for seed in seeds:
        assert f"OK mesh_fuzz_{seed}" in out, out
    assert out.count("PASS draw") >= len(seeds), out  # most draws run (the rest are refused by a named rule)


def test_small_outputs_are_handed_to_xla_per_shard():
    """With the small-output rule on (its default; the suite turns it off for the kernel tests)
    every GEMM of these cases is small. The partitioner must still split them by tokens with
    ``shard_map`` and let each shard's lowering hand its GEMM to XLA: asked with the global
    shape, the rule had left the wgrad programs to XLA's partitioner, which gathered the
    tokens (the data-parallel case's all-gather check failed). The model case runs the
    Pallas lowering itself (interpret mode) on a data x FSDP mesh: every GEMM of its shards
    goes to XLA, and the loss and gradients still equal one device's."""
    out = _run_cases(["ops_dp_auto", "model_pallas_2x4_auto"], reset=("routing.xla_output_below",))
    assert "OK ops_data_parallel_auto" in out and "OK model_pallas_2x4_auto" in out, out


def test_fuses_epilogue_at_asks_about_each_devices_rows():
    """Ops choose their formulation with the global token count; a partitioned lowering asks
    its backend about each device's rows (what the backend's own lowering sees inside the
    ``shard_map``). An abstract mesh suffices: no GPU, no 8 devices."""
    from jax.sharding import AbstractMesh, AxisType

    from coda_jax.lowering import fuses_epilogue_at
    from coda_jax.pallas.lowering import PallasLowering
    from coda_jax.partitioning import PartitionedLowering

    cj.reset_options("routing")  # the library's default output bound, 2^22 elements
    lowering, epi = PartitionedLowering(PallasLowering()), programs.rms_dgrad(True)
    assert fuses_epilogue_at(lowering, epi, 4096, 2048, 8192)  # 2^23 elements: the kernel
    assert not fuses_epilogue_at(lowering, epi, 1024, 2048, 8192)  # 2^21: handed to XLA
    assert not fuses_epilogue_at(PartitionedLowering(REFERENCE), epi, 8192, 2048, 8192)  # the xla backend
    mesh = AbstractMesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    with jax.sharding.use_abstract_mesh(mesh):
        assert not fuses_epilogue_at(lowering, epi, 4096, 2048, 8192)  # 512 rows a device
        assert fuses_epilogue_at(lowering, epi, 4100, 2048, 8192)  # ragged: runs unpartitioned
        assert fuses_epilogue_at(lowering, epi, 16384, 2048, 8192)  # 2048 rows a device
    with cj.options(routing={"xla_output_below": 0}):
        assert fuses_epilogue_at(lowering, epi, 1024, 2048, 8192)
    from coda_jax.ffi.lowering import CuteDslLowering  # the same rule on the CuTeDSL backend

    cute = PartitionedLowering(CuteDslLowering())
    assert fuses_epilogue_at(cute, epi, 4096, 2048, 8192) and not fuses_epilogue_at(cute, epi, 1024, 2048, 8192)
    # Under FSDP with fewer than 1024 tokens a device every GEMM runs as XLA ops (partitioning.
    # fsdp_xla_tokens_below), whatever its output size; data parallel keeps the kernel.
    cj.reset_options("mesh.fsdp_xla_tokens_below")
    data = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.sharding.use_abstract_mesh(data):
        assert fuses_epilogue_at(lowering, epi, 4096, 16384, 2048)
    with jax.sharding.use_abstract_mesh(mesh):
        assert not fuses_epilogue_at(lowering, epi, 4096, 16384, 2048)  # 512 tokens a device
        assert fuses_epilogue_at(lowering, epi, 8192, 16384, 2048)  # 1024: split by tokens
    with cj.options(mesh={"fsdp_xla_tokens_below": 0}), jax.sharding.use_abstract_mesh(mesh):
        assert fuses_epilogue_at(lowering, epi, 4096, 16384, 2048)
    # Under FSDP with fewer tokens a device than mesh.fsdp_xla_gemms_below (default 4096)
    # the kernel backends' GEMMs run on the xla backend's lowering (split by tokens); data
    # parallel keeps the kernel.
    cj.reset_options("mesh.fsdp_xla_gemms_below")
    with jax.sharding.use_abstract_mesh(mesh):
        assert not fuses_epilogue_at(lowering, epi, 16384, 16384, 2048)  # 2048 tokens a device
        assert not fuses_epilogue_at(cute, epi, 16384, 16384, 2048)
        assert fuses_epilogue_at(lowering, epi, 32768, 16384, 2048)  # 4096
    with jax.sharding.use_abstract_mesh(data):
        assert fuses_epilogue_at(lowering, epi, 16384, 16384, 2048)
    with cj.options(mesh={"fsdp_xla_gemms_below": 0}), jax.sharding.use_abstract_mesh(mesh):
        assert fuses_epilogue_at(lowering, epi, 16384, 16384, 2048)


def test_train_example_on_meshes_matches_one_device(tmp_path):
    """Data parallel over 8 devices, resumed from its checkpoint on an FSDP mesh, then on a
    tensor-parallel mesh, then on an Explicit data x fsdp mesh: the same losses as one
    device."""
    import json

    sys.path.insert(0, str(ROOT / "examples"))
    import train_llama

    out = _run_cases(["train_mesh"])
    mesh_losses = json.loads(next(l for l in out.splitlines() if l.startswith("HISTORY "))[len("HISTORY "):])
    train_llama.main(["--batch", "8", "--seq", "32", "--layers", "1", "--vocab", "512", "--eval-every", "0",
                      "--ckpt-every", "0", "--steps", "10", "--out", str(tmp_path)])
    one = json.loads((tmp_path / "history.json").read_text())["loss"]
    assert len(mesh_losses) == 10
    np.testing.assert_allclose(mesh_losses, one, rtol=2e-5)


LINEAR = [epi for epi in vars(programs).values() if isinstance(epi, E.Epilogue) and epi.linear]


@pytest.mark.parametrize("epi", LINEAR, ids=lambda e: e.name)
def test_linear_declarations_hold(epi):
    """An epilogue declared linear gives, from two partial accumulators, outputs that add up
    to its outputs from their sum: what the partitioned wgrad's psum relies on."""
    m, n, k = 24, 40, 16
    ks = jax.random.split(jax.random.key(3), 4)
    a1, a2 = jax.random.normal(ks[0], (k, m)), jax.random.normal(ks[1], (k, m))
    b = jax.random.normal(ks[2], (k, n))
    loads = {l.name: jax.random.normal(jax.random.fold_in(ks[3], i),
                                       {E.LoadKind.ROW: (m,), E.LoadKind.COL: (n,), E.LoadKind.TILE: (m, n)}[l.kind])
             for i, l in enumerate(epi.loads)}
    f32 = {o.name: jnp.float32 for o in epi.outputs}
    kinds = {o.name: o.kind for o in epi.outputs}

    def f(a):  # partials of reductions summed: the values the ops use
        outs = REFERENCE.gemm(epi, a, b, loads, transpose_a=True, out_dtypes=f32)
        return {k: v if kinds[k] is E.OutputKind.TILE else v.sum(axis=0) for k, v in outs.items()}

    whole, p1, p2 = f(a1 + a2), f(a1), f(a2)
    for name in whole:
        np.testing.assert_allclose(p1[name] + p2[name], whole[name], rtol=1e-5, atol=1e-4)


def test_the_wgrad_programs_are_declared_linear():
    assert {e.name for e in LINEAR} == {"identity", "norm_wgrad"}


def test_fsdp_spec_splits_the_largest_divisible_dimension():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"))
    P = jax.sharding.PartitionSpec
    assert fsdp_spec((64, 256), mesh) == P(None, "fsdp")
    assert fsdp_spec((258, 6), mesh) == P()
    assert fsdp_spec((258, 8), mesh) == P(None, "fsdp")
    assert fsdp_spec((), mesh) == P()
    assert fsdp_spec((64, 256), jax.sharding.AbstractMesh((8,), ("data",))) == P()


def test_parameters_carry_logical_axis_names_that_shard_like_any_flax_model():
    """Every CodaLlama parameter (and its AdamW moments) carries logical names; under
    LOGICAL_AXIS_RULES they give FSDP over the width and Megatron TP over MLP features, heads
    and the vocabulary, dropping mesh axes that are absent or do not divide the dimension."""
    import optax
    from flax import nnx
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.sharding import logical_partition_specs

    cfg = LlamaConfig.tiny(vocab_size=250, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=16, qk_norm=True, tie_word_embeddings=False)
    model = CodaLlama(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    names = jax.tree.leaves(jax.tree.map(lambda v: v.get_metadata().get("out_sharding"), params,
                                         is_leaf=lambda v: isinstance(v, nnx.Variable)),
                            is_leaf=lambda x: isinstance(x, tuple))
    assert len(names) == len(jax.tree.leaves(params)) and all(isinstance(n, tuple) for n in names), names
    mesh = AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor"))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    specs = logical_partition_specs(nnx.state((model, opt)), mesh)
    sp = lambda v: v.get_value() if isinstance(v, nnx.Variable) else v  # noqa: E731
    blk = {k: sp(v) for k, v in specs[0]["blocks"][0].items()}
    # (FSDP joins the tensor split on the rows of w_down and w_o: sharding.rows_first.)
    assert blk["w_gu"] == P("fsdp", "tensor") and blk["w_down"] == P(("tensor", "fsdp"), None)
    assert blk["w_o"] == P(("tensor", "fsdp"), None) and blk["w_qkv"] == P("fsdp", None)
    assert blk["attn_norm"] == P() and blk["q_norm"] == P()
    # The vocabulary over "tensor" (the vocab-parallel head's split); 250 rows do not divide
    # by tensor x fsdp, so FSDP stays on the width.
    assert sp(specs[0]["lm_head"]) == P("tensor", "fsdp")
    assert sp(specs[1]["opt_state"][0]["mu"]["blocks"][0]["w_gu"]) == P("fsdp", "tensor")
    assert sp(specs[1]["opt_state"][0]["nu"]["blocks"][0]["w_down"]) == P(("tensor", "fsdp"), None)
    # A tensor axis of 128 divides the 384 gate/up columns but not the 192 rows of w_down.
    specs8 = logical_partition_specs(nnx.state(model), AbstractMesh((128,), ("tensor",)))
    assert sp(specs8["blocks"][0]["w_down"]) == P() and sp(specs8["blocks"][0]["w_gu"]) == P(None, "tensor")


def test_fsdp_split_choice_and_its_errors():
    """``choose_fsdp_split``: ``"features"`` up to 6144 tokens a step in each FSDP group (or
    fewer than ``fsdp_xla_tokens_below`` a device) on an Auto mesh with an FSDP axis and no
    tensor axis, else ``"width"``; a bad setting raises
    naming the option ``mesh.fsdp_split`` and the choices."""
    from jax.sharding import AbstractMesh, AxisType

    import coda_jax as cj
    from coda_jax.partitioning import auto_fsdp_split, choose_fsdp_split, features_split, fsdp_split, fsdp_split_as

    auto = lambda shape, names: AbstractMesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))  # noqa: E731
    assert choose_fsdp_split(auto((2,), ("fsdp",)), 6144) == "features"
    assert choose_fsdp_split(auto((2,), ("fsdp",)), 6145) == "width"
    assert choose_fsdp_split(auto((4,), ("fsdp",)), 8192) == "width"  # measured slower
    assert choose_fsdp_split(auto((2, 2), ("data", "fsdp")), 12288) == "features"  # 6144 a group
    assert choose_fsdp_split(auto((2, 2), ("data", "fsdp")), 16384) == "width"
    assert choose_fsdp_split(auto((8,), ("data",)), 1024) == "width"
    assert choose_fsdp_split(auto((2, 2), ("fsdp", "tensor")), 1024) == "width"
    explicit = AbstractMesh((2,), ("fsdp",), axis_types=(AxisType.Explicit,))
    assert choose_fsdp_split(explicit, 1024) == "width"
    assert choose_fsdp_split(None, 1024) == "width"
    # Scaled by the model: a block's weights over the width (1B 29,696: 6236 tokens; 8B 53,248:
    # 11,182, where 8192 tokens in the group measured faster with features).
    from coda_jax.layers import LlamaConfig

    one_b, eight_b = LlamaConfig.llama_3_2_1b(), LlamaConfig.llama_3_1_8b()
    assert one_b.block_weights_per_width == 29696 and eight_b.block_weights_per_width == 53248
    fsdp2 = auto((2,), ("fsdp",))
    assert choose_fsdp_split(fsdp2, 6144, one_b.block_weights_per_width) == "features"
    assert choose_fsdp_split(fsdp2, 8192, one_b.block_weights_per_width) == "width"
    assert choose_fsdp_split(fsdp2, 8192, eight_b.block_weights_per_width) == "features"
    assert choose_fsdp_split(fsdp2, 16384, eight_b.block_weights_per_width) == "width"
    # Fewer tokens a device than fsdp_xla_tokens_below (the suite sets it to 0,
    # tests/suite_options.py): every GEMM is left to the partitioner on either split, so the
    # features placement.
    fsdp8 = auto((8,), ("fsdp",))
    assert choose_fsdp_split(fsdp8, 8 * 1000) == "width"
    cj.reset_options("mesh.fsdp_xla_tokens_below")  # the library's default
    assert cj.current_options().mesh.fsdp_xla_tokens_below == 1024
    assert choose_fsdp_split(fsdp8, 8 * 1000) == "features" and choose_fsdp_split(fsdp8, 8 * 1024) == "width"
    assert choose_fsdp_split(auto((8,), ("data",)), 1024) == "width"
    assert fsdp_split() == "width" and not features_split(auto((2,), ("fsdp",)))
    with fsdp_split_as("features"):
        assert features_split(auto((2,), ("fsdp",))) and not features_split(auto((2, 2), ("fsdp", "tensor")))
        assert not features_split(auto((8,), ("data",)))
    assert fsdp_split() == "width"
    # "auto" (the example's --fsdp-split) chooses only where the option is not already set
    assert auto_fsdp_split(fsdp8, 8 * 1000) == "features"
    cj.set_options(mesh=cj.MeshOptions(fsdp_split="width"))
    assert auto_fsdp_split(fsdp8, 8 * 1000) is None and fsdp_split() == "width"
    with fsdp_split_as("features"):  # the context wins over the process setting
        assert fsdp_split() == "features"
    with pytest.raises(cj.OptionError, match=r"mesh.fsdp_split must be one of: 'width', 'features'; got 'rows'"):
        cj.set_options(mesh={"fsdp_split": "rows"})
    with pytest.raises(ValueError, match="mesh.fsdp_split must be one of"):
        with fsdp_split_as("embed"):
            pass


def test_features_split_places_weights_along_their_features():
    """With the features split, FSDP puts each block weight's split where plain JAX's
    largest-dimension rule puts its own (the MLP columns of ``w_gu``, rows of ``w_down``,
    the head rows of ``w_o``, the vocabulary; ``w_qkv`` along the width, as plain JAX's
    separate Q, K, V weights), the norms whole; a tensor axis keeps the width split and
    Megatron's."""
    from flax import nnx
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.partitioning import fsdp_split_as
    from coda_jax.sharding import logical_partition_specs

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
    state = nnx.state(CodaLlama(cfg, rngs=nnx.Rngs(0)))
    sp = lambda v: v.get_value() if isinstance(v, nnx.Variable) else v  # noqa: E731
    with fsdp_split_as("features"):
        specs = logical_partition_specs(state, AbstractMesh((2,), ("fsdp",)))
        tp = logical_partition_specs(state, AbstractMesh((2, 2), ("fsdp", "tensor")))
    blk = {k: sp(v) for k, v in specs["blocks"][0].items()}
    assert blk["w_gu"] == P(None, "fsdp") and blk["w_down"] == P("fsdp", None)
    assert blk["w_qkv"] == P("fsdp", None) and blk["w_o"] == P("fsdp", None) and blk["attn_norm"] == P()
    assert sp(specs["embed"]) == P("fsdp", None) and sp(specs["lm_head"]) == P("fsdp", None)
    assert sp(tp["blocks"][0]["w_gu"]) == P("fsdp", "tensor")


def test_width_split_places_every_weight_along_its_rows():
    """The width split (``sharding.rows_first``): every 2-D weight's FSDP split on its rows,
    where plain JAX's largest-dimension placement puts it (``w_o``, ``w_down`` and the
    embedding too, whose logical columns are the width); a vocabulary the axis does not
    divide keeps the split on the width. On a tensor mesh FSDP joins the tensor split of
    ``w_o`` and ``w_down``'s rows, tensor-major (``P(("tensor", "fsdp"), None)``: gathered
    over FSDP, each tensor shard's rows, as the block's ``shard_map`` takes them), and
    ``w_gu`` keeps Megatron's column split."""
    from flax import nnx
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from coda_jax.layers import CodaLlama, LlamaConfig
    from coda_jax.partitioning import fsdp_split_as
    from coda_jax.sharding import logical_partition_specs

    sp = lambda v: v.get_value() if isinstance(v, nnx.Variable) else v  # noqa: E731
    for vocab, head in ((256, P("fsdp", None)), (255, P(None, "fsdp"))):
        cfg = LlamaConfig.tiny(vocab_size=vocab, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4,
                               num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
        state = nnx.state(CodaLlama(cfg, rngs=nnx.Rngs(0)))
        with fsdp_split_as("width"):
            specs = logical_partition_specs(state, AbstractMesh((2, 2), ("data", "fsdp")))
            tp = logical_partition_specs(state, AbstractMesh((2, 2), ("fsdp", "tensor")))
        blk = {k: sp(v) for k, v in specs["blocks"][0].items()}
        assert {k: blk[k] for k in ("w_qkv", "w_o", "w_gu", "w_down")} == dict.fromkeys(
            ("w_qkv", "w_o", "w_gu", "w_down"), P("fsdp", None)), blk
        assert sp(specs["embed"]) == head and sp(specs["lm_head"]) == head and blk["attn_norm"] == P()
        tblk = {k: sp(v) for k, v in tp["blocks"][0].items()}
        assert tblk["w_down"] == tblk["w_o"] == P(("tensor", "fsdp"), None), tblk
        assert tblk["w_gu"] == P("fsdp", "tensor") and tblk["w_qkv"] == P("fsdp", None), tblk
        # The vocabulary over "tensor" too, FSDP beside it on the rows where they divide.
        tp_head = P(("tensor", "fsdp"), None) if vocab % 4 == 0 else P(None, "fsdp")
        assert sp(tp["embed"]) == tp_head and sp(tp["lm_head"]) == tp_head
        t_only = logical_partition_specs(state, AbstractMesh((2,), ("tensor",)))
        assert sp(t_only["embed"]) == (P("tensor", None) if vocab % 2 == 0 else P())
