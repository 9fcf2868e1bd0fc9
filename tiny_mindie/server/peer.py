"""Who is on the other end of a connection, and the id of its request: :func:`request_id`,
:func:`peer_address`, :func:`peer_subject`.
"""

from __future__ import annotations

import asyncio
import re
import uuid

from .http_message import Request, RequestHead

__all__ = ["peer_address", "peer_subject", "request_id"]

_SANE_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")


def request_id(request: Request | RequestHead | None) -> str:
    """The id of ``request``: its ``X-Request-Id`` header when that is 1-128 visible ASCII
    characters (so a proxy's id carries through), else a new random one (32 hex digits)."""
    given = request.header("x-request-id") if request is not None else None
    if given is not None and _SANE_REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


def peer_subject(writer: asyncio.StreamWriter) -> str | None:
    """The subject of the client's TLS certificate as an RFC 4514 string (``CN=client,O=...``),
    or ``None`` without TLS or without a client certificate."""
    tls = writer.get_extra_info("ssl_object")
    der = tls.getpeercert(binary_form=True) if tls is not None else None
    if not der:
        return None
    from cryptography import x509
    try:
        return x509.load_der_x509_certificate(der).subject.rfc4514_string()
    except ValueError:          # a certificate the TLS layer accepted but cryptography cannot read
        return None


def peer_address(peername) -> str | None:
    """``host:port`` (``[v6]:port``) of a socket address; ``None`` when unknown."""
    if not isinstance(peername, tuple) or len(peername) < 2:
        return None
    host, port = peername[0], peername[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
