#!/usr/bin/env python
"""Write a random-weight GGUF with the real shapes of Qwen2.5-0.5B (or Qwen2.5-1.5B, or
Llama-3.2-1B), as a benchmark input for start-up, memory and speed: no real file can be fetched
here.

Shapes (Qwen2.5-0.5B's config.json): 24 layers, hidden 896, FFN 4864, 14 query heads and 2 KV
heads of 64, vocabulary 151,936, rope theta 1e6, tied embeddings; ``qwen2`` architecture (q/k/v
biases). The tokenizer is a byte-level BPE of 256 byte tokens, one merge, and normal padding
tokens up to the vocabulary size (enough to load and run, not to read text; a real Qwen2.5
tokenizer with its 151,387 merges takes longer to load).

Tensor types: ``--type q8_0`` (every matrix Q8_0), ``q4_0`` (matrices Q4_0, the embedding Q8_0,
as a Q4_0 file from llama.cpp's quantizer), ``mixed`` (what a Q4_K_M file holds where ``gguf``'s
quantizer can write it: Q4_0 for attention q/k/o and FFN gate/up, Q8_0 for v and FFN down, Q8_0
embedding), or ``f16``; ``gguf.quants.quantize`` has no K-quant writer: ``--quantize BIN``
writes the F16 file and then runs llama.cpp's ``llama-quantize`` (``BIN``: the binary or its
folder, built from the ``llama-cpp-python==0.3.36`` source distribution) to make a real
``Q4_K_M`` file, as users get them.

Llama-3.2-1B (``--size llama3.2-1b``): 16 layers, hidden 2048, FFN 8192, 32 query heads and 8 KV
heads of 64, vocabulary 128,256, rope theta 500,000 with llama3 rope scaling (``rope_freqs``,
factor 32, as the real file), tied embeddings, ``llama`` architecture (no biases).

    python scripts/make_qwen_shaped.py /tmp/qwen05-shaped.gguf --type mixed
    python scripts/make_qwen_shaped.py /tmp/llama1b.gguf --size llama3.2-1b --quantize BIN
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

SIZES = {   # name: layers, hidden, ffn, heads, kv heads, vocab, tied
    "0.5b": (24, 896, 4864, 14, 2, 151_936, True),
    "1.5b": (28, 1536, 8960, 12, 2, 151_936, True),
    "llama3.2-1b": (16, 2048, 8192, 32, 8, 128_256, True),
}


def llama3_rope_freqs(head_dim: int, theta: float = 500_000.0, factor: float = 32.0,
                      low: float = 1.0, high: float = 4.0, original: int = 8192) -> np.ndarray:
    """The ``rope_freqs.weight`` llama.cpp's converter writes for llama3 rope scaling: per
    rotary pair, the divisor of its frequency (1 for high frequencies, ``factor`` for low ones,
    interpolated between; Meta's ``apply_scaling``)."""
    freqs = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    out = np.where(wavelen < original / high, 1.0,
                   np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def write(path: str, size: str = "0.5b", kind: str = "mixed", seed: int = 0) -> None:
    import gguf

    Q = gguf.GGMLQuantizationType
    layers, d, ffn, heads, kv, vocab, tied = SIZES[size]
    hd = d // heads
    llama = size.startswith("llama")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama" if llama else "qwen2")
    w.add_name(f"{size}-shaped-random" if llama else f"qwen2.5-{size}-shaped-random")
    w.add_context_length(131072 if llama else 32768)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(500_000.0 if llama else 1_000_000.0)
    w.add_layer_norm_rms_eps(1e-5 if llama else 1e-6)
    if llama:
        w.add_rope_dimension_count(hd)
    w.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "mixed": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "f16": gguf.LlamaFileType.MOSTLY_F16}[kind])
    specials = (["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"] if llama
                else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    byte_map = _byte_tokens()
    tokens = byte_map + ["Ġt"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab - len(specials))] + specials
    types = [1] * (vocab - len(specials)) + [3] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if llama else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 1)
    w.add_add_bos_token(False)

    def qtype(name: str) -> gguf.GGMLQuantizationType:
        if kind == "f16":
            return Q.F16
        if kind == "q8_0" or name == "token_embd.weight":
            return Q.Q8_0
        if kind == "q4_0":
            return Q.Q4_0
        return Q.Q8_0 if name.endswith(("attn_v.weight", "ffn_down.weight")) else Q.Q4_0

    def mat(name: str, out: int, inp: int) -> None:
        a = (rng.standard_normal((out, inp), dtype=np.float32) * inp ** -0.5)
        t = qtype(name)
        if t == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)

    def vec(name: str, n: int, mean: float, scale: float) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n) * scale).astype(np.float32))

    mat("token_embd.weight", vocab, d)
    if llama:
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(hd))
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d, 1.0, 0.1)
        mat(p + "attn_q.weight", heads * hd, d)
        mat(p + "attn_k.weight", kv * hd, d)
        mat(p + "attn_v.weight", kv * hd, d)
        if not llama:
            vec(p + "attn_q.bias", heads * hd, 0.0, 0.5)
            vec(p + "attn_k.bias", kv * hd, 0.0, 0.5)
            vec(p + "attn_v.bias", kv * hd, 0.0, 0.5)
        mat(p + "attn_output.weight", d, heads * hd)
        vec(p + "ffn_norm.weight", d, 1.0, 0.1)
        mat(p + "ffn_gate.weight", ffn, d)
        mat(p + "ffn_up.weight", ffn, d)
        mat(p + "ffn_down.weight", d, ffn)
    vec("output_norm.weight", d, 1.0, 0.1)
    if not tied:
        mat("output.weight", vocab, d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the tokenizer's own table)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tiny_mindie.model.tokenizer_load import _gpt2_byte_decoder

    decoder = _gpt2_byte_decoder()
    return sorted(decoder, key=decoder.__getitem__)


def quantize(f16_path: str, out_path: str, where: str, kind: str = "Q4_K_M") -> None:
    """Run llama.cpp's ``llama-quantize`` (``where``: the binary or its folder) on ``f16_path``;
    raises ``SystemExit`` with its output when it fails."""
    import subprocess

    binary = os.path.join(where, "llama-quantize") if os.path.isdir(where) else where
    done = subprocess.run([binary, f16_path, out_path, kind], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--type", choices=("mixed", "q8_0", "q4_0", "f16"), default="mixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantize", metavar="BIN",
                    help="llama.cpp's llama-quantize (or its folder): write F16, then Q4_K_M")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.quantize:
        f16 = args.path + ".f16.tmp"
        try:
            write(f16, args.size, "f16", args.seed)
            quantize(f16, args.path, args.quantize)
        finally:
            if os.path.exists(f16):
                os.remove(f16)
    else:
        write(args.path, args.size, args.type, args.seed)
    print(f"wrote {args.path} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
