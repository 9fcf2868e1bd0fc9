"""Text <-> token ids, built in memory from the vocabulary stored in a GGUF file.

Two vocabulary kinds are supported, chosen by ``tokenizer.ggml.model``:

- ``"gpt2"``: byte-level BPE (GPT-2, SmolLM2, Qwen2, LLaMA 3, ...). Built with Hugging Face
  ``tokenizers`` from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``; the pre-tokenizer
  (how text is cut into words before BPE) is chosen by ``tokenizer.ggml.pre`` and mirrors the
  regexes of llama.cpp's ``llama-vocab.cpp``.
- ``"llama"``: SentencePiece (LLaMA 1/2, Phi-3, Gemma). Built with ``sentencepiece`` from a
  ``ModelProto`` assembled in memory from pieces, scores and token types (BPE model with byte
  fallback, whitespace escaped to ``"▁"``, dummy space prefix per
  ``tokenizer.ggml.add_space_prefix``).

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
import logging
import os
import re
import threading
from collections.abc import Sequence

from tiny_mindie.model.gguf import GGUFFile, ModelFileError

log = logging.getLogger(__name__)

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Texts of tokens that end generation when present in the vocabulary (llama.cpp, llama-vocab.cpp).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
})
# Fill-in-the-middle pad / repo / file-separator tokens: llama.cpp also ends generation on them.
_FIM_EOG_TEXTS = frozenset({
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
})
_EOG_ID_KEYS = (
    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
)

# ---- byte-level BPE pre-tokenizers (regexes from llama.cpp's llama-vocab.cpp) --------------------
_GPT2 = "gpt2"            # HF ByteLevel's own GPT-2 regex
_DIGITS = r"\p{N}"
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class _Pre:
    """How one ``tokenizer.ggml.pre`` family cuts text: regexes applied in turn, then flags."""

    def __init__(self, splits: tuple[str, ...], *, ignore_merges: bool = False,
                 add_bos: bool = False):
        self.splits = splits            # each: a regex, or _GPT2 for HF ByteLevel's GPT-2 split
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos          # llama.cpp's default for add_bos when the key is absent


_PRE_FAMILIES: list[tuple[tuple[str, ...], _Pre]] = [
    (("default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
      "jina-v2-de", "a.x-4.0", "mellum", "jina-v1-en", "jina-v2-code", "roberta-bpe", "mpt",
      "olmo", "jais", "trillion", "granite-docling", "exaone4"), _Pre((_GPT2,))),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     _Pre((_DIGITS, _GPT2))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez", "hunyuan"), _Pre((_QWEN2,))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
     _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), _Pre((_LLAMA3,))),
    (("gpt-4o", "llama4"), _Pre((_GPT4O,))),
]
PRE_TOKENIZERS: dict[str, _Pre] = {name: pre for names, pre in _PRE_FAMILIES for name in names}


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable-character map, reversed: character -> byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


# Token ids come from ``encode_batch`` (it lets go of the GIL while encoding; ``encode`` held it
# for all of a 5 MB text, stalling every other request), one text at a time: no rayon pool,
# and no "process just got forked" warning from a child process after it has run.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_DECODER = _gpt2_byte_decoder()
# str.translate table: the 68 remapped characters (U+0100..U+0143) back to U+0000..U+00FF, so a
# translated byte-level piece encodes to its bytes with latin-1.
_BYTE_TRANSLATE = {ord(c): b for c, b in _BYTE_DECODER.items() if ord(c) >= 256}


def _byte_level_bytes(piece: str) -> bytes:
    """UTF-8 bytes of a byte-level BPE piece (GPT-2 byte map reversed)."""
    try:
        out = piece.translate(_BYTE_TRANSLATE).encode("latin-1")
    except UnicodeEncodeError:
        out = None
    if out is not None and all(c in _BYTE_DECODER for c in piece):
        return out
    # a character outside the byte map (a malformed vocabulary): keep its own UTF-8
    return b"".join(bytes([_BYTE_DECODER[c]]) if c in _BYTE_DECODER else c.encode("utf-8")
                    for c in piece)


def _spm_piece_bytes(piece: str, ttype: int) -> bytes:
    """UTF-8 bytes a SentencePiece piece contributes: ``▁`` -> space, ``<0xAB>`` -> that byte."""
    if ttype == TOKEN_BYTE:
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


class Tokenizer:
    """Encodes text to token ids and decodes ids back to text, for one model's vocabulary.

    Build it with :func:`load_tokenizer`. Safe to share between threads.

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

    def __init__(self, *, kind: str, tokens: list[str], token_types: list[int],
                 token_bytes: list[bytes], bos_id: int | None, eos_id: int | None,
                 eog_ids: frozenset[int], add_bos: bool, chat_template: str | None,
                 pre: str | None = None, hf=None, spm=None, add_space_prefix: bool = False):
        """Internal: use :func:`load_tokenizer`."""
        self.kind = kind
        self.pre = pre
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eog_ids = eog_ids
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
               parse_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: the text to encode.
            add_bos: prepend ``bos_id``; ``None`` means :attr:`add_bos`. Ignored when the
                vocabulary has no BOS token.
            parse_special: when True, control tokens written in the text (``<|im_start|>``)
                become their single id; when False they are encoded as plain text.
                User-defined tokens are always parsed (as llama.cpp does).

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
            ids.extend(self._spm_encode(text, parse_special))
        return ids

    def _spm_encode(self, text: str, parse_special: bool) -> list[int]:
        # llama.cpp: cut special tokens out of the text, encode each raw fragment separately,
        # with a space prefix at the start and after every special token.
        pattern = self._spm_special if parse_special else self._spm_user
        pieces = pattern.split(text) if pattern is not None else [text]
        ids: list[int] = []
        prev_special = True
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
            return [self._spm_encode(t, parse_special=False) if t else [] for t in texts]
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


# ---- loading ------------------------------------------------------------------------------------
def load_tokenizer(f: GGUFFile) -> Tokenizer:
    """Build the tokenizer of the model in ``f`` from its ``tokenizer.ggml.*`` metadata.

    Args:
        f: an open GGUF file.

    Returns:
        the :class:`Tokenizer`.

    Raises:
        ModelFileError: the tokenizer model is neither ``"gpt2"`` nor ``"llama"``, or the
            vocabulary metadata is missing or inconsistent.
    """
    model = f.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFileError(f"{f.path}: no tokenizer in the file (tokenizer.ggml.model missing)")
    if model not in ("gpt2", "llama"):
        raise ModelFileError(f"{f.path}: unsupported tokenizer model {model!r} "
                             f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    tokens = _str_list(f, "tokenizer.ggml.tokens")
    n = len(tokens)
    if n == 0:
        raise ModelFileError(f"{f.path}: tokenizer.ggml.tokens is empty")
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[EMPTY_{i}]"   # as llama.cpp does
    types = f.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * n
    if len(types) != n:
        raise ModelFileError(f"{f.path}: tokenizer.ggml.token_type has {len(types)} entries, "
                             f"tokenizer.ggml.tokens {n}")

    # end-of-generation tokens; llama.cpp forces them to control type
    eog = {i for i, t in enumerate(tokens) if t in EOG_TEXTS or t in _FIM_EOG_TEXTS}
    for key in _EOG_ID_KEYS:
        v = f.get(key)
        if v is not None and 0 <= int(v) < n:
            eog.add(int(v))
    for i in eog:
        if types[i] != TOKEN_CONTROL:
            types[i] = TOKEN_CONTROL

    bos_id = _token_id(f, "tokenizer.ggml.bos_token_id", n)
    eos_id = _token_id(f, "tokenizer.ggml.eos_token_id", n)
    chat_template = f.get("tokenizer.chat_template")
    add_bos_key = f.get("tokenizer.ggml.add_bos_token")

    if model == "gpt2":
        pre_name = str(f.get("tokenizer.ggml.pre") or "default")
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            log.warning("%s: unknown tokenizer.ggml.pre %r, using the GPT-2 pre-tokenizer",
                        f.path, pre_name)
            pre = PRE_TOKENIZERS["gpt-2"]
        merges = _str_list(f, "tokenizer.ggml.merges")
        hf = _build_hf_bpe(tokens, types, merges, pre, f.path)
        token_bytes = [
            _byte_level_bytes(t) if ty in (TOKEN_NORMAL, TOKEN_BYTE)
            else t.encode("utf-8") if ty == TOKEN_USER_DEFINED else b""
            for t, ty in zip(tokens, types, strict=True)
        ]
        return Tokenizer(kind="gpt2", pre=pre_name, tokens=tokens, token_types=types,
                         token_bytes=token_bytes, bos_id=bos_id, eos_id=eos_id,
                         eog_ids=frozenset(eog | _opt(eos_id)),
                         add_bos=bool(add_bos_key) if add_bos_key is not None else pre.add_bos,
                         chat_template=chat_template, hf=hf)

    if model == "llama":
        if bos_id is None and f.get("tokenizer.ggml.bos_token_id") is None and n > 1:
            bos_id = 1      # llama.cpp's SentencePiece defaults
        if eos_id is None and f.get("tokenizer.ggml.eos_token_id") is None and n > 2:
            eos_id = 2
        scores = f.get("tokenizer.ggml.scores")
        scores = [float(s) for s in scores] if scores is not None else [0.0] * n
        if len(scores) != n:
            raise ModelFileError(f"{f.path}: tokenizer.ggml.scores has {len(scores)} entries, "
                                 f"tokenizer.ggml.tokens {n}")
        add_space_prefix = f.get("tokenizer.ggml.add_space_prefix")
        add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
        remove_extra_ws = bool(f.get("tokenizer.ggml.remove_extra_whitespaces") or False)
        unk_id = _token_id(f, "tokenizer.ggml.unknown_token_id", n)
        spm = _build_spm(tokens, types, scores, unk_id, remove_extra_ws, f.path)
        token_bytes = [
            _spm_piece_bytes(t, ty) if ty in (TOKEN_NORMAL, TOKEN_BYTE)
            else t.encode("utf-8") if ty == TOKEN_USER_DEFINED else b""
            for t, ty in zip(tokens, types, strict=True)
        ]
        return Tokenizer(kind="llama", tokens=tokens, token_types=types, token_bytes=token_bytes,
                         bos_id=bos_id, eos_id=eos_id, eog_ids=frozenset(eog | _opt(eos_id)),
                         add_bos=True if add_bos_key is None else bool(add_bos_key),
                         chat_template=chat_template, spm=spm, add_space_prefix=add_space_prefix)

    raise AssertionError(model)  # unreachable: checked above


def _opt(x: int | None) -> set[int]:
    return set() if x is None else {x}


def _token_id(f: GGUFFile, key: str, n: int) -> int | None:
    v = f.get(key)
    if v is None:
        return None
    v = int(v)
    if not 0 <= v < n:
        log.warning("%s: %s = %d is outside the vocabulary (%d tokens); ignored", f.path, key, v, n)
        return None
    return v


def _str_list(f: GGUFFile, key: str) -> list[str]:
    value = f.get(key)
    if value is None:
        raise ModelFileError(f"{f.path}: metadata key {key!r} is missing")
    if not isinstance(value, list):
        raise ModelFileError(f"{f.path}: metadata key {key!r} is not an array")
    return [str(v) for v in value]


def _build_hf_bpe(tokens: list[str], types: list[int], merges: list[str], pre: _Pre, path: str):
    """A Hugging Face ``tokenizers.Tokenizer`` for a byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        k = m.find(" ", 1)     # llama.cpp splits at the first space after the first character
        if k < 0:
            raise ModelFileError(f"{path}: malformed BPE merge {m!r}")
        pairs.append((m[:k], m[k + 1:]))
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    except Exception as exc:
        raise ModelFileError(f"{path}: cannot build the BPE vocabulary ({exc})") from exc
    hf = HFTokenizer(bpe)

    steps = []
    for s in pre.splits:
        if s == _GPT2:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(s), behavior="isolated"))
    if pre.splits[-1] != _GPT2:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    hf.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()

    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types, strict=True) if ty in (TOKEN_CONTROL, TOKEN_UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == TOKEN_USER_DEFINED]
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
    return hf


def _build_spm(tokens: list[str], types: list[int], scores: list[float], unk_id: int | None,
               remove_extra_ws: bool, path: str):
    """A ``sentencepiece.SentencePieceProcessor`` for a SentencePiece vocabulary.

    The dummy space prefix is not set in the model: :class:`Tokenizer` adds it per fragment,
    as llama.cpp does (also after special tokens).
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    n = len(tokens)
    if unk_id is None or types[unk_id] not in (TOKEN_UNKNOWN, TOKEN_CONTROL):
        unk_id = next((i for i, ty in enumerate(types) if ty == TOKEN_UNKNOWN), None)
    if unk_id is None:
        raise ModelFileError(f"{path}: SentencePiece vocabulary without an unknown token")
    n_bytes = sum(1 for ty in types if ty == TOKEN_BYTE)

    proto = pb.ModelProto()
    ts = proto.trainer_spec
    ts.model_type = pb.TrainerSpec.BPE
    ts.vocab_size = n
    ts.byte_fallback = n_bytes == 256
    ts.unk_id = unk_id
    ts.unk_piece = tokens[unk_id]
    ts.bos_id = -1
    ts.eos_id = -1
    ts.pad_id = -1
    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = False
    ns.remove_extra_whitespaces = remove_extra_ws
    ns.escape_whitespaces = True

    # sentencepiece wants exactly one UNKNOWN piece and unique pieces; llama.cpp has neither rule
    seen = set()
    add = proto.pieces.add
    for i, (t, ty, sc) in enumerate(zip(tokens, types, scores, strict=True)):
        if i == unk_id:
            pty = pb.ModelProto.SentencePiece.UNKNOWN
        elif ty == TOKEN_UNKNOWN or t in seen:
            pty = pb.ModelProto.SentencePiece.UNUSED
        elif ty == TOKEN_BYTE and n_bytes != 256:
            pty = pb.ModelProto.SentencePiece.NORMAL
        else:
            pty = ty if ty in (1, 3, 4, 5, 6) else pb.ModelProto.SentencePiece.NORMAL
        if t in seen:
            t = f"\ufffe[DUP_{i}]"
        seen.add(t)
        add(piece=t, score=sc, type=pty)
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto.SerializeToString())
    except Exception as exc:
        raise ModelFileError(f"{path}: cannot build the SentencePiece model ({exc})") from exc
    return sp
