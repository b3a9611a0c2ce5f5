"""Tuning configuration of the CuTeDSL GEMM-epilogue kernel (importable without cutlass)."""

from __future__ import annotations

import dataclasses

SCHEDULES = ("auto", "cooperative", "pingpong")


@dataclasses.dataclass(frozen=True)
class CuteDslTuning:
    """Static tiling choices of the CuTeDSL kernel; ``None`` / ``"auto"`` leave each to the
    kernel's own rule. Pass one to :class:`coda_jax.ffi.lowering.CuteDslLowering`.

    Attributes:
      tile_n: ``128`` or ``256`` forces the CTA tile's width where the program fits it
        (default ``None``: :func:`coda_jax.ffi.kernel.choose_tile_n`).
      max_stages: caps the operand pipeline's depth (``>= 2``; default ``None``: as many
        stages as fit beside the epilogue's SMEM).
      group_m: tile rows per raster group of the persistent tile walk (``>= 1``; default
        ``None``: :data:`coda_jax.ffi.kernel.GROUP_M`).
      schedule: ``"cooperative"`` (both consumer warpgroups on one tile), ``"pingpong"`` (each
        on its own 128-wide tiles, one's epilogue beside the other's mainloop; programs it
        cannot run stay cooperative) or ``"auto"`` (default:
        :func:`coda_jax.ffi.kernel.choose_schedule`).
    """

    tile_n: int | None = None
    max_stages: int | None = None
    group_m: int | None = None
    schedule: str = "auto"

    def __post_init__(self):
        if self.tile_n not in (None, 128, 256):
            raise ValueError(f"CuteDslTuning.tile_n must be 128, 256 or None, got {self.tile_n!r}")
        if self.max_stages is not None and (not isinstance(self.max_stages, int) or self.max_stages < 2):
            raise ValueError(f"CuteDslTuning.max_stages must be an integer >= 2 or None, got {self.max_stages!r}")
        if self.group_m is not None and (not isinstance(self.group_m, int) or self.group_m < 1):
            raise ValueError(f"CuteDslTuning.group_m must be an integer >= 1 or None, got {self.group_m!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"CuteDslTuning.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
