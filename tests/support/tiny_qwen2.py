"""The tiny random Qwen2 GGUF (written with ``gguf``'s own writer) and the greedy loop that
tests/model/test_qwen2.py, tests/model/test_architectures.py and tests/model/test_startup.py share:
2 layers, d=64, 4 query heads and 2 KV heads of 16, MLP 128, 300 tokens of a byte-level BPE
vocabulary, random weights as Q8_0 and Q4_0, F32 biases and norms, an untied LM head."""

from __future__ import annotations

import gguf as gguf_pkg
import numpy as np

from tiny_mindie.model.backend import SeqChunk

N_LAYERS, D, H, KV, HD, FFN, VOCAB = 2, 64, 4, 2, 16, 128, 300
THETA, EPS, CTX = 1_000_000.0, 1e-6, 128

# tensors stored as Q4_0 (the rest of the matrices are Q8_0)
Q4_0_TENSORS = {"blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight",
                "blk.1.ffn_gate.weight"}


def byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def write_tiny_qwen2(path: str, seed: int = 0) -> None:
    """Write the tiny random Qwen2 GGUF to ``path``."""
    Q = gguf_pkg.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    w = gguf_pkg.GGUFWriter(path, "qwen2")
    w.add_name("tiny-qwen2-random")
    w.add_context_length(CTX)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FFN)
    w.add_block_count(N_LAYERS)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_file_type(gguf_pkg.LlamaFileType.MOSTLY_Q8_0)

    # tokenizer: 256 byte tokens, a few merges, specials up to VOCAB
    tokens = byte_tokens()
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
    tokens += [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    while len(tokens) < VOCAB - len(specials):
        tokens.append(f"[PAD{len(tokens)}]")
    tokens += specials
    types = [1] * (VOCAB - len(specials) - 0) + [3] * len(specials)
    for i, t in enumerate(tokens):
        if t.startswith("[PAD"):
            types[i] = 4                                    # user-defined
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(VOCAB - 3)
    w.add_eos_token_id(VOCAB - 3)
    w.add_add_bos_token(False)

    def mat(name: str, out: int, inp: int, scale: float) -> None:
        a = (rng.standard_normal((out, inp)) * scale).astype(np.float32)  # GGUF [out, in] rows
        qt = Q.Q4_0 if name in Q4_0_TENSORS else Q.Q8_0
        w.add_tensor(name, gguf_pkg.quants.quantize(a, qt), raw_dtype=qt)

    def vec(name: str, n: int, mean: float, scale: float) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(n) * scale).astype(np.float32))

    mat("token_embd.weight", VOCAB, D, 1.0)
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", D, 1.0, 0.1)
        mat(p + "attn_q.weight", H * HD, D, D ** -0.5)
        mat(p + "attn_k.weight", KV * HD, D, D ** -0.5)
        mat(p + "attn_v.weight", KV * HD, D, D ** -0.5)
        vec(p + "attn_q.bias", H * HD, 0.0, 0.5)
        vec(p + "attn_k.bias", KV * HD, 0.0, 0.5)
        vec(p + "attn_v.bias", KV * HD, 0.0, 0.5)
        mat(p + "attn_output.weight", D, H * HD, (H * HD) ** -0.5)
        vec(p + "ffn_norm.weight", D, 1.0, 0.1)
        mat(p + "ffn_gate.weight", FFN, D, D ** -0.5)
        mat(p + "ffn_up.weight", FFN, D, D ** -0.5)
        mat(p + "ffn_down.weight", D, FFN, FFN ** -0.5)
    vec("output_norm.weight", D, 1.0, 0.1)
    mat("output.weight", VOCAB, D, 0.5)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy(be, prompts: list[np.ndarray], slots: list[int],
            steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill each prompt (one batch), then decode ``steps`` greedy tokens for all rows."""
    logits = be.forward([SeqChunk(s, 0, p) for s, p in zip(slots, prompts, strict=True)])
    out: list[list[int]] = [[] for _ in prompts]
    all_logits = [logits.copy()]
    pos = [len(p) for p in prompts]
    for _ in range(steps):
        nxt = logits.argmax(axis=-1)
        for r, t in enumerate(nxt):
            out[r].append(int(t))
        logits = be.forward([SeqChunk(s, pos[r], np.array([nxt[r]], dtype=np.int64))
                             for r, s in enumerate(slots)])
        all_logits.append(logits.copy())
        pos = [q + 1 for q in pos]
    return out, all_logits
