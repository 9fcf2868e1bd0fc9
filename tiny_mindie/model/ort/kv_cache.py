"""The onnxruntime backend's KV cache: one buffer per layer for keys and one for values, each
``[P, Nkv, cache_len, H]`` of ``dtype`` (float32; float16 for the float16 standard graph) with
``P = num_slots`` physical rows, and the map from slots to physical rows that keeps a decode
batch's rows consecutive (see :mod:`.ort_backend`).
"""

from __future__ import annotations

import mmap

import numpy as np

from ..arch import ModelConfig
from .memory import zeroed_buffers


class KVCache:
    """The KV buffers of :class:`.ort_backend.OrtBackend` and their slot layout.

    Args:
        config: the model's parameters (layers, KV heads, head size).
        num_slots: sequences held at once (the physical rows ``P``).
        cache_len: positions of each buffer row (``max_seq_len``, plus a scratch position for
            the standard graph: :class:`.shapes.StaticShapes`).
        dtype: the buffers' numpy type (the graph's ``past_key.{i}`` inputs').

    Attributes:
        k, v: the key and value buffers per layer, ``dtype [P, Nkv, cache_len, H]`` (zeroed;
            pages allocated as they are written).
        used: positions in use per slot (what a row swap copies); the backend keeps it.
        swaps: row swaps done (:meth:`arrange`).
    """

    def __init__(self, config: ModelConfig, num_slots: int, cache_len: int, dtype: type):
        self.num_slots = num_slots
        self.cache_len = cache_len
        self.dtype = dtype
        self._layers, self._kv_heads, self._head_dim = (config.num_layers, config.num_kv_heads,
                                                        config.head_dim)
        shape = (num_slots, config.num_kv_heads, cache_len, config.head_dim)
        self._map, kv = zeroed_buffers(2 * config.num_layers, shape, dtype)
        self.k, self.v = kv[:config.num_layers], kv[config.num_layers:]
        self._row_bytes = kv[0][0].nbytes               # one physical row of one buffer
        self._empty()

    def _empty(self) -> None:
        self._phys = list(range(self.num_slots))        # slot -> physical row
        self._slot_at = list(range(self.num_slots))     # physical row -> slot
        self.used = [0] * self.num_slots
        self.swaps = 0

    def forget(self) -> None:
        """Every slot empty and on its own physical row again (``swaps`` back to 0), the buffers'
        pages given back where the OS can (zeros again)."""
        self._empty()
        if hasattr(mmap, "MADV_REMOVE"):                # shared anonymous: pages freed
            self._map.madvise(mmap.MADV_REMOVE)

    @property
    def nbytes(self) -> int:
        """Bytes of every key and value buffer."""
        return 2 * sum(k.nbytes for k in self.k)

    def row(self, slot: int) -> int:
        """The physical row holding ``slot``."""
        return self._phys[slot]

    def positions(self, slot: int, a: int, b: int) -> list[np.ndarray]:
        """Copies of positions ``[a, b)`` of ``slot``: every layer's keys, then its values, each
        ``dtype [Nkv, b - a, H]``."""
        r = self._phys[slot]
        return [buf[r, :, a:b].copy() for buf in self.k + self.v]

    def copy(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Positions ``[0, n)`` of every layer's key and value buffer, from the source slot's
        physical row to the destination's (slots and ``n`` already checked)."""
        a, b = self._phys[src_slot], self._phys[dst_slot]
        for buf in self.k + self.v:
            buf[b, :, :n] = buf[a, :, :n]
        self.used[dst_slot] = max(self.used[dst_slot], n)

    def bind(self, binding, r0: int, B: int) -> None:
        """Bind the buffers of physical rows ``[r0, r0 + B)`` to ``binding`` in place: each
        layer's ``past_key.{i}``/``present_key.{i}`` (and values) to the same memory,
        ``dtype [B, Nkv, cache_len, H]``."""
        shape = [B, self._kv_heads, self.cache_len, self._head_dim]
        off = r0 * self._row_bytes
        for i in range(self._layers):
            for kind, buf in (("key", self.k[i]), ("value", self.v[i])):
                ptr = buf.ctypes.data + off
                binding.bind_input(f"past_{kind}.{i}", "cpu", 0, self.dtype, shape, ptr)
                binding.bind_output(f"present_{kind}.{i}", "cpu", 0, self.dtype, shape, ptr)

    def arrange(self, slots: list[int]) -> int:
        """Make the physical rows of ``slots`` consecutive (swapping rows, copying the fewest
        positions in use); return the first."""
        B, P = len(slots), self.num_slots
        rows = sorted(self._phys[s] for s in slots)
        if rows[-1] - rows[0] == B - 1:
            return rows[0]
        members = set(slots)
        best, best_cost = 0, None
        for w in range(P - B + 1):      # the window needing the least copying
            cost = 0
            for r in range(w, w + B):
                s = self._slot_at[r]
                if s not in members:
                    cost += self.used[s]
            for s in slots:
                if not w <= self._phys[s] < w + B:
                    cost += self.used[s]
            if best_cost is None or cost < best_cost:
                best, best_cost = w, cost
        outside = [s for s in slots if not best <= self._phys[s] < best + B]
        free = [r for r in range(best, best + B) if self._slot_at[r] not in members]
        for s, r in zip(outside, free, strict=True):
            self._swap_rows(self._phys[s], r)
        return best

    def _swap_rows(self, a: int, b: int) -> None:
        sa, sb = self._slot_at[a], self._slot_at[b]
        na, nb = self.used[sa], self.used[sb]
        for buf in self.k + self.v:
            tmp = buf[a, :, :na].copy()
            buf[a, :, :nb] = buf[b, :, :nb]
            buf[b, :, :na] = tmp
        self._slot_at[a], self._slot_at[b] = sb, sa
        self._phys[sa], self._phys[sb] = b, a
        self.swaps += 1

    def close(self) -> None:
        """Drop the buffers (unmapped once the last view of them is gone)."""
        self.k = self.v = []
        self._map = None
