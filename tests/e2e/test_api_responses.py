"""OpenAI's Responses API (``POST /v1/responses``) against the real server and model, driven by
the official ``openai`` SDK (``responses.create``, ``responses.stream``) and by openai-agents'
default model (``OpenAIResponsesModel``); the same-answer promise across chat completions,
responses and Anthropic's messages."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from helpers import access_line, anthropic_client, openai_client, request, sse_events, wait_until

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
HI = "Say hi"
WEATHER = "What is the weather in Paris?"
CITY_TOOL = {"type": "function", "name": "get_weather", "description": "Get a city's weather.",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def test_create_answers_a_completed_response(client):
    r = client.responses.create(model=MODEL, input=HI, temperature=0, max_output_tokens=200)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.text and r.output_text == part.text
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert r.temperature == 0 and r.max_output_tokens == 200 and r.store is False


def test_instructions_are_the_system_message(client):
    """``instructions`` is the chat's system message: the same prompt, the same answer."""
    said = client.responses.create(model=MODEL, instructions="Answer in French.", input=HI,
                                   temperature=0, max_output_tokens=30)
    as_item = client.responses.create(
        model=MODEL, input=[{"role": "system", "content": "Answer in French."},
                            {"role": "user", "content": [{"type": "input_text", "text": HI}]}],
        temperature=0, max_output_tokens=30)
    assert said.output_text == as_item.output_text
    assert said.usage.input_tokens == as_item.usage.input_tokens


def test_cut_off_at_max_output_tokens_is_incomplete(client, server):
    r = client.responses.create(model=MODEL, input=HI, temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5
    assert [item.status for item in r.output] == ["incomplete"]
    status, _, body = request(server, "POST", "/v1/responses",
                              {"model": MODEL, "input": HI, "temperature": 0,
                               "max_output_tokens": 5, "stream": True})
    assert status == 200
    events = sse_events(_data_only(body))
    assert events[-1]["type"] == "response.incomplete"
    assert [i["status"] for i in events[-1]["response"]["output"]] == ["incomplete"]
    (done,) = [e for e in events if e["type"] == "response.output_item.done"]
    assert done["item"]["status"] == "incomplete"
    (added,) = [e for e in events if e["type"] == "response.output_item.added"]
    assert added["item"]["status"] == "in_progress"


def _data_only(raw: bytes) -> bytes:
    """An SSE body with its ``event:`` lines taken out (each checked to name its data's type)."""
    blocks = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            head, _, data = block.partition("\n")
            assert head.startswith("event: ") and data.startswith("data: "), block
            assert json.loads(data[6:])["type"] == head[7:]
            blocks.append(data)
    return "\n\n".join(blocks).encode() + b"\n\n"


def test_stream_is_the_responses_event_sequence(client):
    plain = client.responses.create(model=MODEL, input=HI, temperature=0, max_output_tokens=200)
    with client.responses.stream(model=MODEL, input=HI, temperature=0,
                                 max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"]
                     + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done",
                        "response.output_item.done", "response.completed"])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_required_tool_call_and_its_result_round_trip(client):
    r = client.responses.create(model=MODEL, input=WEATHER, tools=[CITY_TOOL],
                                tool_choice="required", temperature=0, max_output_tokens=64)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    assert r.tools[0].strict is True       # Responses' default
    again = client.responses.create(
        model=MODEL, tools=[CITY_TOOL], temperature=0, max_output_tokens=20,
        input=[{"role": "user", "content": WEATHER}, *r.output,      # the SDK's items
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 22 C"}])
    assert again.output and again.usage.input_tokens > r.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": WEATHER},
                                       {"type": "function_call_output", "call_id": "nope",
                                        "output": "x"}])
    assert err.value.body["param"].startswith("input")


def test_stream_of_a_function_call(client):
    with client.responses.stream(model=MODEL, input=WEATHER, tools=[CITY_TOOL],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert kinds[2] == "response.output_item.added" and kinds[-1] == "response.completed"
    (call,) = final.output
    assert call.type == "function_call" and deltas == done.arguments == call.arguments
    assert json.loads(call.arguments).keys() == {"city"}


def test_function_call_cut_off_is_an_incomplete_function_call(client):
    """A forced call cut off by ``max_output_tokens`` is a ``function_call`` item, status
    ``incomplete``, with the arguments written so far -- streamed as the call's events."""
    ask = dict(model=MODEL, input=WEATHER, tools=[CITY_TOOL], temperature=0,
               tool_choice={"type": "function", "name": "get_weather"})
    whole = client.responses.create(**ask, max_output_tokens=64)
    cap = whole.usage.output_tokens - 4
    r = client.responses.create(**ask, max_output_tokens=cap)
    (call,) = r.output
    assert r.status == "incomplete" and r.usage.output_tokens == cap
    assert call.type == "function_call" and call.status == "incomplete", r
    assert call.name == "get_weather" and call.arguments.startswith("{")
    assert len(call.arguments) < len(whole.output[0].arguments), (call, whole)
    with client.responses.stream(**ask, max_output_tokens=cap) as stream:
        events = list(stream)
    kinds = {e.type for e in events}
    assert "response.output_text.delta" not in kinds and kinds >= {
        "response.function_call_arguments.delta", "response.incomplete"}
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.type == "function_call" and done.item.status == "incomplete"
    assert done.item.arguments == call.arguments


def test_text_format_json_schema_holds_the_answer(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Describe a person as JSON.",
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": schema, "strict": True}},
                                temperature=0, max_output_tokens=60)
    jsonschema.validate(json.loads(r.output_text), schema)


def test_same_seeded_text_through_chat_responses_and_messages(server, client):
    """The same-answer promise: one seeded, sampled request gives one text on all three."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                          **SEEDED)
    resp = client.responses.create(model=MODEL, input=messages, max_output_tokens=30,
                                   extra_body=SEEDED)
    with anthropic_client(server) as anthropic:
        msg = anthropic.messages.create(model=MODEL, messages=messages, max_tokens=30,
                                        extra_body=SEEDED)
    assert chat.choices[0].message.content == resp.output_text == msg.content[0].text
    other = client.responses.create(model=MODEL, input=messages, max_output_tokens=30,
                                    extra_body={**SEEDED, "seed": 4321})
    assert other.output_text != resp.output_text      # the seed matters: not greedy by accident


def test_agents_default_model_runs_a_tool_agent(server):
    """openai-agents' default model (the Responses API) calls the tool, gets its result back
    as a ``function_call_output`` item and answers: the run ends with a message."""
    agents = pytest.importorskip("agents")
    import httpx2
    from agents.models.openai_responses import OpenAIResponsesModel

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    async def run():
        async with httpx2.AsyncClient(verify=server.ssl_context(), timeout=120) as http:
            model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key="x", http_client=http, max_retries=0))
            agent = agents.Agent(name="weather", instructions="Use the weather tool.",
                                 tools=[get_weather], model=model,
                                 model_settings=agents.ModelSettings(
                                     tool_choice="required", temperature=0, max_tokens=40))
            return await agents.Runner.run(agent, WEATHER, max_turns=3)

    result = asyncio.run(run())
    assert cities == ["Paris"]
    assert [type(i).__name__ for i in result.new_items] == [
        "ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output
    first, second = result.raw_responses
    assert second.usage.input_tokens > first.usage.input_tokens   # the call and its result


@pytest.mark.parametrize("body, param, code", [
    ({"input": HI, "frequency_penalty": 1}, "frequency_penalty", "unknown_parameter"),
    ({"input": HI, "previous_response_id": "resp_1"}, "previous_response_id", None),
    ({"input": HI, "store": True}, "store", None),
    ({"input": HI, "include": ["message.output_text.logprobs"]}, "include", None),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", None),
    ({"input": [{"role": "user", "content": HI, "x": 1}]}, "input[0].x", "unknown_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content", None),
    ({"input": HI, "tools": [{"type": "web_search"}]}, "tools", None),
    ({"input": HI, "reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
    ({"input": HI, "temperature": -1}, "temperature", None),
    ({"input": HI, "max_output_tokens": 0}, "max_output_tokens", None),
    ({"input": HI, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     None),
    ({"input": []}, "input", None),
    ({"input": "word " * 2000}, "input", "context_length_exceeded"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, code):
    status, _, raw = request(server, "POST", "/v1/responses", {"model": MODEL, **body})
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error", raw
    assert err["param"] == param and err["code"] == code, raw


@pytest.mark.parametrize("body, param, said", [
    ({"input": HI, "max_output_tokens": 0}, "max_output_tokens",
     "Parameter max_output_tokens must be in [1,"),
    ({"input": HI, "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format", "text.format.name must be"),
    ({"instructions": "Be brief.", "input": [
        {"role": "user", "content": HI},
        {"type": "function_call_output", "call_id": "call_9", "output": "Sunny"}]},
     "input", 'input[1].call_id "call_9" answers no tool call'),
])
def test_error_messages_name_the_fields_sent(server, body, param, said):
    """The chat pipeline's errors name the Responses fields, in ``param`` and the message."""
    status, _, raw = request(server, "POST", "/v1/responses", {"model": MODEL, **body})
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and said in err["message"], raw
    assert not re.search(r"max_tokens|response_format|tool_call|messages", err["message"]), raw


def test_store_false_and_metadata_change_nothing(client):
    r = client.responses.create(model=MODEL, input=HI, temperature=0, max_output_tokens=12,
                                store=False, metadata={"k": "v"}, truncation="disabled")
    plain = client.responses.create(model=MODEL, input=HI, temperature=0, max_output_tokens=12)
    assert r.output_text == plain.output_text and r.metadata == {"k": "v"}


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-x", input=HI)
    assert err.value.body["code"] == "model_not_found"


def test_counted_in_metrics_and_the_access_log(server):
    def received() -> float:
        _, _, body = request(server, "GET", "/metrics")
        return float(re.search(rb"\ntiny_mindie_request_received_total\{[^}]*\} (\S+)",
                               body).group(1))

    before = received()
    for path, body in (("/v1/responses", {"input": HI, "max_output_tokens": 2}),
                       ("/v1/messages", {"messages": [{"role": "user", "content": HI}],
                                         "max_tokens": 2})):
        rid = "new-api-" + path.rsplit("/", 1)[1]
        status, _, _ = request(server, "POST", path, {"model": MODEL, **body},
                               headers={"X-Request-Id": rid})
        assert status == 200
        assert re.search(rf'tiny_mindie\.access: "POST {path}" 200 .* id={rid} .*'
                         r"generated_tokens=2$", access_line(server, rid))
    wait_until(lambda: received() >= before + 2, what="two requests counted")
