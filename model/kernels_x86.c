/* kernels_x86.c — the AVX2 and AVX-512 paths of the kernels in kernels.c.
 *
 * Every function here computes exactly the operations of the scalar path in
 * kernels.c (the ORDER RULE in kernels.h), only several lanes at a time:
 * vector FMA is fmaf per lane, vector add is a float add per lane. Nothing
 * here reassociates a sum. The tests compare all paths bit for bit.
 *
 * The file compiles without any -m flag: each function carries its own
 * target attribute and kernels.c dispatches at run time. On other
 * architectures it is empty and kernels.c uses the scalar path.
 *
 * The entry points (kern_x86_*) are declared in kernels_x86.h. */
#include "kernels_x86.h"

#if defined(__x86_64__)

#include <immintrin.h>

#define ATTR512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define ATTR2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

/* libgcc / compiler-rt fill the CPU model in a constructor, so no
 * __builtin_cpu_init here (that would also race between threads). */
kern_isa kern_x86_best(void)
{
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
        return KERN_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return KERN_ISA_AVX2;
    return KERN_ISA_SCALAR;
}

/* ------------------------------------------------------------------------
 * matmul micro-kernels
 *
 * A micro-kernel computes an MR x NR tile: MR rows of x against NR panels
 * (16 outputs each) over all of k, by the block rule of kernels.h: the
 * accumulators (in registers) start each block of KERN_KBLOCK k's with a
 * multiply (not a zeroing: 24 register moves per block cost ~8% of a
 * prefill's speed) and FMA the rest; a finished block merges with the level sums its index calls for
 * (the binary counter of panel_scalar in kernels.c, the older sum on the
 * left) and is parked in its level; the levels left at the end are added
 * from the lowest up, then the bias. Levels live in a local array: one
 * store per block and, on average, one load and add, against 16 FMAs.
 *
 * The kernels are written once as always-inline bodies with MR, NR and the
 * weight type as arguments; each (MR, NR, type) instance below is a
 * separate function in which those are constants, so the tests on them
 * fold away and only that tile's accumulators remain, in registers. */

typedef struct {
    const float *x;      /* x at (row m, column 0) */
    size_t ldx;          /* floats between rows of x */
    const void *w;       /* panel p at row 0 (float or uint16_t) */
    size_t pstride;      /* elements between consecutive panels (n_in * 16) */
    int K;               /* k steps (n_in) */
    float *y;            /* y at (row m, column 16 p) */
    size_t ldy;          /* floats between rows of y */
    const float *bias;   /* bias at 16 p, or NULL */
    int lastvalid;       /* lanes of panel NR-1 that exist (16 unless the matrix's last) */
} mk_args;

typedef void (*mk_fn)(const mk_args *a);

/* Accumulators are named variables c<i><j> (row i, panel j), not an
 * array: clang does not turn an array of vectors carried across the k loop
 * into registers, gcc does; named variables work for both. Every use is
 * guarded by a test on the constants MR and NR, so each instance keeps
 * only its own. FOR_TILE(M) expands M(i, j) over the largest tile, 8 x 4;
 * accumulator (i, j) parks its levels at index 4 i + j. */
#define FOR_ROW(M, i) M(i, 0) M(i, 1) M(i, 2) M(i, 3)
#define FOR_TILE(M)                                                                    \
    FOR_ROW(M, 0) FOR_ROW(M, 1) FOR_ROW(M, 2) FOR_ROW(M, 3) FOR_ROW(M, 4) FOR_ROW(M, 5) \
    FOR_ROW(M, 6) FOR_ROW(M, 7)
#define FOR_ROWS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define LV(i, j) ((i) * 4 + (j))

/* --- AVX-512: one zmm = one panel --- */

INLINE ATTR512 __m512 w512(const void *w, size_t idx, int bf16)
{
    if (bf16) {
        /* bf16 -> f32 is exact: the 16 bits become the high half. */
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)w + idx);
}

INLINE ATTR512 void mk512_body(const int MR, const int NR, const int bf16, const mk_args *a)
{
    const __mmask16 lastmask = (__mmask16)((1u << a->lastvalid) - 1u);
    const float *xr = a->x;
    const size_t ldx = a->ldx, ldy = a->ldy, ps = a->pstride;
    const int K = a->K;
    float *y = a->y;
    __m512 lv[KERN_MAX_LEVELS][32];
    int nb = 0;
#define MASK512(j) ((j) == NR - 1 ? lastmask : (__mmask16)0xFFFF)

#define DECL(i, j) __m512 c##i##j = _mm512_setzero_ps();
    FOR_TILE(DECL)
#undef DECL
    for (int k0 = 0; k0 < K; k0 += KERN_KBLOCK, nb++) {
        const int k1 = K - k0 < KERN_KBLOCK ? K : k0 + KERN_KBLOCK;
        /* The block's first product is a multiply (no zeroing), the rest
         * FMAs. */
#define WLOAD(k)                                                                \
    const size_t wk = (size_t)(k) * 16;                                         \
    __m512 w0 = w512(a->w, wk, bf16);                                           \
    __m512 w1 = NR > 1 ? w512(a->w, ps + wk, bf16) : w0;                        \
    __m512 w2 = NR > 2 ? w512(a->w, 2 * ps + wk, bf16) : w0;                    \
    __m512 w3 = NR > 3 ? w512(a->w, 3 * ps + wk, bf16) : w0;
        {
            const int k = k0;
            WLOAD(k)
#define MUL(i, j)                                                               \
    if (NR > j)                                                                 \
        c##i##j = _mm512_mul_ps(xb, w##j);
#define ROW(i)                                                                  \
    if (MR > i) {                                                               \
        __m512 xb = _mm512_set1_ps(xr[i * ldx + k]);                            \
        FOR_ROW(MUL, i)                                                         \
    }
            FOR_ROWS(ROW)
#undef ROW
#undef MUL
        }
        for (int k = k0 + 1; k < k1; k++) {
            WLOAD(k)
#define FMA(i, j)                                                               \
    if (NR > j)                                                                 \
        c##i##j = _mm512_fmadd_ps(xb, w##j, c##i##j);
#define ROW(i)                                                                  \
    if (MR > i) {                                                               \
        __m512 xb = _mm512_set1_ps(xr[i * ldx + k]);                            \
        FOR_ROW(FMA, i)                                                         \
    }
            FOR_ROWS(ROW)
#undef ROW
#undef FMA
        }
#undef WLOAD
        int l = 0;
        for (; nb >> l & 1; l++) {
#define MERGE(i, j)                                                             \
    if (MR > i && NR > j)                                                       \
        c##i##j = _mm512_add_ps(lv[l][LV(i, j)], c##i##j);
            FOR_TILE(MERGE)
#undef MERGE
        }
#define PARK(i, j)                                                              \
    if (MR > i && NR > j)                                                       \
        lv[l][LV(i, j)] = c##i##j;
        FOR_TILE(PARK)
#undef PARK
    }
    int first = 1;
    for (int l = 0; l < KERN_MAX_LEVELS; l++) {
        if (!(nb >> l & 1))
            continue;
#define FINAL(i, j)                                                             \
    if (MR > i && NR > j)                                                       \
        c##i##j = first ? lv[l][LV(i, j)] : _mm512_add_ps(lv[l][LV(i, j)], c##i##j);
        FOR_TILE(FINAL)
#undef FINAL
        first = 0;
    }
    if (a->bias) {
        const float *b = a->bias;
        __m512 b0 = _mm512_maskz_loadu_ps(MASK512(0), b);
        __m512 b1 = NR > 1 ? _mm512_maskz_loadu_ps(MASK512(1), b + 16) : b0;
        __m512 b2 = NR > 2 ? _mm512_maskz_loadu_ps(MASK512(2), b + 32) : b0;
        __m512 b3 = NR > 3 ? _mm512_maskz_loadu_ps(MASK512(3), b + 48) : b0;
#define BIAS(i, j)                                                              \
    if (MR > i && NR > j)                                                       \
        c##i##j = _mm512_add_ps(c##i##j, b##j);
        FOR_TILE(BIAS)
#undef BIAS
    }
#define STORE(i, j)                                                             \
    if (MR > i && NR > j)                                                       \
        _mm512_mask_storeu_ps(y + i * ldy + 16 * j, MASK512(j), c##i##j);
    FOR_TILE(STORE)
#undef STORE
#undef MASK512
}

/* --- AVX2: two ymm = one panel (lanes 0-7 in c<i><j>l, 8-15 in c<i><j>h) --- */

INLINE ATTR2 __m256 w256(const void *w, size_t idx, int bf16)
{
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + idx);
}

/* Lane masks for maskload/maskstore: lane l is on when l < valid. */
INLINE ATTR2 __m256i lanes_below(int valid)
{
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), idx);
}

INLINE ATTR2 void mk256_body(const int MR, const int NR, const int bf16, const mk_args *a)
{
    const __m256i ones = _mm256_set1_epi32(-1);
    const __m256i lml = lanes_below(a->lastvalid), lmh = lanes_below(a->lastvalid - 8);
    const float *xr = a->x;
    const size_t ldx = a->ldx, ldy = a->ldy, ps = a->pstride;
    const int K = a->K;
    float *y = a->y;
    __m256 lv[KERN_MAX_LEVELS][2 * 32];
    int nb = 0;
#define MASKL(j) ((j) == NR - 1 ? lml : ones)
#define MASKH(j) ((j) == NR - 1 ? lmh : ones)

#define DECL(i, j) __m256 c##i##j##l = _mm256_setzero_ps(), c##i##j##h = c##i##j##l;
    FOR_TILE(DECL)
#undef DECL
    for (int k0 = 0; k0 < K; k0 += KERN_KBLOCK, nb++) {
        const int k1 = K - k0 < KERN_KBLOCK ? K : k0 + KERN_KBLOCK;
#define WLOAD(k)                                                                \
    const size_t wk = (size_t)(k) * 16;                                         \
    __m256 w0l = w256(a->w, wk, bf16), w0h = w256(a->w, wk + 8, bf16);         \
    __m256 w1l = NR > 1 ? w256(a->w, ps + wk, bf16) : w0l;                      \
    __m256 w1h = NR > 1 ? w256(a->w, ps + wk + 8, bf16) : w0l;                  \
    __m256 w2l = NR > 2 ? w256(a->w, 2 * ps + wk, bf16) : w0l;                  \
    __m256 w2h = NR > 2 ? w256(a->w, 2 * ps + wk + 8, bf16) : w0l;              \
    __m256 w3l = NR > 3 ? w256(a->w, 3 * ps + wk, bf16) : w0l;                  \
    __m256 w3h = NR > 3 ? w256(a->w, 3 * ps + wk + 8, bf16) : w0l;
#define ROW(i)                                                                  \
    if (MR > i) {                                                               \
        __m256 xb = _mm256_set1_ps(xr[i * ldx + k]);                            \
        FOR_ROW(OP, i)                                                          \
    }
        {   /* the block's first product: a multiply */
            const int k = k0;
            WLOAD(k)
#define OP(i, j)                                                                \
    if (NR > j) {                                                               \
        c##i##j##l = _mm256_mul_ps(xb, w##j##l);                                \
        c##i##j##h = _mm256_mul_ps(xb, w##j##h);                                \
    }
            FOR_ROWS(ROW)
#undef OP
        }
#define OP(i, j)                                                                \
    if (NR > j) {                                                               \
        c##i##j##l = _mm256_fmadd_ps(xb, w##j##l, c##i##j##l);                  \
        c##i##j##h = _mm256_fmadd_ps(xb, w##j##h, c##i##j##h);                  \
    }
        if (k1 - k0 == KERN_KBLOCK) {
            /* A whole block, unrolled: no loop exit to mispredict at the
             * end of every block. */
#pragma GCC unroll 16
            for (int k = k0 + 1; k < k0 + KERN_KBLOCK; k++) {
                WLOAD(k)
                FOR_ROWS(ROW)
            }
        } else {
            for (int k = k0 + 1; k < k1; k++) {
                WLOAD(k)
                FOR_ROWS(ROW)
            }
        }
#undef OP
#undef ROW
#undef WLOAD
        int l = 0;
        for (; nb >> l & 1; l++) {
#define MERGE(i, j)                                                             \
    if (MR > i && NR > j) {                                                     \
        c##i##j##l = _mm256_add_ps(lv[l][2 * LV(i, j)], c##i##j##l);            \
        c##i##j##h = _mm256_add_ps(lv[l][2 * LV(i, j) + 1], c##i##j##h);        \
    }
            FOR_TILE(MERGE)
#undef MERGE
        }
#define PARK(i, j)                                                              \
    if (MR > i && NR > j) {                                                     \
        lv[l][2 * LV(i, j)] = c##i##j##l;                                       \
        lv[l][2 * LV(i, j) + 1] = c##i##j##h;                                   \
    }
        FOR_TILE(PARK)
#undef PARK
    }
    int first = 1;
    for (int l = 0; l < KERN_MAX_LEVELS; l++) {
        if (!(nb >> l & 1))
            continue;
#define FINAL(i, j)                                                             \
    if (MR > i && NR > j) {                                                     \
        c##i##j##l = first ? lv[l][2 * LV(i, j)]                                \
                           : _mm256_add_ps(lv[l][2 * LV(i, j)], c##i##j##l);    \
        c##i##j##h = first ? lv[l][2 * LV(i, j) + 1]                            \
                           : _mm256_add_ps(lv[l][2 * LV(i, j) + 1], c##i##j##h);\
    }
        FOR_TILE(FINAL)
#undef FINAL
        first = 0;
    }
    if (a->bias) {
        const float *b = a->bias;
        __m256 b0l = _mm256_maskload_ps(b, MASKL(0)), b0h = _mm256_maskload_ps(b + 8, MASKH(0));
        __m256 b1l = NR > 1 ? _mm256_maskload_ps(b + 16, MASKL(1)) : b0l;
        __m256 b1h = NR > 1 ? _mm256_maskload_ps(b + 24, MASKH(1)) : b0l;
        __m256 b2l = NR > 2 ? _mm256_maskload_ps(b + 32, MASKL(2)) : b0l;
        __m256 b2h = NR > 2 ? _mm256_maskload_ps(b + 40, MASKH(2)) : b0l;
        __m256 b3l = NR > 3 ? _mm256_maskload_ps(b + 48, MASKL(3)) : b0l;
        __m256 b3h = NR > 3 ? _mm256_maskload_ps(b + 56, MASKH(3)) : b0l;
#define BIAS(i, j)                                                              \
    if (MR > i && NR > j) {                                                     \
        c##i##j##l = _mm256_add_ps(c##i##j##l, b##j##l);                        \
        c##i##j##h = _mm256_add_ps(c##i##j##h, b##j##h);                        \
    }
        FOR_TILE(BIAS)
#undef BIAS
    }
    /* vmaskmovps stores are microcoded on AMD (tens of cycles each): only
     * the matrix's partial last panel takes them. */
    if (a->lastvalid == KERN_PANEL) {
#define STORE(i, j)                                                             \
    if (MR > i && NR > j) {                                                     \
        _mm256_storeu_ps(y + i * ldy + 16 * j, c##i##j##l);                     \
        _mm256_storeu_ps(y + i * ldy + 16 * j + 8, c##i##j##h);                 \
    }
        FOR_TILE(STORE)
#undef STORE
    } else {
#define STORE(i, j)                                                             \
    if (MR > i && NR > j) {                                                     \
        _mm256_maskstore_ps(y + i * ldy + 16 * j, MASKL(j), c##i##j##l);        \
        _mm256_maskstore_ps(y + i * ldy + 16 * j + 8, MASKH(j), c##i##j##h);    \
    }
        FOR_TILE(STORE)
#undef STORE
    }
#undef MASKL
#undef MASKH
}

/* --- instances --- */

#define MK512(MR, NR)                                                                  \
    static ATTR512 void mk512_f32_##MR##x##NR(const mk_args *a) { mk512_body(MR, NR, 0, a); } \
    static ATTR512 void mk512_bf16_##MR##x##NR(const mk_args *a) { mk512_body(MR, NR, 1, a); }
#define MK256(MR, NR)                                                                  \
    static ATTR2 void mk256_f32_##MR##x##NR(const mk_args *a) { mk256_body(MR, NR, 0, a); } \
    static ATTR2 void mk256_bf16_##MR##x##NR(const mk_args *a) { mk256_body(MR, NR, 1, a); }

/* AVX-512 shapes: MR*NR accumulators of 32 zmm, leaving room for weights. */
MK512(1, 1) MK512(1, 2) MK512(1, 3) MK512(1, 4)
MK512(2, 1) MK512(2, 2) MK512(2, 3) MK512(2, 4)
MK512(3, 1) MK512(3, 2) MK512(3, 3) MK512(3, 4)
MK512(4, 1) MK512(4, 2) MK512(4, 3) MK512(4, 4)
MK512(5, 1) MK512(5, 2) MK512(5, 3) MK512(5, 4)
MK512(6, 1) MK512(6, 2) MK512(6, 3) MK512(6, 4)
MK512(7, 1) MK512(7, 2) MK512(7, 3)
MK512(8, 1) MK512(8, 2) MK512(8, 3)

/* AVX2 shapes: 2*MR*NR accumulators of 16 ymm. */
MK256(1, 1) MK256(1, 2) MK256(1, 3) MK256(1, 4)
MK256(2, 1) MK256(2, 2) MK256(2, 3)
MK256(3, 1) MK256(3, 2)
MK256(4, 1)
MK256(5, 1)
MK256(6, 1)

#define ROW512(t, MR) \
    { NULL, mk512_##t##_##MR##x1, mk512_##t##_##MR##x2, mk512_##t##_##MR##x3, NR4_##MR(t) }
#define T512(MR) ROW512(f32, MR)
#define B512(MR) ROW512(bf16, MR)
#define NR4_1(t) mk512_##t##_1x4
#define NR4_2(t) mk512_##t##_2x4
#define NR4_3(t) mk512_##t##_3x4
#define NR4_4(t) mk512_##t##_4x4
#define NR4_5(t) mk512_##t##_5x4
#define NR4_6(t) mk512_##t##_6x4
#define NR4_7(t) NULL
#define NR4_8(t) NULL

/* [bf16][MR][NR]; NULL where the shape would not fit the register file. */
static const mk_fn mk512_table[2][9][5] = {
    { { NULL }, T512(1), T512(2), T512(3), T512(4), T512(5), T512(6), T512(7), T512(8) },
    { { NULL }, B512(1), B512(2), B512(3), B512(4), B512(5), B512(6), B512(7), B512(8) },
};

static const mk_fn mk256_table[2][7][5] = {
    { { NULL },
      { NULL, mk256_f32_1x1, mk256_f32_1x2, mk256_f32_1x3, mk256_f32_1x4 },
      { NULL, mk256_f32_2x1, mk256_f32_2x2, mk256_f32_2x3, NULL },
      { NULL, mk256_f32_3x1, mk256_f32_3x2, NULL, NULL },
      { NULL, mk256_f32_4x1, NULL, NULL, NULL },
      { NULL, mk256_f32_5x1, NULL, NULL, NULL },
      { NULL, mk256_f32_6x1, NULL, NULL, NULL } },
    { { NULL },
      { NULL, mk256_bf16_1x1, mk256_bf16_1x2, mk256_bf16_1x3, mk256_bf16_1x4 },
      { NULL, mk256_bf16_2x1, mk256_bf16_2x2, mk256_bf16_2x3, NULL },
      { NULL, mk256_bf16_3x1, mk256_bf16_3x2, NULL, NULL },
      { NULL, mk256_bf16_4x1, NULL, NULL, NULL },
      { NULL, mk256_bf16_5x1, NULL, NULL, NULL },
      { NULL, mk256_bf16_6x1, NULL, NULL, NULL } },
};

/* ------------------------------------------------------------------------
 * matmul tile: rows [m0, m1) x panels [p0, p1) of y, all of k.
 *
 * Loop nest (outermost first):
 *   panel blocks of PB  — PB whole panels (PB x K x 16) stay in L2 and are
 *                         reused by every row tile
 *   row tiles of MR     — one x row tile reused across the panel block
 *   panel groups of NR  — one micro-kernel call, over all of k
 * k is never split across calls: the block rule's level sums live inside
 * the micro-kernel. For a few rows (decode) there is nothing to reuse: one
 * panel block, so the weights stream from memory exactly once, NR panels
 * at a time. None of this changes the per-output sequence of operations. */

typedef struct {
    int mr, nr;          /* main tile shape */
    int pb;              /* panels per L2 block */
} mm_plan;

static mm_plan plan_for(kern_isa isa, const kern_linear *L, int rows)
{
    mm_plan pl;
    if (isa == KERN_ISA_AVX512) {
        pl.mr = rows >= 8 ? 8 : rows;
        pl.nr = pl.mr <= 6 ? 4 : 3;
    } else {
        pl.mr = rows >= 6 ? 6 : rows;
        pl.nr = pl.mr == 1 ? 4 : pl.mr == 2 ? 3 : pl.mr == 3 ? 2 : 1;
    }
    if (rows <= 4) {
        pl.pb = 1 << 30;
    } else {
        /* 16 output lanes x K x element size per panel; ~1 MiB of L2. */
        pl.pb = (1 << 20) / (KERN_PANEL * L->n_in * (L->wtype == KERN_BF16 ? 2 : 4));
        if (pl.pb < pl.nr)
            pl.pb = pl.nr;
    }
    return pl;
}

/* The widest available kernel of mr rows and at most nr panels; every
 * table has all nr = 1 entries, so this always finds one. */
static int shape_nr(kern_isa isa, int bf16, int mr, int nr)
{
    if (isa == KERN_ISA_AVX512) {
        while (!mk512_table[bf16][mr][nr])
            nr--;
    } else {
        while (!mk256_table[bf16][mr][nr])
            nr--;
    }
    return nr;
}

void kern_x86_matmul_tile(kern_isa isa, const kern_linear *L, const float *x, int m0, int m1,
                          int p0, int p1, float *y)
{
    const int K = L->n_in, N = L->n_out;
    const int bf16 = L->wtype == KERN_BF16;
    const size_t esz = bf16 ? 2 : 4;
    const size_t pstride = (size_t)K * KERN_PANEL;
    const int nlast = (N + KERN_PANEL - 1) / KERN_PANEL - 1;   /* the only partial panel */
    const mm_plan pl = plan_for(isa, L, m1 - m0);

    for (int b0 = p0; b0 < p1; b0 += pl.pb) {
        int b1 = p1 - b0 < pl.pb ? p1 : b0 + pl.pb;
        for (int m = m0; m < m1; m += pl.mr) {
            int mr = m1 - m < pl.mr ? m1 - m : pl.mr;
            int nr;
            for (int p = b0; p < b1; p += nr) {
                nr = shape_nr(isa, bf16, mr, b1 - p < pl.nr ? b1 - p : pl.nr);
                mk_fn fn = isa == KERN_ISA_AVX512 ? mk512_table[bf16][mr][nr]
                                                  : mk256_table[bf16][mr][nr];
                mk_args a = {
                    .x = x + (size_t)m * K,
                    .ldx = (size_t)K,
                    .w = (const char *)L->panels + (size_t)p * pstride * esz,
                    .pstride = pstride,
                    .K = K,
                    .y = y + (size_t)m * N + (size_t)p * KERN_PANEL,
                    .ldy = (size_t)N,
                    .bias = L->bias ? L->bias + (size_t)p * KERN_PANEL : NULL,
                    .lastvalid = p + nr - 1 == nlast ? N - nlast * KERN_PANEL : KERN_PANEL,
                };
                fn(&a);
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * attention helpers
 *
 * Dot products follow the 8-lane rule: lane l of one ymm accumulates the
 * elements i % 8 == l in ascending i; the tail (n % 8 elements) is an FMA
 * blended under a mask so absent lanes keep their value exactly (even a
 * -0, which fmaf(0, 0, -0) would turn into +0). The 8 partial
 * sums are then combined in the fixed tree of combine8 (the scalar path's
 * definition). Eight keys are computed together so eight FMA chains are in
 * flight and their combines can be done as vectors. */

static float combine8(const float s[8])
{
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

INLINE ATTR2 __m256 tail_fma2(__m256 acc, const float *a, const float *b, __m256i m)
{
    __m256 t = _mm256_fmadd_ps(_mm256_maskload_ps(a, m), _mm256_maskload_ps(b, m), acc);
    return _mm256_blendv_ps(acc, t, _mm256_castsi256_ps(m));
}

/* combine8 of eight keys at once: lane t of the result is
 * ((a_t[0]+a_t[4]) + (a_t[1]+a_t[5])) + ((a_t[2]+a_t[6]) + (a_t[3]+a_t[7])),
 * the same adds of the same values (hadd adds neighbours, and a float add
 * is commutative), so the same bits as combine8. */
INLINE ATTR2 __m256 combine8x8(const __m256 a[8])
{
    /* [lo(a_2t), lo(a_2t+1)] + [hi(a_2t), hi(a_2t+1)]: lane l of key k
     * becomes u_l = s_l + s_l+4. */
#define HALVES(t) _mm256_add_ps(_mm256_permute2f128_ps(a[2 * t], a[2 * t + 1], 0x20), \
                                _mm256_permute2f128_ps(a[2 * t], a[2 * t + 1], 0x31))
    __m256 u0 = HALVES(0), u1 = HALVES(1), u2 = HALVES(2), u3 = HALVES(3);
#undef HALVES
    /* (u0+u1), (u2+u3) per key, then their sum: keys come out as
     * [0, 2, 4, 6 | 1, 3, 5, 7]. */
    __m256 h1 = _mm256_hadd_ps(u0, u1);
    __m256 h2 = _mm256_hadd_ps(u2, u3);
    __m256 r = _mm256_hadd_ps(h1, h2);
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* s[j] = dot(q, krow[j] + off) * scale for j < n. Used by both SIMD paths:
 * the 8-lane rule is one ymm, AVX-512 has nothing to add. */
static ATTR2 void scores_avx2(const float *q, const float *const *krow, size_t off, int n,
                              int D, float scale, float *s)
{
    const int Dv = D & ~7, rem = D - Dv;
    const __m256i tm = lanes_below(rem);
    float lanes[8];
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        /* Named accumulators a0..a7, one per key (see FOR_TILE). */
#define SCDECL(t) const float *k##t = krow[j + t] + off; __m256 a##t = _mm256_setzero_ps();
        FOR_ROWS(SCDECL)
#undef SCDECL
        for (int i = 0; i < Dv; i += 8) {
            __m256 qv = _mm256_loadu_ps(q + i);
#define SCFMA(t) a##t = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k##t + i), a##t);
            FOR_ROWS(SCFMA)
#undef SCFMA
        }
        if (rem) {
#define SCTAIL(t) a##t = tail_fma2(a##t, q + Dv, k##t + Dv, tm);
            FOR_ROWS(SCTAIL)
#undef SCTAIL
        }
        const __m256 acc[8] = { a0, a1, a2, a3, a4, a5, a6, a7 };
        _mm256_storeu_ps(s + j, _mm256_mul_ps(combine8x8(acc), _mm256_set1_ps(scale)));
    }
    for (; j < n; j++) {
        const float *kj = krow[j] + off;
        __m256 a0 = _mm256_setzero_ps();
        for (int i = 0; i < Dv; i += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(kj + i), a0);
        if (rem)
            a0 = tail_fma2(a0, q + Dv, kj + Dv, tm);
        _mm256_storeu_ps(lanes, a0);
        s[j] = combine8(lanes) * scale;
    }
}

static ATTR2 float dot_avx2(const float *a, const float *b, int n)
{
    const int nv = n & ~7;
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < nv; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    if (n > nv)
        acc = tail_fma2(acc, a + nv, b + nv, lanes_below(n - nv));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    return combine8(lanes);
}

/* The weighted value sum of one chunk of n keys by the block rule
 * (pv_body in kernels.c): a chunk of up to 128 columns (NC zmm, the last
 * one masked) stays in registers across a block of 16 keys; block sums
 * merge with the parked levels (lv, local) as the binary counter says; the
 * chunk's sum is stored into out (first) or added to it. NC is a constant
 * in each instance, so only o0..o(NC-1) remain, in registers. */
#define PV_LEVELS 9     /* ATTN_PV_LEVELS in kernels.c: 2^8 blocks of a 4096-key chunk */
INLINE ATTR512 void pv_chunk512(const int NC, const float *p, const float *const *vrow,
                                size_t off, int n, float *out, __mmask16 lastmask, int first)
{
    __m512 lv[PV_LEVELS][8];
    int nb = 0;
    /* Named accumulators o0..o7, as in the matmul kernels. */
#define PVMASK(c) ((c) == NC - 1 ? lastmask : (__mmask16)0xFFFF)
#define PVDECL(c) __m512 o##c = _mm512_setzero_ps();
    FOR_ROWS(PVDECL)
#undef PVDECL
    for (int j0 = 0; j0 < n; j0 += KERN_KBLOCK, nb++) {
        const int j1 = n - j0 < KERN_KBLOCK ? n : j0 + KERN_KBLOCK;
        {   /* the block's first key: a multiply */
            const float *v = vrow[j0] + off;
            __m512 pj = _mm512_set1_ps(p[j0]);
#define PVMUL(c)                                                                \
    if (NC > c)                                                                 \
        o##c = _mm512_mul_ps(pj, _mm512_maskz_loadu_ps(PVMASK(c), v + 16 * c));
            FOR_ROWS(PVMUL)
#undef PVMUL
        }
        for (int j = j0 + 1; j < j1; j++) {
            const float *v = vrow[j] + off;
            __m512 pj = _mm512_set1_ps(p[j]);
#define PVFMA(c)                                                                \
    if (NC > c)                                                                 \
        o##c = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(PVMASK(c), v + 16 * c), o##c);
            FOR_ROWS(PVFMA)
#undef PVFMA
        }
        int l = 0;
        for (; nb >> l & 1; l++) {
#define PVMERGE(c)                                                              \
    if (NC > c)                                                                 \
        o##c = _mm512_add_ps(lv[l][c], o##c);
            FOR_ROWS(PVMERGE)
#undef PVMERGE
        }
#define PVPARK(c)                                                               \
    if (NC > c)                                                                 \
        lv[l][c] = o##c;
        FOR_ROWS(PVPARK)
#undef PVPARK
    }
    int top = 1;
    for (int l = 0; l < PV_LEVELS; l++) {
        if (!(nb >> l & 1))
            continue;
#define PVFINAL(c)                                                              \
    if (NC > c)                                                                 \
        o##c = top ? lv[l][c] : _mm512_add_ps(lv[l][c], o##c);
        FOR_ROWS(PVFINAL)
#undef PVFINAL
        top = 0;
    }
#define PVSTORE(c)                                                              \
    if (NC > c) {                                                               \
        if (!first)                                                             \
            o##c = _mm512_add_ps(_mm512_maskz_loadu_ps(PVMASK(c), out + 16 * c), o##c); \
        _mm512_mask_storeu_ps(out + 16 * c, PVMASK(c), o##c);                   \
    }
    FOR_ROWS(PVSTORE)
#undef PVSTORE
#undef PVMASK
}

static ATTR512 void pv_avx512(const float *p, const float *const *vrow, size_t off, int n,
                              int D, float *out, int first)
{
    for (int d0 = 0; d0 < D; d0 += 128) {
        int w = D - d0 < 128 ? D - d0 : 128;
        int nc = (w + 15) / 16;
        __mmask16 lm = (__mmask16)((1u << (w - 16 * (nc - 1))) - 1u);
        size_t o2 = off + (size_t)d0;
        float *o = out + d0;
        switch (nc) {
        case 1: pv_chunk512(1, p, vrow, o2, n, o, lm, first); break;
        case 2: pv_chunk512(2, p, vrow, o2, n, o, lm, first); break;
        case 3: pv_chunk512(3, p, vrow, o2, n, o, lm, first); break;
        case 4: pv_chunk512(4, p, vrow, o2, n, o, lm, first); break;
        case 5: pv_chunk512(5, p, vrow, o2, n, o, lm, first); break;
        case 6: pv_chunk512(6, p, vrow, o2, n, o, lm, first); break;
        case 7: pv_chunk512(7, p, vrow, o2, n, o, lm, first); break;
        default: pv_chunk512(8, p, vrow, o2, n, o, lm, first); break;
        }
    }
}

/* The same with ymm: up to 64 columns (NC ymm, the last one masked) in
 * registers. Masked-off lanes load as 0 and are never stored. */
INLINE ATTR2 void pv_chunk256(const int NC, const float *p, const float *const *vrow,
                              size_t off, int n, float *out, __m256i lastmask, int first)
{
    const __m256i ones = _mm256_set1_epi32(-1);
    __m256 lv[PV_LEVELS][8];
    int nb = 0;
#define PVMASK(c) ((c) == NC - 1 ? lastmask : ones)
#define PVDECL(c) __m256 o##c = _mm256_setzero_ps();
    FOR_ROWS(PVDECL)
#undef PVDECL
    for (int j0 = 0; j0 < n; j0 += KERN_KBLOCK, nb++) {
        const int j1 = n - j0 < KERN_KBLOCK ? n : j0 + KERN_KBLOCK;
        {   /* the block's first key: a multiply */
            const float *v = vrow[j0] + off;
            __m256 pj = _mm256_set1_ps(p[j0]);
#define PVMUL(c)                                                                \
    if (NC > c)                                                                 \
        o##c = _mm256_mul_ps(pj, _mm256_maskload_ps(v + 8 * c, PVMASK(c)));
            FOR_ROWS(PVMUL)
#undef PVMUL
        }
        for (int j = j0 + 1; j < j1; j++) {
            const float *v = vrow[j] + off;
            __m256 pj = _mm256_set1_ps(p[j]);
#define PVFMA(c)                                                                \
    if (NC > c)                                                                 \
        o##c = _mm256_fmadd_ps(pj, _mm256_maskload_ps(v + 8 * c, PVMASK(c)), o##c);
            FOR_ROWS(PVFMA)
#undef PVFMA
        }
        int l = 0;
        for (; nb >> l & 1; l++) {
#define PVMERGE(c)                                                              \
    if (NC > c)                                                                 \
        o##c = _mm256_add_ps(lv[l][c], o##c);
            FOR_ROWS(PVMERGE)
#undef PVMERGE
        }
#define PVPARK(c)                                                               \
    if (NC > c)                                                                 \
        lv[l][c] = o##c;
        FOR_ROWS(PVPARK)
#undef PVPARK
    }
    int top = 1;
    for (int l = 0; l < PV_LEVELS; l++) {
        if (!(nb >> l & 1))
            continue;
#define PVFINAL(c)                                                              \
    if (NC > c)                                                                 \
        o##c = top ? lv[l][c] : _mm256_add_ps(lv[l][c], o##c);
        FOR_ROWS(PVFINAL)
#undef PVFINAL
        top = 0;
    }
#define PVSTORE(c)                                                              \
    if (NC > c) {                                                               \
        if (!first)                                                             \
            o##c = _mm256_add_ps(_mm256_maskload_ps(out + 8 * c, PVMASK(c)), o##c); \
        _mm256_maskstore_ps(out + 8 * c, PVMASK(c), o##c);                      \
    }
    FOR_ROWS(PVSTORE)
#undef PVSTORE
#undef PVMASK
}

static ATTR2 void pv_avx2(const float *p, const float *const *vrow, size_t off, int n,
                          int D, float *out, int first)
{
    for (int d0 = 0; d0 < D; d0 += 64) {
        int w = D - d0 < 64 ? D - d0 : 64;
        int nc = (w + 7) / 8;
        __m256i lm = lanes_below(w - 8 * (nc - 1));
        size_t o2 = off + (size_t)d0;
        float *o = out + d0;
        switch (nc) {
        case 1: pv_chunk256(1, p, vrow, o2, n, o, lm, first); break;
        case 2: pv_chunk256(2, p, vrow, o2, n, o, lm, first); break;
        case 3: pv_chunk256(3, p, vrow, o2, n, o, lm, first); break;
        case 4: pv_chunk256(4, p, vrow, o2, n, o, lm, first); break;
        case 5: pv_chunk256(5, p, vrow, o2, n, o, lm, first); break;
        case 6: pv_chunk256(6, p, vrow, o2, n, o, lm, first); break;
        case 7: pv_chunk256(7, p, vrow, o2, n, o, lm, first); break;
        default: pv_chunk256(8, p, vrow, o2, n, o, lm, first); break;
        }
    }
}

void kern_x86_scores(kern_isa isa, const float *q, const float *const *krow, size_t off,
                     int n, int D, float scale, float *s)
{
    (void)isa;   /* the ymm code is the same instruction mix on both */
    scores_avx2(q, krow, off, n, D, scale, s);
}

void kern_x86_pv(kern_isa isa, const float *p, const float *const *vrow, size_t off, int n,
                 int D, float *out, int first)
{
    if (isa == KERN_ISA_AVX512)
        pv_avx512(p, vrow, off, n, D, out, first);
    else
        pv_avx2(p, vrow, off, n, D, out, first);
}

float kern_x86_dot(kern_isa isa, const float *a, const float *b, int n)
{
    (void)isa;
    return dot_avx2(a, b, n);
}

#else
/* Not x86-64: kernels.c never calls into this file. ISO C wants a
 * declaration in every translation unit. */
typedef int kern_x86_unused;
#endif
