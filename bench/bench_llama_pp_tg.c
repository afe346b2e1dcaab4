/* bench_llama_pp_tg.c — llama.cpp timed as llama-bench times it (the
 * fetched build ships no llama-bench), for bench/side_by_side.sh:
 *
 *   pp: a PP-token prompt into an empty cache, one llama_decode, logits
 *       of the last token only;
 *   tg: TG greedy steps of one token from an empty cache (positions
 *       0 .. TG-1).
 *
 * llama-bench's defaults otherwise: batch 2048, ubatch 512, an f16 KV
 * cache, and flash attention off (as in the comparison the numbers are
 * meant for); THREADS for both prompt and decode. One warm-up decode (16
 * tokens) first: it also faults in the mapped GGUF. Each figure is one
 * measurement; the script keeps the best over rounds.
 *
 * Usage: bench_llama_pp_tg MODEL.gguf THREADS PP TG
 * Prints "pp TOK_S tg TOK_S"; exit 0, or 2 with a one-line reason.
 * Built by `make bench` only when llama.cpp is there (it links libllama). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-backend.h"
#include "llama.h"

#ifndef LLAMA_LIB_DIR
#define LLAMA_LIB_DIR "."
#endif

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void quiet(enum ggml_log_level level, const char *text, void *user)
{
    (void)level;
    (void)text;
    (void)user;
}

static int fail(const char *what)
{
    fprintf(stderr, "bench_llama_pp_tg: %s\n", what);
    return 2;
}

static int argmax(const float *v, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: bench_llama_pp_tg MODEL.gguf THREADS PP TG\n");
        return 2;
    }
    const int threads = atoi(argv[2]), pp = atoi(argv[3]), tg = atoi(argv[4]);
    if (threads < 1 || pp < 16 || tg < 1)
        return fail("bad arguments (THREADS>=1 PP>=16 TG>=1)");
    llama_log_set(quiet, NULL);
    ggml_backend_load_all_from_path(LLAMA_LIB_DIR);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model)
        return fail("llama.cpp could not load the model");
    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(pp > tg ? pp : tg);
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = cp.type_v = GGML_TYPE_F16;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx)
        return fail("llama.cpp refused the context");
    llama_token *prompt = malloc((size_t)pp * sizeof *prompt);
    if (!prompt)
        return fail("out of memory");
    /* the prompt bench_pp_tg uses */
    for (int i = 0; i < pp; i++)
        prompt[i] = (llama_token)((i * 7919 + 13) % V);

    if (llama_decode(ctx, llama_batch_get_one(prompt, 16)) != 0)
        return fail("warm-up decode failed");
    llama_memory_clear(llama_get_memory(ctx), true);

    double t0 = now_s();
    if (llama_decode(ctx, llama_batch_get_one(prompt, pp)) != 0)
        return fail("prompt decode failed");
    llama_synchronize(ctx);
    double t_pp = now_s() - t0;
    llama_memory_clear(llama_get_memory(ctx), true);

    llama_token next = prompt[0];
    t0 = now_s();
    for (int i = 0; i < tg; i++) {
        if (llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0)
            return fail("decode failed");
        next = argmax(llama_get_logits_ith(ctx, -1), V);
    }
    double t_tg = now_s() - t0;

    printf("pp %.2f tg %.2f\n", pp / t_pp, tg / t_tg);
    free(prompt);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
