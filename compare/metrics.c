/* metrics.c — the element rule, row comparison and the per-(layer, stage)
 * aggregates: bitwise equality, max abs, row-relative error, ULP distance,
 * cosine similarity and NMSE. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "cmp_internal.h"

/* Float bit patterns mapped to integers that order like the floats, so the
 * ULP distance is a subtraction (+0 and -0 both map to 0). No branch: the
 * row loops below vectorize around it. */
static int64_t ordered_bits(uint32_t u)
{
    const int64_t mag = (int64_t)(u & 0x7fffffffu), neg = -(int64_t)(u >> 31);
    return (mag ^ neg) - neg;
}

/* ULP distance of two finite floats given as bits. */
static uint64_t ulp_bits(uint32_t a, uint32_t b)
{
    const int64_t d = ordered_bits(a) - ordered_bits(b);
    return (uint64_t)(d < 0 ? -d : d);
}

static bool same_bits(float a, float b)
{
    return memcmp(&a, &b, sizeof a) == 0;
}

uint64_t cmp_ulp_distance(float a, float b)
{
    if (same_bits(a, b))
        return 0;
    if (!isfinite(a) || !isfinite(b))
        return UINT64_MAX;
    uint32_t ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    return ulp_bits(ua, ub);
}

/* One side NaN and the other not, or an infinity against anything else:
 * a divergence whatever the tolerance. */
bool cmp_elem_nonfinite_mismatch(float test, float ref)
{
    if (isfinite(test) && isfinite(ref))
        return false;
    if (isnan(test) && isnan(ref))
        return false;
    return !(isinf(test) && isinf(ref) && test == ref);
}

bool cmp_elem_ok(float test, float ref, double ref_rowmax, const cmp_tol *t)
{
    if (same_bits(test, ref))
        return true;
    if (t->exact)
        return false;
    if (!isfinite(test) || !isfinite(ref))
        return !cmp_elem_nonfinite_mismatch(test, ref);
    double d = fabs((double)test - (double)ref);
    if (d <= t->atol + t->rtol * ref_rowmax)
        return true;
    return t->ulp > 0 && cmp_ulp_distance(test, ref) <= t->ulp;
}

/* A bit-equal row's record: no error, and sums of squares that are those
 * of the reference. Four independent accumulators let the loop run at
 * memory speed (identical rows are the common case: a dump compared with
 * a correct engine's is all of them). A non-finite element makes the sum
 * non-finite: then 0 is returned and the caller takes the general path,
 * which skips such elements. */
static int bitequal_row(const float *ref, int n, cmp_rowrec *rec)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    float m0 = 0, m1 = 0, m2 = 0, m3 = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        const double a = ref[i], b = ref[i + 1], c = ref[i + 2], d = ref[i + 3];
        s0 += a * a;
        s1 += b * b;
        s2 += c * c;
        s3 += d * d;
        m0 = fabsf(ref[i]) > m0 ? fabsf(ref[i]) : m0;
        m1 = fabsf(ref[i + 1]) > m1 ? fabsf(ref[i + 1]) : m1;
        m2 = fabsf(ref[i + 2]) > m2 ? fabsf(ref[i + 2]) : m2;
        m3 = fabsf(ref[i + 3]) > m3 ? fabsf(ref[i + 3]) : m3;
    }
    for (; i < n; i++) {
        const double a = ref[i];
        s0 += a * a;
        m0 = fabsf(ref[i]) > m0 ? fabsf(ref[i]) : m0;
    }
    const double sq = (s0 + s1) + (s2 + s3);
    float m = m0 > m1 ? m0 : m1;
    m = m > m2 ? m : m2;
    m = m > m3 ? m : m3;
    if (!isfinite(sq) || !isfinite(m))
        return 0;
    rec->ref_absmax = m;
    rec->dot = rec->ref_sq = rec->test_sq = sq;
    return 1;
}

static bool row_finite(const float *x, int n)
{
    uint32_t special = 0;
    for (int i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], sizeof u);
        special |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !special;
}

/* A row pair with no NaN or infinity on either side: the same record as
 * the general loop below, in two passes without per-element calls (the
 * sums in four lanes, so their last bits may differ from one running
 * sum). This is the path cascade-versus-reference comparisons live on. */
static void finite_row(const float *test, const float *ref, int n, const cmp_tol *t,
                       cmp_rowrec *rec)
{
    double dot[4] = {0}, rsq[4] = {0}, tsq[4] = {0}, esq[4] = {0};
    double max_abs = 0, absmax = 0;
    uint64_t max_ulp = 0;
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int k = 0; k < 4; k++) {
            const double a = test[i + k], b = ref[i + k], d = a - b;
            dot[k] += a * b;
            rsq[k] += b * b;
            tsq[k] += a * a;
            esq[k] += d * d;
        }
    for (; i < n; i++) {
        const double a = test[i], b = ref[i], d = a - b;
        dot[0] += a * b;
        rsq[0] += b * b;
        tsq[0] += a * a;
        esq[0] += d * d;
    }
    for (i = 0; i < n; i++) {
        uint32_t ua, ub;
        memcpy(&ua, &test[i], sizeof ua);
        memcpy(&ub, &ref[i], sizeof ub);
        const double d = fabs((double)test[i] - (double)ref[i]), m = fabs((double)ref[i]);
        max_abs = d > max_abs ? d : max_abs;
        absmax = m > absmax ? m : absmax;
        const uint64_t u = ulp_bits(ua, ub);
        max_ulp = u > max_ulp ? u : max_ulp;
    }
    rec->dot = (dot[0] + dot[1]) + (dot[2] + dot[3]);
    rec->ref_sq = (rsq[0] + rsq[1]) + (rsq[2] + rsq[3]);
    rec->test_sq = (tsq[0] + tsq[1]) + (tsq[2] + tsq[3]);
    rec->err_sq = (esq[0] + esq[1]) + (esq[2] + esq[3]);
    rec->max_abs = max_abs;
    rec->ref_absmax = absmax;
    rec->max_ulp = max_ulp;
    /* The element rule (cmp_elem_ok) for finite values. */
    const double tol = t->atol + t->rtol * absmax;
    for (i = 0; i < n; i++) {
        uint32_t ua, ub;
        memcpy(&ua, &test[i], sizeof ua);
        memcpy(&ub, &ref[i], sizeof ub);
        if (ua == ub)
            continue;
        bool ok = false;
        if (!t->exact) {
            ok = fabs((double)test[i] - (double)ref[i]) <= tol;
            if (!ok && t->ulp > 0)
                ok = ulp_bits(ua, ub) <= t->ulp;
        }
        if (!ok) {
            if (rec->first_bad < 0)
                rec->first_bad = i;
            rec->n_bad++;
        }
    }
    rec->bad = rec->n_bad > 0;
}

void cmp_row_compare(const float *test, const float *ref, int n, const cmp_tol *t,
                     cmp_rowrec *rec)
{
    memset(rec, 0, sizeof *rec);
    rec->first_bad = -1;
    rec->bitequal = memcmp(test, ref, (size_t)n * sizeof(float)) == 0;
    if (rec->bitequal && bitequal_row(ref, n, rec))
        return;
    if (!rec->bitequal && row_finite(test, n) && row_finite(ref, n)) {
        finite_row(test, ref, n, t, rec);
        return;
    }
    double rowmax = 0;   /* rtol is relative to the row's scale */
    for (int i = 0; i < n && !rec->bitequal && t->rtol > 0; i++)
        if (isfinite(ref[i]) && fabs((double)ref[i]) > rowmax)
            rowmax = fabs((double)ref[i]);
    for (int i = 0; i < n; i++) {
        const float a = test[i], b = ref[i];
        if (!rec->bitequal && !cmp_elem_ok(a, b, rowmax, t)) {
            if (rec->first_bad < 0)
                rec->first_bad = i;
            rec->n_bad++;
        }
        if (!isfinite(a) || !isfinite(b)) {
            rec->nonfinite += cmp_elem_nonfinite_mismatch(a, b);
            continue;
        }
        const double da = a, db = b, d = fabs(da - db);
        if (d > rec->max_abs)
            rec->max_abs = d;
        if (fabs(db) > rec->ref_absmax)
            rec->ref_absmax = fabs(db);
        uint64_t u = cmp_ulp_distance(a, b);
        if (u > rec->max_ulp)
            rec->max_ulp = u;
        rec->dot += da * db;
        rec->ref_sq += db * db;
        rec->test_sq += da * da;
        rec->err_sq += (da - db) * (da - db);
    }
    rec->bad = rec->n_bad > 0;
}

/* Fingerprints only say equal or not. */
void cmp_row_hashed(bool equal, cmp_rowrec *rec)
{
    memset(rec, 0, sizeof *rec);
    rec->first_bad = -1;
    rec->bitequal = equal;
    rec->bad = !equal;
    rec->n_bad = !equal;
}

double cmp_rowrec_rel(const cmp_rowrec *rec)
{
    if (rec->max_abs == 0)
        return 0;
    return rec->ref_absmax > 0 ? rec->max_abs / rec->ref_absmax : INFINITY;
}

double cmp_row_rel_err(const float *a, const float *b, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(b[i])) {
            if (cmp_elem_nonfinite_mismatch(a[i], b[i]))
                return INFINITY;
            continue;
        }
        double d = fabs((double)a[i] - (double)b[i]);
        num = d > num ? d : num;
        den = fabs((double)b[i]) > den ? fabs((double)b[i]) : den;
    }
    if (num == 0)
        return 0;
    return den > 0 ? num / den : INFINITY;
}

void cmp_stats_init(cmp_stats *s)
{
    memset(s, 0, sizeof *s);
    s->first_bitdiff_pos = -1;
}

void cmp_stats_add(cmp_stats *s, const cmp_rowrec *rec, int64_t pos)
{
    s->rows++;
    s->bitequal_rows += rec->bitequal;
    s->violating_rows += rec->bad;
    s->nonfinite += rec->nonfinite;
    if (!rec->bitequal && (s->first_bitdiff_pos < 0 || pos < s->first_bitdiff_pos))
        s->first_bitdiff_pos = pos;
    if (rec->max_abs > s->max_abs)
        s->max_abs = rec->max_abs;
    double rel = cmp_rowrec_rel(rec);
    if (rel > s->max_rel)
        s->max_rel = rel;
    if (rec->max_ulp > s->max_ulp)
        s->max_ulp = rec->max_ulp;
    s->dot += rec->dot;
    s->ref_sq += rec->ref_sq;
    s->test_sq += rec->test_sq;
    s->err_sq += rec->err_sq;
}

double cmp_stats_cosine(const cmp_stats *s)
{
    if (s->ref_sq == 0 && s->test_sq == 0)
        return 1;
    if (s->ref_sq == 0 || s->test_sq == 0)
        return 0;
    return s->dot / (sqrt(s->ref_sq) * sqrt(s->test_sq));
}

double cmp_stats_nmse(const cmp_stats *s)
{
    if (s->err_sq == 0)
        return 0;
    return s->ref_sq > 0 ? s->err_sq / s->ref_sq : INFINITY;
}
