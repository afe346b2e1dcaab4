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

const kv_family family_gemma4 = {
    .arch = ARCH_GEMMA4, .model_type = "gemma4_text", .outer_type = "gemma4",
    .architecture = "Gemma4ForCausalLM", .gguf_arch = "gemma4",
    .act_key = "hidden_activation",
    .sizes_required = true, .def_head_dim = 256, .def_max_positions = 131072,
    .def_theta = 1000000.0, .def_tie = true, .def_bos = 2, .def_eos = 1,
    .slides = true, .def_window = 4096,
    .flags = flags,
};
