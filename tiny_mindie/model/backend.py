"""The interface every model backend implements (numpy reference, ONNX Runtime).

A backend owns the weights and the KV cache. The KV cache is divided into ``num_slots`` slots,
one per running sequence, each holding up to ``max_seq_len`` positions. The engine decides which
sequence uses which slot; the backend only computes.

One :meth:`Backend.forward` call runs one step of continuous batching: every row is a chunk of
one sequence -- a whole prompt or a piece of it (prefill), or a single token (decode).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import BACKENDS, DEFAULT_BACKEND  # noqa: F401  (named in the package, re-exported)
from .arch import ModelConfig


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)
    -- what thread counts are sized by."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SeqChunk:
    """One row of a forward batch.

    Attributes:
        slot: KV-cache slot of the sequence, ``0 <= slot < num_slots``.
        start: position of ``token_ids[0]``. Positions ``[0, start)`` of this slot are already in
            the KV cache; the chunk writes positions ``[start, start + n)`` and overwrites
            whatever was there (so ``start=0`` starts a new sequence in a reused slot).
        token_ids: int64 ``[n]``, ``n >= 1``; ``start + n <= max_seq_len``.
    """

    slot: int
    start: int
    token_ids: np.ndarray


class Backend(ABC):
    """A decoder with a slot-based KV cache.

    Attributes:
        name: short backend name shown to users (``"numpy"``, ``"onnxruntime"``).
        device: where it runs, e.g. ``"CPU"`` or ``"CANNExecutionProvider:0"``.
        config: the model's architecture parameters.
        num_slots: number of sequences the KV cache holds at once.
        max_seq_len: positions per slot (prompt + generated tokens).
        batch_invariant: a row's logits are bit for bit the same alone and in any batch.
        prefix_split_invariant: a prompt's KV cache and last logits are bit for bit the same
            however it is split into chunks of two tokens or more (a one-token chunk runs
            through the decode kernels, which round differently). Where this holds, the prefix
            cache may reuse a prefix of any length; else only whole pieces between the fixed
            cuts of the engine's prefill plan.
        fast_verify: :meth:`verify` computes up to ``max_verify_rows`` rows in one run
            (speculative decoding can pay); else it decodes them one by one.
    """

    name: str
    device: str
    config: ModelConfig
    num_slots: int
    max_seq_len: int
    batch_invariant: bool = False
    prefix_split_invariant: bool = False
    fast_verify: bool = False
    max_verify_rows: int = 0

    @abstractmethod
    def forward(self, chunks: Sequence[SeqChunk]) -> np.ndarray:
        """Run prefill and/or decode for a batch of chunks and update their KV cache slots.

        Args:
            chunks: rows of the batch; each slot appears at most once.

        Returns:
            float32 ``[len(chunks), vocab_size]``: logits of the last token of each chunk.

        Raises:
            ValueError: a chunk is empty, its slot is out of range, or it would pass
                ``max_seq_len``.
        """

    def verify(self, slot: int, start: int, token_ids: np.ndarray) -> np.ndarray:
        """Run the tokens of one sequence as a chunk at ``start`` (writing the KV of positions
        ``[start, start + n)``) and return the logits after *each* of them: bit for bit what
        ``n`` one-token decode steps would return (speculative decoding verifies proposed
        tokens with it). This default runs the decode steps; a backend that can compute them
        in one run overrides it (:attr:`fast_verify`).

        Args:
            token_ids: int64 ``[n]``, ``n >= 1``.

        Returns:
            float32 ``[n, vocab_size]``.

        Raises:
            ValueError: as :meth:`forward`.
        """
        return np.stack([self.forward([SeqChunk(slot, start + k, token_ids[k:k + 1])])[0]
                         for k in range(len(token_ids))])

    def copy_kv(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the KV cache of positions ``[0, n)`` of ``src_slot`` into ``dst_slot`` (bit for
        bit; ``dst_slot``'s positions from ``n`` on are left as they are, past its sequence).
        Not during :meth:`forward`.

        Raises:
            ValueError: a slot out of range, the same slot twice, or ``n`` outside
                ``[0, max_seq_len]``.
            NotImplementedError: the backend cannot copy (the engine then prefills instead).
        """
        raise NotImplementedError

    def _check_copy(self, src_slot: int, dst_slot: int, n: int) -> None:
        for s in (src_slot, dst_slot):
            if not 0 <= s < self.num_slots:
                raise ValueError(f"slot {s} out of range 0..{self.num_slots - 1}")
        if src_slot == dst_slot:
            raise ValueError(f"cannot copy slot {src_slot} onto itself")
        if not 0 <= n <= self.max_seq_len:
            raise ValueError(f"{n} positions outside 0..{self.max_seq_len}")

    def kv_cache_bytes(self) -> int:
        """Bytes held by the KV cache (all slots)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release sessions and buffers; the backend is unusable afterwards."""


def check_chunks(chunks: Sequence[SeqChunk], num_slots: int, max_seq_len: int,
                 vocab_size: int) -> list[np.ndarray]:
    """Validate a forward batch (see :meth:`Backend.forward`).

    Returns:
        each chunk's token ids as int64 ``[n]``.

    Raises:
        ValueError: empty or non-1-D chunk, token id outside ``[0, vocab_size)``, slot out of
            range or repeated, positions past ``max_seq_len``.
    """
    seen = set()
    ids = [np.asarray(c.token_ids, dtype=np.int64) for c in chunks]
    for c, a in zip(chunks, ids, strict=True):
        if a.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {a.shape}")
        n = len(a)
        if n < 1:
            raise ValueError("empty chunk")
        if not 0 <= c.slot < num_slots:
            raise ValueError(f"slot {c.slot} out of range 0..{num_slots - 1}")
        if c.slot in seen:
            raise ValueError(f"slot {c.slot} appears twice in one batch")
        seen.add(c.slot)
        if c.start < 0 or c.start + n > max_seq_len:
            raise ValueError(f"chunk positions {c.start}..{c.start + n} pass max_seq_len "
                             f"{max_seq_len}")
        if a.min() < 0 or a.max() >= vocab_size:
            raise ValueError(f"token id out of range 0..{vocab_size - 1}")
    return ids
