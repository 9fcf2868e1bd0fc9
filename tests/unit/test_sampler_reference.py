"""The fast batch sampler against the plain reference (``engine/sampling/reference.py``): for
the same logits, parameters and uniform number, the same token, and logprobs equal to float32
rounding -- on random logits and parameter combinations (hypothesis), also with the ``-inf``
logits of a grammar's token mask (constrained decoding: the engine masks, then samples)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tiny_mindie.engine.request import SamplingParams
from tiny_mindie.engine.sampling import (
    SampleRow,
    make_rng,
    reference,
    sample_batch,
    sample_with_top,
)

SHIFT = 5e-6        # how far the coin and the masses move to tell a boundary case (the float32
                    # weights put the running probabilities within 1e-6 of float64 ones)
TOL = 1e-4          # logprobs: float32 weights against float64


def random_logits(kind: str, seed: int, v: int) -> np.ndarray:
    """float32 ``[v]``: normal, Zipf-like (a real model's heavy head), integer (many ties), or
    normal with one id far ahead."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.normal(0, rng.uniform(0.5, 5), v).astype(np.float32)
    if kind == "zipf":
        x = -rng.uniform(0.3, 3) * np.log(np.arange(1, v + 1)) + rng.normal(0, 0.5, v)
        return (x[rng.permutation(v)] * rng.uniform(1, 4)).astype(np.float32)
    if kind == "ties":
        return rng.integers(-8, 0, v).astype(np.float32)
    x = rng.normal(0, 2, v).astype(np.float32)
    x[rng.integers(0, v)] += 12
    return x


unit_mass = st.one_of(st.just(1.0), st.floats(0.02, 0.995))
params_st = st.builds(
    SamplingParams,
    do_sample=st.sampled_from([True, True, True, False]),
    temperature=st.one_of(st.just(1.0), st.floats(0.1, 4.0), st.just(1e-6)),
    top_k=st.sampled_from([0, 0, 0, 1, 3, 40, 100_000]),
    top_p=unit_mass,
    typical_p=unit_mass,
    repetition_penalty=st.sampled_from([1.0, 1.0, 1.3, 0.7]),
    presence_penalty=st.sampled_from([0.0, 0.0, 0.5, -0.4]),
    frequency_penalty=st.sampled_from([0.0, 0.0, 0.3]),
    watermark=st.sampled_from([False, False, False, True]),
    min_p=st.sampled_from([0.0, 0.0, 0.0, 0.02, 0.3]),
    seed=st.integers(0, 2**63 - 1))

row_st = st.tuples(st.sampled_from(["normal", "zipf", "ties", "peaked"]), st.integers(0, 2**32 - 1),
                   params_st, st.integers(0, 4), st.integers(0, 40),   # ..., top_n, len(seen),
                   st.sampled_from([None, None, 5, 40, 0.5]))          # tokens a mask allows


def masked(x: np.ndarray, allowed, seed: int) -> np.ndarray:
    """``x`` with all but ``allowed`` ids (a count, or a fraction of the vocabulary; at least
    5, more than ``top_n``) at ``-inf``, as :func:`~tiny_mindie.engine.constraint.apply_bitmask`
    leaves a constrained row; ``None``: ``x`` as it is."""
    if allowed is None or x.shape[0] <= 5:
        return x
    n = max(5, int(allowed * x.shape[0]) if isinstance(allowed, float) else allowed)
    keep = np.random.default_rng(seed).permutation(x.shape[0])[:n]
    out = np.full_like(x, -np.inf)
    out[keep] = x[keep]
    return out


def shifted(value: float) -> list[float]:
    """``value`` (a mass below 1, or a coin) moved by ``SHIFT`` both ways, staying below 1."""
    return [min(max(value + d, 1e-9), 1 - 1e-9) for d in (-SHIFT, SHIFT)]


def clear_choice(x, params, coin, seen, n_prompt, top_n):
    """The reference's ``(token, logprob, top)``, or None when the coin or a filter's mass lies
    within ``SHIFT`` of a boundary: when moving one of them changes the token or the logprob."""
    got = reference.sample(x, params, coin, seen, n_prompt, top_n)
    variants = [(params, c) for c in shifted(coin)]
    if params.top_p < 1:
        variants += [(SamplingParams(**{**vars(params), "top_p": m}), coin)
                     for m in shifted(params.top_p)]
    if params.typical_p < 1:
        variants += [(SamplingParams(**{**vars(params), "typical_p": m}), coin)
                     for m in shifted(params.typical_p)]
    if params.min_p > 0:
        variants += [(SamplingParams(**{**vars(params), "min_p": m}), coin)
                     for m in shifted(params.min_p)]
    for p, c in variants:
        tok, lp, _ = reference.sample(x, p, c, seen, n_prompt, top_n)
        if tok != got[0] or abs(lp - got[1]) > TOL:
            return None
    return got


def assert_same(fast, ref):
    assert fast[0] == ref[0]
    assert fast[1] == pytest.approx(ref[1], abs=TOL, rel=TOL)
    if ref[2] is None:
        assert fast[2] is None
    else:
        assert [i for i, _ in fast[2]] == [i for i, _ in ref[2]]
        assert ([lp for _, lp in fast[2]]
                == pytest.approx([lp for _, lp in ref[2]], abs=TOL, rel=TOL))


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])      # a loaded host is slow, not wrong
@given(v=st.sampled_from([2, 17, 300, 1000, 5000, 20_000, 49_152]),
       rows=st.lists(row_st, min_size=1, max_size=4))
def test_the_batch_sampler_picks_the_reference_token_for_the_same_uniform_number(v, rows):
    x = np.stack([masked(random_logits(kind, seed, v), allowed, seed)
                  for kind, seed, *_, allowed in rows])
    gen = np.random.default_rng(v)
    seen = [gen.integers(0, v, n) for *_, n, _ in rows]
    batch = [SampleRow(p, s, make_rng(p.seed), top_n, len(s) // 3)
             for (_, _, p, top_n, _, _), s in zip(rows, seen, strict=True)]
    fast = sample_batch(x, batch)
    checked = 0
    for i, row in enumerate(batch):
        coin = make_rng(row.params.seed).random()     # the row generator's one draw
        ref = clear_choice(x[i], row.params, coin, row.seen, row.n_prompt, row.top_n)
        if ref is not None:
            assert_same(fast[i], ref)
            checked += 1
    assume(checked)                 # hypothesis fails a test whose examples are mostly unchecked


@pytest.mark.parametrize("params", [SamplingParams(do_sample=True, top_p=0.9),
                                    SamplingParams(do_sample=True, temperature=0.7),
                                    SamplingParams(do_sample=True, typical_p=0.8, top_k=50),
                                    SamplingParams(do_sample=True, min_p=0.05),
                                    SamplingParams(do_sample=True, min_p=0.1, top_p=0.8)])
def test_every_coin_picks_the_reference_token(params):
    """One row, many coins: the fast path's token for the generator's draw is the reference's
    token for that number, whatever the number (the rare boundary coins aside)."""
    x = random_logits("zipf", 3, 5000)
    checked = 0
    for seed in range(200):
        p = SamplingParams(**{**vars(params), "seed": seed})
        ref = clear_choice(x, p, make_rng(seed).random(), np.array([], np.int64), 0, 2)
        if ref is not None:
            assert_same(sample_with_top(x, p, np.array([], np.int64), make_rng(seed), 2), ref)
            checked += 1
    assert checked >= 190


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["normal", "zipf", "ties", "peaked"]), seed=st.integers(0, 2**32 - 1),
       min_p=st.floats(0.001, 1.0), temperature=st.floats(0.2, 3.0), top_k=st.sampled_from([0, 40]),
       seeds=st.lists(st.integers(0, 2**63 - 1), min_size=8, max_size=8))
def test_min_p_draws_only_tokens_at_least_min_p_times_the_most_likely(kind, seed, min_p,
                                                                       temperature, top_k, seeds):
    """A numpy oracle of min-p: after the temperature, an id is kept when its probability is at
    least ``min_p`` times the largest; every token drawn is kept, its logprob is its share of the
    kept mass, and a row draws the same token alone or in a batch beside other rows."""
    x = random_logits(kind, seed, 3000)
    z = x.astype(np.float64) / temperature
    prob = np.exp(z - z.max())
    prob /= prob.sum()
    ratio = prob / prob.max()
    kept = ratio >= min_p
    clear = np.abs(ratio - min_p) > 1e-5              # float32 rounding decides the rest
    if top_k:                          # the first k by logit descending, ties: the lower id
        first = np.zeros_like(kept)
        first[np.argsort(-z, kind="stable")[:top_k]] = True
        kept &= first
    others = np.stack([random_logits("normal", seed + 1, 3000), x])
    for s in seeds:
        p = SamplingParams(do_sample=True, temperature=temperature, min_p=min_p, top_k=top_k,
                           seed=s)
        tok, lp, _ = sample_with_top(x, p, np.array([], np.int64), make_rng(s))
        if not clear[tok]:
            continue
        assert kept[tok]
        assert lp == pytest.approx(np.log(prob[tok] / prob[kept].sum()), abs=1e-3)
        other = SamplingParams(do_sample=True, top_p=0.9, seed=7)
        batch = sample_batch(others, [SampleRow(other, np.array([], np.int64), make_rng(7)),
                                      SampleRow(p, np.array([], np.int64), make_rng(s))])
        assert batch[1][0] == tok
