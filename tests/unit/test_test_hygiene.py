"""The test suite's own rules: no test module imports another (shared code lives in the helper
modules of tests/support), and in CI a model or e2e test that skips fails the run
(tests/support/ci_gate.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUPPORT = os.path.join(TESTS, "support")


def _imported_modules(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_imports_another():
    offenders = []
    for folder, _, names in sorted(os.walk(TESTS)):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(folder, name)
            bad = {m for m in _imported_modules(path) if m.startswith("test_") or m == "conftest"}
            offenders += [f"{os.path.relpath(path, TESTS)} imports {m}" for m in sorted(bad)]
    assert not offenders, "move shared code into a helper module:\n" + "\n".join(offenders)


SKIPPING = '''
import pytest

pytestmark = pytest.mark.{tier}


def test_needs_a_model():
    pytest.skip("model x unavailable: no network")
'''


@pytest.mark.parametrize("tier, ci, rc, says", [
    ("e2e", "1", 1, "e2e test skipped in CI ($CI is set), where it must run: model x unavailable"),
    ("model", "1", 1, "model test skipped in CI"),
    ("e2e", "", 0, "1 skipped"),
    ("unit", "1", 0, "1 skipped"),
])
def test_ci_fails_a_run_where_a_model_or_e2e_test_skips(tmp_path, tier, ci, rc, says):
    (tmp_path / "test_skipping.py").write_text(SKIPPING.format(tier=tier))
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(PYTHONPATH=SUPPORT, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **({"CI": ci} if ci else {}))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "ci_gate", "-q", "-p", "no:cacheprovider",
         "-W", "ignore::pytest.PytestUnknownMarkWarning", "-rfs", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert says in proc.stdout, proc.stdout
