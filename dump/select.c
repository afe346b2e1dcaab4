/* select.c — what a dump records: the default selection and the strict
 * parsers of --dump-layers, --dump-positions and --dump-stages. No HDF5
 * here; a parser changes *o only when the whole argument is valid. */
#include "dump.h"

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void dump_opts_default(dump_opts *o)
{
    memset(o, 0, sizeof *o);
    o->layer_lo = 0;
    o->layer_hi = INT32_MAX;
    o->pos_lo = 0;
    o->pos_hi = INT64_MAX;
    for (int s = 0; s < STAGE_COUNT; s++)
        o->stages[s] = s != STAGE_LOGITS && s != STAGE_FINAL_NORM;
    o->topk = 8;
    o->block_rows = 64;
    o->row_hashes = true;
}

/* ------------------------------------------------------------------ */
/* Ranges                                                               */

/* Parses the decimal digits s[0..len) (no sign, no blanks) into *out.
 * Returns -1 when empty, not all digits, or above max. */
static int parse_bound(const char *s, size_t len, int64_t max, int64_t *out)
{
    if (len == 0 || len > 19)
        return -1;
    char buf[20];
    memcpy(buf, s, len);
    buf[len] = 0;
    for (size_t i = 0; i < len; i++)
        if (!isdigit((unsigned char)buf[i]))
            return -1;
    errno = 0;
    long long v = strtoll(buf, NULL, 10);
    if (errno == ERANGE || v > max)
        return -1;
    *out = v;
    return 0;
}

/* "A:B", "A:", ":B" or "N" into [*lo, *hi]; open ends become 0 and max. */
static int parse_range(const char *opt, const char *s, int64_t max, int64_t *lo, int64_t *hi,
                       kv_err *e)
{
    const char *colon = s ? strchr(s, ':') : NULL;
    int64_t a = 0, b = max;
    int bad;
    if (!s)
        return kv_errf(e, "%s: missing range (A:B, A:, :B or N)", opt);
    if (!colon) {
        bad = parse_bound(s, strlen(s), max, &a);
        b = a;
    } else {
        size_t la = (size_t)(colon - s), lb = strlen(colon + 1);
        /* ":" alone names neither end: refuse it rather than guess "all". */
        bad = (la == 0 && lb == 0) || strchr(colon + 1, ':') != NULL ||
              (la > 0 && parse_bound(s, la, max, &a) < 0) ||
              (lb > 0 && parse_bound(colon + 1, lb, max, &b) < 0);
    }
    if (bad)
        return kv_errf(e, "%s: '%s' is not a range (A:B, A:, :B or N; non-negative integers "
                          "up to %lld)", opt, s, (long long)max);
    if (b < a)
        return kv_errf(e, "%s: '%s' is empty: the end %lld is before the start %lld", opt, s,
                       (long long)b, (long long)a);
    *lo = a;
    *hi = b;
    return 0;
}

int dump_parse_layers(const char *s, dump_opts *o, kv_err *e)
{
    int64_t lo, hi;
    if (parse_range("--dump-layers", s, INT32_MAX, &lo, &hi, e) < 0)
        return -1;
    o->layer_lo = (int)lo;
    o->layer_hi = (int)hi;
    return 0;
}

int dump_parse_positions(const char *s, dump_opts *o, kv_err *e)
{
    return parse_range("--dump-positions", s, INT64_MAX, &o->pos_lo, &o->pos_hi, e);
}

/* ------------------------------------------------------------------ */
/* Stages                                                               */

static void list_stages(char *buf, size_t n)
{
    size_t used = 0;
    buf[0] = 0;
    for (int s = 0; s < STAGE_COUNT && used < n; s++) {
        int w = snprintf(buf + used, n - used, "%s%s", s ? ", " : "", stage_name((kv_stage)s));
        if (w < 0)
            break;
        used += (size_t)w;
    }
}

int dump_parse_stages(const char *s, dump_opts *o, kv_err *e)
{
    bool set[STAGE_COUNT] = {false};
    const char *p = s;
    if (!s || !*s)
        return kv_errf(e, "--dump-stages: empty list (give stage names separated by commas)");
    for (;;) {
        size_t len = strcspn(p, ",");
        char name[64];
        if (len == 0)
            return kv_errf(e, "--dump-stages: empty stage name in '%s'", s);
        snprintf(name, sizeof name, "%.*s", (int)(len < sizeof name - 1 ? len : sizeof name - 1), p);
        int st = len < sizeof name - 1 ? stage_parse(name) : -1;
        if (st < 0) {
            char valid[512];
            list_stages(valid, sizeof valid);
            return kv_errf(e, "--dump-stages: unknown stage '%.*s' (valid: %s)", (int)len, p, valid);
        }
        set[st] = true;
        if (p[len] == 0)
            break;
        p += len + 1;
    }
    memcpy(o->stages, set, sizeof set);
    /* Naming logits asks for them stored, as --dump-logits does. */
    if (set[STAGE_LOGITS])
        o->full_logits = true;
    return 0;
}
