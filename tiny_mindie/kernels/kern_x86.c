/* The x86-64 paths: AVX2, AVX-VNNI and AVX-512 VNNI, each compiled for its ISA by a target
 * attribute (the library itself is built for the baseline x86-64: dispatch.c picks a path by
 * what the CPU and the OS enable). The integer dot products differ; the float32 arithmetic is
 * kern_impl.h's, the same as the portable path's. */
#include "tm_kernels.h"

#ifdef TM_HAVE_X86
#include <immintrin.h>
#include <string.h>

/* 8 vectors of 8 int32 partial sums -> one vector of their 8 totals (lane r: v_r's total) */
#define TM_HSUM8(out, v)                                                                     \
    do {                                                                                     \
        __m256i a0_ = _mm256_hadd_epi32(v[0], v[1]), a1_ = _mm256_hadd_epi32(v[2], v[3]);    \
        __m256i a2_ = _mm256_hadd_epi32(v[4], v[5]), a3_ = _mm256_hadd_epi32(v[6], v[7]);    \
        __m256i b0_ = _mm256_hadd_epi32(a0_, a1_), b1_ = _mm256_hadd_epi32(a2_, a3_);        \
        out = _mm256_add_epi32(_mm256_permute2x128_si256(b0_, b1_, 0x20),                   \
                               _mm256_permute2x128_si256(b0_, b1_, 0x31));                  \
    } while (0)

/* The three dot kernels of kern_impl.h for one path, from its products:
 * U8(w, x): 8 int32 partials of unsigned w times signed x; S16(wlo, whi, xlo, xhi): of int16. */
#define TM_DOTS(SFX, ATTR, U8, S16)                                                          \
static inline ATTR void dot_u8_##SFX(const void *w, int64_t ws, const int8_t *const *xp,    \
                                     int mc, int32_t D[TM_TILE_M][TM_TILE_N])               \
{                                                                                            \
    __m256i wv[TM_TILE_N], p[TM_TILE_N], s;                                                  \
    int m, r;                                                                                \
    for (r = 0; r < TM_TILE_N; r++)                                                          \
        wv[r] = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + r * ws));          \
    for (m = 0; m < mc; m++) {                                                               \
        __m256i x = _mm256_loadu_si256((const __m256i *)xp[m]);                              \
        for (r = 0; r < TM_TILE_N; r++) p[r] = U8(wv[r], x);                                 \
        TM_HSUM8(s, p);                                                                      \
        _mm256_storeu_si256((__m256i *)D[m], s);                                             \
    }                                                                                        \
}                                                                                            \
static inline ATTR void dot_s8_##SFX(const void *w, int64_t ws, const int8_t *const *xp,    \
                                     int mc, int32_t D[TM_TILE_M][TM_TILE_N])               \
{                                                                                            \
    __m256i wv[TM_TILE_N], aw[TM_TILE_N], p[TM_TILE_N], s;                                   \
    int m, r;                                                                                \
    for (r = 0; r < TM_TILE_N; r++) {                                                        \
        wv[r] = _mm256_loadu_si256((const __m256i *)((const uint8_t *)w + r * ws));          \
        aw[r] = _mm256_abs_epi8(wv[r]);                                                      \
    }                                                                                        \
    for (m = 0; m < mc; m++) {                                                               \
        __m256i x = _mm256_loadu_si256((const __m256i *)xp[m]);                              \
        for (r = 0; r < TM_TILE_N; r++) p[r] = U8(aw[r], _mm256_sign_epi8(x, wv[r]));        \
        TM_HSUM8(s, p);                                                                      \
        _mm256_storeu_si256((__m256i *)D[m], s);                                             \
    }                                                                                        \
}                                                                                            \
static inline ATTR void dot_i16_##SFX(const void *w, int64_t ws, const int8_t *const *xp,   \
                                      int mc, int32_t D[TM_TILE_M][TM_TILE_N])              \
{                                                                                            \
    __m256i p[TM_TILE_N], s;                                                                 \
    int m, r;                                                                                \
    for (m = 0; m < mc; m++) {                                                               \
        __m256i xl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)xp[m]));          \
        __m256i xh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(xp[m] + 16)));   \
        for (r = 0; r < TM_TILE_N; r++) {                                                    \
            const int16_t *wr = (const int16_t *)w + r * ws;                                 \
            p[r] = S16(_mm256_loadu_si256((const __m256i *)wr),                              \
                       _mm256_loadu_si256((const __m256i *)(wr + 16)), xl, xh);              \
        }                                                                                    \
        TM_HSUM8(s, p);                                                                      \
        _mm256_storeu_si256((__m256i *)D[m], s);                                             \
    }                                                                                        \
}

/* ---- AVX2 (with FMA and F16C, as every AVX2 CPU has; FMA is not used in the arithmetic) ---- */
#define ATTR_AVX2 __attribute__((target("avx2,fma,f16c")))
#define U8_AVX2(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
#define S16_AVX2(wl, wh, xl, xh) \
    _mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh))
TM_DOTS(avx2, ATTR_AVX2, U8_AVX2, S16_AVX2)

/* ---- AVX-VNNI (VEX-encoded VPDPBUSD/VPDPWSSD) ---- */
#define ATTR_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
#define U8_AVXVNNI(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#define S16_AVXVNNI(wl, wh, xl, xh) \
    _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(_mm256_setzero_si256(), wl, xl), wh, xh)
TM_DOTS(avxvnni, ATTR_AVXVNNI, U8_AVXVNNI, S16_AVXVNNI)

/* ---- AVX-512 VNNI (its 256-bit forms: AVX-512 VL) ---- */
#define ATTR_AVX512 \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define U8_AVX512(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#define S16_AVX512(wl, wh, xl, xh) \
    _mm256_dpwssd_epi32(_mm256_dpwssd_epi32(_mm256_setzero_si256(), wl, xl), wh, xh)
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
        const uint8_t *sb = row + (b0 / 8) * 144, *s = sb + 4;                               \
        float d = f16_##SFX(sb), dmin = f16_##SFX(sb + 2);                                   \
        for (c = 0; c < 8; c++) {                                                            \
            int sc, mn;                                                                      \
            if (c < 4) {                                                                     \
                sc = s[c] & 63;                                                              \
                mn = s[c + 4] & 63;                                                          \
            } else {                                                                         \
                sc = (s[c + 4] & 15) | (s[c - 4] >> 6) << 4;                                 \
                mn = (s[c + 4] >> 4) | (s[c] >> 6) << 4;                                     \
            }                                                                                \
            dw[c] = d * (float)sc;                                                           \
            mw[c] = -(dmin * (float)mn);                                                     \
        }                                                                                    \
        for (c = 0; c < 8; c += 2) {                                                         \
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

#define TM_SFX(name) name##_avx2
#define TM_TARGET ATTR_AVX2
#define TM_FN static inline ATTR_AVX2
#define TM_F16(p) f16_avx2(p)
#define TM_DECODE decode_avx2
#include "kern_impl.h"
#undef TM_SFX
#undef TM_TARGET
#undef TM_FN
#undef TM_F16
#undef TM_DECODE

#define TM_SFX(name) name##_avxvnni
#define TM_TARGET ATTR_AVXVNNI
#define TM_FN static inline ATTR_AVXVNNI
#define TM_F16(p) f16_avxvnni(p)
#define TM_DECODE decode_avxvnni
#include "kern_impl.h"
#undef TM_SFX
#undef TM_TARGET
#undef TM_FN
#undef TM_F16
#undef TM_DECODE

#define TM_SFX(name) name##_avx512vnni
#define TM_TARGET ATTR_AVX512
#define TM_FN static inline ATTR_AVX512
#define TM_F16(p) f16_avx512vnni(p)
#define TM_DECODE decode_avx512vnni
#include "kern_impl.h"

#else
typedef int tm_no_x86;   /* ISO C: a translation unit is not empty */
#endif
