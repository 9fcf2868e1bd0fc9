"""Float64 building blocks of the tests' independent Hugging Face-layout recomputations
(test_reference, test_qwen2, test_gemma3): written once, used by each."""

from __future__ import annotations

import numpy as np


def weight64(f, name: str) -> np.ndarray:
    """GGUF tensor ``name`` (``[out, in]`` for matrices: HF's nn.Linear weight) as float64."""
    return f.dequantize(name).astype(np.float64)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * w``."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rotate_half(x: np.ndarray) -> np.ndarray:
    """HF's rotary helper: ``[x1, x2] -> [-x2, x1]`` over the last axis (NEOX pairing)."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
