"""MindIE's native text inference: ``POST /infer`` (plain and streaming), spec §2.

JSON -> validated :class:`GenerationParams` -> :class:`GenerationRequest` -> engine -> MindIE's
JSON / SSE events.
"""

from __future__ import annotations

import asyncio

from ..engine.request import GenerationError, GenerationParams, GenerationRequest, TokenEvent
from ..llm import LLM, MAX_SEED
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS
from .drive import build, collect, merged, route, send_stream
from .errors import MINDIE, from_generation_error, invalid
from .validate import (
    INF,
    INT32_MAX,
    check_token_ids,
    get_bool,
    get_float,
    get_int,
    parse_json_object,
    read_json_object,
    refuse_unknown,
)

#: ``parameters`` of ``/infer`` (spec §2); any other that is not null is a 422 naming it.
PARAMETERS = frozenset({"temperature", "top_k", "top_p", "typical_p", "do_sample", "seed",
                        "repetition_penalty", "watermark", "priority", "max_new_tokens",
                        "timeout", "details"})
#: The top-level fields of ``/infer`` and ``/infer_token``.
FIELDS = frozenset({"inputs", "input_id", "stream", "parameters"})


def parse_infer(body: bytes,
                llm: LLM) -> tuple[str | list[int], GenerationParams, bool, bool]:
    """Validate an ``/infer`` body (cheap: nothing is tokenized here).

    Returns:
        ``(prompt, the request's parameters, stream, details)``.

    Raises:
        APIError: 422 with MindIE's message for every malformed or out-of-range field, and
            naming a field or parameter nothing reads (:data:`FIELDS`, :data:`PARAMETERS`).
    """
    obj = parse_json_object(body)
    has_ids = "input_id" in obj and obj["input_id"] is not None
    if "inputs" in obj and obj["inputs"] is not None and has_ids:
        raise invalid("Input conflict.")
    if has_ids:
        prompt: str | list[int] = check_token_ids(
            obj["input_id"], "input_id", llm.tokenizer.vocab_size, non_empty=True,
            type_message="The type of input_id is abnormal",
            range_message="input_id must be token ids in [0,{max_id}]")
    else:
        prompt = read_inputs(obj)
    refuse_unknown(obj, FIELDS, "Field")
    stream = get_bool(obj, "stream", False, "Field")
    p = read_parameters(obj)
    refuse_unknown(p, PARAMETERS)
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


def mindie_parameters(p: dict, *, top_p_may_be_one: bool = False,
                      top_k_min: int = 1) -> GenerationParams:
    """MindIE's generation parameters (spec §2) -> the request's :class:`GenerationParams`.
    The Triton routes accept ``top_p == 1.0`` and ``top_k == 0``; /infer does not.

    Raises:
        APIError: 422 with MindIE's message for a parameter out of range or of a wrong type.
    """
    return GenerationParams(
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


def _details(ev: TokenEvent, request: GenerationRequest) -> dict:
    return {"finish_reason": ev.finish_reason, "generated_tokens": ev.index + 1,
            "seed": request.sampling.seed, **speculation_details(ev)}


def speculation_details(ev: TokenEvent) -> dict:
    """``details``' ``proposed_tokens`` / ``accepted_tokens`` (tiny_mindie's own): present only
    when speculative decoding verified proposals for the request, so MindIE's shape is kept
    otherwise."""
    if not ev.proposed_tokens:
        return {}
    return {"proposed_tokens": ev.proposed_tokens, "accepted_tokens": ev.accepted_tokens}


def stream_event(ev: TokenEvent, request: GenerationRequest, details: bool) -> dict:
    """One SSE event of the ``/infer`` stream (spec §2): the last one carries
    ``generated_text``, ``details`` (or null) and its token with ``"text": null``."""
    out: dict = {
        "prefill_time": None if ev.prefill_time_ms is None else round(ev.prefill_time_ms, 2),
        "decode_time": None if ev.decode_time_ms is None else round(ev.decode_time_ms, 2)}
    if ev.is_last:
        out["generated_text"] = ev.generated_text
        out["details"] = _details(ev, request) if details else None
        out["token"] = {"id": ev.token_id, "text": None}
    else:
        out["token"] = {"id": ev.token_id, "text": ev.text}
    return out


async def infer(req: Request, stream: ResponseStream, llm: LLM) -> Response | None:
    """``POST /infer``: MindIE's text inference, plain JSON or an SSE stream."""
    prompt, params, streaming, details = await asyncio.to_thread(parse_infer, req.body, llm)
    request = (await build(llm, prompt, params))[0]
    if streaming:
        await send_stream(stream, merged(llm, [request], record=stream.record), MINDIE,
                          lambda item: [stream_event(item[1], request, details)])
        return None
    done = await collect(llm, [request], stream)
    if done is None:
        return None
    evs = done[0]
    out: dict = {"generated_text": evs[-1].generated_text or ""}
    if details:
        out["details"] = _details(evs[-1], request)
    return json_response(200, out)


async def infer_token(req: Request, stream: ResponseStream, llm: LLM) -> Response | None:
    """``POST /infer_token``: ``/infer`` with token ids in (``input_id``), same answers."""
    obj = await read_json_object(req.body)
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
    obj = await read_json_object(req.body)
    text = read_inputs(obj)
    decode = get_bool(obj, "do_decode", False, "Field")

    def run() -> tuple[int, list]:          # in a worker thread: the event loop serves others
        ids = llm.prompt_ids(text)
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
    return [route("POST", "/infer", BUSINESS, lambda r, s, p: infer(r, s, app.llm),
                  generation=True),
            route("POST", "/infer_token", BUSINESS, lambda r, s, p: infer_token(r, s, app.llm),
                  generation=True),
            route("POST", "/v1/tokenizer", BUSINESS, lambda r, s, p: tokenizer(r, s, app.llm))]
