"""tiny_mindie.api.tool_request and tool_calls without a model: ``tools`` / ``tool_choice``
validation (every malformed value a 400 naming its field), the call parsers, and the streaming
parser cut at every point giving the whole-text answer."""

from __future__ import annotations

import json

import pytest
from cpu_time import least_cpu_seconds

from tiny_mindie.api.chat import tool_calls as tc
from tiny_mindie.api.chat import tool_request as tr
from tiny_mindie.api.errors import APIError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get-time_2", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}}}}


def _fn(**kw) -> list:
    return [{"type": "function", "function": {"name": "f", **kw}}]


BAD_TOOLS = [
    {"type": "function"}, "get_weather", [1], [{"type": "retrieval"}],
    [{"function": {"name": "f"}}], [{"type": "function", "function": "f"}],
    [{"type": "function", "function": {"name": "f"}, "extra": 1}],
    _fn(name=""), [{"type": "function", "function": {}}],
    [{"type": "function", "function": {"name": "a b"}}],
    [{"type": "function", "function": {"name": "x" * 65}}],
    [{"type": "function", "function": {"name": "naïve"}}],
    [WEATHER, WEATHER], _fn(description=3), _fn(parameters=[]),
    _fn(parameters={"type": "string"}), _fn(parameters={"type": "object", "properties": 3}),
    _fn(parameters={"type": "object", "required": "city"}), _fn(strict="yes"),
    _fn(parameters={"type": "object"}, colour="red"),
]


@pytest.mark.parametrize("tools", BAD_TOOLS, ids=range(len(BAD_TOOLS)))
def test_malformed_tools_are_400_naming_tools(tools):
    with pytest.raises(APIError) as exc:
        tr.parse_tools(tools)
    assert (exc.value.status, exc.value.param) == (400, "tools"), exc.value.message


def test_good_tools_and_their_template_form():
    tools = tr.parse_tools([WEATHER, TIME, _fn()[0]])
    assert [t.name for t in tools] == ["get_weather", "get-time_2", "f"]
    assert tools[0].as_openai() == WEATHER
    assert tools[2].as_openai()["function"] == {
        "name": "f", "parameters": {"type": "object", "properties": {}}}
    assert tr.parse_tools(None) is None and tr.parse_tools([]) is None


BAD_CHOICES = [("any", [WEATHER]), (3, [WEATHER]), ({"type": "function"}, [WEATHER]),
               ({"type": "function", "function": {"name": "nope"}}, [WEATHER]),
               ({"type": "tool", "function": {"name": "get_weather"}}, [WEATHER]),
               ({"function": {"name": "get_weather"}}, [WEATHER]),
               ({"type": "function", "function": {"name": 3}}, [WEATHER]),
               ("required", None), ("auto", None),
               ({"type": "function", "function": {"name": "get_weather"}}, None)]


@pytest.mark.parametrize("choice,tools", BAD_CHOICES, ids=range(len(BAD_CHOICES)))
def test_malformed_tool_choice_is_400_naming_it(choice, tools):
    with pytest.raises(APIError) as exc:
        tr.parse_tool_choice(choice, tr.parse_tools(tools))
    assert (exc.value.status, exc.value.param) == (400, "tool_choice"), exc.value.message


def test_tool_choice_defaults_and_schemas():
    tools = tr.parse_tools([WEATHER, TIME])
    assert tr.parse_tool_choice(None, tools) == tr.Choice("auto")
    assert tr.parse_tool_choice(None, None) == tr.Choice("none")
    assert tr.parse_tool_choice("none", None) == tr.Choice("none")
    named = tr.parse_tool_choice({"type": "function", "function": {"name": "get-time_2"}}, tools)
    assert named == tr.Choice("function", "get-time_2")
    one = tr.call_schema(tools, named, parallel=True)
    assert one["properties"] == {"name": {"const": "get-time_2"}, "arguments": {
        **TIME["function"]["parameters"], "additionalProperties": False}}
    assert one["required"] == ["name", "arguments"] and one["additionalProperties"] is False
    req = tr.parse_tool_choice("required", tools)
    single = tr.call_schema(tools, req, parallel=False)
    assert [s["properties"]["name"]["const"] for s in single["anyOf"]] == ["get_weather",
                                                                           "get-time_2"]
    many = tr.call_schema(tools, req, parallel=True)
    assert many == {"type": "array", "items": single, "minItems": 1}


def test_strict_tools_under_auto_get_a_lazy_grammar():
    """Strict tools with ``tool_choice`` auto or unset are accepted (issue 29 item 1); their
    calls get a lazy grammar: free text, a call held to the strict tools' schemas (the others'
    arguments any object) once its marker is written."""
    from tiny_mindie.api.openai.request import _chat_tools

    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    for body in ({"tools": [strict, TIME]}, {"tools": [strict], "tool_choice": "auto"}):
        assert _chat_tools(body, False).choice == tr.Choice("auto")
    tools = tr.parse_tools([strict, TIME])
    opts = {"whitespace_flexible": False}
    hermes = tr.lazy_call_grammar(tools, tc.HERMES, {}, opts)
    lines = hermes.splitlines()
    assert lines[1:2] == ["start: call* TEXT"] and "call_open[lazy]: TEXT \"<tool_call>\"" in lines
    schema = json.loads(lines[2].split("%json ", 1)[1].rsplit(' "\\n"?', 1)[0])
    assert schema["x-guidance"] == opts
    weather, time = schema["anyOf"]
    assert weather["properties"]["arguments"] == {**WEATHER["function"]["parameters"],
                                                  "additionalProperties": False}
    assert time["properties"] == {"name": {"const": "get-time_2"},
                                  "arguments": {"type": "object"}}
    llama = tr.lazy_call_grammar(tools, tc.LLAMA3, {tc.PYTHON_TAG: 128010}, opts)
    assert "start: TEXT | WS? <[128010]>? call (\";\" WS? call)*" in llama
    one = tr.lazy_call_grammar(tools, tc.LLAMA3, {}, opts, several=False)
    assert 'start: TEXT | WS? "<|python_tag|>"? call\n' in one
    # Mistral: after [TOOL_CALLS] (a control token here) a JSON list, or name[ARGS]{...} each
    mistral = tr.lazy_call_grammar(tools, tc.MISTRAL, {tc.MISTRAL_CALLS: 5, "[ARGS]": 6}, opts)
    assert "start: TEXT | TEXT? <[5]> WS? calls\n" in mistral
    assert 'calls: "[" WS? call ("," WS? call)* WS? "]" | named (<[5]> WS? named)*' in mistral
    named = mistral.split("\nnamed: ", 1)[1].split("\n", 1)[0]
    assert named.startswith('"get_weather" <[6]> %json ') and ' | "get-time_2" <[6]> %json' in named
    text = tr.lazy_call_grammar(tools, tc.MISTRAL, {}, opts, several=False)
    assert 'calls_open[lazy]: TEXT "[TOOL_CALLS]"' in text and '| named\n' in text


def test_history_call_arguments_any_string():
    """An earlier assistant call's ``arguments``: JSON object text -> the object, "" -> the
    empty object, other text passed on as it is (OpenAI accepts any string), no string: 400."""
    from tiny_mindie.api.openai.request import _message_tool_calls

    def args(value):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": value}}
        return _message_tool_calls([call], 1)[0]["function"]["arguments"]

    assert args('{"a": 1}') == {"a": 1} and args("") == {} and args("  ") == {}
    assert args("not json") == "not json" and args("[1]") == "[1]"
    with pytest.raises(APIError) as exc:
        args({"a": 1})
    assert (exc.value.status, exc.value.param) == (400, "messages")


def test_format_detection_by_template_text():
    assert tc.detect_format("... <tool_call>\\n{...}</tool_call> ...") == tc.HERMES
    assert tc.detect_format('{{ "[TOOL_CALLS][" }}') == tc.MISTRAL
    assert tc.detect_format('<|start_header_id|> {{ \'"parameters": \' }}') == tc.LLAMA3
    assert tc.detect_format("{{ messages }}") is None
    assert tc.thinks("{{ '</think>' }}") and not tc.thinks("<tool_call>")
    assert tc.call_id(tc.HERMES).startswith("call_") and len(tc.call_id(tc.HERMES)) == 29
    mid = tc.call_id(tc.MISTRAL)
    assert len(mid) == 9 and mid.isalnum()


CALL = tc.ToolCall("get_weather", '{"city": "Paris"}')
# (text, format, reasoning, starts inside <think>, reasoning, content, calls)
CASES = [
    ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
     "\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
     tc.HERMES, False, False, None, "Let me check.", [CALL, tc.ToolCall("f", "{}")]),
    # no closing tag (the model stopped there), arguments as a JSON string
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
     tc.HERMES, False, False, None, None, [CALL]),
    # a block that is no call stays text; a lone "<tool" is text too
    ("a <tool_call>not json</tool_call> b <tool", tc.HERMES, False, False, None,
     "a <tool_call>not json</tool_call> b <tool", []),
    ("Paris is sunny.", tc.HERMES, False, False, None, "Paris is sunny.", []),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     tc.LLAMA3, False, False, None, None, [CALL]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}',
     tc.LLAMA3, False, False, None, None, [CALL, tc.ToolCall("f", "{}")]),
    ('The answer is {"a": 1}', tc.LLAMA3, False, False, None, 'The answer is {"a": 1}', []),
    ('{"a": 1}', tc.LLAMA3, False, False, None, '{"a": 1}', []),
    ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     tc.MISTRAL, False, False, None, "Sure.", [CALL]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}', tc.MISTRAL, False,
     False, None, None, [CALL, tc.ToolCall("f", "{}")]),
    ("[TOOL_CALLS]oops", tc.MISTRAL, False, False, None, "[TOOL_CALLS]oops", []),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}]', tc.JSON, False, False, None,
     None, [CALL]),
    ('{"name": "get_weather", "arguments": {"city": "Par', tc.JSON, False, False, None,
     '{"name": "get_weather", "arguments": {"city": "Par', []),
    # reasoning: opened by the answer, or by the prompt; unclosed; none
    ("<think>\nThe user wants weather.\n</think>\n\nSure.<tool_call>{\"name\": \"get_weather\", "
     "\"arguments\": {\"city\": \"Paris\"}}</tool_call>", tc.HERMES, True, False,
     "The user wants weather.", "Sure.", [CALL]),
    ("\nhmm\n</think>\n\nBlue", None, True, True, "hmm", "Blue", []),
    ("<think>still thinking", None, True, False, "still thinking", None, []),
    ("Blue <think>", None, True, False, None, "Blue <think>", []),
    ("<think>\n\n</think>\n\nBlue", None, True, False, None, "Blue", []),
]


# calls to a function that is not in tools ("f" here) stay content text, whatever the format
NAMES = frozenset({"get_weather"})
UNKNOWN = [
    ('Hi <tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": '
     '"get_weather", "arguments": {"city": "Paris"}}</tool_call>', tc.HERMES, False, False, None,
     'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call>', [CALL], NAMES),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}',
     tc.LLAMA3, False, False, None, '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "f", "parameters": {}}', [], NAMES),
    ('Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}]', tc.MISTRAL, False, False, None,
     'Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}]', [], NAMES),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', tc.MISTRAL, False, False, None, None,
     [CALL], NAMES),
]


@pytest.mark.parametrize("case", CASES + UNKNOWN, ids=range(len(CASES + UNKNOWN)))
def test_parse_output_and_every_stream_cut(case):
    text, fmt, reasoning, inside, want_r, want_c, want_calls, *names = case
    names = names[0] if names else None
    out = tc.parse_output(text, fmt, reasoning=reasoning, in_reasoning=inside, names=names)
    assert (out.reasoning, out.content, out.calls) == (want_r, want_c, want_calls)
    for call in out.calls:
        json.loads(call.arguments)
    # the streaming parser: fed in two pieces cut anywhere, and one character at a time
    for cut in range(len(text) + 1):
        p = tc.OutputParser(fmt, reasoning=reasoning, in_reasoning=inside, names=names)
        assert tc.collect(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()) == out, cut
    p = tc.OutputParser(fmt, reasoning=reasoning, in_reasoning=inside, names=names)
    deltas = [d for ch in text for d in p.feed(ch)] + p.finish()
    assert tc.collect(deltas) == out


# issue 29 item 14: a fenced JSON call (Qwen2.5-Coder's way with tools offered), as the real
# models write it: the whole answer, or after a short preamble
SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}
QWEN_CODER = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
PREAMBLE = "To get the current weather in Paris, I'll call the get_weather function.\n\n"
# Qwen2.5-Coder-0.5B-Instruct's greedy answer to "What's the weather in Paris?" with get_weather
REAL = ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}'
        '\n```')
FENCED = [
    (REAL, tc.HERMES, None, [CALL]),
    (QWEN_CODER, tc.HERMES, None, [CALL]),
    (PREAMBLE + QWEN_CODER + "\n", tc.HERMES, PREAMBLE.strip(), [CALL]),
    ('```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}```', tc.HERMES, None,
     [CALL]),
    (QWEN_CODER, tc.LLAMA3, None, [CALL]),
    ("Sure. " + QWEN_CODER, tc.MISTRAL, "Sure.", [CALL]),
    # text after the block: it was shown, not called
    (QWEN_CODER + "\nThis returns the weather.", tc.HERMES,
     QWEN_CODER + "\nThis returns the weather.", []),
    # no offered function, arguments against its schema, no call at all, cut off: content
    (QWEN_CODER.replace("get_weather", "get_time"), tc.HERMES,
     QWEN_CODER.replace("get_weather", "get_time"), []),
    (QWEN_CODER.replace('"Paris"', "75"), tc.HERMES, QWEN_CODER.replace('"Paris"', "75"), []),
    (QWEN_CODER.replace('"city"', '"town"'), tc.HERMES, QWEN_CODER.replace('"city"', '"town"'),
     []),
    ('Config:\n```json\n{"debug": true}\n```', tc.HERMES,
     'Config:\n```json\n{"debug": true}\n```', []),
    (QWEN_CODER[:-3], tc.HERMES, QWEN_CODER[:-4], []),
    # a call in the template's own format after a block that is none
    ('```json\n{"a": 1}\n```\n<tool_call>{"name": "get_weather", "arguments": {"city": '
     '"Paris"}}</tool_call>', tc.HERMES, '```json\n{"a": 1}\n```', [CALL]),
    # tool_choice "required" (constrained JSON) and no tools read no fences
    (QWEN_CODER, tc.JSON, QWEN_CODER, []),
    (QWEN_CODER, None, QWEN_CODER, []),
]


@pytest.mark.parametrize("case", FENCED, ids=range(len(FENCED)))
def test_a_fenced_json_call_of_an_offered_function_is_a_call(case):
    text, fmt, content, calls = case
    out = tc.parse_output(text, fmt, names=frozenset(SCHEMAS), schemas=SCHEMAS)
    assert (out.content, out.calls) == (content, calls)
    for cut in range(len(text) + 1):
        p = tc.OutputParser(fmt, names=frozenset(SCHEMAS), schemas=SCHEMAS)
        assert tc.collect(p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()) == out, cut
    p = tc.OutputParser(fmt, names=frozenset(SCHEMAS), schemas=SCHEMAS)
    assert tc.collect([d for ch in text for d in p.feed(ch)] + p.finish()) == out
    # without the tools' schemas (no tools offered) a fenced block is text
    assert tc.parse_output(QWEN_CODER, fmt) == tc.Output(None, QWEN_CODER, [])


def test_stream_holds_back_only_possible_markers():
    p = tc.OutputParser(tc.HERMES)
    assert p.feed("Hello <tool") == [("content", "Hello")]      # the space waits, so may "<tool"
    assert p.feed("box> and") == [("content", " <toolbox> and")]
    assert p.feed(" <tool_call>{\"name\": \"f\", ") == []
    assert p.feed('"arguments": {}}</tool_call>') == [("call", tc.ToolCall("f", "{}"))]
    r = tc.OutputParser(None, reasoning=True)
    assert r.feed("<thi") == [] and not r.thinking
    assert r.feed("nk>Hm") == [("reasoning", "Hm")] and r.thinking
    assert r.feed("m</th") == [("reasoning", "m")]
    assert r.feed("ink>Blue") == [("content", "Blue")] and not r.thinking


def test_many_llama3_calls_are_parsed_in_time_linear_in_their_number():
    """Twenty times the calls, about twenty times the work (CPU time of this thread), not the
    four-hundredfold of copying the rest of the answer after each call."""
    def cpu(n: int) -> float:
        text = ";".join(['{"name":"f"}'] * n) + " tail"
        calls, rest = tc.parse_llama3(text)
        assert (len(calls), rest) == (n, " tail")
        return least_cpu_seconds(lambda: tc.parse_llama3(text))

    assert cpu(40_000) / max(cpu(2_000), 1e-4) < 60


NESTED = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
    "$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}},
    "type": "object", "properties": {"addr": {"$ref": "#/$defs/Addr"}},
    "required": ["addr"], "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_parameters_with_defs_and_refs_are_held(choice):
    """A tool whose parameters refer to their own ``$defs`` (pydantic's nested models) is held
    under required, a named function and a strict tool's lazy grammar: the references resolve
    in the call's schema, and the nested object is held to its definition."""
    from helpers import byte_tokenizer

    from tiny_mindie.engine.constraint import compile_constraint
    from tiny_mindie.engine.request import Constraint

    tools = tr.parse_tools([NESTED, TIME])
    if choice == "auto":
        spec = tr.lazy_call_grammar(tools, tc.HERMES, {}, {"whitespace_flexible": False})
        constraint, start = Constraint("lark", spec), '<tool_call>\n'
    else:
        named = tr.Choice("function", "f") if choice == "named" else tr.Choice("required")
        schema = tr.call_schema(tools, named, parallel=False)
        constraint, start = Constraint("json_schema", json.dumps(schema)), ""
    tok = byte_tokenizer()
    good = compile_constraint(tok, constraint).matcher()
    assert all(good.consume(b) for b in f'{start}{{"name":"f","arguments":'
                                      f'{{"addr":{{"city":"Paris"}}}}}}'.encode())
    bad = compile_constraint(tok, constraint).matcher()
    assert not all(bad.consume(b) for b in f'{start}{{"name":"f","arguments":'
                                         f'{{"addr":{{"town"'.encode())
