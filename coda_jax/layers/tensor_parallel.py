"""Tensor parallelism for :class:`~coda_jax.layers.CodaLlamaBlock` (Megatron, sequence-parallel).

When the context mesh (``jax.set_mesh``) has a ``"tensor"`` axis of size ``T > 1``, the
block runs as one ``jax.shard_map`` over every mesh axis. Each tensor shard owns ``H / T``
query heads, ``KV / T`` KV heads and ``f / T`` MLP features; tokens stay split over the
data axes (``"data"``, ``"fsdp"``) as everywhere else. Per shard, with ``x`` the whole rows
of its data shard ``[M_d, d]``:

    qkv   = RoPE(rstd(x) * (x*g_attn) @ W_qkv[:, heads_t])     fused (column-parallel)
    o     = attention(q, k, v) over the local heads
    x1_t  = x_t + reduce_scatter_T(o @ W_o[heads_t, :])         row-parallel GEMM (XLA)
    x1    = all_gather_T(x1_t)
    p     = SwiGLU(rstd(x1) * (x1*g_mlp) @ W_gu[:, feats_t]) @ W_down[feats_t, :]   fused
    x2_t  = x1_t + reduce_scatter_T(p)
    x_out = all_gather_T(x2_t)

``x_t`` is this shard's ``1/T`` of the rows: the residual adds run sequence-parallel on
``M_d / T`` rows after a reduce-scatter of the row-parallel GEMMs' partial sums (in the
compute dtype, as plain JAX's partitioner reduces them; the option ``mesh.partial_sums="float32"``
keeps float32; the adds themselves run in float32),
and the gathers restore whole rows for the next column-parallel GEMM.

**What stays fused under TP**: the QKV GEMM with the norm scale, RoPE and QK-norm in its
epilogue, and the gate/up GEMM with the norm scale and SwiGLU, forward and backward
(:func:`coda_jax.swiglu_mlp_partial`: the SwiGLU backward still runs in the epilogue of the
down projection's dgrad GEMM). **What does not**: the residual add and the RMS statistics
after a row-parallel GEMM (the partial sums must be reduced across shards first) become XLA
ops after the reduce-scatter, and the norm statistics are recomputed from ``x`` in the next
GEMM's op (no cross-layer :class:`~coda_jax.NormCarry` under TP).

Weights enter the ``shard_map`` split as the math needs (``W_q``/``W_k``/``W_v`` and ``W_gu``
by columns, ``W_o``/``W_down`` by rows); :func:`coda_jax.sharding.shard_state` stores them
that way (``W_qkv`` excepted: its Q, K and V column groups are split separately, so it is
stored whole along its columns; with an FSDP axis each group is sliced to its tensor
shard's columns on the device that holds its rows, then gathered along the rows).
Gradients: ``shard_map``'s transpose (``check_vma=False``) sums each input's cotangent
over the axes its spec does not name, which is exactly the sum of
the shards' partial gradients (data shards for every weight, tensor shards for the norm
weights and for ``x``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coda_jax import mesh_axes, partitioning
from coda_jax.ops.attention import causal_attention
from coda_jax.mesh_axes import TENSOR_AXIS
from coda_jax.ops.rms_norm_matmul_rope import rms_norm_matmul_rope
from coda_jax.ops.swiglu_mlp import swiglu_mlp_partial
from coda_jax.programs import SWIGLU_BLOCK
from coda_jax.sharding import reshape_tokens


def tensor_parallel_size(mesh) -> int:
    """Size of ``mesh``'s ``"tensor"`` axis (1 without a mesh, without the axis, or inside a
    ``shard_map`` that already made it manual)."""
    return mesh_axes.axis_size(mesh, TENSOR_AXIS)


def check_tensor_parallel(config, batch: int, seq: int, mesh) -> None:
    """Raises ``ValueError`` naming the rule when the block cannot split over ``mesh``'s
    tensor axis: heads, KV heads and MLP features divisible by ``T`` (each shard's gate/up
    columns whole 64-column pairs), the batch by the data axes, each data shard's tokens by ``T``."""
    t = tensor_parallel_size(mesh)
    c = config
    if c.num_heads % t or c.num_kv_heads % t:
        raise ValueError(f"tensor parallel: num_heads ({c.num_heads}) and num_kv_heads ({c.num_kv_heads}) must be "
                         f"multiples of the mesh's {TENSOR_AXIS!r} axis size ({t})")
    if c.intermediate_size % (t * SWIGLU_BLOCK):
        raise ValueError(f"tensor parallel: intermediate_size ({c.intermediate_size}) must be a multiple of "
                         f"{TENSOR_AXIS!r} axis size x {SWIGLU_BLOCK} ({t * SWIGLU_BLOCK}): each shard's gate/up "
                         "columns are whole 64-column blocks")
    dp = mesh_axes.token_shards(mesh)
    if batch % dp:
        raise ValueError(f"tensor parallel: batch ({batch}) must be a multiple of the data axes' size ({dp})")
    if (batch // dp * seq) % t:
        raise ValueError(f"tensor parallel: tokens per data shard ({batch // dp} x {seq}) must be a multiple of "
                         f"the {TENSOR_AXIS!r} axis size ({t}) for the sequence-parallel residual")




def _columns_over_tensor(w: jax.Array, mesh) -> jax.Array:
    """A column group of ``W_qkv`` (``[d, heads * hd]``, stored split over ``"fsdp"`` along its
    rows and whole over ``"tensor"``) placed as ``P("fsdp", "tensor")``:
    each device keeps its own tensor shard's columns of its rows, a local slice, so the
    ``shard_map``'s ``P(None, "tensor")`` is then a gather over ``"fsdp"`` along the rows
    (under an Explicit mesh the same as a ``reshard``).
    Left to the partitioner, it went from rows over ``"fsdp"`` to columns over ``"tensor"``
    by all-to-alls, or by replicating the whole group first (XLA's "involuntary full
    rematerialization")."""
    f = mesh_axes.axis_size(mesh, mesh_axes.FSDP_AXIS)
    if f <= 1 or w.shape[0] % f:
        return w
    spec = P(mesh_axes.FSDP_AXIS, TENSOR_AXIS)
    return jax.sharding.reshard(w, spec) if mesh.are_all_axes_explicit else jax.lax.with_sharding_constraint(w, spec)


def tensor_parallel_block(block, x: jax.Array, positions: jax.Array) -> jax.Array:
    """``block(x, positions)`` split over the context mesh's ``"tensor"`` axis.

    Args:
      block: a :class:`~coda_jax.layers.CodaLlamaBlock`.
      x: ``[B, S, d]`` residual stream (batch split over the data axes, if any).
      positions: ``[B, S]`` int token positions.

    Returns:
      ``[B, S, d]`` in the config's compute dtype.
    """
    c = block.config
    mesh = mesh_axes.context_mesh()
    t = tensor_parallel_size(mesh)
    b, s, d = x.shape
    check_tensor_parallel(c, b, s, mesh)
    dt, hd, nh, nkv = c.dtype, c.head_dim, c.num_heads, c.num_kv_heads
    m = b * s
    dp = mesh_axes.token_axes(mesh)
    tok = dp if len(dp) > 1 else (dp[0] if dp else None)
    # Each weight cast on its stored split (not gathered whole): the shard_map's in_specs
    # below say what each device needs, so only the FSDP split is gathered (under an
    # Explicit mesh, shard_map_over reshards to them; whole, every device gathered every
    # weight over "tensor" too).
    def w(name, dtype=None):
        return block._param(name, dtype, whole=False)

    w_qkv = w("w_qkv", dt)  # [d, (H + 2 KV) hd]: Q, K, V column groups, each split by heads
    groups = {"w_q": w_qkv[:, :nh * hd], "w_k": w_qkv[:, nh * hd:(nh + nkv) * hd], "w_v": w_qkv[:, (nh + nkv) * hd:]}
    params = {"attn_norm": w("attn_norm"), **{k: _columns_over_tensor(v, mesh) for k, v in groups.items()},
              "w_o": w("w_o", dt), "mlp_norm": w("mlp_norm"),
              "w_gu": w("w_gu", dt), "w_down": w("w_down", dt), "inv_freq": w("inv_freq")}
    col, row = P(None, TENSOR_AXIS), P(TENSOR_AXIS, None)
    specs = {"attn_norm": P(), "w_q": col, "w_k": col, "w_v": col, "w_o": row, "mlp_norm": P(),
             "w_gu": col, "w_down": row, "inv_freq": P()}
    if c.qk_norm:
        params.update(q_norm=w("q_norm"), k_norm=w("k_norm"))
        specs.update(q_norm=P(), k_norm=P())
    hl, kvl = nh // t, nkv // t
    part = partitioning.partial_sum_dtype(dt)  # dtype of the row-parallel partial sums on the wire

    def body(x, pos, p):
        ml = x.shape[0]
        qk = dict(q_norm=p["q_norm"], k_norm=p["k_norm"], qk_norm_eps=c.qk_norm_eps) if c.qk_norm else {}
        w_qkv_t = jnp.concatenate([p["w_q"], p["w_k"], p["w_v"]], axis=1)  # this shard's heads, Q|K|V
        q, k, v = rms_norm_matmul_rope(x, p["attn_norm"], w_qkv_t, pos, p["inv_freq"], num_heads=hl,
                                       num_kv_heads=kvl, eps=c.rms_norm_eps, split_qkv=True, backend=block.backend,
                                       **qk)
        q = q.reshape(ml // s, s, hl, hd)
        k = k.reshape(ml // s, s, kvl, hd)
        v = v.reshape(ml // s, s, kvl, hd)
        o = causal_attention(q, k, v, c.attention_implementation).reshape(ml, hl * hd)
        # Row-parallel o-projection: partial sums reduce-scattered over the rows, in the
        # compute dtype as plain JAX's partitioner would (partitioning.partial_sum_dtype).
        attn = jax.lax.psum_scatter(jnp.dot(o, p["w_o"], preferred_element_type=part), TENSOR_AXIS,
                                    scatter_dimension=0, tiled=True).astype(jnp.float32)
        rows = ml // t
        x_t = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(TENSOR_AXIS) * rows, rows, axis=0)
        x1_t = (x_t.astype(jnp.float32) + attn).astype(dt)
        x1 = jax.lax.all_gather(x1_t, TENSOR_AXIS, axis=0, tiled=True)
        mlp = swiglu_mlp_partial(x1, p["mlp_norm"], p["w_gu"], p["w_down"], eps=c.rms_norm_eps,
                                 backend=block.backend)
        x2_t = (x1_t.astype(jnp.float32)
                + jax.lax.psum_scatter(mlp.astype(part), TENSOR_AXIS, scatter_dimension=0,
                                       tiled=True).astype(jnp.float32)).astype(dt)
        return jax.lax.all_gather(x2_t, TENSOR_AXIS, axis=0, tiled=True)

    out = partitioning.shard_map_over(mesh, body, (P(tok, None), P(tok), specs), P(tok, None),
                                      reshape_tokens(x, (m, d)).astype(dt), reshape_tokens(positions, (m,)), params)
    return reshape_tokens(out, (b, s, d))
