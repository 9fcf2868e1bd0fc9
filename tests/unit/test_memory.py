"""The backend's resident-memory helpers (tiny_mindie/model/ort/memory.py): KV buffers that cost
nothing until written, and moving freshly written memory to huge pages (Linux >= 6.1)."""

from __future__ import annotations

import numpy as np
from huge_pages import needs_collapse, private_anonymous

from tiny_mindie.model.ort import memory


def test_kv_cache_costs_no_memory_until_written():
    """The KV buffers are zero pages of one anonymous mapping: 64 MiB of them add (almost)
    nothing to the resident set until written."""
    def rss_kib():
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    before = rss_kib()
    buf, arrays = memory.zeroed_buffers(16, (4, 4, 1024, 64))
    assert rss_kib() - before < 4096                 # (checked before anything reads them)
    assert len(arrays) == 16 and arrays[3].shape == (4, 4, 1024, 64) and not arrays[15].any()
    arrays[2][1, 0, 5] = 1.0
    assert arrays[2].ctypes.data - arrays[1].ctypes.data == arrays[1].nbytes
    assert arrays[2][1, 0, 5, 0] == 1.0 and not arrays[1].any() and not arrays[3].any()


def _anon_huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of the mapping(s) of this process inside ``[lo, hi)``."""
    total, inside = 0, False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@needs_collapse
def test_use_huge_pages_collapses_what_was_written_since_and_nothing_else():
    """Memory fully written after the snapshot ends up on 2 MiB pages with its bytes unchanged;
    memory with one page written per 2 MiB stays as it is (collapsing it would fill the holes:
    +2 MiB each), so does memory only read (the kernel's zero page: collapsing it would allocate
    it) and memory that was populated before (the embedding program's)."""
    _, older, olo = private_anonymous(16 << 20)
    older[:] = 3
    before = memory.populated_pieces()
    _, dense, lo = private_anonymous(16 << 20)
    pattern = np.resize(np.arange(251, dtype=np.uint8), dense.size)
    dense[:] = pattern
    _, sparse, slo = private_anonymous(16 << 20)
    sparse[::2 << 20] = 7
    _, read, rlo = private_anonymous(16 << 20)
    assert read.sum() == 0                                       # read only: the zero page
    pieces = memory.own_huge_pieces(lo, lo + dense.size)
    assert len(pieces) * (2 << 20) >= 14 << 20                  # the aligned 2 MiB pieces inside
    assert memory.own_huge_pieces(slo, slo + sparse.size) == []
    assert memory.own_huge_pieces(rlo, rlo + read.size) == []
    assert memory.use_huge_pages(before) >= 14 << 20
    assert _anon_huge_kib(lo, lo + dense.size) >= 14 << 10
    assert _anon_huge_kib(slo, slo + sparse.size) == 0
    assert _anon_huge_kib(rlo, rlo + read.size) == 0
    assert _anon_huge_kib(olo, olo + older.size) == 0
    assert (dense == pattern).all() and (older == 3).all()


def test_a_mapped_files_pages_count_as_file_pages_not_own_memory(tmp_path):
    """Reading half the pages of a mapped 32 MiB file adds about 16 MiB to its resident bytes
    and to the process's file pages, and nothing like that to its own memory."""
    import mmap

    path = tmp_path / "weights.bin"
    path.write_bytes(np.arange(32 << 20, dtype=np.uint8).tobytes())
    before_own, before_file = memory.resident_split()
    assert memory.file_resident_bytes(str(path)) == 0              # not mapped yet
    with open(path, "rb") as fh:
        mapped = np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), np.uint8)
    half = int(mapped[1: 16 << 20 : mmap.PAGESIZE].sum(dtype=np.int64))   # a byte a page
    assert half > 0
    resident = memory.file_resident_bytes(str(path))
    own, files = memory.resident_split()
    assert (16 << 20) <= resident < (20 << 20)                     # (fault-around: a few more)
    assert files - before_file >= 16 << 20
    assert own - before_own < 4 << 20
