"""The CuTeDSL kernel cache (coda_jax/ffi/kernel_cache.py), on the CPU.

CuTeDSL compiles each kernel while JAX lowers its call (``CUTE_DSL_ARCH=sm_90a``, no GPU
needed), so lowering a gradient for CUDA fills the cache; a later process lowers the same
module from it without compiling.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass")
pytest.importorskip("cutlass.jax")

import coda_jax as cj  # noqa: E402
from coda_jax import backend as B  # noqa: E402
from coda_jax import epilogue as E  # noqa: E402
from coda_jax.ffi import interpret as I  # noqa: E402
from coda_jax.ffi import kernel_cache as KC  # noqa: E402
from coda_jax.ffi import lowering as L  # noqa: E402
from coda_jax.ffi.tuning import CuteDslTuning  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The lowering that both this process and the subprocess run: a fused op's gradient (its
# forward and backward kernels), on fresh random inputs.
PROGRAM = """
import hashlib, jax, jax.numpy as jnp, coda_jax as cj
def lowered():
    x, g, w = (jax.random.normal(jax.random.key(i), s, jnp.float32).astype(jnp.bfloat16)
               for i, s in enumerate([(128, 128), (128,), (128, 256)]))
    loss = lambda x, g, w: cj.rms_norm_matmul_swiglu(x, g, w, backend="cutedsl").astype(jnp.float32).sum()
    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return hashlib.sha256(f.trace(x, g, w).lower(lowering_platforms=("cuda",)).as_text().encode()).hexdigest()
"""
_ns: dict = {}
exec(PROGRAM, _ns)
lowered = _ns["lowered"]


@pytest.fixture(autouse=True)
def _cutedsl_without_gpu(monkeypatch):
    """Lets backend='cutedsl' resolve on a machine without a GPU (we only lower); each test
    starts with the lowering's in-memory kernels emptied."""
    real = B.backend_unavailable_reason
    monkeypatch.setattr(B, "backend_unavailable_reason", lambda n: None if n == "cutedsl" else real(n))
    L._build.cache_clear()


def _cache_in(directory):
    return cj.options(kernel_cache=cj.KernelCacheOptions(directory=str(directory)))


def test_a_later_process_lowers_the_same_module_from_the_cache(tmp_path):
    with _cache_in(tmp_path):
        digest = lowered()
        stats = KC.active_cache().stats
    entries = sorted((tmp_path / KC.SUBDIR).glob("*.cutedsl.bin"))
    assert stats.misses >= 2 and stats.writes == stats.misses == len(entries) and stats.hits == 0, stats
    probe = PROGRAM + f"""
from coda_jax import backend as B
from coda_jax.ffi import kernel_cache as KC
real = B.backend_unavailable_reason
B.backend_unavailable_reason = lambda n: None if n == "cutedsl" else real(n)
cj.set_options(routing=cj.RoutingOptions(xla_output_below=0))
from cutlass.jax import compile as C
def refuse(*a, **k):
    raise AssertionError("compiled a kernel that the cache holds")
C.cute.compile = refuse
print(lowered(), KC.active_cache().stats)
"""
    env = dict(os.environ, CODA_JAX_KERNEL_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = r.stdout.strip().splitlines()[-1]
    assert out.startswith(digest), (out, digest)  # the same StableHLO, kernels byte for byte
    assert f"hits={len(entries)}, misses=0, writes=0, bad_entries=0" in out, out


def test_without_the_cache_nothing_is_written_and_the_module_is_the_same(tmp_path):
    with _cache_in(tmp_path / "on"):
        cached = lowered()
    L._build.cache_clear()
    with _cache_in("off"):
        assert KC.active_cache() is None
        assert lowered() == cached
    assert [p.name for p in tmp_path.iterdir()] == ["on"]


def test_a_bad_entry_is_reported_and_compiled_again(tmp_path):
    with _cache_in(tmp_path):
        digest = lowered()
    entries = sorted((tmp_path / KC.SUBDIR).glob("*.cutedsl.bin"))
    entries[0].write_bytes(entries[0].read_bytes()[:-100])  # truncated
    entries[1].write_bytes(b"")  # empty
    entries[2].write_bytes(b"something else")
    L._build.cache_clear()
    with _cache_in(tmp_path / "elsewhere"):
        KC.active_cache()  # the next one is a fresh cache object: nothing in memory
    with _cache_in(tmp_path):
        with pytest.warns(RuntimeWarning, match="unreadable"):
            assert lowered() == digest
        stats = KC.active_cache().stats
    assert stats.bad_entries == 3 and stats.misses == 3 and stats.writes == 3, stats
    assert stats.hits == len(entries) - 3, stats
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten entries read back
        for e in entries[:3]:
            assert KC.CuteKernelCache(tmp_path / KC.SUBDIR)._read(e.name.removesuffix(".cutedsl.bin"))


def test_another_plan_is_another_entry(tmp_path):
    """The same op under another tuning (a shallower pipeline): new entries, none read."""
    with _cache_in(tmp_path):
        lowered()
        first = KC.active_cache().stats.writes
        L._build.cache_clear()
        with B.use_lowering(L.CuteDslLowering(CuteDslTuning(max_stages=2))):
            lowered()
        stats = KC.active_cache().stats
    assert stats.hits == 0 and stats.writes == 2 * first, stats


def test_the_body_key_follows_the_math_not_the_function():
    """Bodies that differ only in their math, or in a constant's value, get different keys; the
    same body traced twice (a later process names its function differently) the same key."""
    def body(c):
        return lambda acc, ctx, x: {"out": acc * x + c}

    decl = dict(loads=(E.Load("x", E.LoadKind.TILE),), outputs=(E.Output("out", E.OutputKind.TILE),))
    keys = [KC.body_key(I.trace_body(E.Epilogue("probe", body=body(c), **decl), (128, 128), {"x": jnp.float32}))
            for c in (1.0, 1.0, 2.0, jnp.arange(128.0), jnp.arange(128.0) + 1)]
    assert keys[0] == keys[1] and len(set(keys)) == 4, keys


def test_an_unwritable_directory_is_reported_once_and_the_kernels_compiled_here(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with _cache_in(blocker), pytest.warns(RuntimeWarning, match="cannot write") as caught:
        digest = lowered()
        stats = KC.active_cache().stats
    assert [str(w.message).count("cannot write") for w in caught] == [1], [str(w.message) for w in caught]
    assert stats.misses >= 2 and stats.writes == 0 and stats.hits == 0, stats
    L._build.cache_clear()
    with _cache_in(tmp_path / "ok"):
        assert lowered() == digest
