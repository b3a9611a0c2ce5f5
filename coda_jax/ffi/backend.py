"""Registers the CuTeDSL lowering as the ``"cutedsl"`` backend of every op."""

from coda_jax.backend import register_lowering
from coda_jax.ffi.lowering import CUTEDSL
from coda_jax.ops.names import ALL_OPS

register_lowering("cutedsl", lambda: CUTEDSL, ALL_OPS)
