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

from tiny_mindie.kernels import sources

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "tiny_mindie")

PROBE = ("from tiny_mindie import kernels\n"
         "from tiny_mindie.model.ort.ort_session import resolve_kernels\n"
         "print(kernels.__file__)\n"
         "print(kernels.library_path())\n"
         "print(kernels.unavailable_reason())\n"
         "print(resolve_kernels('auto', 'contrib', 0))\n")


def _installed(site, library: bytes):
    """``site``: a distribution of tiny_mindie whose RECORD names a library of these bytes."""
    rel = f"tiny_mindie/kernels/{os.path.basename(built_kernels().library_path())}"
    (site / "tiny_mindie" / "kernels").mkdir(parents=True)
    (site / rel).write_bytes(library)
    info = site / "tiny_mindie-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny_mindie\nVersion: 0.1.0\n")
    (info / "RECORD").write_text(f"{rel},,\ntiny_mindie-0.1.0.dist-info/RECORD,,\n")
    return site


@pytest.fixture(name="trees")
def _trees(tmp_path):
    """(source tree, installed tree): the package's sources without a build, and a
    distribution holding the library this checkout built."""
    lib = built_kernels().library_path()
    src = tmp_path / "clone"
    shutil.copytree(PACKAGE, src / "tiny_mindie",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    with open(lib, "rb") as fh:
        return src, _installed(tmp_path / "site", fh.read())


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


def test_no_build_at_all_says_how_to_build_one(trees):
    src, _ = trees
    _, path, reason, chosen, _ = _probe(src, src)
    assert path == "None" and chosen == "onnxruntime"
    assert "holds no built kernel library" in reason and "pip install -e ." in reason


def test_a_build_of_its_own_is_used_only_for_the_sources_beside_it(trees):
    """A source tree's own build (pip install -e .) comes first where it embeds the digest of
    the sources beside it; a stale one (sources edited since, or a build from before the
    digest) is not loaded, and the installed build of the same sources is taken instead."""
    src, site = trees
    lib = built_kernels().library_path()
    own = src / "tiny_mindie" / "kernels" / os.path.basename(lib)
    shutil.copy(lib, own)
    _, path, reason, chosen, _ = _probe(src, src, site)
    assert path == str(own) and chosen == "custom"
    edited = src / "tiny_mindie" / "kernels" / "kern_x86.c"
    original = edited.read_text()
    edited.write_text(original + "/* edited after the build */\n")
    _, path, reason, chosen, _ = _probe(src, src)
    assert path == "None" and chosen == "onnxruntime"
    assert "built from other sources than the ones beside it" in reason
    assert "pip install -e . again" in reason
    _, path, _, chosen, _ = _probe(src, src, site)        # the installed build is as stale
    assert path == "None" and chosen == "onnxruntime"
    edited.write_text(original)
    own.write_bytes(own.read_bytes().replace(sources.MARKER, b"x" * len(sources.MARKER)))
    _, path, _, chosen, _ = _probe(src, src)               # a build that embeds no digest
    assert path == "None" and chosen == "onnxruntime"


def test_setup_rebuilds_a_library_of_other_sources_whatever_the_file_times(tmp_path):
    """setup.py's build_ext rebuilds the library when the build at hand embeds another digest
    than the sources', even when no source file is newer than it (a file restored with its
    old time): setuptools alone would keep the stale build."""
    pytest.importorskip("setuptools")
    lib = built_kernels().library_path()
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "*.egg-info", "__pycache__", "*.so", "tests", "docs",
        "scripts", "deploy", "models", ".ci"))
    kernels_dir = tree / "tiny_mindie" / "kernels"
    built = kernels_dir / os.path.basename(lib)
    shutil.copy(lib, built)
    source = kernels_dir / "kern_portable.c"
    before = os.stat(built).st_mtime - 3600
    source.write_text(source.read_text() + "/* changed, its time set back */\n")
    os.utime(source, (before, before))
    assert sources.embedded(str(built)) != sources.digest(str(kernels_dir))
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sources.embedded(str(built)) == sources.digest(str(kernels_dir))


def test_the_first_installed_build_of_these_sources_wins(trees, tmp_path):
    """Two installed distributions on the path: a build of other sources first (it embeds
    another digest), then one of these: the second is loaded."""
    src, site = trees
    good = (site / f"tiny_mindie/kernels/{os.path.basename(built_kernels().library_path())}")
    other = good.read_bytes().replace(sources.digest(str(src / "tiny_mindie" / "kernels"))
                                      .encode(), b"0" * 64)
    stale = _installed(tmp_path / "stale", other)
    _, path, reason, chosen, _ = _probe(src, src, stale, site)
    assert path == str(good) and reason == "None" and chosen == "custom"


def test_a_build_that_does_not_load_is_one_line_and_custom_refuses(trees):
    """A library of the right digest that the loader refuses (not a shared object): auto falls
    back saying so, and ``--kernels custom`` refuses with a ModelFileError naming it."""
    src, _ = trees
    folder = src / "tiny_mindie" / "kernels"
    own = folder / os.path.basename(built_kernels().library_path())
    own.write_bytes(b"not a shared object " + sources.MARKER
                    + sources.digest(str(folder)).encode())
    _, path, reason, chosen, _ = _probe(src, src)
    assert path == str(own) and chosen == "onnxruntime"
    assert reason.startswith("the kernel library does not load: ")
    code = ("from tiny_mindie.model.gguf import ModelFileError\n"
            "from tiny_mindie.model.ort.ort_session import resolve_kernels\n"
            "try:\n    resolve_kernels('custom', 'contrib', 0)\n"
            "except ModelFileError as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(src)), timeout=120)
    assert r.stdout.startswith("refused: kernels custom: the kernel library does not load: ")
    assert "Traceback" not in r.stderr
