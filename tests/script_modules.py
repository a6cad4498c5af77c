"""Scripts of ``scripts/`` imported as modules, by their path, for tests of their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(relative: str) -> ModuleType:
    """``scripts/<relative>`` run as a module named after its file (registered in ``sys.modules``, as its
    dataclasses need), without running its ``__main__`` block."""
    path = SCRIPTS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
