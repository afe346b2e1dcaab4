/* forward.c — one transformer layer as both engines compute it (see
 * forward.h). Row-independent: the engines differ only in their caches. */
#include "forward.h"
#include "mla.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ */
/* State                                                                */

int fw_state_init(fw_state *s, const kv_model *m, int cap, kv_err *e)
{
    const kv_config *c = &m->cfg;
    const size_t E = (size_t)c->hidden, QD = (size_t)config_max_q_width(c);
    const size_t KD = (size_t)config_max_kv_width(c);
    const size_t I = (size_t)(config_max_intermediate(c) > c->per_layer_dim
                                  ? config_max_intermediate(c) : c->per_layer_dim);
    const size_t half = (size_t)config_max_head_dim(c) / 2, H = (size_t)c->n_heads;
    const size_t n = (size_t)cap, P = (size_t)c->per_layer_dim, L = (size_t)c->n_layers;
    memset(s, 0, sizeof *s);
    s->cap = cap;
    s->x = malloc(n * E * sizeof(float));
    s->xn = malloc(n * E * sizeof(float));
    s->q = malloc(n * QD * sizeof(float));
    s->k = malloc(n * KD * sizeof(float));
    s->v = malloc(n * KD * sizeof(float));
    s->att = malloc(n * QD * sizeof(float));
    s->lse = malloc(n * H * sizeof(float));
    s->nkeys = malloc(n * H * sizeof(float));
    s->proj = malloc(n * E * sizeof(float));
    s->gate = malloc(n * I * sizeof(float));
    s->up = malloc(n * I * sizeof(float));
    s->stats = malloc(n * 3 * sizeof(float));
    s->rope_cos = malloc(n * half * sizeof(float));
    s->rope_sin = malloc(n * half * sizeof(float));
    s->inv_freq_local = malloc(half * sizeof(double));
    s->inv_freq_global = malloc(half * sizeof(double));
    if (c->attn_sinks && (!(s->sink = malloc(n * H * sizeof(float))) ||
                          !(s->sink_off = calloc(n, 1)))) {
        fw_state_free(s);
        return kv_errf(e, "out of memory for activations of %d rows", cap);
    }
    if (c->n_experts > 0) {
        const size_t X = (size_t)c->n_experts, K = (size_t)c->n_experts_used;
        s->moe_logits = malloc(n * X * sizeof(float));
        s->moe_in = malloc(n * (E > I ? E : I) * sizeof(float));
        s->moe_gu = malloc(n * 2 * I * sizeof(float));
        s->moe_y = malloc(n * K * E * sizeof(float));
        s->moe_w = malloc(n * K * sizeof(float));
        s->moe_x = malloc(n * K * sizeof(int));
        s->moe_rows = malloc(n * sizeof(int));
        if (!s->moe_logits || !s->moe_in || !s->moe_gu || !s->moe_y || !s->moe_w ||
            !s->moe_x || !s->moe_rows) {
            fw_state_free(s);
            return kv_errf(e, "out of memory for the experts' activations of %d rows", cap);
        }
    }
    if (c->n_experts > 0 && !(s->moe_sel = malloc(n * (size_t)c->n_experts * sizeof(float)))) {
        fw_state_free(s);
        return kv_errf(e, "out of memory for the experts' activations of %d rows", cap);
    }
    if (config_mla(c)) {
        size_t tmp = mla_expand_scratch(c, cap);
        if (tmp < n * (size_t)c->q_lora_rank)
            tmp = n * (size_t)c->q_lora_rank;
        s->lat = malloc(n * (size_t)config_mla_row(c) * sizeof(float));
        s->mla_rows = malloc(n * sizeof(float *));
        s->mla_tmp = malloc(tmp * sizeof(float));
        if (!s->lat || !s->mla_rows || !s->mla_tmp) {
            fw_state_free(s);
            return kv_errf(e, "out of memory for the latent attention of %d rows", cap);
        }
    }
    if (P > 0) {
        s->ple = malloc(n * L * P * sizeof(float));
        s->ple_l = malloc(n * P * sizeof(float));
        s->ple_tab = malloc(L * P * sizeof(float));
    }
    if (!s->x || !s->xn || !s->q || !s->k || !s->v || !s->att || !s->lse || !s->nkeys ||
        !s->proj || !s->gate || !s->up || !s->stats || !s->rope_cos || !s->rope_sin ||
        !s->inv_freq_local || !s->inv_freq_global || (P > 0 && (!s->ple || !s->ple_l || !s->ple_tab))) {
        fw_state_free(s);
        return kv_errf(e, "out of memory for activations of %d rows", cap);
    }
    /* Each layer type's frequencies and cos/sin multiplier (config.h). */
    config_rope_inv_freq(c, true, s->inv_freq_local);
    config_rope_inv_freq(c, false, s->inv_freq_global);
    s->rope_mscale_local = config_rope_mscale(c, true);
    s->rope_mscale_global = config_rope_mscale(c, false);
    return 0;
}

void fw_state_free(fw_state *s)
{
    if (!s)
        return;
    float *f[] = {s->x, s->xn, s->q, s->k, s->v, s->att, s->lse, s->nkeys, s->proj,
                  s->gate, s->up, s->stats, s->rope_cos, s->rope_sin, s->ple, s->ple_l, s->ple_tab};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++)
        free(f[i]);
    free(s->inv_freq_local);
    free(s->inv_freq_global);
    free(s->sink);
    free(s->sink_off);
    free(s->moe_logits);
    free(s->moe_in);
    free(s->moe_gu);
    free(s->moe_y);
    free(s->moe_w);
    free(s->moe_x);
    free(s->moe_rows);
    free(s->moe_sel);
    free(s->lat);
    free(s->mla_rows);
    free(s->mla_tmp);
    memset(s, 0, sizeof *s);
}

/* ------------------------------------------------------------------ */
/* Observer plumbing                                                    */

int fw_wants(kv_observer *obs, kv_stage st, int layer)
{
    if (!obs || !obs->emit)
        return 0;
    return obs->wants ? obs->wants(obs, st, layer) : 1;
}

int fw_emit(kv_observer *obs, kv_stage st, int layer, int64_t pos0, int n, int ncols,
            const float *data)
{
    if (!fw_wants(obs, st, layer))
        return 0;
    kv_event ev = {.stage = st, .layer = layer, .pos0 = pos0, .nrows = n,
                   .ncols = ncols, .data = data};
    return obs->emit(obs, &ev);
}

/* Emit and bail out when the observer asks to stop. */
#define EMIT(st, layer, ncols, data)                                           \
    do {                                                                       \
        if (fw_emit(obs, st, layer, pos0, n, ncols, data) != 0)                \
            return 1;                                                          \
    } while (0)

/* ------------------------------------------------------------------ */
/* Layer pieces                                                         */

static void norm_rows(const kern_ctx *kc, const kv_model *m, const float *in, const float *w,
                      int n, int width, float *out, float *stats)
{
    kern_rmsnorm_rows(kc, in, w, n, width, m->cfg.rms_eps, m->cfg.norm_plus_one, out, stats);
}

/* Gemma 4's per-layer inputs of n rows from their tokens and scaled
 * embeddings s->x: (table(token) * sqrt(P) + rmsnorm(proj(x) * E^-1/2))
 * * 2^-1/2, each layer's P values normalised apart. */
static void per_layer_inputs(const kern_ctx *kc, const kv_model *m, fw_state *s,
                             const int32_t *tokens, int n)
{
    const kv_config *c = &m->cfg;
    const int P = c->per_layer_dim, LP = P * c->n_layers;
    const float tab_scale = sqrtf((float)P);
    const float proj_scale = (float)(1.0 / sqrt((double)c->hidden));
    const float sum_scale = (float)M_SQRT1_2;
    kern_matmul(kc, &m->pl_model_proj, s->x, n, s->ple);
    for (int i = 0; i < n; i++) {
        float *row = s->ple + (size_t)i * LP;
        for (int j = 0; j < LP; j++)
            row[j] *= proj_scale;
        norm_rows(kc, m, row, m->pl_proj_norm, c->n_layers, P, row, NULL);
        /* Tokens past the per-layer vocabulary get no table row. */
        if (tokens[i] < c->per_layer_vocab)
            model_table_row(&m->pl_embed, tokens[i], s->ple_tab);
        else
            memset(s->ple_tab, 0, (size_t)LP * sizeof(float));
        for (int j = 0; j < LP; j++)
            row[j] = (row[j] + s->ple_tab[j] * tab_scale) * sum_scale;
    }
}

int fw_embed(const kern_ctx *kc, const kv_model *m, fw_state *s, const int32_t *tokens,
             int n, int64_t pos0, kv_observer *obs)
{
    const int E = m->cfg.hidden;
    const float scale = m->cfg.embed_scale;
    for (int i = 0; i < n; i++) {
        float *row = s->x + (size_t)i * E;
        kern_linear_get_row(&m->embed, tokens[i], row);
        if (scale != 1.0f)
            for (int j = 0; j < E; j++)
                row[j] *= scale;
    }
    if (m->cfg.per_layer_dim > 0)
        per_layer_inputs(kc, m, s, tokens, n);
    EMIT(STAGE_EMBED, -1, E, s->x);
    return 0;
}


static void rope_rows(const kv_model *m, int layer, fw_state *s, int n,
                      const int64_t *rope_pos, bool with_k)
{
    const kv_config *c = &m->cfg;
    const int D = config_layer_head_dim(c, layer), half = D / 2;
    const int KV = config_layer_kv_heads(c, layer);
    const bool sliding = c->layer_type[layer] == ATTN_SLIDING;
    const double *inv = sliding ? s->inv_freq_local : s->inv_freq_global;
    const double mscale = sliding ? s->rope_mscale_local : s->rope_mscale_global;
    for (int i = 0; i < n; i++) {
        float *cs = s->rope_cos + (size_t)i * half, *sn = s->rope_sin + (size_t)i * half;
        if (mscale == 1.0)
            kern_rope_table((double)rope_pos[i], inv, D, cs, sn);
        else
            kern_rope_table_scaled((double)rope_pos[i], inv, D, mscale, cs, sn);
        kern_rope_apply(s->q + (size_t)i * c->n_heads * D, c->n_heads, D, cs, sn);
        if (with_k)
            kern_rope_apply(s->k + (size_t)i * KV * D, KV, D, cs, sn);
    }
}

int fw_attn_inputs(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                   int64_t pos0, const int64_t *rope_pos, kv_observer *obs)
{
    const kv_config *c = &m->cfg;
    const model_layer *ly = &m->layers[layer];
    const int E = c->hidden, D = config_layer_head_dim(c, layer);
    const int KV = config_layer_kv_heads(c, layer);
    const bool owns = c->kv_owner[layer] == layer;

    EMIT(STAGE_X_IN, layer, E, s->x);
    norm_rows(kc, m, s->x, ly->attn_norm, n, E, s->xn, s->stats);
    EMIT(STAGE_ATTN_NORM_STATS, layer, 3, s->stats);
    EMIT(STAGE_ATTN_NORM, layer, E, s->xn);
    if (config_mla(c)) {
        /* q, the cache row, the expanded keys; the values packed to
         * v_head_dim in s->att (free until attention) to be emitted */
        mla_attn_inputs(kc, m, layer, s, n, rope_pos);
        EMIT(STAGE_Q, layer, c->n_heads * D, s->q);
        EMIT(STAGE_KV_LATENT, layer, config_mla_row(c), s->lat);
        EMIT(STAGE_K, layer, c->n_heads * D, s->k);
        if (fw_wants(obs, STAGE_V, layer)) {
            memcpy(s->att, s->v, (size_t)n * c->n_heads * D * sizeof(float));
            mla_compact(c, s->att, n);
            EMIT(STAGE_V, layer, c->n_heads * c->v_head_dim, s->att);
        }
        return 0;
    }

    kern_matmul(kc, &ly->wq, s->xn, n, s->q);
    if (owns) {
        kern_matmul(kc, &ly->wk, s->xn, n, s->k);
        /* Gemma 4's K=V layers: v is k's projection, before k_norm. */
        if (config_layer_has_v_proj(c, layer))
            kern_matmul(kc, &ly->wv, s->xn, n, s->v);
        else
            memcpy(s->v, s->k, (size_t)n * KV * D * sizeof(float));
        if (c->v_norm)
            kern_rmsnorm_rows(kc, s->v, NULL, n * KV, D, c->rms_eps, false, s->v, NULL);
    }
    if (c->qk_norm) {
        /* q_norm / k_norm normalise each head's D values. */
        norm_rows(kc, m, s->q, ly->q_norm, n * c->n_heads, D, s->q, NULL);
        if (owns)
            norm_rows(kc, m, s->k, ly->k_norm, n * KV, D, s->k, NULL);
    }
    rope_rows(m, layer, s, n, rope_pos, owns);
    EMIT(STAGE_Q, layer, c->n_heads * D, s->q);
    if (owns) {
        EMIT(STAGE_K, layer, KV * D, s->k);
        EMIT(STAGE_V, layer, KV * D, s->v);
    }
    return 0;
}

int fw_attn_emit(const kv_model *m, int layer, fw_state *s, int n, int64_t pos0,
                 const int *nkeys, kv_observer *obs)
{
    const int H = m->cfg.n_heads;
    /* The sink as one more logit in each head's softmax (rows an engine's
     * injected bug marks keep none). */
    if (m->cfg.attn_sinks)
        kern_attn_sinks(n, H, config_layer_head_dim(&m->cfg, layer), m->layers[layer].sinks,
                        s->lse, s->att, s->sink, s->sink_off_any ? s->sink_off : NULL);
    EMIT(STAGE_ATTN_LSE, layer, H, s->lse);
    if (fw_wants(obs, STAGE_ATTN_NKEYS, layer)) {
        for (int i = 0; i < n; i++)
            for (int h = 0; h < H; h++)
                s->nkeys[(size_t)i * H + h] = (float)nkeys[i];
        EMIT(STAGE_ATTN_NKEYS, layer, H, s->nkeys);
    }
    if (m->cfg.attn_sinks)
        EMIT(STAGE_ATTN_SINK, layer, H, s->sink);
    /* MLA's heads come out padded to the keys' width: packed to Dv. */
    if (config_mla(&m->cfg))
        mla_compact(&m->cfg, s->att, n);
    EMIT(STAGE_ATTN_OUT, layer, H * config_layer_v_head_dim(&m->cfg, layer), s->att);
    return 0;
}

static void add_rows(float *x, const float *y, size_t count)
{
    for (size_t i = 0; i < count; i++)
        x[i] = x[i] + y[i];
}

/* Gemma 4's per-layer input block: x += norm(proj(gelu(gate(x)) * ple_l)). */
static int per_layer_block(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s,
                           int n, int64_t pos0, kv_observer *obs)
{
    const kv_config *c = &m->cfg;
    const model_layer *ly = &m->layers[layer];
    const int E = c->hidden, P = c->per_layer_dim, LP = P * c->n_layers;
    for (int i = 0; i < n; i++)
        memcpy(s->ple_l + (size_t)i * P, s->ple + (size_t)i * LP + (size_t)layer * P,
               (size_t)P * sizeof(float));
    EMIT(STAGE_PLE_IN, layer, P, s->ple_l);
    kern_matmul(kc, &ly->w_pl_gate, s->x, n, s->gate);
    kern_act_mul(kc, KERN_ACT_GELU_TANH, s->gate, s->ple_l, (size_t)n * P);
    kern_matmul(kc, &ly->w_pl_proj, s->gate, n, s->proj);
    norm_rows(kc, m, s->proj, ly->pl_norm, n, E, s->proj, NULL);
    EMIT(STAGE_PLE_OUT, layer, E, s->proj);
    add_rows(s->x, s->proj, (size_t)n * E);
    return 0;
}

/* gpt-oss's gated unit on one gate_up row of 2I interleaved values:
 * g = min(gate, limit), u = clamp(up, -limit, limit),
 * out = g sigmoid(1.702 g) (u + 1), in double, rounded once. */
static void oai_swiglu(const float *gu, int I, double limit, float *out)
{
    for (int j = 0; j < I; j++) {
        double g = gu[2 * j], u = gu[2 * j + 1];
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : u > limit ? limit : u;
        out[j] = (float)(g / (1.0 + exp(-1.702 * g)) * (u + 1.0));
    }
}

/* Group-limited choice (DeepSeek): the experts in n_group groups of
 * X / n_group; a group's score is its best selection score (softmax
 * routing) or the sum of its best two (sigmoid routing); only the
 * topk_group best groups' experts stay, the others' set to -inf, as
 * DeepSeek's own inference code and llama.cpp mask them. (transformers
 * masks them to 0: the same unless a kept group's corrected scores,
 * sigmoid + bias, fall below 0, when it can pick a dropped group's expert;
 * llama.cpp's export of tiny-deepseek-v3 differs from a 0 mask at layer
 * 2.) */
void fw_route_groups(const kv_config *c, const float *sel, float *gs)
{
    const int G = c->n_group, per = c->n_experts / G;
    for (int g = 0; g < G; g++) {
        const float *v = sel + (size_t)g * per;
        if (c->route == ROUTE_SIGMOID && per >= 2) {
            int top[2];
            kern_top_k(v, per, 2, top);
            gs[g] = v[top[0]] + v[top[1]];
        } else {
            int top;
            kern_top_k(v, per, 1, &top);
            gs[g] = v[top];
        }
    }
}

void fw_route_choose(const kv_config *c, const float *sel, int *idx)
{
    const int X = c->n_experts, K = c->n_experts_used;
    if (c->n_group <= 0) {
        kern_top_k(sel, X, K, idx);
        return;
    }
    const int G = c->n_group, per = X / G;
    float masked[X], gs[G];
    int gi[G];
    fw_route_groups(c, sel, gs);
    kern_top_k(gs, G, c->topk_group, gi);
    for (int g = 0; g < G; g++) {
        bool kept = false;
        for (int t = 0; t < c->topk_group; t++)
            kept |= gi[t] == g;
        for (int j = 0; j < per; j++)
            masked[g * per + j] = kept ? sel[g * per + j] : -INFINITY;
    }
    kern_top_k(masked, X, K, idx);
}

/* Row i's selection row (s->moe_sel) from its router logits: the logits
 * themselves (gpt-oss; DeepSeek-V2, whose softmax keeps their order), or
 * sigmoid(logit) + e_score_correction_bias (DeepSeek-V3). What the
 * router_logits stage records: what the experts are chosen by. */
static void route_select_row(const kv_config *c, const model_layer *ly, fw_state *s, int i)
{
    const int X = c->n_experts;
    const float *lg = s->moe_logits + (size_t)i * X;
    float *sel = s->moe_sel + (size_t)i * X;
    for (int x = 0; x < X; x++)
        sel[x] = c->route != ROUTE_SIGMOID ? lg[x]
                 : (float)(1.0 / (1.0 + exp(-(double)lg[x]))) +
                   (ly->router_sel_bias ? ly->router_sel_bias[x] : 0.0f);
}

/* Row i's experts (s->moe_x, by fw_route_choose on its selection row, or
 * on `followed`, another run's, when given) and weights (s->moe_w, from
 * this row's own router logits):
 *   gpt-oss   the chosen logits softmaxed among themselves;
 *   softmax   (DeepSeek-V2) their softmax over all experts, normalised
 *             (norm_topk) or times routed_scale;
 *   sigmoid   (DeepSeek-V3) their sigmoid scores (without the bias),
 *             normalised when norm_topk, times routed_scale.
 * In double, rounded to float as the frameworks keep them. */
static void route_row(const kv_config *c, fw_state *s, int i, const float *followed)
{
    const int X = c->n_experts, K = c->n_experts_used;
    const float *lg = s->moe_logits + (size_t)i * X;
    int *ix = s->moe_x + (size_t)i * K;
    float *w = s->moe_w + (size_t)i * K;
    fw_route_choose(c, followed ? followed : s->moe_sel + (size_t)i * X, ix);
    if (c->route == ROUTE_TOPK_SOFTMAX) {
        double sum = 0, mx = lg[ix[0]];
        for (int r = 0; r < K; r++)
            sum += exp((double)lg[ix[r]] - mx);
        for (int r = 0; r < K; r++)
            w[r] = (float)(exp((double)lg[ix[r]] - mx) / sum);
        return;
    }
    float score[K];
    if (c->route == ROUTE_SOFTMAX) {
        double mx = lg[0], all = 0;
        for (int x = 1; x < X; x++)
            mx = lg[x] > mx ? lg[x] : mx;
        for (int x = 0; x < X; x++)
            all += exp((double)lg[x] - mx);
        for (int r = 0; r < K; r++)
            score[r] = (float)(exp((double)lg[ix[r]] - mx) / all);
    } else {
        for (int r = 0; r < K; r++)
            score[r] = (float)(1.0 / (1.0 + exp(-(double)lg[ix[r]])));
    }
    double sum = 0;
    for (int r = 0; r < K; r++)
        sum += score[r];
    const bool norm = c->norm_topk && (c->route == ROUTE_SIGMOID || K > 1);
    for (int r = 0; r < K; r++) {
        double v = score[r];
        if (norm)
            v /= sum + 1e-20;
        if (c->route == ROUTE_SIGMOID || !norm)
            v *= c->routed_scale;
        w[r] = (float)v;
    }
}

/* The followed run's selection row of (layer, pos) (kvdiff run --follow),
 * or NULL: none recorded there, or one holding a non-finite value. */
static const float *followed_row(const kv_route_rows *f, int layer, int64_t pos)
{
    if (!f || layer >= f->n_layers || !f->rows[layer] || pos < f->first[layer] ||
        pos >= f->first[layer] + f->n[layer])
        return NULL;
    const float *row = f->rows[layer] + (size_t)(pos - f->first[layer]) * f->X;
    for (int x = 0; x < f->X; x++)
        if (!isfinite(row[x]))
            return NULL;
    return row;
}

/* The mixture of experts on s->xn (n rows) into s->proj. Each row's
 * experts and weights as route_row says; each expert runs once on the
 * rows that chose it, gathered (the kernels' rows are independent, so a
 * row's bits do not depend on which rows share its expert); each row then
 * sums its experts' outputs by rank with fmaf. An expert is gpt-oss's
 * (gate and up interleaved, biased, its clamped SwiGLU) or DeepSeek's
 * (gate rows then up rows, SiLU). */
static int moe_block(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                     int64_t pos0, kv_observer *obs)
{
    const kv_config *c = &m->cfg;
    const model_layer *ly = &m->layers[layer];
    const int E = c->hidden, X = c->n_experts, K = c->n_experts_used;
    const int I = config_layer_intermediate(c, layer);
    const bool oai = c->route == ROUTE_TOPK_SOFTMAX;
    kern_matmul(kc, &ly->router, s->xn, n, s->moe_logits);
    for (int i = 0; i < n; i++)
        route_select_row(c, ly, s, i);
    EMIT(STAGE_ROUTER_LOGITS, layer, X, s->moe_sel);
    for (int i = 0; i < n; i++)
        route_row(c, s, i, followed_row(m->route_follow, layer, pos0 + i));
    for (int x = 0; x < X; x++) {
        int rows = 0;
        for (int slot = 0; slot < n * K; slot++)
            if (s->moe_x[slot] == x) {
                s->moe_rows[rows] = slot;
                memcpy(s->moe_in + (size_t)rows * E, s->xn + (size_t)(slot / K) * E,
                       (size_t)E * sizeof(float));
                rows++;
            }
        if (rows == 0)
            continue;
        kern_matmul(kc, &ly->gate_up[x], s->moe_in, rows, s->moe_gu);
        for (int r = 0; r < rows; r++) {  /* the unit's output overwrites its input rows */
            float *gu = s->moe_gu + (size_t)r * 2 * I;
            if (oai) {
                oai_swiglu(gu, I, c->swiglu_limit, s->moe_in + (size_t)r * I);
            } else {
                kern_silu_mul(gu, gu + I, I);
                memcpy(s->moe_in + (size_t)r * I, gu, (size_t)I * sizeof(float));
            }
        }
        for (int r = 0; r < rows; r++)   /* packed to (rows, I) */
            memmove(s->moe_gu + (size_t)r * I, s->moe_in + (size_t)r * I,
                    (size_t)I * sizeof(float));
        kern_matmul(kc, &ly->down[x], s->moe_gu, rows, s->moe_in);
        for (int r = 0; r < rows; r++)
            memcpy(s->moe_y + (size_t)s->moe_rows[r] * E, s->moe_in + (size_t)r * E,
                   (size_t)E * sizeof(float));
    }
    for (int i = 0; i < n; i++) {
        float *out = s->proj + (size_t)i * E;
        for (int j = 0; j < E; j++) {
            float acc = 0.0f;
            for (int r = 0; r < K; r++)
                acc = fmaf(s->moe_w[(size_t)i * K + r],
                           s->moe_y[((size_t)i * K + r) * E + j], acc);
            out[j] = acc;
        }
    }
    return 0;
}

/* The dense MLP on s->xn: down(act(gate) * up), width I, into out. */
static void dense_mlp(const kern_ctx *kc, const kv_model *m, const model_layer *ly, fw_state *s,
                      int n, int I, float *out)
{
    kern_matmul(kc, &ly->w_gate, s->xn, n, s->gate);
    kern_matmul(kc, &ly->w_up, s->xn, n, s->up);
    kern_act_mul(kc, m->cfg.act == ACT_GELU_TANH ? KERN_ACT_GELU_TANH : KERN_ACT_SILU, s->gate,
                 s->up, (size_t)n * I);
    kern_matmul(kc, &ly->w_down, s->gate, n, out);
}

int fw_layer_finish(const kern_ctx *kc, const kv_model *m, int layer, fw_state *s, int n,
                    int64_t pos0, kv_observer *obs)
{
    const kv_config *c = &m->cfg;
    const model_layer *ly = &m->layers[layer];
    const int E = c->hidden, I = config_layer_dense_width(c, layer);

    kern_matmul(kc, &ly->wo, s->att, n, s->proj);
    if (c->sandwich_norms)
        norm_rows(kc, m, s->proj, ly->post_attn_norm, n, E, s->proj, NULL);
    EMIT(STAGE_ATTN_PROJ, layer, E, s->proj);
    add_rows(s->x, s->proj, (size_t)n * E);
    EMIT(STAGE_H_MID, layer, E, s->x);

    norm_rows(kc, m, s->x, ly->ffn_norm, n, E, s->xn, s->stats);
    EMIT(STAGE_FFN_NORM_STATS, layer, 3, s->stats);
    EMIT(STAGE_FFN_NORM, layer, E, s->xn);
    if (config_layer_moe(c, layer)) {
        if (moe_block(kc, m, layer, s, n, pos0, obs))
            return 1;
        /* DeepSeek's shared experts: one dense MLP on every row, added. */
        const int S = config_layer_dense_width(c, layer);
        if (S > 0) {
            dense_mlp(kc, m, ly, s, n, S, s->moe_in);
            add_rows(s->proj, s->moe_in, (size_t)n * E);
        }
    } else {
        dense_mlp(kc, m, ly, s, n, I, s->proj);
    }
    if (c->sandwich_norms)
        norm_rows(kc, m, s->proj, ly->post_ffn_norm, n, E, s->proj, NULL);
    EMIT(STAGE_FFN_OUT, layer, E, s->proj);
    add_rows(s->x, s->proj, (size_t)n * E);
    if (c->per_layer_dim > 0 && per_layer_block(kc, m, layer, s, n, pos0, obs))
        return 1;
    if (c->layer_scalar) {
        const float g = ly->layer_scalar[0];
        for (size_t i = 0; i < (size_t)n * E; i++)
            s->x[i] *= g;
    }
    EMIT(STAGE_X_OUT, layer, E, s->x);
    return 0;
}

int fw_logits(const kern_ctx *kc, const kv_model *m, fw_state *s, int row0, int n,
              int64_t pos0, float *logits, kv_observer *obs)
{
    const kv_config *c = &m->cfg;
    const int E = c->hidden;
    float *xn = s->xn + (size_t)row0 * E;
    norm_rows(kc, m, s->x + (size_t)row0 * E, m->final_norm, n, E, xn, NULL);
    EMIT(STAGE_FINAL_NORM, -1, E, xn);
    kern_matmul(kc, model_lm_head(m), xn, n, logits);
    if (c->final_softcap > 0) {
        const double cap = c->final_softcap;
        for (size_t i = 0; i < (size_t)n * c->vocab; i++)
            logits[i] = (float)(cap * tanh((double)logits[i] / cap));
    }
    EMIT(STAGE_LOGITS, -1, c->vocab, logits);
    return 0;
}
