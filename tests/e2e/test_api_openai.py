"""The OpenAI family against the real server and model, driven by the official ``openai``
package."""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers import openai_client, request, sse_events
from hf_math import MIN_MARGIN

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
# SmolLM2-135M is tiny: asked "What is the capital of France?" alone, its first greedy token
# leads by 0.05-0.1 nats ("The" vs "La"), and another CPU or the float reference answers
# otherwise. Asked for one word, every token of "The capital of France is Paris." leads by
# 0.8 nats or more on the int8 graph, with either MLAS kernel, and on the float reference.
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def test_chat_plain_is_on_topic(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=24)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    # not borderline: each greedy token leads the runner-up by MIN_MARGIN nats or more
    lp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                        max_tokens=24, logprobs=True, top_logprobs=2)
    for t in lp.choices[0].logprobs.content:
        assert t.top_logprobs[0].logprob - t.top_logprobs[1].logprob > MIN_MARGIN, t
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_matches_plain_with_usage(client):
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=24)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    # the same prompt again: its KV comes from the prefix cache, all but the last 2 tokens
    usage, prompt = chunks[-1].usage, plain.usage.prompt_tokens
    assert chunks[-1].choices == [] and usage.prompt_tokens == prompt
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == prompt - 2
    assert plain.usage.prompt_tokens_details.cached_tokens in (0, prompt - 2)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n2_seeded_and_stop(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
              temperature=1.0, seed=11, max_tokens=12)
    r = client.chat.completions.create(n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 24
    # choice j is the single request seeded seed + j
    one = client.chat.completions.create(**{**kw, "seed": 12})
    assert r.choices[1].message.content == one.choices[0].message.content
    # streamed n=2: both choices arrive, each with its own finish
    chunks = list(client.chat.completions.create(n=2, stream=True, **kw))
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in r.choices]
    # stop: a string that the greedy answer contains ends it there
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                          max_tokens=24).choices[0].message.content
    cut = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                         max_tokens=24, stop=["Paris", "zzz"])
    assert cut.choices[0].message.content == full[:full.index("Paris")]
    assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs_and_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                       max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 8
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content[:5])
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert math.isclose(t.top_logprobs[0].logprob, t.logprob, abs_tol=1e-4)
    assert sum(math.exp(a.logprob) for a in content[0].top_logprobs) <= 1.0 + 1e-4
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                           max_tokens=4, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_completions_plain_stream_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                  temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.text and c.finish_reason in ("stop", "length")
    assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) >= 2 for t in c.logprobs.top_logprobs)
    streamed = list(client.completions.create(model=MODEL, prompt="The capital of France is",
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(s.choices[0].text for s in streamed) == c.text
    assert streamed[-1].choices[0].finish_reason == c.finish_reason
    # default max_tokens is 16; a list of prompts gives one choice per prompt
    two = client.completions.create(model=MODEL, prompt=["Hello", "One, two,"], temperature=0)
    assert [ch.index for ch in two.choices] == [0, 1]
    assert all(ch.finish_reason == "stop" or ch.finish_reason == "length" for ch in two.choices)
    assert two.usage.completion_tokens <= 32
    echo = client.completions.create(model=MODEL, prompt="One, two,", temperature=0, echo=True,
                                     max_tokens=4)
    assert echo.choices[0].text.startswith("One, two,")


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "MindIE Server" and models.data[0].object == "model"
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.owned_by == "MindIE Server"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_the_model_card_gives_the_context_and_llama_servers_meta(server, model_path):
    """``max_model_len`` is the context a request has (vLLM's field: maxSeqLen, 1024 here);
    ``meta`` is llama-server's, each figure equal to what gguf-py reads from the file."""
    from gguf import GGUFReader

    reader = GGUFReader(model_path)
    field = lambda key: reader.fields[key].contents()       # noqa: E731
    want = {"vocab_type": 2,                        # SmolLM2: gpt2, llama.cpp's BPE
            "n_vocab": len(field("tokenizer.ggml.tokens")),
            "n_ctx_train": field("llama.context_length"),
            "n_embd": field("llama.embedding_length"),
            "n_params": sum(int(t.n_elements) for t in reader.tensors),
            "size": sum(int(t.n_bytes) for t in reader.tensors)}
    status, _, body = request(server, "GET", "/v1/config")
    max_seq_len = json.loads(body)["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"]
    assert status == 200 and max_seq_len == 1024
    status, _, listed = request(server, "GET", "/v1/models")
    assert status == 200
    status, _, one = request(server, "GET", f"/v1/models/{MODEL}")
    assert status == 200
    for card in (json.loads(listed)["data"][0], json.loads(one)):
        assert card["max_model_len"] == max_seq_len
        assert card["meta"] == want, card["meta"]
    assert want["n_vocab"] == 49152 and want["n_embd"] == 576 and want["n_ctx_train"] == 8192
    assert 100e6 < want["n_params"] < 200e6 and want["size"] < os.path.getsize(model_path)


def test_bad_model_and_ranges_are_errors_in_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=QUESTION, max_tokens=2)
    assert exc.value.body["code"] == "model_not_found"
    for bad in ({"temperature": -0.1}, {"top_p": 0}, {"top_p": 1.5}, {"presence_penalty": 2.5},
                {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": 2.5},
                {"n": 0}, {"max_tokens": 0}, {"top_logprobs": 30, "logprobs": True},
                {"stop": 5}, {"seed": -1}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL, messages=QUESTION,
                                           **{k: v for k, v in bad.items()
                                              if k in ("temperature", "top_p", "presence_penalty",
                                                       "frequency_penalty", "n", "max_tokens",
                                                       "top_logprobs", "logprobs", "stop", "seed")},
                                           extra_body={k: v for k, v in bad.items()
                                                       if k == "repetition_penalty"})
        assert exc.value.status_code == 400
        assert set(exc.value.body) == {"message", "type", "param", "code"}
        assert exc.value.body["type"] == "invalid_request_error"
        assert exc.value.body["param"] == next(iter(bad))
    # the same shape straight off the wire, and 422 for a body that is not JSON
    status, headers, body = request(server, "POST", "/v1/chat/completions", b"{nope")
    assert status == 422 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    status, _, body = request(server, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "x", "temperature": "hot"})
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
    status, _, body = request(server, "POST", "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and json.loads(body)["error"]["param"] == "messages"


def test_wire_format_stream_ends_with_done_and_extra_fields(server):
    """Raw SSE: ``data: {chunk}`` events, then ``data: [DONE]``; MindIE's extra fields work."""
    status, headers, body = request(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 5, "top_k": 5,
        "temperature": 0.7, "repetition_penalty": 1.1, "ignore_eos": True, "seed": 3,
        "stop_token_ids": [2], "include_stop_str_in_output": False, "skip_special_tokens": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    raw = body.decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = sse_events(raw[:-len("data: [DONE]\n\n")].encode())
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_chat_template_sandbox_bos_and_raise_exception():
    """Rendering as Hugging Face does: bos/eos tokens, raise_exception, tojson, the sandbox."""
    from types import SimpleNamespace

    from tiny_mindie.api.chat.template import render_chat
    from tiny_mindie.api.errors import APIError

    def fake_llm(template: str, add_bos: bool):
        texts = {1: "<s>", 2: "</s>"}
        return SimpleNamespace(tokenizer=SimpleNamespace(
            chat_template=template, bos_id=1, eos_id=2, add_bos=add_bos,
            token_text=texts.__getitem__))

    tpl = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
           "{{ raise_exception('System role not supported') }}{% endif %}"
           "[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}{% endfor %}"
           "{% if add_generation_prompt %}[assistant]{% endif %}")
    msgs = [{"role": "user", "content": "héllo"}]
    # the tokenizer adds BOS itself: the template's is dropped, so there is only one
    assert render_chat(fake_llm(tpl, add_bos=True), msgs, {}) == '[user] "héllo"</s>[assistant]'
    assert render_chat(fake_llm(tpl, add_bos=False), msgs, {}) == \
        '<s>[user] "héllo"</s>[assistant]'
    with pytest.raises(APIError) as exc:
        render_chat(fake_llm(tpl, add_bos=True), [{"role": "system", "content": "x"}], {})
    assert exc.value.status == 400 and "System role not supported" in exc.value.message
    with pytest.raises(APIError):   # the sandbox refuses attribute games
        render_chat(fake_llm("{{ messages.__class__.__mro__ }}", add_bos=True), msgs, {})


def test_client_leaving_a_stream_with_n2_frees_both_slots(server):
    import http.client
    import time

    def free_slots():
        _, _, body = request(server, "GET", f"/v2/models/{MODEL}/getSlotCount")
        return json.loads(body)

    total = free_slots()["total_slots"]
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=server.ssl_context(),
                                       timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": MODEL, "messages": QUESTION, "stream": True, "n": 2, "max_tokens": 200,
        "ignore_eos": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 10
    while free_slots()["free_slots"] != total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert free_slots()["free_slots"] == total


def test_chat_messages_need_a_known_role_and_content(server):
    for bad_msg in ({"role": "bogus", "content": "hi"}, {"role": "user"}):
        status, _, raw = request(server, "POST", "/v1/chat/completions",
                                 {"model": "smollm2-135m-instruct", "messages": [bad_msg],
                                  "max_tokens": 2})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "messages", raw


def test_thinking_fields_and_unanswered_tool_results_are_400(server):
    """SmolLM2 does not think: a field asking it to is 400 naming it (OpenAI's answer to
    ``reasoning_effort`` for a model that does not reason); ``enable_thinking: false`` asks
    for what it does. A tool result answering no earlier call is 400, as OpenAI."""
    user = {"role": "user", "content": "hi"}
    for extra, param in (({"reasoning_effort": "low"}, "reasoning_effort"),
                         ({"reasoning": {"effort": "low"}}, "reasoning"),
                         ({"chat_template_kwargs": {"enable_thinking": True}},
                          "chat_template_kwargs.enable_thinking"),
                         ({"messages": [user, {"role": "tool", "tool_call_id": "call_9",
                                               "content": "x"}]}, "messages")):
        status, _, raw = request(server, "POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [user], "max_tokens": 2, **extra})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == param, raw
    status, _, raw = request(server, "POST", "/v1/chat/completions", {
        "model": MODEL, "messages": [user], "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, raw
