#!/usr/bin/env bash
# The benchmarks of record on the device: each backend against plain JAX, then the summary.
#   bash benchmarks/gpu_bench.sh [bench.py arguments...]
# 1. the train step, CodaLlama per backend against the plain JAX Llama in one process per
#    configuration (python -m benchmarks.train_step_bench; train_step.json, train_step.md);
# 2. the fused ops, the GEMM, the cross-entropy's memory and the block against their plain
#    baselines (python -m benchmarks.bench --backends plain,<backends>, then this script's
#    arguments, e.g. --widths 2048 --iters 10; bench.json, table.md);
# 3. the current tables and chart from both (python -m benchmarks.summarize: current.md,
#    current.png; put them in benchmarks/RESULTS.md with summarize --update).
# Switches (environment):
#   STEP_BENCH   configurations, preset[-layers]:batch:seq[:mesh[:explicit]] separated by spaces
#                (default "1b:8:1024 8b-4:4:1024"; mesh e.g. data=2,fsdp=2 over all GPUs, batch
#                global; empty: no train step)
#   STEP_RUNS    the runs of each (default plain, every backend, Pallas with the cross-entropy
#                recomputing its logits, plain again to show the drift); a run is plain or a
#                backend with coda-jax options, e.g. pallas:routing.xla_output_below=0
#   STEP_ARGS    more train_step_bench arguments, e.g. "--profile" (then also the bounds of
#                python -m benchmarks.step_ceiling), "--remat block", "--hlo-out $OUT/hlo"
#   BENCH_PARTS  bench.py's parts (default gemm,ops,ce_memory,block; empty: no op bench)
#   TIMEOUT      seconds for each configuration's step bench and for the op bench (default 420)
#   LABEL        the summary's label (default: the GPU and the date)
#   OUT          where results and logs go (default ./gpu_out); more than 8 files are packed
#                into $OUT/0_all.tgz
# The CuTeDSL backend is added when .whl/cutlass_dsl.tar.zst was carried (gpu_common.sh).
# Other measurements (profiles, tuning, compile time, loss curves, ncu) are tools run
# directly: python -m benchmarks.<tool> --help.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
rc=0
STEP_RUNS="${STEP_RUNS:-plain,$BACKENDS,pallas:cross_entropy.save_logits=false,plain}"
for cfg in ${STEP_BENCH-1b:8:1024 8b-4:4:1024}; do
  IFS=':' read -r preset_layers batch seq mesh mesh_type <<< "$cfg"
  layers=(); [[ $preset_layers == *-* ]] && layers=(--layers "${preset_layers#*-}")
  mesh_args=(); [ -n "${mesh:-}" ] && mesh_args=(--mesh "$mesh" --mesh-type "${mesh_type:-auto}")
  echo "== train step vs plain JAX: $cfg ==" | tee -a "$OUT/train_step.log"
  # shellcheck disable=SC2086  # STEP_ARGS is split on spaces
  timeout "${TIMEOUT:-420}" python3 -m benchmarks.train_step_bench --preset "${preset_layers%%-*}" \
    ${layers[@]+"${layers[@]}"} ${mesh_args[@]+"${mesh_args[@]}"} --batch "$batch" --seq "$seq" \
    --runs "$STEP_RUNS" --out "$OUT" ${STEP_ARGS:-} 2>&1 | grep -v '^{' | tee -a "$OUT/train_step.log" | tail -n 14
  status=${PIPESTATUS[0]}; [ "$status" != 0 ] && rc=$status
done
if [[ " ${STEP_ARGS:-} " == *" --profile "* ]] && [ -f "$OUT/train_step.json" ]; then
  # Each profiled step by part (GEMMs, attention, optimizer, casts, other passes) and the
  # bounds on its ratio to plain JAX.
  python3 -m benchmarks.step_ceiling "$OUT" | tee "$OUT/step_ceiling.md"
fi
if [ -n "${BENCH_PARTS-gemm,ops,ce_memory,block}" ]; then
  echo "== op and block benchmarks (plain,$BACKENDS) =="
  timeout "${TIMEOUT:-420}" python3 -m benchmarks.bench --out "$OUT" --backends "plain,$BACKENDS" \
    --parts "${BENCH_PARTS-gemm,ops,ce_memory,block}" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -n 60
  status=${PIPESTATUS[0]}; [ "$status" != 0 ] && rc=$status
fi
if [ -f "$OUT/train_step.json" ] || [ -f "$OUT/bench.json" ]; then
  echo "== summary =="
  python3 -m benchmarks.summarize "$OUT" \
    --label "${LABEL:-$(head -n 1 "$OUT/gpu.txt" | cut -d, -f1), $(date -u '+%Y-%m-%d')}"
fi
pack_out
exit "$rc"
