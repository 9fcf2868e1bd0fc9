"""The chat pipeline of ``/v1/chat/completions``: a validated chat
(:func:`~.request.parse_chat`) made the engine's prompt, and the way its answer is split.

The tools go into the model's chat template, or into a system prompt when the template renders
none (:func:`_with_tools`); ``tool_choice`` ``required`` and a named function hold decoding to
a JSON schema of the calls, ``auto`` with ``strict`` tools holds each call the model starts to
it (a lazy grammar); the messages are rendered and encoded (:mod:`..chat.template`); the
ChatML fallback and a single Hermes call add their stops; a template that thinks, or a tool-call
format to parse, sets :attr:`~.request.Parsed.answer`. The request is built once, at the end
(:meth:`~.request.ChatBody.parsed`).
"""

from __future__ import annotations

import asyncio
import json

from ...engine.constraint import JSON_OPTIONS
from ...engine.request import Constraint, GenerationError
from ...llm import LLM
from ..chat import tool_calls as tc
from ..chat import tool_request as tr
from ..chat.structured import compiled
from ..chat.template import CHATML, chatml_stops, encode_chat, template_uses_tools
from ..errors import APIError, Kind, bad, from_generation_error
from .request import Answer, ChatBody, ChatTools, Parsed


async def prepare_chat(llm: LLM, chat: ChatBody, messages: list[dict], extra: dict,
                       tools: ChatTools) -> Parsed:
    """The request of ``chat``: its prompt (the chat's token ids, their length checked by
    :func:`~..chat.template.encode_chat`), the stops and constraint the tools need, and
    :attr:`~.request.Parsed.answer`; compiling and encoding run off the event loop.

    Raises:
        APIError: 400 ``unsupported_parameter`` naming a field that asks for reasoning
            (:attr:`~.request.ChatBody.thinking`) when the template does not think;
            400 as :func:`_with_tools`; 400 (``tool_choice``) for ``required`` or a
            named function with a ``response_format``; 400 (``tools``) when the tools'
            schemas cannot be enforced; 400 as :func:`~..chat.template.encode_chat`; 424
            (``TOO_LONG``) when the rendered chat cannot fit.
    """
    template = llm.tokenizer.chat_template or CHATML
    reasoning = tc.thinks(template)
    if chat.thinking and not reasoning:
        raise APIError(Kind.BAD_REQUEST, f"Unsupported parameter: '{chat.thinking[0]}' is not "
                       "supported with this model: it does not think (its chat template has "
                       "no reasoning).", param=chat.thinking[0], code="unsupported_parameter")
    messages, extra, fmt = _with_tools(template, messages, extra, tools)
    constraint = chat.constraint
    if fmt == tc.JSON:
        if constraint is not None:
            raise bad(f"tool_choice {tools.choice.mode!r} constrains the answer to tool "
                      "calls: it cannot be combined with response_format.", "tool_choice")
        constraint = await asyncio.to_thread(_call_constraint, llm, tools)
    elif fmt is not None and any(t.strict for t in tools.tools):
        constraint = await asyncio.to_thread(_lazy_constraint, llm, tools, fmt)
    try:
        ids = await asyncio.to_thread(encode_chat, llm, messages, extra, chat.chat_end)
    except GenerationError as err:
        raise from_generation_error(err) from None
    stop = chat.stop
    if llm.tokenizer.chat_template is None:
        stop += chatml_stops(llm.tokenizer)
    if fmt == tc.HERMES and tools.parallel is False:
        stop += (tc.TOOL_CALL_CLOSE,)    # one call: stop at its end
    answer = None
    if fmt is not None or reasoning:
        answer = Answer(fmt, reasoning, reasoning and opens_thinking(llm.tokenizer, ids),
                        one_call=tools.parallel is False,
                        markers=tc.marker_tokens(llm.tokenizer),
                        names=frozenset(t.name for t in tools.tools or ()),
                        schemas={t.name: t.parameters for t in tools.tools or ()} or None)
    return chat.parsed(ids, stop, constraint, answer)


def _with_tools(template: str, messages: list[dict], extra: dict,
                tools: ChatTools) -> tuple[list[dict], dict, str | None]:
    """The messages and template arguments with the tools in, and the format the answer's
    calls come in (:mod:`..chat.tool_calls`; ``None``: no calls parsed).

    A template that reads ``tools`` gets them (``tools=[{"type": "function", "function":
    ...}]``, as Hugging Face's ``apply_chat_template``) and its own call format is parsed; one
    that does not (the ChatML fallback, SmolLM2's, SmolLM3's) gets them in a system message in
    the Hermes format (:func:`~..chat.tool_request.tools_system_prompt`), earlier calls and results
    as Hermes text, and Hermes is parsed. ``tool_choice`` ``none`` renders no tools;
    ``required`` and a named function are answered in :data:`~..chat.tool_calls.JSON` under a
    grammar.

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
        prompt = tr.tools_system_prompt(tools.tools)
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
    """The grammar of ``required``/a named function (:func:`~..chat.tool_request.call_schema`),
    compiled once here so that a schema the engine cannot enforce is a 400.

    Raises:
        APIError: 400 (``tools``) when the schema cannot be compiled.
    """
    schema = tr.call_schema(tools.tools, tools.choice, tools.parallel is True)
    spec = json.dumps(schema, ensure_ascii=False)
    return compiled(llm.tokenizer, Constraint("json_schema", spec),
                    lambda m: bad(f"The tools' parameters cannot be enforced: {m}", "tools"))


def _lazy_constraint(llm: LLM, tools: ChatTools, fmt: str) -> Constraint:
    """The grammar of ``auto`` with ``strict`` tools (:func:`..chat.tool_request.lazy_call_grammar`:
    free text, a call held to its schema once its marker is written), compiled once here.

    Raises:
        APIError: 400 (``tools``) when the schemas cannot be compiled.
    """
    control = {text: tid for tid, text in tc.marker_tokens(llm.tokenizer).items()}
    spec = tr.lazy_call_grammar(tools.tools, fmt, control, JSON_OPTIONS,
                                several=tools.parallel is not False)
    try:
        return compiled(llm.tokenizer, Constraint("lark", spec),
                        lambda m: bad(f"The tools' parameters cannot be enforced: {m}", "tools"))
    except APIError:
        # name a schema it cannot enforce as under required, not amid the grammar's text
        strict = [t for t in tools.tools if t.strict]
        if strict:
            _call_constraint(llm, ChatTools(strict, tr.Choice("required"), False))
        raise


def opens_thinking(tok, ids: list[int]) -> bool:
    """Whether a prompt's token ids end inside ``<think>`` (DeepSeek-R1 distills' templates
    open it in the generation prompt: the answer starts with the reasoning)."""
    return tok.decode(ids[-8:], skip_special=False).rstrip().endswith(tc.THINK_OPEN)
