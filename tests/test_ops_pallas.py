"""Every op's forward and custom backward on the Pallas backend (GPU interpret mode), bf16,
against jax.grad of the naive unfused definition."""

import jax
import jax.numpy as jnp
import pytest

from coda_jax import log as coda_log
import coda_jax as cj
import op_cases as C
from coda_jax.pallas import interpret_mode


@pytest.fixture(autouse=True)
def _interpret():
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    with interpret_mode():
        yield
    reset_gpu_interpret_mode_state()


BF = jnp.bfloat16


def test_rms_norm_matmul():
    C.case_rms_norm_matmul("pallas", 96, 128, 192, BF)


def test_swiglu():
    C.case_swiglu("pallas", 64, 128, 128, BF)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope(qk_norm):
    C.case_rope("pallas", 64, 128, 2, 1, 128, BF, qk_norm=qk_norm)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_split_qkv(qk_norm):
    # Q, K, V written as three arrays by the kernel (head boundaries: multiples of the chunk width).
    C.case_rope("pallas", 64, 128, 2, 1, 64, BF, qk_norm=qk_norm, split_qkv=True)


def test_swiglu_mlp():
    C.case_swiglu_mlp("pallas", 64, 128, 128, BF)


def test_residual_chain():
    C.case_residual_chain("pallas", 64, 128, 128, 128, BF)


def test_residual_chain_wide_norm_gemm_backward_on_the_narrow_side(monkeypatch):
    """N = 256 > d = 128: the rms_norm_matmul backward takes the norm_dgrad kernel (g and the
    row partials of sum(x * gamma * g)) and the wgrad of x_hat, with the residual gradient."""
    calls = C.spy_unscaled_backward(monkeypatch)
    C.case_residual_chain("pallas", 64, 128, 128, 256, BF)
    assert calls == [(64, 128)], calls


@pytest.mark.parametrize("save_logits", [False, True])
def test_cross_entropy(save_logits):
    C.case_cross_entropy("pallas", 64, 128, 300, BF, z_loss=1e-3, save_logits=save_logits)


def test_cross_entropy_vocab_leaving_a_tile_of_padding(monkeypatch):
    # The warp-specialized [64, 256] CTA tile on V = 257 (padded to 512): the LSE partial of
    # the all-padding consumer tile was NaN, and with it the loss and every gradient.
    import dataclasses

    from coda_jax.pallas import lowering
    from coda_jax.pallas.tuning import TuningConfig

    cfg = TuningConfig(tile_m=64, tile_n=128, max_concurrent_steps=2, warp_specialized=True, wg_dimension="n")
    monkeypatch.setattr(lowering, "choose_config", lambda m, n, k, program=None: dataclasses.replace(cfg))
    C.case_cross_entropy("pallas", 100, 64, 257, BF)


def test_float32_is_refused_with_a_pointer_to_xla():
    with pytest.raises(TypeError, match="backend='xla'"):
        C.case_rms_norm_matmul("pallas", 64, 64, 64, jnp.float32)


def test_block_on_pallas_matches_xla_backend():
    import jax
    from flax import nnx

    from coda_jax.layers import CodaLlamaBlock, LlamaConfig
    from op_cases import rel_err

    cfg = LlamaConfig.tiny(hidden_size=128, intermediate_size=128, num_heads=2, num_kv_heads=1, head_dim=64,
                           num_layers=1, dtype=BF, attention_implementation=None)
    x = jax.random.normal(jax.random.key(0), (2, 32, 128)).astype(BF)
    outs, grads = {}, {}
    for b in ("xla", "pallas"):
        blk = CodaLlamaBlock(cfg, rngs=nnx.Rngs(0), backend=b)
        outs[b] = blk(x, next_norm=jnp.ones((128,)))[0]
        grads[b] = nnx.grad(lambda m, x: jnp.sum(m(x)[0].astype(jnp.float32) ** 2), argnums=(0, 1))(blk, x)
    assert rel_err(outs["pallas"], outs["xla"]) < 1e-2
    assert rel_err(grads["pallas"][1], grads["xla"][1]) < 2e-2
    assert rel_err(grads["pallas"][0].w_gu[...], grads["xla"][0].w_gu[...]) < 2e-2


def _remat_vmap_case(backend, check_remat=True):
    """jax.checkpoint of a fused op gives the same gradients; jax.vmap over a leading axis
    (e.g. micro-batches) matches a Python loop, forward and gradient."""
    import jax

    import coda_jax as cj
    from op_cases import rel_err

    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (2, 64, 128)).astype(BF)
    g = (1.0 + 0.1 * jax.random.normal(ks[1], (128,))).astype(BF)
    w = (jax.random.normal(ks[2], (128, 256)) * 128 ** -0.5).astype(BF)

    def loss(x, g, w):
        return jnp.sum(cj.rms_norm_matmul_swiglu(x, g, w, backend=backend).astype(jnp.float32) ** 2)

    if check_remat:
        plain = jax.grad(loss, argnums=(0, 1, 2))(x[0], g, w)
        remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(x[0], g, w)
        for a, b in zip(plain, remat):
            assert rel_err(a, b) < 1e-6
    # vmap runs the op on the flattened batch (M = 128, not 64): XLA and cuBLAS may pick other
    # float32 accumulation orders for the other shape, so the promise is one bfloat16
    # rounding step per element, not bitwise equality (the GPU showed rel err 4.3e-6).
    fwd = jax.vmap(lambda x: cj.rms_norm_matmul_swiglu(x, g, w, backend=backend))(x)
    for i in range(2):
        assert_within_one_rounding_step(fwd[i], cj.rms_norm_matmul_swiglu(x[i], g, w, backend=backend))
    dx = jax.vmap(jax.grad(loss), in_axes=(0, None, None))(x, g, w)
    for i in range(2):
        assert_within_one_rounding_step(dx[i], jax.grad(loss)(x[i], g, w))


def assert_within_one_rounding_step(got, want):
    """Every element of ``got`` equals ``want``'s or is its neighbour in ``want``'s dtype
    (one rounding step of a float32 value that differs in its last bits)."""
    import numpy as np

    assert got.dtype == want.dtype and got.shape == want.shape
    mant = jnp.finfo(want.dtype).nmant  # bfloat16: 7 stored bits; a step is <= 2^-7 * |x|
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(g).all() and np.isfinite(w).all()
    step = np.maximum(np.abs(g), np.abs(w)) * 2.0 ** -mant
    bad = np.abs(g - w) > step
    assert not bad.any(), f"{bad.sum()} of {bad.size} elements differ by more than one rounding step"


def test_gradients_under_remat_and_vmap_xla():
    _remat_vmap_case("xla")


def test_block_remat_is_not_applied_in_the_interpreter(caplog):
    """``LlamaConfig(remat="block")`` with the Pallas kernels in the GPU interpreter: the
    interpreter's IO callbacks are effects ``jax.checkpoint`` refuses, so the blocks run
    without remat and a warning says so (tests/test_gpu_pallas.py checks remat on the
    compiled kernels; tests/test_layers.py on the xla backend)."""
    import logging

    import jax
    from flax import nnx

    from coda_jax.layers import CodaLlama, LlamaConfig

    cfg = LlamaConfig.tiny(vocab_size=256, hidden_size=128, intermediate_size=128, num_heads=2, num_kv_heads=1,
                           head_dim=64, num_layers=1, dtype=BF, attention_implementation=None, remat="block")
    graphdef, state = nnx.split(CodaLlama(cfg, rngs=nnx.Rngs(0), backend="pallas"))
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
    with caplog.at_level(logging.WARNING, logger="coda_jax"):
        jaxpr = jax.make_jaxpr(jax.grad(lambda st: nnx.merge(graphdef, st).loss(tokens[:, :-1], tokens[:, 1:])))(state)
    assert "remat" not in str(jaxpr)
    assert "remat_interpret" in coda_log._logged  # logged once per process (this test or an earlier one)


def test_vmap_pallas():
    # remat is not checked here: the GPU interpreter's IO callbacks are effects that
    # jax.checkpoint refuses; tests/test_gpu_pallas.py checks remat on the compiled kernels.
    _remat_vmap_case("pallas", check_remat=False)


def test_a_pallas_op_and_its_gradient_under_disable_jit():
    """Under jax.disable_jit() the fused op runs op by op, but each kernel still runs as one
    kernel (Mosaic GPU's pipeline cannot be traced op by op; it crashed in Pallas before)."""
    ks = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(ks[0], (128, 128)).astype(BF)
    g = (1 + 0.1 * jax.random.normal(ks[1], (128,))).astype(BF)
    w = (jax.random.normal(ks[2], (128, 256)) * 128 ** -0.5).astype(BF)

    def loss(x, g, w):
        return jnp.sum(cj.rms_norm_matmul(x, g, w, backend="pallas").astype(jnp.float32) ** 2)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, g, w)
    with jax.disable_jit():
        got = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, g, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) < 2e-2


@pytest.mark.parametrize("head_dim", [256, 96])
def test_rope_head_dims_the_kernel_cannot_pair_are_refused_up_front(head_dim):
    with pytest.raises(ValueError, match=f"head_dim={head_dim} is not supported by backend 'pallas'.*128-column tile"):
        C.case_rope("pallas", 16, 64, 1, 1, head_dim, BF)


def test_pair_width_rules_of_the_kernel_backends():
    from coda_jax.ffi.lowering import CuteDslLowering
    from coda_jax.pallas.lowering import PallasLowering
    from coda_jax.pallas.tuning import TuningConfig

    assert PallasLowering().pair_width_rule(128) is None and PallasLowering().pair_width_rule(64) is None
    assert "128-column tile" in PallasLowering().pair_width_rule(256)
    assert PallasLowering(TuningConfig(tile_n=256)).pair_width_rule(256) is None
    assert CuteDslLowering().pair_width_rule(256) is None and CuteDslLowering().pair_width_rule(96) is None
    assert "multiple of 8 and at most 256" in CuteDslLowering().pair_width_rule(512)


def test_pair_width_rule_is_found_through_a_wrapping_lowering():
    from types import SimpleNamespace

    from coda_jax.lowering import pair_width_rule
    from coda_jax.pallas.lowering import PallasLowering
    from coda_jax.reference import REFERENCE

    wrapped = SimpleNamespace(name="pallas", inner=PallasLowering())  # e.g. a partitioned lowering
    assert "128-column tile" in pair_width_rule(wrapped, 256) and pair_width_rule(wrapped, 128) is None
    assert pair_width_rule(REFERENCE, 256) is None
