"""coda-jax: fused GEMM + epilogue kernels (CODA) for Llama-style Transformers in JAX.

Public API:

* ops (2-D ``[tokens, features]``, ``jax.custom_vjp``): :func:`matmul_residual_rms`,
  :func:`rms_norm_matmul`, :func:`rms_norm_matmul_swiglu`, :func:`rms_norm_matmul_rope`,
  :func:`linear_cross_entropy`, :func:`swiglu_mlp` (the whole MLP), with the cross-layer :class:`NormCarry`;
* backends: :func:`set_backend`, :func:`use_backend`, :func:`resolve_backend`
  (``"xla"``, ``"pallas"``, ``"cutedsl"``, ``"auto"``; env ``CODA_JAX_BACKEND``);
* options (typed, context-scoped): :func:`options`, :func:`set_options`, :func:`current_options`,
  :func:`reset_options`, :class:`Options` and its groups (:class:`RoutingOptions`,
  :class:`CrossEntropyOptions`, :class:`MeshOptions`, :class:`XlaOptions`,
  :class:`KernelCacheOptions`, :class:`PallasOptions`); see ``docs/options.md``;
* layers (Flax NNX): ``coda_jax.layers.CodaLlamaBlock``, ``CodaLlama``, ``LlamaConfig``;
* the epilogue spec for new ops: :mod:`coda_jax.epilogue`, :mod:`coda_jax.programs`.
"""

from coda_jax.backend import (
    BACKENDS,
    BackendError,
    BackendOpMissingError,
    BackendUnavailableError,
    UnknownBackendError,
    backend_unavailable_reason,
    resolve_backend,
    set_backend,
    use_backend,
    use_lowering,
)
from coda_jax.options import (
    CrossEntropyOptions,
    KernelCacheOptions,
    MeshOptions,
    OptionError,
    Options,
    PallasOptions,
    RoutingOptions,
    XlaOptions,
    current_options,
    options,
    parse_overrides,
    reset_options,
    set_options,
)
from coda_jax.ops import (
    Llama3RopeScaling,
    NormCarry,
    interleave_gate_up,
    linear_cross_entropy,
    matmul_residual_rms,
    norm_carry,
    rms_norm_matmul,
    rms_norm_matmul_rope,
    rms_norm_matmul_swiglu,
    rope_inv_freq,
    rstd_from_partials,
    split_gate_up,
    swiglu_mlp,
    swiglu_mlp_partial,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "BackendError", "BackendOpMissingError", "BackendUnavailableError", "UnknownBackendError",
    "backend_unavailable_reason", "resolve_backend", "set_backend", "use_backend", "use_lowering",
    "CrossEntropyOptions", "KernelCacheOptions", "MeshOptions", "OptionError", "Options", "PallasOptions",
    "RoutingOptions", "XlaOptions", "current_options", "options", "parse_overrides", "reset_options", "set_options",
    "Llama3RopeScaling", "NormCarry", "interleave_gate_up", "linear_cross_entropy", "matmul_residual_rms",
    "norm_carry", "rms_norm_matmul", "rms_norm_matmul_rope", "rms_norm_matmul_swiglu", "rope_inv_freq",
    "rstd_from_partials", "split_gate_up", "swiglu_mlp", "swiglu_mlp_partial",
]
