/* pcg32.c — PCG32 (XSH-RR), as in the reference pcg-c-basic. */
#include "pcg32.h"

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
