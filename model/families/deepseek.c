/* deepseek.c — DeepSeek-V2 and -V3 (model_type deepseek_v2, deepseek_v3):
 * multi-head latent attention (MLA) and shared-expert mixtures.
 *
 * What the families are, as transformers' DeepseekV2/V3 configs and
 * models define them and llama.cpp's deepseek2 graph runs them:
 *   - attention: q from q_proj, or (q_lora_rank) q_a_proj -> q_a_layernorm
 *     -> q_b_proj, H heads of qk_nope + qk_rope; kv_a_proj_with_mqa gives
 *     the latent (kv_lora_rank) and one key tail (qk_rope) shared by all
 *     heads; the latent goes through kv_a_layernorm and is what a latent
 *     cache holds, with the rotated tail; kv_b_proj expands it to each
 *     head's key part (qk_nope) and value (v_head_dim). RoPE rotates the
 *     q tails and the shared key tail on interleaved pairs (2i, 2i+1);
 *   - YaRN as DeepSeek writes it: cos and sin times m(mscale) /
 *     m(mscale_all_dim) and q.k times (qk_head_dim)^-1/2 m(mscale_all_dim)^2,
 *     m(x) = 0.1 x ln(factor) + 1 (config.c reads both, set_scales applies
 *     the second);
 *   - MLP: the first first_k_dense_replace layers dense (intermediate_size),
 *     then a mixture every moe_layer_freq layers: a router without bias,
 *     V2 softmax over every expert and its top k (group-limited when
 *     topk_method says so), V3 sigmoid scores chosen with a correction bias
 *     within the best groups; the chosen weights normalised (norm_topk_prob)
 *     and times routed_scaling_factor; experts and the shared experts are
 *     SiLU-gated MLPs of moe_intermediate_size (the shared ones one MLP of
 *     n_shared_experts times it), added to the routed sum;
 *   - RMSNorm multipliers w, untied embeddings, no attention biases.
 * The features live in the shared code (model/mla.c: the latent
 * attention; forward.c: the experts); this file says the families have
 * them and reads, checks and writes their config.json keys. */
#include "../family.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAX_EXPERTS (1 << 12)
#define MAX_RANK (1 << 14)

static void flags(kv_config *c)
{
    c->act = ACT_SILU;
    c->qkv_bias = c->o_bias = false;
    /* the routing each version's published configs name (parse reads
     * scoring_func and topk_method) */
    c->route = c->arch == ARCH_DEEPSEEK3 ? ROUTE_SIGMOID : ROUTE_SOFTMAX;
}

/* q_lora_rank: null (V2-Lite: one q_proj) or a rank (1536 when absent,
 * both configs' default). */
static int parse_q_rank(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *q = json_object_get(obj, "q_lora_rank");
    c->q_lora_rank = q ? 0 : 1536;
    if (cj_present(q) && cj_want_int(cx, "q_lora_rank", q, 1, MAX_RANK, &c->q_lora_rank))
        return -1;
    return 0;
}

static int parse_attention(const cfg_jctx *cx, const json_t *obj, bool v3, kv_config *c)
{
    int nope = 0;
    if (cj_get_int(cx, obj, "kv_lora_rank", false, 512, 1, MAX_RANK, &c->kv_lora_rank)
        || parse_q_rank(cx, obj, c)
        || cj_get_int(cx, obj, "qk_nope_head_dim", false, 128, 1, MAX_RANK, &nope)
        || cj_get_int(cx, obj, "qk_rope_head_dim", false, 64, 2, MAX_RANK, &c->qk_rope_dim)
        || cj_get_int(cx, obj, "v_head_dim", false, 128, 1, MAX_RANK, &c->v_head_dim)
        || cj_refuse_true(cx, obj, "attention_bias", "kvdiff runs DeepSeek's attention "
                          "without biases (no published checkpoint has them)")
        || cj_refuse_true(cx, obj, "mlp_bias", "kvdiff runs DeepSeek's MLPs without biases"))
        return -1;
    if (c->qk_rope_dim % 2 != 0)
        return cj_fail(cx, "qk_rope_head_dim", "is %d; RoPE needs it even", c->qk_rope_dim);
    bool interleave = true;
    if (v3 && cj_get_bool(cx, obj, "rope_interleave", true, &interleave))
        return -1;
    if (!interleave)
        return cj_fail(cx, "rope_interleave", "is false; kvdiff rotates DeepSeek's key "
                       "tails on interleaved pairs (2i, 2i+1), as the checkpoints do");
    /* Every head has its own expanded key and value: q, k and v are the
     * expanded heads (num_key_value_heads, when written, says the same). */
    const json_t *kv = json_object_get(obj, "num_key_value_heads");
    int nkv = c->n_heads;
    if (cj_present(kv) && cj_want_int(cx, "num_key_value_heads", kv, 1, KV_MAX_HEADS, &nkv))
        return -1;
    if (nkv != c->n_heads)
        return cj_fail(cx, "num_key_value_heads", "is %d; MLA expands the latent to all %d "
                       "heads", nkv, c->n_heads);
    c->n_kv_heads = c->n_heads;
    c->head_dim = nope + c->qk_rope_dim;
    return 0;
}

/* topk_method and scoring_func: V2 greedy or group_limited_greedy over a
 * softmax, V3 noaux_tc over sigmoid scores. */
static int parse_route(const cfg_jctx *cx, const json_t *obj, bool v3, kv_config *c)
{
    const char *method = NULL, *scoring = NULL;
    if (cj_get_str(cx, obj, "topk_method", v3 ? "noaux_tc" : "greedy", &method)
        || cj_get_str(cx, obj, "scoring_func", v3 ? "sigmoid" : "softmax", &scoring))
        return -1;
    bool grouped = false;
    if (!v3 && !strcmp(method, "greedy"))
        c->route = ROUTE_SOFTMAX;
    else if (!v3 && !strcmp(method, "group_limited_greedy"))
        c->route = ROUTE_SOFTMAX, grouped = true;
    else if (v3 && !strcmp(method, "noaux_tc"))
        c->route = ROUTE_SIGMOID, grouped = true;
    else
        return cj_fail(cx, "topk_method", "'%.40s' is not %s's (kvdiff runs %s)", method,
                       c->model_type, v3 ? "noaux_tc" : "greedy and group_limited_greedy");
    if (strcmp(scoring, c->route == ROUTE_SIGMOID ? "sigmoid" : "softmax") != 0)
        return cj_fail(cx, "scoring_func", "'%.40s' does not go with topk_method %s", scoring,
                       method);
    if (grouped) {
        if (cj_get_int(cx, obj, "n_group", false, 1, 1, c->n_experts, &c->n_group)
            || cj_get_int(cx, obj, "topk_group", false, 1, 1, c->n_group, &c->topk_group))
            return -1;
        if (c->n_experts % c->n_group != 0)
            return cj_fail(cx, "n_group", "is %d, which does not divide n_routed_experts %d",
                           c->n_group, c->n_experts);
        if (c->n_experts_used > c->topk_group * (c->n_experts / c->n_group))
            return cj_fail(cx, "topk_group", "is %d: its groups hold fewer than "
                           "num_experts_per_tok %d experts", c->topk_group, c->n_experts_used);
    }
    return 0;
}

static int parse_experts(const cfg_jctx *cx, const json_t *obj, bool v3, kv_config *c)
{
    const json_t *x = json_object_get(obj, "n_routed_experts");
    if (!cj_present(x) && x)
        return 0;   /* null: dense layers only */
    if (cj_get_int(cx, obj, "n_routed_experts", false, v3 ? 256 : 64, 1, MAX_EXPERTS,
                   &c->n_experts))
        return -1;
    const json_t *k = json_object_get(obj, "num_experts_per_tok");
    c->n_experts_used = 0;
    if (!cj_present(k))
        return cj_fail(cx, "num_experts_per_tok", "is missing (n_routed_experts is %d)",
                       c->n_experts);
    const json_t *sh = json_object_get(obj, "n_shared_experts");
    if (cj_want_int(cx, "num_experts_per_tok", k, 1, c->n_experts, &c->n_experts_used)
        || cj_get_int(cx, obj, "moe_intermediate_size", false, v3 ? 2048 : 1407, 1,
                      1 << 22, &c->moe_intermediate)
        || (cj_present(sh) && cj_want_int(cx, "n_shared_experts", sh, 0, 64,
                                          &c->n_shared_experts))
        || cj_get_int(cx, obj, "first_k_dense_replace", false, v3 ? 3 : 0, 0, c->n_layers,
                      &c->first_dense)
        || cj_get_int(cx, obj, "moe_layer_freq", false, 1, 1, KV_MAX_LAYERS, &c->moe_every)
        || cj_get_bool(cx, obj, "norm_topk_prob", v3, &c->norm_topk)
        || cj_get_num(cx, obj, "routed_scaling_factor", v3 ? 2.5 : 1.0, 0.0, true,
                      CFG_MAX_SCALAR, &c->routed_scale))
        return -1;
    if (!sh)
        c->n_shared_experts = v3 ? 1 : 2;
    return parse_route(cx, obj, v3, c);
}

static int parse(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    bool v3 = c->arch == ARCH_DEEPSEEK3;
    return parse_attention(cx, obj, v3, c) || parse_experts(cx, obj, v3, c) ? -1 : 0;
}

static int check(const kv_config *c, kv_err *e)
{
    const int nope = c->head_dim - c->qk_rope_dim;
    if (c->kv_lora_rank < 1 || c->kv_lora_rank > MAX_RANK)
        return kv_errf(e, "kv_lora_rank %d out of 1..%d", c->kv_lora_rank, MAX_RANK);
    if (c->q_lora_rank < 0 || c->q_lora_rank > MAX_RANK)
        return kv_errf(e, "q_lora_rank %d out of 0..%d", c->q_lora_rank, MAX_RANK);
    if (c->qk_rope_dim < 2 || c->qk_rope_dim % 2 || nope < 1)
        return kv_errf(e, "qk_rope_dim %d must be even and below head_dim %d", c->qk_rope_dim,
                       c->head_dim);
    /* The values are padded to the keys' width in the expanded form. */
    if (c->v_head_dim < 1 || c->v_head_dim > c->head_dim)
        return kv_errf(e, "v_head_dim %d out of 1..%d (qk_nope + qk_rope)", c->v_head_dim,
                       c->head_dim);
    if (c->n_kv_heads != c->n_heads)
        return kv_errf(e, "MLA has one expanded key per head: n_kv_heads %d is not n_heads %d",
                       c->n_kv_heads, c->n_heads);
    if (c->swiglu_limit != 0)
        return kv_errf(e, "swiglu_limit is set but %s has plain SiLU experts", c->model_type);
    if (c->n_experts == 0)
        return c->n_experts_used || c->moe_intermediate || c->n_shared_experts || c->n_group
               ? kv_errf(e, "expert fields are set without experts") : 0;
    if (c->n_experts < 1 || c->n_experts > MAX_EXPERTS)
        return kv_errf(e, "n_experts %d out of 1..%d", c->n_experts, MAX_EXPERTS);
    if (c->n_experts_used < 1 || c->n_experts_used > c->n_experts)
        return kv_errf(e, "n_experts_used %d out of 1..%d", c->n_experts_used, c->n_experts);
    if (c->moe_intermediate < 1 || c->n_shared_experts < 0 || c->n_shared_experts > 64
        || c->first_dense < 0 || c->first_dense > c->n_layers || c->moe_every < 1)
        return kv_errf(e, "moe_intermediate %d / n_shared %d / first_dense %d / moe_every %d "
                       "out of range", c->moe_intermediate, c->n_shared_experts, c->first_dense,
                       c->moe_every);
    if (c->route != (c->arch == ARCH_DEEPSEEK3 ? ROUTE_SIGMOID : ROUTE_SOFTMAX))
        return kv_errf(e, "route %d is not %s's", (int)c->route, c->model_type);
    if (c->n_group < 0 || c->topk_group < 0 || (c->n_group > 0) != (c->topk_group > 0)
        || (c->n_group > 0 && (c->n_experts % c->n_group || c->topk_group > c->n_group
            || c->n_experts_used > c->topk_group * (c->n_experts / c->n_group))))
        return kv_errf(e, "n_group %d / topk_group %d do not fit %d experts, top %d",
                       c->n_group, c->topk_group, c->n_experts, c->n_experts_used);
    if (!(isfinite(c->routed_scale) && c->routed_scale > 0))
        return kv_errf(e, "routed_scale %g is not a positive number", c->routed_scale);
    return 0;
}

static void write(cfg_writer *w, const kv_config *c)
{
    const bool v3 = c->arch == ARCH_DEEPSEEK3;
    cw_int(w, "kv_lora_rank", c->kv_lora_rank);
    if (c->q_lora_rank > 0)
        cw_int(w, "q_lora_rank", c->q_lora_rank);
    else
        cw_raw(w, "q_lora_rank", "null");
    cw_int(w, "qk_nope_head_dim", c->head_dim - c->qk_rope_dim);
    cw_int(w, "qk_rope_head_dim", c->qk_rope_dim);
    cw_int(w, "v_head_dim", c->v_head_dim);
    cw_bool(w, "attention_bias", false);
    if (v3)
        cw_bool(w, "rope_interleave", true);
    if (c->n_experts == 0) {
        cw_raw(w, "n_routed_experts", "null");
        return;
    }
    cw_int(w, "n_routed_experts", c->n_experts);
    cw_int(w, "num_experts_per_tok", c->n_experts_used);
    cw_int(w, "moe_intermediate_size", c->moe_intermediate);
    cw_int(w, "n_shared_experts", c->n_shared_experts);
    cw_int(w, "first_k_dense_replace", c->first_dense);
    cw_int(w, "moe_layer_freq", c->moe_every);
    cw_bool(w, "norm_topk_prob", c->norm_topk);
    cw_num(w, "routed_scaling_factor", c->routed_scale);
    cw_str(w, "topk_method", v3 ? "noaux_tc" : c->n_group > 0 ? "group_limited_greedy"
                                                              : "greedy");
    cw_str(w, "scoring_func", v3 ? "sigmoid" : "softmax");
    if (c->n_group > 0) {
        cw_int(w, "n_group", c->n_group);
        cw_int(w, "topk_group", c->topk_group);
    } else {
        cw_raw(w, "n_group", "null");
        cw_raw(w, "topk_group", "null");
    }
}

/* YaRN as DeepSeek's configs write it (mscale = mscale_all_dim: cos and
 * sin unscaled, q.k times m^2). */
static void yarn(kv_config *c, double factor, int original_max, double mscale)
{
    kv_rope_scaling *s = &c->rope_scaling;
    cfg_yarn(c, factor, original_max, true);
    s->mscale = s->mscale_all_dim = mscale;
    s->attn_factor = 1.0;
    const double m = 0.1 * mscale * log(factor) + 1.0;
    c->attn_scale = 1.0 / sqrt((double)c->head_dim) * (m * m);   /* as config.c derives it */
}

typedef struct {
    int hidden, layers, heads, kv_rank, q_rank, nope, rope, v, inter, vocab;
    int experts, top_k, moe_inter, shared, first_dense;
} ds_sizes;

static void base(kv_config *c, kv_arch arch, const ds_sizes *z)
{
    family_set(c, arch);
    c->hidden = z->hidden;
    c->n_layers = z->layers;
    c->n_heads = c->n_kv_heads = z->heads;
    c->kv_lora_rank = z->kv_rank;
    c->q_lora_rank = z->q_rank;
    c->qk_rope_dim = z->rope;
    c->head_dim = z->nope + z->rope;
    c->v_head_dim = z->v;
    c->intermediate = z->inter;
    c->vocab = z->vocab;
    c->rms_eps = 1e-6;
    c->embed_scale = 1.0f;
    c->attn_scale = 1.0 / sqrt((double)c->head_dim);
    c->rope_theta = c->rope_local_theta = 10000.0;
    c->tie_embeddings = false;
    for (int i = 0; i < z->layers; i++) {
        c->layer_type[i] = ATTN_GLOBAL;
        c->kv_owner[i] = (int16_t)i;
    }
    c->n_experts = z->experts;
    c->n_experts_used = z->top_k;
    c->moe_intermediate = z->moe_inter;
    c->n_shared_experts = z->shared;
    c->first_dense = z->first_dense;
    c->moe_every = 1;
    c->route = arch == ARCH_DEEPSEEK3 ? ROUTE_SIGMOID : ROUTE_SOFTMAX;
    c->routed_scale = 1.0;
}

/* Four layers (the first dense), 4 heads of 16 + 32 (key tails) over a
 * latent of 64, values 16 wide (narrower than the keys' 48, as in the
 * real ones), 8 experts of 32 with 3 chosen and one shared; YaRN factor 8
 * from 64 positions with mscale 0.707 (q.k times 1.32). The latent and
 * the cache row (96) are multiples of 32, as llama.cpp's q8_0 cache
 * blocks need (the real 512 and 576 are). */
static void tiny_v2(kv_config *c)
{
    const ds_sizes z = {.hidden = 64, .layers = 4, .heads = 4, .kv_rank = 64, .q_rank = 0,
                        .nope = 16, .rope = 32, .v = 16, .inter = 96, .vocab = 256,
                        .experts = 8, .top_k = 3, .moe_inter = 32, .shared = 1,
                        .first_dense = 1};
    base(c, ARCH_DEEPSEEK2, &z);
    c->max_positions = 512;
    yarn(c, 8.0, 64, 0.707);
    c->bos_id = 1;
    c->n_eos = 1;
    c->eos_ids[0] = 2;
}

/* The same with V3's parts: a q LoRA, sigmoid routing with a correction
 * bias over 4 groups of which 2 are kept, normalised weights times 2.5. */
static void tiny_v3(kv_config *c)
{
    const ds_sizes z = {.hidden = 64, .layers = 4, .heads = 4, .kv_rank = 64, .q_rank = 24,
                        .nope = 16, .rope = 32, .v = 16, .inter = 96, .vocab = 256,
                        .experts = 8, .top_k = 3, .moe_inter = 32, .shared = 1,
                        .first_dense = 1};
    base(c, ARCH_DEEPSEEK3, &z);
    c->max_positions = 512;
    yarn(c, 8.0, 64, 1.0);
    c->n_group = 4;
    c->topk_group = 2;
    c->norm_topk = true;
    c->routed_scale = 2.5;
    c->bos_id = 0;
    c->n_eos = 1;
    c->eos_ids[0] = 1;
}

/* deepseek-ai/DeepSeek-V2-Lite with synthetic weights: its 27 layers
 * (the first dense), 16 heads of 128 + 64 over a latent of 512, values of
 * 128, 64 experts with 6 chosen and 2 shared, YaRN factor 40 with mscale
 * 0.707; but each expert 88 wide instead of 1408 (a 16th, the shared ones
 * alike: 15.7B weights do not fit this machine's memory; the latent
 * cache, the attention and the routing are whole). */
static void lite_shape(kv_config *c)
{
    const ds_sizes z = {.hidden = 2048, .layers = 27, .heads = 16, .kv_rank = 512,
                        .q_rank = 0, .nope = 128, .rope = 64, .v = 128, .inter = 10944,
                        .vocab = 102400, .experts = 64, .top_k = 6, .moe_inter = 88,
                        .shared = 2, .first_dense = 1};
    base(c, ARCH_DEEPSEEK2, &z);
    c->max_positions = 163840;
    yarn(c, 40.0, 4096, 0.707);
    c->bos_id = 100000;
    c->n_eos = 1;
    c->eos_ids[0] = 100001;
}

static const kv_family_preset PRESETS_V2[] = {
    { "tiny-deepseek-v2", tiny_v2 },
    { "deepseek-v2-lite-shape", lite_shape },
};

static const kv_family_preset PRESETS_V3[] = {
    { "tiny-deepseek-v3", tiny_v3 },
};

/* llama.cpp's deepseek2 tensors (conversion/deepseek_v2.py). */
static const char *const GGUF_NAMES[][2] = {
    {"self_attn.q_a_proj.weight", "attn_q_a.weight"},
    {"self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"},
    {"self_attn.q_b_proj.weight", "attn_q_b.weight"},
    {"self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"},
    {"self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"},
    {"self_attn.kv_b_proj.weight", "attn_kv_b.weight"},
    {"mlp.gate.weight", "ffn_gate_inp.weight"},
    {"mlp.gate.e_score_correction_bias", "exp_probs_b.bias"},
    {"mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
    {"mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
    {"mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"},
    {NULL, NULL},
};

/* DeepSeek-V2/V3 as llama.cpp's deepseek2 reads a GGUF
 * (llama_model_deepseek2::load_arch_hparams) in its MLA form: the
 * expanded heads (key_length_mla, value_length_mla; the GGUF's key_length
 * is the latent cache's row), the latent and the key tail, leading dense
 * layers, experts with shared ones, the gating, groups and weights; q.k
 * times m(mscale_all_dim)^2 / sqrt(head) from yarn_log_multiplier (stored
 * as 0.1 mscale_all_dim), cos and sin unscaled (llama_context takes
 * mscale = mscale_all_dim). V3 is told by its sigmoid gating. */
static int from_gguf(const kv_gguf_in *g, kv_config *c, double *llama_scale, kv_err *e)
{
    int gating = 1, dense = 0;
    if (g->int_key(g, "attention.kv_lora_rank", 1, KV_MAX_HEAD_DIM, true, 0,
                   "the latent's width", &c->kv_lora_rank, e) < 0 ||
        g->int_key(g, "attention.q_lora_rank", 0, KV_MAX_HEAD_DIM, false, 0,
                   "the q LoRA's rank", &c->q_lora_rank, e) < 0 ||
        g->int_key(g, "attention.key_length_mla", 4, KV_MAX_HEAD_DIM, true, 0,
                   "the expanded head size", &c->head_dim, e) < 0 ||
        g->int_key(g, "attention.value_length_mla", 1, c->head_dim, true, 0,
                   "the expanded value size", &c->v_head_dim, e) < 0 ||
        g->int_key(g, "rope.dimension_count", 2, c->head_dim - 1, true, 0,
                   "the rotated tail", &c->qk_rope_dim, e) < 0 ||
        g->int_key(g, "leading_dense_block_count", 0, c->n_layers, false, 0,
                   "the leading dense layers", &dense, e) < 0 ||
        g->int_key(g, "expert_gating_func", 0, 2, false, 1, "the gating function", &gating,
                   e) < 0)
        return -1;
    if (c->qk_rope_dim % 2)
        return kv_errf(e, "%s: the rotated tail of %d is odd", g->path, c->qk_rope_dim);
    c->arch = gating == 2 ? ARCH_DEEPSEEK3 : ARCH_DEEPSEEK2;
    snprintf(c->model_type, sizeof c->model_type, gating == 2 ? "deepseek_v3" : "deepseek_v2");
    config_family_flags(c);
    c->n_kv_heads = c->n_heads;
    c->route = gating == 2 ? ROUTE_SIGMOID : ROUTE_SOFTMAX;
    c->routed_scale = 1.0;
    if (dense < c->n_layers && g->has(g, "expert_count")) {
        if (g->int_key(g, "expert_count", 1, 1 << 12, true, 0, "the number of experts",
                       &c->n_experts, e) < 0 ||
            g->int_key(g, "expert_used_count", 1, c->n_experts, true, 0,
                       "the experts used per token", &c->n_experts_used, e) < 0 ||
            g->int_key(g, "expert_feed_forward_length", 1, KV_MAX_INTERMEDIATE, true, 0,
                       "the experts' width", &c->moe_intermediate, e) < 0 ||
            g->int_key(g, "expert_shared_count", 0, 64, false, 0, "the shared experts",
                       &c->n_shared_experts, e) < 0 ||
            g->int_key(g, "expert_group_count", 0, c->n_experts, false, 0,
                       "the expert groups", &c->n_group, e) < 0 ||
            g->int_key(g, "expert_group_used_count", 0, c->n_experts, false, 0,
                       "the expert groups used", &c->topk_group, e) < 0)
            return -1;
        c->norm_topk = g->is_true(g, "expert_weights_norm");
        c->routed_scale = g->num(g, "expert_weights_scale", 1.0, NULL);
        c->first_dense = dense;
        c->moe_every = 1;
        if (c->n_group <= 1)
            c->n_group = c->topk_group = 0;
    }
    /* YaRN: read by the shared code; DeepSeek's factors set here. */
    bool f_mul;
    const double log_mul = g->num(g, "rope.scaling.yarn_log_multiplier", 0, &f_mul) / 0.1;
    double mul = 1.0;
    if (c->rope_scaling.type == ROPE_SCALE_YARN) {
        c->rope_scaling.attn_factor = 1.0;
        c->rope_scaling.mscale = c->rope_scaling.mscale_all_dim = f_mul ? log_mul : 0.0;
        if (f_mul && log_mul > 0 && c->rope_scaling.factor > 1) {
            const double ms = 0.1 * log_mul * log(c->rope_scaling.factor) + 1.0;
            mul = ms * ms;
        }
    }
    *llama_scale = 1.0 / sqrt((double)c->head_dim) * mul;
    c->attn_scale = *llama_scale;
    return 0;
}

/* Its GGUF keys as the converter's DeepseekV2Model.set_gguf_parameters
 * writes them; q_lora_rank always (0: one q_proj), since llama.cpp
 * requires it of any model whose layer count is not DeepSeek-V2-Lite's;
 * the gating function and the expert groups as llama.cpp's own keys name
 * them. (The shared code wrote the MLA head: one KV head of the latent
 * and the key tail, keys R + dr, values R.) */
static void gguf_keys(kv_gguf_out *g, const kv_config *c)
{
    g->u32(g, ".leading_dense_block_count", (uint32_t)(c->n_experts > 0 ? c->first_dense
                                                                        : c->n_layers));
    g->u32(g, ".attention.q_lora_rank", (uint32_t)c->q_lora_rank);
    g->u32(g, ".attention.kv_lora_rank", (uint32_t)c->kv_lora_rank);
    g->u32(g, ".attention.key_length_mla", (uint32_t)c->head_dim);
    g->u32(g, ".attention.value_length_mla", (uint32_t)c->v_head_dim);
    if (c->n_experts == 0) {
        g->u32(g, ".expert_feed_forward_length", (uint32_t)c->intermediate);
        g->u32(g, ".expert_shared_count", 0);
        return;
    }
    g->u32(g, ".expert_shared_count", (uint32_t)c->n_shared_experts);
    g->f32(g, ".expert_weights_scale", (float)c->routed_scale);
    if (c->norm_topk)
        g->flag(g, ".expert_weights_norm", true);
    g->u32(g, ".expert_gating_func", c->route == ROUTE_SIGMOID ? 2u : 1u);
    if (c->n_group > 0) {
        g->u32(g, ".expert_group_count", (uint32_t)c->n_group);
        g->u32(g, ".expert_group_used_count", (uint32_t)c->topk_group);
    }
    /* [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: the converter stores 0.1 times it */
    if (c->rope_scaling.type == ROPE_SCALE_YARN && c->rope_scaling.mscale_all_dim > 0)
        g->f32(g, ".rope.scaling.yarn_log_multiplier",
               (float)(0.1 * c->rope_scaling.mscale_all_dim));
}

/* What llama.cpp's deepseek2 cannot run: mscale other than
 * mscale_all_dim (it leaves cos and sin unscaled; llama_context's
 * [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]), experts on some layers only. */
static int gguf_check(const kv_config *c, kv_err *e)
{
    if (c->rope_scaling.type == ROPE_SCALE_YARN &&
        c->rope_scaling.mscale != c->rope_scaling.mscale_all_dim)
        return kv_errf(e, "rope_scaling mscale %g differs from mscale_all_dim %g; llama.cpp's "
                       "deepseek2 takes them equal, so it cannot run this model",
                       c->rope_scaling.mscale, c->rope_scaling.mscale_all_dim);
    if (c->moe_every > 1)
        return kv_errf(e, "moe_layer_freq %d; llama.cpp's deepseek2 has experts on every "
                       "layer after the leading dense ones", c->moe_every);
    return 0;
}

/* llama.cpp's deepseek2 graph in the MLA form (absorbed attention): q is
 * "q" before RoPE (the last of that name at the heads' full width: the q
 * LoRA's nodes are narrower) with its tails from the rotated "q_pe"; the
 * latent cache's row is "Kcur"; the expanded keys and values are never
 * formed (no k, v); "kqv_out" is the attention after v_b; the router's
 * row is its logits (V2) or the biased sigmoid scores the experts are
 * chosen by (V3); "ffn_out" the MLP with the shared experts. */
#define DEEPSEEK_GRAPH(router) \
    KV_GRAPH_MODEL("embd"), \
    {KV_GRAPH("attn_norm", STAGE_ATTN_NORM, GRAPH_EMIT)}, \
    {KV_GRAPH("q", STAGE_Q, GRAPH_LAST), .full_width = true}, \
    {KV_GRAPH("q_pe", STAGE_Q, GRAPH_Q_TAILS), .rope = true}, \
    {KV_GRAPH("Kcur", STAGE_KV_LATENT, GRAPH_EMIT)}, \
    {KV_GRAPH("kqv_out", STAGE_ATTN_OUT, GRAPH_EMIT)}, \
    {KV_GRAPH("ffn_inp", STAGE_H_MID, GRAPH_EMIT)}, \
    {KV_GRAPH("ffn_norm", STAGE_FFN_NORM, GRAPH_EMIT)}, \
    {KV_GRAPH(router, STAGE_ROUTER_LOGITS, GRAPH_EMIT)}, \
    {KV_GRAPH("ffn_out", STAGE_FFN_OUT, GRAPH_EMIT)}, \
    {KV_GRAPH("l_out", STAGE_X_OUT, GRAPH_EMIT)}, \
    {.node = NULL}

static const kv_graph_name GRAPH_V2[] = {DEEPSEEK_GRAPH("ffn_moe_logits")};
static const kv_graph_name GRAPH_V3[] = {DEEPSEEK_GRAPH("ffn_moe_probs_biased")};

const kv_family family_deepseek2 = {
    .arch = ARCH_DEEPSEEK2, .model_type = "deepseek_v2", .architecture = "DeepseekV2ForCausalLM",
    .gguf_arch = "deepseek2", .act_key = "hidden_act",
    .sizes_required = true, .def_head_dim = 192, .def_max_positions = 2048,
    .def_theta = 10000.0, .def_tie = false, .def_bos = 100000, .def_eos = 100001,
    .moe = true, .mla = true,
    .gguf_names = GGUF_NAMES,
    .graph = GRAPH_V2, .from_gguf = from_gguf, .gguf_keys = gguf_keys,
    .gguf_check = gguf_check,
    .flags = flags, .parse = parse, .check = check, .write = write,
    .presets = PRESETS_V2, .n_presets = (int)(sizeof PRESETS_V2 / sizeof PRESETS_V2[0]),
};

const kv_family family_deepseek3 = {
    .arch = ARCH_DEEPSEEK3, .model_type = "deepseek_v3", .architecture = "DeepseekV3ForCausalLM",
    .gguf_arch = "deepseek2", .act_key = "hidden_act",
    .sizes_required = true, .def_head_dim = 192, .def_max_positions = 4096,
    .def_theta = 10000.0, .def_tie = false, .def_bos = 0, .def_eos = 1,
    .moe = true, .mla = true,
    .gguf_names = GGUF_NAMES,
    .graph = GRAPH_V3, .from_gguf = from_gguf, .gguf_keys = gguf_keys,
    .gguf_check = gguf_check,
    .flags = flags, .parse = parse, .check = check, .write = write,
    .presets = PRESETS_V3, .n_presets = (int)(sizeof PRESETS_V3 / sizeof PRESETS_V3[0]),
};
