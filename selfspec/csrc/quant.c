/* Weight-only quantized matmuls for drafting with a low-bit copy of the model's own weights:
 *
 *   y[m, n] = sum_k x[m, k] * w[k, n],   w = dequant(q) never materialised
 *
 * int8 (per output channel):  w[k, n] = s[n] * q[k, n],            q in -127..127
 *   chain: acc = +0; for k = 0..K-1: acc = fmaf(x[m, k], (float)q[k, n], acc);  y = acc * s[n]
 * int4 (groups of G rows, asymmetric): w[k, n] = s[g, n] * (u[k, n] - z[g, n]), u in 0..15,
 *   s and z stored as fp16 (exactly the values the quantizer used),
 *   g = k / G; per group: acc = +0; xs = +0; for k in g (increasing):
 *         acc = fmaf(x[m, k], (float)u[k, n], acc); xs = xs + x[m, k]
 *   then y = fmaf(s[g, n], fmaf(-z[g, n], xs, acc), y), groups in increasing order (y starts at +0).
 *
 * As in gemm.c, every output element is one fixed chain computed alone: row m's result is the
 * same bits whatever M, the thread count (threads split N only) or the row blocking, and the
 * scalar references below compute the very same chains. Dequantisation happens in registers:
 * the weights stream at 1 (int8) or 1/2 (int4) byte per element instead of 2 (bf16).
 *
 * Layouts (64-column tiles, NB = ceil(N / 64), zero padded):
 *   int8: q [NB][K][64] int8
 *   int4: q [NB][K][32] bytes: byte j of a tile row holds column j (low nibble) and column
 *         j + 32 (high nibble), so one 16-byte load gives columns j..j+15 and j+32..j+47
 *   s, z: fp32 [N] (int8) / fp16 [ceil(K / G)][N] (int4)
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define QT 64  /* columns per tile */
#define QMR 4  /* rows per register block */
#ifndef QPF
#define QPF 8  /* prefetch distance in k rows */
#endif

typedef struct {
    const void *q;       /* see the layouts above */
    const void *scale;   /* int8: fp32 [N]; int4: fp16 [G][N] */
    const void *zero;    /* int4: fp16 [G][N] (in quantized units); NULL for int8 */
    long in_features, out_features;
    long group;          /* int4: rows per group; int8: unused */
    int bits;            /* 8 or 4 */
} ss_qweight;

static inline __mmask16 qlanes(long n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
}

static inline uint16_t q_f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void q_store(void *y, int y_bf16, long off, float v) {
    if (y_bf16) ((uint16_t *)y)[off] = q_f32_to_bf16(v); else ((float *)y)[off] = v;
}

/* ---- int8 ---------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void tile_q8(
    const int R, long K, const float *xr, const int8_t *wt, const float *s,
    void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    __m512 acc[QMR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long k = 0; k < K; k++) {
        const int8_t *wk = wt + k * QT;
        _mm_prefetch((const char *)(wk + QPF * QT), _MM_HINT_T0);
        __m512 w[4];
        for (int j = 0; j < 4; j++)
            w[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wk + 16 * j))));
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xr[r * K + k]);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(xb, w[j], acc[r][j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        long c0 = n0 + 16 * j;
        if (c0 >= N) break;
        __mmask16 mk = qlanes(N - c0);
        __m512 sc = _mm512_maskz_loadu_ps(mk, s + c0);
        for (int r = 0; r < R; r++) {
            float out[16];
            _mm512_storeu_ps(out, _mm512_mul_ps(acc[r][j], sc));
            long left = N - c0 < 16 ? N - c0 : 16;
            for (long c = 0; c < left; c++) q_store(y, y_bf16, (m0 + r) * ldy + c0 + c, out[c]);
        }
    }
}

/* ---- int4 ---------------------------------------------------------------------------- */

/* the 16 columns c0..c0+15 (c0 in {0, 16}) and c0+32.. of a tile row from its 32 bytes */
static inline __attribute__((always_inline)) void q4_row(const uint8_t *wk, int half, __m512 *lo, __m512 *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(wk + 16 * half)));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

/* column slice j (0..3) of a tile <-> (half, lo/hi): slices 0,1 are the low nibbles of halves
 * 0,1 (columns 0..31), slices 2,3 the high nibbles (columns 32..63) */
static inline __m512 load_h16(const uint16_t *p, __mmask16 mk) {  /* 16 fp16 -> fp32 (exact) */
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p));
}

static inline __attribute__((always_inline)) void tile_q4(
    const int R, long K, long G, const float *xr, const uint8_t *wt, const uint16_t *s, const uint16_t *z,
    void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    __m512 yv[QMR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) yv[r][j] = _mm512_setzero_ps();
    __mmask16 mk[4];
    for (int j = 0; j < 4; j++) mk[j] = qlanes(N - (n0 + 16 * j));
    for (long k0 = 0, g = 0; k0 < K; k0 += G, g++) {
        long kn = K - k0 < G ? K - k0 : G;
        __m512 acc[QMR][4];
        float xs[QMR];
        for (int r = 0; r < R; r++) {
            xs[r] = 0.0f;
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        }
        for (long k = k0; k < k0 + kn; k++) {
            const uint8_t *wk = wt + k * (QT / 2);
            _mm_prefetch((const char *)(wk + QPF * (QT / 2)), _MM_HINT_T0);
            __m512 w[4];
            q4_row(wk, 0, &w[0], &w[2]);
            q4_row(wk, 1, &w[1], &w[3]);
            for (int r = 0; r < R; r++) {
                float xv = xr[r * K + k];
                __m512 xb = _mm512_set1_ps(xv);
                xs[r] = xs[r] + xv;
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_fmadd_ps(xb, w[j], acc[r][j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            __m512 sc = load_h16(s + g * N + n0 + 16 * j, mk[j]);
            __m512 nz = _mm512_sub_ps(_mm512_setzero_ps(), load_h16(z + g * N + n0 + 16 * j, mk[j]));
            for (int r = 0; r < R; r++)
                yv[r][j] = _mm512_fmadd_ps(sc, _mm512_fmadd_ps(nz, _mm512_set1_ps(xs[r]), acc[r][j]), yv[r][j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        long c0 = n0 + 16 * j;
        if (c0 >= N) break;
        long left = N - c0 < 16 ? N - c0 : 16;
        for (int r = 0; r < R; r++) {
            float out[16];
            _mm512_storeu_ps(out, yv[r][j]);
            for (long c = 0; c < left; c++) q_store(y, y_bf16, (m0 + r) * ldy + c0 + c, out[c]);
        }
    }
}

static int q_team(long ntiles, int nthreads) {
    int nt = nthreads;
#ifdef _OPENMP
    if (nt <= 0) nt = omp_get_max_threads();
#endif
    if (ntiles < nt) nt = (int)ntiles;
    return nt < 1 ? 1 : nt;
}

/* x: [M, K] (x_bf16 ? bf16 : fp32) contiguous; y: [M, N] (y_bf16 ? bf16 : fp32).
 * Returns 0 on success, 2 for a bad descriptor, 1 when out of memory. */
int selfspec_qgemm(long M, const void *x, int x_bf16, const void *wd, void *y, int y_bf16, int nthreads) {
    const ss_qweight *w = (const ss_qweight *)wd;
    const long K = w->in_features, N = w->out_features;
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || (w->bits != 8 && w->bits != 4) || (w->bits == 4 && (w->group <= 0 || !w->zero))) return 2;
    float stackbuf[8192];
    float *xf = (M * K <= (long)(sizeof(stackbuf) / 4)) ? stackbuf : (float *)malloc(sizeof(float) * M * K);
    if (!xf) return 1;
    for (long i = 0; i < M * K; i++) {
        if (x_bf16) { uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16; memcpy(&xf[i], &u, 4); }
        else xf[i] = ((const float *)x)[i];
    }
    long ntiles = (N + QT - 1) / QT;
    int nt = q_team(ntiles, nthreads);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (long t = 0; t < ntiles; t++) {
        long n0 = t * QT;
        for (long m0 = 0; m0 < M; m0 += QMR) {
            const float *xr = xf + m0 * K;
            int R = M - m0 < QMR ? (int)(M - m0) : QMR;
            if (w->bits == 8) {
                const int8_t *wt = (const int8_t *)w->q + t * K * QT;
                const float *sc = (const float *)w->scale;
                switch (R) {
                case 4: tile_q8(4, K, xr, wt, sc, y, y_bf16, N, m0, n0, N); break;
                case 3: tile_q8(3, K, xr, wt, sc, y, y_bf16, N, m0, n0, N); break;
                case 2: tile_q8(2, K, xr, wt, sc, y, y_bf16, N, m0, n0, N); break;
                default: tile_q8(1, K, xr, wt, sc, y, y_bf16, N, m0, n0, N); break;
                }
            } else {
                const uint8_t *wt = (const uint8_t *)w->q + t * K * (QT / 2);
                const uint16_t *sc = (const uint16_t *)w->scale, *zp = (const uint16_t *)w->zero;
                switch (R) {
                case 4: tile_q4(4, K, w->group, xr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
                case 3: tile_q4(3, K, w->group, xr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
                case 2: tile_q4(2, K, w->group, xr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
                default: tile_q4(1, K, w->group, xr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
                }
            }
        }
    }
    if (xf != stackbuf) free(xf);
    return 0;
}

/* Scalar references of the same chains (fp32 x and y), for the tests. */
int selfspec_qgemm_ref(long M, const float *x, const ss_qweight *w, float *y) {
    const long K = w->in_features, N = w->out_features;
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            long t = n / QT, c = n % QT;
            if (w->bits == 8) {
                const int8_t *q = (const int8_t *)w->q + t * K * QT;
                float acc = 0.0f;
                for (long k = 0; k < K; k++) acc = fmaf(x[m * K + k], (float)q[k * QT + c], acc);
                y[m * N + n] = acc * ((const float *)w->scale)[n];
            } else {
                const uint8_t *q = (const uint8_t *)w->q + t * K * (QT / 2);
                float out = 0.0f;
                for (long k0 = 0, g = 0; k0 < K; k0 += w->group, g++) {
                    float acc = 0.0f, xs = 0.0f;
                    for (long k = k0; k < K && k < k0 + w->group; k++) {
                        uint8_t b = q[k * (QT / 2) + c % 32];
                        float u = (float)(c < 32 ? (b & 0xF) : (b >> 4));
                        acc = fmaf(x[m * K + k], u, acc);
                        xs = xs + x[m * K + k];
                    }
                    float sc = _cvtsh_ss(((const uint16_t *)w->scale)[g * N + n]), zp = _cvtsh_ss(((const uint16_t *)w->zero)[g * N + n]);
                    out = fmaf(sc, fmaf(-zp, xs, acc), out);
                }
                y[m * N + n] = out;
            }
        }
    return 0;
}

/* The quantizers' clipping search (selfspec/quant.py): the squared error of candidate
 * quantizations of w [K, N] (fp32, row-major), per (candidate, group, column):
 *
 *   err[c, g, n] = sum over k in group g of ((clamp(round(w[k, n] / s + z), lo, hi) - z) * s - w[k, n])^2
 *   with s = s[c, g, n], z = z[c, g, n] (z NULL: 0), groups of `group` rows (the last one short)
 *
 * round() is round-half-to-even, as torch.round; the sum runs over k in increasing order.
 * Only the choice of scale depends on these sums, never a token: the draft's output is
 * verified. One pass over w computes every candidate (torch needed 7 passes per candidate).
 * Threads split the columns. */
int selfspec_quant_errors(const float *w, long K, long N, long group, const float *s, const float *z, int ncand,
                          float lo, float hi, float *err, int nthreads) {
    if (K <= 0 || N <= 0 || group <= 0 || ncand <= 0) return -1;
    long G = (K + group - 1) / group;
    long nblocks = (N + 15) / 16;
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
#ifdef _OPENMP
    #pragma omp parallel for num_threads(nthreads > 0 ? nthreads : 1) schedule(static)
#endif
    for (long b = 0; b < nblocks; b++) {
        long n0 = b * 16;
        __mmask16 m = qlanes(N - n0);
        for (long g = 0; g < G; g++) {
            long k0 = g * group, k1 = k0 + group < K ? k0 + group : K;
            for (int c = 0; c < ncand; c++) {
                long off = ((long)c * G + g) * N + n0;
                __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), m, s + off);
                __m512 zv = z ? _mm512_maskz_loadu_ps(m, z + off) : _mm512_setzero_ps();
                __m512 acc = _mm512_setzero_ps();
                for (long k = k0; k < k1; k++) {
                    __m512 x = _mm512_maskz_loadu_ps(m, w + k * N + n0);
                    __m512 u = _mm512_add_ps(_mm512_div_ps(x, sv), zv);
                    u = _mm512_roundscale_ps(u, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);  /* half to even */
                    u = _mm512_min_ps(_mm512_max_ps(u, vlo), vhi);
                    __m512 d = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(u, zv), sv), x);
                    acc = _mm512_fmadd_ps(d, d, acc);
                }
                _mm512_mask_storeu_ps(err + off, m, acc);
            }
        }
    }
    return 0;
}
