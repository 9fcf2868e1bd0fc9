"""Build the ONNX graph of a GGUF decoder, node by node, with ``onnx.helper``.

Nothing is exported from a framework: every node below is written here from the model's
architecture parameters (:class:`~tiny_mindie.model.config.ModelConfig`) and its GGUF tensors.
The graph uses ONNX Runtime's contrib operators (domain ``com.microsoft``) where they are the fast
path on CPU: ``GroupQueryAttention`` (KV cache updated in place, rotary inside),
``MatMulNBits`` (block-quantized weights), ``SkipSimplifiedLayerNormalization`` and
``GatherBlockQuantized``; ``SimplifiedLayerNormalization`` is a default-domain op.

Graph inputs and outputs (``B`` rows, ``S`` tokens per row, ``L`` KV buffer length,
``Nkv`` = ``num_kv_heads``, ``H`` = ``head_dim``, ``V`` = ``vocab_size``; all dynamic except
``Nkv``, ``H``, ``V``)::

    input_ids              int64   [B, S]          token ids; rows shorter than S are right-padded
    seqlens_k              int32   [B]             per row: (tokens in the KV buffer after this
                                                   call, padding included) - 1
    total_sequence_length  int32   []              max over rows of seqlens_k + 1
    logits_index           int64   [B]             per row: b * S + (index of its last real token)
    past_key.{i}           float32 [B, Nkv, L, H]  layer i's key cache (i = 0 .. num_layers-1)
    past_value.{i}         float32 [B, Nkv, L, H]  layer i's value cache

    logits                 float32 [B', V]         logits of the token at logits_index; B' is B
                                                   rounded up to a multiple of the metadata
                                                   entry ``tiny_mindie.logits_row_multiple``
                                                   (rows past B repeat row B - 1: ignore them)
    present_key.{i}        float32 [B, Nkv, L, H]  bind to the SAME buffer as past_key.{i}
    present_value.{i}      float32 [B, Nkv, L, H]  bind to the SAME buffer as past_value.{i}

Inside, activations are 2-D, ``[T, D]`` with ``T = B * S`` (``logits_index`` indexes ``T``);
a MatMulNBits whose kernels compute a row otherwise depending on the number of rows gets its
input padded to a multiple of rows and its output cut back (:func:`_pad_rows`, and
``GraphOptions.row_multiples`` for which); per layer, with ``h`` the residual stream::

    x, h = SkipSimplifiedLayerNormalization(h, previous block's output, attn_norm)   # h += .., x = norm(h)
    qkv  = MatMulNBits(x, [Wq/sqrt(H); Wk; Wv]) (+ Q4_1 residual, see below)   # [T, (Nq + 2 Nkv) H]
    a    = GroupQueryAttention(qkv as [B, S, .], past/present K/V, rotary cos/sin caches, scale=1)
    o    = MatMulNBits(a, Wo)
    x, h = SkipSimplifiedLayerNormalization(h, o, ffn_norm)
    g, u = Split(MatMulNBits(x, [Wgate; Wup]))
    out  = MatMulNBits(silu(g) * u, Wdown)

Qwen2 (``qwen2``) is the same graph plus an ``Add`` of the q/k/v biases after the fused QKV
projection (the q bias scaled like the q weights), and ``rotary_interleaved=0``: llama.cpp's
converter keeps Qwen2's Q/K rows in HF order, rotated in NEOX mode (pairs ``x[i], x[i + H/2]``)
instead of LLaMA's adjacent pairs.

Gemma 3 (``gemma3``) adds: the embedding times ``sqrt(D)`` (a float32 ``Mul``, as the
reference); q and k heads RMS-normalized over ``H`` (``SimplifiedLayerNormalization`` on
``[T, N, H]``) before GroupQueryAttention, the power-of-two attention scale (1/16) folded into
the q norm's weights instead of Wq; ``SimplifiedLayerNormalization`` of the attention and MLP
outputs before each residual add; ``Gelu(approximate="tanh")`` instead of SiLU; NEOX rope; and on
local layers (``(i + 1) % 6 != 0``) ``local_window_size = sliding_window`` (measured on
onnxruntime 1.24: a query at ``p`` then sees the ``w`` keys ``p - w + 1 .. p``, the reference's
``p - key < window``) with a second pair of cos/sin caches at the local rotary base (10000).

(the first layer's norm is a plain ``SimplifiedLayerNormalization``); then the rows at
``logits_index`` are gathered, normalized (``output_norm``) and multiplied by the LM head.
The attention scale ``1/sqrt(H)`` is folded into the query weights when it is a power of two
(``H`` = 64: 1/8, exact), see :func:`_power_of_two`; otherwise GroupQueryAttention
applies it.

GroupQueryAttention semantics this graph relies on (CPU kernel of onnxruntime 1.24): with
``past_key`` and ``present_key`` sharing one buffer, row ``b`` writes its ``S`` new keys at
positions ``[seqlens_k[b] + 1 - S, seqlens_k[b] + 1)`` and its queries attend causally to
positions ``[0, own position]``; rotary positions are the same cache positions. ``S > 1`` with
past context (a prompt chunk after the first) is only accepted at ``B == 1``; ``S == 1`` (decode)
and ``S == total_sequence_length`` (first prompt chunks, all rows starting at 0) take any ``B``.
Right padding therefore writes junk keys *after* a row's real tokens, which no real token attends
to and the row's next chunk overwrites (see ``ort_backend.py``).

Weights (GGUF type -> graph representation; "exact" means the ONNX weights dequantize to the
same float32 values as ``GGUFFile.dequantize``, bit for bit):

- ``Q4_0``: ``MatMulNBits`` bits=4, block 32, scale ``d``, default zero point 8.  Exact.
- ``Q4_1`` (``w = d*q + m``): ``MatMulNBits`` bits=4, block 32, scale ``d``, uint8 zero point
  ``z = round(-m/d)``, plus the residual ``r = m + d*z`` (exact in float32) as a correction
  ``blocksum(x) @ r.T`` (per block ``w . x = d * ((q - z) . x) + r * sum(x)``): per matrix a
  free Reshape, a ReduceSum and one Gemm that also adds.  Exact.
  MatMulNBits' float zero points could express ``-m/d`` only with rounding, and they turn off its
  packed kernels.  (MLAS's int8 kernel computes exactly this kind of correction internally,
  ``ABlockSum @ QuantBBlkSum``, but derives ``QuantBBlkSum = -scale * zero_point`` at prepack,
  so ``m`` itself cannot be handed to it.)  Cost, measured at decode, 2 threads: the
  corrections are ~15 % of a step (mostly reading ``r``, 13 MB of float32 per token for
  SmolLM2-135M, in single-threaded Gemms).
- ``Q8_0``: ``MatMulNBits`` bits=8, block 32, scale ``d``, default zero point 128
  (``u = q + 128``).  Exact.  The token embedding is read with ``GatherBlockQuantized`` (8 bits,
  data ``[V, D/32, 32]``, ``quantize_axis=2``) on the same bytes; a tied LM head is a
  ``MatMulNBits`` on a second copy in the weight file (onnxruntime repacks that one into its own
  buffer and drops the file pages, while the gather only touches the rows it reads).  Not exact
  by default: an 8-bit LM head is requantized to blocks of 128 where they divide ``D``
  (``GraphOptions.lm_head_block``; see :func:`lm_head_weight` for why and what it costs).
- ``Q5_0`` (``w = d * (q - 16)``, 5-bit q): ``MatMulNBits`` bits=8, scale ``d``, default zero
  point 128 (``u = q - 16 + 128``).  Exact.
- anything else (F16, BF16, F32 matrices, Q4_K, Q6_K, ...): dequantized and requantized to
  symmetric 8-bit blocks of 32 (``scale = absmax / 127``); the error is at most half a step,
  ``absmax / 254`` per block.  Measured on Gemma 3 270M's Q4_K and Q6_K matrices: relative
  (Frobenius) error 0.55-0.60 %, every block within the bound (tests/test_ort_backend.py).
  Q4_K (``w = (d * sc_j) * q - dmin * m_j`` per 32-block) fits Q4_1's exact form above; tried
  on Gemma 3 270M (all 27 Q4_K matrices bit-exact), it made a decode step 4-5 % *slower* than
  8-bit (the residual's three extra nodes per matrix cost more than the 8.5 MB of weights they
  save per token), and its 0.6 % weight error is far below the int8-activation noise, so K-quants
  stay requantized.
- 1-D tensors (norm weights): float32.

The built model is saved as ``model.onnx`` plus one external weight file ``model.onnx.data``
(tensors aligned to 4 KiB so ONNX Runtime can memory-map them); ONNX IR version 10,
default-domain opset 21, ``com.microsoft`` opset 1 (onnxruntime-cann 1.24.4 refuses IR 14,
which ``onnx`` writes unless told).
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .config import ModelConfig
from .gguf import GGUFFile, ModelFileError, RawTensor

#: Bump whenever the graph or the weight layout changes: cached graphs from older builders are
#: then rebuilt instead of loaded.
BUILDER_VERSION = 7

#: ``model.onnx`` metadata entries: the graph options' key, and ``"even"`` or ``"all"`` for the
#: rows of the ``logits`` output (see the table above).
GRAPH_OPTIONS_KEY = "tiny_mindie.graph_options"
LOGITS_ROWS_KEY = "tiny_mindie.logits_row_multiple"

IR_VERSION = 10
OPSET = 21
MS_DOMAIN = "com.microsoft"
BLOCK = 32
_ALIGN = 4096


# ---- weight packing (GGUF blocks -> MatMulNBits) --------------------------------------------

@dataclass
class NBitsWeight:
    """A matrix ``W [N, K]`` in MatMulNBits form.

    ``W[n, k] = scales[n, b] * (q[n, k] - zp[n, b]) + (mins[n, b] if mins is not None else 0)``
    with ``b = k // block``. ``data`` is ``uint8 [N, K/block, block*bits/8]`` (4-bit: element
    ``2i`` in the low nibble of byte ``i``, ``2i+1`` in the high nibble); ``zero_points`` is
    ``None`` (the default ``2**(bits-1)``) or ``uint8 [N, ceil(K/block * bits / 8)]`` packed the
    same way. ``block`` is 32 (GGUF's blocks) unless requantized (:func:`quantize_8bit`).
    """

    bits: int
    n: int
    k: int
    data: np.ndarray
    scales: np.ndarray          # float32 [N, K/32]
    zero_points: np.ndarray | None
    mins: np.ndarray | None     # float32 [N, K/32] per-block residual added to W (Q4_1 only)
    exact: bool = True
    block: int = BLOCK


def _blocks(raw: RawTensor, block_bytes: int) -> np.ndarray:
    n, k = raw.shape
    if k % BLOCK:
        raise ModelFileError(f"{raw.name}: row length {k} is not a multiple of {BLOCK}")
    return np.asarray(raw.data).reshape(n, k // BLOCK, block_bytes)


def _nibbles_to_pairs(qs: np.ndarray) -> np.ndarray:
    """ggml 4-bit block ``[..., 16]`` (low nibbles = elements 0..15, high = 16..31) ->
    MatMulNBits layout ``[..., 16]`` (element 2i low, 2i+1 high)."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)            # [..., 32] values 0..15
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def pack_q4_0(raw: RawTensor) -> NBitsWeight:
    """GGUF Q4_0 (``w = d * (q - 8)``) -> 4-bit MatMulNBits with the default zero point 8."""
    n, k = raw.shape
    b = _blocks(raw, 18)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return NBitsWeight(4, n, k, _nibbles_to_pairs(b[..., 2:18]), d, None, None)


def pack_q4_1(raw: RawTensor) -> NBitsWeight:
    """GGUF Q4_1 (``w = d * q + m``) -> 4-bit MatMulNBits plus a per-block residual.

    The zero point is the integer nearest to ``-m / d`` (clamped to 0..15), ``z``; the residual
    ``r = m + d * z`` is then small (about ``d / 2``) and exact in float32, so
    ``w = d * (q - z) + r`` holds bit for bit (``d * (q - z)`` is exact too, and both sides round
    the same real number once). Centring ``q`` this way keeps the kernel's int8 activation error
    proportional to ``w`` instead of to ``d * q`` (which would cancel against ``m``).
    """
    n, k = raw.shape
    b = _blocks(raw, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    d64, m64 = d.astype(np.float64), m.astype(np.float64)
    z = np.clip(np.rint(np.divide(-m64, d64, out=np.zeros_like(d64), where=d64 != 0)), 0, 15)
    r64 = m64 + d64 * z
    inexact = r64.astype(np.float32).astype(np.float64) != r64
    z[inexact] = 0                                  # keep exactness: r = m when z = 0
    r = (m64 + d64 * z).astype(np.float32)
    z = z.astype(np.uint8)
    nb = k // BLOCK
    if nb % 2:
        z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
    zp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    return NBitsWeight(4, n, k, _nibbles_to_pairs(b[..., 4:20]), d, zp, r)


def pack_q8_0(raw: RawTensor) -> NBitsWeight:
    """GGUF Q8_0 (``w = d * q``, q int8) -> 8-bit MatMulNBits, default zero point 128."""
    n, k = raw.shape
    b = _blocks(raw, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    u = b[..., 2:34] ^ np.uint8(0x80)                             # int8 q -> uint8 q + 128
    return NBitsWeight(8, n, k, np.ascontiguousarray(u), d, None, None)


def pack_q5_0(raw: RawTensor) -> NBitsWeight:
    """GGUF Q5_0 (``w = d * (q - 16)``, q 5-bit: low nibbles in ``qs``, fifth bits in the 32-bit
    ``qh``) -> 8-bit MatMulNBits with the default zero point 128 (``u = q - 16 + 128``). Exact."""
    n, k = raw.shape
    b = _blocks(raw, 22)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qh = b[..., 2:6].copy().view("<u4")[..., 0]                       # [N, K/32]
    qs = b[..., 6:22]
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                 # [N, K/32, 32]
    hi = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    u = ((lo | (hi << 4)).astype(np.int16) + (128 - 16)).astype(np.uint8)
    return NBitsWeight(8, n, k, np.ascontiguousarray(u), d, None, None)


def quantize_8bit(w: np.ndarray, block: int = BLOCK) -> NBitsWeight:
    """Float ``w [N, K]`` -> symmetric 8-bit blocks of ``block`` (a power of two dividing
    ``K``; error <= absmax/254 per block)."""
    n, k = w.shape
    blocks = w.reshape(n, k // block, block).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1)
    scale = (amax / 127.0).astype(np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int16) + 128
    return NBitsWeight(8, n, k, q.astype(np.uint8), scale, None, None, exact=False, block=block)


def lm_head_weight(w: NBitsWeight, block: int) -> NBitsWeight:
    """The LM head as the graph computes it: an 8-bit ``w`` requantized to blocks of ``block``
    when that is larger than its own and divides ``K``; else ``w`` unchanged.

    Why: onnxruntime's 8-bit MatMulNBits kernel (1.24, AVX2, int8 activations) spends its time
    per block, not per byte: on Gemma 3's 262,144 x 640 head it takes 7.4 ms at blocks of 32
    and 3.8 ms at blocks of 128 (2 threads), and the head is half of a decode step. The cost:
    a second rounding of a Q8_0 weight (within half a step of its block of 128); measured on
    Gemma 3 270M, the mean NLL of tests/data/english_paragraph.txt moves from 2.8690 to 2.8702
    nats, and a batch-1 decode step takes 12.8 instead of 15.7 ms (same host, alternating
    order).
    """
    if w.bits != 8 or block <= w.block or w.k % block:
        return w
    out = NBitsWeight(8, w.n, w.k, np.empty((w.n, w.k // block, block), np.uint8),
                      np.empty((w.n, w.k // block), np.float32), None, None, exact=False, block=block)
    rows = 8192                      # in pieces: float32 [262144, 640] alone would be 671 MB
    for a in range(0, w.n, rows):
        part = quantize_8bit(unpack_nbits(NBitsWeight(
            8, min(rows, w.n - a), w.k, w.data[a:a + rows], w.scales[a:a + rows],
            None if w.zero_points is None else w.zero_points[a:a + rows], None, w.exact, w.block)),
            block)
        out.data[a:a + rows], out.scales[a:a + rows] = part.data, part.scales
    return out


def pack_weight(f: GGUFFile, name: str) -> NBitsWeight:
    """The matrix ``name`` of ``f`` in MatMulNBits form (exactly where the type allows)."""
    raw = f.raw(name)
    if len(raw.shape) != 2:
        raise ModelFileError(f"{name}: expected a matrix, got shape {raw.shape}")
    packer = {"Q4_0": pack_q4_0, "Q4_1": pack_q4_1, "Q5_0": pack_q5_0,
              "Q8_0": pack_q8_0}.get(raw.qtype)
    if packer is not None:
        return packer(raw)
    return quantize_8bit(f.dequantize(name))


def unpack_nbits(w: NBitsWeight) -> np.ndarray:
    """Dequantize a MatMulNBits weight to float32 ``[N, K]`` the way ONNX Runtime defines it
    (``scale * (q - zero_point)``, plus the block minimum for Q4_1); used to check packing."""
    if w.bits == 4:
        lo, hi = w.data & 0x0F, w.data >> 4
        q = np.stack([lo, hi], axis=-1).reshape(w.n, -1, w.block)
    else:
        q = w.data.reshape(w.n, -1, w.block)
    nb = q.shape[1]
    if w.zero_points is None:
        zp = np.full((w.n, nb), 2 ** (w.bits - 1), np.float32)
    elif w.bits == 4:
        zp = np.stack([w.zero_points & 0x0F, w.zero_points >> 4], -1).reshape(w.n, -1)[:, :nb]
    else:
        zp = w.zero_points[:, :nb]
    deq = w.scales[..., None] * (q.astype(np.float32) - zp.astype(np.float32)[..., None])
    if w.mins is not None:
        deq = deq + w.mins[..., None]
    return deq.reshape(w.n, w.k).astype(np.float32)


def concat_weights(ws: Sequence[NBitsWeight]) -> list[NBitsWeight]:
    """Stack matrices with the same input size along N where their forms match (fused QKV,
    fused gate/up); returns one weight per run of matching forms."""
    out: list[NBitsWeight] = []
    for w in ws:
        prev = out[-1] if out else None
        if (prev is not None and prev.bits == w.bits and prev.k == w.k and prev.block == w.block
                and (prev.zero_points is None) == (w.zero_points is None)
                and (prev.mins is None) == (w.mins is None)):
            out[-1] = NBitsWeight(
                w.bits, prev.n + w.n, w.k, np.concatenate([prev.data, w.data]),
                np.concatenate([prev.scales, w.scales]),
                None if w.zero_points is None else np.concatenate([prev.zero_points, w.zero_points]),
                None if w.mins is None else np.concatenate([prev.mins, w.mins]),
                prev.exact and w.exact, w.block)
        else:
            out.append(w)
    return out


def rope_cache(config: ModelConfig, positions: int,
               theta: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin caches ``float32 [positions, rope_dim/2]``: ``angle[p, i] = p * theta**(-2i/d)``
    (RoFormer eq. 15), computed in float64 then rounded; ``theta`` defaults to
    ``config.rope_theta`` (Gemma 3's local layers pass ``rope_theta_local``)."""
    d = config.rope_dim
    theta = config.rope_theta if theta is None else theta
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- graph construction ----------------------------------------------------------------------

class _Builder:
    """Collects nodes and initializers; initializers go to one external data file."""

    def __init__(self, data_path: str):
        from onnx import TensorProto, helper

        self.helper = helper
        self.TensorProto = TensorProto
        self.nodes: list = []
        self.inits: list = []
        self._n = 0
        self._data_name = os.path.basename(data_path)
        self._data = open(data_path, "wb")
        self._consts: dict = {}

    def close(self) -> None:
        self._data.close()

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def init(self, name: str, array: np.ndarray) -> str:
        """Add ``array`` as an initializer stored in the external data file."""
        array = np.ascontiguousarray(array)
        t = self.TensorProto()
        t.name = name
        t.data_type = self.helper.np_dtype_to_tensor_dtype(array.dtype)
        t.dims.extend(array.shape)
        if array.nbytes < 256:                      # tiny constants stay inline
            t.raw_data = array.tobytes()
        else:
            pos = self._data.tell()
            pad = (-pos) % _ALIGN
            if pad:
                self._data.write(b"\0" * pad)
                pos += pad
            self._data.write(memoryview(array).cast("B"))
            t.data_location = self.TensorProto.EXTERNAL
            for key, value in (("location", self._data_name), ("offset", str(pos)),
                               ("length", str(array.nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
        self.inits.append(t)
        return name

    def const(self, values, dtype=np.int64) -> str:
        """A small shared constant (shapes, axes)."""
        arr = np.asarray(values, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.init(self.name("const"), arr)
        return self._consts[key]

    def op(self, op_type: str, inputs: Sequence[str], n_out: int = 1, *, domain: str = "",
           name: str | None = None, outputs: Sequence[str] | None = None, **attrs) -> list[str]:
        name = name or self.name(op_type)
        outs = list(outputs) if outputs is not None else [f"{name}/out{i}" for i in range(n_out)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), outs, name=name,
                                                domain=domain or None, **attrs))
        return outs

    def op1(self, op_type: str, inputs: Sequence[str], **kw) -> str:
        return self.op(op_type, inputs, 1, **kw)[0]


def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def default_row_multiples() -> tuple[tuple[int, int], ...]:
    """``((bits, multiple), ...)``: the rows a MatMulNBits call with weights of ``bits`` bits is
    padded to a multiple of on this CPU (see :func:`_pad_rows`); 1 where its kernels give a row
    the same arithmetic whatever the number of rows.

    x86-64: 4-bit 2 (AVX2 and AVX-VNNI take a one-row kernel at M = 1); 8-bit 1, or 2 with
    AVX-512 (an odd last row was computed by another path there). Elsewhere (aarch64: NEON
    computes 4-bit rows in tiles of 4 and the rows left over otherwise): 4-bit 4, 8-bit 1.
    """
    if platform.machine().lower() in ("x86_64", "amd64", "x64"):
        return (4, 2), (8, 2 if "avx512f" in cpu_flags() else 1)
    return (4, 4), (8, 1)


@dataclass(frozen=True)
class GraphOptions:
    """Choices that change the built graph (part of the cache key).

    Attributes:
        accuracy_level: MatMulNBits ``accuracy_level`` of the layer matrices: 4 quantizes the
            activations to int8 per block inside the kernel (llama.cpp does the same; fastest on
            CPU), 0 computes in float32.
        lm_head_accuracy_level: the same for the LM head (8-bit weights).
        lm_head_block: an 8-bit LM head is requantized to blocks of this size when larger than
            its own (:func:`lm_head_weight`); 32 keeps a Q8_0 head exact.
        max_positions: rows of the rotary cos/sin caches (positions a sequence can reach).
        row_multiples: ``((bits, multiple), ...)``: a matrix product with weights of ``bits``
            bits runs on a multiple of ``multiple`` rows (:func:`_pad_rows`), so a row's logits
            do not depend on its batch; 1, or bits not listed, runs the rows as they are.
            Default: :func:`default_row_multiples` (for this CPU).
    """

    accuracy_level: int = 4
    lm_head_accuracy_level: int = 4
    lm_head_block: int = 128
    max_positions: int = 0          # 0: the model's context_length
    overrides: tuple[tuple[str, int], ...] = ()   # (matrix kind, accuracy level), e.g. ("ffn_down", 0)
    row_multiples: tuple[tuple[int, int], ...] = field(default_factory=default_row_multiples)

    def level(self, kind: str) -> int:
        """accuracy_level of the matrices named ``kind`` (``attn_qkv``, ``attn_output``,
        ``ffn_gate_up``, ``ffn_down``, ``lm_head``)."""
        for k, v in self.overrides:
            if k == kind:
                return v
        return self.lm_head_accuracy_level if kind == "lm_head" else self.accuracy_level

    def key(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in self.overrides)
        rows = ".".join(f"{b}x{m}" for b, m in self.row_multiples)
        return (f"a{self.accuracy_level}-h{self.lm_head_accuracy_level}-l{self.lm_head_block}"
                f"-p{self.max_positions}-r{rows}{extra}")

    def row_multiple(self, bits: int) -> int:
        """Rows a product with ``bits``-bit weights is padded to a multiple of (1: none)."""
        return dict(self.row_multiples).get(bits, 1)


def _linear(g: _Builder, x: str, ws: Sequence[NBitsWeight], prefix: str,
            options: GraphOptions, kind: str, rows: str, keep_padding: bool = False) -> str:
    """``x [T, K] -> [T, sum(N)]`` with MatMulNBits, plus ``blocksum(x) @ mins.T`` for Q4_1.

    ``rows`` holds ``T``; MatMulNBits runs on ``x`` padded to the row multiple of its weights'
    bits (:func:`_pad_rows`), and its output is cut back to ``T`` rows unless ``keep_padding``
    (then every weight must have the same multiple). ``kind`` names the matrices for
    ``options.level``.

    The block sums ``blocksum(x) [T, K/32]`` are a ``ReduceSum`` over ``x`` viewed as
    ``[T, K/32, 32]`` (the Reshape is free: no copy); the correction and the addition are one
    Gemm. Measured against a MatMul with a 0/1 block-indicator matrix (one node fewer, but a
    ``[K, K/32]`` float operand per call): about 4 % less CPU time per decode step.
    """
    outs = []
    for j, w in enumerate(concat_weights(ws)):
        p = f"{prefix}.{j}" if len(ws) > 1 else prefix
        m = options.row_multiple(w.bits)
        inputs = [_pad_rows(g, x, rows, m), g.init(p + ".qweight", w.data),
                  g.init(p + ".scales", w.scales.reshape(-1))]
        if w.zero_points is not None:
            inputs.append(g.init(p + ".qzeros", w.zero_points.reshape(-1)))
        y = g.op1("MatMulNBits", inputs, domain=MS_DOMAIN, name=p + "/MatMulNBits",
                  K=w.k, N=w.n, bits=w.bits, block_size=w.block,
                  accuracy_level=options.level(kind))                             # [T', N]
        if m > 1 and not keep_padding:
            y = g.op1("Slice", [y, g.const([0]), rows, g.const([0])])           # [T, N]
        if w.mins is not None:
            xb = g.op1("Reshape", [inputs[0] if keep_padding else x,
                                   g.const([-1, w.k // BLOCK, BLOCK])], name=p + "/blocks")
            bs = g.op1("ReduceSum", [xb, g.const([-1])], name=p + "/blocksum",
                       keepdims=0)                                              # [T, K/32]
            y = g.op1("Gemm", [bs, g.init(p + ".mins_t", np.ascontiguousarray(w.mins.T)), y],
                      name=p + "/add_mins")                                     # [T, N]
        outs.append(y)
    if len(outs) == 1:
        return outs[0]
    return g.op1("Concat", outs, axis=-1)


def _row_pads(g: _Builder, rows: str, multiple: int) -> str:
    """The ``Pad`` input that adds ``(-T) mod multiple`` rows at the end of a ``[T, D]`` tensor
    (``rows``: int64 ``[1]`` holding ``T``); made once per ``(rows, multiple)``."""
    key = ("row_pads", rows, multiple)
    if key not in g._consts:
        m = g.const([multiple])
        extra = g.op1("Mod", [g.op1("Sub", [m, g.op1("Mod", [rows, m])]), m])
        g._consts[key] = g.op1("Concat", [g.const([0, 0]), extra, g.const([0])], axis=0)
    return g._consts[key]


def _rows(g: _Builder, x: str) -> str:
    """int64 ``[1]``: the number of rows of ``x``."""
    return g.op1("Slice", [g.op1("Shape", [x]), g.const([0]), g.const([1])])


def _pad_rows(g: _Builder, x: str, rows: str, multiple: int) -> str:
    """``x [T, K] -> [T', K]``, ``T'`` the next multiple of ``multiple`` (the last row repeated
    into the new ones; ``rows`` holds ``T``).

    Why: onnxruntime's ``MatMulNBits`` kernels (MLAS, 1.24, int8 activations) compute a row by
    other arithmetic depending on how many rows share the call, and a row's logits would then
    depend on the batch it runs in (so would a seeded or greedy answer). Read in MLAS's sources
    and measured: on AVX2, with 4-bit weights a call of exactly one row takes a GEMV kernel
    (``CountM == 1``: signed 4-bit products, no block-sum correction) that rounds otherwise than
    the two-row kernel of every larger M (a decode row's logits moved by 0.46 over 30 layers);
    its 8-bit kernels compute every row alike. NEON computes 4-bit rows in tiles of 4 and the
    rows left over otherwise (measured under qemu-aarch64: 0.63 at batch 8). On AVX-512 an odd
    last row of 8-bit blocks of 128 was computed by another path than rows in pairs. MLAS
    quantizes the activations per row, so the repeated rows change nothing for the others.
    The cost, measured on AVX2: the two-row 4-bit kernel is ~20 % slower than the GEMV for one
    row, which is what a single stream pays (see :func:`default_row_multiples`).
    """
    if multiple <= 1:
        return x
    return g.op1("Pad", [x, _row_pads(g, rows, multiple)], mode="edge")


def _scaled(w: NBitsWeight, factor: float) -> NBitsWeight:
    """``w * factor`` for a power-of-two ``factor``: scales and residuals multiplied, which is
    exact in float32 (barring under/overflow), so the weight stays bit-exact up to that factor."""
    f = np.float32(factor)
    return NBitsWeight(w.bits, w.n, w.k, w.data, w.scales * f, w.zero_points,
                       None if w.mins is None else w.mins * f, w.exact, w.block)


def _power_of_two(s: float) -> float | None:
    """``s`` when it is a power of two (so multiplying by it is exact), else ``None``.

    The attention scale (``1/sqrt(head_dim)``: head_dim 4, 16, 64, 256, ...) is folded into the
    query weights when this holds, and GroupQueryAttention then runs with ``scale=1``. Why:
    onnxruntime's GroupQueryAttention computes ``Q K^T`` with an sgemm of ``alpha = scale``;
    MLAS takes its M=1 no-packing kernel only for ``alpha == 1`` and otherwise copies and
    transposes every head's keys into a packed buffer, every decode step (measured: about 10 %
    of single-thread decode samples in ``MlasSgemmTransposePackB16x4Avx``; gone with scale 1,
    decode CPU time about -5 %). Rotary embedding is linear, so scaling q before it is the same."""
    m, _ = math.frexp(s)
    return s if m == 0.5 else None


def _qk_norm(g: _Builder, f: GGUFFile, c: ModelConfig, p: str, qkv: str,
             q_fold: float | None, eps: float) -> str:
    """Gemma 3's q/k norm on the fused projection ``[T, (Nq + 2 Nkv) H]``: each q and k head
    RMS-normalized over ``H`` (``SimplifiedLayerNormalization`` on ``[T, N, H]``), v untouched.
    A power-of-two attention scale is folded into the q norm's weights (exact), since a scale
    folded into Wq would be normalized away."""
    hd = c.head_dim
    q, k, v = g.op("Split", [qkv, g.const([c.num_heads * hd, c.num_kv_heads * hd,
                                          c.num_kv_heads * hd])], 3, axis=-1)
    wq = f.dequantize(p + ".attn_q_norm.weight").astype(np.float32)
    if q_fold is not None:
        wq = wq * np.float32(q_fold)
    outs = []
    for name, t, w, n in (("q", q, wq, c.num_heads), ("k", k, None, c.num_kv_heads)):
        w = f.dequantize(p + ".attn_k_norm.weight").astype(np.float32) if w is None else w
        t3 = g.op1("Reshape", [t, g.const([-1, n, hd])])                   # [T, N, H]
        t3 = g.op1("SimplifiedLayerNormalization", [t3, g.init(f"{p}.attn_{name}_norm", w)],
                   name=f"{p}/attn_{name}_norm", axis=-1, epsilon=eps)
        outs.append(g.op1("Reshape", [t3, g.const([-1, n * hd])]))         # [T, N H]
    return g.op1("Concat", outs + [v], axis=-1)                              # [T, (Nq+2Nkv) H]


def build_model(f: GGUFFile, config: ModelConfig, out_dir: str,
                options: GraphOptions = GraphOptions()) -> str:
    """Write ``out_dir/model.onnx`` (+ ``model.onnx.data``) for the decoder in ``f``.

    Returns:
        the path of ``model.onnx``.

    Raises:
        ModelFileError: the architecture or a tensor is not supported.
    """
    from onnx import TensorProto, helper

    if config.architecture not in ("llama", "qwen2", "gemma3"):
        raise ModelFileError(f"the onnxruntime backend does not support architecture "
                             f"{config.architecture!r} yet; use --backend numpy")
    c = config
    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "model.onnx")
    g = _Builder(model_path + ".data")
    try:
        positions = options.max_positions or c.context_length
        cos, sin = rope_cache(c, positions)
        cos_name, sin_name = g.init("rope.cos", cos), g.init("rope.sin", sin)
        if c.sliding_window:                        # Gemma 3: local layers' own rotary base
            cos_l, sin_l = rope_cache(c, positions, c.rope_theta_local)
            cos_l_name, sin_l_name = g.init("rope_local.cos", cos_l), g.init("rope_local.sin", sin_l)

        # token embedding: GatherBlockQuantized on the 8-bit blocks  [B, S] -> [T = B*S, D]
        emb = pack_weight(f, "token_embd.weight")
        if emb.bits != 8 or emb.zero_points is not None or emb.mins is not None:
            emb = quantize_8bit(f.dequantize("token_embd.weight"))
        nb = emb.k // BLOCK
        emb_data = g.init("token_embd.qweight", emb.data.reshape(emb.n, nb, BLOCK))
        emb_scales = g.init("token_embd.scales3", emb.scales.reshape(emb.n, nb, 1))
        e = g.op1("GatherBlockQuantized", [emb_data, "input_ids", emb_scales], domain=MS_DOMAIN,
                  name="embed/GatherBlockQuantized", bits=8, block_size=BLOCK,
                  gather_axis=0, quantize_axis=2)                           # [B, S, nb, 32]
        h = g.op1("Reshape", [e, g.const([-1, c.hidden_size])])            # [T, D]
        if c.embedding_scale != 1.0:                # Gemma: * sqrt(D), in float32 like the reference
            h = g.op1("Mul", [h, g.const(np.float32(c.embedding_scale), np.float32)],
                      name="embed/scale")
        tokens = _rows(g, h)                        # T, for the row padding of _linear
        # [B, S, (Nq + 2 Nkv) H]: the shape GroupQueryAttention wants its packed QKV in
        qkv_shape = g.op1("Concat", [g.op1("Shape", ["input_ids"]),
                                     g.const([(c.num_heads + 2 * c.num_kv_heads) * c.head_dim])],
                          axis=0)

        eps = float(c.rms_eps)
        q_fold = _power_of_two(c.attn_scale)
        gqa_scale = 1.0 if q_fold is not None else float(c.attn_scale)
        pending = None      # output of the previous block, still to be added to the residual h
        for i in range(c.num_layers):
            p = f"blk.{i}"
            norm_w = g.init(p + ".attn_norm", f.dequantize(p + ".attn_norm.weight"))
            if pending is None:
                x = g.op1("SimplifiedLayerNormalization", [h, norm_w], name=p + "/attn_norm",
                          axis=-1, epsilon=eps)
            else:                                   # h += pending; x = norm(h)
                x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [h, pending, norm_w], 4,
                                  domain=MS_DOMAIN, name=p + "/attn_norm", epsilon=eps)
            # attention: fused QKV projection, GQA with rotary and the in-place cache
            wq, wk, wv = (pack_weight(f, f"{p}.attn_{t}.weight") for t in "qkv")
            if q_fold is not None and not c.qk_norm:
                wq = _scaled(wq, q_fold)
            qkv = _linear(g, x, [wq, wk, wv], p + ".attn_qkv", options, "attn_qkv",
                          tokens)                                           # [T, (Nq+2Nkv) H]
            if c.qkv_bias:                          # Qwen2: + [bq (scaled like Wq); bk; bv]
                bq, bk, bv = (f.dequantize(f"{p}.attn_{t}.bias").reshape(-1) for t in "qkv")
                if q_fold is not None:
                    bq = bq * np.float32(q_fold)    # power of two: exact
                b_qkv = np.concatenate([bq, bk, bv]).astype(np.float32)
                qkv = g.op1("Add", [qkv, g.init(p + ".attn_qkv.bias", b_qkv)],
                            name=p + "/attn_qkv_bias")                      # [T, (Nq+2Nkv) H]
            if c.qk_norm:                           # Gemma 3: RMSNorm of every q and k head
                qkv = _qk_norm(g, f, c, p, qkv, q_fold, eps)
            qkv = g.op1("Reshape", [qkv, qkv_shape])                        # [B, S, (Nq+2Nkv) H]
            local = c.is_local(i)
            window = {"local_window_size": c.sliding_window} if local else {}
            attn = g.op("GroupQueryAttention",
                        [qkv, "", "", f"past_key.{i}", f"past_value.{i}", "seqlens_k",
                         "total_sequence_length", cos_l_name if local else cos_name,
                         sin_l_name if local else sin_name],
                        domain=MS_DOMAIN, name=p + "/GroupQueryAttention",
                        outputs=[p + "/attn_out", f"present_key.{i}", f"present_value.{i}"],
                        num_heads=c.num_heads, kv_num_heads=c.num_kv_heads, do_rotary=1,
                        rotary_interleaved=0 if c.rope_neox else 1, scale=gqa_scale,
                        **window)[0]
            attn = g.op1("Reshape", [attn, g.const([-1, c.num_heads * c.head_dim])])  # [T, Nq H]
            o = _linear(g, attn, [pack_weight(f, p + ".attn_output.weight")], p + ".attn_output",
                        options, "attn_output", tokens)                                             # [T, D]
            if c.post_norms:                        # Gemma 3: norm the attention output first
                o = g.op1("SimplifiedLayerNormalization",
                          [o, g.init(p + ".post_attention_norm",
                                     f.dequantize(p + ".post_attention_norm.weight"))],
                          name=p + "/post_attention_norm", axis=-1, epsilon=eps)
            norm_w = g.init(p + ".ffn_norm", f.dequantize(p + ".ffn_norm.weight"))
            x, _, _, h = g.op("SkipSimplifiedLayerNormalization", [h, o, norm_w], 4,
                              domain=MS_DOMAIN, name=p + "/ffn_norm", epsilon=eps)
            # gated MLP: down(silu(gate(x)) * up(x))
            gu = _linear(g, x, [pack_weight(f, p + ".ffn_gate.weight"),
                                pack_weight(f, p + ".ffn_up.weight")],
                         p + ".ffn_gate_up", options, "ffn_gate_up", tokens)                          # [T, 2I]
            gate, up = g.op("Split", [gu], 2, axis=-1, num_outputs=2)        # 2 x [T, I]
            if c.mlp_act == "gelu_tanh":            # Gemma: GeGLU
                act = g.op1("Mul", [g.op1("Gelu", [gate], approximate="tanh"), up])
            else:
                act = g.op1("Mul", [g.op1("Mul", [gate, g.op1("Sigmoid", [gate])]), up])
            pending = _linear(g, act, [pack_weight(f, p + ".ffn_down.weight")], p + ".ffn_down",
                              options, "ffn_down", tokens)                                         # [T, D]
            if c.post_norms:
                pending = g.op1("SimplifiedLayerNormalization",
                                [pending, g.init(p + ".post_ffw_norm",
                                                 f.dequantize(p + ".post_ffw_norm.weight"))],
                                name=p + "/post_ffw_norm", axis=-1, epsilon=eps)

        # the token whose logits are wanted, per row: [T, D] -> [B, D]; final norm; LM head
        last_h = g.op1("Gather", [h, "logits_index"], axis=0)
        last_p = g.op1("Gather", [pending, "logits_index"], axis=0)
        norm_w = g.init("output_norm", f.dequantize("output_norm.weight"))
        x = g.op("SkipSimplifiedLayerNormalization", [last_h, last_p, norm_w], 1,
                 domain=MS_DOMAIN, name="output_norm", epsilon=eps)[0]      # [B, D]
        head = lm_head_weight(emb if config.tied_embeddings else pack_weight(f, "output.weight"),
                              options.lm_head_block)
        head_name = "token_embd" if config.tied_embeddings else "output"
        head_rows = options.row_multiple(head.bits)         # logits keep the padding rows
        logits = _linear(g, x, [head], head_name + ".lm_head", options, "lm_head", _rows(g, x),
                         keep_padding=True)
        g.op("Identity", [logits], outputs=["logits"])                       # [B', V]

        F, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
        kv_shape = ["batch", c.num_kv_heads, "kv_len", c.head_dim]
        inputs = [helper.make_tensor_value_info("input_ids", I64, ["batch", "seq"]),
                  helper.make_tensor_value_info("seqlens_k", I32, ["batch"]),
                  helper.make_tensor_value_info("total_sequence_length", I32, []),
                  helper.make_tensor_value_info("logits_index", I64, ["batch"])]
        outputs = [helper.make_tensor_value_info("logits", F, ["logits_rows", c.vocab_size])]
        for i in range(c.num_layers):
            inputs += [helper.make_tensor_value_info(f"past_key.{i}", F, kv_shape),
                       helper.make_tensor_value_info(f"past_value.{i}", F, kv_shape)]
            outputs += [helper.make_tensor_value_info(f"present_key.{i}", F, kv_shape),
                        helper.make_tensor_value_info(f"present_value.{i}", F, kv_shape)]
        graph = helper.make_graph(g.nodes, "tiny_mindie_decoder", inputs, outputs, g.inits)
        model = helper.make_model(
            graph, ir_version=IR_VERSION, producer_name="tiny_mindie",
            producer_version=str(BUILDER_VERSION),
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
        for key, value in ((GRAPH_OPTIONS_KEY, options.key()),
                           (LOGITS_ROWS_KEY, str(head_rows))):
            meta = model.metadata_props.add()
            meta.key, meta.value = key, value
    finally:
        g.close()
    with open(model_path, "wb") as out:
        out.write(model.SerializeToString())
    return model_path
