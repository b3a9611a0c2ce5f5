"""The fused ops: each one GEMM-epilogue program sequence with a custom VJP."""

from coda_jax.ops.linear_cross_entropy import linear_cross_entropy
from coda_jax.ops.matmul_residual_rms import matmul_residual_rms
from coda_jax.ops.norm_carry import NormCarry, norm_carry, rstd_from_partials
from coda_jax.ops.rms_norm_matmul import rms_norm_matmul
from coda_jax.ops.rms_norm_matmul_rope import rms_norm_matmul_rope
from coda_jax.ops.rms_norm_matmul_swiglu import rms_norm_matmul_swiglu
from coda_jax.ops.rope_frequencies import Llama3RopeScaling, rope_inv_freq
from coda_jax.ops.swiglu_layout import interleave_gate_up, split_gate_up
from coda_jax.ops.swiglu_mlp import swiglu_mlp, swiglu_mlp_partial

__all__ = [
    "NormCarry", "Llama3RopeScaling", "interleave_gate_up", "linear_cross_entropy", "matmul_residual_rms",
    "norm_carry", "rms_norm_matmul", "rms_norm_matmul_rope", "rms_norm_matmul_swiglu", "rope_inv_freq",
    "rstd_from_partials", "split_gate_up", "swiglu_mlp", "swiglu_mlp_partial",
]
