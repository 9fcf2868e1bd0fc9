"""The server's stop: asked for by ``GET /stopService`` or a signal, then the drain.

The serve loop (:mod:`tiny_mindie.service.lifecycle`) makes the one :class:`ShutdownControl` of a
server, hands it to the app (whose management routes ask for a stop and report it in their
readiness answers), tells it the engine once the model is in, awaits :attr:`~ShutdownControl.
requested`, runs :meth:`~ShutdownControl.drain` and exits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..api.metrics import RequestCounters
    from ..engine.engine import Engine

log = logging.getLogger("tiny_mindie")


class ShutdownControl:
    """A stop asked for by ``/stopService`` or a signal, and its drain.

    :meth:`request` makes the engine stop admitting at once, so that no request slips in
    between the ask and the drain; while the model loads there is no engine yet, and
    :meth:`serving` stops its admission as soon as it is there.

    Attributes:
        requested: set once a stop is asked for.
        drained: set when no generation is left (finished, or cancelled by a forced stop).
        force: the stop cancels what is running instead of letting it finish.
        signals: the SIGTERM and SIGINT received so far.
        engine: the loaded model's engine; ``None`` while it loads.
        requests: the app's HTTP requests to generation routes
            (:class:`~tiny_mindie.api.metrics.RequestCounters`), given with the engine, or
            ``None``.
    """

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.drained = asyncio.Event()
        self.force = False
        self.signals = 0
        self.engine: Engine | None = None
        self.requests: RequestCounters | None = None

    @property
    def stopping(self) -> bool:
        return self.requested.is_set()

    def serving(self, engine: Engine, requests: RequestCounters | None = None) -> None:
        """The model is in: ``engine`` is the one to drain (at once if a stop was asked for
        while the model loaded), and the ``requests`` in flight the ones to wait for
        (``None``: no HTTP requests are counted)."""
        self.engine = engine
        self.requests = requests
        if self.stopping:
            engine.drain()

    def request(self, force: bool = False) -> bool:
        """Ask for a stop. A forced stop may follow a graceful one (it cancels the rest);
        returns ``False`` when a stop at least as strong is already under way."""
        if self.requested.is_set() and (self.force or not force):
            return False
        self.force = self.force or force
        if self.engine is not None:
            self.engine.drain()
        self.requested.set()
        return True

    def signal(self) -> bool:
        """SIGTERM or SIGINT: the first asks for a graceful stop, the next ones force it.
        Returns whether the stop is forced now."""
        self.signals += 1
        self.request(force=self.signals > 1)
        return self.force

    async def drain(self, poll_s: float = 0.05, force_wait_s: float = 10.0,
                    graceful_s: float | None = None,
                    idle: Callable[[], bool] | None = None) -> None:
        """Return when no request is left: graceful -- the engine is idle, every counted
        HTTP request has been answered and ``idle()`` (the embedding jobs: none waiting or
        running) holds; forced -- the engine is stopped (its requests end with ``The service
        has been stopped.``) and their handlers have returned, or after ``force_wait_s``. A
        forced stop asked for meanwhile cuts a graceful drain short, and so does
        ``graceful_s`` seconds passing (``None``: no limit): what is left is cancelled as by
        a forced stop. Call it once :meth:`serving` has been told the engine, if the server
        has one (a server of an embedding model alone has none).

        Raises:
            RuntimeError: no engine and no ``idle``.
        """
        engine = self.engine
        if engine is None and idle is None:
            raise RuntimeError("nothing to drain: the model is not loaded")
        loop = asyncio.get_running_loop()
        deadline = None
        give_up = None if graceful_s is None else loop.time() + graceful_s
        while True:
            if not self.force and give_up is not None and loop.time() >= give_up:
                self.force = True
                log.warning("drain deadline (%g s) passed: cancelling the requests left",
                            graceful_s)
            if self.force and deadline is None:
                deadline = loop.time() + force_wait_s
                if engine is not None:
                    await asyncio.to_thread(engine.stop)
            if _engine_idle(engine, self.requests, forced=deadline is not None) and (
                    idle is None or deadline is not None or idle()):
                break
            if deadline is not None and loop.time() > deadline:
                break
            await asyncio.sleep(poll_s)
        self.drained.set()


def _engine_idle(engine, requests, forced: bool) -> bool:
    """No counted HTTP request in flight and, unless ``forced``, nothing running or waiting
    (no engine: true)."""
    if engine is None:
        return True
    st = engine.stats()
    return (requests is None or requests.in_flight == 0) and (
        forced or (st["running"] == 0 and st["waiting"] == 0))
