"""Logs and request ids over a real server: ``--log-format json`` (set through the environment,
``TINY_MINDIE_LOG_FORMAT``), one access record per request -- answered or abandoned -- with its
request id, route, tokens, times and the client certificate's subject, no prompt or output
text; ``X-Request-Id`` on every answer, the client's own kept when sane. One server process
for the module (plus the shared one for the text format)."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from helpers import TEST_CONFIG, request, seed_body, serving, sse_events, start_server

pytestmark = pytest.mark.e2e

SECRET = "Zanzibar-quokka-7731"       # a prompt word that must never reach the log
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def jsrv(tmp_path_factory, model_path):
    """A server logging JSON (chosen by its environment); ``jsrv.log``: its output lines."""
    srv = start_server(str(tmp_path_factory.mktemp("jsonlog")), TEST_CONFIG,
                       env={"TINY_MINDIE_LOG_FORMAT": "json", "TINY_MINDIE_LOG_LEVEL": "info"})
    yield from serving(srv)


def access_record(srv, request_id: str, timeout: float = 30.0) -> dict:
    """The access record of ``request_id`` in the server's JSON log (waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        for line in list(srv.log):
            if request_id in line:
                rec = json.loads(line)
                if rec["logger"] == "tiny_mindie.access" and rec["request_id"] == request_id:
                    return rec
        assert time.monotonic() < deadline, f"no access record for {request_id}:\n" + "".join(
            srv.log[-10:])
        time.sleep(0.05)


def test_json_access_record_of_a_request(jsrv):
    """The client's X-Request-Id comes back and names the access record, which has the route
    template, the status, the tokens, TTFT and total time, the client certificate's subject
    and the peer; every line of the log is one JSON object; no prompt or output text."""
    body = seed_body(False, max_new_tokens=6, do_sample=False)
    body["inputs"] = f"{SECRET} says hello and"
    status, headers, raw = request(jsrv, "POST", "/infer", body,
                                   headers={"X-Request-Id": "trace-42.a_b"})
    assert status == 200, raw
    assert headers["x-request-id"] == "trace-42.a_b"
    output = json.loads(raw)["generated_text"]
    rec = access_record(jsrv, "trace-42.a_b")
    assert rec["level"] == "INFO" and re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", rec["timestamp"])
    assert (rec["method"], rec["route"], rec["path"], rec["status"], rec["outcome"]) == \
        ("POST", "/infer", "/infer", 200, "success")
    assert rec["prompt_tokens"] > 5 and rec["cached_tokens"] >= 0
    assert 1 <= rec["generated_tokens"] <= 6
    assert 0 < rec["ttft_ms"] <= rec["total_ms"]
    assert "CN=" in rec["client"] and rec["peer"].startswith("127.0.0.1:")
    assert '"POST /infer" 200' in rec["message"] and "id=trace-42.a_b" in rec["message"]
    # the route's template, not the path with the model's name in it
    status, headers, _ = request(jsrv, "GET", f"/v1/models/{MODEL}",
                                 headers={"X-Request-Id": "tmpl-1"})
    assert status == 200
    rec = access_record(jsrv, "tmpl-1")
    assert (rec["route"], rec["path"]) == ("/v1/models/{model}", f"/v1/models/{MODEL}")
    assert rec["generated_tokens"] == 0 and rec["ttft_ms"] is None
    log = list(jsrv.log)
    assert all(json.loads(line)["message"] is not None for line in log)   # JSON, banner too
    text = "".join(log)
    assert SECRET not in text and output.strip()[:12] not in text


def test_request_id_generated_when_absent_or_insane(jsrv):
    ids = []
    for given in (None, "x" * 129, "has space", "caf\u00e9"):
        headers = {} if given is None else {"X-Request-Id": given}
        status, got, _ = request(jsrv, "GET", "/v1/models", headers=headers)
        assert status == 200
        assert re.fullmatch(r"[0-9a-f]{32}", got["x-request-id"]), (given, got)
        ids.append(got["x-request-id"])
        assert access_record(jsrv, got["x-request-id"])["route"] == "/v1/models"
    assert len(set(ids)) == len(ids)
    status, got, _ = request(jsrv, "GET", "/v1/models", headers={"X-Request-Id": "y" * 128})
    assert got["x-request-id"] == "y" * 128


def test_request_id_on_error_answers_and_streams(jsrv):
    """404, 405, 422 and a stream carry X-Request-Id; so does the parser's own 400. The
    refusals' outcome is ``validation``, as /metrics counts them."""
    for method, path, body, want in (("GET", "/nowhere", None, 404),
                                     ("DELETE", "/infer", None, 405),
                                     ("POST", "/infer", {"inputs": ""}, 422),
                                     ("POST", "/infer", seed_body(True, max_new_tokens=2), 200)):
        status, headers, raw = request(jsrv, method, path, body,
                                       headers={"X-Request-Id": f"err-{want}"})
        assert (status, headers["x-request-id"]) == (want, f"err-{want}"), raw
        rec = access_record(jsrv, f"err-{want}")
        assert (rec["status"], rec["outcome"]) == (want, "success" if want == 200 else "validation")
    assert rec["generated_tokens"] == 2 and sse_events(raw)
    assert access_record(jsrv, "err-404")["route"] is None
    with socket.create_connection(("127.0.0.1", jsrv.port), timeout=30) as raw_sock:
        with jsrv.ssl_context().wrap_socket(raw_sock, server_hostname="127.0.0.1") as tls:
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
            head = tls.recv(65536).decode()
    assert head.startswith("HTTP/1.1 400") and re.search(r"(?i)x-request-id: [0-9a-f]{32}", head)


def test_abandoned_stream_is_logged(jsrv):
    """A client that leaves in the middle of a stream still gets its access record: status
    200, outcome cancelled, the tokens it was sent."""
    body = json.dumps(seed_body(True, max_new_tokens=200, do_sample=False)).encode()
    with socket.create_connection(("127.0.0.1", jsrv.port), timeout=60) as raw_sock:
        tls = jsrv.ssl_context().wrap_socket(raw_sock, server_hostname="127.0.0.1")
        tls.sendall(b"POST /infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"X-Request-Id: gone-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while b"data:" not in got:
            chunk = tls.recv(65536)
            assert chunk, got
            got += chunk
        assert b"X-Request-Id: gone-1" in got
        tls.shutdown(socket.SHUT_RDWR)     # leave without a TLS goodbye
        tls.close()
    rec = access_record(jsrv, "gone-1", timeout=30)
    assert (rec["status"], rec["outcome"], rec["route"]) == (200, "cancelled", "/infer")
    assert 1 <= rec["generated_tokens"] < 200 and rec["ttft_ms"] is not None


def test_text_access_line_has_the_request_id(server):
    """The default text format keeps one line per request, now with ``id=``."""
    status, headers, _ = request(server, "GET", "/v1/models", headers={"X-Request-Id": "txt-9"})
    assert status == 200 and headers["x-request-id"] == "txt-9"
    deadline = time.monotonic() + 30
    while not any(" id=txt-9" in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log[-10:])
        time.sleep(0.05)
    line = next(line for line in server.log if " id=txt-9" in line)
    assert re.search(r'INFO tiny_mindie\.access: "GET /v1/models" 200 [0-9.]+ ms id=txt-9$',
                     line.strip()), line


def _raw_answer(srv, data: bytes) -> str:
    """The head of the server's answer to the raw request bytes ``data`` (over mutual TLS)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as raw_sock:
        with srv.ssl_context().wrap_socket(raw_sock, server_hostname="127.0.0.1") as tls:
            tls.sendall(data)
            return tls.recv(65536).decode("latin-1")


@pytest.mark.parametrize("data, status", [
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n", 400),
    (b"POST /infer HTTP/1.1\r\nHost: x\r\nX-Request-Id: big-1\r\nContent-Length: 99999999999\r\n"
     b"\r\n", 413),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"POST /infer HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 1\r\n\r\nx", 417),
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 101 + b"\r\n", 431),
    (b"POST /infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
])
def test_requests_the_parser_refuses_have_an_access_record(jsrv, data, status):
    """Outcome ``validation``, the status, the answer's request id (the client's once the head
    was read), the peer and the client's certificate subject."""
    head = _raw_answer(jsrv, data)
    assert head.startswith(f"HTTP/1.1 {status} "), head
    rid = re.search(r"(?i)x-request-id: (\S+)", head).group(1)
    rec = access_record(jsrv, rid)
    assert (rec["status"], rec["outcome"], rec["route"], rec["total_ms"]) == \
        (status, "validation", None, None)
    assert rec["peer"].startswith("127.0.0.1:") and "CN=" in rec["client"]
    if status == 413:
        assert (rid, rec["method"], rec["path"]) == ("big-1", "POST", "/infer")
        assert '"POST /infer" 413 validation - id=big-1' in rec["message"]
    elif status != 414:             # the request-line was read: its method and path are shown
        first = data.split(b"\r\n", 1)[0].decode().split(" ")
        assert (rec["method"], rec["path"]) == (first[0], first[1])
        assert f'"{first[0]} {first[1]}" {status} validation' in rec["message"]
