"""OpenAI's streamed answers: each choice's tokens as SSE chunks as they come
(``chat.completion.chunk`` deltas, or ``text_completion`` pieces), a last chunk with ``usage``
when asked for (``stream_options.include_usage``), then ``data: [DONE]``."""

from __future__ import annotations

from ...engine.request import GenerationRequest, TokenEvent
from ...llm import LLM
from ...server.conn import ResponseStream
from ..drive import OPENAI_EVENTS, merged, send_stream
from ..errors import OPENAI
from .answer import Envelope, Formatter, Split, counted, finish_reason, usage_dict
from .request import Parsed


async def stream_answer(llm: LLM, stream: ResponseStream, p: Parsed, env: Envelope,
                        prefixes: list[str], flat: list[GenerationRequest]) -> None:
    """The SSE chunks of ``flat``'s choices (``p.n`` a prompt) as their tokens come, then
    ``data: [DONE]``; ``prefixes`` are the echoed prompts. An engine error before the first
    token is raised (its own status), one after it is the stream's last event."""
    chunks = _Chunks(llm, p, env, prefixes, len(flat))
    await send_stream(stream, merged(llm, flat, record=stream.record), OPENAI, chunks.event,
                      opening=chunks.opening(), closing=chunks.closing, framing=OPENAI_EVENTS)


class _Chunks:
    """One streamed answer's chunks, and the counts its ``usage`` needs."""

    def __init__(self, llm: LLM, p: Parsed, env: Envelope, prefixes: list[str], choices: int):
        self.p, self.env, self.prefixes = p, env, prefixes
        self.fmt = Formatter(llm)
        self.counts = [0] * choices
        self.prompt_tokens = [0] * (choices // p.n)
        self.cached_tokens = [0] * (choices // p.n)
        self.offsets = [len(prefixes[i // p.n]) if prefixes else 0 for i in range(choices)]
        self.splits = ([Split(p.answer) for _ in range(choices)]
                       if env.chat and p.answer is not None else None)

    def chunk(self, choices: list, usage=None) -> dict:
        return {**self.env.envelope(choices, chunk=True),
                **({"usage": usage} if self.p.include_usage else {})}

    def opening(self) -> list[dict]:
        """Chat's first chunk (each choice's ``role``), or the echoed prompts."""
        n = len(self.counts)
        if self.env.chat:
            return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None} for i in range(n)])]
        if any(self.prefixes):
            return [self.chunk([{"index": i, "text": self.prefixes[i // self.p.n],
                                 "logprobs": None, "finish_reason": None} for i in range(n)])]
        return []

    def event(self, item: tuple[int, TokenEvent]) -> list[dict]:
        """The chunks of choice ``i``'s event ``ev`` (``item``: ``(i, ev)``)."""
        i, ev = item
        n = self.p.n
        self.counts[i] += 1
        self.prompt_tokens[i // n] = ev.prompt_tokens
        if i % n == 0:
            self.cached_tokens[i // n] = ev.cached_tokens
        lp = self.p.logprobs and counted(ev)
        finish = finish_reason(ev) if ev.is_last else None
        if self.splits is not None:
            return self._split(i, ev, lp, finish)
        if self.env.chat:
            return self._chat(i, ev, lp, finish)
        return self._text(i, ev, lp, finish)

    def _split(self, i: int, ev: TokenEvent, lp: bool, finish: str | None) -> list[dict]:
        """A chat event through its choice's :class:`~.answer.Split`: a chunk a delta
        (the logprobs on the first), one for the logprobs alone, and the finish."""
        out = []
        deltas = self.splits[i].feed(ev)
        for k, delta in enumerate(deltas or ([{}] if lp else [])):
            out.append(self.chunk([{"index": i, "delta": delta,
                                    "logprobs": ({"content": [self.fmt.chat_entry(ev)]}
                                                 if lp and k == 0 else None),
                                    "finish_reason": None}]))
        if finish:
            out.append(self.chunk([{"index": i, "delta": {}, "logprobs": None,
                                    "finish_reason": self.splits[i].finish_reason(finish)}]))
        return out

    def _chat(self, i: int, ev: TokenEvent, lp: bool, finish: str | None) -> list[dict]:
        out = []
        if ev.text or lp:
            out.append(self.chunk([{"index": i, "delta": {"content": ev.text},
                                    "logprobs": ({"content": [self.fmt.chat_entry(ev)]} if lp
                                                 else None), "finish_reason": None}]))
        if finish:
            out.append(self.chunk([{"index": i, "delta": {}, "logprobs": None,
                                    "finish_reason": finish}]))
        return out

    def _text(self, i: int, ev: TokenEvent, lp: bool, finish: str | None) -> list[dict]:
        out = []
        if ev.text or lp or finish:
            out.append(self.chunk([{"index": i, "text": ev.text,
                                    "logprobs": (self.fmt.completion_logprobs([ev], self.offsets[i])
                                                 if lp else None), "finish_reason": finish}]))
            self.offsets[i] += len(ev.text)
        return out

    def closing(self) -> list[dict]:
        """The ``usage`` chunk, when asked for."""
        if not self.p.include_usage:
            return []
        usage = usage_dict(sum(self.prompt_tokens), sum(self.counts), sum(self.cached_tokens))
        if self.splits is not None and self.p.answer.reasoning:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(s.reasoning_tokens for s in self.splits)}
        return [self.chunk([], usage)]
