/* observer.c — stage names: the vocabulary shared by engines, dumps and
 * the comparer. The names are part of the dump format. */
#include "observer.h"

#include <string.h>

static const char *const stage_names[STAGE_COUNT] = {
    [STAGE_X_IN] = "x_in",
    [STAGE_ATTN_NORM_STATS] = "attn_norm_stats",
    [STAGE_ATTN_NORM] = "attn_norm",
    [STAGE_Q] = "q",
    [STAGE_KV_LATENT] = "kv_latent",
    [STAGE_K] = "k",
    [STAGE_V] = "v",
    [STAGE_ATTN_LSE] = "attn_lse",
    [STAGE_ATTN_NKEYS] = "attn_nkeys",
    [STAGE_ATTN_SINK] = "attn_sink",
    [STAGE_ATTN_OUT] = "attn_out",
    [STAGE_ATTN_PROJ] = "attn_proj",
    [STAGE_H_MID] = "h_mid",
    [STAGE_FFN_NORM_STATS] = "ffn_norm_stats",
    [STAGE_FFN_NORM] = "ffn_norm",
    [STAGE_ROUTER_LOGITS] = "router_logits",
    [STAGE_FFN_OUT] = "ffn_out",
    [STAGE_PLE_IN] = "ple_in",
    [STAGE_PLE_OUT] = "ple_out",
    [STAGE_X_OUT] = "x_out",
    [STAGE_EMBED] = "embed",
    [STAGE_FINAL_NORM] = "final_norm",
    [STAGE_LOGITS] = "logits",
};

static const kv_stage wire_order[STAGE_COUNT] = {
    STAGE_X_IN, STAGE_ATTN_NORM_STATS, STAGE_ATTN_NORM, STAGE_Q, STAGE_K, STAGE_V,
    STAGE_ATTN_LSE, STAGE_ATTN_NKEYS, STAGE_ATTN_OUT, STAGE_ATTN_PROJ, STAGE_H_MID,
    STAGE_FFN_NORM_STATS, STAGE_FFN_NORM, STAGE_FFN_OUT, STAGE_X_OUT,
    STAGE_EMBED, STAGE_FINAL_NORM, STAGE_LOGITS,
    STAGE_PLE_IN, STAGE_PLE_OUT, STAGE_ATTN_SINK, STAGE_ROUTER_LOGITS, STAGE_KV_LATENT,
};

int stage_wire_id(kv_stage s)
{
    for (int i = 0; i < STAGE_COUNT; i++)
        if (wire_order[i] == s)
            return i;
    return -1;
}

kv_stage stage_from_wire(uint64_t id)
{
    return id < STAGE_COUNT ? wire_order[id] : STAGE_COUNT;
}

const char *stage_name(kv_stage s)
{
    return (s >= 0 && s < STAGE_COUNT) ? stage_names[s] : "?";
}

int stage_parse(const char *name)
{
    for (int s = 0; s < STAGE_COUNT; s++)
        if (strcmp(stage_names[s], name) == 0)
            return s;
    return -1;
}

static int tee_wants_one(kv_observer *o, kv_stage st, int layer)
{
    return o && (!o->wants || o->wants(o, st, layer));
}

static int tee_wants(kv_observer *self, kv_stage st, int layer)
{
    kv_observer_tee *t = (kv_observer_tee *)self;
    return tee_wants_one(t->a, st, layer) || tee_wants_one(t->b, st, layer);
}

static int tee_emit(kv_observer *self, const kv_event *ev)
{
    kv_observer_tee *t = (kv_observer_tee *)self;
    if (tee_wants_one(t->a, ev->stage, ev->layer) && t->a->emit(t->a, ev))
        return 1;
    if (tee_wants_one(t->b, ev->stage, ev->layer) && t->b->emit(t->b, ev))
        return 1;
    return 0;
}

static int tee_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    kv_observer_tee *t = (kv_observer_tee *)self;
    if (t->a && t->a->token && t->a->token(t->a, pos, id, is_prompt))
        return 1;
    if (t->b && t->b->token && t->b->token(t->b, pos, id, is_prompt))
        return 1;
    return 0;
}

kv_observer *obs_tee_init(kv_observer_tee *t, kv_observer *a, kv_observer *b)
{
    memset(t, 0, sizeof *t);
    t->a = a;
    t->b = b;
    t->obs.emit = tee_emit;
    t->obs.token = tee_token;
    t->obs.wants = tee_wants;
    t->obs.all_logits = (a && a->all_logits) || (b && b->all_logits);
    return &t->obs;
}
