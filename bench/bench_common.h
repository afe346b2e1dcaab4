/* bench_common.h — what every benchmark program needs: a monotonic clock
 * and the commit it measures (for the rows of bench/results.tsv). */
#ifndef KV_BENCH_COMMON_H
#define KV_BENCH_COMMON_H

#include <stdio.h>
#include <string.h>
#include <time.h>

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Short hash of HEAD, or "unknown" outside a git checkout. */
static inline void git_head(char *buf, size_t n)
{
    FILE *p = popen("git rev-parse --short HEAD 2>/dev/null", "r");
    buf[0] = 0;
    if (p) {
        if (!fgets(buf, (int)n, p))
            buf[0] = 0;
        pclose(p);
    }
    buf[strcspn(buf, "\n")] = 0;
    if (!buf[0])
        snprintf(buf, n, "unknown");
}

#endif
