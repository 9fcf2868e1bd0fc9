"""How a model is loaded and run: one frozen value built once from the configuration
(:func:`tiny_mindie.service.lifecycle.load_llm`, or :class:`tiny_mindie.LLM`'s keywords) and
handed to the loader (:func:`.loader.load_model`), the backends and the draft model's loader.

Like :mod:`tiny_mindie.model` it imports no numpy: the configuration names these choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from . import BACKENDS, DEFAULT_BACKEND, GRAPH_FLAVOURS, KERNEL_MODES, STANDARD_DTYPES, WEIGHT_MODES


@dataclass(frozen=True)
class BackendOptions:
    """The backend's choices (``BackendConfig`` in the configuration).

    Attributes:
        backend: ``"onnxruntime"`` or ``"numpy"`` (:data:`~tiny_mindie.model.BACKENDS`).
        threads: intra-op threads (0: the backend's default, every CPU).
        parallel_runs: onnxruntime session runs executed at once (0: CPUs // threads; see
            :mod:`tiny_mindie.model.ort.ort_backend`).
        batch_invariant: onnxruntime: pad the matrix products whose kernels need it and check
            at start-up that a row gets the same logits alone and in a batch (see
            ``graph_nodes._pad_rows``); ``False`` leaves both out (a lone stream of a 4-bit
            model may then decode faster, but a row's logits may change with the batch). The
            numpy backend is not batch-invariant either way.
        weights: a weight mode of :data:`~tiny_mindie.model.WEIGHT_MODES` (``exact``,
            ``compact``); the numpy backend takes ``exact`` only.
        device_id: the NPU of the CANN execution provider.
        providers: onnxruntime execution providers to ask for, names or ``[name, {options}]``
            (a list is kept as a tuple); empty: chosen (CANN when Ascend's runtime loads, else
            the CPU).
        graph: onnxruntime: ``auto`` (``standard`` on the CANN provider, else ``contrib``),
            ``contrib`` or ``standard`` (:data:`~tiny_mindie.model.GRAPH_FLAVOURS`).
        kernels: onnxruntime: the matrix products' kernels, ``onnxruntime``, ``custom`` or
            ``auto`` (:func:`.ort.ort_session.resolve_kernels`).
        standard_dtype: the standard graph's ``float16`` or ``float32``
            (:data:`~tiny_mindie.model.STANDARD_DTYPES`).
        speculation: onnxruntime: build the graph with its verification path
            (``GraphOptions.verify_rows``) for speculative decoding; without it a decode step
            skips an ``If`` per layer.
        spinning: onnxruntime: idle intra-op threads spin between runs (lower latency); off for
            a session whose runs alternate with another's (a draft model), whose threads would
            otherwise take the cores from the other's.

    Raises:
        ValueError: an unknown backend, a negative count (``threads``, ``parallel_runs``,
            ``device_id``), or choices it does not take together (:func:`check_weight_mode`).
    """

    backend: str = DEFAULT_BACKEND
    threads: int = 0
    parallel_runs: int = 0
    batch_invariant: bool = True
    weights: str = "exact"
    device_id: int = 0
    providers: tuple = ()
    graph: str = "auto"
    kernels: str = "auto"
    standard_dtype: str = "float16"
    speculation: bool = True
    spinning: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", tuple(self.providers or ()))
        for name in ("threads", "parallel_runs", "device_id"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of "
                             f"{', '.join(BACKENDS)}")
        check_weight_mode(self.backend, self.weights, self.graph, self.kernels,
                          self.standard_dtype)

    @classmethod
    def names(cls) -> frozenset[str]:
        """The fields' names."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def pick(cls, values: Mapping[str, Any]) -> BackendOptions:
        """The options named in ``values`` (other names are left out), the rest defaults.

        Raises:
            ValueError: as :class:`BackendOptions`.
        """
        return cls(**{k: v for k, v in values.items() if k in cls.names()})


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


@dataclass(frozen=True)
class SessionTuning:
    """How the onnxruntime backend opens its session, beyond :class:`BackendOptions` (the
    defaults are the server's; tests and scripts change them).

    Attributes:
        max_chunk_tokens: the longest piece of a prefill chunk run at once, tokens.
        session_config: extra onnxruntime session config entries (``add_session_config_entry``).
        release_pages: after loading, give back the weight-file pages onnxruntime read while
            prepacking (see :func:`.ort.memory.release_file_pages`).
        huge_pages: after loading, move the prepacked weights to huge pages
            (:func:`.ort.memory.use_huge_pages`), in the background.
    """

    max_chunk_tokens: int = 256
    session_config: Mapping[str, str] | None = None
    release_pages: bool = True
    huge_pages: bool = True
