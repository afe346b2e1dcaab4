/* structure.c — errors judged by their structure, not only their size
 * (docs/cross-runtime.md, "Structure"). Rounding leaves an error that
 * looks like noise: no consistent sign, nothing a simple map of the
 * reference's values explains. A semantic change leaves structure: an
 * RMSNorm epsilon scales each row by a factor that depends on its mean
 * square, a scaled norm weight scales every row, a final softcap of
 * another value is a smooth monotone map of the logits. So beside the
 * size walk (crossrt.c), each row's error is split into the part one
 * low-dimensional map explains and the residual that is left, and the
 * map's part is weighed against that residual, the noise this very pair
 * shows there: a systematic part many times the noise is a step even far
 * under the size floor.
 *
 * Two maps are fitted here:
 *
 * - a row scale, test = a * ref, per row. Its part of the error is
 *   |a - 1| (row-relative: max |(a - 1) ref| / max |ref|); the noise is
 *   the residual's RMS over the reference's. A row dominated by one large
 *   element (a massive activation) would give that element's own rounding
 *   the look of a scale, so the fit is made again on four interleaved
 *   column groups, and a scale counts only where every group sees it
 *   (each within half of the row's);
 * - a map of the logits at /output, over every position's top-k values
 *   matched by id: a final softcap c (the reference's values uncapped
 *   with the config's cap, capped again with c; c = inf: no cap) or a
 *   scale s (a temperature). One parameter for the whole run, fitted
 *   where it leaves the least residual. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cmp_internal.h"

/* ------------------------------------------------------------------ */
/* Row scale                                                            */

#define GROUPS 4

void cmp_row_scale_fit(const float *test, const float *ref, int n, cmp_scalefit *f)
{
    memset(f, 0, sizeof *f);
    f->noise = INFINITY;
    double tr = 0, rr = 0, gtr[GROUPS] = {0}, grr[GROUPS] = {0};
    for (int j = 0; j < n; j++) {
        const double t = test[j], r = ref[j];
        if (!isfinite(t) || !isfinite(r))
            return;
        tr += t * r;
        rr += r * r;
        gtr[j % GROUPS] += t * r;
        grr[j % GROUPS] += r * r;
    }
    if (!(rr > 0) || n < CMP_FIT_MIN_COLS)
        return;
    const double a = tr / rr;
    double res = 0;
    for (int j = 0; j < n; j++) {
        const double d = (double)test[j] - a * ref[j];
        res += d * d;
    }
    f->dev = a - 1;
    f->noise = sqrt(res / rr);
    f->fitted = true;
    f->groups_agree = true;
    for (int g = 0; g < GROUPS; g++)
        f->groups_agree &= grr[g] > 0 && fabs(gtr[g] / grr[g] - a) <= 0.5 * fabs(f->dev);
}

/* ------------------------------------------------------------------ */
/* Logit maps                                                           */

/* The reference's logit before its cap (cap 0: none). */
static double uncap(double v, double cap)
{
    if (!(cap > 0))
        return v;
    const double x = v / cap;
    return x >= 1 ? INFINITY : x <= -1 ? -INFINITY : cap * atanh(x);
}

double cmp_logit_map(const cmp_logitmap *m, double ref_value)
{
    switch (m->kind) {
    case CMP_MAP_SCALE:
        return m->param * ref_value;
    case CMP_MAP_SOFTCAP: {
        const double z = uncap(ref_value, m->config_cap);
        return isinf(m->param) ? z : m->param * tanh(z / m->param);
    }
    default:
        return ref_value;
    }
}

/* Sum of squared residuals of the pairs under m. */
static double ssr(const cmp_logitmap *m, const double *ref, const double *test, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = test[i] - cmp_logit_map(m, ref[i]);
        s += isfinite(d) ? d * d : INFINITY;
    }
    return s;
}

/* The softcap whose map leaves the least residual: golden-section search
 * on log(c) over [0.5, 1e5], then against no cap at all. */
static void fit_softcap(cmp_logitmap *m, const double *ref, const double *test, size_t n)
{
    m->kind = CMP_MAP_SOFTCAP;
    const double g = (sqrt(5.0) - 1) / 2;
    double lo = log(0.5), hi = log(1e5);
    double x1 = hi - g * (hi - lo), x2 = lo + g * (hi - lo);
    m->param = exp(x1);
    double f1 = ssr(m, ref, test, n);
    m->param = exp(x2);
    double f2 = ssr(m, ref, test, n);
    for (int it = 0; it < 80; it++) {
        if (f1 < f2) {
            hi = x2, x2 = x1, f2 = f1;
            x1 = hi - g * (hi - lo);
            m->param = exp(x1);
            f1 = ssr(m, ref, test, n);
        } else {
            lo = x1, x1 = x2, f1 = f2;
            x2 = lo + g * (hi - lo);
            m->param = exp(x2);
            f2 = ssr(m, ref, test, n);
        }
    }
    m->param = exp(f1 < f2 ? x1 : x2);
    m->ssr = fmin(f1, f2);
    const cmp_logitmap none = {.kind = CMP_MAP_SOFTCAP, .param = INFINITY,
                               .config_cap = m->config_cap};
    const double fn = ssr(&none, ref, test, n);
    if (fn <= m->ssr) {
        m->param = INFINITY;
        m->ssr = fn;
    }
}

static void fit_scale(cmp_logitmap *m, const double *ref, const double *test, size_t n)
{
    double tr = 0, rr = 0;
    for (size_t i = 0; i < n; i++) {
        tr += test[i] * ref[i];
        rr += ref[i] * ref[i];
    }
    m->kind = CMP_MAP_SCALE;
    m->param = rr > 0 ? tr / rr : 1;
    m->ssr = ssr(m, ref, test, n);
}

/* ------------------------------------------------------------------ */
/* Significance                                                         */

/* F(1, d) at 1 - 1e-4, d = 1..30, then 40, 60, 120, infinity: a map's
 * one parameter fitted by chance lowers the residual of d + 1 independent
 * positions (the logits of one position share its hidden state's error,
 * so positions, not pairs, are the units) this much at most, in 1 of 10^4
 * runs. */
double cmp_map_f_critical(int64_t d)
{
    static const double f[] = {0, 4.05e7, 9999.5, 784.0, 241.6, 124.8, 82.49, 62.17, 50.69,
                               43.48, 38.58, 35.06, 32.43, 30.39, 28.77, 27.45, 26.36, 25.44,
                               24.66, 23.99, 23.40, 22.89, 22.44, 22.03, 21.67, 21.35, 21.05,
                               20.78, 20.54, 20.31, 20.11};
    if (d < 1)
        return INFINITY;
    if (d <= 30)
        return f[d];
    return d <= 40 ? 19.07 : d <= 60 ? 17.55 : d <= 120 ? 16.26 : 15.14;
}

void cmp_logit_map_fit(const double *ref, const double *test, size_t n, double config_cap,
                       cmp_logitmap *best)
{
    memset(best, 0, sizeof *best);
    best->kind = CMP_MAP_NONE;
    best->config_cap = config_cap;
    best->ssr = ssr(best, ref, test, n);
    best->ssr_identity = best->ssr;
    best->pairs = n;
    if (n < 2)
        return;
    cmp_logitmap cap = {.config_cap = config_cap}, sc = {.config_cap = config_cap};
    fit_softcap(&cap, ref, test, n);
    fit_scale(&sc, ref, test, n);
    const cmp_logitmap *m = cap.ssr <= sc.ssr ? &cap : &sc;
    if (m->ssr < best->ssr) {
        const double id = best->ssr;
        *best = *m;
        best->ssr_identity = id;
        best->pairs = n;
    }
}

/* ------------------------------------------------------------------ */
/* Per-channel offset                                                   */

#define OFFSET_Z 8.0   /* a channel's offset, in its standard errors, that counts */

void cmp_channel_offset_fit(const float *test, const float *ref, int W, int n,
                            cmp_offsetfit *f)
{
    memset(f, 0, sizeof *f);
    if (W < CMP_OFFSET_MIN_ROWS || n < CMP_FIT_MIN_COLS)
        return;
    double o2 = 0, s2 = 0, r2 = 0;
    for (int j = 0; j < n; j++) {
        double mr = 0, mt = 0;
        for (int p = 0; p < W; p++) {
            const double r = ref[(size_t)p * n + j], t = test[(size_t)p * n + j];
            if (!isfinite(r) || !isfinite(t))
                return;
            mr += r / W;
            mt += t / W;
        }
        double vr = 0, cv = 0, q2 = 0;
        for (int p = 0; p < W; p++) {
            const double dr = ref[(size_t)p * n + j] - mr, dt = test[(size_t)p * n + j] - mt;
            vr += dr * dr / W;
            cv += dr * dt / W;
            q2 += (double)ref[(size_t)p * n + j] * ref[(size_t)p * n + j] / W;
        }
        r2 += q2;
        /* A channel whose reference hardly moves (a massive activation held
         * near one value) cannot tell an offset from a scale: left out. */
        if (!(vr > 1e-6 * q2))
            continue;
        const double s = cv / vr, o = mt - s * mr;
        double res = 0;
        for (int p = 0; p < W; p++) {
            const double d = test[(size_t)p * n + j] - s * ref[(size_t)p * n + j] - o;
            res += d * d;
        }
        const double var = res / (W - 2);
        const double se = sqrt(var * (1.0 / W + mr * mr / (W * vr)));
        f->channels++;
        f->significant += fabs(o) > OFFSET_Z * se;
        o2 += o * o;
        s2 += var;
    }
    if (f->channels == 0 || !(r2 > 0))
        return;
    const double rms = sqrt(r2 / n);
    f->part = sqrt(o2 / f->channels) / rms;
    f->noise = sqrt(s2 / f->channels) / rms;
    f->fitted = true;
}
