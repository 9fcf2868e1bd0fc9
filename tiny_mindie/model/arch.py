"""Architecture parameters of a decoder-only transformer, read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .gguf import GGUFFile, ModelFileError

SUPPORTED_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3", "phi3", "smollm3")

# SmolLM3 skips the rotary embedding on every 4th layer ("NoPE"); llama.cpp hard-codes the step
# (``hparams.n_no_rope_layer_step = 4`` in src/models/smollm3.cpp), the GGUF stores no key.
SMOLLM3_NO_ROPE_STEP = 4
# YaRN's ramp ends (llama.cpp ``yarn_beta_fast`` / ``yarn_beta_slow`` defaults; HF the same).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0

# Gemma 3: every ``GEMMA3_SWA_PATTERN``-th layer is global, the others use sliding-window
# attention (llama.cpp ``hparams.set_swa_pattern(6)``; HF ``sliding_window_pattern = 6``; the
# GGUF stores no key). The local layers' rotary base is ``gemma3.rope.freq_base_swa`` when the
# file has it, else 10000 (llama.cpp ``rope_freq_base_train_swa``; HF ``rope_local_base_freq``).
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
    # ---- rotary scaling (see :func:`.reference.layers.rope_frequencies`) ----
    rope_scaling: str = "none"       # ``rope.scaling.type``: "none", "linear" or "yarn"
    rope_factor: float = 1.0         # ``rope.scaling.factor`` (linear: positions / factor)
    rope_attn_factor: float = 1.0    # ``rope.scaling.attn_factor``: cos and sin times this
    rope_orig_context: int = 0       # ``rope.scaling.original_context_length`` (YaRN, LongRoPE)
    rope_freq_factors: tuple[float, ...] = ()   # ``rope_freqs.weight`` (Llama 3.1+): divisors
    rope_factors_long: tuple[float, ...] = ()   # ``rope_factors_long.weight`` (Phi-3 LongRoPE)
    rope_factors_short: tuple[float, ...] = ()  # ``rope_factors_short.weight``
    no_rope_step: int = 0            # layer i skips rotary when (i + 1) % step == 0 (SmolLM3)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` uses sliding-window attention (and the local rotary base): every
        layer when ``swa_pattern`` is 0 (Phi-3, Mistral), else all but every
        ``swa_pattern``-th (Gemma 3)."""
        return self.sliding_window > 0 and (self.swa_pattern == 0
                                            or (layer + 1) % self.swa_pattern != 0)

    def uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates q and k (False on SmolLM3's every 4th, "NoPE", layer)."""
        return self.no_rope_step == 0 or (layer + 1) % self.no_rope_step != 0

    def freq_factors(self, n_ctx: int) -> tuple[float, ...]:
        """The per-pair frequency divisors for sequences of up to ``n_ctx`` positions:
        ``rope_freqs`` (Llama 3), or Phi-3's LongRoPE long factors when ``n_ctx`` exceeds the
        original context and its short factors otherwise (llama.cpp
        ``llama_model::get_rope_factors``); ``()`` when none."""
        if self.rope_freq_factors:
            return self.rope_freq_factors
        if self.rope_factors_long and n_ctx > self.rope_orig_context:
            return self.rope_factors_long
        return self.rope_factors_short

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
        refuse_unsupported(f)
        extra = _architecture_fields(f, arch, hidden, heads, head_dim)
        extra.update(_rope_scaling(f, p))
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


def _architecture_fields(f: GGUFFile, arch: str, hidden: int, heads: int, head_dim: int) -> dict:
    """The fields of :class:`ModelConfig` that ``arch`` sets apart from LLaMA's defaults."""
    p = arch + "."
    extra: dict = {}
    if arch == "gemma3":
        # query_pre_attn_scalar == head_dim for every Gemma 3 except 27B (which uses
        # d_model / n_head); llama.cpp derives the scale the same way (no GGUF key).
        scalar = hidden / heads if int(f.require(p + "block_count")) == 62 else head_dim
        extra = dict(
            rope_neox=True, embedding_scale=math.sqrt(hidden), attention_scale=scalar ** -0.5,
            mlp_act="gelu_tanh", qk_norm=True, post_norms=True,
            sliding_window=int(f.get(p + "attention.sliding_window", 0)),
            swa_pattern=GEMMA3_SWA_PATTERN, rope_theta_local=_local_rope_base(f, p))
    elif arch == "qwen2":
        # LLaMA's block plus q/k/v biases; llama.cpp's converter leaves Q/K rows in HF order
        # and llama.cpp rotates qwen2 in NEOX mode (LLAMA_ROPE_TYPE_NEOX).
        extra = dict(rope_neox=True, qkv_bias=True)
    elif arch == "qwen3":
        # Qwen2 without the biases, plus an RMSNorm of each q and k head before the rotary
        # (llama.cpp src/models/qwen3.cpp; NEOX rope as qwen2).
        extra = dict(rope_neox=True, qk_norm=True)
    elif arch == "phi3":
        # fused attn_qkv and ffn_up (gate rows, then up rows); NEOX rope (llama.cpp
        # src/models/phi3.cpp); every layer attends to the last ``sliding_window`` positions
        # (HF Phi3; llama.cpp ignores the key, which agrees within the window).
        extra = dict(rope_neox=True, swa_pattern=0,
                     sliding_window=int(f.get(p + "attention.sliding_window", 0)))
    elif arch == "smollm3":
        extra = dict(no_rope_step=SMOLLM3_NO_ROPE_STEP)
    elif arch == "llama":
        # Mistral 7B v0.1 (llama architecture) attends to the last 4096 positions on every
        # layer when the key is present; convert_hf_to_gguf.py writes none for llama.
        extra = dict(sliding_window=int(f.get(p + "attention.sliding_window", 0)),
                     swa_pattern=0)
    if arch in ("llama", "qwen2", "smollm3") and f.has_tensor("blk.0.attn_q.bias"):
        extra["qkv_bias"] = True
    return extra


def _local_rope_base(f: GGUFFile, p: str) -> float:
    """Gemma 3's local layers' rotary base: ``rope.freq_base_swa``, default 10000.

    Raises:
        ModelFileError: the value is not a positive finite number (no rotary table exists for
            it; 0 would also read as "no local base" in :class:`ModelConfig`).
    """
    value = f.get(p + "rope.freq_base_swa", GEMMA3_ROPE_THETA_LOCAL)
    try:
        base = float(value)
    except (TypeError, ValueError):
        base = math.nan
    if not (math.isfinite(base) and base > 0):
        raise ModelFileError(f"{f.path}: metadata {p}rope.freq_base_swa = {_short(value)} is "
                             "not supported: it must be a positive finite number")
    return base


def _vector(f: GGUFFile, name: str) -> tuple[float, ...]:
    return tuple(float(v) for v in f.dequantize(name).reshape(-1)) if f.has_tensor(name) else ()


def _rope_scaling(f: GGUFFile, p: str) -> dict:
    """The rotary scaling fields of :class:`ModelConfig` from ``f`` (prefix ``p``: ``arch.``).

    Raises:
        ModelFileError: a scaling type other than none, linear, yarn or longrope, or YaRN
            parameters other than llama.cpp's defaults.
    """
    kind = str(f.get(p + "rope.scaling.type", "none" if not f.get(p + "rope.scaling.factor")
                     and not f.get(p + "rope.scale_linear") else "linear"))
    factor = float(f.get(p + "rope.scaling.factor", f.get(p + "rope.scale_linear", 0.0)) or 1.0)
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise ModelFileError(f"{f.path}: {p}rope.scaling.type {kind!r} is not supported "
                             "(supported: none, linear, yarn, longrope)")
    if kind == "yarn":
        for key, default in (("yarn_beta_fast", YARN_BETA_FAST), ("yarn_beta_slow", YARN_BETA_SLOW),
                             ("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
            value = f.get(p + "rope.scaling." + key)
            if value is not None and float(value) != default:
                raise ModelFileError(f"{f.path}: {p}rope.scaling.{key} = {value} is not "
                                     f"supported (only {default})")
        if f.get(p + "rope.scaling.yarn_attn_factor") is not None:
            raise ModelFileError(f"{f.path}: {p}rope.scaling.yarn_attn_factor is not supported")
    ctx = int(f.get(p + "context_length", 2048))
    return dict(
        rope_scaling="none" if kind == "longrope" or factor == 1.0 else kind,
        rope_factor=factor,
        rope_attn_factor=float(f.get(p + "rope.scaling.attn_factor", 1.0)),
        rope_orig_context=int(f.get(p + "rope.scaling.original_context_length", ctx)),
        rope_freq_factors=_vector(f, "rope_freqs.weight"),
        rope_factors_long=_vector(f, "rope_factors_long.weight"),
        rope_factors_short=_vector(f, "rope_factors_short.weight"),
    )


# Metadata keys (after ``arch.``) that change the mathematics and that no supported architecture
# implements: a file carrying one (with a value other than the neutral one) is refused.
UNSUPPORTED_KEYS = {
    "attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0, "expert_count": 0,
    "expert_used_count": 0, "logit_scale": 1.0, "residual_scale": 1.0, "embedding_scale": 1.0,
    "attention.scale": 0.0, "attention.clamp_kqv": 0.0, "attention.max_alibi_bias": 0.0,
    "attention.value_length": None, "attention.sliding_window_pattern": None,
    "attention.causal": True, "use_parallel_residual": False, "rope.dimension_sections": None,
    "rope.freq_base_swa": None, "rope.scaling.alpha": 0.0, "full_attention_interval": None,
    "interleave_moe_layer_step": None, "leading_dense_block_count": 0,
}
# Tensors (in layer 0, or global) that change the mathematics and are not read.
UNSUPPORTED_TENSORS = (
    "blk.0.attn_output.bias", "blk.0.ffn_gate.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias",
    "blk.0.attn_qkv.bias", "blk.0.attn_norm.bias", "blk.0.ffn_norm.bias", "output_norm.bias",
    "output.bias", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight",
    "blk.0.ffn_up_exps.weight", "blk.0.attn_sinks.weight", "blk.0.attn_gate.weight",
)


# Keys of UNSUPPORTED_KEYS an architecture handles itself: Gemma 3 files may carry the
# soft-capping keys, which llama.cpp's gemma3 graph ignores too; its local layers' rotary base
# is read (:func:`_local_rope_base`).
HANDLED_KEYS = {"gemma3": ("final_logit_softcapping", "attn_logit_softcapping",
                           "rope.freq_base_swa")}


def refuse_unsupported(f: GGUFFile) -> None:
    """Raise :class:`ModelFileError` naming the first metadata key or tensor of ``f`` that
    would change the mathematics in a way this server does not implement (soft-capping,
    experts, ALiBi, per-layer patterns, biases other than q/k/v...), instead of answering
    wrongly. Keys holding their neutral value (e.g. ``expert_count = 0``) pass."""
    arch = f.architecture
    for key, neutral in UNSUPPORTED_KEYS.items():
        if key in HANDLED_KEYS.get(arch, ()):
            continue
        value = f.get(f"{arch}.{key}")
        if value is None or (neutral is not None and _same(value, neutral)):
            continue
        if key == "attention.value_length" and int(value) == int(
                f.get(f"{arch}.attention.key_length", 0) or 0):
            continue
        raise ModelFileError(f"{f.path}: metadata {arch}.{key} = {_short(value)} is not supported")
    for name in UNSUPPORTED_TENSORS:
        if f.has_tensor(name):
            raise ModelFileError(f"{f.path}: tensor {name} is not supported for {arch}")


def _same(value, neutral) -> bool:
    try:
        return float(value) == float(neutral)
    except (TypeError, ValueError):
        return False


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
