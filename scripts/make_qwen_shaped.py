#!/usr/bin/env python
"""Write a random-weight GGUF with the real shapes of Qwen2.5-0.5B (or another Qwen2 size), as a
benchmark input for start-up, memory and speed: no real 0.5B file can be fetched here.

Shapes (Qwen2.5-0.5B's config.json): 24 layers, hidden 896, FFN 4864, 14 query heads and 2 KV
heads of 64, vocabulary 151,936, rope theta 1e6, tied embeddings; ``qwen2`` architecture (q/k/v
biases). The tokenizer is a byte-level BPE of 256 byte tokens, one merge, and normal padding
tokens up to the vocabulary size (enough to load and run, not to read text; a real Qwen2.5
tokenizer with its 151,387 merges takes longer to load).

Tensor types: ``--type q8_0`` (every matrix Q8_0), ``q4_0`` (matrices Q4_0, the embedding Q8_0,
as a Q4_0 file from llama.cpp's quantizer), ``mixed`` (what a Q4_K_M file holds where ``gguf``'s
quantizer can write it: Q4_0 for attention q/k/o and FFN gate/up, Q8_0 for v and FFN down, Q8_0
embedding), or ``f16``; ``gguf.quants.quantize`` has no K-quant writer (Q4_K/Q6_K would need
llama.cpp's ``llama-quantize`` on an F16 file written by this script).

    python scripts/make_qwen_shaped.py /tmp/qwen05-shaped.gguf --type mixed
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
}


def write(path: str, size: str = "0.5b", kind: str = "mixed", seed: int = 0) -> None:
    import gguf

    Q = gguf.GGMLQuantizationType
    layers, d, ffn, heads, kv, vocab, tied = SIZES[size]
    hd = d // heads
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_name(f"qwen2.5-{size}-shaped-random")
    w.add_context_length(32768)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "mixed": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "f16": gguf.LlamaFileType.MOSTLY_F16}[kind])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_map = _byte_tokens()
    tokens = byte_map + ["Ġt"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab - len(specials))] + specials
    types = [1] * (vocab - len(specials)) + [3] * len(specials)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
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
    for i in range(layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d, 1.0, 0.1)
        mat(p + "attn_q.weight", heads * hd, d)
        mat(p + "attn_k.weight", kv * hd, d)
        mat(p + "attn_v.weight", kv * hd, d)
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
    from tiny_mindie.model.tokenizer import _gpt2_byte_decoder

    decoder = _gpt2_byte_decoder()
    return sorted(decoder, key=decoder.__getitem__)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--type", choices=("mixed", "q8_0", "q4_0", "f16"), default="mixed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    write(args.path, args.size, args.type, args.seed)
    print(f"wrote {args.path} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
