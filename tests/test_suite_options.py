"""The suite's own process settings (tests/suite_options.py): its per-session compilation cache."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

_PROBE = """
import os, sys
import jax, jax.numpy as jnp
from suite_options import COMPILE_CACHE_DIR_ENV, apply_suite_compile_cache, suite_compile_cache_env
apply_suite_compile_cache()
d = os.environ.get(COMPILE_CACHE_DIR_ENV)
print("DIR", d)
print("CONFIG", jax.config.jax_compilation_cache_dir)
print("ENV", sorted(suite_compile_cache_env()))
jax.jit(lambda x: jnp.cos(x) * 2)(jnp.ones(5)).block_until_ready()
print("ENTRIES", len(os.listdir(d)) if d else 0)
"""


def _probe(**env) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CODA_JAX_TESTS_COMPILE_CACHE", "JAX_COMPILATION"))}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**base, "JAX_PLATFORMS": "cpu", **env}, cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


@pytest.mark.skipif(not os.environ.get("CODA_JAX_TESTS_COMPILE_CACHE_DIR"), reason="the suite's cache is off here")
def test_the_first_process_makes_the_sessions_cache_and_removes_it_at_exit():
    got = _probe()
    d = got["DIR"]
    assert d != "None" and got["CONFIG"] == d and int(got["ENTRIES"]) > 0  # the jit was written there
    assert got["ENV"] == str(["JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])  # no size bound: no LRU scans
    assert not Path(d).exists()  # made by that process: removed when it exited
    # A process started inside a session uses the session's directory and leaves it in place.
    mine = os.environ["CODA_JAX_TESTS_COMPILE_CACHE_DIR"]
    got = _probe(CODA_JAX_TESTS_COMPILE_CACHE_DIR=mine)
    assert got["DIR"] == got["CONFIG"] == mine and Path(mine).is_dir()


def test_the_cache_can_be_turned_off():
    got = _probe(CODA_JAX_TESTS_COMPILE_CACHE="off")
    assert got["DIR"] == "None" and got["CONFIG"] == "None" and got["ENV"] == "[]"
