"""Listeners and routing: (method, path) -> handler, for MindIE's route groups (spec §1).

Routes belong to a plane -- business (inference), management (health, status) or metrics --
and each plane listens on its configured address and port; planes with the same port share one
listener. Every listener speaks HTTP/1.1 over mutual TLS (or plain TCP with ``--no-tls``); how
connections are accepted and counted is :mod:`.listen`'s.
"""

from __future__ import annotations

import email.utils
import json
import logging
import ssl
import time
from dataclasses import dataclass

from ..api.errors import APIError
from ..config import Config
from ..llm import LLM
from .conn import Response, ResponseStream, json_response, serve_connection
from .http import Request, format_response
from .listen import (
    LISTEN_BACKLOG,
    ConnectionSlots,
    RefusalLogs,
    TCPListener,
    bind,
    connection_limit,
)
from .routing import BUSINESS, MANAGEMENT, METRICS, Route

log = logging.getLogger("tiny_mindie.server")
access = logging.getLogger("tiny_mindie.access")   # one line per request

class App:
    """The route table of one server and the dispatch of each request.

    Args:
        llm: the loaded model and engine every API family drives.
        cfg: the server's configuration.
    """

    def __init__(self, llm: LLM, cfg: Config):
        from ..api import manage, metrics, native, openai, tgi, triton

        self.llm = llm
        self.cfg = cfg
        #: Connections open at once: maxLinkNum, or less when the open files limit is lower
        #: (set by :func:`start_listeners`).
        self.max_link_num = cfg.server.max_link_num
        # Each API family contributes its routes: ``module.routes(app) -> list[Route]``.
        self.routes: list[Route] = metrics.count_requests(
            [r for family in (native, manage, metrics, tgi, triton, openai) for r in family.routes(self)], llm.engine.metrics)

    def handler_for(self, planes: frozenset[str]):
        """The connection handler of a listener that serves ``planes``."""
        routes = [r for r in self.routes if r.plane in planes]
        backlog_kb = self.cfg.server.max_stream_backlog_kb

        async def handle(req: Request, stream: ResponseStream) -> Response | None:
            t0 = time.monotonic()
            stream.max_backlog = backlog_kb * 1024 if backlog_kb else None
            resp = await dispatch(req, stream)
            status = resp.status if resp is not None else ("stream" if stream.started else "gone")
            access.info('"%s %s" %s %.1f ms', req.method, req.target[:200], status,
                        (time.monotonic() - t0) * 1000)
            return resp

        async def dispatch(req: Request, stream: ResponseStream) -> Response | None:
            found = [(r, p) for r in routes if (p := r.match(req.path)) is not None]
            if not found:
                return json_response(404, APIError(404, f"Route {req.path} not found").body())
            method = "GET" if req.method == "HEAD" else req.method   # HEAD: GET without the body
            chosen = next(((r, p) for r, p in found if r.method == method), None)
            if chosen is None:
                allow = ", ".join(sorted({r.method for r, _ in found}))
                return json_response(405, APIError(
                    405, f"Method {req.method} is not allowed for {req.path}; use {allow}").body(),
                    [("Allow", allow)])
            route, params = chosen
            try:
                return await route.handler(req, stream, params)
            except APIError as err:
                if stream.started:   # the status line is gone: tell the client in the stream
                    await stream.chunked_stream.send_event(json.dumps(err.body(), ensure_ascii=False))
                    await stream.chunked_stream.end()
                    return None
                return json_response(err.status, err.body(), err.headers)

        return handle


@dataclass
class Listener:
    """One listening address: which planes it serves, where, and whether over TLS."""

    host: str
    port: int
    planes: frozenset[str]
    server: TCPListener | None = None

    @property
    def bound_port(self) -> int:
        return self.server.sockets[0].getsockname()[1] if self.server else self.port

    @property
    def bound_addresses(self) -> list[str]:
        """The addresses its sockets are bound to (a host name resolves to one or more)."""
        return [sock.getsockname()[0] for sock in self.server.sockets] if self.server else []


def plan_listeners(cfg: Config) -> list[Listener]:
    """Group the planes by port: equal ports share one listener (MindIE's rule)."""
    s = cfg.server
    wanted = [(BUSINESS, s.ip_address, s.port), (MANAGEMENT, s.management_ip_address, s.management_port),
              (METRICS, s.management_ip_address, s.metrics_port)]
    by_port: dict[int, Listener] = {}
    for plane, host, port in wanted:
        if port in by_port:
            by_port[port].planes = by_port[port].planes | {plane}
        else:
            by_port[port] = Listener(host, port, frozenset({plane}))
    return list(by_port.values())


def check_ports_free(cfg: Config) -> None:
    """Fail fast, before the slow model load, when a listen address cannot be bound.

    Raises:
        ConfigError: a listen address cannot be resolved.
        OSError: the address is in use or not available on this machine.
    """
    for lst in plan_listeners(cfg):
        for sock in bind(lst.host, lst.port, backlog=1):
            sock.close()


async def start_listeners(app: App, cfg: Config, ssl_ctx: ssl.SSLContext | None) -> list[Listener]:
    """Bind every listener and start accepting; returns them with their bound ports.

    At most ``maxLinkNum`` connections are open at once, counted from ``accept()`` (TLS
    handshakes included) and capped by the open files limit, which is first raised to its hard
    limit; a TLS handshake has ``tlsHandshakeTimeout`` seconds. See :mod:`.listen` for who is
    closed when the slots are full. Without TLS, a connection beyond the limit gets a 503 JSON
    answer at once, before its request is read, and is closed (MindIE drops it silently).
    ``app.max_link_num`` is set to the limit in force.

    Raises:
        OSError: an address is in use or cannot be bound.
    """
    s = cfg.server
    max_body = s.max_request_length * 1024 * 1024
    slots = ConnectionSlots(connection_limit(s.max_link_num))
    app.max_link_num = slots.limit
    logs = RefusalLogs()
    busy = json_response(503, APIError(503, "Too many connections, try again later.").body())

    def busy_answer() -> bytes:
        return format_response(503, [("Date", email.utils.formatdate(usegmt=True)),
                                     ("Server", "tiny_mindie"), ("Content-Type", busy.content_type),
                                     ("Connection", "close")], busy.body)

    listeners = plan_listeners(cfg)
    try:
        for lst in listeners:
            handle = app.handler_for(lst.planes)

            async def serve(reader, writer, handle=handle) -> None:
                await serve_connection(reader, writer, handle, max_body_bytes=max_body)

            lst.server = TCPListener(bind(lst.host, lst.port, backlog=LISTEN_BACKLOG),
                                     serve, busy_answer, slots=slots, ssl_ctx=ssl_ctx,
                                     handshake_timeout=s.tls_handshake_timeout, logs=logs)
    except BaseException:
        for lst in listeners:
            if lst.server:
                lst.server.close()
        raise
    return listeners
