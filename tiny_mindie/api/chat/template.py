"""Chat templates: a conversation -> the prompt's token ids, as Hugging Face's
``apply_chat_template`` renders it (the GGUF's ``tokenizer.chat_template`` in jinja2's sandbox,
or :data:`CHATML` when the GGUF has none), with only the template's own control tokens parsed:
the client's text stays plain text even where it spells one (:func:`encode_chat`).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

from ...llm import LLM
from ..errors import bad

# A model whose GGUF carries no chat template is prompted in ChatML (llama.cpp's default).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@functools.lru_cache(maxsize=1)
def _template_env():
    """The jinja2 environment chat templates compile in, as Hugging Face's
    ``_compile_jinja_template`` makes it: an ``ImmutableSandboxedEnvironment`` with
    ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a
    ``tojson`` that keeps non-ASCII, and the ``{% generation %}`` tag (rendered as its body)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """The chat template compiled in :func:`_template_env`.

    Raises:
        jinja2.exceptions.TemplateSyntaxError: the template is not valid jinja2.
    """
    return _template_env().from_string(source)


# What a turn marker looks like in a template's literal text: <|im_start|>, <start_of_turn>,
# </s>, [INST], <<SYS>>. Not any tag: Qwen's template writes <tools> as plain text by design,
# and a message that mentions <tools> is no forged turn.
_MARKER = re.compile(r"<\|[^\s<>|]{1,64}\|>|</?[A-Za-z]{1,32}_of_turn>|</?s>"
                     r"|\[/?[A-Z][A-Z_]{1,31}\]|<<[A-Z]{1,31}>>")


@functools.lru_cache(maxsize=8)
def template_markers(source: str) -> tuple[str, ...]:
    """The turn markers a chat template writes: what looks like one (:data:`_MARKER`) in its
    literal text (``{{ '<|im_start|>' + ... }}``, text outside tags), each once, in order.

    Raises:
        jinja2.exceptions.TemplateSyntaxError: the template is not valid jinja2.
    """
    from jinja2 import nodes

    literals = [n.data if isinstance(n, nodes.TemplateData) else n.value
                for n in _template_env().parse(source).find_all((nodes.Const, nodes.TemplateData))]
    found = (m for s in literals if isinstance(s, str) for m in _MARKER.findall(s))
    return tuple(dict.fromkeys(found))


@functools.lru_cache(maxsize=8)
def template_uses_tools(source: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (renders tool definitions); the
    ChatML fallback and many small models' templates do not. ``False`` for a template that is
    not valid jinja2 (rendering it answers the 400)."""
    from jinja2 import TemplateSyntaxError, meta

    try:
        return "tools" in meta.find_undeclared_variables(_template_env().parse(source))
    except TemplateSyntaxError:
        return False


def chatml_stops(tok) -> tuple[str, ...]:
    """Stop strings a chat prompted in the :data:`CHATML` fallback needs: ``<|im_end|>`` when
    the vocabulary has no such end-of-generation token (Gemma 3's base model, whose GGUF carries
    no template, writes the marker out as text and would go on with the next turn)."""
    if any(tok.token_text(i) == "<|im_end|>" for i in tok.eog_ids):
        return ()
    return ("<|im_end|>",)


#: How a rendered chat ends: with the template's generation prompt (the answer is a new
#: assistant turn), without it (vLLM's ``add_generation_prompt: false``), or inside the final
#: assistant message, cut after its content (vLLM's ``continue_final_message``, llama-server's
#: prefill): rendered without the generation prompt, and cut after the last place its content
#: appears, so that the template's end of turn is left out.
ENDS = ("generation", "none", "continue")


def render_chat(llm: LLM, messages: list[dict], extra: dict, mark: str | None = None,
                end: str = "generation") -> str:
    """The prompt text for ``messages``, ending as ``end`` says (:data:`ENDS`; a final
    message to continue whose content is empty gets the generation prompt).

    When the template writes the BOS token itself and the tokenizer adds one too, the written
    one is dropped, so the prompt never starts with two (HF tokenizes the rendered text without
    special tokens; here ``encode`` adds BOS by the GGUF's rule).

    Args:
        llm: the model (its tokenizer's template, BOS and EOS).
        messages: the validated messages.
        extra: the template's extra keyword arguments (``chat_template_kwargs``).
        mark: when given, every client string (messages but their roles, ``extra``) goes
            through ``Tokenizer.shield`` with it first; see :func:`encode_chat`.

    Raises:
        APIError: 400 when the template refuses the conversation or fails to render; 400
            when ``end`` is ``continue`` and the rendered text does not hold the final
            message's content.
    """
    import jinja2

    tok = llm.tokenizer
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    if mark is not None:
        try:
            messages = [{_shielded(k, tok, mark): v if k == "role" else _shielded(v, tok, mark)
                         for k, v in m.items()} for m in messages]
            extra = _shielded(extra, tok, mark)
        except ValueError as exc:
            raise bad(f"Cannot keep the messages' text apart from the template: {exc}.",
                      "messages") from None
    if end == "continue" and not messages[-1]["content"]:
        end = "generation"
    kwargs = {**extra, "messages": messages, "add_generation_prompt": end == "generation",
              "bos_token": bos, "eos_token": eos}
    kwargs.setdefault("tools", None)
    kwargs.setdefault("documents", None)
    try:
        text = compile_template(tok.chat_template or CHATML).render(**kwargs)
    except jinja2.exceptions.TemplateError as exc:   # raise_exception(...), syntax, security
        raise bad(f"Chat template error: {exc}", "messages") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise bad(f"Chat template error: {type(exc).__name__}: {exc}", "messages") from None
    if bos and tok.add_bos and text.startswith(bos):
        text = text[len(bos):]
    return _cut_after(text, messages[-1]["content"]) if end == "continue" else text


def _cut_after(text: str, content: str) -> str:
    """``text`` up to the end of the last place ``content`` (or, for a template that strips
    it, its stripped form) appears in it.

    Raises:
        APIError: 400 (``messages``) when it appears in neither form.
    """
    for c in (content, content.strip()):
        at = text.rfind(c) if c else -1
        if at >= 0:
            return text[:at + len(c)]
    raise bad("The chat template does not render the final assistant message's content as "
              "it is, so the answer cannot continue it.", "messages")


def encode_chat(llm: LLM, messages: list[dict], extra: dict,
                end: str = "generation") -> list[int]:
    """The prompt ids for ``messages``: the template's control tokens (``<|im_start|>``) as
    their ids, the client's text -- contents, names, tool calls and results,
    ``chat_template_kwargs`` -- as plain text even where it spells a control token, so that a
    message cannot forge a turn. A chat whose strings spell none tokenizes exactly as
    ``llm.tokenizer.encode(render_chat(...), parse_special=True)``.

    The length check (``LLM.prompt_ids``, the one check of a prompt's length) takes the chat
    rendered as it is: its text bound comes first (cheap: a 40 MB chat is refused before its
    strings are shielded), the count of the ids after encoding. Where a marker the template
    writes (:func:`template_markers`) is no control token of the vocabulary -- the ChatML
    fallback on Gemma 3 -- the model cannot tell a client's copy from the template's, so a
    client string holding one is refused.

    Raises:
        APIError: 400 as :func:`render_chat`; 400 when a client string holds a marker of
            the template that the vocabulary writes as plain text.
        GenerationError: ``"too_long"`` (HTTP 424) when the rendered chat cannot fit.
    """
    tok = llm.tokenizer
    template = tok.chat_template or CHATML
    text = render_chat(llm, messages, extra, end=end)

    def encode(rendered: str) -> list[int]:
        strings = [*_strings(messages), *_strings(extra)]
        for marker in tok.plain_text_of(template_markers(template)):
            if any(marker in s for s in strings):
                raise bad(f"The messages hold {marker!r}, but {marker!r} is this model's chat "
                          "turn marker, which its vocabulary cannot keep apart from text.",
                          "messages")
        mark = _free_mark([*strings, template])
        if not _any_shielded(tok, strings, mark):   # the usual chat: the render is the one
            return tok.encode(rendered, parse_special=True)
        return tok.encode_shielded(render_chat(llm, messages, extra, mark, end), mark)
    return llm.prompt_ids(text, encode)


def _any_shielded(tok, strings: list[str], mark: str) -> bool:
    """Whether ``Tokenizer.shield`` marks any of ``strings`` (True also when it refuses one:
    :func:`render_chat` then answers the 400)."""
    try:
        return any(tok.shield(s, mark) is not s for s in strings)
    except ValueError:
        return True


def _strings(obj):
    """Every string in ``obj`` (JSON values: dict keys included); iterative, so that no
    nesting depth can exhaust the stack (``parse_json_object`` bounds it anyway)."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            yield x
        elif isinstance(x, dict):
            for k, v in x.items():
                stack += (v, k)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))


def _shielded(obj, tok, mark: str):
    """``obj`` (JSON values) with each string, dict keys included, through ``tok.shield``;
    a copy, made iteratively as :func:`_strings` walks."""
    root = [obj]
    todo = [(root, 0)]                    # (container, key): its value still to be copied
    while todo:
        parent, key = todo.pop()
        x = parent[key]
        if isinstance(x, str):
            parent[key] = tok.shield(x, mark)
        elif isinstance(x, dict):
            parent[key] = copy = {}
            for k, v in x.items():
                k = tok.shield(k, mark) if isinstance(k, str) else k
                copy[k] = v
                todo.append((copy, k))
        elif isinstance(x, (list, tuple)):
            parent[key] = copy = list(x)
            todo.extend((copy, i) for i in range(len(copy)))
    return root[0]


# Marks for Tokenizer.shield: CJK Extension B ideographs (printable, so a template's repr() of a
# message keeps them, caseless, not whitespace), then plane 15's private use characters.
_MARKS = (range(0x20000, 0x2A6E0), range(0xF0000, 0xFFFFE))


def _free_mark(strings: list[str]) -> str:
    """A character in none of ``strings``: the first of :data:`_MARKS` unless a string has it,
    else the first one no string has (one pass over the text either way).

    Raises:
        APIError: 400 when the strings hold every candidate (over 108,000 characters).
    """
    first = chr(_MARKS[0][0])
    if not any(first in s for s in strings):
        return first
    used = set().union(*map(set, strings))
    for block in _MARKS:
        for cp in block:
            if chr(cp) not in used:
                return chr(cp)
    raise bad("The messages use too many distinct characters.", "messages")
