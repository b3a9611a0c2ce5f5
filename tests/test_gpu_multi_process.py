"""Several processes on several GPUs (``device`` kind ``nvidia-h200-x2``): ``scripts/launch_local.sh
--gpus-per-process 1 2`` starts one process per GPU, joined by ``jax.distributed`` (NCCL between
the processes), and ``examples/train_llama.py`` must give the same losses as one process that
sees both GPUs, on a data-parallel and an FSDP mesh, and in FP8; a checkpoint the 2 processes
wrote resumes in one process on one GPU. The CPU suite checks the same rules with 2 processes of
2 CPU devices (``tests/test_multi_process.py``). Skipped with fewer than 2 GPUs.

The test process never starts JAX itself: it counts the GPUs with ``nvidia-smi`` and leaves
them to the runs it starts (see :func:`_gpu_count`).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_local.sh"
TRAIN = ROOT / "examples" / "train_llama.py"

# The runs hold the GPUs, not this process. tests/conftest.py's Hopper check starts JAX's GPU
# client in this process after collection; by default it would take 75 % of each GPU (90 % under
# benchmarks/gpu_common.sh's XLA_PYTHON_CLIENT_MEM_FRACTION) for the whole session. Set here,
# before that check, the client allocates on demand (as benchmarks/gpu_tests.sh's xdist workers
# do). Where a client started earlier (another test file's import) this is too late, which is why
# the runs below also allocate on demand: then they share what that client left free.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_count() -> int:
    """The machine's GPUs, counted without JAX: ``jax.device_count()`` (what
    tests/test_gpu_multi.py asks) would start the GPU client in this process, and it would hold
    memory on every GPU while the training runs need them. ``nvidia-smi -L`` lists one
    ``GPU i: ...`` line a GPU (MIG instances are indented lines under their GPU, not counted).
    scripts/launch_local.sh numbers the GPUs of the machine (it sets ``CUDA_VISIBLE_DEVICES``
    itself), so the count is the machine's; a ``CUDA_VISIBLE_DEVICES`` already set lowers it to
    the GPUs it lists (an empty one: none, skipped)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    n = sum(line.startswith("GPU ") for line in listed.splitlines())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 or more GPUs"),
    pytest.mark.skipif(not (importlib.util.find_spec("orbax") and importlib.util.find_spec("tokenizers")),
                       reason="needs orbax-checkpoint and tokenizers (examples/train_llama.py)"),
    # The module's tests share their runs (the fixture below); under pytest-xdist they must land
    # on one worker, or each worker would train them again, on the same GPUs at once
    # (benchmarks/gpu_tests.sh passes --dist loadgroup).
    pytest.mark.xdist_group("gpu_multi_process"),
]

# One layer of the 1B preset (bf16) on the Pallas kernels, at a GPU-sized batch; checkpoints at
# steps 3 and 6. Each run costs JAX's start, the train and evaluation steps' compiles and two
# checkpoints: 7 runs in this module.
COMMON = ["--preset", "1b", "--layers", "1", "--backend", "pallas", "--batch", "8", "--seq", "256", "--steps", "6",
          "--eval-every", "3", "--ckpt-every", "3"]
# 2 processes x 1 GPU and 1 process x 2 GPUs run the same partitioned program on the same
# per-GPU shards, and both reduce across the GPUs over NCCL (a sum of two operands is the same in
# either order): what can differ is the last bits of nondeterministic GPU ops (the embedding's
# scatter-add gradient, the GEMM algorithms each process's autotuner picks): bf16 roundings that
# move a 6-step loss by ~1e-4 relative.
RTOL = 1e-3
# FP8 (delayed scaling): such a last-bit difference moves a value across an FP8 rounding boundary
# now and then, which changes the next GEMMs by far more than a bf16 rounding does.
RTOL_FP8 = 5e-3
# One GPU against the 2-GPU run: another device count sums the batch (and the weight gradients'
# token dimension) in another order, in GEMMs of other shapes, for three steps; no NCCL.
RTOL_ONE_GPU = 1e-2
TIMEOUT = 600  # seconds a run; each should take well under a minute

# How the runs get their devices; a manual check on the CPU swaps these two for
# ("--cpu-devices", "1") and forced CPU devices (JAX_PLATFORMS=cpu, XLA_FLAGS).
LAUNCHER_DEVICES = ("--gpus-per-process", "1")


def _devices_env(n: int) -> dict[str, str]:
    """The environment that shows one process the machine's first ``n`` GPUs (the ones the
    launcher gives its processes)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}


def _env(**extra: str) -> dict[str, str]:
    # Each run allocates on demand: this process's JAX client (conftest.py's check, or another
    # test file's) may already hold part of each GPU. NVLink multicast (NCCL's NVLS) stays off
    # unless the environment says otherwise: the device machines keep it off (a program using it
    # can take a shared host's GPUs out of service), and two GPUs gain nothing from it.
    return {"NCCL_NVLS_ENABLE": "0", **os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **extra}


def _launch(*args: str) -> subprocess.CompletedProcess:
    """``scripts/launch_local.sh --gpus-per-process 1 2 ARGS...`` with this interpreter: process
    i on GPU i."""
    cmd = ["bash", str(LAUNCH), *LAUNCHER_DEVICES, "--python", sys.executable, "2", *args]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _one_process(*args: str, devices: int) -> subprocess.CompletedProcess:
    """``examples/train_llama.py ARGS...`` in one process that sees the first ``devices`` GPUs."""
    return subprocess.run([sys.executable, str(TRAIN), *args], check=False, cwd=ROOT,
                          env=_env(**_devices_env(devices)), capture_output=True, text=True, timeout=TIMEOUT)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"{' '.join(map(str, r.args))}: exit status {r.returncode}\n{r.stdout[-4000:]}\n" \
                              f"{r.stderr[-6000:]}"
    return r.stdout + r.stderr


def _history(out: Path) -> dict:
    return json.loads((out / "history.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(*flags)``: (one process's run directory on 2 GPUs, two processes' run directory,
    the launcher's stdout: process 0's), each pair trained once per module; a failed pair fails
    every test that asks for it without training again."""
    made = {}

    def get(*flags: str):
        if flags not in made:
            base = tmp_path_factory.mktemp("_".join(f.strip("-").replace("=", "") for f in flags))
            one, two = base / "one", base / "two"
            try:
                _ok(_one_process(*COMMON, *flags, "--out", str(one), devices=2))
                r = _launch(*COMMON, *flags, "--out", str(two))
                _ok(r)
                made[flags] = one, two, r.stdout
            except (AssertionError, subprocess.TimeoutExpired) as e:
                made[flags] = f"training {' '.join(flags)} failed: {e}"
        if isinstance(made[flags], str):
            pytest.fail(made[flags], pytrace=False)
        return made[flags]

    return get


def _max_rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want) / np.abs(want)))


def _check_same_training(one: Path, two: Path, printed: str, rtol: float, label: str) -> None:
    """The two processes' losses and validation losses are the one process's; only process 0
    printed the summary."""
    a, b = _history(one), _history(two)
    print(f"MULTIPROC {label}: max rel diff loss {_max_rel(b['loss'], a['loss']):.3g}, "
          f"val_loss {_max_rel(b['val_loss'], a['val_loss']):.3g}; one process {a['loss']} {a['val_loss']}, "
          f"two processes {b['loss']} {b['val_loss']}")
    assert b["step"] == list(range(6)) and b["val_step"] == [3, 6], b
    both = f"one process: {a}\ntwo processes: {b}"
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=rtol, err_msg=both)
    np.testing.assert_allclose(b["val_loss"], a["val_loss"], rtol=rtol, err_msg=both)
    assert b["loss"][-1] != b["loss"][0]  # it trained
    summary = json.loads((two / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["last_loss"] == pytest.approx(a["loss"][-1], rel=rtol)
    assert "x 2 processes (2 devices)" in printed, printed[-4000:]
    assert sum(line.startswith('{"tokens_per_s"') for line in printed.splitlines()) == 1, printed[-4000:]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["3", "6"]


@pytest.mark.parametrize("mesh", ["data=2", "fsdp=2"])
def test_two_processes_on_two_gpus_train_as_one_process(runs, mesh):
    """One process a GPU (NCCL between the processes): the losses and validation losses of one
    process driving both GPUs on the same mesh."""
    one, two, printed = runs("--mesh", mesh)
    _check_same_training(one, two, printed, RTOL, mesh)


def test_two_processes_on_two_gpus_train_in_fp8_as_one_process(runs):
    """``--fp8`` (the blocks' GEMMs in FP8, delayed scaling: the amax histories are state the
    processes must keep alike) on ``data=2``: the one process's losses."""
    one, two, printed = runs("--mesh", "data=2", "--fp8")
    _check_same_training(one, two, printed, RTOL_FP8, "data=2 fp8")
    assert json.loads((two / "args.json").read_text())["fp8"] is True


def test_a_checkpoint_of_two_processes_resumes_in_one_process_on_one_gpu(runs, tmp_path):
    """The step-3 checkpoint the 2 processes wrote on ``data=2``, restored by one process on one
    GPU (no mesh): steps 3-5 continue as the uninterrupted run, and it checkpoints again."""
    one, two, _ = runs("--mesh", "data=2")
    out = tmp_path / "resumed"
    shutil.copytree(two, out)
    shutil.rmtree(out / "checkpoints" / "6")  # the run as if stopped after step 3's checkpoint
    printed = _ok(_one_process(*COMMON, "--out", str(out), devices=1))
    assert "resumed from step 3" in printed, printed[-4000:]
    got, ref, theirs = _history(out), _history(one), _history(two)
    print(f"MULTIPROC resumed on one GPU: max rel diff loss {_max_rel(got['loss'][3:], ref['loss'][3:]):.3g}, "
          f"val_loss {_max_rel(got['val_loss'], ref['val_loss']):.3g}; resumed {got['loss']} {got['val_loss']}, "
          f"one process on 2 GPUs {ref['loss']} {ref['val_loss']}")
    assert got["step"] == list(range(6)) and got["val_step"] == [3, 6], got
    # steps 0-2 and the step-3 validation: the checkpoint's history, as the 2 processes wrote it
    assert got["loss"][:3] == theirs["loss"][:3] and got["val_loss"][0] == theirs["val_loss"][0]
    both = f"resumed: {got}\none process on 2 GPUs: {ref}"
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=RTOL_ONE_GPU, err_msg=both)
    np.testing.assert_allclose(got["val_loss"], ref["val_loss"], rtol=RTOL_ONE_GPU, err_msg=both)
    assert json.loads((out / "summary.json").read_text())["devices"] == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", "6"]
