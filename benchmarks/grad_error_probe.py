"""Each backend's error in one training step, per gradient, against float32 math.

    python -m benchmarks.grad_error_probe --backends xla,pallas,cutedsl --layers 4 --out probe.json
    python -m benchmarks.grad_error_probe --backends xla:fp8,pallas:fp8,plain_fp8,pallas --layers 2

Builds ``CodaLlama`` (``--preset``, ``--layers``; seed 0, so every backend gets the same
parameters) and takes the first training batch of ``examples/train_llama.py``. The
reference is the same model in float32 on the ``xla`` backend with XLA's attention and
``highest`` matmul precision. Each backend in ``--backends`` computes the step in the
preset's compute dtype (bf16). The probe prints, per parameter kind (``w_qkv``, ``w_o``,
``w_gu``, ``w_down``, the two block norms (each averaged over the blocks), ``embed``,
``final_norm``, ``lm_head``), the relative error ``||g - g_ref|| / ||g_ref||`` of every
backend, the ratio of each to the first backend's error, and each later backend's distance
from the first's gradients. ``<backend>:fp8``: the model in FP8 (``Fp8Recipe()``), its
histories filled by one step's amaxes before the measured step. ``plain`` and ``plain_fp8``:
the plain JAX Llama in the compute dtype and the plain FP8 baseline
(``benchmarks/plain_fp8_llama.py``) with the same weights, their gradients mapped to
CodaLlama's names.

Why: a backend can pass every op test (error under 1e-2 against XLA) and still round
differently somewhere, which shows in training as a different sensitivity of the loss
curve. Equal errors per gradient rule that out; a larger one names the parameter whose
backward program to look at.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


# Runs of the plain JAX Llama (benchmarks/plain_llama.py, benchmarks/plain_fp8_llama.py).
PLAIN_RUNS = ("plain", "plain_fp8")


def gradient_kind(path: str) -> str:
    """``blocks/3/w_gu`` -> ``w_gu`` (blocks pooled); other parameters keep their name."""
    m = re.fullmatch(r"blocks/\d+/(.+)", path)
    return m.group(1) if m else path


def step_gradients(model, tokens, targets) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and every parameter gradient (float32 NumPy arrays) of one step. A model in FP8
    (delayed scaling) first takes one step's amaxes into its histories (as the train step does,
    :func:`coda_jax.training.make_steps`), so that the measured step runs on scales from real
    amaxes, not the initial ones."""
    from flax import nnx

    from coda_jax.fp8 import Fp8Meta

    if jax.tree.leaves(nnx.state(model, Fp8Meta)):
        @nnx.jit
        def histories(model, tokens, targets):
            wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Meta))
            _, grads = nnx.value_and_grad(lambda m: m.loss(tokens, targets), argnums=wrt)(model)
            return grads.filter(Fp8Meta)

        nnx.update(model, histories(model, tokens, targets))

    @nnx.jit
    def step(model, tokens, targets):
        return nnx.value_and_grad(lambda m: m.loss(tokens, targets))(model)

    loss, grads = step(model, tokens, targets)
    flat = {"/".join(str(p) for p in path): np.asarray(v[...], np.float32)
            for path, v in nnx.to_flat_state(nnx.state(grads))}
    return float(loss), flat


def as_coda_gradients(grads: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """The plain Llama's gradients (``benchmarks/plain_llama.py``: ``wq``, ``wk``, ``wv``, ``wo``,
    ``w_gate``, ``w_up`` per block) under CodaLlama's names and layouts (``w_qkv``, ``w_o``, the
    block-interleaved ``w_gu``), as :meth:`PlainLlama.from_coda` maps the weights the other way."""
    from coda_jax.ops.swiglu_layout import interleave_gate_up

    out = {k: v for k, v in grads.items() if not re.fullmatch(r"blocks/\d+/(wq|wk|wv|wo|w_gate|w_up)", k)}
    for i in range(config.num_layers):
        b = f"blocks/{i}/"
        out[b + "w_qkv"] = np.concatenate([grads[b + "wq"], grads[b + "wk"], grads[b + "wv"]], axis=1)
        out[b + "w_o"] = grads[b + "wo"]
        out[b + "w_gu"] = np.asarray(interleave_gate_up(grads[b + "w_gate"], grads[b + "w_up"]))
    return out


def errors(grads: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    """Per gradient kind: ``||g - g_ref|| / ||g_ref||`` averaged over the blocks."""
    per_kind: dict[str, list[float]] = {}
    for k, r in ref.items():
        e = float(np.linalg.norm(grads[k] - r) / max(float(np.linalg.norm(r)), 1e-30))
        per_kind.setdefault(gradient_kind(k), []).append(e)
    return {k: float(np.mean(v)) for k, v in per_kind.items()}


def probe(args) -> dict:
    from flax import nnx

    from benchmarks.first_step import config_and_first_batch
    from coda_jax.fp8 import Fp8Recipe
    from coda_jax.layers import CodaLlama

    cfg, inputs, targets = config_and_first_batch(args.preset, args.layers, args.batch, args.seq)
    if args.dtype is not None:
        cfg = cfg.replace(dtype=jnp.dtype(args.dtype))

    ref_cfg = cfg.replace(dtype=jnp.float32, attention_implementation=None)
    with jax.default_matmul_precision("highest"):
        ref_loss, ref = step_gradients(CodaLlama(ref_cfg, rngs=nnx.Rngs(0), backend="xla"), inputs, targets)
    result = {"preset": args.preset, "layers": cfg.num_layers, "dtype": jnp.dtype(cfg.dtype).name,
              "reference_loss": ref_loss, "backends": {}}
    first = None
    for run in args.backends:
        backend, _, recipe = run.partition(":")
        if backend in PLAIN_RUNS:  # the plain JAX Llama (bf16 or FP8) with CodaLlama's weights
            from benchmarks.plain_fp8_llama import PlainFp8Llama
            from benchmarks.plain_llama import PlainLlama

            plain = (PlainFp8Llama if backend == "plain_fp8" else PlainLlama).from_coda(
                CodaLlama(cfg, rngs=nnx.Rngs(0), backend="xla"))
            loss, grads = step_gradients(plain, inputs, targets)
            grads = as_coda_gradients(grads, cfg)
        else:
            run_cfg = cfg.replace(fp8=Fp8Recipe()) if recipe == "fp8" else cfg
            loss, grads = step_gradients(CodaLlama(run_cfg, rngs=nnx.Rngs(0), backend=backend), inputs, targets)
        result["backends"][run] = {"loss": loss, "loss_abs_err": abs(loss - ref_loss),
                                   "grad_rel_err": errors(grads, ref)}
        if first is None:  # the first run's gradients: each later run's distance from it
            first = grads
        else:
            result["backends"][run]["grad_rel_err_vs_first"] = errors(grads, first)
        del grads
    return result


def table(result: dict) -> str:
    """Markdown: per gradient kind, each backend's error and its ratio to the first's, and
    each later backend's distance from the first's gradients."""
    backends = list(result["backends"])
    first = backends[0]
    cols = backends + [f"{b} / {first}" for b in backends[1:]] + [f"{b} vs {first}" for b in backends[1:]]
    lines = ["| gradient | " + " | ".join(cols) + " |", "|---" * (1 + len(cols)) + "|"]
    rows = [("loss (abs err)", {b: result["backends"][b]["loss_abs_err"] for b in backends})]
    rows += [(k, {b: result["backends"][b]["grad_rel_err"][k] for b in backends})
             for k in result["backends"][first]["grad_rel_err"]]
    for name, errs in rows:
        cells = [f"{errs[b]:.3e}" for b in backends]
        cells += [f"{errs[b] / errs[first]:.3f}" if errs[first] else "-" for b in backends[1:]]
        vs = [result["backends"][b].get("grad_rel_err_vs_first", {}).get(name) for b in backends[1:]]
        cells += [f"{v:.3e}" if v is not None else "-" for v in vs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="xla,pallas,cutedsl",
                   type=lambda s: [b for b in s.split(",") if b],
                   help="comma-separated; the first is the one the others' errors are divided by")
    p.add_argument("--preset", default="1b")
    p.add_argument("--layers", type=int, default=4, help="override the preset's number of layers")
    p.add_argument("--dtype", default=None, help="compute dtype of the backends (default: the preset's)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None, help="write the errors here (JSON)")
    args = p.parse_args(argv)
    unknown = [b for b in args.backends if b.removesuffix(":fp8") not in ("xla", "pallas", "cutedsl")
               and b not in PLAIN_RUNS]
    if not args.backends or unknown:
        p.error(f"--backends must name xla, pallas or cutedsl, each optionally in FP8 (pallas:fp8), or "
                f"{' or '.join(PLAIN_RUNS)}, got {args.backends}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    result = probe(args)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
