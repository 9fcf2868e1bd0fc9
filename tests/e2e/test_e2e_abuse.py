"""What a breaker sends, against the real server: bodies built to make a scan quadratic, and
legal bodies of the costliest JSON, each answered (4xx) in time growing with its size and never
with its square, while another client's ``/health`` is answered in the middle of them."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time

import pytest
from helpers import request

LIMIT = 1 << 20        # the test config's maxRequestLength: 1 MB


def _fit(unit: bytes, size: int) -> bytes:
    return unit * (size // len(unit))


FAMILIES = {
    "quote-bracket": lambda n: _fit(b'\\"[', n),
    "escaped quotes": lambda n: b'{"inputs":"' + _fit(b'\\"', n - 14) + b'"}',
    "unterminated": lambda n: b'{"inputs":"' + _fit(b"[{,:\\", n - 11),
    "deep": lambda n: _fit(b"[", n),
    "long number": lambda n: b'{"inputs":1.' + _fit(b"9", n - 14) + b"}",
    "many keys": lambda n: b"{" + b",".join(b'"k%07d":0' % i for i in range(n // 13)) + b"}",
    "many commas": lambda n: b"[" + _fit(b",", n - 2) + b"]",
}


def _seconds(server, body: bytes) -> float:
    start = time.perf_counter()
    status, _, raw = request(server, "POST", "/infer", body)
    assert 400 <= status < 500 and json.loads(raw), (status, raw[:200])
    return time.perf_counter() - start


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_body_is_answered_in_time_linear_in_its_size(server, family):
    """10 KB, 100 KB and the body limit: each tenfold size at most ~tenfold time (and the
    connection's own cost keeps the small ones from being any faster), well under the
    hundredfold a quadratic scan takes."""
    make = FAMILIES[family]
    small, mid, big = (statistics.median(_seconds(server, make(n)) for _ in range(3))
                       for n in (10_000, 100_000, LIMIT - 64))
    assert mid / small < 35 and big / mid < 35, (family, small, mid, big)


def _health_during(server, bodies: list[bytes], rounds: int) -> tuple[list[str], list[int]]:
    """Each of ``bodies`` sent ``rounds`` times in a row by its own client, all at once, while
    another client asks ``/health`` on one kept-alive connection until they are done; the
    order of events ("sent", "answered", "health") and the statuses of the bodies."""
    events: list[str] = []
    statuses: list[int] = []
    lock = threading.Lock()
    sent = threading.Barrier(len(bodies) + 1)

    def sender(body: bytes) -> None:
        for r in range(rounds):
            conn = http.client.HTTPSConnection("127.0.0.1", server.port,
                                               context=server.ssl_context(), timeout=120)
            conn.request("POST", "/infer", body=body, headers={"Content-Type": "application/json"})
            with lock:
                events.append("sent")
            if r == 0:
                sent.wait()
            resp = conn.getresponse()
            resp.read()
            conn.close()
            with lock:
                events.append("answered")
                statuses.append(resp.status)

    health = http.client.HTTPSConnection("127.0.0.1", server.port,
                                         context=server.ssl_context(), timeout=120)
    health.request("GET", "/health")
    assert health.getresponse().read() is not None        # connected and kept alive
    threads = [threading.Thread(target=sender, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    sent.wait()                                           # every first body is on its way
    while any(t.is_alive() for t in threads):
        health.request("GET", "/health")
        resp = health.getresponse()
        resp.read()
        with lock:
            events.append("health" if resp.status == 200 else f"health {resp.status}")
    for t in threads:
        t.join()
    health.close()
    return events, statuses


def _answered_in_flight(events: list[str], bodies: int, rounds: int) -> int:
    """How many /health answers came while at least one body was sent and not yet answered."""
    in_flight = count = 0
    for e in events:
        in_flight += {"sent": 1, "answered": -1}.get(e, 0)
        count += e == "health" and in_flight > 0
    assert events.count("answered") == bodies * rounds
    return count


@pytest.mark.parametrize("family", ["quote-bracket", "many keys", "deep"])
def test_health_is_answered_while_bodies_at_the_limit_are_in_flight(server, family):
    body = FAMILIES[family](LIMIT - 64)
    events, statuses = _health_during(server, [body] * 4, rounds=3)
    assert set(statuses) <= {413, 422} and "health" in events
    assert not [e for e in events if e.startswith("health ")], events
    assert _answered_in_flight(events, 4, 3) >= 1, events


def _legal_huge(n: int, seed: int) -> bytes:
    """An object holding as many distinct keys as fit in ``n`` bytes, under the key cap per
    object (so parsed whole), then refused for lacking ``inputs``."""
    keys = [b'"k%d_%07d":0' % (seed, i) for i in range(n // 16)]
    groups = [b"{" + b",".join(keys[i:i + 50_000]) + b"}" for i in range(0, len(keys), 50_000)]
    return b'{"x":[' + b",".join(groups) + b"]}"


def test_four_huge_legal_objects_leave_health_answered(server):
    bodies = [_legal_huge(LIMIT - 64, i) for i in range(4)]
    assert all(len(b) <= LIMIT for b in bodies)
    events, statuses = _health_during(server, bodies, rounds=3)
    assert statuses == [422] * 12                         # parsed, then: no inputs
    assert _answered_in_flight(events, 4, 3) >= 1, events


def test_a_huge_object_over_the_key_cap_is_refused_before_parsing(server):
    status, _, raw = request(server, "POST", "/infer", FAMILIES["many keys"](LIMIT - 64))
    assert status == 422
    assert json.loads(raw)["error"].startswith(
        "Failed to parse request context to json: an object of more than")


@pytest.mark.parametrize("grammar, says", [
    ({"type": "json", "value": "[" * 100_000}, "grammar.value nests deeper than 64 levels"),
    ({"type": "regex", "value": "a*" * 5000},
     "the grammar is too large to enforce: 10000 characters of the regex, at most 8192"),
    ({"type": "json", "value": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "a*" * 100} for i in range(50)}}},
     "the grammar is too large to enforce: 10000 characters of regexes in the schema"),
    ({"type": "json", "value": {"type": "object", "properties": {
        f"p{i:05d}": {"type": "string"} for i in range(3000)}}},
     "characters of the json_schema, at most 65536"),
])
def test_a_grammar_too_costly_to_compile_is_refused_by_its_size(server, grammar, says):
    """Compiling a grammar takes time growing faster than its size; past the caps it is a 422
    at once, and the server answers the next request."""
    status, _, raw = request(server, "POST", "/generate",
                             {"inputs": "hi", "parameters": {"grammar": grammar}})
    assert status == 422 and says in json.loads(raw)["error"], raw
    assert request(server, "GET", "/health")[0] == 200
