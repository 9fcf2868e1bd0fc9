"""tiny_mindie's C kernels on real tensors, SmolLM2's and Gemma 3's: their matrices through every
ISA path this CPU runs against the numpy oracle, and their embeddings and matrices through the
lookup (``tiny_mindie::GatherGGUF``) bit for bit the values of the ``gguf`` package's
dequantization. Random blocks, the paths' bits and the operators: tests/unit/test_kernels.py and
tests/unit/test_kernels_gather.py.

Skips where the kernel library was not built (fails in CI, where it is).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf_blocks import (
    X86_PATHS,
    assert_close_to_oracle,
    assert_same_bits,
    kernels_on_best_path,
    use_path,
)

from tiny_mindie import kernels

lib = pytest.fixture(scope="module", name="lib")(kernels_on_best_path)


def _real_matrices(path: str, rows: int = 96) -> dict[str, tuple[np.ndarray, int, int]]:
    """The first matrix of each supported type in the GGUF at ``path`` (its first ``rows``
    rows): type -> (raw bytes, N, K)."""
    from tiny_mindie.model.gguf import GGUFFile

    f = GGUFFile(path)
    found: dict[str, tuple[np.ndarray, int, int]] = {}
    for name in f.tensor_names():
        raw = f.raw(name)
        if raw.qtype in kernels.TYPES and raw.qtype not in found and len(raw.shape) == 2:
            n = min(rows, raw.shape[0])
            found[raw.qtype] = (np.array(raw.data[:n]), n, raw.shape[1])
    return found


@pytest.mark.parametrize("path", X86_PATHS)
def test_real_tensors_match_the_oracle(lib, path, model_path, gemma_path):
    use_path(lib, path)
    rng = np.random.default_rng(3)
    seen = set()
    for gguf_path in (model_path, gemma_path):
        for qtype, (w, n, k) in _real_matrices(gguf_path).items():
            x = rng.standard_normal((4, k)).astype(np.float32)
            assert_close_to_oracle(qtype, x, w, n, k, lib.matmul(qtype, x, w, n, k))
            seen.add(qtype)
    assert {"Q4_1", "Q4_K", "Q6_K"} <= seen


def _real_tables(path: str) -> dict[str, tuple[np.ndarray, int, int]]:
    """The embedding and the first matrix of each other supported type in the GGUF at ``path``:
    type -> (raw bytes, N, K), mapped (not read)."""
    from tiny_mindie.model.gguf import GGUFFile

    f = GGUFFile(path)
    found: dict[str, tuple[np.ndarray, int, int]] = {}
    for name in ["token_embd.weight", *f.tensor_names()]:
        raw = f.raw(name)
        if raw.qtype in kernels.TYPES and raw.qtype not in found and len(raw.shape) == 2:
            found[raw.qtype] = (raw.data, *raw.shape)
    return found


def test_real_tensors_are_the_gguf_values_bit_for_bit(lib, model_path, gemma_path):
    """SmolLM2's and Gemma 3's embeddings (Q8_0) and matrices (Q4_1; Q5_0, Q4_K, Q6_K): rows
    at the start, the end and in between, compared with the rows ``gguf`` dequantizes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    seen = set()
    for path in (model_path, gemma_path):
        for qtype, (w, n, k) in _real_tables(path).items():
            ids = np.unique(np.r_[0, 1, n // 3, n // 2 + 1, n - 2, n - 1])
            want = dequantize(np.asarray(w[ids]), GGMLQuantizationType[qtype]).reshape(-1, k)
            assert_same_bits(lib.gather(qtype, ids, w, n, k), want)
            seen.add(qtype)
    assert {"Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"} <= seen
