"""tiny_mindie's own matrix-product kernels on GGUF blocks, a C library built with the package
(``setup.py``: an optional extension; where no compiler is present the package installs
without it and :func:`available` is false).

The library holds the onnxruntime custom operators ``tiny_mindie::MatMulGGUF`` and
``tiny_mindie::GatherGGUF`` (loaded by ``SessionOptions.register_custom_ops_library(
library_path())``) and direct entries for ctypes, :func:`matmul` and :func:`gather`, which
compute the same numbers. The product:

    y [M, N] = x [M, K] @ W [N, K]^T

with ``W`` the GGUF tensor's own bytes (``N`` rows of blocks; :data:`TYPES`), ``x`` float32. The
activations are quantized to int8 per block of 32 (``scale = max|x| / 127``, round half to even),
each block's product is an exact int32 sum, and a row's blocks are added in float32 in block
order: a row's output depends on no other row, thread split or ISA path (``kern_impl.h``). A
block of activations holding a NaN or an infinity makes all of its row's outputs NaN; a block
too small for its scale's reciprocal (max|x| below about 3.7e-37) counts as zero.

ISA paths (:func:`isa`): ``avx512vnni``, ``avxvnni``, ``avx2``, ``neon`` (aarch64 with the dot
product extension) and ``portable``; the best one the CPU and its OS enable runs, unless the
environment variable ``TINY_MINDIE_KERNEL_ISA`` (or :func:`set_isa`) names one.

The lookup (the token embedding): ``y [T, K] = W [ids]``, each row's blocks dequantized to
float32 as the block formats define them (the values of ``gguf``'s dequantization, bit for bit).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.metadata
import os
import threading

import numpy as np

from . import sources

#: GGUF type name -> ggml type id (the operator's ``type`` attribute).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
#: GGUF type name -> (elements, bytes) per block.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q6_K": (256, 210)}
#: The ISA path names, best first.
PATHS = ("avx512vnni", "avxvnni", "avx2", "neon", "portable")
#: The custom operators' domain, the product's name and the lookup's.
DOMAIN, OP, GATHER_OP = "tiny_mindie", "MatMulGGUF", "GatherGGUF"

_HERE = os.path.dirname(os.path.abspath(__file__))
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class KernelError(RuntimeError):
    """The kernel library refused a call (bad arguments, or a refused ISA path)."""


def library_path() -> str | None:
    """The path of the library to load (``_tm_kernels`` with the interpreter's extension
    suffix), or ``None`` where there is none to load (:func:`unavailable_reason` says why).

    In an installed package (no C sources beside it), its own build. In a source tree (a
    clone), a build that embeds the digest of the sources beside it (:mod:`.sources`): its own
    (``pip install -e .``), else the installed distribution's (``pip install .``, then
    ``python -m tiny_mindie`` run inside the clone, which imports the clone's package).
    """
    return _find()[0]


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, in one line a user can act on (``None`` where it loads)."""
    try:
        _load()
    except KernelError as exc:
        return str(exc)
    return None


@functools.cache
def _find() -> tuple[str | None, str]:
    """(:func:`library_path`, and why it is ``None`` where it is): decided once per process, so
    the library onnxruntime registers is the one ctypes loaded."""
    own = _built_in(_HERE)
    want = sources.digest(_HERE)
    if want is None:                                    # an installed package
        return own, "the kernel library was not built (no C compiler at install)"
    if own is not None and sources.embedded(own) == want:
        return own, ""
    installed = None
    for path in _installed_builds():
        if sources.embedded(path) == want:
            return path, ""
        installed = installed or path
    if own is not None:
        return None, (f"the kernel library in {_HERE} was built from other sources than the "
                      "ones beside it: pip install -e . again")
    if installed is not None:
        return None, (f"the kernel library installed at {installed} was built from other "
                      f"sources than this source tree ({_HERE}): pip install . again, or "
                      "pip install -e .")
    return None, (f"this source tree ({_HERE}) holds no built kernel library and no installed "
                  "tiny_mindie has one built from it: pip install -e . builds it here (a C "
                  "compiler is needed)")


def _built_in(folder: str) -> str | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_tm_kernels" + suffix)
        if os.path.isfile(path):
            return path
    return None


def _installed_builds():
    """The library files of the installed ``tiny_mindie`` distributions, in path order."""
    # every one on the path: a source tree may hold its own metadata (an egg-info) too
    for dist in importlib.metadata.distributions(name="tiny_mindie"):
        for file in dist.files or ():
            if file.parent.name == "kernels" and file.name.startswith("_tm_kernels."):
                path = str(dist.locate_file(file))
                if os.path.isfile(path) and os.path.dirname(os.path.abspath(path)) != _HERE:
                    yield path


def _load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            path, why = _find()
            if path is None:
                raise KernelError(why)
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                raise KernelError(f"the kernel library does not load: {exc}") from None
            try:
                _declare(lib)
            except AttributeError as exc:            # a library of another version
                raise KernelError(f"the kernel library at {path} is not this version's ({exc}):"
                                  " install tiny_mindie again") from None
            _lib = lib
        return _lib


def _declare(lib: ctypes.CDLL) -> None:
    """The C entry points' argument and result types (AttributeError: one is missing)."""
    lib.tm_isa.restype = ctypes.c_char_p
    lib.tm_isa_error.restype = ctypes.c_char_p
    lib.tm_isa_supported.argtypes = [ctypes.c_char_p]
    lib.tm_set_isa.argtypes = [ctypes.c_char_p]
    i64 = ctypes.c_int64
    lib.tm_matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, i64, i64, ctypes.c_void_p, i64, i64,
                              ctypes.c_void_p, ctypes.c_int]
    lib.tm_gather.argtypes = [ctypes.c_int, ctypes.c_void_p, i64, ctypes.c_void_p, i64, i64, i64,
                              ctypes.c_void_p]


def available() -> bool:
    """True where the library was built and loads."""
    try:
        _load()
    except KernelError:
        return False
    return True


def isa() -> str:
    """The name of the ISA path in use (one of :data:`PATHS`).

    Raises:
        KernelError: the library is not built, or ``TINY_MINDIE_KERNEL_ISA`` names a path that
            does not exist or that this CPU (with what its OS enables) cannot run.
    """
    lib = _load()
    err = lib.tm_isa_error()
    if err:
        raise KernelError(err.decode())
    return lib.tm_isa().decode()


def supported(name: str) -> bool:
    """True when this CPU (and this build) can run the ISA path ``name``.

    Raises:
        ValueError: ``name`` is none of :data:`PATHS`.
    """
    r = _load().tm_isa_supported(name.encode())
    if r < 0:
        raise ValueError(f"no kernel ISA path {name!r}: one of {', '.join(PATHS)}")
    return bool(r)


def set_isa(name: str) -> None:
    """Run the ISA path ``name`` from now on, in this process (for tests and benchmarks).

    Raises:
        ValueError: ``name`` is none of :data:`PATHS`, or this CPU cannot run it.
    """
    r = _load().tm_set_isa(name.encode())
    if r == -1:
        raise ValueError(f"no kernel ISA path {name!r}: one of {', '.join(PATHS)}")
    if r == -2:
        raise ValueError(f"this CPU (or its OS) cannot run the kernel ISA path {name!r}")


def matmul(qtype: str, x: np.ndarray, w: np.ndarray, n: int, k: int, threads: int = 1
           ) -> np.ndarray:
    """``x @ W.T`` on the GGUF blocks ``w``.

    Args:
        qtype: the GGUF type of ``w``, a key of :data:`TYPES`.
        x: float32 ``[M, K]`` activations (converted to C-contiguous float32).
        w: uint8, the ``N`` rows of ``K / block`` blocks as in the GGUF file (any shape).
        n, k: ``N`` and ``K``.
        threads: threads splitting the ``N`` outputs (each row's arithmetic is the same for any).

    Returns:
        float32 ``[M, N]``.

    Raises:
        ValueError: an unknown type, or shapes that do not match.
        KernelError: the library is not built, or its ISA path was refused.
    """
    if qtype not in TYPES:
        raise ValueError(f"unsupported GGUF type {qtype!r}: one of {', '.join(TYPES)}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.uint8)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], not {list(x.shape)}")
    y = np.empty((x.shape[0], n), np.float32)
    r = _load().tm_matmul(TYPES[qtype], x.ctypes.data, x.shape[0], k, w.ctypes.data, w.nbytes,
                          n, y.ctypes.data, threads)
    if r == -1:
        raise ValueError(f"{qtype} weight of {w.nbytes} bytes is not {n} rows of {k} elements")
    if r == -3:
        isa()                                   # raises with the reason
    if r:
        raise KernelError(f"tm_matmul failed ({r})")
    return y


def gather(qtype: str, ids, w: np.ndarray, n: int, k: int) -> np.ndarray:
    """Rows ``ids`` of ``W [N, K]``, dequantized.

    Args:
        qtype: the GGUF type of ``w``, a key of :data:`TYPES`.
        ids: integer row numbers, any shape, each in ``0 .. N-1``.
        w: uint8, the ``N`` rows of ``K / block`` blocks as in the GGUF file (any shape).
        n, k: ``N`` and ``K``.

    Returns:
        float32 ``[*ids.shape, K]``.

    Raises:
        ValueError: an unknown type, a ``w`` that is not ``N`` rows of ``K``, or an id outside
            ``0 .. N-1`` (nothing is read then).
        KernelError: the library is not built.
    """
    if qtype not in TYPES:
        raise ValueError(f"unsupported GGUF type {qtype!r}: one of {', '.join(TYPES)}")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    w = np.ascontiguousarray(w, dtype=np.uint8)
    y = np.empty((*ids.shape, k), np.float32)
    if _load().tm_gather(TYPES[qtype], ids.ctypes.data, ids.size, w.ctypes.data, w.nbytes, n, k,
                         y.ctypes.data):
        raise ValueError(f"ids {ids.min(initial=0)}..{ids.max(initial=0)} of a {qtype} weight of "
                         f"{w.nbytes} bytes as {n} rows of {k}: an id out of range, or the "
                         "size is not N rows")
    return y
