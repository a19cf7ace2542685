/* Sampling from one row of logits without sorting the vocabulary (see selfspec/sampling.py
 * for the definitions this implements; the torch reference there is the specification).
 *
 *   x_i = l_i / T                      (fp32 division, exactly torch's `logits / T`)
 *   support: finite x_i with W(x > x_i) < P, applied for top-k (W = count, P = k), then
 *            for top-p over the top-k set (W = probability mass after top-k, P = top_p)
 *   p_i = exp(x_i - m) / Z over the support (m = max x, Z = sum over the support)
 *
 * Every truncation is a threshold on x: the support is {x >= tau}. Ties are therefore kept
 * or dropped together, and no result depends on an order among equal values.
 *
 * How (one row, n entries, all passes vectorised: 16 lanes, csrc/simd.h):
 *   top-k (then top-p): one pass keeps the entries at or above a running threshold (the
 *      k-th largest collected so far, raised by a quickselect whenever the buffer fills), so
 *      only ~k candidates survive; exps of those alone (Z of the top-k set), then top-p by a
 *      weighted quickselect over them.
 *   top-p alone, or temperature alone:
 *   1. m: max of l (division is monotone, so max(l) / T is the largest x).
 *   2. one pass in blocks of SB entries: e_i = exp(x_i - m), block sums of e (a dense
 *      distribution keeps them: a draw then walks 256 block sums and one block), and, for
 *      top-p, count and mass of {x >= m - d} for a ladder of offsets d (vectors entirely
 *      below the lowest rung skip that work: most of a vocabulary).
 *   3. the highest rung whose mass reaches top_p * Z surely holds the support; when it has
 *      more than DIRECT entries, finer ladders inside its band (one pass each, at most
 *      REFINE) narrow it. Its entries are compacted in index order.
 *   4. tau by a weighted quickselect on those candidates (expected linear time); the
 *      support is written out (ids ascending, probabilities) when it has at most `cap`
 *      entries, else only (m, tau, Z) are returned (a dense distribution).
 *
 * Draws (selfspec_sample_draw): w_j = max(p_j - q_j, 0) over a dense p (q: none, a dense
 * row, or a list of (id, q) pairs), one uniform u, and an inverse-CDF walk in index order:
 * block sums first, then within the chosen block. Plain sampling is q = none.
 *
 * Numerics: e_i uses one exp (exp_v below, ~1 ulp) everywhere, so a value recomputed for a
 * draw is the value the sums were made of. Sums of e are fp32 within a block (16 lanes,
 * reduced in a fixed tree) and fp64 across blocks and over candidates. Results depend only
 * on the row: no threads, no dependence on anything else.
 */
/* a * b - c * d must not become fma(a, b, -(c * d)): p - q would not be 0 where p == q */
#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#define SB 1024   /* entries per block: the unit of block sums and draws */
#define NLEV 8    /* rungs per ladder: candidate sets {x >= t} */
static const float LADDER[NLEV] = {0.5f, 1.f, 2.f, 3.f, 4.f, 6.f, 9.f, 16.f};  /* first ladder: t = m - d */
#define DIRECT 4096  /* candidates a quickselect takes without a finer ladder first */
#define REFINE 4     /* finer ladders at most (each one pass over the row) */

/* exp(z) for z <= 0 (Cephes expf: round z / ln2, two-part reduction, degree-6 polynomial);
 * z below EXP_LO (and -inf, NaN) gives 0 */
#define EXP_LO -110.0f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define P0 1.9875691500E-4f
#define P1 1.3981999507E-3f
#define P2 8.3334519073E-3f
#define P3 4.1665795894E-2f
#define P4 1.6666665459E-1f
#define P5 5.0000001201E-1f

static inline vf16 exp_v(vf16 z) {
    m16 ok = vf_cmp_ge(z, vf_set1(EXP_LO));
    z = vf_max(z, vf_set1(EXP_LO));
    vf16 n = vf_round(vf_mul(z, vf_set1(LOG2E)));
    vf16 r = vf_fnmadd(n, vf_set1(LN2_HI), z);
    r = vf_fnmadd(n, vf_set1(LN2_LO), r);
    vf16 p = vf_set1(P0);
    p = vf_fmadd(p, r, vf_set1(P1));
    p = vf_fmadd(p, r, vf_set1(P2));
    p = vf_fmadd(p, r, vf_set1(P3));
    p = vf_fmadd(p, r, vf_set1(P4));
    p = vf_fmadd(p, r, vf_set1(P5));
    vf16 y = vf_fmadd(p, vf_mul(r, r), r);
    y = vf_add(y, vf_set1(1.0f));
    return vf_maskz_mov(ok, vf_scalef(y, n));  /* n in [-159, 0] */
}
static inline float exp1(float z) { return vf_lane0(exp_v(vf_set1(z))); }
#define lanes lanes16

typedef struct {
    const float *l;  /* logits [n] */
    long n;
    float T;         /* temperature (> 0) */
    int div;         /* T != 1: x = l / T */
    float m;         /* max x */
} row_t;

static inline float x_at(const row_t *r, long i) { return r->div ? r->l[i] / r->T : r->l[i]; }

static inline vf16 x_vec(const row_t *r, long i, m16 mk) {
    vf16 v = vf_mask_loadu(vf_set1(-INFINITY), mk, r->l + i);
    return r->div ? vf_div(v, vf_set1(r->T)) : v;
}

/* max and smallest finite value of l[0..n), NaN ignored (max -inf: there is no number) */
static void range_of(const float *l, long n, float *lmax, float *lmin) {
    float hi = -INFINITY, lo = INFINITY;
    long i = 0;
    vf16 ah = vf_set1(-INFINITY), al = vf_set1(INFINITY), ninf = vf_set1(-INFINITY);
    for (; i + 16 <= n; i += 16) {
        vf16 v = vf_loadu(l + i);
        ah = vf_max(v, ah);  /* NaN in v: ah kept */
        al = vf_mask_min(al, vf_cmp_gt(v, ninf), al, v);
    }
    hi = vf_reduce_max(ah);
    lo = vf_reduce_min(al);
    for (; i < n; i++) {
        if (l[i] > hi) hi = l[i];
        if (l[i] > -INFINITY && l[i] < lo) lo = l[i];
    }
    *lmax = hi;
    *lmin = lo;
}

/* e = exp(x - m) on the support {x >= tau} of entries [i0, i1), written to e (len i1 - i0);
 * returns their sum (fp32 lanes, fixed tree) */
static float block_weights(const row_t *r, long i0, long i1, float tau, float *e) {
    vf16 acc = vf_zero(), m = vf_set1(r->m), t = vf_set1(tau);
    for (long i = i0; i < i1; i += 16) {
        m16 mk = lanes(i1 - i);
        vf16 x = x_vec(r, i, mk);
        m16 in = vf_cmp_ge(x, t);
        vf16 v = vf_maskz_mov(in, exp_v(vf_sub(x, m)));
        if (e) vf_mask_storeu(e + (i - i0), mk, v);
        acc = vf_add(acc, v);
    }
    return vf_reduce_add(acc);
}

/* One pass over the row: per-block sums of e on the support {x >= tau} into blocks[], the
 * number of entries in it (*count), and, if t != NULL, for each ladder threshold t[j]
 * (all >= tau) the count and mass of {x >= t[j]} */
static void stats_pass(const row_t *r, float tau, const float *t, double *blocks, long *count, long *cnt, double *mass) {
    long nb = (r->n + SB - 1) / SB, total = 0;
    for (int j = 0; t && j < NLEV; j++) { cnt[j] = 0; mass[j] = 0.0; }
    for (long b = 0; b < nb; b++) {
        long i0 = b * SB, i1 = i0 + SB < r->n ? i0 + SB : r->n;
        vf16 acc = vf_zero(), m = vf_set1(r->m), lo = vf_set1(tau);
        vf16 macc[NLEV];
        long c[NLEV];
        for (int j = 0; j < NLEV; j++) { macc[j] = vf_zero(); c[j] = 0; }
        for (long i = i0; i < i1; i += 16) {
            m16 mk = lanes(i1 - i);
            vf16 x = x_vec(r, i, mk);
            m16 in = vf_cmp_ge(x, lo);
            vf16 v = vf_maskz_mov(in, exp_v(vf_sub(x, m)));
            acc = vf_add(acc, v);
            total += __builtin_popcount(in);
            /* the lowest rung first: most of a vocabulary lies far below every rung */
            if (t && vf_cmp_ge(x, vf_set1(t[NLEV - 1]))) {
                for (int j = 0; j < NLEV; j++) {
                    m16 k = vf_cmp_ge(x, vf_set1(t[j]));
                    c[j] += __builtin_popcount(k);
                    macc[j] = vf_mask_add(macc[j], k, macc[j], v);
                }
            }
        }
        blocks[b] = vf_reduce_add(acc);
        for (int j = 0; t && j < NLEV; j++) { cnt[j] += c[j]; mass[j] += vf_reduce_add(macc[j]); }
    }
    *count = total;
}

/* count and mass (sum of exp(x - m)) of {x >= t[j]} for a ladder t[0] > ... > t[nt-1] */
static void ladder_pass(const row_t *r, const float *t, int nt, long *cnt, double *mass) {
    for (int j = 0; j < nt; j++) { cnt[j] = 0; mass[j] = 0.0; }
    long nb = (r->n + SB - 1) / SB;
    for (long b = 0; b < nb; b++) {
        long i0 = b * SB, i1 = i0 + SB < r->n ? i0 + SB : r->n;
        vf16 m = vf_set1(r->m), low = vf_set1(t[nt - 1]), macc[NLEV];
        for (int j = 0; j < nt; j++) macc[j] = vf_zero();
        for (long i = i0; i < i1; i += 16) {
            vf16 x = x_vec(r, i, lanes(i1 - i));
            m16 in = vf_cmp_ge(x, low);
            if (!in) continue;
            vf16 v = vf_maskz_mov(in, exp_v(vf_sub(x, m)));
            for (int j = 0; j < nt; j++) {
                m16 k = vf_cmp_ge(x, vf_set1(t[j]));
                cnt[j] += __builtin_popcount(k);
                macc[j] = vf_mask_add(macc[j], k, macc[j], v);
            }
        }
        for (int j = 0; j < nt; j++) mass[j] += vf_reduce_add(macc[j]);
    }
}

/* The entries with x >= thr, in index order: ids, x, e = exp(x - m). Returns how many
 * (at most cap_n, which the caller knows to be enough). */
static long collect(const row_t *r, float thr, long cap_n, int32_t *ids, float *xs, float *es) {
    long c = 0;
    vf16 t = vf_set1(thr);
    for (long i = 0; i < r->n; i += 16) {
        m16 mk = lanes(r->n - i);
        vf16 x = x_vec(r, i, mk);
        m16 k = vf_cmp_ge(x, t);
        if (!k) continue;
        if (c + __builtin_popcount(k) > cap_n) break;  /* cannot happen when the counts are right; never overflow */
        c += vf_compress_store(xs + c, ids + c, k, x, (int32_t)i);
    }
    for (long i = 0; i < c; i += 16) {
        m16 mk = lanes(c - i);
        vf16 x = vf_maskz_loadu(mk, xs + i);
        vf_mask_storeu(es + i, mk, exp_v(vf_sub(x, vf_set1(r->m))));
    }
    return c;
}

static inline float med3(float a, float b, float c) {
    if (a > b) { float s = a; a = b; b = s; }
    if (b > c) b = c;
    return a > b ? a : b;
}

/* tau = min { v in vx : W(x > v) < P } with W the sum of w (NULL: 1 each) over the values.
 * Weighted quickselect, 3-way partitions; vx and w are permuted. n >= 1, P > 0. */
static float threshold_select(float *vx, float *w, long n, double P) {
    double above = 0.0;  /* weight of the values greater than everything in [lo, hi) */
    long lo = 0, hi = n;
    for (;;) {
        float v = med3(vx[lo], vx[lo + (hi - lo) / 2], vx[hi - 1]);
        long gt = lo, i = lo, lt = hi;
        double wg = 0.0, we = 0.0;
        while (i < lt) {  /* [lo, gt) > v, [gt, i) == v, [lt, hi) < v */
            float xi = vx[i];
            double wi = w ? (double)w[i] : 1.0;
            if (xi > v) {
                vx[i] = vx[gt]; vx[gt] = xi;
                if (w) { float s = w[i]; w[i] = w[gt]; w[gt] = s; }
                wg += wi; gt++; i++;
            } else if (xi < v) {
                lt--;
                vx[i] = vx[lt]; vx[lt] = xi;
                if (w) { float s = w[i]; w[i] = w[lt]; w[lt] = s; }
            } else {
                we += wi; i++;
            }
        }
        if (above + wg >= P && gt > lo) { hi = gt; continue; }  /* v dropped: tau is greater */
        if (above + wg + we >= P || lt == hi) return v;          /* v kept, everything below dropped */
        above += wg + we;
        lo = lt;
    }
}

/* keep the entries with x >= tau (order kept); returns the new count */
static long keep_at_least(float tau, long n, int32_t *ids, float *xs, float *es) {
    long c = 0;
    for (long i = 0; i < n; i++)
        if (xs[i] >= tau) { ids[c] = ids[i]; xs[c] = xs[i]; es[c] = es[i]; c++; }
    return c;
}

static double sum_of(const float *v, long n) {
    double s = 0.0;
    for (long i = 0; i < n; i++) s += v[i];
    return s;
}

/* top-k in one pass: the entries that can still be among the k largest, in index order. A
 * running threshold (the k-th largest value collected so far, a lower bound of the final
 * one) drops the rest as the pass goes; at the end the set is {x >= the k-th largest}, or
 * every finite entry when there are at most k. Sets *ids / *xs (malloc'd), *thr (the
 * threshold: -FLT_MAX when nothing was dropped); returns the count, -2 when out of memory. */
static long collect_top(const row_t *r, long k, int32_t **pids, float **pxs, float *pthr) {
    long capb = 4 * k + 1024, c = 0;
    int32_t *ids = (int32_t *)malloc(sizeof(int32_t) * (capb + 16));
    float *xs = (float *)malloc(sizeof(float) * (capb + 16)), *wk = (float *)malloc(sizeof(float) * (capb + 16));
    float thr = -FLT_MAX;
    if (!ids || !xs || !wk) goto oom;
    vf16 t = vf_set1(thr);
    for (long i = 0; i < r->n; i += 16) {
        vf16 x = x_vec(r, i, lanes(r->n - i));
        m16 km = vf_cmp_ge(x, t);
        if (!km) continue;
        if (c + 16 > capb) {
            if (c >= k) {  /* raise the threshold to the k-th largest so far */
                memcpy(wk, xs, sizeof(float) * c);
                thr = threshold_select(wk, NULL, c, (double)k);
                long w = 0;
                for (long j = 0; j < c; j++) if (xs[j] >= thr) { ids[w] = ids[j]; xs[w] = xs[j]; w++; }
                c = w;
            }
            if (2 * (c + 16) > capb) {  /* ties keep it full: grow */
                capb *= 2;
                int32_t *i2 = (int32_t *)realloc(ids, sizeof(int32_t) * (capb + 16));
                if (i2) ids = i2;
                float *x2 = (float *)realloc(xs, sizeof(float) * (capb + 16));
                if (x2) xs = x2;
                float *w2 = (float *)realloc(wk, sizeof(float) * (capb + 16));
                if (w2) wk = w2;
                if (!i2 || !x2 || !w2) goto oom;
            }
            t = vf_set1(thr);
            km = vf_cmp_ge(x, t);
            if (!km) continue;
        }
        c += vf_compress_store(xs + c, ids + c, km, x, (int32_t)i);
    }
    if (c > k) {
        memcpy(wk, xs, sizeof(float) * c);
        thr = threshold_select(wk, NULL, c, (double)k);
        long w = 0;
        for (long j = 0; j < c; j++) if (xs[j] >= thr) { ids[w] = ids[j]; xs[w] = xs[j]; w++; }
        c = w;
    }
    free(wk);
    *pids = ids; *pxs = xs; *pthr = thr;
    return c;
oom:
    free(ids); free(xs); free(wk);
    return -2;
}

/* the support's ids / probabilities (ids ascending) when it has at most cap entries */
static void write_support(long nc, const int32_t *ci, const float *ce, double zs, long cap, int64_t *ids, double *probs, double *out) {
    out[2] = zs; out[3] = (double)nc; out[4] = 0.0;
    if (nc > cap) return;
    for (long i = 0; i < nc; i++) { ids[i] = ci[i]; probs[i] = ce[i] / zs; }
    out[4] = (double)nc;
}

/* top-k (then top-p) without a pass over exp: the k largest are found first, so only
 * their exps are needed (Z of the top-k set) */
static int dist_top_k(row_t *r, long top_k, double top_p, long cap, int64_t *ids, double *probs, double *out) {
    int32_t *ci;
    float *cx, tau;
    long nc = collect_top(r, top_k, &ci, &cx, &tau);
    if (nc == -2) return -2;
    if (nc == 0) { free(ci); free(cx); return -1; }  /* no finite logit */
    float m = -INFINITY;
    for (long i = 0; i < nc; i++) if (cx[i] > m) m = cx[i];
    float *ce = (float *)malloc(sizeof(float) * (nc + 16)), *wx = (float *)malloc(sizeof(float) * (nc + 16)),
          *we = (float *)malloc(sizeof(float) * (nc + 16));
    int rc = 0;
    if (!ce || !wx || !we) { rc = -2; goto done; }
    if (isinf(m)) { rc = -1; goto done; }
    r->m = m;
    for (long i = 0; i < nc; i++) ce[i] = exp1(cx[i] - m);
    if (top_p < 1.0) {
        memcpy(wx, cx, sizeof(float) * nc);
        memcpy(we, ce, sizeof(float) * nc);
        tau = threshold_select(wx, we, nc, top_p * sum_of(ce, nc));
        long w = 0;
        for (long i = 0; i < nc; i++) if (cx[i] >= tau) { ci[w] = ci[i]; cx[w] = cx[i]; ce[w] = ce[i]; w++; }
        nc = w;
    }
    out[0] = m; out[1] = tau;
    write_support(nc, ci, ce, sum_of(ce, nc), cap, ids, probs, out);
done:
    free(ci); free(cx); free(ce); free(wx); free(we);
    return rc;
}

typedef struct { float t; long cnt; double mass; } rung_t;  /* {x >= t}: its size and mass */

/* the first rung (highest threshold) whose mass reaches P: its set surely holds the support */
static int first_rung(const rung_t *g, int nr, int from, double P) {
    for (int j = from; j < nr - 1; j++) if (g[j].mass >= P) return j;
    return nr - 1;  /* the last rung is every finite entry */
}

/* One row's distribution after temperature, top-k (top_k <= 0: none), top-p (>= 1: none).
 *   out[0] m, out[1] tau, out[2] Z (sum of exp(x - m) over the support), out[3] the support's
 *   size, out[4] entries written to ids/probs (the support, ids ascending, probs summing to
 *   1) when the size is <= cap, else 0.
 *   blocks (nullable, ceil(n / SB) entries): block sums of exp(x - m) over the support,
 *   written only when nothing is truncated (the support is every finite entry).
 * Returns 0, -1 when no logit is finite or one is +inf, -2 when out of memory. */
int selfspec_sample_dist(const float *logits, long n, float T, long top_k, double top_p, long cap,
                         int64_t *ids, double *probs, double *blocks, double *out) {
    row_t r = {logits, n, T, T != 1.0f, 0.0f};
    if (top_k > 0 && top_k < n) return dist_top_k(&r, top_k, top_p, cap, ids, probs, out);
    float lmax, lmin;
    range_of(logits, n, &lmax, &lmin);
    if (!(lmax > -INFINITY) || lmax == INFINITY) return -1;
    r.m = r.div ? lmax / T : lmax;
    float xmin = r.div ? lmin / T : lmin;
    if (isinf(r.m)) return -1;
    int trunc = top_p < 1.0;
    float t[NLEV];
    for (int j = 0; j < NLEV; j++) t[j] = r.m - LADDER[j];
    long nb = (n + SB - 1) / SB, nfin, cnt[NLEV];
    double mass[NLEV];
    double *bl = blocks ? blocks : (double *)malloc(sizeof(double) * nb);
    if (!bl) return -2;
    stats_pass(&r, -FLT_MAX, trunc ? t : NULL, bl, &nfin, cnt, mass);
    double z = 0.0;
    for (long b = 0; b < nb; b++) z += bl[b];
    if (!blocks) free(bl);
    out[0] = r.m; out[1] = -FLT_MAX; out[2] = z; out[3] = (double)nfin; out[4] = 0.0;
    if (!trunc && nfin > cap) return 0;  /* dense: the whole row */

    /* rungs, highest threshold first; the last one holds every finite entry */
    rung_t g[NLEV * (REFINE + 1) + 1];
    int nr = 0;
    for (int j = 0; trunc && j < NLEV; j++) if (t[j] > xmin) g[nr++] = (rung_t){t[j], cnt[j], mass[j]};
    g[nr++] = (rung_t){-FLT_MAX, nfin, z};
    double P = top_p * z;
    int lev = first_rung(g, nr, 0, P);
    /* too many candidates: a finer ladder inside the band where the support ends */
    for (int it = 0; it < REFINE && trunc && g[lev].cnt > DIRECT; it++) {
        float hi = lev > 0 ? g[lev - 1].t : r.m, lo = lev < nr - 1 ? g[lev].t : xmin;
        float sub[NLEV];
        long c2[NLEV];
        double m2[NLEV];
        int ns = 0;
        for (int j = 0; j < NLEV; j++) {
            float v = hi - (hi - lo) * (float)(j + 1) / (float)(NLEV + 1);
            if (v > lo && v < hi && (ns == 0 || v < sub[ns - 1])) sub[ns++] = v;
        }
        if (ns == 0) break;
        ladder_pass(&r, sub, ns, c2, m2);
        memmove(g + lev + ns, g + lev, sizeof(rung_t) * (nr - lev));
        for (int j = 0; j < ns; j++) g[lev + j] = (rung_t){sub[j], c2[j], m2[j]};
        nr += ns;
        long before = g[lev + ns].cnt;
        lev = first_rung(g, nr, lev, P);
        if (g[lev].cnt >= before) break;
    }
    for (;;) {
        long nc = g[lev].cnt;
        int32_t *ci = (int32_t *)malloc(sizeof(int32_t) * (nc + 16));
        float *cx = (float *)malloc(sizeof(float) * (nc + 16)), *ce = (float *)malloc(sizeof(float) * (nc + 16));
        float *wx = (float *)malloc(sizeof(float) * (nc + 16)), *we = (float *)malloc(sizeof(float) * (nc + 16));
        if (!ci || !cx || !ce || !wx || !we) { free(ci); free(cx); free(ce); free(wx); free(we); return -2; }
        nc = collect(&r, g[lev].t, nc, ci, cx, ce);
        /* the rung's fp32 mass said "enough"; the fp64 sum of the same terms must agree, else go lower */
        if (trunc && lev < nr - 1 && sum_of(ce, nc) < P) {
            free(ci); free(cx); free(ce); free(wx); free(we);
            lev++;
            continue;
        }
        float tau = -FLT_MAX;
        if (trunc) {
            memcpy(wx, cx, sizeof(float) * nc);
            memcpy(we, ce, sizeof(float) * nc);
            tau = threshold_select(wx, we, nc, P);
            nc = keep_at_least(tau, nc, ci, cx, ce);
        }
        out[1] = tau;
        write_support(nc, ci, ce, sum_of(ce, nc), cap, ids, probs, out);
        free(ci); free(cx); free(ce); free(wx); free(we);
        return 0;
    }
}

typedef struct {  /* what a draw subtracts from p */
    const row_t *q;         /* dense q over the same entries (or NULL) */
    float qtau;
    double qz;
    const int64_t *ids;     /* listed q: ids, values qv, grouped by block: order[start[b]..start[b+1]) */
    const double *qv;
    const long *order, *start;
} minus_t;

/* Residual weights w_j = max(p_j - q_j, 0) of entries [i0, i1) (block b) into w (fp64);
 * returns their sum. e, f: scratch of SB floats. One function for the block sums and for
 * the walk inside the chosen block, so both see the same numbers. */
static double block_residual(const row_t *p, float ptau, double pz, const minus_t *q, long b, long i0, long i1,
                             float *e, float *f, double *w) {
    long len = i1 - i0;
    block_weights(p, i0, i1, ptau, e);
    double s = 0.0;
    if (q->q) {
        block_weights(q->q, i0, i1, q->qtau, f);
        float ip = (float)(1.0 / pz), iq = (float)(1.0 / q->qz);
        for (long i = 0; i < len; i++) {
            float d = e[i] * ip - f[i] * iq;
            w[i] = d > 0.0f ? (double)d : 0.0;
            s += w[i];
        }
        return s;
    }
    for (long i = 0; i < len; i++) w[i] = (double)e[i] / pz;
    if (q->order) {
        for (long k = q->start[b]; k < q->start[b + 1]; k++) {
            long i = q->order[k], j = q->ids[i] - i0;
            double d = w[j] - q->qv[i];
            w[j] = d > 0.0 ? d : 0.0;
        }
    }
    for (long i = 0; i < len; i++) s += w[i];
    return s;
}

/* One draw from w_j = max(p_j - q_j, 0), j < n, normalised, by inverse CDF in index order
 * with the uniform u in [0, 1).
 *   p: dense, p_j = exp(x_j - pm) / pz on {x_j >= ptau}, x = pl / pT; pblocks (nullable):
 *      its block sums of exp(x - pm) (from selfspec_sample_dist, no truncation), used for
 *      the blocks q does not touch.
 *   q: none (ql = qprobs = NULL), dense over the same n entries (ql, qids = NULL), a dense
 *      row over qn entries at ids qids (ql, a restricted vocabulary), or explicit
 *      probabilities qprobs at ids qids (qn pairs). Ids are distinct.
 * Returns the drawn index and sets *total = sum of w, or returns -1 when sum w <= 0 (then
 * p <= q everywhere: a rejection had probability 0), or -2 when out of memory. */
long selfspec_sample_draw(const float *pl, long n, float pT, float ptau, float pm, double pz, const double *pblocks,
                          const float *ql, const int64_t *qids, long qn, float qT, float qtau, float qm, double qz,
                          const double *qprobs, double u, double *total) {
    row_t p = {pl, n, pT, pT != 1.0f, pm};
    int dense_q = ql && !qids;
    row_t q = {ql, dense_q ? n : qn, qT, qT != 1.0f, qm};
    minus_t mq = {dense_q ? &q : NULL, qtau, qz, qids, NULL, NULL, NULL};
    long nb = (n + SB - 1) / SB, res = -2;
    double *bs = (double *)malloc(sizeof(double) * nb), *w = (double *)malloc(sizeof(double) * SB);
    float *e = (float *)malloc(sizeof(float) * (SB + 16)), *f = (float *)malloc(sizeof(float) * (SB + 16));
    double *qv = NULL;
    long *order = NULL, *start = NULL;
    if (!bs || !w || !e || !f) goto done;
    if (!dense_q && qn > 0 && (ql || qprobs)) {  /* listed q: its values, grouped by block */
        qv = (double *)malloc(sizeof(double) * qn);
        order = (long *)malloc(sizeof(long) * qn);
        start = (long *)calloc(nb + 1, sizeof(long));
        if (!qv || !order || !start) goto done;
        for (long i = 0; i < qn; i++) {
            float x = ql ? x_at(&q, i) : 0.0f;
            qv[i] = qprobs ? qprobs[i] : (x >= qtau ? (double)exp1(x - qm) / qz : 0.0);
            if (qids[i] >= 0 && qids[i] < n && qv[i] > 0.0) start[qids[i] / SB + 1]++;
        }
        for (long b = 0; b < nb; b++) start[b + 1] += start[b];
        long *fill = (long *)malloc(sizeof(long) * nb);
        if (!fill) goto done;
        memcpy(fill, start, sizeof(long) * nb);
        for (long i = 0; i < qn; i++)
            if (qids[i] >= 0 && qids[i] < n && qv[i] > 0.0) order[fill[qids[i] / SB]++] = i;
        free(fill);
        mq.qv = qv; mq.order = order; mq.start = start;
    }
    for (long b = 0; b < nb; b++) {
        long i0 = b * SB, i1 = i0 + SB < n ? i0 + SB : n;
        int touched = dense_q || (order && start[b + 1] > start[b]);
        if (touched) bs[b] = block_residual(&p, ptau, pz, &mq, b, i0, i1, e, f, w);
        else bs[b] = (pblocks ? pblocks[b] : (double)block_weights(&p, i0, i1, ptau, NULL)) / pz;
    }
    double tot = 0.0;
    long bsel = -1;
    for (long b = 0; b < nb; b++) if (bs[b] > 0.0) tot += bs[b];
    *total = tot;
    if (!(tot > 0.0)) { res = -1; goto done; }
    double target = u * tot;
    for (long b = 0; b < nb; b++) {
        if (!(bs[b] > 0.0)) continue;
        bsel = b;
        if (target < bs[b]) break;
        target -= bs[b];  /* rounding may walk past the end: then the last positive block */
    }
    long i0 = bsel * SB, i1 = i0 + SB < n ? i0 + SB : n;
    block_residual(&p, ptau, pz, &mq, bsel, i0, i1, e, f, w);
    res = -1;
    for (long i = 0; i < i1 - i0; i++) {
        if (!(w[i] > 0.0)) continue;
        res = i0 + i;
        if (target < w[i]) break;
        target -= w[i];
    }
done:
    free(bs); free(w); free(e); free(f); free(qv); free(order); free(start);
    return res;
}
