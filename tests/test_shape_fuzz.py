"""The shape fuzz at CPU scale (tests/shape_fuzz.py): a few seeded draws per backend, the
Pallas kernels in GPU interpret mode (the draws marked ``ws_tile`` on a warp-specialized
[64, 256] CTA tile, so that ragged and all-padding consumer tiles occur); every draw on xla."""

import contextlib

import pytest

import shape_fuzz as F
from coda_jax.pallas import interpret_mode
from coda_jax.pallas.tuning import TuningConfig

WS_TILE = TuningConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, warp_specialized=True, wg_dimension="n")
OP_DRAWS = F.draw(seed=0, count=6, scale="cpu")
MODEL_DRAWS = F.draw(seed=0, count=1, scale="cpu", ops=("model",))
# seed 3's first model draw: 61 tokens, one sequence (no tile multiple in any GEMM's M or K)
FP8_MODEL_DRAWS = F.draw(seed=3, count=1, scale="cpu", ops=("model",))


def test_draws_are_seeded_and_ragged():
    assert F.draw(seed=0, count=6, scale="cpu") == OP_DRAWS != F.draw(seed=1, count=6, scale="cpu")
    big = F.draw(seed=0, count=200, scale="gpu") + F.draw(seed=0, count=50, scale="gpu", ops=("model",))
    assert all(s.m % 64 and s.d % 64 == 0 and s.f % 64 == 0 and s.heads % s.kv_heads == 0 for s in big)
    assert {s.heads // s.kv_heads for s in big} == set(range(1, 9))
    assert {s.vocab for s in big} == {32000, 32003, 50257, 151936} and {s.head_dim for s in big} == {64, 128}
    assert {s.qk_norm for s in big} == {False, True} and max(s.m for s in big) > 3000


@pytest.fixture
def _pallas(request):
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield request.param
    reset_gpu_interpret_mode_state()


WS_DRAWS = [s for s in OP_DRAWS if s.ws_tile]


@pytest.mark.parametrize("_pallas", WS_DRAWS, ids=[f"{s.op}-m{s.m}" for s in WS_DRAWS], indirect=True)
def test_op_draws_on_a_warp_specialized_tile(_pallas):
    # Kernel level, one kernel per jit (see F.forward_gemms); the table's configurations run
    # the ops forward and backward in the model draw below and in tests/test_ops_pallas.py.
    from test_pallas_kernels import _compare

    for epi, m, n, k, kw in F.forward_gemms(_pallas):
        _compare(epi, m, n, k, config=WS_TILE, seed=2, **kw)


@pytest.mark.parametrize("shape", OP_DRAWS, ids=[f"{s.op}-m{s.m}" for s in OP_DRAWS])
def test_op_draws_on_xla(shape):
    F.run_op(shape, "xla", seed=1)


@pytest.mark.parametrize("_pallas", MODEL_DRAWS, ids=[f"model-{s.batch}x{s.seq}" for s in MODEL_DRAWS], indirect=True)
def test_model_draw_on_pallas(_pallas):
    F.run_model(_pallas, "pallas")


@pytest.mark.parametrize("shape", FP8_MODEL_DRAWS, ids=[f"model-{s.batch}x{s.seq}" for s in FP8_MODEL_DRAWS])
def test_fp8_model_draw_on_pallas(shape):
    # Every FP8 GEMM and quantizing pass on the kernels in the interpreter (however small its
    # output), against the xla backend's FP8 step.
    import coda_jax as cj

    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    @contextlib.contextmanager
    def on_the_kernels():
        try:
            with interpret_mode(), cj.options(routing=dict(xla_output_below=0)):
                yield
        finally:
            reset_gpu_interpret_mode_state()

    assert shape.m % 64 and shape.batch == 1
    F.run_model_fp8(shape, "pallas", seed=3, context=on_the_kernels)
