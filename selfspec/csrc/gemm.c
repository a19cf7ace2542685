/* Row-invariant, thread-count-invariant small-M GEMM for CPU decode.
 *
 *   y[m, n] = sum_{k=0}^{K-1} x[m, k] * w[k, n]
 *
 * Summation order (fixed, documented, identical for every M and thread count):
 *   acc = +0.0f; for k = 0, 1, ..., K-1: acc = fmaf(xf[m,k], wf[k,n], acc)
 * where xf / wf are the fp32 values of x / w (bf16 -> fp32 is exact). Each output
 * element is one independent fp32 FMA chain in increasing k; the vector code only
 * evaluates 16 such chains side by side (one per lane), so the tile width, the
 * number of rows M, the row chunking and the thread split (over N only, never K)
 * cannot change any bit. The scalar fmaf tail computes the very same chain.
 * Output: fp32, or bf16 rounded to nearest even from the fp32 accumulator (NaN -> 0x7FC0),
 * exactly like c10::BFloat16(float).
 *
 * Weight layouts (the kernel only needs a base pointer and a row stride):
 *   plain  : w[K, N] row-major (ldw = N); tile t starts at w + 64 t
 *   packed : wp[NB][K][64] with NB = ceil(N / 64), zero padded; tile t starts at
 *            wp + t*K*64 with row stride 64, so each tile is one contiguous stream.
 *
 * Paths: M <= MR (6): rows kept in registers, weights widened on the fly (direct);
 * M > MR: K chunks copied (bf16: widened) once into an L1 fp32 scratch and shared by all
 * row blocks (tile_many). Both give the same bits (tested); threads split tiles.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include "pool.h"
#include "simd.h"  /* lanes16, ss_tilecfg */

#define NT 64  /* columns per tile: 4 zmm of 16 fp32 */
#ifndef PF
#define PF 16  /* prefetch distance in k rows */
#endif
#ifndef PFP
#define PFP 16  /* prefetch distance in pair rows (pair path) */
#endif
#ifndef PFP_L2
#define PFP_L2 128  /* pair rows (32 KB) ahead into L2, from PFP_L2_ROWS rows (see tile_pairs) */
#endif
#ifndef PFP_L2_ROWS
#define PFP_L2_ROWS 3
#endif
#ifndef PAIRS_MANY_MIN
#define PAIRS_MANY_MIN 13  /* pair path: rows from which the widened-scratch path may pay */
#endif
#ifndef DIRECT_ONLY
#define DIRECT_ONLY 0  /* 1: never use the many-row path (same bits, for testing/benchmarks) */
#endif
#ifndef MR
#define MR 6   /* rows per register block (6 x 4 accumulators + 4 weights <= 32 zmm) */
#endif

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
/* ---- AVX-512: 16 lanes, 32 registers ---------------------------------------------- */

static inline __m512 load_w_bf16(const uint16_t *p, __mmask16 mk) {
    __m256i h = _mm256_maskz_loadu_epi16(mk, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* acc[j] += xb * w_j for the four 16-column slices of a tile row */
static inline __attribute__((always_inline)) void fma_row(__m512 acc[4], __m512 xb, __m512 w0, __m512 w1, __m512 w2, __m512 w3) {
    acc[0] = _mm512_fmadd_ps(xb, w0, acc[0]);
    acc[1] = _mm512_fmadd_ps(xb, w1, acc[1]);
    acc[2] = _mm512_fmadd_ps(xb, w2, acc[2]);
    acc[3] = _mm512_fmadd_ps(xb, w3, acc[3]);
}

static inline void store_out(void *y, int y_bf16, long off, __m512 v, __mmask16 mk) {
    if (!y_bf16) { _mm512_mask_storeu_ps((float *)y + off, mk, v); return; }
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16((uint16_t *)y + off, mk, _mm512_cvtepi32_epi16(r));
}

/* bf16 weights: 64 columns per k as four 256-bit loads of 16 bf16, widened to fp32
 * exactly (zero-extend to 32 bits, shift left 16). Accumulators acc[r][j] hold columns
 * n0+16j .. n0+16j+15 of row m0+r. (An even/odd-lane trick that skips the widening was
 * measured slower here for M >= 4.) */
static inline __attribute__((always_inline)) void tile_bf16(
    const int R, long K, const float *xr, const uint16_t *wt, long ldw,
    void *y, int y_bf16, long ldy, long m0, long n0, const __mmask16 mk[4]) {
    __m512 acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long k = 0; k < K; k++) {
        const uint16_t *wk = wt + k * ldw;
        /* software prefetch PF rows ahead (a hint only: never faults, no effect on results) */
        _mm_prefetch((const char *)(wk + PF * ldw), _MM_HINT_T0);
        _mm_prefetch((const char *)(wk + PF * ldw) + 64, _MM_HINT_T0);
        __m512 w0 = load_w_bf16(wk, mk[0]), w1 = load_w_bf16(wk + 16, mk[1]);
        __m512 w2 = load_w_bf16(wk + 32, mk[2]), w3 = load_w_bf16(wk + 48, mk[3]);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xr[r * K + k]);
            fma_row(acc[r], xb, w0, w1, w2, w3);
        }
    }
    for (int r = 0; r < R; r++) {
        long off = (m0 + r) * ldy + n0;
        for (int j = 0; j < 4; j++) store_out(y, y_bf16, off + 16 * j, acc[r][j], mk[j]);
    }
}

/* fp32 weights: 64 columns as four masked 512-bit loads, no conversion. */
static inline __attribute__((always_inline)) void tile_f32(
    const int R, long K, const float *xr, const float *wt, long ldw,
    void *y, int y_bf16, long ldy, long m0, long n0, const __mmask16 mk[4]) {
    __m512 acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long k = 0; k < K; k++) {
        const float *wk = wt + k * ldw;
        for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(wk + PF * ldw) + 64 * c, _MM_HINT_T0);
        __m512 w0 = _mm512_maskz_loadu_ps(mk[0], wk), w1 = _mm512_maskz_loadu_ps(mk[1], wk + 16);
        __m512 w2 = _mm512_maskz_loadu_ps(mk[2], wk + 32), w3 = _mm512_maskz_loadu_ps(mk[3], wk + 48);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xr[r * K + k]);
            fma_row(acc[r], xb, w0, w1, w2, w3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) store_out(y, y_bf16, (m0 + r) * ldy + n0 + 16 * j, acc[r][j], mk[j]);
}

/* Many-row path (M > MR): per tile, K is walked in chunks of KC rows; each chunk of the
 * tile is copied once into an fp32 scratch (KC x 64, L1 resident; bf16 widened exactly) and
 * then every row block runs its FMAs from that scratch. Accumulators are parked in memory
 * (exact fp32 stores/loads) between chunks, so each element is still the single chain
 * acc = fma(x[k], w[k], acc) for k = 0..K-1 in order: identical bits to the direct path. */
#define KC 128
static inline __attribute__((always_inline)) void chunk_rows(
    const int R, long K, long k0, long kn, const float *xr, const float *ws, float *accbuf, int first) {
    __m512 acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(accbuf + r * NT + 16 * j);
    for (long k = 0; k < kn; k++) {
        const float *wk = ws + k * NT;
        __m512 w0 = _mm512_load_ps(wk), w1 = _mm512_load_ps(wk + 16);
        __m512 w2 = _mm512_load_ps(wk + 32), w3 = _mm512_load_ps(wk + 48);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xr[r * K + k0 + k]);
            fma_row(acc[r], xb, w0, w1, w2, w3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(accbuf + r * NT + 16 * j, acc[r][j]);
}

static void tile_many(long M, long K, const float *xf, const void *wt, int w_bf16, long ldw,
                      void *y, int y_bf16, long ldy, long n0, const __mmask16 mk[4], float *accbuf) {
    float ws[KC * NT] __attribute__((aligned(64)));
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kn = K - k0 < KC ? K - k0 : KC;
        if (w_bf16)
            for (long k = 0; k < kn; k++) {
                const uint16_t *wk = (const uint16_t *)wt + (k0 + k) * ldw;
                _mm_prefetch((const char *)(wk + PF * ldw), _MM_HINT_T0);
                _mm_prefetch((const char *)(wk + PF * ldw) + 64, _MM_HINT_T0);
                /* and two chunks ahead into L2, so the next chunk streams while this one computes
                 * (Zen 4, packed bf16 from memory: 8 / 16 rows 1.18 / 1.12x) */
                _mm_prefetch((const char *)(wk + 2 * KC * ldw), _MM_HINT_T1);
                _mm_prefetch((const char *)(wk + 2 * KC * ldw) + 64, _MM_HINT_T1);
                for (int j = 0; j < 4; j++) _mm512_store_ps(ws + k * NT + 16 * j, load_w_bf16(wk + 16 * j, mk[j]));
            }
        else
            for (long k = 0; k < kn; k++) {
                const float *wk = (const float *)wt + (k0 + k) * ldw;
                for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(wk + PF * ldw) + 64 * c, _MM_HINT_T0);
                for (int j = 0; j < 4; j++) _mm512_store_ps(ws + k * NT + 16 * j, _mm512_maskz_loadu_ps(mk[j], wk + 16 * j));
            }
        for (long m0 = 0; m0 < M; m0 += MR) {
            const float *xr = xf + m0 * K;
            float *ab = accbuf + m0 * NT;
            switch (M - m0 < MR ? M - m0 : MR) {
            case 6: chunk_rows(6, K, k0, kn, xr, ws, ab, k0 == 0); break;
            case 5: chunk_rows(5, K, k0, kn, xr, ws, ab, k0 == 0); break;
            case 4: chunk_rows(4, K, k0, kn, xr, ws, ab, k0 == 0); break;
            case 3: chunk_rows(3, K, k0, kn, xr, ws, ab, k0 == 0); break;
            case 2: chunk_rows(2, K, k0, kn, xr, ws, ab, k0 == 0); break;
            default: chunk_rows(1, K, k0, kn, xr, ws, ab, k0 == 0); break;
            }
        }
    }
    for (long m = 0; m < M; m++)
        for (int j = 0; j < 4; j++)
            store_out(y, y_bf16, m * ldy + n0 + 16 * j, _mm512_loadu_ps(accbuf + m * NT + 16 * j), mk[j]);
}

#ifdef __AVX512BF16__
/* Pair layout (packed == 2, bf16 only): wp[NB][K2][64][2], K2 = ceil(K / 2): for tile t,
 * pair-row k2 and column c, (w[2 k2, 64 t + c], w[2 k2 + 1, 64 t + c]) are adjacent, so one
 * VDPBF16PS per 16 columns consumes two k. x is rounded to bf16 and paired the same way.
 * Chain per output (Intel's definition of VDPBF16PS, products of bf16 exact in fp32,
 * denormals treated as zero and flushed, round to nearest even):
 *   acc = +0; for k2 = 0..K2-1: acc += x[2k2+1] w[2k2+1]; acc += x[2k2] w[2k2]
 * Still one fixed chain per element: row- and thread-invariant like the FMA path, with
 * half the instructions and no widening, which is what matters once M > 1 (verification)
 * makes the FMA path compute-bound. */
static inline __attribute__((always_inline)) void tile_pairs(
    const int R, long K2, const uint32_t *xr, const uint16_t *wt,
    void *y, int y_bf16, long ldy, long m0, long n0, const __mmask16 mk[4]) {
    __m512 acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (long k = 0; k < K2; k++) {
        const uint16_t *wk = wt + k * 2 * NT;
        for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(wk + PFP * 2 * NT) + 64 * c, _MM_HINT_T0);
        /* with several rows the loop no longer keeps pace with memory by itself: a far hint into
         * L2 (Zen 4, 16 rows streamed from memory: 1.2x faster; one row is left as it was) */
        if (R >= PFP_L2_ROWS || (R == 2 && m0 == 0))  /* two rows alone: as in quant.c's tile_q8 */
            for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(wk + PFP_L2 * 2 * NT) + 64 * c, _MM_HINT_T1);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wk), w1 = (__m512bh)_mm512_loadu_si512(wk + 32);
        __m512bh w2 = (__m512bh)_mm512_loadu_si512(wk + 64), w3 = (__m512bh)_mm512_loadu_si512(wk + 96);
        for (int r = 0; r < R; r++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[r * K2 + k]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xb);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xb);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) store_out(y, y_bf16, (m0 + r) * ldy + n0 + 16 * j, acc[r][j], mk[j]);
}
#endif

/* Many-row pair path (M > MR): VDPBF16PS issues at about half the FMA rate here, so once M
 * amortises the widening, the same chain is cheaper as two FMAs per pair from an L1 fp32
 * scratch (odd term first, then even, as VDPBF16PS), with MXCSR DAZ|FTZ set so denormals are
 * handled as the instruction handles them. Same bits as tile_pairs (tested). */
#define KC2 64
static inline __attribute__((always_inline)) void pair_rows(
    const int R, long K2, long k0, long kn, long m0, const float *xe, const float *xo, const float *ws, float *accbuf) {
    float *ab = accbuf + m0 * NT;
    __m512 acc[MR][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
            acc[r][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(ab + r * NT + 16 * j);
    for (long k = 0; k < kn; k++) {
        const float *we = ws + k * 2 * NT, *wo = we + NT;
        long xi = m0 * K2 + k0 + k;
        /* odd terms for every row, then even terms: 24 accumulators + 4 weights fit the
         * 32 vector registers; each element's chain order is unchanged */
        __m512 w0 = _mm512_load_ps(wo), w1 = _mm512_load_ps(wo + 16), w2 = _mm512_load_ps(wo + 32), w3 = _mm512_load_ps(wo + 48);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xo[xi + r * K2]);
            fma_row(acc[r], xb, w0, w1, w2, w3);
        }
        w0 = _mm512_load_ps(we); w1 = _mm512_load_ps(we + 16); w2 = _mm512_load_ps(we + 32); w3 = _mm512_load_ps(we + 48);
        for (int r = 0; r < R; r++) {
            __m512 xb = _mm512_set1_ps(xe[xi + r * K2]);
            fma_row(acc[r], xb, w0, w1, w2, w3);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(ab + r * NT + 16 * j, acc[r][j]);
}

static void tile_pairs_many(long M, long K2, const float *xe, const float *xo, const uint16_t *wt,
                            void *y, int y_bf16, long ldy, long n0, const __mmask16 mk[4], float *accbuf) {
    float ws[KC2 * 2 * NT] __attribute__((aligned(64)));  /* per pair row: 64 even, then 64 odd */
    for (long k0 = 0; k0 < K2; k0 += KC2) {
        long kn = K2 - k0 < KC2 ? K2 - k0 : KC2;
        for (long k = 0; k < kn; k++) {
            const uint16_t *wk = wt + (k0 + k) * 2 * NT;
            _mm_prefetch((const char *)(wk + PFP * 2 * NT), _MM_HINT_T0);
            for (int j = 0; j < 4; j++) {
                __m512i pr = _mm512_loadu_si512(wk + 32 * j);  /* 16 x (even, odd) bf16 */
                __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(pr, 16));
                __m512 od = _mm512_castsi512_ps(_mm512_and_si512(pr, _mm512_set1_epi32((int)0xFFFF0000u)));
                _mm512_store_ps(ws + k * 2 * NT + 16 * j, ev);
                _mm512_store_ps(ws + k * 2 * NT + NT + 16 * j, od);
            }
        }
        for (long m0 = 0; m0 < M; m0 += MR) {
            switch (M - m0 < MR ? M - m0 : MR) {
            case 6: pair_rows(6, K2, k0, kn, m0, xe, xo, ws, accbuf); break;
            case 5: pair_rows(5, K2, k0, kn, m0, xe, xo, ws, accbuf); break;
            case 4: pair_rows(4, K2, k0, kn, m0, xe, xo, ws, accbuf); break;
            case 3: pair_rows(3, K2, k0, kn, m0, xe, xo, ws, accbuf); break;
            case 2: pair_rows(2, K2, k0, kn, m0, xe, xo, ws, accbuf); break;
            default: pair_rows(1, K2, k0, kn, m0, xe, xo, ws, accbuf); break;
            }
        }
    }
    for (long m = 0; m < M; m++)
        for (int j = 0; j < 4; j++)
            store_out(y, y_bf16, m * ldy + n0 + 16 * j, _mm512_loadu_ps(accbuf + m * NT + 16 * j), mk[j]);
}

static void tile_masks(long n0, long N, __mmask16 mk[4]) {
    for (int j = 0; j < 4; j++) {
        long left = N - (n0 + 16 * j);
        mk[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    }
}

/* tile t (columns 64 t ..) of y for all M rows; accbuf: the thread's many-row scratch, made
 * on first use (NULL: the direct path) */
static void gemm_tile(long M, long K, long N, const float *xf, const void *w, int w_bf16, int packed,
                      void *y, int y_bf16, long t, float **accbuf) {
    long n0 = t * NT;
    __mmask16 mk[4];
    tile_masks(n0, N, mk);
    long ldw = packed ? NT : N;
    long woff = packed ? t * K * NT : n0;
    if (M > MR && !DIRECT_ONLY) {
        if (!*accbuf) *accbuf = (float *)aligned_alloc(64, sizeof(float) * NT * ((M + 15) / 16 * 16));
        if (*accbuf) {
            const void *wt = w_bf16 ? (const void *)((const uint16_t *)w + woff) : (const void *)((const float *)w + woff);
            tile_many(M, K, xf, wt, w_bf16, ldw, y, y_bf16, N, n0, mk, *accbuf);
            return;
        }
    }
    for (long m0 = 0; m0 < M; m0 += MR) {
        const float *xr = xf + m0 * K;
        if (w_bf16) {
            const uint16_t *wt = (const uint16_t *)w + woff;
            switch (M - m0 < MR ? M - m0 : MR) {
            case 6: tile_bf16(6, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 5: tile_bf16(5, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 4: tile_bf16(4, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 3: tile_bf16(3, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 2: tile_bf16(2, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            default: tile_bf16(1, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            }
        } else {
            const float *wt = (const float *)w + woff;
            switch (M - m0 < MR ? M - m0 : MR) {
            case 6: tile_f32(6, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 5: tile_f32(5, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 4: tile_f32(4, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 3: tile_f32(3, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            case 2: tile_f32(2, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            default: tile_f32(1, K, xr, wt, ldw, y, y_bf16, N, m0, n0, mk); break;
            }
        }
    }
}

#else
/* ---- AVX2 + FMA: 8 lanes, 16 registers ----------------------------------------------- */
/* The same chains, 8 columns per register (block_eo below). Full tiles only; a tile cut by N
 * (plain layout: reading past N could leave the array) runs the scalar chain, which is the
 * same fmaf chain. */

static inline __attribute__((always_inline)) void store8(void *y, int y_bf16, long off, __m256 v) {
    if (!y_bf16) { _mm256_storeu_ps((float *)y + off, v); return; }
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    _mm_storeu_si128((__m128i *)((uint16_t *)y + off), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* Weights into fp32 lanes, 16 columns at a time: bf16 without widening (one 256-bit load holds
 * 16 bf16 columns; shifting each 32-bit lane left by 16 gives the even columns' fp32 values,
 * clearing its low half the odd columns'), fp32 as two loads. Accumulators hold the even and
 * odd columns apart (v[0]: columns 16 p + 2 i, v[1]: 16 p + 2 i + 1; fp32 the same) and are
 * interleaved back when stored: per column the chain is unchanged. */
static inline __attribute__((always_inline)) void w16(const int wbf, const int lean, const void *wk, __m256 v[2]) {
    if (wbf) {
        __m256i u = _mm256_loadu_si256((const __m256i *)wk), e = _mm256_slli_epi32(u, 16);
        v[0] = _mm256_castsi256_ps(e);
        /* lean (6-row blocks: 12 accumulators + 2 weights + 1 broadcast leave no register for a
         * mask): the low half cleared as u ^ (e >> 16), the same bits as u & 0xFFFF0000 */
        v[1] = _mm256_castsi256_ps(lean ? _mm256_xor_si256(u, _mm256_srli_epi32(e, 16))
                                        : _mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else {  /* fp32: the same even/odd split, so both kinds share the store */
        __m256 a = _mm256_loadu_ps((const float *)wk), b = _mm256_loadu_ps((const float *)wk + 8);
        __m256 e = _mm256_shuffle_ps(a, b, 0x88), o = _mm256_shuffle_ps(a, b, 0xDD);  /* per 128-bit half */
        v[0] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
        v[1] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8));
    }
}
/* even/odd accumulators of 16 columns -> 16 consecutive outputs */
static inline __attribute__((always_inline)) void store_eo(void *y, int y_bf16, long off, __m256 ev, __m256 od) {
    __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);  /* per 128-bit half */
    store8(y, y_bf16, off, _mm256_permute2f128_ps(lo, hi, 0x20));
    store8(y, y_bf16, off + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
}

#define KCH 32  /* k rows per chunk (block_eo) */
#ifndef PF_L2_AVX2
#define PF_L2_AVX2 128  /* k rows ahead, into L2 (pass_eo) */
#endif

/* R rows x the 16-column groups p0..p0+P-1 of a tile, over k = k0..k1-1; acc parked in ab
 * ([R][64] floats, even/odd order) unless the pass covers all of K (ab NULL) */
static inline __attribute__((always_inline)) void pass_eo(
    const int R, const int P, const int wbf, long K, long k0, long k1, const float *xr, const void *wt, long ldw,
    float *ab, void *y, int y_bf16, long ldy, long m0, long n0, int p0) {
    const int esz = wbf ? 2 : 4;
    /* every loop over r, j, p unrolled, or GCC keeps acc[][] in memory too (12 stores per k) */
    __m256 acc[MR][8];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 16")
        for (int j = 0; j < 2 * P; j++)
            acc[r][j] = (ab && k0 > 0) ? _mm256_loadu_ps(ab + r * NT + 16 * p0 + 8 * j) : _mm256_setzero_ps();
    for (long k = k0; k < k1; k++) {
        __m256 wv[8];
        if (ab && p0 == 0) {  /* a chunk's first pass fetches the next chunk's lines (a hint: with
                               * several rows computing takes as long as streaming, and the two
                               * overlap only this way; the LM head at 4-8 rows: 10-15% faster),
                               * and PF_L2_AVX2 k-rows ahead into L2 (Zen 4 running this code,
                               * bf16 matrices from memory: 2 / 4 / 6 / 8 / 16 rows 1.6 / 1.85 /
                               * 1.5 / 1.36 / 1.12x faster) */
            const char *pf = (const char *)wt + ((k + KCH) * ldw) * esz;
            _mm_prefetch(pf, _MM_HINT_T0);
            _mm_prefetch(pf + 64, _MM_HINT_T0);
            const char *pf2 = (const char *)wt + ((k + PF_L2_AVX2) * ldw) * esz;
            _mm_prefetch(pf2, _MM_HINT_T1);
            _mm_prefetch(pf2 + 64, _MM_HINT_T1);
        }
        _Pragma("GCC unroll 16")
        for (int p = 0; p < P; p++) w16(wbf, R >= 5, (const char *)wt + (k * ldw + 16 * (p0 + p)) * esz, wv + 2 * p);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            __m256 xb = _mm256_broadcast_ss(xr + r * K + k);
            _Pragma("GCC unroll 16")
            for (int j = 0; j < 2 * P; j++) acc[r][j] = _mm256_fmadd_ps(xb, wv[j], acc[r][j]);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 16")
        for (int p = 0; p < P; p++) {
            if (ab && k1 < K) {
                _mm256_storeu_ps(ab + r * NT + 16 * (p0 + p), acc[r][2 * p]);
                _mm256_storeu_ps(ab + r * NT + 16 * (p0 + p) + 8, acc[r][2 * p + 1]);
            } else {
                store_eo(y, y_bf16, (m0 + r) * ldy + n0 + 16 * (p0 + p), acc[r][2 * p], acc[r][2 * p + 1]);
            }
        }
}

/* One row (decode): the whole 64-column tile in one pass over K, 8 accumulators. More rows:
 * 2 * P R <= 12 accumulators cover 32 (R = 2) or 16 (R = 3..6) columns, so K goes in chunks of
 * KCH rows (the tile's lines for them, 8 KB at most, stay in L1) and each chunk runs the column
 * passes one after another, parking the accumulators in between (exact fp32 stores and
 * loads): memory streams each tile once and in order (column passes over all of K had the LM
 * head at 2 rows cost 1.6x 1 row; a widened fp32 scratch, 1.7x). */
#ifndef MR8
#define MR8 6  /* rows per block: 12 accumulators keep both FMA pipes busy (8: ~60% of peak, 12: ~75%) */
#endif
static inline __attribute__((always_inline)) void block_eo(
    const int R, const int wbf, long K, const float *xr, const void *wt, long ldw,
    void *y, int y_bf16, long ldy, long m0, long n0) {
    if (R == 1) { pass_eo(1, 4, wbf, K, 0, K, xr, wt, ldw, NULL, y, y_bf16, ldy, m0, n0, 0); return; }
    const int P = R == 2 ? 2 : 1;
    float ab[MR * NT];
    for (long k0 = 0; k0 < K; k0 += KCH) {
        long k1 = K - k0 < KCH ? K : k0 + KCH;
        for (int p0 = 0; p0 < 4; p0 += P) pass_eo(R, P, wbf, K, k0, k1, xr, wt, ldw, ab, y, y_bf16, ldy, m0, n0, p0);
    }
}

#define BLOCK_CASES(wbf)                                                            \
    switch (M - m0 < MR8 ? M - m0 : MR8) {                                          \
    case 6: block_eo(6, wbf, K, xr, wt, ldw, y, y_bf16, N, m0, n0); break;          \
    case 5: block_eo(5, wbf, K, xr, wt, ldw, y, y_bf16, N, m0, n0); break;          \
    case 4: block_eo(4, wbf, K, xr, wt, ldw, y, y_bf16, N, m0, n0); break;          \
    case 3: block_eo(3, wbf, K, xr, wt, ldw, y, y_bf16, N, m0, n0); break;          \
    case 2: block_eo(2, wbf, K, xr, wt, ldw, y, y_bf16, N, m0, n0); break;          \
    default: block_eo(1, wbf, K, xr, wt, ldw, y, y_bf16, N, m0, n0); break;         \
    }

static void gemm_tile(long M, long K, long N, const float *xf, const void *w, int w_bf16, int packed,
                      void *y, int y_bf16, long t, float **accbuf) {
    (void)accbuf;
    long n0 = t * NT, ldw = packed ? NT : N, woff = packed ? t * K * NT : n0;
    const void *wt = w_bf16 ? (const void *)((const uint16_t *)w + woff) : (const void *)((const float *)w + woff);
    if (n0 + NT > N) {  /* the last, partial tile: the scalar chain (fmaf is the same FMA) */
        for (long m = 0; m < M; m++)
            for (long c = 0; n0 + c < N; c++) {
                float acc = 0.0f;
                for (long k = 0; k < K; k++)
                    acc = fmaf(xf[m * K + k], w_bf16 ? bf16_to_f32(((const uint16_t *)wt)[k * ldw + c])
                                                     : ((const float *)wt)[k * ldw + c], acc);
                if (y_bf16) ((uint16_t *)y)[m * N + n0 + c] = f32_to_bf16(acc);
                else ((float *)y)[m * N + n0 + c] = acc;
            }
        return;
    }
    /* DIRECT_ONLY (one row at a time) exists for the tests: the same bits */
    for (long m0 = 0; m0 < M; m0 += DIRECT_ONLY ? 1 : MR8) {
        const float *xr = xf + m0 * K;
        if (DIRECT_ONLY) { w_bf16 ? block_eo(1, 1, K, xr, wt, ldw, y, y_bf16, N, m0, n0) : block_eo(1, 0, K, xr, wt, ldw, y, y_bf16, N, m0, n0); continue; }
        if (w_bf16) { BLOCK_CASES(1) } else { BLOCK_CASES(0) }
    }
}
#undef BLOCK_CASES
#endif

/* Pair path: the row count from which tile_pairs_many runs instead of tile_pairs. Which one
 * is faster depends on the CPU (on AMD Zen 4 VDPBF16PS issues as fast as an FMA, so the
 * direct path is ~2x faster at every M; where it issues at half the FMA rate the scratch
 * path pays from ~13 rows), so the loader times both once and sets it (kernels/build.py).
 * Both give the same bits, so this changes speed only. */
static long pairs_many_min = PAIRS_MANY_MIN;
void selfspec_set_pairs_many_min(long m) { pairs_many_min = m < 1 ? 1 : m; }
long selfspec_pairs_many_min(void) { return pairs_many_min; }

/* 1 if this build has the pair (VDPBF16PS) path. */
int selfspec_has_pairs(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

/* threads for ntiles tiles: nthreads (<= 0: the CPUs), at most one per tile */
static int team_size(long ntiles, int nthreads) {
    int nt = ss_threads(nthreads);
    if (ntiles < nt) nt = (int)ntiles;
    return nt < 1 ? 1 : nt;
}

#ifdef __AVX512BF16__
typedef struct {
    long M, N, K2;
    const uint32_t *xp;
    const float *xe, *xo;  /* the widened-scratch path's fp32 copies, or NULL (direct tiles) */
    const uint16_t *w;
    void *y;
    int y_bf16;
    long ntiles;
    int failed;
} pairs_job;

static void pairs_region(void *ctx, int tid, int nt) {
    pairs_job *j = (pairs_job *)ctx;
    const long M = j->M, N = j->N, K2 = j->K2;
    float *accbuf = NULL;
    unsigned int csr = _mm_getcsr();
    if (j->xe) {
        _mm_setcsr(csr | 0x8040u);  /* FTZ | DAZ, as VDPBF16PS */
        accbuf = (float *)aligned_alloc(64, sizeof(float) * NT * ((M + 15) / 16 * 16));
        if (!accbuf) __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
    }
    long t0, t1;
    ss_share(j->ntiles, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        long n0 = t * NT;
        __mmask16 mk[4];
        tile_masks(n0, N, mk);
        const uint16_t *wt = j->w + t * K2 * 2 * NT;
        if (j->xe) {
            if (accbuf) tile_pairs_many(M, K2, j->xe, j->xo, wt, j->y, j->y_bf16, N, n0, mk, accbuf);
            continue;
        }
        for (long m0 = 0; m0 < M; m0 += MR) {
            const uint32_t *xr = j->xp + m0 * K2;
            switch (M - m0 < MR ? M - m0 : MR) {
            case 6: tile_pairs(6, K2, xr, wt, j->y, j->y_bf16, N, m0, n0, mk); break;
            case 5: tile_pairs(5, K2, xr, wt, j->y, j->y_bf16, N, m0, n0, mk); break;
            case 4: tile_pairs(4, K2, xr, wt, j->y, j->y_bf16, N, m0, n0, mk); break;
            case 3: tile_pairs(3, K2, xr, wt, j->y, j->y_bf16, N, m0, n0, mk); break;
            case 2: tile_pairs(2, K2, xr, wt, j->y, j->y_bf16, N, m0, n0, mk); break;
            default: tile_pairs(1, K2, xr, wt, j->y, j->y_bf16, N, m0, n0, mk); break;
            }
        }
    }
    if (j->xe) _mm_setcsr(csr);
    free(accbuf);
}
#endif


#if defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
/* AMX path (layout 4: pair-layout weights packed for it; the runtime packs its bf16 layer
 * matrices so where the CPU has AMX-BF16, kernels.amx()). Same bytes and the same bf16 x pairs
 * as the VDPBF16PS path, but each output is the chain of TDPBF16PS instructions:
 *   acc = +0; for c = 0, 16, 32, ..: acc = TDPBF16PS(acc, x pairs c..c+15, w pairs c..c+15)
 * with K2 zero-padded to a multiple of 16 (zero pairs add exact zeros). How one instruction
 * sums its 32 products is the hardware's (it matches no sequential fp32 chain: measured), so
 * this is a chain of its own; it belongs to the weight, so every matmul with that weight, any
 * row count, runs it: a C tile's row depends on its A row only, chunks run in increasing k
 * whatever M, threads split N only (tests/test_amx.py checks these bits). The gain: one
 * instruction does 16 rows x 16 columns x 32 k, so verification and prefill stop being
 * compute-bound (gemma-3-270m layers, Intel Xeon: 7 rows 1.36x, 16 rows 2.1x, 64 rows 3.1x
 * faster, 1 row 0.95-0.98x). The LM head stays on VDPBF16PS: one row streams its 0.3 GB
 * slower through tile loads (0.83x), and sampling decodes with one row. */
#include <unistd.h>
#include <sys/syscall.h>
#ifndef AMX_PF
#define AMX_PF 32  /* pair rows (two chunks) ahead into L1: one row 0.79 -> 0.89x of VDPBF16PS's time */
#endif
/* 1 when this process may use the tile state (asked of Linux once; harmless to repeat) */
int selfspec_amx_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}
/* tiles 0-3: the four 16-column accumulators (mrows x 16 fp32), 4: x (mrows x 16 pairs),
 * 5-6: weights (16 pair rows x 16 columns, alternating so a load can follow the other's use) */
static void amx_config(int mrows) {
    ss_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) { c.rows[t] = (uint8_t)mrows; c.colsb[t] = 64; }
    for (int t = 5; t < 7; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    ss_tile_loadconfig(&c);
}
typedef struct {
    long M, N, K2, K2p, mrows;
    const uint32_t *xa;  /* [Mp][K2p] x pairs, zero padded to whole tiles */
    const uint16_t *w;
    void *y;
    int y_bf16;
    long ntiles;
} amx_job;

static void amx_region(void *ctx, int tid, int nt) {
    amx_job *j = (amx_job *)ctx;
    const long M = j->M, N = j->N, K2 = j->K2, K2p = j->K2p;
    amx_config((int)j->mrows);  /* tile state is per thread: configured here, released below */
    float cbuf[16 * NT] __attribute__((aligned(64)));
    uint16_t btail[16 * 2 * NT] __attribute__((aligned(64)));  /* a last chunk short of 16 pair rows */
    long t0, t1;
    ss_share(j->ntiles, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        long n0 = t * NT;
        __mmask16 mk[4];
        tile_masks(n0, N, mk);
        const uint16_t *wt = j->w + t * K2 * 2 * NT;
        for (long m0 = 0; m0 < M; m0 += 16) {  /* later row blocks find the tile in L2 */
            const uint32_t *xr = j->xa + m0 * K2p;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (long k0 = 0; k0 < K2p; k0 += 16) {
                const uint16_t *wk = wt + k0 * 2 * NT;
                if (k0 + 16 > K2) {
                    memset(btail, 0, sizeof btail);
                    memcpy(btail, wk, (size_t)(K2 - k0) * 2 * NT * 2);
                    wk = btail;
                } else if (m0 == 0) {  /* AMX_PF pair rows ahead; at a tile's end the next tile's start (hints never fault) */
                    for (int c = 0; c < 64; c++) _mm_prefetch((const char *)(wk + AMX_PF * 2 * NT) + 64 * c, _MM_HINT_T0);
                }
                _tile_loadd(4, xr + k0, K2p * 4);
                _tile_loadd(5, wk, 2 * NT * 2);       /* columns 0-15 of the 64: 16 pair rows, 256 B apart */
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, wk + 32, 2 * NT * 2);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(5, wk + 64, 2 * NT * 2);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(6, wk + 96, 2 * NT * 2);
                _tile_dpbf16ps(3, 4, 6);
            }
            _tile_stored(0, cbuf, NT * 4);  /* tile numbers must be constants */
            _tile_stored(1, cbuf + 16, NT * 4);
            _tile_stored(2, cbuf + 32, NT * 4);
            _tile_stored(3, cbuf + 48, NT * 4);
            long mb = M - m0 < 16 ? M - m0 : 16;
            for (long r = 0; r < mb; r++)
                for (int q = 0; q < 4; q++)
                    store_out(j->y, j->y_bf16, (m0 + r) * N + n0 + 16 * q, _mm512_load_ps(cbuf + r * NT + 16 * q), mk[q]);
        }
    }
    _tile_release();
}

/* xa: [Mp][K2p] x pairs, zero padded to whole tiles (gemm_pairs writes them so). Up to 16 rows
 * the tiles are configured with M rows; more rows go in blocks of 16, the last one padded. */
static long amx_rows(long M) { return M <= 16 ? M : (M + 15) / 16 * 16; }
static long amx_k2(long K2) { return (K2 + 15) / 16 * 16; }
static int gemm_amx(long M, long K2, long N, const uint32_t *xa, const uint16_t *w, void *y, int y_bf16, int nthreads) {
    amx_job job = {M, N, K2, amx_k2(K2), M <= 16 ? M : 16, xa, w, y, y_bf16, (N + NT - 1) / NT};
    ss_parallel(team_size(job.ntiles, nthreads), amx_region, &job);
    return 0;
}
#define HAVE_AMX 1
#else
int selfspec_amx_init(void) { return 0; }
#endif

#ifdef __AVX512BF16__
/* x [M, K] (bf16, or fp32 rounded as f32_to_bf16 rounds) -> x pairs, row m at xp + m * ld: pair
 * k2 holds the bf16 of k = 2 k2 (low half) and 2 k2 + 1 (high half; 0 past K). In memory that is
 * just the row's bf16 values in order, so an fp32 row is 16 lanes at a time through store_out's
 * rounding (the same bits) and a bf16 row is a copy. It ran one element at a time with a branch
 * before: 5-7% of a 128-row prefill, with the second core waiting. */
static void x_pairs(long M, long K, const void *x, int x_bf16, uint32_t *xp, long ld) {
    const long K2 = (K + 1) / 2;
    for (long m = 0; m < M; m++) {
        uint16_t *out = (uint16_t *)(xp + m * ld);
        out[2 * K2 - 1] = 0;  /* odd K: the last pair's high half */
        if (x_bf16) {
            memcpy(out, (const uint16_t *)x + m * K, (size_t)K * 2);
            continue;
        }
        const float *xf = (const float *)x + m * K;
        for (long k = 0; k < K; k += 16) {
            const __mmask16 mk = lanes16(K - k);
            store_out(out, 1, k, _mm512_maskz_loadu_ps(mk, xf + k), mk);
        }
    }
}
#endif

static int gemm_pairs(long M, long K, long N, const void *x, int x_bf16, const uint16_t *w, int w_bf16,
                      void *y, int y_bf16, int nthreads, int amx) {
#ifndef __AVX512BF16__
    (void)M; (void)K; (void)N; (void)x; (void)x_bf16; (void)w; (void)w_bf16; (void)y; (void)y_bf16; (void)nthreads; (void)amx;
    return 4;
#else
    if (!w_bf16) return 5;
#ifndef HAVE_AMX
    if (amx) return 4;
#endif
    long K2 = (K + 1) / 2, ld = K2, rows = M;
#ifdef HAVE_AMX
    if (amx) { ld = amx_k2(K2); rows = amx_rows(M); }
#endif
    uint32_t stackbuf[8192];
    const size_t words = (size_t)(rows * ld);
    uint32_t *xp = words <= sizeof(stackbuf) / 4 ? stackbuf : (uint32_t *)malloc(sizeof(uint32_t) * words);
    if (!xp) return 1;
    x_pairs(M, K, x, x_bf16, xp, ld);
    if (rows > M || ld > K2) {  /* AMX's padding: zero pairs add exact zeros */
        for (long m = 0; m < M; m++) memset(xp + m * ld + K2, 0, (size_t)(ld - K2) * 4);
        memset(xp + M * ld, 0, (size_t)((rows - M) * ld) * 4);
    }
#ifdef HAVE_AMX
    if (amx) {
        int rc = gemm_amx(M, K2, N, xp, w, y, y_bf16, nthreads);
        if (xp != stackbuf) free(xp);
        return rc;
    }
#endif
    /* M >= pairs_many_min: fp32 copies of the even / odd x (DAZ applies to them inside the FMAs) */
    float *xe = NULL, *xo = NULL;
    if (M >= pairs_many_min && !DIRECT_ONLY) {
        xe = (float *)malloc(sizeof(float) * M * K2 * 2);
        if (!xe) { if (xp != stackbuf) free(xp); return 1; }
        xo = xe + M * K2;
        for (long i = 0; i < M * K2; i++) {
            xe[i] = bf16_to_f32((uint16_t)(xp[i] & 0xFFFFu));
            xo[i] = bf16_to_f32((uint16_t)(xp[i] >> 16));
        }
    }
    pairs_job job = {M, N, K2, xp, xe, xo, w, y, y_bf16, (N + NT - 1) / NT, 0};
    ss_parallel(team_size(job.ntiles, nthreads), pairs_region, &job);
    free(xe);
    if (xp != stackbuf) free(xp);
    return job.failed;
#endif
}

int selfspec_qgemm(long M, const void *x, int x_bf16, const void *w, void *y, int y_bf16, int nthreads);
int selfspec_ggemm(long M, const void *x, int x_bf16, const void *w, void *y, int y_bf16, int nthreads);

typedef struct {
    long M, K, N;
    const float *xf;
    const void *w;
    int w_bf16, packed;
    void *y;
    int y_bf16;
    long ntiles;
} gemm_job;

static void gemm_region(void *ctx, int tid, int nt) {
    const gemm_job *j = (const gemm_job *)ctx;
    float *accbuf = NULL;
    long t0, t1;
    ss_share(j->ntiles, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) gemm_tile(j->M, j->K, j->N, j->xf, j->w, j->w_bf16, j->packed, j->y, j->y_bf16, t, &accbuf);
    free(accbuf);
}

/* x: [M, K] (x_bf16 ? bf16 : fp32), contiguous.  y: [M, N] (y_bf16 ? bf16 : fp32).
 * w: plain (packed=0): [K, N] contiguous; packed (packed=1): [ceil(N/64), K, 64];
 * pairs (packed=2, bf16 only): [ceil(N/64), ceil(K/2), 64, 2] (see tile_pairs).
 * quantized (packed=3): w points to an ss_qweight descriptor (quant.c; K and N must match).
 * pairs on AMX tiles (packed=4): the pair layout, TDPBF16PS's chain (gemm_amx; 4 = unavailable).
 * GGUF blocks (packed=5): w points to an ss_gweight descriptor (ggml_gemm.c; K and N must match).
 * w_bf16: weight dtype. nthreads <= 0: OpenMP default. Returns 0 on success. */
int selfspec_gemm(long M, long K, long N, const void *x, int x_bf16, const void *w, int w_bf16,
                  int packed, void *y, int y_bf16, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) return 2; /* caller handles K == 0 (all-zero output) */
    if (packed == 2 || packed == 4) return gemm_pairs(M, K, N, x, x_bf16, (const uint16_t *)w, w_bf16, y, y_bf16, nthreads, packed == 4);
    if (packed == 3) return selfspec_qgemm(M, x, x_bf16, w, y, y_bf16, nthreads);  /* w: an ss_qweight (quant.c) */
    if (packed == 5) return selfspec_ggemm(M, x, x_bf16, w, y, y_bf16, nthreads);  /* w: an ss_gweight (ggml_gemm.c) */
    float stackbuf[16384];
    float *xf = (M * K <= (long)(sizeof(stackbuf) / 4)) ? stackbuf : (float *)malloc(sizeof(float) * M * K);
    if (!xf) return 1;
    for (long i = 0; i < M * K; i++)
        xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    gemm_job job = {M, K, N, xf, w, w_bf16, packed, y, y_bf16, (N + NT - 1) / NT};
    ss_parallel(team_size(job.ntiles, nthreads), gemm_region, &job);
    if (xf != stackbuf) free(xf);
    return 0;
}

/* Scalar reference of the same chain (fmaf, fp32 x, plain w bf16 or fp32, fp32 y): the
 * vector kernel must match it bit for bit. Used by the tests only. */
int selfspec_gemm_ref(long M, long K, long N, const float *xf, const void *w, int w_bf16, float *y) {
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float acc = 0.0f;
            for (long k = 0; k < K; k++)
                acc = fmaf(xf[m * K + k], w_bf16 ? bf16_to_f32(((const uint16_t *)w)[k * N + n]) : ((const float *)w)[k * N + n], acc);
            y[m * N + n] = acc;
        }
    return 0;
}

/* Scalar reference of the pair chain (tests only): fp32 x rounded to bf16, bf16 plain w [K, N],
 * per k2: odd term then even term, each an fmaf, with denormal inputs and results flushed to
 * zero as VDPBF16PS does. */
static inline float ftz(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f; }
int selfspec_gemm_pairs_ref(long M, long K, long N, const float *xf, const uint16_t *w, float *y) {
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) {
            float acc = 0.0f;
            for (long k = 0; k < K; k += 2) {
                float x0 = ftz(bf16_to_f32(f32_to_bf16(xf[m * K + k]))), w0 = ftz(bf16_to_f32(w[k * N + n]));
                float x1 = 0.0f, w1 = 0.0f;
                if (k + 1 < K) { x1 = ftz(bf16_to_f32(f32_to_bf16(xf[m * K + k + 1]))); w1 = ftz(bf16_to_f32(w[(k + 1) * N + n])); }
                acc = ftz(fmaf(x1, w1, acc));
                acc = ftz(fmaf(x0, w0, acc));
            }
            y[m * N + n] = acc;
        }
    return 0;
}
