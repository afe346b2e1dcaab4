/* sampler.h — choosing the next token from logits.
 *
 * Greedy by default (argmax; the lowest id wins a tie). With a temperature
 * > 0: softmax(logits / T) restricted to the top_k most likely (0 = all)
 * and to the smallest set whose probability reaches top_p (1 = all),
 * sampled with the PCG32 passed in. Probabilities are computed in double
 * over candidates sorted by logit (ties by id), so the choice depends only
 * on the logits and the generator state. */
#ifndef KV_SAMPLER_H
#define KV_SAMPLER_H

#include <stdint.h>
#include "err.h"
#include "pcg32.h"

typedef struct {
    double temperature;   /* <= 0: greedy */
    int top_k;            /* 0: no limit */
    double top_p;         /* in (0, 1]; 1: no limit */
} sampler_opts;

typedef struct {
    float logit;
    int32_t id;
} sampler_cand;

typedef struct {
    sampler_opts o;
    pcg32 rng;
    int vocab;
    sampler_cand *order;  /* (vocab) scratch */
    double *prob;         /* (vocab) scratch */
} sampler;

int sampler_init(sampler *s, const sampler_opts *o, uint64_t seed, int vocab, kv_err *e);
void sampler_free(sampler *s);  /* accepts a zeroed struct */

int32_t sampler_pick(sampler *s, const float *logits);

/* Largest logit's id and the margin to the second largest (for reports). */
int32_t logits_argmax(const float *logits, int vocab, float *margin);

#endif
