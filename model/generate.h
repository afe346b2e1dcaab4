/* generate.h — prefill a prompt and decode new tokens with any engine. */
#ifndef KV_GENERATE_H
#define KV_GENERATE_H

#include <stdbool.h>
#include <stdint.h>
#include "observer.h"
#include "config.h"
#include "engine.h"
#include "sampler.h"

typedef struct {
    int max_new;            /* tokens to generate at most */
    bool ignore_eos;        /* keep going past an end-of-sequence token */
    sampler_opts samp;
    uint64_t seed;          /* sampler seed */
    bool keep_logits;       /* store the logits each new token was chosen from */
    const int32_t *follow;  /* (max_new) or NULL: teacher forcing, the ids fed in
                             * place of sampled ones (another run's tokens, read
                             * by the caller, who owns them); nothing is sampled
                             * and an end-of-sequence id does not stop the run */
} gen_opts;

typedef struct {
    int32_t *tokens;        /* (n_prompt + n_new) prompt then generated ids */
    int n_prompt, n_new;
    float *step_logits;     /* (n_new, V) when keep_logits, else NULL */
    float *prefill_logits;  /* (V) logits after the prompt (always kept) */
    bool stopped_at_eos;
} gen_result;

/* Runs the prompt through eng, then samples up to max_new tokens (or takes
 * them from o->follow, each checked below the vocabulary first), feeding
 * each back. Announces every token to obs (may be NULL). Returns 0, 1 when
 * the observer stopped the run (out holds what was generated), -1 on
 * error. out is always safe to gen_result_free. */
int generate(kv_engine *eng, const kv_config *c, const int32_t *prompt, int n_prompt,
             const gen_opts *o, kv_observer *obs, gen_result *out, kv_err *e);

void gen_result_free(gen_result *r);

/* Is id one of the config's end-of-sequence ids? */
bool config_is_eos(const kv_config *c, int32_t id);

#endif
