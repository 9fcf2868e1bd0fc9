"""Management routes over curl (spec §4): health, readiness, timed health, slots, status, config,
and /stopService -- graceful (drains a running stream, exits 0) and forced -- on servers of their
own, since they stop them."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest
from helpers import TEST_CONFIG, start_server

pytestmark = pytest.mark.e2e            # every test needs a server; some start their own

MODEL = "smollm2-135m-instruct"
STOPPED = "The service has been stopped."
# A stream that keeps going for a few seconds: near-uniform sampling rarely meets EOS.
LONG_STREAM = {"inputs": "Count from one to one thousand:", "stream": True,
               "parameters": {"max_new_tokens": 200, "temperature": 10.0, "do_sample": True,
                              "seed": 7, "details": True}}


def curl(server, path: str, *extra: str, timeout: float = 60) -> tuple[int, str]:
    """GET (or what ``extra`` says) over mutual TLS; returns (status, body)."""
    r = subprocess.run(["curl", "-sS", "--cacert", server.ca, "--cert", server.client_cert,
                        "--key", server.client_key, "-w", "\n%{http_code}", *extra,
                        f"{server.url}{path}"], capture_output=True, text=True, timeout=timeout)
    body, _, code = r.stdout.rpartition("\n")
    return int(code), body


def curl_stream(server, body: dict) -> subprocess.Popen:
    """A streaming ``/infer`` by curl, read line by line from its stdout."""
    return subprocess.Popen(
        ["curl", "-sS", "-N", "--cacert", server.ca, "--cert", server.client_cert,
         "--key", server.client_key, "-H", "Content-Type: application/json", "-X", "POST",
         "-d", json.dumps(body), f"{server.url}/infer"], stdout=subprocess.PIPE, text=True)


def events_of(lines: list[str]) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


# ---- the shared server ----------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/v2/health/live", "/v2/health/ready",
                                  f"/v2/models/{MODEL}/ready"])
def test_health_routes_answer_200_with_empty_body(server, path):
    assert curl(server, path) == (200, "")


def test_model_ready_for_an_unknown_model_is_404(server):
    status, body = curl(server, "/v2/models/nope/ready")
    assert status == 404
    assert json.loads(body) == {"error": "Model nope not found", "error_type": "NotFoundError"}


def test_timed_health_runs_a_real_generation(server):
    # "healthy" says the server's own generation finished within the 10 s it was given
    status, body = curl(server, "/health/timed-10")
    assert (status, json.loads(body)) == (200, {"status": "healthy"})


@pytest.mark.parametrize("n", ["0", "601", "99999", "9" * 5000, "0" * 5000])
def test_timed_health_n_out_of_range_is_422(server, n):
    status, body = curl(server, f"/health/timed-{n}")
    assert status == 422
    assert json.loads(body)["error_type"] == "Input Validation Error"
    assert "[1, 600]" in json.loads(body)["error"]


@pytest.mark.parametrize("path", ["/health/timed-", "/health/timed-x", "/health/other",
                                  "/health/timed-%D9%A3"])          # an Arabic 3: not ASCII
def test_other_health_paths_are_404(server, path):
    assert curl(server, path)[0] == 404


def test_slot_count(server):
    status, body = curl(server, f"/v2/models/{MODEL}/getSlotCount")
    ans = json.loads(body)
    assert status == 200 and set(ans) == {"total_slots", "free_slots", "available_tokens_length"}
    assert 1 <= ans["free_slots"] <= ans["total_slots"]
    assert ans["available_tokens_length"] == ans["free_slots"] * 1024   # maxSeqLen of TEST_CONFIG


def test_status_has_mindie_shape(server):
    status, body = curl(server, "/v1/status")
    ans = json.loads(body)
    assert status == 200 and set(ans) == {"service", "resource", "linkStatus"}
    assert ans["service"]["roleStatus"] == "RoleReady"
    res = ans["resource"]
    assert {"availSlotsNum", "availBlockNum", "waitingRequestNum", "runningRequestNum",
            "swappedRequestNum", "freeNpuBlockNums", "totalNpuBlockNums"} <= set(res)
    assert 0 <= res["freeNpuBlockNums"] <= res["totalNpuBlockNums"]
    assert ans["linkStatus"] == {"peers": []}


def test_config_is_the_effective_one_without_key_contents(server):
    status, body = curl(server, "/v1/config")
    ans = json.loads(body)
    assert status == 200
    assert ans["modelName"] == MODEL and ans["maxSeqLen"] == 1024 and ans["maxOutputLen"] == 256
    s = ans["ServerConfig"]
    assert s["httpsEnabled"] is True and s["maxRequestLength"] == 1
    assert s["tlsPk"] == server.client_key.replace("client.key.pem", "server.key.pem")
    assert ans["BackendConfig"]["batchInvariant"] is (os.environ.get("TINY_MINDIE_TEST_BACKEND")
                                                      != "numpy")
    md = ans["BackendConfig"]["ModelDeployConfig"]
    assert md["maxInputTokenLen"] == 512 and md["ModelConfig"][0]["modelName"] == MODEL
    assert "PRIVATE KEY" not in body and "BEGIN" not in body


def test_stop_service_with_a_bad_mode_is_422_and_does_not_stop(server):
    status, body = curl(server, "/stopService?mode=Sometime")
    assert status == 422 and "mode" in json.loads(body)["error"]
    assert curl(server, "/health") == (200, "")


# ---- servers of their own -------------------------------------------------------------------
@pytest.fixture
def own_server(tmp_path):
    """A server this test may stop; its output is read on a thread so the pipe never fills."""
    srv = start_server(str(tmp_path), TEST_CONFIG)
    srv.log = []
    threading.Thread(target=lambda: srv.log.extend(iter(srv.proc.stdout.readline, "")),
                     daemon=True).start()
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()


def _first_event(stream: subprocess.Popen) -> list[str]:
    lines = []
    while not lines or not lines[-1].startswith("data: "):
        line = stream.stdout.readline()
        assert line, "stream ended before its first event"
        lines.append(line)
    return lines


def _wait_stopping(server) -> None:
    deadline = time.monotonic() + 30
    while curl(server, "/health")[0] != 503:
        assert time.monotonic() < deadline, "/health never turned 503"
        time.sleep(0.05)


def test_graceful_stop_drains_a_running_stream_then_exits_0(own_server):
    srv = own_server
    stream = curl_stream(srv, LONG_STREAM)
    lines = _first_event(stream)
    stopper = subprocess.Popen(
        ["curl", "-sS", "--cacert", srv.ca, "--cert", srv.client_cert, "--key", srv.client_key,
         "-w", "%{http_code}", f"{srv.url}/stopService"], stdout=subprocess.PIPE, text=True)
    _wait_stopping(srv)
    # Not admitting any more: a new request gets MindIE's 503, readiness says why.
    status, body = curl(srv, "/infer", "-X", "POST", "-H", "Content-Type: application/json",
                        "-d", json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 2}}))
    assert status == 503
    assert json.loads(body) == {"error": STOPPED, "error_type": "Service Unavailable"}
    status, body = curl(srv, "/v2/health/ready")
    assert (status, json.loads(body)) == (503, {"message": STOPPED})
    assert curl(srv, "/stopService")[0] == 503          # already stopping
    assert stopper.poll() is None                       # /stopService waits for the stream
    # ... while the running stream goes on to its natural end.
    lines += stream.stdout.readlines()
    assert stream.wait(timeout=60) == 0
    events = events_of(lines)
    last = events[-1]
    assert "error" not in last, last
    assert last["details"]["finish_reason"] in ("length", "eos_token")
    assert last["details"]["generated_tokens"] == len(events)
    assert len(events) > 1
    assert stopper.communicate(timeout=30)[0] == "200"   # answered once drained
    assert srv.proc.wait(timeout=30) == 0


def test_forced_stop_cancels_a_running_stream_then_exits_0(own_server):
    srv = own_server
    stream = curl_stream(srv, LONG_STREAM)
    lines = _first_event(stream)
    assert curl(srv, "/stopService?mode=Force") == (200, "")
    lines += stream.stdout.readlines()
    assert stream.wait(timeout=30) == 0
    events = events_of(lines)
    assert events[-1] == {"error": STOPPED, "error_type": "Service Unavailable"}
    assert len(events) < LONG_STREAM["parameters"]["max_new_tokens"]     # cut, not run out
    assert srv.proc.wait(timeout=60) == 0


def test_three_ports_give_three_listeners_each_with_its_own_routes(tmp_path):
    """MindIE's 1025/1026/1027 layout: business, management and metrics planes apart."""
    import copy
    import http.client
    import re
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    cfg = copy.deepcopy(TEST_CONFIG)
    ports = {"port": free_port(), "managementPort": free_port(), "metricsPort": free_port()}
    cfg["ServerConfig"].update(ports)
    srv = start_server(str(tmp_path), cfg)
    try:
        listens = dict((p, planes) for p, planes in
                       re.findall(r"listens\s+https://127\.0\.0\.1:(\d+)\s+\((\w+)\)", srv.banner))
        assert listens == {str(ports["port"]): "business",
                           str(ports["managementPort"]): "management",
                           str(ports["metricsPort"]): "metrics"}

        def status(port: int, method: str, path: str, body: bytes | None = None) -> int:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=srv.ssl_context(),
                                               timeout=60)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            code = conn.getresponse().status
            conn.close()
            return code

        infer = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 1}}).encode()
        assert status(ports["port"], "POST", "/infer", infer) == 200
        assert status(ports["port"], "GET", "/health") == 404
        assert status(ports["port"], "GET", "/metrics") == 404
        assert status(ports["managementPort"], "GET", "/health") == 200
        assert status(ports["managementPort"], "POST", "/infer", infer) == 404
        assert status(ports["metricsPort"], "GET", "/metrics") == 200
        assert status(ports["metricsPort"], "GET", "/health") == 404
    finally:
        srv.proc.terminate()
        srv.proc.wait(timeout=30)
