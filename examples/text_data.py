"""Training text for the examples: public-domain books shipped in ``examples/data``.

A byte-level BPE tokenizer is trained locally with the ``tokenizers`` package (no
downloads) and cached as JSON under ``examples/.cache``; batches are drawn at random
offsets, deterministically from ``(seed, step)`` so a resumed run sees the same stream.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parent / "data"
CACHE_DIR = Path(__file__).resolve().parent / ".cache"


def load_corpus(data_dir: Path | str = DATA_DIR) -> str:
    """All ``*.txt`` files of ``data_dir``, sorted by name, joined by blank lines."""
    files = sorted(Path(data_dir).glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no .txt files in {data_dir}")
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files)


def build_tokenizer(texts: Sequence[str], vocab_size: int = 4096, cache_dir: Path | str = CACHE_DIR):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (cached by content hash)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (256 bytes + specials), got {vocab_size}")
    digest = hashlib.sha256(("\0".join(texts) + f"|{vocab_size}").encode()).hexdigest()[:16]
    path = Path(cache_dir) / f"bpe_{vocab_size}_{digest}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name, then renamed: the processes of a multi-process run
    # (examples/train_llama.py) build the tokenizer at once, and none may read a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tok


def encode(tokenizer, text: str) -> np.ndarray:
    """``text`` -> int32 token ids (paragraph by paragraph, so it stays fast)."""
    paras = text.split("\n\n")
    ids = [e.ids for e in tokenizer.encode_batch([p + "\n\n" for p in paras])]
    return np.fromiter((i for seq in ids for i in seq), dtype=np.int32)


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """The last ``val_fraction`` of the stream is the validation set."""
    n_val = max(1, int(len(tokens) * val_fraction))
    return tokens[:-n_val], tokens[-n_val:]


def batch_starts(n_tokens: int, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """The ``batch_size`` window offsets of training step ``step``, drawn from
    ``default_rng((seed, step))``: the same in every process, so each process of a
    multi-process run cuts only its own rows' windows (:func:`windows`)."""
    if n_tokens < seq_len + 2:
        raise ValueError(f"need more than {seq_len + 1} tokens, got {n_tokens}")
    return np.random.default_rng((seed, step)).integers(0, n_tokens - seq_len - 1, size=batch_size)


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)`` int32 ``[len(starts), seq_len]``: the windows at ``starts``,
    targets = inputs shifted by one."""
    chunk = tokens[np.asarray(starts)[:, None] + np.arange(seq_len + 1)[None]]
    return chunk[:, :-1].astype(np.int32), chunk[:, 1:].astype(np.int32)


def batches(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
            start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yields ``(inputs, targets)`` int32 ``[batch_size, seq_len]``, targets = inputs shifted by one.

    Step ``s`` draws its offsets from ``default_rng((seed, s))`` (:func:`batch_starts`):
    deterministic, and a run resumed at ``start_step`` continues the same stream.
    """
    batch_starts(len(tokens), batch_size, seq_len, seed, start_step)  # checks the length up front
    step = start_step
    while True:
        yield windows(tokens, batch_starts(len(tokens), batch_size, seq_len, seed, step), seq_len)
        step += 1


def validation_starts(n_tokens: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The offsets of :func:`validation_batch`'s windows: evenly spaced over the stream."""
    if n_tokens < seq_len + 2:
        raise ValueError(f"validation stream too short for seq_len {seq_len}")
    return np.linspace(0, n_tokens - seq_len - 1, batch_size).astype(np.int64)


def validation_batch(tokens: np.ndarray, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed batch of evenly spaced windows of the validation stream."""
    return windows(tokens, validation_starts(len(tokens), batch_size, seq_len), seq_len)
