"""Candidate sets inside a small pool: top-k of the vocabulary, then top-p (Holtzman et al.
2020) and typical-p (Meister et al. 2022) inside the pool it leaves, each renormalised over its
pool. Pools are ordered by logit descending, ties by the lower id.

(Top-p and typical-p over the whole vocabulary, without sorting it, are :mod:`.vocab_sets`.)
"""

from __future__ import annotations

import numpy as np

from .scratch import scratch


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a small 1-D array (a candidate pool)."""
    x = x.astype(np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def sort_desc(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` ordered by logit descending, ties by id (so the order never depends on how
    a partition happened to return them)."""
    ids = np.sort(ids)
    return ids[np.argsort(-logits[ids], kind="stable")]


def largest_ids(a: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest values of float32 ``a``, by value descending (ties: lower id).

    Exact, and cheaper than ``argpartition`` on a large array: a threshold taken from a strided
    sample keeps only a few hundred candidates in one compare; if fewer than ``k`` values reach
    it, ``argpartition`` runs instead.
    """
    v = a.shape[0]
    if k >= v:
        return sort_desc(a, np.arange(v))
    stride = 64
    if v >= 16 * stride and k * stride * 4 < v:
        sample = a[::stride]
        q = sample.shape[0] - 1 - min(2 * (k // stride + 1), sample.shape[0] - 1)
        t = np.partition(sample, q)[q]
        cand = np.flatnonzero(np.greater_equal(a, t, out=scratch(1, v).mask))
        if cand.shape[0] >= k:     # the k largest are all >= t, so all are in cand
            return cand[np.lexsort((cand, -a[cand]))[:k]]
    ids = np.argpartition(-a, k - 1)[:k]
    edge = a[ids].min()             # settle ties at the edge by the lower id
    tied = np.flatnonzero(a == edge)
    if tied.shape[0] > np.count_nonzero(a[ids] == edge):
        above = ids[a[ids] > edge]
        ids = np.concatenate([above, tied[:k - above.shape[0]]])
    return sort_desc(a, ids)


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits (float32 ``[V]``; all when ``k <= 0``), by logit
    descending (ties: lower id); O(V + k log k)."""
    return largest_ids(logits, logits.shape[0] if k <= 0 else k)


def _prefix_reaching(mass: np.ndarray, target: float) -> int:
    """Length of the shortest prefix whose cumulative mass reaches ``target`` (at least 1)."""
    return max(1, min(int(np.searchsorted(np.cumsum(mass), target, side="left")) + 1,
                      mass.shape[0]))


def nucleus_candidates(logits: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p filter (Holtzman et al. 2020) inside a pool: the shortest prefix of ``ids`` (sorted
    by logit descending) whose mass, renormalised over the pool, reaches ``top_p``."""
    if top_p >= 1.0:
        return ids
    return ids[:_prefix_reaching(np.exp(log_softmax(logits[ids])), top_p)]


def typical_candidates(logits: np.ndarray, ids: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical filter (Meister et al. 2022, sec. 4; HF ``TypicalLogitsWarper``) inside a
    pool: keep the ids whose surprisal ``-log p`` is closest to the entropy ``H`` of the pool's
    distribution, fewest first, until their mass reaches ``mass``. Sorted by logit descending."""
    if mass >= 1.0:
        return ids
    logp = log_softmax(logits[ids])
    p = np.exp(logp)
    live = p > 0                    # a masked id (logit -inf) adds nothing, and no 0 * -inf
    entropy = -np.sum(p[live] * logp[live])
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    kept = ids[order[:int(np.sum(np.cumsum(p[order]) < mass)) + 1]]
    return sort_desc(logits, kept)
