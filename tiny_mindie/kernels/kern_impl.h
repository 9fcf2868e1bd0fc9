/* The product's body, compiled once per ISA path: the including file defines
 *   TM_SFX(name)  the path's name for a function (name ## _avx2, ...)
 *   TM_TARGET     the ISA's target attribute (may be empty)
 *   TM_FN         the attributes of its internal functions (static inline TM_TARGET)
 *   TM_F16(p)     the float value of the little-endian IEEE half at p
 *   TM_DECODE     optionally, the path's own decode (below)
 *   TM_TRANSPOSE8 optionally, the path's transpose of float [8][8] (dst, src)
 *   TM_Q4K_SB     optionally, a whole Q4_K super-block of the 8 rows for activation rows
 *                 m0 .. m0+mc-1 (j, n, R, b0, m0, mc, acc), read straight from the rows, its
 *                 terms added to acc[0..mc-1] as terms() below does
 *   TM_Q6K_SB     optionally, the same for a Q6_K super-block
 *   TM_Q32_SB     optionally, the same for 8 blocks of a type of blocks of 32
 *   the dot kernels TM_SFX(dot_u8), TM_SFX(dot_s8), TM_SFX(dot_i16), each
 *     (const void *w, int64_t wstride, const int8_t *const *xp, int mc,
 *      int32_t D[TM_TILE_M][TM_TILE_N]):
 *     D[m][r] = sum over i < 32 of w_r[i] * xp[m][i], w_r the 32 weights at w + r * wstride
 *     (bytes: unsigned for dot_u8, signed for dot_s8; int16 for dot_i16), r < TM_TILE_N.
 * Integer sums are exact, so their order is free; the float32 arithmetic below is the same on
 * every path, per output element, in block order:
 *   I   = D - off * xs                      (the block's dot with the weights' own values)
 *   t   = (dw * dx) * (float)I              (dw the weight block's scale, dx the activations')
 *   t   = t + (mw * dx) * (float)xs         (types with a block minimum mw: Q4_1, Q4_K)
 *   acc = acc + t
 */

/* A row's blocks b0 .. b0+cnt-1 as integer weights (q: bytes, q16: int16 for Q6_K) with each
 * block's scale dw and minimum mw (w = dw * (q - off) + mw). A path may bring its own
 * (TM_DECODE: the same values, by vector instructions). */
#ifndef TM_DECODE
#define TM_DECODE TM_SFX(decode)
TM_FN void TM_SFX(decode)(int type, const uint8_t *row, int64_t b0, int cnt, uint8_t *q,
                          int16_t *q16, float *dw, float *mw)
{
    int c, i;
    switch (type) {
    case TM_Q4_0:
        for (c = 0; c < cnt; c++) {
            const uint8_t *blk = row + (b0 + c) * 18, *qs = blk + 2;
            uint8_t *o = q + 32 * c;
            dw[c] = TM_F16(blk);
            mw[c] = 0.0f;
            for (i = 0; i < 16; i++) { o[i] = qs[i] & 15; o[i + 16] = qs[i] >> 4; }
        }
        break;
    case TM_Q4_1:
        for (c = 0; c < cnt; c++) {
            const uint8_t *blk = row + (b0 + c) * 20, *qs = blk + 4;
            uint8_t *o = q + 32 * c;
            dw[c] = TM_F16(blk);
            mw[c] = TM_F16(blk + 2);
            for (i = 0; i < 16; i++) { o[i] = qs[i] & 15; o[i + 16] = qs[i] >> 4; }
        }
        break;
    case TM_Q5_0:
        for (c = 0; c < cnt; c++) {
            const uint8_t *blk = row + (b0 + c) * 22, *qs = blk + 6;
            uint8_t *o = q + 32 * c;
            uint32_t qh = (uint32_t)blk[2] | (uint32_t)blk[3] << 8 | (uint32_t)blk[4] << 16
                          | (uint32_t)blk[5] << 24;
            dw[c] = TM_F16(blk);
            mw[c] = 0.0f;
            for (i = 0; i < 16; i++) {
                o[i] = (uint8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
                o[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
            }
        }
        break;
    case TM_Q8_0:
        for (c = 0; c < cnt; c++) {
            const uint8_t *blk = row + (b0 + c) * 34;
            dw[c] = TM_F16(blk);
            mw[c] = 0.0f;
            for (i = 0; i < 32; i++) q[32 * c + i] = blk[2 + i];
        }
        break;
    case TM_Q4_K: {              /* cnt == 8: one super-block */
        const uint8_t *sb = row + (b0 / 8) * 144, *s = sb + 4;
        float d = TM_F16(sb), dmin = TM_F16(sb + 2);
        for (c = 0; c < 8; c++) {
            int sc, mn;
            if (c < 4) {
                sc = s[c] & 63;
                mn = s[c + 4] & 63;
            } else {
                sc = (s[c + 4] & 15) | (s[c - 4] >> 6) << 4;
                mn = (s[c + 4] >> 4) | (s[c] >> 6) << 4;
            }
            dw[c] = d * (float)sc;
            mw[c] = -(dmin * (float)mn);
        }
        for (c = 0; c < 8; c += 2) {          /* blocks c, c+1: low, high nibbles of 32 bytes */
            const uint8_t *qs = sb + 16 + 16 * c;
            uint8_t *o = q + 32 * c;
            for (i = 0; i < 32; i++) {
                o[i] = qs[i] & 15;
                o[i + 32] = qs[i] >> 4;
            }
        }
        break;
    }
    case TM_Q6_K: {              /* cnt == 8: one super-block */
        const uint8_t *sb = row + (b0 / 8) * 210, *ql = sb, *qh = sb + 128;
        const int8_t *sc = (const int8_t *)(sb + 192);
        float d = TM_F16(sb + 208);
        for (c = 0; c < 8; c++) {
            int h = c / 4, g = c % 4;
            const uint8_t *l4 = ql + 64 * h + 32 * (g & 1), *h2 = qh + 32 * h;
            int lsh = 4 * (g >> 1), hsh = 2 * g;
            int16_t s0 = sc[8 * h + 2 * g], s1 = sc[8 * h + 2 * g + 1];
            int16_t *o = q16 + 32 * c;
            dw[c] = d;
            mw[c] = 0.0f;
            for (i = 0; i < 32; i++) {
                int v = ((l4[i] >> lsh) & 15) | ((h2[i] >> hsh) & 3) << 4;
                o[i] = (int16_t)((i < 16 ? s0 : s1) * (v - 32));
            }
        }
        break;
    }
    default:
        break;
    }
}
#endif

/* Block b's float32 terms added to the 8 rows' accumulators of each activation row */
TM_FN void TM_SFX(terms)(const tm_job *j, tm_v8f *acc, const float *dw, const float *mw,
                         int32_t D[TM_TILE_M][TM_TILE_N], int64_t b, int64_t m0, int mc,
                         int off, int has_min)
{
    int m;
    tm_v8f dwv, mwv;
    memcpy(&dwv, dw, sizeof dwv);
    memcpy(&mwv, mw, sizeof mwv);
    for (m = 0; m < mc; m++) {
        const float dx = j->dx[(m0 + m) * j->nb + b];
        const int32_t xs = j->xs[(m0 + m) * j->nb + b];
        tm_v8f t;
        tm_v8i Dv;
        memcpy(&Dv, D[m], sizeof Dv);
        if (has_min) {
            t = (dwv * dx) * __builtin_convertvector(Dv, tm_v8f);
            t = t + (mwv * dx) * (float)xs;
        } else {
            t = (dwv * dx) * __builtin_convertvector(Dv - off * xs, tm_v8f);
        }
        acc[m] = acc[m] + t;
    }
}

/* Output rows n .. n+R-1 (R <= TM_TILE_N) for activation rows m0 .. m0+mc-1 (mc <= TM_GROUP_M):
 * each chunk of the 8 weight rows is decoded once for all mc rows. */
TM_FN void TM_SFX(tile)(const tm_job *j, int64_t n, int R, int64_t m0, int mc)
{
    enum { W = TM_CHUNK * TM_QK };
    tm_v8f acc[TM_GROUP_M];                                    /* lane r: row n + r */
    _Alignas(32) float dw[TM_CHUNK][TM_TILE_N], mw[TM_CHUNK][TM_TILE_N];   /* [block][row] */
    float dwr[TM_TILE_N][TM_CHUNK], mwr[TM_TILE_N][TM_CHUNK];  /* [row][block] */
    _Alignas(64) uint8_t q[TM_TILE_N][W];
    _Alignas(64) int16_t q16[TM_TILE_N][W];
    _Alignas(32) int32_t D[TM_TILE_M][TM_TILE_N];
    const int8_t *xp[TM_TILE_M];
    const int type = j->type;
    const int off = type == TM_Q4_0 ? 8 : type == TM_Q5_0 ? 16 : 0;
    const int has_min = type == TM_Q4_1 || type == TM_Q4_K;
    const int chunk = j->nb % TM_CHUNK == 0 ? TM_CHUNK : 1;
    /* bytes of a row per chunk, and the next tile's rows (fetched a tile ahead) */
    const int64_t cb = chunk * TM_QK / tm_block_elems(type) * tm_block_bytes(type);
    const int64_t ahead = n + TM_TILE_N + TM_TILE_N <= j->N ? TM_TILE_N
                          : n + TM_TILE_N < j->N ? j->N - n - TM_TILE_N : 0;
    int64_t b0, b, i;
    int m, r, c, s, sc;

    for (m = 0; m < mc; m++)
        for (r = 0; r < TM_TILE_N; r++) acc[m][r] = 0.0f;
    for (r = R; r < TM_TILE_N; r++) {          /* rows past the matrix: zero weights */
        for (c = 0; c < W; c++) { q[r][c] = 0; q16[r][c] = 0; }
        for (c = 0; c < TM_CHUNK; c++) { dwr[r][c] = 0.0f; mwr[r][c] = 0.0f; }
    }
    for (b0 = 0; b0 < j->nb; b0 += chunk) {
        for (r = 0; r < ahead; r++) {
            const uint8_t *next = j->w + (n + TM_TILE_N + r) * j->row_bytes + b0 / chunk * cb;
            for (i = 0; i < cb && TM_PREFETCH; i += 64) __builtin_prefetch(next + i);
        }
#ifdef TM_Q4K_SB
        if (type == TM_Q4_K) {     /* a path's own: the super-block straight from the rows */
            TM_Q4K_SB(j, n, R, b0, m0, mc, acc);
            continue;
        }
#endif
#ifdef TM_Q32_SB
        if (chunk == TM_CHUNK && type != TM_Q4_K && type != TM_Q6_K) {  /* blocks of 32 */
            TM_Q32_SB(j, n, R, b0, m0, mc, acc);
            continue;
        }
#endif
#ifdef TM_Q6K_SB
        if (type == TM_Q6_K) {     /* a path's own: the super-block straight from the rows */
            TM_Q6K_SB(j, n, R, b0, m0, mc, acc);
            continue;
        }
#endif
        for (r = 0; r < R; r++)
            TM_DECODE(type, j->w + (n + r) * j->row_bytes, b0, chunk, q[r], q16[r], dwr[r],
                      mwr[r]);
#ifdef TM_TRANSPOSE8
        if (chunk == TM_CHUNK) {
            TM_TRANSPOSE8(dw, dwr);
            TM_TRANSPOSE8(mw, mwr);
        } else
#endif
        for (r = 0; r < TM_TILE_N; r++)
            for (c = 0; c < chunk; c++) { dw[c][r] = dwr[r][c]; mw[c][r] = mwr[r][c]; }
        for (c = 0; c < chunk; c++) {
            b = b0 + c;
            for (s = 0; s < mc; s += TM_TILE_M) {
                sc = mc - s < TM_TILE_M ? mc - s : TM_TILE_M;
                for (m = 0; m < sc; m++) xp[m] = j->xq + (m0 + s + m) * j->K + b * TM_QK;
                if (type == TM_Q6_K)
                    TM_SFX(dot_i16)(&q16[0][c * TM_QK], W, xp, sc, D);
                else if (type == TM_Q8_0)
                    TM_SFX(dot_s8)(&q[0][c * TM_QK], W, xp, sc, D);
                else
                    TM_SFX(dot_u8)(&q[0][c * TM_QK], W, xp, sc, D);
                TM_SFX(terms)(j, acc + s, dw[c], mw[c], D, b, m0 + s, sc, off, has_min);
            }
        }
    }
    for (m = 0; m < mc; m++)
        for (r = 0; r < R; r++) j->y[(m0 + m) * j->N + n + r] = acc[m][r];
}

TM_TARGET void TM_SFX(tm_rows)(const tm_job *j, int64_t n0, int64_t n1)
{
    int64_t n, m0;
    for (n = n0; n < n1; n += TM_TILE_N) {
        int R = (int)(n1 - n < TM_TILE_N ? n1 - n : TM_TILE_N);
        for (m0 = 0; m0 < j->M; m0 += TM_GROUP_M)
            TM_SFX(tile)(j, n, R, m0, (int)(j->M - m0 < TM_GROUP_M ? j->M - m0 : TM_GROUP_M));
    }
}
