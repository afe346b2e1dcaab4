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
/* A row scale                                                          */

int dg_rule_row_scale(cmp_ctx *c, kv_err *e)
{
    (void)e;
    const cmp_xrt *x = &c->r->xrt;
    const cmp_divergence *d = c->d;
    if (!x->sys_step || c->beyond)
        return 0;
    const double a = 1 + x->sys_dev;
    char s[256];
    dg_say(s, sizeof s, "the test's %s rows are the reference's scaled by %.6g: a norm weight "
           "or scale applied otherwise", stage_name(d->stage), a);
    dg_set(c, CMP_DIAG_ROW_SCALE, CMP_BASIS_EXACT_CHECK, s);
    dg_say(c->g->detail, sizeof c->g->detail, "(layer %d, position %lld: a - 1 = %.3g, %.3g "
           "times the residual's noise %.2g; under the size floor, above what this pair's "
           "rounding makes)", d->layer, (long long)d->pos, x->sys_dev,
           x->sys_noise > 0 ? fabs(x->sys_dev) / x->sys_noise : INFINITY, x->sys_noise);
    dg_say(c->g->evidence, sizeof c->g->evidence, "the row fitted as a * ref leaves a residual "
           "of RMS %.2g of the reference's; every quarter of its columns sees the same scale, "
           "and so do the stage's next rows; threshold %.2g (%g x noise, %g x the compute "
           "type's unit roundoff, %g x upstream)", x->sys_noise, x->sys_threshold,
           x->sys_noise_factor, x->sys_compute_factor, x->gain);
    return 1;
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
    const double dec = pow(10, floor(log10(v)));
    static const double steps[] = {1, 2, 5, 10};
    for (size_t i = 0; i < sizeof steps / sizeof *steps; i++)
        if (fabs(steps[i] * dec / v - 1) <= 0.02)
            return steps[i] * dec;
    return v;
}

bool dg_rule_logit_map(cmp_ctx *c)
{
    const cmp_xrt *x = &c->r->xrt;
    if (!x->map_step)
        return false;
    char s[256];
    const double v = round_value(x->map_param);
    if (x->map_kind == CMP_MAP_SOFTCAP && isinf(x->map_param))
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
           "through it leaves %.3g of the residual no map leaves (RMS); at position %lld its "
           "part is %.2g of the logits' scale, %.3g times the residual there (%.2g)",
           x->map_gain > 0 ? 1 / x->map_gain : 0, (long long)c->d->pos, x->map_part,
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

int dg_rule_stated_precision(cmp_ctx *c, kv_err *e)
{
    const cmp_xrt *x = &c->r->xrt;
    const cmp_divergence *d = c->d;
    if (!x->on || !x->compute_stated || !(x->compute_eps < 0x1p-20) || c->beyond ||
        d->from_output || x->sys_step)
        return 0;
    int rc = 0;
    const int n = cmp_stage_cols(c->cfg, d->layer, d->stage);
    float *t = dg_row(c, c->test, d->layer, d->stage, d->pos, &rc, e);
    float *r = dg_row(c, c->ref, d->layer, d->stage, d->pos, &rc, e);
    const char *seen = NULL;
    if (t && r && n > 0) {
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
     * first stage that errs at all (nothing upstream above f32 rounding). */
    const double bf = 0x1p-8;
    bool first = false;
    if (!seen && d->row_rel >= 0.25 * bf && d->row_rel <= 4 * bf) {
        first = true;
        for (int i = 0; i < c->r->n_stages && first; i++) {
            const cmp_stage_result *sr = &c->r->stages[i];
            if (sr->layer == d->layer && sr->stage == d->stage)
                break;
            first = !(sr->xrt_err > 1e-5);
        }
    }
    if (!seen && !first)
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
