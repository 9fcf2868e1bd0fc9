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

from ...engine.constraint import ConstraintError, compile_constraint
from ...engine.request import Constraint
from ...model.tokenizer import Tokenizer
from ..errors import APIError, Kind, bad, invalid
from ..validate import MAX_JSON_DEPTH, json_depth

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
_ELSEWHERE = ("$dynamicRef", "anyOf", "oneOf", "if", "dependentSchemas")
_DEF_MAPS = ("$defs", "definitions")
#: What the name of a definition's open copy ends with (:class:`_Closer`).
OPEN_SUFFIX = "-open"
#: Bounds on closing objects made of parts (:class:`_Closer`), so that the schema the grammar
#: gets stays linear in the client's: ``$ref`` levels followed to find a part's members, the
#: members one object may be closed to, and the members added to all such objects of a
#: schema. An object past a bound is left open, as its parts say.
MAX_REF_DEPTH, MAX_PART_MEMBERS, MAX_ADDED_MEMBERS = 8, 256, 4096


class _Closer:
    """The change :func:`closed` makes to each (sub)schema of ``root``, and the open copies of
    the definitions (``#/$defs/<name>``, ``#/definitions/<name>``) that a ``$ref`` names as a
    part of an object: an ``allOf`` branch, or a ``$ref`` beside ``properties``. Such a part
    is closed with the object it is part of, never on its own (that would exclude the other
    parts' members): its ``$ref`` is pointed at ``<name>-open``, a copy of the definition that
    is not closed itself (its own subschemas are), while any other ``$ref`` keeps the closed one.
    One copy per definition, so the work stays linear in the schema's size."""

    def __init__(self, root, bare: bool):
        self.bare = bare
        self.defs = {m: root[m] for m in _DEF_MAPS
                     if isinstance(root, dict) and isinstance(root.get(m), dict)}
        self.opened: dict[tuple[str, str], tuple[str, str]] = {}   # def -> (its copy, $ref)
        self.alias: dict[str, str] = {}                            # copy's $ref -> original
        self._names: dict[tuple[str, str], dict | None] = {}
        self.budget = MAX_ADDED_MEMBERS

    def target(self, ref) -> tuple[str, str] | None:
        """The definition a local ``$ref`` names: (its map, its name), else None."""
        ref = self.alias.get(ref, ref) if isinstance(ref, str) else None
        for m in self.defs if ref else ():
            token = ref[len(m) + 3:]
            if ref.startswith(f"#/{m}/") and "/" not in token and "%" not in token:
                name = token.replace("~1", "/").replace("~0", "~")
                return (m, name) if name in self.defs[m] else None
        return None

    def open_ref(self, s: dict) -> None:
        """Point ``s``'s ``$ref`` at its definition's open copy (made once, :meth:`copies`)."""
        key = self.target(s.get("$ref"))
        if key is None:
            return
        if key not in self.opened:
            m, name = key
            copy, ref = name + OPEN_SUFFIX, s["$ref"] + OPEN_SUFFIX
            while copy in self.defs[m]:
                copy, ref = copy + OPEN_SUFFIX, ref + OPEN_SUFFIX
            self.opened[key] = (copy, ref)
            self.alias[ref] = s["$ref"]
        s["$ref"] = self.opened[key][1]

    def names(self, s: dict, seen: tuple = ()) -> dict | None:
        """The property names ``s``, its ``allOf`` branches (nested ones too) and the
        definitions their local ``$ref`` keywords name list, in order (a dict's keys); None
        when one of them says something of other members (:data:`_OTHERS`) or names members
        elsewhere (an ``anyOf``, a ``$ref`` to no local definition, ...), or past a bound
        (:data:`MAX_REF_DEPTH`, :data:`MAX_PART_MEMBERS`): such an object is left open."""
        if any(k in s for k in (*_OTHERS, *_ELSEWHERE)) or not isinstance(
                s.get("properties", {}), dict):
            return None
        names = dict.fromkeys(s.get("properties") or {})
        parts = s.get("allOf") or []
        if "$ref" in s:
            parts = [*parts, None]
        for part in parts:
            more = (self._def_names(self.target(s["$ref"]), seen) if part is None
                    else self.names(part, seen) if isinstance(part, dict) else None)
            if more is None:
                return None
            names.update(more)
            if len(names) > MAX_PART_MEMBERS:
                return None
        return names

    def _def_names(self, key: tuple[str, str] | None, seen: tuple) -> dict | None:
        """:meth:`names` of the definition ``key`` (once each; None within a cycle)."""
        if key is None or key in seen or len(seen) >= MAX_REF_DEPTH:
            return None
        if key not in self._names:
            self._names[key] = None
            d = self.defs[key[0]][key[1]]
            self._names[key] = self.names(d, (*seen, key)) if isinstance(d, dict) else None
        return self._names[key]

    def __call__(self, s: dict, branch: bool) -> None:
        combined = bool(isinstance(s.get("allOf"), list) and s["allOf"]) or (
            "$ref" in s and "properties" in s)
        if branch or combined:
            self.open_ref(s)
        if branch:      # closed with its parent: closing each branch would exclude the others'
            return
        if combined:
            names = self.names(s) if self.budget > 0 else None
            own = s.get("properties") or {}
            added = [n for n in names or () if n not in own]
            if names and len(added) <= self.budget:    # every part's members named: closed
                self.budget -= len(added)
                s["properties"] = {**dict.fromkeys(names, {}), **own}
                s["additionalProperties"] = False
        elif "properties" in s and not any(k in s for k in _OTHERS):
            s["additionalProperties"] = False
        elif self.bare and "object" in _types(s) and not any(k in s for k in _MEMBER_KEYWORDS):
            s["additionalProperties"] = False

    def copies(self, out):
        """``out`` (the closed root) with the open copies of the definitions :meth:`open_ref`
        pointed at (a copy may name more)."""
        done: set = set()
        while len(done) < len(self.opened):
            for key in [k for k in self.opened if k not in done]:
                done.add(key)
                m, name = key
                out[m] = {**out[m], self.opened[key][0]: _each_schema(self.defs[m][name], self,
                                                                      branch=True)}
        return out


def closed(schema, *, bare: bool = True):
    """A copy of ``schema`` in which each object schema that lists ``properties`` but says
    nothing of others (no ``additionalProperties``, ``patternProperties``,
    ``unevaluatedProperties``) allows no others -- as OpenAI's strict mode requires them to be
    written, and as llama.cpp's, vLLM's (xgrammar) and TGI's (outlines) converters hold a
    schema by default --; and, with ``bare``, each ``"type": "object"`` that says nothing of its
    members at all (no ``properties``, ``required``, ``anyOf``, ``$ref``, ...) is the empty
    object, as ``{"type": "object", "properties": {}}`` then is. An ``allOf``'s branches (and
    a ``$ref`` beside ``properties``) describe one object together: the object is closed to
    the members any of them lists, local ``$ref`` keywords followed (:class:`_Closer`; the parts
    stay open themselves). Every document the copy accepts the original accepts too, and a
    small model cannot spend its tokens inventing members."""
    closer = _Closer(schema, bare)
    return closer.copies(_each_schema(schema, closer))


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
    its answers are valid against): its objects :func:`closed` to the members they list unless
    they say otherwise (strict or not, as llama.cpp and vLLM hold schemas; with ``strict`` a
    bare ``{"type": "object"}`` is also the empty object, OpenAI's strict structured outputs),
    and each ``"type": "integer"`` (or a type list with it) lacking a bound gets
    :data:`INT_BOUND` (-INT_BOUND) -- a small model otherwise fills its budget with digits.
    Numbers stay unbounded: a bound limits neither fraction nor exponent digits in
    llguidance's grammar."""
    return _each_schema(closed(schema, bare=strict), _bound_integers)


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
    not, its objects closed to the members they list; ``strict`` also makes a bare object the
    empty one, as OpenAI's strict mode: :func:`grammar_schema`).

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
    "regex", "value": "<regex>"}``; null -> None. A schema is held as :func:`grammar_schema`
    (not strict) holds it.

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
