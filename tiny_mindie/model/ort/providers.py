"""Where and how the ONNX Runtime session runs: execution providers, threads, session options.

``CANNExecutionProvider`` (Ascend NPU) is asked for only when Ascend's ``libascendcl.so`` loads
(asking without it makes onnxruntime print an error and a banner); otherwise the session runs on
``CPUExecutionProvider`` without a word. Users who bring another provider pass
``providers=[...]`` (names or ``(name, options)`` pairs, as onnxruntime takes them).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Sequence
from typing import Any

from ..backend import available_cpus

CANN = "CANNExecutionProvider"
CPU = "CPUExecutionProvider"
#: the CANN provider's ``precision_mode``: float32 where the NPU's operator computes it, float16
#: where it does not (the matrix products; see :mod:`.cann_ops`)
CANN_PRECISION_MODE = "allow_fp32_to_fp16"

#: session config entry that makes onnxruntime (>= 1.24) keep which provider runs which node
RECORD_PLACEMENT = "session.record_ep_graph_assignment_info"


def ascend_available() -> bool:
    """True when Ascend's runtime library ``libascendcl.so`` can be loaded."""
    try:
        ctypes.CDLL("libascendcl.so")
    except OSError:
        return False
    return True


def select_providers(providers: Sequence[Any] | None = None, device_id: int = 0) -> list:
    """The execution providers to ask onnxruntime for.

    Args:
        providers: explicit list (names or ``(name, options)``); ``None`` chooses: CANN on
            ``device_id`` when the build has it and ``libascendcl.so`` loads, then CPU.
        device_id: NPU for the CANN provider (MindIE's ``npuDeviceIds[0]``).
    """
    if providers is not None:
        return list(providers)
    import onnxruntime as ort

    chosen: list = []
    if CANN in ort.get_available_providers() and ascend_available():
        # no .om file per compiled shape written to the working directory (on by default)
        chosen.append((CANN, {"device_id": str(device_id),
                              "precision_mode": CANN_PRECISION_MODE, "dump_om_model": "0"}))
    chosen.append(CPU)
    return chosen


def graph_flavour(graph: str, chosen: Sequence[Any]) -> str:
    """The graph to build for ``graph`` (``auto``, ``contrib`` or ``standard``) on the
    ``chosen`` providers (:func:`select_providers`): ``auto`` is ``standard`` when the first is
    the CANN provider and Ascend's runtime loads (CANN takes no contrib operator), else
    ``contrib`` (the CPU's fast path; onnxruntime falls back to the CPU when CANN cannot
    load)."""
    if graph != "auto":
        return graph
    return "standard" if provider_name(chosen[0]) == CANN and ascend_available() else "contrib"


def provider_name(provider: Any) -> str:
    """The name of one entry of :func:`select_providers`' list (a name or ``(name, options)``)."""
    return provider if isinstance(provider, str) else provider[0]


def device_name(provider: str, device_id: int) -> str:
    """What a session on ``provider`` (the first it uses) runs on, as shown to users:
    ``"CPU"``, ``"CANNExecutionProvider:<device_id>"``, or the provider's name."""
    if provider == CPU:
        return "CPU"
    return f"{provider}:{device_id}" if provider == CANN else provider


def cpu_info() -> tuple[str, set[str]]:
    """``(model name, feature flags)`` of the first CPU in ``/proc/cpuinfo`` (x86's
    ``model name``/``flags``, aarch64's ``CPU part``/``Features``); ``("", set())`` where that
    file cannot be read."""
    model, flags = "", None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "CPU part") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and flags is None:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags or set()


def cpu_identity() -> str:
    """This CPU as kernels see it: machine type, model name and feature flags (sorted) of
    :func:`cpu_info`."""
    model, flags = cpu_info()
    return f"{platform.machine()} | {model} | {' '.join(sorted(flags))}"


def default_threads() -> int:
    """Intra-op threads when none are configured: every CPU this process may run on, so that
    one run -- a lone stream's decode step above all -- uses every core (the parallel runs then
    default to one: :attr:`.ort_backend.OrtBackend.parallel_runs`).

    The other choice, ``--threads 1`` (or ``intraOpThreads: 1``: one thread per run, CPUs runs
    at once), keeps a lone stream on one core: slower on a machine of its own, steadier where
    other processes keep the CPUs busy (docs/design/performance.md has both).
    """
    return available_cpus()


def session_options(threads: int, *, spinning: bool, config: dict[str, str] | None = None,
                    custom_ops: str | None = None):
    """``onnxruntime.SessionOptions`` for the decoder: all graph optimizations, ``threads``
    intra-op threads (sequential execution, one inter-op thread), idle threads spinning or not,
    errors-only logging (no banners, no warnings), the nodes' placement on execution providers
    recorded (:func:`node_placement`), plus the session config entries ``config``
    (``add_session_config_entry``) and the custom operator library at ``custom_ops``
    (``register_custom_ops_library``: :mod:`tiny_mindie.kernels`)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    so.add_session_config_entry(RECORD_PLACEMENT, "1")
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, str(value))
    if custom_ops:
        so.register_custom_ops_library(custom_ops)
    return so


def ops_by_provider(session) -> dict[str, dict[str, int]]:
    """Nodes of the optimized graph of ``session`` per execution provider (most nodes first)
    and operator type (most first), e.g. ``{"CPUExecutionProvider": {"MatMul": 120, ...}}``:
    what onnxruntime recorded when the session was created with :data:`RECORD_PLACEMENT`
    (``InferenceSession.get_provider_graph_assignment_info``, onnxruntime >= 1.24); empty when
    it cannot tell."""
    try:
        subgraphs = session.get_provider_graph_assignment_info()
    except (AttributeError, RuntimeError):      # older onnxruntime, or not recorded
        return {}
    ops: dict[str, dict[str, int]] = {}
    for sub in subgraphs:
        mine = ops.setdefault(sub.ep_name, {})
        for node in sub.get_nodes():
            mine[node.op_type] = mine.get(node.op_type, 0) + 1
    return {ep: dict(sorted(kinds.items(), key=lambda kv: -kv[1]))
            for ep, kinds in sorted(ops.items(), key=lambda kv: -sum(kv[1].values()))}


def node_placement(session) -> dict[str, int]:
    """Nodes of the optimized graph of ``session`` per execution provider, most first, e.g.
    ``{"CPUExecutionProvider": 1006}`` (:func:`ops_by_provider`, counted); empty when
    onnxruntime cannot tell."""
    return {ep: sum(kinds.values()) for ep, kinds in ops_by_provider(session).items()}


def placement_summary(counts: dict[str, int], ops: dict[str, dict[str, int]] | None = None
                      ) -> str:
    """``"CPU 1006 nodes"``, ``"CANN 950, CPU 57 nodes"``; ``"not reported"`` for none. With
    ``ops`` (:func:`ops_by_provider`), the operators of every provider after the first are
    named: ``"CANN 950, CPU 57 nodes (CPU: Gather 30, Shape 27)"``."""
    if not counts:
        return "not reported"
    text = ", ".join(f"{name.removesuffix('ExecutionProvider')} {n}"
                     for name, n in counts.items()) + " nodes"
    rest = [f"{name.removesuffix('ExecutionProvider')}: "
            + ", ".join(f"{op} {n}" for op, n in ops[name].items())
            for name in list(counts)[1:] if ops and name in ops]
    return text + (f" ({'; '.join(rest)})" if rest else "")
