"""Constrained decoding: a grammar the output must follow, as a token mask per decode step.

The grammar (a JSON schema, "any JSON object", a regex or a Lark grammar) is compiled once per
tokenizer and spec by llguidance (Microsoft's guidance engine: Earley parser over a lazy lexer,
masks computed in Rust with the GIL released, numpy bitmasks, no torch) and cached
(:func:`compile_constraint`); each request gets its own :class:`Matcher` (a cheap copy of the
compiled one), which gives the mask of the allowed next tokens and follows the sampled ones.

Masks are bitmasks: int32 ``[ceil(V / 32)]`` per row, bit ``i % 32`` of word ``i // 32`` set
when token ``i`` is allowed (llguidance's layout). :func:`apply_bitmask` turns the disallowed
logits of a batch into ``-inf`` before sampling. When the grammar is complete the end-of-
generation tokens are the only ones allowed.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections import OrderedDict

import llguidance
import llguidance.numpy
import numpy as np

from ..model.tokenizer import Tokenizer
from .request import Constraint

CACHE_SIZE = 64            # compiled grammars kept per tokenizer (least recently used dropped)
#: llguidance's JSON options: no free whitespace between tokens (a small model otherwise may
#: fill its whole budget with newlines, which the grammar would have to allow), like OpenAI's
#: strict outputs, which are compact too.
JSON_OPTIONS = {"whitespace_flexible": False}
_EXECUTOR_THREADS = 1
#: The classes llguidance keeps ASCII in a JSON schema ``pattern`` (``regex_to_lark``'s flags:
#: ``\d``, ``\w``), used for plain regex grammars too: one meaning of ``\d`` everywhere.
JSON_ASCII_CLASSES = "dw"
#: The longest regex, and the most characters of regexes in one JSON schema
#: (its ``pattern`` values and ``patternProperties`` names), that a request may have compiled:
#: the compiler's time grows faster than their length (nested repetitions such as ``a*a*a*``),
#: so a bound on the length bounds it. It runs in a worker thread without the GIL.
MAX_REGEX_CHARS = 8192
#: The longest JSON schema (as JSON text) or Lark grammar a request may have compiled, for the
#: same reason (objects of thousands of properties); tool sets of dozens of functions fit.
MAX_SCHEMA_CHARS = 1 << 16


class ConstraintError(ValueError):
    """A constraint that cannot be compiled: the message names the reason (a malformed schema,
    regex or grammar, or a JSON-schema feature that cannot be enforced, e.g.
    ``Unimplemented keys: ["patternProperties"]``)."""


class _LLTokenizers:
    """One :class:`llguidance.LLTokenizer` (slow to build for a large vocabulary) and one
    compiled-grammar cache per :class:`Tokenizer`, dropped with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tok: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, tokenizer: Tokenizer) -> tuple[llguidance.LLTokenizer, OrderedDict]:
        with self._lock:
            got = self._by_tok.get(tokenizer)
            if got is None:
                got = (_ll_tokenizer(tokenizer), OrderedDict())
                self._by_tok[tokenizer] = got
            return got


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """The vocabulary as llguidance sees it: each token's exact bytes; control tokens (which
    add no text) as ``0xFF`` + their piece, llguidance's mark for special tokens; the
    end-of-generation ids as its EOS tokens."""
    tokens = []
    for i in range(tokenizer.vocab_size):
        b = tokenizer.token_bytes(i)
        if tokenizer.is_special(i) or not b:
            b = b"\xff" + tokenizer.token_text(i).encode("utf-8")
        tokens.append(b)
    eos = sorted(tokenizer.eog_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    wrapper = llguidance.TokenizerWrapper(_Vocab(tokenizer, tokens, eos[0] if eos else 0))
    return llguidance.LLTokenizer(wrapper, eos_token=eos or None)


class _Vocab:
    """What :class:`llguidance.TokenizerWrapper` reads of a tokenizer."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], eos_token_id: int):
        self.tokens = tokens
        self.eos_token_id = eos_token_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size)
                                  if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        # llguidance tokenizes forced text that continues the output: no dummy space prefix
        return self._tokenizer.encode(text, add_bos=False, parse_special=False,
                                      space_prefix=False)


_tokenizers = _LLTokenizers()


def regex_lexeme(regex: str) -> str:
    r"""``regex`` as a Lark ``/.../`` lexeme with the meaning a JSON schema ``pattern`` has in
    llguidance (ECMAScript's): ``\d`` is ``[0-9]`` and ``\w`` ``[0-9a-zA-Z_]`` (ASCII, as
    TGI's outlines reads them too), not any Unicode digit or letter."""
    return llguidance.regex_to_lark(regex, JSON_ASCII_CLASSES)


def _grammar(c: Constraint) -> str:
    """llguidance's grammar text for ``c``; raises :class:`ConstraintError` for a spec that is
    not even well-formed (a schema that is no JSON object)."""
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except ValueError as exc:
            raise ConstraintError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ConstraintError("the schema must be a JSON object")
        _check_size("regexes in the schema", _regex_chars(schema), MAX_REGEX_CHARS)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ConstraintError(f"invalid JSON schema: {exc}") from None
    if c.kind == "regex":
        return llguidance.LLMatcher.grammar_from_lark(f"start: /{regex_lexeme(c.spec)}/")
    if c.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(c.spec)
    raise ConstraintError(f"unknown constraint kind {c.kind!r}")


def _check_size(what: str, size: int, limit: int) -> None:
    if size > limit:
        raise ConstraintError(f"the grammar is too large to enforce: {size} characters of "
                              f"{what}, at most {limit}")


def _regex_chars(schema) -> int:
    """Characters of the regexes in a JSON schema: its ``pattern`` values and
    ``patternProperties`` names, at any depth (an iterative walk)."""
    total, todo = 0, [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                total += len(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                total += sum(len(k) for k in node["patternProperties"])
            todo.extend(node.values())
    return total


class CompiledConstraint:
    """A grammar compiled for one tokenizer (from :func:`compile_constraint`; immutable, shared
    by all requests with the same spec)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, matcher: llguidance.LLMatcher,
                 vocab_size: int):
        self._ll = tokenizer
        self._template = matcher
        self.vocab_size = vocab_size

    def matcher(self) -> Matcher:
        """A fresh :class:`Matcher` at the start of the grammar (a cheap copy)."""
        return Matcher(self._template.deep_copy(), self.vocab_size)


def prepare(tokenizer: Tokenizer) -> float:
    """Build llguidance's view of ``tokenizer``'s vocabulary now, if not yet built; returns the
    seconds it took (0 when it was there). Thread-safe.

    Why: the build holds the GIL for a time that grows with the vocabulary, so every thread
    of the process stalls meanwhile; the server runs it once in the background
    right after it starts listening, rather than in the middle of serving the first
    constrained request.
    """
    t0 = time.perf_counter()
    with _tokenizers._lock:
        built = tokenizer in _tokenizers._by_tok
    if built:
        return 0.0
    _tokenizers.get(tokenizer)
    return time.perf_counter() - t0


def compile_constraint(tokenizer: Tokenizer, constraint: Constraint) -> CompiledConstraint:
    """Compile ``constraint`` for ``tokenizer``'s vocabulary, or take it from the cache (the
    last :data:`CACHE_SIZE` specs per tokenizer, keyed by kind and spec). Thread-safe.

    Raises:
        ConstraintError: the spec is malformed or uses something that cannot be enforced; the
            message names it (llguidance's wording, e.g. ``Unimplemented keys: ["not"]``).
    """
    ll, cache = _tokenizers.get(tokenizer)
    key = (constraint.kind, constraint.spec)
    with _tokenizers._lock:
        hit = cache.get(key)
        if hit is not None:
            cache.move_to_end(key)
            return hit
    if constraint.kind == "regex":
        _check_size("the regex", len(constraint.spec), MAX_REGEX_CHARS)
    elif constraint.kind in ("json_schema", "lark"):    # a lark grammar: of tools' schemas
        _check_size(f"the {constraint.kind}", len(constraint.spec), MAX_SCHEMA_CHARS)
    grammar = _grammar(constraint)
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(_clean(_in_schema_terms(matcher.get_error())))
    error = _probe(matcher.deep_copy(), tokenizer.vocab_size)
    if error is not None:
        raise ConstraintError("the grammar is too complex to enforce: " + _clean(error))
    compiled = CompiledConstraint(ll, matcher, tokenizer.vocab_size)
    with _tokenizers._lock:
        cache[key] = compiled
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return compiled


#: tokens :func:`_probe` follows into a new grammar
PROBE_STEPS = 8


def _probe(matcher: llguidance.LLMatcher, vocab_size: int) -> str | None:
    """Follow ``matcher`` (a copy) for :data:`PROBE_STEPS` tokens, each time the lowest id its
    mask allows, and return its error, if any. Some grammars compile but fail when their
    masks are computed or a token is consumed (a lexer or parser limit: ``LexerTooComplex``,
    ``Current row has 3207 items; max is 2000``), most of them at once: they are refused at
    compile time (a 400) instead of failing a request in flight."""
    mask = np.zeros((1, bitmask_words(vocab_size)), np.int32)
    for _ in range(PROBE_STEPS):
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        if matcher.is_error() or matcher.is_stopped():
            break
        words = np.flatnonzero(mask[0])
        if not words.size:
            break
        word = int(mask[0, words[0]]) & 0xFFFFFFFF
        matcher.consume_token(int(words[0]) * 32 + (word & -word).bit_length() - 1)
        if matcher.is_error():
            break
    return matcher.get_error() if matcher.is_error() else None


def forget(tokenizer: Tokenizer, constraint: Constraint) -> None:
    """Drop ``constraint``'s compiled grammar from the cache (after a request's matcher failed
    on it: its copies share lexer state, which a failure may leave behind)."""
    with _tokenizers._lock:
        got = _tokenizers._by_tok.get(tokenizer)
        if got is not None:
            got[1].pop((constraint.kind, constraint.spec), None)


#: llguidance's advice to set one of its options, which a client cannot set: what to change in
#: the schema instead.
_OPTION_ADVICE = {
    "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf "
    "with anyOf":
        "oneOf alternatives that may match the same value are not supported: make them "
        "exclusive (e.g. a property with a different \"const\" in each, or types that "
        "differ) or use anyOf",
}


def _in_schema_terms(error: str) -> str:
    """llguidance's ``error`` with its advice to set an option of its own replaced by what the
    client can change in the schema (:data:`_OPTION_ADVICE`)."""
    for advice, instead in _OPTION_ADVICE.items():
        error = error.replace(advice, instead)
    return error


def _clean(error: str, limit: int = 300) -> str:
    """llguidance's error without its internal context lines, at most ``limit`` characters
    (some errors quote the whole grammar)."""
    lines = [ln for ln in error.strip().splitlines() if ln.strip()]
    text = lines[0] if len(lines) == 1 else "; ".join(lines[:3])
    return text if len(text) <= limit else text[:limit] + "..."


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row's bitmask."""
    return (vocab_size + 31) // 32


class Matcher:
    """One request's position in its grammar (engine thread only; not thread-safe).

    Attributes:
        vocab_size: the model's vocabulary size ``V``.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m = matcher
        self.vocab_size = vocab_size

    def fill_mask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 ``[B, ceil(V / 32)]``,
        C-contiguous). llguidance releases the GIL while it computes, taking it back only to
        tokenize a string the grammar forces (``Tokenizer.encode``)."""
        llguidance.numpy.fill_next_token_bitmask(self._m, bitmask, row)

    def consume(self, token_id: int) -> bool:
        """Advance past the sampled ``token_id``; False when the grammar did not allow it (the
        matcher is then in error and stays there)."""
        return self._m.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (only end of generation)."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete sentence of the grammar (it may go on)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (shortened), or None."""
        return _clean(self._m.get_error()) if self._m.is_error() else None


def fill_masks(matchers: list[Matcher], vocab_size: int) -> np.ndarray:
    """int32 ``[len(matchers), ceil(V / 32)]``: row ``i`` = the allowed next tokens of
    ``matchers[i]`` (what the engine computes while the forward pass runs)."""
    bitmask = np.zeros((len(matchers), bitmask_words(vocab_size)), np.int32)
    for i, m in enumerate(matchers):
        m.fill_mask(bitmask, i)
    return bitmask


_BITS = np.arange(32, dtype=np.int32)


def _ids(words: np.ndarray, at: np.ndarray, allowed: bool) -> np.ndarray:
    """Token ids whose bit is ``allowed`` in the int32 ``words`` at word indices ``at``."""
    bits = ((words[at][:, None] >> _BITS) & 1).astype(bool)
    return (at[:, None] * 32 + _BITS)[bits if allowed else ~bits]


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """Set the logits of disallowed tokens to ``-inf``, in place.

    Args:
        logits: float32 ``[B, V]``.
        bitmask: int32 ``[B, ceil(V / 32)]``, bit ``i % 32`` of word ``i // 32`` = token ``i``
            allowed (little-endian bit order).

    Per row, only the words that are not all-allowed (or, when most are all-disallowed, only
    the allowed ids) are unpacked: a row allowing a few tokens is filled with ``-inf`` and the
    few put back; a row allowing most has just its disallowed ids set (less work than
    unpacking the whole ``[B, V]`` mask).
    """
    v = logits.shape[1]
    for row, words in zip(logits, bitmask, strict=True):
        nonzero = np.flatnonzero(words)
        if nonzero.size * 2 < words.size:              # few allowed: keep them, fill the rest
            ids = _ids(words, nonzero, True)
            ids = ids[ids < v]
            kept = row[ids]
            row.fill(-np.inf)
            row[ids] = kept
        else:                                          # most allowed: clear the others
            ids = _ids(words, np.flatnonzero(words != -1), False)
            row[ids[ids < v]] = -np.inf
