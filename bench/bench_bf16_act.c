/* bench_bf16_act.c — what keeping activations in float32 costs a bf16
 * prefill, measured with a prototype of bf16 activations (bench only,
 * never shipped: it breaks the order rule and rounds every input).
 *
 * Usage: bench_bf16_act [OUT.tsv [ROUNDS]]   (ROUNDS default 10)
 *   OUT.tsv gets one row a figure (bench/results.tsv's columns).
 *
 * Weights are bf16 in every row. Three kernels compute y = x W^T for
 * M = 512 rows, 1 thread, over Qwen2.5-0.5B's three projection shapes:
 *
 *   shipped     kern_matmul: f32 activations, the order rule's blocks
 *   proto f32   a plain 6 x 16 tile, one FMA chain an output, x in f32
 *   proto bf16  the same tile with x stored as bf16 (half the bytes),
 *               widened to f32 at each broadcast
 *
 * The two prototype rows differ only in the activations' type, so their
 * ratio is what bf16 activations buy on this CPU; the FMA roof line says
 * how much any kernel could gain. On an AVX2 CPU no instruction multiplies
 * bf16 pairs (AVX512-BF16's vdpbf16ps does two products a lane), so a bf16
 * product costs one f32 FMA like any other. Times are thread CPU time,
 * best of ROUNDS interleaved rounds (a shared machine moves wall time by
 * tens of percent between runs of the same binary).
 *
 * The accuracy half: the same products against a float64 sum of the
 * unrounded x, as bench_accuracy measures (max |y - y64| / max |y64|),
 * for f32 and bf16-rounded activations. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_common.h"
#include "model/kernels.h"
#include "model/pcg32.h"

#define M_ROWS 512

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* N(0, 1) by Box-Muller from the project's PCG32. */
static double gauss(pcg32 *r)
{
    double u = (pcg32_next(r) + 0.5) / 4294967296.0, v = (pcg32_next(r) + 0.5) / 4294967296.0;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static uint16_t to_bf16(float f)
{
    uint16_t h;
    kern_bf16_from_f32(&f, 1, &h);
    return h;
}

static float from_bf16(uint16_t h)
{
    float f;
    kern_bf16_to_f32(&h, 1, &f);
    return f;
}

#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_PROTO 1
#define ATTR2 __attribute__((target("avx2,fma")))

/* 6 rows x one 16-wide panel of the packed bf16 weights over all of K.
 * xbf16: x as bf16 (ldx elements a row) when nonzero, else f32. */
static ATTR2 void proto_tile(const void *x, int xbf16, size_t ldx, const uint16_t *w, int K,
                             float *y, size_t ldy)
{
    __m256 c0l = _mm256_setzero_ps(), c0h = c0l, c1l = c0l, c1h = c0l, c2l = c0l, c2h = c0l;
    __m256 c3l = c0l, c3h = c0l, c4l = c0l, c4h = c0l, c5l = c0l, c5h = c0l;
    const float *xf = x;
    const uint16_t *xh = x;
    /* A bf16 broadcast as one load: the 32 bits ending at x[k] hold x[k]
     * in their high half (little-endian), x[k-1] below it, which the AND
     * clears. x[-1] must be readable: the caller pads one element. */
    const __m256 hi16 = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u));
    for (int k = 0; k < K; k++) {
        __m128i h = _mm_loadu_si128((const __m128i *)(w + (size_t)k * 16));
        __m128i h2 = _mm_loadu_si128((const __m128i *)(w + (size_t)k * 16 + 8));
        __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        __m256 wh = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h2), 16));
#define ROW(i)                                                                         \
    {                                                                                  \
        __m256 xb = xbf16 ? _mm256_and_ps(_mm256_broadcast_ss((const float *)(const void *)   \
                                              (xh + (i) * ldx + (size_t)k - 1)), hi16)   \
                          : _mm256_broadcast_ss(xf + (i) * ldx + (size_t)k);           \
        c##i##l = _mm256_fmadd_ps(xb, wl, c##i##l);                                    \
        c##i##h = _mm256_fmadd_ps(xb, wh, c##i##h);                                    \
    }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
#define STORE(i)                                                                       \
    _mm256_storeu_ps(y + (i) * ldy, c##i##l);                                          \
    _mm256_storeu_ps(y + (i) * ldy + 8, c##i##h);
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

/* The same loop nest as the shipped kernel: panel blocks of ~1 MiB, then
 * row tiles of 6, then panels. n_out must be a multiple of 16 and M of 6
 * for this prototype (the shapes below are). */
static void proto_matmul(const kern_linear *L, const void *x, int xbf16, int M, float *y)
{
    const int K = L->n_in, np = L->n_out / 16;
    const size_t esz = xbf16 ? 2 : 4;
    int pb = (1 << 20) / (16 * K * 2);
    if (pb < 1)
        pb = 1;
    for (int b0 = 0; b0 < np; b0 += pb) {
        int b1 = np - b0 < pb ? np : b0 + pb;
        for (int m = 0; m + 6 <= M; m += 6)
            for (int p = b0; p < b1; p++)
                proto_tile((const char *)x + (size_t)m * K * esz, xbf16, (size_t)K,
                           (const uint16_t *)L->panels + (size_t)p * K * 16, K,
                           y + (size_t)m * L->n_out + (size_t)p * 16, (size_t)L->n_out);
    }
}

/* 12 independent FMA chains: the most FLOP/s any f32 kernel gets. */
static ATTR2 double fma_roof(void)
{
    /* named accumulators: an array of vectors may live in memory */
    /* and distinct starts: equal chains would be merged into one */
    __m256 a0 = _mm256_set1_ps(0.001f), a1 = _mm256_set1_ps(0.002f), a2 = _mm256_set1_ps(0.003f);
    __m256 a3 = _mm256_set1_ps(0.004f), a4 = _mm256_set1_ps(0.005f), a5 = _mm256_set1_ps(0.006f);
    __m256 a6 = _mm256_set1_ps(0.007f), a7 = _mm256_set1_ps(0.008f), a8 = _mm256_set1_ps(0.009f);
    __m256 a9 = _mm256_set1_ps(0.010f), a10 = _mm256_set1_ps(0.011f), a11 = _mm256_set1_ps(0.012f);
    const __m256 s = _mm256_set1_ps(0.9999f), t = _mm256_set1_ps(1e-5f);
    const long n = 20000000;
    double c0 = cpu_s();
#define CHAIN(i) a##i = _mm256_fmadd_ps(a##i, s, t);
    for (long r = 0; r < n; r++) {
        CHAIN(0) CHAIN(1) CHAIN(2) CHAIN(3) CHAIN(4) CHAIN(5)
        CHAIN(6) CHAIN(7) CHAIN(8) CHAIN(9) CHAIN(10) CHAIN(11)
    }
#undef CHAIN
    double el = cpu_s() - c0;
    __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                               _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    sum = _mm256_add_ps(sum, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    if (_mm256_cvtss_f32(sum) == 12345.0f)   /* keeps the chains alive */
        puts("");
    return (double)n * 12 * 16 / el * 1e-9;
}
#else
#define HAVE_PROTO 0
#endif

int main(int argc, char **argv)
{
    int rounds = argc > 2 ? atoi(argv[2]) : 10;
    if (rounds < 1 || rounds > 100) {
        fprintf(stderr, "usage: %s [OUT.tsv [ROUNDS 1-100]]\n", argv[0]);
        return 2;
    }
    FILE *tsv = NULL;
    char date[32] = "", head[64] = "";
    if (argc > 1) {
        tsv = fopen(argv[1], "a");
        if (!tsv) {
            perror(argv[1]);
            return 2;
        }
        time_t now = time(NULL);
        strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", gmtime(&now));
        git_head(head, sizeof head);
    }
#if !HAVE_PROTO
    fprintf(stderr, "bench_bf16_act: the prototype is x86-64 only; nothing measured\n");
    if (tsv)
        fclose(tsv);
    return 0;
#else
    if (kern_isa_best() == KERN_ISA_SCALAR) {
        fprintf(stderr, "bench_bf16_act: the prototype needs AVX2 and FMA; nothing measured\n");
        if (tsv)
            fclose(tsv);
        return 0;
    }
    static const int shapes[][2] = { { 896, 896 }, { 4864, 896 }, { 896, 4864 } };
    const int M = 510;   /* a multiple of 6 near 512: no partial tile */
    double roof = 0;
    for (int r = 0; r < 3; r++) {
        double g = fma_roof();
        roof = g > roof ? g : roof;
    }
    printf("FMA roof (1 thread, 12 chains of 256-bit FMAs): %.1f GFLOP/s\n", roof);
    if (tsv)
        fprintf(tsv, "%s\t%s\tbf16 activations\t-\t-\t1\tfma_roof_GFLOP_s\t%.1f\n", date, head,
                roof);
    printf("%-11s %-11s %9s %9s  %s\n", "n_out x n_in", "kernel", "GFLOP/s", "of roof",
           "max|y-y64|/max|y64|");
    pcg32 rng;
    pcg32_seed(&rng, 7, 1);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int N = shapes[si][0], K = shapes[si][1];
        float *W = malloc((size_t)N * K * sizeof *W), *x = malloc((size_t)M_ROWS * K * sizeof *x);
        uint16_t *xh0 = malloc(((size_t)M_ROWS * K + 1) * sizeof *xh0), *xh = xh0 + 1;
        float *y = malloc((size_t)M_ROWS * N * sizeof *y);
        float *y_ship = malloc((size_t)M_ROWS * N * sizeof *y_ship);
        kern_linear L = { 0 };
        if (!W || !x || !xh0 || !y || !y_ship || kern_linear_init(&L, N, K, KERN_BF16, false) != 0) {
            fprintf(stderr, "bench_bf16_act: out of memory\n");
            return 1;
        }
        const double ws = 1.0 / sqrt((double)K);
        for (size_t i = 0; i < (size_t)N * K; i++)
            W[i] = from_bf16(to_bf16((float)(gauss(&rng) * ws)));
        xh0[0] = 0;
        for (size_t i = 0; i < (size_t)M_ROWS * K; i++) {
            x[i] = (float)gauss(&rng);
            xh[i] = to_bf16(x[i]);
        }
        kern_linear_set_rows(&L, 0, N, W);
        const kern_ctx kc = { kern_isa_best(), NULL };
        double best[3] = { 1e30, 1e30, 1e30 };
        for (int r = 0; r < rounds; r++)
            for (int v = 0; v < 3; v++) {
                double c0 = cpu_s();
                if (v == 0)
                    kern_matmul(&kc, &L, x, M, y);
                else
                    proto_matmul(&L, v == 1 ? (const void *)x : (const void *)xh, v == 2, M, y);
                double el = cpu_s() - c0;
                best[v] = el < best[v] ? el : best[v];
            }
        /* accuracy against the float64 sum of the unrounded x: the shipped
         * kernel's output, and y, which holds the last kernel's (bf16
         * activations); the f32 prototype's sum order is not measured */
        double err[3] = { 0, 0, 0 }, ymax = 0;
        kern_matmul(&kc, &L, x, M, y_ship);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double s = 0;
                for (int k = 0; k < K; k++)
                    s += (double)x[(size_t)m * K + k] * W[(size_t)n * K + k];
                ymax = fabs(s) > ymax ? fabs(s) : ymax;
                const double e0 = fabs(y_ship[(size_t)m * N + n] - s);
                const double e2 = fabs(y[(size_t)m * N + n] - s);
                err[0] = e0 > err[0] ? e0 : err[0];
                err[2] = e2 > err[2] ? e2 : err[2];
            }
        static const char *names[3] = { "shipped", "proto f32", "proto bf16" };
        for (int v = 0; v < 3; v++) {
            double g = 2.0 * M * N * K / best[v] * 1e-9;
            char acc[32] = "-";
            if (v != 1)
                snprintf(acc, sizeof acc, "%.2e", err[v] / ymax);
            printf("%4d x %-5d %-11s %9.1f %8.0f%%  %s\n", N, K, names[v], g, 100.0 * g / roof,
                   acc);
            if (tsv) {
                fprintf(tsv, "%s\t%s\tbf16 activations %s\t%dx%d\tbf16\t1\tGFLOP_s\t%.1f\n",
                        date, head, names[v], N, K, g);
                if (v != 1)
                    fprintf(tsv, "%s\t%s\tbf16 activations %s\t%dx%d\tbf16\t1\t"
                            "max_err_over_max_y\t%.2e\n", date, head, names[v], N, K,
                            err[v] / ymax);
            }
        }
        printf("%4d x %-5d bf16 activations / f32 activations (prototype): %.2fx\n", N, K,
               best[1] / best[2]);
        free(y_ship);
        kern_linear_free(&L);
        free(W);
        free(x);
        free(xh0);
        free(y);
    }
    if (tsv) {
        fclose(tsv);
        printf("appended to %s\n", argv[1]);
    }
    return 0;
#endif
}
