"""Names of the fused ops, as used by the backend registry."""

MATMUL_RESIDUAL_RMS = "matmul_residual_rms"
RMS_NORM_MATMUL = "rms_norm_matmul"
RMS_NORM_MATMUL_SWIGLU = "rms_norm_matmul_swiglu"
RMS_NORM_MATMUL_ROPE = "rms_norm_matmul_rope"
LINEAR_CROSS_ENTROPY = "linear_cross_entropy"
SWIGLU_MLP = "swiglu_mlp"
FP8_LLAMA_BLOCK = "fp8_llama_block"

ALL_OPS = (MATMUL_RESIDUAL_RMS, RMS_NORM_MATMUL, RMS_NORM_MATMUL_SWIGLU, RMS_NORM_MATMUL_ROPE, LINEAR_CROSS_ENTROPY,
           SWIGLU_MLP, FP8_LLAMA_BLOCK)
