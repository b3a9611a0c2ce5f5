"""From an :class:`~coda_jax.epilogue.Epilogue` body to per-element register code.

The body is traced once with :func:`jax.make_jaxpr` on abstract float32 values shaped
like one accumulator tile (or like one pair half in pair mode), with every load
broadcastable against it exactly as the reference backend passes them. The resulting
jaxpr is then *interpreted* inside the CuTeDSL kernel, on the values one thread holds.

Representation: every array value of the jaxpr is represented by a Python list with one
scalar per accumulator element held by the thread (the thread's register fragment).
Element ``i`` of any value is the value *at the tile position of accumulator element
``i`` after broadcasting* (in pair mode: at the pair position of element ``i``). Because
the body contract forbids reshapes and cross-column math other than ``ctx.row_sum``,
``broadcast_in_dim`` / ``reshape`` / ``squeeze`` / ``expand_dims`` are identities in this
representation, elementwise primitives act element by element, ``iota`` gives the
element's coordinate and a ``reduce_*`` over the column axis is a segmented row reduction
that the kernel implements through shared memory (:meth:`ElementContext.row_reduce`).

The interpreter is generic over an *element ops* object (:class:`ElementOps`): the
CuTeDSL kernel supplies scalar DSL ops, the tests supply NumPy ops, so the mapping from
JAX primitives is checked on the CPU against the reference backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from coda_jax.epilogue import Epilogue, LoadKind

__all__ = [
    "TracedBody",
    "trace_body",
    "ElementOps",
    "ElementContext",
    "interpret",
    "UnsupportedPrimitiveError",
    "SUPPORTED_PRIMITIVES",
]


class UnsupportedPrimitiveError(NotImplementedError):
    """A JAX primitive in an epilogue body has no CuTeDSL lowering."""


# ----------------------------------------------------------------- tracing ----------
@dataclasses.dataclass(frozen=True)
class TracedBody:
    """The body of an epilogue as a closed jaxpr plus the meaning of its in/outvars.

    ``inputs``: one ``(role, name, part)`` per jaxpr input: role ``"acc"`` / ``"load"`` /
    ``"col0"`` (the tile's first global column, int32 scalar); ``part`` is 0 / 1 for the
    lo / hi half in pair mode, ``None`` otherwise.
    ``outputs``: one ``(output name, part)`` per jaxpr output (``part`` as above; ``None``
    for a single value, including half-width pair outputs).
    """

    jaxpr: Any  # jax.extend.core.ClosedJaxpr
    inputs: tuple[tuple[str, str | None, int | None], ...]
    outputs: tuple[tuple[str, int | None], ...]
    shape: tuple[int, int]  # traced accumulator (or pair half) shape


class _TraceContext:
    """EpilogueContext used while tracing: plain jnp, lowered later per element."""

    def __init__(self, shape, col0, pair: bool):
        self._shape, self._col0, self._pair = shape, col0, pair

    def row_sum(self, x):
        return jnp.sum(x, axis=-1, keepdims=True)

    def col_index(self):
        if self._pair:
            raise NotImplementedError("ctx.col_index() is not defined in pair mode")
        return lax.broadcasted_iota(jnp.int32, (1, self._shape[1]), 1) + self._col0


def _load_avals(epi: Epilogue, shape, load_dtypes: Mapping[str, Any]):
    """Abstract loads as the body sees them; returns (name, part, aval) triples."""
    tm, w = shape
    res = []
    for l in epi.loads:
        dt = jnp.dtype(load_dtypes.get(l.name, jnp.float32))
        dt = jnp.dtype(jnp.float32) if jnp.issubdtype(dt, jnp.floating) else dt
        if l.kind is LoadKind.SCALAR:
            shp = ()
        elif l.kind is LoadKind.ROW:
            shp = (tm, 1)
        elif l.kind is LoadKind.COL:
            shp = (1, w)
        else:  # TILE / ROW_BLOCK
            shp = (tm, w)
        parts = (0, 1) if epi.paired(l) else (None,)
        for p in parts:
            res.append((l.name, p, jax.ShapeDtypeStruct(shp, dt)))
    return res


def trace_body(epi: Epilogue, shape: tuple[int, int], load_dtypes: Mapping[str, Any] | None = None) -> TracedBody:
    """Traces ``epi.body`` on one ``shape`` tile (one pair half in pair mode)."""
    load_dtypes = dict(load_dtypes or {})
    pair = epi.pair_block is not None
    acc_parts = (0, 1) if epi.paired_acc else (None,)
    loads = _load_avals(epi, shape, load_dtypes)
    inputs = [("acc", None, p) for p in acc_parts] + [("load", n, p) for n, p, _ in loads] + [("col0", None, None)]
    avals = ([jax.ShapeDtypeStruct(shape, jnp.float32)] * len(acc_parts) + [a for _, _, a in loads]
             + [jax.ShapeDtypeStruct((), jnp.int32)])
    out_spec: list[tuple[str, int | None]] = []

    def flat_body(*args):
        accs = args[: len(acc_parts)]
        acc = tuple(accs) if len(accs) == 2 else accs[0]
        kw: dict[str, Any] = {}
        for (name, part, _), v in zip(loads, args[len(acc_parts):-1]):
            if part is None:
                kw[name] = v
            else:
                kw[name] = kw.get(name, ()) + (v,)
        res = epi.body(acc, _TraceContext(shape, args[-1], pair), **kw)
        declared = [o.name for o in epi.outputs]
        if set(res) != set(declared):
            raise ValueError(f"epilogue {epi.name!r} body returned {sorted(res)}, declared {declared}")
        flat = []
        out_spec.clear()
        for o in epi.outputs:
            v = res[o.name]
            if isinstance(v, tuple):
                if not pair or len(v) != 2:
                    raise ValueError(f"epilogue {epi.name!r}: output {o.name!r} is a tuple outside pair mode")
                for p, x in enumerate(v):
                    out_spec.append((o.name, p))
                    flat.append(jnp.asarray(x))
            else:
                if epi.paired(o):
                    raise ValueError(f"epilogue {epi.name!r}: full-width pair output {o.name!r} must be (lo, hi)")
                out_spec.append((o.name, None))
                flat.append(jnp.asarray(v))
        return flat

    closed = jax.make_jaxpr(flat_body)(*avals)
    return TracedBody(closed, tuple(inputs), tuple(out_spec), tuple(shape))


# ------------------------------------------------------------ interpretation --------
class ElementOps(Protocol):
    """Scalar operations on one element value (a DSL scalar in the kernel)."""

    def const(self, value: Any, dtype: np.dtype) -> Any: ...

    def unary(self, name: str, x: Any) -> Any: ...

    def binary(self, name: str, x: Any, y: Any) -> Any: ...

    def compare(self, name: str, x: Any, y: Any) -> Any: ...

    def select(self, pred: Any, if_true: Any, if_false: Any) -> Any: ...

    def convert(self, x: Any, src: np.dtype, dst: np.dtype) -> Any: ...


class ElementContext(Protocol):
    """What the interpreter needs from the kernel besides scalar math."""

    def coord(self, dim: int) -> list[Any]:
        """Per element: its int32 coordinate along ``dim`` (0 row, 1 column) of the traced shape."""
        ...

    def row_reduce(self, op: str, values: list[Any]) -> list[Any]:
        """Per element: ``op`` ("sum"/"max") over the traced shape's columns of its row."""
        ...


_UNARY = {
    "neg": "neg", "exp": "exp", "log": "log", "logistic": "logistic", "rsqrt": "rsqrt",
    "sqrt": "sqrt", "cos": "cos", "sin": "sin", "tanh": "tanh", "abs": "abs", "exp2": "exp2",
    "log1p": "log1p", "expm1": "expm1", "square": "square", "sign": "sign", "floor": "floor",
    "ceil": "ceil", "not": "not", "erf": "erf",
}
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "max", "min": "min",
           "pow": "pow", "and": "and", "or": "or", "rem": "rem"}
_COMPARE = {"eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}
# Shape-only primitives: identities in the per-element representation.
_IDENTITY = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p", "reshard", "mesh_cast",
             "sharding_constraint",
             "stop_gradient", "optimization_barrier", "reduce_precision"}
_CALLS = {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
          "custom_vjp_call_jaxpr", "remat", "checkpoint"}
SUPPORTED_PRIMITIVES = frozenset(
    set(_UNARY) | set(_BINARY) | set(_COMPARE) | _IDENTITY | _CALLS
    | {"select_n", "convert_element_type", "integer_pow", "iota", "reduce_sum", "reduce_max",
       "add_any", "max", "min"})


def _sub_jaxpr(eqn) -> Any:
    p = eqn.params
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in p:
            j = p[key]
            return j
    raise UnsupportedPrimitiveError(f"call primitive {eqn.primitive.name!r} without a jaxpr parameter")


def _eval_jaxpr(jaxpr, consts: Sequence[Any], args: Sequence[Any], n: int, ops: ElementOps, ctx: ElementContext,
                where: str) -> list[Any]:
    """Evaluates ``jaxpr`` on per-element lists (length ``n``)."""
    from jax.extend import core as jex_core

    env: dict[Any, Any] = {}

    def read(v):
        if isinstance(v, jex_core.Literal):
            val = np.asarray(v.val)
            if val.ndim:
                val = val.reshape(-1)[0] if np.all(val == val.reshape(-1)[0]) else None
                if val is None:
                    raise UnsupportedPrimitiveError(f"{where}: non-uniform array literal")
            c = ops.const(val.item() if hasattr(val, "item") else val, np.dtype(v.aval.dtype))
            return [c] * n
        return env[v]

    def write(v, x):
        env[v] = x

    for v, c in zip(jaxpr.constvars, consts):
        arr = np.asarray(c)
        flat = arr.reshape(-1)
        if flat.size and not np.all(flat == flat[0]):
            raise UnsupportedPrimitiveError(f"{where}: non-uniform array constant of shape {arr.shape}")
        write(v, [ops.const(flat[0].item() if flat.size else 0, arr.dtype)] * n)
    for v, a in zip(jaxpr.invars, args):
        write(v, a)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [read(v) for v in eqn.invars]
        in_dt = [np.dtype(v.aval.dtype) for v in eqn.invars]
        out_avals = [v.aval for v in eqn.outvars]
        if name in _CALLS:
            sub = _sub_jaxpr(eqn)
            sub_j = getattr(sub, "jaxpr", sub)
            sub_c = getattr(sub, "consts", ())
            outs = _eval_jaxpr(sub_j, sub_c, ins, n, ops, ctx, where)
        elif name in _IDENTITY:
            outs = [ins[0]]
        elif name in _UNARY:
            outs = [[ops.unary(_UNARY[name], x) for x in ins[0]]]
        elif name in _BINARY or name == "add_any":
            op = "add" if name == "add_any" else _BINARY[name]
            outs = [[ops.binary(op, x, y) for x, y in zip(ins[0], ins[1])]]
        elif name in _COMPARE:
            outs = [[ops.compare(_COMPARE[name], x, y) for x, y in zip(ins[0], ins[1])]]
        elif name == "select_n":
            pred, cases = ins[0], ins[1:]
            if len(cases) != 2:
                raise UnsupportedPrimitiveError(f"{where}: select_n with {len(cases)} cases")
            if in_dt[0] != np.dtype(bool):
                raise UnsupportedPrimitiveError(f"{where}: select_n with an integer predicate")
            outs = [[ops.select(p, t, f) for p, f, t in zip(pred, cases[0], cases[1])]]
        elif name == "convert_element_type":
            dst = np.dtype(eqn.params["new_dtype"])
            outs = [[ops.convert(x, in_dt[0], dst) for x in ins[0]]]
        elif name == "integer_pow":
            y = int(eqn.params["y"])
            if y < 0 or y > 8:
                raise UnsupportedPrimitiveError(f"{where}: integer_pow with exponent {y}")
            res = []
            for x in ins[0]:
                r = ops.const(1.0, in_dt[0])
                for _ in range(y):
                    r = ops.binary("mul", r, x)
                res.append(r)
            outs = [res]
        elif name == "iota":
            dim = int(eqn.params["dimension"])
            shape = tuple(eqn.params["shape"])
            if len(shape) != 2 or shape[dim] == 1:
                raise UnsupportedPrimitiveError(f"{where}: iota of shape {shape} (only 2-D tile iotas lower)")
            coords = ctx.coord(dim)
            dt = np.dtype(eqn.params["dtype"])
            outs = [[ops.convert(c, np.dtype(np.int32), dt) if dt != np.int32 else c for c in coords]]
        elif name in ("reduce_sum", "reduce_max"):
            axes = tuple(eqn.params["axes"])
            rank = len(eqn.invars[0].aval.shape)
            if rank != 2 or axes != (1,):
                raise UnsupportedPrimitiveError(
                    f"{where}: {name} over axes {axes} of a rank-{rank} value; only row reductions over "
                    "the tile's columns (ctx.row_sum) lower")
            outs = [ctx.row_reduce("sum" if name == "reduce_sum" else "max", ins[0])]
        else:
            raise UnsupportedPrimitiveError(
                f"{where}: JAX primitive {name!r} has no CuTeDSL epilogue lowering "
                f"(supported: {', '.join(sorted(SUPPORTED_PRIMITIVES))})")
        if len(outs) != len(out_avals):
            raise UnsupportedPrimitiveError(f"{where}: primitive {name!r} returned {len(outs)} values")
        for v, x in zip(eqn.outvars, outs):
            write(v, x)
    return [read(v) for v in jaxpr.outvars]


def interpret(traced: TracedBody, values: Mapping[tuple[str, str | None, int | None], list[Any]], n: int,
              ops: ElementOps, ctx: ElementContext, where: str = "epilogue") -> dict[tuple[str, int | None], list[Any]]:
    """Runs a traced body on per-element lists; returns ``{(output, part): values}``."""
    args = []
    for key in traced.inputs:
        if key not in values:
            raise KeyError(f"{where}: no value for body input {key}")
        args.append(values[key])
    outs = _eval_jaxpr(traced.jaxpr.jaxpr, traced.jaxpr.consts, args, n, ops, ctx, where)
    return dict(zip(traced.outputs, outs))


def check_lowerable(traced: TracedBody, where: str) -> None:
    """Raises :class:`UnsupportedPrimitiveError` if the jaxpr uses an unmapped primitive."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name not in SUPPORTED_PRIMITIVES:
                raise UnsupportedPrimitiveError(
                    f"{where}: JAX primitive {name!r} has no CuTeDSL epilogue lowering "
                    f"(supported: {', '.join(sorted(SUPPORTED_PRIMITIVES))})")
            if name in _CALLS:
                sub = _sub_jaxpr(eqn)
                walk(getattr(sub, "jaxpr", sub))

    walk(traced.jaxpr.jaxpr)


# ---------------------------------------------------------- NumPy element ops -------
class NumpyOps:
    """:class:`ElementOps` on NumPy scalars (tests, and documentation of the semantics)."""

    def const(self, value, dtype):
        return np.asarray(value, dtype=dtype if dtype != np.dtype(np.float64) else np.float32)[()]

    def unary(self, name, x):
        f = {"neg": np.negative, "exp": np.exp, "log": np.log, "logistic": lambda v: 1 / (1 + np.exp(-v)),
             "rsqrt": lambda v: 1 / np.sqrt(v), "sqrt": np.sqrt, "cos": np.cos, "sin": np.sin, "tanh": np.tanh,
             "abs": np.abs, "exp2": np.exp2, "log1p": np.log1p, "expm1": np.expm1, "square": np.square,
             "sign": np.sign, "floor": np.floor, "ceil": np.ceil, "not": np.logical_not}.get(name)
        if f is None:
            raise UnsupportedPrimitiveError(name)
        with np.errstate(all="ignore"):
            return f(x)

    def binary(self, name, x, y):
        f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
             "min": np.minimum, "pow": np.power, "and": np.logical_and, "or": np.logical_or, "rem": np.fmod}[name]
        with np.errstate(all="ignore"):
            return f(x, y)

    def compare(self, name, x, y):
        return {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
                "ge": np.greater_equal}[name](x, y)

    def select(self, pred, if_true, if_false):
        return if_true if pred else if_false

    def convert(self, x, src, dst):
        return np.asarray(x).astype(dst)[()]
