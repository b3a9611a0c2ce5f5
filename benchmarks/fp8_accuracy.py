"""FP8 training accuracy: loss curves of FP8 and bf16 models from the same weights and data.

    python -m benchmarks.fp8_accuracy --preset 1b --steps 300 --batch 8 --seq 1024 \
        --runs plain,plain_fp8,xla:fp8,pallas:fp8 [--layers N] [--lr LR] [--seeds 0,1] [--out DIR]

Every run starts from the same weights (a ``CodaLlama`` of the seed; the plain models copy it
with ``from_coda``) and trains on the same batches of the example's corpus
(``examples/text_data.py``, the example's tokenizer) with the example's optimizer
(:func:`coda_jax.training.adamw_cosine`, the preset's learning rate and warm-up) and jitted
step (:func:`coda_jax.training.make_steps`). Runs: ``plain`` (the plain JAX Llama, bf16), ``plain_fp8``
(:class:`benchmarks.plain_fp8_llama.PlainFp8Llama`), ``<backend>`` (CodaLlama in bf16) and
``<backend>:fp8`` (``LlamaConfig(fp8=Fp8Recipe())``), ``<backend>:fp8-current`` (current scaling),
``<backend>:fp8-head`` (the LM head in FP8 too), ``<backend>:fp8-zq8`` (the SwiGLU input saved in
e4m3: ``Fp8Recipe(swiglu_input="e4m3")``), ``<backend>:fp8-margin1`` and ``:fp8-margin2``
(``Fp8Recipe(margin=...)``: delayed scales with 2x or 4x more headroom), ``plain_fp8:fp8-head`` (the plain FP8 baseline's
head in FP8), and two ablations of the plain FP8 baseline: ``plain_fp8:forward`` (only the
projections' forward GEMMs in FP8, the backward as bf16's) and ``plain_fp8:backward`` (only
their dgrad and wgrad in FP8). ``plain:f32`` and ``<backend>:f32`` compute in float32 (the parameters are
float32 in every run), their GEMMs at ``--f32-precision`` (default ``float32``, exact float32
products; a GPU's default is TF32, ``tensorfloat32``, several times faster), each block
recomputed in the backward (``LlamaConfig(remat="block")``: without it the 1B float32 run
ran out of an H100's memory): the ground truth
against which a bf16 or FP8 run's distance says which of two runs that differ is the outlier,
and two float32 implementations' distance the spread that the setting itself gives.
The JSON (``--out``) is written after every run (``rows`` stays null until the last), so a
call stopped by a time limit keeps the runs it ended. The first run is the reference: per run, the relative difference of the training loss averaged
over windows of 25 steps (the largest after the first 50 steps, and the last, signed: below the
reference is negative), and the validation loss after the last step. A fresh FP8 model first
spends one step on its first batch calibrating its scales (``training.fp8_uncalibrated``), then
trains on every batch as the others do. An FP8 run under delayed scaling also records, per step,
how many of its tensors saturated (``saturated``: a new amax beyond what the history's scale let
through, :func:`saturations`), and per tensor the steps it saturated in (``saturated_by_tensor``,
named by :func:`tensor_names`); the table gives the steps with any, and a line per run the
tensors that saturated most often.

``--corpus python-stdlib`` trains on the interpreter's standard library sources (about 10 MB of
Python without its tests) instead of the example's two novels (about 0.2 M tokens): 300 steps of
8 x 1024 tokens see the novels' training tokens about 11 times over, so that the training loss
measures memorization more than modeling; the standard library holds enough tokens for such a
run to see each about once. The title says how many times the run sees its training tokens.

``--lr`` replaces the preset's learning rate (a high one makes even two bf16 implementations
drift apart: run 321); ``--seeds`` repeats every run per seed (the weights and the batches'
order), with a table per seed and one of the largest differences over the seeds, so that an
FP8 run's distance from bf16 is read against two bf16 implementations' distance.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks._examples import example
from benchmarks.plain_fp8_llama import PlainFp8Llama
from benchmarks.plain_llama import PlainLlama
from coda_jax import training
from coda_jax.fp8 import Fp8Meta, Fp8Recipe
from coda_jax.layers import PRESETS, CodaLlama, LlamaConfig
from coda_jax.ops.fp8_cross_entropy import HEAD_TENSORS
from coda_jax.ops.fp8_llama_block import SWIGLU_INPUT, TENSORS

WINDOW = 25
PROGRESS_EVERY = 50  # steps between progress lines
# Standard-library folders left out of ``--corpus python-stdlib``: tests (a third of the bytes,
# much of it generated data), installed packages, and demos.
STDLIB_SKIP = frozenset({"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3", "turtledemo"})


RECIPES = {"fp8": Fp8Recipe(), "fp8-current": Fp8Recipe(scaling="current"), "fp8-head": Fp8Recipe(lm_head=True),
           "fp8-zq8": Fp8Recipe(swiglu_input="e4m3"), "fp8-margin1": Fp8Recipe(margin=1),
           "fp8-margin2": Fp8Recipe(margin=2)}


F32 = "f32"  # <run>:f32, float32 compute
PLAIN_FP8_ABLATIONS = ("forward", "backward")  # plain_fp8:<which GEMMs run in FP8> (PlainFp8Llama's quantized)


def _model(run: str, cfg: LlamaConfig, reference: CodaLlama):
    name, _, flag = run.partition(":")
    if name not in ("plain", "plain_fp8") and flag not in ("", F32, *RECIPES):
        raise ValueError(f"run {run!r}: the settings are {', '.join(':' + r for r in (F32, *RECIPES))}")
    if name in ("plain", "plain_fp8"):
        if flag and not (name == "plain" and flag == F32) and not (
                name == "plain_fp8" and flag in ("fp8-head", *PLAIN_FP8_ABLATIONS)):
            raise ValueError(f"run {run!r}: plain takes :f32, plain_fp8 :fp8-head, :forward or :backward")
        if name == "plain":
            # from_coda takes the config (its compute dtype too) from the model it copies
            return PlainLlama.from_coda(_model(f"xla:{F32}", cfg, reference) if flag == F32 else reference)
        return PlainFp8Llama.from_coda(reference, lm_head=flag == "fp8-head",
                                       quantized=flag if flag in PLAIN_FP8_ABLATIONS else "both")
    if flag == F32:
        # Each block recomputed in the backward (the same math): without it the 1B model's
        # float32 activations at 8 x 1024 tokens do not fit an H100's memory.
        cfg = cfg.replace(dtype=jnp.float32, remat="block")
    elif flag:
        cfg = cfg.replace(fp8=RECIPES[flag])
    model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=name)
    nnx.update(model, nnx.state(reference, nnx.Param))
    return model


def python_stdlib_corpus() -> str:
    """The running interpreter's standard library sources (``*.py`` outside :data:`STDLIB_SKIP`),
    sorted by path and joined by blank lines."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.glob("**/*.py") if not STDLIB_SKIP & set(f.relative_to(root).parts))
    if not files:
        raise FileNotFoundError(f"no standard library sources under {root}")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def windows(losses: list[float]) -> list[float]:
    return [float(np.mean(losses[i:i + WINDOW])) for i in range(0, len(losses), WINDOW)]


def train(run: str, cfg: LlamaConfig, reference: CodaLlama, data, val, steps: int, lr: float, warmup: int,
          f32_precision: str = "float32") -> dict:
    model = _model(run, cfg, reference)
    opt = nnx.Optimizer(model, training.adamw_cosine(lr, warmup, steps), wrt=nnx.Param)
    step, eval_step, _ = training.make_steps(model, opt)
    recipe = getattr(getattr(model, "config", None), "fp8", None)
    state = jax.tree.map(jnp.copy, nnx.state((model, opt)))  # the step donates it; the reference keeps its own
    del model, opt
    losses, saturated, t0 = [], [], time.perf_counter()
    by_tensor: dict[str, int] = {}
    # saturation is counted under delayed scaling (a current scale is the tensor's own amax)
    fp8 = bool(jax.tree.leaves(nnx.filter_state(state, Fp8Meta))) and getattr(recipe, "scaling", "delayed") == "delayed"
    names = tensor_names(state) if fp8 else []
    # A float32 run's GEMMs at f32_precision (a GPU's default for float32 is TF32).
    with jax.default_matmul_precision(f32_precision if run.endswith(":" + F32) else None):
        for i, (x, y) in zip(range(steps), data()):
            if i == 0 and training.fp8_uncalibrated(state):  # an FP8 model's scales from the first batch
                state, _ = step(state, jnp.asarray(x), jnp.asarray(y))
            before = _histories(state) if fp8 else None
            state, loss = step(state, jnp.asarray(x), jnp.asarray(y))
            losses.append(loss)
            if i == 0 or (i + 1) % PROGRESS_EVERY == 0:  # a run cut by a time limit still shows how far it got
                print(f"  {run}: step {i + 1} / {steps}, loss {float(loss):.4f}, {time.perf_counter() - t0:.0f} s",
                      flush=True)
            if fp8:  # a small host read each step (the histories): the accuracy run's, not a timed one's
                rows = saturated_rows(before, _histories(state), getattr(recipe, "margin", 0))
                saturated.append(len(rows))
                for name in (names[leaf][row] for leaf, row in rows):
                    by_tensor[name] = by_tensor.get(name, 0) + 1
        losses = [float(v) for v in jax.device_get(losses)]
        val_loss = float(eval_step(state, *(jnp.asarray(v) for v in val)))
    return {"run": run, "losses": losses, "val_loss": val_loss, "wall_s": time.perf_counter() - t0,
            **({"saturated": saturated, "saturated_by_tensor": by_tensor} if fp8 else {})}


def _histories(state) -> list[np.ndarray]:
    return [np.asarray(h) for h in jax.device_get(jax.tree.leaves(nnx.filter_state(state, Fp8Meta)))]


def tensor_names(state) -> list[list[str]]:
    """Per :class:`Fp8Meta` leaf of ``state`` (a model's, or ``nnx.state((model, optimizer))``;
    in :func:`_histories`' order), a name per row:
    the leaf's path and the row's tensor (a CodaLlama block's :data:`TENSORS`, its head's
    :data:`HEAD_TENSORS`, a plain FP8 projection's ``x``, ``w`` and ``g``), e.g.
    ``blocks/3/fp8_meta:dz_gu``."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.filter_state(state, Fp8Meta))[0]
    out = []
    for path, leaf in flat:
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
        if keys and isinstance(keys[0], int):  # the state of (model, optimizer): the model's index
            keys = keys[1:]
        keys = [str(k) for k in keys if k not in ("value", "raw_value")]
        rows = int(np.shape(leaf)[0]) if np.ndim(leaf) > 1 else 1
        label = {"fp8_meta": TENSORS + (SWIGLU_INPUT,), "fp8_head_meta": HEAD_TENSORS}.get(keys[-1] if keys else "",
                                                                                        ("x", "w", "g"))
        out.append([f"{'/'.join(keys)}:{label[r] if r < len(label) else r}" for r in range(rows)])
    return out


def most_saturated(by_tensor: dict[str, int], top: int = 8) -> str:
    """The ``top`` tensors of ``by_tensor`` (name -> steps saturated), the most often first, and
    the same counts summed per tensor kind (the name after ``:``) over the blocks."""
    kinds: dict[str, int] = {}
    for name, n in by_tensor.items():
        kinds[name.rsplit(":", 1)[-1]] = kinds.get(name.rsplit(":", 1)[-1], 0) + n
    fmt = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top])  # noqa: E731
    return f"{fmt(by_tensor)}; per kind: {fmt(kinds)}"


def saturated_rows(before: list[np.ndarray], after: list[np.ndarray], margin: int = 0) -> list[tuple[int, int]]:
    """The ``(leaf, row)`` of each FP8 tensor that saturated in a step (:func:`saturations`)."""
    out = []
    for i, (b, a) in enumerate(zip(before, after)):
        hist = b.astype(np.float64).max(axis=-1)
        mant, _ = np.frexp(448.0 / np.where(hist > 0, hist, 1.0))  # in [0.5, 1)
        bound = hist * 2.0 * mant * 2.0 ** margin
        hit = (hist > 0) & (a[..., 0].astype(np.float64) > bound)
        out.extend((i, int(r)) for r in np.flatnonzero(np.atleast_1d(hit)))
    return out


def saturations(before: list[np.ndarray], after: list[np.ndarray], margin: int = 0) -> int:
    """How many FP8 tensors of a step saturated: their new amax (``after[..., 0]``) beyond the
    largest value their delayed scale let through, ``fp8_max / scale`` with the scale from the
    history the step started from (:func:`coda_jax.fp8.scale_from_history` with the recipe's
    ``margin``). That bound is ``amax_hist * 2 * mantissa(fp8_max / amax_hist) * 2**margin`` (a
    power-of-two scale), the same for e4m3 and e5m2 (both maxima are 1.75 * 2**e). Rows without
    a history yet (all zero) are not counted; nor is a current-scaling run's (its scale is the
    tensor's own amax)."""
    return len(saturated_rows(before, after, margin))


def compare(results: list[dict]) -> list[dict]:
    """Per run: window-mean relative differences against the first run."""
    ref = windows(results[0]["losses"])
    rows = []
    for r in results:
        w = windows(r["losses"])
        rel = [abs(a - b) / b for a, b in zip(w, ref)]
        later = rel[2:] or rel
        sat = r.get("saturated")
        rows.append({"run": r["run"], "max_window_rel": max(later), "last_window_rel": rel[-1],
                     "last_window_change": (w[-1] - ref[-1]) / ref[-1],
                     "last_window_loss": w[-1], "val_loss": r["val_loss"],
                     "val_rel": abs(r["val_loss"] - results[0]["val_loss"]) / results[0]["val_loss"],
                     "val_change": (r["val_loss"] - results[0]["val_loss"]) / results[0]["val_loss"],
                     "nonfinite_steps": sum(not np.isfinite(v) for v in r["losses"]),
                     "saturated_steps": None if sat is None else sum(c > 0 for c in sat)})
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--runs", default="plain,plain_fp8,xla:fp8")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds: the weights and the batches' order")
    p.add_argument("--corpus", default="example", choices=["example", "python-stdlib"],
                   help="the example's two novels, or the interpreter's standard library sources")
    p.add_argument("--f32-precision", default="float32", choices=["float32", "tensorfloat32"],
                   help="the GEMM precision of the :f32 runs (float32: exact products; tensorfloat32: a GPU's TF32)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    seeds = [int(v) for v in args.seeds.split(",")]
    td, tl = example("text_data"), example("train_llama")
    corpus = td.load_corpus() if args.corpus == "example" else python_stdlib_corpus()
    tok = td.build_tokenizer([corpus])
    train_tokens, val_tokens = td.split_tokens(td.encode(tok, corpus))
    cfg = tl.make_config(argparse.Namespace(preset=args.preset, layers=args.layers), tok.get_vocab_size())
    cfg = cfg.replace(dtype=jnp.bfloat16)  # the tiny preset computes in float32: FP8 is compared with bf16
    lr, warmup = tl.PRESET_SCHEDULES.get(args.preset, tl.DEFAULT_SCHEDULE)
    lr = args.lr if args.lr is not None else lr
    val = td.validation_batch(val_tokens, args.batch, args.seq)
    passes = args.steps * args.batch * args.seq / len(train_tokens)
    title = (f"{args.preset}{'' if args.layers is None else f' ({args.layers} layers)'}, {args.steps} steps of "
             f"{args.batch} x {args.seq}, lr {lr:g}, corpus {args.corpus} ({len(train_tokens)} training tokens, "
             f"each seen ~{passes:.1f} times)")
    per_seed, results = [], []

    def write(rows=None):  # after every run: a call stopped by its time limit keeps the runs it ended
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "fp8_accuracy.json").write_text(
                json.dumps({"seeds": seeds, "lr": lr, "corpus": args.corpus, "train_tokens": len(train_tokens),
                            "rows": rows, "per_seed": per_seed, "runs": results}))

    for seed in seeds:
        reference = CodaLlama(cfg, rngs=nnx.Rngs(seed), backend="xla")
        data = lambda seed=seed: td.batches(train_tokens, args.batch, args.seq, seed=seed)  # noqa: E731
        results.append([])
        for run in args.runs.split(","):
            results[-1].append(train(run, cfg, reference, data, val, args.steps, lr, warmup,
                                       args.f32_precision))
            r = results[-1][-1]
            print(f"seed {seed} {run}: last loss {r['losses'][-1]:.4f}, val {r['val_loss']:.4f} ({r['wall_s']:.0f} s)",
                  flush=True)
            if r.get("saturated_by_tensor"):
                print(f"  saturated most often (steps): {most_saturated(r['saturated_by_tensor'])}", flush=True)
            write()
        per_seed.append(compare(results[-1]))
        print_table(per_seed[-1], f"{title}, seed {seed}")
    rows = per_seed[0] if len(seeds) == 1 else worst_over_seeds(per_seed)
    if len(seeds) > 1:
        print_table(rows, f"{title}, the largest difference over seeds {args.seeds} (changes: their mean)")
    write(rows)
    return rows


def worst_over_seeds(per_seed: list[list[dict]]) -> list[dict]:
    """Per run, the largest of each difference over the seeds (losses: the mean)."""
    out = []
    for rs in zip(*per_seed):
        row = {"run": rs[0]["run"], "nonfinite_steps": sum(r["nonfinite_steps"] for r in rs)}
        for k in ("max_window_rel", "last_window_rel", "val_rel"):
            row[k] = max(r[k] for r in rs)
        for k in ("last_window_loss", "val_loss", "last_window_change", "val_change"):
            if all(k in r for r in rs):
                row[k] = float(np.mean([r[k] for r in rs]))
        sat = [r.get("saturated_steps") for r in rs]
        row["saturated_steps"] = None if None in sat else sum(sat)
        out.append(row)
    return out


def print_table(rows: list[dict], title: str) -> None:
    """Per run: the largest window difference (absolute), the last window's and the validation
    loss's change from the reference (signed: below it is negative; over seeds, their mean), the
    non-finite steps and the steps where an FP8 tensor saturated (:func:`saturations`)."""
    print(f"\n### FP8 accuracy, {title}, reference {rows[0]['run']}\n")
    print("| run | max window diff (after step 50) | last window change | last window loss | val loss | val change | "
          "non-finite steps | steps with a saturated tensor |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        sat = r.get("saturated_steps")
        print(f"| {r['run']} | {100 * r['max_window_rel']:.2f} % | {100 * r.get('last_window_change', 0.0):+.2f} % | "
              f"{r['last_window_loss']:.4f} | {r['val_loss']:.4f} | {100 * r.get('val_change', 0.0):+.2f} % | "
              f"{r['nonfinite_steps']} | {'' if sat is None else sat} |")


if __name__ == "__main__":
    main()
