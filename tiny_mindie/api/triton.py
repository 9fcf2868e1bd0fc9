"""MindIE's Triton-compatible family (spec §4): metadata, text and token inference, stopInfer.

Routes: ``GET /v2``, ``GET /v2/models/{m}``, ``GET /v2/models/{m}/config``,
``POST /v2/models/{m}/generate`` and ``.../generate_stream`` (``{"id"?, "text_input",
"parameters"}``), ``POST /v2/models/{m}/infer`` (UINT32 token ids in ``inputs[0].data``) and
``POST /v2/models/{m}/stopInfer`` ``{"id"}``, which ends a running request by the id its client
gave it (the engine has its own ids; this module maps one to the other while a request runs).

A stopped request ends normally: a plain answer carries the text so far with
``finish_reason: "stop_sequence"`` (MindIE's reason for aborted requests), a stream ends with
one last event saying the same.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets

from .._version import __version__
from ..engine.request import GenerationParams, TokenEvent
from ..llm import LLM
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS
from .drive import build, collect, merged, route, send_stream
from .errors import MINDIE, APIError, Kind, invalid
from .manage import check_model
from .mindie import (
    PARAMETERS,
    mindie_parameters,
    read_inputs,
    read_parameters,
    speculation_details,
)
from .validate import (
    INT32_MAX,
    check_token_ids,
    get_bool,
    get_int,
    read_json_object,
    refuse_unknown,
)

_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")
#: MindIE's Triton ``parameters``: ``/infer``'s and ``batch_size``, ``perf_stat``; any other
#: that is not null is a 422 naming it.
TRITON_PARAMETERS = PARAMETERS | {"batch_size", "perf_stat"}


def parse_parameters(obj: dict) -> tuple[GenerationParams, bool, bool]:
    """MindIE's Triton ``parameters``: /infer's ranges, but ``top_p`` may be 1.0.
    Returns (the request's parameters, details, perf_stat)."""
    p = read_parameters(obj)
    refuse_unknown(p, TRITON_PARAMETERS)
    make = mindie_parameters(p, top_p_may_be_one=True, top_k_min=0)
    get_int(p, "batch_size", None, 1, INT32_MAX)   # accepted and ignored, as MindIE does
    return make, get_bool(p, "details", False), get_bool(p, "perf_stat", False)


def _client_id(obj: dict) -> str | None:
    v = obj.get("id")
    if v is None:
        return None
    if not isinstance(v, str) or not _ID.fullmatch(v):
        raise invalid("Field id must be 1 to 256 characters of A-Z, a-z, 0-9, '_' or '-'.")
    return v


class _Running:
    """A request that ``stopInfer`` can reach: its engine id and a flag to end it."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.stop = asyncio.Event()


class Triton:
    """The family's handlers, sharing the table of running requests by client id."""

    def __init__(self, app):
        self.app = app
        self.running: dict[str, _Running] = {}

    @property
    def llm(self) -> LLM:
        return self.app.llm

    # ---- metadata ---------------------------------------------------------------------
    async def server_meta(self, req: Request, stream: ResponseStream, params: dict) -> Response:
        s = self.app.cfg.backend.schedule
        return json_response(200, {
            "name": "MindIE Server", "version": __version__,
            "extensions": {"max_iter_times": self.llm.engine.limits.max_iter_times,
                           "prefill_policy_type": 0, "decode_policy_type": 0,
                           "max_prefill_batch_size": s.max_prefill_batch_size,
                           "max_prefill_tokens": s.max_prefill_tokens}})

    async def model_meta(self, req: Request, stream: ResponseStream, params: dict) -> Response:
        check_model(self.app, params["model"])
        return json_response(200, {
            "name": self.llm.model_name, "platform": "MindIE Server",
            "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
            "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]})

    async def model_config(self, req: Request, stream: ResponseStream, params: dict) -> Response:
        check_model(self.app, params["model"])
        kv_gb = math.ceil(self.llm.backend.kv_cache_bytes() / 2**30)
        on_npu = "CANN" in str(self.llm.backend.device).upper()
        return json_response(200, {
            "model_name": self.llm.model_name, "input_datatype": "UINT32",
            "output_datatype": "UINT32", "max_seq_len": self.llm.engine.max_seq_len,
            "npu_mem_size": kv_gb if on_npu else 0, "cpu_mem_size": 0 if on_npu else kv_gb,
            "world_size": 1, "model_weight_path": str(self.llm.model_path),
            "model_instance_type": "Standard"})

    # ---- running requests -------------------------------------------------------------
    def _register(self, client_id: str | None, request_id: str) -> tuple[str, _Running]:
        if client_id is None:
            client_id = "tm-" + secrets.token_hex(8)
        if client_id in self.running:
            raise invalid(f"Request id {client_id} is already running.")
        rec = _Running(request_id)
        self.running[client_id] = rec
        return client_id, rec

    async def stop_infer(self, req: Request, stream: ResponseStream, params: dict) -> Response:
        check_model(self.app, params["model"])
        obj = await read_json_object(req.body)
        if obj.get("id") is None:
            raise invalid("Not found id.")
        client_id = _client_id(obj)
        rec = self.running.get(client_id)
        if rec is None:
            raise APIError(Kind.NOT_FOUND, f"Request id {client_id} not found")
        rec.stop.set()
        self.llm.engine.cancel(rec.request_id)
        return json_response(200, {"id": client_id})

    # ---- text inference ---------------------------------------------------------------
    def _text_request(self, obj: dict) -> str:
        text = read_inputs(obj, "text_input", "text_input")
        refuse_unknown(obj, ("id", "text_input", "parameters"), "Field")
        return text

    def _details(self, request, evs: list[TokenEvent], stopped: bool, perf: bool) -> dict:
        last = evs[-1] if evs else None
        d = {"finish_reason": "stop_sequence" if stopped or last is None else last.finish_reason,
             "generated_tokens": len(evs), "seed": request.sampling.seed,
             **(speculation_details(last) if last else {})}
        if perf:
            d["first_token_cost"] = (round(evs[0].prefill_time_ms, 2)
                                     if evs and evs[0].prefill_time_ms is not None else None)
            d["decode_cost"] = [round(e.decode_time_ms, 2) for e in evs[1:]
                                if e.decode_time_ms is not None]
        return d

    async def _run_registered(self, client_id: str | None, request, stream: ResponseStream):
        """Run ``request`` to its end under the client's id (so ``stopInfer`` can reach it);
        returns ``(client id, (events, stopped) or None when the client left)``."""
        client_id, rec = self._register(client_id, request.request_id)
        try:
            done = await collect(self.llm, [request], stream, stop=rec.stop)
        finally:
            self.running.pop(client_id, None)
        if done is None:
            return client_id, None
        evs = done[0]
        return client_id, (evs, not (evs and evs[-1].is_last))

    async def _text_generation(self, req: Request, params: dict):
        """The common front of generate and generate_stream: model check, body, parameters,
        tokenized request. Returns ``(client id or None, request, details, perf_stat)``."""
        check_model(self.app, params["model"])
        obj = await read_json_object(req.body)
        client_id = _client_id(obj)
        text = self._text_request(obj)
        make, details, perf = parse_parameters(obj)
        return client_id, (await build(self.llm, text, make))[0], details, perf

    async def generate(self, req: Request, stream: ResponseStream, params: dict) -> Response | None:
        client_id, request, details, perf = await self._text_generation(req, params)
        client_id, got = await self._run_registered(client_id, request, stream)
        if got is None:
            return None
        evs, stopped = got
        out = {"id": client_id, "model_name": self.llm.model_name, "model_version": None,
               "text_output": "".join(e.text for e in evs) if stopped or not evs
               else evs[-1].generated_text or ""}
        if details:
            out["details"] = self._details(request, evs, stopped, perf)
        return json_response(200, out)

    async def generate_stream(self, req: Request, stream: ResponseStream,
                              params: dict) -> Response | None:
        client_id, request, details, perf = await self._text_generation(req, params)
        client_id, rec = self._register(client_id, request.request_id)
        base = {"id": client_id, "model_name": self.llm.model_name, "model_version": None}
        n, finished = 0, False

        def event(item: tuple[int, TokenEvent]) -> list[dict]:
            nonlocal n, finished
            ev = item[1]
            n, finished = n + 1, ev.is_last
            out = {**base, "text_output": ev.text}
            if details:
                out["details"] = {"finish_reason": ev.finish_reason, "generated_tokens": n}
                if ev.is_last:
                    out["details"]["seed"] = request.sampling.seed
                if perf:
                    ms = ev.prefill_time_ms if n == 1 else ev.decode_time_ms
                    out["details"]["first_token_cost" if n == 1 else "decode_cost"] = (
                        None if ms is None else round(ms, 2))
            return [out]

        def stopped() -> list[dict]:      # the events ended before the last one: stopInfer
            if finished:
                return []
            out = {**base, "text_output": ""}
            if details:
                out["details"] = {"finish_reason": "stop_sequence", "generated_tokens": n,
                                  "seed": request.sampling.seed}
            return [out]

        try:
            events = merged(self.llm, [request], stop=rec.stop, record=stream.record)
            await send_stream(stream, events, MINDIE, event, closing=stopped)
        finally:
            self.running.pop(client_id, None)
        return None

    # ---- token inference --------------------------------------------------------------
    def _token_inputs(self, obj: dict) -> list[int]:
        inputs = obj.get("inputs")
        if inputs is None:
            raise invalid("Not found inputs.")
        refuse_unknown(obj, ("id", "inputs", "outputs", "parameters"), "Field")
        if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
            raise invalid("Field inputs must be an array of exactly one input.")
        inp = inputs[0]
        if inp.get("datatype") != "UINT32":
            raise invalid("Field inputs[0].datatype must be \"UINT32\".")
        data = inp.get("data")
        data = check_token_ids(
            data, "inputs[0].data", self.llm.tokenizer.vocab_size, "Field", non_empty=True,
            type_message="Field inputs[0].data must be a non-empty array of token ids.")
        shape = inp.get("shape")
        if (not isinstance(shape, list) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
                or math.prod(shape) != len(data)):
            raise invalid(f"Field inputs[0].shape must be [{len(data)}] or [1,{len(data)}], "
                          f"got {json.dumps(shape)}.")
        outputs = obj.get("outputs")
        if outputs is not None and (not isinstance(outputs, list) or len(outputs) != 1):
            raise invalid("Field outputs must be an array of one output.")
        return list(data)

    async def infer(self, req: Request, stream: ResponseStream, params: dict) -> Response | None:
        check_model(self.app, params["model"])
        obj = await read_json_object(req.body)
        client_id = _client_id(obj)
        ids = self._token_inputs(obj)
        outputs = obj.get("outputs") or [{}]
        out_name = outputs[0].get("name", "output0") if isinstance(outputs[0], dict) else "output0"
        make, _details, _perf = parse_parameters(obj)
        request = (await build(self.llm, ids, make))[0]
        client_id, got = await self._run_registered(client_id, request, stream)
        if got is None:
            return None
        evs, _stopped = got
        data = [e.token_id for e in evs]
        return json_response(200, {"id": client_id, "outputs": [
            {"name": out_name, "shape": [1, len(data)], "datatype": "UINT32", "data": data}]})


def routes(app) -> list:
    """The Triton family's routes (spec §4)."""
    t = Triton(app)
    return [
        route("GET", "/v2", BUSINESS, t.server_meta),
        route("GET", "/v2/models/{model}", BUSINESS, t.model_meta),
        route("GET", "/v2/models/{model}/config", BUSINESS, t.model_config),
        route("POST", "/v2/models/{model}/generate", BUSINESS, t.generate, generation=True),
        route("POST", "/v2/models/{model}/generate_stream", BUSINESS, t.generate_stream,
              generation=True),
        route("POST", "/v2/models/{model}/infer", BUSINESS, t.infer, generation=True),
        route("POST", "/v2/models/{model}/stopInfer", BUSINESS, t.stop_infer),
    ]
