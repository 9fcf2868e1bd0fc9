"""The encoder written twice: the onnxruntime graph held to the numpy reference (cosine >= 0.9999
per text) on both registry embedding models, every pooling, and the batch-invariance promise:
a text's vector is the same, bit for bit, alone and in any batch (its padding is chosen by its
own length only)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from embed_texts import TEXTS

from tiny_mindie.model.encoder_load import load_encoder
from tiny_mindie.model.encoder_pool import bucket, finish, pool_weights
from tiny_mindie.model.ort.encoder_ort import EncoderSession
from tiny_mindie.model.reference.encoder import encode_one


@pytest.fixture(scope="module")
def minilm(minilm_path):
    m = load_encoder(minilm_path)
    return m, EncoderSession(m, threads=1)


@pytest.fixture(scope="module")
def nomic(nomic_path):
    m = load_encoder(nomic_path)
    return m, EncoderSession(m, threads=1)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (finish(a) * finish(b)).sum(1)


@pytest.mark.parametrize("which", ["minilm", "nomic"])
def test_the_graph_is_the_reference(which, request):
    model, session = request.getfixturevalue(which)
    ids = [model.tokenizer.encode(t).ids for t in TEXTS]
    ref = np.stack([encode_one(i, model.weights, model.config) for i in ids])
    got = session.encode(ids)
    assert got.shape == (len(TEXTS), model.config.hidden)
    assert cosines(ref, got).min() >= 0.9999
    # and the texts are told apart: related sentences closer than unrelated ones
    v = finish(got)
    assert v[0] @ v[1] > v[0] @ v[3]


@pytest.mark.parametrize("which", ["minilm", "nomic"])
def test_a_vector_is_the_same_alone_and_in_any_batch(which, request):
    model, session = request.getfixturevalue(which)
    ids = [model.tokenizer.encode(t).ids for t in TEXTS]
    alone = np.stack([session.encode([i])[0] for i in ids])
    together = session.encode(ids)
    shuffled = session.encode(ids[::-1] + ids)[:len(ids)][::-1]
    assert np.array_equal(alone, together) and np.array_equal(alone, shuffled)
    crowd = session.encode([ids[0]] * 9 + [ids[3]] * 3)      # same bucket, more rows
    assert np.array_equal(crowd[0], alone[0]) and np.array_equal(crowd[-1], alone[3])


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_cls_and_last_pooling(minilm, pooling):
    model, _ = minilm
    m = replace(model, config=replace(model.config, pooling=pooling))
    session = EncoderSession(m, threads=1)
    ids = [m.tokenizer.encode(t).ids for t in TEXTS[:3]]
    ref = np.stack([encode_one(i, m.weights, m.config) for i in ids])
    assert cosines(ref, session.encode(ids)).min() >= 0.9999
    mean = np.stack([encode_one(i, model.weights, model.config) for i in ids])
    assert cosines(ref, mean).max() < 0.9999                 # a different vector indeed


def test_pool_weights_and_buckets():
    w = pool_weights([3, 1], 4, "mean")
    assert np.allclose(w, [[1 / 3, 1 / 3, 1 / 3, 0], [1, 0, 0, 0]])
    assert pool_weights([3], 4, "cls").tolist() == [[1, 0, 0, 0]]
    assert pool_weights([3], 4, "last").tolist() == [[0, 0, 1, 0]]
    assert [bucket(n) for n in (1, 16, 17, 128, 129, 256, 257, 2048, 2049)] == \
        [16, 16, 32, 128, 144, 256, 288, 2048, 2304]
    assert all(n <= bucket(n) < n + max(16, n / 8) for n in range(1, 9000))
    assert all(bucket(bucket(n)) == bucket(n) for n in range(1, 9000))


def test_finish_normalizes_truncates_and_never_makes_nan():
    rng = np.random.default_rng(0)
    v = rng.standard_normal((3, 768)).astype(np.float32)
    assert np.allclose(np.linalg.norm(finish(v), axis=1), 1.0, atol=1e-5)
    cut = finish(v, dimensions=256)
    assert cut.shape == (3, 256) and np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(finish(v, dimensions=768), finish(v))
    raw = finish(v, normalize=False)
    assert np.array_equal(raw, v)
    zero = finish(np.zeros((1, 8), np.float32))
    assert not np.isnan(zero).any() and not zero.any()


def test_bad_ids_are_refused(minilm):
    model, session = minilm
    for bad in ([], [101] * (model.config.context + 1), [101, 30522, 102], [-1]):
        with pytest.raises(ValueError, match="ids"):
            session.encode([bad])
        with pytest.raises(ValueError, match="ids"):
            encode_one(bad, model.weights, model.config)
