"""HTTP/1.1 message parsing and formatting, sans-IO (RFC 9110 / RFC 9112).

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

The response side is a handful of pure functions that build bytes:
:func:`format_response_head`, :func:`format_response`, :func:`format_chunk`, plus the
constants :data:`LAST_CHUNK` and :data:`CONTINUE_100`.

Strictness (what is rejected, and why) follows RFC 9112 with request smuggling in mind:
one space between request-line parts, token method and header names, no whitespace before
the colon, no obs-fold, no bare CR, no control characters in values, Content-Length digits
only (identical repeats allowed), Content-Length together with Transfer-Encoding rejected,
CRLF required inside chunked framing, exactly one valid ``Host`` in an HTTP/1.1 request (at most
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

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final
from urllib.parse import parse_qsl, unquote

__all__ = [
    "CONTINUE_100",
    "LAST_CHUNK",
    "NEED_DATA",
    "Event",
    "HTTPError",
    "Request",
    "body_too_large_message",
    "RequestHead",
    "RequestParser",
    "format_chunk",
    "format_response",
    "format_response_head",
    "reason_phrase",
]

LAST_CHUNK: Final = b"0\r\n\r\n"
"""The terminating zero-size chunk of a chunked body (no trailers)."""

CONTINUE_100: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
"""The interim response telling a client that waits on ``Expect: 100-continue`` to send."""


class HTTPError(Exception):
    """A request the server cannot accept; answer with ``status`` and close the connection.

    Attributes:
        status: HTTP status code to answer with (400, 408, 413, 414, 417, 431, 501, 505).
        message: Human-readable reason, safe to show to the client (never contains input
            bytes beyond a short, printable excerpt).
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __repr__(self) -> str:
        return f"HTTPError({self.status}, {self.message!r})"


class _NeedData:
    """Type of :data:`NEED_DATA` (a singleton)."""

    __slots__ = ()
    _instance: _NeedData | None = None

    def __new__(cls) -> _NeedData:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA: Final = _NeedData()
"""Returned by :meth:`RequestParser.next_event` when more bytes must be fed first."""


class _Headers:
    """Case-insensitive look-up over ``self.headers`` (names already lower-cased)."""

    headers: list[tuple[str, str]]

    def header(self, name: str, default: str | None = None) -> str | None:
        """Value of header ``name`` (any case); repeated headers are joined with ``", "``.

        Returns ``default`` when the header is absent.
        """
        name = name.lower()
        values = [v for n, v in self.headers if n == name]
        if not values:
            return default
        return values[0] if len(values) == 1 else ", ".join(values)


@dataclass
class RequestHead(_Headers):
    """The request-line and header section of a request, before its body has arrived.

    Attributes:
        method: Request method exactly as sent (case-sensitive token, e.g. ``"POST"``).
        target: Raw request-target (e.g. ``"/infer?x=1"``).
        path: Percent-decoded path without the query (``"*"`` for asterisk-form,
            ``""`` for authority-form).
        query: Decoded query parameters; for repeated keys the last one wins.
        version: ``"HTTP/1.1"`` or ``"HTTP/1.0"``.
        headers: ``(name, value)`` pairs in order received; names lower-cased, values
            stripped of surrounding whitespace and decoded as ISO-8859-1.
        keep_alive: Whether the client allows the connection to be reused afterwards.
        expects_continue: The client sent ``Expect: 100-continue`` (HTTP/1.1 only) and a
            body follows: it may wait for ``100 Continue`` before sending it.
        content_length: Declared body size in bytes, or ``None`` (chunked or no body).
        chunked: The body uses chunked transfer coding.
    """

    method: str
    target: str
    path: str
    query: dict[str, str]
    version: str
    headers: list[tuple[str, str]]
    keep_alive: bool
    expects_continue: bool
    content_length: int | None = None
    chunked: bool = False


@dataclass
class Request(_Headers):
    """A complete request: head fields as in :class:`RequestHead`, plus the body.

    Attributes:
        body: The decoded body (chunked framing removed); ``b""`` when there is none.
        trailers: Trailer fields of a chunked body (names lower-cased); they are not
            merged into ``headers``.
    """

    method: str
    target: str
    path: str
    query: dict[str, str]
    version: str
    headers: list[tuple[str, str]]
    body: bytes = b""
    keep_alive: bool = True
    expects_continue: bool = False
    trailers: list[tuple[str, str]] = field(default_factory=list)


Event = _NeedData | RequestHead | Request
"""What :meth:`RequestParser.next_event` returns."""

# --- grammar (RFC 9110 §5.6.2, RFC 9112 §3, §5, §7.1) -----------------------------------

_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_REQUEST_LINE = re.compile(rb"(" + _TOKEN + rb") ([\x21-\x7e]+) (HTTP/[0-9]+\.[0-9]+)")
_VERSION = re.compile(r"HTTP/([0-9])\.([0-9])")
_FIELD_NAME = re.compile(_TOKEN)
_BAD_VALUE_CHAR = re.compile(rb"[^\t\x20-\x7e\x80-\xff]")
_END_OF_HEAD = re.compile(rb"\n\r?\n")
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(;[\t\x20-\x7e\x80-\xff]*)?")
_DIGITS = re.compile(r"[0-9]+")

# uri-host [":" port] (RFC 3986 §3.2.2-3.2.3): IP-literal (IPv6 or IPvFuture) or reg-name /
# IPv4address; never userinfo.  The host must not be empty (RFC 9110 §4.2.1).
_IP_LITERAL = r"\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+)\]"
_REG_NAME = r"(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})+"
_HOST_PORT = re.compile(rf"(?:{_IP_LITERAL}|{_REG_NAME})(?::[0-9]*)?")
_AUTHORITY_FORM = re.compile(rf"(?:{_IP_LITERAL}|{_REG_NAME}):[0-9]*")
_ABSOLUTE_FORM = re.compile(r"([A-Za-z][A-Za-z0-9+\-.]*)://([^/?#]*)(.*)", re.S)


def _is_host(text: str, form: re.Pattern[str]) -> bool:
    """``form.fullmatch(text)`` with, for an IP-literal, an IPv6 address that
    ``ipaddress.IPv6Address`` takes (``[:::]`` is none); an IPvFuture (``[v1.x]``) is left to
    the pattern, as RFC 3986 defines no more of it."""
    if form.fullmatch(text) is None:
        return False
    if text.startswith("[") and text[1:2] not in ("v", "V"):
        try:
            ipaddress.IPv6Address(text[1:text.index("]")])
        except ValueError:
            return False
    return True

_MAX_HEADERS = 100            # field lines per header or trailer section
_MAX_CHUNK_LINE = 4096        # bytes, chunk-size line including extensions
_MAX_QUERY_FIELDS = 1000

# parser states
_HEAD = "head"
_BODY = "body"                # Content-Length body; self._remaining bytes to go
_CHUNK_SIZE = "chunk-size"
_CHUNK_DATA = "chunk-data"    # self._remaining bytes of the current chunk to go
_CHUNK_CRLF = "chunk-crlf"
_TRAILERS = "trailers"
_ERROR = "error"


def _excerpt(data: bytes, limit: int = 40) -> str:
    """A short printable rendering of ``data`` for error messages."""
    text = data[:limit].decode("ascii", "backslashreplace")
    return repr(text + ("..." if len(data) > limit else ""))


def _mb(n_bytes: int) -> str:
    """``n_bytes`` as MiB for messages: ``"40"`` for 40 MiB, ``"0.5"`` for 512 KiB."""
    return f"{n_bytes / 2**20:g}"


def body_too_large_message(max_body_bytes: int) -> str:
    """MindIE's 413 message for a body limit of ``max_body_bytes`` bytes."""
    return f"Request body too large. Maximum allowed size is {_mb(max_body_bytes)}MB."


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
        self._state = _ERROR
        self._error = exc
        self._buf.clear()

    # -- state machine ----------------------------------------------------------------------

    def _next_event(self) -> Event:
        if self._state == _HEAD:
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
        if self._state == _BODY:
            if self._remaining > self.max_body_bytes:
                raise HTTPError(413, body_too_large_message(self.max_body_bytes))
            if len(self._buf) < self._remaining:
                return NEED_DATA
            with memoryview(self._buf) as view, view[:self._remaining] as part:
                body = bytes(part)              # one copy, however large
            del self._buf[:self._remaining]
            return self._finish([], body)
        while True:  # chunked body: loop until out of bytes or done
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
                if len(self._buf) < 2:
                    if self._buf[:1] not in (b"", b"\r"):
                        raise HTTPError(400, "Chunk data not followed by CRLF")
                    return NEED_DATA
                if self._buf[:2] != b"\r\n":
                    raise HTTPError(400, "Chunk data not followed by CRLF")
                del self._buf[:2]
                self._state = _CHUNK_SIZE
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
        lines = _split_lines(raw)
        method, target, version = _parse_request_line(lines[0])
        headers = _parse_fields(lines[1:], "header")
        return _build_head(method, target, version, headers)

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
            raise HTTPError(400, f"Invalid chunk-size line {_excerpt(line)}")
        size = int(match.group(1), 16)
        del buf[:lf + 1]
        if len(self._body) + size > self.max_body_bytes:
            raise HTTPError(413, body_too_large_message(self.max_body_bytes))
        if size == 0:
            self._state = _TRAILERS
        else:
            self._state = _CHUNK_DATA
            self._remaining = size
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
        end = buf.find(b"\r\n\r\n", max(0, self._scan_from - 3), limit + 4)
        if end < 0:
            if len(buf) > limit + 3:     # the section would end past the limit
                raise HTTPError(431, "Trailer section too large")
            self._scan_from = len(buf)
            return None
        raw = bytes(buf[:end])
        del buf[:end + 4]
        self._scan_from = 0
        lines = raw.split(b"\r\n")
        if any(b"\n" in line for line in lines):
            raise HTTPError(400, "Trailer field not terminated by CRLF")
        return _parse_fields(lines, "trailer")


# --- head helpers (pure) ------------------------------------------------------------------

def _split_lines(raw: bytes) -> list[bytes]:
    """Split a header section on LF, dropping one CR before each; reject any other CR."""
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for line in lines:
        if line.endswith(b"\r"):
            line = line[:-1]
        if b"\r" in line:
            raise HTTPError(400, "Bare CR in request head")
        out.append(line)
    return out


def _parse_request_line(line: bytes) -> tuple[str, str, str]:
    """``method SP request-target SP HTTP-version`` -> the three parts, validated."""
    match = _REQUEST_LINE.fullmatch(line)
    if match is None:
        raise HTTPError(400, f"Invalid request-line {_excerpt(line)}")
    method, target, version = (g.decode("ascii") for g in match.groups())
    vmatch = _VERSION.fullmatch(version)
    if vmatch is None or vmatch.group(1) != "1" or vmatch.group(2) not in ("0", "1"):
        raise HTTPError(505, f"HTTP version not supported: {_excerpt(match.group(3), 16)}")
    return method, target, version


def _parse_fields(lines: Iterable[bytes], what: str) -> list[tuple[str, str]]:
    """Field lines -> ``[(lower-cased name, stripped value)]``; 400/431 on bad input."""
    fields = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HTTPError(400, f"Obsolete line folding in {what} section")
        name, colon, value = line.partition(b":")
        if not colon or not _FIELD_NAME.fullmatch(name):
            raise HTTPError(400, f"Invalid {what} field {_excerpt(line)}")
        value = value.strip(b" \t")
        if _BAD_VALUE_CHAR.search(value):
            raise HTTPError(400, f"Invalid character in {what} field {_excerpt(name)}")
        fields.append((name.decode("ascii").lower(), value.decode("latin-1")))
        if len(fields) > _MAX_HEADERS:
            raise HTTPError(431, f"Too many {what} fields (more than {_MAX_HEADERS})")
    return fields


def _comma_list(headers: list[tuple[str, str]], name: str) -> list[str]:
    """All comma-separated, lower-cased, non-empty members of header ``name``."""
    return [item.strip().lower() for n, v in headers if n == name
            for item in v.split(",") if item.strip()]


def _build_head(method: str, target: str, version: str,
                headers: list[tuple[str, str]]) -> RequestHead:
    """Validate framing headers and decode the target into a :class:`RequestHead`."""
    # Host (RFC 9112 §3.2): required in HTTP/1.1, at most one, uri-host [":" port] or empty.
    hosts = [v for n, v in headers if n == "host"]
    if len(hosts) > 1:
        raise HTTPError(400, "Multiple Host headers")
    if not hosts and version == "HTTP/1.1":
        raise HTTPError(400, "Missing Host header (required in HTTP/1.1)")
    if hosts and hosts[0] and not _is_host(hosts[0], _HOST_PORT):
        raise HTTPError(400, "Invalid Host header")

    # Body framing (RFC 9112 §6).
    te_codings = _comma_list(headers, "transfer-encoding")
    has_te = any(n == "transfer-encoding" for n, _ in headers)
    cl_values = [v.strip() for n, v in headers if n == "content-length" for v in v.split(",")]
    content_length: int | None = None
    chunked = False
    if has_te and cl_values:
        raise HTTPError(400, "Both Content-Length and Transfer-Encoding present")
    if has_te:
        if version == "HTTP/1.0":
            raise HTTPError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if te_codings == ["chunked"]:
            chunked = True
        elif not te_codings:
            raise HTTPError(400, "Empty Transfer-Encoding")
        elif "chunked" in te_codings and (te_codings[-1] != "chunked"
                                          or te_codings.count("chunked") > 1):
            raise HTTPError(400, "Transfer-Encoding must apply chunked once, last")
        else:
            codings = ", ".join(te_codings).encode("latin-1")
            raise HTTPError(501, f"Unsupported Transfer-Encoding {_excerpt(codings)}; "
                                 "only chunked is supported")
    elif cl_values:
        if len(set(cl_values)) != 1 or not _DIGITS.fullmatch(cl_values[0]):
            raise HTTPError(400, "Invalid Content-Length")
        if len(cl_values[0]) > 18:
            content_length = 10**18           # far over any limit: answered with 413
        else:
            content_length = int(cl_values[0])

    # Connection persistence (RFC 9112 §9.3).
    connection = _comma_list(headers, "connection")
    if version == "HTTP/1.1":
        keep_alive = "close" not in connection
    else:
        keep_alive = "keep-alive" in connection and "close" not in connection

    # Expect (RFC 9110 §10.1.1): 100-continue is the only expectation there is.
    expectations = _comma_list(headers, "expect")
    unmet = [e for e in expectations if e != "100-continue"]
    if unmet:
        raise HTTPError(417, f"Unsupported expectation {_excerpt(unmet[0].encode('latin-1'))}; "
                             "only 100-continue is supported")
    has_body = chunked or bool(content_length)
    expects_continue = version == "HTTP/1.1" and has_body and bool(expectations)

    path, query = _split_target(method, target)
    return RequestHead(method=method, target=target, path=path, query=query, version=version,
                       headers=headers, keep_alive=keep_alive, expects_continue=expects_continue,
                       content_length=content_length, chunked=chunked)


def _split_target(method: str, target: str) -> tuple[str, dict[str, str]]:
    """request-target -> (percent-decoded path, query dict with last value winning).

    origin-form ``/path?query``; absolute-form ``http(s)://host[:port][/path][?query]`` (the
    authority is checked, then ignored); authority-form ``host:port`` for CONNECT (path
    ``""``); asterisk-form ``*``.  A fragment (``#...``, never sent by a conforming client) is
    dropped.  Raises HTTPError(400) on anything else.
    """
    if target == "*":
        return "*", {}
    if target.startswith("/"):
        rest = target
    elif (absolute := _ABSOLUTE_FORM.fullmatch(target)) is not None:
        scheme, authority, rest = absolute.groups()
        if scheme.lower() not in ("http", "https") or not _is_host(authority, _HOST_PORT):
            raise HTTPError(400, "Invalid absolute-form request-target "
                                 + _excerpt(target.encode()))
        if not rest.startswith("/"):
            rest = "/" + rest                   # "http://h" and "http://h?q" mean path "/"
    elif method == "CONNECT":                   # authority-form
        if not _is_host(target, _AUTHORITY_FORM):
            raise HTTPError(400, "Invalid authority-form request-target "
                                 + _excerpt(target.encode()))
        return "", {}
    else:
        raise HTTPError(400, f"Invalid request-target {_excerpt(target.encode())}")
    raw_path, _, raw_query = rest.partition("#")[0].partition("?")
    try:
        path = unquote(raw_path, errors="strict")
        query = dict(parse_qsl(raw_query, keep_blank_values=True, errors="strict",
                               max_num_fields=_MAX_QUERY_FIELDS))
    except UnicodeDecodeError:
        raise HTTPError(400, "Request-target is not valid UTF-8 after percent-decoding") from None
    except ValueError:
        raise HTTPError(400, "Too many query parameters") from None
    if "\x00" in path:
        raise HTTPError(400, "NUL in request path")
    return path, query


# --- response side ------------------------------------------------------------------------

_RESPONSE_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_RESPONSE_FIELD_NAME = re.compile(_TOKEN.decode("ascii"))


def reason_phrase(status: int) -> str:
    """The status code's reason phrase (``417`` -> ``"Expectation Failed"``); ``""`` for a code
    Python does not know."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def format_response_head(status: int, headers: Iterable[tuple[str, str]]) -> bytes:
    """Status line and header section of a response, ending with the blank line.

    Args:
        status: Status code, 100..999; the reason phrase is the standard one
            (``http.HTTPStatus``), empty for unknown codes.
        headers: ``(name, value)`` pairs written in order, as given.

    Raises:
        ValueError: status out of range, a name that is not a token, or a value containing
            CR, LF or another control character (header injection), or not ISO-8859-1.
    """
    if not 100 <= status <= 999:
        raise ValueError(f"invalid status code {status}")
    parts = [f"HTTP/1.1 {status} {reason_phrase(status)}\r\n"]
    for name, value in headers:
        value = str(value)
        if not _RESPONSE_FIELD_NAME.fullmatch(name):
            raise ValueError(f"invalid header name {name!r}")
        if not _RESPONSE_FIELD_VALUE.fullmatch(value):
            raise ValueError(f"invalid character in value of header {name!r}")
        parts.append(f"{name}: {value}\r\n")
    parts.append("\r\n")
    return "".join(parts).encode("latin-1")


def format_response(status: int, headers: Iterable[tuple[str, str]], body: bytes, *,
                    include_body: bool = True) -> bytes:
    """A complete response with ``Content-Length`` set from ``body`` (bytes).

    Any ``Content-Length`` or ``Transfer-Encoding`` in ``headers`` is replaced.  For 1xx, 204
    and 304 no ``Content-Length`` is sent and ``body`` must be empty.  With
    ``include_body=False`` (answering ``HEAD``) the head announces ``len(body)`` but the body
    is left out.

    Raises:
        ValueError: as :func:`format_response_head`, or a body given for 1xx/204/304.
    """
    kept = [(n, v) for n, v in headers if n.lower() not in ("content-length", "transfer-encoding")]
    if status < 200 or status in (204, 304):
        if body:
            raise ValueError(f"a {status} response cannot have a body")
    else:
        kept.append(("Content-Length", str(len(body))))
    head = format_response_head(status, kept)
    return head + body if include_body and body else head


def format_chunk(data: bytes) -> bytes:
    """One chunk of a chunked body: hex size, CRLF, data, CRLF.

    Empty ``data`` gives ``b""``: a zero-size chunk would end the body (use
    :data:`LAST_CHUNK` for that).
    """
    if not data:
        return b""
    return b"%x\r\n%b\r\n" % (len(data), data)
