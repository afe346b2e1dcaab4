/* check_conformance.c — the reference engine against the outside world.
 *
 * tests/data/conformance/ holds tiny Hugging Face folders (Llama, Qwen2,
 * Gemma 3 with sliding and global layers; Qwen3, and Llama with
 * attention_bias and llama3 RoPE scaling, Gemma 4, gpt-oss with sinks,
 * YaRN and experts, from make_case.py there), a
 * 40-token prompt each, and golden tensors from independent float64
 * implementations of the transformers definitions (llama.cpp agrees to
 * 1e-6). Each folder is loaded
 * with the real loader and every golden tensor must match within 1e-5
 * relative (max |engine - golden| / max |golden|). RMSNorm eps moves results
 * too little for that tolerance to see, so it gets its own check: the
 * config's eps must fit the goldens better than eps x 10 and eps / 10. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/generate.h"
#include "model/safetensors.h"
#include "model/tokens.h"
#include "reference/reference.h"
#include "testutil.h"

#define CONF_TOL 1e-5
#define CONF_DIR "tests/data/conformance"

/* Runs the prompt of case `name` and returns the worst relative error over
 * every golden tensor; the name of the worst tensor goes to worst_name. */
static double run_case(const char *name, double eps_scale, char *worst_name, size_t wn)
{
    char dir[256], path[300];
    kv_err e = {{0}};
    kv_model m;
    snprintf(dir, sizeof dir, CONF_DIR "/%s", name);
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_load_dir(dir, &mo, &m, &e) == 0, "%s", e.msg);
    m.cfg.rms_eps *= eps_scale;

    int32_t *ids;
    int n;
    snprintf(path, sizeof path, "%s/prompt.txt", dir);
    ck_assert_msg(tokens_load(path, m.cfg.vocab, &ids, &n, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(n, 40);

    capture *cap = capture_new(n);
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    ref_opts ro = {.max_ctx = n, .prefill_step = 0};
    kv_engine *eng = ref_create(&m, &kc, &ro, &cap->base, &e);
    ck_assert_msg(eng != NULL, "%s", e.msg);
    ck_assert_msg(eng->forward(eng, ids, n, NULL, &e) == 0, "%s", e.msg);

    snprintf(path, sizeof path, "%s/golden.safetensors", dir);
    st_file *g = st_open(path, &e);
    ck_assert_msg(g != NULL, "%s", e.msg);
    double worst = 0;
    for (size_t i = 0; i < st_count(g); i++) {
        const st_tensor *t = st_at(g, i);
        kv_stage st;
        int layer = -1;
        char stage[32] = "";
        if (!strcmp(t->name, "embed")) st = STAGE_EMBED;
        else if (!strcmp(t->name, "final_norm")) st = STAGE_FINAL_NORM;
        else if (!strcmp(t->name, "logits")) st = STAGE_LOGITS;
        else {
            ck_assert_int_eq(sscanf(t->name, "layers.%d.%31s", &layer, stage), 2);
            st = !strcmp(stage, "q") ? STAGE_Q : !strcmp(stage, "k") ? STAGE_K
               : !strcmp(stage, "v") ? STAGE_V : !strcmp(stage, "attn_out") ? STAGE_ATTN_OUT
               : !strcmp(stage, "ple_in") ? STAGE_PLE_IN
               : !strcmp(stage, "ple_out") ? STAGE_PLE_OUT
               : !strcmp(stage, "attn_sink") ? STAGE_ATTN_SINK
               : !strcmp(stage, "kv_latent") ? STAGE_KV_LATENT : STAGE_X_OUT;
            ck_assert_msg(st != STAGE_X_OUT || !strcmp(stage, "x_out"), "unknown %s", t->name);
        }
        int ncols;
        const float *got = capture_get(cap, st, layer, &ncols);
        ck_assert_msg(got != NULL, "%s: engine emitted no %s", name, t->name);
        ck_assert_uint_eq((uint64_t)ncols * (uint64_t)n, t->nelem);
        float *want = malloc(t->nelem * sizeof(float));
        ck_assert_int_eq(st_read_f32(t, 0, t->nelem, want, &e), 0);
        double rel = test_rel_err(got, want, t->nelem);
        if (rel > worst) {
            worst = rel;
            snprintf(worst_name, wn, "%s", t->name);
        }
        free(want);
    }
    st_close(g);
    engine_free(eng);
    capture_free(cap);
    free(ids);
    model_free(&m);
    return worst;
}

static void check_case(const char *name)
{
    char worst_name[64] = "";
    double worst = run_case(name, 1.0, worst_name, sizeof worst_name);
    if (getenv("KVDIFF_TEST_VERBOSE"))
        fprintf(stderr, "conformance %s: worst %.2e (%s)\n", name, worst, worst_name);
    ck_assert_msg(worst <= CONF_TOL, "%s: %s is off by %.3g relative (tolerance %.0e)", name,
                  worst_name, worst, CONF_TOL);
    /* eps: the configured value must fit best. */
    char w10[64], w01[64];
    double up = run_case(name, 10.0, w10, sizeof w10);
    double down = run_case(name, 0.1, w01, sizeof w01);
    ck_assert_msg(worst < up && worst < down,
                  "%s: eps fits no better than eps x10 (%.3g) or /10 (%.3g): %.3g", name, up,
                  down, worst);
}

START_TEST(test_llama) { check_case("llama"); }
END_TEST
START_TEST(test_qwen2) { check_case("qwen2"); }
END_TEST
START_TEST(test_gemma3) { check_case("gemma3"); }
END_TEST
START_TEST(test_qwen3) { check_case("qwen3"); }
END_TEST
START_TEST(test_llama3_bias) { check_case("llama3-bias"); }
END_TEST
START_TEST(test_qwen3_hd64) { check_case("qwen3-hd64"); }
END_TEST

START_TEST(test_gemma4) { check_case("gemma4"); }
END_TEST
START_TEST(test_gpt_oss) { check_case("gpt-oss"); }
END_TEST
START_TEST(test_deepseek_v2) { check_case("deepseek-v2"); }
END_TEST
START_TEST(test_deepseek_v3) { check_case("deepseek-v3"); }
END_TEST

Suite *conformance_suite(void)
{
    Suite *s = suite_create("conformance");
    TCase *tc = tcase_create("hf-goldens");
    tcase_add_test(tc, test_llama);
    tcase_add_test(tc, test_qwen2);
    tcase_add_test(tc, test_gemma3);
    tcase_add_test(tc, test_qwen3);
    tcase_add_test(tc, test_llama3_bias);
    tcase_add_test(tc, test_qwen3_hd64);
    tcase_add_test(tc, test_gemma4);
    tcase_add_test(tc, test_gpt_oss);
    tcase_add_test(tc, test_deepseek_v2);
    tcase_add_test(tc, test_deepseek_v3);
    suite_add_tcase(s, tc);
    return s;
}
