/* plants.h — the bugs ports make, as the recordings of a port show them,
 * planted into a copy of the reference's recording (tests/
 * check_hypotheses.c, bench/diag_sweep.c): attention rows recomputed
 * over the key set the bug reads (cmp_memrec_plant_attention), or K/V and
 * norm rows rewritten as the bug writes them. Each family says the
 * diagnosis it must get. Header-only: both programs include it. */
#ifndef KV_TESTS_PLANTS_H
#define KV_TESTS_PLANTS_H

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "chunked/chunked.h"
#include "compare/cmp_internal.h"
#include "model/generate.h"
#include "model/kernels.h"
#include "model/model.h"
#include "model/pcg32.h"
#include "reference/reference.h"

/* Where and how: the prompt length, the recording's positions, and the
 * family's parameter (a window, a key, a slot, a chunk). */
typedef struct {
    int64_t P, T;
    int64_t n;
} plant_arg;

/* A greedy run of P random ids (drawn from seed) plus nnew decode steps
 * through the reference engine (o NULL) or the chunked one, into a new
 * in-memory recording with or without attn_lse and attn_nkeys (counts)
 * and without full logits. NULL with e filled on failure. */
static inline cmp_memrec *plant_record(const kv_model *m, int P, int nnew, uint64_t seed,
                                       const chk_opts *o, const char *settings, bool counts,
                                       kv_err *e)
{
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    mo.stages[STAGE_ATTN_LSE] = counts;
    mo.stages[STAGE_ATTN_NKEYS] = counts;
    mo.stages[STAGE_LOGITS] = false;
    cmp_memrec *rec = cmp_memrec_new(&m->cfg, o ? "chunked" : "reference", settings, &mo, e);
    int32_t *prompt = rec ? malloc((size_t)P * sizeof *prompt) : NULL;
    if (!prompt) {
        if (rec)
            kv_errf(e, "plant: out of memory");
        cmp_memrec_free(rec);
        return NULL;
    }
    kv_observer *obs = cmp_memrec_observer(rec);
    kv_engine *eng;
    if (o) {
        chk_opts co = *o;
        co.max_ctx = P + nnew;
        eng = chk_create(m, &kc, &co, obs, e);
    } else {
        ref_opts ro = {.max_ctx = P + nnew, .prefill_step = 0};
        eng = ref_create(m, &kc, &ro, obs, e);
    }
    pcg32 r;
    pcg32_seed(&r, seed, 0x70);
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)pcg32_bounded(&r, (uint32_t)m->cfg.vocab);
    gen_opts go = {.max_new = nnew, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    const bool ok = eng && generate(eng, &m->cfg, prompt, P, &go, obs, &res, e) == 0;
    if (ok)
        gen_result_free(&res);
    engine_free(eng);
    free(prompt);
    if (!ok) {
        cmp_memrec_free(rec);
        return NULL;
    }
    return rec;
}

typedef bool (*plant_keys_fn)(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                              cmp_hyp *h);
typedef void (*plant_rows_fn)(const plant_arg *a, cmp_memrec *rec, const kv_model *m);

typedef struct {
    const char *name;
    plant_keys_fn keys;          /* attention read over these keys, or */
    plant_rows_fn rows;          /* rows rewritten first (then keys, when both) */
    cmp_diag_kind kind;          /* what the diagnosis must name */
} plant_family;

static inline int64_t plant_lo(int W, int64_t q)
{
    return W > 0 && q - W + 1 > 0 ? q - W + 1 : 0;
}

/* A sliding window of n keys on every sliding layer (W - 1, W + 1, ...). */
static inline bool plant_window(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                cmp_hyp *h)
{
    if (config_layer_window(cfg, L) <= 0)
        return false;
    h->lo = plant_lo((int)a->n, q);
    return true;
}

/* The global layers read through a window of n (a split local/global
 * cache). */
static inline bool plant_global_windowed(const plant_arg *a, const kv_config *cfg, int L,
                                         int64_t q, cmp_hyp *h)
{
    if (config_layer_window(cfg, L) > 0)
        return false;
    h->lo = plant_lo((int)a->n, q);
    return true;
}

/* Sliding layer n run as global (layer types off by one). */
static inline bool plant_layer_global(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                      cmp_hyp *h)
{
    (void)cfg;
    (void)q;
    if (L != a->n)
        return false;
    h->lo = 0;
    return true;
}

/* Decode steps never see the prompt's keys. */
static inline bool plant_decode_blind(const plant_arg *a, const kv_config *cfg, int L,
                                      int64_t q, cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < a->P)
        return false;
    h->lo = h->lo > a->P ? h->lo : a->P;
    return true;
}

/* Decode reads n unwritten (zero) slots of a padded prefill cache. */
static inline bool plant_padded(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < a->P)
        return false;
    h->extra_zero = (int)a->n;
    return true;
}

/* An AR cache whose write index is stuck at slot n from the first decode
 * step: slot n holds the newest key, the decode positions' slots stay
 * zero (a sliding layer whose window has left slot n behind still reads
 * its own slot unwritten). */
static inline bool plant_stuck(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                               cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < a->P || (a->n == a->P && q == a->P))
        return false;
    h->nsubst = 1;
    h->from[0] = a->n, h->to[0] = q;
    h->zero_lo = a->n == a->P ? a->P + 1 : a->P, h->zero_hi = q + 1;
    return true;
}

/* The query's own key masked out (j < q). */
static inline bool plant_own_masked(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                    cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    (void)L;
    h->hi = q - 1;
    return true;
}

/* Prefill chunks of n attending only to themselves, decode steps too. */
static inline bool plant_isolated(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                  cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    const int64_t cs = q >= a->P ? q : (q / a->n) * a->n;
    if (cs <= h->lo)
        return false;
    h->lo = cs;
    return true;
}

/* No causal mask in a prefill chunk of n: the chunk's later keys read. */
static inline bool plant_future(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q >= a->P)
        return false;
    const int64_t end = (q / a->n) * a->n + a->n - 1;
    h->hi = end < a->P - 1 ? end : a->P - 1;
    return h->hi > q;
}

/* Key n dropped from the cache once the prompt ran (every layer). */
static inline bool plant_drop_key(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                  cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < a->P || a->n < h->lo)
        return false;
    h->skip_one = true, h->skip_pos = a->n;
    return true;
}

/* Key n in the cache twice once the prompt ran (every layer). */
static inline bool plant_dup_key(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                 cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    if (q < a->P || a->n < h->lo)
        return false;
    h->dup_one = true, h->dup_pos = a->n;
    return true;
}

/* Every layer's attention recomputed from its (rewritten) k, v, from P. */
static inline bool plant_all_from_P(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                    cmp_hyp *h)
{
    (void)cfg;
    (void)L;
    (void)h;
    return q >= a->P;
}

/* Layer 0's attention from its rewritten k, v. */
static inline bool plant_layer0(const plant_arg *a, const kv_config *cfg, int L, int64_t q,
                                cmp_hyp *h)
{
    (void)a;
    (void)cfg;
    (void)q;
    (void)h;
    return L == 0;
}

/* The K = V = 0 of KV-shared ports: nothing written from position P on. */
static inline void plant_zero_kv(const plant_arg *a, cmp_memrec *rec, const kv_model *m)
{
    for (int L = 0; L < m->cfg.n_layers; L++)
        for (int64_t q = a->P; q < a->T; q++)
            for (int st = STAGE_K; st <= STAGE_V; st++) {
                int cols;
                float *row = cmp_memrec_row(rec, L, (kv_stage)st, q, &cols);
                if (row)
                    memset(row, 0, (size_t)cols * sizeof(float));
            }
}

/* k and v weights swapped on layer 0: k = RoPE(k_norm(W_v x)), v = W_k x,
 * from the reference's rows (W_k x up to the scale the norm drops: its k
 * rotated back, over the norm's gain). RoPE at q is the rotation back at
 * -q. */
static inline void plant_kv_swapped(const plant_arg *a, cmp_memrec *rec, const kv_model *m)
{
    const kv_config *cfg = &m->cfg;
    const int KV = cfg->n_kv_heads, D = cfg->head_dim, n = KV * D;
    const float *w = m->layers[0].k_norm;
    double *u = malloc((size_t)n * sizeof(double));
    float *kn = malloc((size_t)n * sizeof(float)), *vk = malloc((size_t)n * sizeof(float));
    for (int64_t q = 0; q < a->T && u && kn && vk; q++) {
        float *k = cmp_memrec_row(rec, 0, STAGE_K, q, NULL);
        float *v = cmp_memrec_row(rec, 0, STAGE_V, q, NULL);
        if (!k || !v)
            continue;
        for (int hd = 0; hd < KV; hd++) {
            double ms = 0;
            for (int d = 0; d < D; d++)
                ms += (double)v[hd * D + d] * v[hd * D + d];
            const double inv = w ? 1.0 / sqrt(ms / D + cfg->rms_eps) : 1.0;
            for (int d = 0; d < D; d++) {
                const double g = !w ? 1.0 : cfg->norm_plus_one ? 1.0 + w[d] : w[d];
                kn[hd * D + d] = (float)(v[hd * D + d] * inv * g);
            }
        }
        cmp_rope_unrotate(cfg, 0, q, k, KV, u);
        for (int i = 0; i < n; i++) {
            const double g = !w ? 1.0 : cfg->norm_plus_one ? 1.0 + w[i % D] : w[i % D];
            vk[i] = (float)(u[i] / g);
        }
        cmp_rope_unrotate(cfg, 0, -q, kn, KV, u);
        for (int i = 0; i < n; i++)
            k[i] = (float)u[i];
        memcpy(v, vk, (size_t)n * sizeof(float));
    }
    free(u);
    free(kn);
    free(vk);
}

/* Decode reads n slots holding values the recording never saw (a padded
 * cache not zeroed): layer 0's attention from P on over the config's keys
 * plus n keys and values drawn at random, larger than the recorded. */
static inline void plant_garbage_slots(const plant_arg *a, cmp_memrec *rec, const kv_model *m)
{
    const kv_config *cfg = &m->cfg;
    const int H = cfg->n_heads, KV = cfg->n_kv_heads, D = cfg->head_dim, rep = H / KV;
    const double scale = cfg->attn_scale > 0 ? cfg->attn_scale : 1.0 / sqrt((double)D);
    const int W = config_layer_window(cfg, 0);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    double *acc = malloc((size_t)D * sizeof *acc);
    float *gk = malloc((size_t)D * sizeof *gk), *gv = malloc((size_t)D * sizeof *gv);
    for (int64_t q = a->P; q < a->T && acc && gk && gv; q++) {
        float *qr = cmp_memrec_row(rec, 0, STAGE_Q, q, NULL);
        float *o = cmp_memrec_row(rec, 0, STAGE_ATTN_OUT, q, NULL);
        float *l = cmp_memrec_row(rec, 0, STAGE_ATTN_LSE, q, NULL);
        float *nk = cmp_memrec_row(rec, 0, STAGE_ATTN_NKEYS, q, NULL);
        if (!qr || !o)
            continue;
        for (int h = 0; h < H; h++) {
            const int kh = h / rep;
            double mx = -INFINITY, sum = 0;
            int nkeys = 0;
            memset(acc, 0, (size_t)D * sizeof *acc);
            for (int64_t j = plant_lo(W, q); j <= q + a->n; j++, nkeys++) {
                const float *k, *v;
                if (j <= q) {
                    k = cmp_memrec_row(rec, 0, STAGE_K, j, NULL) + kh * D;
                    v = cmp_memrec_row(rec, 0, STAGE_V, j, NULL) + kh * D;
                } else {
                    for (int d = 0; d < D; d++) {   /* xorshift: 2 x the recorded scale */
                        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                        gk[d] = (float)((double)(s >> 11) / 9007199254740992.0 * 4 - 2);
                        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                        gv[d] = (float)((double)(s >> 11) / 9007199254740992.0 * 4 - 2);
                    }
                    k = gk, v = gv;
                }
                double dot = 0;
                for (int d = 0; d < D; d++)
                    dot += (double)qr[h * D + d] * k[d];
                const double sc = dot * scale, m2 = fmax(mx, sc);
                const double f = exp(mx - m2), w = exp(sc - m2);
                sum = sum * f + w;
                for (int d = 0; d < D; d++)
                    acc[d] = acc[d] * f + w * v[d];
                mx = m2;
            }
            for (int d = 0; d < D; d++)
                o[h * D + d] = (float)(acc[d] / sum);
            if (l)
                l[h] = (float)(mx + log(sum));
            if (nk)
                nk[h] = (float)nkeys;
        }
    }
    free(acc);
    free(gk);
    free(gv);
}

/* RMSNorm with eps 1e-2 in the input norm of layer 0. */
static inline void plant_norm_eps(const plant_arg *a, cmp_memrec *rec, const kv_model *m)
{
    const int E = m->cfg.hidden;
    for (int64_t q = 0; q < a->T; q++) {
        float *x = cmp_memrec_row(rec, 0, STAGE_X_IN, q, NULL);
        float *y = cmp_memrec_row(rec, 0, STAGE_ATTN_NORM, q, NULL);
        if (!x || !y)
            continue;
        double ms = 0;
        for (int i = 0; i < E; i++)
            ms += (double)x[i] * x[i];
        ms /= E;
        const double f = sqrt((ms + m->cfg.rms_eps) / (ms + 1e-2));
        for (int i = 0; i < E; i++)
            y[i] = (float)(y[i] * f);
    }
}

typedef struct {
    const plant_arg *a;
    plant_keys_fn f;
} plant_cb_ctx;

static inline bool plant_cb(void *ctx, const kv_config *cfg, int layer, int64_t q, cmp_hyp *h)
{
    const plant_cb_ctx *p = ctx;
    return p->f(p->a, cfg, layer, q, h);
}

/* Plants family f with argument a into rec. 0, or -1 with e filled. */
static inline int plant_apply(const plant_family *f, const plant_arg *a, cmp_memrec *rec,
                              const kv_model *m, kv_err *e)
{
    if (f->rows)
        f->rows(a, rec, m);
    plant_cb_ctx pc = {a, f->keys};
    if (!f->keys)
        return 0;
    /* A sink model: the model's own sink logits (an attn_out-only
     * recording holds nothing to recover them from). */
    const int H = m->cfg.n_heads, L = m->cfg.n_layers;
    float *sinks = m->cfg.attn_sinks ? (float *)malloc((size_t)L * H * sizeof *sinks) : NULL;
    if (m->cfg.attn_sinks && !sinks)
        return kv_errf(e, "plant: out of memory");
    for (int l = 0; sinks && l < L; l++)
        memcpy(sinks + (size_t)l * H, m->layers[l].sinks, (size_t)H * sizeof *sinks);
    int rc = cmp_memrec_plant_attention_sinks(rec, &m->cfg, plant_cb, &pc, sinks, e);
    free(sinks);
    return rc;
}

#endif
