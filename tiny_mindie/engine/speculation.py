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

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: n-gram lengths looked up, longest first.
MAX_NGRAM = 3
MIN_NGRAM = 2     # a lone repeated token proposes mostly noise in free text


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


def expected_tokens(rate: float, k: int) -> float:
    """Tokens one verification of ``k`` proposals yields when each is kept with probability
    ``rate`` (given the ones before it were): ``1 + rate + ... + rate^k`` (Leviathan et al.
    2023, eq. 1; the last sample is always kept)."""
    return float(sum(rate ** i for i in range(k + 1)))


@dataclass
class SpeculationPolicy:
    """When one sequence proposes tokens, and how many.

    A verification of ``k`` proposals costs ``cost(k + 1)`` decode steps (measured by the
    engine: :class:`CostModel`) and yields :func:`expected_tokens` of the sequence's recent
    acceptance :attr:`rate` (an exponential average of ``accepted / proposed``, starting at 1).
    The policy proposes the ``k`` that yields the most tokens per decode step's time, if that
    is more than one; otherwise, or when a verification kept too little, the sequence decodes
    plainly for a while (4 steps, doubling each time up to :attr:`max_backoff`, back to 4
    after a verification that paid), then tries again from the break-even rate.

    Attributes:
        max_proposals: ``k`` at most (the backend's verification rows minus one).
        max_backoff: plain decode steps between two tries at most.
        rate: the sequence's recent acceptance.
    """

    max_proposals: int = 4
    max_backoff: int = 128
    rate: float = 1.0
    _wait: int = 0
    _next_backoff: int = 4

    def proposals(self, tokens: Sequence[int], room: int,
                  cost: Callable[[int], float]) -> list[int]:
        """Tokens to verify now (empty: decode one step as usual). ``room``: tokens the
        sequence may still produce after the next one; ``cost(n)``: a verification of ``n``
        rows in decode steps."""
        if self._wait > 0:
            self._wait -= 1
            return []
        found = propose(tokens, min(self.max_proposals, room))
        if not found:
            return []
        k = max(range(1, len(found) + 1),
                key=lambda n: expected_tokens(self.rate, n) / cost(n + 1))
        if expected_tokens(self.rate, k) <= cost(k + 1):
            self._back_off()
            return []
        return found[:k]

    def update(self, proposed: int, accepted: int, cost: float) -> None:
        """Record one verification: ``accepted`` of ``proposed`` kept, at ``cost`` decode
        steps."""
        self.rate = 0.5 * self.rate + 0.5 * (accepted / proposed)
        if accepted + 1 > cost:
            self._next_backoff = 4
        elif expected_tokens(self.rate, proposed) <= cost:
            self._back_off()

    def _back_off(self) -> None:
        self._wait = self._next_backoff
        self._next_backoff = min(2 * self._next_backoff, self.max_backoff)
        self.rate = max(self.rate, 0.6)     # the try after the pause assumes it may pay


class CostModel:
    """What a verification costs in decode steps, timed as the engine runs: the shortest of the
    last :attr:`WINDOW` lone decode steps, and of the last :attr:`WINDOW` verifications of ``n``
    rows. Until both are timed, ``n`` rows are assumed to cost ``1 + 0.3 (n - 1)`` steps (each
    row beyond the first adds a fraction of a step: the rows share one pass over the weights).

    The shortest, not an average: a step timed while another process held a core is longer,
    never shorter, so the minimum of recent samples is the step's own cost, and a few such
    samples cannot turn speculation off; a lasting change is followed within :attr:`WINDOW`
    samples."""

    WINDOW = 16

    def __init__(self) -> None:
        self._decode: deque[float] = deque(maxlen=self.WINDOW)
        self._verify: dict[int, deque[float]] = {}

    @property
    def decode_s(self) -> float | None:
        """Seconds of a lone decode step; ``None`` before one was timed."""
        return min(self._decode) if self._decode else None

    def decode(self, seconds: float) -> None:
        """A lone decode step took ``seconds``."""
        self._decode.append(seconds)

    def verify(self, rows: int, seconds: float) -> None:
        """A verification of ``rows`` rows took ``seconds``."""
        self._verify.setdefault(rows, deque(maxlen=self.WINDOW)).append(seconds)

    def __call__(self, rows: int) -> float:
        """A verification of ``rows`` rows, in decode steps."""
        times = self._verify.get(rows)
        if not times or not self.decode_s:
            return 1.0 + 0.3 * (rows - 1)
        return min(times) / self.decode_s
