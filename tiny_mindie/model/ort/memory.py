"""Resident memory of the ONNX Runtime backend (Linux; each function a no-op elsewhere).

onnxruntime repacks the quantized weights into its own buffers at load, memory-maps the weight
file and keeps the mappings: :func:`release_file_pages` gives back the file pages it no longer
needs. With tiny_mindie's own kernels (``--kernels custom``) the weights are the GGUF's own
pages, mapped read-only and read in place: they count in the process's resident memory as it
touches them, but as file-backed pages -- the OS page cache's, shared with every process mapping
the same file, and reclaimable under memory pressure (read from the file again when next
touched) -- not as memory of its own (:func:`resident_split`, :func:`file_resident_bytes`);
they are never released. :func:`trim_heap` returns the heap's freed pages after prepacking, and
:func:`use_huge_pages` moves the memory the session wrote, its prepacked weights above all, to
2 MiB huge pages (a decode step streams every weight: fewer TLB misses and prefetcher stops).
The KV buffers live in one anonymous mapping (:func:`zeroed_buffers`), so untouched positions
cost nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

_MADV_PAGEOUT = 21      # Linux >= 5.4: reclaim these pages now (content is kept: clean file pages
                        # are re-read on the next touch, dirty ones would go to swap)


def _mappings():
    """``(start, end, permissions, path)`` of each mapping of this process, from
    ``/proc/self/maps`` (``path`` empty for anonymous memory). Raises OSError without it."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            yield lo, hi, fields[1], fields[5].rstrip("\n") if len(fields) > 5 else ""


def _madvise():
    """libc's ``madvise(addr, length, advice) -> 0 or -1``, or None where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


def release_file_pages(path: str) -> int:
    """Ask the kernel to reclaim the pages of ``path`` mapped in this process; returns bytes asked.

    onnxruntime memory-maps the external weight file, reads every tensor once to prepack it into
    its own buffers, and keeps the mappings: the pages it read then count as resident although
    the kernels use the packed copies. ``MADV_PAGEOUT`` gives them back; whatever is still used
    (the embedding rows looked up, norm weights, rotary tables) is faulted in again on demand.
    A no-op where the call is unavailable.
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    try:
        real = os.path.realpath(path)
        return sum(hi - lo for lo, hi, _, name in _mappings()
                   if name == real and madvise(lo, hi - lo, _MADV_PAGEOUT) == 0)
    except (OSError, ValueError):
        return 0


def _status_kb(field: str) -> int:
    """The ``field:`` value of ``/proc/self/status`` in kB (0 where it cannot be read)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def resident_split() -> tuple[int, int]:
    """``(own, file)``: this process's resident bytes of its own (anonymous and shared memory:
    ``RssAnon + RssShmem``) and of mapped files (``RssFile``: pages of the OS page cache, shared
    with other processes mapping the same files and reclaimable); ``(0, 0)`` where
    ``/proc/self/status`` cannot be read."""
    return ((_status_kb("RssAnon") + _status_kb("RssShmem")) * 1024,
            _status_kb("RssFile") * 1024)


def file_resident_bytes(path: str) -> int:
    """Bytes of ``path`` resident in this process's mappings of it (their ``Rss`` in
    ``/proc/self/smaps``); 0 where it is not mapped or smaps cannot be read."""
    real = os.path.realpath(path)
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as fh:
            for line in fh:
                head = line.split(maxsplit=5)
                if "-" in head[0] and not head[0].endswith(":"):      # a mapping's first line
                    inside = len(head) > 5 and head[5].rstrip("\n") == real
                elif inside and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


_MADV_COLLAPSE = 25     # Linux >= 6.1: collapse this range's present pages into huge pages now
_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20


def anonymous_regions() -> list[tuple[int, int]]:
    """``(start, end)`` addresses of this process's private anonymous mappings (heap included)
    of at least one huge page (2 MiB), from ``/proc/self/maps``; empty where it does not exist.
    Shared and non-read-write mappings (reservations) are left out."""
    try:
        return [(lo, hi) for lo, hi, perms, name in _mappings()
                if name in ("", "[heap]") and perms[:2] == "rw" and perms[3] == "p"
                and hi - lo >= _HUGE_PAGE]
    except OSError:
        return []


#: pagemap bits 63 (present) and 56 (mapped by this process alone): a page that was only read
#: is present too, but as the kernel's shared zero page, and collapsing it would allocate memory
_OWN_PAGE = np.uint64((1 << 63) | (1 << 56))


def own_huge_pieces(lo: int, hi: int) -> list[int]:
    """Start addresses of the aligned 2 MiB pieces of ``[lo, hi)`` whose every 4 KiB page is in
    memory and this process's own (written, not the shared zero page: bits 63 and 56 of
    ``/proc/self/pagemap``); empty where pagemap is unreadable."""
    lo = -(-lo // _HUGE_PAGE) * _HUGE_PAGE
    hi = hi // _HUGE_PAGE * _HUGE_PAGE
    per = _HUGE_PAGE // _PAGE                   # pages per huge page
    step = 128 * _HUGE_PAGE                     # read pagemap 256 MiB of addresses at a time
    out: list[int] = []
    try:
        with open("/proc/self/pagemap", "rb") as fh:
            for start in range(lo, hi, step):
                n = min(step, hi - start) // _PAGE
                fh.seek(start // _PAGE * 8)
                entries = np.frombuffer(fh.read(n * 8), "<u8")
                if len(entries) != n:
                    return out
                own = ((entries & _OWN_PAGE) == _OWN_PAGE).reshape(-1, per).all(axis=1)
                out += (start + np.flatnonzero(own) * _HUGE_PAGE).tolist()
    except (OSError, ValueError):
        pass
    return out


def populated_pieces() -> set[int]:
    """:func:`own_huge_pieces` of all :func:`anonymous_regions`."""
    return {a for region in anonymous_regions() for a in own_huge_pieces(*region)}


def use_huge_pages(before: set[int]) -> int:
    """Collapse into 2 MiB transparent huge pages the pieces of private anonymous memory that are
    fully populated now and were not in ``before`` (:func:`populated_pieces` taken before a load):
    the memory the load wrote, and nothing the embedding program wrote before (what its other
    threads write during the load is collapsed too: fully written, so it costs no memory).
    Returns the bytes collapsed; 0 where ``MADV_COLLAPSE`` is missing (Linux < 6.1, other
    systems).

    Only ``MADV_COLLAPSE``, no ``MADV_HUGEPAGE``: the pages are collapsed once, now, and nothing
    asks the kernel to fill the pieces' holes later (with ``MADV_HUGEPAGE`` a later fault in a
    piece the program had partly freed would bring back a whole 2 MiB). A piece with holes is
    never collapsed (that would fill them), so resident memory does not grow.

    Why: a decode step streams every weight once, and on 4 KiB pages that is a TLB miss every
    4 KiB and a hardware prefetcher that stops at every page boundary. onnxruntime's prepacked
    weights live in ordinary ``malloc`` memory, which gets huge pages only when asked
    (``/sys/kernel/mm/transparent_hugepage/enabled`` is usually ``madvise``; ``MADV_COLLAPSE``
    does not depend on that setting).
    """
    madvise = _madvise()
    if madvise is None:
        return 0
    ranges: list[list[int]] = []                # consecutive pieces: one call each run
    for a in sorted(populated_pieces() - before):
        if ranges and ranges[-1][1] == a:
            ranges[-1][1] = a + _HUGE_PAGE
        else:
            ranges.append([a, a + _HUGE_PAGE])
    return sum(hi - lo for lo, hi in ranges if madvise(lo, hi - lo, _MADV_COLLAPSE) == 0)


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere):
    prepacking the weights leaves freed temporary buffers inside the heap."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def zeroed_buffers(count: int, shape: tuple[int, ...], dtype=np.float32
                   ) -> tuple[mmap.mmap, list[np.ndarray]]:
    """``count`` arrays of ``shape`` and ``dtype`` (float32 by default), consecutive in one
    anonymous mapping (returned too: the arrays are views of it): zero pages the OS only backs
    with memory when written (``np.zeros`` may instead get recycled heap memory and clear it)."""
    each = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = mmap.mmap(-1, max(1, count * each))
    arrays = [np.frombuffer(buf, dtype, int(np.prod(shape)), i * each).reshape(shape)
              for i in range(count)]
    return buf, arrays
