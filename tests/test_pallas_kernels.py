"""Every epilogue program through the Pallas kernel (GPU interpret mode) vs the reference lowering.

Fresh random bf16 inputs, outputs poisoned by construction (each kernel writes a new
array; a missed tile would keep whatever the allocation held and fail the comparison),
relative error per output after reducing partials.
"""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import pytest

from coda_jax import log as coda_log
import coda_jax as cj
from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.epilogue import LoadKind, OutputKind
from coda_jax.lowering import routes_to_xla
from coda_jax.pallas import interpret_mode
from coda_jax.pallas.gemm_epilogue import SMEM_LIMIT, KernelShape, plan_epilogue, plan_kernel
from coda_jax.pallas.lowering import PallasLowering
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig
from coda_jax.reference import REFERENCE
from op_cases import PASS_PROGRAMS, rel_err

SMALL = TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2)


@pytest.fixture(autouse=True)
def _interpret(request):
    if request.node.get_closest_marker("gpu"):  # the GPU suite reuses these helpers, compiled
        yield
        return
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield
    reset_gpu_interpret_mode_state()


def _loads(epi, m, n, key):
    out = {}
    for i, l in enumerate(epi.loads):
        k = jax.random.fold_in(key, i)
        w = epi.width(n, l.half)
        if l.name == "target":
            out[l.name] = jax.random.randint(k, (m,), -1, n)
        elif l.kind is LoadKind.ROW_BLOCK:  # cos / sin of random angles
            ang = jax.random.uniform(jax.random.fold_in(key, 99), (m, epi.pair_block), maxval=7.0)
            out[l.name] = jnp.cos(ang) if l.name == "cos" else jnp.sin(ang)
        elif l.name == "rot":
            out[l.name] = (jnp.arange(w) < w - 64).astype(jnp.float32)
        elif l.name == "lse":
            out[l.name] = 3.0 + jax.random.normal(k, (m,))
        elif l.name == "rstd":
            out[l.name] = jax.random.uniform(k, (m,), minval=0.5, maxval=2.0)
        elif l.kind is LoadKind.ROW:
            out[l.name] = jax.random.normal(k, (m,))
        elif l.kind is LoadKind.COL:
            out[l.name] = 1.0 + 0.1 * jax.random.normal(k, (w,))
        else:
            dt = jnp.float32 if l.name == "prev" else jnp.bfloat16
            out[l.name] = jax.random.normal(k, (m, w), jnp.float32).astype(dt)
    return out


def _compare(epi, m, n, k, transpose_a=False, transpose_b=False, seed=0, config=SMALL, **lowering_kw):
    key = jax.random.key(seed)
    ka, kb, kl = jax.random.split(key, 3)
    a = (jax.random.normal(ka, (k, m) if transpose_a else (m, k)) / k ** 0.25).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (n, k) if transpose_b else (k, n)) / k ** 0.25).astype(jnp.bfloat16)
    loads = _loads(epi, m, n, kl)
    kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
    low = PallasLowering(config, plain_gemm="kernel", **lowering_kw)
    got = jax.jit(lambda a, b, l: low.gemm(epi, a, b, l, **kw))(a, b, loads)
    want = REFERENCE.gemm(epi, a, b, loads, **kw)
    assert set(got) == set(want)
    for o in epi.outputs:
        g, w = got[o.name], want[o.name]
        if o.kind in (OutputKind.ROW_SUM, OutputKind.COL_SUM):
            g, w = g.sum(0), w.sum(0)
        elif o.kind is OutputKind.ROW_LOGSUMEXP:
            g, w = jax.nn.logsumexp(g, axis=0), jax.nn.logsumexp(w, axis=0)
        else:
            assert g.shape == w.shape and g.dtype == w.dtype, (o.name, g.shape, w.shape, g.dtype, w.dtype)
        e = rel_err(g, w)
        assert e < 1e-2, f"{epi.name}.{o.name}: rel err {e:.3g}"


# The kernel backends' programs do not reduce over columns (d_gamma is a row sum of the
# wgrad epilogue there; only the xla backend's rms_dgrad(..., with_dgamma=True) has a column
# sum); the primitive stays in the spec and is tested with this program.
COL_SUM_PROBE = E.Epilogue(name="col_sum_probe", loads=(E.col("gamma"),),
                           outputs=(E.tile_out("out"), E.col_sum("colsum")),
                           body=lambda acc, ctx, gamma: {"out": acc * gamma, "colsum": acc * acc})

CASES = [
    (programs.IDENTITY, {}),
    (programs.RESIDUAL, {}),
    (programs.RESIDUAL_RMS, {}),
    (programs.ROW_SCALE, {}),
    (programs.rms_swiglu(False), {}),
    (programs.rms_swiglu(True), {}),
    (programs.rms_rope(64, None, False), {}),
    (programs.rms_rope(64, 1e-6, True), {}),
    (programs.rms_rope(32, None, False), {}),
    (programs.RMS_LSE, {"transpose_b": True}),
    (programs.RMS_LSE_LOGITS, {"transpose_b": True}),
    (programs.rms_dgrad(False), {"transpose_b": True}),
    (programs.rms_dgrad(True), {"transpose_b": True}),
    (programs.CE_GRAD, {"transpose_b": True}),
    (programs.ACCUMULATE, {}),
    (programs.NORM_WGRAD, {"transpose_a": True}),
    (programs.NORM_DGRAD, {"transpose_b": True}),
    (programs.SWIGLU_DGRAD, {"transpose_b": True}),
    (COL_SUM_PROBE, {}),
]


@pytest.mark.parametrize("epi,kw", CASES, ids=[c[0].name for c in CASES])
def test_program_matches_reference(epi, kw):
    n = 256 if epi.pair_block == 64 else 192 if epi.pair_block is None else 128
    _compare(epi, 128, n, 128, **kw)


WS = TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2, warp_specialized=True)


def _shape(m, n, k, outs, transpose_a=False, transpose_b=False, num_sms=132):
    """A KernelShape of tile-multiple sizes; ``outs``: {output name: dtype}."""
    return KernelShape(m=m, n=n, k=k, m_real=m, n_real=n, transpose_a=transpose_a, transpose_b=transpose_b,
                       operand_dtype=jnp.dtype(jnp.bfloat16),
                       out_dtypes=tuple((name, jnp.dtype(dt)) for name, dt in outs.items()), num_sms=num_sms)


def _dtypes(**kw):
    return tuple((k, jnp.dtype(v)) for k, v in kw.items())


WS_N = dataclasses.replace(WS, wg_dimension="n")


@pytest.mark.parametrize("epi,kw", CASES, ids=[c[0].name for c in CASES])
def test_program_warp_specialized(epi, kw):
    n = 256 if epi.pair_block == 64 else 192 if epi.pair_block is None else 128
    _compare(epi, 256, n, 128, config=WS, seed=7, **kw)


@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[0].name in
                                    ("residual_rms", "rms_swiglu_train", "rms_lse", "rms_dgrad_res", "rms_rope",
                                     "swiglu_dgrad")],
                         ids=lambda c: getattr(c, "name", ""))
def test_program_warp_specialized_split_n(epi, kw):
    _compare(epi, 128, 256, 128, config=WS_N, seed=17, **kw)


def test_warp_specialized_ragged_and_transposed_b():
    _compare(programs.rms_dgrad(True), 200, 72, 130, transpose_b=True, config=WS, seed=8)
    _compare(programs.IDENTITY, 64, 128, 192, transpose_a=True, config=WS, seed=9)  # falls back: transposed A


def test_warp_specialized_split_n_transposed_a():
    # The wgrad layout (A = [K, M]) runs warp-specialized when the consumers split N.
    shape = _shape(128, 256, 192, {"out": jnp.bfloat16}, transpose_a=True, num_sms=4)
    assert plan_kernel(programs.IDENTITY, shape, WS_N).warp_specialized
    assert not plan_kernel(programs.IDENTITY, shape, WS).warp_specialized
    _compare(programs.IDENTITY, 128, 256, 192, transpose_a=True, config=WS_N, seed=10)
    _compare(programs.rms_dgrad(False), 100, 200, 130, transpose_b=True, config=WS_N, seed=11)


PINGPONG = dataclasses.replace(WS, schedule="pingpong")


ONE_OUT_SLOT_CASES = [c for c in CASES if c[0].name in (
    "identity", "residual_rms", "rms_swiglu_train", "rms_lse_logits", "rms_dgrad_res", "swiglu_dgrad", "col_sum_probe")]


@pytest.mark.parametrize("epi,kw", ONE_OUT_SLOT_CASES, ids=[c[0].name for c in ONE_OUT_SLOT_CASES])
def test_one_out_slot(epi, kw):
    # epilogue_out_slots=1: every chunk of a tile output is staged in the same SMEM slot, after
    # the previous chunk's store has read it (16-column chunks: 8 per 128-wide tile, so the
    # slot is reused within a tile and across tiles). The column-sum probe runs the
    # single-warpgroup kernel, whose column sums keep two slots of their own.
    cfg = dataclasses.replace(WS, epilogue_out_slots=1, epilogue_cols=16)
    n = 256 if epi.pair_block == 64 else 192 if epi.pair_block is None else 128
    _compare(epi, 256, n, 128, config=cfg, seed=23, **kw)


@pytest.mark.parametrize("epi,kw", ONE_OUT_SLOT_CASES, ids=[c[0].name for c in ONE_OUT_SLOT_CASES])
def test_manual_barriers(epi, kw):
    # manual_barriers on the ping-pong and cooperative kernels (the interpreter checks the
    # values and the code paths, not the synchronization: the GPU suite and
    # test_pallas_fp8.py's barrier count do). The column-sum probe keeps the automatic
    # barriers on the single-warpgroup kernel.
    n = 256 if epi.pair_block == 64 else 192 if epi.pair_block is None else 128
    for cfg in (dataclasses.replace(PINGPONG, manual_barriers=True, epilogue_cols=16),
                dataclasses.replace(WS, manual_barriers=True, epilogue_out_slots=1)):
        _compare(epi, 200, n, 128, config=cfg, seed=26, **kw)


ROW_SUM_CASES = [c for c in CASES if any(o.kind is OutputKind.ROW_SUM for o in c[0].outputs)]


@pytest.mark.parametrize("epi,kw", ROW_SUM_CASES, ids=[c[0].name for c in ROW_SUM_CASES])
def test_folded_row_reductions(epi, kw):
    # fold_row_reductions: row sums kept as [tm, 8] partials across chunks, reduced once a tile;
    # ragged M and N (padding columns masked before the fold), two kernels.
    n = 256 if epi.pair_block == 64 else 200 if epi.pair_block is None else 128
    for cfg in (dataclasses.replace(PINGPONG, fold_row_reductions=True, epilogue_cols=16),
                dataclasses.replace(SMALL, fold_row_reductions=True)):
        _compare(epi, 200, n, 128, config=cfg, seed=27, **kw)


def test_manual_barriers_only_where_safe():
    # Staged chunks are synchronized by hand on the warp-specialized kernels; in-place staging
    # (a thread's reads and writes of one slot), column sums (cross-warp reductions) and the
    # single-warpgroup kernel keep Pallas's automatic barriers.
    from coda_jax.pallas.gemm_epilogue import _EpilogueEmitter

    def manual(epi, cfg, n=256):
        shape = KernelShape(m=256, n=n, k=128, m_real=256, n_real=n, transpose_a=False, transpose_b=True,
                            operand_dtype=jnp.dtype(jnp.bfloat16),
                            out_dtypes=tuple((o.name, jnp.dtype(jnp.bfloat16)) for o in epi.outputs), num_sms=4)
        ldt = {l.name: jnp.dtype(jnp.bfloat16) for l in epi.loads}
        return _EpilogueEmitter(epi, shape, dataclasses.replace(cfg, manual_barriers=True), ldt).manual_barriers

    assert manual(programs.SWIGLU_DGRAD, PINGPONG) and manual(programs.RESIDUAL_RMS, WS)
    assert not manual(programs.SWIGLU_DGRAD, dataclasses.replace(PINGPONG, epilogue_load_slots=3))  # in place
    assert not manual(COL_SUM_PROBE, WS) and not manual(programs.RESIDUAL_RMS, SMALL)
    assert not manual(programs.RESIDUAL_RMS, dataclasses.replace(WS, direct_stores=True))  # no staging to fence


def test_one_out_slot_ragged_on_every_schedule():
    for cfg in (dataclasses.replace(WS, epilogue_out_slots=1, epilogue_cols=32),
                dataclasses.replace(PINGPONG, epilogue_out_slots=1, epilogue_cols=32),
                dataclasses.replace(WS, delay_release=1, epilogue_out_slots=1, epilogue_cols=32),
                dataclasses.replace(SMALL, epilogue_out_slots=1, epilogue_cols=32)):
        _compare(programs.rms_swiglu(True), 200, 256, 130, config=cfg, seed=24)
        _compare(programs.RESIDUAL_RMS, 72, 200, 96, config=cfg, seed=25)


def test_one_out_slot_fits_wider_chunks_beside_four_stages():
    # The identity GEMM at the 1B dgrad shape: with two staging slots 64-column chunks do not
    # fit beside 4 operand stages and the plan narrows them to 32; one slot keeps 64.
    shape = _shape(8192, 8192, 2048, {"out": jnp.bfloat16}, transpose_b=True)
    two = plan_kernel(programs.IDENTITY, shape, CONFIG_TABLE["default"])
    one = plan_kernel(programs.IDENTITY, shape, dataclasses.replace(CONFIG_TABLE["default"], epilogue_out_slots=1))
    assert (two.max_concurrent_steps, two.epilogue_cols) == (4, 32)
    assert (one.max_concurrent_steps, one.epilogue_cols, one.epilogue_out_slots) == (4, 64, 1)
    with pytest.raises(ValueError, match="epilogue_out_slots must be 1 or 2"):
        dataclasses.replace(CONFIG_TABLE["default"], epilogue_out_slots=3)


@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[0].name in (
    "identity", "residual_rms", "rms_swiglu_train", "rms_rope", "rms_lse", "rms_dgrad_res")],
    ids=lambda c: getattr(c, "name", ""))
def test_pingpong_schedule(epi, kw):
    # 4 CTAs, 16 tiles of 64 x 128: each consumer takes 2 tiles, alternating, and the one
    # stage ring (2 stages, 4 K steps a tile) wraps across tiles and consumers.
    shape = _shape(256, 512, 256, {o.name: jnp.bfloat16 for o in epi.outputs}, num_sms=4, **kw)
    ldt = _dtypes(**{l.name: jnp.float32 if l.kind in (LoadKind.ROW, LoadKind.COL, LoadKind.ROW_BLOCK) else jnp.bfloat16
                     for l in epi.loads})
    assert plan_kernel(epi, shape, PINGPONG, ldt).pingpong
    _compare(epi, 256, 512, 256, config=PINGPONG, seed=13, **kw)


def test_pingpong_ragged_transposed_and_idle_ctas():
    # Padding masks; a transposed A read whole by one consumer; 2 tiles on 4 CTAs (two idle,
    # one consumer of each busy CTA idle).
    _compare(programs.rms_dgrad(True), 200, 72, 130, transpose_b=True, config=PINGPONG, seed=14)
    _compare(programs.NORM_WGRAD, 128, 256, 192, transpose_a=True, config=PINGPONG, seed=15)


def test_rms_dgrad_with_dgamma_runs_on_the_kernel_too():
    """The xla backend's norm backward program (``d_gamma`` column partials beside ``dx``)
    is an ordinary declaration: the kernel runs it too (single warpgroup: a column sum is
    not run in two consumers at once), ragged and padded."""
    epi = programs.rms_dgrad(True, True)
    assert [o.name for o in epi.outputs] == ["dx", "dgamma"]
    _compare(epi, 200, 72, 130, transpose_b=True, seed=31)


@pytest.mark.parametrize("cluster", ["m", "n"])
def test_pingpong_cluster_multicast(cluster):
    # CTA pairs take neighbouring tiles in step and share the B (cluster "m") or A ("n")
    # block by multicast; a stage is refilled only after both CTAs' consumers released it.
    cfg = dataclasses.replace(PINGPONG, cluster_dimension=cluster, grid_minor_dim="m")
    shape = _shape(256, 512, 256, {"x": jnp.bfloat16, "h": jnp.bfloat16, "sumsq": jnp.float32}, num_sms=4)
    ldt = _dtypes(residual=jnp.bfloat16, gamma=jnp.float32)
    planned = plan_kernel(programs.RESIDUAL_RMS, shape, cfg, ldt)
    assert planned.pingpong and planned.cluster_dimension == cluster
    _compare(programs.RESIDUAL_RMS, 256, 512, 256, config=cfg, seed=16)
    _compare(programs.rms_dgrad(True), 200, 300, 130, transpose_b=True, config=cfg, seed=17)


@pytest.mark.parametrize("stages", [2, 4])
def test_pingpong_turns(stages):
    # The consumers take turns on the tensor cores. 4 CTAs: 4 tiles each (residual), 1-2
    # tiles each with an idle consumer (SwiGLU backward: 6 tiles), 2 CTAs idle (RMSNorm dgrad).
    cfg = dataclasses.replace(PINGPONG, pingpong_turns=True, max_concurrent_steps=stages)
    _compare(programs.RESIDUAL_RMS, 256, 512, 256, config=cfg, seed=23)
    _compare(programs.SWIGLU_DGRAD, 192, 256, 128, transpose_b=True, config=cfg, seed=24)
    _compare(programs.rms_dgrad(True), 200, 72, 130, transpose_b=True, config=cfg, seed=25)


DIRECT_CASES = [(programs.SWIGLU_DGRAD, {"transpose_b": True}), (programs.RESIDUAL_RMS, {}),
                (programs.rms_rope(64, None, False), {})]


DIRECT_MODES = {  # (kernel, which of the tile loads / outputs skip the SMEM staging)
    "simple-both": (SMALL, True, True), "cooperative-loads": (WS, True, False),
    "pingpong-both": (PINGPONG, True, True), "pingpong-stores": (PINGPONG, False, True)}
# Every mode on the SwiGLU backward (a paired tile load and output, a row sum); one each on
# the residual (two tile outputs) and RoPE (row-block loads).
DIRECT_RUNS = [(DIRECT_CASES[0], mode) for mode in DIRECT_MODES] + [
    (DIRECT_CASES[1], "pingpong-both"), (DIRECT_CASES[2], "cooperative-loads")]


@pytest.mark.parametrize("case,mode", DIRECT_RUNS, ids=[f"{c[0].name}-{m}" for c, m in DIRECT_RUNS])
def test_direct_tiles(case, mode):
    epi, kw = case
    # Tile loads (z, residual; RoPE's cos/sin row blocks) from GMEM into registers, the next
    # chunk's in flight, and / or tile outputs from registers to GMEM; row partials staged.
    config, loads, stores = DIRECT_MODES[mode]
    cfg = dataclasses.replace(config, direct_loads=loads, direct_stores=stores, epilogue_cols=32)
    n = 256 if epi.pair_block == 64 else 512
    _compare(epi, 256, n, 256, config=cfg, seed=18, **kw)


def test_direct_tiles_ragged_and_their_smem():
    cfg = dataclasses.replace(PINGPONG, direct_loads=True, direct_stores=True)
    _compare(programs.SWIGLU_DGRAD, 200, 192, 130, transpose_b=True, config=cfg, seed=19)
    _compare(programs.RESIDUAL_RMS, 72, 200, 96, config=dataclasses.replace(WS, direct_loads=True, direct_stores=True), seed=20)
    # No staging SMEM but the row partials': the same stages fit with wider chunks.
    shape = _shape(8192, 8192, 2048, {"dz": jnp.bfloat16, "zdz": jnp.float32}, transpose_b=True)
    ldt = _dtypes(z=jnp.bfloat16, rstd=jnp.float32)
    big = dataclasses.replace(CONFIG_TABLE["default"], schedule="pingpong", cluster_dimension=None,
                              max_concurrent_steps=6)
    staged = plan_kernel(programs.SWIGLU_DGRAD, shape, big, ldt)
    direct = plan_kernel(programs.SWIGLU_DGRAD, shape, dataclasses.replace(big, direct_loads=True, direct_stores=True), ldt)
    assert direct.max_concurrent_steps == 6 and direct.direct_loads
    assert (staged.max_concurrent_steps, staged.epilogue_cols) < (6, direct.epilogue_cols)


RING = dataclasses.replace(WS_N, delay_release=1)


@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[0].name in (
    "identity", "rms_swiglu_train", "rms_lse", "swiglu_dgrad")], ids=lambda c: getattr(c, "name", ""))
def test_cooperative_stage_ring(epi, kw):
    # delay_release=1: both consumers on every 64 x 256 CTA tile (split along N), each keeping
    # one K step's MMAs in flight. 4 CTAs, 8 tiles, 4 K steps a tile through 2 stages: the
    # ring wraps inside a tile and across the CTA's two tiles.
    shape = _shape(256, 512, 256, {o.name: jnp.bfloat16 for o in epi.outputs}, num_sms=4, **kw)
    ldt = _dtypes(**{l.name: jnp.float32 if l.kind in (LoadKind.ROW, LoadKind.COL, LoadKind.ROW_BLOCK) else jnp.bfloat16
                     for l in epi.loads})
    planned = plan_kernel(epi, shape, RING, ldt)
    assert planned.warp_specialized and not planned.pingpong and planned.delay_release == 1
    _compare(epi, 256, 512, 256, config=RING, seed=23, **kw)


PREFETCH_CASES = [(programs.RESIDUAL_RMS, {}), (programs.SWIGLU_DGRAD, {"transpose_b": True}),
                  (programs.rms_dgrad(True), {"transpose_b": True}), (programs.ACCUMULATE, {})]


@pytest.mark.parametrize("schedule", ["pingpong", "ring"])
@pytest.mark.parametrize("epi,kw", PREFETCH_CASES, ids=[c[0].name for c in PREFETCH_CASES])
def test_prefetch_next_tile(epi, kw, schedule):
    """TuningConfig.prefetch_next_tile: each consumer's next tile's first tile loads issued
    during this tile's last chunks. 4 CTAs, 16 ping-pong tiles of 64 x 128 (each consumer takes
    two in turn: the second's first chunks arrive from the first's epilogue) or 8 cooperative
    CTA tiles of 64 x 256 (both consumers on two tiles each); 32-column chunks (four a tile)
    and 64 (two); a ragged shape with idle consumers (no next tile to prefetch)."""
    from coda_jax.pallas.gemm_epilogue import _EpilogueEmitter

    base = PINGPONG if schedule == "pingpong" else RING
    for cols in (32, 64):
        cfg = dataclasses.replace(base, prefetch_next_tile=True, epilogue_cols=cols)
        shape = _shape(256, 512, 256, {o.name: jnp.bfloat16 for o in epi.outputs}, num_sms=4, **kw)
        ldt = _dtypes(**{l.name: jnp.float32 if l.kind in (LoadKind.ROW, LoadKind.COL, LoadKind.ROW_BLOCK)
                         else jnp.bfloat16 for l in epi.loads})
        planned = plan_kernel(epi, shape, cfg, ldt)
        assert _EpilogueEmitter(epi, shape, planned, dict(ldt)).cross_tile, (epi.name, cols)  # the path is taken
        _compare(epi, 256, 512, 256, config=cfg, seed=41 + cols, **kw)
    _compare(epi, 200, 192 if epi.pair_block else 72, 130, config=cfg, seed=43, **kw)


def test_prefetch_next_tile_applies_only_where_it_can():
    """Not on the kernels that do not pass a next tile (cooperative without the ring, single
    warpgroup), not with as many loads in flight as a tile has chunks, not without tile loads."""
    from coda_jax.pallas.gemm_epilogue import _EpilogueEmitter

    shape = _shape(256, 512, 256, {"x": jnp.bfloat16, "h": jnp.bfloat16, "sumsq": jnp.float32}, num_sms=4)
    ldt = _dtypes(residual=jnp.bfloat16, gamma=jnp.float32)

    def cross(cfg, epi=programs.RESIDUAL_RMS):
        return _EpilogueEmitter(epi, shape, dataclasses.replace(cfg, prefetch_next_tile=True), dict(ldt)).cross_tile

    assert cross(PINGPONG) and cross(RING)
    assert not cross(WS) and not cross(SMALL)
    assert not cross(dataclasses.replace(PINGPONG, epilogue_load_slots=3, epilogue_cols=64))  # 2 chunks, 2 ahead
    assert not cross(PINGPONG, programs.IDENTITY)  # no tile loads
    assert not _EpilogueEmitter(programs.RESIDUAL_RMS, shape, PINGPONG, dict(ldt)).cross_tile  # off by default


@pytest.mark.parametrize("cfg", [dataclasses.replace(RING, wg_dimension="m"),
                                 dataclasses.replace(RING, cluster_dimension="m", grid_minor_dim="m"),
                                 dataclasses.replace(RING, cluster_dimension="n", max_concurrent_steps=3)],
                         ids=["split_m", "cluster_m", "cluster_n_3_stages"])
def test_cooperative_stage_ring_variants(cfg):
    # M split of the CTA tile; CTA pairs sharing B (or A) by multicast, where a stage is
    # refilled only after the consumers of both CTAs released it; ragged shapes; a
    # transposed B (dgrad) and, on the N split, a transposed A (wgrad).
    _compare(programs.RESIDUAL_RMS, 256, 512, 256, config=cfg, seed=24)
    _compare(programs.rms_dgrad(True), 200, 300, 130, transpose_b=True, config=cfg, seed=25)
    if cfg.wg_dimension == "n":
        _compare(programs.NORM_WGRAD, 128, 256, 192, transpose_a=True, config=cfg, seed=26)


@pytest.mark.parametrize("cfg", [dataclasses.replace(RING, tile_k=32, max_concurrent_steps=3),
                                 dataclasses.replace(WS_N, tile_k=32, max_concurrent_steps=2)],
                         ids=["ring", "cooperative"])
def test_k32_steps_in_the_dgrad_layout(cfg):
    # 32-wide K steps (64-byte swizzled rows) with both operands K-major: a ragged K
    # (130 -> 160: 5 K steps a tile through 3 or 2 stages) and M; on the ring also a pair
    # epilogue (K = 128, 4 steps; 2 tiles a CTA, so the ring wraps across tiles).
    _compare(programs.rms_dgrad(True), 200, 300, 130, transpose_b=True, config=cfg, seed=28)
    if cfg.delay_release:
        _compare(programs.SWIGLU_DGRAD, 256, 512, 128, transpose_b=True, config=cfg, seed=29)


def test_k32_steps_need_both_operands_k_major():
    shape = _shape(256, 256, 256, {"out": jnp.bfloat16})
    with pytest.raises(ValueError, match=r"tile_k=32 needs both operands K-major"):
        plan_kernel(programs.IDENTITY, shape, dataclasses.replace(WS_N, tile_k=32), ())
    with pytest.raises(ValueError, match=r"tile_k must be a multiple of 32"):
        dataclasses.replace(WS_N, tile_k=48)


def test_plan_fits_heavy_epilogues_in_smem():
    # QK-norm RoPE training epilogue: f32 cos/sin staging + two tile outputs do not fit beside
    # 4 stages of the 256x128 warp-specialized CTA tile; the plan falls back until it fits.
    epi = programs.rms_rope(64, 1e-6, True)
    shape = _shape(2048, 1024, 1024, {"qkv": jnp.bfloat16, "z": jnp.bfloat16})
    ldt = _dtypes(rstd=jnp.float32, cos=jnp.float32, sin=jnp.float32, rot=jnp.float32, qk_w=jnp.float32)
    cfg = CONFIG_TABLE["default"]
    planned = plan_kernel(epi, shape, cfg, ldt)
    assert planned != cfg
    assert planned.smem_bytes(2) <= SMEM_LIMIT
    light = plan_kernel(programs.IDENTITY, _shape(2048, 1024, 1024, {"out": jnp.bfloat16}), cfg, ())  # a light epilogue stays warp-specialized
    assert light.warp_specialized and light.tile_m == cfg.tile_m


@pytest.mark.parametrize("epi", [programs.RESIDUAL_RMS, programs.rms_swiglu(True), programs.rms_rope(32, None, False)],
                         ids=lambda e: e.name)
def test_swizzled_epilogue_staging(epi):
    _compare(epi, 256, 256, 128, config=dataclasses.replace(WS_N, swizzle_epilogue=True), seed=12)


@pytest.mark.parametrize("slots", [3, 4])
@pytest.mark.parametrize("epi,kw", [c for c in CASES if c[0].name in ("residual_rms", "rms_dgrad_res", "swiglu_dgrad")],
                         ids=lambda c: getattr(c, "name", ""))
def test_load_ring_with_in_place_outputs(epi, kw, slots):
    # Tile outputs staged in their load's slot, loads issued slots - 2 chunks ahead; 3 slots
    # do not divide the chunks of a tile, so the ring wraps across tiles (4 CTAs, 2 tiles each).
    # (2 slots, the default double buffer, run in every other test.)
    cfg = dataclasses.replace(WS_N, epilogue_load_slots=slots, epilogue_cols=16)
    n = 512
    outs = {o.name: (jnp.bfloat16 if o.kind is OutputKind.TILE else jnp.float32) for o in epi.outputs}
    ldt = _dtypes(**{l.name: (jnp.bfloat16 if l.kind is LoadKind.TILE else jnp.float32) for l in epi.loads})
    planned = plan_kernel(epi, _shape(256, n, 128, outs, num_sms=4, **kw), cfg, ldt)
    assert planned.epilogue_load_slots == slots and planned.warp_specialized
    _compare(epi, 256, n, 128, config=cfg, seed=21, **kw)
    _compare(epi, 128, n, 128, config=dataclasses.replace(SMALL, epilogue_load_slots=slots), seed=22, **kw)


@pytest.mark.parametrize("base", ["split_m", "split_n"])
@pytest.mark.parametrize("cluster", ["m", "n"])
def test_cluster_multicast(cluster, base):
    # CTA pairs share one operand block by multicast TMA; bands of tiles across M.
    cfg = dataclasses.replace(WS if base == "split_m" else WS_N, cluster_dimension=cluster, grid_minor_dim="m")
    m, n = (256, 256) if (base, cluster) != ("split_n", "n") else (128, 512)
    shape = _shape(m, n, 128, {"x": jnp.bfloat16, "h": jnp.bfloat16, "sumsq": jnp.float32}, num_sms=4)
    ldt = _dtypes(residual=jnp.bfloat16, gamma=jnp.float32)
    assert plan_kernel(programs.RESIDUAL_RMS, shape, cfg, ldt).cluster_dimension == cluster
    _compare(programs.RESIDUAL_RMS, m, n, 128, config=cfg, seed=13)


def test_cluster_dropped_where_it_does_not_divide():
    cfg = dataclasses.replace(WS_N, cluster_dimension="n")  # cluster tile 64 x 512
    shape = _shape(128, 256, 128, {"out": jnp.bfloat16}, transpose_a=True, num_sms=4)
    planned = plan_kernel(programs.IDENTITY, shape, cfg)
    assert planned.warp_specialized and planned.cluster_dimension is None
    _compare(programs.IDENTITY, 128, 256, 128, transpose_a=True, config=cfg, seed=14)


@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_transposed_operands(ta, tb):
    _compare(programs.IDENTITY, 64, 128, 192, transpose_a=ta, transpose_b=tb, seed=1)


def test_shapes_that_are_not_tile_multiples():
    _compare(programs.RESIDUAL_RMS, 100, 150, 80, seed=2)
    _compare(programs.SWIGLU_DGRAD, 100, 192, 80, transpose_b=True, seed=4)  # half_acc: z padded to 2 x 256
    _compare(programs.RMS_LSE, 70, 200, 64, transpose_b=True, seed=3)
    _compare(programs.rms_dgrad(True), 90, 72, 130, transpose_b=True, seed=4)
    _compare(programs.rms_swiglu(True), 50, 256, 64, seed=5)


def test_logsumexp_of_a_consumer_tile_that_is_all_padding():
    # N = 257 pads to 512 for the [64, 256] CTA tile: the second consumer of the last CTA
    # tile sees padding columns only (vocab 50257 on the default [128, 256] tile: 50432).
    # Its partial LSE must be -inf (ignored by the logsumexp of the partials), not NaN.
    _compare(programs.RMS_LSE, 100, 257, 64, transpose_b=True, config=WS_N, seed=3)
    _compare(programs.RMS_LSE, 37, 64, 64, transpose_b=True, config=WS_N, seed=4)  # 1 CTA tile


def record_grids(monkeypatch) -> list[int]:
    """The grid (``KernelShape.num_sms``: CTAs of the kernel) of every Pallas kernel built from
    now on, in order; the lowering's kernel cache is cleared so that each is built."""
    from coda_jax.pallas import kernel_builder as KB

    grids = []
    real = KB.build_kernel
    monkeypatch.setattr(KB, "build_kernel", lambda epi, shape, *a: grids.append(shape.num_sms) or real(epi, shape, *a))
    KB.compiled_kernel.cache_clear()
    return grids


@pytest.mark.parametrize("config", [WS, PINGPONG], ids=["cooperative", "pingpong"])
def test_reserved_sms_shrink_the_persistent_grid(monkeypatch, config):
    # reserved_sms=1 leaves one of the interpreter's 4 "SMs" free: 3 CTAs walk 8 tiles (an
    # uneven share), and every tile is still written.
    from coda_jax.pallas import lowering as L

    grids = record_grids(monkeypatch)
    _compare(programs.RESIDUAL_RMS, 256, 512, 128, config=config, seed=21, reserved_sms=1)
    assert grids == [L.INTERPRET_SMS - 1]


@pytest.mark.parametrize("config,per_cta,programs_expected", [
    (WS, 1, 8), (WS, 3, 3),  # CTA tile 128 x 128: 8 tiles of 256 x 512; 3 CTAs take 3, 3, 2
    (PINGPONG, 2, 8),  # 64 x 128: 16 tiles, a consumer each per CTA
    (dataclasses.replace(PINGPONG, cluster_dimension="m", grid_minor_dim="m"), 1, 16),  # 8 pairs
    (TuningConfig(tile_m=64, tile_n=128, tile_k=64), 5, 4),  # not warp-specialized: 16 tiles
], ids=["cooperative-1", "cooperative-3", "pingpong-2", "pingpong-pairs-1", "simple-5"])
def test_tiles_per_cta_grid(monkeypatch, config, per_cta, programs_expected):
    # tiles_per_cta=N: one CTA (pair) per N tiles, more CTAs than the interpreter's 4 "SMs"
    # (or fewer); poisoned outputs show any tile left unwritten.
    grids = record_grids(monkeypatch)
    _compare(programs.RESIDUAL_RMS, 256, 512, 128, config=config, seed=22, tiles_per_cta=per_cta)
    assert grids == [programs_expected]


def test_launch_setting_errors():
    from coda_jax.lowering import persistent_grid_sms

    assert PallasLowering().tiles_per_cta == 0 and PallasLowering().reserved_sms == 0
    for bad in ("x", -2, 1.5, True):
        with pytest.raises(ValueError, match="tiles_per_cta must be a non-negative integer"):
            PallasLowering(tiles_per_cta=bad)
        with pytest.raises(ValueError, match="reserved_sms must be a non-negative integer"):
            PallasLowering(reserved_sms=bad if bad is not True else -1)
    assert persistent_grid_sms(132) == 132 and persistent_grid_sms(132, 16) == 116
    with pytest.raises(ValueError, match="reserved_sms=131 leaves 1 of the GPU's 132 SMs.*at least 2"):
        persistent_grid_sms(132, 131)
    with pytest.raises(ValueError, match="at least 2"):
        PallasLowering(reserved_sms=131).grid_sms(132)


def test_default_config():
    _compare(programs.ROW_SCALE, 128, 128, 256, config=TuningConfig())


def test_errors_name_the_rule():
    p = PallasLowering(SMALL)
    a = jnp.ones((64, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match="bfloat16/float16"):
        p.gemm(programs.IDENTITY, a.astype(jnp.float32), a.astype(jnp.float32), {})
    with pytest.raises(TypeError, match="share a dtype"):
        p.gemm(programs.IDENTITY, a, a.astype(jnp.float16), {})
    with pytest.raises(ValueError, match="contraction sizes differ"):
        p.gemm(programs.IDENTITY, a, jnp.ones((32, 64), jnp.bfloat16), {})
    with pytest.raises(ValueError, match="multiple of 2\\*pair_block=128"):
        p.gemm(programs.rms_swiglu(False), a, jnp.ones((64, 192), jnp.bfloat16), {"rstd": jnp.ones(64)})
    with pytest.raises(ValueError, match="load 'rstd'"):
        p.gemm(programs.ROW_SCALE, a, a, {"rstd": jnp.ones(3)})


def test_plan_narrows_epilogue_chunks_before_dropping_stages():
    # The norm backward (two tile loads, one tile output) on the dgrad GEMM.
    epi = programs.rms_dgrad(True)
    shape = _shape(8192, 2048, 16384, {"dx": jnp.bfloat16}, transpose_b=True)
    ldt = _dtypes(x=jnp.bfloat16, xcoef=jnp.float32, gamma=jnp.float32, dres=jnp.bfloat16)
    planned = plan_kernel(epi, shape, CONFIG_TABLE["default"], ldt)
    assert planned.warp_specialized and planned.max_concurrent_steps >= 3 and planned.epilogue_cols < 64


@pytest.mark.parametrize("cols", [16, 32])
def test_narrow_epilogue_chunks(cols):
    cfg = dataclasses.replace(WS_N, epilogue_cols=cols)
    _compare(programs.rms_dgrad(True), 100, 200, 130, transpose_b=True, config=cfg, seed=13)
    _compare(programs.RESIDUAL_RMS, 128, 256, 64, config=cfg, seed=14)


def test_column_sums_never_run_warp_specialized_in_the_kernel():
    # Measured on the H100: a column sum (a cross-warp reduction) in both consumer
    # warpgroups at once gave intermittently wrong partials. plan_kernel keeps such programs
    # on the single-warpgroup kernel; plan_epilogue (what the lowering runs) writes the sums'
    # summands as float32 tiles instead and keeps the two consumers (col_sum_tiles), or,
    # with col_sum_tiles=False, the single-warpgroup kernel's in-kernel sum.
    shape = _shape(2048, 1024, 1024, {"out": jnp.bfloat16, "colsum": jnp.float32})
    ldt, cfg = _dtypes(gamma=jnp.float32), dataclasses.replace(CONFIG_TABLE["default"], col_sum_tiles=True)
    assert not plan_kernel(COL_SUM_PROBE, shape, cfg, ldt).warp_specialized
    epi, planned = plan_epilogue(COL_SUM_PROBE, shape, cfg, ldt)
    assert planned.warp_specialized and epi.name == COL_SUM_PROBE.name
    assert [(o.name, o.kind, o.dtype) for o in epi.outputs] == [
        ("out", OutputKind.TILE, None), ("colsum", OutputKind.TILE, jnp.float32)]
    # The default keeps the in-kernel sum.
    kept, planned = plan_epilogue(COL_SUM_PROBE, shape, CONFIG_TABLE["default"], ldt)
    assert kept is COL_SUM_PROBE and not planned.warp_specialized
    # A single-warpgroup configuration keeps the in-kernel sum.
    assert plan_epilogue(COL_SUM_PROBE, shape, SMALL, ldt)[0] is COL_SUM_PROBE


@pytest.mark.parametrize("config", [dataclasses.replace(c, col_sum_tiles=True) for c in
                                    (WS, WS_N, PINGPONG, dataclasses.replace(WS, swizzle_epilogue=True))],
                         ids=["cooperative", "cooperative_n", "pingpong", "swizzled"])
def test_column_sums_as_summand_tiles(config):
    # The norm backward's dgamma beside dx on the warp-specialized kernels: written as the
    # summand tile, returned as [M, N] partials (padding rows and columns cut off), ragged.
    epi = programs.rms_dgrad(True, True)
    _compare(epi, 200, 72, 130, transpose_b=True, config=config, seed=32)
    _compare(COL_SUM_PROBE, 256, 192, 128, config=config, seed=33)
    a = jax.ShapeDtypeStruct((200, 130), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((72, 130), jnp.bfloat16)
    shapes = {LoadKind.TILE: ((200, 72), jnp.bfloat16), LoadKind.ROW: ((200,), jnp.float32),
              LoadKind.COL: ((72,), jnp.float32)}
    loads = {l.name: jax.ShapeDtypeStruct(*shapes[l.kind]) for l in epi.loads}
    got = jax.eval_shape(lambda a, b, l: PallasLowering(config, plain_gemm="kernel").gemm(epi, a, b, l, transpose_b=True),
                         a, b, loads)
    assert got["dgamma"].shape == (200, 72) and got["dgamma"].dtype == jnp.float32


def test_plan_narrows_chunks_to_the_register_budget():
    from coda_jax.pallas.gemm_epilogue import _chunks

    cfg = dataclasses.replace(CONFIG_TABLE["default"], max_concurrent_steps=2)  # SMEM is not the limit here
    plan = lambda epi, outs, loads=(): plan_kernel(epi, _shape(2048, 1024, 1024, outs), cfg, loads)  # noqa: E731
    assert plan(programs.IDENTITY, {"out": jnp.bfloat16}).epilogue_cols == 64
    # accumulator pair + y + z pair: 5 x 64 values per thread at 64 columns -> 16 columns
    assert plan(programs.rms_swiglu(True), {"y": jnp.bfloat16, "z": jnp.bfloat16},
                _dtypes(rstd=jnp.float32)).epilogue_cols == 16
    assert _chunks(programs.rms_swiglu(True), 128, 16) == [(0, 16), (16, 16), (32, 16), (48, 16)]
    assert _chunks(programs.SWIGLU_DGRAD, 128, 32) == [(0, 32), (32, 32), (64, 32), (96, 32)]
    # QK-norm sums over a whole pair half (ctx.row_sum): never sliced
    assert _chunks(programs.rms_rope(64, 1e-6, True), 256, 16) == [(0, 64), (128, 64)]


def test_plain_gemm_routing(monkeypatch):
    # Identity-epilogue GEMMs go to the reference backend (no kernel) by default and with
    # plain_gemm="xla"; the option routing.plain_gemm="kernel" or plain_gemm="kernel" (or the
    # backend's name) selects the kernel; the lowering's argument wins over the option.
    on_xla = lambda low: routes_to_xla(low.name, programs.IDENTITY, 96, 80, 64, low.plain_gemm)  # noqa: E731
    assert on_xla(PallasLowering())
    assert not on_xla(PallasLowering(plain_gemm="kernel")) and not on_xla(PallasLowering(plain_gemm="pallas"))
    with cj.options(routing=cj.RoutingOptions(plain_gemm="kernel")):
        assert not on_xla(PallasLowering())
        assert on_xla(PallasLowering(plain_gemm="xla"))
    key = jax.random.split(jax.random.key(21), 2)
    a = jax.random.normal(key[0], (96, 64)).astype(jnp.bfloat16)
    b = jax.random.normal(key[1], (80, 64)).astype(jnp.bfloat16)
    got = PallasLowering(plain_gemm="xla").gemm(programs.IDENTITY, a, b, {}, transpose_b=True,
                                                  out_dtypes={"out": jnp.float32})["out"]
    want = REFERENCE.gemm(programs.IDENTITY, a, b, {}, transpose_b=True, out_dtypes={"out": jnp.float32})["out"]
    assert got.dtype == jnp.float32 and rel_err(got, want) == 0.0
    with pytest.raises(ValueError, match="plain_gemm must be 'xla', 'kernel' or 'pallas'"):
        PallasLowering(plain_gemm="cublas")


def _has_kernel(fn, *args) -> bool:
    # A fresh function each time: options are read when a function is traced.
    fresh = lambda *a: fn(*a)  # noqa: E731
    return "wgmma" in str(jax.make_jaxpr(fresh)(*args))  # the kernel's MMAs; the reference has none


def _routing_case(seed: int):
    """A 128 x 64 x 128 ``residual_rms`` GEMM on the Pallas lowering: (run, a, b, loads)."""
    key = jax.random.split(jax.random.key(seed), 4)
    m, k, n = 128, 64, 128
    a = jax.random.normal(key[0], (m, k)).astype(jnp.bfloat16)
    b = jax.random.normal(key[1], (k, n)).astype(jnp.bfloat16)
    loads = {"residual": jax.random.normal(key[2], (m, n)).astype(jnp.bfloat16),
             "gamma": jax.random.normal(key[3], (n,))}
    return (lambda a, b, l: PallasLowering().gemm(programs.RESIDUAL_RMS, a, b, l)), a, b, loads


def test_fused_program_routing(monkeypatch):
    # The option routing.xla_programs sends the named fused programs (optionally only GEMMs up
    # to a size) to the reference lowering; the result is then the reference's, exactly.
    run, a, b, loads = _routing_case(22)
    (m, k), n = a.shape, b.shape[1]

    def programs_to_xla(text):
        return cj.options(**cj.parse_overrides(f"routing.xla_programs={text}"))

    assert _has_kernel(run, a, b, loads)  # the default table routes nothing at this size
    with programs_to_xla("rms_rope+ residual_rms"):
        assert not _has_kernel(run, a, b, loads)
        got, want = run(a, b, loads), REFERENCE.gemm(programs.RESIDUAL_RMS, a, b, loads)
    for name in want:
        assert rel_err(got[name], want[name]) == 0.0, name
    cap = m * n * k / 2 ** 30
    with cj.options(routing={"xla_programs": {"residual_rms": cap}}):  # m*n*k == cap * 2^30: routed
        assert not _has_kernel(run, a, b, loads)
    with programs_to_xla(f"residual_rms<{cap / 2}"):  # larger than the cap: the kernel
        assert _has_kernel(run, a, b, loads)
    with programs_to_xla("none"):
        assert _has_kernel(run, a, b, loads)
    for bad in ("residual_rms<big", "+residual_rms"):
        with pytest.raises(cj.OptionError, match="routing.xla_programs"):
            programs_to_xla(bad)
    with pytest.raises(cj.OptionError, match="routing.xla_programs"):
        cj.options(routing={"xla_programs": {"residual_rms": -1}})


def test_small_output_routing(monkeypatch, caplog):
    # A fused GEMM whose output has fewer than routing.xla_output_below elements (by default
    # 2^22) runs on the reference lowering, exactly; the suite turns the rule off (0,
    # tests/suite_options.py) so that the other kernel tests test the kernel at their shapes.
    run, a, b, loads = _routing_case(23)
    m, n = a.shape[0], b.shape[1]
    assert cj.current_options().routing.xla_output_below == 0
    assert _has_kernel(run, a, b, loads)
    cj.reset_options("routing")  # the library's default, 2^22
    assert cj.current_options().routing.xla_output_below == 1 << 22
    monkeypatch.setattr(coda_log, "_logged", set())  # logged once per program
    with caplog.at_level(logging.INFO, logger="coda_jax"):
        assert not _has_kernel(run, a, b, loads)  # 128 x 128 < 2^22: the default routes it
    assert any("residual_rms" in r.getMessage() and "routing.xla_output_below" in r.getMessage()
               for r in caplog.records)
    got, want = run(a, b, loads), REFERENCE.gemm(programs.RESIDUAL_RMS, a, b, loads)
    for name in want:
        assert rel_err(got[name], want[name]) == 0.0, name
    with cj.options(routing={"xla_output_below": m * n}):  # the output is not below m * n: the kernel
        assert _has_kernel(run, a, b, loads)
    with cj.options(routing={"xla_output_below": m * n + 1}):
        assert not _has_kernel(run, a, b, loads)
    # The Llama shapes the rule is for, and those it must leave alone (no shape is run here).
    assert routes_to_xla("pallas", programs.RESIDUAL_RMS, 512, 2048, 8192)  # 1B, 2 x 256 tokens
    assert not routes_to_xla("pallas", programs.RESIDUAL_RMS, 8192, 2048, 8192)  # 1B, 8 x 1024
    assert not routes_to_xla("pallas", programs.SWIGLU_DGRAD, 512, 8192, 2048)  # 2^22 exactly
    assert routes_to_xla("cutedsl", programs.RESIDUAL_RMS, 512, 2048, 8192)
    assert not routes_to_xla("cutedsl", programs.RESIDUAL_RMS, 8192, 2048, 8192)
    assert routes_to_xla("pallas", programs.IDENTITY, 8192, 2048, 8192)  # plain GEMMs: as before
    for bad in (-1, "4M", 1.5):
        with pytest.raises(cj.OptionError, match="routing.xla_output_below"):
            cj.set_options(routing={"xla_output_below": bad})


def _kernel_programs(fn, *args) -> set[str]:
    """The epilogue programs of the Pallas kernels in ``fn``'s jaxpr (kernels are named
    ``coda_<program>_<layout>_<M>x<N>x<K>``)."""
    fresh = lambda *a: fn(*a)  # noqa: E731  (a fresh trace: jit's cache does not see the environment)
    return set(re.findall(r"coda_(\w+?)_[nt][nt]_\d+x\d+x\d+", str(jax.make_jaxpr(fresh)(*args))))


@pytest.mark.parametrize("m,d,n", [(64, 64, 128), (32, 128, 64)], ids=["n_above_d", "n_below_d"])
def test_norm_backward_follows_its_dgrad_to_xla(monkeypatch, m, d, n):
    # Where the backend hands the RMSNorm backward's dgrad GEMM ([M, d] output) to XLA, the
    # backward takes the `xla` backend's formulation (plain wgrad, d_gamma in the dx pass)
    # instead of the norm_wgrad kernel (faster at small batches: docs/performance.md#routing). The bound sits between the dgrad's output (m * d)
    # and the wgrad's (d * n), so that only the dgrad is small; both backward formulations
    # (N > d from dz itself, N <= d from rstd * dz) are covered.
    ks = jax.random.split(jax.random.key(31), 3)
    x = jax.random.normal(ks[0], (m, d), jnp.bfloat16)
    gamma = 1 + 0.1 * jax.random.normal(ks[1], (d,))
    w = (jax.random.normal(ks[2], (d, n)) / d ** 0.5).astype(jnp.bfloat16)

    def grads(backend):
        loss = lambda x, g, w: jnp.sum(cj.rms_norm_matmul(x, g, w, backend=backend).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))

    with cj.options(routing={"xla_output_below": 0}):
        assert "norm_wgrad" in _kernel_programs(grads("pallas"), x, gamma, w)  # the fused formulation
    with cj.options(routing={"xla_output_below": m * d + 1}):
        assert "norm_wgrad" not in _kernel_programs(grads("pallas"), x, gamma, w)
        got, want = grads("pallas")(x, gamma, w), grads("xla")(x, gamma, w)
    for name, g1, g2 in zip(("dx", "dgamma", "dw"), got, want):
        assert rel_err(g1, g2) < 2e-2, name


NARROW = dataclasses.replace(CONFIG_TABLE["default"], tile_n=64)  # what fit_waves picks for few tiles


@pytest.mark.parametrize("epi,kw", [(programs.NORM_WGRAD, dict(transpose_a=True)),
                                    (programs.rms_dgrad(True), dict(transpose_b=True))],
                         ids=["norm_wgrad", "rms_dgrad_res"])
def test_half_width_tile_of_the_wave_fit(epi, kw):
    """The default kernel at tile_n=64 (128 x 128 CTA tiles, clusters along M): the plan
    :func:`coda_jax.pallas.tuning.fit_waves` takes for GEMMs with few output tiles."""
    _compare(epi, 256, 256, 128, config=NARROW, **kw)


def test_half_width_tile_without_cluster():
    """The narrow tile without CTA pairs (a candidate for the wave fit)."""
    _compare(programs.NORM_WGRAD, 256, 256, 128, config=dataclasses.replace(NARROW, cluster_dimension=None),
             transpose_a=True)


def test_fit_waves_takes_the_half_width_tile_only_where_it_fills_the_sms():
    from coda_jax.pallas.tuning import fit_waves, wave_fill

    cfg = CONFIG_TABLE["default"]
    # The 1B QKV wgrad, [2048, 3072]: 192 CTA tiles of 128 x 256 on 132 SMs (73 % fill) ->
    # 384 of 128 x 128 (97 %).
    assert wave_fill(cfg, 2048, 3072, 132) == pytest.approx(192 / 264)
    assert fit_waves(cfg, 2048, 3072, 132).tile_n == 64
    assert fit_waves(cfg, 8192, 16384, 132) is cfg  # many tiles: the wide tile stays
    assert fit_waves(cfg, 2048, 3072, 132, pair_width=128) is cfg  # the SwiGLU pair must fit the tile


def test_choose_config_schedule():
    from coda_jax.pallas.tuning import _PINGPONG, LEAN_EPILOGUE, choose_config, fit_waves

    big = (8192, 8192, 2048)
    rope = choose_config(*big, "rms_rope")  # the name the QKV op uses (no QK-norm, training too)
    assert rope.pingpong and rope.cluster_dimension is None and rope.grid_minor_dim == "m"
    assert choose_config(*big, "rms_rope_qknorm_train").pingpong
    dgrad = choose_config(*big, "swiglu_dgrad")
    assert not dgrad.pingpong and dgrad.cluster_dimension is None  # cooperative, no CTA pair
    assert choose_config(*big, "residual_rms") == CONFIG_TABLE["default"]
    assert not choose_config(64, 64, 64, "rms_rope").warp_specialized  # the small table entry stays
    # an epilogue pass (one K step of 64) over a large output: ping-pong in bands along M
    for name in ("quantize_e4m3", "rope_grad_q8", None):
        cfg = choose_config(8192, 2048, 64, name)
        assert cfg.pingpong and cfg.grid_minor_dim == "m" and cfg.cluster_dimension is None, name
    assert not choose_config(200, 320, 64, "quantize_e4m3").warp_specialized  # a small one stays small
    pp = dataclasses.replace(CONFIG_TABLE["default"], **_PINGPONG)
    assert pp.pingpong and fit_waves(pp, 2048, 3072, 132) is pp  # a ping-pong tile is not narrowed
    assert all(getattr(choose_config(8192, 2048, 64, "quantize_e4m3"), f) for f in LEAN_EPILOGUE)  # passes: lean


def test_fp8_heuristic_takes_the_lean_ping_pong_kernel_for_quantizing_epilogues():
    """FP8 operands, K <= FP8_EPILOGUE_MAX_K: ping-pong with the lean epilogue for a quantizing
    output, with per-consumer column sums for dgamma, the program's own for the SwiGLU backward;
    every other FP8 GEMM keeps :func:`choose_config`'s configuration."""
    from coda_jax import epilogue as E
    from coda_jax.pallas.lowering import table_or_heuristic_config
    from coda_jax.pallas.tuning import (FP8_COL_SUM_CONFIG, FP8_EPILOGUE_CONFIG, FP8_EPILOGUE_MAX_K,
                                        FP8_PROGRAM_CONFIGS, choose_config, choose_fp8_config, fit_waves,
                                        for_fp8_operands)

    def has(cfg, fields):
        return all(getattr(cfg, f) == v for f, v in fields.items())

    swiglu_dgrad = E.dequantized(programs.SWIGLU_DGRAD_Q8)
    rope = E.dequantized(programs.rms_rope(32, None, False))
    assert rope.name in FP8_PROGRAM_CONFIGS, rope.name
    for epi, (m, n, k), fields in [
            (swiglu_dgrad, (8192, 8192, 2048), FP8_PROGRAM_CONFIGS[swiglu_dgrad.name]),
            (rope, (8192, 3072, 2048), FP8_PROGRAM_CONFIGS[rope.name]),  # no quantizing output
            (E.dequantized(programs.RESIDUAL_RMS_Q8), (8192, 2048, 2048), FP8_EPILOGUE_CONFIG),
            (E.dequantized(programs.rms_swiglu_q8(True)), (4096, 28672, 4096), FP8_EPILOGUE_CONFIG),
            (E.dequantized(programs.rms_dgrad_q8(True)), (8192, 2048, 3072), FP8_COL_SUM_CONFIG),  # dgamma + dxq
            (E.dequantized(programs.rms_dgrad(True, True)), (8192, 2048, 3072), FP8_COL_SUM_CONFIG)]:  # dgamma
        cfg = choose_fp8_config(m, n, k, epi)
        assert has(cfg, fields) and cfg.pingpong and cfg.cluster_dimension is None, epi.name
        assert cfg.consumer_col_sums == (fields is FP8_COL_SUM_CONFIG), epi.name
        # the heuristics' path of a kernel call without a table: the same, with the FP8 K step
        assert table_or_heuristic_config(epi, m, n, k, False, True, None, 132, fp8_operands=True) == \
            for_fp8_operands(cfg)
    assert not choose_fp8_config(8192, 8192, 2048, swiglu_dgrad).manual_barriers  # not the lean set
    keep = [(E.dequantized(programs.RESIDUAL_RMS_Q8), (8192, 2048, 2 * FP8_EPILOGUE_MAX_K)),  # long K
            (E.dequantized(programs.rms_dgrad_q8(True)), (8192, 2048, 16384)),  # long K with dgamma
            (E.dequantized(programs.IDENTITY), (8192, 2048, 2048)),  # nothing quantized
            (E.dequantized(programs.RESIDUAL_RMS_Q8), (200, 320, 2048))]  # the small class
    for epi, (m, n, k) in keep:
        assert choose_fp8_config(m, n, k, epi) == choose_config(m, n, k, epi.name), (epi.name, m, n, k)
    # 16-bit operands keep choose_config's, quantizing output or not
    epi = programs.SWIGLU_DGRAD_Q8
    assert table_or_heuristic_config(epi, 8192, 8192, 2048, False, True, None, 132) == \
        fit_waves(choose_config(8192, 8192, 2048, epi.name), 8192, 8192, 132, epi.pair_width)
    with pytest.raises(ValueError, match="delay_release must be 0 or 1"):
        dataclasses.replace(CONFIG_TABLE["default"], delay_release=2)


def test_every_program_config_names_a_real_program():
    """:data:`PROGRAM_CONFIGS` keys are names the ops' epilogues really have (an entry for a
    name no op uses would silently do nothing: "rms_rope_train" did)."""
    from coda_jax.pallas.tuning import PROGRAM_CONFIGS, TuningConfig

    names = {c[0].name for c in CASES} | {programs.rms_rope(64, 1e-6, False).name}
    assert set(PROGRAM_CONFIGS) <= names, set(PROGRAM_CONFIGS) - names
    for fields in PROGRAM_CONFIGS.values():
        dataclasses.replace(CONFIG_TABLE["default"], **fields)  # valid TuningConfig fields
    # FP8: the names the kernels see (the programs run on FP8 operands, epilogue.dequantized)
    from coda_jax import epilogue as E
    from coda_jax.pallas.tuning import FP8_PROGRAM_CONFIGS

    epilogues = [c[0] for c in CASES] + [v for v in vars(programs).values() if isinstance(v, E.Epilogue)]
    fp8_names = {E.dequantized(epi).name for epi in epilogues}
    assert set(FP8_PROGRAM_CONFIGS) <= fp8_names, set(FP8_PROGRAM_CONFIGS) - fp8_names
    for fields in FP8_PROGRAM_CONFIGS.values():
        dataclasses.replace(CONFIG_TABLE["default"], **fields)


def _shipped_program_configs():
    """(program case, config) of each distinct configuration in the shipped tuned tables."""
    from coda_jax.pallas.tuned import SHIPPED_TABLES, load_table

    seen = {}
    for e in (e for path in SHIPPED_TABLES for e in load_table(str(path)).entries):
        # FP8 entries, and the FP8 epilogue passes: test_pallas_fp8.py
        if e.config is not None and not e.program.endswith("_fp8") and e.program not in PASS_PROGRAMS:
            case = next((c for c in CASES if c[0].name == e.program), None)
            assert case is not None, f"tuned table entry for unknown program {e.program!r}"
            seen.setdefault((e.program, e.config), (case[0], e.layout, e.config))
    return list(seen.values())


@pytest.mark.parametrize("epi,layout,cfg", _shipped_program_configs(),
                         ids=lambda x: getattr(x, "name", None) or (x if isinstance(x, str) else None))
def test_shipped_tuned_configs(epi, layout, cfg):
    """Each configuration of the shipped tuned table, on the program it was tuned for, in the
    interpreter (``tests/test_gpu_pallas.py`` runs them compiled at larger shapes)."""
    _compare(epi, 256, 256, 128, transpose_a=layout[0] == "t", transpose_b=layout[1] == "t", config=cfg)
