"""The shared request validators (``tiny_mindie.api.validate``) on what no real request sends:
integers too large for a float, integers of thousands of digits, JSON nested hundreds deep; and
their errors in each family's style (a bad field named once, OpenAI's 400 where MindIE says
422), and a prompt too long carrying its numbers into OpenAI's wording."""

from __future__ import annotations

import json
import sys

import pytest

from tiny_mindie.api.errors import MINDIE, OPENAI, TGI, APIError, Kind, from_generation_error
from tiny_mindie.api.mindie import mindie_parameters
from tiny_mindie.api.validate import (
    INF,
    MAX_JSON_DEPTH,
    JSONTooDeep,
    check_token_ids,
    get_bool,
    get_float,
    get_int,
    json_depth,
    parse_json_object,
)
from tiny_mindie.engine.request import GenerationError

BIG = 10**400                         # what json.loads makes of "1" followed by 400 zeros


@pytest.mark.parametrize("value", [BIG, -BIG, 2**1024, 2**1024 - 1],
                         ids=["1e400", "-1e400", "2**1024", "2**1024-1"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "typical_p", "repetition_penalty"])
def test_an_integer_too_large_for_a_float_is_out_of_range(name, value):
    with pytest.raises(APIError) as exc:
        mindie_parameters({name: value})
    assert exc.value.status == 422
    assert exc.value.message.startswith(f"Parameter {name} must be in (0.0,")
    assert exc.value.message.endswith(f", got {str(value)[:57]}....")


def test_float_parameters_still_take_integers_and_floats():
    assert get_float({"t": 10**20}, "t", 1.0, 0.0, INF, lo_open=True, hi_open=True) == 1e20
    assert get_float({"t": 1}, "t", 0.5, 0.0, 1.0, lo_open=True, hi_open=False) == 1.0
    assert get_float({"t": 1.7976931348623157e308}, "t", 1.0, 0.0, INF,
                     lo_open=True, hi_open=True) > 0
    with pytest.raises(APIError, match=r"must be in \(0.0,1.0\], got 2\."):
        get_float({"t": 2}, "t", 1.0, 0.0, 1.0, lo_open=True, hi_open=False)
    with pytest.raises(APIError, match="must be a number, got true"):
        get_float({"t": True}, "t", 1.0, 0.0, 1.0, lo_open=True, hi_open=False)


@pytest.mark.parametrize("name", ["max_new_tokens", "seed", "top_k", "priority", "timeout"])
def test_huge_integers_are_out_of_range(name):
    for value in (BIG, -BIG, 2**200):
        with pytest.raises(APIError, match=f"Parameter {name} must be in \\["):
            mindie_parameters({name: value})


def test_an_integer_past_python_s_digit_limit_is_a_parse_error():
    digits = sys.get_int_max_str_digits() + 1 if hasattr(sys, "get_int_max_str_digits") else 5000
    with pytest.raises(APIError) as exc:
        parse_json_object(b'{"parameters":{"seed":%s}}' % (b"9" * digits))
    assert (exc.value.status, exc.value.message) == (422, "Failed to parse request context to json")
    # ... and one made otherwise is echoed by its size, not its digits
    with pytest.raises(APIError, match="got an integer of 16610 bits"):
        get_int({"n": 10**5000}, "n", None, 0, 1)


def test_json_depth():
    assert [json_depth(t) for t in (b"1", b'"[{"', b"[]", b"[1,[2,{}]]", b'{"a":[{"b":"]]"}]}',
                                    b'["\\"[[[", ["\\\\"]]', b"[" * 10**5 + b"]" * 10**5)] == \
        [0, 0, 1, 3, 3, 2, 10**5]
    # far past one chunk of the scan, ending shallower than it went
    assert json_depth(b"[" * 3_000_000 + b"]" * 2_999_999) == 3_000_000
    assert json_depth((b"[" * 65 + b"]" * 65) * 20_000) == 65


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 500, 950, 5000, 100_000])
def test_json_nested_too_deep_is_refused_before_it_is_parsed(depth):
    body = b'{"x":' + b"[" * (depth - 1) + b'"x"' + b"]" * (depth - 1) + b"}"
    with pytest.raises(JSONTooDeep) as exc:
        parse_json_object(body)
    assert exc.value.status == 422
    assert exc.value.message == ("Failed to parse request context to json: arrays and objects "
                                 f"nest deeper than {MAX_JSON_DEPTH} levels")


def test_json_as_deep_as_allowed_and_brackets_in_strings_are_fine():
    nested = "[" * (MAX_JSON_DEPTH - 1) + "1" + "]" * (MAX_JSON_DEPTH - 1)
    obj = parse_json_object(('{"x":%s}' % nested).encode())
    assert json.dumps(obj) == '{"x": %s}' % nested
    text = "[{" * 10_000 + '\\"'
    assert parse_json_object(json.dumps({"inputs": text}).encode()) == {"inputs": text}


def _raised(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as exc:
        fn(*args, **kwargs)
    return exc.value


def test_a_bad_field_names_itself_and_each_style_answers_it_once():
    errors = [_raised(get_int, {"n": 1.5}, "n", 1, 1, 8),
              _raised(get_float, {"top_p": 2}, "top_p", 1.0, 0.0, 1.0, lo_open=True,
                      hi_open=False),
              _raised(get_bool, {"echo": 1}, "echo", False),
              _raised(check_token_ids, [5], "prompt", 4)]
    for err, param in zip(errors, ["n", "top_p", "echo", "prompt"], strict=True):
        assert (err.kind, err.param) == (Kind.INVALID, param)
        assert (err.status, err.body()) == (422, {"error": err.message,
                                                  "error_type": "Input Validation Error"})
        err.style = TGI
        assert (err.status, err.body()["error_type"]) == (422, "validation")
        err.style = OPENAI
        assert (err.status, err.body()) == (400, {"error": {
            "message": err.message, "type": "invalid_request_error", "param": param,
            "code": None}})
    body = _raised(parse_json_object, b"[1]")     # no field to name: 422 in every style
    body.style = OPENAI
    assert (body.param, body.status) == (None, 422)
    assert MINDIE.status(body) == 422


def test_a_prompt_too_long_carries_its_numbers_and_openai_says_them():
    from tiny_mindie.api.openai.routes import _context_error

    err = GenerationError.too_long(512, 600)
    assert (err.kind, err.limit, err.length, err.at_least) == ("too_long", 512, 600, False)
    assert err.message == ("Failed to enqueue inferRequest. This model's maximum input ids "
                           "length cannot be greater than 512,the input ids length is 600")
    answer = _context_error(from_generation_error(err), "prompt")
    answer.style = OPENAI
    assert (answer.status, answer.body()) == (400, {"error": {
        "message": "This model's maximum context length is 512 tokens. However, you requested "
                   "600 tokens in the prompt. Please reduce the length of the prompt.",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}})
    assert from_generation_error(err).status == 424             # MindIE's words and status
    # a text refused by its size alone: only a lower bound, so MindIE's words stay
    bound = GenerationError.too_long(512, 900, at_least=True)
    assert bound.message.endswith("the input ids length is at least 900")
    answer = _context_error(from_generation_error(bound), "messages")
    assert (answer.message, answer.param) == (bound.message, "messages")
