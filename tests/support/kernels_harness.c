/* A command-line face of the kernel library's C entry points, for running it where Python is
 * not (tests/unit/test_kernels_aarch64.py: the aarch64 build under qemu-user).
 *
 *   kernels_harness INPUT OUTPUT
 *
 * INPUT: int64 type, M, N, K, threads, w_bytes; then float32 x [M, K]; then w_bytes bytes of
 * GGUF blocks (little-endian, as written by numpy). OUTPUT: float32 y [M, N]. Prints the ISA
 * path it ran (tm_isa) on stdout; exit status 1 on any failure, with the reason on stderr.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

const char *tm_isa(void);
const char *tm_isa_error(void);
int tm_matmul(int type, const float *x, int64_t M, int64_t K, const uint8_t *w,
              int64_t w_bytes, int64_t N, float *y, int threads);

int main(int argc, char **argv)
{
    int64_t h[6];
    float *x, *y;
    uint8_t *w;
    FILE *in, *out;
    int r;
    if (argc != 3 || !(in = fopen(argv[1], "rb"))) {
        fprintf(stderr, "usage: kernels_harness INPUT OUTPUT\n");
        return 1;
    }
    if (fread(h, sizeof h, 1, in) != 1) return 1;
    x = malloc((size_t)(h[1] * h[3]) * sizeof *x);
    y = malloc((size_t)(h[1] * h[2]) * sizeof *y);
    w = malloc((size_t)h[5]);
    if (!x || !y || !w) return 1;
    if (fread(x, sizeof *x, (size_t)(h[1] * h[3]), in) != (size_t)(h[1] * h[3])) return 1;
    if (fread(w, 1, (size_t)h[5], in) != (size_t)h[5]) return 1;
    fclose(in);
    if (tm_isa_error()) {
        fprintf(stderr, "%s\n", tm_isa_error());
        return 1;
    }
    r = tm_matmul((int)h[0], x, h[1], h[3], w, h[5], h[2], y, (int)h[4]);
    if (r) {
        fprintf(stderr, "tm_matmul: %d\n", r);
        return 1;
    }
    if (!(out = fopen(argv[2], "wb"))) return 1;
    fwrite(y, sizeof *y, (size_t)(h[1] * h[2]), out);
    fclose(out);
    printf("%s\n", tm_isa());
    return 0;
}
