#!/usr/bin/env bash
# The ONE device script: GPU tests + benchmarks in a single run on the H100 (device tool).
#   bash benchmarks/gpu_suite.sh [bench.py args...]
# Writes logs and results under $OUT (default ./gpu_out) and prints a short table last.
# CuTeDSL: if .whl/cutlass_dsl.tar.zst was carried, it is unpacked and the backend is added.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
BACKENDS="xla,pallas"
if [ -s .whl/cutlass_dsl.tar.zst ]; then
  mkdir -p /tmp/site && (cd /tmp/site && "$ROOT/.whl/zstd" -dc --long=28 "$ROOT/.whl/cutlass_dsl.tar.zst" | tar xf -)
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
  BACKENDS="$BACKENDS,cutedsl"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
echo "== GPU tests ==" | tee "$OUT/tests.log"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu tests/test_gpu_pallas.py -p no:cacheprovider 2>&1 | tail -n 40 | tee -a "$OUT/tests.log"
echo "== benchmarks ($BACKENDS) =="
timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench.py --out "$OUT" --backends "$BACKENDS" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v '^{' | tail -n 60
echo "== summary =="
tail -n 3 "$OUT/tests.log"
cat "$OUT/table.md" 2>/dev/null
