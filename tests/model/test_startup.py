"""Start-up of the ONNX Runtime backend on a tiny random Qwen2 GGUF (tests/model/test_qwen2.py's):
the batch-invariance check runs once per graph, onnxruntime version, CPU and thread count; the
tokenizer is read beside the backend, and its errors still stop the load."""

from __future__ import annotations

import json
import logging
import os

import pytest

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.model          # writes a model file and loads it (about a second)

from tiny_qwen2 import write_tiny_qwen2  # noqa: E402

from tiny_mindie.model.arch import ModelConfig  # noqa: E402
from tiny_mindie.model.gguf import GGUFFile, ModelFileError  # noqa: E402
from tiny_mindie.model.loader import load_model  # noqa: E402
from tiny_mindie.model.options import BackendOptions, SessionTuning  # noqa: E402
from tiny_mindie.model.ort import ort_backend  # noqa: E402
from tiny_mindie.model.ort.ort_backend import OrtBackend  # noqa: E402
from tiny_mindie.model.ort.startup_checks import BATCH_CHECKS, StartupChecks  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny-qwen2.gguf")
    write_tiny_qwen2(path)
    return path


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == ort_backend.__name__]


def test_the_batch_check_runs_once_per_cpu_and_thread_count(tiny, tmp_path, caplog,
                                                            monkeypatch):
    caplog.set_level(logging.INFO, logger=ort_backend.__name__)
    f = GGUFFile(tiny)
    cfg = ModelConfig.from_gguf(f)

    def backend(threads: int) -> OrtBackend:
        return OrtBackend(f, cfg, BackendOptions(threads=threads), num_slots=4, max_seq_len=32,
                          cache_dir=str(tmp_path), tuning=SessionTuning(huge_pages=False))

    def recorded(check: str | None = None) -> list[dict]:
        return [k for k in json.load(open(record)) if k.get("check") == check]

    first = backend(1)
    record = os.path.join(os.path.dirname(first.graph_path), BATCH_CHECKS)
    (key,) = recorded()
    assert key["threads"] == 1 and key["rows"] == 4 and key["cpu"]
    # the prefix-split check is recorded beside it, whatever its outcome (a failure is the
    # safe, shorter reuse: not worth checking again at every start)
    (split,) = recorded("prefix split")
    assert split["passed"] is first.prefix_split_invariant
    assert any(m.startswith("decode rows checked:") for m in _messages(caplog))
    first.close()
    caplog.clear()

    def not_again(self):
        raise AssertionError("the prefix-split check ran again")

    monkeypatch.setattr(StartupChecks, "check_prefix_split_invariance", not_again)
    second = backend(1)
    assert second.batch_invariant and second.rows_per_decode_run == 0
    assert second.prefix_split_invariant == first.prefix_split_invariant
    assert any("checked at an earlier start" in m for m in _messages(caplog))
    assert len(recorded("prefix split")) == 1
    assert not any(m.startswith("decode rows checked:") for m in _messages(caplog))
    second.close()
    caplog.clear()
    monkeypatch.undo()
    third = backend(2)                                  # another thread count: checked again
    assert any(m.startswith("decode rows checked:") for m in _messages(caplog))
    assert [k["threads"] for k in recorded()] == [1, 2]
    third.close()


def test_a_check_record_names_what_was_checked(tiny, tmp_path):
    """A start with a short ``max_seq_len`` checks a shorter prompt (and rows at fewer
    positions): its record must not stand for a longer one, or one start at 60 tokens would
    vouch for prefix reuse at 2048. Pieces cut to 1 token are dropped (the check vouches for
    chunks of 2+ tokens), and so is one that became the whole prompt. Down to 5 positions, the
    checks run (no error)."""
    f = GGUFFile(tiny)
    cfg = ModelConfig.from_gguf(f)
    for n in (5, 20, 32, 20):
        OrtBackend(f, cfg, BackendOptions(threads=1), num_slots=4, max_seq_len=n,
                   cache_dir=str(tmp_path), tuning=SessionTuning(huge_pages=False)).close()
    record = os.path.join(os.path.dirname(
        OrtBackend(f, cfg, BackendOptions(threads=1), num_slots=4, max_seq_len=20,
                   cache_dir=str(tmp_path), tuning=SessionTuning(huge_pages=False)).graph_path),
        BATCH_CHECKS)
    keys = json.load(open(record))
    assert [(k["tokens"], k["pieces"]) for k in keys if k.get("check") == "prefix split"] == [
        (5, [[0, 2], [2, 5]]), (20, [[0, 2], [2, 20], [0, 17], [17, 20]]),
        (32, [[0, 2], [2, 32], [0, 17], [17, 32]])]
    # the batch check's rows sit at the same positions at 20 and 32: one record serves both
    assert [k["positions"] for k in keys if k.get("check") is None] == [[3, 4, 1, 2],
                                                                         [3, 4, 5, 6]]


def test_the_verification_check_fits_a_short_max_seq_len(tiny, tmp_path):
    """Where ``max_seq_len`` leaves no room after positions 21 and 150, the verification check
    verifies after the last position that does; below 3 positions nothing can be verified, and
    speculation stays off rather than being vouched for unchecked."""
    from tiny_mindie.model.onnx.graph_options import GraphOptions

    f = GGUFFile(tiny)
    cfg = ModelConfig.from_gguf(f)
    for n, pasts in ((2, []), (3, [1]), (5, [1]), (30, [21]), (128, [21])):
        be = OrtBackend(f, cfg, BackendOptions(threads=1), num_slots=2, max_seq_len=n,
                        cache_dir=str(tmp_path), graph_options=GraphOptions(verify_rows=5),
                        tuning=SessionTuning(huge_pages=False))
        assert be.checks._verify_check_pasts() == pasts, n
        if not pasts:                   # (elsewhere the check's outcome is this CPU's)
            assert not be.fast_verify
        be.close()


def test_load_model_reads_the_tokenizer_beside_the_backend(tiny):
    f, cfg, tok, be = load_model(tiny, BackendOptions(threads=1, kernels="onnxruntime",
                                                      speculation=False),
                                 num_slots=2, max_seq_len=32)
    try:
        assert be.name == "onnxruntime" and cfg.architecture == "qwen2"
        assert tok.vocab_size == cfg.vocab_size
        assert tok.decode(tok.encode("the")) == "the"
    finally:
        be.close()


def test_a_tokenizer_error_still_stops_the_load(tiny, tmp_path):
    data = open(tiny, "rb").read()
    at = data.index(b"gpt2", data.index(b"tokenizer.ggml.model"))
    bad = tmp_path / "bert-tokenizer.gguf"
    bad.write_bytes(data[:at] + b"bert" + data[at + 4:])  # same length: still a valid GGUF
    with pytest.raises(ModelFileError, match="unsupported tokenizer model 'bert'"):
        load_model(str(bad), BackendOptions(threads=1, kernels="onnxruntime", speculation=False),
                   num_slots=2, max_seq_len=32)
