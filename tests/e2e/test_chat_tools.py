"""Tools, tool calls and reasoning on the OpenAI chat route, with real chat templates (llama.cpp's
``models/templates``, from the llama-cpp-python sdist: tests/support/testdata.py).

- Rendering, per template: the tools reach the prompt (the template's own way, or this server's
  Hermes system prompt for a template that renders none), a multi-turn chat with an assistant's
  calls and the tools' results renders, and the call the template writes in an assistant turn
  parses back (:mod:`tiny_mindie.api.tool_calls`) to the call it was given.
- Each parser on a tiny random model scripted to answer with its family's call (Qwen2.5 Hermes,
  Llama 3.1 JSON after the ``<|python_tag|>`` control token, Mistral's ``[TOOL_CALLS]``/``[ARGS]``
  control tokens), the tokens through the chat route's parser in-process.
- End to end (the official ``openai`` SDK, a real server process): a tiny random model carrying
  Qwen3's vocabulary (with its tool and think tokens) and template, scripted to answer any prompt
  with ``<think>Checking the weather</think>Sure.<tool_call>{...}</tool_call>`` and its end of
  turn (tests/support/tiny_chat.py): reasoning, content and the parsed call, plain and streamed (the
  deltas reassemble to the plain answer), ``tool_choice`` ``none``, ``parallel_tool_calls``,
  multi-turn, usage's reasoning tokens; on the default model, ``required`` and named calls that
  validate (50 prompts), malformed fields' 400s, ``context_length_exceeded``, langchain-openai.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from types import SimpleNamespace

import pytest

pytest.importorskip("gguf")
pytest.importorskip("jinja2")

from helpers import (  # noqa: E402
    openai_client,
    request,
    sse_events,
)

from tiny_mindie.api.chat import tool_calls as tc  # noqa: E402
from tiny_mindie.api.chat import tool_request as tr  # noqa: E402
from tiny_mindie.api.chat.template import render_chat  # noqa: E402
from tiny_mindie.api.errors import APIError  # noqa: E402
from tiny_mindie.api.openai.chat import _with_tools  # noqa: E402
from tiny_mindie.api.openai.request import ChatTools  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "The city"}},
                   "required": ["city"]}}}
CALL_ID = "abc123XYZ"          # 9 letters and digits: Mistral's template checks ids
CALL = {"id": CALL_ID, "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
USER = {"role": "user", "content": "Weather in Paris?"}
TURNS = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny, 21 C"}]

# template: (end of an assistant turn, the format parsed (None: Hermes fallback), thinks)
TEMPLATES = {
    "Qwen-Qwen2.5-7B-Instruct": ("<|im_end|>\n", tc.HERMES, False),
    "Qwen-Qwen3-0.6B": ("<|im_end|>\n", tc.HERMES, True),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("<|im_end|>\n", tc.HERMES, False),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("<|im_end|>\n", tc.HERMES, False),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|eot_id|>", tc.LLAMA3, False),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|eot_id|>", tc.LLAMA3, False),
    "mistralai-Mistral-Nemo-Instruct-2407": ("</s>", tc.MISTRAL, False),
    "HuggingFaceTB-SmolLM3-3B": ("<|im_end|>\n", None, True),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<｜end▁of▁sentence｜>", None, True),
    "microsoft-Phi-3.5-mini-instruct": ("<|end|>\n", None, False),
}


def fake_llm(template: str):
    """What ``render_chat`` reads of an ``LLM``: its tokenizer's template, BOS and EOS."""
    texts = {1: "<s>", 2: "</s>"}
    return SimpleNamespace(tokenizer=SimpleNamespace(
        chat_template=template, bos_id=1, eos_id=2, add_bos=True, token_text=texts.__getitem__))


def _prepared(source: str, messages: list[dict], mode: str = "auto"):
    """Messages as the chat route prepares them (parse_chat's tool_calls, then the tools)."""
    from tiny_mindie.api.openai.request import _message_tool_calls

    msgs = [{**m, "content": m["content"] or ""} for m in messages]
    for i, m in enumerate(msgs):
        if m.get("tool_calls"):
            m["tool_calls"] = _message_tool_calls(m["tool_calls"], i)
    tools = ChatTools(tr.parse_tools([WEATHER]), tr.Choice(mode), None)
    return _with_tools(source, msgs, {}, tools)


@pytest.fixture(scope="module", params=list(TEMPLATES))
def template(request, vocab_dir):
    from tiny_chat import template_source
    return request.param, template_source(vocab_dir, request.param)


def test_tools_reach_the_prompt_and_calls_parse_back(template):
    name, source = template
    end, native_fmt, thinking = TEMPLATES[name]
    assert tc.thinks(source) == thinking
    messages, extra, fmt = _prepared(source, [USER])
    assert fmt == (native_fmt or tc.HERMES)
    prompt = render_chat(fake_llm(source), messages, extra)
    assert "get_weather" in prompt and "Weather of a city" in prompt, prompt
    # tool_choice none: no tools rendered (Hermes' tool_use templates need tools: a 400)
    messages, extra, fmt = _prepared(source, [USER], "none")
    if name.endswith("tool_use"):
        with pytest.raises(APIError):
            render_chat(fake_llm(source), messages, extra)
    else:
        assert fmt is None and "get_weather" not in render_chat(fake_llm(source), messages, extra)
    # required: the tools are rendered, the answer is the constrained JSON
    assert _prepared(source, [USER], "required")[2] == tc.JSON

    # multi-turn: the call and the result render; the assistant turn the template writes for
    # the call parses back to it
    messages, extra, _ = _prepared(source, TURNS)
    full = render_chat(fake_llm(source), messages, extra)
    assert "Paris" in full and "sunny, 21 C" in full, full
    asked, extra1, _ = _prepared(source, TURNS[:1])
    said, extra2, _ = _prepared(source, TURNS[:2])
    before = render_chat(fake_llm(source), asked, extra1)
    after = render_chat(fake_llm(source), said, extra2)
    same = os.path.commonprefix([before, after])     # back to the end of a marker or line
    turn = after[max(same.rfind(">"), same.rfind("]"), same.rfind("\n")) + 1:]
    turn = turn[:turn.index(end)]
    out = tc.parse_output(turn, native_fmt or tc.HERMES, reasoning=thinking)
    assert out.calls == [tc.ToolCall("get_weather", '{"city": "Paris"}')], (turn, out)
    # an earlier call's arguments "" (OpenAI accepts any string): the empty object
    empty = {**CALL, "function": {**CALL["function"], "arguments": ""}}
    messages, extra, _ = _prepared(source, [USER, {**TURNS[1], "tool_calls": [empty]}, TURNS[2]])
    assert "sunny, 21 C" in render_chat(fake_llm(source), messages, extra)


def test_enable_thinking_reaches_the_template(vocab_dir):
    from tiny_chat import template_source
    qwen3 = template_source(vocab_dir, "Qwen-Qwen3-0.6B")
    on = render_chat(fake_llm(qwen3), [USER], {})
    off = render_chat(fake_llm(qwen3), [USER], {"enable_thinking": False})
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    r1 = template_source(vocab_dir, "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    assert render_chat(fake_llm(r1), [USER], {"enable_thinking": True}).endswith("<think>\n")


# ---- each parser on a scripted tiny model's tokens, in-process ------------------------------
# family: (tiny case, vocabulary, template, answer script, end of turn)
SCRIPTED = {
    "qwen2.5": ("qwen3", "ggml-vocab-qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct",
                '<tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call>',
                "<|im_end|>"),
    "llama3.1": ("llama3.2", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.1-8B-Instruct",
                 '<|python_tag|>{"name":"get_weather","parameters":{"city": "Paris"}}',
                 "<|eot_id|>"),
    "mistral": ("llama-linear-swa", "ggml-vocab-llama-spm.gguf",
                "mistralai-Mistral-Nemo-Instruct-2407",
                '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}', "</s>"),
}


@pytest.mark.parametrize("family", list(SCRIPTED))
def test_auto_parses_calls_from_generated_tokens(family, vocab_dir, tmp_path):
    """The model's tokens, control-token markers included (``<|python_tag|>``, Mistral's
    ``[TOOL_CALLS]`` and ``[ARGS]``: no text of their own), through the chat route's parser."""
    from tiny_arch import CASES
    from tiny_chat import template_source, vocabulary, write_scripted

    from tiny_mindie.api.chat.template import encode_chat
    from tiny_mindie.api.openai.answer import Split
    from tiny_mindie.api.openai.request import Answer
    from tiny_mindie.llm import LLM

    case, vocab, template, script, end = SCRIPTED[family]
    source = template_source(vocab_dir, template)
    path = str(tmp_path / f"{family}.gguf")
    write_scripted(path, dataclasses.replace(CASES[case], ctx=1024),
                   vocabulary(family, vocab, vocab_dir, tool_tokens=True), source, script, end)
    llm = LLM(path, backend="numpy", max_seq_len=1024, max_input_len=900, num_slots=1,
              log=None)
    try:
        messages, extra, fmt = _prepared(source, [USER])
        assert fmt == {"qwen2.5": tc.HERMES, "llama3.1": tc.LLAMA3, "mistral": tc.MISTRAL}[family]
        markers = tc.marker_tokens(llm.tokenizer)       # <tool_call> is text: no marker
        assert set(markers.values()) == {"qwen2.5": set(), "llama3.1": {tc.PYTHON_TAG},
                                         "mistral": {tc.MISTRAL_CALLS, "[ARGS]"}}[family]
        split = Split(Answer(fmt, False, False, markers=markers))
        events = list(llm.stream(encode_chat(llm, messages, extra), max_new_tokens=40))
        assert events[-1].finish_reason == "eos_token"
        deltas = [d for ev in events for d in split.feed(ev)]
        assert split.content is None and [c["function"] for c in split.calls] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        assert [list(d) for d in deltas] == [["tool_calls"], ["tool_calls"]]
        if family == "mistral":
            assert len(split.calls[0]["id"]) == 9 and split.calls[0]["id"].isalnum()
    finally:
        llm.close()


# (a blank line after ```json: the script's tokens must all differ, and "\n" ends the prompt)
FENCED = ('Let me check.\n```json\n\n{"name":"get_weather","arguments":{"city": "Paris"}}'
          '\n```\n')


def _scripted_llm(vocab_dir: str, path: str, family: str, script: str):
    """A tiny model of SCRIPTED[family]'s case, vocabulary and template answering ``script``."""
    from tiny_arch import CASES
    from tiny_chat import template_source, vocabulary, write_scripted

    from tiny_mindie.llm import LLM

    case, vocab, template, _, end = SCRIPTED[family]
    write_scripted(path, dataclasses.replace(CASES[case], ctx=1024),
                   vocabulary(family, vocab, vocab_dir, tool_tokens=True),
                   template_source(vocab_dir, template), script, end)
    return LLM(path, backend="numpy", max_seq_len=1024, max_input_len=900, num_slots=1,
               log=None)


def _chat_in_process(llm, body: dict) -> tuple[dict, list[dict]]:
    """``body`` through the chat route's steps in-process (parse, prepare with its constraint
    and stops, generate, split): the plain choice and the streamed deltas."""
    import asyncio

    from tiny_mindie.api.openai.answer import Formatter, Split, _chat_choice
    from tiny_mindie.api.openai.chat import prepare_chat
    from tiny_mindie.api.openai.request import parse_chat

    chat, messages, extra, chat_tools = parse_chat(
        SimpleNamespace(llm=llm), json.dumps({"model": llm.model_name, **body}).encode())
    p = asyncio.run(prepare_chat(llm, chat, messages, extra, chat_tools))
    events = list(llm.stream(p.prompts[0], p.params))
    split = Split(p.answer)
    deltas = [d for ev in events for d in split.feed(ev)]
    return _chat_choice(p, Formatter(llm), 0, events)[0], deltas


def test_a_fenced_json_call_is_a_call_plain_and_streamed(vocab_dir, tmp_path):
    """Qwen2.5-Coder's answer with tools offered: a fenced JSON block after a preamble (issue 29
    item 14), from a tiny Qwen2.5 scripted to write it, through the chat route's steps: the
    plain message has the call, the streamed deltas are tool-call deltas (the closing fence
    split over two tokens)."""
    llm = _scripted_llm(vocab_dir, str(tmp_path / "m.gguf"), "qwen2.5", FENCED)
    try:
        choice, deltas = _chat_in_process(llm, {"messages": [USER], "tools": [WEATHER],
                                                "max_tokens": 40, "temperature": 0})
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] == "Let me check."
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
        assert [list(d) for d in deltas[-2:]] == [["tool_calls"], ["tool_calls"]]
        assert "".join(d["content"] for d in deltas[:-2]) == "Let me check."
        assert deltas[-2]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                           "arguments": ""}
        assert deltas[-1]["tool_calls"][0]["function"] == {"arguments": '{"city": "Paris"}'}
        # a block naming no offered function stays content, streamed as it came
        other = {**WEATHER, "function": {**WEATHER["function"], "name": "get_time"}}
        choice, deltas = _chat_in_process(llm, {"messages": [USER], "tools": [other],
                                                "max_tokens": 40, "temperature": 0})
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == FENCED.strip()
        assert "".join(d["content"] for d in deltas) == FENCED.strip()
    finally:
        llm.close()


CITY = {"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"]}}}


@pytest.mark.parametrize("family", ["qwen2.5", "llama3.1", "mistral"])
def test_strict_tools_under_auto_hold_the_call_the_model_starts(family, vocab_dir, tmp_path):
    """``strict`` tools with ``tool_choice`` auto (pydantic-ai's and openai-agents' default;
    issue 29 item 1): a tiny model scripted to call with a wrong argument (``town``) is held to
    the schema once its call begins, its text before the call stays free; without strict the
    wrong call goes through as written."""
    script = {"qwen2.5": 'Sure.<tool_call>{"name":"get_weather","arguments":{"town": "Paris"}}'
                         "</tool_call>",
              "llama3.1": '<|python_tag|>{"name":"get_weather","parameters":{"town": "Paris"}}',
              "mistral": '[TOOL_CALLS]get_weather[ARGS]{"town": "Paris"}'}
    llm = _scripted_llm(vocab_dir, str(tmp_path / "m.gguf"), family, script[family])
    try:
        body = {"messages": [USER], "tools": [CITY], "max_tokens": 40, "temperature": 0,
                "parallel_tool_calls": False}
        choice, deltas = _chat_in_process(llm, body)
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] == ("Sure." if family == "qwen2.5" else None)
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) in ({"city": "Paris"},
                                                             {"city": "Rome"})
        assert [list(d) for d in deltas[-2:]] == [["tool_calls"], ["tool_calls"]]
        loose = {**CITY, "function": {**CITY["function"], "strict": False}}
        choice, _ = _chat_in_process(llm, {**body, "tools": [loose]})
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"town": "Paris"}
    finally:
        llm.close()


def test_required_on_a_sentencepiece_vocabulary_holds_the_call(vocab_dir, tmp_path):
    """``required`` on a SentencePiece vocabulary with a dummy space prefix (the Mistral
    family's test vocabulary): llguidance tokenizes the text it forces as a continuation, so
    no space is put before a forced ``"`` and the grammar is followed to a valid call."""
    llm = _scripted_llm(vocab_dir, str(tmp_path / "m.gguf"), "mistral", SCRIPTED["mistral"][3])
    try:
        choice, _ = _chat_in_process(llm, {"messages": [USER], "tools": [CITY],
                                           "tool_choice": "required", "max_tokens": 60,
                                           "temperature": 0})
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) in ({"city": "Paris"},
                                                             {"city": "Rome"})
    finally:
        llm.close()


def test_a_strict_schema_the_grammar_cannot_hold_is_named_under_auto_as_under_required(
        vocab_dir, tmp_path):
    """A strict tool whose parameters use what the grammar cannot enforce (``if``/``then``):
    under ``auto`` the 400 names the schema's keys as under ``required``, not grammar text."""
    llm = _scripted_llm(vocab_dir, str(tmp_path / "m.gguf"), "qwen2.5", SCRIPTED["qwen2.5"][3])
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}
    try:
        for choice in ("auto", "required"):
            with pytest.raises(APIError) as exc:
                _chat_in_process(llm, {"messages": [USER], "tools": [tool],
                                       "tool_choice": choice, "max_tokens": 8})
            assert (exc.value.status, exc.value.param) == (400, "tools")
            assert "if" in exc.value.message and "%llguidance" not in exc.value.message
    finally:
        llm.close()


# ---- end to end on a scripted tiny Qwen3 ----------------------------------------------------
SCRIPT = ('<think>Checking the weather</think>Sure.<tool_call>{"name":"get_weather",'
          '"arguments":{"city": "Paris"}}</tool_call>')
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def tiny_server(vocab_dir, tmp_path_factory):
    from tiny_chat import start_scripted_qwen3

    home = tmp_path_factory.mktemp("tiny-qwen3")
    srv = start_scripted_qwen3(vocab_dir, home, SCRIPT, MODEL)
    srv.model_file = str(home / f"{MODEL}.gguf")
    yield srv
    srv.proc.terminate()
    srv.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(tiny_server):
    pytest.importorskip("openai")
    with openai_client(tiny_server, timeout=120) as c:
        yield c


def _reassembled(chunks) -> tuple[dict, str, dict]:
    """The streamed choice 0 put together: message fields, finish reason, the usage."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish, usage = None, None
    for c in chunks:
        usage = c.get("usage") or usage
        for ch in c["choices"]:
            d = ch["delta"]
            for key in ("content", "reasoning_content"):
                msg[key] += d.get(key) or ""
            for t in d.get("tool_calls") or ():
                call = msg["tool_calls"].setdefault(t["index"], {"function": {"arguments": ""}})
                if "id" in t:     # the first delta of a call: id, type, name, arguments ""
                    assert t["type"] == "function" and t["function"]["arguments"] == ""
                    assert "id" not in call
                    call.update(id=t["id"], type=t["type"])
                    call["function"]["name"] = t["function"]["name"]
                else:
                    assert "id" in call
                    call["function"]["arguments"] += t["function"]["arguments"]
            finish = ch["finish_reason"] or finish
    msg["tool_calls"] = [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]
    return msg, finish, usage


def test_auto_parses_reasoning_content_and_call_plain_and_streamed(client, tiny_server):
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER], "max_tokens": 64, "n": 2}
    r = client.chat.completions.create(**body)
    assert len(r.choices) == 2
    for choice in r.choices:
        m = choice.message
        assert choice.finish_reason == "tool_calls"
        assert (m.content, m.reasoning_content) == ("Sure.", "Checking the weather")
        (call,) = m.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris"})
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id
    # <think> Checking the weather </think>: 5 tokens, each choice
    assert r.usage.completion_tokens_details.reasoning_tokens == 10
    assert r.usage.completion_tokens == 2 * 23          # the script's 22 and <|im_end|>

    status, _, raw = request(tiny_server, "POST", "/v1/chat/completions", {
        **body, "n": 1, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = sse_events(raw.decode().removesuffix("data: [DONE]\n\n").encode())
    msg, finish, usage = _reassembled(chunks)
    plain = r.choices[0].message
    assert finish == "tool_calls"
    assert (msg["content"], msg["reasoning_content"]) == (plain.content, plain.reasoning_content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in plain.tool_calls]
    assert msg["tool_calls"][0]["id"].startswith("call_")
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 5}
    # the SDK's own stream accumulator reads the deltas the same way
    with client.chat.completions.stream(model=MODEL, messages=[USER], tools=[WEATHER],
                                        max_tokens=64) as s:
        final = s.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in plain.tool_calls]
    # with logprobs: one entry per token, each on a chunk of its own or on the token's delta
    status, _, raw = request(tiny_server, "POST", "/v1/chat/completions", {
        **body, "n": 1, "stream": True, "logprobs": True})
    chunks = sse_events(raw.decode().removesuffix("data: [DONE]\n\n").encode())
    entries = [e["token"] for c in chunks for ch in c["choices"]
               for e in (ch.get("logprobs") or {}).get("content") or ()]
    assert "".join(entries) == SCRIPT and _reassembled(chunks)[0]["content"] == "Sure."


def test_tool_choice_none_parallel_and_multi_turn(client):
    # none: no tools rendered, nothing parsed as a call; the reasoning still split
    r = client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER],
                                       tool_choice="none", max_tokens=64)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and m.tool_calls is None
    assert m.content == SCRIPT.split("</think>")[1]
    assert m.reasoning_content == "Checking the weather"
    # no tools at all: a thinking template's answer is still split
    r = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=64)
    assert r.choices[0].message.reasoning_content == "Checking the weather"
    # parallel_tool_calls false: generation stops at the end of the first call
    r = client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER],
                                       parallel_tool_calls=False, max_tokens=64)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert r.usage.completion_tokens == 22     # stopped at </tool_call>, before <|im_end|>
    # the call and its result sent back render through the template (the prompt grows)
    first = client.chat.completions.create(model=MODEL, messages=[USER], tools=[WEATHER],
                                           max_tokens=64)
    turn = first.choices[0].message
    again = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], max_tokens=64, messages=[
            USER, turn.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": "sunny, 21 C"}])
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + 20
    # enable_thinking false reaches the template: the empty think block is in the prompt
    off = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=64,
                                         extra_body={"chat_template_kwargs":
                                                     {"enable_thinking": False}})
    no_tools = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=64)
    assert off.usage.prompt_tokens == no_tools.usage.prompt_tokens + 4


# ---- end to end on the default model (SmolLM2-135M: its template renders no tools) ---------
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
QUESTIONS = [f"{q} {c}?" for q in ("What's the weather in", "Is it raining in",
                                   "How warm is it in", "What is 17 plus the length of",
                                   "Add the letters of")
             for c in ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Rome",
                       "Seoul", "Dakar")]


@pytest.fixture(scope="module")
def default_client(server):
    pytest.importorskip("openai")
    with openai_client(server, timeout=300) as c:
        yield c


def test_required_and_named_calls_validate_50_of_50(default_client):
    """``required`` on 50 varied prompts (greedy, 8 requests at a time): every answer is calls
    whose arguments validate against their function's schema; a named function is called.
    (Strings are bounded: an unbounded one is where a 135M model may ramble to max_tokens --
    then the answer is cut, ``length``, and claims no call.)"""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    def ask(i: int):
        return default_client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": QUESTIONS[i]}],
            tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(len(QUESTIONS))))
    assert len(answers) == 50
    for r in answers:
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                schemas[call.function.name])
    named = default_client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Hi there"}],
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=64, temperature=0)
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and named.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    # parallel_tool_calls true: the answer is an array of one or more calls
    several = default_client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": QUESTIONS[0]}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=True, max_tokens=96,
        temperature=0)
    assert several.choices[0].finish_reason == "tool_calls"
    for call in several.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def _weather_call(n: int, city: str) -> dict:
    """An assistant turn calling ``get_weather`` for ``city`` (its id ``call_<n>``)."""
    return {"role": "assistant", "content": None, "tool_calls": [{
        "id": f"call_{n}", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


def test_strict_tools_under_auto_default_model(default_client):
    """What pydantic-ai's and openai-agents' tool agents send (strict tools, no tool_choice):
    after two turns that called ``get_weather``, SmolLM2 calls it again for the city asked (greedy,
    as probed on these four questions), and the call validates against its schema."""
    import jsonschema

    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    history = [{"role": "user", "content": "What's the weather in Oslo?"}, _weather_call(1, "Oslo"),
               {"role": "user", "content": "What's the weather in Rome?"}, _weather_call(2, "Rome")]
    for question, city in zip(QUESTIONS[:4], ("Paris", "Tokyo", "Lima", "Oslo"), strict=True):
        r = default_client.chat.completions.create(
            model="smollm2-135m-instruct", tools=strict, max_tokens=96, temperature=0,
            messages=[*history, {"role": "user", "content": question}])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (question, choice.message.content)
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and arguments["city"] == city, arguments
        jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])


def test_required_streamed_reassembles(server, default_client):
    body = {"model": "smollm2-135m-instruct", "tools": TOOLS, "tool_choice": "required",
            "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 160,
            "temperature": 0}
    plain = default_client.chat.completions.create(**body).choices[0].message
    status, _, raw = request(server, "POST", "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    msg, finish, _ = _reassembled(sse_events(raw.decode().removesuffix("data: [DONE]\n\n")
                                             .encode()))
    assert finish == "tool_calls" and msg["content"] == "" and plain.content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in plain.tool_calls]


BAD_BODIES = [({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
              ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
              ({"tools": [{"type": "function", "function": {
                  "name": "f", "parameters": {"type": "object", "properties": 1}}}]}, "tools"),
              ({"tool_choice": "required"}, "tool_choice"),
              ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
              ({"tools": TOOLS, "tool_choice": {"type": "function",
                                                "function": {"name": "nope"}}}, "tool_choice"),
              ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
              ({"parallel_tool_calls": True}, "parallel_tool_calls"),
              ({"tools": [{"type": "function", "function": {
                  "name": "f", "parameters": {"type": "object", "properties": {
                      "x": {"type": "string", "format": "no-such-format"}}}}}],
                "tool_choice": "required"}, "tools"),
              ({"messages": [USER, {"role": "assistant", "tool_calls": [
                  {"id": "c", "type": "function",
                   "function": {"name": "f", "arguments": 3}}]}]}, "messages"),
              ({"tools": TOOLS, "response_format": {"type": "json_object"}},
               "response_format"),
              ({"messages": [USER, {"role": "tool", "content": "x"}]}, "messages"),
              ({"functions": [{"name": "f"}]}, "functions"),
              ({"tools": TOOLS, "tool_choice": "required",
                "response_format": {"type": "json_object"}}, "tool_choice"),
              ({"function_call": "auto"}, "function_call")]


def test_bad_tools_are_400_naming_the_field_and_long_prompts_context_length_exceeded(
        server, default_client):
    import openai

    for extra, param in BAD_BODIES:
        body = {"model": "smollm2-135m-instruct", "messages": [USER], "max_tokens": 4, **extra}
        status, _, raw = request(server, "POST", "/v1/chat/completions", body)
        err = json.loads(raw)["error"]
        assert (status, err["param"], err["type"]) == (400, param, "invalid_request_error"), \
            (extra, err)
    # a prompt over the context: 400 context_length_exceeded, the SDK's BadRequestError
    long = "hello " * 600
    with pytest.raises(openai.BadRequestError) as exc:
        default_client.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": long}])
    assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "messages")
    # OpenAI's words, which clients match (litellm: ContextWindowExceededError)
    assert re.fullmatch(r"This model's maximum context length is \d+ tokens\. However, you "
                        r"requested \d+ tokens in the messages\. .*", exc.value.body["message"])
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            default_client.completions.create(model="smollm2-135m-instruct", prompt=long,
                                              stream=stream)
        assert (exc.value.code, exc.value.param) == ("context_length_exceeded", "prompt")


def test_a_prompt_that_opens_think_starts_in_the_reasoning(tiny_server):
    """DeepSeek-R1 distills' generation prompt ends with ``<think>\n``: the answer's text up to
    ``</think>`` is reasoning (:func:`~tiny_mindie.api.openai_chat.opens_thinking` on the ids)."""
    from tiny_mindie.api.openai.chat import opens_thinking
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    tok = load_tokenizer(GGUFFile(tiny_server.model_file))

    def ids(text):
        return tok.encode(text, add_bos=False, parse_special=True)
    assert opens_thinking(tok, ids("<|im_start|>assistant\n<think>\n"))
    assert not opens_thinking(tok, ids("<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert not opens_thinking(tok, ids("<|im_start|>assistant\n"))
    out = tc.parse_output("The user asks.\n</think>\n\nParis.", None, reasoning=True,
                          in_reasoning=True)
    assert (out.reasoning, out.content) == ("The user asks.", "Paris.")


def test_langchain_bind_tools_and_structured_output(server):
    """langchain-openai as an agent framework uses it: ``bind_tools`` with a forced tool, and
    ``with_structured_output`` by ``method="function_calling"`` (a named tool) and by
    ``method="json_schema"`` (``response_format``), each parsed back into the Pydantic
    model."""
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field
    try:
        import httpx2 as httpx
    except ImportError:   # pragma: no cover
        import httpx

    class Weather(BaseModel):
        """Current weather of a city."""

        city: str = Field(max_length=24)
        celsius: int = Field(ge=-60, le=60)

    http_client = httpx.Client(verify=server.ssl_context(), timeout=120)
    try:
        chat = lc.ChatOpenAI(model="smollm2-135m-instruct", base_url=server.url + "/v1",
                             api_key="x", http_client=http_client, temperature=0,
                             max_tokens=64, max_retries=0)
        msg = chat.bind_tools([TOOLS[0]], tool_choice="any").invoke("Weather in Oslo?")
        (call,) = msg.tool_calls
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
        assert call["id"].startswith("call_")
        for method in ("function_calling", "json_schema"):   # a named tool; response_format
            out = chat.with_structured_output(Weather, method=method).invoke(
                "It is 12 degrees in Lima.")
            assert isinstance(out, Weather) and -60 <= out.celsius <= 60, method
    finally:
        http_client.close()
