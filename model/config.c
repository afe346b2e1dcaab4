/* config.c — kv_config: reading and writing Hugging Face config.json
 * (llama, qwen2, qwen3, gemma3_text, gemma3, gemma4_text, gemma4), validation, built-in presets and the
 * one-line description.
 *
 * Defaults are the transformers library's own (LlamaConfig, Qwen2Config,
 * Qwen3Config, Gemma3TextConfig), except that the size fields whose library
 * defaults describe some 7B model (hidden_size, num_hidden_layers,
 * intermediate_size, and for llama/qwen2/qwen3 also num_attention_heads and
 * vocab_size) are required: a config.json without them is a mistake, not a
 * request for a 7B model. Features the engines do not implement are refused
 * with a message naming the field, never ignored. */
#include "config.h"
#include "config_json.h"
#include "family.h"
#include "kernels.h"
#include "infile.h"
#include "observer.h"
#include "outfile.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- limits: beyond these a value is a typo or an attack ---------------- */

#define MAX_HIDDEN       KV_MAX_HIDDEN
#define MAX_HEADS        KV_MAX_HEADS
#define MAX_HEAD_DIM     KV_MAX_HEAD_DIM
#define MAX_INTERMEDIATE KV_MAX_INTERMEDIATE
#define MAX_VOCAB        KV_MAX_VOCAB
#define MAX_POSITIONS    KV_MAX_POSITIONS
#define MAX_PATTERN      (1 << 20)
#define MAX_MATRIX       ((long long)INT32_MAX) /* elements of one weight matrix */
#define MAX_TABLE        (1LL << 34)            /* elements of Gemma 4's per-layer table */
#define MIN_THETA        1.0
#define MAX_THETA        1e15
#define MAX_FACTOR       1e6
#define MAX_SCALAR       1e9
#define CONFIG_MAX_BYTES (16L << 20)

/* ---- what each family fixes: model/families/, one file each (family.h) -- */

static const kv_family *fam(const kv_config *c)
{
    return family_of(c->arch);
}

#define GEMMA_DEF_QPAS         256.0
#define GEMMA_DEF_LOCAL_THETA  10000.0

/* Gemma 3 and 4: sliding layers, KV sharing, sandwich norms, GELU. */
static bool is_gemma(kv_arch a)
{
    return a == ARCH_GEMMA3 || a == ARCH_GEMMA4;
}

/* ---- derived fields, shared by the parser and the presets --------------- */

static double scale_of(double x)
{
    return 1.0 / sqrt(x);
}

/* Gemma's embedding multiplier: sqrt(hidden) rounded to float32. For every
 * hidden size accepted here sqrtf((float)h) equals (float)sqrt((double)h),
 * which is what transformers computes. */
static float gemma_embed_scale(int hidden)
{
    return sqrtf((float)hidden);
}

/* Everything that follows from the family alone (Llama's and Qwen3's
 * attention biases follow attention_bias; they start off). */
void config_family_flags(kv_config *c)
{
    c->norm_plus_one = c->qk_norm = c->sandwich_norms = false;
    c->qkv_bias = c->o_bias = false;
    c->act = ACT_SILU;
    c->v_norm = c->layer_scalar = c->attn_sinks = false;
    c->route = ROUTE_TOPK_SOFTMAX;
    const kv_family *f = fam(c);
    if (f && f->flags)
        f->flags(c);
}

void family_set(kv_config *c, kv_arch arch)
{
    c->arch = arch;
    snprintf(c->model_type, sizeof c->model_type, "%s", family_of(arch)->model_type);
    config_family_flags(c);
    snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "model.");
    snprintf(c->lm_head_name, sizeof c->lm_head_name, "lm_head.weight");
}

static double yarn_mscale(double factor, double mscale);

/* DeepSeek's YaRN also scales q.k, by m(mscale_all_dim)^2 (1 without it). */
static double softmax_mscale2(const kv_config *c)
{
    const kv_rope_scaling *s = &c->rope_scaling;
    if (s->type != ROPE_SCALE_YARN || !(s->mscale_all_dim > 0))
        return 1.0;
    double m = yarn_mscale(s->factor, s->mscale_all_dim);
    return m * m;
}

/* Scales that follow from the sizes (call after head_dim / qpas are set). */
static void set_scales(kv_config *c)
{
    if (c->arch == ARCH_GEMMA3) {
        c->embed_scale = gemma_embed_scale(c->hidden);
        c->attn_scale = scale_of(c->query_pre_attn_scalar);
    } else if (c->arch == ARCH_GEMMA4) {
        /* Gemma 4 scales q.k by 1 (its q_norm/k_norm set the size). */
        c->embed_scale = gemma_embed_scale(c->hidden);
        c->attn_scale = 1.0;
        c->query_pre_attn_scalar = 0.0;
    } else {
        c->embed_scale = 1.0f;
        c->attn_scale = scale_of((double)c->head_dim) * softmax_mscale2(c);
        c->query_pre_attn_scalar = 0.0;
    }
}

void cfg_yarn(kv_config *c, double factor, int original_max, bool truncate)
{
    kv_rope_scaling *s = &c->rope_scaling;
    s->type = ROPE_SCALE_YARN;
    s->factor = factor;
    s->original_max_position = original_max;
    s->beta_fast = 32.0;
    s->beta_slow = 1.0;
    s->truncate = truncate;
    s->attn_factor = yarn_mscale(factor, 1.0);
}

/* Gemma 3's sliding_window_pattern P: layer i slides iff (i+1) % P != 0. */
void cfg_layers_from_pattern(kv_config *c, int pattern)
{
    for (int i = 0; i < c->n_layers; i++)
        c->layer_type[i] = (i + 1) % pattern != 0 ? ATTN_SLIDING : ATTN_GLOBAL;
}

/* Gemma 3n's rule: a KV-shared layer reads the last layer before the shared
 * block that has its attention type. -1 when there is none. */
static int shared_owner(const kv_config *c, int first_shared, int layer)
{
    for (int j = first_shared - 1; j >= 0; j--)
        if (c->layer_type[j] == c->layer_type[layer])
            return j;
    return -1;
}

/* Sets kv_owner for the last n_shared layers sharing KV. Returns -1 on
 * success, else the first layer that has no layer to read. */
static int set_owners(kv_config *c, int n_shared)
{
    int first_shared = c->n_layers - n_shared;
    for (int i = 0; i < c->n_layers; i++) {
        int owner = i < first_shared ? i : shared_owner(c, first_shared, i);
        if (owner < 0)
            return i;
        c->kv_owner[i] = (int16_t)owner;
    }
    return -1;
}

/* How many trailing layers read another layer's cache. */
static int count_shared(const kv_config *c)
{
    int layers = c->n_layers < 0 ? 0 : c->n_layers > KV_MAX_LAYERS ? KV_MAX_LAYERS : c->n_layers;
    int n = 0;
    while (n < layers && c->kv_owner[layers - 1 - n] != layers - 1 - n)
        n++;
    return n;
}

const char *cj_type_name(int t)
{
    return t == ATTN_SLIDING ? "sliding_attention" : "full_attention";
}

/* ---- JSON reading helpers ----------------------------------------------- */

int cj_fail(const cfg_jctx *cx, const char *key, const char *fmt, ...)
{
    char what[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kv_errf(cx->e, "%s: %s%s %s", cx->file, cx->scope, key, what);
}

/* Shortest text that reads back as exactly v; integral values as "500000.0"
 * (Python's repr). */
void cj_fmt_double(char *buf, size_t n, double v)
{
    if (v == floor(v) && fabs(v) < 1e16) {
        snprintf(buf, n, "%.1f", v);
        return;
    }
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            return;
    }
}

/* A short description of a JSON value for messages: `the string "64"`. */
const char *cj_desc(const json_t *v, char *buf, size_t n)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    case JSON_NULL: return "null";
    case JSON_STRING: snprintf(buf, n, "the string \"%.40s\"", json_string_value(v)); break;
    case JSON_INTEGER: snprintf(buf, n, "%" JSON_INTEGER_FORMAT, json_integer_value(v)); break;
    case JSON_REAL: cj_fmt_double(buf, n, json_real_value(v)); break;
    }
    return buf;
}

const char *cj_subkey(char *buf, size_t n, const char *path, const char *key)
{
    snprintf(buf, n, "%s.%s", path, key);
    return buf;
}

bool cj_present(const json_t *v)
{
    return v != NULL && !json_is_null(v);
}

int cj_want_int(const cfg_jctx *cx, const char *key, const json_t *v,
                    long long lo, long long hi, int *out)
{
    char d[64];
    if (!json_is_integer(v))
        return cj_fail(cx, key, "is %s; expected an integer", cj_desc(v, d, sizeof d));
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return cj_fail(cx, key, "is %lld; expected %lld..%lld", x, lo, hi);
    *out = (int)x;
    return 0;
}

/* An integer field; absent gives def unless required. null is an error. */
int cj_get_int(const cfg_jctx *cx, const json_t *obj, const char *key, bool required,
                   int def, long long lo, long long hi, int *out)
{
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        if (required)
            return cj_fail(cx, key, "is missing");
        *out = def;
        return 0;
    }
    return cj_want_int(cx, key, v, lo, hi, out);
}

/* A number in (lo, hi] (lo_open) or [lo, hi]; integers are accepted. */
int cj_want_num(const cfg_jctx *cx, const char *key, const json_t *v,
                    double lo, bool lo_open, double hi, double *out)
{
    char d[64];
    if (!json_is_number(v))
        return cj_fail(cx, key, "is %s; expected a number", cj_desc(v, d, sizeof d));
    double x = json_number_value(v);
    bool low_ok = lo_open ? x > lo : x >= lo;
    if (!isfinite(x) || !low_ok || x > hi)
        return cj_fail(cx, key, "is %s; expected a number %s %g and <= %g",
                     cj_desc(v, d, sizeof d), lo_open ? ">" : ">=", lo, hi);
    *out = x;
    return 0;
}

int cj_get_num(const cfg_jctx *cx, const json_t *obj, const char *key, double def,
                   double lo, bool lo_open, double hi, double *out)
{
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    return cj_want_num(cx, key, v, lo, lo_open, hi, out);
}

int cj_get_bool(const cfg_jctx *cx, const json_t *obj, const char *key, bool def, bool *out)
{
    char d[64];
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v))
        return cj_fail(cx, key, "is %s; expected true or false", cj_desc(v, d, sizeof d));
    *out = json_is_true(v);
    return 0;
}

/* A string field; absent gives def (NULL def: required). */
int cj_get_str(const cfg_jctx *cx, const json_t *obj, const char *key,
                   const char *def, const char **out)
{
    char d[64];
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        if (!def)
            return cj_fail(cx, key, "is missing");
        *out = def;
        return 0;
    }
    if (!json_is_string(v))
        return cj_fail(cx, key, "is %s; expected a string", cj_desc(v, d, sizeof d));
    *out = json_string_value(v);
    return 0;
}

/* Refuses a boolean feature switch that is true. */
int cj_refuse_true(const cfg_jctx *cx, const json_t *obj, const char *key, const char *why)
{
    bool on = false;
    if (cj_get_bool(cx, obj, key, false, &on))
        return -1;
    return on ? cj_fail(cx, key, "is true; %s", why) : 0;
}

/* ---- sizes -------------------------------------------------------------- */

static int parse_heads(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const kv_family *a = fam(c);
    bool gemma = c->arch == ARCH_GEMMA3;
    if (cj_get_int(cx, obj, "num_attention_heads", a->sizes_required, a->def_heads,
                1, MAX_HEADS, &c->n_heads))
        return -1;
    /* llama and qwen2 default KV heads to the query heads (null too);
     * Gemma3TextConfig defaults to 4. */
    const json_t *kv = json_object_get(obj, "num_key_value_heads");
    if (c->arch == ARCH_GEMMA4 && !cj_present(kv))
        return cj_fail(cx, "num_key_value_heads", "is missing (gemma4_text has no default)");
    if (!kv || (json_is_null(kv) && !gemma))
        c->n_kv_heads = gemma ? a->def_kv_heads : c->n_heads;
    else if (cj_want_int(cx, "num_key_value_heads", kv, 1, MAX_HEADS, &c->n_kv_heads))
        return -1;
    if (c->n_heads % c->n_kv_heads != 0)
        return cj_fail(cx, "num_key_value_heads", "is %d, which does not divide "
                     "num_attention_heads %d", c->n_kv_heads, c->n_heads);
    return 0;
}

static int parse_head_dim(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *hd = json_object_get(obj, "head_dim");
    /* Gemma3TextConfig and Qwen3Config give head_dim a default of its own
     * (a null there is an error); LlamaConfig and Qwen2Config derive it. */
    bool own_default = fam(c)->def_head_dim > 0;
    if (cj_present(hd) || (hd && own_default)) {
        if (cj_want_int(cx, "head_dim", hd, 1, MAX_HEAD_DIM, &c->head_dim))
            return -1;
    } else if (own_default) {
        c->head_dim = fam(c)->def_head_dim;
    } else if (c->hidden % c->n_heads != 0) {
        return cj_fail(cx, "head_dim", "is missing and hidden_size %d is not a multiple "
                     "of num_attention_heads %d", c->hidden, c->n_heads);
    } else {
        c->head_dim = c->hidden / c->n_heads;
    }
    if (c->head_dim % 2 != 0)
        return cj_fail(cx, "head_dim", "is %d; RoPE needs an even head_dim", c->head_dim);
    return 0;
}

static int parse_sizes(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const kv_family *a = fam(c);
    if (cj_get_int(cx, obj, "hidden_size", true, 0, 1, MAX_HIDDEN, &c->hidden)
        || cj_get_int(cx, obj, "num_hidden_layers", true, 0, 1, KV_MAX_LAYERS, &c->n_layers)
        || cj_get_int(cx, obj, "intermediate_size", true, 0, 1, MAX_INTERMEDIATE, &c->intermediate)
        || parse_heads(cx, obj, c) || parse_head_dim(cx, obj, c)
        || cj_get_int(cx, obj, "vocab_size", a->sizes_required, a->def_vocab, 1, MAX_VOCAB, &c->vocab)
        || cj_get_int(cx, obj, "max_position_embeddings", false, a->def_max_positions,
                   1, MAX_POSITIONS, &c->max_positions))
        return -1;
    return 0;
}

/* ---- norm, activation, features the engines do not implement ------------ */

static int parse_act(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const char *key = fam(c)->act_key;
    bool gemma = is_gemma(c->arch);
    const char *act = NULL;
    if (cj_get_str(cx, obj, key, gemma ? "gelu_pytorch_tanh" : "silu", &act))
        return -1;
    bool ok = gemma ? !strcmp(act, "gelu_pytorch_tanh") || !strcmp(act, "gelu_tanh")
                    : !strcmp(act, "silu") || !strcmp(act, "swish");
    if (!ok)
        return cj_fail(cx, key, "'%.40s' is not supported for %s (kvdiff runs %s)", act,
                     c->model_type, gemma ? "gelu_pytorch_tanh" : "silu");
    return 0;
}

/* attention_bias (LlamaAttention, Qwen3Attention): q, k, v and o_proj
 * all get a bias. */
static int parse_attention_bias(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    bool on = false;
    if (cj_get_bool(cx, obj, "attention_bias", false, &on))
        return -1;
    c->qkv_bias = c->o_bias = on;
    return 0;
}

/* Gemma 4: MoE and bidirectional text attention are out of scope;
 * "vision" (bidirectional over image tokens only) leaves text causal. */
static int parse_gemma4_switches(const cfg_jctx *cx, const json_t *obj)
{
    char d[64];
    const json_t *cap = json_object_get(obj, "attn_logit_softcapping");
    if (cj_present(cap))
        return cj_fail(cx, "attn_logit_softcapping", "is %s; attention logit softcapping "
                     "is not supported (Gemma 4 has none)", cj_desc(cap, d, sizeof d));
    const json_t *bi = json_object_get(obj, "use_bidirectional_attention");
    if (cj_present(bi) && !json_is_false(bi)
        && !(json_is_string(bi) && !strcmp(json_string_value(bi), "vision")))
        return cj_fail(cx, "use_bidirectional_attention", "is %s; kvdiff runs causal "
                     "decoders only", cj_desc(bi, d, sizeof d));
    const json_t *ne = json_object_get(obj, "num_experts");
    if (cj_present(ne) && !(json_is_integer(ne) && json_integer_value(ne) == 0))
        return cj_fail(cx, "num_experts", "is %s; Gemma 4's mixture-of-experts models are "
                     "not supported (dense E2B/E4B-style models only)", cj_desc(ne, d, sizeof d));
    return cj_refuse_true(cx, obj, "enable_moe_block", "Gemma 4's mixture-of-experts block is "
                       "not supported (dense E2B/E4B-style models only)")
        || cj_refuse_true(cx, obj, "attention_bias", "biased attention projections are not "
                       "supported for gemma4_text");
}

static int parse_family_switches(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    switch (c->arch) {
    case ARCH_LLAMA:
        return parse_attention_bias(cx, obj, c)
            || cj_refuse_true(cx, obj, "mlp_bias", "biased MLP projections are not "
                           "supported for llama");
    case ARCH_QWEN2:
        return cj_refuse_true(cx, obj, "use_sliding_window", "sliding-window attention is "
                           "not supported for qwen2 (kvdiff runs every layer global)");
    case ARCH_QWEN3:
        return parse_attention_bias(cx, obj, c)
            || cj_refuse_true(cx, obj, "use_sliding_window", "sliding-window attention is "
                           "not supported for qwen3 (kvdiff runs every layer global)");
    case ARCH_GEMMA3: {
        char d[64];
        const json_t *cap = json_object_get(obj, "attn_logit_softcapping");
        if (cj_present(cap))
            return cj_fail(cx, "attn_logit_softcapping", "is %s; attention logit "
                         "softcapping is not supported (Gemma 3 sets it to null)",
                         cj_desc(cap, d, sizeof d));
        return cj_refuse_true(cx, obj, "attention_bias", "biased attention projections are "
                           "not supported for gemma3_text")
            || cj_refuse_true(cx, obj, "use_bidirectional_attention", "kvdiff runs causal "
                           "decoders only");
    }
    case ARCH_GEMMA4:
        return parse_gemma4_switches(cx, obj);
    default:
        return 0;   /* the family's parse hook reads its own keys */
    }
}

static int parse_gemma_scalars(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    if (cj_get_num(cx, obj, "query_pre_attn_scalar", GEMMA_DEF_QPAS, 0.0, true, MAX_SCALAR,
                &c->query_pre_attn_scalar))
        return -1;
    const json_t *cap = json_object_get(obj, "final_logit_softcapping");
    c->final_softcap = 0.0;
    if (cj_present(cap))
        return cj_want_num(cx, "final_logit_softcapping", cap, 0.0, true, MAX_SCALAR,
                        &c->final_softcap);
    return 0;
}

static int parse_norm_act(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    if (cj_get_num(cx, obj, "rms_norm_eps", 1e-6, 0.0, true, 1.0, &c->rms_eps)
        || parse_act(cx, obj, c) || parse_family_switches(cx, obj, c))
        return -1;
    if (c->arch == ARCH_GEMMA3)
        return parse_gemma_scalars(cx, obj, c);
    if (c->arch == ARCH_GEMMA4) {
        const json_t *cap = json_object_get(obj, "final_logit_softcapping");
        c->final_softcap = 0.0;
        if (cj_present(cap))
            return cj_want_num(cx, "final_logit_softcapping", cap, 0.0, true, MAX_SCALAR,
                            &c->final_softcap);
    }
    return 0;
}

/* ---- RoPE --------------------------------------------------------------- */

/* A string member of a RoPE object; "" when absent. */
static int rope_str(const cfg_jctx *cx, const char *path, const json_t *v, const char *key,
                    const char **out)
{
    char k[128], d[64];
    const json_t *s = json_object_get(v, key);
    *out = "";
    if (s && !json_is_string(s))
        return cj_fail(cx, cj_subkey(k, sizeof k, path, key), "is %s; expected a string",
                     cj_desc(s, d, sizeof d));
    if (s)
        *out = json_string_value(s);
    return 0;
}

/* The scaling type: rope_type, or the older key type (they must agree).
 * *key (may be NULL): which of the two said it, for messages. */
static int scaling_type_key(const cfg_jctx *cx, const char *path, const json_t *v,
                            bool required, const char **type, const char **key)
{
    const char *rt = NULL, *ty = NULL;
    if (rope_str(cx, path, v, "rope_type", &rt) || rope_str(cx, path, v, "type", &ty))
        return -1;
    if (*rt && *ty && strcmp(rt, ty) != 0)
        return cj_fail(cx, path, "has rope_type '%.40s' and type '%.40s'; they must agree", rt, ty);
    *type = *rt ? rt : *ty ? ty : NULL;
    if (key)
        *key = *rt || !*ty ? "rope_type" : "type";
    if (!*type && required)
        return cj_fail(cx, path, "has no rope_type");
    return 0;
}

static int scaling_type(const cfg_jctx *cx, const char *path, const json_t *v,
                        bool required, const char **type)
{
    return scaling_type_key(cx, path, v, required, type, NULL);
}

static int parse_llama3_scaling(const cfg_jctx *cx, const char *path, const json_t *v,
                                kv_rope_scaling *s)
{
    char k[128];
    const char *names[3] = { "factor", "low_freq_factor", "high_freq_factor" };
    double *dst[3] = { &s->factor, &s->low_freq_factor, &s->high_freq_factor };
    for (int i = 0; i < 3; i++) {
        const json_t *x = json_object_get(v, names[i]);
        cj_subkey(k, sizeof k, path, names[i]);
        if (!x)
            return cj_fail(cx, k, "is missing");
        if (cj_want_num(cx, k, x, 0.0, true, MAX_FACTOR, dst[i]))
            return -1;
    }
    const json_t *om = json_object_get(v, "original_max_position_embeddings");
    cj_subkey(k, sizeof k, path, "original_max_position_embeddings");
    if (!om)
        return cj_fail(cx, k, "is missing");
    if (cj_want_int(cx, k, om, 1, MAX_POSITIONS, &s->original_max_position))
        return -1;
    if (s->high_freq_factor <= s->low_freq_factor)
        return cj_fail(cx, path, "has high_freq_factor %g <= low_freq_factor %g",
                     s->high_freq_factor, s->low_freq_factor);
    return 0;
}

/* YaRN (HF _compute_yarn_parameters): factor; beta_fast 32 and beta_slow 1
 * by default; truncate (true by default) rounds the ramp's ends to whole
 * dims; attention_factor, else mscale / mscale_all_dim, else 0.1 ln(factor)
 * + 1 multiplies cos and sin. original_max_position_embeddings defaults to
 * max_position_embeddings (filled in by parse_rope, which knows it). */
static double yarn_mscale(double factor, double mscale)
{
    return factor <= 1.0 ? 1.0 : 0.1 * mscale * log(factor) + 1.0;
}

static int parse_yarn_scaling(const cfg_jctx *cx, const char *path, const json_t *v,
                              kv_rope_scaling *s)
{
    char k[128];
    const json_t *f = json_object_get(v, "factor");
    if (!f)
        return cj_fail(cx, cj_subkey(k, sizeof k, path, "factor"), "is missing");
    if (cj_want_num(cx, cj_subkey(k, sizeof k, path, "factor"), f, 0.0, true, MAX_FACTOR,
                    &s->factor))
        return -1;
    const json_t *om = json_object_get(v, "original_max_position_embeddings");
    if (cj_present(om) && cj_want_int(cx, cj_subkey(k, sizeof k, path,
                                                    "original_max_position_embeddings"),
                                      om, 1, MAX_POSITIONS, &s->original_max_position))
        return -1;
    const char *bf = "beta_fast", *bs = "beta_slow";
    if (cj_get_num(cx, v, bf, 32.0, 0.0, true, MAX_FACTOR, &s->beta_fast)
        || cj_get_num(cx, v, bs, 1.0, 0.0, true, MAX_FACTOR, &s->beta_slow)
        || cj_get_bool(cx, v, "truncate", true, &s->truncate))
        return -1;
    if (s->beta_fast <= s->beta_slow)
        return cj_fail(cx, path, "has beta_fast %g <= beta_slow %g", s->beta_fast, s->beta_slow);
    double af = 0, ms = 0, msa = 0;
    if (cj_get_num(cx, v, "mscale", 0.0, 0.0, false, MAX_FACTOR, &ms)
        || cj_get_num(cx, v, "mscale_all_dim", 0.0, 0.0, false, MAX_FACTOR, &msa))
        return -1;
    s->mscale = ms;
    s->mscale_all_dim = msa;
    const json_t *a = json_object_get(v, "attention_factor");
    if (cj_present(a))
        return cj_want_num(cx, cj_subkey(k, sizeof k, path, "attention_factor"), a, 0.0, true,
                           MAX_FACTOR, &s->attn_factor);
    af = ms > 0 && msa > 0 ? yarn_mscale(s->factor, ms) / yarn_mscale(s->factor, msa)
                           : yarn_mscale(s->factor, 1.0);
    s->attn_factor = af;
    return 0;
}

/* A rope_scaling object (or the scaling part of rope_parameters). */
int cj_parse_scaling(const cfg_jctx *cx, const char *path, const json_t *v,
                         bool type_required, kv_rope_scaling *s)
{
    char d[64], k[128];
    const char *type = NULL;
    memset(s, 0, sizeof *s);
    if (!cj_present(v))
        return 0;
    if (!json_is_object(v))
        return cj_fail(cx, path, "is %s; expected an object or null", cj_desc(v, d, sizeof d));
    if (scaling_type(cx, path, v, type_required, &type))
        return -1;
    if (!type || !strcmp(type, "default"))
        return 0;
    if (!strcmp(type, "llama3")) {
        s->type = ROPE_SCALE_LLAMA3;
        return parse_llama3_scaling(cx, path, v, s);
    }
    if (!strcmp(type, "yarn")) {
        s->type = ROPE_SCALE_YARN;
        return parse_yarn_scaling(cx, path, v, s);
    }
    if (strcmp(type, "linear") != 0)
        return cj_fail(cx, path, "type '%.40s' is not supported (kvdiff supports linear, "
                     "llama3 and yarn)", type);
    s->type = ROPE_SCALE_LINEAR;
    const json_t *f = json_object_get(v, "factor");
    cj_subkey(k, sizeof k, path, "factor");
    if (!f)
        return cj_fail(cx, k, "is missing");
    return cj_want_num(cx, k, f, 0.0, true, MAX_FACTOR, &s->factor);
}

/* partial_rotary_factor other than 1 (rotating part of each head) is refused. */
static int refuse_partial_rotary(const cfg_jctx *cx, const char *key, const json_t *v)
{
    double f = 1.0;
    if (!cj_present(v))
        return 0;
    if (cj_want_num(cx, key, v, 0.0, true, 1.0, &f))
        return -1;
    return f != 1.0 ? cj_fail(cx, key, "is %g; partial rotary embeddings are not "
                            "supported", f) : 0;
}

/* One entry of transformers 5's rope_parameters: scaling plus rope_theta. */
static int parse_rope_entry(const cfg_jctx *cx, const char *path, const json_t *v,
                            kv_rope_scaling *s, double *theta)
{
    char k[128];
    if (!json_is_object(v)) {
        char d[64];
        return cj_fail(cx, path, "is %s; expected an object", cj_desc(v, d, sizeof d));
    }
    if (cj_parse_scaling(cx, path, v, false, s))
        return -1;
    const json_t *t = json_object_get(v, "rope_theta");
    if (t && cj_want_num(cx, cj_subkey(k, sizeof k, path, "rope_theta"), t,
                      MIN_THETA, false, MAX_THETA, theta))
        return -1;
    return refuse_partial_rotary(cx, cj_subkey(k, sizeof k, path, "partial_rotary_factor"),
                                 json_object_get(v, "partial_rotary_factor"));
}

/* rope_parameters.sliding_attention (Gemma 3 and 4): the local base,
 * unscaled. */
static int parse_sliding_rope(const cfg_jctx *cx, const json_t *slide, kv_config *c)
{
    kv_rope_scaling s = { .type = ROPE_SCALE_NONE };
    const char *path = "rope_parameters.sliding_attention", *type = NULL, *tkey = "rope_type";
    char k[128];
    /* "proportional" here is Gemma 4's full-layer RoPE put on the wrong
     * layers, not a scaling kvdiff lacks: said so, under the key that has it. */
    if (json_is_object(slide) && scaling_type_key(cx, path, slide, false, &type, &tkey))
        return -1;
    if (type && !strcmp(type, "proportional"))
        return cj_fail(cx, cj_subkey(k, sizeof k, path, tkey), "is 'proportional'; sliding layers "
                     "rotate whole heads with default RoPE (Gemma 4 rotates part of a head, "
                     "proportional, on full-attention layers only)");
    if (parse_rope_entry(cx, path, slide, &s,
                         &c->rope_local_theta))
        return -1;
    if (s.type != ROPE_SCALE_NONE)
        return cj_fail(cx, "rope_parameters.sliding_attention", "is scaled; kvdiff "
                     "scales RoPE on full-attention layers only");
    return 0;
}

/* Gemma 4's full-attention entry: rope_type "proportional" (or "default")
 * with partial_rotary_factor, the first factor * D/2 frequency pairs
 * rotating at theta^(-2j/D), the rest passing through. */
static int parse_gemma4_full_rope(const cfg_jctx *cx, const json_t *v, kv_config *c)
{
    const char *path = "rope_parameters.full_attention", *type = NULL;
    char k[128], d[64];
    if (!json_is_object(v))
        return cj_fail(cx, path, "is %s; expected an object", cj_desc(v, d, sizeof d));
    const char *tkey = "rope_type";
    if (scaling_type_key(cx, path, v, false, &type, &tkey))
        return -1;
    bool prop = type && !strcmp(type, "proportional");
    if (type && !prop && strcmp(type, "default") != 0)
        return cj_fail(cx, path, "%s '%.40s' is not supported (Gemma 4's full "
                     "layers use proportional)", tkey, type);
    const json_t *t = json_object_get(v, "rope_theta");
    if (t && cj_want_num(cx, cj_subkey(k, sizeof k, path, "rope_theta"), t, MIN_THETA, false,
                      MAX_THETA, &c->rope_theta))
        return -1;
    const json_t *f = json_object_get(v, "partial_rotary_factor");
    double factor = 1.0;
    cj_subkey(k, sizeof k, path, "partial_rotary_factor");
    if (cj_present(f) && cj_want_num(cx, k, f, 0.0, true, 1.0, &factor))
        return -1;
    /* No rope_type at all is not "rope_type default": the entry lacks the
     * key the factor needs, and the message says so. */
    if (factor != 1.0 && !type)
        return cj_fail(cx, k, "is %g but %s has no rope_type (read as default); kvdiff "
                     "rotates part of a head for rope_type proportional only", factor, path);
    if (factor != 1.0 && !prop)
        return cj_fail(cx, k, "is %g with rope_type default; kvdiff rotates part of a "
                     "head for proportional RoPE only", factor);
    c->rope_partial_full = factor == 1.0 ? 0.0 : factor;
    return 0;
}

static int parse_gemma4_rope(const cfg_jctx *cx, const json_t *full, const json_t *slide,
                             kv_config *c)
{
    if (!full && !slide)
        return cj_fail(cx, "rope_parameters", "has neither full_attention nor "
                     "sliding_attention; gemma4_text keys them by layer type");
    if (full && parse_gemma4_full_rope(cx, full, c))
        return -1;
    return slide ? parse_sliding_rope(cx, slide, c) : 0;
}

/* transformers 5 writes rope_parameters instead of rope_theta/rope_scaling:
 * one object for llama/qwen2, one per layer type for Gemma 3. */
static int parse_rope_parameters(const cfg_jctx *cx, const json_t *rp, kv_config *c)
{
    char d[64];
    if (!json_is_object(rp))
        return cj_fail(cx, "rope_parameters", "is %s; expected an object",
                     cj_desc(rp, d, sizeof d));
    const json_t *full = json_object_get(rp, "full_attention");
    const json_t *slide = json_object_get(rp, "sliding_attention");
    bool keyed = full || slide;
    if (c->arch == ARCH_GEMMA4)
        return parse_gemma4_rope(cx, full, slide, c);
    if (c->arch != ARCH_GEMMA3) {
        if (keyed)
            return cj_fail(cx, "rope_parameters", "is keyed by layer type; %s has one "
                         "kind of layer", c->model_type);
        return parse_rope_entry(cx, "rope_parameters", rp, &c->rope_scaling, &c->rope_theta);
    }
    if (!keyed)
        return cj_fail(cx, "rope_parameters", "has neither full_attention nor "
                     "sliding_attention; gemma3_text keys them by layer type");
    if (full && parse_rope_entry(cx, "rope_parameters.full_attention", full,
                                 &c->rope_scaling, &c->rope_theta))
        return -1;
    return slide ? parse_sliding_rope(cx, slide, c) : 0;
}

static int parse_rope(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    bool gemma = is_gemma(c->arch);
    if (cj_get_num(cx, obj, "rope_theta", fam(c)->def_theta, MIN_THETA, false,
                MAX_THETA, &c->rope_theta))
        return -1;
    c->rope_local_theta = c->rope_theta;
    /* Gemma4TextConfig without rope_parameters: proportional 0.25 on full
     * layers, base 10000 on sliding ones. */
    if (c->arch == ARCH_GEMMA4) {
        c->rope_local_theta = GEMMA_DEF_LOCAL_THETA;
        c->rope_partial_full = 0.25;
    }
    if (c->arch == ARCH_GEMMA3 && cj_get_num(cx, obj, "rope_local_base_freq", GEMMA_DEF_LOCAL_THETA, MIN_THETA,
                         false, MAX_THETA, &c->rope_local_theta))
        return -1;
    const json_t *rs = json_object_get(obj, "rope_scaling");
    const json_t *rp = json_object_get(obj, "rope_parameters");
    if (cj_present(rs) && cj_present(rp))
        return cj_fail(cx, "rope_scaling", "and rope_parameters are both set; kvdiff reads "
                     "one of them");
    if (cj_parse_scaling(cx, "rope_scaling", rs, true, &c->rope_scaling))
        return -1;
    if (cj_present(rp) && parse_rope_parameters(cx, rp, c))
        return -1;
    if (c->rope_scaling.type == ROPE_SCALE_YARN && c->rope_scaling.original_max_position == 0)
        c->rope_scaling.original_max_position = c->max_positions;
    if (!gemma)
        c->rope_local_theta = c->rope_theta;
    return refuse_partial_rotary(cx, "partial_rotary_factor",
                                 json_object_get(obj, "partial_rotary_factor"));
}

/* ---- layers ------------------------------------------------------------- */

static int parse_layer_types(const cfg_jctx *cx, const json_t *lt, kv_config *c)
{
    char d[64], k[48];
    if (!json_is_array(lt))
        return cj_fail(cx, "layer_types", "is %s; expected an array of strings",
                     cj_desc(lt, d, sizeof d));
    size_t n = json_array_size(lt);
    if (n != (size_t)c->n_layers)
        return cj_fail(cx, "layer_types", "has %zu entries but num_hidden_layers is %d",
                     n, c->n_layers);
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(lt, i);
        snprintf(k, sizeof k, "layer_types[%zu]", i);
        const char *s = json_is_string(v) ? json_string_value(v) : NULL;
        if (s && !strcmp(s, "full_attention"))
            c->layer_type[i] = ATTN_GLOBAL;
        else if (s && !strcmp(s, "sliding_attention") && fam(c)->slides)
            c->layer_type[i] = ATTN_SLIDING;
        else if (s && !strcmp(s, "sliding_attention"))
            return cj_fail(cx, k, "is 'sliding_attention'; sliding attention is not "
                         "supported for %s", c->model_type);
        else
            return cj_fail(cx, k, "is %s; expected 'sliding_attention' or 'full_attention'",
                         cj_desc(v, d, sizeof d));
    }
    return 0;
}

static int parse_window(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *w = json_object_get(obj, "sliding_window");
    int window = fam(c)->def_window;
    if (w && json_is_null(w))
        window = 0;
    else if (w && cj_want_int(cx, "sliding_window", w, 1, MAX_POSITIONS, &window))
        return -1;
    int first_sliding = -1;
    for (int i = c->n_layers - 1; i >= 0; i--)
        if (c->layer_type[i] == ATTN_SLIDING)
            first_sliding = i;
    if (first_sliding >= 0 && window == 0)
        return cj_fail(cx, "sliding_window", "is null but layer %d is a sliding_attention "
                     "layer", first_sliding);
    c->sliding_window = first_sliding >= 0 ? window : 0;
    return 0;
}

static int parse_kv_sharing(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    int n_shared = 0;
    if (cj_get_int(cx, obj, "num_kv_shared_layers", false, 0, 0, KV_MAX_LAYERS, &n_shared))
        return -1;
    if (n_shared > 0 && !is_gemma(c->arch))
        return cj_fail(cx, "num_kv_shared_layers", "is %d; KV sharing is read for "
                     "gemma3_text and gemma4_text only", n_shared);
    if (n_shared >= c->n_layers)
        return cj_fail(cx, "num_kv_shared_layers", "is %d but the model has %d layers; at "
                     "least the first layer must compute K/V", n_shared, c->n_layers);
    int orphan = set_owners(c, n_shared);
    if (orphan >= 0)
        return cj_fail(cx, "num_kv_shared_layers", "is %d: layer %d (%s) has no earlier "
                     "non-shared %s layer to read K/V from", n_shared, orphan,
                     cj_type_name(c->layer_type[orphan]), cj_type_name(c->layer_type[orphan]));
    return 0;
}

/* per_layer_config: {"<layer>": {"head_dim": .., "num_key_value_heads": ..}};
 * the first full-attention layer's value of key, or 0. */
static int per_layer_full(const cfg_jctx *cx, const json_t *obj, const kv_config *c,
                          const char *key, int *out)
{
    const json_t *plc = json_object_get(obj, "per_layer_config");
    char k[96], d[64];
    *out = 0;
    if (!cj_present(plc))
        return 0;
    if (!json_is_object(plc))
        return cj_fail(cx, "per_layer_config", "is %s; expected an object",
                     cj_desc(plc, d, sizeof d));
    for (int i = 0; i < c->n_layers; i++) {
        snprintf(k, sizeof k, "%d", i);
        const json_t *lc = json_object_get(plc, k);
        if (c->layer_type[i] != ATTN_GLOBAL || !json_is_object(lc)
            || !json_object_get(lc, key))
            continue;
        snprintf(k, sizeof k, "per_layer_config.%d.%s", i, key);
        return cj_want_int(cx, k, json_object_get(lc, key), 1, MAX_HEAD_DIM, out);
    }
    return 0;
}

/* A full layer's size: key (global_head_dim, num_global_key_value_heads),
 * else per_layer_config's pkey for the first full layer, else fallback. */
static int full_layer_size(const cfg_jctx *cx, const json_t *obj, const kv_config *c,
                           const char *key, const char *pkey, int hi, int fallback, int *out)
{
    const json_t *v = json_object_get(obj, key);
    *out = 0;
    if (cj_present(v) ? cj_want_int(cx, key, v, 1, hi, out) : per_layer_full(cx, obj, c, pkey, out))
        return -1;
    if (*out == 0)
        *out = fallback;
    return 0;
}

/* Gemma 4's full-layer head size and KV heads, K=V, double-wide MLPs and
 * per-layer inputs (after layer types and KV sharing are known). */
static int parse_gemma4_layers(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    if (full_layer_size(cx, obj, c, "global_head_dim", "head_dim", MAX_HEAD_DIM, c->head_dim,
                        &c->head_dim_full)
        || full_layer_size(cx, obj, c, "num_global_key_value_heads", "num_key_value_heads",
                           MAX_HEADS, c->n_kv_heads, &c->n_kv_heads_full))
        return -1;
    if (c->head_dim_full % 2 != 0)
        return cj_fail(cx, "global_head_dim", "is %d; RoPE needs an even head size",
                     c->head_dim_full);
    if (c->n_heads % c->n_kv_heads_full != 0)
        return cj_fail(cx, "num_global_key_value_heads", "is %d, which does not divide "
                     "num_attention_heads %d", c->n_kv_heads_full, c->n_heads);
    if (c->rope_partial_full > 0 && (int)(c->rope_partial_full * c->head_dim_full / 2) < 1)
        return cj_fail(cx, "rope_parameters.full_attention.partial_rotary_factor", "is %g: "
                     "no pair of a %d-wide head rotates", c->rope_partial_full,
                     c->head_dim_full);
    if (cj_get_bool(cx, obj, "attention_k_eq_v", false, &c->k_eq_v)
        || cj_get_bool(cx, obj, "use_double_wide_mlp", false, &c->double_wide_mlp))
        return -1;
    const json_t *p = json_object_get(obj, "hidden_size_per_layer_input");
    c->per_layer_dim = 0;
    if (cj_present(p) && cj_want_int(cx, "hidden_size_per_layer_input", p, 0, MAX_HIDDEN,
                               &c->per_layer_dim))
        return -1;
    c->per_layer_vocab = 0;
    if (c->per_layer_dim > 0) {
        if (cj_get_int(cx, obj, "vocab_size_per_layer_input", false, c->vocab, 1, MAX_VOCAB,
                    &c->per_layer_vocab))
            return -1;
        if ((long long)c->per_layer_dim * c->n_layers > MAX_HIDDEN)
            return cj_fail(cx, "hidden_size_per_layer_input", "is %d: times %d layers, the "
                         "per-layer table is wider than %d", c->per_layer_dim,
                         c->n_layers, MAX_HIDDEN);
    }
    return 0;
}

static int parse_layers(const cfg_jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *lt = json_object_get(obj, "layer_types");
    memset(c->layer_type, ATTN_GLOBAL, sizeof c->layer_type);
    if (fam(c)->def_pattern > 0 && !cj_present(lt)) {
        int pattern = fam(c)->def_pattern;
        if (cj_get_int(cx, obj, "sliding_window_pattern", false, pattern,
                    1, MAX_PATTERN, &pattern))
            return -1;
        cfg_layers_from_pattern(c, pattern);
    } else if (c->arch == ARCH_GEMMA4 && !cj_present(lt)) {
        return cj_fail(cx, "layer_types", "is missing (gemma4_text lists each layer's type)");
    } else if (cj_present(lt) && c->arch != ARCH_LLAMA) {
        /* LlamaConfig has no layer_types; transformers ignores the key there. */
        if (parse_layer_types(cx, lt, c))
            return -1;
    }
    if (fam(c)->slides && parse_window(cx, obj, c))
        return -1;
    if (parse_kv_sharing(cx, obj, c))
        return -1;
    return c->arch == ARCH_GEMMA4 ? parse_gemma4_layers(cx, obj, c) : 0;
}

/* ---- token ids, tying --------------------------------------------------- */

static int parse_eos(const cfg_jctx *cx, const json_t *v, kv_config *c)
{
    char k[48], d[64];
    if (json_is_integer(v)) {
        c->n_eos = 1;
        return cj_want_int(cx, "eos_token_id", v, 0, c->vocab - 1, &c->eos_ids[0]);
    }
    if (!json_is_array(v))
        return cj_fail(cx, "eos_token_id", "is %s; expected an integer, a list of integers "
                     "or null", cj_desc(v, d, sizeof d));
    size_t n = json_array_size(v);
    if (n > KV_MAX_EOS)
        return cj_fail(cx, "eos_token_id", "lists %zu ids; kvdiff keeps at most %d", n,
                     KV_MAX_EOS);
    for (size_t i = 0; i < n; i++) {
        snprintf(k, sizeof k, "eos_token_id[%zu]", i);
        if (cj_want_int(cx, k, json_array_get(v, i), 0, c->vocab - 1, &c->eos_ids[i]))
            return -1;
    }
    c->n_eos = (int)n;
    return 0;
}

/* Gemma3ForConditionalGeneration keeps token ids (and the tie flag) at the top
 * level; set there (not null) they win over text_config's, as in
 * transformers' generation config. */
static const json_t *pick(const cfg_jctx *cx, const json_t *obj, const cfg_jctx *top,
                          const json_t *outer, const char *key, const cfg_jctx **used)
{
    if (outer && cj_present(json_object_get(outer, key))) {
        *used = top;
        return outer;
    }
    *used = cx;
    return obj;
}

static int parse_tokens(const cfg_jctx *cx, const json_t *obj, const json_t *outer, kv_config *c)
{
    const kv_family *a = fam(c);
    cfg_jctx top = { cx->file, "", cx->e };
    const cfg_jctx *u;
    const json_t *src = pick(cx, obj, &top, outer, "tie_word_embeddings", &u);
    if (cj_get_bool(u, src, "tie_word_embeddings", a->def_tie, &c->tie_embeddings))
        return -1;
    src = pick(cx, obj, &top, outer, "bos_token_id", &u);
    const json_t *bos = json_object_get(src, "bos_token_id");
    c->bos_id = bos ? -1 : a->def_bos;
    if (cj_present(bos) && cj_want_int(u, "bos_token_id", bos, 0, c->vocab - 1, &c->bos_id))
        return -1;
    src = pick(cx, obj, &top, outer, "eos_token_id", &u);
    const json_t *eos = json_object_get(src, "eos_token_id");
    c->n_eos = 0;
    if (!eos && a->def_eos >= 0) {
        c->n_eos = 1;
        c->eos_ids[0] = a->def_eos;
    }
    if (cj_present(eos))
        return parse_eos(u, eos, c);
    return 0;
}

/* ---- top level ---------------------------------------------------------- */

/* Reads a text model's config object (obj); outer is the enclosing
 * Gemma3ForConditionalGeneration config or NULL. */
static int parse_text(const cfg_jctx *cx, const json_t *obj, const json_t *outer,
                      kv_arch arch, kv_config *c)
{
    family_set(c, arch);
    if (parse_sizes(cx, obj, c) || parse_norm_act(cx, obj, c) || parse_rope(cx, obj, c)
        || parse_layers(cx, obj, c) || parse_tokens(cx, obj, outer, c))
        return -1;
    if (fam(c)->parse && fam(c)->parse(cx, obj, c))
        return -1;
    set_scales(c);
    return 0;
}

/* Gemma3ForConditionalGeneration / Gemma4ForConditionalGeneration: the
 * text model under text_config. */
static int parse_gemma_nested(const cfg_jctx *cx, const json_t *root, kv_arch arch,
                              kv_config *c)
{
    char d[64];
    const char *outer = arch == ARCH_GEMMA4 ? "gemma4" : "gemma3";
    const char *inner_type = family_of(arch)->model_type;
    const json_t *tc = json_object_get(root, "text_config");
    if (!tc)
        return cj_fail(cx, "text_config", "is missing (model_type %s nests the text "
                     "model there)", outer);
    if (!json_is_object(tc))
        return cj_fail(cx, "text_config", "is %s; expected an object", cj_desc(tc, d, sizeof d));
    const json_t *mt = json_object_get(tc, "model_type");
    if (mt && !(json_is_string(mt) && !strcmp(json_string_value(mt), inner_type)))
        return cj_fail(cx, "text_config.model_type", "is %s; expected \"%s\"",
                     cj_desc(mt, d, sizeof d), inner_type);
    cfg_jctx inner = { cx->file, "text_config.", cx->e };
    if (parse_text(&inner, tc, root, arch, c))
        return -1;
    /* The caller also tries the other layout ("model.language_model." or
     * "language_model.model.") when these names are absent. */
    if (arch == ARCH_GEMMA4) {
        snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "model.language_model.");
        snprintf(c->lm_head_name, sizeof c->lm_head_name, "lm_head.weight");
    } else {
        snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "language_model.model.");
        snprintf(c->lm_head_name, sizeof c->lm_head_name, "language_model.lm_head.weight");
    }
    return 0;
}

static int parse_root(const json_t *root, const char *file, kv_config *c, kv_err *e)
{
    cfg_jctx cx = { file, "", e };
    char d[64];
    const char *mt = NULL;
    if (!json_is_object(root))
        return kv_errf(e, "%s: top level is %s; expected an object", file,
                       cj_desc(root, d, sizeof d));
    if (cj_get_str(&cx, root, "model_type", NULL, &mt))
        return -1;
    const kv_family *f = family_by_model_type(mt);
    if (f && f->outer_type && !strcmp(mt, f->outer_type))
        return parse_gemma_nested(&cx, root, f->arch, c);
    if (f)
        return parse_text(&cx, root, NULL, f->arch, c);
    char types[256];
    family_model_types(types, sizeof types);
    return kv_errf(e, "%s: model_type '%.40s' is not supported (kvdiff reads %s)", file, mt,
                   types);
}

int config_parse_json(const char *text, size_t len, const char *name,
                      kv_config *out, kv_err *e)
{
    json_error_t je;
    kv_config c;
    if (!name)
        name = "config.json";
    if (!text || !out)
        return kv_errf(e, "%s: no text to parse", name);
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return kv_errf(e, "%s: not valid JSON: %s (line %d, column %d)", name, je.text,
                       je.line, je.column);
    memset(&c, 0, sizeof c);
    int rc = parse_root(root, name, &c, e);
    json_decref(root);
    /* A safety net: whatever the parser accepted must be consistent. */
    if (rc == 0 && config_validate(&c, e) != 0)
        rc = kv_err_prefix(e, name);
    if (rc == 0)
        memcpy(out, &c, sizeof c);
    return rc;
}

/* Reads a whole small file; *buf is malloc'ed. */
static int read_small_file(const char *path, char **buf, size_t *len, kv_err *e)
{
    FILE *f = infile_open(path, CONFIG_MAX_BYTES, e);
    if (!f)
        return -1;
    size_t cap = 0, n = 0;
    char *p = NULL;
    int rc = 0;
    for (;;) {
        if (n == cap) {
            char *q = cap < (size_t)CONFIG_MAX_BYTES ? realloc(p, cap ? cap * 2 : 4096) : NULL;
            if (!q) {
                rc = cap < (size_t)CONFIG_MAX_BYTES
                    ? kv_errf(e, "%s: out of memory", path)
                    : kv_errf(e, "%s: larger than %ld bytes; not a config.json", path,
                              CONFIG_MAX_BYTES);
                break;
            }
            p = q;
            cap = cap ? cap * 2 : 4096;
        }
        size_t got = fread(p + n, 1, cap - n, f);
        n += got;
        if (got == 0) {
            if (ferror(f))
                rc = kv_errf(e, "%s: cannot read: %s", path, strerror(errno));
            break;
        }
    }
    fclose(f);
    if (rc) {
        free(p);
        return rc;
    }
    *buf = p;
    *len = n;
    return 0;
}

int config_load_json(const char *path, kv_config *out, kv_err *e)
{
    char *text = NULL;
    size_t len = 0;
    if (!path)
        return kv_errf(e, "config_load_json: no path");
    if (read_small_file(path, &text, &len, e))
        return -1;
    int rc = config_parse_json(text, len, path, out, e);
    free(text);
    return rc;
}

/* ---- validation --------------------------------------------------------- */

static bool has_nul(const char *s, size_t n)
{
    return memchr(s, '\0', n) != NULL;
}

static int check_family(const kv_config *c, kv_err *e)
{
    if (!fam(c))
        return kv_errf(e, "arch %d is not a family kvdiff knows", (int)c->arch);
    kv_config want;
    memset(&want, 0, sizeof want);
    family_set(&want, c->arch);
    if (!has_nul(c->model_type, sizeof c->model_type)
        || strcmp(c->model_type, want.model_type) != 0)
        return kv_errf(e, "model_type '%.*s' does not match the arch (expected '%s')",
                       (int)sizeof c->model_type, c->model_type, want.model_type);
    if (c->norm_plus_one != want.norm_plus_one || c->qk_norm != want.qk_norm
        || c->sandwich_norms != want.sandwich_norms || c->act != want.act
        || c->v_norm != want.v_norm || c->layer_scalar != want.layer_scalar
        || c->attn_sinks != want.attn_sinks)
        return kv_errf(e, "norm_plus_one/qk_norm/sandwich_norms/act/v_norm/layer_scalar/"
                       "attn_sinks do not match the %s family", want.model_type);
    const kv_family *f = fam(c);
    if (!f->moe && (c->n_experts || c->n_experts_used || c->swiglu_limit != 0))
        return kv_errf(e, "experts are set but %s has a dense MLP", c->model_type);
    /* DeepSeek's routing and shared experts, and MLA, are theirs alone. */
    if (!f->mla && (c->route || c->moe_intermediate || c->n_shared_experts || c->first_dense
                    || c->moe_every || c->n_group || c->topk_group || c->norm_topk
                    || c->routed_scale != 0))
        return kv_errf(e, "shared experts / routing fields are set but %s has none",
                       c->model_type);
    if (!f->mla && (c->kv_lora_rank || c->q_lora_rank || c->qk_rope_dim || c->v_head_dim))
        return kv_errf(e, "latent attention fields are set but %s has none", c->model_type);
    if (!(isfinite(c->rope_scaling.mscale) && c->rope_scaling.mscale >= 0
          && isfinite(c->rope_scaling.mscale_all_dim) && c->rope_scaling.mscale_all_dim >= 0
          && c->rope_scaling.mscale <= MAX_FACTOR && c->rope_scaling.mscale_all_dim <= MAX_FACTOR))
        return kv_errf(e, "rope_scaling mscale %g / mscale_all_dim %g out of range",
                       c->rope_scaling.mscale, c->rope_scaling.mscale_all_dim);
    if (f->check && f->check(c, e))
        return -1;
    /* Some families have one switch (attention_bias) for all four biases;
     * the others fix them. */
    bool switchable = f->bias_switch;
    if (switchable ? c->qkv_bias != c->o_bias
                   : c->qkv_bias != want.qkv_bias || c->o_bias != want.o_bias)
        return kv_errf(e, "qkv_bias %d / o_bias %d do not match the %s family", c->qkv_bias,
                       c->o_bias, want.model_type);
    return 0;
}

static int check_range(kv_err *e, const char *what, long long v, long long lo, long long hi)
{
    if (v < lo || v > hi)
        return kv_errf(e, "%s is %lld; expected %lld..%lld", what, v, lo, hi);
    return 0;
}

/* The Gemma 4 fields: in range there, zero elsewhere. */
static int check_gemma4_sizes(const kv_config *c, kv_err *e)
{
    if (c->arch != ARCH_GEMMA4) {
        if (c->head_dim_full || c->n_kv_heads_full || c->rope_partial_full != 0.0
            || c->k_eq_v || c->double_wide_mlp || c->per_layer_dim || c->per_layer_vocab)
            return kv_errf(e, "Gemma 4 fields (global head size, K=V, double-wide MLP, "
                           "per-layer inputs) are set but %s has none", c->model_type);
        return 0;
    }
    if (check_range(e, "head_dim_full", c->head_dim_full, 2, MAX_HEAD_DIM)
        || check_range(e, "n_kv_heads_full", c->n_kv_heads_full, 1, c->n_heads)
        || check_range(e, "per_layer_dim", c->per_layer_dim, 0, MAX_HIDDEN)
        || check_range(e, "per_layer_vocab", c->per_layer_vocab, c->per_layer_dim ? 1 : 0,
                       c->per_layer_dim ? c->vocab : 0))
        return -1;
    if (c->head_dim_full % 2 != 0 || c->n_heads % c->n_kv_heads_full != 0)
        return kv_errf(e, "head_dim_full %d is odd or n_kv_heads_full %d does not divide "
                       "n_heads %d", c->head_dim_full, c->n_kv_heads_full, c->n_heads);
    if (c->rope_partial_full != 0.0
        && (!(c->rope_partial_full > 0.0 && c->rope_partial_full < 1.0)
            || (int)(c->rope_partial_full * c->head_dim_full / 2) < 1))
        return kv_errf(e, "rope_partial_full %g rotates no pair or all of them",
                       c->rope_partial_full);
    return 0;
}

static int check_sizes(const kv_config *c, kv_err *e)
{
    if (check_range(e, "hidden", c->hidden, 1, MAX_HIDDEN)
        || check_range(e, "n_layers", c->n_layers, 1, KV_MAX_LAYERS)
        || check_range(e, "n_heads", c->n_heads, 1, MAX_HEADS)
        || check_range(e, "n_kv_heads", c->n_kv_heads, 1, c->n_heads)
        || check_range(e, "head_dim", c->head_dim, 2, MAX_HEAD_DIM)
        || check_range(e, "intermediate", c->intermediate, 1, MAX_INTERMEDIATE)
        || check_range(e, "vocab", c->vocab, 1, MAX_VOCAB)
        || check_range(e, "max_positions", c->max_positions, 1, MAX_POSITIONS))
        return -1;
    if (c->n_heads % c->n_kv_heads != 0)
        return kv_errf(e, "n_kv_heads %d does not divide n_heads %d", c->n_kv_heads,
                       c->n_heads);
    if (c->head_dim % 2 != 0)
        return kv_errf(e, "head_dim %d is odd; RoPE needs it even", c->head_dim);
    if (check_gemma4_sizes(c, e))
        return -1;
    long long e_ = c->hidden, qd = config_max_q_width(c);
    long long ffn = config_max_intermediate(c);
    if (e_ * qd > MAX_MATRIX || e_ * ffn > MAX_MATRIX || e_ * c->vocab > MAX_MATRIX)
        return kv_errf(e, "a weight matrix has more than %lld elements (E=%d H*D=%lld "
                       "I=%lld V=%d)", MAX_MATRIX, c->hidden, qd, ffn, c->vocab);
    /* The per-layer table is gathered, never multiplied: bounded apart
     * (E2B's is 262144 x 8960). */
    long long table = (long long)c->per_layer_vocab * c->per_layer_dim * c->n_layers;
    if (table > MAX_TABLE)
        return kv_errf(e, "the per-layer embedding table has %lld elements, more than %lld",
                       table, MAX_TABLE);
    return 0;
}

static bool num_in(double v, double lo, bool lo_open, double hi)
{
    return isfinite(v) && (lo_open ? v > lo : v >= lo) && v <= hi;
}

static bool close_to(double a, double b)
{
    return fabs(a - b) <= 1e-12 * fabs(b);
}

static int check_rope(const kv_config *c, kv_err *e)
{
    const kv_rope_scaling *s = &c->rope_scaling;
    if (!num_in(c->rope_theta, MIN_THETA, false, MAX_THETA)
        || !num_in(c->rope_local_theta, MIN_THETA, false, MAX_THETA))
        return kv_errf(e, "rope_theta %g / rope_local_theta %g out of %g..%g",
                       c->rope_theta, c->rope_local_theta, MIN_THETA, MAX_THETA);
    if (!is_gemma(c->arch) && c->rope_local_theta != c->rope_theta)
        return kv_errf(e, "rope_local_theta differs from rope_theta but %s has no "
                       "sliding layers", c->model_type);
    switch (s->type) {
    case ROPE_SCALE_NONE:
        return 0;
    case ROPE_SCALE_LINEAR:
        return num_in(s->factor, 0.0, true, MAX_FACTOR) ? 0
            : kv_errf(e, "rope_scaling factor %g out of range", s->factor);
    case ROPE_SCALE_LLAMA3:
        if (!num_in(s->factor, 0.0, true, MAX_FACTOR)
            || !num_in(s->low_freq_factor, 0.0, true, MAX_FACTOR)
            || !num_in(s->high_freq_factor, s->low_freq_factor, true, MAX_FACTOR))
            return kv_errf(e, "llama3 rope_scaling needs factor > 0 and high_freq_factor "
                           "> low_freq_factor > 0");
        return check_range(e, "rope_scaling original_max_position",
                           s->original_max_position, 1, MAX_POSITIONS);
    case ROPE_SCALE_YARN:
        if (!num_in(s->factor, 0.0, true, MAX_FACTOR)
            || !num_in(s->beta_slow, 0.0, true, MAX_FACTOR)
            || !num_in(s->beta_fast, s->beta_slow, true, MAX_FACTOR)
            || !num_in(s->attn_factor, 0.0, true, MAX_FACTOR))
            return kv_errf(e, "yarn rope_scaling needs factor > 0, beta_fast > beta_slow > 0 "
                           "and attention_factor > 0");
        return check_range(e, "rope_scaling original_max_position",
                           s->original_max_position, 1, MAX_POSITIONS);
    }
    return kv_errf(e, "rope_scaling type %d is unknown", (int)s->type);
}

static int check_numbers(const kv_config *c, kv_err *e)
{
    bool gemma = c->arch == ARCH_GEMMA3;
    if (!num_in(c->rms_eps, 0.0, true, 1.0))
        return kv_errf(e, "rms_eps %g is not in (0, 1]", c->rms_eps);
    float want_embed = is_gemma(c->arch) ? gemma_embed_scale(c->hidden) : 1.0f;
    if (c->embed_scale != want_embed)
        return kv_errf(e, "embed_scale %.9g is not %.9g", (double)c->embed_scale,
                       (double)want_embed);
    if (gemma && !num_in(c->query_pre_attn_scalar, 0.0, true, MAX_SCALAR))
        return kv_errf(e, "query_pre_attn_scalar %g out of range", c->query_pre_attn_scalar);
    if (!gemma && c->query_pre_attn_scalar != 0.0)
        return kv_errf(e, "query_pre_attn_scalar is set but %s has none", c->model_type);
    double want_scale = c->arch == ARCH_GEMMA4 ? 1.0
        : gemma ? scale_of(c->query_pre_attn_scalar)
        : scale_of((double)c->head_dim) * softmax_mscale2(c);
    if (!close_to(c->attn_scale, want_scale))
        return kv_errf(e, "attn_scale %.17g is not %.17g", c->attn_scale, want_scale);
    if (!num_in(c->final_softcap, 0.0, false, MAX_SCALAR)
        || (!is_gemma(c->arch) && c->final_softcap != 0))
        return kv_errf(e, "final_softcap %g is not allowed for %s", c->final_softcap,
                       c->model_type);
    return check_rope(c, e);
}

static int check_owner(const kv_config *c, int i)
{
    int o = c->kv_owner[i];
    return o >= 0 && o <= i && c->kv_owner[o] == o && c->layer_type[o] == c->layer_type[i];
}

static int check_layers(const kv_config *c, kv_err *e)
{
    int n_sliding = 0;
    for (int i = 0; i < c->n_layers; i++) {
        if (c->layer_type[i] != ATTN_GLOBAL && c->layer_type[i] != ATTN_SLIDING)
            return kv_errf(e, "layer_type[%d] is %d", i, c->layer_type[i]);
        if (c->layer_type[i] == ATTN_SLIDING && !fam(c)->slides)
            return kv_errf(e, "layer %d slides but %s has global layers only", i,
                           c->model_type);
        if (!check_owner(c, i))
            return kv_errf(e, "kv_owner[%d] is %d; a layer reads its own cache or that of "
                           "an earlier owning layer of the same attention type", i,
                           c->kv_owner[i]);
        n_sliding += c->layer_type[i] == ATTN_SLIDING;
    }
    if (n_sliding > 0)
        return check_range(e, "sliding_window", c->sliding_window, 1, MAX_POSITIONS);
    if (c->sliding_window != 0)
        return kv_errf(e, "sliding_window is %d but no layer slides", c->sliding_window);
    return 0;
}

static int check_tokens(const kv_config *c, kv_err *e)
{
    if (c->bos_id != -1 && check_range(e, "bos_id", c->bos_id, 0, c->vocab - 1))
        return -1;
    if (check_range(e, "n_eos", c->n_eos, 0, KV_MAX_EOS))
        return -1;
    for (int i = 0; i < c->n_eos; i++)
        if (check_range(e, "eos id", c->eos_ids[i], 0, c->vocab - 1))
            return -1;
    if (!has_nul(c->tensor_prefix, sizeof c->tensor_prefix)
        || !has_nul(c->lm_head_name, sizeof c->lm_head_name) || !c->lm_head_name[0])
        return kv_errf(e, "tensor_prefix / lm_head_name are not terminated strings");
    return 0;
}

int config_validate(const kv_config *c, kv_err *e)
{
    if (!c)
        return kv_errf(e, "no config");
    if (check_family(c, e) || check_sizes(c, e) || check_numbers(c, e)
        || check_layers(c, e) || check_tokens(c, e))
        return -1;
    return 0;
}

/* ---- per-layer queries -------------------------------------------------- */

int config_layer_window(const kv_config *c, int layer)
{
    if (!c || layer < 0 || layer >= c->n_layers || layer >= KV_MAX_LAYERS
        || c->layer_type[layer] != ATTN_SLIDING)
        return 0;
    return c->sliding_window;
}

/* Gemma 3 leaves its sliding layers unscaled; a family whose
 * sliding_rope_scaled says so (gpt-oss: one rotary embedding for every
 * layer) scales them alike. */
bool config_rope_scaled(const kv_config *c, bool sliding)
{
    return !sliding || (fam(c) && fam(c)->sliding_rope_scaled);
}

void config_rope_inv_freq(const kv_config *c, bool sliding, double *inv)
{
    /* MLA rotates each head's qk_rope_dim tail at theta^(-2j/qk_rope_dim). */
    const int D = config_mla(c) ? c->qk_rope_dim
                : sliding || c->head_dim_full <= 0 ? c->head_dim : c->head_dim_full;
    const double theta = sliding ? c->rope_local_theta : c->rope_theta;
    const kv_rope_scaling *rs = &c->rope_scaling;
    kern_rope_inv_freq(theta, D, inv);
    if (config_rope_scaled(c, sliding) && rs->type == ROPE_SCALE_YARN)
        kern_rope_yarn_inv_freq(inv, D / 2, theta, rs->factor, rs->beta_fast, rs->beta_slow,
                                rs->original_max_position, rs->truncate);
    else if (config_rope_scaled(c, sliding))
        kern_rope_scale_inv_freq(inv, D / 2, (int)rs->type, rs->factor, rs->low_freq_factor,
                                 rs->high_freq_factor, rs->original_max_position);
    /* Gemma 4's proportional RoPE: pairs past the rotated ones keep
     * frequency 0 (cos 1, sin 0: passed through exactly). */
    if (!sliding && c->rope_partial_full > 0)
        for (int j = (int)(c->rope_partial_full * D / 2); j < D / 2; j++)
            inv[j] = 0.0;
}

double config_rope_mscale(const kv_config *c, bool sliding)
{
    return config_rope_scaled(c, sliding) && c->rope_scaling.type == ROPE_SCALE_YARN
               ? c->rope_scaling.attn_factor : 1.0;
}

double config_layer_theta(const kv_config *c, int layer)
{
    if (!c)
        return 0.0;
    if (layer >= 0 && layer < c->n_layers && layer < KV_MAX_LAYERS
        && c->layer_type[layer] == ATTN_SLIDING)
        return c->rope_local_theta;
    return c->rope_theta;
}

static bool full_layer(const kv_config *c, int layer)
{
    return c && layer >= 0 && layer < c->n_layers && layer < KV_MAX_LAYERS
        && c->layer_type[layer] == ATTN_GLOBAL;
}

int config_layer_head_dim(const kv_config *c, int layer)
{
    if (!c)
        return 0;
    return full_layer(c, layer) && c->head_dim_full > 0 ? c->head_dim_full : c->head_dim;
}

int config_layer_kv_heads(const kv_config *c, int layer)
{
    if (!c)
        return 0;
    return full_layer(c, layer) && c->n_kv_heads_full > 0 ? c->n_kv_heads_full
                                                          : c->n_kv_heads;
}

int config_layer_intermediate(const kv_config *c, int layer)
{
    if (!c)
        return 0;
    if (c->moe_intermediate > 0 && config_layer_moe(c, layer))
        return c->moe_intermediate;
    bool shared = layer >= 0 && layer < c->n_layers && layer < KV_MAX_LAYERS
        && c->kv_owner[layer] != layer;
    return c->double_wide_mlp && shared ? 2 * c->intermediate : c->intermediate;
}

bool config_layer_moe(const kv_config *c, int layer)
{
    return c && c->n_experts > 0 && layer >= c->first_dense
        && (c->moe_every <= 1 || layer % c->moe_every == 0);
}

int config_layer_dense_width(const kv_config *c, int layer)
{
    if (!c)
        return 0;
    if (config_layer_moe(c, layer))
        return c->n_shared_experts * c->moe_intermediate;
    return config_layer_intermediate(c, layer);
}

int config_layer_v_head_dim(const kv_config *c, int layer)
{
    return c && c->v_head_dim > 0 ? c->v_head_dim : config_layer_head_dim(c, layer);
}

bool config_mla(const kv_config *c)
{
    return c && c->kv_lora_rank > 0;
}

int config_mla_row(const kv_config *c)
{
    return config_mla(c) ? c->kv_lora_rank + c->qk_rope_dim : 0;
}

int config_layer_rope_pairs(const kv_config *c, int layer)
{
    int D = config_layer_head_dim(c, layer);
    if (full_layer(c, layer) && c->rope_partial_full > 0.0)
        return (int)(c->rope_partial_full * D / 2);
    return D / 2;
}

bool config_layer_has_stage(const kv_config *c, int layer, int st)
{
    if (!c || layer < 0 || layer >= KV_MAX_LAYERS)
        return true;
    if ((st == STAGE_K || st == STAGE_V) && c->kv_owner[layer] != layer)
        return false;
    if ((st == STAGE_PLE_IN || st == STAGE_PLE_OUT) && c->per_layer_dim <= 0)
        return false;
    if (st == STAGE_ATTN_SINK && !c->attn_sinks)
        return false;
    if (st == STAGE_ROUTER_LOGITS && !config_layer_moe(c, layer))
        return false;
    if (st == STAGE_KV_LATENT && !config_mla(c))
        return false;
    return true;
}

bool config_layer_has_v_proj(const kv_config *c, int layer)
{
    return c && !(c->k_eq_v && full_layer(c, layer));
}

int config_max_head_dim(const kv_config *c)
{
    if (!c)
        return 0;
    return c->head_dim_full > c->head_dim ? c->head_dim_full : c->head_dim;
}

int config_max_kv_width(const kv_config *c)
{
    if (!c)
        return 0;
    int a = c->n_kv_heads * c->head_dim;
    int b = c->head_dim_full > 0 && c->n_kv_heads_full > 0
                ? c->n_kv_heads_full * c->head_dim_full : 0;
    return a > b ? a : b;
}

int config_max_q_width(const kv_config *c)
{
    return c ? c->n_heads * config_max_head_dim(c) : 0;
}

int config_max_intermediate(const kv_config *c)
{
    if (!c)
        return 0;
    int w = c->double_wide_mlp ? 2 * c->intermediate : c->intermediate;
    int shared = c->n_shared_experts * c->moe_intermediate;
    if (c->moe_intermediate > w)
        w = c->moe_intermediate;
    return shared > w ? shared : w;
}

/* ---- writing ------------------------------------------------------------ */

void cw_key(cfg_writer *w, const char *key)
{
    fprintf(w->f, "%s\n  \"%s\": ", w->n++ ? "," : "", key);
}

void cw_num(cfg_writer *w, const char *key, double v)
{
    char buf[40];
    cj_fmt_double(buf, sizeof buf, v);
    cw_key(w, key);
    fputs(buf, w->f);
}

void cw_int(cfg_writer *w, const char *key, long long v)
{
    cw_key(w, key);
    fprintf(w->f, "%lld", v);
}

void cw_raw(cfg_writer *w, const char *key, const char *text)
{
    cw_key(w, key);
    fputs(text, w->f);
}

void cw_str(cfg_writer *w, const char *key, const char *s)
{
    cw_key(w, key);
    fprintf(w->f, "\"%s\"", s); /* only fixed ASCII names are written */
}

void cw_bool(cfg_writer *w, const char *key, bool b)
{
    cw_raw(w, key, b ? "true" : "false");
}

static void write_scaling(cfg_writer *w, const kv_rope_scaling *s)
{
    char f[40], lo[40], hi[40];
    if (s->type == ROPE_SCALE_NONE) {
        cw_raw(w, "rope_scaling", "null");
        return;
    }
    cj_fmt_double(f, sizeof f, s->factor);
    cw_key(w, "rope_scaling");
    if (s->type == ROPE_SCALE_LINEAR) {
        fprintf(w->f, "{\"rope_type\": \"linear\", \"factor\": %s}", f);
        return;
    }
    if (s->type == ROPE_SCALE_YARN) {
        char bf[40], bs[40], af[40];
        cj_fmt_double(bf, sizeof bf, s->beta_fast);
        cj_fmt_double(bs, sizeof bs, s->beta_slow);
        cj_fmt_double(af, sizeof af, s->attn_factor);
        fprintf(w->f, "{\"rope_type\": \"yarn\", \"factor\": %s, \"beta_fast\": %s, "
                "\"beta_slow\": %s, \"truncate\": %s, \"attention_factor\": %s, "
                "\"original_max_position_embeddings\": %d", f, bf, bs,
                s->truncate ? "true" : "false", af, s->original_max_position);
        if (s->mscale > 0 || s->mscale_all_dim > 0) {
            cj_fmt_double(bf, sizeof bf, s->mscale);
            cj_fmt_double(bs, sizeof bs, s->mscale_all_dim);
            fprintf(w->f, ", \"mscale\": %s, \"mscale_all_dim\": %s", bf, bs);
        }
        fputc('}', w->f);
        return;
    }
    cj_fmt_double(lo, sizeof lo, s->low_freq_factor);
    cj_fmt_double(hi, sizeof hi, s->high_freq_factor);
    fprintf(w->f, "{\"rope_type\": \"llama3\", \"factor\": %s, \"low_freq_factor\": %s, "
            "\"high_freq_factor\": %s, \"original_max_position_embeddings\": %d}",
            f, lo, hi, s->original_max_position);
}

static void write_tokens(cfg_writer *w, const kv_config *c)
{
    if (c->bos_id < 0)
        cw_raw(w, "bos_token_id", "null");
    else
        cw_int(w, "bos_token_id", c->bos_id);
    if (c->n_eos == 0) {
        cw_raw(w, "eos_token_id", "null");
    } else if (c->n_eos == 1) {
        cw_int(w, "eos_token_id", c->eos_ids[0]);
    } else {
        cw_key(w, "eos_token_id");
        for (int i = 0; i < c->n_eos; i++)
            fprintf(w->f, "%s%d", i ? ", " : "[", c->eos_ids[i]);
        fputc(']', w->f);
    }
}

static void write_common(cfg_writer *w, const kv_config *c, const char *torch_dtype)
{
    cw_key(w, "architectures");
    fprintf(w->f, "[\"%s\"]", fam(c)->architecture);
    cw_str(w, "model_type", c->model_type);
    cw_int(w, "hidden_size", c->hidden);
    cw_int(w, "intermediate_size", c->intermediate);
    cw_int(w, "num_hidden_layers", c->n_layers);
    cw_int(w, "num_attention_heads", c->n_heads);
    cw_int(w, "num_key_value_heads", c->n_kv_heads);
    if (!fam(c)->mla)
        cw_int(w, "head_dim", c->head_dim);
    cw_num(w, "rms_norm_eps", c->rms_eps);
    cw_num(w, "rope_theta", c->rope_theta);
    write_scaling(w, &c->rope_scaling);
    cw_int(w, "vocab_size", c->vocab);
    cw_int(w, "max_position_embeddings", c->max_positions);
    cw_bool(w, "tie_word_embeddings", c->tie_embeddings);
    write_tokens(w, c);
    cw_str(w, "torch_dtype", torch_dtype);
    cw_str(w, fam(c)->act_key, c->act == ACT_SILU ? "silu" : "gelu_pytorch_tanh");
}

/* The pieces Gemma 3's and Gemma 4's configs share: the window (null
 * when no layer slides), each layer's type, and the softcaps of a model
 * without attention biases. */
void cw_window(cfg_writer *w, const kv_config *c)
{
    if (c->sliding_window > 0)
        cw_int(w, "sliding_window", c->sliding_window);
    else
        cw_raw(w, "sliding_window", "null");
}

void cw_layer_types(cfg_writer *w, const kv_config *c)
{
    cw_key(w, "layer_types");
    for (int i = 0; i < c->n_layers; i++)
        fprintf(w->f, "%s\n    \"%s\"", i ? "," : "[", cj_type_name(c->layer_type[i]));
    fputs("\n  ]", w->f);
}

void cw_softcaps_unbiased(cfg_writer *w, const kv_config *c)
{
    if (c->final_softcap > 0)
        cw_num(w, "final_logit_softcapping", c->final_softcap);
    else
        cw_raw(w, "final_logit_softcapping", "null");
    cw_raw(w, "attn_logit_softcapping", "null");
    cw_bool(w, "attention_bias", false);
}

/* P such that layer i slides iff (i+1) % P != 0, or 0 when there is none. */
static int regular_pattern(const kv_config *c)
{
    int p = 0;
    while (p < c->n_layers && c->layer_type[p] == ATTN_SLIDING)
        p++;
    if (p == c->n_layers)
        return 0;
    p++;
    for (int i = 0; i < c->n_layers; i++)
        if (c->layer_type[i] != ((i + 1) % p != 0 ? ATTN_SLIDING : ATTN_GLOBAL))
            return 0;
    return p;
}

static void write_gemma(cfg_writer *w, const kv_config *c)
{
    double q = c->query_pre_attn_scalar;
    if (q == floor(q) && q <= MAX_SCALAR)
        cw_int(w, "query_pre_attn_scalar", (long long)q);
    else
        cw_num(w, "query_pre_attn_scalar", q);
    cw_window(w, c);
    int p = regular_pattern(c);
    if (p > 0)
        cw_int(w, "sliding_window_pattern", p);
    cw_layer_types(w, c);
    cw_num(w, "rope_local_base_freq", c->rope_local_theta);
    cw_softcaps_unbiased(w, c);
    int shared = count_shared(c);
    if (shared > 0)
        cw_int(w, "num_kv_shared_layers", shared);
}

/* gemma4_text as transformers writes it: rope_parameters keyed by layer
 * type, the full layers' sizes beside the sliding ones'. */
static void write_gemma4(cfg_writer *w, const kv_config *c)
{
    char lt[40], gt[40], pf[40];
    cw_int(w, "global_head_dim", c->head_dim_full);
    cw_int(w, "num_global_key_value_heads", c->n_kv_heads_full);
    cw_window(w, c);
    cw_layer_types(w, c);
    cj_fmt_double(lt, sizeof lt, c->rope_local_theta);
    cj_fmt_double(gt, sizeof gt, c->rope_theta);
    cj_fmt_double(pf, sizeof pf, c->rope_partial_full > 0 ? c->rope_partial_full : 1.0);
    cw_key(w, "rope_parameters");
    fprintf(w->f, "{\"sliding_attention\": {\"rope_type\": \"default\", \"rope_theta\": %s}, "
            "\"full_attention\": {\"rope_type\": \"proportional\", \"partial_rotary_factor\": "
            "%s, \"rope_theta\": %s}}", lt, pf, gt);
    cw_softcaps_unbiased(w, c);
    cw_bool(w, "attention_k_eq_v", c->k_eq_v);
    cw_int(w, "num_kv_shared_layers", count_shared(c));
    cw_bool(w, "use_double_wide_mlp", c->double_wide_mlp);
    cw_int(w, "hidden_size_per_layer_input", c->per_layer_dim);
    if (c->per_layer_dim > 0)
        cw_int(w, "vocab_size_per_layer_input", c->per_layer_vocab);
    cw_bool(w, "enable_moe_block", false);
}

static void write_config(FILE *f, const kv_config *c, const char *torch_dtype)
{
    cfg_writer w = { f, 0 };
    fputc('{', f);
    write_common(&w, c, torch_dtype);
    if (c->arch == ARCH_LLAMA) {
        cw_bool(&w, "attention_bias", c->qkv_bias);
        cw_bool(&w, "mlp_bias", false);
    } else if (c->arch == ARCH_QWEN2 || c->arch == ARCH_QWEN3) {
        if (c->arch == ARCH_QWEN3)
            cw_bool(&w, "attention_bias", c->qkv_bias);
        cw_bool(&w, "use_sliding_window", false);
        cw_raw(&w, "sliding_window", "null");
        cw_int(&w, "max_window_layers", c->n_layers);
    } else if (c->arch == ARCH_GEMMA4) {
        write_gemma4(&w, c);
    } else if (c->arch == ARCH_GEMMA3) {
        write_gemma(&w, c);
    } else if (fam(c)->write) {
        fam(c)->write(&w, c);
    }
    fputs("\n}\n", f);
}

/* config.json can say "the last N layers share KV" and nothing else. */
static int check_expressible(const kv_config *c, kv_err *e)
{
    int shared = count_shared(c);
    if (shared > 0 && !is_gemma(c->arch))
        return kv_errf(e, "KV sharing cannot be written for %s (num_kv_shared_layers is "
                       "read for gemma3_text and gemma4_text only)", c->model_type);
    kv_config rule = *c;
    if (set_owners(&rule, shared) >= 0)
        return kv_errf(e, "kv_owner cannot be written as num_kv_shared_layers");
    for (int i = 0; i < c->n_layers; i++)
        if (rule.kv_owner[i] != c->kv_owner[i])
            return kv_errf(e, "kv_owner[%d] is %d; num_kv_shared_layers %d would make it %d",
                           i, c->kv_owner[i], shared, rule.kv_owner[i]);
    return 0;
}

int config_write_json(const kv_config *c, const char *path, kv_err *e)
{
    return config_write_json_dtype(c, path, "float32", e);
}

int config_write_json_dtype(const kv_config *c, const char *path, const char *torch_dtype,
                            kv_err *e)
{
    if (!path)
        return kv_errf(e, "config_write_json: no path");
    if (config_validate(c, e) || check_expressible(c, e))
        return kv_err_prefix(e, path);
    /* A fresh temporary name from mkstemp (outfile.h): a predictable
     * "config.json.tmp.<pid>" could be a symlink planted to a file the
     * write would then go through. */
    outfile o;
    if (outfile_open(&o, path, e) < 0)
        return -1;
    write_config(o.f, c, torch_dtype);
    return outfile_commit(&o, e);
}

/* ---- presets ------------------------------------------------------------ */

typedef struct {
    const char *name;
    kv_arch arch;
    int hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, max_positions;
    double eps, theta, local_theta, qpas;
    bool tie;
    int window, pattern, kv_shared;
    int bos, n_eos, eos[2];
    kv_rope_scaling scaling;
    /* Gemma 4 only */
    int head_dim_full, kv_heads_full, per_layer_dim;
    double partial_full, softcap;
    bool k_eq_v, double_wide;
} preset_spec;

#define NO_SCALING { .type = ROPE_SCALE_NONE }
#define NO_G4 0, 0, 0, 0.0, 0.0, false, false

/* The tiny models are small enough to dump whole; the -shape presets have
 * the published configs' dimensions (Qwen/Qwen2.5-0.5B, Qwen/Qwen3-0.6B,
 * google/gemma-3-1b-it) with synthetic weights. tiny-llama3 is tiny-llama
 * with Llama 3.1/3.2's rope_scaling (factor 32, low 1, high 4), its
 * original_max_position_embeddings scaled down from 8192 to 64 so that, at
 * head_dim 16, some frequencies are kept, one is blended and the rest are
 * slowed: every branch of the rule is exercised. */
static const preset_spec PRESETS[] = {
    { "tiny-llama", ARCH_LLAMA, 64, 4, 4, 2, 16, 128, 256, 4096,
      1e-5, 500000.0, 0, 0, false, 0, 0, 0, 1, 1, { 2 }, NO_SCALING, NO_G4 },
    { "tiny-llama3", ARCH_LLAMA, 64, 4, 4, 2, 16, 128, 256, 4096,
      1e-5, 500000.0, 0, 0, true, 0, 0, 0, 1, 1, { 2 },
      { .type = ROPE_SCALE_LLAMA3, .factor = 32.0, .low_freq_factor = 1.0,
        .high_freq_factor = 4.0, .original_max_position = 64 }, NO_G4 },
    { "tiny-qwen2", ARCH_QWEN2, 64, 4, 4, 2, 16, 128, 256, 4096,
      1e-6, 1e6, 0, 0, true, 0, 0, 0, 1, 1, { 2 }, NO_SCALING, NO_G4 },
    /* head_dim 32 differs from hidden/heads = 16, as in every Qwen3. */
    { "tiny-qwen3", ARCH_QWEN3, 64, 4, 4, 2, 32, 128, 256, 4096,
      1e-6, 1e6, 0, 0, true, 0, 0, 0, 1, 1, { 2 }, NO_SCALING, NO_G4 },
    { "tiny-gemma3", ARCH_GEMMA3, 64, 6, 4, 2, 32, 128, 256, 4096,
      1e-6, 1e6, 10000.0, 24, true, 12, 6, 0, 1, 1, { 2 }, NO_SCALING, NO_G4 },
    { "tiny-gemma3-kvshared", ARCH_GEMMA3, 64, 12, 4, 2, 32, 128, 256, 4096,
      1e-6, 1e6, 10000.0, 24, true, 12, 6, 4, 1, 1, { 2 }, NO_SCALING, NO_G4 },
    /* hidden 288 = 1152 / 4: sqrt(288) = 16.97 has gemma-3-1b's mantissa, so
     * the embedding scale is inexact in bf16 (17.0) as at 1B, and 288
     * columns let a row's worst rounding show, as 64 do not. */
    { "tiny-gemma3-h288", ARCH_GEMMA3, 288, 6, 4, 2, 64, 576, 256, 4096,
      1e-6, 1e6, 10000.0, 64, true, 12, 6, 0, 1, 1, { 2 }, NO_SCALING, NO_G4 },
    { "qwen2.5-0.5b-shape", ARCH_QWEN2, 896, 24, 14, 2, 64, 4864, 151936, 32768,
      1e-6, 1e6, 0, 0, true, 0, 0, 0, 151643, 1, { 151643 }, NO_SCALING, NO_G4 },
    { "qwen3-0.6b-shape", ARCH_QWEN3, 1024, 28, 16, 8, 128, 3072, 151936, 40960,
      1e-6, 1e6, 0, 0, true, 0, 0, 0, 151643, 1, { 151645 }, NO_SCALING, NO_G4 },
    { "gemma3-1b-shape", ARCH_GEMMA3, 1152, 26, 4, 1, 256, 6912, 262144, 32768,
      1e-6, 1e6, 10000.0, 256, true, 512, 6, 0, 2, 2, { 1, 106 }, NO_SCALING, NO_G4 },
    /* Gemma 4 in small: layers (S S S F) x 3, the last four sharing
     * (sliding ones read layer 6, the full one layer 7: the last layers
     * before the shared block are sliding then full, as in E2B and as
     * llama.cpp assumes), sliding heads 32 wide with 2 KV heads, full ones
     * 64 wide with 1 KV head and v taken from k (both multiples of q8_0's
     * block of 32), a quarter of the full heads' pairs rotating,
     * double-wide MLPs on the shared layers and 16-wide per-layer inputs
     * (E/4; E2B's are E/6: narrower ones let llama.cpp's table GELU swing
     * the block's normalised output past any drift bound). Eight layers
     * before the shared block let a wrong shared_kv_layers (8 for 4) still
     * run in llama.cpp. */
    { "tiny-gemma4", ARCH_GEMMA4, 64, 12, 4, 2, 32, 96, 256, 4096,
      1e-6, 1e6, 10000.0, 0, true, 12, 4, 4, 2, 1, { 1 }, NO_SCALING,
      64, 1, 16, 0.25, 30.0, true, true },
    /* google/gemma-4-E2B's text model with synthetic weights. */
    { "gemma4-e2b-shape", ARCH_GEMMA4, 1536, 35, 8, 1, 256, 6144, 262144, 131072,
      1e-6, 1e6, 10000.0, 0, true, 512, 5, 20, 2, 2, { 1, 106 }, NO_SCALING,
      512, 1, 256, 0.25, 30.0, false, true },
};

#define N_PRESETS ((int)(sizeof PRESETS / sizeof PRESETS[0]))

static void build_preset(const preset_spec *p, kv_config *c)
{
    memset(c, 0, sizeof *c);
    family_set(c, p->arch);
    c->hidden = p->hidden;
    c->n_layers = p->layers;
    c->n_heads = p->heads;
    c->n_kv_heads = p->kv_heads;
    c->head_dim = p->head_dim;
    c->intermediate = p->intermediate;
    c->vocab = p->vocab;
    c->max_positions = p->max_positions;
    c->rms_eps = p->eps;
    c->tie_embeddings = p->tie;
    c->rope_theta = p->theta;
    c->rope_local_theta = is_gemma(p->arch) ? p->local_theta : p->theta;
    c->query_pre_attn_scalar = p->qpas;
    c->rope_scaling = p->scaling;
    set_scales(c);
    if (p->pattern > 0)
        cfg_layers_from_pattern(c, p->pattern);
    c->sliding_window = p->window;
    set_owners(c, p->kv_shared);
    c->bos_id = p->bos;
    c->n_eos = p->n_eos;
    memcpy(c->eos_ids, p->eos, sizeof p->eos);
    if (p->arch == ARCH_GEMMA4) {
        c->head_dim_full = p->head_dim_full;
        c->n_kv_heads_full = p->kv_heads_full;
        c->rope_partial_full = p->partial_full;
        c->k_eq_v = p->k_eq_v;
        c->double_wide_mlp = p->double_wide;
        c->per_layer_dim = p->per_layer_dim;
        c->per_layer_vocab = p->per_layer_dim ? p->vocab : 0;
        c->final_softcap = p->softcap;
    }
}

int config_preset(const char *name, kv_config *out, kv_err *e)
{
    char list[768] = "";
    for (int i = 0; name && out && i < N_PRESETS; i++) {
        if (strcmp(name, PRESETS[i].name) == 0) {
            build_preset(&PRESETS[i], out);
            return 0;
        }
    }
    for (int i = 0; name && out && i < family_preset_count(); i++) {
        const kv_family_preset *p = family_preset(i);
        if (strcmp(name, p->name) == 0) {
            memset(out, 0, sizeof *out);
            p->build(out);
            return 0;
        }
    }
    for (const char *const *n = config_preset_names(); *n; n++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                 n == config_preset_names() ? "" : ", ", *n);
    return kv_errf(e, "unknown preset '%s' (presets: %s)", name ? name : "(null)", list);
}

#define MAX_PRESETS 64

static const char *preset_names[MAX_PRESETS + 1];
static pthread_once_t preset_names_once = PTHREAD_ONCE_INIT;

static void list_presets(void)
{
    int n = 0;
    for (int i = 0; i < N_PRESETS && n < MAX_PRESETS; i++)
        preset_names[n++] = PRESETS[i].name;
    for (int i = 0; i < family_preset_count() && n < MAX_PRESETS; i++)
        preset_names[n++] = family_preset(i)->name;
    preset_names[n] = NULL;
}

const char *const *config_preset_names(void)
{
    pthread_once(&preset_names_once, list_presets);
    return preset_names;
}

/* ---- description -------------------------------------------------------- */

void config_describe(const kv_config *c, char *buf, size_t n)
{
    char layers[96], extra[96] = "";
    if (!buf || n == 0)
        return;
    if (!c) {
        snprintf(buf, n, "(no config)");
        return;
    }
    int n_sliding = 0, shared = count_shared(c);
    for (int i = 0; i < c->n_layers && i < KV_MAX_LAYERS; i++)
        n_sliding += c->layer_type[i] == ATTN_SLIDING;
    int n_global = c->n_layers - n_sliding;
    if (n_sliding > 0)
        snprintf(layers, sizeof layers, "%d sliding W=%d, %d global", n_sliding,
                 c->sliding_window, n_global);
    else
        snprintf(layers, sizeof layers, "%d global", n_global);
    if (shared > 0)
        snprintf(layers + strlen(layers), sizeof layers - strlen(layers),
                 ", %d KV-shared", shared);
    static const char *const scale_names[] = {"none", "linear", "llama3", "yarn"};
    if (c->rope_scaling.type != ROPE_SCALE_NONE)
        snprintf(extra, sizeof extra, " rope %s x%g", scale_names[c->rope_scaling.type],
                 c->rope_scaling.factor);
    if (c->attn_sinks)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " sinks");
    if (c->n_experts > 0)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " experts %d/%d",
                 c->n_experts_used, c->n_experts);
    if (c->o_bias)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra), " attention_bias");
    if (c->arch == ARCH_GEMMA4)
        snprintf(extra + strlen(extra), sizeof extra - strlen(extra),
                 " full D=%d KV=%d%s P=%d", c->head_dim_full, c->n_kv_heads_full,
                 c->k_eq_v ? " K=V" : "", c->per_layer_dim);
    snprintf(buf, n, "%s: %d layers (%s), E=%d H=%d/KV=%d D=%d I=%d V=%d%s",
             c->model_type, c->n_layers, layers, c->hidden, c->n_heads, c->n_kv_heads,
             c->head_dim, c->intermediate, c->vocab, extra);
}
