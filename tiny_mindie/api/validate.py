"""Typed, ranged reading of JSON request fields, with MindIE's 422 messages.

Messages name the parameter, the accepted range and the value, e.g.
``Parameter top_p must be in (0.0,1.0), got 1.0.`` (spec §3). ``null`` means "not set".
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import invalid


def parse_json_object(body: bytes) -> dict:
    """The request body as a JSON object; 422 ``Failed to parse request context to json``
    for invalid UTF-8, invalid JSON, NaN/Infinity, or a non-object."""
    def no_constants(name: str):
        raise ValueError(name)
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise invalid("Failed to parse request context to json") from None
    if not isinstance(obj, dict):
        raise invalid("Failed to parse request context to json")
    return obj


def _fmt(v: Any) -> str:
    """``v`` as JSON would show it, cut to 60 characters (a 4000-digit number is not echoed)."""
    s = json.dumps(v, ensure_ascii=False) if isinstance(v, (str, list, dict)) else repr(v) \
        if not isinstance(v, bool) else ("true" if v else "false")
    return s if len(s) <= 60 else s[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def get_bool(d: dict, name: str, default: bool | None, what: str = "Parameter") -> bool | None:
    """``d[name]`` as a bool (``None``/absent -> ``default``); 422 when it is another type."""
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"{what} {name} must be a boolean, got {_fmt(v)}.")
    return v


def check_token_ids(value: Any, name: str, vocab_size: int, what: str = "Parameter") -> list[int]:
    """``value`` as a list of token ids in ``[0, vocab_size)``; 422 when it is not one."""
    if not isinstance(value, list) or not all(_is_int(i) for i in value):
        raise invalid(f"{what} {name} must be a list of token ids.")
    if not all(0 <= i < vocab_size for i in value):
        raise invalid(f"{what} {name} must hold token ids in [0,{vocab_size - 1}].")
    return list(value)


def get_int(d: dict, name: str, default: int | None, lo: int, hi: int,
            what: str = "Parameter") -> int | None:
    """``d[name]`` as an integer in ``[lo, hi]``; a float is a type error (spec §2)."""
    v = d.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(f"{what} {name} must be an integer, got {_fmt(v)}.")
    if not lo <= v <= hi:
        raise invalid(f"{what} {name} must be in [{lo},{hi}], got {_fmt(v)}.")
    return v


def get_float(d: dict, name: str, default: float | None, lo: float, hi: float,
              lo_open: bool, hi_open: bool, what: str = "Parameter") -> float | None:
    """``d[name]`` as a float in the interval (``lo_open``/``hi_open`` exclude the ends);
    integers are accepted."""
    v = d.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise invalid(f"{what} {name} must be a number, got {_fmt(v)}.")
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        interval = (f"{'(' if lo_open else '['}{float(lo)},"
                    f"{'inf' if math.isinf(hi) else float(hi)}{')' if hi_open else ']'}")
        raise invalid(f"{what} {name} must be in {interval}, got {_fmt(v)}.")
    return float(v)
