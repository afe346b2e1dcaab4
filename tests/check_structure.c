/* check_structure.c — errors judged by their structure (compare/structure.c,
 * docs/cross-runtime.md "Structure"): the row-scale fit tells a scale from
 * noise and from one large element's rounding; the logit map recovers a
 * softcap, no softcap and a scale; and with the real llama.cpp a GGUF whose
 * RMSNorm epsilon is 1e-4 where the config says 1e-6, and one whose final
 * softcap is 15 where the config says 30, and one with 1% of a q bias
 * missing, all "no bug: drift" before this test, are steps at their first
 * stage and named, while the correct GGUF stays drift. The per-channel
 * offset fit tells a bias from noise and from per-channel scales. */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../compare/cmp_internal.h"
#include "../model/generate.h"
#include "../model/pcg32.h"
#include "../reference/reference.h"
#include "gguf_patch.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* The fits                                                             */

static float gauss(pcg32 *g)
{
    double u = (pcg32_next(g) + 0.5) / 4294967296.0, v = (pcg32_next(g) + 0.5) / 4294967296.0;
    return (float)(sqrt(-2 * log(u)) * cos(6.283185307179586 * v));
}

START_TEST(structure_row_scale_fit)
{
    enum { N = 256 };
    float ref[N], test[N];
    pcg32 g;
    pcg32_seed(&g, 7, 1);
    for (int i = 0; i < N; i++)
        ref[i] = gauss(&g);
    /* Rounding-like noise, 1e-3 of each value: no scale to speak of. */
    for (int i = 0; i < N; i++)
        test[i] = ref[i] * (1 + 1e-3f * gauss(&g));
    cmp_scalefit f;
    cmp_row_scale_fit(test, ref, N, &f);
    ck_assert(f.fitted);
    ck_assert_msg(fabs(f.dev) < f.noise, "noise: dev %g noise %g", f.dev, f.noise);
    /* A scale of 1 - 5e-5 under noise of 1e-7: many times the noise, in
     * every column group. */
    for (int i = 0; i < N; i++)
        test[i] = ref[i] * (1 - 5e-5f) * (1 + 1e-7f * gauss(&g));
    cmp_row_scale_fit(test, ref, N, &f);
    ck_assert_msg(fabs(f.dev + 5e-5) < 1e-6 && f.groups_agree && fabs(f.dev) > 40 * f.noise,
                  "scale: dev %g noise %g agree %d", f.dev, f.noise, f.groups_agree);
    /* One massive element whose own rounding moves it by 1e-4: it looks
     * like a scale of the whole row, but three column groups do not see it. */
    memcpy(test, ref, sizeof ref);
    ref[5] = 1000;
    test[5] = 1000 * (1 + 1e-4f);
    cmp_row_scale_fit(test, ref, N, &f);
    ck_assert_msg(!f.groups_agree, "massive element: dev %g", f.dev);
    /* Too narrow to fit (per-head statistics). */
    cmp_row_scale_fit(test, ref, CMP_FIT_MIN_COLS - 1, &f);
    ck_assert(!f.fitted);
}
END_TEST

START_TEST(structure_channel_offset_fit)
{
    enum { W = 32, N = 64 };
    static float ref[W * N], test[W * N];
    pcg32 g;
    pcg32_seed(&g, 5, 9);
    for (int i = 0; i < W * N; i++)
        ref[i] = gauss(&g);
    /* Noise of 1e-3 per value: no offset stands out. */
    for (int i = 0; i < W * N; i++)
        test[i] = ref[i] + 1e-3f * gauss(&g);
    cmp_offsetfit f;
    cmp_channel_offset_fit(test, ref, W, N, &f);
    ck_assert(f.fitted && f.channels == N);
    ck_assert_msg(f.significant == 0 && f.part < f.noise, "noise: %d significant, part %g "
                  "noise %g", f.significant, f.part, f.noise);
    /* Every channel scaled by its own factor near 1 (a weight rounded):
     * no offset either. */
    for (int p = 0; p < W; p++)
        for (int j = 0; j < N; j++)
            test[p * N + j] = ref[p * N + j] * (1 + 0.004f * (j % 5 - 2)) + 1e-6f * gauss(&g);
    cmp_channel_offset_fit(test, ref, W, N, &f);
    ck_assert_msg(f.part < 1e-5, "scales: part %g", f.part);
    /* A bias of 1e-3 per channel under noise of 1e-5: every channel. */
    for (int p = 0; p < W; p++)
        for (int j = 0; j < N; j++)
            test[p * N + j] = ref[p * N + j] + 1e-3f * (j % 2 ? 1 : -1) + 1e-5f * gauss(&g);
    cmp_channel_offset_fit(test, ref, W, N, &f);
    ck_assert_msg(f.significant == N && f.part > 50 * f.noise, "bias: %d significant, part %g "
                  "noise %g", f.significant, f.part, f.noise);
    /* Too few positions to tell. */
    cmp_channel_offset_fit(test, ref, CMP_OFFSET_MIN_ROWS - 1, N, &f);
    ck_assert(!f.fitted);
}
END_TEST

START_TEST(structure_logit_map_fit)
{
    enum { N = 400 };
    double ref[N], test[N];
    pcg32 g;
    pcg32_seed(&g, 11, 3);
    /* Logits capped at 30 in the reference, at 15 in the test. */
    for (int i = 0; i < N; i++) {
        const double z = 12 * gauss(&g);
        ref[i] = 30 * tanh(z / 30);
        test[i] = 15 * tanh(z / 15) + 1e-4 * gauss(&g);
    }
    cmp_logitmap m;
    cmp_logit_map_fit(ref, test, N, 30, &m);
    ck_assert_int_eq(m.kind, CMP_MAP_SOFTCAP);
    ck_assert_msg(fabs(m.param - 15) < 0.05, "cap %g", m.param);
    ck_assert(m.ssr_identity > 100 * m.ssr);
    /* No cap at all in the test. */
    for (int i = 0; i < N; i++)
        test[i] = 30 * atanh(ref[i] / 30);
    cmp_logit_map_fit(ref, test, N, 30, &m);
    ck_assert_int_eq(m.kind, CMP_MAP_SOFTCAP);
    ck_assert_msg(isinf(m.param), "cap %g", m.param);
    /* A temperature: every logit times 0.9. */
    for (int i = 0; i < N; i++)
        test[i] = 0.9 * ref[i];
    cmp_logit_map_fit(ref, test, N, 30, &m);
    ck_assert_int_eq(m.kind, CMP_MAP_SCALE);
    ck_assert_msg(fabs(m.param - 0.9) < 1e-9, "scale %g", m.param);
    /* Noise alone: no map beats none by much. */
    for (int i = 0; i < N; i++)
        test[i] = ref[i] + 1e-3 * gauss(&g);
    cmp_logit_map_fit(ref, test, N, 30, &m);
    ck_assert(m.ssr_identity < 1.1 * m.ssr || m.kind == CMP_MAP_NONE);
}
END_TEST

/* ------------------------------------------------------------------ */
/* With llama.cpp                                                       */

/* Records gguf with llama.cpp (config from dir/hf), compares it against
 * dir/ref.h5: the exit code, the JSON in *j. */
static int record_compare(const char *dir, const char *gguf, json_t **j)
{
    char args[2048];
    snprintf(args, sizeof args, "%s --hf %s/hf --prompt-from %s/ref.h5 --max-new 4 --ignore-eos "
             "--threads 1 --cache-type f32 --dump %s/llama.h5", gguf, dir, dir, dir);
    char rm[600];
    snprintf(rm, sizeof rm, "%s/llama.h5", dir);
    remove(rm);
    ck_assert_msg(test_run_recorder(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/llama.h5 --json", dir, dir);
    int rc = test_run_cli(args, out, sizeof out);
    *j = json_loads(out, 0, NULL);
    ck_assert_msg(*j, "%.2000s", out);
    return rc;
}

static void model(const char *dir, const char *preset)
{
    char args[1024];
    snprintf(args, sizeof args, "gen --preset %s -o %s/hf --gguf %s/m.gguf", preset, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/hf --prompt-random 60 --seed 3 --max-new 4 "
             "--ignore-eos --dump %s/ref.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

static const char *kind_of(json_t *j)
{
    return json_string_value(json_object_get(json_object_get(j, "diagnosis"), "kind"));
}

/* The step at (pos, layer, stage), diagnosed kind: the structure block. */
static json_t *expect_step(json_t *j, long pos, int layer, const char *stage, const char *kind)
{
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == pos &&
                  json_integer_value(json_object_get(d, "layer")) == layer &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), stage) &&
                  !strcmp(kind_of(j), kind), "expected %ld/%d/%s %s\n%.3000s", pos, layer,
                  stage, kind, out);
    return json_object_get(json_object_get(json_object_get(j, "mode"), "cross_runtime"),
                           "structure");
}

START_TEST(structure_llama_norm_eps)
{
    char dir[512], gguf[600], bad[600];
    test_tmpdir(dir, sizeof dir);
    model(dir, "tiny-gemma3");
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/eps.gguf", dir);
    ck_assert(gguf_patch(gguf, bad, "gemma3.attention.layer_norm_rms_epsilon", 1e-4) == 0);
    json_t *j;
    int rc = record_compare(dir, bad, &j);
    ck_assert_msg(rc == 1, "exit %d\n%.3000s", rc, out);
    json_t *st = expect_step(j, 0, 0, "attn_norm", "norm_eps");
    json_t *step = json_object_get(st, "step");
    ck_assert_msg(json_is_object(step), "%.3000s", out);
    /* under the size floor: the structure found it */
    ck_assert(json_number_value(json_object_get(step, "drift_threshold")) > 1e-3);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* 1% of layer 0's q bias missing (tiny-qwen2): 0.3% of q, under the size
 * floor, the same vector at every position: a step at (0, 0, q), named. */
START_TEST(structure_llama_bias)
{
    char dir[512], gguf[600], bad[600];
    test_tmpdir(dir, sizeof dir);
    model(dir, "tiny-qwen2");
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/bias.gguf", dir);
    ck_assert(gguf_scale_tensors(gguf, bad, "blk.0.attn_q.bias", 0.99) == 1);
    json_t *j;
    int rc = record_compare(dir, bad, &j);
    ck_assert_msg(rc == 1, "exit %d\n%.3000s", rc, out);
    json_t *st = expect_step(j, 0, 0, "q", "bias");
    ck_assert_msg(json_is_object(json_object_get(st, "offset_step")), "%.3000s", out);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

START_TEST(structure_llama_softcap)
{
    char dir[512], gguf[600], bad[600];
    test_tmpdir(dir, sizeof dir);
    model(dir, "tiny-gemma4");
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    json_t *j;
    /* The correct GGUF: drift, and the fitted cap is the config's. */
    int rc = record_compare(dir, gguf, &j);
    ck_assert_msg(rc == 0, "exit %d\n%.3000s", rc, out);
    json_t *map = json_object_get(json_object_get(json_object_get(json_object_get(j, "mode"),
                                  "cross_runtime"), "structure"), "logit_map");
    ck_assert(json_is_false(json_object_get(map, "step")));
    json_decref(j);
    snprintf(gguf, sizeof gguf, "%s/m.gguf", dir);
    snprintf(bad, sizeof bad, "%s/cap.gguf", dir);
    ck_assert(gguf_patch(gguf, bad, "gemma4.final_logit_softcapping", 15) == 0);
    rc = record_compare(dir, bad, &j);
    ck_assert_msg(rc == 1, "exit %d\n%.3000s", rc, out);
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_str_eq(json_string_value(json_object_get(d, "stage")), "logits");
    ck_assert_str_eq(kind_of(j), "logit_map");
    const char *sum = json_string_value(json_object_get(json_object_get(j, "diagnosis"),
                                                        "summary"));
    ck_assert_msg(strstr(sum, "caps the logits at 15 where the config says 30"), "%s", sum);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* A token flip judged by the evidence at its position                  */

/* The reference's run on tiny-gemma3 into memory, under an engine name. */
static cmp_memrec *record_as(const kv_model *m, const char *engine, const char *settings,
                             int p, int nnew)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, engine, settings, NULL, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    kv_observer *obs = cmp_memrec_observer(rec);
    ref_opts ro = {.max_ctx = p + nnew, .prefill_step = 0};
    kv_engine *eng = ref_create(m, &kc, &ro, obs, &e);
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[64];
    for (int i = 0; i < p; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m->cfg.vocab);
    gen_opts go = {.max_new = nnew, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    ck_assert_msg(generate(eng, &m->cfg, prompt, p, &go, obs, &res, &e) == 0, "%s", e.msg);
    gen_result_free(&res);
    engine_free(eng);
    return rec;
}

/* Both sides' /output, edited at one position to a near tie: the
 * reference's second choice 0.002 under its first; on the test side the
 * two ids at ranks 0 and 1 swapped (its logits show the flip, each of the
 * two off by 0.002) or not (its logits do not show it). */
#define NEAR_TIE 0.002f
static struct {
    cmp_source ref, test;
    int64_t at;
    bool swap;
} flip;

static int near_tie(const cmp_source *in, bool swap, int64_t pos0, int64_t n, float *lse,
                    int32_t *ids, float *vals, kv_err *e)
{
    int64_t first, rows;
    int k;
    if (in->output(in->ctx, pos0, n, lse, ids, vals, e) < 0 ||
        in->output_info(in->ctx, &first, &rows, &k) != 0)
        return -1;
    for (int64_t r = 0; r < n; r++)
        if (pos0 + r == flip.at) {
            float *v = vals + r * k;
            ck_assert(k < 3 || v[2] < v[0] - NEAR_TIE);
            v[1] = v[0] - NEAR_TIE;
            if (swap) {
                const int32_t t = ids[r * k];
                ids[r * k] = ids[r * k + 1];
                ids[r * k + 1] = t;
            }
        }
    return 0;
}

static int ref_output(void *ctx, int64_t pos0, int64_t n, float *lse, int32_t *ids, float *vals,
                      kv_err *e)
{
    (void)ctx;
    return near_tie(&flip.ref, false, pos0, n, lse, ids, vals, e);
}

static int test_output(void *ctx, int64_t pos0, int64_t n, float *lse, int32_t *ids,
                       float *vals, kv_err *e)
{
    (void)ctx;
    return near_tie(&flip.test, flip.swap, pos0, n, lse, ids, vals, e);
}

/* Compares the reference against a copy whose token at pos is the
 * reference's second choice there, at a near tie; swap: the test's
 * /output shows that flip. */
static void flip_compare(bool swap, cmp_result *r)
{
    kv_model m;
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset("tiny-gemma3", 0, &mo, &m, &e) == 0, "%s", e.msg);
    enum { P = 20, NEW = 6 };
    cmp_memrec *a = record_as(&m, "reference", "{\"engine\":\"reference\"}", P, NEW);
    cmp_memrec *b = record_as(&m, "pytorch", "{\"compute_dtype\":\"f32\"}", P, NEW);
    cmp_source sa, sb;
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    const int64_t at = P + 2;   /* the third generated token */
    int64_t first, rows;
    int k;
    ck_assert(sb.output_info(sb.ctx, &first, &rows, &k) == 0 && k >= 2);
    float lse, vals[64];
    int32_t ids[64];
    ck_assert(k <= 64 && sb.output(sb.ctx, at - 1, 1, &lse, ids, vals, &e) == 0);
    int32_t *tokens = malloc((size_t)sb.n_tokens * sizeof *tokens);
    memcpy(tokens, sb.tokens, (size_t)sb.n_tokens * sizeof *tokens);
    ck_assert_int_eq(tokens[at], ids[0]);
    tokens[at] = ids[1];
    flip.ref = sa;
    flip.test = sb;
    flip.at = at - 1;
    flip.swap = swap;
    sb.tokens = tokens;
    sa.output = ref_output;
    sb.output = test_output;
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, r, &e) == 0, "%s", e.msg);
    free(tokens);
    cmp_memrec_free(a);
    cmp_memrec_free(b);
    model_free(&m);
}

START_TEST(structure_flip_explained)
{
    cmp_result r;
    flip_compare(true, &r);
    char *t = cmp_render_text(&r, 0);
    ck_assert_msg(r.xrt.on && r.tokens.kind == CMP_TOKENS_DIFFER && r.tokens.flip_drift, "%s", t);
    ck_assert_msg(r.verdict == CMP_WITHIN_TOLERANCE, "%s", t);
    ck_assert_msg(fabs(r.tokens.logit_err - NEAR_TIE) <= 1e-6, "err %g", r.tokens.logit_err);
    ck_assert_msg(strstr(t, "near-tie flip") && strstr(t, "--follow"), "%s", t);
    free(t);
    cmp_result_free(&r);
}
END_TEST

START_TEST(structure_flip_unexplained)
{
    cmp_result r;
    flip_compare(false, &r);
    char *t = cmp_render_text(&r, 0);
    ck_assert_msg(r.tokens.kind == CMP_TOKENS_DIFFER && !r.tokens.flip_drift, "%s", t);
    ck_assert_msg(r.verdict == CMP_DIVERGED, "%s", t);
    free(t);
    cmp_result_free(&r);
}
END_TEST

/* kvdiff's own chunked engine, cascade attention, judged as another
 * runtime (--cross-runtime): it computes in f32 with an f32 cache, and is
 * held to that, not to an assumed bf16 (whose floor let a decode index
 * that does not advance pass: no step, 5.7% at attn_lse). */
START_TEST(structure_own_engines_f32)
{
    char dir[256], args[1536];
    test_tmpdir(dir, sizeof dir);
    const char *common = "--model tiny-gemma3 --prompt-random 100 --seed 3 --max-new 8 "
                         "--ignore-eos";
    snprintf(args, sizeof args, "run %s --dump %s/ref.h5", common, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run %s --engine chunked --attn cascade --chunk 16 --dump "
             "%s/cascade.h5", common, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run %s --engine chunked --attn cascade --chunk 16 --inject "
             "decode-index-stuck --dump %s/stuck.h5", common, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/cascade.h5 --cross-runtime --json", dir,
             dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%.3000s", out);
    json_t *j = json_loads(out, 0, NULL);
    json_t *c = json_object_get(json_object_get(json_object_get(j, "mode"), "cross_runtime"),
                                "compute");
    ck_assert_str_eq(json_string_value(json_object_get(c, "precision")), "f32");
    json_decref(j);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/stuck.h5 --cross-runtime --json", dir,
             dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%.3000s", out);
    j = json_loads(out, 0, NULL);
    expect_step(j, 101, 0, "attn_lse", "decode_index_stuck");
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

Suite *structure_suite(void)
{
    Suite *s = suite_create("structure");
    TCase *fit = tcase_create("fit");
    tcase_add_test(fit, structure_row_scale_fit);
    tcase_add_test(fit, structure_channel_offset_fit);
    tcase_add_test(fit, structure_logit_map_fit);
    suite_add_tcase(s, fit);
    TCase *fl = tcase_create("flip");
    tcase_add_test(fl, structure_flip_explained);
    tcase_add_test(fl, structure_flip_unexplained);
    suite_add_tcase(s, fl);
    TCase *tc = tcase_create("llama");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, structure_llama_norm_eps);
    tcase_add_test(tc, structure_llama_softcap);
    tcase_add_test(tc, structure_llama_bias);
    tcase_add_test(tc, structure_own_engines_f32);
    suite_add_tcase(s, tc);
    return s;
}
