"""Read a GGUF file: metadata, raw quantized tensors and dequantized float32 tensors.

GGUF layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Reading and dequantizing
are done by the ``gguf`` package (from llama.cpp), which handles Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q6_K, F16, BF16 and F32 bit-exactly; this module only gives it a small, typed face.

Metadata and tensor directory are parsed here (:func:`_parse`) rather than by
``gguf.GGUFReader``: the reader turns every element of every array into its own numpy view, which
makes opening a file with a large vocabulary (Gemma 3's 262,144 SentencePiece pieces) slow; the
plain parse below yields the same values (``GGUFReader``'s ``contents()``). Tensor
data are the same read-only memory-map slices the reader would give, and dequantization is still
``gguf.quants``'. Anything the fast parse does not handle (big-endian files, GGUF v1) falls back
to ``GGUFReader``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class ModelFileError(Exception):
    """The model file is missing, unreadable, or not a model this project can run."""


@dataclass(frozen=True)
class RawTensor:
    """One tensor as stored in the file.

    ``shape`` is numpy order (rows first): a GGUF matrix with ``ne = [n_in, n_out]`` has
    ``shape == (n_out, n_in)``. ``data`` is a read-only memory map: for quantized types a
    ``uint8`` array ``[n_out, bytes_per_row]`` of ggml blocks, for float types the values.
    """

    name: str
    qtype: str          # ggml type name: "Q4_1", "Q8_0", "F32", ...
    shape: tuple[int, ...]
    data: np.ndarray


class _Tensor(NamedTuple):
    name: str
    tensor_type: Any           # gguf.GGMLQuantizationType
    ne: tuple[int, ...]        # GGUF order (innermost first)
    data: np.ndarray           # read-only memory map, as GGUFReader gives it


class _Unsupported(Exception):
    """A valid-looking file the fast parse leaves to ``GGUFReader``."""


# GGUF value types (gguf.md): id -> (struct format, numpy dtype); 7 = bool, 8 = string, 9 = array
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")          # a string's length
# Float/integer tensor types GGUFReader exposes as values (not as bytes of blocks).
_PLAIN_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}


class _Cursor:
    """Reads GGUF values (little-endian) from ``buf``, advancing ``pos``."""

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        buf, pos = self.buf, self.pos
        n = _U64.unpack_from(buf, pos)[0]
        pos += 8
        self.pos = pos + n
        return str(buf[pos:pos + n], "utf-8")

    def value(self, vtype: int) -> Any:
        """A metadata value of GGUF type ``vtype``; arrays as lists."""
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                raise _Unsupported("nested arrays")
            dtype = np.dtype(_SCALARS[etype][1])
            a = np.frombuffer(self.buf, dtype=dtype.newbyteorder("<"), count=count,
                              offset=self.pos)
            self.pos += count * dtype.itemsize
            return a.tolist()
        return self.take(_SCALARS[vtype][0])


def _parse(path: str, gguf) -> tuple[dict[str, Any], dict[str, _Tensor]]:
    """Metadata (as ``ReaderField.contents()`` would give) and tensors of a GGUF v2/v3 file
    (little-endian)."""
    mm = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(mm))
    if bytes(cur.buf[:4]) != b"GGUF":
        raise ValueError("bad magic")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise _Unsupported(f"version {version}")
    n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors,
                            "GGUF.kv_count": n_kv}  # the pseudo-keys GGUFReader lists too
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.take("<I")
        ne = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, ne, cur.take("<I"), cur.take("<Q")))
    align = int(meta.get("general.alignment", 32))
    return meta, _tensors(mm, infos, cur.pos + (-cur.pos) % align, gguf)


def _tensors(mm: np.memmap, infos: list[tuple[str, tuple[int, ...], int, int]], start: int,
             gguf) -> dict[str, _Tensor]:
    """The tensors of the directory ``infos`` (name, ne, ggml type, offset from ``start``) as
    read-only views of ``mm``."""
    tensors: dict[str, _Tensor] = {}
    for name, ne, raw_type, offset in infos:
        if name in tensors:
            raise ValueError(f"duplicated tensor {name}")
        qtype = gguf.GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(ne, dtype=np.int64))
        shape = tuple(reversed(ne))
        plain = _PLAIN_DTYPES.get(qtype.name)
        if plain is not None:
            dtype, count = np.dtype(plain), n_elems
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            dtype, count = np.dtype(np.uint8), n_elems * type_size // block
            shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
        begin = start + offset
        if begin + count * dtype.itemsize > len(mm):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = mm[begin:begin + count * dtype.itemsize].view(dtype).reshape(shape)
        tensors[name] = _Tensor(name, qtype, ne, data)
    return tensors


def _whole_map(tensors: dict[str, _Tensor]) -> np.ndarray | None:
    """The memory map of the whole file that the tensors' data are views of, as uint8 (``None``
    for a file without tensors)."""
    root = next((t.data for t in tensors.values()), None)
    while isinstance(root, np.ndarray) and isinstance(root.base, np.ndarray):
        root = root.base
    return None if root is None else root.reshape(-1).view(np.uint8)


GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: str) -> None:
    """Refuse ``path`` unless it is a readable file starting with the GGUF magic (4 bytes
    read; nothing else is parsed).

    Raises:
        ModelFileError: in one line: ``path`` is missing, a directory (the ``.gguf`` files in
            it named), unreadable, or not a GGUF file.
    """
    if os.path.isdir(path):
        try:
            inside = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        except OSError:
            inside = []
        hint = (f"give one of the .gguf files in it ({', '.join(inside[:3])}"
                f"{', ...' if len(inside) > 3 else ''})" if inside else
                "give a .gguf file")
        raise ModelFileError(f"model file {path} is a directory, not a file: {hint}")
    if not os.path.isfile(path):
        raise ModelFileError(f"model file not found: {path}")
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelFileError(f"cannot read the model file {path}: {exc.strerror or exc}") \
            from None
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"not a readable GGUF file: {path} (it does not start with "
                             f"{GGUF_MAGIC.decode()!r})")


class GGUFFile:
    """A GGUF file opened by memory map.

    Args:
        path: path of the ``.gguf`` file.

    Raises:
        ModelFileError: the file does not exist, is a directory, or is not a readable GGUF
            file (:func:`check_gguf_file`).
    """

    def __init__(self, path: str | os.PathLike[str]):
        import gguf  # imported here: the package is slow to import and only needed at load time

        self.path = os.fspath(path)
        check_gguf_file(self.path)
        self._gguf = gguf
        try:
            try:
                self._meta, self._tensors = _parse(self.path, gguf)
            except _Unsupported:
                self._meta, self._tensors = self._read_with_reader()
        except Exception as exc:  # ValueError, struct.error, UnicodeDecodeError, ... on bad files
            raise ModelFileError(f"not a readable GGUF file: {self.path} ({exc})") from exc
        self._map = _whole_map(self._tensors)

    def _read_with_reader(self) -> tuple[dict[str, Any], dict[str, _Tensor]]:
        reader = self._gguf.GGUFReader(self.path, "r")
        meta = {k: f.contents() for k, f in reader.fields.items()}
        tensors = {t.name: _Tensor(t.name, t.tensor_type, tuple(int(n) for n in t.shape), t.data)
                   for t in reader.tensors}
        return meta, tensors

    # ---- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value for ``key`` (str, int, float, bool or list), or ``default``."""
        return self._meta.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value for ``key``; raises :class:`ModelFileError` when it is absent."""
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def keys(self) -> list[str]:
        return list(self._meta)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    # ---- tensors --------------------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        """The names of the file's tensors, in file order."""
        return list(self._tensors)

    def raw(self, name: str) -> RawTensor:
        """The tensor ``name`` as stored (quantized blocks untouched)."""
        t = self._tensor(name)
        return RawTensor(name, t.tensor_type.name, tuple(reversed(t.ne)), t.data)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor ``name`` as float32, numpy shape (rows first, see :class:`RawTensor`)."""
        t = self._tensor(name)
        shape = tuple(reversed(t.ne))
        values = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

    def file_offset(self, array: np.ndarray) -> int | None:
        """The byte offset in the file of ``array``'s bytes when ``array`` is a C-contiguous
        view of this file's memory map (a tensor's ``raw().data``, or a slice of its rows),
        else ``None``."""
        if self._map is None or not isinstance(array, np.ndarray) or \
                not array.flags.c_contiguous:
            return None
        at = array.__array_interface__["data"][0] - self._map.__array_interface__["data"][0]
        return at if 0 <= at and at + array.nbytes <= self._map.nbytes else None

    def mapped_bytes(self, offset: int, length: int) -> np.ndarray:
        """Bytes ``offset .. offset + length`` of the file: a read-only uint8 view of its memory
        map (no copy).

        Raises:
            ModelFileError: the range is not inside the file.
        """
        if self._map is None or offset < 0 or length < 0 or offset + length > self._map.nbytes:
            raise ModelFileError(f"{self.path}: bytes {offset}..{offset + length} are not in the "
                                 f"file ({0 if self._map is None else self._map.nbytes} bytes)")
        return self._map[offset:offset + length]

    def dequantize_rows(self, name: str, start: int, end: int) -> np.ndarray:
        """Rows ``[start, end)`` of the matrix ``name`` as float32 ``[end - start, columns]``:
        the same values as those rows of :meth:`dequantize` (a GGUF row is whole blocks), by
        gguf's block function of the type when it has one (called on the rows at once: for a
        few hundred rows several times faster than :meth:`dequantize`'s groups of 16)."""
        t = self._tensor(name)
        rows = np.asarray(t.data[start:end]).view(np.ndarray)
        quant = getattr(self._gguf.quants, t.tensor_type.name, None)
        if quant is not None and hasattr(quant, "dequantize_rows"):
            quant.init_grid()
            values = quant.dequantize_rows(rows)
        else:                                   # F32, F16: no block class
            values = self._gguf.quants.dequantize(rows, t.tensor_type)
        return np.ascontiguousarray(values, dtype=np.float32).reshape(-1, t.ne[0])

    def tensor_totals(self) -> tuple[int, int]:
        """``(values, bytes)`` over all the file's tensors: the model's parameter count and the
        size of its weights as stored (quantized blocks included), as llama.cpp's
        ``llama_model_n_params`` and ``llama_model_size`` count them."""
        values = sum(int(np.prod(t.ne, dtype=np.int64)) for t in self._tensors.values())
        return values, sum(int(t.data.nbytes) for t in self._tensors.values())

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing") from None
