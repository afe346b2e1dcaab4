/* families.c — the table of architectures (family.h): one line per family. */
#include "../family.h"

#include <stdio.h>
#include <string.h>

extern const kv_family family_llama, family_qwen2, family_qwen3, family_gemma3,
    family_gemma4, family_gpt_oss, family_deepseek2, family_deepseek3;

/* Indexed by kv_arch. */
static const kv_family *const FAMILIES[ARCH_COUNT] = {
    [ARCH_LLAMA] = &family_llama,
    [ARCH_QWEN2] = &family_qwen2,
    [ARCH_QWEN3] = &family_qwen3,
    [ARCH_GEMMA3] = &family_gemma3,
    [ARCH_GEMMA4] = &family_gemma4,
    [ARCH_GPT_OSS] = &family_gpt_oss,
    [ARCH_DEEPSEEK2] = &family_deepseek2,
    [ARCH_DEEPSEEK3] = &family_deepseek3,
};

const kv_family *family_of(kv_arch arch)
{
    return (int)arch >= 0 && arch < ARCH_COUNT ? FAMILIES[arch] : NULL;
}

/* llama.cpp's llm_build_llama / qwen2 / qwen3: q and k after RoPE, the
 * last Vcur (after its bias), o_proj's output "attn_out" (Qwen2 names
 * none: kvdiff-llama takes the product with attn_output.weight), the FFN
 * input norm "ffn_norm". */
const kv_graph_name family_graph_default[] = {
    KV_GRAPH_MODEL("embd"),
    KV_GRAPH_LLAMA_ATTN,
    {KV_GRAPH("attn_out", STAGE_ATTN_PROJ, GRAPH_LAST)},
    {KV_GRAPH("ffn_inp", STAGE_H_MID, GRAPH_EMIT)},
    {KV_GRAPH("ffn_norm", STAGE_FFN_NORM, GRAPH_EMIT)},
    {KV_GRAPH("ffn_out", STAGE_FFN_OUT, GRAPH_EMIT)},
    {KV_GRAPH("l_out", STAGE_X_OUT, GRAPH_EMIT)},
    {.node = NULL},
};

const kv_graph_name *family_graph(kv_arch arch)
{
    const kv_family *f = family_of(arch);
    return f && f->graph ? f->graph : family_graph_default;
}

const kv_family *family_by_model_type(const char *mt)
{
    for (int a = 0; mt && a < ARCH_COUNT; a++)
        if (!strcmp(mt, FAMILIES[a]->model_type)
            || (FAMILIES[a]->outer_type && !strcmp(mt, FAMILIES[a]->outer_type)))
            return FAMILIES[a];
    return NULL;
}

const kv_family *family_by_gguf_arch(const char *gguf_arch)
{
    for (int a = 0; gguf_arch && a < ARCH_COUNT; a++)
        if (!strcmp(gguf_arch, FAMILIES[a]->gguf_arch))
            return FAMILIES[a];
    return NULL;
}

void family_model_types(char *buf, size_t n)
{
    if (n == 0)
        return;
    buf[0] = 0;
    for (int a = 0; a < ARCH_COUNT; a++) {
        snprintf(buf + strlen(buf), n - strlen(buf), "%s%s", a ? ", " : "",
                 FAMILIES[a]->model_type);
        if (FAMILIES[a]->outer_type)
            snprintf(buf + strlen(buf), n - strlen(buf), ", %s", FAMILIES[a]->outer_type);
    }
}

int family_preset_count(void)
{
    int n = 0;
    for (int a = 0; a < ARCH_COUNT; a++)
        n += FAMILIES[a]->n_presets;
    return n;
}

const kv_family_preset *family_preset(int i)
{
    for (int a = 0; a < ARCH_COUNT && i >= 0; a++) {
        if (i < FAMILIES[a]->n_presets)
            return &FAMILIES[a]->presets[i];
        i -= FAMILIES[a]->n_presets;
    }
    return NULL;
}
