/* check_double_forward.c — an independent double-precision forward pass.
 *
 * A deliberately plain transformer forward, written here from the Hugging
 * Face definitions of Llama, Qwen2, Qwen3 and Gemma 3 (see the conformance
 * README), sharing no kernel with the engines: weights come straight from
 * the tensor catalogue and the synthetic generator, every sum is a plain
 * double loop. For every tiny preset (and Llama/Qwen3 with attention_bias,
 * Llama with linear RoPE scaling) and a prompt longer than the sliding
 * window, the reference engine's q, k, attention output and residual of
 * every layer, its final norm and its logits must agree with this forward
 * within 1e-5 relative (max |diff| / max |ours| over the whole tensor).
 * Negative controls show the comparison does catch a wrong window, llama3
 * RoPE scaling left out, Qwen3's q/k norms read as Gemma's 1 + w, and a
 * missing o_proj bias. */
#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "reference/reference.h"
#include "testutil.h"

static const char *const tiny_presets[] = {"tiny-llama", "tiny-llama3", "tiny-qwen2",
                                           "tiny-qwen3", "tiny-gemma3", "tiny-gemma3-kvshared"};
#define N_TINY (int)(sizeof tiny_presets / sizeof *tiny_presets)
#define PROMPT_LEN 40        /* longer than every tiny preset's window */
#define TOLERANCE 1e-5       /* the conformance README's float32 engine bound */
#define CONTROL_MIN_ERR 1e-3 /* a wrong window must move x_out at least this far */

/* ------------------------------------------------------------------ */
/* Weights in double, row-major as Hugging Face stores them            */

/* One decoder layer; W matrices are (out, in) and y = W x (+ b). K/V
 * projections and k_norm are NULL on KV-shared followers. */
typedef struct {
    double *input_norm;      /* (E) input_layernorm */
    double *mlp_norm;        /* (E) MLP input: post_attention_layernorm (Llama, Qwen2)
                                or pre_feedforward_layernorm (Gemma 3) */
    double *post_attn_norm;  /* (E) Gemma 3: on the o_proj output */
    double *post_mlp_norm;   /* (E) Gemma 3: on the MLP output */
    double *q_norm, *k_norm; /* (D) Gemma 3 (1 + w), Qwen3 (w) */
    double *wq, *wk, *wv, *wo;
    double *bq, *bk, *bv;    /* Qwen2; Llama and Qwen3 with attention_bias */
    double *bo;              /* Llama and Qwen3 with attention_bias */
    double *w_gate, *w_up, *w_down;
} dlayer;

typedef struct {
    kv_config cfg;
    double *embed;           /* (V, E) */
    double *lm_head;         /* (V, E), NULL when tied to embed */
    double *final_norm;      /* (E) */
    dlayer *layers;          /* (L) */
    double **owned;          /* every tensor above, for freeing */
    int n_owned;
} dmodel;

/* The slot of layer tensor `role` (the name after "layers.<i>."). */
static double **layer_slot(dlayer *ly, const char *role, bool sandwich)
{
    static const struct {
        const char *role;
        size_t off;
    } roles[] = {
        {"input_layernorm.weight", offsetof(dlayer, input_norm)},
        {"pre_feedforward_layernorm.weight", offsetof(dlayer, mlp_norm)},
        {"post_feedforward_layernorm.weight", offsetof(dlayer, post_mlp_norm)},
        {"self_attn.q_norm.weight", offsetof(dlayer, q_norm)},
        {"self_attn.k_norm.weight", offsetof(dlayer, k_norm)},
        {"self_attn.q_proj.weight", offsetof(dlayer, wq)},
        {"self_attn.k_proj.weight", offsetof(dlayer, wk)},
        {"self_attn.v_proj.weight", offsetof(dlayer, wv)},
        {"self_attn.o_proj.weight", offsetof(dlayer, wo)},
        {"self_attn.q_proj.bias", offsetof(dlayer, bq)},
        {"self_attn.k_proj.bias", offsetof(dlayer, bk)},
        {"self_attn.v_proj.bias", offsetof(dlayer, bv)},
        {"self_attn.o_proj.bias", offsetof(dlayer, bo)},
        {"mlp.gate_proj.weight", offsetof(dlayer, w_gate)},
        {"mlp.up_proj.weight", offsetof(dlayer, w_up)},
        {"mlp.down_proj.weight", offsetof(dlayer, w_down)},
    };
    /* Gemma's post_attention_layernorm normalizes the attention output;
     * in Llama/Qwen2 the same name is the MLP's input norm. */
    if (strcmp(role, "post_attention_layernorm.weight") == 0)
        return sandwich ? &ly->post_attn_norm : &ly->mlp_norm;
    for (size_t i = 0; i < sizeof roles / sizeof *roles; i++)
        if (strcmp(role, roles[i].role) == 0)
            return (double **)((char *)ly + roles[i].off);
    return NULL;
}

/* The slot a catalogue tensor goes to, by its Hugging Face name. */
static double **tensor_slot(dmodel *dm, const tensor_spec *s)
{
    const kv_config *c = &dm->cfg;
    char want[200];
    if (s->layer < 0) {
        snprintf(want, sizeof want, "%sembed_tokens.weight", c->tensor_prefix);
        if (strcmp(s->name, want) == 0)
            return &dm->embed;
        snprintf(want, sizeof want, "%snorm.weight", c->tensor_prefix);
        if (strcmp(s->name, want) == 0)
            return &dm->final_norm;
        if (strcmp(s->name, c->lm_head_name) == 0)
            return &dm->lm_head;
        return NULL;
    }
    snprintf(want, sizeof want, "%slayers.%d.", c->tensor_prefix, s->layer);
    size_t n = strlen(want);
    if (s->layer >= c->n_layers || strncmp(s->name, want, n) != 0)
        return NULL;
    return layer_slot(&dm->layers[s->layer], s->name + n, c->sandwich_norms);
}

/* Draws every tensor of config cfg with seed 0 (the weights
 * model_from_config(cfg, ..., 0, ...) builds) and widens them to double. */
static void dmodel_build_config(const char *name, const kv_config *cfg, dmodel *dm)
{
    memset(dm, 0, sizeof *dm);
    dm->cfg = *cfg;
    const kv_config *c = &dm->cfg;
    int n = tensors_list(c, NULL, 0);
    ck_assert_int_gt(n, 0);
    tensor_spec *specs = calloc((size_t)n, sizeof *specs);
    ck_assert_ptr_nonnull(specs);
    ck_assert_int_eq(tensors_list(c, specs, n), n);
    dm->layers = calloc((size_t)c->n_layers, sizeof *dm->layers);
    dm->owned = calloc((size_t)n, sizeof *dm->owned);
    ck_assert(dm->layers && dm->owned);
    for (int i = 0; i < n; i++) {
        const tensor_spec *s = &specs[i];
        size_t count = (size_t)s->shape[0] * (size_t)(s->ndim == 2 ? s->shape[1] : 1);
        float *f = malloc(count * sizeof *f);
        double *d = malloc(count * sizeof *d);
        ck_assert(f && d);
        synth_tensor(c, s, 0, f);
        for (size_t k = 0; k < count; k++)
            d[k] = f[k];
        free(f);
        dm->owned[dm->n_owned++] = d;
        double **slot = tensor_slot(dm, s);
        ck_assert_msg(slot != NULL, "%s: tensor '%s' has no role in the double forward",
                      name, s->name);
        ck_assert_msg(*slot == NULL, "%s: tensor '%s' listed twice", name, s->name);
        *slot = d;
    }
    free(specs);
}

/* The same for preset `name` (model_from_preset(name, 0, ...)). */
static void dmodel_build(const char *name, dmodel *dm)
{
    kv_config c;
    kv_err e = {{0}};
    ck_assert_msg(config_preset(name, &c, &e) == 0, "%s", e.msg);
    dmodel_build_config(name, &c, dm);
}

static void dmodel_free(dmodel *dm)
{
    for (int i = 0; i < dm->n_owned; i++)
        free(dm->owned[i]);
    free(dm->owned);
    free(dm->layers);
    memset(dm, 0, sizeof *dm);
}

/* ------------------------------------------------------------------ */
/* The forward pass, in double                                          */

/* What the comparison needs, each (T, cols) row-major; k and v are NULL
 * for layers that read another layer's cache. */
typedef struct {
    int T, L;
    double **q, **k, **v, **attn, **x_out; /* (L) each */
    double *final_norm;                    /* (T, E) */
    double *logits;                        /* (T, V) */
} dresult;

static double *dalloc(size_t n)
{
    double *p = calloc(n, sizeof *p);
    ck_assert_ptr_nonnull(p);
    return p;
}

static void dresult_free(dresult *r)
{
    for (int l = 0; l < r->L; l++) {
        free(r->q[l]);
        free(r->k[l]);
        free(r->v[l]);
        free(r->attn[l]);
        free(r->x_out[l]);
    }
    free(r->q);
    free(r->k);
    free(r->v);
    free(r->attn);
    free(r->x_out);
    free(r->final_norm);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

/* y (n_out) = W x (+ b), W (n_out, n_in). */
static void linear(const double *W, const double *b, const double *x, int n_out, int n_in,
                   double *y)
{
    for (int o = 0; o < n_out; o++) {
        double s = 0;
        for (int i = 0; i < n_in; i++)
            s += W[(size_t)o * n_in + i] * x[i];
        y[o] = b ? s + b[o] : s;
    }
}

/* HF RMSNorm: x / sqrt(mean(x^2) + eps) * w (Gemma: * (1 + w)). */
static void rmsnorm(const double *x, const double *w, int n, double eps, bool plus_one,
                    double *out)
{
    double ss = 0;
    for (int i = 0; i < n; i++)
        ss += x[i] * x[i];
    double inv = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * inv * (plus_one ? 1.0 + w[i] : w[i]);
}

/* Rotate-half RoPE at position pos on n_heads heads of D: pairs (d, d + D/2). */
static void rope(double *x, int n_heads, int D, double pos, const double *inv_freq)
{
    for (int h = 0; h < n_heads; h++) {
        double *v = x + (size_t)h * D;
        for (int d = 0; d < D / 2; d++) {
            double a = pos * inv_freq[d];
            double lo = v[d], hi = v[d + D / 2];
            v[d] = lo * cos(a) - hi * sin(a);
            v[d + D / 2] = hi * cos(a) + lo * sin(a);
        }
    }
}

static double act(kv_act kind, double x)
{
    if (kind == ACT_SILU)
        return x / (1.0 + exp(-x));
    /* gelu_pytorch_tanh */
    const double k = sqrt(2.0 / M_PI);
    return 0.5 * x * (1.0 + tanh(k * (x + 0.044715 * x * x * x)));
}

static bool layer_slides(const kv_config *c, int l, bool window_off)
{
    return !window_off && c->layer_type[l] == ATTN_SLIDING;
}

/* transformers' modeling_rope_utils._compute_llama3_parameters, written
 * out: wavelengths longer than original_max / low_freq_factor are slowed
 * by factor, shorter than original_max / high_freq_factor kept, and in
 * between blended with smooth = (original_max / wavelen - low) / (high -
 * low). Its attention factor is 1 (cos/sin unscaled). */
static void llama3_scale(const kv_rope_scaling *s, int half, double *inv_freq)
{
    const double old_len = s->original_max_position;
    const double low_wavelen = old_len / s->low_freq_factor;
    const double high_wavelen = old_len / s->high_freq_factor;
    for (int d = 0; d < half; d++) {
        double wavelen = 2.0 * M_PI / inv_freq[d];
        double slowed = wavelen > low_wavelen ? inv_freq[d] / s->factor : inv_freq[d];
        double smooth = (old_len / wavelen - s->low_freq_factor) /
                        (s->high_freq_factor - s->low_freq_factor);
        double blended = (1 - smooth) * slowed / s->factor + smooth * slowed;
        bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
        inv_freq[d] = medium ? blended : slowed;
    }
}

/* inv_freq[d] = theta^(-2d/D): local base on sliding layers, global base
 * (with linear or llama3 scaling, if any) on full-attention layers. The
 * base follows the layer's type in the config even when the window is
 * switched off. */
static void layer_inv_freq(const kv_config *c, int l, double *inv_freq)
{
    bool sliding = c->layer_type[l] == ATTN_SLIDING;
    double theta = sliding ? c->rope_local_theta : c->rope_theta;
    int D = c->head_dim;
    for (int d = 0; d < D / 2; d++) {
        inv_freq[d] = pow(theta, -(2.0 * d) / D);
        if (!sliding && c->rope_scaling.type == ROPE_SCALE_LINEAR)
            inv_freq[d] /= c->rope_scaling.factor;
    }
    if (!sliding && c->rope_scaling.type == ROPE_SCALE_LLAMA3)
        llama3_scale(&c->rope_scaling, D / 2, inv_freq);
}

/* Causal softmax attention of every position over keys k/v (T, KV*D),
 * query head h reading KV head h / (H / KV); key j is visible to query i
 * iff j <= i and, on sliding layers, j > i - W. */
static void attention(const kv_config *c, int T, bool sliding, const double *q,
                      const double *k, const double *v, double *out)
{
    const int H = c->n_heads, KV = c->n_kv_heads, D = c->head_dim;
    const int group = H / KV;
    double *p = dalloc((size_t)T);
    for (int i = 0; i < T; i++) {
        int j0 = sliding ? i - c->sliding_window + 1 : 0;
        if (j0 < 0)
            j0 = 0;
        for (int h = 0; h < H; h++) {
            const double *qh = q + (size_t)i * H * D + (size_t)h * D;
            int kvh = h / group;
            double mx = -INFINITY;
            for (int j = j0; j <= i; j++) {
                const double *kj = k + (size_t)j * KV * D + (size_t)kvh * D;
                double s = 0;
                for (int d = 0; d < D; d++)
                    s += qh[d] * kj[d];
                p[j] = s * c->attn_scale;
                if (p[j] > mx)
                    mx = p[j];
            }
            double sum = 0;
            for (int j = j0; j <= i; j++) {
                p[j] = exp(p[j] - mx);
                sum += p[j];
            }
            double *oh = out + (size_t)i * H * D + (size_t)h * D;
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int j = j0; j <= i; j++)
                    acc += p[j] * v[(size_t)j * KV * D + (size_t)kvh * D + d];
                oh[d] = acc / sum;
            }
        }
    }
    free(p);
}

/* One decoder layer over all T positions: x (T, E) in, r->x_out[l] out. */
static void decoder_layer(const dmodel *dm, int l, const double *x, bool window_off,
                          dresult *r)
{
    const kv_config *c = &dm->cfg;
    const dlayer *ly = &dm->layers[l];
    const int T = r->T, E = c->hidden, H = c->n_heads, KV = c->n_kv_heads;
    const int D = c->head_dim, I = c->intermediate, QD = H * D, KD = KV * D;
    const bool owner = c->kv_owner[l] == l;
    const bool plus1 = c->norm_plus_one;
    double *xn = dalloc((size_t)E), *proj = dalloc((size_t)E), *h = dalloc((size_t)E);
    double *gate = dalloc((size_t)I), *up = dalloc((size_t)I);
    double *inv_freq = dalloc((size_t)D / 2);
    layer_inv_freq(c, l, inv_freq);

    r->q[l] = dalloc((size_t)T * QD);
    r->attn[l] = dalloc((size_t)T * QD);
    r->x_out[l] = dalloc((size_t)T * E);
    if (owner) {
        r->k[l] = dalloc((size_t)T * KD);
        r->v[l] = dalloc((size_t)T * KD);
    }
    for (int t = 0; t < T; t++) {
        double *q = r->q[l] + (size_t)t * QD;
        rmsnorm(x + (size_t)t * E, ly->input_norm, E, c->rms_eps, plus1, xn);
        linear(ly->wq, ly->bq, xn, QD, E, q);
        if (c->qk_norm)
            for (int hd = 0; hd < H; hd++)
                rmsnorm(q + (size_t)hd * D, ly->q_norm, D, c->rms_eps, plus1, q + (size_t)hd * D);
        rope(q, H, D, (double)t, inv_freq);
        if (!owner)
            continue;
        double *k = r->k[l] + (size_t)t * KD, *v = r->v[l] + (size_t)t * KD;
        linear(ly->wk, ly->bk, xn, KD, E, k);
        linear(ly->wv, ly->bv, xn, KD, E, v);
        if (c->qk_norm)
            for (int hd = 0; hd < KV; hd++)
                rmsnorm(k + (size_t)hd * D, ly->k_norm, D, c->rms_eps, plus1, k + (size_t)hd * D);
        rope(k, KV, D, (double)t, inv_freq);
    }
    /* A KV-shared follower reads its owner's keys and values at the same
     * positions; its own layer type decides the mask. */
    int src = c->kv_owner[l];
    attention(c, T, layer_slides(c, l, window_off), r->q[l], r->k[src], r->v[src], r->attn[l]);

    for (int t = 0; t < T; t++) {
        const double *xt = x + (size_t)t * E;
        double *out = r->x_out[l] + (size_t)t * E;
        linear(ly->wo, ly->bo, r->attn[l] + (size_t)t * QD, E, QD, proj);
        if (c->sandwich_norms)
            rmsnorm(proj, ly->post_attn_norm, E, c->rms_eps, plus1, proj);
        for (int i = 0; i < E; i++)
            h[i] = xt[i] + proj[i];
        rmsnorm(h, ly->mlp_norm, E, c->rms_eps, plus1, xn);
        linear(ly->w_gate, NULL, xn, I, E, gate);
        linear(ly->w_up, NULL, xn, I, E, up);
        for (int i = 0; i < I; i++)
            gate[i] = act(c->act, gate[i]) * up[i];
        linear(ly->w_down, NULL, gate, E, I, proj);
        if (c->sandwich_norms)
            rmsnorm(proj, ly->post_mlp_norm, E, c->rms_eps, plus1, proj);
        for (int i = 0; i < E; i++)
            out[i] = h[i] + proj[i];
    }
    free(xn);
    free(proj);
    free(h);
    free(gate);
    free(up);
    free(inv_freq);
}

/* The whole prompt at positions 0..T-1. window_off treats every layer as
 * global (the negative control). */
static void double_forward(const dmodel *dm, const int32_t *ids, int T, bool window_off,
                           dresult *r)
{
    const kv_config *c = &dm->cfg;
    const int E = c->hidden, V = c->vocab, L = c->n_layers;
    memset(r, 0, sizeof *r);
    r->T = T;
    r->L = L;
    r->q = calloc((size_t)L, sizeof *r->q);
    r->k = calloc((size_t)L, sizeof *r->k);
    r->v = calloc((size_t)L, sizeof *r->v);
    r->attn = calloc((size_t)L, sizeof *r->attn);
    r->x_out = calloc((size_t)L, sizeof *r->x_out);
    ck_assert(r->q && r->k && r->v && r->attn && r->x_out);

    double *x = dalloc((size_t)T * E);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < E; i++)
            x[(size_t)t * E + i] = dm->embed[(size_t)ids[t] * E + i] * (double)c->embed_scale;
    for (int l = 0; l < L; l++)
        decoder_layer(dm, l, l == 0 ? x : r->x_out[l - 1], window_off, r);
    free(x);

    const double *head = dm->lm_head ? dm->lm_head : dm->embed;
    r->final_norm = dalloc((size_t)T * E);
    r->logits = dalloc((size_t)T * V);
    for (int t = 0; t < T; t++) {
        double *fn = r->final_norm + (size_t)t * E, *lg = r->logits + (size_t)t * V;
        rmsnorm(r->x_out[L - 1] + (size_t)t * E, dm->final_norm, E, c->rms_eps,
                c->norm_plus_one, fn);
        linear(head, NULL, fn, V, E, lg);
        if (c->final_softcap > 0)
            for (int v = 0; v < V; v++)
                lg[v] = c->final_softcap * tanh(lg[v] / c->final_softcap);
    }
}

/* ------------------------------------------------------------------ */
/* Comparison                                                           */

static void prompt_ids(const kv_config *c, int32_t *ids, int T)
{
    for (int i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 37 + 11) % c->vocab);
}

/* test_rel_err of engine rows against ours (rounded to float), and where
 * the largest difference is. */
static double rel_err_at(const float *eng, const double *ours, size_t n, size_t *worst)
{
    float *f = malloc(n * sizeof *f);
    ck_assert_ptr_nonnull(f);
    double max_diff = -1;
    for (size_t i = 0; i < n; i++) {
        f[i] = (float)ours[i];
        double d = fabs((double)eng[i] - (double)f[i]);
        if (d > max_diff) {
            max_diff = d;
            *worst = i;
        }
    }
    double rel = test_rel_err(eng, f, n);
    free(f);
    return rel;
}

/* Compares one captured (stage, layer) with ours (T, cols); returns the
 * relative error, failing the test beyond tol. */
static double compare_stage(const char *preset, const capture *cap, kv_stage st, int layer,
                            const double *ours, int T, int cols, double tol)
{
    int ncols = 0;
    const float *eng = capture_get(cap, st, layer, &ncols);
    ck_assert_msg(eng != NULL, "%s: engine emitted no %s rows for layer %d", preset,
                  stage_name(st), layer);
    ck_assert_msg(ncols == cols, "%s: %s layer %d has %d columns, expected %d", preset,
                  stage_name(st), layer, ncols, cols);
    size_t worst = 0;
    double rel = rel_err_at(eng, ours, (size_t)T * cols, &worst);
    ck_assert_msg(rel <= tol,
                  "%s: %s layer %d: rel err %.3e > %.0e; worst at position %d index %d "
                  "(engine %.9g, double %.9g)",
                  preset, stage_name(st), layer, rel, tol, (int)(worst / cols),
                  (int)(worst % cols), (double)eng[worst], ours[worst]);
    return rel;
}

static void run_engine(const kv_model *m, const int32_t *ids, int T, capture *cap)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    kv_engine *eng = ref_create(m, &kc, &(ref_opts){.max_ctx = T, .prefill_step = 0},
                                &cap->base, &e);
    ck_assert_msg(eng != NULL, "%s", e.msg);
    ck_assert_msg(eng->forward(eng, ids, T, NULL, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(eng->position(eng), T);
    engine_free(eng);
}

/* The config fields the forward trusts, checked against the Hugging Face
 * definitions so a wrong value there cannot hide in both sides. */
static void check_config_semantics(const char *preset, const kv_config *c, int T)
{
    bool gemma = c->arch == ARCH_GEMMA3;
    double want_scale = 1.0 / sqrt(gemma ? c->query_pre_attn_scalar : (double)c->head_dim);
    ck_assert_msg(fabs(c->attn_scale - want_scale) <= 1e-12 * want_scale,
                  "%s: attn_scale %.17g, HF gives %.17g", preset, c->attn_scale, want_scale);
    float want_embed = gemma ? (float)sqrt((double)c->hidden) : 1.0f;
    ck_assert_msg(c->embed_scale == want_embed, "%s: embed_scale %.9g, HF gives %.9g", preset,
                  (double)c->embed_scale, (double)want_embed);
    ck_assert_int_eq(c->n_heads % c->n_kv_heads, 0);
    /* Gemma3RMSNorm is x (1 + w), Qwen3RMSNorm (on q/k too) and LlamaRMSNorm x w;
     * LlamaAttention and Qwen3Attention bias all four projections or none. */
    ck_assert_msg(c->norm_plus_one == gemma, "%s: norm multiplier", preset);
    ck_assert_msg(c->qk_norm == (gemma || c->arch == ARCH_QWEN3), "%s: q/k norms", preset);
    if (c->arch == ARCH_LLAMA || c->arch == ARCH_QWEN3)
        ck_assert_msg(c->qkv_bias == c->o_bias, "%s: attention_bias", preset);
    else
        ck_assert_msg(c->qkv_bias == (c->arch == ARCH_QWEN2) && !c->o_bias, "%s: biases",
                      preset);
    bool any_sliding = false;
    for (int l = 0; l < c->n_layers; l++)
        any_sliding |= c->layer_type[l] == ATTN_SLIDING;
    if (any_sliding)
        ck_assert_msg(c->sliding_window > 0 && c->sliding_window < T,
                      "%s: window %d must be shorter than the %d-token prompt", preset,
                      c->sliding_window, T);
}

/* ------------------------------------------------------------------ */
/* Tests                                                                */

/* Runs cfg's synthetic model (seed 0) through the reference engine and dm
 * through the double forward on the same prompt; returns the worst
 * relative error over q, k, v, attn_out, x_out of every layer, final norm
 * and logits, failing the test where one exceeds tol. */
static double engine_vs_double(const char *label, const kv_config *cfg, const dmodel *dm,
                               double tol)
{
    const int T = PROMPT_LEN;
    const kv_config *c = &dm->cfg;
    int32_t ids[PROMPT_LEN];
    prompt_ids(c, ids, T);

    dresult r;
    double_forward(dm, ids, T, false, &r);

    kv_model m;
    kv_err e = {{0}};
    ck_assert_msg(model_from_config(cfg, label, 0, &(model_opts){.wtype = -1}, &m, &e) == 0,
                  "%s", e.msg);
    capture *cap = capture_new(T);
    ck_assert_ptr_nonnull(cap);
    run_engine(&m, ids, T, cap);

    const int E = c->hidden, QD = c->n_heads * c->head_dim, KD = c->n_kv_heads * c->head_dim;
    /* Worst over layers of q, k, v, attn_out, x_out. K and V exist only on
     * layers owning a cache (followers write none). */
    double worst[5] = {0};
    for (int l = 0; l < c->n_layers; l++) {
        worst[0] = fmax(worst[0], compare_stage(label, cap, STAGE_Q, l, r.q[l], T, QD, tol));
        if (c->kv_owner[l] == l) {
            worst[1] = fmax(worst[1], compare_stage(label, cap, STAGE_K, l, r.k[l], T, KD, tol));
            worst[2] = fmax(worst[2], compare_stage(label, cap, STAGE_V, l, r.v[l], T, KD, tol));
        }
        worst[3] = fmax(worst[3], compare_stage(label, cap, STAGE_ATTN_OUT, l, r.attn[l], T,
                                                QD, tol));
        worst[4] = fmax(worst[4], compare_stage(label, cap, STAGE_X_OUT, l, r.x_out[l], T, E,
                                                tol));
    }
    double fn = compare_stage(label, cap, STAGE_FINAL_NORM, -1, r.final_norm, T, E, tol);
    double lg = compare_stage(label, cap, STAGE_LOGITS, -1, r.logits, T, c->vocab, tol);
    if (getenv("KVDIFF_TEST_VERBOSE"))
        fprintf(stderr,
                "double_forward %s: q %.2e k %.2e v %.2e attn_out %.2e x_out %.2e "
                "final_norm %.2e logits %.2e\n",
                label, worst[0], worst[1], worst[2], worst[3], worst[4], fn, lg);

    capture_free(cap);
    model_free(&m);
    dresult_free(&r);
    double all = fmax(fn, lg);
    for (int i = 0; i < 5; i++)
        all = fmax(all, worst[i]);
    return all;
}

START_TEST(test_engine_matches_double_forward)
{
    const char *preset = tiny_presets[_i];
    dmodel dm;
    dmodel_build(preset, &dm);
    check_config_semantics(preset, &dm.cfg, PROMPT_LEN);
    engine_vs_double(preset, &dm.cfg, &dm, TOLERANCE);
    dmodel_free(&dm);
}
END_TEST

/* Presets with one feature switched, as a config.json can ask. */
typedef enum { VAR_ATTENTION_BIAS, VAR_LINEAR_ROPE } variant_kind;

static const struct {
    const char *label, *preset;
    variant_kind kind;
} variants[] = {
    {"tiny-llama attention_bias", "tiny-llama", VAR_ATTENTION_BIAS},
    {"tiny-qwen3 attention_bias", "tiny-qwen3", VAR_ATTENTION_BIAS},
    {"tiny-llama linear rope x4", "tiny-llama", VAR_LINEAR_ROPE},
};

static kv_config variant_config(int i)
{
    kv_config c;
    kv_err e = {{0}};
    ck_assert_msg(config_preset(variants[i].preset, &c, &e) == 0, "%s", e.msg);
    if (variants[i].kind == VAR_ATTENTION_BIAS)
        c.qkv_bias = c.o_bias = true;
    else
        c.rope_scaling = (kv_rope_scaling){.type = ROPE_SCALE_LINEAR, .factor = 4.0};
    ck_assert_msg(config_validate(&c, &e) == 0, "%s: %s", variants[i].label, e.msg);
    return c;
}

START_TEST(test_variant_matches_double_forward)
{
    kv_config c = variant_config(_i);
    dmodel dm;
    dmodel_build_config(variants[_i].label, &c, &dm);
    check_config_semantics(variants[_i].label, &dm.cfg, PROMPT_LEN);
    engine_vs_double(variants[_i].label, &c, &dm, TOLERANCE);
    dmodel_free(&dm);
}
END_TEST

/* Negative controls for what the additions to the forward compute: each
 * reads the model the wrong way a port plausibly would, and the engine
 * must then disagree far beyond the tolerance (so the agreement above is
 * not an accident of features that change nothing). */
typedef enum { CTL_NO_LLAMA3, CTL_QK_NORM_PLUS_ONE, CTL_NO_O_BIAS } control_kind;

static const struct {
    const char *label;
    const char *preset;
    control_kind kind;
} controls[] = {
    {"tiny-llama3 read without its rope_scaling", "tiny-llama3", CTL_NO_LLAMA3},
    {"tiny-qwen3 q/k norms read as 1 + w", "tiny-qwen3", CTL_QK_NORM_PLUS_ONE},
    {"tiny-llama attention_bias without o_proj's bias", "tiny-llama", CTL_NO_O_BIAS},
};

START_TEST(test_wrong_reading_is_caught)
{
    kv_config c;
    kv_err e = {{0}};
    ck_assert_msg(config_preset(controls[_i].preset, &c, &e) == 0, "%s", e.msg);
    if (controls[_i].kind == CTL_NO_O_BIAS)
        c.qkv_bias = c.o_bias = true;
    dmodel dm;
    dmodel_build_config(controls[_i].label, &c, &dm);
    switch (controls[_i].kind) {
    case CTL_NO_LLAMA3:
        ck_assert_int_eq(dm.cfg.rope_scaling.type, ROPE_SCALE_LLAMA3);
        dm.cfg.rope_scaling.type = ROPE_SCALE_NONE;
        break;
    case CTL_QK_NORM_PLUS_ONE:
        for (int l = 0; l < c.n_layers; l++)
            for (int d = 0; d < c.head_dim; d++) {
                dm.layers[l].q_norm[d] += 1.0;
                dm.layers[l].k_norm[d] += 1.0;
            }
        break;
    case CTL_NO_O_BIAS:
        for (int l = 0; l < c.n_layers; l++) {
            ck_assert_ptr_nonnull(dm.layers[l].bo);
            dm.layers[l].bo = NULL;
        }
        break;
    }
    double worst = engine_vs_double(controls[_i].label, &c, &dm, INFINITY);
    ck_assert_msg(worst > CONTROL_MIN_ERR, "%s: worst rel err %.3e should exceed %.0e",
                  controls[_i].label, worst, CONTROL_MIN_ERR);
    dmodel_free(&dm);
}
END_TEST

/* Negative control: the same double forward with the sliding window
 * switched off must disagree with the engine far beyond the tolerance,
 * so a window bug on either side could not pass the test above. */
START_TEST(test_window_off_is_caught)
{
    const char *preset = "tiny-gemma3";
    const int T = PROMPT_LEN;
    dmodel dm;
    dmodel_build(preset, &dm);
    const kv_config *c = &dm.cfg;
    int32_t ids[PROMPT_LEN];
    prompt_ids(c, ids, T);

    dresult r;
    double_forward(&dm, ids, T, true, &r);

    kv_model m;
    kv_err e = {{0}};
    ck_assert_msg(model_from_preset(preset, 0, &(model_opts){.wtype = -1}, &m, &e) == 0, "%s",
                  e.msg);
    capture *cap = capture_new(T);
    ck_assert_ptr_nonnull(cap);
    run_engine(&m, ids, T, cap);

    /* Layer 0 slides, so its output already differs from position W on. */
    ck_assert_int_eq(c->layer_type[0], ATTN_SLIDING);
    double first = 0, worst = 0;
    for (int l = 0; l < c->n_layers; l++) {
        double rel = compare_stage(preset, cap, STAGE_X_OUT, l, r.x_out[l], T, c->hidden,
                                   INFINITY);
        if (l == 0)
            first = rel;
        worst = fmax(worst, rel);
    }
    ck_assert_msg(first > CONTROL_MIN_ERR,
                  "%s without window: layer 0 x_out rel err %.3e should exceed %.0e", preset,
                  first, CONTROL_MIN_ERR);
    if (getenv("KVDIFF_TEST_VERBOSE"))
        fprintf(stderr, "double_forward control %s window off: x_out layer 0 %.2e, worst %.2e\n",
                preset, first, worst);

    capture_free(cap);
    model_free(&m);
    dresult_free(&r);
    dmodel_free(&dm);
}
END_TEST

Suite *double_forward_suite(void)
{
    Suite *s = suite_create("double_forward");
    TCase *tc = tcase_create("presets");
    tcase_add_loop_test(tc, test_engine_matches_double_forward, 0, N_TINY);
    tcase_add_loop_test(tc, test_variant_matches_double_forward, 0,
                        (int)(sizeof variants / sizeof *variants));
    tcase_add_test(tc, test_window_off_is_caught);
    tcase_add_loop_test(tc, test_wrong_reading_is_caught, 0,
                        (int)(sizeof controls / sizeof *controls));
    suite_add_tcase(s, tc);
    return s;
}
