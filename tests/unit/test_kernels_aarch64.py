"""The kernel library's aarch64 build (the NEON dot-product path and the portable one) under
qemu-user: Debian's cross compiler builds it with a small C harness
(tests/support/kernels_harness.c), ``qemu-aarch64`` runs it, and its products must match the numpy
oracle and give the same bits as every other path (tests/unit/test_kernels.py). A CPU without the
dot product extension runs the portable path and refuses the NEON one.

Needs ``aarch64-linux-gnu-gcc`` (Debian's gcc-aarch64-linux-gnu, with libc6-dev-arm64-cross) and
``qemu-aarch64`` (qemu-user): skipped where they are missing, failed in CI (``.ci/run`` installs
them).
"""

from __future__ import annotations

import glob
import os
import subprocess

import numpy as np
import pytest
from gguf_blocks import assert_close_to_oracle, random_blocks
from helpers import debian_binary

from tiny_mindie import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KERNELS = os.path.join(ROOT, "tiny_mindie", "kernels")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> tuple[str, str]:
    """``(qemu-aarch64, the static aarch64 harness)``, built with setup.py's flags."""
    cc = debian_binary("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu")
    qemu = debian_binary("qemu-aarch64", "qemu-user")
    out = str(tmp_path_factory.mktemp("aarch64") / "kernels_harness")
    sources = sorted(glob.glob(os.path.join(KERNELS, "*.c")))
    harness_c = os.path.join(ROOT, "tests", "support", "kernels_harness.c")
    subprocess.run([cc, "-static", "-std=c11", "-O3", "-ffp-contract=off", "-D_GNU_SOURCE",
                    "-o", out, *sources, harness_c,
                    "-lm", "-lpthread"], check=True, capture_output=True, timeout=600)
    return qemu, out


def run_aarch64(harness, tmp_path, qtype: str, x: np.ndarray, w: np.ndarray, n: int, k: int,
                isa: str, cpu: str = "max", threads: int = 1) -> tuple[str, np.ndarray]:
    """The harness's ``(ISA path, y)`` for ``x @ W.T`` under qemu with the CPU model ``cpu``,
    ``TINY_MINDIE_KERNEL_ISA=isa``."""
    qemu, exe = harness
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    head = np.array([kernels.TYPES[qtype], x.shape[0], n, k, threads, w.nbytes], np.int64)
    src.write_bytes(head.tobytes() + x.astype(np.float32).tobytes() + w.tobytes())
    r = subprocess.run([qemu, "-cpu", cpu, exe, str(src), str(dst)], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, TINY_MINDIE_KERNEL_ISA=isa))
    if r.returncode:
        raise RuntimeError(r.stderr.strip())
    y = np.frombuffer(dst.read_bytes(), np.float32).reshape(x.shape[0], n)
    return r.stdout.strip(), y


@pytest.mark.parametrize("qtype", sorted(kernels.TYPES))
def test_the_neon_path_matches_the_oracle_and_the_portable_bits(harness, tmp_path, qtype):
    rng = np.random.default_rng(21)
    n, k = 45, 768
    w = random_blocks(qtype, n, k, rng)
    x = rng.standard_normal((5, k)).astype(np.float32)
    isa, neon = run_aarch64(harness, tmp_path, qtype, x, w, n, k, "neon")
    assert isa == "neon"
    assert_close_to_oracle(qtype, x, w, n, k, neon)
    isa, portable = run_aarch64(harness, tmp_path, qtype, x, w, n, k, "portable")
    assert isa == "portable"
    np.testing.assert_array_equal(neon, portable)
    if kernels.available():                        # the host's paths: the same bits again
        np.testing.assert_array_equal(neon, kernels.matmul(qtype, x, w, n, k))
    _, two_threads = run_aarch64(harness, tmp_path, qtype, x, w, n, k, "neon", threads=2)
    np.testing.assert_array_equal(two_threads, neon)
    for i in (0, 3):
        _, alone = run_aarch64(harness, tmp_path, qtype, x[i:i + 1], w, n, k, "neon")
        np.testing.assert_array_equal(alone[0], neon[i])


def test_a_cpu_without_dot_products_runs_the_portable_path(harness, tmp_path):
    rng = np.random.default_rng(2)
    w, x = random_blocks("Q4_K", 8, 256, rng), rng.standard_normal((1, 256)).astype(np.float32)
    assert run_aarch64(harness, tmp_path, "Q4_K", x, w, 8, 256, "auto", cpu="max")[0] == "neon"
    assert run_aarch64(harness, tmp_path, "Q4_K", x, w, 8, 256, "auto",
                       cpu="cortex-a53")[0] == "portable"
    with pytest.raises(RuntimeError, match="cannot run"):
        run_aarch64(harness, tmp_path, "Q4_K", x, w, 8, 256, "neon", cpu="cortex-a53")
