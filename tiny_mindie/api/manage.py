"""Health and management routes (spec §4): liveness, readiness, KV slot counts."""

from __future__ import annotations

from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import MANAGEMENT, Route
from .errors import APIError


def check_model(app, name: str) -> None:
    """404 ``Model <name> not found`` unless ``name`` is the served model's name."""
    if name != app.llm.model_name:
        raise APIError(404, f"Model {name} not found")


def routes(app) -> list[Route]:
    async def health(req: Request, stream: ResponseStream, params: dict) -> Response:
        return Response(200, b"", "")

    async def slot_count(req: Request, stream: ResponseStream, params: dict) -> Response:
        """MindIE's ``getSlotCount``: KV-cache slots in all and free; tokens they can hold."""
        check_model(app, params["model"])
        st = app.llm.engine.stats()
        return json_response(200, {"total_slots": st["total_slots"], "free_slots": st["free_slots"],
                                   "available_tokens_length": st["free_slots"] * app.llm.engine.max_seq_len})

    return [
        Route("GET", "/health", MANAGEMENT, health),
        Route("GET", "/v2/health/live", MANAGEMENT, health),
        Route("GET", "/v2/health/ready", MANAGEMENT, health),
        Route("GET", "/v2/models/{model}/getSlotCount", MANAGEMENT, slot_count),
    ]
