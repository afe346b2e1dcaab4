/* rope.c — the rotation families (docs/diagnosis.md): q or k rotated
 * for another position (rope_offset), under another RoPE convention (base,
 * scaling, pair layout, rows' order: rope_convention), or scaled as a
 * whole (attn_scale). Each transforms the reference's row and must
 * reproduce the test's at p and at the last compared position. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"
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

/* The rows of the step's stage on both sides at the last compared
 * position of the row (before the token cut), where conventions close at
 * the step part: *p2 and the rows (malloc'd), or *p2 = -1 and NULL when
 * there is none past the step. 0, -1 on error. */
static int last_pair(cmp_ctx *c, int64_t *p2, float **a2, float **b2, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const cmp_stage_result *sr = cmp_result_stage(c->r, d->layer, d->stage);
    *p2 = sr ? sr->pos_hi : -1;
    if (c->pos_limit >= 0 && *p2 >= c->pos_limit)
        *p2 = c->pos_limit - 1;
    *a2 = *b2 = NULL;
    if (*p2 <= d->pos) {
        *p2 = -1;
        return 0;
    }
    const int rc = dg_row_pair(c, d->layer, d->stage, *p2, a2, b2, e);
    if (rc < 0)
        return -1;
    if (rc)
        *p2 = -1;
    return 0;
}

/* Conventions that reproduce the test at pos (and at pos2 when >= 0). */
typedef struct {
    cmp_rope_conv cv;
    double err, err2;
} conv_fit;


/* Where the walk found a rotation under the size threshold, what a
 * candidate must leave of the row (a, b) at the step, as the walk's test
 * did: CMP_ROT_BACK times less than the row differs, by the walk's
 * measure of the row (its error there) or this one, the larger. */
static double rot_back_tol(const cmp_ctx *c, const float *a, const float *b)
{
    const double own = cmp_row_rel_err(a, b, cmp_stage_cols(c->cfg, c->d->layer, c->d->stage));
    const double walk = c->r->xrt.step ? c->r->xrt.step_err : 0;
    return fmax(own, isfinite(walk) ? walk : 0) / CMP_ROT_BACK;
}

/* Tries every other convention at the step's position and at the last
 * compared position of the row (where bases far apart at p part). Fills
 * fits (CMP_ROPE_MAX_CONVS) and *p2 (-1 when only p was tried); returns how many
 * fit, -1 on error. */
static int rope_conv_fits(cmp_ctx *c, const float *a, const float *b, int nh, conv_fit *fits,
                          int64_t *p2, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_rope_conv cv[CMP_ROPE_MAX_CONVS];
    const int n = cmp_rope_convs(c->cfg, d->layer, cv);
    float *a2 = NULL, *b2 = NULL;
    if (last_pair(c, p2, &a2, &b2, e) < 0)
        return -1;
    /* Where the walk found a rotation under the size threshold, a
     * candidate must explain the row here as its test did. */
    double tol_p = c->row_tol;
    if (c->r->xrt.rot_step)
        tol_p = rot_back_tol(c, a, b);
    int nf = 0;
    for (int i = 0; i < n; i++) {
        const double err = cmp_rope_conv_err(c->cfg, d->layer, &cv[i], d->pos, a, b, nh);
        if (!(err <= tol_p))
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

/* "position 1 is the first rotated", or, where the step sits later (a
 * convention turns every position from 1 on, but a coarse cache's noise
 * hides its first rows), where it first stands out of the drift. */
static void first_rotated_words(const cmp_ctx *c, char *buf, size_t n)
{
    if (c->d->pos > 1 && c->r->xrt.on)
        dg_say(buf, n, "it turns every position from 1 on; position %lld is the first where it "
               "stands out of the drift", (long long)c->d->pos);
    else
        dg_say(buf, n, "position %lld is the first rotated", (long long)c->d->pos);
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
    else if (nf == 1) {
        char first[160];
        first_rotated_words(c, first, sizeof first);
        dg_say(g->detail, sizeof g->detail, "(%s; per-head norms equal within %s)", first,
               c->r->xrt.on ? "drift" : "1e-5");
    }
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

/* ------------------------------------------------------------------ */
/* Another number of pairs rotated                                      */

typedef struct {
    int lo, hi, count;           /* pair counts that fit: lo..hi, how many (0 none) */
    double err, err2;            /* at lo: the errors at p and at p2 */
} part_fit;

/* Every pair count of every layout against the test's rows at p and at
 * the last compared position p2 (as rope_conv_fits). Returns the layouts
 * with a fit, -1 on error. */
static int rope_partial_fits(cmp_ctx *c, const float *a, const float *b, int nh,
                             part_fit fits[CMP_PART_KINDS], int64_t *p2, kv_err *e)
{
    const cmp_divergence *d = c->d;
    const int half = config_layer_head_dim(c->cfg, d->layer) / 2;
    for (int k = 0; k < CMP_PART_KINDS; k++)
        fits[k] = (part_fit){0};
    /* Nothing turns at position 0; and a candidate must explain what the
     * config's own rotation leaves, far above what it fits to (a step
     * found by its structure, under the size threshold, is fitted by
     * anything that barely moves the row). */
    const double own_err = cmp_row_rel_err(a, b, cmp_stage_cols(c->cfg, d->layer, d->stage));
    /* A step the walk found as a rotation (drift by its size) may sit
     * where the rotation first shows, under the threshold: there a
     * candidate must explain the row as the walk's test did. */
    const bool rot = c->r->xrt.rot_step;
    if (d->pos == 0 || !(own_err > (rot ? 0 : c->row_tol)))
        return 0;
    const double tol = rot ? rot_back_tol(c, a, b) : fmin(c->row_tol, own_err / 4);
    float *a2 = NULL, *b2 = NULL;
    if (last_pair(c, p2, &a2, &b2, e) < 0)
        return -1;
    int kinds = 0;
    for (int k = 0; k < CMP_PART_KINDS; k++) {
        part_fit *f = &fits[k];
        for (int np = 1; np <= half; np++) {
            if (cmp_rope_partial_is_own(c->cfg, d->layer, (cmp_part_kind)k, np))
                continue;
            const cmp_rope_conv cv = cmp_rope_partial(c->cfg, d->layer, (cmp_part_kind)k, np);
            const double err = cmp_rope_conv_err(c->cfg, d->layer, &cv, d->pos, a, b, nh);
            if (!(err <= tol))
                continue;
            const double err2 = *p2 < 0 ? NAN
                                : cmp_rope_conv_err(c->cfg, d->layer, &cv, *p2, a2, b2, nh);
            if (*p2 >= 0 && !(err2 <= c->row_tol))
                continue;
            if (f->count++ == 0) {
                f->lo = np;
                f->err = err;
                f->err2 = err2;
            }
            f->hi = np;
        }
        kinds += f->count > 0;
    }
    free(a2);
    free(b2);
    return kinds;
}

/* A count of pairs, or its range: "8", "20 to 32"; and the same as a
 * partial rotary factor of the head's pairs. */
static void part_counts(const part_fit *f, int half, bool factor, char *buf, size_t n)
{
    if (factor && f->lo == f->hi)
        dg_say(buf, n, "%.3g", (double)f->lo / half);
    else if (factor)
        dg_say(buf, n, "%.3g to %.3g", (double)f->lo / half, (double)f->hi / half);
    else if (f->lo == f->hi)
        dg_say(buf, n, "%d", f->lo);
    else
        dg_say(buf, n, "%d to %d", f->lo, f->hi);
}

/* What a layout's fit says, short ("a rope dimension count of 16 (partial
 * factor 0.5)") and its pairs and frequencies ("pairs (i, i + n) of the
 * first 2n dimensions at theta^(-i/n)"). */
static void part_phrase(const kv_config *cfg, int layer, cmp_part_kind k, const part_fit *f,
                        char *name, size_t nn, char *how, size_t nh)
{
    const int D = config_layer_head_dim(cfg, layer), half = D / 2;
    char fac[48], dims[48];
    part_counts(f, half, true, fac, sizeof fac);
    const part_fit twice = {.lo = 2 * f->lo, .hi = 2 * f->hi};
    part_counts(&twice, half, false, dims, sizeof dims);
    switch (k) {
    case CMP_PART_PROPORTIONAL:
        dg_say(name, nn, "a proportional partial rotary factor of %s", fac);
        dg_say(how, nh, "pairs (i, i + %d) at the whole head's frequencies theta^(-2i/%d), "
               "the rest unrotated, as Gemma 4's proportional RoPE (llama.cpp: rope_freqs)",
               half, D);
        break;
    case CMP_PART_NEOX:
        dg_say(name, nn, "a rope dimension count of %s of %d (partial rotary factor %s)", dims,
               D, fac);
        dg_say(how, nh, "pairs (i, i + n) of the first 2n dimensions at theta^(-i/n), the "
               "rest unrotated, as a rotary dimension (llama.cpp's n_rot) below the head size "
               "rotates");
        break;
    default:
        dg_say(name, nn, "a rope dimension count of %s of %d on rows laid out for halves", dims,
               D);
        dg_say(how, nh, "pairs (i, i + %d) for i < n at theta^(-i/n): the first 2n rows of an "
               "interleaved runtime rotated, mapped back to halves", half);
        break;
    }
}

static void rope_partial_text(cmp_ctx *c, const part_fit fits[CMP_PART_KINDS], int kinds,
                              int64_t p2)
{
    const cmp_divergence *d = c->d;
    const kv_config *cfg = c->cfg;
    cmp_diagnosis *g = c->g;
    const char *what = d->stage == STAGE_Q ? "queries" : "keys";
    const int own = config_layer_rope_pairs(cfg, d->layer);
    const int half = config_layer_head_dim(cfg, d->layer) / 2;
    g->kind = CMP_DIAG_ROPE_CONVENTION;
    g->basis = CMP_BASIS_RECOMPUTED;
    const part_fit *first = NULL;
    int shown = 0;
    char name[128], how[256];
    for (int k = 0; k < CMP_PART_KINDS; k++) {
        if (!fits[k].count)
            continue;
        part_phrase(cfg, d->layer, (cmp_part_kind)k, &fits[k], name, sizeof name, how, sizeof how);
        if (!first) {
            first = &fits[k];
            char cnt[48];
            part_counts(first, half, false, cnt, sizeof cnt);
            if (kinds == 1) {
                dg_say(g->summary, sizeof g->summary, "RoPE turns %s of the %d pairs of each "
                       "head where the config turns %d: %s", cnt, half, own, name);
                char firstw[160];
                first_rotated_words(c, firstw, sizeof firstw);
                dg_say(g->detail, sizeof g->detail, "(the test's %s: %s; %s; per-head norms "
                       "equal within %s%s)", what, how, firstw, c->r->xrt.on ? "drift" : "1e-5",
                       first->lo != first->hi ? "; the pairs past the lower count turn too "
                       "little by the last position compared to tell the counts apart" : "");
            } else {
                dg_say(g->summary, sizeof g->summary, "RoPE turns other pairs of each head "
                       "than the config's %d of %d, in one of %d ways nothing recorded tells "
                       "apart", own, half, kinds);
                dg_say(g->detail, sizeof g->detail, "(");
            }
        }
        if (kinds > 1)
            dg_append(g->detail, sizeof g->detail, "%s%s: %s", shown ? "; or " : "", name, how);
        shown++;
    }
    if (kinds > 1)
        dg_append(g->detail, sizeof g->detail, ")");
    c->ev->rope_err = first->err;
    dg_say(g->evidence, sizeof g->evidence, "undoing the config's rotation of the reference's "
           "%s and turning %d pair%s%s instead reproduces the test's at position %lld (error "
           "%.2g)", what, first->lo, first->lo == 1 ? "" : "s", first->lo != first->hi
           ? " (the fewest that fit)" : "", (long long)d->pos, first->err);
    if (p2 >= 0)
        dg_append(g->evidence, sizeof g->evidence, " and at position %lld (%.2g)",
                  (long long)p2, first->err2);
    dg_append(g->evidence, sizeof g->evidence, "; errors up to %.2g count as reproducing (%s)",
              c->row_tol, c->r->xrt.on ? "the step's drift threshold" : "exact mode");
}

/* q (or k) rotated for another position: norms equal, an integer offset
 * maps the reference row onto the test row. */
/* The layer rotates with the other layer type's base: is it run as the
 * other type altogether? At the last position the test holds of the layer,
 * attention recomputed from its own rows over every key (a sliding layer
 * run as global) or over the sliding window (a global one run as sliding)
 * against the config's keys. Renames the diagnosis a layer type when the
 * other type's keys fit and the config's do not; otherwise says what
 * would tell. 0, -1 on error. */
static int layer_type_from_rope(cmp_ctx *c, kv_err *e)
{
    const kv_config *cfg = c->cfg;
    const int l = c->d->layer, W = config_layer_window(cfg, l);
    int Ws = 0;
    for (int L = 0; L < cfg->n_layers && Ws == 0; L++)
        Ws = config_layer_window(cfg, L);
    int64_t lo, q;
    if (dg_attn_held(c, l, &lo, &q) != 0 || Ws <= 0)
        return 0;
    const int reach = W > 0 ? W : Ws;   /* where the windows part */
    if (q < reach) {
        dg_append(c->g->detail, sizeof c->g->detail, "; a layer run as the other type would "
                  "show in its keys from position %d on, which the test did not reach", reach);
        return 0;
    }
    cmp_hyp own = {.lo = W > 0 && q - W + 1 > 0 ? q - W + 1 : 0, .hi = q};
    cmp_hyp other = {.lo = W > 0 ? 0 : (q - Ws + 1 > 0 ? q - Ws + 1 : 0), .hi = q};
    double e_own, e_other;
    int64_t tn;
    int rc = dg_attn_err_at(c, l, q, &own, false, &e_own, &tn, e);
    if (rc == 0)
        rc = dg_attn_err_at(c, l, q, &other, false, &e_other, &tn, e);
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    if (!(e_other <= c->attn_tol) || e_own <= c->attn_tol)
        return 0;
    char layers[256] = "";
    int n_other = 0;
    if (dg_layer_survey(c, q, INT64_MAX, layers, sizeof layers, &n_other, e) < 0)
        return -1;
    c->g->kind = CMP_DIAG_LAYER_TYPE;
    char *it = strstr(c->g->evidence, " under it ");
    if (it) {   /* "it" was the convention the summary named */
        char rest[1024];
        dg_say(rest, sizeof rest, "%s", it + strlen(" under it "));
        dg_say(it, sizeof c->g->evidence - (size_t)(it - c->g->evidence), " under the %s "
               "layers' base %s", W > 0 ? "global" : "sliding", rest);
    }
    if (W > 0)
        dg_say(c->g->summary, sizeof c->g->summary, "layer %d runs as a global layer: it rotates "
               "with the global layers' base and reads every key; the config says sliding "
               "(window %d): a layer type off?", l, W);
    else
        dg_say(c->g->summary, sizeof c->g->summary, "layer %d runs as a sliding layer: it "
               "rotates with the sliding layers' base and reads a window of %d keys; the config "
               "says global: a layer type off?", l, Ws);
    dg_say(c->g->detail, sizeof c->g->detail, "(layers read otherwise than the config at "
           "position %lld: %s)", (long long)q, n_other ? layers : "none other");
    dg_append(c->g->evidence, sizeof c->g->evidence, "; at position %lld attention recomputed "
              "from the test's q, k, v over %s reproduces its attn_out (error %.2g), over the "
              "config's keys it does not (%.2g)", (long long)q, W > 0 ? "every key" : "the "
              "sliding window", e_other, e_own);
    return 0;
}

int dg_rule_rope(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    cmp_evidence *ev = c->ev;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    const int D = config_layer_head_dim(c->cfg, d->layer);
    const int nh = d->stage == STAGE_Q ? c->cfg->n_heads : config_layer_kv_heads(c->cfg, d->layer);
    int rc = 0;
    float *a = dg_row(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
    float *b = dg_row(c, dg_test_rows(c), d->layer, d->stage, d->pos, &rc, e);
    if (!a || !b) {
        free(a);
        free(b);
        return rc;
    }
    ev->norms_equal = head_norms_equal(a, b, nh, D, c->r->xrt.on ? c->row_tol : CMP_NORM_TOL);
    /* MLA turns each head's tail alone: the conventions and partial
     * rotations below model whole heads, the offset solver knows tails. */
    const bool mla = config_mla(c->cfg);
    if (ev->norms_equal) {
        conv_fit fits[CMP_ROPE_MAX_CONVS];
        int64_t p2 = -1;
        const int nf = mla ? 0 : rope_conv_fits(c, a, b, nh, fits, &p2, e);
        if (nf != 0) {
            free(a);
            free(b);
            if (nf > 0)
                rope_conv_text(c, fits, nf, p2);
            if (nf == 1 && strstr(fits[0].cv.what, "layers' base, on a") &&
                layer_type_from_rope(c, e) < 0)
                return -1;
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
        /* Fewer or more pairs turned than the config's. */
        part_fit pf[CMP_PART_KINDS];
        int64_t p2 = -1;
        rc = 0;
        a = dg_row(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
        b = dg_row(c, dg_test_rows(c), d->layer, d->stage, d->pos, &rc, e);
        const int kinds = a && b && D >= 4 && !mla ? rope_partial_fits(c, a, b, nh, pf, &p2, e)
                                                   : 0;
        free(a);
        free(b);
        if (rc < 0 || kinds < 0)
            return -1;
        if (kinds > 0) {
            rope_partial_text(c, pf, kinds, p2);
            return 1;
        }

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
int dg_rule_scaled(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if ((d->stage != STAGE_Q && d->stage != STAGE_K) || d->row_rel <= CMP_DRIFT_REL)
        return 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    float *a, *b;
    int rc = dg_row_pair(c, d->layer, d->stage, d->pos, &a, &b, e);
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
    const double D = config_layer_head_dim(c->cfg, d->layer);
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
/* Scores scaled otherwise                                              */

/* Error of attention at (layer, q) over the config's keys, from the
 * test's own q, k, v, with the scores scaled by s. +inf when it cannot be
 * recomputed there. 0, -1 on error. */
static int scaled_err(cmp_ctx *c, int layer, int64_t q, double s, double *err, kv_err *e)
{
    const int W = config_layer_window(c->cfg, layer);
    const cmp_hyp h = {.lo = W > 0 && q - W + 1 > 0 ? q - W + 1 : 0, .hi = q};
    kv_config tmp = *c->cfg;
    tmp.attn_scale = s;
    const kv_config *keep = c->cfg;
    c->cfg = &tmp;
    int64_t tn;
    const int rc = dg_attn_err_at(c, layer, q, &h, false, err, &tn, e);
    c->cfg = keep;
    if (rc != 0)
        *err = INFINITY;
    return rc < 0 ? -1 : 0;
}

int dg_rule_scores_scaled(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if (!dg_is_attn_stage(d->stage) || d->layer < 0 || d->pos < 1)
        return 0;
    const int l = d->layer;
    const double D = config_layer_head_dim(c->cfg, l);
    const double s0 = c->cfg->attn_scale > 0 ? c->cfg->attn_scale
                      : c->cfg->query_pre_attn_scalar > 0
                          ? 1.0 / sqrt(c->cfg->query_pre_attn_scalar) : 1.0 / sqrt(D);
    double e0;
    if (scaled_err(c, l, d->pos, s0, &e0, e) < 0)
        return -1;
    if (!isfinite(e0) || e0 <= c->attn_tol)
        return 0;   /* nothing recomputed, or the config's scale fits */
    /* A grid over factors 1/16 .. 16 (log-spaced), then golden sections
     * around the best point. */
    double best_f = 1, best = e0;
    for (int i = -24; i <= 24; i++) {
        const double f = exp2(i / 6.0), s = s0 * f;
        double er;
        if (i == 0)
            continue;
        if (scaled_err(c, l, d->pos, s, &er, e) < 0)
            return -1;
        if (er < best) {
            best = er;
            best_f = f;
        }
    }
    if (best_f == 1)
        return 0;
    double lo = log(best_f) - log(2) / 6, hi = log(best_f) + log(2) / 6;
    const double gr = (sqrt(5.0) - 1) / 2;
    for (int it = 0; it < 40; it++) {
        const double m1 = hi - gr * (hi - lo), m2 = lo + gr * (hi - lo);
        double e1, e2;
        if (scaled_err(c, l, d->pos, s0 * exp(m1), &e1, e) < 0 ||
            scaled_err(c, l, d->pos, s0 * exp(m2), &e2, e) < 0)
            return -1;
        if (e1 < e2)
            hi = m2;
        else
            lo = m1;
    }
    const double f = exp((lo + hi) / 2), s = s0 * f;
    if (scaled_err(c, l, d->pos, s, &best, e) < 0)
        return -1;
    /* The same factor at the last position the test holds of the layer. */
    int64_t held_lo, q2;
    double err2 = NAN;
    if (dg_attn_held(c, l, &held_lo, &q2) == 0) {
        if (c->pos_limit >= 0 && q2 >= c->pos_limit)
            q2 = c->pos_limit - 1;
        if (q2 > d->pos && scaled_err(c, l, q2, s, &err2, e) < 0)
            return -1;
    }
    if (!(best <= c->attn_tol) || (!isnan(err2) && !(err2 <= c->attn_tol)) ||
        fabs(f - 1) <= 1e-3)
        return 0;
    /* The scales as 1/sqrt(X): the config's X0 (query_pre_attn_scalar, or
     * the head size), the test's X. */
    const double X = 1 / (s * s), X0 = 1 / (s0 * s0);
    char why[160] = "";
    if (fabs(X / D - 1) <= 0.01 && fabs(X0 / D - 1) > 0.01)
        dg_say(why, sizeof why, ": 1/sqrt(head_dim), the config's query_pre_attn_scalar (%g) "
               "ignored", X0);
    else if (fabs(2 * X / X0 - 1) <= 0.01)
        dg_say(why, sizeof why, " = 1/sqrt(%g): the scalar halved (query_pre_attn_scalar, or "
               "the head size it stands for)", X0);
    else if (fabs(X / (2 * X0) - 1) <= 0.01)
        dg_say(why, sizeof why, " = 1/sqrt(%g): the scalar doubled (query_pre_attn_scalar, or "
               "the head size it stands for)", X0);
    else
        dg_say(why, sizeof why, " (the test's is %.4g times it)", f);
    char sum[256];
    dg_say(sum, sizeof sum, "attention scale: the test scales scores by %.6g = 1/sqrt(%.4g) "
           "where the config says %.6g%s", s, X, s0, why);
    dg_set(c, CMP_DIAG_ATTN_SCALE, CMP_BASIS_RECOMPUTED, sum);
    dg_say(c->g->detail, sizeof c->g->detail, "(layer %d from position %lld: q, k and v are the "
           "reference's within drift; the softmax is sharper or flatter: the scale applied to "
           "q.k, not to q)", l, (long long)d->pos);
    dg_say(c->g->evidence, sizeof c->g->evidence, "attention recomputed from the test's own q, "
           "k, v over the config's keys reproduces its %s with the scores scaled by %.6g (error "
           "%.2g at position %lld", dg_recorded_attn(c), s, best, (long long)d->pos);
    if (!isnan(err2))
        dg_append(c->g->evidence, sizeof c->g->evidence, ", %.2g at position %lld", err2,
                  (long long)q2);
    dg_append(c->g->evidence, sizeof c->g->evidence, "), not with the config's %.6g (%.2g); "
              "errors up to %.2g count as reproducing", s0, e0, c->attn_tol);
    return 1;
}
