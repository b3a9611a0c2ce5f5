"""The shipped corpus, the local tokenizer and the batch stream."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
pytest.importorskip("tokenizers")

import text_data  # noqa: E402


@pytest.fixture(scope="module")
def corpus():
    return text_data.load_corpus()


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    return text_data.build_tokenizer([corpus], vocab_size=1024, cache_dir=tmp_path_factory.mktemp("tok"))


def test_corpus_is_real_english(corpus):
    assert len(corpus) > 500_000
    for w in ("Elizabeth", "Darcy", "Alice", "Rabbit", " the ", " and "):
        assert w in corpus
    assert "Gutenberg" not in corpus  # license boilerplate stripped


def test_tokenizer_round_trip_and_vocab(tok, corpus):
    para = corpus[20_000:21_000]
    assert tok.decode(tok.encode(para).ids) == para
    assert tok.get_vocab_size() == 1024
    ids = text_data.encode(tok, corpus[:50_000])
    assert ids.dtype == np.int32 and ids.max() < 1024 and len(ids) < 50_000 / 2.5  # BPE compresses


def test_batches_shift_determinism_and_resume():
    tokens = np.arange(10_000, dtype=np.int32)
    it = text_data.batches(tokens, 4, 16, seed=3)
    b = [next(it) for _ in range(5)]
    x, y = b[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    again = text_data.batches(tokens, 4, 16, seed=3, start_step=3)
    np.testing.assert_array_equal(next(again)[0], b[3][0])
    other = next(text_data.batches(tokens, 4, 16, seed=4))[0]
    assert not np.array_equal(other, b[0][0])


def test_split_and_validation_batch():
    tr, va = text_data.split_tokens(np.arange(1000, dtype=np.int32))
    assert len(tr) == 950 and len(va) == 50 and tr[-1] + 1 == va[0]
    vx, vy = text_data.validation_batch(va, 2, 8)
    assert vx.shape == (2, 8)
    with pytest.raises(ValueError, match="too short"):
        text_data.validation_batch(va, 2, 64)
