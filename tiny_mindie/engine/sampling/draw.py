"""Drawing a token and reporting logprobs.

Every request has its own ``numpy.random.Generator`` (PCG64) seeded from its ``seed``
(:func:`make_rng`), and draws exactly one uniform number ``u`` in [0, 1) per sampled token
(none when greedy), so a seed fixes the output whatever else is in the batch. The token is the
inverse CDF at ``u``: the first id whose running weight passes ``u`` times the total, in the
order of its pool -- by logit descending (ties: lower id) for a filtered pool (:func:`draw`),
vocabulary order for the whole distribution (:func:`inverse_cdf`). Logprobs are natural logs
of the probabilities in the distribution drawn from.
"""

from __future__ import annotations

import numpy as np

from .candidates import top_k_candidates

BLOCK = 1024     # block width of the per-row block sums (two-level inverse CDF)

Top = tuple[tuple[int, float], ...]


def make_rng(seed: int) -> np.random.Generator:
    """The per-request generator for ``seed`` (0 .. 2**63-1)."""
    return np.random.Generator(np.random.PCG64(seed))


def _blocks(a: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Views of float32 ``a`` ``[rows, V]``: ``[rows, V // width, width]`` and the rest
    ``[rows, V % width]``."""
    rows, v = a.shape
    n = v // width
    if n * width == v:              # a plain view (as_strided costs more Python overhead)
        return a.reshape(rows, n, width), a[:, v:]
    full = np.lib.stride_tricks.as_strided(a, (rows, n, width),
                                           (a.strides[0], width * a.strides[1], a.strides[1]),
                                           writeable=False)
    return full, a[:, n * width:]


def block_sums(w: np.ndarray) -> np.ndarray:
    """float64 ``[rows, ceil(V / BLOCK)]``: sums of consecutive ``BLOCK``-wide pieces of each
    row of float32 ``w`` ``[rows, V]``: ``einsum``'s vectorised float32 sums (relative error
    a few 1e-7 on real rows; numpy's pairwise ``sum`` along the last axis is slower)."""
    full, rest = _blocks(w, BLOCK)
    sums = np.einsum("rbi->rb", full)
    if rest.shape[1]:
        sums = np.concatenate([sums, rest.sum(axis=1)[:, None]], axis=1)
    return sums.astype(np.float64)


def inverse_cdf(w: np.ndarray, sums: np.ndarray, u: float) -> int:
    """Index where the running sum of ``w`` (float32 ``[V]``, ``>= 0``) first passes
    ``u * sum(w)``, ``0 <= u < 1``: a block from ``sums`` (:func:`block_sums` of ``w``), then
    a running sum inside that block only. Never an index of weight 0."""
    cum = np.cumsum(sums)
    target = u * cum[-1]
    b = int(np.searchsorted(cum, target, side="right"))
    if b >= sums.shape[0]:                 # u * total rounded up to the total
        b = int(np.flatnonzero(sums)[-1])
    block = w[b * BLOCK:(b + 1) * BLOCK]
    j = int(np.searchsorted(np.cumsum(block, dtype=np.float64),
                            target - (cum[b - 1] if b else 0.0), side="right"))
    if j >= block.shape[0]:                # rounding: the block's own sum falls short
        j = int(np.flatnonzero(block)[-1])
    return b * BLOCK + j


def _top(ids: np.ndarray, logp: np.ndarray, n: int) -> Top:
    return tuple((int(i), float(lp)) for i, lp in zip(ids[:n], logp[:n], strict=True))


def top_of_vocab(x: np.ndarray, w: np.ndarray, z: float, n: int) -> Top | None:
    """The ``n`` most likely ids of the whole distribution ``w / z`` with their logprobs."""
    if n <= 0:
        return None
    ids = top_k_candidates(x, n)
    with np.errstate(divide="ignore"):
        return _top(ids, np.log(w[ids].astype(np.float64) / z), n)


def draw(ids: np.ndarray, weights: np.ndarray, u: float, n: int) -> tuple[int, float, Top | None]:
    """Inverse CDF over a candidate pool, in its order (by logit descending).

    Args:
        ids: int ``[k]`` the pool; weights: float64 ``[k]`` their unnormalised probabilities.
        u: uniform in [0, 1); n: how many ``(id, logprob)`` of the pool to report (its first).
    """
    cum = np.cumsum(weights)
    total = cum[-1]
    j = min(int(np.searchsorted(cum, u * total, side="right")), ids.shape[0] - 1)
    with np.errstate(divide="ignore"):
        top = _top(ids, np.log(weights[:n] / total), n) if n > 0 else None
        return int(ids[j]), float(np.log(weights[j] / total)), top
