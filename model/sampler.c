/* sampler.c — greedy and temperature / top-k / top-p sampling. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int sampler_init(sampler *s, const sampler_opts *o, uint64_t seed, int vocab, kv_err *e)
{
    memset(s, 0, sizeof *s);
    s->o = *o;
    s->vocab = vocab;
    /* Stream 0x5a is the sampler's: prompts drawn with the same seed use another. */
    pcg32_seed(&s->rng, seed, 0x5a);
    if (o->temperature > 0) {
        s->order = malloc((size_t)vocab * sizeof *s->order);
        s->prob = malloc((size_t)vocab * sizeof *s->prob);
        if (!s->order || !s->prob) {
            sampler_free(s);
            return kv_errf(e, "out of memory for the sampler");
        }
    }
    return 0;
}

void sampler_free(sampler *s)
{
    if (!s)
        return;
    free(s->order);
    free(s->prob);
    memset(s, 0, sizeof *s);
}

int32_t logits_argmax(const float *logits, int vocab, float *margin)
{
    int32_t best = 0;
    float b1 = -INFINITY, b2 = -INFINITY;
    for (int i = 0; i < vocab; i++) {
        float v = logits[i];
        if (v > b1) {
            b2 = b1;
            b1 = v;
            best = i;
        } else if (v > b2) {
            b2 = v;
        }
    }
    if (margin)
        *margin = b1 - b2;
    return best;
}

/* Descending logit, ascending id on ties: a total order. */
static int by_logit_desc(const void *a, const void *b)
{
    const sampler_cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit > y->logit ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

int32_t sampler_pick(sampler *s, const float *logits)
{
    if (s->o.temperature <= 0)
        return logits_argmax(logits, s->vocab, NULL);
    int n = s->vocab;
    for (int i = 0; i < n; i++)
        s->order[i] = (sampler_cand){.logit = logits[i], .id = i};
    qsort(s->order, (size_t)n, sizeof *s->order, by_logit_desc);
    if (s->o.top_k > 0 && s->o.top_k < n)
        n = s->o.top_k;
    const double t = s->o.temperature, top = s->order[0].logit;
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = exp(((double)s->order[i].logit - top) / t);
        sum += s->prob[i];
    }
    if (s->o.top_p > 0 && s->o.top_p < 1) {
        double acc = 0;
        for (int i = 0; i < n; i++) {
            acc += s->prob[i] / sum;
            if (acc >= s->o.top_p) {
                n = i + 1;
                break;
            }
        }
        sum = 0;
        for (int i = 0; i < n; i++)
            sum += s->prob[i];
    }
    double u = pcg32_double(&s->rng) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->prob[i];
        if (u < acc)
            return s->order[i].id;
    }
    return s->order[n - 1].id;
}
