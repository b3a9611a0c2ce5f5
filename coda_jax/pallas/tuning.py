"""Tuning configurations of the Pallas GEMM-epilogue kernel, and the per-shape table."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from coda_jax.epilogue import Epilogue, OutputKind


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static tiling of one GEMM-epilogue kernel.

    Attributes:
      tile_m, tile_n: output tile per CTA (one consumer warpgroup; ``tile_m`` a multiple
        of 64, ``tile_n`` a multiple of 64 and of the epilogue's pair block ``2*b``).
      tile_k: K step of the TMA/wgmma pipeline (64 for 16-bit operands: one 128-byte
        swizzled row; 32, a 64-byte row, only where both operands are K-major: half the
        SMEM per stage, so twice the stages in the same bytes). In elements: FP8 operands
        (1 byte) hold a 128-byte row in 128; the lowering's own configurations for them are
        the 16-bit ones with ``tile_k`` doubled (:func:`for_fp8_operands`), a configuration
        passed in is taken as given.
      max_concurrent_steps: pipeline depth (SMEM stages in flight).
      grid_tile_width: width of the planar-snake band of tiles, for L2 reuse.
      grid_minor_dim: ``"n"`` or ``"m"``: the dimension the planar-snake band runs across
        (consecutive CTAs take neighbouring tiles along it, sharing the other operand's
        block in L2).
      warp_specialized: one producer warpgroup issues the TMA loads and two consumer
        warpgroups each own a ``[tile_m, tile_n]`` half of a ``[2*tile_m, tile_n]`` CTA
        tile (more reuse per byte of SMEM traffic). Falls back to the single-warpgroup
        kernel where its operand stages and epilogue do not fit in SMEM (fewer stages are
        tried first).
      wg_dimension: ``"m"``: the two consumers split the CTA tile along M (CTA tile
        ``[2*tile_m, tile_n]``); ``"n"``: along N (CTA tile ``[tile_m, 2*tile_n]``, which
        also serves a transposed A, the wgrad layout).
      cluster_dimension: ``None``, ``"m"`` or ``"n"`` (warp-specialized kernel only): CTAs
        run in clusters of two that take neighbouring CTA tiles along this dimension and
        share the operand block they have in common through a multicast TMA load (cluster
        ``"m"``: both CTAs need the same B block; ``"n"``: the same A block), halving its
        L2 -> SMEM traffic. The other grid dimension's tiles are then walked in pairs.
      swizzle_epilogue: the epilogue's SMEM staging tiles (tile loads and tile outputs)
        use the 128-byte swizzled layout that TMA and the WGMMA register layout agree on
        (no bank conflicts); ``False`` keeps them row-major. A quantizing output's transposed
        copy is staged swizzled too (the widest swizzle its rows of ``tile_m`` bytes allow).
      epilogue_cols: width of one epilogue chunk outside pair mode (64, 32 or 16): the
        accumulator is processed ``[tile_m, epilogue_cols]`` at a time, each chunk's tile
        loads and outputs double-buffered in SMEM. ``plan_kernel`` narrows it for heavy
        epilogues so that the warp-specialized kernel keeps its pipeline depth.
      epilogue_load_slots: SMEM slots of the epilogue's tile loads (at most; ``plan_kernel``
        lowers it, down to 2, to fit): a chunk's loads are issued that many chunks ahead
        (one fewer where a tile output is staged in place of a load, see
        :class:`coda_jax.pallas.gemm_epilogue._EpilogueEmitter`), so their latency hides
        behind the chunks before it. Default 2 (double-buffered loads): more slots did not
        speed up the block's fused GEMMs and slowed one of them (``rms_dgrad_res``)
        (docs/performance.md#kernels).
      epilogue_out_slots: SMEM staging slots of each tile output (1 or 2). Two (the default)
        double-buffer the chunks: a chunk's store may still be reading its slot while the
        next chunk is written. One halves that staging, so that wider chunks fit beside the
        operand stages (the identity GEMM at 4 stages: 64-column chunks instead of 32, two
        TMA stores per consumer tile instead of four); each chunk then waits for the
        previous chunk's store to have read the slot before writing it. It wins on some
        fused GEMMs, where the tuned table picks it, not on every kernel of a step, so two
        stay the default (docs/performance.md#kernels).
      epilogue_regs: register budget of one epilogue chunk, in float32 values per thread
        (:func:`coda_jax.pallas.gemm_epilogue.live_values`: accumulator slice, tile loads and
        tile outputs of a chunk); ``plan_kernel`` narrows the chunk (pair-mode chunks too,
        unless the body sums over a pair half) until it fits, so that heavy epilogues do not
        spill beside the 128-register accumulator.
      schedule: how the warp-specialized kernel's two consumer warpgroups share the work.
        ``"cooperative"``: both work on one CTA tile (``wg_dimension`` splits it) and run
        their epilogues at the same time, while the tensor cores wait. ``"pingpong"``: each
        consumer owns a whole ``[tile_m, tile_n]`` tile. The CTA's tiles alternate between the
        two consumers, and the producer streams their operand blocks through one ring of
        stages in tile order. One consumer's epilogue then runs while the other's MMAs do.
        With a cluster, the two CTAs of a cluster take neighbouring tiles at the same time
        and share one operand block by multicast, as in the cooperative kernel; that is
        slower than ping-pong without one, as each CTA then waits on its partner's epilogue
        (docs/performance.md#kernels).
      pingpong_turns: ping-pong only: the consumers take turns on the tensor cores. A
        consumer starts a tile's MMAs only after the other consumer has finished its previous
        tile's (a barrier each consumer arrives on for the other), as CUTLASS's ping-pong
        orders its math warpgroups. Without it, a ring deep enough to hold the next tile's
        first stages lets both consumers run MMAs at once, finish together and then run their
        epilogues together, as the cooperative kernel does, and the overlap that ping-pong is
        for is lost (docs/performance.md#kernels).
      delay_release: cooperative warp-specialized kernel only. ``0``: JAX's warp-specialized
        pipeline (``plgpu.emit_pipeline_warp_specialized``), where each consumer waits for its
        K step's MMAs to finish (``wgmma_wait(0)``) before it releases the step's SMEM stage
        and issues the next step, so the tensor cores drain between steps. ``1``: the
        hand-written stage ring of the ping-pong kernel, with both consumers on every CTA
        tile: each issues step ``k+1``'s MMAs while step ``k``'s still run (``wgmma_wait(1)``)
        and releases step ``k``'s stage then (one stage fewer in flight for the producer,
        which also runs on into the next tile while the consumers run their epilogues).
        The ping-pong and single-warpgroup kernels always keep one step in flight.
      direct_loads: the epilogue's tile loads go from GMEM straight into registers (vector
        loads in the WGMMA register layout; chunk ``c + epilogue_load_slots - 1``'s issued
        before chunk ``c`` is computed, the first ones before the mainloop), not through
        SMEM slots filled by TMA: no load staging SMEM, barriers or TMA load requests beside
        the mainloop's.
      direct_stores: the epilogue's tile outputs go from registers straight to GMEM (vector
        stores), not staged in SMEM and written by TMA. The kernel then runs without Pallas's
        automatic barriers (what SMEM it still writes, row partials, is fenced by hand).
      manual_barriers: warp-specialized kernels: the epilogue's staged tile outputs and loads
        are synchronized by hand, not by Pallas's automatic barriers, which put a warpgroup
        barrier before and after every register -> SMEM store and before every TMA load (about
        13 a chunk for a quantizing SwiGLU backward, whose four warps they hold in lockstep).
        By hand a chunk has two: the wait for its staging slot's previous TMA store, and
        ``commit_smem`` before its own stores (a load refills the slot of the chunk before,
        which every thread read before that chunk's commit). Not with in-place staging or
        column sums (cross-warp reductions), which keep the automatic barriers.
      fp8_byte_transpose: a quantizing output's transposed copy is relaid from its FP8 values
        (the main copy's): per two of a thread's two-element vectors, one 32-bit shuffle with
        the lane that holds the neighbouring row and one byte permute, instead of relaying the
        float32 values (a shuffle and three selects per vector) and casting them again. The
        same bits either way; compiled kernels only (the interpreter relays the float32 values).
      fold_row_reductions: row sums and a quantizing output's row max (the amax) are kept as
        ``[tile_m, 8]`` register partials across the tile's chunks (each chunk folded into them
        elementwise) and reduced across columns and lanes once per tile, not per chunk: no
        shuffles per chunk, 8 more registers a thread per reduced output. (The row sums then
        add in another order, within float32 rounding.)
      consumer_col_sums: warp-specialized kernels: an epilogue's column sums (the RMSNorm
        backward's ``dgamma``) are reduced in the kernel by each consumer warpgroup with an SMEM
        scratch of its own, so such an epilogue keeps the two-consumer kernels. Pallas gives a
        reduction across warps one scratch per kernel, which two consumers reducing at once
        share (what gave the intermittently wrong partials on the H100); compiled kernels only
        (the interpreter's sums share nothing).
      col_sum_tiles: warp-specialized kernel: an epilogue with column sums (the RMSNorm
        backward's ``dgamma``) writes each sum's summands as a float32 tile ``[M, N]``, which
        the caller sums over M (the column-sum contract, with one partial per row), so that
        it keeps the two consumer warpgroups. A column sum reduced in the kernel crosses warps,
        and run by two consumer warpgroups at once it gave intermittently wrong partials on
        the H100, so such an epilogue otherwise falls back to the single-warpgroup kernel
        (:func:`coda_jax.pallas.gemm_epilogue.plan_epilogue`). The tile costs 8 bytes an
        element of traffic (written, then read by the sum), and its staging SMEM can cost the
        kernel pipeline stages or chunk width. Off by default (the single-warpgroup kernel
        with the sum in the kernel): in the 1B FP8 step it sped up the light dgrad with
        ``dgamma`` (K = 3072) and slowed the heavy one (K = 16384, which also writes two FP8
        layouts) (docs/fp8.md); the autotuner's ``*_col_tiles`` candidates time it per GEMM.
      prefetch_next_tile: ring kernels (ping-pong, or ``delay_release=1``) with staged tile
        loads: a consumer issues its next tile's first tile loads during this tile's last
        chunks, into the slots those chunks' loads have freed (the chunk sequence and its slot
        ring run on across tiles), instead of at the next tile's start. Its first chunks' loads
        then no longer wait out a whole latency behind a short mainloop: what bounds an
        epilogue pass (one K step of zero operands) and GEMMs with short K. Applies where a
        tile has more chunks than loads in flight ahead (``epilogue_load_slots - 1``) and no
        output is staged in place; elsewhere the kernel is unchanged.
      skip_pass_gemm: ring kernels (ping-pong, or ``delay_release=1``) running an epilogue
        pass (an epilogue that declares ``reads_acc=False``: its outputs come from its loads
        alone): no GEMM under it, so the producer loads no operand stage, the consumers issue
        no MMA and wait on no stage, and the body gets the zero accumulator. A pass otherwise
        runs one K step of zero operands a tile (their TMA loads share the L2 and the barriers
        with the pass's own tile loads). Elsewhere (a program that reads ``acc``, the other
        kernels) the kernel is unchanged.
      approx_math: the epilogue's transcendentals (exp, sigmoid, rsqrt, division) use the
        GPU's approximate instructions (relative error ~1e-7..1e-6 in float32, far below the
        bfloat16 rounding of the outputs).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 4
    grid_minor_dim: str = "n"
    cluster_dimension: str | None = None
    warp_specialized: bool = False
    wg_dimension: str = "m"
    swizzle_epilogue: bool = False
    epilogue_cols: int = 64
    epilogue_load_slots: int = 2
    epilogue_out_slots: int = 2
    epilogue_regs: int = 128
    schedule: str = "cooperative"
    delay_release: int = 0
    pingpong_turns: bool = False
    direct_loads: bool = False
    direct_stores: bool = False
    manual_barriers: bool = False
    fp8_byte_transpose: bool = False
    fold_row_reductions: bool = False
    consumer_col_sums: bool = False
    col_sum_tiles: bool = False
    prefetch_next_tile: bool = False
    skip_pass_gemm: bool = False
    approx_math: bool = False

    def __post_init__(self):
        if self.wg_dimension not in ("m", "n"):
            raise ValueError(f"wg_dimension must be 'm' or 'n', got {self.wg_dimension!r}")
        if self.grid_minor_dim not in ("m", "n"):
            raise ValueError(f"grid_minor_dim must be 'm' or 'n', got {self.grid_minor_dim!r}")
        if self.cluster_dimension not in (None, "m", "n"):
            raise ValueError(f"cluster_dimension must be None, 'm' or 'n', got {self.cluster_dimension!r}")
        if self.schedule not in ("cooperative", "pingpong"):
            raise ValueError(f"schedule must be 'cooperative' or 'pingpong', got {self.schedule!r}")
        if self.tile_m % 64 or self.tile_n % 64:
            raise ValueError(f"tile_m and tile_n must be multiples of 64, got {self}")
        if self.tile_k % 32:
            raise ValueError(f"tile_k must be a multiple of 32 (64 unless both operands are K-major), got {self}")
        if self.epilogue_cols not in (16, 32, 64):
            raise ValueError(f"epilogue_cols must be 16, 32 or 64, got {self.epilogue_cols}")
        if self.epilogue_out_slots not in (1, 2):
            raise ValueError(f"epilogue_out_slots must be 1 or 2, got {self.epilogue_out_slots}")
        if self.epilogue_load_slots < 2:
            raise ValueError(f"epilogue_load_slots must be >= 2, got {self.epilogue_load_slots}")
        if self.max_concurrent_steps < 1:
            raise ValueError(f"max_concurrent_steps must be >= 1, got {self.max_concurrent_steps}")
        if self.delay_release not in (0, 1):
            raise ValueError(f"delay_release must be 0 or 1, got {self.delay_release}")

    def k_step_fits(self, transpose_a: bool, transpose_b: bool) -> bool:
        """Whether ``tile_k`` suits the layout: a 32-element K step is a 64-byte row, which
        Mosaic GPU's wgmma takes only where both operands keep K minor-most (A ``[M, K]``,
        B stored ``[N, K]``: the dgrad layout)."""
        return self.tile_k % 64 == 0 or (not transpose_a and transpose_b)

    @property
    def pingpong(self) -> bool:
        """Whether the warp-specialized kernel runs the ping-pong schedule."""
        return self.warp_specialized and self.schedule == "pingpong"

    def cta_tile(self) -> tuple[int, int]:
        """Output tile that one CTA computes at a time: two consumer tiles in the cooperative
        warp-specialized kernel, one (per consumer, in turn) otherwise."""
        if not self.warp_specialized or self.pingpong:
            return self.tile_m, self.tile_n
        return (self.tile_m, 2 * self.tile_n) if self.wg_dimension == "n" else (2 * self.tile_m, self.tile_n)

    def cluster_tile(self) -> tuple[int, int]:
        """Output tile of one cluster (the CTA tile when not clustered)."""
        cm, cn = self.cta_tile()
        if self.cluster_dimension is None or not self.warp_specialized:
            return cm, cn
        return (2 * cm, cn) if self.cluster_dimension == "m" else (cm, 2 * cn)

    def smem_bytes(self, itemsize: int) -> int:
        """SMEM of the mainloop's operand stages."""
        cm, cn = self.cta_tile()
        return self.max_concurrent_steps * (cm + cn) * self.tile_k * itemsize


# Per shape class: the fastest of the measured candidates on the H100 (benchmarks/tune.py
# regenerates it: docs/performance.md#tuned-tables). Keys: "small" (M*N < 2^22 or K < 256),
# "default".
CONFIG_TABLE: dict[str, TuningConfig] = {
    "small": TuningConfig(tile_m=64, tile_n=128, tile_k=64, max_concurrent_steps=2, approx_math=True),
    # 128 x 256 CTA tile, consumers split along N; plan_kernel trims the pipeline to 3
    # stages beside the epilogue staging (4 do not fit). Approximate math: epilogues heavy in
    # transcendentals (the SwiGLU backward) run markedly faster with it, and programs without
    # them are unaffected. CTA pairs along M share the B block by multicast TMA, halving its
    # L2 -> SMEM traffic: the large identity GEMMs reach the JAX-shipped kernel's best, and no
    # other shape or layout is slower (docs/performance.md#kernels).
    "default": TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=4, warp_specialized=True,
                            wg_dimension="n", cluster_dimension="m", approx_math=True),
}


# Per-program changes to the default configuration, for GEMMs the tuned table
# (:mod:`coda_jax.pallas.tuned`) has no entry for. Each won at both the 1B and the 8B-width
# training step's shapes on the H100 (docs/performance.md#kernels):
# * RoPE (register math beside a short mainloop): ping-pong, whose consumers overlap one
#   tile's epilogue with the other's MMAs, with bands of tiles across M. The cooperative
#   kernel runs it on 2 stages; with one output slot it gets 3 and, at the 8B width, beats
#   ping-pong (the tuned table's entry there).
# * swiglu_dgrad: the cooperative kernel without CTA pairs, faster than ping-pong at both widths.
# Ping-pong drops the CTA pair: a clustered ping-pong waits on the partner's epilogue.
_PINGPONG = {"schedule": "pingpong", "cluster_dimension": None}
PROGRAM_CONFIGS: dict[str, dict] = {
    "rms_rope": {**_PINGPONG, "grid_minor_dim": "m"},
    "rms_rope_qknorm": {**_PINGPONG, "grid_minor_dim": "m"},
    "rms_rope_qknorm_train": {**_PINGPONG, "grid_minor_dim": "m"},
    "swiglu_dgrad": {"cluster_dimension": None},
}


# The lean epilogue: staged chunks synchronized by hand, a quantizing output's transposed copy
# relaid from its FP8 bytes, row reductions folded across chunks (TuningConfig's fields; each
# is left off by the kernel where it does not apply). Fewer barriers, shuffles, selects and
# casts in every tile's epilogue: what bounds a kernel whose epilogue outlasts its MMAs.
LEAN_EPILOGUE = {"manual_barriers": True, "fp8_byte_transpose": True, "fold_row_reductions": True}

# An epilogue pass (coda_jax.ops.epilogue_pass: the program over one K step of zero operands,
# K = 64) is all epilogue: its traffic is the whole cost. On a large output, ping-pong over
# bands of tiles along M overlaps one consumer's loads and stores with the other's; every
# pass the autotuner has measured (the QKV gradient's, the FP8 LM head's, the quantizing and
# norm-input passes; docs/performance.md) won with it, well ahead of the small
# single-warpgroup configuration, and with the lean epilogue by a few percent more. A pass
# whose program ignores the accumulator (Epilogue.reads_acc) then skips the zero GEMM
# (skip_pass_gemm: no operand loads in the L2 beside the pass's own, no MMAs): that beat the
# same configuration with its GEMM on every pass call of the 1B FP8 step timed, on an H100
# and an H200 (docs/performance.md#kernels). A program that reads acc runs its GEMM.
PASS_MAX_K = 64
PASS_CONFIG = {**_PINGPONG, "grid_minor_dim": "m", **LEAN_EPILOGUE, "skip_pass_gemm": True}

# A GEMM of FP8 operands whose epilogue writes a quantizing output (an FP8 tile, its
# transposed copy and amax) over a K of at most FP8_EPILOGUE_MAX_K: the FP8 MMAs end before the
# epilogue's tile traffic, so ping-pong (one consumer's epilogue beside the other's MMAs) with
# the lean epilogue. It beat the cooperative default on every such GEMM of the 1B and
# 8B-width FP8 blocks measured (docs/performance.md#kernels); over longer K (the down
# projection's forward, K = the MLP width) the default held. Column sums (dgamma) keep the
# default: two consumers summing need TuningConfig.consumer_col_sums.
FP8_EPILOGUE_MAX_K = 4096
FP8_EPILOGUE_CONFIG = {**_PINGPONG, **LEAN_EPILOGUE}
# Such a GEMM whose epilogue also sums columns (the norm backward's dgamma, quantizing its dx
# or not): ping-pong too, each consumer reducing its column sums through its own scratch
# (TuningConfig.consumer_col_sums), with bands across M and the economies that apply beside a
# column sum (barriers stay automatic there). It beat the single-warpgroup kernel that column
# sums otherwise take on both such GEMMs of the 1B FP8 block (docs/performance.md#kernels).
FP8_COL_SUM_CONFIG = {**_PINGPONG, "grid_minor_dim": "m", "consumer_col_sums": True, "fp8_byte_transpose": True,
                      "fold_row_reductions": True}
# Per program, in place of the two above. The FP8 SwiGLU backward (pair blocks, sigmoid math,
# two row reductions) ran fastest with the byte relayout alone, bands across M: barriers by
# hand and folded row reductions slowed it. The FP8 QKV projection with RoPE writes no FP8
# output (attention reads bf16), yet as its 16-bit form (PROGRAM_CONFIGS) it runs faster on
# ping-pong with bands across M, and with the lean epilogue: 1.2-1.3x the cooperative default
# at the 1B and 8B-width shapes on an H100 and an H200 (docs/performance.md#kernels).
_SWIGLU_DGRAD_FP8 = {**_PINGPONG, "grid_minor_dim": "m", "fp8_byte_transpose": True}
FP8_PROGRAM_CONFIGS: dict[str, dict] = {
    "swiglu_dgrad_q8_fp8": _SWIGLU_DGRAD_FP8,
    # the same program reading z in e4m3 (Fp8Recipe(swiglu_input="e4m3")): the same math and outputs
    "swiglu_dgrad_zq8_fp8": _SWIGLU_DGRAD_FP8,
    "rms_rope_fp8": {**_PINGPONG, "grid_minor_dim": "m", **LEAN_EPILOGUE},
}


def choose_config(m: int, n: int, k: int, program: str | None = None) -> TuningConfig:
    """The heuristic configuration for an ``[m, k] @ [k, n]`` GEMM running epilogue ``program``:
    the shape class's table entry, with :data:`PROGRAM_CONFIGS`'s changes for that program
    (warp-specialized entries only); an epilogue pass over a large output (``k <=``
    :data:`PASS_MAX_K`) on the ping-pong kernel (:data:`PASS_CONFIG`).
    """
    if k <= PASS_MAX_K and m * n >= (1 << 22):
        return dataclasses.replace(CONFIG_TABLE["default"], **PASS_CONFIG)
    cfg = CONFIG_TABLE["small"] if m * n < (1 << 22) or k < 256 else CONFIG_TABLE["default"]
    if not cfg.warp_specialized:
        return cfg
    return dataclasses.replace(cfg, **PROGRAM_CONFIGS.get(program or "", {}))


def choose_fp8_config(m: int, n: int, k: int, epilogue: Epilogue) -> TuningConfig:
    """The heuristic configuration for an ``[m, k] @ [k, n]`` GEMM of FP8 operands running
    ``epilogue``, before its K step is doubled (:func:`for_fp8_operands`): :func:`choose_config`'s,
    and over a K of at most :data:`FP8_EPILOGUE_MAX_K` on the ping-pong kernel: with the lean
    epilogue (:data:`FP8_EPILOGUE_CONFIG`) where the epilogue writes a quantizing output and sums
    no columns, with column sums per consumer (:data:`FP8_COL_SUM_CONFIG`) where it sums columns,
    or as :data:`FP8_PROGRAM_CONFIGS` names for its program."""
    cfg = choose_config(m, n, k, epilogue.name)
    if not cfg.warp_specialized or k > FP8_EPILOGUE_MAX_K:
        return cfg
    quantizes = any(o.quantize is not None for o in epilogue.outputs)
    col_sums = any(o.kind is OutputKind.COL_SUM for o in epilogue.outputs)
    if epilogue.name in FP8_PROGRAM_CONFIGS:
        return dataclasses.replace(cfg, **FP8_PROGRAM_CONFIGS[epilogue.name])
    if col_sums:
        return dataclasses.replace(cfg, **FP8_COL_SUM_CONFIG)
    if quantizes:
        return dataclasses.replace(cfg, **FP8_EPILOGUE_CONFIG)
    return cfg


def config_overrides(items: list[str], source: str) -> dict[str, Any]:
    """``["field=value", ...]`` as ``{field: value}`` for ``dataclasses.replace`` of a
    :class:`TuningConfig`, each value parsed as its field's type: integers, ``true`` / ``false``
    (or ``1`` / ``0``), strings, ``none`` for the fields that take None. ``ValueError`` naming
    ``source`` and the rule for an unknown field or a value of the wrong type (the values
    themselves are checked by ``TuningConfig`` when it is built)."""
    fields = {f.name: f for f in dataclasses.fields(TuningConfig)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"{source}: an override is field=value with a TuningConfig field, got {item!r}")
        default = fields[name].default
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{source}: {name} takes true or false, got {text!r}")
            out[name] = text.lower() in ("true", "1")
        elif isinstance(default, int):
            try:
                out[name] = int(text)
            except ValueError:
                raise ValueError(f"{source}: {name} takes an integer, got {text!r}") from None
        else:
            out[name] = None if text.lower() == "none" else text
    return out


def for_fp8_operands(cfg: TuningConfig) -> TuningConfig:
    """``cfg`` (chosen for 16-bit operands) for a GEMM of FP8 operands: ``tile_k`` doubled,
    so that a K step holds the same bytes (64 bf16 elements, one 128-byte swizzled row, become
    128 FP8 elements: a 128-byte swizzle, one 8-bit wgmma K group of 128, four k32
    instructions). The stages keep their SMEM bytes, so the plan is the 16-bit one's."""
    return dataclasses.replace(cfg, tile_k=2 * cfg.tile_k)


# Wave quantization: a GEMM with few output tiles (e.g. the 1B model's QKV wgrad, [2048, 3072]:
# 192 CTA tiles of 128 x 256 on 132 SMs, a second wave 45 % full) leaves SMs idle. Below this
# fill, fit_waves tries the half-width tile.
WAVE_FILL_MIN = 0.8
# Mainloop rate of a 128 x 128 CTA tile relative to the default 128 x 256 one (assumed; the
# narrow tile is taken only where it wins by more than this).
NARROW_TILE_RATE = 0.9


def wave_fill(cfg: TuningConfig, m: int, n: int, num_sms: int) -> float:
    """Fraction of the SMs' waves that ``cfg``'s CTA tiles of an ``[m, n]`` output keep busy."""
    cm, cn = cfg.cta_tile()
    tiles = math.ceil(m / cm) * math.ceil(n / cn)
    return tiles / (math.ceil(tiles / num_sms) * num_sms)


def fit_waves(cfg: TuningConfig, m: int, n: int, num_sms: int, pair_width: int | None = None) -> TuningConfig:
    """``cfg``, or the same with half its ``tile_n`` where that fills the SMs' waves enough
    better to pay for the narrower tile (:data:`NARROW_TILE_RATE`). The pair width of a
    pair-mode epilogue must divide the narrower tile."""
    if cfg.tile_n < 128 or cfg.pingpong:
        return cfg  # a ping-pong CTA already takes 128 x 128 tiles
    fill = wave_fill(cfg, m, n, num_sms)
    if fill >= WAVE_FILL_MIN:
        return cfg
    narrow = dataclasses.replace(cfg, tile_n=cfg.tile_n // 2)
    if pair_width is not None and narrow.tile_n % pair_width:
        return cfg
    return narrow if wave_fill(narrow, m, n, num_sms) * NARROW_TILE_RATE > fill else cfg
