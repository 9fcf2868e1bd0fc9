"""Structured outputs, unit tier: OpenAI's ``response_format`` and ``logit_bias`` and TGI's
``grammar`` as :mod:`tiny_mindie.api.structured` validates them (every malformed one is the
client's 400 / 422 naming the field), and :mod:`tiny_mindie.engine.constraint` (compiling,
caching, masks, completion) on a small real vocabulary: the 256 bytes and an end token."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import byte_tokenizer

from tiny_mindie.api.chat import tool_request as tr
from tiny_mindie.api.chat.structured import (
    INT_BOUND,
    closed,
    grammar_schema,
    logit_bias,
    response_format,
    tgi_grammar,
)
from tiny_mindie.api.errors import APIError, Kind
from tiny_mindie.api.openai.request import parse_chat, parse_completion
from tiny_mindie.engine.constraint import (
    ConstraintError,
    apply_bitmask,
    bitmask_words,
    compile_constraint,
)
from tiny_mindie.engine.request import Constraint, SamplingParams
from tiny_mindie.model.tokenizer import Tokenizer

EOS = 256          # byte_tokenizer's end of generation


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return byte_tokenizer()


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


def _rf(schema=SCHEMA, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, **extra}}


BAD_RESPONSE_FORMATS = [
    ("json_schema", "must be an object"),
    ({}, "type must be one of"),
    ({"type": "bogus"}, "type must be one of"),
    ({"type": ["text"]}, "type must be one of"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": "x"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "name must be 1-64"),
    ({"type": "json_schema", "json_schema": {"name": "", "schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "a" * 65, "schema": SCHEMA}}, "name must"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": 7, "schema": SCHEMA}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "thing"}}, "schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "thing", "schema": "{}"}},
     "schema is required"),
    (_rf(strict="yes"), "strict must be a boolean"),
    (_rf(description=3), "description must be a string"),
    (_rf({"type": "object", "not": {"type": "string"}}), 'Unimplemented keys: ["not"]'),
    (_rf({"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (_rf({"properties": {"a": {"if": {}, "then": {}}}}), '"if"'),
    (_rf({"type": "nonsense"}), "schema:"),
    (_rf({"$ref": "#/$defs/missing"}), "schema:"),
]


@pytest.mark.parametrize("value,words", BAD_RESPONSE_FORMATS)
def test_malformed_response_format_is_400_naming_it(tok, value, words):
    with pytest.raises(APIError) as e:
        response_format(tok, value)
    assert e.value.kind is Kind.BAD_REQUEST and e.value.param == "response_format"
    assert words in e.value.message


def test_response_format_values(tok):
    assert response_format(tok, None) is None
    assert response_format(tok, {"type": "text"}) is None
    assert response_format(tok, {"type": "json_object"}) == Constraint("json_object")
    c = response_format(tok, _rf(strict=True, description="a thing"))
    assert c.kind == "json_schema" and json.loads(c.spec) == grammar_schema(SCHEMA)
    assert response_format(tok, _rf(strict=False)) == c       # enforced either way
    ok = "aZ0_-" * 12 + "abcd"
    assert response_format(tok, {"type": "json_schema", "json_schema": {"name": ok,
                                                                        "schema": {}}})


@pytest.mark.parametrize("value", [
    [1, 2], "x", {"abc": 1}, {"-1": 1}, {"1.5": 1}, {"257": 1}, {"99999999999": 1}, {" 1": 1},
    {"1": 101}, {"1": -100.5}, {"1": "5"}, {"1": True}, {"1": None}, {"1": [1]}, {"1": 1e400},
])
def test_malformed_logit_bias_is_400_naming_it(tok, value):
    with pytest.raises(APIError) as e:
        logit_bias(tok, value)
    assert e.value.kind is Kind.BAD_REQUEST and e.value.param == "logit_bias"


def test_logit_bias_values(tok):
    assert logit_bias(tok, None) == {}
    assert logit_bias(tok, {"0": -100, "256": 100, "7": 0.5}) == {0: -100.0, 256: 100.0, 7: 0.5}
    with pytest.raises(ValueError):
        SamplingParams(logit_bias=((3, 100.5),))


@pytest.mark.parametrize("value", [
    "json", {"type": "bogus", "value": "x"}, {"type": "json"}, {"type": "json", "value": 3},
    {"type": "json", "value": "{not json"}, {"type": "json", "value": {"type": "nonsense"}},
    {"type": "regex"}, {"type": "regex", "value": {"a": 1}}, {"type": "regex", "value": "(ab"},
    {"type": "json_schema", "value": SCHEMA}, {"type": "json_schema", "value": {"schema": 1}},
    {"type": "json_schema", "value": {"name": 3, "schema": SCHEMA}},
])
def test_malformed_tgi_grammar_is_422(tok, value):
    with pytest.raises(APIError) as e:
        tgi_grammar(tok, value)
    assert e.value.kind is Kind.INVALID


def test_tgi_grammar_values(tok):
    assert tgi_grammar(tok, None) is None
    assert tgi_grammar(tok, {"type": "json", "value": SCHEMA}).kind == "json_schema"
    assert tgi_grammar(tok, {"type": "json", "value": json.dumps(SCHEMA)}).kind == "json_schema"
    for kind, spec in (("json_object", SCHEMA), ("json_schema", {"name": "t", "schema": SCHEMA}),
                       ("json_schema", {"schema": SCHEMA})):
        assert tgi_grammar(tok, {"type": kind, "value": spec}) == Constraint(
            "json_schema", json.dumps(grammar_schema(SCHEMA)))
    assert tgi_grammar(tok, {"type": "regex", "value": "[a-c]+"}) == Constraint("regex", "[a-c]+")


def test_closed_schemas_allow_no_unnamed_properties_but_keep_what_is_said():
    import jsonschema

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {}}},
        "c": {"anyOf": [{"type": "object", "properties": {"y": {}}}, {"type": "null"}]},
        "d": {"type": "object", "additionalProperties": {"type": "string"}},
        "e": {"type": "object", "properties": {"z": {}}, "patternProperties": {"^q": {}}},
        "f": {"type": "object"}, "g": {"type": ["object", "null"], "required": ["k"]},
        "h": {"type": "object", "minProperties": 1}, "i": {"not": {"type": "object"}}},
        "$defs": {"p": {"type": "object", "properties": {"w": {}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert props["b"]["items"]["additionalProperties"] is False
    assert props["c"]["anyOf"][0]["additionalProperties"] is False
    assert props["d"]["additionalProperties"] == {"type": "string"}      # said: kept
    assert "additionalProperties" not in props["e"]                       # patterns: kept
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert props["f"] == {"type": "object", "additionalProperties": False}   # any -> empty
    assert props["g"] == schema["properties"]["g"] and props["h"] == schema["properties"]["h"]
    assert props["i"] == schema["properties"]["i"]          # not inside "not": looser
    doc = {"a": {"x": 1}, "b": [{}], "c": None, "d": {"k": "v"}, "e": {"q1": 2}, "f": {},
           "g": {"k": 1}, "h": {"m": 1}, "i": 1}
    jsonschema.validate(doc, out)
    jsonschema.validate(doc, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "extra": 1}, out)


def test_integers_get_int64_bounds_in_the_grammar_only(tok):
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "m": {"type": ["integer", "null"], "minimum": 0},
        "k": {"type": "integer", "exclusiveMaximum": 10}, "x": {"type": "number"},
        "big": {"type": "integer", "minimum": 2**64},
        "l": {"type": "array", "items": {"type": "integer"}}}}
    out = grammar_schema(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -INT_BOUND, "maximum": INT_BOUND}
    assert props["m"] == {"type": ["integer", "null"], "minimum": 0, "maximum": INT_BOUND}
    assert props["k"] == {"type": "integer", "exclusiveMaximum": 10, "minimum": -INT_BOUND}
    assert props["x"] == {"type": "number"}                          # numbers: unbounded
    assert props["big"] == {"type": "integer", "minimum": 2**64}      # no empty range made
    assert props["l"]["items"] == props["n"]
    assert "maximum" not in schema["properties"]["n"]                # the client's: as it was
    assert out["additionalProperties"] is False         # not strict: closed to its members
    # the grammar: at most 19 digits, then the number must end
    rf = response_format(tok, _rf({"type": "object", "properties": {"n": {"type": "integer"}},
                                   "required": ["n"], "additionalProperties": False}))
    m = compile_constraint(tok, rf).matcher()
    for b in b'{"n":' + b"1" * 19:
        assert m.consume(b)
    assert _allowed(m, tok.vocab_size) == {ord("}")}


def test_strict_closes_bare_objects_too_non_strict_only_listed_members(tok):
    schema = {"type": "object", "properties": {"a": {"type": "object"}}}
    strict = json.loads(response_format(tok, _rf(schema, strict=True)).spec)
    assert strict == {**schema, "additionalProperties": False, "properties": {
        "a": {"type": "object", "additionalProperties": False}}}
    for loose in (response_format(tok, _rf(schema, strict=False)), response_format(tok, _rf(
            schema))):
        assert json.loads(loose.spec) == {**schema, "additionalProperties": False}


def test_tool_without_properties_is_called_with_the_empty_object(tok):
    """``"parameters": {"type": "object"}``: the grammar allows only ``{}`` as arguments (a
    small model otherwise writes made-up members until max_tokens)."""
    tools = tr.parse_tools([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}])
    schema = tr.call_schema(tools, tr.Choice("required"), parallel=False)
    m = compile_constraint(tok, Constraint("json_schema", json.dumps(schema))).matcher()
    for b in b'{"name":"f","arguments":{':
        assert m.consume(b)
    assert _allowed(m, tok.vocab_size) == {ord("}")}


def _app(tok):
    from types import SimpleNamespace

    return SimpleNamespace(llm=SimpleNamespace(model_name="m", tokenizer=tok))


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("field,value", [
    ("tools", TOOLS), ("tool_choice", "auto"), ("parallel_tool_calls", False),
    ("chat_template_kwargs", {"enable_thinking": False}), ("functions", [{"name": "f"}]),
    ("function_call", "auto")])
def test_chat_fields_on_completions_are_400_naming_them(tok, field, value):
    body = {"model": "m", "prompt": "hi", field: value}
    with pytest.raises(APIError) as e:
        parse_completion(_app(tok), json.dumps(body).encode())
    assert (e.value.status, e.value.param) == (400, field)
    assert "only supported on /v1/chat/completions" in e.value.message


def test_response_format_with_tools_under_auto_is_400_naming_it(tok):
    msgs = [{"role": "user", "content": "hi"}]
    for rf in ({"type": "json_object"}, _rf()):
        for choice in (None, "auto"):
            body = {"model": "m", "messages": msgs, "tools": TOOLS, "response_format": rf,
                    "tool_choice": choice}
            with pytest.raises(APIError) as e:
                parse_chat(_app(tok), json.dumps(body).encode())
            assert (e.value.status, e.value.param) == (400, "response_format")
        body = {"model": "m", "messages": msgs, "tools": TOOLS, "response_format": rf,
                "tool_choice": "none"}
        assert parse_chat(_app(tok), json.dumps(body).encode())[0].constraint


def _allowed(matcher, v: int) -> set[int]:
    bm = np.zeros((1, bitmask_words(v)), np.int32)
    matcher.fill_mask(bm, 0)
    x = np.zeros((1, v), np.float32)
    apply_bitmask(x, bm)
    return set(np.flatnonzero(x[0] == 0).tolist())


def test_matcher_follows_a_regex_and_ends_with_eos(tok):
    m = compile_constraint(tok, Constraint("regex", "a[0-9]{2}(x|yz)?")).matcher()
    assert _allowed(m, tok.vocab_size) == {ord("a")}
    for ch in "a12":
        assert m.consume(ord(ch))
    assert _allowed(m, tok.vocab_size) == {ord("x"), ord("y"), EOS}
    assert m.accepting and not m.done
    assert m.consume(ord("y"))
    assert _allowed(m, tok.vocab_size) == {ord("z")}
    assert m.consume(ord("z")) and m.done
    assert _allowed(m, tok.vocab_size) == {EOS}
    bad = compile_constraint(tok, Constraint("regex", "ab")).matcher()
    assert not bad.consume(ord("b")) and bad.error


def test_json_schema_mask_walks_a_valid_instance_compactly(tok):
    m = compile_constraint(tok, Constraint("json_schema", json.dumps(SCHEMA))).matcher()
    for b in b'{"n":42}':
        assert b in _allowed(m, tok.vocab_size)
        assert ord(" ") not in _allowed(m, tok.vocab_size)        # no free whitespace
        assert m.consume(b)
    assert m.done and _allowed(m, tok.vocab_size) == {EOS}


def test_compiled_grammars_are_cached_per_spec(tok):
    a = compile_constraint(tok, Constraint("json_object"))
    assert compile_constraint(tok, Constraint("json_object")) is a
    assert compile_constraint(tok, Constraint("regex", "a")) is not a
    m1, m2 = a.matcher(), a.matcher()
    assert m1.consume(ord("{")) and _allowed(m2, tok.vocab_size) == {ord("{")}  # own state
    with pytest.raises(ConstraintError, match="not valid JSON"):
        compile_constraint(tok, Constraint("json_schema", "{oops"))
    with pytest.raises(ValueError):
        Constraint("yaml")


def test_apply_bitmask_sets_disallowed_logits_to_minus_inf():
    v = 70
    logits = np.arange(2 * v, dtype=np.float32).reshape(2, v)
    bm = np.zeros((2, bitmask_words(v)), np.int32)
    bm[0, 0] = 0b101            # tokens 0 and 2
    bm[1, 2] = 1 << 5           # token 69
    apply_bitmask(logits, bm)
    assert np.flatnonzero(np.isfinite(logits[0])).tolist() == [0, 2]
    assert np.flatnonzero(np.isfinite(logits[1])).tolist() == [69]
    assert logits[1, 69] == v + 69


@pytest.mark.parametrize("v", [70, 4096, 49_152])
def test_apply_bitmask_matches_unpacking_every_bit(v):
    """Rows allowing few tokens, most tokens, all, one: the same ``-inf`` as the plain rule."""
    rng = np.random.default_rng(v)
    w = bitmask_words(v)
    bm = np.zeros((5, w), np.int32)
    bm[0, rng.integers(0, w, 3)] = rng.integers(1, 2**31, 3)           # few
    bm[1] = -1
    bm[1, rng.integers(0, w, max(1, w // 10))] = rng.integers(-2**31, 2**31, max(1, w // 10))
    bm[2] = -1                                                          # all
    bm[3, (v - 1) // 32] = np.array([1 << ((v - 1) % 32)], np.uint32).view(np.int32)[0]  # last
    bm[4] = rng.integers(-2**31, 2**31, w)                              # half
    logits = rng.normal(size=(5, v)).astype(np.float32)
    plain = logits.copy()
    bits = np.unpackbits(bm.view(np.uint8), axis=1, count=v, bitorder="little")
    plain[bits == 0] = -np.inf
    apply_bitmask(logits, bm)
    assert np.array_equal(logits, plain)
    assert np.isfinite(logits[2]).all() and np.flatnonzero(np.isfinite(logits[3])) == [v - 1]


@pytest.mark.parametrize("constraint", [
    Constraint("regex", "z{1000000}"),                          # lexer limit at its 2nd byte
    Constraint("json_schema", json.dumps({"type": "string", "pattern": "^f{1000000}$"})),
    Constraint("json_schema", json.dumps(                      # parser limit after "{"
        {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(800)}})),
])
def test_grammars_that_fail_in_their_first_tokens_are_refused_at_compile(tok, constraint):
    """They compile, then fail when a mask is computed or a token consumed: a request with one
    was a 500, and the cached grammar then let the next ones end at once with an empty 200.
    The compile-time probe refuses them (a 400), and they are not cached."""
    from tiny_mindie.engine import constraint as module

    with pytest.raises(ConstraintError, match="too complex to enforce"):
        compile_constraint(tok, constraint)
    cache = module._tokenizers.get(tok)[1]
    assert (constraint.kind, constraint.spec) not in cache
    many = {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(400)}}
    compile_constraint(tok, Constraint("json_schema", json.dumps(many)))   # below the limits


# ---- issue 29: response_format's keys, allOf under strict, ASCII \d, thinking fields -----
ITEM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
        "additionalProperties": False}


def _walks(tok, c: Constraint, text: bytes) -> bool:
    """Whether ``c``'s grammar takes ``text`` and may end there."""
    m = compile_constraint(tok, c).matcher()
    return all(m.consume(b) for b in text) and m.accepting


def test_json_object_with_schema_enforces_it_as_llama_cpp(tok):
    """llama.cpp's ``{"type": "json_object", "schema": ...}`` (instructor's JSON_SCHEMA
    mode): the schema holds, not merely "an object"."""
    c = response_format(tok, {"type": "json_object", "schema": ITEM})
    assert c == Constraint("json_schema", json.dumps(grammar_schema(ITEM)))
    assert _walks(tok, c, b'{"name":"x"}') and not _walks(tok, c, b'{"Tom":1}')
    with pytest.raises(APIError) as e:
        response_format(tok, {"type": "json_object", "schema": "{}"})
    assert e.value.param == "response_format" and "must be an object" in e.value.message


def test_json_object_with_schema_is_still_one_object(tok):
    """``json_object`` promises an object: a schema without a type gets ``object`` (an empty
    schema no longer lets a number through), one whose type excludes objects is a 400."""
    c = response_format(tok, {"type": "json_object", "schema": {}})
    assert _walks(tok, c, b'{"a":1}') and not _walks(tok, c, b"1.5")
    with pytest.raises(APIError) as e:
        response_format(tok, {"type": "json_object", "schema": {"type": "integer"}})
    assert e.value.param == "response_format" and "json_schema" in e.value.message
    both = response_format(tok, {"type": "json_object", "schema": {"type": ["object", "null"]}})
    assert _walks(tok, both, b"{}") and not _walks(tok, both, b"null")


@pytest.mark.parametrize("value,key", [
    ({"type": "json_object", "bogus": 1}, "bogus"),
    ({"type": "text", "schema": ITEM}, "schema"),
    ({"type": "text", "json_schema": {"name": "a", "schema": ITEM}}, "json_schema"),
    ({**_rf(), "schema": ITEM}, "schema"),
    ({**_rf(), "strict": True}, "strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": ITEM, "x": 1}},
     "json_schema.x"),
])
def test_unknown_response_format_keys_are_400_naming_them(tok, value, key):
    with pytest.raises(APIError) as e:
        response_format(tok, value)
    assert (e.value.status, e.value.param) == (400, f"response_format.{key}")
    assert e.value.code == "unknown_parameter"
    assert f"'response_format.{key}'" in e.value.message


def test_strict_all_of_closes_the_combined_object_not_each_branch(tok):
    import jsonschema

    schema = {"type": "object", "allOf": [
        {"properties": {"name": {"type": "string"}}, "required": ["name"]},
        {"properties": {"price": {"type": "number"}}, "required": ["price"]}]}
    out = closed(schema)
    jsonschema.validate({"name": "a", "price": 1}, out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "a", "price": 1, "extra": 2}, out)
    nested = {"type": "object", "properties": {"x": {"type": "integer"}}, "allOf": [
        {"allOf": [{"properties": {"y": {"type": "object", "properties": {"z": {}}}}}]}]}
    out = closed(nested)
    jsonschema.validate({"x": 1, "y": {"z": 1}}, out)
    for doc in ({"x": 1, "w": 1}, {"y": {"z": 1, "v": 2}}):      # closed at both levels
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, out)
    c = response_format(tok, _rf(schema, strict=True))
    assert _walks(tok, c, b'{"name":"a","price":1}')
    assert not _walks(tok, c, b'{"name":"a","price":1,"x":1}')


def test_tgi_regex_digits_are_ascii_as_in_json_schema_patterns(tok):
    r"""``\d`` is [0-9] in a TGI regex, as in a JSON schema ``pattern`` (not any Unicode
    digit, e.g. U+1FBF8); ``\D`` its complement."""
    for c in (tgi_grammar(tok, {"type": "regex", "value": r"\d{2}-\D"}),
              tgi_grammar(tok, {"type": "json", "value": {"type": "string",
                                                          "pattern": r"^\d{2}-\D$"}})):
        quote = b'"' if c.kind == "json_schema" else b""
        assert _walks(tok, c, quote + b"12-x" + quote)
        assert not _walks(tok, c, quote + "🯸1-x".encode() + quote)
        assert _walks(tok, c, quote + "12-🯸".encode() + quote)
    assert _walks(tok, tgi_grammar(tok, {"type": "regex", "value": "a/b"}), b"a/b")


def test_overlapping_one_of_says_what_to_change_in_the_schema(tok):
    with pytest.raises(APIError) as e:
        response_format(tok, _rf({"oneOf": [{"type": "string"},
                                            {"type": "string", "maxLength": 3}]}))
    assert "coerce_one_of" not in e.value.message and "Enable" not in e.value.message
    assert "oneOf" in e.value.message and "anyOf" in e.value.message


CALLED = [{"role": "user", "content": "hi"},
          {"role": "assistant", "content": None, "tool_calls": [
              {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_tool_message_must_answer_an_earlier_call(tok):
    ok = [*CALLED, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]
    parse_chat(_app(tok), json.dumps({"model": "m", "messages": ok}).encode())
    for messages in ([*CALLED, {"role": "tool", "tool_call_id": "call_2", "content": "x"}],
                     [CALLED[0], {"role": "tool", "tool_call_id": "call_1", "content": "x"},
                      CALLED[1]]):
        with pytest.raises(APIError) as e:
            parse_chat(_app(tok), json.dumps({"model": "m", "messages": messages}).encode())
        assert (e.value.status, e.value.param) == (400, "messages")
        assert "tool_call_id" in e.value.message


@pytest.mark.parametrize("extra,param", [
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
])
def test_thinking_asked_of_a_model_that_cannot_think_is_400(tok, extra, param):
    import asyncio
    from types import SimpleNamespace

    from tiny_mindie.api.openai.chat import prepare_chat

    def prepare(template: str, body: dict):
        p, messages, kwargs, tools = parse_chat(_app(tok), json.dumps(body).encode())
        llm = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))
        asyncio.run(prepare_chat(llm, p, messages, kwargs, tools))

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(APIError) as e:
        prepare("{{ messages }}", body)
    assert (e.value.status, e.value.param) == (400, param)
    assert e.value.code == "unsupported_parameter" and "think" in e.value.message
    with pytest.raises(AttributeError):    # a template that thinks: on to encoding
        prepare("{{ messages }}</think>", body)
    prepare_off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    prepare_off.pop("reasoning_effort", None)
    prepare_off.pop("reasoning", None)
    with pytest.raises(AttributeError):    # asking for no thinking: fine
        prepare("{{ messages }}", prepare_off)
