/* progress.h — a one-line progress bar on a terminal:
 *
 *     2/4 test fingerprints [#####.....] 512/1024 positions 0:12 eta 0:12
 *
 * redrawn in place with '\r' and erased at the end. It draws only when the
 * stream is a terminal (isatty); otherwise every call does nothing, so
 * logs and pipes never see it. Generic: any verb that walks a known number
 * of items (suite cases, compared layers, generated tokens, model tensors)
 * can use it. A phase names which of several passes is running; elapsed
 * time and an estimate of the time left follow the count. */
#ifndef KV_PROGRESS_H
#define KV_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#define PROGRESS_BAR_WIDTH 20
#define PROGRESS_LINE_MAX 79     /* columns a drawn line never exceeds */

typedef struct {
    FILE *f;                     /* where it draws (NULL: nowhere) */
    bool on;                     /* f is a terminal */
    char label[24];              /* "cases", "layers", ... */
    char phase[32];              /* "1/4 reference fingerprints", or "" */
    long total;
    double t0;                   /* monotonic seconds at progress_start */
    size_t drawn;                /* length of the line on screen, to erase it */
    char last[PROGRESS_LINE_MAX + 1];  /* the line on screen: an unchanged one
                                        * is not written again */
} progress;

/* Starts a bar of total items on f; draws nothing unless f is a terminal.
 * label names the items (copied, cut to fit). */
void progress_start(progress *p, FILE *f, const char *label, long total);

/* Sets the phase shown before the bar (copied, cut to fit; NULL or "" for
 * none) and redraws. Call after progress_start. */
void progress_phase(progress *p, const char *phase);

/* Redraws with done items finished; what (may be NULL) is shown after the
 * count, cut so the line fits PROGRESS_LINE_MAX columns. */
void progress_step(progress *p, long done, const char *what);

/* The same with a fraction of an item done (a batch part-way through its
 * layers): the bar and the estimate use it, the count shows whole items. */
void progress_stepf(progress *p, double done, const char *what);

/* Items done once layer (0-based, of n_layers) has finished a batch of
 * nrows items starting after done0 items: done0 + nrows x (layer + 1) /
 * n_layers (n_layers <= 0: the whole batch). */
double progress_batch_done(double done0, int nrows, int layer, int n_layers);

/* Erases the line; the bar is then off. Safe to call twice. */
void progress_end(progress *p);

/* The line progress_step draws, without '\r': "[####......] 3/10 cases  what"
 * (done is clamped to 0..total; total 0 draws an empty bar). Writes at most
 * n bytes including the NUL (n >= 1) and returns the line's length. */
size_t progress_render(char *buf, size_t n, const char *label, long done, long total,
                       const char *what);

/* The full line: "PHASE [####......] 3/10 cases 0:12 eta 0:40  what".
 * phase NULL or "" is left out; elapsed < 0 leaves out both times; the
 * estimate (elapsed x items left / items done) is shown once done > 0,
 * "eta -:--" before. Same contract as progress_render otherwise. */
size_t progress_render_full(char *buf, size_t n, const char *phase, const char *label,
                            double done, long total, double elapsed, const char *what);

/* Seconds as "m:ss", or "h:mm:ss" from an hour on (negative: "-:--"). */
void progress_clock(char *buf, size_t n, double seconds);

#endif
