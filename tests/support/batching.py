"""Test helper: does a backend give a row the same logits alone and in any batch?

Used by the SmolLM2 and Gemma 3 backend tests. Bit-for-bit equality, not closeness: a seeded or
greedy answer must not change with the load (see ``graph_nodes._pad_rows``).
"""

from __future__ import annotations

import numpy as np

from tiny_mindie.model.backend import SeqChunk


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max())


def assert_rows_batch_invariant(be, vocab_size: int, batch_sizes=(1, 2, 3, 4, 8), seed: int = 0):
    """Decode one token for rows of several prompts alone and in batches of ``batch_sizes``
    (each batch tried in two orders, on scattered slots, so rows land in every position and the
    backend regroups its KV rows), and prefill a prompt beside decode rows; every row's logits
    must equal its logits alone, bit for bit. Needs ``max(batch_sizes) + 1`` slots."""
    rng = np.random.default_rng(seed)
    n = max(batch_sizes)
    prompts = [rng.integers(100, min(vocab_size, 20000), 3 + 2 * i) for i in range(n)]
    tokens = [np.array([int(t)]) for t in rng.integers(100, min(vocab_size, 20000), n)]
    free = be.num_slots - 1                        # the last slot computes the rows alone
    alone_prefill, alone_step = [], []
    for p, t in zip(prompts, tokens, strict=True):
        alone_prefill.append(be.forward([SeqChunk(free, 0, p)])[0])
        alone_step.append(be.forward([SeqChunk(free, len(p), t)])[0])
    for b in batch_sizes:
        for order in (list(range(b)), list(range(b))[::-1]):
            slots = [(3 * j + b) % free for j in range(b)]          # scattered, not in row order
            for j, i in enumerate(order):
                be.forward([SeqChunk(slots[j], 0, prompts[i])])
            got = be.forward([SeqChunk(slots[j], len(prompts[i]), tokens[i])
                              for j, i in enumerate(order)])
            for j, i in enumerate(order):
                assert np.array_equal(got[j], alone_step[i]), (
                    f"batch {b}, row {j} (prompt {i}): "
                    f"max |diff| {_diff(got[j], alone_step[i]):.3g}")
    # a prompt prefilled in the same forward call as decode rows
    b = min(3, n - 1)
    for j in range(b):
        be.forward([SeqChunk(j, 0, prompts[j])])
    got = be.forward([SeqChunk(j, len(prompts[j]), tokens[j]) for j in range(b)]
                     + [SeqChunk(b, 0, prompts[b])])
    for j in range(b):
        assert np.array_equal(got[j], alone_step[j]), f"decode row {j} beside a prefill"
    assert np.array_equal(got[b], alone_prefill[b]), "prefill beside decode rows"
