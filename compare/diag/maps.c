/* maps.c — the families the structure test (structure.c) finds: a row
 * scale the size walk let pass (a norm weight scaled, a scale applied
 * twice or not at all), a map of the logits at /output (a final softcap
 * of another value or none, a temperature), and a recording whose stated
 * compute precision is finer than the one its rows show. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "diag.h"

/* ------------------------------------------------------------------ */
/* Maps of a stage's rows: a row scale, a per-channel scale or offset    */

#define MAP_POS 16     /* positions from the point the maps are fitted over */
#define MAP_MIN_POS 4  /* fewer: a per-channel fit explains anything */
#define MAP_GAIN 4.0   /* the map must leave this many times less residual */

typedef struct {
    int N, n;                    /* positions, columns */
    int64_t p0;
    float *ref, *test;           /* (N, n) */
} map_rows;

static void map_rows_free(map_rows *m)
{
    free(m->ref);
    free(m->test);
}

/* The stage's rows at the point and the positions after it the test
 * holds, up to MAP_POS, before the token cut. 0, -1 on error. */
static int map_rows_read(cmp_ctx *c, map_rows *m, kv_err *e)
{
    const cmp_divergence *d = c->d;
    memset(m, 0, sizeof *m);
    m->n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    m->p0 = d->pos;
    if (m->n < CMP_FIT_MIN_COLS)
        return 0;
    m->ref = malloc((size_t)MAP_POS * (size_t)m->n * sizeof *m->ref);
    m->test = malloc((size_t)MAP_POS * (size_t)m->n * sizeof *m->test);
    if (!m->ref || !m->test)
        return kv_errf(e, "compare: out of memory");
    for (int64_t p = d->pos; m->N < MAP_POS; p++) {
        if (c->pos_limit >= 0 && p >= c->pos_limit)
            break;
        float *a, *b;
        const int rc = dg_row_pair(c, d->layer, d->stage, p, &a, &b, e);
        if (rc)
            return rc < 0 ? -1 : 0;
        float *rr = m->ref + (size_t)m->N * m->n, *tt = m->test + (size_t)m->N * m->n;
        if (d->stage == STAGE_Q || d->stage == STAGE_K) {
            /* a bias or a scale acts before RoPE: fit the rows rotated back */
            const int D = config_layer_head_dim(c->cfg, d->layer);
            double *u = malloc((size_t)m->n * sizeof *u);
            if (!u) {
                free(a);
                free(b);
                return kv_errf(e, "compare: out of memory");
            }
            cmp_rope_unrotate(c->cfg, d->layer, p, a, m->n / D, u);
            for (int j = 0; j < m->n; j++)
                rr[j] = (float)u[j];
            cmp_rope_unrotate(c->cfg, d->layer, p, b, m->n / D, u);
            for (int j = 0; j < m->n; j++)
                tt[j] = (float)u[j];
            free(u);
        } else {
            memcpy(rr, a, (size_t)m->n * sizeof *a);
            memcpy(tt, b, (size_t)m->n * sizeof *b);
        }
        m->N++;
        free(a);
        free(b);
    }
    return 0;
}

enum { MAP_ROW, MAP_CHANNEL, MAP_OFFSET, MAP_KINDS };

/* Each map's parameters, fitted by least squares: per row a[p], per
 * channel s[j], per channel o[j]; and the residual each leaves, as the
 * largest |test - map(ref)| over the largest |ref| (the rows' measure). */
typedef struct {
    double *a, *s, *o;
    double res[MAP_KINDS], res_rms[MAP_KINDS], id_rms, ref_max;
} map_fit;

static int fit_maps(const map_rows *m, map_fit *f, kv_err *e)
{
    const int N = m->N, n = m->n;
    f->a = calloc((size_t)N, sizeof *f->a);
    f->s = calloc((size_t)n, sizeof *f->s);
    f->o = calloc((size_t)n, sizeof *f->o);
    double *rr = calloc((size_t)n, sizeof *rr);
    if (!f->a || !f->s || !f->o || !rr) {
        free(rr);
        return kv_errf(e, "compare: out of memory");
    }
    for (int p = 0; p < N; p++) {
        double tr = 0, r2 = 0;
        for (int j = 0; j < n; j++) {
            const double t = m->test[(size_t)p * n + j], r = m->ref[(size_t)p * n + j];
            tr += t * r;
            r2 += r * r;
            f->s[j] += t * r;
            rr[j] += r * r;
            f->o[j] += (t - r) / N;
        }
        f->a[p] = r2 > 0 ? tr / r2 : 1;
    }
    for (int j = 0; j < n; j++)
        f->s[j] = rr[j] > 0 ? f->s[j] / rr[j] : 1;
    free(rr);
    double sq[MAP_KINDS] = {0}, id = 0, r2 = 0;
    f->ref_max = 0;
    for (int k = 0; k < MAP_KINDS; k++)
        f->res[k] = 0;
    for (int p = 0; p < N; p++)
        for (int j = 0; j < n; j++) {
            const double t = m->test[(size_t)p * n + j], r = m->ref[(size_t)p * n + j];
            const double d[MAP_KINDS] = {t - f->a[p] * r, t - f->s[j] * r, t - r - f->o[j]};
            for (int k = 0; k < MAP_KINDS; k++) {
                sq[k] += d[k] * d[k];
                f->res[k] = fmax(f->res[k], fabs(d[k]));
            }
            id += (t - r) * (t - r);
            r2 += r * r;
            f->ref_max = fmax(f->ref_max, fabs(r));
        }
    for (int k = 0; k < MAP_KINDS; k++) {
        f->res[k] = f->ref_max > 0 ? f->res[k] / f->ref_max : INFINITY;
        f->res_rms[k] = r2 > 0 ? sqrt(sq[k] / r2) : INFINITY;
    }
    f->id_rms = r2 > 0 ? sqrt(id / r2) : INFINITY;
    return 0;
}

static void map_fit_free(map_fit *f)
{
    free(f->a);
    free(f->s);
    free(f->o);
}

static void range_of(const double *x, int n, double *lo, double *hi)
{
    *lo = INFINITY;
    *hi = -INFINITY;
    for (int i = 0; i < n; i++) {
        *lo = fmin(*lo, x[i]);
        *hi = fmax(*hi, x[i]);
    }
}

/* The map that reproduces the test within the step's threshold, leaving
 * MAP_GAIN times less residual than none; the simplest when several do
 * (a scale of every row is a row scale and a channel scale at once). */
static int best_map(const map_fit *f, const map_rows *m, double tol)
{
    int best = -1;
    for (int k = 0; k < MAP_KINDS; k++) {
        if (k != MAP_ROW && m->N < MAP_MIN_POS)
            continue;
        if (!(f->res[k] <= tol) || !(f->res_rms[k] * MAP_GAIN <= f->id_rms))
            continue;
        if (best < 0 || f->res_rms[k] * 2 < f->res_rms[best])
            best = k;
    }
    return best;
}

/* The walk's per-channel offset test made the step: its figures name it. */
static int offset_step_named(cmp_ctx *c)
{
    const cmp_xrt *x = &c->r->xrt;
    const cmp_divergence *d = c->d;
    char s[256];
    dg_say(s, sizeof s, "a per-channel offset at %s, the same vector at every position (RMS "
           "%.3g of the reference's): a bias missing, added or another", stage_name(d->stage),
           x->off_part);
    dg_set(c, CMP_DIAG_BIAS, CMP_BASIS_RECOMPUTED, s);
    dg_say(c->g->detail, sizeof c->g->detail, "(layer %d from position %lld: %d channels each "
           "offset by 8 standard errors or more)", d->layer, (long long)d->pos, x->off_channels);
    dg_say(c->g->evidence, sizeof c->g->evidence, "fitted per channel over the stage's first "
           "positions%s as test = s ref + o, the offsets' RMS is %.3g of the reference's, "
           "%.3g times the residual's noise %.2g", d->stage == STAGE_Q || d->stage == STAGE_K
           ? " (RoPE undone)" : "", x->off_part, x->off_noise > 0 ? x->off_part / x->off_noise
           : INFINITY, x->off_noise);
    return 1;
}

int dg_rule_maps(cmp_ctx *c, kv_err *e)
{
    const cmp_divergence *d = c->d;
    if (c->r->xrt.off_step && !c->beyond)
        return offset_step_named(c);
    if (d->layer < 0 && d->stage != STAGE_EMBED && d->stage != STAGE_FINAL_NORM)
        return 0;
    /* attention's own rows are the key-set families' (keysets.c), after */
    if (dg_is_attn_stage(d->stage) || d->stage == STAGE_ATTN_NORM_STATS ||
        d->stage == STAGE_FFN_NORM_STATS || c->beyond)
        return 0;
    map_rows m;
    if (map_rows_read(c, &m, e) < 0) {
        map_rows_free(&m);
        return -1;
    }
    map_fit f = {0};
    int rc = m.N > 0 ? fit_maps(&m, &f, e) : 0;
    const double tol = fmax(c->row_tol, CMP_MATCH_TOL);
    const int k = rc == 0 && m.N > 0 ? best_map(&f, &m, tol) : -1;
    if (k >= 0) {
        char s[256], where[64];
        if (d->layer >= 0)
            dg_say(where, sizeof where, "layer %d", d->layer);
        else
            dg_say(where, sizeof where, "model level");
        double lo, hi;
        if (k == MAP_ROW) {
            range_of(f.a, m.N, &lo, &hi);
            if (hi - lo <= 0.1 * fmax(fabs(hi - 1), fabs(lo - 1)))
                dg_say(s, sizeof s, "the test's %s rows are the reference's scaled by %.6g: a "
                       "norm weight or a scale applied otherwise", stage_name(d->stage),
                       0.5 * (lo + hi));
            else
                dg_say(s, sizeof s, "the test's %s rows are the reference's, each scaled by "
                       "its own factor (%.6g..%.6g): a normalisation computed otherwise (its "
                       "epsilon or its statistic)", stage_name(d->stage), lo, hi);
        } else if (k == MAP_CHANNEL) {
            range_of(f.s, m.n, &lo, &hi);
            int off = 0;
            for (int j = 0; j < m.n; j++)
                off += fabs(f.s[j] - 1) > 10 * tol;
            dg_say(s, sizeof s, "a per-channel scale at %s: %d of its %d channels scaled "
                   "(%.4g..%.4g), the same at every position: a norm weight or a "
                   "projection's rows scaled", stage_name(d->stage), off, m.n, lo, hi);
        } else {
            double ss = 0, rs = 0;
            for (int j = 0; j < m.n; j++)
                ss += f.o[j] * f.o[j];
            for (size_t i = 0; i < (size_t)m.N * m.n; i++)
                rs += (double)m.ref[i] * m.ref[i];
            dg_say(s, sizeof s, "a per-channel offset at %s, the same vector at every position "
                   "(RMS %.3g of the reference's): a bias missing, added or another",
                   stage_name(d->stage), sqrt(ss / m.n) / sqrt(rs / ((double)m.N * m.n)));
        }
        dg_set(c, k == MAP_ROW ? CMP_DIAG_ROW_SCALE
                  : k == MAP_CHANNEL ? CMP_DIAG_CHANNEL_SCALE : CMP_DIAG_BIAS,
               CMP_BASIS_RECOMPUTED, s);
        dg_say(c->g->detail, sizeof c->g->detail, "(%s, positions %lld..%lld: the map leaves "
               "%.3g of the difference no map leaves, RMS)", where, (long long)m.p0,
               (long long)(m.p0 + m.N - 1), f.id_rms > 0 ? f.res_rms[k] / f.id_rms : 0);
        dg_say(c->g->evidence, sizeof c->g->evidence, "fitted over %d position%s, the %s map "
               "reproduces the test's rows to %.2g (within %.2g, the step's threshold); the "
               "other maps leave %.2g, %.2g, %.2g (row, channel, offset)", m.N,
               m.N == 1 ? "" : "s", k == MAP_ROW ? "row-scale" : k == MAP_CHANNEL
               ? "per-channel scale" : "per-channel offset", f.res[k], tol, f.res[MAP_ROW],
               f.res[MAP_CHANNEL], f.res[MAP_OFFSET]);
        rc = 1;
    }
    map_fit_free(&f);
    map_rows_free(&m);
    return rc;
}

/* ------------------------------------------------------------------ */
/* A map of the logits                                                  */

/* A fitted value as configs write it: 1, 2 or 5 times a power of ten
 * (or an integer) within 2% of it, else as fitted. */
static double round_value(double v)
{
    if (!isfinite(v) || !(v > 0))
        return v;
    if (fabs(v - round(v)) <= 0.02 * v)
        return round(v);
    return dg_config_value(0.98 * v, 1.02 * v, v);
}

bool dg_rule_logit_map(cmp_ctx *c)
{
    const cmp_xrt *x = &c->r->xrt;
    if (!x->map_step)
        return false;
    char s[256];
    const double v = round_value(x->map_param);
    /* a cap far above every logit is no cap the data can tell from none */
    const bool none = x->map_kind == CMP_MAP_SOFTCAP &&
                      (isinf(x->map_param) || x->map_param > 10 * x->map_zmax);
    if (none && isfinite(x->map_param) && x->map_config_cap > 0)
        dg_say(s, sizeof s, "final logit softcap: the test applies none (or one above %.3g, "
               "ten times its largest logit) where the config caps the logits at %g",
               10 * x->map_zmax, x->map_config_cap);
    else if (none)
        dg_say(s, sizeof s, "final logit softcap: the test applies none where the config caps "
               "the logits at %g", x->map_config_cap);
    else if (x->map_kind == CMP_MAP_SOFTCAP && x->map_config_cap > 0)
        dg_say(s, sizeof s, "final logit softcap: the test caps the logits at %g where the "
               "config says %g", v, x->map_config_cap);
    else if (x->map_kind == CMP_MAP_SOFTCAP)
        dg_say(s, sizeof s, "final logit softcap: the test caps the logits at %g where the "
               "config has none", v);
    else
        dg_say(s, sizeof s, "the test's logits are the reference's times %.6g (a temperature "
               "or a logit scale applied otherwise)", x->map_param);
    dg_set(c, CMP_DIAG_LOGIT_MAP, CMP_BASIS_RECOMPUTED, s);
    dg_say(c->g->detail, sizeof c->g->detail, "(/output from position %lld: the %s fitted "
           "over every position's top-k values, %.4g)", (long long)c->d->pos,
           x->map_kind == CMP_MAP_SOFTCAP ? "cap" : "scale", x->map_param);
    dg_say(c->g->evidence, sizeof c->g->evidence, "mapping the reference's top-k logits "
           "through it leaves %.3g of the residual no map leaves (RMS) over %lld positions (F "
           "%.3g against %.3g: a chance of 1e-4); at position %lld its part is %.2g of the "
           "logits' scale, %.3g times the residual there (%.2g)",
           x->map_gain > 0 ? 1 / x->map_gain : 0, (long long)x->map_positions, x->map_F,
           x->map_F_crit, (long long)c->d->pos, x->map_part,
           x->map_noise > 0 ? x->map_part / x->map_noise : INFINITY, x->map_noise);
    return true;
}

/* ------------------------------------------------------------------ */
/* A stated precision the rows contradict                               */

/* Whether every finite value of the row is exactly a value of the type
 * whose mantissa keeps `bits` bits (bf16 8, f16 11; f16's range too). */
static bool row_in_type(const float *v, int n, int bits)
{
    int nonzero = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(v[i]) || v[i] == 0)
            continue;
        int ex;
        const double m = frexp((double)v[i], &ex);   /* |m| in [0.5, 1) */
        const double scaled = ldexp(m, bits);
        if (scaled != nearbyint(scaled) || (bits == 11 && fabs(v[i]) > 65504))
            return false;
        nonzero++;
    }
    return nonzero >= CMP_FIT_MIN_COLS;
}

/* Whether the error at the point looks like rounding: no map of the
 * stage's rows (a row or channel scale, an offset) explains it. */
static bool noise_like(cmp_ctx *c, kv_err *e)
{
    map_rows m;
    bool yes = false;
    if (map_rows_read(c, &m, e) == 0 && m.N > 0) {
        map_fit f = {0};
        if (fit_maps(&m, &f, e) == 0) {
            yes = true;
            for (int k = 0; k < MAP_KINDS; k++)
                if (k == MAP_ROW || m.N >= MAP_MIN_POS)
                    yes &= f.res_rms[k] * 2 > f.id_rms;
        }
        map_fit_free(&f);
    }
    map_rows_free(&m);
    return yes;
}

/* Whether every stage before the point errs by f32 rounding at most at
 * its position: the point is the first stage that errs. */
static bool first_to_err(const cmp_ctx *c)
{
    const cmp_divergence *d = c->d;
    for (int i = 0; i < c->r->n_stages; i++) {
        const cmp_stage_result *sr = &c->r->stages[i];
        if (sr->layer == d->layer && sr->stage == d->stage)
            return true;
        if (sr->xrt_err > 1e-5)
            return false;
    }
    return true;
}

int dg_rule_stated_precision(cmp_ctx *c, kv_err *e, bool exact)
{
    const cmp_xrt *x = &c->r->xrt;
    const cmp_divergence *d = c->d;
    /* Rows a cache holds (k, v, attention's) may be of the cache's type,
     * and so may q where the cache is coarser than f32: llama.cpp converts
     * the query to the cache's type for the dot products (a bf16 cache: q
     * rows of bf16 values, measured). */
    const bool q_cached = d->stage == STAGE_Q && x->kv_eps > 0x1p-20;
    if (!x->on || !x->compute_stated || !(x->compute_eps < 0x1p-20) || c->beyond ||
        d->from_output || x->sys_step || dg_is_attn_stage(d->stage) || d->stage == STAGE_K ||
        d->stage == STAGE_V || q_cached || x->off_step || !first_to_err(c))
        return 0;
    int rc = 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    float *t = dg_row(c, dg_test_rows(c), d->layer, d->stage, d->pos, &rc, e);
    float *r = dg_row(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
    const char *seen = NULL;
    if (exact && t && r && n > 0) {
        if (row_in_type(t, n, 8) && !row_in_type(r, n, 8))
            seen = "bf16";
        else if (row_in_type(t, n, 11) && !row_in_type(r, n, 11))
            seen = "f16";
    }
    free(t);
    free(r);
    if (rc < 0)
        return -1;
    /* Without that evidence: an error of a coarse type's size at the
     * first stage that errs at all, which no map of the rows explains. */
    const double bf = 0x1p-8;
    if (exact ? !seen : !(d->row_rel >= 0.25 * bf && d->row_rel <= 4 * bf && noise_like(c, e)))
        return 0;
    char s[256];
    dg_say(s, sizeof s, "the stated precision looks wrong: the test says compute_dtype %s, but "
           "its %s rows %s", x->compute_precision, stage_name(d->stage),
           seen ? "hold only values of a coarser type" : "err by a coarse type's rounding");
    dg_set(c, CMP_DIAG_STATED_PRECISION, seen ? CMP_BASIS_EXACT_CHECK : CMP_BASIS_HEURISTIC, s);
    if (seen)
        dg_say(c->g->detail, sizeof c->g->detail, "(every value of the test's row at layer %d, "
               "position %lld is exactly a %s value, the reference's are not: the runtime "
               "computes in %s; state it, e.g. record(..., settings={\"compute_dtype\": "
               "\"%s\"}), or engine_settings compute_dtype \"%s\")", d->layer,
               (long long)d->pos, seen, seen, seen, seen);
    else
        dg_say(c->g->detail, sizeof c->g->detail, "(relative error %.2g at the first stage "
               "that errs, %.2g unit roundoffs of bf16 where f32 leaves 1e-6 or less: if the "
               "runtime computes in bf16 or f16 (autocast, bf16 values in f32 tensors), state "
               "it, e.g. record(..., settings={\"compute_dtype\": \"bf16\"}), or engine_settings "
               "compute_dtype)", d->row_rel, d->row_rel / bf);
    dg_say(c->g->evidence, sizeof c->g->evidence, "%s", seen
           ? "each value's mantissa checked against the coarser type's width"
           : "every stage before it at this position errs by 1e-5 or less");
    return 1;
}
