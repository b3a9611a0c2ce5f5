"""Train a small Llama (``CodaLlama``) on public-domain English text shipped with the repo.

    python examples/train_llama.py                      # tiny preset, CPU-friendly, 200 steps
    python examples/train_llama.py --backend pallas --preset 1b --steps 300   # on an H100

AdamW with linear warm-up + cosine decay (:func:`coda_jax.training.adamw_cosine`; peak
``--lr`` and ``--warmup`` default to the preset's: 2e-3 after 40 steps for ``tiny``, 3e-3
after 20 for the others), a jitted train step (:func:`coda_jax.training.make_steps`:
functional NNX, the model and optimizer state are donated, so the step updates them in
place), a progress bar with loss and tokens/s (MFU on a GPU), a loss-curve PNG and an orbax
checkpoint in ``--out``; running again with the same ``--out`` resumes from the last
checkpoint.

The loop never waits for a step to finish except every ``--log-every`` steps (and at
evaluations and checkpoints): losses stay on the device until then, so the host prepares
the next batches while the GPU works and the queue stays full.

The summary (``summary.json``, printed at the end with a ``steady state:`` line) leads with
the one rate to read, ``tokens_per_s``: the steady state, over the ``timed_steps`` train
steps after the compiling first one, between those synchronizations, evaluation and
checkpoint pauses excluded; on a GPU ``mfu`` is its model FLOPs utilization per device
against the H100's bf16 dense peak. The other timings are named for what they hold:
``first_step_s`` (tracing, compilation and the first step) and
``wall_tokens_per_s_with_eval_and_checkpoints`` (the whole loop after the first step, wall
clock, with the evaluation step's compile, evaluations and checkpoints, which dominate
short runs).

Several processes (``jax.distributed``; docs/multi_gpu.md#several-processes-and-hosts): with
``--coordinator HOST:PORT --num-processes N --process-id I`` in each process (what
``scripts/launch_local.sh N`` passes), or ``--distributed`` under a cluster manager JAX
detects (SLURM, Open MPI, ...: it supplies those three). Without either the script runs as
one process and never calls ``jax.distributed.initialize``. The mesh then spans every
process's devices, ``--batch`` is the global batch, each process cuts only the rows its
devices hold, only process 0 prints and writes ``args.json``, the plot and the summaries, and
every process takes part in each orbax checkpoint (``--out`` must be one directory all
processes see), which resumes onto another process count or mesh.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax import partitioning
from coda_jax.fp8 import SCALINGS, SWIGLU_INPUTS, Fp8Recipe
from coda_jax.layers import PRESETS, CodaLlama, LlamaConfig
from coda_jax.layers.tensor_parallel import check_tensor_parallel, tensor_parallel_size
from coda_jax.sharding import batch_from_rows, mesh_from_spec, shard_state, token_shards
from coda_jax.training import adamw_cosine, fp8_uncalibrated, make_steps

import text_data  # examples/text_data.py: Python puts a script's own folder first on sys.path

# bf16 dense peak of one H100 SXM, for MFU.
H100_BF16_FLOPS = 989e12


# (peak lr, warm-up steps) by preset. The tiny model at 3e-3 after 20 warm-up steps took a
# one-step loss spike (6.5 -> 8.4 at step 39, near the peak rate) in the default run; 2e-3
# after 40 steps trains without one and ends lower. The larger presets (and a Hugging Face
# starting point) keep the settings their runs were made with.
DEFAULT_SCHEDULE = (3e-3, 20)
PRESET_SCHEDULES = {"tiny": (2e-3, 40)}


def fill_schedule(args, preset: str | None) -> None:
    """Set ``args.lr`` / ``args.warmup`` left unset (``None``) to ``preset``'s schedule
    (:data:`PRESET_SCHEDULES`; :data:`DEFAULT_SCHEDULE` for other presets and ``None``)."""
    lr, warmup = PRESET_SCHEDULES.get(preset, DEFAULT_SCHEDULE)
    args.lr = lr if args.lr is None else args.lr
    args.warmup = warmup if args.warmup is None else args.warmup


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="xla", choices=["xla", "pallas", "cutedsl", "auto"])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default: the preset's, PRESET_SCHEDULES: 2e-3 for tiny, else 3e-3; "
                        "with --init-from, the starting run's preset's)")
    p.add_argument("--warmup", type=int, default=None,
                   help="linear warm-up steps (default: the preset's, PRESET_SCHEDULES: 40 for tiny, else 20; "
                        "with --init-from, the starting run's preset's)")
    p.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary (the tiny preset uses it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/tiny", help="checkpoint, loss curve and log directory")
    p.add_argument("--ckpt-every", type=int, default=100, help="checkpoint period in steps (0: never)")
    p.add_argument("--eval-every", type=int, default=50, help="evaluation period in steps (0: after the last step only)")
    p.add_argument("--log-every", type=int, default=10,
                   help="steps between host synchronizations (loss fetch, NaN check, progress bar)")
    p.add_argument("--mesh", default=None,
                   help="device mesh, e.g. data=2 or fsdp=8 or data=2,fsdp=4 or data=2,tensor=4 (tensor: Megatron "
                        "tensor parallel blocks; sizes multiply to the device count); "
                        "default: data parallel over all devices (every process's, under jax.distributed). --batch "
                        "is the global batch, split over the mesh (it must divide evenly)")
    p.add_argument("--mesh-type", default="auto", choices=["auto", "explicit"],
                   help="the mesh's axis types: auto (the partitioner places what the layers leave to it) or "
                        "explicit (sharding in types; the layers and the vocabulary-split lookup place every "
                        "array themselves)")
    p.add_argument("--fsdp-split", default="auto", choices=["auto", "width", "features"],
                   help="which dimension FSDP splits each weight along (the option mesh.fsdp_split): "
                        "width (gathered per layer, ZeRO-3), features (few tokens a step: XLA runs the MLP and "
                        "attention tensor-parallel over the fsdp axis), auto (features when each FSDP group's "
                        "tokens a step are at most 0.21 of a block's weights over the width, 6236 for 1b, or each "
                        "device has under 1024)")
    p.add_argument("--init-from", default=None,
                   help="start from these weights (fine-tuning): a Hugging Face checkpoint directory (its config "
                        "and its tokenizer.json replace --preset/--layers/--vocab) or another "
                        "train_llama.py --out directory (its model flags replace these)")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--fp8", action="store_true",
                   help="train the blocks' projections in FP8 (coda_jax.fp8.Fp8Recipe: e4m3 forward, e5m2 gradients, "
                        "delayed scaling; attention, norms and the LM head stay in the compute dtype). Needs a GPU "
                        "with FP8 tensor cores (sm_89+) or the CPU (emulated by XLA)")
    p.add_argument("--fp8-scaling", default="delayed", choices=list(SCALINGS),
                   help="with --fp8: each tensor's scale from its amax history (delayed: the GEMM that produces it "
                        "writes it in FP8) or from its own amax (current: a pass after the GEMM quantizes it)")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="with --fp8: the LM head's three GEMMs in FP8 too (Fp8Recipe(lm_head=True); docs/fp8.md#lm-head)")
    p.add_argument("--fp8-swiglu-input", default="compute", choices=list(SWIGLU_INPUTS),
                   help="with --fp8: how the SwiGLU input is saved for the backward (e4m3: half its bytes and "
                        "memory; Fp8Recipe(swiglu_input=...); docs/fp8.md#the-recipe)")
    p.add_argument("--remat", default="none", choices=["none", "block"],
                   help="activation checkpointing: block = each block keeps only its input and recomputes its "
                        "forward in the backward (less memory, about a third more GEMM work)")
    mp = p.add_argument_group(
        "several processes (jax.distributed.initialize)",
        "Give all three of --coordinator, --num-processes and --process-id (scripts/launch_local.sh does), or "
        "--distributed under a cluster manager JAX detects (SLURM, Open MPI, ...), which then supplies any of "
        "the three left out. With none of these the run is one process.")
    mp.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="address of process 0's coordination service (coordinator_address)")
    mp.add_argument("--num-processes", type=int, default=None, help="number of processes (num_processes)")
    mp.add_argument("--process-id", type=int, default=None, help="this process's index, 0 to N-1 (process_id)")
    mp.add_argument("--distributed", action="store_true",
                    help="call jax.distributed.initialize() with the flags given above, the rest detected from "
                         "the cluster manager (SLURM, Open MPI, Kubernetes, ...)")
    mp.add_argument("--local-device-ids", type=_device_ids, default=None, metavar="I,J,...",
                    help="the GPUs of this host this process uses (local_device_ids), e.g. 0,1,2,3,4,5,6,7 for one "
                         "process per host under SLURM, where JAX otherwise gives each process the one GPU "
                         "numbered by its SLURM_LOCALID; default: JAX's choice")
    args = p.parse_args(argv)
    if not args.init_from:  # else main() fills them once it knows the starting point's model
        fill_schedule(args, args.preset)
    for msg in flag_errors(args):
        p.error(msg)
    return args


# Smallest value of each integer flag (the tokenizer needs 256 bytes + specials).
FLAG_MINIMUMS = {"layers": 1, "steps": 1, "batch": 1, "seq": 1, "warmup": 0, "vocab": 260, "ckpt_every": 0,
                 "eval_every": 0, "log_every": 1, "num_processes": 1, "process_id": 0}
# The jax.distributed flags, which go together unless --distributed lets JAX detect the rest.
PROCESS_FLAGS = ("coordinator", "num_processes", "process_id")


def flag_errors(args) -> list[str]:
    """Rules each flag must meet on its own, as messages naming the flag (empty: all met)."""
    errs = []
    for name, lo in FLAG_MINIMUMS.items():
        v = getattr(args, name)
        if v is not None and v < lo:
            errs.append(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
    if args.lr is not None and not (args.lr > 0 and np.isfinite(args.lr)):
        errs.append(f"--lr must be a finite number > 0, got {args.lr}")
    given = [f for f in PROCESS_FLAGS if getattr(args, f, None) is not None]
    if given and len(given) < len(PROCESS_FLAGS) and not getattr(args, "distributed", False):
        missing = [f for f in PROCESS_FLAGS if f not in given]
        errs.append(f"{', '.join(_flag(f) for f in given)} needs {' and '.join(_flag(f) for f in missing)} "
                    "(or --distributed, to have JAX detect the rest from a cluster manager such as SLURM)")
    n, i = getattr(args, "num_processes", None), getattr(args, "process_id", None)
    if n is not None and i is not None and n >= 1 and not 0 <= i < n:
        errs.append(f"--process-id must be in 0..{n - 1} (--num-processes {n}), got {i}")
    coord = getattr(args, "coordinator", None)
    if coord is not None and not re.fullmatch(r"\S+:\d{1,5}", coord):
        errs.append(f"--coordinator must be HOST:PORT (e.g. localhost:12355 or 10.0.0.1:12355), got {coord!r}")
    if getattr(args, "local_device_ids", None) is not None and not multi_process(args):
        errs.append("--local-device-ids needs --distributed or --coordinator/--num-processes/--process-id")
    return errs


def _device_ids(text: str) -> list[int]:
    """``"0,1,3"`` -> ``[0, 1, 3]`` (argparse type of ``--local-device-ids``)."""
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct device numbers >= 0 separated by commas, got {text!r}")
    return ids


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def multi_process(args) -> bool:
    """Whether the flags ask for ``jax.distributed`` (see :func:`init_distributed`)."""
    return bool(getattr(args, "distributed", False) or getattr(args, "coordinator", None) is not None)


def init_distributed(args) -> None:
    """Joins this process to the others of the run (``jax.distributed.initialize``) when the
    flags ask for it: all three of ``--coordinator``, ``--num-processes`` and
    ``--process-id`` (checked together by :func:`flag_errors`), or ``--distributed`` (JAX
    detects what is not given from the cluster manager). Never for a plain single-process
    run, even under a cluster manager: that run keeps to this process's devices.

    Must come before anything asks JAX for a device. Calling :func:`main` again in a process
    that already joined (a fine-tune after a run) keeps the first run's processes."""
    if not multi_process(args) or jax.distributed.is_initialized():
        return
    kw = {name: v for name, v in (("coordinator_address", args.coordinator), ("num_processes", args.num_processes),
                                  ("process_id", args.process_id), ("local_device_ids", args.local_device_ids))
          if v is not None}
    try:
        jax.distributed.initialize(**kw)
    except (ValueError, RuntimeError) as e:  # no cluster manager detected, coordinator unreachable, ...
        how = "--distributed" if args.distributed else f"--coordinator {args.coordinator}"
        hint = ("; outside a cluster manager JAX detects, give --coordinator, --num-processes and --process-id"
                if args.coordinator is None else "")
        raise SystemExit(f"train_llama.py: error: {how}: jax.distributed.initialize failed: {e}{hint}") from None


def _say(*args, **kw) -> None:
    """``print`` on process 0 only: the other processes of a multi-process run stay quiet."""
    if jax.process_index() == 0:
        print(*args, **kw)


def run_errors(args, cfg: LlamaConfig, train_tokens: int, val_tokens: int, memory_bytes: int | None,
               platform: str, compute_capability: str | None = None) -> list[str]:
    """Rules the flags must meet together with the corpus and the machine (empty: all met).

    ``--seq`` needs ``seq + 2`` tokens in each split; the step's memory, counted from below
    (float32 parameters, gradients and two AdamW moments; one layer's ``[B, H, S, S]``
    float32 attention scores when XLA's attention runs; each layer's saved ``[B*S, ...]``
    activations) must fit the device's ``memory_bytes``.
    """
    errs = []
    for split, n in (("training", train_tokens), ("validation", val_tokens)):
        if args.seq + 2 > n:
            errs.append(f"--seq must be <= {n - 2} (the corpus's {split} split has {n} tokens at --vocab "
                        f"{args.vocab}), got {args.seq}")
    if memory_bytes:
        need = estimate_step_bytes(cfg, args.batch, args.seq, platform, compute_capability)
        if need > memory_bytes:
            errs.append(f"--batch {args.batch} x --seq {args.seq} needs at least {need / 2**30:,.1f} GiB for one "
                        f"training step of this model, more than the device's {memory_bytes / 2**30:,.1f} GiB: "
                        f"lower --seq or --batch{'' if cfg.remat == 'block' else ', or pass --remat block'}")
    return errs


def estimate_step_bytes(cfg: LlamaConfig, batch: int, seq: int, platform: str,
                        compute_capability: str | None = None) -> int:
    """A lower bound on one training step's memory (bytes); see :func:`run_errors`."""
    from coda_jax.ops.attention import plan_attention

    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    params = L * (d * cfg.qkv_size + cfg.num_heads * cfg.head_dim * d + 3 * d * f) + cfg.vocab_size * d
    act = jnp.dtype(cfg.dtype).itemsize
    m = batch * seq
    layer = m * (cfg.qkv_size + 4 * d + 2 * f) * act  # what one block saves for its backward
    # remat="block": each block saves its input and norm carry; one block's activations at a time
    total = 16 * params + (L * layer if cfg.remat == "none" else L * 2 * m * d * act + layer)
    plan = plan_attention(cfg.attention_implementation, dtype=cfg.dtype, seq_len=seq, head_dim=cfg.head_dim,
                          platform=platform, compute_capability=compute_capability)
    if plan.implementation != "cudnn":
        total += batch * cfg.num_heads * seq * seq * 4
    return total


def device_memory_bytes() -> int | None:
    """Memory of this process's first device: the GPU's allocator limit, or the host's RAM on CPU."""
    import os

    dev = jax.local_devices()[0]  # under jax.distributed, jax.devices()[0] may be another process's
    if dev.platform == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    stats = dev.memory_stats() or {}
    return stats.get("bytes_limit")


def fp8_recipe(args) -> Fp8Recipe | None:
    """The run's FP8 recipe (``--fp8``, ``--fp8-scaling``, ``--fp8-lm-head``, ``--fp8-swiglu-input``), or None;
    ``args`` may be an older run's ``args.json`` without these flags."""
    if not getattr(args, "fp8", False):
        return None
    return Fp8Recipe(scaling=getattr(args, "fp8_scaling", "delayed"), lm_head=getattr(args, "fp8_lm_head", False),
                     swiglu_input=getattr(args, "fp8_swiglu_input", "compute"))


def make_config(args, vocab_size: int) -> LlamaConfig:
    if args.preset == "tiny":
        cfg = LlamaConfig.tiny(vocab_size=vocab_size)
    else:  # real widths keep their own vocab size; our tokenizer ids are a subset
        cfg = PRESETS[args.preset]()
    if args.layers is not None:
        cfg = cfg.replace(num_layers=args.layers)
    return cfg.replace(remat=getattr(args, "remat", "none"))  # runs written before --remat: none


def flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    """Training FLOPs per token: 6 * matmul params + attention (causal) 6 * L * S * d."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    per_layer = d * cfg.qkv_size + cfg.num_heads * cfg.head_dim * d + 3 * d * f
    dense = cfg.num_layers * per_layer + cfg.vocab_size * d
    return 6 * dense + 6 * cfg.num_layers * seq * cfg.num_heads * cfg.head_dim


def main(argv=None) -> dict:
    args = parse_args(argv)
    init_distributed(args)  # before any device is asked for
    primary = jax.process_index() == 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on_gpu = jax.local_devices()[0].platform == "gpu"

    corpus = text_data.load_corpus()
    init = _init_source(args)  # with --init-from a train_llama.py run: that run's preset, layers and vocab
    fill_schedule(args, None if "config" in init else args.preset)  # a Hugging Face model is no preset
    if primary:  # how examples/sample.py rebuilds the model
        (out / "args.json").write_text(json.dumps(vars(args), indent=1))
    tok = init.get("tokenizer") or text_data.build_tokenizer([corpus], vocab_size=args.vocab)
    train_tokens, val_tokens = text_data.split_tokens(text_data.encode(tok, corpus))
    cfg = (init.get("config") or make_config(args, tok.get_vocab_size())).replace(
        remat=args.remat, fp8=fp8_recipe(args))
    dev = jax.local_devices()[0]
    for msg in run_errors(args, cfg, len(train_tokens), len(val_tokens), device_memory_bytes(), dev.platform,
                          getattr(dev, "compute_capability", None)):
        raise SystemExit(f"train_llama.py: error: {msg}")
    procs = f" x {jax.process_count()} processes ({len(jax.devices())} devices)" if jax.process_count() > 1 else ""
    _say(f"jax {jax.__version__} on {dev.device_kind}{procs}; backend={args.backend}; preset={args.preset} "
         f"(d={cfg.hidden_size}, layers={cfg.num_layers}, vocab={cfg.vocab_size}); "
         f"{len(train_tokens):,} train tokens", flush=True)

    try:
        mesh = mesh_from_spec(args.mesh, explicit=args.mesh_type == "explicit")
    except ValueError as e:
        raise SystemExit(f"train_llama.py: error: --mesh: {e}") from None
    shards = token_shards(mesh)
    if args.batch % shards:
        raise SystemExit(f"train_llama.py: error: --batch {args.batch} (the global batch) must be a multiple of "
                         f"the mesh's {shards} data shards ({args.mesh or 'data parallel over all devices'}"
                         + (f", {len(jax.devices())} devices in {jax.process_count()} processes"
                            if jax.process_count() > 1 else "") + ")")
    if tensor_parallel_size(mesh) > 1:
        try:
            check_tensor_parallel(cfg, args.batch, args.seq, mesh)
        except ValueError as e:
            raise SystemExit(f"train_llama.py: error: --mesh {args.mesh}: {e}") from None
    split = getattr(args, "fsdp_split", "auto")
    if split == "auto":
        split = partitioning.auto_fsdp_split(mesh, args.batch * args.seq, cfg.block_weights_per_width)
    with partitioning.fsdp_split_as(split):
        return _run(args, out, cfg, train_tokens, val_tokens, mesh, shards, on_gpu, init)


def _run(args, out: Path, cfg: LlamaConfig, train_tokens, val_tokens, mesh, shards: int, on_gpu: bool, init: dict):
    n_dev = 1 if mesh is None else mesh.size
    if mesh is not None:
        _say(f"mesh {dict(zip(mesh.axis_names, mesh.axis_sizes))}"
             f"{' (Explicit axes)' if mesh.are_all_axes_explicit else ''}: global batch {args.batch}, "
             f"{args.batch // shards} sequences per data shard"
             + (f"; FSDP splits the weights' {partitioning.fsdp_split_on(mesh)}" if partitioning.axis_size(mesh, "fsdp") > 1 else ""),
             flush=True)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return _train(args, out, cfg, train_tokens, val_tokens, mesh, n_dev, on_gpu, init.get("load"))


def _init_source(args) -> dict:
    """What ``--init-from`` provides: ``config``, ``tokenizer`` (either may be absent) and
    ``load(model)``, which fills the model's parameters."""
    if not args.init_from:
        return {}
    src = Path(args.init_from)
    if (src / "config.json").exists():  # a Hugging Face directory
        from coda_jax.layers.hf_llama import config_from_hf, load_hf_state_dict
        from coda_jax.layers.pretrained import SafetensorsDirectory

        init = {"config": config_from_hf(json.loads((src / "config.json").read_text()), dtype=jnp.bfloat16),
                "load": lambda model: load_hf_state_dict(model, SafetensorsDirectory(src))}
        if not (src / "tokenizer.json").exists():
            raise SystemExit(f"train_llama.py: error: --init-from {src}: no tokenizer.json; training a Hugging Face "
                             "checkpoint on the shipped text needs the checkpoint's own tokenizer")
        from tokenizers import Tokenizer

        init["tokenizer"] = Tokenizer.from_file(str(src / "tokenizer.json"))
        return init
    if not (src / "args.json").exists():
        raise SystemExit(f"train_llama.py: error: --init-from {src}: neither a Hugging Face directory (config.json) "
                         "nor a train_llama.py run (args.json)")
    run = argparse.Namespace(**json.loads((src / "args.json").read_text()))
    for flag in ("preset", "layers", "vocab"):  # the model and tokenizer are the run's
        setattr(args, flag, getattr(run, flag))

    def load(model):
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager((src / "checkpoints").resolve()) as mgr:
            step = mgr.latest_step()
            if step is None:
                raise SystemExit(f"train_llama.py: error: --init-from {src}: no checkpoint")
            # The run's optimizer, for the checkpoint's structure; its moments follow the
            # model's placement, so every array is restored onto this run's mesh.
            opt = nnx.Optimizer(model, adamw_cosine(run.lr, run.warmup, run.steps), wrt=nnx.Param)
            target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state((model, opt)))
            got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        nnx.update((model, opt), got["state"])

    return {"load": load}


def _train(args, out: Path, cfg: LlamaConfig, train_tokens, val_tokens, mesh, n_dev: int, on_gpu: bool,
           load=None) -> dict:
    primary = jax.process_index() == 0
    model = CodaLlama(cfg, rngs=nnx.Rngs(args.seed), backend=args.backend)
    optimizer = nnx.Optimizer(model, adamw_cosine(args.lr, args.warmup, args.steps), wrt=nnx.Param)

    def place():  # parameters and AdamW moments FSDP-split over "fsdp" (replicated over "data")
        if mesh is not None:  # each process built the same state (one seed) and takes its devices' part
            nnx.update((model, optimizer), shard_state(nnx.state((model, optimizer)), mesh))

    place()
    if load is not None:  # after placing: a run's checkpoint is restored straight onto this mesh
        load(model)
        place()  # a Hugging Face model's weights arrive whole on every process
    shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, nnx.state((model, optimizer)))
    train_step, eval_step, graphdef = make_steps(model, optimizer, shardings)

    def put(tokens: np.ndarray, starts: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """The windows of ``tokens`` at ``starts`` as ``[batch, seq]`` (inputs, targets) on
        the device(s), split over the mesh's data shards; under several processes each
        process cuts only the rows its devices hold."""
        if mesh is None:
            return tuple(jnp.asarray(a) for a in text_data.windows(tokens, starts, args.seq))
        shape = (len(starts), args.seq)
        return tuple(batch_from_rows(lambda lo, hi, k=k: text_data.windows(tokens, starts[lo:hi], args.seq)[k],
                                     shape, mesh) for k in (0, 1))

    def validation() -> tuple[jax.Array, jax.Array]:
        return put(val_tokens, text_data.validation_starts(len(val_tokens), args.batch, args.seq))

    ckpt = _Checkpointer(out / "checkpoints")
    start, history = 0, {"step": [], "loss": [], "val_step": [], "val_loss": []}
    if not args.no_resume and ckpt.latest() is not None:
        start, history = ckpt.restore(model, optimizer)
        _say(f"resumed from step {start} ({out / 'checkpoints'})", flush=True)
    state = nnx.state((model, optimizer))
    if fp8_uncalibrated(state):  # a fresh FP8 model: its first step fills the amax histories only
        starts = text_data.batch_starts(len(train_tokens), args.batch, args.seq, args.seed, start)
        state, loss = train_step(state, *put(train_tokens, starts))
        _say(f"FP8: scales calibrated on the first batch (loss {float(loss):.3f}; no update)", flush=True)
    if start == 0 and load is not None:  # fine-tuning: the starting point's validation loss (FP8: calibrated)
        history["val_before"] = float(eval_step(state, *validation()))
        _say(f"validation loss before training {history['val_before']:.4f} "
             f"(perplexity {np.exp(history['val_before']):.1f})", flush=True)

    tokens_per_step = args.batch * args.seq
    fpt = flops_per_token(cfg, args.seq)
    bar = _Progress(args.steps, start, show=primary)
    pending = []  # (step, loss on the device) since the last synchronization
    window_start, window_steps = None, 0  # the clock starts after the compiling first step
    train_s, timed_steps = 0.0, 0  # train steps between synchronizations, host waits excluded

    def sync(step_done: int):
        """Fetch the pending losses (waits for the device), check them, report the rate."""
        nonlocal window_start, window_steps, train_s, timed_steps
        losses = jax.device_get([l for _, l in pending])
        now = time.perf_counter()
        for (s, _), loss in zip(pending, losses):
            loss = float(loss)
            if not np.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {s}")
            history["step"].append(s)
            history["loss"].append(loss)
        text = f"loss {history['loss'][-1]:.3f}"
        if window_start is not None and window_steps:
            dt = now - window_start
            train_s, timed_steps = train_s + dt, timed_steps + window_steps
            tps = window_steps * tokens_per_step / dt
            text += f"  {tps:,.0f} tok/s"
            if n_dev > 1:
                text += f" ({tps / n_dev:,.0f}/device)"
            if on_gpu:
                text += f" MFU {tps / n_dev * fpt / H100_BF16_FLOPS:5.1%}" + ("/device" if n_dev > 1 else "")
        bar.update(step_done, text)
        pending.clear()
        window_start, window_steps = time.perf_counter(), 0

    t_first = time.perf_counter()
    for step in range(start, args.steps):
        # The step's offsets (a few integers, the same in every process); each process cuts its rows.
        starts = text_data.batch_starts(len(train_tokens), args.batch, args.seq, args.seed, step)
        state, loss = train_step(state, *put(train_tokens, starts))
        pending.append((step, loss))
        window_steps += 1
        last = step + 1 == args.steps
        do_eval = (args.eval_every and (step + 1) % args.eval_every == 0) or last
        do_ckpt = args.ckpt_every > 0 and ((step + 1) % args.ckpt_every == 0 or last)
        if step == start or (step + 1) % args.log_every == 0 or do_eval or do_ckpt or last:
            if step == start:  # the first step compiles: it is not timed
                window_steps = 0
            sync(step + 1)
            if step == start:
                loop_t0 = time.perf_counter()
                first_step_s = loop_t0 - t_first  # tracing, compilation and the first step
        if do_eval:
            history["val_step"].append(step + 1)
            history["val_loss"].append(float(eval_step(state, *validation())))
        if do_ckpt:
            nnx.update((model, optimizer), state)
            ckpt.save(step + 1, model, optimizer, history)
        if do_eval or do_ckpt:
            window_start = time.perf_counter()
    nnx.update((model, optimizer), state)
    bar.close()
    ckpt.close()  # every process: orbax finishes the last checkpoint together
    if primary:
        _plot(history, out / "loss.png")
    summary = {}
    if timed_steps:
        # The figure to read, first: the steady-state rate of the train steps after the
        # compiling first one, between host synchronizations (evaluation and checkpoint pauses
        # excluded), and its MFU on a GPU. The wall rate of the whole loop, with the evaluation
        # step's compile, evaluations and checkpoints, comes later, named for what it holds:
        # those pauses dominate short runs.
        summary["tokens_per_s"] = timed_steps * tokens_per_step / train_s
        if on_gpu:
            summary["mfu"] = summary["tokens_per_s"] / n_dev * fpt / H100_BF16_FLOPS  # per device
        summary["timed_steps"] = timed_steps
        summary["devices"] = n_dev
    summary.update({"first_loss": history["loss"][0] if history["loss"] else None,
                    "last_loss": history["loss"][-1] if history["loss"] else None,
                    "val_loss": history["val_loss"][-1] if history["val_loss"] else None, "steps": args.steps,
                    "backend": args.backend, "preset": args.preset, "tokens_per_step": tokens_per_step})
    if "val_before" in history:
        summary["val_loss_before"] = history["val_before"]
        summary["val_perplexity_before"] = float(np.exp(history["val_before"]))
    if summary["val_loss"] is not None:
        summary["val_perplexity"] = float(np.exp(summary["val_loss"]))
    if args.steps > start:
        summary["first_step_s"] = first_step_s  # tracing, compilation and the first step
    if timed_steps:
        summary["wall_tokens_per_s_with_eval_and_checkpoints"] = \
            (args.steps - start - 1) * tokens_per_step / (time.perf_counter() - loop_t0)
    if mesh is not None and partitioning.axis_size(mesh, "fsdp") > 1:
        summary["fsdp_split"] = partitioning.fsdp_split_on(mesh)
    if primary:  # the same numbers in every process (the losses are the global batch's); one writes them
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "history.json").write_text(json.dumps(history))
    _say(json.dumps(summary), flush=True)
    if timed_steps:
        mfu = f", MFU {summary['mfu']:.1%} a device" if on_gpu else ""
        _say(f"steady state: {summary['tokens_per_s']:,.0f} tokens/s{mfu} over {timed_steps} timed steps "
             f"(compile, evaluation and checkpoints excluded; the whole loop with them: "
             f"{summary['wall_tokens_per_s_with_eval_and_checkpoints']:,.0f} tokens/s)", flush=True)
    return summary


class _Progress:
    """tqdm when available, else one line every few steps; nothing where not ``show`` (the
    processes of a multi-process run other than process 0)."""

    def __init__(self, total: int, start: int, show: bool = True):
        self._show = show
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, dynamic_ncols=True, mininterval=0.5) if show else None
        except ImportError:
            self._bar = None
        self._last = start

    def update(self, step: int, text: str):
        if self._bar is not None:
            self._bar.update(step - self._last)
            self._bar.set_postfix_str(text, refresh=False)
        elif self._show and step % 10 == 0:
            print(f"step {step}: {text}", flush=True)
        self._last = step

    def close(self):
        if self._bar is not None:
            self._bar.close()


class _Checkpointer:
    """orbax checkpoints of (model params, optimizer state, loss history).

    Under several processes every process makes each call: orbax writes each array's shards
    from the processes holding them (one replica each) and the history from process 0, into
    one directory (a file system all processes share). A restore reads onto the shardings of
    the current state, so a checkpoint resumes on another process count or mesh."""

    def __init__(self, directory: Path):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self._mgr = ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def latest(self):
        return self._mgr.latest_step()

    def save(self, step, model, optimizer, history):
        ocp = self._ocp
        self._mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(nnx.state((model, optimizer))), history=ocp.args.JsonSave(history)))

    def restore(self, model, optimizer):
        ocp = self._ocp
        step = self._mgr.latest_step()
        target = nnx.state((model, optimizer))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        got = self._mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), history=ocp.args.JsonRestore()))
        nnx.update((model, optimizer), got["state"])
        return step, got["history"]

    def close(self):
        self._mgr.wait_until_finished()
        self._mgr.close()


def _plot(history, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(history["step"], history["loss"], label="train", lw=1)
    if history["val_step"]:
        ax.plot(history["val_step"], history["val_loss"], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        # The error and its newline in one write: Python's own handler writes them apart, and
        # under the launcher (unbuffered, several processes on one stderr) another process's
        # line could land between them.
        sys.stderr.write(e.code + "\n")
        sys.exit(1)
