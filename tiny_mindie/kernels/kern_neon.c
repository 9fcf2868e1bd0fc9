/* The aarch64 path: NEON with the dot product extension (SDOT), chosen where the kernel reports
 * it (getauxval(AT_HWCAP) & HWCAP_ASIMDDP); compiled for it by a target attribute, the library
 * itself for the baseline armv8-a. The integer dot products use SDOT (int8) and widening
 * multiplies (int16, Q6_K); the blocks' decode and the float32 arithmetic are kern_impl.h's, the
 * same as the portable path's. */
#include "tm_kernels.h"

#ifdef TM_HAVE_NEON
#include <arm_neon.h>

float tm_f16_to_f32(const uint8_t *p);

#define ATTR_NEON __attribute__((target("arch=armv8.2-a+dotprod")))

/* 4 vectors of 4 int32 partial sums -> their 4 totals, stored at out */
static inline ATTR_NEON void sum4(int32x4_t a0, int32x4_t a1, int32x4_t a2, int32x4_t a3,
                                  int32_t *out)
{
    vst1q_s32(out, vpaddq_s32(vpaddq_s32(a0, a1), vpaddq_s32(a2, a3)));
}

/* unsigned weights (at most 63: they are signed bytes too) and signed weights alike: SDOT */
static inline ATTR_NEON void dot_s8_neon(const void *w, int64_t ws, const int8_t *const *xp,
                                         int mc, int32_t D[TM_TILE_M][TM_TILE_N])
{
    int8x16_t lo[TM_TILE_N], hi[TM_TILE_N];
    int m, r;
    for (r = 0; r < TM_TILE_N; r++) {
        lo[r] = vld1q_s8((const int8_t *)w + r * ws);
        hi[r] = vld1q_s8((const int8_t *)w + r * ws + 16);
    }
    for (m = 0; m < mc; m++) {
        int8x16_t x0 = vld1q_s8(xp[m]), x1 = vld1q_s8(xp[m] + 16);
        int32x4_t a[TM_TILE_N];
        for (r = 0; r < TM_TILE_N; r++)
            a[r] = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo[r], x0), hi[r], x1);
        sum4(a[0], a[1], a[2], a[3], D[m]);
        sum4(a[4], a[5], a[6], a[7], D[m] + 4);
    }
}

static inline ATTR_NEON void dot_u8_neon(const void *w, int64_t ws, const int8_t *const *xp,
                                         int mc, int32_t D[TM_TILE_M][TM_TILE_N])
{
    dot_s8_neon(w, ws, xp, mc, D);
}

static inline ATTR_NEON void dot_i16_neon(const void *w, int64_t ws, const int8_t *const *xp,
                                          int mc, int32_t D[TM_TILE_M][TM_TILE_N])
{
    int m, r, k;
    for (m = 0; m < mc; m++) {
        int16x8_t x[4];
        int32x4_t a[TM_TILE_N];
        int8x16_t x0 = vld1q_s8(xp[m]), x1 = vld1q_s8(xp[m] + 16);
        x[0] = vmovl_s8(vget_low_s8(x0));
        x[1] = vmovl_high_s8(x0);
        x[2] = vmovl_s8(vget_low_s8(x1));
        x[3] = vmovl_high_s8(x1);
        for (r = 0; r < TM_TILE_N; r++) {
            const int16_t *wr = (const int16_t *)w + r * ws;
            int32x4_t s = vdupq_n_s32(0);
            for (k = 0; k < 4; k++) {
                int16x8_t wv = vld1q_s16(wr + 8 * k);
                s = vmlal_s16(s, vget_low_s16(wv), vget_low_s16(x[k]));
                s = vmlal_high_s16(s, wv, x[k]);
            }
            a[r] = s;
        }
        sum4(a[0], a[1], a[2], a[3], D[m]);
        sum4(a[4], a[5], a[6], a[7], D[m] + 4);
    }
}

#define TM_SFX(name) name##_neon
#define TM_TARGET ATTR_NEON
#define TM_FN static inline ATTR_NEON
#define TM_F16(p) tm_f16_to_f32(p)
#include "kern_impl.h"

#else
typedef int tm_no_neon;  /* ISO C: a translation unit is not empty */
#endif
