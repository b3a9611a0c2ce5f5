"""The repository's example scripts as modules, for the tools that reuse them.

``examples/`` is a folder of scripts, not a package: :func:`example` loads one by its file
(``example("train_llama")``) and registers it under its own name, so that the examples'
imports of each other (``train_llama``'s ``import text_data``) find the same module.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (loaded once per process)."""
    path = EXAMPLES / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no example {name!r} ({path})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
