"""The embedding requests' parsing (three families' bodies) and the batching thread, on the real
all-MiniLM-L6-v2 and nomic-embed-text-v1.5 models, in process."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_mindie.api.embeddings_request import MAX_INPUTS, parse_llama, parse_openai, parse_tei
from tiny_mindie.api.errors import APIError
from tiny_mindie.engine.embedder import Embedder
from tiny_mindie.model.encoder_load import load_encoder
from tiny_mindie.model.ort.encoder_ort import EncoderSession


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return load_encoder(minilm_path)


@pytest.fixture(scope="module")
def nomic_cfg(nomic_path):
    m = load_encoder(nomic_path)
    return m.tokenizer, m.config


def test_openai_inputs(minilm):
    tok, cfg = minilm.tokenizer, minilm.config
    one = parse_openai({"input": "hello"}, tok, cfg)
    assert one.ids == [[101, 7592, 102]] and not one.base64 and one.dimensions is None
    assert parse_openai({"input": ["a", "b"]}, tok, cfg).ids == [[101, 1037, 102],
                                                                  [101, 1038, 102]]
    assert parse_openai({"input": [101, 7592, 102]}, tok, cfg).ids == [[101, 7592, 102]]
    assert parse_openai({"input": [[101, 102], [7592]], "encoding_format": "base64"},
                        tok, cfg).base64
    assert parse_openai({"input": "x", "dimensions": 384}, tok, cfg).dimensions is None


@pytest.mark.parametrize("body, field", [
    ({}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"),
    ({"input": [""]}, "input"), ({"input": [[]]}, "input"), ({"input": [30522]}, "input"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"), ({"input": "x " * 300}, "input"),
    ({"input": [1.5]}, "input"), ({"input": "x", "dimensions": 128}, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "best": 1}, "best")])
def test_openai_bad_bodies_name_the_field(minilm, body, field):
    with pytest.raises(APIError) as err:
        parse_openai(body, minilm.tokenizer, minilm.config)
    assert err.value.param == field and err.value.status in (400, 422, 424)


def test_matryoshka_dimensions_and_prompt_names(nomic_cfg):
    tok, cfg = nomic_cfg
    assert parse_openai({"input": "x", "dimensions": 256}, tok, cfg).dimensions == 256
    with pytest.raises(APIError, match="768, 512, 256, 128, 64"):
        parse_openai({"input": "x", "dimensions": 300}, tok, cfg)
    job = parse_tei({"inputs": "what is tsne", "prompt_name": "search_query"}, tok, cfg)
    assert job.ids == parse_tei({"inputs": "search_query: what is tsne"}, tok, cfg).ids
    with pytest.raises(APIError, match="prompt_name"):
        parse_tei({"inputs": "x", "prompt_name": "query"}, tok, cfg)


def test_tei_truncation(minilm):
    tok, cfg = minilm.tokenizer, minilm.config
    long = " ".join(str(i) for i in range(400))
    with pytest.raises(APIError, match="at most 256"):
        parse_tei({"inputs": long}, tok, cfg)
    right = parse_tei({"inputs": [long], "truncate": True}, tok, cfg).ids[0]
    left = parse_tei({"inputs": long, "truncate": True, "truncation_direction": "Left"},
                     tok, cfg).ids[0]
    assert len(right) == len(left) == 256 and right[0] == left[0] == 101
    assert right[-1] == left[-1] == 102 and right[1:3] != left[1:3]
    assert not parse_tei({"inputs": "x", "normalize": False}, tok, cfg).normalize
    assert parse_llama({"content": "hello"}, tok, cfg).ids == [[101, 7592, 102]]


def test_the_embedder_batches_and_keeps_each_vector(minilm):
    session = EncoderSession(minilm, threads=1)
    emb = Embedder(session)
    try:
        texts = [minilm.tokenizer.encode(t).ids for t in ("a cat", "a dog " * 20, "tea")]
        alone = [session.encode([t]) for t in texts]
        futures = [emb.submit([t]) for t in texts] + [emb.submit(texts)]
        got = [f.result(timeout=120) for f in futures]
        for i in range(3):
            assert np.array_equal(got[i], alone[i])
            assert np.array_equal(got[3][i], alone[i][0])
        bad = emb.submit([[101, 99999, 102]])
        with pytest.raises(ValueError):
            bad.result(timeout=120)
        assert emb.submit(texts[:1]).result(timeout=120).shape == (1, 384)
    finally:
        emb.close()
    s = emb.stats
    assert s.requests == 5 and s.inputs == 7 and s.batches >= 1
    assert sum(s.batch_sizes) == s.inputs
    buckets, total, runs = s.histogram()
    assert buckets[-1] == (float("inf"), s.batches) and (total, runs) == (s.inputs, s.batches)
    assert buckets[0][1] == sum(1 for n in s.batch_sizes if n == 1)
    assert emb.idle() and emb.pending == 0 and not emb.alive


def test_long_texts_run_fewer_rows_at_a_time_with_the_same_vectors(minilm, monkeypatch):
    """The rows of one run are capped by their attention scores (``MAX_SCORES``): a cap of one
    row per run gives the vectors of the default batching."""
    from tiny_mindie.model.ort import encoder_ort

    session = EncoderSession(minilm, threads=1)
    texts = [minilm.tokenizer.encode(f"text {i} " * 40).ids for i in range(3)]
    runs = []
    real = session._run
    monkeypatch.setattr(session, "_run", lambda t, w, n: runs.append(len(t)) or real(t, w, n))
    batched = session.encode(texts)
    monkeypatch.setattr(encoder_ort, "MAX_SCORES", 1)
    single = session.encode(texts)
    assert runs == [3, 1, 1, 1]
    assert np.array_equal(batched, single)
