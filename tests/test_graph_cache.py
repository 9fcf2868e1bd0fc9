"""The cache of built graphs (tiny_mindie/model/graph_cache.py) on the real SmolLM2-135M."""

from __future__ import annotations

import os

from tiny_mindie.model import graph_cache
from tiny_mindie.model.config import ModelConfig
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.graph import BUILDER_VERSION, GraphOptions
from tiny_mindie.model.registry import sha256_of


def test_building_a_graph_removes_older_builders_graphs_of_the_model(model_path, tmp_path):
    """A builder version bump would leave the old graphs (1.5x the GGUF each) in the cache
    forever; the new build removes the model's graphs of older builders, whatever options they
    were built with, and keeps the current builder's graphs with other options and other
    models' graphs."""
    gguf = GGUFFile(model_path)
    config = ModelConfig.from_gguf(gguf)
    key = GraphOptions().key()
    digest = sha256_of(gguf.path)[:16]
    stem = os.path.splitext(os.path.basename(gguf.path))[0]
    version = BUILDER_VERSION
    old = tmp_path / f"{stem}-{digest}-b{version - 1}-{key}"
    old_options = tmp_path / f"{stem}-{digest}-b{version - 1}-a4-h4-p0"    # an older key format
    other_options = tmp_path / f"{stem}-{digest}-b{version}-a0-h0-l32-p0"
    other_model = tmp_path / f"other-{digest}-b{version - 1}-{key}"
    for d in (old, old_options, other_options, other_model):
        d.mkdir()
        (d / "complete").write_text("")
    path, built = graph_cache.cached_graph(gguf, config, GraphOptions(), str(tmp_path))
    assert built and os.path.isfile(path)
    assert not old.exists() and not old_options.exists()
    assert other_options.exists() and other_model.exists()
    old.mkdir()                     # left by an older version that ran after this one built
    again, built = graph_cache.cached_graph(gguf, config, GraphOptions(), str(tmp_path))
    assert again == path and not built and not old.exists() and other_options.exists()
