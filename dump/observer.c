/* observer.c — stage names: the vocabulary shared by engines, dumps and
 * the comparer. The names are part of the dump format. */
#include "observer.h"

#include <string.h>

static const char *const stage_names[STAGE_COUNT] = {
    [STAGE_X_IN] = "x_in",
    [STAGE_ATTN_NORM_STATS] = "attn_norm_stats",
    [STAGE_ATTN_NORM] = "attn_norm",
    [STAGE_Q] = "q",
    [STAGE_K] = "k",
    [STAGE_V] = "v",
    [STAGE_ATTN_LSE] = "attn_lse",
    [STAGE_ATTN_NKEYS] = "attn_nkeys",
    [STAGE_ATTN_OUT] = "attn_out",
    [STAGE_ATTN_PROJ] = "attn_proj",
    [STAGE_H_MID] = "h_mid",
    [STAGE_FFN_NORM_STATS] = "ffn_norm_stats",
    [STAGE_FFN_NORM] = "ffn_norm",
    [STAGE_FFN_OUT] = "ffn_out",
    [STAGE_X_OUT] = "x_out",
    [STAGE_EMBED] = "embed",
    [STAGE_FINAL_NORM] = "final_norm",
    [STAGE_LOGITS] = "logits",
};

const char *stage_name(kv_stage s)
{
    return (s >= 0 && s < STAGE_COUNT) ? stage_names[s] : "?";
}

int stage_parse(const char *name)
{
    for (int s = 0; s < STAGE_COUNT; s++)
        if (strcmp(stage_names[s], name) == 0)
            return s;
    return -1;
}
