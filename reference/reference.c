/* reference.c — continuous generation over a dense cache (reference.h). */
#include "reference.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../model/forward.h"

typedef struct {
    kv_engine base;
    const kv_model *m;
    const kern_ctx *kc;
    kv_observer *obs;
    ref_opts o;
    int64_t pos;                /* next absolute position */
    float **kcache, **vcache;   /* per layer (max_ctx, KV*D); NULL for KV-shared followers */
    const float ***krow, ***vrow; /* per layer (max_ctx): row j of the owner's cache */
    fw_state fw;
    int *kbeg, *kend, *nkeys;   /* (fw.cap) */
    int64_t *rope_pos;          /* (fw.cap) */
    float *logits;              /* (fw.cap, V) */
} ref_engine;

/* Floats of one cached row of layer l (Gemma 4's full and sliding layers
 * differ). */
static size_t kv_row_floats(const kv_config *c, int l)
{
    return (size_t)config_layer_kv_heads(c, l) * (size_t)config_layer_head_dim(c, l);
}

/* The per-batch buffers, sized for fw.cap rows. */
static void rows_free(ref_engine *r)
{
    fw_state_free(&r->fw);
    free(r->kbeg);
    free(r->kend);
    free(r->nkeys);
    free(r->rope_pos);
    free(r->logits);
}

static int ensure_rows(ref_engine *r, int n, kv_err *e)
{
    if (r->fw.cap >= n)
        return 0;
    rows_free(r);
    r->nkeys = malloc((size_t)n * sizeof(int));
    r->kbeg = malloc((size_t)n * sizeof(int));
    r->kend = malloc((size_t)n * sizeof(int));
    r->rope_pos = malloc((size_t)n * sizeof(int64_t));
    r->logits = malloc((size_t)n * r->m->cfg.vocab * sizeof(float));
    if (!r->kbeg || !r->kend || !r->nkeys || !r->rope_pos || !r->logits)
        return kv_errf(e, "out of memory for %d rows", n);
    return fw_state_init(&r->fw, r->m, n, e);
}

/* One batch of n tokens at positions r->pos .. r->pos + n - 1. */
static int ref_batch(ref_engine *r, const int32_t *tokens, int n, bool last, float *logits,
                     kv_err *e)
{
    const kv_config *c = &r->m->cfg;
    const int64_t pos0 = r->pos;
    kv_observer *obs = r->obs;
    fw_state *s = &r->fw;

    if (ensure_rows(r, n, e) < 0)
        return -1;
    for (int i = 0; i < n; i++)
        r->rope_pos[i] = pos0 + i;
    if (fw_embed(r->kc, r->m, s, tokens, n, pos0, obs))
        goto stopped;
    for (int l = 0; l < c->n_layers; l++) {
        const int owner = c->kv_owner[l];
        const size_t KD = kv_row_floats(c, l);
        if (fw_attn_inputs(r->kc, r->m, l, s, n, pos0, r->rope_pos, obs))
            goto stopped;
        if (owner == l) {
            memcpy(r->kcache[l] + (size_t)pos0 * KD, s->k, (size_t)n * KD * sizeof(float));
            memcpy(r->vcache[l] + (size_t)pos0 * KD, s->v, (size_t)n * KD * sizeof(float));
        }
        const int W = config_layer_window(c, l);
        for (int i = 0; i < n; i++) {
            int64_t p = pos0 + i;
            r->kbeg[i] = (W > 0 && p - W + 1 > 0) ? (int)(p - W + 1) : 0;
            r->kend[i] = (int)p + 1;
        }
        kern_attention(r->kc, n, s->q, c->n_heads, config_layer_kv_heads(c, l),
                       config_layer_head_dim(c, l),
                       (float)c->attn_scale, (const float *const *)r->krow[owner],
                       (const float *const *)r->vrow[owner], r->kbeg,
                       r->kend, s->att, s->lse);
        for (int i = 0; i < n; i++)
            r->nkeys[i] = r->kend[i] - r->kbeg[i];
        if (fw_attn_emit(r->m, l, s, n, pos0, r->nkeys, obs) ||
            fw_layer_finish(r->kc, r->m, l, s, n, pos0, obs))
            goto stopped;
    }
    r->pos += n;
    /* Logits of every row only when someone records them. */
    bool all = obs && obs->all_logits;
    if (all || (last && logits)) {
        int row0 = all ? 0 : n - 1, rows = all ? n : 1;
        if (fw_logits(r->kc, r->m, s, row0, rows, pos0 + row0, r->logits, obs))
            goto stopped;
        if (last && logits)
            memcpy(logits, r->logits + (size_t)(rows - 1) * c->vocab,
                   (size_t)c->vocab * sizeof(float));
    }
    return 0;
stopped:
    kv_errf(e, "stopped by the observer at position %lld", (long long)pos0);
    return 1;
}

static int ref_forward(kv_engine *self, const int32_t *tokens, int n, float *logits, kv_err *e)
{
    ref_engine *r = (ref_engine *)self;
    const kv_config *c = &r->m->cfg;
    if (n <= 0)
        return kv_errf(e, "reference: nothing to run (0 tokens)");
    if (r->pos + n > r->o.max_ctx)
        return kv_errf(e, "reference: %lld tokens exceed the context of %d positions",
                       (long long)(r->pos + n), r->o.max_ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab)
            return kv_errf(e, "token id %d at position %lld is outside the vocabulary (0..%d)",
                           tokens[i], (long long)(r->pos + i), c->vocab - 1);
    int step = r->o.prefill_step > 0 ? r->o.prefill_step : n;
    for (int i = 0; i < n; i += step) {
        int k = n - i < step ? n - i : step;
        int rc = ref_batch(r, tokens + i, k, i + k == n, logits, e);
        if (rc != 0)
            return rc;
    }
    return 0;
}

static int64_t ref_position(const kv_engine *self)
{
    return ((const ref_engine *)self)->pos;
}

static void ref_describe(const kv_engine *self, char *buf, size_t n)
{
    const ref_engine *r = (const ref_engine *)self;
    if (r->o.prefill_step > 0)
        snprintf(buf, n, "reference (dense cache, prefill %d token%s per step)",
                 r->o.prefill_step, r->o.prefill_step == 1 ? "" : "s");
    else
        snprintf(buf, n, "reference (dense cache, prefill all at once)");
}

static size_t ref_cache_bytes(const kv_engine *self)
{
    const ref_engine *r = (const ref_engine *)self;
    const kv_config *c = &r->m->cfg;
    size_t floats = 0;
    for (int l = 0; l < c->n_layers; l++)
        if (c->kv_owner[l] == l)
            floats += kv_row_floats(c, l);
    return 2 * (size_t)r->o.max_ctx * floats * sizeof(float);
}

static void ref_destroy(kv_engine *self)
{
    ref_engine *r = (ref_engine *)self;
    if (!r)
        return;
    for (int l = 0; r->kcache && l < r->m->cfg.n_layers; l++) {
        free(r->kcache[l]);
        free(r->vcache[l]);
        free(r->krow[l]);
        free(r->vrow[l]);
    }
    free(r->kcache);
    free(r->vcache);
    free(r->krow);
    free(r->vrow);
    rows_free(r);
    free(r);
}

static int alloc_caches(ref_engine *r, kv_err *e)
{
    const kv_config *c = &r->m->cfg;
    const size_t L = (size_t)c->n_layers, T = (size_t)r->o.max_ctx;
    r->kcache = calloc(L, sizeof *r->kcache);
    r->vcache = calloc(L, sizeof *r->vcache);
    r->krow = calloc(L, sizeof *r->krow);
    r->vrow = calloc(L, sizeof *r->vrow);
    if (!r->kcache || !r->vcache || !r->krow || !r->vrow)
        return kv_errf(e, "out of memory for the KV cache");
    for (size_t l = 0; l < L; l++) {
        if (c->kv_owner[l] != (int)l)
            continue;
        const size_t KD = kv_row_floats(c, (int)l);
        r->kcache[l] = calloc(T * KD, sizeof(float));
        r->vcache[l] = calloc(T * KD, sizeof(float));
        r->krow[l] = malloc(T * sizeof(float *));
        r->vrow[l] = malloc(T * sizeof(float *));
        if (!r->kcache[l] || !r->vcache[l] || !r->krow[l] || !r->vrow[l])
            return kv_errf(e, "out of memory for the KV cache (%zu positions)", T);
        for (size_t j = 0; j < T; j++) {
            r->krow[l][j] = r->kcache[l] + j * KD;
            r->vrow[l][j] = r->vcache[l] + j * KD;
        }
    }
    return 0;
}

kv_engine *ref_create(const kv_model *m, const kern_ctx *kc, const ref_opts *o,
                      kv_observer *obs, kv_err *e)
{
    if (o->max_ctx <= 0 || o->max_ctx > m->cfg.max_positions) {
        kv_errf(e, "reference: context %d outside 1..%d (max_position_embeddings)",
                o->max_ctx, m->cfg.max_positions);
        return NULL;
    }
    if (o->prefill_step < 0) {
        kv_errf(e, "reference: prefill step %d must be >= 0", o->prefill_step);
        return NULL;
    }
    ref_engine *r = calloc(1, sizeof *r);
    if (!r) {
        kv_errf(e, "out of memory");
        return NULL;
    }
    r->base = (kv_engine){.name = "reference", .forward = ref_forward,
                          .position = ref_position, .describe = ref_describe,
                          .cache_bytes = ref_cache_bytes, .destroy = ref_destroy};
    r->m = m;
    r->kc = kc;
    r->obs = obs;
    r->o = *o;
    if (alloc_caches(r, e) < 0) {
        ref_destroy(&r->base);
        return NULL;
    }
    return &r->base;
}
