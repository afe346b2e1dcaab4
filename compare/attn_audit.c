/* attn_audit.c — the test's attention against its own inputs. A
 * cross-runtime compare judges each row against the reference, so a bug
 * smaller than the runtime's drift there (a window one key short under a
 * bf16 cache, where dropping a key of 257 moves attn_out by 6% and the
 * cache's rounding alone by up to 7%) reads as drift. Its attention
 * output, though, must still be the softmax of its OWN recorded q, k and v
 * over the config's key set: only the attention kernel's rounding stands
 * between the two, never the drift of the layers before. Recomputing that
 * attention (kvdiff's own kernel, in float, the same order as the
 * engines) and comparing it with the test's attn_out finds such a bug at
 * its first position, with a margin measured in docs/cross-runtime.md. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/kernels.h"
#include "../model/safetensors.h"
#include "cmp_internal.h"

/* The runtime's precision, modelled: before recomputing, the recorded q,
 * k and v are rounded to the cache's type as a runtime rounds them on the
 * way into attention (the cache holds k and v in that type, and llama.cpp
 * converts each query row to the type its dot product with the cache
 * takes: bf16 for a bf16 cache, q8_0 blocks for a q8_0 one). What is left
 * is the attention kernel's own arithmetic. Measured on llama.cpp,
 * residuals of correct runs without the model / with it: gemma3-1b-shape
 * (640 tokens, bf16 cache) 0.0084 / see docs/cross-runtime.md;
 * tiny-gemma3 (600 tokens, q8_0 cache, flash attention) 0.028 / 0.0018.
 * The threshold keeps the drift model's allowance for a kernel's
 * rounding (crossrt.c) plus 4 unit roundoffs of the cache's type.
 *
 * A runtime that computes in a coarser type than its cache (bf16
 * activations) rounds the check's inputs and output in that type: the
 * threshold takes the coarser of the two unit roundoffs.
 *
 * Not checked: an f16 cache (and llama.cpp's flash attention, which reads
 * any cache as f16) unless the recording says its attention sums in f32
 * (engine_settings "attn_accumulator": "f32", as the Python recorder's
 * torch models do), nor a cache of unknown type. llama.cpp's CPU flash
 * attention sums the weighted values in f16 when decoding, measured at
 * 0.017 (35 unit roundoffs) over 640 keys and growing with them, so no
 * fixed bound holds (other f16 runtimes, an ANE, may do the same); and
 * there the drift model's own floor is tight enough to find the bugs the
 * check is for. */
#define AUDIT_BASE 4e-3
#define AUDIT_KV_FACTOR 4.0
#define AUDIT_ROWS 128   /* query rows recomputed at once */
/* For a runtime that computes in bf16 or f16, the residual is also
 * AUDIT_RMS_WEIGHT x the row's RMS-relative one. Measured in bf16 on the
 * torch model: its max-relative residual reaches 0.0077 with eager
 * attention (scores and probabilities rounded), and the RMS 0.0045, sdpa
 * 0.0017; a key left out of 257 at gemma3-1b-shape moves the row by 0.014
 * (max) and 0.0143 (RMS): under the threshold (0.0196) by the one, at
 * 1.46 x it by twice the other (docs/cross-runtime.md). */
#define AUDIT_RMS_WEIGHT 2.0

typedef enum { ROUND_NONE, ROUND_BF16, ROUND_F16, ROUND_Q8_0, ROUND_Q4_0 } audit_round;

/* ggml's q8_0: blocks of 32, scale max|x| / 127 stored as f16, values
 * rounded to integers. n is a multiple of 32 (head_dim is, where q8_0 is
 * allowed); a tail is left as is. */
static void round_q8_0(float *x, size_t n)
{
    for (size_t b = 0; b + 32 <= n; b += 32) {
        float amax = 0;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(x[b + i]));
        const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0;
        const float dh = st_f16_to_f32(st_f32_to_f16(d));
        for (int i = 0; i < 32; i++)
            x[b + i] = roundf(x[b + i] * id) * dh;
    }
}

/* ggml's q4_0: blocks of 32, step d = m / -8 where m is the block's value
 * of largest magnitude (its sign kept), stored as f16; each value goes to
 * the nearest of 16 levels (q - 8) d, q in 0..15, halves up. */
static void round_q4_0(float *x, size_t n)
{
    for (size_t b = 0; b + 32 <= n; b += 32) {
        float amax = 0, max = 0;
        for (int i = 0; i < 32; i++)
            if (fabsf(x[b + i]) > amax) {
                amax = fabsf(x[b + i]);
                max = x[b + i];
            }
        const float d = max / -8, id = d != 0 ? 1.0f / d : 0;
        const float dh = st_f16_to_f32(st_f32_to_f16(d));
        for (int i = 0; i < 32; i++) {
            const float q = floorf(x[b + i] * id + 8.5f);
            x[b + i] = ((q > 15 ? 15 : q) - 8) * dh;
        }
    }
}

/* Rows of width w, each rounded as the runtime holds it. rot: the block
 * size of the Walsh-Hadamard rotation the runtime quantizes them under (0
 * none; llama.cpp's attn_rot_k for q and k, attn_rot_v for v): rotated,
 * rounded, rotated back (the rotation is its own inverse). */
static void round_rows(audit_round how, float *x, size_t rows, int w, int rot)
{
    const size_t n = rows * (size_t)w;
    if (how == ROUND_BF16)
        for (size_t i = 0; i < n; i++)
            x[i] = st_bf16_to_f32(st_f32_to_bf16(x[i]));
    else if (how == ROUND_F16)
        for (size_t i = 0; i < n; i++)
            x[i] = st_f16_to_f32(st_f32_to_f16(x[i]));
    else if ((how == ROUND_Q8_0 || how == ROUND_Q4_0) && w % 32 == 0) {
        if (rot > 0)
            kern_hadamard_blocks(x, n, rot);
        if (how == ROUND_Q8_0)
            round_q8_0(x, n);
        else
            round_q4_0(x, n);
        if (rot > 0)
            kern_hadamard_blocks(x, n, rot);
    }
}

/* A rotation block size from the test's settings: a power of two from 32
 * up to KERN_HADAMARD_MAX that divides head_dim, else 0. */
static int rotation(const cmp_source *test, const char *key, int head_dim)
{
    const long b = cmp_settings_int(test, key, 0);
    return b >= 32 && b <= KERN_HADAMARD_MAX && !(b & (b - 1)) && head_dim % b == 0 ? (int)b
                                                                                    : 0;
}

/* How q, k and v are rounded on the way in: the cache's type, or the
 * compute type where that is the coarser (bf16 activations over an f32
 * or f16 cache). */
static audit_round rounding_of(const cmp_xrt *m)
{
    if (!strcmp(m->kv_precision, "q8_0"))
        return ROUND_Q8_0;
    if (!strcmp(m->kv_precision, "q4_0"))
        return ROUND_Q4_0;
    /* (crossrt.c names both types canonically) */
    if (!strcmp(m->kv_precision, "bf16") ||
        (m->compute_stated && !strcmp(m->compute_precision, "bf16")))
        return ROUND_BF16;
    if (!strcmp(m->kv_precision, "f16") ||
        (m->compute_stated && !strcmp(m->compute_precision, "f16")))
        return ROUND_F16;
    return ROUND_NONE;
}

/* How queries are rounded against keys held as how: ggml's dot product
 * of a q4_0 key takes the query as q8_0 blocks (its vec_dot_type), as it
 * does for q8_0 keys. */
static audit_round query_rounding(audit_round how)
{
    return how == ROUND_Q4_0 ? ROUND_Q8_0 : how;
}

/* Whether the check runs on this test, and why not (m->audit_skip). */
static bool audit_model(const cmp_source *test, cmp_xrt *m)
{
    /* A block-quantized cache's rounding is modelled to the level: what
     * is left are levels that flip where the runtime's value sits near a
     * boundary. A coarser step flips less often by as much as each flip
     * moves more, so the allowance stays q8_0's: measured, correct q4_0
     * runs leave at most 0.0030 (tiny-gemma3, tiny-gemma4; 600 tokens,
     * ubatch 1 to the whole prompt) where q4_0's own unit would allow
     * 0.254, and one key left out of 600 moves the row by 0.20. */
    const double kv_eps = rounding_of(m) == ROUND_Q4_0 ? 0x1p-8 : m->kv_eps;
    const double eps = m->compute_stated && m->compute_eps > kv_eps ? m->compute_eps : kv_eps;
    m->audit_threshold = AUDIT_BASE + AUDIT_KV_FACTOR * eps;
    /* A runtime computing in bf16 or f16 rounds every output element:
     * rounding scatters over the row (its RMS stays near one unit
     * roundoff), where a key set that differs moves the whole row. */
    const bool coarse = m->compute_stated && (!strcmp(m->compute_precision, "bf16") ||
                                              !strcmp(m->compute_precision, "f16"));
    m->audit_rms_weight = coarse ? AUDIT_RMS_WEIGHT : 0;
    if (!strcmp(m->kv_precision, "unknown"))
        snprintf(m->audit_skip, sizeof m->audit_skip, "the test's KV cache type is not "
                 "recorded");
    else if (m->kv_eps == 0x1p-11 && !cmp_settings_is(test, "attn_accumulator", "f32"))
        snprintf(m->audit_skip, sizeof m->audit_skip, "the test %s, and its attention may sum "
                 "values in f16: no fixed bound",
                 strcmp(m->kv_precision, "f16 (flash)") ? "holds its KV cache in f16"
                                                        : "reads its cache as f16 (flash attention)");
    else
        m->audit_skip[0] = 0;
    return !m->audit_skip[0];
}

/* Row-relative residual of one attention row (cmp_residual). */
static double residual(const float *a, const float *b, int n, double rms_weight)
{
    cmp_residual r = {0};
    for (int i = 0; i < n; i++) {
        if (!isfinite(a[i]) || !isfinite(b[i]))
            return INFINITY;
        cmp_residual_add(&r, a[i], b[i]);
    }
    return cmp_residual_value(&r, rms_weight);
}

/* One layer's buffers. */
typedef struct {
    float *k, *v;                /* (hi + 1, KV*D): the owner's keys and values from 0 */
    const float **krow, **vrow;
    float *q, *rec, *out, *lse;  /* (AUDIT_ROWS, H*D), (AUDIT_ROWS, H) */
    int *kbeg, *kend;
} audit_buf;

static void buf_free(audit_buf *b)
{
    free(b->k);
    free(b->v);
    free(b->krow);
    free(b->vrow);
    free(b->q);
    free(b->rec);
    free(b->out);
    free(b->lse);
    free(b->kbeg);
    free(b->kend);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------------ */
/* The test as the check sees it                                        */

typedef struct {
    const cmp_source *in;
    audit_round how;
} modelled;

static int m_info(void *ctx, int layer, kv_stage st, int64_t *first, int64_t *rows, int *cols)
{
    const modelled *m = ctx;
    return m->in->info(m->in->ctx, layer, st, first, rows, cols);
}

static int m_read(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, float *out,
                  kv_err *e)
{
    const modelled *m = ctx;
    const int rc = m->in->read(m->in->ctx, layer, st, pos0, n, out, e);
    if (rc == 0 && (st == STAGE_Q || st == STAGE_K || st == STAGE_V)) {
        /* Widths and rotation blocks of this layer (Gemma 4's differ). */
        const kv_config *c = &m->in->cfg;
        const int D = config_layer_head_dim(c, layer);
        const int cols = (st == STAGE_Q ? c->n_heads : config_layer_kv_heads(c, layer)) *
                         (st == STAGE_V ? config_layer_v_head_dim(c, layer) : D);
        round_rows(st == STAGE_Q ? query_rounding(m->how) : m->how, out, (size_t)n, cols,
                   rotation(m->in, st == STAGE_V ? "attn_rot_v" : "attn_rot_k", D));
    }
    return rc;
}

static int m_output_info(void *ctx, int64_t *first, int64_t *rows, int *k)
{
    const modelled *m = ctx;
    return m->in->output_info ? m->in->output_info(m->in->ctx, first, rows, k) : 1;
}

static int m_output(void *ctx, int64_t pos0, int64_t n, float *lse, int32_t *ids, float *vals,
                    kv_err *e)
{
    const modelled *m = ctx;
    return m->in->output(m->in->ctx, pos0, n, lse, ids, vals, e);
}

void *cmp_xrt_modelled_source(const cmp_source *test, const cmp_xrt *x, cmp_source *out)
{
    modelled *m = malloc(sizeof *m);
    if (!m)
        return NULL;
    *m = (modelled){.in = test, .how = rounding_of(x)};
    *out = *test;
    out->ctx = m;
    out->info = m_info;
    out->read = m_read;
    out->read_hash = NULL;
    out->read_stats = NULL;
    out->prepare_parallel = NULL;
    out->read_parallel = NULL;
    out->digest = NULL;
    out->output_info = m_output_info;
    out->output = test->output ? m_output : NULL;
    out->prefetch = NULL;
    out->check = NULL;
    return m;
}

/* Whether the reference's own attention at (layer, p) is reproduced by the
 * same recomputation: a guard against a config the recomputation does not
 * model. True when the reference does not record the rows to check. */
static bool reference_agrees(cmp_ctx *c, int layer, int64_t p, kv_err *e, int *rc)
{
    const kv_config *cfg = c->cfg;
    const int qf = cfg->n_heads * config_layer_head_dim(cfg, layer);
    const int of = cfg->n_heads * config_layer_v_head_dim(cfg, layer);
    float *q = malloc((size_t)qf * 2 * sizeof *q);
    double *out = malloc((size_t)qf * sizeof *out), *lse = malloc((size_t)cfg->n_heads *
                                                                   sizeof *lse);
    bool ok = true;
    if (!q || !out || !lse) {
        *rc = kv_errf(e, "compare: out of memory checking attention");
    } else if (cmp_read_row(c->ref, layer, STAGE_Q, p, qf, q, e) == 0 &&
               cmp_read_row(c->ref, layer, STAGE_ATTN_OUT, p, of, q + qf, e) == 0) {
        const int W = config_layer_window(cfg, layer);
        cmp_hyp h = {.lo = W > 0 && p - W + 1 > 0 ? p - W + 1 : 0, .hi = p};
        const int r = cmp_recompute_attention(c->ref, cfg, layer, q, &h, lse, out, e);
        if (r < 0)
            *rc = -1;
        else if (r == 0)
            ok = cmp_attention_err(cfg, layer, lse, out, NULL, q + qf, 0) <= CMP_MATCH_TOL;
    }
    free(q);
    free(out);
    free(lse);
    return ok;
}

/* Residuals of `layer` at positions lo .. hi into res[p] (res holds every
 * position from 0), up to and including the first above the threshold
 * (*first, -1 none). */
static int audit_layer(cmp_ctx *c, const kern_ctx *kc, int layer, int64_t lo, int64_t hi,
                       float *res, int64_t *first, kv_err *e)
{
    const cmp_xrt *m = &c->r->xrt;
    const kv_config *cfg = c->cfg;
    const int H = cfg->n_heads, KV = config_layer_kv_heads(cfg, layer);
    const int D = config_layer_head_dim(cfg, layer);
    const int qf = H * D, kvf = KV * D, owner = cfg->kv_owner[layer];
    const int W = config_layer_window(cfg, layer);
    *first = -1;
    /* A sink model's attention needs its sink logits (recovered from the
     * reference, compare.c): without them the layer is not checked. */
    const float *sinks = cfg->attn_sinks && c->test->sink_logits
                             ? c->test->sink_logits + (size_t)layer * H : NULL;
    if (cfg->attn_sinks && (!sinks || isnan(sinks[0])))
        return 0;
    audit_buf b = {0};
    const size_t nk = (size_t)hi + 1;
    b.k = malloc(nk * kvf * sizeof *b.k);
    b.v = malloc(nk * kvf * sizeof *b.v);
    b.krow = malloc(nk * sizeof *b.krow);
    b.vrow = malloc(nk * sizeof *b.vrow);
    b.q = malloc((size_t)AUDIT_ROWS * qf * sizeof *b.q);
    b.rec = malloc((size_t)AUDIT_ROWS * qf * sizeof *b.rec);
    b.out = malloc((size_t)AUDIT_ROWS * qf * sizeof *b.out);
    b.lse = malloc((size_t)AUDIT_ROWS * H * sizeof *b.lse);
    b.kbeg = malloc(AUDIT_ROWS * sizeof *b.kbeg);
    b.kend = malloc(AUDIT_ROWS * sizeof *b.kend);
    if (!b.k || !b.v || !b.krow || !b.vrow || !b.q || !b.rec || !b.out || !b.lse || !b.kbeg ||
        !b.kend) {
        buf_free(&b);
        return kv_errf(e, "compare: out of memory checking attention");
    }
    int rc = 0;
    const audit_round how = rounding_of(m);
    if (c->test->read(c->test->ctx, owner, STAGE_K, 0, (int64_t)nk, b.k, e) < 0 ||
        c->test->read(c->test->ctx, owner, STAGE_V, 0, (int64_t)nk, b.v, e) < 0)
        rc = -1;
    const int rot_k = rotation(c->test, "attn_rot_k", D), rot_v = rotation(c->test, "attn_rot_v", D);
    round_rows(how, b.k, nk, kvf, rot_k);
    round_rows(how, b.v, nk, kvf, rot_v);
    for (size_t j = 0; j < nk; j++) {
        b.krow[j] = b.k + j * kvf;
        b.vrow[j] = b.v + j * kvf;
    }
    const float scale = (float)cfg->attn_scale;
    for (int64_t p0 = lo; rc == 0 && p0 <= hi && *first < 0; p0 += AUDIT_ROWS) {
        const int n = (int)(hi - p0 + 1 < AUDIT_ROWS ? hi - p0 + 1 : AUDIT_ROWS);
        if (c->test->read(c->test->ctx, layer, STAGE_Q, p0, n, b.q, e) < 0 ||
            c->test->read(c->test->ctx, layer, STAGE_ATTN_OUT, p0, n, b.rec, e) < 0) {
            rc = -1;
            break;
        }
        round_rows(query_rounding(how), b.q, (size_t)n, qf, rot_k);
        for (int i = 0; i < n; i++) {
            const int64_t p = p0 + i;
            b.kbeg[i] = (int)(W > 0 && p - W + 1 > 0 ? p - W + 1 : 0);
            b.kend[i] = (int)p + 1;
        }
        kern_attention(kc, n, b.q, H, KV, D, scale, b.krow, b.vrow, b.kbeg, b.kend, b.out,
                       b.lse);
        if (sinks)   /* the sink joins each softmax, as the engines add it */
            kern_attn_sinks(n, H, D, sinks, b.lse, b.out, NULL, NULL);
        for (int i = 0; i < n; i++) {
            const double r = residual(b.out + (size_t)i * qf, b.rec + (size_t)i * qf, qf,
                                      m->audit_rms_weight);
            res[p0 + i] = (float)r;
            if (!(r <= m->audit_threshold)) {
                *first = p0 + i;
                break;
            }
        }
    }
    buf_free(&b);
    return rc;
}

/* The index in r->stages of (layer, attn_out), -1 when not compared. */
static int stage_index(const cmp_result *r, int layer)
{
    for (int i = 0; i < r->n_stages; i++)
        if (r->stages[i].layer == layer && r->stages[i].stage == STAGE_ATTN_OUT)
            return i;
    return -1;
}

/* The largest residual strictly before (pos, layer) in walk order (pos -1:
 * every one) into m->audit_worst*. res: (L, P) with NaN where not checked. */
static void closest(cmp_xrt *m, const float *res, int L, int64_t P, int64_t pos, int layer)
{
    for (int l = 0; l < L; l++)
        for (int64_t p = 0; p < P; p++) {
            if (pos >= 0 && (p > pos || (p == pos && l >= layer)))
                continue;
            const float r = res[(size_t)l * P + p];
            if (r == r && r > m->audit_worst_residual) {
                m->audit_worst_residual = r;
                m->audit_worst_pos = p;
                m->audit_worst_layer = l;
            }
        }
    m->audit_worst = m->audit_threshold > 0 ? m->audit_worst_residual / m->audit_threshold : 0;
}

int cmp_xrt_audit(cmp_ctx *c, int64_t *pos, int *stage_i, double *err, kv_err *e)
{
    cmp_xrt *m = &c->r->xrt;
    const kv_config *cfg = c->cfg;
    *pos = -1;
    *stage_i = -1;
    m->audit_worst = m->audit_worst_residual = 0;
    m->audit_worst_pos = -1;
    m->audit_worst_layer = -1;
    m->audit_layers = 0;
    if (!audit_model(c->test, m) || !c->test->read || cfg->n_heads <= 0 || cfg->n_kv_heads <= 0 ||
        cfg->n_heads % cfg->n_kv_heads || c->r->compared.pos_hi < 0 ||
        c->r->compared.pos_hi >= INT32_MAX)
        return 0;
    if (config_mla(cfg)) {
        /* The runtime's rounding is the latent's (what its cache holds),
         * which expanded k and v do not show: not modelled here. */
        snprintf(m->audit_skip, sizeof m->audit_skip, "latent (MLA) attention is not checked "
                 "(a latent cache rounds the latent, not the expanded k and v recorded)");
        return 0;
    }
    const int L = cfg->n_layers;
    const int64_t P = c->r->compared.pos_hi + 1;
    float *res = malloc((size_t)L * (size_t)P * sizeof *res);
    if (!res)
        return kv_errf(e, "compare: out of memory checking attention");
    for (size_t i = 0; i < (size_t)L * (size_t)P; i++)
        res[i] = NAN;
    /* The walker's threads split the rows (kern_attention gives the same
     * bits for any split). */
    const kern_ctx kc = {.isa = kern_isa_best(), .pool = c->pool};
    int64_t best = P - 1;   /* later layers need positions before the step found so far */
    int best_layer = -1, rc = 0;
    for (int l = 0; rc == 0 && l < L; l++) {
        const int owner = cfg->kv_owner[l], si = stage_index(c->r, l);
        const int qf = cfg->n_heads * config_layer_head_dim(cfg, l);
        const int kvf = config_layer_kv_heads(cfg, l) * config_layer_head_dim(cfg, l);
        int64_t qlo, qhi, olo, ohi, klo, khi, vlo, vhi;
        if (si < 0 || cmp_source_held(c->test, l, STAGE_Q, qf, &qlo, &qhi) ||
            cmp_source_held(c->test, l, STAGE_ATTN_OUT, qf, &olo, &ohi) ||
            cmp_source_held(c->test, owner, STAGE_K, kvf, &klo, &khi) ||
            cmp_source_held(c->test, owner, STAGE_V, kvf, &vlo, &vhi) || klo > 0 || vlo > 0)
            continue;
        /* Positions whose query, output and every key are recorded, and
         * that the compare reaches (the token cut bounds it). */
        const cmp_stage_result *sr = &c->r->stages[si];
        int64_t lo = qlo > olo ? qlo : olo, hi = qhi < ohi ? qhi : ohi;
        hi = hi < khi ? hi : khi;
        hi = hi < vhi ? hi : vhi;
        lo = lo > sr->pos_lo ? lo : sr->pos_lo;
        hi = hi < sr->pos_hi ? hi : sr->pos_hi;
        hi = hi < (best_layer >= 0 ? best - 1 : best) ? hi : (best_layer >= 0 ? best - 1 : best);
        if (lo > hi)
            continue;
        m->audit_layers++;
        int64_t first;
        float *row = res + (size_t)l * (size_t)P;
        if (audit_layer(c, &kc, l, lo, hi, row, &first, e) < 0) {
            rc = -1;
            break;
        }
        if (first < 0)
            continue;
        const bool ok = reference_agrees(c, l, first, e, &rc);
        if (rc < 0)
            break;
        if (!ok) {   /* this layer's attention is not what the recomputation models */
            m->audit_layers--;
            for (int64_t p = 0; p < P; p++)
                row[p] = NAN;
            cmp_note(c->r, "attention check: layer %d left out, the reference's own attn_out "
                     "at position %lld is not reproduced from its q, k, v", l, (long long)first);
            continue;
        }
        *pos = best = first;
        *stage_i = si;
        *err = row[first];
        best_layer = l;
    }
    if (rc == 0)
        closest(m, res, L, P, *pos, best_layer);
    if (rc == 0 && m->audit_layers == 0)
        snprintf(m->audit_skip, sizeof m->audit_skip, "the test records no layer's attn_out "
                 "together with its q, k and v");
    free(res);
    return rc;
}
