"""Random GGUF quantized blocks and the numpy oracle the kernel library's tests compare with:
``gguf``'s dequantization and the kernels' int8 quantization of the activations; the built
library, or a skip where it is missing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiny_mindie import kernels

X86_PATHS = ("portable", "avx2", "avxvnni", "avx512vnni")

#: byte offsets of each block's float16 fields (scales, minimums)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q8_0": [0], "Q4_K": [0, 2],
              "Q6_K": [208]}


def random_blocks(qtype: str, n: int, k: int, rng) -> np.ndarray:
    """``n`` rows of random ``qtype`` blocks for rows of ``k``: random bytes, float16 fields set
    to finite values (uint8 ``[n, k / block * block_bytes]``)."""
    elems, size = kernels.BLOCKS[qtype]
    b = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        d = (rng.standard_normal((n, k // elems)) * 0.02).astype(np.float16)
        b[..., off:off + 2] = d.view(np.uint8).reshape(n, k // elems, 2)
    return b.reshape(n, -1)


def oracle(qtype: str, x: np.ndarray, w: np.ndarray, n: int, k: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """``(x~ @ W.T, |x~| @ |W|.T)`` in float64: ``W`` dequantized by ``gguf``, ``x~`` the
    activations after the kernels' int8 quantization (per block of 32: scale ``max|x| / 127``
    in float32, ``round-half-even(x * (1 / scale))``; a block whose ``1 / scale`` overflows
    is zero)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    wf = dequantize(np.asarray(w), GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float64)
    xb = x.reshape(x.shape[0], -1, 32)
    scale = np.abs(xb).max(axis=-1) / np.float32(127)
    with np.errstate(over="ignore"):
        inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    tiny = ~np.isfinite(inv)
    scale[tiny], inv[tiny] = 0, 0
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127)
    xd = (q.astype(np.float64) * scale[..., None]).reshape(x.shape[0], k)
    return xd @ wf.T, np.abs(xd) @ np.abs(wf).T


def assert_close_to_oracle(qtype, x, w, n, k, y) -> None:
    """``y`` within float32 rounding of the accumulation of the oracle's terms."""
    ref, mag = oracle(qtype, x, w, n, k)
    err = np.abs(y.astype(np.float64) - ref)
    tol = 1e-6 * mag + 1e-30
    assert (err <= tol).all(), f"{qtype}: worst error {float((err / (mag + 1e-30)).max()):.3g}"


def built_kernels():
    """``tiny_mindie.kernels`` where its library was built; else the test skips (fails in CI,
    where ``pip install -e .`` builds it)."""
    if not kernels.available():
        why = "the kernel library was not built (no C compiler when the package was installed)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return kernels


def kernels_on_best_path():
    """A module fixture's body (``lib``): the built library, its ISA path restored to the best
    one afterwards."""
    lib = built_kernels()
    best = lib.isa()
    yield lib
    lib.set_isa(best)


def use_path(lib, path: str) -> None:
    """Force the ISA path ``path``; skip where this CPU cannot run it."""
    if not lib.supported(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    lib.set_isa(path)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """The same float32 bits, NaNs equal wherever both are NaN (their payloads aside)."""
    assert got.dtype == np.float32 and got.shape == want.shape
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
