"""What goes on the wire when the client misbehaves, without a model: lone surrogates in text
(json_response, SSE events, parser error bodies) and a streaming client that stops reading
(ChunkedStream's backlog limit, on a real asyncio server and real sockets)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
from helpers import ThreadedServer

from tiny_mindie.api.server_errors import ANSWERS
from tiny_mindie.config.load import ConfigError, load_config
from tiny_mindie.server.conn import json_response
from tiny_mindie.server.http import HTTPError
from tiny_mindie.server.sse import sse_event, unsent_bytes, utf8


def _error_body(status: int, message: str, limit: int | None = None) -> bytes:
    """The app's answer body to a request the parser refused (``ANSWERS.rejected``)."""
    answer = ANSWERS.rejected(HTTPError(status, message, limit))
    assert answer.status == status and answer.content_type == "application/json"
    return answer.body


# Strings json.loads gives for JSON a client may send: lone high / low surrogates, a pair
# split over two strings and joined, a backslash right before one, one in a key.
SURROGATE_TEXTS = [json.loads(s) for s in (
    r'"\ud800"', r'"a\udfffb"', r'"\ud83d"', r'"\\\ud800"', r'"caf\u00e9 \ud800 \u4e2d"')]


@pytest.mark.parametrize("text", SURROGATE_TEXTS)
def test_json_response_escapes_lone_surrogates(text):
    obj = {"error": f"Parameter x must be a number, got {json.dumps(text, ensure_ascii=False)}.",
           text: [text, text + json.loads(r'"\ude00"')]}
    resp = json_response(422, obj)
    assert resp.status == 422
    body = resp.body.decode("utf-8")          # strict: valid UTF-8
    # the same JSON as all-ASCII escaping gives (a joined pair reads back as one character)
    assert json.loads(body) == json.loads(json.dumps(obj))
    assert json.loads(body)["error"] == obj["error"]


def test_json_response_keeps_other_text_as_utf8():
    resp = json_response(200, {"t": "caf\u00e9 \u4e2d \U0001f600", "e": "\\ud800"})
    assert resp.body == '{"t":"caf\u00e9 \u4e2d \U0001f600","e":"\\\\ud800"}'.encode()


def test_sse_event_and_error_body_escape_lone_surrogates():
    text = SURROGATE_TEXTS[0]
    data = json.dumps({"text": text + "\n" + text}, ensure_ascii=False, separators=(",", ":"))
    raw = sse_event(data)
    assert raw == b'data: {"text":"\\ud800\\n\\ud800"}\n\n'
    assert json.loads(raw.decode("utf-8")[len("data: "):]) == {"text": text + "\n" + text}
    assert (json.loads(_error_body(400, "bad " + text).decode("utf-8"))["error"]
            == "bad " + text)
    assert utf8("\ud800") == b"\\ud800" and utf8("\u00e9") == "\u00e9".encode()


@pytest.mark.parametrize("status, error_type", [
    (400, "Bad Request"), (408, "Request Timeout"), (414, "Request-URI Too Long"),
    (417, "Expectation Failed"), (431, "Request Header Fields Too Large"),
    (501, "Not Implemented"), (505, "HTTP Version Not Supported")])
def test_parser_error_bodies_name_their_status(status, error_type):
    assert json.loads(_error_body(status, "why")) == {"error": "why", "error_type": error_type}
    assert json.loads(_error_body(413, "why", limit=2**20)) == {
        "message": "Request body too large. Maximum allowed size is 1MB."}
    assert json.loads(_error_body(413, "why", limit=2**19)) == {
        "message": "Request body too large. Maximum allowed size is 0.5MB."}


def test_config_reads_max_stream_backlog(tmp_path):
    path = tmp_path / "config.json"
    assert load_config(None).server.max_stream_backlog_kb == 64
    path.write_text(json.dumps({"ServerConfig": {"maxStreamBacklogKB": 0}}))
    assert load_config(str(path)).server.max_stream_backlog_kb == 0
    path.write_text(json.dumps({"ServerConfig": {"maxStreamBacklogKB": -1}}))
    with pytest.raises(ConfigError, match="maxStreamBacklogKB must be in 0..1048576 KB, got -1"):
        load_config(str(path))


# ---- a client that stops reading ---------------------------------------------------------

CHUNK = b"data: " + b"x" * 994 + b"\n\n"     # 1000 bytes


class StreamServer(ThreadedServer):
    """serve_connection in a background thread; ``GET /stream?limit=N&n=M&pause=S`` streams M
    chunks of 1000 bytes, S seconds apart (as fast as the connection takes them by default),
    under a backlog limit of N bytes (none when absent), and records how each stream ended.
    ``&paced=B``: before each chunk, wait until the client has at most B bytes unread (a client
    that keeps reading, however slowly the host schedules it)."""

    def __init__(self, loop: str) -> None:
        super().__init__(loop, max_body_bytes=1024, idle_timeout=30)
        self.ended: list[tuple[str, int]] = []    # (how, bytes sent)
        self.done = threading.Event()

    async def handler(self, request, stream):
        limit = request.query.get("limit")
        stream.max_backlog = int(limit) if limit else None
        pause = float(request.query.get("pause", "0"))
        paced = request.query.get("paced")
        out = await stream.start()
        try:
            for _ in range(int(request.query.get("n", "100000"))):
                while paced is not None and out.backlog > int(paced):
                    await asyncio.sleep(0.001)
                await out.send(CHUNK)
                await asyncio.sleep(pause)
        except ConnectionError as exc:
            self.ended.append((type(exc).__name__, out.bytes_sent))
            self.done.set()
            raise
        self.ended.append(("complete", out.bytes_sent))
        self.done.set()
        return None

    def non_reader(self, target: str) -> socket.socket:
        """A client with a small receive buffer that sends one request and reads nothing."""
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", self.port))
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        return sock


@pytest.fixture(params=["asyncio", "uvloop"])
def stream_server(request):
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    with StreamServer(request.param) as srv:
        yield srv


@pytest.mark.skipif(not hasattr(socket, "SO_RCVBUF"), reason="needs SO_RCVBUF")
def test_a_client_that_stops_reading_is_cut_off_at_the_backlog_limit(stream_server):
    limit = 16 * 1024
    start = time.monotonic()
    with stream_server.non_reader(f"/stream?limit={limit}") as sock:
        assert stream_server.done.wait(10), "the stream was not cut off"
        how, sent = stream_server.ended[-1]
        # the kernel took what the client's small buffer holds plus the limit, then no more
        assert how == "ConnectionAbortedError"
        assert limit < sent < limit + 256 * 1024, sent
        assert time.monotonic() - start < 5
        # and the connection was reset, not left to linger with its unread bytes
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass


def test_without_a_limit_the_kernel_absorbs_far_more(stream_server):
    """What the limit saves: the same non-reading client, no limit, takes a megabyte while
    the stream still runs (the kernel's send buffer grows for it)."""
    with stream_server.non_reader("/stream?n=1000"):
        deadline = time.monotonic() + 10
        while not stream_server.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert stream_server.ended and stream_server.ended[-1] == ("complete", 1000 * len(CHUNK))


def test_a_reading_client_is_never_cut_off(stream_server):
    """A client with the same small buffer that reads as the events come is not cut off,
    however long it runs: the stream is paced to keep it within half the limit whatever the
    host's load, so only a miscount of its unread bytes could cut it off."""
    n = 1000
    with stream_server.non_reader(f"/stream?limit=8192&n={n}&paced=4096") as sock:
        sock.settimeout(10)
        tail = b""
        while not tail.endswith(b"\r\n0\r\n\r\n"):     # the last chunk
            data = sock.recv(65536)
            assert data, "the server closed the stream"
            tail = (tail + data)[-16:]
    assert stream_server.done.wait(5)
    assert stream_server.ended[-1] == ("complete", n * len(CHUNK))


def test_unsent_bytes_counts_the_kernel_send_queue():
    """On Linux the socket's send queue counts: bytes a non-reading peer has not taken."""
    async def main():
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda r, w: accepted.set_result(w), "127.0.0.1", 0)
        peer = socket.socket()
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        peer.connect(("127.0.0.1", server.sockets[0].getsockname()[1]))
        writer = await accepted
        assert unsent_bytes(writer.transport) == 0
        writer.write(b"x" * 200_000)
        await asyncio.sleep(0.2)
        left = unsent_bytes(writer.transport)
        peer.close()
        writer.transport.abort()
        server.close()
        return left
    left = asyncio.run(main())
    assert 200_000 - 64 * 1024 < left <= 200_000


# --- JSON bodies: bounded, and parsed off the event loop ----------------------------------------

def test_a_body_of_too_many_json_values_is_refused_before_parsing(monkeypatch):
    """A legal body of millions of ``{}`` costs tens of bytes a value once parsed, and
    json.loads holds the GIL: refused (422, on every route) on its bytes alone."""
    from tiny_mindie.api import validate
    from tiny_mindie.api.errors import Kind

    body = b"[" + b"{}," * validate.MAX_JSON_VALUES + b"{}]"
    monkeypatch.setattr(validate.json, "loads", lambda *a, **k: pytest.fail("parsed"))
    with pytest.raises(validate.APIError) as info:
        validate.parse_json_object(body)
    assert info.value.kind is Kind.INVALID and info.value.status == 422
    assert info.value.message == ("Failed to parse request context to json: more than "
                                  f"{validate.MAX_JSON_VALUES} values")


def test_commas_and_brackets_inside_strings_are_not_json_values():
    from tiny_mindie.api import validate

    text = "a,[{" * (validate.MAX_JSON_VALUES // 2)
    assert validate.json_values(json.dumps({"inputs": text}).encode()) == 1     # its "{"
    assert validate.parse_json_object(json.dumps({"inputs": text}).encode()) == {"inputs": text}
    ids = list(range(1 << 20))              # a token-id prompt of maxInputTokenLen's top
    assert validate.parse_json_object(json.dumps({"input_id": ids}).encode())["input_id"] == ids


def test_read_json_object_parses_in_a_worker_thread(monkeypatch):
    from tiny_mindie.api import validate

    threads = []
    real = validate.parse_json_object
    monkeypatch.setattr(validate, "parse_json_object",
                        lambda body: threads.append(threading.current_thread()) or real(body))
    assert asyncio.run(validate.read_json_object(b'{"a": 1}')) == {"a": 1}
    assert threads and threads[0] is not threading.main_thread()


def test_no_route_handler_parses_a_json_body_on_the_event_loop():
    """Every coroutine of the API families reads a body with read_json_object (a worker thread)
    or hands a synchronous parser to a thread, never parse_json_object itself."""
    import ast
    import pathlib

    import tiny_mindie.api as api

    found = []
    for path in sorted(pathlib.Path(api.__file__).parent.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, ast.AsyncFunctionDef):
                found += [f"{path.name}:{node.lineno}" for node in ast.walk(fn)
                          if isinstance(node, ast.Call)
                          and getattr(node.func, "id", None) in ("parse_json_object",
                                                                 "parse_infer")]
    assert not found, found
