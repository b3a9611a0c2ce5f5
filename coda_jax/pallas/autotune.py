"""Autotuning: time every Pallas kernel call of a function under candidate configurations.

    from coda_jax.pallas.autotune import autotune, write_table
    table = autotune(train_step, state, inputs, targets)      # on the GPU
    write_table(table, "my_tuned.json")                        # then cj.set_options(pallas={"tuned_tables": ("my_tuned.json",)})

Steps: trace ``fn(*args)`` abstractly with tuned tables off and collect its distinct kernel
calls (:func:`coda_jax.pallas.kernel_calls.record_kernel_calls`); for each call, build random
operands and loads of its shapes, run it under the configuration the heuristics pick and
under each candidate (:func:`candidate_configs`), reject a candidate whose outputs differ
from the heuristic's (relative error above ``rtol``, or a NaN, on any of
:data:`CHECK_LAUNCHES` launches on a GPU), and time the rest with
CUPTI (the sum of the call's GPU kernel durations, median of ``iters``). A candidate that
beats the heuristic by more than ``min_gain`` becomes the call's table entry; otherwise the
entry keeps the heuristic (``"config": null``). :mod:`coda_jax.pallas.tuned` has the format
and the lookup. ``benchmarks/tune.py --model``
runs this on a CodaLlama training step.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import FP8_DTYPES, Epilogue, OutputKind
from coda_jax.lowering import gpu_sm_count
from coda_jax.pallas.kernel_calls import KernelCall, record_kernel_calls
from coda_jax.pallas.gemm_epilogue import plan_epilogue
from coda_jax.pallas.lowering import PallasLowering, heuristic_config, kernel_load_dtype, kernel_shape
from coda_jax.pallas.tuned import config_fields, layout_name, loads_signature, parse_table, tables_disabled
from coda_jax.pallas.tuning import (CONFIG_TABLE, FP8_COL_SUM_CONFIG, LEAN_EPILOGUE, TuningConfig, config_overrides,
                                    for_fp8_operands)

_D = CONFIG_TABLE["default"]
# The wide candidates' settings (EXTENDED_CANDIDATES' "*_wide*"): 32-column pair chunks past
# the register budget, one output staging slot.
WIDE_CHUNKS = {"epilogue_regs": 160, "epilogue_out_slots": 1}
# Variants of the default that won on some GEMM of a training step on the H100
# (docs/performance.md#tuned-tables):
# bands of tiles across M, wider bands, no CTA pair, ping-pong (also with bands across M),
# the narrow tile.
CANDIDATES: dict[str, TuningConfig] = {
    "default": _D,
    "minor_m": dataclasses.replace(_D, grid_minor_dim="m"),
    "band8": dataclasses.replace(_D, grid_tile_width=8),
    "band16": dataclasses.replace(_D, grid_tile_width=16),
    "no_cluster": dataclasses.replace(_D, cluster_dimension=None),
    "pingpong": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None),
    "pingpong_minor_m": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, grid_minor_dim="m"),
    "narrow": dataclasses.replace(_D, tile_n=64),
    "narrow_no_cluster": dataclasses.replace(_D, tile_n=64, cluster_dimension=None),
}
# Not measured yet: the epilogue's own knobs (load ring depth, chunk width, swizzled
# staging) and wider ping-pong bands. Name them (or "extended", or "all") to time them:
# each candidate costs a Mosaic GPU lowering per call, seconds of Python each
# (docs/performance.md#compile-time).
EXTENDED_CANDIDATES: dict[str, TuningConfig] = {
    "slots3": dataclasses.replace(_D, epilogue_load_slots=3),
    "slots4": dataclasses.replace(_D, epilogue_load_slots=4),
    "cols32": dataclasses.replace(_D, epilogue_cols=32),
    # plan_kernel keeps pipeline stages before chunk width: beside the epilogue staging, the
    # cooperative kernel mostly keeps 3 stages with 16-column chunks (8 TMA stores of
    # 128 x 16 per consumer tile). Two stages leave room for 32-64-column chunks.
    "stages2": dataclasses.replace(_D, max_concurrent_steps=2),
    "swizzled": dataclasses.replace(_D, swizzle_epilogue=True),
    "no_cluster_swizzled": dataclasses.replace(_D, cluster_dimension=None, swizzle_epilogue=True),
    "pingpong_band8": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, grid_tile_width=8),
    "pingpong_minor_m_band8": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                  grid_minor_dim="m", grid_tile_width=8),
    "pingpong_slots3": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, epilogue_load_slots=3),
    # Swizzled staging on the ping-pong schedule (the FP8 block's quantizing programs tuned to
    # ping-pong): a quantizing output's transposed copy is then staged swizzled as well.
    "pingpong_swizzled": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, swizzle_epilogue=True),
    "pingpong_minor_m_swizzled": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                     grid_minor_dim="m", swizzle_epilogue=True),
    # Column sums (the FP8 norm backward's dgamma) as float32 summand tiles on the
    # warp-specialized kernels (TuningConfig.col_sum_tiles; only programs with a column sum
    # get them): faster on one of the 1B FP8 step's two such GEMMs, slower on the other.
    "col_tiles": dataclasses.replace(_D, col_sum_tiles=True),
    "pingpong_col_tiles": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, col_sum_tiles=True),
    "pingpong_minor_m_col_tiles": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                      grid_minor_dim="m", col_sum_tiles=True),
    # A 128 x 128 x 64 stage is half the cooperative kernel's: deeper rings fit. With CTA
    # pairs, a deeper ring may absorb the partner's epilogue that made the clustered
    # ping-pong lose at 4 stages (docs/performance.md#kernels).
    "pingpong_deep": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, max_concurrent_steps=6),
    "pingpong_cluster_deep": dataclasses.replace(_D, schedule="pingpong", max_concurrent_steps=6),
    # The cooperative kernel on the stage ring, one K step's MMAs in flight: faster for most
    # identity GEMMs, slower for every fused program, so not the default
    # (docs/performance.md#kernels). (Unconfirmed reading: beside a fused epilogue's
    # staging the kernel keeps 3 stages, and the ring's delayed release leaves the producer 2.)
    "ring": dataclasses.replace(_D, delay_release=1),
    "ring_no_cluster": dataclasses.replace(_D, delay_release=1, cluster_dimension=None),
    # K steps of 32 (dgrad layout only): a stage is half the bytes, so the ring's held-back
    # stage costs half as much lookahead, and 6 stages fit beside a fused epilogue's staging
    # (the bytes of 3 stages of 64).
    "ring_k32": dataclasses.replace(_D, tile_k=32, max_concurrent_steps=8, delay_release=1),
    "ring_k32_no_cluster": dataclasses.replace(_D, tile_k=32, max_concurrent_steps=8, delay_release=1,
                                               cluster_dimension=None),
    "k32": dataclasses.replace(_D, tile_k=32, max_concurrent_steps=8),
    # Tile loads (and outputs) straight between GMEM and registers, not staged in SMEM by TMA:
    # kernel timelines show ping-pong consumers starving for operand stages while the other
    # consumer's epilogue runs (docs/performance.md#kernels).
    "direct_loads": dataclasses.replace(_D, direct_loads=True),
    "direct": dataclasses.replace(_D, direct_loads=True, direct_stores=True),
    "pingpong_direct_loads": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, direct_loads=True),
    "pingpong_direct_loads_ahead3": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                        direct_loads=True, epilogue_load_slots=4),
    "pingpong_direct": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, direct_loads=True,
                                           direct_stores=True),
    # Ping-pong consumers taking turns on the tensor cores, so that a deeper ring (the next
    # tile's first stages loaded early) does not let both run MMAs at once.
    "pingpong_turns": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, pingpong_turns=True),
    "pingpong_turns_deep": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, pingpong_turns=True,
                                               max_concurrent_steps=6),
    # 5 stages beside an epilogue whose outputs are staged in their loads' slots (3 slots):
    # what fits of a deeper ring for the SwiGLU backward (docs/performance.md#kernels).
    "pingpong_turns_s5_in_place": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                      pingpong_turns=True, max_concurrent_steps=5,
                                                      epilogue_load_slots=3),
    "pingpong_turns_direct_deep": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                      pingpong_turns=True, max_concurrent_steps=6, direct_loads=True),
    # 192-wide consumer tiles (192 accumulator registers a thread): a 128 x 384 or 256 x 192 CTA
    # tile reads ~17 % fewer operand bytes from SMEM per MMA than 128 x 128 consumers, and
    # changes the wave count (8192 x 16384: 2752 CTA tiles of 256 x 192, 20.8 waves on 132
    # SMs, against 4096 of 128 x 256, 31.03 waves). Pair-mode epilogues need a pair width
    # that divides 192 (not the SwiGLU forward's 128). Slower than the default for the
    # identity GEMM in every layout, they win only where the wider tile fits the output into
    # one wave (the 1B QKV wgrad, 2048 x 3072: 128 CTA tiles; docs/performance.md#kernels).
    # One SMEM staging slot per tile output: 64-column epilogue chunks fit beside 4 operand
    # stages where two slots force 32 (a 128 x 128 identity tile is then stored as four
    # 32-column chunks, each with its barriers, fence and TMA store). The identity GEMM does
    # not move; fused GEMMs with a narrow output and the cooperative RoPE forward gain (entries
    # of the tuned table); one slot for every kernel does not speed up the step
    # (docs/performance.md#kernels).
    "one_out_slot": dataclasses.replace(_D, epilogue_out_slots=1),
    "ring_one_out_slot": dataclasses.replace(_D, delay_release=1, epilogue_out_slots=1),
    # Tile loads straight into registers and one output slot: the SMEM both free gives most
    # cooperative fused kernels of the 1B step a fourth operand stage (benchmarks/kernel_plans.py).
    # Yet slower than one slot alone at every call of the 1B step (docs/performance.md#kernels).
    "direct_loads_one_out_slot": dataclasses.replace(_D, direct_loads=True, epilogue_out_slots=1),
    # The same on the ping-pong kernel (with bands across M: the QKV forward's table entry).
    "pingpong_one_out_slot": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                 epilogue_out_slots=1),
    "pingpong_minor_m_one_out_slot": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                         grid_minor_dim="m", epilogue_out_slots=1),
    # Staged epilogue chunks synchronized by hand (TuningConfig.manual_barriers): two warpgroup
    # barriers a chunk instead of Pallas's two around every SMEM store and one before every
    # TMA load. Timelines of the SwiGLU backward showed its epilogue stalled on CTA barriers a
    # third of the time (docs/performance.md#kernels).
    "manual": dataclasses.replace(_D, manual_barriers=True),
    "pingpong_manual": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, manual_barriers=True),
    "pingpong_minor_m_manual": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                   grid_minor_dim="m", manual_barriers=True),
    "pingpong_turns_manual": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                 pingpong_turns=True, manual_barriers=True),
    # A quantizing output's transposed copy relaid from its FP8 values (TuningConfig.fp8_byte_transpose),
    # alone and with the barriers by hand (alone it won the FP8 SwiGLU backward).
    "pingpong_bytes": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, fp8_byte_transpose=True),
    "pingpong_minor_m_bytes": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                  grid_minor_dim="m", fp8_byte_transpose=True),
    "pingpong_minor_m_manual_bytes": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                         grid_minor_dim="m", manual_barriers=True,
                                                         fp8_byte_transpose=True),
    # All three epilogue economies (barriers by hand, FP8 byte relayout, row reductions folded
    # across chunks: TuningConfig.fold_row_reductions): the lean epilogue, which won most FP8
    # GEMMs with a quantizing output and every epilogue pass (the heuristics' FP8 choice).
    "lean": dataclasses.replace(_D, **LEAN_EPILOGUE),
    "pingpong_lean": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, **LEAN_EPILOGUE),
    "pingpong_minor_m_lean": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, grid_minor_dim="m",
                                                 **LEAN_EPILOGUE),
    "pingpong_turns_lean": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, pingpong_turns=True,
                                               **LEAN_EPILOGUE),
    # Each consumer's next tile's first tile loads issued during this tile's last chunks
    # (TuningConfig.prefetch_next_tile), not behind the next tile's mainloop: for the epilogue
    # passes (a mainloop of one K step, so the first chunks wait out a whole load latency) and
    # the short-K FP8 GEMMs; with 32-column chunks and three load slots, two chunks in flight.
    "pingpong_minor_m_lean_prefetch": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                          grid_minor_dim="m", prefetch_next_tile=True,
                                                          **LEAN_EPILOGUE),
    "pingpong_minor_m_lean_prefetch_c32": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                              grid_minor_dim="m", prefetch_next_tile=True,
                                                              epilogue_cols=32, epilogue_load_slots=3,
                                                              **LEAN_EPILOGUE),
    "pingpong_minor_m_bytes_prefetch": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                           grid_minor_dim="m", fp8_byte_transpose=True,
                                                           prefetch_next_tile=True),
    # Epilogue passes without the zero GEMM under them (TuningConfig.skip_pass_gemm): a pass's
    # warps wait on TMA loads, and the zero operands' loads share the L2 with the pass's own
    # (docs/performance.md#kernels). The pass configurations that won so far, each without its
    # GEMM (programs that read the accumulator run theirs: the flag leaves them alone).
    "pingpong_lean_no_gemm": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                 skip_pass_gemm=True, **LEAN_EPILOGUE),
    "pingpong_minor_m_lean_no_gemm": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                         grid_minor_dim="m", skip_pass_gemm=True, **LEAN_EPILOGUE),
    "pingpong_turns_lean_no_gemm": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                       pingpong_turns=True, skip_pass_gemm=True, **LEAN_EPILOGUE),
    "pingpong_minor_m_lean_prefetch_c32_no_gemm": dataclasses.replace(
        _D, schedule="pingpong", cluster_dimension=None, grid_minor_dim="m", prefetch_next_tile=True,
        epilogue_cols=32, epilogue_load_slots=3, skip_pass_gemm=True, **LEAN_EPILOGUE),
    # The norm backward's dgamma summed in the kernel by two consumers, each with its own
    # scratch (TuningConfig.consumer_col_sums), and with the economies that apply beside a
    # column sum (byte relayout, folded row reductions).
    "sums": dataclasses.replace(_D, consumer_col_sums=True),
    "pingpong_sums": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, consumer_col_sums=True),
    "pingpong_minor_m_sums": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, grid_minor_dim="m",
                                                 consumer_col_sums=True),
    "pingpong_minor_m_sums_lean": dataclasses.replace(_D, **FP8_COL_SUM_CONFIG),  # the FP8 heuristics' choice
    # The norm backward's dgamma as its summand tile on two consumers, with the three.
    "pingpong_col_tiles_lean": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, col_sum_tiles=True,
                                                   **LEAN_EPILOGUE),
    "pingpong_minor_m_col_tiles_lean": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                           grid_minor_dim="m", col_sum_tiles=True, **LEAN_EPILOGUE),
    # 64 x 128 consumer tiles on the ping-pong kernel (64 accumulator registers a thread,
    # half the default's): for heavy epilogues beside a 128-row accumulator (the FP8 SwiGLU
    # GEMMs', where they lose: B is loaded and multiplied once per 64 rows;
    # docs/performance.md#kernels), and for the epilogue passes, all memory traffic, where
    # half-height tiles keep more loads and stores in flight per SM between the two consumers.
    "pingpong_minor_m_bytes_m64": dataclasses.replace(_D, tile_m=64, schedule="pingpong", cluster_dimension=None,
                                                      grid_minor_dim="m", fp8_byte_transpose=True),
    "pingpong_minor_m_lean_m64": dataclasses.replace(_D, tile_m=64, schedule="pingpong", cluster_dimension=None,
                                                     grid_minor_dim="m", **LEAN_EPILOGUE),
    "pingpong_lean_m64": dataclasses.replace(_D, tile_m=64, schedule="pingpong", cluster_dimension=None,
                                             **LEAN_EPILOGUE),
    # The pair-block epilogues (the SwiGLU GEMMs) in 32-column chunks, past the register budget
    # that narrows them to 16 (TuningConfig.epilogue_regs): half the chunks, so half the TMA
    # stores, barriers and descriptor set-ups a tile (four stores a chunk: two pair halves,
    # each with its transposed copy), against more values live beside the accumulator. With
    # one output slot their staging fits beside 4 FP8 stages (the forward, which loads no
    # tile) or 3 (the backward, which loads z); plan_kernel narrows chunks before it drops
    # stages, so the 3-stage one is named. Offered to every program: the weights' float32
    # passes run faster on them too (docs/performance.md#kernels).
    "pingpong_minor_m_bytes_wide": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                       grid_minor_dim="m", fp8_byte_transpose=True, **WIDE_CHUNKS),
    "pingpong_minor_m_bytes_wide_s3": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                          grid_minor_dim="m", fp8_byte_transpose=True,
                                                          max_concurrent_steps=3, **WIDE_CHUNKS),
    "pingpong_lean_wide_s3": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                 max_concurrent_steps=3, **WIDE_CHUNKS, **LEAN_EPILOGUE),
    "pingpong_lean_wide": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, **WIDE_CHUNKS,
                                              **LEAN_EPILOGUE),
    # ... and for the passes without their zero GEMM (TuningConfig.skip_pass_gemm).
    "pingpong_minor_m_lean_m64_no_gemm": dataclasses.replace(_D, tile_m=64, schedule="pingpong",
                                                             cluster_dimension=None, grid_minor_dim="m",
                                                             skip_pass_gemm=True, **LEAN_EPILOGUE),
    "pingpong_lean_m64_no_gemm": dataclasses.replace(_D, tile_m=64, schedule="pingpong", cluster_dimension=None,
                                                     skip_pass_gemm=True, **LEAN_EPILOGUE),
    "n192": dataclasses.replace(_D, tile_n=192),
    "n192_split_m": dataclasses.replace(_D, tile_n=192, wg_dimension="m"),
    "n192_split_m_no_cluster": dataclasses.replace(_D, tile_n=192, wg_dimension="m", cluster_dimension=None),
    # 64 x 256 consumer tiles (128 accumulator registers, as 128 x 128): the CTA tile of
    # the default split along M (as CUTLASS's cooperative 128 x 256 kernel splits it), and a
    # ping-pong consumer owning a 64 x 256 tile (wgmma N = 256: half the instructions per MMA).
    "split_m_64x256": dataclasses.replace(_D, tile_m=64, tile_n=256, wg_dimension="m"),
    "split_m_64x256_no_cluster": dataclasses.replace(_D, tile_m=64, tile_n=256, wg_dimension="m",
                                                     cluster_dimension=None),
    "pingpong_64x256": dataclasses.replace(_D, tile_m=64, tile_n=256, schedule="pingpong", cluster_dimension=None),
    "pingpong_64x256_turns_deep": dataclasses.replace(_D, tile_m=64, tile_n=256, schedule="pingpong",
                                                      cluster_dimension=None, pingpong_turns=True,
                                                      max_concurrent_steps=6),
}
# For FP8 GEMMs whose accumulator is promoted (Fp8Recipe.promote_k; offered to those calls
# only). plan_kernel halves their consumer tiles to 64 x 128 (two accumulators a thread), so
# a K step holds half the MMAs of an unpromoted one against the same barrier waits and
# releases. Candidates: K steps of twice the bytes (tile_k 128, 256 FP8 elements: half the
# waits, but stages twice as large, so fewer fit); deeper rings of the halved stages (the
# cooperative ring won every promoted GEMM of the 1B and 8B-width steps, docs/fp8.md#accumulation);
# ping-pong consumers, each on its own tile, one running MMAs while the other drains its
# accumulator into the float32 total.
PROMOTED_CANDIDATES: dict[str, TuningConfig] = {
    "k128": dataclasses.replace(_D, tile_k=128),
    "k128_no_cluster": dataclasses.replace(_D, tile_k=128, cluster_dimension=None),
    "ring_deep": dataclasses.replace(_D, delay_release=1, max_concurrent_steps=6),
    "ring_deep_no_cluster": dataclasses.replace(_D, delay_release=1, max_concurrent_steps=6, cluster_dimension=None),
    "pingpong_k128": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, tile_k=128),
    "pingpong_minor_m_k128": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, tile_k=128,
                                                 grid_minor_dim="m"),
    "pingpong_deeper": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None, max_concurrent_steps=8),
    "pingpong_turns_deeper": dataclasses.replace(_D, schedule="pingpong", cluster_dimension=None,
                                                 pingpong_turns=True, max_concurrent_steps=8),
    # The cooperative ring with the norm backward's dgamma summed by each consumer in its own
    # scratch (TuningConfig.consumer_col_sums), where a promoting kernel otherwise writes
    # dgamma as a float32 summand tile ([M, N], summed by XLA); column-sum programs only.
    "ring_deep_sums": dataclasses.replace(_D, delay_release=1, max_concurrent_steps=6, consumer_col_sums=True),
    "ring_deep_no_cluster_sums": dataclasses.replace(_D, delay_release=1, max_concurrent_steps=6,
                                                     cluster_dimension=None, consumer_col_sums=True),
}


def known_candidates() -> dict[str, TuningConfig]:
    """Every candidate by name: :data:`CANDIDATES`, :data:`EXTENDED_CANDIDATES` and
    :data:`PROMOTED_CANDIDATES`."""
    return {**CANDIDATES, **EXTENDED_CANDIDATES, **PROMOTED_CANDIDATES}


# The base name of a candidate that is the call's own heuristic configuration with overrides.
HEURISTIC = "heuristic"


def resolve_candidate(name: str, heuristic: TuningConfig | None = None) -> TuningConfig:
    """The configuration a candidate name stands for: a known candidate
    (:func:`known_candidates`), or ``"heuristic"`` (the call's heuristic configuration,
    ``heuristic``, with the K step of 16-bit operands), followed by ``+field=value`` overrides
    of its :class:`~coda_jax.pallas.tuning.TuningConfig` fields, e.g.
    ``"pingpong_minor_m_bytes_wide_s3+grid_tile_width=16"`` or ``"heuristic+grid_minor_dim=m"``
    (an FP8 call's ``tile_k`` is given in 16-bit elements, as the candidates' own, and doubled
    with theirs). ``ValueError`` naming the candidate for an unknown base name or field, a value
    of the wrong type, or ``"heuristic"`` without an override (the heuristic is timed anyway)."""
    base, *overrides = name.split("+")
    known = known_candidates()
    if base == HEURISTIC:
        if not overrides:
            raise ValueError("candidate 'heuristic' needs +field=value overrides: the heuristic itself is timed "
                             "beside every candidate")
        if heuristic is None:
            raise ValueError(f"candidate {name!r}: the call's heuristic configuration is needed to resolve it")
        cfg = heuristic
    elif base in known:
        cfg = known[base]
    else:
        raise ValueError(f"unknown candidate {base!r}; known: {sorted(known)}, 'heuristic+...', 'extended', "
                         "'promoted', 'all'")
    changes = config_overrides(overrides, f"candidate {name!r}")
    return dataclasses.replace(cfg, **changes) if changes else cfg  # TuningConfig checks the values


def candidate_name_errors(names: list[str], also: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with each of ``names`` that is not a candidate :func:`resolve_candidate`
    takes (nor one of ``also``, a tool's own names), without a call: one message per bad name."""
    errors = []
    for name in names:
        if name in also:
            continue
        try:
            resolve_candidate(name, heuristic=CONFIG_TABLE["default"])  # a stand-in: only the names are checked
        except ValueError as e:
            errors.append(str(e))
    return errors


def neighbour_names(bases: list[str], neighbours: tuple[str, ...]) -> list[str]:
    """Each base candidate name (overrides of its own allowed) with each neighbour's overrides
    (``"field=value[+field=value]"``) added; a neighbour's field replaces the base's own override
    of it: ``neighbour_names(["a+grid_tile_width=16"], ("grid_tile_width=8",))`` ->
    ``["a+grid_tile_width=8"]``."""
    out = []
    for base in bases:
        root, *own = base.split("+")
        for nb in neighbours:
            fields = dict(item.partition("=")[::2] for item in own)
            fields.update(item.partition("=")[::2] for item in nb.split("+"))
            out.append("+".join([root, *(f"{k}={v}" for k, v in fields.items())]))
    return list(dict.fromkeys(out))


def candidate_configs(call: KernelCall, names: list[str] | None = None) -> dict[str, TuningConfig]:
    """The named candidates (default: :data:`CANDIDATES`; ``"extended"``:
    :data:`EXTENDED_CANDIDATES`; ``"promoted"``: :data:`PROMOTED_CANDIDATES`, for promoting
    calls only; ``"all"``: every one; a name with ``+field=value`` overrides, of a known
    candidate or of the call's heuristic configuration: :func:`resolve_candidate`) that can
    run ``call``: those whose tile
    holds the epilogue's pair block and whose K step suits the call's layout, less those whose
    difference does not apply to the program (column-sum settings without a column sum, a
    skipped pass GEMM under a program that reads its accumulator). The heuristic's own
    configuration is timed separately.

    A call on FP8 operands gets each candidate with its K step doubled
    (:func:`~coda_jax.pallas.tuning.for_fp8_operands`: the bytes of a 16-bit K step, as the
    heuristics run FP8), so its table entry holds the configuration as measured; candidates
    whose 16-bit K step is shorter than 64 (FP8 rows under 128 bytes) are left out."""
    epi = call.epilogue
    fp8 = call.a.dtype in FP8_DTYPES
    pw = epi.pair_width if epi.pair_block is not None else None
    known = known_candidates()
    groups = {"extended": list(EXTENDED_CANDIDATES), "promoted": list(PROMOTED_CANDIDATES), "all": list(known)}
    chosen = [x for name in (names or list(CANDIDATES)) for x in groups.get(name, [name])]
    out = {}
    heuristic = None
    if any(x.split("+")[0] == HEURISTIC for x in chosen):
        m, n, k = call.mnk
        heuristic = heuristic_config(epi, m, n, k, gpu_sm_count(), fp8_operands=fp8)
    for name in dict.fromkeys(chosen):
        cfg = resolve_candidate(name, heuristic)
        if name.split("+")[0] in PROMOTED_CANDIDATES and not call.promote_k:
            continue
        if fp8:
            if cfg.tile_k < 64:
                continue
            cfg = for_fp8_operands(cfg)
        if not cfg.k_step_fits(call.transpose_a, call.transpose_b):
            continue  # plan_kernel would refuse it
        if (cfg.col_sum_tiles or cfg.consumer_col_sums) and not any(o.kind is OutputKind.COL_SUM
                                                                    for o in epi.outputs):
            continue  # the same kernel as the candidate without it
        if cfg.skip_pass_gemm and epi.reads_acc:
            continue  # a program that reads its accumulator runs its GEMM: the same kernel again
        if pw is None or cfg.tile_n % pw == 0:
            out[name] = cfg
    return out


def planned_config(call: KernelCall, cfg: TuningConfig, num_sms: int = 132) -> TuningConfig:
    """What runs when ``call`` is given ``cfg``: :func:`~coda_jax.pallas.gemm_epilogue.plan_epilogue`'s
    configuration (pipeline stages, epilogue chunk width and load slots fitted to SMEM, or the
    single-warpgroup fallback), on a GPU of ``num_sms`` SMs (132: the H100). No GPU needed."""
    m, n, k = call.mnk
    shape = kernel_shape(call.epilogue, m, n, k, cfg, call.transpose_a, call.transpose_b, call.a.dtype,
                         dict(call.out_dtypes), num_sms, call.promote_k)
    loads = {k: v[0] if isinstance(v, tuple) else v for k, v in call.loads}  # column parts: one dtype
    load_dtypes = tuple((l.name, kernel_load_dtype(l, loads[l.name].dtype)) for l in call.epilogue.loads)
    return plan_epilogue(call.epilogue, shape, cfg, load_dtypes)[1]


def random_arguments(call: KernelCall, seed: int = 0) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Random operands (A ~ N(0, 1), B ~ N(0, 1/K): outputs of order one) and loads of the
    call's shapes: integer loads (cross-entropy targets) uniform in ``[0, N)``, floating
    ones uniform in ``[0.5, 1.5)`` (row scales, saved tiles)."""
    m, n, k = call.mnk
    key = jax.random.key(seed)
    ka, kb, kl = jax.random.split(key, 3)
    a = jax.random.normal(ka, call.a.shape, jnp.float32).astype(call.a.dtype)
    b = (jax.random.normal(kb, call.b.shape, jnp.float32) * k ** -0.5).astype(call.b.dtype)
    def draw(kk, sds):
        if jnp.issubdtype(sds.dtype, jnp.integer):
            return jax.random.randint(kk, sds.shape, 0, n, sds.dtype)
        return jax.random.uniform(kk, sds.shape, jnp.float32, 0.5, 1.5).astype(sds.dtype)

    loads = {}
    for i, (name, sds) in enumerate(call.loads):
        kk = jax.random.fold_in(kl, i)
        loads[name] = (tuple(draw(jax.random.fold_in(kk, j), p) for j, p in enumerate(sds)) if isinstance(sds, tuple)
                       else draw(kk, sds))
    return a, b, loads


def _runner(call: KernelCall, cfg: TuningConfig | None):
    """``(run, timed)``: ``run(a, b, loads)`` returns the call's outputs with partials
    combined; ``timed`` returns one element of each output, so that repeated calls do not
    keep gigabytes of outputs (a vocab-wide float32 logits tile is 4 GiB) alive."""
    low = PallasLowering(cfg)
    out_dtypes = dict(call.out_dtypes) or None

    def gemm(a, b, loads):
        return low.gemm(call.epilogue, a, b, loads, transpose_a=call.transpose_a, transpose_b=call.transpose_b,
                        out_dtypes=out_dtypes, promote_k=call.promote_k)

    run = jax.jit(lambda a, b, loads: combined(call.epilogue, gemm(a, b, loads)))
    timed = jax.jit(lambda a, b, loads: jax.tree.map(lambda x: x.reshape(-1)[:1], gemm(a, b, loads)))
    return run, timed


def kernel_ms(fn: Callable, *args, iters: int = 20) -> float:
    """Median GPU time of one call (CUPTI: the sum of its kernels' durations, no launch gaps)."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(fn(*args))
    _, times = profiler.measure(fn, iterations=iters)(*args)
    # One iteration gives a float, several a list.
    return statistics.median(times) if isinstance(times, (list, tuple)) else float(times)


def sustained_kernel_ms(fn: Callable, *args, iters: int = 20, heat_s: float = 1.5,
                        log: Callable[[str], None] | None = None) -> float:
    """:func:`kernel_ms` at the clock a training step runs at: ``fn`` is first called back to
    back for ``heat_s`` seconds, so that the GPU reaches its power limit, then timed.

    A training step keeps an H100 at its power cap (700 W on the SXM part), where the SM clock
    falls well below its 1980 MHz maximum; a kernel timed in a short burst after idle runs at
    the full clock. Configurations differ in energy per tile (L2 and SMEM traffic, CTA-pair
    multicast), not only in cycles, so the fastest can differ between the two
    (docs/performance.md#tuned-tables). ``log``: if given, also receives the burst time, the
    sustained time and the SM clock / power read right after (``nvidia-smi``)."""
    burst = kernel_ms(fn, *args, iters=iters) if log else None
    t_end = time.perf_counter() + heat_s
    n = 0
    while time.perf_counter() < t_end:
        out = fn(*args)
        n += 1
        if n % 16 == 0:  # keep the queue short: the heat must be over when the timing starts
            jax.block_until_ready(out)
    ms = kernel_ms(fn, *args, iters=iters)
    if log:
        log(f"HEAT burst {burst:.4f} ms, sustained {ms:.4f} ms ({burst / ms:.3f}x), {_gpu_clock()}")
    return ms


def _gpu_clock() -> str:
    """The SM clock and power of GPU 0 now, from ``nvidia-smi`` (or why not)."""
    import subprocess

    try:
        r = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or r.stderr.strip()[:80]
    except (OSError, subprocess.SubprocessError) as e:
        return f"no nvidia-smi ({type(e).__name__})"


def combined(epi: Epilogue, outs: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The outputs with their per-tile partials combined (row / column sums summed, tile
    log-sum-exps merged): partials have one row per tile, so their shapes depend on the
    configuration's tile, and only the combination is comparable across configurations."""
    res = {}
    for o in epi.outputs:
        v = jnp.asarray(outs[o.name], jnp.float32)
        if o.kind is OutputKind.ROW_LOGSUMEXP:
            v = jax.nn.logsumexp(v, axis=0)
        elif o.kind in (OutputKind.ROW_SUM, OutputKind.COL_SUM):
            v = v.sum(axis=0)
        res[o.name] = v
        if o.quantize is not None:  # a quantizing output's copy, and its amax partials' max
            for extra in o.result_names()[1:]:
                x = jnp.asarray(outs[extra], jnp.float32)
                res[extra] = x.max(axis=0) if extra.endswith("_amax") else x
    return res


def max_relative_error(outs: dict[str, jax.Array], refs: dict[str, jax.Array]) -> float:
    """The largest ``||out - ref|| / ||ref||`` over the outputs (inf on a NaN the reference lacks)."""
    worst = 0.0
    for name, ref in refs.items():
        o, r = jnp.asarray(outs[name], jnp.float32), jnp.asarray(ref, jnp.float32)
        if o.shape != r.shape:
            return float("inf")
        if bool(jnp.any(jnp.isnan(o) & ~jnp.isnan(r))):
            return float("inf")
        ok = jnp.isfinite(r)  # an LSE over padding-only tiles is -inf in both
        err = jnp.linalg.norm(jnp.where(ok, o - r, 0.0)) / jnp.maximum(jnp.linalg.norm(jnp.where(ok, r, 0.0)), 1e-30)
        worst = max(worst, float(err))
    return worst


# Launches of each candidate whose outputs tune_call checks against the heuristic's (on a GPU).
CHECK_LAUNCHES = 3


def tune_call(call: KernelCall, names: list[str] | None = None, iters: int = 20, rtol: float = 2e-3,
              log: Callable[[str], None] = print, timer: Callable[..., float] = kernel_ms) -> dict[str, Any]:
    """Times ``call`` under the heuristic's configuration and each candidate; returns
    ``{"program", "layout", "m", "n", "k", "heuristic_ms", "results": {name: ms or error}}``.
    ``timer(fn, *args, iters=...)``: milliseconds per call (CUPTI kernel time by default)."""
    m, n, k = call.mnk
    a, b, loads = random_arguments(call)
    sig = loads_signature(call.epilogue, dict(call.loads))
    row = {"program": call.epilogue.name, "layout": layout_name(call.transpose_a, call.transpose_b),
           "m": m, "n": n, "k": k, **({"promote_k": call.promote_k} if call.promote_k else {}),
           **({"loads": sig} if sig else {}), "results": {}}
    with tables_disabled():
        run, timed = _runner(call, None)
        refs = jax.block_until_ready(run(a, b, loads))
        row["heuristic_ms"] = timer(timed, a, b, loads, iters=iters)
    # On a GPU each candidate's outputs are checked on several launches: a race between warps
    # (a staging slot rewritten before its store has read it) need not show on the first.
    repeats = CHECK_LAUNCHES if jax.default_backend() == "gpu" else 1
    for name, cfg in candidate_configs(call, names).items():
        try:
            run, timed = _runner(call, cfg)
            err = max(max_relative_error(run(a, b, loads), refs) for _ in range(repeats))
            if err > rtol:
                row["results"][name] = {"error": f"outputs differ from the heuristic's: relative error {err:.2e}"}
            else:
                row["results"][name] = {"ms": timer(timed, a, b, loads, iters=iters), "config": config_fields(cfg)}
        except Exception as e:  # noqa: BLE001  (SMEM overflow, a lowering failure: record and go on)
            row["results"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        r = row["results"][name]
        log(f"TUNE {row['program']:18s} {row['layout']} {m}x{n}x{k}{key_suffix(row)} {name:18s} "
            + (f"{r['ms']:.4f} ms (heuristic {row['heuristic_ms']:.4f})" if "ms" in r else r["error"][:120]))
    return row


def best_entry(row: dict[str, Any], min_gain: float = 0.02) -> dict[str, Any]:
    """The table entry of a tuned call: the fastest candidate if it beats the heuristic's time
    by more than ``min_gain`` (a fraction); else an entry with ``"config": null`` (the
    heuristic stays for this GEMM, and no neighbouring entry is borrowed for it)."""
    entry = {"program": row["program"], "layout": row["layout"], "m": row["m"], "n": row["n"], "k": row["k"],
             **({"promote_k": row["promote_k"]} if row.get("promote_k") else {}),
             **({"loads": row["loads"]} if row.get("loads") else {}),
             "config": None, "candidate": "heuristic", "ms": round(row["heuristic_ms"], 5),
             "heuristic_ms": round(row["heuristic_ms"], 5)}
    timed = {k: v for k, v in row["results"].items() if "ms" in v}
    if timed:
        name = min(timed, key=lambda k: timed[k]["ms"])
        if timed[name]["ms"] <= row["heuristic_ms"] * (1 - min_gain):
            entry.update(config=timed[name]["config"], candidate=name, ms=round(timed[name]["ms"], 5))
    return entry


def table_from_rows(rows: list[dict[str, Any]], device_kind: str, num_sms: int,
                    min_gain: float = 0.02) -> dict[str, Any]:
    """A tuned table from measurement rows (:func:`tune_call`'s) taken on one GPU kind."""
    return {"device_kinds": [device_kind], "num_sms": num_sms, "jax": jax.__version__,
            "entries": [best_entry(r, min_gain) for r in rows]}


def kernel_calls(fn: Callable, *args) -> list[KernelCall]:
    """The distinct Pallas kernel calls ``fn(*args)`` makes (traced abstractly, tables off)."""
    with tables_disabled(), record_kernel_calls() as calls:
        jax.eval_shape(fn, *args)
    return calls


def key_suffix(row: dict[str, Any]) -> str:
    """What besides program, layout and shape keys a measurement row or table entry, for logs:
    ``" promote_k=512 loads=x:bfloat16"`` (each part only where set)."""
    return ((f" promote_k={row['promote_k']}" if row.get("promote_k") else "")
            + (f" loads={row['loads']}" if row.get("loads") else ""))


def row_key(row: dict[str, Any]) -> tuple:
    """(program, layout, m, n, k, promote_k, loads) of a measurement row or table entry
    (``promote_k`` absent: 0, an unpromoted GEMM; ``loads`` absent or empty: None, no tile loads'
    signature): GEMMs whose tile loads differ in dtype are different entries."""
    return (row["program"], row["layout"], row["m"], row["n"], row["k"], row.get("promote_k", 0),
            row.get("loads") or None)


def call_key(call: KernelCall) -> tuple:
    """The :func:`row_key` of a kernel call's GEMM (its loads' signature:
    :func:`~coda_jax.pallas.tuned.loads_signature`, as the lookup computes it)."""
    sig = loads_signature(call.epilogue, dict(call.loads))
    return call.epilogue.name, layout_name(call.transpose_a, call.transpose_b), *call.mnk, call.promote_k, sig or None


def unsigned_key(key: tuple) -> tuple:
    """``key`` (:func:`row_key`) without its loads' signature: the key of an entry written without
    one (tables from before signatures), which serves the GEMM as well."""
    return (*key[:-1], None)


def table_keys(table: dict[str, Any] | None) -> frozenset[tuple]:
    """The :func:`row_key` of every entry of a table (a heuristic-kept one too)."""
    return frozenset(row_key(e) for e in (table or {}).get("entries", []))


def incumbents(table: dict[str, Any] | None) -> dict[tuple, str]:
    """{:func:`row_key`: candidate name} of a table's entries won by a candidate
    (not the heuristic): pass it to :func:`autotune` so that a sweep of other candidates
    measures each GEMM's current winner beside them, in the same process."""
    return {row_key(e): e["candidate"] for e in (table or {}).get("entries", [])
            if not candidate_name_errors([str(e.get("candidate"))])}


def autotune(fn: Callable, *args, names: list[str] | None = None, iters: int = 20, rtol: float = 2e-3,
             min_gain: float = 0.02, budget_s: float | None = None, rows: list | None = None,
             log: Callable[[str], None] = print, timer: Callable[..., float] = kernel_ms,
             incumbent: dict[tuple, str] | None = None, skip_programs: tuple[str, ...] = (),
             only_programs: tuple[str, ...] = (), skip_keys: frozenset[tuple] = frozenset(),
             neighbours: tuple[str, ...] = ()) -> dict[str, Any]:
    """A tuned table (the JSON object of :mod:`coda_jax.pallas.tuned`) for ``fn(*args)``'s
    kernel calls on the current GPU. ``budget_s``: stop starting new calls after that many
    seconds (the table then holds the calls tuned so far). ``rows``: a list that receives
    every call's measurements; a call it already holds (an earlier run's rows) with every
    wanted candidate is not measured again, and its winner enters the table.
    ``incumbent``: {GEMM key: candidate} (:func:`incumbents` of the table in use), each
    measured beside ``names`` for its GEMM, so that the table entry written is the best of
    both. ``skip_programs``: epilogue names whose calls are left out (and out of the table);
    ``only_programs``: if given, only calls of these epilogues are tuned. ``skip_keys``: GEMM keys
    (:func:`row_key`) not to tune (:func:`table_keys` of the table in use: tune only the calls it
    has no entry for, where device time is short). An entry without a loads' signature counts for
    every call of its GEMM in both (:func:`unsigned_key`). ``neighbours``: overrides
    (``"field=value[+field=value]"``) each call also tries on its incumbent and on its own
    heuristic configuration (:func:`neighbour_names`); with them and no ``names``, only those
    (and the incumbents) are timed."""
    bad = candidate_name_errors([f"{HEURISTIC}+{nb}" for nb in neighbours])
    if bad:
        raise ValueError("neighbours: " + "; ".join(bad))
    dev = jax.local_devices()[0]
    if dev.platform != "gpu":
        raise RuntimeError(f"autotune times kernels on a GPU; the default device is {dev.platform!r}")
    all_calls = kernel_calls(fn, *args)
    unknown = set(only_programs) - {c.epilogue.name for c in all_calls}
    if unknown:
        raise ValueError(f"only_programs: {sorted(unknown)} make no kernel call here; the calls' programs are "
                         f"{sorted({c.epilogue.name for c in all_calls})}")
    calls = [c for c in all_calls if c.epilogue.name not in skip_programs
             and (not only_programs or c.epilogue.name in only_programs)
             and not {call_key(c), unsigned_key(call_key(c))} & skip_keys]
    incumbent = incumbent or {}
    rows = [] if rows is None else rows
    done = {row_key(r): r for r in rows}
    log(f"TUNE {len(calls)} distinct kernel calls")
    t0, tuned, left = time.perf_counter(), [], len(calls)
    for call in calls:
        key = call_key(call)
        row = done.get(key)
        held = incumbent.get(key) or incumbent.get(unsigned_key(key))
        extra = [held] if held else []
        extra += neighbour_names(extra + [HEURISTIC], neighbours)
        base_names = list(names) if names else ([] if neighbours else list(CANDIDATES))
        wanted = list(candidate_configs(call, base_names + extra))
        if row is None or set(wanted) - set(row["results"]):
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                log(f"TUNE budget of {budget_s:.0f} s spent; {left} calls left untuned")
                break
            # A call measured before without some of the wanted candidates is measured again
            # in full, with its old candidates too: times from another process (or machine)
            # are not compared with this one's.
            old = [n for n in (row or {"results": {}})["results"] if n not in wanted]
            new_row = tune_call(call, wanted + old, iters, rtol, log, timer)
            if row is not None:
                rows.remove(row)
            rows.append(new_row)
            row = new_row
        left -= 1
        tuned.append(row)
    return table_from_rows(tuned, dev.device_kind, gpu_sm_count(), min_gain)


def merge_tables(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with ``old``'s entries for GEMMs ``new`` did not measure (same GPU kind and SM
    count; otherwise ``new`` alone). GEMMs are told apart by :func:`row_key`: an old entry with
    other tile-load dtypes is kept beside ``new``'s. An old entry without a signature (a table
    from before signatures) gives way to a new one of the same GEMM with a signature: it was
    measured with one of the GEMM's load dtypes, not known which, so it says nothing the new
    entry does not."""
    if not old or old.get("num_sms") != new["num_sms"] or not set(old["device_kinds"]) & set(new["device_kinds"]):
        return new
    mine = {row_key(e) for e in new["entries"]}
    mine |= {unsigned_key(key) for key in mine}
    kept = [e for e in old["entries"] if row_key(e) not in mine]
    kinds = list(dict.fromkeys(old["device_kinds"] + new["device_kinds"]))
    return {**new, "device_kinds": kinds, "entries": kept + new["entries"]}


def write_table(table: dict[str, Any], path: str | Path, merge: bool = True) -> None:
    """Writes ``table`` (validated) to ``path``, merged with the table already there."""
    path = Path(path)
    old = json.loads(path.read_text()) if merge and path.exists() else None
    out = merge_tables(old, table)
    parse_table(out, str(path))  # a table this module wrote must load
    path.write_text(json.dumps(out, indent=1) + "\n")
