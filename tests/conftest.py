"""Shared fixtures: one pulled model and one running server (real process, real TLS) per session."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTDATA = os.environ.get("TINY_MINDIE_TESTDATA",
                          os.path.join(os.path.dirname(REPO), "shared", "testdata"))


@pytest.fixture(scope="session")
def model_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1), pulled on first use."""
    from tiny_mindie.model.registry import DEFAULT_MODEL, ensure_model

    return ensure_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    """The default model's tokenizer, loaded once."""
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.tokenizer import load_tokenizer

    return load_tokenizer(GGUFFile(model_path))


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
        from tiny_mindie.config import load_config
        from tiny_mindie.server.tls import tls_files
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
                      "ModelDeployConfig": {"maxSeqLen": 1024, "maxInputTokenLen": 512,
                                            "ModelConfig": [{"modelName": "smollm2-135m-instruct",
                                                             "modelWeightPath": "smollm2-135m-instruct"}]},
                      "ScheduleConfig": {"maxPrefillTokens": 512, "maxPrefillBatchSize": 8,
                                         "maxBatchSize": 8, "maxIterTimes": 256}},
}


def start_server(home: str, config: dict, extra_args: list[str] = (), timeout: float = 180) -> Server:
    """Start the server from a config file in ``home`` and wait for its banner."""
    path = os.path.join(home, "config.json")
    with open(path, "w") as fh:
        json.dump(config, fh)
    proc = subprocess.Popen([sys.executable, "-m", "tiny_mindie", "--config", path, *extra_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=home)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("try it:"):
            lines.extend(proc.stdout.readline() for _ in range(3))
            banner = "".join(lines)
            port = int(re.search(r"listens\s+https?://127\.0\.0\.1:(\d+)", banner).group(1))
            return Server(proc, port, home, banner, path)
    proc.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines))


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_path):
    """The one shared server on the default model (mutual TLS, fresh certificates)."""
    backend = os.environ.get("TINY_MINDIE_TEST_BACKEND")   # default: the server's default
    srv = start_server(str(tmp_path_factory.mktemp("server")), TEST_CONFIG,
                       ["--backend", backend] if backend else [])
    # Keep reading its output so the pipe never fills up.
    import threading
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(iter(srv.proc.stdout.readline, "")), daemon=True).start()
    srv.log = log
    yield srv
    srv.proc.terminate()
    try:
        srv.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
