"""Registers the Pallas lowering as the ``"pallas"`` backend of every op."""

from coda_jax.backend import register_lowering
from coda_jax.ops.names import ALL_OPS
from coda_jax.pallas.lowering import PALLAS

register_lowering("pallas", lambda: PALLAS, ALL_OPS)
