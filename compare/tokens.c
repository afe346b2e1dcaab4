/* tokens.c — the tokens verdict (first differing generated token, each
 * run's logit margin there) and the logits metrics: KL(softmax(ref) ||
 * softmax(test)) and top-1 agreement, from full logits or /output top-k. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "cmp_internal.h"

/* Margins below this (in logits) make a flip plausible from rounding alone. */
#define CMP_NEAR_TIE 0.01

static int logits_row_margin(const cmp_source *src, int64_t pos, double *margin, kv_err *e)
{
    const int V = src->cfg.vocab;
    float *row = malloc((size_t)(V > 0 ? V : 1) * sizeof(float));
    if (!row)
        return kv_errf(e, "compare: out of memory for a logits row");
    int rc = cmp_read_row(src, -1, STAGE_LOGITS, pos, V, row, e);
    if (rc == 0 && V >= 2) {
        double t1 = -INFINITY, t2 = -INFINITY;
        for (int i = 0; i < V; i++) {
            if (row[i] > t1)
                t2 = t1, t1 = row[i];
            else if (row[i] > t2)
                t2 = row[i];
        }
        *margin = t1 - t2;
    }
    free(row);
    return rc;
}

static int output_margin(const cmp_source *src, int64_t pos, double *margin, kv_err *e)
{
    int64_t first = 0, rows = 0;
    int k = 0;
    if (!src->output_info || !src->output ||
        src->output_info(src->ctx, &first, &rows, &k) != 0 || rows <= 0 || k < 2 ||
        pos < first || pos >= first + rows)
        return 1;
    float lse, *vals = malloc((size_t)k * sizeof(float));
    int32_t *ids = malloc((size_t)k * sizeof(int32_t));
    int rc = (!vals || !ids) ? kv_errf(e, "compare: out of memory")
                             : src->output(src->ctx, pos, 1, &lse, ids, vals, e);
    if (rc == 0)
        *margin = (double)vals[0] - (double)vals[1];
    free(vals);
    free(ids);
    return rc < 0 ? -1 : 0;
}

double cmp_logit_margin(const cmp_source *src, int64_t pos, kv_err *e, int *rc)
{
    double m = NAN;
    *rc = 0;
    if (pos < 0)
        return m;
    int r = logits_row_margin(src, pos, &m, e);
    if (r == 1)
        r = output_margin(src, pos, &m, e);
    *rc = r < 0 ? -1 : 0;
    return m;
}

/* A run that says it decoded greedily: its settings give temperature 0. */
static bool greedy(const cmp_source *s)
{
    json_error_t je;
    json_t *j = s->settings_json ? json_loads(s->settings_json, 0, &je) : NULL;
    json_t *t = j ? json_object_get(j, "temperature") : NULL;
    const bool g = json_is_number(t) && json_number_value(t) == 0;
    json_decref(j);
    return g;
}

#define SELF_BLOCK 64

/* The first p whose top-1 in /output is not the token at p + 1 (greedy
 * runs only; a token tied with the top-1 is no contradiction). */
static int self_check(const cmp_source *s, int64_t *at, int32_t *token, int32_t *top1,
                      kv_err *e)
{
    int64_t first = 0, rows = 0;
    int k = 0;
    *at = -1;
    if (!greedy(s) || !s->tokens || !s->output_info || !s->output ||
        s->output_info(s->ctx, &first, &rows, &k) != 0 || rows <= 0 || k < 1)
        return 0;
    int64_t lo = s->prompt_length - 1 > first ? s->prompt_length - 1 : first;
    const int64_t hi = first + rows - 1 < s->n_tokens - 2 ? first + rows - 1 : s->n_tokens - 2;
    float lse[SELF_BLOCK], *vals = malloc((size_t)SELF_BLOCK * (size_t)k * sizeof *vals);
    int32_t *ids = malloc((size_t)SELF_BLOCK * (size_t)k * sizeof *ids);
    int rc = (!vals || !ids) ? kv_errf(e, "compare: out of memory reading %s's /output",
                                       s->label) : 0;
    for (int64_t q = lo < 0 ? 0 : lo; rc == 0 && *at < 0 && q <= hi; q += SELF_BLOCK) {
        const int64_t n = hi - q + 1 < SELF_BLOCK ? hi - q + 1 : SELF_BLOCK;
        if ((rc = s->output(s->ctx, q, n, lse, ids, vals, e)) < 0)
            break;
        for (int64_t r = 0; r < n && *at < 0; r++) {
            const int32_t *ir = ids + r * k;
            const float *vr = vals + r * k;
            const int32_t tok = s->tokens[q + r + 1];
            /* the top-1 itself, or a token tied with it; a non-finite top
             * value ranks nothing (NaN logits), so says nothing either */
            bool agrees = ir[0] == tok || !isfinite(vr[0]);
            for (int i = 1; i < k && !agrees && vr[i] == vr[0]; i++)
                agrees = ir[i] == tok;
            if (!agrees) {
                *at = q + r;
                *token = tok;
                *top1 = ir[0];
            }
        }
    }
    free(vals);
    free(ids);
    return rc < 0 ? -1 : 0;
}

static int flip_row(cmp_ctx *c, int64_t pos, int32_t ref_id, int32_t test_id, double *err,
                    double *margin, bool *shown, kv_err *e);

/* Across runtimes a flip is judged by the evidence at its position: the
 * logit error this pair shows there (measured over the ids both /output
 * lists hold, not a constant), which the walk has judged drift, against
 * the reference's own top-2 margin. Two logits each off by at most err
 * swap only where they are within 2 err of each other; and the test's own
 * logits must rank its token above the reference's (else its choice is
 * no rounding of them: a sampler, a token written otherwise). */
static int flip_evidence(cmp_ctx *c, kv_err *e)
{
    cmp_tokens *t = &c->r->tokens;
    t->logit_err = NAN;
    t->flip_drift = false;
    if (!c->r->xrt.on || t->pos < 1)
        return 0;
    bool shown = false;
    double margin = NAN;
    if (flip_row(c, t->pos - 1, t->ref_id, t->test_id, &t->logit_err, &margin, &shown, e) < 0)
        return -1;
    const bool before = c->r->first.found && c->r->first.pos < t->pos;
    t->flip_drift = !before && shown && t->self_pos[1] < 0 && isfinite(margin) &&
                    isfinite(t->logit_err) && margin <= 2 * t->logit_err;
    return 0;
}

int cmp_tokens_compare(cmp_ctx *c, kv_err *e)
{
    cmp_tokens *t = &c->r->tokens;
    const cmp_source *a = c->ref, *b = c->test;
    memset(t, 0, sizeof *t);
    t->n_ref = a->n_tokens;
    t->n_test = b->n_tokens;
    t->prompt_length = a->prompt_length;
    t->pos = t->step = -1;
    t->ref_margin = t->test_margin = t->logit_err = NAN;
    if (self_check(a, &t->self_pos[0], &t->self_token[0], &t->self_top1[0], e) < 0 ||
        self_check(b, &t->self_pos[1], &t->self_token[1], &t->self_top1[1], e) < 0)
        return -1;
    if (a->n_tokens <= 0 || b->n_tokens <= 0 || !a->tokens || !b->tokens) {
        t->kind = CMP_TOKENS_NONE;
        return 0;
    }
    const int64_t n = a->n_tokens < b->n_tokens ? a->n_tokens : b->n_tokens;
    for (int64_t p = 0; p < n; p++)
        if (a->tokens[p] != b->tokens[p]) {
            t->pos = p;
            break;
        }
    if (t->pos < 0) {
        t->kind = a->n_tokens == b->n_tokens ? CMP_TOKENS_IDENTICAL : CMP_TOKENS_LENGTH;
        t->test_stopped = b->stopped_on_purpose && b->n_tokens < a->n_tokens;
        return 0;
    }
    int rc1, rc2;
    t->kind = CMP_TOKENS_DIFFER;
    t->step = t->pos - a->prompt_length;
    t->ref_id = a->tokens[t->pos];
    t->test_id = b->tokens[t->pos];
    /* The token at pos was chosen from the logits computed at pos - 1. */
    t->ref_margin = cmp_logit_margin(a, t->pos - 1, e, &rc1);
    t->test_margin = cmp_logit_margin(b, t->pos - 1, e, &rc2);
    if (rc1 < 0 || rc2 < 0)
        return -1;
    t->near_tie = isfinite(t->ref_margin) && isfinite(t->test_margin) &&
                  t->ref_margin < CMP_NEAR_TIE && t->test_margin < CMP_NEAR_TIE;
    return flip_evidence(c, e);
}

/* ------------------------------------------------------------------ */
/* Logits metrics                                                       */

static double row_lse(const float *x, int V, int *argmax)
{
    double mx = -INFINITY, s = 0;
    *argmax = 0;
    for (int i = 0; i < V; i++)
        if (x[i] > mx) {
            mx = x[i];
            *argmax = i;
        }
    for (int i = 0; i < V; i++)
        s += exp((double)x[i] - mx);
    return mx + log(s);
}

static void add_kl(cmp_logit_stats *ls, double kl, bool agree, int64_t pos)
{
    ls->positions++;
    ls->top1_agree += agree;
    ls->kl_mean += kl;   /* a sum until the end */
    if (ls->positions == 1 || kl > ls->kl_max) {
        ls->kl_max = kl;
        ls->kl_max_pos = pos;
    }
}

static const char *nonfinite_word(double v)
{
    return isnan(v) ? "nan" : v > 0 ? "inf" : "-inf";
}

/* A position where a side's logits are not all finite: no KL measures it
 * (NaN folds to 0 in a sum of max(kl, 0)), so it is left out, counted,
 * and the first one said: which dump, which value, where. side: 0 the
 * reference, 1 the test; what: "log-sum-exp", "logit of token 17". */
static void note_nonfinite(const cmp_ctx *c, cmp_logit_stats *ls, int64_t pos, int side,
                           const char *what, double v)
{
    if (ls->nonfinite++ > 0)
        return;
    ls->nonfinite_pos = pos;
    snprintf(ls->nonfinite_what, sizeof ls->nonfinite_what, "%s's %s is %s",
             side ? c->test->label : c->ref->label, what, nonfinite_word(v));
}

/* The first value of n that is not finite, or -1. */
static int first_nonfinite(const float *x, int n)
{
    for (int i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return i;
    return -1;
}

/* Whether both sides' full logits rows at pos are finite; noted if not. */
static bool logits_finite(const cmp_ctx *c, cmp_logit_stats *ls, int64_t pos, const float *p,
                          const float *q, int V)
{
    const float *row[2] = {p, q};
    for (int side = 0; side < 2; side++) {
        const int i = first_nonfinite(row[side], V);
        if (i >= 0) {
            char what[64];
            snprintf(what, sizeof what, "logit of token %d", i);
            note_nonfinite(c, ls, pos, side, what, row[side][i]);
            return false;
        }
    }
    return true;
}

/* The same for /output rows: the log-sum-exp and the top-k values. */
static bool output_finite(const cmp_ctx *c, cmp_logit_stats *ls, int64_t pos, const float lse[2],
                          const int32_t *const ids[2], const float *const vals[2],
                          const int k[2])
{
    for (int side = 0; side < 2; side++) {
        if (!isfinite(lse[side])) {
            note_nonfinite(c, ls, pos, side, "log-sum-exp", lse[side]);
            return false;
        }
        const int i = first_nonfinite(vals[side], k[side]);
        if (i >= 0) {
            char what[64];
            snprintf(what, sizeof what, "top-k logit of token %d", ids[side][i]);
            note_nonfinite(c, ls, pos, side, what, vals[side][i]);
            return false;
        }
    }
    return true;
}

static double kl_full(const float *p, const float *q, int V, bool *agree)
{
    int ap, aq;
    const double lp = row_lse(p, V, &ap), lq = row_lse(q, V, &aq);
    double kl = 0;
    for (int i = 0; i < V; i++) {
        const double a = (double)p[i] - lp, b = (double)q[i] - lq;
        kl += exp(a) * (a - b);
    }
    *agree = ap == aq;
    return kl > 0 ? kl : 0;
}

static int stats_from_logits(cmp_ctx *c, const cmp_stage_result *sr, kv_err *e)
{
    cmp_logit_stats *ls = &c->r->logits;
    const int V = sr->cols;
    int step = CMP_ROW_BUDGET / V;
    step = step < 1 ? 1 : step > 64 ? 64 : step;
    float *a = malloc((size_t)step * V * sizeof(float));
    float *b = malloc((size_t)step * V * sizeof(float));
    int rc = (!a || !b) ? kv_errf(e, "compare: out of memory for logits") : 0;
    for (int64_t p = sr->pos_lo; rc == 0 && p <= sr->pos_hi; p += step) {
        const int64_t n = sr->pos_hi - p + 1 < step ? sr->pos_hi - p + 1 : step;
        if (c->ref->read(c->ref->ctx, -1, STAGE_LOGITS, p, n, a, e) < 0 ||
            c->test->read(c->test->ctx, -1, STAGE_LOGITS, p, n, b, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t r = 0; r < n; r++) {
            const float *ra = a + (size_t)r * V, *rb = b + (size_t)r * V;
            if (!logits_finite(c, ls, p + r, ra, rb, V))
                continue;
            bool agree;
            double kl = kl_full(ra, rb, V, &agree);
            add_kl(ls, kl, agree, p + r);
        }
    }
    free(a);
    free(b);
    return rc;
}

double cmp_kl_topk(float lr, const int32_t *ir, const float *vr, float lt, const int32_t *it,
                      const float *vt, int k)
{
    double kl = 0;
    for (int i = 0; i < k; i++) {
        double lq = (double)vt[k - 1] - lt;
        for (int j = 0; j < k; j++)
            if (it[j] == ir[i])
                lq = (double)vt[j] - lt;
        const double lp = (double)vr[i] - lr;
        kl += exp(lp) * (lp - lq);
    }
    return kl > 0 || isnan(kl) ? kl : 0;
}

/* The positions lo..hi both sides' /output hold, before the token cut,
 * and each side's top-k width; false when either has none. */
static bool output_overlap(const cmp_ctx *c, int64_t *lo, int64_t *hi, int *ka, int *kb)
{
    const cmp_source *a = c->ref, *b = c->test;
    int64_t fa, ra, fb, rb;
    if (!a->output_info || !b->output_info || !a->output || !b->output ||
        a->output_info(a->ctx, &fa, &ra, ka) != 0 ||
        b->output_info(b->ctx, &fb, &rb, kb) != 0 || ra <= 0 || rb <= 0 || *ka < 1 || *kb < 1)
        return false;
    *lo = fa > fb ? fa : fb;
    *hi = fa + ra < fb + rb ? fa + ra - 1 : fb + rb - 1;
    if (c->pos_limit >= 0 && *hi >= c->pos_limit)
        *hi = c->pos_limit - 1;
    return true;
}

typedef struct {
    float lse[64];
    int32_t *ids;
    float *vals;
} out_block;

/* Both sides' blocks of up to 64 positions, top-k widths ka and kb. */
static int out_pair_alloc(out_block *A, out_block *B, int ka, int kb, kv_err *e)
{
    A->ids = malloc((size_t)64 * ka * 4);
    A->vals = malloc((size_t)64 * ka * 4);
    B->ids = malloc((size_t)64 * kb * 4);
    B->vals = malloc((size_t)64 * kb * 4);
    return !A->ids || !A->vals || !B->ids || !B->vals ? kv_errf(e, "compare: out of memory")
                                                     : 0;
}

/* Both sides' /output at positions p .. p + n - 1 (n <= 64). */
static int out_pair_read(const cmp_ctx *c, int64_t p, int64_t n, out_block *A, out_block *B,
                         kv_err *e)
{
    return c->ref->output(c->ref->ctx, p, n, A->lse, A->ids, A->vals, e) < 0 ||
                   c->test->output(c->test->ctx, p, n, B->lse, B->ids, B->vals, e) < 0
               ? -1 : 0;
}

static void out_pair_free(out_block *A, out_block *B)
{
    free(A->ids);
    free(A->vals);
    free(B->ids);
    free(B->vals);
}

static int stats_from_output(cmp_ctx *c, int64_t lo, int64_t hi, int kr, int kt, kv_err *e)
{
    cmp_logit_stats *ls = &c->r->logits;
    const int k = kr < kt ? kr : kt;
    out_block A, B;
    int rc = out_pair_alloc(&A, &B, kr, kt, e);
    for (int64_t p = lo; rc == 0 && p <= hi; p += 64) {
        const int64_t n = hi - p + 1 < 64 ? hi - p + 1 : 64;
        if (out_pair_read(c, p, n, &A, &B, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t r = 0; r < n; r++) {
            const int32_t *ir = A.ids + r * kr, *it = B.ids + r * kt;
            const float lse[2] = {A.lse[r], B.lse[r]};
            const int32_t *const ids[2] = {ir, it};
            const float *const vals[2] = {A.vals + r * kr, B.vals + r * kt};
            const int widths[2] = {kr, kt};
            if (!output_finite(c, ls, p + r, lse, ids, vals, widths))
                continue;
            double kl = cmp_kl_topk(A.lse[r], ir, A.vals + r * kr, B.lse[r], it, B.vals + r * kt, k);
            add_kl(ls, kl, ir[0] == it[0], p + r);
        }
    }
    out_pair_free(&A, &B);
    return rc;
}

int cmp_logit_stats_compute(cmp_ctx *c, kv_err *e)
{
    cmp_logit_stats *ls = &c->r->logits;
    memset(ls, 0, sizeof *ls);
    ls->nonfinite_pos = -1;
    const cmp_stage_result *sr = cmp_result_stage(c->r, -1, STAGE_LOGITS);
    int rc = 0;
    if (sr && !sr->hashed) {
        rc = stats_from_logits(c, sr, e);
    } else {
        int64_t lo, hi;
        int ka, kb;
        if (!output_overlap(c, &lo, &hi, &ka, &kb) || lo > hi)
            return 0;
        ls->from_topk = true;
        rc = stats_from_output(c, lo, hi, ka, kb, e);
    }
    /* No position measured: no KL to show (JSON null, no report line);
     * the note below says why. */
    ls->present = ls->positions > 0;
    if (ls->positions > 0)
        ls->kl_mean /= (double)ls->positions;
    if (ls->nonfinite > 0)
        cmp_note(c->r, "%s at position %lld (%lld position%s with logits not finite): left out "
                 "of the KL, %s", ls->nonfinite_what, (long long)ls->nonfinite_pos,
                 (long long)ls->nonfinite, ls->nonfinite == 1 ? "" : "s",
                 ls->positions > 0 ? "which covers the others" : "which has no position left");
    return rc;
}

/* ------------------------------------------------------------------ */
/* /output, bit for bit                                                 */

static bool same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

/* The first entry of row r that differs: -1 the lse, else the index in
 * the top-k lists (ids or values); -2 none. */
static int output_row_diff(const out_block *A, const out_block *B, int64_t r, int ka, int kb,
                           int k)
{
    if (!same_bits(A->lse[r], B->lse[r]))
        return -1;
    for (int i = 0; i < k; i++)
        if (A->ids[r * ka + i] != B->ids[r * kb + i] ||
            !same_bits(A->vals[r * ka + i], B->vals[r * kb + i]))
            return i;
    return -2;
}

static void output_divergence(cmp_ctx *c, const out_block *A, const out_block *B, int64_t r,
                              int64_t p, int ka, int kb, int k, int at)
{
    cmp_divergence *d = &c->r->first;
    memset(d, 0, sizeof *d);
    d->found = true;
    d->from_output = true;
    d->pos = p;
    d->layer = -1;
    d->stage = STAGE_LOGITS;
    d->head = at;
    d->dim = at >= 0 && A->ids[r * ka + at] != B->ids[r * kb + at] ? B->ids[r * kb + at] : -1;
    d->kv_owner = -1;
    d->col = at < 0 ? -1 : A->ids[r * ka + at];
    d->ref = at < 0 ? A->lse[r] : A->vals[r * ka + at];
    d->test = at < 0 ? B->lse[r] : B->vals[r * kb + at];
    double mx = 0, ref_max = fabs((double)A->lse[r]);
    d->n_bad = !same_bits(A->lse[r], B->lse[r]);
    mx = fabs((double)A->lse[r] - (double)B->lse[r]);
    for (int i = 0; i < k; i++) {
        const bool differ = A->ids[r * ka + i] != B->ids[r * kb + i] ||
                            !same_bits(A->vals[r * ka + i], B->vals[r * kb + i]);
        d->n_bad += differ;
        const double dv = fabs((double)A->vals[r * ka + i] - (double)B->vals[r * kb + i]);
        mx = differ && dv > mx ? dv : mx;
        ref_max = fmax(ref_max, fabs((double)A->vals[r * ka + i]));
    }
    d->nonfinite = cmp_elem_nonfinite_mismatch(d->test, d->ref);
    d->abs_err = d->nonfinite ? NAN : fabs((double)d->test - (double)d->ref);
    d->ulp = d->nonfinite ? 0 : cmp_ulp_distance(d->test, d->ref);
    d->row_max_abs = mx;
    d->row_rel = ref_max > 0 ? mx / ref_max : INFINITY;
}

int cmp_output_exact(cmp_ctx *c, kv_err *e)
{
    int64_t lo, hi;
    int ka, kb;
    if (!output_overlap(c, &lo, &hi, &ka, &kb))
        return 0;
    /* At the walk's own divergence its stage comes first in dataflow. */
    if (c->r->first.found && hi >= c->r->first.pos)
        hi = c->r->first.pos - 1;
    const int k = ka < kb ? ka : kb;
    out_block A, B;
    int rc = out_pair_alloc(&A, &B, ka, kb, e);
    bool done = false;
    for (int64_t p = lo; rc == 0 && !done && p <= hi; p += 64) {
        const int64_t n = hi - p + 1 < 64 ? hi - p + 1 : 64;
        if (out_pair_read(c, p, n, &A, &B, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t r = 0; r < n && !done; r++) {
            const int at = output_row_diff(&A, &B, r, ka, kb, k);
            if (at == -2)
                continue;
            output_divergence(c, &A, &B, r, p + r, ka, kb, k, at);
            done = true;
        }
    }
    out_pair_free(&A, &B);
    return rc;
}

/* ------------------------------------------------------------------ */
/* /output across runtimes: judged by the drift model                   */

/* Row r's largest difference, with each token's value matched by its id
 * across the two top-k lists: the log-sum-exp, every id both lists hold,
 * and an id one list holds above the other's last value (the other then
 * ranks it lower than it would be: it differs by at least that gap).
 * *at: -1 the lse, else the reference rank (or, as -2 - i, the test's
 * rank i of an id the reference lacks) where it is largest; *scale: the
 * reference's largest magnitude (lse and values). */
static double output_row_err(const out_block *A, const out_block *B, int64_t r, int ka, int kb,
                             int *at, double *scale)
{
    const float *ra = A->vals + r * ka, *rb = B->vals + r * kb;
    const int32_t *ia = A->ids + r * ka, *ib = B->ids + r * kb;
    double worst = fabs((double)A->lse[r] - (double)B->lse[r]);
    *at = -1;
    *scale = fabs((double)A->lse[r]);
    if (!isfinite(worst) && !(isnan(A->lse[r]) && isnan(B->lse[r])))
        worst = INFINITY;
    for (int i = 0; i < ka; i++) {
        *scale = fmax(*scale, fabs((double)ra[i]));
        double d = -1;
        for (int j = 0; j < kb && d < 0; j++)
            if (ib[j] == ia[i])
                d = fabs((double)ra[i] - (double)rb[j]);
        if (d < 0)   /* not in the test's list: at most its last value there */
            d = fmax(0, (double)ra[i] - (double)rb[kb - 1]);
        if (d > worst || isnan(d)) {
            worst = isnan(d) ? INFINITY : d;
            *at = i;
        }
    }
    for (int j = 0; j < kb; j++) {
        bool held = false;
        for (int i = 0; i < ka && !held; i++)
            held = ia[i] == ib[j];
        const double d = held ? 0 : fmax(0, (double)rb[j] - (double)ra[ka - 1]);
        if (d > worst) {
            worst = d;
            *at = -2 - j;
        }
    }
    return worst;
}

int cmp_output_errors(cmp_ctx *c, int64_t base, int64_t P, double *err, kv_err *e)
{
    for (int64_t i = 0; i < P; i++)
        err[i] = NAN;
    int64_t lo, hi;
    int ka, kb;
    if (!output_overlap(c, &lo, &hi, &ka, &kb))
        return 0;
    lo = lo > base ? lo : base;
    hi = hi < base + P - 1 ? hi : base + P - 1;
    out_block A, B;
    int rc = out_pair_alloc(&A, &B, ka, kb, e);
    for (int64_t p = lo; rc == 0 && p <= hi; p += 64) {
        const int64_t n = hi - p + 1 < 64 ? hi - p + 1 : 64;
        if (out_pair_read(c, p, n, &A, &B, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t r = 0; r < n; r++) {
            int at;
            double scale;
            const double d = output_row_err(&A, &B, r, ka, kb, &at, &scale);
            err[p + r - base] = scale > 0 ? d / scale : d > 0 ? INFINITY : 0;
            const double rel = err[p + r - base];
            if (rel > c->r->xrt.output_max_rel || isnan(rel))
                c->r->xrt.output_max_rel = isnan(rel) ? INFINITY : rel;
            c->r->xrt.output_drift |= !(d == 0) || output_row_diff(&A, &B, r, ka, kb,
                                                                  ka < kb ? ka : kb) != -2;
        }
    }
    out_pair_free(&A, &B);
    return rc;
}

int cmp_output_step(cmp_ctx *c, int64_t p, kv_err *e)
{
    int64_t lo, hi;
    int ka, kb;
    if (!output_overlap(c, &lo, &hi, &ka, &kb) || p < lo || p > hi)
        return kv_errf(e, "compare: /output holds no position %lld on both sides", (long long)p);
    out_block A, B;
    int rc = out_pair_alloc(&A, &B, ka, kb, e);
    if (rc == 0 && out_pair_read(c, p, 1, &A, &B, e) < 0)
        rc = -1;
    if (rc == 0) {
        int at;
        double scale;
        output_row_err(&A, &B, 0, ka, kb, &at, &scale);
        /* an id only the test ranks: shown at the reference's last rank,
         * where it would have had to be */
        output_divergence(c, &A, &B, 0, p, ka, kb, ka < kb ? ka : kb,
                          at < -1 ? (ka < kb ? ka : kb) - 1 : at);
        /* across runtimes the values are compared by id, not by rank */
        cmp_divergence *d = &c->r->first;
        if (at >= 0) {
            d->ref = A.vals[at];
            for (int j = 0; j < kb; j++)
                if (B.ids[j] == A.ids[at])
                    d->test = B.vals[j];
        }
        d->row_rel = scale > 0 ? d->row_max_abs / scale : d->row_rel;
    }
    out_pair_free(&A, &B);
    return rc;
}

/* ------------------------------------------------------------------ */
/* /output as a map of the reference's logits (structure.c)             */

#define MAP_MAX_POS 4096   /* positions the map is fitted over (the first ones) */

/* Each position's top-k values both lists hold, matched by id, for up to
 * MAP_MAX_POS positions from the first both hold at or after base;
 * at[i]..at[i + 1] are position first + i's
 * pairs, scale[i] its reference magnitude (lse and values). */
typedef struct {
    double *ref, *test, *scale;
    size_t *at;
    int64_t first, P;            /* positions first .. first + P - 1 */
} map_pairs;

static void map_pairs_free(map_pairs *m)
{
    free(m->ref);
    free(m->test);
    free(m->scale);
    free(m->at);
}

static int map_pairs_read(cmp_ctx *c, int64_t base, int64_t P, map_pairs *m, kv_err *e)
{
    memset(m, 0, sizeof *m);
    int64_t lo, hi;
    int ka, kb;
    if (!output_overlap(c, &lo, &hi, &ka, &kb))
        return 0;
    m->first = lo > base ? lo : base;
    hi = hi < base + P - 1 ? hi : base + P - 1;
    if (hi < m->first)
        return 0;
    m->P = hi - m->first + 1 < MAP_MAX_POS ? hi - m->first + 1 : MAP_MAX_POS;
    const size_t cap = (size_t)m->P * (size_t)(ka < kb ? ka : kb);
    m->ref = malloc((cap + 1) * sizeof *m->ref);
    m->test = malloc((cap + 1) * sizeof *m->test);
    m->scale = malloc((size_t)m->P * sizeof *m->scale);
    m->at = malloc(((size_t)m->P + 1) * sizeof *m->at);
    out_block A, B;
    int rc = out_pair_alloc(&A, &B, ka, kb, e);
    if (rc == 0 && (!m->ref || !m->test || !m->scale || !m->at))
        rc = kv_errf(e, "compare: out of memory");
    size_t n = 0;
    const int64_t end = m->first + m->P;
    for (int64_t p = m->first; rc == 0 && p < end; p += 64) {
        const int64_t rows = end - p < 64 ? end - p : 64;
        if (out_pair_read(c, p, rows, &A, &B, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t r = 0; r < rows; r++) {
            const size_t i = (size_t)(p + r - m->first);
            m->at[i] = n;
            double s = fabs((double)A.lse[r]);
            for (int a = 0; a < ka; a++) {
                const double va = A.vals[r * ka + a];
                s = fmax(s, fabs(va));
                for (int b = 0; b < kb; b++)
                    if (B.ids[r * kb + b] == A.ids[r * ka + a] && n < cap && isfinite(va) &&
                        isfinite(B.vals[r * kb + b])) {
                        m->ref[n] = va;
                        m->test[n++] = B.vals[r * kb + b];
                        break;
                    }
            }
            m->scale[i] = s;
        }
    }
    if (m->at)
        m->at[m->P] = n;
    out_pair_free(&A, &B);
    if (rc < 0)
        map_pairs_free(m);
    return rc;
}

int cmp_output_map(cmp_ctx *c, int64_t base, int64_t P, double *part, double *noise, kv_err *e)
{
    for (int64_t i = 0; i < P; i++)
        part[i] = noise[i] = NAN;
    map_pairs m;
    if (map_pairs_read(c, base, P, &m, e) < 0)
        return -1;
    if (m.P <= 0)
        return 0;
    cmp_xrt *x = &c->r->xrt;
    cmp_logitmap fit;
    cmp_logit_map_fit(m.ref, m.test, m.at[m.P], c->cfg->final_softcap, &fit);
    x->map_fitted = true;
    x->map_kind = fit.kind;
    x->map_param = fit.param;
    x->map_config_cap = fit.config_cap;
    x->map_gain = fit.ssr > 0 ? sqrt(fit.ssr_identity / fit.ssr) : fit.ssr_identity > 0
                                                                      ? INFINITY : 1;
    x->map_positions = 0;
    for (int64_t i = 0; i < m.P; i++)
        x->map_positions += m.at[i + 1] > m.at[i];
    const cmp_logitmap uncapped = {.kind = CMP_MAP_SOFTCAP, .param = INFINITY,
                                   .config_cap = fit.config_cap};
    x->map_zmax = 0;
    for (size_t j = 0; j < m.at[m.P]; j++)
        x->map_zmax = fmax(x->map_zmax, fabs(cmp_logit_map(&uncapped, m.ref[j])));
    /* positions the units: what the map lowers, over what it leaves per
     * remaining degree of freedom */
    x->map_F = fit.ssr > 0 ? (fit.ssr_identity - fit.ssr) / (fit.ssr /
               (double)(x->map_positions > 1 ? x->map_positions - 1 : 1))
                           : fit.ssr_identity > 0 ? INFINITY : 0;
    x->map_F_crit = cmp_map_f_critical(x->map_positions - 1);
    for (int64_t i = 0; fit.kind != CMP_MAP_NONE && i < m.P; i++) {
        double pt = 0, ns = 0;
        for (size_t j = m.at[i]; j < m.at[i + 1]; j++) {
            const double f = cmp_logit_map(&fit, m.ref[j]);
            pt = fmax(pt, fabs(f - m.ref[j]));
            ns = fmax(ns, fabs(m.test[j] - f));
        }
        if (m.at[i + 1] > m.at[i] && m.scale[i] > 0) {
            part[m.first + i - base] = pt / m.scale[i];
            noise[m.first + i - base] = ns / m.scale[i];
        }
    }
    map_pairs_free(&m);
    return 0;
}

/* At pos: the largest |test - ref| over the ids both top-k lists hold
 * (NaN: /output not held there on both sides), the reference's margin of
 * its token over the test's in the same lists, and whether the test's
 * list holds both tokens with its own above the reference's. */
static int flip_row(cmp_ctx *c, int64_t pos, int32_t ref_id, int32_t test_id, double *err,
                    double *margin, bool *shown, kv_err *e)
{
    *err = *margin = NAN;
    *shown = false;
    int64_t lo, hi;
    int ka, kb;
    if (!output_overlap(c, &lo, &hi, &ka, &kb) || pos < lo || pos > hi)
        return 0;
    out_block A, B;
    int rc = out_pair_alloc(&A, &B, ka, kb, e);
    if (rc == 0 && out_pair_read(c, pos, 1, &A, &B, e) < 0)
        rc = -1;
    double worst = -1, v_ref = NAN, v_test = NAN;
    for (int i = 0; rc == 0 && i < ka; i++)
        for (int j = 0; j < kb; j++)
            if (A.ids[i] == B.ids[j]) {
                const double d = fabs((double)A.vals[i] - (double)B.vals[j]);
                worst = isfinite(d) && d > worst ? d : worst;
                break;
            }
    for (int j = 0; rc == 0 && j < kb; j++) {
        v_ref = B.ids[j] == ref_id ? B.vals[j] : v_ref;
        v_test = B.ids[j] == test_id ? B.vals[j] : v_test;
    }
    double r_ref = NAN, r_test = NAN;
    for (int i = 0; rc == 0 && i < ka; i++) {
        r_ref = A.ids[i] == ref_id ? A.vals[i] : r_ref;
        r_test = A.ids[i] == test_id ? A.vals[i] : r_test;
    }
    *margin = r_ref - r_test;
    if (worst >= 0)
        *err = worst;
    *shown = v_test >= v_ref;   /* false when either is not held */
    out_pair_free(&A, &B);
    return rc;
}
