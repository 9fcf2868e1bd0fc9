"""Server-Sent Events framing and a streaming (chunked) response writer for asyncio.

:func:`sse_event` is pure: text in, ``data: ...`` bytes out (WHATWG HTML, "Server-sent
events", §9.2).  :class:`ChunkedStream` writes one streamed HTTP response onto an
``asyncio.StreamWriter``: the head with ``Transfer-Encoding: chunked``, one chunk per
:meth:`ChunkedStream.send`, then the last chunk.  Each send waits for the transport's buffer
to drain (back-pressure from a slow client reaches the token generator), a client that
leaves too much unread is cut off (``max_backlog``), and a vanished client surfaces as
``ConnectionError`` so the caller can cancel generation.

Text goes on the wire through :func:`utf8`, which writes the lone surrogates ``json.loads``
makes from ``"\\ud800"`` as that very escape instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import struct
import sys
from collections.abc import Iterable, Sequence

from .http_response import LAST_CHUNK, format_chunk, format_response_head

__all__ = ["ChunkedStream", "sse_event", "unsent_bytes", "utf8"]

log = logging.getLogger(__name__)

_LINE_BREAK = re.compile(r"\r\n|\r|\n")

try:        # SIOCOUTQ (== TIOCOUTQ): a TCP socket's bytes not yet acknowledged by the peer
    import fcntl
    import termios
    _SIOCOUTQ: int | None = termios.TIOCOUTQ if sys.platform.startswith("linux") else None
except (ImportError, AttributeError):
    _SIOCOUTQ = None


def utf8(text: str) -> bytes:
    """``text`` as UTF-8, with each lone surrogate (which UTF-8 cannot encode, and which
    ``json.loads`` makes from a client's ``"\\ud800"``) written as the escape ``\\ud800``.

    That is JSON's own escape for it, so JSON text stays valid JSON and parses back to the
    same string, as ``ensure_ascii`` output would (a pair's two halves, if a string holds them
    apart, read back as the one character they make); ``json.dumps`` escapes every backslash,
    so the escape cannot join another one. Never raises."""
    return text.encode("utf-8", "backslashreplace")


def unsent_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes written to ``transport`` that its peer has not taken yet, as far as this host
    sees: the transport's write buffer plus, on Linux, the socket's send queue (``SIOCOUTQ``:
    bytes the peer has not acknowledged, which it stops doing once its receive buffer is
    full). Over TLS the queue holds ciphertext: a few bytes per record more than was written.
    Elsewhere, or when the socket is gone, only the write buffer counts. Never raises."""
    try:
        n = transport.get_write_buffer_size()
    except (AttributeError, NotImplementedError):
        n = 0
    sock = transport.get_extra_info("socket") if _SIOCOUTQ is not None else None
    if sock is not None:
        try:
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):
            pass
    return n


def sse_event(data: str) -> bytes:
    """One SSE event carrying ``data``, UTF-8 encoded.

    Every line of ``data`` becomes a ``data: <line>\\n`` field and a blank line ends the event,
    so ``"a\\nb"`` gives ``b"data: a\\ndata: b\\n\\n"`` and a client rebuilds ``"a\\nb"``.  Only
    CR, LF and CRLF split lines (as in the SSE parser); U+2028 and friends stay inside a line.
    Lone surrogates are escaped as :func:`utf8` does.
    """
    lines = _LINE_BREAK.split(data)
    return utf8("".join(f"data: {line}\n" for line in lines)) + b"\n"


class ChunkedStream:
    """Writer for one streamed response on an asyncio connection.

    Args:
        writer: The connection's stream writer.
        base_headers: Headers sent before the stream's own (e.g. ``Date``, ``Server``,
            ``Connection``).
        chunked: Use chunked transfer coding (HTTP/1.1).  ``False`` is for HTTP/1.0 clients:
            the body is written raw and ends when the connection closes, which the caller
            must then do.
        write_timeout: Seconds one :meth:`send` may wait for the client to read before the
            client is considered gone; ``None`` waits forever.
        max_backlog: Bytes the client may leave unread (:func:`unsent_bytes`: the write buffer
            and the socket's send queue) when the next chunk is sent; past it the connection is
            aborted. ``None``: no limit. Without it a client that reads nothing costs up to the
            kernel's send buffer (megabytes) before ``write_timeout`` even starts.

    Errors: :meth:`send` and :meth:`end` raise ``ConnectionError`` when the peer has gone
    (reset, closed, stopped reading for ``write_timeout``, or left more than ``max_backlog``
    unread); the stream is then unusable.
    Calling them before :meth:`start` or after :meth:`end` raises ``RuntimeError``.
    """

    def __init__(self, writer: asyncio.StreamWriter, *,
                 base_headers: Sequence[tuple[str, str]] = (),
                 chunked: bool = True, write_timeout: float | None = None,
                 max_backlog: int | None = None) -> None:
        self._writer = writer
        self._max_backlog = max_backlog
        self._base_headers = list(base_headers)
        self._chunked = chunked
        self._write_timeout = write_timeout
        self._started = False
        self._ended = False
        self.bytes_sent = 0
        """Body bytes sent so far (before chunk framing)."""

    @property
    def started(self) -> bool:
        """The response head has been written."""
        return self._started

    @property
    def ended(self) -> bool:
        """The body has been terminated with :meth:`end`."""
        return self._ended

    @property
    def chunked(self) -> bool:
        """The body uses chunked transfer coding (False for HTTP/1.0 peers)."""
        return self._chunked

    async def start(self, status: int = 200, content_type: str = "text/event-stream",
                    extra_headers: Iterable[tuple[str, str]] = ()) -> None:
        """Write the response head: ``base_headers``, ``Content-Type``,
        ``Cache-Control: no-cache``, ``Transfer-Encoding: chunked`` (when chunked), then
        ``extra_headers``.

        Raises:
            RuntimeError: already started.
            ConnectionError: the peer is gone.
            ValueError: an invalid header name or value.
        """
        if self._started:
            raise RuntimeError("stream already started")
        headers = list(self._base_headers)
        headers.append(("Content-Type", content_type))
        headers.append(("Cache-Control", "no-cache"))
        if self._chunked:
            headers.append(("Transfer-Encoding", "chunked"))
        headers.extend(extra_headers)
        head = format_response_head(status, headers)
        self._started = True
        await self._write(head)

    async def send(self, data: bytes) -> None:
        """Write ``data`` as one chunk and wait until the transport accepts more.

        Empty ``data`` is a no-op (an empty chunk would end the body).

        Raises:
            RuntimeError: not started, or already ended.
            ConnectionError: the peer is gone.
        """
        if not self._started or self._ended:
            raise RuntimeError("send() outside start() ... end()")
        if not data:
            return
        if self._max_backlog is not None:
            self._check_backlog()
        self.bytes_sent += len(data)
        await self._write(format_chunk(data) if self._chunked else data)

    async def send_event(self, data: str) -> None:
        """Shorthand for ``send(sse_event(data))``."""
        await self.send(sse_event(data))

    async def end(self) -> None:
        """Terminate the body with the last chunk (nothing is written when not chunked).

        Raises:
            RuntimeError: not started.
            ConnectionError: the peer is gone.
        """
        if not self._started:
            raise RuntimeError("end() before start()")
        if self._ended:
            return
        self._ended = True
        await self._write(LAST_CHUNK if self._chunked else b"")

    @property
    def backlog(self) -> int:
        """Bytes written to this stream that the client has not read yet (:func:`unsent_bytes`)."""
        return unsent_bytes(self._writer.transport)

    def _check_backlog(self) -> None:
        """Abort the connection when the client has left more than ``max_backlog`` unread."""
        behind = self.backlog
        if behind > self._max_backlog:
            log.info("%s: cut off a client that left %d bytes unread (limit %d)",
                     self._writer.get_extra_info("peername"), behind, self._max_backlog)
            sock = self._writer.get_extra_info("socket")
            try:    # reset: the kernel drops the unread bytes now instead of retrying for minutes
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (AttributeError, OSError):
                pass
            self._writer.transport.abort()
            raise ConnectionAbortedError(
                f"client left {behind} bytes unread (limit {self._max_backlog})")

    async def _write(self, data: bytes) -> None:
        writer = self._writer
        if writer.transport.is_closing():
            raise ConnectionResetError("client connection is closed")
        if data:
            try:
                writer.write(data)
            except RuntimeError as exc:       # uvloop: "unable to perform operation on ..."
                raise ConnectionResetError(str(exc)) from exc
        try:
            if self._write_timeout is None or not _over_high_water(writer.transport):
                await writer.drain()          # returns at once unless writing is paused
            else:
                await asyncio.wait_for(writer.drain(), self._write_timeout)
        except TimeoutError:
            writer.transport.abort()
            raise ConnectionAbortedError(
                f"client did not read for {self._write_timeout:g} s") from None
        except ConnectionError:
            raise
        except OSError as exc:    # the connection was lost with this error (e.g. ssl.SSLError)
            raise ConnectionResetError(f"client connection lost: {exc!r}") from exc


def _over_high_water(transport: asyncio.BaseTransport) -> bool:
    """Whether ``transport``'s write buffer is above its high-water mark (drain will wait)."""
    try:
        return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]
    except (AttributeError, NotImplementedError):
        return True
