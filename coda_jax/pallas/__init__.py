"""The Pallas Mosaic-GPU backend: one Hopper GEMM mainloop lowering every epilogue program."""

from coda_jax.pallas.interpret import interpret_enabled, interpret_mode
from coda_jax.pallas.tuning import CONFIG_TABLE, TuningConfig, choose_config


def __getattr__(name):  # the kernel modules import jax's Pallas GPU stack: load on use
    if name in ("PallasLowering", "PALLAS"):
        from coda_jax.pallas import lowering

        return getattr(lowering, name)
    raise AttributeError(name)


__all__ = ["CONFIG_TABLE", "PALLAS", "PallasLowering", "TuningConfig", "choose_config", "interpret_enabled",
           "interpret_mode"]
