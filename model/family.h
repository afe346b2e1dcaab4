/* family.h — one architecture as one table row.
 *
 * A family (llama, qwen2, qwen3, gemma3_text, gemma4_text, gpt_oss,
 * deepseek_v2, deepseek_v3) is a
 * kv_family in its own file under model/families/: its config.json names
 * and transformers' defaults, the traits the shared code reads instead of
 * asking "which model is this" (may layers slide, may they share a KV
 * cache, do attention sinks or experts exist), and hooks for what no trait
 * can say: the keys of config.json only it has, their checks and how they
 * are written back, its built-in presets, and its side of llama.cpp (GGUF
 * keys written and read back, what llama.cpp cannot run of it, the names
 * of its graph's nodes). The shared code (config.c,
 * model.c, forward.c, the engines) implements each feature once (a sink, a
 * mixture of experts, YaRN) and turns it on from the config, so a new
 * family is a new file plus its line in families.c.
 *
 * Families added before this table still keep some of their reading in
 * config.c (Gemma's RoPE and layer keys, Gemma 4's per-layer sizes),
 * gguf.c and kvdiff-llama (Gemma's GGUF keys); docs/architectures.md lists
 * what each file holds. */
#ifndef KV_FAMILY_H
#define KV_FAMILY_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"
#include "config_json.h"
#include "observer.h"

/* llama.cpp's graph for this family, as kvdiff-llama records it: which
 * node of a layer ("<node>-<layer>") or of the model (no layer) carries
 * which stage. A node matches on its name and, where set, on being the
 * ROPE op of that name or on rows of the stage's full width. */
typedef enum {
    GRAPH_EMIT,         /* the node's rows are the stage's */
    GRAPH_LAST,         /* several nodes carry the name: the last one before the layer's
                           next recorded stage wins (q, v, attn_proj) */
    GRAPH_Q_TAILS,      /* MLA: the rotated tails of the q held before (q_pe) */
    GRAPH_ALL_LAYERS    /* a model node holding every layer's stage (Gemma 4's ple_in) */
} kv_graph_take;

typedef struct {
    const char *node;            /* NULL ends a table */
    kv_stage stage;
    kv_graph_take take;
    bool model;                  /* a model node (no layer) */
    bool rope;                   /* only its ROPE op (the name before RoPE is skipped) */
    bool full_width;             /* only a node whose rows are the stage's full width */
} kv_graph_name;

/* An entry's first three fields, named (the others default to false). */
#define KV_GRAPH(n, s, t) .node = (n), .stage = (s), .take = (t)
/* The model nodes every llama.cpp graph names alike, after its embedding
 * node's name. */
#define KV_GRAPH_MODEL(embed)                                                  \
    {KV_GRAPH(embed, STAGE_EMBED, GRAPH_EMIT), .model = true},                 \
    {KV_GRAPH("result_norm", STAGE_FINAL_NORM, GRAPH_EMIT), .model = true},    \
    {KV_GRAPH("result_output", STAGE_LOGITS, GRAPH_EMIT), .model = true}
/* Llama's attention nodes (llama, qwen, gemma3, gpt-oss): the norm, q and
 * k after RoPE, the last v (after its bias), the attention output. */
#define KV_GRAPH_LLAMA_ATTN                                                    \
    {KV_GRAPH("attn_norm", STAGE_ATTN_NORM, GRAPH_EMIT)},                      \
    {KV_GRAPH("Qcur", STAGE_Q, GRAPH_EMIT), .rope = true},                     \
    {KV_GRAPH("Kcur", STAGE_K, GRAPH_EMIT), .rope = true},                     \
    {KV_GRAPH("Vcur", STAGE_V, GRAPH_LAST)},                                   \
    {KV_GRAPH("kqv_out", STAGE_ATTN_OUT, GRAPH_EMIT)}

/* The names llama.cpp's llama, qwen2 and qwen3 graphs give (families.c):
 * a family whose graph names nothing else sets no table of its own. */
extern const kv_graph_name family_graph_default[];

/* GGUF metadata as a family's from_gguf reads it (kvdiff-llama provides
 * it over ggml's gguf API). A key is named by its suffix after
 * "<general.architecture>.", or in full after '='. Messages name the file
 * (path) and the key. */
typedef struct kv_gguf_in kv_gguf_in;
struct kv_gguf_in {
    const void *ctx;
    const char *path;
    /* An integer from lo to hi into *out; dflt when absent (an error
     * naming `what` when required). 0, or -1 with e set. */
    int (*int_key)(const kv_gguf_in *g, const char *suffix, long long lo, long long hi,
                   bool required, long long dflt, const char *what, int *out, kv_err *e);
    /* A number (any numeric type), dflt when absent; *found (may be NULL)
     * says whether it was there. */
    double (*num)(const kv_gguf_in *g, const char *suffix, double dflt, bool *found);
    bool (*has)(const kv_gguf_in *g, const char *suffix);       /* the key is there */
    bool (*is_true)(const kv_gguf_in *g, const char *suffix);   /* a bool key, true */
    /* Which layers slide, as llama.cpp decides: a bool per layer in
     * attention.sliding_window_pattern, or every n-th layer global (n that
     * key's number, `period` when absent). 0, or -1 with e set. */
    int (*layer_types)(const kv_gguf_in *g, kv_config *c, int period, kv_err *e);
};

/* GGUF metadata as a family's gguf_keys writes it (model/gguf.c provides
 * it): a key starting with '.' is the architecture's ("deepseek2" +
 * ".attention.kv_lora_rank"), any other is written as named. */
typedef struct kv_gguf_out kv_gguf_out;
struct kv_gguf_out {
    void *ctx;
    void (*u32)(kv_gguf_out *g, const char *key, uint32_t v);
    void (*f32)(kv_gguf_out *g, const char *key, float v);
    void (*flag)(kv_gguf_out *g, const char *key, bool v);
    void (*u32s)(kv_gguf_out *g, const char *key, const uint32_t *v, int n);   /* per layer */
    void (*flags)(kv_gguf_out *g, const char *key, const uint8_t *v, int n);   /* bools */
};

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

    /* llama.cpp's graph names (NULL: family_graph_default) */
    const kv_graph_name *graph;

    /* hooks (NULL: nothing of its own) */
    void (*flags)(kv_config *c);                     /* what follows from the family alone */
    int (*parse)(const cfg_jctx *cx, const json_t *obj, kv_config *c); /* its own keys */
    int (*check)(const kv_config *c, kv_err *e);     /* its own fields */
    void (*write)(cfg_writer *w, const kv_config *c);/* its own keys, after the common ones */
    const kv_family_preset *presets;
    int n_presets;

    /* What llama.cpp runs of this family from a GGUF's metadata, beyond
     * the sizes, RoPE and scaling every family shares (read before it,
     * into c); llama_scale is the q.k multiplier llama.cpp applies (set
     * to head_dim^-1/2 before). kvdiff-llama calls it; NULL: nothing of
     * its own (or, for the older families, still in kvdiff-llama). */
    int (*from_gguf)(const kv_gguf_in *g, kv_config *c, double *llama_scale, kv_err *e);
    /* Its own GGUF metadata as llama.cpp's converter writes it, after the
     * keys every family shares (model/gguf.c); NULL: none (or, for the
     * older families, still in gguf.c). */
    void (*gguf_keys)(kv_gguf_out *g, const kv_config *c);
    /* What llama.cpp's graph for it cannot run, refused before a GGUF is
     * written (one line, e); NULL: nothing of its own. */
    int (*gguf_check)(const kv_config *c, kv_err *e);
} kv_family;

/* The family of arch, or NULL when arch is not one. */
const kv_family *family_of(kv_arch arch);
/* Its llama.cpp graph names (family_graph_default when it names none). */
const kv_graph_name *family_graph(kv_arch arch);
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
