"""The listener (server/listen.py) on real sockets and real mutual TLS, in-process: connections
counted from accept, the handshake deadline, revocation, and the log lines of refusals."""

from __future__ import annotations

import asyncio
import datetime
import http.client
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives import serialization
from helpers import chained_client, closed_by_server, make_ca, make_chain_pki, wait_until

from tiny_mindie.server.conn import ConnectionLimits, json_response, serve_connection
from tiny_mindie.server.listen import ConnectionSlots, TCPListener, bind
from tiny_mindie.server.refusal_log import RateLimitedLog, RefusalLogs
from tiny_mindie.server.tls import (
    TLSFiles,
    client_context,
    issue_certificate,
    issue_crl,
    make_certificates,
    server_context,
)

LOOPS = ["asyncio", "uvloop"]
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
        b"{}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with a server pair, a good client, a revoked client (in the CRL) and a CRL."""
    d = str(tmp_path_factory.mktemp("pki"))
    files = TLSFiles(ca=(f"{d}/ca.pem",), cert=f"{d}/server.pem", key=f"{d}/server.key.pem",
                     crls=(f"{d}/crl.pem",), client_cert=f"{d}/client.pem",
                     client_key=f"{d}/client.key.pem")
    make_certificates(files)
    revoked = replace(files, client_cert=f"{d}/revoked.pem", client_key=f"{d}/revoked.key.pem")
    issue_certificate(files.ca[0], files.ca_key, revoked.client_cert, revoked.client_key,
                      "revoked client")
    assert issue_crl(files.crls[0], files.ca[0], files.ca_key, (revoked.client_cert,)) == 1
    return files, revoked


class Listening:
    """A TCPListener serving ``{"ok": true}`` on an event loop of its own thread."""

    def __init__(self, ssl_ctx, limit: int, handshake_timeout: float, loop: str = "asyncio",
                 log_every: float = 60):
        if loop == "uvloop":
            uvloop = pytest.importorskip("uvloop")
            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.slots = ConnectionSlots(limit)
        self.max_open = 0
        ready = threading.Event()

        async def serve(reader, writer):
            self.max_open = max(self.max_open, self.slots.open)
            await serve_connection(reader, writer, ok, ConnectionLimits(max_body_bytes=2**20))

        async def ok(req, stream):
            return json_response(200, {"ok": True})

        async def start():
            self.listener = TCPListener(bind("127.0.0.1", 0, 128), serve, lambda: BUSY,
                                        slots=self.slots, ssl_ctx=ssl_ctx,
                                        handshake_timeout=handshake_timeout,
                                        logs=RefusalLogs(every=log_every))
            self.port = self.listener.sockets[0].getsockname()[1]
            ready.set()

        def run():
            asyncio.set_event_loop(self.loop)
            self.loop.create_task(start())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def stop(self):
        async def shutdown():
            self.listener.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def get(self, ctx, timeout: float = 10.0):
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=ctx, timeout=timeout)
        try:
            conn.request("GET", "/")
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()


def server_side_established(port: int) -> int:
    """Server-side TCP sockets of ``port`` in state ESTABLISHED (accepted or in the backlog),
    as the kernel counts them (/proc/net/tcp)."""
    n = 0
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if int(local.split(":")[1], 16) == port and state == "01":
                n += 1
    return n


def timeouts(records) -> list[str]:
    """The log lines among ``records`` that say a handshake (or first byte) deadline fired."""
    return [r.getMessage() for r in records
            if "no TLS handshake within" in r.getMessage()
            or "no request within" in r.getMessage()]


@pytest.mark.parametrize("loop", LOOPS)
def test_silent_sockets_beyond_the_limit_do_not_lock_out_a_client_with_a_certificate(
        pki, loop, caplog):
    files, _ = pki
    srv = Listening(server_context(files), limit=8, handshake_timeout=2.0, loop=loop)
    silent = []
    try:
        with caplog.at_level(logging.INFO, logger="tiny_mindie.server"):
            t_connect = time.monotonic()
            for _ in range(40):      # 5x the limit, no certificate, not a byte sent
                silent.append(socket.create_connection(("127.0.0.1", srv.port)))
            # the others are closed to make room: before any handshake deadline fired
            wait_until(lambda: server_side_established(srv.port) <= 8, what="room made")
            assert not timeouts(list(caplog.records))
            assert srv.slots.open <= 8
            assert srv.get(client_context(files)) == (200, {"ok": True})
            assert not timeouts(list(caplog.records))           # served before any deadline
            # Every silent socket is closed: most to make room, the last ones at the deadline.
            assert all(closed_by_server(s, 30) for s in silent)
            assert time.monotonic() - t_connect >= 2.0 - 0.1
            wait_until(lambda: not srv.slots.open, what="every slot free")
            assert not srv.slots.handshaking
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "connection limit (8) reached: closed the connection from 127.0.0.1:" in logged
        assert "no TLS handshake within 2 s" in logged
        # One line per kind at most in the window (rate-limited), not one per socket.
        assert sum("connection limit" in r.getMessage() for r in caplog.records) == 1
    finally:
        for s in silent:
            s.close()
        srv.stop()


def test_authenticated_connections_fill_the_slots_then_new_ones_are_closed_at_once(pki, caplog):
    files, _ = pki
    # a handshake deadline far past the waits below: a close within them is the refusal's
    srv = Listening(server_context(files), limit=2, handshake_timeout=60.0)
    ctx = client_context(files)
    held = []
    try:
        for _ in range(2):       # two keep-alive connections past their handshake
            c = http.client.HTTPSConnection("127.0.0.1", srv.port, context=ctx, timeout=5)
            c.request("GET", "/")
            assert c.getresponse().read() == b'{"ok":true}'
            held.append(c)
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            s = socket.create_connection(("127.0.0.1", srv.port))
            assert closed_by_server(s, 30)
            s.close()
        assert "every connection past its handshake: closed the new connection" in caplog.text
        assert srv.slots.established == 2
        held.pop().close()
        wait_until(lambda: srv.slots.established <= 1, what="a slot freed")
        assert srv.get(ctx) == (200, {"ok": True})       # a freed slot serves again
    finally:
        for c in held:
            c.close()
        srv.stop()


@pytest.mark.parametrize("loop", LOOPS)
def test_revoked_certificate_is_refused_and_logged_with_its_subject(pki, loop, caplog):
    files, revoked = pki
    srv = Listening(server_context(files), limit=16, handshake_timeout=5.0, loop=loop)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            assert srv.get(client_context(files)) == (200, {"ok": True})
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                srv.get(client_context(revoked))
            wait_until(lambda: "refused TLS client" in caplog.text, what="the refusal logged")
        line = next(r.getMessage() for r in caplog.records
                    if "refused TLS client" in r.getMessage())
        assert "certificate revoked (verify code 23)" in line
        assert "client certificate 'CN=revoked client,O=tiny_mindie'" in line
        assert srv.get(client_context(files)) == (200, {"ok": True})
    finally:
        srv.stop()


def test_client_without_certificate_is_refused_and_logged(pki, caplog):
    files, _ = pki
    srv = Listening(server_context(files), limit=16, handshake_timeout=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                srv.get(ssl.create_default_context(cafile=files.ca[0]))
            wait_until(lambda: "refused TLS client" in caplog.text, what="the refusal logged")
        assert "refused TLS client 127.0.0.1:" in caplog.text
        assert "peer did not return a certificate" in caplog.text
    finally:
        srv.stop()


def test_expired_crl_warns_at_start_and_every_client_is_refused(pki, tmp_path, caplog):
    files, _ = pki
    now = datetime.datetime.now(datetime.UTC)
    expired = str(tmp_path / "expired_crl.pem")
    issue_crl(expired, files.ca[0], files.ca_key, last_update=now - datetime.timedelta(days=2),
              next_update=now - datetime.timedelta(days=1))
    with caplog.at_level(logging.WARNING, logger="tiny_mindie.tls"):
        ctx = server_context(replace(files, crls=(expired,)))
    assert f"TLS CRL file {expired} expired on" in caplog.text
    assert ("EVERY client certificate of CN=tiny_mindie CA,O=tiny_mindie will be refused"
            in caplog.text)
    srv = Listening(ctx, limit=4, handshake_timeout=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                srv.get(client_context(files))       # the good client: refused, as warned
            wait_until(lambda: "refused TLS client" in caplog.text, what="the refusal logged")
        assert "CRL has expired (verify code 12)" in caplog.text
    finally:
        srv.stop()


def test_rate_limited_log_says_how_many_it_held_back(caplog):
    async def main():
        say = RateLimitedLog(logging.WARNING, every=0.3)
        for i in range(5):
            say(f"event {i}")
        await asyncio.sleep(0.5)
        say("event 5")        # a new window: held until its end
        await asyncio.sleep(0.5)

    with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "event 0", "event 4 (4 like this in the last 0.3 s)",
        "event 5 (1 like this in the last 0.3 s)"]


def spawn_listener(nofile: int, main: str) -> subprocess.Popen:
    """A child Python whose open files limit is ``nofile``, running ``main`` (the body of an
    ``async def main()``, which prints the port; ``TCPListener``, ``ConnectionSlots``,
    ``RefusalLogs``, ``bind``, ``connection_limit`` and a ``serve`` answering 200 ``{"ok": true}``
    in scope) and then waiting 30 s; stdout and stderr piped."""
    script = textwrap.dedent(f"""
        import asyncio, logging, resource
        from tiny_mindie.server.conn import ConnectionLimits, json_response, serve_connection
        from tiny_mindie.server.listen import ConnectionSlots, TCPListener, bind, connection_limit
        from tiny_mindie.server.refusal_log import RefusalLogs
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        resource.setrlimit(resource.RLIMIT_NOFILE, ({nofile}, {nofile}))

        async def ok(req, stream):
            return json_response(200, {{"ok": True}})

        async def serve(reader, writer):
            await serve_connection(reader, writer, ok,
                                   ConnectionLimits(max_body_bytes=1024, idle_timeout=60))

        async def main():
    """) + textwrap.indent(textwrap.dedent(main), "    ") + textwrap.dedent("""
            await asyncio.sleep(30)
        asyncio.run(main())
    """)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_out_of_descriptors_in_accept_is_logged_once_and_the_listener_recovers(tmp_path):
    """A listener whose process may open 40 descriptors, with slots for 1000 connections: accept()
    fails with EMFILE; that is logged once (rate-limited, with a count), the connections wait in
    the backlog, and they are served once descriptors are free again."""
    proc = spawn_listener(40, """
        lst = TCPListener(bind("127.0.0.1", 0, 256), serve, bytes, slots=ConnectionSlots(1000),
                          ssl_ctx=None, handshake_timeout=1, logs=RefusalLogs(every=0.5))
        print(lst.sockets[0].getsockname()[1], flush=True)
    """)
    socks, err_lines = [], []
    reader = threading.Thread(target=lambda: err_lines.extend(iter(proc.stderr.readline, "")),
                              daemon=True)
    reader.start()
    start = time.monotonic()
    try:
        port = int(proc.stdout.readline())
        for _ in range(60):           # more than the process has descriptors
            socks.append(socket.create_connection(("127.0.0.1", port)))
        # EMFILE, again and again, in the accept loop, until a window's summary line is out
        wait_until(lambda: any("like this in the last" in ln for ln in list(err_lines)),
                   what="the summed-up accept() failures")
        for s in socks:
            s.close()
        socks = []
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")    # recovered
        s.close()
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)
        windows = (time.monotonic() - start) / 0.5 + 1     # rate-limit windows it lived through
        reader.join(30)
    err = "".join(err_lines)
    lines = [ln for ln in err.splitlines() if "accept() failed" in ln]
    assert lines and lines[0].startswith("ERROR accept() failed: Too many open files (EMFILE)"), err
    # was "0 descriptors in use": counting them needs a descriptor, and none was left
    assert "every one of the 40 descriptors the open files limit allows in use" in lines[0], err
    assert "new connections wait in the listen backlog" in lines[0]
    # one line and one summary at most per window, not one per failure (one per retry)
    assert len(lines) <= windows + 1, err
    assert any("like this in the last" in ln for ln in lines), err


def plain_get(port: int, timeout: float = 10.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_plain_tcp_silent_sockets_beyond_the_limit_do_not_lock_out_a_client(loop, caplog):
    """--no-tls: a connection holds a slot from accept(); until its first byte it may be closed to
    make room. Was: connections over the limit outside the slots, each holding a descriptor for
    tlsHandshakeTimeout."""
    srv = Listening(None, limit=8, handshake_timeout=2.0, loop=loop)
    silent = []
    try:
        with caplog.at_level(logging.INFO, logger="tiny_mindie.server"):
            t_connect = time.monotonic()
            for _ in range(40):      # 5x the limit, not a byte sent
                silent.append(socket.create_connection(("127.0.0.1", srv.port)))
            # the others are closed to make room: before any first-byte deadline fired
            wait_until(lambda: server_side_established(srv.port) <= 8, what="room made")
            assert not timeouts(list(caplog.records))
            assert srv.slots.open <= 8
            assert plain_get(srv.port) == (200, {"ok": True})
            assert not timeouts(list(caplog.records))           # served before any deadline
            assert all(closed_by_server(s, 30) for s in silent)
            assert time.monotonic() - t_connect >= 2.0 - 0.1      # the last ones at the deadline
            wait_until(lambda: not srv.slots.open, what="every slot free")
            assert not srv.slots.handshaking
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "without sending a byte to admit 127.0.0.1:" in logged
        assert "no request within 2 s" in logged
    finally:
        for s in silent:
            s.close()
        srv.stop()


@pytest.mark.parametrize("loop", LOOPS)
def test_plain_tcp_beyond_busy_slots_gets_a_503_at_once(loop, caplog):
    """Every slot past its first byte: a new connection is answered 503 before it sends anything,
    and closed; one that sends its request at once gets the 503 too (not a reset)."""
    # a first-byte deadline far past the waits below: an answer within them is the refusal's
    srv = Listening(None, limit=2, handshake_timeout=60.0, loop=loop)
    held = []
    try:
        for _ in range(2):       # two keep-alive connections that sent a request
            c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
            c.request("GET", "/")
            assert c.getresponse().read() == b'{"ok":true}'
            held.append(c)
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
            assert answer == BUSY
            s.close()
            for _ in range(20):
                assert plain_get(srv.port) == (503, {})
        assert "every connection past its first byte: answered 503 to the new connection" \
            in caplog.text
        assert srv.slots.established == 2 and not srv.slots.handshaking
        held.pop().close()
        wait_until(lambda: srv.slots.established <= 1, what="a slot freed")
        assert plain_get(srv.port) == (200, {"ok": True})       # a freed slot serves again
    finally:
        for c in held:
            c.close()
        srv.stop()


def test_no_tls_under_a_low_open_files_limit_silent_sockets_leave_room_for_a_client():
    """The reported repro: ulimit -n 200, --no-tls, 400 silent sockets. Was: 201/200 descriptors,
    EMFILE, and a fresh client timed out."""
    proc = spawn_listener(200, """
        slots = ConnectionSlots(connection_limit(1000))
        lst = TCPListener(bind("127.0.0.1", 0, 4096), serve, lambda: b"HTTP/1.1 503 x\\r\\n\\r\\n",
                          slots=slots, ssl_ctx=None, handshake_timeout=600,
                          logs=RefusalLogs(every=1))
        print(lst.sockets[0].getsockname()[1], slots.limit, flush=True)
    """)
    socks = []
    try:
        port, limit = map(int, proc.stdout.readline().split())
        assert 100 < limit < 200
        most = 0
        for i in range(400):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            if i % 50 == 0:
                most = max(most, len(os.listdir(f"/proc/{proc.pid}/fd")))
        time.sleep(0.3)
        most = max(most, len(os.listdir(f"/proc/{proc.pid}/fd")))
        # no first-byte deadline fires in the process's life: served by making room
        assert plain_get(port, timeout=30) == (200, {"ok": True})
        assert most < 200, most
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        err = proc.communicate(timeout=10)[1]
    assert "accept() failed" not in err, err
    assert "without sending a byte to admit" in err, err


def test_rate_limited_log_sums_up_held_events_by_reason(caplog):
    """Was: the last message of the window with the total count, so a revoked alice x3 then a
    self-signed client read "... CN=evil (3 like this)"."""
    async def main():
        say = RateLimitedLog(logging.WARNING, every=0.3)
        for port in (1, 2, 3):
            say(f"refused TLS client 127.0.0.1:{port}: certificate revoked; CN=alice",
                "revoked alice")
        say("refused TLS client 127.0.0.1:4: self signed certificate; CN=evil", "self-signed evil")
        await asyncio.sleep(0.5)
        for i in range(RateLimitedLog.MAX_REASONS + 3):     # more reasons than are kept
            say(f"event {i}", f"reason {i}")
        await asyncio.sleep(0.5)

    with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:2] == [
        "refused TLS client 127.0.0.1:1: certificate revoked; CN=alice",
        "3 more in the last 0.3 s: 2x refused TLS client 127.0.0.1:3: certificate revoked; "
        "CN=alice; 1x refused TLS client 127.0.0.1:4: self signed certificate; CN=evil"]
    kept = "; ".join(f"1x event {i}" for i in range(RateLimitedLog.MAX_REASONS))
    named = "; ".join(f"1x reason {i}" for i in range(RateLimitedLog.MAX_REASONS,
                                                       RateLimitedLog.MAX_REASONS + 3))
    assert lines[2:] == [f"{RateLimitedLog.MAX_REASONS + 3} more in the last 0.3 s: {kept}; "
                         f"{named}"]


def test_rate_limited_log_names_the_kind_of_every_event_past_the_kept_reasons(caplog):
    """Past MAX_REASONS reasons, events are counted by kind and each kind is named; only past
    MAX_KINDS kinds (a bound a fixed set of kinds never reaches) are they "other reasons"."""
    async def main():
        say = RateLimitedLog(logging.WARNING, every=0.3)
        say("first")
        for i in range(RateLimitedLog.MAX_REASONS + 12):
            kind = "certificate revoked" if i % 2 else "unknown ca"
            say(f"refused CN=client{i}: {kind}", f"{kind} CN=client{i}", kind)
        await asyncio.sleep(0.5)
        for i in range(RateLimitedLog.MAX_REASONS + RateLimitedLog.MAX_KINDS + 2):
            say(f"event {i}", f"reason {i}", f"kind {i}")
        await asyncio.sleep(0.5)

    with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[1].endswith("; 6x unknown ca; 6x certificate revoked"), lines[1]
    assert lines[1].count("CN=client") == RateLimitedLog.MAX_REASONS
    last_kind = RateLimitedLog.MAX_REASONS + RateLimitedLog.MAX_KINDS - 1
    assert lines[2].endswith(f"; 1x kind {last_kind}; 2x for other reasons"), lines[2]


def test_a_flood_of_revoked_clients_does_not_hide_another_refusal(pki, caplog):
    files, revoked = pki
    srv = Listening(server_context(files), limit=16, handshake_timeout=5.0, log_every=0.5)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            for ctx in ([client_context(revoked)] * 3
                        + [ssl.create_default_context(cafile=files.ca[0])]):
                with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                    srv.get(ctx)
            wait_until(lambda: "more in the last" in caplog.text, what="the summary line")
        summary = [r.getMessage() for r in caplog.records if "more in the last" in r.getMessage()]
        assert len(summary) == 1, caplog.text
        assert "2x refused TLS client 127.0.0.1:" in summary[0]
        assert "CN=revoked client,O=tiny_mindie" in summary[0]
        assert "1x refused TLS client 127.0.0.1:" in summary[0]
        assert "peer did not return a certificate" in summary[0]
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def chain_pki(tmp_path_factory):
    """:func:`helpers.make_chain_pki`'s files (root, intermediate, a client of the intermediate,
    a server of the root, their CRLs and the root's revoking the intermediate) and its facts."""
    d = str(tmp_path_factory.mktemp("chain"))
    made = make_chain_pki(d)
    files = TLSFiles(ca=(f"{d}/root.pem",), cert=f"{d}/server.pem", key=f"{d}/server.key",
                     crls=(), client_cert=f"{d}/chain.pem", client_key=f"{d}/leaf.key")
    return d, files, made


@pytest.mark.parametrize("cas, crls", [(("root",), ()), (("root", "inter"), ("root", "inter"))])
def test_a_client_chain_through_an_intermediate_ca_is_accepted(chain_pki, cas, crls):
    """The client sends its certificate and the intermediate's; the server trusts the root. With
    CRLs, each CA of the chain has its CRL (and its certificate, which checks the CRL at start)."""
    d, files, _ = chain_pki
    files = replace(files, ca=tuple(f"{d}/{c}.pem" for c in cas),
                    crls=tuple(f"{d}/{c}.crl" for c in crls))
    srv = Listening(server_context(files), limit=4, handshake_timeout=5.0)
    try:
        assert srv.get(chained_client(d)) == (200, {"ok": True})
    finally:
        srv.stop()


def _leaf_only_client(d: str) -> ssl.SSLContext:
    """The intermediate's client sending its own certificate alone (the server holds the
    intermediate's in tlsCaFile)."""
    ctx = ssl.create_default_context(cafile=f"{d}/root.pem")
    ctx.load_cert_chain(f"{d}/leaf.pem", f"{d}/leaf.key")
    return ctx


REVOKED_INTER = ("failed certificate 'CN=intermediate CA' (depth 1 of the chain), "
                 "serial {inter:x}, issuer 'CN=root CA'")


@pytest.mark.parametrize("cas, crls, client, why, failed", [
    (("root", "inter"), ("revoked-inter", "inter"), chained_client,
     "certificate revoked (verify code 23)", REVOKED_INTER),
    (("root", "inter"), ("revoked-inter", "inter"), _leaf_only_client,
     "certificate revoked (verify code 23)", REVOKED_INTER),
    (("root",), ("root",), chained_client,
     "unable to get certificate CRL (verify code 3): every CA of the client's chain, an "
     "intermediate too, needs its CRL in tlsCrlFiles and its certificate in tlsCaFile",
     "no CRL of 'CN=intermediate CA'"),
])
def test_a_chain_is_checked_against_the_crl_of_each_of_its_cas(chain_pki, caplog, cas, crls,
                                                               client, why, failed):
    """A root's CRL revoking the intermediate CA refuses the intermediate's clients, and the line
    names the intermediate (subject, serial), then the client; a chain whose intermediate has no
    CRL is refused with what to add, naming the CA whose CRL is missing."""
    d, files, made = chain_pki
    files = replace(files, ca=tuple(f"{d}/{c}.pem" for c in cas),
                    crls=tuple(f"{d}/{c}.crl" for c in crls))
    srv = Listening(server_context(files), limit=4, handshake_timeout=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                srv.get(client(d))
            time.sleep(0.2)
        line, = [r.getMessage() for r in caplog.records if "refused TLS client" in r.getMessage()]
        named = failed.format(inter=made["inter"].serial_number)
        assert f"{why}; {named}; client certificate 'CN=chained client,O=tiny_mindie', serial " \
               f"{made['leaf_serial']:x}, issuer 'CN=intermediate CA'" in line, line
    finally:
        srv.stop()


def test_a_mixed_matrix_of_refusals_names_every_reason(pki, tmp_path, caplog):
    """More refused clients than the summary keeps by name: the rest are counted by reason,
    never as "other reasons"."""
    files, revoked = pki
    t = str(tmp_path)
    foreign = TLSFiles(ca=(f"{t}/ca.pem",), cert=f"{t}/s.pem", key=f"{t}/s.key", crls=(),
                       client_cert=f"{t}/fc.pem", client_key=f"{t}/fc.key")
    make_certificates(foreign)
    clients = []
    for i in range(RateLimitedLog.MAX_REASONS + 2):     # each of another CA, each its own name
        cert, key = f"{tmp_path}/c{i}.pem", f"{tmp_path}/c{i}.key"
        issue_certificate(foreign.ca[0], foreign.ca_key, cert, key, f"client {i}")
        clients.append(replace(files, client_cert=cert, client_key=key))
    srv = Listening(server_context(files), limit=16, handshake_timeout=5.0, log_every=1.0)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            for ctx in ([client_context(revoked)] + [client_context(c) for c in clients]
                        + [ssl.create_default_context(cafile=files.ca[0])]):
                with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                    srv.get(ctx)
            time.sleep(1.5)
        summary, = [r.getMessage() for r in caplog.records if "more in the last" in r.getMessage()]
        assert "other reasons" not in summary, summary
        assert "; 2x unable to get local issuer certificate (verify code 20)" in summary
        assert "1x peer did not return a certificate" in summary
    finally:
        srv.stop()


def test_a_client_chain_through_an_expired_intermediate_names_the_intermediate(chain_pki, caplog):
    """The client's certificate is valid, the intermediate it sends has expired: the refusal
    line names the intermediate as the certificate that failed."""
    d, files, made = chain_pki
    with open(f"{d}/root.key", "rb") as fh:
        root = (made["root"], serialization.load_pem_private_key(fh.read(), None))
    stale = make_ca(f"{d}/stale.pem", f"{d}/stale.key", "stale CA", root, valid=(-30, -1))[0]
    issue_certificate(f"{d}/stale.pem", f"{d}/stale.key", f"{d}/late.pem", f"{d}/late.key",
                      "late client")
    with open(f"{d}/late-chain.pem", "wb") as fh:
        for part in ("late", "stale"):
            with open(f"{d}/{part}.pem", "rb") as src:
                fh.write(src.read())
    client = ssl.create_default_context(cafile=f"{d}/root.pem")
    client.load_cert_chain(f"{d}/late-chain.pem", f"{d}/late.key")
    srv = Listening(server_context(files), limit=4, handshake_timeout=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="tiny_mindie.server"):
            with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
                srv.get(client)
            time.sleep(0.2)
        line, = [r.getMessage() for r in caplog.records if "refused TLS client" in r.getMessage()]
        assert (f"certificate has expired (verify code 10); failed certificate 'CN=stale CA' "
                f"(depth 1 of the chain), serial {stale.serial_number:x}, issuer 'CN=root CA'; "
                f"client certificate 'CN=late client,O=tiny_mindie'") in line, line
    finally:
        srv.stop()
