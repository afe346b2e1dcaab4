/* f16acc.c — llama.cpp's f16 value accumulator, modelled. With flash
 * attention and values held as f16 (an f16 cache, or an f32 one, which its
 * flash path casts to f16), llama.cpp's CPU kernel sums the weighted
 * values of a query row in an f16 accumulator, rounding it after every
 * key (ggml's flash_attn_ext "one chunk" path: decode steps, and prompt
 * ubatches of fewer than 64 queries). That rounding is not the cache's:
 * it grows with the keys read, and faster than their square root once
 * the sum outgrows its terms (a term below half an f16 ulp of the sum is
 * lost). Measured on tiny-gemma3 over 4000 keys it reached 0.049 at
 * attn_out, four times the drift floor: a correct run stepped at its first
 * decode row.
 *
 * The model recomputes that summation: for each such row, attention over
 * the recorded q, k, v (rounded to f16, as the kernel reads them) once
 * with the accumulator rounded to f16 after each key as llama.cpp does,
 * once exactly; their row-relative difference is what the runtime's own
 * arithmetic leaves at that row, and the drift model allows a multiple of
 * it at attn_out (crossrt.c). Rows the runtime sums in f32 (its tiled
 * path, ubatches of 64 queries and more) are left to the usual floor. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/safetensors.h"
#include "cmp_internal.h"

/* Rounds to the nearest value with an 11-bit significand (f16's, in its
 * normal range) by Veltkamp's split: c - (c - x) keeps the high 11 bits
 * of x, rounded. Plain float arithmetic, so the loops vectorize. */
static inline float round11(float x)
{
    const float c = x * 8193.0f;   /* -ffp-contract=off: never fused */
    return c - (c - x);
}

/* Whether the test is llama.cpp summing values in f16 under flash
 * attention. */
bool cmp_xrt_f16acc_applies(const cmp_source *test, const cmp_xrt *m)
{
    return cmp_settings_is(test, "runtime", "llama.cpp") &&
           cmp_settings_is(test, "flash_attn", "on") && m->kv_eps == 0x1p-11;
}

/* Whether position p's query ran on the f16-summing path: a decode step
 * (one query), or a prompt ubatch of fewer than 64 queries. The prompt
 * goes to llama_decode in pieces of `batch` tokens, each split into
 * ubatches of `ubatch` (kvdiff-llama's engine_settings). Unknown
 * settings: every row. */
static bool on_path(int64_t p, int64_t prompt, long batch, long ubatch)
{
    if (p >= prompt || batch <= 0 || ubatch <= 0)
        return true;
    const int64_t piece = p / batch * batch;
    const int64_t piece_end = piece + batch < prompt ? piece + batch : prompt;
    const int64_t ub = piece + (p - piece) / ubatch * ubatch;
    const int64_t n = ub + ubatch < piece_end ? ubatch : piece_end - ub;
    return n < 64;
}

/* One query row, every head: the f16-summed output and the exact one over
 * keys kbeg .. p; returns the row-relative difference. q16: (H*D) rounded;
 * k, v: (rows, KV*D) rounded. acc, ex: scratch of D floats / doubles. */
static double row_gap(const float *q16, const float *k, const float *v, int64_t kbeg,
                      int64_t kend, int H, int KV, int D, float scale, float *acc, double *ex,
                      float *out16, double *outx)
{
    const int kvf = KV * D, group = H / KV;
    double num = 0, den = 0;
    for (int h = 0; h < H; h++) {
        const float *q = q16 + (size_t)h * D;
        const int kh = h / group;
        float M = -INFINITY, S = 0;
        double Mx = -INFINITY, Sx = 0;
        for (int d = 0; d < D; d++) {
            acc[d] = 0;
            ex[d] = 0;
        }
        for (int64_t j = kbeg; j < kend; j++) {
            const float *kr = k + (size_t)j * kvf + (size_t)kh * D;
            const float *vr = v + (size_t)j * kvf + (size_t)kh * D;
            float s = 0;
            for (int d = 0; d < D; d++)
                s += q[d] * kr[d];
            s *= scale;
            float ms = 1, vs = 1;
            if (s > M) {
                ms = isinf(M) ? 0 : expf(M - s);
                M = s;
                for (int d = 0; d < D; d++)
                    acc[d] = round11(acc[d] * ms);
            } else {
                vs = expf(s - M);
            }
            for (int d = 0; d < D; d++)
                acc[d] = round11(acc[d] + vr[d] * vs);
            S = S * ms + vs;
            /* exact: the same sum in double */
            double mx = 1, vx = 1;
            if (s > Mx) {
                mx = isinf(Mx) ? 0 : exp(Mx - s);
                Mx = s;
            } else {
                vx = exp(s - Mx);
            }
            for (int d = 0; d < D; d++)
                ex[d] = ex[d] * mx + (double)vr[d] * vx;
            Sx = Sx * mx + vx;
        }
        for (int d = 0; d < D; d++) {
            out16[(size_t)h * D + d] = S > 0 ? acc[d] / S : 0;
            outx[(size_t)h * D + d] = Sx > 0 ? ex[d] / Sx : 0;
        }
    }
    for (int i = 0; i < H * D; i++) {
        num = fmax(num, fabs((double)out16[i] - outx[i]));
        den = fmax(den, fabs(outx[i]));
    }
    return num > 0 ? (den > 0 ? num / den : 0) : 0;
}

/* Rows as the f16 cache holds them (and the query as the kernel converts
 * it): the project's own f16 conversion, subnormals and range included.
 * round11 is kept for the accumulator, where it runs once per key and
 * dimension. */
static void round_all(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = st_f16_to_f32(st_f32_to_f16(x[i]));
}

/* Whether src holds rows 0 .. hi of (layer, st) at width w. */
static bool holds(const cmp_source *src, int layer, kv_stage st, int w, int64_t hi)
{
    int64_t lo, last;
    return src->read && src->info && cmp_source_held(src, layer, st, w, &lo, &last) == 0 &&
           lo <= 0 && last >= hi;
}

/* The source the model reads: the reference's q, k, v where it records
 * them for the layer, else the test's. */
static const cmp_source *source_for(const cmp_ctx *c, int layer, int owner, int qf, int kvf,
                                    int64_t hi)
{
    const cmp_source *s[2] = {c->ref, c->test};
    for (int i = 0; i < 2; i++)
        if (holds(s[i], layer, STAGE_Q, qf, hi) && holds(s[i], owner, STAGE_K, kvf, hi) &&
            holds(s[i], owner, STAGE_V, kvf, hi))
            return s[i];
    return NULL;
}

#define ACC_ROWS 64   /* query rows read at once */

int cmp_xrt_f16acc(cmp_ctx *c, int64_t base, int64_t P, float *gap, kv_err *e)
{
    cmp_result *r = c->r;
    cmp_xrt *m = &r->xrt;
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, Dmax = config_max_head_dim(cfg);
    if (H <= 0 || Dmax <= 0)
        return 0;
    const int qfmax = config_max_q_width(cfg);
    const long batch = cmp_settings_int(c->test, "batch", 0);
    const long ubatch = cmp_settings_int(c->test, "ubatch", 0);
    const long ctx = cmp_settings_int(c->test, "max_ctx", 0);
    const long nb = ctx > 0 && ctx < batch ? ctx : batch;
    const long ub = ubatch < nb ? ubatch : nb;
    const int64_t prompt = c->test->prompt_length > 0 ? c->test->prompt_length : base + P;
    const float scale = (float)cfg->attn_scale;
    float *q = malloc((size_t)ACC_ROWS * qfmax * sizeof *q);
    float *acc = malloc((size_t)Dmax * sizeof *acc), *o16 = malloc((size_t)qfmax * sizeof *o16);
    double *ex = malloc((size_t)Dmax * sizeof *ex), *ox = malloc((size_t)qfmax * sizeof *ox);
    int rc = q && acc && o16 && ex && ox ? 0 : kv_errf(e, "compare: out of memory");
    for (int i = 0; rc == 0 && i < r->n_stages; i++) {
        const cmp_stage_result *sr = &r->stages[i];
        if (sr->stage != STAGE_ATTN_OUT || sr->layer < 0 || sr->pos_hi < sr->pos_lo)
            continue;
        const int l = sr->layer, owner = cfg->kv_owner[l];
        const int W = config_layer_window(cfg, l);
        const int KV = config_layer_kv_heads(cfg, l), D = config_layer_head_dim(cfg, l);
        if (KV <= 0 || D <= 0 || H % KV)
            continue;
        const int qf = H * D, kvf = KV * D;
        int64_t lo = sr->pos_lo, hi = sr->pos_hi;
        while (lo <= hi && !on_path(lo, prompt, nb, ub))
            lo++;
        if (lo > hi)
            continue;
        const cmp_source *src = source_for(c, l, owner, qf, kvf, hi);
        if (!src) {
            cmp_note(r, "f16 accumulation: layer %d not modelled (no q, k, v recorded from "
                     "position 0)", l);
            continue;
        }
        const size_t nk = (size_t)hi + 1;
        float *k = malloc(nk * kvf * sizeof *k), *v = malloc(nk * kvf * sizeof *v);
        if (!k || !v) {
            free(k);
            free(v);
            rc = kv_errf(e, "compare: out of memory");
            break;
        }
        if (src->read(src->ctx, owner, STAGE_K, 0, (int64_t)nk, k, e) < 0 ||
            src->read(src->ctx, owner, STAGE_V, 0, (int64_t)nk, v, e) < 0)
            rc = -1;
        round_all(k, nk * kvf);
        round_all(v, nk * kvf);
        for (int64_t p0 = lo; rc == 0 && p0 <= hi; p0 += ACC_ROWS) {
            const int64_t n = hi - p0 + 1 < ACC_ROWS ? hi - p0 + 1 : ACC_ROWS;
            if (src->read(src->ctx, l, STAGE_Q, p0, n, q, e) < 0) {
                rc = -1;
                break;
            }
            round_all(q, (size_t)n * qf);
            for (int64_t p = p0; p < p0 + n; p++) {
                if (!on_path(p, prompt, nb, ub) || p < base || p >= base + P)
                    continue;
                const int64_t kbeg = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0;
                const double g = row_gap(q + (size_t)(p - p0) * qf, k, v, kbeg, p + 1, H, KV, D,
                                         scale, acc, ex, o16, ox);
                gap[(size_t)i * (size_t)P + (size_t)(p - base)] = (float)g;
                m->acc_rows++;
                if (m->acc_pos < 0 || g > m->acc_largest) {
                    m->acc_largest = g;
                    m->acc_pos = p;
                    m->acc_layer = l;
                }
            }
        }
        free(k);
        free(v);
    }
    free(q);
    free(acc);
    free(o16);
    free(ex);
    free(ox);
    return rc;
}
