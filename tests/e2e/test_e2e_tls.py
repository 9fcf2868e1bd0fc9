"""A real server process against connections that never authenticate: silent sockets beyond
``maxLinkNum`` and beyond the process's descriptors, revoked certificates, and what it logs."""

from __future__ import annotations

import http.client
import json
import os
import re
import resource
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from helpers import (
    TEST_CONFIG,
    Server,
    chained_client,
    closed_by_server,
    make_chain_pki,
    request,
)

from tiny_mindie.config.load import load_config
from tiny_mindie.config.tls import tls_files
from tiny_mindie.server.tls import client_context, issue_certificate

pytestmark = pytest.mark.e2e

HANDSHAKE_TIMEOUT = 1.5


def launch(home: str, server_config: dict, nofile: tuple[int, int] | None = None) -> Server:
    """Start ``python -m tiny_mindie`` on TEST_CONFIG with ``server_config`` over it, the TLS
    files of ``home``/security, and (when given) RLIMIT_NOFILE (soft, hard); its output is kept
    in ``server.log`` by a thread."""
    config = {**TEST_CONFIG, "ServerConfig": {**TEST_CONFIG["ServerConfig"], **server_config}}
    path = os.path.join(home, "config.json")
    with open(path, "w") as fh:
        json.dump(config, fh)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiny_mindie", "--config", path], cwd=home, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)) if nofile else None)
    log: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        log.append(line)
        if line.startswith("try it:"):
            port = int(re.search(r"listens\s+https://127\.0\.0\.1:(\d+)", "".join(log)).group(1))
            threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")),
                             daemon=True).start()
            srv = Server(proc, port, home, "".join(log), path)
            srv.log = log
            return srv
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(log))


def stop(srv: Server) -> None:
    srv.proc.terminate()
    try:
        srv.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


def certs(home: str, *args: str) -> str:
    """``python -m tiny_mindie certs --dir HOME ARGS``; its output."""
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "certs", "--dir", home, *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def pki(home: str):
    """The server's TLS files in ``home``, made as a user makes them (the ``certs`` command), plus
    a second client certificate that the CRL revokes."""
    certs(home)
    certs(home, "--client", "revoked")
    files = tls_files(replace(load_config(None), home=home))
    revoked = replace(files, client_cert=f"{home}/security/certs/revoked.pem",
                      client_key=f"{home}/security/keys/revoked.key.pem")
    assert "(1 revoked;" in certs(home, "--revoke", revoked.client_cert)
    return files, revoked


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with 4 connection slots, a 1.5 s handshake deadline and a CRL."""
    home = str(tmp_path_factory.mktemp("guarded"))
    files, revoked = pki(home)
    srv = launch(home, {"maxLinkNum": 4, "tlsHandshakeTimeout": HANDSHAKE_TIMEOUT})
    srv.revoked = revoked
    yield srv
    stop(srv)


def wait_for_log(srv: Server, needle: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in list(srv.log) if needle in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"{needle!r} not in the server log:\n{''.join(srv.log[-30:])}")


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_silent_sockets_beyond_max_link_num_do_not_lock_out_a_client(guarded):
    silent = [socket.create_connection(("127.0.0.1", guarded.port)) for _ in range(50)]
    try:
        time.sleep(0.3)
        start = len(guarded.log)
        status, _, body = request(guarded, "GET", "/health")
        served = len(guarded.log)
        assert status == 200, body
        assert all(closed_by_server(s, HANDSHAKE_TIMEOUT + 10) for s in silent)
        # served without waiting for a deadline: no handshake had timed out by then
        assert not [line for line in guarded.log[start:served] if "no TLS handshake" in line]
    finally:
        for s in silent:
            s.close()
    wait_for_log(guarded, "connection limit (4) reached: closed the connection from 127.0.0.1:")
    wait_for_log(guarded, f"no TLS handshake within {HANDSHAKE_TIMEOUT:g} s")


def test_revoked_certificate_is_refused_while_a_good_one_is_served(guarded):
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
        request(guarded, "GET", "/health", ctx=client_context(guarded.revoked))
    line = wait_for_log(guarded, "refused TLS client")
    assert "certificate revoked (verify code 23)" in line
    assert "client certificate 'CN=revoked,O=tiny_mindie'" in line
    assert request(guarded, "GET", "/health")[0] == 200


def test_more_silent_sockets_than_the_server_has_descriptors(tmp_path):
    """RLIMIT_NOFILE soft 100, hard 160: the server raises its soft limit to 160, caps its
    connections below that (maxLinkNum is 1000), and 300 silent sockets still leave room for a
    client with a certificate."""
    pki(str(tmp_path))
    srv = launch(str(tmp_path), {"tlsHandshakeTimeout": HANDSHAKE_TIMEOUT}, nofile=(100, 160))
    silent = []
    try:
        assert "open files limit (RLIMIT_NOFILE) raised from 100 to 160" in srv.banner
        cap = int(re.search(r"maxLinkNum 1000 does not fit the open files limit \(160 descriptors, "
                            r"\d+ in use\): at most (\d+) connections", srv.banner).group(1))
        assert 50 < cap < 160
        most = 0
        for _ in range(300):
            silent.append(socket.create_connection(("127.0.0.1", srv.port), timeout=10))
            most = max(most, descriptors(srv.proc.pid))
        time.sleep(0.2)
        most = max(most, descriptors(srv.proc.pid))
        start = len(srv.log)
        assert request(srv, "GET", "/health")[0] == 200
        served = len(srv.log)
        assert not [line for line in srv.log[start:served] if "no TLS handshake" in line]
        assert most < 160, most
        assert not [line for line in srv.log if "accept() failed" in line]
        # /v1/config shows the limit in force (was: the configured 1000)
        status, _, body = request(srv, "GET", "/v1/config")
        assert status == 200 and json.loads(body)["ServerConfig"]["maxLinkNum"] == cap
    finally:
        for s in silent:
            s.close()
        stop(srv)


def test_a_revoked_intermediate_is_named_in_the_refusal_line(tmp_path):
    """The root's CRL revokes the intermediate CA: its client, whose own serial is in no CRL, is
    refused with a line naming the intermediate (subject, serial) before the client; a client of
    the root is served."""
    d = str(tmp_path)
    made = make_chain_pki(d)
    issue_certificate(f"{d}/root.pem", f"{d}/root.key", f"{d}/direct.pem", f"{d}/direct.key",
                      "direct client")
    srv = launch(d, {"tlsCaPath": d, "tlsCaFile": ["root.pem", "inter.pem"],
                     "tlsCert": f"{d}/server.pem", "tlsPk": f"{d}/server.key",
                     "tlsCrlPath": d, "tlsCrlFiles": ["revoked-inter.crl", "inter.crl"]})
    try:
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            request(srv, "GET", "/health", ctx=chained_client(d))
        line = wait_for_log(srv, "refused TLS client")
        inter = made["inter"].serial_number
        assert (f"certificate revoked (verify code 23); failed certificate 'CN=intermediate CA' "
                f"(depth 1 of the chain), serial {inter:x}, issuer 'CN=root CA'; client "
                f"certificate 'CN=chained client,O=tiny_mindie', serial "
                f"{made['leaf_serial']:x}") in line, line
        direct = ssl.create_default_context(cafile=f"{d}/root.pem")
        direct.load_cert_chain(f"{d}/direct.pem", f"{d}/direct.key")
        assert request(srv, "GET", "/health", ctx=direct)[0] == 200
    finally:
        stop(srv)
