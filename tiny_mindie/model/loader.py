"""Open a GGUF and build its tokenizer and backend: the one place that knows every backend."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from . import GRAPH_FLAVOURS, KERNEL_MODES, STANDARD_DTYPES, WEIGHT_MODES
from .arch import ModelConfig
from .backend import BACKENDS, DEFAULT_BACKEND, Backend
from .gguf import GGUFFile, ModelFileError
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


def check_weight_mode(backend: str, weights: str, graph: str = "auto",
                      kernels: str = "onnxruntime", standard_dtype: str = "float16") -> None:
    """Raises ``ValueError`` unless ``backend`` takes the weight mode ``weights``, the
    graph ``graph`` and the kernels ``kernels`` (:data:`~tiny_mindie.model.WEIGHT_MODES`,
    :data:`~tiny_mindie.model.GRAPH_FLAVOURS` and :data:`~tiny_mindie.model.KERNEL_MODES` on
    onnxruntime; ``exact``, ``auto`` and ``onnxruntime`` on numpy; the standard graph holds
    exact weights only; ``custom`` kernels read the exact weights; ``standard_dtype``, one of
    :data:`~tiny_mindie.model.STANDARD_DTYPES`, other than the default where a standard graph
    may be built)."""
    if kernels not in KERNEL_MODES or (kernels == "custom" and (
            backend != "onnxruntime" or weights != "exact" or graph == "standard")):
        raise ValueError(f"kernels {kernels!r}: one of {', '.join(KERNEL_MODES)}; custom needs "
                         "the onnxruntime backend, its contrib graph and the exact weights")
    if weights not in WEIGHT_MODES or (weights != "exact" and backend != "onnxruntime"):
        raise ValueError(f"weights {weights!r}: the onnxruntime backend takes "
                         f"{', '.join(WEIGHT_MODES)}, the numpy backend exact only")
    if graph not in GRAPH_FLAVOURS or (graph != "auto" and backend != "onnxruntime"):
        raise ValueError(f"graph {graph!r}: the onnxruntime backend takes "
                         f"{', '.join(GRAPH_FLAVOURS)}, the numpy backend builds no graph")
    if standard_dtype not in STANDARD_DTYPES or (standard_dtype != STANDARD_DTYPES[0] and (
            backend != "onnxruntime" or graph == "contrib")):
        raise ValueError(f"standard dtype {standard_dtype!r}: one of "
                         f"{', '.join(STANDARD_DTYPES)}; {STANDARD_DTYPES[1]} shapes the "
                         "standard graph (the onnxruntime backend, graph auto or standard)")
    if graph == "standard" and weights != "exact":
        raise ValueError(f"weights {weights!r}: the standard graph holds the exact weights "
                         "only (float16 or float32)")


def load_model(path: str, *, backend: str = DEFAULT_BACKEND, num_slots: int | None = None,
               kv_cache_mb: int = 1024, max_batch: int = 200, max_seq_len: int = 2048,
               threads: int = 0, parallel_runs: int = 0, batch_invariant: bool = True,
               weights: str = "exact", device_id: int = 0, providers: list | None = None,
               speculation: bool = False, spinning: bool = True, graph: str = "auto",
               kernels: str = "onnxruntime", standard_dtype: str = "float16"
               ) -> tuple[GGUFFile, ModelConfig, Tokenizer, Backend]:
    """Load the model at ``path`` on ``backend``.

    Args:
        path: a ``.gguf`` file.
        backend: ``"numpy"`` or ``"onnxruntime"``.
        num_slots: sequences the KV cache holds at once; ``None``: as many as ``kv_cache_mb``
            MB hold, at most ``max_batch``.
        max_seq_len: tokens per sequence (capped by the model's trained context).
        threads: intra-op threads (0 = backend default).
        parallel_runs: onnxruntime runs executed at once (0 = CPUs // threads).
        batch_invariant: onnxruntime: pad the matrix products whose kernels need it and check
            at start-up that a row gets the same logits alone and in a batch (see
            ``graph_nodes._pad_rows``); ``False`` leaves both out (a lone stream of a 4-bit model
            may then decode faster, but a row's logits may change with the batch). The
            numpy backend is not batch-invariant either way.
        weights: onnxruntime: a weight mode of :data:`~tiny_mindie.model.WEIGHT_MODES`
            (``exact``, ``compact``); the numpy backend takes ``exact`` only.
        device_id: NPU device for the CANN execution provider.
        providers: onnxruntime execution providers to ask for, names or ``[name, {options}]``;
            ``None`` chooses (CANN when Ascend's runtime loads, else CPU).
        speculation: onnxruntime: build the graph with its verification path
            (``GraphOptions.verify_rows``) for speculative decoding; without it, a decode step
            skips an ``If`` per layer.
        graph: onnxruntime: ``auto`` (``standard`` on the CANN provider, else ``contrib``),
            ``contrib`` or ``standard`` (:data:`~tiny_mindie.model.GRAPH_FLAVOURS`).
        kernels: onnxruntime: the products' kernels (:func:`.ort_session.resolve_kernels`).
        standard_dtype: the standard graph's dtype (:data:`.graph_standard.DTYPES`).
        spinning: onnxruntime: idle intra-op threads spin between runs (lower latency); off
            for a session whose runs alternate with another's (a draft model), whose threads
            would otherwise take the cores from the other's.

    Raises:
        ModelFileError: missing/bad file, unsupported architecture or tokenizer.
        ValueError: unknown backend, or a weight mode the backend does not take.
    """
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    args = (f, cfg, backend, num_slots, kv_cache_mb, max_batch, max_seq_len, threads,
            parallel_runs, batch_invariant, device_id, providers, speculation, weights, spinning,
            graph, kernels, standard_dtype)
    if backend != "onnxruntime":
        return f, cfg, load_tokenizer(f), _load_backend(*args)
    # The tokenizer is read while the session is created (which releases the GIL): a large
    # vocabulary adds nothing to the start. Its errors are raised once the backend has loaded.
    with ThreadPoolExecutor(1, thread_name_prefix="tiny_mindie-tokenizer") as pool:
        tok_job = pool.submit(load_tokenizer, f)
        be = _load_backend(*args)
        try:
            tok = tok_job.result()
        except BaseException:
            be.close()
            raise
    return f, cfg, tok, be


def _load_backend(f: GGUFFile, cfg: ModelConfig, backend: str, num_slots: int | None,
                  kv_cache_mb: int, max_batch: int, max_seq_len: int, threads: int,
                  parallel_runs: int, batch_invariant: bool, device_id: int,
                  providers: list | None, speculation: bool = False,
                  weights: str = "exact", spinning: bool = True, graph: str = "auto",
                  kernels: str = "onnxruntime", standard_dtype: str = "float16") -> Backend:
    """The backend part of :func:`load_model` (same arguments)."""
    check_weight_mode(backend, weights, graph, kernels, standard_dtype)
    max_seq_len = min(max_seq_len, cfg.context_length)
    if backend == "numpy":
        from .reference.decoder import NumpyBackend
        if num_slots is None:
            num_slots = slots_for_budget(cfg, max_seq_len, kv_cache_mb, max_batch)
        return NumpyBackend(f, cfg, num_slots=num_slots, max_seq_len=max_seq_len)
    if backend != "onnxruntime":
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    try:
        return _ort_backend(f, cfg, num_slots, kv_cache_mb, max_batch, max_seq_len, threads,
                            parallel_runs, batch_invariant, device_id, providers, speculation,
                            weights, spinning, graph, kernels, standard_dtype)
    except ImportError as exc:   # onnx / onnxruntime missing or broken in this environment
        raise ModelFileError(f"the onnxruntime backend cannot load ({exc}); reinstall the "
                             f"project's dependencies or use --backend numpy") from None


def _ort_backend(f: GGUFFile, cfg: ModelConfig, num_slots: int | None, kv_cache_mb: int,
                 max_batch: int, max_seq_len: int, threads: int, parallel_runs: int,
                 batch_invariant: bool, device_id: int, providers: list | None,
                 speculation: bool, weights: str, spinning: bool, graph: str, kernels: str,
                 standard_dtype: str) -> Backend:
    """The onnxruntime backend of :func:`_load_backend`; the standard graph's memory stated
    and checked first (:func:`.memory_need.check_standard_memory`) and kept as the backend's
    ``memory_need`` (None for the contrib graph)."""
    from .onnx.graph_options import VERIFY_ROWS, GraphOptions
    from .ort.memory_need import check_standard_memory
    from .ort.ort_backend import OrtBackend
    from .ort.ort_session import resolve_kernels
    from .ort.providers import graph_flavour, select_providers

    chosen = select_providers(list(providers) if providers else None, device_id)
    flavour = graph_flavour(graph, chosen)
    if flavour == "standard" and weights != "exact":
        raise ModelFileError(f"weights {weights!r} need the contrib graph; the CANN "
                             "execution provider gets the standard graph (float16 or "
                             "float32 weights): use weights exact, or graph contrib")
    half = flavour == "standard" and standard_dtype == "float16"
    if num_slots is None:
        num_slots = slots_for_budget(cfg, max_seq_len, kv_cache_mb, max_batch,
                                     2 if half else 4)
    need = None
    if flavour == "standard":
        need = check_standard_memory(f, cfg, dtype=standard_dtype, chosen=chosen,
                                     device_id=device_id, slots=num_slots,
                                     max_seq_len=max_seq_len, speculation=speculation,
                                     threads=threads, parallel_runs=parallel_runs, log=log)
    kernels = resolve_kernels(kernels, flavour, WEIGHT_MODES[weights])
    be = OrtBackend(f, cfg, num_slots=num_slots, max_seq_len=max_seq_len, threads=threads,
               parallel_runs=parallel_runs, device_id=device_id, providers=chosen,
               graph_options=GraphOptions(
                   verify_rows=VERIFY_ROWS if speculation else 0,
                   compact=WEIGHT_MODES[weights], flavour=flavour, kernels=kernels,
                   standard_dtype=standard_dtype,
                   **({} if batch_invariant else {"row_multiples": ()})),
               check_batching=batch_invariant, spinning=spinning)
    be.memory_need = need
    return be
