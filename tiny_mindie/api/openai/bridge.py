"""The chat pipeline driven by another family's request (OpenAI Responses, Anthropic Messages),
and its answer as blocks.

The family translates its body into a chat completions body, which runs through the chat's
own validation, template, tools and grammar (:func:`~.request.parse_chat`,
:func:`~.chat.prepare_chat`): one pipeline, so a seeded request gives the same text
whichever of the three routes asks. The answer comes back as :class:`Blocks`: reasoning, text
and tool calls opened and closed one after the other, as both families stream them (an output
item or a content block each).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

from ...engine.request import GenerationRequest, TokenEvent
from ...llm import LLM
from ..chat import tool_calls as tc
from ..drive import collect
from ..errors import APIError, Kind
from .answer import Split, make_requests
from .chat import prepare_chat
from .request import Parsed, parse_chat

#: What a block holds: the model's reasoning, answer text, or a tool call.
REASONING, TEXT, CALL = "reasoning", "text", "call"

#: A call's name and where its arguments start, in the JSON text of a call cut off.
_CALL_NAME = re.compile(r'"name"\s*:\s*"([^"\\]{1,256})"')
_CALL_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


async def chat_requests(app, chat: dict, rename: dict[str, str],
                        origins: list[str] = ()) -> tuple[Parsed, GenerationRequest]:
    """The engine request of ``chat`` (a chat completions body) for ``app``'s model.

    Args:
        chat: the translated body (one choice: no ``n``).
        rename: chat field -> the family's field, for an error about it (its ``param`` and
            the field names in its message, :func:`rename_fields`).
        origins: per chat message, where the client sent it (``input[3]``), for an error
            naming ``messages[i]``.

    Raises:
        APIError: as :func:`~.request.parse_chat` and
            :func:`~.chat.prepare_chat`, the fields it names the family's; a prompt
            too long (``TOO_LONG``) names the field ``rename["messages"]``.
    """
    body = json.dumps(chat).encode()
    try:
        chat_body, messages, extra, tools = await asyncio.to_thread(parse_chat, app, body)
        p = await prepare_chat(app.llm, chat_body, messages, extra, tools)
        groups = await make_requests(app.llm, p)
    except APIError as err:
        if err.param is None and err.kind is Kind.TOO_LONG:
            err.param = "messages"
        if err.param is not None:
            err.param = rename_fields(err.param, rename, origins)
        err.message = rename_fields(err.message, rename, origins)
        err.args = (err.message,)
        raise
    return p, groups[0][0]


def rename_fields(text: str, rename: dict[str, str], origins: list[str] = ()) -> str:
    """``text`` (an error's message or ``param``) with each chat field of ``rename`` (whole
    words, the longest first: ``response_format.json_schema`` before ``response_format``)
    the family's, and ``messages[i]`` ``origins[i]`` (else ``rename["messages"]``'s
    ``[i]``). One pass, linear in ``len(text)``."""
    keys = sorted(rename, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w\[])(?:messages\[(?P<i>\d{1,9})\]|"
                         + "|".join(map(re.escape, keys)) + r")(?![\w\[])"
                         if keys else r"(?<![\w\[])messages\[(?P<i>\d{1,9})\](?![\w\[])")

    def one(m: re.Match) -> str:
        if m.group("i") is None:
            return rename[m.group(0)]
        i = int(m.group("i"))
        return origins[i] if i < len(origins) else f"{rename.get('messages', 'messages')}[{i}]"
    return pattern.sub(one, text)


@dataclasses.dataclass
class Block:
    """One part of the answer: ``kind`` :data:`REASONING`, :data:`TEXT` or :data:`CALL`;
    ``text`` its text (a call's: the arguments, JSON text); a call's ``name`` and
    ``call_id``; ``index``: its place among the answer's blocks (0-based)."""

    kind: str
    index: int
    text: str = ""
    name: str | None = None
    call_id: str | None = None


class Blocks:
    """One answer's token events as blocks: :meth:`feed` returns what each event does --
    ``("open", block, "")``, ``("delta", block, text)``, ``("close", block, "")`` -- and the
    counts both families' ``usage`` need. An answer with no text and no call is one empty
    text block.

    ``cut_call``: a tool call cut off by the token cap (the answer ends inside it) is a
    :data:`CALL` block of the arguments written so far, not text (:meth:`_cut_call`)."""

    def __init__(self, p: Parsed, cut_call: bool = False):
        self.split = Split(p.answer) if p.answer is not None else None
        self.cut_call = cut_call
        self.blocks: list[Block] = []
        self.open: Block | None = None
        self.output_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.token_ids: list[int] = []
        self.finish: str | None = None          # the engine's finish reason, at the end
        self.generated_text = ""

    @property
    def calls(self) -> list[Block]:
        return [b for b in self.blocks if b.kind == CALL]

    @property
    def reasoning_tokens(self) -> int:
        return self.split.reasoning_tokens if self.split is not None else 0

    def feed(self, ev: TokenEvent) -> list[tuple[str, Block, str]]:
        """What ``ev`` opens, adds and closes (its last event closes the last block)."""
        self.output_tokens += 1
        self.prompt_tokens, self.cached_tokens = ev.prompt_tokens, ev.cached_tokens
        self.token_ids.append(ev.token_id)
        out: list[tuple[str, Block, str]] = []
        if self.split is None:
            if ev.text:
                self._add(out, TEXT, ev.text)
        else:
            deltas = self.split.feed(ev)
            if ev.is_last and ev.finish_reason == "length" and self.cut_call:
                deltas = self._cut_call(deltas)
            for delta in deltas:
                self._delta(out, delta)
        if ev.is_last:
            self.finish, self.generated_text = ev.finish_reason, ev.generated_text or ""
            if not self.blocks:
                self._open(out, Block(TEXT, 0))
            self._close(out)
        return out

    def _cut_call(self, deltas: list[dict]) -> list[dict]:
        """``deltas`` with the text of a call cut off (the parser ends inside one, the last
        delta its text) as that call's deltas: its name read from the text, its arguments
        the text after ``"arguments":``; unchanged when the name is not there yet or is no
        offered tool's."""
        parser = self.split.parser
        if not deltas or not parser.in_call or parser.in_call == tc.FENCE_OPEN:
            return deltas
        text = deltas[-1].get("content") or ""
        name, args = _CALL_NAME.search(text), _CALL_ARGS.search(text)
        if name is None or args is None or args.start() < name.end() or (
                parser.names is not None and name.group(1) not in parser.names):
            return deltas
        call = {"index": len(self.split.calls), "id": tc.call_id(self.split.answer.fmt),
                "type": "function", "function": {"name": name.group(1), "arguments": ""}}
        return [*deltas[:-1], {"tool_calls": [call]},
                {"tool_calls": [{"index": call["index"],
                                 "function": {"arguments": text[args.end():]}}]}]

    def _delta(self, out: list, delta: dict) -> None:
        """A chat delta (:class:`~.answer.Split`'s) as blocks."""
        if "tool_calls" in delta:
            call = delta["tool_calls"][0]
            fn = call["function"]
            if "id" in call:
                self._open(out, Block(CALL, len(self.blocks), name=fn["name"],
                                      call_id=call["id"]))
            elif fn["arguments"]:
                self.open.text += fn["arguments"]
                out.append(("delta", self.open, fn["arguments"]))
        elif delta.get("reasoning_content"):
            self._add(out, REASONING, delta["reasoning_content"])
        elif delta.get("content"):
            self._add(out, TEXT, delta["content"])

    def _add(self, out: list, kind: str, text: str) -> None:
        if self.open is None or self.open.kind != kind:
            self._open(out, Block(kind, len(self.blocks)))
        self.open.text += text
        out.append(("delta", self.open, text))

    def _open(self, out: list, block: Block) -> None:
        self._close(out)
        self.blocks.append(block)
        self.open = block
        out.append(("open", block, ""))

    def _close(self, out: list) -> None:
        if self.open is not None:
            out.append(("close", self.open, ""))
            self.open = None

    def stop_sequence(self, stops: list[str], tok) -> str | None:
        """Which of the client's ``stops`` ended the answer (``None``: none did): the one
        found earliest from where the answer's text ends in the text of all its tokens."""
        if self.finish != "stop_sequence" or not stops:
            return None
        full = b"".join(tok.token_bytes(i) for i in self.token_ids).decode("utf-8", "replace")
        start = max(0, len(self.generated_text) - 1)
        found = [(at, k) for k, at in enumerate(full.find(s, start) for s in stops) if at >= 0]
        return stops[min(found)[1]] if found else None


async def run_blocks(llm: LLM, request: GenerationRequest, p: Parsed, stream,
                     cut_call: bool = False) -> Blocks | None:
    """``request`` run to its end, as :class:`Blocks` (``cut_call`` as theirs); ``None``
    when the client left.

    Raises:
        APIError: the engine's error.
    """
    done = await collect(llm, [request], stream)
    if done is None:
        return None
    blocks = Blocks(p, cut_call)
    for ev in done[0]:
        blocks.feed(ev)
    return blocks
