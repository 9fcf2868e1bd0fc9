"""The sampler against brute-force definitions computed over the fully sorted vocabulary, and
batch rows against the same rows sampled alone."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from tiny_mindie.engine.request import SamplingParams
from tiny_mindie.engine.sampling import SampleRow, make_rng, sample, sample_batch, sample_with_top
from tiny_mindie.engine.sampling import batch as sampling_batch
from tiny_mindie.engine.sampling.candidates import (
    largest_ids,
    nucleus_candidates,
    top_k_candidates,
    typical_candidates,
)
from tiny_mindie.engine.sampling.draw import block_sums, inverse_cdf
from tiny_mindie.engine.sampling.penalties import apply_presence_frequency, apply_repetition_penalty
from tiny_mindie.engine.sampling.vocab_sets import (
    SAMPLE,
    dot,
    nucleus_of_vocab,
    typical_of_vocab,
    vocab_sets,
)
from tiny_mindie.engine.watermark import apply_watermark

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
    for i, pi in zip(order, probs, strict=True):
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
    assert lp == pytest.approx(
        np.log(softmax(logits[top2].astype(np.float64))[list(top2).index(tok)]))


@pytest.mark.parametrize("k", [1, 5, 40, 300, 4999, 5000])
def test_largest_ids_is_exact_with_ties(k):
    a = np.random.default_rng(k).integers(0, 50, 200_000).astype(np.float32)   # many ties
    got = np.sort(largest_ids(a, k))
    expected = np.sort(np.lexsort((np.arange(a.shape[0]), -a))[:k])
    assert got.tolist() == expected.tolist()


def test_inverse_cdf_matches_cumsum():
    p = np.random.default_rng(1).random(262_144).astype(np.float32)
    cum = np.cumsum(p, dtype=np.float64)
    sums = block_sums(p[None])[0]
    assert sums.sum() == pytest.approx(cum[-1])
    for u in (0.0, 1e-9, 0.25, 0.5, 0.999999, 0.9999999999):
        j = inverse_cdf(p, sums, u)
        assert j == min(int(np.searchsorted(cum, u * cum[-1], side="right")), p.shape[0] - 1)


def test_inverse_cdf_never_returns_a_zero_weight_id():
    p = np.zeros(5000, dtype=np.float32)          # an odd length: the last block is short
    p[[3, 1500, 4100]] = [1.0, 2.0, 1.0]
    sums = block_sums(p[None])[0]
    got = {inverse_cdf(p, sums, u) for u in np.linspace(0, 1, 101)[:-1]} | {
        inverse_cdf(p, sums, 1 - 1e-17)}
    assert got == {3, 1500, 4100}


def weights(x):
    w = np.exp(x - x.max()).astype(np.float32)
    return w, float(w.sum(dtype=np.float64))


def brute_typical(x, mass):
    """Typical set by the definition, in float64: ids by |-log p - H| (ties: lower id)."""
    p = softmax(x.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p)
        dev = np.where(p > 0, np.abs(-logp - np.nansum(-p * logp)), np.inf)
    order = np.lexsort((np.arange(x.shape[0]), dev))
    return order[:int(np.sum(np.cumsum(p[order]) < mass)) + 1]


def zipf(v, seed, scale=1.1):
    rng = np.random.default_rng(seed)
    x = (-scale * np.log(np.arange(1, v + 1)) + rng.normal(0, 0.5, v)).astype(np.float32)
    return x[rng.permutation(v)]


@pytest.mark.parametrize("scale", [0.3, 1.1, 3.0])      # flat (a huge nucleus) .. peaked
def test_vocab_wide_nucleus_and_typical_sets_are_exact_on_a_zipf_distribution(scale):
    v = 262_144
    x = zipf(v, 5, scale)
    w, z = weights(x)
    p = w / z
    order = np.lexsort((np.arange(v), -x))                       # logit descending, ties by id
    cum = np.cumsum(p[order], dtype=np.float64)
    for top_p in (0.3, 0.9, 0.99):
        expected = order[:int(np.sum(cum < top_p)) + 1]
        assert nucleus_of_vocab(x, w, z, top_p).tolist() == expected.tolist()
        assert nucleus_of_vocab(x, w, z, top_p, int(np.argmax(x))).tolist() == expected.tolist()
    for mass in (0.2, 0.9):
        got = set(typical_of_vocab(x, w, z, mass).tolist())
        expected = set(brute_typical(x, mass).tolist())
        assert len(got ^ expected) <= 2     # float32 vs float64 deviations may swap an edge id


@pytest.mark.parametrize("temperature", [0.6, 1.7])
def test_vocab_wide_sets_take_the_temperature_from_the_weights_alone(temperature):
    """The sampler never writes ``logits / T`` out: the sets are found on the raw logits, with
    the temperature only in the weights; they must be those of the definition on ``x / T``,
    up to the order of ids that only the division made equal (then the larger raw logit comes
    first instead of the lower id: the same probabilities in the same order)."""
    v = 262_144
    x = zipf(v, 9, 1.1) * 2
    xt = x / np.float32(temperature)
    w, z = weights(xt)
    p = w / z
    order = np.lexsort((np.arange(v), -xt))
    cum = np.cumsum(p[order], dtype=np.float64)
    for top_p in (0.5, 0.95):
        expected = order[:int(np.sum(cum < top_p)) + 1]
        got = nucleus_of_vocab(x, w, z, top_p)
        assert xt[got].tolist() == xt[expected].tolist()
    for mass in (0.3, 0.9):
        got = set(typical_of_vocab(x, w, z, mass).tolist())
        assert len(got ^ set(brute_typical(xt, mass).tolist())) <= 2


def test_vocab_wide_sets_break_ties_by_the_lower_id():
    x = np.random.default_rng(6).integers(-12, 0, 100_000).astype(np.float32)   # many ties
    w, z = weights(x)
    order = np.lexsort((np.arange(x.shape[0]), -x))
    cum = np.cumsum((w / z)[order], dtype=np.float64)
    for top_p in (0.1, 0.5):
        expected = order[:int(np.sum(cum < top_p)) + 1]
        assert nucleus_of_vocab(x, w, z, top_p).tolist() == expected.tolist()
    for mass in (0.1, 0.6):
        assert typical_of_vocab(x, w, z, mass).tolist() == top_k_candidates(x, x.shape[0])[
            np.isin(top_k_candidates(x, x.shape[0]), brute_typical(x, mass))].tolist()



def test_the_batched_first_round_gives_each_row_its_own_set():
    """Top-p and typical-p rows of a batch get their sets from one shared first round
    (``_vocab_sets``); flat rows (a nucleus of thousands, a centre below the largest sampled
    logit) go on alone. Every row's set is the one it gets alone, and the definition's."""
    v = 262_144
    x = np.stack([zipf(v, 40, 1.1) * 2, zipf(v, 41, 0.3), zipf(v, 42, 1.1) * 2, zipf(v, 43, 0.3),
                  zipf(v, 44, 3.0)])
    w = np.stack([weights(r)[0] for r in x])
    z = w.sum(axis=1, dtype=np.float64)
    typical = np.array([True, True, False, False, True])
    mass = np.array([0.9, 0.9, 0.95, 0.9, 0.5])
    center = np.where(typical, [dot(w[i], x[i]) / z[i] for i in range(5)], np.nan)
    assert not typical[1] or x[1, ::v // SAMPLE].max() >= center[1]      # one flat row
    got = vocab_sets(x, w, np.arange(5), mass * z, center)
    for i in range(5):
        alone = (typical_of_vocab if typical[i] else nucleus_of_vocab)(x[i], w[i], z[i], mass[i])
        if typical[i]:
            assert sorted(got[i].tolist()) == sorted(alone.tolist())
            assert len(set(alone.tolist()) ^ set(brute_typical(x[i], mass[i]).tolist())) <= 2
        else:
            assert got[i].tolist() == alone.tolist()
            assert set(alone.tolist()) == brute_top_p(x[i], mass[i])
    assert len(got[3]) > 1000                                   # the flat top-p row went on alone

KINDS = {
    "greedy": SamplingParams(),
    "greedy, penalties": SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                                        frequency_penalty=0.3),
    "temperature": SamplingParams(do_sample=True, temperature=0.7),
    "top_k": SamplingParams(do_sample=True, top_k=40),
    "top_k, top_p, typical_p": SamplingParams(do_sample=True, temperature=0.5, top_k=10, top_p=0.95,
                                              typical_p=0.5, repetition_penalty=1.03),
    "top_p": SamplingParams(do_sample=True, top_p=0.9),
    "typical_p": SamplingParams(do_sample=True, typical_p=0.9),
    "top_p, typical_p": SamplingParams(do_sample=True, temperature=1.3, top_p=0.8, typical_p=0.7),
    "watermark": SamplingParams(do_sample=True, temperature=0.7, watermark=True),
    "watermark, greedy": SamplingParams(watermark=True, repetition_penalty=1.2),
}


def row_for(kind, seed, logits_seen):
    return SampleRow(KINDS[kind], logits_seen, make_rng(seed), top_n=3 if seed % 2 else 0,
                     n_prompt=5)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_row_samples_the_same_alone_and_in_a_mixed_batch_of_eight(kind, split, monkeypatch):
    if split:                                   # half the batch on the helper thread
        monkeypatch.setattr(sampling_batch, "PARALLEL_MIN", 0)
        monkeypatch.setattr(sampling_batch, "_CPUS", 2)
    v = 20_000
    gen = np.random.default_rng(7)
    logits = np.stack([zipf(v, 10 + i, 0.8 + 0.1 * i) * 3 for i in range(8)])
    seen = [gen.integers(0, v, 12) for _ in range(8)]
    others = [k for k in KINDS if k != kind]
    dense = [k for k in others if KINDS[k].top_k == 0]     # a batch computed in one slice
    for pos, pool in ((0, others), (3, others), (7, others), (5, dense)):
        kinds = [pool[(pos + i) % len(pool)] for i in range(8)]
        kinds[pos] = kind
        batch = [row_for(k, i, seen[i]) for i, k in enumerate(kinds)]
        alone, single = row_for(kind, pos, seen[pos]), row_for(kind, pos, seen[pos])
        for _ in range(5):                      # several steps: the generators stay in step
            together = sample_batch(logits, batch)[pos]
            assert together == sample_batch(logits[pos:pos + 1], [alone])[0]
            assert together == sample_with_top(logits[pos], single.params, single.seen, single.rng,
                                               single.top_n, single.n_prompt)


def test_penalties_and_watermark_act_before_the_temperature():
    x = zipf(30_000, 8) * 3
    seen = np.random.default_rng(8).integers(0, 30_000, 40)
    ref = x.copy()
    apply_repetition_penalty(ref, seen, 1.3)
    apply_presence_frequency(ref, seen[5:], 0.4, 0.2)
    ref /= np.float32(0.7)
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.2)
    for seed in range(5):
        got = sample_with_top(x, params, seen, make_rng(seed), 3, 5)
        assert got == sample_with_top(ref, SamplingParams(do_sample=True, top_p=0.9), seen,
                                      make_rng(seed), 3, 5)
    marked = x.copy()
    apply_watermark(marked, int(seen[-1]))
    marked /= np.float32(0.7)
    params = SamplingParams(do_sample=True, temperature=0.7, top_k=50, watermark=True)
    for seed in range(5):
        tok, lp, _ = sample_with_top(x, params, seen, make_rng(seed))
        ref_tok, ref_lp, _ = sample_with_top(marked, SamplingParams(do_sample=True, top_k=50), seen,
                                             make_rng(seed))
        assert tok == ref_tok and lp == pytest.approx(ref_lp, abs=1e-5)


def test_batch_logprobs_follow_the_definitions():
    v = 262_144
    x = np.stack([zipf(v, 20, 1.1) * 2, zipf(v, 21, 0.9) * 2, zipf(v, 22, 1.3) * 2])
    params = [SamplingParams(do_sample=True, top_p=0.9),
              SamplingParams(do_sample=True, typical_p=0.9),
              SamplingParams(do_sample=True, temperature=0.8)]
    empty = np.array([], dtype=np.int64)
    rows = [SampleRow(p, empty, make_rng(i)) for i, p in enumerate(params)]
    for _ in range(20):
        (t0, lp0, _), (t1, lp1, _), (t2, lp2, _) = sample_batch(x, rows)
        nucleus = list(brute_top_p(x[0], 0.9))
        assert t0 in nucleus
        assert lp0 == pytest.approx(
            x[0, t0] - np.logaddexp.reduce(x[0, nucleus].astype(np.float64)))
        typical = brute_typical(x[1], 0.9)
        assert t1 in typical
        assert lp1 == pytest.approx(
            x[1, t1] - np.logaddexp.reduce(x[1, typical].astype(np.float64)))
        x2 = (x[2] / np.float32(0.8)).astype(np.float64)
        assert lp2 == pytest.approx(x2[t2] - np.logaddexp.reduce(x2))


def test_greedy_rows_draw_nothing_and_sampled_rows_draw_once():
    x = np.random.default_rng(2).normal(0, 2, (2, 1000)).astype(np.float32)
    empty = np.array([], dtype=np.int64)
    g, s = make_rng(5), make_rng(5)
    sample_batch(x, [SampleRow(SamplingParams(), empty, g),
                     SampleRow(SamplingParams(do_sample=True, top_p=0.5), empty, s)])
    assert g.random() == make_rng(5).random()
    ref = make_rng(5)
    ref.random()
    assert s.random() == ref.random()


def test_sample_batch_checks_its_rows_and_leaves_the_logits_alone():
    x = np.random.default_rng(2).normal(0, 2, (2, 1000)).astype(np.float32)
    before = x.copy()
    row = SampleRow(SamplingParams(do_sample=True, temperature=0.5, watermark=True,
                                   repetition_penalty=2.0), np.array([1, 2, 3]), make_rng(0))
    sample_batch(x, [row, row])
    assert np.array_equal(x, before)
    with pytest.raises(ValueError):
        sample_batch(x, [row])
    assert sample_batch(x[:0], []) == []


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_below_the_float32_range_is_greedy(temperature):
    x = zipf(30_000, 11) * 3
    seen = np.array([3, 4], np.int64)
    for params in (SamplingParams(do_sample=True, temperature=temperature),
                   SamplingParams(do_sample=True, temperature=temperature, top_p=1e-300,
                                  watermark=True),
                   SamplingParams(do_sample=True, temperature=temperature, top_k=5, typical_p=0.2)):
        greedy = SamplingParams(watermark=params.watermark)
        rng = make_rng(1)
        assert sample(x, params, seen, rng) == sample(x, greedy, seen, make_rng(2))
        assert rng.random() == make_rng(1).random()        # greedy draws nothing


@pytest.mark.parametrize("params", [SamplingParams(do_sample=True, temperature=1e308),
                                    SamplingParams(repetition_penalty=1e-300),
                                    SamplingParams(repetition_penalty=5e-324),
                                    SamplingParams(do_sample=True, repetition_penalty=1e300,
                                                   top_p=0.5),
                                    SamplingParams(repetition_penalty=1.7976931348623157e308,
                                                   watermark=True)])
def test_extreme_accepted_values_sample_quietly(params):
    x = zipf(30_000, 12) * 3
    seen = np.arange(0, 30_000, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")               # no numpy RuntimeWarning reaches the log
        tok, lp = sample(x, params, seen, make_rng(3))
    assert 0 <= tok < 30_000 and np.isfinite(lp) and lp <= 0.0


def test_a_row_that_breaks_the_sampler_fails_alone():
    """The engine samples a batch in one call; should one row's data break it, the other rows
    are sampled alone from their generators' states before the failed call (same tokens as if
    nothing had happened) and only the broken row gets None."""
    from tiny_mindie.engine.engine import Engine

    v = 20_000
    logits = np.stack([zipf(v, 20 + i) * 3 for i in range(3)])
    params = SamplingParams(do_sample=True, temperature=0.8, repetition_penalty=1.2)
    seen = np.array([1, 2, 3], np.int64)

    def rows(bad):
        return [SampleRow(params, seen, make_rng(1)), bad, SampleRow(params, seen, make_rng(3))]

    clean = sample_batch(logits, rows(SampleRow(params, seen, make_rng(2))))
    for bad in (SampleRow(params, np.array(["x"]), make_rng(2)),        # fails before any draw
                SampleRow(params, seen, SimpleNamespace(bit_generator=make_rng(2).bit_generator))):
        got = Engine._sample(logits, rows(bad))         # the second fails after row 0 drew
        assert got[1] is None
        assert got[0] == clean[0] and got[2] == clean[2]


@pytest.mark.parametrize("split", [False, True])
def test_overwrite_gives_the_same_tokens_and_restores_the_logits_on_an_error(split, monkeypatch):
    """The engine lets the sampler penalise and watermark its logits in place (no copy of the
    batch); the tokens are the same as with a copy, and an exception leaves the array as it was
    -- also the rows a helper thread finished without error (``split``)."""
    if split:
        monkeypatch.setattr(sampling_batch, "PARALLEL_MIN", 0)
        monkeypatch.setattr(sampling_batch, "_CPUS", 2)
    v = 20_000
    logits = np.stack([zipf(v, 30 + i) * 3 for i in range(6)])
    seen = np.random.default_rng(4).integers(0, v, 50)
    params = [SamplingParams(do_sample=True, temperature=0.5, top_k=10, top_p=0.95, typical_p=0.5,
                             repetition_penalty=1.03),
              SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
              SamplingParams(do_sample=True, top_p=0.9, frequency_penalty=0.4),
              SamplingParams(do_sample=True, temperature=0.7),
              SamplingParams(do_sample=True, temperature=0.7, watermark=True),
              SamplingParams(watermark=True, repetition_penalty=1.2, presence_penalty=0.3)]

    def rows(bad=False):
        out = [SampleRow(p, seen, make_rng(i), 2, 10) for i, p in enumerate(params)]
        if bad:      # a generator without random(): fails after the penalties were applied
            out[2] = SampleRow(params[2], seen, SimpleNamespace(bit_generator=None))
        return out

    copy_mode = sample_batch(logits, rows())
    own = logits.copy()
    assert sample_batch(own, rows(), overwrite=True) == copy_mode
    assert not np.array_equal(own, logits)                  # penalised in place
    for i in (4, 5):                                        # the watermarked rows too
        assert np.count_nonzero(own[i] != logits[i]) > v // 8
    own = logits.copy()
    with pytest.raises(AttributeError):
        sample_batch(own, rows(bad=True), overwrite=True)
    assert np.array_equal(own, logits)
