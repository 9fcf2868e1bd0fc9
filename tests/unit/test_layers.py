"""The package's layers: each imports only the layers below it, and no modules import each
other in a circle (docs/design/architecture.md).

``server/`` is the HTTP server and knows no API family, engine, model or configuration;
``model/`` knows nothing above it; ``engine/`` drives the model and knows no API or server;
``llm.py`` is the in-process API over the engine; ``api/`` the HTTP families over it;
``config/`` the settings; ``service/`` the running process that wires them; ``cli/`` the
commands. Every import statement counts: absolute or relative, at module level, inside a
function or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "tiny_mindie"

# layer (a folder, or a module of the package root) -> the only parts of the package it may
# import (the package root itself is none of them: a layer reads the version from _version, not
# from tiny_mindie/__init__). The same table is in docs/design/architecture.md.
ALLOWED = {
    "server": {"server"},
    "kernels": {"kernels"},
    "model": {"model", "kernels", "_version"},
    "engine": {"engine", "model", "_version"},
    "llm": {"llm", "engine", "model", "_version"},
    "api": {"api", "llm", "engine", "model", "server", "_version"},
    "config": {"config", "model", "server"},
    "service": {"service", "config", "api", "llm", "engine", "model", "server", "_version"},
    "cli": {"cli", "service", "config", "api", "llm", "engine", "model", "server", "kernels",
            "_version"},
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
    for path in _layer_files(layer):
        for line, mod in imported_modules(path):
            parts = mod.split(".")
            if parts[0] == PACKAGE and (len(parts) == 1 or parts[1] not in ALLOWED[layer]):
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {mod}")
    return sorted(set(bad))


def _layer_files(layer: str) -> list[str]:
    """The files of ``layer``: every .py under its folder, or its module of the package root."""
    single = os.path.join(ROOT, PACKAGE, layer + ".py")
    if os.path.isfile(single):
        return [single]
    return [os.path.join(folder, name)
            for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE, layer))
            for name in sorted(files) if name.endswith(".py")]


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


# ---- no circles ---------------------------------------------------------------------------------
#: the modules of the package root that are no layer of their own
ROOT_MODULES = {"__init__", "__main__", "_version"}


def test_every_module_belongs_to_a_layer():
    """The package root holds only ``__init__``, ``__main__``, ``_version`` and the layers
    (folders, and the public ``llm.py``): a new module goes into the folder of its job."""
    loose = [name for name in sorted(os.listdir(os.path.join(ROOT, PACKAGE)))
             if (name.endswith(".py") and name[:-3] not in ROOT_MODULES | set(ALLOWED))
             or (os.path.isfile(os.path.join(ROOT, PACKAGE, name, "__init__.py"))
                 and name not in ALLOWED)]
    assert loose == []


def import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the modules of the package it imports (a name that is
    not a module counts as the module it is found in; a package's own ``__init__`` is left out
    of its modules' edges)."""
    graph = {}
    for folder, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                graph[module_name(path)] = {mod for _, mod in imported_modules(path)}
    known = set(graph)

    def owner(mod: str) -> str:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        return mod

    return {m: {owner(i) for i in imports} - {"", m} for m, imports in graph.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's
    algorithm, iterative), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other_in_a_circle():
    """Function-level and ``TYPE_CHECKING`` imports count: a lazy import does not hide a circle."""
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle_of_lazy_imports(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from .b import B\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("from .a import x\n")
    (package / "d.py").write_text("from . import a\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    assert circles(import_graph()) == [["tiny_mindie.a", "tiny_mindie.b", "tiny_mindie.c"]]
