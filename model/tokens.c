/* tokens.c — parsing token-id lists (tokens.h). */
#include "tokens.h"
#include "infile.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOKENS_MAX_FILE (64u << 20)

static int is_sep(char ch)
{
    return ch == ',' || ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r';
}

/* Where item start sits in text, for messages about a file: "line L, byte
 * B" (both from 1). */
static void where_in(const char *text, size_t start, char *buf, size_t n)
{
    size_t line = 1, col = 1;
    for (size_t i = 0; i < start; i++, col++)
        if (text[i] == '\n')
            line++, col = 0;
    snprintf(buf, n, "line %zu, byte %zu", line, col);
}

/* echo: quote the offending item (text the user typed on the command
 * line); else name only its line and byte, since a file that is no token
 * list may be anything (a file named by mistake, /etc/passwd) and its
 * contents must not reach a terminal or a log. */
static int parse_ids(const char *text, size_t len, const char *name, int vocab, bool echo,
                     int32_t **ids, int *n, kv_err *e)
{
    size_t cap = 64, count = 0, i = 0;
    int32_t *out = malloc(cap * sizeof *out);
    if (!out)
        return kv_errf(e, "%s: out of memory", name);
    while (i < len) {
        if (is_sep(text[i])) {
            i++;
            continue;
        }
        size_t start = i;
        int64_t v = 0;
        int digits = 1, big = 0;
        while (i < len && !is_sep(text[i])) {
            char ch = text[i++];
            if (ch < '0' || ch > '9')
                digits = 0;
            else if (!big && (v = v * 10 + (ch - '0')) > INT32_MAX)
                big = 1;
        }
        int shown = (int)(i - start > 24 ? 24 : i - start);
        if (!digits || big || (vocab > 0 && v >= vocab)) {
            free(out);
            if (!echo) {
                char at[64];
                where_in(text, start, at, sizeof at);
                return kv_errf(e, "%s: %s (item %zu): %s", name, at, count + 1,
                               !digits ? "not a token id (a non-negative integer); this is "
                                         "no token list"
                                       : "a token id outside the vocabulary");
            }
            if (!digits)
                return kv_errf(e, "%s: item %zu '%.*s' is not a token id (a non-negative integer)",
                               name, count + 1, shown, text + start);
            return kv_errf(e, "%s: item %zu: token id %.*s is outside the vocabulary (0..%d)",
                           name, count + 1, shown, text + start, vocab > 0 ? vocab - 1 : INT32_MAX);
        }
        if (count == cap) {
            int32_t *grown = count >= INT32_MAX / 2 ? NULL : realloc(out, 2 * cap * sizeof *out);
            if (!grown) {
                free(out);
                return kv_errf(e, "%s: too many tokens", name);
            }
            out = grown;
            cap *= 2;
        }
        out[count++] = (int32_t)v;
    }
    if (count == 0) {
        free(out);
        return kv_errf(e, "%s: no token ids", name);
    }
    *ids = out;
    *n = (int)count;
    return 0;
}

int tokens_parse(const char *text, size_t len, const char *name, int vocab, int32_t **ids,
                 int *n, kv_err *e)
{
    return parse_ids(text, len, name, vocab, true, ids, n, e);
}

int tokens_load(const char *path, int vocab, int32_t **ids, int *n, kv_err *e)
{
    char *buf = NULL;
    size_t len = 0;
    if (infile_read_all(path, TOKENS_MAX_FILE, &buf, &len, e) < 0)
        return -1;
    int rc = parse_ids(buf, len, path, vocab, false, ids, n, e);
    free(buf);
    return rc;
}
