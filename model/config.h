/* config.h — the model configuration both engines share.
 *
 * A kv_config is plain data (no pointers): it comes from a built-in preset,
 * or from a Hugging Face config.json (model_type llama, qwen2, qwen3,
 * gemma3_text, gemma3, gemma4_text, gemma4), and can be written back as a config.json that Hugging Face
 * transformers reads. Everything an engine needs is resolved here, so
 * engines never look at model_type strings: per-layer attention type,
 * window, RoPE base and the layer whose KV cache each layer reads. */
#ifndef KV_CONFIG_H
#define KV_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include "err.h"

#define KV_MAX_LAYERS 256
#define KV_MAX_EOS 8

/* Sizes past which a config value is a typo or an attack (config_validate
 * refuses them); public so that readers of other formats (the GGUF
 * recorder) refuse them under their own key names. */
#define KV_MAX_HIDDEN       (1 << 20)
#define KV_MAX_HEADS        (1 << 12)
#define KV_MAX_HEAD_DIM     (1 << 14)
#define KV_MAX_INTERMEDIATE (1 << 22)
#define KV_MAX_POSITIONS    (1 << 24)
#define KV_MAX_VOCAB        (1 << 24)

typedef enum { ARCH_LLAMA, ARCH_QWEN2, ARCH_GEMMA3, ARCH_QWEN3, ARCH_GEMMA4, ARCH_GPT_OSS,
               ARCH_DEEPSEEK2, ARCH_DEEPSEEK3, ARCH_COUNT } kv_arch;
/* How a mixture of experts picks and weighs its experts. */
typedef enum {
    ROUTE_TOPK_SOFTMAX = 0,   /* gpt-oss: top k logits, softmaxed among themselves */
    ROUTE_SOFTMAX,            /* DeepSeek-V2: softmax over all, top k of it (group-limited
                                 when n_group > 0), normalised or times routed_scale */
    ROUTE_SIGMOID,            /* DeepSeek-V3 (noaux_tc): sigmoid scores, chosen by score +
                                 correction bias within the best groups, weights the
                                 scores (normalised), times routed_scale */
} kv_route;
typedef enum { ACT_SILU, ACT_GELU_TANH } kv_act;
typedef enum { ATTN_GLOBAL = 0, ATTN_SLIDING = 1 } kv_attn_type;
typedef enum { ROPE_SCALE_NONE, ROPE_SCALE_LINEAR, ROPE_SCALE_LLAMA3, ROPE_SCALE_YARN } kv_rope_scale;

typedef struct {
    kv_rope_scale type;
    double factor;               /* linear and llama3 */
    double low_freq_factor;      /* llama3 only */
    double high_freq_factor;     /* llama3 only */
    int original_max_position;   /* llama3 and yarn */
    double beta_fast, beta_slow; /* yarn: the ramp's rotation counts (32, 1 by default) */
    bool truncate;               /* yarn: the ramp's ends rounded to whole dims (true by
                                    default; gpt-oss writes false) */
    double attn_factor;          /* yarn: multiplier of cos and sin (0.1 ln factor + 1
                                    unless the config names one); 0 elsewhere */
    double mscale, mscale_all_dim; /* yarn as DeepSeek writes it (0: absent): cos and sin
                                    times m(mscale) / m(mscale_all_dim), and q.k times
                                    m(mscale_all_dim)^2, m(x) = 0.1 x ln factor + 1 */
} kv_rope_scaling;

typedef struct {
    kv_arch arch;
    char model_type[32];         /* as written to config.json: "llama", "qwen2", "qwen3",
                                    "gemma3_text" */

    int hidden;                  /* E: hidden_size */
    int n_layers;                /* L: num_hidden_layers */
    int n_heads;                 /* H: num_attention_heads */
    int n_kv_heads;              /* KV: num_key_value_heads */
    int head_dim;                /* D */
    int intermediate;            /* intermediate_size */
    int vocab;                   /* V: vocab_size */
    int max_positions;           /* max_position_embeddings: the longest context accepted */

    double rms_eps;
    bool norm_plus_one;          /* Gemma: x * (1 + w); others x * w */
    kv_act act;
    bool qkv_bias;               /* q/k/v projections have biases: Qwen2 always; Llama and
                                    Qwen3 when attention_bias is true */
    bool o_bias;                 /* o_proj has a bias: Llama and Qwen3 with attention_bias
                                    (Qwen2 never); equals qkv_bias for those two */
    bool qk_norm;                /* Gemma 3, Qwen3: RMSNorm over D on each q and k head before
                                    RoPE (multiplier 1 + w on Gemma, w on Qwen3) */
    bool sandwich_norms;         /* Gemma 3: post-attention / pre- and post-feedforward norms */
    bool tie_embeddings;         /* lm_head is embed_tokens */
    float embed_scale;           /* Gemma: sqrt(hidden) as float32; others 1 */
    double attn_scale;           /* multiplier of q.k: 1/sqrt(head_dim) or query_pre_attn_scalar^-0.5 */
    double query_pre_attn_scalar;/* Gemma 3 as in config.json (attn_scale = 1/sqrt of it); 0 for others */
    double final_softcap;        /* 0 = none; else logits = cap * tanh(logits / cap) */

    double rope_theta;           /* global (full attention) layers */
    double rope_local_theta;     /* sliding layers (Gemma 3 rope_local_base_freq) */
    kv_rope_scaling rope_scaling;/* applies to global layers (Gemma 3 and Llama alike) */

    int sliding_window;          /* W, 0 when no layer slides */
    uint8_t layer_type[KV_MAX_LAYERS];  /* kv_attn_type of each layer */
    int16_t kv_owner[KV_MAX_LAYERS];    /* layer whose cache layer i reads; i when it owns one */

    int bos_id;                  /* -1 when unknown */
    int eos_ids[KV_MAX_EOS];
    int n_eos;

    /* Prefix of the decoder's tensor names, e.g. "model." or
     * "language_model.model." (Gemma3ForConditionalGeneration). lm_head
     * lives at lm_head_name. */
    char tensor_prefix[64];
    char lm_head_name[96];

    /* Gemma 4 (zero elsewhere). Sliding layers use head_dim and
     * n_kv_heads; full-attention layers use these when non-zero. */
    int head_dim_full;           /* global_head_dim */
    int n_kv_heads_full;         /* num_global_key_value_heads */
    double rope_partial_full;    /* full layers' "proportional" RoPE: the first
                                    rope_partial_full * D/2 pairs rotate, at
                                    frequencies theta^(-2j/D); 0 = all pairs */
    bool k_eq_v;                 /* attention_k_eq_v: full layers have no v_proj and
                                    take v from k_proj's output (before k_norm) */
    bool v_norm;                 /* v goes through an RMSNorm without weight */
    bool double_wide_mlp;        /* use_double_wide_mlp: KV-shared layers' MLP is 2 I wide */
    bool layer_scalar;           /* each layer's output is multiplied by its layer_scalar */
    int per_layer_dim;           /* hidden_size_per_layer_input P; 0 = no per-layer inputs */
    int per_layer_vocab;         /* vocab_size_per_layer_input */

    /* gpt-oss (zero elsewhere). */
    bool attn_sinks;             /* a learned logit per head joins every softmax's
                                    denominator and adds no value */
    int n_experts;               /* num_local_experts; 0 = a dense MLP */
    int n_experts_used;          /* num_experts_per_tok (top-k) */
    double swiglu_limit;         /* the experts' clamp: gate <= limit, |up| <= limit */

    /* Experts beyond gpt-oss's (DeepSeek; zero elsewhere). */
    kv_route route;
    int moe_intermediate;        /* each routed expert's width (0: intermediate) */
    int n_shared_experts;        /* shared experts on every row: one MLP of width
                                    n_shared_experts x moe_intermediate */
    int first_dense;             /* first_k_dense_replace: layers before it are dense */
    int moe_every;               /* moe_layer_freq: layer i >= first_dense has experts
                                    iff i % moe_every == 0 (0: every layer) */
    int n_group, topk_group;     /* group-limited routing: experts in n_group groups,
                                    the best topk_group groups chosen first (0: none) */
    bool norm_topk;              /* norm_topk_prob: the chosen weights sum to 1 */
    double routed_scale;         /* routed_scaling_factor */

    /* MLA, multi-head latent attention (DeepSeek-V2/V3; zero elsewhere).
     * head_dim is then qk_nope + qk_rope and n_kv_heads n_heads: q, k and
     * v as the expanded heads; the cache row is the latent. */
    int kv_lora_rank;            /* R: the cached latent's width; 0: not MLA */
    int q_lora_rank;             /* 0: q_proj; else q_a_proj (to this), q_a_layernorm,
                                    q_b_proj */
    int qk_rope_dim;             /* each head's rotated tail; one key tail shared by all
                                    heads, rotated on interleaved pairs (2i, 2i+1) */
    int v_head_dim;              /* values and attention output per head */
} kv_config;

/* Head size, KV heads and MLP width of layer i (Gemma 4's full-attention
 * layers differ from its sliding ones; double-wide MLPs on shared layers). */
int config_layer_head_dim(const kv_config *c, int layer);
int config_layer_kv_heads(const kv_config *c, int layer);
int config_layer_intermediate(const kv_config *c, int layer);
/* Does layer i run a mixture of experts (else a dense MLP)? */
bool config_layer_moe(const kv_config *c, int layer);
/* Width of the dense MLP of layer i: intermediate on dense layers, the
 * shared experts' n_shared x moe_intermediate on expert layers (0: none). */
int config_layer_dense_width(const kv_config *c, int layer);
/* Values per head (MLA's v_head_dim; else the head size). */
int config_layer_v_head_dim(const kv_config *c, int layer);
/* Is this model's attention MLA (a latent cache)? */
bool config_mla(const kv_config *c);
/* Floats of one MLA cache row: kv_lora_rank + qk_rope_dim (0 when not MLA). */
int config_mla_row(const kv_config *c);
/* Pairs of layer i's head that RoPE rotates (D/2 unless partial). */
int config_layer_rope_pairs(const kv_config *c, int layer);
/* The largest of each over all layers (buffer sizes). */
int config_max_head_dim(const kv_config *c);
int config_max_kv_width(const kv_config *c);     /* KV heads x D */
int config_max_q_width(const kv_config *c);      /* H x D */
int config_max_intermediate(const kv_config *c);
/* Does layer i have stage st (a kv_stage)? Not k and v on a layer reading
 * another's cache, nor the per-layer input stages without per-layer inputs. */
bool config_layer_has_stage(const kv_config *c, int layer, int st);
/* Layer i owns a v projection (false on Gemma 4's K=V full layers). */
bool config_layer_has_v_proj(const kv_config *c, int layer);

/* Attention window of layer i: 0 for global layers. */
int config_layer_window(const kv_config *c, int layer);

/* RoPE base of layer i (rope_local_theta on sliding layers of Gemma 3). */
double config_layer_theta(const kv_config *c, int layer);

/* Inverse frequencies of a layer's RoPE (sliding or full; half = its head
 * size / 2 values, in double): the layer's base, the scaling where it
 * applies (full layers; every layer when the family scales sliding ones
 * too), pairs past a partial rotation 0. mscale: what cos and sin are
 * multiplied by (YaRN's attention factor, else 1). */
void config_rope_inv_freq(const kv_config *c, bool sliding, double *inv_freq);
/* Does the config's rope_scaling apply to a layer of this kind? */
bool config_rope_scaled(const kv_config *c, bool sliding);
double config_rope_mscale(const kv_config *c, bool sliding);

/* Sets what follows from c->arch alone: norm_plus_one, qk_norm,
 * sandwich_norms, qkv_bias (Qwen2), o_bias off and the activation. A dump
 * reader calls it, since a dump's model_config names only the family. */
void config_family_flags(kv_config *c);

/* Checks internal consistency (sizes in range, H divisible by KV, even
 * head_dim, flags and scales those of the family, owners earlier, owning
 * and of the same type, ...). Returns 0 or fills e and returns -1. */
int config_validate(const kv_config *c, kv_err *e);

/* Reads a Hugging Face config.json. On error fills e with
 * "<path>: <problem>" and returns -1; *out is then unspecified. */
int config_load_json(const char *path, kv_config *out, kv_err *e);

/* Parses config.json text (len bytes, need not be NUL-terminated); `name`
 * is used in error messages. Used by config_load_json and the fuzzer. On
 * success *out (all of it, padding included, zeroed first) passes
 * config_validate; on error *out is untouched. */
int config_parse_json(const char *text, size_t len, const char *name,
                      kv_config *out, kv_err *e);

/* Writes c as a Hugging Face config.json to path (temp file + rename), as
 * model_type llama, qwen2, qwen3 or gemma3_text; reading it back gives c again,
 * except tensor_prefix and lm_head_name, which config.json does not hold.
 * Refuses (-1, "<path>: ...") an invalid c and KV owners other than
 * num_kv_shared_layers can say. */
int config_write_json(const kv_config *c, const char *path, kv_err *e);

/* config_write_json with "torch_dtype" set to torch_dtype ("float32",
 * "bfloat16"): what the weights beside it are stored as. */
int config_write_json_dtype(const kv_config *c, const char *path, const char *torch_dtype,
                            kv_err *e);

/* Built-in presets: "tiny-llama", "tiny-llama3" (llama3 RoPE scaling),
 * "tiny-qwen2", "tiny-qwen3", "tiny-gemma3", "tiny-gemma3-kvshared",
 * "tiny-gemma4", "qwen2.5-0.5b-shape", "qwen3-0.6b-shape",
 * "gemma3-1b-shape", "gemma4-e2b-shape".
 * Returns 0, or -1 with e filled for an unknown name. */
int config_preset(const char *name, kv_config *out, kv_err *e);

/* NULL-terminated list of preset names, for --help and tests. */
const char *const *config_preset_names(void);

/* One line describing the model, for `kvdiff run --verbose`. */
void config_describe(const kv_config *c, char *buf, size_t n);

#endif
