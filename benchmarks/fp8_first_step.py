"""How wrong an FP8 model's first step is without calibration: its weight gradients at scale 1.

    python -m benchmarks.fp8_first_step [--preset tiny] [--batch 8] [--seq 1024] [--layers N] [--backend xla]

A fresh FP8 model (``LlamaConfig(fp8=Fp8Recipe())``) has all-zero amax histories, so every
tensor of its first step is quantized with scale 1 (:func:`coda_jax.fp8.scale_from_history`).
This takes one batch of random tokens and the same weights, and prints per weight matrix the
relative error ``||g - g_ref|| / ||g_ref||`` of the FP8 model's parameter gradients against the
model without FP8 (``g_ref``, the compute dtype), and the fraction of exact zeros:

* ``fresh``: the histories all zero (scale 1), what the first step would compute;
* ``calibrated``: after one :func:`coda_jax.training.make_steps` step, which on a fresh model
  only fills the histories (the calibration step, docs/fp8.md#the-first-step), the same
  weights and batch.

The output gradients of a mean loss shrink with the token count, so the fresh step's error
grows with ``batch * seq``. Returns the rows (``--out``: as JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coda_jax import training
from coda_jax.fp8 import Fp8Recipe
from coda_jax.layers import PRESETS, CodaLlama


def _grads(model: CodaLlama, x: jax.Array, y: jax.Array) -> dict[str, np.ndarray]:
    g = nnx.grad(lambda m: m.loss(x, y), argnums=nnx.DiffState(0, nnx.Param))(model)
    return {"/".join(map(str, k)): np.asarray(v[...], np.float64) for k, v in nnx.to_flat_state(g)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--backend", default="xla")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = PRESETS[args.preset]() if args.layers is None else PRESETS[args.preset](num_layers=args.layers)
    ref = CodaLlama(cfg, rngs=nnx.Rngs(args.seed), backend=args.backend)
    fp8 = CodaLlama(cfg.replace(fp8=Fp8Recipe()), rngs=nnx.Rngs(args.seed), backend=args.backend)
    nnx.update(fp8, nnx.state(ref, nnx.Param))
    tokens = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
    x, y = jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)
    g_ref, g_fresh = _grads(ref, x, y), _grads(fp8, x, y)
    opt = nnx.Optimizer(fp8, optax.adam(1e-3), wrt=nnx.Param)
    step, _, graphdef = training.make_steps(fp8, opt)
    state = nnx.state((fp8, opt))
    assert training.fp8_uncalibrated(state)
    state, _ = step(state, x, y)  # the calibration step: histories only, the weights as they were
    calibrated, _ = nnx.merge(graphdef, state)
    g_cal = _grads(calibrated, x, y)
    rows = []
    print(f"{args.preset}, {args.batch} x {args.seq} tokens, backend {args.backend}: FP8 weight gradients against "
          f"{jnp.dtype(cfg.dtype).name}'s\n")
    print("| weight | error, fresh (scale 1) | error, calibrated | zeros, fresh | zeros, calibrated |")
    print("|---|---|---|---|---|")
    for name, r in g_ref.items():
        if r.ndim < 2:
            continue
        norm = np.linalg.norm(r)
        row = {"weight": name, "err_fresh": float(np.linalg.norm(g_fresh[name] - r) / norm),
               "err_calibrated": float(np.linalg.norm(g_cal[name] - r) / norm),
               "zeros_fresh": float(np.mean(g_fresh[name] == 0)), "zeros_calibrated": float(np.mean(g_cal[name] == 0))}
        rows.append(row)
        print(f"| {name} | {row['err_fresh']:.3f} | {row['err_calibrated']:.3f} | {row['zeros_fresh']:.3f} | "
              f"{row['zeros_calibrated']:.3f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_first_step.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
