/* series.c — what the plots draw, read from two recordings: the row error
 * of one stage over layers x positions, and per generated step the KL
 * divergence and logit margins of both runs. Reads go through cmp_source
 * in blocks of positions, so memory is bounded by the block and the grid,
 * never by the recordings. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "report.h"

/* ------------------------------------------------------------------ */
/* Row errors                                                           */

/* max |t - r| over a row (relative: over max |r| of the row, as the
 * cross-runtime compare weighs it); 0 when the bits are equal; +inf when
 * one side is NaN or infinite and the other is not the same kind. */
static double row_error(const float *t, const float *r, int n, bool relative, bool *nonfinite)
{
    if (!memcmp(t, r, (size_t)n * sizeof *t))
        return 0;
    double m = 0, scale = 0;
    for (int i = 0; i < n; i++) {
        const float a = t[i], b = r[i];
        if (isnan(a) && isnan(b))
            continue;
        if (!isfinite(a) || !isfinite(b)) {
            if (a == b)
                continue;
            *nonfinite = true;
            return INFINITY;
        }
        const double d = fabs((double)a - (double)b);
        if (d > m)
            m = d;
        if (fabs((double)b) > scale)
            scale = fabs((double)b);
    }
    if (!relative || m == 0)
        return m;
    return scale > 0 ? m / scale : INFINITY;
}

typedef struct {
    float *ref, *test;           /* block x cols */
    uint64_t *href, *htest;      /* block */
    int block;
} row_bufs;

static void bufs_free(row_bufs *b)
{
    free(b->ref);
    free(b->test);
    free(b->href);
    free(b->htest);
    memset(b, 0, sizeof *b);
}

/* Hashes of n rows of a source: its own fingerprints, or XXH3 of its rows
 * (the dump format's fingerprint) when it holds rows. */
static int read_hashes(const cmp_source *s, int layer, kv_stage st, int64_t p, int64_t n,
                       int cols, float *rows, uint64_t *h, kv_err *e)
{
    if (!s->read)
        return s->read_hash(s->ctx, layer, st, p, n, h, e);
    if (s->read(s->ctx, layer, st, p, n, rows, e) < 0)
        return -1;
    for (int64_t i = 0; i < n; i++)
        h[i] = XXH3_64bits(rows + i * cols, (size_t)cols * sizeof(float));
    return 0;
}

static int grid_layer(const cmp_source *ref, const cmp_source *test, int layer, int64_t lo,
                      int64_t hi, int cols, report_grid *g, row_bufs *b, kv_err *e)
{
    const bool hashed = !ref->read || !test->read;
    const size_t need = (size_t)b->block * (size_t)cols;
    float *nr = realloc(b->ref, need * sizeof(float)), *nt;
    if (nr)
        b->ref = nr;
    nt = nr ? realloc(b->test, need * sizeof(float)) : NULL;
    if (nt)
        b->test = nt;
    if (!nr || !nt)
        return kv_errf(e, "report: out of memory for %d rows of %d floats", b->block, cols);
    if (hashed)
        g->hashed = true;
    for (int64_t p = lo; p <= hi; p += b->block) {
        const int64_t n = hi - p + 1 < b->block ? hi - p + 1 : b->block;
        double *out = g->err + (size_t)layer * (size_t)g->n_pos + (size_t)(p - g->pos_lo);
        if (hashed) {
            if (read_hashes(ref, layer, g->stage, p, n, cols, b->ref, b->href, e) < 0 ||
                read_hashes(test, layer, g->stage, p, n, cols, b->test, b->htest, e) < 0)
                return -1;
            for (int64_t i = 0; i < n; i++)
                out[i] = b->href[i] == b->htest[i] ? 0 : 1;
        } else {
            if (ref->read(ref->ctx, layer, g->stage, p, n, b->ref, e) < 0 ||
                test->read(test->ctx, layer, g->stage, p, n, b->test, e) < 0)
                return -1;
            for (int64_t i = 0; i < n; i++)
                out[i] = row_error(b->test + i * cols, b->ref + i * cols, cols,
                                   g->units == REPORT_UNITS_REL, &g->any_nonfinite);
        }
        g->rows += n;
    }
    return 0;
}

typedef struct {
    int64_t lo, hi;              /* overlap, lo > hi: none */
    int cols;
} layer_span;

/* Where both sources hold (layer, st) with the same width. */
static layer_span overlap(const cmp_source *ref, const cmp_source *test, int layer, kv_stage st)
{
    layer_span s = {0, -1, 0};
    int64_t fr, rr, ft, rt;
    int cr = 0, ct = 0;
    if (ref->info(ref->ctx, layer, st, &fr, &rr, &cr) != 0 ||
        test->info(test->ctx, layer, st, &ft, &rt, &ct) != 0 || rr <= 0 || rt <= 0)
        return s;
    /* fingerprint-only sources report the hash dataset: take the other's width */
    if (!ref->read)
        cr = ct;
    if (!test->read)
        ct = cr;
    if (cr != ct || cr <= 0)
        return s;
    s.lo = fr > ft ? fr : ft;
    s.hi = fr + rr < ft + rt ? fr + rr - 1 : ft + rt - 1;
    s.cols = cr;
    return s;
}

static int grid_build(const cmp_source *ref, const cmp_source *test, kv_stage st,
                      report_units units, int block_rows, report_grid *g, kv_err *e)
{
    memset(g, 0, sizeof *g);
    g->stage = st;
    g->units = units;
    if ((int)st < 0 || st >= STAGE_LAYER_COUNT)
        return kv_errf(e, "report: '%s' is not a layer stage", stage_name(st));
    const int L = ref->cfg.n_layers;
    if (L <= 0 || L > KV_MAX_LAYERS)
        return kv_errf(e, "%s: no layers in the model config", ref->label ? ref->label : "ref");
    layer_span span[KV_MAX_LAYERS];
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int l = 0; l < L; l++) {
        span[l] = overlap(ref, test, l, st);
        if (span[l].lo <= span[l].hi) {
            lo = span[l].lo < lo ? span[l].lo : lo;
            hi = span[l].hi > hi ? span[l].hi : hi;
        }
    }
    g->n_layers = L;
    if (lo > hi)
        return 0;   /* nothing in common: an empty grid */
    g->pos_lo = lo;
    g->n_pos = hi - lo + 1;
    g->err = malloc((size_t)L * (size_t)g->n_pos * sizeof *g->err);
    if (!g->err)
        return kv_errf(e, "report: out of memory for a %d x %lld grid", L, (long long)g->n_pos);
    for (size_t i = 0; i < (size_t)L * (size_t)g->n_pos; i++)
        g->err[i] = NAN;
    row_bufs b = {.block = block_rows > 0 ? (block_rows < 4096 ? block_rows : 4096) : 64};
    b.href = malloc((size_t)b.block * sizeof *b.href);
    b.htest = malloc((size_t)b.block * sizeof *b.htest);
    int rc = b.href && b.htest ? 0 : kv_errf(e, "report: out of memory");
    for (int l = 0; rc == 0 && l < L; l++)
        if (span[l].lo <= span[l].hi)
            rc = grid_layer(ref, test, l, span[l].lo, span[l].hi, span[l].cols, g, &b, e);
    bufs_free(&b);
    return rc;
}

int report_grid_build(const cmp_source *ref, const cmp_source *test, kv_stage st,
                      int block_rows, report_grid *g, kv_err *e)
{
    return grid_build(ref, test, st, REPORT_UNITS_ABS, block_rows, g, e);
}

int report_grid_build_rel(const cmp_source *ref, const cmp_source *test, kv_stage st,
                          int block_rows, report_grid *g, kv_err *e)
{
    return grid_build(ref, test, st, REPORT_UNITS_REL, block_rows, g, e);
}

void report_grid_free(report_grid *g)
{
    if (!g)
        return;
    free(g->err);
    memset(g, 0, sizeof *g);
}

double report_grid_at(const report_grid *g, int layer, int64_t pos)
{
    if (!g->err || layer < 0 || layer >= g->n_layers || pos < g->pos_lo ||
        pos >= g->pos_lo + g->n_pos)
        return NAN;
    return g->err[(size_t)layer * (size_t)g->n_pos + (size_t)(pos - g->pos_lo)];
}

/* ------------------------------------------------------------------ */
/* Units of a cross-runtime verdict                                     */

/* The drift model's threshold is a row's own: it grows with what flowed
 * in from upstream and with the stage's recent drift (compare.h, cmp_xrt).
 * Only the walk knows it, so the comparison is run again with a callback
 * (cmp_opts.xrt_row) that hands each judged row's error and threshold
 * over; the ratios land in judged[i], one per grid. */
typedef struct {
    report_grid *const *g;
    double **judged;             /* (n)(n_layers, n_pos); NaN: not judged */
    int n;
} xrt_rows;

/* err / threshold; a threshold of 0 (key counts: any difference is a
 * step) gives 0 or +inf. */
static double ratio(double err, double thr)
{
    if (isnan(err))
        return NAN;
    if (thr > 0)
        return err / thr;
    return err > 0 ? INFINITY : 0;
}

static void on_xrt_row(void *ctx, int layer, kv_stage st, int64_t pos, double err, double thr)
{
    xrt_rows *x = ctx;
    for (int i = 0; i < x->n; i++) {
        const report_grid *g = x->g[i];
        if (g->stage != st || layer < 0 || layer >= g->n_layers || pos < g->pos_lo ||
            pos >= g->pos_lo + g->n_pos)
            continue;
        x->judged[i][(size_t)layer * (size_t)g->n_pos + (size_t)(pos - g->pos_lo)] =
            ratio(err, thr);
    }
}

static bool same_outcome(const cmp_result *a, const cmp_result *b)
{
    return a->verdict == b->verdict && a->xrt.on && b->xrt.on &&
           a->first.found == b->first.found &&
           (!a->first.found || (a->first.pos == b->first.pos &&
                                a->first.layer == b->first.layer &&
                                a->first.stage == b->first.stage));
}

/* Grid g (row-relative errors) into threshold units: judged rows as the
 * walk judged them, the others over the threshold their (layer, stage)
 * had where the walk stopped (NaN when it never judged one). */
static void to_threshold(report_grid *g, const double *judged, const cmp_result *r)
{
    for (int l = 0; l < g->n_layers; l++) {
        const cmp_stage_result *sr = cmp_result_stage(r, l, g->stage);
        const double frozen = sr && sr->xrt_threshold > 0 ? sr->xrt_threshold : NAN;
        for (int64_t p = 0; p < g->n_pos; p++) {
            const size_t at = (size_t)l * (size_t)g->n_pos + (size_t)p;
            if (!isnan(judged[at]))
                g->err[at] = judged[at];
            else if (!isnan(g->err[at]))
                g->err[at] = sr && sr->stage == STAGE_ATTN_NKEYS ? ratio(g->err[at], 0)
                                                                 : g->err[at] / frozen;
        }
    }
    g->units = REPORT_UNITS_THRESHOLD;
}

int report_grids_to_threshold(const cmp_source *ref, const cmp_source *test,
                              const cmp_result *r, report_grid *const *g, int n,
                              int block_rows, kv_err *e)
{
    if (!r->xrt.on || n <= 0)
        return 0;
    double *judged[REPORT_MAX_GRIDS] = {0};
    xrt_rows x = {.g = g, .judged = judged, .n = n < REPORT_MAX_GRIDS ? n : REPORT_MAX_GRIDS};
    int rc = 0;
    for (int i = 0; rc == 0 && i < x.n; i++) {
        const size_t cells = (size_t)g[i]->n_layers * (size_t)g[i]->n_pos;
        judged[i] = malloc((cells ? cells : 1) * sizeof *judged[i]);
        if (!judged[i])
            rc = kv_errf(e, "report: out of memory");
        for (size_t k = 0; judged[i] && k < cells; k++)
            judged[i][k] = NAN;
    }
    cmp_opts co;
    cmp_opts_default(&co);
    co.cross_runtime = CMP_XRT_ON;
    co.force = true;             /* r was made: its refusals were passed */
    co.block_rows = block_rows;
    co.xrt_row = on_xrt_row;
    co.xrt_row_ctx = &x;
    cmp_result fresh;
    memset(&fresh, 0, sizeof fresh);
    if (rc == 0)
        rc = cmp_compare(ref, test, &co, &fresh, e);
    if (rc == 0 && same_outcome(r, &fresh))
        for (int i = 0; i < x.n; i++)
            if (g[i]->units == REPORT_UNITS_REL && g[i]->err)
                to_threshold(g[i], judged[i], &fresh);
    cmp_result_free(&fresh);
    for (int i = 0; i < x.n; i++)
        free(judged[i]);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Generated steps                                                      */

enum { STEP_BLOCK = 64 };

typedef struct {
    float lse[STEP_BLOCK];
    int32_t *ids;
    float *vals;
} out_block;

int report_steps_build(const cmp_source *ref, const cmp_source *test, report_step **steps,
                       int64_t *n_steps, kv_err *e)
{
    *steps = NULL;
    *n_steps = 0;
    int64_t fr, rr, ft, rt;
    int kr, kt;
    if (!ref->output_info || !test->output_info || !ref->output || !test->output ||
        ref->output_info(ref->ctx, &fr, &rr, &kr) != 0 ||
        test->output_info(test->ctx, &ft, &rt, &kt) != 0 || rr <= 0 || rt <= 0 || kr < 1 ||
        kt < 1)
        return 0;
    int64_t lo = fr > ft ? fr : ft;
    const int64_t hi = fr + rr < ft + rt ? fr + rr - 1 : ft + rt - 1;
    const int64_t first = ref->prompt_length > 0 ? ref->prompt_length - 1 : lo;
    lo = lo > first ? lo : first;
    if (lo > hi)
        return 0;
    const int k = kr < kt ? kr : kt;
    out_block A = {.ids = malloc((size_t)STEP_BLOCK * kr * sizeof(int32_t)),
                   .vals = malloc((size_t)STEP_BLOCK * kr * sizeof(float))};
    out_block B = {.ids = malloc((size_t)STEP_BLOCK * kt * sizeof(int32_t)),
                   .vals = malloc((size_t)STEP_BLOCK * kt * sizeof(float))};
    report_step *s = malloc((size_t)(hi - lo + 1) * sizeof *s);
    int rc = (A.ids && A.vals && B.ids && B.vals && s) ? 0 : kv_errf(e, "report: out of memory");
    for (int64_t p = lo; rc == 0 && p <= hi; p += STEP_BLOCK) {
        const int64_t n = hi - p + 1 < STEP_BLOCK ? hi - p + 1 : STEP_BLOCK;
        if (ref->output(ref->ctx, p, n, A.lse, A.ids, A.vals, e) < 0 ||
            test->output(test->ctx, p, n, B.lse, B.ids, B.vals, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t i = 0; i < n; i++) {
            const int32_t *ir = A.ids + i * kr, *it = B.ids + i * kt;
            const float *vr = A.vals + i * kr, *vt = B.vals + i * kt;
            report_step *o = &s[p + i - lo];
            o->pos = p + i;
            o->step = p + i - first;
            o->kl = cmp_kl_topk(A.lse[i], ir, vr, B.lse[i], it, vt, k);
            o->ref_margin = kr >= 2 ? (double)vr[0] - (double)vr[1] : NAN;
            o->test_margin = kt >= 2 ? (double)vt[0] - (double)vt[1] : NAN;
            o->ref_top1 = ir[0];
            o->test_top1 = it[0];
        }
    }
    free(A.ids);
    free(A.vals);
    free(B.ids);
    free(B.vals);
    if (rc < 0) {
        free(s);
        return -1;
    }
    *steps = s;
    *n_steps = hi - lo + 1;
    return 0;
}
