/* Rows of a GGUF matrix dequantized to float32: the token embedding's lookup
 * (tiny_mindie::GatherGGUF, ort_op.c; tm_gather for ctypes).
 *
 * Each row is N's row `id` of K / block blocks of `type`, each value computed in float32 as the
 * block formats define it, in this order (d, dmin, m: the block's float16 fields; sc, mn: a
 * K-quant sub-block's integer scale and minimum; q: the weight's integer):
 *   Q4_0  d * (q - 8)                  q: 4 bits; the 16 bytes hold weights j (low nibble) and
 *                                      j + 16 (high nibble)
 *   Q4_1  d * q + m                    q: 4 bits, as Q4_0
 *   Q5_0  d * (q - 16)                 q: 4 bits as Q4_0, bit 4 the weight's bit of the
 *                                      little-endian 32-bit mask after d
 *   Q8_0  d * q                        q: int8
 *   Q4_K  (d * sc) * q - (dmin * mn)   8 sub-blocks of 32 with 6-bit sc, mn packed in 12 bytes;
 *                                      the 128 bytes hold sub-blocks 2i (low nibbles of bytes
 *                                      32i..32i+31) and 2i + 1 (their high nibbles)
 *   Q6_K  (d * sc) * (q - 32)          16 sub-blocks of 16 with int8 sc; q: 4 low bits from the
 *                                      128 bytes ql, 2 high bits from the 64 bytes qh
 * Every value is one or two float32 roundings of exact inputs, in that order: the same bits as
 * the dequantization of the `gguf` package (tests/unit/test_kernels_gather.py).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "tm_kernels.h"

#define TM_EXPORT __attribute__((visibility("default")))

/* the float value of the little-endian IEEE binary16 at p (exact: every half is a float) */
static float half_at(const uint8_t *p)
{
    uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    float f;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | man << 13;                  /* inf, nan */
    } else if (exp) {
        bits = sign | (exp + 112) << 23 | man << 13;            /* normal: bias 15 -> 127 */
    } else {
        f = ldexpf((float)man, -24);                             /* zero, subnormal: exact */
        return sign ? -f : f;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* nibble j (0..31) of a block of 32 whose 16 bytes are qs: low nibbles first */
static int nibble(const uint8_t *qs, int j)
{
    return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
}

static void block_q4_0(const uint8_t *b, float *y)
{
    float d = half_at(b);
    int j;
    for (j = 0; j < 32; j++) y[j] = d * (float)(nibble(b + 2, j) - 8);
}

static void block_q4_1(const uint8_t *b, float *y)
{
    float d = half_at(b), m = half_at(b + 2);
    int j;
    for (j = 0; j < 32; j++) y[j] = d * (float)nibble(b + 4, j) + m;
}

static void block_q5_0(const uint8_t *b, float *y)
{
    float d = half_at(b);
    uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16
                  | (uint32_t)b[5] << 24;
    int j;
    for (j = 0; j < 32; j++)
        y[j] = d * (float)((nibble(b + 6, j) | (int)((qh >> j) & 1) << 4) - 16);
}

static void block_q8_0(const uint8_t *b, float *y)
{
    float d = half_at(b);
    int j;
    for (j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
}

/* sub-block s (0..7) of a Q4_K super-block: its 6-bit scale and minimum from the 12 bytes sc */
static void q4_k_scale_min(const uint8_t *sc, int s, int *scale, int *min)
{
    if (s < 4) {
        *scale = sc[s] & 63;
        *min = sc[s + 4] & 63;
    } else {
        *scale = (sc[s + 4] & 15) | (sc[s - 4] >> 6) << 4;
        *min = (sc[s + 4] >> 4) | (sc[s] >> 6) << 4;
    }
}

static void block_q4_k(const uint8_t *b, float *y)
{
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *qs = b + 16;
    int s, j, scale, min;
    for (s = 0; s < 8; s++) {
        const uint8_t *q = qs + 32 * (s / 2);
        float ds, dm;
        q4_k_scale_min(b + 4, s, &scale, &min);
        ds = d * (float)scale;
        dm = dmin * (float)min;
        for (j = 0; j < 32; j++)
            y[32 * s + j] = ds * (float)(s & 1 ? q[j] >> 4 : q[j] & 15) - dm;
    }
}

static void block_q6_k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_at(b + 208);
    int i;
    for (i = 0; i < 256; i++) {
        int half = i / 128, part = i % 128 / 32, l = i % 32;
        int lo = ql[64 * half + 32 * (part & 1) + l], hi = qh[32 * half + l] >> 2 * part & 3;
        int q = ((part < 2 ? lo & 15 : lo >> 4) | hi << 4) - 32;
        y[i] = d * (float)sc[i / 16] * (float)q;
    }
}

/* row `row` (K values) of the N rows at w into y */
static void dequantize_row(int type, const uint8_t *w, int64_t row, int64_t K, float *y)
{
    int64_t elems = tm_block_elems(type), bytes = tm_block_bytes(type), nb = K / elems, b;
    const uint8_t *r = w + row * nb * bytes;
    for (b = 0; b < nb; b++) {
        const uint8_t *blk = r + b * bytes;
        float *out = y + b * elems;
        switch (type) {
        case TM_Q4_0: block_q4_0(blk, out); break;
        case TM_Q4_1: block_q4_1(blk, out); break;
        case TM_Q5_0: block_q5_0(blk, out); break;
        case TM_Q8_0: block_q8_0(blk, out); break;
        case TM_Q4_K: block_q4_k(blk, out); break;
        default: block_q6_k(blk, out); break;
        }
    }
}

int tm_gather_rows(int type, const int64_t *ids, int64_t T, const uint8_t *w, int64_t w_bytes,
                   int64_t N, int64_t K, float *y, const char **why)
{
    int64_t t;
    if (tm_check(type, N, K, w_bytes, why)) return -1;
    for (t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= N) {
            *why = "GatherGGUF: an id is out of range (0 <= id < N)";
            return -1;
        }
    for (t = 0; t < T; t++) dequantize_row(type, w, ids[t], K, y + t * K);
    return 0;
}

/* y [T, K] = rows ids [T] of the N rows of `type` blocks at w (w_bytes bytes). Returns 0, or -1
 * on bad arguments (an unknown type, a size that is not N rows of K, an id outside 0 .. N-1:
 * nothing is read then). */
TM_EXPORT int tm_gather(int type, const int64_t *ids, int64_t T, const uint8_t *w,
                        int64_t w_bytes, int64_t N, int64_t K, float *y)
{
    const char *why = NULL;
    return tm_gather_rows(type, ids, T, w, w_bytes, N, K, y, &why);
}
