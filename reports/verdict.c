/* verdict.c — the words every page of a report shares, below them all:
 * the one-line verdict (summary.md, index.html, and `kvdiff compare -q`)
 * and how a logit margin is printed. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rep_internal.h"

/* ------------------------------------------------------------------ */
/* The verdict line                                                     */

static void verdict_body(const cmp_result *r, char *buf, size_t n)
{
    const cmp_divergence *d = &r->first;
    if (r->verdict != CMP_DIVERGED) {
        /* the first line of compare's own text says it all */
        char *t = cmp_render_text(r, 0);
        const char *s = t ? t : cmp_verdict_name(r->verdict);
        /* past the roles line: report_verdict_line says it its own way */
        if (r->swapped[0] && !strncmp(s, "SWAPPED?", 8) && strchr(s, '\n'))
            s = strchr(s, '\n') + 1;
        const char *nl = strchr(s, '\n');
        snprintf(buf, n, "%.*s", (int)(nl ? nl - s : (ptrdiff_t)strlen(s)), s);
        free(t);
        return;
    }
    if (!d->found) {
        const cmp_tokens *t = &r->tokens;
        if (r->config_diff[0])
            snprintf(buf, n, "diverged: the recordings' configs differ in what attention reads "
                     "(%s); no recorded stage steps above %s", r->config_diff,
                     r->xrt.on ? "drift" : "tolerance");
        else if (t->kind == CMP_TOKENS_DIFFER)
            snprintf(buf, n, "diverged: no recorded stage differs, but the tokens differ at "
                     "position %lld", (long long)t->pos);
        else if (t->kind == CMP_TOKENS_LENGTH)
            snprintf(buf, n, "diverged: no recorded stage differs, but the token counts do "
                     "(reference %lld, test %lld)", (long long)t->n_ref, (long long)t->n_test);
        else
            snprintf(buf, n, "diverged: no recorded stage differs (see below)");
        return;
    }
    char where[64];
    if (d->layer >= 0)
        snprintf(where, sizeof where, "layer %d", d->layer);
    else
        snprintf(where, sizeof where, "model level");
    /* the diagnosis in words; its id (cmp_diag_name) is for JSON */
    snprintf(buf, n, "diverged: first divergence at position %lld, %s, stage %s (%s)",
             (long long)d->pos, where, stage_name(d->stage),
             r->diag.summary[0] ? r->diag.summary : "no diagnosis");
}

void report_verdict_line(const cmp_result *r, char *buf, size_t n)
{
    if (!r->swapped[0]) {
        verdict_body(r, buf, n);
        return;
    }
    /* said before the verdict, which reads the other way round */
    char body[1024];
    verdict_body(r, body, sizeof body);
    snprintf(buf, n, "arguments look swapped (%s; the reference goes first): %s", r->swapped,
             body);
}

/* ------------------------------------------------------------------ */
/* The folder                                                           */

void rep_margin(FILE *f, double m)
{
    if (isfinite(m))
        fprintf(f, "%.3g", m);
    else
        fputs("n/a", f);
}
