"""The OpenAI family (spec §4): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /v1/models/{model}`` (the model's card: OpenAI's fields, the
context in tokens as vLLM's ``max_model_len``, and llama-server's ``meta``; an embedding model
served beside it, ``--embedding-model``, has a card too, marked ``"task": "embedding"`` with
its ``dimensions``).

JSON -> validated :class:`~.request.Parsed` (:mod:`.request`; for chat, a
:class:`~.request.ChatBody` whose prompt is rendered with the tools and reasoning in,
:mod:`.chat`) -> one :class:`~tiny_mindie.engine.request.GenerationRequest` per prompt and
choice -> engine ->
OpenAI's JSON object (:mod:`.answer`) or SSE chunks ending with ``data: [DONE]``
(:mod:`.stream`).

What MindIE adds and checks: ``model`` must be the served model's name (else 404); extra fields
``top_k``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``; ``response_format`` and ``logit_bias``
are enforced (:mod:`..chat.structured`), and so are vLLM's and llama.cpp's constraint fields
(:mod:`..chat.guided`); every other top-level field is read, accepted as without effect, or refused
by name (:mod:`.fields`). Errors are OpenAI's ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad field (and for a body nested too deep), 404 for an unknown model, 422
for a body that is not a JSON object, 400 ``context_length_exceeded`` (``param`` ``messages`` /
``prompt``) for a prompt over the context (OpenAI's and vLLM's status, where ``/infer`` says
424), and the engine's other statuses (500 timeout, 503 stopped) as on ``/infer``.

Chat only: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (:mod:`..chat.tool_request`,
:mod:`..chat.tool_calls`: rendered by the model's template, calls parsed from its output or, for
``required`` and a named function, decoded under a JSON schema), ``reasoning_content`` for
templates that think, ``chat_template_kwargs``; ``/v1/completions`` answers them 400
(:data:`~.request.CHAT_ONLY`). ``response_format`` with tools is refused unless
``tool_choice`` is ``none``.
"""

from __future__ import annotations

import asyncio
import time

from ...llm import LLM
from ...server.conn import Response, ResponseStream, json_response
from ...server.http import Request
from ...server.routing import BUSINESS
from ..drive import route
from ..errors import OPENAI, APIError, Kind
from .answer import Envelope, make_requests, plain_answer
from .chat import prepare_chat
from .request import Parsed, no_such_model, parse_chat, parse_completion
from .stream import stream_answer

OWNED_BY = "MindIE Server"


def routes(app) -> list:
    """The OpenAI family's routes (spec §4), all on the business plane."""
    created = int(time.time())

    def model_card() -> dict:
        llm = app.llm
        return {"id": llm.model_name, "object": "model", "created": created,
                "owned_by": OWNED_BY, "max_model_len": llm.engine.max_seq_len,
                "meta": llm.model_meta}

    def cards() -> list[dict]:
        """The chat model's card, then the embedding model's (its ``task``:
        ``"embedding"``)."""
        out = [model_card()] if app.chat_model is not None else []
        if app.embedder is not None:
            c = app.embedder.model.config
            out.append({"id": c.name, "object": "model", "created": created,
                        "owned_by": OWNED_BY, "max_model_len": c.context,
                        "task": "embedding", "dimensions": c.hidden})
        return out

    async def chat(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        return await _chat(app, req, stream)

    async def completions(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        return await _completions(app, req, stream)

    async def list_models(req: Request, stream: ResponseStream, params: dict) -> Response:
        return json_response(200, {"object": "list", "data": cards()})

    async def get_model(req: Request, stream: ResponseStream, params: dict) -> Response:
        card = next((c for c in cards() if c["id"] == params["model"]), None)
        if card is None:
            raise no_such_model(params["model"])
        return json_response(200, card)

    return [
        route("POST", "/v1/chat/completions", BUSINESS, chat, style=OPENAI, generation=True),
        route("POST", "/v1/completions", BUSINESS, completions, style=OPENAI, generation=True),
        route("GET", "/v1/models", BUSINESS, list_models, style=OPENAI),
        route("GET", "/v1/models/{model}", BUSINESS, get_model, style=OPENAI),
    ]


async def _chat(app, req: Request, stream: ResponseStream) -> Response | None:
    """``/v1/chat/completions``: parse, the chat pipeline, the answer."""
    try:
        # off the event loop: a constraint's first compile builds llguidance's vocabulary
        chat, messages, extra, tools = await asyncio.to_thread(parse_chat, app, req.body)
        llm = app.llm
        p = await prepare_chat(llm, chat, messages, extra, tools)
        return await _answer(llm, stream, p, Envelope(chat=True, model=llm.model_name), [])
    except APIError as err:
        raise _context_error(err, "messages") from None


async def _completions(app, req: Request, stream: ResponseStream) -> Response | None:
    """``/v1/completions``: parse, the answer (the prompts echoed first with ``echo``)."""
    p = await asyncio.to_thread(parse_completion, app, req.body)   # as parse_chat
    llm = app.llm
    prefixes = [pr if isinstance(pr, str) else llm.tokenizer.decode(pr)
                for pr in p.prompts] if p.echo else []
    try:
        return await _answer(llm, stream, p, Envelope(chat=False, model=llm.model_name),
                             prefixes)
    except APIError as err:
        raise _context_error(err, "prompt") from None


async def _answer(llm: LLM, stream: ResponseStream, p: Parsed, env: Envelope,
                  prefixes: list[str]) -> Response | None:
    """Run the requests, plain or streamed; ``prefixes`` are the echoed prompts."""
    groups = await make_requests(llm, p)
    if p.stream:
        await stream_answer(llm, stream, p, env, prefixes, [r for g in groups for r in g])
        return None
    return await plain_answer(llm, stream, p, env, prefixes, groups)


def _context_error(err: APIError, param: str) -> APIError:
    """``err``, naming ``param`` when it is a prompt over the context (OpenAI's 400
    ``context_length_exceeded``), in OpenAI's words where the prompt's length is known (the
    engine's :class:`~tiny_mindie.engine.request.GenerationError` carries it): clients match
    them (litellm raises its ``ContextWindowExceededError`` on "maximum context length is")."""
    if err.kind is Kind.TOO_LONG and err.param is None:
        err.param = param
        cause = err.engine_error
        if cause is not None and cause.limit is not None and not cause.at_least:
            err.message = (f"This model's maximum context length is {cause.limit} tokens. "
                           f"However, you requested {cause.length} tokens in the {param}. "
                           f"Please reduce the length of the {param}.")
    return err
