"""tiny_mindie's embedding lookup on GGUF blocks (``tiny_mindie::GatherGGUF``,
tiny_mindie/kernels/kern_gather.c): every supported type, random blocks bit for bit the values
of the ``gguf`` package's dequantization (real tensors: tests/model/test_kernels_real.py); ids
out of range refused, through ctypes and through onnxruntime.

Skips where the kernel library was not built (fails in CI, where it is).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from gguf_blocks import F16_FIELDS, assert_same_bits, built_kernels, random_blocks

from tiny_mindie import kernels


@pytest.fixture(scope="module")
def lib():
    return built_kernels()


def dequantized(qtype: str, w: np.ndarray, n: int, k: int) -> np.ndarray:
    """float32 ``[n, k]``: ``w`` dequantized by the ``gguf`` package."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.asarray(w), GGMLQuantizationType[qtype]).reshape(n, k)


def odd_halves(rng, size: int) -> np.ndarray:
    """float16 values of every kind: zeros of both signs, subnormals, the largest, infinities,
    NaN, and ordinary ones."""
    special = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 65504.0, -65504.0, np.inf, -np.inf, np.nan],
                       np.float16)
    out = (rng.standard_normal(size) * 0.05).astype(np.float16)
    pick = rng.random(size) < 0.3
    out[pick] = rng.choice(special, int(pick.sum()))
    return out


@pytest.mark.parametrize("qtype", sorted(kernels.TYPES))
def test_random_blocks_are_the_gguf_values_bit_for_bit(lib, qtype):
    rng = np.random.default_rng(zlib.crc32(qtype.encode()))
    n, k = 37, 768                                     # 3 K-quant super-blocks per row
    w = random_blocks(qtype, n, k, rng)
    ids = rng.integers(0, n, (3, 11))                  # any shape, ids repeated
    ids[0, :2] = 0, n - 1                              # the first and the last row
    assert_same_bits(lib.gather(qtype, ids, w, n, k), dequantized(qtype, w, n, k)[ids])


@pytest.mark.parametrize("qtype", sorted(kernels.TYPES))
def test_odd_float16_fields_give_the_gguf_values(lib, qtype):
    """Scales and minimums that are zeros, subnormals, the largest half, infinities, NaN."""
    rng = np.random.default_rng(zlib.crc32(b"odd " + qtype.encode()))
    n, k = 16, 512
    elems, size = kernels.BLOCKS[qtype]
    w = random_blocks(qtype, n, k, rng).reshape(n, k // elems, size)
    for off in F16_FIELDS[qtype]:
        w[..., off:off + 2] = odd_halves(rng, n * (k // elems)).view(np.uint8).reshape(
            n, k // elems, 2)
    w = w.reshape(n, -1)
    ids = np.arange(n)
    with np.errstate(invalid="ignore", over="ignore"):
        want = dequantized(qtype, w, n, k)
    assert_same_bits(lib.gather(qtype, ids, w, n, k), want)


def test_an_id_out_of_range_is_refused(lib):
    w = random_blocks("Q8_0", 10, 64, np.random.default_rng(0))
    for ids in ([10], [3, -1], [2**40]):
        with pytest.raises(ValueError, match="out of range"):
            lib.gather("Q8_0", np.array(ids), w, 10, 64)
    with pytest.raises(ValueError, match="not N rows"):
        lib.gather("Q8_0", np.array([0]), w[:, :-34], 10, 64)
    with pytest.raises(ValueError, match="unsupported GGUF type"):
        lib.gather("Q2_K", np.array([0]), w, 10, 64)
    assert lib.gather("Q8_0", np.zeros((0,), np.int64), w, 10, 64).shape == (0, 64)


def _gather_graph(qtype: str, w: np.ndarray, n: int, k: int) -> bytes:
    """A model of one GatherGGUF node: ids int64 [B, S] -> Y float32 [B, S, K]."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(kernels.GATHER_OP, ["W", "ids"], ["Y"], domain=kernels.DOMAIN,
                            type=kernels.TYPES[qtype], N=n, K=k)
    g = helper.make_graph([node], "gather_gguf",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", "S"])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["B", "S", k])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    return model.SerializeToString()


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "Q8_0"])
def test_the_onnxruntime_operator_gives_the_ctypes_numbers_or_refuses(lib, qtype):
    import onnxruntime as ort

    rng = np.random.default_rng(9)
    n, k = 40, 512
    w = random_blocks(qtype, n, k, rng)
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib.library_path())
    sess = ort.InferenceSession(_gather_graph(qtype, w, n, k), so,
                                providers=["CPUExecutionProvider"])
    ids = rng.integers(0, n, (2, 5))
    got = sess.run(None, {"ids": ids})[0]
    assert got.shape == (2, 5, k)
    assert_same_bits(got, lib.gather(qtype, ids, w, n, k))
    for bad in (n, -1):
        with pytest.raises(Exception, match="out of range"):
            sess.run(None, {"ids": np.array([[1, bad]], np.int64)})
