/* compare.c — cmp_compare: compatibility checks, the (layer, stage) slots
 * both recordings hold, the noise floor, and the walk in dataflow order
 * that finds the first divergence while accumulating per-stage metrics.
 *
 * The walk reads one block of positions (opts.block_rows, fewer for wide
 * stages such as logits) per (layer, stage) at a time, so memory depends on
 * the model's widths, never on the length of the recordings. Within a
 * block every slot is compared and the earliest violation in (position,
 * dataflow rank) order wins; row records are kept for the block only, so
 * the `upto` metrics stop exactly at the divergence. */
#include <math.h>
#include <stdarg.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "cmp_internal.h"
#include "../model/kernels.h"
#include "../model/forward.h"
#include "../model/pool.h"

void cmp_opts_default(cmp_opts *o)
{
    memset(o, 0, sizeof *o);
    o->noise_factor = 4.0;
    o->block_rows = 64;
}

/* ------------------------------------------------------------------ */
/* Compatibility                                                        */

/* Same architecture and shapes, same weights when both say which. */
bool cmp_model_mismatch(const kv_config *x, const kv_config *y, char *why, size_t n)
{
    struct { const char *name; long u, v; } f[] = {
        {"num_hidden_layers", x->n_layers, y->n_layers},
        {"hidden_size", x->hidden, y->hidden},
        {"num_attention_heads", x->n_heads, y->n_heads},
        {"num_key_value_heads", x->n_kv_heads, y->n_kv_heads},
        {"head_dim", x->head_dim, y->head_dim},
        {"vocab_size", x->vocab, y->vocab},
        /* Gemma 4's full layers: 0 where a config has no such field. */
        {"global_head_dim", x->head_dim_full ? x->head_dim_full : x->head_dim,
         y->head_dim_full ? y->head_dim_full : y->head_dim},
        {"num_global_key_value_heads", x->n_kv_heads_full ? x->n_kv_heads_full : x->n_kv_heads,
         y->n_kv_heads_full ? y->n_kv_heads_full : y->n_kv_heads},
        {"hidden_size_per_layer_input", x->per_layer_dim, y->per_layer_dim},
    };
    if (strcmp(x->model_type, y->model_type)) {
        snprintf(why, n, "model_type '%s' vs '%s'", x->model_type, y->model_type);
        return true;
    }
    for (size_t i = 0; i < sizeof f / sizeof *f; i++)
        if (f[i].u != f[i].v) {
            snprintf(why, n, "%s %ld vs %ld", f[i].name, f[i].u, f[i].v);
            return true;
        }
    return false;
}

/* What attention reads that the configs x (a's) and y (b's) set apart,
 * in words, into diff (empty when nothing): the first layer whose type
 * or KV owner differs, else the sliding window, else the final softcap.
 * Returns the diagnosis that names it (CMP_DIAG_NONE: nothing). */
static cmp_diag_kind structure_diff(const cmp_source *a, const cmp_source *b, char *diff,
                                    size_t n)
{
    const kv_config *x = &a->cfg, *y = &b->cfg;
    diff[0] = '\0';
    for (int l = 0; l < x->n_layers && l < y->n_layers && l < KV_MAX_LAYERS; l++) {
        if (x->layer_type[l] != y->layer_type[l]) {
            snprintf(diff, n, "layer %d is %s in %s's config, %s in %s's", l,
                     y->layer_type[l] == ATTN_SLIDING ? "sliding" : "global", b->label,
                     x->layer_type[l] == ATTN_SLIDING ? "sliding" : "global", a->label);
            return CMP_DIAG_LAYER_TYPE;
        }
        if (x->kv_owner[l] != y->kv_owner[l]) {
            char own_x[48], own_y[48];
            snprintf(own_x, sizeof own_x, x->kv_owner[l] == l ? "its own" : "layer %d's",
                     x->kv_owner[l]);
            snprintf(own_y, sizeof own_y, y->kv_owner[l] == l ? "its own" : "layer %d's",
                     y->kv_owner[l]);
            snprintf(diff, n, "layer %d reads %s KV cache in %s's config, %s in %s's", l, own_y,
                     b->label, own_x, a->label);
            return CMP_DIAG_KV_OWNER;
        }
    }
    if (x->sliding_window != y->sliding_window) {
        snprintf(diff, n, "sliding_window %d in %s's config, %d in %s's", y->sliding_window,
                 b->label, x->sliding_window, a->label);
        return CMP_DIAG_WINDOW;
    }
    if (x->final_softcap != y->final_softcap) {
        snprintf(diff, n, "final_logit_softcapping %g in %s's config, %g in %s's",
                 y->final_softcap, b->label, x->final_softcap, a->label);
        return CMP_DIAG_LOGIT_MAP;
    }
    return CMP_DIAG_NONE;
}

static int check_models(const cmp_source *a, const cmp_source *b, const char *what, bool force,
                        cmp_result *r, kv_err *e)
{
    const kv_config *x = &a->cfg, *y = &b->cfg;
    char why[512] = "";
    cmp_model_mismatch(x, y, why, sizeof why);
    if (!why[0] && a->weights && b->weights && a->weights[0] && b->weights[0] &&
        strcmp(a->weights, b->weights))
        snprintf(why, sizeof why, "weight fingerprints %s vs %s", a->weights, b->weights);
    if (why[0]) {
        if (!force)
        {
            /* Name each file once, in the order of "why"'s values. */
            if (strcmp(what, "model"))
                return kv_errf(e, "the %s %s is not the same model as %s: %s; refusing "
                               "to compare (--force to compare anyway)", what, b->label,
                               a->label, why);
            return kv_errf(e, "%s and %s are not the same model: %s; refusing to "
                           "compare (--force to compare anyway)", a->label, b->label, why);
        }
        cmp_note(r, "compared despite different models (forced): %s", why);
    }
    if (x->final_softcap != y->final_softcap)
        cmp_note(r, "configs differ: final_logit_softcapping %g (%s) vs %g (%s)",
                 x->final_softcap, a->label, y->final_softcap, b->label);
    if (x->sliding_window != y->sliding_window)
        cmp_note(r, "configs differ: sliding_window %d (%s) vs %d (%s)", x->sliding_window,
                 a->label, y->sliding_window, b->label);
    for (int l = 0; l < x->n_layers && l < y->n_layers && l < KV_MAX_LAYERS; l++)
        if (x->layer_type[l] != y->layer_type[l] || x->kv_owner[l] != y->kv_owner[l]) {
            cmp_note(r, "configs differ: layer %d attention type or KV owner", l);
            break;
        }
    return 0;
}

/* What validate rejects in a token list, compare refuses too: a prompt
 * longer than the tokens recorded says the file is not what it claims. */
static int check_token_list(const cmp_source *s, kv_err *e)
{
    if (s->prompt_length < 0 || s->n_tokens < 0)
        return kv_errf(e, "%s: /tokens: prompt_length %lld or token count %lld is negative",
                       s->label, (long long)s->prompt_length, (long long)s->n_tokens);
    if (s->n_tokens > 0 && s->prompt_length > s->n_tokens)
        return kv_errf(e, "%s: /tokens: prompt_length %lld is larger than the %lld tokens "
                       "recorded (kvdiff validate rejects it too)", s->label,
                       (long long)s->prompt_length, (long long)s->n_tokens);
    return 0;
}

/* Same prompt; returns in *cut the first position whose token differs
 * (prompt or generated), -1 when none differs. */
static int check_prompts(const cmp_source *a, const cmp_source *b, bool force, cmp_result *r,
                         int64_t *cut, kv_err *e)
{
    *cut = -1;
    if (a->n_tokens <= 0 || b->n_tokens <= 0 || !a->tokens || !b->tokens) {
        cmp_note(r, "%s has no tokens: the prompts could not be checked",
                 a->n_tokens <= 0 ? a->label : b->label);
        return 0;
    }
    const int64_t n = a->n_tokens < b->n_tokens ? a->n_tokens : b->n_tokens;
    for (int64_t p = 0; p < n && *cut < 0; p++)
        if (a->tokens[p] != b->tokens[p])
            *cut = p;
    char why[256] = "";
    if (a->prompt_length != b->prompt_length)
        snprintf(why, sizeof why, "prompt lengths %lld vs %lld", (long long)a->prompt_length,
                 (long long)b->prompt_length);
    else if (*cut >= 0 && *cut < a->prompt_length)
        snprintf(why, sizeof why, "the prompts differ at position %lld (token %d vs %d)",
                 (long long)*cut, a->tokens[*cut], b->tokens[*cut]);
    if (why[0]) {
        if (!force)
            return kv_errf(e, "%s and %s did not run the same prompt: %s; refusing to compare "
                           "(--force to compare the positions before it)", a->label, b->label,
                           why);
        cmp_note(r, "compared despite different prompts (forced): %s", why);
        const int64_t pl = a->prompt_length < b->prompt_length ? a->prompt_length
                                                               : b->prompt_length;
        if (a->prompt_length != b->prompt_length && (*cut < 0 || *cut > pl))
            *cut = pl;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Slots: the (layer, stage) pairs both recordings hold                 */

typedef struct {
    cmp_stage_result *res;
    int cols;
    cmp_tol tol;
    bool prehash;                /* both sides have row hashes: read them first */
    int parallel;                /* rows read on the pool: -1 not asked yet, 0 no, 1 yes */
    /* prehash: hashes of both sides and the reference's statistics for
     * positions span_lo .. span_lo + span_n - 1, read HASH_SPAN at a time
     * (one read per block cost more than the hashes themselves) */
    uint64_t *ha, *hb;
    float *sb;
    int64_t span_lo, span_n;
} walk_slot;

#define HASH_SPAN 1024

/* One read of a block (slot, positions q .. q + n - 1) done on the pool. */
typedef struct {
    int slot;
    int64_t q, n;
    int rc;
    kv_err err;
} read_job;

typedef struct {
    const cmp_source *ref, *test;
    const cmp_opts *o;
    cmp_result *r;
    int64_t pos_limit;           /* exclusive */
    bool routing_cut;            /* pos_limit is a routing flip's (find_routing_flip) */
    walk_slot *slots;
    int n;
    int B;                       /* positions per block */
    float *bufa, *bufb;          /* test, reference rows read here: task 0's tbuf (the
                                  * pool is idle whenever these are used) */
    float **tbuf;                /* per pool task: test and reference rows (2 x tasks) */
    int tasks;
    read_job *jobs;              /* reads of a block done on the pool (block_run) */
    read_job *later;             /* reads of a block done afterwards, here */
    int n_later, max_jobs;
    uint64_t *hasha, *hashb;
    cmp_rowrec *recs;            /* (n, B) */
    kern_pool *pool;             /* rows of a read are weighed in parallel */
    uint8_t *have;               /* (n, B) */
} walker;

/* Dataflow order: embed, layer stages, final_norm, logits. */
static int order_pairs(int L, int *layers, kv_stage *stages)
{
    int n = 0;
    layers[n] = -1, stages[n++] = STAGE_EMBED;
    for (int l = 0; l < L; l++)
        for (int s = 0; s < STAGE_LAYER_COUNT; s++)
            layers[n] = l, stages[n++] = (kv_stage)s;
    layers[n] = -1, stages[n++] = STAGE_FINAL_NORM;
    layers[n] = -1, stages[n++] = STAGE_LOGITS;
    return n;
}

typedef struct {
    bool has;
    int64_t lo, hi;
    int cols;
} presence;

static presence present(const cmp_source *s, int layer, kv_stage st)
{
    presence p = {0};
    int64_t first = 0, rows = 0;
    if (s->info(s->ctx, layer, st, &first, &rows, &p.cols) != 0 || rows <= 0)
        return p;
    p.has = true;
    p.lo = first;
    p.hi = first + rows - 1;
    if (!s->read)   /* fingerprint: the width is the model's (the hash dataset has 1) */
        p.cols = cmp_stage_cols(&s->cfg, layer, st);
    return p;
}

/* Union of what each side holds, to say what the overlap left out. */
typedef struct {
    uint8_t layers[KV_MAX_LAYERS + 1];   /* [layer + 1] */
    bool stages[STAGE_COUNT];
    int64_t lo, hi;
} holding;

static void hold(holding *h, int layer, kv_stage st, presence p)
{
    if (!p.has)
        return;
    h->layers[layer + 1] = 1;
    h->stages[st] = true;
    h->lo = p.lo < h->lo ? p.lo : h->lo;
    h->hi = p.hi > h->hi ? p.hi : h->hi;
}

static void layer_list(const uint8_t *layers, int L, char *buf, size_t n)
{
    size_t used = 0;
    buf[0] = 0;
    for (int l = 0; l < L && used < n; l++) {
        if (!layers[l + 1])
            continue;
        int end = l;
        while (end + 1 < L && layers[end + 2])
            end++;
        int w = end > l ? snprintf(buf + used, n - used, "%s%d-%d", used ? "," : "", l, end)
                        : snprintf(buf + used, n - used, "%s%d", used ? "," : "", l);
        used += w > 0 ? (size_t)w : 0;
        l = end;
    }
    if (!buf[0])
        snprintf(buf, n, "none");
}

/* Names of the stages h holds and the overlap does not, comma-separated. */
static void stages_beyond(const holding *h, const holding *common, char *buf, size_t n)
{
    size_t used = 0;
    buf[0] = 0;
    for (int s = 0; s < STAGE_COUNT && used < n; s++)
        if (h->stages[s] && !common->stages[s]) {
            int w = snprintf(buf + used, n - used, "%s%s", used ? ", " : "",
                             stage_name((kv_stage)s));
            used += w > 0 ? (size_t)w : 0;
        }
}

/* Appends "; " and the formatted text to buf (bounded). */
static void add_part(char *buf, size_t n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add_part(char *buf, size_t n, const char *fmt, ...)
{
    size_t used = strlen(buf);
    if (used && used + 2 < n) {
        strcat(buf, "; ");
        used += 2;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, n - used, fmt, ap);
    va_end(ap);
}

/* Says what one side holds that the compared overlap leaves out: stages
 * (model-level ones such as embed included), layers, positions. Only what
 * differs is named. */
static void describe_side(char *buf, size_t n, const holding *h, const holding *hc, int L,
                          const char *label)
{
    char list[256];
    stages_beyond(h, hc, list, sizeof list);
    if (list[0])
        add_part(buf, n, "%s alone holds %s", label, list);
    if (memcmp(h->layers + 1, hc->layers + 1, sizeof h->layers - 1)) {
        layer_list(h->layers, L, list, sizeof list);
        add_part(buf, n, "%s holds layers %s", label, list);
    }
    if (h->lo != hc->lo || h->hi != hc->hi)
        add_part(buf, n, "%s holds positions %lld..%lld", label, (long long)h->lo,
                 (long long)h->hi);
}

static void describe_overlap(cmp_result *r, const holding *hr, const holding *ht,
                             const holding *hc, int L, const char *rl, const char *tl,
                             bool test_stopped)
{
    bool layers_differ = memcmp(hr->layers, hc->layers, sizeof hr->layers) ||
                         memcmp(ht->layers, hc->layers, sizeof ht->layers);
    bool pos_differ = hr->lo != hc->lo || hr->hi != hc->hi || ht->lo != hc->lo ||
                      ht->hi != hc->hi;
    bool stages_differ = memcmp(hr->stages, hc->stages, sizeof hr->stages) ||
                         memcmp(ht->stages, hc->stages, sizeof ht->stages);
    r->compared.partial = layers_differ || pos_differ || stages_differ;
    /* a test stopped on purpose past its first divergence holds fewer
     * positions by design: that is said where the run says it stopped */
    if (!r->compared.partial || (test_stopped && !layers_differ && !stages_differ))
        return;
    char what[400] = "", c[96];
    describe_side(what, sizeof what, hr, hc, L, rl);
    describe_side(what, sizeof what, ht, hc, L, tl);
    layer_list(hc->layers, L, c, sizeof c);
    cmp_note(r, "compared the overlap only (layers %s, positions %lld..%lld): %s", c,
             (long long)hc->lo, (long long)hc->hi, what);
}

/* Says in cv->lacks what a side lacks of what the other records, stage by
 * stage ("x.h5 lacks q, k of every layer; y.h5 lacks embed"): stages
 * lacking on the same layers are named together. lack[side][stage] has
 * [layer + 1] set where that side lacks what the other side holds. */
static void describe_lacks(cmp_coverage *cv, uint8_t (*lack)[STAGE_COUNT][KV_MAX_LAYERS + 1],
                           int L, const char *const *labels)
{
    char *buf = cv->lacks;
    const size_t n = sizeof cv->lacks;
    buf[0] = 0;
    for (int side = 0; side < 2; side++) {
        bool done[STAGE_COUNT] = {false}, named = false;
        for (int s = 0; s < STAGE_COUNT; s++) {
            if (done[s] || !memchr(lack[side][s], 1, sizeof lack[side][s]))
                continue;
            char stages[200] = "", where[128];
            for (int t = s; t < STAGE_COUNT; t++)
                if (!done[t] && !memcmp(lack[side][t], lack[side][s], sizeof lack[side][s])) {
                    done[t] = true;
                    add_part(stages, sizeof stages, "%s", stage_name((kv_stage)t));
                }
            for (char *c = stages; (c = strstr(c, "; ")); c++)
                *c = ',';   /* add_part separates with "; " */
            int count = 0;
            for (int l = 0; l < L; l++)
                count += lack[side][s][l + 1];
            if (s >= STAGE_LAYER_COUNT)
                where[0] = 0;
            else if (count == L)
                snprintf(where, sizeof where, " of every layer");
            else {
                char list[96];
                layer_list(lack[side][s], L, list, sizeof list);
                snprintf(where, sizeof where, " of layer%s %s", count > 1 ? "s" : "", list);
            }
            if (!named)
                add_part(buf, n, "%s lacks %s%s", labels[side], stages, where);
            else
                snprintf(buf + strlen(buf), n - strlen(buf), ", %s%s", stages, where);
            named = true;
        }
    }
}

/* Adds (layer, stage) over positions lo..hi to the compared set; refuses
 * (or, forced, skips) widths that differ. */
static int add_slot(walker *w, int layer, kv_stage st, presence a, presence b, int64_t lo,
                    int64_t hi, kv_err *e)
{
    cmp_result *r = w->r;
    if (a.cols != b.cols || a.cols <= 0) {
        if (!w->o->force)
            return kv_errf(e, "%s of layer %d has %d columns in %s and %d in %s; refusing to "
                           "compare (--force skips it)", stage_name(st), layer, a.cols,
                           w->ref->label, b.cols, w->test->label);
        cmp_note(r, "skipped %s of layer %d: %d vs %d columns", stage_name(st), layer, a.cols,
                 b.cols);
        return 0;
    }
    cmp_stage_result *sr = &r->stages[r->n_stages++];
    sr->layer = layer;
    sr->stage = st;
    sr->cols = a.cols;
    sr->pos_lo = lo;
    sr->pos_hi = hi;
    sr->hashed = !w->ref->read || !w->test->read;
    cmp_stats_init(&sr->upto);
    cmp_stats_init(&sr->all);
    return 0;
}

/* What was compared, from the slots themselves. */
static void count_coverage(walker *w)
{
    cmp_result *r = w->r;
    cmp_coverage *cv = &r->compared;
    bool layer_seen[KV_MAX_LAYERS] = {false}, stage_seen[STAGE_COUNT] = {false};
    cv->pos_lo = INT64_MAX;
    cv->pos_hi = -1;
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *sr = &r->stages[i];
        w->slots[i].res = &r->stages[i];
        w->slots[i].cols = sr->cols;
        w->slots[i].parallel = -1;
        w->slots[i].prehash = !sr->hashed && !w->o->no_hashes && w->ref->read_hash &&
                              w->ref->read_stats && w->test->read_hash;
        cv->rows += sr->pos_hi - sr->pos_lo + 1;
        cv->pos_lo = sr->pos_lo < cv->pos_lo ? sr->pos_lo : cv->pos_lo;
        cv->pos_hi = sr->pos_hi > cv->pos_hi ? sr->pos_hi : cv->pos_hi;
        cv->hashed |= sr->hashed;
        if (sr->layer >= 0 && !layer_seen[sr->layer]) {
            layer_seen[sr->layer] = true;
            cv->n_layers++;
        }
        if (!stage_seen[sr->stage]) {
            stage_seen[sr->stage] = true;
            if (sr->stage < STAGE_LAYER_COUNT)
                cv->n_stages++;
            else
                cv->n_model_stages++;
        }
    }
    w->n = r->n_stages;
}

static int build_slots(walker *w, kv_err *e)
{
    const int L = w->ref->cfg.n_layers < w->test->cfg.n_layers ? w->ref->cfg.n_layers
                                                               : w->test->cfg.n_layers;
    int layers[KV_MAX_LAYERS * STAGE_LAYER_COUNT + 3];
    kv_stage stages[KV_MAX_LAYERS * STAGE_LAYER_COUNT + 3];
    const int n = order_pairs(L, layers, stages);
    cmp_result *r = w->r;
    r->stages = calloc((size_t)n, sizeof *r->stages);
    w->slots = calloc((size_t)n, sizeof *w->slots);
    if (!r->stages || !w->slots)
        return kv_errf(e, "compare: out of memory");
    holding hr = {.lo = INT64_MAX, .hi = -1}, ht = hr, hc = hr;
    bool ref_layers = false, test_layers = false, common_layers = false;
    uint8_t lack[2][STAGE_COUNT][KV_MAX_LAYERS + 1];
    memset(lack, 0, sizeof lack);
    for (int i = 0; i < n; i++) {
        presence a = present(w->ref, layers[i], stages[i]);
        presence b = present(w->test, layers[i], stages[i]);
        if (a.has != b.has)
            lack[a.has ? 1 : 0][stages[i]][layers[i] + 1] = 1;
        if (layers[i] >= 0) {
            ref_layers |= a.has;
            test_layers |= b.has;
            common_layers |= a.has && b.has && (a.lo > b.lo ? a.lo : b.lo) <= (a.hi < b.hi ? a.hi : b.hi);
        }
        hold(&hr, layers[i], stages[i], a);
        hold(&ht, layers[i], stages[i], b);
        const int64_t lo = a.lo > b.lo ? a.lo : b.lo, both_hi = a.hi < b.hi ? a.hi : b.hi;
        if (!a.has || !b.has || lo > both_hi)
            continue;
        /* The overlap as recorded; the token cut is reported apart. */
        hold(&hc, layers[i], stages[i], (presence){true, lo, both_hi, a.cols});
        const int64_t hi = w->pos_limit >= 0 && both_hi >= w->pos_limit ? w->pos_limit - 1
                                                                          : both_hi;
        if (lo <= hi && add_slot(w, layers[i], stages[i], a, b, lo, hi, e) < 0)
            return -1;
    }
    /* Both record layers but none in common: the embedding alone agreeing
     * says nothing about the cache, so no verdict rests on it. */
    if (ref_layers && test_layers && !common_layers)
        return kv_errf(e, "%s and %s hold no layer stage in common (disjoint layer, stage or "
                       "position selections): nothing to compare", w->ref->label,
                       w->test->label);
    count_coverage(w);
    const char *const labels[2] = {w->ref->label, w->test->label};
    describe_lacks(&r->compared, lack, L, labels);
    if (hc.lo <= hc.hi)
        describe_overlap(r, &hr, &ht, &hc, L, w->ref->label, w->test->label,
                         w->test->stopped_on_purpose);
    if (w->pos_limit >= 0 && w->pos_limit <= hc.hi && !w->routing_cut)
        cmp_note(r, "positions %lld..%lld not compared: the input token at %lld differs, so "
                 "every row from there on has other inputs", (long long)w->pos_limit,
                 (long long)hc.hi, (long long)w->pos_limit);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Reading blocks                                                       */

static int rows_per_read(const walker *w, int cols)
{
    int n = CMP_ROW_BUDGET / (cols > 0 ? cols : 1);
    if (n > w->B)
        n = w->B;
    return n < 1 ? 1 : n;
}

static int alloc_buffers(walker *w, kv_err *e)
{
    size_t need = 1;
    for (int i = 0; i < w->n; i++) {
        size_t f = (size_t)rows_per_read(w, w->slots[i].cols) * (size_t)w->slots[i].cols;
        need = f > need ? f : need;
    }
    w->tasks = pool_threads(w->pool);
    w->tbuf = calloc(2 * (size_t)w->tasks, sizeof *w->tbuf);
    for (int t = 0; w->tbuf && t < 2 * w->tasks; t++)
        if (!(w->tbuf[t] = malloc(need * sizeof(float))))
            return kv_errf(e, "compare: out of memory for read buffers (%zu floats)", need);
    w->bufa = w->tbuf ? w->tbuf[0] : NULL;
    w->bufb = w->tbuf ? w->tbuf[1] : NULL;
    w->max_jobs = 0;
    for (int i = 0; i < w->n; i++) {
        const int step = rows_per_read(w, w->slots[i].cols);
        w->max_jobs += (w->B + step - 1) / step;
    }
    w->jobs = malloc((size_t)(w->max_jobs ? w->max_jobs : 1) * sizeof *w->jobs);
    w->later = malloc((size_t)(w->max_jobs ? w->max_jobs : 1) * sizeof *w->later);
    w->hasha = malloc((size_t)w->B * sizeof(uint64_t));
    w->hashb = malloc((size_t)w->B * sizeof(uint64_t));
    w->recs = malloc((size_t)(w->n ? w->n : 1) * (size_t)w->B * sizeof *w->recs);
    w->have = malloc((size_t)(w->n ? w->n : 1) * (size_t)w->B);
    if (!w->bufa || !w->bufb || !w->tbuf || !w->jobs || !w->later || !w->hasha || !w->hashb || !w->recs ||
        !w->have)
        return kv_errf(e, "compare: out of memory for read buffers (%zu floats)", need);
    return 0;
}

static void walker_free(walker *w)
{
    for (int i = 0; w->slots && i < w->n; i++) {
        free(w->slots[i].ha);
        free(w->slots[i].hb);
        free(w->slots[i].sb);
    }
    free(w->slots);
    for (int t = 0; w->tbuf && t < 2 * w->tasks; t++)
        free(w->tbuf[t]);
    free(w->tbuf);
    free(w->jobs);
    free(w->later);
    free(w->hasha);
    free(w->hashb);
    free(w->recs);
    free(w->have);
}

/* Rows (or their hashes, for a slot compared by fingerprint) of n positions. */
static int read_side(const cmp_source *s, const cmp_stage_result *sr, int64_t p, int64_t n,
                     float *buf, uint64_t *hash, kv_err *e)
{
    if (sr->hashed && !s->read) {
        if (!s->read_hash)
            return kv_errf(e, "%s: no rows and no hashes for %s of layer %d", s->label,
                           stage_name(sr->stage), sr->layer);
        return s->read_hash(s->ctx, sr->layer, sr->stage, p, n, hash, e) < 0 ? -1 : 0;
    }
    if (s->read(s->ctx, sr->layer, sr->stage, p, n, buf, e) < 0)
        return -1;
    if (sr->hashed)
        for (int64_t r = 0; r < n; r++)
            hash[r] = XXH3_64bits(buf + (size_t)r * sr->cols, (size_t)sr->cols * sizeof(float));
    return 0;
}

/* ------------------------------------------------------------------ */
/* Noise floor                                                          */

/* The floor models the drift a legitimate reordering (cascade attention,
 * another runtime) causes, from one sample of it: the noise recording.
 * One (layer, stage)'s own max |ref - noise| is a poor model: drift is
 * relative to the values' scale, a stage can land on the same floats in
 * one run by chance, and with few drifting positions the largest error
 * seen is a small sample. Over random configurations (bench/noise_sweep.py:
 * cascade chunk A against cascade chunk B) the test's error exceeded twice
 * that stage's own maximum in 19 of 120; pooled as below, it never
 * exceeded 1.6 times the floor (266 configurations, tiny and full-size
 * shapes). docs/diagnosis.md has the figures. */

/* Positions the noise recording and the reference both hold for a slot's
 * (layer, stage), before the noise's first differing input token; lo > hi
 * when none. Not bounded by the test: the floor is the noise run's. */
static void noise_span(const walker *w, const cmp_stage_result *sr, int64_t cut, int64_t *lo,
                       int64_t *hi)
{
    presence pn = present(w->o->noise, sr->layer, sr->stage);
    presence pr = present(w->ref, sr->layer, sr->stage);
    *lo = 0, *hi = -1;
    if (!pn.has || !pr.has || pn.cols != sr->cols || pr.cols != sr->cols)
        return;
    *lo = pn.lo > pr.lo ? pn.lo : pr.lo;
    *hi = pn.hi < pr.hi ? pn.hi : pr.hi;
    if (cut >= 0 && *hi >= cut)
        *hi = cut - 1;
}

/* "q of layer 3", or "embed". */
static void noise_where(const cmp_stage_result *sr, char *buf, size_t n)
{
    if (sr->layer >= 0)
        snprintf(buf, n, "%s of layer %d", stage_name(sr->stage), sr->layer);
    else
        snprintf(buf, n, "%s", stage_name(sr->stage));
}

/* One slot's sample: max |ref - noise| and max row-relative error (max
 * |ref - noise| of a row over max |ref| of that row, the scale rtol uses)
 * over the positions noise_span gives. A non-finite value where the
 * reference has a number is refused; elements non-finite in the reference
 * are skipped (the walk judges those whatever the tolerance), and so are
 * rows whose reference is all zero, which have no scale. */
static int noise_measure(walker *w, cmp_stage_result *sr, int64_t cut, kv_err *e)
{
    const cmp_source *nz = w->o->noise;
    int64_t lo, hi;
    noise_span(w, sr, cut, &lo, &hi);
    sr->noise_held = lo <= hi;
    const int step = rows_per_read(w, sr->cols);
    for (int64_t q = lo; q <= hi; q += step) {
        const int64_t n = hi - q + 1 < step ? hi - q + 1 : step;
        if (w->ref->read(w->ref->ctx, sr->layer, sr->stage, q, n, w->bufb, e) < 0 ||
            nz->read(nz->ctx, sr->layer, sr->stage, q, n, w->bufa, e) < 0)
            return -1;
        for (int64_t r = 0; r < n; r++) {
            const float *a = w->bufa + (size_t)r * sr->cols, *b = w->bufb + (size_t)r * sr->cols;
            double dmax = 0, scale = 0;
            for (int k = 0; k < sr->cols; k++) {
                if (!isfinite(b[k]))
                    continue;
                scale = fabs((double)b[k]) > scale ? fabs((double)b[k]) : scale;
                if (!isfinite(a[k])) {
                    char where[64];
                    noise_where(sr, where, sizeof where);
                    return kv_errf(e, "%s has %g where %s has %g (%s, position %lld): a "
                                   "non-finite value is no drift, so it cannot set a noise "
                                   "floor", nz->label, a[k], w->ref->label, b[k], where,
                                   (long long)(q + r));
                }
                const double d = fabs((double)a[k] - (double)b[k]);
                dmax = d > dmax ? d : dmax;
            }
            if (dmax > sr->noise_abs)
                sr->noise_abs = dmax;
            if (scale > 0 && dmax / scale > sr->noise_rel)
                sr->noise_rel = dmax / scale;
        }
    }
    return 0;
}

/* Where a slot lies in dataflow order, coarsely: 0 the embedding, l + 1
 * layer l, L + 1 what follows the last layer. */
static int noise_group(const cmp_stage_result *sr, int L)
{
    if (sr->layer >= 0)
        return sr->layer + 1;
    return sr->stage == STAGE_EMBED ? 0 : L + 1;
}

/* From the samples, the floor of every slot (row-relative):
 *   - drift is born at the first slot, in dataflow order, where the noise
 *     run differs from the reference; slots before it stay exact (nothing
 *     upstream of them moved, so neither may the test);
 *   - from there on the floor of (l, s) is the largest sample of every
 *     slot from the birth through layer l + 1: drift in layer l feeds
 *     layer l + 1 and does not vanish, so a slot the noise run happened to
 *     reproduce exactly (or does not hold) takes its neighbours' level,
 *     and pooling a layer's stages with the next's smooths one sample;
 *     what follows the last layer pools everything;
 *   - key counts are integers drift cannot move: exact, always. */
static void noise_model(walker *w)
{
    const int L = w->ref->cfg.n_layers;
    int birth = -1;
    for (int i = 0; i < w->n && birth < 0; i++)
        if (w->slots[i].res->stage != STAGE_ATTN_NKEYS && w->slots[i].res->noise_rel > 0)
            birth = i;
    if (birth < 0)
        return;
    double run = 0;   /* the largest sample from the birth through slot j */
    int j = birth;
    for (int i = birth; i < w->n; i++) {
        cmp_stage_result *sr = w->slots[i].res;
        const int reach = noise_group(sr, L) + 1;
        for (; j < w->n && noise_group(w->slots[j].res, L) <= reach; j++)
            if (w->slots[j].res->stage != STAGE_ATTN_NKEYS && w->slots[j].res->noise_rel > run)
                run = w->slots[j].res->noise_rel;
        if (sr->stage != STAGE_ATTN_NKEYS)
            sr->noise_floor = run;
    }
}

/* Refuses a noise recording that shows no drift (a floor of 0 everywhere
 * would flag every rounding difference while claiming to allow them: the
 * noise run did not exercise the reordering, e.g. one chunk held the whole
 * context); notes what the floor could not model. */
static int noise_check(walker *w, kv_err *e)
{
    int lacked = 0, worst = -1;
    double abs_max = 0;
    for (int i = 0; i < w->n; i++) {
        const cmp_stage_result *sr = w->slots[i].res;
        lacked += !sr->noise_held;
        abs_max = sr->noise_abs > abs_max ? sr->noise_abs : abs_max;
        if (worst < 0 || sr->noise_rel > w->slots[worst].res->noise_rel)
            worst = i;
    }
    const cmp_stage_result *ws = w->slots[worst].res;
    if (ws->noise_rel == 0)
        return kv_errf(e, "%s %s at every stage and position both hold: it shows no drift, so "
                       "it cannot set a noise floor (record it so that it reorders: cascade "
                       "attention with a chunk smaller than the context)", w->o->noise->label,
                       abs_max == 0 ? "equals the reference"
                                    : "differs from the reference only in rows of zeros");
    if (ws->noise_rel > CMP_DRIFT_BOUND) {
        char where[64];
        noise_where(ws, where, sizeof where);
        cmp_note(w->r, "the noise recording differs from the reference by up to %.3g "
                 "row-relative (%s), more than rounding drift (%g): a difference that size in "
                 "the test passes the floor, and a smaller bug is located where it has grown "
                 "past it; for another precision or runtime drop --noise-floor and let the "
                 "cross-runtime model judge (docs/cross-runtime.md)", ws->noise_rel, where,
                 CMP_DRIFT_BOUND);
    }
    if (lacked)
        cmp_note(w->r, "the noise recording lacks %d of the compared (layer, stage) pairs: "
                 "their floor comes from their neighbours (none before its first drifting "
                 "stage)", lacked);
    return 0;
}

static int noise_floor(walker *w, kv_err *e)
{
    const cmp_source *nz = w->o->noise;
    int64_t cut = -1;
    if (check_token_list(nz, e) < 0 ||
        check_models(w->ref, nz, "noise floor", w->o->force, w->r, e) < 0 ||
        check_prompts(w->ref, nz, w->o->force, w->r, &cut, e) < 0)
        return -1;
    if (!nz->read || !w->ref->read)
        return kv_errf(e, "the noise floor needs full rows, not fingerprints");
    for (int i = 0; i < w->n; i++)
        if (noise_measure(w, w->slots[i].res, cut, e) < 0)
            return -1;
    noise_model(w);
    return noise_check(w, e);
}

static void set_tolerances(walker *w)
{
    const cmp_opts *o = w->o;
    for (int i = 0; i < w->n; i++) {
        walk_slot *s = &w->slots[i];
        s->res->atol_eff = o->atol;
        s->res->rtol_eff = o->rtol + (o->noise ? o->noise_factor * s->res->noise_floor : 0);
        s->tol.atol = s->res->atol_eff;
        s->tol.rtol = s->res->rtol_eff;
        s->tol.ulp = o->ulp;
        s->tol.exact = s->tol.atol == 0 && s->tol.rtol == 0 && s->tol.ulp == 0;
    }
}

/* ------------------------------------------------------------------ */
/* The walk                                                             */

typedef struct {
    int64_t pos;                 /* -1 none yet */
    int slot;
} first_bad;

static bool earlier(int64_t p, int slot, const first_bad *f)
{
    return f->pos < 0 || p < f->pos || (p == f->pos && slot < f->slot);
}

/* Compares one slot over positions [p0, p1] into the block's records. */
/* Larger than rounding drift: a non-finite, a row-relative error above the
 * drift bound, or a key count that moved. */
static bool is_large(const cmp_rowrec *rec, kv_stage st)
{
    return rec->bad && (rec->nonfinite > 0 || cmp_rowrec_rel(rec) > CMP_DRIFT_BOUND ||
                        st == STAGE_ATTN_NKEYS);
}

/* Positions a slot's span holds: HASH_SPAN, or a whole block if larger. */
static int64_t span_cap(const walker *w)
{
    return w->B > HASH_SPAN ? w->B : HASH_SPAN;
}

/* Loads hashes and statistics of positions q .. q + len - 1 (len at most
 * span_cap) into the slot's span. 1: not every row there has a hash. */
static int load_span(walker *w, walk_slot *s, int64_t q, int64_t len, kv_err *e)
{
    const cmp_stage_result *sr = s->res;
    const size_t cap = (size_t)span_cap(w);
    s->span_n = 0;
    if (!s->ha && (!(s->ha = malloc(cap * sizeof *s->ha)) ||
                   !(s->hb = malloc(cap * sizeof *s->hb)) ||
                   !(s->sb = malloc(2 * cap * sizeof *s->sb))))
        return kv_errf(e, "compare: out of memory for row hashes");
    int rc = w->test->read_hash(w->test->ctx, sr->layer, sr->stage, q, len, s->ha, e);
    if (rc == 0)
        rc = w->ref->read_hash(w->ref->ctx, sr->layer, sr->stage, q, len, s->hb, e);
    if (rc == 0)
        rc = w->ref->read_stats(w->ref->ctx, sr->layer, sr->stage, q, len, s->sb, e);
    if (rc != 0)
        return rc < 0 ? -1 : 1;
    s->span_lo = q;
    s->span_n = len;
    return 0;
}

/* Rows q .. q + n - 1 (n at most a block) of a slot whose sides both hash
 * every row: when every hash agrees and the reference's statistics are
 * finite, the rows are bit-equal and their records come from the
 * statistics, without reading a row. Returns 1 when done so, 0 when the
 * rows must be read, -1 on error. */
static int rows_by_hash(walker *w, int i, int64_t b0, int64_t q, int64_t n, kv_err *e)
{
    walk_slot *s = &w->slots[i];
    cmp_stage_result *sr = s->res;
    if (q < s->span_lo || q + n > s->span_lo + s->span_n) {
        const int64_t cap = span_cap(w);
        int64_t len = sr->pos_hi - q + 1 < cap ? sr->pos_hi - q + 1 : cap;
        int rc = load_span(w, s, q, len, e);
        if (rc > 0 && len > n)   /* hashes may stop short of the rows: just this block */
            rc = load_span(w, s, q, n, e);
        if (rc != 0)
            return rc < 0 ? -1 : 0;
    }
    const int64_t off = q - s->span_lo;
    const float *st = s->sb + 2 * off;
    if (memcmp(s->ha + off, s->hb + off, (size_t)n * sizeof(uint64_t)) != 0)
        return 0;
    for (int64_t r = 0; r < n; r++)
        if (!isfinite(st[2 * r]) || !isfinite(st[2 * r + 1]))
            return 0;
    for (int64_t r = 0; r < n; r++) {
        cmp_rowrec *rec = &w->recs[(size_t)i * w->B + (size_t)(q + r - b0)];
        memset(rec, 0, sizeof *rec);
        rec->first_bad = -1;
        rec->bitequal = true;
        rec->ref_absmax = st[2 * r + 1];
        const double l2 = st[2 * r];
        rec->dot = rec->ref_sq = rec->test_sq = l2 * l2;
        w->have[(size_t)i * w->B + (size_t)(q + r - b0)] = 1;
    }
    sr->rows_by_hash += n;
    return 1;
}

/* Rows of one read, weighed by the pool: each task owns its rows' records
 * (a row's record depends on that row alone, so the split changes nothing). */
typedef struct {
    const walker *w;
    const walk_slot *s;
    cmp_rowrec *recs;            /* the read's first record */
    int64_t n;
    int tasks;
} rows_job;

static void rows_task(void *ctx, int task)
{
    const rows_job *j = ctx;
    const int cols = j->s->cols;
    const int64_t lo = j->n * task / j->tasks, hi = j->n * (task + 1) / j->tasks;
    for (int64_t r = lo; r < hi; r++)
        cmp_row_compare(j->w->bufa + (size_t)r * cols, j->w->bufb + (size_t)r * cols, cols,
                        &j->s->tol, &j->recs[r]);
}

/* After a read: the rows' presence, and the first violation and first
 * large difference so far. */
static void note_rows(walker *w, int i, int64_t b0, int64_t q, int64_t n, first_bad *f,
                      first_bad *lg)
{
    const kv_stage st = w->slots[i].res->stage;
    for (int64_t p = q; p < q + n; p++) {
        const size_t k = (size_t)i * w->B + (size_t)(p - b0);
        const cmp_rowrec *rec = &w->recs[k];
        w->have[k] = 1;
        if (rec->bad && earlier(p, i, f))
            *f = (first_bad){p, i};
        if (is_large(rec, st) && earlier(p, i, lg))
            *lg = (first_bad){p, i};
    }
}

/* Can both sides read the slot's rows from several threads? Asked once,
 * when its rows are first needed (a walk settled by hashes never asks). */
static bool parallel_slot(walker *w, walk_slot *s)
{
    if (s->parallel < 0) {
        const cmp_stage_result *sr = s->res;
        s->parallel = w->tasks > 1 && !sr->hashed && w->ref->prepare_parallel &&
                      w->test->prepare_parallel && w->ref->read_parallel &&
                      w->test->read_parallel &&
                      w->test->prepare_parallel(w->test->ctx, sr->layer, sr->stage) == 1 &&
                      w->ref->prepare_parallel(w->ref->ctx, sr->layer, sr->stage) == 1;
    }
    return s->parallel == 1;
}

/* Reads and weighs the rows of one slot read here (rows split over the
 * pool when there are enough). */
static int read_weigh_serial(walker *w, int i, int64_t b0, int64_t q, int64_t n, kv_err *e)
{
    walk_slot *s = &w->slots[i];
    const cmp_stage_result *sr = s->res;
    if (read_side(w->test, sr, q, n, w->bufa, w->hasha, e) < 0 ||
        read_side(w->ref, sr, q, n, w->bufb, w->hashb, e) < 0)
        return -1;
    cmp_rowrec *first = &w->recs[(size_t)i * w->B + (size_t)(q - b0)];
    if (sr->hashed) {
        for (int64_t r = 0; r < n; r++)
            cmp_row_hashed(w->hasha[r] == w->hashb[r], first + r);
        return 0;
    }
    /* Small reads are not worth waking a thread for. */
    int tasks = w->tasks;
    if ((int64_t)s->cols * n < 4096 || n < tasks)
        tasks = 1;
    rows_job job = {w, s, first, n, tasks};
    if (tasks > 1)
        pool_run(w->pool, rows_task, &job, tasks);
    else
        rows_task(&job, 0);
    return 0;
}

/* A block on the pool. Task 0 goes through the slots (hashes first; then,
 * for each read still needed, a job posted for any task, or one listed to
 * be read afterwards through the source's own reader), touching libhdf5
 * alone; meanwhile the other tasks already take the posted jobs, and task
 * 0 joins them when it is through. A job is read into its task's buffers
 * (no libhdf5 call) and weighed there. */
typedef struct {
    walker *w;
    int64_t b0, b1;
    atomic_int next;             /* the next job to take */
    atomic_int posted;           /* jobs posted so far */
    atomic_bool closed;          /* task 0 posts no more */
    int rc;                      /* task 0's own work */
    kv_err err;
} block_run;

static void do_job(walker *w, int64_t b0, read_job *j, int task)
{
    float *ta = w->tbuf[2 * task], *rb = w->tbuf[2 * task + 1];
    const walk_slot *s = &w->slots[j->slot];
    const cmp_stage_result *sr = s->res;
    j->rc = w->test->read_parallel(w->test->ctx, sr->layer, sr->stage, j->q, j->n, ta, &j->err);
    if (j->rc == 0)
        j->rc = w->ref->read_parallel(w->ref->ctx, sr->layer, sr->stage, j->q, j->n, rb,
                                      &j->err);
    if (j->rc < 0)
        return;
    cmp_rowrec *first = &w->recs[(size_t)j->slot * w->B + (size_t)(j->q - b0)];
    for (int64_t r = 0; r < j->n; r++)
        cmp_row_compare(ta + (size_t)r * s->cols, rb + (size_t)r * s->cols, s->cols, &s->tol,
                        first + r);
}

static void take_jobs(block_run *br, int task)
{
    int idle = 0;
    for (;;) {
        int k = atomic_load_explicit(&br->next, memory_order_relaxed);
        if (k >= atomic_load_explicit(&br->posted, memory_order_acquire)) {
            if (atomic_load_explicit(&br->closed, memory_order_acquire) &&
                k >= atomic_load_explicit(&br->posted, memory_order_acquire))
                return;
            /* Task 0 is still reading hashes or mapping datasets (the first
             * block can take a while): yield, then sleep a little, rather
             * than burn a core another process may want. */
            if (idle++ < 64) {
                sched_yield();
            } else {
                struct timespec ts = {0, 50000};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        idle = 0;
        if (atomic_compare_exchange_weak_explicit(&br->next, &k, k + 1, memory_order_relaxed,
                                                  memory_order_relaxed))
            do_job(br->w, br->b0, &br->w->jobs[k], task);
    }
}

/* Task 0's pass over the slots (see block_run). */
static int post_block(block_run *br)
{
    walker *w = br->w;
    for (int i = 0; i < w->n; i++) {
        walk_slot *s = &w->slots[i];
        const cmp_stage_result *sr = s->res;
        const int64_t p0 = sr->pos_lo > br->b0 ? sr->pos_lo : br->b0;
        const int64_t p1 = sr->pos_hi < br->b1 ? sr->pos_hi : br->b1;
        const int step = rows_per_read(w, s->cols);
        for (int64_t q = p0; q <= p1; q += step) {
            const int64_t n = p1 - q + 1 < step ? p1 - q + 1 : step;
            if (s->prehash) {
                int h = rows_by_hash(w, i, br->b0, q, n, &br->err);
                if (h < 0)
                    return -1;
                if (h > 0)
                    continue;
                /* Hashes that differ here mostly differ further on (drift
                 * reaches every later row): this slot's rows are read from
                 * now on, without reading their hashes first. */
                s->prehash = false;
            }
            const read_job j = {.slot = i, .q = q, .n = n};
            if (parallel_slot(w, s)) {
                const int k = atomic_load_explicit(&br->posted, memory_order_relaxed);
                w->jobs[k] = j;
                atomic_store_explicit(&br->posted, k + 1, memory_order_release);
            } else {
                w->later[w->n_later++] = j;
            }
        }
    }
    return 0;
}

static void block_task(void *ctx, int task)
{
    block_run *br = ctx;
    if (task == 0) {
        br->rc = post_block(br);
        atomic_store_explicit(&br->closed, true, memory_order_release);
    }
    take_jobs(br, task);
}

/* Compares every slot over the block's positions: hashes first where both
 * sides have them, then the rows still needed, read on the pool where both
 * sources allow it and through their own readers otherwise. */
static int walk_block(walker *w, int64_t b0, int64_t b1, first_bad *f, first_bad *lg,
                      kv_err *e)
{
    memset(w->have, 0, (size_t)w->n * (size_t)w->B);
    w->n_later = 0;
    block_run br = {.w = w, .b0 = b0, .b1 = b1};
    atomic_init(&br.next, 0);
    atomic_init(&br.posted, 0);
    atomic_init(&br.closed, false);
    pool_run(w->pool, block_task, &br, w->tasks);
    const int posted = atomic_load(&br.posted);
    if (br.rc < 0) {
        *e = br.err;
        return -1;
    }
    for (int k = 0; k < posted; k++) {
        const read_job *j = &w->jobs[k];
        if (j->rc < 0) {
            *e = j->err;
            return -1;
        }
        note_rows(w, j->slot, b0, j->q, j->n, f, lg);
    }
    for (int k = 0; k < w->n_later; k++) {
        const read_job *j = &w->later[k];
        if (read_weigh_serial(w, j->slot, b0, j->q, j->n, e) < 0)
            return -1;
        note_rows(w, j->slot, b0, j->q, j->n, f, lg);
    }
    return 0;
}

/* Rows of the block go to `all`; to `upto` only before the divergence. */
static void merge_block(walker *w, int64_t b0, int64_t b1, const first_bad *f)
{
    for (int i = 0; i < w->n; i++)
        for (int64_t p = b0; p <= b1; p++) {
            size_t k = (size_t)i * w->B + (size_t)(p - b0);
            if (!w->have[k])
                continue;
            cmp_stage_result *sr = w->slots[i].res;
            cmp_stats_add(&sr->all, &w->recs[k], p);
            if (f->pos < 0 || p < f->pos || (p == f->pos && i < f->slot))
                cmp_stats_add(&sr->upto, &w->recs[k], p);
        }
}

/* Fills d from the divergent row (read again: buffers were reused). */
static int fill_divergence(walker *w, const first_bad *f, int64_t b0, cmp_divergence *d,
                           kv_err *e)
{
    walk_slot *s = &w->slots[f->slot];
    const cmp_stage_result *sr = s->res;
    const cmp_rowrec *rec = &w->recs[(size_t)f->slot * w->B + (size_t)(f->pos - b0)];
    const kv_config *c = &w->ref->cfg;
    memset(d, 0, sizeof *d);
    d->found = true;
    d->pos = f->pos;
    d->layer = sr->layer;
    d->stage = sr->stage;
    d->hashed = sr->hashed;
    d->col = d->head = d->dim = -1;
    d->n_bad = rec->n_bad;
    d->row_max_abs = rec->max_abs;
    d->row_rel = cmp_rowrec_rel(rec);
    if (sr->layer >= 0) {
        d->layer_window = config_layer_window(c, sr->layer);
        d->layer_sliding = d->layer_window > 0;
        d->kv_owner = c->kv_owner[sr->layer];
    }
    if (sr->hashed)
        return 0;
    if (w->test->read(w->test->ctx, sr->layer, sr->stage, f->pos, 1, w->bufa, e) < 0 ||
        w->ref->read(w->ref->ctx, sr->layer, sr->stage, f->pos, 1, w->bufb, e) < 0)
        return -1;
    const int col = rec->first_bad;
    cmp_set_element(d, c, col);
    d->test = w->bufa[col];
    d->ref = w->bufb[col];
    d->nonfinite = cmp_elem_nonfinite_mismatch(d->test, d->ref);
    d->abs_err = d->nonfinite ? NAN : fabs((double)d->test - (double)d->ref);
    d->ulp = d->nonfinite ? 0 : cmp_ulp_distance(d->test, d->ref);
    if (!d->nonfinite)
        for (int k = 0; k < s->cols; k++)
            d->nonfinite |= cmp_elem_nonfinite_mismatch(w->bufa[k], w->bufb[k]);
    return 0;
}

/* Evidence of identity at the divergent position: earlier stages of its
 * layer, read from the block's records before they are overwritten. */
static void earlier_stages(walker *w, const first_bad *f, int64_t b0, cmp_evidence *ev)
{
    const int layer = w->slots[f->slot].res->layer;
    if (layer < 0)
        return;
    for (int i = 0; i < f->slot; i++) {
        const cmp_stage_result *sr = w->slots[i].res;
        size_t k = (size_t)i * w->B + (size_t)(f->pos - b0);
        if (sr->layer != layer || !w->have[k])
            continue;
        ev->earlier_compared |= 1u << sr->stage;
        if (w->recs[k].bitequal)
            ev->earlier_identical |= 1u << sr->stage;
    }
}

/* A first divergence that may be rounding drift: the walk goes on to the
 * first difference larger than drift, so a bug behind it is not missed. */
static bool tiny(const cmp_divergence *d)
{
    return d->found && !d->hashed && !d->nonfinite && d->row_rel <= CMP_DRIFT_REL;
}

/* Records what this block found first: the first divergence, and the
 * first difference larger than drift when it is another row. */
static int record_block(walker *w, int64_t b0, const first_bad *f, bool had_f,
                        const first_bad *lg, bool had_lg, kv_err *e)
{
    cmp_result *r = w->r;
    if (f->pos >= 0 && !had_f) {
        if (fill_divergence(w, f, b0, &r->first, e) < 0)
            return -1;
        earlier_stages(w, f, b0, &r->ev);
    }
    if (lg->pos >= 0 && !had_lg && (lg->pos != f->pos || lg->slot != f->slot) &&
        tiny(&r->first)) {
        if (fill_divergence(w, lg, b0, &r->beyond, e) < 0)
            return -1;
        earlier_stages(w, lg, b0, &r->beyond_ev);
    }
    return 0;
}

static int walk(walker *w, kv_err *e)
{
    cmp_coverage *cv = &w->r->compared;
    first_bad f = {-1, 0}, lg = {-1, 0};
    cv->walked_to = -1;
    for (int64_t b0 = cv->pos_lo; b0 <= cv->pos_hi; b0 += w->B) {
        const int64_t b1 = b0 + w->B - 1 < cv->pos_hi ? b0 + w->B - 1 : cv->pos_hi;
        const bool had_f = f.pos >= 0, had_lg = lg.pos >= 0;
        if (walk_block(w, b0, b1, &f, &lg, e) < 0)
            return -1;
        merge_block(w, b0, b1, &f);
        cv->walked_to = b1;
        if (w->o->progress)
            w->o->progress(w->o->progress_ctx, b1, cv->pos_hi);
        if (record_block(w, b0, &f, had_f, &lg, had_lg, e) < 0)
            return -1;
        if (f.pos >= 0 && !w->o->full && (!tiny(&w->r->first) || lg.pos >= 0))
            break;
    }
    return 0;
}

/* Do both sides give equal digests of every stage either records (as
 * recorded, or checked against the hashes as they are)? */
static bool digests_match(const walker *w, bool checked)
{
    const cmp_source *ref = w->ref, *test = w->test;
    if (w->o->no_hashes || !ref->digest || !test->digest)
        return false;
    const int L = ref->cfg.n_layers < test->cfg.n_layers ? ref->cfg.n_layers : test->cfg.n_layers;
    int layers[KV_MAX_LAYERS * STAGE_LAYER_COUNT + 3];
    kv_stage stages[KV_MAX_LAYERS * STAGE_LAYER_COUNT + 3];
    const int n = order_pairs(L, layers, stages);
    for (int i = 0; i < n; i++) {
        cmp_digest a, b;
        const int ha = ref->digest(ref->ctx, layers[i], stages[i], checked, &a) == 0;
        const int hb = test->digest(test->ctx, layers[i], stages[i], checked, &b) == 0;
        if (ha != hb)
            return false;
        if (ha && (!a.usable || !b.usable || a.first_pos != b.first_pos || a.rows != b.rows ||
                   a.cols != b.cols || a.digest[0] != b.digest[0] || a.digest[1] != b.digest[1]))
            return false;
    }
    return true;
}

/* Before the slots: do both sides' digests, as recorded, agree on every
 * stage either records? Only then are they checked against the hashes
 * (reading every hash once), so a pair that differs anywhere costs nothing
 * here. */
static bool digests_agree(const walker *w)
{
    return digests_match(w, false) && digests_match(w, true);
}

/* Tells both sources at once what the compare will ask of each stage, so
 * that a pair of dumps is readied in parallel: always the shapes; then
 * either the digest checks that may settle the compare (when the digests
 * as recorded agree), or the rows' chunk maps (under a tolerance, or
 * without hashes) and those of the hashes read ahead of the rows (exact
 * mode; under a tolerance only where the digests as recorded are equal,
 * as skip_hashes_of_differing decides). */
static void prefetch(const walker *w)
{
    const cmp_source *ref = w->ref, *test = w->test;
    if (!ref->prefetch || ref->prefetch != test->prefetch)
        return;
    const int L = ref->cfg.n_layers < test->cfg.n_layers ? ref->cfg.n_layers : test->cfg.n_layers;
    int layers[KV_MAX_LAYERS * STAGE_LAYER_COUNT + 3];
    kv_stage stages[KV_MAX_LAYERS * STAGE_LAYER_COUNT + 3];
    const int n = order_pairs(L, layers, stages);
    cmp_prefetch_item *items = malloc((size_t)n * sizeof *items);
    if (!items)
        return;   /* read as met */
    const bool same = digests_match(w, false);
    const bool rows = ref->read && test->read;
    const bool hashes = !w->o->no_hashes && ref->read_hash && test->read_hash &&
                        (!rows || ref->read_stats);
    for (int i = 0; i < n; i++) {
        unsigned what = CMP_PREFETCH_INFO, stats = 0;
        cmp_digest a, b;
        const bool known = ref->digest && test->digest &&
                           ref->digest(ref->ctx, layers[i], stages[i], false, &a) == 0 &&
                           test->digest(test->ctx, layers[i], stages[i], false, &b) == 0;
        const bool differ = known && (a.digest[0] != b.digest[0] || a.digest[1] != b.digest[1]);
        const bool exact = w->r->exact;
        if (same) {
            /* and the maps the hash check's sample reads through (hashcheck.c) */
            what |= CMP_PREFETCH_DIGEST;
            if (rows && hashes)
                what |= CMP_PREFETCH_ROWS | CMP_PREFETCH_HASHES;
        } else {
            /* hashes are read first in exact mode, and under a tolerance
             * unless the digests say they differ; rows where there are no
             * hashes, or under a tolerance unless the digests are equal
             * (drift reaches nearly every row) */
            if (hashes && (exact || !differ)) {
                what |= CMP_PREFETCH_HASH_INFO | CMP_PREFETCH_HASHES;
                stats = rows ? CMP_PREFETCH_STATS : 0;   /* the reference's (load_span) */
            }
            if (rows && (!hashes || (!exact && (differ || !known))))
                what |= CMP_PREFETCH_ROWS;
        }
        items[i] = (cmp_prefetch_item){.layer = layers[i], .stage = stages[i],
                                       .what = {what | stats, what}};
    }
    ref->prefetch(ref->ctx, test->ctx, items, n);
    free(items);
}

/* Identical recordings settled from their digests alone: when both sides
 * give a usable digest of every compared slot, over exactly its compared
 * positions (as the row datasets give them: rows beyond the hashes would
 * not be settled) and width, and the digests agree, every row is
 * bit-equal and its record
 * is the one the hash walk makes (statistics from the reference), so the
 * per-stage figures come out the same without reading a hash. Anything
 * else (a digest missing or differing, positions cut) walks as usual. */
/* Under a tolerance, a stage whose digests (as recorded) differ is read
 * without its hashes: its rows differ somewhere, and drift, the usual
 * reason, reaches nearly every row, so the hashes would be read for
 * nothing. Exact mode keeps them: a bug leaves the rows before it equal. */
static void skip_hashes_of_differing(walker *w)
{
    if (!w->ref->digest || !w->test->digest)
        return;
    for (int i = 0; i < w->n; i++) {
        walk_slot *s = &w->slots[i];
        cmp_digest a, b;
        if (s->tol.exact || !s->prehash ||
            w->ref->digest(w->ref->ctx, s->res->layer, s->res->stage, false, &a) != 0 ||
            w->test->digest(w->test->ctx, s->res->layer, s->res->stage, false, &b) != 0)
            continue;
        if (a.digest[0] != b.digest[0] || a.digest[1] != b.digest[1])
            s->prehash = false;
    }
}

static bool settle_by_digest(walker *w)
{
    if (!w->ref->digest || !w->test->digest)
        return false;
    for (int i = 0; i < w->n; i++) {
        const walk_slot *s = &w->slots[i];
        const cmp_stage_result *sr = s->res;
        cmp_digest a, b;
        if (!s->prehash || w->ref->digest(w->ref->ctx, sr->layer, sr->stage, true, &a) != 0 ||
            w->test->digest(w->test->ctx, sr->layer, sr->stage, true, &b) != 0 || !a.usable ||
            !b.usable || a.first_pos != sr->pos_lo || b.first_pos != sr->pos_lo ||
            a.rows != sr->pos_hi - sr->pos_lo + 1 || b.rows != a.rows || a.cols != sr->cols ||
            b.cols != sr->cols ||
            a.digest[0] != b.digest[0] || a.digest[1] != b.digest[1])
            return false;
    }
    for (int i = 0; i < w->n; i++) {
        cmp_stage_result *sr = w->slots[i].res;
        cmp_digest a;
        w->ref->digest(w->ref->ctx, sr->layer, sr->stage, true, &a);
        cmp_stats *st = &sr->all;
        st->rows = st->bitequal_rows = a.rows;
        st->dot = st->ref_sq = st->test_sq = a.sum_sq;
        sr->upto = sr->all;
        sr->rows_by_hash = a.rows;
    }
    cmp_coverage *cv = &w->r->compared;
    cv->walked_to = cv->pos_hi;
    cv->by_index = true;
    if (w->o->progress)
        w->o->progress(w->o->progress_ctx, cv->pos_hi, cv->pos_hi);
    return true;
}

/* ------------------------------------------------------------------ */
/* Verdict and entry point                                              */

/* "partial: interrupted by SIGTERM" of a side, or "partial" when it says nothing. */
static const char *partial_words(const cmp_source *s)
{
    return s->status && !strncmp(s->status, "partial", 7) ? s->status : "partial";
}

/* A side that stopped early explains a shorter token list; a complete
 * side that generated fewer tokens than the other does not. */
static bool shorter_side_partial(const cmp_source *ref, const cmp_source *test)
{
    const cmp_source *shorter = ref->n_tokens < test->n_tokens ? ref : test;
    return !shorter->complete;
}

static void set_incomplete(cmp_result *r, const cmp_source *ref, const cmp_source *test)
{
    if (ref->complete && test->complete)
        return;
    r->incomplete = true;
    if (!ref->complete && !test->complete)
        snprintf(r->incomplete_why, sizeof r->incomplete_why, "both partial (%s: %s; %s: %s)",
                 ref->label, partial_words(ref), test->label, partial_words(test));
    else
        snprintf(r->incomplete_why, sizeof r->incomplete_why, "%s is %s",
                 ref->complete ? test->label : ref->label,
                 partial_words(ref->complete ? test : ref));
}

/* Diverged: a stage, a token, or the token count of two whole runs
 * differs, or the recordings' own configs differ in what attention reads. Otherwise identical or within tolerance, and incomplete when a
 * side is partial (the verdict covers only what both hold). */
static void set_verdict(cmp_result *r, const cmp_source *ref, const cmp_source *test)
{
    bool bitequal = true;
    for (int i = 0; i < r->n_stages; i++)
        bitequal &= r->stages[i].all.bitequal_rows == r->stages[i].all.rows;
    bitequal &= !r->xrt.output_drift;   /* across runtimes /output is walked too */
    const bool count_differs = r->tokens.kind == CMP_TOKENS_LENGTH &&
                               !shorter_side_partial(ref, test);
    const bool flip = r->tokens.kind == CMP_TOKENS_DIFFER && !r->tokens.flip_drift;
    if (r->first.found || flip || count_differs ||
        r->tokens.self_pos[1] >= 0 || r->config_diff[0]) {
        r->verdict = CMP_DIVERGED;
        return;
    }
    r->verdict = bitequal ? CMP_IDENTICAL : CMP_WITHIN_TOLERANCE;
    set_incomplete(r, ref, test);
}

static void set_mode(cmp_result *r, const cmp_opts *o)
{
    r->atol = o->atol;
    r->rtol = o->rtol;
    r->ulp = o->ulp;
    r->noise = o->noise != NULL;
    r->noise_factor = o->noise_factor;
    r->exact = o->atol == 0 && o->rtol == 0 && o->ulp == 0 && !o->noise;
}

static int check_options(const cmp_source *ref, const cmp_source *test, const cmp_opts *o,
                         kv_err *e)
{
    if (!ref || !test || !ref->info || !test->info)
        return kv_errf(e, "compare: a source without an info callback");
    if ((!ref->read && !ref->read_hash) || (!test->read && !test->read_hash))
        return kv_errf(e, "compare: a source with neither rows nor hashes");
    if (o->atol < 0 || o->rtol < 0 || !isfinite(o->atol) || !isfinite(o->rtol) ||
        o->noise_factor < 0 || !isfinite(o->noise_factor))
        return kv_errf(e, "compare: tolerances must be finite and >= 0");
    bool fp = !ref->read || !test->read;
    if (fp && o->cross_runtime == CMP_XRT_ON)
        return kv_errf(e, "compare: %s holds fingerprints only: a cross-runtime compare needs "
                       "rows", !ref->read ? ref->label : test->label);
    if (o->cross_runtime == CMP_XRT_ON && (o->atol > 0 || o->rtol > 0 || o->ulp > 0 || o->noise))
        return kv_errf(e, "compare: the cross-runtime model sets its own thresholds: not with "
                       "a tolerance or noise floor");
    if (fp && (o->atol > 0 || o->rtol > 0 || o->ulp > 0 || o->noise))
        return kv_errf(e, "compare: %s holds fingerprints only: hashes compare exactly, "
                       "without a tolerance or noise floor", !ref->read ? ref->label
                                                                        : test->label);
    return 0;
}

static int compare_run(walker *w, cmp_ctx *c, kv_err *e)
{
    cmp_result *r = w->r;
    const bool same = digests_agree(w);
    if (build_slots(w, e) < 0)
        return -1;
    if (w->n == 0)
        return kv_errf(e, "%s and %s hold no (layer, stage, position) in common: nothing to "
                       "compare", w->ref->label, w->test->label);
    if (alloc_buffers(w, e) < 0)
        return -1;
    if (w->o->noise && noise_floor(w, e) < 0)
        return -1;
    set_tolerances(w);
    cmp_roles_swapped(w->ref, w->test, r->swapped, sizeof r->swapped);
    /* Another runtime's rows: judged by its drift model (crossrt.c), not
     * by the element rule, and never settled by hashes or digests. */
    if (cmp_xrt_wanted(w->ref, w->test, w->o, r->xrt.why, sizeof r->xrt.why)) {
        r->exact = false;
        if (cmp_xrt_walk(c, e) < 0)
            return -1;
    } else {
        const bool settled = same && settle_by_digest(w);
        if (!settled)
            skip_hashes_of_differing(w);
        if (!settled && walk(w, e) < 0)
            return -1;
        /* /output holds no digest or hash: read it whatever settled the
         * rows. Bit for bit in exact mode; a tolerance leaves it alone. */
        if (r->exact && cmp_output_exact(c, e) < 0)
            return -1;
    }
    if (cmp_tokens_compare(c, e) < 0 || cmp_logit_stats_compute(c, e) < 0)
        return -1;
    struct timespec d0, d1;
    clock_gettime(CLOCK_MONOTONIC, &d0);
    if (r->first.found && cmp_diagnose(c, e) < 0)
        return -1;
    clock_gettime(CLOCK_MONOTONIC, &d1);
    /* For bench/diag_cost.sh: what the diagnosis adds to a compare. */
    if (r->first.found && getenv("KVDIFF_DIAG_TIME"))
        fprintf(stderr, "diagnosis: %.3f s\n",
                (double)(d1.tv_sec - d0.tv_sec) + 1e-9 * (double)(d1.tv_nsec - d0.tv_nsec));
    const bool past_routing = r->compared.routing_flip >= 0 &&
                              r->tokens.pos > r->compared.routing_flip;
    if (!r->first.found && r->tokens.kind == CMP_TOKENS_DIFFER && !r->tokens.flip_drift &&
        past_routing) {
        /* Nothing from the routing flip on was compared: the token is not
         * evidence either way, and this pair cannot settle it. */
        r->diag.kind = CMP_DIAG_UNCLASSIFIED;
        snprintf(r->diag.summary, sizeof r->diag.summary, "not decided: the comparison stops "
                 "at a routing flip before the tokens differ");
        snprintf(r->diag.detail, sizeof r->diag.detail, "(the test's router took another "
                 "expert at a near tie at position %lld, layer %d, a rounding flip, and no "
                 "position from there on is compared; the tokens differ at %lld, past it. "
                 "Whether a bug lies after the flip this pair cannot say: re-run the reference "
                 "on the test's tokens and routing, kvdiff run --model MODEL --follow TEST.h5 "
                 "--dump FOLLOWED.h5, and compare FOLLOWED.h5 with the test; kvdiff suite does "
                 "so by itself)", (long long)r->compared.routing_flip,
                 r->compared.routing_flip_layer, (long long)r->tokens.pos);
    } else if (!r->first.found && r->tokens.kind == CMP_TOKENS_DIFFER &&
               !r->tokens.flip_drift) {
        r->diag.kind = CMP_DIAG_UNCLASSIFIED;
        snprintf(r->diag.summary, sizeof r->diag.summary, "cause not identified");
        if (r->xrt.on)   /* the stages do differ there: within the drift model */
            snprintf(r->diag.detail, sizeof r->diag.detail, "(the tokens differ at position "
                     "%lld but no recorded stage steps above drift before it, and neither the "
                     "logit error this pair shows there (%.3g; NaN: /output not recorded on both "
                     "sides) nor the test's own logits explain the flip (the reference's top-2 "
                     "margin %.3g): a bug smaller "
                     "than this runtime's rounding, or a stage not recorded; record /output and "
                     "every stage)", (long long)r->tokens.pos, r->tokens.logit_err,
                     r->tokens.ref_margin);
        else
            snprintf(r->diag.detail, sizeof r->diag.detail, "(the tokens differ at position "
                     "%lld but no recorded stage does before it: record the logits and every "
                     "stage)", (long long)r->tokens.pos);
    }
    /* No row steps, the configs differ in what attention reads: the cause
     * is the one the test's own config states (a coarse cache's drift
     * hides where it acts). Named from the configs, not recomputed. */
    const cmp_diag_kind config_kind =
        structure_diff(w->ref, w->test, r->config_diff, sizeof r->config_diff);
    const char *diff = r->config_diff;
    if (!r->first.found && config_kind != CMP_DIAG_NONE &&
        (r->diag.kind == CMP_DIAG_NONE || r->diag.kind == CMP_DIAG_UNCLASSIFIED)) {
        memset(&r->diag, 0, sizeof r->diag);
        r->diag.kind = config_kind;
        r->diag.basis = CMP_BASIS_HEURISTIC;
        snprintf(r->diag.summary, sizeof r->diag.summary, "the test runs another model "
                 "structure: %.200s", diff);
        snprintf(r->diag.detail, sizeof r->diag.detail, "(named from the recordings' own "
                 "configs: no recorded row steps above %s, so this pair cannot show where it "
                 "acts; a finer cache or the attention check's stages would)",
                 r->xrt.on ? "drift" : "tolerance");
        snprintf(r->diag.evidence, sizeof r->diag.evidence, "the test's recorded model_config "
                 "against the reference's: %s", diff);
    }
    set_verdict(r, w->ref, w->test);
    return 0;
}

static bool settled_by_hashes(const cmp_result *r)
{
    for (int i = 0; i < r->n_stages; i++)
        if (r->stages[i].rows_by_hash > 0)
            return true;
    return false;
}

/* Rows settled by hashes are believed while a sample of the hashes holds
 * (hashcheck.c); a stale one sends the compare through every row. */
static int check_hashes(const cmp_source *ref, const cmp_source *test, const cmp_opts *o,
                        cmp_result *r, kv_err *e)
{
    if (cmp_hash_audit(ref, test, r, o->hash_audit_whole, e) < 0)
        return -1;
    if (!r->hashcheck.stale)
        return 0;
    const cmp_hash_check h = r->hashcheck;
    cmp_opts every = *o;
    every.no_hashes = true;
    cmp_result_free(r);
    if (cmp_compare(ref, test, &every, r, e) < 0)
        return -1;
    r->hashcheck = h;
    char where[64];
    if (h.layer >= 0)
        snprintf(where, sizeof where, "layer %d", h.layer);
    else
        snprintf(where, sizeof where, "model level");
    cmp_note(r, "%s: the row hash of %s, %s, position %lld is stale (the row was changed "
             "after it was hashed): no hash was trusted, every row was compared",
             h.file, stage_name(h.stage), where, (long long)h.pos);
    return 0;
}

/* The sink logits of a model with attention sinks, from the reference's
 * own rows: with l a head's log-sum-exp over its keys (attn_lse) and s the
 * sink's share of its softmax (attn_sink), the sink's logit is
 * l + log(s / (1 - s)), the same at every position. Read at the first of a
 * layer's first 16 positions where every head's share is strictly between
 * 0 and 1; a layer without one keeps NaN (recomputed attention there then
 * has no sink, and reproduces nothing: said by the families that try). */
#define SINK_SCAN 16

int cmp_recover_sinks(const cmp_source *ref, float **out, kv_err *e)
{
    const kv_config *c = &ref->cfg;
    const int H = c->n_heads, L = c->n_layers;
    *out = NULL;
    if (!c->attn_sinks || !ref->read || H <= 0 || L <= 0)
        return 0;
    float *s = malloc((size_t)L * H * sizeof *s);
    float *lse = malloc((size_t)SINK_SCAN * H * sizeof *lse);
    float *sh = malloc((size_t)SINK_SCAN * H * sizeof *sh);
    if (!s || !lse || !sh) {
        free(s);
        free(lse);
        free(sh);
        return kv_errf(e, "compare: out of memory");
    }
    for (size_t i = 0; i < (size_t)L * H; i++)
        s[i] = NAN;
    for (int l = 0; l < L; l++) {
        int64_t p0, n0, p1, n1;
        int c0, c1;
        if (ref->info(ref->ctx, l, STAGE_ATTN_LSE, &p0, &n0, &c0) || n0 <= 0 || c0 != H ||
            ref->info(ref->ctx, l, STAGE_ATTN_SINK, &p1, &n1, &c1) || n1 <= 0 || c1 != H)
            continue;
        const int64_t lo = p0 > p1 ? p0 : p1;
        const int64_t hi = p0 + n0 < p1 + n1 ? p0 + n0 : p1 + n1;
        const int64_t n = hi - lo < SINK_SCAN ? hi - lo : SINK_SCAN;
        if (n <= 0)
            continue;
        if (ref->read(ref->ctx, l, STAGE_ATTN_LSE, lo, n, lse, e) < 0 ||
            ref->read(ref->ctx, l, STAGE_ATTN_SINK, lo, n, sh, e) < 0) {
            free(s);
            free(lse);
            free(sh);
            return -1;
        }
        for (int64_t r = 0; r < n; r++) {
            bool ok = true;
            for (int h = 0; h < H && ok; h++)
                ok = isfinite(lse[r * H + h]) && sh[r * H + h] > 0 && sh[r * H + h] < 1;
            if (!ok)
                continue;
            for (int h = 0; h < H; h++) {
                const double x = sh[r * H + h];
                s[(size_t)l * H + h] = (float)(lse[r * H + h] + log(x) - log1p(-x));
            }
            break;
        }
    }
    free(lse);
    free(sh);
    *out = s;
    return 0;
}

/* A mixture of experts sends each row to the top k of its router's
 * logits. Where the reference's last chosen expert and the one the test
 * chose instead are closer than the error this pair shows in that row's
 * logits, and that error is of the size the pair shows at the layer's
 * earlier positions, the test made a rounding flip at a near tie, not a
 * mistake: from there on its rows (that position from the layer's MLP on,
 * every later position through attention) are computed on other experts'
 * outputs, and comparing them would call the flip a bug. The first
 * difference in routing, in (position, layer) order, is found before the
 * walk; when it is such a flip, positions from it on are not compared, as
 * after a differing input token. A first difference that is no near tie
 * is left to the walk, which finds it at router_logits or ffn_out. */
typedef struct {
    int64_t pos;                 /* -1: none */
    int layer, dropped, added, k;
    double gap, err, level;
    bool tie;
    int group_mul;               /* > 0: the choice differed by expert group (DeepSeek);
                                    the gap is the groups' and a group score sums this many
                                    rows' errors */
} routing_flip;

#define ROUTING_MIN_ROWS 4       /* earlier positions that set the pair's error level */
#define ROUTING_EARLY_REL 2e-2   /* before them: the router row's relative error allowed */

static bool chosen(const int *idx, int k, int x)
{
    for (int i = 0; i < k; i++)
        if (idx[i] == x)
            return true;
    return false;
}

/* Grouped routing: when the groups ra keeps and those rb keeps differ,
 * *gap = the smallest of ra's group scores of a group only ra keeps minus
 * one only rb keeps, and true; false when both keep the same groups. */
static bool group_gap(const kv_config *c, const float *ra, const float *rb, double *gap)
{
    const int G = c->n_group, T = c->topk_group;
    float ga[G], gb[G];
    int ka[G], kb[G];
    fw_route_groups(c, ra, ga);
    fw_route_groups(c, rb, gb);
    kern_top_k(ga, G, T, ka);
    kern_top_k(gb, G, T, kb);
    double best = INFINITY;
    for (int i = 0; i < T; i++) {
        if (chosen(kb, T, ka[i]))
            continue;
        for (int j = 0; j < T; j++)
            if (!chosen(ka, T, kb[j]))
                best = fmin(best, (double)ga[ka[i]] - ga[kb[j]]);
    }
    if (!isfinite(best))
        return false;
    *gap = best;
    return true;
}

/* The first routing difference of layer l, or none, into *f when earlier
 * than what *f holds. */
static int layer_routing(const cmp_source *ref, const cmp_source *test, int l, int64_t limit,
                         routing_flip *f, kv_err *e)
{
    const int X = ref->cfg.n_experts, K = ref->cfg.n_experts_used;
    int64_t pa, na, pb, nb;
    int ca, cb;
    if (ref->info(ref->ctx, l, STAGE_ROUTER_LOGITS, &pa, &na, &ca) || na <= 0 || ca != X ||
        test->info(test->ctx, l, STAGE_ROUTER_LOGITS, &pb, &nb, &cb) || nb <= 0 || cb != X)
        return 0;
    int64_t lo = pa > pb ? pa : pb, hi = (pa + na < pb + nb ? pa + na : pb + nb) - 1;
    if (limit >= 0 && hi >= limit)
        hi = limit - 1;
    if (f->pos >= 0 && hi > f->pos)
        hi = f->pos;
    if (hi < lo)
        return 0;
    const int64_t n = hi - lo + 1;
    float *a = malloc((size_t)n * X * sizeof *a), *b = malloc((size_t)n * X * sizeof *b);
    int *ia = malloc(2 * (size_t)K * sizeof *ia), *ib = ia ? ia + K : NULL;
    int rc = a && b && ia ? 0 : kv_errf(e, "compare: out of memory");
    if (rc == 0 && (ref->read(ref->ctx, l, STAGE_ROUTER_LOGITS, lo, n, a, e) < 0 ||
                    test->read(test->ctx, l, STAGE_ROUTER_LOGITS, lo, n, b, e) < 0))
        rc = -1;
    double level = 0;
    for (int64_t r = 0; rc == 0 && r < n; r++) {
        const float *ra = a + r * X, *rb = b + r * X;
        double d = 0, scale = 0;
        for (int x = 0; x < X; x++) {
            d = fmax(d, fabs((double)ra[x] - rb[x]));
            scale = fmax(scale, fabs((double)ra[x]));
        }
        const double rel = scale > 0 ? d / scale : 0;
        fw_route_choose(&ref->cfg, ra, ia);   /* as the engines choose */
        fw_route_choose(&ref->cfg, rb, ib);
        /* The test's k-th logit tied exactly with an unchosen one (f16
         * logits often are): its runtime may have taken either, and its
         * recorded logits cannot say which. Taken as the one that differs
         * from the reference's choice. */
        for (int x = 0; x < X; x++)
            if (!chosen(ib, K, x) && rb[x] == rb[ib[K - 1]] && !chosen(ia, K, x) &&
                chosen(ia, K, ib[K - 1])) {
                ib[K - 1] = x;
                break;
            }
        int dropped = -1, added = -1;
        double gap = INFINITY, allow = 2 * d;
        for (int i = 0; i < K; i++) {
            if (chosen(ib, K, ia[i]))
                continue;
            for (int j = 0; j < K; j++)
                if (!chosen(ia, K, ib[j]) && (double)ra[ia[i]] - ra[ib[j]] < gap) {
                    gap = (double)ra[ia[i]] - ra[ib[j]];
                    dropped = ia[i];
                    added = ib[j];
                }
        }
        /* Grouped routing (DeepSeek) decides by group first: when the two
         * sides kept other groups, the gap is the groups' (in the
         * reference's scores), and a group score sums up to two rows'
         * errors. */
        int group_mul = 0;
        if (dropped >= 0 && ref->cfg.n_group > 0 && rc == 0 &&
            group_gap(&ref->cfg, ra, rb, &gap)) {
            group_mul = ref->cfg.route == ROUTE_SIGMOID ? 2 : 1;
            allow = 2 * group_mul * d;
        }
        if (dropped >= 0) {
            const int64_t p = lo + r;
            if (f->pos < 0 || p < f->pos || (p == f->pos && l < f->layer)) {
                *f = (routing_flip){.pos = p, .layer = l, .dropped = dropped, .added = added,
                                    .k = K, .gap = gap, .err = d, .level = level,
                                    .group_mul = group_mul};
                /* The pair's error level comes from the layer's earlier rows;
                 * in the first few (no level yet) a row within
                 * ROUTING_EARLY_REL of the reference's may tie. The walk
                 * through the flip's position still judges every stage up
                 * to and including the router's row. */
                f->tie = gap <= allow &&
                         (r >= ROUTING_MIN_ROWS ? level > 0 && rel <= 8 * level
                                                : rel <= ROUTING_EARLY_REL);
            }
            break;
        }
        level = fmax(level, rel);
    }
    free(a);
    free(b);
    free(ia);
    return rc;
}

static int find_routing_flip(const cmp_source *ref, const cmp_source *test, int64_t limit,
                             routing_flip *f, kv_err *e)
{
    f->pos = -1;
    const kv_config *c = &ref->cfg;
    if (c->n_experts <= 0 || c->n_experts_used < 1 || c->n_experts_used >= c->n_experts ||
        test->cfg.n_experts != c->n_experts || !ref->read || !test->read)
        return 0;
    for (int l = 0; l < c->n_layers; l++)
        if (layer_routing(ref, test, l, limit, f, e) < 0)
            return -1;
    return 0;
}

/* Is the first divergence d at or after the flip, in walk order: at its
 * position, past the router of its layer (the flip changes that layer's
 * MLP output and everything after it), or in /output there? */
static bool after_flip(const cmp_divergence *d, const routing_flip *fl)
{
    if (!d->found || d->pos != fl->pos)
        return d->found && d->pos > fl->pos;
    if (d->from_output || d->layer < 0 || d->layer > fl->layer)
        return true;
    return d->layer == fl->layer && d->stage > STAGE_ROUTER_LOGITS;
}

/* One compare. pass 0 finds a routing flip at a near tie (cross-runtime)
 * and compares through the flip's position: a step before the flip in
 * walk order (a bug born upstream of the router there, which the flip's
 * error may hide) stands; a step at or after it returns 2, and pass 1
 * compares the positions before the flip alone. */
static int compare_pass(const cmp_source *ref_in, const cmp_source *test_in, const cmp_opts *o,
                        cmp_result *r, int pass, routing_flip *fl, kv_err *e)
{
    /* Copies that carry what the comparer works out for both (sinks). */
    cmp_source ref_src = *ref_in, test_src = *test_in;
    const cmp_source *ref = &ref_src, *test = &test_src;
    float *sinks = NULL;
    memset(r, 0, sizeof *r);
    set_mode(r, o);
    if (check_options(ref, test, o, e) < 0)
        return -1;
    /* Row records are kept per block: a bounded block keeps memory bounded. */
    const int B = o->block_rows <= 0 ? 64 : o->block_rows > 4096 ? 4096 : o->block_rows;
    walker w = {.ref = ref, .test = test, .o = o, .r = r, .B = B};
    r->n_layers_model = ref->cfg.n_layers;
    if (check_token_list(ref, e) < 0 || check_token_list(test, e) < 0 ||
        check_models(ref, test, "model", o->force, r, e) < 0 ||
        check_prompts(ref, test, o->force, r, &w.pos_limit, e) < 0)
        return -1;
    r->compared.pos_cut = w.pos_limit;
    r->compared.routing_flip = -1;
    if (!ref->complete)
        cmp_note(r, "%s is partial (the run stopped early): compared what it holds", ref->label);
    if (!test->complete && !test->stopped_on_purpose)
        cmp_note(r, "%s is partial (the run stopped early): compared what it holds", test->label);
    cmp_ctx c = {.ref = ref, .test = test, .o = o, .cfg = &ref->cfg, .r = r,
                 .pos_limit = w.pos_limit};
    prefetch(&w);   /* before the pool's threads exist: it may fork */
    /* What validate rejects is refused before a digest or hash settles it. */
    if ((ref->check && ref->check(ref->ctx, e) < 0) ||
        (test->check && test->check(test->ctx, e) < 0))
        return -1;
    if (!ref_src.sink_logits) {
        if (cmp_recover_sinks(ref, &sinks, e) < 0)
            return -1;
        ref_src.sink_logits = test_src.sink_logits = sinks;
    }
    /* Only across runtimes: kvdiff's own engines route bit for bit alike. */
    char why[256];
    if (pass == 0) {
        *fl = (routing_flip){.pos = -1};
        /* A run that followed the other's routing (kvdiff run --follow)
         * chose every recorded row's experts as the other did. */
        const bool followed = cmp_settings_int(ref, "follow_routing", 0) > 0 ||
                              cmp_settings_int(test, "follow_routing", 0) > 0;
        if (!followed && cmp_xrt_wanted(ref, test, o, why, sizeof why) &&
            find_routing_flip(ref, test, w.pos_limit, fl, e) < 0) {
            free(sinks);
            return -1;
        }
    }
    const bool flip = fl->pos >= 0 && fl->tie;
    if (flip) {
        const int64_t cut = pass == 0 ? fl->pos + 1 : fl->pos;
        if (w.pos_limit < 0 || cut < w.pos_limit) {
            w.pos_limit = c.pos_limit = r->compared.pos_cut = cut;
            w.routing_cut = true;
            r->compared.routing_flip = fl->pos;
            r->compared.routing_flip_layer = fl->layer;
        }
        if (pass == 1 && fl->group_mul > 0)
            cmp_note(r, "positions %lld.. not compared: at position %lld, layer %d the test "
                     "routed to expert %d where the reference chose expert %d, having kept "
                     "other expert groups: their group scores %.3g apart in the reference, "
                     "less than %d times the %.3g this pair's router scores differ by there "
                     "(up to %.3g at the layer's earlier positions): a rounding flip at a near "
                     "tie, after which every row is computed on other experts' outputs (`kvdiff "
                     "run --follow` on the test's dump routes as it did: compare against that "
                     "for every position)",
                     (long long)fl->pos, (long long)fl->pos, fl->layer, fl->added, fl->dropped,
                     fl->gap, 2 * fl->group_mul, fl->err, fl->level);
        else if (pass == 1)
            cmp_note(r, "positions %lld.. not compared: at position %lld, layer %d the test "
                     "routed to expert %d where the reference chose expert %d, their logits %.3g "
                     "apart in the reference, less than twice the %.3g this pair's router logits "
                     "differ by there (up to %.3g at the layer's earlier positions): a rounding "
                     "flip at a near tie, after which every row is computed on other experts' "
                     "outputs (`kvdiff run --follow` on the test's dump routes as it did: compare "
                     "against that for every position)",
                     (long long)fl->pos, (long long)fl->pos, fl->layer, fl->added, fl->dropped,
                     fl->gap, fl->err, fl->level);
    }
    /* Two threads at most: reading is serial (libhdf5), only weighing rows
     * is split. Without a pool (out of threads) rows are weighed serially. */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    w.pool = pool_create(cpus > 1 ? 2 : 1);
    c.pool = w.pool;
    int rc = compare_run(&w, &c, e);
    walker_free(&w);
    pool_free(w.pool);
    if (rc == 0 && !o->no_hashes && settled_by_hashes(r))
        rc = check_hashes(ref, test, o, r, e);
    free(sinks);
    if (rc == 0 && pass == 0 && flip && after_flip(&r->first, fl))
        return 2;
    if (rc == 0 && pass == 0 && flip)   /* a step before the flip stands: maybe its cause */
        cmp_note(r, "positions %lld.. not compared: at position %lld, layer %d the test routed "
                 "to expert %d where the reference chose expert %d (their logits %.3g apart, "
                 "within the %.3g the router logits differ by there); every row after it is "
                 "computed on other experts' outputs", (long long)fl->pos + 1,
                 (long long)fl->pos, fl->layer, fl->added, fl->dropped, fl->gap, fl->err);
    return rc;
}

int cmp_compare(const cmp_source *ref, const cmp_source *test, const cmp_opts *opts,
                cmp_result *r, kv_err *e)
{
    cmp_opts dflt;
    cmp_opts_default(&dflt);
    const cmp_opts *o = opts ? opts : &dflt;
    routing_flip fl;
    int rc = compare_pass(ref, test, o, r, 0, &fl, e);
    if (rc == 2) {
        cmp_result_free(r);
        rc = compare_pass(ref, test, o, r, 1, &fl, e);
    }
    return rc;
}
