/* model.c — the tensor catalogue, synthetic weights, and loading weights
 * (from safetensors or from PCG32) into the kernels' packed layout. */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "pcg32.h"
#include "safetensors.h"

/* ------------------------------------------------------------------ */
/* Catalogue                                                            */

static int add_spec3(tensor_spec *specs, int cap, int n, const char *name,
                     tensor_kind kind, int layer, int64_t d0, int64_t d1, int64_t d2)
{
    if (specs && n < cap) {
        tensor_spec *s = &specs[n];
        snprintf(s->name, sizeof s->name, "%s", name);
        s->kind = kind;
        s->layer = layer;
        s->ndim = d2 > 0 ? 3 : d1 > 0 ? 2 : 1;
        s->shape[0] = d0;
        s->shape[1] = d1 > 0 ? d1 : 0;
        s->shape[2] = d2 > 0 ? d2 : 0;
    }
    return n + 1;
}

static int add_spec(tensor_spec *specs, int cap, int n, const char *name,
                    tensor_kind kind, int layer, int64_t d0, int64_t d1)
{
    return add_spec3(specs, cap, n, name, kind, layer, d0, d1, 0);
}

/* MLA's attention tensors of layer i (DeepseekV2Attention's names). */
static void mla_tensors(const kv_config *c, int i, tensor_spec *specs, int cap, int *n)
{
    const int64_t E = c->hidden, H = c->n_heads, D = c->head_dim, Dv = c->v_head_dim;
    const int64_t R = c->kv_lora_rank, dr = c->qk_rope_dim, QR = c->q_lora_rank;
    char name[160];
#define MLA_T(suffix, kind, d0, d1)                                            \
    do {                                                                       \
        snprintf(name, sizeof name, "%slayers.%d.self_attn.%s", c->tensor_prefix, i, suffix); \
        *n = add_spec(specs, cap, *n, name, kind, i, d0, d1);                  \
    } while (0)
    if (QR > 0) {
        MLA_T("q_a_proj.weight", TENSOR_LINEAR, QR, E);
        MLA_T("q_a_layernorm.weight", TENSOR_NORM, QR, 0);
        MLA_T("q_b_proj.weight", TENSOR_LINEAR, H * D, QR);
    } else {
        MLA_T("q_proj.weight", TENSOR_LINEAR, H * D, E);
    }
    MLA_T("kv_a_proj_with_mqa.weight", TENSOR_LINEAR, R + dr, E);
    MLA_T("kv_a_layernorm.weight", TENSOR_NORM, R, 0);
    MLA_T("kv_b_proj.weight", TENSOR_LINEAR, H * (D - dr + Dv), R);
    MLA_T("o_proj.weight", TENSOR_LINEAR, E, H * Dv);
#undef MLA_T
}

/* DeepSeek's mixture on layer i: the router (and V3's correction bias),
 * each expert's three projections, the shared experts as one MLP. */
static void deepseek_moe_tensors(const kv_config *c, int i, tensor_spec *specs, int cap, int *n)
{
    const int64_t E = c->hidden, X = c->n_experts, I = c->moe_intermediate;
    const int64_t S = (int64_t)c->n_shared_experts * I;
    char name[160];
#define MOE_T(kind, d0, d1, ...)                                               \
    do {                                                                       \
        int o_ = snprintf(name, sizeof name, "%slayers.%d.mlp.", c->tensor_prefix, i); \
        snprintf(name + o_, sizeof name - (size_t)o_, __VA_ARGS__);            \
        *n = add_spec(specs, cap, *n, name, kind, i, d0, d1);                  \
    } while (0)
    MOE_T(TENSOR_LINEAR, X, E, "gate.weight");
    if (c->route == ROUTE_SIGMOID)
        MOE_T(TENSOR_BIAS, X, 0, "gate.e_score_correction_bias");
    for (int64_t x = 0; x < X; x++) {
        MOE_T(TENSOR_EXPERT_PART, I, E, "experts.%lld.gate_proj.weight", (long long)x);
        MOE_T(TENSOR_EXPERT_PART, I, E, "experts.%lld.up_proj.weight", (long long)x);
        MOE_T(TENSOR_EXPERT_PART, E, I, "experts.%lld.down_proj.weight", (long long)x);
    }
    if (S > 0) {
        MOE_T(TENSOR_LINEAR, S, E, "shared_experts.gate_proj.weight");
        MOE_T(TENSOR_LINEAR, S, E, "shared_experts.up_proj.weight");
        MOE_T(TENSOR_LINEAR, E, S, "shared_experts.down_proj.weight");
    }
#undef MOE_T
}

static bool layer_owns_kv(const kv_config *c, int i)
{
    return c->kv_owner[i] == i;
}

int tensors_list(const kv_config *c, tensor_spec *specs, int cap)
{
    const int64_t E = c->hidden, P = c->per_layer_dim, LP = P * c->n_layers;
    const char *p = c->tensor_prefix;
    char name[160];
    int n = 0;

    snprintf(name, sizeof name, "%sembed_tokens.weight", p);
    n = add_spec(specs, cap, n, name, TENSOR_EMBED, -1, c->vocab, E);
    if (P > 0) {
        snprintf(name, sizeof name, "%sembed_tokens_per_layer.weight", p);
        n = add_spec(specs, cap, n, name, TENSOR_TABLE, -1, c->per_layer_vocab, LP);
        snprintf(name, sizeof name, "%sper_layer_model_projection.weight", p);
        n = add_spec(specs, cap, n, name, TENSOR_LINEAR, -1, LP, E);
        snprintf(name, sizeof name, "%sper_layer_projection_norm.weight", p);
        n = add_spec(specs, cap, n, name, TENSOR_NORM, -1, P, 0);
    }
    for (int i = 0; i < c->n_layers; i++) {
        bool owns = layer_owns_kv(c, i);
        const int64_t D = config_layer_head_dim(c, i), I = config_layer_intermediate(c, i);
        const int64_t QD = (int64_t)c->n_heads * D;
        const int64_t KD = (int64_t)config_layer_kv_heads(c, i) * D;
#define LAYER_T(suffix, kind, d0, d1)                                          \
    do {                                                                       \
        snprintf(name, sizeof name, "%slayers.%d.%s", p, i, suffix);           \
        n = add_spec(specs, cap, n, name, kind, i, d0, d1);                    \
    } while (0)
        LAYER_T("input_layernorm.weight", TENSOR_NORM, E, 0);
        if (config_mla(c)) {
            mla_tensors(c, i, specs, cap, &n);
        } else {
        LAYER_T("self_attn.q_proj.weight", TENSOR_LINEAR, QD, E);
        if (c->qkv_bias)
            LAYER_T("self_attn.q_proj.bias", TENSOR_BIAS, QD, 0);
        if (owns) {
            LAYER_T("self_attn.k_proj.weight", TENSOR_LINEAR, KD, E);
            if (c->qkv_bias)
                LAYER_T("self_attn.k_proj.bias", TENSOR_BIAS, KD, 0);
            if (config_layer_has_v_proj(c, i)) {
                LAYER_T("self_attn.v_proj.weight", TENSOR_LINEAR, KD, E);
                if (c->qkv_bias)
                    LAYER_T("self_attn.v_proj.bias", TENSOR_BIAS, KD, 0);
            }
        }
        LAYER_T("self_attn.o_proj.weight", TENSOR_LINEAR, E, QD);
        if (c->o_bias)
            LAYER_T("self_attn.o_proj.bias", TENSOR_BIAS, E, 0);
        }
        if (c->attn_sinks)
            LAYER_T("self_attn.sinks", TENSOR_SINKS, c->n_heads, 0);
        if (c->qk_norm) {
            LAYER_T("self_attn.q_norm.weight", TENSOR_NORM, D, 0);
            if (owns)
                LAYER_T("self_attn.k_norm.weight", TENSOR_NORM, D, 0);
        }
        LAYER_T("post_attention_layernorm.weight", TENSOR_NORM, E, 0);
        if (c->sandwich_norms) {
            LAYER_T("pre_feedforward_layernorm.weight", TENSOR_NORM, E, 0);
            LAYER_T("post_feedforward_layernorm.weight", TENSOR_NORM, E, 0);
        }
        if (config_layer_moe(c, i) && c->route != ROUTE_TOPK_SOFTMAX) {
            deepseek_moe_tensors(c, i, specs, cap, &n);
        } else if (config_layer_moe(c, i)) {
            const int64_t X = c->n_experts;
            LAYER_T("mlp.router.weight", TENSOR_LINEAR, X, E);
            LAYER_T("mlp.router.bias", TENSOR_BIAS, X, 0);
            snprintf(name, sizeof name, "%slayers.%d.mlp.experts.gate_up_proj", p, i);
            n = add_spec3(specs, cap, n, name, TENSOR_EXPERTS, i, X, E, 2 * I);
            LAYER_T("mlp.experts.gate_up_proj_bias", TENSOR_EXPERT_BIAS, X, 2 * I);
            snprintf(name, sizeof name, "%slayers.%d.mlp.experts.down_proj", p, i);
            n = add_spec3(specs, cap, n, name, TENSOR_EXPERTS, i, X, I, E);
            LAYER_T("mlp.experts.down_proj_bias", TENSOR_EXPERT_BIAS, X, E);
        } else {
            LAYER_T("mlp.gate_proj.weight", TENSOR_LINEAR, I, E);
            LAYER_T("mlp.up_proj.weight", TENSOR_LINEAR, I, E);
            LAYER_T("mlp.down_proj.weight", TENSOR_LINEAR, E, I);
        }
        if (P > 0) {
            LAYER_T("per_layer_input_gate.weight", TENSOR_LINEAR, P, E);
            LAYER_T("per_layer_projection.weight", TENSOR_LINEAR, E, P);
            LAYER_T("post_per_layer_input_norm.weight", TENSOR_NORM, E, 0);
        }
        if (c->layer_scalar)
            LAYER_T("layer_scalar", TENSOR_NORM, 1, 0);
#undef LAYER_T
    }
    snprintf(name, sizeof name, "%snorm.weight", p);
    n = add_spec(specs, cap, n, name, TENSOR_NORM, -1, E, 0);
    if (!c->tie_embeddings)
        n = add_spec(specs, cap, n, c->lm_head_name, TENSOR_EMBED, -1, c->vocab, E);
    return n;
}

static int64_t spec_rows(const tensor_spec *s)
{
    return s->ndim == 3 ? s->shape[0] * s->shape[1] : s->shape[0];
}

static int64_t spec_cols(const tensor_spec *s)
{
    return s->ndim == 3 ? s->shape[2] : s->ndim == 2 ? s->shape[1] : 1;
}

/* ------------------------------------------------------------------ */
/* Synthetic weights                                                    */

/* Weights (elements) of n tensors: the unit model_progress_fn counts. */
static int64_t tensors_weights(const tensor_spec *specs, int n)
{
    int64_t total = 0;
    for (int i = 0; i < n; i++)
        total += spec_rows(&specs[i]) * spec_cols(&specs[i]);
    return total;
}

static uint64_t name_hash(const char *s)
{
    return XXH3_64bits(s, strlen(s));
}

/* Rows have their own streams (sequence = row index) so blocks of rows can
 * be drawn independently, on any thread. */
static void synth_rows(const kv_config *c, const tensor_spec *s, uint64_t seed,
                       int64_t row0, int64_t nrows, float *out)
{
    const int64_t cols = spec_cols(s);
    const uint64_t base = seed * 0x9E3779B97F4A7C15ULL ^ name_hash(s->name);
    float scale = 1.0f, offset = 0.0f;

    switch (s->kind) {
    case TENSOR_LINEAR: scale = 1.0f / sqrtf((float)cols); break;
    case TENSOR_BIAS:   scale = 0.3f; break;
    case TENSOR_NORM:   scale = 0.1f; offset = c->norm_plus_one ? 0.0f : 1.0f; break;
    case TENSOR_EMBED:  scale = c->embed_scale != 1.0f ? 1.0f / c->embed_scale : 1.0f; break;
    /* Scaled by sqrt(P) when read: rows of order 1 then. */
    case TENSOR_TABLE:  scale = 1.0f / sqrtf((float)(c->per_layer_dim > 0 ? c->per_layer_dim : 1));
                        break;
    /* Input-major: the fan-in is the middle axis. */
    case TENSOR_EXPERTS: scale = 1.0f / sqrtf((float)s->shape[1]); break;
    case TENSOR_EXPERT_PART: scale = 1.0f / sqrtf((float)cols); break;
    case TENSOR_EXPERT_BIAS: scale = 0.3f; break;
    /* Logits of the order of a short context's log-sum-exp: the sink
     * takes a visible share of every softmax, as trained sinks do. */
    case TENSOR_SINKS:  scale = 2.0f; offset = 2.0f; break;
    }
    /* Gemma 4 scores q.k unscaled: q/k norm weights of D^-1/4 keep the
     * scores of order 1, as a trained model's small weights do. */
    if (c->arch == ARCH_GEMMA4 && s->kind == TENSOR_NORM &&
        (strstr(s->name, "q_norm.weight") || strstr(s->name, "k_norm.weight"))) {
        const float f = powf((float)s->shape[0], -0.25f);
        scale *= f;
        offset *= f;
    }
    /* A 1-D tensor is one row of `shape[0]` values: draw it as one stream. */
    if (s->ndim == 1) {
        pcg32 r;
        pcg32_seed(&r, base, 0);
        for (int64_t j = 0; j < s->shape[0]; j++) {
            float v = offset + scale * pcg32_unit_uniform(&r);
            if (j >= row0 && j < row0 + nrows)
                out[j - row0] = v;
        }
        return;
    }
    /* Four rows at a time: each stream is a chain of dependent 64-bit
     * multiplies, so four independent chains keep the multiplier busy.
     * Every row still gets exactly its own sequence. */
    int64_t i = 0;
    for (; i + 4 <= nrows; i += 4) {
        pcg32 r0, r1, r2, r3;
        pcg32_seed(&r0, base, (uint64_t)(row0 + i));
        pcg32_seed(&r1, base, (uint64_t)(row0 + i + 1));
        pcg32_seed(&r2, base, (uint64_t)(row0 + i + 2));
        pcg32_seed(&r3, base, (uint64_t)(row0 + i + 3));
        float *o0 = out + i * cols, *o1 = o0 + cols, *o2 = o1 + cols, *o3 = o2 + cols;
        for (int64_t j = 0; j < cols; j++) {
            float v0 = pcg32_unit_uniform(&r0), v1 = pcg32_unit_uniform(&r1);
            float v2 = pcg32_unit_uniform(&r2), v3 = pcg32_unit_uniform(&r3);
            o0[j] = offset + scale * v0;
            o1[j] = offset + scale * v1;
            o2[j] = offset + scale * v2;
            o3[j] = offset + scale * v3;
        }
    }
    for (; i < nrows; i++) {
        pcg32 r;
        pcg32_seed(&r, base, (uint64_t)(row0 + i));
        for (int64_t j = 0; j < cols; j++)
            out[i * cols + j] = offset + scale * pcg32_unit_uniform(&r);
    }
}

void synth_tensor_rows(const kv_config *c, const tensor_spec *s, uint64_t seed, int64_t row0,
                       int64_t nrows, float *out)
{
    synth_rows(c, s, seed, row0, nrows, out);
}

void synth_tensor(const kv_config *c, const tensor_spec *s, uint64_t seed, float *out)
{
    if (s->ndim == 1)
        synth_rows(c, s, seed, 0, s->shape[0], out);
    else
        synth_rows(c, s, seed, 0, spec_rows(s), out);
}

/* ------------------------------------------------------------------ */
/* Loading through a row source                                         */

/* Where rows come from: a safetensors file or the synthetic generator. */
typedef struct {
    const kv_config *cfg;
    st_file *st;            /* NULL: synthetic */
    uint64_t seed;
    const char *dir;
    uint64_t *nonfinite;    /* NaN and infinite values read so far (counted here) */
    kern_pool *pool;        /* NULL: the caller's thread alone */
    const tensor_spec *specs;   /* the catalogue every tensor_spec * points into */
    kern_linear *ready;     /* NULL, or by catalogue index: matrices allocated ahead */
} row_source;

static const char *suffix_of(const tensor_spec *s);

/* Gemma 4's layers differ by type and by K/V sharing: which config.json
 * fields gave a layer tensor its shape, or made it needed, so that a file
 * that disagrees names the field to look at ("num_attention_heads 4 x the
 * full layers' head size 64 ..."). Empty for the others, whose shapes read
 * off the config as they are. */
static void gemma4_origin(const kv_config *c, const tensor_spec *s, bool missing, char *buf,
                          size_t n)
{
    buf[0] = 0;
    const int l = s->layer;
    if (c->arch != ARCH_GEMMA4)
        return;
    if (s->kind == TENSOR_TABLE && !missing) {
        snprintf(buf, n, "vocab_size_per_layer_input %d, num_hidden_layers %d x "
                 "hidden_size_per_layer_input %d", c->per_layer_vocab, c->n_layers,
                 c->per_layer_dim);
        return;
    }
    if (l < 0 || l >= c->n_layers)
        return;
    const char *sx = suffix_of(s);
    const bool full = c->layer_type[l] == ATTN_GLOBAL, owns = c->kv_owner[l] == l;
    int shared = 0;
    for (int i = 0; i < c->n_layers; i++)
        shared += c->kv_owner[i] != i;
    /* A full layer's size falls back to the sliding one's when its own
     * key is absent (config.c). */
    const char *hd = full ? "global_head_dim (else head_dim)" : "head_dim";
    const char *kvh = full ? "num_global_key_value_heads (else num_key_value_heads)"
                           : "num_key_value_heads";
    const char *type = full ? "full_attention" : "sliding_attention";
    if (missing && strstr(sx, "k_proj") && owns)
        snprintf(buf, n, "layer %d computes its own K/V: num_kv_shared_layers is %d", l, shared);
    else if (missing && strstr(sx, "v_proj"))
        snprintf(buf, n, "layer %d is %s and attention_k_eq_v is %s", l, type,
                 c->k_eq_v ? "true" : "false");
    else if (missing)
        return;
    else if (strstr(sx, "q_proj") || strstr(sx, "o_proj"))
        snprintf(buf, n, "num_attention_heads %d x %s %d: layer %d is %s", c->n_heads, hd,
                 config_layer_head_dim(c, l), l, type);
    else if (strstr(sx, "k_proj") || strstr(sx, "v_proj"))
        snprintf(buf, n, "%s %d x %s %d: layer %d is %s", kvh, config_layer_kv_heads(c, l), hd,
                 config_layer_head_dim(c, l), l, type);
    else if (strstr(sx, "mlp.") && c->double_wide_mlp && !owns)
        snprintf(buf, n, "2 x intermediate_size %d: use_double_wide_mlp, and layer %d shares "
                 "K/V as one of the last num_kv_shared_layers %d", c->intermediate, l, shared);
    else if (strstr(sx, "mlp.") && c->double_wide_mlp)
        snprintf(buf, n, "intermediate_size %d: layer %d computes its own K/V, outside the "
                 "last num_kv_shared_layers %d, so use_double_wide_mlp does not double it",
                 c->intermediate, l, shared);
    else if (strstr(sx, "mlp."))
        snprintf(buf, n, "intermediate_size %d: use_double_wide_mlp is false", c->intermediate);
    else if (strstr(sx, "per_layer"))
        snprintf(buf, n, "hidden_size_per_layer_input %d", c->per_layer_dim);
}

static int source_check(const row_source *src, const tensor_spec *s, kv_err *e)
{
    if (!src->st)
        return 0;
    const st_tensor *t = st_find(src->st, s->name);
    char why[300];
    if (!t) {
        gemma4_origin(src->cfg, s, true, why, sizeof why);
        return kv_errf(e, "%s: tensor '%s' is missing (needed by config.json%s%s)",
                       src->dir, s->name, why[0] ? ": " : "", why);
    }
    if (t->dtype != ST_F32 && t->dtype != ST_F16 && t->dtype != ST_BF16)
        return kv_errf(e, "%s: tensor '%s' has dtype %s; kvdiff reads F32, F16 and BF16",
                       t->file, s->name, st_dtype_name(t->dtype));
    bool ok = t->ndim == s->ndim;
    for (int d = 0; ok && d < s->ndim; d++)
        ok = t->shape[d] == s->shape[d];
    if (!ok) {
        char got[96] = "", want[96] = "";
        for (int d = 0; d < t->ndim && strlen(got) < 64; d++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "",
                     (long long)t->shape[d]);
        for (int d = 0; d < s->ndim; d++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", d ? ", " : "",
                     (long long)s->shape[d]);
        gemma4_origin(src->cfg, s, false, why, sizeof why);
        return kv_errf(e, "%s: tensor '%s' has shape [%s] but config.json implies [%s]%s%s%s",
                       t->file, s->name, got, want, why[0] ? " (" : "", why, why[0] ? ")" : "");
    }
    return 0;
}

/* NaN and infinite values have every exponent bit set: a test on blocks
 * of 16 the compiler vectorises, where isfinite() per value did not. */
static uint64_t count_nonfinite(const float *v, uint64_t n)
{
    uint64_t bad = 0, i = 0;
    for (; i + 16 <= n; i += 16) {
        uint32_t b = 0;
        for (int k = 0; k < 16; k++) {
            uint32_t u;
            memcpy(&u, &v[i + (uint64_t)k], sizeof u);
            b += (u & 0x7f800000u) == 0x7f800000u;
        }
        bad += b;
    }
    for (; i < n; i++)
        bad += !isfinite(v[i]);
    return bad;
}

/* Rows [row0, row0 + nrows) of s as floats into out; adds the NaN and
 * infinite values among them to *bad. Safe to call from several threads
 * at once (it only reads the mapping, or draws rows' own streams). */
static int source_rows(const row_source *src, const tensor_spec *s, int64_t row0,
                       int64_t nrows, float *out, uint64_t *bad, kv_err *e)
{
    if (!src->st) {
        synth_rows(src->cfg, s, src->seed, row0, nrows, out);
        return 0;
    }
    const st_tensor *t = st_find(src->st, s->name);
    const uint64_t n = (uint64_t)(nrows * spec_cols(s));
    if (st_read_f32(t, (uint64_t)(row0 * spec_cols(s)), n, out, e) < 0)
        return -1;
    *bad += count_nonfinite(out, n);
    return 0;
}

static int load_vector(const row_source *src, const tensor_spec *s, float **dst,
                       XXH3_state_t *h, kv_err *e)
{
    int64_t n = s->shape[0];
    *dst = malloc((size_t)n * sizeof(float));
    if (!*dst)
        return kv_errf(e, "out of memory loading '%s'", s->name);
    if (source_rows(src, s, 0, n, *dst, src->nonfinite, e) < 0)
        return -1;
    XXH3_64bits_update(h, *dst, (size_t)n * sizeof(float));
    return 0;
}

/* Rows per packing task: whole panels, so no two tasks write into one
 * panel, and few enough that a task's rows as floats stay in L2. Which
 * thread packs which rows changes no byte: each weight is converted and
 * placed on its own. */
#define PACK_ROWS (2 * KERN_PANEL)

/* Rows of one tensor converted by blocks on the pool's threads, into a
 * packed matrix (L) or a row-major table (t). */
typedef struct {
    const row_source *src;
    const tensor_spec *s;
    kern_linear *L;
    model_table *t;
    atomic_ullong bad;          /* NaN and infinite values read */
    atomic_int failed;          /* the first task to fail sets it and fills err */
    kv_err err;
} fill_job;

/* A task's end: its NaN count, and its error when it is the first. */
static void fill_task_done(fill_job *j, int rc, uint64_t bad, const kv_err *e)
{
    atomic_fetch_add(&j->bad, bad);
    int none = 0;
    if (rc < 0 && atomic_compare_exchange_strong(&j->failed, &none, 1))
        j->err = *e;
}

/* Runs ntasks of fn over j; 0, or -1 with the first task's error. */
static int fill_run(fill_job *j, pool_fn fn, int64_t ntasks, kv_err *e)
{
    atomic_init(&j->bad, 0);
    atomic_init(&j->failed, 0);
    pool_run(j->src->pool, fn, j, (int)ntasks);
    if (atomic_load(&j->failed)) {
        *e = j->err;
        return -1;
    }
    *j->src->nonfinite += atomic_load(&j->bad);
    return 0;
}

static void pack_task(void *ctx, int task)
{
    fill_job *j = ctx;
    const int64_t rows = spec_rows(j->s), cols = spec_cols(j->s);
    const int64_t r0 = (int64_t)task * PACK_ROWS;
    const int64_t nr = rows - r0 < PACK_ROWS ? rows - r0 : PACK_ROWS;
    kv_err e = {{0}};
    uint64_t bad = 0;
    float *buf = malloc((size_t)(nr * cols) * sizeof(float));
    int rc = buf ? source_rows(j->src, j->s, r0, nr, buf, &bad, &e)
                 : kv_errf(&e, "out of memory loading '%s'", j->s->name);
    if (rc == 0)
        kern_linear_set_rows(j->L, (int)r0, (int)nr, buf);
    free(buf);
    fill_task_done(j, rc, bad, &e);
}

/* Converts and packs the rows of a matrix on the pool's threads (both
 * cores: the conversion and the scattered writes into panels were most of
 * a checkpoint's load), then hashes the packed bytes in order. */
static int load_linear(const row_source *src, const tensor_spec *s, kern_wtype wt,
                       bool bias_slot, kern_linear *L, XXH3_state_t *h, kv_err *e)
{
    const int64_t rows = spec_rows(s), cols = spec_cols(s);
    kern_linear *ready = src->ready ? &src->ready[s - src->specs] : NULL;
    if (ready && ready->panels && ready->wtype == wt && (ready->bias != NULL) == bias_slot) {
        *L = *ready;
        memset(ready, 0, sizeof *ready);
    } else if (kern_linear_init(L, (int)rows, (int)cols, wt, bias_slot) < 0) {
        return kv_errf(e, "out of memory for '%s' (%lld x %lld)", s->name,
                       (long long)rows, (long long)cols);
    }
    fill_job job = {.src = src, .s = s, .L = L};
    if (fill_run(&job, pack_task, (rows + PACK_ROWS - 1) / PACK_ROWS, e) < 0)
        return -1;
    size_t esz = wt == KERN_BF16 ? 2 : 4;
    size_t panels = ((size_t)rows + KERN_PANEL - 1) / KERN_PANEL;
    XXH3_64bits_update(h, L->panels, panels * (size_t)cols * KERN_PANEL * esz);
    return 0;
}

/* A stack of expert matrices (X, in, out), stored input-major: each
 * expert's in x out block is read, turned to (out, in) and packed on its
 * own, with a bias slot its _bias tensor fills. */
static int load_experts(const row_source *src, const tensor_spec *s, kern_wtype wt,
                        kern_linear **dst, XXH3_state_t *h, kv_err *e)
{
    const int64_t X = s->shape[0], A = s->shape[1], B = s->shape[2];
    if (!*dst && !(*dst = calloc((size_t)X, sizeof **dst)))
        return kv_errf(e, "out of memory for '%s'", s->name);
    float *buf = malloc((size_t)(A * B) * sizeof(float));
    float *tr = malloc((size_t)(A * B) * sizeof(float));
    int rc = buf && tr ? 0 : kv_errf(e, "out of memory loading '%s'", s->name);
    for (int64_t x = 0; x < X && rc == 0; x++) {
        kern_linear *L = &(*dst)[x];
        if (source_rows(src, s, x * A, A, buf, src->nonfinite, e) < 0) {
            rc = -1;
            break;
        }
        for (int64_t i = 0; i < A; i++)
            for (int64_t o = 0; o < B; o++)
                tr[o * A + i] = buf[i * B + o];
        if (kern_linear_init(L, (int)B, (int)A, wt, true) < 0) {
            rc = kv_errf(e, "out of memory for '%s' (expert %lld)", s->name, (long long)x);
            break;
        }
        kern_linear_set_rows(L, 0, (int)B, tr);
        size_t esz = wt == KERN_BF16 ? 2 : 4;
        size_t panels = ((size_t)B + KERN_PANEL - 1) / KERN_PANEL;
        XXH3_64bits_update(h, L->panels, panels * (size_t)A * KERN_PANEL * esz);
    }
    free(buf);
    free(tr);
    return rc;
}

/* One bias row per expert, into the matrices load_experts made. */
static int load_expert_bias(const row_source *src, const tensor_spec *s, kern_linear *L,
                            XXH3_state_t *h, kv_err *e)
{
    if (!L)
        return kv_errf(e, "internal: '%s' comes before its experts", s->name);
    for (int64_t x = 0; x < s->shape[0]; x++) {
        if (source_rows(src, s, x, 1, L[x].bias, src->nonfinite, e) < 0)
            return -1;
        XXH3_64bits_update(h, L[x].bias, (size_t)s->shape[1] * sizeof(float));
    }
    return 0;
}

/* One DeepSeek expert's projection (mlp.experts.N.gate_proj / up_proj /
 * down_proj): gate and up into rows [0, I) and [I, 2I) of the expert's
 * gate_up matrix (hashed once both are in: up follows gate in the
 * catalogue), down into its own. */
static int load_expert_part(const row_source *src, const tensor_spec *s, kv_model *m,
                            model_layer *ly, const char *sx, XXH3_state_t *h, kv_err *e)
{
    const kv_config *c = &m->cfg;
    const int X = c->n_experts, I = c->moe_intermediate, E = c->hidden;
    int x = -1, used = 0;
    char part[16] = "";
    if (sscanf(sx, "mlp.experts.%d.%15[a-z_]%n", &x, part, &used) != 2 || x < 0 || x >= X)
        return kv_errf(e, "internal: expert tensor '%s' out of the catalogue", s->name);
    const bool gate = !strcmp(part, "gate_proj"), up = !strcmp(part, "up_proj");
    if (!ly->gate_up && (!(ly->gate_up = calloc((size_t)X, sizeof *ly->gate_up))
                         || !(ly->down = calloc((size_t)X, sizeof *ly->down))))
        return kv_errf(e, "out of memory for the experts of '%s'", s->name);
    kern_linear *L = gate || up ? &ly->gate_up[x] : &ly->down[x];
    const int rows = (int)spec_rows(s), cols = (int)spec_cols(s);
    if (!L->panels && kern_linear_init(L, gate || up ? 2 * I : E, cols, m->wtype, false) < 0)
        return kv_errf(e, "out of memory for '%s'", s->name);
    float *buf = malloc((size_t)rows * (size_t)cols * sizeof(float));
    if (!buf)
        return kv_errf(e, "out of memory loading '%s'", s->name);
    int rc = source_rows(src, s, 0, rows, buf, src->nonfinite, e);
    if (rc == 0) {
        kern_linear_set_rows(L, up ? I : 0, rows, buf);
        if (!gate) {
            size_t esz = m->wtype == KERN_BF16 ? 2 : 4;
            size_t panels = ((size_t)L->n_out + KERN_PANEL - 1) / KERN_PANEL;
            XXH3_64bits_update(h, L->panels, panels * (size_t)L->n_in * KERN_PANEL * esz);
        }
    }
    free(buf);
    return rc;
}

/* MLA's absorbed forms, from kv_b_proj as packed (exactly its values):
 * each head's key part turned to (R, nope), its value part (Dv, R). */
static int mla_absorbed(const kv_config *c, model_layer *ly, const tensor_spec *s, kv_err *e)
{
    const int H = c->n_heads, R = c->kv_lora_rank, nope = c->head_dim - c->qk_rope_dim;
    const int Dv = c->v_head_dim, per = nope + Dv;
    ly->uk_t = calloc((size_t)H, sizeof *ly->uk_t);
    ly->uv = calloc((size_t)H, sizeof *ly->uv);
    float *rows = malloc((size_t)per * R * sizeof(float));
    float *tr = malloc((size_t)R * nope * sizeof(float));
    int rc = ly->uk_t && ly->uv && rows && tr ? 0 : kv_errf(e, "out of memory for '%s'", s->name);
    for (int h = 0; h < H && rc == 0; h++) {
        for (int j = 0; j < per; j++)
            kern_linear_get_row(&ly->wkv_b, h * per + j, rows + (size_t)j * R);
        for (int r = 0; r < R; r++)
            for (int d = 0; d < nope; d++)
                tr[(size_t)r * nope + d] = rows[(size_t)d * R + r];
        if (kern_linear_init(&ly->uk_t[h], R, nope, ly->wkv_b.wtype, false) < 0
            || kern_linear_init(&ly->uv[h], Dv, R, ly->wkv_b.wtype, false) < 0) {
            rc = kv_errf(e, "out of memory for '%s' (absorbed)", s->name);
            break;
        }
        kern_linear_set_rows(&ly->uk_t[h], 0, R, tr);
        kern_linear_set_rows(&ly->uv[h], 0, Dv, rows + (size_t)nope * R);
    }
    free(rows);
    free(tr);
    return rc;
}

/* Which member of a layer a catalogue entry fills. */
static const char *suffix_of(const tensor_spec *s)
{
    const char *p = strstr(s->name, "layers.");
    p = p ? strchr(p + 7, '.') : NULL;
    return p ? p + 1 : s->name;
}

static int load_layer_tensor(const row_source *src, const tensor_spec *s, kv_model *m,
                             XXH3_state_t *h, kv_err *e)
{
    model_layer *ly = &m->layers[s->layer];
    const char *sx = suffix_of(s);
    bool qb = m->cfg.qkv_bias;
    kern_wtype wt = m->wtype;

    if (!strcmp(sx, "self_attn.q_proj.weight")) return load_linear(src, s, wt, qb, &ly->wq, h, e);
    if (!strcmp(sx, "self_attn.k_proj.weight")) return load_linear(src, s, wt, qb, &ly->wk, h, e);
    if (!strcmp(sx, "self_attn.v_proj.weight")) return load_linear(src, s, wt, qb, &ly->wv, h, e);
    if (!strcmp(sx, "self_attn.o_proj.weight")) return load_linear(src, s, wt, m->cfg.o_bias, &ly->wo, h, e);
    if (!strcmp(sx, "mlp.gate_proj.weight")) return load_linear(src, s, wt, false, &ly->w_gate, h, e);
    if (!strcmp(sx, "mlp.up_proj.weight")) return load_linear(src, s, wt, false, &ly->w_up, h, e);
    if (!strcmp(sx, "mlp.down_proj.weight")) return load_linear(src, s, wt, false, &ly->w_down, h, e);
    if (!strcmp(sx, "per_layer_input_gate.weight"))
        return load_linear(src, s, wt, false, &ly->w_pl_gate, h, e);
    if (!strcmp(sx, "per_layer_projection.weight"))
        return load_linear(src, s, wt, false, &ly->w_pl_proj, h, e);
    if (!strcmp(sx, "mlp.router.weight"))
        return load_linear(src, s, wt, true, &ly->router, h, e);
    if (!strcmp(sx, "mlp.experts.gate_up_proj"))
        return load_experts(src, s, wt, &ly->gate_up, h, e);
    if (s->kind == TENSOR_EXPERT_PART)
        return load_expert_part(src, s, m, ly, sx, h, e);
    if (!strcmp(sx, "self_attn.q_a_proj.weight"))
        return load_linear(src, s, wt, false, &ly->wq_a, h, e);
    if (!strcmp(sx, "self_attn.q_b_proj.weight"))
        return load_linear(src, s, wt, false, &ly->wq, h, e);
    if (!strcmp(sx, "self_attn.kv_a_proj_with_mqa.weight"))
        return load_linear(src, s, wt, false, &ly->wkv_a, h, e);
    if (!strcmp(sx, "self_attn.kv_b_proj.weight")) {
        if (load_linear(src, s, wt, false, &ly->wkv_b, h, e) < 0)
            return -1;
        return mla_absorbed(&m->cfg, ly, s, e);
    }
    if (!strcmp(sx, "mlp.gate.weight"))
        return load_linear(src, s, wt, false, &ly->router, h, e);
    if (!strcmp(sx, "mlp.shared_experts.gate_proj.weight"))
        return load_linear(src, s, wt, false, &ly->w_gate, h, e);
    if (!strcmp(sx, "mlp.shared_experts.up_proj.weight"))
        return load_linear(src, s, wt, false, &ly->w_up, h, e);
    if (!strcmp(sx, "mlp.shared_experts.down_proj.weight"))
        return load_linear(src, s, wt, false, &ly->w_down, h, e);
    if (!strcmp(sx, "mlp.gate.e_score_correction_bias"))
        return load_vector(src, s, &ly->router_sel_bias, h, e);
    if (!strcmp(sx, "mlp.experts.down_proj"))
        return load_experts(src, s, wt, &ly->down, h, e);
    if (!strcmp(sx, "mlp.experts.gate_up_proj_bias"))
        return load_expert_bias(src, s, ly->gate_up, h, e);
    if (!strcmp(sx, "mlp.experts.down_proj_bias"))
        return load_expert_bias(src, s, ly->down, h, e);
    if (s->kind == TENSOR_BIAS) {
        kern_linear *L = strstr(sx, "q_proj") ? &ly->wq : strstr(sx, "k_proj") ? &ly->wk
                       : strstr(sx, "v_proj") ? &ly->wv : strstr(sx, "router") ? &ly->router
                       : &ly->wo;
        if (source_rows(src, s, 0, s->shape[0], L->bias, src->nonfinite, e) < 0)
            return -1;
        XXH3_64bits_update(h, L->bias, (size_t)s->shape[0] * sizeof(float));
        return 0;
    }
    float **dst = NULL;
    if (!strcmp(sx, "input_layernorm.weight")) dst = &ly->attn_norm;
    else if (!strcmp(sx, "self_attn.q_norm.weight")) dst = &ly->q_norm;
    else if (!strcmp(sx, "self_attn.k_norm.weight")) dst = &ly->k_norm;
    else if (!strcmp(sx, "post_attention_layernorm.weight"))
        dst = m->cfg.sandwich_norms ? &ly->post_attn_norm : &ly->ffn_norm;
    else if (!strcmp(sx, "pre_feedforward_layernorm.weight")) dst = &ly->ffn_norm;
    else if (!strcmp(sx, "post_feedforward_layernorm.weight")) dst = &ly->post_ffn_norm;
    else if (!strcmp(sx, "post_per_layer_input_norm.weight")) dst = &ly->pl_norm;
    else if (!strcmp(sx, "layer_scalar")) dst = &ly->layer_scalar;
    else if (!strcmp(sx, "self_attn.sinks")) dst = &ly->sinks;
    else if (!strcmp(sx, "self_attn.q_a_layernorm.weight")) dst = &ly->q_a_norm;
    else if (!strcmp(sx, "self_attn.kv_a_layernorm.weight")) dst = &ly->kv_a_norm;
    if (!dst)
        return kv_errf(e, "internal: no slot for tensor '%s'", s->name);
    return load_vector(src, s, dst, h, e);
}

/* Rows per table task. */
#define TABLE_ROWS 256

static void table_task(void *ctx, int task)
{
    fill_job *j = ctx;
    const int64_t cols = j->t->cols, r0 = (int64_t)task * TABLE_ROWS;
    const int64_t nr = j->t->rows - r0 < TABLE_ROWS ? j->t->rows - r0 : TABLE_ROWS;
    kv_err e = {{0}};
    uint64_t bad = 0;
    const size_t count = (size_t)(nr * cols);
    float *buf = j->t->wtype == KERN_F32 ? (float *)j->t->data + (size_t)r0 * (size_t)cols
                                         : malloc(count * sizeof(float));
    int rc = buf ? source_rows(j->src, j->s, r0, nr, buf, &bad, &e)
                 : kv_errf(&e, "out of memory loading '%s'", j->s->name);
    if (rc == 0 && j->t->wtype == KERN_BF16)
        kern_bf16_from_f32(buf, count, (uint16_t *)j->t->data + (size_t)r0 * (size_t)cols);
    if (j->t->wtype == KERN_BF16)
        free(buf);
    fill_task_done(j, rc, bad, &e);
}

/* A gathered table, stored row-major in the model's weight type, blocks
 * of rows converted on the pool's threads. */
static int load_table(const row_source *src, const tensor_spec *s, kern_wtype wt,
                      model_table *t, XXH3_state_t *h, kv_err *e)
{
    const size_t esz = wt == KERN_BF16 ? 2 : 4;
    t->rows = spec_rows(s);
    t->cols = spec_cols(s);
    t->wtype = wt;
    t->data = malloc((size_t)t->rows * (size_t)t->cols * esz);
    if (!t->data)
        return kv_errf(e, "out of memory for '%s' (%lld x %lld)", s->name,
                       (long long)t->rows, (long long)t->cols);
    fill_job job = {.src = src, .s = s, .t = t};
    if (fill_run(&job, table_task, (t->rows + TABLE_ROWS - 1) / TABLE_ROWS, e) < 0)
        return -1;
    XXH3_64bits_update(h, t->data, (size_t)t->rows * (size_t)t->cols * esz);
    return 0;
}

void model_table_row(const model_table *t, int64_t r, float *out)
{
    const size_t off = (size_t)r * (size_t)t->cols;
    if (t->wtype == KERN_BF16)
        kern_bf16_to_f32((const uint16_t *)t->data + off, (size_t)t->cols, out);
    else
        memcpy(out, (const float *)t->data + off, (size_t)t->cols * sizeof(float));
}

/* Model-level tensors other than the embedding (catalogue entry 0). */
static int load_model_tensor(const row_source *src, const tensor_spec *s, kv_model *m,
                             XXH3_state_t *h, kv_err *e)
{
    const char *name = s->name + strlen(m->cfg.tensor_prefix);
    if (s->kind == TENSOR_TABLE)
        return load_table(src, s, m->wtype, &m->pl_embed, h, e);
    if (!strcmp(name, "per_layer_model_projection.weight"))
        return load_linear(src, s, m->wtype, false, &m->pl_model_proj, h, e);
    if (!strcmp(name, "per_layer_projection_norm.weight"))
        return load_vector(src, s, &m->pl_proj_norm, h, e);
    if (s->kind == TENSOR_NORM)
        return load_vector(src, s, &m->final_norm, h, e);
    return load_linear(src, s, m->wtype, false, &m->lm_head, h, e);
}

/* A tensor holding NaN or Inf makes every row computed from it NaN: the
 * run still goes (the numbers are the checkpoint's), and the caller is
 * told which tensor, so it can say so before anyone reads the output. */
static void note_nonfinite(const row_source *src, const tensor_spec *s, uint64_t bad,
                           kv_model *m)
{
    if (bad == 0)
        return;
    if (m->nonfinite_tensors++ == 0) {
        const st_tensor *t = src->st ? st_find(src->st, s->name) : NULL;
        snprintf(m->nonfinite_first, sizeof m->nonfinite_first, "%s: tensor '%s' holds %llu "
                 "NaN or infinite value%s", t ? t->file : src->dir, s->name,
                 (unsigned long long)bad, bad == 1 ? "" : "s");
    }
}

/* Is spec b the bias of matrix a ("x.weight" then "x.bias")? */
static bool bias_of(const tensor_spec *a, const tensor_spec *b)
{
    size_t la = strlen(a->name), lb = strlen(b->name);
    return b->kind == TENSOR_BIAS && la > 7 && lb == la - 2 &&
           !strcmp(a->name + la - 7, ".weight") && !strncmp(a->name, b->name, la - 7) &&
           !strcmp(b->name + lb - 5, ".bias");
}

typedef struct {
    const row_source *src;
    int n;
    kern_wtype wt;
} alloc_job;

/* A fresh matrix is zeroed page by page by the kernel, a third of a 1B
 * checkpoint's load when one thread did it for every matrix in turn.
 * Allocated here, one matrix per task, the zeroing runs on every thread.
 * A failure leaves the entry empty: load_linear then allocates it again
 * and names the tensor that did not fit. */
static void alloc_task(void *ctx, int i)
{
    const alloc_job *j = ctx;
    const tensor_spec *s = &j->src->specs[i];
    if (s->kind != TENSOR_LINEAR && s->kind != TENSOR_EMBED)
        return;
    bool bias = i + 1 < j->n && bias_of(s, &j->src->specs[i + 1]);
    if (kern_linear_init(&j->src->ready[i], (int)spec_rows(s), (int)spec_cols(s), j->wt,
                         bias) < 0)
        memset(&j->src->ready[i], 0, sizeof j->src->ready[i]);
}

static int load_all(const row_source *src, const model_opts *o, kv_model *m, kv_err *e)
{
    const kv_config *c = &m->cfg;
    int n = tensors_list(c, NULL, 0);
    tensor_spec *specs = calloc((size_t)n, sizeof *specs);
    m->layers = calloc((size_t)c->n_layers, sizeof *m->layers);
    XXH3_state_t *h = XXH3_createState();
    kern_linear *ready = NULL;
    int rc = -1;
    if (!specs || !m->layers || !h) {
        kv_errf(e, "out of memory");
        goto done;
    }
    tensors_list(c, specs, n);
    XXH3_64bits_reset(h);
    int64_t total = tensors_weights(specs, n), done = 0;
    for (int i = 0; i < n; i++)
        if (source_check(src, &specs[i], e) < 0)
            goto done;
    row_source run = *src;
    run.specs = specs;
    run.pool = o ? o->pool : NULL;
    if (pool_threads(run.pool) > 1 && (ready = calloc((size_t)n, sizeof *ready)) != NULL) {
        run.ready = ready;
        alloc_job aj = {.src = &run, .n = n, .wt = m->wtype};
        pool_run(run.pool, alloc_task, &aj, n);
    }
    src = &run;
    for (int i = 0; i < n; i++) {
        const tensor_spec *s = &specs[i];
        int r;
        *src->nonfinite = 0;
        if (s->layer >= 0)
            r = load_layer_tensor(src, s, m, h, e);
        else if (i == 0)
            r = load_linear(src, s, m->wtype, false, &m->embed, h, e);
        else
            r = load_model_tensor(src, s, m, h, e);
        if (r < 0)
            goto done;
        done += spec_rows(s) * spec_cols(s);
        if (o && o->progress)
            o->progress(o->progress_ctx, done, total, s->name);
        note_nonfinite(src, s, *src->nonfinite, m);
    }
    m->fingerprint = XXH3_64bits_digest(h);
    rc = 0;
done:
    for (int i = 0; ready && i < n; i++)     /* left over when a load failed */
        kern_linear_free(&ready[i]);
    free(ready);
    XXH3_freeState(h);
    free(specs);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Public entry points                                                  */

int model_from_preset(const char *preset, uint64_t seed, const model_opts *o,
                      kv_model *m, kv_err *e)
{
    kv_config c;
    char label[96];
    memset(m, 0, sizeof *m);
    if (config_preset(preset, &c, e) < 0)
        return -1;
    snprintf(label, sizeof label, "preset %s", preset);
    return model_from_config(&c, label, seed, o, m, e);
}

int model_from_config(const kv_config *c, const char *label, uint64_t seed,
                      const model_opts *o, kv_model *m, kv_err *e)
{
    memset(m, 0, sizeof *m);
    if (config_validate(c, e) < 0)
        return kv_err_prefix(e, label);
    m->cfg = *c;
    m->wtype = (o && o->wtype >= 0) ? (kern_wtype)o->wtype : KERN_F32;
    snprintf(m->source, sizeof m->source, "%s seed %llu", label, (unsigned long long)seed);
    uint64_t nonfinite = 0;
    row_source src = {.cfg = &m->cfg, .st = NULL, .seed = seed, .dir = label,
                      .nonfinite = &nonfinite};
    if (load_all(&src, o, m, e) < 0) {
        model_free(m);
        return -1;
    }
    return 0;
}

void model_resolve_prefix(kv_config *c, const st_file *st)
{
    static const char *const alternatives[] = {
        "model.", "language_model.model.", "model.language_model.", ""};
    char name[160];
    snprintf(name, sizeof name, "%sembed_tokens.weight", c->tensor_prefix);
    if (st_find(st, name))
        return;
    for (size_t i = 0; i < sizeof alternatives / sizeof *alternatives; i++) {
        snprintf(name, sizeof name, "%sembed_tokens.weight", alternatives[i]);
        if (st_find(st, name)) {
            snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "%s", alternatives[i]);
            return;
        }
    }
}

/* A config.json whose num_hidden_layers is below the layers the checkpoint
 * holds would run its first layers only and call the result the model's:
 * every verdict on it would be about another network. Refused, naming the
 * highest layer found. */
static int check_layer_count(const char *dir, const kv_config *c, const st_file *st, kv_err *e)
{
    const size_t plen = strlen(c->tensor_prefix);
    long top = -1;
    const st_tensor *at = NULL;
    for (size_t i = 0; i < st_count(st); i++) {
        const st_tensor *t = st_at(st, i);
        const char *p = t->name;
        if (strncmp(p, c->tensor_prefix, plen) != 0 || strncmp(p + plen, "layers.", 7) != 0)
            continue;
        p += plen + 7;
        char *end;
        errno = 0;
        const long l = strtol(p, &end, 10);
        if (end != p && *end == '.' && errno == 0 && l > top)
            top = l, at = t;
    }
    if (top >= c->n_layers)
        return kv_errf(e, "%s/config.json: num_hidden_layers is %d, but the checkpoint holds "
                       "layer %ld (tensor '%s' in %s): a config cut short would run only the "
                       "first layers", dir, c->n_layers, top, at->name, at->file);
    return 0;
}

int model_load_dir(const char *dir, const model_opts *o, kv_model *m, kv_err *e)
{
    char path[4096];
    memset(m, 0, sizeof *m);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (config_load_json(path, &m->cfg, e) < 0)
        return -1;
    st_file *st = st_open_dir(dir, e);
    if (!st)
        return -1;
    model_resolve_prefix(&m->cfg, st);
    if (check_layer_count(dir, &m->cfg, st, e) < 0) {
        st_close(st);
        return -1;
    }
    char embed_name[160];
    snprintf(embed_name, sizeof embed_name, "%sembed_tokens.weight", m->cfg.tensor_prefix);
    const st_tensor *emb = st_find(st, embed_name);
    if (o && o->wtype >= 0)
        m->wtype = (kern_wtype)o->wtype;
    else
        m->wtype = (emb && emb->dtype == ST_BF16) ? KERN_BF16 : KERN_F32;
    snprintf(m->source, sizeof m->source, "%s", dir);
    uint64_t nonfinite = 0;
    row_source src = {.cfg = &m->cfg, .st = st, .seed = 0, .dir = dir, .nonfinite = &nonfinite};
    int rc = load_all(&src, o, m, e);
    st_close(st);
    if (rc < 0)
        model_free(m);
    return rc;
}

int model_open(const char *spec, uint64_t seed, const model_opts *o, kv_model *m, kv_err *e)
{
    struct stat sb;
    if (strchr(spec, '/') || (stat(spec, &sb) == 0 && S_ISDIR(sb.st_mode)))
        return model_load_dir(spec, o, m, e);
    return model_from_preset(spec, seed, o, m, e);
}

const kern_linear *model_lm_head(const kv_model *m)
{
    return m->cfg.tie_embeddings ? &m->embed : &m->lm_head;
}

void model_free(kv_model *m)
{
    if (!m)
        return;
    if (m->layers) {
        for (int i = 0; i < m->cfg.n_layers; i++) {
            model_layer *ly = &m->layers[i];
            kern_linear *lin[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo,
                                  &ly->w_gate, &ly->w_up, &ly->w_down,
                                  &ly->w_pl_gate, &ly->w_pl_proj, &ly->router,
                                  &ly->wq_a, &ly->wkv_a, &ly->wkv_b};
            for (size_t j = 0; j < sizeof lin / sizeof *lin; j++)
                kern_linear_free(lin[j]);
            for (int x = 0; x < m->cfg.n_experts; x++) {
                if (ly->gate_up)
                    kern_linear_free(&ly->gate_up[x]);
                if (ly->down)
                    kern_linear_free(&ly->down[x]);
            }
            for (int h = 0; h < m->cfg.n_heads; h++) {
                if (ly->uk_t)
                    kern_linear_free(&ly->uk_t[h]);
                if (ly->uv)
                    kern_linear_free(&ly->uv[h]);
            }
            free(ly->uk_t);
            free(ly->uv);
            free(ly->gate_up);
            free(ly->down);
            free(ly->sinks);
            free(ly->router_sel_bias);
            free(ly->q_a_norm);
            free(ly->kv_a_norm);
            free(ly->attn_norm);
            free(ly->ffn_norm);
            free(ly->post_attn_norm);
            free(ly->post_ffn_norm);
            free(ly->q_norm);
            free(ly->k_norm);
            free(ly->pl_norm);
            free(ly->layer_scalar);
        }
        free(m->layers);
    }
    free(m->pl_embed.data);
    kern_linear_free(&m->pl_model_proj);
    free(m->pl_proj_norm);
    kern_linear_free(&m->embed);
    kern_linear_free(&m->lm_head);
    free(m->final_norm);
    memset(m, 0, sizeof *m);
}

/* ------------------------------------------------------------------ */
/* Writing a synthetic preset as a Hugging Face folder                  */

static int ensure_dir(const char *dir, bool *created, kv_err *e)
{
    struct stat sb;
    *created = false;
    if (stat(dir, &sb) == 0)
        return S_ISDIR(sb.st_mode) ? 0 : kv_errf(e, "%s: exists and is not a directory", dir);
    if (mkdir(dir, 0777) < 0)
        return kv_errf(e, "%s: cannot create directory: %s", dir, strerror(errno));
    *created = true;
    return 0;
}

/* A folder this run created and could not fill (a full disk, the file-size
 * limit) is removed with what was written into it: no model folder is left
 * half made. A folder that was there keeps its files. */
static int undo_folder(const char *dir, bool created)
{
    if (created) {
        char path[4096];
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        unlink(path);
        snprintf(path, sizeof path, "%s/config.json", dir);
        unlink(path);
        rmdir(dir);
    }
    return -1;
}

static int gen_folder(const kv_config *cfg, const char *preset, uint64_t seed, int bf16,
                      const char *dir, kern_pool *pool, model_progress_fn progress, void *ctx,
                      kv_err *e);

int model_gen_folder(const char *preset, uint64_t seed, int bf16, const char *dir, kv_err *e)
{
    return model_gen_folder_pool(preset, seed, bf16, dir, NULL, NULL, NULL, e);
}

int model_gen_folder_progress(const char *preset, uint64_t seed, int bf16, const char *dir,
                              model_progress_fn progress, void *ctx, kv_err *e)
{
    return model_gen_folder_pool(preset, seed, bf16, dir, NULL, progress, ctx, e);
}

/* One tensor drawn (and narrowed to bf16) by blocks of rows on the pool:
 * each row has its own stream, so the bytes are those of one thread. */
typedef struct {
    const kv_config *cfg;
    const tensor_spec *s;
    uint64_t seed;
    float *f32;             /* (rows, cols), or NULL when bf16 is the output */
    uint16_t *bf16;         /* (rows, cols), or NULL when f32 is */
    atomic_int failed;      /* a task found no memory */
} gen_job;

static void gen_task(void *ctx, int task)
{
    gen_job *j = ctx;
    const int64_t rows = spec_rows(j->s), cols = spec_cols(j->s);
    const int64_t r0 = (int64_t)task * PACK_ROWS;
    const int64_t nr = rows - r0 < PACK_ROWS ? rows - r0 : PACK_ROWS;
    if (j->f32) {
        synth_rows(j->cfg, j->s, j->seed, r0, nr, j->f32 + r0 * cols);
        return;
    }
    float *rowbuf = malloc((size_t)(nr * cols) * sizeof(float));
    if (!rowbuf) {
        atomic_store(&j->failed, 1);
        return;
    }
    synth_rows(j->cfg, j->s, j->seed, r0, nr, rowbuf);
    st_f32_to_bf16_n(rowbuf, (size_t)(nr * cols), j->bf16 + r0 * cols);
    free(rowbuf);
}

static int gen_tensor(gen_job *j, kern_pool *pool)
{
    if (j->s->ndim == 1) {          /* one stream: one task */
        float *v = j->f32 ? j->f32 : malloc((size_t)j->s->shape[0] * sizeof(float));
        if (!v)
            return -1;
        synth_tensor(j->cfg, j->s, j->seed, v);
        if (!j->f32) {
            st_f32_to_bf16_n(v, (size_t)j->s->shape[0], j->bf16);
            free(v);
        }
        return 0;
    }
    atomic_init(&j->failed, 0);
    pool_run(pool, gen_task, j, (int)((spec_rows(j->s) + PACK_ROWS - 1) / PACK_ROWS));
    return atomic_load(&j->failed) ? -1 : 0;
}

/* Writes one tensor at a time into the file, on a thread of its own when
 * asked: the copy into the page cache is a third of a big preset's time
 * and overlaps with drawing the next tensor. Without a thread (or when
 * none can start) bg_writer_post writes at once. The st_writer is used by
 * one thread at a time: the writer's, between post and wait. */
typedef struct {
    st_writer *w;
    bool threaded;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const void *data;       /* the posted tensor, NULL when idle */
    size_t nbytes;
    bool is_f32;
    bool quit;
    int rc;                 /* the first failure, with err */
    kv_err err;
} bg_writer;

static int bg_write(bg_writer *b, const void *data, size_t nbytes, bool is_f32)
{
    /* bf16 values are written as they lie in memory: the file is little
     * endian, as is the host (st_writer_put_f32 relies on it for F32 too). */
    return is_f32 ? st_writer_put_f32(b->w, data, &b->err)
                  : st_writer_put_raw(b->w, data, nbytes, &b->err);
}

static void *bg_writer_main(void *arg)
{
    bg_writer *b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (!b->data && !b->quit)
            pthread_cond_wait(&b->cv, &b->mu);
        if (!b->data)
            break;
        const void *data = b->data;
        pthread_mutex_unlock(&b->mu);
        int rc = b->rc == 0 ? bg_write(b, data, b->nbytes, b->is_f32) : 0;
        pthread_mutex_lock(&b->mu);
        if (rc < 0)
            b->rc = -1;
        b->data = NULL;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static void bg_writer_start(bg_writer *b, st_writer *w, bool threaded)
{
    memset(b, 0, sizeof *b);
    b->w = w;
    if (!threaded || pthread_mutex_init(&b->mu, NULL) != 0)
        return;
    if (pthread_cond_init(&b->cv, NULL) != 0) {
        pthread_mutex_destroy(&b->mu);
        return;
    }
    if (pthread_create(&b->thread, NULL, bg_writer_main, b) != 0) {
        pthread_cond_destroy(&b->cv);
        pthread_mutex_destroy(&b->mu);
        return;
    }
    b->threaded = true;
}

/* Hands data (nbytes, the next declared tensor) over; it must stay
 * untouched until the next bg_writer_wait. */
static void bg_writer_post(bg_writer *b, const void *data, size_t nbytes, bool is_f32)
{
    if (!b->threaded) {
        if (b->rc == 0 && bg_write(b, data, nbytes, is_f32) < 0)
            b->rc = -1;
        return;
    }
    pthread_mutex_lock(&b->mu);
    b->data = data;
    b->nbytes = nbytes;
    b->is_f32 = is_f32;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

/* Waits until the posted tensor is written; -1 (with e) once a write failed. */
static int bg_writer_wait(bg_writer *b, kv_err *e)
{
    if (b->threaded) {
        pthread_mutex_lock(&b->mu);
        while (b->data)
            pthread_cond_wait(&b->cv, &b->mu);
        pthread_mutex_unlock(&b->mu);
    }
    if (b->rc < 0) {
        *e = b->err;
        return -1;
    }
    return 0;
}

static void bg_writer_stop(bg_writer *b)
{
    if (!b->threaded)
        return;
    pthread_mutex_lock(&b->mu);
    b->quit = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->thread, NULL);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    b->threaded = false;
}

int model_gen_folder_pool(const char *preset, uint64_t seed, int bf16, const char *dir,
                          kern_pool *pool, model_progress_fn progress, void *ctx, kv_err *e)
{
    kv_config c;
    if (config_preset(preset, &c, e) < 0)
        return -1;
    return gen_folder(&c, preset, seed, bf16, dir, pool, progress, ctx, e);
}

int model_gen_folder_config(const kv_config *c, uint64_t seed, int bf16, const char *dir,
                            kv_err *e)
{
    if (config_validate(c, e) < 0)
        return kv_err_prefix(e, dir);
    return gen_folder(c, "", seed, bf16, dir, NULL, NULL, NULL, e);
}

static int gen_folder(const kv_config *cfg, const char *preset, uint64_t seed, int bf16,
                      const char *dir, kern_pool *pool, model_progress_fn progress, void *ctx,
                      kv_err *e)
{
    const kv_config c = *cfg;
    char path[4096], seedtxt[32];
    bool created;
    if (ensure_dir(dir, &created, e) < 0)
        return -1;
    int n = tensors_list(&c, NULL, 0);
    tensor_spec *specs = calloc((size_t)n, sizeof *specs);
    st_decl *decls = calloc((size_t)n, sizeof *decls);
    if (!specs || !decls) {
        free(specs);
        free(decls);
        kv_errf(e, "out of memory");
        return undo_folder(dir, created);
    }
    tensors_list(&c, specs, n);
    int64_t total = tensors_weights(specs, n);
    for (int i = 0; i < n; i++) {
        decls[i].name = specs[i].name;
        decls[i].dtype = bf16 ? ST_BF16 : ST_F32;
        decls[i].ndim = specs[i].ndim;
        for (int d = 0; d < specs[i].ndim; d++)
            decls[i].shape[d] = specs[i].shape[d];
    }
    snprintf(seedtxt, sizeof seedtxt, "%llu", (unsigned long long)seed);
    /* A config that is no preset's has no "preset" entry; a preset's keeps
     * the order the files have always had (their bytes are pinned). */
    const char *meta_preset[] = {"format", "pt", "generator", "kvdiff gen", "preset", preset,
                                 "seed", seedtxt, NULL};
    const char *meta_config[] = {"format", "pt", "generator", "kvdiff gen", "seed", seedtxt,
                                 NULL};
    const char **meta = preset[0] ? meta_preset : meta_config;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    /* Buffers as large as the largest tensor, reused for every tensor: a
     * fresh one each time had the kernel zero gigabytes of pages. Two
     * with a pool: the writer thread copies one into the file while the
     * next tensor is drawn into the other. */
    size_t most = 0;
    for (int i = 0; i < n; i++) {
        size_t cnt = (size_t)spec_rows(&specs[i]) * (size_t)spec_cols(&specs[i]);
        most = cnt > most ? cnt : most;
    }
    const size_t esz = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int nbuf = pool_threads(pool) > 1 ? 2 : 1;
    void *bufs[2] = {malloc(most * esz), nbuf == 2 ? malloc(most * esz) : NULL};
    int rc = 0;
    if (!bufs[0] || (nbuf == 2 && !bufs[1]))
        rc = kv_errf(e, "out of memory generating %s", preset);
    st_writer *w = rc == 0 ? st_writer_open(path, decls, (size_t)n, meta, e) : NULL;
    bg_writer bw;
    if (w)
        bg_writer_start(&bw, w, nbuf == 2);
    else
        rc = -1;
    int64_t written = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        size_t cnt = (size_t)spec_rows(&specs[i]) * (size_t)spec_cols(&specs[i]);
        void *buf = bufs[i % nbuf];
        gen_job job = {.cfg = &c, .s = &specs[i], .seed = seed,
                       .f32 = bf16 ? NULL : buf, .bf16 = bf16 ? buf : NULL};
        if (gen_tensor(&job, pool) < 0) {
            rc = kv_errf(e, "out of memory generating '%s'", specs[i].name);
            break;
        }
        if (bg_writer_wait(&bw, e) < 0) {       /* tensor i - 1 is in the file */
            rc = -1;
            break;
        }
        if (i > 0 && progress)
            progress(ctx, written, total, specs[i - 1].name);
        bg_writer_post(&bw, buf, cnt * esz, !bf16);
        written += (int64_t)cnt;
    }
    if (w) {
        if (bg_writer_wait(&bw, e) < 0)
            rc = -1;
        else if (rc == 0 && n > 0 && progress)
            progress(ctx, written, total, specs[n - 1].name);
        bg_writer_stop(&bw);
    }
    free(bufs[0]);
    free(bufs[1]);
    if (rc == 0) {
        rc = st_writer_finish(w, e);
        w = NULL;
    }
    st_writer_abort(w);
    free(specs);
    free(decls);
    if (rc < 0)
        return undo_folder(dir, created);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (config_write_json_dtype(&c, path, bf16 ? "bfloat16" : "float32", e) < 0)
        return undo_folder(dir, created);
    return 0;
}
