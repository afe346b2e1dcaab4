/* kernels_x86.h — internal: the AVX2 / AVX-512 entry points kernels.c
 * dispatches to (defined in kernels_x86.c). Not part of the public API. */
#ifndef KV_KERNELS_X86_H
#define KV_KERNELS_X86_H

#include "kernels.h"

#if defined(__x86_64__)
kern_isa kern_x86_best(void);
void kern_x86_matmul_tile(kern_isa isa, const kern_linear *L, const float *x, int m0, int m1,
                          int p0, int p1, float *y);
void kern_x86_scores(kern_isa isa, const float *q, const float *const *krow, size_t off,
                     int n, int D, float scale, float *s);
/* The value sum of one chunk of keys; stores into out when first, else adds. */
void kern_x86_pv(kern_isa isa, const float *p, const float *const *vrow, size_t off, int n,
                 int D, float *out, int first);
float kern_x86_dot(kern_isa isa, const float *a, const float *b, int n);
#endif

#endif
