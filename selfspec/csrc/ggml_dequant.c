/* GGUF blocks (llama.cpp's ggml formats) to fp32, as stored: F16, BF16, Q4_0, Q5_0, Q8_0, Q4_K,
 * Q5_K, Q6_K. The same bits as the gguf package's numpy dequantizer (gguf.quants.dequantize;
 * tests/test_gguf_dequant.py): every scale is one fp32 product (d * sub-block scale), every
 * value one more (scale * q), K-quants' offsets one fp32 subtraction after it, never fused:
 * this file is compiled without contraction into FMAs.
 *
 * Block layouts (little-endian; d, dmin fp16; a "super-block" is 256 values):
 *   Q4_0 (32 values, 18 B): d, qs[16]; value j < 16 is qs[j] & 15, j >= 16 is qs[j-16] >> 4; d * (q - 8)
 *   Q5_0 (32, 22 B): d, qh (u32), qs[16]; as Q4_0 plus bit j of qh as bit 4; d * (q - 16)
 *   Q8_0 (32, 34 B): d, int8 q[32]; d * q
 *   Q4_K (256, 144 B): d, dmin, scales[12] (eight 6-bit scales and mins), qs[128]; sub-block s of
 *        32: nibble s & 1 of qs[32 (s / 2) + l]; (d * sc[s]) * q - (dmin * m[s])
 *   Q5_K (256, 176 B): d, dmin, scales[12], qh[32], qs[128]; as Q4_K plus bit s of qh[l] as bit 4
 *   Q6_K (256, 210 B): ql[128], qh[64], int8 scales[16], d; value 128 h + r: low 4 bits
 *        ql[64 h + r % 64] >> 4 (r / 64), high 2 bits qh[32 h + r % 32] >> 2 (r / 32);
 *        (d * scales[(128 h + r) / 16]) * (q - 32)
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include "pool.h"

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static void dq_q4_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 15) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void dq_q5_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int h0 = (int)((qh >> j) & 1), h1 = (int)((qh >> (j + 16)) & 1);
        y[j] = d * (float)(((qs[j] & 15) | (h0 << 4)) - 16);
        y[j + 16] = d * (float)(((qs[j] >> 4) | (h1 << 4)) - 16);
    }
}

static void dq_q8_0(const uint8_t *b, float *y) {
    const float d = h2f(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

/* the eight 6-bit scales and mins of Q4_K / Q5_K */
static void k_scales(const uint8_t *s, uint8_t *sc, uint8_t *m) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[4 + j] & 63;
        sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 2) & 0x30);
        m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

static void dq_q45_k(const uint8_t *b, float *y, int five) {
    const float d = h2f(b), dmin = h2f(b + 2);
    uint8_t sc[8], m[8];
    k_scales(b + 4, sc, m);
    const uint8_t *qh = b + 16, *qs = five ? b + 48 : b + 16;
    for (int s = 0; s < 8; s++) {
        const float ds = d * (float)sc[s], ms = dmin * (float)m[s];
        const uint8_t *q = qs + 32 * (s / 2);
        const int shift = 4 * (s & 1);
        for (int l = 0; l < 32; l++) {
            int v = (q[l] >> shift) & 15;
            if (five) v |= ((qh[l] >> s) & 1) << 4;
            y[32 * s + l] = ds * (float)v - ms;
        }
    }
}

static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 128; r++) {
            const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
            const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
            const int e = 128 * h + r;
            y[e] = (d * (float)sc[e / 16]) * (float)((lo | (hi << 4)) - 32);
        }
}

/* values per block and bytes per block of a type; 0 where not handled here */
static int block_shape(int type, int *bytes) {
    switch (type) {
    case T_F32: *bytes = 4; return 1;
    case T_F16: case T_BF16: *bytes = 2; return 1;
    case T_Q4_0: *bytes = 18; return 32;
    case T_Q5_0: *bytes = 22; return 32;
    case T_Q8_0: *bytes = 34; return 32;
    case T_Q4_K: *bytes = 144; return 256;
    case T_Q5_K: *bytes = 176; return 256;
    case T_Q6_K: *bytes = 210; return 256;
    default: return 0;
    }
}

static void dq_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case T_F32: memcpy(y, b, 4); break;
    case T_F16: *y = h2f(b); break;
    case T_BF16: { uint32_t u = (uint32_t)(b[0] | (b[1] << 8)) << 16; memcpy(y, &u, 4); } break;
    case T_Q4_0: dq_q4_0(b, y); break;
    case T_Q5_0: dq_q5_0(b, y); break;
    case T_Q8_0: dq_q8_0(b, y); break;
    case T_Q4_K: dq_q45_k(b, y, 0); break;
    case T_Q5_K: dq_q45_k(b, y, 1); break;
    case T_Q6_K: dq_q6_k(b, y); break;
    }
}

typedef struct { int type, values, bytes; long n; const uint8_t *src; float *dst; } dq_job;

static void dq_task(void *ctx, int tid, int nt) {
    const dq_job *j = (const dq_job *)ctx;
    long lo, hi;
    ss_share(j->n, tid, nt, &lo, &hi);
    for (long i = lo; i < hi; i++) dq_block(j->type, j->src + i * j->bytes, j->dst + i * j->values);
}

int selfspec_ggml_block(int type, int *bytes) { return block_shape(type, bytes); }

/* n_blocks blocks of `type` at src -> n_blocks * values fp32 at dst; returns 0, or 2 for a type
 * not handled here. Blocks are split among the pool's threads (the bits do not depend on it). */
int selfspec_ggml_dequant(int type, const uint8_t *src, long n_blocks, float *dst, int threads) {
    int bytes;
    const int values = block_shape(type, &bytes);
    if (!values) return 2;
    dq_job j = {type, values, bytes, n_blocks, src, dst};
    ss_parallel(n_blocks < 4096 ? 1 : ss_threads(threads), dq_task, &j);
    return 0;
}
