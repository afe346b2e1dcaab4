/* sharing.c — a layer that read another layer's KV cache than the
 * config's: KV-shared layers wired to the wrong layer (a GGUF's
 * shared_kv_layers other than config.json's num_kv_shared_layers, a port's
 * off-by-one in the owner table), or a layer that should share computing
 * its own. The test's attention at the point is recomputed from its own
 * query over each candidate layer's keys and values as the reference
 * recorded them (a layer of the same type that owns a cache); the one
 * that reproduces the test there, and at every position of the layer the
 * test holds, is named, the config's own owner having failed. */
#include <math.h>
#include <stdlib.h>

#include "diag.h"

#define SHARE_CHECK_MAX 64   /* positions of the layer verified, at most */

/* The test's attention at (layer, p) against attention recomputed from
 * q over layer owner's k, v in the reference. +inf when it cannot be.
 * 0; 1 when the reference did not record those keys (a test that ran on
 * past a prefill-only reference); -1 on error. */
static int err_with_owner(cmp_ctx *c, kv_config *cfg, int layer, int owner, int64_t p,
                          const float *q, const float *lse_rec, const float *out_rec,
                          double *err, kv_err *e)
{
    const int H = cfg->n_heads, D = config_layer_head_dim(cfg, layer);
    const int keep = cfg->kv_owner[layer];
    cfg->kv_owner[layer] = (int16_t)owner;
    const int W = config_layer_window(cfg, layer);
    cmp_hyp h = {.lo = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0, .hi = p};
    double *l = malloc((size_t)H * sizeof *l), *o = malloc((size_t)H * D * sizeof *o);
    int rc = !l || !o ? kv_errf(e, "compare: out of memory") : 0;
    if (rc == 0)
        rc = cmp_recompute_attention(c->ref, cfg, layer, q, &h, l, o, e);
    *err = rc == 0 ? cmp_attention_err(cfg, layer, l, o, lse_rec, out_rec, c->rms_weight)
                   : INFINITY;
    cfg->kv_owner[layer] = (int16_t)keep;
    free(l);
    free(o);
    return rc < 0 ? -1 : rc;
}

/* Layers at the end of c's config that read another's cache. */
static int shared_tail(const kv_config *c)
{
    int n = 0;
    while (n < c->n_layers && c->kv_owner[c->n_layers - 1 - n] != c->n_layers - 1 - n)
        n++;
    return n;
}

/* Does owner reproduce the test at every held position of layer (up to
 * SHARE_CHECK_MAX of them, spread evenly)? *n_checked: how many. */
static int holds_everywhere(cmp_ctx *c, kv_config *cfg, int layer, int owner, double tol,
                            int *n_checked, double *worst, kv_err *e)
{
    int64_t lo, hi;
    *n_checked = 0;
    *worst = 0;
    if (dg_attn_held(c, layer, &lo, &hi))
        return 1;
    /* pos_limit < 0: no input token differs (a prefill-only pair never
     * has one), so every held position is the test's own. */
    if (c->pos_limit >= 0 && hi >= c->pos_limit)
        hi = c->pos_limit - 1;
    const int64_t n = hi - lo + 1, step = n > SHARE_CHECK_MAX ? n / SHARE_CHECK_MAX + 1 : 1;
    for (int64_t p = lo; p <= hi; p += step) {
        int rc = 0;
        float *q = dg_row(c, c->test, layer, STAGE_Q, p, &rc, e);
        float *out = dg_row(c, c->test, layer, STAGE_ATTN_OUT, p, &rc, e);
        float *lse = dg_row(c, c->test, layer, STAGE_ATTN_LSE, p, &rc, e);
        double err = INFINITY;
        if (rc == 0 && q && (out || lse))
            rc = err_with_owner(c, cfg, layer, owner, p, q, lse, out, &err, e);
        free(q);
        free(out);
        free(lse);
        if (rc < 0)
            return -1;
        if (rc == 1)
            continue;   /* the reference holds no keys there: nothing to check */
        if (!isfinite(err) || err > tol) {
            *worst = err;
            return 0;
        }
        *worst = fmax(*worst, err);
        (*n_checked)++;
    }
    return *n_checked > 0;
}

int dg_rule_kv_owner(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const int L = d->layer;
    if (L < 0 || !dg_is_attn_stage(d->stage) || c->cfg->n_layers < 2)
        return 0;
    kv_config cfg = *c->cfg;
    const int own = cfg.kv_owner[L];
    int rc = 0;
    float *q = dg_row(c, c->test, L, STAGE_Q, d->pos, &rc, e);
    float *out = dg_row(c, c->test, L, STAGE_ATTN_OUT, d->pos, &rc, e);
    const float *lse = c->ev->lse_test;
    const double tol = fmax(c->attn_tol, c->row_tol);
    double err_own = INFINITY;
    int match[KV_MAX_LAYERS], n_match = 0;
    double err_match = INFINITY;
    if (rc == 0 && q && (out || lse))
        rc = err_with_owner(c, &cfg, L, own, d->pos, q, lse, out, &err_own, e);
    rc = rc > 0 ? 0 : rc;   /* unrecorded at the point: err_own stays +inf, none matches */
    /* Candidates: every layer of L's type that owns a cache, but the
     * config's own choice. */
    for (int j = 0; rc == 0 && q && (out || lse) && err_own > tol && j < cfg.n_layers; j++) {
        if (j == own || cfg.kv_owner[j] != j || cfg.layer_type[j] != cfg.layer_type[L])
            continue;
        double err;
        rc = err_with_owner(c, &cfg, L, j, d->pos, q, lse, out, &err, e);
        if (rc == 1)
            rc = 0;   /* err is +inf: no match */
        else if (rc == 0 && err <= tol) {
            match[n_match++] = j;
            err_match = fmin(err_match, err);
        }
    }
    free(q);
    free(out);
    if (rc < 0 || n_match == 0)
        return rc < 0 ? -1 : 0;
    /* Each remaining candidate must hold at every position of the layer. */
    int kept[KV_MAX_LAYERS], n_kept = 0, n_checked = 0;
    double worst = 0;
    for (int i = 0; i < n_match; i++) {
        int n;
        double w;
        int h = holds_everywhere(c, &cfg, L, match[i], tol, &n, &w, e);
        if (h < 0)
            return -1;
        if (h == 1) {
            kept[n_kept++] = match[i];
            n_checked = n;
            worst = fmax(worst, w);
        }
    }
    if (n_kept == 0)
        return 0;
    char s[256], who[160] = "";
    for (int i = 0; i < n_kept; i++)
        dg_append(who, sizeof who, "%s%d", i == 0 ? "" : i + 1 == n_kept ? " or " : ", ",
                  kept[i]);
    if (own == L)
        dg_say(s, sizeof s, "layer %d read layer %s's KV cache where the config has it compute "
            "its own (KV sharing wired otherwise)", L, who);
    else
        dg_say(s, sizeof s, "layer %d read layer %s's KV cache where the config has it read "
            "layer %d's (KV sharing wired otherwise)", L, who, own);
    dg_set(c, CMP_DIAG_KV_OWNER, CMP_BASIS_RECOMPUTED, s);
    const int s_ref = shared_tail(&c->ref->cfg), s_test = shared_tail(&c->test->cfg);
    if (s_test != s_ref)
        dg_say(c->g->detail, sizeof c->g->detail, "(the test's model_config shares the last %d "
            "layers' caches, the reference's %d: num_kv_shared_layers in config.json against "
            "shared_kv_layers in a GGUF, or a port's own count)", s_test, s_ref);
    else if (n_kept > 1)
        dg_say(c->g->detail, sizeof c->g->detail, "(these layers' keys and values agree over "
            "what the test read; record a position where they differ to tell them apart)");
    else
        dg_say(c->g->detail, sizeof c->g->detail, "(the test's own model_config says what the "
            "config does: the runtime wires the shared layers otherwise than it states)");
    dg_say(c->g->evidence, sizeof c->g->evidence, "recomputing attention from the test's q over "
        "layer %s's k, v (as the reference recorded them) reproduces its %s (error %.2g) at %d "
        "position%s of layer %d (worst %.2g); layer %d's, the config's, gives %.2g",
        who, dg_recorded_attn(c), err_match, n_checked, n_checked == 1 ? "" : "s", L, worst,
        own, err_own);
    return 1;
}
