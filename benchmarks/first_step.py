"""The model config and first batch of ``examples/train_llama.py``, for the tools that look
at one training step (``compile_time``, ``repeat_probe``, ``grad_error_probe``): the same
tokenizer, data order (seed 0) and preset handling, so a tool looks at the step the training
runs start with."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp

from benchmarks._examples import example


def config_and_first_batch(preset: str, layers: int | None, batch: int, seq: int):
    """-> ``(LlamaConfig, tokens [batch, seq] int32, targets [batch, seq] int32)``."""
    text_data = example("text_data")
    train_llama = example("train_llama")

    corpus = text_data.load_corpus()
    tok = text_data.build_tokenizer([corpus], vocab_size=4096)
    train_tokens, _ = text_data.split_tokens(text_data.encode(tok, corpus))
    cfg = train_llama.make_config(SimpleNamespace(preset=preset, layers=layers), tok.get_vocab_size())
    tokens, targets = next(text_data.batches(train_tokens, batch, seq, seed=0, start_step=0))
    return cfg, jnp.asarray(tokens), jnp.asarray(targets)
