"""Next-token selection: logits processors and sampling, as small pure numpy functions.

Order of the processors is Hugging Face's / TGI's: repetition penalty, the watermark bias when
asked (:mod:`.watermark`), then temperature, top-k, top-p, typical-p, each working on the
distribution the previous one left.

Cost: the whole vocabulary is never sorted. Work over all ``V`` logits is a few O(V) float32
passes (max, exp, sum, a strided threshold for top-k, a bucketed mass histogram for top-p and
typical-p); sorting happens only inside the candidate set (top-k, the nucleus, the typical set). With Gemma's 262,144-token vocabulary that keeps a sampled row near a
millisecond.

Every request has its own ``numpy.random.Generator`` (PCG64) seeded from its ``seed``, and draws
exactly one uniform number per sampled token, so a seed fixes the output whatever else is in
the batch.
"""

from __future__ import annotations

import numpy as np

from .request import SamplingParams
from .watermark import apply_watermark



def make_rng(seed: int) -> np.random.Generator:
    """The per-request generator for ``seed`` (0 .. 2**63-1)."""
    return np.random.Generator(np.random.PCG64(seed))


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL repetition penalty (Keskar et al. 2019, sec. 4.1), as in HF transformers.

    Args:
        logits: float32 ``[vocab]``, modified in place and returned.
        seen: int ``[n]`` ids already in prompt + output (duplicates allowed).
        penalty: > 0. A seen token's positive logit is divided by it, a negative one multiplied.
    """
    if penalty == 1.0 or seen.size == 0:
        return logits
    ids = np.unique(seen)
    ids = ids[ids < logits.shape[0]]
    vals = logits[ids]
    logits[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return logits


def _probs(x: np.ndarray) -> np.ndarray:
    """softmax over all of ``x`` in float32 (one exp pass); float32 ``[V]``."""
    p = np.exp(x - np.max(x))
    p /= p.sum(dtype=np.float64)
    return p


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a small 1-D array (a candidate pool)."""
    x = x.astype(np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def _sort_desc(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` ordered by logit descending, ties by id (so the order never depends on how
    ``argpartition`` happened to return them)."""
    ids = np.sort(ids)
    return ids[np.argsort(-logits[ids], kind="stable")]


def smallest_ids(a: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` smallest values of ``a`` (ties broken by the lower id), unordered.

    Exact, and cheaper than ``argpartition`` on a large array: a threshold taken from a strided
    sample keeps only a few hundred candidates in one vectorised pass; if fewer than ``k``
    values fall under it, the full ``argpartition`` runs instead.
    """
    v = a.shape[0]
    if k >= v:
        return np.arange(v)
    stride = 64
    if v >= 16 * stride and k * stride * 4 < v:
        sample = a[::stride]
        t = np.partition(sample, min(2 * (k // stride + 1), sample.shape[0] - 1))[
            min(2 * (k // stride + 1), sample.shape[0] - 1)]
        cand = np.flatnonzero(a <= t)
        if cand.shape[0] >= k:   # the k smallest are all <= t, so all are in cand
            return cand[np.lexsort((cand, a[cand]))[:k]]
    ids = np.argpartition(a, k - 1)[:k]
    edge = a[ids].max()             # settle ties at the edge by the lower id
    tied = np.flatnonzero(a == edge)
    if tied.shape[0] > np.count_nonzero(a[ids] == edge):
        below = ids[a[ids] < edge]
        ids = np.concatenate([below, tied[:k - below.shape[0]]])
    return ids


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits, ordered by logit descending; O(V + k log k)."""
    v = logits.shape[0]
    ids = np.arange(v) if k <= 0 or k >= v else smallest_ids(-logits, k)
    return _sort_desc(logits, ids)


def _prefix_reaching(mass: np.ndarray, target: float) -> int:
    """Length of the shortest prefix whose cumulative mass reaches ``target`` (at least 1)."""
    return max(1, min(int(np.searchsorted(np.cumsum(mass), target, side="left")) + 1, mass.shape[0]))


def nucleus_candidates(logits: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p filter (Holtzman et al. 2020) inside a pool: the shortest prefix of ``ids`` (sorted
    by logit descending) whose mass, renormalised over the pool, reaches ``top_p``."""
    if top_p >= 1.0:
        return ids
    return ids[:_prefix_reaching(np.exp(_log_softmax(logits[ids])), top_p)]


def _lightest_prefix(key: np.ndarray, p: np.ndarray, target: float,
                     per_unit: int = 16, buckets: int = 4096) -> np.ndarray:
    """The ids with the smallest ``key`` (ties: lower id first), in that order, up to and
    including the one where their mass ``p`` first reaches ``target``.

    One O(V) pass buckets ``key`` (>= 0) into ``1/per_unit``-wide buckets and sums the mass of
    each (``bincount``); only the buckets up to the one where the running mass reaches
    ``target`` are sorted. key: float32 ``[V]``; p: float32 ``[V]`` probabilities.
    """
    b = np.minimum(key * np.float32(per_unit), buckets - 1).astype(np.int32)
    mass = np.bincount(b, weights=p, minlength=buckets)
    last = min(int(np.searchsorted(np.cumsum(mass), target)), buckets - 1)
    cand = np.flatnonzero(b <= last)
    cand = cand[np.lexsort((cand, key[cand]))]
    cum = np.cumsum(p[cand], dtype=np.float64)
    return cand[:min(int(np.sum(cum < target)) + 1, cand.shape[0])]


def nucleus_of_vocab(logits: np.ndarray, p: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p over the whole vocabulary without sorting it (Holtzman et al. 2020): the most likely
    ids, by logit descending, until their mass ``p`` reaches ``top_p``."""
    return _lightest_prefix(np.max(logits) - logits, p, top_p)


def typical_candidates(logits: np.ndarray, ids: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical filter (Meister et al. 2022, sec. 4; HF ``TypicalLogitsWarper``) inside a
    pool: keep the ids whose surprisal ``-log p`` is closest to the entropy ``H`` of the pool's
    distribution, fewest first, until their mass reaches ``mass``. Sorted by logit descending."""
    if mass >= 1.0:
        return ids
    logp = _log_softmax(logits[ids])
    p = np.exp(logp)
    entropy = -np.sum(np.where(p > 0, p * logp, 0.0))
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    kept = ids[order[:int(np.sum(np.cumsum(p[order]) < mass)) + 1]]
    return _sort_desc(logits, kept)


def typical_of_vocab(logits: np.ndarray, p: np.ndarray, mass: float) -> np.ndarray:
    """Typical-p over the whole vocabulary without sorting it: the entropy is one O(V) pass;
    the ids closest to it, until their mass reaches ``mass``, sorted by logit descending."""
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p)
        entropy = -np.nansum(p * logp, dtype=np.float64)
        dev = np.abs(-logp - np.float32(entropy))
    dev[p == 0] = np.inf
    return _sort_desc(logits, _lightest_prefix(dev, p, mass))


def _inverse_cdf(p: np.ndarray, u: float, block: int = 1024) -> tuple[int, float]:
    """Index ``j`` where the running sum of ``p`` first passes ``u * sum(p)``, and the sum;
    two levels (block sums, then one block) instead of a cumulative sum over all of ``p``."""
    v = p.shape[0]
    n_full = v // block
    sums = p[:n_full * block].reshape(n_full, block).sum(axis=1, dtype=np.float64)
    if n_full * block < v:
        sums = np.append(sums, p[n_full * block:].sum(dtype=np.float64))
    cum_blocks = np.cumsum(sums)
    total = float(cum_blocks[-1])
    target = u * total
    b = min(int(np.searchsorted(cum_blocks, target, side="right")), sums.shape[0] - 1)
    before = float(cum_blocks[b - 1]) if b else 0.0
    inside = np.cumsum(p[b * block:(b + 1) * block], dtype=np.float64)
    j = min(int(np.searchsorted(inside, target - before, side="right")), inside.shape[0] - 1)
    return b * block + j, total


def apply_presence_frequency(logits: np.ndarray, output: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties on the generated tokens (not the prompt):
    ``logit -= frequency * count + presence * (count > 0)``; ``logits`` is modified in place."""
    if (presence == 0.0 and frequency == 0.0) or output.size == 0:
        return logits
    ids, counts = np.unique(output[output < logits.shape[0]], return_counts=True)
    logits[ids] -= np.float32(frequency) * counts.astype(np.float32) + np.float32(presence)
    return logits


def sample(logits: np.ndarray, params: SamplingParams, seen: np.ndarray,
           rng: np.random.Generator) -> tuple[int, float]:
    """Choose the next token of one sequence.

    Args:
        logits: float32 ``[vocab]`` next-token logits (not modified).
        params: the request's sampling parameters.
        seen: int ``[n]`` prompt + generated ids, for the repetition penalty and the watermark.
        rng: the request's generator; one ``random()`` draw per sampled token, none when greedy.

    Returns:
        ``(token_id, logprob)``: logprob is the natural log of the chosen token's probability
        in the final (processed, renormalised) distribution; for greedy, under the
        penalised distribution at temperature 1.
    """
    tok, logprob, _ = sample_with_top(logits, params, seen, rng)
    return tok, logprob


def _top(ids: np.ndarray, logp: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    return tuple((int(i), float(lp)) for i, lp in zip(ids[:n], logp[:n]))


def sample_with_top(logits: np.ndarray, params: SamplingParams, seen: np.ndarray,
                    rng: np.random.Generator, top_n: int = 0, n_prompt: int = 0
                    ) -> tuple[int, float, tuple[tuple[int, float], ...] | None]:
    """:func:`sample`, plus the ``top_n`` most likely tokens of the same distribution.

    Args:
        top_n: how many alternatives to report (OpenAI's ``top_logprobs``); 0 = none, and then
            nothing extra is computed.
        n_prompt: how many ids at the start of ``seen`` are the prompt; the presence and
            frequency penalties count only the ids after them.

    Returns:
        ``(token_id, logprob, top)``: ``top`` is ``None`` when ``top_n == 0``, else up to
        ``top_n`` ``(id, logprob)`` pairs, most likely first, from the distribution the chosen
        token's logprob comes from (fewer when top-k / top-p / typical-p keep fewer tokens).
    """
    x = apply_repetition_penalty(np.array(logits, dtype=np.float32, copy=True), seen,
                                 params.repetition_penalty)
    apply_presence_frequency(x, seen[n_prompt:], params.presence_penalty,
                             params.frequency_penalty)
    if params.watermark and seen.size:
        apply_watermark(x, int(seen[-1]))
    if not params.do_sample:
        tok = int(np.argmax(x))
        p = _probs(x)
        top = None
        if top_n > 0:
            ids = top_k_candidates(x, top_n)
            with np.errstate(divide="ignore"):
                top = _top(ids, np.log(p[ids].astype(np.float64)), top_n)
        return tok, float(np.log(p[tok])), top
    x /= np.float32(params.temperature)
    if params.top_k > 0:
        ids = nucleus_candidates(x, top_k_candidates(x, params.top_k), params.top_p)
        ids = typical_candidates(x, ids, params.typical_p)
    elif params.top_p < 1.0:
        ids = typical_candidates(x, nucleus_of_vocab(x, _probs(x), params.top_p), params.typical_p)
    elif params.typical_p < 1.0:
        ids = typical_of_vocab(x, _probs(x), params.typical_p)
    else:   # plain sampling from the whole distribution: inverse CDF in vocabulary order
        p = _probs(x)
        j, total = _inverse_cdf(p, rng.random())
        top = None
        if top_n > 0:
            tids = top_k_candidates(x, top_n)
            with np.errstate(divide="ignore"):
                top = _top(tids, np.log(p[tids].astype(np.float64) / total), top_n)
        return j, float(np.log(p[j] / total)), top
    logp = _log_softmax(x[ids])          # ids are sorted by logit descending
    cum = np.cumsum(np.exp(logp))
    j = min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), ids.shape[0] - 1)
    return int(ids[j]), float(logp[j]), (_top(ids, logp, top_n) if top_n > 0 else None)
