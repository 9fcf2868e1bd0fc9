"""Weight packing (tiny_mindie/model/weights.py): GGUF blocks -> MatMulNBits form, on the real
SmolLM2-135M (Q4_1, Q8_0) and Gemma 3 270M (Q5_0, Q8_0, Q4_K, Q6_K) weights and on synthetic blocks.

The exact types must dequantize to GGUF's own values bit for bit; the requantized ones within
half a step of their block.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tiny_mindie.model import weights
from tiny_mindie.model.config import ModelConfig
from tiny_mindie.model.gguf import GGUFFile, RawTensor
from tiny_mindie.model.weights import NBitsWeight, lm_head_weight, pack_weight, unpack_nbits


@pytest.fixture(scope="module")
def gguf(model_path) -> GGUFFile:
    return GGUFFile(model_path)


def test_gguf_matrices_pack_bit_exactly(gguf):
    """Q4_1 (and the Q8_0 embedding) -> MatMulNBits form dequantizes to GGUF's values, bit for
    bit."""
    names = ["token_embd.weight"] + [f"blk.{i}.{t}.weight" for i in (0, 29) for t in
                                    ("attn_q", "attn_k", "attn_v", "attn_output",
                                     "ffn_gate", "ffn_up", "ffn_down")]
    for name in names:
        w = pack_weight(gguf, name)
        assert w.exact
        ours, theirs = unpack_nbits(w), gguf.dequantize(name)
        assert ours.shape == theirs.shape
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), name


def _synthetic(qtype: str, n: int, k: int, seed: int) -> tuple[RawTensor, np.ndarray]:
    """Random ggml blocks of ``qtype`` (with tricky scales) and gguf's own dequantization."""
    import gguf as gg

    rng = np.random.default_rng(seed)
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype]
    blocks = rng.integers(0, 256, (n, k // 32, block_bytes), dtype=np.uint8)
    halves = 2 if qtype == "Q4_1" else 1
    f16 = rng.normal(0, 0.02, (n, k // 32, halves)).astype(np.float16)
    f16[0, 0] = 0                                   # an all-zero block
    f16[-1, -1, 0] = -f16[-1, -1, 0]                # a negative scale
    blocks[..., :2 * halves] = f16.view(np.uint8).reshape(n, k // 32, 2 * halves)
    data = blocks.reshape(n, -1)
    expect = gg.quants.dequantize(data, gg.GGMLQuantizationType[qtype]).reshape(n, k)
    return RawTensor("synthetic", qtype, (n, k), data), expect.astype(np.float32)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_synthetic_blocks_pack_bit_exactly(qtype):
    raw, expect = _synthetic(qtype, 64, 96, seed=3)      # 3 blocks per row: odd zero-point packing
    packer = {"Q4_0": weights.pack_q4_0, "Q4_1": weights.pack_q4_1, "Q8_0": weights.pack_q8_0}
    w = packer[qtype](raw)
    assert np.array_equal(unpack_nbits(w).view(np.uint32), expect.view(np.uint32))


def test_matmulnbits_reads_the_packing_as_documented(gguf):
    """A lone MatMulNBits node (float compute) on a packed Q4_1 matrix equals x @ W.T."""
    import onnxruntime as rt
    from onnx import TensorProto, helper, numpy_helper

    w = pack_weight(gguf, "blk.5.ffn_down.weight")
    W = gguf.dequantize("blk.5.ffn_down.weight")
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "S", "Z"], ["y0"], domain="com.microsoft",
                              K=w.k, N=w.n, bits=4, block_size=32, accuracy_level=0),
             helper.make_node("MatMul", ["x", "I"], ["bs"]),
             helper.make_node("Gemm", ["bs", "R", "y0"], ["y"])]
    ind = (np.arange(w.k)[:, None] // 32 == np.arange(w.k // 32)[None]).astype(np.float32)
    inits = [numpy_helper.from_array(a, n) for n, a in
             (("B", w.data), ("S", w.scales.reshape(-1)), ("Z", w.zero_points.reshape(-1)),
              ("I", ind), ("R", np.ascontiguousarray(w.mins.T)))]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, w.k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, w.n])], inits)
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                           helper.make_opsetid("com.microsoft", 1)])
    sess = rt.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, w.k)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    ref = x.astype(np.float64) @ W.T.astype(np.float64)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


def test_attention_scale_folds_only_when_exact(gguf):
    """1/sqrt(head_dim) goes into the query weights only as a power of two, so the folded query
    matrix is still bit-exact (times 1/8 for SmolLM2's head_dim 64)."""
    assert weights.power_of_two(1 / math.sqrt(64)) == 0.125
    assert weights.power_of_two(1 / math.sqrt(16)) == 0.25
    assert weights.power_of_two(1 / math.sqrt(128)) is None
    assert weights.power_of_two(1 / math.sqrt(80)) is None
    s = weights.power_of_two(ModelConfig.from_gguf(gguf).attn_scale)
    if s is not None:
        w = weights._scaled(pack_weight(gguf, "blk.3.attn_q.weight"), s)
        expect = gguf.dequantize("blk.3.attn_q.weight") * np.float32(s)
        assert np.array_equal(unpack_nbits(w).view(np.uint32), expect.view(np.uint32))


@pytest.fixture(scope="module")
def gemma_file(gemma_path):
    """Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 matrices), pulled on first use."""
    return GGUFFile(gemma_path)


def test_q5_0_packs_exactly_and_k_quants_requantize_within_the_bound(gemma_file):
    seen = set()
    for layer in (0, 1):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            name = f"blk.{layer}.{part}.weight"
            qtype = gemma_file.raw(name).qtype
            w = gemma_file.dequantize(name)
            got = unpack_nbits(pack_weight(gemma_file, name))
            if qtype in ("Q5_0", "Q8_0"):
                assert np.array_equal(got, w), name                  # exact, bit for bit
            else:                                                    # Q4_K, Q6_K: 8-bit requantized
                err = np.abs(got - w).reshape(w.shape[0], -1, 32).max(-1)
                bound = np.abs(w).reshape(w.shape[0], -1, 32).max(-1) / 254
                assert np.all(err <= bound * 1.001 + 1e-9), name          # float32 rounding
                assert np.linalg.norm(got - w) / np.linalg.norm(w) < 0.01, name
            seen.add(qtype)
    assert {"Q5_0", "Q4_K", "Q6_K"} <= seen


def test_an_8bit_lm_head_is_requantized_to_blocks_of_128_within_half_a_step(gemma_file, gguf):
    """Gemma's tied Q8_0 head (262,144 x 640) goes to blocks of 128 (``lm_head_weight``: twice
    as fast in onnxruntime's int8 kernel); every weight stays within half a step of its block,
    the embedding gather keeps the exact bytes, and heads that cannot take the larger block
    (4-bit, or a row length it does not divide, as SmolLM2's 576) are left as they are."""
    emb = pack_weight(gemma_file, "token_embd.weight")
    assert emb.exact and emb.block == 32
    n = 20_000                                     # a slice: the whole head is 671 MB as float32
    part = NBitsWeight(8, n, emb.k, emb.data[:n], emb.scales[:n], None, None,
                        exact=True, block=32)
    head = lm_head_weight(part, 128)
    assert head.block == 128 and not head.exact and head.scales.shape == (n, emb.k // 128)
    w, got = unpack_nbits(part), unpack_nbits(head)
    err = np.abs(got - w).reshape(n, -1, 128).max(-1)
    bound = np.abs(w).reshape(n, -1, 128).max(-1) / 254
    assert np.all(err <= bound * 1.001 + 1e-9)
    assert 0 < np.linalg.norm(got - w) / np.linalg.norm(w) < 0.01
    assert lm_head_weight(part, 32) is part
    smol = pack_weight(gguf, "token_embd.weight")
    assert smol.k % 128 and lm_head_weight(smol, 128) is smol
    q4 = pack_weight(gguf, "blk.0.attn_q.weight")
    assert q4.bits == 4 and lm_head_weight(q4, 128) is q4
