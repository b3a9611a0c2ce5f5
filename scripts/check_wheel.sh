#!/usr/bin/env bash
# Packaging check (CI): build the wheel and sdist, install the wheel (no deps: the test venv
# already holds them) into an empty target directory, and run one op from it, outside the repo.
#   bash scripts/check_wheel.sh [python]   (default: .venv/bin/python)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${1:-$ROOT/.venv/bin/python}"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip install -q build
"$PY" -m build -q --outdir "$TMP/dist" "$ROOT" >/dev/null
ls "$TMP"/dist/coda_jax-*.whl "$TMP"/dist/coda_jax-*.tar.gz >/dev/null
"$PY" -m pip install -q --no-deps --target "$TMP/site" "$TMP"/dist/coda_jax-*.whl
cd "$TMP"
PYTHONPATH="$TMP/site" "$PY" - <<'PY'
import jax, jax.numpy as jnp, coda_jax as cj, os
assert os.path.realpath(cj.__file__).startswith(os.path.realpath(os.environ["PYTHONPATH"])), cj.__file__
x = jax.random.normal(jax.random.key(0), (8, 16)); g = jnp.ones((16,)); w = jax.random.normal(jax.random.key(1), (16, 4))
z = cj.rms_norm_matmul(x, g, w, backend="xla")
ref = (x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)) @ w
assert float(jnp.max(jnp.abs(z - ref))) < 1e-4
from coda_jax.pallas.tuned import SHIPPED_TABLES, load_table  # package data: the tuned tables
assert any(p.name == "tuned_h100.json" for p in SHIPPED_TABLES), SHIPPED_TABLES
assert all(load_table(str(p)).entries for p in SHIPPED_TABLES), SHIPPED_TABLES
print("wheel OK:", cj.__file__)
PY
