"""The Pallas Mosaic-GPU Hopper GEMM with a lowered epilogue program.

Mainloop: persistent CTAs (one per SM) walk the output tiles in planar-snake order. The
default (warp-specialized) kernel has a producer warpgroup streaming operand blocks into
swizzled SMEM with TMA, ``max_concurrent_steps`` deep, and two consumer warpgroups, each
``wgmma``-ing one ``[tile_m, tile_n]`` half of the CTA tile (split along N by default:
``[128, 256]``) into a float32 register accumulator and running its epilogue; the
epilogue's tile loads are issued before the MMAs so they land during the mainloop. By
default CTAs run in clusters of two along M that share each B block through one multicast
TMA load (``TuningConfig.cluster_dimension``). Both consumers run their epilogues at the same
time, while the tensor cores wait. The ping-pong kernel (``TuningConfig.schedule="pingpong"``,
:func:`_ring_body`) instead gives each consumer whole ``[tile_m, tile_n]`` tiles in turn,
so one consumer's epilogue runs beside the other's MMAs. :func:`coda_jax.pallas.tuning.choose_config`
picks it for the programs where it measured faster. The same hand-written stage ring also runs
the cooperative schedule with one K step's MMAs in flight (``TuningConfig.delay_release=1``,
opt-in: it sped up plain GEMMs and slowed fused ones, docs/performance.md#kernels). The
single-warpgroup kernel (``plgpu.emit_pipeline``) serves what does not fit beside it.
:func:`plan_kernel` picks the kernel, pipeline depth and epilogue chunk width that fit in
SMEM. Transposed operands (``[K, M]`` A for wgrad, ``[N, K]`` B for dgrad and the LM head)
are read as transposed SMEM views; no copy.

Epilogue: the accumulator tile is cut into *chunks* (``epilogue_cols`` columns, or one ``2*b`` pair block
in pair mode) and the epilogue body (the same function the reference backend runs) is
called on each chunk with its loads already broadcast to the chunk's shape:

* row vectors load from GMEM in the ``WGMMA.reduce(1)`` layout, column vectors in
  ``WGMMA.reduce(0)``, tiles through TMA into SMEM;
* tile outputs go to SMEM and back to GMEM with TMA, one store per chunk;
* row sums accumulate across chunks in registers and are stored as one ``[tile_m]`` row
  of the ``[n_tiles, M]`` partials; column sums as ``[tile_n]`` rows of ``[m_tiles, N]``;
* the row log-sum-exp keeps an online (max, sum-exp) across chunks and stores the tile's
  LSE; logits never reach memory.

FP8: the operands may be ``float8_e4m3fn`` / ``float8_e5m2`` (mixed too), both K-major (A
``[M, K]``, B stored ``[N, K]``: Hopper's 8-bit wgmma has no transposed operands). A 1-byte
element changes only the swizzle arithmetic (:func:`_transforms`: a 128-byte swizzled row is
128 elements, the K of one wgmma group), so the mainloops are the 16-bit ones. Scalar loads
(a dequantized GEMM's ``acc_scale``, a quantizing output's scale) are read once per tile from
GMEM. A quantizing output (:class:`coda_jax.epilogue.Quantize`) is written as
``saturate(v * scale)`` in its FP8 dtype like any tile output; its transposed copy goes out
through a ``[w, tile_m]`` staging slot written through a transposed view (or straight to
GMEM with ``direct_stores``), and its amax is a per-row max over the tile's columns, written
as ``[N / tile_n, M]`` partials like a row sum's.

The wrapper (:mod:`coda_jax.pallas.lowering`) pads M, N and K to tile multiples; padded
columns and rows are masked out of reductions, amaxes and LSEs here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith

from coda_jax.epilogue import Epilogue, LoadKind, Output, OutputKind, body_uses_row_sum
from coda_jax.pallas.tuning import TuningConfig

_WG = plgpu.Layout.WGMMA
# WGMMA's register tile with its 2 x 2 blocks transposed: a thread's two-element vectors run
# down a column, so they are contiguous in a transposed view (a quantizing output's copy).
_WG_T = plgpu.Layout.WGMMA_TRANSPOSED
_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)
# The most negative finite float32: the online log-sum-exp's shift where a row's max is -inf.
_FINITE_FLOOR = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """Static problem description of one kernel instance (padded sizes + real sizes)."""

    m: int
    n: int
    k: int
    m_real: int
    n_real: int
    transpose_a: bool
    transpose_b: bool
    # A's dtype. B's is the same, or with FP8 operands possibly the other FP8 type: the same
    # 1-byte element, so the same SMEM transforms and stage sizes (the kernel reads B's dtype
    # from its operand where it allocates B's stages).
    operand_dtype: Any
    out_dtypes: tuple[tuple[str, Any], ...]
    num_sms: int  # the grid's CTAs: the SMs of the persistent grid, or one (pair) per N tiles (tile_grid)
    # Tile outputs written as several arrays, their columns in order: ((name, widths), ...).
    # Every part boundary is a multiple of the chunk width (split_outputs_fit) and N is unpadded.
    out_splits: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Tile loads read from several arrays, their columns in order: ((name, widths), ...), under
    # the same rule as out_splits (split_loads_fit).
    load_splits: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # FP8 accumulation: every ``promote_k`` K elements the tensor core's accumulator is added
    # into a float32 register total and restarted (0: the whole K in the tensor core). See
    # :func:`_promoted_groups`.
    promote_k: int = 0

    def promote_steps(self, tile_k: int) -> int:
        """K steps between promotions under ``tile_k`` (0: none)."""
        return max(1, self.promote_k // tile_k) if self.promote_k else 0


def _transforms(minor_elems: int, dtype) -> tuple:
    """SMEM tiling + swizzle of a block whose minor dimension holds ``minor_elems`` elements
    of ``dtype``: the widest swizzle (at most 128 bytes) the row's bytes allow, tiles of 8 rows
    of one swizzle width. 16-bit: 64 elements a 128-byte row; FP8: 128 (what wgmma's 8-bit
    path needs: tiling ``(8, swizzle)``, a K group of ``swizzle`` elements)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _chunk_width(epi: Epilogue, tile_n: int, cols: int) -> int:
    """Columns of one epilogue chunk (in pair mode: of its slice of each pair half)."""
    b = epi.pair_block
    if b is None:
        return min(cols, tile_n)
    return b if body_uses_row_sum(epi) else min(cols, b)


def _chunks(epi: Epilogue, tile_n: int, cols: int = 64) -> list[tuple[int, int]]:
    """(first column, width) of each epilogue chunk of a tile, ``cols`` wide.

    Pair mode: a chunk is a ``w``-column slice of the lo half of a pair block (the hi slice
    sits ``b`` columns to its right; with ``half_acc`` the block is ``b`` accumulator
    columns), ``w = min(cols, b)``, or the whole half when the body calls ``ctx.row_sum``
    (a sum over the whole half)."""
    b, w = epi.pair_block, _chunk_width(epi, tile_n, cols)
    if b is None:
        return [(c, w) for c in range(0, tile_n, w)]
    return [(c + s, w) for c in range(0, tile_n, epi.pair_width) for s in range(0, b, w)]


def live_values(epi: Epilogue, tile_n: int, cols: int) -> int:
    """float32 values per thread of a 128-thread consumer warpgroup that one epilogue chunk
    of a 128-row tile holds at once: its accumulator slice, tile loads and tile outputs,
    ``128 x w`` each (two parts each in pair mode unless half-width). They must fit in the
    register file beside the accumulator, or the epilogue spills. (A 64-row tile holds half
    as many; the budget then errs on the narrow side, which is what ran on the GPU.)"""
    staged = [x for x in epi.loads + epi.outputs
              if x.kind in (LoadKind.TILE, LoadKind.ROW_BLOCK, OutputKind.TILE)]
    parts = (2 if epi.paired_acc else 1) + sum(2 if epi.paired(x) else 1 for x in staged)
    return parts * _chunk_width(epi, tile_n, cols)


class _TileContext:
    """EpilogueContext of one register chunk."""

    def __init__(self, col0, shape):
        self._col0 = col0
        self._shape = shape

    def row_sum(self, x):
        return lax.broadcast_in_dim(x.sum(axis=1), x.shape, [0])

    def col_index(self):
        return plgpu.broadcasted_iota(jnp.int32, self._shape, 1, layout=_WG) + self._col0


def split_outputs_fit(epi: Epilogue, shape: KernelShape, cfg: TuningConfig,
                      splits: dict[str, tuple[int, ...]]) -> bool:
    """Whether the kernel can write the tile outputs in ``splits`` as separate arrays: N
    unpadded, and every part boundary a multiple of the chunk width (a chunk's stores,
    ``chunk width`` columns each, then never straddle two parts)."""
    w = _chunk_width(epi, cfg.tile_n, cfg.epilogue_cols)
    return shape.n == shape.n_real and all(
        sum(widths[:i]) % w == 0 for widths in splits.values() for i in range(1, len(widths)))


def split_loads_fit(epi: Epilogue, shape: KernelShape, cfg: TuningConfig,
                    splits: dict[str, tuple[int, ...]]) -> bool:
    """Whether the kernel can read the tile loads in ``splits`` from their column parts: as
    :func:`split_outputs_fit` (a chunk's load then lies inside one part), with the loads
    staged by TMA (``direct_loads`` reads them whole)."""
    return not cfg.direct_loads and split_outputs_fit(epi, shape, cfg, splits)


def out_types(epi: Epilogue, shape: KernelShape, cfg: TuningConfig) -> list[jax.ShapeDtypeStruct]:
    """The kernel's outputs in ``epi.outputs`` order; a split tile output is one array per part.
    A quantizing output is followed by its transposed copy ``[W, M]`` (``W`` its width) and
    its amax partials ``[N / tile_n, M]`` float32 (a row max per consumer tile), where its
    :class:`~coda_jax.epilogue.Quantize` asks for them (:meth:`~coda_jax.epilogue.Output.result_names`
    order)."""
    dt = dict(shape.out_dtypes)
    splits = dict(shape.out_splits)
    res = []
    for o in epi.outputs:
        if o.kind is OutputKind.TILE and o.name in splits:
            res.extend(jax.ShapeDtypeStruct((shape.m, w), dt[o.name]) for w in splits[o.name])
        elif o.kind is OutputKind.TILE:
            res.append(jax.ShapeDtypeStruct((shape.m, epi.width(shape.n, o.half)), dt[o.name]))
        elif o.kind is OutputKind.COL_SUM:
            res.append(jax.ShapeDtypeStruct((shape.m // cfg.tile_m, shape.n), jnp.float32))
        else:  # ROW_SUM, ROW_LOGSUMEXP
            res.append(jax.ShapeDtypeStruct((shape.n // cfg.tile_n, shape.m), jnp.float32))
        if o.quantize is not None and o.quantize.transpose:
            res.append(jax.ShapeDtypeStruct((epi.width(shape.n, o.half), shape.m), dt[o.name]))
        if o.quantize is not None and o.quantize.amax:
            res.append(jax.ShapeDtypeStruct((shape.n // cfg.tile_n, shape.m), jnp.float32))
    return res


class _EpilogueEmitter:
    """Lowers one Epilogue onto accumulator tiles, streaming chunk by chunk.

    Per chunk: tile loads arrive by TMA into a ring of ``S = cfg.epilogue_load_slots``
    SMEM slots, issued ``L`` chunks ahead (the first ``L + 1`` chunks' loads before the
    mainloop), the body runs in registers, tile outputs go to SMEM and out by TMA.

    A tile output with the shape and dtype of a tile load is staged *in place*, in the slot
    its chunk's load arrived in: each thread overwrites exactly the elements it read (the
    same WGMMA register layout), so no barrier is needed between the read and the write,
    and the ring holds loads and outputs in the SMEM of the loads alone. A slot is then
    refilled only after the store that read it; ``L = S - 2`` keeps the last chunk's store
    in flight while the next load is issued (``L = S - 1`` without in-place outputs). Other
    tile outputs (all of them, with 2 load slots) use two slots of their own
    (``TuningConfig.epilogue_out_slots``; one slot: wider chunks fit, and each chunk waits
    for the previous chunk's store to read it); ``wait_smem_to_gmem`` before a slot is
    reused keeps only the previous chunk's stores in flight. With 2 load slots and no
    in-place outputs this is the double-buffered epilogue that ran before load rings existed.
    """

    def __init__(self, epi: Epilogue, shape: KernelShape, cfg: TuningConfig,
                 load_dtypes: dict[str, Any] | None = None, profiled: frozenset[str] = frozenset(),
                 compiled: bool = False):
        self.epi, self.shape, self.cfg = epi, shape, cfg
        self.profiled = profiled
        # ``compiled`` (not interpreted): Mosaic GPU's float32 -> FP8 cast saturates by itself
        # (cvt.rn.satfinite: beyond the finite range to +-max, NaN to NaN), so a quantizing
        # output skips its clip, where the interpreter's (XLA's convert) does not saturate; and
        # the Mosaic GPU code of the options below runs (the interpreter takes the plain path).
        self.compiled = compiled
        # TuningConfig.fp8_byte_transpose.
        self.byte_transpose = cfg.fp8_byte_transpose and compiled
        # Tile loads / tile outputs straight between GMEM and registers (TuningConfig.direct_loads,
        # direct_stores), not staged in SMEM.
        self.direct_loads, self.direct_stores = cfg.direct_loads, cfg.direct_stores
        self.tm, self.tn = cfg.tile_m, cfg.tile_n
        self.b = epi.pair_block
        self.chunks = _chunks(epi, self.tn, cfg.epilogue_cols)
        self.dt = dict(shape.out_dtypes)
        self.splits = dict(shape.out_splits)
        self.load_splits = dict(shape.load_splits)
        if self.load_splits and self.direct_loads:
            raise ValueError("tile loads in column parts need staged loads (direct_loads=False): split_loads_fit")
        # Loads that arrive by TMA into SMEM, chunk by chunk (row_block: always columns [0, b)).
        self.tile_loads = [l for l in epi.loads if l.kind in (LoadKind.TILE, LoadKind.ROW_BLOCK)]
        self.tile_outs = [o for o in epi.outputs if o.kind is OutputKind.TILE]
        self.row_outs = [o for o in epi.outputs if o.kind in (OutputKind.ROW_SUM, OutputKind.ROW_LOGSUMEXP)]
        self.col_outs = [o for o in epi.outputs if o.kind is OutputKind.COL_SUM]
        # Scalars (an FP8 GEMM's acc_scale, a quantizing output's scale): read once per tile.
        self.scalar_loads = [l for l in epi.loads if l.kind is LoadKind.SCALAR]
        # Quantizing tile outputs (FP8) with a transposed copy / an amax (Quantize).
        self.t_outs = [o for o in self.tile_outs if o.quantize is not None and o.quantize.transpose]
        self.amax_outs = [o for o in self.tile_outs if o.quantize is not None and o.quantize.amax]
        # TMA stores issued per chunk (tile-output parts and transposed copies unless direct,
        # column-sum parts).
        self.col_stores_per_chunk = sum(self._nparts(False) for _ in self.col_outs)
        self.stores_per_chunk = ((0 if self.direct_stores else sum(self._nparts(o.half) for o in self.tile_outs)
                                  + sum(self._nparts(o.half) for o in self.t_outs))
                                 + self.col_stores_per_chunk)
        # TMA stores issued at the end of a tile: row partials, amax partials.
        self.row_stores = len(self.row_outs) + len(self.amax_outs)
        # Staging slots of each tile output (TuningConfig.epilogue_out_slots). With one, a chunk
        # waits until the previous chunk's tile-output stores have read the slot; its column-sum
        # stores (issued after them, in slots of their own) may still run.
        self.out_slots = cfg.epilogue_out_slots
        # Each chunk waits for its staging slot and commits SMEM before its TMA stores; with
        # direct stores only column sums (if any) are staged.
        self.chunk_staging = bool(self.stores_per_chunk) or not self.direct_stores
        self.slots = cfg.epilogue_load_slots if self.tile_loads else 2
        # In place needs 3+ slots: with 2 it would leave no load in flight ahead of a chunk.
        in_place_ok = self.slots >= 3 and not (self.direct_loads or self.direct_stores)
        self.in_place = self._in_place(dict(shape.out_dtypes), load_dtypes or {}) if in_place_ok else {}
        self.lookahead = self.slots - (2 if self.in_place else 1)
        # TuningConfig.manual_barriers: the kernel runs without Pallas's automatic barriers and
        # each staged chunk has two (its store wait's and commit_smem's). A chunk's loads refill
        # the slot of the chunk before, which every thread read before that chunk's commit.
        self.manual_barriers = (cfg.manual_barriers and cfg.warp_specialized and not self.direct_stores
                                and not self.in_place and not self.col_outs and self.chunk_staging)
        # TuningConfig.fold_row_reductions: [tm, 8] partials across chunks (chunks of whole
        # 8-column WGMMA groups), reduced across columns once per tile.
        self.fold_rows = cfg.fold_row_reductions and self._width() % _FOLD == 0
        # TuningConfig.consumer_col_sums: column sums reduced with this consumer's own scratch
        # (the interpreter's sums share nothing).
        self.consumer_col_sums = bool(cfg.consumer_col_sums and cfg.warp_specialized and compiled and self.col_outs)
        # TuningConfig.prefetch_next_tile: the next tile's first ``lookahead`` chunks' loads are
        # issued during this tile's last ``lookahead`` chunks (the ring kernels pass the next
        # tile to emit); the next tile's prefetch then issues only chunk ``lookahead``.
        ring = cfg.pingpong or (cfg.warp_specialized and cfg.delay_release == 1)
        self.cross_tile = bool(cfg.prefetch_next_tile and ring and self.tile_loads and not self.direct_loads
                               and not self.in_place and len(self.chunks) > self.lookahead)

    def scope(self, name: str):
        """A profiler range named ``name`` (:class:`ProfileSettings`) if it is profiled,
        else nothing."""
        return jax.named_scope(name) if name in self.profiled else contextlib.nullcontext()

    def _in_place(self, out_dt, load_dt) -> dict[str, str]:
        """{tile output: the tile load whose SMEM slot stages it} (same parts and dtype)."""
        res, free = {}, [l for l in self.tile_loads if l.kind is LoadKind.TILE]
        for o in self.tile_outs:
            for l in free:
                if self._nparts(l.half) == self._nparts(o.half) and load_dt.get(l.name) == out_dt[o.name]:
                    res[o.name] = l.name
                    free.remove(l)
                    break
        return res

    def _out_buf(self, name: str, slot, out_slot):
        """SMEM staging (buffer, slot) of tile output ``name`` for the current chunk."""
        if name in self.in_place:
            return "in_" + self.in_place[name], slot
        return "out_" + name, out_slot

    def _to_part(self, name: str, out_refs, gc, write) -> None:
        """``write(ref, column)`` for the chunk piece at GMEM column ``gc`` of tile output
        ``name``: into its one array, or into the part of a split output that holds the
        column (a piece lies inside one part: :func:`split_outputs_fit`), at the column
        relative to that part. A traced ``gc`` picks the part at run time: one branch per
        part, exactly one taken, so the count of TMA stores in flight is unchanged."""
        widths = self.splits.get(name)
        if widths is None:
            write(out_refs[name], gc)
        else:
            self._at_part(widths, out_refs[name], gc, write)

    def _at_part(self, widths: tuple[int, ...], refs, gc, fn) -> None:
        """``fn(ref, column)`` on the part of ``refs`` (column parts of ``widths``) that holds
        GMEM column ``gc``, at the column relative to it: chosen now for a static ``gc``, else
        at run time, one branch per part with exactly one taken."""
        start = 0
        for ref, w in zip(refs, widths):
            if isinstance(gc, int):
                if start <= gc < start + w:
                    fn(ref, gc - start)
            else:
                @pl.when((gc >= start) & (gc < start + w))
                def _(ref=ref, start=start):
                    fn(ref, pl.multiple_of(gc - start, self._width()))
            start += w

    def _nparts(self, half: bool) -> int:
        return 2 if (self.b is not None and not half) else 1

    def _load_nparts(self, l) -> int:
        return 1 if l.kind is LoadKind.ROW_BLOCK else self._nparts(l.half)

    def _load_parts(self, l, c0: int, n0):
        if l.kind is LoadKind.ROW_BLOCK:  # [M, b]: the chunk's offset inside its pair half
            return [(c0 % (2 * self.b), self._width())]
        return self.parts(c0, n0, l.half)

    def _width(self) -> int:
        return self.chunks[0][1]

    def parts(self, c0: int, n0, half: bool):
        """GMEM (first column, width) of a chunk's pieces in a full or half-width array."""
        b, w = self.b, self._width()
        if b is None:
            return [(n0 + c0, w)]
        aligned = lambda x: x if isinstance(x, int) else pl.multiple_of(x, w)  # noqa: E731
        if self.epi.half_acc:  # accumulator column g's pair: (g // b) * 2b + g % b and + b
            if half:
                return [(n0 + c0, w)]
            s = c0 % b
            start = aligned(2 * (n0 + c0 - s) + s)
            return [(start, w), (start + b, w)]
        s = c0 % (2 * b)
        if half:  # one column per pair: pair block (n0 + c0 - s) / 2b maps to [(n0 + c0 - s)/2, +b)
            return [(aligned((n0 + c0 - s) // 2 + s), w)]
        return [(n0 + c0, w), (n0 + c0 + b, w)]

    def scratch_types(self, loads_dtypes: dict[str, Any], copies: int | None = None) -> dict[str, Any]:
        """SMEM scratch of the epilogue (with a leading ``copies`` axis, one per consumer)."""
        lead = () if copies is None else (copies,)
        w, tm = self._width(), self.tm
        s = {}
        # Swizzled staging needs rows of 32 bytes or more (an FP8 chunk of 16 columns stays row-major).
        tf = ((lambda dt: _transforms(w, dt) if w * jnp.dtype(dt).itemsize >= 32 else ())
              if self.cfg.swizzle_epilogue else (lambda dt: ()))
        for l in self.tile_loads if not self.direct_loads else ():
            s["in_" + l.name] = plgpu.SMEM(lead + (self.slots, self._load_nparts(l), tm, w), loads_dtypes[l.name],
                                           transforms=tf(loads_dtypes[l.name]))
        for o in self.tile_outs if not self.direct_stores else ():
            if o.name not in self.in_place:
                s["out_" + o.name] = plgpu.SMEM(lead + (self.out_slots, self._nparts(o.half), tm, w), self.dt[o.name],
                                                transforms=tf(self.dt[o.name]))
        for o in self.row_outs:
            s["row_" + o.name] = plgpu.SMEM(lead + (2, tm), jnp.float32)
        for o in self.col_outs:
            s["col_" + o.name] = plgpu.SMEM(lead + (2, self._nparts(False), w), jnp.float32)
        # A transposed copy's chunk is staged [w, tm] (the GMEM layout of its [N, M] array),
        # written through a transposed view: unswizzled, or with swizzle_epilogue swizzled over
        # its rows of tm bytes (the transposed view's stores then spread over the SMEM banks).
        for o in self.t_outs if not self.direct_stores else ():
            s["outT_" + o.name] = plgpu.SMEM(lead + (self.out_slots, self._nparts(o.half), w, tm), self.dt[o.name],
                                             transforms=_transforms(tm, self.dt[o.name]) if self.cfg.swizzle_epilogue else ())
        for o in self.amax_outs:
            s["amax_" + o.name] = plgpu.SMEM(lead + (2, tm), jnp.float32)
        if self.consumer_col_sums:
            s["colsum_scratch"] = plgpu.SMEM(lead + (COL_SUM_SCRATCH // 4,), jnp.float32)
        if self.n_barriers:
            s["barrier"] = plgpu.Barrier(num_barriers=self.n_barriers * (copies or 1))
        return s

    @property
    def n_barriers(self) -> int:
        """Load barriers of one consumer: one per slot and load part (none for direct loads)."""
        return 0 if self.direct_loads else self.slots * len(self._load_parts_list())

    def scratch_bytes(self, loads_dtypes: dict[str, Any]) -> int:
        w, tm = self._width(), self.tm
        staged_loads = () if self.direct_loads else self.tile_loads
        staged_outs = () if self.direct_stores else [o for o in self.tile_outs if o.name not in self.in_place]
        total = sum(self.slots * self._load_nparts(l) * tm * w * jnp.dtype(loads_dtypes[l.name]).itemsize
                    for l in staged_loads)
        total += sum(self.out_slots * self._nparts(o.half) * tm * w * jnp.dtype(self.dt[o.name]).itemsize
                     for o in staged_outs)
        total += len(self.row_outs) * 2 * tm * 4 + len(self.col_outs) * 2 * 2 * w * 4
        if not self.direct_stores:
            total += sum(self.out_slots * self._nparts(o.half) * w * tm * jnp.dtype(self.dt[o.name]).itemsize
                         for o in self.t_outs)
        total += len(self.amax_outs) * 2 * tm * 4
        total += COL_SUM_SCRATCH if self.consumer_col_sums else 0
        return total

    def _n_prefetched(self) -> int:
        """Chunks whose tile loads are issued before the first chunk is computed."""
        return min(self.lookahead + 1, len(self.chunks))

    def _wait_slot_free(self):
        """Before a load refills a slot: a slot that staged an in-place output has been read
        by that store (only the last chunk's stores may still be in flight). Without Pallas's
        automatic barriers (direct stores) and with no per-chunk ``commit_smem`` (no staged
        chunk), a warpgroup barrier first, so that every thread has read the slot's last
        chunk (manual barriers rely on the chunk's commit, :class:`TuningConfig`)."""
        if self.in_place:
            plgpu.wait_smem_to_gmem(self.stores_per_chunk, wait_read_only=True)
        elif self.direct_stores and not self.chunk_staging:
            plgpu.commit_smem()  # its warpgroup barrier

    def _load_parts_list(self):
        return [(l, p) for l in self.tile_loads for p in range(self._load_nparts(l))]

    def _slot_of(self, step_base, ci, slots=None):
        slots = slots or self.slots
        return (step_base + ci) % slots if isinstance(step_base, int) else lax.rem(step_base + ci, slots)

    def _issue_loads(self, ci, m0, n0, load_refs, scr, barrier_base, step_base):
        """TMA of chunk ``ci``'s tile / row_block loads into its SMEM slot."""
        c0, _ = self.chunks[ci]
        slot = self._slot_of(step_base, ci)
        load_parts = self._load_parts_list()
        for j, (l, p) in enumerate(load_parts):
            gc, pw = self._load_parts(l, c0, n0)[p]

            def copy(ref, col, l=l, p=p, j=j, pw=pw):
                plgpu.copy_gmem_to_smem(ref.at[pl.ds(m0, self.tm), pl.ds(col, pw)], scr["in_" + l.name].at[slot, p],
                                        scr["barrier"].at[barrier_base + slot * len(load_parts) + j])

            if l.name in self.load_splits:  # from the column part that holds the piece
                self._at_part(self.load_splits[l.name], load_refs[l.name], gc, copy)
            else:
                copy(load_refs[l.name], gc)

    def _load_direct(self, ci, m0, n0, load_refs) -> dict[str, tuple]:
        """Chunk ``ci``'s tile / row_block loads, GMEM -> registers in the WGMMA layout (in
        their own dtype; one array per part)."""
        c0, _ = self.chunks[ci]
        return {l.name: tuple(plgpu.load(load_refs[l.name].at[pl.ds(m0, self.tm), pl.ds(gc, pw)], layout=_WG,
                                         optimized=False)
                              for gc, pw in self._load_parts(l, c0, n0))
                for l in self.tile_loads}

    def _row_vectors(self, m0, load_refs) -> dict[str, Any]:
        """The tile's row loads (``[tm]`` each), GMEM -> registers."""
        return {l.name: _f32(plgpu.load(load_refs[l.name].at[pl.ds(m0, self.tm)], layout=_ROW, optimized=False))
                for l in self.epi.loads if l.kind is LoadKind.ROW}

    def _col_vectors(self, ci: int, n0, load_refs) -> dict[str, tuple]:
        """Chunk ``ci``'s column loads (one ``[w]`` vector per pair part), GMEM -> registers."""
        c0, _ = self.chunks[ci]
        return {l.name: tuple(_f32(plgpu.load(load_refs[l.name].at[pl.ds(gc, pw)], layout=_COL, optimized=False))
                              for gc, pw in self.parts(c0, n0, l.half))
                for l in self.epi.loads if l.kind is LoadKind.COL}

    def _scalars(self, load_refs) -> dict[str, Any]:
        """The scalar loads (0-d float32 in GMEM), read by every thread."""
        return {l.name: _f32(load_refs[l.name][...]) for l in self.scalar_loads}

    def prefetch(self, m0, n0, load_refs, scr, barrier_base=0, step_base=0, carried=None):
        """Issues the first chunks' tile loads and loads the row vectors, the first chunk's
        column vectors and the scalars; call before the mainloop so that they land during it.
        Returns the vectors (and, with direct loads, the first chunks' tile values), to pass
        as :meth:`emit`'s ``prefetched``. ``carried`` (a traced bool, with
        :attr:`cross_tile`): the tile before issued this tile's first ``lookahead`` chunks'
        loads (:meth:`emit`'s ``next_tile``), so only the rest are issued here."""
        tiles = {}
        if self._load_parts_list():
            if self.direct_loads:
                tiles = {ci: self._load_direct(ci, m0, n0, load_refs) for ci in range(self._n_prefetched())}
            else:
                self._wait_slot_free()
                for ci in range(self._n_prefetched()):
                    if self.cross_tile and carried is not None and ci < self.lookahead:
                        @pl.when(jnp.logical_not(carried))
                        def _(ci=ci):
                            self._issue_loads(ci, m0, n0, load_refs, scr, barrier_base, step_base)
                    else:
                        self._issue_loads(ci, m0, n0, load_refs, scr, barrier_base, step_base)
        vectors = self._row_vectors(m0, load_refs), self._col_vectors(0, n0, load_refs), tiles
        return vectors + (self._scalars(load_refs),) if self.scalar_loads else vectors

    def emit(self, acc, m0, n0, mi, ni, tile_slot, load_refs, out_refs, scr, barrier_base=0, step_base=0,
             prefetched=None, next_tile=None):
        """Runs the epilogue of the ``[tm, tn]`` accumulator tile at (m0, n0).

        ``step_base``: chunks processed before this tile with the same scratch (its parity
        picks the double-buffer slot, so a slot is never rewritten while its store runs).
        ``prefetched``: what :meth:`prefetch` returned (it issued the first chunks' tile loads
        and loaded the vectors), or None. Chunk ``ci + 1``'s column vectors are loaded
        before chunk ``ci`` is computed, so their latency hides behind its math.
        ``next_tile``: ``(m0, n0, exists)`` of the tile this scratch takes next (with
        :attr:`cross_tile`): its first chunks' loads are issued during this tile's last chunks,
        where it exists (its :meth:`prefetch` is then told ``carried``).
        """

        epi, shape, b, tm = self.epi, self.shape, self.b, self.tm
        m_slice = pl.ds(m0, tm)
        shape_c = (tm, self._width())
        load_parts = self._load_parts_list()
        n_chunks, ahead = len(self.chunks), self.lookahead

        def issue_loads(ci):
            self._issue_loads(ci, m0, n0, load_refs, scr, barrier_base, step_base)

        if prefetched is None:
            prefetched = self.prefetch(m0, n0, load_refs, scr, barrier_base, step_base)
        rows, cols, tiles = prefetched[:3]
        scalars = prefetched[3] if self.scalar_loads else {}
        tiles = dict(tiles)
        row_vals = {k: lax.broadcast_in_dim(v, shape_c, [0]) for k, v in rows.items()}
        row_state: dict[str, Any] = {}
        for ci, (c0, w) in enumerate(self.chunks):
            slot, col_slot = self._slot_of(step_base, ci), self._slot_of(step_base, ci, 2)
            out_slot = self._slot_of(step_base, ci, self.out_slots)
            col0 = n0 + c0
            next_cols = self._col_vectors(ci + 1, n0, load_refs) if ci + 1 < n_chunks else {}
            if load_parts and self.direct_loads:  # chunk ci + ahead's loads fly while chunk ci is computed
                if ci >= 1 and ci + ahead < n_chunks:
                    tiles[ci + ahead] = self._load_direct(ci + ahead, m0, n0, load_refs)
            elif load_parts:
                if ci >= 1 and ci + ahead < n_chunks:  # into the slot of chunk ci + ahead - slots
                    self._wait_slot_free()
                    issue_loads(ci + ahead)
                elif ci >= 1 and self.cross_tile and next_tile is not None:  # the next tile's chunk
                    nm0, nn0, exists = next_tile

                    @pl.when(exists)
                    def _(nc=ci + ahead - n_chunks):
                        self._wait_slot_free()
                        self._issue_loads(nc, nm0, nn0, load_refs, scr, barrier_base, step_base + n_chunks)
                with self.scope("load_wait"):
                    for j in range(len(load_parts)):
                        plgpu.barrier_wait(scr["barrier"].at[barrier_base + slot * len(load_parts) + j])
            acc_c = acc[:, c0:c0 + w] if b is None or epi.half_acc else (acc[:, c0:c0 + w], acc[:, c0 + b:c0 + b + w])
            kw = {}
            for l in epi.loads:
                if l.kind is LoadKind.ROW:
                    kw[l.name] = row_vals[l.name]
                elif l.kind is LoadKind.COL:
                    vs = tuple(lax.broadcast_in_dim(v, shape_c, [1]) for v in cols[l.name])
                    kw[l.name] = vs[0] if len(vs) == 1 else vs
                elif l.kind is LoadKind.SCALAR:  # 0-d: the body broadcasts it
                    kw[l.name] = scalars[l.name]
                elif self.direct_loads:
                    vs = tuple(_f32(v) for v in tiles[ci][l.name])
                    kw[l.name] = vs[0] if len(vs) == 1 else vs
                else:
                    vs = tuple(_f32(plgpu.load(scr["in_" + l.name].at[slot, p], layout=_WG, optimized=False))
                               for p in range(self._load_nparts(l)))
                    kw[l.name] = vs[0] if len(vs) == 1 else vs
            res = epi.body(acc_c, _TileContext(col0, shape_c), **kw)
            # An own slot written now was last stored two chunks ago: keep only the last chunk's
            # stores (an in-place slot was freed before its load was issued). With one output
            # slot, the last chunk's tile-output stores must have read it too.
            if self.chunk_staging:
                with self.scope("store_wait"):
                    in_flight = self.stores_per_chunk if self.out_slots == 2 else self.col_stores_per_chunk
                    plgpu.wait_smem_to_gmem(in_flight, wait_read_only=True)
            col_half = {}
            for o in epi.outputs:
                v = res[o.name]
                vs = v if isinstance(v, tuple) else (v,)
                if o.kind is OutputKind.TILE and o.quantize is not None:  # FP8, its copy, its amax
                    self._quantized(o, vs, scalars[o.quantize.scale], c0, n0, m_slice, shape_c, col0, slot, out_slot,
                                    out_refs, scr, row_state)
                elif o.kind is OutputKind.TILE and self.direct_stores:  # registers -> GMEM, no staging
                    for part, (gc, pw) in zip(vs, self.parts(c0, n0, o.half)):
                        val = part.astype(self.dt[o.name])
                        self._to_part(o.name, out_refs, gc, lambda ref, c, val=val, pw=pw: ref.__setitem__(
                            (m_slice, pl.ds(c, pw)), val))
                elif o.kind is OutputKind.TILE:
                    buf, bslot = self._out_buf(o.name, slot, out_slot)
                    for p, part in enumerate(vs):
                        scr[buf][bslot, p] = part.astype(self.dt[o.name])
                elif o.kind is OutputKind.ROW_SUM:
                    tot = None
                    for part in vs:
                        if shape.n_real < shape.n:  # pair mode pads whole blocks: the block start decides
                            part = jnp.where(_col_ids(shape_c, col0) < shape.n_real, part, 0.0)
                        r = _folded(part, jnp.add) if self.fold_rows else part.sum(axis=1)
                        tot = r if tot is None else tot + r
                    row_state[o.name] = tot if o.name not in row_state else row_state[o.name] + tot
                elif o.kind is OutputKind.ROW_LOGSUMEXP:
                    x = v
                    if shape.n_real < shape.n:
                        x = jnp.where(_col_ids(shape_c, col0) < shape.n_real, x, -jnp.inf)
                    cm = x.max(axis=1)
                    mx, se = row_state.get(o.name, (None, None))
                    nm = cm if mx is None else jnp.maximum(mx, cm)  # online (max, sum-exp) across chunks
                    # A chunk, or a whole consumer tile, of padding columns has max -inf (N padded
                    # to the CTA tile can leave the second consumer's tile all padding: vocab
                    # 50257 -> 50432). Shifting by -inf would give exp(-inf + inf) = NaN; a finite
                    # shift gives exp(-inf) = 0, and the tile's LSE log(0) = -inf, which the
                    # partials' logsumexp ignores. (Without padding no max is -inf: no guard.)
                    shift = jnp.maximum(nm, _FINITE_FLOOR) if shape.n_real < shape.n else nm
                    ex = jnp.exp(x - lax.broadcast_in_dim(shift, shape_c, [0])).sum(axis=1)
                    row_state[o.name] = (nm, ex if mx is None else se * jnp.exp(mx - shift) + ex)
                else:  # COL_SUM
                    col_half[o.name] = b is not None and not isinstance(v, tuple)
                    for p, part in enumerate(vs):
                        if shape.m_real < shape.m:
                            rows = plgpu.broadcasted_iota(jnp.int32, shape_c, 0, layout=_WG) + m0
                            part = jnp.where(rows < shape.m_real, part, 0.0)
                        scr["col_" + o.name][col_slot, p] = (_consumer_col_sum(part, scr["colsum_scratch"])
                                                             if self.consumer_col_sums else part.sum(axis=0))
            if self.chunk_staging:
                plgpu.commit_smem()
            for o in self.tile_outs if not self.direct_stores else ():
                buf, bslot = self._out_buf(o.name, slot, out_slot)
                for p, (gc, pw) in enumerate(self.parts(c0, n0, o.half)):
                    src = scr[buf].at[bslot, p]
                    self._to_part(o.name, out_refs, gc, lambda ref, c, src=src, pw=pw: plgpu.copy_smem_to_gmem(
                        src, ref.at[m_slice, pl.ds(c, pw)]))
            for o in self.t_outs if not self.direct_stores else ():  # [w, tm] blocks of the [W, M] copy
                for p, (gc, pw) in enumerate(self.parts(c0, n0, o.half)):
                    plgpu.copy_smem_to_gmem(scr["outT_" + o.name].at[out_slot, p],
                                            out_refs[o.name + "_t"].at[pl.ds(gc, pw), m_slice])
            for o in self.col_outs:
                for p, (gc, pw) in enumerate(self.parts(c0, n0, col_half[o.name])):
                    plgpu.copy_smem_to_gmem(scr["col_" + o.name].at[col_slot, p], out_refs[o.name].at[mi, pl.ds(gc, pw)])
            cols = next_cols
        if self.row_outs or self.amax_outs:
            if self.direct_stores:  # no per-chunk wait ran: the slot's store of two tiles ago has read it
                plgpu.wait_smem_to_gmem(self.row_stores, wait_read_only=True)
            for o in self.row_outs:
                st = row_state[o.name]
                if o.kind is OutputKind.ROW_SUM:
                    scr["row_" + o.name][tile_slot] = st.sum(axis=1) if self.fold_rows else st
                else:
                    scr["row_" + o.name][tile_slot] = st[0] + jnp.log(st[1])
            for o in self.amax_outs:
                st = row_state[o.name + "_amax"]
                scr["amax_" + o.name][tile_slot] = st.max(axis=1) if self.fold_rows else st
            plgpu.commit_smem()
            for o in self.row_outs:
                plgpu.copy_smem_to_gmem(scr["row_" + o.name].at[tile_slot], out_refs[o.name].at[ni, m_slice])
            for o in self.amax_outs:
                plgpu.copy_smem_to_gmem(scr["amax_" + o.name].at[tile_slot], out_refs[o.name + "_amax"].at[ni, m_slice])

    def _quantized(self, o, vs, scale, c0, n0, m_slice, shape_c, col0, slot, out_slot, out_refs, scr,
                   row_state) -> None:
        """One chunk of quantizing output ``o`` (``vs``: its float32 parts, one per pair half):
        ``saturate(v * scale)`` in its FP8 dtype into its tile (staged, or straight to GMEM with
        direct stores), the same values into its transposed copy's ``[w, tm]`` blocks (through a
        transposed view, in the register layout whose two-element vectors run down a column:
        contiguous bytes of the copy's rows), and the chunk's row max of ``|v|`` (padding
        columns masked to 0) into ``row_state``."""
        dt = self.dt[o.name]
        sat = tuple(part * scale if self.compiled else _saturated(part, scale, dt) for part in vs)
        for p, (q, (gc, pw)) in enumerate(zip(sat, self.parts(c0, n0, o.half))):
            val = q.astype(dt)
            if self.direct_stores:
                self._to_part(o.name, out_refs, gc, lambda ref, c, val=val, pw=pw: ref.__setitem__(
                    (m_slice, pl.ds(c, pw)), val))
            else:
                buf, bslot = self._out_buf(o.name, slot, out_slot)
                scr[buf][bslot, p] = val
            if o.quantize.transpose:
                if self.byte_transpose:  # the FP8 values relaid: a shuffle and a permute per two vectors
                    val_t = _fp8_transposed(val)
                else:  # Mosaic GPU relays 16- and 32-bit values: the float32 ones, cast again
                    val_t = plgpu.layout_cast(q, _WG_T).astype(dt)
                dst = (out_refs[o.name + "_t"].at[pl.ds(gc, pw), m_slice] if self.direct_stores
                       else scr["outT_" + o.name].at[out_slot, p])
                dst.T[...] = val_t
        if o.quantize.amax:
            amax = None
            for part in vs:
                x = jnp.abs(part)
                if self.shape.n_real < self.shape.n:  # pair mode pads whole blocks: the block start decides
                    x = jnp.where(_col_ids(shape_c, col0) < self.shape.n_real, x, 0.0)
                r = _folded(x, jnp.maximum) if self.fold_rows else x.max(axis=1)
                amax = r if amax is None else jnp.maximum(amax, r)
            key = o.name + "_amax"
            row_state[key] = amax if key not in row_state else jnp.maximum(row_state[key], amax)


SMEM_LIMIT = 227 * 1024


def _specs(shape: KernelShape, cfg: TuningConfig, block_m: int, block_n: int):
    """SMEM block shapes of the A and B operands (transposed layouts keep K minor-most)."""
    tk = cfg.tile_k
    a_block = (tk, block_m) if shape.transpose_a else (block_m, tk)
    b_block = (block_n, tk) if shape.transpose_b else (tk, block_n)
    return a_block, b_block


# SMEM a kernel takes beside its operand stages and epilogue staging: barriers and alignment
# (at most 232 B measured over the programs and tuning candidates), and,
# in a kernel with a reduction (row or column sums, the online logsumexp, ctx.row_sum), the
# cross-warp reduction scratch that Pallas reserves for it (CompilerParams.reduction_scratch_bytes).
SMEM_MARGIN = 2048
REDUCTION_SCRATCH = plgpu.CompilerParams().reduction_scratch_bytes


@functools.lru_cache(maxsize=None)  # per program: its body is traced to find ctx.row_sum
def _reserved_smem(epi: Epilogue) -> int:
    """:data:`SMEM_MARGIN`, plus :data:`REDUCTION_SCRATCH` where ``epi``'s kernel reduces."""
    reduces = any(o.kind in (OutputKind.ROW_SUM, OutputKind.ROW_LOGSUMEXP, OutputKind.COL_SUM)
                  or (o.quantize is not None and o.quantize.amax) for o in epi.outputs) or body_uses_row_sum(epi)
    return SMEM_MARGIN + (REDUCTION_SCRATCH if reduces else 0)


def smem_estimate(epi: Epilogue, shape: KernelShape, cfg: TuningConfig, load_dtypes: dict[str, Any]) -> int:
    """SMEM bytes ``plan_kernel`` counts for ``cfg``: the operand stages, the epilogue staging
    (once per consumer warpgroup beside the pipeline; in the single-warpgroup kernel it reuses
    the pipeline's SMEM) and :func:`_reserved_smem`."""
    scratch = _EpilogueEmitter(epi, shape, cfg, load_dtypes).scratch_bytes(load_dtypes)
    ops = cfg.smem_bytes(jnp.dtype(shape.operand_dtype).itemsize)
    body = ops + 2 * scratch if cfg.warp_specialized else max(ops, scratch)  # disjoint scopes
    return body + _reserved_smem(epi)


def plan_kernel(epi: Epilogue, shape: KernelShape, cfg: TuningConfig,
                load_dtypes: tuple[tuple[str, Any], ...] = ()) -> TuningConfig:
    """The configuration that runs: ``cfg``, adjusted until operands + epilogue fit in SMEM.

    Order of preference: the warp-specialized kernel with ``cfg``'s pipeline depth and
    the widest epilogue chunk (at most ``cfg.epilogue_cols``) whose :func:`live_values` fit
    ``cfg.epilogue_regs``, each with the most load slots that fit (at most
    ``cfg.epilogue_load_slots``, at least 2), then narrower chunks (32, 16 columns: less
    staging SMEM per consumer), then fewer stages (down to 2; to 1 on the ping-pong kernel where a
    tile has one K step, an epilogue pass); then the single-warpgroup kernel (whose
    epilogue staging reuses the pipeline's SMEM), then with ``tile_m=64``. Raises
    ``ValueError`` naming the epilogue if nothing fits. A promoting kernel
    (``shape.promote_k``) first halves its consumer tile (M, then N) to
    :data:`PROMOTED_TILE_ELEMS`, as it holds two accumulators, and runs the cooperative
    schedule on the ring's mainloop (``delay_release=1``), which promotes between its K steps.
    """
    ldt = dict(load_dtypes)
    if shape.promote_k:  # two accumulators a consumer; the ring's mainloop, not JAX's pipeline
        while cfg.tile_m * cfg.tile_n > PROMOTED_TILE_ELEMS:
            cfg = dataclasses.replace(cfg, **(dict(tile_m=cfg.tile_m // 2) if cfg.tile_m > 64 else
                                              dict(tile_n=cfg.tile_n // 2)))
        if cfg.warp_specialized and not cfg.pingpong:
            cfg = dataclasses.replace(cfg, delay_release=1)
    if not cfg.k_step_fits(shape.transpose_a, shape.transpose_b):
        raise ValueError(f"tile_k={cfg.tile_k} needs both operands K-major (A [M, K], B given as [N, K]: "
                         f"transpose_a=False, transpose_b=True); use a multiple of 64")

    def fits(c: TuningConfig) -> bool:
        return smem_estimate(epi, shape, c, ldt) <= SMEM_LIMIT

    def ws_applies(c: TuningConfig) -> bool:
        if any(o.kind is OutputKind.COL_SUM for o in epi.outputs) and not c.consumer_col_sums:
            # A column sum is a cross-warp reduction through Pallas's one scratch; run in both
            # consumer warpgroups at once it gave intermittently wrong partials on the H100
            # (TuningConfig.consumer_col_sums gives each consumer its own).
            return False
        cm, cn = c.cluster_tile()
        if shape.m % cm or shape.n % cn:
            return False
        # An M split would slice a transposed A; a ping-pong consumer takes the whole block.
        return c.pingpong or c.wg_dimension == "n" or not shape.transpose_a

    # The widest chunk whose values fit the register budget beside the accumulator; then
    # narrower chunks (less staging SMEM) before shallower pipelines; 2 stages last.
    widest = cfg.epilogue_cols
    while widest > 16 and live_values(epi, cfg.tile_n, widest) > cfg.epilogue_regs:
        widest //= 2
    col_options = [c for c in (widest, 32, 16) if c <= widest]
    stage_options = list(range(cfg.max_concurrent_steps, 2, -1))
    # One K step a tile (an epilogue pass): the ping-pong ring runs on one stage too (a
    # consumer releases it after its one MMA, before its epilogue), last, unless asked for.
    one_stage = shape.k <= cfg.tile_k and cfg.pingpong and cfg.warp_specialized
    # Load slots are given up first (they only matter to epilogues with tile loads).
    slot_options = list(range(cfg.epilogue_load_slots, 1, -1))
    candidates = []
    # A cluster that does not divide the grid is dropped before the warp-specialized kernel is.
    for ws_cfg in dict.fromkeys((cfg, dataclasses.replace(cfg, cluster_dimension=None))):
        if ws_cfg.warp_specialized and ws_applies(ws_cfg):
            ws_stages = stage_options + [2]
            if one_stage:
                ws_stages = [1] + ws_stages if cfg.max_concurrent_steps == 1 else ws_stages + [1]
            candidates += [dataclasses.replace(ws_cfg, epilogue_cols=c, max_concurrent_steps=s, epilogue_load_slots=k)
                           for s in ws_stages for c in col_options for k in slot_options]
            break
    simple = dataclasses.replace(cfg, warp_specialized=False, cluster_dimension=None, epilogue_cols=widest)
    for tm in dict.fromkeys((cfg.tile_m, 64)):
        candidates += [dataclasses.replace(simple, tile_m=tm, max_concurrent_steps=s, epilogue_load_slots=k)
                       for s in range(cfg.max_concurrent_steps, 1, -1) for k in slot_options]
    for c in candidates:
        if fits(c):
            return c
    raise ValueError(f"epilogue {epi.name!r}: operand stages + epilogue staging exceed the {SMEM_LIMIT} B of SMEM "
                     f"even at tile_m=64 with 2 stages (tile_n={cfg.tile_n}); use a smaller tile_n")


def col_sums_as_tiles(epi: Epilogue) -> Epilogue:
    """``epi`` with each column-sum output written as a float32 tile of its summands
    (``[M, N]``; sliced to the GEMM's rows and columns like any tile, so padding drops out):
    the column-sum contract's partials ``[P, N]`` with ``P = M``, which the caller sums over
    axis 0. The body is unchanged (a tile output stores what a column sum would have summed).
    Pair-mode epilogues are returned as they are (their half-width summands have their own
    layout)."""
    if epi.pair_block is not None or not any(o.kind is OutputKind.COL_SUM for o in epi.outputs):
        return epi
    outs = tuple(Output(o.name, OutputKind.TILE, jnp.float32) if o.kind is OutputKind.COL_SUM else o
                 for o in epi.outputs)
    return dataclasses.replace(epi, outputs=outs)


def plan_epilogue(epi: Epilogue, shape: KernelShape, cfg: TuningConfig,
                  load_dtypes: tuple[tuple[str, Any], ...] = ()) -> tuple[Epilogue, TuningConfig]:
    """The epilogue and configuration that run: :func:`plan_kernel`'s, except that where
    ``cfg`` asks for the warp-specialized kernel and ``epi``'s column sums alone keep it off
    (see ``plan_kernel``), with ``cfg.col_sum_tiles`` the sums are written as tiles
    (:func:`col_sums_as_tiles`) and the kernel keeps its two consumer warpgroups, if they
    then fit in SMEM. ``shape`` serves both (a column sum's partials and its summand tile
    are float32 alike)."""
    planned = plan_kernel(epi, shape, cfg, load_dtypes)
    # A promoting kernel takes the summand tiles too: the single-warpgroup kernel promotes by
    # restarting its pipeline each group.
    if planned.warp_specialized or not (cfg.warp_specialized and (cfg.col_sum_tiles or shape.promote_k)):
        return epi, planned
    tiled = col_sums_as_tiles(epi)
    if tiled is epi:
        return epi, planned
    try:
        tiled_plan = plan_kernel(tiled, shape, cfg, load_dtypes)
    except ValueError:  # the summand tile's staging does not fit: keep the sum in the kernel
        return epi, planned
    return (tiled, tiled_plan) if tiled_plan.warp_specialized else (epi, planned)


# Timelines of the kernel's phases (Mosaic GPU's in-kernel profiler), for studying where a
# fused kernel loses time against the identity GEMM (benchmarks/kernel_timeline.py). Each
# warpgroup records when it enters and leaves the named ranges of the kernel body: the
# consumers' ``mainloop`` (inside it, per K step, ``full_wait``: waiting for an operand
# stage, ring kernels only; before it, ``turn_wait``: ping-pong turns) and ``epilogue``
# (inside it, per chunk, ``load_wait``: the tile
# loads' barrier; ``store_wait``: the staging slot's previous TMA store), and the ring
# producer's ``free_wait`` per K step (a stage not yet released by the consumers).
PROFILE_SCOPES = ("mainloop", "epilogue", "full_wait", "free_wait", "load_wait", "store_wait", "turn_wait")


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    """Profiling of the Pallas kernels (debugging only): pass one to
    :class:`coda_jax.pallas.PallasLowering` (``profile=``) and run under
    :func:`coda_jax.backend.use_lowering`.

    Attributes:
      directory: where every kernel launch writes its timeline (a Chrome-trace JSON, one per
        launch, ``ts`` in microseconds).
      ranges: ranges one warpgroup records per launch (default 40). Mosaic GPU keeps them in SMEM (16 bytes each) beside the kernel's own
        staging, so only a few fit: the first ones are kept (the first tiles), later ones
        dropped.
      scopes: the ranges recorded, of :data:`PROFILE_SCOPES` (default ``mainloop`` and
        ``epilogue``: two a tile).
    A profiled kernel reads the clock per range and returns through a host callback; it is
    never taken from or written to the kernel cache.
    """

    directory: str
    ranges: int = 40
    scopes: frozenset[str] = frozenset({"mainloop", "epilogue"})


    def __post_init__(self):
        unknown = sorted(set(self.scopes) - set(PROFILE_SCOPES))
        if unknown or self.ranges < 1 or not self.directory:
            raise ValueError(f"ProfileSettings: scopes must be of {PROFILE_SCOPES} (got {unknown}), ranges >= 1 "
                             f"(got {self.ranges}) and directory non-empty (got {self.directory!r})")


def build_kernel(epi: Epilogue, shape: KernelShape, cfg: TuningConfig, interpret: bool,
                 load_dtypes: tuple[tuple[str, Any], ...] = (), profile: ProfileSettings | None = None):
    """A callable ``(a, b, *loads) -> outputs`` (outputs in ``epi.outputs`` order).

    ``cfg`` must already be the planned configuration (:func:`plan_kernel`). ``profile``:
    record the kernel's timeline (:class:`ProfileSettings`; ignored in interpret mode).
    """
    profile = None if interpret else profile
    emitter = _EpilogueEmitter(epi, shape, cfg, dict(load_dtypes), profile.scopes if profile else frozenset(),
                               compiled=not interpret)
    ldt = dict(load_dtypes)
    ws = cfg.warp_specialized
    if cfg.pingpong or (ws and cfg.delay_release):
        body = _ring_body(emitter, shape, cfg, ldt)
    else:
        body = _ws_body(emitter, shape, cfg, ldt) if ws else _simple_body(emitter, shape, cfg, ldt)
    # The kernel's name in profiles: program, layout and (padded) GEMM shape, so a profile
    # splits a program's time per call site (e.g. rms_dgrad_res: the MLP's and the QKV's dgrad).
    layout = ("t" if shape.transpose_a else "n") + ("t" if shape.transpose_b else "n")
    body.__name__ = body.__qualname__ = f"coda_{epi.name}_{layout}_{shape.m}x{shape.n}x{shape.k}"
    cluster = _cluster_size(cfg)
    return plgpu.kernel(
        body,
        out_type=out_types(epi, shape, cfg),
        grid=(shape.num_sms // cluster,),
        grid_names=("sm",),
        **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
        num_threads=3 if ws else None,
        thread_name="wg" if ws else None,
        compiler_params=plgpu.CompilerParams(
            approx_math=cfg.approx_math,
            # Pallas's automatic barriers around every register -> memory store guard SMEM
            # that several threads share. Direct stores go to GMEM, each thread its own
            # elements; the SMEM left (row partials) is fenced by hand: a wait for the slot's
            # previous TMA store (with its warpgroup barrier) before the write, commit_smem after.
            # Manual barriers fence the staged chunks the same way (_EpilogueEmitter).
            unsafe_no_auto_barriers=cfg.direct_stores or emitter.manual_barriers,
            **(dict(profile_space=profile.ranges, profile_dir=profile.directory, profile_bounds_check=True)
               if profile else {})),
        interpret=plgpu.InterpretGPUParams(uninitialized_memory="nan") if interpret else None,  # poisoned outputs
    )


def tile_grid(shape: KernelShape, cfg: TuningConfig, per_cta: int) -> KernelShape:
    """``shape`` whose grid (``num_sms``) launches one program (a CTA, or a CTA pair when
    clustered) per ``per_cta`` cluster tiles instead of one per SM (``per_cta`` 0: unchanged).

    The tile loop is the persistent one either way: with as many programs as tiles / ``per_cta``,
    each walks at most ``per_cta`` tiles, and the GPU schedules the programs onto free SMs.
    ``cfg`` must be planned (:func:`plan_kernel`): its cluster tile decides the count.
    """
    if per_cta <= 0:
        return shape
    cl_m, cl_n = cfg.cluster_tile()
    tiles = (shape.m // cl_m) * (shape.n // cl_n)
    return dataclasses.replace(shape, num_sms=_cluster_size(cfg) * -(-tiles // per_cta))


def _cluster_size(cfg: TuningConfig) -> int:
    return 2 if cfg.warp_specialized and cfg.cluster_dimension is not None else 1


def _tile_order(lin, grid_m: int, grid_n: int, cfg: TuningConfig):
    """(mi, ni) of the ``lin``-th tile in planar-snake order (bands across ``grid_minor_dim``)."""
    minor = 1 if cfg.grid_minor_dim == "n" else 0
    return plgpu.planar_snake(lin, (grid_m, grid_n), minor, min(cfg.grid_tile_width, (grid_m, grid_n)[minor]))


def _split_refs(em: _EpilogueEmitter, refs):
    """``(load refs, output refs)`` by name from the kernel's refs after ``a`` and ``b``; a
    split output's or load's entry is the tuple of its parts' refs."""
    epi, splits, load_splits = em.epi, dict(em.shape.out_splits), dict(em.shape.load_splits)
    loads, i = {}, 0
    for l in epi.loads:  # a load in column parts: the tuple of its parts' refs
        k = len(load_splits.get(l.name, (None,)))
        loads[l.name] = tuple(refs[i:i + k]) if l.name in load_splits else refs[i]
        i += k
    outs = {}
    for o in epi.outputs:
        k = len(splits.get(o.name, (None,)))
        outs[o.name] = tuple(refs[i:i + k]) if o.name in splits else refs[i]
        i += k
        for extra in o.result_names()[1:]:  # a quantizing output's copy and amax (out_types)
            outs[extra] = refs[i]
            i += 1
    return loads, outs


def _as_operands(a, b, shape: KernelShape):
    """wgmma operands from SMEM blocks: transposed views where the layout stores them so."""
    return a.transpose((1, 0)) if shape.transpose_a else a, b.transpose((1, 0)) if shape.transpose_b else b


def _consumer_operands(a, b, shape: KernelShape, cfg: TuningConfig, wg):
    """Cooperative kernels: consumer ``wg``'s wgmma operands from one stage's CTA-wide A and
    B blocks, its half along ``cfg.wg_dimension`` (an M split never meets a transposed A:
    :func:`plan_kernel` does not pick it)."""
    if cfg.wg_dimension == "n":
        tn = cfg.tile_n
        b = b.at[pl.ds(wg * tn, tn)] if shape.transpose_b else b.at[:, pl.ds(wg * tn, tn)]
    else:
        a = a.at[pl.ds(wg * cfg.tile_m, cfg.tile_m)]
    return _as_operands(a, b, shape)


def _consumer_tile(cfg: TuningConfig, mi, ni, wg):
    """Cooperative kernels: ``(m0, n0, mi_c, ni_c)``, the origin of consumer ``wg``'s
    ``[tile_m, tile_n]`` half of CTA tile ``(mi, ni)`` and that half's index in the
    ``[tile_m, tile_n]`` grid (whose row / column partials it writes)."""
    cta_m, cta_n = cfg.cta_tile()
    if cfg.wg_dimension == "n":
        return mi * cta_m, ni * cta_n + wg * cfg.tile_n, mi, 2 * ni + wg
    return mi * cta_m + wg * cfg.tile_m, ni * cta_n, 2 * mi + wg, ni


# A promoting consumer holds two accumulators (the tensor core's and the float32 total): a
# consumer tile of at most this many elements keeps both at 64 registers a thread each;
# plan_kernel halves larger tiles.
PROMOTED_TILE_ELEMS = 64 * 128


def _promoted_groups(k_iters: int, every: int, tm: int, tn: int, group: Callable[[Any, int, Any], None]):
    """The float32 ``[tm, tn]`` product of ``k_iters`` K steps, accumulated with periodic
    promotion (TransformerEngine's split accumulator) when ``every`` > 0.

    Hopper's FP8 wgmma adds each product group into its accumulator at reduced precision (the
    addends are aligned to the larger exponent with about 14 bits kept), so an accumulator that
    has grown drops the low bits of every later addend, and the error grows with K
    (docs/fp8.md#accumulation). Here every ``every`` K steps run on a fresh tensor-core
    accumulator, and each group's partial sum is added into a float32 register total.
    ``group(acc_ref, first, steps)`` issues K steps ``first .. first + steps - 1`` on
    ``acc_ref`` and waits for them (the tensor cores drain once a group). ``every`` 0: one
    group of all K steps, no total."""
    def run(first, steps):
        def scope(acc_ref):
            group(acc_ref, first, steps)
            return acc_ref[...]
        return pl.run_scoped(scope, plgpu.ACC((tm, tn), jnp.float32))

    if not every or every >= k_iters:
        return run(0, k_iters)
    groups, rest = divmod(k_iters, every)
    total = plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), _WG)
    total = lax.fori_loop(0, groups, lambda g, t: t + run(g * every, every), total)
    return total + run(groups * every, rest) if rest else total


def _simple_body(em: _EpilogueEmitter, shape: KernelShape, cfg: TuningConfig, ldt):
    """One warpgroup per CTA: TMA pipeline, wgmma, then the epilogue (SMEM reused)."""
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    grid_m, grid_n, k_iters = shape.m // tm, shape.n // tn, shape.k // tk
    a_block, b_block = _specs(shape, cfg, tm, tn)
    every = shape.promote_steps(tk)

    def body(a_gmem, b_gmem, *refs):
        load_refs, out_refs = _split_refs(em, refs)

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _tile_loop(info: plgpu.NDLoopInfo):
            lin = info.index[0]
            mi, ni = _tile_order(lin, grid_m, grid_n, cfg)

            def group(acc_ref, first, steps):  # K steps first .. first + steps - 1, pipelined
                def step(_, a_smem, b_smem):
                    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)) if shape.transpose_a else a_smem,
                                b_smem.transpose((1, 0)) if shape.transpose_b else b_smem)
                    plgpu.wgmma_wait(1)

                a_map = (lambda kk: (first + kk, mi)) if shape.transpose_a else (lambda kk: (mi, first + kk))
                b_map = (lambda kk: (ni, first + kk)) if shape.transpose_b else (lambda kk: (first + kk, ni))
                plgpu.emit_pipeline(
                    step,
                    grid=(steps,),
                    in_specs=[
                        plgpu.BlockSpec(a_block, a_map, transforms=_transforms(a_block[1], shape.operand_dtype),
                                        delay_release=1),
                        plgpu.BlockSpec(b_block, b_map, transforms=_transforms(b_block[1], shape.operand_dtype),
                                        delay_release=1),
                    ],
                    max_concurrent_steps=cfg.max_concurrent_steps,
                )(a_gmem, b_gmem)
                plgpu.wgmma_wait(0)

            with em.scope("mainloop"):
                # With promotion, each group is its own pipeline (filled and drained).
                acc = _promoted_groups(k_iters, every, tm, tn, group)

            @functools.partial(pl.run_scoped, **em.scratch_types(ldt))
            def _scope(**scr):
                with em.scope("epilogue"):
                    em.emit(acc, mi * tm, ni * tn, mi, ni, 0, load_refs, out_refs, scr)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # scratch dies with this scope

        plgpu.wait_smem_to_gmem(0)

    return body


def _ws_body(em: _EpilogueEmitter, shape: KernelShape, cfg: TuningConfig, ldt):
    """Warp-specialized: a producer warpgroup feeds two consumers, each owning half the tile.

    ``wg_dimension="m"``: CTA tile ``[2*tm, tn]``, consumer ``wg`` owns rows
    ``[wg*tm, (wg+1)*tm)``; ``"n"``: CTA tile ``[tm, 2*tn]``, consumer ``wg`` owns columns
    ``[wg*tn, (wg+1)*tn)``. Either way each consumer's epilogue sees a ``[tm, tn]`` tile and
    writes the partials of tile ``(mi_c, ni_c)`` of the ``[tm, tn]`` grid.
    """
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    ta, tb = shape.transpose_a, shape.transpose_b
    cta_m, cta_n = cfg.cta_tile()
    cl_m, cl_n = cfg.cluster_tile()
    grid_m, grid_n, k_iters = shape.m // cl_m, shape.n // cl_n, shape.k // tk
    n_programs = shape.num_sms // _cluster_size(cfg)
    a_block, b_block = _specs(shape, cfg, cta_m, cta_n)
    # A cluster along M shares the B block (multicast to both CTAs); along N, the A block.
    a_shared = ("cluster",) if cfg.cluster_dimension == "n" else ()
    b_shared = ("cluster",) if cfg.cluster_dimension == "m" else ()
    n_bar = em.n_barriers

    def pipeline(step, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(a_block, (lambda kk: (kk, 0)) if ta else (lambda kk: (0, kk)),
                                transforms=_transforms(a_block[1], shape.operand_dtype), collective_axes=a_shared),
                plgpu.BlockSpec(b_block, (lambda kk: (0, kk)) if tb else (lambda kk: (kk, 0)),
                                transforms=_transforms(b_block[1], shape.operand_dtype), collective_axes=b_shared),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    def body(a_gmem, b_gmem, *refs):
        load_refs, out_refs = _split_refs(em, refs)
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(pl.run_scoped,
                           pipeline_allocs=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
                           collective_axes="wg", **em.scratch_types(ldt, copies=2))
        def _scope(pipeline_allocs, **scr):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
            def _tile_loop(info: plgpu.NDLoopInfo):
                lin = info.index[0]
                mi, ni = _tile_order(lin, grid_m, grid_n, cfg)
                if cfg.cluster_dimension == "m":  # (mi, ni) is the cluster's tile; this CTA's half
                    mi = 2 * mi + lax.axis_index("cluster")
                elif cfg.cluster_dimension == "n":
                    ni = 2 * ni + lax.axis_index("cluster")
                local = lax.div(lin, n_programs)  # tiles this CTA has done before
                tile_slot = lax.rem(local, 2)
                m0, n0, mi_c, ni_c = _consumer_tile(cfg, mi, ni, wg)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc(acc_ref):
                        mine = {k: (v if k == "barrier" else v.at[wg]) for k, v in scr.items()}
                        step_base = local * len(em.chunks)
                        # The epilogue's residual / saved tiles stream in while the MMAs run.
                        pre = em.prefetch(m0, n0, load_refs, mine, barrier_base=wg * n_bar, step_base=step_base)
                        with em.scope("mainloop"):
                            eval_pipeline(acc_ref)
                            acc = acc_ref[...]
                        with em.scope("epilogue"):
                            em.emit(acc, m0, n0, mi_c, ni_c, tile_slot, load_refs, out_refs, mine,
                                    barrier_base=wg * n_bar, step_base=step_base, prefetched=pre)

                def step(_, a_smem, b_smem, acc_ref):
                    plgpu.wgmma(acc_ref, *_consumer_operands(a_smem, b_smem, shape, cfg, wg))
                    plgpu.wgmma_wait(0)
                    return acc_ref

                a_view = a_gmem.at[:, pl.ds(mi * cta_m, cta_m)] if ta else a_gmem.at[pl.ds(mi * cta_m, cta_m), :]
                b_view = b_gmem.at[pl.ds(ni * cta_n, cta_n), :] if tb else b_gmem.at[:, pl.ds(ni * cta_n, cta_n)]
                pipeline(step, compute_context)(a_view, b_view, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0)

    return body


# Registers per thread: the producer gives up what the two consumers take (64 Ki registers
# per SM: 40 + 2 * 232 <= 512 per thread of a warpgroup).
_PRODUCER_REGS, _CONSUMER_REGS = 40, 232


def _ring_body(em: _EpilogueEmitter, shape: KernelShape, cfg: TuningConfig, ldt):
    """Warp-specialized on a hand-written stage ring: a producer warpgroup feeds two consumers.

    Two schedules share the producer and the ring:

    * **ping-pong** (``cfg.pingpong``): the CTA's output tiles (``lin = sm, sm + n_programs,
      ...``, planar-snake order) alternate between the consumers: consumer ``c`` owns the
      CTA's tiles ``i = c, c + 2, ...`` and computes each ``[tm, tn]`` tile whole, mainloop
      and epilogue. While a consumer runs its epilogue, the other consumer's MMAs run on the
      blocks that were streaming in meanwhile. This is the overlap that the cooperative
      kernel lacks. With ``cfg.pingpong_turns`` a consumer also waits for the other to finish
      its tile's MMAs before starting its own (``mma_turn``), so a ring that already holds the
      next tile's stages does not let the two run MMAs at once.
    * **cooperative** (``cfg.delay_release == 1``): both consumers take every CTA tile, each
      its ``[tm, tn]`` half (``wg_dimension``), as in :func:`_ws_body`; but each consumer
      issues K step ``k+1``'s MMAs before it waits for step ``k``'s (``wgmma_wait(1)``), so
      the tensor cores do not drain between steps, and releases step ``k``'s stage then.

    The producer walks all the CTA's tiles and K steps in order and loads them through ONE
    ring of ``S = max_concurrent_steps`` stages, running into the next tile while the
    consumers run their epilogues.

    Barriers. Step ``t`` (tile ``t // K``, K step ``t % K``) lives in stage ``t % S``.
    * ``full[c, s]`` (ping-pong) is filled by the A and B loads of consumer ``c``'s steps in
      stage ``s``. Each consumer waits on its own barriers only, so it waits on every phase
      of them (the Pallas phase-bit invariant), although the stages are shared. Cooperative:
      ``full[s]``, waited on by both consumers, each at every phase.
    * ``free[s]`` is arrived at by the consumer(s) that used stage ``s`` (one, or both when
      cooperative) once their MMAs have read the stage, and waited on by the producer before
      it refills the stage. A tile's last stage is released after ``wgmma_wait(0)``.
    No barrier can complete twice before its waiter sees the first completion: a stage is
    refilled only after its previous users have released it.

    Clusters (``cluster_dimension="m"``): two CTAs take vertically neighbouring tiles of
    the same column at the same time, and the B block they share arrives by one multicast
    TMA load (each CTA loads half and writes it into both CTAs' stage). ``free`` is then a
    cluster barrier: a stage is refilled only when the consumers of both CTAs have released
    it, since the refill writes into both. (``"n"``: the same with the A block.)
    """
    # An epilogue pass (the body ignores acc) on TuningConfig.skip_pass_gemm: no K step, so the
    # producer loads nothing and each consumer's mainloop is the zero accumulator alone.
    ring = _Ring.of(shape, cfg, skip_gemm=cfg.skip_pass_gemm and not em.epi.reads_acc)
    n_bar = em.n_barriers
    users = 2 if ring.coop else 1  # consumers that read each stage
    stages = ring.stages
    if _cluster_size(cfg) > 1:
        free_type = plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=users, num_barriers=stages)
    else:
        free_type = plgpu.Barrier(num_arrivals=users, num_barriers=stages)

    def body(a_gmem, b_gmem, *refs):
        load_refs, out_refs = _split_refs(em, refs)
        sm = lax.axis_index("sm")
        my_tiles = lax.div(ring.n_tiles - sm + ring.n_programs - 1, ring.n_programs)  # tiles sm, sm + P, ...
        a_dt, b_dt = a_gmem.dtype, b_gmem.dtype  # FP8 operands may mix e4m3 and e5m2

        @functools.partial(
            pl.run_scoped,
            a_smem=plgpu.SMEM((stages, *ring.a_block), a_dt, transforms=_transforms(ring.a_block[1], a_dt)),
            b_smem=plgpu.SMEM((stages, *ring.b_block), b_dt, transforms=_transforms(ring.b_block[1], b_dt)),
            # [consumer, stage] (ping-pong) or [stage]: A + B loads arrive.
            full=plgpu.Barrier(num_arrivals=2, num_barriers=stages if ring.coop else 2 * stages),
            free=free_type,
            # Ping-pong turns: mma_turn[c] is arrived at by the other consumer when its MMAs of
            # a tile are done; consumer c waits on it before its next tile's MMAs.
            **(dict(mma_turn=plgpu.Barrier(num_arrivals=1, num_barriers=2)) if ring.turns else {}),
            collective_axes="wg", **em.scratch_types(ldt, copies=2))
        def _scope(a_smem, b_smem, full, free, mma_turn=None, **scr):
            wg = lax.axis_index("wg")
            stage_ring = _StageRing(a_smem, b_smem, full, free, mma_turn)
            total = my_tiles * ring.k_iters  # the CTA's K steps, over all its tiles

            @pl.when(wg == 2)
            def _producer():
                _ring_producer(ring, em, stage_ring, a_gmem, b_gmem, sm, my_tiles, total)

            @pl.when(wg < 2)
            def _consumer():
                _ring_consumer(ring, em, stage_ring, sm, my_tiles, wg, load_refs, out_refs, scr, n_bar)

        plgpu.wait_smem_to_gmem(0)

    return body


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The static geometry of the ring kernel (:func:`_ring_body`) for one shape and config."""

    shape: KernelShape
    cfg: TuningConfig
    coop: bool  # both consumers on every CTA tile (delay_release), else ping-pong
    turns: bool  # ping-pong consumers take turns on the tensor cores
    cta_m: int
    cta_n: int
    grid_m: int  # tiles of the cluster along M
    grid_n: int
    k_iters: int
    n_tiles: int
    n_programs: int  # CTAs (cluster leaders' count times the cluster)
    stages: int
    a_block: tuple[int, int]
    b_block: tuple[int, int]
    a_shared: str | None  # the multicast axis of A's (B's) load, with a cluster along N (M)
    b_shared: str | None

    @staticmethod
    def of(shape: KernelShape, cfg: TuningConfig, skip_gemm: bool = False) -> _Ring:
        """``skip_gemm``: no K step at all (an epilogue pass under TuningConfig.skip_pass_gemm)."""
        cta_m, cta_n = cfg.cta_tile()
        cl_m, cl_n = cfg.cluster_tile()
        grid_m, grid_n = shape.m // cl_m, shape.n // cl_n
        a_block, b_block = _specs(shape, cfg, cta_m, cta_n)
        return _Ring(shape=shape, cfg=cfg, coop=not cfg.pingpong, turns=cfg.pingpong and cfg.pingpong_turns,
                     cta_m=cta_m, cta_n=cta_n, grid_m=grid_m, grid_n=grid_n,
                     k_iters=0 if skip_gemm else shape.k // cfg.tile_k,
                     n_tiles=grid_m * grid_n, n_programs=shape.num_sms // _cluster_size(cfg),
                     stages=cfg.max_concurrent_steps, a_block=tuple(a_block), b_block=tuple(b_block),
                     a_shared="cluster" if cfg.cluster_dimension == "n" else None,
                     b_shared="cluster" if cfg.cluster_dimension == "m" else None)

    def tile_origin(self, i, sm):
        """(mi, ni) of this CTA's ``i``-th CTA tile (its half of the cluster's tile)."""
        mi, ni = _tile_order(sm + i * self.n_programs, self.grid_m, self.grid_n, self.cfg)
        if self.cfg.cluster_dimension == "m":
            mi = 2 * mi + lax.axis_index("cluster")
        elif self.cfg.cluster_dimension == "n":
            ni = 2 * ni + lax.axis_index("cluster")
        return mi, ni


@dataclasses.dataclass(frozen=True)
class _StageRing:
    """The ring's SMEM stages and barriers: ``a_smem`` / ``b_smem`` ``[stages, block]``,
    ``full`` (loads arrived: ``[stage]``, or ``[consumer * stages + stage]`` in ping-pong),
    ``free`` (the stage's readers are done), ``mma_turn`` (ping-pong turns, or None)."""

    a_smem: Any
    b_smem: Any
    full: Any
    free: Any
    mma_turn: Any = None


def _ring_producer(ring: _Ring, em: _EpilogueEmitter, st: _StageRing, a_gmem, b_gmem, sm, my_tiles,
                   total) -> None:
    """The producer warpgroup: every K step of every CTA tile, in order, through one ring of
    stages. Step ``t`` goes into stage ``t % stages`` once its previous users released it
    (``free``), and arrives on its owner's ``full`` barrier (the tile's consumer in ping-pong,
    both consumers' shared barrier in the cooperative kernel). Then it waits for the last
    stages' releases, so that every phase of ``free`` is waited on."""
    plgpu.set_max_registers(_PRODUCER_REGS, action="decrease")
    tk, stages = ring.cfg.tile_k, ring.stages
    ta, tb = ring.shape.transpose_a, ring.shape.transpose_b
    cta_m, cta_n = ring.cta_m, ring.cta_n

    @pl.loop(0, my_tiles)
    def _tile(i):
        mi, ni = ring.tile_origin(i, sm)
        owner = 0 if ring.coop else lax.rem(i, 2)

        @pl.loop(0, ring.k_iters)
        def _k(kk):
            step = i * ring.k_iters + kk
            slot = lax.rem(step, stages)

            @pl.when(step >= stages)
            def _():
                with em.scope("free_wait"):
                    plgpu.barrier_wait(st.free.at[slot])

            a_src = (a_gmem.at[pl.ds(kk * tk, tk), pl.ds(mi * cta_m, cta_m)] if ta
                     else a_gmem.at[pl.ds(mi * cta_m, cta_m), pl.ds(kk * tk, tk)])
            b_src = (b_gmem.at[pl.ds(ni * cta_n, cta_n), pl.ds(kk * tk, tk)] if tb
                     else b_gmem.at[pl.ds(kk * tk, tk), pl.ds(ni * cta_n, cta_n)])
            bar = st.full.at[owner * stages + slot]
            plgpu.copy_gmem_to_smem(a_src, st.a_smem.at[slot], bar, collective_axes=ring.a_shared)
            plgpu.copy_gmem_to_smem(b_src, st.b_smem.at[slot], bar, collective_axes=ring.b_shared)

    # The last stages' releases (of ``total`` steps): every phase of ``free`` is waited on.
    @pl.loop(lax.max(total - stages, 0), total)
    def _drain(step):
        plgpu.barrier_wait(st.free.at[lax.rem(step, stages)])


def _ring_mainloop(ring: _Ring, em: _EpilogueEmitter, st: _StageRing, i, wg, full_base) -> jax.Array:
    """One consumer's MMAs of CTA tile ``i`` over K: wait for each step's stage (``full``),
    issue its wgmma, and release the previous step's stage once that step's MMAs are done
    (``wgmma_wait(1)``: one step stays in flight, so the tensor cores do not drain between
    steps); the tile's last stage is released after ``wgmma_wait(0)``. Returns the
    accumulated tile (promoted: :func:`_promoted_groups`). ``full_base``: this consumer's
    first ``full`` barrier."""
    stages = ring.stages

    def group(acc_ref, first, steps):
        @pl.loop(0, steps)
        def _k(j):
            kk = first + j
            step = i * ring.k_iters + kk
            slot = lax.rem(step, stages)
            with em.scope("full_wait"):
                plgpu.barrier_wait(st.full.at[full_base + slot])
            a, b = st.a_smem.at[slot], st.b_smem.at[slot]
            plgpu.wgmma(acc_ref, *(_consumer_operands(a, b, ring.shape, ring.cfg, wg) if ring.coop
                                   else _as_operands(a, b, ring.shape)))
            plgpu.wgmma_wait(1)  # step - 1's MMA is done: its stage can be refilled

            @pl.when(kk > 0)
            def _():
                plgpu.barrier_arrive(st.free.at[lax.rem(step - 1 + stages, stages)])

        plgpu.wgmma_wait(0)

    tm, tn = ring.cfg.tile_m, ring.cfg.tile_n
    if not ring.k_iters:  # an epilogue pass without its GEMM: the accumulator stays zero, no stage used
        return plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), _WG)
    acc = _promoted_groups(ring.k_iters, ring.shape.promote_steps(ring.cfg.tile_k), tm, tn, group)
    plgpu.barrier_arrive(st.free.at[lax.rem(i * ring.k_iters + ring.k_iters - 1, stages)])
    return acc


def _ring_consumer(ring: _Ring, em: _EpilogueEmitter, st: _StageRing, sm, my_tiles, wg, load_refs, out_refs,
                   scr, n_bar: int) -> None:
    """A consumer warpgroup's tiles: ping-pong, tiles ``i = 2j + wg`` (whole ``[tm, tn]``
    tiles, taking turns on the tensor cores with ``ring.turns``); cooperative, every tile
    ``i = j`` (its half). For each: the epilogue's tile loads prefetched, the mainloop
    (:func:`_ring_mainloop`), then the epilogue (:meth:`_EpilogueEmitter.emit`)."""
    cfg, coop = ring.cfg, ring.coop
    tm, tn = cfg.tile_m, cfg.tile_n
    plgpu.set_max_registers(_CONSUMER_REGS, action="increase")
    mine = {k: (v if k == "barrier" else v.at[wg]) for k, v in scr.items()}

    # Ping-pong: this consumer's tiles i = 2j + wg; cooperative: every tile i = j.
    @pl.loop(0, my_tiles if coop else lax.div(my_tiles - wg + 1, 2))
    def _tile(j):
        i = j if coop else 2 * j + wg
        mi, ni = ring.tile_origin(i, sm)
        m0, n0, mi_c, ni_c = _consumer_tile(cfg, mi, ni, wg) if coop else (mi * tm, ni * tn, mi, ni)
        step_base = j * len(em.chunks)  # epilogue chunks this consumer did before
        # The epilogue's tile loads stream in while the MMAs run (the first ones from the tile
        # before, with em.cross_tile).
        pre = em.prefetch(m0, n0, load_refs, mine, barrier_base=wg * n_bar, step_base=step_base, carried=j > 0)
        next_tile = None
        if em.cross_tile:  # this consumer's next tile: i + 1 (cooperative) or i + 2 (ping-pong)
            i_next = i + (1 if coop else 2)
            mi_n, ni_n = ring.tile_origin(i_next, sm)
            m0_n, n0_n = (_consumer_tile(cfg, mi_n, ni_n, wg)[:2] if coop else (mi_n * tm, ni_n * tn))
            next_tile = (m0_n, n0_n, i_next < my_tiles)
        full_base = 0 if coop else wg * ring.stages

        if ring.turns:  # the other consumer's MMAs of the tile before are done (consumer 0 opens)
            @pl.when(jnp.logical_or(wg == 1, j > 0))
            def _():
                with em.scope("turn_wait"):
                    plgpu.barrier_wait(st.mma_turn.at[wg])

        with em.scope("mainloop"):
            acc = _ring_mainloop(ring, em, st, i, wg, full_base)
        if ring.turns:  # the CTA's next tile, if any, is the other consumer's: its turn
            @pl.when(i + 1 < my_tiles)
            def _():
                plgpu.barrier_arrive(st.mma_turn.at[1 - wg])
        with em.scope("epilogue"):
            em.emit(acc, m0, n0, mi_c, ni_c, lax.rem(j, 2), load_refs, out_refs, mine,
                    barrier_base=wg * n_bar, step_base=step_base, prefetched=pre, next_tile=next_tile)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the staging dies with this scope


# SMEM scratch of one consumer's column sums (TuningConfig.consumer_col_sums): Mosaic GPU's
# cross-warp reduction needs 1 KiB a register of the reduced row (4 warps x 32 lanes x 2
# float32); 4 KiB reduce a chunk of up to 32 columns in one round.
COL_SUM_SCRATCH = 4096


def _consumer_col_sum(x: jax.Array, scratch) -> jax.Array:
    """``x.sum(axis=0)`` (``[tm, w]`` WGMMA layout -> ``[w]``) reduced across the warpgroup's
    warps through ``scratch`` (this consumer's float32 SMEM), not the scratch Pallas shares
    among every reduction of the kernel."""

    @plgpu.inline_mgpu(arg_types=(_WG, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((x.shape[1],), jnp.float32, layout=_COL))
    def col_sum(ctx, v, ref):
        del ctx
        return v.reduce("add", 0, scratch=ref)

    return col_sum(x, scratch)


_FOLD = 8  # columns of one WGMMA register group: a thread's pair in each of a row's 8-column groups


def _folded(x: jax.Array, op) -> jax.Array:
    """``x`` ``[tm, w]`` (WGMMA layout, ``w`` a multiple of 8) folded to ``[tm, 8]`` by ``op``
    over its 8-column groups: elementwise, within each thread's registers (no shuffles)."""
    parts = [x[:, c:c + _FOLD] for c in range(0, x.shape[1], _FOLD)]
    return functools.reduce(op, parts)


def _fp8_transposed(val: jax.Array) -> jax.Array:
    """``val`` (8-bit, WGMMA layout: a thread's two-element vectors run along a row) in the
    WGMMA_TRANSPOSED layout (its vectors run down a column), as Mosaic GPU relays 16-bit
    values, two vectors at a time. The lanes ``l`` and ``l ^ 4`` hold rows ``r`` and ``r + 1``
    of each 2 x 2 block: each thread packs two of its vectors into 32 bits ``[a0 a1 b0 b1]``,
    swaps them with that lane, and keeps ``[a0 a0' b0 b0']`` (row ``r``: column ``c`` of both
    rows) or ``[a1' a1 b1' b1]`` (row ``r + 1``: column ``c + 1``) with one byte permute."""
    @plgpu.inline_mgpu(arg_types=(_WG,), return_type=plgpu.ShapeDtypeStruct(val.shape, val.dtype, layout=_WG_T))
    def relayout(ctx, x):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        c = lambda v: arith.constant(i32, v)  # noqa: E731
        row_r = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(arith.divui(mu.thread_idx(), c(4)), c(2)), c(0))
        # prmt selectors (bytes 0-3: this lane's, 4-7: the other's), lowest result byte first.
        perm = arith.select(row_r, c(0x6240), c(0x3715))
        regs = list(x.registers.flat)
        assert all(ir.VectorType(r.type).shape == [2] for r in regs), regs[0].type
        v4 = ir.VectorType.get((4,), x.mlir_dtype)
        out = []
        for i in range(0, len(regs), 2):
            pair = regs[i:i + 2]
            packed = mu.bitcast(mu.vector_concat(pair if len(pair) == 2 else pair * 2), i32)
            mixed = mu.bitcast(mu.prmt(packed, mu.shfl_bfly(packed, 4), perm), v4)
            out += [mu.vector_slice(mixed, slice(0, 2)), mu.vector_slice(mixed, slice(2, 4))][:len(pair)]
        layout = mgpu.WGMMA_TRANSPOSED_LAYOUT
        return mgpu.FragmentedArray(_registers=np.asarray(out, dtype=object).reshape(layout.registers_shape(x.shape)),
                                    _layout=layout, _is_signed=None)

    return relayout(val)


def _f32(v):
    return v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v


def _saturated(v, scale, dtype):
    """``v * scale`` clipped to ``dtype``'s finite range (float32): a quantizing output's
    value before its cast, as :func:`coda_jax.reference.quantize_tile` computes it."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(v * scale, -fmax, fmax)


def _col_ids(shape, col0):
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WG) + col0

