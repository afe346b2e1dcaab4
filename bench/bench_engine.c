/* bench_engine.c — reference engine speed on a real-shaped model.
 *
 * Prefill of 512 tokens and decode of 128 tokens on qwen2.5-0.5b-shape
 * (real Qwen2.5-0.5B dimensions, synthetic weights), f32 and bf16 weights,
 * 2 threads. Prints a table and appends one row per configuration to the
 * TSV file named on the command line, so runs compare across commits.
 * Usage: bench_engine OUT.tsv [PRESET] [PREFILL] [DECODE] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_common.h"
#include "model/generate.h"
#include "reference/reference.h"

static int bench_one(FILE *tsv, const char *preset, kern_wtype wt, int threads, int n_prefill,
                     int n_decode)
{
    kv_err e = {{0}};
    kv_model m;
    model_opts mo = {.wtype = (int)wt};
    double t0 = now_s();
    if (model_from_preset(preset, 0, &mo, &m, &e) < 0) {
        fprintf(stderr, "bench: %s\n", e.msg);
        return -1;
    }
    double t_load = now_s() - t0;
    kern_ctx kc = {.isa = kern_isa_best(), .pool = pool_create(threads)};
    ref_opts ro = {.max_ctx = n_prefill + n_decode, .prefill_step = 0};
    kv_engine *eng = ref_create(&m, &kc, &ro, NULL, &e);
    float *logits = malloc((size_t)m.cfg.vocab * sizeof(float));
    int32_t *prompt = malloc((size_t)n_prefill * sizeof(int32_t));
    if (!eng || !logits || !prompt) {
        fprintf(stderr, "bench: %s\n", e.msg[0] ? e.msg : "out of memory");
        return -1;
    }
    for (int i = 0; i < n_prefill; i++)
        prompt[i] = (int32_t)((i * 7919 + 13) % m.cfg.vocab);
    double t1 = now_s();
    int rc = eng->forward(eng, prompt, n_prefill, logits, &e);
    double t2 = now_s();
    for (int i = 0; rc == 0 && i < n_decode; i++) {
        int32_t next = logits_argmax(logits, m.cfg.vocab, NULL);
        rc = eng->forward(eng, &next, 1, logits, &e);
    }
    double t3 = now_s();
    if (rc != 0)
        fprintf(stderr, "bench: %s\n", e.msg);
    double pp = n_prefill / (t2 - t1), tg = n_decode / (t3 - t2);
    const char *dt = wt == KERN_BF16 ? "bf16" : "f32";
    printf("%-20s %-5s %7d %12.1f %12.1f %9.1f\n", preset, dt, threads, pp, tg, t_load);
    char head[64], date[32];
    git_head(head, sizeof head);
    time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", gmtime(&now));
    fprintf(tsv, "%s\t%s\tengine\t%s\t%s\t%d\tpp%d_tok_s\t%.1f\n", date, head, preset, dt, threads,
            n_prefill, pp);
    fprintf(tsv, "%s\t%s\tengine\t%s\t%s\t%d\ttg%d_tok_s\t%.1f\n", date, head, preset, dt, threads,
            n_decode, tg);
    free(prompt);
    free(logits);
    engine_free(eng);
    pool_free(kc.pool);
    model_free(&m);
    return rc == 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: bench_engine OUT.tsv [PRESET] [PREFILL] [DECODE]\n");
        return 2;
    }
    const char *preset = argc > 2 ? argv[2] : "qwen2.5-0.5b-shape";
    int n_prefill = argc > 3 ? atoi(argv[3]) : 512, n_decode = argc > 4 ? atoi(argv[4]) : 128;
    FILE *tsv = fopen(argv[1], "a");
    if (!tsv) {
        perror(argv[1]);
        return 2;
    }
    printf("%-20s %-5s %7s %12s %12s %9s\n", "model", "dtype", "threads",
           "prefill t/s", "decode t/s", "build s");
    int rc = bench_one(tsv, preset, KERN_F32, 2, n_prefill, n_decode);
    rc |= bench_one(tsv, preset, KERN_BF16, 2, n_prefill, n_decode);
    fclose(tsv);
    printf("appended to %s\n", argv[1]);
    return rc ? 1 : 0;
}
