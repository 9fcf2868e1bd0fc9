"""GET /metrics: prometheus_client's parser accepts it, and the counters move by exactly the
requests sent (read before and after: other tests share the server)."""

from __future__ import annotations

import http.client
import json
import math
import os
import subprocess
import time

from helpers import debian_binary, request, sse_events
from prometheus_client.parser import text_string_to_metric_families

P = "tiny_mindie_"
MODEL = "smollm2-135m-instruct"
REASONS = ("validation", "too_long", "timeout", "cancelled", "stopped", "internal")
HISTOGRAMS = ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds")


def scrape(server) -> tuple[dict, dict]:
    """``({family name: type}, {(sample name, frozenset(labels)): value})``."""
    status, headers, body = request(server, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = {}, {}
    for fam in text_string_to_metric_families(body.decode()):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples[(P + name, frozenset({"model_name": MODEL, **labels}.items()))]


def counters(samples: dict) -> dict:
    out = {k: value(samples, f"request_{k}_total") for k in ("received", "success")}
    out.update({r: value(samples, "request_failed_total", reason=r) for r in REASONS})
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def idle(samples: dict) -> bool:
    """No request in flight: every one received has its outcome counted, none runs or waits.
    The tests that count exactly start from there (an earlier test's abandoned request may
    still be counted a moment after that test ended)."""
    c = counters(samples)
    return (c["received"] == c["success"] + sum(c[r] for r in REASONS)
            and value(samples, "num_requests_running") == 0
            and value(samples, "num_requests_waiting") == 0)


def test_one_outcome_vocabulary_for_the_access_log_and_the_counters():
    """The request record's outcome words are success and the counters' failure reasons, in
    order; every error kind's reason is one of them."""
    from tiny_mindie.api.errors import Kind
    from tiny_mindie.api.metrics import FAIL_REASONS
    from tiny_mindie.server.routing import OUTCOMES

    assert OUTCOMES == ("success", *FAIL_REASONS) and FAIL_REASONS == REASONS
    assert {k.reason for k in Kind} <= set(OUTCOMES)


def test_exposition_parses_with_every_series(server):
    types, samples = scrape(server)
    for name in ("request_received", "request_success", "request_failed", "prompt_tokens",
                 "generation_tokens"):
        assert types[P + name] == "counter", name
    for name in ("num_requests_running", "num_requests_waiting", "npu_cache_usage_perc"):
        assert types[P + name] == "gauge", name
    for name in HISTOGRAMS:
        assert types[P + name] == "histogram", name
        buckets = sorted(((float(dict(labels)["le"]), v) for (n, labels), v in samples.items()
                          if n == P + name + "_bucket"))
        assert buckets[-1][0] == math.inf
        counts = [v for _, v in buckets]
        assert counts == sorted(counts)                       # cumulative
        assert buckets[-1][1] == value(samples, name + "_count")
        assert value(samples, name + "_sum") >= 0
    assert 0.0 <= value(samples, "npu_cache_usage_perc") <= 1.0
    assert set(counters(samples)) == {"received", "success", *REASONS}


def test_promtool_accepts_the_exposition_with_process_series(server):
    """``promtool check metrics`` (Prometheus' own linter: names, HELP/TYPE, counters' _total,
    units) exits 0 on the real server's /metrics, which also carries the process_* series."""
    promtool = debian_binary("promtool", "prometheus")
    status, _, body = request(server, "GET", "/metrics")
    assert status == 200
    r = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True,
                       timeout=30)
    assert r.returncode == 0 and not r.stdout + r.stderr, (r.stdout + r.stderr).decode()
    types, samples = scrape(server)
    for name, kind in (("process_cpu_seconds", "counter"), ("process_open_fds", "gauge"),
                       ("process_max_fds", "gauge"), ("process_resident_memory_bytes", "gauge"),
                       ("process_virtual_memory_bytes", "gauge"),
                       ("process_start_time_seconds", "gauge")):
        assert types[name] == kind, name
    assert samples[("process_resident_memory_bytes", frozenset())] > 10 * 2**20
    assert 0 < samples[("process_open_fds", frozenset())] < samples[("process_max_fds",
                                                                       frozenset())]


def test_successful_requests_move_request_and_token_counters_exactly(server, tokenizer):
    prompt = "My name is Olivier and I"
    n_prompt = len(tokenizer.encode(prompt, parse_special=True))
    params = {"max_new_tokens": 6, "do_sample": False, "details": True}
    before = _wait_for(server, idle)

    status, _, body = request(server, "POST", "/infer", {"inputs": prompt, "parameters": params})
    assert status == 200
    n1 = json.loads(body)["details"]["generated_tokens"]
    status, _, body = request(server, "POST", "/infer",
                              {"inputs": prompt, "stream": True, "parameters": params})
    assert status == 200
    n2 = sse_events(body)[-1]["details"]["generated_tokens"]

    _, after = scrape(server)
    assert delta(counters(before), counters(after)) == {
        "received": 2, "success": 2, **dict.fromkeys(REASONS, 0)}
    d = lambda name: value(after, name) - value(before, name)   # noqa: E731
    assert d("prompt_tokens_total") == 2 * n_prompt
    assert d("generation_tokens_total") == n1 + n2
    assert d("time_to_first_token_seconds_count") == 2
    assert d("time_per_output_token_seconds_count") == (n1 - 1) + (n2 - 1)
    assert d("e2e_request_latency_seconds_count") == 2
    assert d("e2e_request_latency_seconds_sum") > 0


def _wait_for(server, pred, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, samples = scrape(server)
        if pred(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def test_failures_are_counted_once_by_reason(server):
    before = _wait_for(server, idle)
    base = counters(before)

    # validation: bad JSON, a parameter out of range (422 from the API layer)
    assert request(server, "POST", "/infer", b"{not json")[0] == 422
    assert request(server, "POST", "/infer",
                   {"inputs": "Hi", "parameters": {"top_p": 1.0}})[0] == 422
    # too_long: 424
    assert request(server, "POST", "/infer", {"inputs": "hello " * 700})[0] == 424
    # timeout: 500 Engine callback timeout (near-uniform sampling does not stop by itself)
    status, _, body = request(server, "POST", "/infer", {
        "inputs": "Hi", "parameters": {"max_new_tokens": 256, "temperature": 10.0,
                                       "do_sample": True, "seed": 3, "timeout": 1}})
    assert (status, json.loads(body)["error"]) == (500, "Engine callback timeout: client timeout")
    # cancelled: the client leaves a stream after its first event
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=server.ssl_context(),
                                       timeout=60)
    conn.request("POST", "/infer", body=json.dumps({
        "inputs": "Hi", "stream": True,
        "parameters": {"max_new_tokens": 256, "temperature": 10.0, "do_sample": True, "seed": 4}}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    _, during = scrape(server)   # the stream holds a KV slot meanwhile
    assert value(during, "num_requests_running") >= 1
    assert value(during, "npu_cache_usage_perc") > 0
    assert counters(during)["received"] - counters(during)["success"] \
        - sum(counters(during)[r] for r in REASONS) >= 1      # in flight
    conn.sock.close()
    conn.close()

    after = _wait_for(server, lambda s: counters(s)["cancelled"] > base["cancelled"])
    assert delta(base, counters(after)) == {
        "received": 5, "success": 0, "validation": 2, "too_long": 1, "timeout": 1,
        "cancelled": 1, "stopped": 0, "internal": 0}


def test_non_generation_routes_are_not_counted(server):
    before = _wait_for(server, idle)
    for path in ("/health", "/v1/status", "/metrics", f"/v2/models/{MODEL}/getSlotCount"):
        assert request(server, "GET", path)[0] == 200
    assert request(server, "GET", "/health/timed-10")[0] == 200   # a real generation, not a request
    assert request(server, "GET", "/nope")[0] == 404
    _, after = scrape(server)
    assert counters(after) == counters(before)


def test_the_default_server_speculates_on_extractive_work_and_counts_it(server):
    """Speculative decoding is on by default (onnxruntime backend): a request that copies its
    prompt, decoding alone, has proposals verified and kept, and /metrics counts them --
    whatever the host's load (a verification is priced at its rows' decode steps at most)."""
    status, _, body = request(server, "GET", "/v1/config")
    on = json.loads(body)["BackendConfig"]["ScheduleConfig"]["speculativeDecoding"]
    numpy = os.environ.get("TINY_MINDIE_TEST_BACKEND") == "numpy"
    assert status == 200 and on is (not numpy)
    text = ("Edge devices have little memory, so small quantized models are a good fit for "
            "them, and a server that speaks the same API saves rewriting every client.")
    before = _wait_for(server, idle, timeout=120)
    assert idle(before)              # it decodes alone: an earlier test's request has ended
    status, _, body = request(server, "POST", "/infer", {
        "inputs": f"Text:\n{text}\n\nThe same text again:\n{text[:30]}",
        "parameters": {"max_new_tokens": 24, "do_sample": False}})
    assert status == 200 and json.loads(body)["generated_text"]
    _, after = scrape(server)
    d = lambda name: value(after, name) - value(before, name)   # noqa: E731
    proposed = d("spec_decode_num_draft_tokens_total")
    kept = d("spec_decode_num_accepted_tokens_total")
    if numpy:
        assert proposed == kept == 0
    else:
        assert proposed >= kept >= 8, (proposed, kept)
    assert d("spec_decode_draft_model_tokens_total") == 0     # no draft: all prompt lookup


def test_the_speculation_series_say_which_is_a_part_of_which(server):
    """The totals count both sources; the draft model's series say they are a part of the
    totals (a dashboard adding them would count the draft's tokens twice)."""
    status, _, body = request(server, "GET", "/metrics")
    assert status == 200
    help_of = {f.name: f.documentation for f in text_string_to_metric_families(body.decode())}
    for total in ("num_draft_tokens", "num_accepted_tokens"):
        text = help_of[f"{P}spec_decode_{total}"]
        assert "prompt lookup and the draft model" in text, text
        assert "(prompt lookup)" not in text
    for part, total in (("draft_model_tokens", "num_draft_tokens"),
                        ("draft_model_accepted_tokens", "num_accepted_tokens")):
        text = help_of[f"{P}spec_decode_{part}"]
        assert f"a part of {P}spec_decode_{total}_total, not in addition" in text, text
