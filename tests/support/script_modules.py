"""The repository's scripts (``scripts/*.py``) as modules, for the tests that check them."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts")


def load_script(name: str, module_name: str | None = None) -> ModuleType:
    """``scripts/{name}.py`` run as a module named ``module_name`` (default ``name``), put in
    ``sys.modules`` under that name (dataclasses look their module up by name); the same
    module again when it is loaded already."""
    module_name = module_name or name
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name,
                                                  os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
