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

#define TM_SFX(name) name##_avx2
#define TM_TARGET ATTR_AVX2
#define TM_FN static inline ATTR_AVX2
#define TM_F16(p) f16_avx2(p)
#include "kern_impl.h"
#undef TM_SFX
#undef TM_TARGET
#undef TM_FN
#undef TM_F16

#define TM_SFX(name) name##_avxvnni
#define TM_TARGET ATTR_AVXVNNI
#define TM_FN static inline ATTR_AVXVNNI
#define TM_F16(p) f16_avxvnni(p)
#include "kern_impl.h"
#undef TM_SFX
#undef TM_TARGET
#undef TM_FN
#undef TM_F16

#define TM_SFX(name) name##_avx512vnni
#define TM_TARGET ATTR_AVX512
#define TM_FN static inline ATTR_AVX512
#define TM_F16(p) f16_avx512vnni(p)
#include "kern_impl.h"

#else
typedef int tm_no_x86;   /* ISO C: a translation unit is not empty */
#endif
