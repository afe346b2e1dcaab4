/* kvdiff-llama.c — records a llama.cpp run of a GGUF model into a kvdiff
 * dump (docs/dump-format.md), through llama.cpp's public API only.
 *
 * llama.cpp names the tensors of its compute graph ("Qcur-3", "l_out-3");
 * its eval callback (cb_eval) hands each named node to us once computed.
 * We map the names onto kvdiff's stages (docs/recorders.md), put the rows
 * at absolute positions (ubatches and decode steps run in position order,
 * so a running count per stage dataset is the position), convert them to
 * our layouts and emit them to kvdiff's own dump writer, which hashes,
 * indexes and marks the file partial until the run ends.
 *
 * Exit status: 0 recorded, 2 bad input or error (one line on stderr). */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <hdf5.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <ggml-backend.h>
#include <ggml.h>
#include <gguf.h>
#include <llama.h>

#include "dump/dump.h"
#include "model/config.h"
#include "model/family.h"
#include "model/infile.h"
#include "model/kernels.h"
#include "model/outfile.h"
#include "model/tokens.h"
#include "llama_version.h"

#define TOOL "kvdiff-llama"

/* ------------------------------------------------------------------ */
/* Options                                                              */

typedef struct {
    const char *gguf, *hf_dir, *out;
    const char *prompt_tokens, *prompt_file, *prompt_from;
    int max_new, ubatch, batch, threads, ctx;
    int flash_attn;                /* 0 off, 1 on */
    enum ggml_type cache_type;
    const char *cache_name;
    bool ignore_eos, full_logits, list_tensors, verbose, no_record, timing;
    const char *stages;
    const char *fault;             /* --fault SPEC (a test aid), NULL none */
} rec_opts;

static void usage(FILE *f)
{
    fprintf(f,
        "usage: " TOOL " MODEL.gguf (--prompt-tokens L | --prompt-ids-file F | --prompt-from DUMP)\n"
        "                    --dump FILE [options]\n"
        "\n"
        "Runs the prompt through llama.cpp, then greedy-decodes --max-new tokens, and\n"
        "records every stage llama.cpp exposes to a kvdiff dump (docs/recorders.md).\n"
        "\n"
        "prompt (one of):\n"
        "  --prompt-tokens L  ids, e.g. 5,17,42\n"
        "  --prompt-ids-file F  file of ids separated by spaces, commas or newlines\n"
        "  --prompt-from D    the prompt of a kvdiff dump (its first prompt_length tokens)\n"
        "generation:\n"
        "  --max-new N        tokens to generate, greedy (default 16)\n"
        "  --ignore-eos       do not stop at an end-of-generation token\n"
        "llama.cpp settings:\n"
        "  --ubatch N         physical batch (tokens per forward step; default 512)\n"
        "  --batch N          logical batch (tokens per llama_decode; default 2048)\n"
        "  --flash-attn on|off  (default off)\n"
        "  --cache-type T     KV cache type f32, f16 (default), bf16, q8_0\n"
        "                     or q4_0 (quantized types need --flash-attn on)\n"
        "  --threads N        (default: the cores online, at most 4)\n"
        "  --ctx N            context size (default prompt + max-new)\n"
        "model:\n"
        "  --hf DIR           take model_config from DIR/config.json (checked against\n"
        "                     the GGUF); Gemma 3 needs it when query_pre_attn_scalar\n"
        "                     is not head_dim (the GGUF folds the difference into q)\n"
        "recording:\n"
        "  --dump FILE        the dump to write (-o FILE too)\n"
        "  --dump-stages L    comma list of stages (default: all llama.cpp exposes)\n"
        "  --dump-logits      also store full logits\n"
        "  --list-tensors     print each graph tensor name of the first step and exit\n"
        "  --no-record        run without the eval callback and write nothing (a baseline)\n"
        "  --time             print the seconds the prompt and decoding took on stdout\n"
        "  --verbose          llama.cpp's log on stderr\n"
        "test aids (plant a cache bug inside llama.cpp; recorded in engine_settings):\n"
        "  --fault isolate-ubatch  each ubatch and decode step sees only its own keys\n"
        "  --fault drop-key=P      position P leaves the cache once its ubatch ran\n"
        "  --fault decode-blind    decode steps do not see the prompt's keys\n"
        "  --fault dup-key=P       the prompt's key P is in the cache twice when decoding\n"
        "  --fault rope-offset=K   every token runs at its position + K (RoPE rotated K too far)\n"
        "  --fault ggml-abort      ggml aborts in the first decode step (a failed GGML_ASSERT,\n"
        "                          as on a GGUF llama.cpp cannot compute with)\n"
        "  MLA (deepseek2), changed in the graph as it runs:\n"
        "  --fault mla-rope-twice  the key tail (k_pe) rotated once more before it is cached\n"
        "  --fault mla-rope-uncached  cached rows keep no key tail once their ubatch ran\n"
        "  --fault mla-mixed-forms    the first decode step finds the prompt's latent rows\n"
        "                          never written (zero), as if prefill ran the expanded form\n"
        "                          (f32, f16 or bf16 caches for these two)\n"
        "  attention sinks (gpt-oss), in the graph as it runs:\n"
        "  --fault sink-dropped    no sink in any softmax\n"
        "  --fault sink-prefill-only  decode steps' softmax leaves the sink out\n"
        "  --fault sink-windowed   a sliding layer's sink is masked with key 0 once the\n"
        "                          window leaves it (the sink applied after the mask;\n"
        "                          needs --ubatch 1)\n");
}

static int parse_int(const char *s, const char *opt, int lo, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > 1 << 30) {
        fprintf(stderr, TOOL ": %s: '%s' is not an integer from %d to %d\n", opt, s, lo,
                1 << 30);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The dump must not overwrite what the run reads. */
static int output_not_input(const rec_opts *o)
{
    char cfg[4096] = "";
    if (o->hf_dir)
        snprintf(cfg, sizeof cfg, "%s/config.json", o->hf_dir);
    const struct { const char *opt, *path; } in[] = {
        {"the model", o->gguf}, {"--prompt-ids-file", o->prompt_file},
        {"--prompt-from", o->prompt_from}, {"--hf", cfg[0] ? cfg : NULL}};
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        if (in[i].path && outfile_same(o->out, in[i].path)) {
            fprintf(stderr, TOOL ": --dump %s: is the same file as %s %s; refusing to "
                            "overwrite it\n", o->out, in[i].opt, in[i].path);
            return -1;
        }
    return 0;
}

static int parse_args(int argc, char **argv, rec_opts *o)
{
    memset(o, 0, sizeof *o);
    o->max_new = 16;
    o->ubatch = 512;
    o->batch = 2048;
    /* More threads than cores makes llama.cpp's spinning workers wait on
     * each other: 100x slower on two cores. */
    const long online = sysconf(_SC_NPROCESSORS_ONLN);
    o->threads = online < 1 ? 1 : online > 4 ? 4 : (int)online;
    o->cache_type = GGML_TYPE_F16;
    o->cache_name = "f16";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEED_VALUE                                                                   \
    do {                                                                             \
        if (!v) {                                                                    \
            fprintf(stderr, TOOL ": %s needs a value\n", a);                         \
            return -1;                                                               \
        }                                                                            \
        i++;                                                                         \
    } while (0)
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(a, "--prompt-tokens")) {
            NEED_VALUE;
            o->prompt_tokens = v;
        } else if (!strcmp(a, "--prompt-ids-file")) {
            NEED_VALUE;
            o->prompt_file = v;
        } else if (!strcmp(a, "--prompt-from")) {
            NEED_VALUE;
            o->prompt_from = v;
        } else if (!strcmp(a, "--dump") || !strcmp(a, "-o")) {
            NEED_VALUE;
            o->out = v;
        } else if (!strcmp(a, "--hf")) {
            NEED_VALUE;
            o->hf_dir = v;
        } else if (!strcmp(a, "--dump-stages")) {
            NEED_VALUE;
            o->stages = v;
        } else if (!strcmp(a, "--max-new")) {
            NEED_VALUE;
            if (parse_int(v, a, 0, &o->max_new) < 0)
                return -1;
        } else if (!strcmp(a, "--ubatch")) {
            NEED_VALUE;
            if (parse_int(v, a, 1, &o->ubatch) < 0)
                return -1;
        } else if (!strcmp(a, "--batch")) {
            NEED_VALUE;
            if (parse_int(v, a, 1, &o->batch) < 0)
                return -1;
        } else if (!strcmp(a, "--threads")) {
            NEED_VALUE;
            if (parse_int(v, a, 1, &o->threads) < 0)
                return -1;
        } else if (!strcmp(a, "--ctx")) {
            NEED_VALUE;
            if (parse_int(v, a, 1, &o->ctx) < 0)
                return -1;
        } else if (!strcmp(a, "--flash-attn")) {
            NEED_VALUE;
            if (strcmp(v, "on") && strcmp(v, "off")) {
                fprintf(stderr, TOOL ": --flash-attn: '%s' is not on or off\n", v);
                return -1;
            }
            o->flash_attn = !strcmp(v, "on");
        } else if (!strcmp(a, "--cache-type")) {
            NEED_VALUE;
            static const struct { const char *name; enum ggml_type t; } types[] = {
                {"f32", GGML_TYPE_F32}, {"f16", GGML_TYPE_F16},
                {"bf16", GGML_TYPE_BF16}, {"q8_0", GGML_TYPE_Q8_0}, {"q4_0", GGML_TYPE_Q4_0}};
            int k = -1;
            for (int j = 0; j < (int)(sizeof types / sizeof types[0]); j++)
                if (!strcmp(v, types[j].name))
                    k = j;
            if (k < 0) {
                fprintf(stderr, TOOL ": --cache-type: '%s' is not f32, f16, bf16, q8_0 or q4_0\n", v);
                return -1;
            }
            o->cache_type = types[k].t;
            o->cache_name = types[k].name;
        } else if (!strcmp(a, "--fault")) {
            NEED_VALUE;
            o->fault = v;
        } else if (!strcmp(a, "--ignore-eos")) {
            o->ignore_eos = true;
        } else if (!strcmp(a, "--dump-logits")) {
            o->full_logits = true;
        } else if (!strcmp(a, "--list-tensors")) {
            o->list_tensors = true;
        } else if (!strcmp(a, "--no-record")) {
            o->no_record = true;
        } else if (!strcmp(a, "--time")) {
            o->timing = true;
        } else if (!strcmp(a, "--verbose")) {
            o->verbose = true;
        } else if (a[0] == '-') {
            fprintf(stderr, TOOL ": unknown option %s (see --help)\n", a);
            return -1;
        } else if (!o->gguf) {
            o->gguf = a;
        } else {
            fprintf(stderr, TOOL ": one model only ('%s' and '%s')\n", o->gguf, a);
            return -1;
        }
#undef NEED_VALUE
    }
    if (!o->gguf) {
        fprintf(stderr, TOOL ": no GGUF model given (see --help)\n");
        return -1;
    }
    if (!!o->prompt_tokens + !!o->prompt_file + !!o->prompt_from != 1) {
        fprintf(stderr, TOOL ": give the prompt with exactly one of --prompt-tokens, "
                        "--prompt-ids-file, --prompt-from\n");
        return -1;
    }
    if (!o->out && !o->list_tensors && !o->no_record) {
        fprintf(stderr, TOOL ": no --dump FILE given\n");
        return -1;
    }
    return o->out && !o->list_tensors && !o->no_record ? output_not_input(o) : 0;
}

/* ------------------------------------------------------------------ */
/* llama.cpp's log: quiet unless --verbose; the last error is kept, so a
 * failed load says why in one line.                                    */

static struct {
    bool verbose, in_error;
    char last_error[512];  /* the first error llama.cpp logged */
    char line[512];
} g_log;

static void on_log(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (g_log.verbose)
        fputs(text, stderr);
    /* The first error says why ("missing tensor ..."); the ones after it
     * only that loading failed. Messages may come in pieces (CONT). */
    bool cont = level == GGML_LOG_LEVEL_CONT;
    if (level == GGML_LOG_LEVEL_ERROR && !g_log.last_error[0])
        g_log.line[0] = '\0', g_log.in_error = true;
    else if (!cont)
        g_log.in_error = false;
    if (!g_log.in_error)
        return;
    size_t have = strlen(g_log.line);
    snprintf(g_log.line + have, sizeof g_log.line - have, "%s", text);
    snprintf(g_log.last_error, sizeof g_log.last_error, "%s", g_log.line);
    char *nl;
    while ((nl = strchr(g_log.last_error, '\n')))
        *nl = ' ';
    size_t n = strlen(g_log.last_error);
    while (n && isspace((unsigned char)g_log.last_error[n - 1]))
        g_log.last_error[--n] = '\0';
}

/* ------------------------------------------------------------------ */
/* model_config from the GGUF's metadata                                */

typedef struct {
    const struct gguf_context *g;
    const char *arch;
} meta;

static int64_t meta_key(const meta *m, const char *suffix)
{
    char key[160];
    snprintf(key, sizeof key, "%s.%s", m->arch, suffix);
    return gguf_find_key(m->g, key);
}

/* A numeric value of any integer or float type; dflt when absent. */
static double meta_num(const meta *m, const char *suffix, double dflt, bool *found)
{
    int64_t k = suffix[0] == '=' ? gguf_find_key(m->g, suffix + 1) : meta_key(m, suffix);
    if (found)
        *found = k >= 0;
    if (k < 0)
        return dflt;
    switch (gguf_get_kv_type(m->g, k)) {
    case GGUF_TYPE_UINT8: return gguf_get_val_u8(m->g, k);
    case GGUF_TYPE_INT8: return gguf_get_val_i8(m->g, k);
    case GGUF_TYPE_UINT16: return gguf_get_val_u16(m->g, k);
    case GGUF_TYPE_INT16: return gguf_get_val_i16(m->g, k);
    case GGUF_TYPE_UINT32: return gguf_get_val_u32(m->g, k);
    case GGUF_TYPE_INT32: return gguf_get_val_i32(m->g, k);
    case GGUF_TYPE_UINT64: return (double)gguf_get_val_u64(m->g, k);
    case GGUF_TYPE_INT64: return (double)gguf_get_val_i64(m->g, k);
    case GGUF_TYPE_FLOAT32: return gguf_get_val_f32(m->g, k);
    case GGUF_TYPE_FLOAT64: return gguf_get_val_f64(m->g, k);
    default:
        if (found)
            *found = false;
        return dflt;
    }
}

/* A numeric key as written: an integer's exact value (a u64 past
 * INT64_MAX saturates there, its text keeps every digit), a float's. */
typedef struct {
    bool found;        /* present and a number (not an array, not a string) */
    bool is_int;       /* an integer type, or a float holding a whole number */
    long long v;       /* the value when is_int */
    char text[40];     /* the value as written, for messages */
} meta_val;

static meta_val meta_get(const meta *m, const char *suffix)
{
    meta_val r = {.found = false};
    int64_t k = suffix[0] == '=' ? gguf_find_key(m->g, suffix + 1) : meta_key(m, suffix);
    if (k < 0)
        return r;
    r.found = r.is_int = true;
    switch (gguf_get_kv_type(m->g, k)) {
    case GGUF_TYPE_UINT8: r.v = gguf_get_val_u8(m->g, k); break;
    case GGUF_TYPE_INT8: r.v = gguf_get_val_i8(m->g, k); break;
    case GGUF_TYPE_UINT16: r.v = gguf_get_val_u16(m->g, k); break;
    case GGUF_TYPE_INT16: r.v = gguf_get_val_i16(m->g, k); break;
    case GGUF_TYPE_UINT32: r.v = gguf_get_val_u32(m->g, k); break;
    case GGUF_TYPE_INT32: r.v = gguf_get_val_i32(m->g, k); break;
    case GGUF_TYPE_INT64: r.v = gguf_get_val_i64(m->g, k); break;
    case GGUF_TYPE_UINT64: {
        const uint64_t u = gguf_get_val_u64(m->g, k);
        r.v = u > INT64_MAX ? INT64_MAX : (long long)u;
        snprintf(r.text, sizeof r.text, "%llu", (unsigned long long)u);
        return r;
    }
    case GGUF_TYPE_FLOAT32:
    case GGUF_TYPE_FLOAT64: {
        const double d = meta_num(m, suffix, 0, NULL);
        r.is_int = isfinite(d) && d == floor(d) && fabs(d) < 9e18;
        r.v = r.is_int ? (long long)d : 0;
        snprintf(r.text, sizeof r.text, "%.17g", d);
        return r;
    }
    default:
        r.found = r.is_int = false;
        return r;
    }
    snprintf(r.text, sizeof r.text, "%lld", r.v);
    return r;
}

/* The key's full name, "llama.block_count" (or the name after '='). */
static const char *meta_name(const meta *m, const char *suffix, char *buf, size_t n)
{
    if (suffix[0] == '=')
        return suffix + 1;
    snprintf(buf, n, "%s.%s", m->arch, suffix);
    return buf;
}

/* An integer key from lo to hi into *out: dflt when absent (an error when
 * required). what names what it counts, for the message that says which
 * key holds what and why it is refused ("llama.block_count is 0: the
 * number of layers must be from 1 to 256"). Present as another type (a
 * string, an array): as absent, unless required. */
static int meta_int(const meta *m, const char *path, const char *suffix, long long lo,
                    long long hi, bool required, long long dflt, const char *what, int *out,
                    kv_err *e)
{
    char buf[160];
    const char *name = meta_name(m, suffix, buf, sizeof buf);
    meta_val v = meta_get(m, suffix);
    if (!v.found) {
        if (required)
            return kv_errf(e, "%s: the GGUF has no number %s (%s)", path, name, what);
        *out = (int)dflt;
        return 0;
    }
    if (!v.is_int)
        return kv_errf(e, "%s: %s is %s, not a whole number (%s)", path, name, v.text, what);
    if (v.v < lo || v.v > hi)
        return kv_errf(e, "%s: %s is %s: %s must be from %lld to %lld", path, name, v.text, what,
                       lo, hi);
    *out = (int)v.v;
    return 0;
}

/* A head size (key_length, key_length_swa) must be even: RoPE rotates
 * pairs of its dimensions. */
static int head_even(const meta *m, const char *path, const char *key, int head_dim, kv_err *e)
{
    if (head_dim >= 2 && head_dim % 2 == 0)
        return 0;
    char buf[160];
    if (meta_get(m, key).found)
        return kv_errf(e, "%s: %s is %d: the head size must be even (RoPE rotates pairs of its "
                       "dimensions)", path, meta_name(m, key, buf, sizeof buf), head_dim);
    return kv_errf(e, "%s: the GGUF has no %s, and embedding_length / head_count gives a head "
                   "size of %d: it must be even, from 2", path, meta_name(m, key, buf, sizeof buf),
                   head_dim);
}

/* The rows of blk.0.attn_k.weight (K/V heads x head size), from its byte
 * size and a row of hidden values; -1 when that does not tell. */
static long long k_rows(const struct gguf_context *g, int hidden)
{
    int64_t id = gguf_find_tensor(g, "blk.0.attn_k.weight");
    if (id < 0 || hidden <= 0)
        return -1;
    const enum ggml_type t = gguf_get_tensor_type(g, id);
    const size_t ts = ggml_type_size(t), bytes = gguf_get_tensor_size(g, id);
    const long long bs = ggml_blck_size(t);
    if (ts == 0 || bs <= 0 || bytes % ts != 0)
        return -1;
    const long long n = (long long)(bytes / ts) * bs;
    return n % hidden == 0 ? n / hidden : -1;
}

/* attention.key_length against what the K weight holds (Llama, Qwen,
 * Gemma 3: n_kv_heads x head size rows): a wrong key_length is named
 * here, before the RoPE count checked against it is blamed. 1: the
 * weight confirms it; 0: no word (absent key or weight); -1: refused. */
static int key_length_fits(const meta *m, const char *path, const kv_config *c, kv_err *e)
{
    char buf[160];
    const long long rows = k_rows(m->g, c->hidden);
    if (!meta_get(m, "attention.key_length").found || rows <= 0 || rows % c->n_kv_heads != 0)
        return 0;
    if (rows / c->n_kv_heads == c->head_dim)
        return 1;
    return kv_errf(e, "%s: %s is %d, but blk.0.attn_k.weight holds %d K/V heads of %lld "
                   "dimensions (%lld rows): the key length is wrong", path,
                   meta_name(m, "attention.key_length", buf, sizeof buf), c->head_dim,
                   c->n_kv_heads, rows / c->n_kv_heads, rows);
}

/* A RoPE dimension count llama.cpp's rope op can take: even, from 2 to
 * the head size (head_key's, checked before). More than a head size the
 * K weight confirmed (head_ok) is the count's fault; more than one
 * nothing confirmed names both keys: either may be the wrong one. */
static int rope_count(const meta *m, const char *path, const char *key, const char *head_key,
                      int head_dim, bool head_ok, kv_err *e)
{
    const meta_val r = meta_get(m, key);
    char a[160], b[160];
    if (!r.found)
        return 0;
    if (!r.is_int || r.v < 2 || r.v % 2 != 0 || (head_ok && r.v > head_dim))
        return kv_errf(e, "%s: %s is %s: llama.cpp cannot rotate by it (an even count from 2 "
                       "to the head size, %d)", path, meta_name(m, key, a, sizeof a), r.text,
                       head_dim);
    if (r.v > head_dim && meta_get(m, head_key).found)
        return kv_errf(e, "%s: %s is %s, more than the head size %s = %d: llama.cpp cannot "
                       "rotate by more than a head (one of the two is wrong)", path,
                       meta_name(m, key, a, sizeof a), r.text, meta_name(m, head_key, b, sizeof b),
                       head_dim);
    if (r.v > head_dim)
        return kv_errf(e, "%s: %s is %s, more than the head size %d (embedding_length / "
                       "head_count; the GGUF has no %s): llama.cpp cannot rotate by more than a "
                       "head", path, meta_name(m, key, a, sizeof a), r.text, head_dim,
                       meta_name(m, head_key, b, sizeof b));
    return 0;
}

/* A token id key: absent, -1 or 2^32 - 1 (llama.cpp's "none" written as
 * u32) read as none (-1); else an id from 0 to 2^31 - 1. */
static int token_key(const meta *m, const char *path, const char *key, int *out, kv_err *e)
{
    const meta_val t = meta_get(m, key);
    if (t.found && t.is_int && (t.v == -1 || t.v == UINT32_MAX)) {
        *out = -1;
        return 0;
    }
    return meta_int(m, path, key, 0, INT32_MAX, false, -1, "a token id", out, e);
}

/* Which layers slide, as llama.cpp decides (llama_hparams::set_swa_pattern
 * and load_swa_pattern): a bool array, or every n-th layer global. */
static int gemma3_layer_types(const meta *m, const char *path, kv_config *c, int period,
                              kv_err *e)
{
    int64_t k = meta_key(m, "attention.sliding_window_pattern");
    if (k >= 0 && gguf_get_kv_type(m->g, k) == GGUF_TYPE_ARRAY) {
        if (gguf_get_arr_type(m->g, k) != GGUF_TYPE_BOOL ||
            gguf_get_arr_n(m->g, k) < (size_t)c->n_layers)
            return kv_errf(e, "%s: %s.attention.sliding_window_pattern: not a bool per layer",
                           path, m->arch);
        const int8_t *v = gguf_get_arr_data(m->g, k);
        for (int l = 0; l < c->n_layers; l++)
            c->layer_type[l] = v[l] ? ATTN_SLIDING : ATTN_GLOBAL;
        return 0;
    }
    int n;
    if (meta_int(m, path, "attention.sliding_window_pattern", 0, INT32_MAX, false, period,
                 "the sliding window pattern (every n-th layer global)", &n, e) < 0)
        return -1;
    for (int l = 0; l < c->n_layers; l++)
        c->layer_type[l] = (n == 0 || l % n < n - 1) ? ATTN_SLIDING : ATTN_GLOBAL;
    return 0;
}

/* A per-layer u32/i32 array key, or a scalar for every layer. */
static int meta_layer_u32(const meta *m, const char *suffix, int n, uint32_t *out, bool *found)
{
    int64_t k = meta_key(m, suffix);
    *found = k >= 0;
    if (k < 0)
        return 0;
    if (gguf_get_kv_type(m->g, k) != GGUF_TYPE_ARRAY) {
        bool f;
        double v = meta_num(m, suffix, 0, &f);
        for (int i = 0; i < n; i++)
            out[i] = (uint32_t)v;
        return f && v >= 0 && v <= UINT32_MAX ? 0 : -1;
    }
    enum gguf_type t = gguf_get_arr_type(m->g, k);
    if ((t != GGUF_TYPE_UINT32 && t != GGUF_TYPE_INT32) || gguf_get_arr_n(m->g, k) < (size_t)n)
        return -1;
    const uint32_t *v = gguf_get_arr_data(m->g, k);
    for (int i = 0; i < n; i++)
        out[i] = v[i];
    return 0;
}

/* Pairs of a full layer's head that rotate: rope_freqs.weight holds 1 for
 * those and a huge divisor (1e30 from the converter) for the others. All
 * of them when the tensor is absent or unreadable as F32. */
static int gemma4_rotated_pairs(const struct gguf_context *g, const char *path, int half)
{
    int64_t id = gguf_find_tensor(g, "rope_freqs.weight");
    if (id < 0 || gguf_get_tensor_type(g, id) != GGML_TYPE_F32 ||
        gguf_get_tensor_size(g, id) != (size_t)half * sizeof(float))
        return half;
    float *f = malloc((size_t)half * sizeof *f);
    FILE *fp = f ? fopen(path, "rb") : NULL;
    int rot = half;
    if (fp && fseeko(fp, (off_t)(gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id)),
                     SEEK_SET) == 0 && fread(f, sizeof *f, (size_t)half, fp) == (size_t)half) {
        rot = 0;
        while (rot < half && f[rot] == 1.0f)
            rot++;
        for (int d = rot; d < half; d++)
            if (!(f[d] >= 1e20f))
                rot = half;   /* not the proportional pattern: taken as whole */
    }
    if (fp)
        fclose(fp);
    free(f);
    return rot;
}

/* The layers the sharing count says compute K/V (the first n_kv) must
 * have K weights: a shared layer has none, so a count too small for the
 * file is a sharing llama.cpp cannot run. Said of the count, which is what
 * is wrong (the MLP widths, doubled on shared layers only, would look
 * wrong too). */
static int gemma4_check_sharing(const meta *m, const char *path, int n_kv, int shared,
                                kv_err *e)
{
    for (int l = 0; l < n_kv; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_k.weight", l);
        if (gguf_find_tensor(m->g, name) < 0)
            return kv_errf(e, "%s: %s.attention.shared_kv_layers is %d, so layer %d computes "
                           "its own K/V, but the file has no %s (a layer sharing another's "
                           "cache has none): the count is wrong for these weights, and "
                           "llama.cpp cannot run the file", path, m->arch, shared, l, name);
    }
    return 0;
}

/* Gemma 4 as llama.cpp's gemma4 reads it (llama_model_gemma4::
 * load_arch_hparams, llama-model.cpp's layer reuse rule). */
static int gemma4_from_gguf(const meta *m, const char *path, kv_config *c, kv_err *e)
{
    uint32_t kv[KV_MAX_LAYERS], ff[KV_MAX_LAYERS];
    bool f_kv, f_ff;
    c->head_dim_full = c->head_dim;
    if (meta_int(m, path, "attention.key_length_swa", 2, KV_MAX_HEAD_DIM, false,
                 c->head_dim_full, "the sliding layers' head size", &c->head_dim, e) < 0 ||
        head_even(m, path, "attention.key_length_swa", c->head_dim, e) < 0 ||
        rope_count(m, path, "rope.dimension_count_swa", "attention.key_length_swa",
                   c->head_dim, false, e) < 0)
        return -1;
    if (gemma3_layer_types(m, path, c, 6, e) < 0)
        return -1;
    bool sliding = false;
    for (int l = 0; l < c->n_layers; l++)
        sliding |= c->layer_type[l] == ATTN_SLIDING;
    if (meta_int(m, path, "attention.sliding_window", sliding ? 1 : 0, KV_MAX_POSITIONS, false,
                 0, sliding ? "the sliding window (the model has sliding layers)"
                            : "the sliding window", &c->sliding_window, e) < 0)
        return -1;
    c->rope_local_theta = meta_num(m, "rope.freq_base_swa", 10000.0, NULL);
    if (meta_layer_u32(m, "attention.head_count_kv", c->n_layers, kv, &f_kv) < 0)
        return kv_errf(e, "%s: %s.attention.head_count_kv is neither a number nor one per "
                       "layer", path, m->arch);
    if (meta_layer_u32(m, "feed_forward_length", c->n_layers, ff, &f_ff) < 0)
        return kv_errf(e, "%s: %s.feed_forward_length is neither a number nor one per layer",
                       path, m->arch);
    for (int l = 0; l < c->n_layers; l++) {
        if (f_kv && (kv[l] < 1 || kv[l] > (uint32_t)c->n_heads))
            return kv_errf(e, "%s: %s.attention.head_count_kv of layer %d is %u: the number of "
                           "K/V heads must be from 1 to the attention heads, %d", path, m->arch,
                           l, kv[l], c->n_heads);
        if (f_ff && (ff[l] < 1 || ff[l] > KV_MAX_INTERMEDIATE))
            return kv_errf(e, "%s: %s.feed_forward_length of layer %d is %u: the MLP width must "
                           "be from 1 to %d", path, m->arch, l, ff[l], KV_MAX_INTERMEDIATE);
    }
    c->n_kv_heads = c->n_kv_heads_full = 0;
    for (int l = 0; l < c->n_layers && f_kv; l++) {
        int *slot = c->layer_type[l] == ATTN_SLIDING ? &c->n_kv_heads : &c->n_kv_heads_full;
        if (*slot == 0)
            *slot = (int)kv[l];
        else if (*slot != (int)kv[l])
            return kv_errf(e, "%s: head_count_kv differs between layers of one type (layer "
                           "%d): not a Gemma 4 kvdiff can describe", path, l);
    }
    if (c->n_kv_heads == 0)
        c->n_kv_heads = c->n_kv_heads_full ? c->n_kv_heads_full : c->n_heads;
    if (c->n_kv_heads_full == 0)
        c->n_kv_heads_full = c->n_kv_heads;
    /* llama.cpp: the last shared_kv_layers layers read layer n_kv - 2
     * (sliding) or n_kv - 1 (full): what it runs, whatever the checkpoint's
     * config said. */
    const meta_val shared_v = meta_get(m, "attention.shared_kv_layers");
    if (shared_v.found && !(shared_v.is_int && shared_v.v >= 0 && shared_v.v <= c->n_layers - 2))
        return kv_errf(e, "%s: %s.attention.shared_kv_layers is %s: llama.cpp needs at least "
                       "two of the %d layers computing K/V", path, m->arch, shared_v.text,
                       c->n_layers);
    const int shared = shared_v.found ? (int)shared_v.v : 0, n_kv = c->n_layers - shared;
    for (int l = 0; l < c->n_layers; l++)
        c->kv_owner[l] = (int16_t)(l < n_kv ? l : n_kv - (c->layer_type[l] == ATTN_SLIDING ? 2 : 1));
    if (gemma4_check_sharing(m, path, n_kv, shared, e) < 0)
        return -1;
    c->intermediate = f_ff ? (int)ff[0] : c->intermediate;
    for (int l = 0; l < c->n_layers && f_ff; l++) {
        if ((int)ff[l] == c->intermediate)
            continue;
        if ((int)ff[l] == 2 * c->intermediate && c->kv_owner[l] != l)
            c->double_wide_mlp = true;
        else if ((int)ff[l] == 2 * c->intermediate)
            return kv_errf(e, "%s: %s.feed_forward_length of layer %d is %u, twice layer 0's "
                           "%d, but layer %d computes its own K/V (%s.attention."
                           "shared_kv_layers is %d): Gemma 4 doubles the MLP only on layers "
                           "that share K/V; one of the two is wrong", path, m->arch, l, ff[l],
                           c->intermediate, l, m->arch, shared);
        else
            return kv_errf(e, "%s: %s.feed_forward_length of layer %d is %u where layer 0's is "
                           "%d: not a Gemma 4 kvdiff can describe", path, m->arch, l, ff[l],
                           c->intermediate);
    }
    if (meta_int(m, path, "embedding_length_per_layer_input", 0, KV_MAX_HIDDEN, false, 0,
                 "the per-layer input width", &c->per_layer_dim, e) < 0)
        return -1;
    c->per_layer_vocab = c->per_layer_dim > 0 ? c->vocab : 0;
    /* K=V: a full layer computing K/V with no attn_v (llama.cpp uses Kcur). */
    for (int l = 0; l < c->n_layers; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_v.weight", l);
        if (c->layer_type[l] == ATTN_GLOBAL && c->kv_owner[l] == l &&
            gguf_find_tensor(m->g, name) < 0)
            c->k_eq_v = true;
    }
    const int rot = gemma4_rotated_pairs(m->g, path, c->head_dim_full / 2);
    c->rope_partial_full = rot < c->head_dim_full / 2 ? 2.0 * rot / c->head_dim_full : 0.0;
    /* llama.cpp applies 30 when the key is absent. */
    c->final_softcap = meta_num(m, "final_logit_softcapping", 30.0, NULL);
    c->embed_scale = sqrtf((float)c->hidden);
    c->attn_scale = 1.0;
    return 0;
}

/* kv_gguf_in (model/family.h) over the GGUF's metadata: what a family's
 * from_gguf reads. */
static int gin_int(const kv_gguf_in *g, const char *suffix, long long lo, long long hi,
                   bool required, long long dflt, const char *what, int *out, kv_err *e)
{
    return meta_int(g->ctx, g->path, suffix, lo, hi, required, dflt, what, out, e);
}

static double gin_num(const kv_gguf_in *g, const char *suffix, double dflt, bool *found)
{
    return meta_num(g->ctx, suffix, dflt, found);
}

static bool gin_has(const kv_gguf_in *g, const char *suffix)
{
    return meta_get(g->ctx, suffix).found;
}

static bool gin_is_true(const kv_gguf_in *g, const char *suffix)
{
    const meta *m = g->ctx;
    const int64_t k = meta_key(m, suffix);
    return k >= 0 && gguf_get_kv_type(m->g, k) == GGUF_TYPE_BOOL && gguf_get_val_bool(m->g, k);
}

static int gin_layer_types(const kv_gguf_in *g, kv_config *c, int period, kv_err *e)
{
    return gemma3_layer_types(g->ctx, g->path, c, period, e);
}

/* What llama.cpp runs, as a kv_config. llama_scale: the q.k multiplier
 * llama.cpp applies (Gemma 3: 1/sqrt(head_dim), or 1/sqrt(E/H) for the
 * 62-layer model, whatever query_pre_attn_scalar was). */
static int config_from_gguf(const struct gguf_context *g, const char *path, kv_config *c,
                            double *llama_scale, kv_err *e)
{
    memset(c, 0, sizeof *c);
    int64_t ka = gguf_find_key(g, "general.architecture");
    if (ka < 0 || gguf_get_kv_type(g, ka) != GGUF_TYPE_STRING)
        return kv_errf(e, "%s: no general.architecture in the GGUF metadata", path);
    meta m = {g, gguf_get_val_str(g, ka)};
    const kv_family *fam = family_by_gguf_arch(m.arch);
    if (!fam) {
        char known[256] = "";
        for (int a = 0; a < ARCH_COUNT; a++) {
            const char *ga = family_of((kv_arch)a)->gguf_arch;
            if (!strstr(known, ga))
                snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s",
                         known[0] ? ", " : "", ga);
        }
        return kv_errf(e, "%s: unsupported architecture '%.64s' (" TOOL " knows %s)", path,
                       m.arch, known);
    }
    /* its model_type and what follows from the family alone (a DeepSeek
     * GGUF is V2 until its gating says V3) */
    family_set(c, fam->arch);
    /* Llama's attention_bias: llama.cpp loads the biases when present. */
    if (c->arch == ARCH_LLAMA && gguf_find_tensor(g, "blk.0.attn_q.bias") >= 0)
        c->qkv_bias = c->o_bias = true;
    /* Each key checked and named on its own: a key present with value 0 is
     * not missing, and 2^31 is not -2^31. */
    if (meta_int(&m, path, "embedding_length", 1, KV_MAX_HIDDEN, true, 0, "the model width",
                 &c->hidden, e) < 0 ||
        meta_int(&m, path, "block_count", 1, KV_MAX_LAYERS, true, 0, "the number of layers",
                 &c->n_layers, e) < 0 ||
        meta_int(&m, path, "attention.head_count", 1, KV_MAX_HEADS, true, 0,
                 "the number of attention heads", &c->n_heads, e) < 0 ||
        meta_int(&m, path, "attention.head_count_kv", 1, c->n_heads, false, c->n_heads,
                 "the number of K/V heads", &c->n_kv_heads, e) < 0 ||
        meta_int(&m, path, "attention.key_length", 2, KV_MAX_HEAD_DIM, false,
                 c->hidden / c->n_heads, "the head size", &c->head_dim, e) < 0 ||
        head_even(&m, path, "attention.key_length", c->head_dim, e) < 0)
        return -1;
    const int head_ok = c->arch == ARCH_GEMMA4 ? 0 : key_length_fits(&m, path, c, e);
    /* What llama.cpp's rope asserts on (odd, or more than a head) or spins
     * on (0): refused here. Any other count it runs, and a compare shows. */
    if (head_ok < 0 || rope_count(&m, path, "rope.dimension_count", "attention.key_length",
                                  c->head_dim, head_ok == 1, e) < 0)
        return -1;
    /* Gemma 4's is one per layer (read by gemma4_from_gguf). */
    if (meta_int(&m, path, "feed_forward_length", 1, KV_MAX_INTERMEDIATE,
                 c->arch != ARCH_GEMMA4, 0, "the MLP width", &c->intermediate, e) < 0 ||
        meta_int(&m, path, "context_length", 1, KV_MAX_POSITIONS, false, 4096,
                 "the context length", &c->max_positions, e) < 0)
        return -1;
    c->rms_eps = meta_num(&m, "attention.layer_norm_rms_epsilon", 1e-6, NULL);
    c->rope_theta = meta_num(&m, "rope.freq_base", 10000.0, NULL);
    c->rope_local_theta = c->rope_theta;
    c->final_softcap = meta_num(&m, "final_logit_softcapping", 0, NULL);
    c->embed_scale = 1.0f;
    c->tie_embeddings = gguf_find_tensor(g, "output.weight") < 0;
    int eos;
    if (token_key(&m, path, "=tokenizer.ggml.bos_token_id", &c->bos_id, e) < 0 ||
        token_key(&m, path, "=tokenizer.ggml.eos_token_id", &eos, e) < 0)
        return -1;
    if (eos >= 0)
        c->eos_ids[c->n_eos++] = eos;
    for (int l = 0; l < c->n_layers; l++)
        c->kv_owner[l] = (int16_t)l;
    /* Hugging Face names, which config_validate insists on; unused here. */
    snprintf(c->tensor_prefix, sizeof c->tensor_prefix, "model.");
    snprintf(c->lm_head_name, sizeof c->lm_head_name, "%s",
             c->tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
    *llama_scale = 1.0 / sqrt((double)c->head_dim);
    if (c->arch == ARCH_GEMMA4) {
        if (gemma4_from_gguf(&m, path, c, e) < 0)
            return -1;
        *llama_scale = 1.0;   /* f_attention_scale */
    } else if (c->arch == ARCH_GEMMA3) {
        c->embed_scale = sqrtf((float)c->hidden);
        if (meta_int(&m, path, "attention.sliding_window", 0, KV_MAX_POSITIONS, false, 0,
                     "the sliding window", &c->sliding_window, e) < 0)
            return -1;
        if (c->sliding_window > 0) {
            c->rope_local_theta = meta_num(&m, "rope.freq_base_swa", 10000.0, NULL);
            if (gemma3_layer_types(&m, path, c, 6, e) < 0)
                return -1;
        }
        if (c->n_layers == 62)
            *llama_scale = 1.0 / sqrt((double)(c->hidden / c->n_heads));
        c->query_pre_attn_scalar = 1.0 / (*llama_scale * *llama_scale);
        /* A GGUF kvdiff exported says what it folded into q_norm (the
         * ratio of the two scales): take the model's own scalar back. */
        bool f_qpas;
        const double qpas = meta_num(&m, "=kvdiff.query_pre_attn_scalar", 0, &f_qpas);
        if (f_qpas && qpas > 0 && isfinite(qpas))
            c->query_pre_attn_scalar = qpas;
    } else if (!fam->from_gguf) {
        bool f_scale;
        double s = meta_num(&m, "attention.scale", 0, &f_scale);
        if (f_scale && s != 0)
            *llama_scale = s;
    }
    /* Gemma 3: the model's scale (the recorder divides q by what llama.cpp
     * folded beyond its own); every other model: llama.cpp's. */
    c->attn_scale = c->arch == ARCH_GEMMA3 ? 1.0 / sqrt(c->query_pre_attn_scalar) : *llama_scale;
    if (c->arch == ARCH_GEMMA4)
        return 0;   /* no RoPE scaling: rope_freqs carries the proportional RoPE */
    bool f_rs;
    double rs = meta_num(&m, "rope.scaling.factor", 0, &f_rs);
    int64_t kt = meta_key(&m, "rope.scaling.type");
    const char *rtype = kt >= 0 && gguf_get_kv_type(g, kt) == GGUF_TYPE_STRING
                            ? gguf_get_val_str(g, kt) : "none";
    if (!strcmp(rtype, "linear") && f_rs && rs > 0 && rs != 1) {
        c->rope_scaling.type = ROPE_SCALE_LINEAR;
        c->rope_scaling.factor = rs;
    } else if (!strcmp(rtype, "yarn") && f_rs && rs > 0) {
        /* As llama.cpp runs it: the ramp's ends rounded to whole dims
         * (ggml_rope_yarn_corr_dims), whatever the checkpoint's truncate;
         * cos and sin times 0.1 ln factor + 1 (llama_context). */
        kv_rope_scaling *y = &c->rope_scaling;
        y->type = ROPE_SCALE_YARN;
        y->factor = rs;
        y->beta_fast = meta_num(&m, "rope.scaling.yarn_beta_fast", 32.0, NULL);
        y->beta_slow = meta_num(&m, "rope.scaling.yarn_beta_slow", 1.0, NULL);
        y->truncate = true;
        y->attn_factor = rs > 1 ? 0.1 * log(rs) + 1.0 : 1.0;
        if (meta_int(&m, path, "rope.scaling.original_context_length", 1, KV_MAX_POSITIONS,
                     true, 0, "YaRN's original context", &y->original_max_position, e) < 0)
            return -1;
    } else if (strcmp(rtype, "none") && strcmp(rtype, "linear")) {
        return kv_errf(e, "%s: RoPE scaling '%.32s' is not one kvdiff models", path, rtype);
    }
    if (fam->from_gguf) {
        const kv_gguf_in gin = {&m, path, gin_int, gin_num, gin_has, gin_is_true,
                                gin_layer_types};
        return fam->from_gguf(&gin, c, llama_scale, e);
    }
    return 0;
}

/* Layers that share K/V (a Gemma 4's last num_kv_shared_layers). */
static int count_shared(const kv_config *c)
{
    int n = 0;
    for (int l = 0; l < c->n_layers; l++)
        n += c->kv_owner[l] != l;
    return n;
}

/* --hf: config.json is the truth about the model; the GGUF must be the
 * same shape, its KV sharing included (llama.cpp runs the GGUF's). */
static int config_check_same(const kv_config *hf, const kv_config *gg, const char *path,
                             kv_err *e)
{
    struct { const char *name; int a, b; } f[] = {
        {"hidden_size", hf->hidden, gg->hidden},
        {"num_hidden_layers", hf->n_layers, gg->n_layers},
        {"num_attention_heads", hf->n_heads, gg->n_heads},
        {"num_key_value_heads", hf->n_kv_heads, gg->n_kv_heads},
        {"head_dim", hf->head_dim, gg->head_dim},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].a != f[i].b)
            return kv_errf(e, "%s: %s is %d in config.json but %d in the GGUF", path, f[i].name,
                           f[i].a, f[i].b);
    if (hf->arch != gg->arch)
        return kv_errf(e, "%s: config.json's model_type %s is not the GGUF's architecture", path,
                       hf->model_type);
    if (count_shared(hf) != count_shared(gg))
        return kv_errf(e, "%s: %d layers share KV caches in config.json (num_kv_shared_layers) "
                       "but %d in the GGUF (attention.shared_kv_layers)", path,
                       count_shared(hf), count_shared(gg));
    for (int l = 0; l < hf->n_layers; l++)
        if (hf->kv_owner[l] != gg->kv_owner[l])
            return kv_errf(e, "%s: layer %d reads layer %d's KV cache in config.json but "
                           "layer %d's as llama.cpp runs the GGUF", path, l, hf->kv_owner[l],
                           gg->kv_owner[l]);
    return 0;
}

/* ------------------------------------------------------------------ */
/* The recorder: graph tensors to stage rows                            */

typedef struct {
    float *rows;
    int nrows, cap;
} pending;

typedef struct {
    kv_observer *obs;
    const kv_config *cfg;
    int V;                          /* logits width */
    bool unpermute;                 /* llama: rows 2m+s back to s*D/2+m */
    float q_unfold;                 /* Gemma 3: q as llama.cpp holds it = q * q_unfold */
    int rot_k, rot_v;               /* llama.cpp's Hadamard rotations of a quantized cache:
                                     * the block sizes of q/k and of v, 0 when none */
    int64_t next[STAGE_COUNT][KV_MAX_LAYERS + 1];   /* next position of each dataset */
    pending v[KV_MAX_LAYERS], proj[KV_MAX_LAYERS];
    pending q[KV_MAX_LAYERS];       /* MLA: q before RoPE, until its rotated tails come */
    unsigned char *raw;
    size_t raw_cap;
    float *buf, *tmp;
    size_t buf_cap;
    bool list;                      /* --list-tensors */
    bool paused;                    /* a planted fault's own decode: nothing recorded */
    int graph_fault;                /* a test fault planted in the graph (graph_fault_kind) */
    int n_prompt;                   /* its prompt length */
    int call_pos0;                  /* the first position of the current llama_decode call */
    long graph_fault_hits;          /* nodes it changed */
    /* MLA: each layer's attn_k_b (nope, R, H) and attn_v_b (R, Dv, H) as
     * floats, to expand the cached latent rows into k and v (NULL: the
     * GGUF has none; k and v are then not recorded) */
    float *k_b[KV_MAX_LAYERS], *v_b[KV_MAX_LAYERS];
    int64_t ubatch_pos;             /* sink-windowed: the position of the ubatch's token */
    float sink_saved[KV_MAX_LAYERS][KV_MAX_HEADS];   /* and each layer's sinks */
    bool sink_kept[KV_MAX_LAYERS];
    bool failed;
    char err[512];
} recorder;

typedef enum { MAP_NONE, MAP_EMIT, MAP_PENDING_V, MAP_PENDING_PROJ, MAP_PLE, MAP_PENDING_Q,
               MAP_Q_TAILS } map_kind;

typedef struct {
    map_kind kind;
    kv_stage stage;
    int layer;
} mapping;

/* "Qcur-3" -> ("Qcur", 3); names without a layer give -1. */
static int split_name(const char *name, char *base, size_t n)
{
    const char *dash = strrchr(name, '-');
    int layer = -1;
    size_t len = strlen(name);
    if (dash && dash[1] && strspn(dash + 1, "0123456789") == strlen(dash + 1)) {
        layer = atoi(dash + 1);
        len = (size_t)(dash - name);
    }
    if (len >= n)
        len = n - 1;
    memcpy(base, name, len);
    base[len] = '\0';
    return layer;
}

/* Layer index of a weight named "blk.<il>.<what>", else -1. */
static int weight_layer(const struct ggml_tensor *w, const char *what)
{
    if (!w)
        return -1;
    int il, off = 0;
    const char *name = ggml_get_name(w);
    if (sscanf(name, "blk.%d.%n", &il, &off) != 1 || off == 0 || strcmp(name + off, what))
        return -1;
    return il;
}

static int stage_cols(const recorder *r, kv_stage s, int layer);

/* Where a graph node goes: the family's graph names (model/family.h, each
 * family's file; docs/recorders.md has the table), after what every
 * family shares: o_proj's product (Qwen2 names no node after it), the
 * router's sum with its bias (gpt-oss). */
static mapping map_tensor(const recorder *r, const struct ggml_tensor *t)
{
    const kv_config *c = r->cfg;
    mapping m = {MAP_NONE, STAGE_X_IN, -1};
    int wl;
    /* Sandwich norms (Gemma) end the attention block after o_proj. */
    if (!c->sandwich_norms && t->op == GGML_OP_MUL_MAT &&
        (wl = weight_layer(t->src[0], "attn_output.weight")) >= 0 && wl < c->n_layers)
        return (mapping){MAP_PENDING_PROJ, STAGE_ATTN_PROJ, wl};
    if (!c->sandwich_norms && t->op == GGML_OP_ADD &&
        (wl = weight_layer(t->src[1], "attn_output.bias")) >= 0 && wl < c->n_layers)
        return (mapping){MAP_PENDING_PROJ, STAGE_ATTN_PROJ, wl};
    /* The router's logits: the sum with blk.<il>.ffn_gate_inp.bias (named
     * ffn_moe_probs or ffn_moe_logits_biased by llama.cpp's versions). */
    if (c->n_experts > 0 && t->op == GGML_OP_ADD &&
        (wl = weight_layer(t->src[1], "ffn_gate_inp.bias")) >= 0 && wl < c->n_layers)
        return (mapping){MAP_EMIT, STAGE_ROUTER_LOGITS, wl};
    char base[64];
    const int il = split_name(ggml_get_name(t), base, sizeof base);
    if (il >= c->n_layers)
        return m;
    for (const kv_graph_name *g = family_graph(c->arch); g->node; g++) {
        if (g->model != (il < 0) || strcmp(base, g->node) ||
            (g->rope && t->op != GGML_OP_ROPE))
            continue;
        if (g->full_width) {
            const int64_t cols = stage_cols(r, g->stage, il);
            if (t->ne[0] != cols && t->ne[0] * t->ne[1] != cols)
                continue;
        }
        switch (g->take) {
        case GRAPH_ALL_LAYERS: return (mapping){MAP_PLE, g->stage, -1};
        case GRAPH_Q_TAILS: return (mapping){MAP_Q_TAILS, g->stage, il};
        case GRAPH_LAST:
            return (mapping){g->stage == STAGE_Q   ? MAP_PENDING_Q
                             : g->stage == STAGE_V ? MAP_PENDING_V
                                                   : MAP_PENDING_PROJ, g->stage, il};
        case GRAPH_EMIT: return (mapping){MAP_EMIT, g->stage, il};
        }
    }
    return m;
}

static int stage_cols(const recorder *r, kv_stage s, int layer)
{
    const kv_config *c = r->cfg;
    const int D = config_layer_head_dim(c, layer);
    switch (s) {
    case STAGE_Q: return c->n_heads * D;
    case STAGE_ATTN_OUT: return c->n_heads * config_layer_v_head_dim(c, layer);
    case STAGE_K: return config_layer_kv_heads(c, layer) * D;
    case STAGE_V: return config_layer_kv_heads(c, layer) * config_layer_v_head_dim(c, layer);
    case STAGE_KV_LATENT: return config_mla_row(c);
    case STAGE_PLE_IN: return c->per_layer_dim;
    case STAGE_ROUTER_LOGITS: return c->n_experts;
    case STAGE_LOGITS: return r->V;
    default: return c->hidden;
    }
}

static bool rec_fail(recorder *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static bool rec_fail(recorder *r, const char *fmt, ...)
{
    if (!r->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->err, sizeof r->err, fmt, ap);
        va_end(ap);
    }
    r->failed = true;
    return false;
}

static bool grow(void **p, size_t *cap, size_t need)
{
    if (need <= *cap)
        return true;
    void *q = realloc(*p, need);
    if (!q)
        return false;
    *p = q;
    *cap = need;
    return true;
}

/* The tensor's values in logical order (ne[0] fastest), as float, into
 * r->buf: strided views and f16/bf16 tensors read as what they hold. */
static bool read_tensor(recorder *r, const struct ggml_tensor *t, int64_t *n_out)
{
    const int64_t n = ggml_nelements(t);
    const size_t span = ggml_nbytes(t);
    size_t cap = r->buf_cap;
    if (!grow((void **)&r->buf, &cap, (size_t)n * sizeof(float)) ||
        !grow((void **)&r->tmp, &r->buf_cap, (size_t)n * sizeof(float)) ||
        !grow((void **)&r->raw, &r->raw_cap, span))
        return rec_fail(r, "out of memory reading %s", ggml_get_name(t));
    if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
        ggml_backend_tensor_get(t, r->buf, 0, (size_t)n * sizeof(float));
        *n_out = n;
        return true;
    }
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16)
        return rec_fail(r, "tensor %s has type %s (f32, f16 or bf16 expected)", ggml_get_name(t),
                        ggml_type_name(t->type));
    ggml_backend_tensor_get(t, r->raw, 0, span);
    int64_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++)
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++)
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++)
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    const unsigned char *p = r->raw + i0 * t->nb[0] + i1 * t->nb[1] +
                                             i2 * t->nb[2] + i3 * t->nb[3];
                    float x;
                    if (t->type == GGML_TYPE_F32)
                        memcpy(&x, p, sizeof x);
                    else if (t->type == GGML_TYPE_F16)
                        x = ggml_fp16_to_fp32(*(const ggml_fp16_t *)p);
                    else
                        x = ggml_bf16_to_fp32(*(const ggml_bf16_t *)p);
                    r->buf[k++] = x;
                }
    *n_out = n;
    return true;
}

/* llama.cpp's Llama rotates adjacent pairs (the converter permuted q/k
 * rows so that this equals Hugging Face's rotate-half): element 2m + s of
 * a head is our element s*D/2 + m. */
static void unpermute_rows(recorder *r, float *rows, int nrows, int cols)
{
    const int D = r->cfg->head_dim, half = D / 2;
    for (int i = 0; i < nrows; i++) {
        float *row = rows + (size_t)i * cols;
        for (int h = 0; h < cols / D; h++) {
            float *head = row + (size_t)h * D;
            for (int m = 0; m < half; m++) {
                r->tmp[m] = head[2 * m];
                r->tmp[half + m] = head[2 * m + 1];
            }
            memcpy(head, r->tmp, (size_t)D * sizeof(float));
        }
    }
}

/* With a quantized cache and head_dim a multiple of 64, llama.cpp stores v
 * rotated by an orthonormal Walsh-Hadamard matrix H of size rot_v (in
 * Sylvester order; H H = I), so kqv_out is H times each block of the
 * attention output, and llama.cpp multiplies by H again before o_proj.
 * The recorder does the same (kern_hadamard_blocks): the attention output
 * in our basis. */
static bool emit_rows(recorder *r, kv_stage st, int layer, const float *rows, int nrows)
{
    int64_t *next = &r->next[st][layer + 1];
    kv_event ev = {st, layer, *next, nrows, stage_cols(r, st, layer), rows};
    *next += nrows;
    if (r->obs->emit(r->obs, &ev))
        return rec_fail(r, "the dump writer stopped the run");
    return true;
}

static bool flush_pending(recorder *r, pending *p, kv_stage st, int layer)
{
    if (p->nrows == 0)
        return true;
    bool ok = emit_rows(r, st, layer, p->rows, p->nrows);
    p->nrows = 0;
    return ok;
}

static bool keep_pending(recorder *r, pending *p, const float *rows, int nrows, int cols)
{
    size_t cap = (size_t)p->cap;
    if (!grow((void **)&p->rows, &cap, (size_t)nrows * cols * sizeof(float)))
        return rec_fail(r, "out of memory");
    p->cap = (int)(cap > (size_t)1 << 30 ? 1 << 30 : cap);
    memcpy(p->rows, rows, (size_t)nrows * cols * sizeof(float));
    p->nrows = nrows;
    return true;
}

/* MLA: the held q rows (before RoPE) with each head's tail replaced by
 * the rotated q_pe ([dr, H, rows], dr fastest), emitted as q. */
static bool emit_q_tails(recorder *r, int il, const float *pe, int nrows)
{
    const kv_config *c = r->cfg;
    const int H = c->n_heads, D = c->head_dim, dr = c->qk_rope_dim;
    pending *p = &r->q[il];
    if (p->nrows != nrows)
        return rec_fail(r, "layer %d: q_pe has %d rows, the q before it %d", il, nrows,
                        p->nrows);
    for (int i = 0; i < nrows; i++)
        for (int h = 0; h < H; h++)
            memcpy(p->rows + ((size_t)i * H + h) * D + (D - dr),
                   pe + ((size_t)i * H + h) * dr, (size_t)dr * sizeof(float));
    return flush_pending(r, p, STAGE_Q, il);
}

/* Gemma 4's inp_per_layer, [P, L, T] (P fastest): layer l's P values of
 * token t at (l + L t) P; each layer's rows go to its ple_in. */
static bool emit_ple(recorder *r, const struct ggml_tensor *t)
{
    const int P = r->cfg->per_layer_dim, L = r->cfg->n_layers;
    int64_t n = 0;
    if (P <= 0 || !read_tensor(r, t, &n))
        return P <= 0 ? rec_fail(r, "inp_per_layer in a model without per-layer inputs") : false;
    if (n % ((int64_t)P * L))
        return rec_fail(r, "inp_per_layer holds %lld values, not rows of %d x %d layers",
                        (long long)n, P, L);
    const int64_t T = n / ((int64_t)P * L);
    float *rows = malloc((size_t)(T * P) * sizeof *rows);
    if (!rows)
        return rec_fail(r, "out of memory");
    bool ok = true;
    for (int l = 0; ok && l < L; l++) {
        if (r->obs->wants && !r->obs->wants(r->obs, STAGE_PLE_IN, l))
            continue;
        for (int64_t tok = 0; tok < T; tok++)
            memcpy(rows + tok * P, r->buf + (l + L * tok) * P, (size_t)P * sizeof *rows);
        ok = emit_rows(r, STAGE_PLE_IN, l, rows, (int)T);
    }
    free(rows);
    return ok;
}

static bool wanted(recorder *r, kv_stage st, int layer)
{
    /* Gemma 4's per-layer inputs come for every layer at once. */
    if (st == STAGE_PLE_IN && layer < 0) {
        for (int l = 0; l < r->cfg->n_layers; l++)
            if (wanted(r, STAGE_PLE_IN, l))
                return true;
        return false;
    }
    return !r->obs->wants || r->obs->wants(r->obs, st, layer) ||
           (st == STAGE_X_OUT && layer + 1 < r->cfg->n_layers &&
            r->obs->wants(r->obs, STAGE_X_IN, layer + 1)) ||
           (st == STAGE_EMBED && r->obs->wants(r->obs, STAGE_X_IN, 0));
}

/* ------------------------------------------------------------------ */
/* MLA: the expanded heads, from the cache row                          */

/* One of the GGUF's tensors as n floats (any type ggml can turn to float),
 * read from the file; NULL with e set, or NULL and no error when absent. */
static float *gguf_floats(const struct gguf_context *g, const char *path, const char *name,
                          int64_t n, kv_err *e)
{
    const int64_t id = gguf_find_tensor(g, name);
    if (id < 0)
        return NULL;
    const enum ggml_type t = gguf_get_tensor_type(g, id);
    const struct ggml_type_traits *tr = ggml_get_type_traits(t);
    const size_t bytes = gguf_get_tensor_size(g, id);
    if (!tr || (t != GGML_TYPE_F32 && !tr->to_float) ||
        bytes != ggml_row_size(t, n)) {
        kv_errf(e, "%s: %s is not %lld values kvdiff-llama can read (%s, %zu bytes)", path,
                name, (long long)n, ggml_type_name(t), bytes);
        return NULL;
    }
    void *raw = malloc(bytes);
    float *out = malloc((size_t)n * sizeof *out);
    FILE *f = raw && out ? fopen(path, "rb") : NULL;
    bool ok = f && fseeko(f, (off_t)(gguf_get_data_offset(g) + gguf_get_tensor_offset(g, id)),
                          SEEK_SET) == 0 && fread(raw, 1, bytes, f) == bytes;
    if (f)
        fclose(f);
    if (ok && t == GGML_TYPE_F32)
        memcpy(out, raw, bytes);
    else if (ok)
        tr->to_float(raw, out, n);
    free(raw);
    if (!ok) {
        free(out);
        kv_errf(e, "%s: cannot read %s", path, name);
        return NULL;
    }
    return out;
}

/* Every layer's attn_k_b and attn_v_b (the converter's split of
 * kv_b_proj), when the GGUF holds them all. */
static int mla_load_expansion(recorder *r, const struct gguf_context *g, const char *path,
                              kv_err *e)
{
    const kv_config *c = r->cfg;
    const int64_t R = c->kv_lora_rank, H = c->n_heads, nope = c->head_dim - c->qk_rope_dim;
    for (int l = 0; l < c->n_layers; l++) {
        char kn[64], vn[64];
        snprintf(kn, sizeof kn, "blk.%d.attn_k_b.weight", l);
        snprintf(vn, sizeof vn, "blk.%d.attn_v_b.weight", l);
        e->msg[0] = 0;
        r->k_b[l] = gguf_floats(g, path, kn, nope * R * H, e);
        r->v_b[l] = r->k_b[l] ? gguf_floats(g, path, vn, R * c->v_head_dim * H, e) : NULL;
        if (e->msg[0])
            return -1;
        if (!r->k_b[l] || !r->v_b[l]) {   /* not the absorbed MLA form: no expansion */
            for (int i = 0; i <= l; i++) {
                free(r->k_b[i]);
                free(r->v_b[i]);
                r->k_b[i] = r->v_b[i] = NULL;
            }
            return 0;
        }
    }
    return 0;
}

/* k and v of n cache rows (the normed latent, then the rotated tail) of
 * layer il, as docs/dump-format.md defines them for MLA: each head's key
 * is attn_k_b's rows of the latent then the shared tail, its value
 * attn_v_b's; in double, rounded once. */
static bool mla_emit_kv(recorder *r, int il, const float *rows, int n)
{
    const kv_config *c = r->cfg;
    const int R = c->kv_lora_rank, dr = c->qk_rope_dim, H = c->n_heads, D = c->head_dim;
    const int nope = D - dr, Dv = c->v_head_dim;
    const bool want_k = wanted(r, STAGE_K, il), want_v = wanted(r, STAGE_V, il);
    if (!r->k_b[il] || (!want_k && !want_v))
        return true;
    float *k = malloc((size_t)n * H * D * sizeof *k), *v = malloc((size_t)n * H * Dv * sizeof *v);
    if (!k || !v) {
        free(k);
        free(v);
        return rec_fail(r, "out of memory expanding layer %d's latent rows", il);
    }
    for (int i = 0; i < n; i++) {
        const float *lat = rows + (size_t)i * (R + dr);
        for (int h = 0; h < H; h++) {
            float *kh = k + ((size_t)i * H + h) * D, *vh = v + ((size_t)i * H + h) * Dv;
            for (int d = 0; d < nope; d++) {   /* (d, r, h) at d + nope (r + R h) */
                double acc = 0;
                for (int q = 0; q < R; q++)
                    acc += (double)r->k_b[il][d + (size_t)nope * (q + (size_t)R * h)] * lat[q];
                kh[d] = (float)acc;
            }
            memcpy(kh + nope, lat + R, (size_t)dr * sizeof(float));
            for (int j = 0; j < Dv; j++) {     /* (q, j, h) at q + R (j + Dv h) */
                const float *w = r->v_b[il] + (size_t)R * (j + (size_t)Dv * h);
                double acc = 0;
                for (int q = 0; q < R; q++)
                    acc += (double)w[q] * lat[q];
                vh[j] = (float)acc;
            }
        }
    }
    bool ok = (!want_k || emit_rows(r, STAGE_K, il, k, n)) &&
              (!want_v || emit_rows(r, STAGE_V, il, v, n));
    free(k);
    free(v);
    return ok;
}

/* ------------------------------------------------------------------ */
/* Test aids planted in the graph as it runs (--fault mla-*)            */

/* A latent cache's bugs made inside llama.cpp's MLA graph: the node is
 * computed, changed here (cb_eval's second call), and every node after it
 * reads the change, the cache included. Each says so in engine_settings
 * ("fault"), as the memory-API faults below do. */
enum { GF_NONE, GF_ROPE_TWICE, GF_ROPE_UNCACHED, GF_MIXED_FORMS, GF_SINK_DROPPED,
       GF_SINK_PREFILL_ONLY, GF_SINK_WINDOWED };

static bool sink_fault(int gf)
{
    return gf == GF_SINK_DROPPED || gf == GF_SINK_PREFILL_ONLY || gf == GF_SINK_WINDOWED;
}

static int weight_layer(const struct ggml_tensor *w, const char *what);

/* The sinks an attention node reads (gpt-oss: ggml_soft_max_add_sinks
 * puts them in src[2], ggml_flash_attn_ext_add_sinks in src[4]), or NULL. */
static struct ggml_tensor *node_sinks(const struct ggml_tensor *t)
{
    if (t->op == GGML_OP_SOFT_MAX)
        return t->src[2];
    if (t->op == GGML_OP_FLASH_ATTN_EXT)
        return t->src[4];
    return NULL;
}

/* Sinks left out: the weight set to -inf (exp(-inf) = 0 in the softmax),
 * before the attention node computes (cb_eval's first call), in every
 * step, from the first decode step on, or (windowed, one token a ubatch)
 * on a sliding layer's rows whose window no longer holds key 0, the
 * weight put back for the others; the model is loaded without mmap for
 * it (its weights writable). */
static bool fault_sinks(recorder *r, struct ggml_tensor *t)
{
    struct ggml_tensor *w = node_sinks(t);
    if (r->graph_fault == GF_SINK_PREFILL_ONLY && r->call_pos0 < r->n_prompt)
        return true;
    if (w->type != GGML_TYPE_F32)
        return rec_fail(r, "--fault: the sinks %s are %s, not f32", ggml_get_name(w),
                        ggml_type_name(w->type));
    const int64_t n = ggml_nelements(w);
    const int il = weight_layer(w, "attn_sinks.weight");
    bool drop = true;
    if (r->graph_fault == GF_SINK_WINDOWED) {
        if (il < 0 || il >= r->cfg->n_layers || n > KV_MAX_HEADS)
            return rec_fail(r, "--fault sink-windowed: %s is no layer's sinks",
                            ggml_get_name(w));
        if (!r->sink_kept[il]) {   /* the layer's own logits, to put back */
            ggml_backend_tensor_get(w, r->sink_saved[il], 0, (size_t)n * sizeof(float));
            r->sink_kept[il] = true;
        }
        drop = r->cfg->layer_type[il] == ATTN_SLIDING && r->ubatch_pos >= r->cfg->sliding_window;
        if (!drop) {
            ggml_backend_tensor_set(w, r->sink_saved[il], 0, (size_t)n * sizeof(float));
            return true;
        }
    }
    float x[KV_MAX_HEADS];
    float *big = n > KV_MAX_HEADS ? malloc((size_t)n * sizeof *big) : NULL;
    float *v = n > KV_MAX_HEADS ? big : x;
    if (!v)
        return rec_fail(r, "out of memory planting --fault");
    for (int64_t i = 0; i < n; i++)
        v[i] = -INFINITY;
    ggml_backend_tensor_set(w, v, 0, (size_t)n * sizeof *v);
    free(big);
    return true;
}

/* The node graph_fault changes, and its layer: the rotated key tail
 * ("k_pe-<il>", ROPE) or the K cache after this ubatch's rows are written
 * into it ("cache_k_l<il> (view)", SET_ROWS). */
static bool graph_fault_node(const recorder *r, const struct ggml_tensor *t, int *layer)
{
    char base[64];
    const char *name = ggml_get_name(t);
    if (r->graph_fault == GF_ROPE_TWICE) {
        *layer = split_name(name, base, sizeof base);
        return t->op == GGML_OP_ROPE && *layer >= 0 && !strcmp(base, "k_pe");
    }
    if (sink_fault(r->graph_fault)) {
        *layer = -1;
        return node_sinks(t) != NULL;
    }
    if (t->op != GGML_OP_SET_ROWS || strncmp(name, "cache_k_l", 9) ||
        !isdigit((unsigned char)name[9]))
        return false;
    *layer = atoi(name + 9);
    return true;
}

/* The tail turned once more by each row's position (t->src[1], the
 * positions ROPE read), with kvdiff's own tables of the config. */
static bool fault_rope_twice(recorder *r, struct ggml_tensor *t)
{
    const kv_config *c = r->cfg;
    const int dr = c->qk_rope_dim, half = dr / 2;
    const int64_t rows = ggml_nrows(t);
    const struct ggml_tensor *pos = t->src[1];
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[0] != dr || !pos ||
        pos->type != GGML_TYPE_I32 || ggml_nelements(pos) != rows || dr > KV_MAX_HEAD_DIM)
        return rec_fail(r, "--fault mla-rope-twice: %s is not the %d-wide f32 key tail it "
                           "expects", ggml_get_name(t), dr);
    float *x = malloc((size_t)ggml_nelements(t) * sizeof *x);
    int32_t *p = malloc((size_t)rows * sizeof *p);
    if (!x || !p) {
        free(x);
        free(p);
        return rec_fail(r, "out of memory planting --fault mla-rope-twice");
    }
    ggml_backend_tensor_get(t, x, 0, ggml_nbytes(t));
    ggml_backend_tensor_get(pos, p, 0, (size_t)rows * sizeof *p);
    double inv[KV_MAX_HEAD_DIM / 2];
    float cs[KV_MAX_HEAD_DIM / 2], sn[KV_MAX_HEAD_DIM / 2];
    config_rope_inv_freq(c, false, inv);
    const double m = config_rope_mscale(c, false);
    for (int64_t i = 0; i < rows; i++) {
        kern_rope_table_scaled((double)p[i], inv, dr, m, cs, sn);
        kern_rope_apply_pairs(x + i * dr, 1, dr, half, cs, sn);
    }
    ggml_backend_tensor_set(t, x, 0, ggml_nbytes(t));
    free(x);
    free(p);
    return true;
}

/* Bytes [from, from + len) of each cache row (cell) in [lo, hi) not
 * written by this ubatch (t->src[1]: the cells SET_ROWS wrote, I64 or
 * I32) set to 0, which is 0.0 in f32, f16 and bf16. */
static bool fault_zero_cells(recorder *r, struct ggml_tensor *t, int64_t lo, int64_t hi,
                             size_t from, size_t len)
{
    const struct ggml_tensor *idx = t->src[1];
    const int64_t n_idx = idx ? ggml_nelements(idx) : 0;
    if (!idx || (idx->type != GGML_TYPE_I64 && idx->type != GGML_TYPE_I32))
        return rec_fail(r, "--fault: %s has no row indices to read", ggml_get_name(t));
    int64_t *cells = malloc((size_t)(n_idx + 1) * sizeof *cells);
    unsigned char *zero = calloc(1, len);
    if (!cells || !zero) {
        free(cells);
        free(zero);
        return rec_fail(r, "out of memory planting --fault");
    }
    for (int64_t i = 0; i < n_idx; i++) {
        if (idx->type == GGML_TYPE_I64) {
            ggml_backend_tensor_get(idx, &cells[i], (size_t)i * sizeof(int64_t), sizeof(int64_t));
        } else {
            int32_t v;
            ggml_backend_tensor_get(idx, &v, (size_t)i * sizeof v, sizeof v);
            cells[i] = v;
        }
    }
    if (hi > t->ne[1])
        hi = t->ne[1];
    for (int64_t cell = lo; cell < hi; cell++) {
        bool written = false;
        for (int64_t i = 0; i < n_idx && !written; i++)
            written = cells[i] == cell;
        if (!written)
            ggml_backend_tensor_set(t, zero, (size_t)cell * t->nb[1] + from, len);
    }
    free(cells);
    free(zero);
    return true;
}

/* The planted change to node t of layer il (graph_fault_node's). */
static bool graph_fault_apply(recorder *r, struct ggml_tensor *t, int il)
{
    const kv_config *c = r->cfg;
    if (r->graph_fault == GF_ROPE_TWICE)
        return fault_rope_twice(r, t);
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16)
        return rec_fail(r, "--fault %s plants in an f32, f16 or bf16 cache, not %s",
                        r->graph_fault == GF_ROPE_UNCACHED ? "mla-rope-uncached"
                                                           : "mla-mixed-forms",
                        ggml_type_name(t->type));
    const size_t R = ggml_row_size(t->type, c->kv_lora_rank);
    const size_t W = ggml_row_size(t->type, c->kv_lora_rank + c->qk_rope_dim);
    (void)il;
    /* uncached: every earlier row loses its tail as its ubatch ends */
    if (r->graph_fault == GF_ROPE_UNCACHED)
        return fault_zero_cells(r, t, 0, t->ne[1], R, W - R);
    /* mixed forms: the first decode step finds the prompt's rows (cells
     * 0 .. n_prompt - 1 of a fresh single-sequence context) never
     * written: zero latents, zero tails, from then on */
    if (r->call_pos0 == r->n_prompt)
        return fault_zero_cells(r, t, 0, r->n_prompt, 0, W);
    return true;
}

/* cb_eval: ask = true, "do you want this node's data?"; ask = false, the
 * node is computed. Returning false from the second call stops the graph. */
static bool on_tensor(struct ggml_tensor *t, bool ask, void *user)
{
    recorder *r = user;
    if (r->failed)
        return !ask ? false : true;
    if (r->list) {
        if (ask)
            printf("%s %s %s [%lld %lld %lld %lld]\n", ggml_get_name(t), ggml_op_desc(t),
                   ggml_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1],
                   (long long)t->ne[2], (long long)t->ne[3]);
        return false;
    }
    /* sink-windowed's clock: the ubatch's position, from the positions a
     * ROPE node reads (inputs, set before the graph runs) */
    if (ask && r->graph_fault == GF_SINK_WINDOWED && t->op == GGML_OP_ROPE && t->src[1] &&
        t->src[1]->type == GGML_TYPE_I32 && ggml_nelements(t->src[1]) >= 1) {
        int32_t p0;
        ggml_backend_tensor_get(t->src[1], &p0, 0, sizeof p0);
        r->ubatch_pos = p0;
    }
    int gl;
    if (r->graph_fault && graph_fault_node(r, t, &gl)) {
        if (sink_fault(r->graph_fault)) {
            /* a weight the node reads, changed before it computes */
            r->graph_fault_hits++;
            if (!fault_sinks(r, t))
                return !ask ? false : true;
            return false;
        }
        if (ask)
            return true;
        r->graph_fault_hits++;
        return graph_fault_apply(r, t, gl);
    }
    if (r->paused)
        return !ask;
    mapping m = map_tensor(r, t);
    if (m.kind == MAP_NONE || !wanted(r, m.stage, m.layer))
        return false;
    if (ask)
        return true;
    if (m.kind == MAP_PLE)
        return emit_ple(r, t);
    const int cols = m.kind == MAP_Q_TAILS ? r->cfg->n_heads * r->cfg->qk_rope_dim
                                           : stage_cols(r, m.stage, m.layer);
    int64_t n = 0;
    if (!read_tensor(r, t, &n))
        return false;
    if (n % cols)
        return rec_fail(r, "tensor %s holds %lld values, not rows of %d (%s)", ggml_get_name(t),
                        (long long)n, cols, stage_name(m.stage));
    const int nrows = (int)(n / cols);
    const int il = m.layer;
    switch (m.kind) {
    case MAP_PENDING_V:
        return keep_pending(r, &r->v[il], r->buf, nrows, cols);
    case MAP_PENDING_Q:
        return keep_pending(r, &r->q[il], r->buf, nrows, cols);
    case MAP_Q_TAILS:
        return emit_q_tails(r, il, r->buf, nrows);
    case MAP_PENDING_PROJ:
        return keep_pending(r, &r->proj[il], r->buf, nrows, cols);
    default:
        break;
    }
    if (m.stage == STAGE_Q || m.stage == STAGE_K) {
        if (r->unpermute)
            unpermute_rows(r, r->buf, nrows, cols);
        if (m.stage == STAGE_Q && r->q_unfold != 1.0f)
            for (int64_t i = 0; i < n; i++)
                r->buf[i] /= r->q_unfold;
    }
    if (m.stage == STAGE_ATTN_OUT && r->rot_v)
        kern_hadamard_blocks(r->buf, (size_t)n, r->rot_v);
    /* Candidates that end with a later node are settled by an anchor. */
    if (m.stage == STAGE_ATTN_OUT && !flush_pending(r, &r->v[il], STAGE_V, il))
        return false;
    if (m.stage == STAGE_H_MID) {
        if (!flush_pending(r, &r->v[il], STAGE_V, il) ||
            !flush_pending(r, &r->proj[il], STAGE_ATTN_PROJ, il))
            return false;
    }
    if (!emit_rows(r, m.stage, il, r->buf, nrows))
        return false;
    if (m.stage == STAGE_KV_LATENT)   /* the expanded heads, from the row just cached */
        return mla_emit_kv(r, il, r->buf, nrows);
    /* A layer's input is the last one's output (the embedding for layer 0). */
    if (m.stage == STAGE_X_OUT && il + 1 < r->cfg->n_layers)
        return emit_rows(r, STAGE_X_IN, il + 1, r->buf, nrows);
    if (m.stage == STAGE_EMBED)
        return emit_rows(r, STAGE_X_IN, 0, r->buf, nrows);
    return true;
}

static void recorder_free(recorder *r)
{
    for (int l = 0; l < KV_MAX_LAYERS; l++) {
        free(r->k_b[l]);
        free(r->v_b[l]);
        free(r->v[l].rows);
        free(r->proj[l].rows);
        free(r->q[l].rows);
    }
    free(r->raw);
    free(r->buf);
    free(r->tmp);
}

/* ------------------------------------------------------------------ */
/* Prompt                                                               */

static int load_prompt(const rec_opts *o, int32_t **ids, int *n, kv_err *e)
{
    if (o->prompt_from) {
        dump_file *f = dump_open(o->prompt_from, e);
        if (!f)
            return -1;
        int64_t p = dump_prompt_length(f), total = dump_n_tokens(f);
        int32_t *all = p > 0 && total >= p ? malloc((size_t)total * sizeof *all) : NULL;
        int rc = 0;
        if (p <= 0 || total < p)
            rc = kv_errf(e, "%s: no prompt recorded", o->prompt_from);
        else if (!all)
            rc = kv_errf(e, "out of memory");
        else if (dump_read_tokens(f, all, e) < 0)
            rc = -1;
        dump_file_close(f);
        if (rc < 0) {
            free(all);
            return -1;
        }
        *ids = all;
        *n = (int)p;
        return 0;
    }
    return o->prompt_file ? tokens_load(o->prompt_file, 0, ids, n, e)
                          : tokens_parse(o->prompt_tokens, strlen(o->prompt_tokens),
                                         "--prompt-tokens", 0, ids, n, e);
}

/* ------------------------------------------------------------------ */
/* Running                                                              */

/* A failed GGML_ASSERT inside llama.cpp (a GGUF whose metadata it takes
 * but cannot compute with, e.g. a RoPE dimension count its rope op
 * rejects) calls abort(): exit 134 and a debugger's backtrace. ggml calls
 * this instead, on whichever thread failed; no C++ frame can be unwound
 * from here, so it says one line, removes the dump this run created (half
 * written, it is no result) and ends the process. */
static struct {
    const char *gguf;
    const char *dump;            /* set once this run created it */
} g_abort;

static void on_ggml_abort(const char *message)
{
    /* the first thread to fail speaks; any other waits for the exit */
    static atomic_flag said = ATOMIC_FLAG_INIT;
    if (atomic_flag_test_and_set(&said))
        for (;;)
            pause();
    char msg[600], line[1024];
    size_t n = 0;
    /* the source path of the build that failed, from its ggml/ on */
    const char *tail = message ? strstr(message, "ggml/src/") : NULL;
    if (tail)
        message = tail;
    for (const char *p = message ? message : ""; *p && n + 1 < sizeof msg; p++)
        msg[n++] = *p == '\n' || *p == '\r' ? ' ' : *p;
    while (n > 0 && msg[n - 1] == ' ')
        n--;
    msg[n] = '\0';
    if (g_abort.dump)
        unlink(g_abort.dump);
    int len = snprintf(line, sizeof line, TOOL ": %s: llama.cpp stopped on a failed internal "
                       "check (%s): it cannot run this model as the GGUF describes it%s\n",
                       g_abort.gguf ? g_abort.gguf : "the model", msg,
                       g_abort.dump ? "; no dump written" : "");
    if (len > 0)
        (void)!write(STDERR_FILENO, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
    _exit(2);
}

static volatile sig_atomic_t g_stop;   /* the signal that stopped the run, or 0 */
static void on_signal(int sig)
{
    g_stop = sig;
}

static const char *signal_name(int sig)
{
    return sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : sig == SIGTERM ? "SIGTERM"
                                                                                : "a signal";
}

/* What this tool printed must have reached its reader (--help, --time,
 * --list-tensors): a full disk or a closed pipe behind standard output is
 * exit 2, as in kvdiff, whichever path led to the exit. */
static void check_stdout(void)
{
    errno = 0;
    if (fflush(stdout) == 0 && !ferror(stdout))
        return;
    char line[200];
    int n = snprintf(line, sizeof line, TOOL ": cannot write to standard output: %s\n",
                     errno ? strerror(errno) : "write error");
    if (n > 0)
        (void)!write(STDERR_FILENO, line, (size_t)n < sizeof line ? (size_t)n : sizeof line - 1);
    _exit(2);
}

/* compute_dtype: llama.cpp's CPU backend keeps activations in f32 (with
 * bf16 weights its matmuls round their inputs to bf16, measured well
 * under the drift model's 4e-3 floor: docs/cross-runtime.md).
 * cache "dense" for every model: the context is made with swa_full (its
 * default, set anyway), so the sliding layers' cache has a cell for each
 * of the n_ctx positions as the full layers' does, nothing is evicted
 * and the window is a mask: kvdiff's dense cache, not a ring. */
static char *settings_json(const rec_opts *o, int n_ctx, int rot_k, int rot_v)
{
    char *s = malloc(2048);
    if (!s)
        return NULL;
    snprintf(s, 2048,
             "{\"runtime\":\"llama.cpp\",\"llama_cpp\":%s,\"chunk\":%d,\"cache\":\"dense\","
             "\"ubatch\":%d,"
             "\"batch\":%d,\"flash_attn\":\"%s\",\"cache_type\":\"%s\",\"compute_dtype\":\"f32\","
             "\"threads\":%d,"
             "\"max_ctx\":%d,\"attn_rot_k\":%d,\"attn_rot_v\":%d,\"recorder\":\"" TOOL " "
             KVDIFF_REC_VERSION "\"}",
             LLAMA_CPP_VERSION_JSON, o->ubatch, o->ubatch, o->batch,
             o->flash_attn ? "on" : "off", o->cache_name, o->threads, n_ctx, rot_k, rot_v);
    return s;
}

/* The line a finished recording ends with, on stderr beside the one a
 * partial dump gets (stdout carries only --time's seconds and
 * --list-tensors' names, which scripts read). The last generated token is
 * never run: one position fewer than the tokens is recorded. */
static void say_wrote(const char *path, int n_prompt, int n_generated, int n_layers)
{
    fprintf(stderr, TOOL ": wrote %s: %d positions x %d layers (%d prompt tokens, %d "
            "generated)\n", path, n_prompt + (n_generated > 0 ? n_generated - 1 : 0), n_layers,
            n_prompt, n_generated);
}

/* ------------------------------------------------------------------ */
/* Test aids: cache bugs planted inside llama.cpp                       */

/* kvdiff's key-set diagnoses must name bugs a runtime really makes, so the
 * tests make them in real llama.cpp through its public memory API
 * (docs/recorders.md). None is a llama.cpp setting: a dump recorded with
 * one says so in engine_settings ("fault"). */
typedef enum {
    FAULT_NONE,
    FAULT_ISOLATE_UBATCH,           /* earlier positions removed before each ubatch */
    FAULT_DROP_KEY,                 /* position pos removed after its ubatch */
    FAULT_DECODE_BLIND,             /* the prompt removed before the first decode step */
    FAULT_DUP_KEY,                  /* position pos decoded again as a second cell */
    FAULT_ROPE_OFFSET,              /* every token given to llama.cpp at position + pos */
    FAULT_GGML_ABORT,               /* ggml's abort in the first decode step */
    /* MLA (deepseek2): planted in the graph as it runs (graph_fault) */
    FAULT_MLA_ROPE_TWICE,           /* the key tail rotated once more before it is cached */
    FAULT_MLA_ROPE_UNCACHED,        /* cached rows keep no key tail past their ubatch */
    FAULT_MLA_MIXED_FORMS,          /* decode finds the prompt's latent rows never written */
    /* attention sinks (gpt-oss), in the graph too */
    FAULT_SINK_DROPPED,             /* no sink in any softmax */
    FAULT_SINK_PREFILL_ONLY,        /* decode steps' softmax without the sink */
    FAULT_SINK_WINDOWED             /* a sliding layer's sink leaves with key 0 */
} fault_kind;

typedef struct {
    fault_kind kind;
    int pos;
} fault;

static int parse_fault(const char *spec, int n_prompt, fault *f, kv_err *e)
{
    memset(f, 0, sizeof *f);
    if (!spec)
        return 0;
    char *end;
    if (!strcmp(spec, "isolate-ubatch")) {
        f->kind = FAULT_ISOLATE_UBATCH;
    } else if (!strcmp(spec, "decode-blind")) {
        f->kind = FAULT_DECODE_BLIND;
    } else if (!strcmp(spec, "ggml-abort")) {
        f->kind = FAULT_GGML_ABORT;
    } else if (!strcmp(spec, "mla-rope-twice")) {
        f->kind = FAULT_MLA_ROPE_TWICE;
    } else if (!strcmp(spec, "mla-rope-uncached")) {
        f->kind = FAULT_MLA_ROPE_UNCACHED;
    } else if (!strcmp(spec, "mla-mixed-forms")) {
        f->kind = FAULT_MLA_MIXED_FORMS;
    } else if (!strcmp(spec, "sink-dropped")) {
        f->kind = FAULT_SINK_DROPPED;
    } else if (!strcmp(spec, "sink-prefill-only")) {
        f->kind = FAULT_SINK_PREFILL_ONLY;
    } else if (!strcmp(spec, "sink-windowed")) {
        f->kind = FAULT_SINK_WINDOWED;
    } else if (!strncmp(spec, "drop-key=", 9) || !strncmp(spec, "dup-key=", 8)) {
        const bool drop = spec[1] == 'r';
        const char *v = spec + (drop ? 9 : 8);
        errno = 0;
        long p = strtol(v, &end, 10);
        if (errno || end == v || *end || p < 0 || p >= n_prompt)
            return kv_errf(e, "--fault %s: the position must be a prompt position, 0..%d", spec,
                           n_prompt - 1);
        f->kind = drop ? FAULT_DROP_KEY : FAULT_DUP_KEY;
        f->pos = (int)p;
    } else if (!strncmp(spec, "rope-offset=", 12)) {
        /* Positions shift alike, so every key set stays as it was and only
         * the rotation is wrong: what a runtime that counts positions from
         * the wrong origin does. */
        errno = 0;
        long k = strtol(spec + 12, &end, 10);
        if (errno || end == spec + 12 || *end || k < 1 || k > (1L << 20))
            return kv_errf(e, "--fault %s: the offset must be 1..%ld", spec, 1L << 20);
        f->kind = FAULT_ROPE_OFFSET;
        f->pos = (int)k;
    } else {
        return kv_errf(e, "--fault: '%s' is not isolate-ubatch, drop-key=P, decode-blind, "
                          "dup-key=P, rope-offset=K, ggml-abort, mla-rope-twice, "
                          "mla-rope-uncached, mla-mixed-forms, sink-dropped, "
                          "sink-prefill-only or sink-windowed", spec);
    }
    return 0;
}

/* Tokens per llama_decode call: a fault that acts between ubatches needs
 * each call to be one ubatch. */
static int fault_piece(const fault *f, int ubatch, int n_batch)
{
    return f->kind == FAULT_ISOLATE_UBATCH || f->kind == FAULT_DROP_KEY ? ubatch : n_batch;
}

/* The prompt's token at f->pos decoded once more, at the same position,
 * as sequence 1 (nothing recorded), and its cell then given to sequence
 * 0: the cache holds that key twice. Its first layer's key is the one
 * already there (same token, same position, no context before it). */
static int fault_dup(struct llama_context *ctx, recorder *r, const int32_t *ids, const fault *f)
{
    struct llama_batch b = llama_batch_init(1, 0, 1);
    b.n_tokens = 1;
    b.token[0] = ids[f->pos];
    b.pos[0] = f->pos;
    b.n_seq_id[0] = 1;
    b.seq_id[0][0] = 1;
    b.logits[0] = 1;
    r->paused = true;
    int rc = llama_decode(ctx, b);
    r->paused = false;
    llama_batch_free(b);
    if (rc != 0)
        return rc;
    llama_memory_t mem = llama_get_memory(ctx);
    llama_memory_seq_cp(mem, 1, 0, -1, -1);
    return llama_memory_seq_rm(mem, 1, -1, -1) ? 0 : -1;
}

/* Before the llama_decode call of n tokens at pos0. */
static int fault_before(struct llama_context *ctx, recorder *r, const fault *f,
                        const int32_t *ids, int n_prompt, int pos0)
{
    llama_memory_t mem = llama_get_memory(ctx);
    r->call_pos0 = pos0;   /* the graph faults' clock */
    if (f->kind == FAULT_ISOLATE_UBATCH && pos0 > 0)
        return llama_memory_seq_rm(mem, 0, 0, pos0) ? 0 : -1;
    if (f->kind == FAULT_DECODE_BLIND && pos0 == n_prompt)
        return llama_memory_seq_rm(mem, 0, 0, n_prompt) ? 0 : -1;
    if (f->kind == FAULT_DUP_KEY && pos0 == n_prompt)
        return fault_dup(ctx, r, ids, f);
    /* what llama.cpp does on a GGUF it cannot compute with (a failed
     * GGML_ASSERT), with the dump half written */
    if (f->kind == FAULT_GGML_ABORT && pos0 == n_prompt)
        GGML_ABORT("test aid: --fault ggml-abort");
    return 0;
}

/* After the llama_decode call of n tokens at pos0. */
static int fault_after(struct llama_context *ctx, const fault *f, int pos0, int n)
{
    if (f->kind == FAULT_DROP_KEY && f->pos >= pos0 && f->pos < pos0 + n)
        return llama_memory_seq_rm(llama_get_memory(ctx), 0, f->pos, f->pos + 1) ? 0 : -1;
    return 0;
}

static const char *fault_name(const fault *f, char *buf, size_t n)
{
    static const char *const names[] = {"", "isolate-ubatch", "drop-key", "decode-blind",
                                        "dup-key", "rope-offset", "ggml-abort",
                                        "mla-rope-twice", "mla-rope-uncached",
                                        "mla-mixed-forms", "sink-dropped",
                                        "sink-prefill-only", "sink-windowed"};
    if (f->kind == FAULT_DROP_KEY || f->kind == FAULT_DUP_KEY || f->kind == FAULT_ROPE_OFFSET)
        snprintf(buf, n, "%s=%d", names[f->kind], f->pos);
    else
        snprintf(buf, n, "%s", names[f->kind]);
    return buf;
}

/* engine_settings with the planted fault added, so that a dump says so. */
static char *settings_with_fault(char *settings, const fault *f)
{
    if (!settings || f->kind == FAULT_NONE)
        return settings;
    char name[64];
    const size_t n = strlen(settings) + 128;
    char *s = malloc(n);
    if (s && settings[0] == '{')
        snprintf(s, n, "{\"fault\":\"%s\",%s", fault_name(f, name, sizeof name), settings + 1);
    free(settings);
    return s;
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

static bool is_eos(const kv_config *c, const struct llama_vocab *vocab, int id, bool from_hf)
{
    if (from_hf) {
        for (int i = 0; i < c->n_eos; i++)
            if (c->eos_ids[i] == id)
                return true;
        return false;
    }
    return llama_vocab_is_eog(vocab, id);
}

/* What decode() needs to plant a test fault (f->kind FAULT_NONE: none). */
typedef struct {
    const fault *f;
    recorder *r;
    const int32_t *prompt;
    int n_prompt;
} fault_ctx;

/* Decodes tokens[0..n) at positions pos0.. in pieces of n_batch, every
 * row asking for logits (so the last layer keeps every row: llama.cpp
 * drops the rows without output there). fc: a test fault to plant, or
 * NULL. */
static int decode(struct llama_context *ctx, struct llama_batch *b, const int32_t *tokens, int n,
                  int pos0, int n_batch, const fault_ctx *fc)
{
    const int shift = fc && fc->f->kind == FAULT_ROPE_OFFSET ? fc->f->pos : 0;
    for (int i = 0; i < n; i += n_batch) {
        int k = n - i < n_batch ? n - i : n_batch;
        if (fc && fault_before(ctx, fc->r, fc->f, fc->prompt, fc->n_prompt, pos0 + i) != 0)
            return -101;
        b->n_tokens = k;
        for (int j = 0; j < k; j++) {
            b->token[j] = tokens[i + j];
            b->pos[j] = pos0 + i + j + shift;
            b->n_seq_id[j] = 1;
            b->seq_id[j][0] = 0;
            b->logits[j] = 1;
        }
        int rc = llama_decode(ctx, *b);
        if (rc != 0)
            return rc;
        if (fc && fault_after(ctx, fc->f, pos0 + i, k) != 0)
            return -101;
        if (g_stop)
            return -100;
    }
    return 0;
}

int main(int argc, char **argv)
{
    rec_opts o;
    atexit(check_stdout);
    outfile_clean_on_signal();
    outfile_track_inputs(true);   /* no output may replace a file this run read */
    if (parse_args(argc, argv, &o) < 0)
        return 2;
    g_log.verbose = o.verbose;
    llama_log_set(on_log, NULL);
    ggml_log_set(on_log, NULL);
    g_abort.gguf = o.gguf;
    ggml_set_abort_callback(on_ggml_abort);
    /* As kvdiff (harness/main.c): past a file-size limit writes fail with
     * EFBIG, said in one line, rather than SIGXFSZ killing the run; and
     * libhdf5's exit handler, which crashes closing a file whose last
     * flush failed, is not installed. */
    signal(SIGXFSZ, SIG_IGN);
    H5dont_atexit();

    kv_err e = {{0}};
    int status = 2;
    struct gguf_context *g = NULL;
    struct llama_model *model = NULL;
    struct llama_context *ctx = NULL;
    dump_writer *w = NULL;
    int32_t *ids = NULL;
    char *settings = NULL;
    struct llama_batch batch = {0};
    bool have_batch = false;
    recorder *r = calloc(1, sizeof *r);
    kv_config cfg, hf;
    fault flt = {FAULT_NONE, 0};
    double llama_scale = 0;
    int n_prompt = 0;
    if (!r) {
        fprintf(stderr, TOOL ": out of memory\n");
        return 2;
    }

    /* Everything that can be refused is refused before the dump exists.
     * First a regular file, checked without blocking: a FIFO or a device
     * at the model's name blocked gguf's open or read for ever. */
    FILE *mf = infile_open(o.gguf, 1LL << 50, &e);
    if (!mf) {
        fprintf(stderr, TOOL ": %s\n", e.msg);
        goto out;
    }
    fclose(mf);
    g = gguf_init_from_file(o.gguf, (struct gguf_init_params){.no_alloc = true, .ctx = NULL});
    if (!g) {
        FILE *f = fopen(o.gguf, "rb");
        if (!f)
            fprintf(stderr, TOOL ": %s: %s\n", o.gguf, strerror(errno));
        else
            fprintf(stderr, TOOL ": %s: not a readable GGUF file%s%s\n", o.gguf,
                    g_log.last_error[0] ? ": " : "", g_log.last_error);
        if (f)
            fclose(f);
        goto out;
    }
    if (config_from_gguf(g, o.gguf, &cfg, &llama_scale, &e) < 0)
        goto fail;
    if (o.hf_dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/config.json", o.hf_dir);
        if (config_load_json(path, &hf, &e) < 0 || config_check_same(&hf, &cfg, o.gguf, &e) < 0)
            goto fail;
        cfg = hf;
    }
    if (load_prompt(&o, &ids, &n_prompt, &e) < 0)
        goto fail;
    if (n_prompt <= 0) {
        kv_errf(&e, "the prompt is empty");
        goto fail;
    }
    if (parse_fault(o.fault, n_prompt, &flt, &e) < 0)
        goto fail;

    ggml_backend_load_all_from_path(getenv("KVDIFF_LLAMA_BACKENDS") ? getenv("KVDIFF_LLAMA_BACKENDS")
                                                                    : LLAMA_CPP_LIBDIR);
    if (ggml_backend_dev_count() == 0) {
        kv_errf(&e, "no ggml backend could be loaded from %s (set KVDIFF_LLAMA_BACKENDS to the "
                    "folder holding libggml-cpu*.so)",
                getenv("KVDIFF_LLAMA_BACKENDS") ? getenv("KVDIFF_LLAMA_BACKENDS") : LLAMA_CPP_LIBDIR);
        goto fail;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    /* a sink fault writes a weight: no read-only mapping of the file */
    if (flt.kind == FAULT_SINK_DROPPED || flt.kind == FAULT_SINK_PREFILL_ONLY ||
        flt.kind == FAULT_SINK_WINDOWED)
        mp.load_mode = LLAMA_LOAD_MODE_NONE;
    model = llama_model_load_from_file(o.gguf, mp);
    if (!model) {
        kv_errf(&e, "%s: llama.cpp could not load the model: %s", o.gguf,
                g_log.last_error[0] ? g_log.last_error : "(no reason given)");
        goto fail;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    r->V = llama_vocab_n_tokens(vocab);
    if (r->V <= 0) {
        kv_errf(&e, "%s: the model has no vocabulary size", o.gguf);
        goto fail;
    }
    if (!o.hf_dir) {
        /* The vocabulary size is llama.cpp's (the GGUF may not state it). */
        cfg.vocab = r->V;
        if (cfg.per_layer_dim > 0)
            cfg.per_layer_vocab = cfg.vocab;   /* llama.cpp's table has a row a token */
        if (config_validate(&cfg, &e) < 0) {
            kv_err_prefix(&e, o.gguf);
            goto fail;
        }
    } else if (cfg.vocab != r->V) {
        kv_errf(&e, "%s: vocab_size is %d in config.json but llama.cpp has %d tokens", o.gguf,
                cfg.vocab, r->V);
        goto fail;
    }
    for (int i = 0; i < n_prompt; i++)
        if (ids[i] < 0 || ids[i] >= r->V) {
            kv_errf(&e, "prompt token %d (id %d) is out of range: the vocabulary has %d ids", i,
                    ids[i], r->V);
            goto fail;
        }

    int n_ctx = o.ctx ? o.ctx : n_prompt + o.max_new;
    if (n_ctx < n_prompt + o.max_new) {
        kv_errf(&e, "--ctx %d holds fewer than the prompt and --max-new (%d)", n_ctx,
                n_prompt + o.max_new);
        goto fail;
    }
    r->cfg = &cfg;
    if (config_mla(&cfg) && mla_load_expansion(r, g, o.gguf, &e) < 0)
        goto fail;
    r->unpermute = llama_model_rope_type(model) == LLAMA_ROPE_TYPE_NORM;
    r->q_unfold = (float)(cfg.attn_scale / llama_scale);
    /* llama.cpp's own rule (llama-kv-cache.cpp): q/k blocks of the largest
     * power of two dividing head_dim, v blocks of 64; LLAMA_ATTN_ROT_DISABLE
     * turns both off. */
    const char *rot_off = getenv("LLAMA_ATTN_ROT_DISABLE");
    if (ggml_is_quantized(o.cache_type) && cfg.head_dim % 64 == 0 &&
        !(rot_off && atoi(rot_off))) {
        r->rot_v = 64;
        for (r->rot_k = 64; cfg.head_dim % (2 * r->rot_k) == 0;)
            r->rot_k *= 2;
    }
    r->list = o.list_tensors;
    r->graph_fault = flt.kind == FAULT_MLA_ROPE_TWICE      ? GF_ROPE_TWICE
                     : flt.kind == FAULT_MLA_ROPE_UNCACHED ? GF_ROPE_UNCACHED
                     : flt.kind == FAULT_MLA_MIXED_FORMS   ? GF_MIXED_FORMS
                     : flt.kind == FAULT_SINK_DROPPED      ? GF_SINK_DROPPED
                     : flt.kind == FAULT_SINK_PREFILL_ONLY ? GF_SINK_PREFILL_ONLY
                     : flt.kind == FAULT_SINK_WINDOWED     ? GF_SINK_WINDOWED
                                                           : GF_NONE;
    const bool sinks_planted = sink_fault(r->graph_fault);
    if (sinks_planted && !cfg.attn_sinks) {
        kv_errf(&e, "--fault %s: %s has no attention sinks", o.fault, o.gguf);
        goto fail;
    }
    if (r->graph_fault == GF_SINK_WINDOWED && o.ubatch != 1) {
        kv_errf(&e, "--fault sink-windowed decides per row: it needs --ubatch 1 (one token a "
                    "graph), not %d", o.ubatch);
        goto fail;
    }
    r->n_prompt = n_prompt;
    if (r->graph_fault && !sinks_planted && !config_mla(&cfg)) {
        kv_errf(&e, "--fault %s: %s has no latent (MLA) cache", o.fault, o.gguf);
        goto fail;
    }
    if (r->graph_fault && o.no_record) {
        kv_errf(&e, "--fault %s plants through the graph callback, which --no-record turns off",
                o.fault);
        goto fail;
    }

    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n_ctx;
    cp.n_batch = (uint32_t)o.batch;
    cp.n_ubatch = (uint32_t)o.ubatch;
    cp.n_threads = cp.n_threads_batch = o.threads;
    cp.flash_attn_type = o.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = cp.type_v = o.cache_type;
    cp.swa_full = true;   /* every position its own cell: engine_settings' dense cache */
    cp.cb_eval = o.no_record ? NULL : on_tensor;
    cp.cb_eval_user_data = o.no_record ? NULL : r;
    cp.no_perf = true;
    if (flt.kind == FAULT_DUP_KEY) {
        /* A second sequence in the same cells, and room for its cell. */
        cp.n_seq_max = 2;
        cp.kv_unified = true;
        cp.n_ctx += 1;
    }
    ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        kv_errf(&e, "llama.cpp refused the context (ubatch %d, batch %d, cache %s, flash "
                    "attention %s): %s", o.ubatch, o.batch, o.cache_name,
                o.flash_attn ? "on" : "off", g_log.last_error[0] ? g_log.last_error : "no reason given");
        goto fail;
    }
    int n_batch = (int)llama_n_batch(ctx);
    batch = llama_batch_init(n_batch, 0, 1);
    have_batch = true;

    if (o.list_tensors) {
        int rc = decode(ctx, &batch, ids, n_prompt < o.ubatch ? n_prompt : o.ubatch, 0, n_batch,
                        NULL);
        status = rc == 0 ? 0 : 2;
        if (rc)
            fprintf(stderr, TOOL ": llama_decode failed (%d)\n", rc);
        goto out;
    }

    if (o.no_record) {
        /* The same run with nothing watching it: what recording costs is
         * measured against this (bench/bench_llama.sh). */
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int rc = decode(ctx, &batch, ids, n_prompt, 0, n_batch, NULL);
        for (int step = 0; rc == 0 && step + 1 < o.max_new; step++) {
            int32_t next = argmax(llama_get_logits_ith(ctx, -1), r->V);
            rc = decode(ctx, &batch, &next, 1, n_prompt + step, n_batch, NULL);
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (rc != 0) {
            kv_errf(&e, "llama_decode failed (%d)", rc);
            goto fail;
        }
        if (o.timing)
            printf("%.3f\n", (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
        status = 0;
        goto out;
    }
    settings = settings_with_fault(settings_json(&o, n_ctx, r->rot_k, r->rot_v), &flt);
    dump_opts dopts;
    dump_opts_default(&dopts);
    dopts.full_logits = o.full_logits;
    if (o.stages && dump_parse_stages(o.stages, &dopts, &e) < 0)
        goto fail;
    dump_meta dm = {.engine = "llama.cpp", .engine_settings = settings, .cfg = &cfg,
                    .tool_version = TOOL " " KVDIFF_REC_VERSION,
                    .max_positions = n_prompt + o.max_new, .prompt_length = n_prompt};
    if (!settings) {
        kv_errf(&e, "out of memory");
        goto fail;
    }
    w = dump_create(o.out, &dm, &dopts, &e);
    if (!w)
        goto fail;
    g_abort.dump = o.out;
    dump_watch_flag(w, &g_stop);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);   /* a closed terminal stops it as Ctrl-C does */
    r->obs = dump_observer(w);

    const char *why = NULL;
    char whybuf[700];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < n_prompt && !why; i++)
        if (r->obs->token(r->obs, i, ids[i], 1))
            why = "the dump writer stopped the run";
    const fault_ctx fc = {.f = &flt, .r = r, .prompt = ids, .n_prompt = n_prompt};
    const fault_ctx *fcp = flt.kind != FAULT_NONE ? &fc : NULL;
    int rc = why ? 0 : decode(ctx, &batch, ids, n_prompt, 0,
                              fault_piece(&flt, (int)llama_n_ubatch(ctx), n_batch), fcp);
    int pos = n_prompt, n_gen = 0;
    for (int step = 0; !why && rc == 0 && step < o.max_new; step++) {
        int32_t next = argmax(llama_get_logits_ith(ctx, -1), r->V);
        if (r->obs->token(r->obs, pos, next, 0)) {
            why = "the dump writer stopped the run";
            break;
        }
        n_gen++;
        if (step + 1 == o.max_new || (!o.ignore_eos && is_eos(&cfg, vocab, next, o.hf_dir)))
            break;
        rc = decode(ctx, &batch, &next, 1, pos, n_batch, fcp);
        pos++;
    }
    if (!why && rc == 0 && r->graph_fault && r->graph_fault_hits == 0 && !r->failed) {
        /* a test aid that changed nothing must not pass for one that did */
        snprintf(whybuf, sizeof whybuf, "--fault %s found no node of llama.cpp's graph to "
                 "plant in", o.fault);
        why = whybuf;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (o.timing)
        printf("%.3f\n", (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
    char sigwhy[64];
    if (g_stop) {   /* first: the writer may have stopped the run because of it */
        snprintf(sigwhy, sizeof sigwhy, "interrupted by %s", signal_name(g_stop));
        why = sigwhy;
    } else if (!why && r->failed) {
        snprintf(whybuf, sizeof whybuf, "%s", r->err);
        why = whybuf;
    } else if (!why && rc == -101) {
        snprintf(whybuf, sizeof whybuf, "llama.cpp's memory refused the planted fault");
        why = whybuf;
    } else if (!why && rc != 0) {
        snprintf(whybuf, sizeof whybuf, "llama_decode failed (%d)%s%s", rc,
                 g_log.last_error[0] ? ": " : "", g_log.last_error);
        why = whybuf;
    }
    for (int l = 0; !why && l < cfg.n_layers; l++)
        if (r->v[l].nrows || r->proj[l].nrows) {
            snprintf(whybuf, sizeof whybuf, "layer %d: v or attn_proj rows without the node "
                     "after them (an unknown graph)", l);
            why = whybuf;
        }
    if (!why && dump_error(w)) {
        snprintf(whybuf, sizeof whybuf, "%s", dump_error(w));
        why = whybuf;
    }
    if (dump_close(w, why, &e) < 0) {
        w = NULL;
        goto fail;
    }
    w = NULL;
    if (why) {
        fprintf(stderr, TOOL ": %s: %s (the dump is marked partial)\n", o.out, why);
        if (g_stop)   /* as kvdiff run: 128 + the signal */
            status = 128 + g_stop;
        goto out;
    }
    say_wrote(o.out, n_prompt, n_gen, cfg.n_layers);
    status = 0;
    goto out;

fail:
    fprintf(stderr, TOOL ": %s\n", e.msg);
out:
    if (w) {
        kv_err ce;
        dump_close(w, "aborted", &ce);
    }
    if (have_batch)
        llama_batch_free(batch);
    if (ctx)
        llama_free(ctx);
    if (model)
        llama_model_free(model);
    if (g)
        gguf_free(g);
    recorder_free(r);
    free(r);
    free(ids);
    free(settings);
    return status;
}
