"""The plain JAX baseline (benchmarks/plain_llama.py) computes the same function as CodaLlama,
so "speed vs plain JAX" compares two implementations of one model."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from benchmarks.plain_llama import PlainLlama
from coda_jax.layers import CodaLlama, LlamaConfig
from coda_jax.ops.rope_frequencies import Llama3RopeScaling
from conftest import rel_err


@pytest.mark.parametrize("tied", [True, False])
def test_plain_llama_matches_coda_llama(tied):
    cfg = LlamaConfig.tiny(vocab_size=300, num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4,
                           num_kv_heads=2, head_dim=32, tie_word_embeddings=tied,
                           rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=16))
    coda = CodaLlama(cfg, rngs=nnx.Rngs(1), backend="xla")
    plain = PlainLlama.from_coda(coda)
    tokens = jax.random.randint(jax.random.key(2), (2, 17), 0, cfg.vocab_size)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    assert rel_err(plain.logits(inp), coda(inp)) < 1e-5
    lp, gp = nnx.value_and_grad(lambda m: m.loss(inp, tgt))(plain)
    lc, gc = nnx.value_and_grad(lambda m: m.loss(inp, tgt))(coda)
    assert abs(float(lp) - float(lc)) < 1e-5 * abs(float(lc))
    assert rel_err(gp["embed"][...], gc["embed"][...]) < 1e-4
    assert rel_err(gp["blocks"][1]["w_down"][...], gc["blocks"][1]["w_down"][...]) < 1e-4
    assert rel_err(gp["blocks"][0]["attn_norm"][...], gc["blocks"][0]["attn_norm"][...]) < 1e-4


def test_plain_llama_rejects_qk_norm():
    with pytest.raises(ValueError, match="qk_norm"):
        PlainLlama(LlamaConfig.tiny(qk_norm=True), rngs=nnx.Rngs(0))


def test_plain_llama_block_remat_gives_the_same_gradients():
    """``config.remat == "block"`` rematerializes the baseline's blocks too (the step benchmark's
    ``--remat block`` compares like with like): same loss and gradients, a remat in the jaxpr."""
    cfg = LlamaConfig.tiny(vocab_size=256, num_layers=2)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    got = {}
    for remat in ("none", "block"):
        graphdef, state = nnx.split(PlainLlama(cfg.replace(remat=remat), rngs=nnx.Rngs(0)))
        fn = jax.value_and_grad(lambda st: nnx.merge(graphdef, st).loss(tokens[:, :-1], tokens[:, 1:]))
        assert ("remat" in str(jax.make_jaxpr(fn)(state))) == (remat == "block")
        got[remat] = fn(state)
    assert rel_err(got["block"][0], got["none"][0]) < 1e-6
    for a, b in zip(jax.tree.leaves(got["block"][1]), jax.tree.leaves(got["none"][1])):
        assert rel_err(a, b) < 1e-5
