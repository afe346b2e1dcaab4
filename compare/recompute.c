/* recompute.c — the comparer's own arithmetic on recorded rows: attention
 * of one query over a hypothesised key set (in double, streaming the keys
 * in blocks so memory stays bounded), and the RoPE offset that maps one
 * recorded query to another. Both are checks, not engines: they need only
 * reproduce a recording to ~1e-6, never bit for bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/kernels.h"
#include "cmp_internal.h"

#define KEY_BLOCK 64

int64_t cmp_hyp_nkeys(const cmp_hyp *h)
{
    return (h->hi >= h->lo ? h->hi - h->lo + 1 : 0) + h->extra_zero -
           (h->skip_one && h->skip_pos >= h->lo && h->skip_pos <= h->hi) +
           (h->dup_one && h->dup_pos >= h->lo && h->dup_pos <= h->hi);
}

static double attn_scale(const kv_config *c)
{
    if (c->attn_scale > 0)
        return (float)c->attn_scale;   /* the engines multiply by it as a float */
    if (c->query_pre_attn_scalar > 0)
        return (float)(1.0 / sqrt(c->query_pre_attn_scalar));
    return (float)(1.0 / sqrt((double)config_max_head_dim(c)));
}

/* Online softmax state of every head. */
typedef struct {
    int H, KV, D, Dv;            /* Dv: values per head (MLA's v_head_dim; else D) */
    double scale;
    const float *q;
    double *m, *s, *acc;         /* (H), (H), (H, Dv) */
    const float *sink;           /* (H) the layer's sink logits, or NULL */
} softmax_state;

/* The layer's sink logits from the source, when the model has sinks. */
static const float *layer_sinks(const cmp_source *src, const kv_config *cfg, int layer)
{
    if (!cfg->attn_sinks || !src->sink_logits || layer < 0 || layer >= cfg->n_layers)
        return NULL;
    const float *s = src->sink_logits + (size_t)layer * cfg->n_heads;
    return isnan(s[0]) ? NULL : s;   /* NaN: not recovered for this layer */
}

/* A sink joins the softmax's denominator: each head's output keeps
 * exp(lse) / (exp(lse) + exp(sink)) of itself (lse over the keys, as
 * attn_lse records it, is unchanged). */
static void apply_sinks(const float *sink, int H, int D, const double *lse, double *out)
{
    for (int h = 0; sink && h < H; h++) {
        if (!isfinite(lse[h]))
            continue;
        const double keep = 1.0 / (1.0 + exp((double)sink[h] - lse[h]));
        for (int d = 0; d < D; d++)
            out[(size_t)h * D + d] *= keep;
    }
}

/* One key (k, v: KV*D floats; NULL = K = V = 0) into every head. */
static void add_key(softmax_state *st, const float *k, const float *v)
{
    const int group = st->H / st->KV;
    for (int h = 0; h < st->H; h++) {
        const int kh = h / group;
        double score = 0;
        if (k) {
            const float *qh = st->q + (size_t)h * st->D, *kk = k + (size_t)kh * st->D;
            for (int d = 0; d < st->D; d++)
                score += (double)qh[d] * (double)kk[d];
            score *= st->scale;
        }
        double *acc = st->acc + (size_t)h * st->Dv;
        if (score > st->m[h]) {
            const double f = exp(st->m[h] - score);
            st->s[h] *= f;
            for (int d = 0; d < st->Dv; d++)
                acc[d] *= f;
            st->m[h] = score;
        }
        const double w = exp(score - st->m[h]);
        st->s[h] += w;
        if (v)
            for (int d = 0; d < st->Dv; d++)
                acc[d] += w * (double)v[(size_t)kh * st->Dv + d];
    }
}

/* Where the key at reference position j comes from: 0 zero, 1 itself,
 * 2 another position (*from), 3 not read at all. */
static int key_source(const cmp_hyp *h, int64_t j, int64_t *from)
{
    if (h->skip_one && j == h->skip_pos)
        return 3;
    if (h->all_zero)
        return 0;
    if (j >= h->zero_lo && j < h->zero_hi) {
        *from = j - h->older;
        return h->older > 0 && *from >= 0 ? 2 : 0;
    }
    for (int i = 0; i < h->nsubst; i++)
        if (h->from[i] == j) {
            *from = h->to[i];
            return h->to[i] < 0 ? 0 : 2;
        }
    return 1;
}

typedef struct {
    const cmp_source *src;
    int owner, kvf, vf;          /* floats of a key row, of a value row */
    float *k, *v;                /* (KEY_BLOCK, kvf), (KEY_BLOCK, vf) */
    float *k1, *v1;              /* one substituted row */
    /* MLA's tail hypotheses (NULL cfg: none): a changed key row, the
     * tail's frequencies and cos/sin factor */
    const kv_config *cfg;
    float *t1;
    double *inv_freq;
    double mscale;
} key_reader;

static int read_kv(const key_reader *kr, int64_t p, int64_t n, float *k, float *v, kv_err *e)
{
    int64_t first, rows;
    int cols;
    for (int s = STAGE_K; s <= STAGE_V; s++)
        if (kr->src->info(kr->src->ctx, kr->owner, (kv_stage)s, &first, &rows, &cols) != 0 ||
            p < first || p + n > first + rows || cols != (s == STAGE_K ? kr->kvf : kr->vf))
            return 1;
    if (kr->src->read(kr->src->ctx, kr->owner, STAGE_K, p, n, k, e) < 0 ||
        kr->src->read(kr->src->ctx, kr->owner, STAGE_V, p, n, v, e) < 0)
        return -1;
    return 0;
}

/* The latent-cache hypotheses' change of one key row (MLA, cmp_hyp):
 * into kr->k1 when there is one, else k itself. */
static const float *tail_of(const key_reader *kr, const cmp_hyp *h, int64_t pos, const float *k)
{
    if (!k || !kr->cfg || (!h->tail_twice && !(h->tail_zero && pos < h->tail_lo)))
        return k;
    const kv_config *c = kr->cfg;
    const int D = c->head_dim, dr = c->qk_rope_dim, KV = kr->kvf / D;
    float *t = kr->t1;
    memcpy(t, k, (size_t)kr->kvf * sizeof(float));
    if (h->tail_zero) {
        for (int g = 0; g < KV; g++)
            memset(t + (size_t)g * D + (D - dr), 0, (size_t)dr * sizeof(float));
        return t;
    }
    float cs[KV_MAX_HEAD_DIM / 2], sn[KV_MAX_HEAD_DIM / 2];
    kern_rope_table_scaled((double)pos, kr->inv_freq, dr, kr->mscale, cs, sn);
    kern_rope_apply_pairs(t + (D - dr), KV, D, dr / 2, cs, sn);
    return t;
}

static int add_range(softmax_state *st, const key_reader *kr, const cmp_hyp *h, kv_err *e)
{
    for (int64_t j0 = h->lo; j0 <= h->hi; j0 += KEY_BLOCK) {
        const int64_t n = h->hi - j0 + 1 < KEY_BLOCK ? h->hi - j0 + 1 : KEY_BLOCK;
        if (!h->all_zero) {
            int rc = read_kv(kr, j0, n, kr->k, kr->v, e);
            if (rc)
                return rc;
        }
        for (int64_t r = 0; r < n; r++) {
            int64_t from = 0;
            const int how = key_source(h, j0 + r, &from);
            const int times = how == 3 ? 0 : h->dup_one && h->dup_pos == j0 + r ? 2 : 1;
            const float *k = NULL, *v = NULL;
            if (how == 1) {
                k = kr->k + (size_t)r * kr->kvf;
                v = kr->v + (size_t)r * kr->vf;
            } else if (how == 2) {
                int rc = read_kv(kr, from, 1, kr->k1, kr->v1, e);
                if (rc)
                    return rc;
                k = kr->k1;
                v = kr->v1;
            }
            k = tail_of(kr, h, how == 2 ? from : j0 + r, k);
            for (int t = 0; t < times; t++)
                add_key(st, k, v);
        }
    }
    return 0;
}

/* The softmax state and key reader of a recomputation for the query row q
 * of `layer`, empty: 0, 1 when the shapes do not allow one, -1 out of
 * memory (e filled). Released with recompute_close whatever it returned. */
static int recompute_open(softmax_state *st, key_reader *kr, const cmp_source *src,
                          const kv_config *cfg, int layer, const float *q, kv_err *e)
{
    const int H = cfg->n_heads, KV = config_layer_kv_heads(cfg, layer);
    const int D = config_layer_head_dim(cfg, layer), Dv = config_layer_v_head_dim(cfg, layer);
    memset(st, 0, sizeof *st);
    memset(kr, 0, sizeof *kr);
    if (!src->read || H <= 0 || KV <= 0 || H % KV || D <= 0 || Dv <= 0)
        return 1;
    *st = (softmax_state){.H = H, .KV = KV, .D = D, .Dv = Dv, .scale = attn_scale(cfg), .q = q,
                          .sink = layer_sinks(src, cfg, layer)};
    *kr = (key_reader){.src = src, .owner = cfg->kv_owner[layer], .kvf = KV * D,
                       .vf = KV * Dv};
    st->m = malloc((size_t)H * sizeof(double));
    st->s = calloc((size_t)H, sizeof(double));
    st->acc = calloc((size_t)H * Dv, sizeof(double));
    kr->k = malloc((size_t)(KEY_BLOCK + 1) * kr->kvf * sizeof(float));
    kr->v = malloc((size_t)(KEY_BLOCK + 1) * kr->vf * sizeof(float));
    if (!st->m || !st->s || !st->acc || !kr->k || !kr->v)
        return kv_errf(e, "compare: out of memory recomputing attention");
    kr->k1 = kr->k + (size_t)KEY_BLOCK * kr->kvf;
    kr->v1 = kr->v + (size_t)KEY_BLOCK * kr->vf;
    if (config_mla(cfg)) {
        kr->cfg = cfg;
        kr->t1 = malloc((size_t)kr->kvf * sizeof(float));
        kr->inv_freq = malloc((size_t)(cfg->qk_rope_dim / 2 + 1) * sizeof(double));
        if (!kr->t1 || !kr->inv_freq)
            return kv_errf(e, "compare: out of memory recomputing attention");
        config_rope_inv_freq(cfg, false, kr->inv_freq);
        kr->mscale = config_rope_mscale(cfg, false);
    }
    for (int i = 0; i < H; i++)
        st->m[i] = -INFINITY;
    return 0;
}

static void recompute_close(softmax_state *st, key_reader *kr)
{
    free(st->m);
    free(st->s);
    free(st->acc);
    free(kr->k);
    free(kr->v);
    free(kr->t1);
    free(kr->inv_freq);
}

/* The attention the state holds, into lse (H) and out (H x Dv). */
static void softmax_result(const softmax_state *st, double *lse, double *out)
{
    for (int i = 0; i < st->H; i++) {
        lse[i] = st->s[i] > 0 ? st->m[i] + log(st->s[i]) : -INFINITY;
        for (int d = 0; d < st->Dv; d++)
            out[(size_t)i * st->Dv + d] = st->s[i] > 0
                                              ? st->acc[(size_t)i * st->Dv + d] / st->s[i] : 0;
    }
    apply_sinks(st->sink, st->H, st->Dv, lse, out);
}

int cmp_recompute_attention(const cmp_source *src, const kv_config *cfg, int layer,
                            const float *q, const cmp_hyp *h, double *lse, double *out,
                            kv_err *e)
{
    softmax_state st;
    key_reader kr;
    int rc = recompute_open(&st, &kr, src, cfg, layer, q, e);
    if (h->scale_mul > 0)
        st.scale *= h->scale_mul;
    if (rc == 0)
        rc = add_range(&st, &kr, h, e);
    for (int i = 0; rc == 0 && i < h->extra_zero; i++)
        add_key(&st, NULL, NULL);
    if (rc == 0)
        softmax_result(&st, lse, out);
    recompute_close(&st, &kr);
    return rc;
}

int cmp_extend_scan(const cmp_source *src, const kv_config *cfg, int layer, const float *q,
                    int64_t lo, int64_t p, int64_t hi_max, const float *lse_rec,
                    const float *out_rec, double rms_weight, int64_t *best_hi, double *best_err,
                    kv_err *e)
{
    const int H = cfg->n_heads, D = config_layer_v_head_dim(cfg, layer);
    *best_hi = -1;
    *best_err = INFINITY;
    if (hi_max <= p)
        return 1;
    softmax_state st;
    key_reader kr;
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * D * sizeof(double));
    int rc = recompute_open(&st, &kr, src, cfg, layer, q, e);
    if (rc == 0 && (!lse || !out))
        rc = kv_errf(e, "compare: out of memory scanning keys");
    const cmp_hyp base = {.lo = lo, .hi = p};
    if (rc == 0)
        rc = add_range(&st, &kr, &base, e);
    /* Each later key added once: the attention over lo..j for every j. */
    for (int64_t j = p + 1; rc == 0 && j <= hi_max; j++) {
        rc = read_kv(&kr, j, 1, kr.k1, kr.v1, e);
        if (rc)
            break;
        add_key(&st, kr.k1, kr.v1);
        softmax_result(&st, lse, out);
        const double err = cmp_attention_err(cfg, layer, lse, out, lse_rec, out_rec, rms_weight);
        if (err < *best_err) {
            *best_err = err;
            *best_hi = j;
        }
    }
    recompute_close(&st, &kr);
    free(lse);
    free(out);
    return rc;
}

/* Keys a scan holds at once ((hi - lo + 1) x (H + KV*D) values). */
#define SCAN_MAX_KEYS 8192

int cmp_keyset_scan(const cmp_source *src, const kv_config *cfg, int layer, const float *q,
                    int64_t lo, int64_t hi, const float *lse_rec, const float *out_rec,
                    int64_t *skip, double *skip_err, int64_t *dup, double *dup_err, kv_err *e)
{
    const int H = cfg->n_heads, KV = config_layer_kv_heads(cfg, layer);
    const int D = config_layer_head_dim(cfg, layer), Dv = config_layer_v_head_dim(cfg, layer);
    const int64_t n = hi - lo + 1;
    *skip = *dup = -1;
    *skip_err = *dup_err = INFINITY;
    if (!src->read || H <= 0 || KV <= 0 || H % KV || D <= 0 || n < 2 || n > SCAN_MAX_KEYS)
        return 1;
    const int kvf = KV * D, vf = KV * Dv, group = H / KV;
    const double scale = attn_scale(cfg);
    key_reader kr = {.src = src, .owner = cfg->kv_owner[layer], .kvf = kvf, .vf = vf};
    float *vs = malloc((size_t)n * vf * sizeof(float));
    float *kb = malloc((size_t)KEY_BLOCK * kvf * sizeof(float));
    double *sc = malloc((size_t)n * H * sizeof(double));
    double *m = malloc((size_t)H * sizeof(double)), *z = calloc((size_t)H, sizeof(double));
    double *acc = calloc((size_t)H * Dv, sizeof(double));
    double *lse = malloc((size_t)H * sizeof(double)), *out = malloc((size_t)H * Dv * sizeof(double));
    int rc = (!vs || !kb || !sc || !m || !z || !acc || !lse || !out)
                 ? kv_errf(e, "compare: out of memory scanning key sets") : 0;
    /* Every key's score per head, and its value row. */
    for (int64_t j0 = 0; rc == 0 && j0 < n; j0 += KEY_BLOCK) {
        const int64_t b = n - j0 < KEY_BLOCK ? n - j0 : KEY_BLOCK;
        rc = read_kv(&kr, lo + j0, b, kb, vs + (size_t)j0 * vf, e);
        for (int64_t r = 0; rc == 0 && r < b; r++)
            for (int h = 0; h < H; h++) {
                const float *qh = q + (size_t)h * D;
                const float *kk = kb + (size_t)r * kvf + (size_t)(h / group) * D;
                double s = 0;
                for (int d = 0; d < D; d++)
                    s += (double)qh[d] * (double)kk[d];
                sc[(size_t)(j0 + r) * H + h] = s * scale;
            }
    }
    for (int h = 0; rc == 0 && h < H; h++) {
        m[h] = -INFINITY;
        for (int64_t j = 0; j < n; j++)
            m[h] = fmax(m[h], sc[(size_t)j * H + h]);
        for (int64_t j = 0; j < n; j++) {
            const double w = exp(sc[(size_t)j * H + h] - m[h]);
            const float *v = vs + (size_t)j * vf + (size_t)(h / group) * Dv;
            z[h] += w;
            for (int d = 0; d < Dv; d++)
                acc[(size_t)h * Dv + d] += w * v[d];
        }
    }
    /* Each key taken out (sign -1) or counted twice (+1). */
    for (int64_t j = 0; rc == 0 && j < n; j++)
        for (int sign = -1; sign <= 1; sign += 2) {
            bool ok = true;
            for (int h = 0; h < H && ok; h++) {
                const double w = exp(sc[(size_t)j * H + h] - m[h]);
                const double zz = z[h] + sign * w;
                /* Taking out a key that holds nearly all the weight
                 * cancels: not tried (the direct recomputation is). */
                if (!(zz > 1e-9 * z[h])) {
                    ok = false;
                    break;
                }
                const float *v = vs + (size_t)j * vf + (size_t)(h / group) * Dv;
                lse[h] = m[h] + log(zz);
                for (int d = 0; d < Dv; d++)
                    out[(size_t)h * Dv + d] = (acc[(size_t)h * Dv + d] + sign * w * v[d]) / zz;
            }
            if (!ok)
                continue;
            apply_sinks(layer_sinks(src, cfg, layer), H, Dv, lse, out);
            const double err = cmp_attention_err(cfg, layer, lse, out, lse_rec, out_rec, 0);
            double *best = sign < 0 ? skip_err : dup_err;
            if (err < *best) {
                *best = err;
                *(sign < 0 ? skip : dup) = lo + j;
            }
        }
    free(vs);
    free(kb);
    free(sc);
    free(m);
    free(z);
    free(acc);
    free(lse);
    free(out);
    return rc;
}

double cmp_attention_err(const kv_config *cfg, int layer, const double *lse, const double *out,
                         const float *lse_rec, const float *out_rec, double rms_weight)
{
    const int H = cfg->n_heads, n = cfg->n_heads * config_layer_v_head_dim(cfg, layer);
    double err = 0;
    for (int h = 0; lse_rec && h < H; h++) {
        if (!isfinite(lse[h]) || !isfinite(lse_rec[h])) {
            if (lse[h] != (double)lse_rec[h])
                return INFINITY;
            continue;
        }
        double d = fabs(lse[h] - lse_rec[h]) / fmax(1.0, fabs((double)lse_rec[h]));
        err = d > err ? d : err;
    }
    if (!out_rec)
        return err;
    cmp_residual res = {0};
    for (int i = 0; i < n; i++) {
        if (!isfinite(out_rec[i]))
            return INFINITY;
        cmp_residual_add(&res, out[i], out_rec[i]);
    }
    return fmax(err, cmp_residual_value(&res, rms_weight));
}

/* ------------------------------------------------------------------ */
/* RoPE offset                                                          */

/* Inverse frequencies of the layer, as the engines build them: the local
 * base on sliding layers (unscaled), the global base and scaling elsewhere. */
static void layer_inv_freq(const kv_config *c, int layer, double *inv)
{
    const bool sliding = config_layer_window(c, layer) > 0;
    if (sliding && !(c->rope_local_theta > 0)) {
        /* a dump's config without a local base: the global one */
        kv_config g = *c;
        g.rope_local_theta = c->rope_theta;
        config_rope_inv_freq(&g, true, inv);
        return;
    }
    config_rope_inv_freq(c, sliding, inv);
}

/* Row-relative error of ref rotated by the angles (cs, sn) against test;
 * gives up (returns a value > limit) as soon as it exceeds limit. */
static double rotated_err(const float *ref, const float *test, int nheads, int D,
                          const double *cs, const double *sn, double test_max, double limit)
{
    const int half = D / 2;
    const double cap = limit * test_max;
    double worst = 0;
    for (int h = 0; h < nheads; h++) {
        const float *x = ref + (size_t)h * D, *y = test + (size_t)h * D;
        for (int d = 0; d < half; d++) {
            const double a = x[d], b = x[d + half];
            const double r0 = a * cs[d] - b * sn[d], r1 = b * cs[d] + a * sn[d];
            const double err = fmax(fabs(r0 - y[d]), fabs(r1 - y[d + half]));
            worst = err > worst ? err : worst;
            if (worst > cap)
                return INFINITY;
        }
    }
    return test_max > 0 ? worst / test_max : (worst > 0 ? INFINITY : 0);
}

/* Angles wrapped to (-pi, pi]. */
static double wrap_angle(double x)
{
    x = fmod(x, 2 * M_PI);
    if (x > M_PI)
        x -= 2 * M_PI;
    else if (x <= -M_PI)
        x += 2 * M_PI;
    return x;
}

/* Residual angle a candidate offset may leave at one frequency before it
 * is refused: far above float32 rounding (~1e-6), far below a wrong
 * wrap's (uniform over (-pi, pi]). */
#define ROPE_ANGLE_TOL 0.05

/* A candidate offset (a real estimate from the lowest frequency) refined
 * through every higher one: at each, the predicted angle must agree with
 * the measured one to ROPE_ANGLE_TOL, and the agreement moves the
 * estimate closer. Returns false at the first disagreement. */
static bool rope_refine(double est, const double *inv, const double *theta, const int *order,
                        int n, int64_t *delta)
{
    for (int i = 1; i < n; i++) {
        const int f = order[i];
        const double r = wrap_angle(theta[f] - est * inv[f]);
        if (fabs(r) > ROPE_ANGLE_TOL)
            return false;
        est += r / inv[f];
    }
    if (!(fabs(est) < CMP_ROPE_MAX_OFFSET))
        return false;
    *delta = (int64_t)llround(est);
    return true;
}

/* cmp_rope_solve on rows of nheads heads of D rotated as halves. */
static double solve_half(const kv_config *cfg, int layer, int D, const float *ref,
                         const float *test, int nheads, int64_t *delta)
{
    const int half = D / 2;
    double *inv = malloc((size_t)half * 5 * sizeof(double));
    int *order = malloc((size_t)half * sizeof(int));
    double best = INFINITY;
    *delta = 0;
    if (!inv || !order || D < 2 || D % 2)
        goto done;
    double *theta = inv + half, *weight = theta + half, *cs = weight + half, *sn = cs + half;
    double test_max = 0, wmax = 0;
    for (int i = 0; i < nheads * D; i++)
        test_max = fmax(test_max, fabs((double)test[i]));
    layer_inv_freq(cfg, layer, inv);
    /* Per frequency pair, the angle that takes the reference's pairs to
     * the test's: arg of sum over heads of conj(ref) * test (each pair
     * weighted by its own size). */
    for (int d = 0; d < half; d++) {
        double re = 0, im = 0;
        for (int h = 0; h < nheads; h++) {
            const double a = ref[(size_t)h * D + d], b = ref[(size_t)h * D + d + half];
            const double y0 = test[(size_t)h * D + d], y1 = test[(size_t)h * D + d + half];
            re += a * y0 + b * y1;
            im += a * y1 - b * y0;
        }
        theta[d] = atan2(im, re);
        weight[d] = hypot(re, im);
        wmax = fmax(wmax, weight[d]);
    }
    /* Frequencies whose pairs carry signal, lowest first. */
    int n = 0;
    for (int d = 0; d < half; d++)
        if (weight[d] > 1e-6 * wmax && inv[d] > 0 && isfinite(theta[d]))
            order[n++] = d;
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && inv[order[j]] < inv[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    if (n == 0)
        goto done;
    /* The lowest frequency knows the offset up to its period 2 pi / inv:
     * each wrap k is a candidate, nearest zero first; the higher
     * frequencies refuse all but the right one (usually at the first
     * check), and rotating the whole row verifies what is left. */
    const double inv0 = inv[order[0]], th0 = theta[order[0]];
    int64_t kmax = (int64_t)(CMP_ROPE_MAX_OFFSET * inv0 / (2 * M_PI)) + 1;
    if (kmax > (1 << 26))   /* only a head_dim of 2 or 4 turns that fast: bound the work */
        kmax = 1 << 26;
    for (int64_t k = 0; k <= kmax; k++) {
        for (int sign = 0; sign < (k ? 2 : 1); sign++) {
            const double est = (th0 + 2 * M_PI * (double)(sign ? -k : k)) / inv0;
            int64_t dl;
            if (!rope_refine(est, inv, theta, order, n, &dl) || dl == 0)
                continue;
            for (int d = 0; d < half; d++) {
                const double ang = (double)dl * inv[d];   /* in double, as the engines */
                cs[d] = cos(ang);
                sn[d] = sin(ang);
            }
            double err = rotated_err(ref, test, nheads, D, cs, sn, test_max,
                                     isfinite(best) ? best : 1.0);
            if (err < best) {
                best = err;
                *delta = dl;
            }
        }
    }
done:
    free(inv);
    free(order);
    return best;
}

double cmp_rope_solve(const kv_config *cfg, int layer, const float *ref, const float *test,
                      int nheads, int64_t *delta)
{
    const int D = config_layer_head_dim(cfg, layer);
    if (!config_mla(cfg))
        return solve_half(cfg, layer, D, ref, test, nheads, delta);
    /* MLA rotates each head's tail on interleaved pairs: the tails laid
     * out as halves, solved so; the parts before them must agree as they
     * are (an offset turns nothing else). */
    const int dr = cfg->qk_rope_dim, nope = D - dr, half = dr / 2;
    float *a = calloc((size_t)nheads * dr, sizeof *a), *b = calloc((size_t)nheads * dr, sizeof *b);
    double best = INFINITY, test_max = 0, still = 0;
    *delta = 0;
    if (a && b && half > 0) {
        for (int h = 0; h < nheads; h++) {
            const float *x = ref + (size_t)h * D, *y = test + (size_t)h * D;
            for (int j = 0; j < half; j++) {
                a[(size_t)h * dr + j] = x[nope + 2 * j];
                a[(size_t)h * dr + half + j] = x[nope + 2 * j + 1];
                b[(size_t)h * dr + j] = y[nope + 2 * j];
                b[(size_t)h * dr + half + j] = y[nope + 2 * j + 1];
            }
            for (int j = 0; j < D; j++)
                test_max = fmax(test_max, fabs((double)y[j]));
            for (int j = 0; j < nope; j++)
                still = fmax(still, fabs((double)x[j] - (double)y[j]));
        }
        best = solve_half(cfg, layer, dr, a, b, nheads, delta);
        if (test_max > 0)
            best = fmax(best, still / test_max);
    }
    free(a);
    free(b);
    return best;
}

/* ------------------------------------------------------------------ */
/* Another RoPE convention                                              */

double cmp_rope_conv_err(const kv_config *cfg, int layer, const cmp_rope_conv *cv, int64_t pos,
                         const float *ref, const float *test, int nheads)
{
    const int D = config_layer_head_dim(cfg, layer), half = D / 2;
    const int pairs = cv->pairs > 0 ? cv->pairs : config_layer_rope_pairs(cfg, layer);
    const int fd = cv->freq_dims > 0 ? cv->freq_dims : D;
    const int gap = cv->gap > 0 ? cv->gap : half;
    if (D < 2 || D % 2 || pairs > half || fd < 2 * pairs || fd > D ||
        (!cv->interleaved && (gap < pairs || pairs + gap > D)))
        return INFINITY;
    /* inv, inv_cv, then the angles' cosines and sines (the config's, the
     * candidate's): computed once, used for every head */
    double *inv = malloc((size_t)half * 6 * sizeof(double));
    double *x = malloc((size_t)D * 2 * sizeof(double));
    if (!inv || !x) {
        free(inv);
        free(x);
        return INFINITY;
    }
    double *xr = x + D;
    double *inv_cv = inv + half, *cs = inv_cv + half, *sn = cs + half, *cs2 = sn + half,
           *sn2 = cs2 + half;
    layer_inv_freq(cfg, layer, inv);
    kern_rope_inv_freq(cv->theta, fd, inv_cv);
    const kv_rope_scaling *rs = &cv->scaling;
    if (rs->type == ROPE_SCALE_YARN)
        kern_rope_yarn_inv_freq(inv_cv, fd / 2, cv->theta, rs->factor, rs->beta_fast,
                                rs->beta_slow, rs->original_max_position, rs->truncate);
    else if (rs->type != ROPE_SCALE_NONE)
        kern_rope_scale_inv_freq(inv_cv, pairs, (int)rs->type, rs->factor, rs->low_freq_factor,
                                 rs->high_freq_factor, rs->original_max_position);
    for (int d = 0; d < half; d++) {   /* angles in double, as the engines */
        cs[d] = cos((double)pos * inv[d]);
        sn[d] = sin((double)pos * inv[d]);
    }
    for (int d = 0; d < pairs; d++) {
        cs2[d] = cos((double)pos * inv_cv[d]);
        sn2[d] = sin((double)pos * inv_cv[d]);
    }
    double worst = 0, test_max = 0;
    for (int h = 0; h < nheads; h++) {
        const float *a = ref + (size_t)h * D, *y = test + (size_t)h * D;
        /* Undo the config's rotation. */
        for (int d = 0; d < half; d++) {
            x[d] = a[d] * cs[d] + a[d + half] * sn[d];
            x[d + half] = a[d + half] * cs[d] - a[d] * sn[d];
        }
        /* The rows in the order the runtime rotated them. */
        for (int m = 0; m < half; m++)
            for (int t = 0; t < 2; t++) {
                const int hf = t * half + m, il = 2 * m + t;
                if (cv->rows == CMP_ROWS_UNPERMUTED)
                    xr[hf] = x[il];
                else if (cv->rows == CMP_ROWS_PERMUTED)
                    xr[il] = x[hf];
                else
                    xr[hf] = x[hf];
            }
        /* Rotated as the runtime does, in place; the pairs past `pairs`
         * stay as they are. */
        for (int d = 0; d < pairs; d++) {
            const int i0 = cv->interleaved ? 2 * d : d, i1 = cv->interleaved ? 2 * d + 1 : d + gap;
            const double r0 = xr[i0] * cs2[d] - xr[i1] * sn2[d];
            const double r1 = xr[i1] * cs2[d] + xr[i0] * sn2[d];
            xr[i0] = r0;
            xr[i1] = r1;
        }
        for (int d = 0; d < D; d++) {
            worst = fmax(worst, fabs(xr[d] - y[d]));
            test_max = fmax(test_max, fabs((double)y[d]));
        }
    }
    free(inv);
    free(x);
    return test_max > 0 ? worst / test_max : (worst > 0 ? INFINITY : 0);
}

void cmp_rope_unrotate(const kv_config *cfg, int layer, int64_t pos, const float *row, int nheads,
                       double *out)
{
    const int D = config_layer_head_dim(cfg, layer), half = D / 2;
    double *inv = malloc((size_t)(half > 0 ? half : 1) * sizeof(double));
    if (!inv || D < 2 || D % 2) {
        for (int i = 0; i < nheads * D; i++)
            out[i] = row[i];
        free(inv);
        return;
    }
    layer_inv_freq(cfg, layer, inv);
    for (int h = 0; h < nheads; h++) {
        const float *a = row + (size_t)h * D;
        double *x = out + (size_t)h * D;
        for (int d = 0; d < half; d++) {
            const double ang = (double)pos * inv[d], cs = cos(ang), sn = sin(ang);
            x[d] = a[d] * cs + a[d + half] * sn;
            x[d + half] = a[d + half] * cs - a[d] * sn;
        }
    }
    free(inv);
}
