/* check_reference.c — the reference engine's numerics promises:
 * whole-prompt prefill, token-by-token and odd step sizes give the same
 * bits; so do 1 vs 2 threads and scalar vs SIMD kernels; two runs are
 * identical; a generated folder loads back to the same model. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "model/generate.h"
#include "reference/reference.h"
#include "testutil.h"

static const char *const tiny_presets[] = {"tiny-llama", "tiny-qwen2", "tiny-gemma3",
                                           "tiny-gemma3-kvshared", "tiny-llama3",
                                           "tiny-qwen3"};
#define N_TINY (int)(sizeof tiny_presets / sizeof *tiny_presets)
#define PROMPT_LEN 40   /* longer than every tiny preset's window */
#define NEW_TOKENS 12

typedef struct {
    int prefill_step;
    int threads;
    kern_isa isa;
} run_setup;

/* Generates NEW_TOKENS after a fixed random prompt; returns the result
 * (tokens + the logits of every step) and, when cap != NULL, every stage. */
static void run_preset(const kv_model *m, run_setup rs, capture *cap, gen_result *out)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = rs.isa, .pool = rs.threads > 1 ? pool_create(rs.threads) : NULL};
    ref_opts ro = {.max_ctx = PROMPT_LEN + NEW_TOKENS, .prefill_step = rs.prefill_step};
    kv_engine *eng = ref_create(m, &kc, &ro, cap ? &cap->base : NULL, &e);
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[PROMPT_LEN];
    for (int i = 0; i < PROMPT_LEN; i++)
        prompt[i] = (int32_t)((i * 37 + 11) % m->cfg.vocab);
    gen_opts go = {.max_new = NEW_TOKENS, .ignore_eos = true, .keep_logits = true,
                   .samp = {.temperature = 0, .top_p = 1}};
    ck_assert_msg(generate(eng, &m->cfg, prompt, PROMPT_LEN, &go, cap ? &cap->base : NULL,
                           out, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(out->n_new, NEW_TOKENS);
    engine_free(eng);
    pool_free(kc.pool);
}

static void assert_same_result(const gen_result *a, const gen_result *b, int vocab,
                               const char *what)
{
    ck_assert_msg(memcmp(a->tokens, b->tokens,
                         (size_t)(a->n_prompt + a->n_new) * sizeof(int32_t)) == 0,
                  "%s: tokens differ", what);
    for (int s = 0; s < a->n_new; s++)
        ck_assert_msg(memcmp(a->step_logits + (size_t)s * vocab,
                             b->step_logits + (size_t)s * vocab, (size_t)vocab * 4) == 0,
                      "%s: logits of step %d differ", what, s);
}

static void open_preset(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

START_TEST(test_prefill_batching_is_invisible)
{
    kv_model m;
    open_preset(tiny_presets[_i], &m);
    gen_result all, token, seven;
    run_preset(&m, (run_setup){0, 1, kern_isa_best()}, NULL, &all);
    run_preset(&m, (run_setup){1, 1, kern_isa_best()}, NULL, &token);
    run_preset(&m, (run_setup){7, 1, kern_isa_best()}, NULL, &seven);
    assert_same_result(&all, &token, m.cfg.vocab, "all-at-once vs token-by-token");
    assert_same_result(&all, &seven, m.cfg.vocab, "all-at-once vs 7 per step");
    gen_result_free(&all);
    gen_result_free(&token);
    gen_result_free(&seven);
    model_free(&m);
}
END_TEST

START_TEST(test_every_stage_identical_across_batching)
{
    kv_model m;
    open_preset(tiny_presets[_i], &m);
    const int T = PROMPT_LEN + NEW_TOKENS;
    capture *a = capture_new(T), *b = capture_new(T);
    gen_result ra, rb;
    run_preset(&m, (run_setup){0, 2, kern_isa_best()}, a, &ra);
    run_preset(&m, (run_setup){1, 1, kern_isa_best()}, b, &rb);
    int compared = 0;
    for (int st = 0; st < STAGE_COUNT; st++)
        for (int l = -1; l < m.cfg.n_layers; l++) {
            int na, nb;
            const float *x = capture_get(a, st, l, &na), *y = capture_get(b, st, l, &nb);
            ck_assert((x == NULL) == (y == NULL));
            if (!x)
                continue;
            ck_assert_int_eq(na, nb);
            /* Logits and final norm of prompt rows exist in both runs. */
            for (int p = 0; p < T - 1; p++)
                ck_assert_msg(memcmp(x + (size_t)p * na, y + (size_t)p * na,
                                     (size_t)na * 4) == 0,
                              "%s stage %s layer %d position %d differs", tiny_presets[_i],
                              stage_name(st), l, p);
            compared++;
        }
    ck_assert_int_gt(compared, m.cfg.n_layers * 10);
    gen_result_free(&ra);
    gen_result_free(&rb);
    capture_free(a);
    capture_free(b);
    model_free(&m);
}
END_TEST

START_TEST(test_threads_and_isa_are_invisible)
{
    kv_model m;
    open_preset(tiny_presets[_i], &m);
    gen_result one, two, scalar, again;
    run_preset(&m, (run_setup){0, 1, kern_isa_best()}, NULL, &one);
    run_preset(&m, (run_setup){0, 2, kern_isa_best()}, NULL, &two);
    run_preset(&m, (run_setup){0, 2, KERN_ISA_SCALAR}, NULL, &scalar);
    run_preset(&m, (run_setup){0, 1, kern_isa_best()}, NULL, &again);
    assert_same_result(&one, &two, m.cfg.vocab, "1 vs 2 threads");
    assert_same_result(&one, &scalar, m.cfg.vocab, "SIMD vs scalar");
    assert_same_result(&one, &again, m.cfg.vocab, "two identical runs");
    if (kern_isa_best() == KERN_ISA_AVX512) {
        gen_result avx2;
        run_preset(&m, (run_setup){3, 2, KERN_ISA_AVX2}, NULL, &avx2);
        assert_same_result(&one, &avx2, m.cfg.vocab, "AVX-512 vs AVX2");
        gen_result_free(&avx2);
    }
    gen_result_free(&one);
    gen_result_free(&two);
    gen_result_free(&scalar);
    gen_result_free(&again);
    model_free(&m);
}
END_TEST

START_TEST(test_generated_folder_loads_back)
{
    char dir[64];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    ck_assert_msg(model_gen_folder(tiny_presets[_i], 7, 0, dir, &e) == 0, "%s", e.msg);
    kv_model a, b;
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(tiny_presets[_i], 7, &mo, &a, &e) == 0, "%s", e.msg);
    ck_assert_msg(model_load_dir(dir, &mo, &b, &e) == 0, "%s", e.msg);
    ck_assert_uint_eq(a.fingerprint, b.fingerprint);
    ck_assert_int_eq(memcmp(&a.cfg, &b.cfg, sizeof a.cfg), 0);
    gen_result ra, rb;
    run_preset(&a, (run_setup){0, 1, kern_isa_best()}, NULL, &ra);
    run_preset(&b, (run_setup){0, 1, kern_isa_best()}, NULL, &rb);
    assert_same_result(&ra, &rb, a.cfg.vocab, "preset vs generated folder");
    gen_result_free(&ra);
    gen_result_free(&rb);
    model_free(&a);
    model_free(&b);
    /* A different seed is a different model. */
    ck_assert_int_eq(model_from_preset(tiny_presets[_i], 8, &mo, &a, &e), 0);
    ck_assert_uint_ne(a.fingerprint, b.fingerprint);
    model_free(&a);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_bf16_folder_runs_bf16)
{
    char dir[64];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    ck_assert_msg(model_gen_folder("tiny-qwen2", 3, 1, dir, &e) == 0, "%s", e.msg);
    kv_model bf;
    model_opts from_file = {.wtype = -1};
    ck_assert_msg(model_load_dir(dir, &from_file, &bf, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(bf.wtype, KERN_BF16);
    gen_result a, b;
    run_preset(&bf, (run_setup){0, 2, kern_isa_best()}, NULL, &a);
    run_preset(&bf, (run_setup){1, 1, KERN_ISA_SCALAR}, NULL, &b);
    assert_same_result(&a, &b, bf.cfg.vocab, "bf16: batched SIMD vs token-by-token scalar");
    gen_result_free(&a);
    gen_result_free(&b);
    model_free(&bf);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_bad_tokens_and_context)
{
    kv_model m;
    open_preset("tiny-llama", &m);
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best()};
    ref_opts ro = {.max_ctx = 8, .prefill_step = 0};
    kv_engine *eng = ref_create(&m, &kc, &ro, NULL, &e);
    int32_t bad[2] = {3, 256};
    ck_assert_int_eq(eng->forward(eng, bad, 2, NULL, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "token id 256 at position 1 is outside the vocabulary"));
    int32_t nine[9] = {0};
    ck_assert_int_eq(eng->forward(eng, nine, 9, NULL, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "exceed the context of 8"));
    engine_free(eng);
    ro.max_ctx = m.cfg.max_positions + 1;
    ck_assert_ptr_null(ref_create(&m, &kc, &ro, NULL, &e));
    ck_assert_ptr_nonnull(strstr(e.msg, "max_position_embeddings"));
    model_free(&m);
}
END_TEST

Suite *reference_suite(void)
{
    Suite *s = suite_create("reference");
    TCase *tc = tcase_create("invariance");
    tcase_add_loop_test(tc, test_prefill_batching_is_invisible, 0, N_TINY);
    tcase_add_loop_test(tc, test_every_stage_identical_across_batching, 0, N_TINY);
    tcase_add_loop_test(tc, test_threads_and_isa_are_invisible, 0, N_TINY);
    tcase_add_loop_test(tc, test_generated_folder_loads_back, 0, N_TINY);
    tcase_add_test(tc, test_bf16_folder_runs_bf16);
    tcase_add_test(tc, test_bad_tokens_and_context);
    suite_add_tcase(s, tc);
    return s;
}
