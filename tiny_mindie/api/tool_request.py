"""A chat request's tools: ``tools`` and ``tool_choice`` validated, the tools written as a
system prompt for a template that renders none of its own, and the JSON schema decoding is held
to when a call is forced (``tool_choice`` ``required`` or a named function). Pure functions, no
I/O, no model; what the model writes back is :mod:`.tool_calls`' to parse.
"""

from __future__ import annotations

import dataclasses
import json
import re

from .errors import bad
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
    def one(t: Tool) -> dict:
        return {"type": "object", "properties": {"name": {"const": t.name},
                                                 "arguments": grammar_schema(t.parameters,
                                                                             strict=True)},
                "required": ["name", "arguments"], "additionalProperties": False}

    if choice.mode == "function":
        return one(next(t for t in tools if t.name == choice.name))
    calls = [one(t) for t in tools]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": item, "minItems": 1} if parallel else item


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
