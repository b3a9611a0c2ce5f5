"""The suite's tiers (tests/tiers.py): the tables name real tests, the rules keep what they say."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiers

TESTS = Path(__file__).resolve().parent


def test_tier_tables_name_collected_tests(request):
    """Every entry of ``FULL_ONLY`` and ``SWEEPS`` names a collected test or parameter: a renamed
    test would otherwise move back into the default tier, or a kept parameter quietly out."""
    ids = getattr(request.config, "coda_collected_ids", [])
    files = {i.split("::", 1)[0] for i in ids}
    if files != {p.name for p in TESTS.glob("test_*.py")}:
        pytest.skip("this run collected part of the suite")
    assert tiers.check_tables(ids) == []


def test_default_tier_rules():
    ids = ["test_a.py::test_x", "test_a.py::test_sweep[p-s1]", "test_a.py::test_sweep[p-s2]",
           "test_a.py::test_sweep[q-s1]", "test_a.py::test_sweep[q-s2]", "test_a.py::test_pick[one]",
           "test_a.py::test_pick[two]", "test_a.py::test_gone[one]", "test_b.py::test_y"]
    full_only = {"test_a.py::test_gone": "why", "test_b.py::test_y": "why"}
    sweeps = {"test_a.py::test_sweep": (0, 1), "test_a.py::test_pick": frozenset({"two"})}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tiers, "FULL_ONLY", full_only)
        m.setattr(tiers, "SWEEPS", sweeps)
        keep = tiers.default_tier(ids)
        # The cover keeps [p-s1] (p, s1), [p-s2] (s2), [q-s1] (q); [q-s2] brings nothing new.
        assert keep == {"test_a.py::test_x", "test_a.py::test_sweep[p-s1]", "test_a.py::test_sweep[p-s2]",
                        "test_a.py::test_sweep[q-s1]", "test_a.py::test_pick[two]"}
        assert tiers.check_tables(ids) == []
        assert tiers.check_tables(ids[:-1]) == ["test_b.py::test_y"]
        m.setattr(tiers, "SWEEPS", {**sweeps, "test_a.py::test_pick": frozenset({"three"})})
        assert tiers.check_tables(ids) == ["test_a.py::test_pick[three]"]


def _collected(*args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "CODA_JAX_TESTS"}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        "-p", "no:xdist", *args, str(TESTS / "test_shape_fuzz.py")],
                       capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return sorted(line.split("::", 1)[1] for line in r.stdout.splitlines() if "::" in line)


def test_full_flag_runs_the_rest_marked_slow():
    default = _collected()
    slow = _collected("--full", "-m", "slow")
    assert default == ["test_draws_are_seeded_and_ragged"]
    assert len(slow) >= 4 and "test_draws_are_seeded_and_ragged" not in slow
