"""OpenAI's Responses API: ``POST /v1/responses``.

The body is checked and translated into a chat completions body
(:mod:`.responses_request`), run through the chat pipeline (:mod:`.bridge`), and the
answer given as a ``response`` object: its ``output`` items -- ``reasoning`` (for a template
that thinks), ``message`` (one ``output_text`` part), ``function_call`` -- in the order the
model wrote them, ``status`` ``completed`` (``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when cut off, and so is the status of the item cut off), ``usage``.
Streamed (``stream: true``), it is the Responses event sequence, each event numbered
(``sequence_number``) and named (SSE ``event:``):
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``,
its content (``response.content_part.added``, ``response.output_text.delta`` ...
``.done``, ``response.content_part.done``; ``response.reasoning_text.delta`` / ``.done``;
``response.function_call_arguments.delta`` / ``.done``) and ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete``) with the whole response. No response
is stored. Errors are OpenAI's; one after the stream's head is its ``error`` event.
"""

from __future__ import annotations

import time
import uuid

from ...server.conn import Response, ResponseStream, json_response
from ...server.http import Request
from ...server.routing import BUSINESS
from ..drive import NAMED_EVENTS, merged, route, send_stream
from ..errors import OPENAI, ResponsesEventStyle
from ..validate import read_json_object
from .bridge import CALL, REASONING, Block, Blocks, chat_requests, run_blocks
from .responses_request import check_fields, to_chat

#: Chat fields named in an error -> the Responses field that sent them.
RENAME = {"messages": "input", "max_tokens": "max_output_tokens",
          "response_format.json_schema": "text.format", "response_format": "text.format",
          "reasoning_effort": "reasoning", "chat_template_kwargs": "reasoning",
          "tool_call_id": "call_id", "tool_calls[].id": "function_call items' call_id"}


def routes(app) -> list:
    """The Responses route, on the business plane."""
    async def responses(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        return await _responses(app, req, stream)

    return [route("POST", "/v1/responses", BUSINESS, responses, style=OPENAI,
                  generation=True)]


async def _responses(app, req: Request, stream: ResponseStream) -> Response | None:
    obj = await read_json_object(req.body)
    check_fields(obj)
    chat, origins = to_chat(obj)
    p, request = await chat_requests(app, chat, RENAME, origins)
    shape = _Shape(obj, app.llm.model_name)
    if p.stream:
        events = _Events(shape, Blocks(p, cut_call=True))
        await send_stream(stream, merged(app.llm, [request], record=stream.record),
                          ResponsesEventStyle(events.number), events.render,
                          closing=events.closing, framing=NAMED_EVENTS)
        return None
    blocks = await run_blocks(app.llm, request, p, stream, cut_call=True)
    if blocks is None:
        return None
    return json_response(200, shape.response(blocks))


class _Shape:
    """The ``response`` object of one request: the request's settings echoed, the output
    items of its :class:`~.bridge.Blocks`."""

    def __init__(self, obj: dict, model: str):
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.model = model
        tools = [{**t, "strict": t.get("strict", True)} for t in obj.get("tools") or ()]
        self.echo = {
            "instructions": obj.get("instructions"),
            "max_output_tokens": obj.get("max_output_tokens"),
            "metadata": obj.get("metadata") or {},
            "parallel_tool_calls": obj.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None,
            "reasoning": obj.get("reasoning") or {"effort": None, "summary": None},
            "store": False,
            "temperature": obj.get("temperature", 1.0),
            "text": obj.get("text") or {"format": {"type": "text"}},
            "tool_choice": obj.get("tool_choice") or ("auto" if tools else "none"),
            "tools": tools,
            "top_p": obj.get("top_p", 1.0),
            "truncation": "disabled",
            "user": obj.get("user"),
        }
        self.item_ids: dict[int, str] = {}

    def item_id(self, block: Block) -> str:
        prefix = {REASONING: "rs_", CALL: "fc_"}.get(block.kind, "msg_")
        return self.item_ids.setdefault(block.index, prefix + uuid.uuid4().hex)

    def item(self, block: Block, done: bool, cut: bool = False) -> dict:
        """The output item of ``block`` (``done``: complete, else as it opens; ``cut``: the
        one ``max_output_tokens`` cut off, status ``incomplete``)."""
        status = "incomplete" if cut else "completed" if done else "in_progress"
        if block.kind == CALL:
            return {"id": self.item_id(block), "type": "function_call", "status": status,
                    "call_id": block.call_id, "name": block.name,
                    "arguments": block.text if done else ""}
        if block.kind == REASONING:
            return {"id": self.item_id(block), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": block.text}] if done else []}
        return {"id": self.item_id(block), "type": "message", "role": "assistant",
                "status": status, "content": [self.part(block)] if done else []}

    @staticmethod
    def part(block: Block) -> dict:
        return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}

    def response(self, blocks: Blocks | None) -> dict:
        """The ``response`` object: in progress (``blocks`` ``None``) or complete."""
        out = {"id": self.id, "object": "response", "created_at": self.created_at,
               "model": self.model, "status": "in_progress", "error": None,
               "incomplete_details": None, "output": [], "usage": None, **self.echo}
        if blocks is None:
            return out
        cut = blocks.finish == "length"
        out.update(status="incomplete" if cut else "completed",
                   incomplete_details={"reason": "max_output_tokens"} if cut else None,
                   output=[self.item(b, True, cut and b is blocks.blocks[-1])
                           for b in blocks.blocks],
                   usage={"input_tokens": blocks.prompt_tokens,
                          "input_tokens_details": {"cached_tokens": blocks.cached_tokens},
                          "output_tokens": blocks.output_tokens,
                          "output_tokens_details": {"reasoning_tokens": blocks.reasoning_tokens},
                          "total_tokens": blocks.prompt_tokens + blocks.output_tokens})
        return out


class _Events:
    """One streamed response's events, numbered."""

    def __init__(self, shape: _Shape, blocks: Blocks):
        self.shape, self.blocks = shape, blocks
        self.sequence = 0

    def number(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def event(self, kind: str, **fields) -> dict:
        return {"type": "response." + kind, "sequence_number": self.number(), **fields}

    def render(self, item) -> list[dict]:
        """The events of one engine event (the first opens the response)."""
        _, ev = item
        out = []
        if self.sequence == 0:
            out += [self.event(k, response=self.shape.response(None))
                    for k in ("created", "in_progress")]
        for what, block, text in self.blocks.feed(ev):
            out += getattr(self, "_" + what)(block, text)
        return out

    def _where(self, block: Block) -> dict:
        return {"item_id": self.shape.item_id(block), "output_index": block.index}

    def _open(self, block: Block, _: str) -> list[dict]:
        out = [self.event("output_item.added", output_index=block.index,
                          item=self.shape.item(block, False))]
        if block.kind not in (CALL, REASONING):
            out.append(self.event("content_part.added", **self._where(block), content_index=0,
                                  part=self.shape.part(Block(block.kind, block.index))))
        return out

    def _delta(self, block: Block, text: str) -> list[dict]:
        kind = {CALL: "function_call_arguments.delta",
                REASONING: "reasoning_text.delta"}.get(block.kind, "output_text.delta")
        extra = {} if block.kind == CALL else {"content_index": 0}
        if block.kind not in (CALL, REASONING):
            extra["logprobs"] = []
        return [self.event(kind, **self._where(block), **extra, delta=text)]

    def _close(self, block: Block, _: str) -> list[dict]:
        where = self._where(block)
        if block.kind == CALL:
            out = [self.event("function_call_arguments.done", **where, name=block.name,
                              arguments=block.text)]
        elif block.kind == REASONING:
            out = [self.event("reasoning_text.done", **where, content_index=0,
                              text=block.text)]
        else:
            out = [self.event("output_text.done", **where, content_index=0, text=block.text,
                              logprobs=[]),
                   self.event("content_part.done", **where, content_index=0,
                              part=self.shape.part(block))]
        cut = self.blocks.finish == "length"      # set by the last event, which closes
        return out + [self.event("output_item.done", output_index=block.index,
                                 item=self.shape.item(block, True, cut))]

    def closing(self) -> list[dict]:
        """``response.completed`` (``response.incomplete`` when cut off)."""
        response = self.shape.response(self.blocks)
        kind = "completed" if response["status"] == "completed" else "incomplete"
        return [self.event(kind, response=response)]
