"""The request head of HTTP/1.1 (RFC 9110 / RFC 9112), sans-IO: the request-line and the field
lines of a complete header section -> a :class:`~.http_message.RequestHead`, checked for what the
:mod:`.http` parser's docstring lists (Host, body framing, Expect, the request-target's form).

Pure functions; :func:`parse_fields` also reads a chunked body's trailer section.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, unquote

from .http_message import HTTPError, RequestHead

__all__ = ["TOKEN", "excerpt", "parse_fields", "parse_head"]

# --- grammar (RFC 9110 §5.6.2, RFC 9112 §3, §5) ---------------------------------------------

TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
"""A token (RFC 9110 §5.6.2): a method, a field name."""
_REQUEST_LINE = re.compile(rb"(" + TOKEN + rb") ([\x21-\x7e]+) (HTTP/[0-9]+\.[0-9]+)")
_VERSION = re.compile(r"HTTP/([0-9])\.([0-9])")
_FIELD_NAME = re.compile(TOKEN)
_BAD_VALUE_CHAR = re.compile(rb"[^\t\x20-\x7e\x80-\xff]")
_DIGITS = re.compile(r"[0-9]+")
_TOKEN_TEXT = re.compile(TOKEN.decode("ascii"))
_OWS = " \t"      # OWS (RFC 9110 §5.6.3): SP and HTAB only, not str.strip()'s 0x85 or 0xA0

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
_MAX_QUERY_FIELDS = 1000


def excerpt(data: bytes, limit: int = 40) -> str:
    """A short printable rendering of ``data`` for error messages."""
    text = data[:limit].decode("ascii", "backslashreplace")
    return repr(text + ("..." if len(data) > limit else ""))


def parse_head(raw: bytes) -> RequestHead:
    """A complete header section (request-line and field lines, each ended by LF or CRLF,
    without the empty line that ends the section) -> its :class:`RequestHead`.

    Raises:
        HTTPError: 400, 417, 431, 501 or 505, as :meth:`.http.RequestParser.next_event` lists;
            its ``body_length`` set where the fields were read.
    """
    lines = _split_lines(raw)
    method, target, version = _parse_request_line(lines[0])
    fields = None
    try:
        fields = parse_fields(lines[1:], "header")
        return _build_head(method, target, version, fields)
    except HTTPError as exc:
        exc.request_line = (method, target)
        exc.body_length = _body_length(fields, version)
        raise


def _body_length(fields: list[tuple[str, str]] | None, version: str) -> int | None:
    """The ``Content-Length`` body's length of a refused head whose fields and framing are
    valid (0 without a body); ``None`` when unknown (bad fields or framing, or chunked)."""
    if fields is None:
        return None
    try:
        length, chunked = _body_framing(fields, version)
    except HTTPError:
        return None
    return None if chunked else length or 0


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
        raise HTTPError(400, f"Invalid request-line {excerpt(line)}")
    method, target, version = (g.decode("ascii") for g in match.groups())
    vmatch = _VERSION.fullmatch(version)
    if vmatch is None or vmatch.group(1) != "1" or vmatch.group(2) not in ("0", "1"):
        exc = HTTPError(505, f"HTTP version not supported: {excerpt(match.group(3), 16)}")
        exc.request_line = (method, target)
        raise exc
    return method, target, version


def parse_fields(lines: Iterable[bytes], what: str) -> list[tuple[str, str]]:
    """Field lines -> ``[(lower-cased name, stripped value)]``; 400/431 on bad input."""
    fields = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            raise HTTPError(400, f"Obsolete line folding in {what} section")
        name, colon, value = line.partition(b":")
        if not colon or not _FIELD_NAME.fullmatch(name):
            raise HTTPError(400, f"Invalid {what} field {excerpt(line)}")
        value = value.strip(b" \t")
        if _BAD_VALUE_CHAR.search(value):
            raise HTTPError(400, f"Invalid character in {what} field {excerpt(name)}")
        fields.append((name.decode("ascii").lower(), value.decode("latin-1")))
        if len(fields) > _MAX_HEADERS:
            raise HTTPError(431, f"Too many {what} fields (more than {_MAX_HEADERS})")
    return fields


def _comma_list(headers: list[tuple[str, str]], name: str) -> list[str]:
    """All comma-separated, lower-cased, non-empty members of header ``name``, OWS trimmed."""
    return [item.strip(_OWS).lower() for n, v in headers if n == name
            for item in v.split(",") if item.strip(_OWS)]



def _build_head(method: str, target: str, version: str,
                headers: list[tuple[str, str]]) -> RequestHead:
    """Validate framing headers and decode the target into a :class:`RequestHead`."""
    _check_host(headers, version)
    content_length, chunked = _body_framing(headers, version)

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
        raise HTTPError(417, f"Unsupported expectation {excerpt(unmet[0].encode('latin-1'))}; "
                             "only 100-continue is supported")
    has_body = chunked or bool(content_length)
    expects_continue = version == "HTTP/1.1" and has_body and bool(expectations)

    path, query = _split_target(method, target)
    return RequestHead(method=method, target=target, path=path, query=query, version=version,
                       headers=headers, keep_alive=keep_alive, expects_continue=expects_continue,
                       content_length=content_length, chunked=chunked)


def _check_host(headers: list[tuple[str, str]], version: str) -> None:
    """Host (RFC 9112 §3.2): required in HTTP/1.1, at most one, uri-host [":" port] or empty."""
    hosts = [v for n, v in headers if n == "host"]
    if len(hosts) > 1:
        raise HTTPError(400, "Multiple Host headers")
    if not hosts and version == "HTTP/1.1":
        raise HTTPError(400, "Missing Host header (required in HTTP/1.1)")
    if hosts and hosts[0] and not _is_host(hosts[0], _HOST_PORT):
        raise HTTPError(400, "Invalid Host header")


def _body_framing(headers: list[tuple[str, str]], version: str) -> tuple[int | None, bool]:
    """Body framing (RFC 9112 §6): ``(Content-Length or None, chunked)``."""
    te_codings = _comma_list(headers, "transfer-encoding")
    has_te = any(n == "transfer-encoding" for n, _ in headers)
    cl_values = [v.strip(_OWS) for n, v in headers if n == "content-length" for v in v.split(",")]
    if has_te and cl_values:
        raise HTTPError(400, "Both Content-Length and Transfer-Encoding present")
    if has_te:
        if version == "HTTP/1.0":
            raise HTTPError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if te_codings == ["chunked"]:
            return None, True
        if not te_codings:
            raise HTTPError(400, "Empty Transfer-Encoding")
        if not all(_TOKEN_TEXT.fullmatch(c.partition(";")[0].rstrip(_OWS)) for c in te_codings):
            raise HTTPError(400, "Invalid Transfer-Encoding")
        if "chunked" in te_codings and (te_codings[-1] != "chunked"
                                        or te_codings.count("chunked") > 1):
            raise HTTPError(400, "Transfer-Encoding must apply chunked once, last")
        codings = ", ".join(te_codings).encode("latin-1")
        raise HTTPError(501, f"Unsupported Transfer-Encoding {excerpt(codings)}; "
                             "only chunked is supported")
    if not cl_values:
        return None, False
    if len(set(cl_values)) != 1 or not _DIGITS.fullmatch(cl_values[0]):
        raise HTTPError(400, "Invalid Content-Length")
    if len(cl_values[0]) > 18:
        return 10**18, False               # far over any limit: answered with 413
    return int(cl_values[0]), False


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
                                 + excerpt(target.encode()))
        if not rest.startswith("/"):
            rest = "/" + rest                   # "http://h" and "http://h?q" mean path "/"
    elif method == "CONNECT":                   # authority-form
        if not _is_host(target, _AUTHORITY_FORM):
            raise HTTPError(400, "Invalid authority-form request-target "
                                 + excerpt(target.encode()))
        return "", {}
    else:
        raise HTTPError(400, f"Invalid request-target {excerpt(target.encode())}")
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

