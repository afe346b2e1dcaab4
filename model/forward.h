/* forward.h — the transformer layer math both engines share.
 *
 * An engine owns its KV cache and decides which keys each query sees; all
 * the rest of a layer is here, row-independent, so an engine that feeds
 * the same rows gets the same bits whatever its batching:
 *
 *   fw_embed         tokens -> x (scaled embedding rows)
 *   fw_attn_inputs   x -> attn norm -> q, k, v (bias, q/k norm, RoPE)
 *   (engine)         write k, v to its cache; kern_attention -> att, lse
 *   fw_attn_emit     report lse, keys attended, attention output
 *   fw_layer_finish  att -> o_proj (-> post norm) -> residual -> FFN -> x
 *   fw_logits        x -> final norm -> logits (softcap)
 *
 * Every function emits its intermediates to the observer (may be NULL),
 * labelled with absolute positions pos0 .. pos0 + n - 1. */
#ifndef KV_FORWARD_H
#define KV_FORWARD_H

#include <stdbool.h>
#include <stdint.h>
#include "observer.h"
#include "err.h"
#include "kernels.h"
#include "model.h"

/* Activations for up to `cap` rows, sized for one model. */
typedef struct {
    int cap;
    float *x;        /* (cap, E) residual stream */
    float *xn;       /* (cap, E) normalised input of the current block */
    float *q;        /* (cap, H*D) (D, KV: the widest layer's; rows are packed at
                        the current layer's width) */
    float *k, *v;    /* (cap, KV*D) */
    float *att;      /* (cap, H*D) attention output */
    float *ple;      /* (cap, L*P) Gemma 4's per-layer inputs of the rows, or NULL */
    float *ple_l;    /* (cap, P) one layer's slice of them */
    float *ple_tab;  /* (L*P) one token's table row */
    float *lse;      /* (cap, H) */
    float *nkeys;    /* (cap, H) keys attended, for the observer */
    float *proj;     /* (cap, E) */
    float *gate, *up;/* (cap, I) */
    float *stats;    /* (cap, 3) */
    float *rope_cos, *rope_sin; /* (cap, D/2) */
    double *inv_freq_local, *inv_freq_global; /* (D/2) of sliding / full layers */
    double rope_mscale_local, rope_mscale_global; /* cos/sin multipliers (YaRN) */
    /* gpt-oss (NULL elsewhere) */
    float *sink;     /* (cap, H) the sink's share of each softmax */
    uint8_t *sink_off;   /* (cap) rows whose softmax leaves the sink out (an engine's
                            injected bug; read only while sink_off_any) */
    bool sink_off_any;
    float *moe_logits;   /* (cap, X) router logits */
    float *moe_in;   /* (cap, max(E, I)) rows gathered for one expert, then theirs */
    float *moe_gu;   /* (cap, 2I) their gate_up projection */
    float *moe_y;    /* (cap * k, E) each row's chosen experts' outputs, by rank */
    float *moe_w;    /* (cap * k) their routing weights */
    int *moe_x;      /* (cap * k) their expert ids */
    int *moe_rows;   /* (cap) rows gathered for one expert: row * k + rank */
    float *moe_sel;  /* (cap, X) the rows experts are chosen by (router_logits) */
    /* MLA (NULL elsewhere; mla.h) */
    float *lat;      /* (cap, R + dr) the cache rows */
    float **mla_rows;/* (cap) pointers to them */
    float *mla_tmp;  /* scratch: (cap, max(q_lora_rank, R + H (nope + Dv))) */
} fw_state;

int fw_state_init(fw_state *s, const kv_model *m, int cap, kv_err *e);
void fw_state_free(fw_state *s);   /* accepts a zeroed struct */

/* Does the observer want this (stage, layer)? False for a NULL observer. */
int fw_wants(kv_observer *obs, kv_stage st, int layer);

/* Emits rows; returns the observer's verdict (0 = continue). */
int fw_emit(kv_observer *obs, kv_stage st, int layer, int64_t pos0, int n, int ncols,
            const float *data);

/* s->x = embedding of tokens (n rows), and Gemma 4's per-layer inputs
 * into s->ple. Token ids must be in range. */
int fw_embed(const kern_ctx *kc, const kv_model *m, fw_state *s, const int32_t *tokens,
             int n, int64_t pos0, kv_observer *obs);

/* From s->x: s->xn, s->q and (when the layer owns a cache) s->k, s->v, with
 * RoPE at positions rope_pos[0..n) (normally pos0 + i). */
int fw_attn_inputs(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                   int64_t pos0, const int64_t *rope_pos, kv_observer *obs);

/* Finishes attention and emits it: on a model with attention sinks, each
 * head's output is first scaled by its keys' share of the softmax that
 * includes the sink (the sink adds to the denominator, no value); then
 * emits attn_lse (from s->lse, over the keys alone), attn_nkeys (nkeys[r]
 * keys read by row r, the same for every head), attn_sink (the sink's
 * share) and attn_out (s->att). Both engines call it after their
 * attention, so a sink is applied identically whatever the cache. */
int fw_attn_emit(const kv_model *m, int layer, fw_state *s, int n, int64_t pos0,
                 const int *nkeys, kv_observer *obs);

/* The k experts a mixture chooses from one selection row (the
 * router_logits stage: logits, or DeepSeek-V3's sigmoid + correction
 * bias), within the best groups when the config has them; idx by rank.
 * The comparer reads recordings the same way. */
void fw_route_choose(const kv_config *c, const float *sel, int *idx);
/* The n_group group scores fw_route_choose keeps the best topk_group of:
 * a group's best selection score, or its best two's sum (sigmoid). */
void fw_route_groups(const kv_config *c, const float *sel, float *gs);

/* From s->att and s->x: output projection, residual, FFN, residual -> s->x. */
int fw_layer_finish(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                    int64_t pos0, kv_observer *obs);

/* Logits of rows [row0, row0 + n) of s->x into logits (n, V). Uses s->xn. */
int fw_logits(const kern_ctx *kc, const kv_model *m, fw_state *s, int row0, int n,
              int64_t pos0, float *logits, kv_observer *obs);

#endif
