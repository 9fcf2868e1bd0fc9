"""A real server against clients that misbehave on the wire: lone surrogates in the JSON they
send, disconnects before (and while) their answer is written, streams they never read.

Counters are read from ``GET /metrics`` before and after (other tests share the server), once no
request is in flight."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import random
import socket
import threading
import time

import pytest
from helpers import TEST_CONFIG, request, sse_events, start_server
from prometheus_client.parser import text_string_to_metric_families

MODEL = "smollm2-135m-instruct"
P = "tiny_mindie_"
S = r'"\ud800"'                      # a lone surrogate as JSON text (json.loads -> "\ud800")
LONE = json.loads(S)
OUTCOMES = ("success", "validation", "too_long", "timeout", "cancelled", "stopped", "internal")


# ---- helpers -----------------------------------------------------------------------------

def metrics(server) -> dict:
    """``{name: value}``: request counters by outcome, running, tokens, KV usage."""
    status, _, body = request(server, "GET", "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            name = s.name.removeprefix(P)
            if name == "request_failed_total":
                out[s.labels["reason"]] = s.value
            elif name == "request_success_total":
                out["success"] = s.value
            elif name in ("request_received_total", "num_requests_running",
                          "generation_tokens_total", "npu_cache_usage_perc"):
                out[name.removeprefix("request_").removesuffix("_total")] = s.value
    return out


def settled(server, timeout: float = 30.0) -> dict:
    """Metrics once every request received has its outcome counted and none runs."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["received"] == sum(m[k] for k in OUTCOMES) and m["num_requests_running"] == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("received", *OUTCOMES)}


def send_raw(server, path: str, body: dict, rcvbuf: int = 0):
    """A TLS socket that has sent one POST and read nothing."""
    raw = socket.socket()
    if rcvbuf:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.connect(("127.0.0.1", server.port))
    sock = server.ssl_context().wrap_socket(raw, server_hostname="127.0.0.1")
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def leave(server, path: str, body: dict, after_s: float) -> None:
    """Send a request and close the connection ``after_s`` seconds later, unread."""
    sock = send_raw(server, path, body)
    time.sleep(after_s)
    sock.close()


# Requests that would generate for seconds: sampling at temperature 10 does not stop by itself.
LONG = {
    "infer": ("/infer", {"inputs": "Tell me a story", "parameters": {
        "max_new_tokens": 200, "temperature": 10.0, "do_sample": True, "seed": 1}}),
    "infer-stream": ("/infer", {"inputs": "Tell me a story", "stream": True, "parameters": {
        "max_new_tokens": 200, "temperature": 10.0, "do_sample": True, "seed": 2}}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 200, "ignore_eos": True,
                                      "messages": [{"role": "user", "content": "A story"}]}),
    "chat-stream": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 200, "ignore_eos": True,
                                             "stream": True,
                                             "messages": [{"role": "user", "content": "A story"}]}),
}


def tracebacks(server) -> int:
    return sum("Traceback" in line for line in server.log)


# ---- lone surrogates ---------------------------------------------------------------------

def test_lone_surrogates_get_their_4xx_or_answer_on_every_route_family(server):
    """A lone surrogate (JSON ``"\\ud800"``) echoed in an error message or in an answer is
    written as that escape: valid UTF-8, valid JSON, the route's own status; no traceback."""
    before = tracebacks(server)

    def post(path: str, raw_json: str, status: int):
        got, _, body = request(server, "POST", path, raw_json.encode())
        text = body.decode("utf-8")                   # strict: valid UTF-8
        assert got == status, (path, raw_json, text)
        return text

    def answer(path: str, raw_json: str, status: int) -> dict:
        return json.loads(post(path, raw_json, status))

    wrong_type = f'Parameter temperature must be a number, got "{LONE}".'
    # MindIE native: a parameter of the wrong type; a prompt (the tokenizer sees U+FFFD)
    assert answer("/infer", '{"inputs":"hi","parameters":{"temperature":%s}}' % S, 422) == {
        "error": wrong_type, "error_type": "Input Validation Error"}
    assert json.loads(post("/infer", '{"inputs":%s,"parameters":{"max_new_tokens":2}}' % S, 200))
    events = sse_events(post("/infer", '{"inputs":%s,"stream":true,"parameters":'
                                       '{"max_new_tokens":2}}' % S, 200).encode())
    assert events[-1]["generated_text"] is not None
    assert answer("/v1/tokenizer", '{"inputs":"a","do_decode":%s}' % S, 422)["error"] == \
        f'Field do_decode must be a boolean, got "{LONE}".'
    assert answer("/v1/tokenizer", '{"inputs":%s}' % S, 200)["token_number"] >= 1
    # TGI: the error; the prompt echoed back (return_full_text) in a stream; a stop string
    assert answer("/generate", '{"inputs":"hi","parameters":{"temperature":%s}}' % S, 422) == {
        "error": wrong_type, "error_type": "validation"}
    events = sse_events(post("/generate_stream", '{"inputs":%s,"parameters":{"max_new_tokens":2,'
                                                 '"return_full_text":true,"stop":[%s]}}' % (S, S),
                             200).encode())
    assert events[-1]["generated_text"].startswith(LONE)
    # vLLM 0.2's /generate echoes the prompt
    assert answer("/generate", '{"prompt":%s,"max_tokens":2}' % S, 200)["text"][0].startswith(LONE)
    # Triton
    assert answer(f"/v2/models/{MODEL}/generate",
                 '{"text_input":"hi","parameters":{"temperature":%s}}' % S,
                 422)["error"] == wrong_type
    # OpenAI: an unknown model; the prompt echoed, plain and streamed; a stop string
    for path in ("/v1/chat/completions", "/v1/completions"):
        err = answer(path, '{"model":%s,"prompt":"hi","messages":[{"role":"user","content":"hi"}]}'
                    % S, 404)
        assert err["error"]["message"] == f"The model `{LONE}` does not exist."
    assert answer("/v1/completions", '{"model":"%s","prompt":%s,"max_tokens":2,"echo":true}'
                 % (MODEL, S), 200)["choices"][0]["text"].startswith(LONE)
    events = post("/v1/completions", '{"model":"%s","prompt":%s,"max_tokens":2,"echo":true,'
                                     '"stream":true}' % (MODEL, S), 200)
    assert json.loads(events.split("\n\n")[0].removeprefix("data: "))["choices"][0]["text"] == LONE
    events = post("/v1/chat/completions", '{"model":"%s","max_tokens":2,"stream":true,"stop":[%s],'
                                          '"messages":[{"role":"user","content":%s}]}'
                  % (MODEL, S, S), 200)
    assert events.endswith("data: [DONE]\n\n")
    assert tracebacks(server) == before


# ---- disconnects are the client's doing --------------------------------------------------

# ---- numbers and nesting no request needs ------------------------------------------------

BIG = "1" + "0" * 400                 # an integer no float holds (json.loads makes an int)
DEEP = "[" * 500 + '"x"' + "]" * 500  # deeper than MAX_JSON_DEPTH (64); ~1000 breaks json.loads


def test_huge_numbers_and_deep_nesting_get_the_familys_4xx(server):
    """An integer too large for a float in a float parameter, huge integers in integer
    parameters, a 5000-digit integer (json.loads refuses it), JSON nested 500 and 5000 deep:
    each route family answers its own 4xx, counted ``validation``; no traceback, nothing
    ``internal`` (was: 500 ``OverflowError`` / ``RecursionError``)."""
    logs, before = tracebacks(server), settled(server)
    triton = f"/v2/models/{MODEL}/generate"
    cases = [   # (path, raw JSON body, status, part of the error message)
        *[("/infer", '{"inputs":"hi","parameters":{"%s":%s}}' % (n, BIG), 422,
           f"Parameter {n} must be in") for n in
          ("temperature", "top_p", "typical_p", "repetition_penalty", "max_new_tokens", "seed",
           "top_k")],
        ("/infer", '{"inputs":"hi","parameters":{"temperature":-%s}}' % BIG, 422, "(0.0,inf)"),
        *[("/generate", '{"inputs":"hi","parameters":{"%s":%s}}' % (n, BIG), 422, n) for n in
          ("temperature", "top_p", "typical_p", "repetition_penalty", "best_of", "top_n_tokens")],
        *[("/generate", '{"prompt":"hi","%s":%s}' % (n, BIG), 422, n) for n in
          ("temperature", "top_p", "repetition_penalty", "n", "top_k", "max_tokens")],
        (triton, '{"text_input":"hi","parameters":{"top_p":%s}}' % BIG, 422, "top_p"),
        *[("/v1/completions", '{"model":"%s","prompt":"hi","%s":%s}' % (MODEL, n, BIG), 400, n)
          for n in ("top_p", "temperature", "logprobs", "best_of", "n", "seed")],
        *[("/v1/chat/completions", '{"model":"%s","messages":[{"role":"user","content":"hi"}],'
           '"%s":%s}' % (MODEL, n, BIG), 400, n) for n in
          ("temperature", "presence_penalty", "repetition_penalty", "max_tokens",
           "top_logprobs")],
        # json.loads: "Exceeds the limit (4300 digits)"
        ("/infer", '{"inputs":"hi","parameters":{"seed":%s}}' % ("9" * 5000), 422,
         "Failed to parse request context to json"),
        ("/v1/completions", '{"model":"%s","prompt":"hi","seed":%s}' % (MODEL, "9" * 5000),
         422, "Failed to parse request context to json"),
        # nesting: 500 deep (json.loads parses it; it is refused before), 5000 deep (it would not)
        *[(path, body, status, "nest deeper than 64 levels") for path, status, body in (
            ("/infer", 422, '{"inputs":"hi","parameters":{"x":%s}}' % DEEP),
            ("/generate", 422, '{"inputs":"hi","parameters":{"x":%s}}' % DEEP),
            (triton, 422, '{"text_input":"hi","x":%s}' % DEEP),
            ("/v1/completions", 400, '{"model":"%s","prompt":%s}' % (MODEL, DEEP)),
            ("/v1/chat/completions", 400, '{"model":"%s","max_tokens":1,"messages":[{"role":'
             '"user","content":"hi"}],"chat_template_kwargs":{"a":%s}}' % (MODEL, DEEP)),
            ("/v1/chat/completions", 400, '{"model":"%s","max_tokens":1,"messages":[{"role":'
             '"user","content":"hi","x":%s}]}' % (MODEL, '{"a":' * 950 + "1" + "}" * 950)),
            ("/v1/chat/completions", 400, '{"model":"%s","messages":%s}'
             % (MODEL, "[" * 5000 + "]" * 5000)))],
    ]
    for path, body, status, part in cases:
        got, _, raw = request(server, "POST", path, body.encode())
        answer = json.loads(raw)
        message = answer["error"]["message"] if path.startswith("/v1/") else answer["error"]
        assert (got, part in message) == (status, True), (path, body[:120], raw[:300])
    after = settled(server)
    assert delta(before, after)["validation"] == len(cases)
    assert delta(before, after)["internal"] == 0 and tracebacks(server) == logs


def test_clients_that_leave_before_their_answer_are_counted_cancelled(server):
    before = settled(server)
    for path, body in LONG.values():
        leave(server, path, body, 0.0)       # right after sending: before any head
        leave(server, path, body, 0.4)       # while generating (streams: mid-stream)
    # one token: generated before the server looks for the client, whose answer has no reader
    leave(server, "/infer", {"inputs": "Hi", "parameters": {"max_new_tokens": 1}}, 0.0)
    after = settled(server)
    assert delta(before, after) == {"received": 9, **dict.fromkeys(OUTCOMES, 0), "cancelled": 9}


def test_a_disconnect_storm_counts_nothing_internal_and_the_server_goes_on(server):
    rng = random.Random(13)
    jobs = [(*LONG[rng.choice(list(LONG))], rng.uniform(0.0, 0.8)) for _ in range(50)]
    before = settled(server)
    logged = tracebacks(server)
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda job: leave(server, *job), jobs))
    after = settled(server, timeout=60)
    d = delta(before, after)
    assert d["internal"] == 0 and d["received"] == 50
    assert d["success"] + d["cancelled"] == 50 and d["cancelled"] > 0, d
    assert tracebacks(server) == logged
    status, _, body = request(server, "POST", "/infer", {"inputs": "Hello",
                                                         "parameters": {"max_new_tokens": 3}})
    assert status == 200 and json.loads(body)["generated_text"]


# ---- a streaming client that never reads -------------------------------------------------

@pytest.fixture(scope="module")
def one_slot_server(tmp_path_factory, model_path):
    """A server running one sequence at a time that cuts off a stream left 8 KB behind."""
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["ServerConfig"]["maxStreamBacklogKB"] = 8
    cfg["BackendConfig"]["ModelDeployConfig"]["maxSeqLen"] = 2048
    cfg["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=1, maxPrefillBatchSize=1,
                                                  maxIterTimes=2000)
    srv = start_server(str(tmp_path_factory.mktemp("one_slot")), cfg)
    srv.log = []
    threading.Thread(target=lambda: srv.log.extend(iter(srv.proc.stdout.readline, "")),
                     daemon=True).start()
    yield srv
    srv.proc.terminate()
    srv.proc.wait(timeout=20)


NEVER_READ = {
    "/infer": {"inputs": "Tell me a story", "stream": True, "parameters": {
        "max_new_tokens": 1900, "temperature": 10.0, "do_sample": True, "seed": 5}},
    "/v1/chat/completions": {"model": MODEL, "max_tokens": 1900, "ignore_eos": True,
                             "stream": True, "messages": [{"role": "user", "content": "A story"}]},
    # vLLM 0.2, two samples merged into one stream: both leave the engine when it is cut off
    "/generate": {"prompt": "Tell me a story", "n": 2, "stream": True, "max_tokens": 1900,
                  "temperature": 10.0, "ignore_eos": True, "seed": 5},
}


@pytest.mark.e2e
@pytest.mark.parametrize("path", list(NEVER_READ))
def test_a_stream_nobody_reads_is_cut_off_and_frees_its_slot(one_slot_server, path):
    srv = one_slot_server
    before = settled(srv)
    with send_raw(srv, path, NEVER_READ[path], rcvbuf=4096):
        # The one slot is the unread stream's: this request waits until it is cut off.
        status, _, body = request(srv, "POST", "/infer", {"inputs": "Hello", "parameters": {
            "max_new_tokens": 5, "temperature": 10.0, "do_sample": True, "seed": 1}})
    assert status == 200 and json.loads(body)["generated_text"]
    after = settled(srv)
    assert delta(before, after) == {"received": 2, **dict.fromkeys(OUTCOMES, 0),
                                    "success": 1, "cancelled": 1}
    cut_at = after["generation_tokens"] - before["generation_tokens"] - 5
    assert 0 < cut_at < 600, cut_at           # of 1900: cut off, not run to max_tokens
    assert after["num_requests_running"] == 0 and after["npu_cache_usage_perc"] == 0
    assert any("cut off a client that left" in line for line in srv.log)


@pytest.mark.e2e
def test_a_stream_read_as_it_comes_is_not_cut_off(one_slot_server):
    """The same 8 KB limit never touches a client that reads: 400 tokens, all delivered."""
    before = settled(one_slot_server)
    status, _, body = request(one_slot_server, "POST", "/infer", {
        "inputs": "Tell me a story", "stream": True, "parameters": {
            "max_new_tokens": 400, "temperature": 10.0, "do_sample": True, "seed": 6,
            "details": True}})
    assert status == 200
    assert sse_events(body)[-1]["details"]["generated_tokens"] == 400
    assert delta(before, settled(one_slot_server))["success"] == 1
    status, _, body = request(one_slot_server, "GET", "/v1/config")
    assert status == 200 and json.loads(body)["ServerConfig"]["maxStreamBacklogKB"] == 8
