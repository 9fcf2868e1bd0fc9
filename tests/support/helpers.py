"""Helpers for the end-to-end tests: start a real ``python -m tiny_mindie`` server process and
talk to it over mutual TLS.

Shared here, not in a test module, so that no test module imports another (each may be run alone
or in any order). The ``server`` fixture in conftest.py starts one :class:`Server` per session;
tests that stop a server start their own with :func:`start_server` and :data:`TEST_CONFIG`.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

# ---- a server process ------------------------------------------------------------------------


@dataclass
class Server:
    """A running ``python -m tiny_mindie`` process and how to reach it."""

    proc: subprocess.Popen
    port: int
    home: str
    banner: str
    config_path: str

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def tls(self):
        """The server's TLS files, resolved the way the server resolves them."""
        from tiny_mindie.config.load import load_config
        from tiny_mindie.config.tls import tls_files
        return tls_files(load_config(self.config_path))

    @property
    def ca(self) -> str:
        return self.tls.ca[0]

    @property
    def client_cert(self) -> str:
        return self.tls.client_cert

    @property
    def client_key(self) -> str:
        return self.tls.client_key

    def ssl_context(self) -> ssl.SSLContext:
        from tiny_mindie.server.tls import client_context
        return client_context(self.tls)


TEST_CONFIG = {
    "ServerConfig": {"ipAddress": "127.0.0.1", "managementIpAddress": "127.0.0.1", "port": 0,
                     "managementPort": 0, "metricsPort": 0, "httpsEnabled": True,
                     "tokenTimeout": 600, "e2eTimeout": 600, "maxRequestLength": 1},
    "BackendConfig": {"npuDeviceIds": [[0]], "kvCacheMB": 512,
                      "ModelDeployConfig": {
                          "maxSeqLen": 1024, "maxInputTokenLen": 512,
                          "ModelConfig": [{"modelName": "smollm2-135m-instruct",
                                           "modelWeightPath": "smollm2-135m-instruct"}]},
                      "ScheduleConfig": {"maxPrefillTokens": 512, "maxPrefillBatchSize": 8,
                                         "maxBatchSize": 8, "maxIterTimes": 256}},
}


def serving(srv: Server):
    """For a fixture: keep reading ``srv``'s output into ``srv.log`` (so the pipe never fills
    up), yield it, then stop it (SIGTERM; killed after 20 s)."""
    srv.log = []
    threading.Thread(target=lambda: srv.log.extend(iter(srv.proc.stdout.readline, "")),
                     daemon=True).start()
    try:
        yield srv
    finally:
        srv.proc.terminate()
        try:
            srv.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            srv.proc.kill()


def start_server(home: str, config: dict, extra_args: list[str] = (),
                 timeout: float = 180, env: dict | None = None) -> Server:
    """Start the server from a config file in ``home`` and wait for its banner; ``env``: more
    environment variables for it (``TINY_MINDIE_*`` settings)."""
    path = os.path.join(home, "config.json")
    with open(path, "w") as fh:
        json.dump(config, fh)
    proc = subprocess.Popen([sys.executable, "-m", "tiny_mindie", "--config", path, *extra_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=home,
                            env={**os.environ, **env} if env else None)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith('{"') and "try it:" in line:    # --log-format json: one record
            line = json.loads(line)["message"]
            lines.append(line)
            port = int(re.search(r"listens\s+https?://127\.0\.0\.1:(\d+)", line).group(1))
            return Server(proc, port, home, "".join(lines), path)
        lines.append(line)
        if line.startswith("try it:"):
            lines.extend(proc.stdout.readline() for _ in range(3))
            banner = "".join(lines)
            port = int(re.search(r"listens\s+https?://127\.0\.0\.1:(\d+)", banner).group(1))
            return Server(proc, port, home, banner, path)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines))


def debian_binary(name: str, package: str) -> str:
    """The path of the program ``name`` (from the Debian package ``package``, which ``.ci/run``
    installs). Skips the test when it is missing here -- fails it in CI (``$CI`` set), where a
    missing tool must not pass unnoticed."""
    import pytest

    path = shutil.which(name)
    if path is None:
        why = f"{name} not found (Debian package {package}; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


# ---- requests --------------------------------------------------------------------------------

SEED_PARAMS = {"temperature": 0.5, "top_k": 10, "top_p": 0.95, "max_new_tokens": 20,
               "do_sample": True, "seed": None, "repetition_penalty": 1.03, "details": True,
               "typical_p": 0.5, "watermark": False, "priority": 5, "timeout": 10}


def seed_body(stream: bool, **params) -> dict:
    """MindIE's documented ``/infer`` example request, with ``params`` overriding its parameters."""
    return {"inputs": "My name is Olivier and I", "stream": stream,
            "parameters": {**SEED_PARAMS, **params}}


def request(server, method: str, path: str, body=None, headers=None, ctx=None):
    """One request with Python's http.client over TLS; returns (status, headers, body bytes)."""
    conn = http.client.HTTPSConnection("127.0.0.1", server.port,
                                       context=ctx or server.ssl_context(), timeout=120)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data,
                 headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def sse_events(raw: bytes) -> list[dict]:
    """Parse an SSE body into the JSON objects of its ``data:`` lines."""
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: "):]))
    return events


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """The server closed ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def wait_until(condition, within: float = 30, what: str = "the condition") -> None:
    """Poll ``condition()`` until it is true; fail after ``within`` seconds, a bound for a hang
    only (how soon it turns true is the test's business, never a speed to assert)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within} s"
        time.sleep(0.02)


# ---- serve_connection in-process, on a real socket ---------------------------------------------


class ThreadedServer:
    """``serve_connection(reader, writer, self.handler, ConnectionLimits(**limits), answers=)``
    for every connection to a 127.0.0.1 port, on an event loop (``"asyncio"`` or ``"uvloop"``)
    in a background thread; a context manager. Subclasses define ``async handler(request,
    stream)``. ``ssl_context``: the server's, for TLS (``None``: plain TCP); ``answers``: the
    :class:`~tiny_mindie.server.conn.ErrorAnswers` (``None``: the default)."""

    def __init__(self, loop: str = "asyncio", ssl_context=None, answers=None, **limits) -> None:
        self.loop_kind = loop
        self.ssl_context = ssl_context
        self.serve_kw = {"answers": answers} if answers is not None else {}
        self.limits = limits
        self.connections = 0
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def handler(self, request, stream):
        raise NotImplementedError

    def _run(self) -> None:
        if self.loop_kind == "uvloop":
            import uvloop
            uvloop.run(self._main())
        else:
            asyncio.run(self._main())

    async def _main(self) -> None:
        from tiny_mindie.server.conn import ConnectionLimits, serve_connection

        limits = ConnectionLimits(**self.limits)
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()

        async def on_connection(reader, writer):
            self.connections += 1
            try:
                await serve_connection(reader, writer, self.handler, limits, **self.serve_kw)
            except asyncio.CancelledError:
                pass   # shutdown; Python 3.11's start_server callback would log a cancelled task

        server = await asyncio.start_server(on_connection, "127.0.0.1", 0, ssl=self.ssl_context)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)



# ---- certificates -------------------------------------------------------------------------------


def make_ca(path: str, key_path: str, cn: str, issuer: tuple | None = None,
            valid: tuple[float, float] = (-1, 30)) -> tuple:
    """A CA certificate and key written as PEM: a root (no limit on the CAs under it) when
    ``issuer`` is None, else an intermediate (path length 0) signed by ``issuer`` =
    (certificate, key); valid from ``valid[0]`` to ``valid[1]`` days from now. Returns
    (certificate, key), ``cryptography`` objects."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    signer_cert, signer_key = issuer or (None, key)
    cert = (x509.CertificateBuilder().subject_name(name)
            .issuer_name(signer_cert.subject if signer_cert else name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now + datetime.timedelta(days=valid[0]))
            .not_valid_after(now + datetime.timedelta(days=valid[1]))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None if issuer is None
                                                 else 0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(signer_key, hashes.SHA256()))
    with open(path, "wb") as fh:
        fh.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return cert, key


def make_chain_pki(d: str) -> dict:
    """In folder ``d``: a root CA (``root.pem``/``.key``), an intermediate CA under it
    (``inter``), a client certificate of the intermediate (``leaf``; ``chain.pem`` holds the
    client's certificate, then the intermediate's), a server certificate of the root for
    localhost and 127.0.0.1 (``server``); the CRLs of both CAs (``root.crl``, ``inter.crl``) and
    one of the root revoking the intermediate (``revoked-inter.crl``). Returns the root's and the
    intermediate's certificates and the client's serial: ``{"root", "inter", "leaf_serial"}``."""
    from tiny_mindie.server.tls import issue_certificate, issue_crl

    root = make_ca(f"{d}/root.pem", f"{d}/root.key", "root CA")
    inter = make_ca(f"{d}/inter.pem", f"{d}/inter.key", "intermediate CA", root)
    issue_certificate(f"{d}/root.pem", f"{d}/root.key", f"{d}/server.pem", f"{d}/server.key",
                      "localhost", hosts=("localhost", "127.0.0.1"))
    serial = issue_certificate(f"{d}/inter.pem", f"{d}/inter.key", f"{d}/leaf.pem",
                               f"{d}/leaf.key", "chained client")
    with open(f"{d}/chain.pem", "wb") as fh:
        for part in ("leaf", "inter"):
            with open(f"{d}/{part}.pem", "rb") as src:
                fh.write(src.read())
    issue_crl(f"{d}/root.crl", f"{d}/root.pem", f"{d}/root.key")
    issue_crl(f"{d}/inter.crl", f"{d}/inter.pem", f"{d}/inter.key")
    issue_crl(f"{d}/revoked-inter.crl", f"{d}/root.pem", f"{d}/root.key", (f"{d}/inter.pem",))
    return {"root": root[0], "inter": inter[0], "leaf_serial": serial}


def chained_client(d: str) -> ssl.SSLContext:
    """A client context of :func:`make_chain_pki`'s folder ``d``: trusts the root, presents the
    intermediate's client with its chain."""
    ctx = ssl.create_default_context(cafile=f"{d}/root.pem")
    ctx.load_cert_chain(f"{d}/chain.pem", f"{d}/leaf.key")
    return ctx

@contextlib.contextmanager
def openai_client(server, timeout: float = 120):
    """The official ``openai`` SDK's client for ``server`` over mutual TLS (the server's CA and
    client certificate), no retries; closed on exit."""
    import openai

    try:   # the openai package moved from httpx to httpx2
        import httpx2 as httpx
    except ImportError:   # pragma: no cover
        import httpx
    http_client = httpx.Client(verify=server.ssl_context(), timeout=timeout)
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", http_client=http_client,
                            max_retries=0)
    finally:
        http_client.close()


@contextlib.contextmanager
def anthropic_client(server, timeout: float = 120):
    """The official ``anthropic`` SDK's client for ``server`` over mutual TLS, no retries;
    closed on exit."""
    import anthropic
    import httpx2

    http_client = httpx2.Client(verify=server.ssl_context(), timeout=timeout)
    try:
        yield anthropic.Anthropic(base_url=server.url, api_key="x", http_client=http_client,
                                  max_retries=0)
    finally:
        http_client.close()


def access_line(server, request_id: str, within: float = 30) -> str:
    """The text access log line of ``request_id`` in ``server.log`` (waits for it)."""
    wait_until(lambda: any(f" id={request_id}" in line for line in server.log), within,
               f"the access line of {request_id}")
    return next(line for line in server.log if f" id={request_id}" in line).strip()


# ---- a vocabulary of bytes -------------------------------------------------------------------
def byte_tokenizer():
    """A :class:`~tiny_mindie.model.tokenizer.Tokenizer` of byte tokens 0..255 and ``</s>``
    (256), the end of generation: each byte its token (grammars walked byte by byte)."""
    from tiny_mindie.model.tokenizer import TOKEN_CONTROL, TOKEN_NORMAL, Tokenizer, Vocabulary

    class ByteTokenizer(Tokenizer):
        def encode(self, text: str, *, add_bos=None, parse_special=True,
                   space_prefix=True) -> list[int]:
            return list(text.encode("utf-8"))

    vocab = Vocabulary(tokens=[f"<0x{i:02X}>" for i in range(256)] + ["</s>"],
                       types=[TOKEN_NORMAL] * 256 + [TOKEN_CONTROL], bos_id=None, eos_id=256,
                       eog_ids=frozenset({256}))
    return ByteTokenizer(vocab, kind="llama", token_bytes=[bytes([i]) for i in range(256)] + [b""],
                         add_bos=False, chat_template=None)
