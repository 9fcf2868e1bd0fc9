"""The ONNX Runtime backend on the real SmolLM2-135M-Instruct weights, against the numpy reference.

Two graphs are checked:

- the *float* graph (``accuracy_level=0`` everywhere): MatMulNBits computes in float32 on the
  exactly-packed GGUF weights, so it is the reference's math with another summation order;
  its logits must match the reference to ``ATOL_FLOAT`` (measured: ~1.5e-4; logits span about
  -25..+30).
- the *default* graph (``accuracy_level=4``): MatMulNBits quantizes each block of 32 activations
  to int8 inside the kernel (what llama.cpp does too), which moves the logits by up to about
  1.0 (measured on these prompts: max |diff| 0.5..1.0, relative RMS 3..15 %; no one matrix kind
  dominates, the rounding compounds over 30 layers; llama.cpp 0.3.36 on the same prompts:
  max |diff| 0.5..0.75, relative 3..5 %). Its tolerance is therefore statistical:
  ``MAX_ABS_INT8`` / ``REL_INT8``, and each side's top token is among the other's top 5.

Greedy decoding must be *identical* (not just close) at batch 1 and batch 4: rows are computed
independently, so batching, padding-free chunking and the slot layout cannot change a token.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from batching import assert_rows_batch_invariant
from hf_math import MIN_MARGIN, greedy_margins
from huge_pages import needs_collapse
from smollm2_prompts import (
    CHAT,
    FOLLOW,
    FRANCE,
    MAX_ABS_INT8,
    REL_INT8,
    SHORT,
    STORY,
    ids_of,
    prefill_and_decode,
)

from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.backend import SeqChunk
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.onnx import graph as graph_mod
from tiny_mindie.model.onnx import graph_cache
from tiny_mindie.model.onnx.graph_options import GraphOptions, cpu_flags
from tiny_mindie.model.options import BackendOptions
from tiny_mindie.model.ort import providers
from tiny_mindie.model.ort.ort_backend import OrtBackend
from tiny_mindie.model.reference.decoder import NumpyBackend
from tiny_mindie.model.registry.catalog import sha256_of

MAX_SEQ_LEN = 256
ATOL_FLOAT = 2e-3        # float graph vs reference (measured ~1.5e-4)
GREEDY_STEPS = 64


@pytest.fixture(scope="module")
def gguf(model_path) -> GGUFFile:
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def config(gguf) -> ModelConfig:
    return ModelConfig.from_gguf(gguf)


@pytest.fixture(scope="module")
def ort(gguf, config) -> OrtBackend:
    """The default backend (graph cached next to the model), 8 slots of 256 positions."""
    be = OrtBackend(gguf, config, BackendOptions(threads=1), num_slots=8,
                    max_seq_len=MAX_SEQ_LEN)
    yield be
    be.close()


@pytest.fixture(scope="module")
def reference(gguf, config) -> NumpyBackend:
    return NumpyBackend(gguf, config, num_slots=4, max_seq_len=MAX_SEQ_LEN)


@pytest.fixture(scope="module")
def float_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("onnx-cache"))


@pytest.fixture(scope="module")
def ort_float(gguf, config, float_cache) -> OrtBackend:
    """The float32-compute graph, built cold into a fresh cache directory."""
    be = OrtBackend(gguf, config, BackendOptions(threads=1), num_slots=4, max_seq_len=MAX_SEQ_LEN,
                    cache_dir=float_cache,
                    graph_options=GraphOptions(accuracy_level=0, lm_head_accuracy_level=0))
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(gguf) -> list[np.ndarray]:
    """Four prompts of different lengths (16, 19, 5, 1 tokens)."""
    return [ids_of(gguf, p) for p in (CHAT, STORY, FRANCE, SHORT)]


# ---- logits parity with the reference ----------------------------------------------------------

def test_float_graph_matches_reference(ort_float, reference, prompts):
    for i, p in enumerate(prompts[:3]):
        a = prefill_and_decode(ort_float, 0, p, FOLLOW[:2])
        b = prefill_and_decode(reference, 0, p, FOLLOW[:2])
        assert np.abs(a - b).max() < ATOL_FLOAT, i
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_default_graph_matches_reference_within_int8_tolerance(ort, reference, prompts):
    for i, p in enumerate(prompts):
        a = prefill_and_decode(ort, 0, p, FOLLOW)
        b = prefill_and_decode(reference, 0, p, FOLLOW)
        for row_a, row_b in zip(a, b, strict=True):
            assert np.abs(row_a - row_b).max() < MAX_ABS_INT8, i
            rel = np.linalg.norm(row_a - row_b) / np.linalg.norm(row_b - row_b.mean())
            assert rel < REL_INT8, (i, rel)
            assert row_b.argmax() in np.argsort(row_a)[-5:]
            assert row_a.argmax() in np.argsort(row_b)[-5:]


def test_default_graph_answers_the_question(ort, gguf, prompts):
    """Greedy answer to the chat prompt starts with "The capital of France is Paris", each token
    far enough ahead of the runner-up to be the same on any CPU."""
    vocab = gguf.get("tokenizer.ggml.tokens")
    toks, margins = greedy_margins(ort, prompts[0], 6, slot=3)
    assert "".join(vocab[t] for t in toks).replace("Ġ", " ") == "The capital of France is Paris"
    assert min(margins) > MIN_MARGIN, margins


# ---- greedy decoding: batch 1 == batch 4 ------------------------------------------------------

def _greedy_single(be, slot, prompt, steps):
    tok = int(be.forward([SeqChunk(slot, 0, prompt)])[0].argmax())
    toks = [tok]
    for j in range(steps - 1):
        tok = int(be.forward([SeqChunk(slot, len(prompt) + j, np.array([tok]))])[0].argmax())
        toks.append(tok)
    return toks


def test_greedy_identical_at_batch_1_and_batch_4(ort, prompts):
    single = [_greedy_single(ort, 0, p, GREEDY_STEPS) for p in prompts]
    # batch 4 on scattered slots (forces the backend to regroup its KV rows), prompts of
    # 16/19/5/1 tokens, the 1-token prompt prefilled in the same call as a decode row
    slots = [6, 1, 3, 0]
    toks = [[] for _ in prompts]
    logits = ort.forward([SeqChunk(slots[i], 0, p) for i, p in enumerate(prompts[:3])])
    for i in range(3):
        toks[i].append(int(logits[i].argmax()))
    logits = ort.forward([SeqChunk(slots[0], len(prompts[0]), np.array([toks[0][0]])),
                          SeqChunk(slots[3], 0, prompts[3])])
    toks[3].append(int(logits[1].argmax()))
    pos = [len(prompts[0]) + 1, len(prompts[1]), len(prompts[2]), len(prompts[3])]
    extra0 = int(logits[0].argmax())
    toks[0].append(extra0)
    while min(len(t) for t in toks) < GREEDY_STEPS:
        live = [i for i in range(4) if len(toks[i]) < GREEDY_STEPS]
        chunks = [SeqChunk(slots[i], pos[i], np.array([toks[i][-1]])) for i in live]
        logits = ort.forward(chunks)
        for row, i in enumerate(live):
            toks[i].append(int(logits[row].argmax()))
            pos[i] += 1
    for i in range(4):
        assert toks[i] == single[i], i
    assert ort.kv.swaps > 0        # the scattered slots really were regrouped


@pytest.mark.parametrize("threads, runs", [(1, 1), (1, 2), (2, 1)])
def test_a_row_gets_the_same_logits_alone_and_in_any_batch(gguf, config, threads, runs):
    """Batches of 1, 2, 3, 4 and 8 rows, as one session run, split into two runs at once, or
    run by two intra-op threads: every row's logits are bit for bit its logits alone -- by the
    graph itself (rows padded to a multiple of 2 or 4), not by the start-up check's fallback."""
    be = OrtBackend(gguf, config, BackendOptions(threads=threads, parallel_runs=runs),
                    num_slots=9, max_seq_len=64)
    try:
        assert be.rows_per_decode_run == 0 and be.parallel_runs == runs
        assert_rows_batch_invariant(be, config.vocab_size)
    finally:
        be.close()


def test_a_row_gets_the_same_logits_whatever_the_intra_op_thread_count(gguf, config):
    """One and two intra-op threads (``--threads``) give bit for bit the same logits, for
    prompts and for decode rows alone and in a batch of four: the kernels split the work over
    threads by output columns and heads, not along a sum, so a row's arithmetic does not
    depend on the thread count (if it did, an answer would change with ``--threads``)."""
    prompts = [(np.arange(6 + 3 * s) * 37 + 11 * s) % config.vocab_size for s in range(4)]
    tokens = [np.array([(5 + 101 * s) % config.vocab_size]) for s in range(4)]

    def logits(threads: int) -> list[np.ndarray]:
        be = OrtBackend(gguf, config, BackendOptions(threads=threads, parallel_runs=1,
                                                     batch_invariant=False),
                        num_slots=4, max_seq_len=64)
        try:
            out = [be.forward([SeqChunk(s, 0, p)]) for s, p in enumerate(prompts)]
            out.append(be.forward([SeqChunk(0, len(prompts[0]), tokens[0])]))     # alone
            out.append(be.forward([SeqChunk(s, len(p) + (s == 0), tokens[s])      # batch of 4
                                   for s, p in enumerate(prompts)]))
            return out
        finally:
            be.close()

    one, two = logits(1), logits(2)
    for k, (a, b) in enumerate(zip(one, two, strict=True)):
        assert np.array_equal(a, b), f"forward call {k}: max |diff| {np.abs(a - b).max():.3g}"


def test_a_graph_whose_rows_depend_on_the_batch_is_caught_and_run_row_by_row(gguf, config,
                                                                            tmp_path):
    """Without the row padding, a one-row session run takes another kernel on AVX2 (MLAS's
    4-bit GEMV for M = 1): the start-up check sees it and decode rows then run one per session
    run, which keeps every row's logits the same alone and in a batch. (On CPUs whose kernels
    do not depend on M the check passes and nothing changes: the rows are still the same.)"""
    be = OrtBackend(gguf, config, BackendOptions(threads=1), num_slots=9, max_seq_len=64,
                    cache_dir=str(tmp_path), graph_options=GraphOptions(row_multiples=()))
    try:
        flags = cpu_flags()
        if "avx2" in flags and "avx512bw" not in flags:
            assert be.rows_per_decode_run == 1
        assert_rows_batch_invariant(be, config.vocab_size)
    finally:
        be.close()


def test_batch_invariance_can_be_turned_off(model_path):
    """``batchInvariant: false`` (for a lone stream's speed): no padded products, no start-up
    check, and the backend says its rows are not batch-invariant."""
    import onnx

    from tiny_mindie.model.loader import load_model

    *_, be = load_model(model_path, BackendOptions(threads=1, batch_invariant=False,
                                                   kernels="onnxruntime", speculation=False),
                        num_slots=2, max_seq_len=64)
    try:
        assert be.batch_invariant is False and "batch check" not in be.load_seconds
        m = onnx.load(be.graph_path, load_external_data=False)
        assert not any(n.op_type == "Pad" for n in m.graph.node)
    finally:
        be.close()
    *_, be = load_model(model_path, BackendOptions(threads=1, kernels="onnxruntime",
                                                   speculation=False),
                        num_slots=2, max_seq_len=64)
    try:
        assert be.batch_invariant is True and "batch check" in be.load_seconds
    finally:
        be.close()


class _RunSpy:
    """Calls the real session and records which thread ran each call, and when."""

    def __init__(self, session):
        self.session, self.calls = session, []

    def run_with_iobinding(self, binding):
        import threading
        import time
        t0 = time.perf_counter()
        self.session.run_with_iobinding(binding)
        self.calls.append((threading.current_thread().name, t0, time.perf_counter()))

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_parallel_runs_give_the_tokens_of_single_runs(gguf, config, prompts):
    """Three runs at once (decode rows split into groups, prompts prefilled beside decode rows
    and beside each other) decode greedily exactly as every sequence alone, and the runs
    really overlap in time on different threads."""
    be = OrtBackend(gguf, config, BackendOptions(threads=1, parallel_runs=3), num_slots=8,
                    max_seq_len=MAX_SEQ_LEN)
    try:
        single = [_greedy_single(be, 0, p, 24) for p in prompts]
        spy = be.shapes.session = _RunSpy(be.shapes.session)
        slots = [5, 2, 7, 4]
        toks = [[] for _ in prompts]
        logits = be.forward([SeqChunk(slots[i], 0, p) for i, p in enumerate(prompts[:3])])
        for i in range(3):
            toks[i].append(int(logits[i].argmax()))
        pos = [len(p) for p in prompts]
        for step in range(40):
            live = [i for i in range(4) if toks[i] and len(toks[i]) < 24]
            chunks = [SeqChunk(slots[i], pos[i], np.array([toks[i][-1]])) for i in live]
            if step == 3:                               # a prompt arrives mid-stream
                chunks.append(SeqChunk(slots[3], 0, prompts[3]))
            if not chunks:
                break
            logits = be.forward(chunks)
            for row, i in enumerate(live):
                toks[i].append(int(logits[row].argmax()))
                pos[i] += 1
            if step == 3:
                toks[3].append(int(logits[-1].argmax()))
        assert toks == single
        assert len({name for name, _, _ in spy.calls}) >= 2
        calls = sorted(spy.calls, key=lambda c: c[1])
        # some runs overlapped
        assert any(b[1] < a[2] for a, b in zip(calls, calls[1:], strict=False))
    finally:
        be.close()


def test_parallel_runs_default_to_cores_per_thread_count(ort):
    assert ort.parallel_runs == max(1, len(os.sched_getaffinity(0)) // ort.threads)


def _chunked_vs_whole(be, slot, p):
    whole = be.forward([SeqChunk(slot, 0, p)])[0]
    be.forward([SeqChunk(slot, 0, p[:20])])
    be.forward([SeqChunk(slot, 20, p[20:21])])
    part = be.forward([SeqChunk(slot, 21, p[21:])])[0]
    return whole, part


def test_chunked_prefill_equals_whole_prefill(ort, ort_float, prompts):
    """Prefill in pieces (20 + 1 + 32 tokens) gives the logits of one whole-prompt prefill:
    to float rounding on the float graph; on the default graph within the int8 tolerance (a
    rounding-level change can flip an int8 activation step, which then propagates)."""
    p = np.concatenate([prompts[1], prompts[0], prompts[1]])          # 54 tokens
    whole, part = _chunked_vs_whole(ort_float, 2, p)
    assert np.abs(whole - part).max() < 1e-3
    ort_float.max_chunk_tokens = 16          # the backend's own splitting of long chunks
    try:
        pieces = ort_float.forward([SeqChunk(2, 0, p)])[0]
    finally:
        ort_float.max_chunk_tokens = 256
    assert np.abs(whole - pieces).max() < 1e-3
    whole, part = _chunked_vs_whole(ort, 2, p)
    assert np.abs(whole - part).max() < MAX_ABS_INT8
    assert whole.argmax() == part.argmax()


def test_reused_slot_forgets_the_old_sequence(ort, prompts):
    """A shorter sequence started in a slot that held a longer one sees none of the old keys."""
    fresh = ort.forward([SeqChunk(5, 0, prompts[2])])[0]
    ort.forward([SeqChunk(5, 0, np.concatenate([prompts[1], prompts[1]]))])
    again = ort.forward([SeqChunk(5, 0, prompts[2])])[0]
    assert np.array_equal(fresh, again)


def test_forward_rejects_bad_chunks(ort):
    with pytest.raises(ValueError):
        ort.forward([SeqChunk(8, 0, np.array([1]))])
    with pytest.raises(ValueError):
        ort.forward([SeqChunk(0, MAX_SEQ_LEN, np.array([1]))])
    with pytest.raises(ValueError):
        ort.forward([SeqChunk(0, 0, np.array([49152]))])


# ---- providers, cache, start-up ---------------------------------------------------------------

def test_backend_reports_its_provider(ort):
    assert ort.name == "onnxruntime"
    if not providers.ascend_available():
        assert ort.device == "CPU" and ort.providers == ["CPUExecutionProvider"]


def test_start_up_prints_nothing(model_path, ort):
    """A fresh process loading the (cached) graph writes nothing to stdout or stderr."""
    code = ("import sys; from tiny_mindie.model.gguf import GGUFFile;"
            "from tiny_mindie.model.arch import ModelConfig;"
            "from tiny_mindie.model.ort.ort_backend import OrtBackend;"
            "import numpy as np; from tiny_mindie.model.backend import SeqChunk;"
            "f = GGUFFile(sys.argv[1]); b = OrtBackend(f, ModelConfig.from_gguf(f), num_slots=1,"
            " max_seq_len=16); b.forward([SeqChunk(0, 0, np.array([1, 2]))])")
    proc = subprocess.run([sys.executable, "-c", code, model_path], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_graph_cache_warm_start(gguf, config, float_cache, ort_float):
    """The float graph was built cold into ``float_cache``; a second backend loads it."""
    assert ort_float.built
    again = OrtBackend(gguf, config, BackendOptions(threads=1), num_slots=1, max_seq_len=16,
                       cache_dir=float_cache,
                       graph_options=GraphOptions(accuracy_level=0, lm_head_accuracy_level=0))
    assert not again.built and again.graph_path == ort_float.graph_path
    entry = os.path.basename(os.path.dirname(again.graph_path))
    assert f"-b{graph_mod.BUILDER_VERSION}-" in entry
    again.close()


def test_building_a_graph_removes_older_builders_graphs_of_the_model(model_path, tmp_path):
    """A builder version bump would leave the old graphs (1.5x the GGUF each) in the cache
    forever; the new build removes the model's graphs of older builders, whatever options they
    were built with and whatever name the file had, and keeps the current builder's graphs with
    other options and other models' graphs."""
    gguf = GGUFFile(model_path)
    config = ModelConfig.from_gguf(gguf)
    key = GraphOptions().key()
    digest = sha256_of(gguf.path)[:16]
    stem = os.path.splitext(os.path.basename(gguf.path))[0]
    version = graph_mod.BUILDER_VERSION
    old = tmp_path / f"{stem}-{digest}-b{version - 1}-{key}"
    old_options = tmp_path / f"{stem}-{digest}-b{version - 1}-a4-h4-p0"    # an older key format
    other_options = tmp_path / f"{stem}-{digest}-b{version}-a0-h0-l32-p0"
    other_model = tmp_path / f"other-{'0' * 16}-b{version - 1}-{key}"
    renamed = tmp_path / f"renamed-{digest}-b{version - 1}-{key}"        # this file, another name
    for d in (old, old_options, other_options, other_model, renamed):
        d.mkdir()
        (d / "complete").write_text("")
    path, built = graph_cache.cached_graph(gguf, config, GraphOptions(), str(tmp_path))
    assert built and os.path.isfile(path)
    assert not old.exists() and not old_options.exists() and not renamed.exists()
    assert other_options.exists() and other_model.exists()
    old.mkdir()                     # left by an older version that ran after this one built
    again, built = graph_cache.cached_graph(gguf, config, GraphOptions(), str(tmp_path))
    assert again == path and not built and not old.exists() and other_options.exists()


def test_graph_is_ir10_with_contrib_ops(ort):
    import onnx

    m = onnx.load(ort.graph_path, load_external_data=False)
    assert m.ir_version <= 10
    assert {o.domain: o.version for o in m.opset_import} == {"": 21, "com.microsoft": 1}
    ops = {n.op_type for n in m.graph.node}
    assert {"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization",
            "SimplifiedLayerNormalization", "GatherBlockQuantized"} <= ops
    assert all(n.domain == "" for n in m.graph.node if n.op_type == "SimplifiedLayerNormalization")
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    scale = next(a.f for a in gqa[0].attribute if a.name == "scale")
    assert scale == 1.0                       # 1/sqrt(64) = 1/8 is folded into Wq
    meta = {p.key: p.value for p in m.metadata_props}      # the 8-bit head's row multiple
    head = next(n for n in m.graph.node if n.op_type == "MatMulNBits" and "lm_head" in n.name)
    head_block = next(a.i for a in head.attribute if a.name == "block_size")
    assert head_block == 32                  # 576 inputs: no blocks of 128 (lm_head_weight)
    assert meta[graph_mod.LOGITS_ROWS_KEY] == str(GraphOptions().row_multiple(8, head_block)) \
        == str(ort.shapes.logits_row_multiple)
    pads = sum(n.op_type == "Pad" for n in m.graph.node)   # 4-bit blocks of 32: Q4_1 matrices
    assert pads == (4 * 30 if GraphOptions().row_multiple(4, 32) > 1 else 0) + \
        (GraphOptions().row_multiple(8, head_block) > 1)


@needs_collapse
def test_the_sessions_prepacked_weights_sit_on_huge_pages(ort):
    """SmolLM2-135M's prepacked weights are ~130 MB: most of it is moved to huge pages when the
    backend is loaded (measured 116-140 MiB), also when the graph was just built in this
    process (whose freed memory the session's allocations reuse)."""
    assert ort.huge_page_bytes >= 80 * 10**6
