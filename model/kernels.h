/* kernels.h — the deterministic, batch-invariant numeric kernels.
 *
 * THE ORDER RULE. Every output element is computed by one fixed sequence of
 * floating-point operations that depends neither on how many rows are in
 * the batch, nor on the thread count, nor on whether the scalar or a SIMD
 * path runs:
 *
 *  - matmul: weights are packed at load into panels of KERN_PANEL (16)
 *    output columns, K-major: panel p holds W[16p + j][k] at [k][j]. Output
 *    y[m][n] is a pairwise sum of blocks. k = 0..K-1 is cut into blocks of
 *    KERN_KBLOCK (16) consecutive k's, the last one shorter when K is not a
 *    multiple. Block b's sum starts as the float product x[m][k] * w[n][k]
 *    of its first k, then s = fmaf(x[m][k], w[n][k], s) for the rest in
 *    ascending k (a product, not fmaf onto +0: they differ only in the sign
 *    of a zero, and the SIMD paths save a zeroing per block). The nb
 *    block sums combine as a binary counter: after block b, while bit l of
 *    b is set (l = 0, 1, ...), s = level[l] + s; then level[l] = s for the
 *    first l whose bit is clear. At the end the levels whose bit is set in
 *    nb are added from the lowest up: r = level[lowest], then
 *    r = level[l] + r for each higher one. (For nb a power of two that is
 *    the perfect pairwise tree; otherwise tree(2^a) + (tree(2^b) + ...) over
 *    the binary digits of nb, biggest first.) Then the bias: r + b[n].
 *    The order depends only on K, so M = 1 and M = 512 give the same bits.
 *    Why: one accumulator over K = 896 lands ~2 units of max|y| 2^-24 off
 *    (RMS, 5 at K = 4864); this rule ~0.4, better than llama.cpp's 16
 *    strided lanes (bench/bench_accuracy.c). SIMD paths put the 16 outputs
 *    of a panel in lanes; each lane runs exactly that sequence. Threads and
 *    row tiles split rows and panels, never k. bf16 weights are widened
 *    exactly to float before the same fmaf.
 *  - dot products inside attention and norms: 8 partial sums, lane l taking
 *    elements i with i % 8 == l in ascending i (fmaf), then combined as
 *    ((s0+s4)+(s1+s5)) + ((s2+s6)+(s3+s7)). Lengths need not be multiples
 *    of 8 (missing elements contribute nothing).
 *  - attention: keys visited in the order given (the caller gives them in
 *    ascending absolute position); two passes: max of scores, then
 *    p_j = expf(s_j - max) in that same key order. The sum l of the p_j is
 *    a double, added in key order. The weighted sum of values is the
 *    matmul's block rule over keys instead of k (blocks of KERN_KBLOCK
 *    keys, the first key's product then fmaf in key order, block sums
 *    combined by the same binary counter) within each chunk of 4096 keys, chunk sums added in
 *    key order; then out = (float)(o / l) and lse = (float)(max + log l),
 *    both in double. (kernels.c, "attention", spells out every step.)
 *
 * All kernels take a kern_ctx: the chosen instruction set and the thread
 * pool, passed in, never global. */
#ifndef KV_KERNELS_H
#define KV_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "pool.h"

#define KERN_PANEL 16
#define KERN_KBLOCK 16       /* k's per block of the matmul order rule */
#define KERN_MAX_LEVELS 28   /* pairwise levels: any int K (2^27 blocks of 16) */

typedef enum { KERN_ISA_SCALAR = 0, KERN_ISA_AVX2 = 1, KERN_ISA_AVX512 = 2 } kern_isa;
typedef enum { KERN_F32 = 0, KERN_BF16 = 1 } kern_wtype;

typedef struct {
    kern_isa isa;
    kern_pool *pool;     /* may be NULL: single-threaded */
} kern_ctx;

/* Best instruction set this CPU supports. */
kern_isa kern_isa_best(void);
const char *kern_isa_name(kern_isa isa);
/* Parses "scalar", "avx2", "avx512", "auto"; -1 when unknown. */
int kern_isa_parse(const char *s, kern_isa *out);

/* A linear layer y = x W^T (+ b), W of shape (n_out, n_in). */
typedef struct {
    int n_out, n_in;
    kern_wtype wtype;
    void *panels;        /* (ceil(n_out/16), n_in, 16) floats or bf16; padding lanes are 0 */
    float *bias;         /* (n_out) or NULL */
} kern_linear;

/* Allocates an empty (zero) packed matrix. Returns 0, -1 on allocation failure. */
int kern_linear_init(kern_linear *L, int n_out, int n_in, kern_wtype wt, bool with_bias);
void kern_linear_free(kern_linear *L);   /* accepts a zeroed struct */

/* Packs rows [row0, row0 + nrows) of W from row-major floats (nrows x n_in).
 * With bf16 storage each value is rounded to nearest even. */
void kern_linear_set_rows(kern_linear *L, int row0, int nrows, const float *src);

/* bf16 words from floats (round to nearest even, as packing does) and back. */
void kern_bf16_from_f32(const float *in, size_t n, uint16_t *out);
void kern_bf16_to_f32(const uint16_t *in, size_t n, float *out);

/* Copies row r of W (n_in values, exactly as stored) to out. */
void kern_linear_get_row(const kern_linear *L, int r, float *out);

/* y (M x n_out) = x (M x n_in) W^T + b. Rows of x and y are contiguous. */
void kern_matmul(const kern_ctx *c, const kern_linear *L, const float *x, int M, float *y);

/* Fixed-order dot product (the 8-lane rule above). */
float kern_dot(const float *a, const float *b, int n);

/* RMSNorm of one row: out = x / sqrt(mean(x^2) + eps) * (plus_one ? 1 + w : w);
 * w NULL: no multiplier (Gemma 4's v_norm).
 * mean(x^2) is accumulated in double in ascending order; the scale, the
 * products and 1 + w stay in double and each output is rounded to float
 * once. stats (may be NULL) receives the input's mean, rms and absmax.
 * out may equal x. */
void kern_rmsnorm(const float *x, const float *w, int n, double eps, bool plus_one,
                  float *out, float stats[3]);

/* RoPE tables for one position: cos/sin of pos * inv_freq[d] for d < D/2,
 * the angle formed in double. scale_kind/factors as config's rope scaling
 * (inv_freq already includes it: pass the precomputed inv_freq). */
void kern_rope_inv_freq(double theta, int head_dim, double *inv_freq /* D/2 */);
void kern_rope_table(double pos, const double *inv_freq, int head_dim,
                     float *cos_out, float *sin_out /* D/2 each */);
/* The same with cos and sin times mscale (YaRN's attention factor), the
 * product in double, rounded once; mscale 1 gives kern_rope_table's bits. */
void kern_rope_table_scaled(double pos, const double *inv_freq, int head_dim, double mscale,
                            float *cos_out, float *sin_out);

/* Applies RoPE scaling to inv_freq (half = D/2 values) in place, in double.
 * type as kv_rope_scale in config.h: 0 none, 1 linear (inv_freq / factor),
 * 2 llama3 (HF _compute_llama3_parameters: wavelengths beyond
 * original_max_position / low_freq_factor divided by factor, below
 * original_max_position / high_freq_factor kept, blended in between). */
void kern_rope_scale_inv_freq(double *inv_freq, int half, int type, double factor,
                              double low_freq_factor, double high_freq_factor,
                              int original_max_position);

/* YaRN (HF _compute_yarn_parameters) in place on half = D/2 inverse
 * frequencies of base theta: dims below the ramp keep theta^(-2d/D), dims
 * above it are divided by factor, the ramp between (from the dims where a
 * wavelength turns beta_fast, resp. beta_slow, times in original_max
 * positions; truncate rounds them down, resp. up) blends linearly. In
 * double. The attention factor (cos and sin times it) is the caller's. */
void kern_rope_yarn_inv_freq(double *inv_freq, int half, double theta, double factor,
                             double beta_fast, double beta_slow, int original_max,
                             bool truncate);

/* Attention sinks on M rows of H heads of D: with l a head's log-sum-exp
 * over its keys (lse) and s its sink logit, its output keeps
 * exp(l) / (exp(l) + exp(s)) of itself (none when it read no key), in
 * double, rounded once; share (may be NULL) receives the sink's part.
 * Rows whose skip[i] is set (skip may be NULL) keep no sink (share 0). */
void kern_attn_sinks(int M, int H, int D, const float *sinks, const float *lse, float *out,
                     float *share, const uint8_t *skip);

/* The indices of the k largest of v[0..n) by rank, ties to the lower
 * index (a mixture of experts' routing; the comparer reads a recording's
 * the same way). k <= n. */
void kern_top_k(const float *v, int n, int k, int *idx);

/* Rotate-half RoPE in place on n_heads heads of head_dim each:
 * out[d] = x[d] c - x[d+D/2] s, out[d+D/2] = x[d+D/2] c + x[d] s, formed in
 * double from the float tables and rounded to float once. */
void kern_rope_apply(float *x, int n_heads, int head_dim, const float *cos_t, const float *sin_t);

/* RoPE on interleaved pairs (2d, 2d + 1), d < pairs, of n_heads vectors
 * stride floats apart (x points at the first one's rotated part): MLA's key
 * tails. The same arithmetic as kern_rope_apply. */
void kern_rope_apply_pairs(float *x, int n_heads, int stride, int pairs, const float *cos_t,
                           const float *sin_t);

/* Gated activations, in place into gate: gate[i] = act(gate[i]) * up[i],
 * computed in double and rounded to float once.
 * SiLU: x / (1 + exp(-x)); GELU: the exact tanh form. */
/* x (n values) times the orthonormal Walsh-Hadamard matrix of size b
 * (Sylvester order, entries +-1/sqrt(b); its own inverse) block by block:
 * the rotation llama.cpp applies to a quantized KV cache. b a power of two
 * up to KERN_HADAMARD_MAX; a tail shorter than b is left as is. In double,
 * rounded once. */
#define KERN_HADAMARD_MAX 4096
void kern_hadamard_blocks(float *x, size_t n, int b);

void kern_silu_mul(float *gate, const float *up, int n);
void kern_gelu_tanh_mul(float *gate, const float *up, int n);

/* The same, gate = act(gate) * up over n values, split across c's pool
 * (each value is computed alone, so the split changes no bit). */
typedef enum { KERN_ACT_SILU = 0, KERN_ACT_GELU_TANH = 1 } kern_act;
void kern_act_mul(const kern_ctx *c, kern_act act, float *gate, const float *up, size_t n);

/* kern_rmsnorm over nrows rows of width values, rows split across c's
 * pool; stats (may be NULL) gets 3 values a row. */
void kern_rmsnorm_rows(const kern_ctx *c, const float *x, const float *w, int nrows, int width,
                       double eps, bool plus_one, float *out, float *stats);

/* Attention for M query rows.
 *   q     (M, H*D) queries (RoPE applied, not scaled)
 *   krow, vrow: pointers to key/value rows (KV*D floats each) in the order
 *               keys are visited (ascending absolute position)
 *   kbeg, kend: query row m attends keys krow[kbeg[m] .. kend[m]-1]
 *               (kend > kbeg; an empty range gives zeros and lse = -inf)
 *   out   (M, H*D), lse (M, H) natural-log sum of exp(scale q.k) per head
 * Query head h reads KV head h / (H / KV). Rows are split across threads. */
void kern_attention(const kern_ctx *c, int M, const float *q, int H, int KV, int D,
                    float scale, const float *const *krow, const float *const *vrow,
                    const int *kbeg, const int *kend, float *out, float *lse);

/* The same attention over one shared key list (nkeys rows, in ascending
 * position) where query row m reads key j iff mask[m * nkeys + j] != 0 —
 * the fixed-shape form runtimes use. Keys the mask keeps are visited in
 * list order, so it gives the same bits as kern_attention over the same
 * keys. A row with no key gives zeros and lse = -inf. Returns 0, or -1
 * when its gather space cannot be allocated. */
int kern_attention_masked(const kern_ctx *c, int M, const float *q, int H, int KV, int D,
                          float scale, const float *const *krow, const float *const *vrow,
                          int nkeys, const uint8_t *mask, float *out, float *lse);

/* Cascade attention's merge of two partial softmaxes over disjoint key
 * sets: (out, lse) and (out2, lse2), each (M, H) heads of D. In place into
 * out, lse: with mx = max(lse, lse2), wa = expf(lse - mx), wb = expf(lse2 - mx),
 * out = fmaf(out2, wb, out * wa) / (wa + wb), lse = mx + logf(wa + wb).
 * A side with lse = -inf (no key) contributes nothing. A different order
 * from one softmax over all keys: close to it, not bit-identical. */
void kern_lse_merge(int M, int H, int D, float *out, float *lse, const float *out2,
                    const float *lse2);

#endif
