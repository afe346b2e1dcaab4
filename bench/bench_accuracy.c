/* bench_accuracy.c — how far one float32 matmul lands from float64, for the
 * summation orders a batch-invariant kernel could use.
 *
 * x (M, K) ~ N(0, 1), W (N, K) ~ N(0, 1/K): the shapes and scales of a
 * transformer's projections (K = 896 for Qwen2.5-0.5B's q/k/v/gate/up,
 * 4864 for its down projection). Each order computes every output in
 * float32 from the same float inputs; the error is measured against the
 * exact float64 sum as the issue measures tensors: max |y - y64| /
 * max |y64| over the whole output, plus the RMS error in units of
 * max |y64| * 2^-24. The last row is kern_matmul itself: it must match
 * the row of the order kernels.h states. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/kernels.h"
#include "model/pcg32.h"

/* Order 1: one fmaf accumulator over k = 0..K-1. */
static float sum_single(const float *x, const float *w, int K)
{
    float acc = 0.0f;
    for (int k = 0; k < K; k++)
        acc = fmaf(x[k], w[k], acc);
    return acc;
}

/* Order 2: blocks of B, each from +0 by fmaf, block sums added in turn. */
static float sum_blocks_seq(const float *x, const float *w, int K, int B)
{
    float total = 0.0f;
    for (int k0 = 0; k0 < K; k0 += B) {
        float acc = 0.0f;
        for (int k = k0; k < K && k < k0 + B; k++)
            acc = fmaf(x[k], w[k], acc);
        total = k0 == 0 ? acc : total + acc;
    }
    return total;
}

/* Order 3: blocks of B, block sums combined pairwise (binary counter:
 * equal-sized neighbours merge as soon as both exist; the leftover
 * levels merge from the smallest up). */
static float sum_blocks_pair(const float *x, const float *w, int K, int B)
{
    float level[32];
    int nb = 0;
    for (int k0 = 0; k0 < K; k0 += B, nb++) {
        float acc = 0.0f;
        for (int k = k0; k < K && k < k0 + B; k++)
            acc = fmaf(x[k], w[k], acc);
        int l = 0;
        for (; nb >> l & 1; l++)
            acc = level[l] + acc;
        level[l] = acc;
    }
    float r = 0.0f;
    int first = 1;
    for (int l = 0; l < 32; l++)
        if (nb >> l & 1) {
            r = first ? level[l] : level[l] + r;
            first = 0;
        }
    return r;
}

/* Order 4: S strided lanes (lane l takes k % S == l), combined by halving
 * (lane i += lane i + S/2): what llama.cpp's SIMD dot products do
 * (tinyBLAS: 16 lanes; ggml_vec_dot_f32 on AVX-512: 64). */
static float sum_lanes(const float *x, const float *w, int K, int S)
{
    float lane[64] = { 0 };
    for (int k = 0; k < K; k++)
        lane[k % S] = fmaf(x[k], w[k], lane[k % S]);
    for (int h = S / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++)
            lane[i] = lane[i] + lane[i + h];
    return lane[0];
}

/* Order 5: blocks of B by fmaf, block sums added in double, rounded once. */
static float sum_blocks_double(const float *x, const float *w, int K, int B)
{
    double total = 0.0;
    for (int k0 = 0; k0 < K; k0 += B) {
        float acc = 0.0f;
        for (int k = k0; k < K && k < k0 + B; k++)
            acc = fmaf(x[k], w[k], acc);
        total += acc;
    }
    return (float)total;
}

static double gauss(pcg32 *r)
{
    double u1 = (pcg32_next(r) + 1.0) / 4294967297.0, u2 = pcg32_next(r) / 4294967296.0;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

typedef struct {
    const char *name;
    int kind, param;
} order;

static void report(const char *name, const float *y, const double *ref, size_t n)
{
    double md = 0, mr = 0, ss = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)y[i] - ref[i]);
        md = d > md ? d : md;
        mr = fabs(ref[i]) > mr ? fabs(ref[i]) : mr;
        ss += d * d;
    }
    double unit = mr * ldexp(1.0, -24);
    printf("  %-26s max rel %.2e   rms %.2f units\n", name, md / mr, sqrt(ss / (double)n) / unit);
}

static void run_shape(int M, int N, int K)
{
    pcg32 r;
    pcg32_seed(&r, 42, (uint64_t)K);
    float *x = malloc((size_t)M * K * sizeof *x), *w = malloc((size_t)N * K * sizeof *w);
    float *y = malloc((size_t)M * N * sizeof *y);
    double *ref = malloc((size_t)M * N * sizeof *ref);
    if (!x || !w || !y || !ref) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < (size_t)M * K; i++)
        x[i] = (float)gauss(&r);
    for (size_t i = 0; i < (size_t)N * K; i++)
        w[i] = (float)(gauss(&r) / sqrt((double)K));
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            /* Products of two floats are exact in double; the sum of K of
             * them in double is ~2^-29 relative off, far below float. */
            long double s = 0;
            for (int k = 0; k < K; k++)
                s += (long double)((double)x[(size_t)m * K + k] * w[(size_t)n * K + k]);
            ref[(size_t)m * N + n] = (double)s;
        }
    printf("M %d, N %d, K %d\n", M, N, K);
    static const order orders[] = {
        { "single accumulator", 0, 0 },
        { "blocks 16, sequential", 1, 16 }, { "blocks 32, sequential", 1, 32 },
        { "blocks 64, sequential", 1, 64 },
        { "blocks 8, pairwise", 2, 8 }, { "blocks 16, pairwise", 2, 16 },
        { "blocks 32, pairwise", 2, 32 }, { "blocks 64, pairwise", 2, 64 },
        { "16 lanes (tinyBLAS)", 3, 16 }, { "64 lanes (ggml vec_dot)", 3, 64 },
        { "blocks 16, double total", 4, 16 }, { "blocks 32, double total", 4, 32 },
    };
    for (size_t o = 0; o < sizeof orders / sizeof *orders; o++) {
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                const float *xr = x + (size_t)m * K, *wr = w + (size_t)n * K;
                float v = 0;
                switch (orders[o].kind) {
                case 0: v = sum_single(xr, wr, K); break;
                case 1: v = sum_blocks_seq(xr, wr, K, orders[o].param); break;
                case 2: v = sum_blocks_pair(xr, wr, K, orders[o].param); break;
                case 3: v = sum_lanes(xr, wr, K, orders[o].param); break;
                default: v = sum_blocks_double(xr, wr, K, orders[o].param); break;
                }
                y[(size_t)m * N + n] = v;
            }
        report(orders[o].name, y, ref, (size_t)M * N);
    }
    kern_linear L;
    if (kern_linear_init(&L, N, K, KERN_F32, false) != 0) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    kern_linear_set_rows(&L, 0, N, w);
    kern_ctx kc = { .isa = kern_isa_best(), .pool = NULL };
    kern_matmul(&kc, &L, x, M, y);
    report("kern_matmul (this build)", y, ref, (size_t)M * N);
    kern_linear_free(&L);
    free(x);
    free(w);
    free(y);
    free(ref);
}

int main(void)
{
    run_shape(64, 896, 896);
    run_shape(32, 896, 4864);
    return 0;
}
