"""The fused ops under a device mesh (coda_jax.partitioning, coda_jax.sharding).

The multi-device checks run in subprocesses with 8 CPU devices
(``tests/multi_device_cases.py``): the device count is fixed when JAX starts, and the rest
of the suite runs on one.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from coda_jax import epilogue as E
from coda_jax import programs
from coda_jax.reference import REFERENCE
from coda_jax.sharding import fsdp_spec

ROOT = Path(__file__).resolve().parents[1]
GROUPS = {
    "ops": ["ops_dp_auto", "ops_dp_explicit", "cutedsl_lowers"],
    "model_auto": ["model_xla_8_auto", "model_xla_2x4_auto", "model_pallas_8_auto", "model_pallas_2x4_auto"],
    "model_explicit": ["model_xla_8_explicit", "model_xla_2x4_explicit", "model_pallas_8_explicit",
                       "model_pallas_2x4_explicit"],
}


def _run_cases(cases):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "multi_device_cases.py"), *cases],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r.stdout


@pytest.mark.parametrize("group", list(GROUPS))
def test_on_eight_devices(group):
    out = _run_cases(GROUPS[group])
    for case in GROUPS[group]:
        want = {"ops_dp_auto": "ops_data_parallel_auto", "ops_dp_explicit": "ops_data_parallel_explicit",
                "cutedsl_lowers": "cutedsl_lowers_under_mesh"}.get(case, case)
        assert f"OK {want}" in out, out


def test_train_example_on_meshes_matches_one_device(tmp_path):
    """Data parallel over 8 devices, then resumed from its checkpoint on an FSDP mesh: the
    same losses as one device."""
    import json

    sys.path.insert(0, str(ROOT / "examples"))
    import train_llama

    out = _run_cases(["train_mesh"])
    mesh_losses = json.loads(next(l for l in out.splitlines() if l.startswith("HISTORY "))[len("HISTORY "):])
    train_llama.main(["--batch", "8", "--seq", "32", "--layers", "1", "--vocab", "512", "--eval-every", "0",
                      "--ckpt-every", "0", "--steps", "6", "--out", str(tmp_path)])
    one = json.loads((tmp_path / "history.json").read_text())["loss"]
    assert len(mesh_losses) == 6
    np.testing.assert_allclose(mesh_losses, one, rtol=2e-5)


LINEAR = [epi for epi in vars(programs).values() if isinstance(epi, E.Epilogue) and epi.linear]


@pytest.mark.parametrize("epi", LINEAR, ids=lambda e: e.name)
def test_linear_declarations_hold(epi):
    """An epilogue declared linear gives, from two partial accumulators, outputs that add up
    to its outputs from their sum: what the partitioned wgrad's psum relies on."""
    m, n, k = 24, 40, 16
    ks = jax.random.split(jax.random.key(3), 4)
    a1, a2 = jax.random.normal(ks[0], (k, m)), jax.random.normal(ks[1], (k, m))
    b = jax.random.normal(ks[2], (k, n))
    loads = {l.name: jax.random.normal(jax.random.fold_in(ks[3], i),
                                       {E.LoadKind.ROW: (m,), E.LoadKind.COL: (n,), E.LoadKind.TILE: (m, n)}[l.kind])
             for i, l in enumerate(epi.loads)}
    f32 = {o.name: jnp.float32 for o in epi.outputs}
    kinds = {o.name: o.kind for o in epi.outputs}

    def f(a):  # partials of reductions summed: the values the ops use
        outs = REFERENCE.gemm(epi, a, b, loads, transpose_a=True, out_dtypes=f32)
        return {k: v if kinds[k] is E.OutputKind.TILE else v.sum(axis=0) for k, v in outs.items()}

    whole, p1, p2 = f(a1 + a2), f(a1), f(a2)
    for name in whole:
        np.testing.assert_allclose(p1[name] + p2[name], whole[name], rtol=1e-5, atol=1e-4)


def test_the_wgrad_programs_are_declared_linear():
    assert {e.name for e in LINEAR} == {"identity", "norm_wgrad"}


def test_fsdp_spec_splits_the_largest_divisible_dimension():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "fsdp"))
    P = jax.sharding.PartitionSpec
    assert fsdp_spec((64, 256), mesh) == P(None, "fsdp")
    assert fsdp_spec((258, 6), mesh) == P()
    assert fsdp_spec((258, 8), mesh) == P(None, "fsdp")
    assert fsdp_spec((), mesh) == P()
    assert fsdp_spec((64, 256), jax.sharding.AbstractMesh((8,), ("data",))) == P()
