"""The sampler against brute-force definitions computed over the fully sorted vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_mindie.engine.request import SamplingParams
from tiny_mindie.engine.sampler import (apply_repetition_penalty, make_rng, nucleus_candidates,
                                        sample, top_k_candidates, typical_candidates)

V = 5000


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(0, 3, V).astype(np.float32)


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def brute_top_p(x, p):
    order = np.argsort(-x, kind="stable")
    probs = softmax(x[order].astype(np.float64))
    keep = []
    mass = 0.0
    for i, pi in zip(order, probs):
        keep.append(i)
        mass += pi
        if mass >= p:
            break
    return set(keep)


def test_repetition_penalty_follows_ctrl():
    x = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_repetition_penalty(x.copy(), np.array([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_top_k_returns_k_largest_sorted(logits):
    ids = top_k_candidates(logits, 40)
    assert set(ids) == set(np.argsort(-logits)[:40])
    assert np.all(np.diff(logits[ids]) <= 0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_alone_matches_definition(logits, p):
    x = logits / 0.7
    rng = make_rng(1)
    params = SamplingParams(do_sample=True, top_p=p)
    allowed = brute_top_p(x, p)
    seen = {sample(logits, SamplingParams(do_sample=True, temperature=0.7, top_p=p),
                   np.array([], dtype=np.int64), rng)[0] for _ in range(300)}
    assert seen <= allowed
    assert params.top_p == p


def test_nucleus_after_top_k_renormalises(logits):
    ids = top_k_candidates(logits, 50)
    kept = nucleus_candidates(logits, ids, 0.5)
    probs = softmax(logits[ids].astype(np.float64))
    n = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1
    assert list(kept) == list(ids[:n])


def test_typical_matches_definition():
    x = np.random.default_rng(3).normal(0, 2, 300).astype(np.float32)
    ids = top_k_candidates(x, 300)
    kept = set(typical_candidates(x, ids, 0.5).tolist())
    p = softmax(x.astype(np.float64))
    h = -(p * np.log(p)).sum()
    order = np.argsort(np.abs(-np.log(p) - h), kind="stable")
    cum = np.cumsum(p[order])
    expected = set(order[:int((cum < 0.5).sum()) + 1].tolist())
    assert kept == expected


def test_greedy_ignores_rng_and_applies_penalty():
    x = np.array([1.0, 3.0, 2.9], dtype=np.float32)
    tok, lp = sample(x, SamplingParams(do_sample=False), np.array([], dtype=np.int64), make_rng(0))
    assert tok == 1 and lp == pytest.approx(np.log(softmax(x.astype(np.float64))[1]))
    tok, _ = sample(x, SamplingParams(do_sample=False, repetition_penalty=1.5), np.array([1]),
                    make_rng(0))
    assert tok == 2


def test_same_seed_same_tokens_different_seed_differs(logits):
    p = SamplingParams(do_sample=True, temperature=1.5, top_k=100, top_p=0.95)
    empty = np.array([], dtype=np.int64)

    def run(seed):
        rng = make_rng(seed)
        return [sample(logits, p, empty, rng)[0] for _ in range(50)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sampling_frequencies_follow_probabilities():
    x = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float32))
    rng = make_rng(123)
    draws = [sample(x, SamplingParams(do_sample=True), np.array([], dtype=np.int64), rng)[0]
             for _ in range(6000)]
    freq = np.bincount(draws, minlength=3) / len(draws)
    assert np.allclose(freq, [0.5, 0.3, 0.2], atol=0.03)


def test_logprob_is_of_the_final_distribution(logits):
    p = SamplingParams(do_sample=True, top_k=2)
    tok, lp = sample(logits, p, np.array([], dtype=np.int64), make_rng(0))
    top2 = np.argsort(-logits)[:2]
    assert tok in top2
    assert lp == pytest.approx(np.log(softmax(logits[top2].astype(np.float64))[list(top2).index(tok)]))


@pytest.mark.parametrize("k", [1, 5, 40, 300, 4999, 5000])
def test_smallest_ids_is_exact_with_ties(k):
    from tiny_mindie.engine.sampler import smallest_ids
    a = np.random.default_rng(k).integers(0, 50, 200_000).astype(np.float32)   # many ties
    got = np.sort(smallest_ids(a, k))
    expected = np.sort(np.lexsort((np.arange(a.shape[0]), a))[:k])
    assert got.tolist() == expected.tolist()


def test_inverse_cdf_matches_cumsum():
    from tiny_mindie.engine.sampler import _inverse_cdf
    p = np.random.default_rng(1).random(262_144).astype(np.float32)
    cum = np.cumsum(p, dtype=np.float64)
    for u in (0.0, 1e-9, 0.25, 0.5, 0.999999, 0.9999999999):
        j, total = _inverse_cdf(p, u)
        assert total == pytest.approx(cum[-1])
        assert j == min(int(np.searchsorted(cum, u * cum[-1], side="right")), p.shape[0] - 1)


def test_large_vocab_typical_and_top_p_match_definitions():
    x = np.random.default_rng(4).normal(0, 4, 100_000).astype(np.float32)
    empty = np.array([], dtype=np.int64)
    allowed = brute_top_p(x, 0.5)
    rng = make_rng(3)
    assert {sample(x, SamplingParams(do_sample=True, top_p=0.5), empty, rng)[0]
            for _ in range(200)} <= allowed
    p = softmax(x.astype(np.float64))
    h = -(p * np.log(p)).sum()
    order = np.argsort(np.abs(-np.log(p) - h), kind="stable")
    typical = set(order[:int((np.cumsum(p[order]) < 0.3).sum()) + 1].tolist())
    assert {sample(x, SamplingParams(do_sample=True, typical_p=0.3), empty, rng)[0]
            for _ in range(200)} <= typical


def test_vocab_wide_nucleus_and_typical_sets_are_exact_on_a_zipf_distribution():
    from tiny_mindie.engine.sampler import _probs, nucleus_of_vocab, typical_of_vocab
    rng = np.random.default_rng(5)
    v = 262_144
    x = (-1.1 * np.log(np.arange(1, v + 1)) + rng.normal(0, 0.5, v)).astype(np.float32)
    x = x[rng.permutation(v)]
    p = _probs(x)
    order = np.lexsort((np.arange(v), -x))                       # logit descending, ties by id
    cum = np.cumsum(p[order], dtype=np.float64)
    for top_p in (0.3, 0.9):
        expected = order[:int(np.sum(cum < top_p)) + 1]
        assert nucleus_of_vocab(x, p, top_p).tolist() == expected.tolist()
    logp = np.log(p.astype(np.float64))
    h = -(p * logp).sum()
    dev = np.abs(-logp - h)
    by_dev = np.lexsort((np.arange(v), dev))
    cum = np.cumsum(p[by_dev], dtype=np.float64)
    expected = set(by_dev[:int(np.sum(cum < 0.9)) + 1].tolist())
    got = set(typical_of_vocab(x, p, 0.9).tolist())
    assert len(got ^ expected) <= 2        # float32 vs float64 deviations may swap an edge id
