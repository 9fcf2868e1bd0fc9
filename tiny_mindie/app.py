"""The application: configuration, the loaded model and the route tables of the API families,
wired to the HTTP server of :mod:`tiny_mindie.server` (which knows none of them).

Routes belong to a plane -- business (inference), management (health, status) or metrics --
and each plane listens on its configured address and port; planes with the same port share one
listener. Every listener speaks HTTP/1.1 over mutual TLS (or plain TCP with ``--no-tls``); how
connections are accepted and counted is :mod:`tiny_mindie.server.listen`'s.
"""

from __future__ import annotations

import ssl

from .api import manage, metrics, native, openai, tgi, triton
from .api.errors import error_body
from .config import Config
from .llm import LLM
from .server import listen
from .server.conn import Handler, json_response
from .server.listen import Listener, bind, connection_limit
from .server.routing import BUSINESS, MANAGEMENT, METRICS, Route, Router


class App:
    """The route table of one server and the dispatch of each request.

    Args:
        llm: the loaded model and engine every API family drives.
        cfg: the server's configuration.
    """

    def __init__(self, llm: LLM, cfg: Config):
        self.llm = llm
        self.cfg = cfg
        #: Connections open at once: maxLinkNum, or less when the open files limit is lower
        #: (set by :func:`start_listeners`).
        self.max_link_num = cfg.server.max_link_num
        # Each API family contributes its routes: ``module.routes(app) -> list[Route]``; those
        # that generate (``Route.generation``) are counted in /metrics.
        self.routes: list[Route] = metrics.count_requests(
            [r for family in (native, manage, metrics, tgi, triton, openai)
             for r in family.routes(self)], llm.engine.metrics)
        self.router = Router(self.routes, error_body)

    def handler_for(self, planes: frozenset[str]) -> Handler:
        """The connection handler of a listener that serves ``planes``."""
        backlog_kb = self.cfg.server.max_stream_backlog_kb
        return self.router.handler_for(
            planes, max_backlog_bytes=backlog_kb * 1024 if backlog_kb else None)


def plan_listeners(cfg: Config) -> list[Listener]:
    """Group the planes by port: equal ports share one listener (MindIE's rule)."""
    s = cfg.server
    wanted = [(BUSINESS, s.ip_address, s.port),
              (MANAGEMENT, s.management_ip_address, s.management_port),
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
        AddressError: a listen address cannot be resolved.
        OSError: the address is in use or not available on this machine.
    """
    for lst in plan_listeners(cfg):
        for sock in bind(lst.host, lst.port, backlog=1):
            sock.close()


async def start_listeners(app: App, cfg: Config, ssl_ctx: ssl.SSLContext | None) -> list[Listener]:
    """Bind every listener and start accepting; returns them with their bound ports.

    At most ``maxLinkNum`` connections are open at once, counted from ``accept()`` (TLS
    handshakes included) and capped by the open files limit, which is first raised to its hard
    limit; a TLS handshake has ``tlsHandshakeTimeout`` seconds. See :mod:`.server.listen` for who
    is closed when the slots are full. Without TLS, a connection beyond the limit gets a 503 JSON
    answer at once, before its request is read, and is closed (MindIE drops it silently).
    ``app.max_link_num`` is set to the limit in force.

    Raises:
        AddressError: an address cannot be resolved.
        OSError: an address is in use or cannot be bound.
    """
    s = cfg.server
    limits = listen.Limits(max_connections=connection_limit(s.max_link_num),
                           max_body_bytes=s.max_request_length * 1024 * 1024,
                           handshake_timeout=s.tls_handshake_timeout)
    app.max_link_num = limits.max_connections
    busy = json_response(503, error_body(503, "Too many connections, try again later."))
    return await listen.start_listeners(plan_listeners(cfg), app.handler_for, limits, ssl_ctx, busy)
