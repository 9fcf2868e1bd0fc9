"""What the HTTP/1.1 request parser (:mod:`.http`) gives and raises: :class:`RequestHead`,
:class:`Request`, :data:`NEED_DATA` and :class:`HTTPError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

__all__ = ["NEED_DATA", "Event", "HTTPError", "Request", "RequestHead"]


class HTTPError(Exception):
    """A request the server cannot accept; answer with ``status`` and close the connection.

    Attributes:
        status: HTTP status code to answer with (400, 408, 413, 414, 417, 431, 501, 505).
        message: Human-readable reason, safe to show to the client (never contains input
            bytes beyond a short, printable excerpt).
        limit: For 413, the body limit the request went over, in bytes; else ``None``.
        request_line: ``(method, request-target)`` when the request-line was read before the
            error (for the access record); else ``None``.
        body_length: For a refused head whose fields and framing were valid, the length of
            the ``Content-Length`` body it declares (0: none); else ``None``.
    """

    def __init__(self, status: int, message: str, limit: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.limit = limit
        self.request_line: tuple[str, str] | None = None
        self.body_length: int | None = None

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
