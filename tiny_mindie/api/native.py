"""MindIE's native text inference: ``POST /infer`` (plain and streaming), spec §2.

JSON -> validated :class:`GenerationRequest` -> engine -> MindIE's JSON / SSE events.
"""

from __future__ import annotations

import asyncio
import json

from ..engine.request import GenerationError, GenerationRequest, TokenEvent
from ..llm import LLM, MAX_SEED
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from .errors import from_generation_error, invalid
from .validate import get_bool, get_float, get_int, parse_json_object

INT32_MAX = 2**31 - 1
INF = float("inf")


def parse_infer(body: bytes, llm: LLM) -> tuple[str | list[int], dict, bool, bool]:
    """Validate an ``/infer`` body (cheap: nothing is tokenized here).

    Returns:
        ``(prompt, parameters for LLM.make_request, stream, details)``.

    Raises:
        APIError: 422 with MindIE's message for every malformed or out-of-range field.
    """
    obj = parse_json_object(body)
    has_ids = "input_id" in obj and obj["input_id"] is not None
    if "inputs" in obj and obj["inputs"] is not None and has_ids:
        raise invalid("Input conflict.")
    if has_ids:
        ids = obj["input_id"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise invalid("The type of input_id is abnormal")
        if not all(0 <= i < llm.tokenizer.vocab_size for i in ids):
            raise invalid(f"input_id must be token ids in [0,{llm.tokenizer.vocab_size - 1}]")
        prompt: str | list[int] = list(ids)
    else:
        prompt = read_inputs(obj)
    stream = get_bool(obj, "stream", False, "Field")
    p = read_parameters(obj)
    return prompt, mindie_parameters(p), stream, get_bool(p, "details", False)


def read_inputs(obj: dict, field: str = "inputs", title: str = "Inputs") -> str:
    """The prompt text ``obj[field]``; 422 with MindIE's messages when it is missing, null,
    not a string or empty."""
    if field not in obj:
        raise invalid(f"Not found {field}.")
    text = obj[field]
    if text is None:
        raise invalid(f"{title} must not be null")
    if not isinstance(text, str):
        raise invalid(f"The type of {field} is abnormal")
    if not text:
        raise invalid(f"{title} must not be empty")
    return text


def read_parameters(obj: dict) -> dict:
    """``obj["parameters"]`` as a dict (absent or null -> ``{}``); 422 when not an object."""
    p = obj.get("parameters")
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise invalid("The type of parameters is abnormal")
    return p


def mindie_parameters(p: dict, *, top_p_may_be_one: bool = False, top_k_min: int = 1) -> dict:
    """MindIE's generation parameters (spec §2) -> keyword arguments of ``LLM.make_request``.
    The Triton routes accept ``top_p == 1.0`` and ``top_k == 0``; /infer does not."""
    return dict(
        temperature=get_float(p, "temperature", 1.0, 0.0, INF, lo_open=True, hi_open=True),
        top_k=get_int(p, "top_k", 0, top_k_min, INT32_MAX),
        top_p=get_float(p, "top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=not top_p_may_be_one),
        typical_p=get_float(p, "typical_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        do_sample=get_bool(p, "do_sample", None),
        seed=get_int(p, "seed", None, 0, MAX_SEED),
        repetition_penalty=get_float(p, "repetition_penalty", 1.0, 0.0, INF,
                                     lo_open=True, hi_open=True),
        max_new_tokens=get_int(p, "max_new_tokens", 20, 1, INT32_MAX),
        watermark=get_bool(p, "watermark", False),
        priority=get_int(p, "priority", 5, 1, 5),
        timeout_s=get_int(p, "timeout", None, 1, 65535),
    )


async def build_request(llm: LLM, prompt: str | list[int], params: dict) -> GenerationRequest:
    """Tokenize (in a worker thread: a long prompt must not stall the event loop) and check the
    prompt's length; raises APIError 424 when it cannot fit."""
    try:
        request = await asyncio.to_thread(llm.make_request, prompt, **params)
        llm.engine.check_prompt(len(request.prompt_ids))
    except GenerationError as err:
        raise from_generation_error(err) from None
    return request


async def first_event(llm: LLM, request: GenerationRequest):
    """Start streaming ``request``: ``(events, first event)``. Waiting for the first event
    before the response head is sent lets errors that come before any token (prompt too long,
    service stopped, timeout in the queue) still get their own HTTP status."""
    events = llm.stream_async(request)
    try:
        return events, await events.__anext__()
    except GenerationError as err:
        raise from_generation_error(err) from None


async def until_done_or_gone(work, stream: ResponseStream, poll_s: float = 0.2):
    """Await ``work`` (a coroutine), cancelling it -- and so the request in the engine -- when
    the client disconnects meanwhile; returns ``None`` then.

    Raises:
        APIError: the engine's error, translated (424, 500, 503, ...).
    """
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and stream.peer_gone():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
        return task.result()
    except GenerationError as err:
        raise from_generation_error(err) from None
    finally:
        if not task.done():   # we were cancelled ourselves
            task.cancel()


def _details(ev: TokenEvent, request: GenerationRequest) -> dict:
    return {"finish_reason": ev.finish_reason, "generated_tokens": ev.index + 1,
            "seed": request.sampling.seed}


def stream_event(ev: TokenEvent, request: GenerationRequest, details: bool) -> dict:
    """One SSE event of the ``/infer`` stream (spec §2): the last one carries
    ``generated_text``, ``details`` (or null) and its token with ``"text": null``."""
    out: dict = {"prefill_time": None if ev.prefill_time_ms is None else round(ev.prefill_time_ms, 2),
                 "decode_time": None if ev.decode_time_ms is None else round(ev.decode_time_ms, 2)}
    if ev.is_last:
        out["generated_text"] = ev.generated_text
        out["details"] = _details(ev, request) if details else None
        out["token"] = {"id": ev.token_id, "text": None}
    else:
        out["token"] = {"id": ev.token_id, "text": ev.text}
    return out


def _dumps(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


async def infer(req: Request, stream: ResponseStream, llm: LLM) -> Response | None:
    """``POST /infer``: MindIE's text inference, plain JSON or an SSE stream."""
    prompt, params, streaming, details = parse_infer(req.body, llm)
    request = await build_request(llm, prompt, params)
    if not streaming:
        done = await until_done_or_gone(llm.generate_async(request), stream)
        if done is None:
            return None
        out: dict = {"generated_text": done.text}
        if details:
            out["details"] = {"finish_reason": done.finish_reason,
                              "generated_tokens": len(done.token_ids), "seed": done.seed}
        return json_response(200, out)
    events, ev = await first_event(llm, request)
    try:   # the client may be gone already: then start() raises and the request is cancelled
        out_stream = await stream.start(200, "text/event-stream")
        try:
            while True:
                await out_stream.send_event(_dumps(stream_event(ev, request, details)))
                if ev.is_last:
                    break
                ev = await events.__anext__()
        except GenerationError as err:
            await out_stream.send_event(_dumps(from_generation_error(err).body()))
    finally:
        await events.aclose()
    await out_stream.end()
    return None



async def infer_token(req: Request, stream: ResponseStream, llm: LLM) -> Response | None:
    """``POST /infer_token``: ``/infer`` with token ids in (``input_id``), same answers."""
    obj = parse_json_object(req.body)
    if obj.get("input_id") is None:
        if obj.get("inputs") is not None:
            raise invalid("Not found input_id. /infer_token takes token ids; use /infer for text.")
        raise invalid("Not found input_id.")
    return await infer(req, stream, llm)


async def tokenizer(req: Request, stream: ResponseStream, llm: LLM) -> Response:
    """``POST /v1/tokenizer`` ``{"inputs", "do_decode"?}`` -> ``{"token_number", "tokens"}``:
    the prompt's token ids as ``/infer`` would see them (BOS included when the model adds it),
    or with ``do_decode`` each token's text (control tokens as their piece, e.g. ``<s>``).
    It answers exactly for the texts ``/infer`` accepts as prompts: one with more tokens than
    ``maxInputTokenLen`` gets ``/infer``'s 424 (without being tokenized when its length alone
    proves it)."""
    obj = parse_json_object(req.body)
    text = read_inputs(obj)
    decode = get_bool(obj, "do_decode", False, "Field")

    def run() -> tuple[int, list]:          # in a worker thread: the event loop serves others
        llm.check_text_length(text)
        ids = llm.encode(text)
        llm.engine.check_prompt(len(ids))
        if not decode:
            return len(ids), ids
        tok = llm.tokenizer
        return len(ids), [tok.token_text(i) if tok.is_special(i)
                          else tok.token_bytes(i).decode("utf-8", errors="replace") for i in ids]

    try:
        count, tokens = await asyncio.to_thread(run)
    except GenerationError as err:
        raise from_generation_error(err) from None
    return json_response(200, {"token_number": count, "tokens": tokens})


def routes(app) -> list:
    """The native family's routes (spec §2, §4)."""
    from ..server.routing import BUSINESS, Route
    return [Route("POST", "/infer", BUSINESS, lambda r, s, p: infer(r, s, app.llm)),
            Route("POST", "/infer_token", BUSINESS, lambda r, s, p: infer_token(r, s, app.llm)),
            Route("POST", "/v1/tokenizer", BUSINESS, lambda r, s, p: tokenizer(r, s, app.llm))]
