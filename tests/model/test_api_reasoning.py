"""Reasoning and parsed tool calls on ``/v1/responses`` and ``/v1/messages``, on a scripted tiny
Qwen3 (a real vocabulary and chat template that thinks; its greedy answer is fixed,
tests/support/tiny_chat.py): the ``reasoning`` item and the ``thinking`` block, the text and the
call in the order written, plain and streamed alike."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("gguf")
pytest.importorskip("jinja2")

from helpers import anthropic_client, openai_client, request  # noqa: E402
from tiny_chat import start_scripted_qwen3  # noqa: E402

MODEL = "tiny-qwen3"
SCRIPT = ('<think>Checking the weather</think>Sure.<tool_call>{"name":"get_weather",'
          '"arguments":{"city": "Paris"}}</tool_call>')
ASK = "Weather in Paris?"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def thinker(vocab_dir, tmp_path_factory):
    srv = start_scripted_qwen3(vocab_dir, tmp_path_factory.mktemp("tiny-qwen3-apis"), SCRIPT,
                               MODEL)
    yield srv
    srv.proc.terminate()
    srv.proc.wait(timeout=20)


def test_responses_reasoning_text_and_call_plain_and_streamed(thinker):
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMS,
              "strict": False}]
    with openai_client(thinker) as client:
        r = client.responses.create(model=MODEL, input=ASK, tools=tools, temperature=0,
                                    max_output_tokens=64, reasoning={"effort": "low"})
        with client.responses.stream(model=MODEL, input=ASK, tools=tools, temperature=0,
                                     max_output_tokens=64) as stream:
            events = list(stream)
            final = stream.get_final_response()
    thought, said, call = r.output
    assert thought.type == "reasoning" and thought.content[0].text == "Checking the weather"
    assert said.type == "message" and r.output_text == "Sure."
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"})
    assert r.usage.output_tokens_details.reasoning_tokens == 5   # <think> ... </think>
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == thought.content[0].text
    assert final.output_text == "Sure." and final.output[2].arguments == call.arguments
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "Checking the weather"
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]


def test_messages_thinking_text_and_tool_use_plain_and_streamed(thinker):
    tools = [{"name": "get_weather", "input_schema": PARAMS}]
    ask = [{"role": "user", "content": ASK}]
    with anthropic_client(thinker) as client:
        m = client.messages.create(model=MODEL, messages=ask, tools=tools, max_tokens=64,
                                   thinking={"type": "adaptive"}, extra_body={"temperature": 0})
        with client.messages.stream(model=MODEL, messages=ask, tools=tools, max_tokens=64,
                                    extra_body={"temperature": 0}) as stream:
            events = list(stream)
            final = stream.get_final_message()
    thought, said, use = m.content
    assert (thought.type, thought.thinking) == ("thinking", "Checking the weather")
    assert (said.type, said.text) == ("text", "Sure.")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert m.stop_reason == "tool_use"
    assert [b.model_dump(exclude={"id"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in m.content]
    kinds = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert kinds == {"thinking_delta", "text_delta", "input_json_delta"}


def test_thinking_off_and_the_thought_sent_back(thinker):
    """``thinking`` disabled and ``reasoning.effort`` none reach the template (200); an earlier
    turn's thinking block and reasoning item are taken as its reasoning."""
    turn = [{"role": "user", "content": ASK},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Checking", "signature": ""},
                {"type": "tool_use", "id": "call_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": "sunny"}]}]
    tools = [{"name": "get_weather", "input_schema": PARAMS}]
    for body in ({"thinking": {"type": "disabled"}}, {"messages": turn, "tools": tools}):
        status, _, raw = request(thinker, "POST", "/v1/messages", {
            "model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 8,
            **body})
        assert status == 200, raw
    items = [{"role": "user", "content": ASK},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Checking"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    for body in ({"input": ASK, "reasoning": {"effort": "none"}}, {"input": items}):
        status, _, raw = request(thinker, "POST", "/v1/responses",
                                 {"model": MODEL, "max_output_tokens": 8, **body})
        assert status == 200, raw
