/* diagnose.c — the driver of the diagnosis (docs/diagnosis.md): the
 * evidence at the point under diagnosis (the first divergence, or the
 * first difference beyond drift), then the families in order, most
 * specific first: a NaN a key set explains, non-finite values, rows
 * written otherwise (rows.c), rotations and scales (rope.c), norms
 * (norms.c), attention that read zeros, numeric drift (here), the key-set
 * hypothesis engine (keysets.c), and otherwise "unclassified" with the
 * evidence.
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
    case STAGE_KV_LATENT: return "the latent cache row differs (kv_a_proj_with_mqa, "
                                 "kv_a_layernorm, or the key tail's RoPE)";
    case STAGE_ATTN_LSE:
    case STAGE_ATTN_NKEYS:
    case STAGE_ATTN_OUT: return "attention differs";
    case STAGE_ATTN_SINK: return "the attention sink's share differs (sink logits, or the keys "
                                 "it competes with)";
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
    dg_set(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_NONE, "cause not identified");
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

/* A key count that is no count (a fraction, negative): the recording is
 * malformed there, as `kvdiff validate` says, and nothing about attention
 * can be read from it. 1 when it names the point, 0, -1 on error. */
static int rule_bad_count(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if (d->stage != STAGE_ATTN_NKEYS || d->layer < 0)
        return 0;
    const int H = c->cfg->n_heads;
    for (int side = 0; side < 2; side++) {
        int rc = 0;
        const cmp_source *src = side ? c->ref : dg_test_rows(c);
        float *row = dg_row(c, src, d->layer, STAGE_ATTN_NKEYS, d->pos, &rc, e);
        if (rc < 0)
            return -1;
        int h = -1;
        for (int i = 0; row && i < H && h < 0; i++)
            if (!(row[i] >= 0) || row[i] != floorf(row[i]))
                h = i;
        const double v = h >= 0 ? row[h] : 0;
        free(row);
        if (h < 0)
            continue;
        const char *who = side ? "reference" : "test";
        char s[256];
        dg_say(s, sizeof s, "the %s's attn_nkeys is no key count: %.9g at position %lld, head %d "
               "(counts are whole numbers >= 0): the recording is malformed there", who, v,
               (long long)d->pos, h);
        dg_set(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_EXACT_CHECK, s);
        dg_say(c->g->detail, sizeof c->g->detail, "(kvdiff validate %s rejects it; a recorder "
               "that writes counts through a float computation, or an edit, leaves this)",
               src->label ? src->label : who);
        dg_say(c->g->evidence, sizeof c->g->evidence, "the %s's attn_nkeys row at position %lld "
               "of layer %d holds %.9g for head %d, not a whole number", who, (long long)d->pos,
               d->layer, v, h);
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Entry                                                                */

static int run_rules(cmp_ctx *c, dg_case *a, kv_err *e)
{
    const cmp_divergence *d = c->d;
    int rc;
    if ((rc = rule_bad_count(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->nonfinite) {
        /* A softmax over no key at all (the own key masked at position 0)
         * is NaN in most runtimes: a key set explains it before a bad
         * value does. */
        if (d->layer >= 0 && dg_is_attn_stage(d->stage) && (rc = dg_rule_keyset(c, a, e)) != 0)
            return rc < 0 ? -1 : 0;
        rule_nonfinite(c);
        return 0;
    }
    /* the rows' own type first: a bf16 row read as f32 looks rotated */
    if ((rc = dg_rule_stated_precision(c, e, true)) != 0)
        return rc;
    if (d->layer >= 0 && (rc = dg_rule_rows(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_sinks(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_mla(c, a, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_rope(c, e)) != 0) {
        if (rc < 0)
            return -1;
        /* "rotation-like" without an offset that fits is no finding: a
         * bias under bf16 rounding, or a runtime stated f32 that rounds
         * like bf16, looks so at q */
        if (c->g->kind == CMP_DIAG_UNCLASSIFIED) {
            const cmp_diagnosis weak = *c->g;
            if ((rc = dg_rule_maps(c, e)) != 0 ||
                (rc = dg_rule_stated_precision(c, e, false)) != 0)
                return rc < 0 ? -1 : 0;
            *c->g = weak;
        }
        return 0;
    }
    if (d->layer >= 0 && (rc = dg_rule_scaled(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if ((rc = dg_rule_norm_convention(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_qk_norm_missing(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_zero_read(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_kv_owner(c, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_maps(c, e)) != 0)
        return rc;
    if ((rc = dg_rule_stated_precision(c, e, false)) != 0)
        return rc;
    if ((rc = rule_drift(c, d->layer >= 0 ? a : NULL, e)) != 0)
        return rc < 0 ? -1 : rc == 2 ? 2 : 0;
    if (d->layer >= 0 && (rc = dg_rule_keyset(c, a, e)) != 0)
        return rc < 0 ? -1 : 0;
    if (d->layer >= 0 && (rc = dg_rule_scores_scaled(c, e)) != 0)
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
    if (dg_rule_logit_map(c))
        return;
    dg_set(c, CMP_DIAG_UNCLASSIFIED, CMP_BASIS_NONE, "cause not identified");
    dg_say(c->g->detail, sizeof c->g->detail, "(/output differs at position %lld, %d of its "
        "entries, while every recorded stage there is %s: the final norm, the LM head or the "
        "logits' softcap differs, or /output was written otherwise; record final_norm and "
        "logits to see which)", (long long)c->d->pos, c->d->n_bad,
        c->r->xrt.on ? "within drift" : "identical");
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
        c->attn_tol = c->attn_checked ? r->xrt.audit_threshold : r->xrt.attn_floor;
        c->row_tol = r->xrt.step_threshold > 0 ? r->xrt.step_threshold : c->attn_tol;
        /* A step by its structure is under the size threshold: a cause
         * reproduces the test when what it leaves is drift by its size. */
        if (r->xrt.sys_step || r->xrt.off_step)
            c->row_tol = fmax(c->row_tol, r->xrt.sys_drift_threshold);
    }
    /* Hypotheses recomputed from the test's q, k, v as the check
     * recomputes them, rounded as the runtime holds them. */
    cmp_source modelled;
    void *handle = NULL;
    const cmp_source *test = c->test;
    c->test_rows = test;
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
