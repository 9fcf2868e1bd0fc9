"""The HTTP parser against its fuzz oracles: only HTTPError ever escapes, any split of the same
bytes gives the same events, and error messages stay short.

The oracles and the mutation fuzzer live in scripts/fuzz_http.py (run it for minutes by hand, see
docs/design/testing.md); here they replay the regression corpus tests/support/fuzz_corpus/, run the
fuzzer for a fixed number of iterations with a fixed seed, and drive hypothesis with generated
requests and arbitrary bytes (derandomized, no example database: the same examples on every run).
"""

from __future__ import annotations

import os
import random
import string
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from script_modules import load_script

from tiny_mindie.server.http import HTTPError, Request, RequestHead, RequestParser

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
fuzz_http = load_script("fuzz_http")

FIXED = settings(derandomize=True, database=None, deadline=None, max_examples=100,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def describe(findings) -> str:
    return "\n".join(f"{f.oracle}: {f.kind}\n  {f.data[:200]!r}\n  {f.detail[-600:]}"
                     for f in findings)


# --- corpus and the mutation fuzzer ---------------------------------------------------------

def test_regression_corpus_replays_clean():
    corpus = fuzz_http.load_corpus()
    assert len(corpus) >= 30
    assert b"GET http://[/ HTTP/1.1\r\nHost: h\r\n\r\n" in corpus
    findings = fuzz_http.replay(corpus)
    assert not findings, describe(findings)


def test_mutation_fuzzer_fixed_seed_finds_nothing():
    """A short, deterministic run in CI (the real runs are minutes long, by hand)."""
    corpus = fuzz_http.load_corpus()
    stats = fuzz_http.fuzz(seed=20240601, iterations=1000, corpus=corpus)
    assert stats.iterations == 1000
    assert not stats.findings, describe(stats.findings)
    # the coverage feedback works: mutants that reach new lines joined the pool
    assert stats.edges > 250 and stats.pool > len(fuzz_http.SEEDS) + len(corpus)


class _UrlsplitBug(RequestParser):
    """The parser as it was: an absolute-form target went through urlsplit unguarded."""

    def next_event(self):
        if b"://[" in self._buf:
            urlsplit("http://[/")                 # ValueError: Invalid IPv6 URL
        return super().next_event()


class _EarlyLimitBug(RequestParser):
    """Refuses a head as soon as 40 bytes are buffered without its end: a split-dependent
    answer, like the old request-line check that counted the CR before the LF."""

    def next_event(self):
        if self._state == "head" and len(self._buf) > 40 and b"\n\r\n" not in self._buf \
                and b"\n\n" not in self._buf:
            raise HTTPError(431, "too large")
        return super().next_event()


@pytest.mark.parametrize("planted, oracle", [(_UrlsplitBug, "exception"),
                                             (_EarlyLimitBug, "split")])
def test_fuzzer_finds_planted_bugs(monkeypatch, planted, oracle):
    """The oracles are not vacuous: the same fixed-seed run on a parser with a planted bug
    reports it, shrunk."""
    monkeypatch.setattr(fuzz_http, "RequestParser", planted)
    stats = fuzz_http.fuzz(seed=1, iterations=300, coverage=False, max_findings=1)
    assert [f.oracle for f in stats.findings] == [oracle]
    assert len(stats.findings[0].data) < 200


# --- hypothesis: generated requests ---------------------------------------------------------

_TOKEN_CHARS = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
_FRAMING = {"host", "content-length", "transfer-encoding", "connection", "expect"}
_VALUE_CHARS = st.sampled_from([chr(c) for c in [9, *range(0x20, 0x7f), *range(0x80, 0x100)]])


@dataclass
class Spec:
    """One generated request: what was sent, and what the parser must hand back."""

    method: str
    segments: list[str]
    query: list[tuple[str, str]]
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    framing: str                       # "none", "length" or "chunked"
    chunks: list[int]
    extensions: list[str]
    trailers: list[tuple[str, str]]
    connection: str
    expect: bool
    bare_lf: bool
    empty_lines: int
    host: bool                         # sent in HTTP/1.0 too (always in HTTP/1.1)
    authority: str                     # absolute-form "http://<authority>/..." unless empty
    sent_headers: list[tuple[str, str]] = field(default_factory=list)

    def render(self) -> bytes:
        eol = "\n" if self.bare_lf else "\r\n"
        target = "/" + "/".join(quote(s, safe="") for s in self.segments)
        if self.authority:
            target = f"http://{self.authority}{target}"
        if self.query:
            target += "?" + "&".join(f"{quote(k, safe='')}={quote(v, safe='')}"
                                     for k, v in self.query)
        headers = list(self.headers)
        if self.version == "HTTP/1.1" or self.host:
            headers.insert(0, ("Host", "example.com:1025"))
        if self.connection:
            headers.append(("Connection", self.connection))
        if self.expect:
            headers.append(("Expect", "100-continue"))
        if self.framing == "length":
            headers.append(("Content-Length", str(len(self.body))))
        elif self.framing == "chunked":
            headers.append(("Transfer-Encoding", "chunked"))
        self.sent_headers = [(n.lower(), v) for n, v in headers]
        head = "\r\n" * self.empty_lines + f"{self.method} {target} {self.version}{eol}"
        head += "".join(f"{n}: {v}{eol}" for n, v in headers) + eol
        out = head.encode("latin-1")
        if self.framing == "length":
            out += self.body
        elif self.framing == "chunked":
            pos = 0
            for size, ext in zip(self.chunks, self.extensions, strict=True):
                piece = self.body[pos:pos + size]
                pos += len(piece)
                if piece:
                    out += b"%x%s\r\n%s\r\n" % (len(piece), ext.encode(), piece)
            out += b"0\r\n" + "".join(f"{n}: {v}\r\n" for n, v in self.trailers).encode("latin-1")
            out += b"\r\n"
        return out

    def check(self, req: Request) -> None:
        assert (req.method, req.version, req.body) == (self.method, self.version, self.body)
        assert req.path == "/" + "/".join(self.segments)
        assert req.query == dict(self.query)
        assert req.headers == self.sent_headers
        assert req.trailers == [(n.lower(), v) for n, v in self.trailers]
        keep = (self.connection != "close" if self.version == "HTTP/1.1"
                else self.connection == "keep-alive")
        assert req.keep_alive is keep
        assert req.expects_continue is (self.expect and self.version == "HTTP/1.1"
                                        and (bool(self.body) or self.framing == "chunked"))


@st.composite
def specs(draw) -> Spec:
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0"]))
    body = draw(st.binary(max_size=100))
    framings = ["length", "chunked"] if version == "HTTP/1.1" else ["length"]
    framing = draw(st.sampled_from(framings if body else ["none", *framings]))
    chunks = draw(st.lists(st.integers(1, 64), min_size=1, max_size=8))
    chunks.append(len(body))                     # whatever is left
    text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                   max_size=8)
    field_value = st.text(_VALUE_CHARS, max_size=20).map(lambda v: v.strip(" \t"))
    name = st.text(_TOKEN_CHARS, min_size=1, max_size=10).filter(
        lambda n: n.lower() not in _FRAMING)
    return Spec(
        method=draw(st.sampled_from(["GET", "POST", "PUT", "HEAD", "OPTIONS"])
                    | st.text(_TOKEN_CHARS, min_size=1, max_size=8)),
        segments=draw(st.lists(text, max_size=4)),
        query=draw(st.lists(st.tuples(text, text), max_size=4)),
        version=version,
        headers=draw(st.lists(st.tuples(name, field_value), max_size=6)),
        body=body, framing=framing, chunks=chunks,
        extensions=draw(st.lists(st.sampled_from(["", ";a=b", " ; q=\"x y\"", ";flag"]),
                                 min_size=len(chunks), max_size=len(chunks))),
        trailers=draw(st.lists(st.tuples(name, field_value), max_size=3))
        if framing == "chunked" else [],
        connection=draw(st.sampled_from(["", "close", "keep-alive"])),
        expect=draw(st.booleans()),
        bare_lf=draw(st.booleans()),
        empty_lines=draw(st.integers(0, 2)),
        host=draw(st.booleans()),
        authority=draw(st.sampled_from(["", "", "example.com", "[::1]:8080", "127.0.0.1:1025",
                                        "a_b.c.:", "[v1.x]"])),
    )


def _cut(data: bytes, points: list[int]) -> list[bytes]:
    cuts = sorted(p % (len(data) + 1) for p in points)
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@settings(FIXED, max_examples=60)
@given(st.lists(specs(), min_size=1, max_size=3), st.lists(st.integers(0, 10**6), max_size=6))
def test_generated_requests_parse_back_whatever_the_split(requests, points):
    data = b"".join(spec.render() for spec in requests)
    whole = fuzz_http.run_parser([data], {})
    parsed = [ev for ev in whole if isinstance(ev, Request)]
    assert len(parsed) == len(requests) and len(whole) == 2 * len(requests), whole[-1:]
    assert all(isinstance(ev, RequestHead) for ev in whole[0::2])
    for spec, req in zip(requests, parsed, strict=True):
        spec.check(req)
    assert fuzz_http.run_parser(_cut(data, points), {}) == whole
    assert fuzz_http.run_parser(fuzz_http.byte_pieces(data), {}) == whole


# --- hypothesis: arbitrary bytes ------------------------------------------------------------

def _assert_oracles(data: bytes, points: list[int]) -> None:
    for limits in fuzz_http.PROFILES:
        whole = fuzz_http.run_parser([data], limits)
        assert not (whole and isinstance(whole[-1], fuzz_http.Crash)), whole[-1]
        if whole and isinstance(whole[-1], tuple):
            assert len(whole[-1][2]) <= fuzz_http.MAX_MESSAGE
        assert fuzz_http.run_parser(_cut(data, points), limits) == whole
        assert fuzz_http.run_parser(fuzz_http.byte_pieces(data), limits) == whole


@FIXED
@given(st.binary(max_size=300), st.lists(st.integers(0, 10**6), max_size=6))
def test_arbitrary_bytes_only_raise_http_error(data, points):
    _assert_oracles(data, points)


@FIXED
@given(st.sampled_from(fuzz_http.SEEDS), st.integers(0, 400),
       st.lists(st.sampled_from(fuzz_http.TOKENS) | st.binary(max_size=6), max_size=6),
       st.lists(st.integers(0, 10**6), max_size=6))
def test_seeds_with_arbitrary_bytes_spliced_in_only_raise_http_error(seed, at, inserts, points):
    """Arbitrary bytes rarely get past the request-line; spliced into real requests they
    reach the header, body and trailer code."""
    at %= len(seed) + 1
    _assert_oracles(seed[:at] + b"".join(inserts) + seed[at:], points)


_AUTHORITY_PIECES = ["[", "]", "::1", "v1.x", ":", "@", "%", "%41", "%zz", "h", "a.b", "_", "-",
                     "80", "99999", "*", "/"]


@FIXED
@given(st.sampled_from(["GET", "CONNECT", "OPTIONS"]),
       st.sampled_from(["http://", "https://", "HTTP://", "ftp://", "//", ""]),
       st.lists(st.sampled_from(_AUTHORITY_PIECES), max_size=6),
       st.sampled_from(["", "/", "/a?b=c", "?x", "#f"]),
       st.lists(st.sampled_from(_AUTHORITY_PIECES), max_size=5), st.booleans(),
       st.lists(st.integers(0, 10**6), max_size=4))
def test_odd_targets_and_host_values_only_raise_http_error(method, scheme, authority, rest,
                                                           host, http10, points):
    """Absolute-form and authority-form targets and Host values built from URI delimiters
    (``GET http://[/``, which made urlsplit raise past the parser, is one of them)."""
    version = b"HTTP/1.0" if http10 else b"HTTP/1.1"
    target = (scheme + "".join(authority) + rest).encode() or b"*"
    data = (method.encode() + b" " + target + b" " + version + b"\r\n"
            + b"Host: " + "".join(host).encode() + b"\r\n\r\n")
    _assert_oracles(data, points)


def test_fuzzer_run_is_determined_by_its_seed():
    """CI's fuzz run is the same on every run: the fuzzer draws from its own seeded Random."""
    runs = [fuzz_http.fuzz(seed=5, iterations=100, coverage=False)]
    random.random()
    runs.append(fuzz_http.fuzz(seed=5, iterations=100, coverage=False))
    assert runs[0].digest == runs[1].digest
    assert fuzz_http.fuzz(seed=6, iterations=100, coverage=False).digest != runs[0].digest


# --- differential: framing headers against h11 ------------------------------------------------

_PADS = [b"", b" ", b"\t", b"\x85", b"\xa0", b"\x0b", b"\x0c", b"\x1c", b"\xa0 ", b" \x85"]


def _h11_framing(head: bytes):
    """h11's verdict on a request head: ``"refused"``, or the body framing it reads."""
    import h11
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return "refused"
    headers = dict(event.headers)
    if b"transfer-encoding" in headers:
        return "chunked"
    return int(headers.get(b"content-length", b"0"))


def _our_framing(head: bytes):
    parser = RequestParser()
    parser.feed(head)
    try:
        event = parser.next_event()
    except HTTPError:
        return "refused"
    return "chunked" if event.chunked else event.content_length or 0


@pytest.mark.parametrize("name, value", [(b"Transfer-Encoding", b"chunked"),
                                         (b"Content-Length", b"65")])
def test_framing_header_padding_agrees_with_h11(name, value):
    """Every padding of a framing header's value, before and after: refused by both parsers or
    read as the same framing (0x85 and 0xA0 are no whitespace; only SP and HTAB are OWS)."""
    for before in _PADS:
        for after in _PADS:
            head = b"POST / HTTP/1.1\r\nHost: h\r\n" + name + b":" + before + value + after \
                + b"\r\n\r\n"
            assert _our_framing(head) == _h11_framing(head), head
