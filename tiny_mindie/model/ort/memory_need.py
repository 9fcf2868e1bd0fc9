"""The memory the standard graph (:mod:`.graph_standard`) needs where it runs, stated before it
loads, and the refusal when the device or the host cannot hold it.

:func:`standard_need` is a pure computation from the model's tensor shapes and the settings
(no file, no device): three parts, in bytes --

- **weights**: every matrix of the GGUF at the graph's dtype on an NPU (float16: 2 bytes a
  value); on the CPU provider 4 bytes whatever the dtype (onnxruntime's CPU provider has no
  float16 ``MatMul``: it converts float16 matrices to float32 when it loads them, keeping the
  embedding's float16 table for the ``Gather`` too when the LM head shares it); vectors
  (norms, biases) and the rotary tables (cos and sin) float32;
- **KV cache**: keys and values of every layer for ``num_slots`` rows of ``max_seq_len + 1``
  positions (the scratch position, :mod:`.shapes`) at the graph's dtype, held in host
  memory and bound to every run; on an NPU a run's rows are copied to the device and back, so
  the device needs twice the cache for a decode run over every slot;
- **activations**: a bound on one session run's tensors: every tensor one decoder layer
  computes, plus the embedding and the LM head's, at the largest static shape the runs use (a
  decode run over every slot, or a prompt piece of ``max_chunk_tokens``, each attending to
  ``max_seq_len + 1`` positions), times the runs executed at once (:func:`activation_bytes`).

:func:`check_fits` compares the total with what the place it runs has: the CANN device's free
memory (Ascend's ``aclrtGetMemInfo``, :func:`device_free`) and the host's available memory
(``MemAvailable`` of ``/proc/meminfo``, and the cgroup's limit, :func:`host_available`); where
neither can be read nothing is refused.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..arch import ModelConfig
from ..gguf import ModelFileError
from ..options import BackendOptions

#: ``aclrtMemAttr`` values (Ascend's acl_rt.h): device HBM, else DDR (the edge SoCs have no HBM)
ACL_HBM_MEM, ACL_DDR_MEM = 1, 0
#: ``aclInit`` when another caller (the CANN provider) has initialized ACL already
ACL_ERROR_REPEAT_INITIALIZE = 100002
_F32 = 4


@dataclass(frozen=True)
class MemoryNeed:
    """Bytes the standard graph needs where it runs (see the module docstring).

    Attributes:
        where: ``"CPU"`` or ``"CANNExecutionProvider:<id>"``.
        dtype: the graph's dtype, ``"float16"`` or ``"float32"``.
        weights, kv_cache, activations: bytes on ``where``.
        host: bytes the host holds besides, on an NPU (the KV cache and the graph the provider
            reads); 0 on the CPU, where everything is host memory.
        slots, positions: the KV cache's rows and positions per row.
    """

    where: str
    dtype: str
    weights: int
    kv_cache: int
    activations: int
    host: int
    slots: int
    positions: int

    @property
    def total(self) -> int:
        """Bytes on :attr:`where`: weights, KV cache and activations."""
        return self.weights + self.kv_cache + self.activations

    def describe(self) -> str:
        """One line: the total and its parts in GB (10^9 bytes)."""
        host = f"; on the host {_gb(self.host)} besides" if self.host else ""
        return (f"{_gb(self.total)} on {self.where}: weights {_gb(self.weights)} "
                f"({self.dtype} graph), KV cache {_gb(self.kv_cache)} ({self.slots} slots x "
                f"{self.positions} positions), activations at most {_gb(self.activations)}"
                + host)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def weight_bytes(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig, dtype: str,
                 on_cpu: bool, max_positions: int) -> int:
    """Bytes of the standard graph's weights once loaded (module docstring).

    shapes: ``{GGUF tensor name: numpy shape}`` of the model's tensors; dtype: ``"float16"``
    or ``"float32"``; on_cpu: the CPU provider runs it; max_positions: rows of the rotary
    tables. Raises nothing."""
    half = dtype == "float16"
    matrix = _F32 if on_cpu or not half else 2
    total = 0
    for name, shape in shapes.items():
        n = _count(shape)
        if name == "token_embd.weight":
            total += n * (2 if half else _F32)
            if config.tied_embeddings and half and on_cpu:
                total += n * _F32                   # the LM head's float32 copy
        else:
            total += n * (matrix if len(shape) >= 2 else _F32)
    tables = 2 if config.rope_theta_local else 1
    return total + tables * 2 * max_positions * (config.rope_dim // 2) * _F32


def kv_bytes(config: ModelConfig, dtype: str, slots: int, positions: int) -> int:
    """Bytes of the KV cache: keys and values of every layer, ``slots`` rows of ``positions``
    positions, at ``dtype``'s size."""
    size = 2 if dtype == "float16" else _F32
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * slots * positions * size


def activation_bytes(config: ModelConfig, dtype: str, on_cpu: bool, rows: int, tokens: int,
                     span: int, logits_rows: int) -> int:
    """A bound on the bytes of one session run's tensors over ``rows`` rows of ``tokens``
    tokens attending to ``span`` positions, ``logits_rows`` of them with logits: the sum of
    every tensor one decoder layer computes (the layers' tensors live one layer at a time),
    the embedding's and the LM head's. A product's output counts at the graph's dtype and
    again at float32 (its ``Cast``); on the CPU provider products are float32.

    Per layer, with ``T = rows * tokens`` tokens, ``F = rows * Nq * tokens * span`` scores:
    each RMSNorm ``4`` float32 copies of its input and a float16 one; the QKV product's output
    and 4 float32 copies (cast, bias, split, reshape); rotary 5 float32 copies of q and k; the
    new keys and values transposed and cast; the key and value spans 5 copies; q 3 copies and
    a cast; the scores 2 at the product's dtype and 3 float32 (cast, bias, softmax); the
    attention output 3 copies and the output projection's; the MLP's gate-up product, its
    split, up to 8 float32 tensors of width ``I`` for the activation (GELU's; SiLU needs 3),
    its cast and the down product's; two residual adds. Raises nothing."""
    c, f = config, _F32
    h = _F32 if on_cpu or dtype != "float16" else 2
    t, d, inner = rows * tokens, c.hidden_size, c.intermediate_size
    a, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    e, scores = a + 2 * k, rows * c.num_heads * tokens * span
    norms = (4 if c.post_norms else 2) * (4 * f + h) * t * d
    if c.qk_norm:
        norms += (4 * f + h) * t * (a + k)
    attention = ((h + 4 * f) * t * e + 5 * f * t * (a + k) + 2 * (f + h) * t * k
                 + 5 * h * rows * k * span + (3 * f + h) * t * a + (2 * h + 3 * f) * scores
                 + 3 * h * t * a + (h + 2 * f) * t * d)
    mlp = (h + 2 * f) * t * 2 * inner + (8 * f + h) * t * inner + (h + 2 * f) * t * d
    ends = ((h + 2 * f) * t * d + (4 * f + 2 * h) * logits_rows * d
            + (h + f) * logits_rows * c.vocab_size)
    return norms + attention + mlp + ends


@dataclass(frozen=True)
class StandardPlan:
    """Where and how the standard graph runs: what :func:`standard_need` sizes.

    Attributes:
        dtype: ``"float16"`` or ``"float32"``.
        where: ``"CPU"`` or the NPU's name (``"CANNExecutionProvider:0"``).
        slots, max_seq_len: the KV cache's rows and the positions a sequence reaches.
        max_chunk_tokens: the longest prompt piece of a run.
        verify_rows: the tokens (all with logits) of a verification run, padded as the run
            pads them (0: none).
        parallel_runs: runs executed at once (each with its own tensors).
        max_positions: rows of the rotary tables.
    """

    dtype: str
    where: str
    slots: int
    max_seq_len: int
    max_chunk_tokens: int
    verify_rows: int
    parallel_runs: int
    max_positions: int


def standard_need(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig,
                  plan: StandardPlan) -> MemoryNeed:
    """The standard graph's :class:`MemoryNeed` where it runs (a pure computation).

    shapes: ``{GGUF tensor name: numpy shape}``; plan: where and how it runs. Raises
    nothing."""
    p = plan
    on_cpu = p.where == "CPU"
    positions = p.max_seq_len + 1
    runs = [(p.slots, 1, p.slots), (1, p.max_chunk_tokens, 1)]
    if p.verify_rows:
        runs.append((1, p.verify_rows, p.verify_rows))
    activations = p.parallel_runs * max(
        activation_bytes(config, p.dtype, on_cpu, b, s, positions, r) for b, s, r in runs)
    weights = weight_bytes(shapes, config, p.dtype, on_cpu, p.max_positions)
    cache = kv_bytes(config, p.dtype, p.slots, positions)
    if on_cpu:
        return MemoryNeed(p.where, p.dtype, weights, cache, activations, 0, p.slots, positions)
    # an NPU: a decode run over every slot copies the cache's rows in and out; the host keeps
    # the cache and the graph the provider reads (its weights at the graph's dtype)
    host = cache + weight_bytes(shapes, config, p.dtype, False, p.max_positions)
    return MemoryNeed(p.where, p.dtype, weights, 2 * cache, activations, host, p.slots,
                      positions)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


# ---- what there is ---------------------------------------------------------------------------

def host_available() -> int | None:
    """Bytes the host can give this process now: ``MemAvailable`` of ``/proc/meminfo``, less
    where the process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) allows
    less; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        room = _cgroup_room(limit, usage)
        if room is not None:
            found.append(room)
            break
    return min(found) if found else None


def _cgroup_room(limit_path: str, usage_path: str) -> int | None:
    """A cgroup's limit less its usage, or None where there is no (finite) limit."""
    try:
        with open(limit_path) as fh:
            limit = fh.read().strip()
        with open(usage_path) as fh:
            usage = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    if not limit.isdigit() or int(limit) >= 1 << 60:      # "max", or v1's "no limit"
        return None
    return max(0, int(limit) - usage)


def device_free(device_id: int) -> tuple[int, int] | None:
    """``(free, total)`` bytes of Ascend NPU ``device_id``'s memory, from Ascend's runtime
    (``aclInit``, a repeat accepted; ``aclrtSetDevice``; ``aclrtGetMemInfo`` of HBM, else of
    DDR; ``aclrtResetDevice``), or None where ``libascendcl.so`` does not load or a call
    fails. ACL is left initialized for the CANN provider (onnxruntime-cann accepts a repeated
    ``aclInit``)."""
    try:
        acl = ctypes.CDLL("libascendcl.so")
    except OSError:
        return None
    try:
        if acl.aclInit(None) not in (0, ACL_ERROR_REPEAT_INITIALIZE):
            return None
        if acl.aclrtSetDevice(ctypes.c_int32(device_id)) != 0:
            return None
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        try:
            for attr in (ACL_HBM_MEM, ACL_DDR_MEM):
                if (acl.aclrtGetMemInfo(attr, ctypes.byref(free), ctypes.byref(total)) == 0
                        and total.value):
                    return free.value, total.value
            return None
        finally:
            acl.aclrtResetDevice(ctypes.c_int32(device_id))
    except AttributeError:                  # a library without these entry points
        return None


def check_fits(need: MemoryNeed, model: str, device: tuple[int, int] | None,
               host: int | None) -> None:
    """Raise when the place ``need`` runs cannot hold it.

    device: ``(free, total)`` bytes of the NPU (:func:`device_free`; None: unknown or the
    CPU); host: the host's available bytes (:func:`host_available`; None: unknown). On the
    CPU the total is checked against ``host``; on an NPU the total against the device's free
    memory where it is known, and :attr:`MemoryNeed.host` against ``host``.

    Raises:
        ModelFileError: one line naming ``model``, what it needs and what there is.
    """
    hint = ("fewer KV slots (kvCacheMB, maxBatchSize), a shorter maxSeqLen, or a smaller model"
            + (", or --standard-dtype float16" if need.dtype != "float16" else ""))
    if need.where == "CPU":
        short = [("the host", need.total, host, "available")]
    else:
        short = [(f"device {need.where}", need.total, device[0] if device else None, "free"),
                 ("the host", need.host, host, "available")]
    for place, wanted, there, what in short:
        if there is not None and wanted > there:
            raise ModelFileError(f"{os.path.basename(model)} needs {need.describe()}; "
                                 f"{place} has {_gb(there)} {what}: use {hint}")


def check_standard_memory(f, config: ModelConfig, options: BackendOptions, *, slots: int,
                          max_seq_len: int, log) -> MemoryNeed:
    """State (``log.info``) and check (:func:`check_fits`) what the standard graph of the
    GGUF ``f`` needs on the first of ``options.providers`` (the chosen ones,
    :func:`.providers.select_providers`), with ``slots`` KV rows of ``max_seq_len`` positions
    and the backend's settings as :class:`.shapes.StaticShapes` will use them
    (``options``' dtype, device, speculation, threads and parallel runs). Returns the
    :class:`MemoryNeed`.

    Raises:
        ModelFileError: the device or the host cannot hold it (one line).
    """
    from ..backend import available_cpus
    from ..onnx.graph_options import VERIFY_ROWS
    from .providers import CPU, default_threads, device_name, provider_name
    from .shapes import MAX_CHUNK_TOKENS, MIN_CHUNK, bucket, buckets

    o = options
    first = provider_name(o.providers[0])
    on_cpu = first == CPU
    lanes = 1
    if on_cpu:
        lanes = min(o.parallel_runs
                    or max(1, available_cpus() // (o.threads or default_threads())), slots)
    verify = (bucket(VERIFY_ROWS, buckets(MIN_CHUNK, 4, MAX_CHUNK_TOKENS))
              if o.speculation and on_cpu else 0)
    shapes = {name: f.raw(name).shape for name in f.tensor_names()}
    need = standard_need(shapes, config, StandardPlan(
        dtype=o.standard_dtype, where=device_name(first, o.device_id), slots=slots,
        max_seq_len=max_seq_len, max_chunk_tokens=MAX_CHUNK_TOKENS, verify_rows=verify,
        parallel_runs=lanes,
        max_positions=max_seq_len if config.rope_factors_long else config.context_length))
    log.info("memory: the model needs %s", need.describe())
    check_fits(need, f.path, None if on_cpu else device_free(o.device_id), host_available())
    return need
