/* crossrt.c — cross-runtime verdicts. When the test recording comes from
 * another runtime (llama.cpp, PyTorch), its rounding differs from ours in
 * every row, so the first differing bit says nothing. Each row is judged
 * instead against a drift model (compare.h, cmp_xrt): a correct runtime's
 * error is born small at known places (the KV cache's storage type at the
 * attention output, the runtime's own kernels everywhere at about 1e-3)
 * and grows smoothly from there along positions and layers; a bug is a
 * step, a row whose error is many times what flowed into it and what the
 * same stage showed at the positions before. docs/cross-runtime.md gives
 * the measurements behind the constants. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cmp_internal.h"
#include "dump/settings.h"

/* The model's constants (docs/cross-runtime.md measures them). */
#define XRT_FLOOR_BASE 4e-3   /* kernels' own rounding: llama.cpp's table GELU
                               * alone reaches 1.3e-3 row-relative */
#define XRT_KV_FACTOR 16.0    /* attention output: times the KV type's unit roundoff */
#define XRT_COMPUTE_FACTOR 3.0 /* every stage: times the compute type's unit roundoff
                                * (a row rounded once, from inputs rounded once, by a
                                * scale rounded once: Gemma's embedding in bf16) */
#define XRT_GAIN 8.0          /* times the largest error upstream */
#define XRT_HISTORY 8.0       /* times the stage's own largest recent error */
#define XRT_COARSE_GAIN 4.0   /* both, for a runtime that states it computes in bf16,
                               * f16 or tf32: every op rounds there, the floor's
                               * compute term holds that rounding, and what flows
                               * on grows by at most 2.1x a stage (measured on
                               * gemma3-1b-shape, qwen3-0.6b-shape and
                               * tiny-gemma3-h288, bf16 and f16); at 8
                               * a RoPE bug at layer 4 hid under 8 x the drift
                               * of layers 0-3 (docs/cross-runtime.md) */
#define XRT_ACC_FACTOR 2.0   /* f16-summed attention rows: times the modelled
                              * gap of llama.cpp's f16 accumulator (f16acc.c) */
#define XRT_SYS_NOISE 4.0     /* a row scale is systematic past this x the residual's
                               * noise (structure.c) ... */
#define XRT_SYS_COMPUTE 8.0   /* ... and past this x the compute type's unit roundoff:
                               * a scalar the runtime rounds (Gemma's embedding scale
                               * in bf16: 0.44 U, a norm's 1/rms) scales a whole row
                               * legitimately, by at most 1.5 U measured */
#define XRT_SYS_CONFIRM 3     /* and the stage's next rows (up to this many) show the
                               * same sign above their own noise */
#define XRT_OFFSET_ROWS 64    /* positions the per-channel offset test fits over */
#define XRT_WINDOW 16         /* positions that "recent" covers: a row judged drift
                               * teaches the positions right after it, not every
                               * later one (one early outlier below the floor
                               * must not open the gate for a bug far away) */

/* ------------------------------------------------------------------ */
/* Mode and precision                                                   */

/* kvdiff's own engines, bit-identical by design: between them the first
 * differing bit is the bug, whatever their names. */
static bool ours(const char *engine)
{
    return !strcmp(engine, "reference") || !strcmp(engine, "chunked");
}

bool cmp_xrt_wanted(const cmp_source *ref, const cmp_source *test, const cmp_opts *o,
                    char *why, size_t n)
{
    if (o->cross_runtime == CMP_XRT_OFF || !ref->read || !test->read)
        return false;
    if (o->cross_runtime == CMP_XRT_ON) {
        snprintf(why, n, "asked for (--cross-runtime)");
        return true;
    }
    if (o->atol > 0 || o->rtol > 0 || o->ulp > 0 || o->noise)
        return false;
    if (!ref->engine || !test->engine || !ref->engine[0] || !test->engine[0] ||
        !strcmp(ref->engine, test->engine) || (ours(ref->engine) && ours(test->engine)))
        return false;
    snprintf(why, n, "engines differ: %s vs %s", ref->engine, test->engine);
    return true;
}

/* The type the test's settings name under key, for use
 * (dump/settings.h), or NULL. */
static const set_type *type_named(const cmp_source *test, const char *key, set_type_use use)
{
    char name[32];
    return cmp_settings_str(test, key, name, sizeof name) ? set_type_find(name, use) : NULL;
}

/* The test's KV cache type from its settings ("cache_type", as
 * kvdiff-llama writes it, or "kv_dtype"), and its unit roundoff. An
 * unknown type is taken as the coarsest common one (bf16, q8_0). */
static void kv_precision(const cmp_source *test, cmp_xrt *x)
{
    snprintf(x->kv_precision, sizeof x->kv_precision, "unknown");
    x->kv_eps = 0x1p-8;
    const set_type *t = type_named(test, "cache_type", SET_FOR_CACHE);
    t = t ? t : type_named(test, "kv_dtype", SET_FOR_CACHE);
    if (t) {
        snprintf(x->kv_precision, sizeof x->kv_precision, "%s", t->canon);
        x->kv_eps = t->eps;
    } else if (test->engine && ours(test->engine)) {
        /* kvdiff's own engines keep their caches in f32 */
        snprintf(x->kv_precision, sizeof x->kv_precision, "f32");
        x->kv_eps = 0x1p-24;
    }
    /* llama.cpp's CPU flash attention reads keys and values in f16 whatever
     * the cache holds: measured, its attn_out errs by 2e-3 to 3e-3 with an
     * f32 cache (0.5 of the f32 threshold), as with an f16 one. */
    if (x->kv_eps < 0x1p-11 && cmp_settings_is(test, "flash_attn", "on")) {
        snprintf(x->kv_precision, sizeof x->kv_precision, "f16 (flash)");
        x->kv_eps = 0x1p-11;
    }
}

/* The precision the test computes activations in, from its settings
 * ("compute_dtype", as kvdiff-llama and the Python recorder write it).
 * Not stated: llama.cpp (its CPU backend keeps activations in f32) is
 * f32; any other runtime the coarsest common type, bf16, so that a
 * recording silent about it is not cried wolf over; said so in the
 * output. */
static void compute_precision(const cmp_source *test, cmp_xrt *x)
{
    x->compute_factor = XRT_COMPUTE_FACTOR;
    x->compute_stated = false;
    x->compute_assumed_why[0] = 0;
    const set_type *t = type_named(test, "compute_dtype", SET_FOR_COMPUTE);
    if (t) {
        snprintf(x->compute_precision, sizeof x->compute_precision, "%s", t->canon);
        x->compute_eps = t->eps;
        x->compute_stated = true;
        return;
    }
    if (test->engine && ours(test->engine)) {
        snprintf(x->compute_precision, sizeof x->compute_precision, "f32");
        x->compute_eps = 0x1p-24;
        snprintf(x->compute_assumed_why, sizeof x->compute_assumed_why,
                 "kvdiff's own engines compute in f32");
        return;
    }
    if (cmp_settings_is(test, "runtime", "llama.cpp") ||
        (test->engine && !strcmp(test->engine, "llama.cpp"))) {
        snprintf(x->compute_precision, sizeof x->compute_precision, "f32");
        x->compute_eps = 0x1p-24;
        snprintf(x->compute_assumed_why, sizeof x->compute_assumed_why,
                 "llama.cpp's CPU backend keeps activations in f32");
        return;
    }
    snprintf(x->compute_precision, sizeof x->compute_precision, "bf16");
    x->compute_eps = 0x1p-8;
    snprintf(x->compute_assumed_why, sizeof x->compute_assumed_why,
             "the coarsest common type, so as not to cry wolf");
}

double cmp_xrt_compute_term(const cmp_xrt *m)
{
    return m->compute_factor * m->compute_eps;
}

/* ------------------------------------------------------------------ */
/* Reading: one record and one error per (stage, position)              */

/* A stage's per-channel offset test over its first positions: a step at
 * `first` where it holds. */
typedef struct {
    int64_t first;
    cmp_offsetfit fit;
    double threshold;            /* the offset's part must be above it */
    bool steps;
} xrt_off;

/* A row's scale fit, kept small: one per (stage, position). */
typedef struct {
    float dev, noise;            /* cmp_scalefit's */
    bool ok;                     /* fitted, and every column group sees the scale */
} xrt_fit;

typedef struct {
    cmp_ctx *c;
    int n;                       /* stages */
    int64_t base, P;             /* positions base .. base + P - 1 */
    cmp_rowrec *recs;            /* (n, P) */
    double *err;                 /* (n, P): row-relative error, +inf for NaN/Inf */
    bool *kv_rounds;             /* (n): kv_rounds_here */
    float *acc_gap;              /* (n, P): f16acc.c's modelled gap, or NULL */
    xrt_fit *fit;                /* (n, P): each row's scale fit (structure.c) */
    xrt_off *off;                /* (n): each stage's per-channel offset test */
    double *out_err;             /* (P): /output's error (cmp_output_errors), NaN none */
    double *map_part, *map_noise;/* (P): /output's map part and residual (cmp_output_map) */
    int64_t map_at;              /* where a significant map steps (-1 none) */
    double *rot_tried;           /* (n): the largest error a stage's rows were tried
                                  * as a rotation at (0 none) */
} xrt_walk;

/* Stages whose rows are vectors a map can act on: not per-head
 * statistics or key counts. */
static bool fit_stage(kv_stage st)
{
    return st != STAGE_ATTN_NORM_STATS && st != STAGE_FFN_NORM_STATS && st != STAGE_ATTN_LSE &&
           st != STAGE_ATTN_NKEYS && st != STAGE_ATTN_SINK;
}

static int read_stage(xrt_walk *x, int i, float *ta, float *rb, int64_t cap, kv_err *e)
{
    const cmp_stage_result *sr = &x->c->r->stages[i];
    const cmp_tol exact = {.exact = true};
    for (int64_t p = sr->pos_lo; p <= sr->pos_hi; p += cap) {
        const int64_t m = sr->pos_hi - p + 1 < cap ? sr->pos_hi - p + 1 : cap;
        if (x->c->test->read(x->c->test->ctx, sr->layer, sr->stage, p, m, ta, e) < 0 ||
            x->c->ref->read(x->c->ref->ctx, sr->layer, sr->stage, p, m, rb, e) < 0)
            return -1;
        for (int64_t k = 0; k < m; k++) {
            const size_t at = (size_t)i * (size_t)x->P + (size_t)(p + k - x->base);
            cmp_rowrec *rec = &x->recs[at];
            cmp_row_compare(ta + k * sr->cols, rb + k * sr->cols, sr->cols, &exact, rec);
            x->err[at] = rec->nonfinite ? INFINITY : cmp_rowrec_rel(rec);
            if (fit_stage(sr->stage) && !rec->bitequal) {
                cmp_scalefit f;
                cmp_row_scale_fit(ta + k * sr->cols, rb + k * sr->cols, sr->cols, &f);
                x->fit[at] = (xrt_fit){.dev = (float)f.dev, .noise = (float)f.noise,
                                       .ok = f.fitted && f.groups_agree};
            }
        }
    }
    return 0;
}

static int read_all(xrt_walk *x, kv_err *e)
{
    int maxc = 1;
    for (int i = 0; i < x->n; i++)
        maxc = x->c->r->stages[i].cols > maxc ? x->c->r->stages[i].cols : maxc;
    int64_t cap = CMP_ROW_BUDGET / maxc;
    cap = cap < 1 ? 1 : cap > x->P ? x->P : cap;
    float *ta = malloc((size_t)cap * (size_t)maxc * sizeof *ta);
    float *rb = malloc((size_t)cap * (size_t)maxc * sizeof *rb);
    int rc = ta && rb ? 0 : kv_errf(e, "compare: out of memory");
    for (int i = 0; rc == 0 && i < x->n; i++)
        rc = read_stage(x, i, ta, rb, cap, e);
    free(ta);
    free(rb);
    return rc;
}

/* The per-channel offset test of stage i over its first positions (up to
 * XRT_OFFSET_ROWS), q and k with RoPE undone (a bias acts before the
 * rotation). A step where the offsets' part is above 4 x the residual's
 * noise, 8 x the compute type's unit roundoff and gain x the largest
 * error upstream over those positions (an error flowing in from a key
 * every query reads, an attention sink's, is near constant too), with an
 * eighth of the channels or more each 8 standard errors off. */
static int offset_stage(xrt_walk *x, int i, float *ta, float *rb, double *u, kv_err *e)
{
    const cmp_stage_result *sr = &x->c->r->stages[i];
    xrt_off *o = &x->off[i];
    o->first = sr->pos_lo > x->base ? sr->pos_lo : x->base;
    const int64_t last = sr->pos_hi < x->base + x->P - 1 ? sr->pos_hi : x->base + x->P - 1;
    const int64_t W = last - o->first + 1 < XRT_OFFSET_ROWS ? last - o->first + 1
                                                            : XRT_OFFSET_ROWS;
    if (!fit_stage(sr->stage) || W < CMP_OFFSET_MIN_ROWS || sr->cols < CMP_FIT_MIN_COLS)
        return 0;
    const int n = sr->cols;
    if (x->c->test->read(x->c->test->ctx, sr->layer, sr->stage, o->first, W, ta, e) < 0 ||
        x->c->ref->read(x->c->ref->ctx, sr->layer, sr->stage, o->first, W, rb, e) < 0)
        return -1;
    if (sr->stage == STAGE_Q || sr->stage == STAGE_K) {
        const int D = config_layer_head_dim(x->c->cfg, sr->layer);
        for (int64_t p = 0; p < W; p++)
            for (int k = 0; k < 2; k++) {
                float *row = (k ? ta : rb) + p * n;
                cmp_rope_unrotate(x->c->cfg, sr->layer, o->first + p, row, n / D, u);
                for (int j = 0; j < n; j++)
                    row[j] = (float)u[j];
            }
    }
    cmp_channel_offset_fit(ta, rb, (int)W, n, &o->fit);
    if (!o->fit.fitted)
        return 0;
    double upstream = 0;
    for (int64_t p = o->first; p < o->first + W; p++)
        for (int j = 0; j < i; j++)
            upstream = fmax(upstream, x->err[(size_t)j * (size_t)x->P + (size_t)(p - x->base)]);
    const cmp_xrt *m = &x->c->r->xrt;
    o->threshold = fmax(fmax(XRT_SYS_NOISE * o->fit.noise, XRT_SYS_COMPUTE * m->compute_eps),
                        m->gain * upstream);
    o->steps = o->fit.part > o->threshold && o->fit.significant >= 2 &&
               o->fit.significant * 8 >= o->fit.channels;
    return 0;
}

static int offset_all(xrt_walk *x, kv_err *e)
{
    int maxc = 1;
    for (int i = 0; i < x->n; i++)
        maxc = x->c->r->stages[i].cols > maxc ? x->c->r->stages[i].cols : maxc;
    float *ta = malloc((size_t)XRT_OFFSET_ROWS * (size_t)maxc * sizeof *ta);
    float *rb = malloc((size_t)XRT_OFFSET_ROWS * (size_t)maxc * sizeof *rb);
    double *u = malloc((size_t)maxc * sizeof *u);
    int rc = ta && rb && u ? 0 : kv_errf(e, "compare: out of memory");
    for (int i = 0; rc == 0 && i < x->n; i++)
        rc = offset_stage(x, i, ta, rb, u, e);
    free(ta);
    free(rb);
    free(u);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Judging                                                              */

/* The floor of a stage; kv_rounds: the KV cache's rounding shows first
 * here (kv_rounds_here); acc_gap: the row's modelled f16 summation gap
 * (f16acc.c; 0 none), allowed instead where it is the larger. */
static double floor_of(const cmp_xrt *m, bool kv_rounds, double acc_gap)
{
    const double base = m->floor_base + cmp_xrt_compute_term(m);
    if (!kv_rounds)
        return base;
    const double kv = m->kv_factor * m->kv_eps, acc = m->acc_factor * acc_gap;
    return base + (acc > kv ? acc : kv);
}

static bool after_attention(kv_stage st)
{
    return st >= STAGE_ATTN_OUT && st < STAGE_LAYER_COUNT;
}

/* Whether stage i is where the KV cache's rounding first shows: attn_lse
 * and attn_out; in a layer the compare holds no attn_out of, the first
 * stage after it that it holds (attn_proj). A runtime need not give
 * attn_out: llama.cpp rotates a quantized V cache whose head_dim is a
 * multiple of 64, and its recorder then leaves attn_out out. Measured,
 * a q8_0 cache then errs by 5.5e-3 to 5.9e-3 at attn_proj, above the
 * kernels' floor alone, from position 0 on (docs/cross-runtime.md). */
static bool kv_rounds_here(const cmp_result *r, int i)
{
    const cmp_stage_result *sr = &r->stages[i];
    if (sr->layer < 0)
        return false;
    if (sr->stage == STAGE_ATTN_LSE || sr->stage == STAGE_ATTN_SINK ||
        sr->stage == STAGE_ATTN_OUT)
        return true;
    if (!after_attention(sr->stage))
        return false;
    for (int j = 0; j < i; j++)
        if (r->stages[j].layer == sr->layer && after_attention(r->stages[j].stage))
            return false;
    return true;
}

/* Threshold of stage i at a position: upstream is the largest error of
 * the stages before it at this same position (earlier layers, earlier
 * stages of its layer), own its largest error over the XRT_WINDOW
 * positions before. Key counts are integers: any difference is a step. */
static double threshold(const cmp_xrt *m, const cmp_stage_result *sr, bool kv_rounds,
                        double acc_gap, double upstream, double own)
{
    if (sr->stage == STAGE_ATTN_NKEYS)
        return 0;
    double t = floor_of(m, kv_rounds, acc_gap);
    t = m->gain * upstream > t ? m->gain * upstream : t;
    return m->history * own > t ? m->history * own : t;
}

/* The step's row, read again: the lowest column above the threshold. */
static int fill_step(xrt_walk *x, int i, int64_t p, double thr, kv_err *e)
{
    cmp_ctx *c = x->c;
    const cmp_stage_result *sr = &c->r->stages[i];
    const cmp_rowrec *rec = &x->recs[(size_t)i * (size_t)x->P + (size_t)(p - x->base)];
    cmp_divergence *d = &c->r->first;
    memset(d, 0, sizeof *d);
    d->found = true;
    d->pos = p;
    d->layer = sr->layer;
    d->stage = sr->stage;
    d->row_max_abs = rec->max_abs;
    d->row_rel = x->err[(size_t)i * (size_t)x->P + (size_t)(p - x->base)];
    if (sr->layer >= 0) {
        d->layer_window = config_layer_window(c->cfg, sr->layer);
        d->layer_sliding = d->layer_window > 0;
        d->kv_owner = c->cfg->kv_owner[sr->layer];
    }
    float *t = malloc((size_t)sr->cols * 2 * sizeof *t);
    if (!t)
        return kv_errf(e, "compare: out of memory");
    float *r = t + sr->cols;
    if (c->test->read(c->test->ctx, sr->layer, sr->stage, p, 1, t, e) < 0 ||
        c->ref->read(c->ref->ctx, sr->layer, sr->stage, p, 1, r, e) < 0) {
        free(t);
        return -1;
    }
    const double lim = thr * rec->ref_absmax;
    int col = -1;
    for (int k = 0; k < sr->cols; k++) {
        const bool nf = cmp_elem_nonfinite_mismatch(t[k], r[k]);
        d->nonfinite |= nf;
        if (nf || fabs((double)t[k] - (double)r[k]) > lim) {
            d->n_bad++;
            col = col < 0 ? k : col;
        }
    }
    if (col < 0) {
        /* No single element is above the threshold: the attention check's
         * step on the row's RMS (attn_audit.c). Point at the largest
         * difference, and count the elements that differ at all. */
        double big = -1;
        for (int k = 0; k < sr->cols; k++) {
            const double dk = fabs((double)t[k] - (double)r[k]);
            d->n_bad += dk > 0;
            if (dk > big) {
                big = dk;
                col = k;
            }
        }
    }
    cmp_set_element(d, c->cfg, col);
    d->test = t[col];
    d->ref = r[col];
    const bool nf = cmp_elem_nonfinite_mismatch(d->test, d->ref);
    d->abs_err = nf ? NAN : fabs((double)d->test - (double)d->ref);
    d->ulp = nf ? 0 : cmp_ulp_distance(d->test, d->ref);
    free(t);
    /* Earlier stages of the layer at this position: compared, bit-identical. */
    for (int j = 0; j < i; j++) {
        const cmp_stage_result *sj = &c->r->stages[j];
        if (sj->layer != sr->layer || p < sj->pos_lo || p > sj->pos_hi)
            continue;
        c->r->ev.earlier_compared |= 1u << sj->stage;
        if (x->recs[(size_t)j * (size_t)x->P + (size_t)(p - x->base)].bitequal)
            c->r->ev.earlier_identical |= 1u << sj->stage;
    }
    return 0;
}

/* The largest error of stage i over the XRT_WINDOW positions before p
 * (all of them judged drift: the walk stops at the first step). */
static double recent(const xrt_walk *x, const cmp_stage_result *sr, int i, int64_t p)
{
    int64_t lo = p - XRT_WINDOW;
    lo = lo > sr->pos_lo ? lo : sr->pos_lo;
    lo = lo > x->base ? lo : x->base;
    double m = 0;
    for (int64_t q = lo; q < p && q <= sr->pos_hi; q++) {
        const double err = x->err[(size_t)i * (size_t)x->P + (size_t)(q - x->base)];
        m = err > m ? err : m;
    }
    return m;
}

/* The structure test's threshold for a row scale at (i, p): its own
 * noise, scalar rounding in the compute type, what flowed in. */
static double sys_threshold(const xrt_walk *x, size_t at, double upstream)
{
    const cmp_xrt *m = &x->c->r->xrt;
    double t = XRT_SYS_NOISE * x->fit[at].noise;
    t = fmax(t, XRT_SYS_COMPUTE * m->compute_eps);
    return fmax(t, m->gain * upstream);
}

/* Row (i, q) shows a scale of sign `sign` above its noise and scalar
 * rounding: the confirmation a step needs from the stage's next rows. */
static bool sys_row(const xrt_walk *x, int i, int64_t q, double sign)
{
    const xrt_fit *f = &x->fit[(size_t)i * (size_t)x->P + (size_t)(q - x->base)];
    const double u = XRT_SYS_COMPUTE * x->c->r->xrt.compute_eps;
    return f->ok && f->dev * sign > 0 && fabs(f->dev) > XRT_SYS_NOISE * f->noise &&
           fabs(f->dev) > u;
}

/* Is row (i, p) a systematic step: a row scale above sys_threshold that
 * the stage's next rows (up to XRT_SYS_CONFIRM of them) show too? */
static bool sys_steps(xrt_walk *x, cmp_stage_result *sr, int i, int64_t p, double upstream,
                      double *thr)
{
    const size_t at = (size_t)i * (size_t)x->P + (size_t)(p - x->base);
    const xrt_fit *f = &x->fit[at];
    if (!f->ok || sr->stage == STAGE_ATTN_NKEYS)
        return false;
    *thr = sys_threshold(x, at, upstream);
    const double dev = fabs(f->dev), ratio = *thr > 0 ? dev / *thr : 0;
    if (!(dev > *thr)) {
        cmp_xrt *m = &x->c->r->xrt;
        sr->xrt_sys = fmax(sr->xrt_sys, dev);
        sr->xrt_sys_ratio = fmax(sr->xrt_sys_ratio, ratio);
        if (ratio > m->sys_worst_ratio) {
            m->sys_worst_ratio = ratio;
            m->sys_worst_pos = p;
            m->sys_worst_layer = sr->layer;
            m->sys_worst_stage = sr->stage;
        }
        return false;
    }
    const double sign = f->dev > 0 ? 1 : -1;
    for (int64_t q = p + 1; q <= p + XRT_SYS_CONFIRM && q <= sr->pos_hi &&
                            q < x->base + x->P; q++)
        if (!sys_row(x, i, q, sign))
            return false;
    sr->xrt_sys = fmax(sr->xrt_sys, dev);
    return true;
}

/* Whether the fitted map's parameter is another than the config's by
 * more than a rounding of it in the compute type could make. */
static bool map_differs(const cmp_xrt *m)
{
    const double u = XRT_SYS_COMPUTE * m->compute_eps;
    if (m->map_kind == CMP_MAP_SCALE)
        return fabs(m->map_param - 1) > u;
    if (m->map_kind != CMP_MAP_SOFTCAP)
        return false;
    /* a cap far above every logit fitted is none, as far as the data tell */
    const bool none = isinf(m->map_param) || m->map_param > 10 * m->map_zmax;
    if (none || !(m->map_config_cap > 0))
        return none != !(m->map_config_cap > 0);
    return fabs(m->map_param / m->map_config_cap - 1) > u;
}

/* Is /output at p, drift by its size, where a map of the reference's
 * logits (a softcap, a scale) of another parameter than the config's
 * explains the run significantly (map_significant, set once), the step?
 * At the first position where the map's part is above the residual it
 * leaves (map_at), or the first it was fitted at where the noise hides it
 * at every one: the evidence is the run's, not a row's. What flowed in
 * from upstream is in the residual. */
static bool map_steps(const xrt_walk *x, int64_t p, double *thr, double *err)
{
    cmp_xrt *m = &x->c->r->xrt;
    const int64_t i = p - x->base;
    if (!x->map_part || !m->map_significant || i != x->map_at)
        return false;
    m->map_step = true;
    m->map_part = x->map_part[i];
    m->map_noise = x->map_noise[i];
    *thr = x->map_noise[i];
    *err = x->map_part[i];
    return true;
}

/* Where a significant map steps (map_steps): an index into map_part. */
static int64_t map_first(const xrt_walk *x)
{
    int64_t first = -1;
    for (int64_t i = 0; i < x->P; i++) {
        if (isnan(x->map_part[i]))
            continue;
        if (x->map_part[i] > x->map_noise[i])
            return i;
        first = first < 0 ? i : first;
    }
    return first;
}

/* Is /output at p above drift? Its threshold as any stage's: the floor,
 * gain x the largest error upstream at p, history x its own over the
 * window before. */
static bool output_steps(const xrt_walk *x, int64_t p, double upstream, double *thr,
                         double *err)
{
    if (!x->out_err || isnan(x->out_err[p - x->base]))
        return false;
    double own = 0;
    for (int64_t q = p - XRT_WINDOW > x->base ? p - XRT_WINDOW : x->base; q < p; q++)
        if (!isnan(x->out_err[q - x->base]))
            own = fmax(own, x->out_err[q - x->base]);
    const cmp_stage_result out = {.layer = -1, .stage = STAGE_LOGITS};
    *thr = threshold(&x->c->r->xrt, &out, false, 0, upstream, own);
    *err = x->out_err[p - x->base];
    return !(*err <= *thr) || map_steps(x, p, thr, err);
}

/* Drift by its size, but a rotation (docs/cross-runtime.md, "Structure"):
 * a q or k row whose error is above the plain floor (allowed by what
 * flowed in, or by the stage's own history: a RoPE base or a count of
 * pairs turned otherwise grows from under the floor with the position)
 * is the reference's turned under another convention or count of pairs
 * (rotations.c), that candidate leaving CMP_ROT_GAIN times less than the
 * row's error, here and at the stage's last compared position. Rounding
 * leaves noise no rotation explains. A stage is tried where its error
 * first passes the floor and each time it doubles. The step is then
 * placed where the rotation first shows (first_rotated). 1 a step (m->rot_*
 * set, *at_p, *at_i where it is), 0 none, -1 on error. */
static int first_rotated(xrt_walk *x, int layer, const cmp_rope_conv *cv, int64_t p, int i,
                         int64_t *at_p, int *at_i, double *here, kv_err *e);
static int first_rotated_kind(xrt_walk *x, int layer, const cmp_rope_conv *cv, int64_t p, int i,
                              int64_t *at_p, int *at_i, double *here, kv_err *e);

/* The rotation cv found at (p, stage of sr): the row's error err there and
 * the residual best it leaves; the same at p2 (-1 none); here, what it
 * leaves where the step is placed (NaN: that same row); the size walk's
 * threshold thr there. */
static void rot_found(cmp_xrt *m, const cmp_stage_result *sr, const cmp_rope_conv *cv,
                      int64_t p, double err, double best, int64_t p2, double err2, double best2,
                      double here, double thr)
{
    m->rot_step = true;
    m->rot_pos = p;
    m->rot_stage = sr->stage;
    m->rot_err = err;
    m->rot_resid = best;
    m->rot_pos2 = p2;
    m->rot_err2 = p2 >= 0 ? err2 : NAN;
    m->rot_resid2 = p2 >= 0 ? best2 : NAN;
    m->rot_here_resid = here;
    m->rot_drift_threshold = thr;
    /* what a diagnosis's fit must reach: the rotation's residual, with
     * room, never as loose as the row's error */
    m->rot_threshold = fmin(fmax(4 * best, floor_of(m, false, 0)), err / 2);
    snprintf(m->rot_what, sizeof m->rot_what, "%s", cv->what);
}

static int rot_steps(xrt_walk *x, const cmp_stage_result *sr, int i, int64_t p, double err,
                     double thr, int64_t *at_p, int *at_i, kv_err *e)
{
    cmp_ctx *c = x->c;
    cmp_xrt *m = &c->r->xrt;
    if ((sr->stage != STAGE_Q && sr->stage != STAGE_K) || sr->layer < 0 || p == 0 ||
        !x->rot_tried || !isfinite(err))
        return 0;
    const double floor = floor_of(m, false, 0);
    if (!(err > floor) || err <= 2 * x->rot_tried[i])
        return 0;
    x->rot_tried[i] = err;
    const int D = config_layer_head_dim(c->cfg, sr->layer);
    if (D < 4 || sr->cols % D)
        return 0;
    int64_t p2 = sr->pos_hi;
    if (c->pos_limit >= 0 && p2 >= c->pos_limit)
        p2 = c->pos_limit - 1;
    float *rows = malloc((size_t)sr->cols * 4 * sizeof *rows);
    if (!rows)
        return kv_errf(e, "compare: out of memory");
    float *t = rows, *r = rows + sr->cols, *t2 = r + sr->cols, *r2 = t2 + sr->cols;
    int rc = 0;
    if (c->test->read(c->test->ctx, sr->layer, sr->stage, p, 1, t, e) < 0 ||
        c->ref->read(c->ref->ctx, sr->layer, sr->stage, p, 1, r, e) < 0 ||
        (p2 > p && (c->test->read(c->test->ctx, sr->layer, sr->stage, p2, 1, t2, e) < 0 ||
                    c->ref->read(c->ref->ctx, sr->layer, sr->stage, p2, 1, r2, e) < 0)))
        rc = -1;
    cmp_rope_conv cv;
    const double best = rc == 0 ? cmp_rope_best_fit(c->cfg, sr->layer, p, r, t, sr->cols / D, &cv)
                                : INFINITY;
    bool steps = rc == 0 && best <= err / CMP_ROT_GAIN && best <= thr;
    double best2 = NAN, err2 = NAN;
    if (steps && p2 > p) {
        err2 = x->err[(size_t)i * (size_t)x->P + (size_t)(p2 - x->base)];
        best2 = cmp_rope_conv_err(c->cfg, sr->layer, &cv, p2, r2, t2, sr->cols / D);
        steps = best2 <= err2 / CMP_ROT_GAIN || best2 <= floor;
    }
    free(rows);
    if (rc < 0 || !steps)
        return rc;
    double here;
    if (first_rotated_kind(x, sr->layer, &cv, p, i, at_p, at_i, &here, e) < 0)
        return -1;
    rot_found(m, sr, &cv, p, err, best, p2 > p ? p2 : -1, err2, best2, here, thr);
    return 1;
}

/* The first (position, stage) of layer's q and k, from position 1 up to
 * (p, i), where the rotation cv explains the row: it leaves CMP_ROT_BACK
 * times less than the row differs (the candidate is fixed, found by the
 * search at p and checked at the last position: a gain that would not
 * single it out of many tells whether it acts here). The bug acts there,
 * however far under the floor its first rows were, and *here is what
 * cv leaves there; (p, i) and NaN when none is earlier. */
static int first_rotated(xrt_walk *x, int layer, const cmp_rope_conv *cv, int64_t p, int i,
                         int64_t *at_p, int *at_i, double *here, kv_err *e)
{
    cmp_ctx *c = x->c;
    *at_p = p;
    *at_i = i;
    *here = NAN;
    const int D = config_layer_head_dim(c->cfg, layer);
    int js[2], nj = 0;
    for (int j = 0; j < x->n && nj < 2; j++) {
        const cmp_stage_result *s = &c->r->stages[j];
        if (s->layer == layer && (s->stage == STAGE_Q || s->stage == STAGE_K) && s->cols % D == 0)
            js[nj++] = j;
    }
    const int cols = config_max_q_width(c->cfg);
    float *rows = malloc((size_t)cols * 2 * sizeof *rows);
    if (!rows)
        return kv_errf(e, "compare: out of memory");
    float *t = rows, *r = rows + cols;
    for (int64_t q = 1; q <= p; q++)
        for (int k = 0; k < nj; k++) {
            const cmp_stage_result *s = &c->r->stages[js[k]];
            if ((q == p && js[k] >= i) || q < s->pos_lo || q > s->pos_hi)
                continue;
            const double ident = x->err[(size_t)js[k] * (size_t)x->P + (size_t)(q - x->base)];
            if (!(ident > 0))
                continue;
            if (c->test->read(c->test->ctx, layer, s->stage, q, 1, t, e) < 0 ||
                c->ref->read(c->ref->ctx, layer, s->stage, q, 1, r, e) < 0) {
                free(rows);
                return -1;
            }
            const double res = cmp_rope_conv_err(c->cfg, layer, cv, q, r, t, s->cols / D);
            if (res <= ident / CMP_ROT_BACK) {
                *here = res;
                *at_p = q;
                *at_i = js[k];
                free(rows);
                return 0;
            }
        }
    free(rows);
    return 0;
}

/* Whether layers a and b turn their rows alike (the same kind, head size,
 * base and pairs): a rotation found on one is tried on the other. */
static bool same_rotation(const kv_config *cfg, int a, int b)
{
    return (config_layer_window(cfg, a) > 0) == (config_layer_window(cfg, b) > 0) &&
           config_layer_head_dim(cfg, a) == config_layer_head_dim(cfg, b) &&
           config_layer_rope_pairs(cfg, a) == config_layer_rope_pairs(cfg, b) &&
           config_layer_theta(cfg, a) == config_layer_theta(cfg, b);
}

/* first_rotated over layer and every earlier layer turning its rows as
 * it does: a RoPE setting read wrong acts on every layer of its kind, and
 * a later one, fed the earlier one's changed output, may show it first
 * (a q4_0 cache's noise hides it on layer 3 of tiny-gemma4 at its last
 * position, not on layer 7). The earliest point in the walk's order. */
static int first_rotated_kind(xrt_walk *x, int layer, const cmp_rope_conv *cv, int64_t p, int i,
                              int64_t *at_p, int *at_i, double *here, kv_err *e)
{
    *at_p = p;
    *at_i = i;
    *here = NAN;
    for (int l = 0; l <= layer; l++) {
        if (l != layer && !same_rotation(x->c->cfg, l, layer))
            continue;
        int64_t ap;
        int ai;
        double h;
        if (first_rotated(x, l, cv, p, i, &ap, &ai, &h, e) < 0)
            return -1;
        if (ap < *at_p || (ap == *at_p && ai < *at_i)) {
            *at_p = ap;
            *at_i = ai;
            *here = h;
        }
    }
    return 0;
}

/* A step found (by its size, or as a rotation) may sit downstream of a
 * rotation that stayed under every threshold where it was born: a RoPE
 * bug on a global layer moves that layer's q by a few tenths of a percent
 * at position 1 (under a bf16 or q8_0 floor), while a later layer of the
 * same kind, its input already changed, steps by size at that same
 * position and no rotation explains it there. So every q and k stage is
 * searched at its last compared position, where a rotation has grown
 * largest: a candidate leaving CMP_ROT_GAIN times less than the row's
 * error there, and leaving CMP_ROT_BACK times less at an earlier point
 * than the step (first_rotated), moves the step there. 0, -1 on error. */
static int rot_scan(xrt_walk *x, int64_t *stop, int *stop_i, kv_err *e)
{
    cmp_ctx *c = x->c;
    cmp_xrt *m = &c->r->xrt;
    const double floor = floor_of(m, false, 0);
    float *rows = malloc((size_t)config_max_q_width(c->cfg) * 2 * sizeof *rows);
    if (!rows)
        return kv_errf(e, "compare: out of memory");
    int rc = 0;
    for (int j = 0; j < x->n && rc == 0; j++) {
        const cmp_stage_result *sr = &c->r->stages[j];
        if ((sr->stage != STAGE_Q && sr->stage != STAGE_K) || sr->layer < 0 ||
            (*stop <= 1 && j >= *stop_i))
            continue;
        const int D = config_layer_head_dim(c->cfg, sr->layer);
        int64_t p2 = sr->pos_hi;
        if (c->pos_limit >= 0 && p2 >= c->pos_limit)
            p2 = c->pos_limit - 1;
        if (D < 4 || sr->cols % D || p2 < 1 || p2 < sr->pos_lo)
            continue;
        const double err2 = x->err[(size_t)j * (size_t)x->P + (size_t)(p2 - x->base)];
        if (!(err2 > floor) || !isfinite(err2))
            continue;
        float *t = rows, *r = rows + sr->cols;
        if (c->test->read(c->test->ctx, sr->layer, sr->stage, p2, 1, t, e) < 0 ||
            c->ref->read(c->ref->ctx, sr->layer, sr->stage, p2, 1, r, e) < 0) {
            rc = -1;
            break;
        }
        cmp_rope_conv cv;
        const double best = cmp_rope_best_fit(c->cfg, sr->layer, p2, r, t, sr->cols / D, &cv);
        if (!(best <= err2 / CMP_ROT_GAIN))
            continue;
        int64_t at_p;
        int at_i;
        double here;
        rc = first_rotated_kind(x, sr->layer, &cv, *stop, *stop_i, &at_p, &at_i, &here, e);
        if (rc < 0)
            break;
        if (at_p == *stop && at_i == *stop_i)
            continue;   /* nothing earlier: the step stays */
        /* An earlier point: the step is the rotation's. */
        rot_found(m, sr, &cv, p2, err2, best, -1, NAN, NAN, here, sr->xrt_threshold);
        *stop = at_p;
        *stop_i = at_i;
    }
    free(rows);
    return rc;
}

/* Positions ascending, at each the stages in dataflow order: the first
 * row above its threshold is the step. Rows before it are drift and teach
 * each stage its scale. audit_p, audit_i: the attention check's step
 * (position, stage index; -1 none), which ends the walk when it comes
 * first. */
static int judge(xrt_walk *x, int64_t audit_p, int audit_i, double audit_err, kv_err *e)
{
    cmp_result *r = x->c->r;
    cmp_xrt *m = &r->xrt;
    double *own = calloc((size_t)x->n, sizeof *own);
    if (!own)
        return kv_errf(e, "compare: out of memory");
    /* own[i]: stage i's largest drift over the window before p; rows judged
     * drift only (the step's row teaches nothing) */
    int64_t stop = -1;
    int stop_i = -1;
    double stop_thr = 0, out_err = 0;
    bool out_step = false;
    for (int64_t p = x->base; p < x->base + x->P && stop < 0; p++) {
        double upstream = 0;
        for (int i = 0; i < x->n; i++) {
            cmp_stage_result *sr = &r->stages[i];
            own[i] = recent(x, sr, i, p);
            if (p >= sr->pos_lo && p <= sr->pos_hi) {
                const size_t at = (size_t)i * (size_t)x->P + (size_t)(p - x->base);
                const double err = x->err[at];
                const double thr = threshold(m, sr, x->kv_rounds[i],
                                             x->acc_gap ? x->acc_gap[at] : 0, upstream, own[i]);
                cmp_rowrec *rec = &x->recs[at];
                rec->bad = !(err <= thr);
                /* Drift against the reference, but not attention over the
                 * test's own inputs: the attention check's step. */
                if (!rec->bad && p == audit_p && i == audit_i) {
                    rec->bad = true;
                    m->audit_step = true;
                    m->audit_drift_threshold = thr;
                }
                /* Drift by its size, but an offset per channel from here on
                 * that rounding does not make. */
                if (!rec->bad && p == x->off[i].first && x->off[i].steps) {
                    rec->bad = true;
                    m->off_step = true;
                    m->off_part = x->off[i].fit.part;
                    m->off_noise = x->off[i].fit.noise;
                    m->off_channels = x->off[i].fit.significant;
                    m->sys_threshold = x->off[i].threshold;
                    m->sys_drift_threshold = thr;
                }
                /* Drift by its size, but a scale rounding does not make. */
                double sthr = 0;
                if (!rec->bad && sys_steps(x, sr, i, p, upstream, &sthr)) {
                    rec->bad = true;
                    m->sys_step = true;
                    m->sys_dev = x->fit[at].dev;
                    m->sys_noise = x->fit[at].noise;
                    m->sys_threshold = sthr;
                    m->sys_drift_threshold = thr;
                }
                /* Drift by its size, but a rotation. */
                int64_t rot_p = -1;
                int rot_i = -1;
                if (!rec->bad) {
                    const int rs = rot_steps(x, sr, i, p, err, thr, &rot_p, &rot_i, e);
                    if (rs < 0) {
                        free(own);
                        return -1;
                    }
                    rec->bad = rs == 1;
                }
                sr->xrt_threshold = thr;
                sr->xrt_err = err > sr->xrt_err || isnan(err) ? err : sr->xrt_err;
                if (x->c->o->xrt_row)
                    x->c->o->xrt_row(x->c->o->xrt_row_ctx, sr->layer, sr->stage, p, err, thr);
                cmp_stats_add(&sr->all, rec, p);
                if (rec->bad) {
                    stop = rot_p >= 0 ? rot_p : p;
                    stop_i = rot_p >= 0 ? rot_i : i;
                    stop_thr = m->audit_step ? m->audit_threshold
                               : m->sys_step || m->off_step ? m->sys_threshold
                               : m->rot_step ? m->rot_threshold : thr;
                    break;
                }
                cmp_stats_add(&sr->upto, rec, p);
                const double ratio = thr > 0 ? err / thr : 0;
                if (ratio > sr->xrt_ratio)
                    sr->xrt_ratio = ratio;
                if (ratio > m->worst_ratio) {
                    m->worst_ratio = ratio;
                    m->worst_pos = p;
                    m->worst_layer = sr->layer;
                    m->worst_stage = sr->stage;
                }
                sr->xrt_scale = own[i] > err ? own[i] : err;
                upstream = err > upstream ? err : upstream;
            }
        }
        /* /output last: the final norm, the LM head and the softcap come
         * after every stage; its rows carry no stage of their own */
        if (stop < 0 && output_steps(x, p, upstream, &stop_thr, &out_err)) {
            stop = p;
            out_step = true;
        }
        r->compared.walked_to = p;
    }
    free(own);
    /* A plain size step, or a rotation's: an earlier rotation moves it.
     * No step at all: a rotation may still have grown far above a correct
     * run's error under a floor made wide by a coarse cache (a q4_0
     * cache's noise lets q rows of later layers differ by 0.5 where a RoPE
     * base changed moves them by 1.4): searched the same way from past the
     * last stage walked. */
    const bool none = stop < 0;
    if (none && r->compared.walked_to >= 1) {
        stop = r->compared.walked_to;
        stop_i = x->n;
    }
    if (stop >= 0 && !out_step && !m->audit_step && !m->sys_step && !m->off_step) {
        const int64_t was = stop;
        const int was_i = stop_i;
        if (rot_scan(x, &stop, &stop_i, e) < 0)
            return -1;
        if (stop != was || stop_i != was_i)
            stop_thr = m->rot_threshold;
        else if (none)
            stop = -1;   /* none found: no step */
    }
    if (stop < 0)
        return 0;
    if (out_step) {
        m->step = true;
        m->step_err = out_err;
        m->step_threshold = stop_thr;
        return cmp_output_step(x->c, stop, e);
    }
    m->step = true;
    m->step_err = m->audit_step ? audit_err
                  : m->sys_step ? fabs(m->sys_dev) : m->off_step ? m->off_part
                                : x->err[(size_t)stop_i * (size_t)x->P + (size_t)(stop - x->base)];
    m->step_threshold = stop_thr;
    return fill_step(x, stop_i, stop, stop_thr, e);
}

int cmp_xrt_walk(cmp_ctx *c, kv_err *e)
{
    cmp_result *r = c->r;
    cmp_xrt *m = &r->xrt;
    m->on = true;
    snprintf(m->model, sizeof m->model, "drift-step");
    m->floor_base = XRT_FLOOR_BASE;
    m->kv_factor = XRT_KV_FACTOR;
    m->gain = XRT_GAIN;
    m->history = XRT_HISTORY;
    m->worst_pos = -1;
    m->worst_layer = -1;
    m->sys_on = true;
    m->sys_noise_factor = XRT_SYS_NOISE;
    m->sys_compute_factor = XRT_SYS_COMPUTE;
    m->sys_worst_pos = -1;
    m->sys_worst_layer = -1;
    kv_precision(c->test, m);
    compute_precision(c->test, m);
    if (m->compute_stated && m->compute_eps > 0x1p-20)
        m->gain = m->history = XRT_COARSE_GAIN;
    m->attn_floor = floor_of(m, true, 0);
    r->compared.walked_to = -1;
    xrt_walk x = {.c = c, .n = r->n_stages, .base = r->compared.pos_lo};
    x.P = r->compared.pos_hi - r->compared.pos_lo + 1;
    if (x.n == 0 || x.P <= 0)
        return 0;
    x.recs = calloc((size_t)x.n * (size_t)x.P, sizeof *x.recs);
    x.err = calloc((size_t)x.n * (size_t)x.P, sizeof *x.err);
    x.kv_rounds = calloc((size_t)x.n, sizeof *x.kv_rounds);
    for (int i = 0; x.kv_rounds && i < x.n; i++)
        x.kv_rounds[i] = kv_rounds_here(r, i);
    x.out_err = calloc((size_t)x.P, sizeof *x.out_err);
    x.fit = calloc((size_t)x.n * (size_t)x.P, sizeof *x.fit);
    x.off = calloc((size_t)x.n, sizeof *x.off);
    x.rot_tried = calloc((size_t)x.n, sizeof *x.rot_tried);
    int rc = x.recs && x.err && x.kv_rounds && x.out_err && x.fit && x.off && x.rot_tried
                 ? read_all(&x, e) : kv_errf(e, "compare: out of memory");
    if (rc == 0)
        rc = offset_all(&x, e);
    if (rc == 0)
        rc = cmp_output_errors(c, x.base, x.P, x.out_err, e);
    x.map_part = calloc((size_t)x.P, sizeof *x.map_part);
    x.map_noise = calloc((size_t)x.P, sizeof *x.map_noise);
    if (rc == 0)
        rc = x.map_part && x.map_noise ? cmp_output_map(c, x.base, x.P, x.map_part, x.map_noise, e)
                                       : kv_errf(e, "compare: out of memory");
    m->map_significant = m->map_fitted && m->map_F > m->map_F_crit &&
                         m->map_gain >= CMP_MAP_MIN_GAIN && map_differs(m);
    x.map_at = rc == 0 && m->map_significant ? map_first(&x) : -1;
    /* llama.cpp's f16 summation of attention values, modelled. */
    m->acc_pos = -1;
    m->acc_layer = -1;
    if (rc == 0 && cmp_xrt_f16acc_applies(c->test, m)) {
        m->acc_on = true;
        m->acc_factor = XRT_ACC_FACTOR;
        x.acc_gap = calloc((size_t)x.n * (size_t)x.P, sizeof *x.acc_gap);
        rc = x.acc_gap ? cmp_xrt_f16acc(c, x.base, x.P, x.acc_gap, e)
                       : kv_errf(e, "compare: out of memory");
    }
    /* The attention check first: its step, if any, bounds the walk. */
    int64_t audit_p = -1;
    int audit_i = -1;
    double audit_err = 0;
    if (rc == 0)
        rc = cmp_xrt_audit(c, &audit_p, &audit_i, &audit_err, e);
    if (rc == 0)
        rc = judge(&x, audit_p, audit_i, audit_err, e);
    free(x.recs);
    free(x.err);
    free(x.kv_rounds);
    free(x.acc_gap);
    free(x.out_err);
    free(x.fit);
    free(x.off);
    free(x.rot_tried);
    free(x.map_part);
    free(x.map_noise);
    return rc;
}
