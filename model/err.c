/* err.c — formatting of kv_err messages. */
#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int kv_errf(kv_err *e, const char *fmt, ...)
{
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int kv_err_prefix(kv_err *e, const char *prefix)
{
    if (e) {
        /* The result is cut to the message size (checked, not an accident). */
        char tmp[sizeof e->msg];
        int n = snprintf(tmp, sizeof tmp, "%s: %s", prefix, e->msg);
        if (n < 0)
            return -1;
        memcpy(e->msg, tmp, sizeof tmp);
    }
    return -1;
}
