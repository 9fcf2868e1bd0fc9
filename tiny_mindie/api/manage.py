"""Health and management routes (spec §1, §4): liveness, readiness, a timed real generation,
KV slot counts, status, the effective configuration, and ``/stopService``.

=====================================  ========================================================
route                                  answer
=====================================  ========================================================
``GET /health``                        200 empty; 503 when loading, stopping or the engine is
                                       down (``{"message"}`` while loading, else empty)
``GET /v2/health/live``                200 empty, also while the model loads; 503 when the
                                       inference thread is down
``GET /v2/health/ready``               200 empty; 503 ``{"message"}`` when loading, busy (no
                                       free KV slot and requests waiting), stopping or down
``GET /v2/models/{m}/ready``           200 empty; 503 ``{"message"}`` when loading, stopping
                                       or down
``GET /health/timed-{N}``              a one-token greedy generation at priority 1 within N s
                                       (1..600): 200 ``{"status": "healthy"}``, else 503
``GET /v2/models/{m}/getSlotCount``    ``{"total_slots", "free_slots", "available_tokens_length"}``
``GET /v1/status``                     MindIE's ``{"service", "resource", "linkStatus"}``
``GET /v1/config``                     MindIE's summary keys and the effective configuration
                                       (TLS file paths, never their contents)
``GET /stopService[?mode=Force]``      stop admitting (503 ``The service has been stopped.``),
                                       let what runs finish -- or, with Force, cancel it --
                                       then answer 200 and exit with status 0
=====================================  ========================================================

``routes(app)`` also gives the app its :class:`ShutdownControl` as ``app.shutdown``: the one
hook between these routes (and SIGINT/SIGTERM) and the serve loop (:mod:`tiny_mindie.lifecycle`).
The four health routes answer while the model loads (``app.loading``); every other route of the
app is answered 503 then, before its handler runs (:class:`tiny_mindie.app.App`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re

from ..engine.request import GenerationError
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import MANAGEMENT, Route
from .errors import APIError, Kind

STOPPED = "The service has been stopped."
MAX_TIMED_S = 600
log = logging.getLogger("tiny_mindie")


def check_model(app, name: str) -> None:
    """404 ``Model <name> not found`` unless ``name`` is the served model's name."""
    if name != app.llm.model_name:
        raise APIError(Kind.NOT_FOUND, f"Model {name} not found")


class ShutdownControl:
    """A stop asked for by ``/stopService`` or a signal, and its drain.

    The serve loop awaits :attr:`requested`, then runs :meth:`drain` and exits. :meth:`request`
    makes the engine stop admitting at once, so no request slips in meanwhile.

    Attributes:
        requested: set once a stop is asked for.
        drained: set when no generation is left (finished, or cancelled by a forced stop).
        force: the stop cancels what is running instead of letting it finish.
    """

    def __init__(self, app):
        self.app = app
        self.requested = asyncio.Event()
        self.drained = asyncio.Event()
        self.force = False
        self.signals = 0

    @property
    def stopping(self) -> bool:
        return self.requested.is_set()

    def request(self, force: bool = False) -> bool:
        """Ask for a stop. A forced stop may follow a graceful one (it cancels the rest);
        returns ``False`` when a stop at least as strong is already under way."""
        if self.requested.is_set() and (self.force or not force):
            return False
        self.force = self.force or force
        if self.app.loading is None:       # while loading there is nothing to drain
            self.app.llm.engine.drain()
        self.requested.set()
        return True

    def signal(self) -> bool:
        """SIGTERM or SIGINT: the first asks for a graceful stop, the next ones force it.
        Returns whether the stop is forced now."""
        self.signals += 1
        self.request(force=self.signals > 1)
        return self.force

    async def drain(self, poll_s: float = 0.05, force_wait_s: float = 10.0,
                    graceful_s: float | None = None) -> None:
        """Return when no request is left: graceful -- the engine is idle and every counted
        HTTP request has been answered; forced -- the engine is stopped (its requests end with
        ``The service has been stopped.``) and their handlers have returned, or after
        ``force_wait_s``. A forced stop asked for meanwhile cuts a graceful drain short, and so
        does ``graceful_s`` seconds passing (``None``: no limit): what is left is cancelled as
        by a forced stop."""
        engine = self.app.llm.engine
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
                await asyncio.to_thread(engine.stop)
            st = engine.stats()
            if engine.metrics.in_flight == 0 and (
                    deadline is not None or (st["running"] == 0 and st["waiting"] == 0)):
                break
            if deadline is not None and loop.time() > deadline:
                break
            await asyncio.sleep(poll_s)
        self.drained.set()


def _blocks_per_slot(app) -> int:
    return math.ceil(app.llm.engine.max_seq_len / app.cfg.backend.schedule.cache_block_size)


def effective_config(app) -> dict:
    """MindIE's ``/v1/config`` keys, then the configuration in force in config.json's layout
    (paths resolved; effective limits, e.g. maxSeqLen capped by the model's context)."""
    cfg, llm = app.cfg, app.llm
    s, b, sc = cfg.server, cfg.backend, cfg.backend.schedule
    engine = llm.engine
    return {
        "modelName": llm.model_name,
        "maxSeqLen": engine.max_seq_len,
        "npuMemSize": -1,            # MindIE: -1 = sized automatically (here from kvCacheMB)
        "cpuMemSize": 0,             # no swapping to host memory
        "worldSize": 1,
        "maxOutputLen": sc.max_iter_times,
        "cacheBlockSize": sc.cache_block_size,
        "ServerConfig": {
            "ipAddress": s.ip_address, "managementIpAddress": s.management_ip_address,
            "port": s.port, "managementPort": s.management_port, "metricsPort": s.metrics_port,
            "maxLinkNum": app.max_link_num, "httpsEnabled": s.https_enabled,
            "tlsCaPath": cfg.path(s.tls_ca_path), "tlsCaFile": list(s.tls_ca_files),
            "tlsCert": cfg.path(s.tls_cert), "tlsPk": cfg.path(s.tls_pk),
            "tlsCrlPath": cfg.path(s.tls_crl_path), "tlsCrlFiles": list(s.tls_crl_files),
            "tlsHandshakeTimeout": s.tls_handshake_timeout,
            "tokenTimeout": s.token_timeout, "e2eTimeout": s.e2e_timeout,
            "maxRequestLength": s.max_request_length,
            "maxStreamBacklogKB": s.max_stream_backlog_kb,
            "drainTimeout": s.drain_timeout, "keepAliveTimeout": s.keep_alive_timeout,
            "headerTimeout": s.header_timeout, "healthPort": s.health_port,
            "healthIpAddress": s.health_ip_address,
        },
        "BackendConfig": {
            "npuDeviceIds": [list(b.npu_device_ids)],
            "backend": b.backend, "intraOpThreads": b.intra_op_threads,
            "parallelRuns": getattr(llm.backend, "parallel_runs", 1), "kvCacheMB": b.kv_cache_mb,
            "batchInvariant": llm.backend.batch_invariant, "weights": b.weights,
            "device": llm.backend.device, "kvSlots": engine.stats()["total_slots"],
            "ModelDeployConfig": {
                "maxSeqLen": engine.max_seq_len, "maxInputTokenLen": engine.max_input_len,
                "truncation": b.model.truncation, "parseSpecialTokens": llm.parse_special_tokens,
                "ModelConfig": [{"modelName": llm.model_name, "modelWeightPath": llm.model_path,
                                 "worldSize": 1}],
            },
            "ScheduleConfig": {
                "cacheBlockSize": sc.cache_block_size,
                "maxPrefillBatchSize": sc.max_prefill_batch_size,
                "maxPrefillTokens": sc.max_prefill_tokens, "maxBatchSize": sc.max_batch_size,
                "maxIterTimes": sc.max_iter_times,
                "maxQueueDelayMicroseconds": sc.max_queue_delay_microseconds,
                "prefillChunkSize": sc.prefill_chunk_size,
                "prefixCaching": llm.engine.limits.prefix_cache,
                "speculativeDecoding": llm.engine.speculation,
            },
        },
    }


def routes(app) -> list[Route]:
    ctl = app.shutdown = ShutdownControl(app)
    probe_ids: list[int] = []

    def unavailable() -> str | None:
        """Why the service cannot take requests now, or ``None``."""
        if app.loading is not None:
            return app.loading.message
        engine = app.llm.engine
        if ctl.stopping or not engine.accepting:
            return STOPPED
        if not engine.alive:
            return "The inference engine is not running."
        return None

    def message_503(message: str) -> Response:
        return json_response(503, {"message": message})

    async def health(req: Request, stream: ResponseStream, params: dict) -> Response:
        if app.loading is not None:
            return message_503(app.loading.message)
        return Response(503 if unavailable() else 200, b"", "")

    async def live(req: Request, stream: ResponseStream, params: dict) -> Response:
        alive = app.loading is not None or app.llm.engine.alive
        return Response(200 if alive else 503, b"", "")

    async def ready(req: Request, stream: ResponseStream, params: dict) -> Response:
        why = unavailable()
        if why:
            return message_503(why)
        st = app.llm.engine.stats()
        if st["free_slots"] == 0 and st["waiting"] > 0:
            return message_503(f"The service is busy: no free KV slot, {st['waiting']} "
                               "requests waiting.")
        return Response(200, b"", "")

    async def model_ready(req: Request, stream: ResponseStream, params: dict) -> Response:
        if app.loading is None:
            check_model(app, params["model"])
        why = unavailable()
        return message_503(why) if why else Response(200, b"", "")

    async def timed(req: Request, stream: ResponseStream, params: dict) -> Response:
        """``/health/timed-N``: a real one-token generation must finish within N seconds."""
        m = re.fullmatch(r"timed-([0-9]+)", params["probe"])       # ASCII digits only
        if m is None:
            raise APIError(Kind.NOT_FOUND, f"Route {req.path} not found")
        digits = m.group(1).lstrip("0") or "0"
        n = int(digits) if len(digits) <= 9 else None      # int() refuses > 4300 digits
        if n is None or not 1 <= n <= MAX_TIMED_S:
            shown = digits if len(digits) <= 20 else digits[:20] + "..."
            raise APIError(Kind.INVALID, f"N of /health/timed-N must be in [1, {MAX_TIMED_S}], "
                                         f"got {shown}.")
        llm = app.llm
        try:
            if not probe_ids:
                probe_ids.extend(llm.encode("Hello"))
            request = llm.make_request(probe_ids, max_new_tokens=1, do_sample=False, priority=1,
                                       timeout_s=n)
            await asyncio.wait_for(llm.generate_async(request), n)
        except TimeoutError:
            return json_response(503, {"status": "unhealthy",
                                       "message": f"No token generated within {n} s."})
        except GenerationError as err:
            return json_response(503, {"status": "unhealthy", "message": err.message})
        return json_response(200, {"status": "healthy"})

    async def slot_count(req: Request, stream: ResponseStream, params: dict) -> Response:
        """MindIE's ``getSlotCount``: KV-cache slots in all and free; tokens they can hold."""
        check_model(app, params["model"])
        engine = app.llm.engine
        st = engine.stats()
        return json_response(200, {
            "total_slots": st["total_slots"], "free_slots": st["free_slots"],
            "available_tokens_length": st["free_slots"] * engine.max_seq_len})

    async def status(req: Request, stream: ResponseStream, params: dict) -> Response:
        """MindIE's ``/v1/status``. A KV slot holds ``ceil(maxSeqLen / cacheBlockSize)`` blocks
        of ``cacheBlockSize`` tokens; nothing is ever swapped to the CPU."""
        why = unavailable()
        if why:
            raise APIError(Kind.STOPPED, why)
        st = app.llm.engine.stats()
        per_slot = _blocks_per_slot(app)
        return json_response(200, {
            "service": {"roleStatus": "RoleReady", "currentRole": "none"},
            "resource": {"availSlotsNum": st["free_slots"],
                         "availBlockNum": st["free_slots"] * per_slot,
                         "waitingRequestNum": st["waiting"], "runningRequestNum": st["running"],
                         "swappedRequestNum": 0,
                         "freeNpuBlockNums": st["free_slots"] * per_slot, "freeCpuBlockNums": 0,
                         "totalNpuBlockNums": st["total_slots"] * per_slot, "totalCpuBlockNums": 0},
            "linkStatus": {"peers": []}})

    async def config(req: Request, stream: ResponseStream, params: dict) -> Response:
        return json_response(200, effective_config(app))

    async def stop_service(req: Request, stream: ResponseStream, params: dict) -> Response:
        """Graceful by default; ``?mode=Force`` cancels the running requests. Answers 200 once
        nothing is left running; the process exits right after."""
        mode = req.query.get("mode")
        if mode is not None and mode.lower() != "force":
            raise APIError(Kind.INVALID, "mode must be Force (or absent for a graceful stop), "
                                         f"got {mode}.")
        if not ctl.request(force=mode is not None):
            raise APIError(Kind.STOPPED, STOPPED)
        await ctl.drained.wait()
        return Response(200, b"", "", [("Connection", "close")])

    return [
        Route("GET", "/health", MANAGEMENT, health, needs_model=False),
        Route("GET", "/v2/health/live", MANAGEMENT, live, needs_model=False),
        Route("GET", "/v2/health/ready", MANAGEMENT, ready, needs_model=False),
        Route("GET", "/v2/models/{model}/ready", MANAGEMENT, model_ready, needs_model=False),
        Route("GET", "/health/{probe}", MANAGEMENT, timed),
        Route("GET", "/v2/models/{model}/getSlotCount", MANAGEMENT, slot_count),
        Route("GET", "/v1/status", MANAGEMENT, status),
        Route("GET", "/v1/config", MANAGEMENT, config),
        Route("GET", "/stopService", MANAGEMENT, stop_service),
    ]
