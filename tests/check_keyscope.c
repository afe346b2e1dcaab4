/* check_keyscope.c — key-set bugs that live in one layer's code (a
 * first-layer special case, a shared layer): one key left out, or
 * each query's own key masked, on one layer only from some position on,
 * the other layers reading as the config says. The hypothesis engine must
 * name the cause with its scope ("on layer 0 only"), verified on the
 * layers it claims are right too; where the same bug is on every layer
 * the wide cause must win (no "only"); and where another layer is wrong
 * in another way the narrow scope must not be claimed.
 *
 * Two ways of planting: kvdiff's own chunked engine (--inject
 * drop-key=K@L, own-key-masked=F@L, and without @L), and the reference's
 * recording edited as an outside runtime would show the bug (attention
 * recomputed over the bug's keys, with and without attn_lse and key
 * counts). Beside them, Gemma 4's sliding layer 0 read as a full layer
 * (its rotation kept: the key-set half of that bug) is named layer_type. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "plants.h"
#include "testutil.h"

#define PLEN 40
#define NNEW 8

static void open_model(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

/* The diagnosis of ref against test, both in memory: *r filled; the
 * text returned (free it). */
static char *compare_pair(cmp_memrec *ref, cmp_memrec *test, cmp_result *r)
{
    cmp_source sa, sb;
    cmp_memrec_source(ref, &sa);
    cmp_memrec_source(test, &sb);
    kv_err e = {{0}};
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, r, &e) == 0, "%s", e.msg);
    char *t = cmp_render_text(r, 0);
    if (getenv("KVDIFF_TEST_SHOW"))
        fprintf(stderr, "%s\n", t);
    return t;
}

/* What a case must get: kind, place, a phrase, and whether "only" (a
 * narrow scope) may appear in the summary. */
typedef struct {
    const char *name;
    const char *preset;
    const char *inject;          /* chunked engine's injection; NULL: a hand plant */
    int plant;                   /* hand plants: which (below) */
    int64_t pos;
    int layer;
    cmp_diag_kind kind;
    const char *words;           /* in summary or detail; NULL: none required */
    bool narrow;                 /* the summary says "only" */
    bool counts_too;             /* hand plants: also without attn_lse, attn_nkeys */
} scope_case;

static void expect(const scope_case *sc, const cmp_result *r, const char *t, const char *how)
{
    const cmp_divergence *d = r->beyond.found ? &r->beyond : &r->first;
    ck_assert_msg(d->found && d->pos == sc->pos && d->layer == sc->layer,
                  "%s (%s): located at %lld/%d, planted at %lld/%d\n%s", sc->name, how,
                  (long long)d->pos, d->layer, (long long)sc->pos, sc->layer, t);
    ck_assert_msg(r->diag.kind == sc->kind && !r->diag.undecided &&
                      r->diag.basis == CMP_BASIS_RECOMPUTED,
                  "%s (%s): named %s (%s%s), planted %s\n%s", sc->name, how,
                  cmp_diag_name(r->diag.kind), cmp_basis_name(r->diag.basis),
                  r->diag.undecided ? ", undecided" : "", cmp_diag_name(sc->kind), t);
    char all[1024];
    snprintf(all, sizeof all, "%s %s", r->diag.summary, r->diag.detail);
    if (sc->words)
        ck_assert_msg(strstr(all, sc->words), "%s (%s): '%s' not in\n%s", sc->name, how,
                      sc->words, t);
    /* the scope's words: " on layer 0 only", " on the sliding layers only"
     * (not the "only" of "attend only to themselves") */
    const bool narrow = strstr(r->diag.summary, " on layer ") != NULL ||
                        strstr(r->diag.summary, " layers only") != NULL;
    ck_assert_msg(narrow == sc->narrow,
                  "%s (%s): the summary %s a narrow scope\n%s", sc->name, how,
                  sc->narrow ? "lacks" : "claims", t);
}

/* ------------------------------------------------------------------ */
/* Hand plants: the reference's recording edited                        */

#define FROM 20   /* the bug begins at this position */

/* Layer 0 alone, from FROM: key 15 left out (inside the window of 12). */
static bool plant_drop5_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                               cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    if (L != 0 || q < FROM || 15 < h->lo)
        return false;
    h->skip_one = true, h->skip_pos = 15;
    return true;
}

/* Layer 0 alone, from FROM: each query's own key masked. */
static bool plant_own_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                             cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    if (L != 0 || q < FROM)
        return false;
    h->hi = q - 1;
    return true;
}

/* Every layer from FROM: key 15 left out (the wide rival). */
static bool plant_drop5_all(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                            cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    (void)L;
    if (q < FROM || 15 < h->lo)
        return false;
    h->skip_one = true, h->skip_pos = 15;
    return true;
}

/* Layer 0 leaves key 15 out, and layer 1 key 17: layer 0 alone is not the
 * whole story, and must not be claimed. */
static bool plant_drop_two_layers(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                  cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    const int64_t key = L == 0 ? 15 : 17;
    if (L > 1 || q < FROM || key < h->lo)
        return false;
    h->skip_one = true, h->skip_pos = key;
    return true;
}

/* Gemma 4's sliding layer 0 reading every key, as a full layer does. */
static bool plant_layer0_full(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                              cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    (void)q;
    if (L != 0)
        return false;
    h->lo = 0;
    return true;
}

/* Layer 0 alone reads 3 unwritten (zero) slots at every decode step:
 * one layer's cache padded. */
static bool plant_padded_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                cmp_hyp *h)
{
    (void)cfg;
    if (L != 0 || q < a->P)
        return false;
    h->extra_zero = 3;
    return true;
}

/* Layer 0 alone: its write index stuck at slot P from the first decode
 * step (slot P holds the newest key, later slots stay unwritten). */
static bool plant_stuck_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                               cmp_hyp *h)
{
    if (L != 0)
        return false;
    const plant_arg at_p = {.P = a->P, .T = a->T, .n = a->P};
    return plant_stuck(&at_p, cfg, L, q, h);
}

/* Layer 2 alone, prefill chunks of 7: each chunk reads the previous
 * chunk's keys as never written (its cache copy taken before that chunk
 * wrote), as a sliding layer whose state is not synced does. */
static bool plant_stale_layer2(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                               cmp_hyp *h)
{
    (void)cfg;
    const int64_t cs = (q / 7) * 7;
    if (L != 2 || q >= a->P || cs == 0)
        return false;
    h->zero_lo = cs - 7 > h->lo ? cs - 7 : h->lo;
    h->zero_hi = cs;
    return true;
}

/* Every sliding layer, prefill chunks of 7, as plant_stale_layer2. */
static bool plant_stale_all(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                            cmp_hyp *h)
{
    const int64_t cs = (q / 7) * 7;
    if (config_layer_window(cfg, L) <= 0 || q >= a->P || cs == 0)
        return false;
    h->zero_lo = cs - 7 > h->lo ? cs - 7 : h->lo;
    h->zero_hi = cs;
    return true;
}

static const plant_keys_fn plants[] = {plant_drop5_layer0, plant_own_layer0, plant_drop5_all,
                                       plant_drop_two_layers, plant_layer0_full,
                                       plant_padded_layer0, plant_stuck_layer0,
                                       plant_stale_layer2};

#define OUT "{\"engine\":\"outside\"}"

static const scope_case cases[] = {
    /* kvdiff's chunked engine */
    {"drop-key=5@0", "tiny-gemma3", "drop-key=5@0", 0, 6, 0, CMP_DIAG_MISSING_KEY,
     "on layer 0 only", true, false},
    {"drop-key=5 (every layer)", "tiny-gemma3", "drop-key=5", 0, 6, 0, CMP_DIAG_MISSING_KEY,
     "the key at position 5", false, false},
    {"drop-key=20@5 (the global layer)", "tiny-gemma3", "drop-key=20@5", 0, 21, 5,
     CMP_DIAG_MISSING_KEY, "on layer 5 only", true, false},
    {"drop-key=3@2 (llama)", "tiny-llama", "drop-key=3@2", 0, 4, 2, CMP_DIAG_MISSING_KEY,
     "on layer 2 only", true, false},
    {"own-key-masked=10@0", "tiny-gemma3", "own-key-masked=10@0", 0, 10, 0,
     CMP_DIAG_OWN_KEY_MASKED, "on layer 0 only", true, false},
    {"own-key-masked=10 (every layer)", "tiny-gemma3", "own-key-masked=10", 0, 10, 0,
     CMP_DIAG_OWN_KEY_MASKED, "from position 10 on", false, false},
    {"own-key-masked=12@2 (llama)", "tiny-llama", "own-key-masked=12@2", 0, 12, 2,
     CMP_DIAG_OWN_KEY_MASKED, "on layer 2 only", true, false},
    /* chunks of 7 isolated on one layer, and on every layer */
    {"isolated-layer=1", "tiny-gemma3", "isolated-layer=1", 0, 7, 1, CMP_DIAG_CHUNK_ISOLATED,
     "chunks attend only to themselves on layer 1 only", true, false},
    {"isolated-layer=2 (llama)", "tiny-llama", "isolated-layer=2", 0, 7, 2,
     CMP_DIAG_CHUNK_ISOLATED, "on layer 2 only", true, false},
    {"isolated-chunks (every layer)", "tiny-gemma3", "isolated-chunks", 0, 7, 0,
     CMP_DIAG_CHUNK_ISOLATED, "chunks attend only to themselves", false, false},
    /* a sliding cache read stale, a ring not wrapping: every sliding
     * layer (their natural scope, said by the phrase) or one alone */
    {"stale-local@0", "tiny-gemma3", "stale-local@0", 0, 7, 0, CMP_DIAG_STALE_CACHE,
     "stale values on layer 0 only", true, false},
    {"stale-local@2", "tiny-gemma3", "stale-local@2", 0, 7, 2, CMP_DIAG_STALE_CACHE,
     "stale values on layer 2 only", true, false},
    {"stale-local (every sliding layer)", "tiny-gemma3", "stale-local", 0, 7, 0,
     CMP_DIAG_STALE_CACHE, "stale values: the sliding cache", false, false},
    {"ring-no-wrap@3", "tiny-gemma3", "ring-no-wrap@3", 0, 19, 3, CMP_DIAG_RING_NO_WRAP,
     "did not overwrite on layer 3 only", true, false},
    {"ring-no-wrap (every sliding layer)", "tiny-gemma3", "ring-no-wrap", 0, 19, 0,
     CMP_DIAG_RING_NO_WRAP, "did not overwrite (ring buffer", false, false},
    /* hand plants */
    {"key 15 left out on layer 0 from 20", "tiny-gemma3", NULL, 0, FROM, 0,
     CMP_DIAG_MISSING_KEY, "on layer 0 only", true, true},
    {"own key masked on layer 0 from 20", "tiny-gemma3", NULL, 1, FROM, 0,
     CMP_DIAG_OWN_KEY_MASKED, "on layer 0 only", true, true},
    {"key 15 left out on every layer from 20", "tiny-gemma3", NULL, 2, FROM, 0,
     CMP_DIAG_MISSING_KEY, "the key at position 15", false, true},
    {"own key masked on layer 0 from 20 (llama)", "tiny-llama", NULL, 1, FROM, 0,
     CMP_DIAG_OWN_KEY_MASKED, "on layer 0 only", true, true},
    /* one layer's cache read otherwise at decode */
    {"3 zero slots read on layer 0 only from P", "tiny-gemma3", NULL, 5, PLEN, 0,
     CMP_DIAG_PADDED_SLOTS, "on layer 0 only", true, true},
    {"write index stuck at P on layer 0 only", "tiny-gemma3", NULL, 6, PLEN + 1, 0,
     CMP_DIAG_DECODE_STUCK, "decode write index stuck at slot 40 on layer 0 only", true, true},
    {"prefill chunks of 7 read stale on layer 2 only", "tiny-gemma3", NULL, 7, 7, 2,
     CMP_DIAG_STALE_CACHE, "stale values on layer 2 only", true, true},
    /* Gemma 4 (sliding and full layers of other head sizes): layer 0's
     * attention as a full layer's, its rotation kept */
    {"tiny-gemma4 sliding layer 0 read as full", "tiny-gemma4", NULL, 4, 12, 0,
     CMP_DIAG_LAYER_TYPE, "it is global in the test; the config says sliding", false, true},
};
#define NCASES ((int)(sizeof cases / sizeof cases[0]))

static void run_case(const scope_case *sc, bool counts)
{
    kv_model m;
    open_model(sc->preset, &m);
    kv_err e = {{0}};
    cmp_memrec *ref = plant_record(&m, PLEN, NNEW, 11, NULL, "{\"engine\":\"reference\"}", true,
                                   &e);
    ck_assert_msg(ref != NULL, "%s", e.msg);
    cmp_memrec *test;
    if (sc->inject) {
        chk_opts o;
        chk_opts_default(&o);
        o.chunk = 7;
        o.max_ctx = PLEN + NNEW;
        /* a ring-no-wrap needs its ring */
        const bool ring = !strncmp(sc->inject, "ring-no-wrap", 12);
        o.cache = ring ? CACHE_RING : CACHE_DENSE;
        ck_assert_msg(chk_injection_parse(sc->inject, &o.inj, &e) == 0, "%s", e.msg);
        ck_assert_msg(chk_opts_check(&o, &m.cfg, &e) == 0, "%s", e.msg);
        char settings[256];
        snprintf(settings, sizeof settings, "{\"engine\":\"chunked\",\"chunk\":7,\"cache\":"
                 "\"%s\",\"max_ctx\":%d,\"inject\":\"%s\"}", ring ? "ring" : "dense",
                 PLEN + NNEW, sc->inject);
        test = plant_record(&m, PLEN, NNEW, 11, &o, settings, true, &e);
    } else {
        test = plant_record(&m, PLEN, NNEW, 11, NULL, OUT, counts, &e);
        ck_assert_msg(test != NULL, "%s", e.msg);
        const plant_family f = {sc->name, plants[sc->plant], NULL, sc->kind};
        const plant_arg pa = {.P = PLEN, .T = PLEN + NNEW, .n = 0};
        ck_assert_msg(plant_apply(&f, &pa, test, &m, &e) == 0, "%s", e.msg);
    }
    ck_assert_msg(test != NULL, "%s", e.msg);
    cmp_result r;
    char *t = compare_pair(ref, test, &r);
    expect(sc, &r, t, counts ? "counts" : "attn_out alone");
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(test);
    model_free(&m);
}

START_TEST(test_scoped_named)
{
    run_case(&cases[_i], true);
}
END_TEST

static int outside_cases[NCASES];

START_TEST(test_scoped_named_from_attn_out)
{
    run_case(&cases[outside_cases[_i]], false);
}
END_TEST

/* Layer 0 leaves a key out and layer 1 another: "on layer 0 only" would
 * say layer 1 is right, and layer 1 refutes it. Never claimed; and the
 * bug is still located. */
START_TEST(test_one_layer_not_claimed_where_another_is_wrong)
{
    kv_model m;
    open_model("tiny-gemma3", &m);
    kv_err e = {{0}};
    cmp_memrec *ref = plant_record(&m, PLEN, NNEW, 11, NULL, "{\"engine\":\"reference\"}", true,
                                   &e);
    cmp_memrec *test = plant_record(&m, PLEN, NNEW, 11, NULL, OUT, true, &e);
    ck_assert_msg(ref && test, "%s", e.msg);
    const plant_family f = {"two layers", plants[3], NULL, CMP_DIAG_MISSING_KEY};
    const plant_arg pa = {.P = PLEN, .T = PLEN + NNEW, .n = 0};
    ck_assert_msg(plant_apply(&f, &pa, test, &m, &e) == 0, "%s", e.msg);
    cmp_result r;
    char *t = compare_pair(ref, test, &r);
    ck_assert_msg(r.first.found && r.first.pos == FROM && r.first.layer == 0, "%s", t);
    ck_assert_msg(!(r.diag.kind == CMP_DIAG_MISSING_KEY && !r.diag.undecided &&
                    strstr(r.diag.summary, "on layer 0 only")),
                  "layer 0 alone claimed where layer 1 is wrong too\n%s", t);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(test);
    model_free(&m);
}
END_TEST

/* Every sliding layer reads the previous prefill chunk stale, on a prompt
 * of 10 (chunks of 7): a dense cache and a ring of 19 slots (window 12 +
 * chunk 7, the cache unnamed) read the same keys until the ring wraps,
 * past the prompt. One cause either way: named, the ring said in the
 * detail, not "either ... or" the same words twice. */
START_TEST(test_stale_readings_one_cause)
{
    kv_model m;
    open_model("tiny-gemma3", &m);
    kv_err e = {{0}};
    cmp_memrec *ref = plant_record(&m, 10, NNEW, 11, NULL, "{\"engine\":\"reference\"}", true,
                                   &e);
    cmp_memrec *test = plant_record(&m, 10, NNEW, 11, NULL, OUT, true, &e);
    ck_assert_msg(ref && test, "%s", e.msg);
    const plant_family f = {"stale, every sliding layer", plant_stale_all, NULL,
                            CMP_DIAG_STALE_CACHE};
    const plant_arg pa = {.P = 10, .T = 10 + NNEW, .n = 0};
    ck_assert_msg(plant_apply(&f, &pa, test, &m, &e) == 0, "%s", e.msg);
    cmp_result r;
    char *t = compare_pair(ref, test, &r);
    ck_assert_msg(r.first.found && r.first.pos == 7 && r.first.layer == 0, "%s", t);
    ck_assert_msg(r.diag.kind == CMP_DIAG_STALE_CACHE && !r.diag.undecided, "%s", t);
    ck_assert_msg(strstr(r.diag.detail, "a ring of 19 slots (window + chunk) would read the "
                         "same keys here"), "%s", t);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(test);
    model_free(&m);
}
END_TEST

/* The injection's words: parsed, described back, refused past the model. */
START_TEST(test_layer_injection_parse)
{
    chk_injections inj;
    memset(&inj, 0, sizeof inj);
    kv_err e = {{0}};
    ck_assert_int_eq(chk_injection_parse("drop-key=5@3", &inj, &e), 0);
    ck_assert_int_eq(inj.drop_key, 5);
    ck_assert_int_eq(inj.drop_layer, 3);
    ck_assert_int_eq(chk_injection_parse("own-key-masked=4", &inj, &e), 0);
    ck_assert_int_eq(inj.own_from, 4);
    ck_assert_int_eq(inj.own_layer, -1);
    char buf[128];
    chk_injections_describe(&inj, buf, sizeof buf);
    ck_assert_str_eq(buf, "drop-key=5@3,own-key-masked=4");
    ck_assert_int_eq(chk_injection_parse("drop-key=5@x", &inj, &e), -1);
    ck_assert_int_eq(chk_injection_parse("own-key-masked=0", &inj, &e), -1);
    ck_assert_int_eq(chk_injection_parse("drop-key", &inj, &e), -1);
    /* the sliding kinds' bugs on one layer: NAME@L */
    chk_injections sl;
    memset(&sl, 0, sizeof sl);
    ck_assert_int_eq(chk_injection_parse("stale-local@2", &sl, &e), 0);
    ck_assert_int_eq(sl.stale_layer, 2);
    ck_assert_int_eq(chk_injection_parse("ring-no-wrap", &sl, &e), 0);
    ck_assert_int_eq(sl.ring_layer, -1);
    chk_injections_describe(&sl, buf, sizeof buf);
    ck_assert_str_eq(buf, "stale-local@2,ring-no-wrap");
    ck_assert_int_eq(chk_injection_parse("stale-local@", &sl, &e), -1);
    ck_assert_int_eq(chk_injection_parse("decode-index-stuck@1", &sl, &e), -1);
    ck_assert_msg(strstr(e.msg, "takes no layer"), "%s", e.msg);
    kv_model m;
    open_model("tiny-llama", &m);
    chk_opts o;
    chk_opts_default(&o);
    o.max_ctx = 64;
    ck_assert_int_eq(chk_injection_parse("drop-key=5@99", &o.inj, &e), 0);
    ck_assert_int_eq(chk_opts_check(&o, &m.cfg, &e), -1);
    ck_assert_msg(strstr(e.msg, "drop-key=5@99"), "%s", e.msg);
    model_free(&m);
    /* a layer that has no sliding cache to go stale */
    open_model("tiny-gemma3", &m);
    chk_opts_default(&o);
    o.max_ctx = 64;
    ck_assert_int_eq(chk_injection_parse("stale-local@5", &o.inj, &e), 0);
    ck_assert_int_eq(chk_opts_check(&o, &m.cfg, &e), -1);
    ck_assert_msg(strstr(e.msg, "layer 5 is not a sliding-window layer"), "%s", e.msg);
    model_free(&m);
}
END_TEST

Suite *keyscope_suite(void)
{
    Suite *s = suite_create("keyscope");
    TCase *tc = tcase_create("scoped");
    tcase_set_timeout(tc, 300);
    int n_outside = 0;
    for (int i = 0; i < NCASES; i++)
        if (cases[i].counts_too)
            outside_cases[n_outside++] = i;
    tcase_add_test(tc, test_layer_injection_parse);
    tcase_add_loop_test(tc, test_scoped_named, 0, NCASES);
    tcase_add_loop_test(tc, test_scoped_named_from_attn_out, 0, n_outside);
    tcase_add_test(tc, test_one_layer_not_claimed_where_another_is_wrong);
    tcase_add_test(tc, test_stale_readings_one_cause);
    suite_add_tcase(s, tc);
    return s;
}
