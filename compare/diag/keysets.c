/* keysets.c — the key-set hypothesis engine (docs/diagnosis.md, "The
 * hypothesis engine").
 *
 * When attention at the first divergence (p, l) read other keys than the
 * config's, each family of causes proposes candidates (a window of N keys,
 * a layer read as the other type, chunks attending only to themselves,
 * decode blind to the prefill, one key left out or read twice, the own key
 * masked, unwritten slots read as keys, a write index stuck, a ring that
 * does not wrap, a stale sliding cache). A candidate is a model: at every
 * (layer, position) it predicts a key set, and attention recomputed over
 * it from the test's own q, k, v either reproduces the test's recorded
 * attention there or not. Every candidate that reproduces p is then
 * scored at the positions after p (each of the next few, then doubling
 * steps to the last recorded) on l and on one layer of every other window
 * kind, wherever the candidates predict different keys or any predicts
 * other than the config. A candidate is dropped where it fails and another
 * fits; where none fits nothing is dropped (something else happens
 * there). One survivor that fit every place tried, every rival having
 * failed somewhere, is "verified"; several survivors are named side by
 * side with the data that would separate them. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"

#define KS_MAX 24                /* candidates at once */
#define KS_NEAR 8                /* positions after p tried one by one */
#define KS_LAYERS 5              /* layers scored: l, the next of its kind, one of each other */
#define KS_ALL INT64_MAX         /* a window of every key */

/* Layers a candidate changes: the divergent one, every layer of its
 * window kind (every sliding layer, or every global one), every layer. */
typedef enum { SCOPE_LAYER, SCOPE_KIND, SCOPE_ALL } ks_scope;

typedef struct {
    cmp_diag_kind kind;
    int64_t n;                   /* WINDOW, LAYER_TYPE: keys read (KS_ALL: every key);
                                  * MISSING_KEY, DUP_KEY: the key; PADDED_SLOTS,
                                  * EXTRA_KEY: zero slots (variant 1: the cache's size);
                                  * DECODE_STUCK: the slot decode writes;
                                  * CHUNK_ISOLATED: the chunk */
    int variant;
    ks_scope scope;
    int64_t from;                /* the first position it changes (a bug of the decode
                                  * path, or one that began at p) */
    double err_p;
    bool alive;
    int places;                  /* places it reproduced */
    int misses;                  /* places on the divergent layer it did not reproduce,
                                  * where nothing tried did */
    int misses_other;            /* the same on other layers (their cause may lie
                                  * beyond what the recordings hold) */
    int64_t miss_pos;            /* the first of them on the divergent layer (-1 none) */
    int64_t last_pos;            /* the last position it reproduced */
    int fail_layer;
    int64_t fail_pos, fail_n, fail_test_n;
    double fail_err;             /* -1: refuted by the positions before p */
    bool merged;                 /* the same predictions as an earlier candidate */
    char what[160];              /* its key set at p */
} ks_cand;

typedef struct {
    ks_cand k[KS_MAX];
    int n;
    int layers[KS_LAYERS];       /* layers scored, l first */
    int nl;
    int64_t last[KS_LAYERS];     /* the last position each holds (-1 none) */
    int64_t unrec_pos;           /* a place that would separate survivors, not recorded */
    int unrec_layer;
    int none_fit;                /* places where no candidate fit */
    int64_t none_pos;            /* the first of them (-1 none) */
    int none_layer;
    bool counts_only;            /* attention cannot be recomputed: key counts alone */
    bool used_counts;            /* some place was judged by its key count alone */
    int nscored;                 /* places scored, so that none is scored twice */
    int scored_layer[256];
    int64_t scored_pos[256];
} ks_run;

/* ------------------------------------------------------------------ */
/* Predictions                                                          */

static int64_t window_lo(int W, int64_t q)
{
    return W > 0 && q - W + 1 > 0 ? q - W + 1 : 0;
}

/* Prefill runs in chunks of C; each decode step is a chunk of one. */
static int64_t chunk_start(int64_t p, int64_t P, int64_t C)
{
    return p >= P ? p : (p / C) * C;
}

static int64_t prev_chunk_start(int64_t s, int64_t P, int64_t C)
{
    return s > P ? s - 1 : ((s - 1) / C) * C;
}

/* The key set candidate k predicts at (layer, q): the config's where it
 * changes nothing there. False where it predicts nothing at all (a ring
 * past twice its size). */
static bool ks_keys(const cmp_ctx *c, const dg_case *a, const ks_cand *k, int layer, int64_t q,
                    cmp_hyp *h)
{
    const int W = config_layer_window(c->cfg, layer);
    const int64_t lo = window_lo(W, q), P = a->P;
    memset(h, 0, sizeof *h);
    h->lo = lo;
    h->hi = q;
    h->kind = k->kind;
    if ((k->scope == SCOPE_LAYER && layer != c->d->layer) ||
        (k->scope == SCOPE_KIND && W != a->W) || q < k->from)
        return true;
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
    case CMP_DIAG_LAYER_TYPE:
        h->lo = k->n == KS_ALL || q - k->n + 1 < 0 ? 0 : q - k->n + 1;
        break;
    case CMP_DIAG_CHUNK_ISOLATED: {
        const int64_t cs = chunk_start(q, P > 0 ? P : INT64_MAX, k->n);
        h->lo = cs > lo ? cs : lo;
        break;
    }
    case CMP_DIAG_DECODE_BLIND:
        if (P > 0 && q >= P && P > lo)
            h->lo = P;
        break;
    case CMP_DIAG_MISSING_KEY:
        if (k->n >= lo && k->n <= q)
            h->skip_one = true, h->skip_pos = k->n;
        break;
    case CMP_DIAG_DUP_KEY:
        if (k->n >= lo && k->n <= q)
            h->dup_one = true, h->dup_pos = k->n;
        break;
    case CMP_DIAG_OWN_KEY_MASKED:
        h->hi = q - 1;
        break;
    case CMP_DIAG_EXTRA_KEY:
    case CMP_DIAG_PADDED_SLOTS:
        h->extra_zero = (int)(k->variant == 0 ? k->n : k->n - 1 - q > 0 ? k->n - 1 - q : 0);
        /* No slot past the cache's last: a mask off by one reads none there. */
        if (a->ctx > 0 && q + h->extra_zero >= a->ctx)
            h->extra_zero = (int)(a->ctx - 1 - q > 0 ? a->ctx - 1 - q : 0);
        break;
    case CMP_DIAG_DECODE_STUCK:
        /* Every decode token lands in slot n; the slots of the decode
         * positions were never written. */
        if (P <= 0 || q < P || (k->n == P && q == P))
            break;
        h->nsubst = 1;
        h->from[0] = k->n, h->to[0] = q;
        h->zero_lo = k->n == P ? P + 1 : P, h->zero_hi = q + 1;
        if (a->R > 0 && W > 0 && W == a->W) {
            if (q - P >= a->R)
                return false;
            h->older = a->R;
        }
        break;
    case CMP_DIAG_RING_NO_WRAP: {
        /* Writes stop at R: positions R.. read slots still holding 0... */
        const int64_t R = k->n;
        if (q < R || q >= 2 * R)
            return false;
        h->zero_lo = R, h->zero_hi = q + 1, h->older = R;
        break;
    }
    case CMP_DIAG_STALE_CACHE: {
        if (a->W <= 0 || a->C <= 0)
            return false;
        const int64_t cs = chunk_start(q, P, a->C);
        if (cs > 0) {
            const int64_t prev = prev_chunk_start(cs, P, a->C);
            h->zero_lo = prev > lo ? prev : lo;
            h->zero_hi = cs;
            h->older = k->variant == 1 ? k->n : a->R;
        }
        break;
    }
    default:
        break;
    }
    return true;
}

static bool hyp_same(const cmp_hyp *x, const cmp_hyp *y)
{
    if (x->lo != y->lo || x->hi != y->hi || x->extra_zero != y->extra_zero ||
        x->nsubst != y->nsubst || x->skip_one != y->skip_one || x->dup_one != y->dup_one)
        return false;
    if ((x->zero_lo < x->zero_hi || y->zero_lo < y->zero_hi) &&
        (x->zero_lo != y->zero_lo || x->zero_hi != y->zero_hi || x->older != y->older))
        return false;
    for (int i = 0; i < x->nsubst; i++)
        if (x->from[i] != y->from[i] || x->to[i] != y->to[i])
            return false;
    return (!x->skip_one || x->skip_pos == y->skip_pos) && (!x->dup_one || x->dup_pos == y->dup_pos);
}

/* The candidate's key set at p, in words. */
static void ks_describe(const cmp_ctx *c, const dg_case *a, ks_cand *k)
{
    const int64_t p = c->d->pos;
    cmp_hyp h;
    ks_keys(c, a, k, c->d->layer, p, &h);
    char *w = k->what;
    const size_t n = sizeof k->what;
    const long long lo = (long long)h.lo, hi = (long long)h.hi;
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
    case CMP_DIAG_LAYER_TYPE:
        if (k->n == KS_ALL)
            dg_say(w, n, "every key 0..%lld (a global layer)", hi);
        else
            dg_say(w, n, "a window of %lld key%s (%lld..%lld)", (long long)k->n,
                   k->n == 1 ? "" : "s", lo, hi);
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
        dg_say(w, n, "only its own chunk's keys %lld..%lld", lo, hi);
        break;
    case CMP_DIAG_DECODE_BLIND:
        dg_say(w, n, "the decode steps' keys %lld..%lld alone", lo, hi);
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY:
        dg_say(w, n, "the config's keys %lld..%lld with key %lld %s", lo, hi, (long long)k->n,
               k->kind == CMP_DIAG_MISSING_KEY ? "left out" : "read twice");
        break;
    case CMP_DIAG_OWN_KEY_MASKED:
        if (hi >= lo)
            dg_say(w, n, "keys %lld..%lld, its own key %lld masked out", lo, hi, (long long)p);
        else
            dg_say(w, n, "no key at all: its own key %lld masked out", (long long)p);
        break;
    case CMP_DIAG_EXTRA_KEY:
        dg_say(w, n, "the config's keys %lld..%lld plus one unwritten (zero) slot", lo, hi);
        break;
    case CMP_DIAG_PADDED_SLOTS:
        dg_say(w, n, "the config's keys %lld..%lld plus %d unwritten (zero) slots", lo, hi,
               h.extra_zero);
        break;
    case CMP_DIAG_DECODE_STUCK:
        if (p == a->P && k->n != a->P)
            dg_say(w, n, "keys where slot %lld holds position %lld's key and position %lld's "
                   "slot was never written", (long long)k->n, (long long)p, (long long)p);
        else
            dg_say(w, n, "keys where slot %lld holds position %lld's key and the slots of "
                   "positions %lld..%lld were never written", (long long)k->n, (long long)p,
                   (long long)h.zero_lo, (long long)p);
        break;
    case CMP_DIAG_RING_NO_WRAP:
        dg_say(w, n, "the config's keys, positions %lld..%lld read from ring slots still "
               "holding positions %lld..%lld", (long long)k->n, hi, 0LL, (long long)(p - k->n));
        break;
    case CMP_DIAG_STALE_CACHE:
        if (h.zero_lo < h.zero_hi)
            dg_say(w, n, "the config's keys with the previous chunk's (%lld..%lld) read %s",
                   (long long)h.zero_lo, (long long)(h.zero_hi - 1),
                   h.older > 0 ? "as the ring held them before it wrote" : "as never written");
        else
            dg_say(w, n, "the config's keys %lld..%lld (no earlier chunk in reach)", lo, hi);
        break;
    default:
        dg_say(w, n, "another key set");
        break;
    }
}

/* ------------------------------------------------------------------ */
/* Proposals                                                            */

static const char *cache_named(const cmp_ctx *c);
static void param_text(const cmp_ctx *c, const ks_cand *k, char *buf, size_t n);

static void add_from(ks_run *run, cmp_diag_kind kind, int64_t n, int variant, ks_scope scope,
                     int64_t from)
{
    for (int i = 0; i < run->n; i++)
        if (run->k[i].kind == kind && run->k[i].n == n && run->k[i].variant == variant &&
            run->k[i].scope == scope && run->k[i].from == from)
            return;
    if (run->n >= KS_MAX)
        return;
    run->k[run->n++] = (ks_cand){.kind = kind, .n = n, .variant = variant, .scope = scope,
                                  .from = from, .alive = true, .fail_pos = -1, .miss_pos = -1,
                                  .fail_layer = -1, .err_p = INFINITY, .last_pos = -1};
}

static void add(ks_run *run, cmp_diag_kind kind, int64_t n, int variant, ks_scope scope)
{
    add_from(run, kind, n, variant, scope, 0);
}

/* Zero slots added to the config's keys that the test's attention at p
 * shows: attention over n more keys scoring 0 (K = V = 0) has a sum of
 * weights Z + n where the config's has Z; solved per head from attn_lse,
 * or attn_out's shrinkage where lse is not recorded. 0 when none. */
static int64_t solve_zero_slots(cmp_ctx *c, dg_case *a, kv_err *e, int *rc)
{
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, D = cfg->head_dim;
    const float *q = a->q_test ? a->q_test : a->q_ref;
    const float *lse_rec = c->ev->lse_test, *out_rec = a->out_test;
    if (!q || (!lse_rec && !out_rec))
        return 0;
    cmp_hyp h = dg_hyp_config(c->d, a);
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    int r = (!lse || !out) ? kv_errf(e, "compare: out of memory") : 1;
    if (r == 1 && a->q_test)
        r = cmp_recompute_attention(c->test, cfg, c->d->layer, q, &h, lse, out, e);
    if (r == 1)
        r = cmp_recompute_attention(c->ref, cfg, c->d->layer, q, &h, lse, out, e);
    double sum = 0;
    int used = 0;
    for (int i = 0; r == 0 && i < H; i++) {
        if (!isfinite(lse[i]) || lse[i] > 30)
            continue;   /* zero slots weigh nothing beside exp(30) */
        double nz;
        if (lse_rec) {
            nz = exp(lse[i]) * expm1((double)lse_rec[i] - lse[i]);
        } else {
            double dot = 0, sq = 0;
            for (int d = 0; d < D; d++) {
                dot += (double)out_rec[(size_t)i * D + d] * out[(size_t)i * D + d];
                sq += out[(size_t)i * D + d] * out[(size_t)i * D + d];
            }
            if (!(sq > 0) || !(dot > 0))
                continue;
            nz = exp(lse[i]) * (sq / dot - 1);
        }
        if (isfinite(nz)) {
            sum += nz;
            used++;
        }
    }
    free(lse);
    free(out);
    if (r < 0)
        *rc = -1;
    const double n = used > 0 ? round(sum / used) : 0;
    return n >= 1 && n <= 1 << 20 ? (int64_t)n : 0;
}

/* Every cause worth trying at p. */
static int propose(cmp_ctx *c, dg_case *a, ks_run *run, kv_err *e)
{
    const int64_t p = c->d->pos, P = a->P;
    const int W = a->W;
    const int nt = c->ev->nkeys_test, nr = c->ev->nkeys_ref;
    const int64_t ncfg = p - a->lo_ref + 1;
    /* Windows: one of N < W first differs at p = N, reading N keys; a
     * larger one (or none) at p = W, reading W + 1; a global layer read
     * through a window of N at p = N. */
    /* Each in two scopes: every layer of the kind (a window hard-coded,
     * a cache shared by the kind) or this layer alone (layer types off). */
    for (int s = SCOPE_LAYER; s <= SCOPE_KIND; s++) {
        if (W > 0 && p >= 1 && p < W)
            add(run, CMP_DIAG_WINDOW, nt > 0 && nt < p + 1 ? nt : p, 0, (ks_scope)s);
        if (W > 0 && p == W)
            add(run, CMP_DIAG_LAYER_TYPE, KS_ALL, 0, (ks_scope)s);
        if (W > 0 && nt > 0 && nt != ncfg && nt <= p + 1)
            add(run, nt == p + 1 ? CMP_DIAG_LAYER_TYPE : CMP_DIAG_WINDOW,
                nt == p + 1 ? KS_ALL : nt, 0, (ks_scope)s);
        if (W == 0 && p >= 1)
            add(run, CMP_DIAG_LAYER_TYPE, nt > 0 && nt < p + 1 ? nt : p, 0, (ks_scope)s);
    }
    /* Chunks attending only to themselves: every layer. */
    int64_t C = a->C;
    if (C > 0 && chunk_start(p, P > 0 ? P : INT64_MAX, C) > a->lo_ref)
        add(run, CMP_DIAG_CHUNK_ISOLATED, C, 0, SCOPE_ALL);
    /* Decode steps isolated whatever the prefill's chunks: a chunk >= P. */
    if (P > 0 && p >= P && P > a->lo_ref)
        add(run, CMP_DIAG_CHUNK_ISOLATED, P, 0, SCOPE_ALL);
    if (P > 0 && p >= P && P > a->lo_ref)
        add(run, CMP_DIAG_DECODE_BLIND, 0, 0, SCOPE_ALL);
    /* From the decode path's first step, or from the start. */
    const int64_t dec = P > 0 && p >= P ? P : 0;
    add_from(run, CMP_DIAG_OWN_KEY_MASKED, 0, 0, SCOPE_ALL, dec);
    /* Unwritten slots read as keys. */
    if (nt < 0 || (nr >= 0 && nt > nr) || (nr < 0 && nt > ncfg)) {
        int rc = 0;
        const int64_t z = solve_zero_slots(c, a, e, &rc);
        if (rc < 0)
            return -1;
        const int64_t from = dec > 0 ? dec : p;
        if (z == 1)
            add_from(run, CMP_DIAG_EXTRA_KEY, 1, 0, SCOPE_ALL, from);
        if (z > 1)
            add_from(run, CMP_DIAG_PADDED_SLOTS, z, 0, SCOPE_ALL, from);
        if (z >= 1)
            add_from(run, CMP_DIAG_PADDED_SLOTS, p + 1 + z, 1, SCOPE_ALL, from);
    }
    /* A decode write index stuck at one slot. */
    if (P > 0 && p > P)
        add(run, CMP_DIAG_DECODE_STUCK, P, 0, SCOPE_ALL);
    if (P > 1 && p >= P) {
        add(run, CMP_DIAG_DECODE_STUCK, 0, 0, SCOPE_ALL);
        add(run, CMP_DIAG_DECODE_STUCK, P - 1, 0, SCOPE_ALL);
    }
    /* A ring that does not wrap, a stale sliding cache. */
    const int64_t R = a->R > 0 ? a->R : a->R_guess;
    if (W > 0 && R > 0 && p >= R && p < 2 * R)
        add(run, CMP_DIAG_RING_NO_WRAP, R, 0, SCOPE_KIND);
    if (W > 0 && a->C > 0 && p > 0 && chunk_start(p, P, a->C) == p) {
        add(run, CMP_DIAG_STALE_CACHE, 0, 0, SCOPE_KIND);
        /* The cache unnamed: a ring of W + C slots holds older keys where
         * a dense cache holds none. They part once the ring wraps. */
        if (a->R == 0 && !cache_named(c))
            add(run, CMP_DIAG_STALE_CACHE, W + a->C, 1, SCOPE_KIND);
        /* Synced through the prefill, not between decode steps. */
        if (dec > 0)
            add_from(run, CMP_DIAG_STALE_CACHE, 0, 0, SCOPE_KIND, dec);
    }
    /* One key left out or read twice: a scan picks the closest of each. */
    const bool fewer = nt < 0 || nt == (nr >= 0 ? nr : ncfg) - 1;
    const bool more = nt < 0 || nt == (nr >= 0 ? nr : ncfg) + 1;
    const float *q = a->q_test ? a->q_test : a->q_ref;
    if ((fewer || more) && q) {
        int64_t skip, dup;
        double skip_err, dup_err;
        int rc = cmp_keyset_scan(a->q_test ? c->test : c->ref, c->cfg, c->d->layer, q, a->lo_ref,
                                 p, c->ev->lse_test, a->out_test, &skip, &skip_err, &dup,
                                 &dup_err, e);
        if (rc < 0)
            return -1;
        if (rc == 0 && fewer && skip >= 0 && skip < p && skip_err <= c->attn_tol)
            add_from(run, CMP_DIAG_MISSING_KEY, skip, 0, SCOPE_ALL, p);
        if (rc == 0 && more && dup >= 0 && dup_err <= c->attn_tol)
            add_from(run, CMP_DIAG_DUP_KEY, dup, 0, SCOPE_ALL, p);
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Scoring                                                              */

static int alive_count(const ks_run *run)
{
    int n = 0;
    for (int i = 0; i < run->n; i++)
        n += run->k[i].alive;
    return n;
}

/* Before p (and at p on the layers before l) the walk found the test's
 * rows the reference's, which read the config's keys: a candidate that
 * predicts other keys at such a place is refuted there (*q, *layer). */
static bool refuted_before(const cmp_ctx *c, const dg_case *a, const ks_cand *k, int64_t *q,
                           int *layer)
{
    const int64_t p = c->d->pos;
    for (int L = 0; L < c->cfg->n_layers; L++) {
        int64_t lo, hi;
        const int cols = cmp_stage_cols(c->cfg, L, STAGE_ATTN_OUT);
        if (cmp_source_held(c->test, L, STAGE_ATTN_OUT, cols, &lo, &hi) != 0 &&
            cmp_source_held(c->test, L, STAGE_ATTN_NKEYS, c->cfg->n_heads, &lo, &hi) != 0)
            continue;
        const int W = config_layer_window(c->cfg, L);
        for (int64_t x = lo; x <= (L < c->d->layer ? p : p - 1) && x <= hi; x++) {
            cmp_hyp h;
            const cmp_hyp cfg = {.lo = window_lo(W, x), .hi = x};
            if (ks_keys(c, a, k, L, x, &h) && !hyp_same(&h, &cfg)) {
                *q = x;
                *layer = L;
                return true;
            }
        }
    }
    return false;
}

/* Tries every candidate at p; those that do not reproduce the test there
 * are refuted at p. Returns how many do. */
static int score_at_p(cmp_ctx *c, dg_case *a, ks_run *run, kv_err *e)
{
    const int nt = c->ev->nkeys_test;
    int fit = 0;
    run->scored_layer[0] = c->d->layer;
    run->scored_pos[0] = c->d->pos;
    run->nscored = 1;
    for (int i = 0; i < run->n; i++) {
        ks_cand *k = &run->k[i];
        cmp_hyp h;
        ks_keys(c, a, k, c->d->layer, c->d->pos, &h);
        ks_describe(c, a, k);
        k->fail_layer = c->d->layer;
        k->fail_pos = c->d->pos;
        k->fail_n = cmp_hyp_nkeys(&h);
        k->fail_test_n = nt;
        k->fail_err = INFINITY;
        if (nt >= 0 && cmp_hyp_nkeys(&h) != nt) {
            k->alive = false;
            continue;
        }
        if (refuted_before(c, a, k, &k->fail_pos, &k->fail_layer)) {
            k->alive = false;
            k->fail_err = -1;   /* the walk: the test read the config's keys there */
            continue;
        }
        if (run->counts_only)
            k->err_p = nt >= 0 ? 0 : INFINITY;   /* the count, checked above */
        else if (dg_hyp_err(c, a, &h, false, &k->err_p, e) < 0)
            return -1;
        k->fail_err = k->err_p;
        k->alive = k->err_p <= c->attn_tol;
        if (k->alive) {
            k->fail_pos = -1;
            k->places = 1;
            k->last_pos = c->d->pos;
            fit++;
        }
    }
    return fit;
}

/* The layers scored: l, then the first layer of every other window kind
 * (after l where there is one: its rows at p are the test's own). */
static void pick_layers(const cmp_ctx *c, ks_run *run)
{
    const kv_config *cfg = c->cfg;
    const int l = c->d->layer;
    run->layers[0] = l;
    run->nl = 1;
    for (int L = l + 1; L < cfg->n_layers && run->nl == 1; L++)
        if (config_layer_window(cfg, L) == config_layer_window(cfg, l))
            run->layers[run->nl++] = L;
    for (int pass = 0; pass < 2; pass++)
        for (int L = pass == 0 ? l + 1 : 0; L < (pass == 0 ? cfg->n_layers : l); L++) {
            const int w = config_layer_window(cfg, L);
            bool seen = false;
            for (int i = 0; i < run->nl; i++)
                seen |= config_layer_window(cfg, run->layers[i]) == w;
            if (!seen && run->nl < KS_LAYERS)
                run->layers[run->nl++] = L;
        }
    for (int i = 0; i < run->nl; i++) {
        int64_t lo, hi;
        const int cols = cmp_stage_cols(cfg, run->layers[i], STAGE_ATTN_OUT);
        run->last[i] = -1;
        if (cmp_source_held(c->test, run->layers[i], STAGE_ATTN_OUT, cols, &lo, &hi) == 0 ||
            cmp_source_held(c->test, run->layers[i], STAGE_ATTN_LSE, c->cfg->n_heads, &lo,
                            &hi) == 0)
            run->last[i] = hi;   /* past a token cut too: the test's own rows agree */
        if (run->last[i] > c->d->pos + cmp_diag_span(cfg))
            run->last[i] = c->d->pos + cmp_diag_span(cfg);
    }
}

/* One place (layer, q): each distinct prediction of the living
 * candidates recomputed once against the test's own rows there. Returns
 * 0, -1 on error. */
static int score_place(cmp_ctx *c, dg_case *a, ks_run *run, int layer, int64_t q, kv_err *e)
{
    cmp_hyp pred[KS_MAX];
    bool has[KS_MAX], fits[KS_MAX];
    double err[KS_MAX];
    int64_t test_n[KS_MAX];
    bool done[KS_MAX] = {false};
    int tried = 0, fit = 0, distinct = 0;
    for (int i = 0; i < run->nscored; i++)
        if (run->scored_layer[i] == layer && run->scored_pos[i] == q)
            return 0;
    if (run->nscored < 256) {
        run->scored_layer[run->nscored] = layer;
        run->scored_pos[run->nscored++] = q;
    }
    for (int i = 0; i < run->n; i++)
        has[i] = run->k[i].alive && ks_keys(c, a, &run->k[i], layer, q, &pred[i]);
    for (int i = 0; i < run->n; i++) {
        if (!has[i] || done[i])
            continue;
        int rc = dg_attn_err_at(c, layer, q, &pred[i], run->counts_only, &err[i], &test_n[i], e);
        if (rc < 0)
            return -1;
        if (rc == 2) {
            run->used_counts = true;
            rc = 0;
        }
        distinct++;
        for (int j = i; j < run->n; j++)
            if (has[j] && !done[j] && hyp_same(&pred[i], &pred[j])) {
                done[j] = true;
                err[j] = err[i];
                test_n[j] = test_n[i];
                fits[j] = rc == 0 && err[i] <= c->attn_tol;
                has[j] = rc == 0;   /* unrecorded: no verdict from here */
            }
        if (rc == 1 && run->unrec_pos < 0) {
            run->unrec_pos = q;
            run->unrec_layer = layer;
        }
    }
    for (int i = 0; i < run->n; i++)
        if (has[i]) {
            tried++;
            fit += fits[i];
        }
    if (getenv("KVDIFF_DIAG_TRACE"))
        for (int i = 0; i < run->n; i++)
            if (has[i])
                fprintf(stderr, "trace: layer %d pos %lld %s n=%lld: %s %.3g\n", layer,
                        (long long)q, cmp_diag_name(run->k[i].kind), (long long)run->k[i].n,
                        fits[i] ? "fits" : "fails", err[i]);
    if (tried == 0)
        return 0;
    if (fit == 0) {
        if (run->none_fit++ == 0) {
            run->none_pos = q;
            run->none_layer = layer;
        }
        for (int i = 0; i < run->n; i++) {
            if (has[i] && layer != c->d->layer)
                run->k[i].misses_other++;
            if (has[i] && layer == c->d->layer)
                run->k[i].misses++;
            if (has[i] && layer == c->d->layer && run->k[i].miss_pos < 0)
                run->k[i].miss_pos = q;
        }
        return 0;
    }
    (void)distinct;
    for (int i = 0; i < run->n; i++) {
        ks_cand *k = &run->k[i];
        if (!has[i])
            continue;
        if (fits[i]) {
            k->places++;
            if (layer == c->d->layer && q > k->last_pos)
                k->last_pos = q;
            continue;
        }
        k->alive = false;
        k->fail_layer = layer;
        k->fail_pos = q;
        k->fail_err = err[i];
        k->fail_n = cmp_hyp_nkeys(&pred[i]);
        k->fail_test_n = test_n[i];
    }
    return 0;
}

/* Positions tried after p: p + 1 .. p + KS_NEAR, then doubling steps,
 * then the last. */
static int64_t next_pos(int64_t p, int64_t q, int64_t last)
{
    int64_t n = q - p < KS_NEAR ? q + 1 : p + 2 * (q - p);
    if (n > last && q < last)
        n = last;
    return n;
}

static int score_all(cmp_ctx *c, dg_case *a, ks_run *run, kv_err *e)
{
    const int64_t p = c->d->pos;
    /* p on the other layers first (l was scored by score_at_p). */
    for (int li = 1; li < run->nl; li++)
        if (run->last[li] >= p && score_place(c, a, run, run->layers[li], p, e) < 0)
            return -1;
    for (int li = 0; li < run->nl; li++)
        for (int64_t q = next_pos(p, p, run->last[li]); q <= run->last[li];
             q = next_pos(p, q, run->last[li])) {
            if (score_place(c, a, run, run->layers[li], q, e) < 0)
                return -1;
            if (q == run->last[li])
                break;
        }
    return 0;
}

/* A window larger than the config's (or none) that fit p + ... and then
 * failed: the first position where the test stops reading every key is
 * the window's size. Adds that window as a candidate. */
static int solve_larger_window(cmp_ctx *c, ks_run *run, kv_err *e)
{
    const ks_cand *g = NULL;
    int64_t stop = -1;
    for (int i = 0; i < run->n; i++) {
        const ks_cand *k = &run->k[i];
        if (k->kind != CMP_DIAG_LAYER_TYPE || k->n != KS_ALL || k->places == 0)
            continue;
        const int64_t s = !k->alive && k->fail_layer == c->d->layer && k->fail_pos > c->d->pos
                              ? k->fail_pos : k->miss_pos;
        if (s > c->d->pos && (!g || s < stop))
            g = k, stop = s;
    }
    if (!g)
        return 0;
    if (!g->alive && stop == g->fail_pos && g->fail_test_n > 0 &&
        g->fail_test_n < g->fail_pos + 1) {
        add(run, CMP_DIAG_WINDOW, g->fail_test_n, 0, g->scope);
        return 0;
    }
    int64_t lo = g->last_pos < stop ? g->last_pos : c->d->pos, hi = stop;   /* every key fits
                                                                             * at lo, not at hi */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        cmp_hyp h = {.lo = 0, .hi = mid};
        double err;
        int64_t tn;
        int rc = dg_attn_err_at(c, c->d->layer, mid, &h, false, &err, &tn, e);
        if (rc < 0)
            return -1;
        if (rc == 1)
            return 0;
        if (err <= c->attn_tol)
            lo = mid;
        else
            hi = mid;
    }
    add(run, CMP_DIAG_WINDOW, hi, 0, g->scope);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Which layers read otherwise                                          */

/* At one late position q, each layer's attention recomputed over the
 * config's keys, every key, and each window the config or the verdict
 * names: the layers whose test rows fit another than the config's. */
static int survey_layers(cmp_ctx *c, int64_t q, int64_t n_found, char *buf, size_t n,
                         int *n_other, kv_err *e)
{
    const kv_config *cfg = c->cfg;
    int64_t sizes[8];
    int ns = 0;
    sizes[ns++] = KS_ALL;
    if (n_found > 0 && n_found != KS_ALL)
        sizes[ns++] = n_found;
    for (int L = 0; L < cfg->n_layers && ns < 8; L++) {
        const int w = config_layer_window(cfg, L);
        bool seen = w <= 0;
        for (int i = 0; i < ns; i++)
            seen |= sizes[i] == w;
        if (!seen)
            sizes[ns++] = w;
    }
    buf[0] = '\0';
    *n_other = 0;
    for (int L = 0; L < cfg->n_layers; L++) {
        const int w = config_layer_window(cfg, L);
        cmp_hyp h = {.lo = window_lo(w, q), .hi = q};
        double err;
        int64_t tn;
        int rc = dg_attn_err_at(c, L, q, &h, false, &err, &tn, e);
        if (rc < 0)
            return -1;
        if (rc == 1 || err <= c->attn_tol)
            continue;
        for (int i = 0; i < ns; i++) {
            const int64_t s = sizes[i];
            h.lo = s == KS_ALL || q - s + 1 < 0 ? 0 : q - s + 1;
            if (h.lo == window_lo(w, q))
                continue;
            rc = dg_attn_err_at(c, L, q, &h, false, &err, &tn, e);
            if (rc < 0)
                return -1;
            if (rc == 0 && err <= c->attn_tol) {
                if (s == KS_ALL)
                    dg_append(buf, n, "%s%d global", *n_other ? ", " : "", L);
                else
                    dg_append(buf, n, "%s%d window %lld", *n_other ? ", " : "", L,
                              (long long)s);
                (*n_other)++;
                break;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Texts                                                                */

static const char *kind_phrase(cmp_diag_kind k)
{
    switch (k) {
    case CMP_DIAG_WINDOW: return "a sliding window of another size";
    case CMP_DIAG_LAYER_TYPE: return "the layer read as the other type";
    case CMP_DIAG_CHUNK_ISOLATED: return "chunks attending only to themselves";
    case CMP_DIAG_DECODE_BLIND: return "decode steps blind to the prefill";
    case CMP_DIAG_EXTRA_KEY: return "an unwritten slot attended as a key";
    case CMP_DIAG_PADDED_SLOTS: return "unwritten slots read as keys";
    case CMP_DIAG_DECODE_STUCK: return "a decode write index stuck";
    case CMP_DIAG_RING_NO_WRAP: return "a ring buffer not wrapping";
    case CMP_DIAG_STALE_CACHE: return "a sliding cache read from an earlier state";
    case CMP_DIAG_MISSING_KEY: return "one key left out";
    case CMP_DIAG_DUP_KEY: return "one key read twice";
    case CMP_DIAG_OWN_KEY_MASKED: return "the query's own key masked";
    default: return "another key set";
    }
}

static const char *cache_named(const cmp_ctx *c)
{
    const cmp_source *run = cmp_settings_int(c->test, "chunk", 0) > 0 ? c->test : c->ref;
    return cmp_settings_is(run, "cache", "split") ? "split" : cmp_settings_is(run, "cache", "dense")
                                                                ? "dense"
                                                            : cmp_settings_is(run, "cache", "ring")
                                                                ? "ring" : NULL;
}

/* Cause (summary) and parameters (detail) of the one survivor. */
static void survivor_text(cmp_ctx *c, const dg_case *a, const ks_cand *k, const char *layers,
                          int n_other)
{
    const int64_t p = c->d->pos;
    const int l = c->d->layer;
    char *s = c->g->summary, *t = c->g->detail, keys[64];
    const size_t ns = sizeof c->g->summary, nd = sizeof c->g->detail;
    dg_counts_phrase(c, keys, sizeof keys);
    c->g->kind = k->kind;
    const long long pp = (long long)p, last = (long long)k->last_pos;
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
        dg_say(s, ns, "attention read a different key set at the sliding-window boundary");
        dg_say(t, nd, "(window in test appears to be %lld, config says %d%s)", (long long)k->n,
               a->W, k->scope == SCOPE_LAYER ? "; on this layer alone: the other sliding layers "
                                               "read as the config says" : "");
        break;
    case CMP_DIAG_LAYER_TYPE:
        if (k->n == KS_ALL)
            dg_say(s, ns, "layer %d attends every key at every position checked (%lld..%lld): "
                   "it is global in the test; the config says sliding (window %d)", l, pp, last,
                   a->W);
        else
            dg_say(s, ns, "layer %d, global in the config, read through a window of %lld keys%s",
                   l, (long long)k->n, a->W == 0 && config_layer_window(c->cfg, 0) ==
                   (int)k->n ? "" : "");
        if (n_other > 0)
            dg_say(t, nd, "(layers read otherwise than the config at position %lld: %s; %s)",
                   last, layers, keys);
        else
            dg_say(t, nd, "(%s at position %lld; every other layer reads as the config says)",
                   keys, pp);
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
        dg_say(s, ns, "attention read a different key set at a chunk boundary: chunks attend "
               "only to themselves");
        if (p >= a->P && a->P > 0)
            dg_say(t, nd, "(%s at decode position %lld: each step saw only its own token)",
                   keys, pp);
        else if (a->C_inferred)
            dg_say(t, nd, "(%s at position %lld, where a chunk starts; the engine settings do "
                   "not give the chunk size)", keys, pp);
        else
            dg_say(t, nd, "(%s at position %lld, the first of a chunk of %lld)", keys, pp,
                   (long long)a->C);
        break;
    case CMP_DIAG_DECODE_BLIND: {
        const char *cache = cache_named(c);
        if (last <= pp) {
            dg_say(s, ns, "decode steps attend only to the decode cache, never to the prefill's "
                   "keys");
            dg_say(t, nd, "(%s at position %lld = prompt length)", keys, pp);
            break;
        }
        dg_say(s, ns, "decode steps attend only to the decode cache, never to the prefill's "
               "keys%s", cache && strcmp(cache, "split") ? " (though the settings call the "
               "cache one piece)" : cache ? " (a split prefill/decode cache)" : "");
        dg_say(t, nd, "(%s at position %lld = prompt length; at %lld the test read positions "
               "%lld..%lld, the decode steps so far, and so on up to %lld: the prefill's %lld "
               "keys (positions 0..%lld) are never read)", keys, pp, pp + 1, (long long)a->P,
               pp + 1, last, (long long)a->P, (long long)a->P - 1);
        break;
    }
    case CMP_DIAG_EXTRA_KEY:
    case CMP_DIAG_PADDED_SLOTS:
        if (k->variant == 1)
            dg_say(s, ns, "attention read unwritten (zero) slots as keys: a cache of %lld slots "
                   "read whole (its padding not masked)", (long long)k->n);
        else if (k->n == 1 && p == a->P)
            dg_say(s, ns, "at the first decode step: one extra key (off-by-one in the "
                   "prefill/decode mask)");
        else if (k->n == 1)
            dg_say(s, ns, "one extra key: an unwritten (zero) slot attended as a key (an "
                   "off-by-one in a mask)");
        else
            dg_say(s, ns, "attention read %lld unwritten (zero) slots as keys at every step "
                   "(padded slots of a fixed-size cache not masked)", (long long)k->n);
        dg_say(t, nd, "(%s at position %lld%s)", keys, pp, p == a->P ? " = prompt length" : "");
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY: {
        const bool miss = k->kind == CMP_DIAG_MISSING_KEY;
        dg_say(s, ns, "attention read one key %s: the key at position %lld %s",
               miss ? "too few" : "too many", (long long)k->n, miss
               ? "is not read (removed from the cache, or masked out)"
               : "is read twice (written to the cache twice, or a stray cell of the sequence)");
        dg_say(t, nd, "(%s at position %lld; the config's key set is %lld..%lld)", keys, pp,
               (long long)a->lo_ref, pp);
        break;
    }
    case CMP_DIAG_OWN_KEY_MASKED:
        dg_say(s, ns, "the query's own key is masked out: position q reads keys up to q - 1 "
               "(a strict mask, j < q, where j <= q is due)");
        dg_say(t, nd, "(%s at position %lld)", keys, pp);
        break;
    case CMP_DIAG_DECODE_STUCK:
        dg_say(s, ns, "decode write index stuck at slot %lld: every decode step overwrites it",
               (long long)k->n);
        dg_say(t, nd, "(%s at position %lld; the prompt is %lld tokens)", keys, pp,
               (long long)a->P);
        break;
    case CMP_DIAG_RING_NO_WRAP:
        dg_say(s, ns, "keys read from a slot the ring did not overwrite (ring buffer not "
               "wrapping)");
        if (a->R == 0)
            dg_say(t, nd, "(%s at position %lld, the first position the ring did not store: a "
                   "ring of %lld slots; the engine settings do not give its size)", keys, pp,
                   (long long)k->n);
        else if (p == a->R)
            dg_say(t, nd, "(%s at position %lld = ring size: window %d + chunk %lld)", keys, pp,
                   a->W, (long long)a->C);
        else
            dg_say(t, nd, "(%s at position %lld, past the ring size %lld: window %d + chunk "
                   "%lld)", keys, pp, (long long)a->R, a->W, (long long)a->C);
        break;
    case CMP_DIAG_STALE_CACHE:
        dg_say(s, ns, "stale values: the sliding cache read is from an earlier state (state not "
               "synced between chunk calls)");
        if (p >= a->P)
            dg_say(t, nd, "(%s at position %lld, a decode step)", keys, pp);
        else if (a->C_inferred)
            dg_say(t, nd, "(%s at position %lld, where a chunk starts; the engine settings do "
                   "not give the chunk size)", keys, pp);
        else
            dg_say(t, nd, "(%s at position %lld, the first of a chunk of %lld)", keys, pp,
                   (long long)a->C);
        break;
    default:
        break;
    }
}

/* Whether the test holds attention rows of layer L at q. */
static bool held_at(const cmp_ctx *c, int L, int64_t q, int64_t *hi)
{
    int64_t lo;
    *hi = -1;
    const int cols = cmp_stage_cols(c->cfg, L, STAGE_ATTN_OUT);
    if (cmp_source_held(c->test, L, STAGE_ATTN_OUT, cols, &lo, hi) != 0 &&
        cmp_source_held(c->test, L, STAGE_ATTN_NKEYS, c->cfg->n_heads, &lo, hi) != 0)
        return false;
    return q >= lo && q <= *hi;
}

static bool scored(const ks_run *run, int L, int64_t q)
{
    for (int i = 0; i < run->nscored; i++)
        if (run->scored_layer[i] == L && run->scored_pos[i] == q)
            return true;
    return false;
}

/* While several candidates live: the first place (position, layer) up to
 * a horizon where two of them read different keys, scored where the test
 * holds it; where it does not, buf says what to record or run. */
static int separate_more(cmp_ctx *c, dg_case *a, ks_run *run, char *buf, size_t n, kv_err *e)
{
    const int64_t p = c->d->pos;
    const int64_t horizon = p + cmp_diag_span(c->cfg);
    buf[0] = '\0';
    for (int iter = 0; iter < 64 && alive_count(run) > 1; iter++) {
        int64_t fq = -1;
        int fL = -1;
        for (int64_t q = p; q <= horizon && fq < 0; q++)
            for (int L = 0; L < c->cfg->n_layers && fq < 0; L++) {
                if (scored(run, L, q))
                    continue;
                cmp_hyp first, h;
                bool have = false;
                for (int i = 0; i < run->n && fq < 0; i++) {
                    if (!run->k[i].alive || !ks_keys(c, a, &run->k[i], L, q, &h))
                        continue;
                    if (have && !hyp_same(&first, &h))
                        fq = q, fL = L;
                    first = h;
                    have = true;
                }
            }
        if (fq < 0) {
            bool chunked = false;
            for (int i = 0; i < run->n; i++)
                chunked |= run->k[i].alive && run->k[i].kind == CMP_DIAG_CHUNK_ISOLATED;
            dg_say(buf, n, "they read the same keys at every layer up to position %lld: "
                   "attention cannot tell them apart%s", (long long)horizon, chunked
                   ? "; a run with another chunk size would (isolated chunks follow the chunk, "
                     "the others do not)" : "");
            return 0;
        }
        int64_t hi;
        if (held_at(c, fL, fq, &hi)) {
            if (score_place(c, a, run, fL, fq, e) < 0)
                return -1;
            continue;
        }
        if (fq > hi)
            dg_say(buf, n, "they read different keys at position %lld, which the test did not "
                   "reach: run at least %lld positions (a longer prompt or more decode steps)",
                   (long long)fq, (long long)(fq + 1));
        else
            dg_say(buf, n, "they read different keys at layer %d, position %lld, which the test "
                   "did not record: record layer %d's q, k, v and attention", fL, (long long)fq,
                   fL);
        return 0;
    }
    return 0;
}

/* The scores as the JSON lists them: the survivors, the rivals that
 * reproduced p and failed later, then the rest. */
static void keep_scores(cmp_ctx *c, const ks_run *run, bool verified)
{
    cmp_diagnosis *g = c->g;
    g->n_hyps = 0;
    for (int pass = 0; pass < 3; pass++)
        for (int i = 0; i < run->n && g->n_hyps < CMP_MAX_HYPS; i++) {
            const ks_cand *k = &run->k[i];
            const bool close = !k->alive && k->err_p <= c->attn_tol && k->fail_err >= 0;
            if (k->merged || (pass == 0 && !k->alive) || (pass == 1 && !close) ||
                (pass == 2 && (k->alive || close)))
                continue;
            cmp_hyp_score *h = &g->hyps[g->n_hyps++];
            h->kind = k->kind;
            char par[64];
            param_text(c, k, par, sizeof par);
            dg_say(h->keys, sizeof h->keys, "%s%s%s", k->what, par[0] ? ";" : "",
                   par[0] ? par + 1 : "");
            h->status = k->alive ? (verified ? CMP_HYP_VERIFIED : CMP_HYP_REMAINS)
                                 : CMP_HYP_REFUTED;
            h->err = k->err_p;
            h->places = k->places;
            h->refuted_pos = k->alive ? -1 : k->fail_pos;
            h->refuted_layer = k->alive ? -1 : k->fail_layer;
            h->refuted_err = k->alive || k->fail_err < 0 ? NAN : k->fail_err;
        }
}

/* The parameter that tells apart candidates of one kind, in words. */
static void param_text(const cmp_ctx *c, const ks_cand *k, char *buf, size_t n)
{
    buf[0] = '\0';
    switch (k->kind) {
    case CMP_DIAG_WINDOW:
    case CMP_DIAG_LAYER_TYPE:
        if (k->n == KS_ALL)
            dg_say(buf, n, ", every key");
        else
            dg_say(buf, n, ", %lld key%s", (long long)k->n, k->n == 1 ? "" : "s");
        if (k->scope == SCOPE_LAYER)
            dg_append(buf, n, " on layer %d alone", c->d->layer);
        else
            dg_append(buf, n, " on every %s layer",
                      config_layer_window(c->cfg, c->d->layer) > 0 ? "sliding" : "global");
        break;
    case CMP_DIAG_CHUNK_ISOLATED:
        dg_say(buf, n, ", chunk %lld", (long long)k->n);
        break;
    case CMP_DIAG_MISSING_KEY:
    case CMP_DIAG_DUP_KEY:
        dg_say(buf, n, ", key %lld", (long long)k->n);
        break;
    case CMP_DIAG_DECODE_STUCK:
        dg_say(buf, n, ", slot %lld", (long long)k->n);
        break;
    case CMP_DIAG_PADDED_SLOTS:
        dg_say(buf, n, k->variant == 1 ? ", a cache of %lld" : ", %lld slots", (long long)k->n);
        break;
    default:
        break;
    }
    if (k->from > 0 && k->kind != CMP_DIAG_DECODE_BLIND && k->kind != CMP_DIAG_DECODE_STUCK)
        dg_append(buf, n, ", from position %lld", (long long)k->from);
}

/* Up to two rivals refuted after p (the close ones: they reproduced p),
 * with where and how; then how many the positions before p refute (the
 * test read the config's keys there) and how many fail at p itself. */
static void rivals_text(cmp_ctx *c, const ks_run *run, char *buf, size_t n)
{
    int shown = 0, at_p = 0, before = 0;
    for (int i = 0; i < run->n; i++) {
        const ks_cand *k = &run->k[i];
        if (k->alive || k->merged)
            continue;
        if (k->fail_err < 0) {
            before++;
            continue;
        }
        if (k->fail_pos == c->d->pos && k->fail_layer == c->d->layer) {
            at_p++;
            continue;
        }
        if (shown == 2)
            continue;
        char par[64];
        param_text(c, k, par, sizeof par);
        dg_append(buf, n, "; %s (%s%s) fails at position %lld", kind_phrase(k->kind),
                  cmp_diag_name(k->kind), par, (long long)k->fail_pos);
        if (k->fail_layer != c->d->layer)
            dg_append(buf, n, " of layer %d", k->fail_layer);
        if (isinf(k->fail_err) && k->fail_test_n >= 0)
            dg_append(buf, n, " (it reads %lld key%s there, the test %lld)",
                      (long long)k->fail_n, k->fail_n == 1 ? "" : "s",
                      (long long)k->fail_test_n);
        else
            dg_append(buf, n, " (error %.2g)", k->fail_err);
        shown++;
    }
    if (before > 0)
        dg_append(buf, n, "; %d other cause%s would have changed positions before %lld, where "
                  "the test read the config's keys", before, before == 1 ? "" : "s",
                  (long long)c->d->pos);
    if (at_p > 0)
        dg_append(buf, n, "; %d other cause%s tried fail%s at position %lld itself", at_p,
                  at_p == 1 ? "" : "s", at_p == 1 ? "s" : "", (long long)c->d->pos);
}

/* Candidates of one kind that predict the same keys at every layer and
 * position up to the horizon are one cause: the later ones are merged
 * into the first. */
static void merge_equivalent(const cmp_ctx *c, const dg_case *a, ks_run *run)
{
    const int64_t horizon = c->d->pos + cmp_diag_span(c->cfg);
    for (int i = 0; i < run->n; i++)
        for (int j = i + 1; j < run->n; j++) {
            ks_cand *x = &run->k[i], *y = &run->k[j];
            if (!x->alive || !y->alive || x->kind != y->kind)
                continue;
            bool same = true;
            for (int64_t q = 0; q <= horizon && same; q++)
                for (int L = 0; L < c->cfg->n_layers && same; L++) {
                    cmp_hyp hx, hy;
                    const bool px = ks_keys(c, a, x, L, q, &hx), py = ks_keys(c, a, y, L, q, &hy);
                    same = px == py && (!px || hyp_same(&hx, &hy));
                }
            if (same) {
                y->alive = false;
                y->merged = true;
            }
        }
}

/* ------------------------------------------------------------------ */
/* The rule                                                             */

static int verdict(cmp_ctx *c, dg_case *a, ks_run *run, double cfg_err, const char *sep,
                   kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const int64_t p = c->d->pos;
    const char *rows = dg_recorded_attn(c);
    const char *own = a->ref_rows_used ? " (the reference's: the test did not record them)"
                      : c->attn_checked ? " (rounded as the test holds them, as the attention "
                                          "check does)" : "";
    char *s = c->g->summary, *t = c->g->detail, *v = c->g->evidence;
    const size_t ns = sizeof c->g->summary, nd = sizeof c->g->detail,
                 nv = sizeof c->g->evidence;
    c->g->basis = CMP_BASIS_RECOMPUTED;
    if (alive_count(run) > 1) {
        char keys[64];
        dg_counts_phrase(c, keys, sizeof keys);
        c->g->kind = CMP_DIAG_KEY_SET;
        c->g->undecided = true;
        if (run->counts_only)
            c->g->basis = CMP_BASIS_HEURISTIC;
        dg_say(s, ns, "attention read a different key set: ");
        if (run->counts_only)
            dg_say(v, nv, "from key counts only (attention could not be recomputed): each of "
                   "these reads the test's %d key%s at position %lld:", ev->nkeys_test,
                   ev->nkeys_test == 1 ? "" : "s", (long long)p);
        else
            dg_say(v, nv, "recomputing attention from the test's q, k, v%s reproduces its %s "
                   "at position %lld over each of", own, rows, (long long)p);
        int shown = 0;
        const int alive = alive_count(run);
        int64_t last = p;
        for (int i = 0; i < run->n; i++) {
            const ks_cand *k = &run->k[i];
            if (!k->alive)
                continue;
            last = k->last_pos > last ? k->last_pos : last;
            dg_append(s, ns, "%s%s (%s)", shown == 0 ? (alive == 2 ? "either " : "one of ")
                      : shown == alive - 1 ? " or " : ", ", kind_phrase(k->kind),
                      cmp_diag_name(k->kind));
            if (run->counts_only)
                dg_append(v, nv, "%s %s", shown ? ";" : "", k->what);
            else
                dg_append(v, nv, "%s %s (%.2g)", shown ? ";" : "", k->what, k->err_p);
            shown++;
        }
        if (last > p)
            dg_append(v, nv, "; and every place tried up to position %lld fits each alike",
                      (long long)last);
        rivals_text(c, run, v, nv);
        if (run->none_fit > 0)
            dg_say(t, nd, "(%s at position %lld; at position %lld of layer %d none of them "
                   "reproduces the test: something else happens there, and no later place "
                   "decides)", keys, (long long)p, (long long)run->none_pos, run->none_layer);
        else
            dg_say(t, nd, "(%s at position %lld; %s)", keys, (long long)p, sep);
        keep_scores(c, run, false);
        return 1;
    }
    const ks_cand *k = NULL;
    for (int i = 0; i < run->n; i++)
        if (run->k[i].alive)
            k = &run->k[i];
    char layers[256] = "";
    int n_other = 0;
    if ((k->kind == CMP_DIAG_LAYER_TYPE || k->kind == CMP_DIAG_WINDOW) && k->last_pos > p &&
        survey_layers(c, k->last_pos, k->n, layers, sizeof layers, &n_other, e) < 0)
        return -1;
    survivor_text(c, a, k, layers, n_other);
    ev->recompute = 1;
    ev->hyp_err = k->err_p;
    dg_say(ev->hypothesis, sizeof ev->hypothesis, "%s", k->what);
    const bool verified = k->misses == 0 && !run->counts_only;
    c->g->basis = verified ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC;
    if (run->counts_only)
        dg_say(v, nv, "from key counts only (attention could not be recomputed from the "
               "recordings: %s): %s reads the test's %d key%s at position %lld",
               isfinite(ev->ref_check_err) ? "our recomputation does not reproduce the reference"
                                           : "q, k or v not recorded", k->what, ev->nkeys_test,
               ev->nkeys_test == 1 ? "" : "s", (long long)p);
    else
        dg_say(v, nv, "recomputing attention from the test's q, k, v%s over %s reproduces its %s "
               "(error %.2g)", own, k->what, rows, k->err_p);
    if (k->places > 1)
        dg_append(v, nv, " and %d more place%s up to position %lld%s", k->places - 1,
                  k->places == 2 ? "" : "s", (long long)k->last_pos,
                  run->nl > 1 ? " over the layers of each kind" : "");
    if (isfinite(cfg_err))
        dg_append(v, nv, "; the config's keys do not (%.2g)", cfg_err);
    if (ev->ref_check_err <= c->attn_tol)
        dg_append(v, nv, "; the config's key set reproduces the reference (%.2g)",
                  ev->ref_check_err);
    if (run->used_counts && !run->counts_only)
        dg_append(v, nv, "; where q, k, v were not recorded, by key counts");
    if (k->misses > 0)
        dg_append(v, nv, "; but at %d place%s of layer %d nothing tried fits (something else "
                  "happens there)", k->misses, k->misses == 1 ? "" : "s", c->d->layer);
    else if (k->misses_other > 0)
        dg_append(v, nv, "; at %d place%s of other layers nothing tried fits (their keys are "
                  "not all in the recordings)", k->misses_other, k->misses_other == 1 ? "" : "s");
    rivals_text(c, run, v, nv);
    if (c->r->xrt.on)
        dg_append(v, nv, "; errors up to %.2g count as reproducing: %s (KV cache %s)",
                  c->attn_tol, c->attn_checked ? "the attention check's threshold"
                                               : "the drift model's floor at attn_out",
                  c->r->xrt.kv_precision);
    keep_scores(c, run, verified);
    return 1;
}

int dg_rule_keyset(cmp_ctx *c, dg_case *a, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    if (!dg_is_attn_stage(d->stage))
        return 0;
    const bool lse_differs = ev->lse_ref && ev->lse_test &&
                             memcmp(ev->lse_ref, ev->lse_test, (size_t)ev->n_heads * sizeof(float));
    const bool nkeys_differ = ev->nkeys_ref >= 0 && ev->nkeys_test >= 0 &&
                              ev->nkeys_ref != ev->nkeys_test;
    /* A runtime that records neither (llama.cpp): attn_out alone, and
     * only recomputation can say the key set is what differs. */
    const bool counts_unknown = !ev->lse_test && ev->nkeys_test < 0;
    if (!lse_differs && !nkeys_differ && !counts_unknown)
        return 0;
    /* The test read the config's key set and the reference did not: no
     * key set of the test's is to blame. */
    const int64_t n_cfg = d->pos - a->lo_ref + 1;
    if (nkeys_differ && ev->nkeys_test == n_cfg && ev->nkeys_ref != n_cfg) {
        dg_set(c, CMP_DIAG_KEY_SET, CMP_BASIS_HEURISTIC, "attention read a different key set");
        dg_say(c->g->detail, sizeof c->g->detail, "(the reference read %d keys at position "
               "%lld where the config's key set holds %lld, and the test reads those %lld: it "
               "is the reference that is not the config's; were the recordings given the wrong "
               "way round? the reference goes first)", ev->nkeys_ref, (long long)d->pos,
               (long long)n_cfg, (long long)n_cfg);
        return 1;
    }
    cmp_hyp ref = dg_hyp_config(d, a);
    if (dg_hyp_err(c, a, &ref, true, &ev->ref_check_err, e) < 0)
        return -1;
    const bool trusted = ev->ref_check_err <= c->attn_tol;
    double cfg_err = NAN;
    if (trusted && counts_unknown) {
        if (dg_hyp_err(c, a, &ref, false, &cfg_err, e) < 0)
            return -1;
        if (!(cfg_err > c->attn_tol))
            return 0;   /* the config's keys reproduce the test (or cannot be tried) */
    }
    ks_run *run = calloc(1, sizeof *run);
    if (!run)
        return kv_errf(e, "compare: out of memory");
    run->unrec_pos = -1;
    run->none_pos = -1;
    /* Attention that cannot be recomputed is still counted: the test's key
     * counts at p and after score each candidate's, as a heuristic. */
    run->counts_only = !trusted && ev->nkeys_test >= 0;
    int rc = 0, fit = 0;
    if (trusted || run->counts_only) {
        if (trusted)
            ev->recompute = 0;
        rc = propose(c, a, run, e);
        if (rc == 0)
            fit = score_at_p(c, a, run, e);
        rc = fit < 0 ? -1 : rc;
    }
    if (rc == 0 && fit > 0) {
        pick_layers(c, run);
        rc = score_all(c, a, run, e);
        if (rc == 0 && solve_larger_window(c, run, e) < 0)
            rc = -1;
        if (rc == 0 && run->n > 0 && run->k[run->n - 1].alive &&
            run->k[run->n - 1].places == 0) {
            /* a window solved after the first pass: everything scored again */
            ks_cand *w = &run->k[run->n - 1];
            cmp_hyp h;
            ks_keys(c, a, w, d->layer, d->pos, &h);
            ks_describe(c, a, w);
            if (dg_hyp_err(c, a, &h, false, &w->err_p, e) < 0)
                rc = -1;
            w->alive = w->err_p <= c->attn_tol &&
                       !refuted_before(c, a, w, &w->fail_pos, &w->fail_layer);
            for (int i = 0; i < run->n; i++)
                if (run->k[i].alive) {
                    run->k[i].places = 1;
                    run->k[i].misses = 0;
                    run->k[i].misses_other = 0;
                    run->k[i].miss_pos = -1;
                    run->k[i].last_pos = d->pos;
                }
            run->nscored = 1;
            run->none_fit = 0;
            run->none_pos = -1;
            if (rc == 0 && w->alive)
                rc = score_all(c, a, run, e);
        }
    }
    char sep[256] = "";
    if (rc == 0 && fit > 0)
        merge_equivalent(c, a, run);
    if (rc == 0 && fit > 0 && alive_count(run) > 1)
        rc = separate_more(c, a, run, sep, sizeof sep, e);
    if (rc == 0 && fit > 0 && alive_count(run) > 0) {
        rc = verdict(c, a, run, cfg_err, sep, e);
        free(run);
        return rc;
    }
    free(run);
    if (rc < 0)
        return -1;
    if (counts_unknown || d->nonfinite)
        return 0;   /* no key set explains it: leave it to the rules after this one */
    /* Nothing reproduces the test: say what differs, and how far it got. */
    char keys[64];
    dg_counts_phrase(c, keys, sizeof keys);
    dg_set(c, CMP_DIAG_KEY_SET, CMP_BASIS_HEURISTIC, ev->qkv == -1
           ? "attention differs: a different key set, or different q, k, v (not all recorded)"
           : "attention read a different key set");
    dg_say(c->g->detail, sizeof c->g->detail, "(%s at position %lld)", keys, (long long)d->pos);
    if (trusted)
        dg_say(c->g->evidence, sizeof c->g->evidence, "none of the key sets tried (windows, "
               "layer types, chunks, decode blind to the prefill, one key left out or read "
               "twice, the own key masked, unwritten slots, a stuck write index, a ring, a "
               "stale cache) reproduces the test's %s", dg_recorded_attn(c));
    else
        dg_say(c->g->evidence, sizeof c->g->evidence, "from key counts only: attention could "
               "not be recomputed from the recordings (%s)",
               isfinite(ev->ref_check_err) ? "our recomputation does not reproduce the reference"
                                           : "q, k or v not recorded");
    return 1;
}
