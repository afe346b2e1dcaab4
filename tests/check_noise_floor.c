/* check_noise_floor.c — the noise floor models drift, not one sample of it.
 *
 * End to end (the kvdiff binary on dumps, as a user runs it): cascade
 * configurations where the test's drift exceeded twice the noise run's
 * own per-stage maximum are the same within the floor, and a bug injected
 * under cascade is still found at the (position, layer, stage) exact mode
 * finds it at without cascade. In memory, on planted differences: the
 * floor is born where the noise run first drifts, reaches stages the
 * noise run reproduced exactly downstream of it, leaves everything
 * upstream exact, uses every position the noise holds, is shown per
 * stage in the JSON; a noise recording without drift, or with a NaN, is
 * refused, and one beyond rounding drift is noted. */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare/compare.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "reports/report.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* End to end: configurations of bench/noise_sweep.py                   */

/* One configuration: the model and prompt, the test's and the noise
 * run's cascade chunk and cache. */
typedef struct {
    const char *model;
    int weights_seed, seed, p, nnew;
    int chunk_test;
    const char *cache_test;
    int chunk_noise;
    const char *cache_noise;
} sweep_cfg;

/* Each exited 1 when the floor was twice the stage's own max |ref - noise|
 * (the first at attn_out of layer 0, the second at ffn_norm_stats of
 * layer 8, both "numeric drift"). */
static const sweep_cfg clean_cases[] = {
    {"tiny-llama", 807, 214, 20, 7, 14, "dense", 16, "ring"},
    {"tiny-gemma3-kvshared", 414, 526, 36, 5, 10, "split", 24, "ring"},
};

static void record(const char *dir, const char *name, const sweep_cfg *c, const char *engine)
{
    char args[768];
    snprintf(args, sizeof args, "run --model %s --weights-seed %d --prompt-random %d --seed %d "
             "--max-new %d --ignore-eos --threads 1 %s --dump %s/%s", c->model, c->weights_seed,
             c->p, c->seed, c->nnew, engine, dir, name);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

static void record_cascade(const char *dir, const char *name, const sweep_cfg *c, int chunk,
                           const char *cache, const char *inject)
{
    char eng[256];
    snprintf(eng, sizeof eng, "--engine chunked --attn cascade --chunk %d --cache %s%s%s", chunk,
             cache, inject ? " --inject " : "", inject ? inject : "");
    record(dir, name, c, eng);
}

START_TEST(test_cascade_within_floor)
{
    const sweep_cfg *c = &clean_cases[_i];
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", c, "");
    record_cascade(dir, "test.h5", c, c->chunk_test, c->cache_test, NULL);
    record_cascade(dir, "noise.h5", c, c->chunk_noise, c->cache_noise, NULL);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/test.h5 --noise-floor %s/noise.h5", dir,
             dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s: %s", c->model, out);
    ck_assert_msg(strstr(out, "same within tolerance"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Where exact mode locates the bug without cascade, the floor locates it
 * with cascade: the drift before it (positions from chunk 14 on) stays
 * under the floor. It did not when the floor was one sample: the drift at
 * attn_out of layer 0, position 14, was reported first. */
START_TEST(test_injected_bug_found_at_exact_location)
{
    const sweep_cfg *c = &clean_cases[0];
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", c, "");
    record(dir, "exact.h5", c, "--engine chunked --chunk 14 --cache dense "
           "--inject decode-index-stuck");
    record_cascade(dir, "test.h5", c, c->chunk_test, c->cache_test, "decode-index-stuck");
    record_cascade(dir, "noise.h5", c, c->chunk_noise, c->cache_noise, NULL);
    const char *where = "FIRST DIVERGENCE  position 21, layer 0 (global), stage attn_lse";
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/exact.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, where), "exact mode moved: %s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/test.h5 --noise-floor %s/noise.h5", dir,
             dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, where), "%s", out);
    ck_assert_msg(strstr(out, "decode write index stuck at slot 20"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* In memory: the model on planted differences                          */

#define PL 12     /* prompt */
#define NN 4      /* generated */

typedef struct {
    kv_model m;
    cmp_memrec *ref, *test, *noise;
} trio;

static cmp_memrec *record_ref(const kv_model *m, const cmp_memrec_opts *mo)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, "reference", NULL, mo, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    kv_observer *obs = cmp_memrec_observer(rec);
    ref_opts ro = {.max_ctx = PL + NN, .prefill_step = 0};
    kv_engine *eng = ref_create(m, &kc, &ro, obs, &e);
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[PL];
    for (int i = 0; i < PL; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m->cfg.vocab);
    gen_opts go = {.max_new = NN, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    ck_assert_msg(generate(eng, &m->cfg, prompt, PL, &go, obs, &res, &e) == 0, "%s", e.msg);
    ck_assert_msg(cmp_memrec_error(rec) == NULL, "%s", cmp_memrec_error(rec));
    gen_result_free(&res);
    engine_free(eng);
    return rec;
}

/* Three identical reference recordings of tiny-llama (4 layers); the test
 * keeps positions up to test_hi. */
static void trio_open(trio *t, int64_t test_hi)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset("tiny-llama", 0, &mo, &t->m, &e) == 0, "%s", e.msg);
    cmp_memrec_opts ro;
    cmp_memrec_opts_default(&ro);
    ro.pos_hi = test_hi;
    t->ref = record_ref(&t->m, NULL);
    t->test = record_ref(&t->m, &ro);
    t->noise = record_ref(&t->m, NULL);
}

static void trio_close(trio *t)
{
    cmp_memrec_free(t->ref);
    cmp_memrec_free(t->test);
    cmp_memrec_free(t->noise);
    model_free(&t->m);
}

/* Scales the largest element of a row by (1 + rel): a row-relative error
 * of rel (to float rounding). */
static void drift(cmp_memrec *rec, int layer, kv_stage st, int64_t pos, double rel)
{
    int cols;
    float *row = cmp_memrec_row(rec, layer, st, pos, &cols);
    ck_assert_ptr_nonnull(row);
    int k = 0;
    for (int i = 1; i < cols; i++)
        k = fabsf(row[i]) > fabsf(row[k]) ? i : k;
    row[k] = (float)(row[k] * (1 + rel));
}

static int trio_compare(trio *t, cmp_result *r, kv_err *e)
{
    cmp_source sr, st, sn;
    cmp_memrec_source(t->ref, &sr);
    cmp_memrec_source(t->test, &st);
    cmp_memrec_source(t->noise, &sn);
    cmp_opts o;
    cmp_opts_default(&o);
    o.noise = &sn;
    return cmp_compare(&sr, &st, &o, r, e);
}

static const cmp_stage_result *stage(const cmp_result *r, int layer, kv_stage st)
{
    const cmp_stage_result *s = cmp_result_stage(r, layer, st);
    ck_assert_ptr_nonnull(s);
    return s;
}

/* The noise run drifts from attn_out of layer 1 on (one sample, 2e-6):
 * its x_in of layer 2 happens to be exact, yet lies downstream, so the
 * test's drift there passes; stages upstream of layer 1's attn_out, and
 * key counts, stay exact. */
START_TEST(test_floor_born_and_propagated)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    drift(t.noise, 1, STAGE_ATTN_OUT, 5, 2e-6);
    drift(t.test, 2, STAGE_X_IN, 7, 1e-6);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    char *txt = cmp_render_text(&r, 0);
    ck_assert_msg(r.verdict == CMP_WITHIN_TOLERANCE, "%s", txt);
    free(txt);
    const cmp_stage_result *born = stage(&r, 1, STAGE_ATTN_OUT);
    const cmp_stage_result *down = stage(&r, 2, STAGE_X_IN);
    ck_assert(born->noise_held && born->noise_rel > 1.5e-6 && born->noise_rel < 2.5e-6);
    ck_assert(down->noise_held && down->noise_rel == 0 && down->noise_abs == 0);
    ck_assert(down->noise_floor == born->noise_rel);
    ck_assert(down->rtol_eff == r.noise_factor * down->noise_floor && down->atol_eff == 0);
    ck_assert(stage(&r, -1, STAGE_EMBED)->noise_floor == 0);
    ck_assert(stage(&r, 1, STAGE_V)->noise_floor == 0);
    ck_assert(stage(&r, 1, STAGE_ATTN_LSE)->noise_floor == 0);
    ck_assert(stage(&r, 2, STAGE_ATTN_NKEYS)->noise_floor == 0);
    ck_assert(stage(&r, 3, STAGE_X_OUT)->noise_floor == born->noise_rel);
    cmp_result_free(&r);

    /* Upstream of the birth, the same drift is a divergence, located. */
    drift(t.test, 0, STAGE_Q, 6, 1e-6);
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    ck_assert(r.verdict == CMP_DIVERGED && r.first.pos == 6 && r.first.layer == 0 &&
              r.first.stage == STAGE_Q);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* Stages the noise recording lacks, downstream of its drift, take their
 * neighbours' floor, and a note says so. */
START_TEST(test_floor_for_stages_noise_lacks)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    cmp_memrec_free(t.noise);
    cmp_memrec_opts no;
    cmp_memrec_opts_default(&no);
    no.layer_hi = 1;
    t.noise = record_ref(&t.m, &no);
    drift(t.noise, 1, STAGE_ATTN_OUT, 5, 2e-6);
    drift(t.test, 3, STAGE_H_MID, 7, 1e-6);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    ck_assert(r.verdict == CMP_WITHIN_TOLERANCE);
    const cmp_stage_result *h = stage(&r, 3, STAGE_H_MID);
    ck_assert(!h->noise_held && h->noise_floor == stage(&r, 1, STAGE_ATTN_OUT)->noise_rel);
    bool noted = false;
    for (int i = 0; i < r.n_notes; i++)
        noted |= strstr(r.notes[i], "noise recording lacks 30 of the compared") != NULL;
    ck_assert(noted);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* Drift far above the floor is a divergence where it is. */
START_TEST(test_floor_does_not_hide_more_than_drift)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    drift(t.noise, 1, STAGE_ATTN_OUT, 5, 2e-6);
    drift(t.test, 2, STAGE_H_MID, 9, 1e-4);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    ck_assert(r.verdict == CMP_DIVERGED && r.first.pos == 9 && r.first.layer == 2 &&
              r.first.stage == STAGE_H_MID);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* The floor is the noise run's, over every position it shares with the
 * reference: a test that stops early (its tokens diverged, or it recorded
 * fewer positions) is judged by the same floor. */
START_TEST(test_floor_uses_every_noise_position)
{
    trio t;
    trio_open(&t, 8);
    drift(t.noise, 1, STAGE_X_OUT, 14, 2e-6);
    drift(t.test, 1, STAGE_X_OUT, 4, 1e-6);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    ck_assert_msg(r.verdict == CMP_WITHIN_TOLERANCE, "first at %lld", (long long)r.first.pos);
    ck_assert(stage(&r, 1, STAGE_X_OUT)->noise_floor > 1.5e-6);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* A noise run without drift cannot set a floor: refused, not a floor of 0
 * that flags every rounding difference while claiming to allow them. */
START_TEST(test_noise_without_drift_refused)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    drift(t.test, 1, STAGE_X_OUT, 4, 1e-6);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_int_eq(trio_compare(&t, &r, &e), -1);
    ck_assert_msg(strstr(e.msg, "shows no drift"), "%s", e.msg);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* A NaN where the reference has a number is no drift: refused, not
 * skipped into a floor. */
START_TEST(test_noise_nonfinite_refused)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    drift(t.noise, 1, STAGE_ATTN_OUT, 5, 2e-6);
    cmp_memrec_row(t.noise, 2, STAGE_FFN_OUT, 9, NULL)[3] = NAN;
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_int_eq(trio_compare(&t, &r, &e), -1);
    ck_assert_msg(strstr(e.msg, "ffn_out of layer 2, position 9") &&
                  strstr(e.msg, "cannot set a noise floor"), "%s", e.msg);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* A noise run that differs by more than rounding drift (a bug of its own,
 * another precision) still sets a floor, and a note says what it lets
 * through. */
START_TEST(test_noise_beyond_drift_noted)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    drift(t.noise, 1, STAGE_ATTN_OUT, 5, 0.01);
    drift(t.test, 2, STAGE_X_IN, 7, 0.02);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    ck_assert(r.verdict == CMP_WITHIN_TOLERANCE);
    bool noted = false;
    for (int i = 0; i < r.n_notes; i++)
        noted |= strstr(r.notes[i], "more than rounding drift") &&
                 strstr(r.notes[i], "attn_out of layer 1");
    ck_assert(noted);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

/* The JSON shows, per stage, which floor judged: the stage's own sample,
 * the modelled floor and the tolerances applied; they read back. */
START_TEST(test_json_shows_floor)
{
    trio t;
    trio_open(&t, PL + NN - 1);
    drift(t.noise, 1, STAGE_ATTN_OUT, 5, 2e-6);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(trio_compare(&t, &r, &e) == 0, "%s", e.msg);
    char *js = cmp_render_json(&r, CMP_RENDER_STAGES);
    ck_assert_ptr_nonnull(js);
    json_t *j = json_loads(js, 0, NULL);
    ck_assert_ptr_nonnull(j);
    json_t *stages = json_object_get(j, "stages");
    bool seen = false;
    for (size_t i = 0; i < json_array_size(stages); i++) {
        json_t *s = json_array_get(stages, i);
        if (json_integer_value(json_object_get(s, "layer")) != 2 ||
            strcmp(json_string_value(json_object_get(s, "stage")), "x_in"))
            continue;
        const cmp_stage_result *x = stage(&r, 2, STAGE_X_IN);
        ck_assert(json_is_number(json_object_get(s, "noise_rel")) &&
                  json_is_number(json_object_get(s, "noise_abs")) &&
                  json_is_number(json_object_get(s, "rtol")));
        ck_assert(json_number_value(json_object_get(s, "noise_floor")) == x->noise_floor);
        ck_assert(json_number_value(json_object_get(s, "noise_rel")) == 0);
        ck_assert(json_number_value(json_object_get(s, "noise_abs")) == 0);
        ck_assert(json_number_value(json_object_get(s, "rtol")) == x->rtol_eff);
        ck_assert(x->rtol_eff > 0);
        seen = true;
    }
    ck_assert(seen);
    json_decref(j);
    /* ... and a saved result reads back with them (kvdiff report). */
    char dir[64], path[96];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/result.json", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(js, f);
    fclose(f);
    report_json back;
    ck_assert_msg(report_json_load(path, &back, &e) == 0, "%s", e.msg);
    for (int i = 0; i < r.n_stages; i++) {
        const cmp_stage_result *a = &r.stages[i], *b = &back.r.stages[i];
        ck_assert(b->noise_held == a->noise_held && b->noise_rel == a->noise_rel &&
                  b->noise_abs == a->noise_abs && b->noise_floor == a->noise_floor &&
                  b->rtol_eff == a->rtol_eff && b->atol_eff == a->atol_eff);
    }
    report_json_free(&back);
    test_rmtree(dir);
    free(js);
    cmp_result_free(&r);
    trio_close(&t);
}
END_TEST

Suite *noise_floor_suite(void)
{
    Suite *s = suite_create("noise_floor");
    TCase *tc = tcase_create("noise_floor");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, test_cascade_within_floor, 0,
                        (int)(sizeof clean_cases / sizeof *clean_cases));
    tcase_add_test(tc, test_injected_bug_found_at_exact_location);
    tcase_add_test(tc, test_floor_born_and_propagated);
    tcase_add_test(tc, test_floor_for_stages_noise_lacks);
    tcase_add_test(tc, test_floor_does_not_hide_more_than_drift);
    tcase_add_test(tc, test_floor_uses_every_noise_position);
    tcase_add_test(tc, test_noise_without_drift_refused);
    tcase_add_test(tc, test_noise_nonfinite_refused);
    tcase_add_test(tc, test_noise_beyond_drift_noted);
    tcase_add_test(tc, test_json_shows_floor);
    suite_add_tcase(s, tc);
    return s;
}
