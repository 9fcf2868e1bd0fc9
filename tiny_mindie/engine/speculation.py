"""Speculative decoding: proposals from prompt lookup or a draft model, and when to verify them.

A sequence that repeats itself or its prompt (a paragraph copied with its typos fixed, code
edited in place, an answer quoting its sources) can be decoded several tokens per forward
pass: :func:`propose` looks up the sequence's last n-gram where it occurred before, in the
prompt or the output, and proposes the tokens that followed it there ("prompt lookup
decoding", Saxena 2023; llama.cpp's ``--lookup``, vLLM's ``ngram`` speculator). Where nothing
repeats, a draft model (:mod:`.draft`, a smaller model of the same vocabulary) proposes what it
would write next (Leviathan et al. 2023; llama.cpp's ``-md``). The engine runs the last token
and the proposals as one chunk through :meth:`~tiny_mindie.model.backend.Backend.verify`,
whose logits are bit for bit those of decoding the same tokens one by one, samples each
position with the request's own generator in order -- exactly the draws plain decoding would
make there -- and keeps the proposals while the sample equals them, then the first sample that
differs. The output is the same token for token with speculation on or off, with or without a
draft, greedy or seeded.

:class:`SpeculationPolicy` decides, per sequence and source, when a verification is worth its
cost: the chunk costs more than one decode step (and a draft's proposals cost its own steps),
so proposals are made only while recent acceptance pays for it, and only when the sequence
decodes alone (in a batch, the decode step is shared and one sequence's chunk would hold the
others back). :class:`Speculator` prices both sources alike and lets the one whose proposals
yield more tokens per unit of time propose.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from .draft import DraftModel

#: n-gram lengths looked up, longest first.
MAX_NGRAM = 3
MIN_NGRAM = 2     # a lone repeated token proposes mostly noise in free text

#: Where proposals come from: prompt lookup, the draft model.
SOURCES = ("ngram", "draft")
#: A draft step's time in target decode steps, assumed until both are timed.
DRAFT_RATIO = 0.5
#: Plain decode steps after the draft was unsure of its first token, before it is asked again
#: (doubling while it stays unsure).
UNSURE_PAUSE = 2


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
    """When one sequence proposes tokens from one source, and how many.

    Proposing and verifying ``k`` tokens costs ``cost(k)`` decode steps (measured by the
    engine: :class:`CostModel`, :meth:`Speculator.cost`) and yields :func:`expected_tokens`
    of the sequence's recent acceptance :attr:`rate` (an exponential average of
    ``accepted / proposed``, starting at 1). The policy proposes the ``k`` that yields the
    most tokens per decode step's time, if that is at least one (a verification that keeps
    all its proposals never costs more than decoding them: :class:`CostModel` caps it there,
    so a sequence whose proposals are all kept keeps proposing whatever the host's load);
    otherwise, or when a verification kept less than it cost, the sequence decodes plainly
    for a while (4 steps, doubling each time up to :attr:`max_backoff`, back to 4 after a
    verification that paid), then tries again from the break-even rate.

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
    _unsure_pause: int = UNSURE_PAUSE

    def ready(self) -> bool:
        """Whether the sequence may speculate from this source now: ``False`` while it
        pauses (each call counts one step of the pause down). Called once per step the
        sequence could speculate."""
        if self._wait > 0:
            self._wait -= 1
            return False
        return True

    def best(self, available: int, cost: Callable[[int], float]) -> tuple[int, float]:
        """``(k, yield)``: the ``k`` of at most ``available`` proposals that yields the most
        tokens per decode step's time (the largest such ``k``), and that yield (at least 1:
        speculating pays). ``cost(k)``: proposing and verifying ``k`` tokens, in decode
        steps."""
        k = max(range(available, 0, -1), key=lambda n: expected_tokens(self.rate, n) / cost(n))
        return k, expected_tokens(self.rate, k) / cost(k)

    def update(self, proposed: int, accepted: int, cost: float) -> None:
        """Record one verification: ``accepted`` of ``proposed`` kept, at ``cost`` decode
        steps."""
        self.rate = 0.5 * self.rate + 0.5 * (accepted / proposed)
        if accepted + 1 >= cost:
            self._next_backoff = 4
        elif expected_tokens(self.rate, proposed) <= cost:
            self.back_off()

    def unsure(self, unsure: bool) -> None:
        """Whether the source (a draft) was just unsure of its first proposal, so proposed
        nothing: not a wrong proposal (the rate stays), but a run that bought nothing, so it
        pauses :data:`UNSURE_PAUSE` steps, twice as long each time in a row."""
        if not unsure:
            self._unsure_pause = UNSURE_PAUSE
            return
        self._wait = max(self._wait, self._unsure_pause)
        self._unsure_pause = min(2 * self._unsure_pause, self.max_backoff)

    def back_off(self) -> None:
        """Decode plainly for a while (:attr:`max_backoff` steps at most), then try again."""
        self._wait = self._next_backoff
        self._next_backoff = min(2 * self._next_backoff, self.max_backoff)
        self.rate = max(self.rate, 0.6)     # the try after the pause assumes it may pay


class CostModel:
    """What a verification costs in decode steps, timed as the engine runs: the shortest of the
    last :attr:`WINDOW` lone decode steps, and of the last :attr:`WINDOW` verifications of ``n``
    rows. Until both are timed, ``n`` rows are assumed to cost ``1 + 0.3 (n - 1)`` steps (each
    row beyond the first adds a fraction of a step: the rows share one pass over the weights),
    and at most that until ``n`` rows were timed :attr:`MIN_SAMPLES` times.

    The shortest, not an average: a step timed while another process held a core is longer,
    never shorter, so the minimum of recent samples is the step's own cost, and a few such
    samples cannot turn speculation off; a lasting change is followed within :attr:`WINDOW`
    samples. And never more than ``n`` steps: a verification of ``n`` rows computes in one
    run what ``n`` decode steps compute one by one (each row's attention as a decode step's,
    the weights read once for all rows), so a timing above that is the host's load -- other
    processes holding the cores while the few verifications were timed, not while the many
    decode steps were -- not the verification's cost."""

    WINDOW = 16
    #: Samples of a row count before its time alone is trusted; until then the prior bounds it
    #: (a single slow first run -- memory still being mapped -- must not rule a ``k`` out for
    #: good, as it would never be tried, so never timed, again).
    MIN_SAMPLES = 3

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
        """A verification of ``rows`` rows, in decode steps (at most ``rows``)."""
        prior = 1.0 + 0.3 * (rows - 1)
        times = self._verify.get(rows)
        if not times or not self.decode_s:
            return prior
        measured = min(min(times) / self.decode_s, float(rows))
        return measured if len(times) >= self.MIN_SAMPLES else min(measured, prior)


class Speculator:
    """The proposals of a sequence decoding alone: from prompt lookup (free to make) or the
    draft model when one is loaded, whichever yields more tokens per unit of time, each source
    with its own :class:`SpeculationPolicy` per sequence (:meth:`policies`); both are verified
    alike by the engine.

    Args:
        max_proposals: tokens proposed per verification at most (the backend's verification
            rows minus one).
        draft: the draft model, or ``None``.

    Attributes:
        cost_model: the target's timed decode steps and verifications.
    """

    def __init__(self, max_proposals: int, draft: DraftModel | None = None):
        self.max_proposals = max_proposals
        self.draft = draft
        self.cost_model = CostModel()

    def policies(self) -> dict[str, SpeculationPolicy]:
        """A new sequence's policies, one per source of :data:`SOURCES`."""
        return {source: SpeculationPolicy(self.max_proposals) for source in SOURCES}

    def draft_steps(self, k: int) -> float:
        """The draft's proposal of ``k`` tokens, in target decode steps: ``k`` of its steps
        (:attr:`DraftModel.step_s` over the target's decode step, :data:`DRAFT_RATIO`
        until both are timed)."""
        step, decode = (self.draft.step_s if self.draft else None), self.cost_model.decode_s
        return k * (step / decode if step and decode else DRAFT_RATIO)

    def cost(self, source: str, k: int) -> float:
        """Proposing ``k`` tokens from ``source`` and verifying them, in target decode steps."""
        return self.cost_model(k + 1) + (self.draft_steps(k) if source == "draft" else 0.0)

    def proposals(self, tokens: Sequence[int], policies: dict[str, SpeculationPolicy],
                  room: int) -> tuple[str, list[int]]:
        """``(source, tokens to verify)`` for a sequence of ``tokens`` now, from the source
        whose proposals yield the most tokens per decode step's time (at least one);
        ``("", [])``: decode one step as usual. A source that would not pay pauses
        (:meth:`SpeculationPolicy.back_off`). ``room``: tokens the sequence may still produce
        after the next one. The draft is asked only while it is no further behind the
        sequence than that room (its catching up, a prefill of the tokens it has not seen,
        would not pay off before the sequence ends)."""
        draft_ok = self.draft is not None and self.draft.behind(tokens) <= room
        room = min(room, self.max_proposals)
        if room < 1:
            return "", []
        options = []                                     # (source, k, yield)
        found = propose(tokens, room) if policies["ngram"].ready() else []
        if found:
            options.append(("ngram", *policies["ngram"].best(len(found),
                                                             partial(self.cost, "ngram"))))
        if draft_ok and policies["draft"].ready():
            options.append(("draft", *policies["draft"].best(room, partial(self.cost, "draft"))))
        for source, _, gain in options:
            if gain < 1.0:
                policies[source].back_off()
        paying = [o for o in options if o[2] >= 1.0]
        if not paying:
            return "", []
        source, k, _ = max(paying, key=lambda o: o[2])
        if source == "ngram":
            return source, found[:k]
        drafted = self.draft.propose(tokens, k)
        policies["draft"].unsure(not drafted)
        return ("draft", drafted) if drafted else ("", [])

    def verified(self, policies: dict[str, SpeculationPolicy], source: str, proposed: int,
                 accepted: int) -> None:
        """``accepted`` of ``proposed`` tokens from ``source`` were kept."""
        policies[source].update(proposed, accepted, self.cost(source, proposed))
