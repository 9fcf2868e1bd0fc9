"""The encoder on the standard graph (``--graph standard``): operators Ascend's ONNX pages
document only, a fixed set of input shapes (rows a power of two, text lengths from a fixed
list), the numpy reference's vectors, and the same vector alone and in any batch."""

from __future__ import annotations

import numpy as np
import pytest
from embed_texts import TEXTS

from tiny_mindie.config.load import Config
from tiny_mindie.model.encoder_load import load_encoder
from tiny_mindie.model.encoder_pool import finish
from tiny_mindie.model.onnx import cann_ops
from tiny_mindie.model.onnx.encoder_graph import build_encoder
from tiny_mindie.model.ort.encoder_ort import EncoderSession
from tiny_mindie.model.reference.encoder import encode_one
from tiny_mindie.service.lifecycle import load_embedder


@pytest.fixture(scope="module")
def minilm(minilm_path):
    m = load_encoder(minilm_path)
    return m, EncoderSession(m, threads=1, flavour="standard")


@pytest.fixture(scope="module")
def nomic(nomic_path):
    m = load_encoder(nomic_path)
    return m, EncoderSession(m, threads=1, flavour="standard")


def _ids(model, texts=TEXTS) -> list[list[int]]:
    return [model.tokenizer.encode(t).ids for t in texts]


@pytest.mark.parametrize("which", ["minilm", "nomic"])
def test_the_standard_graph_is_the_reference(which, request):
    model, session = request.getfixturevalue(which)
    ids = _ids(model)
    ref = np.stack([encode_one(i, model.weights, model.config) for i in ids])
    got = session.encode(ids)
    assert (finish(ref) * finish(got)).sum(1).min() >= 0.9999


@pytest.mark.parametrize("which", ["minilm", "nomic"])
def test_alone_and_batched_the_same_and_only_the_static_shapes_run(which, request):
    model, session = request.getfixturevalue(which)
    ids = _ids(model)
    session.shapes_run.clear()
    alone = np.stack([session.encode([i])[0] for i in ids])
    together = session.encode(ids)
    crowd = session.encode([ids[0]] * 5 + ids[::-1] + [ids[3]] * 3)
    assert np.array_equal(alone, together)
    assert np.array_equal(crowd[:5], np.stack([alone[0]] * 5))
    assert np.array_equal(crowd[5:10], alone[::-1]) and np.array_equal(crowd[-1], alone[3])
    assert session.shapes_run <= set(session.static_shapes)
    session.shapes_run.clear()
    five = session.encode([ids[3]] * 5)                 # "x": 3 tokens, 5 rows padded to 8
    assert session.shapes_run == {(8, 16)} and np.array_equal(five[4], alone[3])
    widths = (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert session.widths == tuple(w for w in widths if w <= model.config.context)
    assert all(r & (r - 1) == 0 for r, _ in session.static_shapes)


def test_warm_up_runs_every_static_shape_once(minilm):
    model, _ = minilm
    session = EncoderSession(model, threads=1, max_rows=2, flavour="standard")
    assert session.shapes_run == set()              # the CPU's provider: no warm-up by itself
    assert session.warm_up() == len(session.static_shapes) == 2 * len(session.widths)
    assert session.shapes_run == set(session.static_shapes)
    assert session.encode([[101, 102]] * 3).shape == (3, model.config.hidden)  # 2 runs of 2


@pytest.mark.parametrize("which", ["minilm", "nomic"])
def test_the_standard_encoder_graph_has_only_documented_ascend_operators(which, request):
    model, _ = request.getfixturevalue(which)
    assert cann_ops.check_model(build_encoder(model.config, model.weights, standard=True)) == []
    contrib = cann_ops.check_model(build_encoder(model.config, model.weights))
    assert any("LayerNormalization" in p for p in contrib)      # the contrib graph is not


def test_the_embedding_model_follows_the_graph_setting(minilm_path):
    for graph, flavour in (("standard", "standard"), ("contrib", "contrib"),
                           ("auto", "contrib")):       # auto: contrib without the CANN provider
        cfg = Config().with_overrides(**{"backend.graph": graph,
                                         "model.embedding_model": minilm_path})
        embedder = load_embedder(cfg, lambda line: None)
        try:
            assert embedder.session.flavour == flavour
            assert bool(embedder.session.static_shapes) == (flavour == "standard")
        finally:
            embedder.close()
