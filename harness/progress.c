/* progress.c — the terminal progress bar (progress.h). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "progress.h"

size_t progress_render(char *buf, size_t n, const char *label, long done, long total,
                       const char *what)
{
    char line[PROGRESS_LINE_MAX + 1];
    char bar[PROGRESS_BAR_WIDTH + 1];
    if (done < 0)
        done = 0;
    if (total < 0)
        total = 0;
    if (done > total)
        done = total;
    int filled = total > 0 ? (int)((double)done * PROGRESS_BAR_WIDTH / (double)total) : 0;
    for (int i = 0; i < PROGRESS_BAR_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[PROGRESS_BAR_WIDTH] = 0;
    int len = snprintf(line, sizeof line, "[%s] %ld/%ld %s", bar, done, total,
                       label ? label : "");
    if (len < 0)
        len = 0;
    size_t used = (size_t)len < sizeof line ? (size_t)len : sizeof line - 1;
    if (what && *what && used + 2 < sizeof line) {
        /* what is cut to the room left: the line never wraps. */
        size_t room = sizeof line - 1 - used - 2;
        size_t wl = strlen(what);
        if (wl > room)
            wl = room;
        memcpy(line + used, "  ", 2);
        memcpy(line + used + 2, what, wl);
        used += 2 + wl;
        line[used] = 0;
    }
    if (n == 0)
        return used;
    size_t out = used < n - 1 ? used : n - 1;
    memcpy(buf, line, out);
    buf[out] = 0;
    return out;
}

void progress_start(progress *p, FILE *f, const char *label, long total)
{
    memset(p, 0, sizeof *p);
    p->f = f;
    p->on = f && isatty(fileno(f));
    p->total = total;
    snprintf(p->label, sizeof p->label, "%s", label ? label : "");
    progress_step(p, 0, NULL);
}

static void erase(progress *p)
{
    if (p->drawn) {
        fprintf(p->f, "\r%*s\r", (int)p->drawn, "");
        p->drawn = 0;
    }
}

void progress_step(progress *p, long done, const char *what)
{
    char line[PROGRESS_LINE_MAX + 1];
    if (!p->on)
        return;
    size_t len = progress_render(line, sizeof line, p->label, done, p->total, what);
    fprintf(p->f, "\r%s", line);
    if (len < p->drawn)   /* clear what a longer previous line left */
        fprintf(p->f, "%*s\r%s", (int)(p->drawn - len), "", line);
    p->drawn = len;
    fflush(p->f);
}

void progress_end(progress *p)
{
    if (p->on) {
        erase(p);
        fflush(p->f);
    }
    p->on = false;
}
