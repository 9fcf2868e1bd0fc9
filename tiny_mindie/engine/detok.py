"""Incremental detokenization: token ids -> UTF-8-safe text deltas, with stop strings.

Each token contributes raw bytes (``Tokenizer.token_bytes``); an incremental UTF-8 decoder turns
them into text only when characters are complete, so a character split across tokens is sent
whole with the token that completes it and never as U+FFFD (spec §2). Text that might be the
start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one token at a time.

    Args:
        token_bytes: ``token_id -> bytes`` (special tokens give ``b""``).
        stop_strings: strings that end generation when they appear in the output.
        include_stop_string: keep the matched stop string in :attr:`text`.
    """

    def __init__(self, token_bytes, stop_strings: Sequence[str] = (),
                 include_stop_string: bool = False):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stop_strings if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_string
        self._text = ""        # all decoded text so far (stop-truncated once stopped)
        self._emitted = 0      # characters of _text already returned as deltas
        self._from = 0         # stop strings are looked for from here on (add(stops=False))
        self.stopped = False   # a stop string matched

    @property
    def text(self) -> str:
        """All output text so far (after a stop match: cut at, or just after, the stop string)."""
        return self._text

    def add(self, token_id: int, stops: bool = True) -> str:
        """Append one token; return the text that can be sent now (possibly ``""``). With
        ``stops`` false (``min_tokens`` not reached) no stop string is looked for, and none
        found later starts in the text added so far."""
        if self.stopped:
            return ""
        piece = self._decoder.decode(self._token_bytes(token_id))
        if not piece:
            return ""
        search_from = max(self._from, len(self._text) - self._max_stop + 1)
        self._text += piece
        if self._stops and not stops:
            self._from = len(self._text)
            return self._take(len(self._text))
        if self._stops:
            hit = self._find_stop(search_from)
            if hit is not None:
                start, stop = hit
                self._text = self._text[:start + (len(stop) if self._include_stop else 0)]
                self.stopped = True
                return self._take(len(self._text))
            return self._take(len(self._text) - self._held_back())
        return self._take(len(self._text))

    def finish(self) -> str:
        """End of generation: release text held back for a possible stop string. Bytes of an
        incomplete UTF-8 character at the very end are dropped rather than sent as U+FFFD."""
        self._decoder.reset()
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        delta = self._text[self._emitted:upto]
        self._emitted = max(self._emitted, upto)
        return delta

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best = None
        for s in self._stops:
            i = self._text.find(s, search_from)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        tail = self._text[-self._max_stop:] if self._max_stop else ""
        for n in range(min(len(tail), self._max_stop - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
