"""The onnxruntime backends' KV cache: one buffer per layer for keys and one for values, each
``[P, Nkv, cache_len, H]`` of ``kv_dtype`` (float32; float16 for the float16 standard graph)
with ``P = num_slots`` physical rows, and the map from slots to physical rows that keeps a
decode batch's rows consecutive (see :mod:`.ort_backend`).
"""

from __future__ import annotations

import numpy as np

from .memory import zeroed_buffers


class KVLayout:
    """The KV buffers and slot layout of :class:`.ort_backend.OrtBackend` (a mixin: it uses the
    backend's ``config``, ``num_slots``, ``max_seq_len``, ``_lock`` and ``_check_copy``).

    Attributes set by :meth:`_make_kv_cache`: ``_k``/``_v`` (the buffers per layer), ``_phys``
    (slot -> physical row), ``_slot_at`` (physical row -> slot), ``_used`` (positions in use
    per slot), ``_row_bytes`` (bytes of one physical row of one buffer), ``swaps`` is counted
    by :meth:`_swap_rows`.
    """

    #: the KV buffers' element type (the graph's ``past_key.{i}`` inputs')
    kv_dtype = np.float32

    @property
    def cache_len(self) -> int:
        """Positions of each KV buffer row: ``max_seq_len``."""
        return self.max_seq_len

    def _make_kv_cache(self) -> None:
        """The KV buffers (zeroed, pages allocated as they are written) and the slot layout."""
        c, num_slots, cache_len = self.config, self.num_slots, self.cache_len
        shape = (num_slots, c.num_kv_heads, cache_len, c.head_dim)
        self._kv_map, kv = zeroed_buffers(2 * c.num_layers, shape, self.kv_dtype)
        self._k, self._v = kv[:c.num_layers], kv[c.num_layers:]
        self._row_bytes = kv[0][0].nbytes
        self._phys = list(range(num_slots))             # slot -> physical row
        self._slot_at = list(range(num_slots))          # physical row -> slot
        self._used = [0] * num_slots                    # positions in use, per slot

    def copy_kv(self, src_slot: int, dst_slot: int, n: int) -> None:
        """See :meth:`.backend.Backend.copy_kv`: positions ``[0, n)`` of every layer's key and value
        buffer, from the source slot's physical row to the destination's."""
        self._check_copy(src_slot, dst_slot, n)
        with self._lock:
            a, b = self._phys[src_slot], self._phys[dst_slot]
            for buf in self._k + self._v:
                buf[b, :, :n] = buf[a, :, :n]
            self._used[dst_slot] = max(self._used[dst_slot], n)

    def _bind_cache(self, binding, r0: int, B: int) -> None:
        """Bind the KV buffers of physical rows ``[r0, r0 + B)`` to ``binding`` in place: each
        layer's ``past_key.{i}``/``present_key.{i}`` (and values) to the same memory,
        ``kv_dtype [B, Nkv, cache_len, H]``."""
        c = self.config
        shape = [B, c.num_kv_heads, self.cache_len, c.head_dim]
        off = r0 * self._row_bytes
        for i in range(c.num_layers):
            for kind, buf in (("key", self._k[i]), ("value", self._v[i])):
                ptr = buf.ctypes.data + off
                binding.bind_input(f"past_{kind}.{i}", "cpu", 0, self.kv_dtype, shape, ptr)
                binding.bind_output(f"present_{kind}.{i}", "cpu", 0, self.kv_dtype, shape, ptr)

    def kv_cache_bytes(self) -> int:
        return 2 * sum(k.nbytes for k in self._k)

    def _arrange(self, slots: list[int]) -> int:
        """Make the physical rows of ``slots`` consecutive (swapping rows); return the first."""
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
                    cost += self._used[s]
            for s in slots:
                if not w <= self._phys[s] < w + B:
                    cost += self._used[s]
            if best_cost is None or cost < best_cost:
                best, best_cost = w, cost
        outside = [s for s in slots if not best <= self._phys[s] < best + B]
        free = [r for r in range(best, best + B) if self._slot_at[r] not in members]
        for s, r in zip(outside, free, strict=True):
            self._swap_rows(self._phys[s], r)
        return best

    def _swap_rows(self, a: int, b: int) -> None:
        sa, sb = self._slot_at[a], self._slot_at[b]
        na, nb = self._used[sa], self._used[sb]
        for buf in self._k + self._v:
            tmp = buf[a, :, :na].copy()
            buf[a, :, :nb] = buf[b, :, :nb]
            buf[b, :, :na] = tmp
        self._slot_at[a], self._slot_at[b] = sb, sa
        self._phys[sa], self._phys[sb] = b, a
        self.swaps += 1
