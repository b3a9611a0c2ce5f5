"""First-step compile time per backend, and whether a second process skips the compile.

    python -m benchmarks.compile_time --backends xla,pallas,cutedsl --preset 1b --layers 16 \\
        --batch 8 --seq 1024 --cache-dir /tmp/jax_cache --out compile_time.json

For each backend (``plain``: the plain JAX Llama of ``plain_llama.py``), two fresh processes
(``--runs``) each build the model of ``examples/train_llama.py`` (its config and first batch,
``first_step.py``; its functional jitted steps, ``coda_jax.training.make_steps``) and time

* ``train_first_s``: the first call of the jitted train step, and its stages:
  ``train_trace_s`` (Python -> jaxpr), ``train_lower_s`` (-> StableHLO; the kernels'
  Mosaic GPU / CuTeDSL code generation runs here; ``train_hlo_mb`` is the module's size),
  ``train_compile_s`` (XLA, or the persistent cache's hit), ``train_first_run_s``,
* ``train_next_s``: the second call (run only),
* ``eval_first_s`` / ``eval_next_s``: the same for the evaluation step (forward loss),

and count JAX's persistent-cache hits and misses (``jax.monitoring`` events). With
``--cache-dir`` the cache is on (every entry kept: minimum compile time 0, any size), so the
second process's ``*_first_s`` minus ``*_next_s`` is the compile time the cache saves. A
backend named ``pallas@kernel_cache`` (``cutedsl@kernel_cache``) is ``pallas`` (``cutedsl``)
with coda-jax's kernel caches on where they are by default, beside JAX's cache under
``--cache-dir`` (``coda_jax/pallas/kernel_cache.py``: a warm process skips Mosaic GPU's code
generation; ``coda_jax/ffi/kernel_cache.py``: CuTeDSL's compile, which runs while JAX lowers,
before JAX's cache is asked); every other backend runs with them off. Its results add
``kernel_cache_hits`` / ``kernel_cache_misses``. Prints one JSON line per
process.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_CALL_STAGES = ("trace", "lower", "compile", "first_run")
CACHE_EVENTS = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses")
BACKENDS = ("plain", "xla", "pallas", "cutedsl", "pallas@kernel_cache", "cutedsl@kernel_cache")
KERNEL_CACHE_SUFFIX = "@kernel_cache"


def enable_persistent_cache(cache_dir: str) -> None:
    """JAX's persistent compilation cache in ``cache_dir``, keeping every entry."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def child(args) -> dict:
    """One process: time the first and second train / eval step of one backend."""
    if args.cache_dir:
        enable_persistent_cache(args.cache_dir)
    import jax
    import optax
    from flax import nnx

    from benchmarks.first_step import config_and_first_batch
    from coda_jax import training
    from coda_jax.layers import CodaLlama

    counts = dict.fromkeys(CACHE_EVENTS, 0)

    def on_event(name, **_):
        if name in counts:
            counts[name] += 1

    jax.monitoring.register_event_listener(on_event)
    cfg, inputs, targets = config_and_first_batch(args.preset, args.layers, args.batch, args.seq)
    backend = args.backend.removesuffix(KERNEL_CACHE_SUFFIX)
    if args.lower_only and backend != "plain":
        # Lowering for CUDA needs no GPU: let the kernel backend trace on this machine.
        from coda_jax import backend as backends

        real = backends.backend_unavailable_reason
        backends.backend_unavailable_reason = lambda n: None if n == backend else real(n)

    def build():
        if backend == "plain":
            from benchmarks.plain_llama import PlainLlama

            model = PlainLlama(cfg, rngs=nnx.Rngs(0))
        else:
            model = CodaLlama(cfg, rngs=nnx.Rngs(0), backend=backend)
        return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    # --lower-only: abstract parameters (a 1B model's state needs no memory to lower).
    model, optimizer = nnx.eval_shape(build) if args.lower_only else build()
    train_step, eval_step, _ = training.make_steps(model, optimizer)
    state = nnx.state((model, optimizer))
    del model, optimizer
    if args.lower_only:
        return _lower_only(args, train_step, state, inputs, targets)

    res = {"backend": args.backend, "preset": args.preset, "layers": cfg.num_layers, "batch": args.batch,
           "seq": args.seq, "cache": bool(args.cache_dir)}
    for name, fn in (("train", train_step), ("eval", eval_step)):
        # Stages of the first call: trace (Python -> jaxpr), lower (jaxpr -> StableHLO: the
        # kernels' Mosaic GPU / CuTeDSL code generation runs here), compile (XLA, and the
        # persistent cache's lookup), then the first run; then a second call (run only).
        # One clock stamp between stages, so the stages add up to the first call exactly
        # (before each is rounded to the millisecond).
        stamps = [time.perf_counter()]
        traced = fn.trace(state, inputs, targets)
        stamps.append(time.perf_counter())
        lowered = traced.lower()
        stamps.append(time.perf_counter())
        compiled = lowered.compile()
        stamps.append(time.perf_counter())
        out = compiled(state, inputs, targets)
        jax.block_until_ready(out)
        stamps.append(time.perf_counter())
        for stage, t0, t1 in zip(FIRST_CALL_STAGES, stamps, stamps[1:]):
            res[f"{name}_{stage}_s"] = round(t1 - t0, 3)
        res[f"{name}_first_s"] = round(stamps[-1] - stamps[0], 3)
        res |= _module_facts(name, lowered, args.backend, args.dump_hlo)
        if name == "train":
            state = out[0]
            # Committed results make the next call of the jitted step trace and compile again.
            res["train_out_committed"] = any(getattr(x, "committed", False) for x in jax.tree.leaves(state))
        t = time.perf_counter()
        out = compiled(state, inputs, targets)
        jax.block_until_ready(out)
        res[f"{name}_next_s"] = round(time.perf_counter() - t, 3)
        if name == "train":
            state = out[0]
    res["cache_hits"], res["cache_misses"] = (counts[e] for e in CACHE_EVENTS)
    return res | _kernel_cache_counts(args)


def _module_facts(name: str, lowered, backend: str, dump_dir: str | None = None) -> dict:
    """The lowered step's size, its number of Mosaic GPU kernel calls, and a digest of it
    without debug info (what JAX's persistent cache keys on, with the compile options): two
    processes with the same digest share the cached executable. ``dump_dir``: also write that text there, named by backend, step and
    digest (to diff two processes whose digests differ)."""
    text = lowered.as_text(debug_info=False)
    sha = hashlib.sha256(text.encode()).hexdigest()[:12]
    if dump_dir:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        (Path(dump_dir) / f"{backend.replace('@', '_')}_{name}_{sha}.mlir").write_text(text)
    full = lowered.as_text()
    return {f"{name}_hlo_mb": round(len(full) / 1e6, 2), f"{name}_hlo_sha": sha,
            f"{name}_kernel_custom_calls": full.count("@mosaic_gpu")}


def _kernel_cache_counts(args) -> dict:
    """The kernel cache's hits and misses, for a ``pallas@kernel_cache`` or ``cutedsl@kernel_cache`` process."""
    if not args.backend.endswith(KERNEL_CACHE_SUFFIX):
        return {}
    if args.backend.startswith("cutedsl"):
        from coda_jax.ffi.kernel_cache import active_cache as active_kernel_cache
    else:
        from coda_jax.pallas.kernel_cache import active_kernel_cache
    kc = active_kernel_cache()
    return {"kernel_cache_hits": kc.stats.hits if kc else 0, "kernel_cache_misses": kc.stats.misses if kc else 0}


def _lower_only(args, train_step, state, inputs, targets) -> dict:
    """Trace and lower the train step for CUDA (no compile, no run; works on a CPU)."""
    res = {"backend": args.backend, "preset": args.preset, "batch": args.batch, "seq": args.seq,
           "lower_only": True}
    t = time.perf_counter()
    traced = train_step.trace(state, inputs, targets)
    res["train_trace_s"] = round(time.perf_counter() - t, 3)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=("cuda",))
    res["train_lower_s"] = round(time.perf_counter() - t1, 3)
    res["train_trace_lower_s"] = round(time.perf_counter() - t, 3)
    res |= _module_facts("train", lowered, args.backend, args.dump_hlo)
    return res | _kernel_cache_counts(args)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="xla,pallas", type=lambda s: [b for b in s.split(",") if b])
    p.add_argument("--backend", help=argparse.SUPPRESS)  # set in the child processes
    p.add_argument("--preset", default="1b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--runs", type=int, default=2, help="processes per backend (the 2nd finds the 1st's cache)")
    p.add_argument("--cache-dir", default=None, help="turn JAX's persistent compilation cache on, here")
    p.add_argument("--lower-only", action="store_true",
                   help="only trace and lower the train step for CUDA (no GPU needed): times Mosaic GPU's code generation")
    p.add_argument("--out", type=Path, default=None, help="write every process's result here (JSON)")
    p.add_argument("--dump-hlo", default=None,
                   help="write each lowered step (StableHLO without debug info) here, named by backend, step and digest")
    args = p.parse_args(argv)
    for flag in ("batch", "seq", "runs"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    unknown = [b for b in args.backends if b not in BACKENDS]
    if not args.backends or unknown:
        p.error(f"--backends must name {', '.join(BACKENDS)}, got {args.backends}")
    if any(b.endswith(KERNEL_CACHE_SUFFIX) for b in args.backends) and not args.cache_dir and not args.backend:
        p.error(f"--backends {KERNEL_CACHE_SUFFIX[1:]} variants need --cache-dir (the kernel cache lives under it)")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.backend:
        print(json.dumps(child(args)), flush=True)
        return []
    results = []
    for backend in args.backends:
        for run in range(args.runs):
            cmd = [sys.executable, "-m", "benchmarks.compile_time", "--backend", backend, "--preset", args.preset,
                   "--batch", str(args.batch), "--seq", str(args.seq)]
            if args.layers is not None:
                cmd += ["--layers", str(args.layers)]
            if args.dump_hlo:
                cmd += ["--dump-hlo", args.dump_hlo]
            # The child imports this package from the repository root, wherever it runs.
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
            if args.lower_only:
                cmd += ["--lower-only"]
                env.pop("CODA_JAX_PALLAS_INTERPRET", None)  # the compiled kernels, not the interpreter
            if args.cache_dir:
                cmd += ["--cache-dir", args.cache_dir]
            # The kernel cache's default: on beside JAX's persistent cache (--cache-dir). The
            # @kernel_cache variant gets that default, every other backend runs without it.
            env.pop("CODA_JAX_KERNEL_CACHE_DIR", None)
            if not backend.endswith(KERNEL_CACHE_SUFFIX):
                env["CODA_JAX_KERNEL_CACHE_DIR"] = "off"
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"{backend} run {run} failed:\n{out.stderr[-4000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1]) | {"run": run + 1}
            print(json.dumps(res), flush=True)
            results.append(res)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.dump_hlo:
        diff_dumps(results, Path(args.dump_hlo))
    return results


def diff_dumps(results: list[dict], dump_dir: Path, lines: int = 60) -> None:
    """Per backend and step: did every process lower the same module? If not, writes the
    unified diff of the first two that differ to ``<dump_dir>/<backend>_<step>.diff`` and
    prints its first ``lines`` lines (long lines cut)."""
    import difflib

    for backend in dict.fromkeys(r["backend"] for r in results):
        for step in ("train", "eval"):
            shas = list(dict.fromkeys(r[f"{step}_hlo_sha"] for r in results
                                      if r["backend"] == backend and f"{step}_hlo_sha" in r))
            if not shas:
                continue
            print(f"{backend} {step}: {'same module in every process' if len(shas) == 1 else 'modules differ'} "
                  f"({', '.join(shas)})")
            if len(shas) < 2:
                continue
            name = backend.replace("@", "_")
            a, b = ((dump_dir / f"{name}_{step}_{sha}.mlir").read_text().splitlines() for sha in shas[:2])
            diff = list(difflib.unified_diff(a, b, shas[0], shas[1], n=1, lineterm=""))
            (dump_dir / f"{name}_{step}.diff").write_text("\n".join(diff))
            print("\n".join(line[:300] for line in diff[:lines]))


if __name__ == "__main__":
    main()
