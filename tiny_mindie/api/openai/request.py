"""The OpenAI family's request bodies validated (spec §4): ``/v1/chat/completions`` and
``/v1/completions`` JSON -> :class:`Parsed` (the prompts, the request's
:class:`~tiny_mindie.engine.request.GenerationParams` and the answer's options), built once; a
chat's is built by :func:`~.chat.prepare_chat` from its :class:`ChatBody`.

A bad field is a 400 naming it (the shared validators' 422 is turned into 400 by OpenAI's error
style, :class:`~.errors.OpenAIStyle`), an unknown model a 404, a body that is no JSON object a
422. Ranges: temperature >= 0 (0 = greedy), top_p in (0, 1], min_p in [0, 1], typical_p in
(0, 1], presence/frequency_penalty in [-2, 2], repetition_penalty in (0, 2], n >= 1,
0 <= min_tokens <= max_tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from types import MappingProxyType

from ...engine.request import Constraint, GenerationParams
from ...llm import LLM, MAX_SEED
from ..chat import tool_calls as tc
from ..chat import tool_request as tr
from ..chat.guided import guided_constraint
from ..chat.structured import logit_bias, response_format
from ..errors import APIError, Kind, bad
from ..validate import (
    INF,
    INT32_MAX,
    MAX_JSON_DEPTH,
    check_token_ids,
    get_bool,
    get_float,
    get_int,
    json_depth,
    parse_json_object,
)
from .fields import check_fields

MAX_CHOICES = 128           # n x prompts per request: each is a sequence in the engine
MAX_TOP_LOGPROBS = 20       # OpenAI's limit for chat's top_logprobs

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
#: Chat's fields that ``/v1/completions`` refuses (400 naming them) rather than ignores.
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
             "functions", "function_call")
#: Fields asking for reasoning, which ``/v1/completions`` (a raw prompt, no chat template to
#: turn thinking on or off) refuses (400 ``unsupported_parameter`` naming them).
THINKING_FIELDS = ("enable_thinking", "reasoning_effort", "reasoning")


def no_such_model(name: str) -> APIError:
    """404 ``model_not_found`` for a model that is not the served one."""
    return APIError(Kind.NOT_FOUND, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


@dataclasses.dataclass(frozen=True)
class Answer:
    """How a chat answer's text is split (:class:`~..chat.tool_calls.OutputParser`): the tool-call
    format parsed (``None``: none), whether the template thinks, whether the prompt ends inside
    ``<think>``."""

    fmt: str | None
    reasoning: bool
    in_reasoning: bool
    one_call: bool = False          # parallel_tool_calls false: calls after the first dropped
    markers: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    names: frozenset[str] | None = None     # the tools' names: calls to others stay content
    # the tools' parameters by name: fenced JSON calls checked against them (tool_calls.py)
    schemas: dict | None = dataclasses.field(default=None, compare=False, hash=False)

    def parser(self) -> tc.OutputParser:
        return tc.OutputParser(self.fmt, reasoning=self.reasoning,
                               in_reasoning=self.in_reasoning, names=self.names,
                               schemas=self.schemas)


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A validated request: its prompts, the request's parameters (``n`` choices a prompt,
    penalties, ``top_logprobs``, stops, constraint, ...), and the answer's options.

    Attributes:
        prompts: a text or token ids each, checked when their requests are built
            (``LLM.make_requests``); with ``checked``, ids already checked (a chat's).
        logprobs: report logprobs at all (``params.top_logprobs``: alternatives per token).
        answer: chat: how to split the output (``None``: plain text).
    """

    prompts: tuple
    params: GenerationParams
    stream: bool
    include_usage: bool
    logprobs: bool
    echo: bool = False
    answer: Answer | None = None
    checked: bool = False

    @property
    def n(self) -> int:         # choices a prompt
        return self.params.n


@dataclasses.dataclass(frozen=True)
class ChatBody:
    """A validated chat body, before its messages are rendered (:func:`~.chat.prepare_chat`
    makes its :class:`Parsed`).

    Attributes:
        fields: the request's :class:`GenerationParams` fields sent, but the two the chat
            pipeline completes: ``stop`` (the template's stops added) and ``constraint``
            (the tools' may take its place).
        stop, constraint: the client's.
        stream, include_usage, logprobs: as :class:`Parsed`'s.
        thinking: the fields sent that ask the model to think.
        chat_end: how the prompt ends (:data:`~..chat.template.ENDS`).
    """

    fields: Mapping[str, object]
    stop: tuple[str, ...]
    constraint: Constraint | None
    stream: bool
    include_usage: bool
    logprobs: bool
    thinking: tuple[str, ...] = ()
    chat_end: str = "generation"

    def parsed(self, ids: list[int], stop: tuple[str, ...], constraint: Constraint | None,
               answer: Answer | None) -> Parsed:
        """The request of the chat rendered as ``ids`` (checked), with the stops and the
        constraint the chat pipeline settled."""
        return Parsed(prompts=(ids,), params=GenerationParams(**self.fields, stop=stop,
                                                              constraint=constraint),
                      stream=self.stream, include_usage=self.include_usage,
                      logprobs=self.logprobs, answer=answer, checked=True)


@dataclasses.dataclass
class ChatTools:
    """A chat request's validated ``tools`` (``None``: none), ``tool_choice`` and
    ``parallel_tool_calls`` (``None``: not sent). ``True`` lets ``required`` answer an array
    of calls; ``False`` stops an ``auto`` answer after its first call; unsent, ``auto`` may
    call several tools and ``required`` calls one (a small model asked for an array tends to
    repeat calls until ``max_tokens``)."""

    tools: list[tr.Tool] | None
    choice: tr.Choice
    parallel: bool | None


# ---- fields both routes share ------------------------------------------------------------
def _check_model(llm: LLM, obj: dict) -> None:
    name = obj.get("model")
    if name is None:
        raise bad("You must provide a model parameter.", "model")
    if not isinstance(name, str):
        raise bad(f"Parameter model must be a string, got {json.dumps(name)}.", "model")
    if name != llm.model_name:
        raise no_such_model(name)


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


def _include_usage(obj: dict, stream: bool) -> bool:
    """``stream_options.include_usage`` (only with ``stream``)."""
    opts = obj.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("Parameter stream_options is only allowed when stream is true.",
                  "stream_options")
    if not isinstance(opts, dict):
        raise bad("Parameter stream_options must be an object.", "stream_options")
    return get_bool(opts, "include_usage", False)


def _common(llm: LLM, obj: dict, default_max_tokens: int) -> tuple[dict, dict]:
    """The fields both completion routes share: the request's (:class:`GenerationParams`
    keyword arguments) and the answer's (``stream``, ``include_usage``)."""
    _check_model(llm, obj)
    n = get_int(obj, "n", 1, 1, MAX_CHOICES)
    stream = get_bool(obj, "stream", False)
    include_usage = _include_usage(obj, stream)
    max_tokens = get_int(obj, "max_tokens", None, 1, INT32_MAX)
    if obj.get("max_completion_tokens") is not None:
        max_tokens = get_int(obj, "max_completion_tokens", None, 1, INT32_MAX)
    temperature = get_float(obj, "temperature", 1.0, 0.0, INF, lo_open=False, hi_open=True)
    top_k = get_int(obj, "top_k", 0, -1, INT32_MAX)
    best_of = get_int(obj, "best_of", None, 1, MAX_CHOICES)
    min_tokens = get_int(obj, "min_tokens", 0, 0, INT32_MAX)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"Parameter min_tokens ({min_tokens}) must be at most max_tokens "
                  f"({max_tokens}).", "min_tokens")
    if best_of is not None and best_of != n:
        raise bad("Parameter best_of is not supported (only best_of == n).", "best_of")
    fields = dict(max_new_tokens=max_tokens or default_max_tokens, do_sample=temperature > 0,
                  temperature=temperature if temperature > 0 else 1.0, top_k=max(top_k, 0),
                  min_tokens=min_tokens, n=n, **_more_params(llm, obj),
                  presence_penalty=get_float(obj, "presence_penalty", 0.0, -2.0, 2.0,
                                             lo_open=False, hi_open=False),
                  frequency_penalty=get_float(obj, "frequency_penalty", 0.0, -2.0, 2.0,
                                              lo_open=False, hi_open=False))
    return fields, dict(stream=stream, include_usage=include_usage)


def _more_params(llm: LLM, obj: dict) -> dict:
    """:class:`GenerationParams`' keyword arguments past the length, temperature, top_k and
    ``n``."""
    get_bool(obj, "skip_special_tokens", True)   # special tokens never reach the text
    stop_token_ids = obj.get("stop_token_ids")
    return dict(
        top_p=get_float(obj, "top_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        min_p=get_float(obj, "min_p", 0.0, 0.0, 1.0, lo_open=False, hi_open=False),
        typical_p=get_float(obj, "typical_p", 1.0, 0.0, 1.0, lo_open=True, hi_open=False),
        repetition_penalty=get_float(obj, "repetition_penalty", 1.0, 0.0, 2.0,
                                     lo_open=True, hi_open=False),
        seed=get_int(obj, "seed", None, 0, MAX_SEED),
        stop=_stop_strings(obj),
        include_stop_string=get_bool(obj, "include_stop_str_in_output", False),
        stop_token_ids=(() if stop_token_ids is None else tuple(check_token_ids(
            stop_token_ids, "stop_token_ids", llm.tokenizer.vocab_size))),
        ignore_eos=get_bool(obj, "ignore_eos", False),
        logit_bias=logit_bias(llm.tokenizer, obj.get("logit_bias")),
        constraint=_constraint(llm, obj),
    )


def _constraint(llm: LLM, obj: dict):
    """The output's constraint: ``response_format``'s, or that of one of the other servers'
    fields (:mod:`..chat.guided`); None when neither is sent.

    Raises:
        APIError: 400 naming the guided field when both are sent; as their parsers.
    """
    constraint = response_format(llm.tokenizer, obj.get("response_format"))
    guided = guided_constraint(llm.tokenizer, obj)
    if guided is None:
        return constraint
    if constraint is not None:
        raise bad(f"Parameters response_format and {guided[0]} both constrain the output: "
                  "send one.", guided[0])
    return guided[1]


# ---- chat --------------------------------------------------------------------------------
def parse_chat(app, body: bytes) -> tuple[ChatBody, list[dict], dict, ChatTools]:
    """Validate a chat body for ``app``'s model; returns the body, the messages for the
    template (assistant ``tool_calls`` arguments as objects), the template's extra keyword
    arguments (``chat_template_kwargs``) and the tools.

    Raises:
        APIError: 400 naming a bad field, or one nothing reads (``unknown_parameter``,
            :func:`~.fields.check_fields`), 404 for another model, 422 for a body that
            is no JSON object.
    """
    obj = parse_json_object(body)
    fields, options = _common(app.llm, obj, INT32_MAX)  # the engine caps it (maxIterTimes...)
    messages = _chat_messages(obj.get("messages"))
    logprobs = get_bool(obj, "logprobs", False)
    top = get_int(obj, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("Parameter top_logprobs requires logprobs to be true.", "top_logprobs")
    extra = obj.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise bad("Parameter chat_template_kwargs must be an object.", "chat_template_kwargs")
    stop, constraint = fields.pop("stop"), fields.pop("constraint")
    tools = _chat_tools(obj, constraint is not None)
    chat = ChatBody(fields=MappingProxyType({**fields, "top_logprobs": top}), stop=stop,
                    constraint=constraint, logprobs=logprobs, thinking=_thinking(obj, extra),
                    chat_end=_chat_end(obj, messages), **options)
    check_fields(obj, chat=True)
    return chat, messages, extra, tools


def _chat_end(obj: dict, messages: list[dict]) -> str:
    """How the rendered chat ends (:data:`~..chat.template.ENDS`): ``"continue"`` -- the
    answer continues the final assistant message -- with vLLM's ``continue_final_message``,
    or when the last message is the assistant's (llama-server's prefill) and neither field is
    sent; ``"none"`` with ``add_generation_prompt`` false (vLLM); else ``"generation"``.

    Raises:
        APIError: 400 (``continue_final_message``) without a final assistant message, or
            with ``add_generation_prompt`` true.
    """
    cont = get_bool(obj, "continue_final_message", None)
    gen = get_bool(obj, "add_generation_prompt", None)
    last = messages[-1]
    final = last["role"] == "assistant" and not last.get("tool_calls")
    if cont and not final:
        raise bad("Parameter continue_final_message needs a final assistant message without "
                  "tool_calls to continue.", "continue_final_message")
    if cont and gen:
        raise bad("Parameters continue_final_message and add_generation_prompt cannot both be "
                  "true.", "continue_final_message")
    if cont or (cont is None and gen is None and final and last["content"]):
        return "continue"
    return "none" if gen is False else "generation"


def _thinking(obj: dict, extra: dict) -> tuple[str, ...]:
    """The fields of a chat body that ask for reasoning (a model that cannot think answers
    them 400, :func:`~.chat.prepare_chat`): ``reasoning_effort`` and ``reasoning``
    whatever their value (as OpenAI answers ``reasoning_effort`` for a model that does not
    reason), ``chat_template_kwargs.enable_thinking`` unless false (asking for no thinking
    is what such a model does)."""
    asked = tuple(k for k in ("reasoning_effort", "reasoning") if obj.get(k) is not None)
    if extra.get("enable_thinking") not in (None, False):
        asked += ("chat_template_kwargs.enable_thinking",)
    return asked


def _chat_messages(messages) -> list[dict]:
    """``messages`` as the template gets them (:func:`parse_chat`)."""
    if not isinstance(messages, list) or not messages:
        raise bad("Parameter messages must be a non-empty list of messages.", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string role.", "messages")
        if m["role"] not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                      f"got {m['role']!r}.", "messages")
        if not isinstance(m.get("name"), str | None):
            raise bad(f"messages[{i}].name must be a string, got {_json_type(m['name'])}.",
                      f"messages[{i}].name")
        if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise bad(f"messages[{i}].content is required.", "messages")
        out = {**m, "content": _message_content(m.get("content"), i)}
        out.pop("tool_calls", None)
        if out.get("name") is None:
            out.pop("name", None)       # a template tests "name" in message
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = _message_tool_calls(m["tool_calls"], i)
            if calls:       # templates test "tool_calls" in message: no empty list there
                out["tool_calls"] = calls
        if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise bad(f"messages[{i}].tool_call_id (a string) is required for role tool.",
                      "messages")
        rendered.append(out)
    _check_tool_answers(rendered)
    return rendered


def _json_type(value) -> str:
    """The JSON type of a parsed ``value``, with its article (``"an object"``)."""
    kinds = ((bool, "a boolean"), (int | float, "a number"), (list, "an array"),
             (dict, "an object"), (str, "a string"))
    return next((name for t, name in kinds if isinstance(value, t)), "null")


def _check_tool_answers(messages: list[dict]) -> None:
    """Each ``tool`` message answers a call of an earlier assistant message (its
    ``tool_call_id`` one of their ids), as OpenAI requires.

    Raises:
        APIError: 400 (``messages``) naming the first that does not.
    """
    called: set[str] = set()
    for i, m in enumerate(messages):
        called.update(c["id"] for c in m.get("tool_calls") or ())
        if m["role"] == "tool" and m["tool_call_id"] not in called:
            raise bad(f"messages[{i}].tool_call_id {json.dumps(m['tool_call_id'])} answers no "
                      "tool call of an earlier assistant message (its tool_calls[].id).",
                      "messages")


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
        try:        # a text nested deeper than a body may be stays text
            parsed = (json.loads(args) if json_depth(args.encode("utf-8", "surrogatepass"))
                      <= MAX_JSON_DEPTH else None) if args.strip() else {}
        except (ValueError, RecursionError):
            parsed = None
        out.append({"id": c["id"], "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": parsed if isinstance(parsed, dict) else args}})
    return out


def _chat_tools(obj: dict, constrained: bool) -> ChatTools:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked against each other and
    against a ``response_format`` (``constrained``)."""
    for legacy in ("functions", "function_call"):
        if obj.get(legacy) is not None:
            raise bad(f"Parameter {legacy} (deprecated by OpenAI) is not supported: use tools "
                      "and tool_choice.", legacy)
    tools = tr.parse_tools(obj.get("tools"))
    choice = tr.parse_tool_choice(obj.get("tool_choice"), tools)
    if choice.mode == "auto" and constrained:
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
    return ChatTools(tools, choice, parallel)


# ---- text completions --------------------------------------------------------------------
def parse_completion(app, body: bytes) -> Parsed:
    """Validate a ``/v1/completions`` body for ``app``'s model: ``prompt`` is a string, a list
    of strings, a list of token ids, or a list of such lists.

    Raises:
        APIError: as :func:`parse_chat`; 400 naming a chat-only field (:data:`CHAT_ONLY`) or
            one asking for reasoning (:data:`THINKING_FIELDS`).
    """
    obj = parse_json_object(body)
    for name in CHAT_ONLY:
        if obj.get(name) is not None:
            raise bad(f"Parameter {name} is only supported on /v1/chat/completions.", name)
    for name in THINKING_FIELDS:
        if obj.get(name) is not None:
            raise APIError(Kind.BAD_REQUEST, f"Unsupported parameter: '{name}' is not supported "
                           "on /v1/completions (the prompt is raw text: no chat template turns "
                           "thinking on or off); use /v1/chat/completions.", param=name,
                           code="unsupported_parameter")
    fields, options = _common(app.llm, obj, 16)        # OpenAI's default for completions
    prompts = _prompts(app.llm, obj.get("prompt"))
    if len(prompts) * fields["n"] > MAX_CHOICES:
        raise bad(f"At most {MAX_CHOICES} choices (prompts x n) per request.", "n")
    if obj.get("suffix") is not None:
        raise bad("Parameter suffix is not supported.", "suffix")
    lp = get_int(obj, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    echo = get_bool(obj, "echo", False)
    if echo and lp is not None:
        raise bad("Parameter echo together with logprobs is not supported.", "echo")
    check_fields(obj, chat=False)
    return Parsed(prompts=tuple(prompts), params=GenerationParams(**fields, top_logprobs=lp or 0),
                  logprobs=lp is not None, echo=echo, **options)


def _prompts(llm: LLM, prompt) -> list:
    """``prompt`` as a list of prompts, each a non-empty string or list of token ids."""
    vocab = llm.tokenizer.vocab_size
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        prompts = [check_token_ids(prompt, "prompt", vocab)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [check_token_ids(p, "prompt", vocab) for p in prompt]
    else:
        raise bad("Parameter prompt must be a string, a list of strings, a list of token ids "
                  "or a list of lists of token ids.", "prompt")
    if any(not p for p in prompts):
        raise bad("Parameter prompt must not be empty.", "prompt")
    return prompts
