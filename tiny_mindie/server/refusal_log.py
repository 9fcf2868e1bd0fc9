"""Log lines that a flood cannot multiply: :class:`RateLimitedLog` writes one kind of event at most
once per window and sums up the rest by reason; :class:`RefusalLogs` holds one per kind of
refusal of a server's listeners (:mod:`.listen`).
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger("tiny_mindie.server")

LOG_EVERY_SECONDS = 10.0        # at most one line per kind of refusal this often


class RateLimitedLog:
    """Log one kind of event at most once per ``every`` seconds: the first at once, the others of
    the window as one line when the window ends, summed up by reason with a count and the last
    message of each (called on an event loop).

    Calling it: ``log(message, reason="", kind=reason)``; ``reason`` groups the held events, e.g.
    ``certificate revoked ... 'CN=alice'``, so a flood of one reason never hides another; events
    of one reason are summed up as the last message with the count. At most
    :attr:`MAX_REASONS` reasons are kept per window with their message; events of later ones
    are counted by their ``kind``, a short name from a small set (e.g. ``certificate revoked``
    without the client), and each kind is named in the summary. Past :attr:`MAX_KINDS` kinds a
    window counts the rest as ``for other reasons`` (a bound on memory; a fixed set of kinds
    never reaches it).
    """

    MAX_REASONS = 8
    MAX_KINDS = 64

    def __init__(self, level: int, every: float = LOG_EVERY_SECONDS, logger: logging.Logger = log):
        self.level, self.every, self.logger = level, every, logger
        self.window_end = 0.0
        self.held: dict[str, list] = {}    # reason -> [count, last message], first seen first
        self.others: dict[str, int] = {}   # kind -> held events beyond MAX_REASONS reasons
        self.flush_handle: asyncio.TimerHandle | None = None

    def __call__(self, message: str, reason: str = "", kind: str | None = None) -> None:
        now = time.monotonic()
        if now >= self.window_end and not self.held and not self.others:
            self.window_end = now + self.every
            self.logger.log(self.level, "%s", message)
            return
        key = reason
        if key in self.held:
            self.held[key][0] += 1
            self.held[key][1] = message
        elif len(self.held) < self.MAX_REASONS:
            self.held[key] = [1, message]
        else:
            kind = reason if kind is None else kind
            if kind not in self.others and len(self.others) >= self.MAX_KINDS:
                kind = ""                  # for other reasons
            self.others[kind] = self.others.get(kind, 0) + 1
        if self.flush_handle is None:
            loop = asyncio.get_running_loop()
            self.flush_handle = loop.call_later(max(0.0, self.window_end - now), self._flush)

    def _flush(self) -> None:
        self.flush_handle = None
        if not self.held and not self.others:
            return
        total = sum(n for n, _ in self.held.values()) + sum(self.others.values())
        if len(self.held) == 1 and not self.others:
            (n, last), = self.held.values()
            self.logger.log(self.level, "%s (%d like this in the last %g s)", last, n, self.every)
        else:
            parts = [f"{n}x {last}" for n, last in self.held.values()]
            parts += [f"{n}x {kind or 'for other reasons'}" for kind, n in self.others.items()]
            self.logger.log(self.level, "%d more in the last %g s: %s", total, self.every,
                            "; ".join(parts))
        self.held, self.others = {}, {}
        self.window_end = time.monotonic() + self.every


class RefusalLogs:
    """The rate-limited log lines of a server's listeners, one per kind."""

    def __init__(self, every: float = LOG_EVERY_SECONDS):
        self.refused = RateLimitedLog(logging.WARNING, every)
        self.timed_out = RateLimitedLog(logging.WARNING, every)
        self.evicted = RateLimitedLog(logging.WARNING, every)
        self.full = RateLimitedLog(logging.WARNING, every)
        self.exhausted = RateLimitedLog(logging.ERROR, every)
