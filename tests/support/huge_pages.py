"""Anonymous mappings the huge-page tests share (tests/unit/test_memory.py,
tests/model/test_ort_backend.py), and the skip mark for kernels without ``MADV_COLLAPSE``
(Linux < 6.1)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from tiny_mindie.model.ort import memory


def private_anonymous(size: int) -> tuple[mmap.mmap, np.ndarray, int]:
    """A private anonymous mapping (as malloc makes them) of ``size`` bytes between two
    inaccessible guard pages, so the kernel cannot merge it with a neighbour and smaps reports
    it alone; returns the mapping, its ``size`` bytes and their address."""
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, size + 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base, page, 0) == 0 and libc.mprotect(base + page + size, page, 0) == 0
    return buf, np.frombuffer(buf, np.uint8, size, page), base + page


def collapse_works() -> bool:
    buf, data, a = private_anonymous(8 << 20)
    data[:] = 1
    madvise = memory._madvise()
    lo = -(-a // (2 << 20)) * (2 << 20)
    return madvise is not None and madvise(lo, 2 << 20, memory._MADV_COLLAPSE) == 0


needs_collapse = pytest.mark.skipif(not sys.platform.startswith("linux") or not collapse_works(),
                                    reason="MADV_COLLAPSE needs Linux >= 6.1")
