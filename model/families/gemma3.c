/* gemma3.c — Gemma 3 (model_type gemma3_text; gemma3 nests it under
 * text_config).
 *
 * Sliding layers (5 of every 6 by default, window 4096) with their own
 * RoPE base, KV sharing (num_kv_shared_layers, Gemma 3n's rule), sandwich
 * norms, RMSNorm multipliers 1 + w, q/k norms, tanh-GELU, embeddings
 * times sqrt(hidden), q.k scaled by query_pre_attn_scalar^-1/2. */
#include "../family.h"

static void flags(kv_config *c)
{
    c->norm_plus_one = true;
    c->qk_norm = true;
    c->sandwich_norms = true;
    c->act = ACT_GELU_TANH;
}

/* llama.cpp's gemma3 graph: the scaled embedding "inp_scaled", the
 * sandwich norms ("attn_post_norm" ends the attention block, "sa_out" is
 * the residual, "ffn_post_norm" ends the MLP). */
static const kv_graph_name GRAPH[] = {
    KV_GRAPH_MODEL("inp_scaled"),
    KV_GRAPH_LLAMA_ATTN,
    {KV_GRAPH("attn_post_norm", STAGE_ATTN_PROJ, GRAPH_LAST)},
    {KV_GRAPH("sa_out", STAGE_H_MID, GRAPH_EMIT)},
    {KV_GRAPH("ffn_norm", STAGE_FFN_NORM, GRAPH_EMIT)},
    {KV_GRAPH("ffn_post_norm", STAGE_FFN_OUT, GRAPH_EMIT)},
    {KV_GRAPH("l_out", STAGE_X_OUT, GRAPH_EMIT)},
    {.node = NULL},
};

const kv_family family_gemma3 = {
    .arch = ARCH_GEMMA3, .model_type = "gemma3_text", .outer_type = "gemma3",
    .architecture = "Gemma3ForCausalLM", .gguf_arch = "gemma3",
    .act_key = "hidden_activation",
    .sizes_required = false, .def_heads = 8, .def_kv_heads = 4, .def_head_dim = 256,
    .def_vocab = 262208, .def_max_positions = 131072, .def_theta = 1000000.0,
    .def_tie = true, .def_bos = 2, .def_eos = 1,
    .slides = true, .def_pattern = 6, .def_window = 4096,
    .graph = GRAPH,
    .flags = flags,
};
