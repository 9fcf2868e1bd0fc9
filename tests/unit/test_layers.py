"""The package's layers: each imports only the layers below it (docs/architecture.md).

``server/`` is the HTTP server and knows no API family, engine, model or configuration;
``model/`` knows nothing above it; ``engine/`` drives the model and knows no API or server. Every
import statement counts: absolute or relative, at module level or inside a function.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "tiny_mindie"

# layer -> the only parts of the package it may import (the package root itself is none of them:
# model/ reads the version from _version, not from tiny_mindie/__init__)
ALLOWED = {
    "server": {"server"},
    "kernels": {"kernels"},
    "model": {"model", "kernels", "_version"},
    "engine": {"engine", "model", "_version"},
}


def module_name(path: str) -> str:
    """``tiny_mindie/server/tls.py`` -> ``tiny_mindie.server.tls`` (a package: its ``__init__``)."""
    rel = os.path.relpath(path, ROOT)[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def imported_modules(path: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at ``path``; ``from X import y``
    also counts as importing ``X.y`` (``y`` may be a module)."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    package = module_name(path)
    if not path.endswith("__init__.py"):
        package = package.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def layer_violations(layer: str) -> list[str]:
    """``path:line imports module`` for every forbidden import of the files under ``layer``."""
    bad = []
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE, layer)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for line, mod in imported_modules(path):
                parts = mod.split(".")
                if parts[0] == PACKAGE and (len(parts) == 1 or parts[1] not in ALLOWED[layer]):
                    bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {mod}")
    return sorted(set(bad))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_nothing_above_it(layer):
    assert layer_violations(layer) == []


def test_the_import_finder_sees_relative_absolute_and_function_local_imports(tmp_path, monkeypatch):
    """The check can fail: a file under server/ with each kind of forbidden import is caught."""
    server = tmp_path / PACKAGE / "server"
    server.mkdir(parents=True)
    (server / "bad.py").write_text(
        "from ..config import Config\n"                 # relative, module level
        "import tiny_mindie.llm\n"                      # absolute
        "from tiny_mindie import api\n"                 # a package named in the import list
        "from . import http\n"                          # allowed: the server's own
        "def f():\n"
        "    from .. import model\n"                    # function-local, relative
    )
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    assert layer_violations("server") == [
        "tiny_mindie/server/bad.py:1 imports tiny_mindie.config",
        "tiny_mindie/server/bad.py:1 imports tiny_mindie.config.Config",
        "tiny_mindie/server/bad.py:2 imports tiny_mindie.llm",
        "tiny_mindie/server/bad.py:3 imports tiny_mindie",           # the package root runs too
        "tiny_mindie/server/bad.py:3 imports tiny_mindie.api",
        "tiny_mindie/server/bad.py:6 imports tiny_mindie",
        "tiny_mindie/server/bad.py:6 imports tiny_mindie.model",
    ]
