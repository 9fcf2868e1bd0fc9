"""The exact graph with tiny_mindie's own kernels (``GraphOptions.kernels = "custom"``,
``--kernels custom``) on SmolLM2-135M-Instruct Q4_1: every matrix product is a
``tiny_mindie::MatMulGGUF`` on the GGUF's blocks; its logits are as close to the numpy
reference as onnxruntime's own int8 kernels are (tests/model/test_ort_backend.py), its greedy answer
is the reference's, and a row's logits are the same alone and in any batch.

Skips where the kernel library was not built (fails in CI, where it is).
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from batching import assert_rows_batch_invariant
from helpers import TEST_CONFIG, request, serving, start_server
from hf_math import MIN_MARGIN, greedy_margins
from smollm2_prompts import CHAT, FOLLOW, MAX_ABS_INT8, REL_INT8, ids_of, prefill_and_decode

from tiny_mindie import kernels
from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.onnx.graph_options import VERIFY_ROWS, GraphOptions
from tiny_mindie.model.options import BackendOptions
from tiny_mindie.model.ort.ort_backend import OrtBackend
from tiny_mindie.model.reference.decoder import NumpyBackend

MAX_SEQ_LEN = 256


@pytest.fixture(scope="module")
def gguf(model_path) -> GGUFFile:
    if not kernels.available():
        why = "the kernel library was not built (no C compiler when the package was installed)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return GGUFFile(model_path)


@pytest.fixture(scope="module")
def custom(gguf, tmp_path_factory) -> OrtBackend:
    """The exact graph on the custom kernels, built into a fresh cache, 9 slots."""
    be = OrtBackend(gguf, ModelConfig.from_gguf(gguf), BackendOptions(threads=2), num_slots=9,
                    max_seq_len=MAX_SEQ_LEN, cache_dir=str(tmp_path_factory.mktemp("onnx-kernels")),
                    graph_options=GraphOptions(kernels="custom"))
    yield be
    be.close()


@pytest.fixture(scope="module")
def reference(gguf) -> NumpyBackend:
    return NumpyBackend(gguf, ModelConfig.from_gguf(gguf), num_slots=2, max_seq_len=MAX_SEQ_LEN)


def test_every_matrix_product_is_the_custom_operator(custom):
    model = onnx.load(custom.graph_path, load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert "MatMulNBits" not in ops
    # per layer: Q, K, V (apart in the GGUF), output, gate/up (back to back in the GGUF: one
    # product), down; and the LM head (the tied embedding's blocks)
    assert ops.count("MatMulGGUF") == 6 * custom.config.num_layers + 1
    assert ops.count("GatherGGUF") == 1 and "GatherBlockQuantized" not in ops
    names = {"avx512vnni": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2",
             "portable": "portable C"}
    assert custom.kernels == f"custom op, {names[kernels.isa()]}"
    assert custom.batch_invariant


def test_the_cache_entry_holds_the_graph_not_the_ggufs_blocks(custom, gguf, model_path):
    """Every GGUF-block initializer names its bytes in the GGUF (no copy in the entry, whose
    data file holds only the small float tensors); the embedding's lookup and the tied LM head
    share the embedding's one initializer."""
    from tiny_mindie.model.onnx.graph_nodes import GGUF_LOCATION

    model = onnx.load(custom.graph_path, load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    where = {}
    for node in model.graph.node:
        if node.op_type in ("MatMulGGUF", "GatherGGUF"):
            t = inits[node.input[1 if node.op_type == "MatMulGGUF" else 0]]
            ext = {e.key: e.value for e in t.external_data}
            assert ext["location"] == GGUF_LOCATION, t.name
            where.setdefault(node.op_type, []).append((t.name, int(ext["offset"])))
    embd = gguf.file_offset(gguf.raw("token_embd.weight").data)
    assert where["GatherGGUF"] == [where["MatMulGGUF"][-1]] and where["GatherGGUF"][0][1] == embd
    data = os.path.getsize(custom.graph_path + ".data")
    assert data < 0.05 * os.path.getsize(model_path), data
    assert custom.mapped_weight_bytes > 0.95 * os.path.getsize(model_path)


def test_the_session_reads_the_ggufs_pages_in_place(custom, model_path):
    """In a new process: after one prompt, the GGUF's mapping holds (nearly) every weight's
    pages, and the process's own memory grew by far less than the weights (a copy would add
    them all)."""
    import subprocess
    import sys

    cache = os.path.dirname(os.path.dirname(custom.graph_path))
    code = f"""
import json, numpy as np
from tiny_mindie.model.backend import SeqChunk
from tiny_mindie.model.arch import ModelConfig
from tiny_mindie.model.gguf import GGUFFile
from tiny_mindie.model.onnx.graph_options import VERIFY_ROWS, GraphOptions
from tiny_mindie.model.options import BackendOptions
from tiny_mindie.model.ort.memory import file_resident_bytes, resident_split
from tiny_mindie.model.ort.ort_backend import OrtBackend
f = GGUFFile({model_path!r})
own = resident_split()[0]
be = OrtBackend(f, ModelConfig.from_gguf(f), BackendOptions(threads=1, batch_invariant=False),
                num_slots=1, max_seq_len={MAX_SEQ_LEN}, cache_dir={cache!r},
                graph_options=GraphOptions(kernels="custom"))
be.forward([SeqChunk(0, 0, np.arange(1, 9, dtype=np.int64))])
print(json.dumps({{"built": be.built, "mapped": be.mapped_weight_bytes,
                  "gguf": file_resident_bytes({model_path!r}),
                  "own": resident_split()[0] - own}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert not r["built"]                               # the fixture's entry, found
    assert r["gguf"] >= 0.95 * r["mapped"], r
    assert r["own"] < 0.5 * r["mapped"], r


def test_logits_are_as_close_to_the_reference_as_onnxruntimes_kernels(custom, reference, gguf):
    for words in (CHAT, ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]):
        p = ids_of(gguf, words)
        a = prefill_and_decode(custom, 0, p, FOLLOW)
        b = prefill_and_decode(reference, 0, p, FOLLOW)
        for row_a, row_b in zip(a, b, strict=True):
            assert np.abs(row_a - row_b).max() < MAX_ABS_INT8
            rel = np.linalg.norm(row_a - row_b) / np.linalg.norm(row_b - row_b.mean())
            assert rel < REL_INT8, rel
            assert row_a.argmax() == row_b.argmax()


def test_the_greedy_text_is_the_references(custom, reference, gguf):
    """The chat prompt's greedy answer, token for token, where the reference's choice leads by
    a margin no int8 rounding closes."""
    p = ids_of(gguf, CHAT)
    want, margins = greedy_margins(reference, p, 12)
    got, _ = greedy_margins(custom, p, 12, slot=1)
    sure = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(margins))
    assert sure >= 6, margins
    assert got[:sure] == want[:sure]
    vocab = gguf.get("tokenizer.ggml.tokens")
    assert "".join(vocab[t] for t in got[:6]).replace("Ġ", " ") == "The capital of France is Paris"


def test_a_row_gets_the_same_logits_alone_and_in_any_batch(custom):
    assert_rows_batch_invariant(custom, custom.config.vocab_size)


@pytest.mark.parametrize("path", ["avx2", "avxvnni"])
def test_the_start_up_checks_pass_on_another_kernel_path(gguf, path, tmp_path):
    """With the kernels forced to the AVX2 or AVX-VNNI path (what a CPU without AVX-512 runs),
    the start-up batch and verification checks pass (decode rows batched, speculation on) and
    a row's logits are the same alone and in any batch: invariance by construction, not by
    the ISA."""
    if not kernels.supported(path):
        pytest.skip(f"this CPU cannot run the {path} path")
    best = kernels.isa()
    kernels.set_isa(path)
    try:
        be = OrtBackend(gguf, ModelConfig.from_gguf(gguf), BackendOptions(threads=2),
                        num_slots=9, max_seq_len=MAX_SEQ_LEN, cache_dir=str(tmp_path),
                        graph_options=GraphOptions(kernels="custom", verify_rows=VERIFY_ROWS))
        try:
            assert be.kernels.endswith({"avx2": "AVX2", "avxvnni": "AVX-VNNI"}[path])
            assert be.rows_per_decode_run == 0 and be.fast_verify
            assert_rows_batch_invariant(be, be.config.vocab_size)
        finally:
            be.close()
    finally:
        kernels.set_isa(best)



def test_gemma3s_k_quants_give_the_references_greedy_answer(gemma_path, tmp_path):
    """Gemma 3 270M Q4_K_M: Q4_K and Q6_K runs in one fused product, the attention scale in the
    q norm, the LM head the tied Q8_0 embedding as it is: the reference's greedy tokens where
    its choice leads by a margin no int8 rounding closes."""
    from hf_math import QUESTION

    from tiny_mindie.model.tokenizer_load import load_tokenizer

    f = GGUFFile(gemma_path)
    c = ModelConfig.from_gguf(f)
    ids = np.array(load_tokenizer(f).encode(QUESTION), dtype=np.int64)
    be = OrtBackend(f, c, BackendOptions(threads=2), num_slots=3, max_seq_len=MAX_SEQ_LEN,
                    cache_dir=str(tmp_path), graph_options=GraphOptions(kernels="custom"))
    try:
        got, _ = greedy_margins(be, ids, 6)
    finally:
        be.close()
    want, margins = greedy_margins(NumpyBackend(f, c, num_slots=1, max_seq_len=MAX_SEQ_LEN),
                                   ids, 6)
    sure = next((i for i, m in enumerate(margins) if m < MIN_MARGIN), len(margins))
    assert sure >= 1 and got[:sure] == want[:sure], (got, want, margins)

# ---- the setting, the banner and /v1/config ---------------------------------------------------

def _config(tmp_path, backend: dict):
    from tiny_mindie.config.load import load_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": backend}))
    return load_config(str(path))


@pytest.mark.parametrize("backend, message", [
    ({"kernels": "fast"}, 'BackendConfig.kernels must be one of onnxruntime, custom, auto, '
                          'got "fast"'),
    ({"kernels": "custom", "backend": "numpy"}, "kernels custom .* needs the onnxruntime"),
    ({"kernels": "custom", "weights": "compact"}, "kernels custom .* the exact weights"),
    ({"kernels": "custom", "graph": "standard"}, "kernels custom .* its contrib graph"),
])
def test_the_kernels_setting_refuses_what_cannot_run_them(tmp_path, backend, message):
    from tiny_mindie.config.load import ConfigError

    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, backend).with_overrides()


def test_the_flag_chooses_the_kernels(tmp_path):
    from tiny_mindie.cli import main as cli

    assert _config(tmp_path, {}).backend.kernels == "auto"
    path = str(tmp_path / "config.json")
    args = cli.build_parser().parse_args(["serve", "--config", path, "--kernels", "custom"])
    assert cli._config_from_args(args).backend.kernels == "custom"


@pytest.fixture(scope="module")
def custom_server(gguf, tmp_path_factory):
    home = str(tmp_path_factory.mktemp("kernels-server"))
    yield from serving(start_server(home, TEST_CONFIG, ["--kernels", "custom"]))


def test_the_banner_and_config_say_which_kernels_run(custom_server):
    isa = {"avx512vnni": "AVX-512 VNNI", "avxvnni": "AVX-VNNI", "avx2": "AVX2",
           "portable": "portable C"}[kernels.isa()]
    assert f"  kernels  custom op, {isa}\n" in custom_server.banner
    status, _, raw = request(custom_server, "GET", "/v1/config")
    backend = json.loads(raw)["BackendConfig"]
    assert status == 200
    assert (backend["kernels"], backend["kernelsRunning"]) == ("custom", f"custom op, {isa}")
    status, _, raw = request(custom_server, "POST", "/infer", {
        "inputs": "The capital of France is", "stream": False,
        "parameters": {"max_new_tokens": 3, "do_sample": False}})
    assert status == 200 and "Paris" in json.loads(raw)["generated_text"], raw


def test_check_graph_says_which_kernels_run(gguf, model_path, capsys):
    from tiny_mindie.cli.main import main

    assert main(["check-graph", "--model", model_path, "--graph", "contrib", "--kernels",
                 "custom", "--prompts", "1", "--tokens", "4", "--max-seq-len", "300",
                 "--slots", "2"]) == 0
    assert "kernels    custom op, " in capsys.readouterr().out
    assert main(["check-graph", "--model", model_path, "--kernels", "custom"]) == 2
    assert "--kernels custom needs --graph contrib" in capsys.readouterr().err
