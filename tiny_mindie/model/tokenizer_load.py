"""Build a :class:`~tiny_mindie.model.tokenizer.Tokenizer` from the vocabulary stored in a GGUF
file: what every kind shares (tokens, token types, end-of-generation ids, BOS and EOS), then one
loader per kind, chosen by ``tokenizer.ggml.model``:

- ``"gpt2"``: byte-level BPE (GPT-2, SmolLM2, Qwen2, LLaMA 3, ...). Built with Hugging Face
  ``tokenizers`` from ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``; the pre-tokenizer
  (how text is cut into words before BPE) is chosen by ``tokenizer.ggml.pre`` and mirrors the
  regexes of llama.cpp's ``llama-vocab.cpp``.
- ``"llama"``: SentencePiece (LLaMA 1/2, Phi-3, Gemma). Built with ``sentencepiece`` from a
  ``ModelProto`` assembled in memory from pieces, scores and token types (BPE model with byte
  fallback, whitespace escaped to ``"▁"``, dummy space prefix per
  ``tokenizer.ggml.add_space_prefix``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from .gguf import GGUFFile, ModelFileError
from .tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    Tokenizer,
    Vocabulary,
)

# the tokenizer's one logger, whichever of its modules writes the line
log = logging.getLogger("tiny_mindie.model.tokenizer")

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


# ---- what every kind shares -------------------------------------------------------------------
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
    return _LOADERS[_kind(f)](f, _read_vocab(f))


def _kind(f: GGUFFile) -> str:
    """``tokenizer.ggml.model``, one of :data:`_LOADERS` (raises as :func:`load_tokenizer`)."""
    model = f.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFileError(f"{f.path}: no tokenizer in the file (tokenizer.ggml.model missing)")
    if not isinstance(model, str) or model not in _LOADERS:
        raise ModelFileError(f"{f.path}: unsupported tokenizer model {model!r} "
                             f"(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
    return model


def read_vocabulary(f: GGUFFile) -> Vocabulary:
    """The :class:`Vocabulary` :func:`load_tokenizer` would give ``f``'s tokenizer.

    Raises:
        ModelFileError: as :func:`load_tokenizer` (kind, tokens, token types).
    """
    kind, v = _kind(f), _read_vocab(f)
    bos_id, eos_id = _sentencepiece_ids(f, v) if kind == "llama" else (v.bos_id, v.eos_id)
    return _vocabulary(v, bos_id, eos_id)


def _vocabulary(v: _Vocab, bos_id: int | None, eos_id: int | None) -> Vocabulary:
    """``v`` as a :class:`Vocabulary` with these BOS and EOS ids (EOS ends generation too)."""
    return Vocabulary(tokens=v.tokens, types=v.types, bos_id=bos_id, eos_id=eos_id,
                      eog_ids=frozenset(v.eog | _opt(eos_id)))


@dataclass
class _Vocab:
    """The metadata every tokenizer kind reads the same way.

    ``types`` has the end-of-generation tokens forced to control type; ``eog`` holds their ids;
    ``add_bos_key`` is ``tokenizer.ggml.add_bos_token`` as stored (``None`` when absent).
    """

    tokens: list[str]
    types: list[int]
    eog: set[int]
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    add_bos_key: Any


def _read_vocab(f: GGUFFile) -> _Vocab:
    """The shared part of ``f``'s vocabulary (raises :class:`ModelFileError` as
    :func:`load_tokenizer`)."""
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

    return _Vocab(tokens=tokens, types=types, eog=eog,
                  bos_id=_token_id(f, "tokenizer.ggml.bos_token_id", n),
                  eos_id=_token_id(f, "tokenizer.ggml.eos_token_id", n),
                  chat_template=f.get("tokenizer.chat_template"),
                  add_bos_key=f.get("tokenizer.ggml.add_bos_token"))


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


# ---- byte-level BPE ("gpt2") --------------------------------------------------------------------
# pre-tokenizers: regexes from llama.cpp's llama-vocab.cpp
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


def _load_byte_level_bpe(f: GGUFFile, v: _Vocab) -> Tokenizer:
    """The ``"gpt2"`` kind: byte-level BPE with the pre-tokenizer ``tokenizer.ggml.pre`` names."""
    pre_name = str(f.get("tokenizer.ggml.pre") or "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        log.warning("%s: unknown tokenizer.ggml.pre %r, using the GPT-2 pre-tokenizer",
                    f.path, pre_name)
        pre = PRE_TOKENIZERS["gpt-2"]
    merges = _str_list(f, "tokenizer.ggml.merges")
    hf = _build_hf_bpe(v.tokens, v.types, merges, pre, f.path)
    token_bytes = [
        _byte_level_bytes(t) if ty in (TOKEN_NORMAL, TOKEN_BYTE)
        else t.encode("utf-8") if ty == TOKEN_USER_DEFINED else b""
        for t, ty in zip(v.tokens, v.types, strict=True)
    ]
    return Tokenizer(_vocabulary(v, v.bos_id, v.eos_id), kind="gpt2", pre=pre_name,
                     token_bytes=token_bytes,
                     add_bos=bool(v.add_bos_key) if v.add_bos_key is not None else pre.add_bos,
                     chat_template=v.chat_template, encoder=hf)


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



# ---- SentencePiece ("llama") -------------------------------------------------------------------
def _spm_piece_bytes(piece: str, ttype: int) -> bytes:
    """UTF-8 bytes a SentencePiece piece contributes: ``▁`` -> space, ``<0xAB>`` -> that byte."""
    if ttype == TOKEN_BYTE:
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _sentencepiece_ids(f: GGUFFile, v: _Vocab) -> tuple[int | None, int | None]:
    """BOS and EOS of a SentencePiece vocabulary: llama.cpp's defaults (1, 2) for absent keys."""
    n = len(v.tokens)
    bos_id, eos_id = v.bos_id, v.eos_id
    if bos_id is None and f.get("tokenizer.ggml.bos_token_id") is None and n > 1:
        bos_id = 1
    if eos_id is None and f.get("tokenizer.ggml.eos_token_id") is None and n > 2:
        eos_id = 2
    return bos_id, eos_id


def _load_sentencepiece(f: GGUFFile, v: _Vocab) -> Tokenizer:
    """The ``"llama"`` kind: SentencePiece, with llama.cpp's defaults for absent keys."""
    n = len(v.tokens)
    bos_id, eos_id = _sentencepiece_ids(f, v)
    scores = f.get("tokenizer.ggml.scores")
    scores = [float(s) for s in scores] if scores is not None else [0.0] * n
    if len(scores) != n:
        raise ModelFileError(f"{f.path}: tokenizer.ggml.scores has {len(scores)} entries, "
                             f"tokenizer.ggml.tokens {n}")
    add_space_prefix = f.get("tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    remove_extra_ws = bool(f.get("tokenizer.ggml.remove_extra_whitespaces") or False)
    unk_id = _token_id(f, "tokenizer.ggml.unknown_token_id", n)
    spm = _build_spm(v.tokens, v.types, scores, unk_id, remove_extra_ws, f.path)
    token_bytes = [
        _spm_piece_bytes(t, ty) if ty in (TOKEN_NORMAL, TOKEN_BYTE)
        else t.encode("utf-8") if ty == TOKEN_USER_DEFINED else b""
        for t, ty in zip(v.tokens, v.types, strict=True)
    ]
    return Tokenizer(_vocabulary(v, bos_id, eos_id), kind="llama", token_bytes=token_bytes,
                     add_bos=True if v.add_bos_key is None else bool(v.add_bos_key),
                     chat_template=v.chat_template, encoder=spm,
                     add_space_prefix=add_space_prefix)


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


# ---- the kinds, by ``tokenizer.ggml.model`` ---------------------------------------------------
_LOADERS = {"gpt2": _load_byte_level_bpe, "llama": _load_sentencepiece}
