"""The sans-IO HTTP/1.1 parser and response formatting, fed with byte strings only."""

from __future__ import annotations

import pytest

from tiny_mindie.server.http import (CONTINUE_100, LAST_CHUNK, NEED_DATA, HTTPError, Request,
                                     RequestHead, RequestParser, format_chunk, format_response,
                                     format_response_head)
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
    assert (head.method, head.target, head.path, head.query) == ("GET", "/infer?x=1", "/infer", {"x": "1"})
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
    data = b"POST / HTTP/1.1\r\nTransfer-Encoding: Chunked\r\n\r\n1F\r\n" + b"a" * 31 + b"\r\n0\r\n\r\n"
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
    parser.feed(b"tial HTTP/1.1\r\n\r\n")
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


def test_header_whitespace_and_case():
    req = one_request(b"GET / HTTP/1.1\r\nX-Thing:\t  spaced value \t\r\nX-MIXED-case: v\r\n\r\n")
    assert req.headers == [("x-thing", "spaced value"), ("x-mixed-case", "v")]


def test_repeated_header_joined():
    req = one_request(b"GET / HTTP/1.1\r\nAccept: a\r\nAccept: b\r\n\r\n")
    assert req.header("accept") == "a, b"


def test_obs_text_value_decoded_latin1():
    assert one_request(b"GET / HTTP/1.1\r\nX: caf\xe9\r\n\r\n").header("x") == "caf\u00e9"


def test_identical_content_length_repeats_allowed():
    req = one_request(b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3, 3\r\n\r\nabc")
    assert req.body == b"abc"


def test_percent_decoding_and_query():
    req = one_request(b"GET /v2/models/m%C3%A9/ready?a=1&b=x%20y&a=3&flag&c=%2B HTTP/1.1\r\n\r\n")
    assert req.path == "/v2/models/m\u00e9/ready"
    assert req.query == {"a": "3", "b": "x y", "flag": "", "c": "+"}


def test_absolute_form_and_asterisk():
    assert one_request(b"GET http://host:1025/health?x=1 HTTP/1.1\r\n\r\n").path == "/health"
    assert one_request(b"OPTIONS * HTTP/1.1\r\n\r\n").path == "*"


# --- connection semantics -------------------------------------------------------------------

@pytest.mark.parametrize("version, connection, keep", [
    (b"HTTP/1.1", None, True),
    (b"HTTP/1.1", b"close", False),
    (b"HTTP/1.1", b"Upgrade, Close", False),
    (b"HTTP/1.0", None, False),
    (b"HTTP/1.0", b"Keep-Alive", True),
])
def test_keep_alive(version, connection, keep):
    head = b"GET / " + version + b"\r\n"
    if connection:
        head += b"Connection: " + connection + b"\r\n"
    req = one_request(head + b"\r\n")
    assert req.keep_alive is keep
    assert req.version == version.decode()


def test_expect_100_continue():
    parser = RequestParser()
    parser.feed(b"POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 4\r\n\r\n")
    head = parser.next_event()
    assert isinstance(head, RequestHead) and head.expects_continue
    assert parser.next_event() is NEED_DATA
    parser.feed(b"body")
    req = parser.next_event()
    assert req.body == b"body" and req.expects_continue


def test_expect_ignored_for_http10_and_bodiless():
    assert not one_request(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx"
                           ).expects_continue
    assert not one_request(b"GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n").expects_continue


# --- limits ---------------------------------------------------------------------------------

def test_content_length_over_limit_rejected_after_head_without_body():
    parser = RequestParser(max_body_bytes=100)
    parser.feed(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 101\r\n\r\n")
    head = parser.next_event()
    assert isinstance(head, RequestHead) and head.content_length == 101
    with pytest.raises(HTTPError) as info:
        parser.next_event()
    assert info.value.status == 413
    with pytest.raises(HTTPError):   # stays broken
        parser.next_event()


def test_body_at_limit_accepted():
    assert len(one_request(b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\n" + b"x" * 100,
                           max_body_bytes=100).body) == 100


def test_huge_content_length_is_413():
    assert error_of(b"POST / HTTP/1.1\r\nContent-Length: " + b"9" * 40 + b"\r\n\r\n").status == 413


def test_chunked_over_limit_rejected_before_data_arrives():
    parser = RequestParser(max_body_bytes=100)
    parser.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + b"x" * 64 + b"\r\n")
    events_of([], parser)
    parser.feed(b"40\r\n")      # would make 128 > 100: refused on the size line alone
    with pytest.raises(HTTPError) as info:
        parser.next_event()
    assert info.value.status == 413
    assert "Maximum allowed size" in info.value.message


def test_chunked_at_limit_accepted():
    data = (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"32\r\n" + b"x" * 50 + b"\r\n32\r\n" + b"y" * 50 + b"\r\n0\r\n\r\n")
    assert len(one_request(data, max_body_bytes=100).body) == 100


def test_header_section_too_large():
    big = b"GET / HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 2000 + b"\r\n\r\n"
    assert error_of(big, max_header_bytes=1024).status == 431
    # Also while still incomplete: never buffer past the limit waiting for the end.
    assert error_of(big[:1500], max_header_bytes=1024).status == 431


def test_too_many_headers():
    data = b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(101)) + b"\r\n"
    assert error_of(data).status == 431


def test_request_line_too_long():
    assert error_of(b"GET /" + b"a" * 9000).status == 414
    assert error_of(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n").status == 414


def test_trailers_too_large():
    data = (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
            + b"X-T: " + b"a" * 2000)
    assert error_of(data, max_header_bytes=1024).status == 431


# --- malformed input ------------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    b"GET /\r\n\r\n",                                   # HTTP/0.9 style
    b"GET  / HTTP/1.1\r\n\r\n",                         # double space
    b"GET / HTTP/1.1 \r\n\r\n",                         # trailing space
    b"GET / HTTP/1.1 extra\r\n\r\n",
    b"G(T / HTTP/1.1\r\n\r\n",                          # method not a token
    b"GET /\x7f HTTP/1.1\r\n\r\n",                      # control char in target
    b"GET /caf\xc3\xa9 HTTP/1.1\r\n\r\n",               # raw non-ASCII target
    b"GET nothing HTTP/1.1\r\n\r\n",
    b"GET / http/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nNo-Colon\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nName : x\r\n\r\n",              # space before colon
    b"GET / HTTP/1.1\r\n: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nX: a\rb\r\n\r\n",              # bare CR in value
    b"GET / HTTP/1.1\rX: a\r\n\r\n",                    # bare CR as line end
    b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n",             # NUL
    b"GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",       # obs-fold
    b"GET / HTTP/1.1\r\n\tX: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET /%FF HTTP/1.1\r\n\r\n",                       # not UTF-8 after decoding
    b"GET /%00 HTTP/1.1\r\n\r\n",
    b"GET ftp://x/ HTTP/1.1\r\n\r\n",
])
def test_malformed_head_is_400(data):
    assert error_of(data).status == 400


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
    assert error_of(b"POST / HTTP/1.1\r\n" + headers + b"\r\nabc").status == status


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
])
def test_bad_chunked_body_is_400(body):
    assert error_of(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body).status == 400


def test_error_is_sticky_and_feed_ignored():
    parser = RequestParser()
    parser.feed(b"BAD\r\n\r\n")
    with pytest.raises(HTTPError):
        parser.next_event()
    parser.feed(GET)
    with pytest.raises(HTTPError):
        parser.next_event()


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
    req = one_request(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
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
