/* pcg32.h — the PCG32 generator (O'Neill's pcg32_random_r, XSH-RR 64/32).
 *
 * Everything random in kvdiff (synthetic weights, random prompts,
 * sampling) draws from one of these, passed in explicitly: there is no
 * global generator. */
#ifndef KV_PCG32_H
#define KV_PCG32_H

#include <stdint.h>

typedef struct {
    uint64_t state;
    uint64_t inc;    /* always odd */
} pcg32;

#define PCG32_MULT 6364136223846793005ULL

/* Seeds as pcg32_srandom_r(initstate, initseq). */
void pcg32_seed(pcg32 *r, uint64_t initstate, uint64_t initseq);

/* Inline: synthetic weights draw a billion of these for a 1B preset, and a
 * call per value was a third of the time. */
static inline uint32_t pcg32_next(pcg32 *r)
{
    uint64_t old = r->state;
    r->state = old * PCG32_MULT + r->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    uint32_t rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((-rot) & 31u));
}

/* Uniform in [0, bound), unbiased (bound > 0). */
uint32_t pcg32_bounded(pcg32 *r, uint32_t bound);
/* Uniform double in [0, 1) with 53 random bits (two draws). */
double pcg32_double(pcg32 *r);
/* Uniform with mean 0 and variance 1: U(-sqrt 3, sqrt 3) from 24 bits. */
static inline float pcg32_unit_uniform(pcg32 *r)
{
    /* 24-bit uniform in [0, 1), centred, scaled to unit variance. */
    double u = (double)(pcg32_next(r) >> 8) * (1.0 / 16777216.0);
    return (float)((u - 0.5 + 0.5 / 16777216.0) * 3.4641016151377546); /* 2 sqrt(3) */
}

#endif
