/* family.h — one architecture as one table row.
 *
 * A family (llama, qwen2, qwen3, gemma3_text, gemma4_text, gpt_oss,
 * deepseek_v2, deepseek_v3) is a
 * kv_family in its own file under model/families/: its config.json names
 * and transformers' defaults, the traits the shared code reads instead of
 * asking "which model is this" (may layers slide, may they share a KV
 * cache, do attention sinks or experts exist), and hooks for what no trait
 * can say: the keys of config.json only it has, their checks and how they
 * are written back, and its built-in presets. The shared code (config.c,
 * model.c, forward.c, the engines) implements each feature once (a sink, a
 * mixture of experts, YaRN) and turns it on from the config, so a new
 * family is a new file plus its line in families.c.
 *
 * Families added before this table still keep some of their reading in
 * config.c (Gemma's RoPE and layer keys, Gemma 4's per-layer sizes);
 * docs/architectures.md lists what each file holds. */
#ifndef KV_FAMILY_H
#define KV_FAMILY_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "config_json.h"

/* A built-in preset: fills a zeroed config completely. */
typedef struct {
    const char *name;
    void (*build)(kv_config *c);
} kv_family_preset;

typedef struct kv_family {
    kv_arch arch;
    const char *model_type;      /* config.json's model_type */
    const char *outer_type;      /* a wrapper's model_type nesting it under text_config, or NULL */
    const char *architecture;    /* architectures[0] when writing config.json */
    const char *gguf_arch;       /* GGUF general.architecture (llama.cpp's name) */
    const char *act_key;         /* hidden_act or hidden_activation */

    /* transformers' defaults (sizes_required: num_attention_heads and
     * vocab_size have 7B defaults there, so a config.json must say them) */
    bool sizes_required;
    int def_heads, def_kv_heads, def_head_dim, def_vocab, def_max_positions;
    double def_theta;
    bool def_tie;
    int def_bos, def_eos;        /* -1: none */

    /* traits */
    bool slides;                 /* layers may be sliding_attention */
    int def_pattern;             /* without layer_types, layer i slides iff (i+1) % P != 0
                                    (0: every layer full) */
    int def_window;              /* sliding_window when absent */
    bool sinks;                  /* every attention has a learned sink logit per head */
    bool moe;                    /* the MLP is a mixture of experts */
    bool sliding_rope_scaled;    /* rope_scaling applies to sliding layers too (else
                                    to full layers only, as in Gemma 3) */
    bool bias_switch;            /* attention_bias turns the q, k, v and o biases on */
    bool mla;                    /* multi-head latent attention (kv_lora_rank ...); head_dim
                                    is derived (qk_nope + qk_rope), never written */

    /* GGUF names of layer tensors where this family's differ from the
     * shared map (model/gguf.c): {Hugging Face suffix, GGUF suffix}
     * pairs, ended by {NULL, NULL}; NULL: none. */
    const char *const (*gguf_names)[2];

    /* hooks (NULL: nothing of its own) */
    void (*flags)(kv_config *c);                     /* what follows from the family alone */
    int (*parse)(const cfg_jctx *cx, const json_t *obj, kv_config *c); /* its own keys */
    int (*check)(const kv_config *c, kv_err *e);     /* its own fields */
    void (*write)(cfg_writer *w, const kv_config *c);/* its own keys, after the common ones */
    const kv_family_preset *presets;
    int n_presets;
} kv_family;

/* The family of arch, or NULL when arch is not one. */
const kv_family *family_of(kv_arch arch);
/* The family whose model_type (or outer_type) is mt, or NULL. */
const kv_family *family_by_model_type(const char *mt);
/* The family llama.cpp calls gguf_arch, or NULL. */
const kv_family *family_by_gguf_arch(const char *gguf_arch);
/* "llama, qwen2, gemma3_text, gemma3, ..." (each model_type, then its outer
 * type) into buf, for messages. */
void family_model_types(char *buf, size_t n);

/* The families' presets, in table order: count, and the i-th. */
int family_preset_count(void);
const kv_family_preset *family_preset(int i);

/* Shared pieces the family files use to build configs. */
void family_set(kv_config *c, kv_arch arch);   /* model_type, flags, tensor names */

#endif
