/* suite.c — the suite file parser (suite.h, docs/suite-format.md).
 *
 * inih splits the INI text; this file checks every key as it arrives and
 * keeps the first problem with its line. inih does not hand line numbers to
 * the handler, so the text is fed through our own line reader, which counts
 * lines, spots section headings (inih does not report a heading without
 * keys) and refuses lines longer than inih's buffer (inih would silently
 * cut them in two). After the pass, [defaults] fills what cases leave out
 * and every case must be complete. */
#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "suite.h"
#include "../model/infile.h"
#include "../chunked/chunked.h"
#include "../model/observer.h"
#include "../model/config.h"
#include "../model/tokenizer.h"
#include "../model/tokens.h"

#define SUITE_MAX_FILE (4u << 20)
#define SUITE_MAX_NAME 48

/* ------------------------------------------------------------------ */
/* Small helpers                                                        */

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static int parse_long(const char *what, const char *s, long lo, long hi, long *out, kv_err *e)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end)
        return kv_errf(e, "%s: '%s' is not an integer", what, s);
    if (v < lo || v > hi)
        return kv_errf(e, "%s: %ld is outside %ld..%ld", what, v, lo, hi);
    *out = v;
    return 0;
}

static int parse_u64(const char *what, const char *s, uint64_t *out, kv_err *e)
{
    char *end;
    errno = 0;
    if (*s < '0' || *s > '9')
        return kv_errf(e, "%s: '%s' is not a non-negative integer", what, s);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end)
        return kv_errf(e, "%s: '%s' is not a non-negative integer", what, s);
    *out = v;
    return 0;
}

static int parse_positive(const char *what, const char *s, double *out, kv_err *e)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v > 0) || v > 1e30)
        return kv_errf(e, "%s: '%s' is not a positive number", what, s);
    *out = v;
    return 0;
}

void suite_argv_free(char **argv)
{
    if (!argv)
        return;
    for (char **a = argv; *a; a++)
        free(*a);
    free(argv);
}

/* Splits on spaces and tabs into a NULL-terminated argv. */
static int split_words(const char *text, char ***argv, int *argc, kv_err *e)
{
    size_t len = strlen(text);
    char **out = calloc(len / 2 + 2, sizeof *out);
    int n = 0;
    if (!out)
        return kv_errf(e, "out of memory");
    for (size_t i = 0; i < len;) {
        while (i < len && (text[i] == ' ' || text[i] == '\t'))
            i++;
        size_t start = i;
        while (i < len && text[i] != ' ' && text[i] != '\t')
            i++;
        if (i == start)
            break;
        out[n] = malloc(i - start + 1);
        if (!out[n]) {
            suite_argv_free(out);
            return kv_errf(e, "out of memory");
        }
        memcpy(out[n], text + start, i - start);
        out[n++][i - start] = 0;
    }
    *argv = out;
    *argc = n;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Expectations                                                         */

static const char *const inj_diagnosis[INJ_COUNT] = {
    [INJ_ISOLATED_CHUNKS] = "chunk_isolated",
    /* Restarted positions rotate q for another position first. */
    [INJ_ISOLATED_CHUNKS_POS] = "rope_offset",
    [INJ_WINDOW] = "window",
    [INJ_STALE_LOCAL] = "stale_cache",
    [INJ_ZERO_SHARED_KV] = "zero_kv",
    [INJ_SPLIT_MASK_OFF_BY_ONE] = "extra_key",
    [INJ_DECODE_INDEX_STUCK] = "decode_index_stuck",
    [INJ_ROPE_OFFSET] = "rope_offset",
    [INJ_RING_NO_WRAP] = "ring_no_wrap",
    [INJ_SPLIT_DECODE_BLIND] = "split_decode_blind",
    [INJ_DROP_KEY] = "missing_key",
    [INJ_OWN_KEY_MASKED] = "own_key_masked",
    [INJ_ISOLATED_LAYER] = "chunk_isolated",
    [INJ_SINK_DROPPED] = "attention_sink",
    [INJ_SINK_PREFILL_ONLY] = "attention_sink",
    [INJ_SINK_WINDOWED] = "attention_sink",
    [INJ_MLA_ROPE_TWICE] = "latent_cache",
    [INJ_MLA_ROPE_UNCACHED] = "latent_cache",
    [INJ_MLA_NO_MSCALE] = "latent_cache",
    [INJ_MLA_MIXED_FORMS] = "latent_cache",
};

const char *suite_injection_diagnosis(int injection)
{
    return injection >= 0 && injection < INJ_COUNT ? inj_diagnosis[injection] : "?";
}

/* The injection named by word (its =VALUE or @LAYER, if any, ignored); -1 if none. */
static int injection_index(const char *word)
{
    size_t n = strcspn(word, "=@");
    for (int i = 0; i < INJ_COUNT; i++) {
        const char *name = chk_injection_name((chk_injection)i);
        if (strlen(name) == n && !strncmp(name, word, n))
            return i;
    }
    return -1;
}

static int parse_within(char **w, int n, suite_expect *x, kv_err *e)
{
    bool seen[3] = {false, false, false};
    if (n < 2)
        return kv_errf(e, "'within' needs a tolerance: within rtol=1e-4 (atol=, ulp= too)");
    for (int i = 1; i < n; i++) {
        char *eq = strchr(w[i], '=');
        int k = !eq ? -1 : !strncmp(w[i], "atol=", 5) ? 0 : !strncmp(w[i], "rtol=", 5) ? 1
              : !strncmp(w[i], "ulp=", 4) ? 2 : -1;
        if (k < 0)
            return kv_errf(e, "'%s' is not atol=X, rtol=X or ulp=N", w[i]);
        if (seen[k])
            return kv_errf(e, "'%.*s' is given twice", (int)(eq - w[i]), w[i]);
        seen[k] = true;
        long u;
        if (k == 0 && parse_positive("atol", eq + 1, &x->atol, e) < 0)
            return -1;
        if (k == 1 && parse_positive("rtol", eq + 1, &x->rtol, e) < 0)
            return -1;
        if (k == 2) {
            if (parse_long("ulp", eq + 1, 1, LONG_MAX, &u, e) < 0)
                return -1;
            x->ulp = (uint64_t)u;
        }
    }
    x->kind = SUITE_EXPECT_WITHIN;
    return 0;
}

static int parse_detects(char **w, int n, suite_expect *x, kv_err *e)
{
    static const char *const usage = "detects INJECTION at layer L position P stage S";
    if (n != 9 || strcmp(w[2], "at"))
        return kv_errf(e, "expected '%s'", usage);
    x->injection = injection_index(w[1]);
    if (x->injection < 0)
        return kv_errf(e, "'%s' is not an injection (kvdiff run --list-injections)", w[1]);
    bool seen[3] = {false, false, false};
    for (int i = 3; i < n; i += 2) {
        const char *key = w[i], *val = w[i + 1];
        int k = !strcmp(key, "layer") ? 0 : !strcmp(key, "position") ? 1
              : !strcmp(key, "stage") ? 2 : -1;
        if (k < 0)
            return kv_errf(e, "'%s' is not layer, position or stage (%s)", key, usage);
        if (seen[k])
            return kv_errf(e, "'%s' is given twice", key);
        seen[k] = true;
        long v;
        if (k == 0) {
            if (parse_long("layer", val, 0, KV_MAX_LAYERS - 1, &v, e) < 0)
                return -1;
            x->layer = (int)v;
        } else if (k == 1) {
            if (parse_long("position", val, 0, 1L << 30, &v, e) < 0)
                return -1;
            x->pos = v;
        } else {
            int st = stage_parse(val);
            if (st < 0 || st >= STAGE_LAYER_COUNT)
                return kv_errf(e, "stage: '%s' is not a layer stage (x_in, q, k, v, attn_lse, "
                               "attn_out, x_out, ...)", val);
            x->stage = st;
        }
    }
    x->kind = SUITE_EXPECT_DETECTS;
    return 0;
}

int suite_parse_expect(const char *text, suite_expect *x, kv_err *e)
{
    char **w = NULL;
    int n = 0, rc;
    memset(x, 0, sizeof *x);
    if (split_words(text, &w, &n, e) < 0)
        return -1;
    if (n == 0)
        rc = kv_errf(e, "empty expectation (identical, no-bug, within ..., detects ...)");
    else if (!strcmp(w[0], "identical"))
        rc = n == 1 ? (x->kind = SUITE_EXPECT_IDENTICAL, 0)
                    : kv_errf(e, "'identical' takes nothing after it");
    else if (!strcmp(w[0], "no-bug"))
        rc = n == 1 ? (x->kind = SUITE_EXPECT_NO_BUG, 0)
                    : kv_errf(e, "'no-bug' takes nothing after it");
    else if (!strcmp(w[0], "within"))
        rc = parse_within(w, n, x, e);
    else if (!strcmp(w[0], "detects"))
        rc = parse_detects(w, n, x, e);
    else
        rc = kv_errf(e, "'%s' is not an expectation (identical, no-bug, within ..., detects ...)",
                     w[0]);
    suite_argv_free(w);
    return rc;
}

void suite_expect_describe(const suite_expect *x, char *buf, size_t n)
{
    if (x->kind == SUITE_EXPECT_IDENTICAL) {
        snprintf(buf, n, "identical");
    } else if (x->kind == SUITE_EXPECT_NO_BUG) {
        snprintf(buf, n, "no-bug");
    } else if (x->kind == SUITE_EXPECT_WITHIN) {
        char a[40] = "", r[40] = "", u[40] = "";
        if (x->atol > 0)
            snprintf(a, sizeof a, " atol=%g", x->atol);
        if (x->rtol > 0)
            snprintf(r, sizeof r, " rtol=%g", x->rtol);
        if (x->ulp > 0)
            snprintf(u, sizeof u, " ulp=%llu", (unsigned long long)x->ulp);
        snprintf(buf, n, "within%s%s%s", a, r, u);
    } else {
        snprintf(buf, n, "detects %s at layer %d position %lld stage %s",
                 chk_injection_name((chk_injection)x->injection), x->layer, (long long)x->pos,
                 stage_name((kv_stage)x->stage));
    }
}

/* ------------------------------------------------------------------ */
/* Prompts                                                              */

void suite_prompt_free(suite_prompt *p)
{
    if (p) {
        free(p->text);
        p->text = NULL;
    }
}

/* p->text = f, or base_dir/f when f is relative. */
static int resolve_prompt_path(const char *f, const char *what, const char *base_dir,
                               suite_prompt *p, kv_err *e)
{
    if (!*f)
        return kv_errf(e, "'%s' needs a path", what);
    size_t need = strlen(f) + (base_dir ? strlen(base_dir) : 0) + 2;
    p->text = malloc(need);
    if (!p->text)
        return kv_errf(e, "out of memory");
    if (f[0] == '/' || !base_dir || !*base_dir)
        snprintf(p->text, need, "%s", f);
    else
        snprintf(p->text, need, "%s/%s", base_dir, f);
    return 0;
}

/* text:... is the rest of the value as written, or, when it starts with a
 * double quote, one JSON string: the way to write blanks at either end, a
 * newline (\n) or a " ;" that the suite reader would take for a comment
 * (\u003b). */
static int parse_text_prompt(const char *v, suite_prompt *p, kv_err *e)
{
    p->kind = SUITE_PROMPT_TEXT;
    if (*v != '"') {
        if (!*v)
            return kv_errf(e, "'text:' needs the prompt's text");
        p->text = dup_str(v);
        return p->text ? 0 : kv_errf(e, "out of memory");
    }
    json_error_t je;
    json_t *j = json_loads(v, JSON_DECODE_ANY, &je);
    if (!j || !json_is_string(j)) {
        json_decref(j);
        return kv_errf(e, "text:\"...\" is not one JSON string (%s)",
                       j ? "another JSON value" : je.text);
    }
    size_t len = json_string_length(j);
    const char *s = json_string_value(j);
    if (len == 0 || memchr(s, '\0', len)) {
        json_decref(j);
        return kv_errf(e, "text:\"...\" %s", len ? "holds a NUL character" : "is empty");
    }
    p->text = dup_str(s);
    json_decref(j);
    return p->text ? 0 : kv_errf(e, "out of memory");
}

int suite_parse_prompt(const char *text, const char *base_dir, suite_prompt *p, kv_err *e)
{
    memset(p, 0, sizeof *p);
    if (!strncmp(text, "random:", 7)) {
        char num[32];
        const char *colon = strchr(text + 7, ':');
        size_t nl = colon ? (size_t)(colon - text - 7) : strlen(text + 7);
        if (nl >= sizeof num)
            return kv_errf(e, "'%s' is not random:LENGTH[:SEED]", text);
        memcpy(num, text + 7, nl);
        num[nl] = 0;
        p->kind = SUITE_PROMPT_RANDOM;
        if (parse_long("random prompt length", num, 1, 1L << 24, &p->random_len, e) < 0)
            return -1;
        if (colon && parse_u64("random prompt seed", colon + 1, &p->seed, e) < 0)
            return -1;
        return 0;
    }
    if (!strncmp(text, "text:", 5))
        return parse_text_prompt(text + 5, p, e);
    if (!strncmp(text, "text-file:", 10)) {
        if (resolve_prompt_path(text + 10, "text-file:", base_dir, p, e) < 0)
            return -1;
        p->kind = SUITE_PROMPT_TEXT_FILE;
        char *body = NULL;
        size_t len = 0;
        if (tok_read_text(p->text, &body, &len, e) < 0) {
            suite_prompt_free(p);
            return kv_err_prefix(e, "prompt text file");
        }
        free(body);
        return 0;
    }
    int32_t *ids = NULL;
    int n = 0;
    if (!strncmp(text, "file:", 5)) {
        if (resolve_prompt_path(text + 5, "file:", base_dir, p, e) < 0)
            return -1;
        p->kind = SUITE_PROMPT_FILE;
        if (tokens_load(p->text, 0, &ids, &n, e) < 0) {
            suite_prompt_free(p);
            return kv_err_prefix(e, "prompt file");
        }
        free(ids);
        return 0;
    }
    if (tokens_parse(text, strlen(text), "prompt", 0, &ids, &n, e) < 0)
        return kv_err_prefix(e, "not random:N[:SEED], file:PATH, text:TEXT, text-file:PATH "
                                "or a token list");
    free(ids);
    p->kind = SUITE_PROMPT_TOKENS;
    p->text = dup_str(text);
    return p->text ? 0 : kv_errf(e, "out of memory");
}

/* ------------------------------------------------------------------ */
/* Engine settings                                                      */

static const char *const engine_opts[] = {"engine", "prefill", "chunk", "cache", "attn",
                                          "kv-share", "kv-pad", "inject", "max-ctx", "dtype",
                                          "threads", "mla", NULL};

static int engine_opt_index(const char *name, size_t n)
{
    for (int i = 0; engine_opts[i]; i++)
        if (strlen(engine_opts[i]) == n && !strncmp(engine_opts[i], name, n))
            return i;
    return -1;
}

/* Checks one option's value the way `kvdiff run` would. */
static int check_engine_value(const char *opt, const char *v, chk_injections *inj, kv_err *e)
{
    long n;
    chk_cache_kind ck;
    chk_share_kind sk;
    char what[32];
    snprintf(what, sizeof what, "--%s", opt);
    if (!strcmp(opt, "engine") && strcmp(v, "reference") && strcmp(v, "chunked"))
        return kv_errf(e, "--engine: '%s' is not reference or chunked", v);
    if (!strcmp(opt, "prefill") && strcmp(v, "all") && strcmp(v, "token") &&
        parse_long(what, v, 1, 1L << 30, &n, e) < 0)
        return kv_errf(e, "--prefill: '%s' is not all, token or a positive count", v);
    if ((!strcmp(opt, "chunk") || !strcmp(opt, "max-ctx")) &&
        parse_long(what, v, 1, 1L << 30, &n, e) < 0)
        return -1;
    if (!strcmp(opt, "kv-pad") && parse_long(what, v, 1, 4096, &n, e) < 0)
        return -1;
    if (!strcmp(opt, "threads") && parse_long(what, v, 1, 256, &n, e) < 0)
        return -1;
    if (!strcmp(opt, "cache") && chk_cache_parse(v, &ck) < 0)
        return kv_errf(e, "--cache: '%s' is not dense, split or ring", v);
    if (!strcmp(opt, "attn") && strcmp(v, "exact") && strcmp(v, "cascade"))
        return kv_errf(e, "--attn: '%s' is not exact or cascade", v);
    if (!strcmp(opt, "kv-share") && chk_share_parse(v, &sk) < 0)
        return kv_errf(e, "--kv-share: '%s' is not plain, padded or owner-read-only", v);
    if (!strcmp(opt, "mla") && strcmp(v, "expanded") && strcmp(v, "absorbed"))
        return kv_errf(e, "--mla: '%s' is not expanded or absorbed", v);
    if (!strcmp(opt, "dtype") && strcmp(v, "f32") && strcmp(v, "bf16"))
        return kv_errf(e, "--dtype: '%s' is not f32 or bf16", v);
    if (!strcmp(opt, "inject") && chk_injection_parse(v, inj, e) < 0)
        return -1;
    return 0;
}

/* Appends "--opt", "value" to out (room for both is there). */
static int push_pair(char **out, int *n, const char *opt, size_t optlen, const char *val,
                     kv_err *e)
{
    out[*n] = malloc(optlen + 3);
    out[*n + 1] = dup_str(val);
    if (!out[*n] || !out[*n + 1]) {
        free(out[*n]);
        free(out[*n + 1]);
        out[*n] = out[*n + 1] = NULL;
        return kv_errf(e, "out of memory");
    }
    snprintf(out[*n], optlen + 3, "--%.*s", (int)optlen, opt);
    *n += 2;
    return 0;
}

static int engine_words(char **w, int nw, char **out, int *nout, kv_err *e)
{
    bool given[16] = {false};
    chk_injections inj;
    const char *engine = "reference";
    memset(&inj, 0, sizeof inj);
    for (int i = 0; i < nw; i++) {
        if (strncmp(w[i], "--", 2))
            return kv_errf(e, "'%s' is not an option (engine settings are `kvdiff run` "
                           "options such as --engine chunked --chunk 5)", w[i]);
        const char *name = w[i] + 2, *eq = strchr(name, '=');
        size_t nl = eq ? (size_t)(eq - name) : strlen(name);
        int k = engine_opt_index(name, nl);
        if (k < 0)
            return kv_errf(e, "'--%.*s' is not allowed here (engine, prefill, chunk, cache, "
                           "attn, kv-share, kv-pad, inject, max-ctx, dtype, threads, mla)",
                           (int)nl, name);
        const char *val = eq ? eq + 1 : (i + 1 < nw ? w[++i] : NULL);
        if (!val || !*val)
            return kv_errf(e, "--%s needs a value", engine_opts[k]);
        if (given[k] && strcmp(engine_opts[k], "inject"))
            return kv_errf(e, "--%s is given twice", engine_opts[k]);
        given[k] = true;
        if (check_engine_value(engine_opts[k], val, &inj, e) < 0)
            return -1;
        if (!strcmp(engine_opts[k], "engine"))
            engine = val;
        if (push_pair(out, nout, name, nl, val, e) < 0)
            return -1;
    }
    static const char *const chunked_only[] = {"chunk", "cache", "attn", "kv-share", "kv-pad",
                                               "inject", "mla", NULL};
    for (int i = 0; chunked_only[i]; i++)
        if (given[engine_opt_index(chunked_only[i], strlen(chunked_only[i]))] &&
            strcmp(engine, "chunked"))
            return kv_errf(e, "--%s needs --engine chunked", chunked_only[i]);
    if (given[engine_opt_index("prefill", 7)] && strcmp(engine, "reference"))
        return kv_errf(e, "--prefill is an option of --engine reference");
    return 0;
}

int suite_parse_engine(const char *text, char ***argv, int *argc, kv_err *e)
{
    char **w = NULL;
    int nw = 0;
    if (split_words(text, &w, &nw, e) < 0)
        return -1;
    /* "--opt=value" becomes two words: at most twice as many. */
    char **out = calloc((size_t)nw * 2 + 1, sizeof *out);
    int n = 0;
    int rc = out ? engine_words(w, nw, out, &n, e) : kv_errf(e, "out of memory");
    suite_argv_free(w);
    if (rc < 0) {
        suite_argv_free(out);
        return -1;
    }
    *argv = out;
    *argc = n;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Outside sides: llama.cpp:, exec:, dump:                               */

const char *suite_side_name(suite_side_kind k)
{
    return k == SUITE_SIDE_LLAMA ? "llama.cpp" : k == SUITE_SIDE_EXEC ? "exec"
         : k == SUITE_SIDE_DUMP ? "dump" : "kvdiff";
}

static const char *const placeholders[] = {"{model}", "{tokens}", "{max_new}", "{dump}", NULL};

/* Every {...} in word must be a known placeholder. */
static int check_placeholders(const char *word, kv_err *e)
{
    for (const char *o = strchr(word, '{'); o; o = strchr(o + 1, '{')) {
        const char *c = strchr(o, '}');
        if (!c)
            return kv_errf(e, "'%s': '{' without '}' (placeholders: {model}, {tokens}, "
                           "{max_new}, {dump})", word);
        bool known = false;
        for (int i = 0; placeholders[i]; i++)
            known |= strlen(placeholders[i]) == (size_t)(c - o + 1) &&
                     !strncmp(o, placeholders[i], (size_t)(c - o + 1));
        if (!known)
            return kv_errf(e, "unknown placeholder '%.*s' (placeholders: {model}, {tokens}, "
                           "{max_new}, {dump})", (int)(c - o + 1), o);
    }
    return 0;
}

int suite_split_command(const char *text, char ***argv, int *argc, kv_err *e)
{
    size_t len = strlen(text);
    char **out = calloc(len / 2 + 2, sizeof *out);
    char *word = malloc(len + 1);
    int n = 0;
    if (!out || !word) {
        free(out);
        free(word);
        return kv_errf(e, "out of memory");
    }
    size_t i = 0;
    for (;;) {
        while (i < len && (text[i] == ' ' || text[i] == '\t'))
            i++;
        if (i >= len)
            break;
        size_t w = 0;
        while (i < len && text[i] != ' ' && text[i] != '\t') {
            char q = text[i];
            if (q != '\'' && q != '"') {
                word[w++] = text[i++];
                continue;
            }
            const char *close = memchr(text + i + 1, q, len - i - 1);
            if (!close) {
                free(word);
                suite_argv_free(out);
                return kv_errf(e, "unterminated %s quote", q == '\'' ? "single" : "double");
            }
            size_t k = (size_t)(close - text) - i - 1;
            memcpy(word + w, text + i + 1, k);
            w += k;
            i = (size_t)(close - text) + 1;
        }
        word[w] = 0;
        if (check_placeholders(word, e) < 0 || !(out[n] = dup_str(word))) {
            if (!e->msg[0])
                kv_errf(e, "out of memory");
            free(word);
            suite_argv_free(out);
            return -1;
        }
        n++;
    }
    free(word);
    *argv = out;
    *argc = n;
    return 0;
}

/* ------------------------------------------------------------------ */
/* exec: commands: which words a shell reads as code                    */

/* An exec: side runs its command without a shell, but the command may
 * start one (sh -c CODE), itself or through wrappers that run the rest of
 * their words as a command (env, timeout, nice, xargs, ...). A value put
 * in for a placeholder names a path the user chose (--keep, TMPDIR) and
 * must reach the program as that path, never as code: in a POSIX shell's
 * code each value is quoted as the shell reads it where it stands. So the
 * words are read the way their programs read them: a wrapper's options
 * by that wrapper's grammar, a shell's options up to its code, and the
 * code walked as the shell walks it (quotes, $(...), subshells) down to
 * its simple commands, each read the same way. Where a value would be
 * parsed by something the suite cannot quote for (a shell inside shell
 * code, eval, python -c, a program it does not know followed by a shell,
 * `...`, ${...}), the file is refused: a guess would run the folder's
 * name. {max_new} is digits and may stand anywhere. */

enum { PH_MAX_NEW = 2 };

static int ph_at(const char *p)
{
    if (*p != '{')
        return -1;
    for (int k = 0; placeholders[k]; k++)
        if (!strncmp(p, placeholders[k], strlen(placeholders[k])))
            return k;
    return -1;
}

/* The first placeholder in w whose value is a path ({model}, {tokens},
 * {dump}), or NULL. */
static const char *path_ph(const char *w)
{
    for (const char *p = strchr(w, '{'); p; p = strchr(p + 1, '{')) {
        int k = ph_at(p);
        if (k >= 0 && k != PH_MAX_NEW)
            return placeholders[k];
    }
    return NULL;
}

/* The same in s[0..n) (s goes on past n). */
static const char *path_ph_in(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int k = ph_at(s + i);
        if (k >= 0 && k != PH_MAX_NEW && i + strlen(placeholders[k]) <= n)
            return placeholders[k];
    }
    return NULL;
}

/* The same over the words w[from..n). */
static const char *path_ph_from(char *const *w, int from, int n)
{
    for (int i = from; i < n; i++) {
        const char *ph = path_ph(w[i]);
        if (ph)
            return ph;
    }
    return NULL;
}

static const char *base_of(const char *w)
{
    const char *s = strrchr(w, '/');
    return s ? s + 1 : w;
}

static bool in_list(const char *w, const char *const *list)
{
    for (int i = 0; list && list[i]; i++)
        if (!strcmp(w, list[i]))
            return true;
    return false;
}

/* name[0..len) is a long option of list or, as getopt takes it, the
 * start of one. */
static bool long_match(const char *name, size_t len, const char *const *list)
{
    for (int i = 0; len > 0 && list && list[i]; i++)
        if (!strncmp(list[i], name, len))
            return true;
    return false;
}

static bool all_digits(const char *s)
{
    if (!*s)
        return false;
    for (; *s; s++)
        if (*s < '0' || *s > '9')
            return false;
    return true;
}

/* "-c", "-ec", "-xc": a shell's flags with c among them. */
static bool c_flag(const char *o)
{
    if (o[0] != '-' || !o[1] || !strchr(o, 'c'))
        return false;
    for (const char *p = o + 1; *p; p++)
        if (!isalpha((unsigned char)*p))
            return false;
    return true;
}

static const char *const posix_shells[] = {"sh", "bash", "dash", "zsh", "ksh", "ksh93", "mksh",
                                           "pdksh", "lksh", "oksh", "ash", "hush", "yash",
                                           "posh", "rbash", NULL};
/* Shells whose quoting is not POSIX's: their code is not quoted for. */
static const char *const other_shells[] = {"csh", "tcsh", "fish", "rc", "es", "nu", "xonsh",
                                           "elvish", "pwsh", "powershell", NULL};

static bool is_shell(const char *name)
{
    return in_list(name, posix_shells) || in_list(name, other_shells);
}

/* A program that runs the rest of its words as a command, after its own
 * options (GNU coreutils' and util-linux' grammars, and the shell
 * builtins that do the same inside shell code). */
typedef struct {
    const char *name;
    const char *arg;              /* short options taking an argument */
    const char *const *larg;      /* long options taking one (--opt VALUE, --opt=VALUE) */
    const char *stop;             /* short options after which no command runs (chrt -p PID) */
    const char *const *lstop;
    const char *shell;            /* short options handing the command to a shell or a
                                   * splitter of its own (env -S, sudo -s) */
    const char *const *lshell;
    int operands;                 /* words before the command (timeout DURATION, taskset MASK) */
    bool numeric_operand;         /* ... taken only when a number (chrt PRIORITY) */
    bool assignments;             /* NAME=VALUE words before the command (env) */
} wrapper;

static const char *const env_larg[] = {"unset", "chdir", "split-string", NULL};
static const char *const env_lshell[] = {"split-string", NULL};
static const char *const timeout_larg[] = {"kill-after", "signal", NULL};
static const char *const nice_larg[] = {"adjustment", NULL};
static const char *const stdbuf_larg[] = {"input", "output", "error", NULL};
static const char *const xargs_larg[] = {"arg-file", "delimiter", "max-args", "max-procs",
                                         "max-chars", "process-slot-var", NULL};
static const char *const time_larg[] = {"format", "output", NULL};
static const char *const ionice_larg[] = {"class", "classdata", NULL};
static const char *const ionice_lstop[] = {"pid", "pgid", "uid", NULL};
static const char *const chrt_larg[] = {"sched-runtime", "sched-period", "sched-deadline", NULL};
static const char *const chrt_lstop[] = {"pid", "max", NULL};
static const char *const taskset_lstop[] = {"pid", NULL};
static const char *const sudo_larg[] = {"user", "group", "close-from", "chdir", "host",
                                        "prompt", "role", "type", "command-timeout",
                                        "other-user", NULL};
static const char *const sudo_lshell[] = {"shell", "login", NULL};

static const wrapper wrappers[] = {
    {.name = "env", .arg = "uCS", .larg = env_larg, .shell = "S", .lshell = env_lshell,
     .assignments = true},
    {.name = "timeout", .arg = "ks", .larg = timeout_larg, .operands = 1},
    {.name = "nice", .arg = "n", .larg = nice_larg},
    {.name = "stdbuf", .arg = "ioe", .larg = stdbuf_larg},
    {.name = "nohup"},
    {.name = "setsid"},
    {.name = "xargs", .arg = "adEILnPs", .larg = xargs_larg},
    {.name = "time", .arg = "fo", .larg = time_larg},
    {.name = "command", .stop = "vV"},
    {.name = "exec", .arg = "a"},
    {.name = "builtin"},
    {.name = "ionice", .arg = "cn", .larg = ionice_larg, .stop = "pPu", .lstop = ionice_lstop},
    {.name = "chrt", .arg = "TPD", .larg = chrt_larg, .stop = "pm", .lstop = chrt_lstop,
     .operands = 1, .numeric_operand = true},
    {.name = "taskset", .stop = "p", .lstop = taskset_lstop, .operands = 1},
    {.name = "sudo", .arg = "ugCDprtTU", .larg = sudo_larg, .stop = "elLvKV", .shell = "si",
     .lshell = sudo_lshell},
    {.name = "doas", .arg = "uC", .shell = "s"},
};

static const wrapper *find_wrapper(const char *name)
{
    for (size_t i = 0; i < sizeof wrappers / sizeof *wrappers; i++)
        if (!strcmp(name, wrappers[i].name))
            return &wrappers[i];
    return NULL;
}

/* An interpreter whose code may come on its command line. */
typedef struct {
    const char *name;             /* base name; a version may follow (python3.11, lua5.4) */
    const char *lang;
    const char *code;             /* short options whose argument is code (python -c) */
    const char *const *lcode;
    const char *file;             /* short options naming a program file (awk -f) */
    const char *const *lfile;
    const char *arg;              /* short options with another argument */
    const char *const *larg;
    const char *attached;         /* options whose argument is the rest of the group only */
    const char *digits;           /* options followed by digits only (perl -l, -0) */
    const char *stop;             /* short options after which the words are arguments (python -m) */
    bool code_ends;               /* the words after the code are arguments (python) */
    bool program_operand;         /* the first operand is the program unless a code or
                                   * file option came (awk, sed) */
} interp;

static const char *const node_lcode[] = {"eval", "print", NULL};
static const char *const node_larg[] = {"require", "import", "loader", "input-type", NULL};
static const char *const awk_lcode[] = {"source", NULL};
static const char *const awk_lfile[] = {"file", NULL};
static const char *const awk_larg[] = {"assign", "field-separator", "include", "load", NULL};
static const char *const sed_lcode[] = {"expression", NULL};
static const char *const sed_larg[] = {"line-length", NULL};

static const interp interps[] = {
    {.name = "python", .lang = "Python", .code = "c", .arg = "WX", .stop = "m", .code_ends = true},
    {.name = "pypy", .lang = "Python", .code = "c", .arg = "WX", .stop = "m", .code_ends = true},
    {.name = "perl", .lang = "Perl", .code = "eE", .arg = "I", .attached = "MmidxDCF",
     .digits = "l0"},
    {.name = "ruby", .lang = "Ruby", .code = "e", .arg = "IrCE", .attached = "FxTWK",
     .digits = "0"},
    {.name = "node", .lang = "JavaScript", .code = "ep", .lcode = node_lcode, .arg = "r",
     .larg = node_larg},
    {.name = "nodejs", .lang = "JavaScript", .code = "ep", .lcode = node_lcode, .arg = "r",
     .larg = node_larg},
    {.name = "php", .lang = "PHP", .code = "rBRE", .file = "f", .arg = "cdz"},
    {.name = "lua", .lang = "Lua", .code = "e", .arg = "l"},
    {.name = "Rscript", .lang = "R", .code = "e"},
    {.name = "awk", .lang = "awk", .code = "e", .lcode = awk_lcode, .file = "f",
     .lfile = awk_lfile, .arg = "vF", .larg = awk_larg, .program_operand = true},
    {.name = "gawk", .lang = "awk", .code = "e", .lcode = awk_lcode, .file = "f",
     .lfile = awk_lfile, .arg = "vF", .larg = awk_larg, .program_operand = true},
    {.name = "mawk", .lang = "awk", .file = "f", .arg = "vF", .program_operand = true},
    {.name = "nawk", .lang = "awk", .file = "f", .arg = "vF", .program_operand = true},
    {.name = "sed", .lang = "sed", .code = "e", .lcode = sed_lcode, .file = "f",
     .lfile = awk_lfile, .arg = "l", .larg = sed_larg, .attached = "i",
     .program_operand = true},
};

static const interp *find_interp(const char *name)
{
    for (size_t i = 0; i < sizeof interps / sizeof *interps; i++) {
        size_t n = strlen(interps[i].name);
        if (strncmp(name, interps[i].name, n))
            continue;
        const char *v = name + n;   /* python3, python3.11, lua5.4 */
        while (*v && ((*v >= '0' && *v <= '9') || *v == '.'))
            v++;
        if (!*v)
            return &interps[i];
    }
    return NULL;
}

/* Programs that parse words as shell code themselves, or hand them to a
 * shell the suite cannot see (a remote one, another user's). */
typedef struct {
    const char *name;
    const char *code;             /* NULL: every word after the name is code */
    const char *const *lcode;
} runner;

static const char *const su_lcode[] = {"command", "session-command", NULL};
static const char *const script_lcode[] = {"command", NULL};

static const runner runners[] = {
    {"eval", NULL, NULL},   {"trap", NULL, NULL},     {"alias", NULL, NULL},
    {"watch", NULL, NULL},  {"ssh", NULL, NULL},      {"parallel", NULL, NULL},
    {"sg", NULL, NULL},     {"su", "c", su_lcode},    {"runuser", "c", su_lcode},
    {"script", "c", script_lcode}, {"flock", "c", script_lcode},
};

static const runner *find_runner(const char *name)
{
    for (size_t i = 0; i < sizeof runners / sizeof *runners; i++)
        if (!strcmp(name, runners[i].name))
            return &runners[i];
    return NULL;
}

#define PASS_ARG "pass the value as an argument instead (docs/suite-format.md, \"Shell code\")"
#define ARG_INSTEAD "; " PASS_ARG

static int analyse(unsigned char *kinds, char *const *w, const unsigned char *x, int n, int i,
                   int level, kv_err *e);
static int shell_code_check(const char *code, int level, kv_err *e);
static int unknown_words(char *const *w, int n, int i, int level, kv_err *e);

/* The index of the command the wrapper at w[i] runs (n: none), or -1. */
static int wrapper_command(const wrapper *wr, char *const *w, int n, int i, kv_err *e)
{
    int j = i + 1, opt = -1;
    while (j < n && opt < 0) {
        const char *o = w[j];
        if (!strcmp(o, "--")) {
            j++;
            break;
        }
        if (wr->assignments && !strcmp(o, "-")) {   /* env -: env -i */
            j++;
            continue;
        }
        if (o[0] != '-' || !o[1])
            break;
        if (o[1] == '-') {
            const char *name = o + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            if (long_match(name, len, wr->lshell))
                opt = j;
            else if (long_match(name, len, wr->lstop))
                return n;
            j += long_match(name, len, wr->larg) && !eq ? 2 : 1;
            continue;
        }
        int next = 1;
        for (const char *p = o + 1; *p; p++) {
            if (wr->shell && strchr(wr->shell, *p)) {
                opt = j;
                break;
            }
            if (wr->stop && strchr(wr->stop, *p))
                return n;
            if (wr->arg && strchr(wr->arg, *p)) {
                next = p[1] ? 1 : 2;
                break;
            }
        }
        j += next;
    }
    if (opt >= 0) {
        const char *ph = path_ph_from(w, i + 1, n);
        if (ph)
            return kv_errf(e, "'%s' after '%s %s': it hands the command to a shell or splits "
                           "it itself, so the suite cannot tell how %s will be parsed" ARG_INSTEAD,
                           ph, w[i], w[opt], ph);
        return n;
    }
    if (wr->assignments)
        while (j < n && strchr(w[j], '='))
            j++;
    for (int k = 0; k < wr->operands && j < n; k++) {
        if (wr->numeric_operand && !all_digits(w[j]))
            break;
        j++;
    }
    return j;
}

/* Refuses code (an interpreter's, the argument of opt) that holds a path
 * placeholder. */
static int code_check(const interp *in, const char *prog, const char *opt, const char *code,
                      kv_err *e)
{
    const char *ph = code ? path_ph(code) : NULL;
    if (!ph)
        return 0;
    return kv_errf(e, "'%s' in the %s code of '%s%s%s': the suite quotes values for POSIX "
                   "shells only, and %s would be read as %s" ARG_INSTEAD, ph, in->lang, prog,
                   opt ? " " : "", opt ? opt : "", ph, in->lang);
}

/* The code or script of an interpreter may run its arguments as a
 * command: they are read as a wrapper the suite does not know. */
static int interp_words(const interp *in, char *const *w, int n, int i, int level, kv_err *e)
{
    bool program = false;   /* a code or file option came */
    int j = i + 1;
    while (j < n) {
        const char *o = w[j];
        if (!strcmp(o, "--")) {
            j++;
            break;
        }
        if (o[0] != '-' || !o[1])
            break;
        if (o[1] == '-') {
            const char *name = o + 2, *eq = strchr(name, '=');
            size_t len = eq ? (size_t)(eq - name) : strlen(name);
            const char *val = eq ? eq + 1 : j + 1 < n ? w[j + 1] : NULL;
            bool code = long_match(name, len, in->lcode);
            bool file = long_match(name, len, in->lfile);
            if (code && code_check(in, w[i], o, val, e) < 0)
                return -1;
            program |= code || file;
            j += (code || file || long_match(name, len, in->larg)) && !eq ? 2 : 1;
            if (code && in->code_ends)
                return unknown_words(w, n, i, level, e);
            continue;
        }
        int next = 1;
        for (const char *p = o + 1; *p; p++) {
            if (in->stop && strchr(in->stop, *p))
                return unknown_words(w, n, i, level, e);
            if (in->digits && strchr(in->digits, *p)) {
                while (p[1] >= '0' && p[1] <= '9')
                    p++;
                continue;
            }
            if (in->attached && strchr(in->attached, *p))
                break;
            bool code = in->code && strchr(in->code, *p);
            bool file = in->file && strchr(in->file, *p);
            if (!code && !file && !(in->arg && strchr(in->arg, *p)))
                continue;
            const char *val = p[1] ? p + 1 : j + 1 < n ? w[j + 1] : NULL;
            next = p[1] ? 1 : 2;
            if (code && code_check(in, w[i], o, val, e) < 0)
                return -1;
            if (code && in->code_ends)
                return unknown_words(w, n, i, level, e);
            program |= code || file;
            break;
        }
        j += next;
    }
    if (in->program_operand && !program && j < n && code_check(in, w[i], NULL, w[j], e) < 0)
        return -1;
    return unknown_words(w, n, i, level, e);
}

/* A program the suite does not know: if it runs a later word as a
 * command, that could be a shell reading a value as code. */
static int unknown_words(char *const *w, int n, int i, int level, kv_err *e)
{
    for (int k = i + 1; k < n; k++) {
        const char *b = base_of(w[k]);
        const char *ph = path_ph_from(w, k + 1, n);
        if (!ph)
            break;
        if (is_shell(b) || !strcmp(b, "eval"))
            return kv_errf(e, "'%s' comes after '%s' in a command run by '%s', which is no "
                           "wrapper the suite knows (env, timeout, nice, stdbuf, nohup, setsid, "
                           "xargs, time, ionice, chrt, taskset): if it runs '%s', %s is read as "
                           "code the suite cannot quote for; start with the shell, or "
                           PASS_ARG, ph, w[k], w[i], w[k], ph);
        if (find_interp(b) || find_runner(b)) {
            kv_err sub = {{0}};
            if (analyse(NULL, w, NULL, n, k, level, &sub) < 0)
                return kv_errf(e, "'%s' is no wrapper the suite knows, and if it runs '%s': %s",
                               w[i], w[k], sub.msg);
        }
    }
    return 0;
}

static int runner_words(const runner *ru, char *const *w, int n, int i, int level, kv_err *e)
{
    const char *ph;
    if (!ru->code) {
        if ((ph = path_ph_from(w, i + 1, n)))
            return kv_errf(e, "'%s' after '%s': it parses its words as shell code (or hands "
                           "them to another shell), which the suite cannot quote for"
                           ARG_INSTEAD, ph, w[i]);
        return 0;
    }
    for (int j = i + 1; j < n; j++) {
        const char *o = w[j];
        bool code = false;
        if (o[0] == '-' && o[1] == '-') {
            const char *eq = strchr(o + 2, '=');
            code = long_match(o + 2, eq ? (size_t)(eq - o - 2) : strlen(o + 2), ru->lcode);
        } else if (o[0] == '-') {
            code = strpbrk(o + 1, ru->code) != NULL;
        }
        if (code && (ph = path_ph_from(w, j, n)))
            return kv_errf(e, "'%s' after '%s %s': that command is run by a shell the suite "
                           "cannot quote for" ARG_INSTEAD, ph, w[i], o);
    }
    return unknown_words(w, n, i, level, e);
}

static int shell_words(unsigned char *kinds, char *const *w, int n, int i, int level,
                       kv_err *e)
{
    const bool posix = in_list(base_of(w[i]), posix_shells);
    bool code = false;
    int j = i + 1;
    while (j < n) {
        const char *o = w[j];
        if (!strcmp(o, "-") || !strcmp(o, "--")) {
            j++;
            break;
        }
        if (o[0] == '-' && o[1] == '-') {
            j += !strcmp(o, "--rcfile") || !strcmp(o, "--init-file") ? 2 : 1;
            continue;
        }
        if ((o[0] != '-' && o[0] != '+') || !o[1])
            break;
        int extra = 0;   /* -o NAME, -O NAME */
        for (const char *p = o + 1; *p; p++) {
            code |= *p == 'c' && o[0] == '-';
            extra += *p == 'o' || *p == 'O';
        }
        j += 1 + extra;
    }
    if (!code) {
        /* a script (w[j]) and its arguments: values reach it as they are,
         * unless a -c after it says the script is meant to run one */
        for (int k = j + 1; k < n; k++) {
            const char *ph = c_flag(w[k]) ? path_ph_from(w, k, n) : NULL;
            if (ph)
                return kv_errf(e, "'%s' after '%s %s ... %s': there '%s' is an argument of "
                               "the script %s, not the shell's option, and the suite cannot "
                               "tell whether the script runs %s as code; put -c before the "
                               "script's code, or " PASS_ARG, ph, w[i], w[j], w[k], w[k],
                               w[j], ph);
        }
        return j < n ? unknown_words(w, n, j, level, e) : 0;
    }
    if (j >= n)
        return 0;
    if (kinds && posix)
        kinds[j] = SUITE_WORD_SHELL;
    /* the words after the code are $0, $1, ...: values, unless the code
     * runs them ("$@"); a $0 that names a shell is the usual name
     * (sh -c '...' sh ARG), not a command */
    const int args = j + 1 < n && is_shell(base_of(w[j + 1])) ? j + 1 : j;
    const char *ph = path_ph(w[j]);
    if (!ph)
        return unknown_words(w, n, args, level, e);
    if (!posix)
        return kv_errf(e, "'%s' in the code of '%s -c': the suite quotes values for POSIX "
                       "shells (sh, bash, dash, ksh, zsh, ...) only" ARG_INSTEAD, ph, w[i]);
    if (level > 0)
        return kv_errf(e, "'%s' in the code of '%s -c' inside shell code: that code is parsed "
                       "twice and the value is quoted for the outer shell only; pass it to the "
                       "inner shell as an argument: %s -c '... \"$1\" ...' sh %s", ph, w[i],
                       w[i], ph);
    if (shell_code_check(w[j], level + 1, e) < 0)
        return -1;
    return unknown_words(w, n, args, level, e);
}

static const char *const reserved[] = {"!", "{", "}", "(", ")", "if", "then", "else", "elif",
                                       "fi", "do", "done", "while", "until", NULL};
static const char *const not_commands[] = {"for", "case", "select", "function", "in", "esac",
                                           NULL};

static bool assignment(const char *w)
{
    if (!isalpha((unsigned char)*w) && *w != '_')
        return false;
    while (isalnum((unsigned char)*w) || *w == '_')
        w++;
    return *w == '=' || (w[0] == '+' && w[1] == '=');
}

/* Reads the command at w[i] (n words; x: which hold an expansion, level
 * > 0 only), filling kinds at level 0. */
static int analyse(unsigned char *kinds, char *const *w, const unsigned char *x, int n, int i,
                   int level, kv_err *e)
{
    for (;;) {
        if (level > 0)
            while (i < n && !(x && x[i]) && (assignment(w[i]) || in_list(w[i], reserved)))
                i++;
        if (i >= n || (level > 0 && !(x && x[i]) && in_list(w[i], not_commands)))
            return 0;
        if (x && x[i]) {
            const char *ph = path_ph_from(w, i + 1, n);
            if (ph)
                return kv_errf(e, "'%s' in a command whose program comes from an expansion "
                               "('%s'): the suite cannot tell what reads it" ARG_INSTEAD, ph,
                               w[i]);
            return 0;
        }
        if (kinds)
            kinds[i] = SUITE_WORD_PROGRAM;
        if (!strcmp(base_of(w[i]), "busybox") && i + 1 < n && w[i + 1][0] != '-')
            i++;   /* busybox APPLET: read as the applet */
        const char *name = base_of(w[i]);
        if (is_shell(name))
            return shell_words(kinds, w, n, i, level, e);
        const wrapper *wr = find_wrapper(name);
        if (wr) {
            int j = wrapper_command(wr, w, n, i, e);
            if (j < 0 || j >= n)
                return j < 0 ? -1 : 0;
            i = j;
            continue;
        }
        const interp *in = find_interp(name);
        if (in)
            return interp_words(in, w, n, i, level, e);
        const runner *ru = find_runner(name);
        if (ru)
            return runner_words(ru, w, n, i, level, e);
        return unknown_words(w, n, i, level, e);
    }
}

int suite_exec_words(char *const *argv, int argc, unsigned char *kinds, kv_err *e)
{
    if (kinds)
        memset(kinds, SUITE_WORD_ARG, (size_t)argc);
    return analyse(kinds, argv, NULL, argc, 0, 0, e);
}

/* ------------------------------------------------------------------ */
/* Walking shell code                                                   */

/* Where a fill writes (o NULL: counts only). */
typedef struct {
    char *o;
    size_t n;
} outbuf;

static void emit(outbuf *b, const char *s, size_t len)
{
    if (b->o)
        memcpy(b->o + b->n, s, len);
    b->n += len;
}

/* value as the shell reads it literally in quoting state q (0 none, '\''
 * or '"'); q < 0: as it is. */
static void put_value(outbuf *b, const char *value, int q)
{
    if (q < 0) {
        emit(b, value, strlen(value));
        return;
    }
    if (q == 0)
        emit(b, "'", 1);
    for (const char *v = value; *v; v++) {
        if (q == '"' && strchr("\\\"$`", *v)) {
            emit(b, "\\", 1);
            emit(b, v, 1);
        } else if (q != '"' && *v == '\'') {
            emit(b, "'\\''", 4);   /* close, a quote, reopen */
        } else {
            emit(b, v, 1);
        }
    }
    if (q == 0)
        emit(b, "'", 1);
}

/* One simple command read out of shell code, for analyse. */
typedef struct {
    char **w;                    /* its words: quotes removed, placeholders as written */
    unsigned char *x;            /* per word: it holds an expansion ($x, $(...), `...`) */
    int n, cap;
    char *cur;                   /* the word being read */
    size_t len, cap_cur;
    bool in_word, expanded;
    bool redirect;               /* the next word is a redirection's target */
} shcmd;

/* The walk: the same pass checks (check) or fills (out). */
typedef struct {
    const char *s;
    size_t i;
    bool check;                  /* analyse each simple command at level */
    int level;
    outbuf *out;                 /* fill: the code with values put in */
    const char *const *vals;
    kv_err *e;
    int err;                     /* -1 once e is set */
    int depth;                   /* ( and $( open */
    bool saw_case;
} shwalk;

static void sw_fail(shwalk *w, const char *ph, const char *where)
{
    if (!w->err)
        kv_errf(w->e, "'%s' %s in shell code: the suite does not quote values there" ARG_INSTEAD,
                ph, where);
    w->err = -1;
}

/* Copies n bytes of the code to the output as they are. */
static void raw(shwalk *w, size_t n)
{
    if (w->out)
        emit(w->out, w->s + w->i, n);
    w->i += n;
}

static void cur_add(shwalk *w, shcmd *c, const char *p, size_t n)
{
    c->in_word = true;
    if (!w->check || w->err)
        return;
    if (c->len + n + 1 > c->cap_cur) {
        size_t cap = (c->len + n + 1) * 2;
        char *b = realloc(c->cur, cap);
        if (!b) {
            w->err = kv_errf(w->e, "out of memory");
            return;
        }
        c->cur = b;
        c->cap_cur = cap;
    }
    memcpy(c->cur + c->len, p, n);
    c->len += n;
    c->cur[c->len] = 0;
}

static void word_end(shwalk *w, shcmd *c)
{
    if (!c->in_word)
        return;
    bool keep = !c->redirect && w->check && !w->err;
    if (keep && c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 8;
        char **nw = realloc(c->w, (size_t)cap * sizeof *nw);
        if (nw)
            c->w = nw;
        unsigned char *nx = nw ? realloc(c->x, (size_t)cap) : NULL;
        if (nx)
            c->x = nx;
        if (!nw || !nx)
            w->err = kv_errf(w->e, "out of memory");
        else
            c->cap = cap;
    }
    if (keep && !w->err) {
        c->w[c->n] = dup_str(c->cur ? c->cur : "");
        if (!c->w[c->n])
            w->err = kv_errf(w->e, "out of memory");
        else
            c->x[c->n++] = c->expanded;
    }
    c->redirect = false;
    c->in_word = c->expanded = false;
    c->len = 0;
    if (c->cur)
        c->cur[0] = 0;
}

static void cmd_end(shwalk *w, shcmd *c)
{
    word_end(w, c);
    if (w->check && !w->err && c->n > 0) {
        if (!strcmp(c->w[0], "case"))
            w->saw_case = true;
        if (analyse(NULL, c->w, c->x, c->n, 0, w->level, w->e) < 0)
            w->err = -1;
    }
    for (int k = 0; k < c->n; k++)
        free(c->w[k]);
    c->n = 0;
}

/* A placeholder at the walk's place, in quoting state q: its value goes
 * to the output quoted for q, its name to the word. */
static bool placeholder(shwalk *w, shcmd *c, int q)
{
    int k = ph_at(w->s + w->i);
    if (k < 0)
        return false;
    if (w->out)
        put_value(w->out, w->vals[k], k == PH_MAX_NEW ? -1 : q);
    cur_add(w, c, placeholders[k], strlen(placeholders[k]));
    w->i += strlen(placeholders[k]);
    return true;
}

/* A placeholder where no quoting is sure (where names the place):
 * {max_new} goes in as its digits, the others are refused. */
static bool opaque_placeholder(shwalk *w, const char *where)
{
    int k = ph_at(w->s + w->i);
    if (k < 0)
        return false;
    if (k != PH_MAX_NEW) {
        sw_fail(w, placeholders[k], where);
        w->i += strlen(placeholders[k]);
        return true;
    }
    if (w->out)
        put_value(w->out, w->vals[k], -1);
    w->i += strlen(placeholders[k]);
    return true;
}

static void sw_list(shwalk *w, bool closing);
static void dquote(shwalk *w, shcmd *c);

/* A command read from the walk's place (a $(...), a <(...)) whose output
 * becomes part of the word: a value inside it may come out in that word,
 * so the word carries the placeholder's name for analyse. */
static void substitution(shwalk *w, shcmd *c, size_t open)
{
    const size_t start = w->i;
    raw(w, open);
    c->in_word = c->expanded = true;
    sw_list(w, true);
    const char *ph = path_ph_in(w->s + start, w->i - start);
    if (ph)
        cur_add(w, c, ph, strlen(ph));
}

/* `...`: the shell strips a level of backslashes before it parses the
 * command inside, so no quoting of ours holds there. */
static void backquote(shwalk *w, shcmd *c)
{
    raw(w, 1);
    while (!w->err && w->s[w->i] && w->s[w->i] != '`') {
        if (opaque_placeholder(w, "inside `...` (write $(...) instead)"))
            continue;
        raw(w, w->s[w->i] == '\\' && w->s[w->i + 1] ? 2 : 1);
    }
    if (w->s[w->i] == '`')
        raw(w, 1);
    c->in_word = c->expanded = true;
}

/* $((...)) and ((...)): arithmetic, opened by n bytes. */
static void arith(shwalk *w, shcmd *c, size_t n)
{
    int depth = 2;
    raw(w, n);
    while (!w->err && w->s[w->i] && depth > 0) {
        if (opaque_placeholder(w, "inside $((...))"))
            continue;
        depth += w->s[w->i] == '(' ? 1 : w->s[w->i] == ')' ? -1 : 0;
        raw(w, 1);
    }
    c->in_word = c->expanded = true;
}

/* ${...}: the shell's own parsing of the word inside depends on the
 * operator and the shell. */
static void braces(shwalk *w, shcmd *c)
{
    int depth = 1;
    raw(w, 2);
    while (!w->err && w->s[w->i] && depth > 0) {
        if (opaque_placeholder(w, "inside ${...}"))
            continue;
        char ch = w->s[w->i];
        depth += ch == '{' ? 1 : ch == '}' ? -1 : 0;
        raw(w, ch == '\\' && w->s[w->i + 1] ? 2 : 1);
    }
    c->in_word = c->expanded = true;
}

/* $'...': backslash escapes inside, which no quoting of a value survives. */
static void ansi(shwalk *w, shcmd *c)
{
    raw(w, 2);
    while (!w->err && w->s[w->i] && w->s[w->i] != '\'') {
        if (opaque_placeholder(w, "inside $'...'"))
            continue;
        cur_add(w, c, w->s + w->i, 1);
        raw(w, w->s[w->i] == '\\' && w->s[w->i + 1] ? 2 : 1);
    }
    if (w->s[w->i] == '\'')
        raw(w, 1);
    c->in_word = true;
}

static void dollar(shwalk *w, shcmd *c, int q)
{
    const char *s = w->s + w->i;
    int k = ph_at(s + 1);
    if (k >= 0) {   /* ${dump}: the shell's variable, not ours */
        w->i++;
        sw_fail(w, placeholders[k], "right after '$' (the shell reads ${...} as its variable)");
        return;
    }
    if (s[1] == '(' && s[2] == '(') {
        arith(w, c, 3);
    } else if (s[1] == '(') {
        substitution(w, c, 2);
    } else if (s[1] == '{') {
        braces(w, c);
    } else if (s[1] == '\'' && q == 0) {
        ansi(w, c);
    } else if (s[1] == '"' && q == 0) {
        raw(w, 1);
        dquote(w, c);
    } else if (isalpha((unsigned char)s[1]) || s[1] == '_') {
        size_t n = 2;
        while (isalnum((unsigned char)s[n]) || s[n] == '_')
            n++;
        raw(w, n);
        c->in_word = c->expanded = true;
    } else if (s[1] && strchr("0123456789@*#?$!-", s[1])) {
        raw(w, 2);
        c->in_word = c->expanded = true;
    } else {
        cur_add(w, c, s, 1);
        raw(w, 1);
    }
}

static void squote(shwalk *w, shcmd *c)
{
    raw(w, 1);
    c->in_word = true;
    while (!w->err && w->s[w->i] && w->s[w->i] != '\'') {
        if (placeholder(w, c, '\''))
            continue;
        cur_add(w, c, w->s + w->i, 1);
        raw(w, 1);
    }
    if (w->s[w->i] == '\'')
        raw(w, 1);
}

static void dquote(shwalk *w, shcmd *c)
{
    raw(w, 1);
    c->in_word = true;
    while (!w->err && w->s[w->i] && w->s[w->i] != '"') {
        const char *s = w->s + w->i;
        if (placeholder(w, c, '"'))
            continue;
        if (s[0] == '\\' && s[1]) {
            if (strchr("$`\"\\\n", s[1]))
                cur_add(w, c, s + 1, 1);
            else
                cur_add(w, c, s, 2);
            raw(w, 2);
        } else if (s[0] == '$') {
            dollar(w, c, '"');
        } else if (s[0] == '`') {
            backquote(w, c);
        } else {
            cur_add(w, c, s, 1);
            raw(w, 1);
        }
    }
    if (w->s[w->i] == '"')
        raw(w, 1);
}

/* One piece of a word outside quotes. */
static void word_part(shwalk *w, shcmd *c)
{
    const char *s = w->s + w->i;
    if (placeholder(w, c, 0))
        return;
    if (s[0] == '\\') {
        if (s[1])
            cur_add(w, c, s + 1, 1);
        raw(w, s[1] ? 2 : 1);
    } else if (s[0] == '\'') {
        squote(w, c);
    } else if (s[0] == '"') {
        dquote(w, c);
    } else if (s[0] == '$') {
        dollar(w, c, 0);
    } else if (s[0] == '`') {
        backquote(w, c);
    } else {
        cur_add(w, c, s, 1);
        raw(w, 1);
    }
}

/* Reads commands to the end of the code or, closing, to the ')' that
 * ends them (a $(...) or a subshell). */
static void sw_list(shwalk *w, bool closing)
{
    shcmd c;
    memset(&c, 0, sizeof c);
    if (++w->depth > 64 && !w->err)
        w->err = kv_errf(w->e, "shell code nested more than 64 deep");
    while (!w->err && w->s[w->i]) {
        const char *s = w->s + w->i;
        if (s[0] == ' ' || s[0] == '\t') {
            word_end(w, &c);
            raw(w, 1);
        } else if (strchr("\n;&|", s[0])) {
            cmd_end(w, &c);
            raw(w, 1);
        } else if (s[0] == ')') {
            cmd_end(w, &c);
            raw(w, 1);
            if (closing)
                break;
        } else if (s[0] == '(') {
            if (!c.in_word && c.n == 0 && s[1] == '(') {
                arith(w, &c, 2);
                continue;
            }
            cmd_end(w, &c);
            raw(w, 1);
            sw_list(w, true);
        } else if (s[0] == '<' || s[0] == '>') {
            if (c.in_word && c.len > 0 && all_digits(c.cur))   /* 2>FILE: a descriptor */
                c.in_word = c.expanded = false, c.len = 0;
            else
                word_end(w, &c);
            if (s[1] == '(') {   /* <(...): a command's output as a file name */
                substitution(w, &c, 2);
                continue;
            }
            while (w->s[w->i] && strchr("<>&|-", w->s[w->i]))
                raw(w, 1);
            c.redirect = true;
        } else if (s[0] == '#' && !c.in_word) {
            while (!w->err && w->s[w->i] && w->s[w->i] != '\n')
                if (!opaque_placeholder(w, "in a comment"))
                    raw(w, 1);
        } else {
            word_part(w, &c);
        }
    }
    cmd_end(w, &c);
    free(c.w);
    free(c.x);
    free(c.cur);
    w->depth--;
}

/* Checks shell code whose simple commands are read at level. */
static int shell_code_check(const char *code, int level, kv_err *e)
{
    shwalk w = {.s = code, .check = true, .level = level, .e = e};
    sw_list(&w, false);
    if (w.err)
        return -1;
    const char *ph = path_ph(code);
    if (w.saw_case && ph)
        return kv_errf(e, "'%s' in shell code that has 'case': the suite does not follow case "
                       "patterns, so it cannot tell how the value is read" ARG_INSTEAD, ph);
    return 0;
}

static void fill(const char *word, suite_word_kind kind, const char *const vals[4], outbuf *b,
                 int *err)
{
    if (kind == SUITE_WORD_SHELL) {
        kv_err e = {{0}};
        shwalk w = {.s = word, .out = b, .vals = vals, .e = &e};
        sw_list(&w, false);
        *err = w.err;
        return;
    }
    for (const char *p = word; *p;) {
        int k = ph_at(p);
        if (k >= 0) {
            put_value(b, vals[k], -1);
            p += strlen(placeholders[k]);
        } else {
            emit(b, p++, 1);
        }
    }
}

char *suite_exec_fill(const char *word, suite_word_kind kind, const char *const vals[4])
{
    outbuf b = {NULL, 0};
    int err = 0;
    if (!strchr(word, '{'))
        return dup_str(word);
    fill(word, kind, vals, &b, &err);
    if (err || !(b.o = malloc(b.n + 1)))
        return NULL;
    b.n = 0;
    fill(word, kind, vals, &b, &err);
    b.o[b.n] = 0;
    return b.o;
}

/* llama.cpp recorder options the runner sets itself. */
static int check_llama_words(char **w, int n, kv_err *e)
{
    static const char *const runner_owned[] = {"--dump", "-o", "--prompt-tokens",
                                               "--prompt-ids-file", "--prompt-from",
                                               "--max-new", NULL};
    for (int i = 0; i < n; i++) {
        for (int k = 0; runner_owned[k]; k++)
            if (!strcmp(w[i], runner_owned[k]))
                return kv_errf(e, "%s is set by the suite runner (the case's prompt, "
                               "max_new and dump)", w[i]);
    }
    return 0;
}

int suite_parse_side(const char *text, const char *base_dir, suite_side_kind *kind,
                     char ***argv, int *argc, kv_err *e)
{
    static const struct { const char *prefix; suite_side_kind k; } kinds[] = {
        {"llama.cpp:", SUITE_SIDE_LLAMA}, {"exec:", SUITE_SIDE_EXEC}, {"dump:", SUITE_SIDE_DUMP}};
    while (*text == ' ' || *text == '\t')
        text++;
    *kind = SUITE_SIDE_KVDIFF;
    if (!strncmp(text, "--", 2) || !*text)
        return suite_parse_engine(text, argv, argc, e);
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        size_t pl = strlen(kinds[i].prefix);
        if (strncmp(text, kinds[i].prefix, pl))
            continue;
        const char *rest = text + pl;
        while (*rest == ' ' || *rest == '\t')
            rest++;
        *kind = kinds[i].k;
        if (kinds[i].k == SUITE_SIDE_LLAMA) {
            if (split_words(rest, argv, argc, e) < 0)
                return -1;
            if (check_llama_words(*argv, *argc, e) < 0) {
                suite_argv_free(*argv);
                *argv = NULL;
                return -1;
            }
            return 0;
        }
        if (kinds[i].k == SUITE_SIDE_EXEC) {
            if (suite_split_command(rest, argv, argc, e) < 0)
                return -1;
            if (*argc == 0 || suite_exec_words(*argv, *argc, NULL, e) < 0) {
                if (*argc == 0)
                    kv_errf(e, "'exec:' needs a command");
                suite_argv_free(*argv);
                *argv = NULL;
                return -1;
            }
            return 0;
        }
        if (!*rest)
            return kv_errf(e, "'dump:' needs a path");
        char **out = calloc(2, sizeof *out);
        size_t need = strlen(rest) + (base_dir ? strlen(base_dir) : 0) + 2;
        char *path = malloc(need);
        if (!out || !path) {
            free(out);
            free(path);
            return kv_errf(e, "out of memory");
        }
        if (rest[0] == '/' || !base_dir || !*base_dir)
            snprintf(path, need, "%s", rest);
        else
            snprintf(path, need, "%s/%s", base_dir, rest);
        out[0] = path;
        *argv = out;
        *argc = 1;
        return 0;
    }
    size_t wl = strcspn(text, " \t");
    if (wl > 0 && text[wl - 1] == ':')
        return kv_errf(e, "'%.*s' is not a kind of side (llama.cpp:, exec:, dump:, or kvdiff "
                       "run options)", (int)wl, text);
    return suite_parse_engine(text, argv, argc, e);
}

/* ------------------------------------------------------------------ */
/* The INI pass                                                         */

enum { K_MODEL, K_WEIGHTS_SEED, K_PROMPT, K_MAX_NEW, K_A, K_B, K_EXPECT, K_GGUF, K_COUNT };
static const char *const key_names[K_COUNT] = {"model", "weights_seed", "prompt", "max_new",
                                               "a", "b", "expect", "gguf"};

typedef struct {
    suite_case c;                /* what the section gave */
    bool has[K_COUNT];
    int key_line[K_COUNT];
} section;

typedef struct {
    const char *path;
    char *base_dir;
    const char *text;
    size_t len, off;
    int line;                    /* lines handed to inih so far */
    bool key_since_heading;      /* inih's continuation-line rule needs it */
    int err_line;                /* first problem found by us (0: none) */
    kv_err err;
    section *secs;               /* every heading, defaults included */
    int n_secs, cap_secs;
    int cur;                     /* index of the current section; -1 before any */
} parser;

static void free_case(suite_case *c)
{
    free(c->name);
    free(c->model);
    suite_prompt_free(&c->prompt);
    suite_argv_free(c->a);
    suite_argv_free(c->b);
    free(c->expect_text);
    free(c->gguf);
    memset(c, 0, sizeof *c);
}

/* Records the first problem (at the current line) and returns 0 for inih. */
static int fail(parser *p, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(parser *p, int line, const char *fmt, ...)
{
    if (!p->err_line) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(p->err.msg, sizeof p->err.msg, fmt, ap);
        va_end(ap);
        p->err_line = line;
    }
    return 0;
}

static bool valid_case_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > SUITE_MAX_NAME || !strcmp(s, ".") || !strcmp(s, ".."))
        return false;
    for (size_t i = 0; i < n; i++) {
        char ch = s[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '-' || ch == '_' || ch == '.'))
            return false;
    }
    return true;
}

/* A heading line "[name]" seen by the reader: a new section. */
static void open_section(parser *p, const char *name, size_t n)
{
    char buf[SUITE_MAX_NAME + 2];
    if (n > SUITE_MAX_NAME) {
        fail(p, p->line, "section name '%.*s...' is longer than %d characters", 20, name,
             SUITE_MAX_NAME);
        p->cur = -1;
        return;
    }
    memcpy(buf, name, n);
    buf[n] = 0;
    if (!valid_case_name(buf)) {
        fail(p, p->line, "'[%s]': a case name is letters, digits, '-', '_' and '.' "
             "(it names the case's folder)", buf);
        p->cur = -1;
        return;
    }
    for (int i = 0; i < p->n_secs; i++)
        if (!strcmp(p->secs[i].c.name, buf)) {
            fail(p, p->line, "duplicate case name '%s' (first on line %d)", buf,
                 p->secs[i].c.line);
            p->cur = -1;
            return;
        }
    if (p->n_secs == p->cap_secs) {
        int cap = p->cap_secs ? p->cap_secs * 2 : 16;
        section *s = realloc(p->secs, (size_t)cap * sizeof *s);
        if (!s) {
            fail(p, p->line, "out of memory");
            return;
        }
        p->secs = s;
        p->cap_secs = cap;
    }
    section *s = &p->secs[p->n_secs];
    memset(s, 0, sizeof *s);
    s->c.name = dup_str(buf);
    s->c.line = p->line;
    if (!s->c.name) {
        fail(p, p->line, "out of memory");
        return;
    }
    p->cur = p->n_secs++;
}

static bool is_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\f' || ch == '\v';
}

/* Spots a heading the way inih does: '[' after leading blanks, up to ']',
 * unless the line is indented under a key (then inih reads a continuation). */
static void spot_heading(parser *p, const char *line, size_t n)
{
    size_t i = 0;
    if (p->line == 1 && n >= 3 && !memcmp(line, "\xEF\xBB\xBF", 3))
        i = 3;
    size_t lead = i;
    while (i < n && is_space(line[i]))
        i++;
    if (i >= n || line[i] != '[' || (i > lead && p->key_since_heading))
        return;
    const char *close = memchr(line + i + 1, ']', n - i - 1);
    const char *semi = NULL;
    for (size_t j = i + 1; j < n && !semi; j++)   /* inih stops at an inline comment */
        if (line[j] == ';' && is_space(line[j - 1]))
            semi = line + j;
    if (!close || (semi && semi < close))
        return;   /* inih reports the heading as a syntax error */
    p->key_since_heading = false;
    open_section(p, line + i + 1, (size_t)(close - line - i - 1));
}

/* inih's fgets-like reader over the text: one line per call. */
static char *read_line(char *str, int num, void *stream)
{
    parser *p = stream;
    if (p->off >= p->len || num < 4)
        return NULL;
    const char *start = p->text + p->off;
    const char *nl = memchr(start, '\n', p->len - p->off);
    size_t n = nl ? (size_t)(nl - start) + 1 : p->len - p->off;
    p->off += n;
    p->line++;
    size_t keep = n, content = nl ? n - 1 : n;
    if (content > 0 && start[content - 1] == '\r')
        content--;
    if (content > (size_t)num - 3 || n > (size_t)num - 1) {
        fail(p, p->line, "line is longer than %d characters", num - 3);
        keep = n < (size_t)num - 2 ? n : (size_t)num - 2;
    }
    memcpy(str, start, keep);
    str[keep] = 0;
    if (keep < n && nl) {          /* keep the line a line */
        str[keep] = '\n';
        str[keep + 1] = 0;
    }
    spot_heading(p, start, nl ? n - 1 : n);
    return str;
}

static int set_key(parser *p, section *s, int k, const char *value)
{
    suite_case *c = &s->c;
    kv_err e = {{0}};
    int rc = 0;
    long v = 0;
    if (!*value && k != K_A && k != K_B)
        return fail(p, p->line, "%s: empty value", key_names[k]);
    switch (k) {
    case K_MODEL:
        c->model = dup_str(value);
        rc = c->model ? 0 : kv_errf(&e, "out of memory");
        break;
    case K_WEIGHTS_SEED:
        rc = parse_u64("weights_seed", value, &c->weights_seed, &e);
        break;
    case K_PROMPT:
        rc = suite_parse_prompt(value, p->base_dir, &c->prompt, &e);
        break;
    case K_MAX_NEW:
        rc = parse_long("max_new", value, 0, 1L << 24, &v, &e);
        c->max_new = v;
        break;
    case K_A:
        rc = suite_parse_side(value, p->base_dir, &c->ka, &c->a, &c->na, &e);
        break;
    case K_B:
        rc = suite_parse_side(value, p->base_dir, &c->kb, &c->b, &c->nb, &e);
        break;
    case K_GGUF: {
        size_t need = strlen(value) + strlen(p->base_dir) + 2;
        if ((c->gguf = malloc(need)) == NULL)
            rc = kv_errf(&e, "out of memory");
        else if (value[0] == '/')
            snprintf(c->gguf, need, "%s", value);
        else
            snprintf(c->gguf, need, "%s/%s", p->base_dir, value);
        break;
    }
    default:
        rc = suite_parse_expect(value, &c->expect, &e);
        if (rc == 0 && !(c->expect_text = dup_str(value)))
            rc = kv_errf(&e, "out of memory");
        break;
    }
    if (rc < 0) {
        if (k == K_A || k == K_B || k == K_EXPECT || k == K_PROMPT)
            return fail(p, p->line, "%s: %s", key_names[k], e.msg);
        return fail(p, p->line, "%s", e.msg);
    }
    return 1;
}

static int on_key(void *user, const char *sec, const char *name, const char *value)
{
    parser *p = user;
    p->key_since_heading = true;
    if (p->err_line)
        return 1;   /* only the first problem is reported */
    if (!*sec)
        return fail(p, p->line, "'%s' is outside any [section]", name);
    if (p->cur < 0 || strcmp(sec, p->secs[p->cur].c.name))
        return fail(p, p->line, "section heading '[%s]' not understood", sec);
    section *s = &p->secs[p->cur];
    int k = 0;
    while (k < K_COUNT && strcmp(key_names[k], name))
        k++;
    if (k == K_COUNT)
        return fail(p, p->line, "unknown key '%s' (model, weights_seed, prompt, max_new, a, b, "
                    "expect, gguf)", name);
    if (s->has[k])
        return fail(p, p->line, "'%s' is given twice in [%s] (first on line %d; a line "
                    "indented under a key continues it)", name, s->c.name, s->key_line[k]);
    s->has[k] = true;
    s->key_line[k] = p->line;
    return set_key(p, s, k, value);
}

/* ------------------------------------------------------------------ */
/* Defaults and completeness                                            */

static char **copy_argv(char **a, int n)
{
    char **out = calloc((size_t)n + 1, sizeof *out);
    for (int i = 0; out && i < n; i++)
        if (!(out[i] = dup_str(a[i]))) {
            suite_argv_free(out);
            return NULL;
        }
    return out;
}

/* Fills key k of case s from the defaults d. */
static int inherit(section *s, const section *d, int k)
{
    suite_case *c = &s->c;
    const suite_case *dc = &d->c;
    switch (k) {
    case K_MODEL: return (c->model = dup_str(dc->model)) ? 0 : -1;
    case K_WEIGHTS_SEED: c->weights_seed = dc->weights_seed; return 0;
    case K_PROMPT:
        c->prompt = dc->prompt;
        c->prompt.text = NULL;
        return dc->prompt.text && !(c->prompt.text = dup_str(dc->prompt.text)) ? -1 : 0;
    case K_MAX_NEW: c->max_new = dc->max_new; return 0;
    case K_A: c->na = dc->na; c->ka = dc->ka; return (c->a = copy_argv(dc->a, dc->na)) ? 0 : -1;
    case K_B: c->nb = dc->nb; c->kb = dc->kb; return (c->b = copy_argv(dc->b, dc->nb)) ? 0 : -1;
    case K_GGUF: return (c->gguf = dup_str(dc->gguf)) ? 0 : -1;
    default:
        c->expect = dc->expect;
        return (c->expect_text = dup_str(dc->expect_text)) ? 0 : -1;
    }
}

static bool argv_injects(char **a, int n, int injection)
{
    for (int i = 0; i + 1 < n; i += 2)
        if (!strcmp(a[i], "--inject") && injection_index(a[i + 1]) == injection)
            return true;
    return false;
}

/* Applies [defaults], checks every case is complete. 0 or -1 (p->err set). */
static int finish_cases(parser *p)
{
    const section *d = NULL;
    for (int i = 0; i < p->n_secs; i++)
        if (!strcmp(p->secs[i].c.name, "defaults"))
            d = &p->secs[i];
    for (int i = 0; i < p->n_secs; i++) {
        section *s = &p->secs[i];
        if (s == d)
            continue;
        for (int k = 0; k < K_COUNT; k++) {
            if (s->has[k])
                continue;
            if (d && d->has[k]) {
                if (inherit(s, d, k) < 0)
                    return fail(p, s->c.line, "out of memory"), -1;
                s->has[k] = true;
                s->key_line[k] = d->key_line[k];
            } else if (k == K_MODEL || k == K_A || k == K_B || k == K_EXPECT) {
                return fail(p, s->c.line, "case '%s' has no '%s' (nor does [defaults])",
                            s->c.name, key_names[k]), -1;
            } else if (k == K_PROMPT) {
                s->c.prompt.kind = SUITE_PROMPT_RANDOM;   /* as `kvdiff run` */
                s->c.prompt.random_len = 32;
            } else if (k == K_MAX_NEW) {
                s->c.max_new = 16;
            }
        }
        /* A folder's weights are its files: a seed there would change
         * nothing, and must not read as if it did (kvdiff run refuses it). */
        s->c.weights_seed_given = s->has[K_WEIGHTS_SEED];
        kv_config preset;
        if (s->c.weights_seed_given && config_preset(s->c.model, &preset, NULL) < 0)
            return fail(p, s->key_line[K_WEIGHTS_SEED], "case '%s': weights_seed is the seed "
                        "of a preset's weights, and model '%s' is not a preset (a folder's "
                        "weights are its files)", s->c.name, s->c.model), -1;
        /* Presets have no tokenizer: a text prompt would fail in every run. */
        if ((s->c.prompt.kind == SUITE_PROMPT_TEXT ||
             s->c.prompt.kind == SUITE_PROMPT_TEXT_FILE) &&
            config_preset(s->c.model, &preset, NULL) == 0)
            return fail(p, s->key_line[K_PROMPT], "case '%s': a text prompt is encoded by the "
                        "model folder's tokenizer.json, and model '%s' is a preset, which "
                        "has none; give ids (a token list, file: or random:)", s->c.name,
                        s->c.model), -1;
        /* A GGUF no side reads would look as if it were tested. */
        if (s->c.gguf && s->c.ka != SUITE_SIDE_LLAMA && s->c.kb != SUITE_SIDE_LLAMA)
            return fail(p, s->key_line[K_GGUF], "case '%s': 'gguf' is read by a llama.cpp: "
                        "side only, and neither a nor b is one", s->c.name), -1;
        const suite_expect *x = &s->c.expect;
        if (x->kind == SUITE_EXPECT_DETECTS &&
            !(s->c.ka == SUITE_SIDE_KVDIFF && argv_injects(s->c.a, s->c.na, x->injection)) &&
            !(s->c.kb == SUITE_SIDE_KVDIFF && argv_injects(s->c.b, s->c.nb, x->injection)))
            return fail(p, s->key_line[K_EXPECT], "case '%s' expects %s to be detected but "
                        "neither a nor b has --inject %s", s->c.name,
                        chk_injection_name((chk_injection)x->injection),
                        chk_injection_name((chk_injection)x->injection)), -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* Entry points                                                         */

void suite_free(suite *s)
{
    if (!s)
        return;
    for (int i = 0; i < s->n_cases; i++)
        free_case(&s->cases[i]);
    free(s->cases);
    free(s->path);
    free(s->name);
    memset(s, 0, sizeof *s);
}

static char *folder_of(const char *path)
{
    const char *slash = strrchr(path, '/');
    if (!slash)
        return dup_str(".");
    size_t n = slash == path ? 1 : (size_t)(slash - path);
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, path, n);
        d[n] = 0;
    }
    return d;
}

static char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *b = dup_str(slash ? slash + 1 : path);
    size_t n = b ? strlen(b) : 0;
    if (n > 6 && !strcmp(b + n - 6, ".suite"))
        b[n - 6] = 0;
    return b;
}

/* Moves the parsed case sections (not [defaults]) into s. */
static int take_cases(parser *p, suite *s)
{
    s->cases = calloc(p->n_secs > 0 ? (size_t)p->n_secs : 1, sizeof *s->cases);
    if (!s->cases)
        return -1;
    for (int i = 0; i < p->n_secs; i++) {
        if (!strcmp(p->secs[i].c.name, "defaults"))
            continue;
        s->cases[s->n_cases++] = p->secs[i].c;
        memset(&p->secs[i].c, 0, sizeof p->secs[i].c);
    }
    return 0;
}

int suite_parse(const char *text, size_t len, const char *path, suite *s, kv_err *e)
{
    memset(s, 0, sizeof *s);
    parser p;
    memset(&p, 0, sizeof p);
    p.path = path;
    p.text = text;
    p.len = len;
    p.cur = -1;
    p.base_dir = folder_of(path);
    const char *nul = memchr(text, 0, len);
    int rc = -1;
    if (!p.base_dir) {
        kv_errf(e, "%s: out of memory", path);
        goto done;
    }
    if (nul) {
        int line = 1;
        for (const char *c = text; c < nul; c++)
            line += *c == '\n';
        kv_errf(e, "%s:%d: a NUL byte: not a text file", path, line);
        goto done;
    }
    int ini = ini_parse_stream(read_line, &p, on_key, &p);
    if (ini == -2) {
        kv_errf(e, "%s: out of memory", path);
        goto done;
    }
    if (ini > 0 && (!p.err_line || ini < p.err_line)) {
        kv_errf(e, "%s:%d: expected '[case-name]', 'key = value' or a comment", path, ini);
        goto done;
    }
    if (!p.err_line)
        finish_cases(&p);
    if (p.err_line) {
        kv_errf(e, "%s:%d: %s", path, p.err_line, p.err.msg);
        goto done;
    }
    if (take_cases(&p, s) < 0 || !(s->path = dup_str(path)) || !(s->name = base_name(path))) {
        kv_errf(e, "%s: out of memory", path);
        suite_free(s);
        goto done;
    }
    if (s->n_cases == 0) {
        kv_errf(e, "%s:1: no cases: a suite needs at least one [case-name] section", path);
        suite_free(s);
        goto done;
    }
    rc = 0;
done:
    for (int i = 0; i < p.n_secs; i++)
        free_case(&p.secs[i].c);
    free(p.secs);
    free(p.base_dir);
    return rc;
}

int suite_load(const char *path, suite *s, kv_err *e)
{
    memset(s, 0, sizeof *s);
    /* infile_open: a regular file, opened without blocking (a FIFO hung
     * the suite for ever; a folder was only found out at the read). */
    FILE *f = infile_open(path, SUITE_MAX_FILE + 1LL, e);
    if (!f) {
        if (errno == ENOENT)
            return kv_errf(e, "%s: cannot open: %s", path, strerror(ENOENT));
        return -1;
    }
    char *buf = malloc(SUITE_MAX_FILE + 1);
    size_t n = buf ? fread(buf, 1, SUITE_MAX_FILE + 1, f) : 0;
    int bad = !buf ? 1 : ferror(f) ? 2 : n > SUITE_MAX_FILE ? 3 : 0;
    fclose(f);
    int rc = -1;
    if (bad == 1)
        kv_errf(e, "%s: out of memory", path);
    else if (bad == 2)
        kv_errf(e, "%s: cannot read (is it a folder?)", path);
    else if (bad == 3)
        kv_errf(e, "%s: larger than %u MiB: not a suite file", path, SUITE_MAX_FILE >> 20);
    else
        rc = suite_parse(buf, n, path, s, e);
    free(buf);
    return rc;
}
