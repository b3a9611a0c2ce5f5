"""Hugging Face checkpoint directories in and out of :class:`CodaLlama`, without torch.

    model = CodaLlama.from_pretrained("path/to/Llama-3.2-1B", backend="pallas")
    model.save_pretrained("out/")            # transformers.LlamaForCausalLM.from_pretrained("out/") loads it

``CodaLlama.from_pretrained`` builds the model from :func:`pretrained_config` and fills it
with :func:`load_pretrained`; this module reads and writes the files and builds no model.

A directory holds ``config.json`` and ``model.safetensors``, or several
``model-0000k-of-0000n.safetensors`` listed in ``model.safetensors.index.json``. Tensors are
read one at a time with the ``safetensors`` library (its JAX loader: bfloat16 included), so
the host never holds more than one tensor beyond the model; with a ``mesh`` the loaded state
is then split over it (:func:`coda_jax.sharding.shard_state`). Names and layouts follow
:mod:`coda_jax.layers.hf_llama`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax.layers.config import LlamaConfig
from coda_jax.layers.hf_llama import config_from_hf, config_to_hf, load_hf_state_dict, to_hf_state_dict
from coda_jax.sharding import shard_state

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 5 * 10 ** 9  # transformers' default max_shard_size ("5GB")


class SafetensorsDirectory(Mapping):
    """The tensors of a checkpoint directory as a read-on-demand mapping ``name -> array``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if (self.path / INDEX).exists():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).exists():
            weight_map = {name: SINGLE for name in self._keys(self.path / SINGLE)}
        else:
            raise FileNotFoundError(f"{self.path}: no {SINGLE} or {INDEX} (a Hugging Face safetensors checkpoint)")
        missing = {f for f in weight_map.values() if not (self.path / f).exists()}
        if missing:
            raise FileNotFoundError(f"{self.path}: {INDEX} lists missing files {sorted(missing)}")
        self._files = weight_map

    @staticmethod
    def _keys(file: Path) -> list[str]:
        from safetensors import safe_open  # the optional safetensors package (extra "hf"): imported on use

        with safe_open(str(file), framework="flax") as f:
            return list(f.keys())

    def __getitem__(self, name: str):
        from safetensors import safe_open  # optional package: imported on use

        if name not in self._files:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        with safe_open(str(self.path / self._files[name]), framework="flax") as f:
            return np.asarray(f.get_tensor(name).astype(jnp.float32))

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def pretrained_config(path: str | Path, **config_overrides: Any) -> LlamaConfig:
    """The :class:`LlamaConfig` of the Hugging Face checkpoint directory ``path`` (its
    ``config.json``), with ``config_overrides`` (other fields: ``dtype``, ``param_dtype``, ...).

    Raises:
      FileNotFoundError: no config.json; ValueError: not a Llama config, or an unsupported one
      (biases, another activation or RoPE type).
    """
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json (a Hugging Face checkpoint directory)")
    hf_config = json.loads((path / "config.json").read_text())
    if hf_config.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}/config.json: model_type must be 'llama', got {hf_config['model_type']!r}")
    return config_from_hf(hf_config, **config_overrides)


def load_pretrained(model: nnx.Module, path: str | Path, *, mesh=None) -> nnx.Module:
    """Fills ``model`` (a :class:`CodaLlama` of :func:`pretrained_config`'s shapes) with the
    weights of the checkpoint directory ``path``, and returns it; with a ``mesh``, the
    parameters are then split over it (:func:`coda_jax.sharding.shard_state`).

    Raises:
      FileNotFoundError: no weights; KeyError / ValueError: a missing / mis-shaped tensor, by name.
    """
    load_hf_state_dict(model, SafetensorsDirectory(path))
    if mesh is not None:
        nnx.update(model, shard_state(nnx.state(model), mesh))
    return model


def save_pretrained(model: nnx.Module, path: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Writes ``model`` (a :class:`CodaLlama`) as a Hugging Face checkpoint directory (float32
    safetensors, split into shards of at most ``max_shard_bytes`` with an index when larger).

    Under several processes (``jax.distributed``) every process must call it: the parameters
    are gathered from all of them, and process 0 alone writes."""
    from safetensors.numpy import save_file  # optional package: imported on use

    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    path = Path(path)
    tensors = {k: np.ascontiguousarray(v) for k, v in to_hf_state_dict(model).items()}  # every process
    if jax.process_index() != 0:
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=1))
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    for old in list(path.glob("model*.safetensors")) + [path / INDEX]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], str(path / SINGLE), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index, indent=1))
    return path
