"""Anthropic Messages request bodies (``POST /v1/messages``) checked and translated into a chat
completions body (:func:`to_chat`), which the chat pipeline validates further and runs
(:mod:`.openai.bridge`).

``system`` (a string or text blocks) is the first, system message; ``messages`` alternate
``user`` and ``assistant``, their content a string or blocks: ``text``, ``tool_use`` (an
assistant's call: ``id``, ``name``, ``input``), ``tool_result`` (a user's answer to one:
``tool_use_id``, ``content``, ``is_error``, which writes ``Error: `` before the result; ids as
:func:`chat_call_id`),
``thinking`` (an assistant's reasoning). ``tools`` (``name``, ``description``,
``input_schema``, ``strict``) and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``;
``disable_parallel_tool_use``) are the chat's tools; ``max_tokens`` (required),
``stop_sequences``, ``temperature`` (0 to 1), ``top_p``, ``top_k``, ``seed`` (an extension),
``thinking`` (``disabled``; ``adaptive`` for a template that thinks; a thinking budget cannot
be held, so ``enabled`` is refused), ``output_config.format`` (a JSON schema the answer is held
to). ``metadata``, ``service_tier`` and ``cache_control`` (also on blocks) change nothing and
are accepted; any other field is a 400 naming it.
"""

from __future__ import annotations

import json

from .errors import bad

#: The fields read, and those accepted that change nothing in the answer.
FIELDS = ("model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
          "top_p", "top_k", "seed", "stream", "tools", "tool_choice", "thinking",
          "output_config", "metadata", "service_tier", "cache_control")
BLOCK_KEYS = {"text": {"text", "cache_control", "citations"},
              "tool_use": {"id", "name", "input", "cache_control"},
              "tool_result": {"tool_use_id", "content", "is_error", "cache_control"},
              "thinking": {"thinking", "signature"}}
TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control", "strict"}


def tool_use_id(call_id: str) -> str:
    """The ``tool_use`` id of a chat call id (``call_<hex>``, or Mistral's 9 letters and
    digits): ``toolu_`` and the id past its ``call_``."""
    return "toolu_" + call_id.removeprefix("call_")


def chat_call_id(use_id: str) -> str:
    """The chat call id of a ``tool_use`` id: :func:`tool_use_id`'s Mistral-shaped id
    (``toolu_`` and 9 letters and digits, which Mistral's template requires) without its
    ``toolu_``; any other unchanged."""
    rest = use_id.removeprefix("toolu_")
    return rest if len(rest) == 9 and rest.isascii() and rest.isalnum() else use_id


def extra_input(name: str):
    """400 for a field this route does not know, in Anthropic's words."""
    return bad(f"{name}: Extra inputs are not permitted", name)


def to_chat(obj: dict) -> tuple[dict, list[str]]:
    """The chat completions body of a Messages body, and per chat message the field that
    sent it (``system``, ``messages.2``).

    Raises:
        APIError: 400 naming an unknown or bad field, block, tool or ``tool_choice``.
    """
    for name in obj:
        if name not in FIELDS:
            raise extra_input(name)
    for name in ("model", "max_tokens", "messages"):
        if obj.get(name) is None:
            raise bad(f"{name}: Field required", name)
    temperature = obj.get("temperature")
    if isinstance(temperature, int | float) and not 0 <= temperature <= 1:
        raise bad(f"temperature: must be in [0, 1], got {temperature}.", "temperature")
    chat = {k: obj[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "seed",
                                "stream") if obj.get(k) is not None}
    chat["messages"] = _system(obj.get("system")) + messages(obj["messages"])
    origins = ["system"] * (obj.get("system") is not None)
    for i, m in enumerate(obj["messages"]):
        content = m["content"] if isinstance(m["content"], list) else ()
        results = [k for k, b in enumerate(content) if b["type"] == "tool_result"]
        origins += [f"messages.{i}.content.{k}" for k in results]
        texts = len(results) < len(content) or not results
        origins += [f"messages.{i}"] * (m["role"] == "assistant" or texts)
    if obj.get("stop_sequences") is not None:
        if not isinstance(obj["stop_sequences"], list):
            raise bad("stop_sequences: Input should be a valid list.", "stop_sequences")
        chat["stop"] = obj["stop_sequences"]
    if obj.get("tools") is not None:
        chat["tools"] = tools(obj["tools"])
    chat.update(tool_choice(obj.get("tool_choice")))
    chat.update(thinking(obj.get("thinking")))
    chat.update(output_config(obj.get("output_config")))
    return chat, origins


def _system(value) -> list[dict]:
    if value is None:
        return []
    return [{"role": "system", "content": _text_blocks(value, "system")}]


def _text_blocks(value, where: str) -> str:
    """A string, or ``text`` blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"{where}: must be a string or a list of text blocks.", where)
    for k, b in enumerate(value):
        _check_block(b, f"{where}.{k}", ("text",))
    return "".join(b["text"] for b in value)


def _check_block(b, where: str, kinds: tuple[str, ...]) -> str:
    """A content block's ``type``, checked to be one of ``kinds`` with known keys."""
    kind = b.get("type") if isinstance(b, dict) else None
    if kind not in kinds:
        raise bad(f"{where}.type: must be one of {', '.join(kinds)} here, got "
                  f"{json.dumps(kind)}.", where)
    extra = {k for k, v in b.items() if v is not None} - BLOCK_KEYS[kind] - {"type"}
    if extra:
        raise extra_input(f"{where}.{sorted(extra)[0]}")
    key = {"text": "text", "thinking": "thinking"}.get(kind)
    if key and not isinstance(b.get(key), str):
        raise bad(f"{where}.{key}: must be a string.", where)
    return kind


def messages(value) -> list[dict]:
    """``messages`` as chat messages: a user's ``tool_result`` blocks each a ``tool``
    message, then its text; an assistant's ``tool_use`` blocks its ``tool_calls``."""
    if not isinstance(value, list) or not value:
        raise bad("messages: must be a non-empty list of messages.", "messages")
    out = []
    for i, m in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role: must be 'user' or 'assistant'.", where)
        if set(m) - {"role", "content"}:
            raise extra_input(f"{where}.{sorted(set(m) - {'role', 'content'})[0]}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif not isinstance(content, list):
            raise bad(f"{where}.content: must be a string or a list of blocks.", where)
        elif m["role"] == "user":
            out += _user(content, where)
        else:
            out.append(_assistant(content, where))
    return out


def _user(blocks: list, where: str) -> list[dict]:
    out, texts = [], []
    for k, b in enumerate(blocks):
        kind = _check_block(b, f"{where}.content.{k}", ("text", "tool_result"))
        if kind == "text":
            texts.append(b["text"])
            continue
        if not isinstance(b.get("tool_use_id"), str):
            raise bad(f"{where}.content.{k}.tool_use_id: must be a string.", where)
        result = _text_blocks(b.get("content") or "", f"{where}.content.{k}.content")
        if b.get("is_error") is True:
            result = "Error: " + result
        out.append({"role": "tool", "tool_call_id": chat_call_id(b["tool_use_id"]),
                    "content": result})
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: list, where: str) -> dict:
    texts, calls, thought = [], [], []
    for k, b in enumerate(blocks):
        kind = _check_block(b, f"{where}.content.{k}", ("text", "tool_use", "thinking"))
        if kind == "text":
            texts.append(b["text"])
        elif kind == "thinking":
            thought.append(b["thinking"])
        else:
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input"), dict):
                raise bad(f"{where}.content.{k}: a tool_use block needs a string id and name "
                          "and an object input.", where)
            calls.append({"id": chat_call_id(b["id"]), "type": "function",
                          "function": {"name": b["name"],
                                       "arguments": json.dumps(b["input"], ensure_ascii=False)}})
    out = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thought:
        out["reasoning_content"] = "".join(thought)
    return out


def tools(value) -> list[dict]:
    """Anthropic's tools (``name``, ``description``, ``input_schema``, ``strict``) as chat's
    function tools; server tools (a ``type`` other than ``custom``) are refused."""
    if not isinstance(value, list):
        raise bad("tools: must be a list of tools.", "tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools.{i}.type: {json.dumps(kind)} is not supported: only custom "
                      "tools (name, description, input_schema) are.", "tools")
        if set(t) - TOOL_KEYS:
            raise extra_input(f"tools.{i}.{sorted(set(t) - TOOL_KEYS)[0]}")
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"tools.{i}.input_schema: Field required (an object, a JSON schema).",
                      "tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        for key in ("description", "strict"):
            if t.get(key) is not None:
                fn[key] = t[key]
        out.append({"type": "function", "function": fn})
    return out


def tool_choice(value) -> dict:
    """``tool_choice`` as the chat's ``tool_choice`` and ``parallel_tool_calls``."""
    if value is None:
        return {}
    modes = {"auto": "auto", "any": "required", "none": "none", "tool": None}
    if not isinstance(value, dict) or value.get("type") not in modes:
        raise bad("tool_choice: must be {'type': 'auto' | 'any' | 'tool' | 'none'}.",
                  "tool_choice")
    extra = set(value) - {"type", "name", "disable_parallel_tool_use"}
    if extra:
        raise extra_input(f"tool_choice.{sorted(extra)[0]}")
    if value["type"] == "tool":
        if not isinstance(value.get("name"), str):
            raise bad("tool_choice.name: Field required for type 'tool'.", "tool_choice")
        out: dict = {"tool_choice": {"type": "function", "function": {"name": value["name"]}}}
    else:
        out = {"tool_choice": modes[value["type"]]}
    off = value.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise bad("tool_choice.disable_parallel_tool_use: must be a boolean.", "tool_choice")
    if off and value["type"] != "none":
        out["parallel_tool_calls"] = False
    return out


def output_config(value) -> dict:
    """``output_config.format`` (``{"type": "json_schema", "schema"}``) as the chat's
    ``response_format``, the schema held as under strict mode; ``effort`` is refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("output_config: must be an object.", "output_config")
    if set(value) - {"format", "effort"}:
        raise extra_input(f"output_config.{sorted(set(value) - {'format', 'effort'})[0]}")
    if value.get("effort") is not None:
        raise bad("output_config.effort: not supported by this server.", "output_config")
    fmt = value.get("format")
    if fmt is None:
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or set(fmt) != {"type", "schema"}:
        raise bad("output_config.format: must be {'type': 'json_schema', 'schema': {...}}.",
                  "output_config")
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": fmt["schema"], "strict": True}}}


def thinking(value) -> dict:
    """``thinking``: ``disabled`` turns a thinking template's thinking off, ``adaptive``
    asks for it (a model that does not think answers 400)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind is not None and set(value) - {"type", "budget_tokens"}:
        raise extra_input(f"thinking.{sorted(set(value) - {'type', 'budget_tokens'})[0]}")
    if kind == "disabled":
        return {"chat_template_kwargs": {"enable_thinking": False}}
    if kind == "adaptive":
        return {"reasoning_effort": "medium"}
    if kind == "enabled":
        raise bad("thinking.budget_tokens: a thinking budget cannot be held by this server; "
                  "use {'type': 'adaptive'} (bounded by max_tokens) or {'type': 'disabled'}.",
                  "thinking")
    raise bad("thinking.type: must be 'adaptive' or 'disabled'.", "thinking")
