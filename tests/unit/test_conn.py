"""serve_connection on a real asyncio server, driven by real sockets, http.client and curl."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import select
import shutil
import socket
import subprocess
import threading
import time

import pytest
from helpers import ThreadedServer, closed_by_server

from tiny_mindie.api.server_errors import ANSWERS
from tiny_mindie.server.conn import PLAIN_ANSWERS, Response, json_response
from tiny_mindie.server.http_response import CONTINUE_100
from tiny_mindie.server.sse import sse_event
from tiny_mindie.server.tls import TLSFiles, client_context, make_certificates, server_context

MAX_BODY = 1024 * 1024
TOO_LARGE_BODY = b'{"message":"Request body too large. Maximum allowed size is 1MB."}'
INTERNAL_ERROR_BODY = b'{"error":"Internal server error","error_type":"Incomplete Generation"}'


class Recorder:
    """What handlers observed, shared with the test thread."""

    def __init__(self) -> None:
        self.disconnected = threading.Event()


async def handler(request, stream, rec: Recorder):
    path = request.path
    if path == "/echo":
        return json_response(200, {
            "method": request.method, "path": path, "query": request.query,
            "version": request.version, "body": request.body.decode("utf-8", "replace"),
            "te": request.header("transfer-encoding")})
    if path == "/unicode":
        return json_response(200, {"text": "\u4e2d\u6587 caf\u00e9"})
    if path == "/stream":
        out = await stream.start()
        for i in range(int(request.query.get("n", "3"))):
            await out.send(sse_event(json.dumps({"i": i, "text": "\u00e9"}, ensure_ascii=False)))
        return None
    if path == "/boom":
        raise RuntimeError("secret internals")
    if path == "/boom-mid-stream":
        out = await stream.start()
        await out.send(b"data: 1\n\n")
        raise RuntimeError("secret internals")
    if path == "/forever":
        try:
            out = await stream.start()
            while True:
                await out.send(b"data: " + b"x" * 1000 + b"\n\n")
                await asyncio.sleep(0.005)
        except ConnectionError:
            rec.disconnected.set()
            raise
    if path == "/slow":
        await asyncio.sleep(float(request.query.get("s", "0.2")))
        return json_response(200, {"slept": True})
    if path == "/none":
        return None
    if path == "/close":
        return Response(200, b"bye", "text/plain", [("Connection", "close")])
    return json_response(404, {"error": "not found", "error_type": "NotFoundError"})


class ServerThread(ThreadedServer):
    """serve_connection with this module's ``handler`` on a real socket, in a background thread;
    its own error answers are the app's (MindIE's bodies) unless ``answers`` says otherwise."""

    def __init__(self, loop: str = "asyncio", **kw) -> None:
        kw.setdefault("answers", ANSWERS)
        super().__init__(loop, **kw)
        self.rec = Recorder()
        self.clients: list[http.client.HTTPConnection] = []

    async def handler(self, request, stream):
        return await handler(request, stream, self.rec)

    def client(self) -> http.client.HTTPConnection:
        """An http.client connection, closed by close_clients() after the test."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        self.clients.append(conn)
        return conn

    def close_clients(self) -> None:
        while self.clients:
            self.clients.pop().close()

    def socket(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def server_thread(request):
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    with ServerThread(request.param, max_body_bytes=MAX_BODY, idle_timeout=5.0) as srv:
        yield srv


@pytest.fixture
def server(server_thread):
    yield server_thread
    server_thread.close_clients()


@pytest.fixture
def impatient_server():
    with ServerThread("asyncio", max_body_bytes=MAX_BODY, idle_timeout=0.3) as srv:
        yield srv


def recv_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    parts = []
    while chunk := sock.recv(65536):
        parts.append(chunk)
    return b"".join(parts)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"EOF after {data!r}"
        data += chunk
    return data


def split_response(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return lines[0], headers, body


# --- keep-alive, pipelining, headers --------------------------------------------------------

def test_keep_alive_reuses_one_connection(server):
    before = server.connections
    conn = server.client()
    for i in range(3):
        conn.request("POST", f"/echo?i={i}", body=b"hello")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200 and not resp.will_close
        assert body["query"] == {"i": str(i)} and body["body"] == "hello"
        assert resp.getheader("Server") == "tiny_mindie"
        assert resp.getheader("Date", "").endswith(" GMT")
        assert resp.getheader("Content-Type") == "application/json"
    conn.close()
    assert server.connections == before + 1


def test_pipelined_requests_answered_in_order(server):
    with server.socket() as sock:
        sock.sendall(b"GET /echo?n=1 HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /echo?n=2 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
                     b"GET /echo?n=3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = recv_all(sock)
    assert raw.count(b"HTTP/1.1 200 OK\r\n") == 3
    positions = [raw.index(b'"n":"%d"' % i) for i in (1, 2, 3)]
    assert positions == sorted(positions)
    assert b'"body":"abc"' in raw


def test_json_response_is_compact_utf8(server):
    conn = server.client()
    conn.request("GET", "/unicode")
    resp = conn.getresponse()
    assert resp.read() == '{"text":"\u4e2d\u6587 caf\u00e9"}'.encode("utf-8")


def test_connection_close_from_handler(server):
    with server.socket() as sock:
        sock.sendall(b"GET /close HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = split_response(recv_all(sock))
    assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close" and body == b"bye"


def test_head_request_has_no_body(server):
    conn = server.client()
    conn.request("HEAD", "/echo")
    resp = conn.getresponse()
    assert resp.status == 200 and int(resp.getheader("Content-Length")) > 0
    assert resp.read() == b""
    conn.request("GET", "/echo")          # the connection is still in sync
    assert json.loads(conn.getresponse().read())["method"] == "GET"


def test_http10_gets_close_and_unchunked_stream(server):
    with server.socket() as sock:
        sock.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
        status, headers, body = split_response(recv_all(sock))
    assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close"
    assert json.loads(body)["version"] == "HTTP/1.0"
    with server.socket() as sock:
        sock.sendall(b"GET /stream?n=2 HTTP/1.0\r\n\r\n")
        status, headers, body = split_response(recv_all(sock))
    assert "transfer-encoding" not in headers
    assert body == sse_event('{"i": 0, "text": "\u00e9"}') + sse_event('{"i": 1, "text": "\u00e9"}')


# --- request bodies, 100-continue, limits ---------------------------------------------------

def test_chunked_request_body(server):
    conn = server.client()
    conn.request("POST", "/echo", body=iter([b"hel", b"lo ", b"world"]), encode_chunked=True)
    body = json.loads(conn.getresponse().read())
    assert body["body"] == "hello world" and body["te"] == "chunked"


def test_expect_100_continue_raw(server):
    with server.socket() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: 5\r\nConnection: close\r\n\r\n")
        assert recv_exactly(sock, len(CONTINUE_100)) == CONTINUE_100
        sock.sendall(b"hello")
        status, _, body = split_response(recv_all(sock))
    assert status == "HTTP/1.1 200 OK" and json.loads(body)["body"] == "hello"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
def test_expect_100_continue_curl(server):
    # curl sends the body only after a 100 Continue or after its expect timeout (here far past
    # the run's own timeout): finishing at all means the server said 100 Continue
    proc = subprocess.run(
        ["curl", "-sS", "-v", "--expect100-timeout", "600", "-H", "Expect: 100-continue",
         "-H", "Content-Type: application/json", "--data-binary", '{"inputs":"hi"}',
         f"http://127.0.0.1:{server.port}/echo"],
        capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert b"< HTTP/1.1 100 Continue" in proc.stderr
    assert b"Done waiting for 100-continue" not in proc.stderr
    assert json.loads(proc.stdout)["body"] == '{"inputs":"hi"}'


def test_expect_with_oversized_length_gets_413_not_100(server):
    with server.socket() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1))
        status, headers, body = split_response(recv_all(sock))
    assert status == "HTTP/1.1 413 Request Entity Too Large"
    assert headers["connection"] == "close"
    assert body == TOO_LARGE_BODY


def test_content_length_body_too_large(server):
    conn = server.client()
    conn.request("POST", "/echo", body=b"x" * (MAX_BODY + 1))
    resp = conn.getresponse()
    assert resp.status == 413 and resp.read() == TOO_LARGE_BODY and resp.will_close


def test_chunked_body_too_large(server):
    with server.socket() as sock:
        chunk = b"x" * 65536
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + (b"%x\r\n%b\r\n" % (len(chunk), chunk)) * 17)
        status, _, body = split_response(recv_all(sock))
    assert status.startswith("HTTP/1.1 413") and body == TOO_LARGE_BODY


def test_body_at_limit_accepted(server):
    conn = server.client()
    conn.request("POST", "/echo", body=b"x" * MAX_BODY)
    resp = conn.getresponse()
    assert resp.status == 200 and len(json.loads(resp.read())["body"]) == MAX_BODY


# --- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("garbage, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 505),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"GET http://[/ HTTP/1.1\r\nHost: x\r\n\r\n", 400),     # urlsplit's ValueError escaped
    (b"GET http://[:::]/health HTTP/1.1\r\nHost: x\r\n\r\n", 400),   # not an IPv6 address
    (b"GET /echo HTTP/1.1\r\n\r\n", 400),                     # no Host
    (b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 3\r\n\r\nabc", 417),
])
def test_malformed_request_answered_then_server_still_serves(server, garbage, status):
    with server.socket() as sock:
        sock.sendall(garbage)
        line, headers, body = split_response(recv_all(sock))
    assert line.startswith(f"HTTP/1.1 {status} ")
    assert (headers["connection"] == "close" and "date" in headers
            and headers["server"] == "tiny_mindie")
    err = json.loads(body)
    assert err["error_type"] == line.split(" ", 2)[2] and err["error"]    # its reason phrase
    assert err["error_type"] == {400: "Bad Request", 417: "Expectation Failed",
                                 501: "Not Implemented",
                                 505: "HTTP Version Not Supported"}[status]
    conn = server.client()
    conn.request("GET", "/echo")
    assert conn.getresponse().status == 200


def read_answer(sock: socket.socket) -> bytes:
    """One answer with a ``Content-Length`` body, read without waiting for the connection's
    end."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"EOF after {data!r}"
        data += chunk
    body = data.partition(b"\r\n\r\n")[2]
    return data + recv_exactly(sock, int(split_response(data)[1]["content-length"]) - len(body))


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> TLSFiles:
    """A CA, a server and a client certificate (mutual TLS)."""
    d = str(tmp_path_factory.mktemp("pki"))
    files = TLSFiles(ca=(f"{d}/ca.pem",), cert=f"{d}/server.pem", key=f"{d}/server.key.pem",
                     crls=(), client_cert=f"{d}/client.pem", client_key=f"{d}/client.key.pem")
    make_certificates(files)
    return files


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_error_answer_closes_at_once_once_the_refused_request_is_all_in(loop, pki,
                                                                          monkeypatch):
    """Over TLS (which has no half-close: the client sees the end only when the connection
    closes). A refused request received whole -- a head with no body, or with all of its
    declared body -- is answered and its connection closed at once. One whose declared body is
    still owed keeps reading until that body is in, then closes (unread bytes would reset the
    connection and could lose the answer): a head refused with part of its body, and a 413.
    Observed by order, under a linger (30 s here) no deadline can explain: the owing
    connections, opened first, are still open when the whole ones have closed, and the oldest
    is still open when the younger ones close on receiving their bodies."""
    from tiny_mindie.server import conn

    if loop == "uvloop":
        pytest.importorskip("uvloop")
    monkeypatch.setattr(conn, "LINGER_SECONDS", 30.0)
    too_large = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)
    expect = b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 200-ok\r\nContent-Length: 3\r\n\r\n"
    client = client_context(pki)
    with ServerThread(loop, ssl_context=server_context(pki), max_body_bytes=MAX_BODY,
                      idle_timeout=60.0) as srv:
        def connect() -> socket.socket:
            return client.wrap_socket(srv.socket(), server_hostname="127.0.0.1")

        never, partial, large = connect(), connect(), connect()
        for sock, sent, status in ((never, too_large, 413), (partial, expect + b"a", 417),
                                   (large, too_large, 413)):
            sock.sendall(sent)
            assert read_answer(sock).startswith(b"HTTP/1.1 %d " % status)
        for request, status in ((b"GET / HTTP/2.0\r\n\r\n", 505),
                                (b"GET /echo HTTP/1.1\r\nBad Header\r\n\r\n", 400),
                                (b"GET /echo HTTP/1.1\r\n\r\n", 400),
                                (expect + b"abc", 417)):
            with connect() as sock:
                sock.sendall(request)
                sock.settimeout(10)
                assert recv_all(sock).startswith(b"HTTP/1.1 %d " % status)   # then the end
        assert not any(closed_by_server(s, 0.2) for s in (never, partial, large))
        partial.sendall(b"bc")
        assert closed_by_server(partial, 30)           # its body in: closed
        large.sendall(b"x" * (MAX_BODY + 1))
        assert closed_by_server(large, 30)
        assert not closed_by_server(never, 0.2)        # ... not by a deadline: still open
        for sock in (never, partial, large):
            sock.close()


def _access_records(caplog, n: int) -> list:
    """The first ``n`` access records, once they are written (the server runs in a thread)."""
    deadline = time.monotonic() + 5
    while len(got := [r for r in caplog.records if r.name == "tiny_mindie.access"]) < n:
        assert time.monotonic() < deadline, caplog.text
        time.sleep(0.01)
    return got[:n]


def test_refused_requests_get_an_access_record(server, caplog):
    """The parser's refusals are logged like routed requests: the answer's id, the status,
    outcome validation, the peer; method and path once the head was read."""
    with caplog.at_level(logging.INFO, logger="tiny_mindie.access"):
        answers = []
        for data in (b"GARBAGE\r\n\r\n", b"POST /echo HTTP/1.1\r\nHost: x\r\n"
                     b"X-Request-Id: big-7\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)):
            with server.socket() as sock:
                sock.sendall(data)
                answers.append(split_response(recv_all(sock)))
        records = _access_records(caplog, 2)
    for (line, headers, _), record, status in zip(answers, records, (400, 413), strict=True):
        fields = record.fields
        assert line.startswith(f"HTTP/1.1 {status} ")
        assert (fields["request_id"], fields["status"], fields["outcome"]) == \
            (headers["x-request-id"], status, "validation")
        assert fields["peer"].startswith("127.0.0.1:") and fields["total_ms"] is None
    assert (records[0].fields["method"], records[0].fields["path"]) == (None, None)
    assert records[0].getMessage() == f'"- -" 400 validation - id={records[0].fields["request_id"]}'
    assert (records[1].fields["request_id"], records[1].fields["method"],
            records[1].fields["path"]) == ("big-7", "POST", "/echo")


def test_a_request_timed_out_by_the_parser_is_logged_as_timeout(impatient_server, caplog):
    with caplog.at_level(logging.INFO, logger="tiny_mindie.access"):
        with impatient_server.socket() as sock:
            sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab")
            line, _, _ = split_response(recv_all(sock))
        record, = _access_records(caplog, 1)
    assert line.startswith("HTTP/1.1 408 ")
    assert (record.fields["status"], record.fields["outcome"]) == (408, "timeout")


def test_handler_exception_is_500_without_traceback(server, caplog):
    conn = server.client()
    with caplog.at_level(logging.ERROR, logger="tiny_mindie.server.conn"):
        conn.request("GET", "/boom")
        resp = conn.getresponse()
        body = resp.read()
    assert resp.status == 500 and body == INTERNAL_ERROR_BODY
    assert b"Traceback" not in body and b"secret" not in body
    assert any(r.exc_info and "secret internals" in str(r.exc_info[1]) for r in caplog.records)
    conn.request("GET", "/echo")              # same connection keeps serving
    assert conn.getresponse().status == 200


def test_handler_returning_nothing_is_500(server):
    conn = server.client()
    conn.request("GET", "/none")
    resp = conn.getresponse()
    assert resp.status == 500 and resp.read() == INTERNAL_ERROR_BODY


def test_without_the_apps_answers_its_own_errors_are_plain_text():
    """serve_connection writes no API family's bodies of its own: by default the parser's
    message and ``Internal server error``, as text."""
    with ServerThread("asyncio", max_body_bytes=MAX_BODY, idle_timeout=5.0,
                      answers=PLAIN_ANSWERS) as srv:
        with srv.socket() as sock:
            sock.sendall(b"GET /echo HTTP/1.1\r\n\r\n")
            line, headers, body = split_response(recv_all(sock))
        assert line == "HTTP/1.1 400 Bad Request"
        assert headers["content-type"] == "text/plain; charset=utf-8"
        assert body == b"Missing Host header (required in HTTP/1.1)"
        conn = srv.client()
        conn.request("GET", "/boom")
        resp = conn.getresponse()
        assert resp.status == 500 and resp.read() == b"Internal server error"
        assert resp.getheader("Content-Type") == "text/plain; charset=utf-8"
        srv.close_clients()


def test_exception_mid_stream_truncates_body(server):
    conn = server.client()
    conn.request("GET", "/boom-mid-stream")
    resp = conn.getresponse()
    assert resp.status == 200
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        resp.read()


# --- streaming ------------------------------------------------------------------------------

def test_stream_read_back_with_http_client(server):
    conn = server.client()
    conn.request("GET", "/stream?n=3")
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Transfer-Encoding") == "chunked"
    assert resp.getheader("Content-Type") == "text/event-stream"
    assert resp.getheader("Cache-Control") == "no-cache"
    assert resp.getheader("X-Accel-Buffering") == "no"      # nginx: pass each event on at once
    events = resp.read().decode("utf-8").split("\n\n")
    assert events[-1] == ""
    assert [json.loads(e.removeprefix("data: "))["i"] for e in events[:-1]] == [0, 1, 2]
    conn.request("GET", "/echo")               # keep-alive after a chunked stream
    assert conn.getresponse().status == 200


def test_stream_exact_chunk_framing(server):
    with server.socket() as sock:
        sock.sendall(b"GET /stream?n=2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        _, headers, body = split_response(recv_all(sock))
    events = [sse_event(json.dumps({"i": i, "text": "\u00e9"}, ensure_ascii=False))
              for i in range(2)]
    assert body == b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"
    assert headers["transfer-encoding"] == "chunked" and headers["connection"] == "close"


def test_client_disconnect_reaches_the_streaming_handler(server):
    with server.socket() as sock:
        sock.sendall(b"GET /forever HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200 OK")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    assert server.rec.disconnected.wait(30)


# --- timeouts -------------------------------------------------------------------------------

def test_idle_keep_alive_connection_times_out(impatient_server):
    with impatient_server.socket() as sock:
        sock.settimeout(30)
        start = time.monotonic()
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        data = recv_all(sock)                     # response, then EOF after the idle timeout
        _, headers, _ = split_response(data)
        assert data.startswith(b"HTTP/1.1 200 OK") and "connection" not in headers
        assert time.monotonic() - start >= 0.3 - 0.05      # not before the idle timeout


def test_stalled_request_gets_408(impatient_server):
    with impatient_server.socket() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        line, headers, body = split_response(recv_all(sock))
    assert line == "HTTP/1.1 408 Request Timeout"
    assert json.loads(body)["error_type"] == "Request Timeout"


def trickle(sock: socket.socket, data: bytes, gap: float = 0.1) -> int:
    """Send ``data`` one byte every ``gap`` seconds until the server answers (or closes);
    returns how many bytes were sent by then."""
    sent = 0
    try:
        for byte in data:
            sock.sendall(bytes([byte]))
            sent += 1
            if select.select([sock], [], [], gap)[0]:
                break                             # the server answered
    except OSError:                               # the server answered and closed: as wanted
        pass
    return sent


def test_a_header_trickled_in_byte_by_byte_still_gets_408(impatient_server):
    """The idle timeout (0.3 s here) bounds the whole header section, not the gap between two
    bytes: a client sending a byte every 0.1 s must not hold the connection open forever."""
    head = b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    with impatient_server.socket() as sock:
        sock.settimeout(30)
        sent = trickle(sock, head)
        line, headers, body = split_response(recv_all(sock))
    assert line == "HTTP/1.1 408 Request Timeout"
    assert sent < len(head), "the 408 came only once the client had sent all it meant to"


def test_empty_lines_before_a_request_start_the_header_deadline(impatient_server):
    """RFC 9112 lets a server skip empty lines before a request, but they are bytes received:
    a client sending CRLF every 0.1 s (idle timeout 0.3 s) must not hold its connection, and a
    maxLinkNum slot, forever.  The deadline runs from the first byte: 408, then close."""
    empty_lines = b"\r\n" * 100
    with impatient_server.socket() as sock:
        sock.settimeout(30)
        sent = trickle(sock, empty_lines)
        line, headers, body = split_response(recv_all(sock))
    assert line == "HTTP/1.1 408 Request Timeout" and headers["connection"] == "close"
    assert sent < len(empty_lines), "the 408 came only once the client stopped sending"


def test_broken_absolute_form_is_400_without_a_traceback(server, caplog):
    """``GET http://[/`` made urlsplit raise ValueError past the parser's error handling: the
    connection closed unanswered and a 1.6 KiB traceback was logged each time."""
    with caplog.at_level(logging.DEBUG):
        for target in (b"http://[/", b"http://[::1/x", b"http://a:b@h/"):
            with server.socket() as sock:
                sock.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                line, headers, body = split_response(recv_all(sock))
            assert line == "HTTP/1.1 400 Bad Request", target
            assert json.loads(body)["error"].startswith("Invalid absolute-form request-target")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info], \
        caplog.text


def test_a_slow_body_is_timed_per_read():
    """Once the header is in, a body arriving in pieces closer together than the idle timeout is
    read to the end, however long it takes in all."""
    idle = 1.0                 # far above the gaps between pieces, however loaded the host
    with ServerThread("asyncio", max_body_bytes=MAX_BODY, idle_timeout=idle) as srv, \
            srv.socket() as sock:
        sock.settimeout(30)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n"
                     b"Connection: close\r\n\r\n")
        start = time.monotonic()
        for piece in (b"ab", b"cd", b"ef", b"gh"):
            time.sleep(0.3)
            sock.sendall(piece)
        took = time.monotonic() - start
        line, headers, body = split_response(recv_all(sock))
    assert took > idle                            # the body took longer than the idle timeout
    assert line == "HTTP/1.1 200 OK" and b"abcdefgh" in body


def test_client_gone_before_response_is_quiet(server, caplog):
    with caplog.at_level(logging.DEBUG):
        with server.socket() as sock:
            sock.sendall(b"GET /slow?s=0.2 HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                            b"\x01\x00\x00\x00\x00\x00\x00\x00")
        time.sleep(0.4)
        conn = server.client()
        conn.request("GET", "/echo")
        assert conn.getresponse().status == 200
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
