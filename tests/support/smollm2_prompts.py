"""SmolLM2-135M-Instruct's prompts (as vocabulary pieces) and logits tolerances shared by the
tests that compare an onnxruntime graph with the numpy reference (tests/model/test_ort_backend.py,
tests/model/test_kernels_graph.py)."""

from __future__ import annotations

import numpy as np

from tiny_mindie.model.backend import SeqChunk
from tiny_mindie.model.gguf import GGUFFile

MAX_ABS_INT8 = 1.5       # default graph vs reference, max |logit diff| (measured <= 1.0)
REL_INT8 = 0.25          # ... ||diff|| / ||ref - mean(ref)|| (measured 0.03 .. 0.15)


def ids_of(gguf: GGUFFile, pieces: list[str]) -> np.ndarray:
    vocab = gguf.get("tokenizer.ggml.tokens")
    return np.array([vocab.index(p) for p in pieces], dtype=np.int64)


NL = "Ċ"
CHAT = (["<|im_start|>", "user", NL, "What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?",
         "<|im_end|>", NL, "<|im_start|>", "ass", "istant", NL])
STORY = ["Once", "Ġupon", "Ġa", "Ġtime", ",", "Ġthere", "Ġwas", "Ġa", "Ġlittle", "Ġgirl",
         "Ġwho", "Ġlived", "Ġin", "Ġa", "Ġvillage", "Ġnear", "Ġthe", "Ġforest", "."]
FRANCE = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
SHORT = ["Hello"]


def prefill_and_decode(be, slot: int, prompt: np.ndarray, follow: list[int]) -> np.ndarray:
    """Logits after the prompt, then after each teacher-forced token of ``follow``."""
    out = [be.forward([SeqChunk(slot, 0, prompt)])[0]]
    for j, tok in enumerate(follow):
        out.append(be.forward([SeqChunk(slot, len(prompt) + j, np.array([tok]))])[0])
    return np.array(out)


FOLLOW = [504, 3575, 282, 4649]       # "The capital of France" -- teacher-forced decode steps
