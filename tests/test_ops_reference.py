"""Every op's forward and custom gradient on the reference ("xla") backend vs the naive model.

Shapes include token counts and widths that are not multiples of 128.
"""

import importlib

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coda_jax as cj
import op_cases as C

DTYPES = [jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,f,next_norm", [(128, 96, 128, True), (77, 72, 64, False)])
def test_swiglu_mlp(m, d, f, next_norm, dtype):
    C.case_swiglu_mlp("xla", m, d, f, dtype, next_norm=next_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,n", [(128, 256, 384), (77, 200, 130), (1, 64, 8)])
def test_rms_norm_matmul(m, d, n, dtype):
    C.case_rms_norm_matmul("xla", m, d, n, dtype)


@pytest.mark.parametrize("n", [384, 130])
def test_rms_norm_matmul_backward_on_either_side(monkeypatch, n):
    """The op's cotangent is its dz: with N > d (here d = 200) the norm backward runs on the
    [M, d] side (dgrad epilogue's row sums, then one [M, d] pass), otherwise on the [M, N]
    side (dz row-scaled); both with the residual gradient of ``return_residual``."""
    calls = C.spy_unscaled_backward(monkeypatch)
    C.case_residual_chain("xla", 77, 96, 200, n, jnp.float32)
    assert bool(calls) == (n > 200), calls


@pytest.mark.parametrize("n", [384, 130])
def test_xla_norm_backward_has_no_weight_sized_pass(monkeypatch, n):
    """On the ``xla`` backend (epilogues run as passes over whole arrays) the norm backward
    takes plain JAX's formulation: the wgrad is a plain GEMM of ``x_hat * gamma`` and
    ``d_gamma`` is reduced beside ``dx``, so no ``norm_wgrad`` program (``dW = gamma * P``,
    ``d_gamma = sum_N(W * P)``: two passes over ``[d, N]`` arrays) is traced, on either side
    of the norm backward. A kernel lowering keeps the fused ``norm_wgrad`` epilogue."""
    from coda_jax.lowering import fuses_epilogues
    from coda_jax.partitioning import PartitionedLowering
    from coda_jax.reference import ReferenceLowering, xla_backend_lowering

    names, real = [], ReferenceLowering.gemm

    def spy(self, epilogue, *args, **kwargs):
        names.append(epilogue.name)
        return real(self, epilogue, *args, **kwargs)

    monkeypatch.setattr(ReferenceLowering, "gemm", spy)
    C.case_residual_chain("xla", 77, 96, 200, n, jnp.float32)
    assert "norm_wgrad" not in names and "identity" in names, names
    assert ("norm_dgrad" in names) == (n > 200), names  # the [M, d] side where N > d
    assert not fuses_epilogues(xla_backend_lowering())
    assert not fuses_epilogues(PartitionedLowering(xla_backend_lowering()))

    class Kernel:
        name = "kernel"

    assert fuses_epilogues(PartitionedLowering(Kernel()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,d,f", [(128, 256, 128), (93, 160, 192)])
def test_swiglu(m, d, f, dtype):
    C.case_swiglu("xla", m, d, f, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("m,d,h,kv,hd", [(96, 128, 4, 2, 32), (50, 200, 4, 1, 64)])
def test_rope(m, d, h, kv, hd, qk_norm, dtype):
    C.case_rope("xla", m, d, h, kv, hd, dtype, qk_norm=qk_norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,d,n", [(128, 128, 256, 128), (70, 96, 136, 50)])
def test_residual_chain(m, k, d, n, dtype):
    C.case_residual_chain("xla", m, k, d, n, dtype)


@pytest.mark.parametrize("save_logits", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(reduction, dtype, save_logits):
    C.case_cross_entropy("xla", 100, 96, 1000, dtype, reduction=reduction, z_loss=1e-3, save_logits=save_logits)


def test_cross_entropy_bf16_saved_logits():
    """Saved bf16 logits: the gradient carries their rounding, within the bf16 tolerance."""
    C.case_cross_entropy("xla", 100, 96, 1000, jnp.bfloat16, z_loss=1e-3, save_logits=True,
                         logits_dtype=jnp.bfloat16)


def test_save_logits_choice():
    """save_logits=None: the option cross_entropy.save_logits, whose "auto" is the memory budget."""
    import coda_jax as cj

    lce = importlib.import_module("coda_jax.ops.linear_cross_entropy")
    with cj.options(cross_entropy=cj.CrossEntropyOptions(logits_budget_mb=1)):  # 1 MiB: 1024 x 256 float32 fits
        assert lce.resolve_save_logits(None, 1024, 256, jnp.float32)
        assert not lce.resolve_save_logits(None, 1025, 256, jnp.float32)
        assert lce.resolve_save_logits(None, 2048, 256, jnp.bfloat16)
        assert lce.resolve_save_logits(True, 10 ** 6, 10 ** 6, jnp.float32)
        with cj.options(cross_entropy={"save_logits": False}):
            assert not lce.resolve_save_logits(None, 8, 8, jnp.float32)
            assert lce.resolve_save_logits(True, 8, 8, jnp.float32)  # the argument wins
    with pytest.raises(cj.OptionError, match="cross_entropy.save_logits must be one of: True/False, 'auto'; got 'yes'"):
        cj.options(cross_entropy={"save_logits": "yes"}).__enter__()
    with pytest.raises(cj.OptionError, match="cross_entropy.logits_budget_mb must be one of: a number >= 0"):
        cj.set_options(cross_entropy={"logits_budget_mb": "lots"})
    with pytest.raises(ValueError, match="logits_dtype must be float32 or bfloat16"):
        C.case_cross_entropy("xla", 8, 16, 32, jnp.float32, logits_dtype=jnp.float16)


@settings(max_examples=4, deadline=None)
@given(m=st.integers(1, 130), f=st.integers(1, 3).map(lambda v: 64 * v), seed=st.integers(0, 2 ** 16))
def test_swiglu_random_shapes(m, f, seed):
    C.case_swiglu("xla", m, 72, f, jnp.float32, seed=seed)


def test_cross_entropy_logits_dtype_from_the_options():
    """``logits_dtype=None`` reads the option ``cross_entropy.logits_dtype``; a bad value names it."""
    import coda_jax as cj
    from coda_jax.ops.linear_cross_entropy import resolve_logits_dtype

    assert resolve_logits_dtype(None) == jnp.float32
    with cj.options(cross_entropy=cj.CrossEntropyOptions(logits_dtype="bfloat16")):
        assert resolve_logits_dtype(None) == jnp.bfloat16
        assert resolve_logits_dtype(jnp.float32) == jnp.float32  # the argument wins
    with pytest.raises(cj.OptionError, match=r"cross_entropy.logits_dtype must be one of: 'float32', 'bfloat16'"):
        cj.set_options(cross_entropy={"logits_dtype": "float16"})


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_plain_gemm_writes_the_dtype_asked_for(out_dtype):
    """A plain GEMM (the identity epilogue, what the kernel backends hand to XLA) asked for a
    bfloat16 product of bfloat16 operands writes it from the dot itself: a wgrad over split
    tokens is then all-reduced in bfloat16, as plain JAX's is (float32 moved twice the bytes
    on two H100s, run 143). A float32 product stays float32. Values: f32 accumulation, one
    rounding."""
    from coda_jax import programs
    from coda_jax.reference import REFERENCE

    k1, k2 = jax.random.split(jax.random.key(3))
    a = jax.random.normal(k1, (192, 96)).astype(jnp.bfloat16)  # [K, M]: the wgrad layout
    b = jax.random.normal(k2, (192, 80)).astype(jnp.bfloat16)

    def f(a, b):
        return REFERENCE.gemm(programs.IDENTITY, a, b, {}, transpose_a=True, out_dtypes={"out": out_dtype})["out"]

    dots = [e for e in jax.make_jaxpr(f)(a, b).jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [jnp.dtype(e.params["preferred_element_type"]) for e in dots] == [jnp.dtype(out_dtype)]
    got = f(a, b)
    want = jnp.dot(a.astype(jnp.float32).T, b.astype(jnp.float32), precision="highest")
    assert got.dtype == out_dtype and C.rel_err(got, want) < 1e-2


def test_float32_gemms_at_full_precision_unless_the_caller_chose_one():
    # The reference's float32 GEMMs run at HIGHEST; under jax.default_matmul_precision (a
    # float32 model trained at TF32 on a GPU) they take the caller's precision, as jnp.dot does.
    from jax import lax

    from coda_jax import programs
    from coda_jax.reference import REFERENCE

    a = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (32, 48), jnp.float32)

    def precisions():
        f = lambda a, b: REFERENCE.gemm(programs.IDENTITY, a, b, {})["out"]  # noqa: E731
        return [e.params["precision"] for e in jax.make_jaxpr(f)(a, b).jaxpr.eqns if e.primitive.name == "dot_general"]

    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    assert precisions() == [highest]
    with jax.default_matmul_precision("tensorfloat32"):
        want = [e.params["precision"] for e in jax.make_jaxpr(jnp.dot)(a, b).jaxpr.eqns]
        assert precisions() == want and want != [highest], want  # what jnp.dot takes there (TF32)


def test_plain_gemm_helpers_match_jax():
    # coda_jax.ops.plain_gemm: the backward passes' plain GEMMs, in the dtypes they promise.
    from coda_jax.ops.plain_gemm import linear_grads, matmul, wgrad
    from coda_jax.reference import REFERENCE

    k = jax.random.split(jax.random.key(7), 3)
    y = jax.random.normal(k[0], (77, 40), jnp.bfloat16)
    w = jax.random.normal(k[1], (40, 24), jnp.float32)
    dx = jax.random.normal(k[2], (77, 24), jnp.float32)
    wb = w.astype(jnp.bfloat16)
    _, vjp = jax.vjp(lambda y, w: jnp.dot(y.astype(jnp.float32), w.astype(jnp.float32)), y, wb)
    dy_ref, dw_ref = vjp(dx.astype(jnp.bfloat16).astype(jnp.float32))
    dy, dw = linear_grads(REFERENCE, y, wb, dx)
    assert dy.shape == y.shape and dy.dtype == y.dtype and dw.shape == wb.shape and dw.dtype == wb.dtype
    assert float(jnp.linalg.norm(dy - dy_ref) / jnp.linalg.norm(dy_ref)) < 1e-2
    assert float(jnp.linalg.norm(dw - dw_ref) / jnp.linalg.norm(dw_ref)) < 1e-2
    assert wgrad(REFERENCE, y, dx.astype(jnp.bfloat16), w).dtype == jnp.float32  # w's dtype
    out = matmul(REFERENCE, dx.astype(jnp.bfloat16), wb, transpose_b=True, out_dtype=jnp.float32)
    assert out.dtype == jnp.float32 and out.shape == (77, 40)
    assert float(jnp.linalg.norm(out - dy_ref) / jnp.linalg.norm(dy_ref)) < 1e-2


def _pass_programs():
    from coda_jax import programs

    return [programs.rope_grad_q8(32), programs.CE_GRAD_Q8, programs.quantize_q8("e4m3"),
            programs.quantize_q8("e5m2"), programs.RMS_INPUT_Q8]


def _outputs_for_two_products(epi, m=64, n=128, k=64):
    """``epi`` on the reference backend with the same random loads and two different random
    GEMMs under it."""
    from coda_jax.reference import REFERENCE

    keys = jax.random.split(jax.random.key(3), 2 + len(epi.loads))
    loads = {}
    for kk, (name, sds) in zip(keys[2:], C.abstract_loads(epi, m, n).items()):
        loads[name] = (jax.random.randint(kk, sds.shape, 0, n, sds.dtype) if jnp.issubdtype(sds.dtype, jnp.integer)
                       else jax.random.uniform(kk, sds.shape, jnp.float32, 0.5, 1.5).astype(sds.dtype))
    outs = []
    for kk in keys[:2]:
        ka, kb = jax.random.split(kk)
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = jax.random.normal(kb, (n, k), jnp.bfloat16)
        outs.append(REFERENCE.gemm(epi, a, b, loads, transpose_b=True))
    return outs


@pytest.mark.parametrize("epi", _pass_programs(), ids=lambda e: e.name)
def test_epilogue_passes_declare_that_they_ignore_the_accumulator(epi):
    # Epilogue.reads_acc=False lets a kernel skip the GEMM under the pass (TuningConfig.
    # skip_pass_gemm): every output must be the same whatever the product is.
    assert not epi.reads_acc
    one, two = _outputs_for_two_products(epi)
    assert set(one) == set(two) == set(epi.result_names())
    for name in one:
        assert bool(jnp.array_equal(one[name], two[name], equal_nan=True)), name


def test_an_epilogue_that_reads_the_accumulator_says_so():
    # The check above can fail: a program that reads acc changes with the product.
    from coda_jax import programs

    assert programs.RESIDUAL_RMS_Q8.reads_acc
    one, two = _outputs_for_two_products(programs.RESIDUAL_RMS_Q8)
    assert not bool(jnp.array_equal(one["x"], two["x"]))
