"""Bad input against the real server: MindIE's error bodies, and nothing lost for others."""

from __future__ import annotations

import json

import pytest
from helpers import request, seed_body

VALIDATION = "Input Validation Error"

OUT_OF_RANGE = [
    ("temperature", 0), ("temperature", -1.0), ("temperature", "hot"),
    ("top_k", 0), ("top_k", -1), ("top_k", 2**31), ("top_k", 1.5),
    ("top_p", 1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
    ("typical_p", 0.0), ("typical_p", 1.01),
    ("do_sample", "yes"), ("do_sample", 1),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0),
    ("repetition_penalty", 0.0), ("repetition_penalty", -2),
    ("max_new_tokens", 0), ("max_new_tokens", -5), ("max_new_tokens", 2**31),
    ("max_new_tokens", 2.0),
    ("details", "true"), ("watermark", 0),
    ("priority", 0), ("priority", 6), ("priority", 2.5),
    ("timeout", 0), ("timeout", 65536), ("timeout", 1.5),
]


@pytest.mark.parametrize("name,value", OUT_OF_RANGE)
def test_out_of_range_parameter_is_422(server, name, value):
    status, headers, body = request(server, "POST", "/infer",
                                    seed_body(stream=False, **{name: value}))
    assert status == 422, body
    err = json.loads(body)
    assert err["error_type"] == VALIDATION
    assert name in err["error"]


def test_top_p_message_matches_mindie(server):
    status, _, body = request(server, "POST", "/infer", seed_body(stream=False, top_p=1.0))
    assert json.loads(body) == {"error": "Parameter top_p must be in (0.0,1.0), got 1.0.",
                                "error_type": VALIDATION}


@pytest.mark.parametrize("raw,message", [
    (b"{not json", "Failed to parse request context to json"),
    (b"[1, 2]", "Failed to parse request context to json"),
    (b'{"inputs": NaN}', "Failed to parse request context to json"),
    (b"\xff\xfe", "Failed to parse request context to json"),
    (b'{"parameters": {}}', "Not found inputs."),
    (b'{"inputs": null}', "Inputs must not be null"),
    (b'{"inputs": 42}', "The type of inputs is abnormal"),
    (b'{"inputs": ["a"]}', "The type of inputs is abnormal"),
    (b'{"inputs": "hi", "input_id": [1, 2]}', "Input conflict."),
])
def test_malformed_body_is_422(server, raw, message):
    status, _, body = request(server, "POST", "/infer", raw)
    assert status == 422
    assert json.loads(body) == {"error": message, "error_type": VALIDATION}


def test_parameters_must_be_an_object(server):
    status, _, body = request(server, "POST", "/infer", {"inputs": "hi", "parameters": [1]})
    assert status == 422 and json.loads(body)["error_type"] == VALIDATION


def test_stream_must_be_boolean(server):
    status, _, body = request(server, "POST", "/infer", {"inputs": "hi", "stream": "yes"})
    assert status == 422 and "stream" in json.loads(body)["error"]


def test_prompt_too_long_is_424(server):
    status, _, body = request(server, "POST", "/infer", {"inputs": "hello " * 600})
    assert status == 424
    err = json.loads(body)
    assert err["error_type"] == "Generation Error"
    assert err["error"].startswith("Failed to enqueue inferRequest. This model's maximum input ids "
                                   "length cannot be greater than 512,the input ids length is ")


def test_unknown_route_is_404(server):
    status, _, body = request(server, "POST", "/no/such/route", {"inputs": "hi"})
    assert status == 404
    assert json.loads(body)["error_type"] == "NotFoundError"


def test_wrong_method_is_405_with_allow(server):
    status, headers, body = request(server, "GET", "/infer")
    assert status == 405
    assert headers["allow"] == "POST"
    assert "error" in json.loads(body)


def test_body_over_max_request_length_is_413(server):
    # The test config sets maxRequestLength to 1 MB.
    big = json.dumps({"inputs": "x" * (1024 * 1024 + 10)}).encode()
    status, _, body = request(server, "POST", "/infer", big)
    assert status == 413
    assert json.loads(body) == {"message": "Request body too large. Maximum allowed size is 1MB."}


@pytest.mark.parametrize("path, want", [
    ("/v1/chat/completions", {"error": {
        "message": "Request body too large. Maximum allowed size is 1MB.",
        "type": "invalid_request_error", "param": None, "code": None}}),
    ("/v1/responses?x=1", {"error": {
        "message": "Request body too large. Maximum allowed size is 1MB.",
        "type": "invalid_request_error", "param": None, "code": None}}),
    ("/v1/messages", {"type": "error", "error": {
        "type": "request_too_large",
        "message": "Request body too large. Maximum allowed size is 1MB."}}),
    ("/generate", {"message": "Request body too large. Maximum allowed size is 1MB."}),
])
def test_a_body_over_the_limit_is_refused_in_its_familys_shape(server, path, want):
    """The parser refuses it before any route runs; the body is the error shape of the family
    whose route the request-line names (MindIE's and TGI's routes: MindIE's 413 body)."""
    big = json.dumps({"model": "m", "prompt": "x" * (1024 * 1024 + 10)}).encode()
    status, _, body = request(server, "POST", path, big)
    assert (status, json.loads(body)) == (413, want)


def test_server_still_serves_after_bad_input(server):
    status, _, body = request(server, "POST", "/infer", {"inputs": "One, two,",
                                                         "parameters": {"max_new_tokens": 3}})
    assert status == 200 and json.loads(body)["generated_text"]


def test_huge_prompt_is_refused_at_once_without_stalling_others(server):
    """Refused by its length alone ("at least": never tokenized, which would hold the server
    for time in proportion to its size), while another request is served beside it."""
    from concurrent.futures import ThreadPoolExecutor
    body = json.dumps({"inputs": "word " * 200_000}).encode()          # ~1 MB, under the limit
    with ThreadPoolExecutor(2) as pool:
        big = pool.submit(request, server, "POST", "/infer", body)
        health = request(server, "GET", "/health")
        status, _, raw = big.result()
    assert health[0] == 200
    assert status == 424
    assert "cannot be greater than 512,the input ids length is at least" in json.loads(raw)["error"]


def test_head_on_a_get_route(server):
    status, headers, body = request(server, "HEAD", "/health")
    assert status == 200 and body == b""
