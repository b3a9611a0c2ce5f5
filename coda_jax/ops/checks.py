"""Argument validation shared by the ops: errors name the argument and the rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def check_2d(name: str, x: jax.Array, *, features: int | None = None, tokens: int | None = None) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(x.shape)}")
    if features is not None and x.shape[1] != features:
        raise ValueError(f"{name} must have {features} features (last axis), got shape {tuple(x.shape)}")
    if tokens is not None and x.shape[0] != tokens:
        raise ValueError(f"{name} must have {tokens} tokens (first axis), got shape {tuple(x.shape)}")


def check_float(name: str, x: jax.Array) -> None:
    if x.dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_same_dtype(**arrays: jax.Array) -> None:
    dtypes = {k: v.dtype for k, v in arrays.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"GEMM operands must share one dtype, got {', '.join(f'{k}={v}' for k, v in dtypes.items())}")


def check_weight(name: str, w: jax.Array, in_features: int) -> None:
    if w.ndim != 2 or w.shape[0] != in_features:
        raise ValueError(f"{name} must be [in={in_features}, out], got shape {tuple(w.shape)}")


def check_vector(name: str, v: jax.Array, size: int) -> None:
    if v.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {tuple(v.shape)}")
