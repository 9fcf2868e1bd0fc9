"""Which sequences run in the next forward pass: a priority queue feeding a running batch.

Continuous batching (Yu et al. 2022, "Orca"): waiting requests are admitted into the running
batch between steps whenever a KV-cache slot is free; every step decodes one token for each
running sequence that has finished its prompt, and spends a token budget on the prompts of the
others (chunked prefill), so a long prompt never stalls the running streams.

Pure bookkeeping: no threads, no I/O. The engine owns the lock around it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass(frozen=True)
class SchedulerLimits:
    """MindIE ``ScheduleConfig`` limits, in sequences and tokens.

    Attributes:
        max_batch_size: sequences running at once (also capped by the KV slots).
        max_prefill_batch_size: sequences whose prompt is processed in one step.
        max_prefill_tokens: prompt tokens processed in one step, all rows together.
    """

    max_batch_size: int = 8
    max_prefill_batch_size: int = 8
    max_prefill_tokens: int = 512


@dataclass(order=True)
class _Waiting(Generic[T]):
    priority: int
    seq_no: int
    item: T = field(compare=False)


class WaitQueue(Generic[T]):
    """Waiting requests ordered by priority (1 first), FIFO within a priority."""

    def __init__(self) -> None:
        self._heap: list[_Waiting[T]] = []
        self._counter = itertools.count()

    def push(self, priority: int, item: T) -> None:
        heapq.heappush(self._heap, _Waiting(priority, next(self._counter), item))

    def pop(self) -> T:
        return heapq.heappop(self._heap).item

    def remove_if(self, pred) -> list[T]:
        """Remove and return every waiting item for which ``pred(item)`` is true."""
        gone = [w.item for w in self._heap if pred(w.item)]
        if gone:
            self._heap = [w for w in self._heap if not pred(w.item)]
            heapq.heapify(self._heap)
        return gone

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (w.item for w in sorted(self._heap))


@dataclass(frozen=True)
class Taken:
    """A slot taken by :meth:`SlotPool.take`.

    Attributes:
        slot: the slot.
        reused: leading prompt tokens whose KV the slot holds once ``copy_from`` is copied:
            positions ``[0, reused)`` need no prefill.
        copy_from: the slot to copy positions ``[0, reused)`` from (``Backend.copy_kv``)
            before the first prefill chunk; ``None``: the slot holds them already.
    """

    slot: int
    reused: int
    copy_from: int | None = None


class SlotPool:
    """The KV-cache slots of the backend (``num_slots`` sequences fit at once), and the prefix
    cache they hold.

    A slot given back keeps the KV of the tokens its sequence had (those whose KV a fresh prefill
    would compute bit for bit alike, see :func:`reusable_prefix`): a later request whose prompt
    starts with them reuses them. :meth:`take` picks the free slot that spares the most prefill,
    and among ties and misses the least recently given back, so cached KV never blocks a request:
    every free slot can be taken, its cache is simply overwritten. Rather than cut short a cache
    that goes on past the shared prefix, or when a running sequence holds a longer prefix, it
    has the prefix copied into the least recently used slot.
    """

    def __init__(self, num_slots: int):
        self.total = num_slots
        # slot -> when it was last given back (the never used first, lowest slot first)
        self._free: dict[int, int] = {s: s - num_slots for s in range(num_slots)}
        self._cached: dict[int, np.ndarray] = {}   # free slot -> int64 [n] tokens in its KV
        self._clock = itertools.count(1)

    def take(self, prompt: Sequence[int] = (), reusable: Callable[[int], int] = lambda n: 0,
             running: Iterable[tuple[int, Sequence[int]]] = (), min_copy: int | None = None
             ) -> Taken | None:
        """Take a free slot for a sequence with the given prompt.

        The longest reusable prefix may sit in a free slot or, with ``min_copy``, in a running
        sequence's slot. A free slot whose whole cache the prompt starts with is taken as it is;
        otherwise the least recently used free slot is taken (what it holds is lost), and the
        longest prefix is copied into it from wherever it is when that spares at least
        ``min_copy`` more tokens of prefill than the slot's own cache.

        Args:
            prompt: the sequence's prompt token ids.
            reusable: ``reusable(n)``: how many of ``n`` leading tokens shared with a slot's
                cache may be reused (0: none).
            running: ``(slot, tokens)`` of the running sequences: the tokens whose KV their
                slot holds at positions ``[0, len(tokens))`` and will not rewrite.
            min_copy: copy a prefix from another slot when it spares at least this many tokens
                of prefill; ``None``: never copy.

        Returns:
            ``None`` when every slot is taken, else the slot and how its KV is reused.
        """
        if not self._free:
            return None
        ids = np.asarray(prompt, dtype=np.int64)
        common = {slot: common_prefix(self._cached.get(slot), ids) for slot in self._free}
        hits = {slot: reusable(n) for slot, n in common.items()}
        lru = min(self._free, key=self._free.__getitem__)
        best = max(self._free, key=lambda s: (hits[s], -self._free[s]))  # longest, then LRU
        source, longest = best, hits[best]
        if min_copy is not None:
            for slot, tokens in running:
                h = reusable(common_prefix(np.asarray(tokens, dtype=np.int64), ids))
                if h > longest:
                    source, longest = slot, h
        # the prompt starts with the slot's whole cache: the sequence leaves it there again
        kept = self.cached_tokens(best) <= common[best]
        if source == best and (kept or best == lru or min_copy is None):
            taken = Taken(best, hits[best])     # nothing of its cache is lost, or no copying
        elif min_copy is not None and longest - hits[lru] >= max(1, min_copy):
            taken = Taken(lru, longest, source)
        else:
            taken = Taken(lru, hits[lru])
        del self._free[taken.slot]
        self._cached.pop(taken.slot, None)
        return taken

    def give_back(self, slot: int, cached: Sequence[int] = ()) -> None:
        """Return ``slot``; ``cached``: the tokens whose KV it keeps at positions
        ``[0, len(cached))`` (empty: nothing reusable).

        Raises:
            ValueError: the slot is already free.
        """
        if slot in self._free:
            raise ValueError(f"slot {slot} freed twice")
        self._free[slot] = next(self._clock)
        if len(cached):
            self._cached[slot] = np.array(cached, dtype=np.int64)

    def forget(self) -> None:
        """Drop every cached prefix (the free slots stay free)."""
        self._cached.clear()

    def cached_tokens(self, slot: int) -> int:
        """Tokens whose KV the free ``slot`` keeps for reuse (0 for a slot in use)."""
        c = self._cached.get(slot)
        return 0 if c is None else len(c)

    @property
    def free(self) -> int:
        return len(self._free)


def common_prefix(a: np.ndarray | None, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int64 ``[n]`` arrays (0 for ``a=None``)."""
    if a is None:
        return 0
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def reusable_prefix(common: int, n_prompt: int, chunk: int, any_split: bool) -> int:
    """How many of the ``common`` leading prompt tokens whose KV a slot holds a prompt of
    ``n_prompt`` tokens may reuse, so that its KV and first logits are bit for bit those of a
    prefill without the cache (:func:`plan_prefill` cuts it at the multiples of ``chunk``).

    At least the last prompt token is always prefilled (its logits are needed). With
    ``any_split`` (the backend computes a position alike in any chunk of two tokens or more,
    :attr:`~tiny_mindie.model.backend.Backend.prefix_split_invariant`) the reused prefix may end
    anywhere, except one token before the end of a piece the plan would have run whole: that
    last token would run alone, through the decode kernels. Without it, the reused prefix ends
    at a cut (a multiple of ``chunk``), so the rest is prefilled in the same pieces as without
    the cache.
    """
    h = min(common, n_prompt - 1)
    if h <= 0:
        return 0
    if not any_split:
        return h - h % chunk
    piece_start = h - h % chunk
    piece_end = min(piece_start + chunk, n_prompt)
    if h != piece_start and piece_end - h < 2:
        h -= 1
    return h


def plan_prefill(pending: Iterable[tuple[T, int, int]],
                 limits: SchedulerLimits) -> list[tuple[T, int]]:
    """Split this step's prefill budget among sequences that still have prompt tokens.

    A prompt is cut at fixed positions, the multiples of ``max_prefill_tokens``: a step gives a
    sequence whole pieces ``[k * C, min((k + 1) * C, prompt length))``, never part of one. So
    where a prompt is cut depends on its length alone, not on what else is waiting, and the
    backend computes its KV cache and its first logits the same way under any load (a prompt
    cut elsewhere would be computed in other chunk shapes, and a one-token chunk by the decode
    kernels: other rounding, another answer).

    Args:
        pending: ``(sequence, prompt tokens already in the KV cache, prompt tokens not yet)`` in
            admission order.

    Returns:
        ``(sequence, tokens to process now)`` for at most ``max_prefill_batch_size`` sequences
        and at most ``max_prefill_tokens`` tokens in all (one piece each); the first sequence
        always gets its next piece, so progress is guaranteed. A later sequence whose piece
        does not fit in what is left waits, and smaller pieces behind it may use the rest.
    """
    chunk = max(1, limits.max_prefill_tokens)
    plan: list[tuple[T, int]] = []
    budget = chunk
    for seq, done, remaining in pending:
        if len(plan) >= limits.max_prefill_batch_size or budget <= 0:
            break
        n = min(remaining, chunk - done % chunk)        # up to the next cut
        if n <= budget:
            plan.append((seq, n))
            budget -= n
    return plan
