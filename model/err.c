/* err.c — formatting of kv_err messages. */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* strerror(EFBIG), "File too large", reads as a file grown too big for
 * its file system; what a user meets is the file-size limit of the shell
 * (ulimit -f). Said so, wherever a message quotes it (ours, or libhdf5's
 * error detail). */
void kv_err_words(kv_err *e)
{
    if (!e)
        return;
    char *msg = e->msg;
    const size_t n = sizeof e->msg;
    static const char from[] = "File too large";
    static const char to[] = "file size limit reached (ulimit -f)";
    char *at = strstr(msg, from);
    if (!at)
        return;
    char tail[sizeof e->msg];
    snprintf(tail, sizeof tail, "%s", at + sizeof from - 1);
    snprintf(at, n - (size_t)(at - msg), "%s%s", to, tail);
}

int kv_errf(kv_err *e, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
        kv_err_words(e);
    }
    return -1;
}

/* Whether msg already starts with prefix and a colon ("X.h5: ...",
 * "suite.txt:10: ..."): a callee that names its file itself. */
static int has_prefix(const char *msg, const char *prefix)
{
    const size_t n = strlen(prefix);
    return n > 0 && strncmp(msg, prefix, n) == 0 && msg[n] == ':';
}

int kv_err_prefix(kv_err *e, const char *prefix)
{
    if (e && prefix && !has_prefix(e->msg, prefix)) {
        /* The result is cut to the message size (checked, not an accident). */
        char tmp[sizeof e->msg];
        int n = snprintf(tmp, sizeof tmp, "%s: %s", prefix, e->msg);
        if (n < 0)
            return -1;
        memcpy(e->msg, tmp, sizeof tmp);
    }
    return -1;
}
