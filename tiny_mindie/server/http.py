"""HTTP/1.1 request parsing, sans-IO (RFC 9110 / RFC 9112).

Bytes go in through :meth:`RequestParser.feed`, events come out of
:meth:`RequestParser.next_event`; nothing here touches sockets, threads or asyncio
(the style of h11).  One parser serves one connection, request after request:

    parser = RequestParser(max_body_bytes=40 * 2**20)
    parser.feed(data)
    event = parser.next_event()   # NEED_DATA | RequestHead | Request; raises HTTPError

For each request the parser emits exactly one :class:`RequestHead` (as soon as the header
section is complete, so the caller can answer ``100 Continue`` or reject early) and then one
:class:`Request` carrying the whole body.  Bytes after a request stay buffered for the next
one (pipelining).

The head's grammar is :mod:`.http_head`'s, the message types :mod:`.http_message`'s (and
importable from here); responses are built by :mod:`.http_response`.

Strictness (what is rejected, and why) follows RFC 9112 with request smuggling in mind:
one space between request-line parts, token method and header names, no whitespace before
the colon, no obs-fold, no bare CR, no control characters in values, only SP and HTAB trimmed
around a value or list member (RFC 9110's OWS: 0x85 and 0xA0 are no whitespace), Content-Length
digits only (identical repeats allowed), transfer codings tokens only, Content-Length together
with Transfer-Encoding rejected, CRLF required inside chunked framing (a bare LF in the trailer
section refused as soon as it arrives), exactly one valid ``Host`` in an HTTP/1.1 request (at most
one in HTTP/1.0), an absolute-form target only as ``http(s)://host[:port]...`` without userinfo,
a bracketed host (target or ``Host``) only as an IPv6 address ``ipaddress`` takes or an IPvFuture,
no expectation but ``100-continue`` (417).  Lenient where the RFC allows it: empty lines before
the request-line are skipped (they still count as the start of a request for
:attr:`RequestParser.has_partial_request`), and a bare LF ends a line of the request head.

Whatever the input, :meth:`RequestParser.next_event` raises nothing but :class:`HTTPError`
(``scripts/fuzz_http.py`` checks this, and that any split of the same bytes gives the same
events).  Scanning is linear in the bytes received, however they are split.
"""

from __future__ import annotations

import re

from .http_head import excerpt, parse_fields, parse_head
from .http_message import NEED_DATA, Event, HTTPError, Request, RequestHead

__all__ = ["NEED_DATA", "Event", "HTTPError", "Request", "RequestHead", "RequestParser"]

_END_OF_HEAD = re.compile(rb"\n\r?\n")
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(;[\t\x20-\x7e\x80-\xff]*)?")
_BARE_LF = re.compile(rb"(?<!\r)\n")   # an LF without its CR (the trailer section wants CRLF)
_MAX_CHUNK_LINE = 4096        # bytes, chunk-size line including extensions

# parser states
_HEAD = "head"
_BODY = "body"                # Content-Length body; self._remaining bytes to go
_CHUNK_SIZE = "chunk-size"
_CHUNK_DATA = "chunk-data"    # self._remaining bytes of the current chunk to go
_CHUNK_CRLF = "chunk-crlf"
_TRAILERS = "trailers"
_ERROR = "error"


def _owed(raw: bytes, body_length: int | None, received: int) -> int | None:
    """The bytes a client may still send of a request whose head ``raw`` was refused, when
    ``received`` bytes came after the head: its declared body's rest (``body_length``; a head
    that names no body at all -- no field or target mentions one -- has none), ``None`` when
    unknown or when more came than the body (a client pipelining)."""
    if body_length is None:
        low = raw.lower()
        if b"content-length" in low or b"transfer-encoding" in low:
            return None
        body_length = 0
    return body_length - received if received <= body_length else None


class RequestParser:
    """Incremental HTTP/1.1 request parser for one connection (sans-IO).

    Args:
        max_header_bytes: Limit on the header section (request-line + fields) and, separately,
            on the trailer section, in bytes; beyond it -> 431.
        max_body_bytes: Limit on the decoded body, in bytes, for both Content-Length and
            chunked bodies; beyond it -> 413.  At most this much body is ever buffered.
        max_request_line_bytes: Limit on the request-line, in bytes; beyond it -> 414.  At
            most ``max_header_bytes`` (the request-line is part of the header section).

    Use :meth:`feed` to add received bytes and :meth:`next_event` to pull events.  After an
    :class:`HTTPError` the parser is broken: every later :meth:`next_event` re-raises it.
    """

    def __init__(self, max_header_bytes: int = 64 * 1024, max_body_bytes: int = 40 * 1024 * 1024,
                 max_request_line_bytes: int = 8 * 1024) -> None:
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.max_request_line_bytes = min(max_request_line_bytes, max_header_bytes)
        self._buf = bytearray()
        self._state = _HEAD
        self._scan_from = 0                 # where to resume searching for the end of the head
                                            # or of the trailer section (both linear)
        self._skipped_empty_lines = False   # empty lines before the request-line were received
        self._head: RequestHead | None = None
        self._body = bytearray()
        self._remaining = 0
        self._error: HTTPError | None = None
        self._owed: int | None = None       # see owed_after_error
        self._head_owes: int | None = None  # the same, for an error in a complete head

    # -- public -----------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Append received bytes (any split, including empty) to the input buffer."""
        if self._state != _ERROR:
            self._buf += data

    @property
    def has_partial_request(self) -> bool:
        """True when some bytes of a not yet complete request have been received, counting
        the empty lines a client may send before the request-line (so that a client sending
        only empty lines is timed like any other slow request).  Constant time."""
        return (self._state not in (_HEAD, _ERROR) or bool(self._buf)
                or self._skipped_empty_lines)

    @property
    def head(self) -> RequestHead | None:
        """The head of the request being read, once its header section is complete (kept after
        an :class:`HTTPError` about its body); ``None`` before it and between requests."""
        return self._head

    @property
    def owed_after_error(self) -> int | None:
        """After an :class:`HTTPError`: how many more bytes of the refused request the client
        may still send: the unreceived rest of its declared ``Content-Length`` body (a 413; a
        refused head: 0 once that body, or none, is in), ``None`` when unknown (a head or a
        chunked body cut short, a head whose framing is refused) or before an error."""
        return self._owed if self._error is not None else None

    @property
    def buffered(self) -> int:
        """Bytes received but not consumed yet (the start of the next request when pipelining)."""
        return len(self._buf)

    def next_event(self) -> Event:
        """Advance the parser over the buffered bytes.

        Returns:
            :data:`NEED_DATA` when the buffered bytes do not complete the next event;
            a :class:`RequestHead` once per request, when its header section is complete;
            the complete :class:`Request` after that.  The parser is then ready for the next
            request on the same connection.

        Raises:
            HTTPError: malformed or unacceptable input: 400 (syntax, framing, bad chunk,
                missing or invalid Host), 413 (body over ``max_body_bytes``; raised on the
                call after the :class:`RequestHead` when Content-Length already exceeds it),
                414 (request-line too long), 417 (an ``Expect`` other than ``100-continue``),
                431 (header or trailer section too large), 501 (transfer coding other than
                chunked), 505 (HTTP version other than 1.0/1.1).  Nothing else: should a bug
                let another exception out of the parsing, it becomes a 400 whose
                ``__cause__`` is that exception (the fuzzer treats that as a finding).
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except HTTPError as exc:
            self._fail(exc)
            raise
        except Exception as exc:  # a parser bug: still answer 400, keep the cause for the log
            error = HTTPError(400, "Malformed request")
            error.__cause__ = exc
            self._fail(error)
            raise error from exc

    def _fail(self, exc: HTTPError) -> None:
        if self._state == _HEAD:
            self._owed = self._head_owes
        elif self._state == _BODY:
            self._owed = max(0, self._remaining - len(self._buf))
        self._state = _ERROR
        self._error = exc
        self._buf.clear()

    # -- state machine ----------------------------------------------------------------------

    def _next_event(self) -> Event:
        if self._state == _HEAD:
            return self._head_event()
        if self._state == _BODY:
            return self._body_event()
        return self._chunked_event()

    def _too_large(self) -> HTTPError:
        exc = HTTPError(413, f"Request body over the limit of {self.max_body_bytes} bytes",
                        limit=self.max_body_bytes)
        exc.request_line = (self._head.method, self._head.target)
        return exc

    def _head_event(self) -> Event:
        head = self._parse_head()
        if head is None:
            return NEED_DATA
        self._head = head
        self._body = bytearray()
        if head.chunked:
            self._state = _CHUNK_SIZE
        else:
            self._state = _BODY
            self._remaining = head.content_length or 0
        return head

    def _body_event(self) -> Event:
        """The Content-Length body, once all of it is buffered."""
        if self._remaining > self.max_body_bytes:
            raise self._too_large()
        if len(self._buf) < self._remaining:
            return NEED_DATA
        with memoryview(self._buf) as view, view[:self._remaining] as part:
            body = bytes(part)              # one copy, however large
        del self._buf[:self._remaining]
        return self._finish([], body)

    def _chunked_event(self) -> Event:
        """The chunked body: consume chunks until out of bytes or done."""
        while True:
            if self._state == _CHUNK_SIZE:
                if not self._parse_chunk_size():
                    return NEED_DATA
            elif self._state == _CHUNK_DATA:
                n = min(self._remaining, len(self._buf))
                if n == 0:
                    return NEED_DATA
                self._body += self._buf[:n]
                del self._buf[:n]
                self._remaining -= n
                if self._remaining == 0:
                    self._state = _CHUNK_CRLF
            elif self._state == _CHUNK_CRLF:
                if not self._parse_chunk_crlf():
                    return NEED_DATA
            elif self._state == _TRAILERS:
                trailers = self._parse_trailers()
                if trailers is None:
                    return NEED_DATA
                return self._finish(trailers, bytes(self._body))
            else:  # pragma: no cover - states are exhaustive
                raise AssertionError(self._state)

    def _finish(self, trailers: list[tuple[str, str]], body: bytes) -> Request:
        head = self._head
        assert head is not None
        request = Request(
            method=head.method, target=head.target, path=head.path, query=head.query,
            version=head.version, headers=head.headers, body=body,
            keep_alive=head.keep_alive, expects_continue=head.expects_continue,
            trailers=trailers)
        self._head = None
        self._body = bytearray()
        self._state = _HEAD
        self._scan_from = 0
        self._skipped_empty_lines = False
        return request

    # -- head -------------------------------------------------------------------------------

    def _parse_head(self) -> RequestHead | None:
        buf = self._buf
        self._head_owes = None
        # RFC 9112 §2.2: ignore empty lines received before the request-line.
        while True:
            if buf[:2] == b"\r\n":
                del buf[:2]
            elif buf[:1] == b"\n":
                del buf[:1]
            else:
                break
            self._skipped_empty_lines = True
            self._scan_from = 0
        if not buf:
            return None
        match = _END_OF_HEAD.search(buf, max(0, self._scan_from - 2))
        if match is None:
            # Refuse as soon as the outcome is certain, and only then: any later split of the
            # same bytes must give the same answer (414 before 431, as for a complete head).
            self._check_request_line(len(buf))
            if len(buf) > self.max_header_bytes + 2:   # the head would end past the limit
                raise HTTPError(431, "Request header section too large")
            self._scan_from = len(buf)
            return None
        end = match.start() + 1          # keep the last field line's LF
        self._check_request_line(end)
        if end > self.max_header_bytes:
            raise HTTPError(431, "Request header section too large")
        raw = bytes(buf[:end])
        del buf[:match.end()]
        self._scan_from = 0
        try:
            return parse_head(raw)
        except HTTPError as exc:
            self._head_owes = _owed(raw, exc.body_length, len(buf))
            raise

    def _check_request_line(self, end: int) -> None:
        """414 when the request-line in ``self._buf[:end]`` (up to its LF, without a CR before
        it) is, or is certain to become, longer than the limit.  Looks at no more than the
        limit + 2 bytes."""
        limit = self.max_request_line_bytes
        buf = self._buf
        window = min(end, limit + 2)
        lf = buf.find(b"\n", 0, window)
        n = window if lf < 0 else lf           # bytes of the line (so far)
        if n and buf[n - 1] == 0x0D:           # a CR that ends (or may end) the line
            n -= 1
        if n > limit:
            raise HTTPError(414, "Request-line too long")

    # -- chunked body -----------------------------------------------------------------------

    def _parse_chunk_size(self) -> bool:
        """Consume one chunk-size line; False when it is not complete yet."""
        buf = self._buf
        lf = buf.find(b"\n", 0, _MAX_CHUNK_LINE + 2)
        if lf < 0:
            if len(buf) > _MAX_CHUNK_LINE + 1:     # _MAX_CHUNK_LINE bytes and a CR may still end
                raise HTTPError(400, "Chunk-size line too long")
            return False
        if lf == 0 or buf[lf - 1] != 0x0D:
            raise HTTPError(400, "Chunk-size line not terminated by CRLF")
        line = bytes(buf[:lf - 1])
        match = _CHUNK_SIZE_LINE.fullmatch(line)
        if match is None:
            raise HTTPError(400, f"Invalid chunk-size line {excerpt(line)}")
        size = int(match.group(1), 16)
        del buf[:lf + 1]
        if len(self._body) + size > self.max_body_bytes:
            raise self._too_large()
        if size == 0:
            self._state = _TRAILERS
        else:
            self._state = _CHUNK_DATA
            self._remaining = size
        return True

    def _parse_chunk_crlf(self) -> bool:
        """Consume the CRLF after a chunk's data; False when it is not complete yet."""
        if len(self._buf) < 2:
            if self._buf[:1] not in (b"", b"\r"):
                raise HTTPError(400, "Chunk data not followed by CRLF")
            return False
        if self._buf[:2] != b"\r\n":
            raise HTTPError(400, "Chunk data not followed by CRLF")
        del self._buf[:2]
        self._state = _CHUNK_SIZE
        return True

    def _parse_trailers(self) -> list[tuple[str, str]] | None:
        """Consume the trailer section and its final CRLF; None when not complete yet.

        Each call scans only the bytes new since the last one (plus 3), so a trailer section
        fed a byte at a time costs linear time."""
        buf = self._buf
        if buf[:2] == b"\r\n":
            del buf[:2]
            return []
        if buf[:1] == b"\n":
            raise HTTPError(400, "Chunked body not terminated by CRLF")
        if len(buf) < 2:
            return None
        limit = self.max_header_bytes
        start = max(0, self._scan_from - 3)
        end = buf.find(b"\r\n\r\n", start, limit + 4)
        bare_lf = _BARE_LF.search(buf, max(1, self._scan_from), limit + 4 if end < 0 else end)
        if bare_lf is not None:        # refused at once: no CRLF CRLF can make it right
            raise HTTPError(400, "Trailer field not terminated by CRLF")
        if end < 0:
            if len(buf) > limit + 3:     # the section would end past the limit
                raise HTTPError(431, "Trailer section too large")
            self._scan_from = len(buf)
            return None
        raw = bytes(buf[:end])
        del buf[:end + 4]
        self._scan_from = 0
        return parse_fields(raw.split(b"\r\n"), "trailer")
