"""Worker processes that generate Pallas kernels for the kernel cache in parallel.

Mosaic GPU's code generation is Python (about a second per kernel, under the GIL), so a
step with a dozen distinct kernels lowers them one after another. With the kernel cache on
(:mod:`coda_jax.pallas.kernel_cache`), a kernel it does not hold is sent to one of these
workers while the step is still being traced; the step's lowering then waits for the
entries and reads them from disk. The workers are plain ``python -m
coda_jax.pallas.kernel_workers`` processes (no ``multiprocessing``: a user's script is never
re-imported), started on the first job, on the CPU platform (they never touch the GPU),
and stopped after ``IDLE_SECONDS`` without work.

Protocol: the parent writes a job (8-byte little-endian length, then a pickle of
:class:`Job`), the worker writes the entry to the cache directory and answers one JSON line
(``{"ok": true}`` or ``{"ok": false, "error": "..."}``).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from coda_jax.pallas.kernel_builder import compiled_kernel
from coda_jax.pallas.kernel_entries import export_kernel, write_entry

IDLE_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Job:
    """One kernel to generate: the arguments of
    :func:`~coda_jax.pallas.kernel_builder.compiled_kernel`, the argument types, and the
    cache entry to write."""

    directory: str
    key: str
    epilogue: Any
    shape: Any
    config: Any
    load_dtypes: tuple
    avals: tuple[tuple[tuple[int, ...], str], ...]
    latency_ns: int | None = None  # the scheduler's hint (coda_jax.lowering.with_latency_hint)


def run_job(job: Job) -> None:
    """Generates the job's kernel (the one ``PallasLowering`` builds) and writes its cache
    entry (in a worker)."""
    kernel = compiled_kernel(job.epilogue, job.shape, job.config, False, job.load_dtypes, job.latency_ns)
    avals = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in job.avals]
    write_entry(Path(job.directory), job.key, export_kernel(kernel, avals))


class KernelWorkers:
    """``n`` worker processes, each served by a thread of this process."""

    def __init__(self, n: int):
        self._jobs: queue.Queue = queue.Queue()
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        for i in range(n):
            threading.Thread(target=self._serve, name=f"coda-jax-kernel-worker-{i}", daemon=True).start()
        atexit.register(self.close)

    def submit(self, job: Job) -> Future:
        """Queues ``job``; the future's result is None once the entry is on disk, or the
        worker's error (a ``RuntimeError``)."""
        data = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)  # raises here if it cannot travel
        fut: Future = Future()
        self._jobs.put((data, fut))
        return fut

    def close(self) -> None:
        with self._lock:
            procs, self._procs = self._procs, []
        for p in procs:
            _stop(p)

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.pop("CODA_JAX_PALLAS_INTERPRET", None)
        log = tempfile.TemporaryFile()  # the worker's stderr: its tail explains a crash
        p = subprocess.Popen([sys.executable, "-m", "coda_jax.pallas.kernel_workers"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=log, env=env)
        p.log = log
        with self._lock:
            self._procs.append(p)
        return p

    def _retire(self, proc: subprocess.Popen) -> None:
        """Stops ``proc`` and forgets it."""
        with self._lock:
            if proc in self._procs:
                self._procs.remove(proc)
        _stop(proc)

    def _serve(self) -> None:
        proc = None
        while True:
            try:
                data, fut = self._jobs.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                if proc is not None:  # idle: give the memory back
                    self._retire(proc)
                    proc = None
                continue
            try:
                if proc is None or proc.poll() is not None:
                    proc = self._start()
                proc.stdin.write(struct.pack("<Q", len(data)) + data)
                proc.stdin.flush()
                line = proc.stdout.readline()
                if not line:
                    code = proc.wait()
                    raise RuntimeError(f"the kernel worker exited (code {code}): {_tail(proc)}")
                reply = json.loads(line)
                if reply.get("ok"):
                    fut.set_result(None)
                else:
                    fut.set_exception(RuntimeError(reply.get("error", "unknown error")))
            except Exception as err:  # noqa: BLE001 - reported through the future
                if proc is not None:
                    self._retire(proc)
                    proc = None
                fut.set_exception(RuntimeError(f"kernel worker failed: {err}"))


def _tail(proc: subprocess.Popen, size: int = 2000) -> str:
    """The end of a worker's stderr."""
    try:
        proc.log.seek(0, os.SEEK_END)
        proc.log.seek(max(0, proc.log.tell() - size))
        return proc.log.read().decode(errors="replace").strip() or "(no output)"
    except Exception:  # noqa: BLE001
        return "(no output)"


def _stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except Exception:  # noqa: BLE001
        proc.kill()
    finally:
        proc.log.close()


def _worker_main() -> None:
    # The protocol owns the original stdout; anything else printed goes to stderr.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    stdin = sys.stdin.buffer
    while True:
        header = stdin.read(8)
        if len(header) < 8:
            return
        (size,) = struct.unpack("<Q", header)
        try:
            run_job(pickle.loads(stdin.read(size)))
            reply = {"ok": True}
        except Exception:  # noqa: BLE001 - sent back to the parent
            reply = {"ok": False, "error": traceback.format_exc(limit=8)[-4000:]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _worker_main()
