"""The interpreter's thread-pool guard (coda_jax/pallas/interpret.py), in fresh processes:
whether PJRT_NPROC is set depends on whether JAX has created its CPU client yet."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import os, warnings
import jax
from coda_jax.pallas import interpret as I
if {late}:
    jax.devices()  # the CPU client now exists, with its pool already sized
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ok = I.ensure_interpreter_threads()
    I.ensure_interpreter_threads()  # warns once
print(ok, os.environ.get("PJRT_NPROC"), len(w), w[0].message if w else "")
"""


def _run(late: bool, **env) -> list[str]:
    e = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "CODA_JAX_PALLAS_INTERPRET")}
    e.update(env, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(late=late)], env=e, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_pool_sized_before_jax_starts():
    ok, nproc = _run(False)[:2]
    assert ok == "True" and int(nproc) >= 8


def test_user_pool_setting_kept():
    assert _run(False, PJRT_NPROC="12")[:3] == ["True", "12", "0"]


@pytest.mark.skipif((os.cpu_count() or 1) >= 8, reason="the default pool is large enough here")
def test_warns_once_when_too_late():
    res = _run(True)
    assert res[:3] == ["False", "None", "1"] and "PJRT_NPROC=8" in " ".join(res[3:])
