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

/* Seeds as pcg32_srandom_r(initstate, initseq). */
void pcg32_seed(pcg32 *r, uint64_t initstate, uint64_t initseq);
uint32_t pcg32_next(pcg32 *r);
/* Uniform in [0, bound), unbiased (bound > 0). */
uint32_t pcg32_bounded(pcg32 *r, uint32_t bound);
/* Uniform double in [0, 1) with 53 random bits (two draws). */
double pcg32_double(pcg32 *r);
/* Uniform with mean 0 and variance 1: U(-sqrt 3, sqrt 3) from 24 bits. */
float pcg32_unit_uniform(pcg32 *r);

#endif
