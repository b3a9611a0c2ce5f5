#!/usr/bin/env bash
# The ONE device script: GPU tests + benchmarks in a single run on the H100 (device tool).
#   bash benchmarks/gpu_suite.sh [bench.py args...]
# Sections (env): SKIP_TESTS=1 (GPU_TESTS="files" to choose, GPU_TESTS_K="pytest -k expression", GPU_TEST_WORKERS=N xdist processes, default 6 where installed; TEST_TIMEOUT, default 480 s: run 79's
# 230 s cut the full GPU test files at 53 %), SKIP_BENCH=1; TUNE=1 runs the
# Pallas config sweep (benchmarks/tune.py, TUNE_ARGS); TRAIN_STEPS=N (default 0: skip) trains
# examples/train_llama.py on every backend (TRAIN_ARGS, default the 1b preset) and compares
# the loss curves (benchmarks/compare_losses.py; the first run is the reference).
# TRAIN_BACKENDS="xla xla cutedsl cutedsl:CODA_JAX_CUTEDSL_SCHEDULE=pingpong" picks the runs: an
# entry "backend:VAR=VALUE[,VAR=VALUE]" trains under those environment settings (a variant); a
# repeated entry is a rerun (label <spec>_run2), which measures run-to-run noise. PROFILE=1 profiles the block's fwd+bwd per
# kernel (benchmarks/profile_block.py, PROFILE_ARGS; "--model 1b --layers 4" profiles a training step;
# "--model 1b --mesh data=2 --batch 16" the step on all GPUs, per GPU, with the NCCL kernels' overlap).
# REPEAT_PROBE="cutedsl cutedsl xla xla" runs one training step per entry, each in its own process,
# and names the blocks / gradients whose bits differ between processes (benchmarks/repeat_probe.py).
# STEP_BENCH="1b:8:1024 8b-4:4:1024" times the train step of CodaLlama per backend against the
# plain JAX Llama in one process per configuration (benchmarks/train_step_bench.py, STEP_RUNS;
# STEP_REMAT=block runs every model with its blocks rematerialized (LlamaConfig.remat);
# STEP_HLO=1 writes each run's compiled step to $OUT/hlo/ (train_step_bench.py --hlo-out);
# STEP_PROFILE=1 also traces each run's whole step, optimizer included, and prints its kernel classes
# and the bounds on its ratio to plain JAX (benchmarks/step_ceiling.py);
# a run "pallas:VAR=VALUE" runs under one setting, e.g. CODA_JAX_LATENCY_HINTS=1, JAX_ENABLE_PGLE=1 or
# PGLE_AOT=3; on a mesh the SCHEDULE lines say what XLA's schedule overlaps with each collective).
# COMPILE_CACHE="1b:8:1024" compiles that train step in two fresh processes sharing JAX's persistent
# compilation cache (cold, then warm) and prints each run's compile time.
# COMPILE_TIME="1b:8:1024" times the first train step's stages (trace, lower, compile, run) per
# backend in fresh processes, cold and warm cache (benchmarks/compile_time.py, COMPILE_BACKENDS;
# add pallas@kernel_cache to time coda-jax's kernel cache, CODA_JAX_KERNEL_CACHE_WORKERS its workers).
# GRAD_PROBE=1 prints each backend's error per gradient of one training step against float32
# math (benchmarks/grad_error_probe.py, GRAD_PROBE_ARGS).
# NCU_PROGRAMS="label;label" runs Nsight Compute on those epilogue-benchmark kernels (NCU_BACKEND;
# NCU_SOURCE=1: also warp-stall samples per SASS instruction, benchmarks/sass_hotspots.py).
# Writes logs and results under $OUT (default ./gpu_out) and prints a short table last. Exits with
# the GPU tests' pytest status (else the shape fuzz's; 0 when neither ran), not the last summary line's.
# CuTeDSL: if .whl/cutlass_dsl.tar.zst was carried, it is unpacked and the backend is added.
# FUZZ=1 runs the GPU shape fuzz after the GPU tests (tests/test_gpu_shape_fuzz.py: FUZZ_SEED,
# FUZZ_OPS, FUZZ_MODELS, FUZZ_BACKENDS; FUZZ_ROUTING=default keeps the routing rules at the
# library's defaults, which the test suite otherwise turns off: tests/conftest.py).
set -uo pipefail
suite_rc=0  # the exit status: the GPU tests' pytest status, else the shape fuzz's (124: timed out)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
BACKENDS="xla,pallas"
# A run spec "backend[:VAR=VALUE[,VAR=VALUE]]" (TRAIN_BACKENDS, REPEAT_PROBE) -> $b and ${settings[@]}.
split_spec() { b="${1%%:*}"; settings=(); [[ $1 == *:* ]] && IFS=',' read -ra settings <<< "${1#*:}"; }
if [ -s .whl/cutlass_dsl.tar.zst ]; then
  mkdir -p /tmp/site && (cd /tmp/site && "$ROOT/.whl/zstd" -dc --long=28 "$ROOT/.whl/cutlass_dsl.tar.zst" | tar xf -)
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
  BACKENDS="$BACKENDS,cutedsl"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
echo "== GPU tests ==" | tee "$OUT/tests.log"
# GPU_TEST_WORKERS=N: the GPU tests and the shape fuzz run in N pytest-xdist processes sharing
# the GPU (they are bound by the kernels' lowering on the CPU), each allocating on demand.
# Default: 6 where pytest-xdist is installed (runs 162-163: 217 Pallas tests in 142 s, 59
# CuTeDSL in 95 s); 0 = one process.
if [ -z "${GPU_TEST_WORKERS+x}" ]; then
  GPU_TEST_WORKERS=0; python3 -c "import xdist" 2>/dev/null && GPU_TEST_WORKERS=6
fi
xdist=(); test_env=()
[ "$GPU_TEST_WORKERS" != 0 ] && xdist=(-n "$GPU_TEST_WORKERS") && test_env=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
if [ -z "${SKIP_TESTS:-}" ]; then
  if [ -z "${GPU_TESTS:-}" ]; then
    GPU_TESTS="tests/test_gpu_pallas.py"; [[ $BACKENDS == *cutedsl* ]] && GPU_TESTS="$GPU_TESTS tests/test_gpu_cutedsl.py"
    # data / FSDP / tensor parallel against one GPU; skips itself on a machine with one GPU
    GPU_TESTS="$GPU_TESTS tests/test_gpu_multi.py"
  fi
  # GPU_TESTS_K: a pytest -k expression (it may contain spaces; GPU_TESTS is split on them).
  # -v into tests_full.log: one line per finished test, so a run stopped by TEST_TIMEOUT still
  # names what passed (pytest prints no summary then); its last 40 lines and the counts go
  # to tests.log.
  env "${test_env[@]}" timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -v -m gpu "${xdist[@]}" $GPU_TESTS \
    ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} -p no:cacheprovider > "$OUT/tests_full.log" 2>&1
  suite_rc=$?
  { grep -v "PASSED\|SKIPPED\|Warning\|warner(" "$OUT/tests_full.log" | tail -n 40
    echo "test lines: $(grep -c ' PASSED' "$OUT/tests_full.log") PASSED, $(grep -c ' FAILED' "$OUT/tests_full.log") FAILED," \
      "$(grep -c ' ERROR' "$OUT/tests_full.log") ERROR, $(grep -c ' SKIPPED' "$OUT/tests_full.log") SKIPPED" \
      "(pytest status $suite_rc; 124: stopped by TEST_TIMEOUT)"; } | tee -a "$OUT/tests.log"
fi
if [ -n "${FUZZ:-}" ]; then
  # Seeded ragged shapes per op and for a 2-layer model, every backend against float32 math.
  echo "== shape fuzz (seed ${FUZZ_SEED:-0}, routing rules ${FUZZ_ROUTING:-off}) ==" | tee "$OUT/fuzz.log"
  # -v: one line per finished test, so a run stopped by its timeout still names what passed.
  env "${test_env[@]}" FUZZ_BACKENDS="${FUZZ_BACKENDS:-$BACKENDS}" CODA_JAX_TESTS_ROUTING="${FUZZ_ROUTING:-off}" timeout "${FUZZ_TIMEOUT:-480}" python3 -m pytest -v -s \
    -m gpu "${xdist[@]}" tests/test_gpu_shape_fuzz.py -p no:cacheprovider 2>&1 | grep -v Warning \
    | grep -E 'PASSED|FAILED|ERROR|SKIPPED|passed|failed|rel err|Error' | tail -n 150 | tee -a "$OUT/fuzz.log"
  fuzz_rc=${PIPESTATUS[0]}; [ "$suite_rc" = 0 ] && suite_rc=$fuzz_rc
fi
if [ -n "${TUNE:-}" ]; then
  echo "== tuning sweep =="
  timeout "${TUNE_TIMEOUT:-300}" python3 benchmarks/tune.py --out "$OUT" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | grep -v '^{' | tail -n 40
fi
if [ -n "${PROFILE:-}" ]; then
  # PROFILE_ARGS: profile_block.py arguments; several profiles separated by ';'
  # (e.g. "--op lm_head_ce --backends plain,xla,pallas;--model 1b --backends plain,pallas").
  echo "== block profile ==" | tee "$OUT/profile.log"
  IFS=';' read -ra PROFILE_LIST <<< "${PROFILE_ARGS:-}"; [ ${#PROFILE_LIST[@]} -eq 0 ] && PROFILE_LIST=("")
  for pa in "${PROFILE_LIST[@]}"; do
    timeout "${PROFILE_TIMEOUT:-240}" python3 benchmarks/profile_block.py --out "$OUT" --backends "$BACKENDS" $pa 2>&1 \
      | tee -a "$OUT/profile.log" | tail -n 120
  done
fi
if [ -n "${COMPILE_TIME:-}" ]; then
  # COMPILE_TIME="1b:8:1024" (preset[-layers]:batch:seq): the first train step's stages (trace,
  # lower, compile, first run) per backend, two fresh processes each sharing JAX's persistent
  # cache (benchmarks/compile_time.py); COMPILE_BACKENDS (default plain,<backends>).
  echo "== compile time ==" | tee "$OUT/compile_time.log"
  IFS=':' read -r preset_layers ct_batch ct_seq <<< "$COMPILE_TIME"
  ct_layers=(); [[ $preset_layers == *-* ]] && ct_layers=(--layers "${preset_layers#*-}")
  # The step modules of every process go to /tmp/coda_jax_ct_hlo; the log says, per backend and step,
  # whether the processes lowered the same module (else $OUT gets the diff).
  rm -rf /tmp/coda_jax_ct_cache /tmp/coda_jax_ct_hlo
  timeout "${COMPILE_TIMEOUT:-300}" python3 benchmarks/compile_time.py --backends "${COMPILE_BACKENDS:-plain,$BACKENDS}" \
    --preset "${preset_layers%%-*}" "${ct_layers[@]}" --batch "$ct_batch" --seq "$ct_seq" --cache-dir /tmp/coda_jax_ct_cache \
    --dump-hlo /tmp/coda_jax_ct_hlo --out "$OUT/compile_time.json" 2>&1 | tee -a "$OUT/compile_time.log" | grep -v '^[-+@ ]' | tail -n 20
  cp /tmp/coda_jax_ct_hlo/*.diff "$OUT/" 2>/dev/null
fi
if [ -n "${NCU_PROGRAMS:-}" ]; then
  # Nsight Compute on one kernel launch per program label (benchmarks/kernel_probe.py), e.g.
  # NCU_PROGRAMS="identity dgrad;rms_dgrad_res dgrad" NCU_BACKEND=cutedsl.
  echo "== ncu (${NCU_BACKEND:-cutedsl}) ==" | tee "$OUT/ncu.log"
  # NCU_SOURCE=1 also samples warp stalls per SASS instruction (SourceCounters) and prints
  # where each kernel's warps wait, per opcode and per instruction (benchmarks/sass_hotspots.py).
  IFS=';' read -ra NCU_LIST <<< "$NCU_PROGRAMS"
  n_ncu=0
  for p in "${NCU_LIST[@]}"; do
    echo "-- $p" | tee -a "$OUT/ncu.log"
    n_ncu=$((n_ncu + 1)); rep=(); src=()
    [ -n "${NCU_SOURCE:-}" ] && rep=(-o "/tmp/coda_ncu_$n_ncu" -f) && src=(--section SourceCounters)
    timeout "${NCU_TIMEOUT:-180}" ncu --clock-control none -k "regex:${NCU_KERNEL:-coda_}" -c 1 --section SpeedOfLight \
      --section LaunchStats --section WarpStateStats --section SchedulerStats --section Occupancy --section MemoryWorkloadAnalysis \
      "${src[@]}" "${rep[@]}" python3 benchmarks/kernel_probe.py "$p" --backend "${NCU_BACKEND:-cutedsl}" --iters 2 2>&1 \
      | grep -v '^==PROF==\|^\s*$\|Warning' >> "$OUT/ncu.log"
    if [ -n "${NCU_SOURCE:-}" ]; then
      ncu --import "/tmp/coda_ncu_$n_ncu.ncu-rep" --page details >> "$OUT/ncu.log" 2>&1
      ncu --import "/tmp/coda_ncu_$n_ncu.ncu-rep" --page source --csv --print-source sass > "/tmp/coda_ncu_$n_ncu.csv" 2>/dev/null
      python3 benchmarks/sass_hotspots.py "/tmp/coda_ncu_$n_ncu.csv" --top "${NCU_TOP:-25}" 2>&1 | grep -v '^columns' \
        | tee -a "$OUT/ncu_source.log" | head -n 30
    fi
  done
  grep -E -- '^-- |Context|Cluster Size|Grid Size|Block Size|Dynamic Shared|Waves Per SM|Registers Per|Duration|Compute \(SM\) Throughput|Memory Throughput|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall' "$OUT/ncu.log" | head -120
fi
if [ -n "${REPEAT_PROBE:-}" ]; then
  # One training step's digests per process (benchmarks/repeat_probe.py), e.g.
  # REPEAT_PROBE="cutedsl cutedsl xla xla": which block or gradient differs between processes.
  echo "== repeatability probe ==" | tee "$OUT/repeat.log"
  PROBE_DIR=/tmp/coda_repeat; rm -rf "$PROBE_DIR"; mkdir -p "$PROBE_DIR"; n=0
  for spec in $REPEAT_PROBE; do
    split_spec "$spec"
    n=$((n + 1)); echo "-- $n $spec" | tee -a "$OUT/repeat.log"
    env ${settings[@]+"${settings[@]}"} timeout "${REPEAT_TIMEOUT:-150}" python3 benchmarks/repeat_probe.py --backend "$b" \
      ${REPEAT_ARGS:-} --out "$PROBE_DIR/p$n.json" 2>&1 | tail -n 3 | tee -a "$OUT/repeat.log"
  done
  ls "$PROBE_DIR"/p*.json >/dev/null 2>&1 && python3 benchmarks/repeat_probe.py --compare "$PROBE_DIR"/p*.json | tee "$OUT/repeat.md"
fi
if [ -n "${GRAD_PROBE:-}" ]; then
  # One training step's error per gradient against float32 math, per backend
  # (benchmarks/grad_error_probe.py; GRAD_PROBE_ARGS, default every backend, 4 layers of the 1b preset).
  echo "== gradient error probe ==" | tee "$OUT/grad_errors.md"
  timeout "${GRAD_PROBE_TIMEOUT:-300}" python3 benchmarks/grad_error_probe.py ${GRAD_PROBE_ARGS:---backends $BACKENDS --layers 4} \
    2>&1 | tail -n 20 | tee -a "$OUT/grad_errors.md"
fi
if [ -n "${STEP_BENCH:-}" ]; then
  # Train-step tokens/s of CodaLlama per backend against the plain JAX Llama, in one process per
  # configuration (benchmarks/train_step_bench.py). STEP_BENCH="1b:8:1024 8b-4:4:1024 1b:16:1024:fsdp=2" lists
  # preset[-layers]:batch:seq[:mesh[:explicit]] (mesh: data=N,fsdp=M over all GPUs, Auto axes unless
  # ":explicit" follows; batch is global); STEP_RUNS the runs (default: plain, every backend, Pallas with the
  # cross-entropy recomputing its logits, plain again to show the drift).
  echo "== train step vs plain JAX ==" | tee "$OUT/train_step.log"
  RUNS_DEFAULT="plain,${BACKENDS},pallas:CODA_JAX_CE_SAVE_LOGITS=0,plain"
  for cfg in $STEP_BENCH; do
    IFS=':' read -r preset_layers sb_batch sb_seq sb_mesh sb_mesh_type <<< "$cfg"
    sb_preset="${preset_layers%%-*}"; sb_layers=(); [[ $preset_layers == *-* ]] && sb_layers=(--layers "${preset_layers#*-}")
    sb_mesh_arg=(); [ -n "${sb_mesh:-}" ] && sb_mesh_arg=(--mesh "$sb_mesh" --mesh-type "${sb_mesh_type:-auto}")
    timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/train_step_bench.py --preset "$sb_preset" "${sb_layers[@]}" "${sb_mesh_arg[@]}" \
      --batch "$sb_batch" --seq "$sb_seq" --runs "${STEP_RUNS:-$RUNS_DEFAULT}" --out "$OUT" ${STEP_PROFILE:+--profile} \
      ${STEP_REMAT:+--remat "$STEP_REMAT"} ${STEP_HLO:+--hlo-out "$OUT/hlo"} 2>&1 \
      | grep -v '^{' | tee -a "$OUT/train_step.log" | tail -n 14
    [ -n "${STEP_PROFILE:-}" ] && grep '^PROFILE' "$OUT/train_step.log" | tail -n 60
  done
  # Each profiled step by part (GEMMs, attention, optimizer, casts, other passes) and the
  # bounds on its ratio to plain JAX (benchmarks/step_ceiling.py).
  [ -n "${STEP_PROFILE:-}" ] && python3 benchmarks/step_ceiling.py "$OUT" | tee "$OUT/step_ceiling.md"
fi
if [ -n "${COMPILE_CACHE:-}" ]; then
  # JAX's persistent compilation cache across processes: the same train step compiled by two
  # fresh processes sharing JAX_COMPILATION_CACHE_DIR; the second should skip the compile.
  # COMPILE_CACHE="1b:8:1024" (preset[-layers]:batch:seq), CACHE_RUNS (default plain,<backends>).
  echo "== persistent compilation cache ==" | tee "$OUT/compile_cache.log"
  IFS=':' read -r preset_layers cc_batch cc_seq <<< "$COMPILE_CACHE"
  cc_preset="${preset_layers%%-*}"; cc_layers=(); [[ $preset_layers == *-* ]] && cc_layers=(--layers "${preset_layers#*-}")
  CACHE_DIR=/tmp/coda_jax_cache; rm -rf "$CACHE_DIR"
  for attempt in cold warm; do
    echo "-- $attempt" | tee -a "$OUT/compile_cache.log"
    JAX_COMPILATION_CACHE_DIR="$CACHE_DIR" timeout "${CACHE_TIMEOUT:-240}" python3 benchmarks/train_step_bench.py \
      --preset "$cc_preset" "${cc_layers[@]}" --batch "$cc_batch" --seq "$cc_seq" --steps 1 --rounds 1 \
      --runs "${CACHE_RUNS:-plain,$BACKENDS}" 2>&1 | grep '^| \|RUN FAILED' | tee -a "$OUT/compile_cache.log"
  done
  du -sh "$CACHE_DIR" | tee -a "$OUT/compile_cache.log"
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  echo "== benchmarks ($BACKENDS) =="
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench.py --out "$OUT" --backends "$BACKENDS" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -n 60
fi
if [ "${TRAIN_STEPS:-0}" -gt 0 ]; then
  # Run directories stay outside $OUT (the device returns at most 8 files): $OUT gets one log,
  # the comparison table and every run's per-step losses (train_curves.json).
  echo "== training ==" | tee "$OUT/train.log"
  TRAIN_DIR="${TRAIN_DIR:-/tmp/coda_train}"; rm -rf "$TRAIN_DIR"; mkdir -p "$TRAIN_DIR"
  RUNS=()
  for spec in ${TRAIN_BACKENDS:-${BACKENDS//,/ }}; do
    split_spec "$spec"
    label="$(printf '%s' "$spec" | tr -c 'A-Za-z0-9_.-' '_')"; i=2; base="$label"
    while [ -e "$TRAIN_DIR/train_$label" ]; do label="${base}_run$i"; i=$((i + 1)); done  # a rerun of one spec
    echo "-- $label" | tee -a "$OUT/train.log"
    env ${settings[@]+"${settings[@]}"} timeout "${TRAIN_TIMEOUT:-300}" python3 examples/train_llama.py --backend "$b" --steps "$TRAIN_STEPS" \
      ${TRAIN_ARGS:---preset 1b --batch 8 --seq 1024 --lr 3e-4 --warmup 30} --ckpt-every 0 --no-resume \
      --out "$TRAIN_DIR/train_$label" 2>&1 | tr '\r' '\n' | grep -v '^ *[0-9]*%\|it/s\]$' | tail -n 5 | tee -a "$OUT/train.log"
    [ -f "$TRAIN_DIR/train_$label/history.json" ] && RUNS+=("$TRAIN_DIR/train_$label")
  done
  [ "${#RUNS[@]}" -gt 1 ] && python3 benchmarks/compare_losses.py --curves "$OUT/train_curves.json" "${RUNS[@]}" | tee "$OUT/train_compare.md"
fi
echo "== summary =="
grep '^BEST\|^SWEEP\|^MAINLOOP\|^PLAIN' "$OUT/tune.log" 2>/dev/null
tail -n 3 "$OUT/tests.log"
cat "$OUT/table.md" 2>/dev/null
cat "$OUT/train_step.md" 2>/dev/null
cat "$OUT/compile_cache.log" 2>/dev/null
cat "$OUT/repeat.md" 2>/dev/null
cat "$OUT/grad_errors.md" 2>/dev/null
cat "$OUT/train_compare.md" 2>/dev/null
# The device tool returns at most 8 files, the first in path order (runs 293 and 295 lost a
# tuned table that way): with more, one archive of all of them, named to sort first.
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/_gpu_suite_all.tgz -C "$OUT" . && mv /tmp/_gpu_suite_all.tgz "$OUT/0_all.tgz" \
    && echo "(more than 8 files under \$OUT: all of them in \$OUT/0_all.tgz)"
fi
exit "$suite_rc"
