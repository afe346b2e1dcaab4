/* bench_kernels.c — throughput of kern_matmul and the cost of pool_run.
 *
 * Usage: bench_kernels [scalar|avx2|avx512|auto]   (default auto)
 *
 * For each shape (n_out x n_in) of a 0.5B-class model, weight type, batch
 * M and thread count it prints time per call, GFLOP/s (2 M n_out n_in per
 * call) and the weight bytes streamed per second. M = 1 is decode: there
 * the bench cycles through enough copies of the matrix to overflow the
 * last-level cache, as a real model's layers do, so the GB/s column is
 * memory bandwidth, not cache bandwidth. Before it, a plain read of the
 * same amount of memory (1 and 2 threads) gives the roof that column is
 * measured against: a decode matvec cannot stream weights faster than a
 * loop that only reads them. A short attention table follows. */
#include <stdint.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/kernels.h"
#include "model/pool.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static unsigned rng_state = 12345u;
static float rnd(void)
{
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}

/* Enough copies that decode weights come from memory (LLC here is 32 MiB). */
#define STREAM_BYTES (160u << 20)

static int build(kern_linear *L, int n_out, int n_in, kern_wtype wt)
{
    float *W = malloc((size_t)n_out * n_in * sizeof *W);
    if (!W || kern_linear_init(L, n_out, n_in, wt, false) != 0) {
        free(W);
        return -1;
    }
    for (size_t i = 0; i < (size_t)n_out * n_in; i++)
        W[i] = rnd() * 0.05f;
    kern_linear_set_rows(L, 0, n_out, W);
    free(W);
    return 0;
}

/* The memory-read roof: each task xors its share of the buffer's 64-bit
 * words (a loop that only loads, and that the compiler cannot drop). */
typedef struct {
    const uint64_t *buf;
    size_t n;                /* words */
    int ntasks;
    uint64_t sink[2][8];     /* one cache line per task: no false sharing */
} read_job;

static void read_task(void *ctx, int t)
{
    read_job *j = ctx;
    size_t lo = j->n * (size_t)t / (size_t)j->ntasks, hi = j->n * (size_t)(t + 1) / (size_t)j->ntasks;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = lo; i + 4 <= hi; i += 4) {
        a ^= j->buf[i];
        b ^= j->buf[i + 1];
        c ^= j->buf[i + 2];
        d ^= j->buf[i + 3];
    }
    j->sink[t][0] = a ^ b ^ c ^ d;
}

#if defined(__x86_64__)
#include <immintrin.h>
/* The same with 256-bit loads from four streams at once, as the engines'
 * matvec reads a panel's rows: one sequential stream of 64-bit loads
 * stopped at 17-18 GB/s on 2 threads on a machine whose decode streamed
 * its weights at 23 (decode read "above the roof"); four streams reach
 * 23.5-24.7 GB/s there. */
__attribute__((target("avx2"))) static void read_task_avx2(void *ctx, int t)
{
    read_job *j = ctx;
    size_t lo = j->n * (size_t)t / (size_t)j->ntasks, hi = j->n * (size_t)(t + 1) / (size_t)j->ntasks;
    lo = (lo + 15) & ~(size_t)15;
    /* four streams a quarter of the share apart, as a panel's rows are */
    const size_t q = ((hi - lo) / 4) & ~(size_t)15;
    const uint64_t *p0 = j->buf + lo, *p1 = p0 + q, *p2 = p1 + q, *p3 = p2 + q;
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i + 8 <= q; i += 8) {
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(p0 + i)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(p1 + i)));
        c = _mm256_xor_si256(c, _mm256_load_si256((const __m256i *)(p2 + i)));
        d = _mm256_xor_si256(d, _mm256_load_si256((const __m256i *)(p3 + i)));
        a = _mm256_xor_si256(a, _mm256_load_si256((const __m256i *)(p0 + i + 4)));
        b = _mm256_xor_si256(b, _mm256_load_si256((const __m256i *)(p1 + i + 4)));
        c = _mm256_xor_si256(c, _mm256_load_si256((const __m256i *)(p2 + i + 4)));
        d = _mm256_xor_si256(d, _mm256_load_si256((const __m256i *)(p3 + i + 4)));
    }
    a = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, a);
    j->sink[t][0] = out[0] ^ out[1] ^ out[2] ^ out[3];
}
#endif

/* Best of several passes over STREAM_BYTES: the machine may be shared,
 * and the best pass is the closest to what the memory can give. */
static void bench_read_roof(kern_pool *pools[2])
{
    read_job j = { .n = STREAM_BYTES / sizeof(uint64_t) };
    uint64_t *buf = aligned_alloc(64, STREAM_BYTES);
    if (!buf) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        exit(1);
    }
    memset(buf, 1, STREAM_BYTES);
    j.buf = buf;
    void (*task)(void *, int) = read_task;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx2"))
        task = read_task_avx2;
#endif
    for (int t = 0; t < 2; t++) {
        j.ntasks = t + 1;
        double best = 1e30;
        for (int r = 0; r < 8; r++) {
            double t0 = now_s();
            pool_run(pools[t], task, &j, j.ntasks);
            double el = now_s() - t0;
            if (el < best)
                best = el;
        }
        printf("memory read roof (%d thread%s, %s loads, best of 8 passes over %u MiB): "
               "%.1f GB/s\n", t + 1, t ? "s" : "", task == read_task ? "64-bit" : "256-bit",
               STREAM_BYTES >> 20, (double)STREAM_BYTES / best * 1e-9);
    }
    free(buf);
}

static void bench_matmul(kern_isa isa, kern_pool *pools[2])
{
    static const int shapes[][2] = { { 896, 896 }, { 4864, 896 }, { 896, 4864 } };
    static const int Ms[] = { 1, 64, 512 };
    printf("%-11s %-5s %4s %3s %10s %9s %9s\n", "n_out x n_in", "type", "M", "thr", "ms/call",
           "GFLOP/s", "wGB/s");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int wt = 0; wt < 2; wt++) {
            int n_out = shapes[si][0], n_in = shapes[si][1];
            size_t wbytes = (size_t)n_out * n_in * (wt == KERN_BF16 ? 2 : 4);
            int ncopies = (int)(STREAM_BYTES / wbytes) + 1;
            kern_linear *L = calloc((size_t)ncopies, sizeof *L);
            float *x = malloc((size_t)512 * n_in * sizeof *x);
            float *y = malloc((size_t)512 * n_out * sizeof *y);
            if (!L || !x || !y) {
                fprintf(stderr, "bench_kernels: out of memory\n");
                exit(1);
            }
            for (int c = 0; c < ncopies; c++)
                if (build(&L[c], n_out, n_in, (kern_wtype)wt) != 0) {
                    fprintf(stderr, "bench_kernels: out of memory\n");
                    exit(1);
                }
            for (size_t i = 0; i < (size_t)512 * n_in; i++)
                x[i] = rnd();
            for (size_t mi = 0; mi < sizeof Ms / sizeof Ms[0]; mi++)
                for (int t = 0; t < 2; t++) {
                    int M = Ms[mi];
                    kern_ctx ctx = { isa, pools[t] };
                    /* Decode cycles through the copies; batches reuse one (cache-resident
                     * weights are what a prefill sees within one matrix anyway). */
                    int cyc = M == 1 ? ncopies : 1;
                    kern_matmul(&ctx, &L[0], x, M, y);
                    int reps = 0;
                    double t0 = now_s(), el;
                    do {
                        kern_matmul(&ctx, &L[reps % cyc], x, M, y);
                        reps++;
                        el = now_s() - t0;
                    } while (el < 0.3 || reps < 3);
                    double per = el / reps;
                    printf("%4d x %-4d %-5s %4d %3d %10.4f %9.1f %9.1f\n", n_out, n_in,
                           wt == KERN_BF16 ? "bf16" : "f32", M, t + 1, per * 1e3,
                           2.0 * M * n_out * n_in / per * 1e-9, (double)wbytes / per * 1e-9);
                    fflush(stdout);
                }
            for (int c = 0; c < ncopies; c++)
                kern_linear_free(&L[c]);
            free(L);
            free(x);
            free(y);
        }
}

/* Qwen2-0.5B-like heads: 14 query heads, 2 KV heads, head_dim 64. Decode:
 * one row over nkeys keys; prefill: 512 causal rows. FLOPs are counted as
 * 4 D per (row, head, key): the q.k dot and the weighted sum of v. */
static void bench_attention(kern_isa isa, kern_pool *pools[2])
{
    const int H = 14, KV = 2, D = 64, nkeys = 1024;
    float *kv = malloc((size_t)nkeys * KV * D * 2 * sizeof *kv);
    float *q = malloc((size_t)512 * H * D * sizeof *q);
    float *out = malloc((size_t)512 * H * D * sizeof *out);
    float *lse = malloc((size_t)512 * H * sizeof *lse);
    const float **krow = malloc((size_t)nkeys * sizeof *krow);
    const float **vrow = malloc((size_t)nkeys * sizeof *vrow);
    int *kbeg = malloc(512 * sizeof *kbeg), *kend = malloc(512 * sizeof *kend);
    if (!kv || !q || !out || !lse || !krow || !vrow || !kbeg || !kend) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < (size_t)nkeys * KV * D * 2; i++)
        kv[i] = rnd();
    for (size_t i = 0; i < (size_t)512 * H * D; i++)
        q[i] = rnd();
    for (int j = 0; j < nkeys; j++) {
        krow[j] = kv + (size_t)j * KV * D * 2;
        vrow[j] = krow[j] + KV * D;
    }
    printf("\nattention (H %d, KV %d, D %d)\n%-24s %3s %10s %9s\n", H, KV, D, "case", "thr",
           "ms/call", "GFLOP/s");
    for (int c = 0; c < 2; c++) {
        int M = c == 0 ? 1 : 512;
        double flops = 0;
        for (int m = 0; m < M; m++) {
            kend[m] = c == 0 ? nkeys : m + 1;
            kbeg[m] = 0;
            flops += 4.0 * D * H * (kend[m] - kbeg[m]);
        }
        for (int t = 0; t < 2; t++) {
            kern_ctx ctx = { isa, pools[t] };
            int reps = 0;
            double t0 = now_s(), el;
            do {
                kern_attention(&ctx, M, q, H, KV, D, 0.125f, krow, vrow, kbeg, kend, out, lse);
                reps++;
                el = now_s() - t0;
            } while (el < 0.3 || reps < 3);
            double per = el / reps;
            printf("%-24s %3d %10.4f %9.1f\n", c == 0 ? "decode, 1024 keys" : "prefill, 512 causal",
                   t + 1, per * 1e3, flops / per * 1e-9);
        }
    }
    free(kv);
    free(q);
    free(out);
    free(lse);
    free(krow);
    free(vrow);
    free(kbeg);
    free(kend);
}

static void empty_task(void *ctx, int t)
{
    (void)ctx;
    (void)t;
}

static void bench_pool(kern_pool *p, const char *label)
{
    const int n = 200000;
    for (int i = 0; i < 1000; i++)
        pool_run(p, empty_task, NULL, 2);
    double t0 = now_s();
    for (int i = 0; i < n; i++)
        pool_run(p, empty_task, NULL, 2);
    double el = now_s() - t0;
    printf("pool_run overhead (%s, 2 empty tasks): %.3f us/call\n", label, el / n * 1e6);
}

int main(int argc, char **argv)
{
    kern_isa isa = kern_isa_best();
    /* "roof": the memory-read roof alone (bench/side_by_side.sh prints
     * decode's achieved GB/s beside it, measured in the same run) */
    const bool roof_only = argc > 1 && !strcmp(argv[1], "roof");
    if (argc > 1 && !roof_only && kern_isa_parse(argv[1], &isa) != 0) {
        fprintf(stderr, "usage: %s [scalar|avx2|avx512|auto|roof]\n", argv[0]);
        return 2;
    }
    kern_pool *pools[2] = { NULL, pool_create(2) };
    if (!pools[1]) {
        fprintf(stderr, "bench_kernels: cannot create threads\n");
        return 1;
    }
    if (roof_only) {
        bench_read_roof(pools);
        pool_free(pools[1]);
        return 0;
    }
    printf("isa %s (best %s)\n", kern_isa_name(isa), kern_isa_name(kern_isa_best()));
    bench_pool(NULL, "no pool");
    bench_pool(pools[1], "2 threads");
    bench_read_roof(pools);
    bench_matmul(isa, pools);
    bench_attention(isa, pools);
    pool_free(pools[1]);
    return 0;
}
