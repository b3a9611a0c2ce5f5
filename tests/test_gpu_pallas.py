"""GPU suite (H100): every epilogue program through the compiled Pallas kernel, at sizes
that exercise the persistent grid and the default tuning table, against the reference."""

import pytest

from coda_jax.pallas.tuning import TuningConfig
from test_pallas_kernels import CASES, _compare

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("epi,kw", CASES, ids=[c[0].name for c in CASES])
def test_program_on_gpu(epi, kw):
    _compare(epi, 2048, 1024, 1024, config=TuningConfig(), **kw)


def test_ragged_shapes_on_gpu():
    from coda_jax import programs

    _compare(programs.RESIDUAL_RMS, 1000, 1500, 520, config=TuningConfig())
    _compare(programs.RMS_LSE, 777, 5000, 256, transpose_b=True, config=TuningConfig())
