"""What the FP8 step would save if the optimizer wrote the weights' FP8 copies.

    python -m benchmarks.probes.optimizer_fp8_copies --preset 8b --layers 4 [--backend pallas]
        [--candidates pingpong_minor_m_lean_m64_no_gemm,...] [--out DIR]

Today each FP8 block quantizes its four float32 weights at the start of the step (one
``quantize_q8`` epilogue pass a weight: 4 bytes read, 2 written an element; 2.0 ms of the
8B-width step of 4 layers, run 417), and the bf16 LM head casts its float32 weight (1.0 ms
there, run 385). The pass that produces the weight is the optimizer's
update; :func:`coda_jax.ops.adamw_copies.adamw_q8_step` writes the copies from its registers. On
the step's real parameter tree (random values of a CodaLlama's shapes) and its optimizer
(:func:`coda_jax.training.adamw_cosine`), device time (CUPTI) of:

* ``optax``: the update of every parameter as the train step runs it (XLA's fusions);
* ``optax+passes``: the same, then the block weights' e4m3 copies from ``quantize_q8`` passes
  and the LM head weight's bf16 cast (what the step pays now, in its forward);
* ``fused``: the same update with each block weight's leaf (and its moments) taken from
  ``adamw_q8_step`` instead, and the LM head weight's from ``adamw_cast_step``, copies
  included: XLA must drop optax's work for those leaves;
* ``xla_copies``: optax's update with the copies written by XLA's fusions of it (the cast and
  the amax beside the update, the transposed copy from the e4m3 bytes);
* ``passes`` and ``fused_alone``: the copying passes alone, and the fused update's kernels
  alone (what the copied leaves cost each way).

The ``fused`` update is checked against ``optax``'s (the weights and moments to 1e-6), its copies
and ``xla_copies``' against the passes' (>= 99.9 % bit-equal: the same math, another fusion). ``--copies bf16``:
the block weights' bf16 casts of the bf16 step instead of their e4m3 copies. ``--candidates``
times the fused update (and its kernels alone) on other Pallas configurations too (the passes have no tuned entry: the
heuristic's otherwise). Prints one ``OPT`` line per variant and writes
``optimizer_fp8_copies.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from coda_jax import programs, training
from coda_jax.backend import lowering_for
from coda_jax.epilogue import saturate_cast
from coda_jax.layers import CodaLlama
from coda_jax.layers.config import PRESETS
from coda_jax.ops.adamw_copies import adamw_cast_step, adamw_q8_step, adamw_scalars
from coda_jax.ops.epilogue_pass import epilogue_pass
from coda_jax.ops.fp8_gemm import quantizing_run
from coda_jax.ops.names import FP8_LLAMA_BLOCK
from coda_jax.pallas.lowering import PallasLowering

BLOCK_WEIGHTS = ("w_qkv", "w_o", "w_gu", "w_down")
LR, WARMUP, STEPS, WD, CLIP, B1, B2, EPS = 3e-4, 10, 1000, 0.1, 1.0, 0.9, 0.95, 1e-8


def parameter_tree(preset: str, layers: int | None) -> dict[str, jax.ShapeDtypeStruct]:
    """``{path: shape}`` of a CodaLlama's parameters (``nnx.Param``), without allocating them."""
    cfg = PRESETS[preset]()
    if layers:
        cfg = cfg.replace(num_layers=layers)
    model = nnx.eval_shape(lambda: CodaLlama(cfg, rngs=nnx.Rngs(0), backend="xla"))
    return {"/".join(map(str, path)): jax.ShapeDtypeStruct(v.shape, v.dtype)
            for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def is_block_weight(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in BLOCK_WEIGHTS


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--backend", default="pallas")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--copies", default="fp8", choices=["fp8", "bf16"],
                    help="the block weights' copies: e4m3 in both layouts (the FP8 step) or bf16 (the bf16 step)")
    ap.add_argument("--candidates", default="", help="also time the fused update on these Pallas candidates "
                    "(coda_jax.pallas.autotune names, e.g. pingpong_minor_m_lean_m64_no_gemm)")
    ap.add_argument("--no-time", dest="time", action="store_false", help="the checks only (no GPU needed)")
    args = ap.parse_args(argv)
    from coda_jax.pallas import autotune as at

    shapes = parameter_tree(args.preset, args.layers)
    if "lm_head" in shapes:  # the embedding table's update is the same in every variant (8 GB of state at 8B): left out
        shapes.pop("embed")
    keys = iter(jax.random.split(jax.random.key(0), 3 * len(shapes)))
    params = {p: jax.random.normal(next(keys), s.shape, jnp.float32) * 0.02 for p, s in shapes.items()}
    grads = {p: jax.random.normal(next(keys), s.shape, jnp.float32) * 1e-3 for p, s in shapes.items()}
    tx = training.adamw_cosine(LR, WARMUP, STEPS, weight_decay=WD, clip_norm=CLIP)
    schedule = training.cosine_schedule(LR, WARMUP, STEPS)
    state = tx.init(params)
    _, state = jax.jit(tx.update)(grads, state, params)  # moments and count of a step already taken
    low = lowering_for(FP8_LLAMA_BLOCK, args.backend)
    scale = jnp.float32(2.0 ** 10)  # e4m3 covers |w| up to 0.44: random weights of std 0.02 fit

    def optax_update(params, grads, state):
        updates, new_state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    head = "lm_head" if "lm_head" in params else "embed"  # the LM head's weight (tied: the embedding)
    # The weights read in bf16 (the LM head's; every block weight's in the bf16 step), the rest in e4m3.
    cast = {head, *(filter(is_block_weight, params) if args.copies == "bf16" else ())}
    copied = [p for p in params if is_block_weight(p) or p in cast]

    def copies_by_pass(params):
        out = {}
        for p in copied:
            if p in cast:
                out[p] = (params[p].astype(jnp.bfloat16),)
                continue
            m, n = params[p].shape
            _, t, amax = quantizing_run(lambda e, l, od: epilogue_pass(low, e, m, n, l, out_dtypes=od or None),
                                        programs.quantize_q8("e4m3"), {"x": params[p]}, "q", jnp.float32, scale=scale)
            out[p] = (t.data, t.data_t, amax)
        return out

    def with_passes(params, grads, state):
        new, new_state = optax_update(params, grads, state)
        # The step reads the weights after the update, in its forward: not in the update's fusions.
        return new, new_state, copies_by_pass(jax.lax.optimization_barrier(new))

    adamw = optax.adamw(schedule, b1=B1, b2=B2, eps=EPS, weight_decay=WD)  # adamw_cosine's, after its clip

    def step_scalars(state, grad_norm):
        return adamw_scalars(state[1][0].count, schedule(state[1][2].count), b1=B1, b2=B2, weight_decay=WD,
                             grad_norm=grad_norm, max_norm=CLIP, eps=EPS)

    def fused_leaves(low, params, grads, state, s):
        # Each copied leaf's AdamW pass: {leaf: (new weight, mu, nu, its copies)}.
        adam, out = state[1][0], {}
        for p in copied:
            args_p = (low, params[p], grads[p], adam.mu[p], adam.nu[p], s)
            if p in cast:
                *new, bf16 = adamw_cast_step(*args_p)
                out[p] = (*new, (bf16,))
            else:
                *new, t, amax = adamw_q8_step(*args_p, scale)
                out[p] = (*new, (t.data, t.data_t, amax))
        return out

    def fused(params, grads, state, low=low):
        # adamw_cosine's chain spelled out, so that the global norm is computed once, here.
        norm = optax.tree.norm(grads)
        clipped = jax.tree.map(lambda t: jax.lax.select(norm < CLIP, t, (t / norm) * CLIP), grads)
        updates, inner = adamw.update(clipped, state[1], params)
        new = optax.apply_updates(params, updates)
        mu, nu, copies = dict(inner[0].mu), dict(inner[0].nu), {}
        for p, leaf in fused_leaves(low, params, grads, state, step_scalars(state, norm)).items():
            new[p], mu[p], nu[p], copies[p] = leaf
        return new, (state[0], (inner[0]._replace(mu=mu, nu=nu), *inner[1:])), copies

    def fused_alone(params, grads, state, low=low):
        # The fused update's kernels by themselves (a fixed global norm): what the copied leaves
        # cost, against ``passes`` plus optax's share for them.
        return fused_leaves(low, params, grads, state, step_scalars(state, jnp.float32(0.5)))

    def xla_copies(params, grads, state):
        # optax's update with the copies written by XLA's own fusions of it: the cast and the
        # amax beside the update, the transposed copy from the e4m3 bytes (the barrier keeps
        # XLA from recomputing the update in transposed order for it).
        new, new_state = optax_update(params, grads, state)
        copies = {}
        for p in copied:
            if p in cast:
                copies[p] = (new[p].astype(jnp.bfloat16),)
                continue
            q = saturate_cast(new[p], scale, jnp.float8_e4m3fn)
            copies[p] = (q, jax.lax.optimization_barrier(q).T, jnp.max(jnp.abs(new[p])))
        return new, new_state, copies

    fns = {"optax": optax_update, "optax+passes": with_passes, "fused": fused, "xla_copies": xla_copies,
           "passes": lambda params, grads, state: copies_by_pass(params), "fused_alone": fused_alone}
    # The checks on the block weights only (XLA drops the rest): the whole state of several
    # variants would not fit beside the inputs at the 8B width.

    def block_leaves(f):
        def g(*a):
            out = f(*a)
            return ({p: out[0][p] for p in copied}, {p: out[1][1][0].nu[p] for p in copied},
                    out[2] if len(out) > 2 else None)
        return jax.jit(g)

    # One variant's results alive beside the reference's at a time (four fit no H100 at the 8B width).
    ref_w, ref_nu, _ = block_leaves(fns["optax"])(params, grads, state)
    p_copies = block_leaves(fns["optax+passes"])(params, grads, state)[2]
    worst = worst_m = 0.0
    equal = 1.0
    for v in ("fused", "xla_copies"):
        w, nu, c = block_leaves(fns[v])(params, grads, state)
        worst = max(worst, *(float(jnp.linalg.norm(w[p] - ref_w[p]) / jnp.linalg.norm(ref_w[p])) for p in copied))
        worst_m = max(worst_m, *(float(jnp.linalg.norm(nu[p] - ref_nu[p]) / jnp.linalg.norm(ref_nu[p]))
                                 for p in copied))
        equal = min(equal, *(float(np.mean(np.asarray(c[p][i]).view(np.uint8) == np.asarray(p_copies[p][i]).view(
            np.uint8))) for p in copied for i in range(len(c[p])) if c[p][i].ndim))
        del w, nu, c
    print(f"CHECK fused and xla_copies against optax: weights {worst:.2e}, second moments {worst_m:.2e} (relative); "
          f"copies against the passes' {equal:.4%} bit-equal", flush=True)
    if worst > 1e-6 or worst_m > 1e-6 or equal < 0.999:
        raise SystemExit("fused update differs from optax's")
    del ref_w, ref_nu, p_copies
    n_block = sum(int(np.prod(shapes[p].shape)) for p in shapes if is_block_weight(p))
    n_all = sum(int(np.prod(s.shape)) for s in shapes.values())
    row = {"preset": args.preset, "layers": args.layers, "backend": args.backend, "copies": args.copies,
           "block_weight_elements": n_block, "parameter_elements": n_all, "ms": {}}
    if not args.time:
        return row
    for name in filter(None, args.candidates.split(",")):  # the fused passes on other configurations
        cand_low = PallasLowering(at.resolve_candidate(name), plain_gemm="pallas")
        fns[f"fused@{name}"] = functools.partial(fused, low=cand_low)
        fns[f"fused_alone@{name}"] = functools.partial(fused_alone, low=cand_low)
    for name, f in fns.items():
        # One call a measurement: CUPTI's timer keeps every call's outputs (the new state) alive.
        f = jax.jit(f)
        row["ms"][name] = statistics.median(at.kernel_ms(f, params, grads, state, iters=1) for _ in range(args.iters))
        print(f"OPT {name:16s} {row['ms'][name]:.3f} ms", flush=True)
    row["saved_ms"] = row["ms"]["optax+passes"] - min(v for k, v in row["ms"].items() if k.split("@")[0] == "fused")
    row["saved_by_xla_copies_ms"] = row["ms"]["optax+passes"] - row["ms"]["xla_copies"]
    print(f"OPT saved by the fused update: {row['saved_ms']:.3f} ms a step ({n_block / 1e6:.0f} M block-weight "
          f"elements of {n_all / 1e6:.0f} M parameters); by XLA's copies {row['saved_by_xla_copies_ms']:.3f} ms",
          flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "optimizer_fp8_copies.json").write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
