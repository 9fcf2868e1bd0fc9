"""Large scratch arrays of the sampler, kept per thread and reused from call to call.

On a VM a fresh 8 MB array costs more in page faults than the arithmetic done in it, so the
sampler's ``[rows, V]`` work arrays live here, one set per thread (the caller's and the batch
helper's, :mod:`.batch`), and grow only when a call needs more rows or another vocabulary size.
"""

from __future__ import annotations

import threading

import numpy as np


class Scratch:
    """Arrays reused from call to call: ``x``, ``e`` float32, ``masks`` bool, each ``[rows, V]``;
    ``tmp`` float32, ``mask`` bool (the first row of ``masks``), ``u32`` uint32, each ``[V]``."""

    def __init__(self, rows: int, vocab: int):
        self.x = np.empty((rows, vocab), np.float32)
        self.e = np.empty((rows, vocab), np.float32)
        self.tmp = np.empty(vocab, np.float32)
        self.masks = np.empty((rows, vocab), np.bool_)
        self.mask = self.masks[0]
        self.u32 = np.empty(vocab, np.uint32)


_local = threading.local()


def scratch(rows: int, vocab: int) -> Scratch:
    """This thread's scratch arrays for at least ``rows`` rows of ``vocab`` logits."""
    s = getattr(_local, "scratch", None)
    if s is None or s.x.shape[1] != vocab or s.x.shape[0] < rows:
        keep = s.x.shape[0] if s is not None and s.x.shape[1] == vocab else 1
        s = _local.scratch = Scratch(max(rows, keep), vocab)
    return s
