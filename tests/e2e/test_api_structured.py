"""Structured outputs and logit_bias over the real server (mutual TLS, the default model),
driven by the official ``openai`` package; TGI's ``grammar`` is in tests/e2e/test_api_tgi.py."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import openai_client, request

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2-135m-instruct"
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "country": {"type": "string", "maxLength": 20},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 50}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
PLACES = ["France", "Japan", "Brazil", "Kenya", "Canada", "Italy", "India", "Peru"]


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


QUESTIONS = ["What is the capital of {}?", "Tell me about the biggest city of {}.",
             "Name a famous city in {}.", "Where would you travel in {}?",
             "Which city in {} has the most people?", "Describe a port city of {}.",
             "{}: pick a city and describe it as JSON."]


def test_json_schema_answers_validate(client):
    """The issue's evidence: 50 varied chats, greedy and sampled, sent at once (the server
    batches them), all answers validate; streaming gives the same text; the SDK's ``parse``."""
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY,
                                                  "strict": True}}

    def ask(i: int):
        return client.chat.completions.create(
            model=MODEL, response_format=fmt, max_tokens=80, seed=i,
            temperature=0 if i % 2 else 0.8, messages=[{"role": "user", "content": QUESTIONS[
                i % len(QUESTIONS)].format(PLACES[i % len(PLACES)])}])

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    for r in answers:
        (choice,) = r.choices
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), CITY)
    assert len({r.choices[0].message.content for r in answers}) > 20
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The capital of France?"}],
        response_format=fmt, max_tokens=80, temperature=0, logprobs=True)
    content = first.choices[0].message.content
    assert "".join(t.token for t in first.choices[0].logprobs.content) == content  # to the "}"
    assert first.usage.completion_tokens == len(first.choices[0].logprobs.content) + 1  # + EOS
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The capital of France?"}],
        response_format=fmt, max_tokens=80, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    # the SDK's own structured-output helper (a pydantic model -> strict json_schema)
    from pydantic import BaseModel

    class Capital(BaseModel):
        city: str
        country: str

    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "The capital of Japan?"}],
        response_format=Capital, max_tokens=60, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Capital)


def test_json_object_and_length_on_completions(client):
    r = client.completions.create(model=MODEL, prompt=["A JSON object about a cat:"] * 2,
                                  max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and c.text.startswith("{")
    cut = client.completions.create(model=MODEL, prompt="A JSON object about a cat:",
                                    max_tokens=2, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 2


def test_logit_bias_bans_and_forces_tokens(client, tokenizer):
    """The issue's case: ``{"7042": -100}`` (" Paris") must change the answer."""
    paris = tokenizer.encode(" Paris", add_bos=False)
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert client.completions.create(**kw).choices[0].text.startswith(" Paris")
    banned = client.completions.create(**kw, logit_bias={str(paris[0]): -100})
    assert not banned.choices[0].text.startswith(" Paris")
    (banana,) = tokenizer.encode(" banana", add_bos=False)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0.5,
        seed=1, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana" * 3


BAD = [
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x y", "schema": {}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}}, "response_format"),
    ({"logit_bias": {"abc": 999}}, "logit_bias"),
    ({"logit_bias": {"1": 999}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
]


def test_malformed_fields_are_400_naming_them(client, server):
    for extra, param in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2, extra_body=extra)
        assert e.value.status_code == 400 and e.value.body["param"] == param, extra
        status, _, raw = request(server, "POST", "/v1/completions",
                                 {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == param and err["type"], (extra, err)
    with pytest.raises(openai.BadRequestError, match="Unimplemented keys"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format=BAD[4][0]["response_format"])


def test_json_object_schema_all_of_strict_and_unknown_keys(client, server):
    """llama.cpp's ``{"type": "json_object", "schema": ...}`` (what instructor's JSON_SCHEMA
    mode sends) holds the answer to the schema; ``allOf`` under ``strict`` is satisfiable;
    a key nobody reads is 400 naming it."""
    item = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "price": {"type": "number"}},
            "required": ["name", "price"], "additionalProperties": False}
    ask = [{"role": "user", "content": "Name a fruit and its price."}]
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0,
        response_format={"type": "json_object", "schema": item})
    jsonschema.validate(json.loads(r.choices[0].message.content), item)
    parts = {"type": "object", "allOf": [
        {"properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]},
        {"properties": {"price": {"type": "number"}}, "required": ["price"]}]}
    r = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=60, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "item", "schema": parts,
                                                   "strict": True}})
    assert set(json.loads(r.choices[0].message.content)) == {"name", "price"}
    for fmt, key in (({"type": "json_object", "bogus": 1}, "bogus"),
                     ({"type": "text", "schema": item}, "schema"),
                     ({"type": "json_schema", "schema": item,
                       "json_schema": {"name": "item", "schema": item}}, "schema")):
        status, _, raw = request(server, "POST", "/v1/chat/completions", {
            "model": MODEL, "messages": ask, "max_tokens": 2, "response_format": fmt})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == f"response_format.{key}", raw
        assert err["code"] == "unknown_parameter"


def _closed(schema):
    """``schema`` with ``additionalProperties: false`` on each object listing ``properties``
    that says nothing of others: what a non-strict answer must now validate against."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


USER = {"type": "object", "title": "User", "properties": {
    "name": {"title": "Name", "type": "string"}, "age": {"title": "Age", "type": "integer"}},
    "required": ["name", "age"]}
ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "price"]}
PERSON = {"type": "object", "$defs": {"Addr": {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city"]}},
    "properties": {"person": {"type": "string"}, "address": {"$ref": "#/$defs/Addr"}},
    "required": ["person", "address"]}
EXTRACTIONS = [("Extract the user: John is 30 years old.", USER),
               ("Extract: Maria, aged 41, lives in Rome.", USER),
               ("Name a fruit and its price.", ITEM), ("Describe a product you could buy.", ITEM),
               ("Where does Alice live? She lives at 5 Main St, Boston.", PERSON),
               ("Give a person and their address.", PERSON)]


def test_non_strict_schemas_hold_to_the_listed_members(client):
    """What instructor's JSON_SCHEMA mode (``json_object`` + ``schema``) and a ``json_schema``
    without ``strict`` send, pydantic's schemas with no ``additionalProperties``: the answers
    add no members of their own, so they end before ``max_tokens``."""
    def ask(job):
        i, fmt = job
        question, schema = EXTRACTIONS[i]
        rf = ({"type": "json_object", "schema": schema} if fmt == "json_object" else
              {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], response_format=rf,
            max_tokens=160, seed=i, temperature=0 if i % 2 else 0.8)
        return schema, r.choices[0]

    jobs = [(i, fmt) for fmt in ("json_object", "json_schema") for i in range(len(EXTRACTIONS))]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, jobs))
    ended = 0
    for schema, choice in answers:
        if choice.finish_reason == "length":    # a small model may repeat an array's items
            assert _member_names(choice.message.content) <= _property_names(schema), \
                choice.message.content
            continue
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), _closed(schema))
        ended += 1
    assert ended >= len(answers) - 2, [c.finish_reason for _, c in answers]


def _property_names(schema) -> set[str]:
    """Every member name a schema lists, at any depth (its ``$defs`` included)."""
    if isinstance(schema, list):
        return set().union(*map(_property_names, schema))
    if not isinstance(schema, dict):
        return set()
    names = set(schema.get("properties", {}))
    return names.union(*map(_property_names, schema.values()))


def _member_names(text: str) -> set[str]:
    """The member names of a JSON text, complete or cut off: each string followed by ``:``."""
    names, i, n = set(), 0, len(text)
    while i < n:
        if text[i] != '"':
            i += 1
            continue
        j = i + 1
        while j < n and text[j] != '"':
            j += 2 if text[j] == "\\" else 1
        k = j + 1
        while k < n and text[k] in " \t\r\n":
            k += 1
        if k < n and text[k] == ":":
            names.add(json.loads(text[i:j + 1]))
        i = j + 1
    return names


def test_strict_all_of_with_ref_parts_is_accepted(client):
    """``allOf`` naming a definition by ``$ref`` (pydantic's inheritance, hand-written
    mixins) under ``strict``: satisfiable, and held to every part's members together."""
    named = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
             "required": ["name"]}
    schemas = [
        {"$defs": {"Named": {**named, "additionalProperties": False}},
         "allOf": [{"$ref": "#/$defs/Named"}]},
        {"$defs": {"Named": named}, "type": "object", "allOf": [{"$ref": "#/$defs/Named"}],
         "properties": {"price": {"type": "number"}}, "required": ["price"]},
        {"$defs": {"Named": named, "Priced": {"type": "object", "properties": {
            "price": {"type": "number"}}, "required": ["price"]}},
         "allOf": [{"$ref": "#/$defs/Named"}, {"$ref": "#/$defs/Priced"}]}]
    for schema in schemas:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a fruit and its price."}],
            max_tokens=60, temperature=0, response_format={"type": "json_schema", "json_schema": {
                "name": "item", "schema": schema, "strict": True}})
        (choice,) = r.choices
        answer = json.loads(choice.message.content)
        jsonschema.validate(answer, schema)
        assert choice.finish_reason == "stop"
        assert set(answer) == {"name"} | ({"price"} if "price" in json.dumps(schema) else set())


def test_fields_a_route_cannot_honour_are_400_naming_them(server):
    """Reasoning on ``/v1/completions`` (a raw prompt: no template to think with) and a
    message ``name`` that is no string."""
    for field, value in (("enable_thinking", True), ("reasoning_effort", "low")):
        status, _, raw = request(server, "POST", "/v1/completions", {
            "model": MODEL, "prompt": "x", "max_tokens": 2, field: value})
        err = json.loads(raw)["error"]
        assert (status, err["param"], err["code"]) == (400, field, "unsupported_parameter"), raw
    status, _, raw = request(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi", "name": 7}]})
    err = json.loads(raw)["error"]
    assert (status, err["param"]) == (400, "messages[0].name") and "string" in err["message"]
    status, _, raw = request(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert status == 200, raw
