"""``PallasLowering``: the ``"pallas"`` backend's GemmLowering (validation, padding, caching).

Shape rules (documented fallback): M, N and K need not be tile multiples; the wrapper
zero-pads the operands and loads to tile multiples (a copy of the padded operands) and
slices the outputs, and the kernel masks padded rows/columns out of reductions and
log-sum-exps. Pair-mode epilogues need N to be a multiple of the pair block's width
(``2 * pair_block``, or ``pair_block`` with ``half_acc``; the op layer guarantees it). Operands must be bfloat16 or float16 (wgmma's 16-bit path);
float32 operands raise a ``TypeError`` that points at ``backend="xla"``.

FP8 (:meth:`PallasLowering.fp8_rule`): operands in ``float8_e4m3fn`` / ``float8_e5m2`` (mixed
allowed) run on the kernel where both are K-major (``a`` ``[M, K]``, ``b`` ``[N, K]``:
``transpose_b=True``), with the 16-bit configuration's ``tile_k`` doubled (the same bytes per
K step); other layouts go to XLA's FP8 GEMM. Quantizing outputs (:func:`coda_jax.epilogue.fp8_out`)
run on the kernel with any operands: the FP8 tile, its transposed copy ``[W, M]`` and its
amax partials, ``[(N / tile_n) * M]`` float32 (a row max of each consumer tile's columns, padding
masked).

Plain GEMMs (the identity epilogue: backward wgrad/dgrad GEMMs with nothing to fuse) go
to XLA's GEMM (cuBLAS) by default, which runs a bare GEMM faster than this kernel; the option
``routing.plain_gemm="kernel"`` (or ``plain_gemm="kernel"``) keeps them here. Which GEMMs go
to XLA and why: :func:`coda_jax.lowering.routes_to_xla`, docs/performance.md#routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import FP8_DTYPES, Epilogue, Load, LoadKind, default_out_dtype
from coda_jax.kernel_lowering import KernelLowering, pad_loads, pad_operands, slice_output
from coda_jax.lowering import gpu_sm_count, join_columns, load_parts, split_columns
from coda_jax.pallas.gemm_epilogue import (KernelShape, ProfileSettings, out_types, plan_epilogue, split_loads_fit,
                                          split_outputs_fit, tile_grid)
from coda_jax.pallas.interpret import ensure_interpreter_threads, interpret_enabled
from coda_jax.pallas.kernel_builder import compiled_kernel
from coda_jax.pallas.kernel_cache import active_kernel_cache
from coda_jax.pallas.kernel_calls import note_call
from coda_jax.pallas.tuned import loads_signature, tuned_config
from coda_jax.pallas.tuning import (CONFIG_TABLE, TuningConfig, choose_config, choose_fp8_config, fit_waves,
                                    for_fp8_operands)

# SM count used in interpret mode (the CPU interpreter simulates each CTA).
INTERPRET_SMS = 4


def _round_up(x: int, q: int) -> int:
    return -(-x // q) * q


def _num_sms(interpret: bool) -> int:
    """The GPU's SMs (the interpreter's :data:`INTERPRET_SMS`): what the tuned table is keyed by."""
    if interpret:
        return INTERPRET_SMS
    return gpu_sm_count()


def table_or_heuristic_config(epilogue: Epilogue, m: int, n: int, k: int, transpose_a: bool, transpose_b: bool,
                              device_kind: str | None, num_sms: int, *, fp8_operands: bool = False,
                              promote_k: int = 0, loads: Mapping[str, Any] | None = None) -> TuningConfig:
    """The configuration of an ``[m, k] @ [k, n]`` GEMM running ``epilogue`` on a GPU of
    ``device_kind`` with ``num_sms`` SMs: the tuned table's entry
    (:func:`coda_jax.pallas.tuned.tuned_config`; ``device_kind`` None: no table), else the
    heuristics (the shape class's entry with the program's changes, for FP8 operands those of
    :func:`~coda_jax.pallas.tuning.choose_fp8_config`, half-width tiles where they fill the
    persistent grid's waves better: :func:`fit_waves`), for FP8 operands with the K step
    doubled (:func:`~coda_jax.pallas.tuning.for_fp8_operands`; a table entry is taken as
    measured). ``promote_k``: the FP8 accumulator's promotion interval; only entries
    measured with it apply. ``loads``: the GEMM's loads (arrays, abstract values or dtypes by
    name), whose tile loads' dtypes an entry measured with them must share
    (:func:`~coda_jax.pallas.tuned.loads_signature`; None: only entries without a signature)."""
    pw = epilogue.pair_width if epilogue.pair_block is not None else None
    sig = None if loads is None else loads_signature(epilogue, loads)
    tuned = (tuned_config(epilogue.name, m, n, k, transpose_a, transpose_b, device_kind, num_sms, pw, promote_k, sig)
             if device_kind else None)
    if tuned:
        return tuned
    cfg = heuristic_config(epilogue, m, n, k, num_sms, fp8_operands=fp8_operands)
    return for_fp8_operands(cfg) if fp8_operands else cfg


def heuristic_config(epilogue: Epilogue, m: int, n: int, k: int, num_sms: int, *,
                     fp8_operands: bool = False) -> TuningConfig:
    """The heuristics' configuration of an ``[m, k] @ [k, n]`` GEMM running ``epilogue`` on
    ``num_sms`` SMs, wave fit included, with the K step of 16-bit operands (for FP8 operands
    :func:`~coda_jax.pallas.tuning.for_fp8_operands` doubles it, as
    :func:`table_or_heuristic_config` does)."""
    pw = epilogue.pair_width if epilogue.pair_block is not None else None
    return fit_waves(_heuristic_config(epilogue, m, n, k, fp8_operands), m, n, num_sms, pw)


def _heuristic_config(epilogue: Epilogue, m: int, n: int, k: int, fp8_operands: bool) -> TuningConfig:
    """The heuristics' configuration (before the wave fit and the FP8 K step)."""
    return choose_fp8_config(m, n, k, epilogue) if fp8_operands else choose_config(m, n, k, epilogue.name)


def kernel_load_dtype(load: Load, dtype: Any) -> jnp.dtype:
    """The dtype in which a load reaches the kernel: floating row and column loads as
    float32, tile and row-block loads (and integer ones) as given."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and load.kind not in (LoadKind.TILE, LoadKind.ROW_BLOCK):
        return jnp.dtype(jnp.float32)
    return dtype


def kernel_shape(epilogue: Epilogue, m: int, n: int, k: int, cfg: TuningConfig, transpose_a: bool,
                 transpose_b: bool, operand_dtype: Any, out_dtypes: Mapping[str, Any] | None,
                 num_sms: int, promote_k: int = 0) -> KernelShape:
    """The kernel's static shape for an ``[m, k] @ [k, n]`` GEMM under ``cfg``: sizes padded
    to the CTA tile (and K to ``tile_k``; a fallback kernel divides the tile too), each
    output's dtype (``out_dtypes``, else the epilogue's, else
    :func:`~coda_jax.epilogue.default_out_dtype`: the operands', bf16 for FP8 ones; a quantizing
    output's is always its FP8 dtype, as the reference writes it), ``num_sms`` CTAs in the
    persistent grid, ``promote_k`` (FP8 operands; see :class:`coda_jax.lowering.GemmLowering`)."""
    m_quantum, n_quantum = cfg.cta_tile()
    dtypes = tuple((o.name, jnp.dtype(o.dtype if o.quantize is not None
                                      else (out_dtypes or {}).get(o.name, o.dtype) or default_out_dtype(operand_dtype)))
                   for o in epilogue.outputs)
    return KernelShape(m=_round_up(m, m_quantum), n=_round_up(n, n_quantum), k=_round_up(k, cfg.tile_k),
                       m_real=m, n_real=n, transpose_a=transpose_a, transpose_b=transpose_b,
                       operand_dtype=jnp.dtype(operand_dtype), out_dtypes=dtypes, num_sms=num_sms,
                       promote_k=promote_k)


def _default_device():
    return jax.local_devices()[0]


def _pair_rule(tile_n: int) -> str:
    return f"must divide the Pallas kernel's {tile_n}-column tile"


class PallasLowering(KernelLowering):
    """Runs GEMM-epilogue programs as Pallas Mosaic-GPU Hopper kernels.

    Args:
      config: one :class:`TuningConfig` for every GEMM (default ``None``: the tuned table's
        entry for each GEMM on this GPU, else the heuristics: :meth:`default_config`).
      tiles_per_cta: ``0`` (default) keeps the persistent grid (one CTA, or CTA pair, per SM,
        each walking its share of the output tiles); ``N > 0`` launches one CTA (pair) per
        ``N`` output tiles instead, so the GPU hands tiles to whichever SMs are free (for
        GEMMs that share the GPU with kernels on other streams).
      profile: record each kernel's timeline (:class:`ProfileSettings`; debugging only).
      plain_gemm, latency_hints, reserved_sms: see :class:`~coda_jax.kernel_lowering.KernelLowering`.
    """

    name = "pallas"
    title = "Pallas"

    def __init__(self, config: TuningConfig | None = None, *, tiles_per_cta: int = 0,
                 profile: ProfileSettings | None = None, plain_gemm: str | None = None,
                 latency_hints: bool = False, reserved_sms: int = 0):
        super().__init__(plain_gemm=plain_gemm, latency_hints=latency_hints, reserved_sms=reserved_sms)
        if not isinstance(tiles_per_cta, int) or isinstance(tiles_per_cta, bool) or tiles_per_cta < 0:
            raise ValueError(f"tiles_per_cta must be a non-negative integer, got {tiles_per_cta!r}")
        self.config = config
        self.tiles_per_cta = tiles_per_cta
        self.profile = profile

    def pair_width_rule(self, width: int) -> str | None:
        """Why a pair-mode epilogue ``width`` columns wide (RoPE: head_dim; SwiGLU: 128)
        cannot run here, or None: it must divide the tile width of every configuration
        this lowering may pick (its ``config``, else the table's)."""
        tiles = {self.config.tile_n} if self.config else {c.tile_n for c in CONFIG_TABLE.values()}
        bad = sorted(t for t in tiles if t % width)
        return _pair_rule(bad[0]) if bad else None

    @staticmethod
    def default_config(epilogue: Epilogue, m: int, n: int, k: int, transpose_a: bool, transpose_b: bool,
                       interpret: bool, *, fp8_operands: bool = False, promote_k: int = 0,
                       loads: Mapping[str, Any] | None = None) -> TuningConfig:
        """The configuration of a GEMM when none was given: the measured one for this GPU
        (:func:`coda_jax.pallas.tuned.tuned_config`), else the heuristics (the shape-class
        table, the ping-pong programs, the wave fit; with ``fp8_operands``, ``tile_k``
        doubled: :func:`~coda_jax.pallas.tuning.for_fp8_operands`). The interpreter uses the
        heuristics alone: its 4 "SMs" say nothing about waves. ``loads``: the GEMM's loads, whose
        tile loads' dtypes pick among entries measured with different ones."""
        if interpret:
            cfg = _heuristic_config(epilogue, m, n, k, fp8_operands)
            return for_fp8_operands(cfg) if fp8_operands else cfg
        dev = _default_device()
        kind = dev.device_kind if dev.platform == "gpu" else None
        return table_or_heuristic_config(epilogue, m, n, k, transpose_a, transpose_b, kind, _num_sms(False),
                                         fp8_operands=fp8_operands, promote_k=promote_k, loads=loads)

    def fp8_rule(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, transpose_a: bool,
                 transpose_b: bool) -> str | None:
        """Why the Pallas kernel cannot run this FP8 GEMM, or None where it can (see
        :meth:`coda_jax.kernel_lowering.KernelLowering.fp8_rule`).

        FP8 operands (``float8_e4m3fn`` / ``float8_e5m2``, mixed allowed) must both be
        K-major, as Hopper's 8-bit wgmma reads them from SMEM (it has no transposed 8-bit
        operands: Mosaic GPU refuses the other layouts when it lowers the kernel): ``a`` ``[M, K]``
        (``transpose_a=False``) and ``b`` ``[N, K]`` (``transpose_b=True``). Quantizing outputs
        (:func:`coda_jax.epilogue.fp8_out`: the FP8 tile, its transposed copy, its amax) run
        in every kernel, pair mode and split outputs included (a split quantizing output is
        written whole and sliced by XLA)."""
        if a.dtype in FP8_DTYPES and (transpose_a or not transpose_b):
            got = f"a {'[K, M]' if transpose_a else '[M, K]'}, b {'[N, K]' if transpose_b else '[K, N]'}"
            return ("FP8 operands must both be K-major (Hopper's 8-bit wgmma): the Pallas kernel takes FP8 a as "
                    f"[M, K] (transpose_a=False) and b as [N, K] (transpose_b=True), got {got}")
        return None

    def kernel_gemm(self, epilogue: Epilogue, a: jax.Array, b: jax.Array, loads: Mapping[str, jax.Array],
                    dims: tuple[int, int, int], *, transpose_a: bool, transpose_b: bool,
                    out_dtypes: Mapping[str, Any] | None,
                    out_splits: dict[str, tuple[int, ...]], promote_k: int = 0) -> dict[str, Any]:
        """See :class:`coda_jax.lowering.GemmLowering`. A split output is written as one array
        per part where :func:`~coda_jax.pallas.gemm_epilogue.split_outputs_fit` (N a multiple
        of the tile, part boundaries multiples of the epilogue's chunk width: 64 columns
        always fit, and in pair mode multiples of the pair width), else written whole and
        sliced by XLA (a quantizing output always); a load given as column parts is read from
        its parts under the same rule with staged loads (:func:`~coda_jax.pallas.gemm_epilogue.split_loads_fit`),
        else joined first. FP8 operands run the heuristic configuration
        of 16-bit ones with ``tile_k`` doubled (:meth:`default_config`); a ``config`` given to
        the lowering is used as given. ``promote_k``: the mainloop promotes the FP8 accumulator
        every ``promote_k`` K elements (rounded down to the K step, at least one), on a
        consumer tile halved to :data:`~coda_jax.pallas.gemm_epilogue.PROMOTED_TILE_ELEMS`."""
        m, n, k = dims
        interpret = interpret_enabled()
        if interpret:
            ensure_interpreter_threads()  # warns if the CPU pool is too small (a hang)
        note_call(epilogue, a, b, loads, transpose_a, transpose_b, out_dtypes, (m, n, k), promote_k)
        cfg = self.config
        if cfg is None:
            cfg = self.default_config(epilogue, m, n, k, transpose_a, transpose_b, interpret,
                                      fp8_operands=a.dtype in FP8_DTYPES, promote_k=promote_k, loads=loads)
        if epilogue.pair_block is not None and cfg.tile_n % epilogue.pair_width:
            raise ValueError(f"epilogue {epilogue.name!r}: the pair block's width {epilogue.pair_width} "
                             f"{_pair_rule(cfg.tile_n)} (tile_n={cfg.tile_n})")
        shape = kernel_shape(epilogue, m, n, k, cfg, transpose_a, transpose_b, a.dtype, out_dtypes,
                             self.grid_sms(_num_sms(interpret)), promote_k)
        mp, np_, kp = shape.m, shape.n, shape.k
        a_p, b_p = pad_operands(a, b, mp, np_, kp, transpose_a, transpose_b)
        # Loads given as column parts: read where they are if N is unpadded and the plan's
        # chunks allow (split_loads_fit, below), else joined.
        parts = load_parts(loads) if np_ == n else {}
        loads = join_columns(loads, keep=parts)
        cast = lambda l, v: v.astype(kernel_load_dtype(l, v.dtype))  # noqa: E731
        args = [tuple(cast(l, p) for p in v) if isinstance(v, tuple) else cast(l, v)
                for l, v in zip(epilogue.loads, pad_loads(epilogue, loads, m, n, mp, np_))]
        load_dtypes = tuple((l.name, jnp.dtype((v[0] if isinstance(v, tuple) else v).dtype))
                            for l, v in zip(epilogue.loads, args))
        # From here on, the epilogue that runs: a column sum may be written as its summand
        # tile, whose [M, N] slice is the contract's [P, N] partials with P = M.
        epilogue, cfg = plan_epilogue(epilogue, shape, cfg, load_dtypes)
        native = out_splits if out_splits and split_outputs_fit(epilogue, shape, cfg, out_splits) else {}
        native = {name: w for name, w in native.items() if epilogue.output(name).quantize is None}
        native_loads = parts if parts and split_loads_fit(epilogue, shape, cfg, parts) else {}
        args = [jnp.concatenate(v, axis=1) if isinstance(v, tuple) and l.name not in native_loads else v
                for l, v in zip(epilogue.loads, args)]
        args = [p for v in args for p in (v if isinstance(v, tuple) else (v,))]
        shape = dataclasses.replace(shape, out_splits=tuple(native.items()), load_splits=tuple(native_loads.items()))
        shape = tile_grid(shape, cfg, self.tiles_per_cta)  # tiles_per_cta > 0: a grid of tiles, not SMs
        hint = None if interpret else self.latency_hint(mp, np_, kp, (a_p, b_p, *args, *out_types(epilogue, shape, cfg)))
        profile = None if interpret else self.profile
        kernel = compiled_kernel(epilogue, shape, cfg, interpret, load_dtypes, hint, profile)
        # A profiled kernel calls back to the host: never exported to (or read from) the cache.
        cache = None if interpret or profile else active_kernel_cache()
        if cache is not None:  # the kernel's Mosaic GPU module from disk (kernel_cache.py)
            kernel = cache.callable_for(kernel, (epilogue, shape, cfg, load_dtypes, hint), (a_p, b_p, *args))
        # A kernel is one compiled unit, also under jax.disable_jit() (its Pallas body cannot
        # be traced op by op: Mosaic GPU's pipeline needs its fori_loop traced).
        with jax.disable_jit(False):
            res = kernel(a_p, b_p, *args)
        out, res = {}, iter(res)
        for o in epilogue.outputs:
            if o.name in native:
                out[o.name] = tuple(next(res)[:m] for _ in native[o.name])
            else:
                out[o.name] = slice_output(epilogue, o.name, next(res), m, n)
            if o.quantize is not None and o.quantize.transpose:  # [W, M] copy: padding cut off both axes
                out[f"{o.name}_t"] = next(res)[:epilogue.width(n, o.half), :m]
            if o.quantize is not None and o.quantize.amax:  # [N / tile_n, M] row maxes, padded rows cut off
                out[f"{o.name}_amax"] = next(res)[:, :m].reshape(-1)
        return split_columns(out, {k: v for k, v in out_splits.items() if k not in native})


PALLAS = PallasLowering()
