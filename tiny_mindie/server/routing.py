"""Routes: (method, path template, plane) -> handler, and the dispatch of a request to one (404
when no route has its path, 405 when none of those has its method), with one
:class:`RequestRecord` per request. No knowledge of any API family: they bring their routes,
the JSON body of an error, and errors derived from :class:`RouteError`.

The record of a request holds its id, route, timings, token counts and one outcome word
(:data:`OUTCOMES`): ``success``, or why it did not succeed -- ``validation`` (refused: the
request itself is wrong, e.g. 404, 405, 422), ``too_long`` (424), ``timeout`` (a time limit),
``cancelled`` (the client left, asked for the generation to stop, or was cut off for not
reading, before its answer was delivered), ``stopped`` (the service stopped it: a 503 while
stopping or loading, a stream cut by the drain, a handler cancelled at the server's exit) or
``internal`` (a server bug). The router hands each request's record to its handler as the
response stream's ``record``; the handler reports what it knows there
(:meth:`RequestRecord.report`: the first failure wins over success) and adds its token
counts; the router adds what it sees (the client gone, the task cancelled, an exception).
The same word is the request's ``outcome`` in its access record and, on a generation route,
how ``/metrics`` counts it.

The access record (logger ``tiny_mindie.access``, level INFO) is written when the request
ends, however it ends -- answered, streamed to its end, or abandoned (the client went away,
was cut off for not reading, or the server cancelled it). Its message is one line, the status
alone when the outcome is ``success``, else followed by the outcome::

    "POST /infer" 200 812.4 ms id=5f0c... prompt_tokens=8 cached_tokens=0 generated_tokens=20
    "POST /infer" 200 cancelled 95.0 ms id=77a1... prompt_tokens=8 cached_tokens=0 ...

A request the HTTP parser refuses (400, 408, 413, 414, 417, 431, 501, 505: it never reaches a
route) gets one too, from :func:`log_refused`, without a duration; its method and target are
``-`` when the request head itself was refused::

    "- -" 400 validation - id=9d2e...

and its structured fields (``extra={"fields": ...}``, written out by ``--log-format json``):
``request_id``, ``method``, ``route`` (the path template, ``None`` when no route matched), ``path``
(without the query), ``status`` (the status sent; ``None`` when none was), ``outcome``,
``prompt_tokens``, ``cached_tokens``, ``generated_tokens`` (summed over the request's
generations: an OpenAI ``n=2`` request counts its prompt twice), ``ttft_ms`` (arrival to the
first generated token, ``None`` without one), ``total_ms``, ``client`` (the subject of the
client's TLS certificate), ``peer``; and with ``Router.log_bodies`` also ``request_body`` and
``output`` (the generated texts).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .conn import Handler, Response, ResponseStream, json_response, json_text
from .http import HTTPError, Request, RequestHead

access = logging.getLogger("tiny_mindie.access")   # one record per request

#: The token counts of an access record, in the order the text line shows them.
TOKEN_COUNTS = ("prompt_tokens", "cached_tokens", "generated_tokens")

#: How a request ended (see the module doc); ``/metrics`` counts the first as
#: ``request_success_total``, the others as ``request_failed_total``'s ``reason``.
SUCCESS, VALIDATION, TOO_LONG, TIMEOUT = "success", "validation", "too_long", "timeout"
CANCELLED, STOPPED, INTERNAL = "cancelled", "stopped", "internal"
OUTCOMES = (SUCCESS, VALIDATION, TOO_LONG, TIMEOUT, CANCELLED, STOPPED, INTERNAL)


@dataclass
class RequestRecord:
    """One request, from its arrival to its end: what its access record shows and how
    ``/metrics`` counts it.

    Attributes:
        request_id: the request's id (``X-Request-Id``).
        t0: ``time.monotonic()`` at its arrival.
        keep_text: keep the generated texts (``Router.log_bodies``).
        route: the matched route's path template; ``None`` when none matched.
        counts: token counts by name (:data:`TOKEN_COUNTS`).
        first_token: ``time.monotonic()`` when its first token was out, or ``None``.
        output: the generated texts (only with ``keep_text``).
        outcome: one of :data:`OUTCOMES`; ``None`` until reported, final once it ended.
        ended: called with the final outcome when the request ends (after its access record).
    """

    request_id: str
    t0: float
    keep_text: bool = False
    route: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    first_token: float | None = None
    output: list[str] = field(default_factory=list)
    outcome: str | None = None
    ended: list[Callable[[str], None]] = field(default_factory=list)

    def report(self, outcome: str) -> None:
        """Note how (a part of) the request ended: the first failure wins over success (a
        request may run several generations, e.g. OpenAI ``n``)."""
        if self.outcome is None or (self.outcome == SUCCESS and outcome != SUCCESS):
            self.outcome = outcome

    def count(self, name: str, n: int) -> None:
        """Add ``n`` to the count ``name`` (one of :data:`TOKEN_COUNTS`, e.g.
        ``cached_tokens``: prompt tokens served from the prefix cache, summed over the
        request's generations)."""
        self.counts[name] = self.counts.get(name, 0) + n

    def first_token_out(self) -> None:
        """Note that the request's first token is out (``ttft_ms``); later calls change
        nothing."""
        if self.first_token is None:
            self.first_token = time.monotonic()

    def keep_output(self, text: str) -> None:
        """Keep a generated ``text`` for the access record (only with :attr:`keep_text`)."""
        if self.keep_text:
            self.output.append(text)


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

    Attributes:
        log_bodies: put each request's body and generated text in its access record (a debug
            setting: they may hold personal data); off by default.
    """

    def __init__(self, routes: Sequence[Route], error_body: ErrorBody):
        self.routes = list(routes)
        self.error_body = error_body
        self.log_bodies = False

    def handler_for(self, planes: frozenset[str], *,
                    max_backlog_bytes: int | None = None) -> Handler:
        """The connection handler of a listener that serves ``planes``: dispatch, and one
        :class:`RequestRecord` per request, its access record written when it ends.
        ``max_backlog_bytes`` caps the unsent bytes of a stream (``None``: no cap)."""
        routes = [r for r in self.routes if r.plane in planes]
        error_body = self.error_body

        async def handle(req: Request, stream: ResponseStream) -> Response | None:
            rec = RequestRecord(stream.request_id, time.monotonic(), keep_text=self.log_bodies)
            stream.max_backlog = max_backlog_bytes
            stream.record = rec
            resp, seen = None, INTERNAL      # an exception nobody expected: a bug
            try:
                resp = await _dispatch(routes, error_body, rec, req, stream)
                # None without a stream: the handler gave up because the client left
                gone = not stream.started and (resp is None or stream.peer_gone())
                seen = CANCELLED if gone else SUCCESS
                return resp
            except ConnectionError:   # reset, closed, or cut off for not reading
                seen = CANCELLED
                raise
            except asyncio.CancelledError:
                seen = rec.outcome = STOPPED     # the server's doing, whatever was reported
                raise
            finally:
                _end(req, stream, rec, resp, seen)

        return handle


async def _dispatch(routes: list[Route], error_body: ErrorBody, rec: RequestRecord,
                    req: Request, stream: ResponseStream) -> Response | None:
    """The answer of the route ``req`` is for: 404 or 405 when there is none, a handler's
    :class:`RouteError` answered (or, once a stream has started, sent as its last event)."""
    found = [(r, p) for r in routes if (p := r.match(req.path)) is not None]
    if not found:
        rec.report(VALIDATION)
        return json_response(404, error_body(404, f"Route {req.path} not found"))
    method = "GET" if req.method == "HEAD" else req.method   # HEAD: GET without the body
    chosen = next(((r, p) for r, p in found if r.method == method), None)
    if chosen is None:
        allow = ", ".join(sorted({r.method for r, _ in found}))
        rec.report(VALIDATION)
        return json_response(405, error_body(
            405, f"Method {req.method} is not allowed for {req.path}; use {allow}"),
            [("Allow", allow)])
    route, params = chosen
    rec.route = route.path
    try:
        return await route.handler(req, stream, params)
    except RouteError as err:
        if stream.started:   # the status line is gone: tell the client in the stream
            await stream.chunked_stream.send_event(json_text(err.body()))
            await stream.chunked_stream.end()
            return None
        return json_response(err.status, err.body(), err.headers)


def _end(req: Request, stream: ResponseStream, rec: RequestRecord, resp: Response | None,
         seen: str) -> None:
    """The request ended: ``seen`` (what the router saw) joins the outcome the handler
    reported; then its access record, then the record's :attr:`~RequestRecord.ended`."""
    rec.report(seen)
    status = resp.status if resp is not None else stream.status
    if status is None and seen == INTERNAL:
        status = 500              # what serve_connection answers for a bug
    _log_access(rec, status, req, stream.client_subject, stream.peer)
    for ended in rec.ended:
        ended(rec.outcome)


def log_refused(exc: HTTPError, head: RequestHead | None, *, request_id: str,
                peer: str | None, client: str | None) -> None:
    """Write the access record of a request the HTTP parser refused (``ErrorAnswers.refused``
    of :mod:`.conn`): outcome ``timeout`` for a 408, else ``validation``; ``method`` and
    ``path`` are its head's, or its request-line's when the header fields were refused
    (``None`` when not even the request-line was read); ``total_ms`` is
    ``None``, as the parser does not time a request."""
    rec = RequestRecord(request_id, math.nan)
    rec.outcome = TIMEOUT if exc.status == 408 else VALIDATION
    if head is None and exc.request_line is not None:     # the request-line was read
        method, target = exc.request_line
        head = _RequestLine(method, target, target.partition("?")[0])
    _log_access(rec, exc.status, head, client, peer)


class _RequestLine(NamedTuple):
    """What an access record shows of a request refused after its request-line was read."""

    method: str
    target: str
    path: str


def _log_access(rec: RequestRecord, status: int | None,
                req: Request | RequestHead | _RequestLine | None,
                client: str | None, peer: str | None) -> None:
    """Write the access record of a request that ended (see the module doc)."""
    total_ms = (time.monotonic() - rec.t0) * 1000     # NaN for a refused request
    fields = {"request_id": rec.request_id, "method": req and req.method, "route": rec.route,
              "path": req and req.path[:200], "status": status, "outcome": rec.outcome,
              **{k: rec.counts.get(k, 0) for k in TOKEN_COUNTS},
              "ttft_ms": None if rec.first_token is None
              else round((rec.first_token - rec.t0) * 1000, 1),
              "total_ms": None if math.isnan(total_ms) else round(total_ms, 1),
              "client": client, "peer": peer}
    if rec.keep_text and isinstance(req, Request):
        fields["request_body"] = req.body.decode("utf-8", "replace")
        fields["output"] = rec.output
    shown = status if rec.outcome == SUCCESS else f"{status or '-'} {rec.outcome}"
    took = "-" if math.isnan(total_ms) else f"{total_ms:.1f} ms"
    counts = "".join(f" {k}={rec.counts[k]}" for k in TOKEN_COUNTS if k in rec.counts)
    access.info('"%s %s" %s %s id=%s%s', req.method if req else "-",
                req.target[:200] if req else "-", shown, took, rec.request_id, counts,
                extra={"fields": fields})
