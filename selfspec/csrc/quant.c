/* Weight-only quantized matmuls for drafting with a low-bit copy of the model's own weights:
 *
 *   y[m, n] ~ sum_k x[m, k] * w[k, n],   w = dequant(q) never materialised
 *
 * Integer dot products (AVX512-VNNI vpdpbusd: 4 unsigned bytes x 4 signed bytes summed into an
 * int32 lane) do the work, so the activations are quantized too, per row, in blocks of QB = 32
 * consecutive k (block b = k in 32b..32b+31, the last one short; QB is a compile-time constant,
 * 32 or 64: 64 agrees ~2 points less often with the full model on gemma-3-270m):
 *
 *   amax = max |x[m, k]| over the block (x: bf16 or fp32, widened to fp32 exactly)
 *   sx[m, b] = amax / 127.0f                                 (one fp32 division)
 *   xq[m, k] = clamp(rne(x[m, k] / sx[m, b]), -127, 127)      (one fp32 division, round half to
 *              even; NaN clamps to -127); a block with sx == 0 (all zeros, or amax so tiny that
 *              amax / 127 underflows) has xq = 0; k beyond K: xq = 0
 *   xs[m, b] = sum of xq[m, k] over the block                 (int32, exact)
 *
 * int8 (per output channel): w[k, n] = s[n] * q[k, n], q in -127..127, stored as u = q + 128.
 *   per block b:  acc = sum over k in b of u[k, n] * xq[m, k]             (int32, exact)
 *                 y = fmaf(sx[m, b], (float)(acc - 128 * xs[m, b]), y)     (blocks in increasing
 *                 order, y starting at +0.0f); then y = y * s[n]
 * int4 (groups of QG = 64 rows, asymmetric): w[k, n] = s[g, n] * (u[k, n] - z[g, n]), u in 0..15,
 *   s and z fp16 (exactly the values the quantizer used); a group holds QG / QB whole blocks,
 *   each block b taking the (s, z) of its group g = b * QB / QG:
 *   per block b:  acc = sum over k in b of u[k, n] * xq[m, k]             (int32, exact)
 *                 t = fmaf(-z[g, n], (float)xs[m, b], (float)acc)
 *                 y = fmaf(sx[m, b] * s[g, n], t, y)   (sx * s: one fp32 product; blocks in
 *                 increasing order, y starting at +0.0f)
 * The int32 sums are exact (|acc| <= QB * 255 * 127 < 2^24, so (float) is exact too): the order
 * inside a block cannot matter, and row m's bits are the same whatever M, the row blocking or
 * the thread count (threads split N only). selfspec_qgemm_ref computes the same chains in
 * scalar C. Output fp32, or bf16 rounded once from fp32 (nearest even).
 * Without AVX512-VNNI, vpdpbusd is emulated exactly with AVX512BW (vpmaddwd on bytes widened to
 * 16 bits: no saturation): the same bits.
 *
 * Layouts (64-column tiles, NB = ceil(N / 64); a 64-byte load = 16 columns x 4 bytes, one int32
 * lane of vpdpbusd per column):
 *   int8: u [NB][K4][64][4] uint8, K4 = ceil(K / 4): byte i of column c in k-row j is u[4j + i, c];
 *         padding (k >= K, n >= N) is 128 (q = 0; k padding meets xq = 0 anyway)
 *   int4: [NB][K8][64][4] bytes, K8 = ceil(K / 8): byte i of column c in k-row j holds
 *         u[8j + i, c] (low nibble) and u[8j + 4 + i, c] (high nibble); padding 0
 *   s, z: fp32 [N] (int8) / fp16 [ceil(K / 64)][N] (int4)
 */
#include "simd.h"
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include "pool.h"

#define QT 64  /* columns per tile */
#ifndef QB
#define QB 32  /* activation block (k): 32 or 64, dividing the int4 group */
#endif
#define QG 64  /* int4 group (rows): selfspec/quant.py INT4_GROUP */
#define QMR 4  /* rows per register block */
#ifndef QMR8
#ifdef __AVX512F__
#define QMR8 6  /* int8 on AVX-512: 6 rows x 4 slices = 24 int32 accumulators + 4 weight vectors + 1 broadcast <= 32 zmm */
#else
#define QMR8 QMR
#endif
#endif
#define QMR_MAX (QMR8 > QMR ? QMR8 : QMR)

typedef struct {
    const void *q;       /* see the layouts above */
    const void *scale;   /* int8: fp32 [N]; int4: fp16 [G][N] */
    const void *zero;    /* int4: fp16 [G][N] (in quantized units); NULL for int8 */
    long in_features, out_features;
    long group;          /* int4: rows per group (must be QG); int8: unused */
    int bits;            /* 8 or 4 */
} ss_qweight;

#define qlanes lanes16

static inline uint16_t q_f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline void q_store(void *y, int y_bf16, long off, float v) {
    if (y_bf16) ((uint16_t *)y)[off] = q_f32_to_bf16(v); else ((float *)y)[off] = v;
}

static inline float q_load_x(const void *x, int x_bf16, long i) {
    if (!x_bf16) return ((const float *)x)[i];
    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f; memcpy(&f, &u, 4);
    return f;
}

/* One row's activation quantization (the specification above): x row (K values) ->
 * xq [nblk * QB] (zero padded), sx [nblk], xs [nblk]. Scalar (the reference's). */
static void q_act_row(const void *x, int x_bf16, long row, long K, int8_t *xq, float *sx, int32_t *xs) {
    long nblk = (K + QB - 1) / QB;
    for (long b = 0; b < nblk; b++) {
        long k0 = b * QB, k1 = k0 + QB < K ? k0 + QB : K;
        float amax = 0.0f;
        for (long k = k0; k < k1; k++) {
            float a = fabsf(q_load_x(x, x_bf16, row * K + k));
            amax = a > amax ? a : amax;  /* NaN never wins */
        }
        float s = amax / 127.0f;
        int32_t sum = 0;
        for (long k = k0; k < k0 + QB; k++) {
            int v = 0;
            if (k < k1 && s != 0.0f) {
                float r = nearbyintf(q_load_x(x, x_bf16, row * K + k) / s);  /* default mode: half to even */
                r = fminf(fmaxf(r, -127.0f), 127.0f);  /* fmaxf(NaN, -127) = -127 */
                v = (int)r;
            }
            xq[k] = (int8_t)v;
            sum += v;
        }
        sx[b] = s;
        xs[b] = sum;
    }
}

/* q_act_row for other files (csrc/screen.c's residual needs the very xq and sx qgemm multiplies) */
void selfspec_q_act_row(const void *x, int x_bf16, long row, long K, int8_t *xq, float *sx, int32_t *xs) {
    q_act_row(x, x_bf16, row, K, xq, sx, xs);
}

/* q_act_row 16 k at a time, the same operations lane by lane (max never taking a NaN, one
 * IEEE division, round half to even, the clamp sending NaN to -127): the same bits. */
static void q_act_row_v(const void *x, int x_bf16, long row, long K, int8_t *xq, float *sx, int32_t *xs) {
    long nblk = (K + QB - 1) / QB;
    const vf16 lo = vf_set1(-127.0f), hi = vf_set1(127.0f);
    for (long b = 0; b < nblk; b++) {
        long k0 = b * QB, k1 = k0 + QB < K ? k0 + QB : K;
        vf16 v[QB / 16];
        vf16 amax = vf_zero();
        for (int i = 0; i < QB / 16; i++) {
            m16 mk = qlanes(k1 - (k0 + 16 * i));
            v[i] = x_bf16 ? vf_load_bf16((const uint16_t *)x + row * K + k0 + 16 * i, mk)
                          : vf_maskz_loadu(mk, (const float *)x + row * K + k0 + 16 * i);
            amax = vf_max(vf_abs(v[i]), amax);  /* a NaN lane keeps amax */
        }
        float m = vf_reduce_max(amax);
        float s = m / 127.0f;
        vi16 sum = vi_zero();
        for (int i = 0; i < QB / 16; i++) {
            vi16 q = vi_zero();
            if (s != 0.0f) q = vi_from_f(vf_min(vf_max(vf_round(vf_div(v[i], vf_set1(s))), lo), hi));  /* max(NaN, -127) = -127 */
            sum = vi_add(sum, q);
            vi_store_i8(xq + k0 + 16 * i, q);
        }
        sx[b] = s;
        xs[b] = vi_reduce_add(sum);
    }
}

#ifdef __AVX512F__
/* ---- AVX-512: 64-byte vectors, 32 registers ------------------------------------------ */

/* acc + per int32 lane: sum over its 4 bytes of (unsigned byte of a) * (signed byte of b) */
static inline __m512i q_dpbusd(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    /* = _mm512_dpbusd_epi32(acc, a, b); inline asm keeps the accumulator in place (gcc 12 copies
     * it around every intrinsic call: ~1 extra move per instruction in the inner loops) */
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
#else  /* exact: u8 * s8 products fit int16, vpmaddwd sums pairs into int32 without saturation */
    const __m512i lo = _mm512_set1_epi16(0x00FF);
    __m512i ae = _mm512_and_si512(a, lo), ao = _mm512_srli_epi16(a, 8);
    __m512i be = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8), bo = _mm512_srai_epi16(b, 8);
    return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ae, be), _mm512_madd_epi16(ao, bo)));
#endif
}

static inline __m512i q_bcast4(const int8_t *p) {  /* 4 bytes of xq to every int32 lane */
    int32_t v; memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* rows m0..m0+R-1 (their xq rows at xq + r * KP, sx/xs at + r * nblk) of a 64-column tile: out */
static inline __attribute__((always_inline)) void q_tile_store(
    const int R, __m512 yv[QMR_MAX][4], void *y, int y_bf16, long ldy, long m0, long n0, long N) {
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

/* The accumulators of a tile (R rows x 4 slices of 16 columns, int32 per block, fp32 across
 * blocks) and int4's unpacked nibbles do not all fit the 32 zmm registers with R >= 3: there
 * int4 sweeps a block's k rows (2 KB, in L1 after the first pass) once per half tile (2 slices,
 * 32 columns). int8 fits up to QMR8 = 6 rows (24 accumulators; the fp32 sums live in memory
 * between blocks) and makes one pass. Speed only: the sums are exact integers whatever the
 * order. Prefetch: one row streams in address order and the hardware prefetcher does best
 * alone (measured); from QPF_ROWS rows the loop spends long enough on each k-row that memory
 * falls behind, so it asks for the row QPF k-rows ahead (Zen 5, int8 LM head at 5-8 rows
 * 8-15% faster, in-cache 20-30%, with the 6-row blocks). Two rows alone (m0 == 0: the
 * tile's first pass, from memory; after a 6-row block the tile is in L2 already) get the
 * hints too: without them 2 rows took longer than 3 (a 2-core Intel Xeon with AMX, Granite
 * Rapids class, streamed: the int8 draft copy's layers 4.74 ms at 2 rows, 3.91 at 3, 3.50
 * with the hints; the int8 LM head 7.64 -> 6.10). */
#define QJ_INT8 4
#ifndef QPF
#define QPF 16  /* k-rows (256 bytes each) ahead */
#endif
#ifndef QPF_ROWS
#define QPF_ROWS 3
#endif
/* From QPF_ROWS rows the k-row loop is slow enough that memory and compute stop overlapping
 * (measured on Zen 4: a 6-row LM head took the sum of its streaming and its in-cache time):
 * a second hint, QPF_L2 k-rows (32 KB) ahead into L2, keeps enough lines in flight
 * (Zen 4, int8 LM head from memory: 6 rows 1.25x, 8 rows 1.45x, 16 rows 1.3x faster; 1-2 rows,
 * which stream at the memory's pace without it, are left alone). */
#ifndef QPF_L2
#define QPF_L2 128
#endif
#define QJ_INT4(R) ((R) >= 3 ? 2 : 4)

/* ---- int8 ---------------------------------------------------------------------------- */

static inline __attribute__((always_inline)) void tile_q8(
    const int R, long K4, long nblk, long KP, const int8_t *xq, const float *sx, const int32_t *xs,
    const uint8_t *wt, const float *s, void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    __m512 yv[QMR_MAX][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) yv[r][j] = _mm512_setzero_ps();
    const int J = QJ_INT8;
    for (long b = 0; b < nblk; b++) {
        long k40 = b * (QB / 4), k41 = k40 + QB / 4 < K4 ? k40 + QB / 4 : K4;
        for (int j0 = 0; j0 < 4; j0 += J) {
            __m512i acc[QMR_MAX][4];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_si512();
            for (long k4 = k40; k4 < k41; k4++) {
                const uint8_t *wk = wt + k4 * (QT * 4) + 64 * j0;
                if (R >= QPF_ROWS || (R == 2 && m0 == 0))  /* hints only: never fault, no effect on results */
                    for (int c = 0; c < 4; c++) {
                        _mm_prefetch((const char *)(wk + QPF * QT * 4) + 64 * c, _MM_HINT_T0);
                        _mm_prefetch((const char *)(wk + QPF_L2 * QT * 4) + 64 * c, _MM_HINT_T1);
                    }
                __m512i w[4];
                for (int j = 0; j < J; j++) w[j] = _mm512_loadu_si512((const void *)(wk + 64 * j));
                for (int r = 0; r < R; r++) {
                    __m512i xb = q_bcast4(xq + r * KP + 4 * k4);
                    for (int j = 0; j < J; j++) acc[r][j] = q_dpbusd(acc[r][j], w[j], xb);
                }
            }
            for (int r = 0; r < R; r++) {
                __m512i corr = _mm512_set1_epi32(128 * xs[r * nblk + b]);
                __m512 sb = _mm512_set1_ps(sx[r * nblk + b]);
                for (int j = 0; j < J; j++)
                    yv[r][j0 + j] = _mm512_fmadd_ps(sb, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], corr)), yv[r][j0 + j]);
            }
        }
    }
    for (int j = 0; j < 4; j++) {
        __m512 sc = _mm512_maskz_loadu_ps(qlanes(N - (n0 + 16 * j)), s + n0 + 16 * j);
        for (int r = 0; r < R; r++) yv[r][j] = _mm512_mul_ps(yv[r][j], sc);
    }
    q_tile_store(R, yv, y, y_bf16, ldy, m0, n0, N);
}

/* ---- int4 ---------------------------------------------------------------------------- */

static inline __m512 load_h16(const uint16_t *p, __mmask16 mk) {  /* 16 fp16 -> fp32 (exact) */
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, p));
}

static inline __attribute__((always_inline)) void tile_q4(
    const int R, long K8, long nblk, long KP, const int8_t *xq, const float *sx, const int32_t *xs,
    const uint8_t *wt, const uint16_t *s, const uint16_t *z, void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    __m512 yv[QMR_MAX][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) yv[r][j] = _mm512_setzero_ps();
    __mmask16 mk[4];
    for (int j = 0; j < 4; j++) mk[j] = qlanes(N - (n0 + 16 * j));
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const int J = QJ_INT4(R);
    for (long b = 0; b < nblk; b++) {
        long g = b / (QG / QB);  /* the block's int4 group */
        long k80 = b * (QB / 8), k81 = k80 + QB / 8 < K8 ? k80 + QB / 8 : K8;
        for (int j0 = 0; j0 < 4; j0 += J) {
            __m512i acc[QMR][4];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < J; j++) acc[r][j] = _mm512_setzero_si512();
            for (long k8 = k80; k8 < k81; k8++) {
                const uint8_t *wk = wt + k8 * (QT * 4) + 64 * j0;
                __m512i lo[4], hi[4];
                for (int j = 0; j < J; j++) {
                    __m512i v = _mm512_loadu_si512((const void *)(wk + 64 * j));
                    lo[j] = _mm512_and_si512(v, nib);
                    hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                }
                for (int r = 0; r < R; r++) {
                    __m512i xl = q_bcast4(xq + r * KP + 8 * k8), xh = q_bcast4(xq + r * KP + 8 * k8 + 4);
                    for (int j = 0; j < J; j++) acc[r][j] = q_dpbusd(q_dpbusd(acc[r][j], lo[j], xl), hi[j], xh);
                }
            }
            for (int j = 0; j < J; j++) {
                __m512 sc = load_h16(s + g * N + n0 + 16 * (j0 + j), mk[j0 + j]);
                __m512 nz = _mm512_sub_ps(_mm512_setzero_ps(), load_h16(z + g * N + n0 + 16 * (j0 + j), mk[j0 + j]));
                for (int r = 0; r < R; r++) {
                    __m512 t = _mm512_fmadd_ps(nz, _mm512_set1_ps((float)xs[r * nblk + b]), _mm512_cvtepi32_ps(acc[r][j]));
                    yv[r][j0 + j] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(sx[r * nblk + b]), sc), t, yv[r][j0 + j]);
                }
            }
        }
    }
    q_tile_store(R, yv, y, y_bf16, ldy, m0, n0, N);
}


#else
/* ---- AVX2: 32-byte vectors (8 columns x 4 k), 16 registers ------------------------------
 * No vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16 with
 * saturation, so each operand pair is chosen to stay far from it, which keeps every sum exact:
 *   int8: q = u ^ 0x80 = u - 128 (signed, |q| <= 127); vpmaddubsw(|xq|, sign(q, xq)) gives
 *         pairs of xq q with |sum| <= 2 127 127 < 2^15, vpmaddwd(., 1) the 4-term int32 sums:
 *         acc = sum of xq q = sum of xq u - 128 xs exactly, the AVX-512 path's int32 value;
 *   int4: u in 0..15 is unsigned already: vpmaddubsw(u, xq), |pair| <= 2 15 127, and the low
 *         and high nibbles' pairs added in int16 (<= 7620) before vpmaddwd.
 * The fp32 chains across blocks are the specification's (sums parked in memory). A register
 * block is R rows x J vectors, R J <= 8 int32 accumulators; every loop over rows and vectors is
 * unrolled (GCC otherwise keeps some accumulators in memory). */

static inline __attribute__((always_inline)) __m256i q_bcast4_8(const int8_t *p) {
    int32_t v; memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* A k-row of a tile (QT columns x 4 bytes = 4 lines) into L1, a hint only (never faults, no
 * effect on results). The several-row tiles ask for the next block's row in their first column
 * pass: those passes read each row in 64-byte strides, which the hardware prefetcher follows
 * late, so memory now streams under the compute (2-8 rows 13-30% faster on Zen 3). */
static inline __attribute__((always_inline)) void q_prefetch_row(const uint8_t *row) {
    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)row + 64 * c, _MM_HINT_T0);
}

/* The same k-row into L2 only: asked for QPF_L2_AVX2 k-rows (16 KB) ahead, far enough that
 * memory keeps streaming while several rows compute (Zen 4 running this code: 6 rows 1.2x,
 * 2-8 rows 1.07-1.13x faster). */
#ifndef QPF_L2_AVX2
#define QPF_L2_AVX2 64
#endif
static inline __attribute__((always_inline)) void q_prefetch_row_l2(const uint8_t *row) {
    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)row + 64 * c, _MM_HINT_T1);
}

/* 8 fp32 of an [N]-long array from column c (columns >= N read as 0) */
static inline __attribute__((always_inline)) __m256 q_load8_f32(const float *a, long c, long N) {
    if (c + 8 <= N) return _mm256_loadu_ps(a + c);
    float t[8] = {0};
    for (long i = 0; c + i < N && i < 8; i++) t[i] = a[c + i];
    return _mm256_loadu_ps(t);
}
static inline __attribute__((always_inline)) __m256 q_load8_h16(const uint16_t *a, long c, long N) {
    if (c + 8 <= N) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + c)));
    uint16_t t[8] = {0};
    for (long i = 0; c + i < N && i < 8; i++) t[i] = a[c + i];
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)t));
}

static inline __attribute__((always_inline)) void q_tile_out(const int R, float yv[QMR][QT], const float *s8,
                                                              void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++)
        for (long c = 0; c < QT && n0 + c < N; c++)
            q_store(y, y_bf16, (m0 + r) * ldy + n0 + c, s8 ? yv[r][c] * s8[n0 + c] : yv[r][c]);
}

static inline __attribute__((always_inline)) void tile_q8(
    const int R, long K4, long nblk, long KP, const int8_t *xq, const float *sx, const int32_t *xs,
    const uint8_t *wt, const float *s, void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    float yv[QMR][QT];
    memset(yv, 0, sizeof(yv));
    (void)xs;  /* acc is sum xq q already: no 128 xs correction */
    const int J = R == 1 ? 8 : R == 2 ? 4 : 2;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (long b = 0; b < nblk; b++) {
        long k40 = b * (QB / 4), k41 = k40 + QB / 4 < K4 ? k40 + QB / 4 : K4;
        for (int j0 = 0; j0 < 8; j0 += J) {
            __m256i acc[QMR][8];
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++)
                _Pragma("GCC unroll 16")
                for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_si256();
            for (long k4 = k40; k4 < k41; k4++) {
                const uint8_t *wk = wt + k4 * (QT * 4) + 32 * j0;
                if (R == 1) {  /* one row: each weight vector used once, loaded where it is used */
                    __m256i xb = q_bcast4_8(xq + 4 * k4), ax = _mm256_abs_epi8(xb);
                    _Pragma("GCC unroll 16")
                    for (int j = 0; j < J; j++) {
                        __m256i qj = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wk + 32 * j)), flip);
                        acc[0][j] = _mm256_add_epi32(acc[0][j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(qj, xb)), ones));
                    }
                    continue;
                }
                if (j0 == 0) {  /* the next block's row, and one far ahead into L2 */
                    q_prefetch_row(wt + (k4 + QB / 4) * (QT * 4));
                    q_prefetch_row_l2(wt + (k4 + QPF_L2_AVX2) * (QT * 4));
                }
                __m256i q[8];
                _Pragma("GCC unroll 16")
                for (int j = 0; j < J; j++) q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wk + 32 * j)), flip);
                _Pragma("GCC unroll 16")
                for (int r = 0; r < R; r++) {
                    __m256i xb = q_bcast4_8(xq + r * KP + 4 * k4), ax = _mm256_abs_epi8(xb);
                    _Pragma("GCC unroll 16")
                    for (int j = 0; j < J; j++)
                        acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q[j], xb)), ones));
                }
            }
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++) {
                __m256 sb = _mm256_set1_ps(sx[r * nblk + b]);
                _Pragma("GCC unroll 16")
                for (int j = 0; j < J; j++) {
                    float *yp = yv[r] + 8 * (j0 + j);
                    _mm256_storeu_ps(yp, _mm256_fmadd_ps(sb, _mm256_cvtepi32_ps(acc[r][j]), _mm256_loadu_ps(yp)));
                }
            }
        }
    }
    q_tile_out(R, yv, s, y, y_bf16, ldy, m0, n0, N);
}

static inline __attribute__((always_inline)) void tile_q4(
    const int R, long K8, long nblk, long KP, const int8_t *xq, const float *sx, const int32_t *xs,
    const uint8_t *wt, const uint16_t *s, const uint16_t *z, void *y, int y_bf16, long ldy, long m0, long n0, long N) {
    float yv[QMR][QT];
    memset(yv, 0, sizeof(yv));
    const int J = R == 1 ? 4 : 2;
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (long b = 0; b < nblk; b++) {
        long g = b / (QG / QB);  /* the block's int4 group */
        long k80 = b * (QB / 8), k81 = k80 + QB / 8 < K8 ? k80 + QB / 8 : K8;
        for (int j0 = 0; j0 < 8; j0 += J) {
            __m256i acc[QMR][8];
            _Pragma("GCC unroll 16")
            for (int r = 0; r < R; r++)
                _Pragma("GCC unroll 16")
                for (int j = 0; j < J; j++) acc[r][j] = _mm256_setzero_si256();
            for (long k8 = k80; k8 < k81; k8++) {
                const uint8_t *wk = wt + k8 * (QT * 4) + 32 * j0;
                if (j0 == 0) q_prefetch_row(wt + (k8 + QB / 8) * (QT * 4));  /* the next block's */
                __m256i lo[8], hi[8];
                _Pragma("GCC unroll 16")
                for (int j = 0; j < J; j++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(wk + 32 * j));
                    lo[j] = _mm256_and_si256(v, nib);
                    hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
                }
                _Pragma("GCC unroll 16")
                for (int r = 0; r < R; r++) {
                    __m256i xl = q_bcast4_8(xq + r * KP + 8 * k8), xh = q_bcast4_8(xq + r * KP + 8 * k8 + 4);
                    _Pragma("GCC unroll 16")
                    for (int j = 0; j < J; j++) {
                        __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], xl), _mm256_maddubs_epi16(hi[j], xh));
                        acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(p, ones));
                    }
                }
            }
            _Pragma("GCC unroll 16")
            for (int j = 0; j < J; j++) {
                long c = n0 + 8 * (j0 + j);
                __m256 sc = q_load8_h16(s + g * N, c, N);
                __m256 nz = _mm256_sub_ps(_mm256_setzero_ps(), q_load8_h16(z + g * N, c, N));
                _Pragma("GCC unroll 16")
                for (int r = 0; r < R; r++) {
                    float *yp = yv[r] + 8 * (j0 + j);
                    __m256 t = _mm256_fmadd_ps(nz, _mm256_set1_ps((float)xs[r * nblk + b]), _mm256_cvtepi32_ps(acc[r][j]));
                    _mm256_storeu_ps(yp, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(sx[r * nblk + b]), sc), t, _mm256_loadu_ps(yp)));
                }
            }
        }
    }
    q_tile_out(R, yv, NULL, y, y_bf16, ldy, m0, n0, N);
}

#endif

/* tile t (columns 64 t ..) of y for all M rows, from the quantized activations */
static void qgemm_tile(const ss_qweight *w, long M, long nblk, long KP, const int8_t *xq, const float *sx,
                       const int32_t *xs, void *y, int y_bf16, long t) {
    const long K = w->in_features, N = w->out_features, K4 = (K + 3) / 4, K8 = (K + 7) / 8, n0 = t * QT;
    const long rows = w->bits == 8 ? QMR8 : QMR;  /* rows per register block */
    for (long m0 = 0; m0 < M; m0 += rows) {
        const int8_t *xr = xq + m0 * KP;
        const float *sr = sx + m0 * nblk;
        const int32_t *cr = xs + m0 * nblk;
        int R = M - m0 < rows ? (int)(M - m0) : (int)rows;
        if (w->bits == 8) {
            const uint8_t *wt = (const uint8_t *)w->q + t * K4 * QT * 4;
            const float *sc = (const float *)w->scale;
            switch (R) {
#if QMR8 >= 6
            case 6: tile_q8(6, K4, nblk, KP, xr, sr, cr, wt, sc, y, y_bf16, N, m0, n0, N); break;
            case 5: tile_q8(5, K4, nblk, KP, xr, sr, cr, wt, sc, y, y_bf16, N, m0, n0, N); break;
#endif
            case 4: tile_q8(4, K4, nblk, KP, xr, sr, cr, wt, sc, y, y_bf16, N, m0, n0, N); break;
            case 3: tile_q8(3, K4, nblk, KP, xr, sr, cr, wt, sc, y, y_bf16, N, m0, n0, N); break;
            case 2: tile_q8(2, K4, nblk, KP, xr, sr, cr, wt, sc, y, y_bf16, N, m0, n0, N); break;
            default: tile_q8(1, K4, nblk, KP, xr, sr, cr, wt, sc, y, y_bf16, N, m0, n0, N); break;
            }
        } else {
            const uint8_t *wt = (const uint8_t *)w->q + t * K8 * QT * 4;
            const uint16_t *sc = (const uint16_t *)w->scale, *zp = (const uint16_t *)w->zero;
            switch (R) {
            case 4: tile_q4(4, K8, nblk, KP, xr, sr, cr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
            case 3: tile_q4(3, K8, nblk, KP, xr, sr, cr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
            case 2: tile_q4(2, K8, nblk, KP, xr, sr, cr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
            default: tile_q4(1, K8, nblk, KP, xr, sr, cr, wt, sc, zp, y, y_bf16, N, m0, n0, N); break;
            }
        }
    }
}

static int q_team(long ntiles, int nthreads) {
    int nt = ss_threads(nthreads);
    if (ntiles < nt) nt = (int)ntiles;
    return nt < 1 ? 1 : nt;
}

static int q_check(const ss_qweight *w) {
    if (w->in_features <= 0 || (w->bits != 8 && w->bits != 4)) return 2;
    if (w->bits == 4 && (w->group != QG || !w->zero)) return 2;
    return 0;
}

typedef struct {
    const ss_qweight *w;
    long M, nblk, KP;
    const int8_t *xq;
    const float *sx;
    const int32_t *xs;
    void *y;
    int y_bf16;
    long ntiles;
} qgemm_job;

static void qgemm_region(void *ctx, int tid, int nt) {
    const qgemm_job *j = (const qgemm_job *)ctx;
    long t0, t1;
    ss_share(j->ntiles, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) qgemm_tile(j->w, j->M, j->nblk, j->KP, j->xq, j->sx, j->xs, j->y, j->y_bf16, t);
}

/* x: [M, K] (x_bf16 ? bf16 : fp32) contiguous; y: [M, N] (y_bf16 ? bf16 : fp32).
 * Returns 0 on success, 2 for a bad descriptor (incl. an int4 group other than 64), 1 when
 * out of memory. */
int selfspec_qgemm(long M, const void *x, int x_bf16, const void *wd, void *y, int y_bf16, int nthreads) {
    const ss_qweight *w = (const ss_qweight *)wd;
    const long K = w->in_features, N = w->out_features;
    if (M <= 0 || N <= 0) return 0;
    if (q_check(w)) return 2;
    const long nblk = (K + QB - 1) / QB, KP = nblk * QB;
    /* per row: xq [KP] int8, then sx [nblk] fp32 and xs [nblk] int32 (separate arrays) */
    size_t need = (size_t)M * KP + (size_t)M * nblk * 8 + 64;
    _Alignas(64) char stackbuf[16384];
    char *buf = need <= sizeof(stackbuf) ? stackbuf : (char *)malloc(need);
    if (!buf) return 1;
    float *sx = (float *)buf;
    int32_t *xs = (int32_t *)(buf + (size_t)M * nblk * 4);
    int8_t *xq = (int8_t *)(buf + (size_t)M * nblk * 8);
    for (long m = 0; m < M; m++) q_act_row_v(x, x_bf16, m, K, xq + m * KP, sx + m * nblk, xs + m * nblk);
    qgemm_job job = {w, M, nblk, KP, xq, sx, xs, y, y_bf16, (N + QT - 1) / QT};
    ss_parallel(q_team(job.ntiles, nthreads), qgemm_region, &job);
    if (buf != stackbuf) free(buf);
    return 0;
}

/* Scalar reference of the same chains (fp32 x and y), for the tests: the weights are read
 * one byte at a time from the layouts, the dot products summed in plain int arithmetic. */
int selfspec_quant_block(void) { return QB; }  /* the activation block, for the tests */

int selfspec_qgemm_ref(long M, const float *x, const ss_qweight *w, float *y) {
    const long K = w->in_features, N = w->out_features;
    if (q_check(w)) return 2;
    const long nblk = (K + QB - 1) / QB, K4 = (K + 3) / 4, K8 = (K + 7) / 8;
    int8_t *xq = (int8_t *)malloc((size_t)nblk * QB);
    float *sx = (float *)malloc(sizeof(float) * nblk);
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * nblk);
    if (!xq || !sx || !xs) { free(xq); free(sx); free(xs); return 1; }
    for (long m = 0; m < M; m++) {
        q_act_row(x, 0, m, K, xq, sx, xs);
        for (long n = 0; n < N; n++) {
            long t = n / QT, c = n % QT;
            float out = 0.0f;
            for (long b = 0; b < nblk; b++) {
                int32_t acc = 0, xsum = 0;
                for (long k = b * QB; k < K && k < (b + 1) * QB; k++) {
                    int u;
                    if (w->bits == 8) u = ((const uint8_t *)w->q)[((t * K4 + k / 4) * QT + c) * 4 + k % 4] - 128;
                    else {
                        uint8_t byte = ((const uint8_t *)w->q)[((t * K8 + k / 8) * QT + c) * 4 + k % 4];
                        u = k % 8 < 4 ? (byte & 0xF) : (byte >> 4);
                    }
                    acc += u * xq[k];
                    xsum += xq[k];
                }
                if (xsum != xs[b]) { free(xq); free(sx); free(xs); return 3; }  /* cannot happen */
                if (w->bits == 8) out = fmaf(sx[b], (float)acc, out);
                else {
                    long g = b / (QG / QB);
                    float sc = _cvtsh_ss(((const uint16_t *)w->scale)[g * N + n]), zp = _cvtsh_ss(((const uint16_t *)w->zero)[g * N + n]);
                    out = fmaf(sx[b] * sc, fmaf(-zp, (float)xsum, (float)acc), out);
                }
            }
            y[m * N + n] = w->bits == 8 ? out * ((const float *)w->scale)[n] : out;
        }
    }
    free(xq); free(sx); free(xs);
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
typedef struct {
    const float *w;
    long K, N, group, G, nblocks;
    const float *s, *z;
    int ncand;
    float lo, hi;
    float *err;
} qerr_job;

static void qerr_region(void *ctx, int tid, int nt) {
    const qerr_job *j = (const qerr_job *)ctx;
    const long K = j->K, N = j->N, G = j->G;
    const vf16 vlo = vf_set1(j->lo), vhi = vf_set1(j->hi);
    long b0, b1;
    ss_share(j->nblocks, tid, nt, &b0, &b1);
    for (long b = b0; b < b1; b++) {
        long n0 = b * 16;
        m16 m = qlanes(N - n0);
        for (long g = 0; g < G; g++) {
            long k0 = g * j->group, k1 = k0 + j->group < K ? k0 + j->group : K;
            for (int c = 0; c < j->ncand; c++) {
                long off = ((long)c * G + g) * N + n0;
                vf16 sv = vf_mask_loadu(vf_set1(1.0f), m, j->s + off);
                vf16 zv = j->z ? vf_maskz_loadu(m, j->z + off) : vf_zero();
                vf16 acc = vf_zero();
                for (long k = k0; k < k1; k++) {
                    vf16 x = vf_maskz_loadu(m, j->w + k * N + n0);
                    vf16 u = vf_round(vf_add(vf_div(x, sv), zv));  /* half to even */
                    u = vf_min(vf_max(u, vlo), vhi);
                    vf16 d = vf_sub(vf_mul(vf_sub(u, zv), sv), x);
                    acc = vf_fmadd(d, d, acc);
                }
                vf_mask_storeu(j->err + off, m, acc);
            }
        }
    }
}

int selfspec_quant_errors(const float *w, long K, long N, long group, const float *s, const float *z, int ncand,
                          float lo, float hi, float *err, int nthreads) {
    if (K <= 0 || N <= 0 || group <= 0 || ncand <= 0) return -1;
    qerr_job job = {w, K, N, group, (K + group - 1) / group, (N + 15) / 16, s, z, ncand, lo, hi, err};
    ss_parallel(nthreads > 0 ? nthreads : 1, qerr_region, &job);
    return 0;
}
