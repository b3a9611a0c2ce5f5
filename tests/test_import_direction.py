"""The package's dependency direction is one-way: layers -> ops -> backends -> epilogue spec.

Every ``coda_jax`` import in the package's source, at module level or inside a function (a
function-level import is still a dependency; one of them hid an ops -> layers import), is
checked against the rank of the importing module:

* spec (``epilogue``, ``programs``, ``options``): nothing above it;
* backends (``lowering``, ``kernel_lowering``, ``kernel_cache_dir``, ``reference``, ``reference_backend``,
  ``partitioning``, ``coda_jax.pallas.*``, ``coda_jax.ffi.*``): no ops (but the op-name
  registry ``ops.names``, a leaf of constants) and no layers;
* ops (``coda_jax.ops.*``): no layers.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "coda_jax"
SPEC = {"coda_jax.epilogue", "coda_jax.programs", "coda_jax.options"}
BACKENDS = {"coda_jax.lowering", "coda_jax.kernel_lowering", "coda_jax.kernel_cache_dir", "coda_jax.reference",
            "coda_jax.reference_backend", "coda_jax.partitioning"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``coda_jax`` modules ``path`` imports (``from coda_jax import x`` counts as ``coda_jax.x``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("coda_jax"):
            out.add(node.module)
            if node.module == "coda_jax":
                out.update(f"coda_jax.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("coda_jax"))
    return out


def _is(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _forbidden(importer: str) -> tuple[str, ...]:
    if importer in SPEC:
        return ("coda_jax.ops", "coda_jax.layers", "coda_jax.pallas", "coda_jax.ffi", *sorted(BACKENDS),
                "coda_jax.backend")
    if importer in BACKENDS or _is(importer, "coda_jax.pallas", "coda_jax.ffi"):
        return ("coda_jax.ops", "coda_jax.layers")
    if _is(importer, "coda_jax.ops"):
        return ("coda_jax.layers",)
    return ()


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: _module(p))
def test_imports_point_down(path):
    importer = _module(path)
    bad = sorted(m for m in _imports(path) if _is(m, *_forbidden(importer)) and m != "coda_jax.ops.names")
    assert not bad, f"{importer} imports {bad}: the dependency direction is layers -> ops -> backends -> spec"


def test_the_check_sees_function_level_imports(tmp_path):
    src = tmp_path / "f.py"
    src.write_text("def f():\n    from coda_jax.layers.block import CodaLlamaBlock\n    import coda_jax.ops.attention\n")
    assert _imports(src) == {"coda_jax.layers.block", "coda_jax.ops.attention"}
    assert _forbidden("coda_jax.ops.fp8_llama_block") == ("coda_jax.layers",)
    assert "coda_jax.ops" in _forbidden("coda_jax.pallas.lowering")
