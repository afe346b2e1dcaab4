/* metrics.c — the element rule, row comparison and the per-(layer, stage)
 * aggregates: bitwise equality, max abs, row-relative error, ULP distance,
 * cosine similarity and NMSE. */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
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

/* Sums and maxima of one row pair, lanes kept apart so that the scalar
 * and the AVX2 loops give the same bits: element i goes to lane i % 8 in
 * ascending order, the last n % 8 elements to lane 0. Eight lanes, not
 * four: each AVX2 accumulator then takes one addition per eight elements,
 * so the additions of a row do not wait on one another. */
#define LANES 8
typedef struct {
    double dot[LANES], rsq[LANES], tsq[LANES], esq[LANES];
    double max_abs;
    float absmax;
    uint32_t max_ulp;
} row_acc;

/* Finite floats' bits mapped to integers that order like the floats
 * (+0 and -0 both 0); the distance of two fits in 32 unsigned bits. */
static int32_t ordered32(uint32_t u)
{
    const int32_t neg = -(int32_t)(u >> 31), mag = (int32_t)(u & 0x7fffffffu);
    return (mag ^ neg) - neg;
}

/* Not NaN or infinity, told by the bits (as acc_elem does): no compiler
 * flag makes this always true. */
static bool finite_bits(double x)
{
    uint64_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x7ff0000000000000u) != 0x7ff0000000000000u;
}

static void acc_elem(row_acc *s, int k, float a, float b, uint32_t *special)
{
    uint32_t ua, ub;
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    *special |= ((ua & 0x7f800000u) == 0x7f800000u) | ((ub & 0x7f800000u) == 0x7f800000u);
    const double da = a, db = b, d = da - db;
    s->dot[k] += da * db;
    s->rsq[k] += db * db;
    s->tsq[k] += da * da;
    s->esq[k] += d * d;
    const double ad = fabs(d);
    s->max_abs = ad > s->max_abs ? ad : s->max_abs;
    const float fb = fabsf(b);
    s->absmax = fb > s->absmax ? fb : s->absmax;
    const int32_t oa = ordered32(ua), ob = ordered32(ub);
    const uint32_t u = oa > ob ? (uint32_t)oa - (uint32_t)ob : (uint32_t)ob - (uint32_t)oa;
    s->max_ulp = u > s->max_ulp ? u : s->max_ulp;
}

/* Elements from..n-1 (from a multiple of LANES). Returns true when a NaN
 * or an infinity was met, on either side (then s means nothing). */
static bool acc_tail(row_acc *s, const float *test, const float *ref, int from, int n,
                     uint32_t special)
{
    int i = from;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++)
            acc_elem(s, k, test[i + k], ref[i + k], &special);
    for (; i < n; i++)
        acc_elem(s, 0, test[i], ref[i], &special);
    return special != 0;
}

static bool acc_row_scalar(row_acc *s, const float *test, const float *ref, int n)
{
    memset(s, 0, sizeof *s);
    return acc_tail(s, test, ref, 0, n, 0);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CMP_HAVE_AVX2 1
__attribute__((target("avx2"))) static bool acc_row_avx2(row_acc *s, const float *test,
                                                         const float *ref, int n)
{
    /* A: lanes 0-3 (elements i..i+3), B: lanes 4-7 (elements i+4..i+7) */
    __m256d dotA = _mm256_setzero_pd(), dotB = dotA, rsqA = dotA, rsqB = dotA, tsqA = dotA,
            tsqB = dotA, esqA = dotA, esqB = dotA, mabs = dotA;
    __m256 amax = _mm256_setzero_ps();
    __m256i umax = _mm256_setzero_si256();
    const __m256i magm = _mm256_set1_epi32(0x7fffffff);
    const __m256d sgn = _mm256_set1_pd(-0.0);
    const __m256 sgnf = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(test + i), b = _mm256_loadu_ps(ref + i);
        const __m256i ua = _mm256_castps_si256(a), ub = _mm256_castps_si256(b);
        const __m256d a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
        const __m256d a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
        const __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
        const __m256d b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
        dotA = _mm256_add_pd(dotA, _mm256_mul_pd(a0, b0));
        dotB = _mm256_add_pd(dotB, _mm256_mul_pd(a1, b1));
        rsqA = _mm256_add_pd(rsqA, _mm256_mul_pd(b0, b0));
        rsqB = _mm256_add_pd(rsqB, _mm256_mul_pd(b1, b1));
        tsqA = _mm256_add_pd(tsqA, _mm256_mul_pd(a0, a0));
        tsqB = _mm256_add_pd(tsqB, _mm256_mul_pd(a1, a1));
        const __m256d d0 = _mm256_sub_pd(a0, b0), d1 = _mm256_sub_pd(a1, b1);
        esqA = _mm256_add_pd(esqA, _mm256_mul_pd(d0, d0));
        esqB = _mm256_add_pd(esqB, _mm256_mul_pd(d1, d1));
        mabs = _mm256_max_pd(mabs, _mm256_andnot_pd(sgn, d0));
        mabs = _mm256_max_pd(mabs, _mm256_andnot_pd(sgn, d1));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sgnf, b));
        const __m256i na = _mm256_srai_epi32(ua, 31), nb = _mm256_srai_epi32(ub, 31);
        const __m256i oa = _mm256_sub_epi32(_mm256_xor_si256(_mm256_and_si256(ua, magm), na), na);
        const __m256i ob = _mm256_sub_epi32(_mm256_xor_si256(_mm256_and_si256(ub, magm), nb), nb);
        const __m256i dist = _mm256_sub_epi32(_mm256_max_epi32(oa, ob), _mm256_min_epi32(oa, ob));
        umax = _mm256_max_epu32(umax, dist);
    }
    memset(s, 0, sizeof *s);
    _mm256_storeu_pd(s->dot, dotA);
    _mm256_storeu_pd(s->dot + 4, dotB);
    _mm256_storeu_pd(s->rsq, rsqA);
    _mm256_storeu_pd(s->rsq + 4, rsqB);
    _mm256_storeu_pd(s->tsq, tsqA);
    _mm256_storeu_pd(s->tsq + 4, tsqB);
    _mm256_storeu_pd(s->esq, esqA);
    _mm256_storeu_pd(s->esq + 4, esqB);
    double m4[4];
    float m8[8];
    uint32_t u8[8];
    _mm256_storeu_pd(m4, mabs);
    _mm256_storeu_ps(m8, amax);
    _mm256_storeu_si256((__m256i *)u8, umax);
    /* A NaN or an infinity on either side leaves its lane of rsq or tsq
     * not finite; finite floats cannot: a square is below 1.2e77 and a
     * row's sum of them far below DBL_MAX. So the loop needs no test of
     * its own, and says what acc_elem's test would have said. */
    uint32_t special = 0;
    for (int k = 0; k < 8; k++) {
        s->max_abs = k < 4 && m4[k] > s->max_abs ? m4[k] : s->max_abs;
        s->absmax = m8[k] > s->absmax ? m8[k] : s->absmax;
        s->max_ulp = u8[k] > s->max_ulp ? u8[k] : s->max_ulp;
        special |= !finite_bits(s->rsq[k]) || !finite_bits(s->tsq[k]);
    }
    return acc_tail(s, test, ref, i, n, special);
}

/* acc_row_avx2(s, ref, ref, n) for a bit-equal row: dot and tsq are rsq
 * lane for lane (the same products added in the same order), esq and the
 * differences are +0, so only rsq and the reference's largest magnitude
 * are summed. */
__attribute__((target("avx2"))) static bool acc_self_avx2(row_acc *s, const float *ref, int n)
{
    __m256d rsqA = _mm256_setzero_pd(), rsqB = rsqA;
    __m256 amax = _mm256_setzero_ps();
    const __m256 sgnf = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 b = _mm256_loadu_ps(ref + i);
        const __m256d b0 = _mm256_cvtps_pd(_mm256_castps256_ps128(b));
        const __m256d b1 = _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1));
        rsqA = _mm256_add_pd(rsqA, _mm256_mul_pd(b0, b0));
        rsqB = _mm256_add_pd(rsqB, _mm256_mul_pd(b1, b1));
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sgnf, b));
    }
    memset(s, 0, sizeof *s);
    _mm256_storeu_pd(s->rsq, rsqA);
    _mm256_storeu_pd(s->rsq + 4, rsqB);
    float m8[8];
    _mm256_storeu_ps(m8, amax);
    uint32_t special = 0;
    for (int k = 0; k < 8; k++) {
        s->absmax = m8[k] > s->absmax ? m8[k] : s->absmax;
        special |= !finite_bits(s->rsq[k]);   /* as in acc_row_avx2 */
    }
    memcpy(s->dot, s->rsq, sizeof s->dot);
    memcpy(s->tsq, s->rsq, sizeof s->tsq);
    return acc_tail(s, ref, ref, i, n, special);
}
#else
#define CMP_HAVE_AVX2 0
#endif

/* Which loop weighs rows: -1 not decided yet, 0 scalar, 1 AVX2. Both give
 * the same bits; tests switch between them. */
static atomic_int simd_state = -1;

static int cpu_avx2(void)
{
#if CMP_HAVE_AVX2
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

static bool acc_row(row_acc *s, const float *test, const float *ref, int n)
{
    int st = atomic_load_explicit(&simd_state, memory_order_relaxed);
    if (st < 0) {
        st = cpu_avx2();
        atomic_store_explicit(&simd_state, st, memory_order_relaxed);
    }
#if CMP_HAVE_AVX2
    if (st)
        return acc_row_avx2(s, test, ref, n);
#endif
    return acc_row_scalar(s, test, ref, n);
}

/* acc_row of a bit-equal row (test's bits are ref's). */
static bool acc_self(row_acc *s, const float *ref, int n)
{
#if CMP_HAVE_AVX2
    if (atomic_load_explicit(&simd_state, memory_order_relaxed) > 0)
        return acc_self_avx2(s, ref, n);
#endif
    return acc_row(s, ref, ref, n);
}

bool cmp_rows_use_simd(bool on)
{
    const int st = on ? cpu_avx2() : 0;
    atomic_store_explicit(&simd_state, st, memory_order_relaxed);
    return st == 1;
}

static double lanes(const double v[LANES])
{
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* Violations of a row pair with no NaN or infinity, its record filled:
 * none to look for when the largest difference is within the tolerance. */
static void count_bad(const float *test, const float *ref, int n, const cmp_tol *t,
                      cmp_rowrec *rec)
{
    const double tol = t->atol + t->rtol * rec->ref_absmax;
    if (!t->exact && rec->max_abs <= tol)
        return;
    for (int i = 0; i < n; i++) {
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
}

void cmp_row_compare(const float *test, const float *ref, int n, const cmp_tol *t,
                     cmp_rowrec *rec)
{
    memset(rec, 0, sizeof *rec);
    rec->first_bad = -1;
    rec->bitequal = memcmp(test, ref, (size_t)n * sizeof(float)) == 0;
    /* Rows without NaN or infinity (nearly all): one pass for every figure.
     * A bit-equal row is weighed against itself, as its record says. */
    row_acc s;
    if (!(rec->bitequal ? acc_self(&s, ref, n) : acc_row(&s, test, ref, n))) {
        rec->dot = lanes(s.dot);
        rec->ref_sq = lanes(s.rsq);
        rec->test_sq = lanes(s.tsq);
        rec->err_sq = lanes(s.esq);
        rec->max_abs = s.max_abs;
        rec->ref_absmax = s.absmax;
        rec->max_ulp = s.max_ulp;
        if (!rec->bitequal)
            count_bad(test, ref, n, t, rec);
        rec->bad = rec->n_bad > 0;
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
