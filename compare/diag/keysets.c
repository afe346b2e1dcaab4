/* keysets.c — the key-set hypothesis engine (docs/diagnosis.md, "The
 * hypothesis engine"); the families it scores are in keyfams.c.
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
 * side with the data that would separate them. A cause that may live in
 * one layer's code (one key left out or read twice, the own key masked)
 * is proposed on every layer, on l's kind and on l alone: a narrower
 * scope predicts the config's keys on the layers it leaves out, so those
 * layers decide between the scopes, and one that no place tells from the
 * wider is folded into it (named without a scope, the evidence saying
 * which stays open). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "keysets.h"

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
 * predicts other keys at such a place is refuted there (k->alive false,
 * k->fail_*: fail_err -1, by the walk). Across runtimes "the reference's" means within
 * drift, and a quantized cache's drift can hold a key set that differs
 * (a window of 256 of 512 on the first sliding layers of gemma3-1b-shape
 * with a q8_0 cache moves attn_out by 0.014, under the attention check's
 * 0.0196): there the first such place of each layer is recomputed, and
 * refutes only where the candidate's keys do not reproduce the test's
 * own rows (fail_err that error); where they do, the first such place
 * is kept as where it acts (k->act_*). 1 refuted, 0 not, -1 on error. */
static int refuted_before(cmp_ctx *c, const dg_case *a, ks_cand *k, bool counts_only,
                          kv_err *e)
{
    const int64_t p = c->d->pos;
    for (int L = 0; L < c->cfg->n_layers; L++) {
        int64_t lo, hi;
        if (dg_attn_held(c, L, &lo, &hi) != 0)
            continue;
        const int W = config_layer_window(c->cfg, L);
        for (int64_t x = lo; x <= (L < c->d->layer ? p : p - 1) && x <= hi; x++) {
            cmp_hyp h;
            const cmp_hyp cfg = {.lo = ks_window_lo(W, x), .hi = x};
            if (!ks_keys(c, a, k, L, x, &h) || ks_hyp_same(&h, &cfg))
                continue;
            double err = -1;
            int64_t tn;
            const int rc = c->r->xrt.on && !counts_only
                               ? dg_attn_err_at(c, L, x, &h, false, &err, &tn, e)
                               : 1;
            if (rc < 0)
                return -1;
            if (rc != 0 || !(err <= c->attn_tol)) {
                /* (not recomputed: the walk's word stands) */
                k->alive = false;
                k->fail_pos = x;
                k->fail_layer = L;
                k->fail_err = rc != 0 ? -1 : err;
                return 1;
            }
            /* It reproduces the test here too: the first such place is
             * where it acts, if the config's keys leave more. */
            double cfg_err;
            if (k->act_pos < 0 || x < k->act_pos || (x == k->act_pos && L < k->act_layer)) {
                if (dg_attn_err_at(c, L, x, &cfg, false, &cfg_err, &tn, e) < 0)
                    return -1;
                if (cfg_err > CMP_ROT_BACK * err) {
                    k->act_pos = x;
                    k->act_layer = L;
                    k->act_err = err;
                    k->act_cfg_err = cfg_err;
                }
            }
            break;   /* the next layer */
        }
    }
    return 0;
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
        const int rb = refuted_before(c, a, k, run->counts_only, e);
        if (rb < 0)
            return -1;
        if (rb == 1)
            continue;
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
        run->last[i] = -1;
        if (dg_attn_held(c, run->layers[i], &lo, &hi) == 0)
            run->last[i] = hi;   /* past a token cut too: the test's own rows agree */
        if (run->last[i] > c->d->pos + cmp_diag_span(cfg))
            run->last[i] = c->d->pos + cmp_diag_span(cfg);
    }
}

/* k refuted at (layer, q): the error there, the keys it predicted and
 * the test's count. */
static void refute(ks_cand *k, int layer, int64_t q, double err, const cmp_hyp *pred,
                   int64_t test_n)
{
    k->alive = false;
    k->fail_layer = layer;
    k->fail_pos = q;
    k->fail_err = err;
    k->fail_n = cmp_hyp_nkeys(pred);
    k->fail_test_n = test_n;
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
            if (has[j] && !done[j] && ks_hyp_same(&pred[i], &pred[j])) {
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
    if (run->trace)
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
        /* A narrower scope says the layers it leaves out read the config's
         * keys (the text says so): a place on such a layer where they do
         * not fit refutes its scope (the bug is not of that layer or kind
         * alone), where a wide cause only counts the miss. */
        const int W_here = config_layer_window(c->cfg, layer);
        for (int i = 0; i < run->n; i++) {
            ks_cand *k = &run->k[i];
            const bool outside = (k->scope == SCOPE_LAYER && layer != c->d->layer) ||
                                 (k->scope == SCOPE_KIND && W_here != a->W);
            if (has[i] && outside && ks_scoped_kind(k->kind))
                refute(k, layer, q, err[i], &pred[i], test_n[i]);
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
    if (fit == tried && distinct > 1 && run->alike_pos < 0) {
        run->alike_pos = q;
        run->alike_layer = layer;
    }
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
        refute(k, layer, q, err[i], &pred[i], test_n[i]);
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
        ks_add(run, CMP_DIAG_WINDOW, g->fail_test_n, 0, g->scope);
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
    ks_add(run, CMP_DIAG_WINDOW, hi, 0, g->scope);
    return 0;
}

/* ------------------------------------------------------------------ */
/* Which layers read otherwise                                          */

/* At one late position q, each layer's attention recomputed over the
 * config's keys, every key, and each window the config or the verdict
 * names: the layers whose test rows fit another than the config's. */
int dg_layer_survey(cmp_ctx *c, int64_t q, int64_t n_found, char *buf, size_t n,
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
        cmp_hyp h = {.lo = ks_window_lo(w, q), .hi = q};
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
            if (h.lo == ks_window_lo(w, q))
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

/* Whether the test holds attention rows of layer L at q. */
static bool held_at(const cmp_ctx *c, int L, int64_t q, int64_t *hi)
{
    int64_t lo;
    *hi = -1;
    return dg_attn_held(c, L, &lo, hi) == 0 && q >= lo && q <= *hi;
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
                    if (have && !ks_hyp_same(&first, &h))
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
 * reproduced p and failed later, then the rest, a cause on every layer
 * before its one-layer variants (the list is bounded). */
static void keep_scores(cmp_ctx *c, const ks_run *run, bool verified)
{
    cmp_diagnosis *g = c->g;
    g->n_hyps = 0;
    for (int pass = 0; pass < 4; pass++)
        for (int i = 0; i < run->n && g->n_hyps < CMP_MAX_HYPS; i++) {
            const ks_cand *k = &run->k[i];
            const bool close = !k->alive && k->err_p <= c->attn_tol && k->fail_err >= 0;
            const bool narrow = k->scope == SCOPE_LAYER && ks_scoped_kind(k->kind);
            if (k->merged || (pass == 0 && !k->alive) || (pass == 1 && !close) ||
                (pass >= 2 && (k->alive || close)) || (pass == 2 && narrow) ||
                (pass == 3 && !narrow))
                continue;
            cmp_hyp_score *h = &g->hyps[g->n_hyps++];
            h->kind = k->kind;
            char par[64];
            ks_param_text(c, k, par, sizeof par);
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
        ks_param_text(c, k, par, sizeof par);
        /* the cause in words; its id is in the JSON's hypotheses */
        dg_append(buf, n, "; %s%s%s%s fails at position %lld", ks_phrase(k->kind),
                  par[0] ? " (" : "", par[0] ? par + 2 : "", par[0] ? ")" : "",
                  (long long)k->fail_pos);
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
                    same = px == py && (!px || ks_hyp_same(&hx, &hy));
                }
            if (same) {
                y->alive = false;
                y->merged = true;
            }
        }
}

/* A narrower scope still alive beside a wider one of the same cause (the
 * same key, from the same position) was told apart from it nowhere: the
 * places that would (the layers it leaves out) fit both alike, or were
 * not recorded. The wider one is named, without claiming any scope; the
 * evidence says which narrower one the data leaves open. A narrower
 * scope is named only where those layers refuted the wider one. */
static void fold_open_scopes(const cmp_ctx *c, ks_run *run)
{
    for (int i = 0; i < run->n; i++)
        for (int j = 0; j < run->n; j++) {
            ks_cand *w = &run->k[i], *k = &run->k[j];
            if (i == j || !w->alive || !k->alive || w->kind != k->kind || w->n != k->n ||
                w->variant != k->variant || w->from != k->from || w->scope <= k->scope)
                continue;
            k->alive = false;
            k->merged = true;
            char scope[64], wide[64];
            ks_scope_text(c, k, scope, sizeof scope);
            ks_scope_text(c, w, wide, sizeof wide);
            char *only = strstr(wide, " only");
            if (only)
                *only = '\0';   /* "on the sliding layers", of them all */
            if (scope[0] && (!run->scope_open[0] || k->scope == SCOPE_LAYER))
                dg_say(run->scope_open, sizeof run->scope_open, "%s or %s",
                       wide[0]                ? wide + 1
                       : ks_sliding_kind(w->kind) ? "on every sliding layer"
                                                : "on every layer",
                       scope + 1);
        }
}

/* ------------------------------------------------------------------ */
/* The rule                                                             */

/* A stale sliding cache read as a dense cache and as a ring of W + C
 * slots (the cache unnamed) predict the same keys until the ring wraps:
 * one cause either way, not two. Where those two alone survive (one
 * scope, one start), the dense reading is kept and the ring's merged;
 * its size goes to *ring (0: nothing merged). */
static void merge_stale_readings(ks_run *run, int64_t *ring)
{
    *ring = 0;
    int dense = -1, wide = -1, n = 0;
    for (int i = 0; i < run->n; i++) {
        const ks_cand *k = &run->k[i];
        if (!k->alive)
            continue;
        if (k->kind != CMP_DIAG_STALE_CACHE || ++n > 2)
            return;
        if (k->variant == 1)
            wide = i;
        else
            dense = i;
    }
    if (dense < 0 || wide < 0 || run->k[dense].scope != run->k[wide].scope ||
        run->k[dense].from != run->k[wide].from)
        return;
    run->k[wide].alive = false;
    run->k[wide].merged = true;
    *ring = run->k[wide].n;
}

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
    int64_t ring = 0;
    merge_stale_readings(run, &ring);
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
            char scope[64];
            ks_scope_text(c, k, scope, sizeof scope);
            dg_append(s, ns, "%s%s%s", shown == 0 ? (alive == 2 ? "either " : "one of ")
                      : shown == alive - 1 ? " or " : ", ", ks_phrase(k->kind), scope);
            if (run->counts_only)
                dg_append(v, nv, "%s %s", shown ? ";" : "", k->what);
            else
                dg_append(v, nv, "%s %s (%.2g)", shown ? ";" : "", k->what, k->err_p);
            shown++;
        }
        if (last > p && run->none_fit == 0)   /* else the detail says where none fit */
            dg_append(v, nv, "; and every place tried up to position %lld fits each alike",
                      (long long)last);
        rivals_text(c, run, v, nv);
        if (run->none_fit > 0)
            dg_say(t, nd, "(%s at position %lld; at position %lld of layer %d none of them "
                   "reproduces the test: something else happens there, and no later place "
                   "decides)", keys, (long long)p, (long long)run->none_pos, run->none_layer);
        else if (run->alike_pos >= 0)
            dg_say(t, nd, "(%s at position %lld; at position %lld of layer %d they read "
                   "different keys and the test's %s fits them alike (the rows there weigh the "
                   "same): %s; %s)", keys, (long long)p, (long long)run->alike_pos,
                   run->alike_layer, rows, c->ev->lse_test ? "more positions would tell"
                   : "attn_lse, if recorded, would weigh the keys", sep);
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
        dg_layer_survey(c, k->last_pos, k->n, layers, sizeof layers, &n_other, e) < 0)
        return -1;
    ks_survivor_text(c, a, k, layers, n_other);
    /* inside the detail's parentheses */
    const size_t tl = strlen(t);
    const bool paren = (ring > 0 || (k->act_pos >= 0 && k->scope != SCOPE_LAYER)) && tl > 0 &&
                       t[tl - 1] == ')';
    if (paren)
        t[tl - 1] = '\0';
    if (ring > 0)
        dg_append(t, nd, "; a ring of %lld slots (window + chunk) would read the same keys "
                  "here: the two part once it wraps, at position %lld", (long long)ring,
                  (long long)ring);
    if (k->act_pos >= 0 && k->scope != SCOPE_LAYER)
        dg_append(t, nd, "; it acts first at position %lld of layer %d, where its keys "
                  "reproduce the test's %s (%.2g) and the config's leave %.2g, within the "
                  "drift of the test's cache there", (long long)k->act_pos, k->act_layer,
                  rows, k->act_err, k->act_cfg_err);
    if (paren)
        dg_append(t, nd, ")");
    ev->recompute = 1;
    ev->hyp_err = k->err_p;
    dg_say(ev->hypothesis, sizeof ev->hypothesis, "%s", k->what);
    /* Verified: it held at every place of its layer, and either a rival was
     * tried and failed or it held at more than one place. */
    int rivals = 0;
    for (int i = 0; i < run->n; i++)
        rivals += !run->k[i].alive && !run->k[i].merged;
    const bool verified = k->misses == 0 && !run->counts_only && (rivals > 0 || k->places > 1);
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
        dg_append(v, nv, "; it does so at %d more place%s up to position %lld%s", k->places - 1,
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
    if (run->scope_open[0])
        dg_append(v, nv, "; whether it acts %s, no place tried tells (the layers that would "
                  "fit both alike or were not recorded)", run->scope_open);
    rivals_text(c, run, v, nv);
    if (c->r->xrt.on)
        dg_append(v, nv, "; errors up to %.2g count as reproducing: %s (KV cache %s)",
                  c->attn_tol, c->attn_checked ? "the attention check's threshold"
                                               : "the drift model's floor at attn_out",
                  c->r->xrt.kv_precision);
    keep_scores(c, run, verified);
    return 1;
}

/* Nothing fits: is the test's attention any softmax over recorded keys at
 * all? Its attn_lse above that of every key the recording holds, each
 * read once, on some head means it weighed keys the dump does not hold
 * (slots with values never recorded, another sequence's cells) or read
 * some twice. buf (n bytes): that, for the detail, or "". 0, -1 on
 * error. */
static int beyond_recorded_keys(cmp_ctx *c, dg_case *a, char *buf, size_t n, kv_err *e)
{
    buf[0] = '\0';
    const kv_config *cfg = c->cfg;
    const float *lse_rec = c->ev->lse_test, *q = a->q_test;
    int64_t lo, hi;
    const int owner = cfg->kv_owner[c->d->layer];
    if (!lse_rec || !q ||
        cmp_source_held(c->test, owner, STAGE_K, cmp_stage_cols(cfg, owner, STAGE_K), &lo, &hi))
        return 0;
    const int H = cfg->n_heads, D = config_layer_head_dim(cfg, c->d->layer);
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    cmp_hyp all = {.lo = lo, .hi = hi};
    int rc = (!lse || !out) ? kv_errf(e, "compare: out of memory")
                            : cmp_recompute_attention(c->test, cfg, c->d->layer, q, &all, lse,
                                                      out, e);
    int head = -1;
    for (int h = 0; rc == 0 && h < H && head < 0; h++)
        if ((double)lse_rec[h] > lse[h] + c->attn_tol * fmax(1.0, fabs(lse[h])))
            head = h;
    if (head >= 0)
        dg_say(buf, n, "; on head %d its attn_lse (%.6g) is above that of every key the "
               "recording holds, %lld..%lld, read once (%.6g): it weighed keys the dump does not "
               "hold (slots whose values were never recorded, another sequence's cells) or read "
               "some twice", head, lse_rec[head], (long long)lo, (long long)hi, lse[head]);
    free(lse);
    free(out);
    return rc < 0 ? -1 : 0;
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
    run->alike_pos = -1;
    run->trace = getenv("KVDIFF_DIAG_TRACE") != NULL;
    /* Attention that cannot be recomputed is still counted: the test's key
     * counts at p and after score each candidate's, as a heuristic. */
    run->counts_only = !trusted && ev->nkeys_test >= 0;
    int rc = 0, fit = 0;
    if (trusted || run->counts_only) {
        if (trusted)
            ev->recompute = 0;
        rc = ks_propose(c, a, run, e);
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
            w->alive = rc == 0 && w->err_p <= c->attn_tol;
            if (w->alive && refuted_before(c, a, w, run->counts_only, e) < 0)
                rc = -1;
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
    if (rc == 0 && fit > 0)
        fold_open_scopes(c, run);
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
    char beyond[512] = "";
    if (trusted && beyond_recorded_keys(c, a, beyond, sizeof beyond, e) < 0)
        return -1;
    dg_say(c->g->detail, sizeof c->g->detail, "(%s at position %lld%s)", keys,
           (long long)d->pos, beyond);
    if (trusted)
        dg_say(c->g->evidence, sizeof c->g->evidence, "none of the key sets tried (windows, "
               "layer types, chunks, decode blind to the prefill, one key left out or read "
               "twice and the own key masked (each on every layer, its kind or this layer "
               "alone), the causal mask missing, unwritten slots, a stuck "
               "write index, a ring, a stale cache) reproduces the test's %s",
               dg_recorded_attn(c));
    else
        dg_say(c->g->evidence, sizeof c->g->evidence, "from key counts only: attention could "
               "not be recomputed from the recordings (%s)",
               isfinite(ev->ref_check_err) ? "our recomputation does not reproduce the reference"
                                           : "q, k or v not recorded");
    return 1;
}
