"""Routes: (method, path template, plane) -> handler. No knowledge of any API family."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .conn import Response, ResponseStream
from .http import Request

# The planes of spec §1: each listens on its own port unless the ports are equal.
BUSINESS, MANAGEMENT, METRICS = "business", "management", "metrics"

# handler(request, stream, path parameters such as {"model": "..."})
RouteHandler = Callable[[Request, ResponseStream, dict], Awaitable[Response | None]]

BUSINESS, MANAGEMENT, METRICS = "business", "management", "metrics"


@dataclass(frozen=True)
class Route:
    """``path`` may hold ``{name}`` segments, matched by any one non-empty path segment."""

    method: str
    path: str
    plane: str
    handler: RouteHandler

    def match(self, path: str) -> dict | None:
        """The path parameters when ``path`` fits this route's template, else ``None``."""
        want, got = self.path.split("/"), path.split("/")
        if len(want) != len(got):
            return None
        params = {}
        for w, g in zip(want, got):
            if w.startswith("{") and w.endswith("}"):
                if not g:
                    return None
                params[w[1:-1]] = g
            elif w != g:
                return None
        return params
