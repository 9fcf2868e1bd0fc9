"""The TGI family (and vLLM 0.2's /generate) end to end: the real server, model and mutual TLS,
driven by the clients TGI users run -- Hugging Face's ``text-generation`` package and
``huggingface_hub``'s ``InferenceClient`` -- and by hand-made requests for the wire details.

TLS: neither client has a certificate option of its own. ``huggingface_hub`` documents
``configure_http_backend`` for exactly this (a ``requests.Session`` factory: ``verify``/``cert``).
``text_generation.Client`` calls the module-level ``requests.post``; the test routes that one name
through a ``requests.Session`` carrying the CA and the client certificate, everything else in the
client (request building, pydantic validation, SSE parsing, error mapping) runs unchanged.
"""

from __future__ import annotations

import json
import math
import re
import types

import pytest
import requests
from helpers import request, sse_events

PROMPT = "The capital of France is"

# text-generation 0.7 calls pydantic's deprecated .dict(); not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")


def tls_session(server) -> requests.Session:
    s = requests.Session()
    s.trust_env = False    # else REQUESTS_CA_BUNDLE from the environment overrides ``verify``
    s.verify = server.ca
    s.cert = (server.client_cert, server.client_key)
    return s


@pytest.fixture
def tgi_client(server, monkeypatch):
    import text_generation
    import text_generation.client as tg_client

    session = tls_session(server)
    shim = types.SimpleNamespace(post=session.post)   # what Client calls: requests.post(...)
    monkeypatch.setattr(tg_client, "requests", shim)
    yield text_generation.Client(server.url, timeout=60)
    session.close()


@pytest.fixture
def hf_client(server):
    from huggingface_hub import InferenceClient, configure_http_backend

    configure_http_backend(backend_factory=lambda: tls_session(server))
    yield InferenceClient(base_url=server.url, timeout=60)
    configure_http_backend()   # back to huggingface_hub's default sessions


def finite_logprob(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x <= 0.0


# ---- text-generation (Hugging Face's TGI client) ----------------------------------------------

def test_text_generation_client_generate_with_details(tgi_client, tokenizer):
    r = tgi_client.generate(PROMPT, max_new_tokens=12, decoder_input_details=True,
                            stop_sequences=["."])
    d = r.details
    assert "Paris" in r.generated_text and r.generated_text.endswith(".")   # TGI keeps the stop
    assert d.finish_reason.value == "stop_sequence"
    assert d.generated_tokens == len(d.tokens) <= 12
    assert "".join(t.text for t in d.tokens) == r.generated_text
    assert all(finite_logprob(t.logprob) and not t.special for t in d.tokens)
    assert [t.id for t in d.prefill] == tokenizer.encode(PROMPT)
    assert "".join(t.text for t in d.prefill) == PROMPT
    assert all(t.logprob is None for t in d.prefill)   # prompt logprobs are not computed
    assert isinstance(d.seed, int)


def test_text_generation_client_stream(tgi_client):
    events = list(tgi_client.generate_stream(PROMPT, max_new_tokens=10, do_sample=True,
                                             temperature=0.7, seed=42))
    last = events[-1]
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    assert last.details.seed == 42 and last.details.generated_tokens == len(events)
    text = "".join(e.token.text for e in events if not e.token.special)
    assert text == last.generated_text
    assert all(finite_logprob(e.token.logprob) for e in events)
    # same seed and parameters without streaming: same text
    plain = tgi_client.generate(PROMPT, max_new_tokens=10, do_sample=True, temperature=0.7, seed=42)
    assert plain.generated_text == last.generated_text


def test_text_generation_client_top_n_tokens(tgi_client):
    """TGI >= 1.1's top_n_tokens: the most likely tokens of each step's distribution, in the
    details and in every stream event; greedy, the chosen token is the first of them."""
    r = tgi_client.generate(PROMPT, max_new_tokens=4, top_n_tokens=3)
    tops = r.details.top_tokens
    assert len(tops) == len(r.details.tokens) == 4
    for tok, top in zip(r.details.tokens, tops, strict=True):
        assert len(top) == 3 and top[0].id == tok.id
        assert top[0].logprob == pytest.approx(tok.logprob, abs=1e-5)
        lps = [t.logprob for t in top]
        assert lps == sorted(lps, reverse=True) and lps[-1] < lps[0] <= 0.0
        assert len({t.id for t in top}) == 3
    events = list(tgi_client.generate_stream(PROMPT, max_new_tokens=4, top_n_tokens=2,
                                             do_sample=True, top_k=5, seed=3))
    for e in events:
        assert len(e.top_tokens) == 2
        assert e.top_tokens[0].logprob >= e.top_tokens[1].logprob
        assert e.token.logprob <= e.top_tokens[0].logprob + 1e-6
    plain = tgi_client.generate(PROMPT, max_new_tokens=4)
    assert plain.details.top_tokens is None                # only when asked


def test_text_generation_client_validation_error(tgi_client):
    from text_generation.errors import ValidationError
    with pytest.raises(ValidationError, match="truncate"):
        tgi_client.generate(PROMPT, max_new_tokens=2, truncate=10**6)


# ---- huggingface_hub.InferenceClient --------------------------------------------------------

def test_inference_client_plain(hf_client):
    text = hf_client.text_generation(PROMPT, max_new_tokens=8)
    assert isinstance(text, str) and "Paris" in text


def test_inference_client_details(hf_client, tokenizer):
    out = hf_client.text_generation(PROMPT, max_new_tokens=6, details=True,
                                    decoder_input_details=True, return_full_text=True)
    assert out.generated_text.startswith(PROMPT)
    d = out.details
    assert d.finish_reason in ("length", "eos_token") and d.generated_tokens == len(d.tokens)
    assert PROMPT + "".join(t.text for t in d.tokens if not t.special) == out.generated_text
    assert [t.id for t in d.prefill] == tokenizer.encode(PROMPT)
    assert all(finite_logprob(t.logprob) for t in d.tokens)


def test_inference_client_stream_with_details(hf_client):
    events = list(hf_client.text_generation(PROMPT, max_new_tokens=8, details=True, stream=True))
    last = events[-1]
    assert last.details is not None and last.details.generated_tokens == len(events)
    assert "".join(e.token.text for e in events if not e.token.special) == last.generated_text
    assert all(finite_logprob(e.token.logprob) for e in events)
    tokens = list(hf_client.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(tokens) == last.generated_text   # greedy both times


def test_inference_client_validation_error(hf_client):
    from huggingface_hub.errors import ValidationError
    with pytest.raises(ValidationError, match="typical_p"):
        hf_client.text_generation(PROMPT, max_new_tokens=2, typical_p=1.0)   # TGI: (0, 1)


# ---- the wire, by hand ----------------------------------------------------------------------

def test_root_route_answers_a_one_element_array_or_a_stream(server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    status, headers, raw = request(server, "POST", "/", body)
    assert status == 200 and headers["content-type"].startswith("application/json")
    ans = json.loads(raw)
    assert isinstance(ans, list) and len(ans) == 1 and set(ans[0]) == {"generated_text"}
    status, headers, raw = request(server, "POST", "/", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert all(set(e) == {"token", "generated_text", "details"} for e in events)
    assert all(set(e["token"]) == {"id", "text", "logprob", "special"} for e in events)
    assert (events[-1]["details"] is None
            and events[-1]["generated_text"] == ans[0]["generated_text"])


def test_generate_stream_last_event_carries_text_and_details(server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 5, "details": True}}
    events = sse_events(request(server, "POST", "/generate_stream", body)[2])
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
    d = events[-1]["details"]
    assert set(d) == {"finish_reason", "generated_tokens", "seed", "prompt_tokens"}
    assert d["generated_tokens"] == len(events) and d["prompt_tokens"] == 5


def test_truncate_keeps_the_last_prompt_tokens(server, tokenizer):
    text = "one two three four five six seven eight nine ten"
    body = {"inputs": text, "parameters": {"max_new_tokens": 1, "truncate": 3, "details": True,
                                           "decoder_input_details": True}}
    ans = json.loads(request(server, "POST", "/generate", body)[2])
    assert ans["details"]["prompt_tokens"] == 3
    assert [t["id"] for t in ans["details"]["prefill"]] == tokenizer.encode(text)[-3:]


@pytest.mark.parametrize("params, word", [
    ({"top_p": 1.0}, "top_p"), ({"temperature": 0}, "temperature"), ({"top_k": 0}, "top_k"),
    ({"best_of": 2, "do_sample": True}, "best_of"), ({"top_n_tokens": 6}, "top_n_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"max_new_tokens": 2.5}, "max_new_tokens"),
])
def test_tgi_ranges_are_enforced(server, params, word):
    status, _, raw = request(server, "POST", "/generate", {"inputs": PROMPT, "parameters": params})
    assert status == 422
    err = json.loads(raw)
    assert err["error_type"] == "validation" and word in err["error"]


def test_decoder_input_details_cannot_stream(server):
    body = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    status, _, raw = request(server, "POST", "/generate_stream", body)
    assert status == 422 and "decoder_input_details" in json.loads(raw)["error"]


def test_info(server):
    status, _, raw = request(server, "GET", "/info")
    assert status == 200
    info = json.loads(raw)
    assert info["model_id"] == "smollm2-135m-instruct"
    assert info["max_input_length"] == 512 and info["max_total_tokens"] == 1024
    assert info["model_dtype"] == "Q4_1" and info["model_device_type"] == "cpu"
    import os

    from tiny_mindie.model.backend import DEFAULT_BACKEND
    backend = os.environ.get("TINY_MINDIE_TEST_BACKEND") or DEFAULT_BACKEND
    assert info["backend"] == backend and "CPU" in info["execution_provider"]
    for key in ("max_concurrent_requests", "max_batch_total_tokens", "max_best_of",
                "max_stop_sequences", "version"):
        assert key in info


# ---- vLLM 0.2 -------------------------------------------------------------------------------

def test_vllm_form_of_generate(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 2}
    status, _, raw = request(server, "POST", "/generate", body)
    assert status == 200
    texts = json.loads(raw)["text"]
    assert len(texts) == 2 and texts[0] == texts[1]          # greedy: the same twice
    assert texts[0].startswith(PROMPT) and "Paris" in texts[0]


def test_vllm_form_streams_nul_delimited_json(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    status, _, raw = request(server, "POST", "/generate", body)
    assert status == 200
    chunks = [json.loads(c) for c in raw.split(b"\0") if c]
    assert len(chunks) == 4
    plain = json.loads(request(server, "POST", "/generate", {**body, "stream": False})[2])
    assert chunks[-1] == plain


@pytest.mark.parametrize("ids, word", [([-1], "[0,49151]"), ([10**20], "[0,49151]"),
                                       ([1.5], "list of token ids"), ("2", "list of token ids")])
def test_vllm_stop_token_ids_must_be_token_ids(server, ids, word):
    body = {"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids}
    status, _, raw = request(server, "POST", "/generate", body)
    assert status == 422 and word in json.loads(raw)["error"]


def test_vllm_stop_token_ids_stop_generation(server, tokenizer):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    text = json.loads(request(server, "POST", "/generate", body)[2])["text"][0][len(PROMPT):]
    first = tokenizer.encode(text, add_bos=False)[0]
    stopped = json.loads(request(server, "POST", "/generate",
                                 {**body, "stop_token_ids": [first]})[2])["text"][0]
    assert stopped == PROMPT                          # vLLM leaves the stop token out


def test_generate_with_both_inputs_and_prompt_is_a_conflict(server):
    status, _, raw = request(server, "POST", "/generate", {"inputs": PROMPT, "prompt": PROMPT})
    assert status == 422 and "Input conflict" in json.loads(raw)["error"]


# ---- grammar (TGI >= 1.4.3): constrained decoding ----------------------------------------------

def test_grammar_json_and_regex_over_the_real_server(tgi_client, server):
    from text_generation.types import Grammar, GrammarType

    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = tgi_client.generate("Weather report as JSON:", max_new_tokens=40,
                            grammar=Grammar(type=GrammarType.Json, value=schema))
    jsonschema.validate(json.loads(r.generated_text), schema)
    assert r.details.finish_reason.value == "eos_token"
    rx = "(yes|no)! [0-9]{2}"
    streamed = list(tgi_client.generate_stream(PROMPT, max_new_tokens=10,
                                               grammar=Grammar(type=GrammarType.Regex, value=rx)))
    assert re.fullmatch(rx, streamed[-1].generated_text)
    status, _, raw = request(server, "POST", "/", {"inputs": PROMPT, "parameters": {
        "max_new_tokens": 40, "grammar": {"type": "json", "value": json.dumps(schema)}}})
    assert status == 200
    jsonschema.validate(json.loads(json.loads(raw)[0]["generated_text"]), schema)
    # \d is [0-9], as in a schema pattern: after fullwidth digits, not those
    digits = {"inputs": "１２３－４５６７ １２３－４５６７ １２３－４５６７ ", "parameters": {
        "max_new_tokens": 12, "grammar": {"type": "regex", "value": r"\d{3}-\d{4}"}}}
    status, _, raw = request(server, "POST", "/generate", digits)
    assert status == 200 and re.fullmatch("[0-9]{3}-[0-9]{4}", json.loads(raw)[
        "generated_text"]), raw
    for bad in ({"type": "yaml", "value": "x"}, {"type": "regex", "value": "(a"},
                {"type": "json", "value": {"type": "object", "not": {}}}, "json"):
        for path in ("/generate", "/generate_stream", "/"):
            status, _, raw = request(server, "POST", path, {"inputs": PROMPT, "parameters": {
                "max_new_tokens": 4, "grammar": bad}})
            assert status == 422 and json.loads(raw)["error_type"] == "validation", (path, raw)
