"""HTTP/1.1 responses as bytes, sans-IO (RFC 9110 / RFC 9112): :func:`format_response_head`,
:func:`format_response`, :func:`format_chunk`, :func:`reason_phrase`, and the constants
:data:`LAST_CHUNK` and :data:`CONTINUE_100`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from http import HTTPStatus
from typing import Final

from .http_head import TOKEN

__all__ = ["CONTINUE_100", "LAST_CHUNK", "format_chunk", "format_response",
           "format_response_head", "reason_phrase"]

LAST_CHUNK: Final = b"0\r\n\r\n"
"""The terminating zero-size chunk of a chunked body (no trailers)."""

CONTINUE_100: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
"""The interim response telling a client that waits on ``Expect: 100-continue`` to send."""


_RESPONSE_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_RESPONSE_FIELD_NAME = re.compile(TOKEN.decode("ascii"))


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
