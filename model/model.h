/* model.h — the weights both engines run on.
 *
 * A kv_model owns every weight, packed for the kernels (see kernels.h).
 * It comes from a Hugging Face folder (config.json + safetensors) or from
 * a built-in preset whose weights are drawn from PCG32. The tensor
 * catalogue (names and shapes exactly as Hugging Face transformers uses
 * them) is shared by the loader, the synthetic generator and `kvdiff gen`,
 * so a generated folder loads back to the same bytes. */
#ifndef KV_MODEL_H
#define KV_MODEL_H

#include <stdint.h>
#include "config.h"
#include "err.h"
#include "kernels.h"

typedef enum {
    TENSOR_EMBED,     /* (V, E) token embeddings */
    TENSOR_LINEAR,    /* (out, in) projection */
    TENSOR_BIAS,      /* (out) */
    TENSOR_NORM,      /* (n) RMSNorm multiplier as stored; also Gemma 4's layer_scalar (1) */
    TENSOR_TABLE,     /* (Vp, L*P) Gemma 4's per-layer embeddings: rows are gathered, never
                         multiplied, so they are kept row-major, not packed */
    TENSOR_SINKS,     /* (H) gpt-oss's sink logit per head */
    TENSOR_EXPERTS,   /* (X, in, out) gpt-oss's stacked expert matrices, stored input-major
                         (x @ W) as transformers keeps them; packed per expert as (out, in) */
    TENSOR_EXPERT_BIAS, /* (X, out) one bias row per expert */
    TENSOR_EXPERT_PART, /* (out, in) one expert's gate, up or down projection, stored
                           alone (DeepSeek: mlp.experts.N.gate_proj.weight); gate and up
                           packed into one (2I, in) matrix, gate rows first */
} tensor_kind;

typedef struct {
    char name[160];
    tensor_kind kind;
    int ndim;           /* 1, 2 or 3 (experts); a 3-D tensor is read as shape[0] x shape[1]
                           rows of shape[2] */
    int64_t shape[3];
    int layer;          /* -1 for model-level tensors */
} tensor_spec;

/* Fills specs (may be NULL to count) with the tensors a model of config c
 * has, in a fixed canonical order, names using c->tensor_prefix. Returns
 * the count. */
int tensors_list(const kv_config *c, tensor_spec *specs, int cap);

/* Draws tensor s of a synthetic model with the given seed into out
 * (shape product floats). Each tensor has its own PCG32 stream derived from
 * its name, so the result does not depend on the order tensors are made.
 * Scales keep activations of order 1 through every layer. */
void synth_tensor(const kv_config *c, const tensor_spec *s, uint64_t seed, float *out);

/* Rows [row0, row0 + nrows) of synth_tensor's result (of a 2-D tensor). */
void synth_tensor_rows(const kv_config *c, const tensor_spec *s, uint64_t seed, int64_t row0,
                       int64_t nrows, float *out);

typedef struct {
    kern_linear wq, wk, wv, wo;     /* wk, wv empty (n_out 0) on KV-shared followers */
    kern_linear w_gate, w_up, w_down;
    float *attn_norm;               /* (E) input_layernorm */
    float *ffn_norm;                /* (E) post_attention_layernorm (Llama, Qwen2) or
                                       pre_feedforward_layernorm (Gemma 3) */
    float *post_attn_norm;          /* (E) Gemma 3 only */
    float *post_ffn_norm;           /* (E) Gemma 3 only */
    float *q_norm, *k_norm;         /* (D) Gemma 3 and Qwen3; k_norm NULL on followers */
    /* Gemma 4 */
    kern_linear w_pl_gate;          /* (P, E) per_layer_input_gate */
    kern_linear w_pl_proj;          /* (E, P) per_layer_projection */
    float *pl_norm;                 /* (E) post_per_layer_input_norm */
    float *layer_scalar;            /* (1) */
    /* gpt-oss */
    float *sinks;                   /* (H) self_attn.sinks */
    kern_linear router;             /* (X, E) mlp.router, biased */
    kern_linear *gate_up;           /* (X) experts' (2I, E): gate rows 0, 2, ..., up rows 1, 3,
                                       ..., as transformers interleaves them; biased */
    kern_linear *down;              /* (X) experts' (E, I), biased (gpt-oss) */
    float *router_sel_bias;         /* (X) DeepSeek-V3's e_score_correction_bias */
    /* MLA (DeepSeek): wq is q_proj, or q_b_proj after q_a_proj and its norm */
    kern_linear wq_a;               /* (q_lora_rank, E) */
    float *q_a_norm;                /* (q_lora_rank) */
    kern_linear wkv_a;              /* (R + dr, E) kv_a_proj_with_mqa */
    float *kv_a_norm;               /* (R) kv_a_layernorm */
    kern_linear wkv_b;              /* (H (nope + Dv), R) kv_b_proj */
    kern_linear *uk_t;              /* (H) the absorbed forms of wkv_b: each head's key part
                                       turned, (R, nope) */
    kern_linear *uv;                /* (H) each head's value part, (Dv, R) */
} model_layer;

/* A row-major table whose rows are looked up by token (Gemma 4's
 * per-layer embeddings: 262144 x 8960 at E2B, too big to pack as a
 * matrix, and only ever gathered). */
typedef struct {
    int64_t rows, cols;
    kern_wtype wtype;               /* KERN_F32: floats; KERN_BF16: bf16 words */
    void *data;
} model_table;

/* Routing taken from another run's recording (kvdiff run --follow): per
 * layer, the selection rows (its router_logits) that run chose experts
 * by, at positions first[l] .. first[l] + n[l] - 1 (rows[l] NULL: none
 * recorded). The engines then choose each of those rows' experts from the
 * followed row, their weights still from their own router (forward.c). */
typedef struct {
    int n_layers, X;
    int64_t *first, *n;             /* (n_layers) */
    float **rows;                   /* (n_layers) each (n[l], X) or NULL */
    int64_t followed;               /* rows held over all layers */
} kv_route_rows;

typedef struct {
    kv_config cfg;
    kern_wtype wtype;               /* storage of the projection weights */
    kern_linear embed;              /* (V, E); also the LM head when tied */
    kern_linear lm_head;            /* (V, E) when untied, else empty */
    float *final_norm;              /* (E) */
    model_layer *layers;            /* (L) */
    /* Gemma 4's per-layer inputs (empty when cfg.per_layer_dim is 0) */
    model_table pl_embed;           /* (Vp, L*P) embed_tokens_per_layer */
    kern_linear pl_model_proj;      /* (L*P, E) per_layer_model_projection */
    float *pl_proj_norm;            /* (P) per_layer_projection_norm */
    uint64_t fingerprint;           /* xxh3-64 of every packed weight, in catalogue order */
    char source[512];               /* "preset tiny-gemma3 seed 0" or the folder path */
    /* Tensors holding NaN or Inf (counted at load; 0: none) and the
     * first of them in catalogue order, as "<file>: tensor '<name>' holds
     * N NaN or infinite values". Rows computed from them are NaN. */
    int nonfinite_tensors;
    char nonfinite_first[512];
    /* NULL: the model routes by its own router rows; else set by the
     * caller (who owns it) for a followed run. */
    const kv_route_rows *route_follow;
} kv_model;

/* Called after each tensor is made or loaded, in catalogue order, with its
 * name and the weights (elements) done so far of the total: building a
 * large preset takes seconds, and the caller may want to say so (counted
 * in weights, not tensors, since the embedding alone can be a third of
 * the work). Library code prints nothing itself. */
typedef void (*model_progress_fn)(void *ctx, int64_t done, int64_t total, const char *tensor);

typedef struct {
    int wtype;                      /* -1: from the file (BF16 files stay bf16, others f32); else kern_wtype */
    model_progress_fn progress;     /* optional (NULL: none) */
    void *progress_ctx;
    /* Optional (NULL: the caller's thread alone): weights are converted,
     * drawn and packed on its threads; the model is the same bytes either
     * way. Must not be running another job meanwhile. */
    kern_pool *pool;
} model_opts;

/* Loads a Hugging Face folder. Errors name the file and tensor. */
int model_load_dir(const char *dir, const model_opts *o, kv_model *m, kv_err *e);

/* Gemma3ForConditionalGeneration checkpoints put the decoder under one of
 * several prefixes, depending on the transformers version that saved them:
 * sets c->tensor_prefix to the one whose embedding st holds (unchanged
 * when c's own prefix is there, or none is). */
struct st_file;
void model_resolve_prefix(kv_config *c, const struct st_file *st);

/* Builds a preset with synthetic weights. */
int model_from_preset(const char *preset, uint64_t seed, const model_opts *o, kv_model *m, kv_err *e);

/* Builds a model of config c (checked with config_validate) with synthetic
 * weights drawn from seed, exactly as model_from_preset does for a
 * preset's config (same config and seed: same weights). label names the
 * model in m->source and in messages ("preset tiny-llama"). */
int model_from_config(const kv_config *c, const char *label, uint64_t seed,
                      const model_opts *o, kv_model *m, kv_err *e);

/* A folder path (contains '/' or exists as a directory) or a preset name. */
int model_open(const char *spec, uint64_t seed, const model_opts *o, kv_model *m, kv_err *e);

void model_free(kv_model *m);     /* accepts a zeroed struct */

/* The matrix producing logits (embed when tied). */
const kern_linear *model_lm_head(const kv_model *m);

/* Row r of a table, cols floats into out. */
void model_table_row(const model_table *t, int64_t r, float *out);

/* Writes a synthetic preset as a Hugging Face folder (config.json and
 * model.safetensors with dtype F32 or BF16). Creates dir if needed. */
int model_gen_folder(const char *preset, uint64_t seed, int bf16, const char *dir, kv_err *e);

/* The same, calling progress (may be NULL) after each tensor written. */
int model_gen_folder_progress(const char *preset, uint64_t seed, int bf16, const char *dir,
                              model_progress_fn progress, void *ctx, kv_err *e);

/* model_gen_folder for any valid config c (a preset's with a feature
 * switched, say): the weights model_from_config(c, ..., seed) builds. */
int model_gen_folder_config(const kv_config *c, uint64_t seed, int bf16, const char *dir,
                            kv_err *e);

/* The same, drawing each tensor by blocks of rows on pool's threads (NULL:
 * the caller's alone). Every row has its own PCG32 stream, so the file is
 * byte for byte the one a single thread writes. */
int model_gen_folder_pool(const char *preset, uint64_t seed, int bf16, const char *dir,
                          kern_pool *pool, model_progress_fn progress, void *ctx, kv_err *e);

#endif
