"""Hugging Face ``LlamaForCausalLM`` names, layouts and configs, to and from :class:`CodaLlama`'s.

A mapping only: it fills a model it is given (:func:`load_hf_state_dict`) and reads one
(:func:`to_hf_state_dict`), and builds none; ``CodaLlama.from_hf`` and
``CodaLlama.from_pretrained`` (:mod:`coda_jax.layers.pretrained`, checkpoint directories)
make the model.

Mapping (HF linear weights are ``[out, in]``; coda-jax weights are ``[in, out]``):

* ``model.embed_tokens.weight`` -> ``embed`` ``[V, d]``; ``lm_head.weight`` -> ``lm_head``
  (absent when ``tie_word_embeddings``); ``model.norm.weight`` -> ``final_norm``;
* per layer ``i``: ``input_layernorm`` -> ``attn_norm``, ``post_attention_layernorm`` ->
  ``mlp_norm``, ``q/k/v_proj`` -> ``w_qkv = [Wq^T | Wk^T | Wv^T]``, ``o_proj`` -> ``w_o``,
  ``gate/up_proj`` -> ``w_gu`` (64-column blocks, :func:`coda_jax.interleave_gate_up`),
  ``down_proj`` -> ``w_down``, optional ``self_attn.q_norm/k_norm`` -> ``q_norm/k_norm``.

HF's RoPE rotates halves of each head (``rotate_half``), which is what coda-jax does, so no
permutation of the Q/K rows is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from coda_jax.layers.config import LlamaConfig
from coda_jax.ops.rope_frequencies import Llama3RopeScaling
from coda_jax.ops.swiglu_layout import interleave_gate_up, split_gate_up


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    return cfg.get(name, default) if isinstance(cfg, Mapping) else getattr(cfg, name, default)


def config_from_hf(hf_config: Any, **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from a ``transformers.LlamaConfig`` (or its dict)."""
    for flag in ("attention_bias", "mlp_bias"):
        if _get(hf_config, flag, False):
            raise ValueError(f"hf_config.{flag}=True is not supported by CodaLlama (no biases)")
    act = _get(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hf_config.hidden_act must be 'silu' (SwiGLU), got {act!r}")
    heads = _get(hf_config, "num_attention_heads")
    d = _get(hf_config, "hidden_size")
    scaling = _get(hf_config, "rope_scaling")
    params = _get(hf_config, "rope_parameters")  # transformers >= 5 keeps theta and scaling here
    if isinstance(params, Mapping) and params.get("rope_type", "default") != "default":
        scaling = params
    theta = _get(hf_config, "rope_theta", None)
    if theta is None and isinstance(params, Mapping):
        theta = params.get("rope_theta")
    rope_scaling = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            rope_scaling = Llama3RopeScaling(
                factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
        elif kind not in (None, "default"):
            raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3' and none)")
    base = dict(
        vocab_size=_get(hf_config, "vocab_size"), hidden_size=d,
        intermediate_size=_get(hf_config, "intermediate_size"), num_layers=_get(hf_config, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=_get(hf_config, "num_key_value_heads") or heads,
        head_dim=_get(hf_config, "head_dim") or d // heads, rms_norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-5)),
        rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=rope_scaling,
        tie_word_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )
    return LlamaConfig(**{**base, **overrides})


def config_to_hf(cfg: LlamaConfig) -> dict[str, Any]:
    """``config.json`` of a ``transformers`` ``LlamaForCausalLM`` with ``cfg``'s shapes."""
    if cfg.qk_norm:
        raise ValueError("a config with qk_norm has no LlamaForCausalLM equivalent; save_pretrained needs qk_norm=False")
    rope_scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope_scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor,
                        "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling, "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 131072, "torch_dtype": "float32",
    }


def _np(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):  # a torch tensor; no torch import needed
        v = v.detach().float().cpu().numpy()
    return np.asarray(v, dtype=np.float32)


def _hf_names(cfg: LlamaConfig, i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    names = {k: p + v for k, v in dict(
        attn_norm="input_layernorm.weight", mlp_norm="post_attention_layernorm.weight",
        q="self_attn.q_proj.weight", k="self_attn.k_proj.weight", v="self_attn.v_proj.weight",
        o="self_attn.o_proj.weight", gate="mlp.gate_proj.weight", up="mlp.up_proj.weight",
        down="mlp.down_proj.weight").items()}
    if cfg.qk_norm:
        names.update(q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight")
    return names


def expected_hf_keys(cfg: LlamaConfig) -> set[str]:
    keys = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        keys.add("lm_head.weight")
    for i in range(cfg.num_layers):
        keys.update(_hf_names(cfg, i).values())
    return keys


def load_hf_state_dict(model: nnx.Module, state_dict: Mapping[str, Any], *, strict: bool = True) -> nnx.Module:
    """Fills the parameters of ``model`` (a :class:`CodaLlama`) from a Hugging Face Llama
    state dict (in place), and returns it.

    Values may be torch tensors or arrays. ``strict`` rejects unexpected keys (rotary
    buffers such as ``rotary_emb.inv_freq`` are ignored, and ``lm_head.weight`` is ignored
    for tied embeddings).
    """
    cfg = model.config
    want = expected_hf_keys(cfg)
    have = {k for k in state_dict if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        have.discard("lm_head.weight")
    missing, unexpected = want - have, have - want
    if missing:
        raise KeyError(f"state dict is missing {len(missing)} keys, e.g. {sorted(missing)[:4]}")
    if strict and unexpected:
        raise KeyError(f"state dict has {len(unexpected)} unexpected keys, e.g. {sorted(unexpected)[:4]}")

    def take(key: str, shape: tuple[int, ...]) -> np.ndarray:
        v = _np(state_dict[key])
        if v.shape != shape:
            raise ValueError(f"{key}: expected shape {shape} for this config, got {v.shape}")
        return v

    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    pd = cfg.param_dtype

    def put(param: nnx.Param, value: np.ndarray) -> None:
        param[...] = jnp.asarray(value, pd)

    put(model.embed, take("model.embed_tokens.weight", (cfg.vocab_size, d)))
    put(model.final_norm, take("model.norm.weight", (d,)))
    if not cfg.tie_word_embeddings:
        put(model.lm_head, take("lm_head.weight", (cfg.vocab_size, d)))
    for i, blk in enumerate(model.blocks):
        n = _hf_names(cfg, i)
        put(blk.attn_norm, take(n["attn_norm"], (d,)))
        put(blk.mlp_norm, take(n["mlp_norm"], (d,)))
        q = take(n["q"], (cfg.num_heads * hd, d))
        k = take(n["k"], (cfg.num_kv_heads * hd, d))
        v = take(n["v"], (cfg.num_kv_heads * hd, d))
        put(blk.w_qkv, np.concatenate([q, k, v], axis=0).T)
        put(blk.w_o, take(n["o"], (d, cfg.num_heads * hd)).T)
        put(blk.w_gu, np.asarray(interleave_gate_up(take(n["gate"], (f, d)).T, take(n["up"], (f, d)).T)))
        put(blk.w_down, take(n["down"], (d, f)).T)
        if cfg.qk_norm:
            put(blk.q_norm, take(n["q_norm"], (hd,)))
            put(blk.k_norm, take(n["k_norm"], (hd,)))
    return model


def _on_host(x) -> np.ndarray:
    """``x`` whole as a float32 numpy array. An array spread over several processes' devices
    (``jax.distributed``) is gathered from all of them first (a collective: every process
    must get here); ``np.asarray`` refuses one whose shards are not all in this process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x, np.float32)


def to_hf_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """The inverse of :func:`load_hf_state_dict`: ``model``'s (a :class:`CodaLlama`'s)
    parameters as float32 numpy arrays in HF names/layouts. Under several processes every
    process must call it: parameters split over other processes' devices are gathered."""
    cfg = model.config
    a = lambda p: _on_host(p[...])
    out = {"model.embed_tokens.weight": a(model.embed), "model.norm.weight": a(model.final_norm)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = a(model.lm_head)
    hd = cfg.head_dim
    nq, nk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    for i, blk in enumerate(model.blocks):
        n = _hf_names(cfg, i)
        qkv = a(blk.w_qkv).T
        gate, up = split_gate_up(a(blk.w_gu))
        out.update({
            n["attn_norm"]: a(blk.attn_norm), n["mlp_norm"]: a(blk.mlp_norm),
            n["q"]: qkv[:nq], n["k"]: qkv[nq:nq + nk], n["v"]: qkv[nq + nk:], n["o"]: a(blk.w_o).T,
            n["gate"]: np.asarray(gate).T, n["up"]: np.asarray(up).T, n["down"]: a(blk.w_down).T,
        })
        if cfg.qk_norm:
            out[n["q_norm"]], out[n["k_norm"]] = a(blk.q_norm), a(blk.k_norm)
    return out
