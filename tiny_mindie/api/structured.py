"""Structured outputs and token biases, as the API families spell them: OpenAI's
``response_format`` and ``logit_bias``, TGI's ``grammar``. Each is validated, and a grammar
compiled (:func:`tiny_mindie.engine.constraint.compile_constraint`, cached), before anything
reaches the engine, so that a malformed or unenforceable one is the client's 400 / 422 naming
the field, never a silently looser output.
"""

from __future__ import annotations

import json
import math
import re

from ..engine.constraint import ConstraintError, compile_constraint
from ..engine.request import Constraint
from ..model.tokenizer import Tokenizer
from .errors import APIError, Kind, bad, invalid
from .validate import MAX_JSON_DEPTH, json_depth

SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_BIAS = 100.0                 # OpenAI's range for logit_bias values: [-100, 100]
#: The bounds an unbounded ``"type": "integer"`` gets in the grammar: int64's range as far as
#: llguidance can take it (it reads bounds as f64 and fails on -2**63, "Failed to generate
#: regex for integer range"; 2**63 - 1024 is the largest f64 below 2**63): at most 19 digits.
INT_BOUND = 2**63 - 1024


# ---- the schema given to the grammar -----------------------------------------------------
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
#: Not ``not`` nor ``if``: a stricter schema there would make the whole one looser.
_SUBSCHEMAS = ("items", "then", "else", "contains", "additionalProperties",
               "unevaluatedProperties", "unevaluatedItems", "propertyNames")
#: Keywords by which an object schema says something of its members: one without any is
#: "any object", which :func:`closed` makes the empty object.
_MEMBER_KEYWORDS = ("properties", "additionalProperties", "patternProperties",
                    "unevaluatedProperties", "propertyNames", "required", "minProperties",
                    "maxProperties", "dependentRequired", "dependentSchemas", "anyOf", "oneOf",
                    "allOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "enum", "const")


def _each_schema(schema, change, *, branch: bool = False):
    """A copy of ``schema`` with ``change(copy, branch)`` applied to it and to each of its
    subschemas (innermost first); ``change`` edits the dict it is given (a fresh copy);
    ``branch`` is true for an ``allOf`` branch (a part of the object its parent describes)."""
    if isinstance(schema, list):
        return [_each_schema(s, change, branch=branch) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _each_schema(v, change) for k, v in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMAS):
        if isinstance(out.get(key), dict | list):
            out[key] = _each_schema(out[key], change, branch=key == "allOf")
    change(out, branch)
    return out


def _types(schema: dict) -> tuple:
    t = schema.get("type")
    return tuple(t) if isinstance(t, list) else (t,)


_OTHERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_ELSEWHERE = ("$ref", "$dynamicRef", "anyOf", "oneOf", "if", "dependentSchemas")


def _all_of_names(s: dict) -> list | None:
    """The property names ``s`` and its ``allOf`` branches (nested ones too) list, in order;
    None when one of them says something of other members (:data:`_OTHERS`), or names
    members elsewhere (a ``$ref``, an ``anyOf``, ...): such an object is left open."""
    if any(k in s for k in (*_OTHERS, *_ELSEWHERE)):
        return None
    names = list(s.get("properties") or {})
    for part in s.get("allOf") or ():
        more = _all_of_names(part) if isinstance(part, dict) else None
        if more is None:
            return None
        names += [n for n in more if n not in names]
    return names


def _close(s: dict, branch: bool) -> None:
    if branch:      # closed with its parent: closing each branch would exclude the others'
        return
    if isinstance(s.get("allOf"), list) and s["allOf"]:
        names = _all_of_names(s)
        if names:   # the parent names every branch's members, so that it may be closed
            s["properties"] = {**{n: {} for n in names}, **(s.get("properties") or {})}
            s["additionalProperties"] = False
    elif "properties" in s and not any(k in s for k in _OTHERS):
        s["additionalProperties"] = False
    elif "object" in _types(s) and not any(k in s for k in _MEMBER_KEYWORDS):
        s["additionalProperties"] = False


def closed(schema):
    """A copy of ``schema`` in which each object schema that lists ``properties`` but says
    nothing of others (no ``additionalProperties``, ``patternProperties``,
    ``unevaluatedProperties``) allows no others, as OpenAI's strict mode requires them to be
    written; and each ``"type": "object"`` that says nothing of its members at all (no
    ``properties``, ``required``, ``anyOf``, ``$ref``, ...) is the empty object, as
    ``{"type": "object", "properties": {}}`` then is. An ``allOf``'s branches describe one
    object together: the object is closed to the members any of them lists (they stay open
    themselves). Every document the copy accepts the original accepts too, and a small model
    cannot spend its tokens inventing members."""
    return _each_schema(schema, _close)


def _bound_integers(s: dict, branch: bool) -> None:
    if "integer" not in _types(s):
        return
    lows = [s[k] for k in ("minimum", "exclusiveMinimum") if k in s]
    highs = [s[k] for k in ("maximum", "exclusiveMaximum") if k in s]
    low, high = (_json_number(v[0]) if v else None for v in (lows, highs))
    if not highs and (low is None or low <= INT_BOUND):
        s["maximum"] = INT_BOUND
    if not lows and (high is None or high >= -INT_BOUND):
        s["minimum"] = -INT_BOUND


def grammar_schema(schema, *, strict: bool = False):
    """The schema the grammar is compiled from, for a client's ``schema`` (which stays the one
    its answers are valid against): each ``"type": "integer"`` (or a type list with it)
    lacking a bound gets :data:`INT_BOUND` (-INT_BOUND) -- a small model otherwise fills its
    budget with digits --, and with ``strict`` the objects are :func:`closed` (OpenAI's
    strict structured outputs). Numbers stay unbounded: a bound limits neither fraction nor
    exponent digits in llguidance's grammar."""
    if strict:
        schema = closed(schema)
    return _each_schema(schema, _bound_integers)


def compiled(tokenizer: Tokenizer, constraint: Constraint, error) -> Constraint:
    """``constraint`` once it compiles for ``tokenizer``'s vocabulary (cached, see
    :func:`~tiny_mindie.engine.constraint.compile_constraint`).

    Raises:
        APIError: ``error(message)`` (the family's 400/422 naming the field) when it does not.
    """
    try:
        compile_constraint(tokenizer, constraint)
    except ConstraintError as exc:
        raise error(str(exc)) from None
    return constraint


def _json_number(v) -> float | None:
    """A JSON number as a float (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        return float(v)
    except OverflowError:
        return math.inf


#: The keys each ``response_format`` type reads (OpenAI's, and llama.cpp's ``schema`` on
#: ``json_object``); any other is a 400 naming it, never silently ignored.
FORMAT_KEYS = {"text": ("type",), "json_object": ("type", "schema"),
               "json_schema": ("type", "json_schema")}
JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


def unknown_parameter(name: str) -> APIError:
    """400 for a field nobody reads, in OpenAI's words (``param`` the field's path, ``code``
    ``unknown_parameter``)."""
    return APIError(Kind.BAD_REQUEST, f"Unknown parameter: '{name}'.", param=name,
                    code="unknown_parameter")


def _no_other_keys(obj: dict, known, where: str) -> None:
    for key in obj:
        if key not in known:
            raise unknown_parameter(f"{where}.{key}")


def response_format(tokenizer: Tokenizer, value) -> Constraint | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (or null) -> None;
    ``{"type": "json_object"}`` -> any JSON object, ``{"type": "json_object", "schema":
    object}`` (llama.cpp's form) -> output valid against ``schema``; ``{"type": "json_schema",
    "json_schema": {"name": 1-64 of [A-Za-z0-9_-], "schema": object, "strict": bool,
    "description": str}}`` -> output valid against ``schema`` (enforced whether ``strict`` or
    not; ``strict`` also closes its objects, as OpenAI's strict mode: :func:`grammar_schema`).

    Raises:
        APIError: 400 with ``param: "response_format"``: not an object, unknown ``type``,
            ``json_schema`` missing or malformed, bad ``name``, missing ``schema``, or a schema
            the grammar library cannot enforce (the message names the feature); 400
            ``unknown_parameter`` with ``param: "response_format.<key>"`` for a key the type
            does not read (:data:`FORMAT_KEYS`, :data:`JSON_SCHEMA_KEYS`).
    """
    if value is None:
        return None

    def fail(message: str) -> APIError:
        return bad(message, "response_format")

    if not isinstance(value, dict):
        raise fail("Parameter response_format must be an object.")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in FORMAT_KEYS:
        raise fail("response_format.type must be one of 'text', 'json_object', 'json_schema', "
                   f"got {json.dumps(kind)}.")
    _no_other_keys(value, FORMAT_KEYS[kind], "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        if "schema" not in value:
            return compiled(tokenizer, Constraint("json_object"), fail)
        return _schema_constraint(tokenizer, _object_schema(value["schema"]), False,
                                  "response_format.schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise fail("response_format.json_schema must be an object with a name and a schema.")
    _no_other_keys(spec, JSON_SCHEMA_KEYS, "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.fullmatch(name):
        raise fail("response_format.json_schema.name must be 1-64 characters of a-z, A-Z, "
                   f"0-9, '_' and '-', got {json.dumps(name)}.")
    for key, kinds in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise fail(f"response_format.json_schema.{key} must be a "
                       f"{'boolean' if kinds is bool else 'string'}.")
    return _schema_constraint(tokenizer, spec.get("schema"), spec.get("strict") is True,
                              "response_format.json_schema.schema")


def _object_schema(schema):
    """``json_object``'s ``schema`` held to its promise, one JSON object: a schema without a
    ``type`` gets ``"object"``.

    Raises:
        APIError: 400 (``param: "response_format"``) for a schema whose ``type`` excludes
            objects (``json_schema`` takes any root).
    """
    if not isinstance(schema, dict):
        return schema                   # _schema_constraint refuses it, naming the field
    kind = schema.get("type", "object")
    if "object" not in (kind if isinstance(kind, list) else [kind]):
        raise bad(f"response_format.schema of json_object must describe an object, its type is "
                  f"{json.dumps(schema['type'])}: use json_schema for other answers.",
                  "response_format")
    return {**schema, "type": "object"}


def _schema_constraint(tokenizer: Tokenizer, schema, strict: bool, where: str) -> Constraint:
    """The compiled constraint of ``response_format``'s JSON ``schema`` (at ``where``).

    Raises:
        APIError: 400 (``param: "response_format"``) when ``schema`` is no object or cannot
            be enforced.
    """
    if not isinstance(schema, dict):
        raise bad(f"{where} is required and must be an object (a JSON schema).",
                  "response_format")
    spec = json.dumps(grammar_schema(schema, strict=strict))
    return compiled(tokenizer, Constraint("json_schema", spec),
                    lambda m: bad(f"{where}: {m}", "response_format"))


def logit_bias(tokenizer: Tokenizer, value) -> dict[int, float]:
    """OpenAI's ``logit_bias``: ``{"<token id>": bias}``, ids of the vocabulary, biases numbers
    in [-100, 100]; null -> ``{}``.

    Raises:
        APIError: 400 with ``param: "logit_bias"`` for anything else.
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("Parameter logit_bias must be an object mapping token ids to biases.",
                  "logit_bias")
    out: dict[int, float] = {}
    n = tokenizer.vocab_size
    for key, v in value.items():
        if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) >= n:
            raise bad(f"logit_bias keys must be token ids in 0..{n - 1}, got {json.dumps(key)}.",
                      "logit_bias")
        x = _json_number(v)
        if x is None or not -MAX_BIAS <= x <= MAX_BIAS:
            raise bad(f"logit_bias values must be numbers in [-100, 100], got {json.dumps(v)} "
                      f"for token {key}.", "logit_bias")
        out[int(key)] = x
    return out


def tgi_grammar(tokenizer: Tokenizer, value) -> Constraint | None:
    """TGI's ``parameters.grammar``: ``{"type": "json", "value": schema}`` (the schema an object,
    or a string holding one; ``"json_object"`` is TGI's alias of ``"json"``), ``{"type":
    "json_schema", "value": {"name": optional, "schema": schema}}`` (TGI 3) or ``{"type":
    "regex", "value": "<regex>"}``; null -> None.

    Raises:
        APIError: 422 (TGI's ``validation`` error) for anything else, or a grammar that does
            not compile.
    """
    if value is None:
        return None

    def fail(message: str) -> APIError:
        return invalid(f"Grammar failed to compile: {message}")

    if not isinstance(value, dict) or value.get("type") not in (
            "json", "json_object", "json_schema", "regex"):
        raise invalid("Parameter grammar must be {\"type\": \"json\" | \"json_schema\" | "
                      "\"regex\", \"value\": ...}.")
    spec = value.get("value")
    if value["type"] == "json_schema":
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict) \
                or not isinstance(spec.get("name"), str | None):
            raise invalid("Parameter grammar.value must be {\"name\": ..., \"schema\": {...}} "
                          "for type json_schema.")
        spec = spec["schema"]
    if value["type"] == "regex":
        if not isinstance(spec, str):
            raise invalid("Parameter grammar.value must be a string (a regex).")
        return compiled(tokenizer, Constraint("regex", spec), fail)
    if isinstance(spec, str):
        if json_depth(spec.encode("utf-8", "surrogatepass")) > MAX_JSON_DEPTH:
            raise fail(f"grammar.value nests deeper than {MAX_JSON_DEPTH} levels")
        try:
            spec = json.loads(spec)
        except ValueError as exc:
            raise fail(f"grammar.value is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise invalid("Parameter grammar.value must be a JSON schema object.")
    return compiled(tokenizer, Constraint("json_schema", json.dumps(grammar_schema(spec))),
                     fail)
