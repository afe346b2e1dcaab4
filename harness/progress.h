/* progress.h — a one-line progress bar on a terminal:
 *
 *     [#####.....] 12/40 cases  window-bug-g3
 *
 * redrawn in place with '\r' and erased at the end. It draws only when the
 * stream is a terminal (isatty); otherwise every call does nothing, so
 * logs and pipes never see it. Generic: any verb that walks a known number
 * of items (suite cases, compared layers, generated tokens) can use it. */
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
    long total;
    size_t drawn;                /* length of the line on screen, to erase it */
} progress;

/* Starts a bar of total items on f; draws nothing unless f is a terminal.
 * label names the items (copied, cut to fit). */
void progress_start(progress *p, FILE *f, const char *label, long total);

/* Redraws with done items finished; what (may be NULL) is shown after the
 * count, cut so the line fits PROGRESS_LINE_MAX columns. */
void progress_step(progress *p, long done, const char *what);

/* Erases the line; the bar is then off. Safe to call twice. */
void progress_end(progress *p);

/* The line progress_step draws, without '\r': "[####......] 3/10 cases  what"
 * (done is clamped to 0..total; total 0 draws an empty bar). Writes at most
 * n bytes including the NUL (n >= 1) and returns the line's length. */
size_t progress_render(char *buf, size_t n, const char *label, long done, long total,
                       const char *what);

#endif
