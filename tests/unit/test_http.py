"""The sans-IO HTTP/1.1 parser and response formatting, fed with byte strings only."""

from __future__ import annotations

import re
import time

import pytest

from tiny_mindie.server.http import NEED_DATA, HTTPError, Request, RequestHead, RequestParser
from tiny_mindie.server.http_response import (
    CONTINUE_100,
    LAST_CHUNK,
    format_chunk,
    format_response,
    format_response_head,
)
from tiny_mindie.server.sse import sse_event


def events_of(chunks, parser=None):
    """Feed ``chunks`` one at a time, draining events after each; all events, in order."""
    parser = parser or RequestParser()
    out = []
    for chunk in [b"", *chunks]:      # drain what is already buffered first
        parser.feed(chunk)
        while (ev := parser.next_event()) is not NEED_DATA:
            out.append(ev)
    return out


def requests_of(chunks, parser=None):
    return [ev for ev in events_of(chunks, parser) if isinstance(ev, Request)]


def one_request(data: bytes, **kw) -> Request:
    reqs = requests_of([data], RequestParser(**kw))
    assert len(reqs) == 1
    return reqs[0]


def error_of(data: bytes, **kw) -> HTTPError:
    parser = RequestParser(**kw)
    with pytest.raises(HTTPError) as info:
        events_of([data], parser)
    return info.value


GET = b"GET /infer?x=1 HTTP/1.1\r\nHost: localhost\r\n\r\n"
POST_CL = (b"POST /infer HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: 17\r\n\r\n{\"inputs\": \"hi\"}\n")
CHUNKED_HEAD = b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
POST_CHUNKED = (b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"5;name=value;flag\r\nhello\r\n"
                b"6 ; q=\"a b\"\r\n world\r\n"
                b"A\r\n0123456789\r\n"
                b"0\r\nX-Checksum: abc\r\nX-Other:  two \r\n\r\n")


# --- basic shapes ---------------------------------------------------------------------------

def test_get_emits_head_then_request():
    parser = RequestParser()
    parser.feed(GET)
    head = parser.next_event()
    assert isinstance(head, RequestHead)
    assert (head.method, head.target, head.path, head.query) == \
        ("GET", "/infer?x=1", "/infer", {"x": "1"})
    assert head.version == "HTTP/1.1" and head.keep_alive and not head.expects_continue
    req = parser.next_event()
    assert isinstance(req, Request)
    assert req.body == b"" and req.headers == [("host", "localhost")]
    assert req.header("HOST") == "localhost" and req.header("missing", "d") == "d"
    assert parser.next_event() is NEED_DATA
    assert not parser.has_partial_request


def test_content_length_body():
    req = one_request(POST_CL)
    assert req.body == b'{"inputs": "hi"}\n'
    assert req.header("content-type") == "application/json"


def test_chunked_body_with_extensions_and_trailers():
    req = one_request(POST_CHUNKED)
    assert req.body == b"hello world0123456789"
    assert req.trailers == [("x-checksum", "abc"), ("x-other", "two")]
    assert ("x-checksum", "abc") not in req.headers


def test_chunked_without_trailers_and_uppercase_hex():
    data = (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: Chunked\r\n\r\n1F\r\n" + b"a" * 31
            + b"\r\n0\r\n\r\n")
    assert one_request(data).body == b"a" * 31


@pytest.mark.parametrize("message", [GET, POST_CL, POST_CHUNKED, GET + POST_CHUNKED + POST_CL])
def test_every_split_point_gives_the_same_events(message):
    whole = events_of([message])
    for i in range(len(message) + 1):
        assert events_of([message[:i], message[i:]]) == whole, i


@pytest.mark.parametrize("message", [POST_CL, POST_CHUNKED, GET + POST_CHUNKED])
def test_byte_at_a_time(message):
    chunks = [message[i:i + 1] for i in range(len(message))]
    assert events_of(chunks) == events_of([message])


def test_head_emitted_before_body_arrives():
    parser = RequestParser()
    head_part, body_part = POST_CL.split(b"\r\n\r\n", 1)
    parser.feed(head_part + b"\r\n\r\n")
    head = parser.next_event()
    assert isinstance(head, RequestHead) and head.content_length == 17
    assert parser.next_event() is NEED_DATA
    assert parser.has_partial_request
    parser.feed(body_part)
    assert parser.next_event().body == body_part


def test_pipelining_keeps_bytes_for_next_request():
    parser = RequestParser()
    parser.feed(POST_CL + GET + b"GET /par")
    reqs = [ev for ev in iter(parser.next_event, NEED_DATA) if isinstance(ev, Request)]
    assert [r.path for r in reqs] == ["/infer", "/infer"]
    assert reqs[0].method == "POST" and reqs[1].method == "GET"
    assert parser.buffered == len(b"GET /par") and parser.has_partial_request
    parser.feed(b"tial HTTP/1.1\r\nHost: h\r\n\r\n")
    assert [r.path for r in requests_of([], parser)] == ["/partial"]


def test_parser_reusable_for_many_requests():
    parser = RequestParser()
    for i in range(5):
        reqs = requests_of([POST_CHUNKED if i % 2 else POST_CL], parser)
        assert len(reqs) == 1


# --- leniency -------------------------------------------------------------------------------

def test_leading_empty_lines_and_bare_lf():
    req = one_request(b"\r\n\nGET /a HTTP/1.1\nHost: h\nX: 1\n\n")
    assert req.path == "/a" and req.header("x") == "1"



def test_leading_empty_lines_count_as_a_started_request():
    """RFC 9112 §2.2 lets a server skip empty lines before a request-line, but they are bytes
    received: the connection's header deadline must start with them (a client sending CRLF
    every few seconds would otherwise hold the connection forever)."""
    parser = RequestParser()
    assert not parser.has_partial_request
    for _ in range(3):
        parser.feed(b"\r\n")
        assert parser.next_event() is NEED_DATA
        assert parser.buffered == 0 and parser.has_partial_request
    parser.feed(GET)
    assert [type(ev) for ev in events_of([], parser)] == [RequestHead, Request]
    assert not parser.has_partial_request           # the next request has not begun
    parser.feed(b"\n")
    assert parser.next_event() is NEED_DATA and parser.has_partial_request


def test_header_whitespace_and_case():
    req = one_request(b"GET / HTTP/1.1\r\nHost: h\r\nX-Thing:\t  spaced value \t\r\n"
                      b"X-MIXED-case: v\r\n\r\n")
    assert req.headers[1:] == [("x-thing", "spaced value"), ("x-mixed-case", "v")]


def test_repeated_header_joined():
    req = one_request(b"GET / HTTP/1.1\r\nHost: h\r\nAccept: a\r\nAccept: b\r\n\r\n")
    assert req.header("accept") == "a, b"


def test_obs_text_value_decoded_latin1():
    req = one_request(b"GET / HTTP/1.1\r\nHost: h\r\nX: caf\xe9\r\n\r\n")
    assert req.header("x") == "caf\u00e9"


def test_identical_content_length_repeats_allowed():
    req = one_request(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n"
                      b"Content-Length: 3, 3\r\n\r\nabc")
    assert req.body == b"abc"


def test_percent_decoding_and_query():
    req = one_request(b"GET /v2/models/m%C3%A9/ready?a=1&b=x%20y&a=3&flag&c=%2B HTTP/1.1\r\n"
                      b"Host: h\r\n\r\n")
    assert req.path == "/v2/models/m\u00e9/ready"
    assert req.query == {"a": "3", "b": "x y", "flag": "", "c": "+"}


def test_absolute_form_and_asterisk():
    req = one_request(b"GET http://host:1025/health?x=1 HTTP/1.1\r\nHost: h\r\n\r\n")
    assert req.path == "/health" and req.query == {"x": "1"}
    assert one_request(b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n").path == "*"



@pytest.mark.parametrize("target, path, query", [
    (b"http://h", "/", {}),
    (b"http://h?x=1", "/", {"x": "1"}),
    (b"HTTPS://[::1]:1025/a%20b?y=2#frag", "/a b", {"y": "2"}),
    (b"http://127.0.0.1:1025/v1/models", "/v1/models", {}),
    (b"http://[v1.fe80::a+en1]/", "/", {}),
    (b"http://[::ffff:127.0.0.1]:1/x", "/x", {}),        # IPv4 in IPv6
    (b"http://[FE80::1]/x", "/x", {}),
    (b"http://my_host.example.:/x", "/x", {}),    # an empty port is allowed (RFC 3986)
    (b"http://%41b/x", "/x", {}),
])
def test_absolute_form_variants(target, path, query):
    req = one_request(b"GET " + target + b" HTTP/1.1\r\nHost: other\r\n\r\n")
    assert (req.path, req.query, req.target) == (path, query, target.decode())


def test_connect_authority_form():
    req = one_request(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    assert (req.method, req.path, req.query) == ("CONNECT", "", {})


@pytest.mark.parametrize("host", [b"", b"localhost", b"127.0.0.1:1025", b"[::1]:1025", b"[v7.x]",
                                  b"[2001:db8::1]", b"[::ffff:10.0.0.1]:80",
                                  b"example.com.", b"xn--caf-dma.example", b"h:", b"a_b"])
def test_valid_host_values(host):
    assert one_request(b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n\r\n").header("host") == \
        host.decode()


def test_http10_without_host_is_fine():
    req = one_request(b"GET /a HTTP/1.0\r\n\r\n")
    assert (req.path, req.header("host")) == ("/a", None)


# --- connection semantics -------------------------------------------------------------------

@pytest.mark.parametrize("version, connection, keep", [
    (b"HTTP/1.1", None, True),
    (b"HTTP/1.1", b"close", False),
    (b"HTTP/1.1", b"Upgrade, Close", False),
    (b"HTTP/1.0", None, False),
    (b"HTTP/1.0", b"Keep-Alive", True),
])
def test_keep_alive(version, connection, keep):
    head = b"GET / " + version + b"\r\nHost: h\r\n"
    if connection:
        head += b"Connection: " + connection + b"\r\n"
    req = one_request(head + b"\r\n")
    assert req.keep_alive is keep
    assert req.version == version.decode()


def test_expect_100_continue():
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\nContent-Length: 4\r\n\r\n")
    head = parser.next_event()
    assert isinstance(head, RequestHead) and head.expects_continue
    assert parser.next_event() is NEED_DATA
    parser.feed(b"body")
    req = parser.next_event()
    assert req.body == b"body" and req.expects_continue


def test_expect_ignored_for_http10_and_bodiless():
    assert not one_request(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx"
                           ).expects_continue
    assert not one_request(b"GET / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n\r\n"
                           ).expects_continue



@pytest.mark.parametrize("expect", [b"200-ok", b"100-continue, x", b"100-continue;a=b",
                                    b"foo", b"100-Continue, 100-continue, X"])
@pytest.mark.parametrize("version", [b"HTTP/1.1", b"HTTP/1.0"])
def test_other_expectations_are_417(expect, version):
    for body in (b"Content-Length: 1\r\n\r\nx", b"\r\n"):
        error = error_of(b"POST / " + version + b"\r\nHost: h\r\nExpect: " + expect + b"\r\n"
                         + body)
        assert error.status == 417 and "only 100-continue" in error.message


@pytest.mark.parametrize("expect", [b"100-continue", b"100-CONTINUE", b" 100-continue ",
                                    b"100-continue, 100-continue", b""])
def test_100_continue_in_any_case_is_accepted(expect):
    req = one_request(b"POST / HTTP/1.1\r\nHost: h\r\nExpect: " + expect
                      + b"\r\nContent-Length: 1\r\n\r\nx")
    assert req.body == b"x" and req.expects_continue is bool(expect.strip())


# --- limits ---------------------------------------------------------------------------------

def test_content_length_over_limit_rejected_after_head_without_body():
    parser = RequestParser(max_body_bytes=100)
    parser.feed(b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n"
                b"Content-Length: 101\r\n\r\n")
    head = parser.next_event()
    assert isinstance(head, RequestHead) and head.content_length == 101
    with pytest.raises(HTTPError) as info:
        parser.next_event()
    assert info.value.status == 413
    with pytest.raises(HTTPError):   # stays broken
        parser.next_event()


def test_body_at_limit_accepted():
    data = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    assert len(one_request(data, max_body_bytes=100).body) == 100


def test_huge_content_length_is_413():
    data = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n"
    assert error_of(data).status == 413


def test_chunked_over_limit_rejected_before_data_arrives():
    parser = RequestParser(max_body_bytes=100)
    parser.feed(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n"
                + b"x" * 64 + b"\r\n")
    events_of([], parser)
    parser.feed(b"40\r\n")      # would make 128 > 100: refused on the size line alone
    with pytest.raises(HTTPError) as info:
        parser.next_event()
    assert info.value.status == 413 and info.value.limit == 100
    assert info.value.message == "Request body over the limit of 100 bytes"


def test_chunked_at_limit_accepted():
    data = (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"32\r\n" + b"x" * 50 + b"\r\n32\r\n" + b"y" * 50 + b"\r\n0\r\n\r\n")
    assert len(one_request(data, max_body_bytes=100).body) == 100


def test_header_section_too_large():
    big = b"GET / HTTP/1.1\r\nHost: h\r\n" + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n"
    assert error_of(big, max_header_bytes=1024).status == 431
    # Also while still incomplete: never buffer past the limit waiting for the end.
    assert error_of(big[:1500], max_header_bytes=1024).status == 431


def test_too_many_headers():
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(100))
    data = b"GET / HTTP/1.1\r\n" + fields + b"Host: h\r\n\r\n"          # 101 fields
    assert error_of(data).status == 431


def test_request_line_too_long():
    assert error_of(b"GET /" + b"a" * 9000).status == 414
    assert error_of(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: h\r\n\r\n").status == 414


def test_trailers_too_large():
    data = (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
            + b"X-T: " + b"a" * 2000)
    assert error_of(data, max_header_bytes=1024).status == 431



def outcome(chunks, **kw):
    """Events of feeding ``chunks``, with a final ``("error", status)`` if the parser refused."""
    parser = RequestParser(**kw)
    out = []
    try:
        for chunk in chunks:
            parser.feed(chunk)
            while (ev := parser.next_event()) is not NEED_DATA:
                out.append(ev)
    except HTTPError as exc:
        out.append(("error", exc.status, exc.message))
    return out


def assert_split_invariant(data, **kw):
    """Every two-piece split of ``data`` gives what feeding it whole gives; returns that."""
    whole = outcome([data], **kw)
    for i in range(1, len(data)):
        assert outcome([data[:i], data[i:]], **kw) == whole, i
    return whole


def _status(result):
    return result[-1][1] if result and isinstance(result[-1], tuple) else 200


@pytest.mark.parametrize("pad, status", [(0, 200), (1, 431)])
def test_header_limit_boundary_holds_for_every_split(pad, status):
    """The head ends exactly at the limit (fine) or one byte past it (431), whatever the split:
    no split may refuse early what the whole message passes."""
    head = b"GET / HTTP/1.1\r\nHost: h\r\nX: "
    data = head + b"a" * (64 - len(head) - 2 + pad) + b"\r\n\r\n"   # head section 64 + pad
    assert _status(assert_split_invariant(data, max_header_bytes=64)) == status


@pytest.mark.parametrize("pad, status", [(0, 200), (1, 414)])
def test_request_line_limit_boundary_holds_for_every_split(pad, status):
    line = b"GET /" + b"a" * (32 - 14 + pad) + b" HTTP/1.1"            # 32 + pad bytes
    data = line + b"\r\nHost: h\r\nX: " + b"b" * 100 + b"\r\n\r\n"
    assert _status(assert_split_invariant(data, max_request_line_bytes=32,
                                          max_header_bytes=200)) == status


def test_request_line_over_header_limit_is_414_for_every_split():
    data = b"GET /" + b"a" * 100 + b" HTTP/1.1\r\nHost: h\r\n\r\n"
    assert _status(assert_split_invariant(data, max_request_line_bytes=1000,
                                          max_header_bytes=64)) == 414


@pytest.mark.parametrize("pad, status", [(0, 200), (1, 400)])
def test_chunk_size_line_limit_boundary_holds_for_every_split(pad, status):
    line = b"1;e=" + b"x" * (4096 - 4 + pad)                           # 4096 + pad bytes
    data = CHUNKED_HEAD + line + b"\r\nz\r\n0\r\n\r\n"
    assert _status(assert_split_invariant(data)) == status


@pytest.mark.parametrize("pad, status", [(0, 200), (1, 431)])
def test_trailer_limit_boundary_holds_for_every_split(pad, status):
    trailer = b"X-T: " + b"a" * (64 - 5 + pad)                         # 64 + pad bytes
    data = CHUNKED_HEAD + b"1\r\nz\r\n0\r\n" + trailer + b"\r\n\r\n"
    result = assert_split_invariant(data, max_header_bytes=64)
    assert _status(result) == status


def _cpu_seconds_byte_at_a_time(prefix: bytes, data: bytes) -> float:
    """Least CPU time of three runs feeding ``data`` a byte at a time after ``prefix``."""
    best = float("inf")
    for _ in range(3):
        parser = RequestParser()
        parser.feed(prefix)
        events = [parser.next_event(), parser.next_event()]
        start = time.process_time()
        for i in range(len(data)):
            parser.feed(data[i:i + 1])
            while parser.next_event() is not NEED_DATA:
                pass
        best = min(best, time.process_time() - start)
        assert events[-1] is NEED_DATA or isinstance(events[-1], RequestHead)
        assert not parser.has_partial_request          # the request did complete
    return best


def _fields(n_bytes: int) -> bytes:
    line = b"X-T: " + b"a" * 1000 + b"\r\n"                      # 64 KB: 64 fields
    return (line * (n_bytes // len(line) + 1))[:n_bytes - 2] + b"\r\n"


@pytest.mark.parametrize("where", ["trailers", "head"])
def test_parsing_a_section_fed_byte_by_byte_is_linear(where):
    """64 KB of trailer fields fed a byte at a time took 1.5 s of CPU when each feed rescanned
    the section from its start (quadratic).  Compare 4 KB with 64 KB: 16 times the bytes must
    cost well under 48 times the CPU (a quadratic scan costs some 100 times; linear ~16)."""
    def cost(n_bytes):
        if where == "trailers":
            return _cpu_seconds_byte_at_a_time(CHUNKED_HEAD + b"0\r\n", _fields(n_bytes) + b"\r\n")
        return _cpu_seconds_byte_at_a_time(b"", b"GET / HTTP/1.1\r\nHost: h\r\n"
                                           + _fields(n_bytes - 30) + b"\r\n")
    small, large = cost(4 * 1024), cost(64 * 1024 - 100)
    assert large < 48 * small, (small, large)


# --- malformed input ------------------------------------------------------------------------

@pytest.mark.parametrize("data, reason", [
    (b"GET /\r\n\r\n", "Invalid request-line"),                      # HTTP/0.9 style
    (b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid request-line"),  # double space
    (b"GET / HTTP/1.1 \r\nHost: h\r\n\r\n", "Invalid request-line"),  # trailing space
    (b"GET / HTTP/1.1 extra\r\n\r\n", "Invalid request-line"),
    (b"G(T / HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid request-line"),   # method not a token
    (b"GET /\x7f HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid request-line"),  # control char in target
    (b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid request-line"),  # raw non-ASCII
    (b"GET nothing HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid request-target"),
    (b"GET / http/1.1\r\n\r\n", "Invalid request-line"),
    (b"GET / HTTP/1.1\r\nHost: h\r\nNo-Colon\r\n\r\n", "Invalid header field"),
    (b"GET / HTTP/1.1\r\nHost: h\r\nBad Name: x\r\n\r\n", "Invalid header field"),
    (b"GET / HTTP/1.1\r\nHost: h\r\nName : x\r\n\r\n", "Invalid header field"),  # space before :
    (b"GET / HTTP/1.1\r\nHost: h\r\n: x\r\n\r\n", "Invalid header field"),
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\rb\r\n\r\n", "Bare CR"),     # bare CR in value
    (b"GET / HTTP/1.1\rHost: h\r\n\r\n", "Bare CR"),                  # bare CR as line end
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n", "Invalid character"),  # NUL
    (b"GET / HTTP/1.1\r\nHost: h\r\nX: a\r\n folded\r\n\r\n", "line folding"),   # obs-fold
    (b"GET / HTTP/1.1\r\n\tHost: h\r\n\r\n", "line folding"),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "Multiple Host"),
    (b"GET /%FF HTTP/1.1\r\nHost: h\r\n\r\n", "not valid UTF-8"),
    (b"GET /%00 HTTP/1.1\r\nHost: h\r\n\r\n", "NUL in request path"),
    (b"GET ftp://x/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    # absolute-form with a broken authority (urlsplit raised ValueError on the first two)
    (b"GET http://[/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://[::1/x HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://a]/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    # bracketed, but no IPv6 address (ipaddress.IPv6Address refuses it)
    (b"GET http://[:::]/health HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://[1::2::3]:80/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://[12345::]/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://[1.2.3.4]/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://[]/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"CONNECT [:::]:443 HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid authority-form"),
    (b"GET http://user:pw@h/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),  # userinfo
    (b"GET http:///x HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),   # empty host
    (b"GET http://:80/x HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),
    (b"GET http://h:8x/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),  # port not digits
    (b"GET http://h%zz/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid absolute-form"),  # bad escape
    (b"GET 1http://h/ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid request-target"),  # not a scheme
    (b"CONNECT [ HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid authority-form"),
    (b"CONNECT h HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid authority-form"),      # no port
    (b"CONNECT u@h:443 HTTP/1.1\r\nHost: h\r\n\r\n", "Invalid authority-form"),
    # Host (RFC 9112 §3.2): required in HTTP/1.1, valid uri-host [":" port]
    (b"GET / HTTP/1.1\r\n\r\n", "Missing Host"),
    (b"GET / HTTP/1.1\r\nX-Host: h\r\n\r\n", "Missing Host"),
    (b"GET http://h/ HTTP/1.1\r\n\r\n", "Missing Host"),            # even with absolute-form
    (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", "Multiple Host"),
    (b"GET / HTTP/1.1\r\nHost: [\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: [:::]\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: [::1::]:1025\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: [g::1]\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: u@h\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: h:x\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: h/p\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: :80\r\n\r\n", "Invalid Host"),
    (b"GET / HTTP/1.1\r\nHost: caf\xe9\r\n\r\n", "Invalid Host"),
])
def test_malformed_head_is_400(data, reason):
    error = error_of(data)
    assert (error.status, error.__cause__) == (400, None)
    assert reason in error.message


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"HTTP/3.0"])
def test_unsupported_version_is_505(version):
    assert error_of(b"GET / " + version + b"\r\n\r\n").status == 505


@pytest.mark.parametrize("headers, status", [
    (b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n", 400),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n", 400),
    (b"Transfer-Encoding: gzip\r\n", 501),
    (b"Transfer-Encoding: gzip, chunked\r\n", 501),
    (b"Transfer-Encoding: chunked, gzip\r\n", 400),
    (b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n", 400),
    (b"Transfer-Encoding: \r\n", 400),
    (b"Content-Length: abc\r\n", 400),
    (b"Content-Length: -1\r\n", 400),
    (b"Content-Length: +3\r\n", 400),
    (b"Content-Length: 3 3\r\n", 400),
    (b"Content-Length: 3\r\nContent-Length: 4\r\n", 400),
    (b"Content-Length: 3, 4\r\n", 400),
    (b"Content-Length: \r\n", 400),
])
def test_framing_errors(headers, status):
    assert error_of(b"POST / HTTP/1.1\r\nHost: h\r\n" + headers + b"\r\nabc").status == status


def test_transfer_encoding_in_http10_is_400():
    assert error_of(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").status == 400


@pytest.mark.parametrize("body", [
    b"zz\r\nhello\r\n0\r\n\r\n",            # not hex
    b"-5\r\nhello\r\n0\r\n\r\n",
    b"0x5\r\nhello\r\n0\r\n\r\n",
    b"\r\nhello\r\n0\r\n\r\n",              # empty size
    b"5\nhello\r\n0\r\n\r\n",               # bare LF after size
    b"5\r\nhelloXX0\r\n\r\n",               # no CRLF after data
    b"5\r\nhello\n0\r\n\r\n",
    b"5;a\x00b\r\nhello\r\n0\r\n\r\n",       # NUL in extension
    b"5\r\nhello\r\n0\r\nBad Trailer\r\n\r\n",
    b"5\r\nhello\r\n0\r\n\n",
    b"1" * 5000,                            # endless size line
    b"0\r\nX-T: 1\n\r\n",                     # a trailer line ended by a bare LF ...
    b"0\r\nX-T: 1\r\nY: 2\n",                  # ... refused before the section ends
])
def test_bad_chunked_body_is_400(body):
    assert error_of(CHUNKED_HEAD + body).status == 400


@pytest.mark.parametrize("trailers", [b"X-T: 1\n\r\n", b"X-T: 1\r\nY: 2\nZ: 3\r\n\r\n"])
def test_bare_lf_in_trailers_is_400_at_once_for_every_split(trailers):
    """A bare LF in the trailer section is answered when it arrives, not at the body timeout."""
    data = CHUNKED_HEAD + b"0\r\n" + trailers
    assert _status(assert_split_invariant(data)) == 400
    upto_bare_lf = data[:re.search(rb"[^\r]\n", data).end()]
    assert _status(outcome([upto_bare_lf])) == 400


@pytest.mark.parametrize("value", [b"\xa0chunked", b"chunked\xa0", b"chunked\x85", b"\x85chunked",
                                   b"chunked\x0b", b"gzip\xa0, chunked"])
def test_transfer_encoding_trims_sp_and_htab_only(value):
    """0x85 and 0xA0 are not whitespace in HTTP (RFC 9110 OWS is SP and HTAB): such a coding is
    malformed, never chunked."""
    assert error_of(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:" + value
                    + b"\r\n\r\n0\r\n\r\n").status == 400


@pytest.mark.parametrize("value", [b"\xa065", b"65\x85", b"65\xa0", b"\x8565", b"65,\xa065"])
def test_content_length_trims_sp_and_htab_only(value):
    assert error_of(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length:" + value + b"\r\n\r\n"
                    + b"x" * 65).status == 400


def test_connection_and_expect_members_trim_sp_and_htab_only():
    req = one_request(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: \t close\xa0\r\n\r\n")
    assert req.keep_alive                     # "close\xa0" is not "close"
    assert not one_request(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: x,\t close \r\n\r\n"
                           ).keep_alive
    assert error_of(b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\xa0\r\n"
                    b"Content-Length: 1\r\n\r\nx").status == 417


def test_error_is_sticky_and_feed_ignored():
    parser = RequestParser()
    parser.feed(b"BAD\r\n\r\n")
    with pytest.raises(HTTPError):
        parser.next_event()
    parser.feed(GET)
    with pytest.raises(HTTPError):
        parser.next_event()


@pytest.mark.parametrize("data, status, owed", [
    (b"GET / HTTP/2.0\r\n\r\n", 505, 0),                           # no body: all of it in
    (b"GET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n", 400, 0),
    (b"GET / HTTP/1.1\r\n\r\n", 400, 0),                           # no Host
    (b"POST / HTTP/1.1\r\nHost: h\r\nExpect: x\r\nContent-Length: 5\r\n\r\nab", 417, 3),
    (b"POST / HTTP/1.1\r\nHost: h\r\nExpect: x\r\nContent-Length: 2\r\n\r\nab", 417, 0),
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2000\r\n\r\nabc", 413, 1997),
    (b"POST / HTTP/1.1\r\nHost: h\r\nExpect: x\r\nContent-Length: 1\r\n\r\nabc", 417,
     None),                                                        # more came: pipelining
    (b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: x\r\n\r\n", 400, None),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\n", 501, None),
    (b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, None),
    (b"GET /" + b"x" * 9000, 414, None),                            # the head cut short
])
def test_after_an_error_the_parser_says_what_the_client_may_still_send(data, status, owed):
    parser = RequestParser(max_body_bytes=1000)
    assert parser.owed_after_error is None
    parser.feed(data)
    with pytest.raises(HTTPError) as err:
        while parser.next_event() is not NEED_DATA:
            pass
    assert err.value.status == status
    assert parser.owed_after_error == owed


# --- response side --------------------------------------------------------------------------

def test_format_response_sets_content_length():
    data = format_response(200, [("Content-Type", "application/json"), ("Content-Length", "99")],
                           b'{"a":1}')
    assert data == (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 7\r\n\r\n{\"a\":1}")


def test_format_response_head_only_and_no_content():
    assert format_response(200, [], b"abc", include_body=False) == \
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n"
    assert format_response(204, [], b"") == b"HTTP/1.1 204 No Content\r\n\r\n"
    with pytest.raises(ValueError):
        format_response(204, [], b"x")


def test_format_response_head_reason_phrases():
    assert format_response_head(413, []).startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
    assert format_response_head(424, []).startswith(b"HTTP/1.1 424 Failed Dependency\r\n")
    assert format_response_head(599, []) == b"HTTP/1.1 599 \r\n\r\n"


@pytest.mark.parametrize("name, value", [
    ("X", "a\r\nInjected: yes"), ("X", "a\nb"), ("X", "a\x00"), ("Bad Name", "v"), ("X:", "v"),
    ("X", "\u20ac"),
])
def test_format_response_head_rejects_injection(name, value):
    with pytest.raises(ValueError):
        format_response_head(200, [(name, value)])


def test_chunk_framing_roundtrips_through_parser():
    body = format_chunk(b"hello") + format_chunk(b"") + format_chunk(b"x" * 300) + LAST_CHUNK
    assert format_chunk(b"x" * 300).startswith(b"12c\r\n")
    req = one_request(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert req.body == b"hello" + b"x" * 300
    assert CONTINUE_100 == b"HTTP/1.1 100 Continue\r\n\r\n"


# --- SSE framing ----------------------------------------------------------------------------

def test_sse_event_framing():
    assert sse_event('{"a":1}') == b'data: {"a":1}\n\n'
    assert sse_event("a\nb\r\nc\rd") == b"data: a\ndata: b\ndata: c\ndata: d\n\n"
    assert sse_event("") == b"data: \n\n"
    assert sse_event("x\n") == b"data: x\ndata: \n\n"
    # Only CR/LF split lines: U+2028 stays inside (JSON with ensure_ascii=False can hold it).
    assert sse_event("\u00e9\u2028\u4e2d") == "data: \u00e9\u2028\u4e2d\n\n".encode("utf-8")
