/* cli.c — option helpers shared by the verbs (cli.h). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "../model/pcg32.h"
#include "../model/tokens.h"

int cli_int(const char *opt, const char *s, long lo, long hi, long *out, kv_err *e)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end)
        return kv_errf(e, "%s: '%s' is not an integer", opt, s);
    if (v < lo || v > hi)
        return kv_errf(e, "%s: %ld is outside %ld..%ld", opt, v, lo, hi);
    *out = v;
    return 0;
}

int cli_u64(const char *opt, const char *s, uint64_t *out, kv_err *e)
{
    char *end;
    errno = 0;
    if (*s == '-')
        return kv_errf(e, "%s: '%s' must be a non-negative integer", opt, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end)
        return kv_errf(e, "%s: '%s' is not a non-negative integer", opt, s);
    *out = v;
    return 0;
}

int cli_double(const char *opt, const char *s, double lo, double hi, double *out, kv_err *e)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return kv_errf(e, "%s: '%s' is not a number", opt, s);
    if (v < lo || v > hi)
        return kv_errf(e, "%s: %g is outside %g..%g", opt, v, lo, hi);
    *out = v;
    return 0;
}

void cli_model_defaults(cli_model_opts *o)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    memset(o, 0, sizeof *o);
    o->model = "tiny-gemma3";
    o->wtype = -1;
    o->threads = n < 1 ? 1 : n > 64 ? 64 : (int)n;
    o->isa = kern_isa_best();
}

int cli_model_option(cli_model_opts *o, const char *name, const char *val, kv_err *e)
{
    long v;
    if (!strcmp(name, "model")) {
        o->model = val;
    } else if (!strcmp(name, "weights-seed")) {
        if (cli_u64("--weights-seed", val, &o->weights_seed, e) < 0)
            return -1;
    } else if (!strcmp(name, "dtype")) {
        if (!strcmp(val, "f32"))
            o->wtype = KERN_F32;
        else if (!strcmp(val, "bf16"))
            o->wtype = KERN_BF16;
        else
            return kv_errf(e, "--dtype: '%s' is not f32 or bf16", val);
    } else if (!strcmp(name, "threads")) {
        if (cli_int("--threads", val, 1, 256, &v, e) < 0)
            return -1;
        o->threads = (int)v;
    } else if (!strcmp(name, "isa")) {
        if (!strcmp(val, "auto"))
            o->isa = kern_isa_best();
        else if (kern_isa_parse(val, &o->isa) < 0)
            return kv_errf(e, "--isa: '%s' is not auto, scalar, avx2 or avx512", val);
        else if (o->isa > kern_isa_best())
            return kv_errf(e, "--isa: this CPU does not support %s", val);
    } else {
        return 0;
    }
    return 1;
}

int cli_open_model(const cli_model_opts *o, kv_model *m, kern_ctx *kc, kv_err *e)
{
    model_opts mo = {.wtype = o->wtype};
    memset(kc, 0, sizeof *kc);
    if (model_open(o->model, o->weights_seed, &mo, m, e) < 0)
        return -1;
    kc->isa = o->isa;
    kc->pool = o->threads > 1 ? pool_create(o->threads) : NULL;
    if (o->threads > 1 && !kc->pool) {
        model_free(m);
        return kv_errf(e, "cannot start %d threads", o->threads);
    }
    return 0;
}

void cli_close_model(kv_model *m, kern_ctx *kc)
{
    pool_free(kc->pool);
    kc->pool = NULL;
    model_free(m);
}

int cli_open_tokenizer(const char *verb, const cli_model_opts *mo, const kv_model *m,
                       kv_tokenizer **tok, kv_err *e)
{
    *tok = NULL;
    /* A folder may carry a vocabulary; presets have none. */
    if (strcmp(m->source, mo->model) != 0)
        return 0;
    if (tok_load(mo->model, tok, e) < 0)
        return -1;
    char note[1024];
    if (tok_check_vocab(*tok, m->cfg.vocab, note, sizeof note, e) < 0) {
        tok_free(*tok);
        *tok = NULL;
        return -1;
    }
    if (note[0])
        fprintf(stderr, "kvdiff %s: note: %s\n", verb, note);
    return 0;
}

/* The whole file, byte for byte (a final newline is part of the text). */
static int read_text(const char *path, char **text, size_t *len, kv_err *e)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return kv_errf(e, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 12, n = 0;
    char *p = malloc(cap);
    while (p) {
        n += fread(p + n, 1, cap - n, f);
        if (n < cap || ferror(f))
            break;
        char *q = cap < (1u << 26) ? realloc(p, cap * 2) : NULL;
        if (!q) {
            free(p);
            fclose(f);
            return kv_errf(e, "%s: larger than 64 MiB", path);
        }
        p = q;
        cap *= 2;
    }
    int bad = !p || ferror(f);
    fclose(f);
    if (bad) {
        free(p);
        return kv_errf(e, "%s: cannot read: %s", path, p ? strerror(errno) : "out of memory");
    }
    *text = p;
    *len = n;
    return 0;
}

static int encode_prompt(const char *opt, const char *text, size_t len,
                         const cli_model_opts *mo, const kv_model *m, const kv_tokenizer *tok,
                         int32_t **ids, int *n, kv_err *e)
{
    if (!tok && strcmp(m->source, mo->model) != 0)
        return kv_errf(e, "%s: text needs the model folder's tokenizer.json and preset '%s' "
                       "has none; give ids with --prompt-tokens or --prompt-ids-file", opt,
                       mo->model);
    if (!tok)
        return kv_errf(e, "%s: text needs a tokenizer.json and %s has none; give ids with "
                       "--prompt-tokens or --prompt-ids-file", opt, mo->model);
    if (tok_encode(tok, text, len, 1, ids, n, e) < 0)
        return kv_err_prefix(e, opt);
    for (int i = 0; i < *n; i++) {
        if ((*ids)[i] >= m->cfg.vocab) {
            char piece[64] = "";
            tok_decode(tok, (*ids)[i], piece, sizeof piece);
            kv_errf(e, "%s: the text holds token %d \"%s\", past the model's %d ids", opt,
                    (*ids)[i], piece, m->cfg.vocab);
            free(*ids);
            *ids = NULL;
            return -1;
        }
    }
    if (*n == 0) {
        free(*ids);
        *ids = NULL;
        return kv_errf(e, "%s: the text makes no tokens; a prompt needs at least one", opt);
    }
    return 0;
}

int cli_make_prompt(const cli_prompt_opts *p, const cli_model_opts *mo, const kv_model *m,
                    const kv_tokenizer *tok, int32_t **ids, int *n, kv_err *e)
{
    int vocab = m->cfg.vocab;
    int given = (p->tokens != NULL) + (p->ids_file != NULL) + (p->text != NULL) +
                (p->text_file != NULL) + (p->random_len > 0);
    if (given > 1)
        return kv_errf(e, "give one of --prompt-text, --prompt-file, --prompt-tokens, "
                          "--prompt-ids-file, --prompt-random");
    if (p->tokens)
        return tokens_parse(p->tokens, strlen(p->tokens), "--prompt-tokens", vocab, ids, n, e);
    if (p->ids_file)
        return tokens_load(p->ids_file, vocab, ids, n, e);
    if (p->text)
        return encode_prompt("--prompt-text", p->text, strlen(p->text), mo, m, tok, ids, n, e);
    if (p->text_file) {
        char *text = NULL;
        size_t len = 0;
        if (read_text(p->text_file, &text, &len, e) < 0)
            return -1;
        char opt[600];
        snprintf(opt, sizeof opt, "--prompt-file %s", p->text_file);
        int rc = encode_prompt(opt, text, len, mo, m, tok, ids, n, e);
        free(text);
        return rc;
    }
    long len = p->random_len > 0 ? p->random_len : 32;
    int32_t *out = malloc((size_t)len * sizeof *out);
    if (!out)
        return kv_errf(e, "out of memory for a prompt of %ld tokens", len);
    pcg32 r;
    pcg32_seed(&r, p->seed, 0x70); /* the prompt's stream; sampling uses another */
    for (long i = 0; i < len; i++)
        out[i] = (int32_t)pcg32_bounded(&r, (uint32_t)vocab);
    *ids = out;
    *n = (int)len;
    return 0;
}

void cli_error(const char *verb, const kv_err *e)
{
    fprintf(stderr, "kvdiff %s: %s\n", verb, e->msg);
}

void cli_print_ids(FILE *f, const int32_t *ids, int n)
{
    for (int i = 0; i < n; i++)
        fprintf(f, "%s%d", i ? " " : "", ids[i]);
}
