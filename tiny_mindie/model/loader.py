"""Open a GGUF and build its tokenizer and backend: the one place that knows every backend."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from . import WEIGHT_MODES
from .arch import ModelConfig
from .backend import Backend
from .gguf import GGUFFile, ModelFileError
from .options import BackendOptions
from .tokenizer import Tokenizer
from .tokenizer_load import load_tokenizer

log = logging.getLogger(__name__)


def kv_bytes_per_slot(cfg: ModelConfig, max_seq_len: int, dtype_bytes: int = 4) -> int:
    """Bytes of K and V for one sequence of ``max_seq_len`` tokens, all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * max_seq_len * dtype_bytes


def slots_for_budget(cfg: ModelConfig, max_seq_len: int, budget_mb: int, max_batch: int,
                     dtype_bytes: int = 4) -> int:
    """How many sequences the KV cache holds within ``budget_mb`` MB (at least 1, at most
    ``max_batch``), at ``dtype_bytes`` bytes a value (2: the float16 standard graph's)."""
    per = kv_bytes_per_slot(cfg, max_seq_len, dtype_bytes)
    return max(1, min(max_batch, (budget_mb << 20) // per))


@dataclass(frozen=True)
class KVSize:
    """How large a backend's KV cache is: ``num_slots`` sequences (``None``: as many as
    ``kv_cache_mb`` MB hold, at most ``max_batch``) of ``max_seq_len`` tokens each (capped by
    the model's trained context)."""

    num_slots: int | None
    kv_cache_mb: int
    max_batch: int
    max_seq_len: int

    def seq_len(self, cfg: ModelConfig) -> int:
        """``max_seq_len``, capped by the model's trained context."""
        return min(self.max_seq_len, cfg.context_length)

    def slots(self, cfg: ModelConfig, dtype_bytes: int = 4) -> int:
        """``num_slots``, or as many as the budget holds at ``dtype_bytes`` bytes a value
        (:func:`slots_for_budget`)."""
        if self.num_slots is not None:
            return self.num_slots
        return slots_for_budget(cfg, self.seq_len(cfg), self.kv_cache_mb, self.max_batch,
                                dtype_bytes)


def load_model(path: str, options: BackendOptions = BackendOptions(), *,
               num_slots: int | None = None, kv_cache_mb: int = 1024, max_batch: int = 200,
               max_seq_len: int = 2048) -> tuple[GGUFFile, ModelConfig, Tokenizer, Backend]:
    """Load the model at ``path`` on the backend, and with the choices, of ``options``.

    Args:
        path: a ``.gguf`` file.
        options: the backend's choices (:class:`~.options.BackendOptions`).
        num_slots: sequences the KV cache holds at once; ``None``: as many as ``kv_cache_mb``
            MB hold, at most ``max_batch``.
        max_seq_len: tokens per sequence (capped by the model's trained context).

    Returns:
        ``(file, config, tokenizer, backend)``.

    Raises:
        ModelFileError: missing/bad file, unsupported architecture or tokenizer, or (the
            onnxruntime backend) what cannot load here.
    """
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    size = KVSize(num_slots, kv_cache_mb, max_batch, max_seq_len)
    if options.backend != "onnxruntime":
        return f, cfg, load_tokenizer(f), _load_backend(f, cfg, options, size)
    # The tokenizer is read while the session is created (which releases the GIL): a large
    # vocabulary adds nothing to the start. Its errors are raised once the backend has loaded.
    with ThreadPoolExecutor(1, thread_name_prefix="tiny_mindie-tokenizer") as pool:
        tok_job = pool.submit(load_tokenizer, f)
        be = _load_backend(f, cfg, options, size)
        try:
            tok = tok_job.result()
        except BaseException:
            be.close()
            raise
    return f, cfg, tok, be


def _load_backend(f: GGUFFile, cfg: ModelConfig, options: BackendOptions,
                  size: KVSize) -> Backend:
    """The backend part of :func:`load_model`."""
    if options.backend == "numpy":
        from .reference.decoder import NumpyBackend
        return NumpyBackend(f, cfg, num_slots=size.slots(cfg), max_seq_len=size.seq_len(cfg))
    try:
        return _ort_backend(f, cfg, options, size)
    except ImportError as exc:   # onnx / onnxruntime missing or broken in this environment
        raise ModelFileError(f"the onnxruntime backend cannot load ({exc}); reinstall the "
                             f"project's dependencies or use --backend numpy") from None


def _ort_backend(f: GGUFFile, cfg: ModelConfig, options: BackendOptions,
                 size: KVSize) -> Backend:
    """The onnxruntime backend of :func:`_load_backend`; the standard graph's memory stated
    and checked first (:func:`.memory_need.check_standard_memory`) and kept as the backend's
    ``memory_need`` (None for the contrib graph)."""
    from .onnx.graph_options import VERIFY_ROWS, GraphOptions
    from .ort.memory_need import check_standard_memory
    from .ort.ort_backend import OrtBackend
    from .ort.ort_session import resolve_kernels
    from .ort.providers import graph_flavour, select_providers

    o = options
    chosen = select_providers(list(o.providers) or None, o.device_id)
    flavour = graph_flavour(o.graph, chosen)
    if flavour == "standard" and o.weights != "exact":
        raise ModelFileError(f"weights {o.weights!r} need the contrib graph; the CANN "
                             "execution provider gets the standard graph (float16 or "
                             "float32 weights): use weights exact, or graph contrib")
    half = flavour == "standard" and o.standard_dtype == "float16"
    max_seq_len, num_slots = size.seq_len(cfg), size.slots(cfg, 2 if half else 4)
    o = replace(o, providers=tuple(chosen))
    need = None
    if flavour == "standard":
        need = check_standard_memory(f, cfg, o, slots=num_slots, max_seq_len=max_seq_len,
                                     log=log)
    compact = WEIGHT_MODES[o.weights]
    be = OrtBackend(f, cfg, o, num_slots=num_slots, max_seq_len=max_seq_len,
                    graph_options=GraphOptions(
                        verify_rows=VERIFY_ROWS if o.speculation else 0, compact=compact,
                        flavour=flavour, kernels=resolve_kernels(o.kernels, flavour, compact),
                        standard_dtype=o.standard_dtype,
                        **({} if o.batch_invariant else {"row_multiples": ()})))
    be.memory_need = need
    return be
