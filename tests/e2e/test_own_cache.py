"""A server given its own cache (``TINY_MINDIE_CACHE``) and a model in a shared models folder,
with ``--log-requests`` in the default text log format: the access line carries the request's
body and output on one line, and nothing in the models folder changes -- no graph, index entry
or check record is written beside the GGUF, even where a graph cache already sits there. One
server process for the module; its graph comes from the default one's, linked (no build)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from helpers import TEST_CONFIG, request, serving, start_server

pytestmark = pytest.mark.e2e


def _link_tree(src: str, dst: str) -> None:
    """``dst``: ``src``'s graph entries, their big files hard-linked (the JSON records
    copied, as they are rewritten by rename); the index and lock files left out."""
    def link_or_copy(a: str, b: str) -> None:
        (shutil.copy2 if a.endswith(".json") else os.link)(a, b)

    shutil.copytree(src, dst, copy_function=link_or_copy,
                    ignore=lambda d, names: [n for n in names if n == "index"
                                             or n.endswith(".lock") or n.startswith(".")])


def snapshot(folder: str) -> dict[str, tuple]:
    """Every file and folder under ``folder`` (itself included): kind, size, mtime in ns."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in [".", *dirs, *files]:
            path = os.path.normpath(os.path.join(root, name))
            st = os.lstat(path)
            out[os.path.relpath(path, folder)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def own(tmp_path_factory, model_path, server):
    """The server, its ``models`` folder (the GGUF and a graph cache beside it, both linked
    from the default server's) and that folder's :func:`snapshot` before the start."""
    del server                       # started first: the default graph exists to be linked
    base = tmp_path_factory.mktemp("own-cache")
    models, cache = base / "models", base / "cache"
    models.mkdir()
    gguf = models / os.path.basename(model_path)
    os.link(model_path, gguf)
    beside = os.path.join(os.path.dirname(model_path), "onnx-cache")
    _link_tree(beside, str(models / "onnx-cache"))
    _link_tree(beside, str(cache / "onnx"))
    before = snapshot(str(models))
    config = json.loads(json.dumps(TEST_CONFIG))
    config["BackendConfig"]["ModelDeployConfig"]["ModelConfig"][0]["modelWeightPath"] = str(gguf)
    srv = start_server(str(base), config, env={"TINY_MINDIE_CACHE": str(cache),
                                               "TINY_MINDIE_LOG_REQUESTS": "1"})
    srv.models, srv.cache, srv.gguf, srv.before = str(models), str(cache), str(gguf), before
    yield from serving(srv)


def _access_line(srv, request_id: str) -> str:
    deadline = time.monotonic() + 30
    while True:
        found = [line for line in list(srv.log) if f" id={request_id} " in line]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "".join(srv.log[-10:])
        time.sleep(0.05)


def test_log_requests_puts_the_body_and_output_in_the_text_line(own):
    body = json.dumps({"inputs": "Say \"hi\"\nto the quokka:",
                       "parameters": {"max_new_tokens": 8, "do_sample": False}})
    status, _, raw = request(own, "POST", "/infer", body.encode(),
                             headers={"X-Request-Id": "lr-1"})
    assert status == 200, raw
    output = json.loads(raw)["generated_text"]
    line = _access_line(own, "lr-1")           # one line: the prompt's newline is escaped
    assert '"POST /infer" 200 ' in line and line.count("\n") == 1, line
    assert f" request_body={json.dumps(body, ensure_ascii=False)} " in line, line
    assert line.rstrip("\n").endswith(f" output={json.dumps([output], ensure_ascii=False)}")
    status, _, _ = request(own, "GET", "/v1/models", headers={"X-Request-Id": "lr-2"})
    assert status == 200
    assert _access_line(own, "lr-2").rstrip("\n").endswith(' request_body="" output=[]')


def test_nothing_is_written_beside_the_gguf_with_a_cache_of_its_own(own):
    status, _, _ = request(own, "POST", "/infer", {
        "inputs": "Hello", "parameters": {"max_new_tokens": 4, "do_sample": False}})
    assert status == 200
    own.proc.terminate()
    assert own.proc.wait(timeout=30) == 0
    assert snapshot(own.models) == own.before
    # the server did use its own cache: the GGUF's identity is recorded there
    index = os.path.join(own.cache, "onnx", "index")
    recorded = [json.loads(Path(index, name).read_text()) for name in os.listdir(index)]
    assert [r["path"] for r in recorded] == [os.path.realpath(own.gguf)]
