"""Weight packing (tiny_mindie/model/onnx/weights.py): GGUF blocks -> MatMulNBits form, on the real
SmolLM2-135M (Q4_1, Q8_0) and Gemma 3 270M (Q5_0, Q8_0, Q4_K, Q6_K) weights and on synthetic blocks
of every packed type.

The exact types must dequantize to GGUF's own values bit for bit; the requantized ones within
half a step of their block.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.gguf import GGUFFile, ModelFileError, RawTensor
from tiny_mindie.model.onnx import graph_weights, weights
from tiny_mindie.model.onnx.weights import NBitsWeight, lm_head_weight, pack_weight, unpack_nbits


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


#: ggml block layout: (elements, bytes, byte offsets of the f16 scale/min fields).
BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
          "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)),
          "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,)), "Q3_K": (256, 110, (108,))}


def _synthetic(qtype: str, n: int, k: int, seed: int) -> tuple[RawTensor, np.ndarray]:
    """Random ggml blocks of ``qtype`` (random bits, realistic f16 scales, an all-zero and a
    negative scale) and gguf's own dequantization."""
    import gguf as gg

    rng = np.random.default_rng(seed)
    elements, block_bytes, halves = BLOCKS[qtype]
    blocks = rng.integers(0, 256, (n, k // elements, block_bytes), dtype=np.uint8)
    for pos in halves:
        f16 = rng.normal(0, 0.02, (n, k // elements, 1)).astype(np.float16)
        blocks[..., pos:pos + 2] = f16.view(np.uint8)
    blocks[0, 0, halves[0]:halves[0] + 2] = 0                         # an all-zero block
    data = blocks.reshape(n, -1)
    expect = gg.quants.dequantize(data, gg.GGMLQuantizationType[qtype]).reshape(n, k)
    return RawTensor("synthetic", qtype, (n, k), data), expect.astype(np.float32)


@pytest.mark.parametrize("qtype", sorted(weights.PACKERS))
def test_synthetic_blocks_pack_bit_exactly(qtype):
    """Every exactly packed type, on random bits: the packed form dequantizes to gguf's values
    bit for bit (3 blocks of 32 per row for the 32-element types: an odd zero-point count)."""
    raw, expect = _synthetic(qtype, 64, 96 if BLOCKS[qtype][0] == 32 else 768, seed=3)
    w = weights.PACKERS[qtype](raw)
    assert w.exact and w.block == 32 and w.bits == (4 if qtype in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert np.array_equal(unpack_nbits(w).view(np.uint32), expect.view(np.uint32))


def test_k_quant_rows_must_be_whole_super_blocks():
    raw, _ = _synthetic("Q4_K", 4, 256, seed=1)
    with pytest.raises(ModelFileError, match="multiple of 256"):
        weights.pack_q4_k(RawTensor("blk.0.x", "Q4_K", (8, 128), raw.data.reshape(8, 72)))


def test_other_types_requantize_to_8bit_within_half_a_step(tmp_path):
    """F16, F32, Q3_K and Q6_K matrices (no exact form in blocks of 32) become symmetric 8-bit
    blocks of 32 within half a step of their block, a Q6_K embedding too (for the embedding
    gather); pack_weight dispatches each exact type to its packer and refuses a type gguf cannot
    dequantize (Q8_1) by name."""
    import gguf as gg

    rng = np.random.default_rng(7)
    path = str(tmp_path / "types.gguf")
    w = gg.GGUFWriter(path, "llama")
    expect = {}
    for qtype in ("F16", "F32"):
        a = (rng.standard_normal((16, 256)) * 0.05).astype(np.float32)
        w.add_tensor(qtype, gg.quants.quantize(a, gg.GGMLQuantizationType[qtype]))
        expect[qtype] = a.astype(np.float16).astype(np.float32) if qtype == "F16" else a
    for name, qtype in (("Q3_K", "Q3_K"), ("Q4_K", "Q4_K"), ("token_embd.weight", "Q6_K")):
        raw, expect[name] = _synthetic(qtype, 16, 256, seed=len(expect))
        w.add_tensor(name, raw.data, raw_shape=(16, BLOCKS[qtype][1]),
                     raw_dtype=gg.GGMLQuantizationType[qtype])
    w.add_tensor("Q8_1", np.zeros((16, 8 * 40), np.uint8), raw_shape=(16, 8 * 40),
                 raw_dtype=gg.GGMLQuantizationType.Q8_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path)
    for name in ("F16", "F32", "Q3_K", "token_embd.weight"):
        got = pack_weight(f, name)
        assert got.bits == 8 and got.block == 32 and not got.exact, name
        ref = expect[name].reshape(16, -1, 32)
        err = np.abs(unpack_nbits(got).reshape(16, -1, 32) - ref).max(-1)
        assert np.all(err <= np.abs(ref).max(-1) / 254 * 1.001 + 1e-9), name
        assert err.max() > 0, name
    assert pack_weight(f, "Q4_K").exact and pack_weight(f, "Q4_K").bits == 4
    with pytest.raises(ModelFileError, match="Q8_1: GGUF type Q8_1 is not supported"):
        pack_weight(f, "Q8_1")
    emb = graph_weights.load_embedding(f)
    assert emb.bits == 8 and emb.block == 32 and emb.zero_points is None and not emb.exact


def _lone_matmulnbits(w: NBitsWeight, W: np.ndarray) -> None:
    """A lone MatMulNBits node (float compute; plus the block-sum residual when ``w.mins``) on
    the packed ``w`` equals ``x @ W.T`` in float64 within float32 rounding."""
    import onnxruntime as rt
    from onnx import TensorProto, helper, numpy_helper

    arrays = [("B", w.data), ("S", w.scales.reshape(-1))]
    if w.zero_points is not None:
        arrays.append(("Z", w.zero_points.reshape(-1)))
    nodes = [helper.make_node("MatMulNBits", ["x"] + [n for n, _ in arrays],
                              ["y0" if w.mins is not None else "y"], domain="com.microsoft",
                              K=w.k, N=w.n, bits=w.bits, block_size=w.block, accuracy_level=0)]
    if w.mins is not None:
        ind = (np.arange(w.k)[:, None] // 32 == np.arange(w.k // 32)[None]).astype(np.float32)
        arrays += [("I", ind), ("R", np.ascontiguousarray(w.mins.T))]
        nodes += [helper.make_node("MatMul", ["x", "I"], ["bs"]),
                  helper.make_node("Gemm", ["bs", "R", "y0"], ["y"])]
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, w.k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, w.n])],
                          [numpy_helper.from_array(a, n) for n, a in arrays])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                           helper.make_opsetid("com.microsoft", 1)])
    sess = rt.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, w.k)).astype(np.float32)
    y = sess.run(None, {"x": x})[0]
    ref = x.astype(np.float64) @ W.T.astype(np.float64)
    assert np.abs(y - ref).max() <= 1e-4 * np.abs(ref).max()


def test_matmulnbits_reads_the_packing_as_documented(gguf):
    """Q4_1 (4-bit, zero point, residual) through onnxruntime's own MatMulNBits."""
    _lone_matmulnbits(pack_weight(gguf, "blk.5.ffn_down.weight"),
                      gguf.dequantize("blk.5.ffn_down.weight"))


@pytest.mark.parametrize("qtype", ["Q5_1", "Q5_K"])
def test_matmulnbits_reads_8bit_zero_points_and_residuals(qtype):
    raw, expect = _synthetic(qtype, 48, 768, seed=5)
    _lone_matmulnbits(weights.PACKERS[qtype](raw), expect)


def test_attention_scale_folds_only_when_exact(gguf):
    """1/sqrt(head_dim) goes into the query weights only as a power of two, so the folded query
    matrix is still bit-exact (times 1/8 for SmolLM2's head_dim 64)."""
    assert graph_weights.power_of_two(1 / math.sqrt(64)) == 0.125
    assert graph_weights.power_of_two(1 / math.sqrt(16)) == 0.25
    assert graph_weights.power_of_two(1 / math.sqrt(128)) is None
    assert graph_weights.power_of_two(1 / math.sqrt(80)) is None
    s = graph_weights.power_of_two(ModelConfig.from_gguf(gguf).attn_scale)
    if s is not None:
        w = graph_weights._scaled(pack_weight(gguf, "blk.3.attn_q.weight"), s)
        expect = gguf.dequantize("blk.3.attn_q.weight") * np.float32(s)
        assert np.array_equal(unpack_nbits(w).view(np.uint32), expect.view(np.uint32))


@pytest.fixture(scope="module")
def gemma_file(gemma_path):
    """Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 matrices), pulled on first use."""
    return GGUFFile(gemma_path)


def test_gemma_matrices_pack_bit_exactly_or_within_half_a_step(gemma_file):
    """Gemma 3 270M Q4_K_M's Q5_0, Q8_0 and Q4_K (4-bit) matrices dequantize to gguf's values
    bit for bit, its Q6_K ones within half a step of their 8-bit block; onnxruntime's
    MatMulNBits reads the Q4_K packing (zero point + residual) as documented."""
    seen = {}
    for layer in (0, 1):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            name = f"blk.{layer}.{part}.weight"
            w, W = pack_weight(gemma_file, name), gemma_file.dequantize(name)
            qtype = gemma_file.raw(name).qtype
            got = unpack_nbits(w)
            if qtype == "Q6_K":
                assert not w.exact and w.bits == 8, name
                err = np.abs(got - W).reshape(W.shape[0], -1, 32).max(-1)
                bound = np.abs(W).reshape(W.shape[0], -1, 32).max(-1) / 254
                assert np.all(err <= bound * 1.001 + 1e-9) and err.max() > 0, name
            else:
                assert w.exact and np.array_equal(got.view(np.uint32), W.view(np.uint32)), name
            seen.setdefault(qtype, (w, W))
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K"} <= set(seen)
    assert seen["Q4_K"][0].bits == 4
    _lone_matmulnbits(*seen["Q4_K"])


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
