"""The backend-neutral epilogue spec: CODA's five primitive kinds as a declaration.

An :class:`Epilogue` says what a GEMM epilogue *loads* (per-row vectors, per-column
vectors, scalars, a second ``[M, N]`` tile), what it *outputs* (extra tiles), what it
*reduces* (per-row sums over the N-tile, per-column sums over the M-tile, an online
row log-sum-exp across N-tiles) and a small *body* of math over the float32
accumulator. Every backend lowers the same declaration:

* the reference backend (:mod:`coda_jax.reference`) runs the body on whole arrays;
* the Pallas backend (:mod:`coda_jax.pallas`) runs it on each accumulator sub-tile
  of its Hopper GEMM, in registers;
* the CuTeDSL backend (:mod:`coda_jax.ffi`) lowers it into its own GEMM.

The body contract
-----------------
``body(acc, ctx, **loads) -> dict[str, jax.Array]``

* ``acc`` is the float32 accumulator ``A @ B`` of the region being processed; in pair
  mode (``pair_block=b``) it is a tuple ``(lo, hi)``: the columns of every ``2*b``-wide
  block split into its first and second half (SwiGLU's gate/up, RoPE's rotate-half).
* ``loads`` are already broadcastable against ``acc`` (a row vector arrives with a
  trailing unit axis, a column vector with a leading one); tiles arrive with ``acc``'s
  shape. All floating loads arrive as float32. In pair mode, column and tile loads
  arrive as ``(lo, hi)`` like the accumulator, unless declared ``half=True`` (one value
  per pair: ``[N/2]`` / ``[M, N/2]`` in memory, one array in the body).
* With ``half_acc=True`` (pair mode whose *accumulator* has one column per pair: a
  backward GEMM whose output is the gradient of a half-width activation), ``acc`` is one
  array, ``half=True`` loads/outputs have the accumulator's width ``N``, and full-width
  ones are ``[M, 2N]`` in the pair layout and arrive / are returned as ``(lo, hi)``.
* ``ctx`` (:class:`EpilogueContext`) gives the few operations whose implementation
  differs between "whole array" and "register tile": ``ctx.row_sum`` (a keep-dims sum
  over the columns of the current pair block) and ``ctx.col_index`` (global column ids).
* The body returns one value per declared output: the tile for a ``tile`` output, the
  summand for ``row_sum`` / ``col_sum`` (the backend reduces and masks padding), the
  logits for ``row_logsumexp``.

Quantizing outputs (FP8)
------------------------
A tile output declared with ``quantize=`` (:func:`fp8_out`) is stored as FP8 with a
per-tensor scale: the body returns the unscaled float32 tile ``v`` as for any tile output,
and the backend writes ``saturate(v * scale)`` cast to the output's FP8 dtype (``scale`` a
scalar load, chosen before the GEMM runs: delayed scaling). While the tile is on chip it
may also write the transposed copy (``{name}_t``, ``[N, M]``: the K-major operand that the
backward's FP8 GEMMs read, since Hopper's FP8 wgmma takes both operands K-major) and reduce
``max|v|`` (``{name}_amax``, float32 partials ``[P]`` whose max is the tensor's amax, the
next step's scale). An FP8 GEMM whose operands carry scales runs a program made by
:func:`dequantized`: its accumulator is multiplied by the scalar ``acc_scale`` (the
product of the operands' inverse scales) before the body sees it.

The body must be pure ``jnp`` math: elementwise ops, ``where``, ``exp``/``log``/``rsqrt``,
casts. No reshapes, no cross-column ops other than through ``ctx``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

__all__ = [
    "LoadKind",
    "OutputKind",
    "Load",
    "Output",
    "Epilogue",
    "EpilogueContext",
    "row",
    "col",
    "scalar",
    "tile",
    "tile_out",
    "row_sum",
    "col_sum",
    "row_logsumexp",
    "row_block",
    "Quantize",
    "fp8_out",
    "FP8_DTYPES",
    "default_out_dtype",
    "saturate_cast",
    "dequantized",
    "unquantized",
    "body_uses_row_sum",
    "split_pairs",
    "join_pairs",
]


class LoadKind(enum.Enum):
    ROW = "row"  # [M] vector, one value per accumulator row (rstd, zdz, positions, targets)
    COL = "col"  # [N] vector, one value per accumulator column (gamma, RoPE frequencies)
    SCALAR = "scalar"  # [] scalar (alpha, loss scale)
    TILE = "tile"  # [M, N] matrix block (residual, saved pre-activation)
    # Pair mode only: [M, pair_block], one value per row and position inside a pair block,
    # the same for every block (RoPE's cos/sin per token and frequency: computed once per
    # token instead of once per head, and read from L2 instead of recomputed).
    ROW_BLOCK = "row_block"


class OutputKind(enum.Enum):
    TILE = "tile"  # [M, N] (or [M, N/2] in pair mode with half=True) extra tile output
    ROW_SUM = "row_sum"  # per-row sum over the N-tile, written as float32 partials
    COL_SUM = "col_sum"  # per-column sum over the M-tile, written as float32 partials
    ROW_LOGSUMEXP = "row_logsumexp"  # online row max / sum-exp across N-tiles


@dataclasses.dataclass(frozen=True)
class Load:
    """One value the epilogue reads besides the accumulator."""

    name: str
    kind: LoadKind
    half: bool = False  # pair mode, COL/TILE loads: one value per pair ([N/2] / [M, N/2])


# Storage dtypes of quantizing outputs and FP8 GEMM operands.
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def default_out_dtype(operand_dtype: Any) -> jnp.dtype:
    """The storage dtype of a tile output declared with ``dtype=None`` and given none by the
    call: the GEMM operands' dtype, or bfloat16 for FP8 operands (an FP8 output is only ever
    written with a scale: :func:`fp8_out`)."""
    dt = jnp.dtype(operand_dtype)
    return jnp.dtype(jnp.bfloat16) if dt in FP8_DTYPES else dt


def saturate_cast(x: jax.Array, scale: Any, dtype: Any) -> jax.Array:
    """``saturate(x * scale)`` cast to the FP8 ``dtype`` (float32 math): what a quantizing
    output stores (:class:`Quantize`); values beyond the format's largest finite one clip to it."""
    m = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32), -m, m).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Quantize:
    """How a tile output is stored in FP8 (see the module docstring).

    Attributes:
      scale: name of the scalar load holding the per-tensor scale (stored value =
        ``saturate(v * scale)``; dequantize with ``1 / scale``).
      transpose: also write the transposed copy ``{name}_t`` ``[N, M]``.
      amax: also reduce ``max|v|`` over the tile into ``{name}_amax`` (float32 partials ``[P]``).
    """

    scale: str
    transpose: bool = False
    amax: bool = True


@dataclasses.dataclass(frozen=True)
class Output:
    """One value the epilogue writes.

    Attributes:
      name: key in the body's returned dict and in the backend's result dict.
      kind: see :class:`OutputKind`.
      dtype: storage dtype of a tile output; ``None`` means the GEMM operand dtype.
        Reductions are always float32.
      half: pair mode only: the tile output has one column per *pair* (``[M, N/2]``),
        and the body returns a single array; otherwise it returns ``(lo, hi)``.
      quantize: a tile output stored as FP8 (``dtype`` one of :data:`FP8_DTYPES`), with its
        optional transposed copy and amax (:class:`Quantize`); None for a plain output.
    """

    name: str
    kind: OutputKind
    dtype: Any = None
    half: bool = False
    quantize: Quantize | None = None

    def result_names(self) -> tuple[str, ...]:
        """The backend results this output produces: its own name, then ``{name}_t`` and
        ``{name}_amax`` where its :class:`Quantize` asks for them."""
        q = self.quantize
        if q is None:
            return (self.name,)
        return (self.name,) + ((f"{self.name}_t",) if q.transpose else ()) + ((f"{self.name}_amax",) if q.amax else ())


class EpilogueContext(Protocol):
    """The operations a body may need beyond elementwise ``jnp`` math."""

    def row_sum(self, x: jax.Array) -> jax.Array:
        """Sum over the columns of the current pair half, keeping a broadcastable axis."""
        ...

    def col_index(self) -> jax.Array:
        """Global int32 column indices of the accumulator, broadcastable against it."""
        ...


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """A GEMM epilogue program: declared once, lowered by every backend.

    Attributes:
      name: a short identifier, used in kernel names and error messages.
      loads: what the body reads, in the order of its keyword arguments.
      outputs: what the epilogue writes.
      body: ``body(acc, ctx, **loads) -> {output name: value}``.
      pair_block: ``None``, or ``b``: the accumulator columns form blocks of ``2*b``
        and the body receives ``(lo, hi)`` halves of every block.
      uses_col_index: the body calls ``ctx.col_index()``.
      linear: every output is linear in ``acc`` (``body(acc1 + acc2) = body(acc1) +
        body(acc2)`` for fixed loads): the GEMM may run on partial sums over a sharded
        contraction axis and its outputs be added across devices
        (:mod:`coda_jax.partitioning`). ``tests/test_partitioning.py`` checks the claim.
      half_acc: pair mode with a half-width accumulator (see the module docstring): the
        GEMM's ``N`` columns are one per pair, full-width loads/outputs ``[M, 2N]``.
      reads_acc: the body reads ``acc``. ``False`` declares an epilogue pass (its outputs
        come from its loads alone, run over a zero accumulator:
        :func:`coda_jax.ops.epilogue_pass.epilogue_pass`), so a kernel backend may skip the
        GEMM under it (its operand loads and MMAs). ``tests/test_ops_reference.py`` checks the claim.
    """

    name: str
    loads: tuple[Load, ...]
    outputs: tuple[Output, ...]
    body: Callable[..., Mapping[str, Any]]
    pair_block: int | None = None
    uses_col_index: bool = False
    half_acc: bool = False
    linear: bool = False
    reads_acc: bool = True

    def __post_init__(self):
        names = [l.name for l in self.loads] + [r for o in self.outputs for r in o.result_names()]
        if len(set(names)) != len(names):
            raise ValueError(f"epilogue {self.name!r}: load/output names must be unique, got {names}")
        if not self.outputs:
            raise ValueError(f"epilogue {self.name!r}: declares no output")
        scalars = {l.name for l in self.loads if l.kind is LoadKind.SCALAR}
        for o in self.outputs:
            if o.quantize is None:
                continue
            if o.kind is not OutputKind.TILE or jnp.dtype(o.dtype) not in FP8_DTYPES:
                raise ValueError(f"epilogue {self.name!r}: output {o.name!r}: quantize needs a tile output with an "
                                 f"FP8 dtype ({[d.name for d in FP8_DTYPES]}), got {o.kind.value} {o.dtype}")
            if o.quantize.scale not in scalars:
                raise ValueError(f"epilogue {self.name!r}: output {o.name!r}: its scale {o.quantize.scale!r} must be "
                                 f"a scalar load")
        for o in self.outputs:
            if o.half and self.pair_block is None:
                raise ValueError(f"epilogue {self.name!r}: output {o.name!r} is half-width but pair_block is None")
        for l in self.loads:
            if l.kind is LoadKind.ROW_BLOCK and (self.pair_block is None or l.half):
                raise ValueError(f"epilogue {self.name!r}: load {l.name!r}: row_block loads need pair mode")
            if l.half and (self.pair_block is None or l.kind not in (LoadKind.COL, LoadKind.TILE)):
                raise ValueError(f"epilogue {self.name!r}: load {l.name!r}: half-width needs pair mode and a col/tile load")
        if self.half_acc and self.pair_block is None:
            raise ValueError(f"epilogue {self.name!r}: half_acc needs pair_block")
        if self.half_acc and any(l.kind is LoadKind.ROW_BLOCK for l in self.loads):
            raise ValueError(f"epilogue {self.name!r}: row_block loads are not defined with half_acc")
        if self.half_acc and any(o.kind is OutputKind.COL_SUM for o in self.outputs):
            raise ValueError(f"epilogue {self.name!r}: col_sum outputs are not defined with half_acc")
        if self.pair_block is not None and self.uses_col_index:
            raise ValueError(f"epilogue {self.name!r}: col_index is not defined in pair mode")

    def __reduce_ex__(self, protocol):
        # An epilogue built by a @program_factory pickles as (factory, arguments): its body is
        # usually a closure, which pickle cannot carry (a kernel generated in another
        # process rebuilds it there). Others pickle field by field (module-level bodies).
        recipe = self.__dict__.get("_recipe")
        if recipe is not None:
            return recipe
        return super().__reduce_ex__(protocol)

    @property
    def paired_acc(self) -> bool:
        """The body receives the accumulator as ``(lo, hi)`` (pair mode without ``half_acc``)."""
        return self.pair_block is not None and not self.half_acc

    @property
    def pair_width(self) -> int | None:
        """Accumulator columns of one pair block: ``2*b``, ``b`` with ``half_acc``, or None."""
        if self.pair_block is None:
            return None
        return self.pair_block if self.half_acc else 2 * self.pair_block

    def paired(self, item: Load | Output) -> bool:
        """Whether a col/tile load or tile output is passed to / returned by the body as
        ``(lo, hi)`` (pair mode, full width)."""
        kinds = (LoadKind.COL, LoadKind.TILE) if isinstance(item, Load) else (OutputKind.TILE,)
        return self.pair_block is not None and not item.half and item.kind in kinds

    def width(self, n: int, half: bool) -> int:
        """Columns of a tile / col load or tile output for an ``[M, n]`` accumulator."""
        if self.half_acc:
            return n if half else 2 * n
        return n // 2 if half else n

    def load_names(self, kind: LoadKind | None = None) -> tuple[str, ...]:
        return tuple(l.name for l in self.loads if kind is None or l.kind is kind)

    def result_names(self) -> tuple[str, ...]:
        """Every key of a backend's result dict: each output's :meth:`Output.result_names`."""
        return tuple(r for o in self.outputs for r in o.result_names())

    @property
    def quantizes(self) -> bool:
        """Some output is stored as FP8 (:class:`Quantize`)."""
        return any(o.quantize is not None for o in self.outputs)

    def output(self, name: str) -> Output:
        for o in self.outputs:
            if o.name == name:
                return o
        raise KeyError(name)

    def validate_loads(self, loads: Mapping[str, jax.Array], m: int, n: int) -> None:
        """Checks that ``loads`` matches the declaration for an ``[m, n]`` accumulator. A tile
        load may be given as a tuple of its column parts (``[m, w_i]`` arrays of one dtype,
        in order; :func:`coda_jax.lowering.join_columns`)."""
        missing = set(self.load_names()) - set(loads)
        extra = set(loads) - set(self.load_names())
        if missing or extra:
            raise ValueError(
                f"epilogue {self.name!r}: loads mismatch; missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for l in self.loads:
            v = loads[l.name]
            nl = self.width(n, l.half)
            if isinstance(v, (tuple, list)):  # a tile load given as its column parts
                if l.kind is not LoadKind.TILE or not v or any(getattr(p, "ndim", None) != 2 for p in v) \
                        or any(p.shape[0] != m or p.shape[1] < 1 for p in v) \
                        or sum(p.shape[1] for p in v) != nl or len({jnp.dtype(p.dtype) for p in v}) != 1:
                    raise ValueError(
                        f"epilogue {self.name!r}: load {l.name!r} given as parts must be a tile load and a non-empty "
                        f"tuple of [{m}, w_i] arrays of one dtype whose widths sum to {nl}, got "
                        f"{[(tuple(getattr(p, 'shape', ())), str(getattr(p, 'dtype', type(p).__name__))) for p in v]}"
                        f" for a {l.kind.value} load")
                continue
            want = {LoadKind.ROW: (m,), LoadKind.COL: (nl,), LoadKind.SCALAR: (), LoadKind.TILE: (m, nl),
                    LoadKind.ROW_BLOCK: (m, self.pair_block)}[l.kind]
            if tuple(v.shape) != want:
                raise ValueError(
                    f"epilogue {self.name!r}: load {l.name!r} ({l.kind.value}) must have shape {want}, got {tuple(v.shape)}"
                )


def program_factory(fn: Callable[..., Epilogue]) -> Callable[..., Epilogue]:
    """Decorates a function that builds an :class:`Epilogue` from hashable positional
    arguments (e.g. a head size): one epilogue per arguments (cached), and that epilogue
    pickles as a call of the factory, so it can be rebuilt in another process although
    its body is a closure. The factory must be a module-level name. Arguments left to their
    defaults count as given (``f(True)`` and ``f(True, False)`` are one epilogue), so callers
    that spell a default out do not build, and compile, a second copy."""
    signature = inspect.signature(fn)

    @functools.cache
    def build(*args):
        epi = fn(*args)
        object.__setattr__(epi, "_recipe", (factory, args))  # not a field: equality ignores it
        return epi

    @functools.wraps(fn)
    def factory(*args):
        bound = signature.bind(*args)
        bound.apply_defaults()
        return build(*bound.args)

    return factory


@functools.cache
def body_uses_row_sum(epi: Epilogue) -> bool:
    """Whether ``epi.body`` calls ``ctx.row_sum`` (found by tracing it on abstract values).

    A kernel backend may process a pair block in narrower column slices only if it does
    not: ``row_sum`` sums over the whole pair half."""
    used = []

    class _Probe:
        def row_sum(self, x):
            used.append(True)
            return jnp.sum(x, axis=-1, keepdims=True)

        def col_index(self):
            return jnp.zeros((1, 8), jnp.int32)

    f32 = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    acc = (f32, f32) if epi.paired_acc else f32
    loads = {l.name: (f32, f32) if epi.paired(l) else f32 for l in epi.loads}
    jax.eval_shape(lambda acc, loads: epi.body(acc, _Probe(), **loads), acc, loads)
    return bool(used)


def split_pairs(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Pair layout: ``[..., N] -> (lo, hi)``, each ``[..., N/(2*block), block]``."""
    n = x.shape[-1]
    if n % (2 * block):
        raise ValueError(f"pair mode needs a width divisible by 2*{block}, got {n}")
    y = x.reshape(x.shape[:-1] + (n // (2 * block), 2, block))
    return y[..., 0, :], y[..., 1, :]


def join_pairs(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Inverse of :func:`split_pairs`: ``(lo, hi) [..., C, b] -> [..., 2*C*b]``."""
    y = jnp.stack([lo, hi], axis=-2)
    return y.reshape(y.shape[:-3] + (-1,))


# Short constructors, so that declarations read like the paper's decorators.
def row(name: str) -> Load:
    return Load(name, LoadKind.ROW)


def col(name: str, *, half: bool = False) -> Load:
    return Load(name, LoadKind.COL, half)


def row_block(name: str) -> Load:
    """``[M, pair_block]``: per row and position in a pair block, repeated over blocks."""
    return Load(name, LoadKind.ROW_BLOCK)


def scalar(name: str) -> Load:
    return Load(name, LoadKind.SCALAR)


def tile(name: str, *, half: bool = False) -> Load:
    return Load(name, LoadKind.TILE, half)


def tile_out(name: str, dtype: Any = None, *, half: bool = False) -> Output:
    return Output(name, OutputKind.TILE, dtype, half)


def fp8_out(name: str, dtype: Any, *, scale: str, transpose: bool = False, amax: bool = True,
            half: bool = False) -> Output:
    """A tile output stored as FP8 ``dtype`` (``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``)
    with the per-tensor ``scale`` (a scalar load's name); optionally its transposed copy
    and its amax (:class:`Quantize`)."""
    return Output(name, OutputKind.TILE, jnp.dtype(dtype), half, Quantize(scale, transpose, amax))


def row_sum(name: str) -> Output:
    return Output(name, OutputKind.ROW_SUM, jnp.float32)


def col_sum(name: str) -> Output:
    return Output(name, OutputKind.COL_SUM, jnp.float32)


def row_logsumexp(name: str) -> Output:
    return Output(name, OutputKind.ROW_LOGSUMEXP, jnp.float32)


def unquantized(epi: Epilogue) -> Epilogue:
    """``epi`` with each quantizing output written unscaled, as a plain tile output of the same
    name in the GEMM's output dtype (no transposed copy, no amax): the program for a recipe
    that knows a tensor's scale only once the whole tensor exists (current scaling), which
    quantizes it after the GEMM. The scale loads stay (the body is ``epi``'s) and are not read."""
    if not any(o.quantize is not None for o in epi.outputs):
        raise ValueError(f"epilogue {epi.name!r} has no quantizing output")
    outs = tuple(tile_out(o.name, half=o.half) if o.quantize is not None else o for o in epi.outputs)
    return dataclasses.replace(epi, name=f"{epi.name}_unquantized", outputs=outs)


def _dequantized_body(epi: Epilogue):
    def body(acc, ctx, acc_scale, **loads):
        acc = tuple(a * acc_scale for a in acc) if isinstance(acc, tuple) else acc * acc_scale
        return epi.body(acc, ctx, **loads)
    return body


@program_factory
def dequantized(epi: Epilogue) -> Epilogue:
    """``epi`` for a GEMM of FP8 operands with per-tensor scales: the same program with one
    more scalar load, ``acc_scale`` (``1 / (scale_a * scale_b)``), by which the accumulator
    is multiplied before ``epi``'s body sees it. Linear where ``epi`` is."""
    if "acc_scale" in epi.load_names():
        raise ValueError(f"epilogue {epi.name!r} already has a load named 'acc_scale'")
    return dataclasses.replace(epi, name=f"{epi.name}_fp8", loads=epi.loads + (scalar("acc_scale"),),
                               body=_dequantized_body(epi))
