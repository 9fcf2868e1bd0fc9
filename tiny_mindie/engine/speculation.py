"""Speculative decoding without a draft model: prompt lookup proposals, and when to verify them.

A sequence that repeats itself or its prompt (a paragraph copied with its typos fixed, code
edited in place, an answer quoting its sources) can be decoded several tokens per forward
pass: :func:`propose` looks up the sequence's last n-gram where it occurred before, in the
prompt or the output, and proposes the tokens that followed it there ("prompt lookup
decoding", Saxena 2023; llama.cpp's ``--lookup``, vLLM's ``ngram`` speculator). The engine runs
the last token and the proposals as one chunk through
:meth:`~tiny_mindie.model.backend.Backend.verify`, whose logits are bit for bit those of
decoding the same tokens one by one, samples each position with the request's own generator in
order -- exactly the draws plain decoding would make there -- and keeps the proposals while the
sample equals them, then the first sample that differs. The output is the same token for token
with speculation on or off, greedy or seeded.

:class:`SpeculationPolicy` decides, per sequence, when a verification is worth its cost: the
chunk costs more than one decode step, so proposals are made only while recent acceptance
pays for it, and only when the sequence decodes alone (in a batch, the decode step is shared
and one sequence's chunk would hold the others back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: n-gram lengths looked up, longest first.
MAX_NGRAM = 3
MIN_NGRAM = 1


def propose(tokens: Sequence[int], k: int, max_ngram: int = MAX_NGRAM,
            min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the last
    ``n``-gram of ``tokens`` (``n`` from ``max_ngram`` down to ``min_ngram``; the longest
    n-gram that occurred before wins). Empty when none occurred before or ``k < 1``.

    Args:
        tokens: the sequence so far (prompt and output), token ids.
        k: proposals at most.
    """
    if k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_ngram, len(arr) - 1), min_ngram - 1, -1):
        suffix = arr[-n:]
        # windows starting at 0 .. len - n - 1: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            at = int(hits[-1]) + n
            return arr[at:at + k].tolist()
    return []


@dataclass
class SpeculationPolicy:
    """When one sequence proposes tokens, and how many.

    The expected tokens of a verification with acceptance rate ``a`` per proposal and ``k``
    proposals are ``1 + a + a^2 + ... + a^k`` (Leviathan et al. 2023, eq. 1), against its cost
    of ``cost`` decode steps; :attr:`rate` is an exponential average of ``accepted / proposed``
    over the sequence's verifications. Below :attr:`min_rate` the sequence stops proposing for
    a few decode steps (4, doubling at each failure up to :attr:`max_backoff`, back to 4 after
    a verification that accepted something), then tries again.

    Attributes:
        max_proposals: ``k``, proposals per verification at most.
        min_rate: acceptance below which proposing stops for a while.
        max_backoff: decode steps without proposals at most.
        rate: the sequence's recent acceptance (starts at 1).
    """

    max_proposals: int = 4
    min_rate: float = 0.35
    max_backoff: int = 64
    rate: float = 1.0
    _wait: int = 0
    _next_backoff: int = 4

    def proposals(self, tokens: Sequence[int], room: int) -> list[int]:
        """Tokens to verify now (empty: decode one step as usual). ``room``: tokens the
        sequence may still produce after the next one."""
        if self._wait > 0:
            self._wait -= 1
            return []
        return propose(tokens, min(self.max_proposals, room))

    def update(self, proposed: int, accepted: int) -> None:
        """Record one verification's outcome."""
        self.rate = 0.5 * self.rate + 0.5 * (accepted / proposed)
        if self.rate < self.min_rate:
            self._wait = self._next_backoff
            self._next_backoff = min(2 * self._next_backoff, self.max_backoff)
            self.rate = self.min_rate           # the next try starts from the threshold
        elif accepted:
            self._next_backoff = 4
