"""Anthropic's Messages API: ``POST /v1/messages``.

The body is checked and translated into a chat completions body (:mod:`.anthropic_request`),
run through the chat pipeline (:mod:`.openai.bridge`), and answered as a ``message``: its
``content`` blocks -- ``thinking`` (for a template that thinks), ``text``, ``tool_use`` -- in
the order the model wrote them, ``stop_reason`` (``end_turn``, ``max_tokens``,
``stop_sequence`` with the ``stop_sequence`` that matched, ``tool_use``) and ``usage``
(``input_tokens`` not read from the prefix cache, ``cache_read_input_tokens`` those that
were, ``output_tokens``). Streamed, it is Anthropic's event sequence, each SSE event named by
its type: ``message_start``, ``ping``, per block ``content_block_start``,
``content_block_delta`` (``text_delta``, ``thinking_delta``, ``input_json_delta``) and
``content_block_stop``, then ``message_delta`` (``stop_reason``, ``usage``) and
``message_stop``. Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``
(:class:`~.errors.AnthropicStyle`), also as the stream's ``error`` event after its head.
"""

from __future__ import annotations

import json
import uuid

from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS
from .anthropic_request import to_chat, tool_use_id
from .drive import NAMED_EVENTS, merged, route, send_stream
from .errors import ANTHROPIC, APIError, Kind
from .openai.bridge import CALL, REASONING, Block, Blocks, chat_requests, run_blocks
from .validate import read_json_object

#: Chat fields named in an error -> the Messages field that sent them.
RENAME = {"stop": "stop_sequences", "reasoning_effort": "thinking",
          "response_format": "output_config.format",
          "chat_template_kwargs": "thinking", "parallel_tool_calls": "tool_choice",
          "tool_call_id": "tool_use_id", "tool_calls[].id": "tool_use blocks' id"}


def routes(app) -> list:
    """The Messages route, on the business plane."""
    async def messages(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        return await _messages(app, req, stream)

    return [route("POST", "/v1/messages", BUSINESS, messages, style=ANTHROPIC,
                  generation=True)]


async def _messages(app, req: Request, stream: ResponseStream) -> Response | None:
    obj = await read_json_object(req.body)
    try:
        chat, origins = to_chat(obj)
        p, request = await chat_requests(app, chat, RENAME, origins)
    except APIError as err:
        cause = err.engine_error
        if err.kind is Kind.TOO_LONG and cause is not None and cause.limit is not None:
            # Anthropic's words, which its clients match to compact a conversation
            err.message = (f"prompt is too long: {'at least ' if cause.at_least else ''}"
                           f"{cause.length} tokens > {cause.limit} maximum")
        raise
    shape = _Shape(app.llm, obj)
    if p.stream:
        events = _Events(shape, Blocks(p))
        await send_stream(stream, merged(app.llm, [request], record=stream.record), ANTHROPIC,
                          events.render, closing=events.closing, framing=NAMED_EVENTS)
        return None
    blocks = await run_blocks(app.llm, request, p, stream)
    if blocks is None:
        return None
    return json_response(200, shape.message(blocks))


class _Shape:
    """The ``message`` of one request and its content blocks."""

    def __init__(self, llm, obj: dict):
        self.id = "msg_" + uuid.uuid4().hex
        self.model = llm.model_name
        self.tok = llm.tokenizer
        stops = obj.get("stop_sequences")
        self.stops = list(stops) if isinstance(stops, list) else []

    @staticmethod
    def block(block: Block, done: bool) -> dict:
        """A content block (``done``: complete, else as it starts)."""
        if block.kind == CALL:
            return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name,
                    "input": json.loads(block.text or "{}") if done else {}}
        if block.kind == REASONING:
            return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
        return {"type": "text", "text": block.text if done else ""}

    def usage(self, blocks: Blocks) -> dict:
        return {"input_tokens": blocks.prompt_tokens - blocks.cached_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": blocks.cached_tokens,
                "output_tokens": blocks.output_tokens}

    def stop(self, blocks: Blocks) -> dict:
        """``stop_reason`` and ``stop_sequence``."""
        if blocks.finish == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if blocks.calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        matched = blocks.stop_sequence(self.stops, self.tok)
        return {"stop_reason": "stop_sequence" if matched is not None else "end_turn",
                "stop_sequence": matched}

    def message(self, blocks: Blocks | None) -> dict:
        """The ``message``: as it starts (``blocks`` ``None``) or complete."""
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": 0, "output_tokens": 0}}
        if blocks is not None:
            out.update(content=[self.block(b, True) for b in blocks.blocks],
                       usage=self.usage(blocks), **self.stop(blocks))
        return out


class _Events:
    """One streamed message's events."""

    DELTAS = {CALL: ("input_json_delta", "partial_json"),
              REASONING: ("thinking_delta", "thinking")}

    def __init__(self, shape: _Shape, blocks: Blocks):
        self.shape, self.blocks = shape, blocks
        self.started = False

    def render(self, item) -> list[dict]:
        """The events of one engine event (the first starts the message)."""
        _, ev = item
        out = []
        if not self.started:
            self.started = True
            message = self.shape.message(None)
            message["usage"] = {"input_tokens": ev.prompt_tokens - ev.cached_tokens,
                                "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": ev.cached_tokens, "output_tokens": 0}
            out += [{"type": "message_start", "message": message}, {"type": "ping"}]
        for what, block, text in self.blocks.feed(ev):
            if what == "open":
                out.append({"type": "content_block_start", "index": block.index,
                            "content_block": self.shape.block(block, False)})
            elif what == "delta":
                kind, key = self.DELTAS.get(block.kind, ("text_delta", "text"))
                out.append({"type": "content_block_delta", "index": block.index,
                            "delta": {"type": kind, key: text}})
            else:
                out.append({"type": "content_block_stop", "index": block.index})
        return out

    def closing(self) -> list[dict]:
        """``message_delta`` (the stop and the usage), ``message_stop``."""
        return [{"type": "message_delta", "delta": self.shape.stop(self.blocks),
                 "usage": self.shape.usage(self.blocks)},
                {"type": "message_stop"}]
