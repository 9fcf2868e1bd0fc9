"""The OpenAI family (spec §4): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /v1/models/{model}``.

JSON -> validated :class:`GenerationRequest` (one per prompt and choice) -> engine -> OpenAI's
JSON objects or SSE chunks ending with ``data: [DONE]``. Chat prompts are rendered by
:mod:`.chat_template`.

What MindIE adds and checks: ``model`` must be the served model's name (else 404); extra fields
``top_k``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``; ``response_format`` and ``logit_bias``
are enforced (:mod:`.structured`); ranges temperature >= 0 (0 = greedy),
top_p in (0, 1], presence/frequency_penalty in [-2, 2], repetition_penalty in (0, 2], n >= 1.
Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad field
(and for a body nested too deep), 404 for an unknown model, 422 for a body that is not a JSON
object, 400 ``context_length_exceeded`` (``param`` ``messages`` / ``prompt``) for a prompt over
the context (OpenAI's and vLLM's status, where ``/infer`` says 424), and the engine's other
statuses (500 timeout, 503 stopped) as on ``/infer``.

Chat only: ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (:mod:`.tool_calls`: rendered
by the model's template, calls parsed from its output or, for ``required`` and a named
function, decoded under a JSON schema), ``reasoning_content`` for templates that think,
``chat_template_kwargs``; ``/v1/completions`` answers them 400 (:data:`CHAT_ONLY`).
``response_format`` with tools is refused unless ``tool_choice`` is ``none``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid

from ..engine.request import Constraint, GenerationError, GenerationRequest, TokenEvent
from ..llm import LLM, MAX_SEED
from ..server.conn import Response, ResponseStream, json_response
from ..server.http import Request
from ..server.routing import BUSINESS
from . import tool_calls as tc
from .chat_template import CHATML, chatml_stops, encode_chat, template_uses_tools
from .drive import build, collect, fan_out, merged, route, send_stream
from .errors import OPENAI, APIError, Kind, bad, from_generation_error
from .structured import compiled, logit_bias, response_format
from .validate import check_token_ids, get_bool, get_float, get_int, parse_json_object

INT32_MAX = 2**31 - 1
INF = float("inf")
OWNED_BY = "MindIE Server"
MAX_CHOICES = 128           # n x prompts per request: each is a sequence in the engine
MAX_TOP_LOGPROBS = 20       # OpenAI's limit for chat's top_logprobs
MIN_LOGPROB = -9999.0       # JSON has no -inf (vLLM's convention)

# ---- errors ------------------------------------------------------------------------------
def _no_such_model(name: str) -> APIError:
    return APIError(Kind.NOT_FOUND, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


def _field(getter, d: dict, name: str, *args, **kwargs):
    """A shared validator's reading of ``d[name]``, its 422 turned into OpenAI's 400."""
    try:
        return getter(d, name, *args, **kwargs)
    except APIError as err:
        raise bad(err.message, name) from None


# ---- request parsing ---------------------------------------------------------------------
@dataclasses.dataclass
class Parsed:
    """A validated request: prompts (text or ids), engine parameters, and response options."""

    prompts: list                     # str | list[int] each
    params: dict                      # keyword arguments of LLM.make_request
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool                    # report logprobs at all
    top_logprobs: int                 # alternatives per token
    presence_penalty: float
    frequency_penalty: float
    echo: bool = False
    answer: Answer | None = None             # chat: how to split the output (None: plain text)


@dataclasses.dataclass
class ChatTools:
    """A chat request's validated ``tools`` (``None``: none), ``tool_choice`` and
    ``parallel_tool_calls`` (``None``: not sent). ``True`` lets ``required`` answer an array
    of calls; ``False`` stops an ``auto`` answer after its first call; unsent, ``auto`` may
    call several tools and ``required`` calls one (a small model asked for an array tends to
    repeat calls until ``max_tokens``)."""

    tools: list[tc.Tool] | None
    choice: tc.Choice
    parallel: bool | None


@dataclasses.dataclass(frozen=True)
class Answer:
    """How a chat answer's text is split (:class:`~.tool_calls.OutputParser`): the tool-call
    format parsed (``None``: none), whether the template thinks, whether the prompt ends inside
    ``<think>``."""

    fmt: str | None
    reasoning: bool
    in_reasoning: bool
    one_call: bool = False          # parallel_tool_calls false: calls after the first dropped
    markers: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    names: frozenset[str] | None = None     # the tools' names: calls to others stay content

    def parser(self) -> tc.OutputParser:
        return tc.OutputParser(self.fmt, reasoning=self.reasoning,
                               in_reasoning=self.in_reasoning, names=self.names)


def _check_model(app, obj: dict) -> None:
    name = obj.get("model")
    if name is None:
        raise bad("You must provide a model parameter.", "model")
    if not isinstance(name, str):
        raise bad(f"Parameter model must be a string, got {json.dumps(name)}.", "model")
    if name != app.llm.model_name:
        raise _no_such_model(name)


def _stop_strings(obj: dict) -> tuple[str, ...]:
    stop = obj.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("Parameter stop must be a string or a list of strings.", "stop")
    if any(not s for s in stop):
        raise bad("Parameter stop must not contain empty strings.", "stop")
    return tuple(stop)


def _token_ids(llm: LLM, value, name: str) -> list[int]:
    """:func:`check_token_ids` with OpenAI's 400."""
    try:
        return check_token_ids(value, name, llm.tokenizer.vocab_size)
    except APIError as err:
        raise bad(err.message, name) from None


def _common(app, obj: dict, default_max_tokens: int) -> dict:
    """The fields both completion routes share, as :class:`Parsed` keyword arguments."""
    llm = app.llm
    _check_model(app, obj)
    n = _field(get_int, obj, "n", 1, 1, MAX_CHOICES)
    stream = _field(get_bool, obj, "stream", False)
    opts = obj.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("Parameter stream_options is only allowed when stream is true.",
                      "stream_options")
        if not isinstance(opts, dict):
            raise bad("Parameter stream_options must be an object.", "stream_options")
        include_usage = _field(get_bool, opts, "include_usage", False)
    max_tokens = _field(get_int, obj, "max_tokens", None, 1, INT32_MAX)
    if obj.get("max_completion_tokens") is not None:
        max_tokens = _field(get_int, obj, "max_completion_tokens", None, 1, INT32_MAX)
    temperature = _field(get_float, obj, "temperature", 1.0, 0.0, INF, lo_open=False, hi_open=True)
    top_k = _field(get_int, obj, "top_k", 0, -1, INT32_MAX)
    best_of = _field(get_int, obj, "best_of", None, 1, MAX_CHOICES)
    if best_of is not None and best_of != n:
        raise bad("Parameter best_of is not supported (only best_of == n).", "best_of")
    stop_token_ids = obj.get("stop_token_ids")
    _field(get_bool, obj, "skip_special_tokens", True)   # special tokens never reach the text
    params = dict(
        max_new_tokens=max_tokens or default_max_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else 1.0,
        top_k=max(top_k, 0),
        top_p=_field(get_float, obj, "top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=_field(get_float, obj, "repetition_penalty", 1.0, 0.0, 2.0,
                                  lo_open=True, hi_open=False),
        seed=_field(get_int, obj, "seed", None, 0, MAX_SEED),
        stop=_stop_strings(obj),
        include_stop_string=_field(get_bool, obj, "include_stop_str_in_output", False),
        stop_token_ids=(() if stop_token_ids is None
                        else tuple(_token_ids(llm, stop_token_ids, "stop_token_ids"))),
        ignore_eos=_field(get_bool, obj, "ignore_eos", False),
        logit_bias=logit_bias(llm.tokenizer, obj.get("logit_bias")),
        constraint=response_format(llm.tokenizer, obj.get("response_format")),
    )
    return dict(params=params, n=n, stream=stream, include_usage=include_usage,
                presence_penalty=_field(get_float, obj, "presence_penalty", 0.0, -2.0, 2.0,
                                        lo_open=False, hi_open=False),
                frequency_penalty=_field(get_float, obj, "frequency_penalty", 0.0, -2.0, 2.0,
                                         lo_open=False, hi_open=False))


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: Chat's fields that ``/v1/completions`` refuses (400 naming them) rather than ignores.
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
             "functions", "function_call")


def _message_content(content, i: int):
    """A message's content as text: a string, or the text parts of a content-part list."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text content parts are supported.",
                          "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of content parts.", "messages")


def parse_chat(app, body: bytes) -> tuple[Parsed, list[dict], dict, ChatTools]:
    """Validate a chat body; returns the request, the messages for the template (assistant
    ``tool_calls`` arguments as objects), the template's extra keyword arguments
    (``chat_template_kwargs``) and the tools."""
    obj = parse_json_object(body)
    common = _common(app, obj, INT32_MAX)     # the engine caps it by maxIterTimes / maxSeqLen
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("Parameter messages must be a non-empty list of messages.", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role.", "messages")
        if m["role"] not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                      f"got {m['role']!r}.", "messages")
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise bad(f"messages[{i}].content is required.", "messages")
        out = {**m, "content": _message_content(m.get("content"), i)}
        out.pop("tool_calls", None)
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = _message_tool_calls(m["tool_calls"], i)
            if calls:       # templates test "tool_calls" in message: no empty list there
                out["tool_calls"] = calls
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id (a string) is required for role tool.",
                      "messages")
        rendered.append(out)
    logprobs = _field(get_bool, obj, "logprobs", False)
    top = _field(get_int, obj, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("Parameter top_logprobs requires logprobs to be true.", "top_logprobs")
    extra = obj.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise bad("Parameter chat_template_kwargs must be an object.", "chat_template_kwargs")
    for legacy in ("functions", "function_call"):
        if obj.get(legacy) is not None:
            raise bad(f"Parameter {legacy} (deprecated by OpenAI) is not supported: use tools "
                      "and tool_choice.", legacy)
    tools = tc.parse_tools(obj.get("tools"))
    choice = tc.parse_tool_choice(obj.get("tool_choice"), tools)
    if choice.mode == "auto" and any(t.strict for t in tools or ()):
        raise bad("Tools with strict true are enforced only with tool_choice 'required' or a "
                  "named function (decoding is then constrained to their schemas); with "
                  "'auto' the model's text is free.", "tools")
    if choice.mode == "auto" and common["params"]["constraint"] is not None:
        raise bad("Parameter response_format cannot be combined with tools under tool_choice "
                  "'auto' (the grammar would keep the model from writing its calls); use "
                  "tool_choice 'none', or 'required' / a named function without "
                  "response_format.", "response_format")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("Parameter parallel_tool_calls must be a boolean.", "parallel_tool_calls")
    if parallel is not None and not tools:
        raise bad("Parameter parallel_tool_calls is only allowed when tools are given.",
                  "parallel_tool_calls")
    p = Parsed(prompts=[], logprobs=logprobs, top_logprobs=top, **common)
    return p, rendered, extra, ChatTools(tools, choice, parallel)


def _message_tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates read them: each ``{"id",
    "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` parsed from
    its JSON text into an object (Hugging Face's convention, which the templates follow); an
    empty string is the empty object, any other string that is no JSON object is passed on
    as it is (OpenAI accepts any string; Qwen3's and Hermes' templates print a string as it
    is, Qwen2.5's quotes it)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list of tool calls.", "messages")
    out = []
    for k, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or c.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not isinstance(c.get("id"), str):
            raise bad(f"{where}[{k}] must be {{'id': str, 'type': 'function', 'function': "
                      "{'name': str, 'arguments': str}}.", "messages")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise bad(f"{where}[{k}].function.arguments must be a string (JSON text).",
                      "messages")
        try:
            parsed = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            parsed = None
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": parsed if isinstance(parsed, dict) else args}})
    return out


def parse_completion(app, body: bytes) -> Parsed:
    """Validate a ``/v1/completions`` body: ``prompt`` is a string, a list of strings, a list
    of token ids, or a list of such lists."""
    obj = parse_json_object(body)
    for name in CHAT_ONLY:
        if obj.get(name) is not None:
            raise bad(f"Parameter {name} is only supported on /v1/chat/completions.", name)
    common = _common(app, obj, 16)            # OpenAI's default for completions
    prompt = obj.get("prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [_token_ids(app.llm, prompt, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_token_ids(app.llm, p, "prompt") for p in prompt]
    else:
        raise bad("Parameter prompt must be a string, a list of strings, a list of token ids "
                  "or a list of lists of token ids.", "prompt")
    if any(not p for p in prompts):
        raise bad("Parameter prompt must not be empty.", "prompt")
    if len(prompts) * common["n"] > MAX_CHOICES:
        raise bad(f"At most {MAX_CHOICES} choices (prompts x n) per request.", "n")
    if obj.get("suffix") is not None:
        raise bad("Parameter suffix is not supported.", "suffix")
    lp = _field(get_int, obj, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = _field(get_bool, obj, "echo", False)
    if echo and lp is not None:
        raise bad("Parameter echo together with logprobs is not supported.", "echo")
    return Parsed(prompts=prompts, logprobs=lp is not None, top_logprobs=lp or 0, echo=echo,
                  **common)


async def make_requests(llm: LLM, p: Parsed) -> list[list[GenerationRequest]]:
    """One request per prompt and choice (:func:`~.drive.fan_out`: choice j seeded
    ``seed + j``); each prompt is tokenized once, off the event loop."""
    out = []
    for prompt in p.prompts:
        first = await build(llm, prompt, p.params)
        first = dataclasses.replace(
            first, top_logprobs=p.top_logprobs,
            sampling=dataclasses.replace(first.sampling, presence_penalty=p.presence_penalty,
                                         frequency_penalty=p.frequency_penalty))
        out.append(fan_out(first, p.n))
    return out


# ---- responses ---------------------------------------------------------------------------
def _finish_reason(ev: TokenEvent) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def _counted(ev: TokenEvent) -> bool:
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


def _usage(groups: list[list[list[TokenEvent]]]) -> dict:
    prompt = sum(g[0][0].prompt_tokens for g in groups)
    completion = sum(len(evs) for g in groups for evs in g)
    return _usage_dict(prompt, completion, sum(g[0][0].cached_tokens for g in groups))


def _usage_dict(prompt: int, completion: int, cached: int) -> dict:
    """OpenAI's ``usage``; ``cached``: prompt tokens served from the prefix cache (per prompt,
    as ``prompt_tokens``: its first choice's)."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class _Kind:
    """What differs between chat and text completions."""

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


async def _answer(llm: LLM, stream: ResponseStream, p: Parsed, kind: _Kind,
                  prefixes: list[str]) -> Response | None:
    """Run the requests, plain or streamed; ``prefixes`` are the echoed prompts."""
    fmt = Formatter(llm)
    groups = await make_requests(llm, p)
    flat = [r for g in groups for r in g]
    if p.stream:
        await _stream(llm, stream, p, kind, prefixes, flat, fmt)
        return None
    done = await collect(llm, flat, stream)
    if done is None:
        return None
    by_group = [done[g * p.n:(g + 1) * p.n] for g in range(len(groups))]
    choices = []
    reasoning_tokens = 0
    for idx, events in enumerate(done):
        last = events[-1]
        shown = [ev for ev in events if _counted(ev)]
        text = last.generated_text or ""
        finish = _finish_reason(last)
        if kind.chat:
            message = {"role": "assistant", "content": text}
            if p.answer is not None:
                split = _Split(p.answer)
                for ev in events:
                    split.feed(ev)
                message["content"] = split.content
                if p.answer.reasoning:
                    message["reasoning_content"] = split.reasoning
                    reasoning_tokens += split.reasoning_tokens
                if split.calls:
                    message["tool_calls"] = split.calls
                    finish = split.finish_reason(finish)
            choice = {"index": idx, "message": message,
                      "logprobs": ({"content": [fmt.chat_entry(ev) for ev in shown]}
                                   if p.logprobs else None)}
        else:
            prefix = prefixes[idx // p.n] if prefixes else ""
            choice = {"index": idx, "text": prefix + text,
                      "logprobs": (fmt.completion_logprobs(shown, len(prefix))
                                   if p.logprobs else None)}
        choice["finish_reason"] = finish
        choices.append(choice)
    out = kind.envelope(choices, chunk=False)
    out["usage"] = _usage(by_group)
    if p.answer is not None and p.answer.reasoning:
        out["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return json_response(200, out)


class _Split:
    """One chat choice's output through :class:`~.tool_calls.OutputParser`, token by token:
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
        if (before or self.parser.thinking) and _counted(ev):
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


async def _stream(llm: LLM, stream: ResponseStream, p: Parsed, kind: _Kind, prefixes: list[str],
                  flat: list[GenerationRequest], fmt: Formatter) -> None:
    """The SSE chunks of ``flat``'s choices as their tokens come, then ``data: [DONE]``."""
    counts = [0] * len(flat)
    prompt_tokens = [0] * (len(flat) // p.n)
    cached_tokens = [0] * (len(flat) // p.n)
    offsets = [len(prefixes[i // p.n]) if prefixes else 0 for i in range(len(flat))]

    def chunk(choices: list, usage=None) -> dict:
        return {**kind.envelope(choices, chunk=True),
                **({"usage": usage} if p.include_usage else {})}

    opening = []
    if kind.chat:
        opening.append(chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}
                              for i in range(len(flat))]))
    elif any(prefixes):
        opening.append(chunk([{"index": i, "text": prefixes[i // p.n], "logprobs": None,
                               "finish_reason": None} for i in range(len(flat))]))

    splits = [_Split(p.answer) for _ in flat] if kind.chat and p.answer is not None else None

    def event(item: tuple[int, TokenEvent]) -> list[dict]:
        i, ev = item
        counts[i] += 1
        prompt_tokens[i // p.n] = ev.prompt_tokens
        if i % p.n == 0:
            cached_tokens[i // p.n] = ev.cached_tokens
        lp_entry = p.logprobs and _counted(ev)
        finish = _finish_reason(ev) if ev.is_last else None
        out = []
        if splits is not None:
            deltas = splits[i].feed(ev)
            for k, delta in enumerate(deltas or ([{}] if lp_entry else [])):
                out.append(chunk([{"index": i, "delta": delta,
                                   "logprobs": ({"content": [fmt.chat_entry(ev)]}
                                                if lp_entry and k == 0 else None),
                                   "finish_reason": None}]))
            if finish:
                out.append(chunk([{"index": i, "delta": {}, "logprobs": None,
                                   "finish_reason": splits[i].finish_reason(finish)}]))
        elif kind.chat:
            if ev.text or lp_entry:
                out.append(chunk([{"index": i, "delta": {"content": ev.text},
                                   "logprobs": ({"content": [fmt.chat_entry(ev)]} if lp_entry
                                                else None), "finish_reason": None}]))
            if finish:
                out.append(chunk([{"index": i, "delta": {}, "logprobs": None,
                                   "finish_reason": finish}]))
        elif ev.text or lp_entry or finish:
            out.append(chunk([{"index": i, "text": ev.text,
                               "logprobs": (fmt.completion_logprobs([ev], offsets[i]) if lp_entry
                                            else None), "finish_reason": finish}]))
            offsets[i] += len(ev.text)
        return out

    def usage() -> list[dict]:
        if not p.include_usage:
            return []
        usage = _usage_dict(sum(prompt_tokens), sum(counts), sum(cached_tokens))
        if splits is not None and p.answer.reasoning:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": sum(s.reasoning_tokens for s in splits)}
        return [chunk([], usage)]

    await send_stream(stream, merged(llm, flat), OPENAI, event, opening=opening, closing=usage,
                      done="[DONE]")


# ---- tools -------------------------------------------------------------------------------
def _with_tools(template: str, messages: list[dict], extra: dict,
                tools: ChatTools) -> tuple[list[dict], dict, str | None]:
    """The messages and template arguments with the tools in, and the format the answer's
    calls come in (:mod:`.tool_calls`; ``None``: no calls parsed).

    A template that reads ``tools`` gets them (``tools=[{"type": "function", "function":
    ...}]``, as Hugging Face's ``apply_chat_template``) and its own call format is parsed; one
    that does not (the ChatML fallback, SmolLM2's, SmolLM3's) gets them in a system message in
    the Hermes format (:func:`~.tool_calls.tools_system_prompt`), earlier calls and results as
    Hermes text, and Hermes is parsed. ``tool_choice`` ``none`` renders no tools; ``required``
    and a named function are answered in :data:`~.tool_calls.JSON` under a grammar.

    Raises:
        APIError: 400 for ``auto`` on a template whose call format is none of those parsed.
    """
    native = template_uses_tools(template)
    if not native:
        messages = [_as_hermes_text(m) for m in messages]
    choice = tools.choice
    if choice.mode == "none":
        return messages, extra, None
    fmt = tc.detect_format(template) if native else tc.HERMES
    if choice.mode == "auto" and fmt is None:
        raise bad("tool_choice 'auto' is not supported with this model's chat template: its "
                  "tool-call format is none of those parsed (Hermes <tool_call>, Llama 3 JSON, "
                  "Mistral [TOOL_CALLS]); use 'required' or a named function.", "tool_choice")
    if native:
        extra = {**extra, "tools": [t.as_openai() for t in tools.tools]}
    else:
        prompt = tc.tools_system_prompt(tools.tools)
        if messages[0]["role"] == "system":
            messages = [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt},
                        *messages[1:]]
        else:
            messages = [{"role": "system", "content": prompt}, *messages]
    return messages, extra, (fmt if choice.mode == "auto" else tc.JSON)


def _as_hermes_text(m: dict) -> dict:
    """A message for a template that renders no tools: an assistant's calls as Hermes
    ``<tool_call>`` text after its content, a tool result as a user turn in
    ``<tool_response>`` tags (Qwen2.5's rendering)."""
    if m["role"] == "assistant" and m.get("tool_calls"):
        calls = "\n".join(
            "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                          "arguments": c["function"]["arguments"]},
                                         ensure_ascii=False) + "\n</tool_call>"
            for c in m["tool_calls"])
        rest = {k: v for k, v in m.items() if k != "tool_calls"}
        return {**rest, "content": "\n".join(filter(None, [m["content"], calls]))}
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    return m


def _call_constraint(llm: LLM, tools: ChatTools) -> Constraint:
    """The grammar of ``required``/a named function (:func:`~.tool_calls.call_schema`),
    compiled once here so that a schema the engine cannot enforce is a 400.

    Raises:
        APIError: 400 (``tools``) when the schema cannot be compiled.
    """
    schema = tc.call_schema(tools.tools, tools.choice, tools.parallel is True)
    spec = json.dumps(schema, ensure_ascii=False)
    return compiled(llm.tokenizer, Constraint("json_schema", spec),
                    lambda m: bad(f"The tools' parameters cannot be enforced: {m}", "tools"))


def opens_thinking(tok, ids: list[int]) -> bool:
    """Whether a prompt's token ids end inside ``<think>`` (DeepSeek-R1 distills' templates
    open it in the generation prompt: the answer starts with the reasoning)."""
    return tok.decode(ids[-8:], skip_special=False).rstrip().endswith(tc.THINK_OPEN)


_TOO_LONG = re.compile(r"cannot be greater than (\d+),the input ids length is (\d+)")


def _context_error(err: APIError, param: str) -> APIError:
    """``err``, naming ``param`` when it is a prompt over the context (OpenAI's 400
    ``context_length_exceeded``), in OpenAI's words: clients match them (litellm raises its
    ``ContextWindowExceededError`` on "maximum context length is")."""
    if err.kind is Kind.TOO_LONG and err.param is None:
        err.param = param
        m = _TOO_LONG.search(err.message)   # the engine's (MindIE's) wording, check_prompt
        if m:
            err.message = (f"This model's maximum context length is {m[1]} tokens. However, "
                           f"you requested {m[2]} tokens in the {param}. Please reduce the "
                           f"length of the {param}.")
    return err


# ---- routes ------------------------------------------------------------------------------
def routes(app) -> list:
    """The OpenAI family's routes (spec §4), all on the business plane."""
    created = int(time.time())

    def model_card() -> dict:
        return {"id": app.llm.model_name, "object": "model", "created": created,
                "owned_by": OWNED_BY}

    async def chat(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        # off the event loop: a constraint's first compile builds llguidance's vocabulary
        p, messages, extra, tools = await asyncio.to_thread(parse_chat, app, req.body)
        llm = app.llm
        template = llm.tokenizer.chat_template or CHATML
        messages, extra, fmt = _with_tools(template, messages, extra, tools)
        if fmt == tc.JSON:
            if p.params.get("constraint") is not None:
                raise bad(f"tool_choice {tools.choice.mode!r} constrains the answer to tool "
                          "calls: it cannot be combined with response_format.", "tool_choice")
            p.params["constraint"] = await asyncio.to_thread(_call_constraint, llm, tools)
        try:
            ids = await asyncio.to_thread(encode_chat, llm, messages, extra)
        except GenerationError as err:
            raise _context_error(from_generation_error(err), "messages") from None
        except APIError as err:
            raise _context_error(err, "messages") from None
        p.prompts = [ids]
        if llm.tokenizer.chat_template is None:
            p.params["stop"] += chatml_stops(llm.tokenizer)
        if fmt == tc.HERMES and tools.parallel is False:
            p.params["stop"] += (tc.TOOL_CALL_CLOSE,)    # one call: stop at its end
        reasoning = tc.thinks(template)
        in_reasoning = reasoning and opens_thinking(llm.tokenizer, ids)
        if fmt is not None or reasoning:
            p.answer = Answer(fmt, reasoning, in_reasoning, one_call=tools.parallel is False,
                              markers=tc.marker_tokens(llm.tokenizer),
                              names=frozenset(t.name for t in tools.tools or ()))
        try:
            return await _answer(llm, stream, p, _Kind(chat=True, model=llm.model_name), [])
        except APIError as err:
            raise _context_error(err, "messages") from None

    async def completions(req: Request, stream: ResponseStream, params: dict) -> Response | None:
        p = await asyncio.to_thread(parse_completion, app, req.body)   # as parse_chat
        prefixes = []
        if p.echo:
            prefixes = [pr if isinstance(pr, str) else app.llm.tokenizer.decode(pr)
                        for pr in p.prompts]
        try:
            return await _answer(app.llm, stream, p,
                                 _Kind(chat=False, model=app.llm.model_name), prefixes)
        except APIError as err:
            raise _context_error(err, "prompt") from None

    async def list_models(req: Request, stream: ResponseStream, params: dict) -> Response:
        return json_response(200, {"object": "list", "data": [model_card()]})

    async def get_model(req: Request, stream: ResponseStream, params: dict) -> Response:
        if params["model"] != app.llm.model_name:
            raise _no_such_model(params["model"])
        return json_response(200, model_card())

    return [
        route("POST", "/v1/chat/completions", BUSINESS, chat, style=OPENAI, generation=True),
        route("POST", "/v1/completions", BUSINESS, completions, style=OPENAI, generation=True),
        route("GET", "/v1/models", BUSINESS, list_models, style=OPENAI),
        route("GET", "/v1/models/{model}", BUSINESS, get_model, style=OPENAI),
    ]
