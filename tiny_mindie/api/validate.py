"""Typed, ranged reading of JSON request fields, with MindIE's 422 messages.

Messages name the parameter, the accepted range and the value, e.g.
``Parameter top_p must be in (0.0,1.0), got 1.0.`` (spec §3). ``null`` means "not set". Each
field's error names the field as its ``param`` (OpenAI's style answers it 400).

A body's shape (nesting, values, members of one object) is checked on its bytes before
``json.loads`` sees them (:func:`json_structure`: one vectorized pass, linear in the body's
size, no regex), since ``json.loads`` holds the GIL for as long as it parses.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np

from .errors import APIError, Kind, invalid

#: How deeply arrays and objects may nest in a request body. No real request comes near (a
#: chat with tool calls nests about 6 deep); code that walks a parsed body recursively -- the
#: chat template, the chat shielding, json.dumps -- then cannot run out of stack.
MAX_JSON_DEPTH = 64

#: How many JSON values a request body may hold, counted as its commas, brackets and braces
#: outside strings (one to two per value: ``[{},{}]`` counts 4). A value costs tens of bytes once
#: parsed, and ``json.loads`` holds the GIL, so a worker thread does not let the event loop run
#: while it parses; this bounds both. A token-id prompt of ``maxInputTokenLen``'s top fits.
MAX_JSON_VALUES = 1 << 21

#: How many members one JSON object of a request body may have (counted as the colons directly
#: in it, outside strings). The largest objects a request holds -- a tool's parameters, a
#: ``logit_bias`` -- have hundreds; a distinct key is the costliest thing ``json.loads`` builds.
MAX_JSON_KEYS = 1 << 16

#: The largest value a field the families give as a 32-bit signed integer may hold.
INT32_MAX = 2**31 - 1
#: The open upper end of a float field's range (``get_float(..., hi=INF)``).
INF = float("inf")

_CHUNK = 1 << 20                # bytes a vectorized step takes at once (int32 work arrays)
_STEP = np.zeros(256, np.int32)  # what a structural byte does to the depth
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1
_BACKSLASH, _QUOTE, _COLON = 0x5C, 0x22, 0x3A


class JSONTooDeep(APIError):
    """A request body nested deeper than :data:`MAX_JSON_DEPTH`: 422 (400 in OpenAI's style)."""

    def __init__(self, depth_limit: int):
        super().__init__(Kind.TOO_DEEP, "Failed to parse request context to json: arrays and "
                         f"objects nest deeper than {depth_limit} levels")


def json_structure(text: bytes) -> np.ndarray:
    """The bytes ``[ ] { } , :`` of the JSON ``text`` that are outside its strings, in order,
    as a uint8 array: one vectorized pass, linear in ``len(text)``, no parsing.

    A quote is escaped when an odd run of backslashes comes right before it; the unescaped
    quotes open and close the strings. Exact for JSON text and for any prefix of it, so for
    text that is not JSON it stands for what ``json.loads`` reads before it fails.
    """
    parts = []
    run = inside = 0       # parity of the backslashes ending the bytes so far; in a string
    for start in range(0, len(text), _CHUNK):
        a = np.frombuffer(text, np.uint8, min(_CHUNK, len(text) - start), start)
        quotes = a == _QUOTE
        backslashes = a == _BACKSLASH
        if run or backslashes.any():
            at = np.arange(len(a), dtype=np.int32)
            plain = np.maximum.accumulate(np.where(backslashes, -1, at))   # last other byte
            ends = (at - plain) & 1       # parity of the backslash run ending at each byte
            ends[plain < 0] ^= run
            quotes[0] &= run == 0
            quotes[1:] &= ends[:-1] == 0  # ... ending right before each byte
            run = int(ends[-1])
        strings = np.bitwise_xor.accumulate(quotes.view(np.uint8)) ^ np.uint8(inside)
        folded = a | 0x20                 # [ and { as {, ] and } as }
        structural = (folded == 0x7B) | (folded == 0x7D) | (a == 0x2C) | (a == _COLON)
        parts.append(a[structural & (strings == 0)])
        inside = int(strings[-1])
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _levels(structure: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The depth after each byte of a :func:`json_structure` (int8, clipped to -1..127), the
    deepest and the lowest depth reached."""
    levels = np.empty(len(structure), np.int8)
    depth = deepest = lowest = 0
    for i in range(0, len(structure), _CHUNK):
        got = np.cumsum(_STEP[structure[i:i + _CHUNK]], dtype=np.int64) + depth
        deepest, lowest = max(deepest, int(got.max())), min(lowest, int(got.min()))
        levels[i:i + _CHUNK] = np.clip(got, -1, 127)
        depth = int(got[-1])
    return levels, deepest, lowest


def _most_members(structure: np.ndarray, levels: np.ndarray) -> int:
    """The most colons directly in one array or object of a :func:`json_structure` (the most
    members of one object, for JSON): each colon belongs to the last opening bracket or brace
    before it at its own depth, found by a stable (radix) sort of both by depth."""
    pick = (_STEP[structure] > 0) | (structure == _COLON)
    order = np.argsort(levels[pick], kind="stable")
    kinds = structure[pick][order]
    container = np.cumsum(kinds != _COLON)
    counts = np.bincount(container[kinds == _COLON])
    return int(counts.max()) if len(counts) else 0


def json_depth(text: bytes) -> int:
    """How deeply arrays and objects nest in the JSON ``text`` (``0`` for a scalar, ``1`` for
    ``[1]``), brackets inside strings not counted; linear time, no recursion, no parsing (for
    text that is not JSON the number means little)."""
    return _levels(json_structure(text))[1]


def json_values(text: bytes) -> int:
    """How many values the JSON ``text`` holds, as :data:`MAX_JSON_VALUES` counts them: its
    commas, ``[`` and ``{`` outside strings (``[1,2,3]`` -> 3); linear time, no parsing."""
    return _count(json_structure(text), b",[{")


def json_keys(text: bytes) -> int:
    """The most members of one object in the JSON ``text`` (``{"a":1,"b":{"c":2}}`` -> 2), as
    :data:`MAX_JSON_KEYS` counts them; linear time, no parsing."""
    s = json_structure(text)
    return _most_members(s, _levels(s)[0])


async def read_json_object(body: bytes) -> dict:
    """:func:`parse_json_object` of a request body, in a worker thread: what a route handler
    calls. Raises as :func:`parse_json_object` does."""
    return await asyncio.to_thread(parse_json_object, body)


def _count(structure: np.ndarray, chars: bytes) -> int:
    return sum(int(np.count_nonzero(structure == c)) for c in chars)


def _check_shape(structure: np.ndarray, max_depth: int) -> None:
    """Refuse a body whose :func:`json_structure` nests deeper than ``max_depth`` or has an
    object of more than :data:`MAX_JSON_KEYS` members (the values are checked before)."""
    levels, deepest, lowest = _levels(structure)
    if deepest > max_depth:
        raise JSONTooDeep(max_depth)
    colons = _count(structure, b":")
    if colons <= MAX_JSON_KEYS:
        return
    if lowest < 0 or colons > _count(structure, b",[{"):    # each key follows a { or a ,
        raise invalid("Failed to parse request context to json")
    if _most_members(structure, levels) > MAX_JSON_KEYS:
        raise invalid("Failed to parse request context to json: an object of more than "
                      f"{MAX_JSON_KEYS} members")


def parse_json_object(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 422 ``Failed to parse request context to json`` for invalid UTF-8, invalid
            JSON, NaN/Infinity, an integer of over 4300 digits, a non-object, more than
            :data:`MAX_JSON_VALUES` values or an object of more than :data:`MAX_JSON_KEYS`
            members (both checked on the bytes, before parsing);
            :class:`JSONTooDeep` (422) when arrays and objects nest deeper than ``max_depth``
            (checked on the bytes, before anything parses or walks them).
    """
    def no_constants(name: str):
        raise ValueError(name)
    # counts over the raw bytes first (the cheapest checks; strings can only add to them),
    # the exact ones, outside strings, only where one of these is over its bound
    openers = body.count(b"[") + body.count(b"{")
    structure = None
    if (openers + body.count(b",") > MAX_JSON_VALUES or openers > max_depth
            or body.count(b":") > MAX_JSON_KEYS):
        structure = json_structure(body)
        if _count(structure, b",[{") > MAX_JSON_VALUES:
            raise invalid("Failed to parse request context to json: more than "
                          f"{MAX_JSON_VALUES} values")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid("Failed to parse request context to json") from None
    if structure is not None:
        _check_shape(structure, max_depth)
    try:
        obj = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError):
        raise invalid("Failed to parse request context to json") from None
    if not isinstance(obj, dict):
        raise invalid("Failed to parse request context to json")
    return obj


def _fmt(v: Any) -> str:
    """``v`` as JSON would show it, cut to 60 characters (a 4000-digit number is not echoed)."""
    try:     # an int of over 4300 digits has no str() (json.loads never makes one)
        s = json.dumps(v, ensure_ascii=False) if isinstance(v, (str, list, dict)) else repr(v) \
            if not isinstance(v, bool) else ("true" if v else "false")
    except ValueError:
        s = f"an integer of {v.bit_length()} bits"
    return s if len(s) <= 60 else s[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_float(v: Any) -> float | None:
    """A JSON number ``v`` as a float: an integer too large for one (``1e400`` written out in
    digits) as +-inf, so that it fails any range check; ``None`` for anything else (bools,
    strings, NaN and +-Infinity, which ``parse_json_object`` refuses anyway)."""
    if _is_int(v):
        try:
            return float(v)
        except OverflowError:
            return math.inf if v > 0 else -math.inf
    return v if isinstance(v, float) and math.isfinite(v) else None


def get_bool(d: dict, name: str, default: bool | None, what: str = "Parameter") -> bool | None:
    """``d[name]`` as a bool (``None``/absent -> ``default``); 422 when it is another type."""
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{what} {name} must be a boolean, got {_fmt(v)}.", name)
    return v


def check_token_ids(value: Any, name: str, vocab_size: int, what: str = "Parameter", *,
                    non_empty: bool = False, type_message: str | None = None,
                    range_message: str | None = None) -> list[int]:
    """``value`` as a list of token ids in ``[0, vocab_size)`` (``non_empty``: at least one).

    Raises:
        APIError: 422 ``type_message`` (default ``<what> <name> must be a list of token
            ids.``) when it is not a list of integers, or an empty one when ``non_empty``;
            422 ``range_message`` (``{max_id}`` filled in; default ``<what> <name> must hold
            token ids in [0,<max_id>].``) when an id is out of range.
    """
    if (not isinstance(value, list) or (non_empty and not value)
            or not all(_is_int(i) for i in value)):
        raise invalid(type_message or f"{what} {name} must be a list of token ids.", name)
    if not all(0 <= i < vocab_size for i in value):
        raise invalid((range_message or f"{what} {name} must hold token ids in [0,{{max_id}}].")
                      .format(max_id=vocab_size - 1), name)
    return list(value)


def get_int(d: dict, name: str, default: int | None, lo: int, hi: int,
            what: str = "Parameter") -> int | None:
    """``d[name]`` as an integer in ``[lo, hi]``; a float is a type error (spec §2)."""
    v = d.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(f"{what} {name} must be an integer, got {_fmt(v)}.", name)
    if not lo <= v <= hi:
        raise invalid(f"{what} {name} must be in [{lo},{hi}], got {_fmt(v)}.", name)
    return v


def get_float(d: dict, name: str, default: float | None, lo: float, hi: float, *,
              lo_open: bool, hi_open: bool, what: str = "Parameter") -> float | None:
    """``d[name]`` as a finite float in the interval (``lo_open``/``hi_open`` exclude the
    ends); integers are accepted, one too large for a float is out of range (422, not an
    ``OverflowError``)."""
    v = d.get(name)
    if v is None:
        return default
    x = _as_float(v)
    if x is None:
        raise invalid(f"{what} {name} must be a number, got {_fmt(v)}.", name)
    ok = (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi)
    if not ok or math.isinf(x):
        interval = (f"{'(' if lo_open else '['}{float(lo)},"
                    f"{'inf' if math.isinf(hi) else float(hi)}{')' if hi_open else ']'}")
        raise invalid(f"{what} {name} must be in {interval}, got {_fmt(v)}.", name)
    return x


def get_stop_list(p: dict, name: str, limit: int) -> list[str]:
    """``stop``: a string or a list of non-empty strings (at most ``limit``); null -> []."""
    v = p.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise invalid(f"Parameter {name} must be a string or a list of non-empty strings.",
                      name)
    if len(v) > limit:
        raise invalid(f"Parameter {name} supports up to {limit} stop sequences. Given: {len(v)}",
                      name)
    return list(v)


def refuse_unknown(d: dict, known, what: str = "Parameter") -> None:
    """422 ``<what> <name> is not supported.`` naming the first key of ``d`` that is not in
    ``known`` and not null (null means "not set"): a field nothing reads is never silently
    ignored."""
    for name, value in d.items():
        if name not in known and value is not None:
            raise invalid(f"{what} {name} is not supported.", name)


def refuse_set(p: dict, name: str, neutral=(None,)) -> None:
    """422 ``Parameter <name> is not supported.`` unless ``p[name]`` is one of ``neutral``."""
    if p.get(name) not in neutral:
        raise invalid(f"Parameter {name} is not supported.", name)
