/* tiny_mindie's matrix product on GGUF blocks: shared declarations.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T, W held as the GGUF file's own blocks (rows of blocks), x float32.
 * The activations are quantized to int8 per block of 32 (symmetric: scale = max|x| / 127,
 * q = round-half-even(x / scale)); each 32-block contributes one float32 term, computed from
 * an exact int32 dot product, and a row's terms are added in block order. Every ISA path does
 * the same float32 operations in the same order (no fused multiply-add: -ffp-contract=off), so
 * a row's output depends on no other row, on no thread split and on no path: see kern_impl.h.
 */
#ifndef TM_KERNELS_H
#define TM_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* GGUF (ggml) type ids of the supported block types */
enum {
    TM_Q4_0 = 2, TM_Q4_1 = 3, TM_Q5_0 = 6, TM_Q8_0 = 8, TM_Q4_K = 12, TM_Q6_K = 14
};

/* the ISA paths, in order of preference */
enum { TM_PORTABLE = 0, TM_AVX2 = 1, TM_AVXVNNI = 2, TM_AVX512VNNI = 3, TM_NEON = 4,
       TM_NPATHS = 5 };

#define TM_QK 32          /* elements per block (a K-quant's sub-block) */
#define TM_QKK 256        /* elements per K-quant super-block */
#define TM_TILE_N 8       /* weight rows computed together */
#define TM_TILE_M 8       /* activation rows of one dot kernel call */
#define TM_GROUP_M 64     /* activation rows computed together (weights decoded once for them) */
#ifndef TM_PREFETCH
#define TM_PREFETCH 1    /* fetch the next tile's rows ahead (0: leave it to the hardware) */
#endif
#define TM_CHUNK 8        /* 32-blocks decoded at a time (one K-quant super-block) */

/* 8 float32 / int32 lanes (GCC and clang vector extensions): the float32 terms of 8 rows at once,
 * each lane the same IEEE operations as a scalar */
typedef float tm_v8f __attribute__((vector_size(32)));
typedef int32_t tm_v8i __attribute__((vector_size(32)));

/* One product, prepared: the activations already quantized. */
typedef struct {
    int type;
    int64_t M, N, K, nb;          /* nb = K / 32 */
    const uint8_t *w;             /* N rows of row_bytes */
    int64_t row_bytes;
    const int8_t *xq;             /* [M, K] */
    const float *dx;              /* [M, nb] activation scales */
    const int32_t *xs;            /* [M, nb] sums of xq per block */
    const int32_t *xs16;          /* [M, nb] sums of xq per block's first 16 */
    const int8_t *xpat;           /* NULL, or xq arranged for a path's own kernel (tm_xpat_...) */
    float *y;                     /* [M, N] */
} tm_job;

/* rows n0..n1 of the output (n0 a multiple of TM_TILE_N), every m */
typedef void (*tm_rows_fn)(const tm_job *job, int64_t n0, int64_t n1);

void tm_rows_portable(const tm_job *job, int64_t n0, int64_t n1);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TM_HAVE_X86 1
void tm_rows_avx2(const tm_job *job, int64_t n0, int64_t n1);
/* dispatch.c's activation quantization (the same values) by AVX2 instructions */
void tm_quantize_avx2(const float *x, int64_t M, int64_t K, int8_t *xq, float *dx, int32_t *xs,
                      int32_t *xs16);
void tm_rows_avxvnni(const tm_job *job, int64_t n0, int64_t n1);
void tm_rows_avx512vnni(const tm_job *job, int64_t n0, int64_t n1);
/* kern_x86_16.c: blocks of 32 on 16 rows at once, the K-quants by tm_rows_avx512vnni */
void tm_rows_avx512vnni16(const tm_job *job, int64_t n0, int64_t n1);
/* xq of a Q4_K job arranged for the AVX-512 Q4_K kernel (malloc'd: the caller frees it), or
 * NULL (another type, or out of memory: the kernel then arranges xq itself) */
int8_t *tm_xpat_avx512vnni(const tm_job *job);
#endif
#if defined(__aarch64__) && defined(__GNUC__) && defined(__linux__)
#define TM_HAVE_NEON 1
void tm_rows_neon(const tm_job *job, int64_t n0, int64_t n1);
#endif

/* bytes per block and elements per block of a type; 0 for an unknown type */
int64_t tm_block_bytes(int type);
int64_t tm_block_elems(int type);

/* dispatch.c */
int tm_path(void);                       /* the path in use (chosen on first call) */
const char *tm_path_name(int path);
tm_rows_fn tm_rows_for(int path);
const char *tm_isa_error(void);          /* NULL, or why TINY_MINDIE_KERNEL_ISA was refused */
/* 0 when type, N, K (and w_bytes, unless negative) describe a product; else -1 and why */
int tm_check(int type, int64_t N, int64_t K, int64_t w_bytes, const char **why);
/* the product; threads > 1: that many threads split N (pthreads, no spinning); rows_fn NULL:
 * the path in use. Returns 0, or -1 on bad arguments (why says which), -2 out of memory. */
typedef void (*tm_for_fn)(void *ctx, void (*fn)(void *, size_t), size_t total, void *arg);
int tm_run(int type, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N,
           float *y, int threads, tm_for_fn parallel_for, void *pf_ctx, const char **why);

/* kern_gather.c: y [T, K] = the rows ids [T] of W (N rows of K), dequantized to float32.
 * Returns 0, or -1 on bad arguments or an id outside 0 .. N-1 (why says which; nothing read). */
int tm_gather_rows(int type, const int64_t *ids, int64_t T, const uint8_t *w, int64_t w_bytes,
                   int64_t N, int64_t K, float *y, const char **why);

#endif
