"""tiny_mindie's C kernels (tiny_mindie/kernels): every ISA path this CPU runs, every GGUF type,
against a numpy oracle (the blocks dequantized by the ``gguf`` package, the activations
quantized to int8 per block of 32 the kernels' way); bit-equal across paths, row counts, row
positions and thread splits; the same numbers through onnxruntime's custom operator. Real
tensors: tests/model/test_kernels_real.py.

Tests needing the built library skip where it was not built (no C compiler at install) and
fail in CI, where ``pip install -e .`` builds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
from gguf_blocks import (
    X86_PATHS,
    assert_close_to_oracle,
    kernels_on_best_path,
    random_blocks,
    use_path,
)

from tiny_mindie import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


lib = pytest.fixture(scope="module", name="lib")(kernels_on_best_path)


@pytest.mark.parametrize("qtype", sorted(kernels.TYPES))
@pytest.mark.parametrize("path", X86_PATHS)
def test_random_blocks_match_the_oracle(lib, path, qtype):
    use_path(lib, path)
    rng = np.random.default_rng(zlib.crc32(f"{path} {qtype}".encode()))
    n, k = 45, 768                                     # a tail of 5 rows; 3 K-quant super-blocks
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32) * rng.uniform(0.1, 10, (5, 1))
    x[1, :32] = 0                                      # a block of zeros: scale 0
    assert_close_to_oracle(qtype, x, w, n, k, lib.matmul(qtype, x, w, n, k))


@pytest.mark.parametrize("qtype", sorted(kernels.TYPES))
def test_every_path_gives_the_same_bits(lib, qtype):
    rng = np.random.default_rng(7)
    n, k = 33, 512 if qtype in ("Q4_K", "Q6_K") else 544    # blocks of 32: a partial chunk
    w, x = random_blocks(qtype, n, k, rng), rng.standard_normal((3, k)).astype(np.float32)
    lib.set_isa("portable")
    want = lib.matmul(qtype, x, w, n, k)
    ran = 0
    for path in X86_PATHS[1:]:
        if lib.supported(path):
            lib.set_isa(path)
            np.testing.assert_array_equal(lib.matmul(qtype, x, w, n, k), want, err_msg=path)
            ran += 1
    if not ran:
        pytest.skip("no SIMD path runs on this CPU")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_a_row_is_the_same_in_any_batch_position_and_thread_split(lib, qtype):
    """Batch invariance by construction: rows 1..11 (past one tile of 8), any position, 1-5
    threads, on the best path."""
    rng = np.random.default_rng(11)
    n, k = 61, 512
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((11, k)).astype(np.float32)
    alone = np.stack([lib.matmul(qtype, x[i:i + 1], w, n, k)[0] for i in range(len(x))])
    for m in range(2, 12):
        for start in range(0, len(x) - m + 1, 3):
            np.testing.assert_array_equal(lib.matmul(qtype, x[start:start + m], w, n, k),
                                          alone[start:start + m], err_msg=f"M={m} at {start}")
    for threads in (2, 3, 5):
        np.testing.assert_array_equal(lib.matmul(qtype, x, w, n, k, threads=threads), alone,
                                      err_msg=f"{threads} threads")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q5_0", "Q6_K"])
def test_a_row_is_the_same_past_a_group_of_rows(lib, qtype):
    """Rows decoded once for a group of activation rows: 70 rows (past a group of 64) give
    each row's numbers alone, on every path this CPU runs."""
    rng = np.random.default_rng(13)
    n, k = 20, 512
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((70, k)).astype(np.float32)
    for path in X86_PATHS:
        if lib.supported(path):
            lib.set_isa(path)
            alone = np.stack([lib.matmul(qtype, x[i:i + 1], w, n, k)[0] for i in (0, 63, 64, 69)])
            np.testing.assert_array_equal(lib.matmul(qtype, x, w, n, k)[[0, 63, 64, 69]], alone,
                                          err_msg=path)


def _graph(qtype: str, w: np.ndarray, n: int, k: int) -> bytes:
    """A model of one MatMulGGUF node: X float32 [M, K] -> Y [M, N], W an initializer."""
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node(kernels.OP, ["X", "W"], ["Y"], domain=kernels.DOMAIN,
                            type=kernels.TYPES[qtype], N=n, K=k)
    g = helper.make_graph([node], "matmul_gguf",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])
    return model.SerializeToString()


def _session(model: bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.register_custom_ops_library(kernels.library_path())
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q6_K"])
def test_the_onnxruntime_operator_gives_the_ctypes_numbers(lib, qtype):
    rng = np.random.default_rng(5)
    n, k = 300, 512                          # several pieces of rows for the thread pool
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((6, k)).astype(np.float32)
    want = lib.matmul(qtype, x, w, n, k)
    for threads in (1, 2):
        sess = _session(_graph(qtype, w, n, k), threads)
        np.testing.assert_array_equal(sess.run(None, {"X": x})[0], want)
        np.testing.assert_array_equal(sess.run(None, {"X": x[2:3]})[0], want[2:3])


def test_the_operator_refuses_a_weight_of_the_wrong_size(lib):
    rng = np.random.default_rng(5)
    w = random_blocks("Q4_0", 16, 256, rng)
    sess = _session(_graph("Q4_0", w[:, :-18], 16, 256), 1)
    with pytest.raises(Exception, match="not N rows"):
        sess.run(None, {"X": np.ones((1, 256), np.float32)})


def test_bad_arguments_are_refused(lib):
    w = random_blocks("Q4_K", 4, 256, np.random.default_rng(0))
    x = np.ones((1, 256), np.float32)
    with pytest.raises(ValueError, match="unsupported GGUF type"):
        lib.matmul("Q2_K", x, w, 4, 256)
    with pytest.raises(ValueError, match="not 4 rows"):
        lib.matmul("Q4_K", x, w[:, :100], 4, 256)
    with pytest.raises(ValueError, match=r"x must be \[M, 512\]"):
        lib.matmul("Q4_K", x, w, 2, 512)
    with pytest.raises(ValueError, match="no kernel ISA path"):
        lib.set_isa("sse9")
    if not lib.supported("neon"):
        with pytest.raises(ValueError, match="cannot run"):
            lib.set_isa("neon")


def _in_subprocess(env_isa: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TINY_MINDIE_KERNEL_ISA=env_isa, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_environment_forces_a_path_or_is_refused(lib):
    r = _in_subprocess("portable", "from tiny_mindie import kernels; print(kernels.isa())")
    assert r.stdout.strip() == "portable", r.stderr
    other = "avx512vnni" if not lib.supported("avx512vnni") else "neon"
    code = ("from tiny_mindie import kernels\n"
            "try:\n    kernels.isa()\nexcept kernels.KernelError as e:\n    print('refused', e)\n"
            "import onnxruntime as ort\nso = ort.SessionOptions()\n"
            "try:\n    so.register_custom_ops_library(kernels.library_path())\n"
            "except Exception as e:\n    print('onnxruntime refused')\n")
    r = _in_subprocess(other, code)
    assert "refused TINY_MINDIE_KERNEL_ISA names a path this CPU" in r.stdout, r.stderr
    assert "onnxruntime refused" in r.stdout, r.stderr


def test_the_extension_is_optional_and_builds_every_source():
    """setup.py compiles every C source of tiny_mindie/kernels (kernels/sources.py lists them,
    and the headers) and lets the install go on without a compiler (optional=True); the
    sources are in the source distribution (MANIFEST.in)."""
    from tiny_mindie.kernels import sources

    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as fh:
        setup_py = fh.read()
    folder = os.listdir(os.path.join(ROOT, "tiny_mindie", "kernels"))
    assert sorted(f for f in folder if f.endswith(".c")) == sorted(sources.SOURCES)
    assert sorted(f for f in folder if f.endswith(".h")) == sorted(sources.DEPENDS)
    assert "sources.SOURCES" in setup_py and "sources.DEPENDS" in setup_py
    assert "optional=True" in setup_py and '"-march' not in setup_py
    with open(os.path.join(ROOT, "MANIFEST.in"), encoding="utf-8") as fh:
        assert "recursive-include tiny_mindie/kernels *.c *.h" in fh.read()

@pytest.mark.parametrize("qtype", sorted(kernels.TYPES))
def test_a_non_finite_activation_block_gives_nan_on_every_path(lib, qtype):
    """A row whose block holds a NaN or an infinity: all its outputs NaN, on every path; the
    other rows as they are alone."""
    rng = np.random.default_rng(11)
    n, k = 37, 512
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[1, 40], x[2, 3], x[3, 300] = np.nan, np.inf, -np.inf
    got = {}
    for path in X86_PATHS:
        if lib.supported(path):
            lib.set_isa(path)
            got[path] = lib.matmul(qtype, x, w, n, k)
            assert np.isnan(got[path][1:4]).all(), path
            for row in (0, 4):
                alone = lib.matmul(qtype, x[row:row + 1], w, n, k)[0]
                assert np.isfinite(alone).all()
                np.testing.assert_array_equal(got[path][row], alone, err_msg=path)
    for path, y in got.items():
        np.testing.assert_array_equal(y, got["portable"], err_msg=path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_a_block_too_small_to_scale_is_zero_on_every_path(lib, qtype):
    """A block whose largest activation is so small that 1 / scale overflows (with zeros
    beside it, which 0 * inf would make NaN): the block counts as zero, on every path."""
    rng = np.random.default_rng(5)
    n, k = 19, 256
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[1, 32:64] = 0
    x[1, 39] = 1e-37
    x[2] = 0
    x[2, 7] = -2e-38
    zeroed = x.copy()
    zeroed[1, 32:64] = 0
    zeroed[2] = 0
    for path in X86_PATHS:
        if lib.supported(path):
            lib.set_isa(path)
            np.testing.assert_array_equal(lib.matmul(qtype, x, w, n, k),
                                          lib.matmul(qtype, zeroed, w, n, k), err_msg=path)
