"""GPU suite (H100): every epilogue program through the compiled Pallas kernel, against the
reference backend, under four configurations (the single-warpgroup kernel, the table's
warp-specialized default, a swizzled split-M variant and a 2-CTA cluster with multicast
TMA), at sizes that exercise the
persistent grid.

Outputs are poisoned: before each kernel runs, NaN-filled buffers of the output sizes are
allocated and freed, so an output element the kernel fails to write keeps a NaN from the
allocator and fails ``rel_err``'s finiteness check.
"""

import dataclasses

import jax.numpy as jnp
import pytest

from coda_jax import programs
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig
from op_cases import PASS_PROGRAMS, poison_allocator
from test_pallas_kernels import CASES, _compare, record_grids

pytestmark = pytest.mark.gpu

CONFIGS = {
    "single_wg": TuningConfig(),
    "warp_specialized": CONFIG_TABLE["default"],
    "ws_split_m_swizzled": dataclasses.replace(CONFIG_TABLE["default"], wg_dimension="m", swizzle_epilogue=True),
    "ws_swizzled": dataclasses.replace(CONFIG_TABLE["default"], swizzle_epilogue=True),
    # CTA pairs sharing the B block by multicast TMA, bands across M.
    "ws_cluster_m": dataclasses.replace(CONFIG_TABLE["default"], cluster_dimension="m", grid_minor_dim="m"),
    # Each consumer owns whole tiles in turn: one's epilogue overlaps the other's MMAs.
    "ws_pingpong": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None),
    "ws_pingpong_cluster_m": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong"),
    # Cooperative on the stage ring, one K step's MMAs in flight per consumer.
    "ws_ring": dataclasses.replace(CONFIG_TABLE["default"], delay_release=1),
    "ws_ring_no_cluster_split_m": dataclasses.replace(CONFIG_TABLE["default"], delay_release=1,
                                                      cluster_dimension=None, wg_dimension="m"),
    # Tile loads / outputs between GMEM and registers, no staging SMEM (and, with direct
    # stores, no automatic barriers).
    "ws_direct": dataclasses.replace(CONFIG_TABLE["default"], direct_loads=True, direct_stores=True),
    # One staging slot per tile output: 64-column chunks beside 4 stages, each chunk waiting
    # for the previous chunk's store to read the slot.
    "ws_one_out_slot": dataclasses.replace(CONFIG_TABLE["default"], epilogue_out_slots=1),
    # The same on the ping-pong kernel with bands across M (a tuned-table entry, run 253).
    "ws_pingpong_minor_m_one_out_slot": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong",
                                                            cluster_dimension=None, grid_minor_dim="m",
                                                            epilogue_out_slots=1),
    "ws_pingpong_direct_loads": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong",
                                                    cluster_dimension=None, direct_loads=True),
    # Ping-pong consumers taking turns on the tensor cores, 6 stages.
    "ws_pingpong_turns_deep": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None,
                                                  pingpong_turns=True, max_concurrent_steps=6),
    # Staged epilogues synchronized by hand (two barriers a chunk), cooperative and ping-pong.
    "ws_manual": dataclasses.replace(CONFIG_TABLE["default"], manual_barriers=True),
    "ws_pingpong_manual": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None,
                                              manual_barriers=True),
    # ... and row sums folded across chunks (TuningConfig.fold_row_reductions).
    "ws_pingpong_lean": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None,
                                            manual_barriers=True, fold_row_reductions=True),
    "ws_pingpong_direct_deep": dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong",
                                                   cluster_dimension=None, direct_loads=True, direct_stores=True, max_concurrent_steps=6),
}


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("epi,kw", CASES, ids=[c[0].name for c in CASES])
def test_program_on_gpu(epi, kw, cfg):
    poison_allocator([(2048, 1024)] * 8)
    _compare(epi, 2048, 1024, 1024, config=CONFIGS[cfg], **kw)


K32_CONFIGS = {  # 32-wide K steps (64-byte rows): both operands K-major only
    "ring_k32": dataclasses.replace(CONFIG_TABLE["default"], tile_k=32, max_concurrent_steps=8, delay_release=1),
    "k32_no_cluster": dataclasses.replace(CONFIG_TABLE["default"], tile_k=32, max_concurrent_steps=8,
                                          cluster_dimension=None),
}


@pytest.mark.parametrize("cfg", list(K32_CONFIGS), ids=list(K32_CONFIGS))
@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[1].get("transpose_b") and not c[1].get("transpose_a")],
                         ids=lambda c: getattr(c, "name", ""))
def test_k32_steps_in_the_dgrad_layout_on_gpu(epi, kw, cfg):
    poison_allocator([(2048, 1024)] * 8)
    _compare(epi, 2048, 1024, 1024, config=K32_CONFIGS[cfg], **kw)
    _compare(epi, 1000, 1536, 520, config=K32_CONFIGS[cfg], **kw)  # ragged M and K


@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
def test_ragged_shapes_on_gpu(cfg):
    poison_allocator([(1024, 5000)] * 8)
    _compare(programs.RESIDUAL_RMS, 1000, 1500, 520, config=CONFIGS[cfg])
    _compare(programs.RMS_LSE, 777, 5000, 256, transpose_b=True, config=CONFIGS[cfg])
    _compare(programs.RMS_LSE_LOGITS, 777, 5000, 256, transpose_b=True, config=CONFIGS[cfg])
    _compare(programs.rms_dgrad(True), 1000, 1500, 520, transpose_b=True, config=CONFIGS[cfg])
    _compare(programs.IDENTITY, 1000, 1500, 520, transpose_a=True, config=CONFIGS[cfg])


@pytest.mark.parametrize("cfg", ["warp_specialized", "ws_pingpong_cluster_m"])
def test_reserved_sms_on_gpu(monkeypatch, cfg):
    # reserved_sms=9: 123 SMs, an odd count (61 CTA pairs, one SM idle besides)
    from coda_jax.pallas import lowering as L

    grids = record_grids(monkeypatch)
    poison_allocator([(2048, 2048)] * 8)
    _compare(programs.RESIDUAL_RMS, 2048, 2048, 1024, config=CONFIGS[cfg], reserved_sms=9)
    _compare(programs.rms_dgrad(True), 1000, 1500, 520, transpose_b=True, config=CONFIGS[cfg], reserved_sms=9)
    assert grids and set(grids) == {L.gpu_sm_count() - 9}


@pytest.mark.parametrize("cfg,per_cta", [("warp_specialized", 1), ("ws_pingpong_cluster_m", 2)])
def test_tiles_per_cta_on_gpu(monkeypatch, cfg, per_cta):
    # tiles_per_cta: more CTAs (pairs) than SMs, each taking at most per_cta tiles
    from coda_jax.pallas import lowering as L

    grids = record_grids(monkeypatch)
    poison_allocator([(4096, 4096)] * 8)
    _compare(programs.RESIDUAL_RMS, 4096, 4096, 1024, config=CONFIGS[cfg], tiles_per_cta=per_cta)
    _compare(programs.rms_dgrad(True), 1000, 1500, 520, transpose_b=True, config=CONFIGS[cfg], tiles_per_cta=per_cta)
    assert grids and grids[0] > L.gpu_sm_count()  # 4096 x 4096 has more tiles than SMs


def test_vocab_leaving_a_consumer_tile_of_padding_on_gpu():
    # Issue 20, item 1: V = 50257 pads to 50432 on the default [128, 256] CTA tile; the second
    # consumer of the last tile sees padding only, and its partial LSE was NaN.
    from op_cases import case_cross_entropy

    poison_allocator([(1024, 50432)] * 4)
    _compare(programs.RMS_LSE, 1000, 50257, 1536, transpose_b=True, config=CONFIG_TABLE["default"])
    _compare(programs.RMS_LSE, 999, 32003, 512, transpose_b=True, config=CONFIG_TABLE["default"])
    case_cross_entropy("pallas", 1000, 1536, 50257, jnp.bfloat16)


def test_model_block_remat_on_gpu():
    """``LlamaConfig(remat="block")`` on the compiled kernels: the blocks run under remat (the
    fused forward recomputed in the backward) with the loss and every gradient of the model
    without it."""
    import jax
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig
    from op_cases import rel_err

    cfg = LlamaConfig.tiny(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_heads=8, num_kv_heads=2,
                           head_dim=64, num_layers=2, dtype=jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(1), (2, 513), 0, cfg.vocab_size)
    got = {}
    for remat in ("none", "block"):
        graphdef, state = nnx.split(CodaLlama(cfg.replace(remat=remat), rngs=nnx.Rngs(0), backend="pallas"))
        fn = jax.value_and_grad(lambda st, t: nnx.merge(graphdef, st).loss(t[:, :-1], t[:, 1:]))
        assert ("remat" in str(jax.make_jaxpr(fn)(state, tokens))) == (remat == "block")
        got[remat] = jax.jit(fn)(state, tokens)
    assert abs(float(got["block"][0]) - float(got["none"][0])) <= 1e-6 * abs(float(got["none"][0]))
    # The recomputed forward is compiled as its own program, so XLA may order the gradients'
    # bfloat16 sums differently: a norm weight's gradient differed by 4.8e-4 (relative) on an
    # H100 (RESULTS.md, run 279), bf16 rounding. A wrong saved carry differs by O(1).
    for a, b in zip(jax.tree.leaves(got["block"][1]), jax.tree.leaves(got["none"][1])):
        assert rel_err(a, b) < 3e-3


def test_ops_under_remat_and_vmap_on_gpu():
    from test_ops_pallas import _remat_vmap_case

    _remat_vmap_case("pallas")


HALF_WIDTH = dataclasses.replace(CONFIG_TABLE["default"], tile_n=64)  # tuning.fit_waves's narrow tile
HALF_WIDTH_CASES = [c for c in CASES if c[0].pair_block is None or 64 % c[0].pair_width == 0]


@pytest.mark.parametrize("epi,kw", HALF_WIDTH_CASES, ids=[c[0].name for c in HALF_WIDTH_CASES])
def test_half_width_tile_on_gpu(epi, kw):
    """The plan the wave fit takes for GEMMs with few output tiles, every program it can
    hold, at a tile-multiple shape and ragged ones."""
    poison_allocator([(2048, 1024)] * 8)
    _compare(epi, 2048, 1024, 1024, config=HALF_WIDTH, **kw)


def test_half_width_tile_ragged_on_gpu():
    poison_allocator([(1024, 5000)] * 8)
    _compare(programs.RESIDUAL_RMS, 1000, 1500, 520, config=HALF_WIDTH)
    _compare(programs.NORM_WGRAD, 1000, 1500, 520, transpose_a=True, config=HALF_WIDTH)
    _compare(programs.rms_dgrad(True), 1000, 1500, 520, transpose_b=True, config=HALF_WIDTH)


# The narrow tile without CTA pairs: 11-14 % faster on the 1B QKV wgrad (benchmarks/RESULTS.md,
# run 122), a candidate default for tuning.fit_waves once it has passed here.
HALF_WIDTH_NO_CLUSTER = dataclasses.replace(HALF_WIDTH, cluster_dimension=None)


@pytest.mark.parametrize("epi,kw", [(programs.NORM_WGRAD, dict(transpose_a=True)), (programs.IDENTITY, {}),
                                    (programs.rms_dgrad(True), dict(transpose_b=True)), (programs.RESIDUAL_RMS, {})],
                         ids=["norm_wgrad", "identity", "rms_dgrad_res", "residual_rms"])
def test_half_width_tile_without_cluster_on_gpu(epi, kw):
    poison_allocator([(2048, 1024)] * 8)
    _compare(epi, 2048, 1024, 1024, config=HALF_WIDTH_NO_CLUSTER, **kw)
    _compare(epi, 1000, 1500, 520, config=HALF_WIDTH_NO_CLUSTER, **kw)  # ragged


def _shipped_entries():
    """The entries of every shipped tuned table (each GPU kind's) that hold a configuration,
    one per (program, layout, configuration), but for the FP8 programs' and passes'."""
    from coda_jax.pallas.tuned import SHIPPED_TABLES, load_table

    seen = {}
    for path in SHIPPED_TABLES:
        for e in load_table(str(path)).entries:
            # FP8 programs' and the FP8 epilogue passes' configurations: tests/test_gpu_pallas_fp8.py
            if e.config is not None and not e.program.endswith("_fp8") and e.program not in PASS_PROGRAMS:
                seen.setdefault((e.program, e.layout, e.config), e)
    return list(seen.values())


@pytest.mark.parametrize("entry", _shipped_entries(), ids=lambda e: f"{e.program}-{e.layout}-{e.m}x{e.n}x{e.k}")
def test_shipped_tuned_configs_on_gpu(entry):
    """Every configuration the shipped tuned table holds, on its program and layout, at a
    tile-multiple shape and (outside pair mode) a ragged one. The autotuner already checked
    each against the heuristic configuration at the entry's own shape."""
    cases = [c for c in CASES if c[0].name == entry.program]
    assert cases, f"tuned table entry for unknown program {entry.program!r}"
    epi, kw = cases[0]
    kw = dict(transpose_a=entry.layout[0] == "t", transpose_b=entry.layout[1] == "t")
    poison_allocator([(2048, 2048)] * 8)
    _compare(epi, 2048, 2048, 1024, config=entry.config, **kw)
    if epi.pair_block is None:
        _compare(epi, 1000, 1500, 520, config=entry.config, **kw)


@pytest.mark.parametrize("workers", [0, 2], ids=["here", "workers"])
def test_kernel_cache_runs_the_same_kernels_on_gpu(tmp_path, workers):
    """coda_jax/pallas/kernel_cache.py on the GPU: a fused op's forward and gradients with
    the kernels generated into the cache (here or by worker processes) and then read back
    from it are those of the uncached kernels (the same kernels; the tolerance leaves room
    for XLA fusing the code around them differently)."""
    import jax

    import coda_jax as cj
    from coda_jax.pallas import kernel_cache as KC

    ks = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(ks[0], (1024, 512)).astype(jnp.bfloat16)
    g = (1 + 0.1 * jax.random.normal(ks[1], (512,))).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[2], (512, 2048)) * 512 ** -0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(ks[3], (1024, 512)) * 1024 ** -0.5).astype(jnp.bfloat16)

    def run(eps):
        # A new eps is a new trace of the op (JAX would reuse an earlier trace, and its
        # kernels, for the same one); the norm's eps is applied outside the kernels, so the
        # kernels are the same and the results equal to rounding.
        def loss(x, g, w, w_down):
            y, _ = cj.swiglu_mlp(x, g, w, w_down, g, eps=eps, backend="pallas")
            return jnp.sum(y.astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, g, w, w_down)

    KC.disable_kernel_cache()
    want = run(1e-5 * (1 + 1e-6 * workers))
    with jax.disable_jit():  # op by op, XLA rounds between the ops differently: its own reference
        want_eager = run(1e-5 * (1 + 8e-6 + 1e-6 * workers))
    try:
        cache = KC.enable_kernel_cache(tmp_path, workers=workers)
        fresh = run(1e-5 * (1 + 2e-6 + 1e-6 * workers))
        assert cache.stats.misses >= 3 and cache.stats.worker_failures == 0, vars(cache.stats)
        cache = KC.enable_kernel_cache(tmp_path, workers=workers)
        cached = run(1e-5 * (1 + 4e-6 + 1e-6 * workers))
        assert cache.stats.hits >= 3 and cache.stats.misses == 0, vars(cache.stats)
        with jax.disable_jit():  # the cached kernels called op by op
            eager = run(1e-5 * (1 + 6e-6 + 1e-6 * workers))
    finally:
        KC.disable_kernel_cache()
    from op_cases import rel_err

    # Committed results would make the next call of a jitted step trace again.
    assert [x.committed for x in jax.tree.leaves(cached)] == [x.committed for x in jax.tree.leaves(want)]
    for got, ref in ((fresh, want), (cached, want), (eager, want_eager)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            assert rel_err(a, b) < 1e-5, "a cached kernel computed something else"


@pytest.mark.parametrize("cfg", ["warp_specialized", "ws_pingpong", "ws_ring", "ws_direct", "ws_pingpong_turns_deep",
                                 None], ids=lambda c: c or "default")
def test_split_qkv_outputs_on_gpu(cfg):
    """``out_splits`` (tests/test_split_outputs.py) compiled: the 1B model's QKV column
    widths (2048, 512, 512), here as 16 query and 4 KV heads of head_dim 128, written as three arrays, equal bit for bit to the
    unsplit output's columns, and no part left unwritten (poisoned allocator)."""
    import jax

    from coda_jax.pallas.lowering import PallasLowering
    from test_split_outputs import _operands

    epi = programs.rms_rope(64, None, False)
    m, n, k = 2048, 3072, 1024
    a, b, loads = _operands(epi, m, n, k, seed=3)
    low = PallasLowering(CONFIGS[cfg] if cfg else None)
    poison_allocator([(m, n)] * 8)
    whole = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l)["qkv"])(a, b, loads)
    poison_allocator([(m, n)] * 8)
    parts = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, out_splits={"qkv": (2048, 512, 512)})["qkv"])(a, b, loads)
    assert [p.shape for p in parts] == [(m, 2048), (m, 512), (m, 512)]
    got = jnp.concatenate(parts, axis=1).astype(jnp.float32)
    assert bool(jnp.isfinite(got).all())
    assert bool((got == whole.astype(jnp.float32)).all())
