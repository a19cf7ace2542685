/* Fused decoder sub-layers for the CPU path (bf16 or fp32): one call per attention or MLP
 * sub-layer instead of ~30 small torch ops each (at decode sizes the ops' dispatch cost, not
 * their arithmetic, was half of a step).
 *
 *   attention: h += [post_norm]( Wo . attend( rope(qk_norm(Wqkv . norm(h))) , cache ) )
 *   mlp      : h += [post_norm]( Wdown . (act(gate) * up) ),  gate|up = Wgu . norm(h)
 *
 * h (the residual stream), the KV cache and the weights share one storage type, bf16 or fp32
 * (ss_dims.f32); everything in between is fp32. Row invariance (a verify pass over T rows == T single-row calls, bit for bit) holds by
 * construction: each row is computed independently with fixed-order reductions, the matmuls
 * use selfspec_gemm (one fixed chain per output, see gemm.c), and a row's attention reads its
 * keys/values back from the bf16 cache (also the ones this call just wrote), loops over keys
 * lo..p in increasing order, and never looks at T (see attend_rows).
 *
 * Reductions used (each a fixed function of the row alone):
 *   sum of squares: 16 fp32 lanes over i = lane (mod 16), then lanes added 0..15 in order.
 *   score_j = chain over d: acc = fmaf(q[d], k[d][j], acc); then * scale.
 *   softmax: m = max_j s_j; e_j = exp16(s_j - m) (lane-wise, below); Z = ((e_lo + e_lo+1) + ...) in order.
 *   out[d]  = chain over j: acc = fmaf(e_j, v[j][d], acc); then / Z.
 */
#include "simd.h"
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include "pool.h"

int selfspec_gemm(long M, long K, long N, const void *x, int x_bf16, const void *w, int w_bf16,
                  int packed, void *y, int y_bf16, int nthreads);

typedef struct {
    long hidden, heads, kv_heads, head_dim, inter;
    float eps, attn_scale;
    int act;       /* 0 silu, 1 gelu (erf), 2 gelu (tanh) */
    int qk_norm;   /* per-head RMSNorm on q and k before rotary */
    int sandwich;  /* post-attention / post-MLP norms (Gemma) */
    int f32;       /* storage type of h, the KV cache and the matrices: 1 fp32, 0 bf16 */
} ss_dims;

typedef struct {
    const void *wqkv, *wo, *w_gate_up, *w_down;             /* [in, out] (ss_dims.f32's type), plain or packed,
                                                               or (layout 3) an ss_qweight: a quantized draft copy */
    int wqkv_packed, wo_packed, gu_packed, down_packed;
    const float *bqkv, *bo, *b_gate_up, *b_down;             /* fp32 or NULL */
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm;  /* fp32 */
} ss_layer;

static inline float bf2f(uint16_t v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (isnan(f)) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* the first key position p may see: 0, or p - window + 1 under a sliding window */
static inline long first_key(long p, long window) {
    return (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
}

static float sumsq(const float *x, long n) {
    vf16 acc = vf_zero();
    long i = 0;
    for (; i + 16 <= n; i += 16) { vf16 v = vf_loadu(x + i); acc = vf_fmadd(v, v, acc); }
    if (i < n) {
        vf16 v = vf_maskz_loadu(lanes16(n - i), x + i);
        acc = vf_fmadd(v, v, acc);
    }
    float lanes[16], s = 0.0f;
    vf_storeu(lanes, acc);
    for (int l = 0; l < 16; l++) s += lanes[l];
    return s;
}

/* y = x / sqrt(mean(x^2) + eps) * w  (in place allowed) */
static void rmsnorm(const float *x, const float *w, float *y, long n, float eps) {
    float r = 1.0f / sqrtf(sumsq(x, n) / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

/* HF rotate_half convention: y[d] = x[d] cos[d] - x[d+D/2] sin[d] (d < D/2), x[d] cos[d] + x[d-D/2] sin[d] */
static void rope(float *x, const float *cs, const float *sn, long D) {
    long half = D / 2;
    for (long d = 0; d < half; d++) {
        float a = x[d], b = x[d + half];
        x[d] = a * cs[d] - b * sn[d];
        x[d + half] = b * cs[d + half] + a * sn[d + half];
    }
}

/* e^x for 16 lanes (Cephes expf: x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial, scaled by
 * 2^n; ~1 ulp). Scalar libm calls made the activation the slowest part of the MLP block. */
static inline vf16 exp16(vf16 x) {
    x = vf_min(vf_set1(88.3f), vf_max(vf_set1(-87.3f), x));  /* NaN stays NaN (x86 min/max return the second operand) */
    vf16 n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf16 r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf16 p = vf_set1(1.9875691500E-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507E-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073E-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894E-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459E-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201E-1f));
    p = vf_fmadd(vf_mul(p, r), r, vf_add(r, vf_set1(1.0f)));
    return vf_scalef(p, n);
}

/* a[i] = act(gate[i]) * up[i]. silu(x) = x / (1 + e^-x); the tanh GELU
 * 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3); exact GELU via erff. */
static void gated_activation(int act, const float *gate, const float *up, float *a, long n) {
    if (act == 1) {
        for (long i = 0; i < n; i++) a[i] = 0.5f * gate[i] * (1.0f + erff(gate[i] * 0.70710678118654752f)) * up[i];
        return;
    }
    for (long i = 0; i < n; i += 16) {
        m16 mk = lanes16(n - i);
        vf16 x = vf_maskz_loadu(mk, gate + i), s;
        if (act == 0) s = x;
        else {
            vf16 x3 = vf_mul(vf_mul(x, x), x);
            s = vf_mul(vf_set1(2.0f * 0.79788456080286536f), vf_fmadd(vf_set1(0.044715f), x3, x));
        }
        vf16 z = exp16(vf_sub(vf_zero(), s));
        vf16 g = vf_div(x, vf_add(z, vf_set1(1.0f)));
        vf_mask_storeu(a + i, mk, vf_mul(g, vf_maskz_loadu(mk, up + i)));
    }
}

/* element i of a bf16 (f32 == 0) or fp32 array, as fp32 (exact) */
static inline float get_f(const void *a, long i, int f32) {
    return f32 ? ((const float *)a)[i] : bf2f(((const uint16_t *)a)[i]);
}
/* store v into element i (bf16: round to nearest even) */
static inline void put_f(void *a, long i, float v, int f32) {
    if (f32) ((float *)a)[i] = v; else ((uint16_t *)a)[i] = f2bf(v);
}
/* 16 consecutive elements from element i (masked lanes read as 0), as fp32 (exact) */
static inline __attribute__((always_inline)) vf16 load16(const void *a, long i, m16 mk, int f32) {
    if (f32) return vf_maskz_loadu(mk, (const float *)a + i);
    return vf_load_bf16((const uint16_t *)a + i, mk);
}

/* a hint that element i of a bf16 / fp32 array will be read soon (never faults) */
SS_ALWAYS void prefetch_el(const void *a, long i, int f32) {
    _mm_prefetch((const char *)a + i * (f32 ? 4 : 2), _MM_HINT_T0);
}

/* x[t] = norm(float(h[t])) for every row */
static void norm_rows(const void *h, int f32, float *x, long t0, long t1, long H, const float *w, float eps) {
    for (long t = t0; t < t1; t++) {
        for (long i = 0; i < H; i++) x[t * H + i] = get_f(h, t * H + i, f32);
        rmsnorm(x + t * H, w, x + t * H, H, eps);
    }
}

/* h[t] = store(float(h[t]) + post_norm(o[t] + bias)); bias and post_norm may be NULL */
static void add_residual(void *h, int f32, float *o, long t0, long t1, long H, const float *bias, const float *post_norm, float eps) {
    for (long t = t0; t < t1; t++) {
        float *r = o + t * H;
        if (bias) for (long i = 0; i < H; i++) r[i] += bias[i];
        if (post_norm) rmsnorm(r, post_norm, r, H, eps);
        for (long i = 0; i < H; i++) put_f(h, t * H + i, get_f(h, t * H + i, f32) + r[i], f32);
    }
}

/* Several sequences in one call (continuous batching): the rows of h are the concatenation
 * of segments, one per sequence, each with its own KV cache and positions. A segment is
 * 8 longs: {row0, rows, pos, cap, kt, vc, kt_layer_stride, vc_layer_stride} (kt/vc: the
 * cache's layer-0 base addresses; strides in bytes; rows row0..row0+rows-1 hold positions
 * pos..pos+rows-1). The matmuls run over all T rows at once (every weight streams once per
 * call, whatever the number of sequences); rope, the cache writes and attention are per row
 * against the row's own segment, with exactly the solo call's chains: a row's bits never
 * depend on the other segments, their number, order or sizes (batch invariance). */
typedef struct { long row0, rows, pos, cap; char *kt, *vc; long kt_stride, vc_stride; } ss_seg;

/* The blocks' element-wise row work (norms, rotary and the cache writes, the activation, the
 * residual) split over the team: rows are independent (each row's chains are its own), so only
 * the speed changes. Below PAR_ROWS rows one thread does it (a decode or verify step's few rows
 * cost less than waking the team); at prefill sizes this work ran on one core while the other
 * waited (128 rows: ~8% of the pass). */
#ifndef PAR_ROWS
#define PAR_ROWS 16
#endif
typedef struct {
    const ss_dims *d;
    const ss_layer *w;
    void *h;
    int mlp;       /* the MLP block's rows (its norm, bias, post-norm), else the attention block's */
    float *x, *o;  /* the block's normed input and its output before the residual */
    float *mid;    /* the first matmul's output: qkv, or the MLP's gate|up */
    float *a;      /* MLP: act(gate) * up */
    const ss_seg *segs;
    const long *seg_of;
    long T, layer;
    const float *cos, *sin;
    int what;  /* ROWS_* */
} rows_job;
enum { ROWS_NORM, ROWS_QKV, ROWS_ACT, ROWS_RESID };
static void qkv_rows(const rows_job *j, long t0, long t1);
static void act_rows(const rows_job *j, long t0, long t1);

static void rows_region(void *ctx, int tid, int nt) {
    const rows_job *j = (const rows_job *)ctx;
    const ss_dims *d = j->d;
    const ss_layer *w = j->w;
    const long H = d->hidden;
    long t0, t1;
    ss_share(j->T, tid, nt, &t0, &t1);
    if (t0 >= t1) return;
    const float *post_norm = !d->sandwich ? NULL : j->mlp ? w->post_mlp_norm : w->post_attn_norm;
    switch (j->what) {
    case ROWS_NORM: norm_rows(j->h, d->f32, j->x, t0, t1, H, j->mlp ? w->mlp_norm : w->attn_norm, d->eps); break;
    case ROWS_QKV: qkv_rows(j, t0, t1); break;
    case ROWS_ACT: act_rows(j, t0, t1); break;
    case ROWS_RESID: add_residual(j->h, d->f32, j->o, t0, t1, H, j->mlp ? w->b_down : w->bo, post_norm, d->eps); break;
    }
}

static void par_rows(rows_job *j, int what, int nthreads) {
    j->what = what;
    ss_parallel(j->T >= PAR_ROWS ? ss_threads(nthreads) : 1, rows_region, j);
}

/* Attention for query rows t = t0..t1-1 (all heads), in three phases that each split over
 * threads without changing any chain:
 *   1. scores over the union of the rows' key ranges, one pass over the keys per kv head:
 *      each 16-key slice of K is loaded once per d and used by up to 8 query rows (the
 *      g query heads sharing a kv head, and the T rows); work items = (kv head, key block);
 *   2. per row: max, e_j = exp16(s_j - m), Z summed in key order, over its own keys only;
 *   3. per (t, kv head, up to 4 of its query heads, 64-wide slice of d): out = sum_j e_j v_j in
 *      key order, / Z, each value slice loaded once for those heads.
 * Scores a row computes for keys outside its range are never read. */
#ifdef __AVX512F__
#define ROWS_PER_PASS 8
#define HEADS_PER_VPASS 4  /* phase 3: 4 heads x 4 accumulators + 4 value slices + e: 25 of 32 registers */
#else
#define ROWS_PER_PASS 6  /* 6 rows x 2 ymm accumulators + the key slice + q: 15 of 16 registers */
#define HEADS_PER_VPASS 1  /* 4 accumulators of 2 ymm each + the value slice: no room for a second head */
#endif

/* scores of RC query rows against one 16-key slice: out[r][j] = scale * chain over d of
 * fmaf(q_r[d], k[d][j], .) (keys from the cache, bf16 or fp32) */
static inline __attribute__((always_inline)) void score_rows(
    const int RC, const float *const *qp, const void *kt, long kp, long cap, long D, m16 mk, float scale,
    float *const *out, const int f32) {
    vf16 acc[8];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RC; r++) acc[r] = vf_zero();
    for (long e = 0; e < D; e++) {
        vf16 kv = load16(kt, kp + e * cap, mk, f32);
        prefetch_el(kt, kp + 32 + e * cap, f32);  /* the next line of this d-row: rows are cap apart, beyond the hardware prefetchers */
        _Pragma("GCC unroll 8")
        for (int r = 0; r < RC; r++) acc[r] = vf_fmadd(vf_set1(qp[r][e]), kv, acc[r]);
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < RC; r++) vf_mask_storeu(out[r], mk, vf_mul(acc[r], vf_set1(scale)));
}
/* phase 3 for HC heads of one kv head and one 64-wide slice of d (dl <= 64 lanes used):
 * out_h[d] = (chain over j of fmaf(e_h[j], v[j][d], .)) / Z_h, e_h = s + h * lds */
static inline __attribute__((always_inline)) void value_rows(
    const int HC, const float *s, long lds, const void *vc, long vb, long n, long D, long dl, const float *z,
    float *out, long ldo, const int f32) {
    m16 mk[4];
    for (int c = 0; c < 4; c++) mk[c] = lanes16(dl - 16 * c);
    vf16 acc[HEADS_PER_VPASS][4];
    _Pragma("GCC unroll 4")
    for (int h = 0; h < HC; h++)
        for (int c = 0; c < 4; c++) acc[h][c] = vf_zero();
    for (long j = 0; j < n; j++) {
        vf16 vv[4];
        for (int c = 0; c < 4; c++) vv[c] = load16(vc, vb + j * D + 16 * c, mk[c], f32);
        prefetch_el(vc, vb + (j + 8) * D, f32);  /* this slice 8 keys ahead (its lines are D apart) */
        prefetch_el(vc, vb + (j + 8) * D + 32, f32);
        _Pragma("GCC unroll 4")
        for (int h = 0; h < HC; h++) {
            vf16 e = vf_set1(s[h * lds + j]);
            for (int c = 0; c < 4; c++) acc[h][c] = vf_fmadd(e, vv[c], acc[h][c]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int h = 0; h < HC; h++) {
        vf16 zz = vf_set1(z[h]);
        for (int c = 0; c < 4; c++) vf_mask_storeu(out + h * ldo + 16 * c, mk[c], vf_div(acc[h][c], zz));
    }
}

typedef struct {
    const float *qkv;
    long W;
    float *att;
    long Q, t0, t1, pos, window;
    const void *kt, *vc;
    long cap, D, nh, nkv;
    float scale;
    float *sc, *zs;  /* scores [R][ld], Z [R] */
    long lo0, p_hi, nblk, ld;
} attend_job;

static inline __attribute__((always_inline)) void attend_region_impl(const attend_job *job, int tid, int nt, const int f32) {
    const float *qkv = job->qkv;
    float *att = job->att, *sc = job->sc, *zs = job->zs;
    const void *kt = job->kt, *vc = job->vc;
    const long W = job->W, Q = job->Q, t0 = job->t0, pos = job->pos, window = job->window, cap = job->cap, D = job->D, nh = job->nh, nkv = job->nkv;
    const long g = nh / nkv, nt_rows = job->t1 - t0, R = nt_rows * nh, lo0 = job->lo0, p_hi = job->p_hi, nblk = job->nblk, ld = job->ld;
    const float scale = job->scale;
    long lo_, hi_;
    ss_share(nkv * nblk, tid, nt, &lo_, &hi_);
    for (long item = lo_; item < hi_; item++) {
        long kvh = item / nblk, b = item % nblk, j0 = lo0 + 16 * b;
        m16 mk = lanes16(p_hi + 1 - j0);
        const long kp = kvh * D * cap + j0;  /* element offset of this block's first key, d = 0 */
        long nrows = nt_rows * g;  /* rows of this kv head: (t, a) with a in kvh*g .. kvh*g+g-1 */
        for (long r0 = 0; r0 < nrows; r0 += ROWS_PER_PASS) {
            int rc = nrows - r0 < ROWS_PER_PASS ? (int)(nrows - r0) : ROWS_PER_PASS;
            const float *qp[ROWS_PER_PASS];
            float *out[ROWS_PER_PASS];
            for (int r = 0; r < rc; r++) {
                long t = (r0 + r) / g, a = kvh * g + (r0 + r) % g;
                qp[r] = qkv + (t0 + t) * W + a * D;
                out[r] = sc + (t * nh + a) * ld + 16 * b;
            }
            switch (rc) {  /* a constant row count per copy: the accumulators stay in registers */
            case 8: score_rows(8, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            case 7: score_rows(7, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            case 6: score_rows(6, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            case 5: score_rows(5, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            case 4: score_rows(4, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            case 3: score_rows(3, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            case 2: score_rows(2, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            default: score_rows(1, qp, kt, kp, cap, D, mk, scale, out, f32); break;
            }
        }
    }
    ss_barrier();
    ss_share(R, tid, nt, &lo_, &hi_);
    for (long r = lo_; r < hi_; r++) {
        long t = r / nh, p = pos + t0 + t;
        long lo = first_key(p, window);
        float *s = sc + r * ld + (lo - lo0);
        long n = p - lo + 1;
        float m = -INFINITY, z = 0.0f;
        for (long j = 0; j < n; j++) m = s[j] > m ? s[j] : m;
        const vf16 mm = vf_set1(m);
        for (long j = 0; j < n; j += 16) {  /* e_j lane-wise: the same bits wherever j falls in a vector */
            m16 mk = lanes16(n - j);
            vf_mask_storeu(s + j, mk, exp16(vf_sub(vf_maskz_loadu(mk, s + j), mm)));
        }
        for (long j = 0; j < n; j++) z += s[j];
        zs[r] = z;
    }
    ss_barrier();
    /* phase 3 in items (t, kv head, group of up to HEADS_PER_VPASS of its query heads, 64-wide
     * slice of d): the heads of a group share the row's key range, so each value slice is
     * loaded once for all of them, and their independent chains keep the FMA units busy (one
     * head's four chains wait on the FMA latency). Each (row, d) chain is the same as alone. */
    long nd = (D + 63) / 64, ng = (g + HEADS_PER_VPASS - 1) / HEADS_PER_VPASS;
    ss_share(nt_rows * nkv * ng * nd, tid, nt, &lo_, &hi_);
    for (long item = lo_; item < hi_; item++) {
        long d0 = 64 * (item % nd), rest = item / nd;
        long grp = rest % ng, kvh = (rest / ng) % nkv, t = rest / (ng * nkv), p = pos + t0 + t;
        long a0 = kvh * g + grp * HEADS_PER_VPASS, na = g - grp * HEADS_PER_VPASS;
        if (na > HEADS_PER_VPASS) na = HEADS_PER_VPASS;
        long lo = first_key(p, window);
        long n = p - lo + 1, dl = D - d0 < 64 ? D - d0 : 64;
        const long vb = kvh * cap * D + lo * D + d0;  /* element offset of key lo's slice */
        const float *e = sc + (t * nh + a0) * ld + (lo - lo0), *z = zs + t * nh + a0;  /* head a0's e_j, Z */
        float *out = att + (t0 + t) * Q + a0 * D + d0;
        switch (na) {  /* a constant head count per copy: the accumulators stay in registers */
#if HEADS_PER_VPASS >= 4
        case 4: value_rows(4, e, ld, vc, vb, n, D, dl, z, out, D, f32); break;
        case 3: value_rows(3, e, ld, vc, vb, n, D, dl, z, out, D, f32); break;
        case 2: value_rows(2, e, ld, vc, vb, n, D, dl, z, out, D, f32); break;
#endif
        default: value_rows(1, e, ld, vc, vb, n, D, dl, z, out, D, f32); break;
        }
    }
}

static void attend_region_bf16(void *ctx, int tid, int nt) { attend_region_impl((const attend_job *)ctx, tid, nt, 0); }
static void attend_region_f32(void *ctx, int tid, int nt) { attend_region_impl((const attend_job *)ctx, tid, nt, 1); }

static int attend_rows(const float *qkv, long W, float *att, long Q, long t0, long t1, long pos, long window,
                       const void *kt, const void *vc, long cap, long D, long nh, long nkv, float scale, int nt, int f32) {
    const long R = (t1 - t0) * nh;
    long p_hi = pos + t1 - 1;
    long lo0 = first_key(pos + t0, window);  /* the smallest first key of these rows */
    long span = p_hi - lo0 + 1, nblk = (span + 15) / 16;
    float *sc = malloc(sizeof(float) * (R * (nblk * 16) + R));
    if (!sc) return 1;
    attend_job job = {qkv, W, att, Q, t0, t1, pos, window, kt, vc, cap, D, nh, nkv, scale, sc, sc + R * nblk * 16,
                      lo0, p_hi, nblk, nblk * 16};
    ss_parallel(nt, f32 ? attend_region_f32 : attend_region_bf16, &job);
    free(sc);
    return 0;
}

static int attend_segment(const ss_dims *d, const float *qkv, float *att, const ss_seg *s, long layer,
                          long window, int nthreads) {
    const long nh = d->heads, nkv = d->kv_heads, D = d->head_dim, Q = nh * D, W = Q + 2 * nkv * D;
    const void *kt = s->kt + layer * s->kt_stride, *vc = s->vc + layer * s->vc_stride;
    const float *q = qkv + s->row0 * W;
    float *a = att + s->row0 * Q;
    int rc = 0, nt = nthreads > 0 ? nthreads : 1;
    /* work ~ rows x heads x keys x D: fan out only when it outweighs a parallel region's
     * start (~10 us); query rows go in chunks so the score buffer stays small in a prefill */
    for (long t0 = 0; t0 < s->rows && !rc; t0 += 64) {
        long t1 = s->rows - t0 < 64 ? s->rows : t0 + 64;
        double work = (double)(t1 - t0) * (double)nh * (double)(s->pos + t1) * (double)D;
        rc = attend_rows(q, W, a, Q, t0, t1, s->pos, window, kt, vc, s->cap, D, nh, nkv, d->attn_scale,
                         work < 2.5e5 ? 1 : nt, d->f32);
    }
    return rc;
}

/* the small segments of a batch call, one per thread at a time (dynamic: sizes differ) */
typedef struct {
    const ss_dims *d;
    const float *qkv;
    float *att;
    const ss_seg *segs;
    long nseg, layer, window;
    int nt;  /* the call's thread count: which segments fanned out on their own */
    int bad;
    long next;
} segs_job;

static void segs_region(void *ctx, int tid, int nt) {
    segs_job *j = (segs_job *)ctx;
    (void)tid; (void)nt;
    const ss_dims *d = j->d;
    for (long i; (i = ss_next(&j->next, 1)) < j->nseg;) {
        const ss_seg *s = &j->segs[i];
        if (!((double)s->rows * d->heads * (s->pos + s->rows) * d->head_dim >= 2.5e5 * j->nt))
            if (attend_segment(d, j->qkv, j->att, s, j->layer, j->window, 1)) __atomic_store_n(&j->bad, 1, __ATOMIC_RELAXED);
    }
}

/* seg_of[t] = the segment holding row t; rows outside every segment: -1 */
static int row_segments(const ss_seg *segs, long nseg, long T, long *seg_of) {
    for (long t = 0; t < T; t++) seg_of[t] = -1;
    for (long i = 0; i < nseg; i++) {
        const ss_seg *s = &segs[i];
        if (s->row0 < 0 || s->rows < 0 || s->row0 + s->rows > T || s->pos < 0 || s->pos + s->rows > s->cap) return 3;
        for (long t = s->row0; t < s->row0 + s->rows; t++) seg_of[t] = i;
    }
    for (long t = 0; t < T; t++) if (seg_of[t] < 0) return 3;
    return 0;
}

/* h [T, hidden] (updated in place), rows given by segs (above); cos/sin: fp32 [T, head_dim],
 * the rotary rows of every row's own position. window <= 0: full causal. */
/* rows t0..t1-1 of the fused qkv: bias, per-head q/k norms and rotary, k and v into the cache */
static void qkv_rows(const rows_job *j, long t0, long t1) {
    const ss_dims *d = j->d;
    const ss_layer *w = j->w;
    const long nh = d->heads, nkv = d->kv_heads, D = d->head_dim, Q = nh * D, KV = nkv * D, W = Q + 2 * KV;
    const int f32 = d->f32;
    for (long t = t0; t < t1; t++) {
        const ss_seg *s = &j->segs[j->seg_of[t]];
        void *kt = s->kt + j->layer * s->kt_stride, *vc = s->vc + j->layer * s->vc_stride;
        const long cap = s->cap, p = s->pos + (t - s->row0);
        float *r = j->mid + t * W;
        if (w->bqkv) for (long i = 0; i < W; i++) r[i] += w->bqkv[i];
        const float *cs = j->cos + t * D, *sn = j->sin + t * D;
        for (long a = 0; a < nh; a++) {
            if (d->qk_norm) rmsnorm(r + a * D, w->q_norm, r + a * D, D, d->eps);
            rope(r + a * D, cs, sn, D);
        }
        for (long a = 0; a < nkv; a++) {
            float *k = r + Q + a * D, *v = r + Q + KV + a * D;
            if (d->qk_norm) rmsnorm(k, w->k_norm, k, D, d->eps);
            rope(k, cs, sn, D);
            for (long e = 0; e < D; e++) {
                put_f(kt, (a * D + e) * cap + p, k[e], f32);
                put_f(vc, (a * cap + p) * D + e, v[e], f32);
            }
        }
    }
}

/* rows t0..t1-1 of the MLP's gate|up: bias, then a = act(gate) * up */
static void act_rows(const rows_job *j, long t0, long t1) {
    const ss_dims *d = j->d;
    const long I = d->inter;
    for (long t = t0; t < t1; t++) {
        float *r = j->mid + t * 2 * I;
        if (j->w->b_gate_up) for (long i = 0; i < 2 * I; i++) r[i] += j->w->b_gate_up[i];
        gated_activation(d->act, r, r + I, j->a + t * I, I);
    }
}

static int attn_block_batch(const ss_dims *d, const ss_layer *w, void *h, long T, const ss_seg *segs, long nseg,
                            long layer, long window, const float *cos, const float *sin, int nthreads) {
    const long H = d->hidden, nh = d->heads, nkv = d->kv_heads, D = d->head_dim;
    const int f32 = d->f32, wbf = !f32;
    const long Q = nh * D, KV = nkv * D, W = Q + 2 * KV;
    float *x = malloc(sizeof(float) * T * H);
    float *qkv = malloc(sizeof(float) * T * W);
    float *att = malloc(sizeof(float) * T * Q);
    float *o = malloc(sizeof(float) * T * H);
    long *seg_of = malloc(sizeof(long) * (T + 1));
    int rc = 0;
    if (!x || !qkv || !att || !o || !seg_of) { rc = 1; goto done; }
    if ((rc = row_segments(segs, nseg, T, seg_of))) goto done;
    rows_job rj = {d, w, h, 0, x, o, qkv, NULL, segs, seg_of, T, layer, cos, sin, 0};
    par_rows(&rj, ROWS_NORM, nthreads);
    if ((rc = selfspec_gemm(T, H, W, x, 0, w->wqkv, wbf, w->wqkv_packed, qkv, 0, nthreads))) goto done;
    par_rows(&rj, ROWS_QKV, nthreads);
    /* Attention: a big segment (a prefill chunk, a long verify) fans out inside itself; the
     * small ones (decode rows) go one segment per thread. Either way each row's chains are
     * the solo call's: scheduling changes speed only. */
    int nt = nthreads > 0 ? nthreads : 1;
    for (long i = 0; i < nseg && !rc; i++) {
        const ss_seg *s = &segs[i];
        if (nseg == 1 || (double)s->rows * nh * (s->pos + s->rows) * D >= 2.5e5 * nt)
            rc = attend_segment(d, qkv, att, s, layer, window, nt);
    }
    if (rc) goto done;
    if (nseg > 1) {
        segs_job job = {d, qkv, att, segs, nseg, layer, window, nt, 0, 0};
        ss_parallel(nt, segs_region, &job);
        if ((rc = job.bad)) goto done;
    }
    if ((rc = selfspec_gemm(T, Q, H, att, 0, w->wo, wbf, w->wo_packed, o, 0, nthreads))) goto done;
    par_rows(&rj, ROWS_RESID, nthreads);
done:
    free(x); free(qkv); free(att); free(o); free(seg_of);
    return rc;
}

static int mlp_block(const ss_dims *d, const ss_layer *w, void *h, long T, int nthreads) {
    const long H = d->hidden, I = d->inter;
    const int f32 = d->f32, wbf = !f32;
    float *x = malloc(sizeof(float) * T * H);
    float *gu = malloc(sizeof(float) * T * 2 * I);
    float *a = malloc(sizeof(float) * T * I);
    float *o = malloc(sizeof(float) * T * H);
    int rc = 0;
    if (!x || !gu || !a || !o) { rc = 1; goto done; }
    rows_job rj = {d, w, h, 1, x, o, gu, a, NULL, NULL, T, 0, NULL, NULL, 0};
    par_rows(&rj, ROWS_NORM, nthreads);
    if ((rc = selfspec_gemm(T, H, 2 * I, x, 0, w->w_gate_up, wbf, w->gu_packed, gu, 0, nthreads))) goto done;
    par_rows(&rj, ROWS_ACT, nthreads);
    if ((rc = selfspec_gemm(T, I, H, a, 0, w->w_down, wbf, w->down_packed, o, 0, nthreads))) goto done;
    par_rows(&rj, ROWS_RESID, nthreads);
done:
    free(x); free(gu); free(a); free(o);
    return rc;
}

/* A forward pass's layer loop in one call: layers start..end-1 over h [T, hidden], rows in
 * `segs` (as attn_block_batch), attention then MLP per layer (a pass used to
 * make these two foreign calls per layer from Python: ~0.2 ms a pass on the default model). layers[i]: layer i; windows[i]: its sliding window (<= 0: none); rope[i]:
 * which of the cos/sin tables ([T, head_dim] fp32, one row per row of h) it uses; skip[i]:
 * bit 0 skips its attention, bit 1 its MLP. */
int selfspec_layers_batch(const ss_dims *d, const ss_layer *const *layers, long start, long end, void *h, long T,
                          const ss_seg *segs, long nseg, const long *windows, const int *rope,
                          const float *const *cos, const float *const *sin, const unsigned char *skip, int nthreads) {
    int rc = 0;
    for (long i = start; i < end && !rc; i++) {
        if (!(skip[i] & 1))
            rc = attn_block_batch(d, layers[i], h, T, segs, nseg, i, windows[i], cos[rope[i]], sin[rope[i]], nthreads);
        if (!rc && !(skip[i] & 2))
            rc = mlp_block(d, layers[i], h, T, nthreads);
    }
    return rc;
}

/* The final norm before the LM head: out[t] = store(norm(float(h[t]))), h and out bf16 or
 * fp32 (f32), one fixed reduction per row like the blocks' own norms. */
int selfspec_norm_rows(const void *h, int f32, long T, long H, const float *w, float eps, void *out) {
    float *x = malloc(sizeof(float) * H);
    if (!x) return 1;
    for (long t = 0; t < T; t++) {
        norm_rows((const char *)h + t * H * (f32 ? 4 : 2), f32, x, 0, 1, H, w, eps);
        for (long i = 0; i < H; i++) put_f(out, t * H + i, x[i], f32);
    }
    free(x);
    return 0;
}

/* Logit soft-capping in place: y = cap * tanh(y / cap), tanh(u) = 1 - 2 / (e^(2u) + 1) with
 * exp16 on every element (a masked tail runs the very same lane arithmetic), so an element's
 * result never depends on where it sits in the array. */
int selfspec_softcap(float *y, long n, float cap) {
    const vf16 inv = vf_set1(2.0f / cap), one = vf_set1(1.0f), two = vf_set1(2.0f), c = vf_set1(cap);
    for (long i = 0; i < n; i += 16) {
        m16 mk = lanes16(n - i);
        vf16 e = exp16(vf_mul(vf_maskz_loadu(mk, y + i), inv));
        vf16 t = vf_sub(one, vf_div(two, vf_add(e, one)));
        vf_mask_storeu(y + i, mk, vf_mul(t, c));
    }
    return 0;
}

/* Greedy drafting's pass in one foreign call: the embedding rows of tokens[0..T-1] at positions
 * seg's pos.. -> layers 0..end-1 -> final norm -> head -> soft-cap -> each row's argmax. These
 * are the calls the Python path makes (Runtime.embed, run_layers, logits, then argmax), in the
 * same order on the same values, so the same tokens. What it saves is the glue between them: a
 * layer pass streams every weight through the caches and evicts the interpreter's and torch's
 * code, so the handful of small ops around it cost ~0.5 ms a draft token on the default model,
 * a tenth of the token.
 *   emb: the embedding rows in d->f32's type, emb_kind 0 plain [V, H], 1 packed
 *        [ceil(V/64)][H][64], 2 pairs [ceil(V/64)][ceil(H/2)][64][2] (a tied LM head);
 *        emb_scale != 0: each element times it, rounded to the storage type (as torch does);
 *   head: [H, N] in selfspec_gemm's layout head_layout; cap: soft-cap (0: none);
 *   h, xn, y: [T, H], [T, H], [T, N] scratch in the storage type; yf: [T, N] fp32 scratch;
 *   out[t]: the first index of row t's largest logit (a NaN counts as the largest, as in torch).
 * Returns 0, or the failing kernel's code. */
int selfspec_step_argmax(const ss_dims *d, const ss_layer *const *layers, long end, const void *emb, int emb_kind,
                         const long *tokens, long T, float emb_scale, const ss_seg *seg, const long *windows, const int *rope,
                         const float *const *cos, const float *const *sin, const unsigned char *skip,
                         const float *norm_w, float eps, const void *head, int head_layout, long N, float cap,
                         void *h, void *xn, void *y, float *yf, long *out, int nthreads) {
    const long H = d->hidden;
    const int f32 = d->f32;
    for (long t = 0; t < T; t++) {
        const long tok = tokens[t];
        for (long i = 0; i < H; i++) {
            long at = emb_kind == 0 ? tok * H + i
                    : emb_kind == 1 ? ((tok / 64) * H + i) * 64 + tok % 64
                    : ((tok / 64) * ((H + 1) / 2) + i / 2) * 128 + (tok % 64) * 2 + i % 2;
            float v = get_f(emb, at, f32);
            put_f(h, t * H + i, emb_scale != 0.0f ? v * emb_scale : v, f32);
        }
    }
    int rc = selfspec_layers_batch(d, layers, 0, end, h, T, seg, 1, windows, rope, cos, sin, skip, nthreads);
    if (!rc) rc = selfspec_norm_rows(h, f32, T, H, norm_w, eps, xn);
    if (!rc) rc = selfspec_gemm(T, H, N, xn, !f32, head, !f32, head_layout, y, !f32, nthreads);
    if (rc) return rc;
    for (long i = 0; i < T * N; i++) yf[i] = get_f(y, i, f32);
    if (cap != 0.0f) selfspec_softcap(yf, T * N, cap);
    for (long t = 0; t < T; t++) {
        const float *r = yf + t * N;
        long best = 0;
        for (long i = 0; i < N; i++) {
            if (isnan(r[i])) { best = i; break; }
            if (r[i] > r[best]) best = i;
        }
        out[t] = best;
    }
    return 0;
}
