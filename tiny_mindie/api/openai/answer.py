"""OpenAI's answers: the engine requests of a validated request, the answer as one JSON object
(``chat.completion`` / ``text_completion``), and the pieces the streamed answer
(:mod:`.stream`) shares with it -- the envelope, logprob entries, ``usage``, finish
reasons and a chat choice's split into ``reasoning_content``, ``content`` and ``tool_calls``.
"""

from __future__ import annotations

import time
import uuid

from ...engine.request import GenerationRequest, TokenEvent
from ...llm import LLM
from ...server.conn import Response, ResponseStream, json_response
from ..chat import tool_calls as tc
from ..drive import build, collect
from .request import Answer, Parsed

MIN_LOGPROB = -9999.0       # JSON has no -inf (vLLM's convention)


async def make_requests(llm: LLM, p: Parsed) -> list[list[GenerationRequest]]:
    """One group of ``p.n`` requests per prompt, choice ``j`` seeded ``seed + j``
    (:meth:`~tiny_mindie.engine.request.GenerationParams.requests`): a chat's ids, checked
    when it was encoded, as they are; each other prompt tokenized and checked once, off the
    event loop (:func:`~..drive.build`).

    Raises:
        APIError: 424 (``TOO_LONG``) when a prompt cannot fit, 422 when it has no token.
    """
    if p.checked:
        return [p.params.requests(ids) for ids in p.prompts]
    return [await build(llm, prompt, p.params) for prompt in p.prompts]


# ---- shapes both answers share -----------------------------------------------------------
def finish_reason(ev: TokenEvent) -> str:
    """OpenAI's ``finish_reason`` of a last event: ``length`` or ``stop``."""
    return "length" if ev.finish_reason == "length" else "stop"


def counted(ev: TokenEvent) -> bool:
    """Whether the token is part of the output (an end-of-generation token is not)."""
    return ev.finish_reason != "eos_token"


class Formatter:
    """Token ids as OpenAI's logprob entries."""

    def __init__(self, llm: LLM):
        self.tok = llm.tokenizer

    def token(self, token_id: int) -> tuple[str, list[int]]:
        b = self.tok.token_bytes(token_id)
        if not b:   # control tokens: their stored text
            s = self.tok.token_text(token_id)
            return s, list(s.encode("utf-8"))
        return b.decode("utf-8", errors="replace"), list(b)

    @staticmethod
    def lp(x: float) -> float:
        return max(x, MIN_LOGPROB) if x == x else MIN_LOGPROB

    def chat_entry(self, ev: TokenEvent) -> dict:
        s, b = self.token(ev.token_id)
        top = []
        for tid, lp in ev.top_logprobs or ():
            ts, tb = self.token(tid)
            top.append({"token": ts, "logprob": self.lp(lp), "bytes": tb})
        return {"token": s, "logprob": self.lp(ev.logprob), "bytes": b, "top_logprobs": top}

    def completion_logprobs(self, events: list[TokenEvent], offset: int) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for ev in events:
            s, _ = self.token(ev.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(self.lp(ev.logprob))
            top = {self.token(t)[0]: self.lp(lp) for t, lp in ev.top_logprobs or ()}
            top.setdefault(s, self.lp(ev.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(ev.text)
        return out


def usage_dict(prompt: int, completion: int, cached: int) -> dict:
    """OpenAI's ``usage``; ``cached``: prompt tokens served from the prefix cache (per prompt,
    as ``prompt_tokens``: its first choice's)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Envelope:
    """What differs between chat and text completions: the object's name, its id's prefix."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def envelope(self, choices: list, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}


class Split:
    """One chat choice's output through :class:`~..chat.tool_calls.OutputParser`, token by token:
    the deltas as OpenAI's (``reasoning_content``, ``content``, ``tool_calls`` entries), and
    the whole message's parts put together; ``reasoning_tokens`` counts the tokens fed while
    inside the reasoning (its opening and closing tags included)."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.parser = answer.parser()
        self.parts: dict[str, list[str]] = {"reasoning_content": [], "content": []}
        self.calls: list[dict] = []
        self.reasoning_tokens = 0

    def feed(self, ev: TokenEvent) -> list[dict]:
        """The deltas ``ev`` completes (its last event also flushes the parser)."""
        before = self.parser.thinking
        got = self.parser.feed(ev.text or self.answer.markers.get(ev.token_id, ""))
        if (before or self.parser.thinking) and counted(ev):
            self.reasoning_tokens += 1
        if ev.is_last:
            got += self.parser.finish()
        deltas = []
        for kind, value in got:
            if kind == "call":
                if self.answer.one_call and self.calls:
                    continue
                index = len(self.calls)
                call = {"id": tc.call_id(self.answer.fmt), "type": "function",
                        "function": {"name": value.name, "arguments": value.arguments}}
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": index, "id": call["id"],
                                               "type": "function",
                                               "function": {"name": value.name,
                                                            "arguments": ""}}]})
                deltas.append({"tool_calls": [{"index": index,
                                               "function": {"arguments": value.arguments}}]})
            else:
                key = "reasoning_content" if kind == "reasoning" else "content"
                self.parts[key].append(value)
                deltas.append({key: value})
        return deltas

    @property
    def content(self) -> str | None:
        return "".join(self.parts["content"]) or None

    @property
    def reasoning(self) -> str | None:
        return "".join(self.parts["reasoning_content"]) or None

    def finish_reason(self, finish: str) -> str:
        """``tool_calls`` when calls were made and the output was not cut off."""
        return "tool_calls" if self.calls and finish != "length" else finish


# ---- the answer as one JSON object -------------------------------------------------------
async def plain_answer(llm: LLM, stream: ResponseStream, p: Parsed, env: Envelope,
                       prefixes: list[str],
                       groups: list[list[GenerationRequest]]) -> Response | None:
    """Run ``groups`` (:func:`make_requests`) to the end and answer them as one object;
    ``prefixes`` are the echoed prompts. ``None`` when the client left.

    Raises:
        APIError: the engine's error (:func:`~.drive.collect`).
    """
    done = await collect(llm, [r for g in groups for r in g], stream)
    if done is None:
        return None
    fmt = Formatter(llm)
    choices = []
    reasoning_tokens = 0
    for idx, events in enumerate(done):
        if env.chat:
            choice, thought = _chat_choice(p, fmt, idx, events)
            reasoning_tokens += thought
        else:
            choice = _text_choice(p, fmt, idx, events, prefixes[idx // p.n] if prefixes else "")
        choices.append(choice)
    out = env.envelope(choices, chunk=False)
    out["usage"] = _usage([done[g * p.n:(g + 1) * p.n] for g in range(len(groups))])
    if p.answer is not None and p.answer.reasoning:
        out["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return json_response(200, out)


def _chat_choice(p: Parsed, fmt: Formatter, idx: int,
                 events: list[TokenEvent]) -> tuple[dict, int]:
    """A chat choice (its message split as :attr:`Parsed.answer` says) and its reasoning
    tokens."""
    last = events[-1]
    finish = finish_reason(last)
    message = {"role": "assistant", "content": last.generated_text or ""}
    reasoning_tokens = 0
    if p.answer is not None:
        split = Split(p.answer)
        for ev in events:
            split.feed(ev)
        message["content"] = split.content
        if p.answer.reasoning:
            message["reasoning_content"] = split.reasoning
            reasoning_tokens = split.reasoning_tokens
        if split.calls:
            message["tool_calls"] = split.calls
            finish = split.finish_reason(finish)
    shown = [ev for ev in events if counted(ev)]
    return {"index": idx, "message": message,
            "logprobs": ({"content": [fmt.chat_entry(ev) for ev in shown]}
                         if p.logprobs else None),
            "finish_reason": finish}, reasoning_tokens


def _text_choice(p: Parsed, fmt: Formatter, idx: int, events: list[TokenEvent],
                 prefix: str) -> dict:
    """A text completion's choice, the echoed ``prefix`` before its text."""
    last = events[-1]
    shown = [ev for ev in events if counted(ev)]
    return {"index": idx, "text": prefix + (last.generated_text or ""),
            "logprobs": (fmt.completion_logprobs(shown, len(prefix)) if p.logprobs else None),
            "finish_reason": finish_reason(last)}


def _usage(groups: list[list[list[TokenEvent]]]) -> dict:
    prompt = sum(g[0][0].prompt_tokens for g in groups)
    completion = sum(len(evs) for g in groups for evs in g)
    return usage_dict(prompt, completion, sum(g[0][0].cached_tokens for g in groups))
