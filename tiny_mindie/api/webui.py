"""The chat page: ``GET /`` on the business plane (unless ``ServerConfig.webUI`` is false,
``--no-webui``), one self-contained HTML file (``webui.html``, shipped as package data) whose
script talks to ``/v1/chat/completions`` of the same origin.

The page is served while the model loads (its requests then show the 503 the API answers). Its
``Content-Security-Policy`` allows the page's own inline script and style by their SHA-256
hashes and connections to its own origin only; nothing is loaded from another host, and the
script writes the model's text as text (``textContent``), never as HTML.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources

from ..server.conn import Response
from ..server.routing import BUSINESS, Route

PAGE = "webui.html"


@functools.lru_cache(maxsize=1)
def page() -> tuple[bytes, str]:
    """The page's bytes and its ``Content-Security-Policy`` value.

    Raises:
        OSError: the page is not installed with the package.
        ValueError: the page has not exactly one inline ``<script>`` and one ``<style>``.
    """
    html = importlib.resources.files(__package__).joinpath(PAGE).read_bytes()
    sources = {tag: _inline(html, tag) for tag in ("script", "style")}
    hashes = {tag: "'sha256-" + base64.b64encode(hashlib.sha256(src).digest()).decode() + "'"
              for tag, src in sources.items()}
    policy = (f"default-src 'self'; script-src {hashes['script']}; "
              f"style-src {hashes['style']}; connect-src 'self'; img-src 'self' data:; "
              "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html, policy


def _inline(html: bytes, tag: str) -> bytes:
    """The text between the page's one ``<tag>`` and ``</tag>`` (what a CSP hash covers)."""
    opening, closing = f"<{tag}>".encode(), f"</{tag}>".encode()
    if html.count(opening) != 1 or html.count(closing) != 1:
        raise ValueError(f"{PAGE} must hold exactly one {opening.decode()}")
    return html[html.index(opening) + len(opening):html.index(closing)]


def routes(app) -> list[Route]:
    """``GET /``: the page, with its security headers; none when ``webui`` is off."""
    if not app.cfg.server.webui:
        return []

    async def chat_page(req, stream, params) -> Response:
        html, policy = page()
        return Response(200, html, "text/html; charset=utf-8", [
            ("Content-Security-Policy", policy), ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"), ("X-Frame-Options", "DENY"),
            ("Cache-Control", "no-cache")])

    return [Route("GET", "/", BUSINESS, chat_page, needs_model=False)]
