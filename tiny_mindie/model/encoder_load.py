"""Embedding models read from their files: a GGUF of llama.cpp's ``nomic-bert`` or ``bert``
architecture, or a sentence-transformers folder (``config.json``, ``model.safetensors`` read
with ``safetensors``, ``tokenizer.json`` with ``tokenizers``, ``1_Pooling/config.json``).

Both become one :class:`EncoderModel`: an :class:`EncoderConfig`, float32 weights in the layout
both encoders read (:class:`EncoderWeights`; matrices ``[in, out]``, so ``y = x @ w + b``) and a
``tokenizers.Tokenizer`` that adds ``[CLS]`` and ``[SEP]`` and truncates nothing itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from .gguf import GGUFFile, ModelFileError

#: GGUF ``<arch>.pooling_type`` -> pooling (llama.cpp's enum: 1 mean, 2 CLS, 3 last)
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
#: the task prefixes nomic-embed-text expects, by TEI's ``prompt_name``
NOMIC_PREFIXES = {"search_query": "search_query: ", "search_document": "search_document: ",
                  "classification": "classification: ", "clustering": "clustering: "}


@dataclass(frozen=True)
class EncoderConfig:
    """An encoder's shape and what is done with its output.

    Attributes:
        name: the model's name (``/v1/models``, the ``model`` field).
        arch: ``"bert"`` (absolute positions, GELU, biases) or ``"nomic-bert"`` (rotary
            positions, SwiGLU, no biases in the projections).
        hidden, layers, heads, ffn: sizes; ``eps`` the layer norms' epsilon.
        context: the most tokens one input may have ([CLS] and [SEP] included).
        vocab: token ids are ``0 .. vocab - 1``; ``pad_id`` pads a batch.
        pooling: ``"mean"`` (over the input's tokens), ``"cls"`` (its first) or ``"last"``.
        normalize: vectors scaled to unit L2 norm.
        rope_base: nomic-bert's rotary base.
        matryoshka: the shorter lengths the model was trained to be cut to (``dimensions``);
            empty: none.
        prefixes: the task prefixes the model declares, by name (TEI's ``prompt_name``).
    """

    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    ffn: int
    eps: float
    context: int
    vocab: int
    pooling: str = "mean"
    normalize: bool = True
    rope_base: float = 10000.0
    pad_id: int = 0
    matryoshka: tuple[int, ...] = ()
    prefixes: dict[str, str] = field(default_factory=dict)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass
class EncoderLayer:
    """One block's float32 weights; matrices ``[in, out]``. ``up_b``/``down_b``/``qkv_b``/
    ``out_b`` are zeros where the model has none; ``gate`` is nomic-bert's (SwiGLU)."""

    qkv: np.ndarray
    qkv_b: np.ndarray
    out: np.ndarray
    out_b: np.ndarray
    ln1_w: np.ndarray
    ln1_b: np.ndarray
    up: np.ndarray
    up_b: np.ndarray
    down: np.ndarray
    down_b: np.ndarray
    ln2_w: np.ndarray
    ln2_b: np.ndarray
    gate: np.ndarray | None = None


@dataclass
class EncoderWeights:
    """The embeddings' float32 weights and the blocks: ``tokens [vocab, hidden]``, ``positions
    [context, hidden]`` (None for rotary models), ``types [type_vocab, hidden]``, the embedding
    layer norm."""

    tokens: np.ndarray
    positions: np.ndarray | None
    types: np.ndarray
    norm_w: np.ndarray
    norm_b: np.ndarray
    layers: list[EncoderLayer]


@dataclass
class EncoderModel:
    """An embedding model, loaded: its path, configuration, weights and tokenizer."""

    path: str
    config: EncoderConfig
    weights: EncoderWeights
    tokenizer: object                      # tokenizers.Tokenizer


def load_encoder(path: str, name: str | None = None) -> EncoderModel:
    """The embedding model at ``path``: a ``.gguf`` file or a sentence-transformers folder.

    Raises:
        ModelFileError: a file missing or unreadable, or an architecture that is not an encoder
            this project runs (one line).
    """
    if os.path.isdir(path):
        return _load_folder(path, name or os.path.basename(os.path.normpath(path)))
    return _load_gguf(path, name)


# ---- GGUF --------------------------------------------------------------------------------------

def _load_gguf(path: str, name: str | None) -> EncoderModel:
    f = GGUFFile(path)
    arch = f.architecture
    if arch != "nomic-bert":
        raise ModelFileError(f"{path}: architecture {arch!r} is not an embedding model this "
                             "project runs (nomic-bert GGUF, or a sentence-transformers BERT "
                             "folder)")
    if f.get(f"{arch}.attention.causal", False):
        raise ModelFileError(f"{path}: a causal {arch} is not an encoder")
    pooling = GGUF_POOLING.get(int(f.get(f"{arch}.pooling_type", 1)))
    if pooling is None:
        raise ModelFileError(f"{path}: pooling type {f.get(f'{arch}.pooling_type')} is not "
                             "mean, CLS or last")
    hidden = int(f.require(f"{arch}.embedding_length"))
    tokens = [str(t) for t in f.require("tokenizer.ggml.tokens")]
    title = str(f.get("general.name", "")) or os.path.basename(path)
    nomic = "nomic-embed-text" in title
    cfg = EncoderConfig(
        name=name or title, arch=arch, hidden=hidden,
        layers=int(f.require(f"{arch}.block_count")),
        heads=int(f.require(f"{arch}.attention.head_count")),
        ffn=int(f.require(f"{arch}.feed_forward_length")),
        eps=float(f.get(f"{arch}.attention.layer_norm_epsilon", 1e-12)),
        context=int(f.require(f"{arch}.context_length")), vocab=len(tokens), pooling=pooling,
        rope_base=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        pad_id=int(f.get("tokenizer.ggml.padding_token_id", 0)),
        matryoshka=(512, 256, 128, 64) if "v1.5" in title and nomic else (),
        prefixes=dict(NOMIC_PREFIXES) if nomic else {})
    return EncoderModel(os.path.abspath(path), cfg, _gguf_weights(f, cfg),
                        _wordpiece(f, tokens))


def _gguf_weights(f: GGUFFile, cfg: EncoderConfig) -> EncoderWeights:
    def mat(n: str) -> np.ndarray:                 # GGUF [out, in] -> [in, out]
        return np.ascontiguousarray(f.dequantize(n).T)

    def vec(n: str) -> np.ndarray:
        return f.dequantize(n).reshape(-1)

    zeros = np.zeros
    layers = []
    for i in range(cfg.layers):
        p = f"blk.{i}."
        layers.append(EncoderLayer(
            qkv=mat(p + "attn_qkv.weight"), qkv_b=zeros(3 * cfg.hidden, np.float32),
            out=mat(p + "attn_output.weight"), out_b=zeros(cfg.hidden, np.float32),
            ln1_w=vec(p + "attn_output_norm.weight"), ln1_b=vec(p + "attn_output_norm.bias"),
            up=mat(p + "ffn_up.weight"), up_b=zeros(cfg.ffn, np.float32),
            down=mat(p + "ffn_down.weight"), down_b=zeros(cfg.hidden, np.float32),
            ln2_w=vec(p + "layer_output_norm.weight"), ln2_b=vec(p + "layer_output_norm.bias"),
            gate=mat(p + "ffn_gate.weight")))
    return EncoderWeights(tokens=f.dequantize("token_embd.weight"), positions=None,
                          types=f.dequantize("token_types.weight"),
                          norm_w=vec("token_embd_norm.weight"),
                          norm_b=vec("token_embd_norm.bias"), layers=layers)


def _wordpiece(f: GGUFFile, tokens: list[str]):
    """The GGUF's WordPiece vocabulary as a ``tokenizers`` BERT tokenizer: BERT's normalizer
    (lower case when the vocabulary has no upper-case piece), its pre-tokenizer, ``[CLS] text
    [SEP]``. llama.cpp's converter marks a word's first piece with ``\u2581`` and strips the
    ``##`` of the others; WordPiece's own spelling is restored here."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors

    tokens = [_wordpiece_spelling(t) for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[int(f.get("tokenizer.ggml.unknown_token_id", 100))]
    cls = int(f.get("tokenizer.ggml.bos_token_id", 101))
    sep = int(f.get("tokenizer.ggml.seperator_token_id", f.get("tokenizer.ggml.eos_token_id", 102)))
    lower = not any(t.isascii() and t.lower() != t and not t.startswith("[") for t in tokens)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{tokens[cls]} $A {tokens[sep]}",
        special_tokens=[(tokens[cls], cls), (tokens[sep], sep)])
    types = f.get("tokenizer.ggml.token_type") or []
    # unknown and control pieces are special tokens, as tokenizer.json has them
    control = [tokens[i] for i, t in enumerate(types) if int(t) in (2, 3)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok


def _wordpiece_spelling(piece: str) -> str:
    """A GGUF ``bert`` vocabulary piece in WordPiece's spelling (``\u2581word`` -> ``word``,
    ``suffix`` -> ``##suffix``, ``[SPECIAL]`` kept)."""
    if piece.startswith("[") and piece.endswith("]"):
        return piece
    return piece[1:] if piece.startswith("\u2581") else "##" + piece


# ---- sentence-transformers ---------------------------------------------------------------------

def _read_json(path: str, default=None):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        if default is not None:
            return default
        raise ModelFileError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not readable JSON ({exc})") from None


def _folder_config(path: str, name: str) -> EncoderConfig:
    hf = _read_json(os.path.join(path, "config.json"))
    if hf.get("model_type") != "bert" or hf.get("position_embedding_type",
                                                "absolute") != "absolute":
        raise ModelFileError(f"{path}: model_type {hf.get('model_type')!r} is not an embedding "
                             "model this project runs (BERT with absolute positions)")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ModelFileError(f"{path}: hidden_act {hf.get('hidden_act')!r} is not gelu")
    pool = _read_json(os.path.join(path, "1_Pooling", "config.json"),
                      {"pooling_mode_mean_tokens": True})
    pooling = ("cls" if pool.get("pooling_mode_cls_token") else
               "last" if pool.get("pooling_mode_lasttoken") else
               "mean" if pool.get("pooling_mode_mean_tokens") else None)
    if pooling is None:
        raise ModelFileError(f"{path}: 1_Pooling/config.json asks for a pooling that is not "
                             "mean, CLS or last")
    modules = _read_json(os.path.join(path, "modules.json"), [])
    st = _read_json(os.path.join(path, "sentence_bert_config.json"), {})
    context = int(hf.get("max_position_embeddings", 512))
    context = min(context, int(st.get("max_seq_length") or context))
    return EncoderConfig(
        name=name, arch="bert", hidden=int(hf["hidden_size"]),
        layers=int(hf["num_hidden_layers"]), heads=int(hf["num_attention_heads"]),
        ffn=int(hf["intermediate_size"]), eps=float(hf.get("layer_norm_eps", 1e-12)),
        context=context, vocab=int(hf["vocab_size"]), pooling=pooling,
        normalize=any(str(m.get("type", "")).endswith("Normalize") for m in modules) or
        not modules, pad_id=int(hf.get("pad_token_id", 0)))


def _load_folder(path: str, name: str) -> EncoderModel:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    cfg = _folder_config(path, name)
    try:
        st = load_file(os.path.join(path, "model.safetensors"))
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except (OSError, SafetensorError, Exception) as exc:   # tokenizers raises plain Exception
        raise ModelFileError(f"{path}: {exc}") from None
    tok.no_truncation()
    tok.no_padding()
    try:
        weights = _bert_weights(st, cfg)
    except KeyError as exc:
        raise ModelFileError(f"{path}: model.safetensors lacks {exc}") from None
    return EncoderModel(os.path.abspath(path), cfg, weights, tok)


def _bert_weights(st: dict[str, np.ndarray], cfg: EncoderConfig) -> EncoderWeights:
    pre = "bert." if "bert.embeddings.word_embeddings.weight" in st else ""

    def t(n: str) -> np.ndarray:
        return np.ascontiguousarray(st[pre + n], dtype=np.float32)

    layers = []
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        a = p + "attention.self."
        layers.append(EncoderLayer(
            qkv=np.concatenate([t(a + k + ".weight").T for k in ("query", "key", "value")], 1),
            qkv_b=np.concatenate([t(a + k + ".bias") for k in ("query", "key", "value")]),
            out=np.ascontiguousarray(t(p + "attention.output.dense.weight").T),
            out_b=t(p + "attention.output.dense.bias"),
            ln1_w=t(p + "attention.output.LayerNorm.weight"),
            ln1_b=t(p + "attention.output.LayerNorm.bias"),
            up=np.ascontiguousarray(t(p + "intermediate.dense.weight").T),
            up_b=t(p + "intermediate.dense.bias"),
            down=np.ascontiguousarray(t(p + "output.dense.weight").T),
            down_b=t(p + "output.dense.bias"),
            ln2_w=t(p + "output.LayerNorm.weight"), ln2_b=t(p + "output.LayerNorm.bias")))
    e = "embeddings."
    return EncoderWeights(tokens=t(e + "word_embeddings.weight"),
                          positions=t(e + "position_embeddings.weight"),
                          types=t(e + "token_type_embeddings.weight"),
                          norm_w=t(e + "LayerNorm.weight"), norm_b=t(e + "LayerNorm.bias"),
                          layers=layers)
