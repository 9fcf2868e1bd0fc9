"""Next-token selection: logits processors and sampling, as small pure numpy functions.

Order of the processors is Hugging Face's / TGI's: repetition penalty, the watermark bias when
asked (:mod:`.watermark`), then temperature, top-k, top-p, typical-p, each working on the
distribution the previous one left. The whole vocabulary
is never sorted: top-k uses ``argpartition``; top-p grows a partitioned candidate set until it
holds the nucleus.

Every request has its own ``numpy.random.Generator`` (PCG64) seeded from its ``seed``, and draws
exactly one uniform number per sampled token, so a seed fixes the output.
"""

from __future__ import annotations

import numpy as np

from .request import SamplingParams
from .watermark import apply_watermark

_NEG_INF = np.float32(-np.inf)


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


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax of a 1-D array (``-inf`` entries stay ``-inf``)."""
    x = x.astype(np.float64)
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


def top_k_candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the ``k`` largest logits, ordered by logit descending (ties by id); O(V + k log k)."""
    v = logits.shape[0]
    if k <= 0 or k >= v:
        ids = np.arange(v)
    else:
        ids = np.argpartition(-logits, k - 1)[:k]
    return _sort_desc(logits, ids)


def _sort_desc(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    ids = np.sort(ids)  # ties are then broken by id, whatever argpartition returned
    return ids[np.argsort(-logits[ids], kind="stable")]


def nucleus_candidates(logits: np.ndarray, ids: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p filter (Holtzman et al. 2020): the shortest prefix of ``ids`` (sorted by logit
    descending) whose probability mass reaches ``top_p``; at least one id is kept.

    Args:
        logits: float32 ``[vocab]`` (already divided by the temperature).
        ids: candidate ids sorted by logit descending.
    """
    if top_p >= 1.0:
        return ids
    logp = _log_softmax(logits[ids])
    cum = np.cumsum(np.exp(logp))
    keep = int(np.searchsorted(cum, top_p, side="left")) + 1
    return ids[:max(1, min(keep, ids.shape[0]))]


def typical_candidates(logits: np.ndarray, ids: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical filter (Meister et al. 2022, sec. 4; HF ``TypicalLogitsWarper``).

    Keeps the tokens whose surprisal ``-log p`` is closest to the entropy ``H`` of the
    distribution over ``ids``, fewest first, until their mass reaches ``mass``. Returns them
    sorted by logit descending.
    """
    if mass >= 1.0:
        return ids
    logp = _log_softmax(logits[ids])
    p = np.exp(logp)
    entropy = -np.sum(np.where(p > 0, p * logp, 0.0))
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    cum = np.cumsum(p[order])
    last = int(np.sum(cum < mass))
    kept = ids[order[:last + 1]]
    return _sort_desc(logits, kept)


def _candidate_pool(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Candidates after top-k and top-p, without sorting the whole vocabulary."""
    v = logits.shape[0]
    if p.top_k > 0:
        return nucleus_candidates(logits, top_k_candidates(logits, p.top_k), p.top_p)
    if p.top_p >= 1.0 and p.typical_p >= 1.0:
        return np.arange(v)  # plain sampling needs no order
    if p.top_p >= 1.0:
        return top_k_candidates(logits, v)
    # top-p alone: grow a partitioned pool until it holds the nucleus mass.
    logp_all = _log_softmax(logits)
    k = 64
    while True:
        ids = top_k_candidates(logits, k)
        if k >= v or np.sum(np.exp(logp_all[ids])) >= p.top_p:
            break
        k *= 4
    # Mass is measured against the full distribution, as top-p over all tokens would.
    cum = np.cumsum(np.exp(logp_all[ids]))
    keep = int(np.searchsorted(cum, p.top_p, side="left")) + 1
    return ids[:max(1, min(keep, ids.shape[0]))]


def sample(logits: np.ndarray, params: SamplingParams, seen: np.ndarray,
           rng: np.random.Generator) -> tuple[int, float]:
    """Choose the next token of one sequence.

    Args:
        logits: float32 ``[vocab]`` next-token logits (not modified).
        params: the request's sampling parameters.
        seen: int ``[n]`` prompt + generated ids, for the repetition penalty.
        rng: the request's generator; one ``random()`` draw per sampled token, none when greedy.

    Returns:
        ``(token_id, logprob)``: logprob is the natural log of the chosen token's probability
        in the final (processed, renormalised) distribution; for greedy, under the
        penalised distribution at temperature 1.
    """
    x = apply_repetition_penalty(np.array(logits, dtype=np.float32, copy=True), seen,
                                 params.repetition_penalty)
    if params.watermark and seen.size:
        apply_watermark(x, int(seen[-1]))
    if not params.do_sample:
        tok = int(np.argmax(x))
        m = float(np.max(x))
        return tok, float(x[tok] - m - np.log(np.sum(np.exp((x - m).astype(np.float64)))))
    x /= np.float32(params.temperature)
    ids = _candidate_pool(x, params)
    ids = typical_candidates(x, ids, params.typical_p)
    logp = _log_softmax(x[ids])
    cum = np.cumsum(np.exp(logp))
    u = rng.random() * cum[-1]
    j = min(int(np.searchsorted(cum, u, side="right")), ids.shape[0] - 1)
    return int(ids[j]), float(logp[j])
