"""The cache of built graphs: build the ONNX graph of a GGUF once, load it on later starts.

An entry is a directory ``<gguf stem>-<sha256[:16]>-b<BUILDER_VERSION>-<GraphOptions.key()>``
holding ``model.onnx``, ``model.onnx.data`` and a ``complete`` marker, under
``<dir of the GGUF>/onnx-cache/`` (or ``cache_dir``; when that directory is not writable,
``$TINY_MINDIE_CACHE/onnx`` or ``~/.cache/tiny_mindie/onnx``). A graph is built into a temporary
directory beside the entry and renamed into place, so a reader never sees a half-written entry.
Building or loading a graph removes the model's graphs from older builder versions.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

from .config import ModelConfig
from .gguf import GGUFFile, ModelFileError
from .graph import BUILDER_VERSION, GraphOptions, build_model
from .registry import cache_root, sha256_of

log = logging.getLogger(__name__)


def cached_graph(f: GGUFFile, config: ModelConfig, options: GraphOptions = GraphOptions(),
                 cache_dir: str | None = None) -> tuple[str, bool]:
    """Path of the built graph for ``f``, building it on a miss.

    Returns:
        ``(path of model.onnx, True if it was built now)``.

    Raises:
        ModelFileError: no cache directory is writable, or the graph cannot be built
            (see :func:`.graph.build_model`).
    """
    digest = sha256_of(f.path)
    stem = os.path.splitext(os.path.basename(f.path))[0]
    entry = f"{stem}-{digest[:16]}-b{BUILDER_VERSION}-{options.key()}"
    roots = ([cache_dir] if cache_dir else
             [os.path.join(os.path.dirname(os.path.abspath(f.path)), "onnx-cache"),
              os.path.join(cache_root(), "onnx")])
    for root in roots:
        path = os.path.join(root, entry, "model.onnx")
        if os.path.isfile(os.path.join(root, entry, "complete")):
            _drop_outdated(root, f"{stem}-{digest[:16]}-b")     # left by an older version, if any
            return path, False
    last_error: Exception | None = None
    for root in roots:
        try:
            os.makedirs(root, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".build-", dir=root)
        except OSError as exc:
            last_error = exc
            continue
        try:
            build_model(f, config, tmp, options)
            with open(os.path.join(tmp, "complete"), "w") as fh:
                fh.write(f"sha256 {digest}\nbuilder {BUILDER_VERSION}\noptions {options.key()}\n")
            final = os.path.join(root, entry)
            try:
                os.rename(tmp, final)
            except OSError:                     # another process built it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
            _drop_outdated(root, f"{stem}-{digest[:16]}-b")
            return os.path.join(final, "model.onnx"), True
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    raise ModelFileError(f"no writable directory for the ONNX graph cache ({last_error})")


def _drop_outdated(root: str, prefix: str) -> None:
    """Remove this model's graphs (entries ``prefix + version + "-" + options``) built by an
    older builder, whatever their options: this code never loads them again (a builder version
    bump would leave ~1.5x the GGUF behind for each)."""
    for name in os.listdir(root):
        version = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if version.isdigit() and int(version) < BUILDER_VERSION:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log.info("removed the outdated graph %s", name)
