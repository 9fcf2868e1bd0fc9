"""Finding and loading a draft model (:mod:`.draft`) beside the model it drafts for: its file
and vocabulary checked from both GGUF headers before anything is built (:func:`check_draft`),
then its backend loaded with the target's options, changed where a draft wants otherwise
(:func:`draft_options`, :func:`load_draft`)."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import replace

from ..model.arch import ModelConfig
from ..model.backend import Backend
from ..model.gguf import GGUFFile, ModelFileError
from ..model.loader import load_model
from ..model.options import BackendOptions
from ..model.ort.providers import CPU
from ..model.registry.catalog import resolve
from ..model.tokenizer import Tokenizer
from ..model.tokenizer_load import Vocabulary, read_vocabulary
from .draft import DraftModel, vocabulary_difference

#: KV slots of a draft model: only a sequence decoding alone speculates, so a few suffice (a
#: sequence coming back after another one finds its draft KV still there).
DRAFT_SLOTS = 2
DRAFT_NEEDS = ("a draft model needs speculative decoding on the onnxruntime backend "
               "(not --no-speculation, not --backend numpy)")


def check_draft(model_path: str, draft: str, say=print) -> str:
    """The path of the draft model ``draft`` (a ``.gguf`` path, or a registry name pulled if
    missing) for the model in the GGUF file ``model_path``, once the metadata of both files
    show the same vocabulary (:func:`.draft.vocabulary_difference`) and logits of as
    many rows. Only the files' headers are read (a fraction of a second): no tokenizer, no
    graph is built.

    Raises:
        ModelFileError: the draft is missing, a directory, not a GGUF file or unsupported
            (``draft model: ...``), or its vocabulary is not the model's (the message names
            the first difference).
    """
    try:
        path = resolve(draft, log=say)
        vocab, rows = _vocabulary(path)
    except ModelFileError as exc:
        raise ModelFileError(f"draft model: {exc}") from None
    target_vocab, target_rows = _vocabulary(model_path)
    diff = vocabulary_difference(target_vocab, vocab)
    if diff is None and rows != target_rows:
        diff = f"the draft's logits have {rows} rows, the target's {target_rows}"
    if diff is not None:
        raise ModelFileError(f"draft model {os.path.basename(path)}: its vocabulary is not "
                             f"the model's: {diff}")
    return path


def _vocabulary(path: str) -> tuple[Vocabulary, int]:
    """The vocabulary in the GGUF file ``path`` and the rows of its model's logits."""
    f = GGUFFile(path)
    return read_vocabulary(f), ModelConfig.from_gguf(f).vocab_size


def load_draft(model: str, target: Backend, tokenizer: Tokenizer, options: BackendOptions,
               say, max_chunk: int) -> DraftModel | None:
    """The draft model ``model`` (a path or registry name) for the model running on
    ``target`` (its tokenizer ``tokenizer``, loaded with ``options``), loaded on the same
    backend with the target's threads, parallel runs, device and providers but
    :data:`DRAFT_SLOTS` KV slots, no verification path, ``compact`` weights (4-bit blocks:
    fewer bytes per step, and a draft's weights never change an answer, only how many of its
    proposals are kept) and idle threads that do not spin (its runs alternate with the
    model's, whose threads would lose the cores to them): :func:`draft_options`.
    ``max_chunk``: the longest prompt piece the draft prefills at once, tokens; ``say``: where
    progress lines go.

    ``None`` (and a line saying so) where the target's start-up check found that a
    verification is not bit for bit decoding on this CPU (speculation stays off there).

    Raises:
        ModelFileError: the file cannot be loaded, or its vocabulary is not the target's (the
            message names the first difference; :class:`~tiny_mindie.llm.LLM` finds that from
            the files' headers before anything is built, :func:`check_draft`, and the built
            tokenizers are compared here again).
        ValueError: speculation is off, or the backend is not onnxruntime.
    """
    if target.name != "onnxruntime" or target.max_verify_rows < 2:
        raise ValueError(DRAFT_NEEDS)
    if target.providers[0] != CPU:
        say(f"draft model not loaded: a draft runs beside a model on the CPU execution provider "
            f"only, and this one runs on {target.device}")
        return None
    if not target.fast_verify:
        say("draft model not loaded: on this CPU a verification is not bit for bit decoding "
            "(see the start-up check above), so speculative decoding stays off")
        return None
    try:
        path = resolve(model, log=say)
    except ModelFileError as exc:
        raise ModelFileError(f"draft model: {exc}") from None
    t0, rss0 = time.monotonic(), _resident_bytes()
    say(f"loading draft model {path} ...")
    _, cfg, draft_tokenizer, backend = load_model(
        path, draft_options(options), num_slots=min(DRAFT_SLOTS, target.num_slots),
        max_seq_len=target.max_seq_len)
    diff = vocabulary_difference(tokenizer, draft_tokenizer)
    if diff is None and cfg.vocab_size != target.config.vocab_size:
        diff = f"the draft's logits have {cfg.vocab_size} rows, the target's " \
               f"{target.config.vocab_size}"
    if diff is not None:
        backend.close()
        raise ModelFileError(f"draft model {os.path.basename(path)}: its vocabulary is not "
                             f"the model's: {diff}")
    gc.collect()
    grown = max(0, _resident_bytes() - rss0)
    say(f"loaded draft model ({cfg.architecture}, {cfg.num_layers} layers) in "
        f"{time.monotonic() - t0:.1f} s; {backend.num_slots} KV slots, "
        f"{grown / 1e6:.0f} MB more resident memory")
    return DraftModel(backend, max_chunk, path=path, resident_bytes=grown)


def draft_options(options: BackendOptions) -> BackendOptions:
    """A draft model's options beside a model loaded with ``options``: its threads, parallel
    runs, device and providers, on the contrib graph with ``compact`` weights (onnxruntime's
    kernels), no verification path, no batch-invariance padding or check, idle threads that
    do not spin (:func:`load_draft` says why)."""
    return replace(options, batch_invariant=False, speculation=False, weights="compact",
                   graph="contrib", kernels="onnxruntime", standard_dtype="float16",
                   spinning=False)


def _resident_bytes() -> int:
    """This process's resident memory in bytes (``/proc/self/statm``; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
