/* qwen3.c — Qwen3 (model_type qwen3, Qwen3ForCausalLM).
 *
 * Every layer global, q_norm/k_norm (multiplier w) on each head before
 * RoPE; head_dim defaults to 128, not hidden/heads. */
#include "../family.h"

static void flags(kv_config *c)
{
    c->act = ACT_SILU;
    c->qk_norm = true;
}

const kv_family family_qwen3 = {
    .arch = ARCH_QWEN3, .model_type = "qwen3", .architecture = "Qwen3ForCausalLM",
    .gguf_arch = "qwen3", .act_key = "hidden_act",
    .sizes_required = true, .def_head_dim = 128, .def_max_positions = 32768,
    .def_theta = 10000.0, .def_tie = false, .def_bos = -1, .def_eos = -1,
    .bias_switch = true,
    .flags = flags,
};
