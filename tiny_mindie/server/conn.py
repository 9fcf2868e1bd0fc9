"""One HTTP/1.1 connection on asyncio: read -> parse -> handler -> write, until close.

This is the thin glue between an ``asyncio.StreamReader``/``StreamWriter`` pair (plain TCP or
TLS) and the sans-IO parser in :mod:`.http`.  Routing and JSON APIs live elsewhere: the
caller passes a ``handler``::

    async def handler(request: Request, stream: ResponseStream) -> Response | None

that either returns a :class:`Response`, or streams with ``await stream.start(...)`` (a
:class:`~.sse.ChunkedStream`) and returns ``None``.

Behaviour on the wire:

* keep-alive and pipelining (requests answered one at a time, in order);
* ``100 Continue`` sent when the client expects it and the declared body fits the limit;
* parse errors answered with their status, then the connection closes: at once when the
  refused request was received whole, else once its remaining bytes are in (or the client
  closes, or ``LINGER_SECONDS`` pass), so that unread bytes do not reset the connection
  before the client has read the answer;
* a handler exception becomes a 500 (traceback only in the log); if the stream had already
  started, the connection is aborted instead (the client sees a truncated chunked body);
* ``Date``, ``Server`` and ``X-Request-Id`` on every response (the client's own ``X-Request-Id``
  when it is 1-128 visible ASCII characters, else a new uuid4 in hex); a kept-alive connection
  is closed after ``keep_alive_timeout`` idle seconds between two requests (a new connection
  waits ``header_timeout`` for its first request); a request gets 408 when its header section
  takes longer than ``header_timeout`` in all, or its body stalls ``idle_timeout`` between two
  reads;
* a response write waits at most ``idle_timeout`` for a client that does not read; a streamed
  one is also cut off once its client leaves more than ``ResponseStream.max_backlog`` bytes
  unread;
* text is encoded with :func:`~.sse.utf8`: a lone surrogate from the client's JSON goes back
  as the JSON escape ``\\ud800`` rather than failing the response.

The bodies of the error answers it writes by itself are the application's (:class:`ErrorAnswers`).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .http import NEED_DATA, HTTPError, Request, RequestHead, RequestParser
from .http_response import CONTINUE_100, format_response
from .peer import peer_address, peer_subject, request_id
from .sse import ChunkedStream, utf8

__all__ = ["ConnectionLimits", "ErrorAnswers", "Handler", "Response", "ResponseStream",
           "json_response", "serve_connection"]

log = logging.getLogger(__name__)

READ_SIZE = 64 * 1024          # bytes per socket read
LINGER_SECONDS = 2.0           # max time spent draining a refused request's rest before closing
CLOSE_SECONDS = 5.0            # max time waiting for the transport to close


@dataclass
class Response:
    """A complete (non-streamed) response returned by a handler.

    Attributes:
        status: HTTP status code.
        body: Body bytes; ``Content-Length`` is set from it.
        content_type: ``Content-Type`` value; empty string for none.
        headers: Extra ``(name, value)`` headers.  ``("Connection", "close")`` closes the
            connection after this response.
    """

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_text(obj: Any) -> str:
    """``obj`` as compact JSON text, non-ASCII kept as is: the encoding of every JSON body and
    event (write it with :func:`tiny_mindie.server.sse.utf8`, which escapes a lone surrogate).

    Raises:
        TypeError / ValueError: ``obj`` is not JSON-serialisable (or contains NaN/Infinity).
    """
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def json_response(status: int, obj: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    """A :class:`Response` whose body is ``obj`` as compact UTF-8 JSON (:func:`json_text`;
    a lone surrogate, which a client can send as ``"\\ud800"``, as that escape).

    Raises:
        TypeError / ValueError: ``obj`` is not JSON-serialisable (or contains NaN/Infinity).
    """
    return Response(status, utf8(json_text(obj)), "application/json", list(headers or []))


Handler = Callable[[Request, "ResponseStream"], Awaitable[Response | None]]


class ResponseStream:
    """Handed to the handler with each request; lets it stream the response instead.

    Only one of the two may happen per request: return a :class:`Response`, or call
    :meth:`start` and return ``None``.

    Attributes:
        max_backlog: Bytes a streamed response's client may leave unread before it is cut off
            (see :class:`~.sse.ChunkedStream`); ``None`` (the default): no limit. Set it
            before :meth:`start`.
        request_id: The request's id, sent as ``X-Request-Id`` (see :func:`request_id`).
        peer: The client's address (``host:port``), ``None`` when unknown.
        client_subject: The subject of the client's certificate (:func:`peer_subject`).
        status: The status :meth:`start` sent, ``None`` before.
        record: The access record the handler adds to (:class:`~.routing.RequestRecord`).
    """

    def __init__(self, writer: asyncio.StreamWriter, request: Request,
                 base_headers: Callable[[bool], list[tuple[str, str]]],
                 write_timeout: float | None,
                 reader: asyncio.StreamReader | None = None, *, request_id: str = "",
                 peer: str | None = None, client_subject: str | None = None) -> None:
        self._reader = reader
        self._writer = writer
        self._request = request
        self._base_headers = base_headers
        self._write_timeout = write_timeout
        self._stream: ChunkedStream | None = None
        self.max_backlog: int | None = None
        self.request_id = request_id
        self.peer = peer
        self.client_subject = client_subject
        self.status: int | None = None
        self.record = None

    @property
    def started(self) -> bool:
        """:meth:`start` has been called."""
        return self._stream is not None

    @property
    def chunked_stream(self) -> ChunkedStream | None:
        """The stream returned by :meth:`start`, or ``None``."""
        return self._stream

    def peer_gone(self) -> bool:
        """The client closed or reset the connection while its request was being handled.

        Cheap enough to poll: it looks at the transport and at an end-of-stream already
        received, and reads nothing (a pipelined next request stays buffered)."""
        if self._writer.transport.is_closing():
            return True
        return self._reader is not None and self._reader.at_eof()

    @property
    def keep_alive(self) -> bool:
        """Whether the connection can be reused after this streamed response."""
        return self._request.keep_alive and (self._stream is None or self._stream.chunked)

    async def start(self, status: int = 200, content_type: str = "text/event-stream",
                    extra_headers: Iterable[tuple[str, str]] = ()) -> ChunkedStream:
        """Send the response head and return the started :class:`~.sse.ChunkedStream`.

        HTTP/1.0 requests get an unchunked body delimited by closing the connection. Every
        streamed response carries ``X-Accel-Buffering: no``, so that nginx (or another proxy
        that honours it) passes each event on as it comes instead of buffering the answer.

        Raises:
            RuntimeError: called twice.
            ConnectionError: the peer is gone.
        """
        if self._stream is not None:
            raise RuntimeError("response stream already started")
        chunked = self._request.version == "HTTP/1.1"
        keep_alive = self._request.keep_alive and chunked
        self.status = status
        self._stream = ChunkedStream(self._writer, base_headers=self._base_headers(keep_alive),
                                     chunked=chunked, write_timeout=self._write_timeout,
                                     max_backlog=self.max_backlog)
        await self._stream.start(status, content_type,
                                 [("X-Accel-Buffering", "no"), *extra_headers])
        return self._stream


_date_cache: tuple[int, str] = (0, "")


def _http_date() -> str:
    """Current time as an IMF-fixdate (``Date`` header), cached per second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
    return _date_cache[1]


@dataclass(frozen=True)
class ErrorAnswers:
    """The answers :func:`serve_connection` writes by itself, in the application's words.

    Attributes:
        rejected: ``(HTTPError) -> Response``: the answer to a request the parser refused
            (its status is the error's; the connection closes after it).
        failed: the 500 answer when a handler raises or returns no :class:`Response`.
        refused: told of each answer ``rejected`` gave, after it is written (the access
            record): ``refused(exc, head, request_id=, peer=, client=)`` with the head the parser
            read (``None`` when the error came first), the answer's ``X-Request-Id``, the
            client's ``host:port`` and certificate subject.
    """

    rejected: Callable[[HTTPError], Response]
    failed: Response
    refused: Callable[..., None] = lambda exc, head, **who: None


# The default: the parser's message, or "Internal server error", as plain text.
PLAIN_ANSWERS = ErrorAnswers(
    rejected=lambda exc: Response(exc.status, utf8(exc.message), "text/plain; charset=utf-8"),
    failed=Response(500, b"Internal server error", "text/plain; charset=utf-8"))


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may take.

    Attributes:
        max_body_bytes: Request body limit in bytes; larger bodies are answered with 413
            (:attr:`HTTPError.limit <.http_message.HTTPError>` names it).
        idle_timeout: Seconds a request's body may stall between reads (-> 408) and a
            response write may wait for the client.
        keep_alive_timeout: Seconds a kept-alive connection may sit idle between two requests
            before it is closed (``None``: ``idle_timeout``).
        header_timeout: Seconds a request's header section may take in all, counted from its
            first byte (-> 408); also how long a new connection may wait before its first
            request (``None``: ``idle_timeout``).
    """

    max_body_bytes: int
    idle_timeout: float = 60.0
    keep_alive_timeout: float | None = None
    header_timeout: float | None = None


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           handler: Handler, limits: ConnectionLimits, *,
                           server_header: str = "tiny_mindie",
                           answers: ErrorAnswers = PLAIN_ANSWERS) -> None:
    """Serve HTTP/1.1 requests on one connection until it closes; never raises (except
    ``CancelledError``, after closing the connection).

    Args:
        reader, writer: The connection, as given by ``asyncio.start_server``.
        handler: ``async (Request, ResponseStream) -> Response | None`` (see module docstring).
        limits: Its body limit and timeouts (:class:`ConnectionLimits`).
        server_header: Value of the ``Server`` header.
        answers: The bodies of the answers it writes by itself (see :class:`ErrorAnswers`).
    """
    conn = _Connection(reader, writer, handler, limits, server_header, answers)
    await conn.run()


class _Connection:
    """State of one connection while :func:`serve_connection` runs."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 handler: Handler, limits: ConnectionLimits, server_header: str,
                 answers: ErrorAnswers) -> None:
        idle = limits.idle_timeout
        self.reader = reader
        self.writer = writer
        self.handler = handler
        self.max_body_bytes = limits.max_body_bytes
        self.idle_timeout = idle
        self.keep_alive_timeout = idle if limits.keep_alive_timeout is None else \
            limits.keep_alive_timeout
        self.header_timeout = idle if limits.header_timeout is None else limits.header_timeout
        self.served = 0                 # requests answered on this connection
        self.server_header = server_header
        self.answers = answers
        self.parser = RequestParser(max_body_bytes=limits.max_body_bytes)
        self.peer = writer.get_extra_info("peername")
        self.client_subject = peer_subject(writer)

    async def run(self) -> None:
        abort = False
        try:
            while True:
                try:
                    request = await self._read_request()
                except HTTPError as exc:
                    log.debug("%s: rejected request: %d %s", self.peer, exc.status, exc.message)
                    if exc.__cause__ is not None:     # a parser bug, answered with 400 anyway
                        log.warning("%s: HTTP parser error: %r", self.peer, exc.__cause__)
                    await self._send_error(exc)
                    await self._linger(self.parser.owed_after_error)
                    return
                if request is None:
                    return
                keep_alive, abort = await self._respond(request)
                self.served += 1
                if not keep_alive:
                    return
        except (TimeoutError, ConnectionError, ssl.SSLError, asyncio.IncompleteReadError,
                OSError) as exc:
            log.debug("%s: connection ended: %r", self.peer, exc)
            abort = True
        finally:
            await self._close(abort)

    # -- reading ---------------------------------------------------------------------------

    async def _read_request(self) -> Request | None:
        """Next complete request, or ``None`` when the peer closed or idled out between
        requests (``keep_alive_timeout``; ``header_timeout`` before the first one).  Raises
        HTTPError (bad input, or 408 when a request stalls: ``idle_timeout`` between two reads
        of its body, or ``header_timeout`` for its whole header section counted from its first
        byte, empty lines before it included -- a client trickling the header in a byte at a
        time, or sending empty lines, would otherwise hold a connection forever)."""
        parser = self.parser
        loop = asyncio.get_running_loop()
        head_deadline: float | None = None      # set by the first byte of the request
        head_in = False
        idle = self.keep_alive_timeout if self.served else self.header_timeout
        while True:
            event = parser.next_event()
            if event is NEED_DATA:
                if not head_in and head_deadline is None and parser.has_partial_request:
                    head_deadline = loop.time() + self.header_timeout
                if head_in:
                    wait = self.idle_timeout
                elif head_deadline is None:
                    wait = idle
                else:
                    wait = head_deadline - loop.time()
                try:
                    if wait <= 0:
                        raise TimeoutError
                    data = await asyncio.wait_for(self.reader.read(READ_SIZE), wait)
                except TimeoutError:
                    if parser.has_partial_request:
                        raise HTTPError(408, "Request timed out") from None
                    log.debug("%s: idle keep-alive connection timed out", self.peer)
                    return None
                if not data:
                    if parser.has_partial_request:
                        log.debug("%s: peer closed in the middle of a request", self.peer)
                    return None
                parser.feed(data)
            elif isinstance(event, RequestHead):
                head_in, head_deadline = True, None      # the body's reads time out one by one
                if event.expects_continue and (event.content_length is None
                                               or event.content_length <= self.max_body_bytes):
                    await self._write(CONTINUE_100)
            else:
                assert isinstance(event, Request)
                return event

    # -- writing ---------------------------------------------------------------------------

    def _base_headers(self, request: Request | None, keep_alive: bool,
                      rid: str | None = None) -> list[tuple[str, str]]:
        headers = [("Date", _http_date()), ("Server", self.server_header),
                   ("X-Request-Id", rid or request_id(None))]
        if not keep_alive:
            headers.append(("Connection", "close"))
        elif request is not None and request.version == "HTTP/1.0":
            headers.append(("Connection", "keep-alive"))
        return headers

    async def _write(self, data: bytes) -> None:
        """Write ``data`` and wait until it is handed to the kernel (or the peer idles out).

        Raises ConnectionError when the peer is gone."""
        if self.writer.transport.is_closing():
            raise ConnectionResetError("client connection is closed")
        try:
            self.writer.write(data)
        except RuntimeError as exc:           # uvloop, on a transport closed under us
            raise ConnectionResetError(str(exc)) from exc
        await self._drain()

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.writer.drain(), self.idle_timeout)
        except TimeoutError:
            raise ConnectionAbortedError("client stopped reading") from None

    async def _respond(self, request: Request) -> tuple[bool, bool]:
        """Run the handler and write its answer. Returns (keep_alive, abort)."""
        rid = request_id(request)
        stream = ResponseStream(self.writer, request,
                                lambda keep: self._base_headers(request, keep, rid),
                                self.idle_timeout, self.reader, request_id=rid,
                                peer=peer_address(self.peer), client_subject=self.client_subject)
        try:
            result = await self.handler(request, stream)
        except asyncio.CancelledError:
            raise
        except ConnectionError as exc:
            log.debug("%s: client went away during %s %s: %r",
                      self.peer, request.method, request.path, exc)
            return False, True
        except Exception:
            log.exception("handler failed on %s %s", request.method, request.path)
            if stream.started:
                return False, True
            result = self.answers.failed
        else:
            if stream.started:
                chunked = stream.chunked_stream
                assert chunked is not None
                if result is not None:
                    log.error("handler for %s %s returned a Response after streaming",
                              request.method, request.path)
                    return False, True
                if not chunked.ended:
                    await chunked.end()
                return stream.keep_alive, False
            if result is None and stream.peer_gone():   # handler gave up: the client left
                log.debug("%s: client went away during %s %s", self.peer, request.method,
                          request.path)
                return False, True
            if not isinstance(result, Response):
                log.error("handler for %s %s returned %r instead of a Response",
                          request.method, request.path, type(result).__name__)
                result = self.answers.failed

        keep_alive = request.keep_alive and not any(
            n.lower() == "connection" and "close" in v.lower() for n, v in result.headers)
        headers = self._base_headers(request, keep_alive, rid)
        if result.content_type and not any(n.lower() == "content-type" for n, _ in result.headers):
            headers.append(("Content-Type", result.content_type))
        headers.extend((n, v) for n, v in result.headers if n.lower() != "connection")
        try:
            data = format_response(result.status, headers, result.body,
                                   include_body=request.method != "HEAD")
        except ValueError:
            log.exception("handler for %s %s produced an invalid response",
                          request.method, request.path)
            failed = self.answers.failed
            data = format_response(failed.status, self._base_headers(request, keep_alive, rid)
                                   + [("Content-Type", failed.content_type)], failed.body)
        await self._write(data)
        return keep_alive, False

    async def _send_error(self, exc: HTTPError) -> None:
        answer = self.answers.rejected(exc)
        head = self.parser.head
        rid = request_id(head)
        headers = (self._base_headers(None, False, rid) + [("Content-Type", answer.content_type)])
        try:
            await self._write(format_response(exc.status, headers, answer.body))
        finally:
            self.answers.refused(exc, head, request_id=rid, peer=peer_address(self.peer),
                                 client=self.client_subject)

    # -- closing ---------------------------------------------------------------------------

    async def _linger(self, owed: int | None) -> None:
        """After an error answer: when the client may still be sending the refused request
        (``owed``: its bytes not received yet, ``None`` unknown), half-close, then discard
        input until those bytes are in, the client closes, or ``LINGER_SECONDS`` pass, so
        that closing with unread request bytes does not reset the connection before the
        client has read the answer. Nothing owed: the connection closes at once."""
        if owed == 0:
            return
        writer = self.writer
        try:
            if writer.can_write_eof():
                writer.write_eof()
            deadline = asyncio.get_running_loop().time() + min(LINGER_SECONDS, self.idle_timeout)
            while owed is None or owed > 0:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                data = await asyncio.wait_for(self.reader.read(READ_SIZE), left)
                if not data:
                    break
                if owed is not None:
                    owed -= len(data)
        except (TimeoutError, ConnectionError, ssl.SSLError, OSError):
            pass

    async def _close(self, abort: bool) -> None:
        writer = self.writer
        try:
            if abort:
                writer.transport.abort()
            else:
                writer.close()
            await asyncio.wait_for(writer.wait_closed(), CLOSE_SECONDS)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # closing a broken connection: nothing left to do
            log.debug("%s: error while closing: %r", self.peer, exc)
            writer.transport.abort()
