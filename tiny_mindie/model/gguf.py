"""Read a GGUF file: metadata, raw quantized tensors and dequantized float32 tensors.

GGUF layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Reading and dequantizing
are done by the ``gguf`` package (from llama.cpp), which handles Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q6_K, F16, BF16 and F32 bit-exactly; this module only gives it a small, typed face.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

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


class GGUFFile:
    """A GGUF file opened by memory map.

    Args:
        path: path of the ``.gguf`` file.

    Raises:
        ModelFileError: the file does not exist or is not a readable GGUF file.
    """

    def __init__(self, path: str | os.PathLike[str]):
        import gguf  # imported here: the package is slow to import and only needed at load time

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ModelFileError(f"model file not found: {self.path}")
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as exc:  # the reader raises ValueError, struct.error, ... on bad files
            raise ModelFileError(f"not a readable GGUF file: {self.path} ({exc})") from exc
        self._gguf = gguf
        self._tensors = {t.name: t for t in self._reader.tensors}

    # ---- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value for ``key`` (str, int, float, bool or list), or ``default``."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str) -> Any:
        """Metadata value for ``key``; raises :class:`ModelFileError` when it is absent."""
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def keys(self) -> list[str]:
        return list(self._reader.fields)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    # ---- tensors --------------------------------------------------------------------------
    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def raw(self, name: str) -> RawTensor:
        """The tensor ``name`` as stored (quantized blocks untouched)."""
        t = self._tensor(name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        return RawTensor(name, t.tensor_type.name, shape, t.data)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor ``name`` as float32, numpy shape (rows first, see :class:`RawTensor`)."""
        t = self._tensor(name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        values = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)

    def _tensor(self, name: str):
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing") from None
