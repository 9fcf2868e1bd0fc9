"""Where the package finds its kernel library (tiny_mindie.kernels.library_path).

``pip install .`` puts the built library in site-packages only; ``python -m tiny_mindie`` run
inside the clone then imports the clone's package, which holds the C sources and no build. The
package uses the installed build there when the build embeds the digest of these very sources,
and says why not otherwise. Here: a copy of the package's source folder (no library) ahead of an
installed distribution (its ``.dist-info`` RECORD naming the real library, a copy of the one
this checkout built), each imported in a fresh interpreter as the user's would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from gguf_blocks import built_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "tiny_mindie")

PROBE = ("from tiny_mindie import kernels\n"
         "from tiny_mindie.model.ort.ort_session import resolve_kernels\n"
         "print(kernels.__file__)\n"
         "print(kernels.library_path())\n"
         "print(kernels.unavailable_reason())\n"
         "print(resolve_kernels('auto', 'contrib', 0))\n")


@pytest.fixture(name="trees")
def _trees(tmp_path):
    """(source tree, installed tree): the package's sources without a build, and a
    distribution holding the library this checkout built."""
    lib = built_kernels().library_path()
    src = tmp_path / "clone"
    shutil.copytree(PACKAGE, src / "tiny_mindie",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    site = tmp_path / "site"
    rel = f"tiny_mindie/kernels/{os.path.basename(lib)}"
    (site / "tiny_mindie" / "kernels").mkdir(parents=True)
    shutil.copy(lib, site / rel)
    info = site / "tiny_mindie-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny_mindie\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(f"{rel},,\ntiny_mindie-0.1.0.dist-info/RECORD,,\n")
    return src, site


def _probe(cwd, *path) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in path))
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines() + [r.stderr]


def test_a_source_tree_uses_the_installed_build_of_its_own_sources(trees):
    src, site = trees
    where, path, reason, chosen, _ = _probe(src, src, site)
    assert where.startswith(str(src))                   # the clone's package was imported
    assert path.startswith(str(site)) and reason == "None" and chosen == "custom"


def test_a_build_of_other_sources_is_not_used_and_the_log_says_why(trees):
    src, site = trees
    with open(src / "tiny_mindie" / "kernels" / "kern_portable.c", "a") as f:
        f.write("/* edited after the install */\n")
    where, path, reason, chosen, log = _probe(src, src, site)
    assert path == "None" and chosen == "onnxruntime"
    assert "was built from other sources" in reason and "pip install . again" in reason
    assert "kernels: onnxruntime MatMulNBits (the own kernels do not run: " in log


def test_no_installed_build_is_told_as_not_built(trees):
    src, _ = trees
    _, path, reason, chosen, _ = _probe(src, src)
    assert path == "None" and chosen == "onnxruntime"
    assert reason == "the kernel library was not built (no C compiler at install)"
