/* gpt_oss.c — gpt-oss (model_type gpt_oss, GptOssForCausalLM).
 *
 * What the family is, as transformers' GptOssConfig and modeling_gpt_oss
 * define it and llama.cpp's openai-moe graph runs it:
 *   - layers alternate sliding (even) and full (odd) attention: layer_types,
 *     else the pattern of period 2; sliding_window 128 by default;
 *   - a learned sink logit per head (self_attn.sinks) joins every softmax's
 *     denominator and carries no value; biases on q, k, v and o;
 *   - q.k scaled by head_dim^-1/2; RoPE with YaRN scaling (factor 32,
 *     truncate false in the published configs), cos and sin times the
 *     attention factor;
 *   - the MLP a mixture of experts: a biased router, the top
 *     num_experts_per_tok logits softmaxed among themselves, each chosen
 *     expert a gate_up projection (gate and up interleaved, biased), the
 *     gpt-oss SwiGLU (gate clamped above at swiglu_limit, up to +-limit,
 *     gate * sigmoid(1.702 gate) * (up + 1)) and a biased down projection;
 *   - RMSNorm multipliers w (not 1 + w), untied embeddings.
 * The features live in the shared code (forward.c: sinks, experts; the
 * kernels: YaRN); this file says the family has them and reads, checks and
 * writes its config.json keys. */
#include "../family.h"

#include <math.h>
#include <string.h>

#define MAX_EXPERTS (1 << 12)

static void flags(kv_config *c)
{
    c->act = ACT_SILU;
    c->attn_sinks = true;
    c->qkv_bias = c->o_bias = true;
}

/* num_experts_per_tok, or experts_per_token (the original release's key;
 * both must agree when both are there). */
static int parse_top_k(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    int a = 0, b = 0;
    const json_t *ka = json_object_get(obj, "num_experts_per_tok");
    const json_t *kb = json_object_get(obj, "experts_per_token");
    if (ka && cj_want_int(cx, "num_experts_per_tok", ka, 1, c->n_experts, &a))
        return -1;
    if (kb && cj_want_int(cx, "experts_per_token", kb, 1, c->n_experts, &b))
        return -1;
    if (ka && kb && a != b)
        return cj_fail(cx, "experts_per_token", "is %d but num_experts_per_tok is %d", b, a);
    c->n_experts_used = ka ? a : kb ? b : (c->n_experts < 4 ? c->n_experts : 4);
    return 0;
}

static int parse(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    char d[64];
    const json_t *q = json_object_get(obj, "quantization_config");
    if (cj_present(q))
        return cj_fail(cx, "quantization_config", "is %s; kvdiff reads gpt-oss with "
                       "BF16/F16/F32 expert weights (dequantize the MXFP4 experts first, "
                       "e.g. save_pretrained after loading with dequantize=True)",
                       cj_desc(q, d, sizeof d));
    bool bias = true;
    if (cj_get_int(cx, obj, "num_local_experts", true, 0, 1, MAX_EXPERTS, &c->n_experts)
        || parse_top_k(cx, obj, c)
        || cj_get_num(cx, obj, "swiglu_limit", 7.0, 0.0, true, CFG_MAX_SCALAR,
                      &c->swiglu_limit)
        || cj_get_bool(cx, obj, "attention_bias", true, &bias))
        return -1;
    c->qkv_bias = c->o_bias = bias;
    return 0;
}

static int check(const kv_config *c, kv_err *e)
{
    if (c->n_experts < 1 || c->n_experts > MAX_EXPERTS)
        return kv_errf(e, "n_experts %d out of 1..%d", c->n_experts, MAX_EXPERTS);
    if (c->n_experts_used < 1 || c->n_experts_used > c->n_experts)
        return kv_errf(e, "n_experts_used %d out of 1..%d", c->n_experts_used, c->n_experts);
    if (!(isfinite(c->swiglu_limit) && c->swiglu_limit > 0))
        return kv_errf(e, "swiglu_limit %g is not a positive number", c->swiglu_limit);
    if (c->qkv_bias != c->o_bias)
        return kv_errf(e, "gpt_oss has one attention_bias for q, k, v and o");
    return 0;
}

static void write(cfg_writer *w, const kv_config *c)
{
    cw_bool(w, "attention_bias", c->qkv_bias);
    cw_window(w, c);
    cw_layer_types(w, c);
    cw_int(w, "num_local_experts", c->n_experts);
    cw_int(w, "num_experts_per_tok", c->n_experts_used);
    cw_num(w, "swiglu_limit", c->swiglu_limit);
    cw_bool(w, "output_router_logits", false);
}

/* What every gpt-oss preset shares. */
static void base(kv_config *c, int hidden, int layers, int heads, int kv_heads, int head_dim,
                 int intermediate, int vocab, int window, int experts, int top_k)
{
    family_set(c, ARCH_GPT_OSS);
    c->hidden = hidden;
    c->n_layers = layers;
    c->n_heads = heads;
    c->n_kv_heads = kv_heads;
    c->head_dim = head_dim;
    c->intermediate = intermediate;
    c->vocab = vocab;
    c->rms_eps = 1e-5;
    c->embed_scale = 1.0f;
    c->attn_scale = 1.0 / sqrt((double)head_dim);
    c->rope_theta = c->rope_local_theta = 150000.0;
    c->tie_embeddings = false;
    cfg_layers_from_pattern(c, 2);
    c->sliding_window = window;
    for (int i = 0; i < layers; i++)
        c->kv_owner[i] = (int16_t)i;
    c->n_experts = experts;
    c->n_experts_used = top_k;
    c->swiglu_limit = 7.0;
}

/* Four layers (S F S F), 4 query heads 32 wide on 2 KV heads, 8 experts
 * of width 64 with 4 chosen, window 12 (short prompts cross it). YaRN
 * has gpt-oss's factor 32 and betas with original_max_position_embeddings
 * scaled down from 4096 to 64, so that at head_dim 32 frequencies are
 * kept, blended and slowed (as tiny-llama3 does for llama3 scaling). */
static void tiny(kv_config *c)
{
    base(c, 64, 4, 4, 2, 32, 64, 256, 12, 8, 4);
    c->max_positions = 4096;
    cfg_yarn(c, 32.0, 64, false);
    c->bos_id = 1;
    c->n_eos = 1;
    c->eos_ids[0] = 2;
}

/* openai/gpt-oss-20b's text model with synthetic weights: its 24 layers,
 * widths, heads, window, YaRN and 32 experts with 4 chosen, but each
 * expert 192 wide instead of 2880 (a 15th: 21B weights do not fit this
 * machine's memory; the routing, the sinks and the caches are whole). */
static void shape_20b(kv_config *c)
{
    base(c, 2880, 24, 64, 8, 64, 192, 201088, 128, 32, 4);
    c->max_positions = 131072;
    cfg_yarn(c, 32.0, 4096, false);
    c->bos_id = -1;     /* its config.json names none */
    c->n_eos = 1;
    c->eos_ids[0] = 200002;
}

/* llama.cpp's openai-moe tensors (conversion/gpt_oss.py); the experts'
 * stacks are split and transposed by the exporter (TENSOR_EXPERTS). */
static const char *const GGUF_NAMES[][2] = {
    {"post_attention_layernorm.weight", "post_attention_norm.weight"},
    {"self_attn.sinks", "attn_sinks.weight"},
    {"mlp.router.weight", "ffn_gate_inp.weight"},
    {"mlp.router.bias", "ffn_gate_inp.bias"},
    {NULL, NULL},
};

static const kv_family_preset PRESETS[] = {
    { "tiny-gpt-oss", tiny },
    { "gpt-oss-20b-shape", shape_20b },
};

/* gpt-oss as llama.cpp reads a GGUF (llama_model_openai_moe::
 * load_arch_hparams): experts, the window on a pattern of period 2, an
 * optional local RoPE base; the experts' clamp is llama.cpp's fixed 7. */
static int from_gguf(const kv_gguf_in *g, kv_config *c, double *llama_scale, kv_err *e)
{
    (void)llama_scale;   /* head_dim^-1/2, as set */
    if (g->int_key(g, "expert_count", 1, MAX_EXPERTS, true, 0, "the number of experts",
                   &c->n_experts, e) < 0 ||
        g->int_key(g, "expert_used_count", 1, c->n_experts, true, 0,
                   "the experts used per token", &c->n_experts_used, e) < 0 ||
        g->int_key(g, "expert_feed_forward_length", 1, KV_MAX_INTERMEDIATE, false,
                   c->intermediate, "the experts' width", &c->intermediate, e) < 0 ||
        g->int_key(g, "attention.sliding_window", 1, KV_MAX_POSITIONS, true, 0,
                   "the sliding window", &c->sliding_window, e) < 0 ||
        g->layer_types(g, c, 2, e) < 0)
        return -1;
    c->swiglu_limit = 7.0;
    c->rope_local_theta = g->num(g, "rope.freq_base_swa", c->rope_theta, NULL);
    return 0;
}

/* Its GGUF keys beyond the shared ones: the window and which layers
 * slide, one bool per layer. */
static void gguf_keys(kv_gguf_out *g, const kv_config *c)
{
    uint8_t pattern[KV_MAX_LAYERS];
    for (int i = 0; i < c->n_layers; i++)
        pattern[i] = c->layer_type[i] == ATTN_SLIDING;
    g->u32(g, ".attention.sliding_window", (uint32_t)c->sliding_window);
    g->flags(g, ".attention.sliding_window_pattern", pattern, c->n_layers);
}

/* llama.cpp's openai-moe graph: Llama's names, but "attn_post_norm" is
 * the FFN's input norm and "ffn_moe_out" the MLP's output (the router's
 * logits are taken by kvdiff-llama as the sum with ffn_gate_inp.bias). */
static const kv_graph_name GRAPH[] = {
    KV_GRAPH_MODEL("embd"),
    KV_GRAPH_LLAMA_ATTN,
    {KV_GRAPH("attn_out", STAGE_ATTN_PROJ, GRAPH_LAST)},
    {KV_GRAPH("ffn_inp", STAGE_H_MID, GRAPH_EMIT)},
    {KV_GRAPH("attn_post_norm", STAGE_FFN_NORM, GRAPH_EMIT)},
    {KV_GRAPH("ffn_moe_out", STAGE_FFN_OUT, GRAPH_EMIT)},
    {KV_GRAPH("l_out", STAGE_X_OUT, GRAPH_EMIT)},
    {.node = NULL},
};

const kv_family family_gpt_oss = {
    .arch = ARCH_GPT_OSS, .model_type = "gpt_oss", .architecture = "GptOssForCausalLM",
    .gguf_arch = "gpt-oss", .act_key = "hidden_act",
    .sizes_required = true, .def_head_dim = 64, .def_max_positions = 131072,
    .def_theta = 150000.0, .def_tie = false, .def_bos = -1, .def_eos = -1,
    .slides = true, .def_pattern = 2, .def_window = 128,
    .sinks = true, .moe = true, .bias_switch = true,
    .sliding_rope_scaled = true,
    .gguf_names = GGUF_NAMES,
    .graph = GRAPH, .from_gguf = from_gguf, .gguf_keys = gguf_keys,
    .flags = flags, .parse = parse, .check = check, .write = write,
    .presets = PRESETS, .n_presets = (int)(sizeof PRESETS / sizeof PRESETS[0]),
};
