/* diagnose.c — evidence at the first divergence and the rules that name
 * the bug class (docs/diagnosis.md). Rules run most specific first:
 * non-finite values, a RoPE offset (q/k rotated), a zero K/V read, numeric
 * drift, a different key set (refined by recomputing attention under each
 * candidate key set), and otherwise "unclassified" with the evidence.
 *
 * A diagnosis says how it was established: recomputed (our own attention
 * or rotation from recorded rows reproduces the test), an exact check of
 * recorded values, or a heuristic (positions and counts only). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"
/* ------------------------------------------------------------------ */
/* Evidence                                                             */

/* q of layer l and k, v of its KV owner bitwise identical at every
 * recorded position up to p (before p when the divergence is at one of
 * them), from the walk's per-stage statistics. */
static void qkv_evidence(cmp_ctx *c)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    const int owner = c->cfg->kv_owner[d->layer];
    const int layers[3] = {d->layer, owner, owner};
    const kv_stage stages[3] = {STAGE_Q, STAGE_K, STAGE_V};
    ev->qkv = 1;
    ev->qkv_from = 0;
    ev->qkv_to = d->stage <= STAGE_V ? d->pos - 1 : d->pos;
    if (ev->qkv_to < 0) {
        ev->qkv = -1;
        return;
    }
    for (int i = 0; i < 3; i++) {
        const cmp_stage_result *sr = cmp_result_stage(c->r, layers[i], stages[i]);
        if (!sr || sr->pos_hi < ev->qkv_to || sr->pos_lo > ev->qkv_to) {
            ev->qkv = -1;
            return;
        }
        ev->qkv_from = sr->pos_lo > ev->qkv_from ? sr->pos_lo : ev->qkv_from;
        const int64_t f = sr->all.first_bitdiff_pos;
        if (f >= 0 && f <= ev->qkv_to)
            ev->qkv = 0;
    }
}

static int attn_stats_evidence(cmp_ctx *c, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    int rc = 0;
    ev->n_heads = c->cfg->n_heads;
    ev->lse_ref = dg_row(c, c->ref, d->layer, STAGE_ATTN_LSE, d->pos, &rc, e);
    ev->lse_test = dg_row(c, c->test, d->layer, STAGE_ATTN_LSE, d->pos, &rc, e);
    float *na = dg_row(c, c->ref, d->layer, STAGE_ATTN_NKEYS, d->pos, &rc, e);
    float *nb = dg_row(c, c->test, d->layer, STAGE_ATTN_NKEYS, d->pos, &rc, e);
    ev->nkeys_ref = na ? (int)na[0] : -1;
    ev->nkeys_test = nb ? (int)nb[0] : -1;
    free(na);
    free(nb);
    return rc;
}

/* First (position, layer) where any recorded key count differs. */
static int nkeys_scan(cmp_ctx *c, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const int H = c->cfg->n_heads;
    float *a = malloc((size_t)64 * H * sizeof(float)), *b = malloc((size_t)64 * H * sizeof(float));
    int rc = (!a || !b) ? kv_errf(e, "compare: out of memory") : 0;
    ev->nkeys_diff_pos = -1;
    ev->nkeys_diff_layer = -1;
    for (int i = 0; rc == 0 && i < c->r->n_stages; i++) {
        const cmp_stage_result *sr = &c->r->stages[i];
        if (sr->stage != STAGE_ATTN_NKEYS || sr->hashed || sr->cols != H)
            continue;
        for (int64_t p = sr->pos_lo; rc == 0 && p <= sr->pos_hi; p += 64) {
            if (ev->nkeys_diff_pos >= 0 && p > ev->nkeys_diff_pos)
                break;
            const int64_t n = sr->pos_hi - p + 1 < 64 ? sr->pos_hi - p + 1 : 64;
            if (c->ref->read(c->ref->ctx, sr->layer, STAGE_ATTN_NKEYS, p, n, a, e) < 0 ||
                c->test->read(c->test->ctx, sr->layer, STAGE_ATTN_NKEYS, p, n, b, e) < 0) {
                rc = -1;
                break;
            }
            for (int64_t r = 0; r < n; r++)
                if (memcmp(a + r * H, b + r * H, (size_t)H * sizeof(float)) != 0) {
                    if (ev->nkeys_diff_pos < 0 || p + r < ev->nkeys_diff_pos) {
                        ev->nkeys_diff_pos = p + r;
                        ev->nkeys_diff_layer = sr->layer;
                    }
                    break;
                }
        }
    }
    free(a);
    free(b);
    return rc;
}

/* Row-relative error of x_out at p from layer l to the last recorded layer. */
static int growth_evidence(cmp_ctx *c, kv_err *e)
{
    cmp_evidence *ev = c->ev;
    const cmp_divergence *d = c->d;
    int rc = 0;
    ev->growth_first = ev->growth_last = NAN;
    ev->growth_layer_last = -1;
    for (int l = d->layer < 0 ? 0 : d->layer; l < c->cfg->n_layers && rc == 0; l++) {
        float *a = dg_row(c, c->test, l, STAGE_X_OUT, d->pos, &rc, e);
        float *b = dg_row(c, c->ref, l, STAGE_X_OUT, d->pos, &rc, e);
        if (a && b) {
            double rel = cmp_row_rel_err(a, b, c->cfg->hidden);
            if (isnan(ev->growth_first))
                ev->growth_first = rel;
            ev->growth_last = rel;
            ev->growth_layer_last = l;
        }
        free(a);
        free(b);
    }
    return rc;
}

/* ------------------------------------------------------------------ */
/* Rules                                                                */

static void rule_nonfinite(cmp_ctx *c)
{
    const cmp_divergence *d = c->d;
    const char *side = !isfinite(d->test) || isfinite(d->ref) ? "test" : "reference";
    dg_set(c, CMP_DIAG_NONFINITE, CMP_BASIS_EXACT_CHECK,
             "non-finite values: NaN or Inf on one side only");
    dg_say(c->g->detail, sizeof c->g->detail,
        "(%s has %g where the other has %g: overflow, 0/0, a log/sqrt of a bad value or "
        "uninitialised memory)", side, !isfinite(d->test) ? d->test : d->ref,
        !isfinite(d->test) ? d->ref : d->test);
}

/* Per-head L2 norms equal: what a rotation (RoPE at another position)
 * preserves and most other bugs do not. */
static bool head_norms_equal(const float *a, const float *b, int nh, int D, double tol)
{
    for (int h = 0; h < nh; h++) {
        double na = 0, nb = 0;
        for (int i = 0; i < D; i++) {
            na += (double)a[h * D + i] * a[h * D + i];
            nb += (double)b[h * D + i] * b[h * D + i];
        }
        na = sqrt(na), nb = sqrt(nb);
        if (fabs(na - nb) > tol * fmax(na, 1e-30))
            return false;
    }
    return true;
}

/* ------------------------------------------------------------------ */
/* Another RoPE convention                                              */

/* Bases common in released models (Gemma's local 1e4 and global 1e6,
 * Llama 3's 5e5, ...): a runtime that drops the config's often falls back
 * to one of these. */
static const double common_bases[] = {1e4, 1e5, 5e5, 1e6, 1e7};

#define MAX_CONVS 24

static int add_conv(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                    bool interleaved, cmp_rope_rows rows, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static int add_conv(cmp_rope_conv *cv, int n, double theta, const kv_rope_scaling *sc,
                    bool interleaved, cmp_rope_rows rows, const char *fmt, ...)
{
    for (int i = 0; i < n; i++)   /* the first wording of a convention wins */
        if (cv[i].theta == theta && cv[i].interleaved == interleaved && cv[i].rows == rows &&
            !memcmp(&cv[i].scaling, sc, sizeof *sc))
            return n;
    if (n >= MAX_CONVS || !(theta > 0))
        return n;
    cv[n] = (cmp_rope_conv){.theta = theta, .scaling = *sc, .interleaved = interleaved,
                            .rows = rows};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cv[n].what, sizeof cv[n].what, fmt, ap);
    va_end(ap);
    return n + 1;
}

/* Linear factors a wrong or stray scaling setting often has. */
static const double common_linear[] = {2, 4, 8};

static const char *scale_name(kv_rope_scale t)
{
    return t == ROPE_SCALE_LINEAR ? "linear" : t == ROPE_SCALE_LLAMA3 ? "llama3" : "none";
}

/* The conventions a runtime may use instead of the config's on layer l:
 * the other layer type's base, common bases, scaling missing, of the
 * other type or applied where it does not belong, and the interleaved
 * layout. The config's own is never among them. */
static int rope_convs(const kv_config *cfg, int layer, cmp_rope_conv *cv)
{
    const bool sliding = config_layer_window(cfg, layer) > 0;
    const bool two_bases = cfg->rope_local_theta > 0 && cfg->rope_local_theta != cfg->rope_theta;
    const double theta = sliding && cfg->rope_local_theta > 0 ? cfg->rope_local_theta
                                                              : cfg->rope_theta;
    const kv_rope_scaling none = {.type = ROPE_SCALE_NONE};
    const kv_rope_scaling *gs = &cfg->rope_scaling, *own = sliding ? &none : gs;
    const char *type = sliding ? "sliding" : two_bases ? "global" : "";
    int n = 0;
    /* The config's own: added first so that nothing equal to it follows. */
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_SAME, "the config's");
    if (two_bases && sliding)
        n = add_conv(cv, n, cfg->rope_theta, own, false, CMP_ROWS_SAME, "theta %g, the global "
                     "layers' base, on a sliding layer; the config says %g", cfg->rope_theta,
                     theta);
    if (two_bases && !sliding)
        n = add_conv(cv, n, cfg->rope_local_theta, own, false, CMP_ROWS_SAME, "theta %g, the "
                     "sliding layers' base, on a global layer; the config says %g",
                     cfg->rope_local_theta, theta);
    for (size_t i = 0; i < sizeof common_bases / sizeof common_bases[0]; i++)
        n = add_conv(cv, n, common_bases[i], own, false, CMP_ROWS_SAME, "theta %g on a%s%s "
                     "layer; the config says %g", common_bases[i], type[0] ? " " : "",
                     type[0] ? type : "", theta);
    if (own->type != ROPE_SCALE_NONE) {
        n = add_conv(cv, n, theta, &none, false, CMP_ROWS_SAME, "no RoPE scaling; the config "
                     "says %s scaling by %g", scale_name(own->type), own->factor);
        if (own->type == ROPE_SCALE_LLAMA3) {
            const kv_rope_scaling lin = {.type = ROPE_SCALE_LINEAR, .factor = own->factor};
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g; "
                         "the config says llama3 scaling", own->factor);
        }
    } else if (gs->type != ROPE_SCALE_NONE) {
        n = add_conv(cv, n, theta, gs, false, CMP_ROWS_SAME, "the global layers' %s RoPE "
                     "scaling by %g on a sliding layer, where the config has none",
                     scale_name(gs->type), gs->factor);
    }
    n = add_conv(cv, n, theta, own, true, CMP_ROWS_SAME, "interleaved RoPE pairs (2i, 2i + 1) "
                 "where the config rotates halves (i, i + %d)", cfg->head_dim / 2);
    /* The same mix-up seen through a recorder that maps an interleaved
     * runtime's rows back to halves (kvdiff-llama on llama.cpp's Llama). */
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_UNPERMUTED, "interleaved RoPE pairs (2i, 2i + "
                 "1) rotated on rows laid out for halves (i, i + %d): q/k weights without the "
                 "row permutation an interleaved runtime needs (a converter that skipped "
                 "Llama's permute)", cfg->head_dim / 2);
    n = add_conv(cv, n, theta, own, false, CMP_ROWS_PERMUTED, "halves (i, i + %d) rotated on "
                 "rows laid out for interleaved pairs (2i, 2i + 1): q/k weights permuted for "
                 "an interleaved runtime where this one rotates halves, or permuted twice",
                 cfg->head_dim / 2);
    for (size_t i = 0; i < sizeof common_linear / sizeof common_linear[0]; i++) {
        const kv_rope_scaling lin = {.type = ROPE_SCALE_LINEAR, .factor = common_linear[i]};
        if (own->type == ROPE_SCALE_LINEAR && own->factor == lin.factor)
            continue;
        if (own->type == ROPE_SCALE_NONE)
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g "
                         "where the config has none", lin.factor);
        else
            n = add_conv(cv, n, theta, &lin, false, CMP_ROWS_SAME, "linear RoPE scaling by %g; "
                         "the config says %s scaling by %g", lin.factor, scale_name(own->type),
                         own->factor);
    }
    /* Drop the config's own. */
    memmove(cv, cv + 1, (size_t)(n - 1) * sizeof *cv);
    return n - 1;
}

/* Conventions that reproduce the test at pos (and at pos2 when >= 0). */
typedef struct {
    cmp_rope_conv cv;
    double err, err2;
} conv_fit;

/* The rows of (layer, stage) at p on both sides; 0 with both set, 1 when
 * either is missing, -1 on error. */
static int row_pair(cmp_ctx *c, int layer, kv_stage st, int64_t p, float **a, float **b,
                    kv_err *e)
{
    int rc = 0;
    *a = dg_row(c, c->ref, layer, st, p, &rc, e);
    *b = dg_row(c, c->test, layer, st, p, &rc, e);
    if (*a && *b)
        return 0;
    free(*a);
    free(*b);
    *a = *b = NULL;
    return rc < 0 ? -1 : 1;
}

/* Tries every other convention at the step's position and at the last
 * compared position of the row (where bases far apart at p part). Fills
 * fits (MAX_CONVS) and *p2 (-1 when only p was tried); returns how many
 * fit, -1 on error. */
static int rope_conv_fits(cmp_ctx *c, const float *a, const float *b, int nh, conv_fit *fits,
                          int64_t *p2, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_rope_conv cv[MAX_CONVS];
    const int n = rope_convs(c->cfg, d->layer, cv);
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    *p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && *p2 >= c->pos_limit)
        *p2 = c->pos_limit - 1;
    float *a2 = NULL, *b2 = NULL;
    if (*p2 > d->pos) {
        const int rc = row_pair(c, d->layer, d->stage, *p2, &a2, &b2, e);
        if (rc < 0)
            return -1;
        if (rc)
            *p2 = -1;
    } else {
        *p2 = -1;
    }
    int nf = 0;
    for (int i = 0; i < n; i++) {
        const double err = cmp_rope_conv_err(c->cfg, d->layer, &cv[i], d->pos, a, b, nh);
        if (!(err <= c->row_tol))
            continue;
        const double err2 = *p2 < 0 ? NAN
                                    : cmp_rope_conv_err(c->cfg, d->layer, &cv[i], *p2, a2, b2, nh);
        if (*p2 >= 0 && !(err2 <= c->row_tol))
            continue;
        fits[nf++] = (conv_fit){.cv = cv[i], .err = err, .err2 = err2};
    }
    free(a2);
    free(b2);
    return nf;
}

/* The rotation-like step explained by another convention. */
static void rope_conv_text(cmp_ctx *c, const conv_fit *fits, int nf, int64_t p2)
{
    const cmp_divergence *d = c->d;
    cmp_diagnosis *g = c->g;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    g->kind = CMP_DIAG_ROPE_CONVENTION;
    g->basis = CMP_BASIS_RECOMPUTED;
    if (nf == 1) {
        dg_say(g->summary, sizeof g->summary, "RoPE convention: the test's %s match %s", what,
            fits[0].cv.what);
        c->ev->rope_err = fits[0].err;
    } else {
        dg_say(g->summary, sizeof g->summary, "RoPE convention: the test's %s match any of %d "
            "conventions other than the config's, and nothing recorded tells them apart", what,
            nf);
    }
    if (nf > 1)
        dg_say(g->detail, sizeof g->detail, "(");
    dg_say(g->evidence, sizeof g->evidence, "rotating the reference's %s under ", what);
    for (int i = 0; i < nf; i++) {
        if (nf > 1)
            dg_append(g->detail, sizeof g->detail, "%s%s", i ? "; " : "", fits[i].cv.what);
        dg_append(g->evidence, sizeof g->evidence, "%s%s", i ? (i == nf - 1 ? " or " : ", ") : "",
               nf > 1 ? fits[i].cv.what : "it");
    }
    if (nf == 1 && fits[0].cv.rows != CMP_ROWS_SAME)
        dg_say(g->detail, sizeof g->detail, "(the rows of each head are rotated in another order "
            "from position %lld on, where RoPE %s; per-head norms equal within %s)",
            (long long)d->pos, d->pos == 0 ? "turns nothing yet" : "first shows it",
            c->r->xrt.on ? "drift" : "1e-5");
    else if (nf == 1)
        dg_say(g->detail, sizeof g->detail, "(position %lld is the first rotated; per-head norms "
            "equal within %s)", (long long)d->pos, c->r->xrt.on ? "drift" : "1e-5");
    else
        dg_append(g->detail, sizeof g->detail, ")");
    dg_append(g->evidence, sizeof g->evidence, " reproduces the test's at position %lld (error "
           "%.2g)", (long long)d->pos, fits[0].err);
    if (p2 >= 0)
        dg_append(g->evidence, sizeof g->evidence, " and at position %lld (%.2g)", (long long)p2,
               fits[0].err2);
    dg_append(g->evidence, sizeof g->evidence, "; errors up to %.2g count as reproducing (%s)",
           c->row_tol, c->r->xrt.on ? "the step's drift threshold" : "exact mode");
}

/* q (or k) rotated for another position: norms equal, an integer offset
 * maps the reference row onto the test row. */
static int rule_rope(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    const int D = c->cfg->head_dim;
    const int nh = d->stage == STAGE_Q ? c->cfg->n_heads : c->cfg->n_kv_heads;
    int rc = 0;
    float *a = dg_row(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
    float *b = dg_row(c, c->test, d->layer, d->stage, d->pos, &rc, e);
    if (!a || !b) {
        free(a);
        free(b);
        return rc;
    }
    ev->norms_equal = head_norms_equal(a, b, nh, D, c->r->xrt.on ? c->row_tol : CMP_NORM_TOL);
    if (ev->norms_equal) {
        conv_fit fits[MAX_CONVS];
        int64_t p2 = -1;
        const int nf = rope_conv_fits(c, a, b, nh, fits, &p2, e);
        if (nf != 0) {
            free(a);
            free(b);
            if (nf > 0)
                rope_conv_text(c, fits, nf, p2);
            return nf < 0 ? -1 : 1;
        }
        ev->rope_err = cmp_rope_solve(c->cfg, d->layer, a, b, nh, &ev->rope_delta);
        ev->rope_found = ev->rope_err <= c->row_tol;
    }
    free(a);
    free(b);
    if (!ev->norms_equal)
        return 0;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    const long long at = (long long)(d->pos + ev->rope_delta);
    if (!ev->rope_found) {
        dg_set(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_HEURISTIC,
                 "a rotation-like difference: per-head norms are preserved");
        if (isfinite(ev->rope_err))
            dg_say(c->g->detail, sizeof c->g->detail, "(but no RoPE offset reproduces the test: "
                "the rotation angles suggest %+lld, which leaves an error of %.2g; a different "
                "RoPE base, scaling or layout?)", (long long)ev->rope_delta, ev->rope_err);
        else
            dg_say(c->g->detail, sizeof c->g->detail, "(but no RoPE offset reproduces the test: "
                "no offset fits the rotation angle of every frequency pair; a different RoPE "
                "base, scaling or layout?)");
        return 1;
    }
    char s[256];
    dg_say(s, sizeof s, "%s rotated as if at position %lld: RoPE position offset of %+lld", what, at,
        (long long)ev->rope_delta);
    dg_set(c, CMP_DIAG_ROPE_OFFSET, CMP_BASIS_RECOMPUTED, s);
    if (at == 0)
        dg_say(c->g->detail, sizeof c->g->detail, "(positions restart at 0 at position %lld: "
            "RoPE positions restart per chunk, as if each chunk were a new sequence)",
            (long long)d->pos);
    dg_say(c->g->evidence, sizeof c->g->evidence, "rotating the reference's %s by %+lld "
        "positions reproduces the test's (error %.2g); per-head norms equal", what,
        (long long)ev->rope_delta, ev->rope_err);
    return 1;
}

/* ------------------------------------------------------------------ */
/* A query or key scaled as a whole                                     */

/* q (or k) equal to the reference's times one factor, within the match
 * tolerance: a scale folded into q, or a norm weight scaled, where the
 * config says otherwise. With Gemma's query_pre_attn_scalar, a factor of
 * sqrt(query_pre_attn_scalar / head_dim) is the attention scale
 * 1/sqrt(head_dim) used in place of the config's (recorders map a
 * runtime's q back to the config's scale). */
static int rule_scaled(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    float *a, *b;
    int rc = row_pair(c, d->layer, d->stage, d->pos, &a, &b, e);
    if (rc)
        return rc < 0 ? -1 : 0;
    double ab = 0, aa = 0;
    for (int i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
    }
    const double f = aa > 0 ? ab / aa : NAN;
    double worst = 0, bmax = 0;
    for (int i = 0; i < n && isfinite(f); i++) {
        worst = fmax(worst, fabs(f * a[i] - b[i]));
        bmax = fmax(bmax, fabs((double)b[i]));
    }
    free(a);
    free(b);
    const double err = bmax > 0 ? worst / bmax : INFINITY;
    if (!isfinite(f) || !(err <= c->row_tol) || fabs(f - 1) <= c->row_tol || f <= 0)
        return 0;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    /* The config's score scale, and the factor that turns it into
     * 1/sqrt(head_dim) on q (1 when they agree). */
    const double D = c->cfg->head_dim;
    const double cfg_scale = c->cfg->attn_scale > 0 ? c->cfg->attn_scale
                             : c->cfg->query_pre_attn_scalar > 0
                                 ? 1.0 / sqrt(c->cfg->query_pre_attn_scalar)
                                 : 1.0 / sqrt(D);
    const double qpas = 1.0 / (cfg_scale * cfg_scale);
    const double to_plain = 1.0 / (sqrt(D) * cfg_scale);
    const double gemma = fabs(to_plain - 1) > 1e-6 ? to_plain : NAN;
    cmp_diagnosis *g = c->g;
    g->basis = CMP_BASIS_RECOMPUTED;
    if (d->stage == STAGE_Q && isfinite(gemma) && fabs(f / gemma - 1) <= c->row_tol) {
        g->kind = CMP_DIAG_ATTN_SCALE;
        dg_say(g->summary, sizeof g->summary, "attention scale: the test scales scores by "
            "1/sqrt(head_dim) = 1/sqrt(%g), the config by %.6g = 1/sqrt(%.6g) "
            "(query_pre_attn_scalar)", D, cfg_scale, qpas);
        dg_say(g->detail, sizeof g->detail, "(its queries are the reference's times %.6g = "
            "sqrt(%.6g/%g), which scores them by 1/sqrt(%g): the ratio of the two scales is not "
            "folded into q (a converter's q_norm weights), or the runtime ignores "
            "query_pre_attn_scalar)", f, qpas, D, D);
    } else {
        g->kind = CMP_DIAG_UNCLASSIFIED;
        dg_say(g->summary, sizeof g->summary, "the test's %s are the reference's times %.6g: a "
            "scale or norm weight applied where the config has none (or missing)", what, f);
        dg_say(g->detail, sizeof g->detail, "(the same factor on every element: a scaled "
            "projection or %s-norm weight, or an attention scale folded into %s)",
            d->stage == STAGE_Q ? "q" : "k", d->stage == STAGE_Q ? "q" : "k");
    }
    dg_say(g->evidence, sizeof g->evidence, "the reference's %s at position %lld times %.6g "
        "reproduce the test's (error %.2g; errors up to %.2g count as reproducing)", what,
        (long long)d->pos, f, err, c->row_tol);
    return 1;
}

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
    const int g = d->stage == STAGE_Q || d->stage == STAGE_K ? cfg->head_dim : n;
    float *a, *b, *x = NULL;
    *err = INFINITY;
    int rc = row_pair(c, d->layer, d->stage, p, &a, &b, e);
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

static int rule_norm_convention(cmp_ctx *c, kv_err *e)
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
    int rc = row_pair(c, d->layer, d->stage, p, &a, &b, e);
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

static int rule_qk_norm_missing(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL ||
        !cfg_qk_norm(cfg))
        return 0;
    const int D = cfg->head_dim, nh = d->stage == STAGE_Q ? cfg->n_heads : cfg->n_kv_heads;
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

/* lse = log(n) on every head: n keys all scoring 0. */
static bool lse_is_log_n(const float *lse, int H, int n)
{
    const double lg = log((double)n);
    bool yes = lse != NULL && n >= 1;
    for (int h = 0; yes && h < H; h++)
        yes = fabs((double)lse[h] - lg) <= 1e-6 * fmax(1.0, lg);
    return yes;
}

static bool all_zero(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (x[i] != 0.0f)
            return false;
    return true;
}

/* Every score 0 (lse = log(n)) and, where attn_out is recorded, every
 * head's output exactly zero: n keys with K = V = 0. Without attn_out the
 * scores alone say K = 0 (V unchecked); without q, a zero query would
 * give the same scores, and the text says so. */
static int rule_zero_kv(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    const int H = c->cfg->n_heads, n = H * c->cfg->head_dim;
    if (!dg_is_attn_stage(d->stage) || !ev->lse_test || ev->nkeys_test < 1 ||
        !lse_is_log_n(ev->lse_test, H, ev->nkeys_test))
        return 0;
    int rc = 0;
    float *out = dg_row(c, c->test, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    float *ref = dg_row(c, c->ref, d->layer, STAGE_ATTN_OUT, d->pos, &rc, e);
    float *q = dg_row(c, c->test, d->layer, STAGE_Q, d->pos, &rc, e);
    const bool zero = !out || all_zero(out, n);
    /* The reference must not show the same: its output is not zero, or
     * (output unrecorded) its scores are not all 0. */
    const bool ref_same = ref ? all_zero(ref, n)
                              : !ev->lse_ref || lse_is_log_n(ev->lse_ref, H, ev->nkeys_ref >= 1
                                                              ? ev->nkeys_ref : ev->nkeys_test);
    const bool q_zero = q && all_zero(q, n);
    const bool have_out = out != NULL, have_q = q != NULL;
    free(out);
    free(ref);
    free(q);
    if (rc < 0 || !zero || ref_same || q_zero)
        return rc;
    const int owner = c->cfg->kv_owner[d->layer];
    const int nt = ev->nkeys_test;
    const double lg = log((double)nt);
    char s[256];
    if (have_out)
        dg_say(s, sizeof s, "attention read K = V = 0 (an empty or unwired cache%s)",
            owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    else if (have_q)
        dg_say(s, sizeof s, "attention read zero keys: every score was 0 (an empty or unwired "
            "cache%s)", owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    else
        dg_say(s, sizeof s, "every attention score was 0: zero keys read (an empty or unwired "
            "cache%s), or a zero query (q not recorded)",
            owner != d->layer ? ", e.g. a KV-shared layer reading nothing" : "");
    dg_set(c, CMP_DIAG_ZERO_KV, CMP_BASIS_EXACT_CHECK, s);
    if (owner != d->layer)
        dg_say(c->g->detail, sizeof c->g->detail, "(layer %d reads layer %d's cache: %s)",
            d->layer, owner, have_out ? "it got nothing from it" : "what it read scored 0");
    dg_say(c->g->evidence, sizeof c->g->evidence, "%sattn_lse = log(%d) = %.6g on every head, "
        "what %d key%s scoring 0 give%s%s", have_out ? "the test's attn_out is exactly 0 for "
        "every head and " : "the test's ", nt, lg, nt, nt == 1 ? "" : "s", nt == 1 ? "s" : "",
        have_out ? "" : "; attn_out not recorded, so V = 0 is not checked");
    return 1;
}

/* Is the point consistent with rounding drift? At an attention stage:
 * attention over the config's keys, recomputed from each run's own q, k,
 * v, reproduces both. Returns 1 yes (how says so), 0 cannot tell (not an
 * attention stage, rows missing), -1 no (the key set itself differs), -2
 * on error. */
static int drift_consistent(cmp_ctx *c, dg_case *a, char *how, size_t n, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    if (!a || d->layer < 0 || !dg_is_attn_stage(d->stage))
        return 0;
    cmp_hyp ref = dg_hyp_config(d, a);
    double err_t;
    if (dg_hyp_err(c, a, &ref, true, &ev->ref_check_err, e) < 0 ||
        dg_hyp_err(c, a, &ref, false, &err_t, e) < 0)
        return -2;
    if (!(ev->ref_check_err <= c->attn_tol) || !isfinite(err_t))
        return 0;
    if (err_t > c->attn_tol)
        return -1;
    ev->recompute = 1;
    ev->hyp_err = err_t;
    dg_say(ev->hypothesis, sizeof ev->hypothesis, "%s", ref.what);
    dg_say(how, n, "; recomputing attention over the config's keys reproduces both runs (errors "
        "%.2g and %.2g)", ev->ref_check_err, err_t);
    return 1;
}

static void drift_text(cmp_ctx *c, cmp_basis basis, const char *how)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    char grow[160] = "";
    dg_set(c, CMP_DIAG_NUMERIC_DRIFT, basis, c->beyond
             ? "numeric drift (a different rounding order, e.g. cascade attention): no cache "
               "bug up to here"
             : "numeric drift (a different rounding order, e.g. cascade attention): not a "
               "cache bug");
    if (ev->growth_layer_last >= 0)
        dg_say(grow, sizeof grow, ", %.2g at layer %d's x_out", ev->growth_last,
            ev->growth_layer_last);
    if (c->beyond)
        dg_say(c->g->detail, sizeof c->g->detail, "(it grew past %.0e here%s; later positions were "
            "not checked: compare with a tolerance or a noise floor for those)", CMP_DRIFT_BOUND,
            grow);
    else
        dg_say(c->g->detail, sizeof c->g->detail, "(relative error %.2g at the first divergence%s; "
            "never above %.0e, and keys attended identical at every position and layer%s)",
            d->row_rel, grow, CMP_DRIFT_BOUND,
            cmp_settings_is(c->test, "attention", "cascade") ? "; the test ran cascade attention"
                                                              : "");
    dg_say(c->g->evidence, sizeof c->g->evidence, "%s%s", c->beyond
        ? "attention at this point reads the config's keys"
        : "tiny relative error (<= 1e-04) that stays small, no key-count difference anywhere",
        how);
}

/* A tiny first divergence (or, beyond it, a larger one) that rounding
 * explains. Returns 1 when it is drift, 2 when this point is drift but a
 * larger difference follows (diagnose that one), 0 not drift, -1 error. */
static int rule_drift(cmp_ctx *c, dg_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const cmp_evidence *ev = c->ev;
    if (d->nonfinite || (ev->nkeys_ref >= 0 && ev->nkeys_test >= 0 &&
                         ev->nkeys_ref != ev->nkeys_test))
        return 0;
    if (!c->beyond && !(d->row_rel <= CMP_DRIFT_REL))
        return 0;
    char how[256] = "";
    const int cons = drift_consistent(c, a, how, sizeof how, e);
    if (cons == -2)
        return -1;
    if (cons < 0 || (c->beyond && cons == 0))
        return 0;
    if (!c->beyond && c->r->beyond.found)
        return 2;
    /* A count that differs anywhere is a row larger than drift: `beyond`
     * would hold it. Checked again since "not a cache bug" rests on it. */
    if (!c->beyond && ev->nkeys_diff_pos >= 0)
        return 0;
    if (growth_evidence(c, e) < 0)
        return -1;
    drift_text(c, cons == 1 ? CMP_BASIS_RECOMPUTED : CMP_BASIS_HEURISTIC, how);
    return 1;
}

/* ------------------------------------------------------------------ */
/* Unclassified                                                         */

static const char *stage_hint(kv_stage s)
{
    switch (s) {
    case STAGE_EMBED: return "the embedding differs: other weights, token ids or embedding scale";
    case STAGE_X_IN: return "the residual stream entering the layer differs";
    case STAGE_ATTN_NORM_STATS:
    case STAGE_ATTN_NORM:
    case STAGE_FFN_NORM_STATS:
    case STAGE_FFN_NORM:
    case STAGE_FINAL_NORM: return "a normalisation differs (eps, the (1 + w) convention, weights)";
    case STAGE_Q:
    case STAGE_K:
    case STAGE_V: return "a projection differs (weights, bias, q/k norm or RoPE)";
    case STAGE_ATTN_LSE:
    case STAGE_ATTN_NKEYS:
    case STAGE_ATTN_OUT: return "attention differs";
    case STAGE_ATTN_PROJ: return "the output projection differs (o_proj or its norm)";
    case STAGE_H_MID:
    case STAGE_X_OUT: return "the residual addition differs";
    case STAGE_FFN_OUT: return "the MLP differs (weights or activation)";
    case STAGE_LOGITS: return "the LM head differs (weights or softcap)";
    default: return "";
    }
}

static void rule_unclassified(cmp_ctx *c)
{
    const cmp_divergence *d = c->d;
    dg_set(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_NONE, "unclassified");
    if (c->beyond) {
        dg_say(c->g->detail, sizeof c->g->detail, "(after numeric drift from position %lld: a "
            "relative error of %.2g at %s, drift grown past %.0e or a bug; compare with a "
            "tolerance or a noise floor to tell)", (long long)c->r->first.pos, d->row_rel,
            stage_name(d->stage), CMP_DRIFT_BOUND);
        return;
    }
    if (d->hashed) {
        dg_say(c->g->detail, sizeof c->g->detail, "(fingerprints locate the row only: record "
            "position %lld of layer %d in full to see the element and a diagnosis)",
            (long long)d->pos, d->layer);
        return;
    }
    if (dg_is_attn_stage(d->stage) && c->ev->qkv == 1 && c->ev->nkeys_ref == c->ev->nkeys_test &&
        c->ev->lse_ref && c->ev->lse_test &&
        !memcmp(c->ev->lse_ref, c->ev->lse_test, (size_t)c->ev->n_heads * sizeof(float))) {
        dg_say(c->g->detail, sizeof c->g->detail, "(attn_out differs with identical q, k, v, "
            "scores and key counts: the values read differ)");
        return;
    }
    dg_say(c->g->detail, sizeof c->g->detail, "(first difference at %s: %s; relative error "
        "%.2g)", stage_name(d->stage), stage_hint(d->stage), d->row_rel);
}

/* ------------------------------------------------------------------ */
/* Entry                                                                */

static int run_rules(cmp_ctx *c, dg_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    int rc;
    if (d->nonfinite) {
        /* A softmax over no key at all (the own key masked at position 0)
         * is NaN in most runtimes: a key set explains it before a bad
         * value does. */
        if (d->layer >= 0 && dg_is_attn_stage(d->stage) && (rc = dg_rule_keyset(c, a, e)) != 0)
            return rc < 0 ? -1 : 0;
        rule_nonfinite(c);
        return 0;
    }
    if (d->layer >= 0 && (rc = dg_rule_rows(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_rope(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_scaled(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if ((rc = rule_norm_convention(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_qk_norm_missing(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = rule_zero_kv(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if ((rc = rule_drift(c, d->layer >= 0 ? a : NULL, e)) != 0)
        return rc < 0 ? -1 : rc == 2 ? 2 : 0;
    if (d->layer >= 0 && (rc = dg_rule_keyset(c, a, e)) != 0)
        return rc < 0 ? -1 : 0;
    rule_unclassified(c);
    return 0;
}

/* Evidence and rules at the point c->d. Returns 0, 2 (drift here, a
 * larger difference follows), -1 on error. */
static int diagnose_point(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    ev->recompute = -1;
    ev->nkeys_ref = ev->nkeys_test = -1;
    ev->qkv = -1;
    ev->nkeys_diff_pos = -1;
    ev->nkeys_diff_layer = -1;
    ev->growth_first = ev->growth_last = NAN;
    ev->growth_layer_last = -1;
    ev->ref_check_err = ev->hyp_err = ev->rope_err = NAN;
    if (d->hashed) {
        rule_unclassified(c);
        return 0;
    }
    dg_case a;
    memset(&a, 0, sizeof a);
    int rc = 0;
    if (d->layer >= 0) {
        qkv_evidence(c);
        rc = attn_stats_evidence(c, e);
        if (rc == 0)
            rc = dg_case_init(c, &a, e);
    }
    if (rc == 0 && !c->beyond)
        rc = nkeys_scan(c, e);
    if (rc == 0)
        rc = run_rules(c, &a, e);
    dg_case_free(&a);
    return rc;
}

/* A divergence found in /output alone: every recorded stage at its
 * position is identical, so what differs comes after them. */
static void diagnose_output(cmp_ctx *c)
{
    dg_set(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_NONE, "unclassified");
    dg_say(c->g->detail, sizeof c->g->detail, "(/output differs at position %lld, %d of its "
        "entries, while every recorded stage there is identical: the final norm, the LM head "
        "or the logits' softcap differs, or /output was written otherwise; record final_norm "
        "and logits to see which)", (long long)c->d->pos, c->d->n_bad);
}

int cmp_diagnose(cmp_ctx *c, kv_err *e)
{
    cmp_result *r = c->r;
    c->d = &r->first;
    c->ev = &r->ev;
    c->g = &r->diag;
    c->beyond = false;
    c->attn_tol = c->row_tol = CMP_MATCH_TOL;
    if (r->first.from_output) {
        diagnose_output(c);
        return 0;
    }
    /* Where the attention check ran, the runtime's attention is modelled
     * (its q, k, v rounded as it holds them, its compute precision): a
     * hypothesis must reproduce the test as closely as the check's own
     * recomputation does, not merely within the drift floor against the
     * reference (16 unit roundoffs of a bf16 cache, 6.65%, would let a
     * wrong key set pass for a right one). */
    c->attn_checked = r->xrt.on && !r->xrt.audit_skip[0] && r->xrt.audit_layers > 0;
    c->rms_weight = c->attn_checked ? r->xrt.audit_rms_weight : 0;
    if (r->xrt.on) {
        c->attn_tol = c->attn_checked ? r->xrt.audit_threshold : cmp_xrt_attn_floor(&r->xrt);
        c->row_tol = r->xrt.step_threshold > 0 ? r->xrt.step_threshold : c->attn_tol;
    }
    /* Hypotheses recomputed from the test's q, k, v as the check
     * recomputes them, rounded as the runtime holds them. */
    cmp_source modelled;
    void *handle = NULL;
    const cmp_source *test = c->test;
    if (c->attn_checked) {
        handle = cmp_xrt_modelled_source(c->test, &r->xrt, &modelled);
        if (!handle)
            return kv_errf(e, "compare: out of memory");
        c->test = &modelled;
    }
    int rc = diagnose_point(c, e);
    c->test = test;
    free(handle);
    if (rc != 2) {
        r->beyond.found = false;   /* not drift first: nothing is "beyond" it */
        return rc;
    }
    /* Drift first, then something larger: name that one. */
    memset(&r->diag, 0, sizeof r->diag);
    c->d = &r->beyond;
    c->ev = &r->beyond_ev;
    c->beyond = true;
    c->ev->nkeys_diff_pos = r->ev.nkeys_diff_pos;
    c->ev->nkeys_diff_layer = r->ev.nkeys_diff_layer;
    rc = diagnose_point(c, e);
    return rc == 2 ? 0 : rc;
}
