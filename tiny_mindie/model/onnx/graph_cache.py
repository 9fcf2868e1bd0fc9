"""The cache of built graphs: build the ONNX graph of a GGUF once, load it on later starts.

Entries are content-addressed: a directory ``<gguf stem>-<sha256[:16]>-b<BUILDER_VERSION>-
<GraphOptions.key()>`` holding ``model.onnx``, ``model.onnx.data`` and a ``complete`` marker,
under ``<dir of the GGUF>/onnx-cache/`` (or ``cache_dir``; when that directory is not writable,
``$TINY_MINDIE_CACHE/onnx`` or ``~/.cache/tiny_mindie/onnx``). With ``$TINY_MINDIE_CACHE`` set,
only under ``$TINY_MINDIE_CACHE``: ``$TINY_MINDIE_CACHE/onnx``, or the GGUF's own
``onnx-cache`` when the GGUF is inside ``$TINY_MINDIE_CACHE`` (a pulled model), so nothing is
read or written beside a GGUF elsewhere (a shared or read-only models folder stays as it is).
An entry is found by its sha256 whatever the stem, so two paths (or names) of the same file
share one graph.

Finding the sha256 without reading the file: the cache directory's ``index/`` folder maps a
file's identity -- real path, size, modification and change times in ns, inode and device -- to
its sha256, one small JSON file per identity. A start whose file has an identity in the index
reads nothing of it; the first start, or one after the file changed (any of those fields), hashes
it and records the new identity (dropping the path's older ones).

Concurrency: a graph is built into a temporary directory beside the entry and renamed into place,
index files are written to a temporary name and renamed, so a reader never sees half an entry or
half an index file. Two processes that miss the same entry at once (two servers starting) build it
once: the second waits on a lock file (``fcntl.flock``; where there is none, both build and the
first rename wins). The temporary directory is made under that lock and named after its entry
(``.build-<entry>-XXXX``), so the next build of an entry removes the folder a build stopped
halfway left behind (a server stopped with Ctrl-C while it built). Building or loading a graph
removes the file's graphs from older builder versions (and, for a graph flavour with a version
of its own, ``<flavour>@<n>`` options, from its older versions).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

from ..arch import ModelConfig
from ..gguf import GGUFFile, ModelFileError
from ..registry.catalog import cache_root, sha256_of
from ..registry.progress import slow_step
from .graph import BUILDER_VERSION, build_model
from .graph_options import GraphOptions

log = logging.getLogger(__name__)

INDEX_DIR = "index"


def cached_graph(f: GGUFFile, config: ModelConfig, options: GraphOptions = GraphOptions(),
                 cache_dir: str | None = None) -> tuple[str, bool]:
    """Path of the built graph for ``f``, building it on a miss.

    Returns:
        ``(path of model.onnx, True if it was built now)``.

    Raises:
        ModelFileError: no cache directory is writable, or the graph cannot be built
            (see :func:`.graph.build_model`).
    """
    what = (" (compact weights: every matrix requantized to 4-bit, a slower build than the "
            "exact weights')" if options.compact else "")
    return cached_build(f.path, BUILDER_VERSION, options.key(),
                        lambda out: build_model(f, config, out, options), cache_dir, what)


def cache_roots(path: str, cache_dir: str | None = None) -> list[str]:
    """The cache directories tried for the GGUF at ``path``, in order: ``cache_dir`` alone
    when given; else the GGUF's ``onnx-cache`` folder, then tiny_mindie's cache's ``onnx``
    folder -- but with ``$TINY_MINDIE_CACHE`` set, the GGUF's folder only when it is inside
    that cache (see the module docstring)."""
    if cache_dir:
        return [cache_dir]
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "onnx-cache")
    shared = os.path.join(cache_root(), "onnx")
    if os.environ.get("TINY_MINDIE_CACHE"):
        root = os.path.realpath(cache_root())
        if os.path.commonpath([root, os.path.realpath(beside)]) != root:
            return [shared]
    return [beside, shared]


def cached_build(path: str, version: int, options_key: str, build: Callable[[str], object],
                 cache_dir: str | None = None, what: str = "") -> tuple[str, bool]:
    """The cache's logic for any file: the ``model.onnx`` of the entry of ``path``'s content,
    builder ``version`` and ``options_key``, made by ``build(directory)`` on a miss (it writes
    ``directory/model.onnx`` and its data; ``what`` follows the file name in the log line
    that says so). See the module docstring.

    Returns:
        ``(path of model.onnx, True if it was built now)``.

    Raises:
        ModelFileError: no cache directory is writable.
        OSError: ``path`` cannot be read.
    """
    roots = cache_roots(path, cache_dir)
    ident, digest = _identify(path, roots)
    suffix = f"-{digest[:16]}-b{version}-{options_key}"
    for root in roots:
        found = _find_entry(root, suffix)
        if found:
            _drop_outdated(root, digest, version, options_key)   # left by an older version
            record_index(root, ident, digest)
            return os.path.join(found, "model.onnx"), False
    stem = os.path.splitext(os.path.basename(path))[0]
    label = f"{os.path.basename(path)}{what}"
    marker = f"sha256 {digest}\nbuilder {version}\noptions {options_key}\n"
    last_error: Exception | None = None
    for root in roots:
        try:
            entry, built = _build_entry(root, stem, suffix, build, label, marker)
        except _Unwritable as exc:
            last_error = exc.__cause__
            continue
        if built:
            _drop_outdated(root, digest, version, options_key)
        record_index(root, ident, digest)
        return os.path.join(entry, "model.onnx"), built
    raise ModelFileError(f"no writable directory for the ONNX graph cache ({last_error})")


def _identify(path: str, roots: list[str]) -> tuple[dict, str]:
    """``(identity, sha256)`` of the file at ``path``: the sha256 from an index of ``roots``,
    else hashed now; the identity is empty when the file changed while it was hashed (it is
    then not recorded)."""
    ident = file_identity(path)
    digest = next(filter(None, (lookup_index(root, ident) for root in roots)), None)
    if digest is None:
        mb = ident["size"] / 1e6
        with slow_step(log, f"hashing {os.path.basename(path)} ({mb:.0f} MB) to find its graph"):
            digest = sha256_of(path)
        if file_identity(path) != ident:                # changed while it was read: not recorded
            log.warning("%s changed while it was hashed", path)
            ident = {}
    return ident, digest


class _Unwritable(Exception):
    """A cache root where no entry can be made (the ``OSError`` is its ``__cause__``)."""


def _build_entry(root: str, stem: str, suffix: str, build: Callable[[str], object], label: str,
                 marker: str) -> tuple[str, bool]:
    """The entry ``root/<stem><suffix>``, built by ``build(directory)`` under the entry's lock
    (``label`` names it in the log) and marked complete with ``marker``; or an entry with the
    same suffix another process made meanwhile. Returns ``(entry folder, True if built now)``.

    Raises:
        _Unwritable: ``root`` cannot be made, locked or written in.
    """
    tmp = None
    try:
        with contextlib.ExitStack() as held:
            try:
                os.makedirs(root, exist_ok=True)
                held.enter_context(_lock(root, stem + suffix))
            except OSError as exc:
                raise _Unwritable from exc
            found = _find_entry(root, suffix)          # built by another process meanwhile
            if found:
                return found, False
            prefix = f".build-{stem}{suffix}-"
            _remove_stopped_builds(root, prefix)
            try:
                tmp = tempfile.mkdtemp(prefix=prefix, dir=root)
            except OSError as exc:
                raise _Unwritable from exc
            with slow_step(log, f"building the ONNX graph of {label}"):
                build(tmp)
            with open(os.path.join(tmp, "complete"), "w") as fh:
                fh.write(marker)
            final = os.path.join(root, stem + suffix)
            try:
                os.rename(tmp, final)
            except OSError:                             # another process built it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
        return final, True
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stopped_builds(root: str, prefix: str) -> None:
    """Remove the build folders of ``root`` named with ``prefix``: with the entry's lock held,
    another build of the entry left its folder only if it died or was stopped (Ctrl-C)."""
    if _HAS_FLOCK:
        for name in os.listdir(root):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- the index: file identity -> sha256 ----------------------------------------------------------

def file_identity(path: str) -> dict:
    """What tells a file apart from its other versions without reading it: real path, size,
    modification and change times (ns), inode and device. Raises OSError when it is missing."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev}


def _index_name(ident: dict) -> str:
    blob = json.dumps(ident, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32] + ".json"


def lookup_index(root: str, ident: dict) -> str | None:
    """The sha256 recorded in ``root``'s index for a file of identity ``ident``, else None."""
    try:
        with open(os.path.join(root, INDEX_DIR, _index_name(ident))) as fh:
            entry = json.load(fh)
    except (OSError, ValueError):
        return None
    digest = entry.pop("sha256", None) if isinstance(entry, dict) else None
    return digest if entry == ident and isinstance(digest, str) else None


def record_index(root: str, ident: dict, digest: str) -> None:
    """Record ``ident -> digest`` in ``root``'s index (atomically: written to a temporary file,
    then renamed) and drop the index files of the same path with another identity. Does nothing
    for an empty ``ident`` or when ``root`` is not writable (the next start hashes again)."""
    if not ident:
        return
    folder = os.path.join(root, INDEX_DIR)
    name = _index_name(ident)
    try:
        os.makedirs(folder, exist_ok=True)
        write_json_atomic(os.path.join(folder, name), {**ident, "sha256": digest})
    except OSError as exc:
        log.debug("cannot write the graph cache index in %s: %s", folder, exc)
        return
    for other in os.listdir(folder):
        if other == name or not other.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, other)) as fh:
                if json.load(fh).get("path") == ident["path"]:
                    os.unlink(os.path.join(folder, other))
        except (OSError, ValueError, AttributeError):
            pass


def write_json_atomic(path: str, value) -> None:
    """Write ``value`` as JSON to ``path`` through a temporary file in the same directory and a
    rename, so a reader sees the old file or the new one, never half of one. Raises OSError."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(value, fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---- entries -------------------------------------------------------------------------------------

def _find_entry(root: str, suffix: str) -> str | None:
    """A complete entry of ``root`` whose name ends with ``suffix`` (any stem), else None."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return None
    for name in names:
        if name.endswith(suffix) and os.path.isfile(os.path.join(root, name, "complete")):
            return os.path.join(root, name)
    return None


try:
    import fcntl  # noqa: F401  (whether _lock can lock)
    _HAS_FLOCK = True
except ImportError:
    _HAS_FLOCK = False


@contextlib.contextmanager
def _lock(root: str, entry: str) -> Iterator[None]:
    """Hold ``root/.<entry>.lock`` exclusively (``fcntl.flock``; a no-op where there is none),
    saying so when another process holds it. The lock file is removed by the holder that leaves
    normally (the entry is complete then: a process still waiting finds it when it gets the lock
    on the removed file, and a later one finds it before locking)."""
    try:
        import fcntl
    except ImportError:                                 # Windows: no lock, at worst built twice
        yield
        return
    lock_path = os.path.join(root, f".{entry}.lock")
    with open(lock_path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            with slow_step(log, "waiting for another process building the same graph", 0.0):
                fcntl.flock(fh, fcntl.LOCK_EX)
        yield
        with contextlib.suppress(OSError):
            os.unlink(lock_path)


def _flavour_version(options_key: str) -> tuple[str, int] | None:
    """``(flavour, n)`` of an options key ``<flavour>@<n>-...`` (a graph flavour with a version
    of its own), else ``None``."""
    flavour, at, rest = options_key.partition("-")[0].partition("@")
    return (flavour, int(rest)) if at and rest.isdigit() else None


def _drop_outdated(root: str, digest: str, version: int, options_key: str = "") -> None:
    """Remove the graphs of the file of ``digest`` (entries ``<stem>-<digest[:16]>-b<v>-
    <options>``, any stem) built by a builder older than ``version``, whatever their options,
    and, for an ``options_key`` of a versioned flavour (``<flavour>@<n>-...``), those of the
    same builder and flavour at a smaller ``n``: this code never loads them again (a version
    bump would leave a graph larger than the GGUF behind for each)."""
    marker = f"-{digest[:16]}-b"
    current = _flavour_version(options_key)
    for name in os.listdir(root):
        at = name.find(marker)
        v, _, key = name[at + len(marker):].partition("-") if at > 0 else ("", "", "")
        other = _flavour_version(key)
        older_flavour = (current is not None and other is not None and v == str(version)
                         and other[0] == current[0] and other[1] < current[1])
        if v.isdigit() and int(v) < version or older_flavour:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log.info("removed the outdated graph %s", name)
