/* check_diagnose.c — diagnoses that never state a false fact.
 *
 * Injections recorded beside the reference on random prompts (as `kvdiff
 * run --prompt-random N --seed S` draws them), over enough seeds and cache
 * geometries to hit the cases where two bugs read the same keys at the
 * first divergence, and recordings that lack what a rule needs (key
 * counts, attn_out, q/k/v, engine settings). Each must get the diagnosis
 * the evidence supports, and its text must say nothing the evidence
 * contradicts. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "chunked/chunked.h"
#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "dump/dump.h"
#include "model/generate.h"
#include "model/kernels.h"
#include "model/pcg32.h"
#include "reference/reference.h"
#include "testutil.h"

/* ------------------------------------------------------------------ */
/* Recording                                                            */

typedef struct {
    const char *preset;
    uint64_t weights_seed;
    int p, nnew;
    uint64_t prompt_seed;        /* the prompt as --prompt-random p --seed prompt_seed */
} run_spec;

/* One engine run into a new in-memory recording. o NULL: the reference.
 * settings: the engine settings JSON to record (NULL: none). */
static cmp_memrec *record(const kv_model *m, const run_spec *rs, const chk_opts *o,
                          const char *settings, const cmp_memrec_opts *mo)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, o ? "chunked" : "reference", settings, mo, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    kv_observer *obs = cmp_memrec_observer(rec);
    kv_engine *eng;
    if (o) {
        chk_opts co = *o;
        co.max_ctx = rs->p + rs->nnew;
        eng = chk_create(m, &kc, &co, obs, &e);
    } else {
        ref_opts ro = {.max_ctx = rs->p + rs->nnew, .prefill_step = 0};
        eng = ref_create(m, &kc, &ro, obs, &e);
    }
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t *prompt = malloc((size_t)rs->p * sizeof *prompt);
    ck_assert_ptr_nonnull(prompt);
    pcg32 r;
    pcg32_seed(&r, rs->prompt_seed, 0x70);   /* the CLI's prompt stream */
    for (int i = 0; i < rs->p; i++)
        prompt[i] = (int32_t)pcg32_bounded(&r, (uint32_t)m->cfg.vocab);
    gen_opts go = {.max_new = rs->nnew, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    ck_assert_msg(generate(eng, &m->cfg, prompt, rs->p, &go, obs, &res, &e) == 0, "%s", e.msg);
    ck_assert_msg(cmp_memrec_error(rec) == NULL, "%s", cmp_memrec_error(rec));
    gen_result_free(&res);
    engine_free(eng);
    free(prompt);
    return rec;
}

static void open_model(const char *name, uint64_t seed, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, seed, &mo, m, &e) == 0, "%s", e.msg);
}

static chk_opts chunked(chk_cache_kind cache, int chunk, chk_share_kind share, const char *inject)
{
    chk_opts o;
    kv_err e = {{0}};
    chk_opts_default(&o);
    o.cache = cache;
    o.chunk = chunk;
    o.share = share;
    ck_assert_msg(chk_injection_parse(inject, &o.inj, &e) == 0, "%s", e.msg);
    return o;
}

/* The settings JSON kvdiff run records for a chunked run. */
static void chunked_settings(const chk_opts *o, const char *inject, int max_ctx, char *buf,
                             size_t n)
{
    snprintf(buf, n, "{\"engine\":\"chunked\",\"chunk\":%d,\"cache\":\"%s\",\"attention\":"
             "\"exact\",\"inject\":\"%s\",\"max_ctx\":%d}", o->chunk, chk_cache_name(o->cache),
             inject, max_ctx);
}

static void compare(cmp_memrec *a, cmp_memrec *b, cmp_result *r)
{
    cmp_source sa, sb;
    kv_err e = {{0}};
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, r, &e) == 0, "%s", e.msg);
}

static char *text_of(const cmp_result *r)
{
    char *t = cmp_render_text(r, 0);
    ck_assert_ptr_nonnull(t);
    return t;
}

/* ------------------------------------------------------------------ */
/* A stuck decode index is not a stale cache                            */

/* At P + 1 a stuck decode index (key P's slot holds key P + 1, slot P + 1
 * never written) and a stale cache (key P read as never written) read the
 * same pairs (k, v) in other slots: attention there cannot tell them
 * apart, and rounding picked one. P + 2 does. */
typedef struct {
    const char *preset;
    uint64_t weights_seed;
    int p;
    chk_cache_kind cache;
    int chunk;
    chk_share_kind share;
} stuck_geom;

static const stuck_geom stuck_geoms[] = {
    {"tiny-gemma3-kvshared", 0, 50, CACHE_DENSE, 7, SHARE_PLAIN},
    {"tiny-gemma3-kvshared", 0, 50, CACHE_DENSE, 3, SHARE_PLAIN},
    {"tiny-gemma3-kvshared", 0, 50, CACHE_SPLIT, 11, SHARE_OWNER_READ_ONLY},
    {"tiny-gemma3", 1, 17, CACHE_SPLIT, 25, SHARE_PLAIN},
    {"tiny-gemma3", 0, 33, CACHE_RING, 5, SHARE_PLAIN},
    {"tiny-gemma3", 0, 9, CACHE_RING, 4, SHARE_PLAIN},
};
#define STUCK_SEEDS 12   /* the cases above that used to fail are seeds 0 and 3 */

START_TEST(test_decode_stuck_not_stale)
{
    const stuck_geom *g = &stuck_geoms[_i];
    kv_model m;
    open_model(g->preset, g->weights_seed, &m);
    for (uint64_t seed = 0; seed < STUCK_SEEDS; seed++) {
        run_spec rs = {.weights_seed = g->weights_seed, .p = g->p, .nnew = 12,
                       .prompt_seed = seed};
        chk_opts o = chunked(g->cache, g->chunk, g->share, "decode-index-stuck");
        char settings[256];
        chunked_settings(&o, "decode-index-stuck", rs.p + rs.nnew, settings, sizeof settings);
        cmp_memrec *ref = record(&m, &rs, NULL, NULL, NULL);
        cmp_memrec *got = record(&m, &rs, &o, settings, NULL);
        cmp_result r;
        compare(ref, got, &r);
        char *t = text_of(&r);
        ck_assert_msg(r.first.found && r.first.pos == g->p + 1 && r.first.layer == 0,
                      "%s chunk %d seed %llu: divergence elsewhere\n%s", g->preset, g->chunk,
                      (unsigned long long)seed, t);
        ck_assert_msg(r.diag.kind == CMP_DIAG_DECODE_STUCK && r.diag.basis == CMP_BASIS_RECOMPUTED,
                      "%s %s chunk %d seed %llu: %s\n%s", g->preset, chk_cache_name(g->cache),
                      g->chunk, (unsigned long long)seed, cmp_diag_name(r.diag.kind), t);
        ck_assert_msg(!strstr(t, "first decode step"), "P + 1 called the first decode step\n%s", t);
        free(t);
        cmp_result_free(&r);
        cmp_memrec_free(ref);
        cmp_memrec_free(got);
    }
    model_free(&m);
}
END_TEST

/* Recorded only up to P + 1, attention at P + 1 alone cannot tell a
 * stuck index from a stale cache; the positions before it can: a stale
 * cache would have shown at the chunk boundaries of the prefill, or (one
 * stale between decode steps only) at P itself, where the test read the
 * config's keys. So the stuck index is verified, with or without the
 * global layer recorded. */
START_TEST(test_decode_stuck_not_stale_before_p)
{
    kv_model m;
    open_model("tiny-gemma3-kvshared", 0, &m);
    run_spec rs = {.p = 50, .nnew = 12, .prompt_seed = 3};
    chk_opts o = chunked(CACHE_DENSE, 7, SHARE_PLAIN, "decode-index-stuck");
    char settings[256];
    chunked_settings(&o, "decode-index-stuck", rs.p + rs.nnew, settings, sizeof settings);
    for (int with_global = 1; with_global >= 0; with_global--) {
        cmp_memrec_opts mo;
        cmp_memrec_opts_default(&mo);
        mo.pos_hi = rs.p + 1;
        if (!with_global)
            mo.layer_hi = 4;
        cmp_memrec *ref = record(&m, &rs, NULL, NULL, NULL);
        cmp_memrec *got = record(&m, &rs, &o, settings, &mo);
        cmp_result r;
        compare(ref, got, &r);
        char *t = text_of(&r);
        ck_assert_msg(r.first.found && r.first.pos == rs.p + 1, "%s", t);
        ck_assert_msg(r.diag.kind == CMP_DIAG_DECODE_STUCK &&
                      r.diag.basis == CMP_BASIS_RECOMPUTED && !r.diag.undecided, "%s", t);
        ck_assert_msg(strstr(r.diag.evidence, "would have changed positions before 51, where the "
                                              "test read the config's keys"), "%s", t);
        bool stale_refuted = false;
        for (int i = 0; i < r.diag.n_hyps; i++)
            stale_refuted |= r.diag.hyps[i].kind == CMP_DIAG_STALE_CACHE &&
                             r.diag.hyps[i].status == CMP_HYP_REFUTED &&
                             r.diag.hyps[i].refuted_pos <= 50;
        ck_assert_msg(stale_refuted, "%s", t);
        ck_assert_msg(!strstr(t, "first decode step"), "%s", t);
        free(t);
        cmp_result_free(&r);
        cmp_memrec_free(ref);
        cmp_memrec_free(got);
    }
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Unknown key counts                                                   */

/* Which side records attn_nkeys (and whether q, k, v are recorded). */
typedef struct {
    bool ref_nkeys, test_nkeys, qkv;
    cmp_diag_kind kind;          /* the diagnosis the evidence supports */
    const char *keys;            /* the key-count text it must carry */
} unknown_case;

static const unknown_case unknown_cases[] = {
    {true, false, true, CMP_DIAG_CHUNK_ISOLATED, "keys attended 8 vs unknown"},
    {false, true, true, CMP_DIAG_CHUNK_ISOLATED, "keys attended unknown"},
    {false, false, false, CMP_DIAG_KEY_SET, "keys attended unknown vs unknown"},
};

/* isolated-chunks, chunk 7: position 7 reads 1 key where the config
 * reads 8. A count a side did not record is "unknown" (JSON null), never
 * -1, and never "in both". */
START_TEST(test_unknown_key_count_not_printed)
{
    const unknown_case *uc = &unknown_cases[_i];
    kv_model m;
    open_model("tiny-gemma3", 0, &m);
    run_spec rs = {.p = 20, .nnew = 4, .prompt_seed = 0};
    chk_opts o = chunked(CACHE_DENSE, 7, SHARE_PLAIN, "isolated-chunks");
    char settings[256];
    chunked_settings(&o, "isolated-chunks", rs.p + rs.nnew, settings, sizeof settings);
    cmp_memrec_opts mr, mt;
    cmp_memrec_opts_default(&mr);
    mr.stages[STAGE_ATTN_NKEYS] = uc->ref_nkeys;
    mt = mr;
    mt.stages[STAGE_ATTN_NKEYS] = uc->test_nkeys;
    for (int st = STAGE_Q; !uc->qkv && st <= STAGE_V; st++)
        mr.stages[st] = mt.stages[st] = false;
    cmp_memrec *ref = record(&m, &rs, NULL, NULL, &mr);
    cmp_memrec *got = record(&m, &rs, &o, settings, &mt);
    cmp_result r;
    compare(ref, got, &r);
    char *t = text_of(&r);
    ck_assert_msg(r.first.found && r.first.pos == 7 && r.first.stage == STAGE_ATTN_LSE, "%s", t);
    ck_assert_msg(r.diag.kind == uc->kind, "%s\n%s", cmp_diag_name(r.diag.kind), t);
    ck_assert_msg(strstr(r.diag.detail, uc->keys), "'%s' not in the detail\n%s", uc->keys, t);
    ck_assert_msg(!strstr(t, "vs -1") && !strstr(t, "attended -1") && !strstr(t, "in both"), "%s", t);
    json_t *j = cmp_result_json(&r, 0);
    ck_assert_ptr_nonnull(j);
    json_t *ev = json_object_get(j, "evidence"), *nr = json_object_get(ev, "nkeys_ref"),
           *nt = json_object_get(ev, "nkeys_test");
    ck_assert_msg(uc->ref_nkeys ? json_integer_value(nr) == 8 : json_is_null(nr), "nkeys_ref");
    ck_assert_msg(uc->test_nkeys ? json_integer_value(nt) == 1 : json_is_null(nt), "nkeys_test");
    json_decref(j);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Zero keys from the scores alone                                      */

/* zero-shared-kv with only attn_lse and attn_nkeys recorded (and q in the
 * second case): lse = log(n) for n keys is every score 0, the sign of
 * zero keys. Once it was "a different key set (keys attended 1 vs 1)". */
START_TEST(test_zero_kv_from_lse_alone)
{
    kv_model m;
    open_model("tiny-gemma3-kvshared", 0, &m);
    run_spec rs = {.p = 20, .nnew = 4, .prompt_seed = 0};
    chk_opts o = chunked(CACHE_DENSE, 16, SHARE_PLAIN, "zero-shared-kv");
    char settings[256];
    chunked_settings(&o, "zero-shared-kv", rs.p + rs.nnew, settings, sizeof settings);
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    for (int st = 0; st < STAGE_COUNT; st++)
        mo.stages[st] = st == STAGE_ATTN_LSE || st == STAGE_ATTN_NKEYS || (_i == 1 && st == STAGE_Q);
    cmp_memrec *ref = record(&m, &rs, NULL, NULL, &mo);
    cmp_memrec *got = record(&m, &rs, &o, settings, &mo);
    cmp_result r;
    compare(ref, got, &r);
    char *t = text_of(&r);
    ck_assert_msg(r.first.found && r.first.pos == 0 && r.first.layer == 8, "%s", t);
    ck_assert_msg(r.diag.kind == CMP_DIAG_ZERO_KV && r.diag.basis == CMP_BASIS_EXACT_CHECK,
                  "%s\n%s", cmp_diag_name(r.diag.kind), t);
    ck_assert_msg(!strstr(t, "different key set"), "%s", t);
    ck_assert_msg(strstr(r.diag.evidence, "V = 0 is not checked"), "%s", t);
    /* Without q a zero query gives the same scores: said, not hidden. */
    ck_assert_msg((strstr(r.diag.summary, "zero query") != NULL) == (_i == 0), "%s", t);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* RoPE offsets of any size                                             */

/* rope-offset=N at position P: q rotated as if at P + N. A 128k context
 * makes offsets far past the 4096 once searched possible. */
static const struct {
    const char *preset;
    int offset;
} rope_cases[] = {
    {"tiny-qwen2", 3},      {"tiny-qwen2", 5000},    {"tiny-gemma3", 5000},
    {"tiny-llama", 100000}, {"tiny-gemma3", 131072}, {"tiny-qwen2", 1000003},
};

START_TEST(test_rope_offset_any_size)
{
    kv_model m;
    open_model(rope_cases[_i].preset, 0, &m);
    run_spec rs = {.p = 20, .nnew = 3, .prompt_seed = 1};
    char inject[64], settings[256];
    snprintf(inject, sizeof inject, "rope-offset=%d", rope_cases[_i].offset);
    chk_opts o = chunked(CACHE_DENSE, 16, SHARE_PLAIN, inject);
    chunked_settings(&o, inject, rs.p + rs.nnew, settings, sizeof settings);
    cmp_memrec *ref = record(&m, &rs, NULL, NULL, NULL);
    cmp_memrec *got = record(&m, &rs, &o, settings, NULL);
    cmp_result r;
    compare(ref, got, &r);
    char *t = text_of(&r);
    ck_assert_msg(r.first.found && r.first.pos == rs.p && r.first.stage == STAGE_Q, "%s", t);
    ck_assert_msg(r.diag.kind == CMP_DIAG_ROPE_OFFSET && r.diag.basis == CMP_BASIS_RECOMPUTED,
                  "%s\n%s", cmp_diag_name(r.diag.kind), t);
    ck_assert_int_eq(r.ev.rope_delta, rope_cases[_i].offset);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* Rows rotated as the engines rotate them (rotate-half, angle pos x
 * inv_freq in double), at two positions: the solver finds the offset
 * between them whatever its size or sign, restarts at 0 included, and
 * finds none for a row that is not a rotation of the other. */
static void rotate_rows(const float *x, float *y, int nh, int D, const double *inv, int64_t pos)
{
    const int half = D / 2;
    for (int h = 0; h < nh; h++)
        for (int d = 0; d < half; d++) {
            const double a = x[h * D + d], b = x[h * D + d + half], ang = (double)pos * inv[d];
            y[h * D + d] = (float)(a * cos(ang) - b * sin(ang));
            y[h * D + d + half] = (float)(b * cos(ang) + a * sin(ang));
        }
}

START_TEST(test_rope_solve_offsets)
{
    kv_model m;
    open_model("tiny-qwen2", 0, &m);
    const kv_config *c = &m.cfg;
    const int nh = c->n_heads, D = c->head_dim;
    double inv[256];
    kern_rope_inv_freq(c->rope_theta, D, inv);
    float x[1024], a[1024], b[1024];
    pcg32 rng;
    pcg32_seed(&rng, 7, 1);
    for (int i = 0; i < nh * D; i++)
        x[i] = (float)pcg32_bounded(&rng, 2000) / 1000.0f - 1.0f;
    static const int64_t pos[][2] = {
        {40, 43}, {4000, 9000}, {131000, 0}, {250000, 7}, {17, 131089}, {1 << 30, 12},
    };
    for (size_t i = 0; i < sizeof pos / sizeof *pos; i++) {
        rotate_rows(x, a, nh, D, inv, pos[i][0]);
        rotate_rows(x, b, nh, D, inv, pos[i][1]);
        int64_t delta;
        double err = cmp_rope_solve(c, 0, a, b, nh, &delta);
        ck_assert_msg(err <= CMP_MATCH_TOL && delta == pos[i][1] - pos[i][0],
                      "%lld -> %lld: found %lld (error %g)", (long long)pos[i][0],
                      (long long)pos[i][1], (long long)delta, err);
    }
    b[3] += 0.5f;   /* no longer a rotation */
    int64_t delta;
    ck_assert(!(cmp_rope_solve(c, 0, a, b, nh, &delta) <= CMP_MATCH_TOL));
    model_free(&m);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Engine settings {}                                                   */

/* A dump written from docs/dump-format.md alone stores engine_settings
 * as {}. The chunk size and a ring's size are then read from the data
 * (the first divergence of a chunk-shaped bug is the first chunk
 * boundary, a ring that stops storing diverges first at its size); a
 * stuck decode index in a ring needs the recorded chunk and cache, and
 * then nothing wrong may be claimed. */
typedef struct {
    const char *preset;
    chk_cache_kind cache;
    int chunk;
    const char *inject;
    cmp_diag_kind diag;          /* CMP_DIAG_NONE: not inferable, must not be claimed */
    cmp_diag_kind not_diag;
} bare_case;

static const bare_case bare_cases[] = {
    {"tiny-gemma3", CACHE_DENSE, 5, "isolated-chunks", CMP_DIAG_CHUNK_ISOLATED, 0},
    {"tiny-llama", CACHE_RING, 16, "isolated-chunks", CMP_DIAG_CHUNK_ISOLATED, 0},
    {"tiny-gemma3", CACHE_SPLIT, 64, "isolated-chunks", CMP_DIAG_CHUNK_ISOLATED, 0},
    {"tiny-gemma3", CACHE_RING, 5, "stale-local", CMP_DIAG_STALE_CACHE, 0},
    {"tiny-gemma3-kvshared", CACHE_DENSE, 7, "stale-local", CMP_DIAG_STALE_CACHE, 0},
    {"tiny-gemma3", CACHE_DENSE, 40, "stale-local", CMP_DIAG_STALE_CACHE, 0},
    {"tiny-gemma3", CACHE_RING, 5, "ring-no-wrap", CMP_DIAG_RING_NO_WRAP, 0},
    {"tiny-gemma3", CACHE_RING, 16, "ring-no-wrap", CMP_DIAG_RING_NO_WRAP, 0},
    {"tiny-gemma3", CACHE_DENSE, 16, "decode-index-stuck", CMP_DIAG_DECODE_STUCK, 0},
    {"tiny-gemma3", CACHE_SPLIT, 16, "decode-index-stuck", CMP_DIAG_DECODE_STUCK, 0},
    {"tiny-gemma3", CACHE_RING, 5, "window=4", CMP_DIAG_WINDOW, 0},
    {"tiny-llama", CACHE_SPLIT, 16, "split-mask-off-by-one", CMP_DIAG_EXTRA_KEY, 0},
    {"tiny-gemma3", CACHE_RING, 3, "decode-index-stuck", CMP_DIAG_NONE, CMP_DIAG_DECODE_STUCK},
};

START_TEST(test_bare_settings_diagnosed_from_data)
{
    const bare_case *bc = &bare_cases[_i];
    kv_model m;
    open_model(bc->preset, 0, &m);
    run_spec rs = {.p = 40, .nnew = 24, .prompt_seed = 5};
    chk_opts o = chunked(bc->cache, bc->chunk, SHARE_PLAIN, bc->inject);
    cmp_memrec *ref = record(&m, &rs, NULL, "{}", NULL);
    cmp_memrec *got = record(&m, &rs, &o, "{}", NULL);
    cmp_result r;
    compare(ref, got, &r);
    char *t = text_of(&r);
    ck_assert_msg(r.first.found, "%s", t);
    if (bc->diag != CMP_DIAG_NONE) {
        ck_assert_msg(r.diag.kind == bc->diag && r.diag.basis == CMP_BASIS_RECOMPUTED,
                      "%s on %s: %s (%s)\n%s", bc->inject, chk_cache_name(bc->cache),
                      cmp_diag_name(r.diag.kind), cmp_basis_name(r.diag.basis), t);
    } else {
        /* Not inferable: no key set reproduces it, and nothing is claimed. */
        ck_assert_msg(r.diag.kind != bc->not_diag && r.diag.kind == CMP_DIAG_KEY_SET &&
                      r.diag.basis == CMP_BASIS_HEURISTIC, "%s\n%s",
                      cmp_diag_name(r.diag.kind), t);
    }
    ck_assert_msg(!strstr(t, "chunk of 0") && !strstr(t, "chunk 0"), "%s", t);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}
END_TEST

/* kvdiff validate warns, without a violation, when a test-side recording
 * gives no chunk or cache; a reference's settings are not needed. */
typedef struct {
    int lines, warnings;
    char text[4096];
} vlog;

static void vcollect(void *ctx, const char *line)
{
    vlog *l = ctx;
    l->lines++;
    l->warnings += strncmp(line, "warning: ", 9) == 0;
    size_t used = strlen(l->text);
    snprintf(l->text + used, sizeof l->text - used, "%s\n", line);
}

START_TEST(test_validate_warns_without_settings)
{
    static const struct {
        const char *engine, *settings;
        int warns;
        const char *says;   /* the warning's words */
    } cases[] = {
        {"pytorch", "{}", 1, "engine_settings gives no"},
        {"pytorch", "{\"chunk\":512}", 1, "engine_settings gives no"},
        {"pytorch", "{\"chunk\":512,\"cache\":\"ring\"}", 0, NULL},
        {"reference", "{}", 0, NULL},
        /* values the comparer would ignore, each named */
        {"pytorch", "{\"chunk\":0,\"cache\":\"ring\"}", 1, "gives chunk 0;"},
        {"pytorch", "{\"chunk\":\"512\",\"cache\":\"ring\"}", 1, "gives chunk \"512\";"},
        {"pytorch", "{\"chunk\":8,\"cache\":\"dynamic\"}", 1, "gives cache \"dynamic\", which"},
        {"pytorch", "{\"chunk\":8,\"cache\":\"dense\",\"compute_dtype\":\"f64\"}", 1,
         "gives compute_dtype \"f64\", which the drift model does not know (it reads f32, "
         "float32, tf32, f16, float16, bf16, bfloat16)"},
        {"pytorch", "{\"chunk\":8,\"cache\":\"dense\",\"cache_type\":\"tf32\"}", 1,
         "gives cache_type \"tf32\", which the drift model does not know (it reads f32, "
         "float32, f16, float16, bf16, bfloat16, q8_0, q4_0)"},
        {"pytorch", "{\"chunk\":8,\"cache\":\"dense\",\"kv_dtype\":7}", 1, "gives kv_dtype 7,"},
        {"reference", "{\"chunk\":-3}", 1, "gives chunk -3;"},
        {"pytorch", "{\"chunk\":8,\"cache\":\"split\",\"compute_dtype\":\"bfloat16\","
                    "\"cache_type\":\"q8_0\"}", 0, NULL},
    };
    kv_model m;
    open_model("tiny-llama", 0, &m);
    char dir[256], path[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/d.h5", dir);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kv_err e = {{0}};
        dump_opts o;
        dump_opts_default(&o);
        dump_meta meta = {.engine = cases[i].engine, .engine_settings = cases[i].settings,
                          .cfg = &m.cfg, .weight_fingerprint = m.fingerprint,
                          .tool_version = "kvdiff test", .max_positions = 6, .prompt_length = 4};
        dump_writer *w = dump_create(path, &meta, &o, &e);
        ck_assert_msg(w != NULL, "%s", e.msg);
        kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
        ref_opts ro = {.max_ctx = 6, .prefill_step = 0};
        kv_engine *eng = ref_create(&m, &kc, &ro, dump_observer(w), &e);
        ck_assert_msg(eng != NULL, "%s", e.msg);
        const int32_t prompt[4] = {1, 2, 3, 4};
        gen_opts go = {.max_new = 2, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
        gen_result res;
        ck_assert_msg(generate(eng, &m.cfg, prompt, 4, &go, dump_observer(w), &res, &e) == 0,
                      "%s", e.msg);
        gen_result_free(&res);
        engine_free(eng);
        ck_assert_msg(dump_close(w, NULL, &e) == 0, "%s", e.msg);
        vlog l = {0};
        int n = dump_validate(path, vcollect, &l, &e);
        ck_assert_msg(n == 0, "%s: %d violations\n%s", cases[i].settings, n, l.text);
        ck_assert_msg(l.warnings == cases[i].warns && l.lines == l.warnings,
                      "%s %s:\n%s", cases[i].engine, cases[i].settings, l.text);
        if (cases[i].says)
            ck_assert_msg(strstr(l.text, cases[i].says), "%s", l.text);
    }
    test_rmtree(dir);
    model_free(&m);
}
END_TEST

Suite *diagnose_suite(void)
{
    Suite *s = suite_create("diagnose");
    TCase *tc = tcase_create("diagnose");
    tcase_add_loop_test(tc, test_decode_stuck_not_stale, 0,
                        (int)(sizeof stuck_geoms / sizeof *stuck_geoms));
    tcase_add_test(tc, test_decode_stuck_not_stale_before_p);
    tcase_add_loop_test(tc, test_unknown_key_count_not_printed, 0,
                        (int)(sizeof unknown_cases / sizeof *unknown_cases));
    tcase_add_loop_test(tc, test_zero_kv_from_lse_alone, 0, 2);
    tcase_add_loop_test(tc, test_rope_offset_any_size, 0,
                        (int)(sizeof rope_cases / sizeof *rope_cases));
    tcase_add_test(tc, test_rope_solve_offsets);
    tcase_add_loop_test(tc, test_bare_settings_diagnosed_from_data, 0,
                        (int)(sizeof bare_cases / sizeof *bare_cases));
    tcase_add_test(tc, test_validate_warns_without_settings);
    suite_add_tcase(s, tc);
    return s;
}
