/* The portable C path: every CPU; the reference of the others (the same float32 operations). */
#include "tm_kernels.h"

float tm_f16_to_f32(const uint8_t *p);

#define TM_SFX(name) name##_portable
#define TM_TARGET
#define TM_FN static inline
#define TM_F16(p) tm_f16_to_f32(p)

/* IEEE half (little-endian bytes) -> float, exactly (subnormals, infinities, NaN). */
float tm_f16_to_f32(const uint8_t *p)
{
    unsigned h = (unsigned)p[0] | (unsigned)p[1] << 8;
    unsigned sign = (h >> 15) & 1, e = (h >> 10) & 31, f = h & 1023;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        float mag = (float)f * (1.0f / 16777216.0f);    /* f * 2^-24: exact */
        return sign ? -mag : mag;
    }
    if (e == 31)
        v.u = sign << 31 | 0x7F800000u | f << 13;
    else
        v.u = sign << 31 | (e + 112) << 23 | f << 13;
    return v.f;
}

TM_FN void dot_u8_portable(const void *w, int64_t ws, const int8_t *const *xp, int mc,
                           int32_t D[TM_TILE_M][TM_TILE_N])
{
    int m, r, i;
    for (m = 0; m < mc; m++)
        for (r = 0; r < TM_TILE_N; r++) {
            const uint8_t *wr = (const uint8_t *)w + r * ws;
            int32_t s = 0;
            for (i = 0; i < TM_QK; i++) s += (int32_t)wr[i] * xp[m][i];
            D[m][r] = s;
        }
}

TM_FN void dot_s8_portable(const void *w, int64_t ws, const int8_t *const *xp, int mc,
                           int32_t D[TM_TILE_M][TM_TILE_N])
{
    int m, r, i;
    for (m = 0; m < mc; m++)
        for (r = 0; r < TM_TILE_N; r++) {
            const int8_t *wr = (const int8_t *)w + r * ws;
            int32_t s = 0;
            for (i = 0; i < TM_QK; i++) s += (int32_t)wr[i] * xp[m][i];
            D[m][r] = s;
        }
}

TM_FN void dot_i16_portable(const void *w, int64_t ws, const int8_t *const *xp, int mc,
                            int32_t D[TM_TILE_M][TM_TILE_N])
{
    int m, r, i;
    for (m = 0; m < mc; m++)
        for (r = 0; r < TM_TILE_N; r++) {
            const int16_t *wr = (const int16_t *)w + r * ws;
            int32_t s = 0;
            for (i = 0; i < TM_QK; i++) s += (int32_t)wr[i] * xp[m][i];
            D[m][r] = s;
        }
}

#include "kern_impl.h"
