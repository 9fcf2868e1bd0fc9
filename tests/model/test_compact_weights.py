"""``--weights compact`` on SmolLM2 itself (tiny_mindie/model/weights.py ``quantize_4bit``,
scripts/footprint.py): every matrix packed in 4-bit blocks, a compact graph that reads
fewer bytes per token than the exact one and than the GGUF, and stays close to the numpy
reference. The packing on synthetic weights and the setting: tests/unit/test_weight_modes.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from script_modules import load_script

from tiny_mindie.model import WEIGHT_MODES
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.onnx.weights import pack_weight as pack
from tiny_mindie.model.onnx.weights import unpack_nbits

footprint = load_script("footprint")


@pytest.fixture(scope="module")
def smollm2(model_path) -> GGUFFile:
    return GGUFFile(model_path)


def test_compact_packs_every_matrix_of_the_model_in_4bit(smollm2):
    w = pack(smollm2, "blk.2.ffn_down.weight", 64)
    assert (w.bits, w.block, w.exact) == (4, 64, False)
    exact = smollm2.dequantize("blk.2.ffn_down.weight")
    # close to the exact weights: within a few percent of their spread
    assert np.sqrt(np.square(unpack_nbits(w) - exact).mean()) < 0.1 * exact.std()


@pytest.fixture(scope="module")
def graphs(smollm2, tmp_path_factory):
    """The exact and the compact graph of SmolLM2 (built cold into a fresh cache)."""
    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.onnx.graph_options import GraphOptions
    from tiny_mindie.model.options import BackendOptions
    from tiny_mindie.model.ort.ort_backend import OrtBackend

    cfg = ModelConfig.from_gguf(smollm2)
    cache = str(tmp_path_factory.mktemp("weight-modes"))
    out = {}
    for mode, block in WEIGHT_MODES.items():
        out[mode] = OrtBackend(smollm2, cfg, BackendOptions(threads=1), num_slots=2,
                               max_seq_len=128, cache_dir=cache,
                               graph_options=GraphOptions(compact=block))
    yield out
    for be in out.values():
        be.close()


def test_the_compact_graph_reads_fewer_bytes_than_the_exact_one_and_than_the_gguf(graphs, smollm2):
    exact, compact = (footprint.graph_weight_bytes(graphs[m].graph_path)
                      for m in ("exact", "compact"))
    gguf = footprint.gguf_weight_bytes(smollm2)
    assert compact.per_token < exact.per_token
    # SmolLM2's Q4_1 is 5 bits a weight and its tied Q8_0 embedding is the LM head: compact
    # blocks of 64 hold 5 bits a weight once prepacked (4 + a float32 scale and block sum)
    assert compact.per_token < gguf.per_token
    assert compact.resident < exact.resident
    # the embedding is a table read by rows: resident, not read per token
    assert exact.resident - exact.per_token > 0.5 * smollm2.raw("token_embd.weight").data.nbytes


def test_the_compact_graph_stays_close_to_the_reference_and_is_batch_invariant(graphs, smollm2):
    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.backend import SeqChunk
    from tiny_mindie.model.reference.decoder import NumpyBackend
    from tiny_mindie.model.tokenizer_load import load_tokenizer

    tok = load_tokenizer(smollm2)
    ids = tok.encode("The history of computing is a story of people who wanted to calculate "
                     "faster than they could by hand. Early mechanical calculators were "
                     "followed by electromechanical machines, then by vacuum tubes.",
                     add_bos=False)
    ref = NumpyBackend(smollm2, ModelConfig.from_gguf(smollm2), num_slots=1, max_seq_len=128)

    def logprobs(be) -> np.ndarray:
        rows = [be.forward([SeqChunk(0, j, np.array([t], np.int64))])[0]
                for j, t in enumerate(ids)]
        x = np.array(rows, np.float64)
        x -= x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p = logprobs(ref)
    kl, top1 = {}, {}
    for mode, be in graphs.items():
        assert be.batch_invariant, mode                  # the start-up check passed
        q = logprobs(be)
        kl[mode] = float((np.exp(p) * (p - q)).sum(-1).mean())
        top1[mode] = float((q.argmax(-1) == p.argmax(-1)).mean())
    # A 135M model loses much to 4-bit blocks (llama.cpp's own Q4_0 of it: KL ~1 nat too; the
    # real-size figures are in docs/design/weights.md); a broken packing (nibbles or zero points
    # misread) scores near chance: KL of several nats, top-1 under 10 %.
    assert kl["exact"] < 0.05 and top1["exact"] >= 0.85
    assert kl["exact"] < kl["compact"] < 2.0 and top1["compact"] >= 0.4
