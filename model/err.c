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
        char tmp[sizeof e->msg];
        snprintf(tmp, sizeof tmp, "%s: %s", prefix, e->msg);
        memcpy(e->msg, tmp, sizeof tmp);
    }
    return -1;
}
