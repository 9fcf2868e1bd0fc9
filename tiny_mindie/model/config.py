"""Architecture parameters of a decoder-only transformer, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .gguf import GGUFFile, ModelFileError

SUPPORTED_ARCHITECTURES = ("llama", "gemma3", "qwen2")

# Gemma 3: every ``GEMMA3_SWA_PATTERN``-th layer is global, the others use sliding-window
# attention (llama.cpp ``hparams.set_swa_pattern(6)``; HF ``sliding_window_pattern = 6``); the
# local layers' rotary base is fixed at 10000 (llama.cpp ``rope_freq_base_train_swa``; HF
# ``rope_local_base_freq``). The GGUF stores neither.
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_THETA_LOCAL = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of the decoder.

    All sizes are counts (elements, heads, layers, tokens). ``rope_theta`` is the rotary base
    (RoFormer, Su et al. 2021, eq. 15); ``rms_eps`` is RMSNorm's epsilon (Zhang & Sennrich 2019).
    """

    architecture: str
    vocab_size: int          # rows of the embedding / logits width
    hidden_size: int         # d_model
    intermediate_size: int   # MLP width
    num_layers: int
    num_heads: int           # query heads
    num_kv_heads: int        # key/value heads (grouped-query attention when < num_heads)
    head_dim: int
    rope_dim: int            # leading part of each head that is rotated (== head_dim for LLaMA)
    rope_theta: float
    rms_eps: float
    context_length: int      # trained context, tokens
    tied_embeddings: bool    # LM head shares the token embedding matrix
    # ---- Gemma 3 (the defaults are LLaMA's) ----
    rope_neox: bool = False          # rotary pairs (x[i], x[i + rope_dim/2]), not (x[2i], x[2i+1])
    embedding_scale: float = 1.0     # embeddings multiplied by this (Gemma: sqrt(d_model))
    attention_scale: float = 0.0     # scores scale; 0 means 1/sqrt(head_dim)
    mlp_act: str = "silu"            # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False            # RMSNorm of each q and k head over head_dim before rope
    post_norms: bool = False         # RMSNorm of attention and MLP outputs before the residual add
    sliding_window: int = 0          # local layers: query at p sees keys p-window+1..p; 0 = none
    swa_pattern: int = 0             # layer i is global when (i + 1) % swa_pattern == 0 (0: all)
    rope_theta_local: float = 0.0    # rotary base of the local (sliding-window) layers
    # ---- Qwen2 ----
    qkv_bias: bool = False           # q, k, v projections add a bias (``blk.N.attn_{q,k,v}.bias``)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention (and the local rotary base)."""
        return (self.sliding_window > 0 and self.swa_pattern > 0
                and (layer + 1) % self.swa_pattern != 0)

    @property
    def attn_scale(self) -> float:
        """Multiplier of the attention scores ``q . k``."""
        return self.attention_scale or 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelConfig:
        """Read the parameters of ``f``.

        Raises:
            ModelFileError: unsupported architecture or missing keys.
        """
        arch = f.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelFileError(
                f"{f.path}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        p = arch + "."
        hidden = int(f.require(p + "embedding_length"))
        heads = int(f.require(p + "attention.head_count"))
        kv_heads = int(f.get(p + "attention.head_count_kv", heads))
        head_dim = int(f.get(p + "attention.key_length", hidden // heads))
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = int(f.get(p + "vocab_size", len(tokens) if tokens is not None else 0))
        extra = {}
        if arch == "gemma3":
            # query_pre_attn_scalar == head_dim for every Gemma 3 except 27B (which uses
            # d_model / n_head); llama.cpp derives the scale the same way (no GGUF key).
            scalar = hidden / heads if int(f.require(p + "block_count")) == 62 else head_dim
            extra = dict(
                rope_neox=True, embedding_scale=math.sqrt(hidden), attention_scale=scalar ** -0.5,
                mlp_act="gelu_tanh", qk_norm=True, post_norms=True,
                sliding_window=int(f.get(p + "attention.sliding_window", 0)),
                swa_pattern=GEMMA3_SWA_PATTERN, rope_theta_local=GEMMA3_ROPE_THETA_LOCAL)
        elif arch == "qwen2":
            # LLaMA's block plus q/k/v biases; llama.cpp's converter leaves Q/K rows in HF order
            # and llama.cpp rotates qwen2 in NEOX mode (LLAMA_ROPE_TYPE_NEOX).
            extra = dict(rope_neox=True, qkv_bias=True)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(f.require(p + "feed_forward_length")),
            num_layers=int(f.require(p + "block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_dim=int(f.get(p + "rope.dimension_count", head_dim)),
            rope_theta=float(f.get(p + "rope.freq_base", 10000.0)),
            rms_eps=float(f.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            context_length=int(f.get(p + "context_length", 2048)),
            tied_embeddings=not f.has_tensor("output.weight"),
            **extra,
        )
