"""``python -m tiny_mindie health [live|ready|serving]``: an exec probe (Kubernetes ``exec``, Docker
``HEALTHCHECK``, systemd, a shell) that asks the server on this machine for its health with the
server's own configuration and certificate files.

It reads the configuration as ``serve`` does (``--config``, else ``$TINY_MINDIE_CONFIG``, else
MindIE's ``$MIES_CONFIG_JSON_PATH``; ``--host``, ``--port``, ``--management-port``,
``--no-tls`` or their ``TINY_MINDIE_*`` variables over it), connects to the management listener
(a wildcard listen address is reached on the loopback one) -- over mutual TLS with the client
certificate and key beside the server's (``security.tls_files``), checking the server's
certificate against the CA but not its host name (the probe connects to the listen address,
which a certificate made for a service name need not carry) -- and GETs ``/v2/health/live``,
``/v2/health/ready`` or ``/health``.

Exit status 0 when the answer is 200 (one line on stdout); 1 otherwise -- another status, no
connection, a TLS failure, no answer within ``--timeout`` seconds, a configuration it cannot
read -- with one line on stderr saying why; 2 for a usage error (an unknown check, a bad
option), argparse's convention as in the other commands: the probe itself is misconfigured.
It imports neither numpy nor onnxruntime nor asyncio, so that a probe run often costs little
more than Python's start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import ssl
import sys
import time

from ..config.env import EnvError, env_defaults, env_options
from ..config.settings import add_flags, with_flags

PATHS = {"live": "/v2/health/live", "ready": "/v2/health/ready", "serving": "/health"}
DEFAULT_TIMEOUT_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The probe's arguments (``health``'s, in :mod:`tiny_mindie.cli.main` too)."""
    p.add_argument("check", nargs="?", choices=tuple(PATHS), default="live",
                   help="live: the process serves (GET /v2/health/live, 200 also while the "
                        "model loads); ready: it takes requests now (GET /v2/health/ready: 503 "
                        "while loading, busy or stopping); serving: the model is loaded and the "
                        "server is not stopping (GET /health: 200 also when busy, requests "
                        "queue; Kubernetes readiness). Default live")
    p.add_argument("--config", metavar="FILE",
                   help="the server's config.json (default $TINY_MINDIE_CONFIG, else "
                        "$MIES_CONFIG_JSON_PATH, else the defaults)")
    add_flags(p, only=("--host", "--port", "--management-port", "--no-tls"), helps={
        "--host": "the server's --host ($TINY_MINDIE_HOST)",
        "--port": "the server's --port ($TINY_MINDIE_PORT)",
        "--management-port": "the server's --management-port ($TINY_MINDIE_MANAGEMENT_PORT)",
        "--no-tls": "the server runs with --no-tls ($TINY_MINDIE_NO_TLS=1)"})
    p.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds to wait for the connection and the answer "
                        f"(default {DEFAULT_TIMEOUT_S:g})")


def _seconds(text: str) -> float:
    """``--timeout``: a number of seconds in 0.01..600."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0.01 <= v <= 600:      # NaN fails too
        raise argparse.ArgumentTypeError(f"must be seconds in 0.01..600, got {text!r}")
    return v


class ProbeError(Exception):
    """Why the probe cannot ask: one line."""


def target(args: argparse.Namespace) -> tuple[str, int, ssl.SSLContext | None]:
    """``(host, port, TLS context or None)`` of the server's management listener.

    Raises:
        ProbeError: the configuration cannot be read, names port 0, or the client certificate
            files cannot be loaded.
    """
    from ..config.load import ConfigError, load_config
    from ..config.tls import tls_files

    try:
        cfg = with_flags(load_config(args.config), args)    # as serve's flags do
        s = cfg.server
        files = tls_files(cfg) if s.https_enabled else None
    except ConfigError as exc:
        raise ProbeError(str(exc)) from None
    if s.management_port == 0:
        raise ProbeError("the management port is 0 (any free port) in the configuration: "
                         "give the port the server listens on with --port")
    address = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(s.management_ip_address,
                                                          s.management_ip_address)
    if files is None:
        return address, s.management_port, None
    try:
        ctx = ssl.create_default_context(cafile=files.ca[0])
        ctx.check_hostname = False
        ctx.load_cert_chain(files.client_cert, files.client_key)
    except OSError as exc:        # ssl.SSLError is an OSError
        name = getattr(exc, "filename", None)
        raise ProbeError(f"cannot load the TLS files (CA {files.ca[0]}, client certificate "
                         f"{files.client_cert}, key {files.client_key})"
                         f"{': ' + str(name) if name else ''}: "
                         f"{exc.strerror or getattr(exc, 'reason', None) or exc}") from None
    return address, s.management_port, ctx


def ask(host: str, port: int, ctx: ssl.SSLContext | None, path: str,
        timeout: float) -> tuple[int, str]:
    """GET ``path``: ``(status, what the body says)``.

    Raises:
        ProbeError: no connection, TLS refused, no answer within ``timeout`` seconds.
    """
    where = f"{'https' if ctx else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
    conn = (http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx) if ctx
            else http.client.HTTPConnection(host, port, timeout=timeout))
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        body = resp.read(4096)
    except TimeoutError:
        # a plain-HTTP server never answers a TLS handshake: it waits for a request line
        hint = (" (if the server runs without TLS, httpsEnabled false or --no-tls, give the "
                "probe --no-tls too)") if ctx else ""
        raise ProbeError(f"no answer from {where}{path} within {timeout:g} s{hint}") from None
    except ssl.SSLError as exc:
        why = getattr(exc, "verify_message", None) or exc.reason or str(exc)
        raise ProbeError(f"TLS with {where} failed: {why}") from None
    except (OSError, http.client.HTTPException) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ProbeError(f"cannot reach {where}{path}: {why}") from None
    finally:
        conn.close()
    said = ""
    try:
        obj = json.loads(body)
        if isinstance(obj, dict):
            said = str(obj.get("message") or obj.get("error") or "")
    except ValueError:
        said = body.decode("utf-8", "replace").strip()
    return resp.status, f"{resp.status} {resp.reason}" + (f": {said}" if said else "")


def run(args: argparse.Namespace) -> int:
    """The probe; returns its exit status."""
    t0 = time.monotonic()
    path = PATHS[args.check]
    try:
        host, port, ctx = target(args)
        status, said = ask(host, port, ctx, path, args.timeout)
    except ProbeError as exc:
        print(f"tiny_mindie health: {args.check}: {exc}", file=sys.stderr)
        return 1
    ms = (time.monotonic() - t0) * 1000
    if status != 200:
        print(f"tiny_mindie health: {args.check}: not healthy: GET {path} answered {said}",
              file=sys.stderr)
        return 1
    print(f"{args.check}: {said} ({ms:.0f} ms)")
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad argument: one line (and a pointer to --help), exit status 2, as the CLI's."""

    def error(self, message: str):
        self.exit(2, f"tiny_mindie health: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m tiny_mindie health",
                                description="Exit 0 when the server on this machine answers "
                                            "200 to its health route, else 1 with the reason "
                                            "(2: a usage error).")
    add_arguments(p)
    env_options(p)          # TINY_MINDIE_* as serve's (config/env.py: argparse only, light)
    try:
        p.set_defaults(**env_defaults(p, os.environ))
    except EnvError as exc:       # like a configuration the probe cannot read: status 1
        print(f"tiny_mindie health: {exc}", file=sys.stderr)
        return 1
    return run(p.parse_args(argv))

