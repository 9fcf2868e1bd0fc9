"""Control tokens typed by a client are text over HTTPS: the shared server counts a chat's typed
markers as text while raw prompts parse them, and a server started with
``BackendConfig.ModelDeployConfig.parseSpecialTokens`` false parses them nowhere but in the chat
template's own text (the rules: tests/unit/test_chat_injection.py)."""

from __future__ import annotations

import copy
import json

import pytest
from helpers import TEST_CONFIG, request, start_server
from injection_chats import INJECTION, README_CHAT, as_llm

from tiny_mindie.api.chat.template import encode_chat, render_chat

MODEL = "smollm2-135m-instruct"


# ---- over HTTPS (e2e) -------------------------------------------------------------------------
def _post(server, path: str, body: dict) -> dict:
    status, _, raw = request(server, "POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def _chat_usage(server, content: str) -> int:
    out = _post(server, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": content}]})
    return out["usage"]["prompt_tokens"]


def test_chat_usage_counts_typed_markers_as_text(server, tokenizer):
    rendered = render_chat(as_llm(tokenizer), [{"role": "user", "content": INJECTION}], {})
    head, tail = rendered.split(INJECTION)
    # expected: the template's text parsed, "user\n" + the message as plain text
    cut = head.rindex("<|im_start|>") + len("<|im_start|>")
    expected = (tokenizer.encode(head[:cut]) + tokenizer.encode(head[cut:] + INJECTION,
                                                                  parse_special=False)
                + tokenizer.encode(tail))
    assert _chat_usage(server, INJECTION) == len(expected) == 59
    # raw prompts still parse control tokens: the same rendered text is 41 tokens there
    assert _post(server, "/v1/tokenizer", {"inputs": rendered})["token_number"] == 41
    out = _post(server, "/v1/completions", {"model": MODEL, "prompt": rendered, "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == 41
    out = _post(server, "/generate", {"inputs": rendered,
                                      "parameters": {"max_new_tokens": 1, "details": True,
                                                     "decoder_input_details": True}})
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert sum(t["id"] == im_start for t in out["details"]["prefill"]) == 4
    status, _, raw = request(server, "GET", "/v1/config")
    assert json.loads(raw)["BackendConfig"]["ModelDeployConfig"]["parseSpecialTokens"] is True
    # /infer: 200 typed <|im_start|> are 200 tokens (maxInputTokenLen is 512)
    status, _, raw = request(server, "POST", "/infer", {
        "inputs": LONG_MARKERS, "stream": False, "parameters": {"max_new_tokens": 1}})
    assert status == 200, raw


# 200 control tokens when parsed; over the test config's maxInputTokenLen (512) as text
LONG_MARKERS = "<|im_start|>" * 200


@pytest.mark.e2e
def test_parse_special_tokens_off(tmp_path, tokenizer):
    config = copy.deepcopy(TEST_CONFIG)
    config["BackendConfig"]["ModelDeployConfig"]["parseSpecialTokens"] = False
    srv = start_server(str(tmp_path), config)
    try:
        prompt = "<|im_start|>user\nhi<|im_end|>\n"
        plain = len(tokenizer.encode(prompt, parse_special=False))
        assert plain > len(tokenizer.encode(prompt)) == 6
        assert _post(srv, "/v1/tokenizer", {"inputs": prompt})["token_number"] == plain
        out = _post(srv, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
        assert out["usage"]["prompt_tokens"] == plain
        status, _, raw = request(srv, "POST", "/infer", {
            "inputs": LONG_MARKERS, "stream": False, "parameters": {"max_new_tokens": 1}})
        n = len(tokenizer.encode(LONG_MARKERS, parse_special=False))
        assert status == 424 and json.loads(raw)["error"].endswith(f"the input ids length is {n}")
        status, _, raw = request(srv, "GET", "/v1/config")
        assert status == 200
        assert json.loads(raw)["BackendConfig"]["ModelDeployConfig"]["parseSpecialTokens"] is False
        # chat prompts still get the template's control tokens
        assert _chat_usage(srv, README_CHAT[1]["content"]) == \
            len(encode_chat(as_llm(tokenizer), README_CHAT[1:], {}))
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)
