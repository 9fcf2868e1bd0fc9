"""Routes: (method, path template, plane) -> handler, and the dispatch of a request to one (404
when no route has its path, 405 when none of those has its method). No knowledge of any API
family: they bring their routes, the JSON body of an error, and errors derived from
:class:`RouteError`.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from .conn import Handler, Response, ResponseStream, json_response, json_text
from .http import Request

access = logging.getLogger("tiny_mindie.access")   # one line per request

# Counts the handler of the request being handled adds to its access line (``name=value``), in a
# mutable dict so the tasks a handler starts (which get a copy of the context) add to it too.
_access_counts: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "tiny_mindie_access_counts", default=None)


def count_in_access_log(name: str, n: int) -> None:
    """Add ``n`` to the count ``name`` shown as ``name=N`` at the end of the current request's
    access log line (e.g. ``cached``: prompt tokens served from the prefix cache, summed over
    the request's generations); nothing outside a request."""
    counts = _access_counts.get()
    if counts is not None:
        counts[name] = counts.get(name, 0) + n

# The planes of spec §1: each listens on its own port unless the ports are equal; and
# tiny_mindie's plain-HTTP health listener (health routes only, ``ServerConfig.healthPort``).
BUSINESS, MANAGEMENT, METRICS, HEALTH = "business", "management", "metrics", "health"

# handler(request, stream, path parameters such as {"model": "..."})
RouteHandler = Callable[[Request, ResponseStream, dict], Awaitable[Response | None]]

# error_body(status, message) -> the JSON body of an error answer
ErrorBody = Callable[[int, str], dict]


class RouteError(Exception):
    """Raised by a route handler to answer with an error: ``status``, the JSON ``body()`` and
    extra ``headers``; once a stream has started, ``body()`` is sent as its last event."""

    status: int
    headers: list

    def body(self) -> dict:
        raise NotImplementedError


@dataclass(frozen=True)
class Route:
    """``path`` may hold ``{name}`` segments, matched by any one non-empty path segment;
    ``generation`` marks a route that runs generations (its requests are counted in
    ``/metrics``); ``style`` is how the route's family writes its errors (opaque here: the API
    layer's; ``None`` for the default); ``needs_model`` is false for the few routes that answer
    while the model is still loading (liveness and readiness)."""

    method: str
    path: str
    plane: str
    handler: RouteHandler
    generation: bool = False
    style: object = None
    needs_model: bool = True

    def match(self, path: str) -> dict | None:
        """The path parameters when ``path`` fits this route's template, else ``None``."""
        want, got = self.path.split("/"), path.split("/")
        if len(want) != len(got):
            return None
        params = {}
        for w, g in zip(want, got, strict=True):
            if w.startswith("{") and w.endswith("}"):
                if not g:
                    return None
                params[w[1:-1]] = g
            elif w != g:
                return None
        return params


class Router:
    """The route table of one server and the dispatch of each request.

    Args:
        routes: every route of every plane.
        error_body: the JSON body of the 404 and 405 answers, from (status, message).
    """

    def __init__(self, routes: Sequence[Route], error_body: ErrorBody):
        self.routes = list(routes)
        self.error_body = error_body

    def handler_for(self, planes: frozenset[str], *,
                    max_backlog_bytes: int | None = None) -> Handler:
        """The connection handler of a listener that serves ``planes``: dispatch, and one access
        log line per request. ``max_backlog_bytes`` caps the unsent bytes of a stream (``None``:
        no cap)."""
        routes = [r for r in self.routes if r.plane in planes]
        error_body = self.error_body

        async def handle(req: Request, stream: ResponseStream) -> Response | None:
            t0 = time.monotonic()
            stream.max_backlog = max_backlog_bytes
            counts: dict[str, int] = {}
            token = _access_counts.set(counts)
            try:
                resp = await dispatch(req, stream)
            finally:
                _access_counts.reset(token)
            status = resp.status if resp is not None else ("stream" if stream.started else "gone")
            extra = "".join(f" {k}={v}" for k, v in counts.items())
            access.info('"%s %s" %s %.1f ms%s', req.method, req.target[:200], status,
                        (time.monotonic() - t0) * 1000, extra)
            return resp

        async def dispatch(req: Request, stream: ResponseStream) -> Response | None:
            found = [(r, p) for r in routes if (p := r.match(req.path)) is not None]
            if not found:
                return json_response(404, error_body(404, f"Route {req.path} not found"))
            method = "GET" if req.method == "HEAD" else req.method   # HEAD: GET without the body
            chosen = next(((r, p) for r, p in found if r.method == method), None)
            if chosen is None:
                allow = ", ".join(sorted({r.method for r, _ in found}))
                return json_response(405, error_body(
                    405, f"Method {req.method} is not allowed for {req.path}; use {allow}"),
                    [("Allow", allow)])
            route, params = chosen
            try:
                return await route.handler(req, stream, params)
            except RouteError as err:
                if stream.started:   # the status line is gone: tell the client in the stream
                    await stream.chunked_stream.send_event(json_text(err.body()))
                    await stream.chunked_stream.end()
                    return None
                return json_response(err.status, err.body(), err.headers)

        return handle
