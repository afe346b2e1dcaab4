/* err.h — the one error type every library function fills.
 *
 * Library code never prints and never exits: it returns -1 (or NULL) and
 * writes a one-line message naming the file and the problem into a kv_err
 * the caller owns. Only main() and tests print it. */
#ifndef KV_ERR_H
#define KV_ERR_H

#include <stddef.h>

typedef struct {
    char msg[1024];
} kv_err;

/* Formats the message (printf style) into e (e may be NULL) and returns -1,
 * so callers can write `return kv_errf(e, "...")`. */
int kv_errf(kv_err *e, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Says strerror(EFBIG)'s "File too large" in the message as what a user
 * meets: "file size limit reached (ulimit -f)". kv_errf does it; a
 * formatter of its own calls it. */
void kv_err_words(kv_err *e);

/* Prepends "prefix: " to an existing message (used to add a file name),
 * unless the message already starts with prefix and a colon: a file is
 * named once, however many callers add it. */
int kv_err_prefix(kv_err *e, const char *prefix);

#endif
