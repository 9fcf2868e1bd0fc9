"""Embedding request bodies of the three families, checked and turned into token ids.

* OpenAI ``POST /v1/embeddings``: ``input`` (a string, a list of strings, a list of token ids,
  or a list of such lists), ``model``, ``encoding_format`` (``float`` or ``base64``),
  ``dimensions`` (Matryoshka models only), ``user`` (read, without effect).
* TEI ``POST /embed``: ``inputs`` (a string or a list of strings), ``normalize``, ``truncate``,
  ``truncation_direction`` (``Right`` or ``Left``), ``prompt_name``.
* llama-server ``POST /embedding``: ``content`` (a string or a list of strings),
  ``embd_normalize`` (-1 none, 0 max absolute, 1 taxicab, 2 Euclidean: the default, p > 2).

Texts get the model's ``[CLS] ... [SEP]``; token lists are taken as given. An input longer than
the model's context is a 4xx naming the limit unless truncation is asked for (TEI's
``truncate``). Every pass is linear in the body's size.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import APIError, Kind, invalid
from .validate import check_token_ids, get_bool, get_int, refuse_unknown

#: the most inputs one request may hold (OpenAI's limit)
MAX_INPUTS = 2048
OPENAI_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")
TEI_FIELDS = ("inputs", "normalize", "truncate", "truncation_direction", "prompt_name")
LLAMA_FIELDS = ("content", "embd_normalize")


def _empty(message: str, name: str) -> APIError:
    """An empty input: 422 naming ``name`` (OpenAI: 400; TEI: 400 ``Empty``)."""
    err = invalid(message, name)
    err.tei_type = "Empty"
    return err


def _too_long(message: str, name: str) -> APIError:
    """An input over the context: 424 (OpenAI: 400 ``context_length_exceeded``; TEI: 413)."""
    return APIError(Kind.TOO_LONG, message, param=name)


@dataclass
class EmbedJob:
    """What one request asks for: each input's token ids, and the vectors' finish."""

    ids: list[list[int]]
    normalize: bool = True
    dimensions: int | None = None
    base64: bool = False
    #: llama-server's ``embd_normalize``: -1 none, 0 max absolute (scaled to int16's range),
    #: 1 taxicab, 2 Euclidean, p > 2 the p-norm; ``None``: ``normalize`` says
    p_norm: int | None = None

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.ids)


def _texts(value, name: str) -> list[str]:
    """A string or a non-empty list of strings (at most :data:`MAX_INPUTS`), as a list."""
    items = [value] if isinstance(value, str) else value
    if isinstance(items, list) and not items:
        raise _empty(f"{name} is an empty list; give at least one string.", name)
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise invalid(f"{name} must be a string or a non-empty list of strings.", name)
    if len(items) > MAX_INPUTS:
        raise invalid(f"{name} holds {len(items)} inputs; at most {MAX_INPUTS} per request.",
                      name)
    for i, t in enumerate(items):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:          # a lone surrogate (\ud800) from a JSON escape
            raise invalid(f"{name}[{i}] is not valid Unicode text (a lone surrogate).",
                          name) from None
    return items


def encode_texts(texts: list[str], name: str, tokenizer, context: int, *,
                 truncate: bool = False, left: bool = False) -> list[list[int]]:
    """Each text's ids (``[CLS] ... [SEP]``); a text longer than ``context`` tokens is cut
    (keeping both special tokens) when ``truncate``, else refused.

    Raises:
        APIError: 422 (OpenAI and TEI: 400) for an empty text; 424 (OpenAI: 400, TEI: 413)
            for one over the context.
    """
    out = []
    for i, enc in enumerate(tokenizer.encode_batch(texts, add_special_tokens=True)):
        ids = list(enc.ids)
        if not texts[i]:
            raise _empty(f"{name}[{i}] is empty; give a non-empty string.", name)
        if len(ids) > context:
            if not truncate:
                raise _too_long(f"{name}[{i}] has {len(ids)} tokens; this model takes at most "
                                f"{context} tokens per input (or ask for truncation).", name)
            body = ids[1:-1]
            keep = context - 2
            body = body[len(body) - keep:] if left else body[:keep]
            ids = [ids[0], *body, ids[-1]]
        out.append(ids)
    return out


def _openai_input(value, tokenizer, cfg) -> list[list[int]]:
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool)
                                                 for i in value):
        value = [value]                                    # one list of token ids
    if isinstance(value, list) and value and all(isinstance(i, list) for i in value):
        if len(value) > MAX_INPUTS:
            raise invalid(f"input holds {len(value)} inputs; at most {MAX_INPUTS} per request.",
                          "input")
        ids = [check_token_ids(v, "input", cfg.vocab, non_empty=True) for v in value]
        for i, v in enumerate(ids):
            if len(v) > cfg.context:
                raise _too_long(f"input[{i}] has {len(v)} tokens; this model takes at most "
                                f"{cfg.context} tokens per input.", "input")
        return ids
    return encode_texts(_texts(value, "input"), "input", tokenizer, cfg.context)


def parse_openai(obj: dict, tokenizer, cfg) -> EmbedJob:
    """An OpenAI embeddings body -> :class:`EmbedJob` (``model`` is checked by the caller).

    Raises:
        APIError: 422 (answered 400 in OpenAI's style) naming the field.
    """
    refuse_unknown(obj, OPENAI_FIELDS)
    if "input" not in obj:
        raise invalid("input is required.", "input")
    fmt = obj.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("encoding_format must be 'float' or 'base64'.", "encoding_format")
    dims = get_int(obj, "dimensions", None, 1, cfg.hidden)
    if dims is not None and dims != cfg.hidden and dims not in cfg.matryoshka:
        sizes = ", ".join(str(d) for d in (cfg.hidden, *cfg.matryoshka))
        raise invalid(f"dimensions {dims}: this model takes "
                      f"{sizes if cfg.matryoshka else 'no dimensions other than ' + sizes}.",
                      "dimensions")
    if obj.get("user") is not None and not isinstance(obj["user"], str):
        raise invalid("user must be a string.", "user")
    return EmbedJob(_openai_input(obj["input"], tokenizer, cfg),
                    dimensions=None if dims == cfg.hidden else dims, base64=fmt == "base64")


def parse_tei(obj: dict, tokenizer, cfg) -> EmbedJob:
    """A TEI ``/embed`` body -> :class:`EmbedJob`.

    Raises:
        APIError: 422 naming the field.
    """
    refuse_unknown(obj, TEI_FIELDS)
    if "inputs" not in obj:
        raise invalid("inputs is required.", "inputs")
    direction = obj.get("truncation_direction", "Right")
    if direction not in ("Right", "Left", "right", "left"):
        raise invalid("truncation_direction must be 'Right' or 'Left'.", "truncation_direction")
    texts = _texts(obj["inputs"], "inputs")
    name = obj.get("prompt_name")
    if name is not None:
        if not isinstance(name, str) or name not in cfg.prefixes:
            known = ", ".join(cfg.prefixes) or "none"
            raise invalid(f"prompt_name {name!r}: this model's prompts are {known}.",
                          "prompt_name")
        texts = [cfg.prefixes[name] + t for t in texts]
    ids = encode_texts(texts, "inputs", tokenizer, cfg.context,
                       truncate=bool(get_bool(obj, "truncate", False)),
                       left=direction.lower() == "left")
    return EmbedJob(ids, normalize=bool(get_bool(obj, "normalize", True)))


def parse_llama(obj: dict, tokenizer, cfg) -> EmbedJob:
    """A llama-server ``/embedding`` body -> :class:`EmbedJob`.

    Raises:
        APIError: 422 (answered 400 in OpenAI's style) naming the field.
    """
    refuse_unknown(obj, LLAMA_FIELDS)
    if "content" not in obj:
        raise invalid("content is required.", "content")
    p_norm = get_int(obj, "embd_normalize", 2, -1, 1 << 20)
    return EmbedJob(encode_texts(_texts(obj["content"], "content"), "content", tokenizer,
                                 cfg.context), normalize=False, p_norm=p_norm)
