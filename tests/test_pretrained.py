"""Hugging Face checkpoint directories: from_pretrained / save_pretrained against transformers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from coda_jax.layers import CodaLlama  # noqa: E402
from op_cases import rel_err  # noqa: E402
from test_hf_parity import _hf_model  # noqa: E402


def _logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("tied,scaled", [(True, True), (False, False)])
def test_from_pretrained_matches_transformers(tmp_path, tied, scaled):
    hf, _ = _hf_model(tied, scaled)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards and an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = CodaLlama.from_pretrained(tmp_path, backend="xla", dtype=jnp.float32, attention_implementation=None)
    tokens = np.random.default_rng(1).integers(0, 256, size=(2, 40))
    assert rel_err(model(jnp.asarray(tokens)), _logits(hf, tokens)) < 1e-4


def test_save_pretrained_loads_in_transformers_exactly(tmp_path):
    hf, _ = _hf_model(False, True, seed=3)
    hf.save_pretrained(tmp_path / "in")
    model = CodaLlama.from_pretrained(tmp_path / "in", backend="xla", dtype=jnp.float32)
    model.save_pretrained(tmp_path / "out", max_shard_bytes=200_000)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float().eval()
    want, got = hf.state_dict(), back.state_dict()
    for k, v in want.items():
        if "rotary_emb" not in k:
            assert torch.equal(v, got[k]), k
    tokens = np.random.default_rng(2).integers(0, 256, size=(1, 24))
    np.testing.assert_array_equal(_logits(back, tokens), _logits(hf, tokens))


def test_clear_errors(tmp_path):
    hf, _ = _hf_model(False, False)
    hf.save_pretrained(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="config.json"):
        CodaLlama.from_pretrained(tmp_path)
    # a tensor missing from the index
    d = tmp_path / "ok"
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        CodaLlama.from_pretrained(d, backend="xla")
    # a mis-shaped tensor, named
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj.weight: expected shape"):
        CodaLlama.from_pretrained(d, backend="xla")
    # unsupported configs
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    with pytest.raises(ValueError, match="mlp_bias"):
        CodaLlama.from_pretrained(d, backend="xla")
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type must be 'llama'"):
        CodaLlama.from_pretrained(d, backend="xla")


def test_bfloat16_checkpoint(tmp_path):
    """bfloat16 safetensors (the usual release format) load through the JAX loader."""
    hf, _ = _hf_model(True, False, seed=5)
    hf.to(torch.bfloat16).save_pretrained(tmp_path)
    model = CodaLlama.from_pretrained(tmp_path, backend="xla", dtype=jnp.float32)
    want = hf.float().state_dict()["model.layers.0.mlp.down_proj.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(model.blocks[0].w_down[...]).T, want)
