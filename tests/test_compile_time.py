"""benchmarks/compile_time.py on the CPU: a second process loads every XLA executable of the
train and eval steps from JAX's persistent compilation cache."""

from benchmarks import compile_time


def test_compile_time_second_process_hits_the_persistent_cache(tmp_path):
    # xla backend: the Pallas interpreter's host callbacks are never cached; the kernel
    # backends are measured on the GPU (docs/compile_cache.md).
    first, second = compile_time.main(["--backends", "xla", "--preset", "tiny", "--layers", "1", "--batch", "2",
                                       "--seq", "32", "--cache-dir", str(tmp_path / "cache"),
                                       "--dump-hlo", str(tmp_path / "hlo")])
    assert first["cache_misses"] > 0 and first["cache_hits"] == 0
    assert second["cache_hits"] == first["cache_misses"] and second["cache_misses"] == 0
    assert second["train_first_s"] < first["train_first_s"]
    for r in (first, second):  # the first call's stages add up to it, up to rounding each of 5 times to 1 ms
        stages = [r[f"train_{s}_s"] for s in compile_time.FIRST_CALL_STAGES]
        assert min(stages) >= 0 and abs(sum(stages) - r["train_first_s"]) <= 5 * 0.0005 + 1e-9
        assert r["train_hlo_mb"] > 0
    assert second["train_compile_s"] < first["train_compile_s"]  # the cache hit is in the compile stage
    assert first["train_hlo_sha"] == second["train_hlo_sha"] and first["eval_hlo_sha"] == second["eval_hlo_sha"]
    dumped = sorted(p.name for p in (tmp_path / "hlo").iterdir())
    assert dumped == sorted({f"xla_{s}_{first[f'{s}_hlo_sha']}.mlir" for s in ("train", "eval")})


def test_the_kernel_cache_variant_needs_the_cache_dir():
    import pytest

    assert compile_time.parse_args(["--backends", "plain,pallas@kernel_cache", "--cache-dir", "/tmp/x"]).backends == [
        "plain", "pallas@kernel_cache"]
    both = ["cutedsl", "cutedsl@kernel_cache"]
    assert compile_time.parse_args(["--backends", ",".join(both), "--cache-dir", "/tmp/x"]).backends == both
    with pytest.raises(SystemExit):
        compile_time.parse_args(["--backends", "pallas@kernel_cache"])
    with pytest.raises(SystemExit):
        compile_time.parse_args(["--backends", "xla@kernel_cache", "--cache-dir", "/tmp/x"])
