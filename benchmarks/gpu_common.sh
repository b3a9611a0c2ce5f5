# Sourced by gpu_tests.sh and gpu_bench.sh, not run by itself. Sets: the repository root as
# the working directory and on PYTHONPATH; $OUT (default ./gpu_out), created; $BACKENDS
# (xla,pallas, and cutedsl when .whl/cutlass_dsl.tar.zst was carried: the wheel is unpacked
# with the carried .whl/zstd under $TMPDIR/site and put on PYTHONPATH); the GPU's name and
# JAX's version in $OUT/gpu.txt; and pack_out.
# The pack: ../shared/tools/pack_cutedsl.sh, then benchmarks/trim_cutedsl_pack.sh (the pack and
# the working tree must fit one call's 64 MiB).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUT="${OUT:-$ROOT/gpu_out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
BACKENDS="xla,pallas"
if [ -s .whl/cutlass_dsl.tar.zst ]; then
  site="${TMPDIR:-/tmp}/site"
  mkdir -p "$site" && (cd "$site" && "$ROOT/.whl/zstd" -dc --long=28 "$ROOT/.whl/cutlass_dsl.tar.zst" | tar xf -)
  export PYTHONPATH="$PYTHONPATH:$site:$site/nvidia_cutlass_dsl/dsl_packages"
  BACKENDS="$BACKENDS,cutedsl"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

# The device tool returns at most 8 files of $OUT, the first in path order (runs 293 and 295
# lost a tuned table that way): with more, one archive of all of them, named to sort first.
pack_out() {
  if [ "$(find "$OUT" -type f ! -name 0_all.tgz | wc -l)" -gt 8 ]; then
    local tgz="${TMPDIR:-/tmp}/_gpu_out_all.tgz"
    tar czf "$tgz" --exclude=./0_all.tgz -C "$OUT" . && mv "$tgz" "$OUT/0_all.tgz" \
      && echo "(more than 8 files under \$OUT: all of them in \$OUT/0_all.tgz)"
  fi
}
