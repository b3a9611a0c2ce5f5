"""Train-step throughput of CodaLlama per backend against the plain JAX Llama, in one process.

    python -m benchmarks.train_step_bench --preset 1b --batch 8 --seq 1024 \
        --runs plain,xla,pallas,cutedsl,pallas:cross_entropy.save_logits=false,plain --out $OUT

Every run is the same step: the example's optimizer (:func:`coda_jax.training.adamw_cosine`: AdamW after global-norm
clipping) and functional jitted step with donated state (:func:`coda_jax.training.make_steps`), on
one fixed batch of random tokens, from the same initial weights (the plain models copy
CodaLlama's, ``PlainLlama.from_coda``). ``plain`` is :class:`plain_llama.PlainLlama`, the baseline
of record, and ``plain_fp8`` its FP8 counterpart (:class:`plain_fp8_llama.PlainFp8Llama`: delayed
scaling, XLA's cuBLASLt FP8 GEMMs; settings ``idiom=direct|dequant``, how the scaled GEMM is
written, ``fuse=true|false``, Q/K/V and gate/up as one GEMM each, and ``lm_head=true``, the LM
head's GEMMs in FP8 too; on a GPU its row records
how many FP8 GEMM calls the compiled step holds against how many it should,
``fp8_gemm_calls`` / ``fp8_gemm_calls_expected``: XLA runs an FP8 dot it cannot rewrite as a
bf16 GEMM, silently; ``fp8_gemm_kinds`` counts the FP8 GEMMs by how XLA runs them, cuBLASLt's
calls and fusions (Triton's, cuDNN's) over FP8 operands); ``backend[:option=value,...]`` is ``CodaLlama`` on that backend with those coda-jax
options in force while its step is traced (:func:`coda_jax.options.parse_overrides`, applied
with :func:`coda_jax.options.options`, and ``fp8=true`` for ``LlamaConfig(fp8=Fp8Recipe())``
(``fp8=current``: ``Fp8Recipe(scaling="current")``; with ``lm_head=true``: ``Fp8Recipe(lm_head=True)``;
``promote_k=N``: ``Fp8Recipe(promote_k=N)``, also a ``plain_fp8`` setting; ``swiglu_input=e4m3``:
``Fp8Recipe(swiglu_input="e4m3")``; ``cutedsl:fp8=true,
fp8_kernel=false``: that backend's FP8 GEMMs on XLA instead of its kernel), whose
FP8 GEMM calls are checked as ``plain_fp8``'s; e.g. ``pallas:cross_entropy.save_logits=false``: the
cross-entropy recomputes its logits; ``pallas:routing.xla_output_below=0,routing.plain_gemm=kernel``:
every GEMM on the kernel). Per run: compile + first step (wall seconds), then ``--rounds`` rounds of
``--steps`` steps dispatched back to back and closed by one ``jax.block_until_ready`` (the
device queue stays full; the host is not in the step time); the median round gives ms/step
and tokens/s. Runs go one after another (a 1B model with its AdamW state is ~15 GB; several
would not fit together): list ``plain`` first and last, and the table reports the drift
between them. The compiled step's temp memory (XLA's memory analysis) is reported too.
Each row keeps every step's loss (``losses``) and the optimizer's count of the steps it applied
(``steps_applied`` against ``steps_run``: an FP8 step with a non-finite amax or gradient is
skipped, :class:`coda_jax.fp8.Fp8Recipe`; a fresh FP8 model's first step only calibrates its
scales, ``calibration_steps``, docs/fp8.md#the-first-step). The batch repeats, so a run that trains drives its
loss toward zero, and once it has memorized the batch it may spike (likely Adam's steps on near-zero
gradients, which move the weights by about the learning rate): the lowest loss says that a run
trained, not the last. Accuracy is ``fp8_accuracy.py``'s to measure.
Three more settings of a run are not options: ``JAX_ENABLE_PGLE=1`` (JAX's automatic
profile-guided latency estimation, through jit dispatch; ``JAX_PGLE_PROFILING_RUNS=N``
profiled runs, default 3) and ``PGLE_AOT=N`` (the same from N traced steps, compiled ahead of
time, so that the schedule XLA made with the measured costs can be read: the ``SCHEDULE``
lines on a mesh); settings named ``xla_*`` are XLA options of the step's compile (e.g.
``pallas:xla_gpu_all_reduce_combine_threshold_bytes=0``). On a mesh
(``--mesh data=2``, ``--mesh-type explicit`` for Explicit axes) each run's state is placed
by :func:`coda_jax.sharding.shard_state` (the plain model's by
:func:`plain_llama.shard_plain_state`: Megatron's split over a tensor axis); ``--hlo-out DIR`` keeps
each compiled step's schedule for ``python -m benchmarks.hlo_schedule``. Results:
``<out>/train_step.json`` and a table, ratios against the mean of the plain runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.gpu_clock import ClockSampler
from benchmarks.hlo_schedule import collective_windows, window_summary
from benchmarks.plain_fp8_llama import IDIOMS, PlainFp8Llama, fp8_gemm_calls, fp8_gemm_kinds, gemm_call_targets
from benchmarks.plain_llama import PlainLlama, shard_plain_state
from coda_jax import partitioning, training
from coda_jax.fp8 import SWIGLU_INPUTS, Fp8Recipe
from coda_jax.layers import PRESETS, CodaLlama
from coda_jax.options import OptionError, options, parse_overrides
from coda_jax.sharding import batch_sharding, mesh_from_spec, shard_state


def parse_mesh(spec: str | None, explicit: bool = False):
    """``"data=2,fsdp=4"`` -> a mesh over all devices (:func:`coda_jax.sharding.mesh_from_spec`;
    Explicit axes with ``explicit``); no spec: no mesh (one device)."""
    return mesh_from_spec(spec, explicit=explicit) if spec else None


def all_gathers(hlo: str) -> list[tuple[str, list[int], str, str]]:
    """``(dtype, dims, operand, line)`` of each all-gather in compiled HLO text (``operand``:
    the gathered value's name, e.g. ``%param.834`` or ``%fusion.7``)."""
    import re

    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(([^,)\s]*)", line)
        if m:
            out.append((m.group(1), [int(x) for x in m.group(2).split(",") if x], m.group(3), line.strip()))
    return out


def activation_gathers(hlo: str, batch: int, seq: int, floating_only: bool = False) -> list[str]:
    """The all-gathers in compiled HLO text whose result is shaped like an activation
    (``[batch*seq, ...]`` or ``[batch, seq, ...]``: a kernel's operands gathered), each as
    its line; with ``floating_only``, those of floating-point arrays. Gathers of the step's
    parameters (the state: FSDP's weight gathers) are not counted: at 16 x 1024 tokens the
    1B model's 2F = 16384 matched the token count (run 143)."""
    return [line[:160] for dtype, dims, operand, line in all_gathers(hlo)
            if not (floating_only and not dtype.startswith(("f", "bf")))
            and not operand.startswith(("%param", "%Arg_"))
            and dims and (dims[0] == batch * seq or dims[:2] == [batch, seq])]


MODELS = ("plain", "xla", "pallas", "cutedsl", "plain_fp8")
# The plain models (PlainLlama and its FP8 counterpart): not CodaLlama, placed on a mesh by shard_plain_state.
PLAIN_MODELS = ("plain", "plain_fp8")
MODEL_RULE = ("plain, xla, pallas or cutedsl, or plain_fp8 (the plain model in FP8, settings idiom="
              + "|".join(IDIOMS) + " and fuse=true|false)")
# plain_fp8's own settings (PlainFp8Llama's arguments), not coda-jax options.
PLAIN_FP8_SETTINGS = ("idiom", "fuse", "lm_head", "promote_k")
# Settings of a run that are not coda-jax options: JAX's automatic PGLE (JAX_ENABLE_PGLE=1,
# JAX_PGLE_PROFILING_RUNS=N) and the ahead-of-time PGLE compile (PGLE_AOT=N); xla_* settings
# are XLA options of the step's compile.
PGLE_SETTINGS = ("JAX_ENABLE_PGLE", "JAX_PGLE_PROFILING_RUNS", "PGLE_AOT")
PGLE_ON = ("1", "yes", "true")
SETTINGS_RULE = ("a run's settings are coda-jax options (e.g. cross_entropy.save_logits=false; "
                 "coda_jax.options.parse_overrides), xla_* XLA compile options, " + ", ".join(PGLE_SETTINGS))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of ``--runs``: ``"pallas:cross_entropy.save_logits=false,xla_gpu_x=0"``.

    Attributes:
      spec: the text (the run's name in the results).
      model: ``"plain"`` or a backend.
      options: keyword arguments of :func:`coda_jax.options.options`, in force while the
        run's step is traced.
      xla_options: XLA options of the step's compile (settings named ``xla_*``).
      pgle_runs: profiled runs of JAX's automatic PGLE (0: off).
      aot_steps: traced steps of the ahead-of-time PGLE compile (0: off).
      model_args: the model's own arguments (``plain_fp8``: ``idiom``, ``fuse``; a CodaLlama
        backend: ``fp8``).
    """

    spec: str
    model: str
    options: dict[str, Any]
    xla_options: dict[str, str]
    pgle_runs: int = 0
    aot_steps: int = 0
    model_args: dict[str, Any] = dataclasses.field(default_factory=dict)


def split_runs(text: str) -> list[str]:
    """``--runs`` -> one spec per run. Runs are separated by commas, and so are one run's
    settings: an item that names a model (``pallas``, ``pallas:...``) starts a run, any other
    continues the one before (``"plain,pallas:a.b=1,c.d=2,plain"`` -> ``["plain",
    "pallas:a.b=1,c.d=2", "plain"]``)."""
    runs: list[str] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item.partition(":")[0] in MODELS:
            runs.append(item)
        elif runs and ":" in runs[-1]:
            runs[-1] += "," + item
        else:
            raise ValueError(f"--runs: {item!r} is not a run: a run is {', '.join(MODELS)}, optionally followed "
                             "by ':' and its settings (option=value, separated by commas)")
    return runs


def parse_run(spec: str) -> RunSpec:
    """``"pallas:cross_entropy.save_logits=false,xla_gpu_x=0"`` -> its :class:`RunSpec`;
    ``ValueError`` naming the run and the rule it breaks."""
    model, _, rest = spec.partition(":")
    if model not in MODELS:
        raise ValueError(f"run {spec!r}: the model must be {MODEL_RULE}")
    items = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"run {spec!r}: settings are name=value, got {item!r}")
        items[key.strip()] = value.strip()
    xla_options = {k: v for k, v in items.items() if k.startswith("xla_")}
    pgle = {k: items.pop(k) for k in PGLE_SETTINGS if k in items}
    model_args: dict[str, Any] = {}
    if model == "plain_fp8":
        own = {k: items.pop(k) for k in PLAIN_FP8_SETTINGS if k in items}
        if "idiom" in own:
            if own["idiom"] not in IDIOMS:
                raise ValueError(f"run {spec!r}: idiom must be one of {', '.join(IDIOMS)}, got {own['idiom']!r}")
            model_args["idiom"] = own["idiom"]
        for key in ("fuse", "lm_head"):
            if key in own:
                model_args[key] = _flag(spec, key, own[key])
        if "promote_k" in own:
            model_args["promote_k"] = _int_setting(spec, "promote_k", own["promote_k"])
    elif "fp8" in items:  # a CodaLlama run in FP8: LlamaConfig(fp8=Fp8Recipe(scaling=..., lm_head=...))
        value = items.pop("fp8").lower()
        scaling = {"true": "delayed", "1": "delayed", "delayed": "delayed", "current": "current",
                   "false": None, "0": None}
        if value not in scaling:
            raise ValueError(f"run {spec!r}: fp8 must be true (delayed scaling), current or false, got {value!r}")
        if scaling[value]:
            model_args["fp8"] = scaling[value]
        if "lm_head" in items:
            model_args["lm_head"] = _flag(spec, "lm_head", items.pop("lm_head"))
        if "promote_k" in items:
            model_args["promote_k"] = _int_setting(spec, "promote_k", items.pop("promote_k"))
        if "swiglu_input" in items:
            model_args["swiglu_input"] = items.pop("swiglu_input")
            if model_args["swiglu_input"] not in SWIGLU_INPUTS:
                raise ValueError(f"run {spec!r}: swiglu_input must be one of {', '.join(SWIGLU_INPUTS)}")
    for key in ("lm_head", "promote_k", "swiglu_input"):
        if key in items:
            raise ValueError(f"run {spec!r}: {key} is a setting of FP8 runs (plain_fp8, or fp8=true)")
    if "fp8_kernel" in items:  # CuteDslLowering(fp8_kernel=...): FP8 GEMMs on its kernel or on XLA
        if model != "cutedsl":
            raise ValueError(f"run {spec!r}: fp8_kernel is a setting of cutedsl runs")
        model_args["fp8_kernel"] = _flag(spec, "fp8_kernel", items.pop("fp8_kernel"))
    try:
        pgle_runs = (int(pgle.get("JAX_PGLE_PROFILING_RUNS", "3"))
                     if pgle.get("JAX_ENABLE_PGLE", "").lower() in PGLE_ON else 0)
        aot_steps = int(pgle.get("PGLE_AOT", "0") or 0)
    except ValueError:
        raise ValueError(f"run {spec!r}: JAX_PGLE_PROFILING_RUNS and PGLE_AOT take a number of steps") from None
    try:
        overrides = parse_overrides({k: v for k, v in items.items() if k not in xla_options}, source=f"run {spec!r}")
    except OptionError as e:
        raise ValueError(f"{e} ({SETTINGS_RULE})") from None
    return RunSpec(spec, model, overrides, xla_options, pgle_runs, aot_steps, model_args)


def _flag(spec: str, key: str, value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"run {spec!r}: {key} must be true or false, got {value!r}")
    return value.lower() in ("true", "1")


def _int_setting(spec: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"run {spec!r}: {key} must be an integer, got {value!r}") from None


@contextlib.contextmanager
def pgle(runs: int):
    """Within (``runs`` > 0): JAX's automatic PGLE on, ``runs`` profiled runs per function."""
    if not runs:
        yield
        return
    old = jax.config.jax_enable_pgle, jax.config.jax_pgle_profiling_runs
    jax.config.update("jax_enable_pgle", True)
    jax.config.update("jax_pgle_profiling_runs", runs)
    try:
        yield
    finally:
        jax.config.update("jax_enable_pgle", old[0])
        jax.config.update("jax_pgle_profiling_runs", old[1])


@contextlib.contextmanager
def run_context(run: RunSpec, mesh, tokens: int = 0, block_weights_per_width: int | None = None):
    """A run's coda-jax options, its mesh (if any), PGLE (if asked for) and the FSDP split
    that ``examples/train_llama.py --fsdp-split auto`` picks for ``tokens`` a step (unless
    the option ``mesh.fsdp_split`` is set, by the run or the process)."""
    with options(**run.options), (jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()), \
            pgle(run.pgle_runs), _lowering(run), \
            partitioning.fsdp_split_as(partitioning.auto_fsdp_split(mesh, tokens, block_weights_per_width)):
        yield


def _lowering(run: RunSpec):
    """The lowering a run asks for: ``cutedsl:fp8_kernel=false`` hands the CuTeDSL backend's
    FP8 GEMMs to XLA (``CuteDslLowering(fp8_kernel=False)``); otherwise the backend's own."""
    if "fp8_kernel" not in run.model_args:
        return contextlib.nullcontext()
    from coda_jax.backend import use_lowering
    from coda_jax.ffi.lowering import CuteDslLowering

    return use_lowering(CuteDslLowering(fp8_kernel=run.model_args["fp8_kernel"]))


# The shape is a tuple for multi-output fusions (the optimizer's update of p, m and v).
_FUSION = re.compile(r"^\s*%(\S+) = (\([^()]*\)|\S+) fusion\((.*?)\), kind=")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_DEDUP = re.compile(r'deduplicated_name="([^"]*)"')


PGLE_FLAG = "xla_gpu_pgle_profile_file_or_directory_path"


def aot_pgle_compile(train_step, state, inputs, targets, compiled, steps: int, workdir: Path):
    """JAX's manual (ahead-of-time) profile-guided latency estimation: ``steps`` runs of
    ``compiled`` traced, the trace turned into XLA's profiled-instructions proto (each
    instruction's measured time: the Mosaic GPU custom calls included where the trace
    attributes their kernels), and the step compiled again with it
    (``xla_gpu_pgle_profile_file_or_directory_path``). Unlike the automatic mode, the result
    is a compiled executable, so its schedule can be read (``hlo_schedule.py``).

    Returns ``(state, recompiled, info)``; ``info``: the proto's size and how many
    custom-call instructions it names (0 on a CPU, whose trace has no GPU kernels)."""
    import glob

    from jax.experimental.profiler import get_profiled_instructions_proto

    trace_dir = workdir / "trace"
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(steps):
            state, loss = compiled(state, inputs, targets)
        jax.block_until_ready(loss)
    runs = sorted(glob.glob(str(trace_dir / "plugins" / "profile" / "*")))
    proto = get_profiled_instructions_proto(runs[-1]) if runs else b""
    path = workdir / "pgle_profile.pb"
    path.write_bytes(proto)
    recompiled = train_step.lower(state, inputs, targets).compile({PGLE_FLAG: str(path)})
    return state, recompiled, {"bytes": len(proto), "custom_calls": proto.count(b"custom-call")}


def hlo_fusions(hlo: str, kernel: str) -> dict | None:
    """What an XLA kernel of a profile is in the compiled ``hlo``: the fusion instructions
    named ``kernel`` (its last ``_N`` read as ``.N``), directly or as their deduplicated
    kernel: ``{"count", "shape", "operands", "op_name"}`` of the first, or None."""
    dotted = re.sub(r"_(\d+)$", r".\1", kernel)
    hits = []
    for line in hlo.splitlines():
        if " fusion(" not in line or (dotted not in line and kernel not in line):
            continue
        m, dedup = _FUSION.match(line), _DEDUP.search(line)
        if m and dotted in (m.group(1), dedup and dedup.group(1)):
            hits.append((m, _OP_NAME.search(line)))
    if not hits:
        return None
    m, op = hits[0]
    return {"count": len(hits), "shape": m.group(2), "operands": m.group(3)[:160],
            "op_name": op.group(1)[-120:] if op else ""}


def step_profile(compiled, state, inputs, targets, steps: int, top_kernels: int = 15):
    """``(state, summary)``: ``steps`` train steps traced back to back (optimizer included,
    each step's donated state fed to the next) and the per-step kernel summary of
    ``profile_block.gpu_summary`` (mean over the GPUs: device, busy, overlap, idle ms and
    ms by kernel class; ``top_kernels``: how many of the longest kernels it lists)."""
    from benchmarks.device_time import trace_kernels
    from benchmarks.profile_block import gpu_summary, mean_over_gpus

    box = [state]

    def one():
        box[0], loss = compiled(box[0], inputs, targets)
        return loss

    m = mean_over_gpus(gpu_summary(ks, steps) for ks in trace_kernels(one, (), steps).values())
    summary = {k: m[k] for k in ("device_ms", "busy_ms", "overlap_ms", "idle_ms")}
    summary["by_class"] = dict(sorted(m["by_class"].items()))
    if "collectives" in m:
        summary["collectives"] = m["collectives"]
    top = sorted(m["by_kernel"].items(), key=lambda kv: -kv[1])[:top_kernels]
    summary["top_kernels"] = [[k[:100], round(ms, 3)] for k, ms in top]
    summary["kernel_calls"] = {k[:100]: round(m["calls"][k], 3) for k, _ in top}  # launches per step
    return box[0], summary


# A Mosaic GPU kernel's serialized module (and hash) in its custom call's backend_config: tens
# of kB each, of no use to a reader of the schedule.
_KERNEL_BYTES = re.compile(r'(module|kernel_hash) = "(?:[^"\\]|\\.)*"')


def file_name(text: str) -> str:
    """``text`` (a run spec or a configuration's tag) as a file or folder name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def write_hlo(hlo: str, path: Path) -> None:
    """The compiled step's HLO text (its schedule) to ``path`` (gzip), each kernel's
    serialized module replaced by ``<stripped>`` (a line still over 8000 characters keeps its
    first and last 3000)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = _KERNEL_BYTES.sub(r'\1 = "<stripped>"', hlo).splitlines()
    with gzip.open(path, "wt") as f:
        f.write("\n".join(x if len(x) <= 8000 else x[:3000] + " <...> " + x[-3000:] for x in lines) + "\n")


def measure(spec: str, cfg, tokens, steps: int, rounds: int, lr: float = 3e-4, mesh=None,
            profile: bool = False, hlo_out: Path | None = None, profile_top: int = 15) -> dict:
    """One run: build, compile, time. ``tokens [B, S+1]`` int32. With ``mesh``: the state
    FSDP-split over its "fsdp" axis (replicated over "data"), the batch over both. With
    ``profile``, also the kernel summary of the whole step (:func:`step_profile`, its
    ``profile_top`` longest kernels). With ``hlo_out``, the compiled step's HLO goes to
    ``<hlo_out>/hlo_<run>.txt.gz`` (:func:`write_hlo`)."""
    run = parse_run(spec)
    name, xla_options = run.model, run.xla_options
    # JAX_ENABLE_PGLE=1: JAX's automatic profile-guided latency estimation. The step is then
    # called through jit dispatch (not compiled ahead of time): its first N runs are profiled
    # and it is compiled again with the measured op costs, so XLA's scheduler can place
    # collectives beside the custom kernels. PGLE_AOT=N: the same from N traced steps, ahead
    # of time (aot_pgle_compile); the recompiled step is the one timed and whose schedule is read.
    pgle_runs, aot_steps = run.pgle_runs, run.aot_steps
    pgle_info = None
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with run_context(run, mesh, inputs.size, cfg.block_weights_per_width):
        if name in PLAIN_MODELS:  # CodaLlama's initial weights, so that the runs' losses compare step by step
            cls = PlainLlama if name == "plain" else PlainFp8Llama
            model = cls.from_coda(CodaLlama(cfg, rngs=nnx.Rngs(0), backend="xla"), **run.model_args)
        else:
            fp8 = run.model_args.get("fp8")
            recipe = Fp8Recipe(scaling=fp8, lm_head=run.model_args.get("lm_head", False),
                               **{k: run.model_args[k] for k in ("promote_k", "swiglu_input") if k in run.model_args}
                               ) if fp8 else None
            model = CodaLlama(cfg.replace(fp8=recipe) if fp8 else cfg, rngs=nnx.Rngs(0), backend=name)
        # FP8 GEMMs the compiled step should hold (checked against its HLO on a GPU): plain_fp8's,
        # or a CodaLlama FP8 block's 12 (forward, dgrad and wgrad of its four projections).
        # (On a kernel backend the FP8 GEMMs are its own kernels, not cuBLASLt calls: no check.)
        fp8_expected = (model.expected_fp8_gemms() if name == "plain_fp8"
                        else 12 * cfg.num_layers + 3 * run.model_args.get("lm_head", False)
                        if run.model_args.get("fp8") and name == "xla" else None)
        plain = name in PLAIN_MODELS
        split = "width" if plain else partitioning.fsdp_split_on(mesh)
        if mesh is not None and not plain and partitioning.axis_size(mesh, "fsdp") > 1:
            print(f"{spec}: FSDP splits the weights' {split}", flush=True)
        opt = nnx.Optimizer(model, training.adamw_cosine(lr, 10, 1000), wrt=nnx.Param)
        state = nnx.state((model, opt))
        shardings = None
        if mesh is not None:
            state = shard_plain_state(state, mesh) if plain else shard_state(state, mesh)
            shardings = jax.tree.map(lambda x: x.sharding, state)
            inputs, targets = (jax.device_put(x, batch_sharding(mesh)) for x in (inputs, targets))
        # The updated state keeps the input's placement: the ahead-of-time compiled step
        # below takes its own output as the next input.
        train_step, _, _ = training.make_steps(model, opt, shardings)
        del model, opt
        t0 = time.perf_counter()
        if pgle_runs:
            hlo_source = train_step.lower(state, inputs, targets).compile(xla_options)  # the step's HLO and memory
            compiled = train_step
        else:
            compiled = hlo_source = train_step.lower(state, inputs, targets).compile(xla_options)
        compile_s = time.perf_counter() - t0
        # A fresh FP8 model's first step only fills its amax histories (training.make_steps):
        # one step run that the optimizer does not count.
        calibration = int(training.fp8_uncalibrated(state))
        state, loss = compiled(state, inputs, targets)
        first_loss = float(loss)
        first_step_s = time.perf_counter() - t0
        calls = 1 + pgle_runs + 1  # steps run, against the optimizer's count of steps applied
        losses = [loss]  # each step's loss (device scalars, read once at the end: no sync per step)
        for _ in range(pgle_runs + 1):  # the profiled runs, then the recompiled step's first run
            state, loss = compiled(state, inputs, targets)
            losses.append(loss)
        jax.block_until_ready(loss)
        if aot_steps:
            with tempfile.TemporaryDirectory() as tmp:
                t1 = time.perf_counter()
                state, compiled, pgle_info = aot_pgle_compile(train_step, state, inputs, targets, compiled,
                                                              aot_steps, Path(tmp))
                calls += aot_steps  # (their losses are not kept)
                hlo_source = compiled
                compile_s += time.perf_counter() - t1  # the profiled steps and the second compile
            print(f"{spec}: PGLE profile of {aot_steps} steps: {pgle_info['bytes']} bytes, "
                  f"{pgle_info['custom_calls']} custom-call instructions named", flush=True)
    mem = hlo_source.memory_analysis()
    # plain_fp8 on a GPU: its FP8 GEMM calls counted in the compiled step (none on a CPU: no cuBLASLt)
    fp8_check = fp8_expected is not None and jax.devices()[0].platform == "gpu"  # and CodaLlama FP8
    hlo = hlo_source.as_text() if mesh is not None or profile or hlo_out or fp8_check else ""  # tens of MB at 1B: once
    fp8_row = {}
    if fp8_expected is not None:
        fp8_row["fp8_gemm_calls_expected"] = fp8_expected
    if fp8_check:
        found = len(fp8_gemm_calls(hlo))
        kinds = fp8_gemm_kinds(hlo)  # cuBLASLt's calls and the fusions (Triton, cuDNN) over FP8 operands
        fp8_row.update(fp8_gemm_calls=found, fp8_gemm_kinds=kinds, cublas_calls=gemm_call_targets(hlo))
        on_fp8 = sum(kinds.values())
        verdict = ("" if found == fp8_expected else
                   f" -- {on_fp8 - found} more as fusions over FP8 operands {kinds}" if on_fp8 == fp8_expected else
                   f" -- MISMATCH: {fp8_expected - on_fp8} FP8 dots run on 16-bit operands (FP8 GEMMs by kind: {kinds})")
        print(f"FP8 {spec}: {found} FP8 GEMM calls (__cublas$lt$matmul$f8) in the compiled step, {fp8_expected} "
              f"expected{verdict}; cuBLAS calls by target: {fp8_row['cublas_calls']}", flush=True)
    if hlo_out is not None:
        write_hlo(hlo, hlo_out / f"hlo_{file_name(spec)}.txt.gz")
    gather_lines = activation_gathers(hlo, *inputs.shape) if mesh is not None else []
    for line in gather_lines[:20]:
        print(f"{spec}: activation-shaped all-gather: {line}", flush=True)
    # What the schedule puts between each async collective's start and done (hlo_schedule.py)
    schedule = window_summary(collective_windows(hlo)) if mesh is not None else ""
    for line in filter(None, schedule.splitlines()):
        print(f"SCHEDULE {spec}: {line}", flush=True)
    # A jit-dispatched (PGLE) step is called in its tracing context, lest a call retrace it.
    with run_context(run, mesh, inputs.size, cfg.block_weights_per_width) if pgle_runs else contextlib.nullcontext():
        for _ in range(2):  # warm-up
            state, loss = compiled(state, inputs, targets)
            losses.append(loss)
        jax.block_until_ready(loss)
        calls += 2 + rounds * steps
        per_round = []
        with ClockSampler() as clock:  # the GPUs' clock and power over the timed rounds
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(steps):
                    state, loss = compiled(state, inputs, targets)
                    losses.append(loss)
                jax.block_until_ready(loss)
                per_round.append((time.perf_counter() - t) / steps * 1e3)
        if clock.summary:
            print(f"CLOCK {spec}: SM {clock.summary['sm_clock_mhz']:.0f} MHz, {clock.summary['power_w']:.0f} W "
                  f"(medians of {clock.summary['samples']} samples over the timed rounds)", flush=True)
        # An FP8 step whose amaxes or gradients are not finite is skipped (Fp8Recipe.on_nonfinite):
        # the optimizer's step count then falls behind the steps run (and the loss behind the baselines').
        applied = int(jax.device_get(state[1]["step"][...]))
        prof = None
        if profile:
            state, prof = step_profile(compiled, state, inputs, targets, steps, profile_top)
    ms = statistics.median(per_round)
    if prof:
        cls = "  ".join(f"{c} {v:.2f}" for c, v in sorted(prof["by_class"].items(), key=lambda kv: -kv[1]))
        print(f"PROFILE {spec}: device {prof['device_ms']:.2f} busy {prof['busy_ms']:.2f} overlap "
              f"{prof['overlap_ms']:.2f} idle {prof['idle_ms']:.2f} ms/step: {cls}", flush=True)
        if (c := prof.get("collectives")) is not None:
            parts = " ".join(f"{h:.1f}/{t:.1f}" for h, t in zip(c["hidden_by_part"], c["by_part"]))
            near = "  ".join(f"{k} {v:.2f}" for k, v in sorted(c["beside"].items(), key=lambda kv: -kv[1]))
            print(f"PROFILE {spec}: collectives {c['ms']:.2f} ms/step, hidden {c['hidden_ms']:.2f}; per tenth of "
                  f"the step (hidden/all ms): {parts}; beside them: {near}", flush=True)
        prof["fusions"] = {k: f for k, _ in prof["top_kernels"] if (f := hlo_fusions(hlo, k)) is not None}
        for k, kms in prof["top_kernels"]:
            f = prof["fusions"].get(k)
            what = f"  = {f['count']} x {f['shape']} fusion({f['operands'][:60]}) {f['op_name'][-50:]}" if f else ""
            print(f"PROFILE {spec}:   {kms:8.3f} ms  {k}{what}", flush=True)
    n_tok = inputs.shape[0] * inputs.shape[1]
    if applied != calls - calibration:
        print(f"WARNING {spec}: the optimizer applied {applied} of the {calls} steps run "
              f"({calibration} FP8 calibration step; the others were skipped: a non-finite amax or gradient)",
              flush=True)
    del state, compiled, train_step
    gc.collect()
    return {"run": spec, "ms_per_step": ms, "rounds_ms": per_round, "tokens_per_s": n_tok / ms * 1e3,
            "compile_s": compile_s, "first_step_s": first_step_s, "first_loss": first_loss,
            "last_loss": float(loss), "steps_run": calls, "steps_applied": applied, "calibration_steps": calibration,
            "losses": [round(float(x), 6) for x in jax.device_get(losses)],
            "temp_gib": getattr(mem, "temp_size_in_bytes", 0) / 2 ** 30,
            "devices": len(jax.devices()) if mesh is not None else 1,
            **({"fsdp_split": split} if mesh is not None and not plain else {}), "activation_all_gathers": len(gather_lines),
            # the HLO of each (first 20), to tell a gathered kernel operand from an index vector
            "activation_gather_lines": gather_lines[:20], **({"collective_windows": schedule} if schedule else {}),
            **({"pgle_profile": pgle_info} if pgle_info else {}), **fp8_row,
            **({"clock": clock.summary} if clock.summary else {}),
            **({"profile": prof} if prof else {})}


def write_rows(out: Path, tag: str, rows: list[dict]) -> None:
    """``rows`` as configuration ``tag`` of ``<out>/train_step.json`` (other tags kept)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "train_step.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[tag] = rows
    path.write_text(json.dumps(data, indent=1))


def table(rows: list[dict], title: str) -> str:
    plain = [r["tokens_per_s"] for r in rows if r["run"] == "plain"]
    base = statistics.mean(plain) if plain else None
    lines = [f"### {title}", ""]
    if len(plain) > 1:
        lines += [f"plain runs: {', '.join(f'{p:,.0f}' for p in plain)} tokens/s "
                  f"(spread {100 * (max(plain) - min(plain)) / base:.1f} %)", ""]
    fp8_runs = [r["tokens_per_s"] for r in rows if r["run"] == "plain_fp8"]  # the default plain FP8 run
    base8 = statistics.mean(fp8_runs) if fp8_runs else None
    col8 = " vs plain FP8 |" if base8 else ""
    lines += ["| run | ms/step | tokens/s | tokens/s per device | vs plain JAX |" + col8 + " compile s | "
              "compile + first step s | temp GiB | activation all-gathers | loss: step 1 / lowest / last | SM MHz / W (medians) |",
              "|---|---|---|---|---|" + ("---|" if base8 else "") + "---|---|---|---|---|---|"]
    for r in rows:
        x = f"{r['tokens_per_s'] / base:.3f}x" if base else "-"
        if base8:
            x += f" | {r['tokens_per_s'] / base8:.3f}x"
        nd = r.get("devices", 1)
        clk = f"{c['sm_clock_mhz']:.0f} / {c['power_w']:.0f}" if (c := r.get("clock")) else "-"
        lines.append(f"| {r['run']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / nd:,.0f} | "
                     f"{x} | {r['compile_s']:.1f} | {r['first_step_s']:.1f} | {r['temp_gib']:.1f} | "
                     f"{r.get('activation_all_gathers', 0)} | {r['first_loss']:.4f} / "
                     f"{min(r['losses']):.3g} / {r['last_loss']:.3g} | {clk} |")
    fp8 = [r for r in rows if "fp8_gemm_calls" in r]
    if fp8:  # the HLO check of the FP8 runs (on a GPU)
        lines += ["", "FP8 GEMM calls (`__cublas$lt$matmul$f8`) found / expected: " + ", ".join(
            f"{r['run']} {r['fp8_gemm_calls']} / {r['fp8_gemm_calls_expected']}"
            + (f" (FP8 GEMMs by kind: {r['fp8_gemm_kinds']})" if r.get("fp8_gemm_kinds", {}).keys() - {"cublaslt"} else "")
            for r in fp8)]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="1b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--runs", default="plain,xla,pallas,plain",
                    help="comma-separated runs: plain or a backend, each optionally followed by ':' and its "
                         "settings, e.g. plain,pallas:cross_entropy.save_logits=false,routing.xla_output_below=0,plain")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tag", default=None, help="name of this configuration in train_step.json")
    ap.add_argument("--mesh", default=None, help="e.g. data=2 or fsdp=2 or data=2,fsdp=4 (all devices of the host)")
    ap.add_argument("--mesh-type", default="auto", choices=["auto", "explicit"],
                    help="the mesh's axis types (the plain baseline gathers each weight where it is used under "
                         "explicit)")
    ap.add_argument("--remat", default="none", choices=["none", "block"],
                    help="activation checkpointing of every model's blocks (LlamaConfig.remat; the plain "
                         "baseline's blocks too)")
    ap.add_argument("--profile", action="store_true",
                    help="also trace --steps whole train steps per run (optimizer included) and print the kernel "
                         "classes' device time (PROFILE lines; 'profile' in train_step.json)")
    ap.add_argument("--hlo-out", default=None,
                    help="write each run's compiled step (HLO text in schedule order, kernel modules stripped) "
                         "to DIR/<configuration>/hlo_<run>.txt.gz")
    ap.add_argument("--profile-top", type=int, default=15, help="with --profile: the longest kernels listed per run")
    args = ap.parse_args(argv)
    for flag in ("batch", "seq", "steps", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        specs = split_runs(args.runs)
        for s in specs:
            parse_run(s)
    except ValueError as e:
        ap.error(str(e))
    try:
        mesh = parse_mesh(args.mesh, args.mesh_type == "explicit")
    except ValueError as e:
        ap.error(str(e))
    cfg = PRESETS[args.preset](remat=args.remat)
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    tokens = jax.random.randint(jax.random.key(5), (args.batch, args.seq + 1), 0, cfg.vocab_size, jnp.int32)
    tag = args.tag or (f"{args.preset}{'' if args.layers is None else f'-{args.layers}L'} {args.batch}x{args.seq}"
                       + (f" mesh {args.mesh}" if args.mesh else "")
                       + (" explicit" if args.mesh and args.mesh_type == "explicit" else "")
                       + (" remat block" if args.remat == "block" else ""))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {tag}", flush=True)
    rows = []
    out = Path(args.out) if args.out else None
    for spec in specs:
        try:
            rows.append(measure(spec, cfg, tokens, args.steps, args.rounds, mesh=mesh, profile=args.profile,
                                hlo_out=Path(args.hlo_out) / file_name(tag) if args.hlo_out else None,
                                profile_top=args.profile_top))
            print(json.dumps(rows[-1]), flush=True)
            r = rows[-1]
            # One line per finished run, and train_step.json rewritten: a run cut by a timeout
            # leaves the runs before it on record.
            print(f"DONE {spec}: {r['ms_per_step']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
                  f"compile + first step {r['first_step_s']:.1f} s, loss {r['first_loss']:.4f} -> "
                  f"{r['last_loss']:.3g} (lowest {min(r['losses']):.3g}), steps applied {r['steps_applied']} / {r['steps_run']}", flush=True)
            if out is not None:
                write_rows(out, tag, rows)
        except Exception as e:  # noqa: BLE001  (one failing run must not hide the others)
            print(f"RUN FAILED {spec}: {type(e).__name__}: {e}", flush=True)
    md = table(rows, f"train step, {tag}")
    if out is not None:
        write_rows(out, tag, rows)
        with open(out / "train_step.md", "a") as f:
            f.write(md + "\n\n")
    print(md, flush=True)
    return rows


if __name__ == "__main__":
    main()
