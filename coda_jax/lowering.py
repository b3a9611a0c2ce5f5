"""The one interface every kernel backend implements: "run this GEMM with this epilogue".

Ops (:mod:`coda_jax.ops`) are written once, as sequences of :meth:`GemmLowering.gemm`
calls with epilogue programs (:mod:`coda_jax.programs`). A backend is a lowering of
that call: the reference backend does the GEMM with ``jnp.dot`` and runs the body on
whole arrays, the Pallas backend runs its Hopper mainloop and the body on register
tiles, the CuTeDSL backend does the same through the XLA FFI.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from coda_jax.epilogue import FP8_DTYPES, Epilogue, OutputKind
from coda_jax.log import log_once
from coda_jax.options import current_options


class GemmLowering(Protocol):
    """What a kernel backend provides.

    ``gemm(epilogue, a, b, loads, ...)`` computes ``acc = op(a) @ op(b)`` in float32
    (``op`` transposes when asked), runs ``epilogue.body`` on it and returns a dict with
    one entry per declared output:

    * ``tile`` outputs: ``[M, N]`` (``[M, N/2]`` for half-width pair outputs) in the
      output's dtype (``out_dtypes[name]``, else the output's declared dtype, else
      ``a.dtype``);
    * ``row_sum``: float32 partials ``[P, M]`` whose sum over axis 0 is the row sum
      (``P`` is backend-specific: the number of N-tiles or chunks);
    * ``col_sum``: float32 partials ``[P, N]`` (``[P, N/2]`` for pair-mode summands of
      half width) whose sum over axis 0 is the column sum;
    * ``row_logsumexp``: float32 partials ``[P, M]`` whose log-sum-exp over axis 0 is
      the row log-sum-exp.

    Arguments:
      a: ``[M, K]`` (``[K, M]`` if ``transpose_a``), bf16/f16/f32.
      b: ``[K, N]`` (``[N, K]`` if ``transpose_b``), same dtype as ``a``.
      loads: arrays named as in ``epilogue.loads``. A tile load may be a tuple of its
        column parts (``[M, w_i]`` arrays, in order), e.g. attention's dq, dk, dv as one
        ``[M, N]`` load: a kernel may read the parts where they are (the Pallas kernel does
        where its loads allow), otherwise the backend joins them (:func:`join_columns`).
      out_dtypes: per-output storage dtypes overriding the declaration.
      promote_k: FP8 operands: add the tensor core's accumulator into a float32 total every
        ``promote_k`` K elements (TransformerEngine's split accumulator, for long-K backward
        GEMMs); ``0`` (default): the whole K in the tensor core's accumulator. A kernel rounds
        it down to a multiple of its K step; 16-bit operands accumulate in float32 anyway
        (ignored). See :func:`check_promote_k` and docs/fp8.md#accumulation.
      out_splits: ``{tile output: column widths}``: that output is returned as a tuple of
        ``[M, w_i]`` arrays, its columns in order (:func:`check_out_splits`). A kernel may
        write the parts as separate arrays (the Pallas kernel does where its stores allow),
        so a consumer that wants them apart (attention's Q, K, V) reads them without a
        slicing pass; otherwise the backend slices its one output (:func:`split_columns`).

    A kernel lowering may also define ``pair_width_rule(width) -> str | None``: why a
    pair-mode epilogue ``width`` columns wide cannot run on it (None: it can), which ops
    check up front to name their own argument (e.g. RoPE's head_dim). And it may set
    ``fuses_epilogues = False`` (:func:`fuses_epilogues`) where the body runs as separate
    passes over whole arrays after the GEMM rather than in the GEMM's own kernel (the
    ``"xla"`` backend); ops then pick, where they have one, the formulation with fewer such
    passes.
    """

    name: str

    def gemm(
        self,
        epilogue: Epilogue,
        a: jax.Array,
        b: jax.Array,
        loads: Mapping[str, jax.Array],
        *,
        transpose_a: bool = False,
        transpose_b: bool = False,
        out_dtypes: Mapping[str, Any] | None = None,
        out_splits: Mapping[str, tuple[int, ...]] | None = None,
        promote_k: int = 0,
    ) -> dict[str, Any]: ...


def check_promote_k(promote_k: int) -> int:
    """``promote_k`` (see :class:`GemmLowering`) after checking it: a non-negative int."""
    if not isinstance(promote_k, int) or isinstance(promote_k, bool) or promote_k < 0:
        raise ValueError(f"promote_k must be a non-negative int (K elements between float32 promotions of an FP8 "
                         f"accumulator; 0: none), got {promote_k!r}")
    return promote_k


def check_out_splits(epilogue: Epilogue, out_splits: Mapping[str, tuple[int, ...]] | None,
                     n: int) -> dict[str, tuple[int, ...]]:
    """``out_splits`` as ``{name: widths}`` after checking it against ``epilogue`` and the
    GEMM's ``n``: each name a tile output, each width a positive int, the widths summing to
    the output's columns (``n``, or ``n/2`` / ``2n`` for half-width / ``half_acc`` outputs)."""
    res, outs = {}, {o.name: o for o in epilogue.outputs}
    for name, widths in (out_splits or {}).items():
        if name not in outs or outs[name].kind is not OutputKind.TILE:
            raise ValueError(f"out_splits: epilogue {epilogue.name!r} has no tile output {name!r}")
        widths = tuple(widths)
        cols = epilogue.width(n, outs[name].half)
        if not widths or any(not isinstance(w, int) or isinstance(w, bool) or w <= 0 for w in widths) \
                or sum(widths) != cols:
            raise ValueError(f"out_splits[{name!r}] must be positive int column widths summing to the output's "
                             f"{cols} columns, got {widths}")
        res[name] = widths
    return res


def split_columns(outs: Mapping[str, Any], splits: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """``outs`` with each output named in ``splits`` cut into its column parts (a tuple)."""
    res = dict(outs)
    for name, widths in splits.items():
        starts = [sum(widths[:i]) for i in range(len(widths))]
        res[name] = tuple(outs[name][:, s:s + w] for s, w in zip(starts, widths))
    return res


def load_parts(loads: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{load: column widths}`` of the loads given as column parts (tuples of ``[M, w_i]``)."""
    return {k: tuple(int(p.shape[1]) for p in v) for k, v in loads.items() if isinstance(v, (tuple, list))}


def join_columns(loads: Mapping[str, Any], keep: Mapping[str, Any] = ()) -> dict[str, Any]:
    """``loads`` with each load given as column parts concatenated into one array, except
    those named in ``keep`` (what a kernel reads as parts)."""
    return {k: jnp.concatenate(v, axis=1) if isinstance(v, (tuple, list)) and k not in keep else v
            for k, v in loads.items()}


def gemm_dims(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool) -> tuple[int, int, int]:
    """``(m, n, k)`` of ``op(a) @ op(b)`` for 2-D operands; the two contraction sizes must agree."""
    m, k = (a.shape[1], a.shape[0]) if transpose_a else a.shape
    k2, n = (b.shape[1], b.shape[0]) if transpose_b else b.shape
    if k != k2:
        raise ValueError(f"contraction sizes differ: a gives K={k}, b gives K={k2}")
    return m, n, k


def check_kernel_gemm(backend: str, epilogue: Epilogue, a: jax.Array, b: jax.Array, loads: Mapping[str, jax.Array],
                      transpose_a: bool, transpose_b: bool) -> tuple[int, int, int]:
    """The shared input rules of the kernel backends; returns ``(m, n, k)``.

    2-D operands of one 16-bit dtype (wgmma's path; float32 points at ``backend="xla"``) or
    both FP8 (:data:`~coda_jax.epilogue.FP8_DTYPES`, a GEMM with :func:`~coda_jax.epilogue.dequantized` scales),
    equal contraction sizes, loads matching the declaration, and in pair mode N a multiple
    of ``2 * pair_block`` (of ``pair_block`` with ``half_acc``) with no column sum or
    log-sum-exp output.
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got a{tuple(a.shape)} b{tuple(b.shape)}")
    fp8 = a.dtype in FP8_DTYPES and b.dtype in FP8_DTYPES  # e4m3 / e5m2, mixed allowed
    if a.dtype != b.dtype and not fp8:
        raise TypeError(f"a and b must share a dtype (or both be FP8: {[d.name for d in FP8_DTYPES]}), "
                        f"got a={a.dtype} b={b.dtype}")
    if not fp8 and a.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(f"the {backend} backend needs bfloat16/float16 GEMM operands, got {a.dtype}; "
                        "use backend='xla' (or compute dtype bfloat16) for float32")
    m, n, k = gemm_dims(a, b, transpose_a, transpose_b)
    epilogue.validate_loads(loads, m, n)
    pb = epilogue.pair_block
    if pb is not None:
        q = epilogue.pair_width
        if n % q:
            raise ValueError(f"epilogue {epilogue.name!r}: N={n} must be a multiple of "
                             f"{'' if epilogue.half_acc else '2*'}pair_block={q}")
        if any(o.kind in (OutputKind.COL_SUM, OutputKind.ROW_LOGSUMEXP) for o in epilogue.outputs):
            raise NotImplementedError(f"epilogue {epilogue.name!r}: col_sum / row_logsumexp in pair mode "
                                      f"are not supported by the {backend} backend")
    return m, n, k


def _through_wrappers(lowering: GemmLowering, attr: str):
    """``attr`` of ``lowering``, or of the lowering it wraps as ``inner`` (e.g. a partitioned
    lowering), and so on inwards; None where none has it."""
    while lowering is not None:
        value = getattr(lowering, attr, None)
        if value is not None:
            return value
        lowering = getattr(lowering, "inner", None)
    return None


def pair_width_rule(lowering: GemmLowering, width: int) -> str | None:
    """Why ``lowering`` cannot run a pair-mode epilogue ``width`` columns wide, or None: its
    ``pair_width_rule``, looked up through wrappers that hold the kernel lowering as
    ``inner`` (e.g. a partitioned lowering); lowerings without a rule take any width."""
    rule = _through_wrappers(lowering, "pair_width_rule")
    return None if rule is None else rule(width)


def fuses_epilogues(lowering: GemmLowering) -> bool:
    """Whether ``lowering`` runs epilogues inside its GEMM kernel, where an epilogue's extra
    outputs and loads cost no pass over HBM of their own (the kernel backends: True), as
    opposed to running the body on whole arrays after the GEMM (the ``"xla"`` backend:
    False). Looked up through wrappers that hold the lowering as ``inner``; True where no
    lowering says."""
    flag = _through_wrappers(lowering, "fuses_epilogues")
    return True if flag is None else bool(flag)


def fuses_epilogue_at(lowering: GemmLowering, epilogue: Epilogue, m: int, n: int, k: int) -> bool:
    """Whether ``lowering`` runs ``epilogue`` inside its GEMM kernel for the ``[m, k] @ [k, n]``
    GEMM whose ``m`` rows are tokens (all of them: under a mesh, a partitioned lowering asks
    its backend about each device's share, as it runs it).

    False on the ``xla`` backend (:func:`fuses_epilogues`), and where a kernel backend hands
    this GEMM to XLA (:func:`routes_to_xla`: by name, or for its small output); the lowering
    says so through a ``fuses_at(epilogue, m, n, k)`` method, looked up through wrappers
    (True where none has one). An op with two formulations then takes the one written for
    unfused epilogues, whose GEMMs and passes are the ``xla`` backend's (e.g. the backward of
    :mod:`coda_jax.ops.normed_gemm` at small batches).
    """
    if not fuses_epilogues(lowering):
        return False
    rule = _through_wrappers(lowering, "fuses_at")
    return True if rule is None else bool(rule(epilogue, m, n, k))


# SM count assumed when lowering for CUDA on a host without a GPU (the H100 SXM's).
H100_SMS = 132


def gpu_sm_count() -> int:
    """SMs of this process's first device; an H100's 132 without a GPU."""
    return getattr(jax.local_devices()[0], "core_count", None) or H100_SMS


def persistent_grid_sms(num_sms: int, reserved_sms: int = 0) -> int:
    """SMs a persistent kernel's grid covers on a GPU of ``num_sms``: all but ``reserved_sms``
    (a kernel lowering's argument), which must leave at least 2 (a CTA pair's cluster).

    A persistent kernel launches one CTA per SM, each holding most of its SM's shared memory
    until the kernel ends, so a kernel launched beside it on another stream (NCCL's
    collectives under data parallelism) gets no SM until it ends; reserved SMs give such
    kernels room, at the cost of the GEMMs' share of those SMs.
    """
    if not isinstance(reserved_sms, int) or reserved_sms < 0:
        raise ValueError(f"reserved_sms must be a non-negative integer, got {reserved_sms!r}")
    if num_sms - reserved_sms < 2:
        raise ValueError(f"reserved_sms={reserved_sms} leaves {num_sms - reserved_sms} of the GPU's {num_sms} SMs to "
                         f"the kernels; it must leave at least 2")
    return num_sms - reserved_sms


# Rates of the estimate that XLA's scheduler is given for a kernel (one H100 SXM's worth of
# SMs; scaled by the GPU's SM count): dense bf16 at the rate the fused kernels reach (about
# 75 % of the 989 TFLOP/s peak), and HBM3 bandwidth.
HINT_FLOPS_PER_S = 0.75 * 989e12
HINT_BYTES_PER_S = 3.35e12


def estimated_kernel_ns(m: int, n: int, k: int, bytes_moved: int, num_sms: int = H100_SMS) -> int:
    """A roofline estimate of one ``[m, k] @ [k, n]`` kernel's run time in nanoseconds:
    the larger of its MMA time and its memory time (``bytes_moved``: operands, loads and
    outputs), at :data:`HINT_FLOPS_PER_S` scaled to ``num_sms`` and :data:`HINT_BYTES_PER_S`."""
    flops_s = 2.0 * m * n * k / (HINT_FLOPS_PER_S * num_sms / H100_SMS)
    return max(1, round(1e9 * max(flops_s, bytes_moved / HINT_BYTES_PER_S)))


def with_latency_hint(fn: Callable, ns: int) -> Callable:
    """``fn`` with every op it creates annotated for XLA's latency-hiding scheduler: the
    frontend attribute ``latency_metadata`` (nanoseconds), which XLA's GPU latency
    estimators take as the op's cost. Without it a custom call costs the scheduler next to
    nothing (the analytical estimator charges it 10 us, far less than a fused GEMM takes), so under
    data parallelism the scheduler may keep kernels out of the windows in which the gradient
    all-reduces run (docs/performance.md#multi-gpu). ``fn`` must create the kernel's custom
    call and nothing else."""
    from jax.experimental.xla_metadata import set_xla_metadata

    @functools.wraps(fn)
    def hinted(*args):
        with set_xla_metadata(latency_metadata=str(int(ns))):
            return fn(*args)

    return hinted


def kernel_latency_hint(m: int, n: int, k: int, arrays) -> int:
    """The run time XLA's scheduler is told for a kernel backend's ``[m, k] @ [k, n]`` kernel
    (:func:`estimated_kernel_ns`; ``arrays``: its operands, loads and outputs, arrays or
    shape-dtype structs, whose bytes it moves)."""
    moved = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
    return estimated_kernel_ns(m, n, k, moved, gpu_sm_count())


PLAIN_GEMM_CHOICES = ("xla", "kernel")


def check_plain_gemm(backend: str, choice: str | None) -> str | None:
    """A kernel lowering's ``plain_gemm`` argument: ``None`` (the option
    ``routing.plain_gemm`` decides), ``"xla"``, or ``"kernel"`` (the backend's own name means
    the same); returned as ``None``, ``"xla"`` or ``"kernel"``."""
    if choice is None or choice in PLAIN_GEMM_CHOICES:
        return choice
    if choice == backend:
        return "kernel"
    raise ValueError(f"plain_gemm must be 'xla', 'kernel' or {backend!r}, got {choice!r}")


# The plain GEMMs (nothing to fuse): the identity epilogue, and its FP8 form
# (coda_jax.epilogue.dequantized: the accumulator times one scalar, which cuBLASLt's FP8 GEMM
# applies itself as its alpha).
PLAIN_PROGRAMS = ("identity", "identity_fp8")


def is_scaled_fp8_gemm(epilogue: Epilogue, a: jax.Array, out_dtypes: Mapping[str, Any]) -> bool:
    """Whether this call is a plain FP8 GEMM (``dequantized(IDENTITY)`` on FP8 operands) that
    writes a 16-bit output: XLA runs it as one cuBLASLt FP8 GEMM scaling its own output
    (the reference lowering writes it in that form)."""
    return (epilogue.name == "identity_fp8" and a.dtype in FP8_DTYPES
            and jnp.dtype(out_dtypes["out"]).itemsize == 2)


def routes_to_xla(backend: str, epilogue: Epilogue, m: int, n: int, k: int, plain_choice: str | None = None,
                  by_size: bool = True) -> bool:
    """Whether kernel backend ``backend`` runs this ``[m, k] @ [k, n]`` GEMM and its epilogue
    through the reference lowering (XLA's GEMM and a fusion of the body) instead of its kernel,
    by the options of :class:`coda_jax.options.RoutingOptions` in force:

    * the plain GEMMs (:data:`PLAIN_PROGRAMS`: the identity epilogue and its FP8 form):
      ``plain_choice`` (the lowering's argument, as :func:`check_plain_gemm` returns it), else
      ``routing.plain_gemm``;
    * a fused program: when its output has fewer than ``routing.xla_output_below`` elements
      (``m * n``), or when ``routing.xla_programs`` names it (up to its ``m*n*k`` cap, in units
      of ``2**30``). Why these defaults: docs/performance.md#routing.

    ``by_size=False`` leaves the output-size rule out: the mesh partitioner
    (:mod:`coda_jax.partitioning`) asks with the global shape, and the rule is about the GEMM
    each device runs, which the backend's lowering decides on its shard.
    """
    routing = current_options().routing
    if epilogue.name in PLAIN_PROGRAMS:
        return (plain_choice or routing.plain_gemm) == "xla"
    below = routing.xla_output_below if by_size else 0
    if m * n < below:
        log_once(("small_output", backend, epilogue.name), logging.INFO,  # once per program
                 "coda_jax: %s runs %r GEMMs with outputs under %d elements (here %d x %d) on XLA; the option "
                 "routing.xla_output_below=0 keeps them on the kernel", backend, epilogue.name, below, m, n)
        return True
    if epilogue.name not in routing.xla_programs:
        return False
    cap = routing.xla_programs[epilogue.name]
    return cap is None or m * n * k <= cap * 2 ** 30
