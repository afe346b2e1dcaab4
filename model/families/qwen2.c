/* qwen2.c — Qwen2 / Qwen2.5 (model_type qwen2, Qwen2ForCausalLM).
 *
 * Every layer global (use_sliding_window is refused), q/k/v biases always,
 * o_proj without one. */
#include "../family.h"

static void flags(kv_config *c)
{
    c->act = ACT_SILU;
    c->qkv_bias = true;
}

const kv_family family_qwen2 = {
    .arch = ARCH_QWEN2, .model_type = "qwen2", .architecture = "Qwen2ForCausalLM",
    .gguf_arch = "qwen2", .act_key = "hidden_act",
    .sizes_required = true, .def_max_positions = 32768, .def_theta = 10000.0,
    .def_tie = false, .def_bos = -1, .def_eos = -1,
    .flags = flags,
};
