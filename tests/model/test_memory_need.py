"""The memory the standard graph needs where it runs (tiny_mindie.model.ort.memory_need): the pure
computation on hand-made shapes, the refusal, the bound on one run's tensors against the tensors
of a real built graph, and a server that refuses a KV cache the host cannot hold."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.gguf import ModelFileError
from tiny_mindie.model.ort.memory_need import (
    MemoryNeed,
    StandardPlan,
    activation_bytes,
    check_fits,
    device_free,
    host_available,
    kv_bytes,
    standard_need,
    weight_bytes,
)

#: a small LLaMA-shaped model: D 64, I 128, 2 layers, 4 heads of 16 (2 KV heads), V 100
CFG = ModelConfig(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_dim=16,
                  rope_theta=10000.0, rms_eps=1e-5, context_length=64, tied_embeddings=False)
SHAPES = {"token_embd.weight": (100, 64), "output.weight": (100, 64), "output_norm.weight": (64,),
          **{f"blk.{i}.{n}": s for i in range(2) for n, s in (
              ("attn_norm.weight", (64,)), ("attn_q.weight", (64, 64)), ("attn_k.weight", (32, 64)),
              ("attn_v.weight", (32, 64)), ("attn_output.weight", (64, 64)),
              ("ffn_norm.weight", (64,)), ("ffn_gate.weight", (128, 64)),
              ("ffn_up.weight", (128, 64)), ("ffn_down.weight", (64, 128)))}}
MATRICES = 6400 + 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64)     # all but embedding
VECTORS = 64 + 2 * 2 * 64
ROPE = 2 * 64 * 8 * 4                   # cos, sin: 64 positions x rope_dim / 2, float32


def _need(**kw) -> MemoryNeed:
    args = dict(dtype="float16", where="CPU", slots=4, max_seq_len=63, max_chunk_tokens=16,
                verify_rows=0, parallel_runs=1, max_positions=64)
    return standard_need(SHAPES, CFG, StandardPlan(**{**args, **kw}))


def test_weights_at_the_graphs_dtype_where_they_are_held():
    npu = weight_bytes(SHAPES, CFG, "float16", False, 64)
    assert npu == 2 * (MATRICES + 6400) + 4 * VECTORS + ROPE
    # the CPU provider converts float16 matrices to float32; the gathered embedding stays
    assert weight_bytes(SHAPES, CFG, "float16", True, 64) == 4 * MATRICES + 2 * 6400 + \
        4 * VECTORS + ROPE
    assert weight_bytes(SHAPES, CFG, "float32", False, 64) == 4 * (MATRICES + 6400 + VECTORS) + \
        ROPE
    tied = dataclasses.replace(CFG, tied_embeddings=True)
    shapes = {k: v for k, v in SHAPES.items() if k != "output.weight"}
    # tied on the CPU: the Gather's float16 table and the LM head's float32 copy
    assert weight_bytes(shapes, tied, "float16", True, 64) - weight_bytes(
        shapes, CFG, "float16", True, 64) == 4 * 6400
    local = dataclasses.replace(CFG, rope_theta_local=10000.0)
    assert weight_bytes(SHAPES, local, "float16", False, 64) == npu + ROPE


def test_kv_cache_is_linear_in_slots_and_positions_and_halved_in_float16():
    one = kv_bytes(CFG, "float16", 1, 1)
    assert one == 2 * 2 * 2 * 16 * 2              # keys and values, layers, KV heads, H, bytes
    assert kv_bytes(CFG, "float16", 3, 7) == 21 * one
    assert kv_bytes(CFG, "float32", 3, 7) == 42 * one
    need = _need(slots=4, max_seq_len=63)
    assert need.kv_cache == kv_bytes(CFG, "float16", 4, 64) and need.positions == 64


def test_on_an_npu_the_device_holds_a_runs_copies_and_the_host_the_cache():
    cpu, npu = _need(), _need(where="CANNExecutionProvider:0")
    assert cpu.host == 0 and cpu.total == cpu.weights + cpu.kv_cache + cpu.activations
    assert npu.kv_cache == 2 * cpu.kv_cache
    assert npu.host == cpu.kv_cache + weight_bytes(SHAPES, CFG, "float16", False, 64)
    assert npu.weights < cpu.weights                            # float16 there, float32 here


def test_activations_grow_with_the_span_the_rows_and_the_parallel_runs():
    a = [activation_bytes(CFG, "float16", False, 4, 1, span, 4) for span in (64, 128, 256)]
    assert a[0] < a[1] < a[2] and a[2] - a[1] == 2 * (a[1] - a[0])      # linear in the span
    assert activation_bytes(CFG, "float16", False, 8, 1, 64, 8) > a[0]
    assert activation_bytes(CFG, "float32", False, 4, 1, 64, 4) > a[0]
    assert _need(parallel_runs=3).activations == 3 * _need().activations
    assert _need(verify_rows=16).activations >= _need().activations


def test_describe_is_one_line_with_every_part():
    line = _need().describe()
    assert "\n" not in line and line.startswith(f"{_need().total / 1e9:.2f} GB on CPU: weights")
    for part in ("float16 graph", "KV cache", "4 slots x 64 positions", "activations at most"):
        assert part in line
    assert "on the host" in _need(where="CANNExecutionProvider:0").describe()


def test_check_fits_refuses_in_one_line_what_the_place_cannot_hold():
    need = _need()
    check_fits(need, "/m/x.gguf", None, need.total)                 # exactly enough
    check_fits(need, "/m/x.gguf", None, None)                       # unknown: not refused
    with pytest.raises(ModelFileError) as exc:
        check_fits(need, "/m/x.gguf", None, need.total - 1)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("x.gguf needs") and "the host has" in msg
    npu = _need(where="CANNExecutionProvider:0")
    check_fits(npu, "x.gguf", (npu.total, npu.total), npu.host)
    with pytest.raises(ModelFileError, match="device CANNExecutionProvider:0 has"):
        check_fits(npu, "x.gguf", (npu.total - 1, 10 * npu.total), None)
    with pytest.raises(ModelFileError, match="the host has"):
        check_fits(npu, "x.gguf", None, npu.host - 1)
    with pytest.raises(ModelFileError, match="or --standard-dtype float16"):
        check_fits(_need(dtype="float32"), "x.gguf", None, 1)


def test_what_there_is_here():
    free = host_available()
    assert free is not None and 0 < free <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")
    assert device_free(0) is None          # no Ascend runtime on this machine


# ---- a real graph ------------------------------------------------------------------------------

def _run_tensor_bytes(model, dims: dict[str, int]) -> int:
    """Bytes of every tensor the graph's nodes compute (ScatterND's outputs are the bound KV
    cache) at the concrete ``dims``, by ONNX shape inference; the attention span, which the
    graph reads from ``attention_bias``'s shape at run time, set as a constant."""
    import onnx
    from onnx import numpy_helper, shape_inference

    for vi in (*model.graph.input, *model.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_value = dims[d.dim_param]
    shapes = {n.output[0] for n in model.graph.node
              if n.op_type == "Shape" and n.input[0] == "attention_bias"}
    span = {n.output[0] for n in model.graph.node if n.op_type == "Gather" and n.input[0] in shapes}
    model.graph.initializer.append(numpy_helper.from_array(np.array([dims["span"]]), "span_c"))
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            if name in span:
                n.input[i] = "span_c"
    found = {v.name: v.type.tensor_type
             for v in shape_inference.infer_shapes(model, data_prop=True).graph.value_info}
    total = known = 0
    for n in model.graph.node:
        for out in (o for o in n.output if n.op_type != "ScatterND"):
            t = found.get(out)
            if t is not None and all(d.dim_value for d in t.shape.dim):
                known += 1
                size = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
                total += int(np.prod([d.dim_value for d in t.shape.dim])) * size
    assert known > 0.95 * sum(len(n.output) for n in model.graph.node)
    return total


@pytest.mark.parametrize("rows,tokens,logits", [(4, 1, 4), (1, 128, 1), (1, 8, 8)])
def test_the_bound_covers_every_tensor_of_a_built_graph(model_path, rows, tokens, logits):
    """Each layer's tensors live one layer at a time; summed over all layers they stay within
    layers x the bound (which counts the ends once per layer here) and not far below it."""
    import onnx

    from tiny_mindie.model.gguf import GGUFFile
    from tiny_mindie.model.onnx.graph_cache import cached_graph
    from tiny_mindie.model.onnx.graph_options import GraphOptions

    f = GGUFFile(model_path)
    cfg = ModelConfig.from_gguf(f)
    path, _ = cached_graph(f, cfg, GraphOptions(flavour="standard"))
    model = onnx.load(path, load_external_data=False)
    total = _run_tensor_bytes(model, {"batch": rows, "seq": tokens, "span": 301,
                                      "cache_len": 301, "logits_rows": logits})
    bound = activation_bytes(cfg, "float16", False, rows, tokens, 301, logits)
    assert 0.3 * cfg.num_layers * bound < total <= cfg.num_layers * bound


def test_a_server_refuses_a_kv_cache_the_host_cannot_hold(model_path, tmp_path):
    """5000 slots x 8192 positions of SmolLM2's KV cache (~0.9 TB): refused before anything is
    built, with the statement and one error line, exit status 2."""
    config = {"BackendConfig": {"kvCacheMB": 1 << 20, "ModelDeployConfig": {
        "maxSeqLen": 8192, "maxInputTokenLen": 4096,
        "ModelConfig": [{"modelName": "m", "modelWeightPath": model_path}]},
        "ScheduleConfig": {"maxBatchSize": 5000, "maxPrefillTokens": 4096}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = subprocess.run([sys.executable, "-m", "tiny_mindie", "--config",
                        str(tmp_path / "config.json"), "--no-tls", "--port", "0", "--graph",
                        "standard"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    errors = [line for line in r.stderr.splitlines() if line.startswith("tiny_mindie: error:")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(errors) == 1 and "needs" in errors[0] and "the host has" in errors[0], errors
    assert "5000 slots x 8193 positions" in errors[0]
    assert "memory: the model needs" in r.stderr
    assert "onnxruntime session on" not in r.stdout + r.stderr        # refused before loading
