"""MindIE's Triton family and the native extras (/infer_token, /v1/tokenizer), end to end with
curl over mutual TLS against the real server and model."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
from helpers import sse_events

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")

MODEL = "smollm2-135m-instruct"
PROMPT = "The capital of France is"
GREEDY = {"do_sample": False, "max_new_tokens": 8}


def curl_args(server, method: str, path: str, body=None) -> list[str]:
    args = ["curl", "-sS", "-N", "--cacert", server.ca, "--cert", server.client_cert,
            "--key", server.client_key, "-X", method, "-w", "\n%{http_code}"]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    return args + [f"{server.url}{path}"]


def curl(server, method: str, path: str, body=None) -> tuple[int, bytes]:
    """(HTTP status, body) of one curl request."""
    r = subprocess.run(curl_args(server, method, path, body), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    raw, _, code = r.stdout.rpartition(b"\n")
    return int(code), raw


def curl_json(server, method: str, path: str, body=None, status: int = 200):
    got, raw = curl(server, method, path, body)
    assert got == status, raw
    return json.loads(raw)


# ---- metadata -------------------------------------------------------------------------------

def test_server_metadata(server):
    meta = curl_json(server, "GET", "/v2")
    assert meta["name"] == "MindIE Server" and isinstance(meta["version"], str)
    ext = meta["extensions"]
    assert ext["max_iter_times"] == 256 and ext["max_prefill_batch_size"] == 8
    assert ext["max_prefill_tokens"] == 512


def test_model_metadata_and_config(server):
    meta = curl_json(server, "GET", f"/v2/models/{MODEL}")
    assert meta == {"name": MODEL, "platform": "MindIE Server",
                    "inputs": [{"name": "input0", "shape": [-1], "datatype": "UINT32"}],
                    "outputs": [{"name": "output0", "shape": [-1], "datatype": "UINT32"}]}
    cfg = curl_json(server, "GET", f"/v2/models/{MODEL}/config")
    assert cfg["model_name"] == MODEL and cfg["max_seq_len"] == 1024
    assert cfg["input_datatype"] == cfg["output_datatype"] == "UINT32"
    assert cfg["model_weight_path"].endswith(".gguf") and cfg["world_size"] == 1


@pytest.mark.parametrize("method, path", [
    ("GET", "/v2/models/nope"), ("GET", "/v2/models/nope/config"),
    ("POST", "/v2/models/nope/generate"), ("POST", "/v2/models/nope/infer"),
])
def test_unknown_model_is_404(server, method, path):
    err = curl_json(server, method, path, {"text_input": "x"} if method == "POST" else None, 404)
    assert err == {"error": "Model nope not found", "error_type": "NotFoundError"}


# ---- text inference -------------------------------------------------------------------------

def test_generate_plain(server):
    body = {"id": "a123", "text_input": PROMPT,
            "parameters": {**GREEDY, "details": True, "perf_stat": True}}
    ans = curl_json(server, "POST", f"/v2/models/{MODEL}/generate", body)
    assert ans["id"] == "a123" and ans["model_name"] == MODEL and ans["model_version"] is None
    assert "Paris" in ans["text_output"]
    d = ans["details"]
    assert d["finish_reason"] in ("length", "eos_token")
    assert 1 <= d["generated_tokens"] <= 8 and isinstance(d["seed"], int)
    assert d["first_token_cost"] > 0 and len(d["decode_cost"]) == d["generated_tokens"] - 1


def test_generate_stream_matches_generate(server):
    body = {"text_input": PROMPT, "parameters": {**GREEDY, "details": True}}
    plain = curl_json(server, "POST", f"/v2/models/{MODEL}/generate", body)
    status, raw = curl(server, "POST", f"/v2/models/{MODEL}/generate_stream", body)
    assert status == 200
    events = sse_events(raw)
    assert all(set(e) == {"id", "model_name", "model_version", "text_output", "details"}
               for e in events)
    assert len({e["id"] for e in events}) == 1          # an id is made up when none is given
    assert "".join(e["text_output"] for e in events) == plain["text_output"]
    assert [e["details"]["generated_tokens"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["details"]["finish_reason"] == plain["details"]["finish_reason"]


def test_generate_validation(server):
    err = curl_json(server, "POST", f"/v2/models/{MODEL}/generate",
                    {"text_input": PROMPT, "parameters": {"temperature": 0}}, 422)
    assert err["error_type"] == "Input Validation Error" and "temperature" in err["error"]
    err = curl_json(server, "POST", f"/v2/models/{MODEL}/generate", {"inputs": PROMPT}, 422)
    assert err["error"] == "Not found text_input."
    err = curl_json(server, "POST", f"/v2/models/{MODEL}/generate",
                    {"id": "bad id!", "text_input": PROMPT}, 422)
    assert "id" in err["error"]


# ---- token inference ------------------------------------------------------------------------

def test_infer_token_ids(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"id": "42", "inputs": [{"name": "input0", "shape": [1, len(ids)], "datatype": "UINT32",
                                    "data": ids}],
            "outputs": [{"name": "output0"}], "parameters": GREEDY}
    ans = curl_json(server, "POST", f"/v2/models/{MODEL}/infer", body)
    assert ans["id"] == "42"
    (out,) = ans["outputs"]
    assert out["name"] == "output0" and out["datatype"] == "UINT32"
    assert out["shape"] == [1, len(out["data"])] and 1 <= len(out["data"]) <= 8
    text = curl_json(server, "POST", f"/v2/models/{MODEL}/generate",
                     {"text_input": PROMPT, "parameters": GREEDY})["text_output"]
    assert tokenizer.decode(out["data"]) == text


@pytest.mark.parametrize("change, word", [
    ({"datatype": "FP32"}, "datatype"), ({"shape": [1, 3]}, "shape"), ({"data": []}, "data"),
    ({"data": [10**9]}, "data"),
])
def test_infer_rejects_bad_tensors(server, change, word):
    inp = {"name": "input0", "shape": [2], "datatype": "UINT32", "data": [504, 3575], **change}
    err = curl_json(server, "POST", f"/v2/models/{MODEL}/infer", {"inputs": [inp]}, 422)
    assert word in err["error"]


# ---- stopInfer ------------------------------------------------------------------------------

def test_stop_infer_cancels_a_running_stream(server):
    body = {"id": "long-1", "text_input": "Count from one to one thousand: 1, 2, 3,",
            "parameters": {"do_sample": False, "max_new_tokens": 250, "details": True}}
    proc = subprocess.Popen(curl_args(server, "POST", f"/v2/models/{MODEL}/generate_stream", body),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline()               # the stream is running
        assert first.startswith(b"data: "), first + proc.stderr.read()
        assert curl_json(server, "POST", f"/v2/models/{MODEL}/stopInfer", {"id": "long-1"}) \
            == {"id": "long-1"}
        out = proc.stdout.read()     # not communicate(): it would skip what readline buffered
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    raw, _, code = (first + out).rpartition(b"\n")
    assert code == b"200"
    events = sse_events(raw)
    last = events[-1]
    assert last["id"] == "long-1" and last["text_output"] == ""
    assert last["details"]["finish_reason"] == "stop_sequence"
    assert last["details"]["generated_tokens"] == len(events) - 1 < 250
    # the request left the engine: its slot is free again, its id unknown
    deadline = time.monotonic() + 5
    while True:
        slots = curl_json(server, "GET", f"/v2/models/{MODEL}/getSlotCount")
        if slots["free_slots"] == slots["total_slots"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert slots["free_slots"] == slots["total_slots"]
    curl_json(server, "POST", f"/v2/models/{MODEL}/stopInfer", {"id": "long-1"}, 404)


def test_stop_infer_ends_a_plain_generate(server):
    body = {"id": "long-2", "text_input": "Count from one to one thousand: 1, 2, 3,",
            "parameters": {"do_sample": False, "max_new_tokens": 250, "details": True}}
    proc = subprocess.Popen(curl_args(server, "POST", f"/v2/models/{MODEL}/generate", body),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while True:     # stopInfer answers 404 until the request is registered
            status, _ = curl(server, "POST", f"/v2/models/{MODEL}/stopInfer", {"id": "long-2"})
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    raw, _, code = out.rpartition(b"\n")
    assert code == b"200"
    ans = json.loads(raw)
    assert ans["id"] == "long-2" and ans["details"]["finish_reason"] == "stop_sequence"
    assert ans["details"]["generated_tokens"] < 250


# ---- native extras --------------------------------------------------------------------------

def test_tokenizer_route(server, tokenizer):
    ans = curl_json(server, "POST", "/v1/tokenizer", {"inputs": PROMPT})
    assert ans == {"token_number": len(tokenizer.encode(PROMPT)),
                   "tokens": tokenizer.encode(PROMPT)}
    ans = curl_json(server, "POST", "/v1/tokenizer", {"inputs": PROMPT, "do_decode": True})
    assert ans["token_number"] == len(ans["tokens"]) and "".join(ans["tokens"]) == PROMPT
    err = curl_json(server, "POST", "/v1/tokenizer", {"text": PROMPT}, 422)
    assert err["error"] == "Not found inputs."
    err = curl_json(server, "POST", "/v1/tokenizer", {"inputs": "ab " * 20_000}, 424)  # 60 KB
    assert "is at least" in err["error"]                        # as /infer: not tokenized at all
    err = curl_json(server, "POST", "/v1/tokenizer", {"inputs": "x" * 20_000}, 424)  # 5000 tokens
    assert "the input ids length is 5000" in err["error"]        # counted, over the 512 allowed


def test_infer_token_route(server, tokenizer):
    ids = tokenizer.encode(PROMPT)
    body = {"input_id": ids, "parameters": {**GREEDY, "details": True}}
    ans = curl_json(server, "POST", "/infer_token", body)
    text = curl_json(server, "POST", "/infer", {"inputs": PROMPT, "parameters": GREEDY})
    assert ans["generated_text"] == text["generated_text"] and "Paris" in ans["generated_text"]
    assert set(ans["details"]) == {"finish_reason", "generated_tokens", "seed"}
    status, raw = curl(server, "POST", "/infer_token", {**body, "stream": True})
    assert status == 200 and sse_events(raw)[-1]["generated_text"] == ans["generated_text"]
    err = curl_json(server, "POST", "/infer_token", {"inputs": PROMPT}, 422)
    assert err["error"].startswith("Not found input_id.")
    err = curl_json(server, "POST", "/infer_token", {"input_id": [-1]}, 422)
    assert err["error_type"] == "Input Validation Error"

