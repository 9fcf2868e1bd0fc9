"""Which sequences run in the next forward pass: a priority queue feeding a running batch.

Continuous batching (Yu et al. 2022, "Orca"): waiting requests are admitted into the running
batch between steps whenever a KV-cache slot is free; every step decodes one token for each
running sequence that has finished its prompt, and spends a token budget on the prompts of the
others (chunked prefill), so a long prompt never stalls the running streams.

Pure bookkeeping: no threads, no numpy, no I/O. The engine owns the lock around it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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


class SlotPool:
    """The KV-cache slots of the backend: ``num_slots`` sequences fit at once."""

    def __init__(self, num_slots: int):
        self.total = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give_back(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} freed twice")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)


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
