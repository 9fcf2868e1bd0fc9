"""server/routing.py's Router on a real socket: 404, 405 with Allow, HEAD as GET, planes, and a
handler's RouteError answered in the body shape the application gives (no API family here)."""

from __future__ import annotations

import http.client
import json

from helpers import ThreadedServer

from tiny_mindie.server.conn import json_response
from tiny_mindie.server.routing import BUSINESS, MANAGEMENT, Route, RouteError, Router


class Teapot(RouteError):
    status, headers = 418, [("X-Why", "tea")]

    def body(self) -> dict:
        return {"oops": "short and stout"}


async def hello(req, stream, params):
    return json_response(200, {"hello": params.get("name", "")})


async def fails(req, stream, params):
    raise Teapot


ROUTER = Router([Route("GET", "/hello/{name}", BUSINESS, hello),
                 Route("POST", "/hello/{name}", BUSINESS, hello),
                 Route("GET", "/fails", BUSINESS, fails),
                 Route("GET", "/health", MANAGEMENT, hello)],
                lambda status, message: {"status": status, "message": message})


class BusinessPlane(ThreadedServer):
    def __init__(self) -> None:
        super().__init__(max_body_bytes=1024)
        self.handler = ROUTER.handler_for(frozenset({BUSINESS}))


def ask(port: int, method: str, path: str) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_router_dispatches_by_path_method_and_plane():
    with BusinessPlane() as srv:
        status, _, body = ask(srv.port, "GET", "/hello/ann")
        assert (status, json.loads(body)) == (200, {"hello": "ann"})
        status, headers, body = ask(srv.port, "HEAD", "/hello/ann")
        assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0
        status, headers, body = ask(srv.port, "DELETE", "/hello/ann")
        assert (status, headers["Allow"]) == (405, "GET, POST")
        assert json.loads(body) == {"status": 405, "message": "Method DELETE is not allowed for "
                                                              "/hello/ann; use GET, POST"}
        for path in ("/hello/", "/nowhere", "/health"):   # /health: another plane's route
            status, _, body = ask(srv.port, "GET", path)
            assert (status, json.loads(body)) == (404, {"status": 404,
                                                        "message": f"Route {path} not found"})
        status, headers, body = ask(srv.port, "GET", "/fails")
        assert (status, headers["X-Why"], json.loads(body)) == (418, "tea",
                                                               {"oops": "short and stout"})


# ---- the access record ---------------------------------------------------------------------

async def generates(req, stream, params):
    """Stands for a generation route: what api/drive.py adds to the access record."""
    stream.record.first_token_out()
    stream.record.count("prompt_tokens", 7)
    stream.record.count("generated_tokens", 3)
    stream.record.keep_output("the output")
    if params["how"] == "gone":
        raise ConnectionResetError("client left")
    if params["how"] == "bug":
        raise RuntimeError("a bug")
    return json_response(200, {})


def access_records(caplog) -> list:
    return [r for r in caplog.records if r.name == "tiny_mindie.access"]


def test_access_record_per_request_however_it_ends(caplog):
    """Answered, abandoned (the handler meets a gone client) and failed requests each get one
    record with their request id, route template, status, outcome and counts; the request
    body and output only with log_bodies."""
    import logging

    router = Router([Route("POST", "/gen/{how}", BUSINESS, generates)],
                    lambda status, message: {"message": message})

    class Plane(ThreadedServer):
        def __init__(self) -> None:
            super().__init__(max_body_bytes=1024)
            self.handler = router.handler_for(frozenset({BUSINESS}))

    def post(port, how, rid):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", f"/gen/{how}", body=b'{"prompt": "private"}',
                     headers={"X-Request-Id": rid})
        try:
            resp = conn.getresponse()
            return resp.status, resp.getheader("X-Request-Id")
        finally:
            conn.close()

    with caplog.at_level(logging.INFO, logger="tiny_mindie.access"), Plane() as srv:
        assert post(srv.port, "ok", "r-ok") == (200, "r-ok")
        assert post(srv.port, "bug", "r-bug") == (500, "r-bug")
        try:
            post(srv.port, "gone", "r-gone")   # the server drops the connection
        except (ConnectionError, http.client.HTTPException):
            pass
        router.log_bodies = True
        assert post(srv.port, "ok", "r-text") == (200, "r-text")
    recs = {r.fields["request_id"]: r for r in access_records(caplog)}
    assert set(recs) == {"r-ok", "r-bug", "r-gone", "r-text"}
    ok = recs["r-ok"].fields
    assert (ok["route"], ok["path"], ok["status"], ok["outcome"]) == \
        ("/gen/{how}", "/gen/ok", 200, "success")
    assert (ok["prompt_tokens"], ok["cached_tokens"], ok["generated_tokens"]) == (7, 0, 3)
    assert 0 <= ok["ttft_ms"] <= ok["total_ms"] and ok["client"] is None
    assert ok["peer"].startswith("127.0.0.1:")
    assert "request_body" not in ok and "output" not in ok
    assert "private" not in recs["r-ok"].getMessage()
    assert (recs["r-bug"].fields["status"], recs["r-bug"].fields["outcome"]) == (500, "internal")
    assert (recs["r-gone"].fields["status"], recs["r-gone"].fields["outcome"]) == \
        (None, "cancelled")
    text = recs["r-text"].fields
    assert (text["request_body"], text["output"]) == ('{"prompt": "private"}', ["the output"])
    assert recs["r-ok"].getMessage().startswith('"POST /gen/ok" 200 ')
    assert recs["r-ok"].getMessage().endswith(" id=r-ok prompt_tokens=7 generated_tokens=3")


def test_one_outcome_per_request_for_the_access_record_and_its_listeners(caplog):
    """A failure the handler reports wins over the answer it gives; the router's own 404 is
    a refusal (validation); each word is the access record's outcome, shown after the status
    in its line, and what the record's ``ended`` listeners (the /metrics counter) get, once."""
    import logging

    ended: list[tuple[str, str]] = []

    async def timed_out(req, stream, params):
        rec = stream.record
        rec.ended.append(lambda outcome: ended.append((rec.request_id, outcome)))
        rec.report("success")          # one generation finished ...
        rec.report("timeout")          # ... another did not: the failure wins
        rec.report("success")
        return json_response(200, {})

    router = Router([Route("GET", "/late", BUSINESS, timed_out)],
                    lambda status, message: {"message": message})

    class Plane(ThreadedServer):
        def __init__(self) -> None:
            super().__init__(max_body_bytes=1024)
            self.handler = router.handler_for(frozenset({BUSINESS}))

    def get(port, path, rid):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", path, headers={"X-Request-Id": rid})
            return conn.getresponse().status
        finally:
            conn.close()

    with caplog.at_level(logging.INFO, logger="tiny_mindie.access"), Plane() as srv:
        assert get(srv.port, "/late", "r-late") == 200
        assert get(srv.port, "/nowhere", "r-404") == 404
    recs = {r.fields["request_id"]: r for r in access_records(caplog)}
    assert (recs["r-late"].fields["status"], recs["r-late"].fields["outcome"]) == (200, "timeout")
    assert recs["r-late"].getMessage().startswith('"GET /late" 200 timeout ')
    assert (recs["r-404"].fields["status"], recs["r-404"].fields["outcome"]) == \
        (404, "validation")
    assert recs["r-404"].getMessage().startswith('"GET /nowhere" 404 validation ')
    assert ended == [("r-late", "timeout")]


def test_a_request_the_server_cancels_is_stopped(caplog):
    """A handler cancelled by the server (the loop's end after a drain) is ``stopped``, even
    when its generation reported that it was closed early; no status was sent."""
    import asyncio
    import logging
    import types

    started = asyncio.Event()

    async def forever(req, stream, params):
        stream.record.report("cancelled")       # what a generation closed early reports
        started.set()
        await asyncio.Event().wait()

    handle = Router([Route("GET", "/wait", BUSINESS, forever)],
                    lambda status, message: {}).handler_for(frozenset({BUSINESS}))
    req = types.SimpleNamespace(method="GET", path="/wait", target="/wait", body=b"")
    stream = types.SimpleNamespace(request_id="r-cut", max_backlog=None, started=False,
                                   status=None, client_subject=None, peer=None,
                                   peer_gone=lambda: False)

    async def main():
        task = asyncio.ensure_future(handle(req, stream))
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="tiny_mindie.access"):
        asyncio.run(main())
    (rec,) = access_records(caplog)
    assert (rec.fields["status"], rec.fields["outcome"]) == (None, "stopped")
    assert rec.getMessage().startswith('"GET /wait" - stopped ')
