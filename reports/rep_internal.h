/* rep_internal.h — what the parts of a report share: the plan of the
 * plots (which were drawn, which left out and why) and the context the
 * HTML and Markdown writers render. Not part of the public API. */
#ifndef KV_REP_INTERNAL_H
#define KV_REP_INTERNAL_H

#include <stdio.h>
#include "report.h"

typedef enum { PLOT_HEATMAP, PLOT_GROWTH, PLOT_POSITIONS, PLOT_STEPS, PLOT_COUNT } rep_plot_id;

typedef struct {
    const char *name;            /* file stem in plots/: "heatmap" */
    const char *heading;         /* "Row error heatmap" */
    char caption[1024];          /* what it shows (stage, approximations) */
    bool data;                   /* .dat and .gp written */
    bool drawn;                  /* .png and .svg written by gnuplot */
    char why[1024];              /* not drawn: why ("" when drawn) */
} rep_plot;

typedef struct {
    const cmp_result *r;
    const report_opts *o;
    const cmp_source *ref, *test;   /* both NULL: from JSON */
    char *text;                  /* cmp_render_text with the stages table off */
    rep_plot plots[PLOT_COUNT];
    bool gnuplot_missing;
    char gnuplot_error[1024];
    char partial[512];           /* which recording is partial ("" none) */
    const char *plots_dir;       /* where the PNGs are, to embed them in the page */
} rep_ctx;

/* plot.c: writes the .dat and .gp of every plot the inputs support into
 * dir and runs gnuplot on each. Fills c->plots, gnuplot_missing,
 * gnuplot_error. -1 with e filled only on a read or write error. */
int rep_plots_write(rep_ctx *c, const char *dir, kv_err *e);

/* A logit margin, or "n/a" when unknown (NaN). */
void rep_margin(FILE *f, double m);

/* html.c / markdown.c: the page and the CI summary. */
void rep_html_write(const rep_ctx *c, FILE *f);
void rep_markdown_write(const rep_ctx *c, FILE *f);

/* The layer stage the heatmap shows, and the one the growth and position
 * plots show. */
kv_stage rep_heatmap_stage(const cmp_result *r, const report_opts *o);
kv_stage rep_growth_stage(const report_opts *o);

#endif
