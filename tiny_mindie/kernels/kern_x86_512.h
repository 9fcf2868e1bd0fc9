/* AVX-512 helpers shared by kern_x86.c and kern_x86_16.c (included where TM_HAVE_X86). */
#ifndef TM_KERN_X86_512_H
#define TM_KERN_X86_512_H

#include <immintrin.h>

#define ATTR16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* 8 vectors r[0..7] of 16 dwords -> u[0..7]: a 4x4 transposition of dwords within each
 * 128-bit lane, r[0..3] into u[0..3] and r[4..7] into u[4..7] (dword j of u[k]'s lane l is
 * dword k of r[j]'s lane l, or of r[j + 4]'s for u[k + 4]). With r[i] = [row i | row i + 8]
 * (32 bytes each), lane 0 of u[k] (k < 4) holds rows 0-3 at dword k, lane 1 rows 0-3 at
 * dword k + 4, lanes 2 and 3 the same for rows 8-11; u[k + 4] holds rows 4-7 and 12-15. */
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

#endif
