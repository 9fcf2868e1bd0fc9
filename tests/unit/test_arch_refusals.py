"""Metadata that would change the mathematics in a way the server does not implement is refused
with one line naming the key (or tensor), never run wrongly: written as tiny metadata-only GGUFs
with ``gguf``'s writer (no weights, no inference)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

gguf_pkg = pytest.importorskip("gguf")

from tiny_mindie.model.arch import ModelConfig  # noqa: E402
from tiny_mindie.model.gguf import GGUFFile, ModelFileError  # noqa: E402


def _write(path, arch: str, kv: dict | None = None, tensors: tuple[str, ...] = ()) -> GGUFFile:
    w = gguf_pkg.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in (kv or {}).items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)
    for name in tensors:
        w.add_tensor(name, np.zeros(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


@pytest.mark.parametrize("arch, kv, tensors, message", [
    ("qwen3moe", {}, (), "architecture 'qwen3moe' is not supported"),
    ("llama", {"expert_count": 8}, (), "llama.expert_count = 8 is not supported"),
    ("qwen3", {"final_logit_softcapping": 30.0}, (),
     "qwen3.final_logit_softcapping = 30.0 is not supported"),
    ("phi3", {"attn_logit_softcapping": 50.0}, (), "phi3.attn_logit_softcapping"),
    ("llama", {"rope.scaling.type": "dynamic"}, (), "llama.rope.scaling.type 'dynamic'"),
    ("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
               "rope.scaling.yarn_log_multiplier": 0.1}, (),
     "qwen2.rope.scaling.yarn_log_multiplier = 0.1"),
    ("smollm3", {"attention.scale": 0.5}, (), "smollm3.attention.scale = 0.5"),
    ("llama", {"attention.sliding_window_pattern": 4}, (),
     "llama.attention.sliding_window_pattern"),
    ("llama", {}, ("blk.0.attn_output.bias",), "tensor blk.0.attn_output.bias is not supported"),
    ("qwen3", {}, ("blk.0.ffn_gate_inp.weight",), "tensor blk.0.ffn_gate_inp.weight"),
])
def test_unsupported_metadata_is_one_line_naming_it(tmp_path, arch, kv, tensors, message):
    f = _write(tmp_path / "m.gguf", arch, kv, tensors)
    with pytest.raises(ModelFileError) as err:
        ModelConfig.from_gguf(f)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_neutral_values_pass(tmp_path):
    """Keys holding the value that changes nothing (as converters often write them) load."""
    f = _write(tmp_path / "m.gguf", "llama", {"expert_count": 0, "expert_used_count": 0,
                                              "rope.scaling.type": "none"})
    c = ModelConfig.from_gguf(f)
    assert c.rope_scaling == "none" and not c.sliding_window


def test_scaling_keys_are_read(tmp_path):
    f = _write(tmp_path / "m.gguf", "qwen3", {"rope.scaling.type": "yarn",
                                              "rope.scaling.factor": 4.0,
                                              "rope.scaling.original_context_length": 32})
    c = ModelConfig.from_gguf(f)
    assert (c.rope_scaling, c.rope_factor, c.rope_orig_context, c.qk_norm) == (
        "yarn", 4.0, 32, True)
    f = _write(tmp_path / "l.gguf", "llama", {"rope.scaling.type": "linear",
                                              "rope.scaling.factor": 2.0,
                                              "attention.sliding_window": 4096})
    c = ModelConfig.from_gguf(f)
    assert (c.rope_scaling, c.rope_factor, c.sliding_window) == ("linear", 2.0, 4096)
    assert all(c.is_local(i) for i in range(c.num_layers))


def test_smollm3_skips_rotary_on_every_fourth_layer(tmp_path):
    c = ModelConfig.from_gguf(_write(tmp_path / "m.gguf", "smollm3"))
    assert [c.uses_rope(i) for i in range(8)] == [True, True, True, False] * 2


def test_graph_refuses_a_rotary_width_groupqueryattention_cannot_rotate(tmp_path):
    pytest.importorskip("onnx")
    from tiny_mindie.model.onnx.graph import build_model

    f = _write(tmp_path / "m.gguf", "phi3")
    c = dataclasses.replace(ModelConfig.from_gguf(f), rope_dim=8)
    with pytest.raises(ModelFileError, match=r"phi3.rope.dimension_count = 8: .*--backend numpy"):
        build_model(f, c, str(tmp_path / "out"))


@pytest.mark.parametrize("kv, local", [({}, 10000.0), ({"rope.freq_base_swa": 10000.0}, 10000.0),
                                       ({"rope.freq_base_swa": 50000.0}, 50000.0)])
def test_gemma3_reads_the_local_layers_rotary_base(tmp_path, kv, local):
    """``gemma3.rope.freq_base_swa`` (llama.cpp's key, default 10000) is the local layers' base."""
    c = ModelConfig.from_gguf(_write(tmp_path / "m.gguf", "gemma3",
                                     {"rope.freq_base": 1e6, **kv}))
    assert (c.rope_theta, c.rope_theta_local) == (1e6, local)
    # the local layers' rotary table (the reference's; the graph builds its own from the same
    # function) is at that base, the global layers' at rope.freq_base
    from tiny_mindie.model.reference.layers import rope_frequencies
    i = np.arange(c.rope_dim // 2)
    inv_local, _ = rope_frequencies(c, 128, local=True)
    np.testing.assert_allclose(inv_local, local ** (-2.0 * i / c.rope_dim))
    np.testing.assert_allclose(rope_frequencies(c, 128)[0], 1e6 ** (-2.0 * i / c.rope_dim))


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_gemma3_refuses_a_local_rotary_base_it_cannot_compute(tmp_path, value):
    f = _write(tmp_path / "m.gguf", "gemma3", {"rope.freq_base_swa": value})
    with pytest.raises(ModelFileError, match=r"gemma3\.rope\.freq_base_swa = .* must be a "
                                             r"positive finite number"):
        ModelConfig.from_gguf(f)
