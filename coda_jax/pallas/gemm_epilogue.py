"""The Pallas Mosaic-GPU Hopper GEMM with a lowered epilogue program.

Mainloop: persistent CTAs (one per SM) walk the output tiles in planar-snake order; per
tile, ``plgpu.emit_pipeline`` streams ``[tile_m, tile_k]`` / ``[tile_k, tile_n]`` operand
blocks into swizzled SMEM with TMA, ``max_concurrent_steps`` deep, feeding ``wgmma`` into a
float32 register accumulator. Transposed operands (``[K, M]`` A for wgrad, ``[N, K]`` B
for dgrad and the LM head) are read as transposed SMEM views; no copy.

Epilogue: the accumulator tile is cut into *chunks* (64 columns, or one ``2*b`` pair block
in pair mode) and the epilogue body (the same function the reference backend runs) is
called on each chunk with its loads already broadcast to the chunk's shape:

* row vectors load from GMEM in the ``WGMMA.reduce(1)`` layout, column vectors in
  ``WGMMA.reduce(0)``, tiles through TMA into SMEM;
* tile outputs go to SMEM and back to GMEM with TMA, one store per chunk;
* row sums accumulate across chunks in registers and are stored as one ``[tile_m]`` row
  of the ``[n_tiles, M]`` partials; column sums as ``[tile_n]`` rows of ``[m_tiles, N]``;
* the row log-sum-exp keeps an online (max, sum-exp) across chunks and stores the tile's
  LSE; logits never reach memory.

The wrapper (:mod:`coda_jax.pallas.lowering`) pads M, N and K to tile multiples; padded
columns and rows are masked out of reductions and LSEs here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from coda_jax.epilogue import Epilogue, LoadKind, OutputKind
from coda_jax.pallas.tuning import TuningConfig

_WG = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)
_COL = plgpu.Layout.WGMMA.reduce(0)


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
    operand_dtype: Any
    out_dtypes: tuple[tuple[str, Any], ...]
    num_sms: int


def _transforms(minor_elems: int, dtype) -> tuple:
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _chunks(epi: Epilogue, tile_n: int) -> list[tuple[int, int]]:
    """(first column, width) of each epilogue chunk of a tile."""
    w = 2 * epi.pair_block if epi.pair_block is not None else min(64, tile_n)
    return [(c, w) for c in range(0, tile_n, w)]


class _TileContext:
    """EpilogueContext of one register chunk."""

    def __init__(self, col0, shape):
        self._col0 = col0
        self._shape = shape

    def row_sum(self, x):
        return lax.broadcast_in_dim(x.sum(axis=1), x.shape, [0])

    def col_index(self):
        return plgpu.broadcasted_iota(jnp.int32, self._shape, 1, layout=_WG) + self._col0


def out_types(epi: Epilogue, shape: KernelShape, cfg: TuningConfig) -> list[jax.ShapeDtypeStruct]:
    dt = dict(shape.out_dtypes)
    res = []
    for o in epi.outputs:
        if o.kind is OutputKind.TILE:
            res.append(jax.ShapeDtypeStruct((shape.m, shape.n // 2 if o.half else shape.n), dt[o.name]))
        elif o.kind is OutputKind.COL_SUM:
            res.append(jax.ShapeDtypeStruct((shape.m // cfg.tile_m, shape.n), jnp.float32))
        else:  # ROW_SUM, ROW_LOGSUMEXP
            res.append(jax.ShapeDtypeStruct((shape.n // cfg.tile_n, shape.m), jnp.float32))
    return res


def build_kernel(epi: Epilogue, shape: KernelShape, cfg: TuningConfig, interpret: bool):
    """A callable ``(a, b, *loads) -> outputs`` (outputs in ``epi.outputs`` order)."""
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    grid_m, grid_n, k_iters = shape.m // tm, shape.n // tn, shape.k // tk
    b = epi.pair_block
    chunks = _chunks(epi, tn)
    dt = dict(shape.out_dtypes)
    loads = epi.loads
    outs = epi.outputs
    tile_loads = [l for l in loads if l.kind is LoadKind.TILE]
    tile_outs = [o for o in outs if o.kind is OutputKind.TILE]
    row_outs = [o for o in outs if o.kind in (OutputKind.ROW_SUM, OutputKind.ROW_LOGSUMEXP)]
    col_outs = [o for o in outs if o.kind is OutputKind.COL_SUM]
    mask_cols = shape.n_real < shape.n
    mask_rows = shape.m_real < shape.m
    op_dtype = shape.operand_dtype

    a_block = (tk, tm) if shape.transpose_a else (tm, tk)
    b_block = (tn, tk) if shape.transpose_b else (tk, tn)

    def smem_for_chunks(dtype, width, half):
        return plgpu.SMEM((len(chunks), 2 if (b is not None and not half) else 1, tm, width), dtype)

    def body(a_gmem, b_gmem, *refs):
        load_refs = dict(zip([l.name for l in loads], refs[: len(loads)]))
        out_refs = dict(zip([o.name for o in outs], refs[len(loads):]))

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _tile_loop(info: plgpu.NDLoopInfo):
            mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n), 1, min(cfg.grid_tile_width, grid_n))
            m0 = mi * tm
            n0 = ni * tn

            def acc_scope(acc_ref):
                def step(_, a_smem, b_smem):
                    plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)) if shape.transpose_a else a_smem,
                                b_smem.transpose((1, 0)) if shape.transpose_b else b_smem)
                    plgpu.wgmma_wait(1)

                plgpu.emit_pipeline(
                    step,
                    grid=(k_iters,),
                    in_specs=[
                        plgpu.BlockSpec(a_block, (lambda kk: (kk, mi)) if shape.transpose_a else (lambda kk: (mi, kk)),
                                        transforms=_transforms(a_block[1], op_dtype), delay_release=1),
                        plgpu.BlockSpec(b_block, (lambda kk: (ni, kk)) if shape.transpose_b else (lambda kk: (kk, ni)),
                                        transforms=_transforms(b_block[1], op_dtype), delay_release=1),
                    ],
                    max_concurrent_steps=cfg.max_concurrent_steps,
                )(a_gmem, b_gmem)
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((tm, tn), jnp.float32))
            _epilogue(acc, m0, n0, mi, ni, load_refs, out_refs)

        plgpu.wait_smem_to_gmem(0)

    def _epilogue(acc, m0, n0, mi, ni, load_refs, out_refs):
        half_w = b if b is not None else None
        scratch = {}
        for l in tile_loads:
            w = half_w if l.half else (b if b is not None else chunks[0][1])
            scratch["in_" + l.name] = smem_for_chunks(load_refs[l.name].dtype, w, l.half)
        for o in tile_outs:
            w = half_w if o.half else (b if b is not None else chunks[0][1])
            scratch["out_" + o.name] = smem_for_chunks(dt[o.name], w, o.half)
        for o in row_outs:
            scratch["row_" + o.name] = plgpu.SMEM((tm,), jnp.float32)
        for o in col_outs:
            scratch["col_" + o.name] = plgpu.SMEM((len(chunks), 2 if b is not None else 1, half_w or chunks[0][1]),
                                                  jnp.float32)
        # One barrier per TMA copy of a tile load (each copy completes its own phase).
        copies = [(l, ci, p, gc, pw) for l in tile_loads for ci, (c0, w) in enumerate(chunks)
                  for p, (gc, pw) in enumerate(_parts(c0, w, n0, l.half))]
        if copies:
            scratch["barrier"] = plgpu.Barrier(num_barriers=len(copies))

        @functools.partial(pl.run_scoped, **scratch)
        def _scope(**s):
            m_slice = pl.ds(m0, tm)
            # Tile loads: one TMA per (load, chunk part), all in flight, then one wait each.
            for i, (l, ci, p, gc, pw) in enumerate(copies):
                plgpu.copy_gmem_to_smem(load_refs[l.name].at[m_slice, pl.ds(gc, pw)], s["in_" + l.name].at[ci, p],
                                        s["barrier"].at[i])
            for i in range(len(copies)):
                plgpu.barrier_wait(s["barrier"].at[i])

            # Row vectors: one load per tile, broadcast once to the chunk shape.
            shape_c0 = (tm, b) if b is not None else (tm, chunks[0][1])
            row_vals = {l.name: lax.broadcast_in_dim(_f32(plgpu.load(load_refs[l.name].at[m_slice], layout=_ROW,
                                                                      optimized=False)), shape_c0, [0])
                        for l in loads if l.kind is LoadKind.ROW}
            row_state: dict[str, Any] = {}
            col_half: dict[str, bool] = {}
            for ci, (c0, w) in enumerate(chunks):
                col0 = n0 + c0
                if b is None:
                    acc_c = acc[:, c0:c0 + w]
                    shape_c = (tm, w)
                else:
                    acc_c = (acc[:, c0:c0 + b], acc[:, c0 + b:c0 + w])
                    shape_c = (tm, b)
                kw = {}
                for l in loads:
                    ref = load_refs[l.name]
                    if l.kind is LoadKind.ROW:
                        kw[l.name] = row_vals[l.name]
                    elif l.kind is LoadKind.COL:
                        vs = [lax.broadcast_in_dim(_f32(plgpu.load(ref.at[pl.ds(gc, pw)], layout=_COL, optimized=False)),
                                                   shape_c, [1]) for gc, pw in _parts(c0, w, n0, l.half, b)]
                        kw[l.name] = vs[0] if len(vs) == 1 else tuple(vs)
                    elif l.kind is LoadKind.TILE:
                        sm = s["in_" + l.name]
                        vs = [_f32(plgpu.load(sm.at[ci, p], layout=_WG, optimized=False))
                              for p in range(len(_parts(c0, w, n0, l.half)))]
                        kw[l.name] = vs[0] if len(vs) == 1 else tuple(vs)
                    else:
                        raise NotImplementedError(
                            f"epilogue {epi.name!r}: scalar loads are not supported by the Pallas backend; "
                            "pass the scalar as a row vector")
                ctx = _TileContext(col0, shape_c)
                res = epi.body(acc_c, ctx, **kw)
                for o in outs:
                    v = res[o.name]
                    if o.kind is OutputKind.TILE:
                        sm = s["out_" + o.name]
                        for p, part in enumerate(v if isinstance(v, tuple) else (v,)):
                            sm[ci, p] = part.astype(dt[o.name])
                    elif o.kind is OutputKind.ROW_SUM:
                        tot = None
                        for p, part in enumerate(v if isinstance(v, tuple) else (v,)):
                            if mask_cols:
                                # pair mode: padding is whole blocks, so the block's first column decides
                                part = jnp.where(_col_ids(shape_c, col0) < shape.n_real, part, 0.0)
                            r = part.sum(axis=1)
                            tot = r if tot is None else tot + r
                        row_state[o.name] = tot if o.name not in row_state else row_state[o.name] + tot
                    elif o.kind is OutputKind.ROW_LOGSUMEXP:
                        if b is not None:
                            raise NotImplementedError("row_logsumexp in pair mode is not supported")
                        x = v
                        if mask_cols:
                            x = jnp.where(_col_ids(shape_c, col0) < shape.n_real, x, -jnp.inf)
                        cm = x.max(axis=1)
                        if o.name in row_state:
                            mx, se = row_state[o.name]
                            nm = jnp.maximum(mx, cm)
                            se = se * jnp.exp(mx - nm) + jnp.exp(x - lax.broadcast_in_dim(nm, shape_c, [0])).sum(axis=1)
                            row_state[o.name] = (nm, se)
                        else:
                            row_state[o.name] = (cm, jnp.exp(x - lax.broadcast_in_dim(cm, shape_c, [0])).sum(axis=1))
                    else:  # COL_SUM
                        sm = s["col_" + o.name]
                        col_half[o.name] = b is not None and not isinstance(v, tuple)
                        for p, part in enumerate(v if isinstance(v, tuple) else (v,)):
                            if mask_rows:
                                rows = plgpu.broadcasted_iota(jnp.int32, shape_c, 0, layout=_WG) + m0
                                part = jnp.where(rows < shape.m_real, part, 0.0)
                            sm[ci, p] = part.sum(axis=0)
            for o in row_outs:
                st = row_state[o.name]
                s["row_" + o.name][...] = st if o.kind is OutputKind.ROW_SUM else st[0] + jnp.log(st[1])
            plgpu.commit_smem()
            for o in tile_outs:
                sm = s["out_" + o.name]
                for ci, (c0, w) in enumerate(chunks):
                    for p, (gc, pw) in enumerate(_parts(c0, w, n0, o.half)):
                        plgpu.copy_smem_to_gmem(sm.at[ci, p], out_refs[o.name].at[m_slice, pl.ds(gc, pw)])
            for o in row_outs:
                plgpu.copy_smem_to_gmem(s["row_" + o.name], out_refs[o.name].at[ni, m_slice])
            for o in col_outs:
                sm = s["col_" + o.name]
                for ci, (c0, w) in enumerate(chunks):
                    for p, (gc, pw) in enumerate(_parts(c0, w, n0, col_half[o.name])):
                        plgpu.copy_smem_to_gmem(sm.at[ci, p], out_refs[o.name].at[mi, pl.ds(gc, pw)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def _parts(c0, w, n0, half, _b=None):
        """GMEM (first column, width) of a chunk's pieces for a full or half-width array."""
        if b is None:
            return [(n0 + c0, w)]
        if half:  # one column per pair: block j of the tile maps to columns [n0/2 + c0/2, +b)
            return [(n0 // 2 + c0 // 2, b)]
        return [(n0 + c0, b), (n0 + c0 + b, b)]

    kernel = plgpu.kernel(
        body,
        out_type=out_types(epi, shape, cfg),
        grid=(shape.num_sms,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=False),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel


def _f32(v):
    return v.astype(jnp.float32) if jnp.issubdtype(v.dtype, jnp.floating) else v


def _col_ids(shape, col0):
    return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=_WG) + col0

