"""The OpenAI routes' fields from other servers, on the real server and model: each one
implemented changes the answer as it should (vLLM's min_tokens, min_p, guided_* and
structured_outputs, stop_token_ids, continue_final_message; llama.cpp's grammar, json_schema
and its prefill of a final assistant message), every field nobody reads is a 400 naming it,
and the fields that change nothing stay accepted."""

from __future__ import annotations

import json
import re

import pytest
from helpers import openai_client, request

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def chat(server, **fields):
    """``(status, body)`` of a greedy chat with ``fields`` added (null ones left out)."""
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 24, **fields}
    status, _, raw = request(server, "POST", CHAT, {k: v for k, v in body.items()
                                                    if v is not None})
    return status, json.loads(raw)


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


# ---- fields that change the answer ---------------------------------------------------------
def test_min_tokens_holds_back_the_end_until_reached(server):
    status, plain = chat(server, max_tokens=60)
    assert status == 200 and plain["usage"]["completion_tokens"] < 20   # ends on its own
    for path, extra in ((CHAT, {}), ("/v1/completions", {"prompt": "The capital of France is"})):
        body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 60,
                "min_tokens": 40, **extra}
        if extra:
            body.pop("messages")
        status, _, raw = request(server, "POST", path, body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] >= 40


def test_a_complete_grammar_still_ends_the_answer_under_min_tokens(server):
    status, body = chat(server, guided_choice=["yes", "no"], min_tokens=10, max_tokens=20)
    assert status == 200 and content(body) in ("yes", "no")
    assert body["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_above_max_tokens_is_refused(server):
    status, body = chat(server, max_tokens=4, min_tokens=5)
    assert status == 400 and body["error"]["param"] == "min_tokens"


def test_min_p_one_keeps_only_the_most_likely_token(server):
    """min_p = 1 keeps the tokens as likely as the most likely one: sampling at any seed
    gives the greedy answer, which sampling without it does not."""
    greedy = content(chat(server)[1])
    free = {content(chat(server, temperature=1.5, seed=s)[1]) for s in range(4)}
    assert free != {greedy}
    for s in range(4):
        status, body = chat(server, temperature=1.5, seed=s, min_p=1.0)
        assert status == 200 and content(body) == greedy


def test_guided_choice_and_structured_outputs_choice(server):
    choices = ["Paris", "London", "Berlin"]
    for fields in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        status, body = chat(server, **fields)
        assert status == 200 and content(body) in choices, body


def test_guided_regex_matches(server):
    for fields in ({"guided_regex": "[A-Z][a-z]{2,8}!"},
                   {"structured_outputs": {"regex": "[A-Z][a-z]{2,8}!"}}):
        status, body = chat(server, **fields)
        assert status == 200 and re.fullmatch("[A-Z][a-z]{2,8}!", content(body)), body


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.parametrize("fields", [{"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)},
                                    {"json_schema": SCHEMA},
                                    {"structured_outputs": {"json": SCHEMA}}])
def test_json_schema_fields_hold_the_answer_to_the_schema(server, fields):
    status, body = chat(server, max_tokens=60, **fields)
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(content(body)), SCHEMA)


@pytest.mark.parametrize("fields", [
    {"grammar": 'root ::= "yes" | "no"'},                      # llama.cpp's GBNF
    {"guided_grammar": 'root ::= answer\nanswer ::= "yes" | "no"'},
    {"guided_grammar": 'start: "yes" | "no"'},                 # Lark
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}])
def test_grammars_gbnf_or_lark_hold_the_answer(server, fields):
    status, body = chat(server, **fields)
    assert status == 200 and content(body) in ("yes", "no"), body


def test_stop_token_ids_end_the_answer_without_the_token(server, tokenizer):
    text = content(chat(server)[1])
    ids = tokenizer.encode(text, add_bos=False)
    stop = ids[2]
    status, body = chat(server, stop_token_ids=[stop])
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert content(body) == tokenizer.decode(ids[:2])
    status, body = chat(server, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert content(body) == tokenizer.decode(ids[:3])
    assert body["usage"]["completion_tokens"] == 3


def test_a_final_assistant_message_is_continued(server):
    start = "The capital of France is"
    messages = [*QUESTION, {"role": "assistant", "content": start}]
    fresh = content(chat(server)[1])
    assert fresh.startswith(start)
    status, auto = chat(server, messages=messages)                 # llama-server's prefill
    assert status == 200
    assert content(auto) == fresh[len(start):]
    status, cont = chat(server, messages=messages, continue_final_message=True,
                        add_generation_prompt=False)                # vLLM's
    assert status == 200 and content(cont) == content(auto)
    status, new_turn = chat(server, messages=messages, continue_final_message=False)
    assert status == 200 and content(new_turn) != content(auto)     # a new assistant turn


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),     # the last is the user's
    ({"messages": [*QUESTION, {"role": "assistant", "content": "The"}],
      "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message")])
def test_continue_final_message_needs_an_assistant_message_to_continue(server, fields, param):
    status, body = chat(server, **fields)
    assert status == 400 and body["error"]["param"] == param


# ---- fields refused, fields accepted ---------------------------------------------------------
@pytest.mark.parametrize("fields, param, code", [
    ({"max_token": 5}, "max_token", "unknown_parameter"),             # misspelt
    ({"n_predict": 5}, "n_predict", "unknown_parameter"),             # llama.cpp's own name
    ({"mirostat": 2}, "mirostat", "unknown_parameter"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported_parameter"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported_parameter"),
    ({"use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
    ({"echo": True}, "echo", "unsupported_parameter"),
    ({"structured_outputs": {"choice": ["a"], "colour": 1}}, "structured_outputs.colour",
     "unknown_parameter"),
])
def test_fields_nobody_reads_are_refused_naming_them(server, fields, param, code):
    status, body = chat(server, **fields)
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["code"] == code
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"grammar": "root ::= \"a\"\n" + "# x\n" * 20_000}, "grammar"),   # GBNF over 32 K
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ({"min_p": 1.5}, "min_p"),
])
def test_bad_constraint_and_sampling_fields_are_400_naming_them(server, fields, param):
    status, body = chat(server, **fields)
    assert status == 400 and body["error"]["param"] == param, body


def test_completions_refuses_unknown_fields_too(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temprature": 0}
    status, _, raw = request(server, "POST", "/v1/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == "temprature" and err["code"] == "unknown_parameter"


def test_fields_without_effect_are_accepted_through_the_sdk(client):
    base = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    plain = client.chat.completions.create(**base).choices[0].message.content
    r = client.chat.completions.create(
        **base, user="u-1", metadata={"k": "v"}, store=False, service_tier="auto",
        safety_identifier="s-1", prompt_cache_key="k-1",
        prediction={"type": "content", "content": "Paris"},
        extra_body={"request_id": "r-1", "cache_prompt": True, "priority": 0})
    assert r.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**base, metadata="not an object")
    assert err.value.body["param"] == "metadata"


def test_min_tokens_holds_back_stop_strings_too(server):
    status, body = chat(server, stop=[" Paris"])
    assert status == 200 and content(body) == "The capital of France is"
    status, body = chat(server, stop=[" Paris"], min_tokens=12, max_tokens=12)
    assert status == 200 and content(body).startswith("The capital of France is Paris.")
    assert body["usage"]["completion_tokens"] == 12


# ---- the other families: a parameter nothing reads is their 422 naming it --------------------
PROMPT = "My name is Olivier and I"


@pytest.mark.parametrize("path, body, name", [
    ("/infer", {"inputs": PROMPT, "parameters": {"stop": ["."]}}, "Parameter stop"),
    ("/infer", {"inputs": PROMPT, "max_new_tokens": 4}, "Field max_new_tokens"),
    ("/generate", {"inputs": PROMPT, "parameters": {"min_p": 0.1}}, "Parameter min_p"),
    ("/generate_stream", {"inputs": PROMPT, "max_new_tokens": 4}, "Field max_new_tokens"),
    ("/generate", {"prompt": PROMPT, "mirostat": 2}, "Parameter mirostat"),
    ("/generate", {"prompt": PROMPT, "length_penalty": 0.5}, "Parameter length_penalty"),
    (f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "parameters": {"stop": ["."]}},
     "Parameter stop"),
    (f"/v2/models/{MODEL}/generate", {"text_input": PROMPT, "prompt": "x"}, "Field prompt"),
])
def test_other_families_refuse_what_nothing_reads(server, path, body, name):
    status, _, raw = request(server, "POST", path, body)
    err = json.loads(raw)
    assert status == 422 and err["error"] == f"{name} is not supported.", err


def test_other_families_take_null_as_not_set(server):
    status, _, raw = request(server, "POST", "/infer", {
        "inputs": PROMPT, "parameters": {"max_new_tokens": 2, "stop": None}, "extra": None})
    assert status == 200, raw


def test_vllm_generate_min_p_one_is_greedy(server):
    body = {"prompt": PROMPT, "max_tokens": 8}
    greedy = json.loads(request(server, "POST", "/generate", {**body, "temperature": 0})[2])
    for s in range(3):
        got = json.loads(request(server, "POST", "/generate",
                                 {**body, "temperature": 1.5, "seed": s, "min_p": 1.0})[2])
        assert got == greedy
    status, _, raw = request(server, "POST", "/generate", {**body, "min_tokens": 9})
    assert status == 422 and "min_tokens" in json.loads(raw)["error"]


def test_every_field_the_openai_sdk_can_send_is_read_accepted_or_refused():
    """The installed ``openai`` package's create parameters, each placed deliberately: read,
    accepted without effect, or refused by name (a new SDK field fails here until placed)."""
    import typing

    from openai.types import completion_create_params as completion
    from openai.types.chat import completion_create_params as chat_params

    from tiny_mindie.api.openai import fields as f
    from tiny_mindie.api.openai.request import CHAT_ONLY

    placed = set(f.NO_EFFECT) | set(f.UNSUPPORTED)
    sent = set(typing.get_type_hints(chat_params.CompletionCreateParamsBase)) | {"stream"}
    assert sent - (f.CHAT | placed) == set()
    sent = set(typing.get_type_hints(completion.CompletionCreateParamsBase)) | {"stream"}
    assert sent - (f.COMPLETION | placed | set(CHAT_ONLY)) == set()
