/* Which path runs (by what the CPU and the OS enable, or forced), the activations' int8
 * quantization, the split of the output rows over threads, and the library's C entry points
 * for ctypes (tiny_mindie/kernels/__init__.py). */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tm_kernels.h"

#ifdef TM_HAVE_X86
#include <cpuid.h>
#endif
#ifdef TM_HAVE_NEON
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

#define TM_EXPORT __attribute__((visibility("default")))

#ifndef TM_SOURCES_SHA256
#define TM_SOURCES_SHA256 "unknown"
#endif
/* The digest of the sources this library was built from (setup.py, kernels/sources.py): a
 * package with its C sources beside it loads only a build whose digest is theirs. */
TM_EXPORT const char tm_sources[] = "tm-sources-sha256:" TM_SOURCES_SHA256;

static const char *const path_names[TM_NPATHS] = {
    "portable", "avx2", "avxvnni", "avx512vnni", "neon"};

const char *tm_path_name(int path)
{
    return path >= 0 && path < TM_NPATHS ? path_names[path] : "?";
}

int64_t tm_block_bytes(int type)
{
    switch (type) {
    case TM_Q4_0: return 18;
    case TM_Q4_1: return 20;
    case TM_Q5_0: return 22;
    case TM_Q8_0: return 34;
    case TM_Q4_K: return 144;
    case TM_Q6_K: return 210;
    default: return 0;
    }
}

int64_t tm_block_elems(int type)
{
    return type == TM_Q4_K || type == TM_Q6_K ? TM_QKK : tm_block_bytes(type) ? TM_QK : 0;
}

#ifdef TM_HAVE_X86
static unsigned long long xcr0(void)
{
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (unsigned long long)hi << 32 | lo;
}
#endif

/* 1 when this CPU, with what its OS enables, can run the path (AMX is never used, whatever
 * the CPU lists: only the AVX and AVX-512 register states are asked of the OS) */
static int can_run(int path)
{
    if (path == TM_PORTABLE) return 1;
#ifdef TM_HAVE_X86
    {
        unsigned a, b, c, d, b7 = 0, c7 = 0, a71 = 0;
        unsigned long long x;
        int avx2;
        if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
        if (!(c & (1u << 27)) || !(c & (1u << 28))) return 0;     /* OSXSAVE, AVX */
        if (!(c & (1u << 12)) || !(c & (1u << 29))) return 0;     /* FMA, F16C */
        x = xcr0();
        if ((x & 6) != 6) return 0;                               /* XMM and YMM state */
        if (__get_cpuid_max(0, 0) >= 7) {
            __cpuid_count(7, 0, a, b7, c7, d);
            __cpuid_count(7, 1, a71, b, c, d);
        }
        avx2 = (b7 >> 5) & 1;
        if (path == TM_AVX2) return avx2;
        if (path == TM_AVXVNNI) return avx2 && ((a71 >> 4) & 1);
        if (path == TM_AVX512VNNI)
            return avx2 && (x & 0xE0) == 0xE0                     /* opmask, ZMM state */
                   && ((b7 >> 16) & 1) && ((b7 >> 30) & 1) && ((b7 >> 31) & 1)  /* F BW VL */
                   && ((c7 >> 11) & 1);                            /* VNNI */
    }
#endif
#ifdef TM_HAVE_NEON
    if (path == TM_NEON) return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#endif
    return 0;
}

tm_rows_fn tm_rows_for(int path)
{
    switch (path) {
    case TM_PORTABLE: return tm_rows_portable;
#ifdef TM_HAVE_X86
    case TM_AVX2: return tm_rows_avx2;
    case TM_AVXVNNI: return tm_rows_avxvnni;
    case TM_AVX512VNNI: return tm_rows_avx512vnni16;
#endif
#ifdef TM_HAVE_NEON
    case TM_NEON: return tm_rows_neon;
#endif
    default: return NULL;
    }
}

static int path_of(const char *name)
{
    int p;
    for (p = 0; p < TM_NPATHS; p++)
        if (strcmp(name, path_names[p]) == 0) return p;
    return -1;
}

static int current = -1;                 /* the path in use */
static const char *env_error;            /* why TINY_MINDIE_KERNEL_ISA was refused */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void choose(void)
{
    const char *env = getenv("TINY_MINDIE_KERNEL_ISA");
    static const int order[] = {TM_AVX512VNNI, TM_AVXVNNI, TM_AVX2, TM_NEON, TM_PORTABLE};
    size_t i;
    if (env && *env && strcmp(env, "auto") != 0) {
        int p = path_of(env);
        if (p < 0)
            env_error = "TINY_MINDIE_KERNEL_ISA names no path "
                        "(auto, portable, avx2, avxvnni, avx512vnni, neon)";
        else if (!can_run(p) || !tm_rows_for(p))
            env_error = "TINY_MINDIE_KERNEL_ISA names a path this CPU (or its OS) cannot run";
        else {
            current = p;
            return;
        }
    }
    for (i = 0; i < sizeof order / sizeof *order; i++)
        if (tm_rows_for(order[i]) && can_run(order[i])) {
            current = order[i];
            return;
        }
}

int tm_path(void)
{
    pthread_once(&once, choose);
    return current;
}

/* ---- entry points for ctypes ---- */

/* The name of the path in use ("avx512vnni", ...). */
TM_EXPORT const char *tm_isa(void) { return tm_path_name(tm_path()); }

/* NULL, or why the path TINY_MINDIE_KERNEL_ISA names was refused (the best path runs). */
TM_EXPORT const char *tm_isa_error(void)
{
    tm_path();
    return env_error;
}

/* 1: this CPU runs the path `name`; 0: it cannot (or this build has no such path); -1: no such
 * name. */
TM_EXPORT int tm_isa_supported(const char *name)
{
    int p = path_of(name);
    if (p < 0) return -1;
    return can_run(p) && tm_rows_for(p) != NULL;
}

/* Use the path `name` from now on: 0; -1 no such name; -2 this CPU cannot run it. */
TM_EXPORT int tm_set_isa(const char *name)
{
    int p = path_of(name);
    tm_path();
    if (p < 0) return -1;
    if (!can_run(p) || !tm_rows_for(p)) return -2;
    current = p;
    env_error = NULL;                    /* an explicit choice replaces the variable's */
    return 0;
}

int tm_check(int type, int64_t N, int64_t K, int64_t w_bytes, const char **why)
{
    int64_t be = tm_block_elems(type);
    if (!be) { *why = "unsupported GGUF type"; return -1; }
    if (N <= 0 || K <= 0 || K % be) {
        *why = "N must be positive and K a positive multiple of the type's block";
        return -1;
    }
    if (w_bytes >= 0 && w_bytes != N * (K / be) * tm_block_bytes(type)) {
        *why = "the weight's size is not N rows of K / block blocks";
        return -1;
    }
    return 0;
}

/* x [M, K] -> int8 blocks of 32: dx = max|x| / 127, q = round-half-even(x * (1 / dx)); xs
 * the sums of q per block, xs16 of its first 16. A block holding a NaN or an infinity gets
 * dx = NaN and q = 0, so every output of its row is NaN on every path; a block so small that
 * 1 / dx overflows (max|x| below about 3.7e-37) is zero (dx = 0, q = 0). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx,
                          int32_t *xs, int32_t *xs16)
{
    int64_t nb = K / TM_QK, m, b;
    int i;
    for (m = 0; m < M; m++)
        for (b = 0; b < nb; b++) {
            const float *v = x + m * K + b * TM_QK;
            int8_t *q = xq + m * K + b * TM_QK;
            float amax = 0.0f, scale, inv;
            int32_t s = 0, s16 = 0;
            int finite = 1;
            for (i = 0; i < TM_QK; i++) {
                float a = fabsf(v[i]);
                finite &= a <= FLT_MAX;                 /* false for NaN and infinities */
                amax = a > amax ? a : amax;
            }
            if (!finite) {
                memset(q, 0, TM_QK);
                dx[m * nb + b] = NAN;
                xs[m * nb + b] = xs16[m * nb + b] = 0;
                continue;
            }
            scale = amax / 127.0f;
            inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            if (!(inv <= FLT_MAX)) scale = inv = 0.0f;  /* 1 / dx overflows: a zero block */
            for (i = 0; i < TM_QK; i++) {
                float r = nearbyintf(v[i] * inv);
                r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
                q[i] = (int8_t)r;
                s += q[i];
                if (i == 15) s16 = s;
            }
            dx[m * nb + b] = scale;
            xs[m * nb + b] = s;
            xs16[m * nb + b] = s16;
        }
}

typedef struct {
    const tm_job *job;
    tm_rows_fn rows;
    int64_t per;           /* output rows per piece, a multiple of TM_TILE_N */
} tm_work;

static void work_piece(void *arg, size_t i)
{
    const tm_work *w = (const tm_work *)arg;
    int64_t n0 = (int64_t)i * w->per, n1 = n0 + w->per;
    if (n1 > w->job->N) n1 = w->job->N;
    if (n0 < n1) w->rows(w->job, n0, n1);
}

typedef struct {
    tm_work *work;
    size_t piece;
} tm_thread_arg;

static void *thread_main(void *arg)
{
    tm_thread_arg *t = (tm_thread_arg *)arg;
    work_piece(t->work, t->piece);
    return NULL;
}

/* pieces 1.. on their own threads, piece 0 on the caller's; joined before returning */
static void run_threads(tm_work *work, size_t pieces)
{
    pthread_t tid[64];
    tm_thread_arg args[64];
    int started[64];
    size_t i;
    for (i = 1; i < pieces; i++) {
        args[i].work = work;
        args[i].piece = i;
        started[i] = pthread_create(&tid[i], NULL, thread_main, &args[i]) == 0;
        if (!started[i]) work_piece(work, i);
    }
    work_piece(work, 0);
    for (i = 1; i < pieces; i++)
        if (started[i]) pthread_join(tid[i], NULL);
}

int tm_run(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
           float *y, int threads, tm_for_fn parallel_for, void *pf_ctx, const char **why)
{
    tm_job job;
    tm_work work;
    int64_t nb = K / TM_QK, tiles;
    int8_t *xq;
    float *dx;
    int32_t *xs, *xs16;
    size_t pieces;
    int path = tm_path();

    if (M <= 0) return 0;
    job.type = type; job.M = M; job.N = N; job.K = K; job.nb = nb; job.w = w; job.y = y;
    job.row_bytes = K / tm_block_elems(type) * tm_block_bytes(type);
    xq = (int8_t *)malloc((size_t)(M * K));
    dx = (float *)malloc((size_t)(M * nb) * sizeof(float));
    xs = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    xs16 = (int32_t *)malloc((size_t)(M * nb) * sizeof(int32_t));
    if (!xq || !dx || !xs || !xs16) {
        free(xq); free(dx); free(xs); free(xs16);
        *why = "out of memory";
        return -2;
    }
#ifdef TM_HAVE_X86
    if (path == TM_AVX2 || path == TM_AVXVNNI || path == TM_AVX512VNNI)
        tm_quantize_avx2(x, M, K, xq, dx, xs, xs16);
    else
#endif
    quantize_rows(x, M, K, xq, dx, xs, xs16);
    job.xq = xq; job.dx = dx; job.xs = xs; job.xs16 = xs16; job.xpat = NULL;
#ifdef TM_HAVE_X86
    if (path == TM_AVX512VNNI && M <= TM_TILE_M) job.xpat = tm_xpat_avx512vnni(&job);
#endif
    work.job = &job;
    work.rows = tm_rows_for(path);
    tiles = (N + TM_TILE_N - 1) / TM_TILE_N;
    if (parallel_for) {
        work.per = 8 * TM_TILE_N;
        pieces = (size_t)((N + work.per - 1) / work.per);
        parallel_for(pf_ctx, work_piece, pieces, &work);
    } else {
        if (threads < 1) threads = 1;
        if (threads > 64) threads = 64;
        if (threads > tiles) threads = (int)tiles;
        work.per = (tiles + threads - 1) / threads * TM_TILE_N;
        pieces = (size_t)((N + work.per - 1) / work.per);
        if (pieces > 1) run_threads(&work, pieces);
        else work_piece(&work, 0);
    }
    free(xq); free(dx); free(xs); free(xs16); free((void *)job.xpat);
    return 0;
}

/* y [M, N] = x [M, K] @ W^T, W the GGUF blocks of `type` (w_bytes bytes: N rows of K / block
 * blocks); `threads` threads split N. Returns 0; -1 bad arguments; -2 out of memory; -3 the
 * path TINY_MINDIE_KERNEL_ISA names was refused (tm_isa_error). */
TM_EXPORT int tm_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
                        int64_t w_bytes, int64_t N, float *y, int threads)
{
    const char *why = NULL;
    if (tm_check(type, N, K, w_bytes, &why)) return -1;
    if (tm_isa_error()) return -3;
    return tm_run(type, x, M, K, w, N, y, threads, NULL, NULL, &why);
}
