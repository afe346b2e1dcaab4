/* kernels.c — the batch-invariant kernels of kernels.h: the scalar
 * reference path of each, the packed-weight layout, thread splitting and
 * the run-time choice of SIMD path (kernels_x86.c).
 *
 * The scalar loops here ARE the definition of every result (the ORDER RULE
 * in kernels.h); SIMD paths must match them bit for bit, and the tests
 * check that they do. On x86-64 the hot scalar loops are also compiled in
 * a target("fma") clone: there fmaf() is one instruction instead of a libm
 * call, and fma is exactly rounded either way, so the result is the same. */
#include "kernels.h"

#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------
 * SIMD entry points (kernels_x86.c) */
#if defined(__x86_64__)
#include "kernels_x86.h"
#define KERN_X86 1
#define FMA_CLONE __attribute__((target("fma")))
#else
#define KERN_X86 0
#endif

/* ------------------------------------------------------------------------
 * instruction sets */

kern_isa kern_isa_best(void)
{
#if KERN_X86
    return kern_x86_best();
#else
    return KERN_ISA_SCALAR;
#endif
}

const char *kern_isa_name(kern_isa isa)
{
    switch (isa) {
    case KERN_ISA_SCALAR: return "scalar";
    case KERN_ISA_AVX2: return "avx2";
    case KERN_ISA_AVX512: return "avx512";
    }
    return "unknown";
}

int kern_isa_parse(const char *s, kern_isa *out)
{
    kern_isa isa;
    if (!s)
        return -1;
    if (strcmp(s, "scalar") == 0)
        isa = KERN_ISA_SCALAR;
    else if (strcmp(s, "avx2") == 0)
        isa = KERN_ISA_AVX2;
    else if (strcmp(s, "avx512") == 0)
        isa = KERN_ISA_AVX512;
    else if (strcmp(s, "auto") == 0)
        isa = kern_isa_best();
    else
        return -1;
    if (out)
        *out = isa;
    return 0;
}

/* A ctx may ask for more than the CPU has (a config written elsewhere):
 * step down the ladder scalar < avx2 < avx512. The result is the same on
 * every path, so this changes speed only. */
static kern_isa usable_isa(kern_isa want)
{
    kern_isa best = kern_isa_best();
    return want > best ? best : want;
}

#if KERN_X86
static int cpu_has_fma(void)
{
    return __builtin_cpu_supports("fma");
}
#endif

/* ------------------------------------------------------------------------
 * bf16 */

static float bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays NaN (quieted, sign kept), overflow
 * rounds to infinity as IEEE says. */
static uint16_t f32_to_bf16(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((bits >> 16) | 0x0040u);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

void kern_bf16_from_f32(const float *in, size_t n, uint16_t *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = f32_to_bf16(in[i]);
}

void kern_bf16_to_f32(const uint16_t *in, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++)
        out[i] = bf16_to_f32(in[i]);
}

/* ------------------------------------------------------------------------
 * packed linear layers */

_Static_assert((1LL << (KERN_MAX_LEVELS - 1)) * KERN_KBLOCK >= 2147483647LL,
               "KERN_MAX_LEVELS must hold the block count of any int K");

static size_t panel_count(int n_out)
{
    return ((size_t)n_out + KERN_PANEL - 1) / KERN_PANEL;
}

static size_t wsize(kern_wtype wt)
{
    return wt == KERN_BF16 ? sizeof(uint16_t) : sizeof(float);
}

int kern_linear_init(kern_linear *L, int n_out, int n_in, kern_wtype wt, bool with_bias)
{
    memset(L, 0, sizeof *L);
    if (n_out <= 0 || n_in <= 0)
        return -1;
    /* 64-byte alignment: one panel row is one cache line (f32) and SIMD
     * loads never straddle lines; aligned_alloc wants a multiple of 64. */
    size_t bytes = panel_count(n_out) * (size_t)n_in * KERN_PANEL * wsize(wt);
    bytes = (bytes + 63) & ~(size_t)63;
    void *panels = aligned_alloc(64, bytes);
    if (!panels)
        return -1;
    memset(panels, 0, bytes);    /* padding lanes must be 0 */
    float *bias = NULL;
    if (with_bias) {
        bias = calloc((size_t)n_out, sizeof *bias);
        if (!bias) {
            free(panels);
            return -1;
        }
    }
    L->n_out = n_out;
    L->n_in = n_in;
    L->wtype = wt;
    L->panels = panels;
    L->bias = bias;
    return 0;
}

void kern_linear_free(kern_linear *L)
{
    if (!L)
        return;
    free(L->panels);
    free(L->bias);
    memset(L, 0, sizeof *L);
}

void kern_linear_set_rows(kern_linear *L, int row0, int nrows, const float *src)
{
    const size_t K = (size_t)L->n_in;
    for (int r = row0; r < row0 + nrows; r++) {
        const float *s = src + (size_t)(r - row0) * K;
        size_t base = (size_t)(r / KERN_PANEL) * K * KERN_PANEL + (size_t)(r % KERN_PANEL);
        if (L->wtype == KERN_BF16) {
            uint16_t *d = (uint16_t *)L->panels + base;
            for (size_t k = 0; k < K; k++)
                d[k * KERN_PANEL] = f32_to_bf16(s[k]);
        } else {
            float *d = (float *)L->panels + base;
            for (size_t k = 0; k < K; k++)
                d[k * KERN_PANEL] = s[k];
        }
    }
}

void kern_linear_get_row(const kern_linear *L, int r, float *out)
{
    const size_t K = (size_t)L->n_in;
    size_t base = (size_t)(r / KERN_PANEL) * K * KERN_PANEL + (size_t)(r % KERN_PANEL);
    if (L->wtype == KERN_BF16) {
        const uint16_t *w = (const uint16_t *)L->panels + base;
        for (size_t k = 0; k < K; k++)
            out[k] = bf16_to_f32(w[k * KERN_PANEL]);
    } else {
        const float *w = (const float *)L->panels + base;
        for (size_t k = 0; k < K; k++)
            out[k] = w[k * KERN_PANEL];
    }
}

/* ------------------------------------------------------------------------
 * matmul: scalar definition */

/* One output panel (16 lanes) of one row by the block rule: blocks of
 * KERN_KBLOCK k's, each the float product of its first k, then fmaf over
 * the rest in ascending k; block sums
 * merged pairwise as a binary counter (block b merges with the stored sums
 * of levels 0.. while bit l of b is set, older sum on the left); the
 * levels left at the end are added from the lowest up. */
INLINE void panel_scalar(const kern_linear *L, const float *xr, const void *wp, float acc[16])
{
    const int K = L->n_in;
    float lv[KERN_MAX_LEVELS][KERN_PANEL];
    int nb = 0;
    for (int k0 = 0; k0 < K; k0 += KERN_KBLOCK, nb++) {
        const int k1 = K - k0 < KERN_KBLOCK ? K : k0 + KERN_KBLOCK;
        if (L->wtype == KERN_BF16) {
            const uint16_t *w = wp;
            for (int j = 0; j < KERN_PANEL; j++)
                acc[j] = xr[k0] * bf16_to_f32(w[(size_t)k0 * KERN_PANEL + j]);
            for (int k = k0 + 1; k < k1; k++)
                for (int j = 0; j < KERN_PANEL; j++)
                    acc[j] = fmaf(xr[k], bf16_to_f32(w[(size_t)k * KERN_PANEL + j]), acc[j]);
        } else {
            const float *w = wp;
            for (int j = 0; j < KERN_PANEL; j++)
                acc[j] = xr[k0] * w[(size_t)k0 * KERN_PANEL + j];
            for (int k = k0 + 1; k < k1; k++)
                for (int j = 0; j < KERN_PANEL; j++)
                    acc[j] = fmaf(xr[k], w[(size_t)k * KERN_PANEL + j], acc[j]);
        }
        int l = 0;
        for (; nb >> l & 1; l++)
            for (int j = 0; j < KERN_PANEL; j++)
                acc[j] = lv[l][j] + acc[j];
        memcpy(lv[l], acc, sizeof lv[l]);
    }
    int first = 1;
    for (int l = 0; l < KERN_MAX_LEVELS; l++) {
        if (!(nb >> l & 1))
            continue;
        for (int j = 0; j < KERN_PANEL; j++)
            acc[j] = first ? lv[l][j] : lv[l][j] + acc[j];
        first = 0;
    }
}

/* y[m][16p + j] for rows [m0, m1), panels [p0, p1): the block rule over
 * all of k, then the bias. Lanes past n_out are computed (their weights
 * are 0) but never stored. */
INLINE void tile_scalar_body(const kern_linear *L, const float *x, int m0, int m1, int p0,
                             int p1, float *y)
{
    const int K = L->n_in, N = L->n_out;
    const size_t esz = wsize(L->wtype);
    for (int m = m0; m < m1; m++) {
        const float *xr = x + (size_t)m * K;
        for (int p = p0; p < p1; p++) {
            float acc[KERN_PANEL];
            panel_scalar(L, xr, (const char *)L->panels + (size_t)p * K * KERN_PANEL * esz, acc);
            int n0 = p * KERN_PANEL;
            int nv = N - n0 < KERN_PANEL ? N - n0 : KERN_PANEL;
            float *yr = y + (size_t)m * N + n0;
            for (int j = 0; j < nv; j++)
                yr[j] = L->bias ? acc[j] + L->bias[n0 + j] : acc[j];
        }
    }
}

static void tile_scalar(const kern_linear *L, const float *x, int m0, int m1, int p0, int p1,
                        float *y)
{
    tile_scalar_body(L, x, m0, m1, p0, p1, y);
}

#if KERN_X86
FMA_CLONE static void tile_scalar_fma(const kern_linear *L, const float *x, int m0, int m1,
                                      int p0, int p1, float *y)
{
    tile_scalar_body(L, x, m0, m1, p0, p1, y);
}
#endif

/* ------------------------------------------------------------------------
 * matmul: splitting and dispatch
 *
 * Work is a grid of tasks, each a block of rows x a block of panels, and
 * every task computes its outputs whole (all of k), so the split never
 * touches a reduction:
 *   - small products (under ~64k FMAs) run as one task on the caller: the
 *     pool hand-off would cost more than it saves;
 *   - otherwise, with panels to spare (>= 2 per thread) or too few rows to
 *     share, each thread takes a contiguous range of panels and all rows:
 *     in decode every weight byte is then read by exactly one thread;
 *   - otherwise (a narrow matrix, many rows) each thread takes a block of
 *     rows and all panels.
 * Inside a task the SIMD path blocks over panels and rows for cache reuse
 * (kernels_x86.c); the scalar path walks row by row. x and y must not
 * overlap: y is written while x is still being read. */

typedef struct {
    const kern_linear *L;
    const float *x;
    float *y;
    int M;
    int nrow_blocks, npanel_blocks;
    kern_isa isa;
    int scalar_fma;
} mm_job;

static void mm_run_tile(const mm_job *j, int m0, int m1, int p0, int p1)
{
#if KERN_X86
    if (j->isa != KERN_ISA_SCALAR) {
        kern_x86_matmul_tile(j->isa, j->L, j->x, m0, m1, p0, p1, j->y);
        return;
    }
    if (j->scalar_fma) {
        tile_scalar_fma(j->L, j->x, m0, m1, p0, p1, j->y);
        return;
    }
#endif
    tile_scalar(j->L, j->x, m0, m1, p0, p1, j->y);
}

static void mm_task(void *ctx, int t)
{
    const mm_job *j = ctx;
    int np = (int)panel_count(j->L->n_out);
    int rb = t % j->nrow_blocks, pb = t / j->nrow_blocks;
    int m0 = (int)((int64_t)rb * j->M / j->nrow_blocks);
    int m1 = (int)((int64_t)(rb + 1) * j->M / j->nrow_blocks);
    int p0 = (int)((int64_t)pb * np / j->npanel_blocks);
    int p1 = (int)((int64_t)(pb + 1) * np / j->npanel_blocks);
    if (m0 < m1 && p0 < p1)
        mm_run_tile(j, m0, m1, p0, p1);
}

void kern_matmul(const kern_ctx *c, const kern_linear *L, const float *x, int M, float *y)
{
    if (M <= 0)
        return;
    int np = (int)panel_count(L->n_out);
    int T = pool_threads(c->pool);
    mm_job j = { .L = L, .x = x, .y = y, .M = M, .nrow_blocks = 1, .npanel_blocks = 1,
                 .isa = usable_isa(c->isa), .scalar_fma = 0 };
#if KERN_X86
    j.scalar_fma = cpu_has_fma();
#endif
    double work = (double)M * L->n_out * L->n_in;
    if (T > 1 && work >= 65536.0) {
        if (np >= 2 * T || M < 2 * T)
            j.npanel_blocks = np < T ? np : T;
        else
            j.nrow_blocks = T;
    }
    pool_run(c->pool, mm_task, &j, j.nrow_blocks * j.npanel_blocks);
}

/* ------------------------------------------------------------------------
 * dot product: the 8-lane rule */

INLINE float combine8(const float s[8])
{
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

INLINE float dot_body(const float *a, const float *b, int n)
{
    float s[8] = { 0.0f };
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            s[l] = fmaf(a[i + l], b[i + l], s[l]);
    for (int l = 0; i + l < n; l++)
        s[l] = fmaf(a[i + l], b[i + l], s[l]);
    return combine8(s);
}

static float dot_scalar(const float *a, const float *b, int n)
{
    return dot_body(a, b, n);
}

#if KERN_X86
FMA_CLONE static float dot_scalar_fma(const float *a, const float *b, int n)
{
    return dot_body(a, b, n);
}
#endif

/* The scalar-path dot, in its fastest exact form. */
static float dot_ref(const float *a, const float *b, int n, int scalar_fma)
{
#if KERN_X86
    if (scalar_fma)
        return dot_scalar_fma(a, b, n);
#else
    (void)scalar_fma;
#endif
    return dot_scalar(a, b, n);
}

float kern_dot(const float *a, const float *b, int n)
{
    /* No ctx here: every path gives the same bits, so take the fastest. */
#if KERN_X86
    kern_isa isa = kern_isa_best();
    if (isa != KERN_ISA_SCALAR)
        return kern_x86_dot(isa, a, b, n);
    return dot_ref(a, b, n, cpu_has_fma());
#else
    return dot_scalar(a, b, n);
#endif
}

/* ------------------------------------------------------------------------
 * RMSNorm */

void kern_rmsnorm(const float *x, const float *w, int n, double eps, bool plus_one,
                  float *out, float stats[3])
{
    double ss = 0.0, sum = 0.0;
    float absmax = 0.0f;
    for (int i = 0; i < n; i++) {
        double v = x[i];
        ss += v * v;          /* a float squared is exact in double */
        sum += v;
        float a = fabsf(x[i]);
        if (a > absmax)
            absmax = a;
    }
    double mean_sq = n > 0 ? ss / n : 0.0;
    if (stats) {
        stats[0] = n > 0 ? (float)(sum / n) : 0.0f;
        stats[1] = (float)sqrt(mean_sq);
        stats[2] = absmax;
    }
    /* x * scale * weight (Gemma: 1 + weight) in double, rounded to float
     * once: the frameworks round the scale, the product and 1 + weight
     * each to float, three roundings where one is needed. */
    double scale = 1.0 / sqrt(mean_sq + eps);
    for (int i = 0; i < n; i++) {
        double wi = !w ? 1.0 : plus_one ? 1.0 + (double)w[i] : (double)w[i];
        out[i] = (float)((double)x[i] * scale * wi);
    }
}

/* ------------------------------------------------------------------------
 * RoPE */

void kern_rope_inv_freq(double theta, int head_dim, double *inv_freq)
{
    for (int d = 0; d < head_dim / 2; d++)
        inv_freq[d] = pow(theta, -(double)(2 * d) / (double)head_dim);
}

void kern_rope_scale_inv_freq(double *inv_freq, int half, int type, double factor,
                              double low_freq_factor, double high_freq_factor,
                              int original_max_position)
{
    if (type == 1) {
        for (int d = 0; d < half; d++)
            inv_freq[d] /= factor;
        return;
    }
    if (type != 2)
        return;
    /* HF modeling_rope_utils._compute_llama3_parameters: long wavelengths
     * are slowed by factor, short ones kept, the band between blended. */
    const double two_pi = 6.283185307179586476925286766559;
    double old_len = original_max_position;
    double low_freq_wavelen = old_len / low_freq_factor;
    double high_freq_wavelen = old_len / high_freq_factor;
    for (int d = 0; d < half; d++) {
        double f = inv_freq[d];
        double wavelen = two_pi / f;
        if (wavelen > low_freq_wavelen) {
            inv_freq[d] = f / factor;
        } else if (!(wavelen < high_freq_wavelen)) {
            double smooth = (old_len / wavelen - low_freq_factor) /
                            (high_freq_factor - low_freq_factor);
            inv_freq[d] = (1.0 - smooth) * f / factor + smooth * f;
        }
    }
}

void kern_attn_sinks(int M, int H, int D, const float *sinks, const float *lse, float *out,
                     float *share, const uint8_t *skip)
{
    for (int i = 0; i < M; i++)
        for (int h = 0; h < H; h++) {
            const size_t ih = (size_t)i * H + h;
            if (skip && skip[i]) {
                if (share)
                    share[ih] = 0.0f;
                continue;
            }
            const double l = lse[ih], sk = sinks[h];
            const double mx = l > sk ? l : sk;
            const double wk = isinf(l) && l < 0 ? 0.0 : exp(l - mx), ws = exp(sk - mx);
            const double keep = wk / (wk + ws);
            float *o = out + ih * D;
            for (int d = 0; d < D; d++)
                o[d] = (float)((double)o[d] * keep);
            if (share)
                share[ih] = (float)(ws / (wk + ws));
        }
}

void kern_top_k(const float *v, int n, int k, int *idx)
{
    for (int r = 0; r < k; r++) {
        int best = -1;
        for (int x = 0; x < n; x++) {
            bool taken = false;
            for (int q = 0; q < r && !taken; q++)
                taken = idx[q] == x;
            if (!taken && (best < 0 || v[x] > v[best]))
                best = x;
        }
        idx[r] = best;
    }
}

/* The dim whose wavelength turns `rotations` times in max_pos positions. */
static double yarn_dim(double rotations, int dim, double theta, int max_pos)
{
    const double two_pi = 6.283185307179586476925286766559;
    return dim * log(max_pos / (rotations * two_pi)) / (2.0 * log(theta));
}

void kern_rope_yarn_inv_freq(double *inv_freq, int half, double theta, double factor,
                             double beta_fast, double beta_slow, int original_max,
                             bool truncate)
{
    const int dim = 2 * half;
    double low = yarn_dim(beta_fast, dim, theta, original_max);
    double high = yarn_dim(beta_slow, dim, theta, original_max);
    if (truncate) {
        low = floor(low);
        high = ceil(high);
    }
    if (low < 0)
        low = 0;
    if (high > dim - 1)
        high = dim - 1;
    if (low == high)
        high += 0.001;
    for (int d = 0; d < half; d++) {
        double ramp = (d - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double keep = 1.0 - ramp, f = inv_freq[d];
        inv_freq[d] = (f / factor) * (1.0 - keep) + f * keep;
    }
}

void kern_rope_table_scaled(double pos, const double *inv_freq, int head_dim, double mscale,
                            float *cos_out, float *sin_out)
{
    for (int d = 0; d < head_dim / 2; d++) {
        double angle = pos * inv_freq[d];
        cos_out[d] = (float)(cos(angle) * mscale);
        sin_out[d] = (float)(sin(angle) * mscale);
    }
}

void kern_rope_table(double pos, const double *inv_freq, int head_dim, float *cos_out,
                     float *sin_out)
{
    for (int d = 0; d < head_dim / 2; d++) {
        double angle = pos * inv_freq[d];
        cos_out[d] = (float)cos(angle);
        sin_out[d] = (float)sin(angle);
    }
}

void kern_rope_apply(float *x, int n_heads, int head_dim, const float *cos_t, const float *sin_t)
{
    const int half = head_dim / 2;
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * head_dim;
        /* Products of two floats are exact in double: one rounding per
         * output instead of three. */
        for (int d = 0; d < half; d++) {
            double x1 = xh[d], x2 = xh[d + half];
            xh[d] = (float)(x1 * cos_t[d] - x2 * sin_t[d]);
            xh[d + half] = (float)(x2 * cos_t[d] + x1 * sin_t[d]);
        }
    }
}

void kern_rope_apply_pairs(float *x, int n_heads, int stride, int pairs, const float *cos_t,
                           const float *sin_t)
{
    for (int h = 0; h < n_heads; h++) {
        float *xh = x + (size_t)h * stride;
        for (int d = 0; d < pairs; d++) {
            double x1 = xh[2 * d], x2 = xh[2 * d + 1];
            xh[2 * d] = (float)(x1 * cos_t[d] - x2 * sin_t[d]);
            xh[2 * d + 1] = (float)(x2 * cos_t[d] + x1 * sin_t[d]);
        }
    }
}

/* ------------------------------------------------------------------------
 * gated activations: act(gate) * up in double, rounded to float once (the
 * frameworks round the activation, then the product). */

void kern_hadamard_blocks(float *x, size_t n, int b)
{
    static _Thread_local double t[KERN_HADAMARD_MAX];
    if (b < 1 || b > KERN_HADAMARD_MAX || (b & (b - 1)))
        return;
    const double scale = 1.0 / sqrt((double)b);
    for (size_t o = 0; o + (size_t)b <= n; o += (size_t)b) {
        for (int i = 0; i < b; i++)
            t[i] = x[o + i];
        for (int h = 1; h < b; h *= 2)
            for (int i = 0; i < b; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const double u = t[j], v = t[j + h];
                    t[j] = u + v;
                    t[j + h] = u - v;
                }
        for (int i = 0; i < b; i++)
            x[o + i] = (float)(t[i] * scale);
    }
}

void kern_silu_mul(float *gate, const float *up, int n)
{
    for (int i = 0; i < n; i++) {
        double g = gate[i];
        gate[i] = (float)(g / (1.0 + exp(-g)) * (double)up[i]);
    }
}

void kern_gelu_tanh_mul(float *gate, const float *up, int n)
{
    const double pi = 3.14159265358979323846264338327950288;
    const double k = sqrt(2.0 / pi);
    for (int i = 0; i < n; i++) {
        double g = gate[i];
        double act = 0.5 * g * (1.0 + tanh(k * (g + 0.044715 * g * g * g)));
        gate[i] = (float)(act * (double)up[i]);
    }
}

/* Elementwise and row-wise work split across the pool: task t takes the
 * t-th of T contiguous ranges. Small inputs stay on the caller, where the
 * hand-off would cost more than the work. */
#define KERN_SPLIT_MIN 8192

typedef struct {
    kern_act act;
    float *gate;
    const float *up;
    size_t n;
    int ntasks;
} act_job;

static void act_task(void *ctx, int t)
{
    const act_job *j = ctx;
    size_t a = j->n * (size_t)t / (size_t)j->ntasks;
    size_t b = j->n * (size_t)(t + 1) / (size_t)j->ntasks;
    while (a < b) {
        int len = b - a > (size_t)INT_MAX ? INT_MAX : (int)(b - a);
        if (j->act == KERN_ACT_GELU_TANH)
            kern_gelu_tanh_mul(j->gate + a, j->up + a, len);
        else
            kern_silu_mul(j->gate + a, j->up + a, len);
        a += (size_t)len;
    }
}

void kern_act_mul(const kern_ctx *c, kern_act act, float *gate, const float *up, size_t n)
{
    int T = pool_threads(c->pool);
    act_job j = { .act = act, .gate = gate, .up = up, .n = n,
                  .ntasks = n >= KERN_SPLIT_MIN && T > 1 ? T : 1 };
    pool_run(j.ntasks > 1 ? c->pool : NULL, act_task, &j, j.ntasks);
}

typedef struct {
    const float *x, *w;
    int nrows, width, ntasks;
    double eps;
    bool plus_one;
    float *out, *stats;
} norm_job;

static void norm_task(void *ctx, int t)
{
    const norm_job *j = ctx;
    int r0 = (int)((int64_t)j->nrows * t / j->ntasks);
    int r1 = (int)((int64_t)j->nrows * (t + 1) / j->ntasks);
    for (int r = r0; r < r1; r++)
        kern_rmsnorm(j->x + (size_t)r * j->width, j->w, j->width, j->eps, j->plus_one,
                     j->out + (size_t)r * j->width, j->stats ? j->stats + 3 * (size_t)r : NULL);
}

void kern_rmsnorm_rows(const kern_ctx *c, const float *x, const float *w, int nrows, int width,
                       double eps, bool plus_one, float *out, float *stats)
{
    int T = pool_threads(c->pool);
    norm_job j = { .x = x, .w = w, .nrows = nrows, .width = width, .eps = eps,
                   .plus_one = plus_one, .out = out, .stats = stats, .ntasks = 1 };
    if (T > 1 && (size_t)nrows * (size_t)width >= KERN_SPLIT_MIN)
        j.ntasks = nrows < T ? nrows : T;
    pool_run(j.ntasks > 1 ? c->pool : NULL, norm_task, &j, j.ntasks);
}

/* ------------------------------------------------------------------------
 * attention
 *
 * For query row m and head h (KV head h / (H / KV)), keys j in
 * [kbeg[m], kend[m]) in the order given:
 *   s_j  = dot(q, k_j) * scale          (8-lane dot, then a float multiply)
 *   mx   = max_j s_j
 *   p_j  = expf(s_j - mx);  l += p_j    (l in double, key order)
 *   o[d] = sum_j p_j v_j[d]             per chunk of ATTN_CHUNK keys: blocks
 *                                       of 16 keys (product, then fmaf)
 *                                       combined pairwise as in the matmul;
 *                                       chunk sums added in key order
 *   out  = (float)(o / l)               (in double: one rounding)
 *   lse  = (float)(mx + log(l))         (in double)
 * Scores are kept in a stack buffer of ATTN_CHUNK; a longer range is done
 * in chunks and its scores computed twice (once for the max, once for the
 * weights): the same values, so the same result, in O(1) memory.
 *
 * Threads: each (row, head) pair is independent. Tasks take pairs
 * round-robin (task t: pairs t, t + ntasks, ...) so that causal prefill,
 * whose later rows see more keys, is balanced across the pool's contiguous
 * task blocks. */

#define ATTN_CHUNK 4096
/* Levels of the pairwise sum over one chunk: up to 2^8 blocks of 16 keys. */
#define ATTN_PV_LEVELS 9
_Static_assert(ATTN_CHUNK / KERN_KBLOCK <= 1 << (ATTN_PV_LEVELS - 1),
               "ATTN_PV_LEVELS must hold a chunk's block count");

typedef struct {
    int M, H, KV, D;
    float scale;
    const float *q;
    const float *const *krow;
    const float *const *vrow;
    const int *kbeg, *kend;
    const uint8_t *mask;    /* masked form: (M, nkeys), key j read iff non-zero */
    int nkeys;
    const float **pick;     /* masked form: (ntasks, 2 nkeys) gathered key/value rows */
    float *out, *lse;
    int ntasks;
    kern_isa isa;
    int scalar_fma;
} attn_job;

static void attn_scores(const attn_job *j, const float *q, const float *const *krow,
                        size_t off, int n, float *s)
{
#if KERN_X86
    if (j->isa != KERN_ISA_SCALAR) {
        kern_x86_scores(j->isa, q, krow, off, n, j->D, j->scale, s);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        s[i] = dot_ref(q, krow[i] + off, j->D, j->scalar_fma) * j->scale;
}

/* The weighted sum of values of one chunk of n <= ATTN_CHUNK keys, by the
 * block rule of the matmul over keys instead of k: blocks of KERN_KBLOCK
 * keys, each the product of its first key then fmaf in key order, combined
 * by the same binary counter. The chunk's sum is stored into out (first chunk) or added to
 * it. Columns are independent, so they are walked 16 at a time. */
INLINE void pv_body(const float *p, const float *const *vrow, size_t off, int n, int D,
                    float *out, int first)
{
    for (int d0 = 0; d0 < D; d0 += 16) {
        const int w = D - d0 < 16 ? D - d0 : 16;
        float acc[16], lv[ATTN_PV_LEVELS][16];
        int nb = 0;
        for (int j0 = 0; j0 < n; j0 += KERN_KBLOCK, nb++) {
            const int j1 = n - j0 < KERN_KBLOCK ? n : j0 + KERN_KBLOCK;
            for (int i = 0; i < w; i++)
                acc[i] = p[j0] * vrow[j0][off + (size_t)d0 + (size_t)i];
            for (int j = j0 + 1; j < j1; j++) {
                const float *v = vrow[j] + off + d0;
                for (int i = 0; i < w; i++)
                    acc[i] = fmaf(p[j], v[i], acc[i]);
            }
            int l = 0;
            for (; nb >> l & 1; l++)
                for (int i = 0; i < w; i++)
                    acc[i] = lv[l][i] + acc[i];
            memcpy(lv[l], acc, (size_t)w * sizeof *acc);
        }
        int top = 1;
        for (int l = 0; l < ATTN_PV_LEVELS; l++) {
            if (!(nb >> l & 1))
                continue;
            for (int i = 0; i < w; i++)
                acc[i] = top ? lv[l][i] : lv[l][i] + acc[i];
            top = 0;
        }
        for (int i = 0; i < w; i++)
            out[d0 + i] = first ? acc[i] : out[d0 + i] + acc[i];
    }
}

static void pv_scalar(const float *p, const float *const *vrow, size_t off, int n, int D,
                      float *out, int first)
{
    pv_body(p, vrow, off, n, D, out, first);
}

#if KERN_X86
FMA_CLONE static void pv_scalar_fma(const float *p, const float *const *vrow, size_t off, int n,
                                    int D, float *out, int first)
{
    pv_body(p, vrow, off, n, D, out, first);
}
#endif

static void attn_pv(const attn_job *j, const float *p, const float *const *vrow, size_t off,
                    int n, float *out, int first)
{
#if KERN_X86
    if (j->isa != KERN_ISA_SCALAR) {
        kern_x86_pv(j->isa, p, vrow, off, n, j->D, out, first);
        return;
    }
    if (j->scalar_fma) {
        pv_scalar_fma(p, vrow, off, n, j->D, out, first);
        return;
    }
#endif
    pv_scalar(p, vrow, off, n, j->D, out, first);
}

/* The masked form reads exactly the keys the mask keeps, in list order:
 * they are gathered into `pick` and handed to the same code as a range,
 * so a mask and a range selecting the same keys give the same bits. */
static int attn_keys(const attn_job *j, int m, const float *const **krow,
                     const float *const **vrow, const float **pick)
{
    if (!j->mask) {
        *krow = j->krow + j->kbeg[m];
        *vrow = j->vrow + j->kbeg[m];
        return j->kend[m] - j->kbeg[m];
    }
    const uint8_t *mr = j->mask + (size_t)m * j->nkeys;
    int n = 0;
    for (int i = 0; i < j->nkeys; i++)
        if (mr[i]) {
            pick[n] = j->krow[i];
            pick[j->nkeys + n] = j->vrow[i];
            n++;
        }
    *krow = (const float *const *)pick;
    *vrow = (const float *const *)(pick + j->nkeys);
    return n;
}

static void attn_one(const attn_job *j, int m, int h, float *s, const float **pick)
{
    const int D = j->D;
    const size_t hd = (size_t)j->H * D;
    const float *q = j->q + (size_t)m * hd + (size_t)h * D;
    float *o = j->out + (size_t)m * hd + (size_t)h * D;
    const size_t off = (size_t)(h / (j->H / j->KV)) * D;
    const float *const *krow, *const *vrow;
    const int n = attn_keys(j, m, &krow, &vrow, pick);

    if (n <= 0) {
        memset(o, 0, (size_t)D * sizeof *o);
        j->lse[(size_t)m * j->H + h] = -INFINITY;
        return;
    }
    float mx = -INFINITY;
    for (int c0 = 0; c0 < n; c0 += ATTN_CHUNK) {
        int cn = n - c0 < ATTN_CHUNK ? n - c0 : ATTN_CHUNK;
        attn_scores(j, q, krow + c0, off, cn, s);
        for (int i = 0; i < cn; i++)
            if (s[i] > mx)
                mx = s[i];
    }
    double l = 0.0;
    for (int c0 = 0; c0 < n; c0 += ATTN_CHUNK) {
        int cn = n - c0 < ATTN_CHUNK ? n - c0 : ATTN_CHUNK;
        if (n > ATTN_CHUNK)     /* else s still holds this (the only) chunk */
            attn_scores(j, q, krow + c0, off, cn, s);
        for (int i = 0; i < cn; i++) {
            s[i] = expf(s[i] - mx);
            l += s[i];
        }
        attn_pv(j, s, vrow + c0, off, cn, o, c0 == 0);
    }
    for (int d = 0; d < D; d++)
        o[d] = (float)(o[d] / l);
    j->lse[(size_t)m * j->H + h] = (float)(mx + log(l));
}

static void attn_task(void *ctx, int t)
{
    const attn_job *j = ctx;
    float s[ATTN_CHUNK];
    int pairs = j->M * j->H;
    const float **pick = j->pick ? j->pick + (size_t)t * 2 * (size_t)j->nkeys : NULL;
    for (int i = t; i < pairs; i += j->ntasks)
        attn_one(j, i / j->H, i % j->H, s, pick);
}

static int attn_run(const kern_ctx *c, attn_job j)
{
#if KERN_X86
    j.scalar_fma = cpu_has_fma();
#endif
    int T = pool_threads(c->pool);
    int pairs = j.M * j.H;
    /* A few tasks per thread evens out rows of different lengths. */
    j.ntasks = T == 1 ? 1 : (pairs < 8 * T ? pairs : 8 * T);
    if (j.mask) {
        j.pick = malloc((size_t)j.ntasks * 2 * (size_t)j.nkeys * sizeof *j.pick);
        if (!j.pick)
            return -1;
    }
    pool_run(c->pool, attn_task, &j, j.ntasks);
    free(j.pick);
    return 0;
}

void kern_attention(const kern_ctx *c, int M, const float *q, int H, int KV, int D,
                    float scale, const float *const *krow, const float *const *vrow,
                    const int *kbeg, const int *kend, float *out, float *lse)
{
    if (M <= 0 || H <= 0 || D <= 0)
        return;
    (void)attn_run(c, (attn_job){.M = M, .H = H, .KV = KV, .D = D, .scale = scale, .q = q,
                                 .krow = krow, .vrow = vrow, .kbeg = kbeg, .kend = kend,
                                 .out = out, .lse = lse, .isa = usable_isa(c->isa)});
}

int kern_attention_masked(const kern_ctx *c, int M, const float *q, int H, int KV, int D,
                          float scale, const float *const *krow, const float *const *vrow,
                          int nkeys, const uint8_t *mask, float *out, float *lse)
{
    if (M <= 0 || H <= 0 || D <= 0)
        return 0;
    return attn_run(c, (attn_job){.M = M, .H = H, .KV = KV, .D = D, .scale = scale, .q = q,
                           .krow = krow, .vrow = vrow, .mask = mask, .nkeys = nkeys,
                           .out = out, .lse = lse, .isa = usable_isa(c->isa)});
}

void kern_lse_merge(int M, int H, int D, float *out, float *lse, const float *out2,
                    const float *lse2)
{
    for (int i = 0; i < M * H; i++) {
        float a = lse[i], b = lse2[i];
        float *o = out + (size_t)i * D;
        const float *o2 = out2 + (size_t)i * D;
        if (b == -INFINITY)
            continue;
        if (a == -INFINITY) {
            memcpy(o, o2, (size_t)D * sizeof *o);
            lse[i] = b;
            continue;
        }
        float mx = a > b ? a : b;
        float wa = expf(a - mx), wb = expf(b - mx), sum = wa + wb;
        for (int d = 0; d < D; d++)
            o[d] = fmaf(o2[d], wb, o[d] * wa) / sum;
        lse[i] = mx + logf(sum);
    }
}
