/* The exact greedy argmax of the LM head, screened by its int8 copy (selfspec/greedy_head.py):
 *
 *   l[v] = chain(x, w[:, v])     the logit the bf16/fp32 head computes (gemm.c: the FMA chain,
 *                                or the pair chain of VDPBF16PS), the one plain decoding argmaxes
 *   a[v] = qgemm(x, what[:, v])  the int8 head's value (quant.c: activations quantized too)
 *
 * For every column |l[v] - a[v]| <= E[v] = xn * alpha[v] + dxn * beta[v] (+ a tiny constant),
 * with xn = ||x'||, dxn = ||x' - xhat|| per row (quant.c selfspec_act_residual) and
 *   alpha[v] = ||w - what|| + g_K ||w|| + g_B ||what||,   beta[v] = (1 + g_B) ||what||
 * (Cauchy-Schwarz on w.x' - what.xhat = (w - what).x' + what.(x' - xhat), plus gamma bounds of
 * the two fp32 chains: g_K = K u / (1 - K u) for the exact chain of K terms, g_B the same for
 * the int8 chain over its blocks; greedy_head.py computes alpha and beta in float64 and rounds
 * them up). So with lo = max_u (a[u] - E[u]) <= max_u l[u], every column whose l can reach the
 * maximum, ties included, is in
 *
 *   candidates = { v : a[v] + E[v] >= lo }        (in increasing v)
 *
 * and the argmax of l over the candidates (first index on ties) is the argmax over all V.
 * bf16 logits (round_out: the head's output is rounded to bf16, as gemm.c does for bf16 x):
 * rounding is monotone, so a column can tie the rounded maximum only if its l reaches within
 * one bf16 step of lo; the threshold is lowered by |lo| 2^-6 (two steps) and the candidates'
 * values are rounded as gemm.c rounds them.
 * The bounds are evaluated in double from fp32 inputs with a relative margin of 1e-6 on E,
 * far above double's rounding. Only the candidates get exact chains (selfspec_exact_columns):
 * a decode step reads the int8 head (half the bytes) instead of the bf16 one.
 */
#include <float.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include "pool.h"

#define SCREEN_MARGIN (1.0 + 1e-6)
#define SCREEN_TINY 1e-30  /* absolute slack: denormals flushed by the pair chain, and E = 0 rows */
#define MAX_TEAM 8  /* memory-bound passes: more threads would not help, and each holds a candidate buffer per row */

static inline float sc_bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t sc_f32_to_bf16(float f) {  /* gemm.c's f32_to_bf16 */
    uint32_t u; memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* ---- the screen's int8 values a[v] ------------------------------------------------------
 * a is quant.c's int8 matmul (selfspec_qgemm): activations quantized per row in blocks of
 * QB = 32 k (sx = amax / 127, xq = clamp(rne(x / sx), -127, 127): quant.c's q_act_row, which
 * the residual below calls too), a = (sum over blocks b in order of
 * fmaf(sx_b, (float)acc_b, y)) * s[n] with acc_b the exact int32 sum of xq * q. (7-bit
 * activations would let AVX2's vpmaddubsw take the stored bytes unsigned, 3 instructions per
 * 32 products instead of 5, but they doubled dxn and gave ~10x the candidates on Gemma 3 270M,
 * whose final hidden states have outlier dimensions: measured, not kept.) */

typedef struct {  /* quant.c's ss_qweight, the same layout */
    const void *q, *scale, *zero;
    long in_features, out_features, group;
    int bits;
} sc_qweight;

int selfspec_qgemm(long M, const void *x, int x_bf16, const void *w, void *y, int y_bf16, int nthreads);

static inline float sc_load_x(const void *x, int x_bf16, long i) {
    return x_bf16 ? sc_bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

void selfspec_q_act_row(const void *x, int x_bf16, long row, long K, int8_t *xq, float *sx, int32_t *xs);  /* quant.c */
int selfspec_quant_block(void);  /* quant.c: QB */

/* Per row, in double: xn = ||x'|| (x' = x as fp32, or rounded to bf16 first: the pair chain's
 * inputs) and dxn = ||x' - xhat||, xhat[k] = sx_b xq[k] (exact in double), the activations the
 * screen's matmul multiplies. */
int selfspec_act_residual(long M, long K, const void *x, int x_bf16, int round_bf16, double *xn, double *dxn) {
    if (M <= 0 || K <= 0) return 0;
    const long qb = selfspec_quant_block(), nblk = (K + qb - 1) / qb;
    int8_t *xq = (int8_t *)malloc((size_t)nblk * qb);
    float *sx = (float *)malloc(sizeof(float) * nblk);
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * nblk);
    if (!xq || !sx || !xs) { free(xq); free(sx); free(xs); return 1; }
    for (long m = 0; m < M; m++) {
        selfspec_q_act_row(x, x_bf16, m, K, xq, sx, xs);
        double n2 = 0.0, d2 = 0.0;
        for (long k = 0; k < K; k++) {
            float v = sc_load_x(x, x_bf16, m * K + k);
            if (round_bf16) v = sc_bf16_to_f32(sc_f32_to_bf16(v));
            double d = (double)v - (double)sx[k / qb] * (double)xq[k];
            n2 += (double)v * (double)v;
            d2 += d * d;
        }
        xn[m] = sqrt(n2);
        dxn[m] = sqrt(d2);
    }
    free(xq); free(sx); free(xs);
    return 0;
}

/* a = the screen's int8 values of x [M, K] (bf16 or fp32) against the int8 copy w (an 8-bit
 * ss_qweight): y fp32 [M, N], through quant.c's selfspec_qgemm. */
int selfspec_screen_qgemm(long M, const void *x, int x_bf16, const void *wd, float *y, int nthreads) {
    const sc_qweight *w = (const sc_qweight *)wd;
    if (w->bits != 8) return 2;
    return selfspec_qgemm(M, x, x_bf16, wd, y, 0, nthreads);
}


static int screen_team(long work, int nthreads) {
    int nt = ss_threads(nthreads);
    if (nt > MAX_TEAM) nt = MAX_TEAM;
    if (work < 65536) nt = 1;  /* not worth waking a team */
    return nt < 1 ? 1 : nt;
}

/* a [M, V] fp32 (the int8 head's outputs), ab [2][V] fp32 (alpha, then beta), xn / dxn [M] double.
 * cand [M][cap] int32 out, count [M] out: the number of candidates of row m (> cap: too many,
 * only the first cap kept; the caller computes that row in full). A row whose xn or dxn is not
 * a finite number below 1e15, or whose bounds are not finite, gets count = -1 (the caller
 * computes it in full). Threads split v into contiguous shares (one team for all rows); a
 * row's candidates are the shares' joined in order, so increasing in v. Returns 0, or 1 when
 * out of memory. */
static inline double sc_e(double X, double D, const float *al, const float *be, long v) {
    return (X * (double)al[v] + D * (double)be[v]) * SCREEN_MARGIN + SCREEN_TINY;
}

/* max over v in [v0, v1) of a[v] - e[v] (NaN never wins), 4 lanes of double at a time */
static double sc_row_lo(const float *am, const float *al, const float *be, double X, double D, long v0, long v1) {
    const __m256d vX = _mm256_set1_pd(X), vD = _mm256_set1_pd(D), vM = _mm256_set1_pd(SCREEN_MARGIN), vT = _mm256_set1_pd(SCREEN_TINY);
    __m256d best = _mm256_set1_pd(-INFINITY);
    long v = v0;
    for (; v + 4 <= v1; v += 4) {
        __m256d e = _mm256_add_pd(_mm256_mul_pd(_mm256_add_pd(_mm256_mul_pd(vX, _mm256_cvtps_pd(_mm_loadu_ps(al + v))),
                                                              _mm256_mul_pd(vD, _mm256_cvtps_pd(_mm_loadu_ps(be + v)))), vM), vT);
        __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(am + v)), e);
        best = _mm256_max_pd(d, best);  /* d NaN: best (max_pd returns its second operand) */
    }
    double lanes[4], l = -INFINITY;
    _mm256_storeu_pd(lanes, best);
    for (int i = 0; i < 4; i++) l = lanes[i] > l ? lanes[i] : l;
    for (; v < v1; v++) {
        double d = (double)am[v] - sc_e(X, D, al, be, v);
        l = d > l ? d : l;
    }
    return l;
}

/* the v in [v0, v1) with a[v] + e[v] >= g, in order, into out (at most cap); returns how many */
static long sc_row_collect(const float *am, const float *al, const float *be, double X, double D, double g, long v0, long v1,
                           int32_t *out, long cap) {
    const __m256d vX = _mm256_set1_pd(X), vD = _mm256_set1_pd(D), vM = _mm256_set1_pd(SCREEN_MARGIN), vT = _mm256_set1_pd(SCREEN_TINY);
    const __m256d vg = _mm256_set1_pd(g);
    long n = 0, v = v0;
    for (; v + 4 <= v1; v += 4) {
        __m256d e = _mm256_add_pd(_mm256_mul_pd(_mm256_add_pd(_mm256_mul_pd(vX, _mm256_cvtps_pd(_mm_loadu_ps(al + v))),
                                                              _mm256_mul_pd(vD, _mm256_cvtps_pd(_mm_loadu_ps(be + v)))), vM), vT);
        __m256d u = _mm256_add_pd(_mm256_cvtps_pd(_mm_loadu_ps(am + v)), e);
        int mask = _mm256_movemask_pd(_mm256_cmp_pd(u, vg, _CMP_GE_OQ));
        while (mask) {
            int i = __builtin_ctz(mask);
            mask &= mask - 1;
            if (n < cap) out[n] = (int32_t)(v + i);
            n++;
        }
    }
    for (; v < v1; v++)
        if ((double)am[v] + sc_e(X, D, al, be, v) >= g) {
            if (n < cap) out[n] = (int32_t)v;
            n++;
        }
    return n;
}

typedef struct {
    long M, V;
    const float *a, *ab;
    const double *xn, *dxn;
    int round_out;
    long cap;
    long *count;
    double *lo, *glo;  /* [nt][M] partial maxima, then [M] the rows' thresholds */
    long *found;       /* [nt][M] candidates each share found */
    int32_t *local;    /* [nt][M][cap] their first cap */
    int team;
} cand_job;

static void cand_region(void *ctx, int t, int T) {
    cand_job *j = (cand_job *)ctx;
    const long M = j->M, V = j->V, cap = j->cap;
    const float *ab = j->ab;
    if (t == 0) j->team = T;
    const long v0 = V * t / T, v1 = V * (t + 1) / T;
    for (long m = 0; m < M; m++)  /* rows outer: locals in registers, ab's share from cache */
        j->lo[(size_t)t * (size_t)M + m] = sc_row_lo(j->a + m * V, ab, ab + V, j->xn[m], j->dxn[m], v0, v1);
    ss_barrier();
    if (t == 0)
        for (long m = 0; m < M; m++) {
            double g = -INFINITY;
            for (int u = 0; u < T; u++) g = j->lo[(size_t)u * (size_t)M + m] > g ? j->lo[(size_t)u * (size_t)M + m] : g;
            if (!isfinite(g)) j->count[m] = -1;
            j->glo[m] = j->round_out ? g - (fabs(g) * 0x1p-6 + SCREEN_TINY) : g;
        }
    ss_barrier();
    for (long m = 0; m < M; m++) {
        j->found[(size_t)t * (size_t)M + m] = j->count[m] < 0 ? 0
            : sc_row_collect(j->a + m * V, ab, ab + V, j->xn[m], j->dxn[m], j->glo[m], v0, v1,
                             j->local + ((size_t)t * (size_t)M + m) * (size_t)cap, cap);
    }
}

int selfspec_screen_candidates(long M, long V, const float *a, const float *ab, const double *xn, const double *dxn,
                               int round_out, int32_t *cand, long cap, long *count, int nthreads) {
    if (M <= 0) return 0;
    int nt = screen_team(V * M, nthreads);
    double *lo = (double *)malloc(sizeof(double) * (size_t)M * (size_t)(nt + 1));  /* [nt][M] partial, then [M] */
    long *found = (long *)malloc(sizeof(long) * (size_t)M * (size_t)nt);
    int32_t *local = (int32_t *)malloc(sizeof(int32_t) * (size_t)nt * (size_t)M * (size_t)(cap > 0 ? cap : 1));
    if (!lo || !found || !local) { free(lo); free(found); free(local); return 1; }
    for (long m = 0; m < M; m++) count[m] = (xn[m] < 1e15 && dxn[m] < 1e15) ? 0 : -1;  /* NaN fails too */
    cand_job job = {M, V, a, ab, xn, dxn, round_out, cap, count, lo, lo + (size_t)M * (size_t)nt, found, local, 1};
    ss_parallel(nt, cand_region, &job);
    const int team = job.team;
    for (long m = 0; m < M; m++) {
        if (count[m] < 0) continue;
        long total = 0;
        for (int t = 0; t < team; t++) {
            long f = found[(size_t)t * (size_t)M + m], n = f < cap ? f : cap;
            if (total + n <= cap) memcpy(cand + m * cap + total, local + ((size_t)t * (size_t)M + m) * (size_t)cap, sizeof(int32_t) * n);
            total += f;
        }
        count[m] = total;
    }
    free(lo);
    free(found);
    free(local);
    return 0;
}

static inline float sc_ftz(float f) { return fpclassify(f) == FP_SUBNORMAL ? copysignf(0.0f, f) : f; }
static inline float sc_fma(float a, float b, float c) {  /* one rounding, as the vector FMAs */
    return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}

/* element (k, n) of a head laid out as gemm.c's layouts: 0 plain [K, N], 1 packed
 * [ceil(N/64)][K][64], 2 pairs [ceil(N/64)][ceil(K/2)][64][2] */
static inline long sc_index(int layout, long K, long N, long k, long n) {
    if (layout == 0) return k * N + n;
    long t = n / 64, c = n % 64;
    if (layout == 1) return (t * K + k) * 64 + c;
    long K2 = (K + 1) / 2;
    return ((t * K2 + k / 2) * 64 + c) * 2 + (k & 1);
}

static inline float sc_w(const void *w, int w_bf16, long i) {
    return w_bf16 ? sc_bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

#define SC_GROUP 8  /* candidates whose chains run side by side (independent: latency hidden) */
#ifndef SC_PF
#define SC_PF 48  /* k-rows ahead a column read asks for (even: whole pairs) */
#endif

/* The exact logits of the candidates: x [M, K] fp32 (the values the head's gemm multiplies),
 * w the head in `layout` (pairs: bf16 only), cand / count as selfspec_screen_candidates made
 * them (rows with count < 0 or > cap are skipped), out [M][cap] fp32. Each value is computed
 * by the very chain gemm.c computes for that column (layout 0/1: acc = fma(x[k], w[k], acc),
 * k = 0..K-1; layout 2: selfspec_gemm_pairs_ref's chain), so it is that column's logit, bit for
 * bit (round_out: then rounded to bf16 as gemm.c rounds a bf16 output). Returns 0, or 2 for a
 * bad layout. */
typedef struct {
    long M, K, N;
    const float *x;
    const void *w;
    int w_bf16, layout, round_out;
    const int32_t *cand;
    const long *count;
    long cap, groups;  /* groups: SC_GROUP-candidate items per row */
    float *out;
    long next;  /* the next work item (dynamic schedule) */
} cols_job;

/* The exact values of G <= SC_GROUP columns cols[0..G-1] for one row xr [K] (the very chains of
 * gemm.c, rounded to bf16 as gemm.c rounds a bf16 output when round_out) into out[0..G-1]. */
static void sc_exact(const float *xr, long K, long N, const void *w, int w_bf16, int layout, int round_out,
                     const int32_t *c, long G, float *out) {
    float acc[SC_GROUP] = {0};
    /* A column is one value per k-row (64-128 bytes apart in the packed layouts): each read
     * misses on its own line, so the lines SC_PF k-rows ahead are asked for early (hints only). */
    const int esz = w_bf16 ? 2 : 4;
    for (long k = 0; k < SC_PF && k < K; k++)
        for (long i = 0; i < G; i++) _mm_prefetch((const char *)w + esz * sc_index(layout, K, N, k, c[i]), _MM_HINT_T0);
    if (layout < 2) {
        for (long k = 0; k < K; k++) {
            if (k + SC_PF < K)
                for (long i = 0; i < G; i++) _mm_prefetch((const char *)w + esz * sc_index(layout, K, N, k + SC_PF, c[i]), _MM_HINT_T0);
            for (long i = 0; i < G; i++) acc[i] = sc_fma(xr[k], sc_w(w, w_bf16, sc_index(layout, K, N, k, c[i])), acc[i]);
        }
    } else {
        for (long k = 0; k < K; k += 2) {
            if (k + SC_PF < K)  /* the pair holding k-rows k + SC_PF, k + SC_PF + 1 */
                for (long i = 0; i < G; i++) _mm_prefetch((const char *)w + esz * sc_index(2, K, N, k + SC_PF, c[i]), _MM_HINT_T0);
            float x0 = sc_ftz(sc_bf16_to_f32(sc_f32_to_bf16(xr[k])));
            float x1 = k + 1 < K ? sc_ftz(sc_bf16_to_f32(sc_f32_to_bf16(xr[k + 1]))) : 0.0f;
            for (long i = 0; i < G; i++) {
                float w0 = sc_ftz(sc_w(w, 1, sc_index(2, K, N, k, c[i])));
                float w1 = k + 1 < K ? sc_ftz(sc_w(w, 1, sc_index(2, K, N, k + 1, c[i]))) : 0.0f;
                acc[i] = sc_ftz(sc_fma(x1, w1, acc[i]));
                acc[i] = sc_ftz(sc_fma(x0, w0, acc[i]));
            }
        }
    }
    for (long i = 0; i < G; i++) out[i] = round_out ? sc_bf16_to_f32(sc_f32_to_bf16(acc[i])) : acc[i];
}

/* one work item: row m's candidates g0..g0+SC_GROUP-1 */
static void cols_item(const cols_job *j, long m, long g0) {
    long n = j->count[m];
    if (n <= 0 || n > j->cap || g0 >= n) return;
    long G = n - g0 < SC_GROUP ? n - g0 : SC_GROUP;
    sc_exact(j->x + m * j->K, j->K, j->N, j->w, j->w_bf16, j->layout, j->round_out, j->cand + m * j->cap + g0, G,
             j->out + m * j->cap + g0);
}

static void cols_region(void *ctx, int tid, int nt) {
    cols_job *j = (cols_job *)ctx;
    (void)tid; (void)nt;
    const long items = j->M * j->groups;
    for (long i0; (i0 = ss_next(&j->next, 4)) < items;)
        for (long i = i0; i < i0 + 4 && i < items; i++) cols_item(j, i / j->groups, SC_GROUP * (i % j->groups));
}

int selfspec_exact_columns(long M, long K, long N, const float *x, const void *w, int w_bf16, int layout,
                           int round_out, const int32_t *cand, const long *count, long cap, float *out, int nthreads) {
    if (layout < 0 || layout > 2 || (layout == 2 && !w_bf16)) return 2;
    long work = 0;
    for (long m = 0; m < M; m++) work += count[m] > 0 && count[m] <= cap ? count[m] : 0;
    int nt = screen_team(work * K / 8, nthreads);
    /* (row, group of SC_GROUP candidates) work items, flattened */
    cols_job job = {M, K, N, x, w, w_bf16, layout, round_out, cand, count, cap, (cap + SC_GROUP - 1) / SC_GROUP, out, 0};
    ss_parallel(nt, cols_region, &job);
    return 0;
}

/* ---- the argmax from the candidates, in two rounds ------------------------------------------
 * Every column that can be a row's maximum (ties included) is a candidate, but most candidates
 * are far below the maximum's exact value: the screen's threshold max_u (a[u] - E[u]) sits E
 * below the maximum's int8 value, and the rounded-output slack two bf16 steps lower still. So
 * round 1 computes the SC_GROUP candidates of largest a exactly (the maximum is almost always
 * among them); their best exact value b bounds the maximum from below, and round 2 computes
 * only the candidates that can still reach it: a[v] + E[v] >= b (less the same two-step slack
 * when outputs are rounded to bf16). A candidate dropped there has l[v] <= a[v] + E[v] < b <=
 * the maximum (after rounding, strictly below the rounded maximum), so it can neither win nor
 * tie: the answer, the first column of the largest value among those computed, is the full
 * head's argmax. On the default model's decode states: ~40 candidates a row, ~10 computed.
 * best[m] = -1 for a row the screen did not decide (count outside 1..cap) or with a non-finite
 * value; computed[m] = the columns computed exactly. */
typedef struct {
    long M, K, N, V;
    const float *x;
    const void *w;
    int w_bf16, layout, round_out;
    const int32_t *cand;
    const long *count;
    long cap;
    const float *a, *ab;
    const double *xn, *dxn;
    int64_t *best;
    long *computed;
    long next;
} pick_job;

static void pick_row(const pick_job *j, long m) {
    const long n = j->count[m];
    j->best[m] = -1;
    j->computed[m] = 0;
    if (n <= 0 || n > j->cap) return;
    const int32_t *c = j->cand + m * j->cap;
    const float *am = j->a + m * j->V, *al = j->ab, *be = j->ab + j->V;
    const float *xr = j->x + m * j->K;
    /* round 1: the SC_GROUP candidates of largest a (first ones on ties), by insertion */
    int32_t top[SC_GROUP];
    long nt = 0;
    for (long i = 0; i < n; i++) {
        float v = am[c[i]];
        if (nt == SC_GROUP && !(v > am[top[nt - 1]])) continue;
        long p = nt < SC_GROUP ? nt++ : nt - 1;
        while (p > 0 && v > am[top[p - 1]]) { top[p] = top[p - 1]; p--; }
        top[p] = c[i];
    }
    float vals[SC_GROUP];
    sc_exact(xr, j->K, j->N, j->w, j->w_bf16, j->layout, j->round_out, top, nt, vals);
    float bv = -INFINITY;
    int64_t bi = -1;
    for (long i = 0; i < nt; i++) {
        if (!isfinite(vals[i])) return;  /* the full head decides (as its argmax treats NaN / inf) */
        if (vals[i] > bv || (vals[i] == bv && top[i] < bi)) { bv = vals[i]; bi = top[i]; }
    }
    long done = nt;
    const double b = (double)bv, t = j->round_out ? b - (fabs(b) * 0x1p-6 + SCREEN_TINY) : b;
    /* round 2: the candidates (not in round 1) that can still reach b, SC_GROUP at a time */
    int32_t more[SC_GROUP];
    long g = 0;
    for (long i = 0; i <= n; i++) {
        if (i < n) {
            int32_t v = c[i];
            if ((double)am[v] + sc_e(j->xn[m], j->dxn[m], al, be, v) < t) continue;
            int in_top = 0;
            for (long q = 0; q < nt; q++) in_top |= top[q] == v;
            if (in_top) continue;
            more[g++] = v;
            if (g < SC_GROUP) continue;
        }
        if (g == 0) continue;
        sc_exact(xr, j->K, j->N, j->w, j->w_bf16, j->layout, j->round_out, more, g, vals);
        for (long q = 0; q < g; q++) {
            if (!isfinite(vals[q])) return;
            if (vals[q] > bv || (vals[q] == bv && more[q] < bi)) { bv = vals[q]; bi = more[q]; }
        }
        done += g;
        g = 0;
    }
    j->best[m] = bi;
    j->computed[m] = done;
}

static void pick_region(void *ctx, int tid, int nt) {
    pick_job *j = (pick_job *)ctx;
    (void)tid; (void)nt;
    for (long m; (m = ss_next(&j->next, 1)) < j->M;) pick_row(j, m);
}

int selfspec_screen_pick(long M, long K, long N, const float *x, const void *w, int w_bf16, int layout, int round_out,
                         const int32_t *cand, const long *count, long cap, const float *a, const float *ab,
                         const double *xn, const double *dxn, int64_t *best, long *computed, int nthreads) {
    if (layout < 0 || layout > 2 || (layout == 2 && !w_bf16)) return 2;
    int nt = screen_team(M * 2 * SC_GROUP * K / 8, nthreads);  /* ~2 groups a row */
    if (nt > M) nt = (int)M;
    pick_job job = {M, K, N, N, x, w, w_bf16, layout, round_out, cand, count, cap, a, ab, xn, dxn, best, computed, 0};
    ss_parallel(nt < 1 ? 1 : nt, pick_region, &job);
    return 0;
}

/* The screen's int8 copy of a head and its bound coefficients, in one pass per 64-column tile:
 * w [K, N] in `layout` (as selfspec_exact_columns), bf16 or fp32. Per column n (absmax):
 *   s = max_k |w[k, n]| / 127 (fp32; a zero column gets s = 1), q[k] = clamp(rne(w / s), -127, 127)
 *   what = s q (exact in double), and in double: wn = ||w||, qn = ||what||, en = ||w - what||
 *   alpha = en + g_k wn + g_b qn,  beta = (1 + g_b) qn,  both rounded up to fp32
 * Output: q as quant.c's int8 layout (u = q + 128, [ceil(N/64)][ceil(K/4)][64][4], padding 128),
 * scale fp32 [N], ab fp32 [2][N] (alpha, then beta). Returns 0, 2 for a bad layout, 3 if a weight
 * is not finite. */
typedef struct {
    long K, N, NB, K4;
    const void *w;
    int w_bf16, layout;
    double g_k, g_b;
    uint8_t *q;
    float *scale, *ab;
    int bad;
} squant_job;

static void squant_region(void *ctx, int tid, int nt) {
    squant_job *j = (squant_job *)ctx;
    const long K = j->K, N = j->N, K4 = j->K4;
    const void *w = j->w;
    const int w_bf16 = j->w_bf16, layout = j->layout;
    const double g_k = j->g_k, g_b = j->g_b;
    uint8_t *q = j->q;
    float *scale = j->scale, *ab = j->ab;
    long t0, t1;
    ss_share(j->NB, tid, nt, &t0, &t1);
    for (long t = t0; t < t1; t++) {
        uint8_t *qt = q + t * K4 * 64 * 4;
        memset(qt, 128, (size_t)K4 * 64 * 4);
        for (long c = 0; c < 64; c++) {
            long n = t * 64 + c;
            if (n >= N) break;
            float amax = 0.0f;
            for (long k = 0; k < K; k++) {
                float v = sc_w(w, w_bf16, sc_index(layout, K, N, k, n));
                if (!isfinite(v)) __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
                float av = fabsf(v);
                amax = av > amax ? av : amax;
            }
            float s = amax > 0.0f ? amax / 127.0f : 1.0f;
            if (!(s > 0.0f)) s = 1.0f;  /* amax / 127 underflowed */
            double wn = 0.0, qn = 0.0, en = 0.0;
            for (long k = 0; k < K; k++) {
                float v = sc_w(w, w_bf16, sc_index(layout, K, N, k, n));
                float r = nearbyintf(v / s);
                r = fminf(fmaxf(r, -127.0f), 127.0f);
                int qi = (int)r;
                qt[((k / 4) * 64 + c) * 4 + k % 4] = (uint8_t)(qi + 128);
                double wh = (double)s * (double)qi, d = (double)v - wh;
                wn += (double)v * (double)v;
                qn += wh * wh;
                en += d * d;
            }
            wn = sqrt(wn); qn = sqrt(qn); en = sqrt(en);
            /* sqrt and the sums are correctly rounded / accurate to ~1e-13 relative in double: the
             * screen's margin (1e-6) covers them; rounding up to fp32 keeps the bound */
            double alpha = en + g_k * wn + g_b * qn, beta = (1.0 + g_b) * qn;
            float fa = (float)alpha, fb = (float)beta;
            if ((double)fa < alpha) fa = nextafterf(fa, INFINITY);
            if ((double)fb < beta) fb = nextafterf(fb, INFINITY);
            scale[n] = s;
            ab[n] = fa;
            ab[N + n] = fb;
        }
    }
}

int selfspec_screen_quantize(long K, long N, const void *w, int w_bf16, int layout, double g_k, double g_b,
                             uint8_t *q, float *scale, float *ab, int nthreads) {
    if (layout < 0 || layout > 2 || (layout == 2 && !w_bf16)) return 2;
    const long NB = (N + 63) / 64, K4 = (K + 3) / 4;
    squant_job job = {K, N, NB, K4, w, w_bf16, layout, g_k, g_b, q, scale, ab, 0};
    ss_parallel(screen_team(K * N, nthreads), squant_region, &job);
    return job.bad ? 3 : 0;
}

/* ---- interval bounds on every logit, for the screened Gumbel-max pick (selfspec/sampled_head.py)
 * One row: lo[v] <= l[v] <= up[v] for the logit l[v] the head computes (rounded to bf16 when
 * round_out, as gemm.c rounds a bf16 output), from a[v] -+ E[v] (the bound above). The fp32
 * values are pushed outward by 2^-22 of their size before the conversion from double (which
 * moves a value by at most 2^-24 of it), then rounded to bf16 when round_out: rounding to
 * nearest is monotone, so bf16(lo) <= bf16(l) <= bf16(up). Returns 0, or 1 when a bound is not
 * finite (the caller computes the row in full). */
typedef struct {
    long V;
    const float *a, *al, *be;
    double xn, dxn;
    int round_out;
    float *lo, *up;
    float lo_max[MAX_TEAM];
    int bad[MAX_TEAM];
} bounds_job;

static void bounds_region(void *ctx, int t, int nt) {
    bounds_job *j = (bounds_job *)ctx;
    long v0, v1;
    ss_share(j->V, t, nt, &v0, &v1);
    const float *restrict a = j->a, *restrict al = j->al, *restrict be = j->be;
    float *restrict lo = j->lo, *restrict up = j->up;
    const double X = j->xn, D = j->dxn;
    const int round_out = j->round_out;
    int bad = 0;
    float m = -INFINITY;
    for (long v = v0; v < v1; v++) {
        double e = sc_e(X, D, al, be, v), u = (double)a[v] + e, l = (double)a[v] - e;
        float fu = (float)(u + fabs(u) * 0x1p-22 + SCREEN_TINY), fl = (float)(l - fabs(l) * 0x1p-22 - SCREEN_TINY);
        bad |= !(fabsf(fu) <= FLT_MAX) | !(fabsf(fl) <= FLT_MAX);
        up[v] = round_out ? sc_bf16_to_f32(sc_f32_to_bf16(fu)) : fu;
        lo[v] = round_out ? sc_bf16_to_f32(sc_f32_to_bf16(fl)) : fl;
    }
    /* the max apart, so that the loop above stays vectorised (a float max reduction would not be) */
    long v = v0;
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; v + 8 <= v1; v += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(lo + v));
    float mv[8];
    _mm256_storeu_ps(mv, vm);
    for (int q = 0; q < 8; q++) m = mv[q] > m ? mv[q] : m;
    for (; v < v1; v++) m = lo[v] > m ? lo[v] : m;
    j->lo_max[t] = m;
    j->bad[t] = bad;
}

/* *lo_max: the largest lo written (each entry is the same whatever the team; the team only splits
 * the range) */
int selfspec_screen_bounds(long V, const float *a, const float *ab, double xn, double dxn, int round_out, float *lo, float *up,
                           float *lo_max, int nthreads) {
    if (!(xn < 1e15 && dxn < 1e15)) return 1;
    bounds_job job = {V, a, ab, ab + V, xn, dxn, round_out, lo, up, {0}, {0}};
    int nt = screen_team(V, nthreads);
    ss_parallel(nt, bounds_region, &job);
    int bad = 0;
    float m = -INFINITY;
    for (int t = 0; t < nt; t++) {
        bad |= job.bad[t];
        m = job.lo_max[t] > m ? job.lo_max[t] : m;
    }
    *lo_max = m;
    return bad;
}

/* ---- the entries of a row at least a threshold: {v : x[v] >= thr} ascending into out (at most
 * cap), for the screened pick's exact columns (every token that may hold the row's maximum) */
typedef struct {
    const float *x;
    long n, cap;
    float thr;
    int32_t *out;
    long found[MAX_TEAM];
} atleast_job;

static void atleast_region(void *ctx, int t, int nt) {
    atleast_job *j = (atleast_job *)ctx;
    long v0, v1, c = 0;
    ss_share(j->n, t, nt, &v0, &v1);
    int32_t *o = j->out + (size_t)t * (size_t)(j->cap + 1);
    for (long v = v0; v < v1; v++)
        if (j->x[v] >= j->thr) {
            if (c == j->cap + 1) break;  /* more than cap: the caller gives up on the row */
            o[c++] = (int32_t)v;
        }
    j->found[t] = c;
}

/* out must hold (cap + 1) * threads entries (selfspec_at_least_space); returns how many (cap + 1:
 * more than cap), the first of them moved to out[0..) */
long selfspec_at_least(const float *x, long n, float thr, int32_t *out, long cap, int nthreads) {
    int nt = screen_team(n, nthreads);
    atleast_job job = {x, n, cap, thr, out, {0}};
    ss_parallel(nt, atleast_region, &job);
    long c = 0;
    for (int t = 0; t < nt && c <= cap; t++) {
        const int32_t *o = out + (size_t)t * (size_t)(cap + 1);
        for (long i = 0; i < job.found[t] && c <= cap; i++) out[c++] = o[i];  /* o >= out + c: a forward move */
    }
    return c;
}

long selfspec_at_least_space(long cap, int nthreads) { return (cap + 1) * screen_team(1L << 30, nthreads); }

/* ---- the screened Gumbel-max pick's candidates on the pool's threads (csrc/gumbel.c's
 * selfspec_gumbel_reach_range explains the set; each thread runs a share, the shares merge) */
long selfspec_gumbel_reach_range(const float *lo, const float *up, long i0, long n, float T, uint64_t seed, int64_t pos,
                                 int32_t *out, float *us, long cap, float *thr_out);

typedef struct {
    const float *lo, *up;
    long n, cap;
    float T;
    uint64_t seed;
    int64_t pos;
    int32_t *out;
    float *us, *thr;
    long *found;
} reach_job;

static void reach_region(void *ctx, int t, int nt) {
    reach_job *j = (reach_job *)ctx;
    long i0, i1;
    ss_share(j->n / 16, t, nt, &i0, &i1);  /* whole 16-entry blocks; the last share takes the tail */
    i0 *= 16;
    i1 = t == nt - 1 ? j->n : i1 * 16;
    j->found[t] = selfspec_gumbel_reach_range(j->lo, j->up, i0, i1, j->T, j->seed, j->pos, j->out + (size_t)t * (size_t)j->cap,
                              j->us + (size_t)t * (size_t)j->cap, j->cap, j->thr + t);
}

long selfspec_gumbel_reach(const float *lo, const float *up, long n, float T, uint64_t seed, int64_t pos, int32_t *out,
                           float *us, long cap, float *thr_out, int nthreads) {
    int nt = n < 65536 ? 1 : ss_threads(nthreads);
    if (nt > 4) nt = 4;
    if (nt <= 1) return selfspec_gumbel_reach_range(lo, up, 0, n, T, seed, pos, out, us, cap, thr_out);
    int32_t *o = (int32_t *)malloc(sizeof(int32_t) * (size_t)nt * (size_t)cap);
    float *u = (float *)malloc(sizeof(float) * (size_t)nt * (size_t)cap);
    float thr[4];
    long found[4];
    if (!o || !u) { free(o); free(u); return -2; }
    reach_job job = {lo, up, n, cap, T, seed, pos, o, u, thr, found};
    ss_parallel(nt, reach_region, &job);
    float best = -INFINITY;
    long rc = -1;
    for (int t = 0; t < nt; t++) {
        if (found[t] == -2 || found[t] == cap + 1) rc = found[t];
        if (found[t] >= 0 && thr[t] > best) best = thr[t];
    }
    long c = 0;
    for (int t = 0; rc == -1 && t < nt && c <= cap; t++)
        for (long i = 0; i < found[t] && c <= cap; i++) {
            if (!(u[(size_t)t * cap + i] >= best)) continue;
            if (c == cap) { c = cap + 1; break; }
            out[c] = o[(size_t)t * cap + i];
            us[c++] = u[(size_t)t * cap + i];
        }
    free(o); free(u);
    if (rc != -1) return rc;
    *thr_out = best;
    return best == -INFINITY ? -1 : c;
}
