"""Anthropic's Messages API (``POST /v1/messages``) against the real server and model, driven by
the official ``anthropic`` SDK (``messages.create``, ``messages.stream``, tool use included),
and its errors in Anthropic's shape."""

from __future__ import annotations

import json

import pytest
from helpers import anthropic_client, openai_client, request

anthropic = pytest.importorskip("anthropic")

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hi"}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
CITY_TOOL = {"name": "get_weather", "description": "Get a city's weather.",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    with anthropic_client(server) as c:
        yield c


def test_create_answers_a_message(client):
    m = client.messages.create(model=MODEL, messages=HI, max_tokens=200, extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL and m.stop_reason == "end_turn" and m.stop_sequence is None
    (block,) = m.content
    assert block.type == "text" and block.text
    u = m.usage
    assert u.output_tokens > 0 and u.input_tokens + u.cache_read_input_tokens > 0


def test_same_text_as_chat_completions(server, client):
    """The system prompt as a string, as text blocks, and chat's system message: one prompt."""
    system = "Answer in French."
    m = client.messages.create(model=MODEL, messages=HI, system=system, max_tokens=30,
                               extra_body=GREEDY)
    blocks = client.messages.create(model=MODEL, messages=HI, max_tokens=30, extra_body=GREEDY,
                                    system=[{"type": "text", "text": system}])
    with openai_client(server) as oa:
        chat = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": system}, *HI], max_tokens=30,
            temperature=0)
    assert m.content[0].text == blocks.content[0].text == chat.choices[0].message.content
    total = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert total == chat.usage.prompt_tokens


def test_max_tokens_cut_off(client):
    m = client.messages.create(model=MODEL, messages=HI, max_tokens=4, extra_body=GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4


def test_stop_sequence_names_the_one_that_matched(client):
    ask = [{"role": "user", "content": "Count: one, two, three, four"}]
    free = client.messages.create(model=MODEL, messages=ask, max_tokens=60, extra_body=GREEDY)
    text = free.content[0].text
    assert "Three" in text
    m = client.messages.create(model=MODEL, messages=ask, max_tokens=60, extra_body=GREEDY,
                               stop_sequences=["nowhere", "Three"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Three"
    assert m.content[0].text == text[:text.index("Three")]


def test_stream_events_and_text(client, server):
    plain = client.messages.create(model=MODEL, messages=HI, max_tokens=200, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, messages=HI, max_tokens=200,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == plain.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == plain.usage.output_tokens
    status, _, raw = request(server, "POST", "/v1/messages",
                             {"model": MODEL, "messages": HI, "max_tokens": 200, "stream": True,
                              **GREEDY})
    names = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            head, data = block.split("\n")
            names.append(head.removeprefix("event: "))
            assert json.loads(data.removeprefix("data: "))["type"] == names[-1]
    deltas = names.count("content_block_delta")
    assert status == 200 and deltas > 0
    assert names == (["message_start", "ping", "content_block_start"]
                     + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])


def test_tool_use_and_its_result(client):
    m = client.messages.create(model=MODEL, messages=WEATHER, max_tokens=64, tools=[CITY_TOOL],
                               tool_choice={"type": "any"}, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert set(use.input) == {"city"} and isinstance(use.input["city"], str)
    turn = [*WEATHER, {"role": "assistant", "content": m.content},    # the SDK's blocks
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "Sunny, 22 C"}]}]
    again = client.messages.create(model=MODEL, messages=turn, max_tokens=20,
                                   tools=[CITY_TOOL], extra_body=GREEDY)
    assert again.content and again.stop_reason in ("end_turn", "max_tokens", "tool_use")
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert total > m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stream_of_a_tool_use(client):
    with client.messages.stream(model=MODEL, messages=WEATHER, max_tokens=64,
                                tools=[CITY_TOOL], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    (use,) = final.content
    assert final.stop_reason == "tool_use" and use.type == "tool_use"
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.id for b in starts] == [use.id] and use.id.startswith("toolu_")
    assert json.loads(partial) == use.input and set(use.input) == {"city"}


def test_output_config_format_holds_the_answer(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"], "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "A person as JSON."}],
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": None}, "max_tokens: Field required"),
    ({"top_a": 1}, "top_a: Extra inputs are not permitted"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "budget"),
    ({"thinking": {"type": "adaptive"}}, "does not think"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"tools": [{"type": "web_search_20250305", "name": "w"}]}, "custom tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"stop_sequences": [""]}, "stop"),
    ({"stop_sequences": "e"}, "stop_sequences: Input should be a valid list"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, "prompt is too long: "),
    ({"system": "Be brief.", "messages": [
        {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": "Sunny"}]}]},
     'messages.2.content.0.tool_use_id "toolu_9" answers no tool call'),
])
def test_bad_requests_in_anthropics_shape(server, body, words):
    full = {"model": MODEL, "messages": HI, "max_tokens": 8, **body}
    status, _, raw = request(server, "POST", "/v1/messages",
                             {k: v for k, v in full.items() if v is not None})
    answer = json.loads(raw)
    assert status == 400 and answer["type"] == "error", raw
    assert answer["error"]["type"] == "invalid_request_error" and words in answer["error"][
        "message"], raw


def test_sdk_raises_its_typed_errors(client):
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-x", messages=HI, max_tokens=8)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, messages=HI, max_tokens=8,
                               extra_body={"temperature": 3})
    assert err.value.body["type"] == "error"
