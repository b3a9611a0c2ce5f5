#!/usr/bin/env bash
# The GPU tests on the device (tests marked `gpu`; they skip themselves without a Hopper GPU):
#   bash benchmarks/gpu_tests.sh [pytest arguments...]
# Switches (environment):
#   GPU_TESTS         test files (default: tests/test_gpu_pallas.py, tests/test_gpu_cutedsl.py where
#                     the CuTeDSL wheel was carried, tests/test_gpu_multi.py and
#                     tests/test_gpu_multi_process.py); the GPU shape fuzz is
#                     GPU_TESTS=tests/test_gpu_shape_fuzz.py (its FUZZ_SEED, FUZZ_OPS, FUZZ_MODELS,
#                     FUZZ_BACKENDS; CODA_JAX_TESTS_ROUTING=default for the library's routing rules)
#   GPU_TESTS_K       a pytest -k expression (it may contain spaces)
#   GPU_TEST_WORKERS  pytest-xdist processes sharing the GPU (default 6 where pytest-xdist is
#                     installed: runs 162-163, 217 Pallas tests in 142 s; 0: one process)
#   TEST_TIMEOUT      seconds for the whole pytest run (default 480: run 79's 230 s cut the
#                     GPU test files at 53 %)
#   OUT               where the logs go (default ./gpu_out): tests_full.log (-v, one line per
#                     finished test, so a run cut by TEST_TIMEOUT still names what passed) and
#                     tests.log (its last lines and the counts)
# The CuTeDSL backend is added when .whl/cutlass_dsl.tar.zst was carried (gpu_common.sh).
# Exits with pytest's status (124: stopped by TEST_TIMEOUT; 5: no test selected).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"
if [ -z "${GPU_TEST_WORKERS+x}" ]; then
  GPU_TEST_WORKERS=0; python3 -c "import xdist" 2>/dev/null && GPU_TEST_WORKERS=6
fi
xdist=(); test_env=()
# Each worker allocates on demand: the GPU is shared (the tests are bound by lowering on the CPU).
# --dist loadgroup: the tests of one xdist_group run on one worker (tests/test_gpu_multi_process.py's
# share their training runs); the others are spread one by one, as with the default.
[ "$GPU_TEST_WORKERS" != 0 ] && xdist=(-n "$GPU_TEST_WORKERS" --dist loadgroup) \
  && test_env=(XLA_PYTHON_CLIENT_PREALLOCATE=false)
if [ -z "${GPU_TESTS:-}" ]; then
  GPU_TESTS="tests/test_gpu_pallas.py"; [[ $BACKENDS == *cutedsl* ]] && GPU_TESTS="$GPU_TESTS tests/test_gpu_cutedsl.py"
  GPU_TESTS="$GPU_TESTS tests/test_gpu_multi.py tests/test_gpu_multi_process.py"  # skip themselves on one GPU
fi
echo "== GPU tests ($BACKENDS): $GPU_TESTS ==" | tee "$OUT/tests.log"
# shellcheck disable=SC2086  # GPU_TESTS is split on spaces
env ${test_env[@]+"${test_env[@]}"} timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -v -m gpu ${xdist[@]+"${xdist[@]}"} \
  $GPU_TESTS ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} -p no:cacheprovider "$@" > "$OUT/tests_full.log" 2>&1
rc=$?
{ grep -v "PASSED\|SKIPPED\|Warning\|warner(" "$OUT/tests_full.log" | tail -n 40
  echo "test lines: $(grep -c ' PASSED' "$OUT/tests_full.log") PASSED, $(grep -c ' FAILED' "$OUT/tests_full.log") FAILED," \
    "$(grep -c ' ERROR' "$OUT/tests_full.log") ERROR, $(grep -c ' SKIPPED' "$OUT/tests_full.log") SKIPPED" \
    "(pytest status $rc; 124: stopped by TEST_TIMEOUT)"; } | tee -a "$OUT/tests.log"
pack_out
exit "$rc"
