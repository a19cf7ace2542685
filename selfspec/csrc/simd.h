/* 16 fp32 / int32 lanes for the kernels' element-wise code: one AVX-512 register, or two
 * AVX2 registers (x86-64 with AVX2, FMA and F16C: every x86 CPU since ~2013).
 *
 * Every operation here is lane-wise IEEE arithmetic (add, mul, div, fma, min/max, round to
 * nearest even, exact conversions) or exact integer arithmetic, so the AVX2 build computes
 * the very same bits as the AVX-512 build, lane for lane: a chain the kernels document is
 * one chain whatever the ISA. Masks are 16-bit lane sets (bit l = lane l), as AVX-512's.
 *
 * Exceptions, stated where they are: vf_scalef needs an integral n in [-250, 127] and p in
 * [0.5, 2) (every exp here: p = e^r, |r| <= ln2 / 2); max/min follow x86's rule (the second
 * operand when either is NaN), the same on both ISAs; reductions of sums go in GCC's
 * _mm512_reduce_add_ps tree (halves, then quarters, then (0+2, 1+3), then 0+1).
 */
#ifndef SELFSPEC_SIMD_H
#define SELFSPEC_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SS_ALWAYS static inline __attribute__((always_inline))

#ifdef __AMX_TILE__
/* AMX palette 1 tile configuration (64 bytes), loaded with LDTILECFG. Not _tile_loadconfig:
 * GCC 12's tells the compiler it reads 8 bytes, which lets it drop the stores that fill the
 * rest (seen here: a zero configuration, and LDTILECFG's fault). */
typedef struct { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) ss_tilecfg;
SS_ALWAYS void ss_tile_loadconfig(const ss_tilecfg *c) {
    __asm__ volatile("ldtilecfg %0" :: "m"(*c));
}
#endif

/* the first n of 16 lanes (n >= 16: all) */
SS_ALWAYS uint16_t lanes16(long n) {
    return n >= 16 ? (uint16_t)0xFFFF : n <= 0 ? 0 : (uint16_t)((1u << n) - 1);
}

#ifdef __AVX512F__
/* ---- AVX-512: one register --------------------------------------------------------- */
typedef __m512 vf16;
typedef __m512i vi16;
typedef __mmask16 m16;

SS_ALWAYS vf16 vf_zero(void) { return _mm512_setzero_ps(); }
SS_ALWAYS vf16 vf_set1(float a) { return _mm512_set1_ps(a); }
SS_ALWAYS vf16 vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
SS_ALWAYS vf16 vf_maskz_loadu(m16 k, const float *p) { return _mm512_maskz_loadu_ps(k, p); }
SS_ALWAYS vf16 vf_mask_loadu(vf16 src, m16 k, const float *p) { return _mm512_mask_loadu_ps(src, k, p); }
SS_ALWAYS void vf_storeu(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
SS_ALWAYS void vf_mask_storeu(float *p, m16 k, vf16 v) { _mm512_mask_storeu_ps(p, k, v); }
SS_ALWAYS vf16 vf_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
SS_ALWAYS vf16 vf_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
SS_ALWAYS vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
SS_ALWAYS vf16 vf_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
SS_ALWAYS vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }    /* a b + c */
SS_ALWAYS vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); }  /* -a b + c */
SS_ALWAYS vf16 vf_min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
SS_ALWAYS vf16 vf_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
SS_ALWAYS vf16 vf_abs(vf16 a) { return _mm512_abs_ps(a); }
SS_ALWAYS vf16 vf_round(vf16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
SS_ALWAYS vf16 vf_scalef(vf16 p, vf16 n) { return _mm512_scalef_ps(p, n); }
SS_ALWAYS float vf_reduce_max(vf16 a) { return _mm512_reduce_max_ps(a); }
SS_ALWAYS float vf_reduce_min(vf16 a) { return _mm512_reduce_min_ps(a); }
SS_ALWAYS float vf_reduce_add(vf16 a) { return _mm512_reduce_add_ps(a); }
SS_ALWAYS float vf_lane0(vf16 a) { return _mm512_cvtss_f32(a); }
SS_ALWAYS m16 vf_cmp_ge(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
SS_ALWAYS m16 vf_cmp_gt(vf16 a, vf16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
SS_ALWAYS vf16 vf_maskz_mov(m16 k, vf16 a) { return _mm512_maskz_mov_ps(k, a); }
SS_ALWAYS vf16 vf_mask_add(vf16 src, m16 k, vf16 a, vf16 b) { return _mm512_mask_add_ps(src, k, a, b); }
SS_ALWAYS vf16 vf_mask_min(vf16 src, m16 k, vf16 a, vf16 b) { return _mm512_mask_min_ps(src, k, a, b); }
SS_ALWAYS vf16 vf_mask_max(vf16 src, m16 k, vf16 a, vf16 b) { return _mm512_mask_max_ps(src, k, a, b); }
/* the lanes of k, in order, to xs[0..] and base + lane to ids[0..]; returns how many */
SS_ALWAYS int vf_compress_store(float *xs, int32_t *ids, m16 k, vf16 x, int32_t base) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int nk = __builtin_popcount(k);
    m16 head = lanes16(nk);  /* register compress + masked store (the memory form of vcompress is slow on AMD) */
    _mm512_mask_storeu_ps(xs, head, _mm512_maskz_compress_ps(k, x));
    _mm512_mask_storeu_epi32(ids, head, _mm512_maskz_compress_epi32(k, _mm512_add_epi32(iota, _mm512_set1_epi32(base))));
    return nk;
}
/* 16 bf16 / fp16 (masked lanes read as 0, never touched in memory) -> fp32, exactly */
SS_ALWAYS vf16 vf_load_bf16(const uint16_t *p, m16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
SS_ALWAYS vf16 vf_load_h16(const uint16_t *p, m16 k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }

SS_ALWAYS vi16 vi_zero(void) { return _mm512_setzero_si512(); }
SS_ALWAYS vi16 vi_add(vi16 a, vi16 b) { return _mm512_add_epi32(a, b); }
SS_ALWAYS vi16 vi_from_f(vf16 a) { return _mm512_cvtps_epi32(a); }  /* a integral: exact */
SS_ALWAYS vf16 vf_from_i(vi16 a) { return _mm512_cvtepi32_ps(a); }
SS_ALWAYS int32_t vi_reduce_add(vi16 a) { return _mm512_reduce_add_epi32(a); }
SS_ALWAYS void vi_store_i8(int8_t *p, vi16 a) { _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(a)); }  /* |a| <= 127 */

#else
/* ---- AVX2: two registers, lanes 0-7 in lo, 8-15 in hi -------------------------------- */
typedef struct { __m256 lo, hi; } vf16;
typedef struct { __m256i lo, hi; } vi16;
typedef uint16_t m16;

/* lanes of an 8-bit set as an AVX2 mask vector (all ones where set) */
SS_ALWAYS __m256i ss_mask8(unsigned bits) {
    const __m256i b = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), b), b);
}
#define SS_PAIR(expr_lo, expr_hi) do { r.lo = (expr_lo); r.hi = (expr_hi); } while (0)

SS_ALWAYS vf16 vf_zero(void) { vf16 r; SS_PAIR(_mm256_setzero_ps(), _mm256_setzero_ps()); return r; }
SS_ALWAYS vf16 vf_set1(float a) { vf16 r; SS_PAIR(_mm256_set1_ps(a), _mm256_set1_ps(a)); return r; }
SS_ALWAYS vf16 vf_loadu(const float *p) { vf16 r; SS_PAIR(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); return r; }
SS_ALWAYS vf16 vf_maskz_loadu(m16 k, const float *p) {
    if (k == 0xFFFF) return vf_loadu(p);
    vf16 r;  /* vmaskmovps: masked-out lanes read 0 and never fault */
    SS_PAIR(_mm256_maskload_ps(p, ss_mask8(k & 0xFF)), _mm256_maskload_ps(p + 8, ss_mask8(k >> 8)));
    return r;
}
SS_ALWAYS vf16 vf_mask_loadu(vf16 src, m16 k, const float *p) {
    vf16 v = vf_maskz_loadu(k, p), r;
    SS_PAIR(_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(ss_mask8(k & 0xFF))),
            _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(ss_mask8(k >> 8))));
    return r;
}
SS_ALWAYS void vf_storeu(float *p, vf16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
SS_ALWAYS void vf_mask_storeu(float *p, m16 k, vf16 v) {
    if (k == 0xFFFF) { vf_storeu(p, v); return; }
    _mm256_maskstore_ps(p, ss_mask8(k & 0xFF), v.lo);
    _mm256_maskstore_ps(p + 8, ss_mask8(k >> 8), v.hi);
}
#define SS_BINARY(name, op) \
    SS_ALWAYS vf16 name(vf16 a, vf16 b) { vf16 r; SS_PAIR(op(a.lo, b.lo), op(a.hi, b.hi)); return r; }
SS_BINARY(vf_add, _mm256_add_ps)
SS_BINARY(vf_sub, _mm256_sub_ps)
SS_BINARY(vf_mul, _mm256_mul_ps)
SS_BINARY(vf_div, _mm256_div_ps)
SS_BINARY(vf_min, _mm256_min_ps)
SS_BINARY(vf_max, _mm256_max_ps)
#undef SS_BINARY
SS_ALWAYS vf16 vf_fmadd(vf16 a, vf16 b, vf16 c) {
    vf16 r; SS_PAIR(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); return r;
}
SS_ALWAYS vf16 vf_fnmadd(vf16 a, vf16 b, vf16 c) {
    vf16 r; SS_PAIR(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)); return r;
}
SS_ALWAYS vf16 vf_abs(vf16 a) {
    const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    vf16 r; SS_PAIR(_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)); return r;
}
SS_ALWAYS vf16 vf_round(vf16 a) {
    vf16 r;
    SS_PAIR(_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return r;
}
/* p 2^n (p in [0.5, 2), integral n in [-250, 127]) rounded once, as vscalefps: for n >= -125,
 * 2^n is a normal float and p 2^n the one rounding; below, p 2^(n + 125) is exact (normal) and
 * times 2^-125 the one rounding of a subnormal result */
SS_ALWAYS __m256 ss_pow2(__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); }
SS_ALWAYS __m256 ss_scalef8(__m256 p, __m256 n) {
    __m256i e = _mm256_cvtps_epi32(n);
    __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(-125), e);
    __m256 t = _mm256_mul_ps(p, ss_pow2(_mm256_add_epi32(e, _mm256_and_si256(low, _mm256_set1_epi32(125)))));
    return _mm256_blendv_ps(t, _mm256_mul_ps(t, _mm256_set1_ps(0x1p-125f)), _mm256_castsi256_ps(low));
}
SS_ALWAYS vf16 vf_scalef(vf16 p, vf16 n) { vf16 r; SS_PAIR(ss_scalef8(p.lo, n.lo), ss_scalef8(p.hi, n.hi)); return r; }
SS_ALWAYS float vf_reduce_max(vf16 a) {
    float l[16], m;
    vf_storeu(l, a);
    m = l[0];
    for (int i = 1; i < 16; i++) m = l[i] > m ? l[i] : m;
    return m;
}
SS_ALWAYS float vf_reduce_min(vf16 a) {
    float l[16], m;
    vf_storeu(l, a);
    m = l[0];
    for (int i = 1; i < 16; i++) m = l[i] < m ? l[i] : m;
    return m;
}
SS_ALWAYS float vf_reduce_add(vf16 a) {  /* GCC's _mm512_reduce_add_ps tree */
    __m256 t3 = _mm256_add_ps(a.hi, a.lo);
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1)));
}
SS_ALWAYS float vf_lane0(vf16 a) { return _mm256_cvtss_f32(a.lo); }
SS_ALWAYS m16 ss_movemask(__m256 lo, __m256 hi) {
    return (m16)((unsigned)_mm256_movemask_ps(lo) | ((unsigned)_mm256_movemask_ps(hi) << 8));
}
SS_ALWAYS m16 vf_cmp_ge(vf16 a, vf16 b) {
    return ss_movemask(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ));
}
SS_ALWAYS m16 vf_cmp_gt(vf16 a, vf16 b) {
    return ss_movemask(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ));
}
SS_ALWAYS vf16 vf_maskz_mov(m16 k, vf16 a) {
    vf16 r;
    SS_PAIR(_mm256_and_ps(a.lo, _mm256_castsi256_ps(ss_mask8(k & 0xFF))), _mm256_and_ps(a.hi, _mm256_castsi256_ps(ss_mask8(k >> 8))));
    return r;
}
SS_ALWAYS vf16 ss_blend(vf16 src, m16 k, vf16 v) {
    vf16 r;
    SS_PAIR(_mm256_blendv_ps(src.lo, v.lo, _mm256_castsi256_ps(ss_mask8(k & 0xFF))),
            _mm256_blendv_ps(src.hi, v.hi, _mm256_castsi256_ps(ss_mask8(k >> 8))));
    return r;
}
SS_ALWAYS vf16 vf_mask_add(vf16 src, m16 k, vf16 a, vf16 b) { return ss_blend(src, k, vf_add(a, b)); }
SS_ALWAYS vf16 vf_mask_min(vf16 src, m16 k, vf16 a, vf16 b) { return ss_blend(src, k, vf_min(a, b)); }
SS_ALWAYS vf16 vf_mask_max(vf16 src, m16 k, vf16 a, vf16 b) { return ss_blend(src, k, vf_max(a, b)); }
SS_ALWAYS int vf_compress_store(float *xs, int32_t *ids, m16 k, vf16 x, int32_t base) {
    float l[16];
    int c = 0;
    vf_storeu(l, x);
    for (; k; k &= (m16)(k - 1), c++) {
        int i = __builtin_ctz(k);
        xs[c] = l[i];
        ids[c] = base + i;
    }
    return c;
}
/* 16 bf16 / fp16 -> fp32 (exact); a partial mask copies the lanes it names only */
SS_ALWAYS __m256i ss_load_u16x16(const uint16_t *p, m16 k) {
    if (k == 0xFFFF) return _mm256_loadu_si256((const __m256i *)p);
    uint16_t t[16] = {0};
    for (int i = 0; i < 16; i++) if (k >> i & 1) t[i] = p[i];
    return _mm256_loadu_si256((const __m256i *)t);
}
SS_ALWAYS vf16 vf_load_bf16(const uint16_t *p, m16 k) {
    __m256i h = ss_load_u16x16(p, k);
    vf16 r;
    SS_PAIR(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16)),
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16)));
    return r;
}
SS_ALWAYS vf16 vf_load_h16(const uint16_t *p, m16 k) {
    __m256i h = ss_load_u16x16(p, k);
    vf16 r; SS_PAIR(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    return r;
}

SS_ALWAYS vi16 vi_zero(void) { vi16 r; SS_PAIR(_mm256_setzero_si256(), _mm256_setzero_si256()); return r; }
SS_ALWAYS vi16 vi_add(vi16 a, vi16 b) { vi16 r; SS_PAIR(_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)); return r; }
SS_ALWAYS vi16 vi_from_f(vf16 a) { vi16 r; SS_PAIR(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)); return r; }
SS_ALWAYS vf16 vf_from_i(vi16 a) { vf16 r; SS_PAIR(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); return r; }
SS_ALWAYS int32_t vi_reduce_add(vi16 a) {
    int32_t l[8], s = 0;
    _mm256_storeu_si256((__m256i *)l, _mm256_add_epi32(a.lo, a.hi));
    for (int i = 0; i < 8; i++) s += l[i];
    return s;
}
SS_ALWAYS void vi_store_i8(int8_t *p, vi16 a) {  /* |a| <= 127: the saturating packs are exact */
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);  /* 16 int16 in lane order */
    __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i *)p, b);
}
#undef SS_PAIR
#endif

#endif
