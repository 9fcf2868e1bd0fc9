"""Architecture parameters of a decoder-only transformer, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from .gguf import GGUFFile, ModelFileError

SUPPORTED_ARCHITECTURES = ("llama",)


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

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
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
        )
