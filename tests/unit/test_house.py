"""The package's house rules (docs/design/architecture.md): size budgets, and no measurements or
history in code.

- No function in ``tiny_mindie/`` over :data:`MAX_FUNCTION_LINES` lines (its ``def`` line to its
  last, nested functions included) or over :data:`MAX_COMPLEXITY` McCabe cyclomatic complexity
  (as the ``mccabe`` package counts it), without exception. No module over
  :data:`MAX_MODULE_LINES` lines, but those in :data:`ALLOWED`: modules are cut by idea, not by
  size, so a module that holds one idea may be longer, and the allow-list says which idea.
- No function in ``tiny_mindie/`` takes more than :data:`MAX_PARAMETERS` parameters (``self``
  and ``cls`` not counted; ``*args`` and ``**kwargs`` one each): settings travel as one value
  (``BackendOptions``, ``EngineLimits``, ...), not as long lists of keywords.
- Comments and docstrings say what and why: throughput, timings, host descriptions and history
  ("previously", "a reviewer found") belong in docs/ and commit messages (:data:`MEASUREMENT`).
"""

from __future__ import annotations

import ast
import functools
import io
import pathlib
import re
import tokenize

import mccabe
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "tiny_mindie"
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_COMPLEXITY = 500, 60, 15

#: A module's path under ``tiny_mindie/`` -> the one idea it holds (``"one idea: ..."``), which
#: lets it exceed :data:`MAX_MODULE_LINES`. Only modules: a function over budget is split by step.
ALLOWED: dict[str, str] = {}

MAX_PARAMETERS = 8

#: What a measurement or a piece of history looks like in a comment or docstring.
MEASUREMENT = re.compile(r"""(?ix)
    \b\d[\d,.]*(?:\s*-\s*\d[\d.]*)?\s*(?:tok/s|tokens?/s|tokens\ per\ second|[GMK]i?B/s|req/s)
  | \b\d[\d.]*(?:\s*-\s*\d[\d.]*)?\s*(?:ms|µs)\b
  | \b\d[\d.]*(?:\s*-\s*\d[\d.]*)?\s*x\ (?:faster|slower|the\ speed|as\ fast|llama)
  | \b(?:EPYC|Xeon|Ryzen|Graviton)\b | \b\d+-(?:core|vCPU)\ (?:AVX|host|box|VM)
  | \b(?:busy|loaded|quiet)\ (?:host|machine)\b
  | \bmeasured:?\ (?:on|at|with|here|about|\d)
  | \bpreviously\b | \bformerly\b | \bused\ to\ be\b | \breviewers?\b | \bin\ the\ past\b
  | \bcommit\ [0-9a-f]{7,40}\b | \bsession\ \d+\b
""")

#: Lines that match :data:`MEASUREMENT` but show an output's format (the access log's lines, the
#: download's progress line), not a measurement.
FORMAT_EXAMPLES = {
    "server/routing.py": ('"POST /infer" 200 812.4 ms', '"POST /infer" 200 cancelled 95.0 ms'),
    "model/registry/download.py": ("12.3 MB/s, ETA 4 s",),          # the download progress line
}


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


@functools.cache
def _over_budget() -> dict[str, str]:
    over = {}
    for path in _modules():
        src = path.read_text(encoding="utf-8")
        lines = len(src.splitlines())
        if lines > MAX_MODULE_LINES:
            over[_rel(path)] = f"{lines} lines"
        tree = ast.parse(src)
        visitor = mccabe.PathGraphingAstVisitor()
        visitor.preorder(tree, visitor)
        complexity: dict[int, int] = {}
        for graph in visitor.graphs.values():
            complexity[graph.lineno] = max(complexity.get(graph.lineno, 0), graph.complexity())
        for name, node in _functions(tree):
            n = node.end_lineno - node.lineno + 1
            c = complexity.get(node.lineno, 0)
            if n > MAX_FUNCTION_LINES or c > MAX_COMPLEXITY:
                over[f"{_rel(path)}:{name}"] = f"{n} lines, complexity {c}"
    return over


def test_modules_and_functions_keep_their_size_budgets():
    over = {k: v for k, v in _over_budget().items() if k not in ALLOWED}
    assert not over, ("split by job (docs/design/architecture.md):\n"
                      + "\n".join(f"  {k}: {v}" for k, v in sorted(over.items())))


def test_the_allow_list_names_modules_of_one_idea():
    wrong = [k for k, why in ALLOWED.items()
             if ":" in k or not why.startswith("one idea: ") or not (PACKAGE / k).is_file()]
    assert not wrong, f"ALLOWED: a module path -> 'one idea: ...', not {wrong}"


def test_the_allow_list_names_only_what_is_over_budget():
    stale = set(ALLOWED) - set(_over_budget())
    assert not stale, f"within budget now, drop from ALLOWED: {sorted(stale)}"


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    """The parameters of a function: positional, keyword-only, ``*args`` and ``**kwargs`` one
    each; a method's first (``self``, ``cls``) not counted."""
    a = node.args
    n = (len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None)
         + (a.kwarg is not None))
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
    first = (a.posonlyargs + a.args)[:1]
    return n - (method and not static and bool(first) and first[0].arg in ("self", "cls"))


def _methods(tree: ast.AST) -> set[ast.AST]:
    """The functions defined directly in a class body."""
    return {node for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
            for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def long_signatures(package: pathlib.Path = PACKAGE) -> dict[str, int]:
    """``{"path:qualified.name": parameters}`` of every function under ``package`` taking more
    than :data:`MAX_PARAMETERS`."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        methods = _methods(tree)
        for name, node in _functions(tree):
            n = parameter_count(node, node in methods)
            if n > MAX_PARAMETERS:
                found[f"{path.relative_to(package).as_posix()}:{name}"] = n
    return found


def test_no_function_takes_more_than_eight_parameters():
    over = long_signatures()
    assert not over, ("pass a value (a frozen dataclass) instead of the settings one by one:\n"
                      + "\n".join(f"  {k}: {n} parameters" for k, n in sorted(over.items())))


def test_the_parameter_count_finds_a_new_offender(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f(a, b, c, d, e, f, g, h, *args, **kw): pass\n"
        "def g(a, b, c, d, e, f, g, h): pass\n"
        "class C:\n"
        "    def __init__(self, a, b, c, d, e, f, g, h): pass\n"
        "    def m(self, a, b, c, d, e, f, g, *, h, i): pass\n"
        "    @staticmethod\n"
        "    def s(self, a, b, c, d, e, f, g, h): pass\n")
    assert long_signatures(tmp_path) == {"m.py:f": 10, "m.py:C.m": 9, "m.py:C.s": 9}


def _texts(path: pathlib.Path):
    """``(line number, text)`` of every comment and docstring line of ``path``."""
    src = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                for i, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + i, line


def test_no_measurements_or_history_in_code():
    found = []
    for path in _modules():
        examples = FORMAT_EXAMPLES.get(_rel(path), ())
        for line_no, text in _texts(path):
            m = MEASUREMENT.search(text)
            if m and not any(example in text for example in examples):
                found.append(f"  tiny_mindie/{_rel(path)}:{line_no}: [{m.group(0)}] "
                             f"{text.strip()[:120]}")
    assert not found, ("measurements and history go to docs/ and commit messages:\n"
                       + "\n".join(found))


@pytest.mark.parametrize("text", [
    "# copying 500 positions 5-6 ms", "decode runs at 18.1 tok/s here",
    "(2-D nonzero is 10x slower)",
    "Measured on onnxruntime, 2-core AVX2 EPYC", "a busy host", "previously this was a list",
    "a reviewer found it", "see commit 8d495ea1",
])
def test_the_lint_knows_a_measurement_when_it_sees_one(text):
    assert MEASUREMENT.search(text)


@pytest.mark.parametrize("text", [
    "timeout in seconds (default 60)", "the rate is measured by the engine",
    "KV-cache budget in MB used to size num_slots", "[batch, seq, hidden] float32",
    "the address is not on this machine", "2 threads on a 2-core machine",
])
def test_the_lint_lets_what_and_why_through(text):
    assert not MEASUREMENT.search(text)
