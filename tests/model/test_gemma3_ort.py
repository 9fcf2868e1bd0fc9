"""The ONNX Runtime graph of Gemma 3 (``gemma3``) on the real Gemma 3 270M, against the numpy
reference.

Gemma 3's graph adds to LLaMA's: the embedding scale ``sqrt(d)`` (a float32 ``Mul``), q/k norms
(``SimplifiedLayerNormalization`` per head, the power-of-two attention scale 1/16 folded into the
q norm's weights), post-attention and post-FFW norms, GeGLU (``Gelu`` approximate="tanh"), NEOX
rope, and sliding-window attention on the local layers (GroupQueryAttention
``local_window_size=512``: measured on onnxruntime 1.24, a window of ``w`` covers the ``w`` keys
``p - w + 1 .. p``, the reference's ``p - key < window``) with their own rotary caches (base
10000).

Gemma's Q4_K / Q6_K matrices are requantized to 8-bit blocks by ``pack_weight`` (the graph's
only inexact weights), so the float graph (``accuracy_level=0``) is compared with a reference
that reads those same requantized matrices: the two then compute the same model and differ only
by summation order (measured max |diff| 1.2e-4 on a short prompt, 7e-5 past the window; logits
span about -26..+26). Against the unmodified reference (exact K-quants) the requantization alone
moves the logits by up to ~2 (same argmax).
"""

from __future__ import annotations

import numpy as np
import pytest
from batching import assert_rows_batch_invariant
from hf_math import MIN_MARGIN, QUESTION, greedy_margins, mean_kl, mean_nll, paragraph_ids

from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.backend import SeqChunk
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.onnx.graph_options import GraphOptions
from tiny_mindie.model.onnx.weights import PACKERS, quantize_8bit, unpack_nbits
from tiny_mindie.model.options import BackendOptions
from tiny_mindie.model.ort.ort_backend import OrtBackend
from tiny_mindie.model.reference.decoder import NumpyBackend
from tiny_mindie.model.tokenizer_load import load_tokenizer

MAX_SEQ_LEN = 768
LONG = 700                 # > 512: the local layers' window is active
ATOL_FLOAT = 1e-3          # float graph vs reference on the same weights (measured <= 1.2e-4)


class RequantizedGGUF(GGUFFile):
    """The GGUF as the graph sees it: matrices of types ``pack_weight`` cannot express exactly
    (none in Gemma 3 270M Q4_K_M since Q4_K and Q6_K are packed exactly) dequantize to their
    8-bit requantization."""

    def dequantize(self, name):
        raw = self.raw(name)
        if len(raw.shape) == 2 and raw.qtype not in PACKERS:
            return unpack_nbits(quantize_8bit(GGUFFile.dequantize(self, name)))
        return GGUFFile.dequantize(self, name)

    def dequantize_rows(self, name, start, end):
        if self.raw(name).qtype not in PACKERS:
            return self.dequantize(name)[start:end]
        return GGUFFile.dequantize_rows(self, name, start, end)


@pytest.fixture(scope="module")
def path(gemma_path) -> str:
    return gemma_path


@pytest.fixture(scope="module")
def gguf(path) -> GGUFFile:
    return GGUFFile(path)


@pytest.fixture(scope="module")
def config(gguf) -> ModelConfig:
    return ModelConfig.from_gguf(gguf)


@pytest.fixture(scope="module")
def reference(path, config) -> NumpyBackend:
    return NumpyBackend(RequantizedGGUF(path), config, num_slots=2, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def ort_float(gguf, config, tmp_path_factory) -> OrtBackend:
    be = OrtBackend(gguf, config, BackendOptions(threads=2), num_slots=2, max_seq_len=MAX_SEQ_LEN,
                    cache_dir=str(tmp_path_factory.mktemp("onnx-cache")),
                    graph_options=GraphOptions(accuracy_level=0, lm_head_accuracy_level=0,
                                               lm_head_block=32, max_positions=1024))
    yield be
    be.close()


@pytest.fixture(scope="module")
def ort(gguf, config) -> OrtBackend:
    """The default backend (int8 activations, graph cached next to the model)."""
    be = OrtBackend(gguf, config, BackendOptions(threads=2, parallel_runs=1), num_slots=3,
                    max_seq_len=MAX_SEQ_LEN)
    yield be
    be.close()


def _prefill_and_decode(be, prompt: np.ndarray, follow: list[int]) -> np.ndarray:
    out = [be.forward([SeqChunk(0, 0, prompt)])[0]]
    for j, tok in enumerate(follow):
        out.append(be.forward([SeqChunk(0, len(prompt) + j, np.array([tok]))])[0])
    return np.array(out)


@pytest.mark.parametrize("n", [9, LONG])
def test_float_graph_matches_reference(ort_float, reference, n):
    prompt = np.random.default_rng(n).integers(100, 20000, n)
    a = _prefill_and_decode(ort_float, prompt, [5, 1234])
    b = _prefill_and_decode(reference, prompt, [5, 1234])
    assert np.abs(a - b).max() < ATOL_FLOAT, np.abs(a - b).max()
    assert (a.argmax(-1) == b.argmax(-1)).all()


def test_default_graph_answers_paris(ort, gguf):
    tok = load_tokenizer(gguf)
    out, margins = greedy_margins(ort, np.array(tok.encode(QUESTION), dtype=np.int64), 3, slot=1)
    assert tok.decode(out[:1]) == " Paris", tok.decode(out)
    assert margins[0] > MIN_MARGIN, margins           # not borderline: the same on any CPU


def test_default_graph_likelihood_is_the_references(ort, reference, gguf):
    """The default graph trades exactness for speed twice -- int8 activations inside
    MatMulNBits, and the 8-bit LM head requantized to blocks of 128 (``lm_head_weight``) -- and
    the mean NLL of the English paragraph must not notice: within 0.01 nats of the float
    reference's (measured: 2.8702 vs 2.8690 for the head alone), and the mean KL divergence of
    the next-token distributions stays under 0.01 nats (measured 0.0027; requantizing the layer
    matrices to blocks of 128 as well added 0.007 on a 1000-token text, because the kernel
    quantizes the activations per block too)."""
    from tiny_mindie.model.reference.decoder import prefill

    ids = paragraph_ids(load_tokenizer(gguf))
    ref_logits = prefill(reference.weights, reference.cache, 0, 0, ids, all_logits=True)[:-1]
    ort_logits = _prefill_and_decode(ort, ids[:1], list(ids[1:-1]))
    ours, theirs = mean_nll(ort_logits, ids[1:]), mean_nll(ref_logits, ids[1:])
    kl = mean_kl(ref_logits, ort_logits)
    print(f"\nmean NLL: default graph {ours:.4f}, float reference {theirs:.4f} nats/token; "
          f"mean KL {kl:.5f}")
    assert abs(ours - theirs) < 0.01
    assert kl < 0.01


def test_default_graph_gives_a_row_the_same_logits_alone_and_in_any_batch(gguf, config):
    """A seeded request must give the same text alone and beside others, so a row's logits may
    not depend on the batch -- also with the LM head in blocks of 128, whose kernel computes an
    odd last row by another path on some CPUs (the graph pads every matrix product to a
    multiple of 2 or 4 rows; see ``graph_nodes._pad_rows``)."""
    be = OrtBackend(gguf, config, BackendOptions(threads=1, parallel_runs=2), num_slots=5,
                    max_seq_len=64)
    try:
        assert be.rows_per_decode_run == 0
        assert_rows_batch_invariant(be, config.vocab_size, batch_sizes=(1, 2, 3, 4))
    finally:
        be.close()
