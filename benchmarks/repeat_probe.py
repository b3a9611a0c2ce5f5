"""Is one training step bit-repeatable, within a process and across processes?

    python -m benchmarks.repeat_probe --backend cutedsl --out run_a.json   # one process
    python -m benchmarks.repeat_probe --backend cutedsl --out run_b.json   # another
    python -m benchmarks.repeat_probe --compare run_a.json run_b.json ...

Builds ``CodaLlama`` (``--preset``, ``--layers``; seed 0) and takes the first training batch
of ``examples/train_llama.py``. On the device it computes a digest (a position-weighted
wrapping sum of the raw bits) of the residual stream and norm partials after every block,
of the loss, and of every parameter gradient, ``--repeats`` times. A process writes its
digests and whether its repeats agreed; ``--compare`` groups the files by backend and prints,
per backend, which digests differ between processes, in forward-then-backward order. The
first differing forward digest names the block whose output is not repeatable; with a
repeatable forward, the gradients that differ show where the backward is not.

Training curves of two runs on one backend drift apart after a loss spike when any bit
differs (examples/train_llama.py, benchmarks/compare_losses.py); this names the op.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp


def digest(x: jax.Array) -> jax.Array:
    """A uint32 digest of ``x``'s bits: sum of bits * (odd position weights), wrapping."""
    x = jnp.asarray(x).reshape(-1)
    width = x.dtype.itemsize * 8
    if width == 32:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif width == 16:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    else:
        raise ValueError(f"digest: dtype {x.dtype} is not 16 or 32 bits wide")
    w = jnp.arange(x.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.sum(bits * w, dtype=jnp.uint32)


def probe(args) -> dict:
    from flax import nnx

    from benchmarks.first_step import config_and_first_batch
    from coda_jax.layers import CodaLlama
    from coda_jax.ops import linear_cross_entropy

    cfg, inputs, targets = config_and_first_batch(args.preset, args.layers, args.batch, args.seq)
    if args.attention is not None:  # "xla": no cuDNN attention, whose backward is not bit-repeatable
        cfg = cfg.replace(attention_implementation=None if args.attention == "xla" else args.attention)
    model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=args.backend)

    @nnx.jit
    def forward(model, tokens, targets):
        # CodaLlama.hidden_states + loss, with a digest after every block.
        out = {}
        b, s = tokens.shape
        x = jnp.take(model.embed[...], tokens, axis=0).astype(cfg.dtype)
        carry, n = None, len(model.blocks)
        for i, block in enumerate(model.blocks):
            next_norm = model.blocks[i + 1].attn_norm[...] if i + 1 < n else model.final_norm[...]
            x, carry = block(x, None, carry=carry, next_norm=next_norm)
            out[f"fwd/block{i:02d}/x"] = digest(x)
            if carry is not None:
                out[f"fwd/block{i:02d}/sumsq"] = digest(carry.sumsq)
        loss = linear_cross_entropy(x.reshape(b * s, -1), model.final_norm[...], model.vocab_weight(),
                                    targets.reshape(-1), carry=carry, eps=cfg.rms_norm_eps, backend=model.backend)
        out["fwd/loss"] = digest(loss)
        return out, loss

    @nnx.jit
    def backward(model, tokens, targets):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens, targets))(model)
        out, values = {"bwd/loss": digest(loss)}, {}
        for path, v in nnx.to_flat_state(nnx.state(grads)):
            key = "grad/" + "/".join(str(p) for p in path)
            values[key] = v[...]
            out[key] = digest(values[key])
        return out, loss, values

    @jax.jit
    def rel_diffs(a, b):  # ||a - b|| / ||b|| per gradient
        return {k: jnp.linalg.norm((a[k] - b[k]).astype(jnp.float32)) / jnp.linalg.norm(b[k].astype(jnp.float32))
                for k in a}

    runs, first, worst = [], None, {}
    for _ in range(args.repeats):
        f, loss = forward(model, inputs, targets)
        g, _, values = backward(model, inputs, targets)
        runs.append({k: int(v) for k, v in {**f, **g}.items()} | {"loss_value": float(loss)})
        if first is None:
            first = values
        else:  # how far a repeat's gradients are from the first: rounding-sized, or a race?
            for k, v in rel_diffs(values, first).items():
                worst[k] = max(worst.get(k, 0.0), float(v))
    same = all(r == runs[0] for r in runs[1:])
    return {"backend": args.backend, "preset": args.preset, "layers": cfg.num_layers, "repeats": args.repeats,
            "attention": args.attention or "auto", "in_process_repeatable": same, "digests": runs[0],
            "in_process_differs": sorted({k for r in runs[1:] for k in r if r[k] != runs[0][k]}),
            "in_process_max_rel_diff": max(worst.values(), default=0.0),
            "in_process_worst_grad": max(worst, key=worst.get) if worst else None}


def step_order(key: str) -> tuple:
    """Sort key: forward digests block by block, the loss, then gradients in backprop order
    (LM head, final norm, blocks from the last, embedding)."""
    parts = key.split("/")
    if parts[0] == "fwd":
        return (0, parts[1] == "loss", parts[1:])
    if parts[0] == "bwd":
        return (1,)
    rest = parts[1:]
    if rest[0] == "blocks":
        return (2, 2, -int(rest[1]), rest[2:])
    return (2, {"lm_head": 0, "final_norm": 1, "embed": 3}.get(rest[0], 4), 0, rest)


def compare(files: list[Path]) -> str:
    """A markdown table: per backend, the digests that differ between processes."""
    by_backend = defaultdict(list)
    for f in files:
        r = json.loads(f.read_text())
        by_backend[r["backend"]].append((f.name, r))
    lines = ["| backend | processes | repeatable in each process | loss values | keys differing across processes | first differing keys |",
             "|---|---|---|---|---|---|"]
    for backend, rs in by_backend.items():
        keys = sorted((k for k in rs[0][1]["digests"] if k != "loss_value"), key=step_order)
        differ = [k for k in keys if len({r["digests"].get(k) for _, r in rs}) > 1]
        losses = ", ".join(f"{r['digests']['loss_value']:.9g}" for _, r in rs)
        inproc = ", ".join("yes" if r["in_process_repeatable"] else
                           f"no ({len(r['in_process_differs'])} keys; worst grad {r.get('in_process_worst_grad')} "
                           f"rel diff {r.get('in_process_max_rel_diff', float('nan')):.2g})" for _, r in rs)
        lines.append(f"| {backend} | {len(rs)} | {inproc} | {losses} | {len(differ)} of {len(keys)} | "
                     f"{' '.join(differ[:6]) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="xla", choices=["xla", "pallas", "cutedsl"])
    p.add_argument("--preset", default="1b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", default=None, choices=["xla", "cudnn"],
                   help="attention implementation (default: the config's, cuDNN on a GPU)")
    p.add_argument("--out", type=Path, default=None, help="write this process's digests here (JSON)")
    p.add_argument("--compare", nargs="+", type=Path, default=None, help="digest files of several processes")
    args = p.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    result = probe(args)
    if args.out is not None:
        args.out.write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("digests", "in_process_differs")}))


if __name__ == "__main__":
    main()
