/* gemma4.c — Gemma 4 (model_type gemma4_text; gemma4 nests it under
 * text_config).
 *
 * Gemma 3's layout (layer_types required) plus full layers of their own
 * head size and KV heads, K=V full layers, proportional RoPE on part of
 * a full head, v_norm, layer_scalar, double-wide MLPs on KV-shared layers
 * and per-layer inputs; q.k unscaled. Its keys are still read in
 * config.c (parse_gemma4_*). */
#include "../family.h"

static void flags(kv_config *c)
{
    c->qk_norm = true;
    c->sandwich_norms = true;
    c->act = ACT_GELU_TANH;
    c->v_norm = true;
    c->layer_scalar = true;
}

/* Its GGUF keys as the converter's Gemma4Model.set_gguf_parameters writes
 * them, with one difference: final_logit_softcapping is always written, 0
 * for none, since llama.cpp applies 30 when the key is absent (the
 * converter leaves it out for a null, and such a model then runs capped). */
static void gguf_keys(kv_gguf_out *g, const kv_config *c)
{
    uint32_t kv[KV_MAX_LAYERS], ff[KV_MAX_LAYERS];
    uint8_t pattern[KV_MAX_LAYERS];
    int shared = 0;
    for (int i = 0; i < c->n_layers; i++) {
        kv[i] = (uint32_t)config_layer_kv_heads(c, i);
        ff[i] = (uint32_t)config_layer_intermediate(c, i);
        pattern[i] = c->layer_type[i] == ATTN_SLIDING;
        shared += c->kv_owner[i] != i;
    }
    g->u32s(g, ".attention.head_count_kv", kv, c->n_layers);
    if (c->double_wide_mlp)
        g->u32s(g, ".feed_forward_length", ff, c->n_layers);
    g->u32(g, ".attention.key_length_swa", (uint32_t)c->head_dim);
    g->u32(g, ".attention.value_length_swa", (uint32_t)c->head_dim);
    g->u32(g, ".rope.dimension_count_swa", (uint32_t)c->head_dim);
    g->u32(g, ".attention.sliding_window", (uint32_t)c->sliding_window);
    g->flags(g, ".attention.sliding_window_pattern", pattern, c->n_layers);
    g->f32(g, ".rope.freq_base_swa", (float)c->rope_local_theta);
    g->f32(g, ".final_logit_softcapping", (float)c->final_softcap);
    g->u32(g, ".attention.shared_kv_layers", (uint32_t)shared);
    g->u32(g, ".embedding_length_per_layer_input", (uint32_t)c->per_layer_dim);
}

/* llama.cpp's gemma4 graph (llama_model_gemma4::graph): q and k after
 * RoPE as "Qcur_pos" / "Kcur_pos", v after its norm, the per-layer
 * inputs of every layer in one node and each layer's block output. */
static const kv_graph_name GRAPH[] = {
    KV_GRAPH_MODEL("inp_scaled"),
    {KV_GRAPH("inp_per_layer", STAGE_PLE_IN, GRAPH_ALL_LAYERS), .model = true},
    {KV_GRAPH("attn_norm", STAGE_ATTN_NORM, GRAPH_EMIT)},
    {KV_GRAPH("Qcur_pos", STAGE_Q, GRAPH_EMIT), .rope = true},
    {KV_GRAPH("Kcur_pos", STAGE_K, GRAPH_EMIT), .rope = true},
    {KV_GRAPH("Vcur_normed", STAGE_V, GRAPH_EMIT)},
    {KV_GRAPH("kqv_out", STAGE_ATTN_OUT, GRAPH_EMIT)},
    {KV_GRAPH("attn_post_norm", STAGE_ATTN_PROJ, GRAPH_EMIT)},
    {KV_GRAPH("attn_out", STAGE_H_MID, GRAPH_EMIT)},
    {KV_GRAPH("ffn_norm", STAGE_FFN_NORM, GRAPH_EMIT)},
    {KV_GRAPH("ffn_post_norm", STAGE_FFN_OUT, GRAPH_EMIT)},
    {KV_GRAPH("per_layer_embd_out", STAGE_PLE_OUT, GRAPH_EMIT)},
    {KV_GRAPH("l_out", STAGE_X_OUT, GRAPH_EMIT)},
    {.node = NULL},
};

const kv_family family_gemma4 = {
    .arch = ARCH_GEMMA4, .model_type = "gemma4_text", .outer_type = "gemma4",
    .architecture = "Gemma4ForCausalLM", .gguf_arch = "gemma4",
    .act_key = "hidden_activation",
    .sizes_required = true, .def_head_dim = 256, .def_max_positions = 131072,
    .def_theta = 1000000.0, .def_tie = true, .def_bos = 2, .def_eos = 1,
    .slides = true, .def_window = 4096,
    .graph = GRAPH, .gguf_keys = gguf_keys,
    .flags = flags,
};
