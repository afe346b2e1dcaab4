/* bench_pp_tg.c — kvdiff's reference engine timed as llama-bench times
 * llama.cpp, for bench/side_by_side.sh:
 *
 *   pp: a PP-token prompt into an empty cache, one forward step;
 *   tg: TG greedy steps of one token from an empty cache (positions
 *       0 .. TG-1), as llama-bench's tgN does.
 *
 * One warm-up forward (16 tokens) comes first. Each figure is one
 * measurement: the script runs this program and bench_llama_pp_tg in turn,
 * several rounds, and keeps the best of each.
 *
 * Usage: bench_pp_tg PRESET f32|bf16 THREADS PP TG
 * Prints "pp TOK_S tg TOK_S"; exit 0, or 2 with a one-line reason. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_common.h"
#include "model/sampler.h"
#include "reference/reference.h"

static int fail(const char *what, const kv_err *e)
{
    fprintf(stderr, "bench_pp_tg: %s%s%s\n", what, e && e->msg[0] ? ": " : "",
            e ? e->msg : "");
    return 2;
}

/* A fresh engine (empty cache) for max_ctx positions. */
static kv_engine *fresh(const kv_model *m, const kern_ctx *kc, int max_ctx, kv_err *e)
{
    ref_opts ro = {.max_ctx = max_ctx, .prefill_step = 0};
    return ref_create(m, kc, &ro, NULL, e);
}

int main(int argc, char **argv)
{
    if (argc != 6) {
        fprintf(stderr, "usage: bench_pp_tg PRESET f32|bf16 THREADS PP TG\n");
        return 2;
    }
    const char *preset = argv[1];
    const int bf16 = !strcmp(argv[2], "bf16");
    const int threads = atoi(argv[3]), pp = atoi(argv[4]), tg = atoi(argv[5]);
    if ((!bf16 && strcmp(argv[2], "f32")) || threads < 1 || pp < 16 || tg < 1)
        return fail("bad arguments (PRESET f32|bf16 THREADS>=1 PP>=16 TG>=1)", NULL);

    kv_err e = {{0}};
    kv_model m;
    kern_ctx kc = {.isa = kern_isa_best(), .pool = threads > 1 ? pool_create(threads) : NULL};
    model_opts mo = {.wtype = bf16 ? KERN_BF16 : KERN_F32, .pool = kc.pool};
    if (model_from_preset(preset, 0, &mo, &m, &e) < 0)
        return fail(preset, &e);
    const int V = m.cfg.vocab;
    float *logits = malloc((size_t)V * sizeof *logits);
    int32_t *prompt = malloc((size_t)pp * sizeof *prompt);
    if (!logits || !prompt)
        return fail("out of memory", NULL);
    /* the prompt bench_engine uses */
    for (int i = 0; i < pp; i++)
        prompt[i] = (int32_t)((i * 7919 + 13) % V);

    kv_engine *eng = fresh(&m, &kc, pp, &e);
    if (!eng || eng->forward(eng, prompt, 16, logits, &e) < 0)
        return fail("warm-up", &e);
    engine_free(eng);

    eng = fresh(&m, &kc, pp, &e);
    if (!eng)
        return fail("engine", &e);
    double t0 = now_s();
    if (eng->forward(eng, prompt, pp, logits, &e) < 0)
        return fail("prompt", &e);
    double t_pp = now_s() - t0;
    engine_free(eng);

    eng = fresh(&m, &kc, tg, &e);
    if (!eng)
        return fail("engine", &e);
    int32_t next = prompt[0];
    t0 = now_s();
    for (int i = 0; i < tg; i++) {
        if (eng->forward(eng, &next, 1, logits, &e) < 0)
            return fail("decode", &e);
        next = logits_argmax(logits, V, NULL);
    }
    double t_tg = now_s() - t0;
    engine_free(eng);

    printf("pp %.2f tg %.2f\n", pp / t_pp, tg / t_tg);
    free(prompt);
    free(logits);
    pool_free(kc.pool);
    model_free(&m);
    return 0;
}
