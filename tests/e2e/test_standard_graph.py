"""The standard graph (``--graph standard``): default-domain ONNX operators only, on the operator
list the CANN execution provider's graph mode and Ascend's ONNX parser document
(:mod:`tiny_mindie.model.onnx.cann_ops`), with static shapes; float16 weights, KV cache and products
by default, whose next-token distributions on the CPU provider stay within
:data:`~tiny_mindie.cli.check_graph.KL_TOLERANCE` of the numpy reference's; the float32
graph's greedy tokens are the reference's and its logits within
:data:`~tiny_mindie.cli.check_graph.LOGITS_TOLERANCE` of them; the server's features work on it.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
from helpers import TEST_CONFIG, request, serving, start_server

from tiny_mindie.cli.check_graph import KL_TOLERANCE, LOGITS_TOLERANCE, PROMPTS, greedy_compare
from tiny_mindie.model.onnx import cann_ops
from tiny_mindie.model.ort.shapes import bucket, buckets

# ---- unit ------------------------------------------------------------------------------------


def test_static_sizes_are_few_and_cover_every_value():
    assert buckets(1, 2, 8) == (1, 2, 4, 8)
    assert buckets(1, 2, 6) == (1, 2, 4, 6)
    assert buckets(8, 4, 256) == (8, 32, 128, 256)
    assert buckets(256, 2, 2561) == (256, 512, 1024, 2048, 2561)
    assert buckets(256, 2, 81) == (81,)
    sizes = buckets(8, 4, 256)
    assert [bucket(v, sizes) for v in (1, 8, 9, 33, 200, 256)] == [8, 8, 32, 128, 256, 256]
    with pytest.raises(ValueError, match="257 is more than the largest static size 256"):
        bucket(257, sizes)


def test_the_dtypes_are_the_settings():
    from tiny_mindie.model import STANDARD_DTYPES
    from tiny_mindie.model.onnx.graph_standard import DTYPES
    from tiny_mindie.model.options import SessionTuning
    from tiny_mindie.model.ort.shapes import MAX_CHUNK_TOKENS

    assert tuple(DTYPES) == STANDARD_DTYPES
    assert SessionTuning().max_chunk_tokens == MAX_CHUNK_TOKENS


# ---- model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["model_path", "gemma_path"])
def test_row_pieces_dequantize_as_the_whole_matrix(which, request):
    """GGUFFile.dequantize_rows (gguf's block function on rows at once) and the reference's
    [in, out] matrices built from row pieces: the values of dequantize, bit for bit, and in
    float16 the float32 values rounded (Q4_1, Q8_0, Q4_K, Q6_K, F32 between the two files)."""
    from tiny_mindie.model.arch import ModelConfig
    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.reference.decoder import load_layer, xw_matrix

    f = GGUFFile(request.getfixturevalue(which))
    seen = set()
    for name in f.tensor_names():
        raw = f.raw(name)
        if len(raw.shape) != 2 or raw.qtype in seen:
            continue
        seen.add(raw.qtype)
        whole = f.dequantize(name)
        n = raw.shape[0]
        assert np.array_equal(f.dequantize_rows(name, 1, min(n, 300)), whole[1:300]), name
        assert np.array_equal(xw_matrix(f, name), whole.T), name
        assert np.array_equal(xw_matrix(f, name, dtype=np.float16), whole.T.astype(np.float16))
    assert len(seen) >= 2, seen
    cfg = ModelConfig.from_gguf(f)
    a, b = load_layer(f, cfg, 1), load_layer(f, cfg, 1, np.float16)
    assert b.w_qkv.dtype == np.float16 and b.attn_norm.dtype == np.float32
    assert np.array_equal(a.w_gate_up.astype(np.float16), b.w_gate_up)


def _load(path, graph, **kw):
    from tiny_mindie.model.loader import load_model
    from tiny_mindie.model.options import BackendOptions

    size = {k: kw.pop(k) for k in ("num_slots", "max_seq_len") if k in kw}
    options = {"graph": graph, "kernels": "onnxruntime", "speculation": False, **kw}
    return load_model(path, BackendOptions(**options), **size)


@pytest.fixture(scope="module")
def smollm_standard(model_path):
    """The default standard graph (float16)."""
    f, cfg, tok, be = _load(model_path, "standard", num_slots=4, max_seq_len=512,
                            speculation=True)
    yield f, cfg, tok, be
    be.close()


@pytest.fixture(scope="module")
def smollm_exact(model_path):
    """The float32 standard graph (``--standard-dtype float32``)."""
    f, cfg, tok, be = _load(model_path, "standard", num_slots=4, max_seq_len=512,
                            speculation=True, standard_dtype="float32")
    yield f, cfg, tok, be
    be.close()


@pytest.mark.parametrize("which", ["smollm_standard", "smollm_exact"])
def test_the_standard_graph_is_default_domain_on_the_cann_list(which, request):
    import onnx

    _, _, _, be = request.getfixturevalue(which)
    model = onnx.load(be.graph_path, load_external_data=False)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.ir_version == 8
    assert {n.domain for n in model.graph.node} == {""}
    assert "GroupQueryAttention" not in {n.op_type for n in model.graph.node}
    assert cann_ops.check_model(model) == []
    placed = cann_ops.placement_in_graph_mode(model)
    assert placed["left"] == 0, placed
    assert be.graph == "standard" and be.providers == ["CPUExecutionProvider"]
    kinds = {k.op_type: k for k in cann_ops.dtype_report(model)}
    assert all(k.accepted for k in kinds.values()), kinds
    half = which == "smollm_standard"
    assert kinds["MatMul"].types == (("float16",) if half else ("float",))
    assert kinds["MatMul"].narrowed is not half       # float32: computed in float16 on the NPU
    assert ("Cast" in kinds) is half and kinds["Softmax"].types == ("float",)


def test_the_float16_graph_holds_float16_matrices_and_kv(smollm_standard, smollm_exact):
    """Matrices and the KV cache in float16, norms and rotary tables in float32; the cache entry
    within 1.1x the weights' float16 size, about half the float32 graph's."""
    import onnx

    f, _, _, be = smollm_standard
    model = onnx.load(be.graph_path, load_external_data=False)
    types = {t.name: (onnx.TensorProto.DataType.Name(t.data_type), len(t.dims))
             for t in model.graph.initializer}
    assert types["token_embd"] == ("FLOAT16", 2) and types["blk.0.ffn_down"] == ("FLOAT16", 2)
    assert types["blk.0.attn_norm"] == ("FLOAT", 1) and types["rope.cos"][0] == "FLOAT"
    assert {t for t, n in types.values() if n == 2 and t != "FLOAT"} == {"FLOAT16"}
    kv = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert kv["past_key.0"] == onnx.TensorProto.FLOAT16
    assert be.kv.dtype == np.float16 and be.kv.k[0].dtype == np.float16
    assert be.shapes.dtype == "float16" and be.kernels == "onnxruntime MatMul (float16)"
    values, _ = f.tensor_totals()

    def entry(b):
        folder = os.path.dirname(b.graph_path)
        return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))
    assert entry(be) <= 1.1 * 2 * values
    assert entry(smollm_exact[3]) > 1.9 * entry(be)
    assert be.graph_path.split(os.sep)[-2].endswith("-float16")


def test_a_contrib_graph_fails_the_list(model_path):
    import onnx

    _, _, _, be = _load(model_path, "contrib", num_slots=1, max_seq_len=64)
    try:
        problems = cann_ops.check_model(onnx.load(be.graph_path, load_external_data=False))
    finally:
        be.close()
    assert any("MatMulNBits" in p for p in problems), problems[:5]


def test_compact_weights_where_auto_picks_the_standard_graph_are_refused(model_path,
                                                                         monkeypatch):
    from tiny_mindie.model.gguf import ModelFileError
    from tiny_mindie.model.ort import providers

    monkeypatch.setattr(providers, "ascend_available", lambda: True)    # an Ascend machine
    with pytest.raises(ModelFileError, match="weights 'compact' need the contrib graph"):
        _load(model_path, "auto", weights="compact", num_slots=1, max_seq_len=64,
              providers=[("CANNExecutionProvider", {}), "CPUExecutionProvider"])


def test_runs_use_the_static_shapes_only(smollm_standard):
    _, _, _, be = smollm_standard
    assert be.shapes.decode_batches == (1, 2, 4) and be.shapes.chunk_lengths == (8, 32, 128, 256)
    assert be.shapes.spans == (256, 512) and be.kv.cache_len == be.max_seq_len + 1
    assert be.static_shapes() == (3 + 4 + 1) * 2


def _reference(path, max_seq_len=512, num_slots=10):
    return _load(path, "auto", backend="numpy", num_slots=num_slots, max_seq_len=max_seq_len)[3]


def test_greedy_tokens_are_the_references_on_smollm2(smollm_exact, model_path):
    _, _, tok, be = smollm_exact
    ref = _reference(model_path)
    try:
        results = greedy_compare(be, ref, tok, PROMPTS, 32)
    finally:
        ref.close()
    assert [r.prompt for r in results if not r.same] == []
    assert max(r.max_diff for r in results) <= LOGITS_TOLERANCE
    assert max(r.max_diff for r in results) > 0        # another graph, not the reference itself


def test_float16_distributions_are_close_to_the_references_on_smollm2(smollm_standard,
                                                                       model_path):
    """Greedy texts compared, not required identical: every prompt's mean KL within
    KL_TOLERANCE; the logits differ by more than the float32 graph's tolerance (float16
    weights), so the check is not the float32 graph's."""
    _, _, tok, be = smollm_standard
    ref = _reference(model_path)
    try:
        results = greedy_compare(be, ref, tok, PROMPTS, 32)
    finally:
        ref.close()
    assert max(r.kl for r in results) <= KL_TOLERANCE, [(r.prompt, r.kl) for r in results]
    assert max(r.max_diff for r in results) > LOGITS_TOLERANCE
    assert sum(r.same for r in results) >= len(PROMPTS) // 2     # most texts are the same


def test_the_start_up_checks_ran_on_the_standard_graph(smollm_standard):
    """The batch, prefix-split and verification checks ran; whatever they found, a decode row
    in a batch and a verification are then computed as the answers need (checked below)."""
    _, _, _, be = smollm_standard
    assert be.max_verify_rows == 5
    assert isinstance(be.fast_verify, bool) and isinstance(be.prefix_split_invariant, bool)
    assert be.rows_per_decode_run in (0, 1)
    assert {"batch check", "split check"} <= set(be.load_seconds)


def test_verification_rows_are_decodings_where_the_check_says_so(smollm_standard):
    from tiny_mindie.model.backend import SeqChunk

    _, _, tok, be = smollm_standard
    ids = np.array(tok.encode("Edge devices have little memory, so small models"), np.int64)
    be.forward([SeqChunk(1, 0, ids[:-5])])
    steps = np.stack([be.forward([SeqChunk(1, len(ids) - 5 + k, ids[-5 + k:][:1])])[0]
                      for k in range(5)])
    rows = be.verify(1, len(ids) - 5, ids[-5:])
    if be.fast_verify:
        assert np.array_equal(rows, steps)
    else:       # verification runs the decode steps then
        assert np.array_equal(rows, steps)


@pytest.fixture(scope="module")
def llm_standard(model_path):
    from tiny_mindie.llm import LLM

    llm = LLM(model_path, graph="standard", max_seq_len=512, max_input_len=400, num_slots=4,
              log=None)
    yield llm
    llm.close()


def _answers(llm, prompts, concurrent: bool, **params):
    async def one(p):
        c = await llm.generate_async(llm.make_request(p, **params))
        return tuple(c.token_ids), c.finish_reason, c.cached_tokens

    async def all_at_once():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(all_at_once()) if concurrent else [asyncio.run(one(p)) for p in prompts]


def test_batched_answers_are_the_lone_answers(llm_standard):
    prompts = list(PROMPTS[:4])
    for params in (dict(do_sample=False), dict(do_sample=True, temperature=0.8, seed=3)):
        alone = _answers(llm_standard, prompts, False, max_new_tokens=24, ignore_eos=True,
                         **params)
        together = _answers(llm_standard, prompts, True, max_new_tokens=24, ignore_eos=True,
                            **params)
        assert [a[:2] for a in alone] == [t[:2] for t in together]


def test_the_prefix_cache_serves_a_repeated_prompt_with_the_same_answer(llm_standard):
    prompt = "A long shared system prompt about edge inference servers and their users. " * 4
    first = _answers(llm_standard, [prompt + "First question?"], False, max_new_tokens=12)[0]
    second = _answers(llm_standard, [prompt + "First question?"], False, max_new_tokens=12)[0]
    assert second[2] > 40 and first[:2] == second[:2]


def test_speculation_keeps_the_answer_on_the_standard_graph(llm_standard):
    text = ("Edge devices have little memory, so small quantized models are a good fit for "
            "them, and a server that speaks the same API saves rewriting every client.")
    prompts = [f"Text:\n{text}\n\nThe same text again:\n{text[:k]}" for k in (0, 30)]
    before = llm_standard.engine.counters.snapshot()
    llm_standard.engine.speculation = True
    on = _answers(llm_standard, prompts, False, max_new_tokens=30)
    after = llm_standard.engine.counters.snapshot()
    llm_standard.engine.speculation = False
    try:
        off = _answers(llm_standard, prompts, False, max_new_tokens=30)
    finally:
        llm_standard.engine.speculation = True
    assert [a[:2] for a in on] == [a[:2] for a in off]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    if llm_standard.backend.fast_verify:
        assert accepted > 10, accepted
    else:
        assert accepted == 0


def test_constrained_decoding_follows_its_schema(llm_standard):
    import jsonschema

    from tiny_mindie.engine.request import Constraint

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    c = llm_standard.generate("Describe a person as JSON:", max_new_tokens=60,
                              constraint=Constraint("json_schema", json.dumps(schema)))
    jsonschema.validate(json.loads(c.text), schema)


def test_the_greedy_check_command_passes(model_path, capsys):
    from tiny_mindie.cli.main import main

    assert main(["check-graph", "--model", model_path, "--prompts", "2", "--tokens", "8",
                 "--max-seq-len", "300", "--slots", "3"]) == 0
    out = capsys.readouterr().out
    assert "graph      standard, on CPUExecutionProvider" in out
    assert "kernels    onnxruntime MatMul (float16)" in out
    assert "memory     " in out and "(float16 graph), KV cache" in out
    assert "dtypes     MatMul x" in out and ": float16: on the CANN list\n" in out
    assert "dtypes     Softmax x" in out and "NOT on the CANN list" not in out
    assert "shapes     16 sets of input shapes, each run once" in out      # (3 + 4 + 1) x 2
    assert "placement  CPU " in out and "check-graph: passed (2 prompts x 8" in out
    assert f"mean KL within {KL_TOLERANCE:g} per prompt" in out
    assert main(["check-graph", "--model", model_path, "--prompts", "2", "--tokens", "8",
                 "--max-seq-len", "300", "--slots", "3", "--standard-dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "float16 by the precision mode" in out          # MatMul's float32 inputs
    assert f"same tokens, logits within {LOGITS_TOLERANCE:g})" in out
    assert main(["check-graph", "--model", model_path, "--tokens", "400", "--max-seq-len",
                 "300"]) == 2
    assert "--tokens 400 does not fit" in capsys.readouterr().err
    assert main(["check-graph", "--model", model_path, "--graph", "contrib",
                 "--standard-dtype", "float32"]) == 2
    assert "--graph contrib builds none" in capsys.readouterr().err


def test_warm_up_runs_every_shape_and_writes_only_the_scratch_position(smollm_standard):
    _, _, _, be = smollm_standard
    bufs = be.kv.k + be.kv.v
    rng = np.random.default_rng(0)
    for buf in bufs:
        buf[:, :, :be.max_seq_len] = rng.standard_normal(buf[:, :, :be.max_seq_len].shape)
    before = [buf[:, :, :be.max_seq_len].copy() for buf in bufs]
    scratch = [buf[:, :, be.max_seq_len].copy() for buf in bufs]
    assert be.warm_up() == be.static_shapes()
    n = be.max_seq_len
    assert all(np.array_equal(a, b[:, :, :n]) for a, b in zip(before, bufs, strict=True))
    assert not all(np.array_equal(a, b[:, :, n]) for a, b in zip(scratch, bufs, strict=True))


def _agrees(results, dtype: str, tok) -> None:
    """float32: the reference's tokens, logits within LOGITS_TOLERANCE; float16: every
    prompt's mean KL within KL_TOLERANCE (greedy texts may part at a near tie)."""
    if dtype == "float32":
        assert [(r.prompt, tok.decode(r.tokens), tok.decode(r.reference))
                for r in results if not r.same] == []
        assert max(r.max_diff for r in results) <= LOGITS_TOLERANCE
    else:
        assert max(r.kl for r in results) <= KL_TOLERANCE, [(r.prompt, r.kl) for r in results]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_gemma3_local_layers_on_the_standard_graph(gemma_path, dtype):
    """Gemma 3: q/k norms, GELU, sandwich norms, local layers' windows and rotary base."""
    import onnx

    _, _, tok, be = _load(gemma_path, "standard", num_slots=2, max_seq_len=128,
                          standard_dtype=dtype)
    ref = _reference(gemma_path, 128, 2)
    try:
        assert cann_ops.check_model(onnx.load(be.graph_path, load_external_data=False)) == []
        results = greedy_compare(be, ref, tok, PROMPTS[:2], 12)
    finally:
        be.close()
        ref.close()
    _agrees(results, dtype, tok)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_qwen_coder_greedy_against_the_reference(qwen_coder_path, dtype):
    _, _, tok, be = _load(qwen_coder_path, "standard", num_slots=len(PROMPTS), max_seq_len=256,
                          standard_dtype=dtype)
    ref = _reference(qwen_coder_path, 256)
    try:
        results = greedy_compare(be, ref, tok, PROMPTS, 32)
    finally:
        be.close()
        ref.close()
    _agrees(results, dtype, tok)


# ---- e2e -------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_server_on_the_standard_graph_answers_and_says_so(model_path, tmp_path):
    srv = start_server(str(tmp_path), TEST_CONFIG, ["--model", model_path],
                       env={"TINY_MINDIE_GRAPH": "standard"})
    for s in serving(srv):
        assert ", standard graph, exact weights" in s.banner
        assert "execution providers: CPU " in s.banner
        assert "onnxruntime MatMul (float16)" in s.banner
        assert "memory: the model needs " in s.banner and "(float16 graph)" in s.banner
        status, _, raw = request(s, "POST", "/infer", {
            "inputs": "The capital of France is", "stream": False,
            "parameters": {"max_new_tokens": 8, "do_sample": False}})
        assert status == 200
        assert json.loads(raw)["generated_text"].strip().startswith("Paris")
