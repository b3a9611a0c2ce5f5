"""The one interface every kernel backend implements: "run this GEMM with this epilogue".

Ops (:mod:`coda_jax.ops`) are written once, as sequences of :meth:`GemmLowering.gemm`
calls with epilogue programs (:mod:`coda_jax.programs`). A backend is a lowering of
that call: the reference backend does the GEMM with ``jnp.dot`` and runs the body on
whole arrays, the Pallas backend runs its Hopper mainloop and the body on register
tiles, the CuTeDSL backend does the same through the XLA FFI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax

from coda_jax.epilogue import Epilogue


class GemmLowering(Protocol):
    """What a kernel backend provides.

    ``gemm(epilogue, a, b, loads, ...)`` computes ``acc = op(a) @ op(b)`` in float32
    (``op`` transposes when asked), runs ``epilogue.body`` on it and returns a dict with
    one entry per declared output:

    * ``tile`` outputs: ``[M, N]`` (``[M, N/2]`` for half-width pair outputs) in the
      output's dtype (``out_dtypes[name]``, else the output's declared dtype, else
      ``a.dtype``);
    * ``row_sum``: float32 partials ``[P, M]`` whose sum over axis 0 is the row sum
      (``P`` is backend-specific: the number of N-tiles or chunks);
    * ``col_sum``: float32 partials ``[P, N]`` (``[P, N/2]`` for pair-mode summands of
      half width) whose sum over axis 0 is the column sum;
    * ``row_logsumexp``: float32 partials ``[P, M]`` whose log-sum-exp over axis 0 is
      the row log-sum-exp.

    Arguments:
      a: ``[M, K]`` (``[K, M]`` if ``transpose_a``), bf16/f16/f32.
      b: ``[K, N]`` (``[N, K]`` if ``transpose_b``), same dtype as ``a``.
      loads: arrays named as in ``epilogue.loads``.
      out_dtypes: per-output storage dtypes overriding the declaration.
    """

    name: str

    def gemm(
        self,
        epilogue: Epilogue,
        a: jax.Array,
        b: jax.Array,
        loads: Mapping[str, jax.Array],
        *,
        transpose_a: bool = False,
        transpose_b: bool = False,
        out_dtypes: Mapping[str, Any] | None = None,
    ) -> dict[str, jax.Array]: ...
