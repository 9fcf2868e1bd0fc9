/* The x86-64 paths: AVX2, AVX-VNNI and AVX-512 VNNI, each compiled for its ISA by a target
 * attribute (the library itself is built for the baseline x86-64: dispatch.c picks a path by
 * what the CPU and the OS enable). The integer dot products differ; the float32 arithmetic is
 * kern_impl.h's, the same as the portable path's. */
#include "tm_kernels.h"

#ifdef TM_HAVE_X86
#include <float.h>
#include <math.h>
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "kern_x86_512.h"

/* The dot kernels work on the 8 rows' blocks transposed: a row's 32 bytes are 8 dwords of 4
 * weights, and TM_T8 turns the rows r[0..7] into u[k] (k < 4) = [rows 0-3, dword k | rows 0-3,
 * dword k + 4] and u[k + 4] = the same for rows 4-7. A product with x's dwords k and k + 4 broadcast to
 * their halves (shuffle_epi32) then gives each row's partial sums in its own lane, and the two
 * halves of each accumulator added give the 8 rows' totals: no horizontal sums. */
#define TM_T8(u, r)                                                                          \
    do {                                                                                     \
        __m256i t0_ = _mm256_unpacklo_epi32(r[0], r[1]), t1_ = _mm256_unpackhi_epi32(r[0], r[1]);\
        __m256i t2_ = _mm256_unpacklo_epi32(r[2], r[3]), t3_ = _mm256_unpackhi_epi32(r[2], r[3]);\
        __m256i t4_ = _mm256_unpacklo_epi32(r[4], r[5]), t5_ = _mm256_unpackhi_epi32(r[4], r[5]);\
        __m256i t6_ = _mm256_unpacklo_epi32(r[6], r[7]), t7_ = _mm256_unpackhi_epi32(r[6], r[7]);\
        u[0] = _mm256_unpacklo_epi64(t0_, t2_); u[1] = _mm256_unpackhi_epi64(t0_, t2_);       \
        u[2] = _mm256_unpacklo_epi64(t1_, t3_); u[3] = _mm256_unpackhi_epi64(t1_, t3_);       \
        u[4] = _mm256_unpacklo_epi64(t4_, t6_); u[5] = _mm256_unpackhi_epi64(t4_, t6_);       \
        u[6] = _mm256_unpacklo_epi64(t5_, t7_); u[7] = _mm256_unpackhi_epi64(t5_, t7_);       \
    } while (0)

/* accumulators a (rows 0-3), b (rows 4-7), split by halves -> the 8 rows' totals */
#define TM_JOIN(a, b) \
    _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31))

/* x's dword k and k + 4 broadcast to the two halves */
#define TM_XB(X, k) _mm256_shuffle_epi32(X, (k) * 0x55)

/* a constant one ISA variant of a body does not use */
#define TM_UNUSED __attribute__((unused))

/* The three dot kernels of kern_impl.h for one path, from its products:
 * U8(acc, w, x): acc + the int32 lane sums of unsigned bytes w times signed bytes x;
 * S16(acc, w, x): acc + the lane sums of int16 w times int16 x. */
#define TM_DOTS(SFX, ATTR, U8, S16)                                                          \
static inline ATTR void dot_u8_##SFX(const void *w, int64_t ws, const int8_t *const *xp,    \
                                     int mc, int32_t D[TM_TILE_M][TM_TILE_N])               \
{                                                                                            \
    __m256i r[TM_TILE_N], u[8];                                                              \
    int m, k;                                                                                \
    for (k = 0; k < TM_TILE_N; k++)                                                          \
        r[k] = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + k * ws));           \
    TM_T8(u, r);                                                                             \
    for (m = 0; m < mc; m++) {                                                               \
        __m256i X = _mm256_loadu_si256((const __m256i *)xp[m]);                              \
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();                      \
        for (k = 0; k < 4; k++) {                                                            \
            __m256i xb = TM_XB(X, k);                                                        \
            a = U8(a, u[k], xb);                                                             \
            b = U8(b, u[k + 4], xb);                                                         \
        }                                                                                    \
        _mm256_storeu_si256((__m256i *)D[m], TM_JOIN(a, b));                                 \
    }                                                                                        \
}                                                                                            \
static inline ATTR void dot_s8_##SFX(const void *w, int64_t ws, const int8_t *const *xp,    \
                                     int mc, int32_t D[TM_TILE_M][TM_TILE_N])               \
{                                                                                            \
    __m256i r[TM_TILE_N], u[8], au[8];                                                       \
    int m, k;                                                                                \
    for (k = 0; k < TM_TILE_N; k++)                                                          \
        r[k] = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + k * ws));           \
    TM_T8(u, r);                                                                             \
    for (k = 0; k < 8; k++) au[k] = _mm256_abs_epi8(u[k]);                                   \
    for (m = 0; m < mc; m++) {                                                               \
        __m256i X = _mm256_loadu_si256((const __m256i *)xp[m]);                              \
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();                      \
        for (k = 0; k < 4; k++) {                                                            \
            __m256i xb = TM_XB(X, k);                                                        \
            a = U8(a, au[k], _mm256_sign_epi8(xb, u[k]));                                    \
            b = U8(b, au[k + 4], _mm256_sign_epi8(xb, u[k + 4]));                            \
        }                                                                                    \
        _mm256_storeu_si256((__m256i *)D[m], TM_JOIN(a, b));                                 \
    }                                                                                        \
}                                                                                            \
static inline ATTR void dot_i16_##SFX(const void *w, int64_t ws, const int8_t *const *xp,   \
                                      int mc, int32_t D[TM_TILE_M][TM_TILE_N])              \
{                                                                                            \
    __m256i r[TM_TILE_N], lo[8], hi[8];                                                      \
    int m, k;                                                                                \
    for (k = 0; k < TM_TILE_N; k++)                                                          \
        r[k] = _mm256_loadu_si256((const __m256i *)((const int16_t *)w + k * ws));           \
    TM_T8(lo, r);                                                                            \
    for (k = 0; k < TM_TILE_N; k++)                                                          \
        r[k] = _mm256_loadu_si256((const __m256i *)((const int16_t *)w + k * ws + 16));      \
    TM_T8(hi, r);                                                                            \
    for (m = 0; m < mc; m++) {                                                               \
        __m256i XL = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)xp[m]));          \
        __m256i XH = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xp[m] + 16)));   \
        __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();                      \
        for (k = 0; k < 4; k++) {                                                            \
            __m256i xl = TM_XB(XL, k), xh = TM_XB(XH, k);                                    \
            a = S16(a, lo[k], xl);                                                           \
            b = S16(b, lo[k + 4], xl);                                                       \
            a = S16(a, hi[k], xh);                                                           \
            b = S16(b, hi[k + 4], xh);                                                       \
        }                                                                                    \
        _mm256_storeu_si256((__m256i *)D[m], TM_JOIN(a, b));                                 \
    }                                                                                        \
}

/* ---- AVX2 (with FMA and F16C, as every AVX2 CPU has; FMA is not used in the arithmetic) ---- */
#define ATTR_AVX2 __attribute__((target("avx2,fma,f16c")))
#define U8_AVX2(a, w, x) \
    _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define S16_AVX2(a, w, x) _mm256_add_epi32(a, _mm256_madd_epi16(w, x))
TM_DOTS(avx2, ATTR_AVX2, U8_AVX2, S16_AVX2)

/* ---- AVX-VNNI (VEX-encoded VPDPBUSD/VPDPWSSD) ---- */
#define ATTR_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define U8_AVXVNNI(a, w, x) _mm256_dpbusd_avx_epi32(a, w, x)
#define S16_AVXVNNI(a, w, x) _mm256_dpwssd_avx_epi32(a, w, x)
TM_DOTS(avxvnni, ATTR_AVXVNNI, U8_AVXVNNI, S16_AVXVNNI)

/* ---- AVX-512 VNNI (its 256-bit forms: AVX-512 VL) ---- */
#define ATTR_AVX512 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define U8_AVX512(a, w, x) _mm256_dpbusd_epi32(a, w, x)
#define S16_AVX512(a, w, x) _mm256_dpwssd_epi32(a, w, x)
TM_DOTS(avx512vnni, ATTR_AVX512, U8_AVX512, S16_AVX512)

#define TM_F16C_FN(SFX, ATTR)                                                                \
static inline ATTR float f16_##SFX(const uint8_t *p)                                         \
{                                                                                            \
    unsigned short h;                                                                        \
    memcpy(&h, p, 2);                                                                        \
    return _cvtsh_ss(h);                                                                     \
}
TM_F16C_FN(avx2, ATTR_AVX2)
TM_F16C_FN(avxvnni, ATTR_AVXVNNI)
TM_F16C_FN(avx512vnni, ATTR_AVX512)

/* The blocks' decode (kern_impl.h's, by AVX2 instructions; every x86 path has them) */
#define TM_X86_DECODE(SFX, ATTR)                                                             \
static inline ATTR void decode_##SFX(int type, const uint8_t *row, int64_t b0, int cnt,     \
                                     uint8_t *q, int16_t *q16, float *dw, float *mw)        \
{                                                                                            \
    const __m256i m4 = _mm256_set1_epi8(15);                                                 \
    const __m128i m4h = _mm_set1_epi8(15);                                                   \
    int c;                                                                                   \
    switch (type) {                                                                          \
    case TM_Q4_0: case TM_Q4_1: {                                                            \
        const int64_t bb = type == TM_Q4_0 ? 18 : 20, qo = type == TM_Q4_0 ? 2 : 4;         \
        for (c = 0; c < cnt; c++) {                                                          \
            const uint8_t *blk = row + (b0 + c) * bb;                                        \
            __m128i v = _mm_loadu_si128((const __m128i *)(blk + qo));                        \
            dw[c] = f16_##SFX(blk);                                                          \
            mw[c] = type == TM_Q4_1 ? f16_##SFX(blk + 2) : 0.0f;                             \
            _mm_storeu_si128((__m128i *)(q + 32 * c), _mm_and_si128(v, m4h));                \
            _mm_storeu_si128((__m128i *)(q + 32 * c + 16),                                   \
                             _mm_and_si128(_mm_srli_epi16(v, 4), m4h));                      \
        }                                                                                    \
        break;                                                                               \
    }                                                                                        \
    case TM_Q5_0: {                                                                          \
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,\
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);\
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);             \
        for (c = 0; c < cnt; c++) {                                                          \
            const uint8_t *blk = row + (b0 + c) * 22;                                        \
            uint32_t qh;                                                                     \
            __m128i v = _mm_loadu_si128((const __m128i *)(blk + 6));                         \
            __m256i lo = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4h),          \
                                          _mm_and_si128(v, m4h));                            \
            __m256i h;                                                                       \
            memcpy(&qh, blk + 2, 4);                                                         \
            h = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);                     \
            h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);                            \
            dw[c] = f16_##SFX(blk);                                                          \
            mw[c] = 0.0f;                                                                    \
            _mm256_storeu_si256((__m256i *)(q + 32 * c),                                     \
                                _mm256_or_si256(lo, _mm256_and_si256(h, _mm256_set1_epi8(16))));\
        }                                                                                    \
        break;                                                                               \
    }                                                                                        \
    case TM_Q8_0:                                                                            \
        for (c = 0; c < cnt; c++) {                                                          \
            const uint8_t *blk = row + (b0 + c) * 34;                                        \
            dw[c] = f16_##SFX(blk);                                                          \
            mw[c] = 0.0f;                                                                    \
            _mm256_storeu_si256((__m256i *)(q + 32 * c),                                     \
                                _mm256_loadu_si256((const __m256i *)(blk + 2)));             \
        }                                                                                    \
        break;                                                                               \
    case TM_Q4_K: {                                                                          \
        /* the 6-bit scales and minima: bytes 0-3 hold scales 0-3 (and the top bits of 4-7),  \
         * 4-7 minima 0-3 (and the top bits of minima 4-7), 8-11 the low nibbles of both */    \
        const uint8_t *sb = row + (b0 / 8) * 144;                                            \
        uint32_t a, b, l;                                                                    \
        uint64_t sc8, mn8;                                                                   \
        memcpy(&a, sb + 4, 4);                                                               \
        memcpy(&b, sb + 8, 4);                                                               \
        memcpy(&l, sb + 12, 4);                                                              \
        sc8 = (uint64_t)(a & 0x3f3f3f3fu)                                                    \
              | (uint64_t)((l & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;              \
        mn8 = (uint64_t)(b & 0x3f3f3f3fu)                                                    \
              | (uint64_t)(((l >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;       \
        _mm256_storeu_ps(dw, _mm256_mul_ps(_mm256_set1_ps(f16_##SFX(sb)), _mm256_cvtepi32_ps( \
            _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8)))));                      \
        _mm256_storeu_ps(mw, _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(             \
            _mm256_set1_ps(f16_##SFX(sb + 2)),                                               \
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn8)))))); \
        for (c = 0; c < 8 && q; c += 2) {                                                    \
            __m256i v = _mm256_loadu_si256((const __m256i *)(sb + 16 + 16 * c));             \
            _mm256_storeu_si256((__m256i *)(q + 32 * c), _mm256_and_si256(v, m4));          \
            _mm256_storeu_si256((__m256i *)(q + 32 * c + 32),                                \
                                _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));              \
        }                                                                                    \
        break;                                                                               \
    }                                                                                        \
    case TM_Q6_K: {                                                                          \
        const uint8_t *sb = row + (b0 / 8) * 210;                                            \
        const int8_t *sc = (const int8_t *)(sb + 192);                                       \
        float d = f16_##SFX(sb + 208);                                                       \
        const __m256i m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi16(32);                 \
        for (c = 0; c < 8; c++) {                                                            \
            int h = c / 4, g = c % 4;                                                        \
            __m256i l4 = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32 * (g & 1)));  \
            __m256i h2 = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));           \
            __m256i v, lo16, hi16;                                                           \
            if (g >> 1) l4 = _mm256_srli_epi16(l4, 4);                                       \
            h2 = _mm256_srl_epi16(h2, _mm_cvtsi32_si128(2 * g));                             \
            v = _mm256_or_si256(_mm256_and_si256(l4, m4),                                    \
                                _mm256_slli_epi16(_mm256_and_si256(h2, m2), 4));             \
            lo16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)), k32);   \
            hi16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)), k32);\
            lo16 = _mm256_mullo_epi16(lo16, _mm256_set1_epi16(sc[8 * h + 2 * g]));           \
            hi16 = _mm256_mullo_epi16(hi16, _mm256_set1_epi16(sc[8 * h + 2 * g + 1]));       \
            _mm256_storeu_si256((__m256i *)(q16 + 32 * c), lo16);                            \
            _mm256_storeu_si256((__m256i *)(q16 + 32 * c + 16), hi16);                       \
            dw[c] = d;                                                                       \
            mw[c] = 0.0f;                                                                    \
        }                                                                                    \
        break;                                                                               \
    }                                                                                        \
    default:                                                                                 \
        break;                                                                               \
    }                                                                                        \
}
TM_X86_DECODE(avx2, ATTR_AVX2)
TM_X86_DECODE(avxvnni, ATTR_AVXVNNI)
TM_X86_DECODE(avx512vnni, ATTR_AVX512)

/* float [8][8]: dst[c][r] = src[r][c] */
#define TM_X86_TRANSPOSE8(SFX, ATTR)                                                         \
static inline ATTR void transpose8_##SFX(float dst[TM_CHUNK][TM_TILE_N],                    \
                                         float src[TM_TILE_N][TM_CHUNK])                    \
{                                                                                            \
    __m256i r[8], u[8];                                                                      \
    int k;                                                                                   \
    for (k = 0; k < 8; k++) r[k] = _mm256_castps_si256(_mm256_loadu_ps(src[k]));             \
    TM_T8(u, r);                                                                             \
    for (k = 0; k < 4; k++) {                                                                \
        _mm256_storeu_ps(dst[k], _mm256_castsi256_ps(                                        \
            _mm256_permute2x128_si256(u[k], u[k + 4], 0x20)));                               \
        _mm256_storeu_ps(dst[k + 4], _mm256_castsi256_ps(                                    \
            _mm256_permute2x128_si256(u[k], u[k + 4], 0x31)));                               \
    }                                                                                        \
}
TM_X86_TRANSPOSE8(avx2, ATTR_AVX2)
TM_X86_TRANSPOSE8(avxvnni, ATTR_AVXVNNI)
TM_X86_TRANSPOSE8(avx512vnni, ATTR_AVX512)

/* A Q4_K super-block (blocks b0 .. b0+7) of the 8 rows at n for activation rows m0 .. m0+mc-1,
 * read straight from the rows: the rows' scale bytes transposed (lanes = rows) and the 6-bit
 * scales and minima unpacked for all 8 rows at once; each 32-byte run of packed nibbles
 * (blocks 2i, 2i+1: low, high nibbles) transposed once for all activation rows; each block's
 * float32 terms added to acc[m] as kern_impl.h's terms() does, in block order. */
#define TM_X86_Q4K_SB(SFX, ATTR, U8)                                                         \
/* the 8 rows' super-blocks at sb[k]: each block c's scale dw[c] = d * sc and minimum        \
 * mw[c] = -(dmin * m) (lanes = rows), from the rows' first 16 bytes transposed */           \
static inline ATTR void q4k_scales_##SFX(const uint8_t *const *sb, __m256 *dw, __m256 *mw)   \
{                                                                                            \
    const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4d = _mm256_set1_epi32(0x0f0f0f0f);   \
    const __m256i m2h = _mm256_set1_epi32(0x30303030), ff = _mm256_set1_epi32(255);          \
    const __m256i hsplit = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,\
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);\
    __m256i r[4], t0, t1, t2, t3, A, B, L, SC[2], MN[2], H;                                  \
    __m256 d, dmin;                                                                          \
    int k, c;                                                                                \
    for (k = 0; k < 4; k++)                                                                  \
        r[k] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)sb[k + 4]),                 \
                                _mm_loadu_si128((const __m128i *)sb[k]));                    \
    t0 = _mm256_unpacklo_epi32(r[0], r[1]); t1 = _mm256_unpackhi_epi32(r[0], r[1]);          \
    t2 = _mm256_unpacklo_epi32(r[2], r[3]); t3 = _mm256_unpackhi_epi32(r[2], r[3]);          \
    H = _mm256_unpacklo_epi64(t0, t2);           /* bytes 0-3 of rows 0-7: d, dmin */        \
    A = _mm256_unpackhi_epi64(t0, t2);           /* bytes 4-7, 8-11, 12-15 */                \
    B = _mm256_unpacklo_epi64(t1, t3);                                                       \
    L = _mm256_unpackhi_epi64(t1, t3);                                                       \
    H = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(H, hsplit), 0xD8);                      \
    d = _mm256_cvtph_ps(_mm256_castsi256_si128(H));                                          \
    dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(H, 1));                                  \
    SC[0] = _mm256_and_si256(A, m6);                                                         \
    SC[1] = _mm256_or_si256(_mm256_and_si256(L, m4d),                                        \
                            _mm256_and_si256(_mm256_srli_epi32(A, 2), m2h));                 \
    MN[0] = _mm256_and_si256(B, m6);                                                         \
    MN[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(L, 4), m4d),                  \
                            _mm256_and_si256(_mm256_srli_epi32(B, 2), m2h));                 \
    for (c = 0; c < 8; c++) {                                                                \
        const __m128i sh = _mm_cvtsi32_si128(8 * (c & 3));                                   \
        __m256i sc = _mm256_and_si256(_mm256_srl_epi32(SC[c >> 2], sh), ff);                 \
        __m256i mn = _mm256_and_si256(_mm256_srl_epi32(MN[c >> 2], sh), ff);                 \
        dw[c] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));                                    \
        mw[c] = _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));\
    }                                                                                        \
}                                                                                            \
static inline ATTR void q4k_sb_##SFX(const tm_job *j, int64_t n, int R, int64_t b0,         \
                                     int64_t m0, int mc, tm_v8f *acc)                        \
{                                                                                            \
    static const uint8_t zeros[144];                                                         \
    const __m256i m4 = _mm256_set1_epi8(15);                                                 \
    const uint8_t *sb[8];                                                                    \
    __m256 dw[8], mw[8];                                                                     \
    __m256i r[8], u[8], lo[8], hi[8];                                                        \
    int64_t nb = j->nb;                                                                      \
    int k, c, m;                                                                             \
    for (k = 0; k < 8; k++)                                                                  \
        sb[k] = k < R ? j->w + (n + k) * j->row_bytes + b0 / 8 * 144 : zeros;                \
    q4k_scales_##SFX(sb, dw, mw);                                                            \
    for (c = 0; c < 8; c += 2) {                                                             \
        const int64_t ba = b0 + c;                                                           \
        for (k = 0; k < 8; k++) r[k] = _mm256_loadu_si256((const __m256i *)(sb[k] + 16 + 16 * c));\
        TM_T8(u, r);                                                                         \
        for (k = 0; k < 8; k++) {                                                            \
            lo[k] = _mm256_and_si256(u[k], m4);                                              \
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(u[k], 4), m4);                        \
        }                                                                                    \
        for (m = 0; m < mc; m++) {                                                           \
            const int8_t *xa = j->xq + (m0 + m) * j->K + ba * TM_QK;                         \
            const int64_t ia = (m0 + m) * nb + ba;                                           \
            __m256i X = _mm256_loadu_si256((const __m256i *)xa);                             \
            __m256i Y = _mm256_loadu_si256((const __m256i *)(xa + TM_QK));                   \
            __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();                  \
            __m256i e = _mm256_setzero_si256(), f = _mm256_setzero_si256();                  \
            __m256 dxa = _mm256_set1_ps(j->dx[ia]), dxb = _mm256_set1_ps(j->dx[ia + 1]);     \
            __m256 t, s = acc[m];                                                            \
            for (k = 0; k < 4; k++) {                                                        \
                __m256i xk = TM_XB(X, k), yk = TM_XB(Y, k);                                  \
                a = U8(a, lo[k], xk);                                                        \
                b = U8(b, lo[k + 4], xk);                                                    \
                e = U8(e, hi[k], yk);                                                        \
                f = U8(f, hi[k + 4], yk);                                                    \
            }                                                                                \
            t = _mm256_mul_ps(_mm256_mul_ps(dw[c], dxa), _mm256_cvtepi32_ps(TM_JOIN(a, b)));  \
            t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(mw[c], dxa),                    \
                                               _mm256_set1_ps((float)j->xs[ia])));          \
            s = _mm256_add_ps(s, t);                                                         \
            t = _mm256_mul_ps(_mm256_mul_ps(dw[c + 1], dxb), _mm256_cvtepi32_ps(TM_JOIN(e, f)));\
            t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(mw[c + 1], dxb),                \
                                               _mm256_set1_ps((float)j->xs[ia + 1])));      \
            acc[m] = _mm256_add_ps(s, t);                                                    \
        }                                                                                    \
    }                                                                                        \
}
TM_X86_Q4K_SB(avx2, ATTR_AVX2, U8_AVX2)
TM_X86_Q4K_SB(avxvnni, ATTR_AVXVNNI, U8_AVXVNNI)
TM_X86_Q4K_SB(avx512vnni, ATTR_AVX512, U8_AVX512)

/* AVX-512: the Q4_K super-block as above, two runs of 32 bytes (blocks 4p .. 4p+3) per 512-bit
 * vector: each 128-bit lane of the transposed vectors holds what a 256-bit half holds above */
static inline ATTR_AVX512 void q4k_sb_zmm(const tm_job *j, int64_t n, int R, int64_t b0,
                                          int64_t m0, int mc, tm_v8f *acc)
{
    static const uint8_t zeros[144];
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i ia = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i ib = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const uint8_t *sb[8];
    __m256 dw[8], mw[8];
    __m512i r[8], u[8], lo[8], hi[8];
    int64_t nb = j->nb;
    int k, p, m;
    for (k = 0; k < 8; k++)
        sb[k] = k < R ? j->w + (n + k) * j->row_bytes + b0 / 8 * 144 : zeros;
    q4k_scales_avx512vnni(sb, dw, mw);
    for (p = 0; p < 2; p++) {
        const int c = 4 * p;
        for (k = 0; k < 8; k++) r[k] = _mm512_loadu_si512((const void *)(sb[k] + 16 + 64 * p));
        transpose16(u, r);
        for (k = 0; k < 8; k++) {
            lo[k] = _mm512_and_si512(u[k], m4);
            hi[k] = _mm512_and_si512(_mm512_srli_epi16(u[k], 4), m4);
        }
        for (m = 0; m < mc; m++) {
            const int8_t *xa = j->xq + (m0 + m) * j->K + (b0 + c) * TM_QK;
            const int64_t i0 = (m0 + m) * nb + b0 + c;
            /* X: blocks c, c+2 (low nibbles); Y: blocks c+1, c+3 (high nibbles) */
            const int8_t *xp = j->xpat ? j->xpat + (((m0 + m) * nb + b0 + c) / 4) * 512 : NULL;
            __m512i X = _mm512_inserti64x4(_mm512_castsi256_si512(
                _mm256_loadu_si256((const __m256i *)xa)), _mm256_loadu_si256((const __m256i *)(xa + 64)), 1);
            __m512i Y = _mm512_inserti64x4(_mm512_castsi256_si512(
                _mm256_loadu_si256((const __m256i *)(xa + 32))), _mm256_loadu_si256((const __m256i *)(xa + 96)), 1);
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            __m512i e = _mm512_setzero_si512(), f = _mm512_setzero_si512(), DL, DH;
            __m256i D[4];
            __m256 s = acc[m];
            int q;
            for (k = 0; k < 4; k++) {
                __m512i xk = xp ? _mm512_load_si512((const void *)(xp + 64 * k))
                                : _mm512_shuffle_epi32(X, (_MM_PERM_ENUM)(k * 0x55));
                __m512i yk = xp ? _mm512_load_si512((const void *)(xp + 256 + 64 * k))
                                : _mm512_shuffle_epi32(Y, (_MM_PERM_ENUM)(k * 0x55));
                a = _mm512_dpbusd_epi32(a, lo[k], xk);
                b = _mm512_dpbusd_epi32(b, lo[k + 4], xk);
                e = _mm512_dpbusd_epi32(e, hi[k], yk);
                f = _mm512_dpbusd_epi32(f, hi[k + 4], yk);
            }
            DL = _mm512_add_epi32(_mm512_permutex2var_epi64(a, ia, b),
                                  _mm512_permutex2var_epi64(a, ib, b));   /* blocks c, c+2 */
            DH = _mm512_add_epi32(_mm512_permutex2var_epi64(e, ia, f),
                                  _mm512_permutex2var_epi64(e, ib, f));   /* blocks c+1, c+3 */
            D[0] = _mm512_castsi512_si256(DL);
            D[1] = _mm512_castsi512_si256(DH);
            D[2] = _mm512_extracti64x4_epi64(DL, 1);
            D[3] = _mm512_extracti64x4_epi64(DH, 1);
            for (q = 0; q < 4; q++) {
                const __m256 dx = _mm256_set1_ps(j->dx[i0 + q]);
                __m256 t = _mm256_mul_ps(_mm256_mul_ps(dw[c + q], dx), _mm256_cvtepi32_ps(D[q]));
                t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(mw[c + q], dx),
                                                   _mm256_set1_ps((float)j->xs[i0 + q])));
                s = _mm256_add_ps(s, t);
            }
            acc[m] = s;
        }
    }
}

/* xq arranged for q4k_sb_zmm: per activation row and 4 blocks 4q .. 4q+3, the 8 vectors it
 * dots with (blocks 4q, 4q+2, then 4q+1, 4q+3; dword k of each block's halves broadcast) */
ATTR_AVX512 int8_t *tm_xpat_avx512vnni(const tm_job *j)
{
    int64_t quads = j->nb / 4, m, q;
    int8_t *buf;
    int k;
    if (j->type != TM_Q4_K) return NULL;
    buf = (int8_t *)aligned_alloc(64, (size_t)(j->M * quads * 512));
    if (!buf) return NULL;
    for (m = 0; m < j->M; m++)
        for (q = 0; q < quads; q++) {
            const int8_t *xa = j->xq + m * j->K + q * 4 * TM_QK;
            int8_t *o = buf + (m * quads + q) * 512;
            __m512i X = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                (const __m256i *)xa)), _mm256_loadu_si256((const __m256i *)(xa + 64)), 1);
            __m512i Y = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(
                (const __m256i *)(xa + 32))), _mm256_loadu_si256((const __m256i *)(xa + 96)), 1);
            for (k = 0; k < 4; k++) {
                _mm512_store_si512((void *)(o + 64 * k),
                                   _mm512_shuffle_epi32(X, (_MM_PERM_ENUM)(k * 0x55)));
                _mm512_store_si512((void *)(o + 256 + 64 * k),
                                   _mm512_shuffle_epi32(Y, (_MM_PERM_ENUM)(k * 0x55)));
            }
        }
    return buf;
}

/* A chunk of 8 blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0: blocks b0 .. b0+7) of the 8 rows at n for
 * activation rows m0 .. m0+mc-1, read straight from the rows: per block, the 8 rows' float16
 * fields gathered (lanes = rows), each row's 32 weights made unsigned bytes in registers
 * (Q8_0's plus 128 where the products do not saturate, Q8U; else |w| times x with w's
 * sign), transposed, dotted; the block's exact integer sum less the offset times
 * the activations' sum (8, 16, 128; Q4_1 none), its float32 term added to acc[m] as terms()
 * does. */
#define TM_X86_Q32_SB(SFX, ATTR, U8, Q8U, Q5H)                                                \
static inline __attribute__((always_inline)) ATTR void                                      \
q32_body_##SFX(const tm_job *j, int64_t n, int R, int64_t b0, int64_t m0, int mc,           \
               tm_v8f *acc, const int type)                                                  \
{                                                                                            \
    static const uint8_t zeros[8 * 34];                                                      \
    const int64_t bb = tm_block_bytes(type);                                                 \
    const int off = type == TM_Q4_0 ? 8 : type == TM_Q5_0 ? 16 : type == TM_Q8_0 ? 128 * Q8U : 0;\
    const __m256i m4 = _mm256_set1_epi8(15), sh04 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);\
    const __m256i hsplit = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,\
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);\
    const __m256i TM_UNUSED spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,   \
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);  \
    const __m256i TM_UNUSED bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);                 \
    const __m256i k16 = _mm256_set1_epi8(16), k80 = _mm256_set1_epi8((char)0x80);             \
    const uint8_t *rp[8];                                                                    \
    __m256i r[8], U[8][8];                                                                   \
    __m256 DW[8], MW[8];                                                                     \
    int64_t nb = j->nb;                                                                      \
    int k, c, m;                                                                             \
    for (k = 0; k < 8; k++)                                                                  \
        rp[k] = k < R ? j->w + (n + k) * j->row_bytes + b0 * bb : zeros;                     \
    for (c = 0; c < 8; c++) {      /* the 8 blocks decoded and transposed, then dotted below */ \
        uint32_t hw[8];                                                                      \
        __m256i H;                                                                           \
        for (k = 0; k < 8; k++) {                                                            \
            const uint8_t *p = rp[k] + c * bb;                                               \
            memcpy(&hw[k], p, 4);                                                            \
            if (type == TM_Q8_0) {                                                           \
                r[k] = _mm256_loadu_si256((const __m256i *)(p + 2));                         \
                if (Q8U) r[k] = _mm256_xor_si256(r[k], k80);                                 \
            } else {                                                                         \
                const int qo = type == TM_Q4_0 ? 2 : type == TM_Q4_1 ? 4 : 6;                \
                __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + qo))); \
                r[k] = _mm256_and_si256(_mm256_srlv_epi32(v, sh04), m4);                     \
                if (type == TM_Q5_0) {                                                       \
                    uint32_t qh;                                                             \
                    memcpy(&qh, p + 2, 4);                                                   \
                    r[k] = Q5H(r[k], qh);                                                    \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
        H = _mm256_loadu_si256((const __m256i *)hw);                                         \
        H = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(H, hsplit), 0xD8);                  \
        DW[c] = _mm256_cvtph_ps(_mm256_castsi256_si128(H));                                  \
        MW[c] = _mm256_cvtph_ps(_mm256_extracti128_si256(H, 1));                             \
        TM_T8(U[c], r);                                                                      \
    }                                                                                        \
    for (m = 0; m < mc; m++) {     /* a row's terms in block order, its sum in a register */ \
        const int64_t i0 = (m0 + m) * nb + b0;                                               \
        const int8_t *xa = j->xq + (m0 + m) * j->K + b0 * TM_QK;                             \
        __m256 s = acc[m];                                                                   \
        for (c = 0; c < 8; c++) {                                                            \
            __m256i X = _mm256_loadu_si256((const __m256i *)(xa + c * TM_QK));               \
            __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256(), D;               \
            const __m256 dx = _mm256_set1_ps(j->dx[i0 + c]);                                 \
            const int32_t xs = j->xs[i0 + c];                                                \
            __m256 t;                                                                        \
            for (k = 0; k < 4; k++) {                                                        \
                __m256i xk = TM_XB(X, k);                                                    \
                if (type == TM_Q8_0 && !Q8U) {  /* signed weights: |w| times x with w's sign */ \
                    a = U8(a, _mm256_abs_epi8(U[c][k]), _mm256_sign_epi8(xk, U[c][k]));      \
                    b = U8(b, _mm256_abs_epi8(U[c][k + 4]), _mm256_sign_epi8(xk, U[c][k + 4])); \
                } else {                                                                     \
                    a = U8(a, U[c][k], xk);                                                  \
                    b = U8(b, U[c][k + 4], xk);                                              \
                }                                                                            \
            }                                                                                \
            D = TM_JOIN(a, b);                                                               \
            if (type == TM_Q4_1) {                                                           \
                t = _mm256_mul_ps(_mm256_mul_ps(DW[c], dx), _mm256_cvtepi32_ps(D));          \
                t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_mul_ps(MW[c], dx),                 \
                                                   _mm256_set1_ps((float)xs)));              \
            } else {                                                                         \
                D = _mm256_sub_epi32(D, _mm256_set1_epi32(off * xs));                        \
                t = _mm256_mul_ps(_mm256_mul_ps(DW[c], dx), _mm256_cvtepi32_ps(D));          \
            }                                                                                \
            s = _mm256_add_ps(s, t);                                                         \
        }                                                                                    \
        acc[m] = s;                                                                          \
    }                                                                                        \
}                                                                                            \
/* the body above compiled for each type */                                                 \
static inline ATTR void q32_sb_##SFX(const tm_job *j, int64_t n, int R, int64_t b0,         \
                                     int64_t m0, int mc, tm_v8f *acc)                        \
{                                                                                            \
    switch (j->type) {                                                                       \
    case TM_Q4_0: q32_body_##SFX(j, n, R, b0, m0, mc, acc, TM_Q4_0); break;                  \
    case TM_Q4_1: q32_body_##SFX(j, n, R, b0, m0, mc, acc, TM_Q4_1); break;                  \
    case TM_Q5_0: q32_body_##SFX(j, n, R, b0, m0, mc, acc, TM_Q5_0); break;                  \
    default: q32_body_##SFX(j, n, R, b0, m0, mc, acc, TM_Q8_0); break;                       \
    }                                                                                        \
}
/* Q5H(r, qh): the bytes r with 16 added where bit i of qh is set (byte i): by a byte mask made
 * from qh (AVX2), or with qh itself as the mask register (AVX-512 BW) */
#define Q5H_AVX2(r, qh) _mm256_or_si256(r, _mm256_and_si256(k16, _mm256_cmpeq_epi8(         \
    _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)(qh)), spread), bit), bit)))
#define Q5H_AVX512(r, qh) _mm256_mask_add_epi8(r, (__mmask32)(qh), r, k16)
TM_X86_Q32_SB(avx2, ATTR_AVX2, U8_AVX2, 0, Q5H_AVX2)
TM_X86_Q32_SB(avxvnni, ATTR_AVXVNNI, U8_AVXVNNI, 1, Q5H_AVX2)
TM_X86_Q32_SB(avx512vnni, ATTR_AVX512, U8_AVX512, 1, Q5H_AVX512)

/* 8 rows' 16 bytes at p[k] + off as 4 vectors of their dwords 0-3 (lanes = rows 0-7) */
#define TM_T4x8(S, p, off)                                                                   \
    do {                                                                                     \
        __m256i q_[4], t0_, t1_, t2_, t3_;                                                   \
        int k_;                                                                              \
        for (k_ = 0; k_ < 4; k_++)                                                           \
            q_[k_] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)((p)[k_ + 4] + (off))),\
                                      _mm_loadu_si128((const __m128i *)((p)[k_] + (off))));  \
        t0_ = _mm256_unpacklo_epi32(q_[0], q_[1]); t1_ = _mm256_unpackhi_epi32(q_[0], q_[1]);\
        t2_ = _mm256_unpacklo_epi32(q_[2], q_[3]); t3_ = _mm256_unpackhi_epi32(q_[2], q_[3]);\
        S[0] = _mm256_unpacklo_epi64(t0_, t2_); S[1] = _mm256_unpackhi_epi64(t0_, t2_);       \
        S[2] = _mm256_unpacklo_epi64(t1_, t3_); S[3] = _mm256_unpackhi_epi64(t1_, t3_);       \
    } while (0)

/* A Q6_K super-block (blocks b0 .. b0+7) of the 8 rows at n for activation rows m0 .. m0+mc-1,
 * read straight from the rows: the 16 int8 scales of the 8 rows transposed once (lanes = rows);
 * per block, the 6-bit values (0..63) as bytes, transposed, dotted as unsigned bytes, and each
 * 16-element half's sum, less 32 times the activations' sum over that half, times its scale:
 * the block's exact integer sum; its float32 term added to acc[m] as terms() does. */
#define TM_X86_Q6K_SB(SFX, ATTR, U8)                                                         \
static inline ATTR void q6k_sb_##SFX(const tm_job *j, int64_t n, int R, int64_t b0,         \
                                     int64_t m0, int mc, tm_v8f *acc)                        \
{                                                                                            \
    static const uint8_t zeros[210];                                                         \
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);                   \
    const uint8_t *sb[8];                                                                    \
    __m256i r[8], u[8], S[4], l0[8], l1[8], hq[8];                                           \
    __m128i hd = _mm_setzero_si128();                                                        \
    __m256 d;                                                                                \
    int64_t nb = j->nb;                                                                      \
    int k, h, g, m;                                                                          \
    for (k = 0; k < 8; k++)                                                                  \
        sb[k] = k < R ? j->w + (n + k) * j->row_bytes + b0 / 8 * 210 : zeros;                \
    TM_T4x8(S, sb, 192);                                                                     \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[0] + 208), 0);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[1] + 208), 1);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[2] + 208), 2);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[3] + 208), 3);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[4] + 208), 4);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[5] + 208), 5);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[6] + 208), 6);                          \
    hd = _mm_insert_epi16(hd, *(const uint16_t *)(sb[7] + 208), 7);                          \
    d = _mm256_cvtph_ps(hd);                                                                 \
    for (h = 0; h < 2; h++) {  /* a half: its low bits and high bits, transposed */          \
        for (k = 0; k < 8; k++) r[k] = _mm256_loadu_si256((const __m256i *)(sb[k] + 64 * h));\
        TM_T8(l0, r);                                                                        \
        for (k = 0; k < 8; k++)                                                              \
            r[k] = _mm256_loadu_si256((const __m256i *)(sb[k] + 64 * h + 32));               \
        TM_T8(l1, r);                                                                        \
        for (k = 0; k < 8; k++)                                                              \
            r[k] = _mm256_loadu_si256((const __m256i *)(sb[k] + 128 + 32 * h));              \
        TM_T8(hq, r);                                                                        \
        _Pragma("GCC unroll 4")                                                              \
        for (g = 0; g < 4; g++) {                                                            \
        const int c = 4 * h + g;                                                             \
        const __m128i s0l = _mm_cvtsi32_si128(24 - 16 * (c & 1));                            \
        const __m128i s1l = _mm_cvtsi32_si128(16 - 16 * (c & 1));                            \
        const __m128i s24 = _mm_cvtsi32_si128(24);                                           \
        /* scales 2c, 2c + 1: bytes (2c) % 4, (2c + 1) % 4 of S[c / 2], sign-extended */     \
        const __m256i sc0 = _mm256_sra_epi32(_mm256_sll_epi32(S[c >> 1], s0l), s24);         \
        const __m256i sc1 = _mm256_sra_epi32(_mm256_sll_epi32(S[c >> 1], s1l), s24);         \
        const int64_t bc = b0 + c;                                                           \
        for (k = 0; k < 8; k++) {  /* value = low 4 bits | high 2 bits << 4 */               \
            __m256i lb = (g & 1) ? l1[k] : l0[k], hb = hq[k];                                \
            if (g >> 1) lb = _mm256_srli_epi16(lb, 4);                                       \
            hb = g == 0 ? _mm256_slli_epi16(hb, 4) : g == 1 ? _mm256_slli_epi16(hb, 2)       \
                 : g == 3 ? _mm256_srli_epi16(hb, 2) : hb;                                   \
            u[k] = _mm256_or_si256(_mm256_and_si256(lb, m4), _mm256_and_si256(hb, m30));     \
        }                                                                                    \
        for (m = 0; m < mc; m++) {                                                           \
            const int64_t ia = (m0 + m) * nb + bc;                                           \
            __m256i X = _mm256_loadu_si256((const __m256i *)(j->xq + (m0 + m) * j->K         \
                                                             + bc * TM_QK));                 \
            __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256(), P, Q, D;         \
            const int32_t x0 = j->xs16[ia], x1 = j->xs[ia] - x0;                             \
            __m256 t;                                                                        \
            for (k = 0; k < 4; k++) {                                                        \
                __m256i xk = TM_XB(X, k);                                                    \
                a = U8(a, u[k], xk);                                                         \
                b = U8(b, u[k + 4], xk);                                                     \
            }                                                                                \
            P = _mm256_permute2x128_si256(a, b, 0x20);    /* first halves, rows 0-7 */       \
            Q = _mm256_permute2x128_si256(a, b, 0x31);    /* second halves */                \
            D = _mm256_add_epi32(                                                            \
                _mm256_mullo_epi32(_mm256_sub_epi32(P, _mm256_set1_epi32(32 * x0)), sc0),     \
                _mm256_mullo_epi32(_mm256_sub_epi32(Q, _mm256_set1_epi32(32 * x1)), sc1));    \
            t = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(j->dx[ia])),                   \
                              _mm256_cvtepi32_ps(D));                                        \
            acc[m] = _mm256_add_ps(acc[m], t);                                               \
        }                                                                                    \
    }                                                                                        \
    }                                                                                        \
}
TM_X86_Q6K_SB(avx2, ATTR_AVX2, U8_AVX2)
TM_X86_Q6K_SB(avxvnni, ATTR_AVXVNNI, U8_AVXVNNI)
TM_X86_Q6K_SB(avx512vnni, ATTR_AVX512, U8_AVX512)


/* the sum of the 8 int32 lanes */
static inline ATTR_AVX2 int32_t hsum8(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_srli_si128(s, 8));
    s = _mm_add_epi32(s, _mm_srli_si128(s, 4));
    return _mm_cvtsi128_si32(s);
}

/* dispatch.c's quantize_rows by AVX2 instructions, the same values: amax is exact in any
 * order, x * inv is one float32 multiply per element either way, the rounding is to nearest
 * even (the default mode nearbyintf uses), the sums are exact integers, a block holding a NaN
 * or an infinity gets dx = NaN and q = 0, and one whose 1 / dx overflows is zero. */
ATTR_AVX2 void tm_quantize_avx2(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx,
                                int32_t *xs, int32_t *xs16)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), lim = _mm256_set1_ps(127.0f);
    int64_t nb = K / TM_QK, m, b;
    int i;
    for (m = 0; m < M; m++)
        for (b = 0; b < nb; b++) {
            const float *v = x + m * K + b * TM_QK;
            __m256 f[4], mx;
            __m256i q[4], s16, s32;
            __m128i h;
            float amax, scale, inv;
            for (i = 0; i < 4; i++) f[i] = _mm256_loadu_ps(v + 8 * i);
            {   /* |x| > FLT_MAX or unordered: an infinity or a NaN */
                const __m256 big = _mm256_set1_ps(FLT_MAX);
                __m256 bad = _mm256_setzero_ps();
                for (i = 0; i < 4; i++)
                    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_andnot_ps(sign, f[i]), big,
                                                          _CMP_NLE_UQ));
                if (_mm256_movemask_ps(bad)) {
                    memset(xq + m * K + b * TM_QK, 0, TM_QK);
                    dx[m * nb + b] = NAN;
                    xs[m * nb + b] = xs16[m * nb + b] = 0;
                    continue;
                }
            }
            mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
                               _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
            h = _mm_castps_si128(_mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1)));
            h = _mm_castps_si128(_mm_max_ps(_mm_castsi128_ps(h), _mm_castsi128_ps(_mm_srli_si128(h, 8))));
            h = _mm_castps_si128(_mm_max_ps(_mm_castsi128_ps(h), _mm_castsi128_ps(_mm_srli_si128(h, 4))));
            amax = _mm_cvtss_f32(_mm_castsi128_ps(h));
            scale = amax / 127.0f;
            inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            if (!(inv <= FLT_MAX)) scale = inv = 0.0f;  /* 1 / dx overflows: a zero block */
            for (i = 0; i < 4; i++) {
                __m256 r = _mm256_round_ps(_mm256_mul_ps(f[i], _mm256_set1_ps(inv)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                r = _mm256_max_ps(_mm256_min_ps(r, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
                q[i] = _mm256_cvtps_epi32(r);
            }
            /* int32 -> int8 in element order: packs interleave 128-bit lanes, the permute
             * puts them back */
            {
                __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
                __m256i p = _mm256_packs_epi16(p01, p23);
                p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256((__m256i *)(xq + m * K + b * TM_QK), p);
            }
            s16 = _mm256_add_epi32(q[0], q[1]);
            s32 = _mm256_add_epi32(s16, _mm256_add_epi32(q[2], q[3]));
            dx[m * nb + b] = scale;
            xs[m * nb + b] = hsum8(s32);
            xs16[m * nb + b] = hsum8(s16);
        }
}

#define TM_SFX(name) name##_avx2
#define TM_TARGET ATTR_AVX2
#define TM_FN static inline ATTR_AVX2
#define TM_F16(p) f16_avx2(p)
#define TM_DECODE decode_avx2
#define TM_TRANSPOSE8 transpose8_avx2
#define TM_Q4K_SB q4k_sb_avx2
#define TM_Q6K_SB q6k_sb_avx2
#define TM_Q32_SB q32_sb_avx2
#include "kern_impl.h"
#undef TM_SFX
#undef TM_TARGET
#undef TM_FN
#undef TM_F16
#undef TM_DECODE
#undef TM_TRANSPOSE8
#undef TM_Q4K_SB
#undef TM_Q6K_SB
#undef TM_Q32_SB

#define TM_SFX(name) name##_avxvnni
#define TM_TARGET ATTR_AVXVNNI
#define TM_FN static inline ATTR_AVXVNNI
#define TM_F16(p) f16_avxvnni(p)
#define TM_DECODE decode_avxvnni
#define TM_TRANSPOSE8 transpose8_avxvnni
#define TM_Q4K_SB q4k_sb_avxvnni
#define TM_Q6K_SB q6k_sb_avxvnni
#define TM_Q32_SB q32_sb_avxvnni
#include "kern_impl.h"
#undef TM_SFX
#undef TM_TARGET
#undef TM_FN
#undef TM_F16
#undef TM_DECODE
#undef TM_TRANSPOSE8
#undef TM_Q4K_SB
#undef TM_Q6K_SB
#undef TM_Q32_SB

#define TM_SFX(name) name##_avx512vnni
#define TM_TARGET ATTR_AVX512
#define TM_FN static inline ATTR_AVX512
#define TM_F16(p) f16_avx512vnni(p)
#define TM_DECODE decode_avx512vnni
#define TM_TRANSPOSE8 transpose8_avx512vnni
#define TM_Q4K_SB q4k_sb_zmm
#define TM_Q6K_SB q6k_sb_avx512vnni
#define TM_Q32_SB q32_sb_avx512vnni
#include "kern_impl.h"

#else
typedef int tm_no_x86;   /* ISO C: a translation unit is not empty */
#endif
