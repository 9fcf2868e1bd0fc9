"""Text <-> token ids for one model's vocabulary: the :class:`Tokenizer`, built by
:func:`~tiny_mindie.model.tokenizer_load.load_tokenizer` from a GGUF file's ``tokenizer.ggml.*``
metadata (byte-level BPE with Hugging Face ``tokenizers``, or SentencePiece).

Special tokens follow llama.cpp: control tokens (type 3) and unknown tokens (type 2) are parsed
out of the text only when ``parse_special=True``; user-defined tokens (type 4) always are. Control
tokens contribute no text when decoded (unless ``skip_special=False``).

Client text inside a chat template (:meth:`Tokenizer.shield`, :meth:`Tokenizer.encode_shielded`):
the template's own control tokens are parsed, while any written in the client's strings stay
plain text, so a message cannot forge a turn.

GGUF token types (``tokenizer.ggml.token_type``): 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Token ids come from ``encode_batch`` (it lets go of the GIL while encoding; ``encode`` holds it
# for the whole text, stalling every other request on a long one), one text at a time: no rayon
# pool, and no "process just got forked" warning from a child process after it has run.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Vocabulary:
    """The ids, texts and kinds of a model's tokens as its :class:`Tokenizer` holds them, read
    from the GGUF metadata alone (:func:`~tiny_mindie.model.tokenizer_load.read_vocabulary`: no
    tokenizer is built); it answers the questions a :class:`Tokenizer` answers about them
    (``vocab_size``, ``bos_id``, ``eos_id``, ``eog_ids``, :meth:`token_text`,
    :meth:`is_special`).

    ``tokens``: each token's piece as stored; ``types``: its GGUF token type (``TOKEN_*``,
    end-of-generation tokens as control); ``bos_id``, ``eos_id``: ``None`` when absent;
    ``eog_ids``: the ids that end generation."""

    tokens: list[str]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_text(self, token_id: int) -> str:
        """The token's piece as stored (``IndexError`` outside the vocabulary)."""
        return self.tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens, end-of-generation ones included."""
        return self.types[token_id] == TOKEN_CONTROL


class Tokenizer:
    """Encodes text to token ids and decodes ids back to text, for one model's vocabulary.

    Build it with :func:`~tiny_mindie.model.tokenizer_load.load_tokenizer`. Safe to share
    between threads.

    Attributes:
        vocab_size: number of tokens in the vocabulary (ids are ``0 .. vocab_size - 1``).
        bos_id: beginning-of-sequence token id, or ``None`` when the vocabulary has none.
        eos_id: end-of-sequence token id, or ``None``.
        eog_ids: ids that end generation: eos, eot/eom, and tokens such as ``<|im_end|>``,
            ``<|endoftext|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>`` present in the
            vocabulary (as llama.cpp decides them).
        add_bos: whether :meth:`encode` prepends ``bos_id`` by default
            (``tokenizer.ggml.add_bos_token``; when absent: True for SentencePiece and LLaMA-3
            style BPE, False for other BPE vocabularies).
        chat_template: the Jinja chat template stored in the file (``tokenizer.chat_template``),
            or ``None``.
        kind: ``"gpt2"`` (byte-level BPE) or ``"llama"`` (SentencePiece).
        pre: the ``tokenizer.ggml.pre`` name used (byte-level BPE), else ``None``.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    add_bos: bool
    chat_template: str | None

    def __init__(self, vocab: Vocabulary, *, kind: str, token_bytes: list[bytes], add_bos: bool,
                 chat_template: str | None, pre: str | None = None, encoder=None,
                 add_space_prefix: bool = False):
        """Internal: use :func:`~tiny_mindie.model.tokenizer_load.load_tokenizer`.

        ``vocab``: the tokens; ``token_bytes``: each token's bytes as :meth:`token_bytes`
        gives them; ``encoder``: the library that encodes text, a Hugging Face
        ``tokenizers.Tokenizer`` for ``kind="gpt2"``, a ``sentencepiece.SentencePieceProcessor``
        for ``kind="llama"``, or ``None`` when :meth:`encode` is never called)."""
        tokens, token_types = vocab.tokens, vocab.types
        hf = encoder if kind == "gpt2" else None
        spm = encoder if kind == "llama" else None
        self.kind = kind
        self.pre = pre
        self.vocab_size = len(tokens)
        self.bos_id = vocab.bos_id
        self.eos_id = vocab.eos_id
        self.eog_ids = vocab.eog_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._tokens = tokens
        self._types = token_types
        self._bytes = token_bytes                       # control/unknown/unused -> b""
        # same, but control and unknown tokens render as their stored text (skip_special=False)
        self._bytes_all = [
            t.encode("utf-8") if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN) else b
            for t, ty, b in zip(tokens, token_types, token_bytes, strict=True)
        ]
        self._hf = hf
        self._hf_lock = threading.Lock()  # guards hf.encode_special_tokens, a shared flag
        self._spm = spm
        self._add_space_prefix = add_space_prefix
        # what parse_special=True reads out of a text: control and unknown tokens
        self._control_texts = [t for t, ty in zip(tokens, token_types, strict=True)
                               if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
        if spm is not None:
            self._spm_special = _alternation(
                [t for t, ty in zip(tokens, token_types, strict=True)
                 if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)])
            self._spm_user = _alternation(
                [t for t, ty in zip(tokens, token_types, strict=True) if ty == TOKEN_USER_DEFINED])
            self._piece_ids = {t: i for i, t in enumerate(tokens)}

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool | None = None,
               parse_special: bool = True, space_prefix: bool = True) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text to encode.
            add_bos: prepend ``bos_id``; ``None`` means :attr:`add_bos`. Ignored when the
                vocabulary has no BOS token.
            parse_special: when True, control tokens written in the text (``<|im_start|>``)
                become their single id; when False they are encoded as plain text.
                User-defined tokens are always parsed (as llama.cpp does).
            space_prefix: False encodes ``text`` as the continuation of earlier text: no
                dummy space before it where the vocabulary adds one (SentencePiece's, per
                ``tokenizer.ggml.add_space_prefix``); other vocabularies add none anyway.

        Returns:
            list of ids, each in ``0 .. vocab_size - 1``. Lone surrogate code points in
            ``text`` are encoded as U+FFFD.
        """
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        if not text:
            return ids
        if _SURROGATE.search(text):  # lone surrogates (JSON may carry them) are not encodable
            text = _SURROGATE.sub("\ufffd", text)
        if self._hf is not None:
            with self._hf_lock:      # encode_batch: see TOKENIZERS_PARALLELISM above
                self._hf.encode_special_tokens = not parse_special
                ids.extend(self._hf.encode_batch([text], add_special_tokens=False)[0].ids)
        else:
            ids.extend(self._spm_encode(text, parse_special, space_prefix))
        return ids

    def _spm_encode(self, text: str, parse_special: bool, space_prefix: bool) -> list[int]:
        # llama.cpp: cut special tokens out of the text, encode each raw fragment separately,
        # with a space prefix at the start and after every special token.
        pattern = self._spm_special if parse_special else self._spm_user
        pieces = pattern.split(text) if pattern is not None else [text]
        ids: list[int] = []
        prev_special = space_prefix
        for i, frag in enumerate(pieces):
            if i % 2:  # a special token (the capture group of the split)
                ids.append(self._piece_ids[frag])
                prev_special = True
            elif frag:
                if self._add_space_prefix and prev_special:
                    frag = " " + frag
                ids.extend(self._spm.encode(frag))
                prev_special = False
        return ids

    # ---- client text inside a chat template ---------------------------------------------------
    def shield(self, text: str, mark: str) -> str:
        """``text``, a client's string about to be rendered into a chat template, with ``mark``
        inserted wherever a control token could be read in it, so that
        :meth:`encode_shielded` of the rendered template parses the template's own control
        tokens and keeps those of the client as plain text.

        The mark goes inside every control or unknown token written in ``text`` (``<|im_end|>``
        -> ``<`` mark ``|im_end|>``), and at an end of ``text`` -- or of ``text.strip()``, for
        templates that ``trim`` it -- that could make one token with the text next to it
        (``"...<|im"``): no control token can be read across a mark. A mark stays where it is
        through what templates do with a string (concatenation, ``trim``, case changes,
        ``tojson``); slicing through a marked token only cuts it further. A string that could
        only be the middle of a token (``name`` in ``<repo_name>``) gets no mark: templates
        compare such words (``type == 'text'``), and none writes a token's two ends around a
        client's string (only around the message role, which is not the client's text).

        Args:
            text: the client's string.
            mark: one character found in no client string and not in the template.

        Returns:
            ``text`` itself when it needs no mark (ordinary text), else the marked copy.

        Raises:
            ValueError: ``text`` holds a one-character control token, which a mark cannot
                split (no vocabulary known here has one).
        """
        guard = self._guard
        if not text or guard is None:
            return text
        cuts: set[int] = set()
        pos = 0
        while (m := guard.pattern.search(text, pos)) is not None:   # tokens written whole
            if m.end() - m.start() < 2:
                raise ValueError(f"the text holds the one-character control token "
                                 f"{m.group()!r}, which cannot be kept as plain text")
            pos = m.start() + 1
            cuts.add(pos)
        longest = guard.longest
        core_end = len(text.rstrip())
        core_start = len(text) - len(text.lstrip())
        for end in {len(text), core_end}:             # ends with the start of a token: "<|im"
            if any(text[end - j:end] in guard.prefixes
                   for j in range(1, min(end, longest - 1) + 1)):
                cuts.add(end)
        for start in {0, core_start}:                 # starts with the end of one: "_end|>"
            if any(text[start:start + j] in guard.suffixes
                   for j in range(1, min(len(text) - start, longest - 1) + 1)):
                cuts.add(start)
        if not cuts:
            return text
        out, last = [], 0
        for k in sorted(cuts):
            out += (text[last:k], mark)
            last = k
        out.append(text[last:])
        return "".join(out)

    def encode_shielded(self, text: str, mark: str, *, add_bos: bool | None = None) -> list[int]:
        """Ids of a rendered chat template whose client strings went through :meth:`shield`
        with ``mark``: control tokens written whole in ``text`` (the template's) become their
        ids; everything else, ``mark`` removed, is plain text.

        Without ``mark`` in ``text`` this is ``encode(text, parse_special=True)``. With it, the
        ids are the same except where a mark breaks a token, because ``encode`` too cuts the
        text at special and user-defined tokens and encodes each piece between them alone.

        Args:
            text: the rendered template.
            mark: the character given to :meth:`shield`.
            add_bos: as in :meth:`encode`.
        """
        if not mark or mark not in text:
            return self.encode(text, add_bos=add_bos, parse_special=True)
        ids: list[int] = []
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.append(self.bos_id)
        pattern = self._spm_special if self._spm is not None else self._hf_added
        parts = pattern.split(text) if pattern is not None else [text]
        plain = self._encode_plain([p.replace(mark, "") for p in parts[0::2]])
        for i, piece in enumerate(plain):
            ids.extend(piece)
            if 2 * i + 1 < len(parts):
                ids.append(self.token_to_id(parts[2 * i + 1]))
        return ids

    def _encode_plain(self, texts: list[str]) -> list[list[int]]:
        """``encode(t, add_bos=False, parse_special=False)`` of each text, in one batch."""
        texts = [_SURROGATE.sub("\ufffd", t) for t in texts]
        if self._hf is None:
            return [self._spm_encode(t, parse_special=False, space_prefix=True) if t else []
                    for t in texts]
        with self._hf_lock:
            self._hf.encode_special_tokens = True
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    @functools.cached_property
    def _hf_added(self) -> re.Pattern[str] | None:
        """Byte-level BPE: the tokens ``encode`` cuts the text at (control, unknown and
        user-defined: Hugging Face's added tokens), longest first, as one capture group."""
        return _alternation([t for t, ty in zip(self._tokens, self._types, strict=True)
                             if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED)])

    def plain_text_of(self, texts: Sequence[str]) -> tuple[str, ...]:
        """Those of ``texts`` (a chat template's turn markers, e.g. ``<|im_start|>``) that are
        no control or user-defined token of this vocabulary: written in a prompt they are
        ordinary text, so :meth:`shield` cannot keep a client's copy apart from the template's
        (Gemma 3 has no ``<|im_start|>``; the ChatML fallback template writes it as text)."""
        return tuple(t for t in texts if t not in self._token_set)

    @functools.cached_property
    def _token_set(self) -> frozenset[str]:
        """Texts read as one token wherever they are written: control tokens (from the
        template) and user-defined ones (from anyone: as in llama.cpp)."""
        return frozenset(t for t, ty in zip(self._tokens, self._types, strict=True)
                         if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN, TOKEN_USER_DEFINED))

    @functools.cached_property
    def _guard(self) -> _Guard | None:
        return _Guard(self._control_texts) if self._control_texts else None

    # ---- decoding -------------------------------------------------------------------------
    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``: the concatenated :meth:`token_bytes`, decoded as UTF-8.

        Invalid UTF-8 (a sequence cut inside a character) becomes U+FFFD. For SentencePiece
        vocabularies with a dummy space prefix, the one leading space of the first token that
        produces text is dropped (sentencepiece and llama.cpp do the same), so that
        ``decode(encode(t)) == t``; :meth:`token_bytes` keeps that space.

        Args:
            ids: token ids.
            skip_special: when False, control and unknown tokens appear as their stored text.

        Raises:
            IndexError: an id is outside ``0 .. vocab_size - 1``.
        """
        table = self._bytes if skip_special else self._bytes_all
        n = self.vocab_size
        parts = []
        for i in ids:
            if not 0 <= i < n:
                raise IndexError(f"token id {i} out of range 0..{n - 1}")
            b = table[i]
            if b:
                parts.append(b)
        if self._add_space_prefix and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        return b"".join(parts).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes ``token_id`` adds to the text when appended to a sequence.

        Normal tokens: their UTF-8 bytes (byte-level pieces mapped back through the GPT-2 byte
        table; SentencePiece ``▁`` as a space, ``<0xAB>`` byte pieces as that one byte — so a
        single token may be an incomplete UTF-8 sequence). User-defined tokens: their text.
        Control, unknown and unused tokens: ``b""``.

        Raises:
            IndexError: ``token_id`` is outside ``0 .. vocab_size - 1``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range 0..{self.vocab_size - 1}")
        return self._bytes[token_id]

    def token_text(self, token_id: int) -> str:
        """The token's piece as stored in the vocabulary (``"Ġthe"``, ``"▁the"``, ``"<|im_end|>"``).

        Raises:
            IndexError: ``token_id`` is outside ``0 .. vocab_size - 1``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range 0..{self.vocab_size - 1}")
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (``<|im_start|>``, ``<s>``, ``</s>``, end-of-generation tokens).

        Raises:
            IndexError: ``token_id`` is outside ``0 .. vocab_size - 1``.
        """
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range 0..{self.vocab_size - 1}")
        return self._types[token_id] == TOKEN_CONTROL

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose stored piece is exactly ``text``, or ``None``."""
        if self._hf is not None:
            return self._hf.token_to_id(text)
        return self._piece_ids.get(text)

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})")


class _Guard:
    """What :meth:`Tokenizer.shield` looks for: control-token texts whole (``pattern``), their
    starts and ends (proper prefixes and suffixes) and the longest one's length."""

    def __init__(self, texts: list[str]):
        self.pattern = _alternation(texts)
        self.prefixes = {t[:j] for t in texts for j in range(1, len(t))}
        self.suffixes = {t[j:] for t in texts for j in range(1, len(t))}
        self.longest = max(len(t) for t in texts)


def _alternation(texts: list[str]) -> re.Pattern[str] | None:
    """A regex matching any of ``texts`` (longest match wins), as one capture group, or None.

    Built as a trie (``a(?:b(?:c)?|d)``) rather than a flat alternation: with thousands of
    tokens (Gemma's user-defined ones) a flat ``a|b|c...`` tries every word at every position.
    """
    trie: dict = {}
    for t in texts:
        if t:
            node = trie
            for ch in t:
                node = node.setdefault(ch, {})
            node[""] = {}
    if not trie:
        return None

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in node.items() if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body   # greedy: a longer token wins

    return re.compile("(" + build(trie) + ")")
