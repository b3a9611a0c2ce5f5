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
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from coda_jax.epilogue import Epilogue, OutputKind


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
      loads: arrays named as in ``epilogue.loads``.
      out_dtypes: per-output storage dtypes overriding the declaration.
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
    ) -> dict[str, Any]: ...


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

    2-D operands of one 16-bit dtype (wgmma's path; float32 points at ``backend="xla"``),
    equal contraction sizes, loads matching the declaration, and in pair mode N a multiple
    of ``2 * pair_block`` (of ``pair_block`` with ``half_acc``) with no column sum or
    log-sum-exp output.
    """
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"a and b must be 2-D, got a{tuple(a.shape)} b{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must share a dtype, got a={a.dtype} b={b.dtype}")
    if a.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
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
    """SMs of the default device; an H100's 132 without a GPU."""
    return getattr(jax.devices()[0], "core_count", None) or H100_SMS


RESERVED_SMS_ENV = "CODA_JAX_RESERVED_SMS"


def reserved_sms() -> int:
    """SMs the persistent kernels leave free: ``$CODA_JAX_RESERVED_SMS`` (default 0).

    A persistent kernel launches one CTA per SM, each holding most of its SM's shared memory
    until the kernel ends, so a kernel launched beside it on another stream (NCCL's
    all-reduce or reduce-scatter of the gradients under data parallelism) gets no SM until it
    ends. Reserving SMs gives such kernels room to run concurrently, at the cost of the
    GEMMs' share of those SMs. Read when a kernel is traced.
    """
    return env_count(RESERVED_SMS_ENV)


def env_count(name: str, default: int = 0) -> int:
    """A non-negative integer environment setting (unset or empty: ``default``), or an error
    naming it."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"${name} must be a non-negative integer, got {text!r}") from None
    if n < 0:
        raise ValueError(f"${name} must be a non-negative integer, got {n}")
    return n


def persistent_grid_sms(num_sms: int) -> int:
    """SMs a persistent kernel's grid covers on a GPU of ``num_sms``: all but
    :func:`reserved_sms`, which must leave at least 2 (a CTA pair's cluster)."""
    r = reserved_sms()
    if num_sms - r < 2:
        raise ValueError(f"${RESERVED_SMS_ENV}={r} leaves {num_sms - r} of the GPU's {num_sms} SMs to the "
                         f"kernels; it must leave at least 2")
    return num_sms - r


TILES_PER_CTA_ENV = "CODA_JAX_TILES_PER_CTA"


def tiles_per_cta() -> int:
    """``$CODA_JAX_TILES_PER_CTA`` (default 0): 0 keeps the persistent grid (one CTA, or CTA
    pair, per SM, each walking its share of the output tiles in a fixed order); ``N > 0``
    launches one CTA (pair) per ``N`` output tiles instead, so the GPU hands the tiles to
    whichever SMs are free.

    Why: a persistent CTA whose SM is held by a kernel on another stream (NCCL beside the
    GEMM under data parallelism or FSDP) starts late, and the whole GEMM waits for its
    share; with more, shorter CTAs the other SMs take over the work. The price: a CTA's
    pipeline fill is no longer hidden behind the previous tile's epilogue. Pallas only;
    read when a kernel is traced.
    """
    return env_count(TILES_PER_CTA_ENV)


LATENCY_HINTS_ENV = "CODA_JAX_LATENCY_HINTS"
# Rates of the estimate that XLA's scheduler is given for a kernel (one H100 SXM's worth of
# SMs; scaled by the GPU's SM count): dense bf16 at the rate the fused kernels reach (about
# 75 % of the 989 TFLOP/s peak, benchmarks/RESULTS.md), and HBM3 bandwidth.
HINT_FLOPS_PER_S = 0.75 * 989e12
HINT_BYTES_PER_S = 3.35e12


def latency_hints_enabled() -> bool:
    """``$CODA_JAX_LATENCY_HINTS`` (``1`` on; default off): whether each kernel call tells
    XLA's scheduler its estimated run time (:func:`with_latency_hint`)."""
    text = os.environ.get(LATENCY_HINTS_ENV, "0").strip().lower()
    if text not in ("0", "1", "", "false", "true", "off", "on"):
        raise ValueError(f"${LATENCY_HINTS_ENV} must be 0 or 1, got {text!r}")
    return text in ("1", "true", "on")


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
    nothing (the analytical estimator charges it 10 us; a fused GEMM takes 0.1-7 ms), and
    under data parallelism the scheduler kept every Pallas call out of the windows in which
    the gradient all-reduces run (benchmarks/RESULTS.md, runs 154-157). ``fn`` must create
    the kernel's custom call and nothing else."""
    from jax.experimental.xla_metadata import set_xla_metadata

    @functools.wraps(fn)
    def hinted(*args):
        with set_xla_metadata(latency_metadata=str(int(ns))):
            return fn(*args)

    return hinted


def kernel_latency_hint(m: int, n: int, k: int, arrays) -> int | None:
    """The run time XLA's scheduler is told for a kernel backend's ``[m, k] @ [k, n]`` kernel
    (:func:`estimated_kernel_ns`; ``arrays``: its operands, loads and outputs, arrays or
    shape-dtype structs, whose bytes it moves), or None unless ``$CODA_JAX_LATENCY_HINTS=1``."""
    if not latency_hints_enabled():
        return None
    moved = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
    return estimated_kernel_ns(m, n, k, moved, gpu_sm_count())


def plain_gemm_env(backend: str) -> str:
    """The environment variable that routes a kernel backend's plain GEMMs."""
    return f"CODA_JAX_{backend.upper()}_PLAIN_GEMM"


def check_plain_gemm(backend: str, choice: str | None) -> None:
    """``choice`` must be ``None``, ``"xla"`` or the backend's name."""
    if choice not in (None, backend, "xla"):
        raise ValueError(f"plain_gemm must be {backend!r} or 'xla', got {choice!r}")


def plain_gemm_route(backend: str, choice: str | None) -> str:
    """Where a kernel backend runs a *plain* GEMM (the identity epilogue: the backward
    dgrad / wgrad GEMMs with nothing to fuse): ``"xla"`` (XLA's GEMM, cuBLAS on a GPU; the
    default) or ``backend`` (its own kernel).

    ``choice`` (the lowering's ``plain_gemm`` argument) wins, then the environment variable
    ``CODA_JAX_<BACKEND>_PLAIN_GEMM``. An epilogue without loads or reductions gains
    nothing from a fused kernel, and cuBLAS ran each of the block's plain GEMMs 1-3.5 %
    faster than the Pallas kernel (benchmarks/RESULTS.md, run 33) and faster still than the
    CuTeDSL kernel.
    """
    check_plain_gemm(backend, choice)
    env = plain_gemm_env(backend)
    route = choice or os.environ.get(env, "xla")
    if route not in (backend, "xla"):
        raise ValueError(f"{env} must be {backend!r} or 'xla', got {route!r}")
    return route


def xla_programs_env(backend: str) -> str:
    """The environment variable that lists the fused programs a kernel backend hands to XLA."""
    return f"CODA_JAX_{backend.upper()}_XLA_PROGRAMS"


# Fused programs that a kernel backend runs as XLA's GEMM (cuBLAS) plus an XLA fusion of the
# same epilogue body (the reference lowering) instead of its own kernel, by default, each with
# the largest GEMM it applies to (m * n * k in units of 2^30, None: any size). Chosen by
# measurement of the whole train step against the kernel. Empty: every fused program runs
# on the backend's kernel; at 1B each hand-off tried (the CE forward, the QKV and o-projection
# programs) slowed the Pallas train step (benchmarks/RESULTS.md, run 117).
DEFAULT_XLA_PROGRAMS: dict[str, dict[str, float | None]] = {"pallas": {}, "cutedsl": {}}


def xla_output_below_env(backend: str) -> str:
    """The environment variable that sets a kernel backend's :func:`xla_output_below`."""
    return f"CODA_JAX_{backend.upper()}_XLA_OUTPUT_BELOW"


# Fused GEMMs whose output has fewer elements than this (M * N) run on XLA's GEMM plus a
# fusion of the epilogue body (the reference lowering) instead of the backend's kernel, by
# default (0: never). Such an output is the Pallas kernel's "small" shape class (64 x 128
# tiles, two stages, no warp specialization: 512 x 2048 is 128 tiles for 132 SMs, each
# running all of K, 16384 in the 1B MLP's dgrad); there it ran at 93-167 TFLOP/s (run 262),
# and the epilogue passes fusion saves are a few MB. The 1B train step at 2 x 256 tokens
# (benchmarks/RESULTS.md, runs 262-263): Pallas 0.864x -> 1.036x plain JAX, CuTeDSL 1.018x ->
# 1.037x; twice this bound (2^23) routed 2 x 1024 tokens' QKV and o-projection too and lost
# 4 % there (1.061x -> 1.021x); at 8 x 1024 tokens and the block's 8192 no GEMM is this small.
DEFAULT_XLA_OUTPUT_BELOW: dict[str, int] = {"pallas": 1 << 22, "cutedsl": 1 << 22}
_logger = logging.getLogger("coda_jax")
_small_output_logged: set[tuple[str, str]] = set()


def xla_output_below(backend: str) -> int:
    """Output size (``M * N`` elements) below which kernel backend ``backend`` hands a fused GEMM
    to XLA: ``$CODA_JAX_<BACKEND>_XLA_OUTPUT_BELOW`` if set (an integer; ``0`` turns the rule
    off, so that every fused GEMM runs on the kernel), else :data:`DEFAULT_XLA_OUTPUT_BELOW`."""
    return env_count(xla_output_below_env(backend), DEFAULT_XLA_OUTPUT_BELOW.get(backend, 0))


def parse_xla_programs(text: str, source: str) -> dict[str, float | None]:
    """``"rms_rope,rms_dgrad_res<64"`` -> ``{"rms_rope": None, "rms_dgrad_res": 64.0}``;
    ``""`` or ``"none"`` -> ``{}``. Items are separated by commas or ``+`` (for settings that
    travel inside comma-separated lists). ``source`` names the setting in errors."""
    out: dict[str, float | None] = {}
    text = text.strip()
    if text.lower() in ("", "none"):
        return out
    for item in text.replace("+", ",").split(","):
        name, _, cap = item.strip().partition("<")
        if not name.strip():
            raise ValueError(f"{source}: empty program name in {text!r} (expected 'name' or 'name<GIGA_MNK', "
                             f"comma-separated)")
        try:
            out[name.strip()] = float(cap) if cap.strip() else None
        except ValueError:
            raise ValueError(f"{source}: {item.strip()!r} must be 'name' or 'name<N' with N the largest "
                             f"m*n*k in units of 2^30") from None
    return out


def routes_to_xla(backend: str, epilogue: Epilogue, m: int, n: int, k: int, plain_choice: str | None = None,
                  by_size: bool = True) -> bool:
    """Whether kernel backend ``backend`` runs this ``[m, k] @ [k, n]`` GEMM and its epilogue
    through the reference lowering (XLA's GEMM and a fusion of the body) instead of its kernel.

    The identity epilogue follows :func:`plain_gemm_route`. A fused program goes to XLA when its
    output has fewer than :func:`xla_output_below` elements (``m * n``), or when it is in the
    backend's table, ``$CODA_JAX_<BACKEND>_XLA_PROGRAMS`` if set (e.g.
    ``"rms_rope,rms_dgrad_res<64"``: those programs, the second only where ``m*n*k <= 64 * 2^30``;
    ``"none"``: no program), else :data:`DEFAULT_XLA_PROGRAMS`: where the kernel's fused
    epilogue saves less than the kernel loses to cuBLAS on the GEMM itself.

    ``by_size=False`` leaves the output-size rule out: the mesh partitioner
    (:mod:`coda_jax.partitioning`) asks with the global shape, and the rule is about the GEMM
    each device runs, which the backend's lowering decides on its shard.
    """
    if epilogue.name == "identity":
        return plain_gemm_route(backend, plain_choice) == "xla"
    below = xla_output_below(backend) if by_size else 0
    if m * n < below:
        if (backend, epilogue.name) not in _small_output_logged:  # once per program (INFO)
            _small_output_logged.add((backend, epilogue.name))
            _logger.info("coda_jax: %s runs %r GEMMs with outputs under %d elements (here %d x %d) on XLA; "
                         "$%s=0 keeps them on the kernel", backend, epilogue.name, below, m, n,
                         xla_output_below_env(backend))
        return True
    env = xla_programs_env(backend)
    text = os.environ.get(env)
    table = DEFAULT_XLA_PROGRAMS.get(backend, {}) if text is None else parse_xla_programs(text, f"${env}")
    if epilogue.name not in table:
        return False
    cap = table[epilogue.name]
    return cap is None or m * n * k <= cap * 2 ** 30
