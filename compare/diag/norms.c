/* norms.c — the norm families (docs/diagnosis.md): a norm weight applied
 * as w where (1 + w) is due or back (norm_convention), and a q/k norm not
 * applied (qk_norm_missing). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"
/* ------------------------------------------------------------------ */
/* A norm weight applied as w where (1 + w) is due                      */

/* Gemma's RMSNorm multiplies the normalised input n = x / rms(x) by
 * (1 + w); llama.cpp multiplies by the stored weight, so a converter must
 * store 1 + w. Stored as w, the test computes n * w where the reference
 * computes n * (1 + w): the reference minus the test is n itself, a
 * vector of RMS 1 (per head for the q/k norms), whatever w is. The
 * other way round (a runtime adding 1 where the config has w) the test
 * minus the reference is n. */

/* The family's norms: a dump's model_config names the model type, from
 * which the reader sets arch only, not the flags that follow from it. */
static bool cfg_gemma(const kv_config *cfg)
{
    return cfg->arch == ARCH_GEMMA3;
}

/* The norm whose output stage st is, by its Hugging Face name; NULL when
 * the stage is no norm's output in this config. */
static const char *norm_of_stage(const kv_config *cfg, kv_stage st)
{
    const bool qk = cfg->qk_norm || cfg_gemma(cfg);
    const bool sandwich = cfg->sandwich_norms || cfg_gemma(cfg);
    switch (st) {
    case STAGE_ATTN_NORM: return "input_layernorm";
    case STAGE_Q: return qk ? "q_norm" : NULL;
    case STAGE_K: return qk ? "k_norm" : NULL;
    case STAGE_ATTN_PROJ: return sandwich ? "post_attention_layernorm" : NULL;
    case STAGE_FFN_NORM:
        return sandwich ? "pre_feedforward_layernorm" : "post_attention_layernorm";
    case STAGE_FFN_OUT: return sandwich ? "post_feedforward_layernorm" : NULL;
    case STAGE_FINAL_NORM: return "norm";
    default: return NULL;
    }
}

/* The recorded input of the norm whose output is st, where one is. */
static bool norm_input(const kv_config *cfg, kv_stage st, int layer, int *in_layer,
                       kv_stage *in)
{
    *in_layer = layer;
    switch (st) {
    case STAGE_ATTN_NORM: *in = STAGE_X_IN; return true;
    case STAGE_FFN_NORM: *in = STAGE_H_MID; return true;
    case STAGE_FINAL_NORM: *in = STAGE_X_OUT, *in_layer = cfg->n_layers - 1; return true;
    default: return false;
    }
}

/* How far the difference diff = sign * (ref - test) at one position is
 * from a normalised vector, relative to max |ref|: with the norm's input
 * x recorded, max |diff - x / rms(x)|; else, per group of g columns (a
 * head), | rms(diff) - 1 |, the largest. */
static double unit_norm_err(const float *ref, const float *test, const float *x, int n, int g,
                            double sign, double eps)
{
    double rmax = 0, worst = 0, ms = 0;
    for (int i = 0; i < n; i++)
        rmax = fmax(rmax, fabs((double)ref[i]));
    if (!(rmax > 0))
        return INFINITY;
    if (x) {
        for (int i = 0; i < n; i++)
            ms += (double)x[i] * x[i];
        const double inv = 1.0 / sqrt(ms / n + eps);
        for (int i = 0; i < n; i++)
            worst = fmax(worst, fabs(sign * ((double)ref[i] - test[i]) - x[i] * inv));
        return worst / rmax;
    }
    for (int h = 0; h < n / g; h++) {
        double s = 0;
        for (int i = h * g; i < (h + 1) * g; i++) {
            const double d = (double)ref[i] - test[i];
            s += d * d;
        }
        worst = fmax(worst, fabs(sqrt(s / g) - 1));
    }
    return worst / rmax;
}

/* unit_norm_err of (layer, stage) at p; +inf when a row is missing. */
static int norm_err_at(cmp_ctx *c, int64_t p, double sign, double *err, bool *with_input,
                       kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    const int n = cmp_stage_cols(cfg, d->layer, d->stage);
    const int g = d->stage == STAGE_Q || d->stage == STAGE_K ? config_layer_head_dim(cfg, d->layer) : n;
    float *a, *b, *x = NULL;
    *err = INFINITY;
    int rc = dg_row_pair(c, d->layer, d->stage, p, &a, &b, e);
    if (rc)
        return rc < 0 ? -1 : 0;
    int il;
    kv_stage in;
    if (norm_input(cfg, d->stage, d->layer, &il, &in) && cmp_stage_cols(cfg, il, in) == n)
        x = dg_row(c, c->ref, il, in, p, &rc, e);
    *with_input = x != NULL;
    if (rc == 0)
        *err = unit_norm_err(a, b, x, n, g, sign, cfg->rms_eps);
    free(a);
    free(b);
    free(x);
    return rc < 0 ? -1 : 0;
}

int dg_rule_norm_convention(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const char *norm = norm_of_stage(c->cfg, d->stage);
    if (!norm || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    /* The config's convention says which way the test erred. */
    const bool plus_one = c->cfg->norm_plus_one || cfg_gemma(c->cfg);
    const double sign = plus_one ? 1.0 : -1.0;
    double err = INFINITY, err2 = NAN;
    bool with_input = false, with_input2 = false;
    if (norm_err_at(c, d->pos, sign, &err, &with_input, e) < 0)
        return -1;
    if (!(err <= c->row_tol))
        return 0;
    /* And at the row's last compared position: a second, independent
     * normalised vector (the norm's input there is another). */
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    int64_t p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && p2 >= c->pos_limit)
        p2 = c->pos_limit - 1;
    if (p2 > d->pos) {
        if (norm_err_at(c, p2, sign, &err2, &with_input2, e) < 0)
            return -1;
        if (!(err2 <= c->row_tol))
            return 0;
    }
    cmp_diagnosis *g = c->g;
    g->kind = CMP_DIAG_NORM_CONVENTION;
    g->basis = CMP_BASIS_RECOMPUTED;
    const bool qk = d->stage == STAGE_Q || d->stage == STAGE_K;
    if (plus_one)
        dg_say(g->summary, sizeof g->summary, "norm convention: the test's %s multiplies by w in "
            "place of (1 + w) (Gemma's RMSNorm weight stored without its + 1)", norm);
    else
        dg_say(g->summary, sizeof g->summary, "norm convention: the test's %s multiplies by "
            "(1 + w) where the config multiplies by w (a + 1 added that the model does not "
            "have)", norm);
    dg_say(g->detail, sizeof g->detail, "(%s of layer %d%s: the %s's weight, at every position; "
        "a converter that %s, or a runtime that %s)", stage_name(d->stage), d->layer,
        qk ? ", after RoPE" : "", norm,
        plus_one ? "did not add 1 to the norm weights" : "added 1 to the norm weights",
        plus_one ? "does not apply Gemma's (1 + w)" : "applies Gemma's (1 + w) to this model");
    dg_say(g->evidence, sizeof g->evidence, "the %s's %s minus the %s's is the normalised input "
        "%s (error %.2g at position %lld", plus_one ? "reference" : "test", stage_name(d->stage),
        plus_one ? "test" : "reference",
        with_input ? "x / rms(x) recomputed from the recorded input"
                   : qk ? "(RMS 1 in every head)" : "(RMS 1)",
        err, (long long)d->pos);
    if (p2 > d->pos)
        dg_append(g->evidence, sizeof g->evidence, " and %.2g at position %lld", err2,
               (long long)p2);
    dg_append(g->evidence, sizeof g->evidence, ", relative to the row's largest value): n * w "
           "against n * (1 + w), whatever w is; errors up to %.2g count as reproducing (%s)",
           c->row_tol, c->r->xrt.on ? "the step's drift threshold" : "exact mode");
    return 1;
}

/* ------------------------------------------------------------------ */
/* A q/k norm not applied                                               */

/* Gemma 3 and Qwen3 normalise each head of q and k (RMSNorm over D, one
 * weight per dim) before RoPE. A runtime that skips it (a converter that
 * exports the model as an architecture without q/k norms) hands RoPE the
 * raw projection r_h: unrotated, the reference's head is n_h * w with
 * n_h = r_h / rms(r_h), the test's is r_h. So the test's heads, each
 * divided by its own RMS, times ONE weight vector w (fitted) must give
 * the reference's, at every head and position, while the heads' RMS
 * differ (not a norm applied without its weight). */

/* Unrotated (ref, test) rows of (layer, stage) at p, appended to ra, ta
 * (nh x D doubles each). 0, 1 when missing, -1 on error. */
static int unrotated_pair(cmp_ctx *c, int64_t p, int nh, double *ra, double *ta, kv_err *e)
{
    const cmp_divergence *d = c->d;
    float *a, *b;
    int rc = dg_row_pair(c, d->layer, d->stage, p, &a, &b, e);
    if (rc)
        return rc;
    cmp_rope_unrotate(c->cfg, d->layer, p, a, nh, ra);
    cmp_rope_unrotate(c->cfg, d->layer, p, b, nh, ta);
    free(a);
    free(b);
    return 0;
}

/* Whether the config normalises q and k per head. From the family too:
 * a dump's model_config sets arch alone, and Qwen3's qk_norm follows
 * from it as Gemma 3's does. */
static bool cfg_qk_norm(const kv_config *cfg)
{
    return cfg->qk_norm || cfg_gemma(cfg) || cfg->arch == ARCH_QWEN3;
}

int dg_rule_qk_norm_missing(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL ||
        !cfg_qk_norm(cfg))
        return 0;
    const int D = config_layer_head_dim(cfg, d->layer);
    const int nh = d->stage == STAGE_Q ? cfg->n_heads : config_layer_kv_heads(cfg, d->layer);
    const size_t n = (size_t)nh * D;
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    int64_t p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && p2 >= c->pos_limit)
        p2 = c->pos_limit - 1;
    double *ra = malloc(2 * n * sizeof(double)), *ta = malloc(2 * n * sizeof(double));
    double *w = calloc((size_t)D, sizeof(double)), *den = calloc((size_t)D, sizeof(double));
    double *rms = malloc(2 * (size_t)nh * sizeof(double));
    int rc = (!ra || !ta || !w || !den || !rms) ? kv_errf(e, "compare: out of memory") : 0;
    int npos = 0;
    if (rc == 0) {
        rc = unrotated_pair(c, d->pos, nh, ra, ta, e);
        npos = rc == 0;
    }
    if (rc == 0 && p2 > d->pos) {
        rc = unrotated_pair(c, p2, nh, ra + n, ta + n, e);
        npos += rc == 0;
        rc = rc < 0 ? -1 : 0;
    }
    double err = INFINITY, rms_lo = INFINITY, rms_hi = 0;
    if (rc == 0 && npos > 0) {
        /* Each test head over its own RMS: the normalised input n_h. */
        for (int g = 0; g < npos * nh; g++) {
            double s = 0;
            for (int i = 0; i < D; i++)
                s += ta[(size_t)g * D + i] * ta[(size_t)g * D + i];
            rms[g] = sqrt(s / D + cfg->rms_eps);
            rms_lo = fmin(rms_lo, rms[g]);
            rms_hi = fmax(rms_hi, rms[g]);
            for (int i = 0; i < D; i++) {
                const double nn = ta[(size_t)g * D + i] / rms[g];
                w[i] += ra[(size_t)g * D + i] * nn;
                den[i] += nn * nn;
            }
        }
        /* One weight per dim, least squares over every head and position. */
        for (int i = 0; i < D; i++)
            w[i] = den[i] > 0 ? w[i] / den[i] : 0;
        double worst = 0, rmax = 0;
        for (int g = 0; g < npos * nh; g++)
            for (int i = 0; i < D; i++) {
                const double r = ra[(size_t)g * D + i];
                worst = fmax(worst, fabs(w[i] * ta[(size_t)g * D + i] / rms[g] - r));
                rmax = fmax(rmax, fabs(r));
            }
        err = rmax > 0 ? worst / rmax : INFINITY;
    }
    free(ra);
    free(ta);
    free(w);
    free(den);
    free(rms);
    /* Fewer than two heads' worth of rows fit any w: no evidence. */
    if (rc < 0 || npos * nh < 2 || !(err <= c->row_tol))
        return rc < 0 ? -1 : 0;
    const char *norm = d->stage == STAGE_Q ? "q_norm" : "k_norm";
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    cmp_diagnosis *g = c->g;
    g->basis = CMP_BASIS_RECOMPUTED;
    /* Heads of RMS 1 everywhere were normalised: only the weight is off. */
    const bool unit = fabs(rms_lo - 1) <= c->row_tol && fabs(rms_hi - 1) <= c->row_tol;
    if (unit) {
        g->kind = CMP_DIAG_UNCLASSIFIED;
        dg_say(g->summary, sizeof g->summary, "the test's %s are normalised per head but not "
            "multiplied by %s's weight", what, norm);
        dg_say(g->detail, sizeof g->detail, "(%s of layer %d: every head has RMS 1 before RoPE; "
            "the weight is missing or all ones)", stage_name(d->stage), d->layer);
    } else {
        g->kind = CMP_DIAG_QK_NORM_MISSING;
        dg_say(g->summary, sizeof g->summary, "%s missing: the test's %s are not normalised per "
            "head (RMSNorm over head_dim) before RoPE", norm, what);
        dg_say(g->detail, sizeof g->detail, "(%s of layer %d: each head is the raw projection, of "
            "RMS %.3g to %.3g, where the config normalises it and multiplies by %s's weight: a "
            "runtime, or a converter's architecture, without q/k norms, e.g. Qwen3 or Gemma 3 "
            "run as Qwen2 or Llama)", stage_name(d->stage), d->layer, rms_lo, rms_hi, norm);
    }
    dg_say(g->evidence, sizeof g->evidence, "rotated back, each head of the test's %s divided by "
        "its own RMS and multiplied by one weight vector (fitted over %d heads at position "
        "%lld%s) reproduces the reference's (error %.2g; errors up to %.2g count as "
        "reproducing, %s)", what, nh, (long long)d->pos, npos > 1 ? " and at the last compared "
        "position" : "", err, c->row_tol, c->r->xrt.on ? "the step's drift threshold"
                                                      : "exact mode");
    return 1;
}

