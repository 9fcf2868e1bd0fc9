"""The cache of built graphs (tiny_mindie/model/graph_cache.py) on small files: its index, and the
removal of outdated graphs (on the real SmolLM2-135M: tests/model/test_ort_backend.py)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from tiny_mindie.model.onnx import graph_cache
from tiny_mindie.model.onnx.graph import BUILDER_VERSION
from tiny_mindie.model.registry.catalog import sha256_of


def test_a_flavour_version_bump_drops_that_flavours_older_graphs(tmp_path):
    """Options keys ``<flavour>@<n>-...`` (the standard graph's) are versioned on their own:
    a build drops the same flavour's smaller ``n``, not other flavours nor other builders'."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    cache = tmp_path / "cache"
    cache.mkdir()
    digest = sha256_of(str(gguf))[:16]
    old, older_builder, other, contrib = (
        cache / f"m-{digest}-b{BUILDER_VERSION}-standard@1-p0",
        cache / f"m-{digest}-b{BUILDER_VERSION - 1}-standard@5-p0",
        cache / f"m-{digest}-b{BUILDER_VERSION}-other@1-p0",
        cache / f"m-{digest}-b{BUILDER_VERSION}-a4-h4-l128-p0")
    for d in (old, older_builder, other, contrib):
        d.mkdir()
        (d / "complete").write_text("")

    def build(out):
        os.makedirs(out, exist_ok=True)
        (tmp_path / "built").write_text("1")
        with open(os.path.join(out, "model.onnx"), "wb") as fh:
            fh.write(b"x")

    _, built = graph_cache.cached_build(str(gguf), BUILDER_VERSION, "standard@2-p0", build,
                                        str(cache))
    assert built and not old.exists() and not older_builder.exists()
    assert other.exists() and contrib.exists()


# ---- the index: a warm start finds the graph without reading the file (unit tier) ------------

class Builds:
    """A build function for :func:`graph_cache.cached_build` writing a small ``model.onnx``,
    counting its calls; ``delay`` seconds long."""

    def __init__(self, delay: float = 0.0):
        self.calls = 0
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, out: str) -> None:
        with self.lock:
            self.calls += 1
        time.sleep(self.delay)
        with open(os.path.join(out, "model.onnx"), "wb") as fh:
            fh.write(b"graph")


@pytest.fixture
def hashes(monkeypatch) -> list[str]:
    """The paths :func:`graph_cache.cached_build` hashed (the real sha256_of, recorded)."""
    seen: list[str] = []

    def recorded(path: str) -> str:
        seen.append(path)
        return sha256_of(path)

    monkeypatch.setattr(graph_cache, "sha256_of", recorded)
    return seen


def _write(path, data: bytes) -> str:
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def _entries(cache) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if (p / "complete").exists())


def test_second_start_finds_the_graph_without_hashing(tmp_path, hashes):
    gguf = _write(tmp_path / "m.gguf", b"weights" * 1000)
    cache = tmp_path / "cache"
    build = Builds()
    path, built = graph_cache.cached_build(gguf, 3, "opts", build, str(cache))
    assert built and build.calls == 1 and hashes == [gguf]
    assert open(path, "rb").read() == b"graph"
    assert _entries(cache) == [f"m-{sha256_of(gguf)[:16]}-b3-opts"]
    again, built = graph_cache.cached_build(gguf, 3, "opts", build, str(cache))
    assert (again, built) == (path, False) and build.calls == 1
    assert hashes == [gguf]                             # the index answered
    other, built = graph_cache.cached_build(gguf, 3, "other", build, str(cache))
    assert built and other != path and hashes == [gguf]  # other options: a build, no hash


def test_a_changed_file_is_hashed_again_and_gets_its_own_graph(tmp_path, hashes):
    gguf = _write(tmp_path / "m.gguf", b"a" * 4096)
    cache = tmp_path / "cache"
    build = Builds()
    first, _ = graph_cache.cached_build(gguf, 3, "opts", build, str(cache))
    st = os.stat(gguf)
    _write(gguf, b"b" * 4096)                           # same size, new content ...
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))  # ... even with the old mtime
    second, built = graph_cache.cached_build(gguf, 3, "opts", build, str(cache))
    assert built and second != first and build.calls == 2 and hashes == [gguf, gguf]
    assert len(os.listdir(cache / graph_cache.INDEX_DIR)) == 1   # the old identity dropped
    os.utime(gguf)                                      # touched, same content: hashed, no build
    third, built = graph_cache.cached_build(gguf, 3, "opts", build, str(cache))
    assert (third, built) == (second, False) and build.calls == 2 and len(hashes) == 3
    graph_cache.cached_build(gguf, 3, "opts", build, str(cache))
    assert len(hashes) == 3


def test_two_paths_of_one_file_share_one_graph(tmp_path, hashes):
    a = _write(tmp_path / "a.gguf", b"same" * 1000)
    (tmp_path / "elsewhere").mkdir()
    b = _write(tmp_path / "elsewhere" / "b.gguf", b"same" * 1000)
    cache = tmp_path / "cache"
    build = Builds()
    pa, built_a = graph_cache.cached_build(a, 3, "opts", build, str(cache))
    pb, built_b = graph_cache.cached_build(b, 3, "opts", build, str(cache))
    assert built_a and not built_b and pa == pb and build.calls == 1
    assert hashes == [a, b] and len(_entries(cache)) == 1
    graph_cache.cached_build(a, 3, "opts", build, str(cache))
    graph_cache.cached_build(b, 3, "opts", build, str(cache))
    assert hashes == [a, b]                             # both identities are in the index


def test_a_damaged_index_file_means_a_hash_not_a_wrong_graph(tmp_path, hashes):
    gguf = _write(tmp_path / "m.gguf", b"x" * 100)
    cache = tmp_path / "cache"
    path, _ = graph_cache.cached_build(gguf, 3, "opts", Builds(), str(cache))
    (index,) = (cache / graph_cache.INDEX_DIR).iterdir()
    index.write_text('{"sha256": "00"')                 # cut short
    again, built = graph_cache.cached_build(gguf, 3, "opts", Builds(), str(cache))
    assert (again, built) == (path, False) and len(hashes) == 2
    other = json.loads(index.read_text())
    other["size"] += 1                                  # an identity that is not the file's
    index.write_text(json.dumps(other))
    graph_cache.cached_build(gguf, 3, "opts", Builds(), str(cache))
    assert len(hashes) == 3


def test_two_starts_at_once_build_the_graph_once(tmp_path):
    gguf = _write(tmp_path / "m.gguf", b"y" * 1000)
    cache = tmp_path / "cache"
    build = Builds(delay=0.5)
    results: list = [None, None]

    def start(i: int) -> None:
        results[i] = graph_cache.cached_build(gguf, 3, "opts", build, str(cache))

    threads = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.calls == 1
    assert results[0][0] == results[1][0] and sorted(r[1] for r in results) == [False, True]
    assert _entries(cache) == [f"m-{sha256_of(gguf)[:16]}-b3-opts"]
    assert not [n for n in os.listdir(cache) if n.startswith(".")]   # no temporary or lock left


def test_a_build_killed_halfway_leaves_nothing_behind_after_the_next_build(tmp_path):
    """A server stopped while it builds (Ctrl-C on a first start: the build runs on a daemon
    thread, no cleanup) leaves its half-written folder; the next build of that entry removes it,
    and leaves another entry's build folder alone."""
    import signal
    import subprocess
    import sys

    gguf, cache = _write(tmp_path / "m.gguf", b"weights"), tmp_path / "cache"
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from tiny_mindie.model.onnx import graph_cache\n"
        "def build(out):\n"
        "    open(os.path.join(out, 'model.onnx.data'), 'wb').write(b'x' * 1000)\n"
        "    print('building', flush=True)\n"
        "    time.sleep(60)\n"
        f"graph_cache.cached_build({gguf!r}, 3, 'opts', build, {str(cache)!r})\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "building"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    left = [p.name for p in cache.iterdir() if p.name.startswith(".build-")]
    assert len(left) == 1 and "-b3-opts-" in left[0]
    other = cache / ".build-m-0123456789abcdef-b3-other-xyz"      # another entry's, alive
    other.mkdir()
    path, built = graph_cache.cached_build(gguf, 3, "opts", Builds(), str(cache))
    assert built and os.path.isfile(path)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".build-")] == [other.name]


def test_a_cache_of_its_own_keeps_graphs_out_of_the_models_folder(tmp_path, monkeypatch):
    """With TINY_MINDIE_CACHE set, a GGUF outside it gets its graph (and index entry) there
    and its own folder stays as it was, even with a graph cache in it; a pulled GGUF (inside
    the cache) keeps its graphs beside it; unset, beside the GGUF first."""
    shared = tmp_path / "shared"
    shared.mkdir()
    gguf = _write(shared / "m.gguf", b"weights" * 100)
    cache = tmp_path / "own"
    build = Builds()
    monkeypatch.delenv("TINY_MINDIE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    beside, built = graph_cache.cached_build(gguf, 3, "opts", build)
    assert built and beside.startswith(str(shared / "onnx-cache"))
    listing = {str(p): (p.stat().st_ino, p.stat().st_mtime_ns)
               for p in [shared, *shared.rglob("*")]}
    monkeypatch.setenv("TINY_MINDIE_CACHE", str(cache))
    assert graph_cache.cache_roots(gguf) == [str(cache / "onnx")]
    path, built = graph_cache.cached_build(gguf, 3, "opts", build)
    assert built and path.startswith(str(cache / "onnx" / "m-"))
    assert {str(p): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in [shared, *shared.rglob("*")]} == listing
    assert os.listdir(cache / "onnx" / graph_cache.INDEX_DIR)
    pulled = cache / "models" / "m.gguf"
    pulled.parent.mkdir()
    assert graph_cache.cache_roots(str(pulled)) == [str(cache / "models" / "onnx-cache"),
                                                    str(cache / "onnx")]
