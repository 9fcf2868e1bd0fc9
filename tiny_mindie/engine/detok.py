"""Incremental detokenization: token ids -> UTF-8-safe text deltas, with stop strings.

Each token contributes raw bytes (``Tokenizer.token_bytes``); an incremental UTF-8 decoder turns
them into text only when characters are complete, so a character split across tokens is sent
whole with the token that completes it and never as U+FFFD (spec §2). Text that might be the
start of a stop string is held back until it is known not to be one.

Stop strings are matched as the text comes, by one Knuth-Morris-Pratt automaton per stop
string (:class:`_StopString`): the work per output character is constant, whatever the length
of the stop strings a client sent.
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
        self._stops = tuple(_StopString(s) for s in stop_strings if s)
        self._include_stop = include_stop_string
        self._text = ""        # all decoded text so far (stop-truncated once stopped)
        self._emitted = 0      # characters of _text already returned as deltas
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
        start = len(self._text)
        self._text += piece
        if self._stops and not stops:
            for s in self._stops:
                s.matched = 0      # a stop string found later starts after this text
            return self._take(len(self._text))
        if self._stops:
            hit = self._find_stop(piece, start)
            if hit is not None:
                self._text = self._text[:hit]
                self.stopped = True
                return self._take(len(self._text))
            return self._take(len(self._text) - max(s.matched for s in self._stops))
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

    def _find_stop(self, piece: str, start: int) -> int | None:
        """Feed ``piece`` (the text from ``start`` on) to every stop string; where the text
        ends when one of them matched in it (the earliest starting match wins, then the first
        stop string given): before the match, or after it with ``include_stop_string``."""
        best = None
        for s in self._stops:
            end = s.feed(piece)
            if end is not None:
                at = start + end - len(s.text)
                if best is None or at < best[0]:
                    best = (at, len(s.text))
        if best is None:
            return None
        return best[0] + (best[1] if self._include_stop else 0)


class _StopString:
    """A stop string and how much of it ends the text fed so far (:attr:`matched`, its longest
    prefix that is a suffix of the text: what must be held back), kept up by the
    Knuth-Morris-Pratt failure function: amortized constant work per character fed."""

    def __init__(self, text: str):
        self.text = text
        self.matched = 0
        self._fail = fail = [0] * len(text)    # longest proper border of text[:i + 1]
        k = 0
        for i in range(1, len(text)):
            while k and text[i] != text[k]:
                k = fail[k - 1]
            if text[i] == text[k]:
                k += 1
            fail[i] = k

    def feed(self, piece: str) -> int | None:
        """Follow ``piece``; the index in it just past the first full match, else ``None``."""
        text, fail, k = self.text, self._fail, self.matched
        for i, ch in enumerate(piece):
            while k and text[k] != ch:
                k = fail[k - 1]
            if text[k] == ch:
                k += 1
                if k == len(text):
                    self.matched = k
                    return i + 1
        self.matched = k
        return None
