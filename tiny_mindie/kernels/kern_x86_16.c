/* AVX-512 VNNI: the types of blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0) on 16 weight rows at once,
 * one row per float32 lane of a 512-bit vector. The float32 arithmetic per output element is
 * kern_impl.h's (the same operations, in block order), so the results equal the other paths'
 * bit for bit; the K-quants go to the 8-row kernels of kern_x86.c.
 *
 * Layout: a 512-bit vector holds row i's 32 weights of a block in its low half and row i + 8's
 * in its high half (i < 8). The 8 such vectors transposed within their 128-bit lanes (TM_T16)
 * give u[k] (k < 4): per 128-bit lane, rows 0-3 (lanes 0, 1) or 8-11 (lanes 2, 3) at dword k
 * (lanes 0, 2) and k + 4 (lanes 1, 3); u[k + 4] the same for rows 4-7 and 12-15. Dotted with
 * the activations' dword k and k + 4 broadcast to those lanes, two accumulators hold each
 * row's partial sums in two lanes, which one two-source permute and an add join into the 16
 * rows' block sums (lane r = row r). */
#include "tm_kernels.h"

#ifdef TM_HAVE_X86
#include <immintrin.h>
#include <string.h>

#define ATTR16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define TM_TILE16 16

/* the 16 rows' block sums from the accumulators a (rows 0-3, 8-11) and b (4-7, 12-15) */
static inline ATTR16 __m512i join16(__m512i a, __m512i b)
{
    const __m512i ia = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i ib = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    return _mm512_add_epi32(_mm512_permutex2var_epi64(a, ia, b),
                            _mm512_permutex2var_epi64(a, ib, b));
}

/* 8 vectors r[i] = [row i | row i + 8] -> u[0..7] as described above */
static inline ATTR16 void transpose16(__m512i *u, const __m512i *r)
{
    __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    __m512i t4 = _mm512_unpacklo_epi32(r[4], r[5]), t5 = _mm512_unpackhi_epi32(r[4], r[5]);
    __m512i t6 = _mm512_unpacklo_epi32(r[6], r[7]), t7 = _mm512_unpackhi_epi32(r[6], r[7]);
    u[0] = _mm512_unpacklo_epi64(t0, t2); u[1] = _mm512_unpackhi_epi64(t0, t2);
    u[2] = _mm512_unpacklo_epi64(t1, t3); u[3] = _mm512_unpackhi_epi64(t1, t3);
    u[4] = _mm512_unpacklo_epi64(t4, t6); u[5] = _mm512_unpackhi_epi64(t4, t6);
    u[6] = _mm512_unpacklo_epi64(t5, t7); u[7] = _mm512_unpackhi_epi64(t5, t7);
}

/* Block c (of the chunk at rp[]) of rows i and i + 8 as unsigned bytes: Q4_0, Q4_1 the
 * nibbles (low nibbles are weights 0-15, high 16-31), Q5_0 with the fifth bit (bit t of qh:
 * weight t) as 16, Q8_0 plus 128 */
static inline __attribute__((always_inline)) ATTR16 __m512i
decode2(const uint8_t *p, const uint8_t *q, int type)
{
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i sh = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
    __m512i v;
    if (type == TM_Q8_0) {
        v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                (const __m256i *)(p + 2))), _mm256_loadu_si256((const __m256i *)(q + 2)), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    {
        const int qo = type == TM_Q4_0 ? 2 : type == TM_Q4_1 ? 4 : 6;
        v = _mm512_mask_broadcast_i32x4(
            _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(p + qo))), 0xFF00,
            _mm_loadu_si128((const __m128i *)(q + qo)));
        v = _mm512_and_si512(_mm512_srlv_epi32(v, sh), m4);
    }
    if (type == TM_Q5_0) {
        uint32_t h0, h1;
        memcpy(&h0, p + 2, 4);
        memcpy(&h1, q + 2, 4);
        v = _mm512_mask_add_epi8(v, (__mmask64)((uint64_t)h0 | (uint64_t)h1 << 32), v,
                                 _mm512_set1_epi8(16));
    }
    return v;
}

/* Output rows n .. n+R-1 (R <= 16) for activation rows m0 .. m0+mc-1: blocks in chunks of up
 * to 8, each chunk decoded once for all mc rows; a row's terms added in block order. */
static inline __attribute__((always_inline)) ATTR16 void
tile16(const tm_job *j, int64_t n, int R, int64_t m0, int mc, const int type)
{
    static const uint8_t zeros[8 * 34];
    const int64_t bb = tm_block_bytes(type), nb = j->nb;
    const int off = type == TM_Q4_0 ? 8 : type == TM_Q5_0 ? 16 : type == TM_Q8_0 ? 128 : 0;
    const __mmask16 live = (__mmask16)((1u << R) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)j->row_bytes));
    __m512 acc[TM_GROUP_M];
    __m512i U[TM_CHUNK][8], r[8];
    __m512 DW[TM_CHUNK], MW[TM_CHUNK];
    const uint8_t *rp[TM_TILE16];
    int64_t b0;
    int k, c, m, cnt;

    for (m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
    for (b0 = 0; b0 < nb; b0 += cnt) {
        cnt = nb - b0 < TM_CHUNK ? (int)(nb - b0) : TM_CHUNK;
        for (k = 0; k < TM_TILE16; k++)
            rp[k] = k < R ? j->w + (n + k) * j->row_bytes + b0 * bb : zeros;
        for (c = 0; c < cnt; c++) {
            /* the 16 rows' first 4 bytes: d (and Q4_1's m) as float16 */
            __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows,
                                                    rp[0] + c * bb, 1);
            DW[c] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
            if (type == TM_Q4_1)
                MW[c] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
            for (k = 0; k < 8; k++)
                r[k] = decode2(rp[k] + c * bb, rp[k + 8] + c * bb, type);
            transpose16(U[c], r);
        }
        for (m = 0; m < mc; m++) {
            const int64_t i0 = (m0 + m) * nb + b0;
            const int8_t *xa = j->xq + (m0 + m) * j->K + b0 * TM_QK;
            __m512 s = acc[m];
            for (c = 0; c < cnt; c++) {
                const __m512i X = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)(xa + c * TM_QK)));
                const __m512 dx = _mm512_set1_ps(j->dx[i0 + c]);
                const int32_t xs = j->xs[i0 + c];
                __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512(), D;
                __m512 t;
                for (k = 0; k < 4; k++) {
                    const __m512i xk = _mm512_shuffle_epi32(X, (_MM_PERM_ENUM)(k * 0x55));
                    a = _mm512_dpbusd_epi32(a, U[c][k], xk);
                    b = _mm512_dpbusd_epi32(b, U[c][k + 4], xk);
                }
                D = join16(a, b);
                if (type == TM_Q4_1) {
                    t = _mm512_mul_ps(_mm512_mul_ps(DW[c], dx), _mm512_cvtepi32_ps(D));
                    t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_mul_ps(MW[c], dx),
                                                       _mm512_set1_ps((float)xs)));
                } else {
                    D = _mm512_sub_epi32(D, _mm512_set1_epi32(off * xs));
                    t = _mm512_mul_ps(_mm512_mul_ps(DW[c], dx), _mm512_cvtepi32_ps(D));
                }
                s = _mm512_add_ps(s, t);
            }
            acc[m] = s;
        }
    }
    for (m = 0; m < mc; m++)
        _mm512_mask_storeu_ps(j->y + (m0 + m) * j->N + n, live, acc[m]);
}

static ATTR16 void rows16(const tm_job *j, int64_t n0, int64_t n1, const int type)
{
    int64_t n, m0;
    for (n = n0; n < n1; n += TM_TILE16) {
        const int R = (int)(n1 - n < TM_TILE16 ? n1 - n : TM_TILE16);
        for (m0 = 0; m0 < j->M; m0 += TM_GROUP_M)
            tile16(j, n, R, m0, (int)(j->M - m0 < TM_GROUP_M ? j->M - m0 : TM_GROUP_M), type);
    }
}

void tm_rows_avx512vnni16(const tm_job *j, int64_t n0, int64_t n1)
{
    switch (j->type) {
    case TM_Q4_0: rows16(j, n0, n1, TM_Q4_0); break;
    case TM_Q4_1: rows16(j, n0, n1, TM_Q4_1); break;
    case TM_Q5_0: rows16(j, n0, n1, TM_Q5_0); break;
    case TM_Q8_0: rows16(j, n0, n1, TM_Q8_0); break;
    default: tm_rows_avx512vnni(j, n0, n1); break;
    }
}

#else
typedef int tm_no_x86_16;   /* ISO C: a translation unit is not empty */
#endif
