"""The block's causal GQA attention: an implementation that supports the shape, chosen once.

``jax.nn.dot_product_attention(implementation="cudnn")`` refuses some legal shapes (jax
0.11.2, ``jax/_src/cudnn/fused_attention_stablehlo.py``, ``check_is_flash_attention``):

* head_dim must be a multiple of 8 and at most 256 on Hopper and later (128 before);
* under differentiation, odd sequence lengths raise ``Unsupported sequence length Q 77,
  KV 77``: the training rule passes its empty placeholder bias as a real one, and a bias
  needs even lengths.

Odd lengths are padded by one token at the end: under a causal mask no real query attends
to a later key, so the real rows' outputs (and gradients) are exactly the unpadded ones and
the padded row is sliced off. A head_dim cuDNN cannot run falls back to XLA's attention.
Each such decision is logged once per process.

Under an Explicit-mode mesh the attention runs per batch shard in a ``shard_map``: cuDNN's
output carries no sharding type there, and the transpose of the reshape that follows it
then fails (``ShardingTypeError``, seen on 2 and 4 GPUs with FSDP). Attention is
independent per sequence, so each device attends over its own rows of the batch.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from coda_jax.log import log_once
from coda_jax.sharding import explicit_sharding


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How one attention call runs.

    Attributes:
      implementation: passed to ``jax.nn.dot_product_attention`` (``None``: XLA).
      seq_len: the (padded) sequence length it runs at; ``>=`` the real one.
      note: why the plan differs from the request (logged once), or ``""``.
    """

    implementation: str | None
    seq_len: int
    note: str = ""


def cudnn_max_head_dim(compute_capability: str | None) -> int:
    """cuDNN flash attention's largest head_dim: 256 on Hopper (sm_90) and later, else 128."""
    try:
        major = int(str(compute_capability).split(".")[0])
    except ValueError:
        major = 0
    return 256 if major >= 9 else 128


def plan_attention(requested: str | None, *, dtype, seq_len: int, head_dim: int, platform: str,
                   compute_capability: str | None = None) -> AttentionPlan:
    """The implementation and padded length of a causal attention over ``seq_len`` tokens.

    ``requested``: the config's ``attention_implementation``. ``"auto"`` picks cuDNN on a
    GPU for 16-bit dtypes where it supports ``head_dim`` (else XLA); any cuDNN run gets an
    odd ``seq_len`` padded to even. Other requests are kept as they are.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    impl = requested
    note = ""
    if requested == "auto":
        impl = "cudnn" if platform == "gpu" and jnp.dtype(dtype).itemsize == 2 else None
        limit = cudnn_max_head_dim(compute_capability)
        if impl == "cudnn" and (head_dim % 8 or head_dim > limit):
            impl = None
            note = (f"attention: cuDNN needs head_dim a multiple of 8 and <= {limit} (got {head_dim}); "
                    "using XLA's attention")
    if impl == "cudnn" and seq_len % 2:
        return AttentionPlan("cudnn", seq_len + 1,
                             f"attention: cuDNN's training path needs an even sequence length (got {seq_len}); "
                             f"padding to {seq_len + 1} at the end (exact under the causal mask)")
    return AttentionPlan(impl, seq_len, note)


def _log_once(note: str) -> None:
    if note:
        log_once(("attention", note), logging.WARNING, "%s", note)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, requested: str | None) -> jax.Array:
    """Causal GQA attention, ``o = softmax(q k^T / sqrt(hd) + causal) v``.

    Args:
      q: ``[B, S, H, hd]``; k, v: ``[B, S, KV, hd]`` (``H`` a multiple of ``KV``), same dtype.
      requested: ``attention_implementation`` of the config (``"auto"``, ``"cudnn"``,
        ``"xla"`` or ``None``).

    Returns:
      ``[B, S, H, hd]`` in q's dtype.
    """
    sh = explicit_sharding(q)
    if sh is not None and any(p is not None for p in sh.spec):
        spec = P(sh.spec[0], None, None, None)  # split by batch only: sequences are independent
        q, k, v = (jax.sharding.reshard(t, spec) for t in (q, k, v))
        attend = lambda q, k, v: _causal_attention(q, k, v, requested)  # noqa: E731
        return jax.shard_map(attend, mesh=sh.mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
    return _causal_attention(q, k, v, requested)


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, requested: str | None) -> jax.Array:
    dev = jax.local_devices()[0]  # this process's: under jax.distributed, devices()[0] may be remote
    plan = plan_attention(requested, dtype=q.dtype, seq_len=q.shape[1], head_dim=q.shape[3],
                          platform=dev.platform, compute_capability=getattr(dev, "compute_capability", None))
    _log_once(plan.note)
    s = q.shape[1]
    if plan.seq_len != s:  # zero rows after the last token: invisible to the real rows (causal)
        pad = lambda x: jnp.pad(x, ((0, 0), (0, plan.seq_len - s), (0, 0), (0, 0)))  # noqa: E731
        q, k, v = pad(q), pad(k), pad(v)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=plan.implementation)
    return o[:, :s]
