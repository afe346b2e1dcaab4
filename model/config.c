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
#include "infile.h"
#include "observer.h"
#include "outfile.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
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

/* ---- what each family fixes, and the library's defaults ----------------- */

typedef struct {
    const char *model_type;     /* as written to config.json */
    const char *architecture;   /* architectures[0] when writing */
    const char *act_key;        /* hidden_act or hidden_activation */
    bool sizes_required;        /* num_attention_heads, vocab_size have 7B defaults */
    int def_heads, def_kv_heads, def_head_dim, def_vocab; /* when not required */
    int def_max_positions;
    double def_theta;
    bool def_tie;
    int def_bos, def_eos;       /* -1: none */
} arch_info;

static const arch_info ARCHES[] = {
    [ARCH_LLAMA] = { "llama", "LlamaForCausalLM", "hidden_act", true,
                     0, 0, 0, 0, 2048, 10000.0, false, 1, 2 },
    [ARCH_QWEN2] = { "qwen2", "Qwen2ForCausalLM", "hidden_act", true,
                     0, 0, 0, 0, 32768, 10000.0, false, -1, -1 },
    [ARCH_GEMMA3] = { "gemma3_text", "Gemma3ForCausalLM", "hidden_activation", false,
                      8, 4, 256, 262208, 131072, 1000000.0, true, 2, 1 },
    /* Qwen3Config: head_dim defaults to 128 (not hidden/heads). */
    [ARCH_QWEN3] = { "qwen3", "Qwen3ForCausalLM", "hidden_act", true,
                     0, 0, 128, 0, 32768, 10000.0, false, -1, -1 },
    /* Gemma 4: the sizes are required (its published models differ in
     * each), head_dim defaults to 256 as in Gemma 3. */
    [ARCH_GEMMA4] = { "gemma4_text", "Gemma4ForCausalLM", "hidden_activation", true,
                      0, 0, 256, 0, 131072, 1000000.0, true, 2, 1 },
};

#define GEMMA_DEF_QPAS         256.0
#define GEMMA_DEF_WINDOW       4096
#define GEMMA_DEF_PATTERN      6
#define GEMMA_DEF_LOCAL_THETA  10000.0

static bool arch_known(kv_arch a)
{
    return a == ARCH_LLAMA || a == ARCH_QWEN2 || a == ARCH_GEMMA3 || a == ARCH_QWEN3
        || a == ARCH_GEMMA4;
}

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
    bool gemma = is_gemma(c->arch);
    c->norm_plus_one = c->arch == ARCH_GEMMA3;
    c->qk_norm = gemma || c->arch == ARCH_QWEN3;
    c->sandwich_norms = gemma;
    c->qkv_bias = c->arch == ARCH_QWEN2;
    c->o_bias = false;
    c->act = gemma ? ACT_GELU_TANH : ACT_SILU;
    c->v_norm = c->arch == ARCH_GEMMA4;
    c->layer_scalar = c->arch == ARCH_GEMMA4;
}

static void set_family(kv_config *c, kv_arch arch)
{
    c->arch = arch;
    snprintf(c->model_type, sizeof c->model_type, "%s", ARCHES[arch].model_type);
    config_family_flags(c);
    snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "model.");
    snprintf(c->lm_head_name, sizeof c->lm_head_name, "lm_head.weight");
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
        c->attn_scale = scale_of((double)c->head_dim);
        c->query_pre_attn_scalar = 0.0;
    }
}

/* Gemma 3's sliding_window_pattern P: layer i slides iff (i+1) % P != 0. */
static void layers_from_pattern(kv_config *c, int pattern)
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

static const char *type_name(int t)
{
    return t == ATTN_SLIDING ? "sliding_attention" : "full_attention";
}

/* ---- JSON reading helpers ----------------------------------------------- */

/* Where messages come from: the file, and "text_config." when reading the
 * nested text config of a Gemma3ForConditionalGeneration config. */
typedef struct {
    const char *file;
    const char *scope;
    kv_err *e;
} jctx;

static int failf(const jctx *cx, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int failf(const jctx *cx, const char *key, const char *fmt, ...)
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
static void fmt_double(char *buf, size_t n, double v)
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
static const char *jdesc(const json_t *v, char *buf, size_t n)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    case JSON_NULL: return "null";
    case JSON_STRING: snprintf(buf, n, "the string \"%.40s\"", json_string_value(v)); break;
    case JSON_INTEGER: snprintf(buf, n, "%" JSON_INTEGER_FORMAT, json_integer_value(v)); break;
    case JSON_REAL: fmt_double(buf, n, json_real_value(v)); break;
    }
    return buf;
}

static const char *subkey(char *buf, size_t n, const char *path, const char *key)
{
    snprintf(buf, n, "%s.%s", path, key);
    return buf;
}

static bool present(const json_t *v)
{
    return v != NULL && !json_is_null(v);
}

static int want_int(const jctx *cx, const char *key, const json_t *v,
                    long long lo, long long hi, int *out)
{
    char d[64];
    if (!json_is_integer(v))
        return failf(cx, key, "is %s; expected an integer", jdesc(v, d, sizeof d));
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return failf(cx, key, "is %lld; expected %lld..%lld", x, lo, hi);
    *out = (int)x;
    return 0;
}

/* An integer field; absent gives def unless required. null is an error. */
static int get_int(const jctx *cx, const json_t *obj, const char *key, bool required,
                   int def, long long lo, long long hi, int *out)
{
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        if (required)
            return failf(cx, key, "is missing");
        *out = def;
        return 0;
    }
    return want_int(cx, key, v, lo, hi, out);
}

/* A number in (lo, hi] (lo_open) or [lo, hi]; integers are accepted. */
static int want_num(const jctx *cx, const char *key, const json_t *v,
                    double lo, bool lo_open, double hi, double *out)
{
    char d[64];
    if (!json_is_number(v))
        return failf(cx, key, "is %s; expected a number", jdesc(v, d, sizeof d));
    double x = json_number_value(v);
    bool low_ok = lo_open ? x > lo : x >= lo;
    if (!isfinite(x) || !low_ok || x > hi)
        return failf(cx, key, "is %s; expected a number %s %g and <= %g",
                     jdesc(v, d, sizeof d), lo_open ? ">" : ">=", lo, hi);
    *out = x;
    return 0;
}

static int get_num(const jctx *cx, const json_t *obj, const char *key, double def,
                   double lo, bool lo_open, double hi, double *out)
{
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    return want_num(cx, key, v, lo, lo_open, hi, out);
}

static int get_bool(const jctx *cx, const json_t *obj, const char *key, bool def, bool *out)
{
    char d[64];
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v))
        return failf(cx, key, "is %s; expected true or false", jdesc(v, d, sizeof d));
    *out = json_is_true(v);
    return 0;
}

/* A string field; absent gives def (NULL def: required). */
static int get_str(const jctx *cx, const json_t *obj, const char *key,
                   const char *def, const char **out)
{
    char d[64];
    const json_t *v = json_object_get(obj, key);
    if (!v) {
        if (!def)
            return failf(cx, key, "is missing");
        *out = def;
        return 0;
    }
    if (!json_is_string(v))
        return failf(cx, key, "is %s; expected a string", jdesc(v, d, sizeof d));
    *out = json_string_value(v);
    return 0;
}

/* Refuses a boolean feature switch that is true. */
static int refuse_true(const jctx *cx, const json_t *obj, const char *key, const char *why)
{
    bool on = false;
    if (get_bool(cx, obj, key, false, &on))
        return -1;
    return on ? failf(cx, key, "is true; %s", why) : 0;
}

/* ---- sizes -------------------------------------------------------------- */

static int parse_heads(const jctx *cx, const json_t *obj, kv_config *c)
{
    const arch_info *a = &ARCHES[c->arch];
    bool gemma = c->arch == ARCH_GEMMA3;
    if (get_int(cx, obj, "num_attention_heads", a->sizes_required, a->def_heads,
                1, MAX_HEADS, &c->n_heads))
        return -1;
    /* llama and qwen2 default KV heads to the query heads (null too);
     * Gemma3TextConfig defaults to 4. */
    const json_t *kv = json_object_get(obj, "num_key_value_heads");
    if (c->arch == ARCH_GEMMA4 && !present(kv))
        return failf(cx, "num_key_value_heads", "is missing (gemma4_text has no default)");
    if (!kv || (json_is_null(kv) && !gemma))
        c->n_kv_heads = gemma ? a->def_kv_heads : c->n_heads;
    else if (want_int(cx, "num_key_value_heads", kv, 1, MAX_HEADS, &c->n_kv_heads))
        return -1;
    if (c->n_heads % c->n_kv_heads != 0)
        return failf(cx, "num_key_value_heads", "is %d, which does not divide "
                     "num_attention_heads %d", c->n_kv_heads, c->n_heads);
    return 0;
}

static int parse_head_dim(const jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *hd = json_object_get(obj, "head_dim");
    /* Gemma3TextConfig and Qwen3Config give head_dim a default of its own
     * (a null there is an error); LlamaConfig and Qwen2Config derive it. */
    bool own_default = is_gemma(c->arch) || c->arch == ARCH_QWEN3;
    if (present(hd) || (hd && own_default)) {
        if (want_int(cx, "head_dim", hd, 1, MAX_HEAD_DIM, &c->head_dim))
            return -1;
    } else if (own_default) {
        c->head_dim = ARCHES[c->arch].def_head_dim;
    } else if (c->hidden % c->n_heads != 0) {
        return failf(cx, "head_dim", "is missing and hidden_size %d is not a multiple "
                     "of num_attention_heads %d", c->hidden, c->n_heads);
    } else {
        c->head_dim = c->hidden / c->n_heads;
    }
    if (c->head_dim % 2 != 0)
        return failf(cx, "head_dim", "is %d; RoPE needs an even head_dim", c->head_dim);
    return 0;
}

static int parse_sizes(const jctx *cx, const json_t *obj, kv_config *c)
{
    const arch_info *a = &ARCHES[c->arch];
    if (get_int(cx, obj, "hidden_size", true, 0, 1, MAX_HIDDEN, &c->hidden)
        || get_int(cx, obj, "num_hidden_layers", true, 0, 1, KV_MAX_LAYERS, &c->n_layers)
        || get_int(cx, obj, "intermediate_size", true, 0, 1, MAX_INTERMEDIATE, &c->intermediate)
        || parse_heads(cx, obj, c) || parse_head_dim(cx, obj, c)
        || get_int(cx, obj, "vocab_size", a->sizes_required, a->def_vocab, 1, MAX_VOCAB, &c->vocab)
        || get_int(cx, obj, "max_position_embeddings", false, a->def_max_positions,
                   1, MAX_POSITIONS, &c->max_positions))
        return -1;
    return 0;
}

/* ---- norm, activation, features the engines do not implement ------------ */

static int parse_act(const jctx *cx, const json_t *obj, kv_config *c)
{
    const char *key = ARCHES[c->arch].act_key;
    bool gemma = is_gemma(c->arch);
    const char *act = NULL;
    if (get_str(cx, obj, key, gemma ? "gelu_pytorch_tanh" : "silu", &act))
        return -1;
    bool ok = gemma ? !strcmp(act, "gelu_pytorch_tanh") || !strcmp(act, "gelu_tanh")
                    : !strcmp(act, "silu") || !strcmp(act, "swish");
    if (!ok)
        return failf(cx, key, "'%.40s' is not supported for %s (kvdiff runs %s)", act,
                     c->model_type, gemma ? "gelu_pytorch_tanh" : "silu");
    return 0;
}

/* attention_bias (LlamaAttention, Qwen3Attention): q, k, v and o_proj
 * all get a bias. */
static int parse_attention_bias(const jctx *cx, const json_t *obj, kv_config *c)
{
    bool on = false;
    if (get_bool(cx, obj, "attention_bias", false, &on))
        return -1;
    c->qkv_bias = c->o_bias = on;
    return 0;
}

/* Gemma 4: MoE and bidirectional text attention are out of scope;
 * "vision" (bidirectional over image tokens only) leaves text causal. */
static int parse_gemma4_switches(const jctx *cx, const json_t *obj)
{
    char d[64];
    const json_t *cap = json_object_get(obj, "attn_logit_softcapping");
    if (present(cap))
        return failf(cx, "attn_logit_softcapping", "is %s; attention logit softcapping "
                     "is not supported (Gemma 4 has none)", jdesc(cap, d, sizeof d));
    const json_t *bi = json_object_get(obj, "use_bidirectional_attention");
    if (present(bi) && !json_is_false(bi)
        && !(json_is_string(bi) && !strcmp(json_string_value(bi), "vision")))
        return failf(cx, "use_bidirectional_attention", "is %s; kvdiff runs causal "
                     "decoders only", jdesc(bi, d, sizeof d));
    const json_t *ne = json_object_get(obj, "num_experts");
    if (present(ne) && !(json_is_integer(ne) && json_integer_value(ne) == 0))
        return failf(cx, "num_experts", "is %s; Gemma 4's mixture-of-experts models are "
                     "not supported (dense E2B/E4B-style models only)", jdesc(ne, d, sizeof d));
    return refuse_true(cx, obj, "enable_moe_block", "Gemma 4's mixture-of-experts block is "
                       "not supported (dense E2B/E4B-style models only)")
        || refuse_true(cx, obj, "attention_bias", "biased attention projections are not "
                       "supported for gemma4_text");
}

static int parse_family_switches(const jctx *cx, const json_t *obj, kv_config *c)
{
    switch (c->arch) {
    case ARCH_LLAMA:
        return parse_attention_bias(cx, obj, c)
            || refuse_true(cx, obj, "mlp_bias", "biased MLP projections are not "
                           "supported for llama");
    case ARCH_QWEN2:
        return refuse_true(cx, obj, "use_sliding_window", "sliding-window attention is "
                           "not supported for qwen2 (kvdiff runs every layer global)");
    case ARCH_QWEN3:
        return parse_attention_bias(cx, obj, c)
            || refuse_true(cx, obj, "use_sliding_window", "sliding-window attention is "
                           "not supported for qwen3 (kvdiff runs every layer global)");
    case ARCH_GEMMA3: {
        char d[64];
        const json_t *cap = json_object_get(obj, "attn_logit_softcapping");
        if (present(cap))
            return failf(cx, "attn_logit_softcapping", "is %s; attention logit "
                         "softcapping is not supported (Gemma 3 sets it to null)",
                         jdesc(cap, d, sizeof d));
        return refuse_true(cx, obj, "attention_bias", "biased attention projections are "
                           "not supported for gemma3_text")
            || refuse_true(cx, obj, "use_bidirectional_attention", "kvdiff runs causal "
                           "decoders only");
    }
    case ARCH_GEMMA4:
        return parse_gemma4_switches(cx, obj);
    }
    return 0;
}

static int parse_gemma_scalars(const jctx *cx, const json_t *obj, kv_config *c)
{
    if (get_num(cx, obj, "query_pre_attn_scalar", GEMMA_DEF_QPAS, 0.0, true, MAX_SCALAR,
                &c->query_pre_attn_scalar))
        return -1;
    const json_t *cap = json_object_get(obj, "final_logit_softcapping");
    c->final_softcap = 0.0;
    if (present(cap))
        return want_num(cx, "final_logit_softcapping", cap, 0.0, true, MAX_SCALAR,
                        &c->final_softcap);
    return 0;
}

static int parse_norm_act(const jctx *cx, const json_t *obj, kv_config *c)
{
    if (get_num(cx, obj, "rms_norm_eps", 1e-6, 0.0, true, 1.0, &c->rms_eps)
        || parse_act(cx, obj, c) || parse_family_switches(cx, obj, c))
        return -1;
    if (c->arch == ARCH_GEMMA3)
        return parse_gemma_scalars(cx, obj, c);
    if (c->arch == ARCH_GEMMA4) {
        const json_t *cap = json_object_get(obj, "final_logit_softcapping");
        c->final_softcap = 0.0;
        if (present(cap))
            return want_num(cx, "final_logit_softcapping", cap, 0.0, true, MAX_SCALAR,
                            &c->final_softcap);
    }
    return 0;
}

/* ---- RoPE --------------------------------------------------------------- */

/* A string member of a RoPE object; "" when absent. */
static int rope_str(const jctx *cx, const char *path, const json_t *v, const char *key,
                    const char **out)
{
    char k[128], d[64];
    const json_t *s = json_object_get(v, key);
    *out = "";
    if (s && !json_is_string(s))
        return failf(cx, subkey(k, sizeof k, path, key), "is %s; expected a string",
                     jdesc(s, d, sizeof d));
    if (s)
        *out = json_string_value(s);
    return 0;
}

/* The scaling type: rope_type, or the older key type (they must agree).
 * *key (may be NULL): which of the two said it, for messages. */
static int scaling_type_key(const jctx *cx, const char *path, const json_t *v,
                            bool required, const char **type, const char **key)
{
    const char *rt = NULL, *ty = NULL;
    if (rope_str(cx, path, v, "rope_type", &rt) || rope_str(cx, path, v, "type", &ty))
        return -1;
    if (*rt && *ty && strcmp(rt, ty) != 0)
        return failf(cx, path, "has rope_type '%.40s' and type '%.40s'; they must agree", rt, ty);
    *type = *rt ? rt : *ty ? ty : NULL;
    if (key)
        *key = *rt || !*ty ? "rope_type" : "type";
    if (!*type && required)
        return failf(cx, path, "has no rope_type");
    return 0;
}

static int scaling_type(const jctx *cx, const char *path, const json_t *v,
                        bool required, const char **type)
{
    return scaling_type_key(cx, path, v, required, type, NULL);
}

static int parse_llama3_scaling(const jctx *cx, const char *path, const json_t *v,
                                kv_rope_scaling *s)
{
    char k[128];
    const char *names[3] = { "factor", "low_freq_factor", "high_freq_factor" };
    double *dst[3] = { &s->factor, &s->low_freq_factor, &s->high_freq_factor };
    for (int i = 0; i < 3; i++) {
        const json_t *x = json_object_get(v, names[i]);
        subkey(k, sizeof k, path, names[i]);
        if (!x)
            return failf(cx, k, "is missing");
        if (want_num(cx, k, x, 0.0, true, MAX_FACTOR, dst[i]))
            return -1;
    }
    const json_t *om = json_object_get(v, "original_max_position_embeddings");
    subkey(k, sizeof k, path, "original_max_position_embeddings");
    if (!om)
        return failf(cx, k, "is missing");
    if (want_int(cx, k, om, 1, MAX_POSITIONS, &s->original_max_position))
        return -1;
    if (s->high_freq_factor <= s->low_freq_factor)
        return failf(cx, path, "has high_freq_factor %g <= low_freq_factor %g",
                     s->high_freq_factor, s->low_freq_factor);
    return 0;
}

/* A rope_scaling object (or the scaling part of rope_parameters). */
static int parse_scaling(const jctx *cx, const char *path, const json_t *v,
                         bool type_required, kv_rope_scaling *s)
{
    char d[64], k[128];
    const char *type = NULL;
    memset(s, 0, sizeof *s);
    if (!present(v))
        return 0;
    if (!json_is_object(v))
        return failf(cx, path, "is %s; expected an object or null", jdesc(v, d, sizeof d));
    if (scaling_type(cx, path, v, type_required, &type))
        return -1;
    if (!type || !strcmp(type, "default"))
        return 0;
    if (!strcmp(type, "llama3")) {
        s->type = ROPE_SCALE_LLAMA3;
        return parse_llama3_scaling(cx, path, v, s);
    }
    if (strcmp(type, "linear") != 0)
        return failf(cx, path, "type '%.40s' is not supported (kvdiff supports linear "
                     "and llama3)", type);
    s->type = ROPE_SCALE_LINEAR;
    const json_t *f = json_object_get(v, "factor");
    subkey(k, sizeof k, path, "factor");
    if (!f)
        return failf(cx, k, "is missing");
    return want_num(cx, k, f, 0.0, true, MAX_FACTOR, &s->factor);
}

/* partial_rotary_factor other than 1 (rotating part of each head) is refused. */
static int refuse_partial_rotary(const jctx *cx, const char *key, const json_t *v)
{
    double f = 1.0;
    if (!present(v))
        return 0;
    if (want_num(cx, key, v, 0.0, true, 1.0, &f))
        return -1;
    return f != 1.0 ? failf(cx, key, "is %g; partial rotary embeddings are not "
                            "supported", f) : 0;
}

/* One entry of transformers 5's rope_parameters: scaling plus rope_theta. */
static int parse_rope_entry(const jctx *cx, const char *path, const json_t *v,
                            kv_rope_scaling *s, double *theta)
{
    char k[128];
    if (!json_is_object(v)) {
        char d[64];
        return failf(cx, path, "is %s; expected an object", jdesc(v, d, sizeof d));
    }
    if (parse_scaling(cx, path, v, false, s))
        return -1;
    const json_t *t = json_object_get(v, "rope_theta");
    if (t && want_num(cx, subkey(k, sizeof k, path, "rope_theta"), t,
                      MIN_THETA, false, MAX_THETA, theta))
        return -1;
    return refuse_partial_rotary(cx, subkey(k, sizeof k, path, "partial_rotary_factor"),
                                 json_object_get(v, "partial_rotary_factor"));
}

/* rope_parameters.sliding_attention (Gemma 3 and 4): the local base,
 * unscaled. */
static int parse_sliding_rope(const jctx *cx, const json_t *slide, kv_config *c)
{
    kv_rope_scaling s = { ROPE_SCALE_NONE, 0, 0, 0, 0 };
    const char *path = "rope_parameters.sliding_attention", *type = NULL, *tkey = "rope_type";
    char k[128];
    /* "proportional" here is Gemma 4's full-layer RoPE put on the wrong
     * layers, not a scaling kvdiff lacks: said so, under the key that has it. */
    if (json_is_object(slide) && scaling_type_key(cx, path, slide, false, &type, &tkey))
        return -1;
    if (type && !strcmp(type, "proportional"))
        return failf(cx, subkey(k, sizeof k, path, tkey), "is 'proportional'; sliding layers "
                     "rotate whole heads with default RoPE (Gemma 4 rotates part of a head, "
                     "proportional, on full-attention layers only)");
    if (parse_rope_entry(cx, path, slide, &s,
                         &c->rope_local_theta))
        return -1;
    if (s.type != ROPE_SCALE_NONE)
        return failf(cx, "rope_parameters.sliding_attention", "is scaled; kvdiff "
                     "scales RoPE on full-attention layers only");
    return 0;
}

/* Gemma 4's full-attention entry: rope_type "proportional" (or "default")
 * with partial_rotary_factor, the first factor * D/2 frequency pairs
 * rotating at theta^(-2j/D), the rest passing through. */
static int parse_gemma4_full_rope(const jctx *cx, const json_t *v, kv_config *c)
{
    const char *path = "rope_parameters.full_attention", *type = NULL;
    char k[128], d[64];
    if (!json_is_object(v))
        return failf(cx, path, "is %s; expected an object", jdesc(v, d, sizeof d));
    const char *tkey = "rope_type";
    if (scaling_type_key(cx, path, v, false, &type, &tkey))
        return -1;
    bool prop = type && !strcmp(type, "proportional");
    if (type && !prop && strcmp(type, "default") != 0)
        return failf(cx, path, "%s '%.40s' is not supported (Gemma 4's full "
                     "layers use proportional)", tkey, type);
    const json_t *t = json_object_get(v, "rope_theta");
    if (t && want_num(cx, subkey(k, sizeof k, path, "rope_theta"), t, MIN_THETA, false,
                      MAX_THETA, &c->rope_theta))
        return -1;
    const json_t *f = json_object_get(v, "partial_rotary_factor");
    double factor = 1.0;
    subkey(k, sizeof k, path, "partial_rotary_factor");
    if (present(f) && want_num(cx, k, f, 0.0, true, 1.0, &factor))
        return -1;
    /* No rope_type at all is not "rope_type default": the entry lacks the
     * key the factor needs, and the message says so. */
    if (factor != 1.0 && !type)
        return failf(cx, k, "is %g but %s has no rope_type (read as default); kvdiff "
                     "rotates part of a head for rope_type proportional only", factor, path);
    if (factor != 1.0 && !prop)
        return failf(cx, k, "is %g with rope_type default; kvdiff rotates part of a "
                     "head for proportional RoPE only", factor);
    c->rope_partial_full = factor == 1.0 ? 0.0 : factor;
    return 0;
}

static int parse_gemma4_rope(const jctx *cx, const json_t *full, const json_t *slide,
                             kv_config *c)
{
    if (!full && !slide)
        return failf(cx, "rope_parameters", "has neither full_attention nor "
                     "sliding_attention; gemma4_text keys them by layer type");
    if (full && parse_gemma4_full_rope(cx, full, c))
        return -1;
    return slide ? parse_sliding_rope(cx, slide, c) : 0;
}

/* transformers 5 writes rope_parameters instead of rope_theta/rope_scaling:
 * one object for llama/qwen2, one per layer type for Gemma 3. */
static int parse_rope_parameters(const jctx *cx, const json_t *rp, kv_config *c)
{
    char d[64];
    if (!json_is_object(rp))
        return failf(cx, "rope_parameters", "is %s; expected an object",
                     jdesc(rp, d, sizeof d));
    const json_t *full = json_object_get(rp, "full_attention");
    const json_t *slide = json_object_get(rp, "sliding_attention");
    bool keyed = full || slide;
    if (c->arch == ARCH_GEMMA4)
        return parse_gemma4_rope(cx, full, slide, c);
    if (c->arch != ARCH_GEMMA3) {
        if (keyed)
            return failf(cx, "rope_parameters", "is keyed by layer type; %s has one "
                         "kind of layer", c->model_type);
        return parse_rope_entry(cx, "rope_parameters", rp, &c->rope_scaling, &c->rope_theta);
    }
    if (!keyed)
        return failf(cx, "rope_parameters", "has neither full_attention nor "
                     "sliding_attention; gemma3_text keys them by layer type");
    if (full && parse_rope_entry(cx, "rope_parameters.full_attention", full,
                                 &c->rope_scaling, &c->rope_theta))
        return -1;
    return slide ? parse_sliding_rope(cx, slide, c) : 0;
}

static int parse_rope(const jctx *cx, const json_t *obj, kv_config *c)
{
    bool gemma = is_gemma(c->arch);
    if (get_num(cx, obj, "rope_theta", ARCHES[c->arch].def_theta, MIN_THETA, false,
                MAX_THETA, &c->rope_theta))
        return -1;
    c->rope_local_theta = c->rope_theta;
    /* Gemma4TextConfig without rope_parameters: proportional 0.25 on full
     * layers, base 10000 on sliding ones. */
    if (c->arch == ARCH_GEMMA4) {
        c->rope_local_theta = GEMMA_DEF_LOCAL_THETA;
        c->rope_partial_full = 0.25;
    }
    if (c->arch == ARCH_GEMMA3 && get_num(cx, obj, "rope_local_base_freq", GEMMA_DEF_LOCAL_THETA, MIN_THETA,
                         false, MAX_THETA, &c->rope_local_theta))
        return -1;
    const json_t *rs = json_object_get(obj, "rope_scaling");
    const json_t *rp = json_object_get(obj, "rope_parameters");
    if (present(rs) && present(rp))
        return failf(cx, "rope_scaling", "and rope_parameters are both set; kvdiff reads "
                     "one of them");
    if (parse_scaling(cx, "rope_scaling", rs, true, &c->rope_scaling))
        return -1;
    if (present(rp) && parse_rope_parameters(cx, rp, c))
        return -1;
    if (!gemma)
        c->rope_local_theta = c->rope_theta;
    return refuse_partial_rotary(cx, "partial_rotary_factor",
                                 json_object_get(obj, "partial_rotary_factor"));
}

/* ---- layers ------------------------------------------------------------- */

static int parse_layer_types(const jctx *cx, const json_t *lt, kv_config *c)
{
    char d[64], k[48];
    if (!json_is_array(lt))
        return failf(cx, "layer_types", "is %s; expected an array of strings",
                     jdesc(lt, d, sizeof d));
    size_t n = json_array_size(lt);
    if (n != (size_t)c->n_layers)
        return failf(cx, "layer_types", "has %zu entries but num_hidden_layers is %d",
                     n, c->n_layers);
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(lt, i);
        snprintf(k, sizeof k, "layer_types[%zu]", i);
        const char *s = json_is_string(v) ? json_string_value(v) : NULL;
        if (s && !strcmp(s, "full_attention"))
            c->layer_type[i] = ATTN_GLOBAL;
        else if (s && !strcmp(s, "sliding_attention") && is_gemma(c->arch))
            c->layer_type[i] = ATTN_SLIDING;
        else if (s && !strcmp(s, "sliding_attention"))
            return failf(cx, k, "is 'sliding_attention'; sliding attention is not "
                         "supported for %s", c->model_type);
        else
            return failf(cx, k, "is %s; expected 'sliding_attention' or 'full_attention'",
                         jdesc(v, d, sizeof d));
    }
    return 0;
}

static int parse_window(const jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *w = json_object_get(obj, "sliding_window");
    int window = GEMMA_DEF_WINDOW;
    if (w && json_is_null(w))
        window = 0;
    else if (w && want_int(cx, "sliding_window", w, 1, MAX_POSITIONS, &window))
        return -1;
    int first_sliding = -1;
    for (int i = c->n_layers - 1; i >= 0; i--)
        if (c->layer_type[i] == ATTN_SLIDING)
            first_sliding = i;
    if (first_sliding >= 0 && window == 0)
        return failf(cx, "sliding_window", "is null but layer %d is a sliding_attention "
                     "layer", first_sliding);
    c->sliding_window = first_sliding >= 0 ? window : 0;
    return 0;
}

static int parse_kv_sharing(const jctx *cx, const json_t *obj, kv_config *c)
{
    int n_shared = 0;
    if (get_int(cx, obj, "num_kv_shared_layers", false, 0, 0, KV_MAX_LAYERS, &n_shared))
        return -1;
    if (n_shared > 0 && !is_gemma(c->arch))
        return failf(cx, "num_kv_shared_layers", "is %d; KV sharing is read for "
                     "gemma3_text and gemma4_text only", n_shared);
    if (n_shared >= c->n_layers)
        return failf(cx, "num_kv_shared_layers", "is %d but the model has %d layers; at "
                     "least the first layer must compute K/V", n_shared, c->n_layers);
    int orphan = set_owners(c, n_shared);
    if (orphan >= 0)
        return failf(cx, "num_kv_shared_layers", "is %d: layer %d (%s) has no earlier "
                     "non-shared %s layer to read K/V from", n_shared, orphan,
                     type_name(c->layer_type[orphan]), type_name(c->layer_type[orphan]));
    return 0;
}

/* per_layer_config: {"<layer>": {"head_dim": .., "num_key_value_heads": ..}};
 * the first full-attention layer's value of key, or 0. */
static int per_layer_full(const jctx *cx, const json_t *obj, const kv_config *c,
                          const char *key, int *out)
{
    const json_t *plc = json_object_get(obj, "per_layer_config");
    char k[96], d[64];
    *out = 0;
    if (!present(plc))
        return 0;
    if (!json_is_object(plc))
        return failf(cx, "per_layer_config", "is %s; expected an object",
                     jdesc(plc, d, sizeof d));
    for (int i = 0; i < c->n_layers; i++) {
        snprintf(k, sizeof k, "%d", i);
        const json_t *lc = json_object_get(plc, k);
        if (c->layer_type[i] != ATTN_GLOBAL || !json_is_object(lc)
            || !json_object_get(lc, key))
            continue;
        snprintf(k, sizeof k, "per_layer_config.%d.%s", i, key);
        return want_int(cx, k, json_object_get(lc, key), 1, MAX_HEAD_DIM, out);
    }
    return 0;
}

/* A full layer's size: key (global_head_dim, num_global_key_value_heads),
 * else per_layer_config's pkey for the first full layer, else fallback. */
static int full_layer_size(const jctx *cx, const json_t *obj, const kv_config *c,
                           const char *key, const char *pkey, int hi, int fallback, int *out)
{
    const json_t *v = json_object_get(obj, key);
    *out = 0;
    if (present(v) ? want_int(cx, key, v, 1, hi, out) : per_layer_full(cx, obj, c, pkey, out))
        return -1;
    if (*out == 0)
        *out = fallback;
    return 0;
}

/* Gemma 4's full-layer head size and KV heads, K=V, double-wide MLPs and
 * per-layer inputs (after layer types and KV sharing are known). */
static int parse_gemma4_layers(const jctx *cx, const json_t *obj, kv_config *c)
{
    if (full_layer_size(cx, obj, c, "global_head_dim", "head_dim", MAX_HEAD_DIM, c->head_dim,
                        &c->head_dim_full)
        || full_layer_size(cx, obj, c, "num_global_key_value_heads", "num_key_value_heads",
                           MAX_HEADS, c->n_kv_heads, &c->n_kv_heads_full))
        return -1;
    if (c->head_dim_full % 2 != 0)
        return failf(cx, "global_head_dim", "is %d; RoPE needs an even head size",
                     c->head_dim_full);
    if (c->n_heads % c->n_kv_heads_full != 0)
        return failf(cx, "num_global_key_value_heads", "is %d, which does not divide "
                     "num_attention_heads %d", c->n_kv_heads_full, c->n_heads);
    if (c->rope_partial_full > 0 && (int)(c->rope_partial_full * c->head_dim_full / 2) < 1)
        return failf(cx, "rope_parameters.full_attention.partial_rotary_factor", "is %g: "
                     "no pair of a %d-wide head rotates", c->rope_partial_full,
                     c->head_dim_full);
    if (get_bool(cx, obj, "attention_k_eq_v", false, &c->k_eq_v)
        || get_bool(cx, obj, "use_double_wide_mlp", false, &c->double_wide_mlp))
        return -1;
    const json_t *p = json_object_get(obj, "hidden_size_per_layer_input");
    c->per_layer_dim = 0;
    if (present(p) && want_int(cx, "hidden_size_per_layer_input", p, 0, MAX_HIDDEN,
                               &c->per_layer_dim))
        return -1;
    c->per_layer_vocab = 0;
    if (c->per_layer_dim > 0) {
        if (get_int(cx, obj, "vocab_size_per_layer_input", false, c->vocab, 1, MAX_VOCAB,
                    &c->per_layer_vocab))
            return -1;
        if ((long long)c->per_layer_dim * c->n_layers > MAX_HIDDEN)
            return failf(cx, "hidden_size_per_layer_input", "is %d: times %d layers, the "
                         "per-layer table is wider than %d", c->per_layer_dim,
                         c->n_layers, MAX_HIDDEN);
    }
    return 0;
}

static int parse_layers(const jctx *cx, const json_t *obj, kv_config *c)
{
    const json_t *lt = json_object_get(obj, "layer_types");
    memset(c->layer_type, ATTN_GLOBAL, sizeof c->layer_type);
    if (c->arch == ARCH_GEMMA3 && !present(lt)) {
        int pattern = GEMMA_DEF_PATTERN;
        if (get_int(cx, obj, "sliding_window_pattern", false, GEMMA_DEF_PATTERN,
                    1, MAX_PATTERN, &pattern))
            return -1;
        layers_from_pattern(c, pattern);
    } else if (c->arch == ARCH_GEMMA4 && !present(lt)) {
        return failf(cx, "layer_types", "is missing (gemma4_text lists each layer's type)");
    } else if (present(lt) && c->arch != ARCH_LLAMA) {
        /* LlamaConfig has no layer_types; transformers ignores the key there. */
        if (parse_layer_types(cx, lt, c))
            return -1;
    }
    if (is_gemma(c->arch) && parse_window(cx, obj, c))
        return -1;
    if (parse_kv_sharing(cx, obj, c))
        return -1;
    return c->arch == ARCH_GEMMA4 ? parse_gemma4_layers(cx, obj, c) : 0;
}

/* ---- token ids, tying --------------------------------------------------- */

static int parse_eos(const jctx *cx, const json_t *v, kv_config *c)
{
    char k[48], d[64];
    if (json_is_integer(v)) {
        c->n_eos = 1;
        return want_int(cx, "eos_token_id", v, 0, c->vocab - 1, &c->eos_ids[0]);
    }
    if (!json_is_array(v))
        return failf(cx, "eos_token_id", "is %s; expected an integer, a list of integers "
                     "or null", jdesc(v, d, sizeof d));
    size_t n = json_array_size(v);
    if (n > KV_MAX_EOS)
        return failf(cx, "eos_token_id", "lists %zu ids; kvdiff keeps at most %d", n,
                     KV_MAX_EOS);
    for (size_t i = 0; i < n; i++) {
        snprintf(k, sizeof k, "eos_token_id[%zu]", i);
        if (want_int(cx, k, json_array_get(v, i), 0, c->vocab - 1, &c->eos_ids[i]))
            return -1;
    }
    c->n_eos = (int)n;
    return 0;
}

/* Gemma3ForConditionalGeneration keeps token ids (and the tie flag) at the top
 * level; set there (not null) they win over text_config's, as in
 * transformers' generation config. */
static const json_t *pick(const jctx *cx, const json_t *obj, const jctx *top,
                          const json_t *outer, const char *key, const jctx **used)
{
    if (outer && present(json_object_get(outer, key))) {
        *used = top;
        return outer;
    }
    *used = cx;
    return obj;
}

static int parse_tokens(const jctx *cx, const json_t *obj, const json_t *outer, kv_config *c)
{
    const arch_info *a = &ARCHES[c->arch];
    jctx top = { cx->file, "", cx->e };
    const jctx *u;
    const json_t *src = pick(cx, obj, &top, outer, "tie_word_embeddings", &u);
    if (get_bool(u, src, "tie_word_embeddings", a->def_tie, &c->tie_embeddings))
        return -1;
    src = pick(cx, obj, &top, outer, "bos_token_id", &u);
    const json_t *bos = json_object_get(src, "bos_token_id");
    c->bos_id = bos ? -1 : a->def_bos;
    if (present(bos) && want_int(u, "bos_token_id", bos, 0, c->vocab - 1, &c->bos_id))
        return -1;
    src = pick(cx, obj, &top, outer, "eos_token_id", &u);
    const json_t *eos = json_object_get(src, "eos_token_id");
    c->n_eos = 0;
    if (!eos && a->def_eos >= 0) {
        c->n_eos = 1;
        c->eos_ids[0] = a->def_eos;
    }
    if (present(eos))
        return parse_eos(u, eos, c);
    return 0;
}

/* ---- top level ---------------------------------------------------------- */

/* Reads a text model's config object (obj); outer is the enclosing
 * Gemma3ForConditionalGeneration config or NULL. */
static int parse_text(const jctx *cx, const json_t *obj, const json_t *outer,
                      kv_arch arch, kv_config *c)
{
    set_family(c, arch);
    if (parse_sizes(cx, obj, c) || parse_norm_act(cx, obj, c) || parse_rope(cx, obj, c)
        || parse_layers(cx, obj, c) || parse_tokens(cx, obj, outer, c))
        return -1;
    set_scales(c);
    return 0;
}

/* Gemma3ForConditionalGeneration / Gemma4ForConditionalGeneration: the
 * text model under text_config. */
static int parse_gemma_nested(const jctx *cx, const json_t *root, kv_arch arch,
                              kv_config *c)
{
    char d[64];
    const char *outer = arch == ARCH_GEMMA4 ? "gemma4" : "gemma3";
    const char *inner_type = ARCHES[arch].model_type;
    const json_t *tc = json_object_get(root, "text_config");
    if (!tc)
        return failf(cx, "text_config", "is missing (model_type %s nests the text "
                     "model there)", outer);
    if (!json_is_object(tc))
        return failf(cx, "text_config", "is %s; expected an object", jdesc(tc, d, sizeof d));
    const json_t *mt = json_object_get(tc, "model_type");
    if (mt && !(json_is_string(mt) && !strcmp(json_string_value(mt), inner_type)))
        return failf(cx, "text_config.model_type", "is %s; expected \"%s\"",
                     jdesc(mt, d, sizeof d), inner_type);
    jctx inner = { cx->file, "text_config.", cx->e };
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
    jctx cx = { file, "", e };
    char d[64];
    const char *mt = NULL;
    if (!json_is_object(root))
        return kv_errf(e, "%s: top level is %s; expected an object", file,
                       jdesc(root, d, sizeof d));
    if (get_str(&cx, root, "model_type", NULL, &mt))
        return -1;
    if (!strcmp(mt, "gemma3"))
        return parse_gemma_nested(&cx, root, ARCH_GEMMA3, c);
    if (!strcmp(mt, "gemma4"))
        return parse_gemma_nested(&cx, root, ARCH_GEMMA4, c);
    for (int a = 0; a < (int)(sizeof ARCHES / sizeof ARCHES[0]); a++)
        if (!strcmp(mt, ARCHES[a].model_type))
            return parse_text(&cx, root, NULL, (kv_arch)a, c);
    return kv_errf(e, "%s: model_type '%.40s' is not supported (kvdiff reads llama, "
                   "qwen2, qwen3, gemma3_text, gemma3, gemma4_text, gemma4)", file, mt);
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
    if (!arch_known(c->arch))
        return kv_errf(e, "arch %d is not one of llama, qwen2, qwen3, gemma3, gemma4",
                       (int)c->arch);
    kv_config want;
    memset(&want, 0, sizeof want);
    set_family(&want, c->arch);
    if (!has_nul(c->model_type, sizeof c->model_type)
        || strcmp(c->model_type, want.model_type) != 0)
        return kv_errf(e, "model_type '%.*s' does not match the arch (expected '%s')",
                       (int)sizeof c->model_type, c->model_type, want.model_type);
    if (c->norm_plus_one != want.norm_plus_one || c->qk_norm != want.qk_norm
        || c->sandwich_norms != want.sandwich_norms || c->act != want.act
        || c->v_norm != want.v_norm || c->layer_scalar != want.layer_scalar)
        return kv_errf(e, "norm_plus_one/qk_norm/sandwich_norms/act/v_norm/layer_scalar do "
                       "not match the %s family", want.model_type);
    /* Llama and Qwen3 have one switch (attention_bias) for all four biases;
     * the others fix them. */
    bool switchable = c->arch == ARCH_LLAMA || c->arch == ARCH_QWEN3;
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
        : scale_of(gemma ? c->query_pre_attn_scalar : (double)c->head_dim);
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
        if (c->layer_type[i] == ATTN_SLIDING && !is_gemma(c->arch))
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
    bool shared = layer >= 0 && layer < c->n_layers && layer < KV_MAX_LAYERS
        && c->kv_owner[layer] != layer;
    return c->double_wide_mlp && shared ? 2 * c->intermediate : c->intermediate;
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
    return c->double_wide_mlp ? 2 * c->intermediate : c->intermediate;
}

/* ---- writing ------------------------------------------------------------ */

/* A member-by-member JSON object writer: two-space indent, one member a line. */
typedef struct {
    FILE *f;
    int n;
} jwriter;

static void jw_key(jwriter *w, const char *key)
{
    fprintf(w->f, "%s\n  \"%s\": ", w->n++ ? "," : "", key);
}

static void jw_num(jwriter *w, const char *key, double v)
{
    char buf[40];
    fmt_double(buf, sizeof buf, v);
    jw_key(w, key);
    fputs(buf, w->f);
}

static void jw_int(jwriter *w, const char *key, long long v)
{
    jw_key(w, key);
    fprintf(w->f, "%lld", v);
}

static void jw_raw(jwriter *w, const char *key, const char *text)
{
    jw_key(w, key);
    fputs(text, w->f);
}

static void jw_str(jwriter *w, const char *key, const char *s)
{
    jw_key(w, key);
    fprintf(w->f, "\"%s\"", s); /* only fixed ASCII names are written */
}

static void jw_bool(jwriter *w, const char *key, bool b)
{
    jw_raw(w, key, b ? "true" : "false");
}

static void write_scaling(jwriter *w, const kv_rope_scaling *s)
{
    char f[40], lo[40], hi[40];
    if (s->type == ROPE_SCALE_NONE) {
        jw_raw(w, "rope_scaling", "null");
        return;
    }
    fmt_double(f, sizeof f, s->factor);
    jw_key(w, "rope_scaling");
    if (s->type == ROPE_SCALE_LINEAR) {
        fprintf(w->f, "{\"rope_type\": \"linear\", \"factor\": %s}", f);
        return;
    }
    fmt_double(lo, sizeof lo, s->low_freq_factor);
    fmt_double(hi, sizeof hi, s->high_freq_factor);
    fprintf(w->f, "{\"rope_type\": \"llama3\", \"factor\": %s, \"low_freq_factor\": %s, "
            "\"high_freq_factor\": %s, \"original_max_position_embeddings\": %d}",
            f, lo, hi, s->original_max_position);
}

static void write_tokens(jwriter *w, const kv_config *c)
{
    if (c->bos_id < 0)
        jw_raw(w, "bos_token_id", "null");
    else
        jw_int(w, "bos_token_id", c->bos_id);
    if (c->n_eos == 0) {
        jw_raw(w, "eos_token_id", "null");
    } else if (c->n_eos == 1) {
        jw_int(w, "eos_token_id", c->eos_ids[0]);
    } else {
        jw_key(w, "eos_token_id");
        for (int i = 0; i < c->n_eos; i++)
            fprintf(w->f, "%s%d", i ? ", " : "[", c->eos_ids[i]);
        fputc(']', w->f);
    }
}

static void write_common(jwriter *w, const kv_config *c, const char *torch_dtype)
{
    jw_key(w, "architectures");
    fprintf(w->f, "[\"%s\"]", ARCHES[c->arch].architecture);
    jw_str(w, "model_type", c->model_type);
    jw_int(w, "hidden_size", c->hidden);
    jw_int(w, "intermediate_size", c->intermediate);
    jw_int(w, "num_hidden_layers", c->n_layers);
    jw_int(w, "num_attention_heads", c->n_heads);
    jw_int(w, "num_key_value_heads", c->n_kv_heads);
    jw_int(w, "head_dim", c->head_dim);
    jw_num(w, "rms_norm_eps", c->rms_eps);
    jw_num(w, "rope_theta", c->rope_theta);
    write_scaling(w, &c->rope_scaling);
    jw_int(w, "vocab_size", c->vocab);
    jw_int(w, "max_position_embeddings", c->max_positions);
    jw_bool(w, "tie_word_embeddings", c->tie_embeddings);
    write_tokens(w, c);
    jw_str(w, "torch_dtype", torch_dtype);
    jw_str(w, ARCHES[c->arch].act_key, c->act == ACT_SILU ? "silu" : "gelu_pytorch_tanh");
}

/* The pieces Gemma 3's and Gemma 4's configs share: the window (null
 * when no layer slides), each layer's type, and the softcaps of a model
 * without attention biases. */
static void jw_window(jwriter *w, const kv_config *c)
{
    if (c->sliding_window > 0)
        jw_int(w, "sliding_window", c->sliding_window);
    else
        jw_raw(w, "sliding_window", "null");
}

static void jw_layer_types(jwriter *w, const kv_config *c)
{
    jw_key(w, "layer_types");
    for (int i = 0; i < c->n_layers; i++)
        fprintf(w->f, "%s\n    \"%s\"", i ? "," : "[", type_name(c->layer_type[i]));
    fputs("\n  ]", w->f);
}

static void jw_softcaps_unbiased(jwriter *w, const kv_config *c)
{
    if (c->final_softcap > 0)
        jw_num(w, "final_logit_softcapping", c->final_softcap);
    else
        jw_raw(w, "final_logit_softcapping", "null");
    jw_raw(w, "attn_logit_softcapping", "null");
    jw_bool(w, "attention_bias", false);
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

static void write_gemma(jwriter *w, const kv_config *c)
{
    double q = c->query_pre_attn_scalar;
    if (q == floor(q) && q <= MAX_SCALAR)
        jw_int(w, "query_pre_attn_scalar", (long long)q);
    else
        jw_num(w, "query_pre_attn_scalar", q);
    jw_window(w, c);
    int p = regular_pattern(c);
    if (p > 0)
        jw_int(w, "sliding_window_pattern", p);
    jw_layer_types(w, c);
    jw_num(w, "rope_local_base_freq", c->rope_local_theta);
    jw_softcaps_unbiased(w, c);
    int shared = count_shared(c);
    if (shared > 0)
        jw_int(w, "num_kv_shared_layers", shared);
}

/* gemma4_text as transformers writes it: rope_parameters keyed by layer
 * type, the full layers' sizes beside the sliding ones'. */
static void write_gemma4(jwriter *w, const kv_config *c)
{
    char lt[40], gt[40], pf[40];
    jw_int(w, "global_head_dim", c->head_dim_full);
    jw_int(w, "num_global_key_value_heads", c->n_kv_heads_full);
    jw_window(w, c);
    jw_layer_types(w, c);
    fmt_double(lt, sizeof lt, c->rope_local_theta);
    fmt_double(gt, sizeof gt, c->rope_theta);
    fmt_double(pf, sizeof pf, c->rope_partial_full > 0 ? c->rope_partial_full : 1.0);
    jw_key(w, "rope_parameters");
    fprintf(w->f, "{\"sliding_attention\": {\"rope_type\": \"default\", \"rope_theta\": %s}, "
            "\"full_attention\": {\"rope_type\": \"proportional\", \"partial_rotary_factor\": "
            "%s, \"rope_theta\": %s}}", lt, pf, gt);
    jw_softcaps_unbiased(w, c);
    jw_bool(w, "attention_k_eq_v", c->k_eq_v);
    jw_int(w, "num_kv_shared_layers", count_shared(c));
    jw_bool(w, "use_double_wide_mlp", c->double_wide_mlp);
    jw_int(w, "hidden_size_per_layer_input", c->per_layer_dim);
    if (c->per_layer_dim > 0)
        jw_int(w, "vocab_size_per_layer_input", c->per_layer_vocab);
    jw_bool(w, "enable_moe_block", false);
}

static void write_config(FILE *f, const kv_config *c, const char *torch_dtype)
{
    jwriter w = { f, 0 };
    fputc('{', f);
    write_common(&w, c, torch_dtype);
    if (c->arch == ARCH_LLAMA) {
        jw_bool(&w, "attention_bias", c->qkv_bias);
        jw_bool(&w, "mlp_bias", false);
    } else if (c->arch == ARCH_QWEN2 || c->arch == ARCH_QWEN3) {
        if (c->arch == ARCH_QWEN3)
            jw_bool(&w, "attention_bias", c->qkv_bias);
        jw_bool(&w, "use_sliding_window", false);
        jw_raw(&w, "sliding_window", "null");
        jw_int(&w, "max_window_layers", c->n_layers);
    } else if (c->arch == ARCH_GEMMA4) {
        write_gemma4(&w, c);
    } else {
        write_gemma(&w, c);
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

#define NO_SCALING { ROPE_SCALE_NONE, 0, 0, 0, 0 }
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
      { ROPE_SCALE_LLAMA3, 32.0, 1.0, 4.0, 64 }, NO_G4 },
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
    set_family(c, p->arch);
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
        layers_from_pattern(c, p->pattern);
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
    char list[512] = "";
    for (int i = 0; name && out && i < N_PRESETS; i++) {
        if (strcmp(name, PRESETS[i].name) == 0) {
            build_preset(&PRESETS[i], out);
            return 0;
        }
    }
    for (int i = 0; i < N_PRESETS; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
                 PRESETS[i].name);
    return kv_errf(e, "unknown preset '%s' (presets: %s)", name ? name : "(null)", list);
}

const char *const *config_preset_names(void)
{
    static const char *const names[] = {
        "tiny-llama", "tiny-llama3", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3",
        "tiny-gemma3-kvshared", "tiny-gemma3-h288", "qwen2.5-0.5b-shape", "qwen3-0.6b-shape",
        "gemma3-1b-shape", "tiny-gemma4", "gemma4-e2b-shape", NULL,
    };
    _Static_assert(sizeof names / sizeof *names == N_PRESETS + 1,
                   "every preset is listed once");
    return names;
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
    if (c->rope_scaling.type != ROPE_SCALE_NONE)
        snprintf(extra, sizeof extra, " rope %s x%g",
                 c->rope_scaling.type == ROPE_SCALE_LINEAR ? "linear" : "llama3",
                 c->rope_scaling.factor);
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
