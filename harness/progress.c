/* progress.c — the terminal progress bar (progress.h). */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "progress.h"

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void progress_clock(char *buf, size_t n, double seconds)
{
    if (!(seconds >= 0) || seconds > 359999) {   /* NaN, negative, or absurd */
        snprintf(buf, n, "-:--");
        return;
    }
    long s = (long)(seconds + 0.5);
    if (s >= 3600)
        snprintf(buf, n, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else
        snprintf(buf, n, "%ld:%02ld", s / 60, s % 60);
}

size_t progress_render_full(char *buf, size_t n, const char *phase, const char *label,
                            double done, long total, double elapsed, const char *what)
{
    char line[PROGRESS_LINE_MAX + 1];
    char bar[PROGRESS_BAR_WIDTH + 1];
    char times[48] = "";
    if (!(done >= 0))
        done = 0;
    if (total < 0)
        total = 0;
    if (done > (double)total)
        done = (double)total;
    int filled = total > 0 ? (int)(done * PROGRESS_BAR_WIDTH / (double)total) : 0;
    for (int i = 0; i < PROGRESS_BAR_WIDTH; i++)
        bar[i] = i < filled ? '#' : '.';
    bar[PROGRESS_BAR_WIDTH] = 0;
    if (elapsed >= 0) {
        char el[16], eta[16];
        progress_clock(el, sizeof el, elapsed);
        /* The rate so far, projected over what is left: crude, but it is
         * what a user estimates by eye, and it settles as work goes on. */
        progress_clock(eta, sizeof eta,
                       done > 0 ? elapsed * ((double)total - done) / done : -1);
        if (total > 0)
            snprintf(times, sizeof times, " %s eta %s", el, eta);
        else
            snprintf(times, sizeof times, " %s", el);
    }
    /* No total yet (a checkpoint whose catalogue is still being read): no
     * count, no estimate, rather than "0/0". */
    char count[48] = "";
    if (total > 0)
        snprintf(count, sizeof count, " %ld/%ld", (long)done, total);
    int len = snprintf(line, sizeof line, "%s%s[%s]%s%s%s%s", phase && *phase ? phase : "",
                       phase && *phase ? " " : "", bar, count, label && *label ? " " : "",
                       label ? label : "", times);
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

size_t progress_render(char *buf, size_t n, const char *label, long done, long total,
                       const char *what)
{
    return progress_render_full(buf, n, NULL, label, (double)done, total, -1, what);
}

void progress_start(progress *p, FILE *f, const char *label, long total)
{
    memset(p, 0, sizeof *p);
    p->f = f;
    p->on = f && isatty(fileno(f));
    p->total = total;
    p->t0 = mono_now();
    snprintf(p->label, sizeof p->label, "%s", label ? label : "");
    progress_step(p, 0, NULL);
}

void progress_phase(progress *p, const char *phase)
{
    snprintf(p->phase, sizeof p->phase, "%s", phase ? phase : "");
    progress_step(p, 0, NULL);
}

static void erase(progress *p)
{
    if (p->drawn) {
        fprintf(p->f, "\r%*s\r", (int)p->drawn, "");
        p->drawn = 0;
        p->last[0] = 0;
    }
}

void progress_stepf(progress *p, double done, const char *what)
{
    char line[PROGRESS_LINE_MAX + 1];
    if (!p->on)
        return;
    size_t len = progress_render_full(line, sizeof line, p->phase, p->label, done, p->total,
                                      mono_now() - p->t0, what);
    /* Per-layer steps come many times a second: only a changed line is
     * written, so the terminal sees at most a few writes per second. */
    if (p->drawn && !strcmp(line, p->last))
        return;
    fprintf(p->f, "\r%s", line);
    if (len < p->drawn)   /* clear what a longer previous line left */
        fprintf(p->f, "%*s\r%s", (int)(p->drawn - len), "", line);
    p->drawn = len;
    memcpy(p->last, line, len + 1);
    fflush(p->f);
}

void progress_step(progress *p, long done, const char *what)
{
    progress_stepf(p, (double)done, what);
}

double progress_batch_done(double done0, int nrows, int layer, int n_layers)
{
    if (n_layers <= 0)
        return done0 + nrows;
    return done0 + (double)nrows * (double)(layer + 1) / (double)n_layers;
}

void progress_end(progress *p)
{
    if (p->on) {
        erase(p);
        fflush(p->f);
    }
    p->on = false;
}
