/* cli.c — option helpers shared by the verbs (cli.h). */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "progress.h"
#include "../model/outfile.h"
#include "../model/pcg32.h"
#include "../model/text.h"
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

int cli_tolerance_conflict(const char *name, const char **state, kv_err *e)
{
    static const char *const tols[] = {"atol", "rtol", "ulp"};
    const bool exact = !strcmp(name, "exact");
    bool tol = false;
    for (int i = 0; i < 3; i++)
        tol = tol || !strcmp(name, tols[i]);
    if (!exact && !tol)
        return 0;
    /* *state: "exact" once --exact came, else the first tolerance seen */
    if (*state && (exact ? strcmp(*state, "exact") != 0 : !strcmp(*state, "exact")))
        return kv_errf(e, "--exact and --%s: --exact means no tolerance; give one or the "
                          "other", exact ? *state : name);
    if (!*state || exact)
        *state = exact ? "exact" : name;
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
        size_t n = strlen(val);
        o->model = val;
        if (n > 1 && val[n - 1] == '/' && n < sizeof o->model_dir) {
            /* "dir/" -> "dir" only where model_open still sees a folder;
             * a missing one is refused in cli_open_model */
            struct stat sb;
            cli_dir(o->model_dir, sizeof o->model_dir, val);
            if (strchr(o->model_dir, '/') ||
                (stat(o->model_dir, &sb) == 0 && S_ISDIR(sb.st_mode)))
                o->model = o->model_dir;
        }
    } else if (!strcmp(name, "weights-seed")) {
        if (cli_u64("--weights-seed", val, &o->weights_seed, e) < 0)
            return -1;
        o->weights_seed_given = true;
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

void cli_model_progress(void *ctx, int64_t done, int64_t total, const char *tensor)
{
    progress *p = ctx;
    /* Millions of weights for real models, thousands for tiny ones (whose
     * bar flashes by, but should not read "0/1"). */
    double unit = total >= 10000000 ? 1e6 : 1e3;
    snprintf(p->label, sizeof p->label, "%s", unit == 1e6 ? "M weights" : "k weights");
    p->total = lround((double)total / unit);   /* known once the catalogue is */
    progress_stepf(p, (double)done / unit, tensor);
}

int cli_open_model(const cli_model_opts *o, kv_model *m, kern_ctx *kc, kv_err *e)
{
    /* A large preset's weights take seconds to draw (a checkpoint's to
     * load): a terminal sees which tensor is being made. */
    memset(kc, 0, sizeof *kc);
    /* The pool first: loading converts and packs on every thread too. */
    kc->isa = o->isa;
    kc->pool = o->threads > 1 ? pool_create(o->threads) : NULL;
    if (o->threads > 1 && !kc->pool)
        return kv_errf(e, "cannot start %d threads", o->threads);
    progress bar;
    progress_start(&bar, stderr, "", 0);   /* counted once the catalogue is read */
    progress_phase(&bar, "weights");
    model_opts mo = {.wtype = o->wtype, .progress = cli_model_progress, .progress_ctx = &bar,
                     .pool = kc->pool};
    struct stat sb;
    /* model_open's own test of a folder */
    bool folder = strchr(o->model, '/') || (stat(o->model, &sb) == 0 && S_ISDIR(sb.st_mode));
    if (folder && stat(o->model, &sb) != 0) {
        progress_end(&bar);
        pool_free(kc->pool);
        kc->pool = NULL;
        return kv_errf(e, "--model %s: %s (a model is a preset name or a Hugging Face "
                          "folder)", o->model, strerror(errno));
    }
    if (folder && o->weights_seed_given) {
        progress_end(&bar);
        pool_free(kc->pool);
        kc->pool = NULL;
        return kv_errf(e, "--weights-seed: --model %s is a folder, whose weights are its "
                          "files; --weights-seed draws a preset's weights (kvdiff gen "
                          "--help lists the presets)", o->model);
    }
    int rc = model_open(o->model, o->weights_seed, &mo, m, e);
    progress_end(&bar);
    if (rc < 0) {
        pool_free(kc->pool);      /* model_open left m empty */
        kc->pool = NULL;
        return -1;
    }
    /* Not an error (the run reproduces what the checkpoint computes), but
     * no one should read its NaN rows without knowing where they come from. */
    if (m->nonfinite_tensors > 1)
        fprintf(stderr, "kvdiff: warning: %s, and %d more tensors hold some; rows computed "
                        "from them can be NaN or infinite\n", m->nonfinite_first,
                m->nonfinite_tensors - 1);
    else if (m->nonfinite_tensors == 1)
        fprintf(stderr, "kvdiff: warning: %s; rows computed from it can be NaN or infinite\n",
                m->nonfinite_first);
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
    if (tok_encode_prompt(tok, text, len, m->cfg.vocab, m->cfg.max_positions, ids, n, e) < 0)
        return kv_err_prefix(e, opt);
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
        if (tok_read_text(p->text_file, &text, &len, e) < 0)
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
    /* Messages quote file contents (attributes, suite values): one line,
     * nothing the terminal would act on. */
    fprintf(stderr, "kvdiff %s: ", verb);
    cli_fputs_escaped(e->msg, stderr, false);
    fputc('\n', stderr);
}

void cli_usage_error(const char *verb, const kv_err *e)
{
    fprintf(stderr, "kvdiff %s: ", verb);
    cli_fputs_escaped(e->msg, stderr, false);
    fprintf(stderr, "; see kvdiff %s --help\n", verb);
}

void cli_json_error(const char *verb, const kv_err *e, int code)
{
    json_t *j = json_pack("{ss ss ss si}", "schema", "kvdiff-error/1", "verb", verb, "error",
                          e->msg, "exit_code", code);
    /* json_pack refuses a message that is not UTF-8: say so in ASCII */
    if (!j)
        j = json_pack("{ss ss ss si}", "schema", "kvdiff-error/1", "verb", verb, "error",
                      "(the message is not valid UTF-8; see stderr)", "exit_code", code);
    char *text = j ? json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER) : NULL;
    if (text)
        printf("%s\n", text);
    free(text);
    json_decref(j);
}

int cli_getopt_error(int ch, char **argv, kv_err *e)
{
    /* A short option names itself in optopt; a long one is the argument
     * getopt just stepped over. */
    char name[256];
    const char *prev = optind > 0 ? argv[optind - 1] : NULL;
    if (prev && !strncmp(prev, "--", 2))
        snprintf(name, sizeof name, "%s", prev);
    else if (optopt)
        snprintf(name, sizeof name, "-%c", optopt);
    else
        snprintf(name, sizeof name, "%s", prev ? prev : "?");
    char *eq = strchr(name, '=');
    if (eq && name[0] == '-' && name[1] == '-')
        *eq = 0;
    if (ch == ':')
        return kv_errf(e, "option '%s' needs a value", name);
    return kv_errf(e, "unknown option '%s'", name);
}

char *cli_join(char *buf, size_t n, const char *dir, const char *name)
{
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/')
        len--;
    while (*name == '/')
        name++;
    snprintf(buf, n, "%.*s%s%s", (int)len, dir, len && dir[len - 1] == '/' ? "" : "/", name);
    return buf;
}

char *cli_dir(char *buf, size_t n, const char *dir)
{
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/')
        len--;
    snprintf(buf, n, "%.*s", (int)len, dir);
    return buf;
}

void cli_print_ids(FILE *f, const int32_t *ids, int n)
{
    for (int i = 0; i < n; i++)
        fprintf(f, "%s%d", i ? " " : "", ids[i]);
}

/* ------------------------------------------------------------------ */
/* Text from files, to a terminal                                       */

char *cli_escape(char *dst, size_t n, const char *s, bool keep_newlines)
{
    return kv_escape(dst, n, s, keep_newlines);
}

void cli_fputs_escaped(const char *s, FILE *f, bool keep_newlines)
{
    kv_fputs_escaped(s, f, keep_newlines);
}

/* ------------------------------------------------------------------ */
/* Outputs that must not be inputs                                     */

/* The folder of path, whose last '/' is slash (NULL: none): ".", "/" or
 * the part before it. */
void cli_parent_dir(const char *path, const char *slash, char *dir, size_t n)
{
    if (!slash)
        snprintf(dir, n, ".");
    else if (slash == path)
        snprintf(dir, n, "/");
    else
        snprintf(dir, n, "%.*s", (int)(slash - path), path);
}

int cli_output_not_input(const char *out_opt, const char *out, const char *in_opt,
                         const char *in, kv_err *e)
{
    if (!out || !in || !outfile_same(out, in))
        return 0;
    return kv_errf(e, "%s %s: is the same file as %s %s; refusing to overwrite it", out_opt,
                   out, in_opt, in);
}

static bool model_file_name(const char *name)
{
    size_t n = strlen(name);
    return (n >= 5 && !strcmp(name + n - 5, ".json")) ||
           (n >= 12 && !strcmp(name + n - 12, ".safetensors"));
}

int cli_output_not_model_file(const char *out_opt, const char *out, const char *dir,
                              kv_err *e)
{
    DIR *d = out && dir ? opendir(dir) : NULL;
    if (!d)
        return 0;
    int rc = 0;
    for (struct dirent *de; rc == 0 && (de = readdir(d));) {
        if (!model_file_name(de->d_name))
            continue;
        char in[PATH_MAX + 256];
        snprintf(in, sizeof in, "%s/%s", dir, de->d_name);
        if (outfile_same(out, in))
            rc = kv_errf(e, "%s %s: is %s of --model %s; refusing to overwrite it", out_opt,
                         out, de->d_name, dir);
    }
    closedir(d);
    return rc;
}

int cli_output_writable(const char *opt, const char *path, kv_err *e)
{
    struct stat sb;
    if (!*path)
        return kv_errf(e, "%s: empty file name", opt);
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        return kv_errf(e, "%s %s: is a folder, not a file", opt, path);
    const char *slash = strrchr(path, '/');
    char dir[PATH_MAX];
    cli_parent_dir(path, slash, dir, sizeof dir);
    if (slash && !slash[1])
        return kv_errf(e, "%s %s: names a folder, not a file", opt, path);
    if (stat(dir, &sb) != 0)
        return kv_errf(e, "%s %s: folder %s: %s", opt, path, dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return kv_errf(e, "%s %s: %s is not a folder", opt, path, dir);
    if (access(dir, W_OK | X_OK) != 0)
        return kv_errf(e, "%s %s: folder %s is not writable", opt, path, dir);
    return 0;
}
