"""coda_jax's typed options: precedence, merging, the environment, the parser and its errors."""

import jax
import jax.numpy as jnp
import pytest

import coda_jax as cj
from coda_jax.options import DEFAULTS, ENVIRONMENT, is_set


def test_defaults_are_every_field_resolved(monkeypatch):
    monkeypatch.delenv("CODA_JAX_KERNEL_CACHE_DIR", raising=False)  # (the suite turns the cache off)
    cj.reset_options()
    got = cj.current_options()
    assert got == DEFAULTS
    for group in ("routing", "cross_entropy", "mesh", "xla", "kernel_cache", "pallas"):
        assert None not in vars(getattr(got, group)).values(), group


def test_precedence_context_over_process_over_environment(monkeypatch):
    cj.reset_options()
    monkeypatch.setenv("CODA_JAX_BACKEND", "xla")
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_WORKERS", "3")
    assert cj.current_options().backend == "xla" and cj.current_options().kernel_cache.workers == 3
    assert is_set("backend") and not is_set("mesh.fsdp_split")
    cj.set_options(backend="pallas", kernel_cache=cj.KernelCacheOptions(directory="/tmp/k"))
    got = cj.current_options()
    assert got.backend == "pallas" and got.kernel_cache.workers == 3 and got.kernel_cache.directory == "/tmp/k"
    with cj.options(backend="cutedsl", mesh={"partial_sums": "float32"}) as inner:
        assert inner.backend == "cutedsl" and inner.mesh.partial_sums == "float32"
        with cj.options(mesh=cj.MeshOptions(fsdp_split="features")) as innermost:  # merged field by field
            assert innermost.mesh.partial_sums == "float32" and innermost.mesh.fsdp_split == "features"
            assert innermost.mesh.fsdp_xla_gemms_below == DEFAULTS.mesh.fsdp_xla_gemms_below
        assert cj.current_options().mesh.fsdp_split == "width"
    assert cj.current_options().backend == "pallas"
    cj.reset_options("backend")
    assert cj.current_options().backend == "xla"  # the environment again
    cj.reset_options()
    monkeypatch.delenv("CODA_JAX_BACKEND")
    assert cj.current_options().backend == "auto"


def test_set_options_merges_and_reset_clears_named_fields():
    cj.reset_options()
    cj.set_options(routing=cj.RoutingOptions(xla_output_below=7))
    cj.set_options(routing={"plain_gemm": "kernel"})
    assert cj.current_options().routing.xla_output_below == 7 and cj.current_options().routing.plain_gemm == "kernel"
    cj.reset_options("routing.plain_gemm")
    assert cj.current_options().routing == cj.RoutingOptions("xla", 7, {})
    cj.reset_options("routing")
    assert cj.current_options().routing == DEFAULTS.routing
    with pytest.raises(cj.OptionError, match="unknown coda_jax option 'routing.nope'"):
        cj.reset_options("routing.nope")


def test_the_backend_shorthands_are_the_backend_option():
    cj.reset_options()
    cj.set_backend("xla", allow_fallback=True)
    assert cj.current_options().backend == "xla" and cj.current_options().allow_fallback is True
    with cj.use_backend("pallas"):
        assert cj.current_options().backend == "pallas" and cj.current_options().allow_fallback is True
    cj.set_backend(None)
    assert cj.current_options().backend == "auto" and cj.current_options().allow_fallback is False


@pytest.mark.parametrize("text,expected", [
    ("backend=PALLAS", {"backend": "pallas"}),
    ("allow_fallback=yes", {"allow_fallback": True}),
    ("routing.xla_output_below=0", {"routing": cj.RoutingOptions(xla_output_below=0)}),
    ("routing.xla_programs=rms_rope+rms_dgrad_res<64", {"routing": cj.RoutingOptions(
        xla_programs={"rms_rope": None, "rms_dgrad_res": 64.0})}),
    ("cross_entropy.save_logits=false,cross_entropy.logits_budget_mb=512",
     {"cross_entropy": cj.CrossEntropyOptions(save_logits=False, logits_budget_mb=512.0)}),
    ("cross_entropy.save_logits=auto", {"cross_entropy": cj.CrossEntropyOptions(save_logits="auto")}),
    ("kernel_cache.workers=auto,kernel_cache.directory=off",
     {"kernel_cache": cj.KernelCacheOptions(directory="off", workers="auto")}),
    ("pallas.tuned_tables=none", {"pallas": cj.PallasOptions(tuned_tables="none")}),
    ("pallas.tuned_tables=/a.json", {"pallas": cj.PallasOptions(tuned_tables=("/a.json",))}),
])
def test_parse_overrides(text, expected):
    assert cj.parse_overrides(text) == expected
    with cj.options(**expected):  # and a parsed value is one options() takes
        pass


@pytest.mark.parametrize("text,match", [
    ("routing.xla_output_below=-1", r"routing.xla_output_below must be one of: an integer >= 0; got '-1'"),
    ("mesh.fsdp_split=rows", r"mesh.fsdp_split must be one of: 'width', 'features'; got 'rows'"),
    ("xla.accumulate=f64", r"xla.accumulate must be one of: 'operand', 'float32'"),
    ("mesh.nope=1", r"unknown coda_jax option 'mesh.nope'"),
    ("routing=1", r"unknown coda_jax option 'routing'"),
    ("backend", r"'backend' must be 'option=value'"),
])
def test_parse_errors_name_the_option_and_its_rule(text, match):
    with pytest.raises(cj.OptionError, match=f"--runs: .*{match}"):
        cj.parse_overrides(text, source="--runs")


def test_python_values_are_checked_when_given():
    for bad, match in ((dict(backend="gpu"), "backend must be one of"),
                       (dict(mesh={"fsdp_xla_tokens_below": -5}), "mesh.fsdp_xla_tokens_below"),
                       (dict(mesh={"fsdp_xla_tokens_below": True}), "mesh.fsdp_xla_tokens_below"),
                       (dict(routing={"xla_programs": {"x": 0}}), "routing.xla_programs"),
                       (dict(cross_entropy=cj.MeshOptions()), "must be a coda_jax.CrossEntropyOptions"),
                       (dict(mesh={"fsdp_spilt": "width"}), "has no field 'fsdp_spilt'"),
                       (dict(fsdp_split="width"), "unknown coda_jax option 'fsdp_split'")):
        with pytest.raises(cj.OptionError, match=match):
            cj.options(**bad)
        with pytest.raises(cj.OptionError, match=match):
            cj.set_options(**bad)


def test_a_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_WORKERS", "lots")
    with pytest.raises(cj.OptionError, match=r"\$CODA_JAX_KERNEL_CACHE_WORKERS='lots': .*kernel_cache.workers"):
        cj.current_options()


def test_only_five_environment_variables_remain():
    from coda_jax.options import INTERPRET_ENV

    assert sorted([*ENVIRONMENT, INTERPRET_ENV]) == ["CODA_JAX_ALLOW_FALLBACK", "CODA_JAX_BACKEND",
                                                    "CODA_JAX_KERNEL_CACHE_DIR", "CODA_JAX_KERNEL_CACHE_WORKERS",
                                                    "CODA_JAX_PALLAS_INTERPRET"]


def test_options_are_read_when_an_op_is_traced():
    """A GEMM traced inside the block sees the block's options: here the xla backend's GEMM
    output, rounded to bf16 or kept in float32 (xla.accumulate)."""
    from coda_jax import programs
    from coda_jax.reference import REFERENCE, xla_backend_lowering

    ks = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(ks[0], (64, 96), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (96, 128)) / 10).astype(jnp.bfloat16)

    def run():
        return jax.jit(lambda x, w: xla_backend_lowering().gemm(programs.IDENTITY, x, w, {},
                                                               out_dtypes={"out": jnp.float32})["out"])(x, w)

    with cj.options(xla=cj.XlaOptions(accumulate="float32")):
        assert xla_backend_lowering() is REFERENCE
        exact = run()
    assert xla_backend_lowering() is not REFERENCE
    rounded = run()
    assert float(jnp.max(jnp.abs(exact - rounded))) > 0  # bf16 rounding of the GEMM output shows
    assert float(jnp.max(jnp.abs(rounded - exact.astype(jnp.bfloat16).astype(jnp.float32)))) == 0.0
