"""deploy/nginx's configuration serving two real replicas: Debian's nginx, started on a loopback
port with its own prefix, in front of two ``python -m tiny_mindie`` replicas over mutual TLS (one
CA for nginx, the replicas and the client): a revoked client refused, streams through it, then
one replica gets SIGTERM mid-run.

nginx is a Debian package that may be missing on a developer's machine: the tests skip then,
saying so (:func:`helpers.debian_binary`), except in CI (``$CI`` set), where .ci/run installs it
and a missing one fails.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest
from helpers import TEST_CONFIG, Server, debian_binary, request, start_server
from nginx_deploy import nginx_certificates, nginx_cmd, render_nginx

SESSION_HEADER = "X-Session-Id"


class NginxPair:
    """Debian's nginx on 127.0.0.1:``port`` (deploy/nginx's file, rendered) and two replicas."""

    def __init__(self, nginx: subprocess.Popen, port: int, prefix: str, replicas: list[Server]):
        self.nginx, self.port, self.prefix, self.replicas = nginx, port, prefix, replicas
        self.ctx = replicas[0].ssl_context()     # one CA, one client certificate for all

    def access_log(self) -> list[dict]:
        """nginx's access records (deploy/nginx's log_format) as dicts."""
        out = []
        with open(os.path.join(self.prefix, "logs", "tiny_mindie.access.log")) as fh:
            for line in fh:
                m = re.search(r'"(?P<request>[^"]*)" (?P<status>\d+) .*upstream=(?P<upstream>.*) '
                              r'upstream_status=(?P<upstream_status>.*) request_id=(?P<id>\S*) '
                              r'session=(?P<session>\S*)$', line)
                assert m, line
                out.append(m.groupdict())
        return out

    def replica_of(self, upstream: str) -> int:
        """Index of the replica that gave the answer (the last address tried)."""
        last = upstream.split(",")[-1].strip()
        return [f"127.0.0.1:{r.port}" for r in self.replicas].index(last)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _keep_reading(srv: Server) -> None:
    """Read the replica's output in the background so its pipe never fills."""
    srv.log = []
    threading.Thread(target=lambda: srv.log.extend(iter(srv.proc.stdout.readline, "")),
                     daemon=True).start()


@pytest.fixture(scope="module")
def nginx_pair(tmp_path_factory, model_path):
    nginx = debian_binary("nginx", "nginx")
    prefix = str(tmp_path_factory.mktemp("nginx"))
    sec = nginx_certificates(prefix)
    config = json.loads(json.dumps(TEST_CONFIG))
    config["ServerConfig"].update(
        tlsCaPath=f"{sec}/ca/", tlsCaFile=["ca.pem"], tlsCert=f"{sec}/certs/server.pem",
        tlsPk=f"{sec}/keys/server.key.pem", tlsCrlPath=f"{sec}/certs/",
        tlsCrlFiles=["server_crl.pem"])
    # two replicas on the machine's cores: one run of one thread each; 10 KV slots each
    # (kvCacheMB 512 / maxSeqLen 1024) all in the running batch, so 20 streams run at once
    config["BackendConfig"].update(intraOpThreads=1, parallelRuns=1)
    config["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=10)
    homes = [str(tmp_path_factory.mktemp(f"replica{i}")) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:    # both start at once
        futures = [pool.submit(start_server, home, config) for home in homes]
    replicas = [f.result() for f in futures if f.exception() is None]
    proc = None
    try:
        for f in futures:
            if f.exception() is not None:
                raise f.exception()
        for srv in replicas:
            _keep_reading(srv)
        port = _free_port()
        conf = render_nginx(prefix, port, [f"127.0.0.1:{r.port}" for r in replicas])
        proc = subprocess.Popen(nginx_cmd(nginx, prefix, conf), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    with open(os.path.join(prefix, "logs", "error.log")) as fh:
                        pytest.fail(f"nginx did not start:\n{fh.read()}")
                time.sleep(0.05)
        yield NginxPair(proc, port, prefix, replicas)
    finally:
        if proc is not None:
            proc.terminate()                      # nginx: SIGTERM is its fast shutdown
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for srv in replicas:
            if srv.proc.poll() is None:
                srv.proc.kill()
                srv.proc.wait(timeout=10)


def _stream(pair: NginxPair, max_tokens: int, request_id: str,
            first_event: threading.Semaphore | None = None) -> dict:
    """One streaming /v1/completions through nginx: status, the arrival time of each SSE event,
    its data (JSON or ``[DONE]``), and ``error`` (an exception, a non-200 answer, or an event
    that is not a token)."""
    out = {"id": request_id, "times": [], "events": [], "error": None, "status": None}
    body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    try:
        conn = http.client.HTTPSConnection("127.0.0.1", pair.port, context=pair.ctx, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json", "X-Request-Id": request_id})
        resp = conn.getresponse()
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = f"{resp.status} {resp.read()[:300]!r}"
            return out
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            out["times"].append(time.monotonic())
            data = line[len(b"data: "):].strip()
            event = "[DONE]" if data == b"[DONE]" else json.loads(data)
            out["events"].append(event)
            if first_event is not None and len(out["events"]) == 1:
                first_event.release()
        conn.close()
    except Exception as exc:     # reported: the test fails on it
        out["error"] = repr(exc)
        return out
    events = out["events"]
    if not events or events[-1] != "[DONE]":
        out["error"] = f"stream did not end with [DONE]: {events[-2:]}"
    elif any("error" in e or not e.get("choices") for e in events[:-1]):
        out["error"] = f"an error event: {[e for e in events[:-1] if 'error' in e][:1]}"
    elif events[-2]["choices"][0].get("finish_reason") != "length":
        out["error"] = f"stream ended early: {events[-2]}"
    return out


def _successes(srv: Server) -> float:
    """The replica's tiny_mindie request_success_total (summed over labels), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = request(srv, "GET", "/metrics")
    assert status == 200
    return sum(s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples if re.fullmatch(r"tiny_mindie[:_]request_success_total", s.name))


def _bursts(times: list[float], gap: float = 0.005) -> int:
    """How many groups of events arrived, events less than ``gap`` s apart being one group."""
    return 1 + sum(1 for a, b in zip(times, times[1:], strict=False) if b - a > gap)


@pytest.mark.e2e
def test_nginx_refuses_a_client_certificate_the_crl_revokes(nginx_pair):
    """nginx checks the clients' certificates against the replicas' CRL (``ssl_crl``): the
    replicas only ever see nginx's own certificate, so a revoked client would otherwise pass."""
    import dataclasses
    import ssl

    from tiny_mindie.server.tls import client_context

    tls = nginx_pair.replicas[0].tls
    sec = os.path.dirname(os.path.dirname(tls.client_cert))
    body = json.dumps({"inputs": "Hi", "parameters": {"max_new_tokens": 1}})

    def status(files) -> int | None:
        conn = http.client.HTTPSConnection("127.0.0.1", nginx_pair.port,
                                           context=client_context(files), timeout=60)
        try:
            conn.request("POST", "/infer", body=body,
                         headers={"Content-Type": "application/json"})
            return conn.getresponse().status
        except (ssl.SSLError, ConnectionError):
            return None                             # refused in the handshake
        finally:
            conn.close()

    revoked = dataclasses.replace(tls, client_cert=f"{sec}/certs/revoked.pem",
                                  client_key=f"{sec}/keys/revoked.key.pem")
    assert status(revoked) in (None, 400)           # nginx: 400 "The SSL certificate error"
    assert status(tls) == 200


def test_nginx_streams_reach_both_replicas(nginx_pair):
    """20 concurrent streams through nginx all complete, their tokens arriving one by one (not in
    one burst at the end), both replicas serving; X-Session-Id keeps a session on one replica."""
    pair = nginx_pair
    before = [_successes(r) for r in pair.replicas]
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda i: _stream(pair, 16, f"p1-{i}"), range(20)))
    assert [r["error"] for r in results] == [None] * 20, [r for r in results if r["error"]][:2]
    for r in results:
        assert len(r["events"]) >= 9, r["events"]           # 16 tokens, then [DONE]
        assert _bursts(r["times"]) >= 6, (r["id"], [round(t - r["times"][0], 3)
                                                    for t in r["times"]])
    served = [_successes(r) - b for r, b in zip(pair.replicas, before, strict=True)]
    log = [e for e in pair.access_log() if e["id"].startswith("p1-")]
    by_log = [sum(1 for e in log if pair.replica_of(e["upstream"]) == i) for i in (0, 1)]
    spans = sorted(r["times"][-1] - r["times"][0] for r in results)
    print(f"\n20 streams: replicas served {served[0]:.0f} / {served[1]:.0f} (metrics), "
          f"{by_log[0]} / {by_log[1]} (nginx log); events per stream "
          f"{min(len(r['events']) for r in results)}-{max(len(r['events']) for r in results)}, "
          f"arriving in {min(_bursts(r['times']) for r in results)}+ groups over "
          f"{spans[0]:.2f}-{spans[-1]:.2f} s")
    assert sum(served) == 20 and min(served) >= 1, served
    assert by_log == [int(s) for s in served] and len(log) == 20

    # stickiness: one session, one replica (the same hash key), whichever that is
    body = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 1}
    for session in ("alpha", "beta", "gamma"):
        for i in range(3):
            conn = http.client.HTTPSConnection("127.0.0.1", pair.port, context=pair.ctx,
                                               timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", SESSION_HEADER: session,
                                  "X-Request-Id": f"s-{session}-{i}"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.read()
            resp.read()
            conn.close()
    for session in ("alpha", "beta", "gamma"):
        where = {pair.replica_of(e["upstream"]) for e in pair.access_log()
                 if e["session"] == session}
        assert len(where) == 1, (session, where)


@pytest.mark.e2e
def test_nginx_sigterm_on_a_replica_loses_no_request(nginx_pair):
    """SIGTERM to one replica while 20 streams run through nginx and 10 more arrive: no client
    sees an error. Needs graceful SIGTERM (issue 18, lifecycle): the replica drains -- its
    streams in flight finish, new requests get 503, which nginx sends to the other replica
    (proxy_next_upstream http_503 non_idempotent) -- and exits 0."""
    pair = nginx_pair
    victim, other = pair.replicas
    assert victim.proc.poll() is None and other.proc.poll() is None
    started = threading.Semaphore(0)
    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        running = [pool.submit(_stream, pair, 32, f"p2-{i}", started) for i in range(20)]
        for _ in range(12):      # most streams have their first token: both replicas busy
            assert started.acquire(timeout=30)
        t_term = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        late = []
        for i in range(10):      # new requests while it drains, and after it is gone
            late.append(pool.submit(_stream, pair, 8, f"p2-late-{i}"))
            time.sleep(0.15)
        results = [f.result() for f in running + late]
    code = victim.proc.wait(timeout=40)
    log = {e["id"]: e for e in pair.access_log() if e["id"].startswith("p2-")}
    on_victim = {i for i, e in log.items() if pair.replica_of(e["upstream"]) == 0}
    # streams on the victim that had begun before SIGTERM and ended after it
    drained = [r["id"] for r in results if r["id"] in on_victim and r["times"]
               and r["times"][0] < t_term < r["times"][-1]]
    retried = [e for e in log.values() if "," in e["upstream"]]
    print(f"\nSIGTERM after {t_term - min(r['times'][0] for r in results if r['times']):.2f} s: "
          f"{sum(r['error'] is None for r in results)}/30 complete, {len(drained)} streams in "
          f"flight on the draining replica finished there, {len(retried)} retried by nginx "
          f"({[e['upstream_status'] for e in retried]}), replica exit status {code}")
    assert [r["error"] for r in results] == [None] * 30, \
        ([r for r in results if r["error"]][:3], "".join(victim.log[-20:]))
    assert drained, "no stream was in flight on the replica that got SIGTERM"
    # round robin sent a late request to the draining replica: 503, then the other one's 200
    assert any(e["upstream_status"].startswith("503, ") for e in retried), retried
    assert code == 0
