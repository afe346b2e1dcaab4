/* core.c — the evidence interface of the diagnosis (diag.h): rows read at
 * the point under diagnosis, the attention case there, attention
 * recomputed under a hypothesis, and the text helpers. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"

void dg_say(char *buf, size_t n, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, n, fmt, ap);
    va_end(ap);
}

void dg_append(char *buf, size_t n, const char *fmt, ...)
{
    size_t used = strlen(buf);
    if (used + 1 >= n)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf + used, n - used, fmt, ap);
    va_end(ap);
}

void dg_set(cmp_ctx *c, cmp_diag_kind k, cmp_basis b, const char *summary)
{
    c->g->kind = k;
    c->g->basis = b;
    dg_say(c->g->summary, sizeof c->g->summary, "%s", summary);
}

bool dg_is_attn_stage(kv_stage s)
{
    return s == STAGE_ATTN_LSE || s == STAGE_ATTN_NKEYS || s == STAGE_ATTN_SINK ||
           s == STAGE_ATTN_OUT;
}

float *dg_row(const cmp_ctx *c, const cmp_source *src, int layer, kv_stage st, int64_t pos,
              int *rc, kv_err *e)
{
    const int cols = cmp_stage_cols(c->cfg, layer, st);
    if (cols <= 0 || pos < 0)
        return NULL;
    float *row = malloc((size_t)cols * sizeof(float));
    if (!row) {
        *rc = kv_errf(e, "compare: out of memory");
        return NULL;
    }
    int r = cmp_read_row(src, layer, st, pos, cols, row, e);
    if (r != 0) {
        if (r < 0)
            *rc = -1;
        free(row);
        return NULL;
    }
    return row;
}

const cmp_source *dg_test_rows(const cmp_ctx *c)
{
    return c->test_rows ? c->test_rows : c->test;
}

int dg_attn_held(const cmp_ctx *c, int layer, int64_t *lo, int64_t *hi)
{
    const int H = c->cfg->n_heads;
    return cmp_source_held(c->test, layer, STAGE_ATTN_OUT,
                           cmp_stage_cols(c->cfg, layer, STAGE_ATTN_OUT), lo, hi) == 0 ||
                   cmp_source_held(c->test, layer, STAGE_ATTN_LSE, H, lo, hi) == 0 ||
                   cmp_source_held(c->test, layer, STAGE_ATTN_NKEYS, H, lo, hi) == 0
               ? 0
               : 1;
}

void dg_case_free(dg_case *a)
{
    free(a->q_ref);
    free(a->q_test);
    free(a->out_ref);
    free(a->out_test);
}
int dg_case_init(cmp_ctx *c, dg_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    int rc = 0;
    memset(a, 0, sizeof *a);
    a->q_ref = dg_row(c, c->ref, d->layer, STAGE_Q, d->pos, &rc, e);
    a->q_test = dg_row(c, c->test, d->layer, STAGE_Q, d->pos, &rc, e);
    a->out_ref = dg_row(c, c->ref, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    a->out_test = dg_row(c, c->test, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    a->P = c->test->prompt_length > 0 ? c->test->prompt_length : c->ref->prompt_length;
    /* The chunked run is normally the test; either side may say how it ran. */
    const cmp_source *run = cmp_settings_int(c->test, "chunk", 0) > 0 ? c->test : c->ref;
    a->C = cmp_settings_int(run, "chunk", 0);
    a->W = config_layer_window(c->cfg, d->layer);
    a->ctx = cmp_settings_int(run, "max_ctx", 0);
    a->lo_ref = a->W > 0 && d->pos - a->W + 1 > 0 ? d->pos - a->W + 1 : 0;
    /* Without the settings, what the data says: the first divergence of a
     * chunk-shaped bug is the first chunk boundary (C = p; a prompt
     * in one chunk when p >= P: decode steps are chunks of one), and a
     * ring that stopped storing diverges first at its size (R = p).
     * Recomputation then verifies, as with the settings. */
    if (a->C <= 0 && d->pos > 0 && a->P > 0) {
        a->C = d->pos < a->P ? d->pos : a->P;
        a->C_inferred = true;
    }
    const bool cache_known = cmp_settings_is(run, "cache", "ring") ||
                             cmp_settings_is(run, "cache", "dense") ||
                             cmp_settings_is(run, "cache", "split");
    const bool ring = cmp_settings_is(run, "cache", "ring");
    if (a->W > 0 && a->C > 0 && !a->C_inferred && ring) {
        /* The ring holds at most the context; max_ctx >= the tokens run,
         * so without it a ring of W + C <= n_tokens is exact and a larger
         * one is never reached. */
        long ctx = cmp_settings_int(run, "max_ctx", 0);
        a->R = a->W + a->C;
        if (ctx > 0 && a->R > ctx)
            a->R = ctx;
    }
    if (a->R == 0 && (ring || !cache_known) && a->W > 0 && d->pos > a->W)
        a->R_guess = d->pos;
    return rc;
}

int dg_hyp_err(cmp_ctx *c, dg_case *a, const cmp_hyp *h, bool on_ref, double *err,
                   kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, D = config_layer_head_dim(cfg, c->d->layer);
    const int Dv = config_layer_v_head_dim(cfg, c->d->layer);
    const cmp_evidence *ev = c->ev;
    const float *q = on_ref ? a->q_ref : (a->q_test ? a->q_test : a->q_ref);
    const float *lse_rec = on_ref ? ev->lse_ref : ev->lse_test;
    const float *out_rec = on_ref ? a->out_ref : a->out_test;
    *err = INFINITY;
    if (!q || (!lse_rec && !out_rec))
        return 0;
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    int rc = (!lse || !out) ? kv_errf(e, "compare: out of memory") : 1;
    if (rc == 1 && !on_ref)
        rc = cmp_recompute_attention(c->test, cfg, c->d->layer, q, h, lse, out, e);
    if (rc == 1 && !on_ref)
        a->ref_rows_used = true;
    if (rc == 1)   /* a match from the reference's k/v still pins the key set down */
        rc = cmp_recompute_attention(c->ref, cfg, c->d->layer, q, h, lse, out, e);
    if (!on_ref && !a->q_test)
        a->ref_rows_used = true;
    if (rc == 0)
        *err = cmp_hyp_nkeys(h) == 0
                   ? (dg_attn_empty(lse_rec, out_rec, H, H * Dv) ? 0 : INFINITY)
                   : cmp_attention_err(cfg, c->d->layer, lse, out, lse_rec, out_rec, c->rms_weight);
    free(lse);
    free(out);
    return rc < 0 ? -1 : 0;
}

bool dg_attn_empty(const float *lse, const float *out, int H, int n)
{
    if (!lse && !out)
        return false;
    for (int i = 0; lse && i < H; i++)
        if (!isnan(lse[i]) && !(isinf(lse[i]) && lse[i] < 0))
            return false;
    for (int i = 0; out && i < n; i++)
        if (!isnan(out[i]) && out[i] != 0.0f)
            return false;
    return true;
}

cmp_hyp dg_hyp_config(const cmp_divergence *d, const dg_case *a)
{
    cmp_hyp h = {.lo = a->lo_ref, .hi = d->pos, .zero_lo = 0, .zero_hi = 0};
    dg_say(h.what, sizeof h.what, "the config's keys %lld..%lld", (long long)h.lo, (long long)h.hi);
    return h;
}

int dg_attn_err_at(cmp_ctx *c, int layer, int64_t q, const cmp_hyp *h, bool counts_only,
                   double *err, int64_t *test_n, kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, D = config_layer_head_dim(cfg, layer);
    const int Dv = config_layer_v_head_dim(cfg, layer);
    int rc = 0;
    float *qr = counts_only ? NULL : dg_row(c, c->test, layer, STAGE_Q, q, &rc, e);
    float *lse = counts_only ? NULL : dg_row(c, c->test, layer, STAGE_ATTN_LSE, q, &rc, e);
    float *out = counts_only ? NULL : dg_row(c, c->test, layer, STAGE_ATTN_OUT, q, &rc, e);
    float *nk = dg_row(c, c->test, layer, STAGE_ATTN_NKEYS, q, &rc, e);
    double *l = malloc((size_t)H * sizeof(double)), *o = malloc((size_t)H * D * sizeof(double));
    if (rc == 0 && (!l || !o))
        rc = kv_errf(e, "compare: out of memory");
    *err = INFINITY;
    *test_n = nk ? (int64_t)nk[0] : -1;
    if (rc == 0 && (!qr || (!lse && !out))) {
        rc = nk ? 2 : 1;   /* the key count alone, or nothing */
        if (nk && (int64_t)nk[0] == cmp_hyp_nkeys(h))
            *err = 0;
    } else if (rc == 0 && (!nk || (int64_t)nk[0] == cmp_hyp_nkeys(h))) {
        rc = cmp_recompute_attention(c->test, cfg, layer, qr, h, l, o, e);
        if (rc == 1 && nk) {
            rc = 2;   /* k, v not held there: the count alone */
            *err = 0;
        } else if (rc == 0) {
            *err = cmp_hyp_nkeys(h) == 0
                       ? (dg_attn_empty(lse, out, H, H * Dv) ? 0 : INFINITY)
                       : cmp_attention_err(cfg, layer, l, o, lse, out, c->rms_weight);
        }
    }
    free(qr);
    free(lse);
    free(out);
    free(nk);
    free(l);
    free(o);
    return rc < 0 ? -1 : rc;
}

void dg_counts_phrase(const cmp_ctx *c, char *buf, size_t n)
{
    const int nr = c->ev->nkeys_ref, nt = c->ev->nkeys_test;
    char r[32] = "unknown", t[32] = "unknown";
    if (nr >= 0 && nr == nt) {
        dg_say(buf, n, "keys attended %d in both", nr);
        return;
    }
    if (nr >= 0)
        dg_say(r, sizeof r, "%d", nr);
    if (nt >= 0)
        dg_say(t, sizeof t, "%d", nt);
    dg_say(buf, n, "keys attended %s vs %s", r, t);
}

const char *dg_recorded_attn(const cmp_ctx *c)
{
    return c->ev->lse_test ? "attn_lse and attn_out" : "attn_out";
}

/* The rows of (layer, stage) at p on both sides; 0 with both set, 1 when
 * either is missing, -1 on error. */
int dg_row_pair(cmp_ctx *c, int layer, kv_stage st, int64_t p, float **a, float **b,
                kv_err *e)
{
    int rc = 0;
    *a = dg_row(c, c->ref, layer, st, p, &rc, e);
    *b = dg_row(c, dg_test_rows(c), layer, st, p, &rc, e);
    if (*a && *b)
        return 0;
    free(*a);
    free(*b);
    *a = *b = NULL;
    return rc < 0 ? -1 : 1;
}

double dg_config_value(double lo, double hi, double dflt)
{
    const double mid = 0.5 * (lo + hi);
    if (!(mid > 0) || !isfinite(mid))
        return dflt;
    const double dec = pow(10, floor(log10(mid)));
    static const double steps[] = {1, 2, 5, 10};
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++)
        if (steps[i] * dec >= lo && steps[i] * dec <= hi)
            return steps[i] * dec;
    return dflt;
}
