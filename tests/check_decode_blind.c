/* check_decode_blind.c — the split-decode-blind injection and its
 * diagnosis.
 *
 * A split prefill/decode cache whose decode steps read only the decode
 * cache reads, at the first decode step P, only the new token's key: what
 * isolated chunks read there when the prompt fits in one chunk. The
 * comparer must tell them apart from P + 1 (the decode cache so far,
 * {P, P + 1}, against {P + 1}), never name one for the other, and name
 * both when P + 1 was not run. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chunked/chunked.h"
#include "compare/compare.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "testutil.h"

#define P 40      /* prompt length: the first decode step */
#define NEW 8     /* P + 1 and a few more are run */

/* ------------------------------------------------------------------ */
/* Recording                                                            */

typedef struct {
    const char *preset;
    chk_cache_kind cache;
    int chunk;
    const char *inject;          /* comma-separated --inject values; NULL: none */
    chk_attn_kind attn;
    int nnew;
    bool no_qkv;                 /* record neither q, k nor v (an engine that cannot) */
    bool no_settings;            /* the test says nothing of how it ran */
} blind_case;

static void open_model(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

/* Runs the reference (o NULL) or the chunked engine on the fixed prompt. */
static cmp_memrec *record(const kv_model *m, const chk_opts *o, const blind_case *bc)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    const int T = P + bc->nnew;
    char settings[512];
    if (!o)
        snprintf(settings, sizeof settings, "{\"engine\":\"reference\",\"max_ctx\":%d}", T);
    else
        snprintf(settings, sizeof settings, "{\"engine\":\"chunked\",\"chunk\":%d,\"cache\":"
                 "\"%s\",\"attention\":\"%s\",\"max_ctx\":%d}", o->chunk,
                 chk_cache_name(o->cache), o->attn == CHK_ATTN_CASCADE ? "cascade" : "exact", T);
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    if (bc->no_qkv)
        mo.stages[STAGE_Q] = mo.stages[STAGE_K] = mo.stages[STAGE_V] = false;
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, o ? "chunked" : "reference",
                                     o && bc->no_settings ? NULL : settings, &mo, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    kv_observer *obs = cmp_memrec_observer(rec);
    kv_engine *eng;
    if (o) {
        chk_opts co = *o;
        co.max_ctx = T;
        eng = chk_create(m, &kc, &co, obs, &e);
    } else {
        ref_opts ro = {.max_ctx = T, .prefill_step = 0};
        eng = ref_create(m, &kc, &ro, obs, &e);
    }
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[P];
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m->cfg.vocab);
    gen_opts go = {.max_new = bc->nnew, .ignore_eos = true,
                   .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    ck_assert_msg(generate(eng, &m->cfg, prompt, P, &go, obs, &res, &e) == 0, "%s", e.msg);
    ck_assert_msg(cmp_memrec_error(rec) == NULL, "%s", cmp_memrec_error(rec));
    gen_result_free(&res);
    engine_free(eng);
    return rec;
}

/* Records both runs of bc and compares them; the report text goes to text. */
static void run_case(const blind_case *bc, cmp_result *r, char *text, size_t n)
{
    kv_model m;
    kv_err e = {{0}};
    open_model(bc->preset, &m);
    chk_opts o;
    chk_opts_default(&o);
    o.cache = bc->cache;
    o.chunk = bc->chunk;
    o.attn = bc->attn;
    char inj[128];
    snprintf(inj, sizeof inj, "%s", bc->inject ? bc->inject : "");
    for (char *tok = strtok(inj, ","); tok; tok = strtok(NULL, ","))
        ck_assert_msg(chk_injection_parse(tok, &o.inj, &e) == 0, "%s", e.msg);
    cmp_memrec *ref = record(&m, NULL, bc);
    cmp_memrec *got = record(&m, &o, bc);
    cmp_source sa, sb;
    cmp_memrec_source(ref, &sa);
    cmp_memrec_source(got, &sb);
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, r, &e) == 0, "%s", e.msg);
    char *t = cmp_render_text(r, 0);
    snprintf(text, n, "%s", t ? t : "(render failed)");
    free(t);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}

/* The point diagnosed: beyond drift when there is one, else the first. */
static const cmp_divergence *diagnosed(const cmp_result *r)
{
    return r->beyond.found ? &r->beyond : &r->first;
}

static void assert_at_first_decode_step(const cmp_result *r, const blind_case *bc,
                                        const char *text)
{
    const cmp_divergence *d = diagnosed(r);
    ck_assert_msg(r->verdict == CMP_DIVERGED && d->found, "%s on %s: not diverged\n%s",
                  bc->inject, bc->preset, text);
    ck_assert_msg(d->pos == P && d->layer == 0 && d->stage == STAGE_ATTN_LSE,
                  "%s on %s (%s, chunk %d): divergence at %lld/%d/%s, predicted %d/0/attn_lse\n%s",
                  bc->inject, bc->preset, chk_cache_name(bc->cache), bc->chunk,
                  (long long)d->pos, d->layer, stage_name(d->stage), P, text);
}

/* ------------------------------------------------------------------ */
/* split-decode-blind is named, with the prefill/decode split           */

static const blind_case blind_cases[] = {
    {"tiny-llama", CACHE_SPLIT, 16, "split-decode-blind", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-qwen2", CACHE_SPLIT, P, "split-decode-blind", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-gemma3", CACHE_SPLIT, 5, "split-decode-blind", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-gemma3-kvshared", CACHE_SPLIT, 7, "split-decode-blind", CHK_ATTN_EXACT, NEW, false,
     false},
    /* A recording that does not say how it ran (another runtime's). */
    {"tiny-llama", CACHE_SPLIT, 16, "split-decode-blind", CHK_ATTN_EXACT, NEW, false, true},
};

START_TEST(test_blind_located_and_named)
{
    const blind_case *bc = &blind_cases[_i];
    cmp_result r;
    char text[8192];
    run_case(bc, &r, text, sizeof text);
    assert_at_first_decode_step(&r, bc, text);
    ck_assert_msg(r.diag.kind == CMP_DIAG_DECODE_BLIND && r.diag.basis == CMP_BASIS_RECOMPUTED,
                  "%s: %s / %s\n%s", bc->preset, cmp_diag_name(r.diag.kind),
                  cmp_basis_name(r.diag.basis), text);
    ck_assert_str_eq(cmp_diag_name(r.diag.kind), "split_decode_blind");
    ck_assert_msg(strstr(r.diag.summary, "decode steps attend only to the decode cache") &&
                  strstr(r.diag.detail, "the prefill's 40 keys (positions 0..39) are never "
                                        "read") &&
                  strstr(r.diag.detail, "at 41 the test read positions 40..41"), "%s", text);
    /* Verified at the places after P, against the rival that reads P alone. */
    ck_assert_msg(strstr(r.diag.evidence, "over the decode steps' keys 40..40 alone reproduces") &&
                  strstr(r.diag.evidence, "more places up to position 46") &&
                  strstr(r.diag.evidence, "chunks attending only to themselves (chunk 40) fails "
                                          "at position 41 (it reads 1 key there, the test 2)"),
                  "%s", text);
    ck_assert_int_eq(r.ev.qkv, 1);
    ck_assert_int_eq(r.ev.nkeys_test, 1);
    ck_assert_int_eq(cmp_exit_code(0, &r), 1);
    cmp_result_free(&r);
}
END_TEST

/* ------------------------------------------------------------------ */
/* isolated-chunks is never named split-decode-blind                    */

static const blind_case iso_cases[] = {
    /* The prompt fits in one chunk: the first boundary is P, as for a blind decode. */
    {"tiny-llama", CACHE_SPLIT, P + NEW, "isolated-chunks", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-gemma3", CACHE_SPLIT, P, "isolated-chunks", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-gemma3", CACHE_DENSE, P + 1, "isolated-chunks", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-gemma3", CACHE_RING, P, "isolated-chunks", CHK_ATTN_EXACT, NEW, false, false},
    {"tiny-qwen2", CACHE_SPLIT, P, "isolated-chunks", CHK_ATTN_EXACT, NEW, false, true},
    /* Without q, k, v: from key counts. */
    {"tiny-llama", CACHE_SPLIT, P, "isolated-chunks", CHK_ATTN_EXACT, NEW, true, false},
};

START_TEST(test_isolated_is_not_blind)
{
    const blind_case *bc = &iso_cases[_i];
    cmp_result r;
    char text[8192];
    run_case(bc, &r, text, sizeof text);
    assert_at_first_decode_step(&r, bc, text);
    /* Without the chunk size in the settings the key-set rule has no
     * chunk to test; it may say less, never "decode-blind". */
    ck_assert_msg(bc->no_settings ? r.diag.kind != CMP_DIAG_DECODE_BLIND
                                  : r.diag.kind == CMP_DIAG_CHUNK_ISOLATED,
                  "%s %s chunk %d: %s\n%s", bc->preset, chk_cache_name(bc->cache), bc->chunk,
                  cmp_diag_name(r.diag.kind), text);
    if (!bc->no_settings)
        ck_assert_msg(r.diag.basis == (bc->no_qkv ? CMP_BASIS_HEURISTIC : CMP_BASIS_RECOMPUTED),
                      "%s\n%s", cmp_basis_name(r.diag.basis), text);
    ck_assert_ptr_null(strstr(text, "decode cache"));
    cmp_result_free(&r);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Counts only, one decode step, neither pattern, behind drift          */

/* Without q, k, v the counts at P and P + 1 (1, then 2) still tell. */
START_TEST(test_blind_from_counts)
{
    const blind_case bc = {"tiny-gemma3", CACHE_SPLIT, 16, "split-decode-blind", CHK_ATTN_EXACT,
                           NEW, true, false};
    cmp_result r;
    char text[8192];
    run_case(&bc, &r, text, sizeof text);
    assert_at_first_decode_step(&r, &bc, text);
    ck_assert_msg(r.diag.kind == CMP_DIAG_DECODE_BLIND && r.diag.basis == CMP_BASIS_HEURISTIC,
                  "%s / %s\n%s", cmp_diag_name(r.diag.kind), cmp_basis_name(r.diag.basis), text);
    ck_assert_msg(strstr(r.diag.evidence, "from key counts only") &&
                  strstr(r.diag.evidence, "chunks attending only to themselves (chunk 40) fails "
                                          "at position 41 (it reads 1 key there, the test 2)"),
                  "%s", text);
    cmp_result_free(&r);
}
END_TEST

/* Only P is run (one decode step): nothing tells the two apart, so both
 * are named, whatever cache the settings name (a port's "dense" cache can
 * still be blind to its prefill). */
static const struct {
    blind_case bc;
    cmp_diag_kind want;
} one_step_cases[] = {
    {{"tiny-llama", CACHE_SPLIT, 16, "split-decode-blind", CHK_ATTN_EXACT, 2, false, false},
     CMP_DIAG_KEY_SET},
    {{"tiny-llama", CACHE_SPLIT, P, "isolated-chunks", CHK_ATTN_EXACT, 2, false, false},
     CMP_DIAG_KEY_SET},
    {{"tiny-gemma3", CACHE_SPLIT, P, "split-decode-blind", CHK_ATTN_EXACT, 2, true, false},
     CMP_DIAG_KEY_SET},
    {{"tiny-llama", CACHE_DENSE, P, "isolated-chunks", CHK_ATTN_EXACT, 2, false, false},
     CMP_DIAG_KEY_SET},
};

START_TEST(test_one_decode_step_names_both)
{
    const blind_case *bc = &one_step_cases[_i].bc;
    cmp_result r;
    char text[8192];
    run_case(bc, &r, text, sizeof text);
    assert_at_first_decode_step(&r, bc, text);
    ck_assert_msg(r.diag.kind == one_step_cases[_i].want, "%s %s: %s\n%s", bc->inject,
                  chk_cache_name(bc->cache), cmp_diag_name(r.diag.kind), text);
    if (r.diag.kind == CMP_DIAG_KEY_SET) {
        ck_assert_msg(strstr(r.diag.summary, "either chunks attending only to themselves or "
                                             "decode steps blind to the prefill") &&
                      !strstr(r.diag.summary, "chunk_isolated"), "%s", text);
        ck_assert_msg(strstr(r.diag.detail, "they read different keys at position 41, which the "
                                            "test did not reach"), "%s", text);
        ck_assert(r.diag.undecided);
        ck_assert_int_eq(r.diag.basis, bc->no_qkv ? CMP_BASIS_HEURISTIC : CMP_BASIS_RECOMPUTED);
    }
    cmp_result_free(&r);
}
END_TEST

/* A blind decode whose index is also stuck reads, at P + 1, P + 1's key
 * in P's slot and an unwritten one: neither pattern, and said so. */
START_TEST(test_neither_pattern_at_next_step)
{
    const blind_case bc = {"tiny-llama", CACHE_SPLIT, 16, "split-decode-blind,decode-index-stuck",
                           CHK_ATTN_EXACT, NEW, false, false};
    cmp_result r;
    char text[8192];
    run_case(&bc, &r, text, sizeof text);
    assert_at_first_decode_step(&r, &bc, text);
    ck_assert_msg(r.diag.kind == CMP_DIAG_KEY_SET && r.diag.basis == CMP_BASIS_RECOMPUTED,
                  "%s\n%s", cmp_diag_name(r.diag.kind), text);
    ck_assert_msg(strstr(r.diag.detail, "at position 41 of layer 0 none of them reproduces the "
                                        "test"), "%s", text);
    ck_assert(r.diag.undecided);
    cmp_result_free(&r);
}
END_TEST

/* Behind cascade attention's drift the blind decode is still named. */
START_TEST(test_blind_behind_drift)
{
    const blind_case bc = {"tiny-gemma3", CACHE_SPLIT, 5, "split-decode-blind", CHK_ATTN_CASCADE,
                           NEW, false, false};
    cmp_result r;
    char text[8192];
    run_case(&bc, &r, text, sizeof text);
    ck_assert_msg(r.beyond.found && r.first.pos < P, "%s", text);
    assert_at_first_decode_step(&r, &bc, text);
    ck_assert_msg(r.diag.kind == CMP_DIAG_DECODE_BLIND && r.diag.basis == CMP_BASIS_RECOMPUTED,
                  "%s\n%s", cmp_diag_name(r.diag.kind), text);
    cmp_result_free(&r);
}
END_TEST

/* ------------------------------------------------------------------ */
/* The catalogue                                                        */

START_TEST(test_listed_and_refused_elsewhere)
{
    char out[8192];
    ck_assert_msg(test_run_cli("run --list-injections", out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "split-decode-blind     split cache: decode steps attend only to "
                              "the decode cache"), "%s", out);
    kv_model m;
    kv_err e = {{0}};
    open_model("tiny-llama", &m);
    kern_ctx kc = {.isa = kern_isa_best()};
    static const struct {
        chk_cache_kind cache;
        const char *also, *needle;
    } bad[] = {
        {CACHE_DENSE, NULL, "split-decode-blind needs --cache split"},
        {CACHE_RING, NULL, "split-decode-blind needs --cache split"},
        {CACHE_SPLIT, "split-mask-off-by-one", "hides split-mask-off-by-one"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        chk_opts o;
        chk_opts_default(&o);
        o.cache = bad[i].cache;
        o.max_ctx = 64;
        ck_assert_int_eq(chk_injection_parse("split-decode-blind", &o.inj, &e), 0);
        if (bad[i].also)
            ck_assert_int_eq(chk_injection_parse(bad[i].also, &o.inj, &e), 0);
        ck_assert_ptr_null(chk_create(&m, &kc, &o, NULL, &e));
        ck_assert_msg(strstr(e.msg, bad[i].needle), "case %zu: %s", i, e.msg);
    }
    chk_injections inj;
    memset(&inj, 0, sizeof inj);
    ck_assert_int_eq(chk_injection_parse("split-decode-blind=1", &inj, &e), -1);
    ck_assert_int_eq(chk_injection_parse("split-decode-blind", &inj, &e), 0);
    char desc[128];
    chk_injections_describe(&inj, desc, sizeof desc);
    ck_assert_str_eq(desc, "split-decode-blind");
    model_free(&m);
}
END_TEST

Suite *decode_blind_suite(void)
{
    Suite *s = suite_create("decode_blind");
    TCase *tc = tcase_create("diagnosis");
    tcase_add_loop_test(tc, test_blind_located_and_named, 0,
                        (int)(sizeof blind_cases / sizeof *blind_cases));
    tcase_add_loop_test(tc, test_isolated_is_not_blind, 0,
                        (int)(sizeof iso_cases / sizeof *iso_cases));
    tcase_add_test(tc, test_blind_from_counts);
    tcase_add_loop_test(tc, test_one_decode_step_names_both, 0,
                        (int)(sizeof one_step_cases / sizeof *one_step_cases));
    tcase_add_test(tc, test_neither_pattern_at_next_step);
    tcase_add_test(tc, test_blind_behind_drift);
    tcase_add_test(tc, test_listed_and_refused_elsewhere);
    suite_add_tcase(s, tc);
    return s;
}
