"""Parity with Hugging Face transformers' LlamaForCausalLM (float32, CPU)."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from coda_jax.layers.hf_llama import config_from_hf, load_hf_state_dict, to_hf_state_dict  # noqa: E402
from coda_jax.layers.model import CodaLlama  # noqa: E402
from op_cases import rel_err  # noqa: E402


def _hf_model(tied: bool, scaled: bool, seed: int = 0):
    torch.manual_seed(seed)
    kw = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
              tie_word_embeddings=tied, attn_implementation="eager", initializer_range=0.2)
    if scaled:
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        kw["rope_theta"] = 10000.0
    cfg = transformers.LlamaConfig(**kw)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model, cfg


@pytest.mark.parametrize("tied,scaled", [(True, True), (False, False)])
def test_logits_and_loss_match_transformers(tied, scaled):
    hf, cfg = _hf_model(tied, scaled)
    model = CodaLlama.from_hf(hf.state_dict(), cfg, backend="xla", dtype=jnp.float32, attention_implementation=None)
    assert model.config.tie_word_embeddings == tied
    assert (model.config.rope_scaling is not None) == scaled
    tokens = np.random.default_rng(0).integers(0, 256, size=(2, 48))
    with torch.no_grad():
        out = hf(torch.tensor(tokens), labels=torch.tensor(tokens))
    logits = model(jnp.asarray(tokens))
    e = rel_err(logits, out.logits.numpy())
    assert e < 1e-4, e
    loss = model.loss(jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]))
    assert rel_err(loss, out.loss.item()) < 1e-4


def test_export_round_trips_exactly():
    hf, cfg = _hf_model(False, True)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    model = CodaLlama.from_hf(sd, cfg, backend="xla", dtype=jnp.float32)
    back = to_hf_state_dict(model)
    assert set(back) == {k for k in sd if "rotary_emb" not in k}
    for k, v in back.items():
        np.testing.assert_array_equal(v, sd[k], err_msg=k)


def test_bad_state_dicts_are_named():
    hf, cfg = _hf_model(True, False)
    sd = dict(hf.state_dict())
    model = CodaLlama.from_hf(sd, cfg, backend="xla", dtype=jnp.float32)
    missing = {k: v for k, v in sd.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(KeyError, match="layers.1.mlp.up_proj"):
        load_hf_state_dict(model, missing)
    bad = dict(sd, **{"model.layers.0.self_attn.o_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"o_proj.weight: expected shape \(128, 128\)"):
        load_hf_state_dict(model, bad)
    with pytest.raises(KeyError, match="unexpected"):
        load_hf_state_dict(model, dict(sd, extra=torch.zeros(1)))
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(dict(cfg.to_dict(), attention_bias=True))
