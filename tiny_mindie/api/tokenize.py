"""``POST /tokenize`` and ``POST /detokenize`` as llama-server and vLLM spell them: one route
each, taking either server's body as its clients send it.

``/tokenize``:

* llama-server's ``{"content", "add_special"?, "parse_special"?, "with_pieces"?}`` ->
  ``{"tokens": [id, ...]}``, or with ``with_pieces`` ``{"tokens": [{"id", "piece"}, ...]}``
  (a piece is its text, or its bytes as a list of integers where they are no UTF-8 text).
  ``add_special`` (default false) adds the BOS token by the model's rule; ``parse_special``
  (default true) reads control tokens spelled in the text as themselves.
* vLLM's ``{"model"?, "prompt", "add_special_tokens"?, "return_token_strs"?}`` (default
  ``add_special_tokens`` true), or ``{"model"?, "messages", "add_generation_prompt"?,
  "continue_final_message"?, "add_special_tokens"?, "chat_template_kwargs"?, "tools"?}`` (the
  chat's prompt as ``/v1/chat/completions`` renders it, those fields as it takes them) ->
  ``{"count", "max_model_len", "tokens", "token_strs"}``.

``/detokenize``: ``{"model"?, "tokens": [id, ...]}`` (both servers' shape) -> ``{"content",
"prompt"}``: the text, under llama-server's key and vLLM's; control tokens as their text.

Nothing generates, so nothing is counted in ``/metrics``' request counters; each request has
its access log line. Errors are OpenAI's (both servers answer in that style).
"""

from __future__ import annotations

import asyncio

from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS
from .drive import route
from .errors import OPENAI, bad
from .openai.bridge import chat_requests
from .openai.request import no_such_model
from .openai.responses_request import unknown
from .validate import check_token_ids, get_bool, read_json_object

LLAMA_FIELDS = ("content", "add_special", "parse_special", "with_pieces")
VLLM_PROMPT_FIELDS = ("model", "prompt", "add_special_tokens", "return_token_strs")
VLLM_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message",
                    "add_special_tokens", "return_token_strs", "chat_template_kwargs", "tools")


def routes(app) -> list:
    """``/tokenize`` and ``/detokenize``, on the business plane."""
    async def tok(req: Request, stream: ResponseStream, params: dict) -> Response:
        return await tokenize(app, req)

    async def detok(req: Request, stream: ResponseStream, params: dict) -> Response:
        return await detokenize(app, req)

    return [route("POST", "/tokenize", BUSINESS, tok, style=OPENAI),
            route("POST", "/detokenize", BUSINESS, detok, style=OPENAI)]


def _only(obj: dict, fields: tuple[str, ...]) -> None:
    """400 ``unknown_parameter`` for a field of ``obj`` not in ``fields``."""
    for name in obj:
        if name not in fields:
            raise unknown(name, f" This body takes {', '.join(fields)}.")


def _model(app, obj: dict) -> None:
    name = obj.get("model")
    if name is not None and name != app.llm.model_name:
        raise no_such_model(str(name))


async def tokenize(app, req: Request) -> Response:
    """``POST /tokenize`` in either shape (the module's docstring).

    Raises:
        APIError: 400 naming a bad or unknown field, a body with none of ``content``,
            ``prompt`` and ``messages``; 404 for another ``model``; as
            :func:`~.openai.bridge.chat_requests` for ``messages``.
    """
    obj = await read_json_object(req.body)
    if "content" in obj:
        return await _llama(app, obj)
    if "prompt" in obj or "messages" in obj:
        return await _vllm(app, obj)
    raise bad("Parameter content (llama-server), prompt or messages (vLLM) is required.",
              "content")


async def _llama(app, obj: dict) -> Response:
    _only(obj, LLAMA_FIELDS)
    if not isinstance(obj["content"], str):
        raise bad("Parameter content must be a string.", "content")
    special = get_bool(obj, "add_special", False)
    parse = get_bool(obj, "parse_special", True)
    pieces = get_bool(obj, "with_pieces", False)
    tok = app.llm.tokenizer

    def run() -> list:
        ids = tok.encode(obj["content"], add_bos=None if special else False,
                         parse_special=parse)
        if not pieces:
            return ids
        return [{"id": i, "piece": _piece(tok, i)} for i in ids]

    return json_response(200, {"tokens": await asyncio.to_thread(run)})


def _piece(tok, token_id: int):
    """A token's text, or its bytes (a list of integers) where they are no UTF-8 text."""
    raw = tok.token_bytes(token_id)
    if not raw:
        return tok.token_text(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def _vllm(app, obj: dict) -> Response:
    chat = "messages" in obj
    _only(obj, VLLM_CHAT_FIELDS if chat else VLLM_PROMPT_FIELDS)
    _model(app, obj)
    strs = get_bool(obj, "return_token_strs", False)
    llm = app.llm
    if chat:
        body = {k: obj[k] for k in VLLM_CHAT_FIELDS
                if k not in ("model", "return_token_strs") and k in obj}
        if body.get("tools") is not None:
            body["tool_choice"] = "auto"
        p, _ = await chat_requests(app, {"model": llm.model_name, "max_tokens": 1, **body}, {})
        ids = list(p.prompts[0])
    else:
        if not isinstance(obj["prompt"], str):
            raise bad("Parameter prompt must be a string.", "prompt")
        special = get_bool(obj, "add_special_tokens", True)
        ids = await asyncio.to_thread(llm.tokenizer.encode, obj["prompt"],
                                      add_bos=None if special else False)
    tok = llm.tokenizer
    return json_response(200, {"count": len(ids), "max_model_len": llm.engine.max_seq_len,
                               "tokens": ids,
                               "token_strs": [_piece_text(tok, i) for i in ids] if strs
                               else None})


def _piece_text(tok, token_id: int) -> str:
    piece = _piece(tok, token_id)
    return piece if isinstance(piece, str) else bytes(piece).decode("utf-8", "replace")


async def detokenize(app, req: Request) -> Response:
    """``POST /detokenize`` ``{"model"?, "tokens"}`` -> ``{"content", "prompt"}``.

    Raises:
        APIError: 400 for ``tokens`` not a list of the vocabulary's ids, or another field;
            404 for another ``model``.
    """
    obj = await read_json_object(req.body)
    _only(obj, ("model", "tokens"))
    _model(app, obj)
    tok = app.llm.tokenizer
    ids = check_token_ids(obj.get("tokens"), "tokens", tok.vocab_size)
    text = await asyncio.to_thread(tok.decode, ids, skip_special=False)
    return json_response(200, {"content": text, "prompt": text})
