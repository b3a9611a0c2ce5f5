"""Registers the reference lowering as the ``"xla"`` backend of every op."""

from coda_jax.backend import register_lowering
from coda_jax.ops.names import ALL_OPS
from coda_jax.reference import xla_backend_lowering

register_lowering("xla", xla_backend_lowering, ALL_OPS)
