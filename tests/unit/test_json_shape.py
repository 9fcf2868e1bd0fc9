"""The request body's shape, read on its bytes before ``json.loads`` (``validate.json_structure``
and the checks on it): exact against the parsed value on any JSON (escapes, backslash runs,
unicode, chunk boundaries), and linear in the body's size on what a breaker sends -- the work
grows with the size, never with its square."""

from __future__ import annotations

import json

import pytest
from cpu_time import least_cpu_seconds
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiny_mindie.api import validate
from tiny_mindie.api.errors import APIError
from tiny_mindie.api.validate import (
    MAX_JSON_KEYS,
    JSONTooDeep,
    json_depth,
    json_keys,
    json_structure,
    json_values,
    parse_json_object,
)

FIXED = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])   # same patch

# strings made of what the scan looks at: quotes, backslash runs, brackets, separators, unicode
TRICKY = st.text(st.sampled_from(list('"\\[]{},: ab\u00e9\u4e2d\U0001f600\n\t\x00')), max_size=12)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TRICKY, inner, max_size=5),
    max_leaves=30)
LAYOUTS = [dict(), dict(ensure_ascii=False), dict(separators=(",", ":")),
           dict(indent=1, ensure_ascii=False)]


def _expected(v) -> tuple[int, int, int]:
    """(depth, values as MAX_JSON_VALUES counts them, most members of one object) of ``v``."""
    if isinstance(v, (list, dict)):
        kids = [_expected(x) for x in (v.values() if isinstance(v, dict) else v)]
        return (1 + max((k[0] for k in kids), default=0),
                1 + max(len(v) - 1, 0) + sum(k[1] for k in kids),
                max([len(v) if isinstance(v, dict) else 0] + [k[2] for k in kids]))
    return 0, 0, 0


@pytest.mark.parametrize("chunk", [validate._CHUNK, 1, 3, 8])
@given(value=VALUES, layout=st.sampled_from(LAYOUTS))
@FIXED
def test_the_scan_agrees_with_json_loads(monkeypatch, chunk, value, layout):
    monkeypatch.setattr(validate, "_CHUNK", chunk)     # every byte a chunk boundary, or none
    text = json.dumps(value, **layout).encode("utf-8", "surrogatepass")
    assert (json_depth(text), json_values(text), json_keys(text)) == _expected(value)


@pytest.mark.parametrize("chunk", [validate._CHUNK, 2, 5])
def test_backslash_runs_before_a_quote(monkeypatch, chunk):
    monkeypatch.setattr(validate, "_CHUNK", chunk)
    for run in range(9):
        for pad in range(min(chunk, 4) + 1):   # the run and its quote at each offset of a chunk
            text = json.dumps([" " * pad + "\\" * run + '"[{,:', ["x"]]).encode()
            assert json_structure(text).tobytes() == b"[,[]]", (run, pad)


def test_what_the_scan_keeps():
    assert json_structure(b'{"a:[":[1,{"b":"\\\\"}],"c":"\\""}').tobytes() == b"{:[,{:}],:}"
    assert json_structure(b"").tobytes() == b""
    assert json_structure(b'"unterminated [{,:').tobytes() == b""


def test_an_object_at_the_key_cap_parses_and_one_past_it_is_refused():
    def body(keys: int) -> bytes:
        return json.dumps({"inputs": "x", "p": {f"k{i}": i for i in range(keys)}}).encode()

    assert len(parse_json_object(body(MAX_JSON_KEYS))["p"]) == MAX_JSON_KEYS
    with pytest.raises(APIError) as exc:
        parse_json_object(body(MAX_JSON_KEYS + 1))
    assert (exc.value.status, exc.value.message) == (
        422, f"Failed to parse request context to json: an object of more than "
             f"{MAX_JSON_KEYS} members")


def test_many_keys_spread_over_objects_or_inside_strings_are_fine():
    spread = [{f"k{i}": i for i in range(1000)} for _ in range(MAX_JSON_KEYS // 500)]
    assert len(parse_json_object(json.dumps({"a": spread}).encode())["a"]) == len(spread)
    text = '"k":1,' * (MAX_JSON_KEYS + 1)
    assert parse_json_object(json.dumps({"inputs": text}).encode()) == {"inputs": text}


@pytest.mark.parametrize("body", [b":" * (MAX_JSON_KEYS + 1),
                                  b"}{" + b'"a":1,' * MAX_JSON_KEYS + b'"a":1}'],
                         ids=["bare colons", "closed before opened"])
def test_colons_no_json_could_hold_are_refused_as_not_json(body):
    with pytest.raises(APIError) as exc:
        parse_json_object(body)
    assert exc.value.message == "Failed to parse request context to json"


# ---- linear in the size ------------------------------------------------------------------
def _fit(unit: bytes, size: int) -> bytes:
    return unit * (size // len(unit))


#: What a breaker sends, at any size: each refused or parsed, never a 5xx.
ADVERSARIAL = {
    "quote-bracket": lambda n: _fit(b'\\"[', n),
    "escaped quotes": lambda n: b'{"a":"' + _fit(b'\\"', n) + b'"}',
    "backslash runs": lambda n: b'{"a":"' + _fit(b"\\" * 7 + b'"' + b"\\" * 8 + b"[", n) + b'"}',
    "unterminated": lambda n: b'{"a":"' + _fit(b"[{,:", n),
    "unicode escapes": lambda n: b'{"a":"' + _fit(b"\\u00e9\\ud83d\\ude00", n) + b'"}',
    "deep": lambda n: _fit(b"[", n),
    "deep objects": lambda n: _fit(b'{"a":', n),
    "long number": lambda n: b'{"a":1.' + _fit(b"9", n) + b"}",
    "long exponent": lambda n: b'{"a":1e' + _fit(b"9", n) + b"}",
    "many keys": lambda n: b"{" + b",".join(b'"k%d":0' % i for i in range(n // 9)) + b"}",
    "many commas": lambda n: b"[" + _fit(b",", n) + b"]",
    "many values": lambda n: b"[" + _fit(b"0,", n) + b"0]",
    "quote runs": lambda n: b'{"a":' + _fit(b'"', n),
}


def _cpu_seconds(check, body: bytes) -> float:
    """Least CPU time that ``check(body)`` takes, however it ends (a refusal is a 422)."""
    def call():
        try:
            check(body)
        except APIError as exc:
            assert exc.status == 422
    return least_cpu_seconds(call)


def _growth(check, make, small: int, big: int) -> float:
    floor = 2e-4            # below this a timer tick and the call itself dominate
    return (max(_cpu_seconds(check, make(big)), floor)
            / max(_cpu_seconds(check, make(small)), floor))


@pytest.mark.parametrize("family", sorted(ADVERSARIAL))
def test_the_checks_take_time_linear_in_the_body(family):
    """From 100 KB to 1 MB (ten times the bytes) the time of the whole parse grows well under
    the hundredfold a quadratic scan would take."""
    assert _growth(parse_json_object, ADVERSARIAL[family], 100_000, 1_000_000) < 35


@pytest.mark.parametrize("family", sorted(ADVERSARIAL))
def test_the_scan_takes_time_linear_in_the_body(family):
    """The full scan (structure, depths, members of each object), which a body takes only
    when a raw count is over its bound: from 1 MB to 8 MB well under sixty-fourfold."""
    assert _growth(json_keys, ADVERSARIAL[family], 1_000_000, 8_000_000) < 24


def test_the_quote_bracket_body_is_refused_for_its_depth():
    with pytest.raises(JSONTooDeep):
        parse_json_object(ADVERSARIAL["quote-bracket"](96_000))
