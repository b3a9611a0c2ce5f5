"""The Pallas kernel cache (coda_jax/pallas/kernel_cache.py), on the CPU.

The kernels lower for CUDA without a GPU (``lowering_platforms=("cuda",)``), so these
tests check what the cache promises: a process that finds a kernel on disk puts the same
Mosaic GPU custom call into the step as a process that generates it, byte for byte, and
skips the generation; keys change with what the kernel is; bad entries are regenerated;
interpret mode never touches it.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import coda_jax as cj
from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.pallas import kernel_cache as KC
from coda_jax.pallas.lowering import PallasLowering
from kernel_cache_probe import module_digests
from kernel_cache_probe import residual_rms_args as _residual_rms_args

ROOT = Path(__file__).resolve().parents[1]
BF = jnp.bfloat16


@pytest.fixture(autouse=True)
def _cache_off_after():
    yield
    KC.disable_kernel_cache()


def _probe(case: str, cache_dir=None, workers: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    env.pop("CODA_JAX_KERNEL_CACHE_DIR", None)
    env["CODA_JAX_KERNEL_CACHE_WORKERS"] = str(workers)
    args = [case] + ([str(cache_dir)] if cache_dir is not None else [])
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_cache_probe.py"), *args],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("workers", [0, 1], ids=["here", "in_a_worker"])
def test_a_cached_kernel_is_the_generated_kernel_byte_for_byte_in_a_new_process(tmp_path, workers):
    plain = _probe("one_kernel")
    first = _probe("one_kernel", tmp_path, workers=workers)
    second = _probe("one_kernel", tmp_path, workers=workers)
    assert plain["stats"] is None and plain["calls"] == 1 and len(plain["modules"]) == 1
    none = {"bad_entries": 0, "worker_failures": 0}
    assert first["stats"] == {"hits": 0, "misses": 1, "writes": 1, **none}
    assert second["stats"] == {"hits": 1, "misses": 0, "writes": 0, **none}
    assert plain["modules"] == first["modules"] == second["modules"]
    assert first["step"] == second["step"]
    assert plain["committed"] is first["committed"] is second["committed"] is False
    assert len(list(tmp_path.glob("*.kernel.pkl"))) == 1


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _gemm(epi, low=None):
    low = low or PallasLowering(plain_gemm="kernel")
    return lambda a, b, l: low.gemm(epi, a, b, l)


def test_hits_skip_the_kernel_generation(tmp_path, monkeypatch):
    cache = KC.enable_kernel_cache(tmp_path)
    args = _residual_rms_args()
    text = _lower(_gemm(programs.RESIDUAL_RMS), *args)
    assert cache.stats.misses == 1 and cache.stats.writes == 1
    # A new process, in effect: an empty memo over the same directory. Mosaic GPU's code
    # generation must not run at all.
    cache = KC.enable_kernel_cache(tmp_path)
    import jax._src.pallas.mosaic_gpu.lowering as mgpu_lowering

    def refuse(*a, **k):
        raise AssertionError("Mosaic GPU lowered a kernel that the cache holds")

    monkeypatch.setattr(mgpu_lowering, "lower_jaxpr_to_module", refuse)
    again = _lower(_gemm(programs.RESIDUAL_RMS), *args)
    assert cache.stats.hits == 1 and cache.stats.misses == 0
    assert module_digests(again) == module_digests(text)
    # In memory: a second call site of the kernel reads nothing more.
    _lower(lambda a, b, l: [_gemm(programs.RESIDUAL_RMS)(a, b, l) for _ in range(3)], *args)
    assert cache.stats.hits == 1


def test_every_call_site_shares_one_lowered_kernel(tmp_path):
    """A model calls each kernel once per layer: the step carries one copy of its module."""
    args = _residual_rms_args()

    def three_layers(a, b, l):
        x = a
        for _ in range(3):
            out = _gemm(programs.RESIDUAL_RMS)(x, b, l)
            x = out["h"][:, :128]
        return x

    plain = _lower(three_layers, *args)
    KC.enable_kernel_cache(tmp_path)
    cached = _lower(three_layers, *args)
    assert len(module_digests(plain)) == len(module_digests(cached)) == 1
    assert cached.count("@mosaic_gpu_v2") == plain.count("@mosaic_gpu_v2") == 1
    assert 0.8 < len(cached) / len(plain) < 1.2


def test_the_key_follows_the_kernel(tmp_path):
    cache = KC.enable_kernel_cache(tmp_path)
    args = _residual_rms_args()
    _lower(_gemm(programs.RESIDUAL_RMS), *args)
    _lower(_gemm(programs.RESIDUAL_RMS), *_residual_rms_args(m=1024))  # another shape
    from coda_jax.pallas.tuning import CONFIG_TABLE
    import dataclasses

    other_cfg = dataclasses.replace(CONFIG_TABLE["default"], cluster_dimension=None)
    _lower(_gemm(programs.RESIDUAL_RMS, PallasLowering(other_cfg, plain_gemm="kernel")), *args)
    # The same name and declaration with another body: its jaxpr differs, so does the key.
    twin = dataclasses.replace(programs.RESIDUAL_RMS,
                               body=lambda acc, ctx, residual, gamma: {"x": acc + residual,
                                                                       "h": (acc + residual) * gamma,
                                                                       "sumsq": (acc + residual) ** 2})
    _lower(_gemm(twin), *args)
    assert cache.stats.misses == 4 and len(list(tmp_path.glob("*.kernel.pkl"))) == 4


def test_a_latency_hint_is_part_of_the_cached_kernel(tmp_path):
    """latency_hints=True: the cached kernel's custom call carries the hint (a
    separate entry from the kernel without it), also when a worker generated it."""
    from coda_jax.pallas.kernel_builder import compiled_kernel

    cache = KC.enable_kernel_cache(tmp_path, workers=1)
    args = _residual_rms_args()
    plain = _lower(_gemm(programs.RESIDUAL_RMS), *args)
    compiled_kernel.cache_clear()
    hinted = _lower(_gemm(programs.RESIDUAL_RMS, PallasLowering(plain_gemm="kernel", latency_hints=True)), *args)
    assert "latency_metadata" not in plain and hinted.count("latency_metadata") == 1
    assert cache.stats.misses == 2 and cache.stats.worker_failures == 0
    cache.wait()
    assert len(list(tmp_path.glob("*.kernel.pkl"))) == 2


def test_an_unreadable_entry_is_reported_and_regenerated(tmp_path):
    cache = KC.enable_kernel_cache(tmp_path)
    args = _residual_rms_args()
    good = module_digests(_lower(_gemm(programs.RESIDUAL_RMS), *args))
    (entry,) = tmp_path.glob("*.kernel.pkl")
    entry.write_bytes(b"not a pickle")
    cache = KC.enable_kernel_cache(tmp_path)
    with pytest.warns(RuntimeWarning, match="ignoring unreadable entry"):
        again = module_digests(_lower(_gemm(programs.RESIDUAL_RMS), *args))
    assert cache.stats.bad_entries == 1 and cache.stats.misses == 1 and cache.stats.writes == 1
    assert again == good
    cache = KC.enable_kernel_cache(tmp_path)  # the rewritten entry reads back
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lower(_gemm(programs.RESIDUAL_RMS), *args)
    assert cache.stats.hits == 1


def test_the_environment_variable_turns_it_on_and_off(tmp_path, monkeypatch):
    KC.disable_kernel_cache()
    assert KC.active_kernel_cache() is None
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", str(tmp_path))
    cache = KC.active_kernel_cache()
    assert cache is not None and cache.directory == tmp_path
    assert KC.active_kernel_cache() is cache  # one cache while the variable stays
    _lower(_gemm(programs.RESIDUAL_RMS), *_residual_rms_args())
    assert cache.stats.writes == 1
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", "off")
    assert KC.active_kernel_cache() is None


@pytest.fixture
def jax_cache_dir():
    """Sets JAX's persistent cache directory for one test (nothing compiles meanwhile)."""
    before = jax.config.jax_compilation_cache_dir
    yield lambda d: jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_compilation_cache_dir", before)


def test_where_it_lives_by_default(tmp_path, monkeypatch, jax_cache_dir):
    monkeypatch.delenv("CODA_JAX_KERNEL_CACHE_DIR", raising=False)
    KC.disable_kernel_cache()
    jax_cache_dir(str(tmp_path / "jax"))
    cache = KC.active_kernel_cache()
    assert cache is not None and cache.directory == tmp_path / "jax" / KC.JAX_CACHE_SUBDIR
    assert KC.active_kernel_cache() is cache
    for off in ("off", "0", "FALSE", "none"):  # the variable turns it off ...
        monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", off)
        assert KC.active_kernel_cache() is None
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", str(tmp_path / "mine"))  # ... or puts it elsewhere
    assert KC.active_kernel_cache().directory == tmp_path / "mine"
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", "")  # empty: as unset
    assert KC.active_kernel_cache().directory == tmp_path / "jax" / KC.JAX_CACHE_SUBDIR
    # Without JAX's cache (or with a remote one), the user's cache directory.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    jax_cache_dir("gs://bucket/jax_cache")
    assert KC.active_kernel_cache().directory == tmp_path / "xdg" / "coda_jax" / "kernels"
    jax_cache_dir(None)
    assert KC.active_kernel_cache().directory == tmp_path / "xdg" / "coda_jax" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert KC.active_kernel_cache().directory == tmp_path / "home" / ".cache" / "coda_jax" / "kernels"


def test_an_unwritable_directory_is_reported_once_and_the_kernels_generated_here(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cache = KC.enable_kernel_cache(blocker / "kernels", workers=2)
    with pytest.warns(RuntimeWarning, match="cannot write") as caught:
        text = _lower(_gemm(programs.RESIDUAL_RMS), *_residual_rms_args())
        _lower(_gemm(programs.RESIDUAL_RMS), *_residual_rms_args(n=512))
    assert sum("cannot write" in str(w.message) for w in caught) == 1
    assert text.count("@mosaic_gpu_v2") == 1
    assert cache.stats.misses == 2 and cache.stats.writes == 0 and cache._pool is None


def test_interpret_mode_never_uses_it(tmp_path):
    from coda_jax.pallas.interpret import interpret_mode

    cache = KC.enable_kernel_cache(tmp_path)
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (128, 64)).astype(BF)
    g = (1 + 0.1 * jax.random.normal(ks[1], (64,))).astype(BF)
    w = (jax.random.normal(ks[2], (64, 256)) * 0.125).astype(BF)
    with interpret_mode():
        got = cj.rms_norm_matmul_swiglu(x, g, w, backend="pallas")
    want = cj.rms_norm_matmul_swiglu(x, g, w, backend="xla")
    assert float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32))) < 2e-2
    assert vars(cache.stats) == vars(KC.CacheStats())
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("case,workers", [("swiglu_step_vmap", 0), ("swiglu_step", 2)],
                         ids=["vmap_remat_here", "remat_in_workers"])
def test_a_training_step_lowers_through_the_cache(tmp_path, case, workers):
    """The fused ops' forward and backward kernels under jax.grad and jax.checkpoint (and
    jax.vmap, whose batched kernels are generated, not cached), each run in a fresh
    process: the cached step has the uncached step's kernel calls, the cold run generates
    every kernel (in worker processes when there are workers), the warm run none."""
    plain = _probe(case)
    first = _probe(case, tmp_path, workers=workers)
    second = _probe(case, tmp_path, workers=workers)
    n = first["stats"]["misses"]
    assert n >= 3 and first["stats"]["hits"] == 0 and first["stats"]["worker_failures"] == 0, first["stats"]
    assert first["stats"]["writes"] == n == len(list(tmp_path.glob("*.kernel.pkl")))
    assert first["workers_started"] == (workers > 0)
    assert second["stats"]["hits"] == n and second["stats"]["misses"] == 0 and not second["workers_started"]
    assert plain["calls"] == first["calls"] == second["calls"] > 0
    assert plain["committed"] is first["committed"] is second["committed"] is False
    # (Mosaic GPU numbers the kernels of a process in the order it generates them, and the
    # number is part of each module: byte equality is checked on one kernel, above.)
    assert len(plain["modules"]) == len(first["modules"]) == len(second["modules"])
    # A cold process (kernels pending in workers) lowers the step a warm one lowers, so the
    # warm process finds the cold one's executable in JAX's persistent compilation cache.
    # (Not under vmap: its batched kernels are generated in each process, numbered after
    # the cold process's cached ones.)
    if case != "swiglu_step_vmap":
        assert first["step"] == second["step"]


def _fails_in_a_worker(acc, ctx, residual, gamma):
    main = sys.modules["__main__"]
    if getattr(getattr(main, "__spec__", None), "name", "") == "coda_jax.pallas.kernel_workers":
        raise RuntimeError("this body refuses to run in a kernel worker")
    x = acc + residual
    return {"x": x, "h": x * gamma, "sumsq": x * x}


def test_a_failed_worker_job_is_reported_and_generated_here(tmp_path):
    import dataclasses

    epi = dataclasses.replace(programs.RESIDUAL_RMS, name="residual_rms_test_worker_failure", body=_fails_in_a_worker)
    cache = KC.enable_kernel_cache(tmp_path, workers=1)
    with pytest.warns(RuntimeWarning, match="refuses to run in a kernel worker"):
        text = _lower(_gemm(epi), *_residual_rms_args())
    assert cache.stats.worker_failures == 1 and cache.stats.writes == 1
    assert text.count("@mosaic_gpu_v2") == 1 and len(list(tmp_path.glob("*.kernel.pkl"))) == 1


def test_a_kernel_that_cannot_travel_is_generated_here(tmp_path):
    import dataclasses

    closure = dataclasses.replace(programs.RESIDUAL_RMS, name="residual_rms_closure",
                                  body=lambda acc, ctx, residual, gamma: {"x": acc + residual, "h": acc * gamma,
                                                                          "sumsq": acc * acc})
    cache = KC.enable_kernel_cache(tmp_path, workers=2)
    _lower(_gemm(closure), *_residual_rms_args())
    assert cache.stats.misses == 1 and cache.stats.writes == 1 and cache._pool is not None
    assert not cache._pool._procs  # no worker was started for it


def test_every_program_pickles_and_rebuilds_as_itself():
    import pickle

    made = [programs.rms_swiglu(True), programs.rms_swiglu(False), programs.rms_rope(64, None, False),
            programs.rms_rope(64, 1e-6, True), programs.rms_dgrad(True), programs.rms_dgrad(False),
            programs.rms_dgrad(True, True), programs.adamw_q8(0.9, 0.95, 1e-8), programs.adamw_cast(0.9, 0.95, 1e-8)]
    consts = [v for v in vars(programs).values() if isinstance(v, E.Epilogue)]
    for epi in made + consts:
        back = pickle.loads(pickle.dumps(epi))
        assert back == epi and back.name == epi.name
    for epi in made:  # factory-made: rebuilt by the factory (the same cached object here)
        assert pickle.loads(pickle.dumps(epi)) is epi
    # A default spelled out is the same program (one kernel, not a second compile of it).
    assert programs.rms_dgrad(True, False) is programs.rms_dgrad(True)


def test_worker_count_rules(monkeypatch):
    assert KC.resolve_workers(3) == 3 and KC.resolve_workers(0) == 0
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_WORKERS", "2")
    assert KC.resolve_workers(None) == 2
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_WORKERS", "many")
    with pytest.raises(ValueError, match=r"\$CODA_JAX_KERNEL_CACHE_WORKERS='many': coda_jax option kernel_cache.workers must be one of: an integer >= 0, 'auto'"):
        KC.resolve_workers(None)
    with pytest.raises(ValueError, match="workers must be a number of processes >= 0, got -1"):
        KC.resolve_workers(-1)
    monkeypatch.delenv("CODA_JAX_KERNEL_CACHE_WORKERS")
    monkeypatch.setattr(KC, "usable_cores", lambda: 2)
    assert KC.resolve_workers(None) == 0
    monkeypatch.setattr(KC, "usable_cores", lambda: 16)
    assert KC.resolve_workers(None) == 8
    monkeypatch.setattr(KC, "usable_cores", lambda: 6)
    assert KC.resolve_workers(None) == 5
    monkeypatch.setattr(KC.jax, "process_count", lambda: 4)  # four processes of one job share them
    assert KC.resolve_workers(None) == 1
    monkeypatch.setattr(KC, "usable_cores", lambda: 64)
    assert KC.resolve_workers(None) == 2
    monkeypatch.undo()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)  # a process pinned to 3 cores
    assert KC.usable_cores() == 3


def test_a_worker_that_cannot_start_is_reported_and_the_kernel_generated_here(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the worker process exits at once
    cache = KC.enable_kernel_cache(tmp_path, workers=1)
    with pytest.warns(RuntimeWarning, match="a worker could not generate a kernel"):
        text = _lower(_gemm(programs.RESIDUAL_RMS), *_residual_rms_args())
    assert cache.stats.worker_failures == 1 and cache.stats.writes == 1
    assert text.count("@mosaic_gpu_v2") == 1 and len(list(tmp_path.glob("*.kernel.pkl"))) == 1


def test_a_cached_kernel_runs_jitted_eagerly_vmapped_and_without_jit(tmp_path):
    """The wrapping of a cached kernel, run for real on the CPU: an export of a small CPU
    function stands in for the CUDA kernel's. The step's results are not committed (as a
    jitted step's are not without the cache), and the kernel runs under jax.jit, eagerly,
    under jax.vmap (the fallback to the kernel itself) and under jax.disable_jit()."""
    def kernel(a, b):
        return (a @ b, jnp.sum(a * a, axis=1))

    avals = (jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((4, 4), jnp.float32))
    exported = jax.export.export(jax.jit(kernel), platforms=("cpu",))(*avals)
    cache = KC.KernelCache(tmp_path, workers=0)
    out_avals = jax.make_jaxpr(kernel)(*avals).out_avals
    entry = KC._CachedKernel(cache, "k" * 64, kernel, avals, out_avals, exported, None)
    call = KC._with_batching_fallback(entry.bind, kernel)
    a = jax.random.normal(jax.random.key(0), (8, 4))
    b = jax.random.normal(jax.random.key(1), (4, 4))
    want = kernel(a, b)

    def close(got, ref):
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.shape == r.shape and float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 1e-6

    step = jax.jit(lambda a, b: call(a, b))
    got = step(a, b)
    close(got, want)
    assert not any(x.committed for x in got)
    close(step(got[0], b), kernel(want[0], b))  # a step on its own result: no second trace
    assert step._cache_size() == 1
    close(call(a, b), want)
    compiles = []

    def on_duration(name, *_, **__):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        with jax.disable_jit():
            close(call(a, b), want)
            n = len(compiles)
            close(call(a, b), want)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert n >= 1 and len(compiles) == n  # compiled once, not at every eager call
    av = jnp.stack([a, 2 * a])
    got = jax.vmap(call, in_axes=(0, None))(av, b)
    close(got, jax.vmap(kernel, in_axes=(0, None))(av, b))


def test_the_command_line_tells_where_and_how_big_and_clears(tmp_path, monkeypatch, capsys):
    KC.enable_kernel_cache(tmp_path, workers=0)
    _lower(_gemm(programs.RESIDUAL_RMS), *_residual_rms_args())
    (tmp_path / "notes.txt").write_text("not an entry")
    cute = tmp_path / "cutedsl"  # the CuTeDSL cache's entries (coda_jax/ffi/kernel_cache.py): reported and cleared too
    cute.mkdir()
    for name in ("a", "b"):
        (cute / f"{name}.cutedsl.bin").write_bytes(b"x" * 10)
    info = KC.describe(tmp_path)
    assert info["entries"] == 1 and info["bytes"] == next(tmp_path.glob("*.kernel.pkl")).stat().st_size > 0
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", str(tmp_path))
    assert KC.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "1 entries" in out[0] and out[1] == f"CuTeDSL kernel cache: {cute}: 2 entries, 0.0 MiB", out
    assert KC.main(["--clear"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 entries" in out and f"removed 2 entries from {cute}" in out, out
    assert KC.describe(tmp_path)["entries"] == 0 and (tmp_path / "notes.txt").exists() and not list(cute.iterdir())
    monkeypatch.setenv("CODA_JAX_KERNEL_CACHE_DIR", "off")
    assert KC.main([]) == 0 and "off" in capsys.readouterr().out
    assert KC.describe(tmp_path / "missing") == {"directory": str(tmp_path / "missing"), "entries": 0, "bytes": 0}


# One writer process of the test below: writes entry KEY N times, each an export of a
# function whose embedded constant has WIDTH floats (so each writer's entry differs and
# takes a while to write).
_RACE_WRITER = r"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from coda_jax.pallas.kernel_entries import write_entry

directory, key, n, width = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
table = np.arange(width, dtype=np.float32)
exported = jax.export.export(jax.jit(lambda x: x * table))(jax.ShapeDtypeStruct((width,), jnp.float32))
print("ready", flush=True)
for _ in range(n):
    write_entry(directory, key, exported)
"""


def test_processes_sharing_the_directory_never_read_a_partial_entry(tmp_path):
    """Several processes of a job share the cache directory (kernel_cache divides its workers
    among them): three processes write the same entry over and over while this one reads it.
    Each write goes to a temporary file renamed over the entry, so every read finds no entry
    or a whole one (one of the writers'), and no temporary file is left."""
    from coda_jax.pallas.kernel_entries import entry_path, read_entry

    key, widths = "shared", (40_000, 60_000, 80_000)  # 160-320 KB entries
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    writers = [subprocess.Popen([sys.executable, "-c", _RACE_WRITER, str(tmp_path), key, "60", str(w)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in widths]
    seen, reads = set(), 0
    try:
        while any(w.poll() is None for w in writers):
            got = read_entry(tmp_path, key)  # raises on a partial or foreign file
            reads += 1
            if got is not None:
                seen.add(got.in_avals[0].shape[0])
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
    for w in writers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err[-4000:]
    assert seen and seen <= set(widths), seen
    assert read_entry(tmp_path, key).in_avals[0].shape[0] in widths
    assert reads > len(seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry_path(tmp_path, key).name]  # no *.tmp left
