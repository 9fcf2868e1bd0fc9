#!/usr/bin/env python3
"""Mutation fuzzer for the sans-IO HTTP/1.1 request parser (tiny_mindie/server/http.py).

It mutates a seed corpus of valid and invalid requests (the built-in :data:`SEEDS` plus the
files of ``tests/support/fuzz_corpus/``) with byte flips, inserts, deletes, duplications, splices,
duplicated and rewritten header lines, re-chunked bodies and huge numbers, and checks every
input against three oracles:

``exception``
    :meth:`RequestParser.next_event` raises nothing but ``HTTPError``, and no ``HTTPError``
    it raises wraps another exception (the parser turns an internal error into a 400 with
    ``__cause__`` set; that is a bug all the same).
``split``
    Feeding the bytes whole, split at random points, and a byte at a time gives the same
    sequence of events: the same heads, the same requests with their bodies and trailers, and
    the same final ``HTTPError`` (status and message), if any.
``message``
    An ``HTTPError`` message, which the client sees, quotes at most a short excerpt of the
    input (:data:`MAX_MESSAGE` characters in all).

Each input runs under the default limits and under small ones (so that the 414/431/413
boundaries are reached often).  Inputs that reach new lines of the parser (line-to-line edges,
traced on the whole-feed run) or a new kind of outcome (an event or error kind not seen yet)
join the working pool.  A finding is
shrunk (while it still fails the same way) and written to ``--findings`` as raw bytes;
the exit status is 1 when there are findings.  Worth keeping ones go to
``tests/support/fuzz_corpus/``, which the fast tests replay (tests/unit/test_http_fuzz.py).

    python scripts/fuzz_http.py --seconds 60            # random seed, one minute
    python scripts/fuzz_http.py --iterations 20000 --seed 1
    python scripts/fuzz_http.py --replay tests/support/fuzz_corpus
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import random
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_REPO, "tiny_mindie")):   # run from a checkout: fuzz this tree
    sys.path.insert(0, _REPO)

from tiny_mindie.server import http as _http  # noqa: E402
from tiny_mindie.server import http_head as _http_head  # noqa: E402
from tiny_mindie.server.http import NEED_DATA, HTTPError, Request, RequestHead, RequestParser  # noqa: E402

CORPUS_DIR = os.path.join(_REPO, "tests", "support", "fuzz_corpus")

#: Parser limits every input is run under: the defaults, and small ones that fuzzed inputs
#: reach easily.
PROFILES: tuple[dict[str, int], ...] = (
    {},
    {"max_header_bytes": 256, "max_request_line_bytes": 64, "max_body_bytes": 64},
)

#: Built-in seeds: valid requests of every shape the parser accepts, and typical bad ones.
SEEDS: tuple[bytes, ...] = (
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
    b"GET /v2/models/m%C3%A9/ready?a=1&b=x%20y&flag HTTP/1.1\r\nHost: 127.0.0.1:1025\r\n\r\n",
    b"POST /infer HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 17\r\n"
    b"\r\n{\"inputs\": \"hi\"}\n",
    b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value;flag\r\nhello\r\n6 ; q=\"a b\"\r\n world\r\n0\r\nX-Checksum: abc\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\nbody",
    b"\r\n\nGET /a HTTP/1.1\nHost: h\nConnection: close\n\n",
    b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    b"GET http://[::1]:1025/health?x=1 HTTP/1.1\r\nHost: [::1]:1025\r\n\r\n",
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nPOST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
    b"GET /c HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET http://[/ HTTP/1.1\r\nHost: h\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n folded\r\n\r\n",
    b"GET / HTTP/2.0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 200-ok\r\nContent-Length: 1\r\n\r\nx",
)

#: Byte strings worth inserting: framing characters, delimiters, keywords, numbers.
TOKENS: tuple[bytes, ...] = (
    b"\r\n", b"\n", b"\r", b"\r\n\r\n", b" ", b"\t", b":", b";", b",", b"=", b"\"", b"\x00",
    b"\x7f", b"\x80", b"\xff", b"%", b"%00", b"%ff", b"%C3%A9", b"[", b"]", b"@", b"#", b"?",
    b"/", b"*", b"&", b"0", b"1", b"9", b"-1", b"+1", b"0x1", b"ffffffffffffffffffff",
    b"99999999999999999999999", b"18446744073709551616", b"chunked", b"Chunked", b"gzip",
    b"identity", b"close", b"keep-alive", b"100-continue", b"Host: h\r\n", b"Host:",
    b"Content-Length: ", b"Transfer-Encoding: chunked\r\n", b"Expect: 100-continue\r\n",
    b"Connection: close\r\n", b"http://", b"https://", b"http://[", b"HTTP/1.1", b"HTTP/1.0",
    b"HTTP/0.9", b"0\r\n\r\n", b"GET ", b"POST ", b"CONNECT ", b"::1", b"v1.x",
)

#: Longest acceptable HTTPError message (they may quote a short excerpt of the input only).
MAX_MESSAGE = 200

_DIGIT_RUN = re.compile(rb"[0-9A-Fa-f]+")
_EXCERPT = re.compile(r"'.*'|\".*\"|[0-9]+")


# --- running the parser ---------------------------------------------------------------------

@dataclass(frozen=True)
class Crash:
    """An exception other than a clean ``HTTPError`` out of the parser (the ``exception``
    oracle failed)."""

    kind: str              # exception type name, or "HTTPError<-Type" for a wrapped one
    text: str              # the formatted traceback


def run_parser(chunks: Iterable[bytes], limits: dict[str, int]) -> list:
    """Feed ``chunks`` one by one, draining events after each.

    Returns the events in order (:class:`RequestHead` / :class:`Request` objects), ending
    with ``("error", status, message)`` when the parser refused the input, or with a
    :class:`Crash` when it raised anything else (or a 400 wrapping an internal exception).
    """
    parser = RequestParser(**limits)
    out: list = []
    try:
        for chunk in chunks:
            parser.feed(chunk)
            while (event := parser.next_event()) is not NEED_DATA:
                out.append(event)
    except HTTPError as exc:
        if exc.__cause__ is not None:
            cause = exc.__cause__
            out.append(Crash(f"HTTPError<-{type(cause).__name__}", "".join(
                traceback.format_exception(type(cause), cause, cause.__traceback__))))
        else:
            out.append(("error", exc.status, exc.message))
    except Exception as exc:  # the oracle: anything but HTTPError is a finding
        out.append(Crash(type(exc).__name__, traceback.format_exc()))
    return out


def random_splits(data: bytes, rng: random.Random) -> list[bytes]:
    """``data`` cut at 1 to 8 random points (pieces may be empty)."""
    cuts = sorted(rng.randint(0, len(data)) for _ in range(rng.randint(1, 8)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def byte_pieces(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


@dataclass
class Finding:
    """An input that failed an oracle."""

    oracle: str            # "exception", "split" or "message"
    data: bytes
    limits: dict[str, int]
    detail: str
    kind: str = ""         # what went wrong, without input excerpts (findings are deduplicated
                           # on oracle and kind)

    @property
    def key(self) -> str:
        return hashlib.sha1(self.data).hexdigest()[:12]


def check(data: bytes, rng: random.Random, limits: dict[str, int], *, all_splits: bool = False,
          byte_limit: int = 4096) -> tuple[list, Finding | None]:
    """The oracles on ``data`` under ``limits``.

    Splits tried: ``random_splits`` (three draws), a byte at a time (when ``data`` is at most
    ``byte_limit`` bytes; else pieces of 1-16 bytes), and with ``all_splits`` every two-piece
    split.  Returns the whole-feed events and the first finding (or ``None``).
    """
    whole = run_parser([data], limits)
    if whole and isinstance(whole[-1], Crash):
        return whole, _crash_finding(data, limits, whole[-1])
    if whole and isinstance(whole[-1], tuple) and len(whole[-1][2]) > MAX_MESSAGE:
        message = whole[-1][2]
        return whole, Finding("message", data, limits, message,
                              f"over {MAX_MESSAGE} characters: {_EXCERPT.sub('*', message)[:60]}")
    tries: list[Sequence[bytes]] = [random_splits(data, rng) for _ in range(3)]
    if len(data) <= byte_limit:
        tries.append(byte_pieces(data))
    else:
        pieces, i = [], 0
        while i < len(data):
            n = rng.randint(1, 16)
            pieces.append(data[i:i + n])
            i += n
        tries.append(pieces)
    if all_splits:
        tries.extend([data[:i], data[i:]] for i in range(1, len(data)))
    for chunks in tries:
        split = run_parser(chunks, limits)
        if split and isinstance(split[-1], Crash):
            return whole, _crash_finding(data, limits, split[-1])
        if split != whole:
            sizes = [len(c) for c in chunks]
            detail = (f"pieces {sizes[:20]}{'...' if len(sizes) > 20 else ''}\n"
                      f"whole: {_describe(whole)}\nsplit: {_describe(split)}")
            kind = (f"{_describe(whole[-1:], generic=True)} whole, "
                    f"{_describe(split[-1:], generic=True)} split")
            return whole, Finding("split", data, limits, detail, kind)
    return whole, None


def _crash_finding(data: bytes, limits: dict[str, int], crash: Crash) -> Finding:
    frames = re.findall(r'File "[^"]*?([^/"]+)", line (\d+)', crash.text)
    where = ":".join(frames[-1]) if frames else "?"
    last = _EXCERPT.sub("*", crash.text.strip().splitlines()[-1])
    return Finding("exception", data, limits, crash.text, f"{crash.kind} at {where}: {last}")


def _describe(events: list, generic: bool = False) -> str:
    """Events for a report; ``generic`` drops quoted input excerpts from error messages."""
    def one(e) -> str:
        if not isinstance(e, tuple):
            return type(e).__name__
        return f"({e[1]}, {_EXCERPT.sub(repr('*'), e[2])!r})" if generic else repr(e)
    return "[" + ", ".join(one(e) for e in events) + "]"


def signature(events: list) -> frozenset:
    """The kinds of outcome ``events`` holds: event kinds with head flags, error status and
    message without its excerpts and numbers."""
    sig = []
    for ev in events:
        if isinstance(ev, RequestHead):
            sig.append(("head", ev.chunked, ev.content_length is None, ev.keep_alive,
                        ev.expects_continue, ev.version))
        elif isinstance(ev, Request):
            sig.append(("request", bool(ev.body), bool(ev.trailers)))
        elif isinstance(ev, tuple):
            sig.append((ev[1], _EXCERPT.sub("'*'", ev[2])))
    return frozenset(sig)


# --- coverage (line-to-line edges inside http.py and http_head.py) ----------------------------

class EdgeTracer:
    """Collects (previous line, line) pairs executed in the parser's modules while active."""

    def __init__(self) -> None:
        self.filenames = {_http.__file__, _http_head.__file__}
        self.edges: set[tuple[int, int]] = set()
        self._prev: dict[int, int] = {}

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename not in self.filenames:
            return None
        self._prev[id(frame)] = -frame.f_code.co_firstlineno
        return self._local

    def _local(self, frame, event, arg):
        if event == "line":
            key = id(frame)
            self.edges.add((self._prev.get(key, 0), frame.f_lineno))
            self._prev[key] = frame.f_lineno
        return self._local

    def run(self, fn: Callable[[], list]) -> tuple[list, set[tuple[int, int]]]:
        """``fn()`` under tracing; its result and the edges it executed."""
        self.edges, self._prev = set(), {}
        old = sys.gettrace()
        sys.settrace(self._global)
        try:
            result = fn()
        finally:
            sys.settrace(old)
        return result, self.edges


# --- mutations ------------------------------------------------------------------------------

def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def _rechunk(data: bytes, rng: random.Random) -> bytes:
    """The message with its body (everything after the first empty line) re-framed as a
    chunked body of random chunk sizes, with optional extensions and trailers."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        head, body = data, b""
    lines = [ln for ln in head.split(b"\r\n")
             if not ln.lower().startswith((b"content-length:", b"transfer-encoding:"))]
    out = [b"\r\n".join(lines + [b"Transfer-Encoding: chunked"]), b"\r\n\r\n"]
    i = 0
    while i < len(body):
        n = rng.randint(1, max(1, len(body)))
        ext = rng.choice([b"", b";a=b", b" ; q=\"x y\"", b";" + b"e" * rng.randint(1, 40)])
        size = rng.choice([b"%x", b"%X", b"%04x"]) % len(body[i:i + n])
        out += [size, ext, b"\r\n", body[i:i + n], b"\r\n"]
        i += n
    out.append(b"0\r\n")
    if rng.random() < 0.5:
        out.append(b"".join(b"X-T%d: %s\r\n" % (k, b"v" * rng.randint(0, 20))
                            for k in range(rng.randint(1, 4))))
    out.append(b"\r\n")
    return b"".join(out)


def mutate(data: bytes, pool: Sequence[bytes], rng: random.Random) -> bytes:
    """One random mutation of ``data`` (``pool`` supplies splice partners)."""
    n = len(data)
    op = rng.randrange(13)
    pos = rng.randint(0, n)
    if op == 0 and n:                                       # flip bits of one byte
        i = rng.randrange(n)
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    if op == 1 and n:                                       # random byte
        i = rng.randrange(n)
        return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]
    if op == 2:                                             # insert a token
        return data[:pos] + rng.choice(TOKENS) + data[pos:]
    if op == 3:                                             # insert random bytes
        return data[:pos] + rng.randbytes(rng.randint(1, 8)) + data[pos:]
    if op == 4 and n:                                       # delete a range
        i = rng.randrange(n)
        return data[:i] + data[i + rng.randint(1, min(32, n - i)):]
    if op == 5 and n:                                       # duplicate a range
        i = rng.randrange(n)
        j = min(n, i + rng.randint(1, 64))
        return data[:j] + data[i:j] * rng.randint(1, 4) + data[j:]
    if op == 6:                                             # splice with another input
        other = rng.choice(pool)
        return data[:pos] + other[rng.randint(0, len(other)):]
    if op == 7:                                             # concatenate (pipelining)
        return data + rng.choice(pool)
    if op == 8:                                             # duplicate a header line
        lines = _lines(data)
        if len(lines) > 2:
            i = rng.randrange(1, len(lines) - 1)
            lines.insert(i, lines[i])
            return b"\n".join(lines)
    if op == 9:                                             # rewrite a header's value
        lines = _lines(data)
        cands = [i for i, ln in enumerate(lines) if b":" in ln]
        if cands:
            i = rng.choice(cands)
            name = lines[i].split(b":", 1)[0]
            cr = b"\r" if lines[i].endswith(b"\r") else b""
            lines[i] = name + b": " + rng.choice(TOKENS).strip() + cr
            return b"\n".join(lines)
    if op == 10:                                            # re-frame the body as chunked
        return _rechunk(data, rng)
    if op == 11:                                            # a huge or odd number
        runs = list(_DIGIT_RUN.finditer(data))
        if runs:
            m = rng.choice(runs)
            big = rng.choice([b"9" * rng.randint(19, 60), b"f" * rng.randint(16, 80),
                              b"0" * rng.randint(1, 30) + b"1", b"18446744073709551616",
                              b"4294967296", b"-1"])
            return data[:m.start()] + big + data[m.end():]
    if op == 12 and n:                                      # flip the case of a range
        i = rng.randrange(n)
        return data[:i] + data[i:i + rng.randint(1, 16)].swapcase() + data[i + 16:]
    return data[:pos] + rng.choice(TOKENS) + data[pos:]


# --- shrinking ------------------------------------------------------------------------------

def shrink(finding: Finding, rng: random.Random, budget: int = 2000) -> Finding:
    """A smaller input failing the same way (removing spans, halving their size)."""
    def still_fails(data: bytes) -> Finding | None:
        _, found = check(data, random.Random(rng.random()), finding.limits)
        return found if found is not None and found.kind == finding.kind else None

    best = finding
    span = max(1, len(best.data) // 2)
    while span >= 1 and budget > 0:
        i, progressed = 0, False
        while i < len(best.data) and budget > 0:
            budget -= 1
            candidate = best.data[:i] + best.data[i + span:]
            found = still_fails(candidate) if candidate else None
            if found is not None:
                best, progressed = found, True
            else:
                i += span
        if not progressed:
            span //= 2
    return best


# --- the loop -------------------------------------------------------------------------------

def load_corpus(directory: str = CORPUS_DIR) -> list[bytes]:
    """The ``*.http`` files of ``directory`` as bytes, in name order (none when it does not
    exist)."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".http"):
            with open(os.path.join(directory, name), "rb") as f:
                out.append(f.read())
    return out


@dataclass
class Stats:
    """What a fuzzing run did."""

    iterations: int = 0
    pool: int = 0
    edges: int = 0
    outcomes: int = 0
    seconds: float = 0.0
    digest: str = ""               # SHA-1 of every input tried, in order (same seed, same run)
    findings: list[Finding] = field(default_factory=list)


def fuzz(*, seed: int, iterations: int | None = None, seconds: float | None = None,
         corpus: Sequence[bytes] = (), max_pool: int = 4000, max_len: int = 8192,
         coverage: bool = True, max_findings: int = 20,
         report: Callable[[Stats], None] | None = None) -> Stats:
    """Mutate ``SEEDS`` + ``corpus`` and check both oracles until ``iterations`` inputs or
    ``seconds`` have passed (whichever is given first; one of them is required).

    Deterministic for a given ``seed`` and ``iterations``.  ``report`` is called about every
    ten seconds with the running stats.  Returns the stats with the (shrunk) findings.
    """
    if iterations is None and seconds is None:
        raise ValueError("give iterations or seconds")
    rng = random.Random(seed)
    tracer = EdgeTracer() if coverage else None
    pool: list[bytes] = list(dict.fromkeys([*SEEDS, *corpus]))
    edges: set[tuple[int, int]] = set()
    outcomes: set[tuple] = set()
    seen_findings: set[tuple[str, str]] = set()
    stats = Stats()
    tried = hashlib.sha1()
    start = last_report = time.monotonic()
    while True:
        now = time.monotonic()
        if iterations is not None and stats.iterations >= iterations:
            break
        if seconds is not None and now - start >= seconds:
            break
        if report is not None and now - last_report >= 10:
            last_report = now
            stats.seconds, stats.pool, stats.edges = now - start, len(pool), len(edges)
            stats.outcomes = len(outcomes)
            report(stats)
        if stats.iterations < len(pool) and stats.iterations < len(SEEDS) + len(corpus):
            data = pool[stats.iterations]               # every seed once, unmutated
        else:
            data = rng.choice(pool)
            for _ in range(rng.choice((1, 1, 2, 3, 4, 8))):
                data = mutate(data, pool, rng)
            data = data[:max_len]
        stats.iterations += 1
        tried.update(b"%d:" % len(data) + data)
        limits = rng.choice(PROFILES)
        new_edges: set[tuple[int, int]] = set()
        if tracer is not None:
            _, new_edges = tracer.run(functools.partial(run_parser, [data], limits))
            new_edges -= edges
        events, found = check(data, rng, limits)
        if found is not None:
            if (found.oracle, found.kind) not in seen_findings:
                small = shrink(found, rng)
                seen_findings |= {(found.oracle, found.kind), (small.oracle, small.kind)}
                stats.findings.append(small)
                if len(stats.findings) >= max_findings:
                    break
            continue
        new_outcomes = signature(events) - outcomes
        if new_edges or new_outcomes:
            edges |= new_edges
            outcomes |= new_outcomes
            if len(pool) < max_pool:
                pool.append(data)
            else:
                pool[rng.randrange(len(SEEDS), max_pool)] = data
    stats.seconds = time.monotonic() - start
    stats.pool, stats.edges, stats.outcomes = len(pool), len(edges), len(outcomes)
    stats.digest = tried.hexdigest()
    return stats


def replay(inputs: Sequence[bytes], seed: int = 0, all_splits_up_to: int = 600) -> list[Finding]:
    """The oracles on each input under each of :data:`PROFILES`, fed whole, a byte at a time,
    at random splits, and (inputs up to ``all_splits_up_to`` bytes) split in two at every
    point.  Returns the findings (none when the parser is right)."""
    rng = random.Random(seed)
    findings = []
    for data in inputs:
        for limits in PROFILES:
            _, found = check(data, rng, limits, all_splits=len(data) <= all_splits_up_to,
                             byte_limit=1 << 16)
            if found is not None:
                findings.append(found)
    return findings


def _save(findings: Sequence[Finding], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for f in findings:
        path = os.path.join(directory, f"{f.oracle}-{f.key}.http")
        with open(path, "wb") as out:
            out.write(f.data)
        with open(path + ".txt", "w") as out:
            out.write(f"oracle: {f.oracle}\nkind: {f.kind}\nlimits: {f.limits}\n"
                      f"input: {f.data!r}\n\n{f.detail}\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, help="run this long (default 60 without --iterations)")
    ap.add_argument("--iterations", type=int,
                    help="run this many inputs (deterministic with --seed)")
    ap.add_argument("--seed", type=int, help="random seed (default: from the clock, printed)")
    ap.add_argument("--corpus", default=CORPUS_DIR,
                    help="seed corpus folder (default: %(default)s)")
    ap.add_argument("--findings", default="fuzz-findings",
                    help="where failing inputs are written (default: %(default)s)")
    ap.add_argument("--no-coverage", action="store_true",
                    help="no line-edge tracing (faster, blind to new code paths)")
    ap.add_argument("--replay", metavar="DIR", help="only check the files of DIR, no fuzzing")
    args = ap.parse_args(argv)

    if args.replay:
        inputs = load_corpus(args.replay)
        findings = replay(inputs)
        print(f"replayed {len(inputs)} inputs x {len(PROFILES)} limit profiles: "
              f"{len(findings)} findings")
    else:
        seed = args.seed if args.seed is not None else int(time.time())
        seconds = args.seconds if args.seconds is not None or args.iterations else 60.0
        corpus = load_corpus(args.corpus)
        print(f"fuzzing tiny_mindie/server/http.py: seed {seed}, {len(SEEDS)} seeds + "
              f"{len(corpus)} corpus files", flush=True)

        def report(s: Stats) -> None:
            rate = s.iterations / max(s.seconds, 1e-9)
            print(f"  {s.seconds:6.0f} s  {s.iterations:8d} inputs ({rate:.0f}/s)"
                  f"  pool {s.pool}  edges {s.edges}  outcomes {s.outcomes}"
                  f"  findings {len(s.findings)}", flush=True)

        stats = fuzz(seed=seed, iterations=args.iterations, seconds=seconds, corpus=corpus,
                     coverage=not args.no_coverage, report=report)
        report(stats)
        findings = stats.findings
    for f in findings:
        print(f"\nFINDING ({f.oracle}) {f.kind}\n  limits {f.limits}\n  input: {f.data[:300]!r}"
              f"{'...' if len(f.data) > 300 else ''}\n  " + f.detail.strip().replace("\n", "\n  "))
    if findings:
        _save(findings, args.findings)
        print(f"\n{len(findings)} findings written to {args.findings}/")
        return 1
    print("no findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())
