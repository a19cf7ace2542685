/* y = x @ W^T over GGUF blocks as stored (llama.cpp's formats; csrc/ggml_dequant.c has the
 * block layouts): W is [N, K], each of its rows K / 32 or K / 256 blocks, never dequantized
 * in memory. A weight may be the concatenation (over N) of up to four parts of different
 * block types (the runtime's fused q|k|v and gate|up matrices).
 *
 * Activations are quantized per row, in blocks of 32 consecutive k (b = k / 32):
 *   sx[b] = amax |x[k]| / 127 (fp32; x bf16 or fp32 widened exactly)
 *   xq[k] = clamp(rne(x[k] * (1 / sx[b])), -127, 127) (NaN -> -127); sx == 0: xq = 0
 *   xs[b] = sum of xq over the block (int), xsf[b] = sx[b] * (float)xs[b]
 * Each 32-value chunk c of a weight row is decoded to 32 int8 values v (signed formats:
 * the stored value minus its offset; Q4_K / Q5_K: the unsigned 0..15 / 0..31) and a fp32
 * factor f, and multiplied into 8 int32 lanes, lane l the exact sum over bytes 4l..4l+3 of
 * v * xq (VPDPBUSD's grouping; signed values through |v| and sign(xq, v)):
 *   Q8_0, Q4_0, Q5_0: f = d * sx[b]
 *   Q6_K: each lane times its 16-value scale (int, exact), f = d * sx[b]
 *   Q4_K, Q5_K: f = (d * sc[s]) * sx[b]; the row's min term mt = fmaf(dmin * m[s], xsf[b], mt)
 *   acc[l] = fmaf(f, (float)lane[l], acc[l])      chunks in increasing k, acc from +0.0f
 * y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) - mt.
 * Integer sums are exact, so the only rounding is in this fixed chain: a row's result does
 * not depend on how many rows are computed together, nor on the thread count (threads split
 * N), nor on the ISA (selfspec_ggemm_ref is the scalar C of the same chain; the AVX2 build
 * emulates VPDPBUSD exactly with VPMADDUBSW + VPMADDWD: |v| <= 128, |xq| <= 127, no
 * saturation).
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "pool.h"

enum { T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define GG_MAXPARTS 4
#define GG_ROWS 16 /* rows per pass over the weights (more rows: several passes, same bits) */

typedef struct { const uint8_t *data; long rows, row_bytes; int type, pad; } ss_gpart;
typedef struct { long in_features, out_features; int nparts, pad; ss_gpart part[GG_MAXPARTS]; } ss_gweight;

static inline float gh2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float gbf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t gf2bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* block geometry: values per block, bytes per block (0: not a type handled here) */
static int gg_block(int type, int *bytes) {
    switch (type) {
    case T_Q4_0: *bytes = 18; return 32;
    case T_Q5_0: *bytes = 22; return 32;
    case T_Q8_0: *bytes = 34; return 32;
    case T_Q4_K: *bytes = 144; return 256;
    case T_Q5_K: *bytes = 176; return 256;
    case T_Q6_K: *bytes = 210; return 256;
    default: *bytes = 0; return 0;
    }
}

static void k_scales6(const uint8_t *s, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[4 + j] & 63;
        sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

/* ---- activations ------------------------------------------------------------------------ */

typedef struct { int8_t *xq; float *sx, *xsf; } gg_act;

static void quantize_row(const void *x, int x_bf16, long K, int8_t *xq, float *sx, float *xsf) {
    float buf[32];
    for (long b = 0; b < K / 32; b++) {
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            buf[i] = x_bf16 ? gbf16(((const uint16_t *)x)[32 * b + i]) : ((const float *)x)[32 * b + i];
            float a = fabsf(buf[i]);
            amax = a > amax ? a : amax; /* NaN never wins */
        }
        const float s = amax / 127.0f;
        int sum = 0;
        if (s == 0.0f) {
            memset(xq + 32 * b, 0, 32);
        } else {
            const float inv = 1.0f / s;
            for (int i = 0; i < 32; i++) {
                float v = buf[i] * inv;
                v = fmaxf(v, -127.0f); /* NaN -> -127 */
                v = fminf(v, 127.0f);
                const int q = (int)nearbyintf(v);
                xq[32 * b + i] = (int8_t)q;
                sum += q;
            }
        }
        sx[b] = s;
        xsf[b] = s * (float)sum;
    }
}

/* ---- decoding one 32-value chunk (scalar: the reference, and the definition) ------------- */

/* chunk c (32 values) of a row of `type`: v[32], the fp32 weight factor (before sx), the
 * per-lane integer scales (Q6_K; else 1), the min factor (Q4_K/Q5_K: dmin * m; else 0);
 * returns 1 if v is unsigned (0..31). */
static int decode_chunk(int type, const uint8_t *row, long c, int8_t *v, float *f, int *lsc, float *mf) {
    for (int l = 0; l < 8; l++) lsc[l] = 1;
    *mf = 0.0f;
    *f = 0.0f;
    switch (type) {
    case T_Q4_0: case T_Q5_0: case T_Q8_0: {
        const uint8_t *b = row + c * (type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22 : 34);
        *f = gh2f(b);
        if (type == T_Q8_0) { memcpy(v, b + 2, 32); return 0; }
        uint32_t qh = 0;
        const uint8_t *qs = b + 2;
        if (type == T_Q5_0) { memcpy(&qh, b + 2, 4); qs = b + 6; }
        for (int j = 0; j < 16; j++) {
            int lo = qs[j] & 15, hi = qs[j] >> 4;
            if (type == T_Q5_0) {
                lo |= (int)((qh >> j) & 1) << 4;
                hi |= (int)((qh >> (j + 16)) & 1) << 4;
                v[j] = (int8_t)(lo - 16); v[j + 16] = (int8_t)(hi - 16);
            } else {
                v[j] = (int8_t)(lo - 8); v[j + 16] = (int8_t)(hi - 8);
            }
        }
        return 0;
    }
    case T_Q4_K: case T_Q5_K: {
        const int five = type == T_Q5_K;
        const uint8_t *b = row + (c / 8) * (five ? 176 : 144);
        const int s = (int)(c % 8);
        uint8_t sc[8], m[8];
        k_scales6(b + 4, sc, m);
        *f = gh2f(b) * (float)sc[s];
        *mf = gh2f(b + 2) * (float)m[s];
        const uint8_t *qh = b + 16, *q = (five ? b + 48 : b + 16) + 32 * (s / 2);
        for (int l = 0; l < 32; l++) {
            int u = (q[l] >> (4 * (s & 1))) & 15;
            if (five) u |= ((qh[l] >> s) & 1) << 4;
            v[l] = (int8_t)u;
        }
        return 1;
    }
    case T_Q6_K: {
        const uint8_t *b = row + (c / 8) * 210;
        const int h = (int)(c % 8) / 4, cc = (int)(c % 4);
        const uint8_t *ql = b + 64 * h + 32 * (cc % 2), *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * cc;
        *f = gh2f(b + 208);
        for (int l = 0; l < 32; l++) {
            const int lo = (ql[l] >> (4 * (cc / 2))) & 15, hi = (qh[l] >> (2 * cc)) & 3;
            v[l] = (int8_t)((lo | (hi << 4)) - 32);
        }
        for (int l = 0; l < 8; l++) lsc[l] = sc[l / 4];
        return 0;
    }
    }
    return 0;
}

static inline float hsum8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* the scalar chain for one row of W (type) and one activation row */
static float dot_ref(int type, const uint8_t *row, long K, const int8_t *xq, const float *sx, const float *xsf) {
    float acc[8] = {0}, mt = 0.0f;
    int8_t v[32];
    int lsc[8];
    for (long c = 0; c < K / 32; c++) {
        float f, mf;
        decode_chunk(type, row, c, v, &f, lsc, &mf);
        const float fx = f * sx[c];
        for (int l = 0; l < 8; l++) {
            int s = 0;
            for (int i = 0; i < 4; i++) s += (int)v[4 * l + i] * (int)xq[32 * c + 4 * l + i];
            acc[l] = fmaf(fx, (float)(s * lsc[l]), acc[l]);
        }
        if (type == T_Q4_K || type == T_Q5_K) mt = fmaf(mf, xsf[c], mt);
    }
    return hsum8(acc) - mt;
}

/* ---- the vector chain ---------------------------------------------------------------------- */
#ifdef __AVX2__

/* 8 int32 lanes: lane l = sum over bytes 4l..4l+3 of u (unsigned) * s (signed) */
static inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* signed v: sum v * x through |v| and sign(x, v) */
static inline __m256i dot_ss(__m256i v, __m256i x) {
    return dot_us(_mm256_sign_epi8(v, v), _mm256_sign_epi8(x, v));
}

/* 32 bits -> 32 bytes, byte j 0xFF where bit j is set */
static inline __m256i bits_to_bytes(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_movm_epi8(bits);
#else
    const __m256i sel = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), sel);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
#endif
}

static inline __m256i nibbles(const uint8_t *qs16) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs16);
    const __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

static inline float hsum_v(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l + l+4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         /* (0+4)+(2+6), (1+5)+(3+7) */
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* the 32 signed values of a Q8_0 / Q4_0 / Q5_0 block */
static inline __m256i legacy_values(int type, const uint8_t *b) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    if (type == T_Q4_0) return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const __m256i hb = _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16));
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), hb), _mm256_set1_epi8(16));
}

/* Software prefetch into L2 of the bytes [p, p + n) (hints: never fault, no effect on results).
 * A weight's rows are read once, in order, by a loop busy decoding them: with the hardware
 * prefetchers alone a thread streams from memory at a fraction of its in-cache rate; lines asked
 * for GG_PF_BYTES ahead into L2 close most of that gap (benchmarks/RESULTS.md, issue 52). */
#define GG_PF_BYTES (96 * 1024)
/* a macro: gcc 12 drops the prefetches of an inline function that has no other effect */
#define GG_PREFETCH(p, n) \
    for (long o_ = 0; o_ < (n); o_ += 64) _mm_prefetch((const char *)(p) + GG_PF_BYTES + o_, _MM_HINT_T1)

typedef struct {
    const ss_gweight *w;
    long M, K;
    const int8_t *xq;
    const float *sx, *xsf;
    void *y;
    int y_bf16;
} gg_job;

/* rows n0..n1-1 of part p (global column base g) for rows m0..m0+mr-1 (inlined: a one-row
 * call gets its own copy, its accumulator in a register) */
static inline __attribute__((always_inline)) void part_rows(const gg_job *j, const ss_gpart *p, long g, long n0, long n1, long m0, int mr) {
    const long K = j->K, C = K / 32, N = j->w->out_features;
    const int8_t *xq = j->xq + m0 * K;
    const float *sx = j->sx + m0 * C, *xsf = j->xsf + m0 * C;
    long n = n0;
    if (mr == 1 && (p->type == T_Q8_0 || p->type == T_Q4_0 || p->type == T_Q5_0)) {
        const int bytes = p->type == T_Q8_0 ? 34 : p->type == T_Q5_0 ? 22 : 18;
        for (; n + 1 < n1; n += 2) {
            const uint8_t *r0 = p->data + n * p->row_bytes, *r1 = r0 + p->row_bytes;
            GG_PREFETCH(r0, 2 * p->row_bytes);
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            for (long c = 0; c < C; c++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * c));
                const __m256i v0 = legacy_values(p->type, r0 + c * bytes), v1 = legacy_values(p->type, r1 + c * bytes);
                const __m256i s0 = dot_us(_mm256_sign_epi8(v0, v0), _mm256_sign_epi8(x, v0));
                const __m256i s1 = dot_us(_mm256_sign_epi8(v1, v1), _mm256_sign_epi8(x, v1));
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(gh2f(r0 + c * bytes) * sx[c]), _mm256_cvtepi32_ps(s0), a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(gh2f(r1 + c * bytes) * sx[c]), _mm256_cvtepi32_ps(s1), a1);
            }
            const float o0 = hsum_v(a0), o1 = hsum_v(a1);
            const long at = m0 * N + g + n;
            if (j->y_bf16) { ((uint16_t *)j->y)[at] = gf2bf16(o0); ((uint16_t *)j->y)[at + 1] = gf2bf16(o1); }
            else { ((float *)j->y)[at] = o0; ((float *)j->y)[at + 1] = o1; }
        }
    }
    for (; n < n1; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        GG_PREFETCH(row, p->row_bytes);
        __m256 acc[GG_ROWS];
        float mt[GG_ROWS];
        for (int r = 0; r < mr; r++) { acc[r] = _mm256_setzero_ps(); mt[r] = 0.0f; }
        switch (p->type) {
        case T_Q8_0: case T_Q4_0: case T_Q5_0: {
            const int bytes = p->type == T_Q8_0 ? 34 : p->type == T_Q5_0 ? 22 : 18;
            for (long c = 0; c < C; c++) {
                const uint8_t *b = row + c * bytes;
                const float d = gh2f(b);
                const __m256i v = legacy_values(p->type, b);
                const __m256i av = _mm256_sign_epi8(v, v);
                for (int r = 0; r < mr; r++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * c));
                    const __m256i s = dot_us(av, _mm256_sign_epi8(x, v));
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * sx[r * C + c]), _mm256_cvtepi32_ps(s), acc[r]);
                }
            }
            break;
        }
        case T_Q4_K: case T_Q5_K: {
            const int five = p->type == T_Q5_K;
            for (long sb = 0; sb < C / 8; sb++) {
                const uint8_t *b = row + sb * (five ? 176 : 144);
                const float d = gh2f(b), dmin = gh2f(b + 2);
                uint8_t sc[8], mn[8];
                k_scales6(b + 4, sc, mn);
                const uint8_t *qs = five ? b + 48 : b + 16;
                __m256i qh = _mm256_setzero_si256();
                if (five) qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                for (int s = 0; s < 8; s++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * (s / 2)));
                    __m256i u = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(15));
                    if (five) {
                        const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1));
                        u = _mm256_or_si256(u, _mm256_slli_epi16(hb, 4));
                    }
                    const float f = d * (float)sc[s], mf = dmin * (float)mn[s];
                    const long c = 8 * sb + s;
                    for (int r = 0; r < mr; r++) {
                        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * c));
                        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(f * sx[r * C + c]), _mm256_cvtepi32_ps(dot_us(u, x)), acc[r]);
                        mt[r] = fmaf(mf, xsf[r * C + c], mt[r]);
                    }
                }
            }
            break;
        }
        case T_Q6_K: {
            for (long sb = 0; sb < C / 8; sb++) {
                const uint8_t *b = row + sb * 210;
                const float d = gh2f(b + 208);
                const int8_t *scs = (const int8_t *)(b + 192);
                for (int h = 0; h < 2; h++) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                    for (int cc = 0; cc < 4; cc++) {
                        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (cc % 2)));
                        const __m256i lo = _mm256_and_si256(cc / 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15));
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * cc), _mm256_set1_epi8(3));
                        const __m256i v = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
                        const __m256i av = _mm256_sign_epi8(v, v);
                        const int s0 = scs[8 * h + 2 * cc], s1 = scs[8 * h + 2 * cc + 1];
                        const __m256i lsc = _mm256_setr_epi32(s0, s0, s0, s0, s1, s1, s1, s1);
                        const long c = 8 * sb + 4 * h + cc;
                        for (int r = 0; r < mr; r++) {
                            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * c));
                            const __m256i s = _mm256_mullo_epi32(dot_us(av, _mm256_sign_epi8(x, v)), lsc);
                            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * sx[r * C + c]), _mm256_cvtepi32_ps(s), acc[r]);
                        }
                    }
                }
            }
            break;
        }
        }
        for (int r = 0; r < mr; r++) {
            const float out = hsum_v(acc[r]) - mt[r];
            const long at = (m0 + r) * N + g + n;
            if (j->y_bf16) ((uint16_t *)j->y)[at] = gf2bf16(out);
            else ((float *)j->y)[at] = out;
        }
    }
}

static void gg_region(void *ctx, int tid, int nt) {
    const gg_job *j = (const gg_job *)ctx;
    long lo, hi;
    ss_share(j->w->out_features, tid, nt, &lo, &hi);
    for (long m0 = 0; m0 < j->M; m0 += GG_ROWS) {
        const int mr = (int)(j->M - m0 < GG_ROWS ? j->M - m0 : GG_ROWS);
        long g = 0;
        for (int q = 0; q < j->w->nparts; q++) {
            const ss_gpart *p = &j->w->part[q];
            const long a = lo > g ? lo - g : 0, b = hi - g < p->rows ? hi - g : p->rows;
            if (a < b) {
                if (mr == 1) part_rows(j, p, g, a, b, m0, 1);
                else part_rows(j, p, g, a, b, m0, mr);
            }
            g += p->rows;
        }
    }
}
#endif

static int check(const ss_gweight *w) {
    if (w->in_features <= 0 || w->in_features % 32 || w->nparts < 1 || w->nparts > GG_MAXPARTS) return 2;
    long n = 0;
    for (int q = 0; q < w->nparts; q++) {
        int bytes;
        const int values = gg_block(w->part[q].type, &bytes);
        if (!values || w->in_features % values || w->part[q].row_bytes != w->in_features / values * bytes) return 2;
        n += w->part[q].rows;
    }
    return n == w->out_features ? 0 : 2;
}

static int quantize_all(long M, long K, const void *x, int x_bf16, gg_act *a) {
    const long C = K / 32;
    a->xq = (int8_t *)malloc((size_t)(M * K));
    a->sx = (float *)malloc(sizeof(float) * (size_t)(M * C));
    a->xsf = (float *)malloc(sizeof(float) * (size_t)(M * C));
    if (!a->xq || !a->sx || !a->xsf) return 1;
    for (long m = 0; m < M; m++)
        quantize_row(x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K),
                     x_bf16, K, a->xq + m * K, a->sx + m * C, a->xsf + m * C);
    return 0;
}

static void free_act(gg_act *a) { free(a->xq); free(a->sx); free(a->xsf); }

int selfspec_ggml_types_ok(int type) { int b; return gg_block(type, &b) != 0; }

/* x [M, K] (bf16 or fp32) -> y [M, N] (bf16 or fp32) with w an ss_gweight (see the top) */
int selfspec_ggemm(long M, const void *x, int x_bf16, const void *wd, void *y, int y_bf16, int nthreads) {
    const ss_gweight *w = (const ss_gweight *)wd;
    if (M <= 0) return 0;
    if (check(w)) return 2;
    gg_act a = {0};
    if (quantize_all(M, w->in_features, x, x_bf16, &a)) { free_act(&a); return 1; }
#ifdef __AVX2__
    gg_job j = {w, M, w->in_features, a.xq, a.sx, a.xsf, y, y_bf16};
    int nt = ss_threads(nthreads);
    const long work = w->out_features * w->in_features;
    if (work < (1L << 16)) nt = 1;
    if (nt > w->out_features) nt = (int)w->out_features;
    ss_parallel(nt < 1 ? 1 : nt, gg_region, &j);
#else
    (void)nthreads;
    const long K = w->in_features, C = K / 32, N = w->out_features;
    for (long m = 0; m < M; m++) {
        long g = 0;
        for (int q = 0; q < w->nparts; q++) {
            const ss_gpart *p = &w->part[q];
            for (long n = 0; n < p->rows; n++) {
                const float out = dot_ref(p->type, p->data + n * p->row_bytes, K, a.xq + m * K, a.sx + m * C, a.xsf + m * C);
                if (y_bf16) ((uint16_t *)y)[m * N + g + n] = gf2bf16(out);
                else ((float *)y)[m * N + g + n] = out;
            }
            g += p->rows;
        }
    }
#endif
    free_act(&a);
    return 0;
}

/* the scalar chain (fp32 x and y): the vector code must match it bit for bit; tests only */
int selfspec_ggemm_ref(long M, const float *x, const void *wd, float *y) {
    const ss_gweight *w = (const ss_gweight *)wd;
    if (check(w)) return 2;
    gg_act a = {0};
    if (quantize_all(M, w->in_features, x, 0, &a)) { free_act(&a); return 1; }
    const long K = w->in_features, C = K / 32, N = w->out_features;
    for (long m = 0; m < M; m++) {
        long g = 0;
        for (int q = 0; q < w->nparts; q++) {
            const ss_gpart *p = &w->part[q];
            for (long n = 0; n < p->rows; n++)
                y[m * N + g + n] = dot_ref(p->type, p->data + n * p->row_bytes, K, a.xq + m * K, a.sx + m * C, a.xsf + m * C);
            g += p->rows;
        }
    }
    free_act(&a);
    return 0;
}
