"""Register-spill checks of CuTeDSL kernels (``test_cutedsl_lowering``, ``test_cutedsl_fp8``).

:func:`kernel_spill_lines` lowers kernels for sm_90a in a subprocess whose environment makes
CuTeDSL keep its PTX (``CUTE_DSL_KEEP=ptx``), then runs ``ptxas -v`` on each file and returns
its spill lines. The kernels to lower come from a function of a test module, named
``"module:function"``, that returns ``[(name, lower)]`` with ``lower()`` lowering one kernel
for CUDA (run in the subprocess, after the environment is set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import glob, importlib, json, os, shutil, sys
module, function = sys.argv[2].split(":")
stamp, found = {}, {}
for i, (name, lower) in enumerate(getattr(importlib.import_module(module), function)()):
    lower()
    # PTX files are named by the launch signature: kernels with equal operands rewrite the
    # same file, so take the files this lowering wrote and copy them aside.
    new = []
    for f in glob.glob(os.path.join(sys.argv[1], "*.ptx")):
        t = os.stat(f).st_mtime_ns
        if stamp.get(f) != t:
            stamp[f] = t
            new.append(shutil.copy(f, os.path.join(sys.argv[1], f"{i}.{len(new)}.kept")))
    found[f"{i}:{name}"] = new
print(json.dumps(found))
"""


def kernel_spill_lines(tmp_path, runs: str) -> dict[str, list[str]]:
    """``{kernel name: ptxas's spill lines}`` of the kernels ``runs`` (``"module:function"``)
    lowers; fails if a kernel wrote no PTX or ptxas fails, skips where ptxas is older than the
    PTX CuTeDSL writes."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path), runs], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    assert found and all(found.values()), found
    out = {}
    for name, files in found.items():
        for f in files:
            v = subprocess.run(["ptxas", "-arch=sm_90a", "-v", "-o", os.devnull, f], capture_output=True, text=True)
            if "Unsupported .version" in v.stderr:
                pytest.skip(f"ptxas on PATH is older than CuTeDSL's PTX: {v.stderr.strip()[:200]}")
            assert v.returncode == 0, v.stderr[-2000:]
            out.setdefault(name, []).extend(line.strip() for line in v.stderr.splitlines() if "spill" in line)
    return out


def assert_no_spills(lines: dict[str, list[str]]) -> None:
    for name, spills in lines.items():
        assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in s for s in spills), (name, spills)
