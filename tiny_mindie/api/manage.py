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
                                       or down (``m``: the chat or the embedding model)
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

``/stopService`` and the readiness answers use the app's stop control, ``app.shutdown``
(:class:`tiny_mindie.service.shutdown.ShutdownControl`, made by the serve loop, which also stops on
SIGINT/SIGTERM). The four health routes answer while the model loads (``app.loading``); every
other route of the app is answered 503 then, before its handler runs
(:class:`tiny_mindie.service.app.App`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import re

from ..engine.request import GenerationError
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import MANAGEMENT, Route
from .errors import APIError, Kind

STOPPED = "The service has been stopped."
MAX_TIMED_S = 600


def check_model(app, name: str, *, embedding: bool = False) -> None:
    """404 ``Model <name> not found`` unless ``name`` is the served chat model's name (or,
    with ``embedding``, the embedding model's)."""
    names = [app.chat_model.model_name] if app.chat_model is not None else []
    if embedding and app.embedder is not None:
        names.append(app.embedder.name)
    if name not in names:
        raise APIError(Kind.NOT_FOUND, f"Model {name} not found")


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
            "graph": getattr(llm.backend, "graph", None),
            "kernels": b.kernels, "kernelsRunning": getattr(llm.backend, "kernels", None),
            "executionProviders": list(getattr(llm.backend, "providers", [])),
            "device": llm.backend.device, "kvSlots": engine.stats()["total_slots"],
            "ModelDeployConfig": {
                "maxSeqLen": engine.max_seq_len, "maxInputTokenLen": engine.max_input_len,
                "truncation": b.model.truncation, "parseSpecialTokens": llm.parse_special_tokens,
                "ModelConfig": [{"modelName": llm.model_name, "modelWeightPath": llm.model_path,
                                 "worldSize": 1,
                                 "embeddingModelPath": app.embedder.model.path
                                 if app.embedder is not None else ""}],
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


# ---- the handlers: (app, request, stream, path parameters) -> answer -----------------------
def unavailable(app) -> str | None:
    """Why the service cannot take requests now, or ``None``."""
    if app.loading is not None:
        return app.loading.message
    engine = app.chat_model.engine if app.chat_model is not None else None
    if app.shutdown.stopping or (engine is not None and not engine.accepting):
        return STOPPED
    if engine is not None and not engine.alive:
        return "The inference engine is not running."
    if app.embedder is not None and not app.embedder.alive:
        return "The embedding thread is not running."
    return None


def _empty(status: int = 200) -> Response:
    return Response(status, b"", "")


def _message_503(message: str) -> Response:
    return json_response(503, {"message": message})


async def health(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    if app.loading is not None:
        return _message_503(app.loading.message)
    return _empty(503 if unavailable(app) else 200)


async def live(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    alive = app.loading is not None or (
        (app.chat_model is None or app.chat_model.engine.alive)
        and (app.embedder is None or app.embedder.alive))
    return _empty(200 if alive else 503)


async def ready(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    why = unavailable(app)
    if why:
        return _message_503(why)
    if app.chat_model is None:
        return _empty()
    st = app.llm.engine.stats()
    if st["free_slots"] == 0 and st["waiting"] > 0:
        return _message_503(f"The service is busy: no free KV slot, {st['waiting']} "
                            "requests waiting.")
    return _empty()


async def model_ready(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    if app.loading is None:
        check_model(app, params["model"], embedding=True)
    why = unavailable(app)
    return _message_503(why) if why else _empty()


def timed_seconds(req: Request, probe: str) -> int:
    """N of ``/health/timed-N`` (ASCII digits only).

    Raises:
        APIError: 404 for another ``/health/...`` path; 422 when N is not in 1..600.
    """
    m = re.fullmatch(r"timed-([0-9]+)", probe)
    if m is None:
        raise APIError(Kind.NOT_FOUND, f"Route {req.path} not found")
    digits = m.group(1).lstrip("0") or "0"
    n = int(digits) if len(digits) <= 9 else None      # int() refuses > 4300 digits
    if n is None or not 1 <= n <= MAX_TIMED_S:
        shown = digits if len(digits) <= 20 else digits[:20] + "..."
        raise APIError(Kind.INVALID, f"N of /health/timed-N must be in [1, {MAX_TIMED_S}], "
                                     f"got {shown}.")
    return n


async def timed(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    """``/health/timed-N``: a real one-token greedy generation at priority 1 must finish
    within N seconds."""
    n = timed_seconds(req, params["probe"])
    llm = app.llm
    try:
        request = llm.make_request(llm.encode("Hello"), max_new_tokens=1, do_sample=False,
                                   priority=1, timeout_s=n)
        await asyncio.wait_for(llm.generate_async(request), n)
    except TimeoutError:
        return json_response(503, {"status": "unhealthy",
                                   "message": f"No token generated within {n} s."})
    except GenerationError as err:
        return json_response(503, {"status": "unhealthy", "message": err.message})
    return json_response(200, {"status": "healthy"})


async def slot_count(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    """MindIE's ``getSlotCount``: KV-cache slots in all and free; tokens they can hold."""
    check_model(app, params["model"])
    engine = app.llm.engine
    st = engine.stats()
    return json_response(200, {
        "total_slots": st["total_slots"], "free_slots": st["free_slots"],
        "available_tokens_length": st["free_slots"] * engine.max_seq_len})


async def status(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    """MindIE's ``/v1/status``. A KV slot holds ``ceil(maxSeqLen / cacheBlockSize)`` blocks
    of ``cacheBlockSize`` tokens; nothing is ever swapped to the CPU."""
    why = unavailable(app)
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


async def config(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    return json_response(200, effective_config(app))


async def stop_service(app, req: Request, stream: ResponseStream, params: dict) -> Response:
    """Graceful by default; ``?mode=Force`` cancels the running requests. Answers 200 once
    nothing is left running; the process exits right after."""
    mode = req.query.get("mode")
    if mode is not None and mode.lower() != "force":
        raise APIError(Kind.INVALID, "mode must be Force (or absent for a graceful stop), "
                                     f"got {mode}.")
    ctl = app.shutdown
    if not ctl.request(force=mode is not None):
        raise APIError(Kind.STOPPED, STOPPED)
    await ctl.drained.wait()
    return Response(200, b"", "", [("Connection", "close")])


def routes(app) -> list[Route]:
    """The management routes of ``app`` (every handler is given the app first)."""
    def get(path: str, handler, *, needs_model: bool = True) -> Route:
        return Route("GET", path, MANAGEMENT, functools.partial(handler, app),
                     needs_model=needs_model)

    return [
        get("/health", health, needs_model=False),
        get("/v2/health/live", live, needs_model=False),
        get("/v2/health/ready", ready, needs_model=False),
        get("/v2/models/{model}/ready", model_ready, needs_model=False),
        get("/health/{probe}", timed),
        get("/v2/models/{model}/getSlotCount", slot_count),
        get("/v1/status", status),
        get("/v1/config", config),
        get("/stopService", stop_service),
    ]
