/* mla.c — multi-head latent attention (mla.h). */
#include "mla.h"

#include <string.h>

/* The sizes every function here uses. */
typedef struct {
    int H, D, dr, R, W, nope, Dv, per;
} mla_dims;

static mla_dims dims_of(const kv_config *c)
{
    mla_dims d;
    d.H = c->n_heads;
    d.D = c->head_dim;
    d.dr = c->qk_rope_dim;
    d.R = c->kv_lora_rank;
    d.W = d.R + d.dr;
    d.nope = d.D - d.dr;
    d.Dv = c->v_head_dim;
    d.per = d.nope + d.Dv;
    return d;
}

void mla_attn_inputs(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                     const int64_t *rope_pos)
{
    const kv_config *c = &m->cfg;
    const model_layer *ly = &m->layers[layer];
    const mla_dims d = dims_of(c);

    if (c->q_lora_rank > 0) {
        kern_matmul(kc, &ly->wq_a, s->xn, n, s->mla_tmp);
        kern_rmsnorm_rows(kc, s->mla_tmp, ly->q_a_norm, n, c->q_lora_rank, c->rms_eps, false,
                          s->mla_tmp, NULL);
        kern_matmul(kc, &ly->wq, s->mla_tmp, n, s->q);
    } else {
        kern_matmul(kc, &ly->wq, s->xn, n, s->q);
    }
    kern_matmul(kc, &ly->wkv_a, s->xn, n, s->lat);
    for (int i = 0; i < n; i++) {
        float *row = s->lat + (size_t)i * d.W;
        kern_rmsnorm(row, ly->kv_a_norm, d.R, c->rms_eps, false, row, NULL);
        s->mla_rows[i] = row;
    }
    /* The q tails and the shared key tail, on interleaved pairs. */
    const int half = d.dr / 2;
    for (int i = 0; i < n; i++) {
        float *cs = s->rope_cos + (size_t)i * half, *sn = s->rope_sin + (size_t)i * half;
        if (s->rope_mscale_global == 1.0)
            kern_rope_table((double)rope_pos[i], s->inv_freq_global, d.dr, cs, sn);
        else
            kern_rope_table_scaled((double)rope_pos[i], s->inv_freq_global, d.dr,
                                   s->rope_mscale_global, cs, sn);
        kern_rope_apply_pairs(s->q + (size_t)i * d.H * d.D + d.nope, d.H, d.D, half, cs, sn);
        kern_rope_apply_pairs(s->lat + (size_t)i * d.W + d.R, 1, d.W, half, cs, sn);
    }
    mla_expand(kc, m, layer, (const float *const *)s->mla_rows, n, s->k, s->v, s->mla_tmp);
}

size_t mla_expand_scratch(const kv_config *c, int n)
{
    const mla_dims d = dims_of(c);
    return (size_t)n * ((size_t)d.R + (size_t)d.H * d.per);
}

void mla_expand(const kern_ctx *kc, const kv_model *m, int layer, const float *const *rows,
                int n, float *k, float *v, float *scratch)
{
    const mla_dims d = dims_of(&m->cfg);
    float *lat = scratch, *kv = scratch + (size_t)n * d.R;
    for (int j = 0; j < n; j++)
        memcpy(lat + (size_t)j * d.R, rows[j], (size_t)d.R * sizeof(float));
    kern_matmul(kc, &m->layers[layer].wkv_b, lat, n, kv);
    for (int j = 0; j < n; j++)
        for (int h = 0; h < d.H; h++) {
            const float *src = kv + ((size_t)j * d.H + h) * d.per;
            float *kd = k + ((size_t)j * d.H + h) * d.D, *vd = v + ((size_t)j * d.H + h) * d.D;
            memcpy(kd, src, (size_t)d.nope * sizeof(float));
            memcpy(kd + d.nope, rows[j] + d.R, (size_t)d.dr * sizeof(float));
            memcpy(vd, src + d.nope, (size_t)d.Dv * sizeof(float));
            memset(vd + d.Dv, 0, (size_t)(d.D - d.Dv) * sizeof(float));
        }
}

size_t mla_absorb_scratch(const kv_config *c, int n)
{
    const mla_dims d = dims_of(c);
    return (size_t)n * ((size_t)d.nope + d.R + d.Dv);
}

void mla_absorb_q(const kern_ctx *kc, const kv_model *m, int layer, const float *q, int n,
                  float *qa, float *scratch)
{
    const mla_dims d = dims_of(&m->cfg);
    const model_layer *ly = &m->layers[layer];
    float *g = scratch, *y = scratch + (size_t)n * d.nope;
    for (int h = 0; h < d.H; h++) {
        for (int j = 0; j < n; j++)
            memcpy(g + (size_t)j * d.nope, q + ((size_t)j * d.H + h) * d.D,
                   (size_t)d.nope * sizeof(float));
        kern_matmul(kc, &ly->uk_t[h], g, n, y);
        for (int j = 0; j < n; j++) {
            float *dst = qa + ((size_t)j * d.H + h) * d.W;
            memcpy(dst, y + (size_t)j * d.R, (size_t)d.R * sizeof(float));
            memcpy(dst + d.R, q + ((size_t)j * d.H + h) * d.D + d.nope,
                   (size_t)d.dr * sizeof(float));
        }
    }
}

void mla_absorb_out(const kern_ctx *kc, const kv_model *m, int layer, const float *o, int n,
                    float *att, float *scratch)
{
    const mla_dims d = dims_of(&m->cfg);
    const model_layer *ly = &m->layers[layer];
    float *g = scratch, *y = scratch + (size_t)n * d.R;
    for (int h = 0; h < d.H; h++) {
        for (int j = 0; j < n; j++)
            memcpy(g + (size_t)j * d.R, o + ((size_t)j * d.H + h) * d.W,
                   (size_t)d.R * sizeof(float));
        kern_matmul(kc, &ly->uv[h], g, n, y);
        for (int j = 0; j < n; j++) {
            float *dst = att + ((size_t)j * d.H + h) * d.D;
            memcpy(dst, y + (size_t)j * d.Dv, (size_t)d.Dv * sizeof(float));
            memset(dst + d.Dv, 0, (size_t)(d.D - d.Dv) * sizeof(float));
        }
    }
}

void mla_compact(const kv_config *c, float *x, int n)
{
    const mla_dims d = dims_of(c);
    for (int j = 0; j < n; j++)
        for (int h = 0; h < d.H; h++)
            memmove(x + ((size_t)j * d.H + h) * d.Dv, x + ((size_t)j * d.H + h) * d.D,
                    (size_t)d.Dv * sizeof(float));
}
