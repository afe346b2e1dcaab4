/* diag_sweep.c — the diagnosis sweep (docs/diagnosis.md, "The hypothesis
 * engine"): every family planted in two of its four ways — kvdiff's own
 * injections (the chunked engine) and recordings edited as a port shows
 * them (tests/plants.h: attention over the bug's keys, or K/V and norm
 * rows rewritten; with and without attn_lse and key counts) — across the
 * tiny presets, the dense, split and ring caches, prompts shorter and
 * longer than the window, and chunks of 1, 3, 7, 64 and the whole prompt.
 * Legitimate runs (another cache or chunk, cascade attention) must raise
 * no alarm. The other two ways, real llama.cpp and the pure-torch model,
 * are bench/xrt_sweep.sh and bench/precision_sweep.py.
 *
 * Each bug run is located (the first divergence found, and where the plant
 * says for edits), then named (the planted cause, not undecided), undecided
 * (several causes named, the planted one among them: honest), unnamed
 * (nothing claimed: key_set or unclassified) or wrong (another cause
 * named). Prints a table per family and way; with a path, appends one row
 * per family to it (tab-separated: date, way, family, runs, located, named,
 * undecided, unnamed, wrong, verified-wrong). Exits 1 when a bug run is
 * wrong, a verified name is wrong, or a legitimate run alarms.
 *
 *   build/bench/diag_sweep [results.tsv] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chunked/chunked.h"
#include "compare/cmp_internal.h"
#include "compare/compare.h"
#include "model/generate.h"
#include "model/kernels.h"
#include "model/pcg32.h"
#include "reference/reference.h"
#include "tests/plants.h"

#define NNEW 10

typedef struct {
    char way[16], family[40];
    int runs, located, named, undecided, unnamed, wrong, verified_wrong;
    char example[640];           /* the first wrong or unnamed case */
} tally;

static tally tallies[128];
static int ntallies;
static int legit_runs, false_alarms;

static tally *tally_of(const char *way, const char *family)
{
    for (int i = 0; i < ntallies; i++)
        if (!strcmp(tallies[i].way, way) && !strcmp(tallies[i].family, family))
            return &tallies[i];
    tally *t = &tallies[ntallies++];
    memset(t, 0, sizeof *t);
    snprintf(t->way, sizeof t->way, "%s", way);
    snprintf(t->family, sizeof t->family, "%s", family);
    return t;
}

static void die(const char *what, const kv_err *e)
{
    fprintf(stderr, "diag_sweep: %s: %s\n", what, e->msg);
    exit(2);
}

/* A run of the reference (o NULL) or the chunked engine into memory. */
static cmp_memrec *record(const kv_model *m, int P, const chk_opts *o, const char *settings,
                          bool counts)
{
    kv_err e = {{0}};
    cmp_memrec *rec = plant_record(m, P, NNEW, (uint64_t)P * 7 + 3, o, settings, counts, &e);
    if (!rec)
        die("record", &e);
    return rec;
}

static void compare(cmp_memrec *a, cmp_memrec *b, cmp_result *r)
{
    cmp_source sa, sb;
    kv_err e = {{0}};
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    if (cmp_compare(&sa, &sb, NULL, r, &e) != 0)
        die("compare", &e);
}

/* Scores one bug run. exp_pos < 0: any location. */
static void judge(const char *way, const char *family, cmp_diag_kind want, const cmp_result *r,
                  int64_t exp_pos, int exp_layer, const char *what)
{
    tally *t = tally_of(way, family);
    t->runs++;
    const cmp_divergence *d = r->beyond.found ? &r->beyond : &r->first;
    const bool located = d->found && (exp_pos < 0 || (d->pos == exp_pos && d->layer == exp_layer));
    t->located += located;
    const cmp_diagnosis *g = &r->diag;
    bool among = false;
    for (int i = 0; i < g->n_hyps; i++)
        among |= g->hyps[i].kind == want && g->hyps[i].status == CMP_HYP_REMAINS;
    const char *verdict;
    if (!g->undecided && g->kind == want) {
        t->named++;
        verdict = NULL;
    } else if (g->undecided && among) {
        t->undecided++;
        verdict = "undecided";
    } else if (g->kind == CMP_DIAG_KEY_SET || g->kind == CMP_DIAG_UNCLASSIFIED) {
        t->unnamed++;
        verdict = "unnamed";
    } else {
        t->wrong++;
        t->verified_wrong += g->basis == CMP_BASIS_RECOMPUTED && !g->undecided;
        verdict = "WRONG";
    }
    if (!located)
        verdict = "NOT LOCATED";
    if (verdict && !t->example[0])
        snprintf(t->example, sizeof t->example, "%s: %s at %lld/%d: %s (%.200s)", verdict, what,
                 (long long)d->pos, d->layer, cmp_diag_name(g->kind), g->summary);
}

/* --- a scoped cause named with the wrong scope (" on layer 0 only"
 * claimed for a bug on every layer, or not claimed for one on one layer)
 * is named wrong, not named --- */
static void judge_scope(const char *way, const char *family, cmp_diag_kind want,
                        const cmp_result *r, bool narrow, const char *what)
{
    const cmp_diagnosis *g = &r->diag;
    if (g->undecided || g->kind != want)   /* judge() counted it already */
        return;
    /* the scope's words, not the "only" of "attend only to themselves" */
    const bool said = strstr(g->summary, " on layer ") != NULL ||
                      strstr(g->summary, " layers only") != NULL;
    if (said == narrow)
        return;
    tally *t = tally_of(way, family);
    t->named--;
    t->wrong++;
    t->verified_wrong += g->basis == CMP_BASIS_RECOMPUTED;
    snprintf(t->example, sizeof t->example, "WRONG SCOPE: %s: %.200s", what, g->summary);
}
/* --- end of the layer-scoped block --- */

/* ------------------------------------------------------------------ */
/* kvdiff's own injections                                              */

static const struct {
    const char *spec;
    cmp_diag_kind kind;
    chk_cache_kind only;         /* CACHE_KIND_COUNT: any */
} injections[] = {
    {"isolated-chunks", CMP_DIAG_CHUNK_ISOLATED, CACHE_KIND_COUNT},
    {"window=4", CMP_DIAG_WINDOW, CACHE_KIND_COUNT},
    {"window=11", CMP_DIAG_WINDOW, CACHE_KIND_COUNT},
    {"window=13", CMP_DIAG_WINDOW, CACHE_KIND_COUNT},
    {"stale-local", CMP_DIAG_STALE_CACHE, CACHE_KIND_COUNT},
    {"zero-shared-kv", CMP_DIAG_ZERO_KV, CACHE_KIND_COUNT},
    {"split-mask-off-by-one", CMP_DIAG_EXTRA_KEY, CACHE_SPLIT},
    {"decode-index-stuck", CMP_DIAG_DECODE_STUCK, CACHE_KIND_COUNT},
    {"rope-offset=3", CMP_DIAG_ROPE_OFFSET, CACHE_KIND_COUNT},
    {"ring-no-wrap", CMP_DIAG_RING_NO_WRAP, CACHE_RING},
    {"split-decode-blind", CMP_DIAG_DECODE_BLIND, CACHE_SPLIT},
    /* --- key sets scoped to one layer (and their wide rivals) --- */
    {"drop-key=3@0", CMP_DIAG_MISSING_KEY, CACHE_KIND_COUNT},
    {"drop-key=3@1", CMP_DIAG_MISSING_KEY, CACHE_KIND_COUNT},
    {"drop-key=3", CMP_DIAG_MISSING_KEY, CACHE_KIND_COUNT},
    {"own-key-masked=5@0", CMP_DIAG_OWN_KEY_MASKED, CACHE_KIND_COUNT},
    {"own-key-masked=5", CMP_DIAG_OWN_KEY_MASKED, CACHE_KIND_COUNT},
    {"isolated-layer=1", CMP_DIAG_CHUNK_ISOLATED, CACHE_KIND_COUNT},
    {"stale-local@1", CMP_DIAG_STALE_CACHE, CACHE_KIND_COUNT},
    {"ring-no-wrap@1", CMP_DIAG_RING_NO_WRAP, CACHE_RING},
    /* --- end of the layer-scoped block --- */
    /* attention sinks (tiny-gpt-oss only: chk_opts_check refuses the others) */
    {"sink-dropped", CMP_DIAG_SINK, CACHE_KIND_COUNT},
    {"sink-dropped@1", CMP_DIAG_SINK, CACHE_KIND_COUNT},
    {"sink-prefill-only", CMP_DIAG_SINK, CACHE_KIND_COUNT},
    {"sink-windowed", CMP_DIAG_SINK, CACHE_KIND_COUNT},
    /* latent caches (the MLA presets only) */
    {"mla-rope-twice", CMP_DIAG_LATENT_CACHE, CACHE_KIND_COUNT},
    {"mla-rope-uncached", CMP_DIAG_LATENT_CACHE, CACHE_KIND_COUNT},
    {"mla-no-mscale", CMP_DIAG_LATENT_CACHE, CACHE_KIND_COUNT},
    {"mla-mixed-forms", CMP_DIAG_LATENT_CACHE, CACHE_KIND_COUNT},
};

static const char *const presets[] = {"tiny-gemma3", "tiny-gemma3-kvshared", "tiny-llama",
                                      "tiny-qwen3", "tiny-gpt-oss", "tiny-deepseek-v2",
                                      "tiny-deepseek-v3"};
static const int prompts[] = {10, 40};
static const int chunks[] = {1, 3, 7, 64, 0};   /* 0: the whole prompt */

static void open_preset(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mopt = {.wtype = -1};
    if (model_from_preset(name, 0, &mopt, m, &e) != 0)
        die(name, &e);
}

static void sweep_injections(void)
{
    for (size_t pi = 0; pi < sizeof presets / sizeof *presets; pi++) {
        kv_model m;
        kv_err e = {{0}};
        open_preset(presets[pi], &m);
        for (size_t li = 0; li < sizeof prompts / sizeof *prompts; li++) {
            const int P = prompts[li];
            cmp_memrec *ref = record(&m, P, NULL, "{\"engine\":\"reference\"}", true);
            for (int cache = 0; cache < CACHE_KIND_COUNT; cache++)
                for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ci++) {
                    const int C = chunks[ci] > 0 ? chunks[ci] : P;
                    /* legitimate runs: exact, cascade, and (MLA) absorbed decode */
                    for (int attn = 0; attn < 3; attn++) {
                        chk_opts o;
                        chk_opts_default(&o);
                        o.cache = (chk_cache_kind)cache;
                        o.chunk = C;
                        o.attn = attn == 1 ? CHK_ATTN_CASCADE : CHK_ATTN_EXACT;
                        o.mla_absorbed = attn == 2;
                        o.max_ctx = P + NNEW;
                        if (chk_opts_check(&o, &m.cfg, &e) != 0)
                            continue;
                        char settings[256];
                        snprintf(settings, sizeof settings, "{\"engine\":\"chunked\",\"chunk\":%d,"
                                 "\"cache\":\"%s\",\"attention\":\"%s\",\"max_ctx\":%d}", C,
                                 chk_cache_name(o.cache), attn == 1 ? "cascade" : "exact",
                                 P + NNEW);
                        cmp_memrec *got = record(&m, P, &o, settings, true);
                        cmp_result r;
                        compare(ref, got, &r);
                        legit_runs++;
                        const bool alarm = attn ? r.diag.kind != CMP_DIAG_NUMERIC_DRIFT &&
                                                      r.first.found
                                                : r.first.found;
                        if (alarm) {
                            false_alarms++;
                            fprintf(stderr, "false alarm: %s P %d %s chunk %d %s: %s\n",
                                    presets[pi], P, chk_cache_name(o.cache), C,
                                    attn == 1 ? "cascade" : attn == 2 ? "absorbed" : "exact",
                                    r.diag.summary);
                        }
                        cmp_result_free(&r);
                        cmp_memrec_free(got);
                    }
                    for (size_t ii = 0; ii < sizeof injections / sizeof *injections; ii++) {
                        if (injections[ii].only != CACHE_KIND_COUNT &&
                            (int)injections[ii].only != cache)
                            continue;
                        chk_opts o;
                        chk_opts_default(&o);
                        o.cache = (chk_cache_kind)cache;
                        o.chunk = C;
                        o.max_ctx = P + NNEW;
                        if (chk_injection_parse(injections[ii].spec, &o.inj, &e) != 0 ||
                            chk_opts_check(&o, &m.cfg, &e) != 0)
                            continue;
                        char settings[256];
                        snprintf(settings, sizeof settings, "{\"engine\":\"chunked\",\"chunk\":%d,"
                                 "\"cache\":\"%s\",\"attention\":\"exact\",\"inject\":\"%s\","
                                 "\"max_ctx\":%d}", C, chk_cache_name(o.cache),
                                 injections[ii].spec, P + NNEW);
                        cmp_memrec *got = record(&m, P, &o, settings, true);
                        cmp_result r;
                        compare(ref, got, &r);
                        if (r.first.found) {   /* some geometries never reach the bug */
                            char what[160];
                            snprintf(what, sizeof what, "%s P %d %s chunk %d", presets[pi], P,
                                     chk_cache_name(o.cache), C);
                            char fam[40];
                            snprintf(fam, sizeof fam, "%s", injections[ii].spec);
                            judge("inject", fam, injections[ii].kind, &r, -1, -1, what);
                            if (!strncmp(fam, "drop-key", 8) || !strncmp(fam, "own-key", 7) ||
                                !strncmp(fam, "isolated", 8) || !strncmp(fam, "stale", 5) ||
                                !strncmp(fam, "ring", 4))
                                judge_scope("inject", fam, injections[ii].kind, &r,
                                            strchr(fam, '@') != NULL ||
                                                !strncmp(fam, "isolated-layer", 14), what);
                        }
                        cmp_result_free(&r);
                        cmp_memrec_free(got);
                    }
                }
            cmp_memrec_free(ref);
        }
        model_free(&m);
    }
}

/* ------------------------------------------------------------------ */
/* Recordings edited as a port shows the bug                            */

typedef struct {
    const char *name;
    plant_family fam;
    int64_t (*n)(const kv_config *cfg, int P);   /* the family's parameter */
    bool long_prompt;            /* needs a prompt longer than the window */
} edit_family;

static int64_t sliding_w(const kv_config *cfg)
{
    for (int l = 0; l < cfg->n_layers; l++)
        if (config_layer_window(cfg, l) > 0)
            return config_layer_window(cfg, l);
    return 0;
}

static int64_t n_zero(const kv_config *cfg, int P) { (void)cfg; (void)P; return 0; }
static int64_t n_w_minus(const kv_config *cfg, int P) { (void)P; return sliding_w(cfg) - 1; }
static int64_t n_w_plus(const kv_config *cfg, int P) { (void)P; return sliding_w(cfg) + 1; }
static int64_t n_w_half(const kv_config *cfg, int P) { (void)P; return sliding_w(cfg) / 2; }
static int64_t n_global_w(const kv_config *cfg, int P)
{
    (void)P;
    return sliding_w(cfg) > 0 ? sliding_w(cfg) : 8;
}
static int64_t n_first_sliding(const kv_config *cfg, int P)
{
    (void)P;
    for (int l = cfg->n_layers - 1; l >= 0; l--)
        if (config_layer_window(cfg, l) > 0)
            return l;
    return -1;
}
static int64_t n_pad(const kv_config *cfg, int P) { (void)cfg; return 64 - P % 64; }
static int64_t n_prev(const kv_config *cfg, int P) { (void)cfg; return P - 1; }
static int64_t n_three(const kv_config *cfg, int P) { (void)cfg; (void)P; return 3; }
static int64_t n_seven(const kv_config *cfg, int P) { (void)cfg; (void)P; return 7; }
static int64_t n_key(const kv_config *cfg, int P) { (void)cfg; return P - 3; }
static int64_t n_prompt(const kv_config *cfg, int P) { (void)cfg; return P; }
static int64_t n_four(const kv_config *cfg, int P) { (void)cfg; (void)P; return 4; }

/* --- key sets scoped to one layer: layer 0 alone, from P - 5
 * (inside every window), key P - 8 left out or each query's own key
 * masked; the other layers read the config's keys --- */
static bool plant_drop_key_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                  cmp_hyp *h)
{
    (void)cfg;
    if (L != 0 || q < a->P - 5 || a->P - 8 < h->lo || a->P < 10)
        return false;
    h->skip_one = true, h->skip_pos = a->P - 8;
    return true;
}

static bool plant_own_masked_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                    cmp_hyp *h)
{
    (void)cfg;
    if (L != 0 || q < a->P - 5 || a->P < 10)
        return false;
    h->hi = q - 1;
    return true;
}
/* --- end of the layer-scoped block --- */

/* --- a sliding cache read stale: prefill chunks of 7 reading the
 * previous chunk's keys as never written, on every sliding layer (n < 0)
 * or on sliding layer n alone --- */
static bool plant_stale(const plant_arg *a, const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    const int64_t cs = (q / 7) * 7;
    if (config_layer_window(cfg, L) <= 0 || (a->n >= 0 && L != a->n) || q >= a->P || cs == 0)
        return false;
    h->zero_lo = cs - 7 > h->lo ? cs - 7 : h->lo;
    h->zero_hi = cs;
    return true;
}

static int64_t n_every(const kv_config *cfg, int P) { (void)cfg; (void)P; return -1; }
static int64_t n_second_sliding(const kv_config *cfg, int P)
{
    (void)P;
    int seen = 0;
    for (int l = 0; l < cfg->n_layers; l++)
        if (config_layer_window(cfg, l) > 0 && cfg->kv_owner[l] == l && seen++ == 1)
            return l;
    return -2;   /* none: nothing planted */
}

static const edit_family edits[] = {
    {"window W-1", {"", plant_window, NULL, CMP_DIAG_WINDOW}, n_w_minus, false},
    {"window W+1", {"", plant_window, NULL, CMP_DIAG_WINDOW}, n_w_plus, true},
    {"window W/2", {"", plant_window, NULL, CMP_DIAG_WINDOW}, n_w_half, false},
    {"global through a window", {"", plant_global_windowed, NULL, CMP_DIAG_LAYER_TYPE},
     n_global_w, true},
    {"sliding run as global", {"", plant_layer_global, NULL, CMP_DIAG_LAYER_TYPE},
     n_first_sliding, true},
    {"decode blind", {"", plant_decode_blind, NULL, CMP_DIAG_DECODE_BLIND}, n_zero, false},
    {"padded slots", {"", plant_padded, NULL, CMP_DIAG_PADDED_SLOTS}, n_pad, false},
    {"write index stuck at 0", {"", plant_stuck, NULL, CMP_DIAG_DECODE_STUCK}, n_zero, false},
    {"write index stuck at P-1", {"", plant_stuck, NULL, CMP_DIAG_DECODE_STUCK}, n_prev, false},
    {"own key masked", {"", plant_own_masked, NULL, CMP_DIAG_OWN_KEY_MASKED}, n_zero, false},
    {"isolated chunks of 3", {"", plant_isolated, NULL, CMP_DIAG_CHUNK_ISOLATED}, n_three, false},
    {"isolated chunks of 7", {"", plant_isolated, NULL, CMP_DIAG_CHUNK_ISOLATED}, n_seven, false},
    {"key dropped", {"", plant_drop_key, NULL, CMP_DIAG_MISSING_KEY}, n_key, false},
    {"key doubled", {"", plant_dup_key, NULL, CMP_DIAG_DUP_KEY}, n_key, false},
    {"K = V = 0 from P", {"", plant_all_from_P, plant_zero_kv, CMP_DIAG_ZERO_KV}, n_zero, false},
    {"k and v swapped", {"", plant_layer0, plant_kv_swapped, CMP_DIAG_KV_SWAPPED}, n_zero, false},
    {"RMSNorm eps", {"", NULL, plant_norm_eps, CMP_DIAG_NORM_EPS}, n_zero, false},
    {"causal mask missing", {"", plant_future, NULL, CMP_DIAG_FUTURE_KEYS}, n_prompt, false},
    {"causal mask, chunks of 7", {"", plant_future, NULL, CMP_DIAG_FUTURE_KEYS}, n_seven, false},
    /* Slots whose values were never recorded: nothing fits, and the text
     * says the test weighed keys the dump does not hold. */
    {"unrecorded slots", {"", NULL, plant_garbage_slots, CMP_DIAG_KEY_SET}, n_four, false},
    /* --- key sets scoped to one layer --- */
    {"key dropped, layer 0 only", {"", plant_drop_key_layer0, NULL, CMP_DIAG_MISSING_KEY},
     n_zero, false},
    {"own key masked, layer 0 only",
     {"", plant_own_masked_layer0, NULL, CMP_DIAG_OWN_KEY_MASKED}, n_zero, false},
    {"stale sliding cache", {"", plant_stale, NULL, CMP_DIAG_STALE_CACHE}, n_every, false},
    {"stale sliding cache, one layer only", {"", plant_stale, NULL, CMP_DIAG_STALE_CACHE},
     n_second_sliding, false},
    /* --- end of the layer-scoped block --- */
};

/* Where the walk must find a planted key set first: the first (position,
 * layer) where it is not the config's. */
static void planted_at(const edit_family *f, const plant_arg *a, const kv_config *cfg,
                       int64_t *pos, int *layer)
{
    *pos = -1;
    *layer = -1;
    if (f->fam.rows == plant_zero_kv || f->fam.rows == plant_garbage_slots) {
        *pos = a->P, *layer = 0;
        return;
    }
    if (f->fam.rows) {
        *pos = 0, *layer = 0;
        return;
    }
    for (int64_t q = 0; q < a->T - 1; q++)
        for (int L = 0; L < cfg->n_layers; L++) {
            const int W = config_layer_window(cfg, L);
            cmp_hyp h = {.lo = plant_lo(W, q), .hi = q};
            const cmp_hyp c0 = h;
            if (f->fam.keys(a, cfg, L, q, &h) &&
                (h.lo != c0.lo || h.hi != c0.hi || h.extra_zero || h.nsubst || h.skip_one ||
                 h.dup_one || h.zero_lo < h.zero_hi)) {
                *pos = q, *layer = L;
                return;
            }
        }
}

static void sweep_edits(void)
{
    for (size_t pi = 0; pi < sizeof presets / sizeof *presets; pi++) {
        kv_model m;
        kv_err e = {{0}};
        open_preset(presets[pi], &m);
        const int64_t W = sliding_w(&m.cfg);
        for (size_t li = 0; li < sizeof prompts / sizeof *prompts; li++) {
            const int P = prompts[li];
            for (int counts = 1; counts >= 0; counts--) {
                cmp_memrec *ref = record(&m, P, NULL, "{\"engine\":\"reference\"}", true);
                for (size_t fi = 0; fi < sizeof edits / sizeof *edits; fi++) {
                    const edit_family *f = &edits[fi];
                    const int64_t n = f->n(&m.cfg, P);
                    /* What the model and prompt can show. */
                    if ((f->fam.keys == plant_window && (W <= 0 || n < 1)) ||
                        (f->fam.keys == plant_global_windowed && W <= 0) ||
                        (f->fam.keys == plant_layer_global && n < 0) ||
                        (f->long_prompt && P + NNEW <= W + 2) ||
                        (f->fam.rows && !counts))
                        continue;
                    const plant_arg a = {.P = P, .T = P + NNEW, .n = n};
                    cmp_memrec *got = record(&m, P, NULL, "{\"engine\":\"outside\"}", counts);
                    if (plant_apply(&f->fam, &a, got, &m, &e) != 0)
                        die("plant", &e);
                    int64_t pos;
                    int layer;
                    planted_at(f, &a, &m.cfg, &pos, &layer);
                    cmp_result r;
                    compare(ref, got, &r);
                    char what[160];
                    snprintf(what, sizeof what, "%s P %d %s", presets[pi], P,
                             counts ? "with counts" : "attn_out alone");
                    if (pos >= 0)
                        judge(counts ? "edit" : "edit-out", f->name, f->fam.kind, &r, pos,
                              layer, what);
                    if (pos >= 0 && (f->fam.kind == CMP_DIAG_MISSING_KEY ||
                                     f->fam.kind == CMP_DIAG_OWN_KEY_MASKED ||
                                     f->fam.kind == CMP_DIAG_STALE_CACHE))
                        judge_scope(counts ? "edit" : "edit-out", f->name, f->fam.kind, &r,
                                    strstr(f->name, " only") != NULL, what);
                    cmp_result_free(&r);
                    cmp_memrec_free(got);
                }
                cmp_memrec_free(ref);
            }
        }
        model_free(&m);
    }
}

int main(int argc, char **argv)
{
    sweep_injections();
    sweep_edits();
    printf("%-8s %-26s %5s %8s %6s %9s %8s %6s\n", "way", "family", "runs", "located", "named",
           "undecided", "unnamed", "wrong");
    tally all;
    memset(&all, 0, sizeof all);
    for (int i = 0; i < ntallies; i++) {
        const tally *t = &tallies[i];
        printf("%-8s %-26s %5d %8d %6d %9d %8d %6d\n", t->way, t->family, t->runs, t->located,
               t->named, t->undecided, t->unnamed, t->wrong);
        if (t->example[0])
            printf("         e.g. %s\n", t->example);
        all.runs += t->runs, all.located += t->located, all.named += t->named;
        all.undecided += t->undecided, all.unnamed += t->unnamed, all.wrong += t->wrong;
        all.verified_wrong += t->verified_wrong;
    }
    printf("%-35s %5d %8d %6d %9d %8d %6d\n", "all", all.runs, all.located, all.named,
           all.undecided, all.unnamed, all.wrong);
    printf("named %.1f%%, located %.1f%%, verified and wrong %d; legitimate runs %d, false "
           "alarms %d\n", 100.0 * all.named / (all.runs ? all.runs : 1),
           100.0 * all.located / (all.runs ? all.runs : 1), all.verified_wrong, legit_runs,
           false_alarms);
    if (argc > 1) {
        FILE *f = fopen(argv[1], "a");
        if (!f) {
            perror(argv[1]);
            return 2;
        }
        char date[32];
        time_t now = time(NULL);
        strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
        for (int i = 0; i < ntallies; i++) {
            const tally *t = &tallies[i];
            fprintf(f, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\n", date, t->way, t->family,
                    t->runs, t->located, t->named, t->undecided, t->unnamed, t->wrong,
                    t->verified_wrong);
        }
        fprintf(f, "%s\tlegit\tall\t%d\t\t\t\t\t%d\t\n", date, legit_runs, false_alarms);
        fclose(f);
    }
    return all.wrong > 0 || all.verified_wrong > 0 || false_alarms > 0 ||
           all.located < all.runs;
}
