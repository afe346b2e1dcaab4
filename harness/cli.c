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
    /* Not an error (the run reproduces what the checkpoint computes), but
     * no one should read its NaN rows without knowing where they come from. */
    if (m->nonfinite_tensors > 1)
        fprintf(stderr, "kvdiff: warning: %s, and %d more tensors hold some; rows computed "
                        "from them can be NaN or infinite\n", m->nonfinite_first,
                m->nonfinite_tensors - 1);
    else if (m->nonfinite_tensors == 1)
        fprintf(stderr, "kvdiff: warning: %s; rows computed from it can be NaN or infinite\n",
                m->nonfinite_first);
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

int cli_make_prompt(const cli_prompt_opts *p, int vocab, int32_t **ids, int *n, kv_err *e)
{
    int given = (p->tokens != NULL) + (p->file != NULL) + (p->random_len > 0);
    if (given > 1)
        return kv_errf(e, "give one of --prompt-tokens, --prompt-file, --prompt-random");
    if (p->tokens)
        return tokens_parse(p->tokens, strlen(p->tokens), "--prompt-tokens", vocab, ids, n, e);
    if (p->file)
        return tokens_load(p->file, vocab, ids, n, e);
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
