/* pcg32.c — PCG32 (XSH-RR), as in the reference pcg-c-basic. */
#include "pcg32.h"

#define PCG32_MULT 6364136223846793005ULL

uint32_t pcg32_next(pcg32 *r)
{
    uint64_t old = r->state;
    r->state = old * PCG32_MULT + r->inc;
    uint32_t xorshifted = (uint32_t)(((old >> 18u) ^ old) >> 27u);
    uint32_t rot = (uint32_t)(old >> 59u);
    return (xorshifted >> rot) | (xorshifted << ((-rot) & 31u));
}

void pcg32_seed(pcg32 *r, uint64_t initstate, uint64_t initseq)
{
    r->state = 0u;
    r->inc = (initseq << 1u) | 1u;
    pcg32_next(r);
    r->state += initstate;
    pcg32_next(r);
}

uint32_t pcg32_bounded(pcg32 *r, uint32_t bound)
{
    /* Reject the low values that would bias the modulo (pcg's own method). */
    uint32_t threshold = (uint32_t)(-bound) % bound;
    for (;;) {
        uint32_t v = pcg32_next(r);
        if (v >= threshold)
            return v % bound;
    }
}

double pcg32_double(pcg32 *r)
{
    uint64_t hi = pcg32_next(r) >> 5;   /* 27 bits */
    uint64_t lo = pcg32_next(r) >> 6;   /* 26 bits */
    return (double)((hi << 26) | lo) * (1.0 / 9007199254740992.0);
}

float pcg32_unit_uniform(pcg32 *r)
{
    /* 24-bit uniform in [0, 1), centred, scaled to unit variance. */
    double u = (double)(pcg32_next(r) >> 8) * (1.0 / 16777216.0);
    return (float)((u - 0.5 + 0.5 / 16777216.0) * 3.4641016151377546); /* 2 sqrt(3) */
}
