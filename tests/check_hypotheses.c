/* check_hypotheses.c — the bugs ports make, planted into a recording the
 * way an outside runtime would show them, each named at its exact place
 * by the hypothesis engine (docs/diagnosis.md, "The hypothesis engine").
 *
 * The reference run is recorded twice; the second copy is edited: its
 * attention rows recomputed over the key set the bug reads (or its K/V or
 * norm rows rewritten as the bug writes them), from its own q, k, v. Each
 * case is tried as kvdiff records (attn_lse and key counts) and as a
 * runtime that records attn_out alone. The diagnosis must name the cause,
 * say "verified" only where every rival failed somewhere, and never name
 * a rival. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "model/generate.h"
#include "model/kernels.h"
#include "model/pcg32.h"
#include "reference/reference.h"
#include "plants.h"
#include "testutil.h"

#define PLEN 40   /* prompt length */
#define NNEW 10   /* decode steps */

static void open_model(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

/* The reference engine's run of a fixed random prompt. */
static cmp_memrec *record(const kv_model *m, const char *settings, bool counts)
{
    kv_err e = {{0}};
    cmp_memrec *rec = plant_record(m, PLEN, NNEW, 11, NULL, settings, counts, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    return rec;
}

/* A planted bug: the compare of the reference and the edited test, the
 * test recorded with or without attn_lse and attn_nkeys (an outside
 * runtime's attn_out alone). */
typedef struct {
    const char *name;
    const char *preset;
    plant_family fam;
    int64_t n;                   /* the family's parameter */
    const char *settings;        /* the test's engine settings */
    int64_t pos;                 /* where it must be located */
    int layer;
    const char *words;           /* a phrase the diagnosis must hold */
    bool counts_too;             /* also try without attn_lse, attn_nkeys */
} plant_case;

static void run_plant(const plant_case *pc, bool counts)
{
    kv_model m;
    open_model(pc->preset, &m);
    cmp_memrec *ref = record(&m, "{\"engine\":\"reference\"}", true);
    cmp_memrec *got = record(&m, pc->settings, counts);
    const plant_arg pa = {.P = PLEN, .T = PLEN + NNEW, .n = pc->n};
    kv_err pe = {{0}};
    ck_assert_msg(plant_apply(&pc->fam, &pa, got, &m, &pe) == 0, "%s", pe.msg);
    cmp_source sa, sb;
    cmp_memrec_source(ref, &sa);
    cmp_memrec_source(got, &sb);
    cmp_result r;
    kv_err e = {{0}};
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, &r, &e) == 0, "%s", e.msg);
    char *t = cmp_render_text(&r, 0);
    if (getenv("KVDIFF_TEST_SHOW"))   /* to read the texts */
        fprintf(stderr, "== %s (%s)\n%s", pc->name, counts ? "counts" : "attn_out alone", t);
    const cmp_divergence *d = r.beyond.found ? &r.beyond : &r.first;
    ck_assert_msg(d->found && d->pos == pc->pos && d->layer == pc->layer,
                  "%s (%s): located at %lld/%d, planted at %lld/%d\n%s", pc->name,
                  counts ? "counts" : "attn_out alone", (long long)d->pos, d->layer,
                  (long long)pc->pos, pc->layer, t);
    /* key_set: nothing fits, and the text says what the test read (a
     * heuristic by nature); any other: a cause named, not guessed. */
    ck_assert_msg(r.diag.kind == pc->fam.kind && !r.diag.undecided &&
                  (pc->fam.kind == CMP_DIAG_KEY_SET || r.diag.basis != CMP_BASIS_HEURISTIC), "%s (%s): named %s (%s), planted %s\n%s", pc->name,
                  counts ? "counts" : "attn_out alone", cmp_diag_name(r.diag.kind),
                  cmp_basis_name(r.diag.basis), cmp_diag_name(pc->fam.kind), t);
    char all[4096];
    snprintf(all, sizeof all, "%s %s %s", r.diag.summary, r.diag.detail, r.diag.evidence);
    ck_assert_msg(strstr(all, pc->words), "%s: '%s' not in\n%s", pc->name, pc->words, t);
    free(t);
    cmp_result_free(&r);
    cmp_memrec_free(ref);
    cmp_memrec_free(got);
    model_free(&m);
}

/* ------------------------------------------------------------------ */
/* The bugs of the table                                                */

#define OUT "{\"engine\":\"outside\"}"
#define FAM(f, r, k) {#f, f, r, k}

static const plant_case cases[] = {
    {"window W-1", "tiny-gemma3", FAM(plant_window, NULL, CMP_DIAG_WINDOW), 11, OUT, 11, 0,
     "window in test appears to be 11, config says 12", true},
    {"global read through the window", "tiny-gemma3",
     FAM(plant_global_windowed, NULL, CMP_DIAG_LAYER_TYPE), 12, OUT, 12, 5,
     "layer 5, global in the config, read through a window of 12 keys", true},
    {"sliding layer run as global", "tiny-gemma3",
     FAM(plant_layer_global, NULL, CMP_DIAG_LAYER_TYPE), 4, OUT, 12, 4,
     "it is global in the test; the config says sliding", true},
    {"decode blind, cache dense", "tiny-gemma3",
     FAM(plant_decode_blind, NULL, CMP_DIAG_DECODE_BLIND), 0,
     "{\"engine\":\"outside\",\"cache\":\"dense\"}", PLEN, 0,
     "decode steps attend only to the decode cache", true},
    {"padded prefill slots", "tiny-llama", FAM(plant_padded, NULL, CMP_DIAG_PADDED_SLOTS), 8,
     OUT, PLEN, 0, "8 unwritten (zero) slots", true},
    {"write index stuck at 0", "tiny-llama", FAM(plant_stuck, NULL, CMP_DIAG_DECODE_STUCK), 0,
     OUT, PLEN, 0, "stuck at slot 0", true},
    {"own key masked", "tiny-gemma3", FAM(plant_own_masked, NULL, CMP_DIAG_OWN_KEY_MASKED), 0,
     OUT, 0, 0, "own key is masked out", true},
    /* Chunk 1: isolated chunks and a window of 1 read the same keys on a
     * sliding layer; the global layer tells them apart. */
    {"isolated chunks of 1", "tiny-gemma3",
     FAM(plant_isolated, NULL, CMP_DIAG_CHUNK_ISOLATED), 1,
     "{\"engine\":\"outside\",\"chunk\":1}", 1, 0, "chunks attend only to themselves", true},
    {"window of 1", "tiny-gemma3", FAM(plant_window, NULL, CMP_DIAG_WINDOW), 1,
     "{\"engine\":\"outside\",\"chunk\":1}", 1, 0,
     "window in test appears to be 1, config says 12", true},
    {"K = V = 0 from P", "tiny-gemma3-kvshared",
     FAM(plant_all_from_P, plant_zero_kv, CMP_DIAG_ZERO_KV), 0, OUT, PLEN, 0,
     "K and V rows written as zero from position 40 on", false},
    {"k and v swapped", "tiny-llama", FAM(plant_layer0, plant_kv_swapped, CMP_DIAG_KV_SWAPPED), 0,
     OUT, 0, 0, "k and v projections swapped", false},
    {"k and v swapped under a k norm", "tiny-gemma3",
     FAM(plant_layer0, plant_kv_swapped, CMP_DIAG_KV_SWAPPED), 0, OUT, 0, 0,
     "k and v projections swapped", false},
    {"RMSNorm eps", "tiny-gemma3", FAM(NULL, plant_norm_eps, CMP_DIAG_NORM_EPS), 0, OUT, 0, 0,
     "with eps 0.01 where the config says 1e-06", false},
    /* Keys the dump does not hold: positions past the query, and slots
     * whose values were never recorded. */
    {"causal mask missing", "tiny-gemma3", FAM(plant_future, NULL, CMP_DIAG_FUTURE_KEYS), PLEN,
     OUT, 0, 0, "the causal mask is missing", true},
    {"garbage slots", "tiny-llama", FAM(NULL, plant_garbage_slots, CMP_DIAG_KEY_SET), 4, OUT,
     PLEN, 0, "it weighed keys the dump does not hold", false},
};

START_TEST(test_planted_named)
{
    run_plant(&cases[_i], true);
}
END_TEST

/* The cases an outside runtime records too (attn_out alone), by index. */
#define NCASES ((int)(sizeof cases / sizeof cases[0]))
static int outside_cases[NCASES];

START_TEST(test_planted_named_from_attn_out)
{
    run_plant(&cases[outside_cases[_i]], false);
}
END_TEST

Suite *hypotheses_suite(void)
{
    Suite *s = suite_create("hypotheses");
    TCase *tc = tcase_create("planted");
    tcase_set_timeout(tc, 300);
    int n_outside = 0;
    for (int i = 0; i < NCASES; i++)
        if (cases[i].counts_too)
            outside_cases[n_outside++] = i;
    tcase_add_loop_test(tc, test_planted_named, 0, NCASES);
    tcase_add_loop_test(tc, test_planted_named_from_attn_out, 0, n_outside);
    suite_add_tcase(s, tc);
    return s;
}
