"""Several processes through ``jax.distributed`` on the CPU: ``scripts/launch_local.sh`` starts
2 processes of 2 CPU devices each (JAX's CPU collectives, gloo by default in jax 0.11), and
``examples/train_llama.py`` must give the same losses as one process with 4 devices, on a data
parallel and an FSDP mesh; a checkpoint the 2 processes wrote resumes in one process on
another mesh; only process 0 prints the summary; the launcher stops the others when one fails.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from suite_options import suite_xla_flags

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_local.sh"
TRAIN = ROOT / "examples" / "train_llama.py"
sys.path.insert(0, str(ROOT / "examples"))

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tokenizers")

import train_llama  # noqa: E402

# Small enough for a few seconds a run on 2 cores; checkpoints at steps 3 and 6.
COMMON = ["--batch", "8", "--seq", "32", "--layers", "1", "--vocab", "512", "--steps", "6", "--eval-every", "3",
          "--ckpt-every", "3"]
# Two processes on 4 devices reduce across processes through gloo, one process within XLA: the
# same sums in another order.
RTOL = 1e-5


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, XLA_FLAGS=suite_xla_flags())  # the launcher sets the device count
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


def _launch(n: int, *args: str, script: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``scripts/launch_local.sh --cpu-devices 2 N ARGS...`` with this interpreter."""
    cmd = ["bash", str(LAUNCH), "--cpu-devices", "2", "--python", sys.executable,
           *(["--script", str(script)] if script else []), str(n), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _one_process(*args: str, devices: int = 4) -> subprocess.CompletedProcess:
    env = _env(XLA_FLAGS=suite_xla_flags(devices=devices))
    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout + r.stderr


def _history(out: Path) -> dict:
    return json.loads((out / "history.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(mesh)``: (one process's run directory, two processes' run directory, the
    launcher's (stdout, stderr)), each pair trained once per module."""
    made = {}

    def get(mesh: str):
        if mesh not in made:
            base = tmp_path_factory.mktemp(mesh.replace(",", "_").replace("=", ""))
            one, two = base / "one", base / "two"
            _ok(_one_process(*COMMON, "--mesh", mesh, "--out", str(one)))
            r = _launch(2, *COMMON, "--mesh", mesh, "--out", str(two))
            _ok(r)
            made[mesh] = one, two, (r.stdout, r.stderr)
        return made[mesh]

    return get


@pytest.mark.parametrize("mesh", ["data=4", "data=2,fsdp=2"])
def test_two_processes_train_as_one_process(runs, mesh):
    """2 processes x 2 devices: the losses and validation losses of 1 process x 4 devices; only
    process 0 prints the progress and the summary."""
    one, two, (printed, others) = runs(mesh)
    a, b = _history(one), _history(two)
    assert b["step"] == list(range(6)) and b["val_step"] == [3, 6]
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=RTOL)
    np.testing.assert_allclose(b["val_loss"], a["val_loss"], rtol=RTOL)
    assert b["loss"][-1] != b["loss"][0]  # it trained
    summary = json.loads((two / "summary.json").read_text())
    assert summary["devices"] == 4 and summary["last_loss"] == pytest.approx(a["loss"][-1], rel=RTOL)
    lines = printed.splitlines()  # the launcher's stdout: process 0's
    assert sum(l.startswith('{"tokens_per_s"') for l in lines) == 1, printed
    assert sum(l.startswith("steady state:") for l in lines) == 1, printed
    assert "cpu x 2 processes (4 devices)" in printed
    # Process 1's lines (prefixed, on stderr): no progress, no summary.
    theirs = [l for l in others.splitlines() if l.startswith("[1] ")]
    assert not [l for l in theirs if "loss" in l or "steady state" in l or "tokens_per_s" in l], theirs
    assert not [l for l in others.splitlines() if l.startswith("{")], others
    assert {p.name for p in two.iterdir()} == {"args.json", "checkpoints", "history.json", "loss.png", "summary.json"}
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["3", "6"]


def test_the_two_processes_see_the_batches_of_one_device(runs, tmp_path):
    """Against one device (no mesh: the whole batch cut on the host, no process or shard
    split): the same losses, so each process cut the global batch's own rows."""
    _, two, _ = runs("data=4")
    _ok(_one_process(*COMMON, "--out", str(tmp_path / "single"), devices=1))
    np.testing.assert_allclose(_history(two)["loss"], _history(tmp_path / "single")["loss"], rtol=RTOL)


def test_a_checkpoint_of_two_processes_resumes_in_one_on_another_mesh(runs, tmp_path):
    """The step-3 checkpoint the 2 processes wrote on ``data=4``, restored by one process onto
    ``data=2,fsdp=2``: steps 3-5 continue as the uninterrupted one-process run."""
    one, two, _ = runs("data=4")
    out = tmp_path / "resumed"
    shutil.copytree(two, out)
    shutil.rmtree(out / "checkpoints" / "6")  # the run as if stopped after step 3's checkpoint
    printed = _ok(_one_process(*COMMON, "--mesh", "data=2,fsdp=2", "--out", str(out)))
    assert "resumed from step 3" in printed
    got, ref = _history(out), _history(one)
    assert got["step"] == list(range(6))
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=RTOL)
    np.testing.assert_allclose(got["val_loss"], ref["val_loss"], rtol=RTOL)


def test_sample_reads_a_checkpoint_of_two_processes(runs):
    """examples/sample.py runs in one process and reads the checkpoint the 2 processes wrote:
    the same greedy continuation as from the one-process run's checkpoint."""
    one, two, _ = runs("data=4")

    def sample(run: Path) -> str:
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "sample.py"), "--from", str(run), "--prompt",
                            "It was", "--tokens", "6"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                           timeout=300)
        return [l for l in _ok(r).splitlines() if l.startswith("--- sample 1:")][0]

    assert sample(two) == sample(one)


def test_the_library_under_two_processes(tmp_path):
    """``batch_from_rows`` asks each process only for its devices' rows and builds the global
    batch; ``place_whole`` places a value each process holds whole; a model split over both
    processes gives its whole Hugging Face state dict, and ``save_pretrained`` writes it once."""
    r = _launch(2, "library", str(tmp_path / "hf"), script=ROOT / "tests" / "multi_process_probe.py", timeout=120)
    _ok(r)
    got = {}
    for line in (r.stdout + r.stderr).splitlines():
        line = line.removeprefix("[1] ")
        if line.startswith("{"):
            d = json.loads(line)
            got[d["process"]] = d
    assert sorted(got) == [0, 1]
    whole = np.arange(32).reshape(8, 4)
    for i, d in got.items():
        assert (d["processes"], d["devices"]) == (2, 4)
        assert d["rows"] == [[4 * i, 4 * i + 2], [4 * i + 2, 4 * i + 4]]  # its own half of the batch, nothing else
        np.testing.assert_array_equal(d["batch"], whole)
        np.testing.assert_array_equal(d["placed"], whole * 2)
        assert d["hf_split_params"] > 0 and d["hf_equal"], d
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]


def test_the_launcher_stops_the_others_when_one_fails():
    """Process 1 exits with status 3 at once; process 0 would sleep 300 s: the launcher stops it
    and returns 3."""
    t = time.perf_counter()
    r = _launch(2, "fail", script=ROOT / "tests" / "multi_process_probe.py", timeout=120)
    assert r.returncode == 3, r.stderr
    assert time.perf_counter() - t < 60
    assert "process 1 exited with status 3; stopping the others" in r.stderr


def test_a_batch_the_data_shards_do_not_divide_is_an_error_in_every_process(tmp_path):
    r = _launch(2, *COMMON, "--batch", "6", "--mesh", "data=4", "--out", str(tmp_path / "run"), timeout=120)
    assert r.returncode != 0
    rule = ("--batch 6 (the global batch) must be a multiple of the mesh's 4 data shards "
            "(data=4, 4 devices in 2 processes)")
    lines = r.stderr.splitlines()
    assert any(l.startswith("train_llama.py: error: " + rule) for l in lines), r.stderr  # process 0
    assert any(l.startswith("[1] train_llama.py: error: " + rule) for l in lines), r.stderr


@pytest.mark.parametrize("argv,rule", [
    (["2", "--process-id", "0"], "the launcher passes --coordinator, --num-processes and --process-id itself"),
    (["0"], "N (the number of processes) must be an integer >= 1"),
    (["--cpu-devices", "0", "2"], "--cpu-devices needs a count >= 1"),
])
def test_the_launcher_checks_its_arguments(argv, rule):
    r = subprocess.run(["bash", str(LAUNCH), "--python", sys.executable, *argv], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and rule in r.stderr, r.stderr


@pytest.mark.parametrize("argv,rule", [
    (["--process-id", "1"], "--process-id needs --coordinator and --num-processes (or --distributed"),
    (["--coordinator", "localhost:1234", "--num-processes", "2"], "--coordinator, --num-processes needs --process-id"),
    (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in 0..1"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"], "--coordinator must be HOST:PORT"),
    (["--num-processes", "0", "--distributed"], "--num-processes must be >= 1"),
    (["--local-device-ids", "0,1"], "--local-device-ids needs --distributed or --coordinator"),
    (["--distributed", "--local-device-ids", "0,0"], "expected distinct device numbers >= 0"),
])
def test_process_flags_are_checked(argv, rule, capsys):
    with pytest.raises(SystemExit):
        train_llama.parse_args(argv)
    assert rule in capsys.readouterr().err


def test_only_the_process_flags_or_distributed_join_processes(monkeypatch):
    """A plain run never calls ``jax.distributed.initialize``, even under a cluster manager
    (SLURM's variables set); ``--distributed`` calls it with only the flags given."""
    calls = []
    monkeypatch.setattr(train_llama.jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(train_llama.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    train_llama.init_distributed(train_llama.parse_args([]))
    assert calls == []
    train_llama.init_distributed(train_llama.parse_args(["--distributed"]))
    train_llama.init_distributed(train_llama.parse_args(["--distributed", "--process-id", "1",
                                                         "--local-device-ids", "0,1,2,3"]))
    train_llama.init_distributed(train_llama.parse_args(["--coordinator", "h:1", "--num-processes", "2",
                                                         "--process-id", "1"]))
    assert calls == [{}, {"process_id": 1, "local_device_ids": [0, 1, 2, 3]},
                     {"coordinator_address": "h:1", "num_processes": 2, "process_id": 1}]
