/* AVX-512 VNNI: every type on 16 weight rows at once, one row per float32 lane of a 512-bit
 * vector. The float32 arithmetic per output element is kern_impl.h's (the same operations, in
 * block order), so the results equal the other paths' bit for bit.
 *
 * Layout: a 512-bit vector holds row i's 32 weights of a block in its low half and row i + 8's
 * in its high half (i < 8). The 8 such vectors transposed within their 128-bit lanes (transpose16)
 * and their 128-bit lanes then regrouped (regroup16) give U[k] (k < 8): lane r = row r's dword
 * k (its weights 4k .. 4k + 3). Dotted with the activations' dword k broadcast to every lane,
 * each lane sums its own row: two accumulators (dwords 0-3 and 4-7, a Q6_K block's two
 * halves) added give the 16 rows' block sums, with no shuffle of the activations. */
#include "tm_kernels.h"

#ifdef TM_HAVE_X86
#include <immintrin.h>
#include <string.h>

#include "kern_x86_512.h"

#define TM_TILE16 16

/* transpose16's u -> U: U[k] lane r = row r's dword k. u[k] (k < 4) holds, by 128-bit lane,
 * rows 0-3 dword k, rows 0-3 dword k + 4, rows 8-11 dword k, rows 8-11 dword k + 4; u[k + 4]
 * the same for rows 4-7 and 12-15: one two-source permute of 64-bit pairs per vector. */
static inline ATTR16 void regroup16(__m512i *U, const __m512i *u)
{
    const __m512i ia = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i ib = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    int k;
    for (k = 0; k < 4; k++) {                   /* U and u are distinct arrays */
        U[k] = _mm512_permutex2var_epi64(u[k], ia, u[k + 4]);
        U[k + 4] = _mm512_permutex2var_epi64(u[k], ib, u[k + 4]);
    }
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

/* the 16 rows' 16 bytes at p[r] + off (r < 16) as 4 vectors: S[j] lane r = the row's dword j */
static inline ATTR16 void transpose16x4(__m512i *S, const uint8_t *const *p, int64_t off)
{
    __m512i r[4], t0, t1, t2, t3;
    int k;
    for (k = 0; k < 4; k++) {              /* 128-bit lane l: row k + 4 l */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p[k] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[k + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[k + 8] + off)), 2);
        r[k] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p[k + 12] + off)), 3);
    }
    t0 = _mm512_unpacklo_epi32(r[0], r[1]); t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    t2 = _mm512_unpacklo_epi32(r[2], r[3]); t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    S[0] = _mm512_unpacklo_epi64(t0, t2); S[1] = _mm512_unpackhi_epi64(t0, t2);
    S[2] = _mm512_unpacklo_epi64(t1, t3); S[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* the 16 rows' 32 bytes at p[r] + off as U[k] (k < 8): lane r = the row's dword k */
static inline ATTR16 void load_transpose16(__m512i *U, const uint8_t *const *p, int64_t off)
{
    __m512i r[8], u[8];
    int i;
    for (i = 0; i < 8; i++)
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                   (const __m256i *)(p[i] + off))), _mm256_loadu_si256((const __m256i *)(p[i + 8] + off)), 1);
    transpose16(u, r);
    regroup16(U, u);
}

/* A Q4_K super-block of the 16 rows at sb[]: each block c's scale DW[c] = d * sc and minimum
 * MW[c] = -(dmin * m) (lane = row), and its 32 nibbles U[c] (low nibbles of a run of 32 bytes
 * are block 2i, high ones block 2i + 1). Bytes 0-3 of a super-block hold d and dmin, 4-7
 * scales 0-3 (and the top bits of 4-7), 8-11 minima 0-3 (and the top bits of minima 4-7),
 * 12-15 the low nibbles of scales and minima 4-7. */
static inline ATTR16 void q4k_decode16(const uint8_t *const *sb, __m512i U[][8], __m512 *DW,
                                      __m512 *MW)
{
    const __m512i m6 = _mm512_set1_epi32(0x3f3f3f3f), m4d = _mm512_set1_epi32(0x0f0f0f0f);
    const __m512i m2h = _mm512_set1_epi32(0x30303030), ff = _mm512_set1_epi32(255);
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512i S[4], SC[2], MN[2], u[8], H;
    __m512 d, dmin;
    int c, k;
    transpose16x4(S, sb, 0);
    H = S[0];                                    /* d | dmin << 16 */
    d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(H));
    dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(H, 16)));
    SC[0] = _mm512_and_si512(S[1], m6);
    SC[1] = _mm512_or_si512(_mm512_and_si512(S[3], m4d),
                            _mm512_and_si512(_mm512_srli_epi32(S[1], 2), m2h));
    MN[0] = _mm512_and_si512(S[2], m6);
    MN[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(S[3], 4), m4d),
                            _mm512_and_si512(_mm512_srli_epi32(S[2], 2), m2h));
    for (c = 0; c < 8; c++) {
        const int sh = 8 * (c & 3);
        __m512i sc = _mm512_and_si512(_mm512_srli_epi32(SC[c >> 2], sh), ff);
        __m512i mn = _mm512_and_si512(_mm512_srli_epi32(MN[c >> 2], sh), ff);
        DW[c] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        MW[c] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_set1_epi32((int)0x80000000),
                    _mm512_castps_si512(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)))));
    }
    for (c = 0; c < 8; c += 2) {
        load_transpose16(u, sb, 16 + 16 * c);
        for (k = 0; k < 8; k++) {
            U[c][k] = _mm512_and_si512(u[k], m4);
            U[c + 1][k] = _mm512_and_si512(_mm512_srli_epi16(u[k], 4), m4);
        }
    }
}

/* A Q6_K super-block of the 16 rows at sb[]: each block c's 6-bit values (0..63) U[c], the
 * int8 scales of its halves (elements 0-15, 16-31) SC0[c], SC1[c] and d (lane = row). Block
 * c = 4 h + g: its low 4 bits are bytes 64 h + 32 (g & 1) .. of ql (the high nibbles where
 * g >= 2), its top 2 bits bits 2 g of bytes 32 h .. of qh (at byte 128). */
static inline ATTR16 void q6k_decode16(const uint8_t *const *sb, __m512i U[][8], __m512i *SC0,
                                      __m512i *SC1, __m512 *D, __mmask16 live, __m512i rows)
{
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    __m512i S[4], l0[8], l1[8], hq[8];
    int c, h, g, k;
    transpose16x4(S, sb, 192);
    for (c = 0; c < 8; c++) {            /* scales 2c, 2c + 1: bytes (2c) % 4, (2c + 1) % 4 */
        SC0[c] = _mm512_srai_epi32(_mm512_slli_epi32(S[c >> 1], 24 - 16 * (c & 1)), 24);
        SC1[c] = _mm512_srai_epi32(_mm512_slli_epi32(S[c >> 1], 16 - 16 * (c & 1)), 24);
    }
    /* d: the high half of bytes 206-209 (no read past the super-block's 210 bytes) */
    *D = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_i32gather_epi32(
             _mm512_setzero_si512(), live, rows, sb[0] + 206, 1), 16)));
    for (h = 0; h < 2; h++) {
        load_transpose16(l0, sb, 64 * h);
        load_transpose16(l1, sb, 64 * h + 32);
        load_transpose16(hq, sb, 128 + 32 * h);
        for (g = 0; g < 4; g++) {
            c = 4 * h + g;
            for (k = 0; k < 8; k++) {
                __m512i lb = (g & 1) ? l1[k] : l0[k], hb = hq[k];
                if (g >> 1) lb = _mm512_srli_epi16(lb, 4);
                hb = g == 0 ? _mm512_slli_epi16(hb, 4) : g == 1 ? _mm512_slli_epi16(hb, 2)
                     : g == 3 ? _mm512_srli_epi16(hb, 2) : hb;
                U[c][k] = _mm512_or_si512(_mm512_and_si512(lb, m4), _mm512_and_si512(hb, m30));
            }
        }
    }
}

/* Output rows n .. n+R-1 (R <= 16) for activation rows m0 .. m0+mc-1: blocks in chunks of up
 * to 8 (a K-quant's super-block), each chunk decoded once for all mc rows; a row's terms added
 * in block order. */
static inline __attribute__((always_inline)) ATTR16 void
tile16(const tm_job *j, int64_t n, int R, int64_t m0, int mc, const int type)
{
    static const uint8_t zeros[8 * 34];          /* rows past the matrix (>= one super-block) */
    const int kq = type == TM_Q4_K || type == TM_Q6_K;
    const int64_t bb = tm_block_bytes(type), nb = j->nb, per = kq ? TM_CHUNK : 1;
    const int off = type == TM_Q4_0 ? 8 : type == TM_Q5_0 ? 16 : type == TM_Q8_0 ? 128 : 0;
    const int has_min = type == TM_Q4_1 || type == TM_Q4_K;
    const __mmask16 live = (__mmask16)((1u << R) - 1u);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                              11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)j->row_bytes));
    __m512 acc[TM_GROUP_M];
    __m512i U[TM_CHUNK][8], r[8], u[8], SC0[TM_CHUNK], SC1[TM_CHUNK];
    __m512 DW[TM_CHUNK], MW[TM_CHUNK];
    const uint8_t *rp[TM_TILE16];
    int64_t b0;
    int k, c, m, cnt;

    for (m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
    for (b0 = 0; b0 < nb; b0 += cnt) {
        cnt = nb - b0 < TM_CHUNK ? (int)(nb - b0) : TM_CHUNK;
        for (k = 0; k < TM_TILE16; k++)      /* the chunk's first block (super-block) */
            rp[k] = k < R ? j->w + (n + k) * j->row_bytes + b0 / per * bb : zeros;
        if (TM_PREFETCH && n + 2 * TM_TILE16 <= j->N) {    /* the next tile's chunk */
            const int64_t cb = cnt / per * bb;
            int64_t i;
            for (k = 0; k < TM_TILE16; k++)
                for (i = 0; i < cb; i += 64)
                    _mm_prefetch((const char *)rp[k] + TM_TILE16 * j->row_bytes + i, _MM_HINT_T0);
        }
        if (type == TM_Q4_K) {
            q4k_decode16(rp, U, DW, MW);
        } else if (type == TM_Q6_K) {
            q6k_decode16(rp, U, SC0, SC1, &DW[0], live, rows);
        } else {
            for (c = 0; c < cnt; c++) {
                /* the 16 rows' first 4 bytes: d (and Q4_1's m) as float16 */
                __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows,
                                                        rp[0] + c * bb, 1);
                DW[c] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
                if (type == TM_Q4_1)
                    MW[c] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
                for (k = 0; k < 8; k++)
                    r[k] = decode2(rp[k] + c * bb, rp[k + 8] + c * bb, type);
                transpose16(u, r);
                regroup16(U[c], u);
            }
        }
        for (m = 0; m < mc; m++) {
            const int64_t i0 = (m0 + m) * nb + b0;
            const int8_t *xa = j->xq + (m0 + m) * j->K + b0 * TM_QK;
            __m512 s = acc[m];
            for (c = 0; c < cnt; c++) {
                const int8_t *xb = xa + c * TM_QK;
                const __m512 dx = _mm512_set1_ps(j->dx[i0 + c]);
                const int32_t xs = j->xs[i0 + c];
                __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512(), D;
                __m512 t;
                for (k = 0; k < 4; k++) {        /* a: weights 0-15, b: weights 16-31 */
                    int32_t xk, xh;
                    memcpy(&xk, xb + 4 * k, 4);
                    memcpy(&xh, xb + 4 * k + 16, 4);
                    a = _mm512_dpbusd_epi32(a, U[c][k], _mm512_set1_epi32(xk));
                    b = _mm512_dpbusd_epi32(b, U[c][k + 4], _mm512_set1_epi32(xh));
                }
                if (type == TM_Q6_K) {
                    /* each half's sum less 32 times the activations' sum over it, times the
                     * half's scale: the block's exact integer sum; then d's term */
                    const int32_t x0 = j->xs16[i0 + c], x1 = xs - x0;
                    D = _mm512_add_epi32(
                        _mm512_mullo_epi32(_mm512_sub_epi32(a, _mm512_set1_epi32(32 * x0)), SC0[c]),
                        _mm512_mullo_epi32(_mm512_sub_epi32(b, _mm512_set1_epi32(32 * x1)), SC1[c]));
                    t = _mm512_mul_ps(_mm512_mul_ps(DW[0], dx), _mm512_cvtepi32_ps(D));
                } else if (has_min) {
                    D = _mm512_add_epi32(a, b);
                    t = _mm512_mul_ps(_mm512_mul_ps(DW[c], dx), _mm512_cvtepi32_ps(D));
                    t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_mul_ps(MW[c], dx),
                                                       _mm512_set1_ps((float)xs)));
                } else {
                    D = _mm512_sub_epi32(_mm512_add_epi32(a, b), _mm512_set1_epi32(off * xs));
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
    /* the K-quants for one activation row (decode: weights streamed from memory) on the 8-row
     * tiles of kern_x86.c, which keep fewer rows in flight between prefetches; for more rows
     * here, where fewer instructions per weight count. The same bits either way. */
    case TM_Q4_K:
        if (j->M == 1) tm_rows_avx512vnni(j, n0, n1);
        else rows16(j, n0, n1, TM_Q4_K);
        break;
    case TM_Q6_K:
        if (j->M == 1) tm_rows_avx512vnni(j, n0, n1);
        else rows16(j, n0, n1, TM_Q6_K);
        break;
    default: tm_rows_avx512vnni(j, n0, n1); break;
    }
}

#else
typedef int tm_no_x86_16;   /* ISO C: a translation unit is not empty */
#endif
