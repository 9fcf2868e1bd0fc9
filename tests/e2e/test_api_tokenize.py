"""``POST /tokenize`` and ``POST /detokenize`` in llama-server's and vLLM's shapes, against the
real server and model: round trips, the model's own tokenizer, the chat's prompt, bad bodies."""

from __future__ import annotations

import json

import pytest
from helpers import openai_client, request

MODEL = "smollm2-135m-instruct"
TEXT = "Hello world, ünïcödé and <|im_start|> too"


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = request(server, "POST", path, body)
    return status, json.loads(raw)


def test_llama_server_shape_round_trip(server, tokenizer):
    status, got = post(server, "/tokenize", {"content": TEXT})
    assert status == 200 and set(got) == {"tokens"}
    assert got["tokens"] == tokenizer.encode(TEXT, add_bos=False)
    status, back = post(server, "/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["content"] == TEXT


def test_llama_server_pieces_and_options(server, tokenizer):
    _, got = post(server, "/tokenize", {"content": TEXT, "with_pieces": True})
    pieces = got["tokens"]
    assert [p["id"] for p in pieces] == tokenizer.encode(TEXT, add_bos=False)
    # a piece that is no UTF-8 text on its own (half of a character) comes as its bytes
    assert any(isinstance(p["piece"], list) for p in pieces)
    assert b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                    for p in pieces).decode() == TEXT
    _, parsed = post(server, "/tokenize", {"content": "<|im_start|>"})
    _, plain = post(server, "/tokenize", {"content": "<|im_start|>", "parse_special": False})
    assert len(parsed["tokens"]) == 1 and len(plain["tokens"]) > 1
    _, special = post(server, "/tokenize", {"content": "Hi", "add_special": True})
    assert special["tokens"] == tokenizer.encode("Hi")     # BOS by the model's own rule


def test_vllm_prompt_shape_round_trip(server, tokenizer):
    status, got = post(server, "/tokenize", {"model": MODEL, "prompt": TEXT,
                                             "return_token_strs": True})
    assert status == 200 and set(got) == {"count", "max_model_len", "tokens", "token_strs"}
    assert got["tokens"] == tokenizer.encode(TEXT) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 1024 and len(got["token_strs"]) == got["count"]
    _, bare = post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode(TEXT, add_bos=False) and bare["token_strs"] is None
    status, back = post(server, "/detokenize", {"model": MODEL, "tokens": bare["tokens"]})
    assert status == 200 and back["prompt"] == TEXT


def test_vllm_messages_are_the_chats_prompt(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, got = post(server, "/tokenize", {"model": MODEL, "messages": messages})
    with openai_client(server) as client:
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert status == 200 and got["count"] == chat.usage.prompt_tokens == len(got["tokens"])
    _, text = post(server, "/detokenize", {"tokens": got["tokens"]})
    assert "Be brief." in text["content"] and "<|im_start|>" in text["content"]
    _, bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert got["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < got["count"]


@pytest.mark.parametrize("path, body, param, status", [
    ("/tokenize", {"content": "x", "add_special_tokens": True}, "add_special_tokens", 400),
    ("/tokenize", {"prompt": "x", "with_pieces": True}, "with_pieces", 400),
    ("/tokenize", {"content": 3}, "content", 400),
    ("/tokenize", {"text": "x"}, "content", 400),
    ("/tokenize", {"model": "other", "prompt": "x"}, "model", 404),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "add_special_tokens": True}, "add_special_tokens", 400),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", 400),
    ("/detokenize", {"tokens": [10**9]}, "tokens", 400),
    ("/detokenize", {"tokens": "abc"}, "tokens", 400),
    ("/detokenize", {"tokens": [1], "skip": True}, "skip", 400),
])
def test_bad_bodies_are_answered_naming_the_field(server, path, body, param, status):
    got_status, got = post(server, path, body)
    assert got_status == status and got["error"]["param"] == param, got
    assert got["error"]["type"] == "invalid_request_error"
