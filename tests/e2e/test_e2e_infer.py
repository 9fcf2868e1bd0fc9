"""End to end: the real server process, the real model, real mutual TLS, real clients."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import ssl
import subprocess

import pytest
from helpers import request, seed_body, sse_events


def curl(server, body: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["curl", "-sS", "-N", "-H", "Accept: application/json",
         "-H", "Content-type: application/json",
         "--cacert", server.ca, "--cert", server.client_cert, "--key", server.client_key,
         "-X", "POST", "-d", json.dumps(body), *extra, f"{server.url}/infer"],
        capture_output=True, timeout=120)


def check_details_keys(d: dict) -> None:
    """MindIE's three keys, and tiny_mindie's speculation counts when any were proposed."""
    if "proposed_tokens" in d:
        assert 0 <= d["accepted_tokens"] <= d["proposed_tokens"] and d["proposed_tokens"] > 0
        d = {k: v for k, v in d.items() if k not in ("proposed_tokens", "accepted_tokens")}
    assert set(d) == {"finish_reason", "generated_tokens", "seed"}


def check_plain_answer(ans: dict, max_new_tokens: int) -> None:
    assert set(ans) == {"generated_text", "details"}
    assert isinstance(ans["generated_text"], str) and ans["generated_text"].strip()
    d = ans["details"]
    check_details_keys(d)
    assert d["finish_reason"] in ("length", "eos_token")
    assert isinstance(d["generated_tokens"], int) and 1 <= d["generated_tokens"] <= max_new_tokens
    if d["finish_reason"] == "length":
        assert d["generated_tokens"] == max_new_tokens
    assert isinstance(d["seed"], int) and 0 <= d["seed"] <= 2**63 - 1


def check_stream(events: list[dict], tokenizer, max_new_tokens: int) -> str:
    """Every field and type of an /infer stream; returns generated_text."""
    assert events
    first, last = events[0], events[-1]
    assert isinstance(first["prefill_time"], float) and first["prefill_time"] > 0
    assert first["decode_time"] is None
    for ev in events[:-1]:
        assert set(ev) == {"prefill_time", "decode_time", "token"}
        assert set(ev["token"]) == {"id", "text"}
        assert isinstance(ev["token"]["id"], int) and isinstance(ev["token"]["text"], str)
        assert "\ufffd" not in ev["token"]["text"]
    for ev in events[1:]:
        assert ev["prefill_time"] is None and isinstance(ev["decode_time"], float)
    assert set(last) == {"prefill_time", "decode_time", "generated_text", "details", "token"}
    assert last["token"]["text"] is None and isinstance(last["token"]["id"], int)
    d = last["details"]
    check_details_keys(d)
    assert d["generated_tokens"] == len(events)
    if d["finish_reason"] == "length":
        assert d["generated_tokens"] == max_new_tokens
    streamed = "".join(ev["token"]["text"] for ev in events[:-1])
    last_text = tokenizer.decode([last["token"]["id"]])
    assert streamed + last_text == last["generated_text"]
    return last["generated_text"]


def test_banner_says_where_and_how(server):
    b = server.banner
    assert f"https://127.0.0.1:{server.port}" in b
    from tiny_mindie.model.backend import DEFAULT_BACKEND
    backend = os.environ.get("TINY_MINDIE_TEST_BACKEND") or DEFAULT_BACKEND
    assert "smollm2-135m-instruct" in b and f"backend  {backend} on CPU" in b
    for path in (server.ca, server.client_cert, server.client_key):
        assert path in b
    assert "curl " in b and "/infer" in b


def test_seed_request_plain_http_client(server):
    status, headers, body = request(server, "POST", "/infer", seed_body(stream=False))
    assert status == 200
    assert headers["content-type"].startswith("application/json")
    assert int(headers["content-length"]) == len(body)
    check_plain_answer(json.loads(body), 20)


def test_seed_request_plain_curl(server):
    r = curl(server, seed_body(stream=False))
    assert r.returncode == 0, r.stderr
    check_plain_answer(json.loads(r.stdout), 20)


def test_seed_request_stream_http_client(server, tokenizer):
    status, headers, body = request(server, "POST", "/infer", seed_body(stream=True))
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["transfer-encoding"] == "chunked"
    check_stream(sse_events(body), tokenizer, 20)


def test_seed_request_stream_curl(server, tokenizer):
    r = curl(server, seed_body(stream=True))
    assert r.returncode == 0, r.stderr
    events = sse_events(r.stdout)
    assert b"[DONE]" not in r.stdout
    check_stream(events, tokenizer, 20)


def test_seeded_stream_equals_seeded_plain(server, tokenizer):
    seed = 846930886
    _, _, plain = request(server, "POST", "/infer",
                          seed_body(stream=False, seed=seed, max_new_tokens=24))
    _, _, streamed = request(server, "POST", "/infer",
                             seed_body(stream=True, seed=seed, max_new_tokens=24))
    plain = json.loads(plain)
    assert plain["details"]["seed"] == seed
    events = sse_events(streamed)
    assert events[-1]["details"]["seed"] == seed
    assert check_stream(events, tokenizer, 24) == plain["generated_text"]


def test_unseeded_requests_draw_different_seeds(server):
    body = seed_body(stream=False, max_new_tokens=1)
    seeds = {json.loads(request(server, "POST", "/infer", body)[2])["details"]["seed"]
             for _ in range(3)}
    assert len(seeds) == 3


def test_greedy_knows_paris(server):
    body = {"inputs": "The capital of France is",
            "parameters": {"do_sample": False, "max_new_tokens": 8}}
    status, _, raw = request(server, "POST", "/infer", body)
    assert status == 200
    ans = json.loads(raw)
    assert set(ans) == {"generated_text"}          # no details unless asked
    assert "Paris" in ans["generated_text"]


def test_details_false_stream_ends_with_null_details(server):
    body = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 3}}
    events = sse_events(request(server, "POST", "/infer", body)[2])
    assert events[-1]["details"] is None
    assert len(events) <= 3


def test_client_without_certificate_is_refused(server):
    ctx = ssl.create_default_context(cafile=server.ca)   # trusts the server, presents nothing
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        request(server, "POST", "/infer", seed_body(stream=False), ctx=ctx)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_curl_without_certificate_is_refused(server):
    r = subprocess.run(["curl", "-sS", "--cacert", server.ca, "-X", "POST", "-d", "{}",
                        f"{server.url}/infer"], capture_output=True, timeout=30)
    assert r.returncode != 0
    assert b"generated_text" not in r.stdout


def test_client_certificate_from_another_ca_is_refused(server, tmp_path):
    from tiny_mindie.server.tls import TLSFiles, make_certificates
    d = str(tmp_path)
    other = TLSFiles(ca=(f"{d}/ca.pem",), cert=f"{d}/s.pem", key=f"{d}/s.key", crls=(),
                     client_cert=f"{d}/c.pem", client_key=f"{d}/c.key")
    make_certificates(other)
    from dataclasses import replace

    from tiny_mindie.server.tls import client_context
    ctx = client_context(replace(other, ca=(server.ca,)))   # trusts the server, wrong client CA
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        request(server, "POST", "/infer", seed_body(stream=False), ctx=ctx)


def test_tls_12_is_refused(server):
    ctx = server.ssl_context()
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises((ssl.SSLError, ConnectionError)):
        request(server, "POST", "/infer", seed_body(stream=False), ctx=ctx)


def test_keep_alive_serves_several_requests_on_one_connection(server):
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=server.ssl_context(),
                                       timeout=60)
    for _ in range(3):
        conn.request("POST", "/infer",
                     body=json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2}}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and "generated_text" in json.loads(resp.read())
    conn.close()
