"""An epilogue program run as a pass of its own, where no GEMM produces the tile.

Some tensors a block quantizes come from no GEMM (the attention backward's QKV gradient). A
standalone XLA pass can write their FP8 copies, but it writes the transposed copy as XLA's
layout assignment chooses (for the RoPE backward, the float32 gradient transposed first). Run
as an epilogue instead, the pass gets what a GEMM's epilogue has: tile loads, row and column
loads, and quantizing outputs that write both layouts and the amax from registers.

The GEMM under it has one K step of zero operands (``a [M, K0]``, ``b [N, K0]``, bf16; ``K0``
is the 16-bit kernels' K step): the body's accumulator is zero, and a kernel backend spends one
operand load and one MMA a tile on it beside the epilogue's own traffic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.epilogue import Epilogue
from coda_jax.lowering import GemmLowering

K_STEP = 64  # one K step of the 16-bit kernels: 128-byte rows


def epilogue_pass(lowering: GemmLowering, epilogue: Epilogue, m: int, n: int, loads: Mapping[str, jax.Array],
                  **kw: Any) -> dict[str, Any]:
    """``epilogue`` over an ``[m, n]`` output with a zero accumulator: its results, as
    :meth:`coda_jax.lowering.GemmLowering.gemm` returns them (``kw``: ``out_dtypes``,
    ``out_splits``). The body must not depend on ``acc``."""
    a = jnp.zeros((m, K_STEP), jnp.bfloat16)
    b = jnp.zeros((n, K_STEP), jnp.bfloat16)
    return lowering.gemm(epilogue, a, b, loads, transpose_b=True, **kw)
