/* render.c — a cmp_result as text (the FIRST DIVERGENCE / DIAGNOSIS /
 * TOKENS report) and as JSON with the same content and stable keys. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmp_internal.h"

/* ------------------------------------------------------------------ */
/* Words shared with the reports                                        */

const char *cmp_ulp_text(uint64_t ulp, char *buf, size_t n)
{
    if (ulp <= CMP_ULP_SHOWN)
        snprintf(buf, n, "%llu", (unsigned long long)ulp);
    else
        snprintf(buf, n, ">%d", CMP_ULP_SHOWN);
    return buf;
}

const char *cmp_evidence_label(const cmp_diagnosis *g)
{
    if (g->undecided)
        return "not decided";
    return g->basis == CMP_BASIS_RECOMPUTED ? "verified"
         : g->basis == CMP_BASIS_EXACT_CHECK ? "exact check" : "heuristic";
}

/* "; " inside parentheses belongs to the clause: "(error 0.1; at 4)". */
const char *cmp_evidence_clause(const char *s, size_t *len)
{
    int depth = 0;
    const char *p = s;
    for (; *p; p++) {
        if (*p == '(')
            depth++;
        else if (*p == ')' && depth > 0)
            depth--;
        else if (*p == ';' && p[1] == ' ' && depth == 0)
            break;
    }
    *len = (size_t)(p - s);
    if (!*p)
        return NULL;
    p += 2;
    while (*p == ' ')
        p++;
    return *p ? p : NULL;
}

/* ------------------------------------------------------------------ */
/* Text                                                                 */

static void model_stages(const cmp_result *r, char *buf, size_t n)
{
    static const kv_stage ms[] = {STAGE_EMBED, STAGE_FINAL_NORM, STAGE_LOGITS};
    size_t used = 0;
    buf[0] = 0;
    for (size_t i = 0; i < sizeof ms / sizeof *ms; i++)
        if (cmp_result_stage(r, -1, ms[i])) {
            int w = snprintf(buf + used, n - used, "%s%s", used ? ", " : " (+ ",
                             stage_name(ms[i]));
            used += w > 0 && (size_t)w < n - used ? (size_t)w : 0;
        }
    if (used && used + 1 < n)
        strcat(buf, ")");
}

static void coverage_line(FILE *f, const cmp_result *r)
{
    const cmp_coverage *cv = &r->compared;
    char ms[96];
    model_stages(r, ms, sizeof ms);
    long long np = cv->pos_hi >= cv->pos_lo ? (long long)(cv->pos_hi - cv->pos_lo + 1) : 0;
    fprintf(f, "%d layer%s x %lld position%s x %d stage%s%s", cv->n_layers,
            cv->n_layers == 1 ? "" : "s", np, np == 1 ? "" : "s", cv->n_stages,
            cv->n_stages == 1 ? "" : "s", ms);
    if (cv->hashed)
        fprintf(f, " (fingerprints)");
    if (cv->lacks[0])
        fprintf(f, " (%s)", cv->lacks);
}

static void tokens_phrase(FILE *f, const cmp_tokens *t)
{
    switch (t->kind) {
    case CMP_TOKENS_IDENTICAL:
        fprintf(f, "tokens byte-identical");
        break;
    case CMP_TOKENS_LENGTH:
        if (t->test_stopped) {
            fprintf(f, "tokens identical over the %lld positions the test ran (it was stopped "
                    "past its first divergence)", (long long)t->n_test);
            break;
        }
        fprintf(f, "token counts differ (reference %lld, test %lld), identical over the common "
                "%lld", (long long)t->n_ref, (long long)t->n_test,
                (long long)(t->n_ref < t->n_test ? t->n_ref : t->n_test));
        break;
    case CMP_TOKENS_NONE:
        fprintf(f, "tokens not recorded");
        break;
    case CMP_TOKENS_DIFFER:
        fprintf(f, "tokens differ at position %lld", (long long)t->pos);
        if (t->flip_drift)
            fprintf(f, " (a near-tie flip: the reference's margin between the two tokens is "
                    "within twice the logit error this pair shows there, %.3g: drift; the positions after it "
                    "were fed other tokens and are not compared: run the reference on the "
                    "test's tokens, kvdiff run --model M --follow TEST.h5 --dump R.h5, and "
                    "compare R.h5 with TEST.h5)", t->logit_err);
        break;
    }
}

/* A greedy run whose token is not its own top-1: say it under TOKENS. */
static void self_lines(FILE *f, const cmp_tokens *t)
{
    static const char *const side[2] = {"reference", "test"};
    for (int s = 0; s < 2; s++)
        if (t->self_pos[s] >= 0)
            fprintf(f, "           the %s contradicts itself: greedy, its token at position "
                    "%lld is %d but its own top-1 at %lld is %d (a sampler that is not greedy, "
                    "or logits recorded for another position)\n", side[s],
                    (long long)t->self_pos[s] + 1, t->self_token[s], (long long)t->self_pos[s],
                    t->self_top1[s]);
}

static void tolerance_phrase(FILE *f, const cmp_result *r)
{
    fprintf(f, "atol %g, rtol %g", r->atol, r->rtol);
    if (r->ulp)
        fprintf(f, ", %llu ulp", (unsigned long long)r->ulp);
    if (r->noise)
        fprintf(f, ", noise floor x%g", r->noise_factor);
}

/* A verdict over part of the runs says so first, and why. */
static void incomplete_line(FILE *f, const cmp_result *r)
{
    if (r->incomplete)
        fprintf(f, "INCOMPLETE: no divergence over what both hold, but %s; a verdict on the "
                "whole runs needs complete dumps (exit 2)\n", r->incomplete_why);
}

/* The structure test's figures: how close a row scale came to its
 * threshold, and the map /output was fitted to. */
static void structure_line(FILE *f, const cmp_xrt *x)
{
    if (!x->sys_on)
        return;
    fprintf(f, "  structure: a row scale is a step above %g x its residual's noise, %g x the "
            "compute type's rounding and the upstream allowance", x->sys_noise_factor,
            x->sys_compute_factor);
    if (x->sys_worst_pos >= 0 && !x->sys_step) {
        fprintf(f, "; it came closest at position %lld, ", (long long)x->sys_worst_pos);
        if (x->sys_worst_layer >= 0)
            fprintf(f, "layer %d, ", x->sys_worst_layer);
        fprintf(f, "%s (%.2g)", stage_name(x->sys_worst_stage), x->sys_worst_ratio);
    }
    if (x->map_fitted && x->map_kind != CMP_MAP_NONE) {
        fprintf(f, "; /output fits best a %s of ", x->map_kind == CMP_MAP_SOFTCAP ? "softcap"
                                                                                   : "scale");
        if (isinf(x->map_param))
            fprintf(f, "none");
        else
            fprintf(f, "%.4g", x->map_param);
        if (x->map_kind == CMP_MAP_SOFTCAP && x->map_config_cap > 0)
            fprintf(f, " (config %g)", x->map_config_cap);
        fprintf(f, ", leaving %.3g of the residual none leaves", x->map_gain > 0
                ? 1 / x->map_gain : 1);
        /* the map's evidence grows with the positions: say how to get more */
        if (!x->map_step && x->map_positions > 0 && x->map_positions < 32)
            fprintf(f, " over %lld position%s (record final_norm on both sides, --dump-stages "
                    "...,final_norm, for /output at every prompt position)",
                    (long long)x->map_positions, x->map_positions == 1 ? "" : "s");
    }
    fprintf(f, "\n");
}

/* Which drift model judged and how close drift came to it. */
static void xrt_line(FILE *f, const cmp_result *r)
{
    const cmp_xrt *x = &r->xrt;
    if (!x->on)
        return;
    char compute[64] = "";
    if (x->compute_precision[0] && x->compute_eps > 0x1p-20)
        snprintf(compute, sizeof compute, " + %g x %s rounding", x->compute_factor,
                 x->compute_precision);
    fprintf(f, "  drift model %s: ", x->model);
    if (x->compute_precision[0])
        fprintf(f, "compute %s%s, ", x->compute_precision, x->compute_stated ? "" : " (assumed)");
    fprintf(f, "KV cache %s; a row is drift while its relative error is at "
            "most max(%.0e%s%s, %g x upstream, %g x its stage's earlier rows)",
            x->kv_precision, x->floor_base, compute,
            x->kv_eps > 0x1p-20 ? " + KV rounding at attn_out (attn_proj where attn_out is not recorded)"
                                : "", x->gain, x->history);
    if (x->worst_pos >= 0) {
        fprintf(f, "; drift came closest at position %lld, ", (long long)x->worst_pos);
        if (x->worst_layer >= 0)
            fprintf(f, "layer %d, ", x->worst_layer);
        fprintf(f, "%s (%.2g of its threshold)", stage_name(x->worst_stage), x->worst_ratio);
    }
    fprintf(f, "\n");
    if (x->compute_precision[0] && !x->compute_stated)
        fprintf(f, "  compute precision: the test's engine_settings give no compute_dtype; %s "
                "assumed (%s)\n", x->compute_precision, x->compute_assumed_why);
    structure_line(f, x);
    if (x->audit_skip[0])
        fprintf(f, "  attention check: not run: %s\n", x->audit_skip);
    else if (x->audit_layers > 0) {
        fprintf(f, "  attention check: the test's attn_out against attention recomputed from its "
                "own q, k, v over the config's keys, %d layer%s, threshold %.2g", x->audit_layers,
                x->audit_layers == 1 ? "" : "s", x->audit_threshold);
        if (x->audit_rms_weight > 0)
            fprintf(f, " on the larger of the max-relative residual and %g x the RMS-relative "
                    "one (the test computes in %s)", x->audit_rms_weight, x->compute_precision);
        if (x->audit_worst_pos >= 0)
            fprintf(f, "; %s came closest at position %lld, layer %d (%.2g)",
                    x->audit_step ? "below the step it" : "it", (long long)x->audit_worst_pos,
                    x->audit_worst_layer, x->audit_worst_residual);
        fprintf(f, "\n");
    }
    if (x->acc_on) {
        fprintf(f, "  f16 accumulation: the test sums attention values in f16 (llama.cpp, flash "
                "attention); %lld attn_out row%s modelled and allowed %g x that summation's gap",
                (long long)x->acc_rows, x->acc_rows == 1 ? "" : "s", x->acc_factor);
        if (x->acc_pos >= 0)
            fprintf(f, " (largest %.2g, at position %lld, layer %d)", x->acc_largest,
                    (long long)x->acc_pos, x->acc_layer);
        fprintf(f, "\n");
    }
}

static void same_report(FILE *f, const cmp_result *r)
{
    incomplete_line(f, r);
    if (r->verdict == CMP_IDENTICAL) {
        fprintf(f, "%s: ", r->incomplete ? "identical over what both hold" : "identical");
        coverage_line(f, r);
        fprintf(f, ", ");
        tokens_phrase(f, &r->tokens);
        fprintf(f, "\n");
        int64_t rows = 0, hashed = 0;
        for (int i = 0; i < r->n_stages; i++) {
            rows += r->stages[i].all.rows;
            hashed += r->stages[i].rows_by_hash;
        }
        if (r->compared.by_index)
            fprintf(f, "  settled by the row hash indexes of both files");
        else if (hashed > 0)
            fprintf(f, "  %lld of %lld rows settled by their hashes", (long long)hashed,
                    (long long)rows);
        if (hashed > 0 && r->hashcheck.rows_checked >= 2 * hashed)
            fprintf(f, "; every one hashed again matched (%lld rows, both files)\n",
                    (long long)r->hashcheck.rows_checked);
        else if (hashed > 0)
            fprintf(f, "; a sample of %lld rows hashed again matched (--no-hashes compares "
                    "every row itself)\n", (long long)r->hashcheck.rows_checked);
        return;
    }
    int64_t rows = 0, eq = 0;
    cmp_stats agg;
    cmp_stats_init(&agg);
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stats *s = &r->stages[i].all;
        rows += s->rows;
        eq += s->bitequal_rows;
        agg.max_abs = fmax(agg.max_abs, s->max_abs);
        agg.max_rel = fmax(agg.max_rel, s->max_rel);
        agg.max_ulp = s->max_ulp > agg.max_ulp ? s->max_ulp : agg.max_ulp;
    }
    if (r->xrt.on) {
        fprintf(f, "no bug: drift%s (cross-runtime, %s): ", r->incomplete ? " over what both hold"
                                                                          : "", r->xrt.why);
    } else {
        fprintf(f, "same within tolerance%s (", r->incomplete ? " over what both hold" : "");
        tolerance_phrase(f, r);
        fprintf(f, "): ");
    }
    coverage_line(f, r);
    fprintf(f, "; %lld of %lld rows not bit-identical (max abs %.3g, max rel %.3g",
            (long long)(rows - eq), (long long)rows, agg.max_abs, agg.max_rel);
    /* Units in the last place say nothing across runtimes, nor between
     * values far apart (CMP_ULP_SHOWN): "max 1992802176 ulp". */
    if (!r->xrt.on && agg.max_ulp <= CMP_ULP_SHOWN)
        fprintf(f, ", max %llu ulp", (unsigned long long)agg.max_ulp);
    fprintf(f, "), ");
    if (r->xrt.on && r->xrt.output_drift)
        fprintf(f, "/output within drift (max rel %.3g), ", r->xrt.output_max_rel);
    tokens_phrase(f, &r->tokens);
    fprintf(f, "\n");
    xrt_line(f, r);
}

static void layer_phrase(FILE *f, const cmp_divergence *d)
{
    if (d->layer < 0) {
        fprintf(f, "model level");
        return;
    }
    fprintf(f, "layer %d (", d->layer);
    if (d->layer_sliding)
        fprintf(f, "sliding, window %d", d->layer_window);
    else
        fprintf(f, "global");
    if (d->kv_owner != d->layer)
        fprintf(f, ", reads layer %d's KV", d->kv_owner);
    fprintf(f, ")");
}

static void element_phrase(FILE *f, const cmp_divergence *d)
{
    static const char *const stats[3] = {"mean", "rms", "absmax"};
    if (d->from_output && d->col < 0) {
        fprintf(f, ", the log-sum-exp in /output");
        return;
    }
    if (d->from_output) {
        fprintf(f, ", rank %d of /output's top-k, token id %d", d->head + 1, d->col);
        if (d->dim >= 0)
            fprintf(f, " (the test has token id %d there)", d->dim);
        return;
    }
    if (d->col < 0)
        return;
    if (d->stage == STAGE_Q || d->stage == STAGE_ATTN_OUT)
        fprintf(f, ", head %d, dim %d", d->head, d->dim);
    else if (d->stage == STAGE_K || d->stage == STAGE_V)
        fprintf(f, ", KV head %d, dim %d", d->head, d->dim);
    else if (d->stage == STAGE_ATTN_LSE || d->stage == STAGE_ATTN_NKEYS ||
             d->stage == STAGE_ATTN_SINK)
        fprintf(f, ", head %d", d->head);
    else if (d->stage == STAGE_LOGITS)
        fprintf(f, ", token id %d", d->col);
    else if ((d->stage == STAGE_ATTN_NORM_STATS || d->stage == STAGE_FFN_NORM_STATS) &&
             d->col < 3)
        fprintf(f, ", %s", stats[d->col]);
    else
        fprintf(f, ", column %d", d->col);
}

/* ulps: say the element's distance in units in the last place, which
 * means something between kvdiff's own engines (a few roundings apart)
 * and nothing across runtimes, where every value differs by millions of
 * them and the model judges row-relative error instead; nor past
 * CMP_ULP_SHOWN, where the row's relative error says it. */
static void values_line(FILE *f, const cmp_divergence *d, bool ulps)
{
    if (d->hashed) {
        fprintf(f, "  row hashes differ (fingerprints: the element is unknown)\n");
        return;
    }
    fprintf(f, "  ref %.9g  test %.9g  (", d->ref, d->test);
    if (d->nonfinite && (!isfinite(d->ref) || !isfinite(d->test)))
        fprintf(f, "non-finite on one side");
    else if (ulps && d->ulp <= CMP_ULP_SHOWN)
        fprintf(f, "abs %.3g, %llu ulp", d->abs_err, (unsigned long long)d->ulp);
    else
        fprintf(f, "abs %.3g", d->abs_err);
    if (d->nonfinite && d->row_max_abs == 0)   /* the sums skip non-finite pairs */
        fprintf(f, "; row: %d element%s differ%s, the finite ones are equal)\n", d->n_bad,
                d->n_bad == 1 ? "" : "s", d->n_bad == 1 ? "s" : "");
    else if (d->nonfinite)
        fprintf(f, "; row: %d element%s differ%s, over the finite ones max abs %.3g, rel "
                "%.3g)\n", d->n_bad, d->n_bad == 1 ? "" : "s", d->n_bad == 1 ? "s" : "",
                d->row_max_abs, d->row_rel);
    else
        fprintf(f, "; row: max abs %.3g, rel %.3g, %d element%s differ%s)\n", d->row_max_abs,
                d->row_rel, d->n_bad, d->n_bad == 1 ? "" : "s", d->n_bad == 1 ? "s" : "");
}

static void earlier_phrase(FILE *f, const cmp_evidence *ev)
{
    const uint32_t cmp = ev->earlier_compared, id = ev->earlier_identical;
    int n = 0, same = 0;
    for (int s = 0; s < STAGE_LAYER_COUNT; s++)
        if (cmp & (1u << s)) {
            n++;
            same += (id >> s) & 1u;
        }
    if (!n) {
        fprintf(f, "no earlier stage of this layer recorded at this position");
        return;
    }
    if (same == n) {
        fprintf(f, "every earlier stage of this layer at this position identical");
        return;
    }
    fprintf(f, "at this position %d of %d earlier stages within tolerance but not "
            "bit-identical (", n - same, n);
    const char *sep = "";
    for (int s = 0; s < STAGE_LAYER_COUNT; s++)
        if ((cmp & (1u << s)) && !(id & (1u << s))) {
            fprintf(f, "%s%s", sep, stage_name((kv_stage)s));
            sep = ", ";
        }
    fprintf(f, ")");
}

static void before_line(FILE *f, const cmp_divergence *d, const cmp_evidence *ev, bool beyond)
{
    if (d->layer < 0 || d->hashed)
        return;
    fprintf(f, "  before it: ");
    if (ev->qkv == 1 && ev->qkv_from == 0)
        fprintf(f, "q, k, v of every position <= %lld identical; ", (long long)ev->qkv_to);
    else if (ev->qkv == 1)
        fprintf(f, "q, k, v identical at positions %lld..%lld (earlier ones not recorded); ",
                (long long)ev->qkv_from, (long long)ev->qkv_to);
    else if (ev->qkv == 0 && beyond)
        fprintf(f, "q, k, v not all bit-identical up to position %lld (the drift); ",
                (long long)ev->qkv_to);
    else if (ev->qkv == 0)   /* in tolerance mode: they precede the divergence */
        fprintf(f, "q, k, v of every position <= %lld within tolerance, not all bit-identical; ",
                (long long)ev->qkv_to);
    earlier_phrase(f, ev);
    fprintf(f, "\n");
    if (!ev->lse_ref && !ev->lse_test && ev->nkeys_ref < 0)
        return;
    fprintf(f, "  attention here: ");
    if (ev->lse_ref && ev->lse_test) {
        int h = 0;
        while (h < ev->n_heads - 1 && ev->lse_ref[h] == ev->lse_test[h])
            h++;
        bool same = !memcmp(ev->lse_ref, ev->lse_test, (size_t)ev->n_heads * sizeof(float));
        fprintf(f, "attn_lse %s (head %d: ref %.9g, test %.9g)", same ? "identical" : "differs",
                h, ev->lse_ref[h], ev->lse_test[h]);
    } else {
        fprintf(f, "attn_lse not recorded");
    }
    if (ev->nkeys_ref >= 0 && ev->nkeys_test >= 0)
        fprintf(f, "; keys attended %d vs %d", ev->nkeys_ref, ev->nkeys_test);
    else if (ev->nkeys_ref >= 0)   /* an unknown count is said, never printed as -1 */
        fprintf(f, "; keys attended %d vs unknown (test did not record attn_nkeys)",
                ev->nkeys_ref);
    else if (ev->nkeys_test >= 0)
        fprintf(f, "; keys attended unknown (reference did not record attn_nkeys) vs %d",
                ev->nkeys_test);
    fprintf(f, "\n");
}

static void diagnosis_block(FILE *f, const cmp_result *r)
{
    const cmp_diagnosis *g = &r->diag;
    fprintf(f, "DIAGNOSIS  %s\n", g->summary);
    if (g->detail[0])
        fprintf(f, "           %s\n", g->detail);
    if (!g->evidence[0])
        return;
    /* one clause a line: the evidence runs to 600 characters */
    fprintf(f, "           %s:\n", cmp_evidence_label(g));
    for (const char *s = g->evidence, *next; s && *s; s = next) {
        size_t n;
        next = cmp_evidence_clause(s, &n);
        fprintf(f, "             - %.*s\n", (int)n, s);
    }
}

static void margin(FILE *f, double m)
{
    if (isfinite(m))
        fprintf(f, "margin %.3g", m);
    else
        fprintf(f, "margin n/a");
}

static void tokens_block_head(FILE *f, const cmp_result *r)
{
    const cmp_tokens *t = &r->tokens;
    fprintf(f, "TOKENS     ");
    if (t->kind != CMP_TOKENS_DIFFER) {
        tokens_phrase(f, t);
        fprintf(f, "\n");
        return;
    }
    if (t->step >= 0)
        fprintf(f, "first differing generated token at step %lld (position %lld): ",
                (long long)t->step, (long long)t->pos);
    else
        fprintf(f, "first differing token at prompt position %lld: ", (long long)t->pos);
    fprintf(f, "ref %d (", t->ref_id);
    margin(f, t->ref_margin);
    fprintf(f, ") vs test %d (", t->test_id);
    margin(f, t->test_margin);
    fprintf(f, ")\n");
    if (t->near_tie)
        fprintf(f, "           a near tie in both runs: a flip rounding alone can cause\n");
}

static void tokens_block(FILE *f, const cmp_result *r)
{
    tokens_block_head(f, r);
    self_lines(f, &r->tokens);
}

static void point_block(FILE *f, const char *title, const cmp_divergence *d,
                        const cmp_evidence *ev, bool beyond, bool ulps)
{
    fprintf(f, "%s  position %lld, ", title, (long long)d->pos);
    layer_phrase(f, d);
    fprintf(f, ", stage %s", stage_name(d->stage));
    element_phrase(f, d);
    fprintf(f, "\n");
    values_line(f, d, ulps);
    before_line(f, d, ev, beyond);
}

/* The first divergence was drift; say so before the larger one. */
static void drift_line(FILE *f, const cmp_result *r)
{
    fprintf(f, "  this one is numeric drift (relative error %.2g", r->first.row_rel);
    if (r->ev.recompute == 1)
        fprintf(f, "; attention over the config's keys reproduces both runs here");
    fprintf(f, "); the first difference larger than drift (row-relative error above "
            "%.0e) follows\n", 1e-3);
}

static void diverged_report(FILE *f, const cmp_result *r)
{
    const cmp_divergence *d = &r->first;
    fprintf(f, "compared: ");
    coverage_line(f, r);
    fprintf(f, ", %s\n", r->xrt.on ? "cross-runtime" : r->exact ? "exact" : "with tolerance");
    if (!d->found && r->tokens.self_pos[1] >= 0 && r->tokens.kind != CMP_TOKENS_DIFFER) {
        fprintf(f, "DIVERGED  the test's greedy tokens contradict its own recorded top-k "
                "(below); no recorded stage differs over positions %lld..%lld\n",
                (long long)r->compared.pos_lo, (long long)r->compared.pos_hi);
    } else if (!d->found && r->tokens.kind == CMP_TOKENS_LENGTH) {
        fprintf(f, "DIVERGED  the runs generated different numbers of tokens (reference "
                "%lld, test %lld); no recorded stage differs over positions %lld..%lld\n",
                (long long)r->tokens.n_ref, (long long)r->tokens.n_test,
                (long long)r->compared.pos_lo, (long long)r->compared.pos_hi);
    } else if (!d->found && r->config_diff[0]) {
        fprintf(f, "DIVERGED  the recordings' own configs differ in what attention reads: %s; "
                "no recorded stage steps above %s over positions %lld..%lld, so this pair "
                "cannot show where it acts\n", r->config_diff,
                r->xrt.on ? "drift" : "tolerance", (long long)r->compared.pos_lo,
                (long long)r->compared.pos_hi);
    } else if (!d->found) {
        fprintf(f, "FIRST DIVERGENCE  none in the recorded stages (positions %lld..%lld)\n",
                (long long)r->compared.pos_lo, (long long)r->compared.pos_hi);
    } else {
        point_block(f, r->xrt.on ? "FIRST STEP ABOVE DRIFT" : "FIRST DIVERGENCE", d, &r->ev,
                    false, !r->xrt.on);
        if (r->xrt.step && r->xrt.audit_step)
            fprintf(f, "  a step in the test's own attention: its attn_out is %.2g from "
                    "attention over its own q, k, v and the config's keys (threshold %.2g); "
                    "against the reference this row is %.2g, within the drift threshold of "
                    "%.2g (%s)\n", r->xrt.step_err, r->xrt.step_threshold, d->row_rel,
                    r->xrt.audit_drift_threshold, r->xrt.why);
        else if (r->xrt.sys_step)
            fprintf(f, "  a step by its structure: the row is the reference's times %.6g, a - 1 "
                    "= %.2g against %.2g (%g x the residual's noise %.2g, a scale rounding "
                    "does not make), under the size threshold %.2g (%s)\n", 1 + r->xrt.sys_dev,
                    r->xrt.sys_dev, r->xrt.sys_threshold, r->xrt.sys_noise_factor,
                    r->xrt.sys_noise, r->xrt.sys_drift_threshold, r->xrt.why);
        else if (r->xrt.off_step)
            fprintf(f, "  a step by its structure: over the stage's first positions each channel "
                    "is offset by one value (%d channels 8 standard errors off), the offsets' "
                    "part %.2g against %.2g (%g x the residual's noise %.2g, what rounding and "
                    "what flowed in make), under the size threshold %.2g (%s)\n",
                    r->xrt.off_channels, r->xrt.off_part, r->xrt.sys_threshold,
                    r->xrt.sys_noise_factor, r->xrt.off_noise, r->xrt.sys_drift_threshold,
                    r->xrt.why);
        else if (r->xrt.rot_step) {
            const cmp_xrt *x = &r->xrt;
            fprintf(f, "  a step by its structure: %s at position %lld is the reference's "
                    "turned under %s, which leaves %.2g of its error %.2g", stage_name(x->rot_stage),
                    (long long)x->rot_pos, x->rot_what, x->rot_resid, x->rot_err);
            if (x->rot_pos2 >= 0)
                fprintf(f, " (at position %lld, %.2g of %.2g)", (long long)x->rot_pos2,
                        x->rot_resid2, x->rot_err2);
            fprintf(f, ": rounding leaves noise no rotation explains");
            if (!isnan(x->rot_here_resid))
                fprintf(f, "; it first shows here, leaving %.2g of %.2g", x->rot_here_resid,
                        x->step_err);
            fprintf(f, "; drift by its size (threshold %.2g at position %lld; %s)\n",
                    x->rot_drift_threshold, (long long)x->rot_pos, x->why);
        } else if (r->xrt.map_step)
            fprintf(f, "  a step by its structure: /output is a map of the reference's logits "
                    "(%s) over %lld positions, F %.3g against %.3g (a chance of 1e-4), its part "
                    "%.2g here above the residual it leaves, %.2g (%s)\n",
                    r->xrt.map_kind == CMP_MAP_SOFTCAP ? "a softcap" : "a scale",
                    (long long)r->xrt.map_positions, r->xrt.map_F, r->xrt.map_F_crit,
                    r->xrt.map_part, r->xrt.map_noise, r->xrt.why);
        else if (r->xrt.step)
            fprintf(f, "  a step: relative error %.2g here against a drift threshold of %.2g "
                    "(%s)\n", r->xrt.step_err, r->xrt.step_threshold, r->xrt.why);
        if (r->beyond.found) {
            drift_line(f, r);
            point_block(f, "BEYOND DRIFT", &r->beyond, &r->beyond_ev, true, !r->xrt.on);
        }
    }
    if (r->diag.kind != CMP_DIAG_NONE)
        diagnosis_block(f, r);
    tokens_block(f, r);
    xrt_line(f, r);
}

static void stages_table(FILE *f, const cmp_result *r)
{
    fprintf(f, "%5s %-16s %7s %8s %10s %10s %10s %12s %10s\n", "layer", "stage", "rows",
            "bitequal", "max_abs", "max_rel", "max_ulp", "cosine", "nmse");
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *s = &r->stages[i];
        const cmp_stats *a = &s->all;
        char ulp[24];
        fprintf(f, "%5d %-16s %7lld %8lld %10.3g %10.3g %10s %12.9f %10.3g\n", s->layer,
                stage_name(s->stage), (long long)a->rows, (long long)a->bitequal_rows,
                a->max_abs, a->max_rel, cmp_ulp_text(a->max_ulp, ulp, sizeof ulp),
                cmp_stats_cosine(a), cmp_stats_nmse(a));
    }
}

char *cmp_render_text(const cmp_result *r, unsigned flags)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f)
        return NULL;
    if (r->swapped[0])
        fprintf(f, "SWAPPED?   the arguments look the wrong way round: %s. kvdiff compare takes "
                "the reference first and the run under test second, and everything below "
                "reads the other way round: swap the two files.\n", r->swapped);
    if (r->verdict == CMP_DIVERGED)
        diverged_report(f, r);
    else
        same_report(f, r);
    if (r->verdict != CMP_DIVERGED)
        self_lines(f, &r->tokens);
    /* Positions whose logits are not finite are out of the KL; the note
     * below says which dump and where. */
    if (!r->logits.present && r->verdict == CMP_DIVERGED && r->logits.nonfinite > 0)
        fprintf(f, "LOGITS     no KL: a dump's logits are not finite at every compared "
                "position (%lld; note below)\n", (long long)r->logits.nonfinite);
    else if (r->logits.present && r->verdict == CMP_DIVERGED)
        fprintf(f, "LOGITS     KL(ref || test) mean %.3g, max %.3g at position %lld%s; top-1 "
                "agrees at %lld of %lld positions%s\n", r->logits.kl_mean, r->logits.kl_max,
                (long long)r->logits.kl_max_pos, r->logits.from_topk ? " (from top-k only)" : "",
                (long long)r->logits.top1_agree, (long long)r->logits.positions,
                r->logits.nonfinite > 0 ? " with finite logits (note below)" : "");
    for (int i = 0; i < r->n_notes; i++)
        fprintf(f, "note: %s\n", r->notes[i]);
    if (flags & CMP_RENDER_STAGES)
        stages_table(f, r);
    if (fclose(f) != 0) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* ------------------------------------------------------------------ */
/* JSON                                                                 */

/* JSON has no NaN or infinity: those become the strings "nan", "inf". */
static json_t *jnum(double x)
{
    if (isfinite(x))
        return json_real(x);
    return json_string(isnan(x) ? "nan" : x > 0 ? "inf" : "-inf");
}

/* A quantity that may not have been computed (NaN): null then. */
static json_t *jopt(double x)
{
    return isnan(x) ? json_null() : jnum(x);
}

static json_t *jstats(const cmp_stats *s)
{
    return json_pack("{sI sI sI sI so so sI so so sI}", "rows", (json_int_t)s->rows,
                     "bitequal_rows", (json_int_t)s->bitequal_rows, "violating_rows",
                     (json_int_t)s->violating_rows, "nonfinite", (json_int_t)s->nonfinite,
                     "max_abs", jnum(s->max_abs), "max_rel", jnum(s->max_rel), "max_ulp",
                     (json_int_t)(s->max_ulp > INT64_MAX ? INT64_MAX : s->max_ulp), "cosine",
                     jnum(cmp_stats_cosine(s)), "nmse", jnum(cmp_stats_nmse(s)),
                     "first_bitdiff_position", (json_int_t)s->first_bitdiff_pos);
}

static json_t *jcompared(const cmp_result *r)
{
    const cmp_coverage *cv = &r->compared;
    json_t *ms = json_array();
    for (int s = STAGE_EMBED; s < STAGE_COUNT; s++)
        if (cmp_result_stage(r, -1, (kv_stage)s))
            json_array_append_new(ms, json_string(stage_name((kv_stage)s)));
    return json_pack("{si sI sI sI si so sI sb sb so so sI sb}", "layers", cv->n_layers,
                     "positions",
                     (json_int_t)(cv->pos_hi >= cv->pos_lo ? cv->pos_hi - cv->pos_lo + 1 : 0),
                     "position_lo", (json_int_t)cv->pos_lo, "position_hi",
                     (json_int_t)cv->pos_hi, "stages", cv->n_stages, "model_stages", ms, "rows",
                     (json_int_t)cv->rows, "partial", cv->partial, "fingerprint", cv->hashed,
                     "token_cut", cv->pos_cut >= 0 ? json_integer(cv->pos_cut) : json_null(),
                     "routing_flip",
                     cv->routing_flip >= 0 ? json_integer(cv->routing_flip) : json_null(),
                     "walked_to", (json_int_t)cv->walked_to, "by_index", cv->by_index);
}

/* An index that may not apply (no head for a model stage, no column for
 * a fingerprint): null, never a -1 a reader could take for a number. */
static json_t *jidx(int i)
{
    return i < 0 ? json_null() : json_integer(i);
}

static json_t *jdiv(const cmp_divergence *d)
{
    if (!d->found)
        return json_null();
    json_t *j = json_pack("{sI si ss sb so so so so so so sI sb si so so}", "position",
                          (json_int_t)d->pos, "layer", d->layer, "stage", stage_name(d->stage),
                          "fingerprint", d->hashed, "column", jidx(d->col), "head",
                          jidx(d->head), "dim", jidx(d->dim), "ref", jnum(d->ref), "test", jnum(d->test), "abs",
                          jnum(d->abs_err), "ulp",
                          (json_int_t)(d->ulp > INT64_MAX ? INT64_MAX : d->ulp), "nonfinite",
                          d->nonfinite, "bad_elements", d->n_bad, "row_max_abs",
                          jnum(d->row_max_abs), "row_rel", jnum(d->row_rel));
    if (j && d->from_output)
        json_object_set_new(j, "from_output", json_true());
    if (j && d->layer >= 0) {
        json_object_set_new(j, "attention", json_string(d->layer_sliding ? "sliding" : "global"));
        json_object_set_new(j, "window", json_integer(d->layer_window));
        json_object_set_new(j, "kv_owner", json_integer(d->kv_owner));
    }
    return j;
}

static json_t *jfloats(const float *x, int n)
{
    if (!x)
        return json_null();
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, jnum(x[i]));
    return a;
}

/* The causes the key-set engine scored. */
static json_t *jhyps(const cmp_diagnosis *g)
{
    static const char *const status[] = {"verified", "remains", "refuted"};
    json_t *a = json_array();
    for (int i = 0; a && i < g->n_hyps; i++) {
        const cmp_hyp_score *h = &g->hyps[i];
        json_t *o = json_pack("{ss ss ss so sI}", "kind", cmp_diag_name(h->kind), "keys", h->keys,
                              "status", status[h->status], "error_at_first", jnum(h->err),
                              "places", (json_int_t)h->places);
        if (o && h->status == CMP_HYP_REFUTED)
            json_object_set_new(o, "refuted_at", json_pack("{sI si so}", "position",
                                (json_int_t)h->refuted_pos, "layer", h->refuted_layer,
                                "error", jnum(h->refuted_err)));
        json_array_append_new(a, o);
    }
    return a;
}

static json_t *jevidence(const cmp_divergence *d, const cmp_evidence *ev)
{
    if (!d->found)
        return json_null();
    json_t *identical = json_array(), *compared = json_array();
    for (int s = 0; s < STAGE_LAYER_COUNT; s++) {
        if (ev->earlier_compared & (1u << s))
            json_array_append_new(compared, json_string(stage_name((kv_stage)s)));
        if (ev->earlier_identical & (1u << s))
            json_array_append_new(identical, json_string(stage_name((kv_stage)s)));
    }
    json_t *j = json_pack("{so so so sI sI so so so so}", "earlier_compared", compared,
                          "earlier_identical", identical, "qkv_identical_upto_position",
                          ev->qkv < 0 ? json_null() : json_boolean(ev->qkv == 1),
                          "qkv_from", (json_int_t)ev->qkv_from, "qkv_to",
                          (json_int_t)ev->qkv_to, "attn_lse_ref",
                          jfloats(ev->lse_ref, ev->n_heads), "attn_lse_test",
                          jfloats(ev->lse_test, ev->n_heads), "nkeys_ref",
                          ev->nkeys_ref < 0 ? json_null() : json_integer(ev->nkeys_ref),
                          "nkeys_test",
                          ev->nkeys_test < 0 ? json_null() : json_integer(ev->nkeys_test));
    if (!j)
        return NULL;
    json_object_set_new(j, "norms_equal", json_boolean(ev->norms_equal));
    json_object_set_new(j, "rope_delta", ev->rope_found ? json_integer(ev->rope_delta)
                                                        : json_null());
    json_object_set_new(j, "rope_error", jopt(ev->rope_err));
    json_object_set_new(j, "recomputed", ev->recompute < 0 ? json_null()
                                                           : json_boolean(ev->recompute == 1));
    json_object_set_new(j, "hypothesis", ev->hypothesis[0] ? json_string(ev->hypothesis)
                                                           : json_null());
    json_object_set_new(j, "hypothesis_error", jopt(ev->hyp_err));
    json_object_set_new(j, "reference_check_error", jopt(ev->ref_check_err));
    json_object_set_new(j, "nkeys_differ_at", ev->nkeys_diff_pos < 0 ? json_null()
        : json_pack("{sI si}", "position", (json_int_t)ev->nkeys_diff_pos, "layer",
                    ev->nkeys_diff_layer));
    json_object_set_new(j, "growth_first", jopt(ev->growth_first));
    json_object_set_new(j, "growth_last", jopt(ev->growth_last));
    json_object_set_new(j, "growth_last_layer", json_integer(ev->growth_layer_last));
    return j;
}

static json_t *jself(const cmp_tokens *t, int side)
{
    if (t->self_pos[side] < 0)
        return json_null();
    return json_pack("{sI si si}", "position", (json_int_t)t->self_pos[side], "token",
                     t->self_token[side], "top1", t->self_top1[side]);
}

static json_t *jtokens(const cmp_tokens *t)
{
    static const char *const kinds[] = {"none", "identical", "differ", "length_differs"};
    const bool d = t->kind == CMP_TOKENS_DIFFER;
    json_t *j = json_pack("{ss sI sI sI so so so so so so sb}", "verdict", kinds[t->kind], "n_ref",
                     (json_int_t)t->n_ref, "n_test", (json_int_t)t->n_test, "prompt_length",
                     (json_int_t)t->prompt_length, "position",
                     t->pos >= 0 ? json_integer(t->pos) : json_null(), "step",
                     d ? json_integer(t->step) : json_null(), "ref_id",
                     d ? json_integer(t->ref_id) : json_null(), "test_id",
                     d ? json_integer(t->test_id) : json_null(), "ref_margin",
                     d ? jopt(t->ref_margin) : json_null(), "test_margin",
                     d ? jopt(t->test_margin) : json_null(), "near_tie", t->near_tie);
    if (j && t->test_stopped)
        json_object_set_new(j, "test_stopped", json_true());
    if (j && d) {   /* across runtimes: the flip judged by the pair's logit error */
        json_object_set_new(j, "logit_error", jopt(t->logit_err));
        json_object_set_new(j, "flip_drift", json_boolean(t->flip_drift));
    }
    if (j)
        json_object_set_new(j, "contradicts_own_topk",
                            json_pack("{so so}", "reference", jself(t, 0), "test", jself(t, 1)));
    return j;
}

static json_t *jlogits(const cmp_logit_stats *l)
{
    if (!l->present)
        return json_null();
    /* Positions with logits not finite are said in a note (the notes
     * round-trip through kvdiff report's reader; these keys would not). */
    return json_pack("{sb sI sI so so sI}", "from_topk", l->from_topk, "positions",
                     (json_int_t)l->positions, "top1_agree", (json_int_t)l->top1_agree,
                     "kl_mean", jnum(l->kl_mean), "kl_max", jnum(l->kl_max), "kl_max_position",
                     (json_int_t)l->kl_max_pos);
}

static const char *map_kind_name(cmp_map_kind k)
{
    return k == CMP_MAP_SOFTCAP ? "softcap" : k == CMP_MAP_SCALE ? "scale" : "none";
}

/* The structure test's constants and figures (null in results without it). */
static json_t *jstructure(const cmp_xrt *x)
{
    if (!x->sys_on)
        return json_null();
    json_t *closest = x->sys_worst_pos < 0 ? json_null()
        : json_pack("{sI si ss so}", "position", (json_int_t)x->sys_worst_pos, "layer",
                    x->sys_worst_layer, "stage", stage_name(x->sys_worst_stage), "ratio",
                    jnum(x->sys_worst_ratio));
    json_t *step = !x->sys_step ? json_null()
        : json_pack("{so so so so}", "scale", jnum(1 + x->sys_dev), "noise", jnum(x->sys_noise),
                    "threshold", jnum(x->sys_threshold), "drift_threshold",
                    jnum(x->sys_drift_threshold));
    /* an infinite softcap (none) is written as null */
    json_t *map = !x->map_fitted ? json_null()
        : json_pack("{ss so so so sI so so sb sb so so}", "kind", map_kind_name(x->map_kind),
                    "value", isfinite(x->map_param) ? jnum(x->map_param) : json_null(),
                    "config_cap", jnum(x->map_config_cap), "gain",
                    isfinite(x->map_gain) ? jnum(x->map_gain) : json_null(), "positions",
                    (json_int_t)x->map_positions, "F", isfinite(x->map_F) ? jnum(x->map_F)
                                                                          : json_null(),
                    "F_critical", isfinite(x->map_F_crit) ? jnum(x->map_F_crit) : json_null(),
                    "significant", x->map_significant, "step", x->map_step, "part",
                    x->map_step ? jnum(x->map_part) : json_null(), "noise",
                    x->map_step ? jnum(x->map_noise) : json_null());
    json_t *off = !x->off_step ? json_null()
        : json_pack("{so so si so so}", "part", jnum(x->off_part), "noise", jnum(x->off_noise),
                    "channels", x->off_channels, "threshold", jnum(x->sys_threshold),
                    "drift_threshold", jnum(x->sys_drift_threshold));
    json_t *rot = !x->rot_step ? json_null()
        : json_pack("{ss sI ss so so so so so so so so}", "candidate", x->rot_what,
                    "position", (json_int_t)x->rot_pos, "stage", stage_name(x->rot_stage),
                    "error", jnum(x->rot_err), "residual", jnum(x->rot_resid), "last_position",
                    x->rot_pos2 >= 0 ? json_integer(x->rot_pos2) : json_null(),
                    "error_at_last", x->rot_pos2 >= 0 ? jnum(x->rot_err2) : json_null(),
                    "residual_at_last", x->rot_pos2 >= 0 ? jnum(x->rot_resid2) : json_null(),
                    "residual_at_step", isnan(x->rot_here_resid) ? json_null()
                                                                  : jnum(x->rot_here_resid),
                    "threshold", jnum(x->rot_threshold), "drift_threshold",
                    jnum(x->rot_drift_threshold));
    return json_pack("{ss so so so so so so so}", "test", "row_scale", "noise_factor",
                     jnum(x->sys_noise_factor), "compute_factor", jnum(x->sys_compute_factor),
                     "step", step, "offset_step", off, "rotation_step", rot, "closest", closest,
                     "logit_map", map);
}

/* The cross-runtime model and its figures; null when it did not judge. */
static json_t *jxrt(const cmp_result *r)
{
    const cmp_xrt *x = &r->xrt;
    if (!x->on)
        return json_null();
    json_t *st = json_array();
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *s = &r->stages[i];
        json_array_append_new(st, json_pack("{si ss so so so so so so}", "layer", s->layer,
                                            "stage", stage_name(s->stage), "scale",
                                            jnum(s->xrt_scale), "threshold",
                                            jnum(s->xrt_threshold), "error", jnum(s->xrt_err),
                                            "ratio", jnum(s->xrt_ratio), "systematic",
                                            jnum(s->xrt_sys), "systematic_ratio",
                                            jnum(s->xrt_sys_ratio)));
    }
    json_t *worst = x->worst_pos < 0 ? json_null()
        : json_pack("{sI si ss so}", "position", (json_int_t)x->worst_pos, "layer",
                    x->worst_layer, "stage", stage_name(x->worst_stage), "ratio",
                    jnum(x->worst_ratio));
    json_t *audit = json_pack(
        "{sb so si so so sb so so}", "ran", !x->audit_skip[0] && x->audit_layers > 0, "skipped",
        x->audit_skip[0] ? json_string(x->audit_skip) : json_null(), "layers", x->audit_layers,
        "threshold", jnum(x->audit_threshold), "rms_weight", jnum(x->audit_rms_weight),
        "step", x->audit_step, "drift_threshold",
        x->audit_step ? jnum(x->audit_drift_threshold) : json_null(), "closest",
        x->audit_worst_pos < 0 ? json_null()
            : json_pack("{sI si so so}", "position", (json_int_t)x->audit_worst_pos, "layer",
                        x->audit_worst_layer, "residual", jnum(x->audit_worst_residual),
                        "ratio", jnum(x->audit_worst)));
    json_t *acc = !x->acc_on ? json_null()
        : json_pack("{sI so so so}", "rows", (json_int_t)x->acc_rows, "factor",
                    jnum(x->acc_factor), "largest", jnum(x->acc_largest), "at",
                    x->acc_pos < 0 ? json_null()
                        : json_pack("{sI si}", "position", (json_int_t)x->acc_pos, "layer",
                                    x->acc_layer));
    json_t *compute = !x->compute_precision[0] ? json_null()
        : json_pack("{ss so so sb so}", "precision", x->compute_precision, "eps",
                    jnum(x->compute_eps), "factor", jnum(x->compute_factor), "stated",
                    x->compute_stated, "assumed_why",
                    x->compute_stated ? json_null() : json_string(x->compute_assumed_why));
    json_t *j = json_pack("{ss ss so ss so so so so so sb so so so so so so}", "model", x->model, "why",
                     x->why, "compute", compute, "kv_precision", x->kv_precision, "kv_eps", jnum(x->kv_eps), "floor",
                     jnum(x->floor_base), "kv_factor", jnum(x->kv_factor), "gain",
                     jnum(x->gain), "history", jnum(x->history), "step", x->step, "step_error",
                     x->step ? jnum(x->step_err) : json_null(), "step_threshold",
                     x->step ? jnum(x->step_threshold) : json_null(), "drift_closest", worst,
                     "attention_check", audit, "f16_accumulation", acc, "stages", st);
    if (j)
        json_object_set_new(j, "structure", jstructure(x));
    if (j)   /* /output, walked last at each position; null where it is bit-identical */
        json_object_set_new(j, "output_max_rel", x->output_drift ? jnum(x->output_max_rel)
                                                                 : json_null());
    return j;
}

static json_t *jstages(const cmp_result *r)
{
    json_t *a = json_array();
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *s = &r->stages[i];
        /* The noise floor that judged the stage: its own sample (null where
         * the noise recording lacks it), the modelled floor, the tolerances. */
        json_t *nrel = r->noise && s->noise_held ? jnum(s->noise_rel) : json_null();
        json_t *nabs = r->noise && s->noise_held ? jnum(s->noise_abs) : json_null();
        json_array_append_new(a, json_pack("{si ss si sI sI sb sI so so so so so so so}", "layer",
                                           s->layer, "stage", stage_name(s->stage), "cols",
                                           s->cols, "position_lo", (json_int_t)s->pos_lo,
                                           "position_hi", (json_int_t)s->pos_hi, "fingerprint",
                                           s->hashed, "rows_by_hash", (json_int_t)s->rows_by_hash,
                                           "noise_rel", nrel, "noise_abs", nabs, "noise_floor",
                                           jnum(s->noise_floor), "atol", jnum(s->atol_eff),
                                           "rtol", jnum(s->rtol_eff), "upto", jstats(&s->upto),
                                           "all", jstats(&s->all)));
    }
    return a;
}

json_t *cmp_result_json(const cmp_result *r, unsigned flags)
{
    json_t *notes = json_array();
    for (int i = 0; i < r->n_notes; i++)
        json_array_append_new(notes, json_string(r->notes[i]));
    json_t *mode = json_pack("{sb so so sI sb so}", "exact", r->exact, "atol", jnum(r->atol),
                             "rtol", jnum(r->rtol), "ulp", (json_int_t)r->ulp, "noise_floor",
                             r->noise, "noise_factor", jnum(r->noise_factor));
    if (mode)
        json_object_set_new(mode, "cross_runtime", jxrt(r));
    json_t *diag = r->first.found || r->diag.kind != CMP_DIAG_NONE
        ? json_pack("{ss ss sb ss ss ss so}", "kind", cmp_diag_name(r->diag.kind), "basis",
                    cmp_basis_name(r->diag.basis), "undecided", r->diag.undecided, "summary",
                    r->diag.summary, "detail", r->diag.detail, "evidence", r->diag.evidence,
                    "hypotheses", jhyps(&r->diag))
        : json_null();
    json_t *beyond = jdiv(&r->beyond);
    if (json_is_object(beyond))
        json_object_set_new(beyond, "evidence", jevidence(&r->beyond, &r->beyond_ev));
    json_t *j = json_pack("{ss ss si so so so so so so so so so}", "schema", CMP_JSON_SCHEMA,
                          "verdict", cmp_verdict_name(r->verdict), "exit_code", cmp_exit_code(0, r), "mode",
                          mode, "compared", jcompared(r), "first_divergence", jdiv(&r->first),
                          "evidence", jevidence(&r->first, &r->ev), "beyond_drift", beyond,
                          "diagnosis", diag, "tokens", jtokens(&r->tokens), "logits",
                          jlogits(&r->logits), "notes", notes);
    if (j) {
        json_object_set_new(j, "incomplete", json_boolean(r->incomplete));
        json_object_set_new(j, "incomplete_why", r->incomplete ? json_string(r->incomplete_why)
                                                                : json_null());
        json_object_set_new(j, "swapped", r->swapped[0] ? json_string(r->swapped) : json_null());
        json_object_set_new(j, "config_differs",
                            r->config_diff[0] ? json_string(r->config_diff) : json_null());
        const cmp_hash_check *h = &r->hashcheck;
        json_object_set_new(
            j, "hash_check",
            json_pack("{sI so}", "rows_checked", (json_int_t)h->rows_checked, "stale",
                      h->stale ? json_pack("{ss si ss sI}", "file", h->file, "layer", h->layer,
                                           "stage", stage_name(h->stage), "position",
                                           (json_int_t)h->pos)
                               : json_null()));
    }
    if (j && (flags & CMP_RENDER_STAGES))
        json_object_set_new(j, "stages", jstages(r));
    return j;
}

char *cmp_render_json(const cmp_result *r, unsigned flags)
{
    json_t *j = cmp_result_json(r, flags);
    if (!j)
        return NULL;
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return s;
}
