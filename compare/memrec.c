/* memrec.c — the in-memory recorder: a kv_observer sink that keeps every
 * row and token and reads back as a cmp_source (tests, lockstep runs). */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmp_internal.h"

typedef struct {
    int64_t first, rows, cap;    /* positions first .. first + rows - 1 held */
    int cols;
    float *data;                 /* (cap, cols) */
} mr_stage;

/* /output rows: lse and the top k of every logits row seen, kept even
 * when the full logits are not (as a dump keeps them). */
typedef struct {
    int64_t first, rows, cap;
    int k;
    float *lse;                  /* (cap) */
    int32_t *ids;                /* (cap, k) */
    float *vals;                 /* (cap, k) */
} mr_output;

struct cmp_memrec {
    kv_observer obs;             /* first: the observer pointer is the memrec */
    kv_config cfg;
    char *engine, *settings;
    cmp_memrec_opts o;
    mr_stage *st;                /* (n_layers + 1) x STAGE_COUNT; layer -1 first */
    mr_output out;
    int32_t *tokens;
    int64_t n_tokens, cap_tokens, prompt_length;
    bool complete;
    char err[256];
};

void cmp_memrec_opts_default(cmp_memrec_opts *o)
{
    memset(o, 0, sizeof *o);
    o->layer_lo = 0;
    o->layer_hi = KV_MAX_LAYERS;
    o->pos_lo = 0;
    o->pos_hi = INT64_MAX;
    for (int s = 0; s < STAGE_COUNT; s++)
        o->stages[s] = true;
    o->topk = 8;
}

static mr_stage *slot_of(const cmp_memrec *m, int layer, kv_stage st)
{
    if (layer < -1 || layer >= m->cfg.n_layers || (int)st < 0 || st >= STAGE_COUNT)
        return NULL;
    if ((layer < 0) != (st >= STAGE_LAYER_COUNT))
        return NULL;
    return &m->st[(size_t)(layer + 1) * STAGE_COUNT + st];
}

static int mr_fail(cmp_memrec *m, const char *fmt, ...)
{
    if (!m->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(m->err, sizeof m->err, fmt, ap);
        va_end(ap);
    }
    return 1;
}

/* ------------------------------------------------------------------ */
/* Observer                                                             */

/* Logits are always wanted: /output is derived from them. */
static int mr_wants(kv_observer *self, kv_stage stage, int layer)
{
    const cmp_memrec *m = (const cmp_memrec *)self;
    if (stage == STAGE_LOGITS)
        return 1;
    if ((int)stage < 0 || stage >= STAGE_COUNT || !m->o.stages[stage])
        return 0;
    return layer < 0 || (layer >= m->o.layer_lo && layer <= m->o.layer_hi);
}

static int grow_rows(mr_stage *s, int64_t need)
{
    if (need <= s->cap)
        return 0;
    int64_t cap = s->cap ? s->cap : 64;
    while (cap < need)
        cap *= 2;
    float *d = realloc(s->data, (size_t)cap * (size_t)s->cols * sizeof(float));
    if (!d)
        return -1;
    s->data = d;
    s->cap = cap;
    return 0;
}

/* Top-k of one logits row, descending, ties by lower id (as the dump's
 * /output), and its log-sum-exp in double. */
static void row_output(const float *x, int V, int k, float *lse, int32_t *ids, float *vals)
{
    double mx = -INFINITY, sum = 0;
    for (int i = 0; i < V; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int i = 0; i < V; i++)
        sum += exp((double)x[i] - mx);
    *lse = (float)(mx + log(sum));
    int n = 0;
    for (int i = 0; i < V; i++) {
        if (n == k && !(x[i] > vals[k - 1]))
            continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && x[i] > vals[j - 1]) {
            vals[j] = vals[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        vals[j] = x[i];
        ids[j] = i;
    }
}

static int grow_output(mr_output *o, int64_t need)
{
    if (need <= o->cap)
        return 0;
    int64_t cap = o->cap ? o->cap * 2 : 64;
    float *lse = realloc(o->lse, (size_t)cap * sizeof(float));
    if (lse)
        o->lse = lse;
    int32_t *ids = realloc(o->ids, (size_t)cap * o->k * sizeof(int32_t));
    if (ids)
        o->ids = ids;
    float *vals = realloc(o->vals, (size_t)cap * o->k * sizeof(float));
    if (vals)
        o->vals = vals;
    if (!lse || !ids || !vals)
        return -1;
    o->cap = cap;
    return 0;
}

static int add_output(cmp_memrec *m, const kv_event *ev)
{
    mr_output *o = &m->out;
    if (o->k == 0)
        o->k = m->o.topk < ev->ncols ? m->o.topk : ev->ncols;
    for (int r = 0; r < ev->nrows; r++) {
        const int64_t p = ev->pos0 + r;
        if (p < m->o.pos_lo || p > m->o.pos_hi)
            continue;
        if (o->rows == 0)
            o->first = p;
        int64_t idx = p - o->first;
        if (idx < 0 || idx > o->rows)
            return mr_fail(m, "memrec: logits jump to position %lld", (long long)p);
        if (idx == o->rows && grow_output(o, o->rows + 1) < 0)
            return mr_fail(m, "memrec: out of memory for /output");
        row_output(ev->data + (size_t)r * ev->ncols, ev->ncols, o->k, o->lse + idx,
                   o->ids + idx * o->k, o->vals + idx * o->k);
        if (idx == o->rows)
            o->rows++;
    }
    return 0;
}

static int mr_emit(kv_observer *self, const kv_event *ev)
{
    cmp_memrec *m = (cmp_memrec *)self;
    if (ev->stage == STAGE_LOGITS && ev->layer == -1 && ev->ncols > 0 && add_output(m, ev))
        return 1;
    if ((int)ev->stage < 0 || ev->stage >= STAGE_COUNT || !m->o.stages[ev->stage] ||
        !mr_wants(self, ev->stage, ev->layer))
        return 0;
    mr_stage *s = slot_of(m, ev->layer, ev->stage);
    if (!s || ev->ncols <= 0 || ev->nrows < 0)
        return mr_fail(m, "memrec: unexpected event %s of layer %d (%d columns)",
                       stage_name(ev->stage), ev->layer, ev->ncols);
    if (s->cols && s->cols != ev->ncols)
        return mr_fail(m, "memrec: %s of layer %d changed width from %d to %d",
                       stage_name(ev->stage), ev->layer, s->cols, ev->ncols);
    s->cols = ev->ncols;
    for (int r = 0; r < ev->nrows; r++) {
        const int64_t p = ev->pos0 + r;
        if (p < m->o.pos_lo || p > m->o.pos_hi)
            continue;
        if (s->rows == 0)
            s->first = p;
        int64_t idx = p - s->first;
        if (idx < 0 || idx > s->rows)
            return mr_fail(m, "memrec: %s of layer %d jumps to position %lld (holds %lld..%lld)",
                           stage_name(ev->stage), ev->layer, (long long)p,
                           (long long)s->first, (long long)(s->first + s->rows - 1));
        if (idx == s->rows && grow_rows(s, s->rows + 1) < 0)
            return mr_fail(m, "memrec: out of memory at %s of layer %d, position %lld",
                           stage_name(ev->stage), ev->layer, (long long)p);
        memcpy(s->data + (size_t)idx * s->cols, ev->data + (size_t)r * ev->ncols,
               (size_t)s->cols * sizeof(float));
        if (idx == s->rows)
            s->rows++;
    }
    return 0;
}

static int mr_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    cmp_memrec *m = (cmp_memrec *)self;
    if (pos < 0)
        return mr_fail(m, "memrec: token at negative position %lld", (long long)pos);
    if (pos >= m->cap_tokens) {
        int64_t cap = m->cap_tokens ? m->cap_tokens : 256;
        while (cap <= pos)
            cap *= 2;
        int32_t *t = realloc(m->tokens, (size_t)cap * sizeof *t);
        if (!t)
            return mr_fail(m, "memrec: out of memory for %lld tokens", (long long)cap);
        memset(t + m->cap_tokens, 0, (size_t)(cap - m->cap_tokens) * sizeof *t);
        m->tokens = t;
        m->cap_tokens = cap;
    }
    m->tokens[pos] = id;
    if (pos + 1 > m->n_tokens)
        m->n_tokens = pos + 1;
    if (is_prompt && pos + 1 > m->prompt_length)
        m->prompt_length = pos + 1;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Lifetime                                                             */

static char *dup_or_null(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

cmp_memrec *cmp_memrec_new(const kv_config *cfg, const char *engine, const char *settings_json,
                           const cmp_memrec_opts *o, kv_err *e)
{
    if (!cfg || cfg->n_layers < 1 || cfg->n_layers > KV_MAX_LAYERS) {
        kv_errf(e, "memrec: a model config with 1..%d layers is needed", KV_MAX_LAYERS);
        return NULL;
    }
    cmp_memrec *m = calloc(1, sizeof *m);
    if (!m) {
        kv_errf(e, "memrec: out of memory");
        return NULL;
    }
    m->cfg = *cfg;
    if (o)
        m->o = *o;
    else
        cmp_memrec_opts_default(&m->o);
    if (m->o.topk < 1)
        m->o.topk = 1;
    m->st = calloc((size_t)(cfg->n_layers + 1) * STAGE_COUNT, sizeof *m->st);
    m->engine = dup_or_null(engine);
    m->settings = dup_or_null(settings_json);
    if (!m->st || (engine && !m->engine) || (settings_json && !m->settings)) {
        cmp_memrec_free(m);
        kv_errf(e, "memrec: out of memory");
        return NULL;
    }
    m->complete = true;
    m->obs.emit = mr_emit;
    m->obs.token = mr_token;
    m->obs.wants = mr_wants;
    m->obs.all_logits = 1;
    return m;
}

void cmp_memrec_free(cmp_memrec *m)
{
    if (!m)
        return;
    if (m->st)
        for (size_t i = 0; i < (size_t)(m->cfg.n_layers + 1) * STAGE_COUNT; i++)
            free(m->st[i].data);
    free(m->st);
    free(m->out.lse);
    free(m->out.ids);
    free(m->out.vals);
    free(m->tokens);
    free(m->engine);
    free(m->settings);
    free(m);
}

kv_observer *cmp_memrec_observer(cmp_memrec *m)
{
    return &m->obs;
}

const char *cmp_memrec_error(const cmp_memrec *m)
{
    return m->err[0] ? m->err : NULL;
}

void cmp_memrec_set_complete(cmp_memrec *m, bool complete)
{
    m->complete = complete;
}

float *cmp_memrec_row(cmp_memrec *m, int layer, kv_stage st, int64_t pos, int *cols)
{
    mr_stage *s = slot_of(m, layer, st);
    if (cols)
        *cols = s ? s->cols : 0;
    if (!s || s->rows == 0 || pos < s->first || pos >= s->first + s->rows)
        return NULL;
    return s->data + (size_t)(pos - s->first) * s->cols;
}

size_t cmp_memrec_bytes(const cmp_memrec *m)
{
    size_t b = 0;
    for (size_t i = 0; i < (size_t)(m->cfg.n_layers + 1) * STAGE_COUNT; i++)
        b += (size_t)m->st[i].rows * (size_t)m->st[i].cols * sizeof(float);
    return b;
}

/* ------------------------------------------------------------------ */
/* As a source                                                          */

static int src_info(void *ctx, int layer, kv_stage st, int64_t *first, int64_t *rows, int *cols)
{
    const mr_stage *s = slot_of(ctx, layer, st);
    *first = s ? s->first : 0;
    *rows = s ? s->rows : 0;
    *cols = s ? s->cols : 0;
    return s && s->rows > 0 ? 0 : 1;
}

static int src_read(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, float *out,
                    kv_err *e)
{
    const mr_stage *s = slot_of(ctx, layer, st);
    if (!s || n < 0 || pos0 < s->first || pos0 + n > s->first + s->rows)
        return kv_errf(e, "memrec: %s of layer %d: positions %lld..%lld not recorded",
                       stage_name(st), layer, (long long)pos0, (long long)(pos0 + n - 1));
    memcpy(out, s->data + (size_t)(pos0 - s->first) * s->cols,
           (size_t)n * (size_t)s->cols * sizeof(float));
    return 0;
}

static int src_output_info(void *ctx, int64_t *first, int64_t *rows, int *k)
{
    const mr_output *o = &((const cmp_memrec *)ctx)->out;
    *first = o->first;
    *rows = o->rows;
    *k = o->k;
    return o->rows > 0 ? 0 : 1;
}

static int src_output(void *ctx, int64_t pos0, int64_t n, float *lse, int32_t *ids,
                      float *vals, kv_err *e)
{
    const mr_output *o = &((const cmp_memrec *)ctx)->out;
    if (n < 0 || pos0 < o->first || pos0 + n > o->first + o->rows)
        return kv_errf(e, "memrec: /output positions %lld..%lld not recorded", (long long)pos0,
                       (long long)(pos0 + n - 1));
    const size_t at = (size_t)(pos0 - o->first);
    memcpy(lse, o->lse + at, (size_t)n * sizeof(float));
    memcpy(ids, o->ids + at * o->k, (size_t)n * o->k * sizeof(int32_t));
    memcpy(vals, o->vals + at * o->k, (size_t)n * o->k * sizeof(float));
    return 0;
}

void cmp_memrec_source(cmp_memrec *m, cmp_source *out)
{
    memset(out, 0, sizeof *out);
    out->ctx = m;
    out->label = m->engine ? m->engine : "memory";
    out->cfg = m->cfg;
    out->engine = m->engine;
    out->settings_json = m->settings;
    out->n_tokens = m->n_tokens;
    out->prompt_length = m->prompt_length;
    out->tokens = m->tokens;
    out->complete = m->complete;
    out->info = src_info;
    out->read = src_read;
    out->output_info = src_output_info;
    out->output = src_output;
}

int cmp_memrec_plant_attention(cmp_memrec *rec, const kv_config *cfg, cmp_plant_fn keys,
                               void *ctx, kv_err *e)
{
    return cmp_memrec_plant_attention_sinks(rec, cfg, keys, ctx, NULL, e);
}

int cmp_memrec_plant_attention_sinks(cmp_memrec *rec, const kv_config *cfg, cmp_plant_fn keys,
                                     void *ctx, const float *sink_logits, kv_err *e)
{
    cmp_source s;
    cmp_memrec_source(rec, &s);
    const int H = cfg->n_heads;
    /* A sink model's planted attention keeps its sinks (the caller's, or
     * read off the recording before it is changed), so the plant is one
     * bug. */
    float *sinks = NULL;
    if (cfg->attn_sinks && sink_logits) {
        if (!(sinks = malloc((size_t)cfg->n_layers * H * sizeof *sinks)))
            return kv_errf(e, "plant: out of memory");
        memcpy(sinks, sink_logits, (size_t)cfg->n_layers * H * sizeof *sinks);
    } else if (cmp_recover_sinks(&s, &sinks, e) < 0) {
        return -1;
    }
    s.sink_logits = sinks;
    double *lse = malloc((size_t)H * sizeof(double));
    double *out = malloc((size_t)config_max_q_width(cfg) * sizeof(double));
    int rc = (!lse || !out) ? kv_errf(e, "plant: out of memory") : 0;
    for (int L = 0; rc == 0 && L < cfg->n_layers; L++) {
        mr_stage *qs = slot_of(rec, L, STAGE_Q);
        for (int64_t q = qs ? qs->first : 0; rc == 0 && qs && q < qs->first + qs->rows; q++) {
            const int W = config_layer_window(cfg, L);
            cmp_hyp h = {.lo = W > 0 && q - W + 1 > 0 ? q - W + 1 : 0, .hi = q};
            if (!keys(ctx, cfg, L, q, &h))
                continue;
            const float *qr = cmp_memrec_row(rec, L, STAGE_Q, q, NULL);
            float *o = cmp_memrec_row(rec, L, STAGE_ATTN_OUT, q, NULL);
            if (!o)
                continue;
            int r = cmp_recompute_attention(&s, cfg, L, qr, &h, lse, out, e);
            if (r != 0) {
                rc = r < 0 ? -1 : kv_errf(e, "plant: layer %d position %lld: k, v not held",
                                          L, (long long)q);
                break;
            }
            const int64_t n = cmp_hyp_nkeys(&h);
            const int D = config_layer_head_dim(cfg, L);
            float *l = cmp_memrec_row(rec, L, STAGE_ATTN_LSE, q, NULL);
            float *k = cmp_memrec_row(rec, L, STAGE_ATTN_NKEYS, q, NULL);
            float *sh = cmp_memrec_row(rec, L, STAGE_ATTN_SINK, q, NULL);
            const float *sk = sinks && !isnan(sinks[(size_t)L * H]) ? sinks + (size_t)L * H
                                                                     : NULL;
            for (int i = 0; i < H; i++) {
                if (sh && sk)
                    sh[i] = n > 0 ? (float)(1.0 / (1.0 + exp(lse[i] - (double)sk[i]))) : 1.0f;
                if (l)
                    l[i] = n > 0 ? (float)lse[i] : NAN;
                if (k)
                    k[i] = (float)n;
                for (int d = 0; d < D; d++)
                    o[(size_t)i * D + d] = n > 0 ? (float)out[(size_t)i * D + d] : NAN;
            }
        }
    }
    free(lse);
    free(out);
    free(sinks);
    return rc;
}
