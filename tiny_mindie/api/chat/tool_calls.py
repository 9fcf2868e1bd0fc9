"""Tool calls on the OpenAI chat route: the formats a chat model writes its calls in, and its
output split into reasoning, content and tool calls -- pure functions and one small incremental
parser, no I/O, no model (the request's ``tools`` are :mod:`.tool_request`'s).

Tool-call formats (:func:`detect_format` picks one from the chat template's text):

``hermes``
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, anywhere in the
    answer (Qwen2.5, Qwen3, Hermes 2/3 templates; also the tools prompt this server writes for a
    template that renders no tools, :func:`~.tool_request.tools_system_prompt`).
``llama3_json``
    Llama 3.1+: the answer *is* ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>``
    before it optional; several joined by ``;``).
``mistral``
    ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral Nemo) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral Small 3.2, Devstral), after optional text.
``json``
    The whole answer is ``{"name": ..., "arguments": {...}}`` or a list of those: the output of
    ``tool_choice`` ``required`` or a named function, which decoding is constrained to
    (:func:`~.tool_request.call_schema`).

With tools offered (``schemas``), a fenced JSON block (`````json`` ... `````) that ends the
answer and is a valid call of an offered function is a call too, in any of the first three
formats (:func:`fenced_call`).

Reasoning: for a template that thinks (``</think>`` in its text: Qwen3, DeepSeek-R1 distills,
SmolLM3), ``<think>...</think>`` at the start of the answer -- or everything up to ``</think>``
when the prompt itself ends inside ``<think>`` -- is the reasoning, the rest the answer.

:class:`OutputParser` does the split as text comes (streaming), holding back only text that may
still turn out to be a marker (``<tool_call``, ``</thi``, a backtick) or a call;
:func:`parse_output` is the same parser fed the whole text at once, so a streamed answer
reassembles to the plain one.
Reasoning, content and the text around calls are stripped of surrounding whitespace.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string

HERMES, LLAMA3, MISTRAL, JSON = "hermes", "llama3_json", "mistral", "json"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, MISTRAL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
#: A call written as a fenced JSON block (:func:`fenced_call`).
FENCE_OPEN, FENCE_CLOSE = "```json", "```"
#: The markers the parsers read. Where the vocabulary has one as a control token (Mistral's
#: ``[TOOL_CALLS]`` and ``[ARGS]``, Llama's ``<|python_tag|>``), the token adds no text to the
#: answer, and its stored text is fed to the parser instead (:func:`marker_tokens`).
MARKERS = (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, PYTHON_TAG, MISTRAL_CALLS,
           "[ARGS]", "[CALL_ID]")

_ALNUM = string.ascii_letters + string.digits
_SPACE = re.compile(r"\s*")


def detect_format(template: str) -> str | None:
    """The tool-call format a chat template teaches its model (by the template's text), or
    ``None`` when it is none of :data:`HERMES`, :data:`LLAMA3`, :data:`MISTRAL`."""
    if TOOL_CALL_OPEN in template:
        return HERMES
    if MISTRAL_CALLS in template:
        return MISTRAL
    if '"parameters": ' in template and ("<|start_header_id|>" in template
                                         or PYTHON_TAG in template):
        return LLAMA3
    return None


def thinks(template: str) -> bool:
    """Whether a chat template is a reasoning model's (it writes or strips ``</think>``)."""
    return THINK_CLOSE in template


def call_id(fmt: str | None) -> str:
    """A new tool call id: ``call_`` and 24 random hex digits; 9 random letters and digits for
    :data:`MISTRAL` (its template refuses other ids in later turns)."""
    if fmt == MISTRAL:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# ---- output ------------------------------------------------------------------------------
def marker_tokens(tok) -> dict[int, str]:
    """Token id -> marker text, for each of :data:`MARKERS` that is one token of ``tok``'s
    vocabulary adding no text to the output (a control token)."""
    out = {}
    for m in MARKERS:
        i = tok.token_to_id(m)
        if i is not None and not tok.token_bytes(i):
            out[i] = m
    return out


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


def _call(obj, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """``obj`` (parsed JSON) as a call: an object with a string ``name`` and an object (or a
    JSON text of one) under one of ``keys``; else ``None``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_hermes_block(block: str) -> ToolCall | None:
    """``<tool_call>{...}</tool_call>`` (closing tag optional) as a call, else ``None``."""
    body = block[len(TOOL_CALL_OPEN):]
    if body.endswith(TOOL_CALL_CLOSE):
        body = body[:-len(TOOL_CALL_CLOSE)]
    return _call(_loads(body.strip()))


def parse_llama3(text: str) -> tuple[list[ToolCall], str] | None:
    """Llama 3.1+'s answer ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]`` as
    its calls and the text after them; ``None`` when it does not start with a call."""
    s = text.lstrip()
    if s.startswith(PYTHON_TAG):
        s = s[len(PYTHON_TAG):].lstrip()
    dec, calls, pos = json.JSONDecoder(), [], 0
    while True:
        try:
            obj, end = dec.raw_decode(s, pos)
        except (ValueError, RecursionError):
            break
        call = _call(obj)
        if call is None:
            break
        calls.append(call)
        pos = end
        after = _SPACE.match(s, pos).end()     # no copies of the rest: linear in the calls
        if not s.startswith(";", after):
            break
        pos = _SPACE.match(s, after + 1).end()
    if not calls:
        return None
    return calls, s[pos:]


def parse_mistral(after: str) -> list[ToolCall] | None:
    """What follows ``[TOOL_CALLS]``: a JSON list of calls, or ``name[ARGS]{...}`` (with an
    optional ``[CALL_ID]id`` before ``[ARGS]``) repeated; ``None`` unless it is all calls."""
    s = after.strip()
    if s.startswith("["):
        objs = _loads(s)
        if isinstance(objs, dict):
            objs = [objs]
        if not isinstance(objs, list) or not objs:
            return None
        calls = [_call(o) for o in objs]
        return None if None in calls else calls
    calls = []
    for part in s.split(MISTRAL_CALLS):
        name, sep, args = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        call = _call({"name": name, "arguments": _loads(args.strip())}) if sep else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


def parse_json_calls(text: str) -> list[ToolCall] | None:
    """The constrained answer of ``required``/a named function
    (:func:`~.tool_request.call_schema`): one call object or a list of them; ``None`` unless it
    is all calls (a cut-off answer is not)."""
    obj = _loads(text.strip())
    objs = obj if isinstance(obj, list) else [obj]
    calls = [_call(o, ("arguments",)) for o in objs]
    return None if not calls or None in calls else calls


def fenced_call(block: str, schemas: dict) -> ToolCall | None:
    """A fenced block, `````json`` + ``{"name": ..., "arguments": {...}}`` + `````, as a call
    (``parameters`` for ``arguments`` too): the way Qwen2.5-Coder answers with tools offered
    instead of its template's ``<tool_call>``. A call only when the name is one of
    ``schemas`` (name -> the function's JSON schema) and the arguments are valid against that
    schema; else ``None`` (the block stays content: an example, or a call the client could
    not run)."""
    import jsonschema

    call = _call(_loads(block[len(FENCE_OPEN):-len(FENCE_CLOSE)].strip()))
    if call is None or call.name not in schemas:
        return None
    try:
        valid = jsonschema.Draft202012Validator(schemas[call.name]).is_valid(
            json.loads(call.arguments))
    except Exception:       # a schema the validator cannot follow (a $ref to nowhere)
        valid = False
    return call if valid else None


class _Segment:
    """Pieces of one text (the reasoning, or the content) as they come, stripped of leading and
    trailing whitespace: trailing whitespace is held until more text follows."""

    def __init__(self):
        self.started = False
        self.held = ""
        self.any = False

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        full = self.held + text
        out = full.rstrip()
        self.held = full[len(out):]
        self.any = self.any or bool(out)
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is the start of ``marker`` (to hold back)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclasses.dataclass
class Output:
    """An answer split: reasoning and content (each ``None`` when empty) and calls."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]


class OutputParser:
    """Splits a chat answer, fed as it comes, into reasoning, content and tool calls.

    Args:
        fmt: the tool-call format to parse (:func:`detect_format`, :data:`JSON`), or ``None``
            for none (``tool_choice`` ``none``, no tools).
        reasoning: whether the template thinks (:func:`thinks`): a leading ``<think>`` opens
            the reasoning.
        in_reasoning: the prompt ends inside ``<think>``: the answer starts in the reasoning.
        names: the functions that may be called (the request's ``tools``), or ``None`` for
            any: a call to another one is no call, its text stays content.
        schemas: the offered functions' parameters by name, or ``None``: with one of
            :data:`HERMES`, :data:`LLAMA3`, :data:`MISTRAL`, a fenced JSON block ending the
            answer is also read as a call (:func:`fenced_call`).

    :meth:`feed` and :meth:`finish` return deltas: ``("reasoning", text)``, ``("content",
    text)``, ``("call", ToolCall)``. :attr:`thinking` says whether the text fed so far ends
    inside the reasoning.
    """

    def __init__(self, fmt: str | None, *, reasoning: bool = False, in_reasoning: bool = False,
                 names: frozenset[str] | None = None, schemas: dict | None = None):
        self.fmt = fmt
        self.names = names
        self.schemas = schemas if fmt in (HERMES, LLAMA3, MISTRAL) else None
        self.fenced: tuple[str, ToolCall] | None = None     # a fenced call, if the answer ends
        self.state = "think" if in_reasoning else "start" if reasoning else "answer"
        self.pending = ""           # text not yet given out
        self.in_call: str | bool = ""   # pending starts with a call (its marker, or True)
        self.plain = fmt is None    # the answer is plain content from here on
        self.reasoning = _Segment()
        self.content = _Segment()

    @property
    def thinking(self) -> bool:
        return self.state == "think"

    def feed(self, text: str) -> list[tuple]:
        """Deltas for ``text`` (the next piece of the answer)."""
        self.pending += text
        out: list[tuple] = []
        if self.state == "start":
            s = self.pending.lstrip()
            if s.startswith(THINK_OPEN):
                self.state, self.pending = "think", s[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(s):
                return out
            else:
                self.state = "answer"
        if self.state == "think":
            i = self.pending.find(THINK_CLOSE)
            if i < 0:
                keep = _partial_suffix(self.pending, THINK_CLOSE)
                self._add(out, "reasoning", self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                return out
            self._add(out, "reasoning", self.pending[:i])
            self.state, self.pending = "answer", self.pending[i + len(THINK_CLOSE):]
        self._answer(out)
        return out

    def _add(self, out: list, kind: str, text: str) -> None:
        piece = (self.reasoning if kind == "reasoning" else self.content).add(text)
        if piece:
            out.append((kind, piece))

    def _answer(self, out: list) -> None:
        """Give out what of ``pending`` (answer text) cannot be part of a call."""
        while self.pending:
            if self.fenced is not None:
                if not self.pending.strip():
                    return              # only whitespace after a fenced call so far
                self._add(out, "content", self.fenced[0])   # text follows: no call
                self.fenced = None
            if self.fmt == LLAMA3 and not self.plain and not self.in_call:
                s = self.pending.lstrip()
                if not s or PYTHON_TAG.startswith(s):
                    return              # maybe a call still
                self.in_call = s.startswith("{") or s.startswith(PYTHON_TAG)
                self.plain = not self.in_call   # Llama calls start the answer: none here
            if self.fmt == JSON or (self.in_call and self.in_call != FENCE_OPEN
                                    and self.fmt != HERMES):
                self.in_call = True     # the calls run to the end
                return
            if not self.in_call:
                openers = self._openers()
                if not openers:
                    self._add(out, "content", self.pending)
                    self.pending = ""
                    return
                self.in_call = self._up_to(out, openers)
                if not self.in_call:
                    return
            if not self._close(out):
                return

    def _openers(self) -> tuple[str, ...]:
        """The markers that may open a call in the answer text from here on."""
        own = {HERMES: (TOOL_CALL_OPEN,), MISTRAL: (MISTRAL_CALLS,)}.get(self.fmt, ())
        return (() if self.plain else own) + ((FENCE_OPEN,) if self.schemas else ())

    def _close(self, out: list) -> bool:
        """With :attr:`pending` starting with a Hermes block or a fenced block: give it out
        once its closing marker came (True), else hold it (False)."""
        fence = self.in_call == FENCE_OPEN
        close = FENCE_CLOSE if fence else TOOL_CALL_CLOSE
        j = self.pending.find(close, len(self.in_call))
        if j < 0:
            return False
        block = self.pending[:j + len(close)]
        self.pending, self.in_call = self.pending[len(block):], ""
        if not fence:
            self._block(out, block)
            return True
        call = fenced_call(block, self.schemas)
        if call is None:
            self._add(out, "content", block)
        else:
            self.fenced = (block, call)
        return True

    def _up_to(self, out: list, markers: tuple[str, ...]) -> str:
        """Give out as content the text of :attr:`pending` before the first of ``markers``,
        holding back an end that may still become one; the marker ``pending`` now starts with,
        or ``""``."""
        found = [(i, m) for m in markers if (i := self.pending.find(m)) >= 0]
        if not found:
            hold = max(_partial_suffix(self.pending, m) for m in markers)
            keep = len(self.pending) - hold
            self._add(out, "content", self.pending[:keep])
            self.pending = self.pending[keep:]
            return ""
        i, marker = min(found)
        self._add(out, "content", self.pending[:i])
        self.pending = self.pending[i:]
        return marker

    def _known(self, calls: list[ToolCall] | None) -> list[ToolCall] | None:
        """``calls`` when each is to a function of :attr:`names`, else ``None``."""
        if calls and self.names is not None and any(c.name not in self.names for c in calls):
            return None
        return calls

    def _block(self, out: list, block: str) -> None:
        call = parse_hermes_block(block)
        if self._known([call] if call else None) is None:
            self._add(out, "content", block)
        else:
            out.append(("call", call))

    def finish(self) -> list[tuple]:
        """The deltas of the text still held, the answer being complete (or cut off)."""
        out: list[tuple] = []
        rest, self.pending = self.pending, ""
        if self.state in ("start", "think"):
            self._add(out, "reasoning" if self.state == "think" else "content", rest)
            return out
        if self.fenced is not None:     # nothing but whitespace came after the block
            out.append(("call", self.fenced[1]))
            self.fenced = None
        if not rest:
            return out
        if self.plain or not self.in_call or self.in_call == FENCE_OPEN:
            self._add(out, "content", rest)
        elif self.fmt == HERMES:
            self._block(out, rest)
        elif self.fmt == MISTRAL:
            calls = self._known(parse_mistral(rest[len(MISTRAL_CALLS):]))
            if calls is None:
                self._add(out, "content", rest)
            out.extend(("call", c) for c in calls or ())
        elif self.fmt == LLAMA3:
            got = parse_llama3(rest)
            if got is not None and self._known(got[0]) is None:
                got = None
            if got is None:
                self._add(out, "content", rest)
            else:
                out.extend(("call", c) for c in got[0])
                self._add(out, "content", got[1])
        else:
            calls = self._known(parse_json_calls(rest))
            if calls is None:
                self._add(out, "content", rest)
            out.extend(("call", c) for c in calls or ())
        return out


def collect(deltas: list[tuple]) -> Output:
    """Deltas (:class:`OutputParser`'s) put together."""
    reasoning = "".join(d[1] for d in deltas if d[0] == "reasoning")
    content = "".join(d[1] for d in deltas if d[0] == "content")
    return Output(reasoning or None, content or None, [d[1] for d in deltas if d[0] == "call"])


def parse_output(text: str, fmt: str | None, *, reasoning: bool = False,
                 in_reasoning: bool = False, names: frozenset[str] | None = None,
                 schemas: dict | None = None) -> Output:
    """A whole answer split (:class:`OutputParser` fed ``text`` at once)."""
    p = OutputParser(fmt, reasoning=reasoning, in_reasoning=in_reasoning, names=names,
                     schemas=schemas)
    return collect(p.feed(text) + p.finish())
