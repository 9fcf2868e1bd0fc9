"""Weight packing: the GGUF's tensors as the arrays the ONNX graph (:mod:`.graph`) holds.

A matrix ``W [N, K]`` (GGUF rows: ``N`` outputs of ``K`` inputs) becomes an :class:`NBitsWeight`,
the operand of onnxruntime's ``MatMulNBits``; norm weights and biases stay float32 vectors.
"Exact" means the packed weight dequantizes to the same float32 values as
``GGUFFile.dequantize`` (gguf's ``quants.dequantize``), bit for bit. The table below is the
weight mode ``exact``; the mode ``compact`` requantizes every matrix to 4-bit blocks instead
(:func:`quantize_4bit`; what each mode costs in bytes and quality: docs/design/weights.md). Each
layer's matrices are assembled from these in :mod:`.graph_weights`.

What each GGUF type becomes, and the largest error measured (``max |w - dequant| / max |w|``
over a matrix: random blocks of every type, and for Q4_K, Q6_K, Q5_0, Q8_0 and Q4_1 all
matrices of gemma-3-270m Q4_K_M and SmolLM2-135M Q4_1):

==========================  ===================================================  =========
GGUF type                   MatMulNBits form                                     error
==========================  ===================================================  =========
Q4_0                        4-bit, block 32, scale ``d``, default zero point 8   0 (exact)
Q4_1, Q4_K                  4-bit, block 32, uint8 zero point + residual [a]_    0 (exact)
Q5_0                        8-bit, block 32, ``u = q - 16 + 128``                0 (exact)
Q5_1, Q5_K                  8-bit, block 32, uint8 zero point + residual [a]_    0 (exact)
Q8_0                        8-bit, block 32, ``u = q + 128``                     0 (exact)
Q6_K [c]_, F32, F16, BF16,  requantized: symmetric 8-bit, block 32,              <= 1/254
Q2_K, Q3_K, IQ*, TQ*, MXFP4 ``scale = absmax / 127`` [b]_                        (0.0039)
Q8_1, Q8_K                  refused (``ModelFileError``): gguf cannot read them  --
==========================  ===================================================  =========

.. [a] A block ``w = d * q + m`` (Q4_1, Q5_1; Q4_K and Q5_K per 32-block with ``d = d*sc`` and
   ``m = -dmin*m``) runs as ``d * (q - z) + r``: ``z`` the uint8 zero point nearest to
   ``-m / d``, and the residual ``r = m + d * z``, which the graph adds as
   ``blocksum(x) @ r.T`` (:func:`.graph_nodes.linear`; :func:`_affine`). The alternatives, measured
   on gemma-3-270m's Q4_K matrices: a float zero point ``-m / d`` (MatMulNBits accepts zero
   points of the scales' type) is exact to 1.0e-7, but onnxruntime (1.24, CPU) then skips its
   prepacked kernels and dequantizes the whole matrix to float32 at every call (far slower:
   docs/design/weights.md); a uint8 zero point alone (``z``, no residual) errs by 5.6e-2.
.. [b] Half a quantization step of the block, at most ``absmax / 254``; 3.9e-3 measured (less
   for types with few distinct values: IQ1_S 1.8e-3, TQ1_0/TQ2_0 6e-8). The token embedding
   (gathered from 8-bit blocks of 32 with the default zero point) and an 8-bit LM head in
   blocks of 128 (:func:`lm_head_weight`) are requantized the same way where their packed form
   differs.
.. [c] Q6_K (``w = d * sc * (q - 32)`` per 16 elements, int8 ``sc``, 6-bit ``q``) would be
   exact as 8-bit blocks of 16 (scale ``d * sc``, ``u = q + 96``), but onnxruntime's int8
   kernel spends its time per block and keeps a scale and a block sum per block: blocks of 16
   cost more time per product and more resident memory than blocks of 32, for an error 1/8 of
   Q6_K's own rounding. Blocks of 32 cannot hold both 16-blocks' scales exactly
   (``sc_a / g`` and ``sc_b / g`` would have to fit ``|.| <= 4``: 3 % of gemma-3-270m's blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..gguf import GGUFFile, ModelFileError, RawTensor

BLOCK = 32      # elements per GGUF block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; a K-quant's sub-block)


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
    scales: np.ndarray          # float32 [N, K/block]
    zero_points: np.ndarray | None
    mins: np.ndarray | None     # float32 [N, K/block] per-block residual added to W (_affine)
    exact: bool = True
    block: int = BLOCK


# ---- GGUF blocks -> MatMulNBits ----------------------------------------------------------------

def _blocks(raw: RawTensor, block_bytes: int, elements: int = BLOCK) -> np.ndarray:
    """The ggml blocks of ``raw`` as ``uint8 [N, K/elements, block_bytes]``."""
    n, k = raw.shape
    if k % elements:
        raise ModelFileError(f"{raw.name}: row length {k} is not a multiple of {elements} "
                             f"({raw.qtype} blocks)")
    return np.asarray(raw.data).reshape(n, k // elements, block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    """``uint8 [..., 2]`` little-endian half floats -> float32 ``[...]``."""
    return b.copy().view(np.float16)[..., 0].astype(np.float32)


def _pairs(q: np.ndarray) -> np.ndarray:
    """4-bit values ``[..., 2m]`` -> MatMulNBits bytes ``[..., m]`` (element 2i low nibble,
    2i+1 high)."""
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def _nibbles_to_pairs(qs: np.ndarray) -> np.ndarray:
    """ggml 4-bit block ``[..., 16]`` (low nibbles = elements 0..15, high = 16..31) ->
    MatMulNBits layout ``[..., 16]`` (element 2i low, 2i+1 high)."""
    return _pairs(np.concatenate([qs & 0x0F, qs >> 4], axis=-1))   # [..., 32] values 0..15


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 5-bit values ``uint8 [..., 32]`` (0..31) from the low nibbles ``qs [..., 16]``
    and the fifth bits ``qh`` (``uint8 [..., 4]``, one little-endian 32-bit word)."""
    lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    hi = np.unpackbits(qh, axis=-1, bitorder="little")     # bit j of the word: element j
    return lo | (hi << 4)


def _affine(raw: RawTensor, bits: int, q: np.ndarray, d: np.ndarray, m: np.ndarray,
            qmax: int) -> NBitsWeight:
    """Blocks of 32 with ``w = d * q + m`` (``q uint8 [N, K/32, 32]`` in ``0 .. qmax``, ``d * q``
    exact in float32; ``d``, ``m`` float32 ``[N, K/32]``) -> ``bits``-bit MatMulNBits with a
    uint8 zero point and a per-block residual (the graph adds ``blocksum(x) @ r.T``).

    The zero point is the integer nearest to ``-m / d`` clamped to ``0 .. qmax``, ``z``; the
    residual ``r = m + d * z`` is then small (about ``d / 2``) and, where it is exact in float32,
    ``w = d * (q - z) + r`` holds bit for bit (``|q - z| <= qmax``, so ``d * (q - z)`` is exact
    like ``d * q``, and both sides round the same real number once); elsewhere ``z = 0`` and
    ``r = m``. Centring ``q``
    this way keeps the kernel's int8 activation error proportional to ``w`` instead of to
    ``d * q`` (which would cancel against ``m``).
    """
    n, k = raw.shape
    d64, m64 = d.astype(np.float64), m.astype(np.float64)
    z = np.clip(np.rint(np.divide(-m64, d64, out=np.zeros_like(d64), where=d64 != 0)), 0, qmax)
    r64 = m64 + d64 * z
    z[r64.astype(np.float32).astype(np.float64) != r64] = 0   # keep exactness: r = m when z = 0
    r = (m64 + d64 * z).astype(np.float32)
    z = z.astype(np.uint8)
    if bits == 4:
        if z.shape[1] % 2:
            z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
        data, z = _pairs(q), _pairs(z)
    else:
        data = np.ascontiguousarray(q, dtype=np.uint8)
    return NBitsWeight(bits, n, k, data, d.astype(np.float32), z, r)


def pack_q4_0(raw: RawTensor) -> NBitsWeight:
    """GGUF Q4_0 (``w = d * (q - 8)``) -> 4-bit MatMulNBits with the default zero point 8."""
    n, k = raw.shape
    b = _blocks(raw, 18)
    return NBitsWeight(4, n, k, _nibbles_to_pairs(b[..., 2:18]), _f16(b[..., 0:2]), None, None)


def pack_q4_1(raw: RawTensor) -> NBitsWeight:
    """GGUF Q4_1 (``w = d * q + m``) -> 4-bit MatMulNBits, uint8 zero point and residual
    (:func:`_affine`). Exact."""
    b = _blocks(raw, 20)
    q = np.concatenate([b[..., 4:20] & 0x0F, b[..., 4:20] >> 4], axis=-1)
    return _affine(raw, 4, q, _f16(b[..., 0:2]), _f16(b[..., 2:4]), 15)


def pack_q8_0(raw: RawTensor) -> NBitsWeight:
    """GGUF Q8_0 (``w = d * q``, q int8) -> 8-bit MatMulNBits, default zero point 128."""
    n, k = raw.shape
    b = _blocks(raw, 34)
    u = b[..., 2:34] ^ np.uint8(0x80)                             # int8 q -> uint8 q + 128
    return NBitsWeight(8, n, k, np.ascontiguousarray(u), _f16(b[..., 0:2]), None, None)


def pack_q5_0(raw: RawTensor) -> NBitsWeight:
    """GGUF Q5_0 (``w = d * (q - 16)``, q 5-bit: low nibbles in ``qs``, fifth bits in the 32-bit
    ``qh``) -> 8-bit MatMulNBits with the default zero point 128 (``u = q - 16 + 128``). Exact."""
    n, k = raw.shape
    b = _blocks(raw, 22)
    u = (_q5_values(b[..., 2:6], b[..., 6:22]).astype(np.int16) + (128 - 16)).astype(np.uint8)
    return NBitsWeight(8, n, k, u, _f16(b[..., 0:2]), None, None)


def pack_q5_1(raw: RawTensor) -> NBitsWeight:
    """GGUF Q5_1 (``w = d * q + m``, q 5-bit as in Q5_0) -> 8-bit MatMulNBits, uint8 zero point
    and residual (:func:`_affine`). Exact."""
    b = _blocks(raw, 24)
    return _affine(raw, 8, _q5_values(b[..., 4:8], b[..., 8:24]), _f16(b[..., 0:2]),
                   _f16(b[..., 2:4]), 31)


QK_K = 256      # elements per K-quant super-block


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-blocks ``uint8 [N, K/256, bytes]`` -> each 32-block's scale ``d * sc``
    and minimum ``-dmin * m``, float32 ``[N, K/32]`` (6-bit ``sc``, ``m`` unpacked by gguf's
    ``Q4_K.get_scale_min``; llama.cpp ``dequantize_row_q4_K``). Both products are exact."""
    from gguf.quants import Q4_K

    n, nsb = b.shape[:2]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return ((d * sc.reshape(n, nsb, 8).astype(np.float32)).reshape(n, -1),
            (-(dmin * m.reshape(n, nsb, 8).astype(np.float32))).reshape(n, -1))


def pack_q4_k(raw: RawTensor) -> NBitsWeight:
    """GGUF Q4_K (super-blocks of 256: per 32-block ``w = d*sc * q - dmin*m``, q 4-bit) ->
    4-bit MatMulNBits in Q4_1's form (:func:`_affine`: scale ``d*sc``, uint8 zero point,
    residual). Exact.

    Layout (llama.cpp ``block_q4_K``): ``d``, ``dmin`` (f16), 12 bytes of 6-bit scales and
    mins, 128 bytes ``qs``: 32-block ``2j`` in the low nibbles of ``qs[32j:32j+32]``, ``2j+1``
    in their high nibbles.
    """
    n, _ = raw.shape
    b = _blocks(raw, 144, QK_K)
    qs = b[..., 16:144].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    q = (qs & 0x0F).reshape(n, -1, 32)
    return _affine(raw, 4, q, *_k_scales(b), 15)


def pack_q5_k(raw: RawTensor) -> NBitsWeight:
    """GGUF Q5_K (as Q4_K with 5-bit q: fifth bits in 32 bytes ``qh``, bit ``j`` of ``qh[i]``
    for element ``i`` of 32-block ``j``) -> 8-bit MatMulNBits in Q4_1's form (:func:`_affine`).
    Exact."""
    n, _ = raw.shape
    b = _blocks(raw, 176, QK_K)
    ql = b[..., 48:176].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
    qh = b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    q = ((ql & 0x0F).reshape(n, -1, 32) | ((qh & 1).reshape(n, -1, 32) << 4)).astype(np.uint8)
    return _affine(raw, 8, q, *_k_scales(b), 31)


#: GGUF types the project's own kernels read as they are (:mod:`tiny_mindie.kernels`).
GGUF_KERNEL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")


@dataclass
class GGUFMatrix:
    """A matrix ``W [N, K]`` as the GGUF holds it, for the custom operator
    ``tiny_mindie::MatMulGGUF`` (:mod:`tiny_mindie.kernels`): ``data`` uint8
    ``[N, bytes_per_row]``, the file's rows of ``qtype`` blocks (a memory map, not a copy);
    ``scale``: a power of two the product is multiplied by (an attention scale folded in,
    exactly: :func:`.graph_weights._scaled`)."""

    qtype: str
    n: int
    k: int
    data: np.ndarray
    scale: float = 1.0


def gguf_matrix(raw: RawTensor) -> GGUFMatrix:
    """``raw`` (a matrix of one of :data:`GGUF_KERNEL_TYPES`) as a :class:`GGUFMatrix`.

    Raises:
        ModelFileError: its rows are not whole blocks.
    """
    n, k = raw.shape
    elements = QK_K if raw.qtype.endswith("_K") else BLOCK
    if k % elements:
        raise ModelFileError(f"{raw.name}: row length {k} is not a multiple of {elements} "
                             f"({raw.qtype} blocks)")
    return GGUFMatrix(raw.qtype, n, k, np.asarray(raw.data).reshape(n, -1))


def quantize_8bit(w: np.ndarray, block: int = BLOCK) -> NBitsWeight:
    """Float ``w [N, K]`` -> symmetric 8-bit blocks of ``block`` (a power of two dividing
    ``K``; error <= absmax/254 per block)."""
    n, k = w.shape
    blocks = np.asarray(w, dtype=np.float32).reshape(n, k // block, block)
    amax = np.maximum(blocks.max(axis=-1), -blocks.min(axis=-1))
    scale = (amax / 127.0).astype(np.float32)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = blocks * inv[..., None]                     # a new array: the steps below work in it
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    q += 128
    return NBitsWeight(8, n, k, q.astype(np.uint8), scale, None, None, exact=False, block=block)


#: Shrink factors of a block's range tried by :func:`quantize_4bit` (1.0: min to max).
_SHRINKS = np.linspace(0.70, 1.0, 13, dtype=np.float32)


def quantize_4bit(w: np.ndarray, block: int, rows: int = 4096) -> NBitsWeight:
    """Float ``w [N, K]`` -> asymmetric 4-bit blocks of ``block`` along ``K``: ``w ~ s * (q - z)``
    with ``q`` in 0..15, a float32 scale ``s`` and a uint8 zero point ``z`` per block (what
    onnxruntime's int8 kernel folds into its per-block sums, so the zero points cost no bytes
    once prepacked). The weight mode ``compact`` (:class:`.graph_options.GraphOptions`).

    Per block the scale is searched, not just taken from the range: for each shrink factor
    ``f`` of :data:`_SHRINKS`, ``s = f * (max - min) / 15`` (the range widened to hold 0) with
    ``z`` the integer nearest ``-min / s`` (clamped to 0..15) and ``q`` rounded; the factor
    with the least squared error wins, and its scale is then refitted by least squares for the
    chosen codes (as llama.cpp's ``make_qkx2_quants`` searches its Q4_K scales). ``block`` must
    divide ``K``; ``rows`` rows are quantized at a time (bounds the memory of a large matrix).
    """
    n, k = w.shape
    nb = k // block
    q = np.empty((n, nb, block), np.uint8)
    scale = np.empty((n, nb), np.float32)
    zero = np.zeros((n, nb + nb % 2), np.uint8)
    for a in range(0, n, rows):
        b = np.asarray(w[a:a + rows], dtype=np.float32).reshape(-1, nb, block)
        q[a:a + rows], scale[a:a + rows], zero[a:a + rows, :nb] = _fit_4bit(b)
    return NBitsWeight(4, n, k, _pairs(q), scale, _pairs(zero), None, exact=False, block=block)


def _fit_4bit(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks ``b`` float32 ``[R, nb, block]`` -> codes uint8 ``[R, nb, block]``, scales float32
    and zero points uint8 ``[R, nb]`` (the search of :func:`quantize_4bit`)."""
    lo = np.minimum(b.min(axis=-1), 0.0)
    rng = np.maximum(np.maximum(b.max(axis=-1), 0.0) - lo, np.float32(1e-30))
    best_err = np.full(lo.shape, np.inf, np.float32)
    best_s, best_z = np.zeros_like(lo), np.zeros_like(lo)
    for f in _SHRINKS:
        s = rng * (f / 15)
        z = np.clip(np.rint(-lo / s), 0, 15)
        q = np.clip(np.rint(b / s[..., None]) + z[..., None], 0, 15)
        q -= z[..., None]
        q *= s[..., None]
        q -= b
        err = np.square(q, out=q).sum(axis=-1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_z = np.where(better, z, best_z)
    q = np.clip(np.rint(b / best_s[..., None]) + best_z[..., None], 0, 15)
    c = q - best_z[..., None]                                   # the centred codes, -15..15
    den = np.square(c).sum(axis=-1)
    fit = np.divide((b * c).sum(axis=-1), den, out=best_s.copy(), where=den > 0)
    return (q.astype(np.uint8), np.where(fit > 0, fit, best_s).astype(np.float32),
            best_z.astype(np.uint8))


def compact_block(k: int, block: int) -> int:
    """The block :func:`quantize_4bit` uses for rows of ``k``: ``block``, halved until it
    divides ``k`` (at least 16, MatMulNBits' smallest block).

    Raises:
        ValueError: ``block`` is not a power of two of at least 16 (MatMulNBits' blocks).
        ModelFileError: no such block (``k`` not a multiple of 16).
    """
    if block < 16 or block & (block - 1):
        raise ValueError(f"a compact block must be a power of two of at least 16, not {block}")
    b = block
    while b >= 16 and k % b:
        b //= 2
    if b < 16:
        raise ModelFileError(f"rows of {k} are not whole blocks of 16: the compact weight mode "
                             f"cannot hold this model; use the exact weights")
    return b


#: GGUF types packed exactly, and their packers (others are requantized, :func:`pack_weight`).
PACKERS = {"Q4_0": pack_q4_0, "Q4_1": pack_q4_1, "Q5_0": pack_q5_0, "Q5_1": pack_q5_1,
           "Q8_0": pack_q8_0, "Q4_K": pack_q4_k, "Q5_K": pack_q5_k}


def pack_weight(f: GGUFFile, name: str, compact: int = 0, gguf: bool = False
                ) -> NBitsWeight | GGUFMatrix:
    """The matrix ``name`` of ``f`` in MatMulNBits form: exactly for the types of
    :data:`PACKERS`, else requantized to symmetric 8-bit blocks of 32 (:func:`quantize_8bit`);
    with ``compact`` > 0 every type is requantized to 4-bit blocks of that size
    (:func:`quantize_4bit`, :func:`compact_block`); with ``gguf``, the types of
    :data:`GGUF_KERNEL_TYPES` stay the file's blocks (:class:`GGUFMatrix`).

    Raises:
        ModelFileError: ``name`` is missing, not a matrix, its rows are not whole blocks, or
            gguf cannot dequantize its type (Q8_1, Q8_K: ggml's internal types).
    """
    raw = f.raw(name)
    if len(raw.shape) != 2:
        raise ModelFileError(f"{name}: expected a matrix, got shape {raw.shape}")
    if gguf and not compact and raw.qtype in GGUF_KERNEL_TYPES:
        return gguf_matrix(raw)
    if compact:
        try:
            return quantize_4bit(f.dequantize(name), compact_block(raw.shape[1], compact))
        except NotImplementedError:
            raise ModelFileError(f"{name}: GGUF type {raw.qtype} is not supported") from None
    packer = PACKERS.get(raw.qtype)
    if packer is not None:
        return packer(raw)
    try:
        return quantize_8bit(f.dequantize(name))
    except NotImplementedError:
        raise ModelFileError(f"{name}: GGUF type {raw.qtype} is not supported") from None


def unpack_nbits(w: NBitsWeight) -> np.ndarray:
    """Dequantize a MatMulNBits weight to float32 ``[N, K]`` the way ONNX Runtime defines it
    (``scale * (q - zero_point)``, plus the residual ``mins`` where present); used to check
    packing."""
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
                None if w.zero_points is None
                else np.concatenate([prev.zero_points, w.zero_points]),
                None if w.mins is None else np.concatenate([prev.mins, w.mins]),
                prev.exact and w.exact, w.block)
        else:
            out.append(w)
    return out


def row_slice(w: NBitsWeight | GGUFMatrix, a: int, b: int) -> NBitsWeight | GGUFMatrix:
    """Rows ``a:b`` of ``w`` (outputs ``a..b-1``; blocks run along ``K``, so rows split whole)."""
    if isinstance(w, GGUFMatrix):
        return GGUFMatrix(w.qtype, b - a, w.k, w.data[a:b], w.scale)
    zp = None if w.zero_points is None else w.zero_points[a:b]
    mins = None if w.mins is None else w.mins[a:b]
    return NBitsWeight(w.bits, b - a, w.k, w.data[a:b], w.scales[a:b], zp, mins, w.exact, w.block)


def lm_head_weight(w: NBitsWeight, block: int) -> NBitsWeight:
    """The LM head as the graph computes it: an 8-bit ``w`` requantized to blocks of ``block``
    when that is larger than its own and divides ``K``; else ``w`` unchanged.

    Why: onnxruntime's 8-bit MatMulNBits kernel spends its time per block, not per byte, and
    the head of a large vocabulary is about half of a decode step; the cost is a second rounding
    of a Q8_0 weight, within half a step of its block of 128.
    """
    if w.bits != 8 or block <= w.block or w.k % block:
        return w
    out = NBitsWeight(8, w.n, w.k, np.empty((w.n, w.k // block, block), np.uint8),
                      np.empty((w.n, w.k // block), np.float32), None, None,
                      exact=False, block=block)
    rows = 8192                      # in pieces: float32 [262144, 640] alone would be 671 MB
    for a in range(0, w.n, rows):
        part = quantize_8bit(unpack_nbits(NBitsWeight(
            8, min(rows, w.n - a), w.k, w.data[a:a + rows], w.scales[a:a + rows],
            None if w.zero_points is None else w.zero_points[a:a + rows], None, w.exact, w.block)),
            block)
        out.data[a:a + rows], out.scales[a:a + rows] = part.data, part.scales
    return out
