#!/usr/bin/env bash
# coda-jax developer entry point. Creates .venv with Python >= 3.12 on first use.
#   bash scripts/run.sh train [train_llama.py args...]   train a small Llama (CPU-friendly default)
#   bash scripts/run.sh test  [pytest args...]           run the test suite's default tier (CPU; kernels in GPU interpret
#                                                        mode; one pytest-xdist worker per core, CODA_JAX_TEST_WORKERS=N
#                                                        to change); with --full (or CODA_JAX_TESTS=full) the full tier
#                                                        (tests/tiers.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${CODA_JAX_VENV:-$ROOT/.venv}"

find_python() {
  # A Python >= 3.12: $PYTHON, then python3.13/3.12/python3 on PATH, then pyenv's installs.
  local c v
  for c in "${PYTHON:-}" python3.13 python3.12 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -rV); do
      c="$(pyenv root)/versions/$v/bin/python3"
      if [ -x "$c" ]; then echo "$c"; return 0; fi
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python)" || { echo "coda-jax needs Python >= 3.12 (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "creating $VENV with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.coda-jax-installed"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ .ci/constraints.txt -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c .ci/constraints.txt -e ".[test,examples]"
  touch "$STAMP"
fi

cmd="${1:-}"; shift || true
case "$cmd" in
  train) exec "$VENV/bin/python" examples/train_llama.py "$@" ;;
  # xdist: one worker a core; an idle worker takes queued tests from the other (the longest run
  # first, tests/conftest.py), so no worker waits alone on a long test at the end.
  test)  exec "$VENV/bin/python" -m pytest -n "${CODA_JAX_TEST_WORKERS:-auto}" --dist worksteal tests "$@" ;;
  *) echo "usage: bash scripts/run.sh {train|test} [args...]" >&2; exit 2 ;;
esac
