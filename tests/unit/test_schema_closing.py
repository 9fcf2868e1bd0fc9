"""Schemas as the grammar holds them, unit tier (:func:`tiny_mindie.api.structured.closed`):
objects closed to the members they list unless they say otherwise, strict or not; ``allOf``
parts -- local ``$ref`` ones too -- closed together, never each on its own; and the refusals
of fields that ask for what a route cannot do (reasoning on ``/v1/completions``, a message
``name`` that is no string)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from helpers import byte_tokenizer

from tiny_mindie.api.chat.structured import (
    OPEN_SUFFIX,
    closed,
    grammar_schema,
    response_format,
    tgi_grammar,
)
from tiny_mindie.api.errors import APIError
from tiny_mindie.api.openai.request import THINKING_FIELDS, parse_chat, parse_completion
from tiny_mindie.engine.constraint import compile_constraint
from tiny_mindie.engine.request import Constraint


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _walks(tok, c: Constraint, text: bytes) -> bool:
    """Whether ``c``'s grammar takes ``text`` and may end there."""
    m = compile_constraint(tok, c).matcher()
    return all(m.consume(b) for b in text) and m.accepting


def _rf(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}


ADDR = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA = {"type": "object", "$defs": {"Addr": ADDR}, "properties": {
    "name": {"type": "string"}, "home": {"$ref": "#/$defs/Addr"},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
    "meta": {"type": "object"}, "free": {"type": "object", "additionalProperties": True},
    "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
    "shut": {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
    "pat": {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}},
    "required": ["name"]}


def test_non_strict_closes_listed_members_keeps_what_the_schema_says():
    out = closed(SCHEMA, bare=False)
    props = out["properties"]
    assert out["additionalProperties"] is False                     # the root
    assert out["$defs"]["Addr"]["additionalProperties"] is False     # a definition
    assert props["tags"]["items"]["additionalProperties"] is False   # an array's items
    assert props["meta"] == {"type": "object"}                      # bare: any object
    for said in ("free", "typed", "shut", "pat"):                    # said: as it was
        assert props[said] == SCHEMA["properties"][said]
    assert "additionalProperties" not in SCHEMA and "additionalProperties" not in ADDR
    doc = {"name": "a", "home": {"city": "b"}, "tags": [{"k": 1}], "meta": {"any": 1},
           "free": {"z": 1}, "typed": {"n": 2}, "shut": {"a": 1}, "pat": {"a": 1, "x1": 2}}
    jsonschema.validate(doc, out)
    for extra in ({"more": 1}, {"home": {"city": "b", "zip": "1"}}, {"tags": [{"k": 1, "v": 2}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**doc, **extra}, out)
        jsonschema.validate({**doc, **extra}, SCHEMA)      # what the client's schema allows
    strict = closed(SCHEMA)
    assert strict["properties"]["meta"] == {"type": "object", "additionalProperties": False}
    assert grammar_schema(SCHEMA)["properties"]["meta"] == {"type": "object"}
    assert grammar_schema(SCHEMA, strict=True)["properties"]["meta"]["additionalProperties"] \
        is False


def test_every_schema_route_closes_a_non_strict_schema(tok):
    user = {"type": "object", "properties": {"n": {"type": "string", "maxLength": 3}},
            "required": ["n"]}
    for c in (response_format(tok, _rf(user)), response_format(tok, _rf(user, strict=False)),
              response_format(tok, {"type": "json_object", "schema": user}),
              tgi_grammar(tok, {"type": "json", "value": user}),
              tgi_grammar(tok, {"type": "json_schema", "value": {"schema": user}})):
        assert _walks(tok, c, b'{"n":"ab"}')
        assert not _walks(tok, c, b'{"n":"ab","m":1}')
    opened = {**user, "additionalProperties": True}
    assert _walks(tok, response_format(tok, _rf(opened)), b'{"n":"ab","m":1}')


A = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}},
     "required": ["a"]}
B = {"type": "object", "properties": {"b": {"type": "integer", "maximum": 9}},
     "required": ["b"]}
ALL_OF_REFS = [
    # the issue's: one $ref branch, the definition closed by the client
    ({"$defs": {"A": {**A, "additionalProperties": False}}, "allOf": [{"$ref": "#/$defs/A"}]},
     b'{"a":"x"}', b'{"a":"x","c":1}'),
    ({"$defs": {"A": A}, "type": "object", "properties": {"b": B["properties"]["b"]},
      "required": ["b"], "allOf": [{"$ref": "#/$defs/A"}]}, b'{"b":1,"a":"x"}', b'{"b":1,"c":1}'),
    ({"$defs": {"A": A, "B": B}, "allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
     b'{"a":"x","b":1}', b'{"a":"x","b":1,"c":1}'),
    ({"definitions": {"A": A}, "allOf": [{"$ref": "#/definitions/A"}, B]},
     b'{"a":"x","b":1}', b'{"a":"x","b":1,"c":1}'),
    ({"$defs": {"A": A}, "$ref": "#/$defs/A", "properties": {"b": {}}, "required": ["b"]},
     b'{"a":"x","b":1}', b'{"a":"x","b":1,"c":1}'),
]


@pytest.mark.parametrize("schema,good,extra", ALL_OF_REFS)
@pytest.mark.parametrize("strict", [True, False])
def test_all_of_with_ref_branches_is_satisfiable_and_closed_together(tok, schema, good, extra,
                                                                     strict):
    c = response_format(tok, _rf(schema, strict=strict))     # no 400 "Unsatisfiable"
    assert _walks(tok, c, good) and not _walks(tok, c, extra)
    jsonschema.validate(json.loads(good), schema)
    out = closed(schema, bare=strict)
    jsonschema.validate(json.loads(good), out)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(extra), out)


def test_a_definition_is_closed_where_referenced_alone_open_as_a_part():
    schema = {"$defs": {"A": A, f"A{OPEN_SUFFIX}": {"type": "string"}}, "type": "object",
              "properties": {"one": {"$ref": "#/$defs/A"},
                             "both": {"allOf": [{"$ref": "#/$defs/A"}, B]}}}
    out = closed(schema)
    defs = out["$defs"]
    assert defs["A"]["additionalProperties"] is False
    assert defs[f"A{OPEN_SUFFIX}"] == {"type": "string"}               # the client's: kept
    copy = f"A{OPEN_SUFFIX}{OPEN_SUFFIX}"                              # a free name instead
    assert defs[copy] == A and out["properties"]["one"] == {"$ref": "#/$defs/A"}
    assert out["properties"]["both"]["allOf"][0] == {"$ref": f"#/$defs/{copy}"}
    doc = {"one": {"a": "x"}, "both": {"a": "x", "b": 1}}
    jsonschema.validate(doc, out)
    for bad in ({"one": {"a": "x", "b": 1}}, {"both": {"a": "x", "b": 1, "c": 2}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, out)


def test_cycles_and_shared_parts_stay_linear_in_the_schema():
    """``allOf`` chains through ``$ref`` (each definition two parts of the next) and cycles:
    one open copy per definition, so the output grows with the input, not with the paths."""
    def chain(n: int) -> dict:
        defs = {f"D{i}": {"allOf": [{"$ref": f"#/$defs/D{i + 1}"}] * 2,
                          "properties": {f"p{i}": {}}} for i in range(n)}
        defs[f"D{n}"] = {"type": "object", "properties": {"last": {}}}
        return {"$defs": defs, "$ref": "#/$defs/D0"}

    sizes = [len(json.dumps(closed(chain(n)))) / len(json.dumps(chain(n)))
             for n in (100, 1000, 5000)]
    assert sizes[2] < sizes[1] < sizes[0] < 20       # closed, up to MAX_ADDED_MEMBERS in all
    short = closed(chain(4))
    assert list(short["$defs"]["D0"]["properties"]) == ["p0", "p1", "p2", "p3", "last"]
    assert short["$defs"]["D0"]["additionalProperties"] is False
    looped = {"$defs": {"L": {"allOf": [{"$ref": "#/$defs/L"}], "properties": {"x": {}}}},
              "$ref": "#/$defs/L"}
    out = closed(looped)
    assert "additionalProperties" not in out["$defs"]["L"]    # a cycle of parts: left open


@pytest.mark.parametrize("field,value", [("enable_thinking", True), ("enable_thinking", False),
                                         ("reasoning_effort", "low"),
                                         ("reasoning", {"effort": "high"})])
def test_reasoning_on_completions_is_400_naming_it(tok, field, value):
    from types import SimpleNamespace

    assert field in THINKING_FIELDS
    app = SimpleNamespace(llm=SimpleNamespace(model_name="m", tokenizer=tok))
    with pytest.raises(APIError) as e:
        parse_completion(app, json.dumps({"model": "m", "prompt": "hi", field: value}).encode())
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter")
    assert "/v1/chat/completions" in e.value.message


@pytest.mark.parametrize("name,ok", [("bob", True), (None, True), (7, False),
                                     (["x"], False), ({"a": 1}, False), (True, False)])
def test_a_message_name_must_be_a_string(tok, name, ok):
    from types import SimpleNamespace

    app = SimpleNamespace(llm=SimpleNamespace(model_name="m", tokenizer=tok))
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi", "name": name}]
    body = json.dumps({"model": "m", "messages": msgs}).encode()
    if ok:
        _, rendered, _, _ = parse_chat(app, body)
        assert rendered[1].get("name") == name and (name is not None or "name" not in rendered[1])
        return
    with pytest.raises(APIError) as e:
        parse_chat(app, body)
    assert (e.value.status, e.value.param) == (400, "messages[1].name")
    assert "messages[1].name must be a string" in e.value.message
