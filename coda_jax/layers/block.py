"""``CodaLlamaBlock``: a Llama decoder layer whose non-attention ops live in GEMM epilogues."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from coda_jax.ops.attention import causal_attention
from coda_jax.layers.config import LlamaConfig
from coda_jax.layers.tensor_parallel import tensor_parallel_block, tensor_parallel_size
from coda_jax.backend import lowering_for
from coda_jax.fp8 import Fp8Meta, Fp8Tensor, check_fp8_device
from coda_jax.ops.fp8_llama_block import block_tensors as fp8_block_tensors
from coda_jax.ops.fp8_llama_block import BlockShape as Fp8BlockShape
from coda_jax.ops.fp8_llama_block import Fp8Carry, fp8_llama_block
from coda_jax.ops.matmul_residual_rms import matmul_residual_rms
from coda_jax.ops.names import FP8_LLAMA_BLOCK
from coda_jax.ops.norm_carry import NormCarry
from coda_jax.ops.rms_norm_matmul_rope import rms_norm_matmul_rope, rope_rotated_columns, rope_tables
from coda_jax.ops.swiglu_mlp import swiglu_mlp
from coda_jax.ops.rope_frequencies import rope_inv_freq
from coda_jax.reference import xla_backend_lowering
from coda_jax.mesh_axes import context_mesh, token_axes
from coda_jax.sharding import cast_for_use, logical_param, param_split, reshape_tokens


def _normal(rngs: nnx.Rngs, shape, std, dtype):
    return jax.random.normal(rngs.params(), shape, dtype) * std


class CodaLlamaBlock(nnx.Module):
    """One Llama decoder layer: four GEMM-epilogue programs around attention.

    1. ``qkv = RoPE(rstd * (h @ w_qkv))``        (input norm folded into the QKV GEMM)
    2. ``o = dot_product_attention(q, k, v)``     (causal, GQA; cuDNN on GPU)
    3. ``x1 = x + o @ w_o``  -> carry ``(x1 * mlp_norm, sumsq(x1))``
    4. ``y = silu(.) * (.)`` of ``rstd1 * (h1 @ w_gu)``
    5. ``x2 = x1 + y @ w_down`` -> carry for the *next* norm (``next_norm``)

    Steps 4-5 are one op (:func:`coda_jax.swiglu_mlp`), so that the SwiGLU backward runs in
    the epilogue of the down projection's dgrad GEMM.

    Parameters follow Llama checkpoint names (``input_layernorm`` = ``attn_norm``,
    ``post_attention_layernorm`` = ``mlp_norm``), with Q/K/V fused into ``w_qkv``
    ``[d, (H + 2*KV) * hd]`` and gate/up into ``w_gu`` ``[d, 2f]`` (64-column blocks).
    Weights are ``[in, out]``. Each parameter carries logical axis names (``embed``,
    ``qkv``, ``heads``, ``mlp``, ``norm``, ``head_dim``; :data:`coda_jax.sharding.LOGICAL_AXIS_RULES`
    maps them to mesh axes), so ``nnx.get_partition_spec`` shards the block like any Flax module.

    Call: ``block(x [B, S, d], positions [B, S] int, carry=None, next_norm=None)``
    returns ``(x_out [B, S, d], carry_out)``. ``carry`` is the :class:`NormCarry` of ``x``
    for this block's input norm (from the previous block; ``None`` computes it), and
    ``next_norm`` the ``[d]`` weight of the norm that reads ``x_out`` (the next block's
    ``attn_norm`` or the final norm): with it, the last GEMM's epilogue writes the next
    carry, so no standalone norm pass runs between blocks.

    ``grad_through_carry=True`` is the caller's promise that the block reading ``carry_out``
    is the only reader of ``x_out`` (a plain chain of blocks, as :class:`CodaLlama`'s loop).
    In FP8 with delayed scaling that block then writes ``x_out``'s gradient in e5m2 in its
    QKV dgrad's epilogue and returns it through the carry, where this block would otherwise
    quantize it in a pass of its own. A gradient reaching ``x_out`` from another reader
    would be missed in the FP8 GEMMs, so leave it False unless the chain is plain. Ignored
    without FP8.

    Under a context mesh with a ``"tensor"`` axis (``jax.set_mesh``), the block runs tensor
    parallel (:mod:`coda_jax.layers.tensor_parallel`): heads and MLP features split over the
    axis, and the carry is not used (``carry_out`` is ``None``).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, backend: str | None = None):
        c = config
        self.config = c
        self.backend = backend
        d, f, hd = c.hidden_size, c.intermediate_size, c.head_dim
        pd = c.param_dtype
        p = logical_param  # nnx.Param with logical axis names (coda_jax.sharding.LOGICAL_AXIS_RULES)
        self.attn_norm = p(jnp.ones((d,), pd), ("norm",))
        self.w_qkv = p(_normal(rngs, (d, c.qkv_size), d ** -0.5, pd), ("qkv_embed", "qkv"))
        self.w_o = p(_normal(rngs, (c.num_heads * hd, d), (c.num_heads * hd) ** -0.5 / (2 * c.num_layers) ** 0.5, pd),
                     ("heads", "embed"))
        self.mlp_norm = p(jnp.ones((d,), pd), ("norm",))
        self.w_gu = p(_normal(rngs, (d, 2 * f), d ** -0.5, pd), ("embed", "mlp"))
        self.w_down = p(_normal(rngs, (f, d), f ** -0.5 / (2 * c.num_layers) ** 0.5, pd), ("mlp", "embed"))
        if c.qk_norm:
            self.q_norm = p(jnp.ones((hd,), pd), ("head_dim",))
            self.k_norm = p(jnp.ones((hd,), pd), ("head_dim",))
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(hd, c.rope_theta, c.rope_scaling)))
        # FP8 (config.fp8): one amax history per quantized tensor (coda_jax.ops.fp8_llama_block.block_tensors).
        # fp8_carry_out: whether the carry this block writes is read by another FP8 block (the
        # model's last block writes a compute-dtype carry for the LM head).
        self.fp8_carry_out = True
        if c.fp8 is not None:
            self.fp8_meta = Fp8Meta(jnp.zeros((len(fp8_block_tensors(c.fp8.swiglu_input)), c.fp8.history),
                                              jnp.float32))

    def _param(self, name: str, dtype=None, whole: bool = True) -> jax.Array:
        """Parameter ``name`` as the layer uses it: cast to ``dtype`` (before any gather: half
        the bytes), then whole on every device (``whole=False``: left on its stored split,
        for a ``shard_map`` that takes its own part; :func:`coda_jax.sharding.cast_for_use`)."""
        return cast_for_use(getattr(self, name), dtype, whole)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array | None = None,
        carry: NormCarry | None = None,
        next_norm: jax.Array | None = None,
        *,
        grad_through_carry: bool = False,
    ) -> tuple[jax.Array, NormCarry | None]:
        c = self.config
        b, s, d = x.shape
        if d != c.hidden_size:
            raise ValueError(f"x must be [batch, seq, {c.hidden_size}], got {x.shape}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        tensor_parallel = tensor_parallel_size(context_mesh()) > 1
        if c.fp8 is not None:
            return self._fp8_call(x, positions, carry, next_norm, tensor_parallel, grad_through_carry)
        if tensor_parallel:  # Megatron TP: coda_jax/layers/tensor_parallel.py
            return tensor_parallel_block(self, x, positions), None
        dt = c.dtype
        m = b * s
        x2 = reshape_tokens(x, (m, d)).astype(dt)
        w = self._param  # a parameter as used: cast, and gathered if FSDP-split under an Explicit mesh
        qk = dict(q_norm=w("q_norm"), k_norm=w("k_norm"), qk_norm_eps=c.qk_norm_eps) if c.qk_norm else {}
        (q, k, v), x2 = rms_norm_matmul_rope(
            x2, w("attn_norm"), w("w_qkv", dt), reshape_tokens(positions, (m,)), w("inv_freq"),
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, carry=carry, eps=c.rms_norm_eps,
            return_residual=True, split_qkv=True, backend=self.backend, **qk)
        hd, nh, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        q = reshape_tokens(q, (b, s, nh, hd))
        k = reshape_tokens(k, (b, s, nkv, hd))
        v = reshape_tokens(v, (b, s, nkv, hd))
        o = causal_attention(q, k, v, c.attention_implementation)  # cuDNN where it supports the shape
        x1, carry1 = matmul_residual_rms(reshape_tokens(o, (m, nh * hd)), w("w_o", dt), x2, w("mlp_norm"),
                                         backend=self.backend)
        out, carry2 = swiglu_mlp(x1, w("mlp_norm"), w("w_gu", dt), w("w_down", dt),
                                 next_norm, carry=carry1, eps=c.rms_norm_eps, backend=self.backend)
        return reshape_tokens(out, (b, s, d)), carry2

    def _fp8_call(self, x, positions, carry, next_norm, tensor_parallel: bool = False,
                  grad_through_carry: bool = False):
        """The block in FP8 (:func:`coda_jax.ops.fp8_llama_block.fp8_llama_block`).

        Under a ``"tensor"`` mesh axis the weights stay on their stored splits (``w_gu`` by
        columns, ``w_o`` and ``w_down`` by rows) and the block's GEMMs and epilogues run as
        XLA ops (the ``xla`` backend's lowering, unpartitioned), which XLA's SPMD partitioner
        splits from those shardings, amaxes reduced over the whole tensors: the FP8 block has
        no ``shard_map`` of its own (docs/fp8.md#meshes)."""
        c = self.config
        b, s, d = x.shape
        m, hd = b * s, c.head_dim
        check_fp8_device()
        if carry is not None and not isinstance(carry, Fp8Carry):
            carry = None  # a compute-dtype carry (not from an FP8 block): h is quantized from x
        w = self._param
        weights = ("w_qkv", "w_o", "w_gu", "w_down")
        # The weights stay on their stored splits: the op quantizes each where it lies and
        # gathers its FP8 copy (under FSDP one byte an element crosses devices, not four);
        # under a tensor axis they stay split for XLA's partitioner.
        params = {name: w(name, whole=not tensor_parallel and name not in weights)
                  for name in ("attn_norm", "w_qkv", "w_o", "mlp_norm", "w_gu", "w_down")}
        splits = None if tensor_parallel else tuple((n, param_split(getattr(self, n))) for n in weights)
        pos = reshape_tokens(positions, (m,))
        cos, sin = rope_tables(pos, w("inv_freq"))
        aux = {"cos": cos, "sin": sin, "rot": rope_rotated_columns(c.num_heads, c.num_kv_heads, hd // 2)}
        if c.qk_norm:
            aux["qk_w"] = jnp.concatenate([jnp.tile(w("q_norm").astype(jnp.float32), c.num_heads),
                                           jnp.tile(w("k_norm").astype(jnp.float32), c.num_kv_heads),
                                           jnp.ones((c.num_kv_heads * hd,), jnp.float32)])
        carry_out = "none" if next_norm is None else ("fp8" if self.fp8_carry_out else "norm")
        shape = Fp8BlockShape(b, s, c.num_heads, c.num_kv_heads, hd, float(c.rms_norm_eps),
                              float(c.qk_norm_eps) if c.qk_norm else None, c.attention_implementation,
                              c.fp8.margin, carry_out, c.fp8.scaling, c.fp8.promote_k,
                              c.fp8.promote_min_k, splits, grad_carry=grad_through_carry and carry_out == "fp8",
                              swiglu_input=c.fp8.swiglu_input)
        lowering = xla_backend_lowering() if tensor_parallel else lowering_for(FP8_LLAMA_BLOCK, self.backend)

        def block(x, params, aux, meta, carry, next_norm):
            return fp8_llama_block(lowering, shape, x, params, aux, meta, carry=carry, next_norm=next_norm)

        mesh = context_mesh()
        if tensor_parallel and not mesh.are_all_axes_auto:
            # Explicit shardings would make each FP8 dot of differently split operands a type
            # error: the block is partitioned as under an Auto mesh, its results placed back.
            block = jax.sharding.auto_axes(block, out_sharding=_fp8_out_specs(shape, mesh))
        out, carry_out = block(reshape_tokens(x, (m, d)).astype(c.dtype), params, aux, self.fp8_meta[...], carry,
                               next_norm)
        return reshape_tokens(out, (b, s, d)), carry_out


def _fp8_out_specs(shape: Fp8BlockShape, mesh) -> tuple:
    """The shardings of the FP8 block's ``(x_out, carry)`` on ``mesh``: rows split over the
    token axes (``[M, d]`` by rows, ``[d, M]`` copies and ``[P, M]`` partials by columns)."""
    axes = token_axes(mesh)
    tok = axes if len(axes) > 1 else (axes[0] if axes else None)
    rows, cols = P(tok, None), P(None, tok)
    fp8 = Fp8Carry(Fp8Tensor(rows, cols, P()), cols, P() if shape.grad_from_carry else None)
    carry = {"fp8": fp8, "norm": NormCarry(rows, cols), "none": None}
    return rows, carry[shape.carry_out]
