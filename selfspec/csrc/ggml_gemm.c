/* y = x @ W^T over GGUF blocks as stored (llama.cpp's formats; csrc/ggml_dequant.c has the
 * block layouts): W is [N, K], each of its rows K / 32 or K / 256 blocks, never dequantized
 * in memory. A weight may be the concatenation (over N) of up to four parts of different
 * block types (the runtime's fused q|k|v and gate|up matrices).
 *
 * Activations are quantized per row, in blocks of B consecutive k: B = 32 for the 32-value
 * formats (Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1), B = 256 for the K-quants (as llama.cpp's Q8_K: one scale per
 * super-block, so a super-block's sub-blocks add up in integers):
 *   sx[b] = amax |x[k]| / 127 (fp32; x bf16 or fp32 widened exactly)
 *   xq[k] = clamp(rne(x[k] * (1 / sx[b])), -127, 127) (NaN -> -127); sx == 0: xq = 0
 *   K-quants: xs[g] = sum of xq over the 16 values of group g (int16; the min and offset terms)
 * Q8_0, Q4_0, Q5_0, IQ4_NL (the "legacy" 32-value formats): each 32-value block c holds 32 int8
 * values v (the stored value minus its offset; IQ4_NL: the nibble's entry of the non-linear table
 * KV) and its fp16 scale d; S_c = sum over the block of v * xq (one exact integer) and, block by
 * block, y = fmaf(d * sx[c], (float)S_c, y) from y = 0.
 *   Stored as given, or packed (ss_gpart.packed, selfspec_ggml_pack): eight rows' blocks c side by
 *   side, so that one lane of a vector is one row of W (below, "packed blocks"): the same bits.
 * IQ4_XS: as Q6_K (one integer S a super-block), sc = its 32-value chunk's 6-bit scale - 32, v = KV[nibble].
 * Q4_1, Q5_1 (value d v + m, v the unsigned 0..15 / 0..31): 8 int32 lanes, lane l the exact sum
 * over bytes 4l..4l+3 of v * xq; block by block acc[l] = fmaf(d * sx[c], (float)lane[l], acc[l]) and
 * mt[l] = fmaf(m * sx[c], (float)(the lane's sum of xq), mt[l]); y = hsum(acc) + hsum(mt), hsum(a) =
 * ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
 * K-quants, super-block sb (256 values, activation block sb) by super-block, its products
 * summed in exact integers and then scaled once (sc: Q4_K / Q5_K the 6-bit scale of the value's
 * 32-value chunk s, v the unsigned 0..15 / 0..31, m[s] its 6-bit min; Q6_K the int8 scale of
 * its 16 values, v the stored value minus 32):
 *   Q4_K, Q5_K, two integers: S = sum over the super-block's chunks s of sc[s] * (sum over the
 *     chunk of v * xq), M = sum over s of m[s] * (the xs of chunk s's two groups);
 *     acc = fmaf(d * sx[sb], (float)S, acc), mt = fmaf(dmin * sx[sb], (float)M, mt); y = acc - mt
 *   Q6_K, one integer: S = sum over the super-block of sc * v * xq; acc = fmaf(d * sx[sb], (float)S, acc); y = acc.
 *   (Q4_K and Q6_K packed as the legacy formats, eight rows side by side: "packed blocks" below.)
 * F16, BF16 (one value a "block": unquantized rows, as a file stores its full-precision matrices):
 *   no activation quantization; 32 fp32 lanes, lane l over k = 32 c + l, acc[l] = fmaf(w[k], x[k], acc[l])
 *   (w widened exactly, x as given: fp32, or bf16 widened exactly), then four 8-lane vectors
 *   added ((a0 + a1) + (a2 + a3)) and y = hsum of that as above.
 * Integer sums are exact (|S| < 2^28), so the only rounding is in these fixed chains: a row's
 * result does not depend on how many rows are computed together, nor on the thread count
 * (threads split N), nor on the ISA (selfspec_ggemm_ref is the scalar C of the same chains; the
 * vector code sums its integers in another order (Q6_K: unsigned values, minus 32 * sc * xs),
 * and without VNNI emulates VPDPBUSD / VPDPWSSD with VPMADDUBSW + VPMADDWD: no saturation).
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "pool.h"

enum { T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14,
       T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30 };
/* IQ4_NL / IQ4_XS: a nibble's value (llama.cpp's kvalues_iq4nl) */
static const int8_t KV[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#define GG_MAXPARTS 4
#define GG_ROWS 8 /* rows per pass over the weights (more rows: several passes, same bits); every count
                     * 1..GG_ROWS is compiled with a constant, so the accumulators stay in registers */

typedef struct { const uint8_t *data; long rows, row_bytes; int type, packed; } ss_gpart; /* packed: selfspec_ggml_pack's layout */
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
    case T_Q4_1: *bytes = 20; return 32;
    case T_IQ4_NL: *bytes = 18; return 32;
    case T_IQ4_XS: *bytes = 136; return 256;
    case T_Q5_1: *bytes = 24; return 32;
    case T_Q8_0: *bytes = 34; return 32;
    case T_Q4_K: *bytes = 144; return 256;
    case T_Q5_K: *bytes = 176; return 256;
    case T_Q6_K: *bytes = 210; return 256;
    case T_F16: case T_BF16: *bytes = 2; return 1;
    default: *bytes = 0; return 0;
    }
}

/* Q4_K / Q5_K's twelve bytes of 6-bit scales and mins -> sc[8], m[8] (four bytes at a time:
 * scales 0..3 and mins 0..3 are the low six bits of bytes 0..3 and 4..7; scales and mins 4..7
 * the nibbles of bytes 8..11 under the top two bits of bytes 0..3 and 4..7) */
static inline void k_scales6(const uint8_t *s, uint8_t *sc, uint8_t *m) {
    uint32_t u[3], o[4];
    memcpy(u, s, 12);
    o[0] = u[0] & 0x3F3F3F3Fu;                                  /* sc 0..3 */
    o[1] = (u[2] & 0x0F0F0F0Fu) | ((u[0] >> 2) & 0x30303030u);  /* sc 4..7 */
    o[2] = u[1] & 0x3F3F3F3Fu;                                  /* m 0..3 */
    o[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | ((u[1] >> 2) & 0x30303030u); /* m 4..7 */
    memcpy(sc, o, 8);
    memcpy(m, o + 2, 8);
}

#ifdef __AVX2__
/* k_scales6 in one vector, no bytes through memory: -> sc[8] (bytes 0..7), m[8] (bytes 8..15).
 * Reads 16 bytes from s (the 12 of the scales and 4 that are not used). */
static inline __m128i k_scales6_v(const uint8_t *s) {
    const __m128i u = _mm_loadu_si128((const __m128i *)s);           /* words u0 u1 u2 . */
    const __m128i t = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0));  /* u0 u2 u1 u2 */
    const __m128i h = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));  /* u0 u0 u1 u1 */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(t, _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(h, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}
#endif

/* ---- activations ------------------------------------------------------------------------ */

/* the rows' two quantizations (each made only where a part of the weight needs it): per 32
 * values (xq [M, K], sx [M, K / 32]) for the 32-value formats, per 256 (kq [M, K], ks [M, K / 256],
 * kxs [M, K / 16]) for the K-quants */
typedef struct { int8_t *xq, *kq; float *sx, *ks; int16_t *kxs; int32_t *xsum; } gg_act; /* xsum [M, K / 32]: sum of xq a block */

/* values i0 .. i0 + B - 1 of x as one activation block: xq[B] and *sx (the definition) */
static void quantize_block(const void *x, int x_bf16, long i0, int B, int8_t *xq, float *sx) {
    float buf[256];
    float amax = 0.0f;
    for (int i = 0; i < B; i++) {
        buf[i] = x_bf16 ? gbf16(((const uint16_t *)x)[i0 + i]) : ((const float *)x)[i0 + i];
        float a = fabsf(buf[i]);
        amax = a > amax ? a : amax; /* NaN never wins */
    }
    const float s = amax / 127.0f;
    *sx = s;
    if (s == 0.0f) {
        memset(xq, 0, (size_t)B);
        return;
    }
    const float inv = 1.0f / s;
    for (int i = 0; i < B; i++) {
        float v = buf[i] * inv;
        v = fmaxf(v, -127.0f); /* NaN -> -127 */
        v = fminf(v, 127.0f);
        xq[i] = (int8_t)(int)nearbyintf(v);
    }
}

#ifdef __AVX2__
static inline __m256 load8(const void *x, int x_bf16, long i) {
    if (x_bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}

/* quantize_block's bits, 8 lanes at a time (B a multiple of 32): the largest |x| whatever the
 * order (VMAXPS returns its second operand, the running maximum, when the first is NaN: NaN never
 * wins), the same product, clamp (NaN -> -127) and round to nearest even (the default MXCSR
 * mode, nearbyintf's) */
static void quantize_block_v(const void *x, int x_bf16, long i0, int B, int8_t *xq, float *sx) {
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < B; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), load8(x, x_bf16, i0 + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float s = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h))) / 127.0f;
    *sx = s;
    if (s == 0.0f) {
        memset(xq, 0, (size_t)B);
        return;
    }
    const __m256 inv = _mm256_set1_ps(1.0f / s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int i = 0; i < B; i += 32) {
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(load8(x, x_bf16, i0 + i + 8 * k), inv), lo), hi));
        /* int32 -> int8 (|q| <= 127: no saturation); the packs interleave 128-bit halves */
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + i), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
}
#endif

/* x's K values in blocks of B: xq, sx[K / B], and where xs is given the sums of xq over each 16
 * values; vec: quantize_block_v where built (the same bits) */
static void quantize_row(const void *x, int x_bf16, long K, int B, int8_t *xq, float *sx, int16_t *xs, int vec) {
    for (long b = 0; b < K / B; b++) {
#ifdef __AVX2__
        if (vec) { quantize_block_v(x, x_bf16, B * b, B, xq + B * b, sx + b); continue; }
#endif
        (void)vec;
        quantize_block(x, x_bf16, B * b, B, xq + B * b, sx + b);
    }
    for (long g = 0; xs && g < K / 16; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += xq[16 * g + i];
        xs[g] = (int16_t)sum; /* |sum| <= 16 * 127 */
    }
}

/* ---- decoding one 32-value chunk (scalar: the reference, and the definition) ------------- */

/* chunk c (32 values) of a row of `type`: v[32], the per-lane integer scales lsc[8] (Q4_K /
 * Q5_K: the chunk's 6-bit scale; Q6_K: the scale of each lane's 16 values; else 1), the fp32
 * factor d (its block's, or super-block's), and for Q4_K / Q5_K the super-block's dmin and the
 * chunk's 6-bit min mi (else 0); Q4_1 / Q5_1: dmin the block's min m (mi 1) */
static void decode_chunk(int type, const uint8_t *row, long c, int8_t *v, int *lsc, float *d, float *dmin, int *mi) {
    for (int l = 0; l < 8; l++) lsc[l] = 1;
    *mi = 0;
    *d = *dmin = 0.0f;
    switch (type) {
    case T_IQ4_NL: case T_IQ4_XS: {
        const int xs = type == T_IQ4_XS;
        const uint8_t *b = row + (xs ? (c / 8) * 136 : c * 18), *qs = xs ? b + 8 + 16 * (c % 8) : b + 2;
        *d = gh2f(b);
        if (xs) {
            const int ib = (int)(c % 8);
            const uint16_t h = (uint16_t)(b[2] | b[3] << 8);
            const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((h >> (2 * ib)) & 3) << 4);
            for (int l = 0; l < 8; l++) lsc[l] = ls - 32;
        }
        for (int j = 0; j < 16; j++) { v[j] = KV[qs[j] & 15]; v[j + 16] = KV[qs[j] >> 4]; }
        return;
    }
    case T_Q4_0: case T_Q5_0: case T_Q8_0: {
        const uint8_t *b = row + c * (type == T_Q4_0 ? 18 : type == T_Q5_0 ? 22 : 34);
        *d = gh2f(b);
        if (type == T_Q8_0) { memcpy(v, b + 2, 32); return; }
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
        return;
    }
    case T_Q4_1: case T_Q5_1: {
        const int five = type == T_Q5_1;
        const uint8_t *b = row + c * (five ? 24 : 20);
        *d = gh2f(b);
        *dmin = gh2f(b + 2);
        *mi = 1;
        uint32_t qh = 0;
        if (five) memcpy(&qh, b + 4, 4);
        const uint8_t *qs = b + (five ? 8 : 4);
        for (int j = 0; j < 16; j++) {
            v[j] = (int8_t)((qs[j] & 15) | (int)((qh >> j) & 1) << 4);
            v[j + 16] = (int8_t)((qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4);
        }
        return;
    }
    case T_Q4_K: case T_Q5_K: {
        const int five = type == T_Q5_K;
        const uint8_t *b = row + (c / 8) * (five ? 176 : 144);
        const int s = (int)(c % 8);
        uint8_t sc[8], m[8];
        k_scales6(b + 4, sc, m);
        *d = gh2f(b);
        *dmin = gh2f(b + 2);
        *mi = m[s];
        for (int l = 0; l < 8; l++) lsc[l] = sc[s];
        const uint8_t *qh = b + 16, *q = (five ? b + 48 : b + 16) + 32 * (s / 2);
        for (int l = 0; l < 32; l++) {
            int u = (q[l] >> (4 * (s & 1))) & 15;
            if (five) u |= ((qh[l] >> s) & 1) << 4;
            v[l] = (int8_t)u;
        }
        return;
    }
    case T_Q6_K: {
        const uint8_t *b = row + (c / 8) * 210;
        const int h = (int)(c % 8) / 4, cc = (int)(c % 4);
        const uint8_t *ql = b + 64 * h + 32 * (cc % 2), *qh = b + 128 + 32 * h;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * h + 2 * cc;
        *d = gh2f(b + 208);
        for (int l = 0; l < 32; l++) {
            const int lo = (ql[l] >> (4 * (cc / 2))) & 15, hi = (qh[l] >> (2 * cc)) & 3;
            v[l] = (int8_t)((lo | (hi << 4)) - 32);
        }
        for (int l = 0; l < 8; l++) lsc[l] = sc[l / 4];
        return;
    }
    }
}

static inline float hsum8(const float *a) {
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

static inline int is_legacy(int type) { return type == T_Q8_0 || type == T_Q4_0 || type == T_Q5_0 || type == T_IQ4_NL; }
static inline int packable(int type) { return is_legacy(type) || type == T_Q4_K || type == T_Q6_K; } /* selfspec_ggml_pack's types */
static inline int is_k(int type) { return type == T_Q4_K || type == T_Q5_K || type == T_Q6_K || type == T_IQ4_XS; }
static inline int one_sum(int type) { return type == T_Q6_K || type == T_IQ4_XS; } /* one integer S a super-block */
static inline int is_float(int type) { return type == T_F16 || type == T_BF16; }
static inline int has_min(int type) { return type == T_Q4_1 || type == T_Q5_1; }

/* value k of an F16 / BF16 row, widened (exact) */
static inline float float_value(int type, const uint8_t *row, long k) {
    uint16_t h;
    memcpy(&h, row + 2 * k, 2);
    return type == T_F16 ? _cvtsh_ss(h) : gbf16(h);
}

/* the scalar chain of an F16 / BF16 row and one activation row x (fp32, or bf16) */
static float dot_float_ref(int type, const uint8_t *row, long K, const void *x, int x_bf16) {
    float acc[32] = {0}, v[8];
    for (long k = 0; k < K; k++) {
        const float xv = x_bf16 ? gbf16(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        acc[k % 32] = fmaf(float_value(type, row, k), xv, acc[k % 32]);
    }
    for (int l = 0; l < 8; l++) v[l] = (acc[l] + acc[8 + l]) + (acc[16 + l] + acc[24 + l]);
    return hsum8(v);
}

/* the scalar chain for one row of W (type) and one activation row: xq, sx and xs of the
 * activation blocks that type multiplies (32 values, or 256 for the K-quants) */
static float dot_ref(int type, const uint8_t *row, long K, const int8_t *xq, const float *sx, const int16_t *xs) {
    float acc[8] = {0}, mt[8] = {0}, a = 0.0f, am = 0.0f;
    int8_t v[32];
    int lsc[8], L[8] = {0}, ML[8] = {0}, S = 0, mi;
    float d, dmin;
    for (long c = 0; c < K / 32; c++) {
        decode_chunk(type, row, c, v, lsc, &d, &dmin, &mi);
        if (is_legacy(type)) {
            int sc = 0;
            for (int i = 0; i < 32; i++) sc += (int)v[i] * (int)xq[32 * c + i];
            a = fmaf(d * sx[c], (float)sc, a);
            continue;
        }
        for (int l = 0; l < 8; l++) {
            int s = 0;
            for (int i = 0; i < 4; i++) s += (int)v[4 * l + i] * (int)xq[32 * c + 4 * l + i];
            if (one_sum(type)) S += lsc[l] * s;
            else if (is_k(type)) L[l] += lsc[l] * s;
            else acc[l] = fmaf(d * sx[c], (float)s, acc[l]);
            if (has_min(type)) {
                int t = 0;
                for (int i = 0; i < 4; i++) t += (int)xq[32 * c + 4 * l + i];
                mt[l] = fmaf(dmin * sx[c], (float)t, mt[l]);
            }
        }
        if (!is_k(type)) continue;
        ML[c % 8] = mi * (xs[2 * c] + xs[2 * c + 1]);
        if (c % 8 == 7) {
            const float f = d * sx[c / 8], fm = dmin * sx[c / 8];
            if (one_sum(type)) { a = fmaf(f, (float)S, a); S = 0; continue; }
            int S4 = 0, M4 = 0;
            for (int l = 0; l < 8; l++) { S4 += L[l]; M4 += ML[l]; L[l] = 0; }
            a = fmaf(f, (float)S4, a);
            am = fmaf(fm, (float)M4, am);
        }
    }
    return one_sum(type) || is_legacy(type) ? a : is_k(type) ? a - am : hsum8(acc) + hsum8(mt); /* Q4_1, Q5_1 */
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

/* acc + 8 int32 lanes: lane l = p[2l] * s[2l] + p[2l + 1] * s[2l + 1] (int16 p, s) */
static inline __m256i dot_ws(__m256i acc, __m256i p, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s));
#endif
}

static inline int hsum_i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* int16 lanes of v (its two 128-bit halves alike) -> every lane of the low half int16 lane a of
 * v, of the high half lane b */
static inline __m256i pick16(__m256i v, int a, int b) {
    const __m256i sel = _mm256_setr_epi8(2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1,
        2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1, 2 * a, 2 * a + 1,
        2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1,
        2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1, 2 * b, 2 * b + 1);
    return _mm256_shuffle_epi8(v, sel);
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

/* 16 bytes -> their 32 nibbles: low nibbles in bytes 0..15, high ones in 16..31 (the 16 bytes
 * in both halves, the high half shifted, one mask: no lane-crossing insert) */
static inline __m256i nibbles(const uint8_t *qs16) {
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs16));
    return _mm256_and_si256(_mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xF0), _mm256_set1_epi8(15));
}

static inline float hsum_v(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* l + l+4 */
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                         /* (0+4)+(2+6), (1+5)+(3+7) */
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* KV in both 128-bit halves (a VPSHUFB table) */
static inline __m256i kv_table(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KV)); }

/* the 32 signed values of a Q8_0 / Q4_0 / Q5_0 / IQ4_NL block */
static inline __m256i legacy_values(int type, const uint8_t *b) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    if (type == T_Q4_0) return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    if (type == T_IQ4_NL) return _mm256_shuffle_epi8(kv_table(), nibbles(b + 2));
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    /* value - 16 as a byte: the nibble where the high bit is set, nibble | 0xF0 (= nibble - 16) where not */
    return _mm256_or_si256(nibbles(b + 6), _mm256_andnot_si256(bits_to_bytes(qh), _mm256_set1_epi8((char)0xF0)));
}

/* a block's fp16 scale in all 8 lanes */
static inline __m256 scale8(const uint8_t *b) {
    return _mm256_cvtph_ps(_mm_set1_epi16((short)((uint16_t)b[0] | (uint16_t)b[1] << 8)));
}

/* Software prefetch into L2, GG_PF_BYTES ahead of the reads (hints: never fault, no effect on
 * results). A weight's rows are read once, in order, by a loop busy decoding them: with the
 * hardware prefetchers alone a thread streams from memory at a fraction of its in-cache rate.
 * A thread's stream keeps the next line to ask for in pf; GG_STREAM(pf, at), called as the loop
 * reads up to `at`, asks for each line once, up to at + GG_PF_BYTES: spread through the decoding,
 * never in a burst (asking for a whole long row at its start, 131 lines for a 10240-wide K-quant
 * row, outruns the core's queue of outstanding misses: most of the burst is dropped;
 * benchmarks/RESULTS.md, issue 52). A macro: gcc 12 drops the prefetches of an inline function
 * that has no other effect. */
#define GG_PF_BYTES (96 * 1024)
#define GG_STREAM(pf, at) \
    for (const char *e_ = (const char *)(at) + GG_PF_BYTES; (pf) < e_; (pf) += 64) _mm_prefetch((pf), _MM_HINT_T1)
/* a stream starting at the rows of part p from row n */
#define GG_STREAM_AT(p, n) ((const char *)((p)->data + (n) * (p)->row_bytes) + GG_PF_BYTES)

typedef struct {
    const ss_gweight *w;
    long M, K;
    const int8_t *xq, *kq; /* activations per 32 values (xq, sx; xsum) and per 256 (kq, ks; kxs per 16) */
    const int32_t *xsum;
    const float *sx, *ks;
    const int16_t *kxs;
    const void *x; /* the activations as given (F16 / BF16 rows multiply them unquantized) */
    int x_bf16;
    void *y;
    int y_bf16;
    long next; /* the first column no thread has taken yet (next_columns) */
} gg_job;

static inline void put(const gg_job *j, long m, long col, float v) {
    const long at = m * j->w->out_features + col;
    if (j->y_bf16) ((uint16_t *)j->y)[at] = gf2bf16(v);
    else ((float *)j->y)[at] = v;
}

/* 8 activations of row m from k, widened to fp32 */
static inline __m256 act8(const gg_job *j, long m, long k) {
    if (j->x_bf16) return load8(j->x, 1, m * j->K + k);
    return _mm256_loadu_ps((const float *)j->x + m * j->K + k);
}

/* 8 values of an F16 / BF16 row from k, widened (exact) */
static inline __m256 weight8(int type, const uint8_t *row, long k) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * k));
    if (type == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* F16 / BF16 rows n0..n1-1 of part p for rows m0..m0+mr-1: dot_float_ref's chain, 4 vectors of 8 lanes */
static inline __attribute__((always_inline)) void float_rows(const gg_job *j, const ss_gpart *p, long g, long n0, long n1, long m0, int mr) {
    const long K = j->K;
    const char *pf = GG_STREAM_AT(p, n0);
    for (long n = n0; n < n1; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        __m256 acc[GG_ROWS][4];
        for (int r = 0; r < mr; r++)
            for (int q = 0; q < 4; q++) acc[r][q] = _mm256_setzero_ps();
        for (long k = 0; k < K; k += 32) {
            GG_STREAM(pf, row + 2 * k + 64);
            __m256 w[4];
            for (int q = 0; q < 4; q++) w[q] = weight8(p->type, row, k + 8 * q);
            for (int r = 0; r < mr; r++)
                for (int q = 0; q < 4; q++) acc[r][q] = _mm256_fmadd_ps(w[q], act8(j, m0 + r, k + 8 * q), acc[r][q]);
        }
        for (int r = 0; r < mr; r++)
            put(j, m0 + r, g + n, hsum_v(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]))));
    }
}

/* A Q4_K / Q5_K super-block's d and dmin (lanes 0, 1), its 6-bit scales as int16 in both halves
 * (*sc) and its mins, each twice (*mn: m0 m0 m1 m1 ..), unpacked in vectors */
static inline __m128 k45_head(const uint8_t *b, __m256i *sc, __m256i *mn) {
    int dbits;
    memcpy(&dbits, b, 4);
    const __m128i sm = k_scales6_v(b + 4); /* sc[8], m[8] */
    *sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
    *mn = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(sm, sm));
    return _mm_cvtph_ps(_mm_cvtsi32_si128(dbits));
}

/* One activation row against one Q4_K / Q5_K weight row (K / 256 super-blocks, not packed): the
 * chain of part_rows' general loop below (exact integers, the same fp32 FMAs in the same order), in
 * a loop of its own for one-row products: the integer sums in two accumulators, the scales
 * unpacked in a vector. */
static inline __attribute__((always_inline)) float k45_row1(const uint8_t *row, long nsb, int five, const int8_t *kq,
                                                            const int16_t *kxs, const float *ks, const char **pf) {
    const long sbytes = five ? 176 : 144;
    const __m256i m15 = _mm256_set1_epi8(15), b16 = _mm256_set1_epi8(16);
    float acc = 0.0f, mt = 0.0f;
    for (long sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * sbytes;
        GG_STREAM(*pf, b + sbytes);
        const int8_t *x = kq + 256 * sb;
        __m256i sc, mn;
        const __m128 dm = _mm_mul_ps(k45_head(b, &sc, &mn), _mm_set1_ps(ks[sb])); /* d * sx, dmin * sx */
        const uint8_t *qs = five ? b + 48 : b + 16;
        __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m256i L0 = _mm256_setzero_si256(), L1 = _mm256_setzero_si256();
        for (int jj = 0; jj < 4; jj++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * jj));
            __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
            if (five) {
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), b16));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), b16));
                qh = _mm256_srli_epi16(qh, 2);
            }
            L0 = dot_ws(L0, _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x + 64 * jj))), pick16(sc, 2 * jj, 2 * jj));
            L1 = dot_ws(L1, _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 64 * jj + 32))),
                        pick16(sc, 2 * jj + 1, 2 * jj + 1));
        }
        const __m256i ml = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)(kxs + 16 * sb)));
        acc = fmaf(_mm_cvtss_f32(dm), (float)hsum_i(_mm256_add_epi32(L0, L1)), acc);
        mt = fmaf(_mm_cvtss_f32(_mm_movehdup_ps(dm)), (float)hsum_i(ml), mt);
    }
    return acc - mt;
}

/* One activation row against one Q6_K weight row: part_rows' chain (one exact integer S a
 * super-block, then one fp32 FMA), in a loop of its own as k45_row1, the integer sums in four
 * accumulators */
static inline __attribute__((always_inline)) float q6k_row1(const uint8_t *row, long nsb, const int8_t *kq, const int16_t *kxs,
                                                            const float *ks, const char **pf) {
    const __m256i m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    float acc = 0.0f;
    for (long sb = 0; sb < nsb; sb++) {
        const uint8_t *b = row + sb * 210;
        GG_STREAM(*pf, b + 210);
        const int8_t *x = kq + 256 * sb;
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        __m256i P[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int h = 0; h < 2; h++) {
            const __m256i sh = _mm256_permute2x128_si256(sc, sc, h ? 0x11 : 0x00);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h)), ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            const __m256i u[4] = { /* chunk 4 h + cc: the stored 0..63 */
                _mm256_or_si256(_mm256_and_si256(ql0, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
                _mm256_or_si256(_mm256_and_si256(ql1, m15), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m15), _mm256_and_si256(qh, m30)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m15), _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
            for (int cc = 0; cc < 4; cc++)
                P[cc] = dot_ws(P[cc], _mm256_maddubs_epi16(u[cc], _mm256_loadu_si256((const __m256i *)(x + 128 * h + 32 * cc))),
                               pick16(sh, 2 * cc, 2 * cc + 1));
        }
        const __m256i S = _mm256_add_epi32(_mm256_add_epi32(P[0], P[1]), _mm256_add_epi32(P[2], P[3]));
        const __m256i L = _mm256_sub_epi32(S, _mm256_slli_epi32(_mm256_madd_epi16(sc,
            _mm256_loadu_si256((const __m256i *)(kxs + 16 * sb))), 5));
        acc = fmaf(gh2f(b + 208) * ks[sb], (float)hsum_i(L), acc);
    }
    return acc;
}

/* ---- packed blocks ----------------------------------------------------------------------
 * A legacy part of rows % 8 == 0, packed (selfspec_ggml_pack): group G = rows 8G..8G+7, its
 * block c one packed block of 8 times the stored bytes, at (G * C + c) * 8 * bytes:
 *   16 bytes: the eight rows' fp16 scales d, row i at 2i;
 *   the values as unsigned bytes u = v + o (o: Q4_0 8, Q5_0 16, Q8_0 and IQ4_NL 128), in eight
 *   32-byte vectors U[q] (q = 0..7: the block's values 4q..4q+3), byte 4i + t = row i's value 4q + t:
 *     Q8_0: the eight U[q], 256 bytes;
 *     Q4_0, IQ4_NL: four 32-byte vectors of nibbles, vector h's low nibbles U[2h], high U[2h + 1]
 *       (IQ4_NL: the nibble indexes KV; u = KV + 128); Q5_0: those nibbles, the low four bits of u,
 *       then eight 32-bit masks, mask q's bit 4i + t the fifth bit of U[q]'s byte 4i + t.
 * Then one VPDPBUSD of U[q] with the row's four activations at 4q broadcast gives eight columns'
 * partial sums at once; starting from -o sum(xq) over the block, the eight lanes end as the blocks'
 * S_c (exact), and y's eight lanes take the chain's FMA together: the same bits as one column alone.
 * Q4_K (super-block sb of group G at (G * K / 256 + sb) * 8 * 144, as many bytes): the eight rows'
 * d (16 bytes), dmin (16 bytes); their 6-bit scales sc[c][i] and mins m[c][i] (chunk c, row i) in
 * 96 bytes: at 32 + 8c + i the low four bits of sc[c][i] (low nibble) and of m[c][i] (high); at
 * 96 + 8c + i (c < 4) their top two bits, sc[c] in bits 0-1, m[c] 2-3, sc[c + 4] 4-5, m[c + 4] 6-7;
 * then 32 vectors, vector v's word i the stored word v of row i's 128 bytes of nibbles (v = 8 jj
 * + q: chunk 2 jj's values 4q..4q+3 in the low nibbles, chunk 2 jj + 1's in the high).
 * Q6_K (8 * 210 bytes a super-block): d (16 bytes); the int8 scales, at 16 + 8 g + i row i's of
 * group g (16 values); then group g's stored 0..63 values u (v + 32), four quads U0..U3 of eight
 * rows' four values as above, in three vectors at 144 + 96 g: A = U0 | U3 << 6, B = U1 | (U3 >> 2)
 * << 6, C = U2 | (U3 >> 4) << 6 (bytewise), so that U0..U2 are one AND each and U3 the top two
 * bits of A, B, C; S = sum over groups of sc * (u . xq) - 32 * (sum over groups of sc * xs): exact. */
#define GG_PACK 8

static inline int legacy_bytes(int type) { return type == T_Q8_0 ? 34 : type == T_Q5_0 ? 22 : 18; }
static inline int legacy_offset(int type) { return type == T_Q4_0 ? 8 : type == T_Q5_0 ? 16 : 128; }

/* U[0..7] of a packed block (after its 16 bytes of scales) */
static inline void packed_values(int type, const uint8_t *q, __m256i *U) {
    if (type == T_Q8_0) {
        for (int i = 0; i < 8; i++) U[i] = _mm256_loadu_si256((const __m256i *)(q + 32 * i));
        return;
    }
    const __m256i m15 = _mm256_set1_epi8(15);
    for (int h = 0; h < 4; h++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(q + 32 * h));
        U[2 * h] = _mm256_and_si256(b, m15);
        U[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
    }
    if (type == T_IQ4_NL) {
        const __m256i kv = _mm256_add_epi8(kv_table(), _mm256_set1_epi8((char)0x80));
        for (int i = 0; i < 8; i++) U[i] = _mm256_shuffle_epi8(kv, U[i]);
    } else if (type == T_Q5_0) {
        uint32_t hb[8];
        memcpy(hb, q + 128, 32);
        for (int i = 0; i < 8; i++) U[i] = _mm256_or_si256(U[i], _mm256_and_si256(bits_to_bytes(hb[i]), _mm256_set1_epi8(16)));
    }
}

/* eight int32 lanes += the four-byte dot products of u (unsigned) and s (signed), exact: VPDPBUSD,
 * or without VNNI VPMADDUBSW + VPMADDWD (exact where 2 * 255 * |s| < 2^15, the caller's care) */
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if defined(__AVX512VNNI__) || defined(__AVXVNNI__)
#define GG_VNNI 1
#else
#define GG_VNNI 0
#endif

static inline void put8(const gg_job *j, long m, long col, __m256 v) {
    const long at = m * j->w->out_features + col;
    if (j->y_bf16) {
        float f[8];
        _mm256_storeu_ps(f, v);
        for (int i = 0; i < 8; i++) ((uint16_t *)j->y)[at + i] = gf2bf16(f[i]);
    } else {
        _mm256_storeu_ps((float *)j->y + at, v);
    }
}

/* sum over quads q < nq of U[q] (eight rows' four unsigned values) . x's four at 4q, per row of W:
 * exact, in two chains (even and odd quads: half the VPDPBUSD latency) */
static inline __m256i quad_sums(const __m256i *U, const int8_t *x, int nq) {
    __m256i T[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int q = 0; q < nq; q++) {
        int32_t x4;
        memcpy(&x4, x + 4 * q, 4);
        T[q % 2] = dot4(T[q % 2], U[q], _mm256_set1_epi32(x4));
    }
    return _mm256_add_epi32(T[0], T[1]);
}

/* rows n0..n1-1 (multiples of 8) of a packed part for activation rows m0..m0+mr-1 */
static inline __attribute__((always_inline)) void packed_rows(const gg_job *j, const ss_gpart *p, long g, long n0, long n1, long m0, int mr) {
    const long K = j->K, C = K / 32, pb = 8L * legacy_bytes(p->type);
    const int8_t *xq = j->xq + m0 * K;
    const float *sx = j->sx + m0 * C;
    const int32_t *xsum = j->xsum + m0 * C;
    const int o = legacy_offset(p->type);
    /* without VNNI, u up to 255 would saturate VPMADDUBSW: Q8_0 / IQ4_NL multiply |v| by sign(x, v) */
    const int signed_path = !GG_VNNI && o == 128;
    for (long n = n0; n < n1; n += GG_PACK) {
        const uint8_t *blk = p->data + (n / GG_PACK) * C * pb;
        const char *pf = (const char *)blk + GG_PF_BYTES;
        __m256 acc[GG_ROWS];
        for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
        for (long c = 0; c < C; c++, blk += pb) {
            GG_STREAM(pf, blk + pb);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            __m256i U[8];
            packed_values(p->type, blk + 16, U);
            if (signed_path)
                for (int i = 0; i < 8; i++) U[i] = _mm256_xor_si256(U[i], _mm256_set1_epi8((char)0x80)); /* v itself */
            for (int r = 0; r < mr; r++) {
                const int8_t *x = xq + r * K + 32 * c;
                __m256i Sp[2] = {_mm256_set1_epi32(signed_path ? 0 : -o * xsum[r * C + c]), _mm256_setzero_si256()};
                for (int i = 0; i < 8; i++) { /* two chains of exact sums: half the latency of one row's block */
                    int32_t x4;
                    memcpy(&x4, x + 4 * i, 4);
                    const __m256i xb = _mm256_set1_epi32(x4);
                    Sp[i % 2] = signed_path ? dot4(Sp[i % 2], _mm256_sign_epi8(U[i], U[i]), _mm256_sign_epi8(xb, U[i])) : dot4(Sp[i % 2], U[i], xb);
                }
                const __m256i S = _mm256_add_epi32(Sp[0], Sp[1]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(sx[r * C + c])), _mm256_cvtepi32_ps(S), acc[r]);
            }
        }
        for (int r = 0; r < mr; r++) put8(j, m0 + r, g + n, acc[r]);
    }
}

/* rows n0..n1-1 (multiples of 8) of a packed Q4_K part for activation rows m0..m0+mr-1 */
static inline __attribute__((always_inline)) void packed_q4k_rows(const gg_job *j, const ss_gpart *p, long g, long n0, long n1, long m0, int mr) {
    const long K = j->K, NSB = K / 256, pb = 8L * 144;
    const int8_t *kq = j->kq + m0 * K;
    const float *ks = j->ks + m0 * NSB;
    const int16_t *kxs = j->kxs + m0 * (K / 16);
    const __m256i m15 = _mm256_set1_epi8(15), m48 = _mm256_set1_epi8(0x30);
    for (long n = n0; n < n1; n += GG_PACK) {
        const uint8_t *blk = p->data + (n / GG_PACK) * NSB * pb;
        const char *pf = (const char *)blk + GG_PF_BYTES;
        __m256 acc[GG_ROWS], mt[GG_ROWS];
        for (int r = 0; r < mr; r++) acc[r] = mt[r] = _mm256_setzero_ps();
        for (long sb = 0; sb < NSB; sb++, blk += pb) {
            GG_STREAM(pf, blk + pb);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
            /* the scales and mins as bytes [chunk][row of W]: sm[0..63] sc, sm[64..127] m */
            uint8_t sm[128];
            {
                const __m256i n03 = _mm256_loadu_si256((const __m256i *)(blk + 32)), n47 = _mm256_loadu_si256((const __m256i *)(blk + 64));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 96));
                _mm256_storeu_si256((__m256i *)sm, _mm256_or_si256(_mm256_and_si256(n03, m15), _mm256_and_si256(_mm256_slli_epi16(h, 4), m48)));
                _mm256_storeu_si256((__m256i *)(sm + 32), _mm256_or_si256(_mm256_and_si256(n47, m15), _mm256_and_si256(h, m48)));
                _mm256_storeu_si256((__m256i *)(sm + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n03, 4), m15),
                                                                         _mm256_and_si256(_mm256_slli_epi16(h, 2), m48)));
                _mm256_storeu_si256((__m256i *)(sm + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n47, 4), m15),
                                                                         _mm256_and_si256(_mm256_srli_epi16(h, 2), m48)));
            }
            __m256i S[GG_ROWS];
            for (int r = 0; r < mr; r++) S[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i scv = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sm + 8 * c)));
                __m256i U[8]; /* chunk c, quad q: eight rows' four unsigned values */
                for (int q = 0; q < 8; q++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * (8 * (c / 2) + q)));
                    U[q] = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(w, 4) : w, m15);
                }
                for (int r = 0; r < mr; r++)
                    S[r] = _mm256_add_epi32(S[r], _mm256_mullo_epi32(quad_sums(U, kq + r * K + 256 * sb + 32 * c, 8), scv));
            }
            __m256i mp[4]; /* int16 pairs (m of chunk 2k, of chunk 2k + 1) a row of W */
            for (int k = 0; k < 4; k++)
                mp[k] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(sm + 64 + 16 * k)),
                                                               _mm_loadl_epi64((const __m128i *)(sm + 72 + 16 * k))));
            for (int r = 0; r < mr; r++) {
                const int16_t *xs = kxs + r * (K / 16) + 16 * sb;
                __m256i M = _mm256_setzero_si256();
                for (int k = 0; k < 4; k++) { /* the chunks' sums of xq as int16 pairs (|.| <= 32 * 127) */
                    const uint32_t lo = (uint16_t)(xs[4 * k] + xs[4 * k + 1]), hi = (uint16_t)(xs[4 * k + 2] + xs[4 * k + 3]);
                    M = dot_ws(M, mp[k], _mm256_set1_epi32((int)(lo | hi << 16)));
                }
                const __m256 f = _mm256_set1_ps(ks[r * NSB + sb]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, f), _mm256_cvtepi32_ps(S[r]), acc[r]);
                mt[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin, f), _mm256_cvtepi32_ps(M), mt[r]);
            }
        }
        for (int r = 0; r < mr; r++) put8(j, m0 + r, g + n, _mm256_sub_ps(acc[r], mt[r]));
    }
}

/* rows n0..n1-1 (multiples of 8) of a packed Q6_K part for activation rows m0..m0+mr-1 */
static inline __attribute__((always_inline)) void packed_q6k_rows(const gg_job *j, const ss_gpart *p, long g, long n0, long n1, long m0, int mr) {
    const long K = j->K, NSB = K / 256, pb = 8L * 210;
    const int8_t *kq = j->kq + m0 * K;
    const float *ks = j->ks + m0 * NSB;
    const int16_t *kxs = j->kxs + m0 * (K / 16);
    const __m256i m63 = _mm256_set1_epi8(63), m3 = _mm256_set1_epi8(3), m12 = _mm256_set1_epi8(12), m48 = _mm256_set1_epi8(0x30);
    for (long n = n0; n < n1; n += GG_PACK) {
        const uint8_t *blk = p->data + (n / GG_PACK) * NSB * pb;
        const char *pf = (const char *)blk + GG_PF_BYTES;
        __m256 acc[GG_ROWS];
        for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
        for (long sb = 0; sb < NSB; sb++, blk += pb) {
            GG_STREAM(pf, blk + pb);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
            const uint8_t *sc = blk + 16;
            __m256i S[GG_ROWS];
            for (int r = 0; r < mr; r++) S[r] = _mm256_setzero_si256();
            for (int gq = 0; gq < 16; gq++) { /* group gq: values 16 gq .. 16 gq + 15 */
                const uint8_t *t = blk + 144 + 96 * gq;
                const __m256i A = _mm256_loadu_si256((const __m256i *)t), B = _mm256_loadu_si256((const __m256i *)(t + 32)),
                              Cv = _mm256_loadu_si256((const __m256i *)(t + 64));
                const __m256i U[4] = {_mm256_and_si256(A, m63), _mm256_and_si256(B, m63), _mm256_and_si256(Cv, m63),
                    _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(A, 6), m3), _mm256_and_si256(_mm256_srli_epi16(B, 4), m12)),
                                    _mm256_and_si256(_mm256_srli_epi16(Cv, 2), m48))};
                const __m256i scv = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * gq)));
                for (int r = 0; r < mr; r++)
                    S[r] = _mm256_add_epi32(S[r], _mm256_mullo_epi32(quad_sums(U, kq + r * K + 256 * sb + 16 * gq, 4), scv));
            }
            __m256i sp[8]; /* int16 pairs (sc of group 2k, of group 2k + 1) a row of W */
            for (int k = 0; k < 8; k++)
                sp[k] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(sc + 16 * k)),
                                                               _mm_loadl_epi64((const __m128i *)(sc + 16 * k + 8))));
            for (int r = 0; r < mr; r++) {
                const int16_t *xs = kxs + r * (K / 16) + 16 * sb;
                __m256i O = _mm256_setzero_si256();
                for (int k = 0; k < 8; k++) {
                    int32_t pair;
                    memcpy(&pair, xs + 2 * k, 4); /* xs of groups 2k, 2k + 1 */
                    O = dot_ws(O, sp[k], _mm256_set1_epi32(pair));
                }
                const __m256i L = _mm256_sub_epi32(S[r], _mm256_slli_epi32(O, 5));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(ks[r * NSB + sb])), _mm256_cvtepi32_ps(L), acc[r]);
            }
        }
        for (int r = 0; r < mr; r++) put8(j, m0 + r, g + n, acc[r]);
    }
}

/* rows n0..n1-1 of part p (global column base g) for rows m0..m0+mr-1 (inlined: a one-row
 * call gets its own copy, its accumulator in a register) */
static inline __attribute__((always_inline)) void part_rows(const gg_job *j, const ss_gpart *p, long g, long n0, long n1, long m0, int mr) {
    if (is_float(p->type)) { float_rows(j, p, g, n0, n1, m0, mr); return; }
    const long K = j->K, C = K / 32;
    const int8_t *xq = j->xq + m0 * K, *kq = j->kq + m0 * K;
    const float *sx = j->sx + m0 * C, *ks = j->ks + m0 * (C / 8);
    const int16_t *kxs = j->kxs + m0 * (K / 16);
    long n = n0;
    const char *pf = GG_STREAM_AT(p, n0);
    if (p->packed) {
        if (p->type == T_Q4_K) packed_q4k_rows(j, p, g, n0, n1, m0, mr);
        else if (p->type == T_Q6_K) packed_q6k_rows(j, p, g, n0, n1, m0, mr);
        else packed_rows(j, p, g, n0, n1, m0, mr);
        return;
    }
    if (mr == 1 && (p->type == T_Q4_K || p->type == T_Q5_K || p->type == T_Q6_K)) {
        for (; n < n1; n++) {
            const uint8_t *row = p->data + n * p->row_bytes;
            put(j, m0, g + n, p->type == T_Q6_K ? q6k_row1(row, C / 8, kq, kxs, ks, &pf)
                                                 : k45_row1(row, C / 8, p->type == T_Q5_K, kq, kxs, ks, &pf));
        }
        return;
    }
    for (; n < n1; n++) {
        const uint8_t *row = p->data + n * p->row_bytes;
        if (has_min(p->type)) {
            const int five = p->type == T_Q5_1;
            __m256 acc[GG_ROWS], mt[GG_ROWS];
            for (int r = 0; r < mr; r++) acc[r] = mt[r] = _mm256_setzero_ps();
            const __m256i ones = _mm256_set1_epi8(1);
            for (long c = 0; c < C; c++) {
                const uint8_t *b = row + c * (five ? 24 : 20);
                GG_STREAM(pf, b + (five ? 24 : 20));
                const __m256 d = scale8(b), m = scale8(b + 2);
                __m256i u = nibbles(b + (five ? 8 : 4));
                if (five) {
                    uint32_t qh;
                    memcpy(&qh, b + 4, 4);
                    u = _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(16)));
                }
                for (int r = 0; r < mr; r++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * c));
                    const __m256 xd = _mm256_broadcast_ss(sx + r * C + c);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, xd), _mm256_cvtepi32_ps(dot_us(u, x)), acc[r]);
                    mt[r] = _mm256_fmadd_ps(_mm256_mul_ps(m, xd), _mm256_cvtepi32_ps(dot_us(ones, x)), mt[r]);
                }
            }
            for (int r = 0; r < mr; r++) put(j, m0 + r, g + n, hsum_v(acc[r]) + hsum_v(mt[r]));
            continue;
        }
        if (is_legacy(p->type)) { /* blocks as stored (a part not packed): one column at a time */
            const int bytes = p->type == T_Q8_0 ? 34 : p->type == T_Q5_0 ? 22 : 18;
            float acc[GG_ROWS];
            for (int r = 0; r < mr; r++) acc[r] = 0.0f;
            for (long c = 0; c < C; c++) {
                const uint8_t *b = row + c * bytes;
                GG_STREAM(pf, b + bytes);
                const float d = gh2f(b);
                const __m256i v = legacy_values(p->type, b);
                const __m256i av = _mm256_sign_epi8(v, v);
                for (int r = 0; r < mr; r++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * c));
                    acc[r] = fmaf(d * sx[r * C + c], (float)hsum_i(dot_us(av, _mm256_sign_epi8(x, v))), acc[r]);
                }
            }
            for (int r = 0; r < mr; r++) put(j, m0 + r, g + n, acc[r]);
            continue;
        }
        float acc[GG_ROWS], mtr[GG_ROWS]; /* mtr: Q4_K, Q5_K's min terms */
        for (int r = 0; r < mr; r++) acc[r] = mtr[r] = 0.0f;
        const __m256i m15 = _mm256_set1_epi8(15);
        const long sbytes = p->row_bytes / (C / 8); /* a super-block's */
        for (long sb = 0; sb < C / 8; sb++) {
            GG_STREAM(pf, row + (sb + 1) * sbytes);
            const int8_t *x = kq + 256 * sb;   /* row r: x + r * K */
            const int16_t *xs = kxs + 16 * sb; /* row r: xs + r * (K / 16) */
            __m256i L[GG_ROWS];
            for (int r = 0; r < mr; r++) L[r] = _mm256_setzero_si256();
            float d = 0.0f;
            if (p->type == T_IQ4_XS) {
                const uint8_t *b = row + sb * 136;
                d = gh2f(b);
                const uint16_t h = (uint16_t)(b[2] | b[3] << 8);
                for (int ib = 0; ib < 8; ib++) {
                    const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 15) | (((h >> (2 * ib)) & 3) << 4);
                    const __m256i v = _mm256_shuffle_epi8(kv_table(), nibbles(b + 8 + 16 * ib));
                    const __m256i av = _mm256_sign_epi8(v, v), scv = _mm256_set1_epi16((short)(ls - 32));
                    for (int r = 0; r < mr; r++) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * K + 32 * ib));
                        L[r] = dot_ws(L[r], _mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)), scv);
                    }
                }
            } else if (p->type == T_Q6_K) {
                const uint8_t *b = row + sb * 210;
                d = gh2f(b + 208);
                /* 16 int8 scales, one per 16 values, as int16: [0..7 | 8..15], then each half in both */
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
                const __m256i sh[2] = {_mm256_permute2x128_si256(sc, sc, 0x00), _mm256_permute2x128_si256(sc, sc, 0x11)};
                for (int h = 0; h < 2; h++) {
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                    for (int cc = 0; cc < 4; cc++) { /* chunk 4 h + cc: values 128 h + 32 cc .. + 31 */
                        const __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (cc % 2)));
                        const __m256i lo = _mm256_and_si256(cc / 2 ? _mm256_srli_epi16(ql, 4) : ql, m15);
                        const __m256i hi = _mm256_and_si256(cc == 0 ? _mm256_slli_epi16(qh, 4) : cc == 1 ? _mm256_slli_epi16(qh, 2)
                            : cc == 2 ? qh : _mm256_srli_epi16(qh, 2), _mm256_set1_epi8(0x30));
                        const __m256i u = _mm256_or_si256(lo, hi); /* the stored 0..63 */
                        const __m256i scv = pick16(sh[h], 2 * cc, 2 * cc + 1);
                        for (int r = 0; r < mr; r++) {
                            const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + r * K + 128 * h + 32 * cc));
                            L[r] = dot_ws(L[r], _mm256_maddubs_epi16(u, xv), scv);
                        }
                    }
                }
                /* the offset: S -= 32 * sum over groups of sc * xs */
                for (int r = 0; r < mr; r++)
                    L[r] = _mm256_sub_epi32(L[r], _mm256_slli_epi32(_mm256_madd_epi16(sc,
                        _mm256_loadu_si256((const __m256i *)(xs + r * (K / 16)))), 5));
            } else {
                const int five = p->type == T_Q5_K;
                const uint8_t *b = row + sb * (five ? 176 : 144);
                __m256i sc, mn;
                const __m128 dd = k45_head(b, &sc, &mn); /* d, dmin */
                const uint8_t *qs = five ? b + 48 : b + 16;
                __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
                for (int jj = 0; jj < 4; jj++) { /* chunks 2 jj (low nibbles) and 2 jj + 1 (high) */
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * jj));
                    __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
                    if (five) { /* bit 2 jj (+ 1) of each qh byte is the fifth bit */
                        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(qh, 4), _mm256_set1_epi8(16)));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(qh, 3), _mm256_set1_epi8(16)));
                        qh = _mm256_srli_epi16(qh, 2);
                    }
                    const __m256i slo = pick16(sc, 2 * jj, 2 * jj), shi = pick16(sc, 2 * jj + 1, 2 * jj + 1);
                    for (int r = 0; r < mr; r++) {
                        const int8_t *xr = x + r * K + 64 * jj;
                        L[r] = dot_ws(L[r], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)), slo);
                        L[r] = dot_ws(L[r], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32))), shi);
                    }
                }
                for (int r = 0; r < mr; r++) { /* lane l: chunk l's min term */
                    const __m256i ml = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)(xs + r * (K / 16))));
                    const __m128 dm = _mm_mul_ps(dd, _mm_set1_ps(ks[r * (C / 8) + sb])); /* d * sx, dmin * sx */
                    acc[r] = fmaf(_mm_cvtss_f32(dm), (float)hsum_i(L[r]), acc[r]);
                    mtr[r] = fmaf(_mm_cvtss_f32(_mm_movehdup_ps(dm)), (float)hsum_i(ml), mtr[r]);
                }
                continue;
            }
            for (int r = 0; r < mr; r++) acc[r] = fmaf(d * ks[r * (C / 8) + sb], (float)hsum_i(L[r]), acc[r]);
        }
        for (int r = 0; r < mr; r++)
            put(j, m0 + r, g + n, one_sum(p->type) ? acc[r] : acc[r] - mtr[r]);
    }
}

/* Guided scheduling over the N columns: a thread takes the next (untaken) / (2 nt) columns, at
 * least GG_MIN_CHUNK, until none are left. Threads are slowed unevenly (a neighbour on the core,
 * a memory channel), and a static split waits for the slowest; which thread computes a column
 * never changes its bits. Returns the first column taken (>= n: none left), *hi one past the last. */
#define GG_MIN_CHUNK 16
static long next_columns(long *next, long n, int nt, long *hi) {
    long lo = __atomic_load_n(next, __ATOMIC_RELAXED);
    for (;;) {
        if (lo >= n) return lo;
        long c = (n - lo) / (2 * nt);
        if (c < GG_MIN_CHUNK) c = GG_MIN_CHUNK;
        c = (c + GG_PACK - 1) / GG_PACK * GG_PACK; /* packed parts start at multiples of 8 (check) */
        const long h = lo + c < n ? lo + c : n;
        if (__atomic_compare_exchange_n(next, &lo, h, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) { *hi = h; return lo; }
    }
}

static void gg_region(void *ctx, int tid, int nt) {
    gg_job *j = (gg_job *)ctx;
    (void)tid;
    long lo, hi = 0;
    while ((lo = next_columns(&j->next, j->w->out_features, nt, &hi)) < j->w->out_features) {
        for (long m0 = 0; m0 < j->M; m0 += GG_ROWS) { /* the chunk's weights stay in cache across passes */
            const int mr = (int)(j->M - m0 < GG_ROWS ? j->M - m0 : GG_ROWS);
            long g = 0;
            for (int q = 0; q < j->w->nparts; q++) {
                const ss_gpart *p = &j->w->part[q];
                const long a = lo > g ? lo - g : 0, b = hi - g < p->rows ? hi - g : p->rows;
                if (a < b) {
                    switch (mr) { /* constant row counts: the accumulators stay in registers */
                    case 1: part_rows(j, p, g, a, b, m0, 1); break;
                    case 2: part_rows(j, p, g, a, b, m0, 2); break;
                    case 3: part_rows(j, p, g, a, b, m0, 3); break;
                    case 4: part_rows(j, p, g, a, b, m0, 4); break;
                    case 5: part_rows(j, p, g, a, b, m0, 5); break;
                    case 6: part_rows(j, p, g, a, b, m0, 6); break;
                    case 7: part_rows(j, p, g, a, b, m0, 7); break;
                    default: part_rows(j, p, g, a, b, m0, GG_ROWS);
                    }
                }
                g += p->rows;
            }
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
        if (w->part[q].packed && (!packable(w->part[q].type) || w->part[q].rows % 8 || n % 8)) return 2;
        n += w->part[q].rows;
    }
    return n == w->out_features ? 0 : 2;
}

static int quantize_all(long M, long K, const void *x, int x_bf16, const ss_gweight *w, gg_act *a, int vec) {
    const long C = K / 32;
    int legacy = 0, kquant = 0;
    for (int q = 0; q < w->nparts; q++) {
        if (is_k(w->part[q].type)) kquant = 1;
        else if (!is_float(w->part[q].type)) legacy = 1;
    }
    if (legacy) {
        a->xq = (int8_t *)malloc((size_t)(M * K));
        a->sx = (float *)malloc(sizeof(float) * (size_t)(M * C));
        a->xsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * C));
        if (!a->xq || !a->sx || !a->xsum) return 1;
    }
    if (kquant) {
        a->kq = (int8_t *)malloc((size_t)(M * K));
        a->ks = (float *)malloc(sizeof(float) * (size_t)(M * (K / 256)));
        a->kxs = (int16_t *)malloc(sizeof(int16_t) * (size_t)(M * (K / 16)));
        if (!a->kq || !a->ks || !a->kxs) return 1;
    }
    for (long m = 0; m < M; m++) {
        const void *xm = x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K);
        if (legacy) quantize_row(xm, x_bf16, K, 32, a->xq + m * K, a->sx + m * C, NULL, vec);
        if (kquant) quantize_row(xm, x_bf16, K, 256, a->kq + m * K, a->ks + m * (K / 256), a->kxs + m * (K / 16), vec);
    }
    for (long i = 0; legacy && i < M * C; i++) {
        int sum = 0;
        for (int k = 0; k < 32; k++) sum += a->xq[32 * i + k];
        a->xsum[i] = sum;
    }
    return 0;
}

static void free_act(gg_act *a) { free(a->xq); free(a->sx); free(a->kq); free(a->ks); free(a->kxs); free(a->xsum); }

/* activation row m of a for rows of `type`: its xq, sx and xs (dot_ref's arguments) */
static void act_row(const gg_act *a, int type, long m, long K, const int8_t **xq, const float **sx, const int16_t **xs) {
    if (is_k(type)) { *xq = a->kq + m * K; *sx = a->ks + m * (K / 256); *xs = a->kxs + m * (K / 16); }
    else { *xq = a->xq + m * K; *sx = a->sx + m * (K / 32); *xs = NULL; }
}

int selfspec_ggml_types_ok(int type) { int b; return gg_block(type, &b) != 0; }

/* x [M, K] (bf16 or fp32) -> y [M, N] (bf16 or fp32) with w an ss_gweight (see the top) */
int selfspec_ggemm(long M, const void *x, int x_bf16, const void *wd, void *y, int y_bf16, int nthreads) {
    const ss_gweight *w = (const ss_gweight *)wd;
    if (M <= 0) return 0;
    if (check(w)) return 2;
    gg_act a = {0};
    if (quantize_all(M, w->in_features, x, x_bf16, w, &a, 1)) { free_act(&a); return 1; }
#ifdef __AVX2__
    gg_job j = {w, M, w->in_features, a.xq, a.kq, a.xsum, a.sx, a.ks, a.kxs, x, x_bf16, y, y_bf16, 0};
    int nt = ss_threads(nthreads);
    const long work = w->out_features * w->in_features;
    if (work < (1L << 16)) nt = 1;
    if (nt > w->out_features) nt = (int)w->out_features;
    ss_parallel(nt < 1 ? 1 : nt, gg_region, &j);
#else
    (void)nthreads;
    const long K = w->in_features, N = w->out_features;
    for (long m = 0; m < M; m++) {
        long g = 0;
        for (int q = 0; q < w->nparts; q++) {
            const ss_gpart *p = &w->part[q];
            const int8_t *xq; const float *sx; const int16_t *xs;
            act_row(&a, p->type, m, K, &xq, &sx, &xs);
            const void *xm = x_bf16 ? (const void *)((const uint16_t *)x + m * K) : (const void *)((const float *)x + m * K);
            for (long n = 0; n < p->rows; n++) {
                const uint8_t *row = p->data + n * p->row_bytes;
                const float out = is_float(p->type) ? dot_float_ref(p->type, row, K, xm, x_bf16) : dot_ref(p->type, row, K, xq, sx, xs);
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

/* rows [rows, row_bytes] of a legacy type as stored -> dst (as many bytes) in the packed layout
 * (ggml_gemm's "packed blocks"; rows a..b of a part, a % 8 == 0, are its bytes a * row_bytes ..
 * b * row_bytes, so a part can be packed a slice at a time). 0, or 2: not packable here (the type,
 * rows % 8, no AVX2 build). Four bytes (four values of one row) at a time. */
typedef struct { int type; const uint8_t *src; long rows, row_bytes, bytes; uint8_t *dst; } gg_pack_job;

/* groups of eight rows, split over the threads (the copy's first touch: its pages fault in there) */
static void pack_region(void *ctx, int tid, int nt) {
    const gg_pack_job *p = (const gg_pack_job *)ctx;
    const int type = p->type;
    const long bytes = p->bytes, C = p->row_bytes / bytes;
    long g0, g1;
    ss_share(p->rows / 8, tid, nt, &g0, &g1);
    for (long G = g0; G < g1 && type == T_Q4_K; G++)
        for (long sb = 0; sb < C; sb++) { /* C: super-blocks here */
            uint8_t *o = p->dst + (G * C + sb) * 8 * bytes;
            memset(o + 96, 0, 32);
            for (int i = 0; i < 8; i++) {
                const uint8_t *b = p->src + (8 * G + i) * p->row_bytes + sb * bytes;
                uint8_t sc[8], m[8];
                k_scales6(b + 4, sc, m);
                memcpy(o + 2 * i, b, 2);
                memcpy(o + 16 + 2 * i, b + 2, 2);
                for (int c = 0; c < 8; c++) {
                    o[32 + 8 * c + i] = (uint8_t)((sc[c] & 15) | (m[c] & 15) << 4);
                    o[96 + 8 * (c % 4) + i] |= (uint8_t)(((sc[c] >> 4) | (m[c] >> 4) << 2) << (4 * (c / 4)));
                }
                for (int v = 0; v < 32; v++) memcpy(o + 128 + 32 * v + 4 * i, b + 16 + 4 * v, 4);
            }
        }
    for (long G = g0; G < g1 && type == T_Q6_K; G++)
        for (long sb = 0; sb < C; sb++) {
            uint8_t *o = p->dst + (G * C + sb) * 8 * bytes;
            for (int i = 0; i < 8; i++) {
                const uint8_t *b = p->src + (8 * G + i) * p->row_bytes + sb * bytes;
                memcpy(o + 2 * i, b + 208, 2);
                for (int gq = 0; gq < 16; gq++) o[16 + 8 * gq + i] = b[192 + gq];
                uint8_t u[256]; /* the stored 0..63 values of the super-block */
                for (int c = 0; c < 8; c++) {
                    const int h = c / 4, cc = c % 4;
                    const uint8_t *ql = b + 64 * h + 32 * (cc % 2), *qh = b + 128 + 32 * h;
                    for (int l = 0; l < 32; l++)
                        u[32 * c + l] = (uint8_t)(((ql[l] >> (4 * (cc / 2))) & 15) | ((qh[l] >> (2 * cc)) & 3) << 4);
                }
                for (int gq = 0; gq < 16; gq++)
                    for (int t = 0; t < 4; t++) { /* byte 4i + t of each vector: value 16 gq + 4 q + t of row i */
                        const uint8_t u0 = u[16 * gq + t], u1 = u[16 * gq + 4 + t], u2 = u[16 * gq + 8 + t], u3 = u[16 * gq + 12 + t];
                        uint8_t *at = o + 144 + 96 * gq + 4 * i + t;
                        at[0] = (uint8_t)(u0 | (u3 & 3) << 6);
                        at[32] = (uint8_t)(u1 | ((u3 >> 2) & 3) << 6);
                        at[64] = (uint8_t)(u2 | ((u3 >> 4) & 3) << 6);
                    }
            }
        }
    for (long G = g0; G < g1 && is_legacy(type); G++)
        for (long c = 0; c < C; c++) {
            uint8_t *o = p->dst + (G * C + c) * 8 * bytes;
            uint32_t *q = (uint32_t *)(void *)(o + 16), hb[8] = {0};
            for (int i = 0; i < 8; i++) {
                const uint8_t *b = p->src + (8 * G + i) * p->row_bytes + c * bytes;
                memcpy(o + 2 * i, b, 2);
                uint32_t w[8]; /* row i's values 4k..4k+3 as unsigned u = v + offset (IQ4_NL: the nibbles) */
                if (type == T_Q8_0) {
                    memcpy(w, b + 2, 32);
                    for (int k = 0; k < 8; k++) q[8 * k + i] = w[k] ^ 0x80808080u;
                    continue;
                }
                uint32_t qs[4], qh = 0;
                memcpy(qs, b + (type == T_Q5_0 ? 6 : 2), 16);
                if (type == T_Q5_0) memcpy(&qh, b + 2, 4);
                for (int k = 0; k < 4; k++) { w[k] = qs[k] & 0x0F0F0F0Fu; w[k + 4] = (qs[k] >> 4) & 0x0F0F0F0Fu; }
                for (int h = 0; h < 4; h++) q[8 * h + i] = w[2 * h] | w[2 * h + 1] << 4; /* U[2h] low nibbles, U[2h+1] high */
                for (int k = 0; k < 8; k++) hb[k] |= ((qh >> (4 * k)) & 15u) << (4 * i);
            }
            if (type == T_Q5_0) memcpy(o + 16 + 128, hb, 32);
        }
}

int selfspec_ggml_pack(int type, const uint8_t *src, long rows, long row_bytes, uint8_t *dst) {
#ifdef __AVX2__
    const long bytes = is_legacy(type) ? legacy_bytes(type) : type == T_Q4_K ? 144 : type == T_Q6_K ? 210 : 0;
    if (!bytes || rows <= 0 || rows % 8 || row_bytes % bytes) return 2;
    gg_pack_job p = {type, src, rows, row_bytes, bytes, dst};
    int nt = ss_threads(0);
    if (nt > rows / 8) nt = (int)(rows / 8);
    ss_parallel(nt < 1 ? 1 : nt, pack_region, &p);
    return 0;
#else
    (void)type; (void)src; (void)rows; (void)row_bytes; (void)dst;
    return 2;
#endif
}

/* the scalar chain (fp32 x and y): the vector code must match it bit for bit; tests only */
int selfspec_ggemm_ref(long M, const float *x, const void *wd, float *y) {
    const ss_gweight *w = (const ss_gweight *)wd;
    if (check(w)) return 2;
    for (int q = 0; q < w->nparts; q++)
        if (w->part[q].packed) return 2; /* the reference reads the blocks as stored */
    gg_act a = {0};
    if (quantize_all(M, w->in_features, x, 0, w, &a, 0)) { free_act(&a); return 1; }
    const long K = w->in_features, N = w->out_features;
    for (long m = 0; m < M; m++) {
        long g = 0;
        for (int q = 0; q < w->nparts; q++) {
            const ss_gpart *p = &w->part[q];
            const int8_t *xq; const float *sx; const int16_t *xs;
            act_row(&a, p->type, m, K, &xq, &sx, &xs);
            for (long n = 0; n < p->rows; n++) {
                const uint8_t *row = p->data + n * p->row_bytes;
                y[m * N + g + n] = is_float(p->type) ? dot_float_ref(p->type, row, K, x + m * K, 0) : dot_ref(p->type, row, K, xq, sx, xs);
            }
            g += p->rows;
        }
    }
    free_act(&a);
    return 0;
}
