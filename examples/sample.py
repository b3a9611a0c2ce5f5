"""Print continuations of a prompt from a trained model: greedy, or sampled with temperature / top-k.

    python examples/sample.py --from runs/tiny --prompt "It was a dark"          # a train_llama.py run
    python examples/sample.py --from path/to/hf_llama_dir --prompt "The" --temperature 0.8 --top-k 40

``--from`` is either the ``--out`` directory of ``examples/train_llama.py`` (its orbax
checkpoint; the tokenizer is rebuilt from the shipped corpus with the run's ``--vocab``) or a
Hugging Face checkpoint directory (``config.json``, safetensors, and ``tokenizer.json`` read
with the ``tokenizers`` library). Forward only, any backend; each new token reruns the model on
the whole sequence (no KV cache: fine for the short continuations this is for). It runs in
one process, on that process's devices, and reads a checkpoint written by any number of
processes (``train_llama.py`` under ``jax.distributed``): orbax restores it onto this process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax.layers import CodaLlama
from coda_jax.training import adamw_cosine


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", required=True, help="train_llama.py --out directory or a HF directory")
    p.add_argument("--prompt", default="It was")
    p.add_argument("--tokens", type=int, default=40, help="new tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="xla", choices=["xla", "pallas", "cutedsl", "auto"])
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.temperature < 0:
        p.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        p.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.samples < 1:
        p.error(f"--samples must be >= 1, got {args.samples}")
    return args


def load(source: Path, backend: str):
    """-> (model, encode: str -> ids, decode: ids -> str)."""
    if (source / "config.json").exists():  # Hugging Face directory
        from tokenizers import Tokenizer

        if not (source / "tokenizer.json").exists():
            raise SystemExit(f"sample.py: error: {source} has no tokenizer.json")
        tok = Tokenizer.from_file(str(source / "tokenizer.json"))
        model = CodaLlama.from_pretrained(source, backend=backend)
        return model, (lambda s: tok.encode(s).ids), tok.decode
    if not (source / "args.json").exists():
        raise SystemExit(f"sample.py: error: {source} is neither a Hugging Face directory (config.json) nor a "
                         "train_llama.py run (args.json)")
    import orbax.checkpoint as ocp

    import text_data  # the other examples, beside this script
    import train_llama

    run = SimpleNamespace(**json.loads((source / "args.json").read_text()))
    tok = text_data.build_tokenizer([text_data.load_corpus()], vocab_size=run.vocab)
    # As trained: an FP8 run's blocks hold amax histories its checkpoint restores (and run in FP8).
    cfg = train_llama.make_config(run, tok.get_vocab_size()).replace(fp8=train_llama.fp8_recipe(run))
    model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend)
    optimizer = nnx.Optimizer(model, adamw_cosine(run.lr, run.warmup, run.steps), wrt=nnx.Param)
    mgr = ocp.CheckpointManager((source / "checkpoints").resolve())
    step = mgr.latest_step()
    if step is None:
        raise SystemExit(f"sample.py: error: no checkpoint in {source / 'checkpoints'}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state((model, optimizer)))
    got = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    nnx.update((model, optimizer), got["state"])
    mgr.close()
    return model, (lambda s: tok.encode(s).ids), tok.decode


def generate(model: CodaLlama, ids: list[int], n: int, temperature: float, top_k: int, key) -> list[int]:
    """``n`` new token ids after ``ids`` (greedy when ``temperature == 0``)."""
    # The weights as an argument, not constants baked into the program (XLA would fold an FP8
    # model's weight amaxes at compile time).
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t)[0, -1])
    out = list(ids)
    for _ in range(n):
        logits = forward(state, jnp.asarray([out], jnp.int32))
        if temperature == 0:
            nxt = int(jnp.argmax(logits))
        else:
            logits = logits / temperature
            if top_k:
                kth = jnp.sort(logits)[-min(top_k, logits.shape[0])]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            key, sub = jax.random.split(key)
            nxt = int(jax.random.categorical(sub, logits))
        out.append(nxt)
    return out[len(ids):]


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    model, encode, decode = load(Path(args.source), args.backend)
    ids = list(encode(args.prompt))
    if not ids:
        raise SystemExit("sample.py: error: --prompt encodes to no tokens")
    key = jax.random.key(args.seed)
    texts = []
    for i in range(args.samples):
        new = generate(model, ids, args.tokens, args.temperature, args.top_k, jax.random.fold_in(key, i))
        texts.append(decode(list(np.asarray(ids)) + new))
        print(f"--- sample {i + 1}: {texts[-1]}", flush=True)
    return texts


if __name__ == "__main__":
    main()
