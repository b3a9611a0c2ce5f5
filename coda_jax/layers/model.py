"""``CodaLlama``: embedding, a stack of :class:`CodaLlamaBlock`, final norm, LM head, fused loss."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from coda_jax.backend import BackendUnavailableError, resolve_backend
from coda_jax.layers.block import CodaLlamaBlock
from coda_jax.layers.config import LlamaConfig
from coda_jax.layers.embedding import embedding_lookup
from coda_jax.layers.hf_llama import config_from_hf, load_hf_state_dict
from coda_jax.layers.pretrained import load_pretrained, pretrained_config, save_pretrained
from coda_jax.layers.vocab_parallel import vocab_parallel_axis, vocab_parallel_cross_entropy
from coda_jax.fp8 import Fp8Meta
from coda_jax.log import log_once
from coda_jax.ops.fp8_cross_entropy import HEAD_TENSORS, fp8_linear_cross_entropy
from coda_jax.ops.fp8_llama_block import Fp8Carry
from coda_jax.ops.linear_cross_entropy import linear_cross_entropy
from coda_jax.ops.rms_norm_matmul import rms_norm_matmul
from coda_jax.mesh_axes import context_mesh
from coda_jax.pallas.interpret import interpret_enabled
from coda_jax.sharding import cast_for_use, gathered, logical_param, reshape_tokens, typed_on_mesh


def _run_block(block: CodaLlamaBlock, x, positions, carry, next_norm, grad_through_carry: bool):
    return block(x, positions, carry=carry, next_norm=next_norm, grad_through_carry=grad_through_carry)


# LlamaConfig.remat == "block": the backward runs the block's forward again from its input
# and norm carry (the only values saved across it) instead of reading saved activations.
_run_block_remat = nnx.remat(_run_block, static_argnums=(5,))


class CodaLlama(nnx.Module):
    """A Llama-3-style causal LM on coda-jax's fused ops.

    The norm statistics travel between blocks in the GEMM epilogues (each block's last
    GEMM writes the carry of the next block's input norm, the last block's that of the
    final norm), so the only standalone norm pass is the one after the embedding.

    Parameters: ``embed [V, d]``, ``blocks``, ``final_norm [d]``, ``lm_head [V, d]``
    (absent when ``tie_word_embeddings``: the embedding table is the LM head), each with
    logical axis names (:func:`coda_jax.sharding.logical_param`).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, backend: str | None = None):
        c = config
        self.config = c
        self.backend = backend
        self.embed = logical_param(
            jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), c.param_dtype) * 0.02, ("vocab", "embed"))
        self.blocks = nnx.List([CodaLlamaBlock(c, rngs=rngs, backend=backend) for _ in range(c.num_layers)])
        if c.num_layers:
            # The final norm / LM head reads a compute-dtype carry, or with an FP8 head the FP8 one.
            self.blocks[-1].fp8_carry_out = self._fp8_head
        if self._fp8_head:  # the amax histories of the FP8 LM head (coda_jax.ops.fp8_cross_entropy)
            self.fp8_head_meta = Fp8Meta(jnp.zeros((len(HEAD_TENSORS), c.fp8.history), jnp.float32))
        self.final_norm = logical_param(jnp.ones((c.hidden_size,), c.param_dtype), ("norm",))
        if not c.tie_word_embeddings:
            self.lm_head = logical_param(
                jax.random.normal(rngs.params(), (c.vocab_size, c.hidden_size), c.param_dtype) * c.hidden_size ** -0.5,
                ("vocab", "embed"))

    @classmethod
    def from_pretrained(cls, path, *, backend: str | None = None, dtype: Any = jnp.bfloat16,
                        param_dtype: Any = jnp.float32, mesh=None, rngs: nnx.Rngs | None = None,
                        **config_overrides: Any) -> "CodaLlama":
        """A model with the weights of the Hugging Face checkpoint directory ``path``
        (:mod:`coda_jax.layers.pretrained`).

        Args:
          path: directory with ``config.json`` and safetensors weights.
          backend: the model's backend (see :mod:`coda_jax.backend`).
          dtype: compute dtype (bfloat16 by default, what the kernel backends run).
          param_dtype: parameter storage dtype (float32 by default, for training).
          mesh: if given, the parameters are split over it (FSDP along ``"fsdp"``, replicated
            over the other axes; :func:`coda_jax.sharding.shard_state`).
          config_overrides: other :class:`LlamaConfig` fields.

        Raises:
          FileNotFoundError: no config or weights; ValueError / KeyError: an unsupported config
          (biases, another activation or RoPE type) or a missing / mis-shaped tensor, by name.
        """
        cfg = pretrained_config(path, dtype=dtype, param_dtype=param_dtype, **config_overrides)
        return load_pretrained(cls(cfg, rngs=rngs or nnx.Rngs(0), backend=backend), path, mesh=mesh)

    @classmethod
    def from_hf(cls, state_dict: Mapping[str, Any], hf_config: Any, *, rngs: nnx.Rngs | None = None,
                backend: str | None = None, **config_overrides: Any) -> "CodaLlama":
        """A model holding the weights of a Hugging Face Llama state dict (torch tensors or
        arrays) and config (a ``transformers.LlamaConfig`` or its dict), with
        ``config_overrides`` (other :class:`LlamaConfig` fields); see
        :mod:`coda_jax.layers.hf_llama`."""
        model = cls(config_from_hf(hf_config, **config_overrides), rngs=rngs or nnx.Rngs(0), backend=backend)
        return load_hf_state_dict(model, state_dict)

    def save_pretrained(self, path, **kwargs):
        """Writes a Hugging Face checkpoint directory that ``transformers`` loads;
        see :func:`coda_jax.layers.pretrained.save_pretrained`."""
        return save_pretrained(self, path, **kwargs)

    @property
    def _fp8_head(self) -> bool:
        """Whether the LM head runs in FP8 (``Fp8Recipe(lm_head=True)``)."""
        return self.config.fp8 is not None and self.config.fp8.lm_head

    def vocab_weight(self, whole: bool = True) -> jax.Array:
        """``[V, d]`` LM-head weight in the compute dtype (``whole=False``: left on its
        parameter's split, for the vocab-parallel head's ``shard_map`` to slice)."""
        return cast_for_use(self.embed if self.config.tie_word_embeddings else self.lm_head, self.config.dtype,
                            whole=whole)

    def hidden_states(self, tokens: jax.Array, positions: jax.Array | None = None):
        """``tokens [B, S]`` -> final residual stream ``[B*S, d]`` and its norm carry."""
        c = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, seq] integers, got shape {tokens.shape}")
        b, s = tokens.shape
        tokens = typed_on_mesh(tokens)  # a batch made outside an Explicit mesh: replicated on it
        positions = None if positions is None else typed_on_mesh(positions)
        x = embedding_lookup(self.embed[...], tokens, c.dtype)
        carry = None
        n = len(self.blocks)
        run = _run_block_remat if self._remat_blocks() else _run_block
        for i, block in enumerate(self.blocks):
            next_norm = gathered(self.blocks[i + 1].attn_norm[...]) if i + 1 < n else gathered(self.final_norm[...])
            # Each block's output is read by the next block alone: in FP8 its gradient comes back
            # through the carry (the last block's from the head, which reads its carry as a cache).
            x, carry = run(block, x, positions, carry, next_norm, i + 1 < n)
        return reshape_tokens(x, (b * s, c.hidden_size)), carry

    def _remat_blocks(self) -> bool:
        """Whether the blocks run under ``nnx.remat`` (``config.remat == "block"``). Not with the
        Pallas kernels in the GPU interpreter: its host callbacks are effects that
        ``jax.checkpoint`` refuses, so there the blocks save their activations (logged once)."""
        if self.config.remat == "none":
            return False
        try:
            name = resolve_backend(self.backend)
        except BackendUnavailableError:
            return True  # the ops raise it, or fall back to the xla backend where allowed
        if name == "pallas" and interpret_enabled():
            log_once("remat_interpret", logging.WARNING,
                     "coda-jax: remat='block' is not applied with the Pallas kernels in the GPU interpreter (its "
                     "callbacks cannot be rematerialized); the blocks save their activations")
            return False
        return True

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Full logits ``[B, S, V]`` float32 (for evaluation / parity; training uses :meth:`loss`)."""
        b, s = tokens.shape
        x, carry = self.hidden_states(tokens, positions)
        if isinstance(carry, Fp8Carry):  # an FP8 head's carry: these logits come from the compute-dtype head
            carry = None
        logits = rms_norm_matmul(x, gathered(self.final_norm[...]), self.vocab_weight().T, carry=carry,
                                 eps=self.config.rms_norm_eps, backend=self.backend)
        return reshape_tokens(logits.astype(jnp.float32), (b, s, logits.shape[-1]))

    def loss(self, tokens: jax.Array, targets: jax.Array, positions: jax.Array | None = None, *,
             ignore_index: int = -100, z_loss: float = 0.0) -> jax.Array:
        """Mean next-token cross-entropy in one fused op (the logits are kept for the backward only
        when they fit the memory budget: :func:`coda_jax.linear_cross_entropy`). Under a
        ``"tensor"`` mesh axis, or an ``"fsdp"`` axis without one, whose size ``n`` divides the
        vocabulary, each shard of that axis takes ``V / n`` of the vocab
        (:mod:`coda_jax.layers.vocab_parallel`); otherwise every shard computes the whole LM
        head for its data shard. With ``Fp8Recipe(lm_head=True)`` the head's GEMMs run in FP8
        (:func:`coda_jax.ops.fp8_cross_entropy.fp8_linear_cross_entropy`), the vocab-parallel
        head's too."""
        c = self.config
        x, carry = self.hidden_states(tokens, positions)
        axis = vocab_parallel_axis(context_mesh(), c.vocab_size)
        targets = reshape_tokens(typed_on_mesh(targets), (targets.size,))
        gamma = gathered(self.final_norm[...])
        kw = dict(eps=c.rms_norm_eps, ignore_index=ignore_index, z_loss=z_loss, backend=self.backend)
        # With an FP8 head the last block wrote the head's h in e4m3 (an Fp8Carry).
        fp8_carry = carry if isinstance(carry, Fp8Carry) else None
        if axis is not None:
            fp8 = (self.fp8_head_meta[...], c.fp8, fp8_carry) if self._fp8_head else None
            return vocab_parallel_cross_entropy(x, gamma, self.vocab_weight(whole=False), targets, vocab_axis=axis,
                                                fp8=fp8, **kw)
        if self._fp8_head:
            return fp8_linear_cross_entropy(x, gamma, self.vocab_weight(), targets, self.fp8_head_meta[...],
                                            recipe=c.fp8, carry=fp8_carry, **kw)
        return linear_cross_entropy(x, gamma, self.vocab_weight(), targets, carry=carry, **kw)
