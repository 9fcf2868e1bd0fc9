"""The sampler's choice for one row, written plainly: the definition the fast path
(:func:`.batch.sample_batch`) is tested against, after llama2.c's ``sample`` (Karpathy, run.c):
softmax, argmax, top-p by sorting, and an inverse CDF over the kept tokens.

The penalties work on float32 logits, as the fast path's do (so the same logits tie); from the
temperature on, everything is float64 over the fully sorted vocabulary, one filter at a time,
each on the distribution the one before left (renormalised).

Contract: given the same logits, parameters and uniform number ``coin`` -- the next
``random()`` of the row's generator, of which the fast path draws one per sampled token --
:func:`sample` picks the token the fast path picks, with its logprob (and ``top``) equal to
float32 rounding. They may differ only where that rounding decides: when ``coin``, or a
filter's running mass, lies within it of a boundary (tests/unit/test_sampler_reference.py skips a
choice that moving them by a few times that rounding changes). The conventions both follow:

- greedy (no ``do_sample``, or a temperature below ``MIN_TEMPERATURE``): the argmax (lowest
  id on ties), no coin; the logprob is at temperature 1;
- candidates are ordered by logit descending, ties by the lower id; min-p (first, after the
  temperature) keeps the ids whose probability is at least ``min_p`` times the largest;
  top-k keeps the first ``k``; top-p the shortest prefix whose mass reaches ``top_p``
  (``>=``; llama2.c: ``>``); typical-p the ids by ``|-log p - H|`` (ties: the earlier in
  logit order) until their mass reaches ``typical_p``, then back in logit order;
- the token is the first whose running probability exceeds ``coin`` (llama2.c's
  ``coin < cdf``): over the candidates in logit order when a filter is on (llama2.c's
  ``sample_topp``), over the vocabulary in id order when none is (``sample_mult``).
"""

from __future__ import annotations

import numpy as np

from ..request import SamplingParams
from ..watermark import DELTA, green_mask
from .row import MIN_TEMPERATURE


def softmax(x: np.ndarray) -> np.ndarray:
    """float64 probabilities of the logits ``x`` ``[n]``."""
    e = np.exp(x - x.max())
    return e / e.sum()


def sample_mult(probs: np.ndarray, coin: float) -> int:
    """Index of the first ``probs`` ``[n]`` whose running sum exceeds ``coin`` in [0, 1)
    (the last index when rounding leaves the sum short of ``coin``)."""
    passed = np.flatnonzero(coin < np.cumsum(probs))
    return int(passed[0]) if passed.size else probs.shape[0] - 1


def _reaching(probs: np.ndarray, mass: float) -> int:
    """How many of the first ``probs`` ``[n]`` it takes for their sum to reach ``mass``
    (``>=``); all ``n`` when rounding leaves the whole sum short of it."""
    reached = np.flatnonzero(np.cumsum(probs) >= mass)
    return int(reached[0]) + 1 if reached.size else probs.shape[0]


def processed(logits: np.ndarray, params: SamplingParams, seen=(), n_prompt: int = 0) -> np.ndarray:
    """float32 ``[V]``: ``logits`` after the repetition penalty (CTRL: a seen id's positive
    logit divided by it, a negative one multiplied; in float64, rounded to float32), the
    presence and frequency penalties on the generated ids (``seen`` after the first
    ``n_prompt``; in float32) and the watermark's bias. Float32 as the fast path's logits are,
    so that the same logits tie."""
    x = np.array(logits, np.float32)
    seen = np.asarray(seen, np.int64)
    for i in set(seen[seen < x.shape[0]].tolist()):
        v = float(x[i])
        x[i] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
    output = seen[n_prompt:]
    for i, count in zip(*np.unique(output[output < x.shape[0]], return_counts=True), strict=True):
        x[i] -= (np.float32(params.frequency_penalty) * np.float32(count)
                 + np.float32(params.presence_penalty))
    if params.watermark and seen.size:
        x += np.where(green_mask(int(seen[-1]), x.shape[0]), np.float32(DELTA), np.float32(0))
    return x


def sample(logits: np.ndarray, params: SamplingParams, coin: float, seen=(), n_prompt: int = 0,
           top_n: int = 0) -> tuple[int, float, tuple[tuple[int, float], ...] | None]:
    """``(token, logprob, top)`` for one row's float32 ``[V]`` logits (see the module doc);
    ``top``: the ``top_n`` most likely ``(id, logprob)`` of the final distribution, or None."""
    x = processed(logits, params, seen, n_prompt).astype(np.float64)
    greedy = not params.do_sample or params.temperature < MIN_TEMPERATURE
    if not greedy:
        x = x / params.temperature
    order = np.argsort(-x, kind="stable")                # logit descending, ties: lower id
    filtered = not greedy and (params.top_k > 0 or params.top_p < 1 or params.typical_p < 1
                               or params.min_p > 0)
    if filtered and params.min_p > 0:                    # min-p first, as vLLM
        p = softmax(x)
        order = order[p[order] >= params.min_p * p.max()]
    cand = order[:params.top_k] if params.top_k > 0 else order
    if filtered and params.top_p < 1:
        cand = cand[:_reaching(softmax(x[cand]), params.top_p)]
    if filtered and params.typical_p < 1:
        p = softmax(x[cand])
        with np.errstate(divide="ignore"):
            surprisal = -np.log(p)                       # inf where p underflows to 0
        entropy = np.sum(p[p > 0] * surprisal[p > 0])
        by_typicality = np.argsort(np.abs(surprisal - entropy), kind="stable")
        cand = cand[np.sort(by_typicality[:_reaching(p[by_typicality], params.typical_p)])]
    if filtered:                                         # drawn in logit order
        ids, probs = cand, softmax(x[cand])
    else:                                                # drawn in id order
        ids, probs = np.arange(x.shape[0]), softmax(x)
    j = int(np.argmax(x)) if greedy else sample_mult(probs, coin)
    ranked = np.argsort(-probs, kind="stable")[:top_n]   # ties: the earlier in ids
    with np.errstate(divide="ignore"):
        logp = np.log(probs)
    top = tuple((int(ids[i]), float(logp[i])) for i in ranked) if top_n > 0 else None
    return int(ids[j]), float(logp[j]), top
