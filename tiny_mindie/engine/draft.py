"""Speculative decoding with a draft model: a smaller model of the target's family proposes the
next tokens, the target verifies them (:mod:`.speculation`).

A draft proposes greedily: it feeds the sequence's tokens it has not seen yet, takes the most
likely next token, and repeats, ``k`` times at most, stopping early when its own top
probability falls below :attr:`DraftModel.p_min` (a guess the target would likely reject costs
a draft step and a verification row; llama.cpp's ``--draft-p-min`` is the same rule). What it
proposes never changes the answer: the target keeps a proposal only where its own sample, drawn
as plain decoding would draw it, equals it.

The draft has a few KV slots of its own, each remembering which tokens its KV holds; a
sequence uses the slot sharing the longest prefix with it, so after a verification only the
tokens the draft has not fed yet (the target's last sample, usually one) are fed again, and a
sequence that comes back after another one ran reuses what its slot still holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from ..model.backend import Backend, SeqChunk
from ..model.tokenizer import Tokenizer, Vocabulary

#: A drafted token whose probability under the draft is below this ends the proposal.
P_MIN = 0.5


def vocabulary_difference(target: Tokenizer | Vocabulary,
                          draft: Tokenizer | Vocabulary) -> str | None:
    """The first way ``draft``'s vocabulary differs from ``target``'s, in words, or ``None``
    when both have the same tokens (ids, texts and kinds) and the same special ids (BOS, EOS,
    end-of-generation). Built tokenizers or the vocabularies read from their GGUF files
    (:func:`~tiny_mindie.model.tokenizer_load.read_vocabulary`) alike."""
    if target.vocab_size != draft.vocab_size:
        return f"the draft has {draft.vocab_size} tokens, the target {target.vocab_size}"
    for name in ("bos_id", "eos_id", "eog_ids"):
        a, b = getattr(target, name), getattr(draft, name)
        if a != b:
            shown = (sorted(a), sorted(b)) if name == "eog_ids" else (a, b)
            return f"{name}: the target's is {shown[0]}, the draft's {shown[1]}"
    for i in range(target.vocab_size):
        if target.token_text(i) != draft.token_text(i) or target.is_special(i) != \
                draft.is_special(i):
            return (f"token {i}: the target's is {target.token_text(i)!r}, the draft's "
                    f"{draft.token_text(i)!r}")
    return None


class DraftModel:
    """A draft model's backend and what its KV slots hold.

    Args:
        backend: the draft model, loaded with its own KV slots (a few suffice: only a sequence
            decoding alone speculates).
        max_chunk: tokens fed in one run at most (the server's prefill chunk).
        p_min: see :data:`P_MIN`.
        path: the draft's model file (for the banner and logs).
        resident_bytes: memory the draft added to the process when it loaded, bytes.

    Attributes:
        seconds: time spent running the draft, in seconds (all runs, catching up included).
    """

    WINDOW = 16

    def __init__(self, backend: Backend, max_chunk: int, p_min: float = P_MIN, *,
                 path: str = "", resident_bytes: int = 0):
        self.backend = backend
        self.path = path
        self.resident_bytes = resident_bytes
        self.max_chunk = max(1, max_chunk)
        self.p_min = p_min
        self.seconds = 0.0
        self._held: list[list[int]] = [[] for _ in range(backend.num_slots)]
        self._used = [0] * backend.num_slots
        self._clock = 0
        self._steps: deque[float] = deque(maxlen=self.WINDOW)

    @property
    def step_s(self) -> float | None:
        """Seconds of a one-token draft step: the median of the last :attr:`WINDOW`, or
        ``None`` before one was timed. (Catching up on many unseen tokens is not a step: the
        speculator asks the draft only while that stays short.)"""
        return float(np.median(self._steps)) if self._steps else None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens the draft expects after ``tokens`` (greedy, stopping early below
        :attr:`p_min`; fewer where the draft's context ends).

        Args:
            tokens: the sequence so far (prompt and output), token ids; at least one.
            k: proposals at most.
        """
        k = min(k, self.backend.max_seq_len - len(tokens))
        if k < 1 or not tokens:
            return []
        slot, held = self._slot_for(tokens)
        self._clock += 1
        self._used[slot] = self._clock
        start = held
        out: list[int] = []
        feed = list(tokens[held:])
        self._held[slot] = list(tokens[:held])      # all that stays valid should a run fail
        while True:
            logits = self._run(slot, start, feed)
            start += len(feed)
            row = logits[0]
            best = int(np.argmax(row))
            top = row[best]
            # softmax probability of the argmax: 1 / sum(exp(x - max))
            if 1.0 / float(np.exp(row - top).sum()) < self.p_min:
                break
            out.append(best)
            if len(out) == k:
                break
            feed = [best]
        self._held[slot] = [*tokens, *out][:start]
        return out

    def behind(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` a :meth:`propose` call would feed before its first proposal
        (at least 1)."""
        return len(tokens) - self._slot_for(tokens)[1]

    def _slot_for(self, tokens: Sequence[int]) -> tuple[int, int]:
        """The slot holding the longest prefix of ``tokens`` (the least recently used among
        equals), and how many of its tokens are reused (at most ``len(tokens) - 1``: the
        last token is always fed, for its logits)."""
        best, best_n = 0, -1
        arr = np.asarray(tokens)
        for slot, held in enumerate(self._held):
            n = min(len(held), len(arr) - 1)
            if n:
                same = np.asarray(held[:n]) == arr[:n]
                n = n if same.all() else int(np.argmin(same))
            if n > best_n or (n == best_n and self._used[slot] < self._used[best]):
                best, best_n = slot, n
        return best, best_n

    def _run(self, slot: int, start: int, ids: list[int]) -> np.ndarray:
        """Feed ``ids`` at ``start`` in chunks of :attr:`max_chunk`; the last one's logits."""
        t0 = time.perf_counter()
        for j in range(0, len(ids), self.max_chunk):
            piece = np.asarray(ids[j:j + self.max_chunk], dtype=np.int64)
            logits = self.backend.forward([SeqChunk(slot, start + j, piece)])
        took = time.perf_counter() - t0
        self.seconds += took
        if len(ids) == 1:
            self._steps.append(took)
        return logits
