"""The application: configuration, the loaded model and the route tables of the API families,
wired to the HTTP server of :mod:`tiny_mindie.server` (which knows none of them).

Routes belong to a plane -- business (inference), management (health, status) or metrics --
and each plane listens on its configured address and port; planes with the same port share one
listener. Every listener speaks HTTP/1.1 over mutual TLS (or plain TCP with ``--no-tls``); how
connections are accepted and counted is :mod:`tiny_mindie.server.listen`'s. An optional fourth
listener (``ServerConfig.healthPort``) serves the health routes only, over plain HTTP.

The listeners start before the model is loaded (or pulled): until :meth:`App.loaded`, the app
is *loading* (:class:`Loading`) and every route but the health ones answers 503 with what the
load is doing, in its family's error style: :meth:`App.refusal`, which the one route wrapper
(:func:`tiny_mindie.api.drive.serve`) asks before each handler, so that handlers never see an
app without a model. That wrapper also counts the generation routes' requests in
:attr:`App.requests` (``/metrics``) and answers every error in its family's style.
"""

from __future__ import annotations

import dataclasses
import ssl

from ..api import (
    anthropic,
    embeddings,
    manage,
    metrics,
    mindie,
    tgi,
    tokenize,
    triton,
    webui,
)
from ..api.drive import serve
from ..api.errors import APIError, Kind, error_body
from ..api.openai import responses
from ..api.openai import routes as openai
from ..api.server_errors import answers
from ..config.load import Config
from ..llm import LLM
from ..server import listen
from ..server.conn import Handler, json_response
from ..server.listen import Listener, bind, connection_limit
from ..server.routing import BUSINESS, HEALTH, MANAGEMENT, METRICS, Route, Router
from .shutdown import ShutdownControl

#: What the plain-HTTP health listener serves (GET only), and its connections at once.
HEALTH_PATHS = ("/health", "/v2/health/live", "/v2/health/ready")
HEALTH_CONNECTIONS = 64
#: What a server of an embedding model alone (no chat model) serves; its other routes answer
#: 404 in their family's error style.
WITHOUT_CHAT = frozenset({*HEALTH_PATHS, "/v2/models/{model}/ready", "/stopService",
                          "/v1/models", "/v1/models/{model}", "/metrics", *embeddings.PATHS})


class Loading:
    """The model being pulled or loaded: the load's progress, for the 503s.

    :meth:`log` is the load's ``log`` callback (``LLM(log=...)``, which the pull shares): a line
    starting in its first column names a step (``pulling ...``, ``loading ...``), an indented
    line is progress within it (``  50%``, ``  41 MB of 98 MB``); each is passed on to ``echo``.
    Called from the loading thread; read on the event loop (str assignments are atomic).
    """

    def __init__(self, echo=None):
        self.step = ""
        self.progress = ""
        self.echo = echo

    def log(self, line: str) -> None:
        text = " ".join(line.split())
        if text and line[:1].isspace():
            self.progress = text
        elif text:
            self.step, self.progress = text, ""
        if self.echo is not None:
            self.echo(line)

    @property
    def message(self) -> str:
        """``The model is loading: <step>[: <progress>]``."""
        said = ": ".join(filter(None, (self.step, self.progress)))
        return "The model is loading" + (f": {said}" if said else ".")


class App:
    """The route table of one server and the dispatch of each request.

    Args:
        cfg: the server's configuration.
        llm: the loaded model and engine every API family drives; ``None`` while it loads
            (then :attr:`loading` holds its progress until :meth:`loaded` is called).
        shutdown: the server's stop control (the serve loop's), which ``/stopService`` asks
            and the readiness routes read.
        echo: where the load's progress lines go besides :attr:`loading`.
        embedder: the embedding model's batching thread
            (:class:`~.engine.embedder.Embedder`), when ``llm`` is given; ``None``: none.
    """

    def __init__(self, cfg: Config, llm: LLM | None = None, *, shutdown: ShutdownControl,
                 echo=None, embedder=None):
        self._llm = llm
        self.embedder = embedder
        self.cfg = cfg
        self.shutdown = shutdown
        #: The load in progress, or ``None`` once the models are in.
        self.loading: Loading | None = Loading(echo) if llm is None else None
        #: Connections open at once: maxLinkNum, or less when the open files limit is lower
        #: (set by :func:`start_configured_listeners`).
        self.max_link_num = cfg.server.max_link_num
        #: The HTTP requests to generation routes (``Route.generation``), for /metrics.
        self.requests = metrics.RequestCounters()
        # Each API family contributes its routes: ``module.routes(app) -> list[Route]``.
        self.routes: list[Route] = [
            serve(r, self.refusal, self.requests)
            for family in (mindie, manage, metrics, tgi, triton, openai, responses, anthropic,
                           tokenize, webui, embeddings)
            for r in family.routes(self)]
        self.routes += [dataclasses.replace(r, plane=HEALTH) for r in self.routes
                        if r.plane == MANAGEMENT and r.method == "GET" and r.path in HEALTH_PATHS]
        self.router = Router(self.routes, error_body)

    @property
    def llm(self) -> LLM:
        """The loaded chat model.

        Raises:
            RuntimeError: still loading, or no chat model is served (no route handler asks
                then: see :meth:`refusal`)."""
        if self._llm is None:
            raise RuntimeError("the model is not loaded yet")
        return self._llm

    @property
    def chat_model(self) -> LLM | None:
        """The loaded chat model, or ``None`` (loading, or an embedding model alone)."""
        return self._llm

    def loaded(self, llm: LLM | None, embedder=None) -> None:
        """The models are in (``llm`` ``None``: an embedding model alone): every route
        serves from now on."""
        self._llm = llm
        self.embedder = embedder
        self.loading = None

    def refusal(self, route: Route) -> APIError | None:
        """What ``route`` answers instead of running its handler, or ``None``: 503 ``The model
        is loading: ...`` while the model loads (unless the route has ``needs_model`` false),
        404 on a route that needs the chat model when an embedding model alone is served."""
        loading = self.loading
        if loading is not None and route.needs_model:
            return APIError(Kind.LOADING, loading.message, headers=(("Retry-After", "1"),))
        if loading is None and self._llm is None and route.path not in WITHOUT_CHAT:
            name = self.embedder.name if self.embedder is not None else "none"
            return APIError(Kind.NOT_FOUND, f"{route.method} {route.path}: this server serves "
                            f"the embedding model {name} alone, no chat model (start it with "
                            "--model to generate); its routes are POST /v1/embeddings, /embed "
                            "and /embedding")
        return None

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
    """Fail fast, before anything else is said or done, when a listen address cannot be bound.

    Raises:
        AddressError: a listen address cannot be resolved.
        OSError: the address is in use or not available on this machine.
    """
    s = cfg.server
    health = [Listener(s.health_ip_address, s.health_port, frozenset({HEALTH}))] \
        if s.health_port else []
    for lst in plan_listeners(cfg) + health:
        for sock in bind(lst.host, lst.port, backlog=1):
            sock.close()


async def start_configured_listeners(app: App, cfg: Config,
                                     ssl_ctx: ssl.SSLContext | None) -> list[Listener]:
    """Bind the listeners ``cfg`` plans (:func:`plan_listeners`, and the health port's) and
    start accepting with ``app``'s handlers; returns them with their bound ports.

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
                           handshake_timeout=s.tls_handshake_timeout,
                           keep_alive_timeout=s.keep_alive_timeout,
                           header_timeout=s.header_timeout)
    app.max_link_num = limits.max_connections
    busy = json_response(503, error_body(503, "Too many connections, try again later."))
    listeners = await listen.start_listeners(plan_listeners(cfg), app.handler_for, limits,
                                             ssl_ctx, busy, answers(app.routes))
    if s.health_port:
        try:
            # slots of its own, so that probes still get in when maxLinkNum clients are in
            listeners += await listen.start_listeners(
                [Listener(s.health_ip_address, s.health_port, frozenset({HEALTH}))],
                app.handler_for, dataclasses.replace(limits, max_connections=HEALTH_CONNECTIONS),
                None, busy, answers(app.routes))
        except BaseException:
            for lst in listeners:
                lst.server.close()
            raise
    return listeners
