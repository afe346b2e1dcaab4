/* check_kernels.c — unit tests of the kernels and the thread pool.
 *
 * Two kinds of check. Invariance: the same outputs, byte for byte, whether
 * a batch has 1 or many rows, whether 1 or 2 threads run it, whether the
 * scalar, AVX2 or AVX-512 path runs it, and equal to a plain re-statement
 * of the ORDER RULE written here independently. Correctness: the same
 * outputs against double-precision formulas within a tight tolerance (the
 * invariance checks alone would pass a kernel that is consistently wrong).
 * Inputs come from a small PCG32 generator, so every run sees the same. */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/kernels.h"
#include "model/pool.h"

/* ------------------------------------------------------------------------
 * helpers */

typedef struct {
    uint64_t state, inc;
} test_rng;

static test_rng rng_seed(uint64_t seed)
{
    test_rng r = { 0, (seed << 1) | 1u };
    r.state = r.inc + seed;
    return r;
}

/* PCG32's step and XSH RR output; the seeding is simplified (not the
 * reference pcg32_srandom), as only reproducibility matters here. */
static uint32_t rng_u32(test_rng *r)
{
    uint64_t old = r->state;
    r->state = old * 6364136223846793005ULL + r->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18) ^ old) >> 27);
    uint32_t rot = (uint32_t)(old >> 59);
    return (xorshifted >> rot) | (xorshifted << ((32 - rot) & 31));
}

/* Uniform in [-1, 1). */
static float rng_f(test_rng *r)
{
    return (float)((double)rng_u32(r) / 2147483648.0 - 1.0);
}

static float *rand_vec(test_rng *r, size_t n, float scale)
{
    float *v = malloc(n * sizeof *v);
    ck_assert_ptr_nonnull(v);
    for (size_t i = 0; i < n; i++)
        v[i] = rng_f(r) * scale;
    return v;
}

/* Byte comparison that names the first differing element. */
static void expect_same(const float *got, const float *want, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
            ck_abort_msg("%s: element %zu differs: %a vs %a", what, i, (double)got[i],
                         (double)want[i]);
    }
}

/* The instruction sets this CPU can run; prints a note for the others once. */
static int available_isas(kern_isa out[3])
{
    static int noted = 0;
    kern_isa best = kern_isa_best();
    int n = 0;
    for (int i = KERN_ISA_SCALAR; i <= KERN_ISA_AVX512; i++) {
        if ((kern_isa)i <= best)
            out[n++] = (kern_isa)i;
        else if (!noted)
            printf("check_kernels: note: CPU lacks %s, its path is not tested\n",
                   kern_isa_name((kern_isa)i));
    }
    noted = 1;
    return n;
}

static float bf16_round_ref(float f)
{
    /* Round-to-nearest-even of the low 16 bits, by the book. */
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    uint32_t lower = b & 0xFFFFu, upper = b >> 16;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u)))
        upper++;
    b = upper << 16;
    float out;
    memcpy(&out, &b, sizeof out);
    return out;
}

/* ------------------------------------------------------------------------
 * bf16 packing */

START_TEST(test_bf16_rounding)
{
    const float one = 1.0f;
    const float vals[] = {
        1.0f,
        one + ldexpf(1.0f, -8),                     /* tie, even below: 1 */
        one + 3.0f * ldexpf(1.0f, -8),              /* tie, even above: 1 + 2^-6 */
        one + ldexpf(1.0f, -8) + ldexpf(1.0f, -20), /* just above a tie: up */
        -2.5f, 0.0f, -0.0f, 3.0e-39f /* subnormal */, FLT_MAX, -FLT_MAX, INFINITY, -INFINITY,
        65504.0f, 1.0e-20f,
    };
    const int n = (int)(sizeof vals / sizeof vals[0]);
    kern_linear L;
    ck_assert_int_eq(kern_linear_init(&L, 1, n, KERN_BF16, false), 0);
    kern_linear_set_rows(&L, 0, 1, vals);
    float back[sizeof vals / sizeof vals[0]];
    kern_linear_get_row(&L, 0, back);
    ck_assert(back[0] == 1.0f);
    ck_assert(back[1] == 1.0f);
    ck_assert(back[2] == one + ldexpf(1.0f, -6));
    ck_assert(back[3] == one + ldexpf(1.0f, -7));
    ck_assert(back[4] == -2.5f);
    ck_assert(back[5] == 0.0f && !signbit(back[5]));
    ck_assert(back[6] == 0.0f && signbit(back[6]));
    ck_assert(isinf(back[8]) && back[8] > 0);     /* FLT_MAX is past the last bf16 tie */
    ck_assert(isinf(back[9]) && back[9] < 0);
    ck_assert(isinf(back[10]) && isinf(back[11]));
    for (int i = 0; i < n; i++)
        ck_assert_msg(memcmp(&back[i], &(float){ bf16_round_ref(vals[i]) }, 4) == 0 ||
                          isinf(back[i]),
                      "value %d: %a", i, (double)vals[i]);
    kern_linear_free(&L);

    /* NaN stays NaN (a naive rounding carry could turn some into inf). */
    float nans[2];
    uint32_t nb = 0x7F80FFFFu;   /* NaN whose payload is all in the low bits */
    memcpy(&nans[0], &nb, 4);
    nans[1] = -NAN;
    ck_assert_int_eq(kern_linear_init(&L, 1, 2, KERN_BF16, false), 0);
    kern_linear_set_rows(&L, 0, 1, nans);
    kern_linear_get_row(&L, 0, back);
    ck_assert(isnan(back[0]) && isnan(back[1]));
    kern_linear_free(&L);
}
END_TEST

START_TEST(test_linear_layout)
{
    /* Panel p holds W[16p + j][k] at [k][j]; padding lanes are 0; f32 is exact. */
    test_rng r = rng_seed(1);
    const int N = 20, K = 7;
    float *W = rand_vec(&r, (size_t)N * K, 1.0f);
    for (int wt = 0; wt < 2; wt++) {
        kern_linear L;
        ck_assert_int_eq(kern_linear_init(&L, N, K, (kern_wtype)wt, true), 0);
        ck_assert_int_eq((int)((uintptr_t)L.panels % 64), 0);
        ck_assert_ptr_nonnull(L.bias);
        kern_linear_set_rows(&L, 0, 5, W);
        kern_linear_set_rows(&L, 5, N - 5, W + 5 * K);
        float row[7];
        for (int n = 0; n < N; n++) {
            kern_linear_get_row(&L, n, row);
            for (int k = 0; k < K; k++) {
                float want = wt == KERN_BF16 ? bf16_round_ref(W[n * K + k]) : W[n * K + k];
                ck_assert(memcmp(&row[k], &want, 4) == 0);
                size_t at = (size_t)(n / 16) * K * 16 + (size_t)k * 16 + (size_t)(n % 16);
                if (wt == KERN_F32) {
                    ck_assert(memcmp(&((const float *)L.panels)[at], &want, 4) == 0);
                } else {
                    uint32_t bits = (uint32_t)((const uint16_t *)L.panels)[at] << 16;
                    ck_assert(memcmp(&bits, &want, 4) == 0);
                }
            }
        }
        /* Panel 1, lanes 4..15 are padding. */
        for (int k = 0; k < K; k++)
            for (int j = 4; j < 16; j++) {
                size_t idx = (size_t)K * 16 + (size_t)k * 16 + (size_t)j;
                if (wt == KERN_F32)
                    ck_assert(((const float *)L.panels)[idx] == 0.0f);
                else
                    ck_assert(((const uint16_t *)L.panels)[idx] == 0);
            }
        kern_linear_free(&L);
        kern_linear_free(&L);   /* a zeroed struct is fine */
    }
    free(W);
}
END_TEST

/* ------------------------------------------------------------------------
 * matmul */

typedef struct {
    int n_out, n_in;
    kern_wtype wt;
    bool bias;
} mm_shape;

static void build_linear(kern_linear *L, const mm_shape *s, uint64_t seed)
{
    test_rng r = rng_seed(seed);
    float *W = rand_vec(&r, (size_t)s->n_out * s->n_in, 1.0f);
    ck_assert_int_eq(kern_linear_init(L, s->n_out, s->n_in, s->wt, s->bias), 0);
    kern_linear_set_rows(L, 0, s->n_out, W);
    if (s->bias)
        for (int n = 0; n < s->n_out; n++)
            L->bias[n] = rng_f(&r);
    free(W);
}

/* The ORDER RULE restated, as a tree rather than the kernels' binary
 * counter: k in blocks of KERN_KBLOCK, each the product of its first k
 * then fmaf in ascending k; n block sums combine as
 * tree(n) = pow2(h) + tree(n - h) with h the largest power of two <= n
 * (h = n: pow2 alone), pow2 being a perfect pairwise tree. */
static float block_sum(const float *x, const float *w, int k0, int k1)
{
    float acc = x[k0] * w[k0];
    for (int k = k0 + 1; k < k1; k++)
        acc = fmaf(x[k], w[k], acc);
    return acc;
}

static float pow2_tree(const float *x, const float *w, int K, int b0, int nb)
{
    if (nb == 1) {
        int k0 = b0 * KERN_KBLOCK;
        return block_sum(x, w, k0, K - k0 < KERN_KBLOCK ? K : k0 + KERN_KBLOCK);
    }
    return pow2_tree(x, w, K, b0, nb / 2) + pow2_tree(x, w, K, b0 + nb / 2, nb / 2);
}

static float rule_tree(const float *x, const float *w, int K, int b0, int nb)
{
    int h = 1;
    while (2 * h <= nb)
        h *= 2;
    if (h == nb)
        return pow2_tree(x, w, K, b0, nb);
    return pow2_tree(x, w, K, b0, h) + rule_tree(x, w, K, b0 + h, nb - h);
}

/* Weights read back through the public accessor; + bias at the end. */
static void matmul_rule(const kern_linear *L, const float *x, int M, float *y)
{
    const int K = L->n_in, nb = (K + KERN_KBLOCK - 1) / KERN_KBLOCK;
    float *w = malloc((size_t)K * sizeof *w);
    ck_assert_ptr_nonnull(w);
    for (int n = 0; n < L->n_out; n++) {
        kern_linear_get_row(L, n, w);
        for (int m = 0; m < M; m++) {
            float acc = rule_tree(x + (size_t)m * K, w, K, 0, nb);
            y[(size_t)m * L->n_out + n] = L->bias ? acc + L->bias[n] : acc;
        }
    }
    free(w);
}

/* y with a guard zone after the last row: a partial panel must not write past it. */
#define GUARD 32
static float *alloc_y(size_t n)
{
    float *y = malloc((n + GUARD) * sizeof *y);
    ck_assert_ptr_nonnull(y);
    for (size_t i = 0; i < n + GUARD; i++)
        y[i] = -12345.0f;
    return y;
}

static void check_guard(const float *y, size_t n)
{
    for (size_t i = n; i < n + GUARD; i++)
        ck_assert_msg(y[i] == -12345.0f, "write past y at %zu", i - n);
}

static const mm_shape mm_shapes[] = {
    { 37, 29, KERN_F32, false },     /* partial panel, odd K */
    { 37, 29, KERN_BF16, true },
    { 83, 301, KERN_F32, true },     /* 19 k blocks (not a power of 2), the last partial */
    { 83, 301, KERN_BF16, false },
    { 48, 64, KERN_F32, true },      /* whole panels */
    { 5, 3, KERN_BF16, true },       /* one partial panel only */
};

START_TEST(test_matmul_invariance)
{
    const mm_shape *s = &mm_shapes[_i];
    const int Ms[] = { 1, 3, 17, 64 };
    kern_isa isas[3];
    int nisa = available_isas(isas);
    kern_pool *pools[2] = { NULL, pool_create(2) };
    ck_assert_ptr_nonnull(pools[1]);
    kern_linear L;
    build_linear(&L, s, 100 + (uint64_t)_i);
    test_rng r = rng_seed(7);
    float *x = rand_vec(&r, (size_t)64 * s->n_in, 2.0f);
    size_t ny = (size_t)64 * s->n_out;
    float *want = alloc_y(ny), *one = alloc_y((size_t)s->n_out), *got = alloc_y(ny);

    matmul_rule(&L, x, 64, want);
    /* Each row alone (M = 1) on the scalar path, single-threaded. */
    kern_ctx c0 = { KERN_ISA_SCALAR, NULL };
    for (int m = 0; m < 64; m++) {
        kern_matmul(&c0, &L, x + (size_t)m * s->n_in, 1, one);
        check_guard(one, (size_t)s->n_out);
        expect_same(one, want + (size_t)m * s->n_out, (size_t)s->n_out, "scalar M=1 vs rule");
    }
    for (int ii = 0; ii < nisa; ii++)
        for (int t = 0; t < 2; t++)
            for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++) {
                int M = Ms[mi];
                kern_ctx c = { isas[ii], pools[t] };
                for (size_t i = 0; i < ny + GUARD; i++)
                    got[i] = -12345.0f;
                kern_matmul(&c, &L, x, M, got);
                check_guard(got, (size_t)M * s->n_out);
                char what[128];
                snprintf(what, sizeof what, "%dx%d %s%s isa=%s threads=%d M=%d", s->n_out,
                         s->n_in, s->wt == KERN_BF16 ? "bf16" : "f32", s->bias ? "+b" : "",
                         kern_isa_name(isas[ii]), t + 1, M);
                expect_same(got, want, (size_t)M * s->n_out, what);
            }
    free(x);
    free(want);
    free(one);
    free(got);
    kern_linear_free(&L);
    pool_free(pools[1]);
}
END_TEST

START_TEST(test_matmul_large)
{
    /* More panels than one L2 block (54 f32 panels of k=300) and more rows
     * than a row tile: every blocking loop runs more than once. */
    const mm_shape s = { 1100, 300, KERN_F32, true };
    kern_isa isas[3];
    int nisa = available_isas(isas);
    kern_pool *pool = pool_create(2);
    kern_linear L;
    build_linear(&L, &s, 5);
    test_rng r = rng_seed(9);
    const int M = 19;
    float *x = rand_vec(&r, (size_t)M * s.n_in, 1.0f);
    size_t ny = (size_t)M * s.n_out;
    float *want = alloc_y(ny), *got = alloc_y(ny);
    matmul_rule(&L, x, M, want);
    for (int ii = 0; ii < nisa; ii++) {
        kern_ctx c = { isas[ii], pool };
        kern_matmul(&c, &L, x, M, got);
        check_guard(got, ny);
        expect_same(got, want, ny, kern_isa_name(isas[ii]));
    }
    free(x);
    free(want);
    free(got);
    kern_linear_free(&L);
    pool_free(pool);
}
END_TEST

START_TEST(test_matmul_vs_double)
{
    /* Proves the rule computes x W^T + b: error of a K-term fma sum is at
     * most about K ulp of sum |x w|. */
    for (int wt = 0; wt < 2; wt++) {
        const mm_shape s = { 45, 77, (kern_wtype)wt, true };
        kern_linear L;
        build_linear(&L, &s, 11);
        test_rng r = rng_seed(12);
        const int M = 9;
        float *x = rand_vec(&r, (size_t)M * s.n_in, 3.0f);
        float *y = alloc_y((size_t)M * s.n_out);
        float w[77];
        kern_ctx c = { kern_isa_best(), NULL };
        kern_matmul(&c, &L, x, M, y);
        for (int n = 0; n < s.n_out; n++) {
            kern_linear_get_row(&L, n, w);
            for (int m = 0; m < M; m++) {
                double ref = L.bias[n], mag = fabs(L.bias[n]);
                for (int k = 0; k < s.n_in; k++) {
                    ref += (double)x[m * s.n_in + k] * w[k];
                    mag += fabs((double)x[m * s.n_in + k] * w[k]);
                }
                double err = fabs(y[m * s.n_out + n] - ref);
                ck_assert_msg(err <= (s.n_in + 1) * FLT_EPSILON * mag,
                              "y[%d][%d] = %.9g, want %.9g", m, n, (double)y[m * s.n_out + n], ref);
            }
        }
        free(x);
        free(y);
        kern_linear_free(&L);
    }
}
END_TEST

START_TEST(test_matmul_negative_zero)
{
    /* A block starts with its first product, not with +0: when every
     * product is an exact -0 (x < 0, w = +0) the sum is -0 on every path,
     * where fmaf onto +0 would give +0. */
    const int N = 20, K = 37;
    kern_linear L;
    ck_assert_int_eq(kern_linear_init(&L, N, K, KERN_F32, false), 0);
    float x[5 * 37], y[5 * 20];
    for (int i = 0; i < 5 * K; i++)
        x[i] = -1.0f - (float)i;
    kern_isa isas[3];
    int nisa = available_isas(isas);
    for (int ii = 0; ii < nisa; ii++)
        for (int M = 1; M <= 5; M += 4) {
            kern_ctx c = { isas[ii], NULL };
            kern_matmul(&c, &L, x, M, y);
            for (int i = 0; i < M * N; i++)
                ck_assert_msg(y[i] == 0.0f && signbit(y[i]), "%s M=%d y[%d] = %g",
                              kern_isa_name(isas[ii]), M, i, (double)y[i]);
        }
    kern_linear_free(&L);
}
END_TEST

START_TEST(test_matmul_accuracy)
{
    /* The point of the block rule: a long sum stays close to the exact one.
     * A Qwen2.5-0.5B-sized projection (K = 896 and the down projection's
     * 4864, weights scaled by K^-1/2) against the float64 sum of the same
     * float products: one fmaf accumulator over all of k lands 2.8 and 6.7
     * units of max|y| 2^-24 off (RMS); the block rule 0.53 and 0.58. */
    const int Ks[] = { 896, 4864 };
    for (int ki = 0; ki < 2; ki++) {
        const int K = Ks[ki], N = 64, M = 16;
        test_rng r = rng_seed(21 + (uint64_t)ki);
        float *W = rand_vec(&r, (size_t)N * K, (float)(sqrt(3.0) / sqrt((double)K)));
        float *x = rand_vec(&r, (size_t)M * K, (float)sqrt(3.0));
        float *y = alloc_y((size_t)M * N);
        kern_linear L;
        ck_assert_int_eq(kern_linear_init(&L, N, K, KERN_F32, false), 0);
        kern_linear_set_rows(&L, 0, N, W);
        kern_ctx c = { kern_isa_best(), NULL };
        kern_matmul(&c, &L, x, M, y);
        double ss = 0, ymax = 0;
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double ref = 0;
                for (int k = 0; k < K; k++)
                    ref += (double)x[(size_t)m * K + k] * W[(size_t)n * K + k];
                double d = y[(size_t)m * N + n] - ref;
                ss += d * d;
                ymax = fmax(ymax, fabs(ref));
            }
        double rms_units = sqrt(ss / (M * N)) / (ymax * ldexp(1.0, -24));
        ck_assert_msg(rms_units < 1.0, "K=%d: RMS error %.2f units of max|y| 2^-24", K, rms_units);
        free(W);
        free(x);
        free(y);
        kern_linear_free(&L);
    }
}
END_TEST

/* ------------------------------------------------------------------------
 * dot */

static float dot_rule(const float *a, const float *b, int n)
{
    float s[8] = { 0 };
    for (int i = 0; i < n; i++)
        s[i % 8] = fmaf(a[i], b[i], s[i % 8]);
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

START_TEST(test_dot)
{
    test_rng r = rng_seed(3);
    float *a = rand_vec(&r, 300, 1.0f), *b = rand_vec(&r, 300, 1.0f);
    for (int n = 0; n <= 300; n += (n < 40 ? 1 : 37)) {
        float got = kern_dot(a, b, n), want = dot_rule(a, b, n);
        ck_assert_msg(memcmp(&got, &want, 4) == 0, "n=%d: %a vs %a", n, (double)got, (double)want);
        double ref = 0, mag = 0;
        for (int i = 0; i < n; i++) {
            ref += (double)a[i] * b[i];
            mag += fabs((double)a[i] * b[i]);
        }
        ck_assert(fabs(got - ref) <= (n + 3) * FLT_EPSILON * mag);
    }
    /* Missing lanes contribute nothing, not even +0: nine products that
     * each round to -0 leave every lane at -0, so the sum is -0. */
    float ta[9], tb[9];
    for (int i = 0; i < 9; i++) {
        ta[i] = -1e-30f;
        tb[i] = 1e-30f;
    }
    float z = kern_dot(ta, tb, 9);
    ck_assert(z == 0.0f && signbit(z));
    free(a);
    free(b);
}
END_TEST

/* ------------------------------------------------------------------------
 * attention */

typedef struct {
    int M, H, KV, D, nkeys;
    float scale;
    float *q, *kv_k, *kv_v;      /* q (M, H*D); keys/values (nkeys, KV*D) */
    const float **krow, **vrow;  /* permuted: visiting order != storage order */
    int *kbeg, *kend;
} attn_case;

static attn_case attn_make(int M, int H, int KV, int D, int nkeys, int window, uint64_t seed)
{
    attn_case a = { M, H, KV, D, nkeys, 1.0f / sqrtf((float)D), NULL, NULL, NULL,
                    NULL, NULL, NULL, NULL };
    test_rng r = rng_seed(seed);
    a.q = rand_vec(&r, (size_t)M * H * D, 2.0f);
    a.kv_k = rand_vec(&r, (size_t)nkeys * KV * D, 2.0f);
    a.kv_v = rand_vec(&r, (size_t)nkeys * KV * D, 1.0f);
    a.krow = malloc((size_t)nkeys * sizeof *a.krow);
    a.vrow = malloc((size_t)nkeys * sizeof *a.vrow);
    a.kbeg = malloc((size_t)M * sizeof *a.kbeg);
    a.kend = malloc((size_t)M * sizeof *a.kend);
    ck_assert(a.krow && a.vrow && a.kbeg && a.kend);
    /* A ring buffer: visiting order j is storage slot (j + 5) % nkeys. */
    for (int j = 0; j < nkeys; j++) {
        a.krow[j] = a.kv_k + (size_t)((j + 5) % nkeys) * KV * D;
        a.vrow[j] = a.kv_v + (size_t)((j + 5) % nkeys) * KV * D;
    }
    /* Causal, the last M positions of nkeys, with an optional window. */
    for (int m = 0; m < M; m++) {
        a.kend[m] = nkeys - M + m + 1;
        a.kbeg[m] = window > 0 && a.kend[m] > window ? a.kend[m] - window : 0;
    }
    return a;
}

static void attn_free(attn_case *a)
{
    free(a->q);
    free(a->kv_k);
    free(a->kv_v);
    free(a->krow);
    free(a->vrow);
    free(a->kbeg);
    free(a->kend);
}

/* The value sum of keys [j0, j0 + n) for column c, weights p (indexed
 * like the keys): the matmul's block tree (rule_tree) over keys. */
static float pv_tree(const float *p, const float *const *vrow, size_t col, int j0, int n)
{
    if (n <= KERN_KBLOCK) {
        float acc = p[j0] * vrow[j0][col];
        for (int j = j0 + 1; j < j0 + n; j++)
            acc = fmaf(p[j], vrow[j][col], acc);
        return acc;
    }
    int nb = (n + KERN_KBLOCK - 1) / KERN_KBLOCK, h = 1;
    while (2 * h < nb)
        h *= 2;    /* the largest power of two below nb: the left subtree */
    int left = h * KERN_KBLOCK;
    return pv_tree(p, vrow, col, j0, left) + pv_tree(p, vrow, col, j0 + left, n - left);
}

/* The documented sequence, restated: l and the final division in double,
 * the value sum per chunk of 4096 keys as a block tree, chunks in turn. */
static void attn_rule(const attn_case *a, float *out, float *lse)
{
    const int D = a->D, HD = a->H * a->D;
    float *s = malloc((size_t)a->nkeys * sizeof *s);
    ck_assert_ptr_nonnull(s);
    for (int m = 0; m < a->M; m++)
        for (int h = 0; h < a->H; h++) {
            const float *q = a->q + (size_t)m * HD + h * D;
            float *o = out + (size_t)m * HD + h * D;
            int g = h / (a->H / a->KV);
            float mx = -INFINITY;
            double l = 0.0;
            for (int j = a->kbeg[m]; j < a->kend[m]; j++) {
                s[j] = dot_rule(q, a->krow[j] + g * D, D) * a->scale;
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int j = a->kbeg[m]; j < a->kend[m]; j++) {
                s[j] = expf(s[j] - mx);
                l += s[j];
            }
            for (int d = 0; d < D; d++) {
                float acc = 0.0f;
                for (int c0 = a->kbeg[m]; c0 < a->kend[m]; c0 += 4096) {
                    int cn = a->kend[m] - c0 < 4096 ? a->kend[m] - c0 : 4096;
                    float part = pv_tree(s, a->vrow, (size_t)g * D + d, c0, cn);
                    acc = c0 == a->kbeg[m] ? part : acc + part;
                }
                o[d] = (float)(acc / l);
            }
            lse[m * a->H + h] = (float)(mx + log(l));
        }
    free(s);
}

static void attn_check_double(const attn_case *a, const float *out, const float *lse)
{
    const int D = a->D, HD = a->H * a->D;
    for (int m = 0; m < a->M; m++)
        for (int h = 0; h < a->H; h++) {
            const float *q = a->q + (size_t)m * HD + h * D;
            int g = h / (a->H / a->KV);
            double mx = -INFINITY;
            int n = a->kend[m] - a->kbeg[m];
            double *s = malloc((size_t)n * sizeof *s);
            ck_assert_ptr_nonnull(s);
            for (int j = 0; j < n; j++) {
                double acc = 0;
                for (int d = 0; d < D; d++)
                    acc += (double)q[d] * a->krow[a->kbeg[m] + j][g * D + d];
                s[j] = acc * a->scale;
                mx = fmax(mx, s[j]);
            }
            double l = 0;
            for (int j = 0; j < n; j++)
                l += exp(s[j] - mx);
            for (int d = 0; d < D; d++) {
                double o = 0;
                for (int j = 0; j < n; j++)
                    o += exp(s[j] - mx) * a->vrow[a->kbeg[m] + j][g * D + d];
                o /= l;
                ck_assert_msg(fabs(out[(size_t)m * HD + h * D + d] - o) < 2e-5,
                              "out[%d][%d][%d] = %.8g, want %.8g", m, h, d,
                              (double)out[(size_t)m * HD + h * D + d], o);
            }
            ck_assert(fabs(lse[m * a->H + h] - (mx + log(l))) < 2e-5 * (1 + fabs(mx + log(l))));
            free(s);
        }
}

static const struct { int M, H, KV, D, nkeys, window; } attn_cases[] = {
    { 7, 4, 2, 20, 40, 0 },      /* GQA 2:1, D not a multiple of 8 or 16 */
    { 5, 6, 2, 64, 33, 9 },      /* GQA 3:1, sliding window (kbeg > 0) */
    { 3, 2, 2, 128, 50, 0 },     /* one register chunk of 128 */
    { 2, 2, 1, 200, 21, 0 },     /* 128 + a partial chunk */
};

START_TEST(test_attention_invariance)
{
    const int ci = _i;
    attn_case a = attn_make(attn_cases[ci].M, attn_cases[ci].H, attn_cases[ci].KV,
                            attn_cases[ci].D, attn_cases[ci].nkeys, attn_cases[ci].window,
                            40 + (uint64_t)ci);
    const size_t no = (size_t)a.M * a.H * a.D, nl = (size_t)a.M * a.H;
    float *want = malloc(no * sizeof *want), *wl = malloc(nl * sizeof *wl);
    float *got = malloc(no * sizeof *got), *gl = malloc(nl * sizeof *gl);
    ck_assert(want && wl && got && gl);
    attn_rule(&a, want, wl);
    attn_check_double(&a, want, wl);

    kern_isa isas[3];
    int nisa = available_isas(isas);
    kern_pool *pools[2] = { NULL, pool_create(2) };
    for (int ii = 0; ii < nisa; ii++)
        for (int t = 0; t < 2; t++) {
            kern_ctx c = { isas[ii], pools[t] };
            char what[96];
            snprintf(what, sizeof what, "case %d isa=%s threads=%d", ci,
                     kern_isa_name(isas[ii]), t + 1);
            kern_attention(&c, a.M, a.q, a.H, a.KV, a.D, a.scale, a.krow, a.vrow, a.kbeg,
                           a.kend, got, gl);
            expect_same(got, want, no, what);
            expect_same(gl, wl, nl, what);
            /* Each row on its own (M = 1). */
            for (int m = 0; m < a.M; m++) {
                kern_attention(&c, 1, a.q + (size_t)m * a.H * a.D, a.H, a.KV, a.D, a.scale,
                               a.krow, a.vrow, a.kbeg + m, a.kend + m, got, gl);
                expect_same(got, want + (size_t)m * a.H * a.D, (size_t)a.H * a.D, what);
                expect_same(gl, wl + (size_t)m * a.H, (size_t)a.H, what);
            }
        }
    pool_free(pools[1]);
    free(want);
    free(wl);
    free(got);
    free(gl);
    attn_free(&a);
}
END_TEST

START_TEST(test_attention_long)
{
    /* More keys than the score buffer: scores are computed in chunks and
     * twice; the result must not notice. */
    attn_case a = attn_make(2, 2, 1, 12, 5000, 0, 77);
    const size_t no = (size_t)a.M * a.H * a.D, nl = (size_t)a.M * a.H;
    float want[48], wl[4], got[48], gl[4];
    ck_assert(no <= 48 && nl <= 4);
    attn_rule(&a, want, wl);
    attn_check_double(&a, want, wl);
    kern_isa isas[3];
    int nisa = available_isas(isas);
    kern_pool *pool = pool_create(2);
    for (int ii = 0; ii < nisa; ii++) {
        kern_ctx c = { isas[ii], pool };
        kern_attention(&c, a.M, a.q, a.H, a.KV, a.D, a.scale, a.krow, a.vrow, a.kbeg, a.kend,
                       got, gl);
        expect_same(got, want, no, kern_isa_name(isas[ii]));
        expect_same(gl, wl, nl, kern_isa_name(isas[ii]));
    }
    pool_free(pool);
    attn_free(&a);
}
END_TEST

START_TEST(test_attention_negative_zero)
{
    /* Value blocks start with their first product too: values that are
     * all -0 give -0 on every path (fmaf onto +0 would give +0). */
    attn_case a = attn_make(3, 2, 1, 24, 37, 0, 17);
    for (int i = 0; i < 37 * 24; i++)
        a.kv_v[i] = -0.0f;
    float out[3 * 2 * 24], lse[3 * 2];
    kern_isa isas[3];
    int nisa = available_isas(isas);
    for (int ii = 0; ii < nisa; ii++) {
        kern_ctx c = { isas[ii], NULL };
        kern_attention(&c, 3, a.q, 2, 1, 24, a.scale, a.krow, a.vrow, a.kbeg, a.kend, out, lse);
        for (int i = 0; i < 3 * 2 * 24; i++)
            ck_assert_msg(out[i] == 0.0f && signbit(out[i]), "%s out[%d] = %g",
                          kern_isa_name(isas[ii]), i, (double)out[i]);
    }
    attn_free(&a);
}
END_TEST

START_TEST(test_attention_accuracy)
{
    /* The value sums over many keys: 3000 keys (one chunk), 4 heads of 64,
     * against float64. One fmaf accumulator per column over the keys and a
     * float sum of the weights land 6.0 units of max|out| 2^-24 off
     * (RMS); blocks of 16 keys combined pairwise and l in double, 0.6. */
    attn_case a = attn_make(1, 4, 4, 64, 3000, 0, 91);
    const int D = a.D, HD = a.H * a.D, n = a.nkeys;
    float out[256], lse[4];
    kern_ctx c = { kern_isa_best(), NULL };
    kern_attention(&c, 1, a.q, a.H, a.KV, D, a.scale, a.krow, a.vrow, a.kbeg, a.kend, out, lse);
    double *p = malloc((size_t)n * sizeof *p), ss = 0, omax = 0;
    ck_assert_ptr_nonnull(p);
    for (int h = 0; h < a.H; h++) {
        double mx = -INFINITY, l = 0;
        for (int j = 0; j < n; j++) {
            /* The kernel's own float scores and weights: this measures the
             * two sums and the division alone. */
            p[j] = kern_dot(a.q + h * D, a.krow[j] + h * D, D) * a.scale;
            mx = fmax(mx, p[j]);
        }
        for (int j = 0; j < n; j++) {
            p[j] = expf((float)(p[j] - mx));
            l += p[j];
        }
        for (int d = 0; d < D; d++) {
            double o = 0;
            for (int j = 0; j < n; j++)
                o += p[j] * a.vrow[j][h * D + d];
            o /= l;
            ss += (out[h * D + d] - o) * (out[h * D + d] - o);
            omax = fmax(omax, fabs(o));
        }
    }
    double rms_units = sqrt(ss / HD) / (omax * ldexp(1.0, -24));
    ck_assert_msg(rms_units < 1.5, "RMS error %.2f units of max|out| 2^-24", rms_units);
    free(p);
    attn_free(&a);
}
END_TEST

START_TEST(test_attention_gqa_and_empty)
{
    /* Values of KV head g are all c_g = 1, 2, 4: the weighted mean of equal
     * values is that value up to the rounding of the two sums (a few
     * 2^-24), so head h must read c_{h / (H / KV)}, far from the others. */
    const int H = 6, KV = 3, D = 16, nk = 10;
    attn_case a = attn_make(3, H, KV, D, nk, 0, 5);
    for (int j = 0; j < nk; j++)
        for (int g = 0; g < KV; g++)
            for (int d = 0; d < D; d++)
                a.kv_v[(size_t)j * KV * D + g * D + d] = g == 2 ? 4.0f : (float)(g + 1);
    a.kbeg[1] = a.kend[1] = 4;   /* row 1: empty range */
    float out[3 * 6 * 16], lse[3 * 6];
    kern_isa isas[3];
    int nisa = available_isas(isas);
    for (int ii = 0; ii < nisa; ii++) {
        kern_ctx c = { isas[ii], NULL };
        kern_attention(&c, 3, a.q, H, KV, D, a.scale, a.krow, a.vrow, a.kbeg, a.kend, out, lse);
        for (int m = 0; m < 3; m++)
            for (int h = 0; h < H; h++)
                for (int d = 0; d < D; d++) {
                    int g = h / (H / KV);
                    float want = m == 1 ? 0.0f : (g == 2 ? 4.0f : (float)(g + 1));
                    ck_assert_msg(fabsf(out[(m * H + h) * D + d] - want) <= 1e-6f * want,
                                  "m=%d h=%d: %g", m, h, (double)out[(m * H + h) * D + d]);
                }
        for (int h = 0; h < H; h++) {
            ck_assert(isinf(lse[H + h]) && lse[H + h] < 0);
            ck_assert(isfinite(lse[h]));
        }
    }
    attn_free(&a);
}
END_TEST

/* ------------------------------------------------------------------------
 * rmsnorm, rope, activations */

START_TEST(test_rmsnorm)
{
    test_rng r = rng_seed(21);
    const int n = 37;
    float *x = rand_vec(&r, n, 3.0f), *w = rand_vec(&r, n, 1.0f);
    float out[37], out2[37], stats[3];
    for (int plus_one = 0; plus_one < 2; plus_one++) {
        kern_rmsnorm(x, w, n, 1e-6, plus_one, out, stats);
        double ss = 0, sum = 0, amax = 0;
        for (int i = 0; i < n; i++) {
            ss += (double)x[i] * x[i];
            sum += x[i];
            amax = fmax(amax, fabs(x[i]));
        }
        ck_assert(stats[0] == (float)(sum / n));
        ck_assert(stats[1] == (float)sqrt(ss / n));
        ck_assert(stats[2] == (float)amax);
        double scale = 1.0 / sqrt(ss / n + 1e-6);
        for (int i = 0; i < n; i++) {
            double wi = plus_one ? 1.0 + (double)w[i] : (double)w[i];
            float want = (float)((double)x[i] * scale * wi);
            ck_assert(memcmp(&out[i], &want, 4) == 0);
            /* One rounding: within half an ulp of the exact value (three
             * float roundings, as the frameworks do, miss this). */
            double exact = x[i] / sqrt(ss / n + 1e-6) * (plus_one ? 1.0 + w[i] : w[i]);
            ck_assert_msg(fabs(out[i] - exact) <= 0.5000001 * FLT_EPSILON * fabs(exact) + 1e-30,
                          "element %d (plus_one %d): %.9g vs %.17g", i, plus_one,
                          (double)out[i], exact);
        }
        /* In place gives the same bytes. */
        memcpy(out2, x, sizeof out2);
        kern_rmsnorm(out2, w, n, 1e-6, plus_one, out2, NULL);
        expect_same(out2, out, (size_t)n, "in place");
    }
    free(x);
    free(w);
}
END_TEST

START_TEST(test_rope)
{
    const int D = 16, half = 8;
    double inv[8], inv2[8];
    kern_rope_inv_freq(10000.0, D, inv);
    for (int d = 0; d < half; d++)
        ck_assert(inv[d] == pow(10000.0, -(2.0 * d) / D));
    ck_assert(inv[0] == 1.0);

    float c[8], s[8];
    const double pos = 4321.0;
    kern_rope_table(pos, inv, D, c, s);
    for (int d = 0; d < half; d++) {
        ck_assert(c[d] == (float)cos(pos * inv[d]));
        ck_assert(s[d] == (float)sin(pos * inv[d]));
    }

    /* Rotate-half layout: pairs are (d, d + D/2), not (2d, 2d+1). */
    test_rng r = rng_seed(8);
    float *x = rand_vec(&r, 2 * (size_t)D, 1.0f);
    float y[32];
    memcpy(y, x, sizeof y);
    kern_rope_apply(y, 2, D, c, s);
    for (int h = 0; h < 2; h++)
        for (int d = 0; d < half; d++) {
            double x1 = x[h * D + d], x2 = x[h * D + d + half];
            double e1 = x1 * c[d] - x2 * s[d], e2 = x2 * c[d] + x1 * s[d];
            float w1 = (float)e1, w2 = (float)e2;
            ck_assert(memcmp(&y[h * D + d], &w1, 4) == 0);
            ck_assert(memcmp(&y[h * D + d + half], &w2, 4) == 0);
            /* One rounding of the exact rotation of the float tables. */
            ck_assert(fabs(y[h * D + d] - e1) <= 0.5000001 * FLT_EPSILON * fabs(e1));
            ck_assert(fabs(y[h * D + d + half] - e2) <= 0.5000001 * FLT_EPSILON * fabs(e2));
            double a = pos * inv[d];
            ck_assert(fabs(y[h * D + d] - (x1 * cos(a) - x2 * sin(a))) < 1e-6);
        }
    /* Position 0 is the identity. */
    kern_rope_table(0.0, inv, D, c, s);
    memcpy(y, x, sizeof y);
    kern_rope_apply(y, 2, D, c, s);
    expect_same(y, x, 32, "rope at 0");
    free(x);

    /* Scaling: linear divides everything; llama3 keeps high frequencies,
     * divides low ones and blends the band between (Llama 3.1 numbers). */
    double big[64], lin[64];
    kern_rope_inv_freq(500000.0, 128, big);
    memcpy(lin, big, sizeof lin);
    kern_rope_scale_inv_freq(lin, 64, 1, 8.0, 1.0, 4.0, 8192);
    for (int d = 0; d < 64; d++)
        ck_assert(lin[d] == big[d] / 8.0);
    double l3[64];
    memcpy(l3, big, sizeof l3);
    kern_rope_scale_inv_freq(l3, 64, 2, 8.0, 1.0, 4.0, 8192);
    int kept = 0, divided = 0, blended = 0;
    for (int d = 0; d < 64; d++) {
        double wl = 2 * 3.14159265358979323846 / big[d];
        if (wl < 8192.0 / 4.0) {
            ck_assert(l3[d] == big[d]);
            kept++;
        } else if (wl > 8192.0) {
            ck_assert(l3[d] == big[d] / 8.0);
            divided++;
        } else {
            double sm = (8192.0 / wl - 1.0) / 3.0;
            ck_assert(fabs(l3[d] - ((1 - sm) * big[d] / 8.0 + sm * big[d])) <= 1e-15 * big[d]);
            ck_assert(l3[d] < big[d] && l3[d] > big[d] / 8.0);
            blended++;
        }
    }
    ck_assert(kept > 0 && divided > 0 && blended > 0);
    memcpy(inv2, inv, sizeof inv2);
    kern_rope_scale_inv_freq(inv2, 8, 0, 8.0, 1.0, 4.0, 8192);
    ck_assert(memcmp(inv2, inv, sizeof inv) == 0);
}
END_TEST

START_TEST(test_activations)
{
    test_rng r = rng_seed(31);
    const int n = 200;
    float *g = rand_vec(&r, n, 8.0f), *u = rand_vec(&r, n, 2.0f);
    g[0] = 0.0f;
    g[1] = -30.0f;
    g[2] = 30.0f;
    float a[200], b[200];
    memcpy(a, g, sizeof a);
    memcpy(b, g, sizeof b);
    kern_silu_mul(a, u, n);
    kern_gelu_tanh_mul(b, u, n);
    for (int i = 0; i < n; i++) {
        double x = g[i];
        double silu = x / (1.0 + exp(-x));
        double gelu = 0.5 * x * (1.0 + tanh(sqrt(2.0 / 3.14159265358979323846) *
                                            (x + 0.044715 * x * x * x)));
        /* act * up in double, one rounding: within half an ulp (rounding
         * the activation first and then the product misses this). */
        ck_assert_msg(a[i] == (float)(silu * u[i]), "silu(%g)", x);
        ck_assert_msg(b[i] == (float)(gelu * u[i]), "gelu(%g)", x);
        ck_assert_msg(fabs(a[i] - silu * u[i]) <= 0.5000001 * FLT_EPSILON * fabs(silu * u[i]) + 1e-37,
                      "silu(%g) * %g", x, (double)u[i]);
        ck_assert_msg(fabs(b[i] - gelu * u[i]) <= 0.5000001 * FLT_EPSILON * fabs(gelu * u[i]) + 1e-37,
                      "gelu(%g) * %g", x, (double)u[i]);
    }
    ck_assert(a[0] == 0.0f && b[0] == 0.0f);
    /* Known values: gelu_tanh(1) = 0.841191990607..., silu(1) = 0.731058578630... */
    float one = 1.0f, up = 1.0f;
    kern_gelu_tanh_mul(&one, &up, 1);
    ck_assert(fabs(one - 0.8411919906082768) < 1e-7);
    one = 1.0f;
    kern_silu_mul(&one, &up, 1);
    ck_assert(fabs(one - 0.7310585786300049) < 1e-7);
    free(g);
    free(u);
}
END_TEST

/* ------------------------------------------------------------------------
 * isa names, pool */

START_TEST(test_isa)
{
    kern_isa isa = KERN_ISA_SCALAR;
    ck_assert_int_eq(kern_isa_parse("avx2", &isa), 0);
    ck_assert_int_eq(isa, KERN_ISA_AVX2);
    ck_assert_int_eq(kern_isa_parse("avx512", &isa), 0);
    ck_assert_int_eq(isa, KERN_ISA_AVX512);
    ck_assert_int_eq(kern_isa_parse("scalar", &isa), 0);
    ck_assert_int_eq(isa, KERN_ISA_SCALAR);
    ck_assert_int_eq(kern_isa_parse("auto", &isa), 0);
    ck_assert_int_eq(isa, kern_isa_best());
    ck_assert_int_eq(kern_isa_parse("sse9", &isa), -1);
    ck_assert_int_eq(kern_isa_parse(NULL, &isa), -1);
    ck_assert_str_eq(kern_isa_name(KERN_ISA_AVX512), "avx512");
    ck_assert_str_eq(kern_isa_name(KERN_ISA_SCALAR), "scalar");
}
END_TEST

/* The pooled activations and row norms split work across threads; the
 * split must change no bit, on both sides of the size below which they
 * stay on the caller, with ranges that do not divide evenly. */
START_TEST(test_pooled_elementwise)
{
    test_rng r = rng_seed(41);
    kern_pool *p = pool_create(3);
    ck_assert_ptr_nonnull(p);
    const kern_ctx serial = { kern_isa_best(), NULL }, pooled = { kern_isa_best(), p };
    const size_t sizes[] = { 1, 37, 8191, 8192, 20011 };
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        const size_t n = sizes[si];
        float *g = rand_vec(&r, (int)n, 8.0f), *u = rand_vec(&r, (int)n, 2.0f);
        float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
        ck_assert(a && b);
        for (int act = KERN_ACT_SILU; act <= KERN_ACT_GELU_TANH; act++) {
            memcpy(a, g, n * sizeof *a);
            memcpy(b, g, n * sizeof *b);
            if (act == KERN_ACT_SILU)
                kern_silu_mul(a, u, (int)n);
            else
                kern_gelu_tanh_mul(a, u, (int)n);
            kern_act_mul(&pooled, (kern_act)act, b, u, n);
            ck_assert_msg(memcmp(a, b, n * sizeof *a) == 0, "act %d, n %zu", act, n);
            memcpy(b, g, n * sizeof *b);
            kern_act_mul(&serial, (kern_act)act, b, u, n);
            ck_assert_msg(memcmp(a, b, n * sizeof *a) == 0, "act %d, n %zu, serial", act, n);
        }
        free(g);
        free(u);
        free(a);
        free(b);
    }
    /* rows x width: one row, fewer rows than threads, many short rows, long rows */
    const int shapes[][2] = { { 1, 37 }, { 2, 5000 }, { 1001, 64 }, { 7, 4096 } };
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int rows = shapes[si][0], width = shapes[si][1];
        const size_t n = (size_t)rows * width;
        float *x = rand_vec(&r, (int)n, 3.0f), *w = rand_vec(&r, width, 1.0f);
        float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
        float *sa = malloc(3 * (size_t)rows * sizeof *sa), *sb = malloc(3 * (size_t)rows * sizeof *sb);
        ck_assert(a && b && sa && sb);
        for (int variant = 0; variant < 3; variant++) {
            const float *wv = variant == 2 ? NULL : w;
            const bool plus_one = variant == 1;
            for (int i = 0; i < rows; i++)
                kern_rmsnorm(x + (size_t)i * width, wv, width, 1e-6, plus_one,
                             a + (size_t)i * width, sa + 3 * i);
            kern_rmsnorm_rows(&pooled, x, wv, rows, width, 1e-6, plus_one, b, sb);
            ck_assert_msg(memcmp(a, b, n * sizeof *a) == 0, "rows %d x %d", rows, width);
            ck_assert(memcmp(sa, sb, 3 * (size_t)rows * sizeof *sa) == 0);
            /* in place, no stats */
            memcpy(b, x, n * sizeof *b);
            kern_rmsnorm_rows(&pooled, b, wv, rows, width, 1e-6, plus_one, b, NULL);
            ck_assert_msg(memcmp(a, b, n * sizeof *a) == 0, "rows %d x %d in place", rows, width);
        }
        free(x);
        free(w);
        free(a);
        free(b);
        free(sa);
        free(sb);
    }
    pool_free(p);
}
END_TEST

/* Tasks record how often they ran; odd tasks spin a little so that
 * threads finish their blocks at different times and steal from others. */
static void probe_task(void *ctx, int t)
{
    atomic_int *count = ctx;
    unsigned spin = (unsigned)t;
    if (t % 2)
        for (int i = 0; i < 200 * (t % 7); i++)
            spin = spin * 1103515245u + 12345u;
    /* spin | 1 is never 0: the loop's result is used, so it is not elided. */
    atomic_fetch_add_explicit(&count[t], (spin | 1u) ? 1 : 2, memory_order_relaxed);
}

START_TEST(test_pool)
{
    ck_assert_int_eq(pool_threads(NULL), 1);
    ck_assert_ptr_null(pool_create(0));
    atomic_int count[101];
    for (int T = 1; T <= 3; T++) {
        kern_pool *p = pool_create(T);
        ck_assert_ptr_nonnull(p);
        ck_assert_int_eq(pool_threads(p), T);
        const int sizes[] = { 0, 1, 2, 3, 7, 101 };
        for (int rep = 0; rep < 300; rep++)
            for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
                int n = sizes[si];
                for (int t = 0; t < 101; t++)
                    atomic_init(&count[t], 0);
                pool_run(p, probe_task, count, n);
                /* pool_run returned: every task ran exactly once, none beyond n. */
                for (int t = 0; t < 101; t++)
                    ck_assert_int_eq(atomic_load(&count[t]), t < n ? 1 : 0);
            }
        pool_free(p);
    }
    for (int t = 0; t < 101; t++)
        atomic_init(&count[t], 0);
    pool_run(NULL, probe_task, count, 5);
    ck_assert_int_eq(atomic_load(&count[4]), 1);
    pool_free(NULL);
}
END_TEST

Suite *kernels_suite(void)
{
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("kernels");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_bf16_rounding);
    tcase_add_test(tc, test_linear_layout);
    tcase_add_loop_test(tc, test_matmul_invariance, 0,
                        (int)(sizeof mm_shapes / sizeof mm_shapes[0]));
    tcase_add_test(tc, test_matmul_large);
    tcase_add_test(tc, test_matmul_vs_double);
    tcase_add_test(tc, test_matmul_accuracy);
    tcase_add_test(tc, test_matmul_negative_zero);
    tcase_add_test(tc, test_dot);
    tcase_add_loop_test(tc, test_attention_invariance, 0,
                        (int)(sizeof attn_cases / sizeof attn_cases[0]));
    tcase_add_test(tc, test_attention_long);
    tcase_add_test(tc, test_attention_gqa_and_empty);
    tcase_add_test(tc, test_attention_accuracy);
    tcase_add_test(tc, test_attention_negative_zero);
    tcase_add_test(tc, test_rmsnorm);
    tcase_add_test(tc, test_rope);
    tcase_add_test(tc, test_activations);
    tcase_add_test(tc, test_isa);
    tcase_add_test(tc, test_pool);
    tcase_add_test(tc, test_pooled_elementwise);
    suite_add_tcase(s, tc);
    return s;
}
