"""The CuTeDSL backend: a Hopper (sm_90a) TMA + wgmma GEMM whose epilogue is lowered from
the backend-neutral :class:`~coda_jax.epilogue.Epilogue` declarations, called from JAX
through ``cutlass.jax.cutlass_call`` (an XLA FFI custom call). See ``docs/cutedsl.md``."""

from coda_jax.ffi.tuning import CuteDslTuning

__all__ = ["CuteDslTuning"]
