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
