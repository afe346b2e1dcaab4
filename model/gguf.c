/* gguf.c — the GGUF writer behind `kvdiff gen --gguf`: metadata, tensor
 * layout and tokenizer section as llama.cpp's convert_hf_to_gguf.py writes
 * them (checked against llama.cpp v0.5.0's loader and graph builders; see
 * docs/gguf-export.md), streamed tensor by tensor to a temporary file
 * renamed into place when whole. */
#include "gguf.h"
#include "family.h"
#include "outfile.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels.h"
#include "model.h"
#include "safetensors.h"

/* ------------------------------------------------------------------ */
/* GGUF constants (ggml/include/gguf.h, ggml.h)                         */

#define GGUF_VERSION 3
#define GGUF_ALIGN 32

enum { GT_UINT32 = 4, GT_INT32 = 5, GT_FLOAT32 = 6, GT_BOOL = 7, GT_STRING = 8, GT_ARRAY = 9 };
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_BF16 = 30 };
/* llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_BF16 */
enum { FTYPE_F32 = 0, FTYPE_F16 = 1, FTYPE_BF16 = 32 };
/* llama_token_type */
enum { TOK_NORMAL = 1, TOK_CONTROL = 3, TOK_USER_DEFINED = 4, TOK_UNUSED = 5, TOK_BYTE = 6 };

int gguf_out_type_parse(const char *s, gguf_out_type *out, kv_err *e)
{
    if (s && !strcmp(s, "f32"))
        *out = GGUF_OUT_F32;
    else if (s && !strcmp(s, "f16"))
        *out = GGUF_OUT_F16;
    else if (s && !strcmp(s, "bf16"))
        *out = GGUF_OUT_BF16;
    else
        return kv_errf(e, "'%s' is not f32, f16 or bf16", s ? s : "(null)");
    return 0;
}

/* ------------------------------------------------------------------ */
/* A growable byte buffer for the header (metadata and tensor infos)    */

typedef struct {
    uint8_t *p;
    size_t n, cap;
    int oom;
} gbuf;

static void gb_put(gbuf *b, const void *data, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n)
            cap *= 2;
        uint8_t *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
}

/* GGUF is little-endian; so is every machine kvdiff builds on (x86-64,
 * aarch64), and safetensors already assumes it. */
static void gb_u32(gbuf *b, uint32_t v) { gb_put(b, &v, 4); }
static void gb_u64(gbuf *b, uint64_t v) { gb_put(b, &v, 8); }
static void gb_str(gbuf *b, const char *s)
{
    size_t n = strlen(s);
    gb_u64(b, n);
    gb_put(b, s, n);
}

typedef struct {
    gbuf kv;
    uint64_t n_kv;
    const char *arch;   /* prefix of architecture keys */
} kvs;

static void kv_key(kvs *k, const char *key, uint32_t type)
{
    gb_str(&k->kv, key);
    gb_u32(&k->kv, type);
    k->n_kv++;
}

/* "%s." arch prefix for keys written as ".context_length". */
static const char *akey(const kvs *k, const char *suffix, char *buf, size_t n)
{
    if (suffix[0] == '.')
        snprintf(buf, n, "%s%s", k->arch, suffix);
    else
        snprintf(buf, n, "%s", suffix);
    return buf;
}

static void kv_u32(kvs *k, const char *key, uint32_t v)
{
    char b[128];
    kv_key(k, akey(k, key, b, sizeof b), GT_UINT32);
    gb_u32(&k->kv, v);
}

static void kv_bool(kvs *k, const char *key, bool v)
{
    char b[128];
    const uint8_t byte = v ? 1 : 0;
    kv_key(k, akey(k, key, b, sizeof b), GT_BOOL);
    gb_put(&k->kv, &byte, 1);
}

static void kv_f32(kvs *k, const char *key, float v)
{
    char b[128];
    kv_key(k, akey(k, key, b, sizeof b), GT_FLOAT32);
    gb_put(&k->kv, &v, 4);
}

static void kv_str(kvs *k, const char *key, const char *v)
{
    char b[128];
    kv_key(k, akey(k, key, b, sizeof b), GT_STRING);
    gb_str(&k->kv, v);
}

/* An array of n numbers of GGUF type `type`, esize bytes each, as v holds
 * them (little-endian; bool is one byte). */
static void kv_num_arr(kvs *k, const char *key, uint32_t type, const void *v, size_t esize,
                       uint64_t n)
{
    char b[128];
    kv_key(k, akey(k, key, b, sizeof b), GT_ARRAY);
    gb_u32(&k->kv, type);
    gb_u64(&k->kv, n);
    gb_put(&k->kv, v, n * esize);
}

static void kv_str_arr(kvs *k, const char *key, char *const *v, uint64_t n)
{
    char b[128];
    kv_key(k, akey(k, key, b, sizeof b), GT_ARRAY);
    gb_u32(&k->kv, GT_STRING);
    gb_u64(&k->kv, n);
    for (uint64_t i = 0; i < n; i++)
        gb_str(&k->kv, v[i]);
}

/* ------------------------------------------------------------------ */
/* What llama.cpp can run                                               */

static const char *arch_name(kv_arch a)
{
    const kv_family *f = family_of(a);
    return f ? f->gguf_arch : "?";
}

/* llama.cpp's gemma4 (llama_model's layer reuse callback): a shared layer
 * reads layer n_kv - 2 if it slides, n_kv - 1 otherwise, n_kv the layers
 * computing K/V. Right when the last two of those are sliding then full,
 * as in every published Gemma 4; a model laid out otherwise it runs with
 * the wrong caches. Returns the first layer where that rule and the
 * config's differ, -1 when none. */
static int gemma4_llama_reuse_mismatch(const kv_config *c, int *llama_owner)
{
    int n_kv = 0;
    while (n_kv < c->n_layers && c->kv_owner[n_kv] == n_kv)
        n_kv++;
    for (int i = n_kv; i < c->n_layers; i++) {
        int o = n_kv - (c->layer_type[i] == ATTN_SLIDING ? 2 : 1);
        if (o != c->kv_owner[i]) {
            *llama_owner = o;
            return i;
        }
    }
    return -1;
}

static int gemma4_export_check(const kv_config *c, kv_err *e)
{
    int shared = 0, lo = -1;
    for (int i = 0; i < c->n_layers; i++)
        shared += c->kv_owner[i] != i;
    if (shared > 0 && c->n_layers - shared < 2)
        return kv_errf(e, "%d of %d layers share KV; llama.cpp's gemma4 needs at least two "
                       "layers computing K/V", shared, c->n_layers);
    int bad = shared > 0 ? gemma4_llama_reuse_mismatch(c, &lo) : -1;
    if (bad >= 0)
        return kv_errf(e, "layer %d reads layer %d's KV cache, but llama.cpp's gemma4 would "
                       "read layer %d (it takes the last two layers before the shared block "
                       "to be sliding then full), so it cannot run this model",
                       bad, c->kv_owner[bad], lo);
    if (c->rope_scaling.type != ROPE_SCALE_NONE)
        return kv_errf(e, "RoPE scaling on gemma4: llama.cpp's gemma4 carries only the "
                       "proportional RoPE of the full layers");
    if (c->per_layer_dim > 0 && c->per_layer_vocab != c->vocab)
        return kv_errf(e, "vocab_size_per_layer_input %d differs from vocab_size %d; "
                       "llama.cpp's gemma4 indexes the per-layer table by token",
                       c->per_layer_vocab, c->vocab);
    return 0;
}

int gguf_export_check(const kv_config *c, kv_err *e)
{
    const kv_family *fam = family_of(c->arch);
    if (!fam || !fam->gguf_arch)
        return kv_errf(e, "model_type '%s' has no GGUF export", c->model_type);
    if (fam->gguf_check && fam->gguf_check(c, e) < 0)
        return -1;
    if (c->arch == ARCH_GEMMA4)
        return gemma4_export_check(c, e);
    /* llama_model_qwen3::load_arch_tensors creates no attn_output.bias. */
    if (c->arch == ARCH_QWEN3 && (c->qkv_bias || c->o_bias))
        return kv_errf(e, "attention_bias on qwen3: llama.cpp's qwen3 loads no "
                       "attn_output.bias, so it cannot run this model");
    for (int i = 0; i < c->n_layers; i++) {
        if (c->kv_owner[i] != i)
            return kv_errf(e, "layer %d reads layer %d's KV cache; llama.cpp's %s "
                           "architecture has no KV-shared layers (only gemma3n, a different "
                           "model), so it cannot run this model",
                           i, c->kv_owner[i], arch_name(c->arch));
        if (!family_of(c->arch)->slides && c->layer_type[i] == ATTN_SLIDING)
            return kv_errf(e, "layer %d slides; llama.cpp's %s architecture has no "
                           "sliding-window layers", i, arch_name(c->arch));
    }
    if (c->arch == ARCH_QWEN2 && c->n_heads * c->head_dim != c->hidden)
        return kv_errf(e, "num_attention_heads x head_dim = %d differs from hidden_size %d; "
                       "llama.cpp's qwen2 loader requires them equal",
                       c->n_heads * c->head_dim, c->hidden);
    if (c->arch == ARCH_GEMMA3 && c->rope_scaling.type == ROPE_SCALE_LLAMA3)
        return kv_errf(e, "llama3 RoPE scaling on gemma3: llama.cpp's gemma3 has no "
                       "rope_freqs tensor to carry it");
    if (c->final_softcap != 0 && c->arch != ARCH_GEMMA3)
        return kv_errf(e, "final logit softcapping on %s: llama.cpp's %s does not apply it",
                       c->model_type, arch_name(c->arch));
    return 0;
}

/* llama.cpp's gemma3 multiplies q by this fixed scale (llama_model_gemma3::
 * load_arch_hparams: a 62-layer model is "27B" and uses hidden/heads). */
static double llama_gemma3_scale(const kv_config *c)
{
    float d = c->n_layers == 62 ? (float)(c->hidden / c->n_heads) : (float)c->head_dim;
    return 1.0f / sqrtf(d);
}

/* ------------------------------------------------------------------ */
/* The tensors to write                                                 */

typedef struct {
    char name[96];              /* GGUF name */
    const tensor_spec *spec;    /* source; NULL for rope_freqs */
    int stack_n, stack_stride;  /* > 0: stacked from stack_n catalogue entries, spec and
                                   every stack_stride-th after it (DeepSeek's experts) */
    int ndim;
    uint64_t ne[3];             /* ne[0] is the fastest-varying (columns) */
    int xform;                  /* experts (XF_*): how the stack is laid out for llama.cpp */
    uint32_t type;              /* ggml type */
    uint64_t nbytes, offset;
    int permute_heads;          /* > 0: Llama q/k row permutation over this many heads */
    float add, mul;             /* stored value = (w + add) * mul */
} out_tensor;

/* How a stack of experts (X, in, out) input-major, as transformers keeps
 * it, becomes llama.cpp's (conversion/gpt_oss.py): gate_up_proj split into
 * its even (gate) and odd (up) outputs, each expert turned to (out, in)
 * rows; down_proj turned likewise; the biases split or kept. */
enum { XF_NONE, XF_EVEN, XF_ODD, XF_TURN, XF_BIAS_EVEN, XF_BIAS_ODD, XF_K_B, XF_V_B };

/* "model.layers.3.self_attn.q_proj.weight" -> "self_attn.q_proj.weight" */
static const char *layer_suffix(const char *name)
{
    const char *p = strstr(name, "layers.");
    p = p ? strchr(p + 7, '.') : NULL;
    return p ? p + 1 : name;
}

static const char *gguf_layer_name(const kv_config *c, const char *sx)
{
    static const struct { const char *hf, *gg; } MAP[] = {
        {"input_layernorm.weight", "attn_norm.weight"},
        {"self_attn.q_proj.weight", "attn_q.weight"},
        {"self_attn.q_proj.bias", "attn_q.bias"},
        {"self_attn.k_proj.weight", "attn_k.weight"},
        {"self_attn.k_proj.bias", "attn_k.bias"},
        {"self_attn.v_proj.weight", "attn_v.weight"},
        {"self_attn.v_proj.bias", "attn_v.bias"},
        {"self_attn.o_proj.weight", "attn_output.weight"},
        {"self_attn.o_proj.bias", "attn_output.bias"},
        {"self_attn.q_norm.weight", "attn_q_norm.weight"},
        {"self_attn.k_norm.weight", "attn_k_norm.weight"},
        {"pre_feedforward_layernorm.weight", "ffn_norm.weight"},
        {"post_feedforward_layernorm.weight", "post_ffw_norm.weight"},
        {"mlp.gate_proj.weight", "ffn_gate.weight"},
        {"mlp.up_proj.weight", "ffn_up.weight"},
        {"mlp.down_proj.weight", "ffn_down.weight"},
        /* Gemma 4 */
        {"per_layer_input_gate.weight", "inp_gate.weight"},
        {"per_layer_projection.weight", "proj.weight"},
        {"post_per_layer_input_norm.weight", "post_norm.weight"},
        {"layer_scalar", "layer_output_scale.weight"},
    };
    const kv_family *f = family_of(c->arch);
    for (int i = 0; f && f->gguf_names && f->gguf_names[i][0]; i++)
        if (!strcmp(sx, f->gguf_names[i][0]))
            return f->gguf_names[i][1];
    /* Gemma's post_attention_layernorm normalizes the attention output
     * (sandwich); Llama's and Qwen2's is the FFN input norm. */
    if (!strcmp(sx, "post_attention_layernorm.weight"))
        return c->sandwich_norms ? "post_attention_norm.weight" : "ffn_norm.weight";
    for (size_t i = 0; i < sizeof MAP / sizeof *MAP; i++)
        if (!strcmp(sx, MAP[i].hf))
            return MAP[i].gg;
    return NULL;
}

/* Fills t from catalogue entry s. */
static int plan_tensor(const kv_config *c, const tensor_spec *s, int index,
                       gguf_out_type ot, out_tensor *t, kv_err *e)
{
    memset(t, 0, sizeof *t);
    t->spec = s;
    t->mul = 1.0f;
    if (s->layer >= 0) {
        const char *sx = layer_suffix(s->name);
        const char *g = gguf_layer_name(c, sx);
        if (!g)
            return kv_errf(e, "internal: no GGUF name for tensor '%s'", s->name);
        snprintf(t->name, sizeof t->name, "blk.%d.%s", s->layer, g);
        /* llama.cpp's llama architecture rotates adjacent pairs (RoPE type
         * NORM); HF rotates halves. LlamaModel.permute reorders rows, of
         * the q/k biases too (LlamaModel.modify_tensors). Qwen2/Qwen3 use
         * NEOX RoPE (halves) and are written as they are. */
        if (c->arch == ARCH_LLAMA && (!strcmp(sx, "self_attn.q_proj.weight") ||
                                      !strcmp(sx, "self_attn.q_proj.bias")))
            t->permute_heads = c->n_heads;
        if (c->arch == ARCH_LLAMA && (!strcmp(sx, "self_attn.k_proj.weight") ||
                                      !strcmp(sx, "self_attn.k_proj.bias")))
            t->permute_heads = c->n_kv_heads;
        if (c->arch == ARCH_GEMMA3 && !strcmp(sx, "self_attn.q_norm.weight"))
            t->mul = (float)(c->attn_scale / llama_gemma3_scale(c));
    } else if (s->kind == TENSOR_TABLE) {
        snprintf(t->name, sizeof t->name, "per_layer_token_embd.weight");
    } else if (strstr(s->name, "per_layer_model_projection.weight")) {
        snprintf(t->name, sizeof t->name, "per_layer_model_proj.weight");
    } else if (strstr(s->name, "per_layer_projection_norm.weight")) {
        snprintf(t->name, sizeof t->name, "per_layer_proj_norm.weight");
    } else if (s->kind == TENSOR_NORM) {
        snprintf(t->name, sizeof t->name, "output_norm.weight");
    } else {
        snprintf(t->name, sizeof t->name, index == 0 ? "token_embd.weight" : "output.weight");
    }
    /* Gemma3Model.norm_shift: Gemma3RMSNorm computes x * (1 + w). */
    if (c->norm_plus_one && s->kind == TENSOR_NORM)
        t->add = 1.0f;
    t->ndim = s->ndim;
    t->ne[0] = (uint64_t)(s->ndim == 2 ? s->shape[1] : s->shape[0]);
    t->ne[1] = s->ndim == 2 ? (uint64_t)s->shape[0] : 1;
    t->ne[2] = 1;
    /* The converter keeps 1-D tensors (norms, biases) in F32 whatever the
     * output type; so does this writer. */
    t->type = s->ndim == 1 || ot == GGUF_OUT_F32 ? GGML_F32
              : ot == GGUF_OUT_F16             ? GGML_F16
                                               : GGML_BF16;
    t->nbytes = t->ne[0] * t->ne[1] * (t->type == GGML_F32 ? 4 : 2);
    return 0;
}

/* Experts: gate_up_proj gives two tensors (its gate and its up), the
 * others one. Fills t[0] (and t[1] for gate_up); returns how many. */
static int plan_experts(const tensor_spec *s, gguf_out_type ot, out_tensor *t)
{
    const char *sx = layer_suffix(s->name);
    const uint64_t X = (uint64_t)s->shape[0];
    const bool gate_up = strstr(sx, "gate_up_proj") != NULL;
    const bool bias = s->kind == TENSOR_EXPERT_BIAS;
    const int n = gate_up ? 2 : 1;
    for (int i = 0; i < n; i++) {
        out_tensor *o = &t[i];
        memset(o, 0, sizeof *o);
        o->spec = s;
        o->mul = 1.0f;
        const char *g = gate_up ? (i == 0 ? "ffn_gate_exps" : "ffn_up_exps") : "ffn_down_exps";
        snprintf(o->name, sizeof o->name, "blk.%d.%s.%s", s->layer, g, bias ? "bias" : "weight");
        if (bias) {     /* (X, out): [out / n, X] */
            o->ndim = 2;
            o->ne[0] = (uint64_t)s->shape[1] / (uint64_t)n;
            o->ne[1] = X;
            o->ne[2] = 1;
            o->xform = gate_up ? (i == 0 ? XF_BIAS_EVEN : XF_BIAS_ODD) : XF_NONE;
            o->type = GGML_F32;
        } else {        /* (X, in, out): [in, out / n, X] */
            o->ndim = 3;
            o->ne[0] = (uint64_t)s->shape[1];
            o->ne[1] = (uint64_t)s->shape[2] / (uint64_t)n;
            o->ne[2] = X;
            o->xform = gate_up ? (i == 0 ? XF_EVEN : XF_ODD) : XF_TURN;
            o->type = ot == GGUF_OUT_F32 ? GGML_F32 : ot == GGUF_OUT_F16 ? GGML_F16 : GGML_BF16;
        }
        o->nbytes = o->ne[0] * o->ne[1] * o->ne[2] * (o->type == GGML_F32 ? 4 : 2);
    }
    return n;
}

/* Experts stored one catalogue entry per expert and projection
 * (TENSOR_EXPERT_PART: gate, up, down in turn; DeepSeek's layout): stacked
 * as the converter's merge_expert does,
 * [in, out, X] each. s is expert 0's gate_proj. Fills t[0..2]. */
static int plan_expert_parts(const kv_config *c, const tensor_spec *s, gguf_out_type ot,
                                 out_tensor *t)
{
    static const char *const names[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (int i = 0; i < 3; i++) {
        out_tensor *o = &t[i];
        memset(o, 0, sizeof *o);
        o->spec = s + i;
        o->stack_n = c->n_experts;
        o->stack_stride = 3;
        o->mul = 1.0f;
        snprintf(o->name, sizeof o->name, "blk.%d.%s.weight", s->layer, names[i]);
        o->ndim = 3;
        o->ne[0] = (uint64_t)s[i].shape[1];
        o->ne[1] = (uint64_t)s[i].shape[0];
        o->ne[2] = (uint64_t)c->n_experts;
        o->type = ot == GGUF_OUT_F32 ? GGML_F32 : ot == GGUF_OUT_F16 ? GGML_F16 : GGML_BF16;
        o->nbytes = o->ne[0] * o->ne[1] * o->ne[2] * (o->type == GGML_F32 ? 4 : 2);
    }
    return 3;
}

/* MLA's kv_b_proj split as the converter writes it for the absorbed form:
 * attn_k_b [nope, R, H] (each head's key part turned), attn_v_b [R, Dv, H]. */
static int plan_kv_b(const kv_config *c, const tensor_spec *s, gguf_out_type ot, out_tensor *t)
{
    const uint64_t R = (uint64_t)c->kv_lora_rank, H = (uint64_t)c->n_heads;
    const uint64_t nope = (uint64_t)(c->head_dim - c->qk_rope_dim), Dv = (uint64_t)c->v_head_dim;
    for (int i = 0; i < 2; i++) {
        out_tensor *o = &t[i];
        memset(o, 0, sizeof *o);
        o->spec = s;
        o->mul = 1.0f;
        o->xform = i == 0 ? XF_K_B : XF_V_B;
        snprintf(o->name, sizeof o->name, "blk.%d.%s.weight", s->layer,
                 i == 0 ? "attn_k_b" : "attn_v_b");
        o->ndim = 3;
        o->ne[0] = i == 0 ? nope : R;
        o->ne[1] = i == 0 ? R : Dv;
        o->ne[2] = H;
        o->type = ot == GGUF_OUT_F32 ? GGML_F32 : ot == GGUF_OUT_F16 ? GGML_F16 : GGML_BF16;
        o->nbytes = o->ne[0] * o->ne[1] * o->ne[2] * (o->type == GGML_F32 ? 4 : 2);
    }
    return 2;
}

/* ------------------------------------------------------------------ */
/* Where weights come from                                              */

typedef struct {
    const kv_config *cfg;
    uint64_t seed;
    st_file *st;          /* NULL: synthetic */
    const char *dir;
    const gguf_progress *progress;   /* may be NULL */
} wsource;

static int src_read(const wsource *src, const tensor_spec *s, float *out, kv_err *e)
{
    if (!src->st) {
        synth_tensor(src->cfg, s, src->seed, out);
        return 0;
    }
    const st_tensor *t = st_find(src->st, s->name);
    uint64_t n = (uint64_t)s->shape[0] * (uint64_t)(s->ndim >= 2 ? s->shape[1] : 1) *
                 (uint64_t)(s->ndim == 3 ? s->shape[2] : 1);
    if (!t)
        return kv_errf(e, "%s: tensor '%s' is missing (needed by config.json)", src->dir,
                       s->name);
    if (t->nelem != n || t->ndim != s->ndim || t->shape[0] != s->shape[0])
        return kv_errf(e, "%s: tensor '%s' has a shape config.json does not imply", t->file,
                       s->name);
    return st_read_f32(t, 0, n, out, e);
}

/* Rows [row0, row0 + nrows) of a 2-D tensor (src_read has checked the
 * whole tensor's shape before the first block). */
static int src_read_rows(const wsource *src, const tensor_spec *s, int64_t row0, int64_t nrows,
                         float *out, kv_err *e)
{
    if (!src->st) {
        synth_tensor_rows(src->cfg, s, src->seed, row0, nrows, out);
        return 0;
    }
    const st_tensor *t = st_find(src->st, s->name);
    const uint64_t cols = (uint64_t)s->shape[1];
    if (!t || t->nelem != (uint64_t)s->shape[0] * cols || t->ndim != 2 ||
        t->shape[0] != s->shape[0])
        return kv_errf(e, "%s: tensor '%s' is missing or has a shape config.json does not "
                       "imply", src->dir, s->name);
    return st_read_f32(t, (uint64_t)row0 * cols, (uint64_t)nrows * cols, out, e);
}

/* LlamaModel.permute: within each head, row t*(D/2)+j moves to 2*j+t. */
static void permute_rows(const float *in, float *out, int rows, int cols, int heads)
{
    int D = rows / heads, half = D / 2;
    for (int h = 0; h < heads; h++)
        for (int t = 0; t < 2; t++)
            for (int j = 0; j < half; j++)
                memcpy(out + (size_t)(h * D + 2 * j + t) * cols,
                       in + (size_t)(h * D + t * half + j) * cols, (size_t)cols * sizeof(float));
}

/* ------------------------------------------------------------------ */
/* Writing                                                              */

typedef struct {
    outfile out;      /* the temporary file and its target */
    int fd;           /* out's descriptor; -1 once handed back */
    const char *path;
    uint64_t written;
} gguf_outfile;

static int of_write(gguf_outfile *o, const void *p, size_t n, kv_err *e)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(o->fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return kv_errf(e, "%s: write failed: %s", o->path, strerror(errno));
        b += w;
        n -= (size_t)w;
        o->written += (uint64_t)w;
    }
    return 0;
}

static int of_pad(gguf_outfile *o, kv_err *e)
{
    static const uint8_t zeros[GGUF_ALIGN];
    size_t pad = (size_t)((GGUF_ALIGN - o->written % GGUF_ALIGN) % GGUF_ALIGN);
    return of_write(o, zeros, pad, e);
}

/* The output discipline (outfile.h): a fresh temporary file beside path,
 * renamed over it only if path is absent or a regular file that is none
 * of the run's inputs (the Hugging Face folder being exported). */
static int of_open(gguf_outfile *o, const char *path, kv_err *e)
{
    memset(o, 0, sizeof *o);
    o->fd = -1;
    o->path = path;
    return outfile_open_fd(&o->out, path, &o->fd, e);
}

static void of_abort(gguf_outfile *o)
{
    outfile_abort(&o->out);
    o->fd = -1;
}

static int of_finish(gguf_outfile *o, kv_err *e)
{
    o->fd = -1;
    return outfile_commit(&o->out, e);
}

/* Converts n floats into the tensor's type in dst. */
static void convert(const float *src, size_t n, uint32_t type, void *dst)
{
    if (type == GGML_F32) {
        memcpy(dst, src, n * 4);
        return;
    }
    uint16_t *h = dst;
    for (size_t i = 0; i < n; i++)
        h[i] = type == GGML_F16 ? st_f32_to_f16(src[i]) : st_f32_to_bf16(src[i]);
}

/* Elements converted at a time when a tensor is written by blocks of
 * rows (Gemma 4's per-layer table is 2.3G elements at E2B). */
#define WRITE_BLOCK (1u << 22)

/* A 2-D tensor written as is (no permutation), by blocks of rows. */
static int write_rows(gguf_outfile *o, const wsource *src, const out_tensor *t, kv_err *e)
{
    const int64_t rows = (int64_t)t->ne[1], cols = (int64_t)t->ne[0];
    const int64_t block = cols >= WRITE_BLOCK ? 1 : WRITE_BLOCK / cols;
    const size_t esz = t->type == GGML_F32 ? 4 : 2;
    float *buf = malloc((size_t)(block * cols) * sizeof(float));
    void *outb = t->type == GGML_F32 ? NULL : malloc((size_t)(block * cols) * esz);
    int rc = -1;
    if (!buf || (t->type != GGML_F32 && !outb)) {
        kv_errf(e, "out of memory writing '%s'", t->name);
        goto done;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t nr = rows - r0 < block ? rows - r0 : block;
        const size_t n = (size_t)(nr * cols);
        if (src_read_rows(src, t->spec, r0, nr, buf, e) < 0)
            goto done;
        if (t->add != 0.0f || t->mul != 1.0f)
            for (size_t i = 0; i < n; i++)
                buf[i] = (buf[i] + t->add) * t->mul;
        if (t->type != GGML_F32)
            convert(buf, n, t->type, outb);
        if (of_write(o, outb ? outb : (void *)buf, n * esz, e) < 0)
            goto done;
    }
    rc = of_pad(o, e);
done:
    free(buf);
    free(outb);
    return rc;
}

/* n floats of tensor t, converted to its type, written whole and padded. */
static int write_whole(gguf_outfile *o, const out_tensor *t, const float *buf, size_t n,
                       kv_err *e)
{
    void *outb = t->type == GGML_F32 ? NULL : malloc(n * 2);
    if (t->type != GGML_F32 && !outb)
        return kv_errf(e, "out of memory writing '%s'", t->name);
    if (outb)
        convert(buf, n, t->type, outb);
    int rc = of_write(o, outb ? outb : (const void *)buf, (size_t)t->nbytes, e) < 0 ||
             of_pad(o, e) < 0 ? -1 : 0;
    free(outb);
    return rc;
}

/* An experts' tensor: the stack read whole, laid out as t->xform says. */
static int write_experts(gguf_outfile *o, const wsource *src, const out_tensor *t, kv_err *e)
{
    const tensor_spec *s = t->spec;
    const size_t all = (size_t)s->shape[0] * (size_t)s->shape[1] *
                       (size_t)(s->ndim == 3 ? s->shape[2] : 1);
    const size_t n = (size_t)(t->ne[0] * t->ne[1] * t->ne[2]);
    float *in = malloc(all * sizeof *in), *buf = malloc(n * sizeof *buf);
    int rc = -1;
    if (!in || !buf) {
        kv_errf(e, "out of memory writing '%s'", t->name);
        goto done;
    }
    if (src_read(src, s, in, e) < 0)
        goto done;
    const size_t X = (size_t)s->shape[0];
    if (t->xform == XF_NONE || t->xform == XF_BIAS_EVEN || t->xform == XF_BIAS_ODD) {
        const size_t w = (size_t)s->shape[1], half = t->xform == XF_NONE ? 0 : 1;
        for (size_t x = 0; x < X; x++)
            for (size_t j = 0; j < (size_t)t->ne[0]; j++)
                buf[x * t->ne[0] + j] = half ? in[x * w + 2 * j + (t->xform == XF_BIAS_ODD)]
                                             : in[x * w + j];
    } else {
        /* (X, A in, B out) input-major -> per expert rows of A: out o, in a */
        const size_t A = (size_t)s->shape[1], B = (size_t)s->shape[2];
        const size_t rows = (size_t)t->ne[1];
        for (size_t x = 0; x < X; x++)
            for (size_t r = 0; r < rows; r++) {
                const size_t col = t->xform == XF_TURN ? r : 2 * r + (t->xform == XF_ODD);
                for (size_t a = 0; a < A; a++)
                    buf[(x * rows + r) * A + a] = in[(x * A + a) * B + col];
            }
    }
    rc = write_whole(o, t, buf, n, e);
done:
    free(in);
    free(buf);
    return rc;
}

/* A stack of DeepSeek experts (each entry's rows as they are, one after
 * the other), or MLA's kv_b_proj split into attn_k_b / attn_v_b. */
static int write_assembled(gguf_outfile *o, const wsource *src, const out_tensor *t, kv_err *e)
{
    const size_t n = (size_t)(t->ne[0] * t->ne[1] * t->ne[2]);
    const tensor_spec *s = t->spec;
    const size_t in_n = t->stack_n > 0 ? 0 : (size_t)(s->shape[0] * s->shape[1]);
    float *buf = malloc(n * sizeof *buf), *in = in_n ? malloc(in_n * sizeof *in) : NULL;
    int rc = -1;
    if (!buf || (in_n && !in)) {
        kv_errf(e, "out of memory writing '%s'", t->name);
        goto done;
    }
    if (t->stack_n > 0) {
        const size_t per = (size_t)(t->ne[0] * t->ne[1]);
        for (int x = 0; x < t->stack_n; x++)
            if (src_read(src, s + (size_t)x * t->stack_stride, buf + x * per, e) < 0)
                goto done;
    } else {
        const kv_config *c = src->cfg;
        const size_t R = (size_t)c->kv_lora_rank, H = (size_t)c->n_heads;
        const size_t nope = (size_t)(c->head_dim - c->qk_rope_dim), Dv = (size_t)c->v_head_dim;
        const size_t per = nope + Dv;
        if (src_read(src, s, in, e) < 0)
            goto done;
        for (size_t h = 0; h < H; h++) {
            const float *rows = in + h * per * R;
            if (t->xform == XF_K_B) {       /* (d, r, h) = kv_b[h per + d][r] */
                for (size_t r = 0; r < R; r++)
                    for (size_t d = 0; d < nope; d++)
                        buf[(h * R + r) * nope + d] = rows[d * R + r];
            } else {                        /* (r, j, h) = kv_b[h per + nope + j][r] */
                memcpy(buf + h * Dv * R, rows + nope * R, Dv * R * sizeof *buf);
            }
        }
    }
    rc = write_whole(o, t, buf, n, e);
done:
    free(buf);
    free(in);
    return rc;
}

static int write_tensor(gguf_outfile *o, const wsource *src, const out_tensor *t,
                        const float *rope_freqs, kv_err *e)
{
    if (t->spec && (t->spec->kind == TENSOR_EXPERTS || t->spec->kind == TENSOR_EXPERT_BIAS))
        return write_experts(o, src, t, e);
    if (t->stack_n > 0 || t->xform == XF_K_B || t->xform == XF_V_B)
        return write_assembled(o, src, t, e);
    if (t->spec && !t->permute_heads && t->ndim == 2)
        return write_rows(o, src, t, e);
    size_t n = (size_t)(t->ne[0] * t->ne[1]);
    float *buf = malloc(n * sizeof(float));
    float *tmp = t->permute_heads ? malloc(n * sizeof(float)) : NULL;
    int rc = -1;
    if (!buf || (t->permute_heads && !tmp)) {
        kv_errf(e, "out of memory writing '%s'", t->name);
        goto done;
    }
    if (!t->spec)
        memcpy(buf, rope_freqs, n * sizeof(float));
    else if (src_read(src, t->spec, buf, e) < 0)
        goto done;
    if (t->permute_heads) {
        /* A bias (1-D) is one value a row. */
        int rows = t->ndim == 1 ? (int)t->ne[0] : (int)t->ne[1];
        permute_rows(buf, tmp, rows, t->ndim == 1 ? 1 : (int)t->ne[0], t->permute_heads);
        float *sw = buf;
        buf = tmp;
        tmp = sw;
    }
    if (t->add != 0.0f || t->mul != 1.0f)
        for (size_t i = 0; i < n; i++)
            buf[i] = (buf[i] + t->add) * t->mul;
    rc = write_whole(o, t, buf, n, e);
done:
    free(buf);
    free(tmp);
    return rc;
}

/* ------------------------------------------------------------------ */
/* Metadata                                                             */

/* kv_gguf_out (model/family.h) over kvs: what a family's gguf_keys writes. */
static void out_u32(kv_gguf_out *g, const char *key, uint32_t v) { kv_u32(g->ctx, key, v); }
static void out_f32(kv_gguf_out *g, const char *key, float v) { kv_f32(g->ctx, key, v); }
static void out_flag(kv_gguf_out *g, const char *key, bool v) { kv_bool(g->ctx, key, v); }

static void out_u32s(kv_gguf_out *g, const char *key, const uint32_t *v, int n)
{
    kv_num_arr(g->ctx, key, GT_UINT32, v, 4, (uint64_t)n);
}

static void out_flags(kv_gguf_out *g, const char *key, const uint8_t *v, int n)
{
    kv_num_arr(g->ctx, key, GT_BOOL, v, 1, (uint64_t)n);
}

static void put_model_keys(kvs *k, const kv_config *c, gguf_out_type ot, const char *name,
                           float q_fold)
{
    const int D = c->arch == ARCH_GEMMA4 ? c->head_dim_full : c->head_dim;
    /* MLA as llama.cpp's deepseek2 runs it: one KV head of the latent and
     * the key tail (keys R + dr, values R), the expanded heads under _mla. */
    const bool mla = config_mla(c);
    kv_str(k, "general.architecture", k->arch);
    kv_str(k, "general.name", name);
    kv_u32(k, "general.file_type", ot == GGUF_OUT_F32 ? FTYPE_F32
                                   : ot == GGUF_OUT_F16 ? FTYPE_F16 : FTYPE_BF16);
    kv_u32(k, ".context_length", (uint32_t)c->max_positions);
    kv_u32(k, ".embedding_length", (uint32_t)c->hidden);
    kv_u32(k, ".block_count", (uint32_t)c->n_layers);
    if (!c->double_wide_mlp)
        kv_u32(k, ".feed_forward_length", (uint32_t)c->intermediate);
    kv_u32(k, ".attention.head_count", (uint32_t)c->n_heads);
    if (c->arch != ARCH_GEMMA4)
        kv_u32(k, ".attention.head_count_kv", mla ? 1u : (uint32_t)c->n_kv_heads);
    /* Gemma 4: the full layers' head; the sliding ones' under "_swa". */
    kv_u32(k, ".attention.key_length", (uint32_t)(mla ? config_mla_row(c) : D));
    kv_u32(k, ".attention.value_length", (uint32_t)(mla ? c->kv_lora_rank : D));
    kv_u32(k, ".rope.dimension_count", (uint32_t)(mla ? c->qk_rope_dim : D));
    kv_f32(k, ".attention.layer_norm_rms_epsilon", (float)c->rms_eps);
    kv_f32(k, ".rope.freq_base", (float)c->rope_theta);
    kv_u32(k, ".vocab_size", (uint32_t)c->vocab);
    if (c->rope_scaling.type == ROPE_SCALE_LINEAR) {
        kv_str(k, ".rope.scaling.type", "linear");
        kv_f32(k, ".rope.scaling.factor", (float)c->rope_scaling.factor);
    }
    /* YaRN as the converter writes it (TextModel.set_gguf_parameters);
     * llama.cpp derives the cos/sin factor 0.1 ln factor + 1 itself, and
     * always rounds the ramp's ends to whole dims (truncate true). */
    if (c->rope_scaling.type == ROPE_SCALE_YARN) {
        kv_str(k, ".rope.scaling.type", "yarn");
        kv_f32(k, ".rope.scaling.factor", (float)c->rope_scaling.factor);
        kv_u32(k, ".rope.scaling.original_context_length",
               (uint32_t)c->rope_scaling.original_max_position);
        kv_f32(k, ".rope.scaling.yarn_beta_fast", (float)c->rope_scaling.beta_fast);
        kv_f32(k, ".rope.scaling.yarn_beta_slow", (float)c->rope_scaling.beta_slow);
    }
    if (c->n_experts > 0) {
        kv_u32(k, ".expert_count", (uint32_t)c->n_experts);
        kv_u32(k, ".expert_used_count", (uint32_t)c->n_experts_used);
        kv_u32(k, ".expert_feed_forward_length",
               (uint32_t)(c->moe_intermediate > 0 ? c->moe_intermediate : c->intermediate));
    }
    const kv_family *fam = family_of(c->arch);
    if (fam && fam->gguf_keys) {
        kv_gguf_out out = {k, out_u32, out_f32, out_flag, out_u32s, out_flags};
        fam->gguf_keys(&out, c);
    }
    if (c->arch == ARCH_GEMMA3) {
        int any_sliding = 0;
        uint8_t pattern[KV_MAX_LAYERS];
        for (int i = 0; i < c->n_layers; i++) {
            pattern[i] = c->layer_type[i] == ATTN_SLIDING;
            any_sliding |= pattern[i];
        }
        if (any_sliding) {
            kv_u32(k, ".attention.sliding_window", (uint32_t)c->sliding_window);
            /* Per layer, so any layer_types list survives (llama.cpp's
             * load_swa_pattern reads a bool array before the period). */
            kv_num_arr(k, ".attention.sliding_window_pattern", GT_BOOL, pattern, 1,
                   (uint64_t)c->n_layers);
            kv_f32(k, ".rope.freq_base_swa", (float)c->rope_local_theta);
        }
        if (c->final_softcap != 0)
            kv_f32(k, ".final_logit_softcapping", (float)c->final_softcap);
        /* Not read by llama.cpp: lets a recorder map q back to kvdiff's. */
        kv_f32(k, "kvdiff.q_scale_folded", q_fold);
        kv_f32(k, "kvdiff.query_pre_attn_scalar", (float)c->query_pre_attn_scalar);
    }
}

/* ------------------------------------------------------------------ */
/* Tokenizer section                                                    */

typedef struct {
    char **tokens;      /* (n) owned strings */
    int32_t *types;     /* (n) */
    char **merges;      /* (n_merges) owned strings */
    int n, n_merges;
    int bpe;            /* 0: "none" */
} vocab_out;

static void vocab_free(vocab_out *v)
{
    for (int i = 0; v->tokens && i < v->n; i++)
        free(v->tokens[i]);
    for (int i = 0; v->merges && i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->tokens);
    free(v->types);
    free(v->merges);
    memset(v, 0, sizeof *v);
}

static int is_byte_token(const char *s)
{
    return strlen(s) == 6 && !strncmp(s, "<0x", 3) && s[5] == '>';
}

static int cmp_strp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Added tokens past the model's vocab_size: the converter leaves them out
 * (_create_vocab_sentencepiece: "ignore token N: id is out of range"), as
 * the model has no embedding row for them; Gemma 3's <image_soft_token>,
 * id 262144 of a 262144-row table, is one. note (may be NULL) says so. */
static void note_added_past(const char *path, size_t n_past, json_int_t first_id,
                            const char *first, int vocab_size, char *note, size_t note_n)
{
    if (!note || note_n == 0 || n_past == 0)
        return;
    snprintf(note, note_n, "%s: %zu added token%s past vocab_size %d (%s'%.40s', id %lld) "
             "left out, as llama.cpp's converter does: the model has no embedding for %s",
             path, n_past, n_past > 1 ? "s" : "", vocab_size, n_past > 1 ? "the first " : "",
             first, (long long)first_id, n_past > 1 ? "them" : "it");
}

/* Reads <dir>/tokenizer.json's BPE vocabulary into v (vocab_size ids;
 * ids it lacks become "[PADn]" unused tokens, as the converter writes;
 * added tokens past vocab_size are left out, said in note). A folder
 * without tokenizer.json gives v->bpe = 0. */
static int vocab_from_dir(const char *dir, int vocab_size, vocab_out *v, char *note,
                          size_t note_n, kv_err *e)
{
    char path[4096];
    memset(v, 0, sizeof *v);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    if (access(path, F_OK) != 0)
        return 0;
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root)
        return kv_errf(e, "%s: line %d: %s", path, je.line, je.text);
    int rc = -1;
    json_t *model = json_object_get(root, "model");
    const char *type = json_string_value(json_object_get(model, "type"));
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    json_t *added = json_object_get(root, "added_tokens");
    if (!type || strcmp(type, "BPE") || !json_is_object(vocab)) {
        kv_errf(e, "%s: model type '%s' is not exported (kvdiff writes BPE vocabularies "
                "as llama.cpp's gpt2 tokenizer)", path, type ? type : "(none)");
        goto done;
    }
    int byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    v->n = vocab_size;
    v->tokens = calloc((size_t)vocab_size, sizeof *v->tokens);
    v->types = calloc((size_t)vocab_size, sizeof *v->types);
    if (!v->tokens || !v->types) {
        kv_errf(e, "out of memory reading %s", path);
        goto done;
    }
    const char *tok;
    json_t *idv;
    json_object_foreach(vocab, tok, idv) {
        json_int_t id = json_integer_value(idv);
        if (!json_is_integer(idv) || id < 0 || id >= vocab_size) {
            kv_errf(e, "%s: token '%.40s' has id %lld, outside vocab_size %d", path, tok,
                    (long long)id, vocab_size);
            goto done;
        }
        free(v->tokens[id]);
        v->tokens[id] = strdup(tok);
        v->types[id] = byte_fallback && is_byte_token(tok) ? TOK_BYTE : TOK_NORMAL;
    }
    size_t i, n_past = 0;
    json_int_t past_id = 0;
    const char *past = NULL;   /* the first added token past vocab_size */
    json_t *a;
    json_array_foreach(added, i, a) {
        json_t *id_json = json_object_get(a, "id");
        json_int_t id = json_integer_value(id_json);
        const char *content = json_string_value(json_object_get(a, "content"));
        if (!content || !json_is_integer(id_json) || id < 0) {
            kv_errf(e, "%s: added_tokens[%zu] has no content or no id from 0 up", path, i);
            goto done;
        }
        if (id >= vocab_size) {
            if (n_past++ == 0) {
                past = content;
                past_id = id;
            }
            continue;
        }
        free(v->tokens[id]);
        v->tokens[id] = strdup(content);
        v->types[id] = json_is_true(json_object_get(a, "special")) ? TOK_CONTROL
                                                                   : TOK_USER_DEFINED;
    }
    for (int id = 0; id < vocab_size; id++) {
        if (!v->tokens[id]) {
            char pad[32];
            snprintf(pad, sizeof pad, "[PAD%d]", id);
            v->tokens[id] = strdup(pad);
            v->types[id] = TOK_UNUSED;
        }
        if (!v->tokens[id]) {
            kv_errf(e, "out of memory reading %s", path);
            goto done;
        }
    }
    /* llama.cpp asserts every token string is distinct (one id each). */
    char **sorted = malloc((size_t)vocab_size * sizeof *sorted);
    if (!sorted) {
        kv_errf(e, "out of memory reading %s", path);
        goto done;
    }
    memcpy(sorted, v->tokens, (size_t)vocab_size * sizeof *sorted);
    qsort(sorted, (size_t)vocab_size, sizeof *sorted, cmp_strp);
    for (int id = 1; id < vocab_size; id++)
        if (!strcmp(sorted[id - 1], sorted[id])) {
            kv_errf(e, "%s: token '%.40s' appears under two ids; llama.cpp needs each "
                    "token once", path, sorted[id]);
            free(sorted);
            goto done;
        }
    free(sorted);
    v->n_merges = (int)json_array_size(merges);
    v->merges = calloc((size_t)v->n_merges + 1, sizeof *v->merges);
    if (!v->merges) {
        kv_errf(e, "out of memory reading %s", path);
        goto done;
    }
    json_array_foreach(merges, i, a) {
        /* Either "a b" or ["a", "b"] (tokenizers >= 0.20). */
        const char *s = json_string_value(a);
        const char *l = json_string_value(json_array_get(a, 0));
        const char *r = json_string_value(json_array_get(a, 1));
        if (s) {
            v->merges[i] = strdup(s);
        } else if (l && r) {
            size_t n = strlen(l) + strlen(r) + 2;
            v->merges[i] = malloc(n);
            if (v->merges[i])
                snprintf(v->merges[i], n, "%s %s", l, r);
        } else {
            kv_errf(e, "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", path, i);
            goto done;
        }
        if (!v->merges[i]) {
            kv_errf(e, "out of memory reading %s", path);
            goto done;
        }
    }
    v->bpe = 1;
    note_added_past(path, n_past, past_id, past, vocab_size, note, note_n);
    rc = 0;
done:
    json_decref(root);
    if (rc < 0)
        vocab_free(v);
    return rc;
}

static void put_vocab_keys(kvs *k, const kv_config *c, const vocab_out *v)
{
    if (!v->bpe) {
        /* llama.cpp's "none" vocabulary: vocab_size ids without text
         * (llama_vocab::impl::load adds that many dummy tokens). */
        kv_str(k, "tokenizer.ggml.model", "none");
        return;
    }
    kv_str(k, "tokenizer.ggml.model", "gpt2");
    kv_str(k, "tokenizer.ggml.pre", "default");
    kv_str_arr(k, "tokenizer.ggml.tokens", v->tokens, (uint64_t)v->n);
    kv_num_arr(k, "tokenizer.ggml.token_type", GT_INT32, v->types, 4, (uint64_t)v->n);
    kv_str_arr(k, "tokenizer.ggml.merges", v->merges, (uint64_t)v->n_merges);
    if (c->bos_id >= 0 && c->bos_id < c->vocab)
        kv_u32(k, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos_id);
    if (c->n_eos > 0 && c->eos_ids[0] >= 0 && c->eos_ids[0] < c->vocab)
        kv_u32(k, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos_ids[0]);
}

/* ------------------------------------------------------------------ */
/* The export                                                           */

/* rope_freqs for llama3 scaling: llama.cpp divides each inverse frequency
 * by its factor, so the factor is kvdiff's unscaled / scaled frequency. */
static float *llama3_factors(const kv_config *c)
{
    int half = c->head_dim / 2;
    double *f = malloc((size_t)half * sizeof *f);
    float *out = malloc((size_t)half * sizeof *out);
    if (!f || !out) {
        free(f);
        free(out);
        return NULL;
    }
    for (int d = 0; d < half; d++)
        f[d] = pow(c->rope_theta, -2.0 * d / c->head_dim);
    kern_rope_scale_inv_freq(f, half, 2, c->rope_scaling.factor,
                             c->rope_scaling.low_freq_factor, c->rope_scaling.high_freq_factor,
                             c->rope_scaling.original_max_position);
    for (int d = 0; d < half; d++)
        out[d] = (float)(pow(c->rope_theta, -2.0 * d / c->head_dim) / f[d]);
    free(f);
    return out;
}

/* Gemma 4's full layers (Gemma4Model.generate_extra_tensors): factor 1
 * on the rotated pairs, 1e30 on the rest, which llama.cpp divides the
 * frequency by (angle 0: passed through). Required by llama.cpp even when
 * every pair rotates. */
static float *gemma4_factors(const kv_config *c)
{
    const int half = c->head_dim_full / 2;
    int rot = half;
    for (int l = 0; l < c->n_layers; l++)
        if (c->layer_type[l] == ATTN_GLOBAL)
            rot = config_layer_rope_pairs(c, l);
    float *out = malloc((size_t)(half > 0 ? half : 1) * sizeof *out);
    for (int d = 0; out && d < half; d++)
        out[d] = d < rot ? 1.0f : 1e30f;
    return out;
}

static int export_model(const wsource *src, const vocab_out *v, gguf_out_type ot,
                        const char *name, const char *path, kv_err *e)
{
    const kv_config *c = src->cfg;
    if (gguf_export_check(c, e) < 0)
        return -1;
    int n_specs = tensors_list(c, NULL, 0);
    tensor_spec *specs = calloc((size_t)n_specs, sizeof *specs);
    out_tensor *ts = calloc(2 * (size_t)n_specs + 1, sizeof *ts);
    float *rope_freqs = NULL;
    kvs k = {.arch = arch_name(c->arch)};
    gbuf info = {0};
    gguf_outfile o = {.fd = -1};
    int n = 0, rc = -1;
    if (!specs || !ts) {
        kv_errf(e, "out of memory");
        goto done;
    }
    tensors_list(c, specs, n_specs);
    if (c->rope_scaling.type == ROPE_SCALE_LLAMA3 || c->arch == ARCH_GEMMA4) {
        rope_freqs = c->arch == ARCH_GEMMA4 ? gemma4_factors(c) : llama3_factors(c);
        if (!rope_freqs) {
            kv_errf(e, "out of memory");
            goto done;
        }
        out_tensor *t = &ts[n++];
        snprintf(t->name, sizeof t->name, "rope_freqs.weight");
        t->ndim = 1;
        t->ne[0] = (uint64_t)(c->arch == ARCH_GEMMA4 ? c->head_dim_full : c->head_dim) / 2;
        t->ne[1] = 1;
        t->ne[2] = 1;
        t->type = GGML_F32;
        t->nbytes = t->ne[0] * 4;
        t->mul = 1.0f;
    }
    for (int i = 0; i < n_specs; i++) {
        const tensor_spec *s = &specs[i];
        if (s->kind == TENSOR_EXPERTS || s->kind == TENSOR_EXPERT_BIAS)
            n += plan_experts(s, ot, &ts[n]);
        else if (s->kind == TENSOR_EXPERT_PART)
            n += strstr(s->name, ".experts.0.gate_proj.") ? plan_expert_parts(c, s, ot, &ts[n])
                                                         : 0;
        else if (s->layer >= 0 && !strcmp(layer_suffix(s->name), "self_attn.kv_b_proj.weight"))
            n += plan_kv_b(c, s, ot, &ts[n]);
        else if (plan_tensor(c, s, i, ot, &ts[n++], e) < 0)
            goto done;
    }
    float q_fold = c->arch == ARCH_GEMMA3 ? (float)(c->attn_scale / llama_gemma3_scale(c)) : 1.0f;
    put_model_keys(&k, c, ot, name, q_fold);
    put_vocab_keys(&k, c, v);
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        ts[i].offset = off;
        off += (ts[i].nbytes + GGUF_ALIGN - 1) / GGUF_ALIGN * GGUF_ALIGN;
        gb_str(&info, ts[i].name);
        gb_u32(&info, (uint32_t)ts[i].ndim);
        for (int d = 0; d < ts[i].ndim; d++)
            gb_u64(&info, ts[i].ne[d]);
        gb_u32(&info, ts[i].type);
        gb_u64(&info, ts[i].offset);
    }
    if (k.kv.oom || info.oom) {
        kv_errf(e, "out of memory");
        goto done;
    }
    if (of_open(&o, path, e) < 0)
        goto done;
    uint8_t head[24];
    uint32_t magic_ver[2] = {0x46554747u /* "GGUF" */, GGUF_VERSION};
    uint64_t counts[2] = {(uint64_t)n, k.n_kv};
    memcpy(head, magic_ver, 8);
    memcpy(head + 8, counts, 16);
    if (of_write(&o, head, sizeof head, e) < 0 || of_write(&o, k.kv.p, k.kv.n, e) < 0 ||
        of_write(&o, info.p, info.n, e) < 0 || of_pad(&o, e) < 0)
        goto done;
    int64_t total = 0, done_w = 0;
    for (int i = 0; i < n; i++)
        total += (int64_t)(ts[i].ne[0] * ts[i].ne[1] * ts[i].ne[2]);
    for (int i = 0; i < n; i++) {
        if (write_tensor(&o, src, &ts[i], rope_freqs, e) < 0)
            goto done;
        done_w += (int64_t)(ts[i].ne[0] * ts[i].ne[1] * ts[i].ne[2]);
        if (src->progress && src->progress->fn)
            src->progress->fn(src->progress->ctx, done_w, total, ts[i].name);
    }
    rc = of_finish(&o, e);
done:
    if (rc < 0)
        of_abort(&o);
    free(k.kv.p);
    free(info.p);
    free(rope_freqs);
    free(specs);
    free(ts);
    return rc;
}

int gguf_export_preset(const char *preset, uint64_t seed, gguf_out_type t, const char *path,
                       kv_err *e)
{
    return gguf_export_preset_progress(preset, seed, t, path, NULL, e);
}

int gguf_export_preset_progress(const char *preset, uint64_t seed, gguf_out_type t,
                                const char *path, const gguf_progress *p, kv_err *e)
{
    kv_config c;
    char name[128];
    if (config_preset(preset, &c, e) < 0)
        return -1;
    snprintf(name, sizeof name, "kvdiff %s seed %llu", preset, (unsigned long long)seed);
    wsource src = {.cfg = &c, .seed = seed, .st = NULL, .dir = preset, .progress = p};
    vocab_out v = {0};
    return export_model(&src, &v, t, name, path, e);
}

/* Same inode as path? (an output that would replace one of the inputs) */
static int same_file(const struct stat *out, const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && sb.st_dev == out->st_dev && sb.st_ino == out->st_ino;
}


/* ------------------------------------------------------------------ */
/* The checkpoint's own type                                            */

const char *gguf_out_type_name(gguf_out_type t)
{
    return t == GGUF_OUT_F32 ? "f32" : t == GGUF_OUT_F16 ? "f16" : "bf16";
}

/* Counts, over the matrices the export writes (the only tensors it
 * writes in 16 bits), the folder's tensors of each dtype. Tensors the
 * folder lacks are not counted: the export names them. */
static void count_matrix_dtypes(const kv_config *c, const st_file *st,
                                size_t counts[ST_DTYPE_COUNT])
{
    int n = tensors_list(c, NULL, 0);
    tensor_spec *specs = calloc((size_t)(n > 0 ? n : 1), sizeof *specs);
    memset(counts, 0, ST_DTYPE_COUNT * sizeof *counts);
    if (!specs)
        return;
    tensors_list(c, specs, n);
    for (int i = 0; i < n; i++) {
        const st_tensor *t = specs[i].ndim == 2 ? st_find(st, specs[i].name) : NULL;
        if (t)
            counts[t->dtype]++;
    }
    free(specs);
}

/* One dtype among F32, F16, BF16 holding every counted matrix: that
 * type. Several: f32, the one type holding bf16 and f16 values alike
 * exactly (bf16 lacks f16's mantissa, f16 lacks bf16's range); note says
 * so. */
static gguf_out_type pick_out_type(const char *dir, const size_t counts[ST_DTYPE_COUNT],
                                   char *note, size_t note_n)
{
    static const st_dtype floats[] = {ST_F32, ST_F16, ST_BF16};
    static const gguf_out_type as[] = {GGUF_OUT_F32, GGUF_OUT_F16, GGUF_OUT_BF16};
    size_t kinds = 0, total = 0;
    gguf_out_type only = GGUF_OUT_F32;
    char mix[160] = "";
    for (int d = 0; d < ST_DTYPE_COUNT; d++) {
        if (!counts[d])
            continue;
        kinds++;
        total += counts[d];
        snprintf(mix + strlen(mix), sizeof mix - strlen(mix), "%s%zu %s", kinds > 1 ? ", " : "",
                 counts[d], st_dtype_name((st_dtype)d));
    }
    for (size_t i = 0; i < sizeof floats / sizeof *floats; i++)
        if (counts[floats[i]] == total && total > 0)
            only = as[i];
    if (kinds > 1 && note && note_n)
        snprintf(note, note_n, "%s: its matrices are of several types (%s): writing f32, the "
                 "one type that holds every one of them exactly (--dtype bf16 or f16 to round "
                 "them instead)", dir, mix);
    return kinds == 1 ? only : GGUF_OUT_F32;
}

int gguf_dir_out_type(const char *dir, gguf_out_type *out, char *note, size_t note_n,
                      kv_err *e)
{
    kv_config c;
    char cfg_path[4096];
    size_t counts[ST_DTYPE_COUNT];
    if (note_n)
        note[0] = '\0';
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    if (config_load_json(cfg_path, &c, e) < 0)
        return -1;
    st_file *st = st_open_dir(dir, e);
    if (!st)
        return -1;
    model_resolve_prefix(&c, st);
    count_matrix_dtypes(&c, st, counts);
    st_close(st);
    *out = pick_out_type(dir, counts, note, note_n);
    return 0;
}

/* ------------------------------------------------------------------ */
/* A Hugging Face folder                                                */

int gguf_export_dir(const char *dir, gguf_out_type t, const char *path, kv_err *e)
{
    return gguf_export_dir_progress(dir, t, path, NULL, NULL, 0, e);
}

int gguf_export_dir_progress(const char *dir, gguf_out_type t, const char *path,
                             const gguf_progress *p, char *note, size_t note_n, kv_err *e)
{
    kv_config c;
    char cfg_path[4096], tok_path[4096];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    snprintf(tok_path, sizeof tok_path, "%s/tokenizer.json", dir);
    if (config_load_json(cfg_path, &c, e) < 0)
        return -1;
    if (gguf_export_check(&c, e) < 0)
        return kv_err_prefix(e, dir);
    st_file *st = st_open_dir(dir, e);
    if (!st)
        return -1;
    int rc = -1;
    vocab_out v = {0};
    struct stat out_sb;
    if (stat(path, &out_sb) == 0) {
        int clash = same_file(&out_sb, cfg_path) || same_file(&out_sb, tok_path);
        for (size_t i = 0; !clash && i < st_count(st); i++)
            clash = same_file(&out_sb, st_at(st, i)->file);
        if (clash) {
            kv_errf(e, "%s: is one of the input files of %s; choose another output", path, dir);
            goto done;
        }
    }
    model_resolve_prefix(&c, st);
    if (note_n)
        note[0] = '\0';
    if (vocab_from_dir(dir, c.vocab, &v, note, note_n, e) < 0)
        goto done;
    wsource src = {.cfg = &c, .seed = 0, .st = st, .dir = dir, .progress = p};
    rc = export_model(&src, &v, t, dir, path, e);
done:
    vocab_free(&v);
    st_close(st);
    return rc;
}
