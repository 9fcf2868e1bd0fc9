"""Other servers' constraint fields on the OpenAI routes, held by the same grammar engine as
``response_format`` (:mod:`.structured`): vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and ``structured_outputs`` (``{"json" | "regex" |
"choice" | "grammar" | "json_object": ...}``), llama.cpp's top-level ``json_schema`` and
``grammar``.

A grammar is Lark (llguidance's syntax) when a line starts a ``start:`` rule or says
``%llguidance``, else GBNF (llama.cpp's, which vLLM's xgrammar backend reads too), converted
to Lark by llguidance's ``gbnf_to_lark``. A choice is one of the given strings, exactly; a
JSON schema is held as ``response_format``'s ``json_schema`` without ``strict`` holds it.
"""

from __future__ import annotations

import json

from llguidance.gbnf_to_lark import gbnf_to_lark

from ...engine.request import Constraint
from ...model.tokenizer import Tokenizer
from ..errors import bad
from .structured import compiled, grammar_schema, unknown_parameter

#: The top-level fields that constrain the output, besides ``response_format``: the kind of
#: constraint each holds.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar", "structured_outputs": None, "json_schema": "json",
          "grammar": "grammar"}
#: ``structured_outputs``' keys that say what the output is (exactly one of them is sent).
SO_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
            "json_object": "json_object"}
#: ``structured_outputs``' keys accepted without effect: every answer holds to them already
#: (there is no fallback to an unconstrained backend, and JSON has no free whitespace).
SO_NO_EFFECT = ("disable_fallback", "disable_any_whitespace")
MAX_CHOICES = 4096
#: The longest GBNF grammar converted, in characters: llguidance's converter is plain Python,
#: character by character, and gathers a run of comments by repeated concatenation (quadratic
#: in the run); llama.cpp's own grammars are a few KB.
MAX_GBNF = 32 * 1024


def guided_constraint(tokenizer: Tokenizer, obj: dict) -> tuple[str, Constraint] | None:
    """The constraint of the one field of :data:`GUIDED` that ``obj`` sends (not null) and
    that field's name; None when it sends none.

    Raises:
        APIError: 400 naming the field: two of them sent, a malformed value, a grammar,
            regex or schema the engine cannot compile; 400 ``unknown_parameter`` for a key
            of ``structured_outputs`` nothing reads.
    """
    sent = [k for k in GUIDED if obj.get(k) is not None]
    if not sent:
        return None
    if len(sent) > 1:
        raise bad(f"Parameters {sent[0]} and {sent[1]} both constrain the output: send one.",
                  sent[1])
    name = sent[0]
    if name == "structured_outputs":
        return name, _structured_outputs(tokenizer, obj[name])
    return name, _constraint(tokenizer, GUIDED[name], obj[name], name)


def _structured_outputs(tokenizer: Tokenizer, value) -> Constraint:
    """vLLM's ``structured_outputs`` object: one of :data:`SO_KINDS`, and
    ``disable_additional_properties`` (closes a schema's objects, as ``strict`` does)."""
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise bad(f"Parameter {where} must be an object.", where)
    for key, v in value.items():
        if key not in SO_KINDS and key not in SO_NO_EFFECT \
                and key != "disable_additional_properties" and v is not None:
            raise unknown_parameter(f"{where}.{key}")
        if key in SO_NO_EFFECT or key == "disable_additional_properties":
            if v is not None and not isinstance(v, bool):
                raise bad(f"{where}.{key} must be a boolean.", where)
    kinds = [k for k in SO_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise bad(f"{where} must hold exactly one of {', '.join(SO_KINDS)}, got "
                  f"{len(kinds)}.", where)
    close = value.get("disable_additional_properties") is True
    return _constraint(tokenizer, SO_KINDS[kinds[0]], value[kinds[0]], f"{where}.{kinds[0]}",
                       close=close)


def _constraint(tokenizer: Tokenizer, kind: str, value, where: str, *,
                close: bool = False) -> Constraint:
    """The compiled constraint of ``value`` read as ``kind`` (``json``: a schema object or its
    JSON text; ``regex``, ``grammar``: a string; ``choice``: a list of strings;
    ``json_object``: true) at ``where``; ``close``: objects closed as :func:`grammar_schema`'s
    ``strict`` closes them."""
    param = where.split(".")[0]

    def fail(message: str):
        return bad(f"{where}: {message}", param)

    if kind == "json_object":
        if value is not True:
            raise fail("must be true")
        return compiled(tokenizer, Constraint("json_object"), fail)
    if kind == "json":
        return compiled(tokenizer, _schema(value, close, fail), fail)
    if kind == "choice":
        return compiled(tokenizer, Constraint("lark", _choice_grammar(value, fail)), fail)
    if not isinstance(value, str) or not value:
        raise fail(f"must be a non-empty string (a {kind}).")
    if kind == "regex":
        return compiled(tokenizer, Constraint("regex", value), fail)
    return compiled(tokenizer, Constraint("lark", lark_grammar(value, fail)), fail)


def _schema(value, close: bool, fail) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise fail(f"is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise fail("must be a JSON schema (an object, or its JSON text).")
    return Constraint("json_schema", json.dumps(grammar_schema(value, strict=close)))


def _choice_grammar(value, fail) -> str:
    """Lark for one of ``value``'s strings, exactly (llguidance's own ``choice`` form)."""
    if not isinstance(value, list) or not value or len(value) > MAX_CHOICES \
            or not all(isinstance(c, str) and c for c in value):
        raise fail(f"must be a list of 1 to {MAX_CHOICES} non-empty strings.")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)


def is_lark(text: str) -> bool:
    """Whether a grammar is Lark rather than GBNF: a line that, past its indentation, starts
    with ``%llguidance`` or a ``start`` rule (``start:``); one pass over the lines."""
    for line in text.splitlines():
        line = line.lstrip()
        if line.startswith("%llguidance"):
            return True
        rest = line[5:].lstrip() if line.startswith("start") else ""
        if rest.startswith(":") and not rest.startswith("::="):
            return True
    return False


def lark_grammar(text: str, fail) -> str:
    """``text`` as Lark: as it is when :func:`is_lark`, else converted from GBNF.

    Raises:
        APIError: ``fail(message)`` when the GBNF cannot be converted or is longer than
            :data:`MAX_GBNF`.
    """
    if is_lark(text):
        return text
    if len(text) > MAX_GBNF:
        raise fail(f"a GBNF grammar may have at most {MAX_GBNF} characters (Lark: no limit).")
    try:
        return gbnf_to_lark(text)
    except RecursionError:
        raise fail("the GBNF grammar nests too deeply.") from None
    except Exception as exc:          # the converter raises its own parse errors
        raise fail(f"the GBNF grammar cannot be read: {exc}") from None
