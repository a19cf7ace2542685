/* Gumbel noise keyed by (seed, position, token), and the Gumbel-max pick of one row: the
 * sampling rule that makes a seed one text (selfspec/coupling.py, Gumbel-max coupling;
 * its torch implementation, gumbel_noise_torch, computes the very same bits).
 *
 * Bits: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11), counter (t / 4, pos lo, pos hi,
 *   DOMAIN), key (seed lo, seed hi); token t takes word t % 4 of its counter's output b.
 * Noise, fp32, every operation a separate IEEE one (no fma: fp-contract off; no library
 *   function), so the same bits on any ISA, vectorised or not, and in torch:
 *     w = (b + 1/2) 2^-32 as fp32 (2^-24 floor(b / 2^8) plus 2^-32 (b mod 2^8 + 1/2): one
 *         rounding), at most 1 - 2^-24                        uniform in (0, 1)
 *     E = -log(1 - w)                                         Exp(1); for w < 1/16 by its series
 *                                                             w (1 + w/2 + ... + w^7/8), which keeps full
 *                                                             relative precision where E is small: the
 *                                                             noise of tokens that win against the odds
 *     g = -log(E)                                             standard Gumbel, in [-2.82, 22.88]
 *   log is Cephes' logf (frexp reduction to [sqrt(1/2), sqrt(2)), degree-8 polynomial, ~1 ulp).
 * Pick: argmax_j fl(x_j + g(seed, pos, token_j)) over the support {x_j >= tau, x_j finite},
 *   x_j = l_j / T (fp32 division, as the distribution's), ties to the lowest j. Exact, and
 *   cheap on a whole vocabulary: an entry with fl(x_j + GMAX) < the best score so far cannot
 *   win (g <= GMAX, rounding is monotone) and is passed over; the rest get their bits, and
 *   logarithms only where the bits leave them a chance (score_chunk).
 */
#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define PH_M0 0xD2511F53u
#define PH_M1 0xCD9E8D57u
#define PH_W0 0x9E3779B9u
#define PH_W1 0xBB67AE85u
#define DOMAIN 0x47756D62u /* "Gumb": this counter space is the Gumbel noise's */
#define GMAX 23.0f         /* > every g (w >= 2^-33: E >= 1.16e-10, g <= 22.88) */
#define CHUNK 512          /* candidates collected before they are scored */

static inline void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
#pragma GCC unroll 10
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)PH_M0 * c[0], p1 = (uint64_t)PH_M1 * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[0] = n0; c[1] = (uint32_t)p1; c[2] = n2; c[3] = (uint32_t)p0;
        k0 += PH_W0; k1 += PH_W1;
    }
}

/* the raw generator, for known-answer tests: out = Philox4x32-10(ctr, key) */
void selfspec_philox4x32(const uint32_t *ctr, const uint32_t *key, uint32_t *out) {
    uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    philox4x32_10(c, key[0], key[1]);
    memcpy(out, c, sizeof(c));
}

/* 8 lanes at a time in GCC's vector extensions: integer and IEEE lane-wise operations only,
 * the same bits as the scalar code they spell out (AVX-512, AVX2: the compiler's choice) */
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));

static inline f32x8 sel(i32x8 mask, f32x8 a, f32x8 b) {  /* mask lanes all ones: a, else b */
    return (f32x8)(((i32x8)a & mask) | ((i32x8)b & ~mask));
}
static inline f32x8 fill(float v) { return (f32x8){v, v, v, v, v, v, v, v}; }

/* log(y) for normal, finite y > 0 (Cephes logf) */
static inline f32x8 log_v(f32x8 y) {
    i32x8 bits = (i32x8)y;
    i32x8 e = ((bits >> 23) & 0xFF) - 126;                    /* y = m 2^e, m in [0.5, 1) */
    f32x8 m = (f32x8)((bits & 0x007FFFFF) | 0x3F000000);
    i32x8 low = m < fill(0.707106781186547524f);
    f32x8 f = sel(low, (m + m) - 1.0f, m - 1.0f);             /* exact */
    f32x8 fe = __builtin_convertvector(e + low, f32x8);       /* low lanes: e - 1 (low is -1 there) */
    f32x8 z = f * f;
    f32x8 p = fill(7.0376836292E-2f);
    p = p * f + -1.1514610310E-1f;
    p = p * f + 1.1676998740E-1f;
    p = p * f + -1.2420140846E-1f;
    p = p * f + 1.4249322787E-1f;
    p = p * f + -1.6668057665E-1f;
    p = p * f + 2.0000714765E-1f;
    p = p * f + -2.4999993993E-1f;
    p = p * f + 3.3333331174E-1f;
    p = p * f * z;
    p = p + fe * -2.12194440E-4f;
    p = p + -0.5f * z;
    f32x8 r = f + p;
    return r + fe * 0.693359375f;
}

/* the noise of 8 words of bits (module doc) */
static inline f32x8 gumbel_v(u32x8 b) {
    f32x8 hi = __builtin_convertvector((i32x8)(b >> 8), f32x8);     /* exact: < 2^24 */
    f32x8 lo = __builtin_convertvector((i32x8)(b & 0xFF), f32x8) + 0.5f;
    f32x8 w = hi * 0x1p-24f + lo * 0x1p-32f;                          /* (b + 1/2) 2^-32, one rounding */
    f32x8 top = fill(0x1.fffffep-1f);
    w = sel(w < top, w, top);
    f32x8 s = fill(0.125f);                                           /* the series, Horner from w^7/8 */
    s = s * w + 0.142857142857142857f;
    s = s * w + 0.166666666666666667f;
    s = s * w + 0.2f;
    s = s * w + 0.25f;
    s = s * w + 0.333333333333333333f;
    s = s * w + 0.5f;
    s = s * w + 1.0f;
    f32x8 E = sel(w < 0.0625f, s * w, -log_v(1.0f - w));
    return -log_v(E);
}

/* (a mod 2^32) m in 64 bits, lane-wise: VPMULUDQ (GCC's own choice, VPMULLQ, is ~3x slower) */
static inline u64x8 mul32(u64x8 a, uint32_t m) {
#ifdef __AVX512F__
    return (u64x8)_mm512_mul_epu32((__m512i)a, _mm512_set1_epi64(m));
#else
    __m256i h[2];
    memcpy(h, &a, sizeof(h));
    h[0] = _mm256_mul_epu32(h[0], _mm256_set1_epi64x(m));
    h[1] = _mm256_mul_epu32(h[1], _mm256_set1_epi64x(m));
    memcpy(&a, h, sizeof(h));
    return a;
#endif
}

/* Philox4x32-10 of 8 counters (c0, plo, phi, DOMAIN), 32-bit words in 64-bit lanes: all four
 * words of each into w[0..3] */
static inline void philox_v(uint32_t k0, uint32_t k1, uint32_t plo, uint32_t phi, u64x8 c0, u64x8 w[4]) {
    const uint64_t lo32 = 0xFFFFFFFFu;
    u64x8 c1 = c0 * 0 + plo, c2 = c0 * 0 + phi, c3 = c0 * 0 + DOMAIN;
#pragma GCC unroll 10
    for (int r = 0; r < 10; r++) {
        u64x8 p0 = mul32(c0, PH_M0), p1 = mul32(c2, PH_M1);
        c0 = (p1 >> 32) ^ c1 ^ k0;
        c2 = (p0 >> 32) ^ c3 ^ k1;
        c1 = p1 & lo32;
        c3 = p0 & lo32;
        k0 += PH_W0; k1 += PH_W1;
    }
    w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}

/* Philox4x32-10 of 8 counters (c0, plo, phi, DOMAIN), 32-bit words in 64-bit lanes: the word
 * t % 4 of each */
static inline u32x8 bits_v(uint32_t k0, uint32_t k1, uint32_t plo, uint32_t phi, u64x8 c0, u64x8 word) {
    u64x8 c[4];
    philox_v(k0, k1, plo, phi, c0, c);
    u64x8 w0 = (u64x8)(word == 0), w1 = (u64x8)(word == 1), w2 = (u64x8)(word == 2);
    return __builtin_convertvector((c[0] & w0) | (c[1] & w1) | (c[2] & w2) | (c[3] & ~(w0 | w1 | w2)), u32x8);
}

/* 8 tokens of tokens[i..n) as counters and words (lanes past n: token 0) */
static inline void load_tokens(const int64_t *tokens, long i, long n, u64x8 *c0, u64x8 *word) {
    u64x8 t;
    if (i + 8 <= n) memcpy(&t, tokens + i, sizeof(t));
    else for (int j = 0; j < 8; j++) t[j] = i + j < n ? (uint64_t)tokens[i + j] : 0;
    *c0 = (t >> 2) & 0xFFFFFFFFu;
    *word = t & 3;
}

typedef struct { uint32_t k0, k1, plo, phi; } nkey_t;

static inline nkey_t key_of(uint64_t seed, int64_t pos) {
    return (nkey_t){(uint32_t)seed, (uint32_t)(seed >> 32), (uint32_t)pos, (uint32_t)((uint64_t)pos >> 32)};
}

/* g(seed, pos, tokens[i]) -> g[i], i < n */
void selfspec_gumbel_noise(uint64_t seed, int64_t pos, const int64_t *tokens, long n, float *g) {
    nkey_t k = key_of(seed, pos);
    for (long i = 0; i < n; i += 8) {
        u64x8 c0, word;
        load_tokens(tokens, i, n, &c0, &word);
        f32x8 v = gumbel_v(bits_v(k.k0, k.k1, k.plo, k.phi, c0, word));
        if (i + 8 <= n) memcpy(g + i, &v, sizeof(v));
        else for (int j = 0; i + j < n; j++) g[i + j] = v[j];
    }
}

typedef struct { float s; long j; } best_t;  /* the best score so far and its entry (-1: none) */

static inline void consider(best_t *b, float s, long j) {
    if (b->j < 0 || s > b->s || (s == b->s && j < b->j)) { b->s = s; b->j = j; }
}

/* Candidates (entries ent, values xs, tokens tok; n of them) against the best score *b.
 * One at d = best - x wins only with g >= d, i.e. E <= e^-d. Its bits alone bound E from
 * below: E >= w (the series is w times a sum >= 1; -log(1 - w) >= w) and w >= 2^-24 hb,
 * hb = floor(b / 2^8) (w's first part). So where 2^-24 hb > e^-d (with d less its rounding,
 * a slack of 0.01 in log2, and d > 3, past the log branch's g <= 2.75), the candidate cannot
 * win and needs no logarithm: of the candidates at d only a share ~e^-d gets them. */
/* lanes of scores x + g (g: the noise of bits) that may reach best: all but those whose bits
 * prove g < best - x (below) */
static inline i32x8 may_reach(f32x8 x, u32x8 bits, float best_s) {
    f32x8 best = fill(best_s);
    f32x8 ax = sel(x < 0.0f, -x, x), ab = sel(best < 0.0f, -best, best);
    f32x8 d = (best - x) - (ab + ax + 1.0f) * 0x1p-18f;            /* at most d, surely */
    i32x8 hb = (i32x8)(bits >> 8);
    f32x8 fh = __builtin_convertvector(hb, f32x8);                  /* exact: < 2^24 */
    f32x8 lg = __builtin_convertvector((((i32x8)fh >> 23) & 0xFF) - 127, f32x8);  /* floor(log2 hb) */
    i32x8 out = (d > 3.0f) & (hb > 0) & (lg > d * -1.44269504f + 24.01f);
    return ~out & (x > -INFINITY);
}

static void score_chunk(nkey_t k, const int32_t *ent, const float *xs, const int64_t *tok, long n, best_t *b) {
    for (long i = 0; i < n; i += 8) {
        u64x8 c0, word;
        load_tokens(tok, i, n, &c0, &word);
        u32x8 bits = bits_v(k.k0, k.k1, k.plo, k.phi, c0, word);
        f32x8 x = fill(-INFINITY);
        if (i + 8 <= n) memcpy(&x, xs + i, sizeof(x));
        else for (int j = 0; i + j < n; j++) x[j] = xs[i + j];
        i32x8 live = may_reach(x, bits, b->s);
        if (!(live[0] | live[1] | live[2] | live[3] | live[4] | live[5] | live[6] | live[7])) continue;
        f32x8 s = x + gumbel_v(bits);
        for (int j = 0; j < 8; j++)
            if (live[j]) consider(b, s[j], ent[i + j]);
    }
}

/* The Gumbel-max pick of one row (module doc): l [n] logits, T temperature (1: no division),
 * support {x >= tau} (tau = -FLT_MAX: every finite entry), ids [n] the entries' token ids (NULL:
 * entry j is token j). Returns the entry, -1 when the support is empty, -2 when out of memory;
 * *score (nullable) gets its score. */
long selfspec_gumbel_pick(const float *l, long n, float T, float tau, const int64_t *ids, uint64_t seed, int64_t pos,
                          float *score) {
    int div = T != 1.0f;
    nkey_t k = key_of(seed, pos);
    best_t b = {-INFINITY, -1};
    /* the largest x in the support (its first entry): its score is the first bound */
    vf16 vt = vf_set1(tau), vT = vf_set1(T), vg = vf_set1(GMAX), vinf = vf_set1(INFINITY), vm = vf_set1(-INFINITY);
    for (long i = 0; i < n; i += 16) {
        m16 mk = lanes16(n - i);
        vf16 x = vf_mask_loadu(vf_set1(-INFINITY), mk, l + i);
        if (div) x = vf_div(x, vT);
        vm = vf_mask_max(vm, vf_cmp_ge(x, vt) & vf_cmp_gt(vinf, x) & mk, vm, x);
    }
    float m = vf_reduce_max(vm);
    long jm = -1;
    for (long i = 0; m > -INFINITY && i < n; i++)
        if ((div ? l[i] / T : l[i]) == m) { jm = i; break; }
    if (jm < 0) return -1;
    int64_t t0 = ids ? ids[jm] : jm;
    float g0;
    selfspec_gumbel_noise(seed, pos, &t0, 1, &g0);
    consider(&b, m + g0, jm);
    int32_t *ent = (int32_t *)malloc(sizeof(int32_t) * (CHUNK + 16));
    float *xs = (float *)malloc(sizeof(float) * (CHUNK + 16));
    int64_t *tok = (int64_t *)malloc(sizeof(int64_t) * (CHUNK + 16));
    if (!ent || !xs || !tok) { free(ent); free(xs); free(tok); return -2; }
    long c = 0;
    for (long i = 0; i < n; i += 16) {
        m16 mk = lanes16(n - i);
        vf16 x = vf_mask_loadu(vf_set1(-INFINITY), mk, l + i);
        if (div) x = vf_div(x, vT);
        /* in the support, finite, and not surely below the best: fl(x + GMAX) >= best */
        m16 in = vf_cmp_ge(x, vt) & vf_cmp_gt(vinf, x) & vf_cmp_ge(vf_add(x, vg), vf_set1(b.s)) & mk;
        if (!in) continue;
        c += vf_compress_store(xs + c, ent + c, in, x, (int32_t)i);
        if (c >= CHUNK || i + 16 >= n) {
            for (long j = 0; j < c; j++) tok[j] = ids ? ids[ent[j]] : ent[j];
            score_chunk(k, ent, xs, tok, c, &b);
            c = 0;
        }
    }
    if (c) {
        for (long j = 0; j < c; j++) tok[j] = ids ? ids[ent[j]] : ent[j];
        score_chunk(k, ent, xs, tok, c, &b);
    }
    free(ent); free(xs); free(tok);
    if (score) *score = b.s;
    return b.j;
}

/* collected entries (out, their upper scores us; n of them) whose upper score reaches thr, kept in order */
static long keep_reaching(int32_t *out, float *us, long n, float thr) {
    long c = 0;
    for (long i = 0; i < n; i++)
        if (us[i] >= thr) { out[c] = out[i]; us[c] = us[i]; c++; }
    return c;
}

/* The screened Gumbel-max pick's candidates from bounds lo [n] <= logits <= up [n] (finite;
 * entry j is token j): with su_j = fl(fl(up_j / T) + g_j), sl_j the same of lo_j (T 1: no
 * division) and thr = max_j sl_j, the entries {j : su_j >= thr} in increasing j into out (at
 * most cap) and su_j into us; *thr_out = thr. One pass: thr runs up as lower scores are seen
 * (every value it takes is some sl_j, so at most the final thr), and an entry is dropped only
 * when its upper score is surely below the running thr: fl(x + GMAX) < thr, or its bits bound
 * its noise below thr - x (may_reach). On a language model's row most of the vocabulary is within
 * GMAX of thr, so the pass takes 32 entries at a time, the four words of each of 8 Philox
 * counters (the four tokens of a counter share its one call; a block with no entry within GMAX
 * makes none); i0 is a multiple of 4. The token of the largest sl is never dropped (its su >=
 * sl >= any running thr), so thr ends at max sl and the set is exactly {su >= max sl}, however
 * the entries are split among threads (each runs its share [i0, n), then csrc/screen.c's
 * selfspec_gumbel_reach merges the shares: gumbel.c builds alone, without the pool).
 * Returns how many (cap + 1: more than cap), -1 when lo has no finite entry, -2 when out of
 * memory. */
long selfspec_gumbel_reach_range(const float *lo, const float *up, long i0, long n, float T, uint64_t seed, int64_t pos, int32_t *out,
                        float *us, long cap, float *thr_out) {
    int div = T != 1.0f;
    nkey_t k = key_of(seed, pos);
    *thr_out = -INFINITY;
    vf16 vm = vf_set1(-INFINITY), vinf = vf_set1(INFINITY), vT0 = vf_set1(T);
    for (long i = i0; i < n; i += 16) {  /* the first bound: the lower score of the largest lo (its first entry) */
        m16 mk = lanes16(n - i);
        vf16 x = vf_mask_loadu(vf_set1(-INFINITY), mk, lo + i);
        if (div) x = vf_div(x, vT0);
        vm = vf_mask_max(vm, vf_cmp_gt(vinf, x) & mk, vm, x);
    }
    float m = vf_reduce_max(vm);
    long jm = -1;
    for (long i = i0; m > -INFINITY && i < n; i++)
        if ((div ? lo[i] / T : lo[i]) == m) { jm = i; break; }
    if (jm < 0) return -1;
    int64_t t0 = jm;
    float g0;
    selfspec_gumbel_noise(seed, pos, &t0, 1, &g0);
    float thr = m + g0;
    long found = 0;
    f32x8 vg = fill(GMAX);
    for (long i = i0; i < n; i += 32) {  /* 32 entries: the 4 words of 8 Philox counters (i / 4 + l, l < 8) */
        f32x8 xu[4], xl[4];
        i32x8 in[4], any = {0};
        for (int q = 0; q < 4; q++) {
            xu[q] = fill(-INFINITY);
            xl[q] = fill(-INFINITY);
            long b = i + 8 * q;
            if (b + 8 <= n) { memcpy(&xu[q], up + b, sizeof(f32x8)); memcpy(&xl[q], lo + b, sizeof(f32x8)); }
            else for (long e = 0; b + e < n; e++) { xu[q][e] = up[b + e]; xl[q][e] = lo[b + e]; }
            if (div) { xu[q] = xu[q] / T; xl[q] = xl[q] / T; }
            in[q] = (xu[q] + vg >= thr) & (xu[q] > -INFINITY);  /* not surely below thr: fl(x + GMAX) >= thr */
            any |= in[q];
        }
        if (!(any[0] | any[1] | any[2] | any[3] | any[4] | any[5] | any[6] | any[7])) continue;
        u64x8 c0;
        for (int l = 0; l < 8; l++) c0[l] = ((uint64_t)(i >> 2) + l) & 0xFFFFFFFFu;
        u64x8 w[4];
        philox_v(k.k0, k.k1, k.plo, k.phi, c0, w);
        u32x8 w0 = __builtin_convertvector(w[0], u32x8), w1 = __builtin_convertvector(w[1], u32x8),
              w2 = __builtin_convertvector(w[2], u32x8), w3 = __builtin_convertvector(w[3], u32x8);
        /* to token order: entry i + 4 l + word */
        u32x8 a01 = __builtin_shufflevector(w0, w1, 0, 8, 1, 9, 2, 10, 3, 11), a23 = __builtin_shufflevector(w2, w3, 0, 8, 1, 9, 2, 10, 3, 11);
        u32x8 b01 = __builtin_shufflevector(w0, w1, 4, 12, 5, 13, 6, 14, 7, 15), b23 = __builtin_shufflevector(w2, w3, 4, 12, 5, 13, 6, 14, 7, 15);
        u32x8 bits[4] = {__builtin_shufflevector(a01, a23, 0, 1, 8, 9, 2, 3, 10, 11), __builtin_shufflevector(a01, a23, 4, 5, 12, 13, 6, 7, 14, 15),
                         __builtin_shufflevector(b01, b23, 0, 1, 8, 9, 2, 3, 10, 11), __builtin_shufflevector(b01, b23, 4, 5, 12, 13, 6, 7, 14, 15)};
        for (int q = 0; q < 4; q++) {
            i32x8 live = in[q] & may_reach(xu[q], bits[q], thr);
            if (!(live[0] | live[1] | live[2] | live[3] | live[4] | live[5] | live[6] | live[7])) continue;
            f32x8 g = gumbel_v(bits[q]), su = xu[q] + g, sl = xl[q] + g;
            for (int e = 0; e < 8; e++) {
                if (!live[e]) continue;
                if (sl[e] > thr) thr = sl[e];
                if (su[e] < thr) continue;
                if (found == cap) found = keep_reaching(out, us, found, thr);
                if (found == cap) return cap + 1;
                out[found] = (int32_t)(i + 8 * q + e);
                us[found++] = su[e];
            }
        }
    }
    *thr_out = thr;
    return keep_reaching(out, us, found, thr);
}


/* e^y for y <= 88 in fp32, 8 lanes: y = n ln2 + r (two-part ln2, |r| <= 0.35), degree-6 Taylor of
 * e^r, 2^n into the exponent; below -80 0 (< 2^-115: the callers' margins hold far more than
 * every such term), from 88 +inf. Within 2^-20 of e^y elsewhere (relative; the callers widen
 * their sums by EXP_SLACK; tests/test_sampled_head.py checks it on a dense grid). */
#define EXP_SLACK 0x1p-18
static inline f32x8 exp_bound_v(f32x8 y) {
    i32x8 ok = y > -80.0f, big = y >= 88.0f;
    y = sel(ok & ~big, y, fill(0.0f));
    f32x8 t = y * 1.44269504088896341f;
    i32x8 n = __builtin_convertvector(t + sel(t < 0.0f, fill(-0.5f), fill(0.5f)), i32x8);  /* round half away */
    f32x8 fn = __builtin_convertvector(n, f32x8);
    f32x8 r = (y - fn * 0.693359375f) - fn * -2.12194440e-4f;
    f32x8 p = fill(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    f32x8 v = (f32x8)((i32x8)p + (n << 23));
    return sel(big, fill(INFINITY), sel(ok, v, fill(0.0f)));
}

typedef double f64x8 __attribute__((vector_size(64)));

/* lanes of entries [i, i + 8) (past n: none): e^(xu - m) where xu > xt into *a (and how many
 * into *c), e^(xl - m) where xl >= zl into *z (want_z). pu, pl: raw thresholds below xt T and
 * zl T, so that up <= pu proves xu <= xt and lo < pl proves xl < zl: most lanes need no division */
static inline void tail_lanes(const float *lo, const float *up, long i, long n, int div, float T, float xt, float m,
                              float zl, float pu, float pl, int want_z, f64x8 *a, long *c, f64x8 *z) {
    f32x8 u = fill(-INFINITY), l = fill(-INFINITY);
    if (i + 8 <= n) { memcpy(&u, up + i, sizeof(u)); memcpy(&l, lo + i, sizeof(l)); }
    else for (long q = 0; i + q < n; q++) { u[q] = up[i + q]; l[q] = lo[i + q]; }
    i32x8 in = u > pu;
    if (in[0] | in[1] | in[2] | in[3] | in[4] | in[5] | in[6] | in[7]) {
        if (div) u = u / T;
        in = u > xt;
        *a += __builtin_convertvector(sel(in, exp_bound_v(u - m), fill(0.0f)), f64x8);
        for (int q = 0; q < 8; q++) *c += in[q] != 0;
    }
    if (!want_z) return;
    i32x8 iz = l >= pl;
    if (iz[0] | iz[1] | iz[2] | iz[3] | iz[4] | iz[5] | iz[6] | iz[7]) {
        if (div) l = l / T;
        iz = l >= zl;
        *z += __builtin_convertvector(sel(iz, exp_bound_v(l - m), fill(0.0f)), f64x8);
    }
}

/* a float below v t (exact product less its rounding and more): the raw side of x = v */
static inline float raw_below(float v, float t) {
    float p = v * t;
    return p - (fabsf(p) * 0x1p-20f + FLT_MIN);
}

/* The screened nucleus's sums (selfspec/sampled_head.py: is the unrestricted pick, of score
 * xt, inside the top-k / top-p support?) over the entries j < n outside skip [ns] (ascending, in
 * [0, n): those whose logits are known exactly), from bounds lo_j <= l_j <= up_j and the row's
 * max m: xu = fl(up / T) >= x_j, xl = fl(lo / T) <= x_j (fp32 division is monotone; T 1: none).
 *   out[0] >= sum of exp(xu - m) over {xu > xt}   (>= the exact mass strictly above xt there)
 *   out[1] = |{xu > xt}|                           (>= the count strictly above xt there)
 *   out[2] <= sum of exp(xl - m) over {xl >= m - cut}, when want_z (<= the exact mass there)
 * The skipped entries' lanes are summed as well, then subtracted (the same lanes, the same
 * values): the fp64 rounding left is the caller's margin's. */
void selfspec_nucleus_tail(const float *lo, const float *up, long n, float T, float xt, float m, float cut,
                           const int32_t *skip, long ns, int want_z, double *out) {
    int div = T != 1.0f;
    float zl = m - cut, pu = div ? raw_below(xt, T) : xt, pl = div ? raw_below(zl, T) : zl;
    f64x8 a = {0}, z = {0}, as = {0}, zs = {0};
    long cnt = 0, cs = 0;
    for (long i = 0; i < n; i += 8) tail_lanes(lo, up, i, n, div, T, xt, m, zl, pu, pl, want_z, &a, &cnt, &z);
    for (long k = 0; k < ns; k++) tail_lanes(lo, up, skip[k], skip[k] + 1, div, T, xt, m, zl, pu, pl, want_z, &as, &cs, &zs);
    double sa = 0.0, sz = 0.0, ssa = 0.0, ssz = 0.0;
    for (int q = 0; q < 8; q++) { sa += a[q]; sz += z[q]; ssa += as[q]; ssz += zs[q]; }
    out[0] = (sa - ssa) * (1.0 + EXP_SLACK);
    out[1] = (double)(cnt - cs);
    out[2] = (sz - ssz) * (1.0 - EXP_SLACK);
}

/* exp_bound_v of y [n] (tests: its error against exp) */
void selfspec_exp_bound(const float *y, long n, float *out) {
    for (long i = 0; i < n; i += 8) {
        f32x8 v = fill(0.0f);
        for (long q = 0; q < 8 && i + q < n; q++) v[q] = y[i + q];
        v = exp_bound_v(v);
        for (long q = 0; q < 8 && i + q < n; q++) out[i + q] = v[q];
    }
}
