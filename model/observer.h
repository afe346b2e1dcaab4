/* observer.h — what engines emit while they run.
 *
 * Engines know nothing of files: at each stage of each layer they hand a
 * block of rows (consecutive absolute positions) to an observer. Sinks
 * (HDF5 writer, fingerprint writer, in-memory comparer, statistics) plug in
 * here without touching the engines. A NULL observer costs nothing. */
#ifndef KV_OBSERVER_H
#define KV_OBSERVER_H

#include <stdint.h>

/* Stages in dataflow order within a layer; model-level stages after. */
typedef enum {
    STAGE_X_IN = 0,        /* residual stream entering the layer (E) */
    STAGE_ATTN_NORM_STATS, /* mean, rms, absmax of the input-norm input (3) */
    STAGE_ATTN_NORM,       /* input_layernorm output (E) */
    STAGE_Q,               /* query after bias, q_norm, RoPE (H*D) */
    STAGE_KV_LATENT,       /* MLA: the cache row, the normed latent (kv_lora_rank) then
                              the rotated shared key tail (qk_rope_dim) */
    STAGE_K,               /* key as written to the cache (KV*D); MLA: each head's
                              expanded key, nope part then the shared rotated tail */
    STAGE_V,               /* value as written to the cache (KV*D); MLA: each head's
                              expanded value (H * v_head_dim) */
    STAGE_ATTN_LSE,        /* log-sum-exp of scaled scores per head (H) */
    STAGE_ATTN_NKEYS,      /* keys attended per head (H) */
    STAGE_ATTN_SINK,       /* gpt-oss: the sink's share of each head's softmax,
                              exp(s) / (exp(s) + sum exp(scores)) (H) */
    STAGE_ATTN_OUT,        /* softmax(scores) V, heads concatenated (H*D) */
    STAGE_ATTN_PROJ,       /* o_proj output; Gemma: after post_attention_layernorm (E) */
    STAGE_H_MID,           /* residual after attention (E) */
    STAGE_FFN_NORM_STATS,  /* mean, rms, absmax of the FFN-norm input (3) */
    STAGE_FFN_NORM,        /* FFN input norm output (E) */
    STAGE_ROUTER_LOGITS,   /* mixture of experts: the router's logits, before top-k (X) */
    STAGE_FFN_OUT,         /* MLP output; Gemma: after post_feedforward_layernorm (E) */
    STAGE_PLE_IN,          /* Gemma 4: this layer's slice of the per-layer inputs (P) */
    STAGE_PLE_OUT,         /* Gemma 4: per-layer input block output, after
                              post_per_layer_input_norm, before the residual (E) */
    STAGE_X_OUT,           /* residual stream leaving the layer (E); Gemma 4: times
                              layer_scalar */
    STAGE_LAYER_COUNT,
    /* model level (layer = -1) */
    STAGE_EMBED = STAGE_LAYER_COUNT, /* scaled embedding rows (E) */
    STAGE_FINAL_NORM,      /* final RMSNorm output (E) */
    STAGE_LOGITS,          /* full logits (V) */
    STAGE_COUNT
} kv_stage;

const char *stage_name(kv_stage s);

/* The stage's id in a dump's /row_hash_index (docs/dump-format.md): the
 * ids of format 1 (x_in = 0 ... x_out = 14, embed 15, final_norm 16,
 * logits 17) stay, stages added since come after (ple_in 18, ple_out 19, attn_sink 20, router_logits 21, kv_latent 22),
 * whatever their place in dataflow order. */
int stage_wire_id(kv_stage s);
/* The stage of a wire id; STAGE_COUNT when none. */
kv_stage stage_from_wire(uint64_t id);
/* -1 when unknown. */
int stage_parse(const char *name);

typedef struct {
    kv_stage stage;
    int layer;              /* -1 for model-level stages */
    int64_t pos0;           /* absolute position of the first row */
    int nrows;
    int ncols;              /* floats per row */
    const float *data;      /* nrows x ncols, row-major; valid during the call only */
} kv_event;

typedef struct kv_observer {
    /* Returns 0 to continue, non-zero to ask the engine to stop (the
     * engine then returns an error naming the observer's reason). */
    int (*emit)(struct kv_observer *self, const kv_event *ev);
    /* Generated token at position pos (prompt tokens are announced too,
     * with is_prompt = 1), before the next forward step. */
    int (*token)(struct kv_observer *self, int64_t pos, int32_t id, int is_prompt);
    /* Quick filter: does this observer want (stage, layer)? NULL = all.
     * Engines skip building rows nobody wants. */
    int (*wants)(struct kv_observer *self, kv_stage stage, int layer);
    /* Non-zero: engines compute the final norm and logits of every row
     * (costly with a large vocabulary). Zero: only of the rows generation
     * needs — the last prompt row and each decode step — which are still
     * emitted to an observer that wants them. */
    int all_logits;
} kv_observer;

/* Two sinks as one: every event goes to both (each filtered by its own
 * wants), in order a then b; the first non-zero return stops the run.
 * all_logits is either's. Fill with obs_tee_init; t must outlive the run. */
typedef struct {
    kv_observer obs;
    kv_observer *a, *b;
} kv_observer_tee;

kv_observer *obs_tee_init(kv_observer_tee *t, kv_observer *a, kv_observer *b);

#endif
