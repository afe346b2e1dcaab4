/* mla.h — multi-head latent attention (DeepSeek-V2/V3), the pieces both
 * engines share.
 *
 * A layer's input x gives, per row: q (H heads of D = nope + dr, the
 * tails rotated), and the cache row: the latent (R = kv_lora_rank, after
 * kv_a_layernorm) followed by one key tail (dr, rotated) that every head
 * shares. Attention can then run two ways over the same cache rows:
 *
 *   expanded  each cached row through kv_b_proj into H keys [k_nope, tail]
 *             and H values (Dv): ordinary attention of H heads of D, the
 *             values padded with zeros to D (a zero adds nothing, exactly),
 *             the output sliced back to Dv. What transformers computes, and
 *             both engines' default: the reference expands each row once,
 *             the chunked engine expands its cached latents per chunk, the
 *             same rows through the same kernel, so the bits agree.
 *   absorbed  kv_b_proj folded into the query and the output: each head's
 *             q_nope through its key part turned (R), the tail appended,
 *             attention over the latent rows themselves (one KV head of
 *             R + dr, the latent as value), each head's output through its
 *             value part. What llama.cpp and most ports run in decode: the
 *             same scores, another rounding.
 *
 * Every function is row-independent and emits nothing (forward.c does). */
#ifndef KV_MLA_H
#define KV_MLA_H

#include "forward.h"

/* An MLA layer's attention inputs from s->xn (the input norm's output):
 * s->q, s->lat (n rows of R + dr), s->k (n, H*D) and s->v (n, H*D, each
 * head's Dv values then zeros). fw_attn_inputs emits them. */
void mla_attn_inputs(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                     const int64_t *rope_pos);

/* Floats of scratch mla_expand needs for n rows. */
size_t mla_expand_scratch(const kv_config *c, int n);
/* Keys and padded values (n, H*D each) of n cache rows (R + dr floats
 * each, at rows[j]). */
void mla_expand(const kern_ctx *kc, const kv_model *m, int layer, const float *const *rows,
                int n, float *k, float *v, float *scratch);

/* The absorbed form. Floats of scratch either step needs for n rows. */
size_t mla_absorb_scratch(const kv_config *c, int n);
/* q (n, H*D) -> qa (n, H*(R + dr)). */
void mla_absorb_q(const kern_ctx *kc, const kv_model *m, int layer, const float *q, int n,
                  float *qa, float *scratch);
/* Attention output over latent rows o (n, H*(R + dr); the first R of each
 * head count) -> att (n, H*D: each head's Dv values, then zeros). */
void mla_absorb_out(const kern_ctx *kc, const kv_model *m, int layer, const float *o, int n,
                    float *att, float *scratch);

/* Each head's Dv values packed in place: (n, H*D) -> (n, H*Dv). */
void mla_compact(const kv_config *c, float *x, int n);

#endif
