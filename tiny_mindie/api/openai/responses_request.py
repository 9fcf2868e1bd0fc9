"""OpenAI Responses request bodies (``POST /v1/responses``) checked and translated into a chat
completions body (:func:`to_chat`), which the chat pipeline validates further and runs
(:mod:`.bridge`).

``input`` is a string (one user message) or a list of items: messages (``role`` ``user``,
``system``, ``developer`` or ``assistant``; content a string or ``input_text`` /
``output_text`` / ``refusal`` parts), ``function_call`` and ``function_call_output`` items (an
assistant's tool calls and their results), ``reasoning`` items (the reasoning of the next
assistant message). ``instructions`` is the first, system message. ``tools`` are function tools
(``strict`` true unless sent false, as OpenAI's Responses API has it), ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``text``, ``json_object``, ``json_schema``) ->
``response_format``, ``max_output_tokens``, ``temperature``, ``top_p``, ``seed`` (an
extension), ``reasoning.effort`` (``"none"`` turns a thinking template's thinking off).

Fields that change nothing in the answer are accepted: ``store`` false (nothing is stored),
``metadata`` (echoed), ``user``, ``safety_identifier``, ``prompt_cache_key``,
``prompt_cache_retention``, ``service_tier``, ``include`` empty, ``truncation`` ``disabled``,
``background`` false, ``top_logprobs`` 0, ``stream_options``. Anything else -- responses kept
on the server (``store`` true, ``previous_response_id``, ``conversation``, ``prompt``), an
unknown field, another tool type -- is a 400 naming it.
"""

from __future__ import annotations

import json

from ..chat.structured import unknown_parameter
from ..errors import APIError, bad

#: Fields translated into the chat body, or read by the answer.
USED = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
        "text", "max_output_tokens", "temperature", "top_p", "seed", "reasoning", "stream")
#: Fields that change nothing in the answer: each with the values that do not (``None``: any).
NEUTRAL = {"store": (False,), "metadata": None, "user": None, "safety_identifier": None,
           "prompt_cache_key": None, "prompt_cache_retention": None, "service_tier": None,
           "include": ([],), "truncation": ("disabled",), "background": (False,),
           "top_logprobs": (0,), "stream_options": None}
#: Fields that need responses kept on the server, which it does not keep.
STORED = ("previous_response_id", "conversation", "prompt")
ROLES = ("user", "system", "developer", "assistant")
#: The keys each input item may have besides ``type`` (those that change nothing: ``id``,
#: ``status``; a part's ``annotations``, ``logprobs``).
ITEM_KEYS = {"message": {"role", "content", "id", "status", "phase"},
             "function_call": {"call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"call_id", "output", "id", "status"},
             "reasoning": {"summary", "content", "id", "status", "encrypted_content"}}


def unknown(name: str, why: str = "") -> APIError:
    """400 ``unknown_parameter`` naming ``name`` (:func:`~..chat.structured.unknown_parameter`),
    ``why`` after its message."""
    err = unknown_parameter(name)
    err.message += why
    return err


def check_fields(obj: dict) -> None:
    """Every field of ``obj`` is one of :data:`USED`, or :data:`NEUTRAL` with a neutral value.

    Raises:
        APIError: 400 naming the first that is not (``unknown_parameter`` for an unknown one).
    """
    for name, value in obj.items():
        if name in USED or value is None:
            continue
        if name in STORED or (name == "store" and value is True):
            raise bad(f"Parameter {name} is not supported: this server keeps no responses "
                      "(send the whole conversation as input).", name)
        if name not in NEUTRAL:
            raise unknown(name)
        if NEUTRAL[name] is not None and value not in NEUTRAL[name]:
            raise bad(f"Parameter {name} is only supported as "
                      f"{' or '.join(json.dumps(v) for v in NEUTRAL[name])}.", name)
    if not isinstance(obj.get("metadata") or {}, dict):
        raise bad("Parameter metadata must be an object.", "metadata")


def to_chat(obj: dict) -> tuple[dict, list[str]]:
    """The chat completions body of a Responses body (checked by :func:`check_fields`), and
    per chat message the field that sent it (``instructions``, ``input[3]``).

    Raises:
        APIError: 400 naming a bad ``input`` item, tool, ``tool_choice``, ``text`` or
            ``reasoning``.
    """
    chat = {k: obj[k] for k in ("model", "temperature", "top_p", "seed", "stream",
                                "parallel_tool_calls") if obj.get(k) is not None}
    origins: list[str] = []
    chat["messages"] = messages(obj.get("input"), obj.get("instructions"), origins)
    if obj.get("max_output_tokens") is not None:
        chat["max_tokens"] = obj["max_output_tokens"]
    if obj.get("tools") is not None:
        chat["tools"] = tools(obj["tools"])
    if obj.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(obj["tool_choice"])
    fmt = text_format(obj.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    chat.update(reasoning(obj.get("reasoning")))
    return chat, origins


def messages(value, instructions, origins: list[str]) -> list[dict]:
    """``instructions`` and ``input`` as chat messages; appends to ``origins`` the field
    each came from."""
    out = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("Parameter instructions must be a string.", "instructions")
        out.append({"role": "system", "content": instructions})
        origins.append("instructions")
    if isinstance(value, str):
        origins.append("input")
        return [*out, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("Parameter input must be a string or a non-empty list of input items.",
                  "input")
    thought = None
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEM_KEYS:
            raise bad(f"input[{i}].type must be one of {', '.join(ITEM_KEYS)}, got "
                      f"{json.dumps(kind)}.", f"input[{i}].type")
        extra = _set(item) - ITEM_KEYS[kind] - {"type"}
        if extra:
            raise unknown(f"input[{i}].{sorted(extra)[0]}")
        if kind == "reasoning":
            thought = _reasoning_text(item, i)
            continue
        _add_item(out, kind, item, i, thought)
        origins += [f"input[{i}]"] * (len(out) - len(origins))
        thought = None
    return out


def _set(obj: dict) -> set[str]:
    """The keys of ``obj`` that are set (not null: a client's model dumped whole)."""
    return {k for k, v in obj.items() if v is not None}


def _add_item(out: list[dict], kind: str, item: dict, i: int, thought: str | None) -> None:
    """One ``input`` item (not ``reasoning``) onto the chat messages ``out``; ``thought``:
    the reasoning item before it."""
    where = f"input[{i}]"
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad(f"{where}.call_id must be a string.", f"{where}.call_id")
        out.append({"role": "tool", "tool_call_id": item["call_id"],
                    "content": _text(item.get("output"), f"{where}.output")})
        return
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise bad(f"{where}.{key} must be a string.", f"{where}.{key}")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and thought is None:
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call],
                        **({"reasoning_content": thought} if thought else {})})
        return
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}.",
                  f"{where}.role")
    message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
    if thought and role == "assistant":
        message["reasoning_content"] = thought
    out.append(message)


def _text(content, where: str) -> str:
    """A message's content, or a call's output: a string, or text parts (``input_text``,
    ``output_text``, ``refusal``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of text parts.", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "refusal") \
                or not isinstance(part.get(key), str):
            raise bad(f"{where}[{k}] must be a text part (input_text, output_text or refusal "
                      f"with its text); got type {json.dumps(kind)}.", where)
        extra = _set(part) - {"type", key, "annotations", "logprobs"}
        if extra:
            raise unknown(f"{where}[{k}].{sorted(extra)[0]}")
        texts.append(part[key])
    return "".join(texts)


def _reasoning_text(item: dict, i: int) -> str:
    """A ``reasoning`` item's text: its ``content`` (``reasoning_text`` parts), else its
    ``summary`` (``summary_text`` parts)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
                isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
                for p in parts):
            raise bad(f"input[{i}].{key} must be a list of {kind} parts.", f"input[{i}].{key}")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def tools(value) -> list:
    """Responses' function tools (``{"type": "function", "name", "description",
    "parameters", "strict"}``) as chat's (``strict`` true unless false)."""
    if not isinstance(value, list):
        raise bad("Parameter tools must be a list of tools.", "tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools[{i}].type {json.dumps(kind)} is not supported: only function "
                      "tools are.", "tools")
        fn = {k: v for k, v in t.items() if k != "type" and v is not None}
        fn.setdefault("strict", True)
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(value):
    """``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function", "name"}``,
    as chat's."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {
            "type", "name"}:
        return {"type": "function", "function": {"name": value["name"]}}
    raise bad("Parameter tool_choice must be 'none', 'auto', 'required' or "
              "{'type': 'function', 'name': ...}.", "tool_choice")


def text_format(value) -> dict | None:
    """``text.format`` as chat's ``response_format`` (``None``: plain text)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("Parameter text must be an object.", "text")
    extra = set(value) - {"format", "verbosity"}
    if extra:
        raise unknown(f"text.{sorted(extra)[0]}")
    if value.get("verbosity") is not None:
        raise bad("Parameter text.verbosity is not supported.", "text.verbosity")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise bad("Parameter text.format.type must be 'text', 'json_object' or "
                  "'json_schema'.", "text.format")
    if fmt["type"] == "json_schema":
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    if set(fmt) != {"type"}:
        raise unknown(f"text.format.{sorted(set(fmt) - {'type'})[0]}")
    return None if fmt["type"] == "text" else {"type": "json_object"}


def reasoning(value) -> dict:
    """``reasoning`` as the chat's fields: ``effort`` ``"none"`` turns thinking off
    (``chat_template_kwargs.enable_thinking`` false), any other asks for it
    (``reasoning_effort``: a model that does not think answers 400)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("Parameter reasoning must be an object.", "reasoning")
    extra = set(value) - {"effort", "summary", "generate_summary"}
    if extra:
        raise unknown(f"reasoning.{sorted(extra)[0]}")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            raise bad(f"Parameter reasoning.{key} is not supported: the reasoning comes whole, "
                      "in the reasoning item's content.", f"reasoning.{key}")
    effort = value.get("effort")
    if effort == "none":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    return {"reasoning_effort": effort or "medium"}
