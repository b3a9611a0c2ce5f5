"""Backend resolution order, availability errors, the registry and the reference fallback."""

import logging

import jax
import jax.numpy as jnp
import pytest

from coda_jax import log as coda_log
import coda_jax as cj
from coda_jax import backend as B
from coda_jax.reference import REFERENCE


def test_unknown_backend_names_the_choices():
    with pytest.raises(cj.UnknownBackendError, match="choose one of xla, pallas, cutedsl, auto"):
        cj.resolve_backend("tpu")
    with pytest.raises(cj.UnknownBackendError):
        cj.set_backend("cuda")
    with pytest.raises(cj.UnknownBackendError):
        with cj.use_backend("triton"):
            pass


def test_unknown_env_backend(monkeypatch):
    monkeypatch.setenv("CODA_JAX_BACKEND", "bogus")
    with pytest.raises(cj.UnknownBackendError, match="CODA_JAX_BACKEND='bogus'"):
        cj.resolve_backend()


def test_auto_on_cpu_picks_xla_and_logs_why(caplog):
    coda_log.forget_logged()
    with caplog.at_level(logging.INFO, logger="coda_jax"):
        assert cj.resolve_backend() == "xla"
        assert cj.resolve_backend("auto") == "xla"
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "picked 'xla' because the default JAX device is cpu" in msgs[0]


def _pretend_available(monkeypatch, names):
    real = B.backend_unavailable_reason
    monkeypatch.setattr(B, "backend_unavailable_reason", lambda n: None if n in names else real(n))


def test_resolution_order(monkeypatch):
    _pretend_available(monkeypatch, {"pallas", "cutedsl"})
    monkeypatch.setenv("CODA_JAX_BACKEND", "cutedsl")
    assert cj.resolve_backend() == "cutedsl"  # env
    cj.set_backend("pallas")
    assert cj.resolve_backend() == "pallas"  # process setter beats env
    with cj.use_backend("xla"):
        assert cj.resolve_backend() == "xla"  # context beats setter
        with cj.use_backend("cutedsl"):
            assert cj.resolve_backend() == "cutedsl"  # innermost context
        assert cj.resolve_backend("pallas") == "pallas"  # explicit argument beats all
    assert cj.resolve_backend() == "pallas"
    cj.set_backend(None)
    assert cj.resolve_backend() == "cutedsl"


def test_pallas_without_gpu_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("CODA_JAX_PALLAS_INTERPRET", raising=False)
    with pytest.raises(cj.BackendUnavailableError) as e:
        cj.resolve_backend("pallas")
    msg = str(e.value)
    assert "Hopper" in msg and "cpu" in msg and "coda-jax[cuda]" in msg and "backend='xla'" in msg
    assert "CODA_JAX_PALLAS_INTERPRET=1" in msg


def test_pallas_interpret_mode_makes_it_available(monkeypatch):
    monkeypatch.setenv("CODA_JAX_PALLAS_INTERPRET", "1")
    assert cj.resolve_backend("pallas") == "pallas"


def test_cutedsl_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "cutlass" else real(n, *a))
    with pytest.raises(cj.BackendUnavailableError, match=r"pip install 'coda-jax\[cutedsl\]'"):
        cj.resolve_backend("cutedsl")


def test_cutedsl_without_gpu(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "cutlass" else real(n, *a))
    with pytest.raises(cj.BackendUnavailableError, match="needs an NVIDIA Hopper GPU"):
        cj.resolve_backend("cutedsl")


class _Partial:
    """A fake backend lowering that implements only rms_norm_matmul (by delegation)."""

    name = "fake"
    calls = 0

    def gemm(self, *a, **k):
        _Partial.calls += 1
        return REFERENCE.gemm(*a, **k)


@pytest.fixture
def partial_pallas(monkeypatch):
    _pretend_available(monkeypatch, {"pallas"})
    monkeypatch.setitem(B._lowerings, "pallas", _Partial)
    monkeypatch.setitem(B._ops, "pallas", {"rms_norm_matmul"})
    coda_log.forget_logged()
    _Partial.calls = 0


def _inputs():
    k = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k[0], (8, 64)), jnp.ones((64,)), jax.random.normal(k[1], (64, 128)))


def test_registered_op_runs_on_the_backend(partial_pallas):
    x, g, w = _inputs()
    cj.rms_norm_matmul(x, g, w, backend="pallas")
    assert _Partial.calls == 1


def test_missing_op_errors_without_fallback(partial_pallas):
    x, g, w = _inputs()
    with pytest.raises(cj.BackendOpMissingError, match="'rms_norm_matmul_swiglu' is not implemented by backend 'pallas'"):
        cj.rms_norm_matmul_swiglu(x, g, w, backend="pallas")


@pytest.mark.parametrize("how", ["context", "setter", "env"])
def test_missing_op_falls_back_when_allowed_and_says_so(partial_pallas, monkeypatch, caplog, how):
    x, g, w = _inputs()
    with caplog.at_level(logging.WARNING, logger="coda_jax"):
        if how == "context":
            with cj.use_backend("pallas", allow_fallback=True):
                y = cj.rms_norm_matmul_swiglu(x, g, w)
        elif how == "setter":
            cj.set_backend("pallas", allow_fallback=True)
            y = cj.rms_norm_matmul_swiglu(x, g, w)
        else:
            monkeypatch.setenv("CODA_JAX_ALLOW_FALLBACK", "1")
            y = cj.rms_norm_matmul_swiglu(x, g, w, backend="pallas")
    assert y.shape == (8, 64) and _Partial.calls == 0
    assert any("falling back to 'xla'" in r.getMessage() for r in caplog.records)


def test_every_op_is_registered_on_xla():
    from coda_jax.ops.names import ALL_OPS

    assert B.registered_ops("xla") == frozenset(ALL_OPS)
