/* llama.c — Llama 2/3 (model_type llama, LlamaForCausalLM).
 *
 * Every layer global; one switch (attention_bias) for the q, k, v and o
 * biases, read in config.c with Qwen3's; RoPE scaling linear or llama3. */
#include "../family.h"

static void flags(kv_config *c)
{
    c->act = ACT_SILU;
}

const kv_family family_llama = {
    .arch = ARCH_LLAMA, .model_type = "llama", .architecture = "LlamaForCausalLM",
    .gguf_arch = "llama", .act_key = "hidden_act",
    .sizes_required = true, .def_max_positions = 2048, .def_theta = 10000.0,
    .def_tie = false, .def_bos = 1, .def_eos = 2,
    .bias_switch = true,
    .flags = flags,
};
