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
#include "testutil.h"

#define P 40      /* prompt length */
#define NEW 10    /* decode steps */

/* What a bug makes attention read at (layer, q); false: the config's. */
typedef bool (*keys_fn)(const kv_config *cfg, int layer, int64_t q, cmp_hyp *h);

static int64_t cfg_lo(const kv_config *cfg, int layer, int64_t q)
{
    const int W = config_layer_window(cfg, layer);
    return W > 0 && q - W + 1 > 0 ? q - W + 1 : 0;
}

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
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    mo.stages[STAGE_ATTN_LSE] = counts;
    mo.stages[STAGE_ATTN_NKEYS] = counts;
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, "reference", settings, &mo, &e);
    ck_assert_msg(rec != NULL, "%s", e.msg);
    kv_observer *obs = cmp_memrec_observer(rec);
    ref_opts ro = {.max_ctx = P + NEW, .prefill_step = 0};
    kv_engine *eng = ref_create(m, &kc, &ro, obs, &e);
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[P];
    pcg32 r;
    pcg32_seed(&r, 11, 0x70);
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)pcg32_bounded(&r, (uint32_t)m->cfg.vocab);
    gen_opts go = {.max_new = NEW, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    ck_assert_msg(generate(eng, &m->cfg, prompt, P, &go, obs, &res, &e) == 0, "%s", e.msg);
    gen_result_free(&res);
    engine_free(eng);
    return rec;
}

/* The planting callback over a keys_fn (held in a struct: a function
 * pointer does not pass as void *). */
typedef struct {
    keys_fn f;
} plant_ctx;

static bool plant_cb(void *ctx, const kv_config *cfg, int layer, int64_t q, cmp_hyp *h)
{
    return ((plant_ctx *)ctx)->f(cfg, layer, q, h);
}

static void plant_keys(cmp_memrec *rec, const kv_config *cfg, keys_fn f)
{
    kv_err e = {{0}};
    plant_ctx pc = {f};
    ck_assert_msg(cmp_memrec_plant_attention(rec, cfg, plant_cb, &pc, &e) == 0, "%s", e.msg);
}

/* A planted bug: the compare of the reference and the edited test, the
 * test recorded with or without attn_lse and attn_nkeys (an outside
 * runtime's attn_out alone). */
typedef struct {
    const char *name;
    const char *preset;
    keys_fn keys;                /* the bug, as a key set */
    void (*plant)(cmp_memrec *rec, const kv_model *m);   /* or as rows, first */
    const char *settings;        /* the test's engine settings */
    int64_t pos;                 /* where it must be located */
    int layer;
    cmp_diag_kind kind;          /* what it must be named */
    const char *words;           /* a phrase the diagnosis must hold */
    bool counts_too;             /* also try without attn_lse, attn_nkeys */
} plant_case;

static void run_plant(const plant_case *pc, bool counts)
{
    kv_model m;
    open_model(pc->preset, &m);
    cmp_memrec *ref = record(&m, "{\"engine\":\"reference\"}", true);
    cmp_memrec *got = record(&m, pc->settings, counts);
    if (pc->plant)
        pc->plant(got, &m);
    if (pc->keys)
        plant_keys(got, &m.cfg, pc->keys);
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
    ck_assert_msg(r.diag.kind == pc->kind && r.diag.basis != CMP_BASIS_HEURISTIC &&
                  !r.diag.undecided, "%s (%s): named %s (%s), planted %s\n%s", pc->name,
                  counts ? "counts" : "attn_out alone", cmp_diag_name(r.diag.kind),
                  cmp_basis_name(r.diag.basis), cmp_diag_name(pc->kind), t);
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
/* The bugs                                                             */

/* A sliding window one key short of the config's, on every sliding layer. */
static bool window_short(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    const int W = config_layer_window(cfg, L);
    if (W <= 0)
        return false;
    h->lo = q - (W - 1) + 1 > 0 ? q - (W - 1) + 1 : 0;
    return true;
}

/* The split local/global cache bug: the global layer read through the
 * sliding window. */
static bool global_through_window(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    if (config_layer_window(cfg, L) > 0)
        return false;
    h->lo = q - 12 + 1 > 0 ? q - 12 + 1 : 0;
    return true;
}

/* Layer types off by one: sliding layer 4 runs as global. */
static bool sliding_as_global(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)q;
    if (L != 4)
        return false;
    h->lo = 0;
    return true;
}

/* Decode steps never see the prompt's keys. */
static bool decode_blind(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < P)
        return false;
    h->lo = h->lo > P ? h->lo : P;
    return true;
}

/* Decode reads the prefill cache whole, padded to 48 slots (8 zero). */
static bool padded_prefill(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < P)
        return false;
    h->extra_zero = 8;
    return true;
}

/* An AR cache whose write index is stuck at 0 from the first decode step:
 * slot 0 holds the newest key, the decode positions' slots stay zero. */
static bool stuck_at_zero(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    if (q < P || cfg_lo(cfg, L, q) > 0)
        return false;
    h->nsubst = 1;
    h->from[0] = 0, h->to[0] = q;
    h->zero_lo = P, h->zero_hi = q + 1;
    return true;
}

/* The query's own key masked out (j < q) everywhere. */
static bool own_masked(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    h->hi = q - 1;
    return true;
}

/* Chunks of one token attending only to themselves: every layer. */
static bool isolated_1(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q >= P)
        return false;
    h->lo = q;
    return true;
}

/* A window of one key on the sliding layers. */
static bool window_1(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    if (config_layer_window(cfg, L) <= 0)
        return false;
    h->lo = q;
    return true;
}

/* Every layer's attention recomputed from the (edited) k, v. */
static bool all_config(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    (void)q;
    (void)h;
    return true;
}

/* The K = V = 0 of KV-shared ports: nothing written from position P on. */
static void zero_kv_from_P(cmp_memrec *rec, const kv_model *m)
{
    const kv_config *cfg = &m->cfg;
    for (int L = 0; L < cfg->n_layers; L++)
        for (int64_t q = P; q < P + NEW; q++)
            for (int st = STAGE_K; st <= STAGE_V; st++) {
                int cols;
                float *row = cmp_memrec_row(rec, L, (kv_stage)st, q, &cols);
                if (row)
                    memset(row, 0, (size_t)cols * sizeof(float));
            }
}

/* k and v weights swapped on layer 0: k = RoPE(k_norm(W_v x)), v = W_k x,
 * built from the reference's rows (W_k x up to the scale the norm drops:
 * its k rotated back, over the norm's gain). RoPE at q is the rotation
 * back at -q. */
static void kv_swapped(cmp_memrec *rec, const kv_model *m)
{
    const kv_config *cfg = &m->cfg;
    const int KV = cfg->n_kv_heads, D = cfg->head_dim, n = KV * D;
    const float *w = m->layers[0].k_norm;
    double *u = malloc((size_t)n * sizeof(double));
    float *kn = malloc((size_t)n * sizeof(float)), *vk = malloc((size_t)n * sizeof(float));
    for (int64_t q = 0; q < P + NEW; q++) {
        int cols;
        float *k = cmp_memrec_row(rec, 0, STAGE_K, q, &cols);
        float *v = cmp_memrec_row(rec, 0, STAGE_V, q, &cols);
        if (!k || !v)
            continue;
        for (int h = 0; h < KV; h++) {
            double ms = 0;
            for (int d = 0; d < D; d++)
                ms += (double)v[h * D + d] * v[h * D + d];
            const double inv = w ? 1.0 / sqrt(ms / D + cfg->rms_eps) : 1.0;
            for (int d = 0; d < D; d++) {
                const double g = !w ? 1.0 : cfg->norm_plus_one ? 1.0 + w[d] : w[d];
                kn[h * D + d] = (float)(v[h * D + d] * inv * g);
            }
        }
        cmp_rope_unrotate(cfg, 0, q, k, KV, u);
        for (int i = 0; i < n; i++) {
            const double g = !w ? 1.0 : cfg->norm_plus_one ? 1.0 + w[i % D] : w[i % D];
            vk[i] = (float)(u[i] / g);
        }
        cmp_rope_unrotate(cfg, 0, -q, kn, KV, u);
        for (int i = 0; i < n; i++)
            k[i] = (float)u[i];
        memcpy(v, vk, (size_t)n * sizeof(float));
    }
    free(u);
    free(kn);
    free(vk);
}

/* RMSNorm with eps 1e-2 in the input norms of layer 0. */
static void norm_eps(cmp_memrec *rec, const kv_model *m)
{
    const int E = m->cfg.hidden;
    for (int64_t q = 0; q < P + NEW; q++) {
        int cols;
        float *x = cmp_memrec_row(rec, 0, STAGE_X_IN, q, &cols);
        float *y = cmp_memrec_row(rec, 0, STAGE_ATTN_NORM, q, &cols);
        if (!x || !y)
            continue;
        double ms = 0;
        for (int i = 0; i < E; i++)
            ms += (double)x[i] * x[i];
        ms /= E;
        const double f = sqrt((ms + m->cfg.rms_eps) / (ms + 1e-2));
        for (int i = 0; i < E; i++)
            y[i] = (float)(y[i] * f);
    }
}

/* Layer 0's attention from its edited k, v. */
static bool layer0(const kv_config *cfg, int L, int64_t q, cmp_hyp *h)
{
    return L == 0 && all_config(cfg, L, q, h);
}

static const plant_case cases[] = {
    {"window W-1", "tiny-gemma3", window_short, NULL, "{\"engine\":\"outside\"}", 11, 0,
     CMP_DIAG_WINDOW, "window in test appears to be 11, config says 12", true},
    {"global read through the window", "tiny-gemma3", global_through_window, NULL,
     "{\"engine\":\"outside\"}", 12, 5, CMP_DIAG_LAYER_TYPE,
     "layer 5, global in the config, read through a window of 12 keys", true},
    {"sliding layer run as global", "tiny-gemma3", sliding_as_global, NULL,
     "{\"engine\":\"outside\"}", 12, 4, CMP_DIAG_LAYER_TYPE,
     "it is global in the test; the config says sliding", true},
    {"decode blind, cache dense", "tiny-gemma3", decode_blind, NULL,
     "{\"engine\":\"outside\",\"cache\":\"dense\"}", P, 0, CMP_DIAG_DECODE_BLIND,
     "decode steps attend only to the decode cache", true},
    {"padded prefill slots", "tiny-llama", padded_prefill, NULL, "{\"engine\":\"outside\"}", P,
     0, CMP_DIAG_PADDED_SLOTS, "8 unwritten (zero) slots", true},
    {"write index stuck at 0", "tiny-llama", stuck_at_zero, NULL, "{\"engine\":\"outside\"}", P,
     0, CMP_DIAG_DECODE_STUCK, "stuck at slot 0", true},
    {"own key masked", "tiny-gemma3", own_masked, NULL, "{\"engine\":\"outside\"}", 0, 0,
     CMP_DIAG_OWN_KEY_MASKED, "own key is masked out", true},
    /* Chunk 1: isolated chunks and a window of 1 read the same keys on a
     * sliding layer; the global layer tells them apart. */
    {"isolated chunks of 1", "tiny-gemma3", isolated_1, NULL,
     "{\"engine\":\"outside\",\"chunk\":1}", 1, 0, CMP_DIAG_CHUNK_ISOLATED,
     "chunks attend only to themselves", true},
    {"window of 1", "tiny-gemma3", window_1, NULL, "{\"engine\":\"outside\",\"chunk\":1}", 1,
     0, CMP_DIAG_WINDOW, "window in test appears to be 1, config says 12", true},
    {"K = V = 0 from P", "tiny-gemma3-kvshared", all_config, zero_kv_from_P,
     "{\"engine\":\"outside\"}", P, 0, CMP_DIAG_ZERO_KV,
     "K and V rows written as zero from position 40 on", false},
    {"k and v swapped", "tiny-llama", layer0, kv_swapped, "{\"engine\":\"outside\"}", 0, 0,
     CMP_DIAG_KV_SWAPPED, "k and v projections swapped", false},
    {"k and v swapped under a k norm", "tiny-gemma3", layer0, kv_swapped,
     "{\"engine\":\"outside\"}", 0, 0, CMP_DIAG_KV_SWAPPED, "k and v projections swapped",
     false},
    {"RMSNorm eps", "tiny-gemma3", NULL, norm_eps, "{\"engine\":\"outside\"}", 0, 0,
     CMP_DIAG_NORM_EPS, "with eps 0.01 where the config says 1e-06", false},
};

START_TEST(test_planted_named)
{
    run_plant(&cases[_i], true);
}
END_TEST

START_TEST(test_planted_named_from_attn_out)
{
    if (cases[_i].counts_too)
        run_plant(&cases[_i], false);
}
END_TEST

Suite *hypotheses_suite(void)
{
    Suite *s = suite_create("hypotheses");
    TCase *tc = tcase_create("planted");
    tcase_set_timeout(tc, 300);
    const int n = (int)(sizeof cases / sizeof cases[0]);
    tcase_add_loop_test(tc, test_planted_named, 0, n);
    tcase_add_loop_test(tc, test_planted_named_from_attn_out, 0, n);
    suite_add_tcase(s, tc);
    return s;
}
