"""Engine behaviour seen through the server: timeouts, concurrency, priority accepted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from test_e2e_infer import request, sse_events


def test_timeout_non_stream_is_mindie_500(server):
    body = {"inputs": "1, 2, 3, 4, 5,",
            "parameters": {"max_new_tokens": 250, "timeout": 1, "do_sample": False}}
    status, _, raw = request(server, "POST", "/infer", body)
    assert status == 500
    assert json.loads(raw) == {"error": "Engine callback timeout: client timeout",
                               "error_type": "Incomplete Generation"}


def test_timeout_in_stream_is_a_final_error_event(server):
    body = {"inputs": "1, 2, 3, 4, 5,", "stream": True,
            "parameters": {"max_new_tokens": 250, "timeout": 1, "do_sample": False}}
    status, _, raw = request(server, "POST", "/infer", body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == {"error": "Engine callback timeout: client timeout",
                          "error_type": "Incomplete Generation"}
    assert all("token" in ev for ev in events[:-1])


def test_concurrent_requests_all_complete(server):
    bodies = [{"inputs": prompt, "stream": i % 2 == 0,
               "parameters": {"max_new_tokens": n, "seed": i, "temperature": 0.8, "details": True,
                              "priority": 1 + i % 5}}
              for i, (prompt, n) in enumerate([("The sky is", 6), ("Once upon a time", 12),
                                               ("Water boils at", 4), ("My favourite food is", 9)])]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda b: request(server, "POST", "/infer", b), bodies))
    for body, (status, _, raw) in zip(bodies, results):
        assert status == 200
        n = body["parameters"]["max_new_tokens"]
        last = sse_events(raw)[-1] if body["stream"] else json.loads(raw)
        d = last["details"]
        assert d["seed"] == body["parameters"]["seed"]
        assert d["generated_tokens"] == n or d["finish_reason"] == "eos_token"


def test_server_keeps_serving_after_timeouts(server):
    status, _, raw = request(server, "POST", "/infer", {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert status == 200 and json.loads(raw)["generated_text"]
