"""A chat request's tools: ``tools`` and ``tool_choice`` validated, the tools written as a
system prompt for a template that renders none of its own, and the JSON schema decoding is held
to when a call is forced (``tool_choice`` ``required`` or a named function). Pure functions, no
I/O, no model; what the model writes back is :mod:`.tool_calls`' to parse.
"""

from __future__ import annotations

import dataclasses
import json
import re

from ..errors import bad
from . import tool_calls as tc
from .structured import grammar_schema

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclasses.dataclass(frozen=True)
class Tool:
    """One validated ``tools`` entry (``type: "function"``)."""

    name: str
    description: str | None
    parameters: dict            # a JSON schema object ({} when the client gave none)
    strict: bool = False

    def as_openai(self) -> dict:
        """The entry as the chat template gets it: OpenAI's ``{"type": "function", "function":
        {"name", "description", "parameters"}}`` (what Hugging Face's templates read)."""
        fn: dict = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def parse_tools(value) -> list[Tool] | None:
    """The ``tools`` field: ``None`` when absent or empty, else each entry checked.

    Raises:
        APIError: 400 (``param`` ``tools``) for a non-list, an entry not ``{"type":
            "function", "function": {...}}``, a name not matching ``[a-zA-Z0-9_-]{1,64}``, a
            name given twice, a non-string description, ``parameters`` not a JSON schema
            object (``type``, when given, must be ``"object"``), a non-boolean ``strict``.
    """
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("Parameter tools must be a list of tools.", "tools")
    tools, seen = [], set()
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad(f"{where}.type must be 'function'.", "tools")
        if set(t) - {"type", "function"}:
            raise bad(f"{where} has unknown fields: {sorted(set(t) - {'type', 'function'})}.",
                      "tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{where}.function must be an object.", "tools")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise bad(f"{where}.function has unknown fields: {sorted(unknown)}.", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(f"{where}.function.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ "
                      f"and -, got {json.dumps(name)[:80]}.", "tools")
        if name in seen:
            raise bad(f"{where}.function.name {name!r} is given twice.", "tools")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad(f"{where}.function.description must be a string.", "tools")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad(f"{where}.function.parameters must be a JSON schema object.", "tools")
        if params.get("type", "object") != "object":
            raise bad(f"{where}.function.parameters must describe an object "
                      f"(type 'object'), got type {json.dumps(params.get('type'))}.", "tools")
        _check_schema(params, f"{where}.function.parameters")
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise bad(f"{where}.function.strict must be a boolean.", "tools")
        tools.append(Tool(name, desc, params, strict))
    return tools or None


def _check_schema(schema: dict, where: str) -> None:
    """``schema`` is a valid JSON schema (Draft 2020-12's meta-schema, with ``jsonschema``)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise bad(f"{where}{path} is not a valid JSON schema: {exc.message[:200]}",
                  "tools") from None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The validated ``tool_choice``: ``mode`` ``"none"``, ``"auto"``, ``"required"`` or
    ``"function"`` (then ``name`` is the function's)."""

    mode: str
    name: str | None = None


def parse_tool_choice(value, tools: list[Tool] | None) -> Choice:
    """The ``tool_choice`` field (default ``auto`` with tools, ``none`` without).

    Raises:
        APIError: 400 (``param`` ``tool_choice``) for another string, an object not
            ``{"type": "function", "function": {"name": ...}}``, a name that is no tool's, or
            ``auto``/``required``/a function without ``tools``.
    """
    if value is None:
        return Choice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad("Parameter tool_choice must be 'none', 'auto', 'required' or "
                      f"{{'type': 'function', 'function': {{'name': ...}}}}, got {value!r}.",
                      "tool_choice")
        choice = Choice(value)
    elif isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(value.get("function"), dict) \
            and isinstance(value["function"].get("name"), str) and set(value) == {"type",
                                                                                   "function"}:
        choice = Choice("function", value["function"]["name"])
    else:
        raise bad("Parameter tool_choice must be 'none', 'auto', 'required' or "
                  "{'type': 'function', 'function': {'name': ...}}.", "tool_choice")
    if choice.mode != "none" and not tools:
        raise bad(f"Parameter tool_choice {choice.mode!r} requires tools.", "tool_choice")
    if choice.mode == "function" and choice.name not in {t.name for t in tools or ()}:
        raise bad(f"Parameter tool_choice names function {choice.name!r}, which is not in "
                  "tools.", "tool_choice")
    return choice


def call_schema(tools: list[Tool], choice: Choice, parallel: bool) -> dict:
    """The JSON schema decoding is constrained to for ``required`` or a named function:
    ``{"name": <const>, "arguments": <that function's parameters>}``, any of ``tools`` for
    ``required`` (an array of one or more such calls when ``parallel``), the named one
    otherwise. The parameters are as under OpenAI's strict mode
    (:func:`~.structured.grammar_schema`: objects closed, integers bounded): what is generated
    still validates against the client's schema."""
    defs: dict = {}
    if choice.mode == "function":
        return _rooted(_one_call(next(t for t in tools if t.name == choice.name), "arguments",
                                 True, defs), defs)
    item = _any_call(tools, "arguments", True, defs)
    return _rooted({"type": "array", "items": item, "minItems": 1} if parallel else item, defs)


def _one_call(t: Tool, key: str, held: bool, defs: dict | None = None) -> dict:
    """The schema of a call of ``t``: ``{"name": <const>, key: <arguments>}``; the arguments
    held to ``t``'s parameters (as under strict mode) when ``held``, else any object.
    Parameters with local references (``#/$defs/...``, ``#``: pydantic's nested models) go
    into ``defs`` as ``tool_<n>``, their references rebased there, and the call refers to
    them: the caller puts ``defs`` at the root (:func:`_rooted`), where they resolve."""
    args = grammar_schema(t.parameters, strict=True) if held else {"type": "object"}
    if held and defs is not None and _has_local_ref(args):
        name = f"tool_{len(defs)}"
        defs[name] = _rebased(args, f"#/$defs/{name}")
        args = {"$ref": f"#/$defs/{name}"}
    return {"type": "object", "properties": {"name": {"const": t.name}, key: args},
            "required": ["name", key], "additionalProperties": False}


def _any_call(tools: list[Tool], key: str, held: bool | None, defs: dict | None = None) -> dict:
    """A call of any of ``tools`` (:func:`_one_call`; ``held`` ``None``: each tool's own
    ``strict``)."""
    calls = [_one_call(t, key, t.strict if held is None else held, defs) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _any_call_rooted(tools: list[Tool], key: str) -> dict:
    """:func:`_any_call` with each tool's own ``strict``, its ``defs`` at its root."""
    defs: dict = {}
    return _rooted(_any_call(tools, key, None, defs), defs)


def _rooted(schema: dict, defs: dict) -> dict:
    """``schema`` with ``defs`` (:func:`_one_call`'s) as its root ``$defs``."""
    return {**schema, "$defs": defs} if defs else schema


def _has_local_ref(x) -> bool:
    """Whether a schema holds a ``$ref`` into its own document (``#...``)."""
    if isinstance(x, dict):
        return any((k == "$ref" and isinstance(v, str) and v.startswith("#"))
                   or _has_local_ref(v) for k, v in x.items())
    return isinstance(x, list) and any(_has_local_ref(v) for v in x)


def _rebased(x, root: str):
    """A schema with its local references (``#/a/b``, ``#``) made relative to ``root``."""
    if isinstance(x, dict):
        return {k: (root + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebased(v, root)) for k, v in x.items()}
    if isinstance(x, list):
        return [_rebased(v, root) for v in x]
    return x


#: What a lazy grammar's free text may be: anything (Hermes: a call opens at its marker), or
#: for Llama 3 anything that does not start as a call does (a ``{``, or ``<|`` of the tag).
_ANY_TEXT = r"(.|\n)*"
_NOT_A_CALL = r"\s*([^\s{<](.|\n)*|<([^|](.|\n)*)?)?"


def lazy_call_grammar(tools: list[Tool], fmt: str, control: dict[str, int],
                      json_options: dict, several: bool = True) -> str:
    """The Lark grammar (llguidance's) of ``tool_choice`` ``auto`` with tools that are
    ``strict``: the model writes free text, and once it starts a call -- its format's opening
    marker written -- the call is held to a call schema (:func:`_any_call`: the strict tools'
    arguments to their parameters, the others' to any object). llama.cpp calls this a lazy
    grammar.

    Args:
        fmt: :data:`~.tool_calls.HERMES` (``<tool_call>`` blocks anywhere in the text),
            :data:`~.tool_calls.LLAMA3` (the answer is calls, or text that does not start
            like one) or :data:`~.tool_calls.MISTRAL` (text, then ``[TOOL_CALLS]`` and the
            calls: a JSON list, or ``name[ARGS]{...}`` each).
        control: the markers that are control tokens of the vocabulary, by their text, and
            their ids (:func:`~.tool_calls.marker_tokens`): named as tokens, not text.
        json_options: llguidance's JSON options for the call (``x-guidance``).
        several: more than one call may be made (``parallel_tool_calls`` not false; a single
            Hermes call is ended by its stop string instead).
    """
    def marker(m: str) -> str:
        return f"<[{control[m]}]>" if m in control else json.dumps(m)

    def schema(s: dict) -> str:
        return "%json " + json.dumps({**s, "x-guidance": json_options}, ensure_ascii=False)

    if fmt == tc.HERMES:
        return (f"%llguidance {{}}\nstart: call* TEXT\n"
                f'call: call_open "\\n"? {schema(_any_call_rooted(tools, "arguments"))} '
                f'"\\n"? {marker(tc.TOOL_CALL_CLOSE)}\n'
                f"call_open[lazy]: TEXT {marker(tc.TOOL_CALL_OPEN)}\n"
                f"TEXT: /{_ANY_TEXT}/\n")
    if fmt == tc.LLAMA3:
        more = ' (";" WS? call)*' if several else ""
        return (f"%llguidance {{}}\n"
                f'start: TEXT | WS? {marker(tc.PYTHON_TAG)}? call{more}\n'
                f'call: {schema(_any_call_rooted(tools, "parameters"))}\n'
                f"TEXT: /{_NOT_A_CALL}/\nWS: /\\s+/\n")
    return _mistral_grammar(tools, marker, schema, several)


def _mistral_grammar(tools: list[Tool], marker, schema, several: bool) -> str:
    """:func:`lazy_call_grammar` for Mistral's ``[TOOL_CALLS]``: after it, a JSON list of
    calls (Mistral Nemo) or ``name[ARGS]{...}`` (Mistral Small 3.2), as
    :func:`~.tool_calls.parse_mistral` reads them."""
    opener = marker(tc.MISTRAL_CALLS)
    named = " | ".join(
        f'{json.dumps(t.name)} {marker("[ARGS]")} '
        f'{schema(_one_call(t, "arguments", t.strict)["properties"]["arguments"])}'
        for t in tools)
    listed = ' ("," WS? call)*' if several else ""
    more = f" ({opener} WS? named)*" if several else ""
    if opener.startswith("<["):             # a control token: free text cannot hold it
        start = f"start: TEXT | TEXT? {opener} WS? calls\n"
    else:                                   # text: the calls begin once it is written
        start = f"start: TEXT | calls_open WS? calls\ncalls_open[lazy]: TEXT {opener}\n"
    return (f"%llguidance {{}}\n{start}"
            f'calls: "[" WS? call{listed} WS? "]" | named{more}\n'
            f'call: {schema(_any_call_rooted(tools, "arguments"))}\n'
            f"named: {named}\n"
            f"TEXT: /{_ANY_TEXT}/\nWS: /\\s+/\n")


def tools_system_prompt(tools: list[Tool]) -> str:
    """The tools as a system prompt in the Hermes format (Qwen2.5's wording), for a chat
    template that renders no tools of its own; the answer is then parsed as
    :data:`~.tool_calls.HERMES`."""
    lines = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{lines}\n</tools>\n\nFor each function call, return a json object with "
            "function name and arguments within <tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")
