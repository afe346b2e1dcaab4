/* report.h — a comparison as a folder a person opens: index.html (verdict,
 * first divergence, diagnosis, tokens, per-stage metrics, plots),
 * summary.md (the same for a CI comment), result.json, and gnuplot plots
 * with their data and scripts in plots/.
 *
 * The content comes from a cmp_result (the comparer's own text and JSON
 * renderers are reused, so the report says what `kvdiff compare` says);
 * the plots need the rows, read from two cmp_source in blocks of
 * positions (never a whole recording). A result read back from the JSON
 * of `kvdiff compare --json` makes a report without the recordings: the
 * plots that need rows are then left out and the report says why.
 *
 * gnuplot runs as an external program. Without it every file but the
 * images is still written. Nothing here prints: what the caller should
 * tell the user comes back in report_info. */
#ifndef KV_REPORT_H
#define KV_REPORT_H

#include <stdbool.h>
#include <stdint.h>
#include "../compare/compare.h"
#include "../model/err.h"

/* ------------------------------------------------------------------ */
/* Row-error series (series.c)                                          */

/* What a grid's values are: max |test - ref| over each row (ABS); that
 * over max |ref| of the row (REL, as the cross-runtime compare weighs
 * rows); REL over the drift threshold the row was judged against
 * (THRESHOLD: 1 = the threshold, above it beyond drift). */
typedef enum { REPORT_UNITS_ABS, REPORT_UNITS_REL, REPORT_UNITS_THRESHOLD } report_units;

/* Row error of one stage over layers x positions, in `units`. From
 * fingerprint-only recordings (no rows, only row hashes) the value is 0
 * (hash equal) or 1 (hash differs) and hashed is set. */
typedef struct {
    kv_stage stage;
    report_units units;
    int n_layers;
    int64_t pos_lo, n_pos;       /* positions pos_lo .. pos_lo + n_pos - 1 */
    double *err;                 /* (n_layers, n_pos); NaN: not held by both */
    bool hashed;                 /* some layer compared by row hash only */
    bool any_nonfinite;          /* some row had NaN / Inf on one side only
                                  * (its error is +inf) */
    int64_t rows;                /* rows compared */
} report_grid;

/* Fills g for layer stage st (st < STAGE_LAYER_COUNT) of every layer of
 * ref's config, reading block_rows positions at a time (<= 0: 64). Rows
 * are compared where both sources hold them. Returns 0, or -1 with e
 * filled (a read error, out of memory, st not a layer stage). g is safe
 * to report_grid_free after either. */
int report_grid_build(const cmp_source *ref, const cmp_source *test, kv_stage st,
                      int block_rows, report_grid *g, kv_err *e);
/* The same in row-relative units (REPORT_UNITS_REL). */
int report_grid_build_rel(const cmp_source *ref, const cmp_source *test, kv_stage st,
                          int block_rows, report_grid *g, kv_err *e);
void report_grid_free(report_grid *g);   /* accepts NULL; leaves *g zeroed */

/* Puts the REL grids g[0..n-1] (at most REPORT_MAX_GRIDS) of a
 * cross-runtime result r (r->xrt.on; otherwise nothing is done) into
 * units of its verdict, REPORT_UNITS_THRESHOLD: each row's error over the
 * threshold the drift model judged it against, got by running the
 * comparison again with cmp_opts.xrt_row. Rows the model did not judge
 * (after its step) are taken over the threshold their (layer, stage) had
 * where the walk stopped. When the comparison run again does not give r's
 * verdict and first divergence (the dumps changed since), the grids are
 * left REL. Returns 0, or -1 with e filled (a read error, out of memory,
 * a refusal of the comparison). */
enum { REPORT_MAX_GRIDS = 4 };
int report_grids_to_threshold(const cmp_source *ref, const cmp_source *test,
                              const cmp_result *r, report_grid *const *g, int n,
                              int block_rows, kv_err *e);

/* Error of (layer, position) or NaN outside the grid / not compared. */
double report_grid_at(const report_grid *g, int layer, int64_t pos);

/* One generated step: the next-token distributions of both runs at
 * position pos (the token at pos + 1 is step pos + 1 - prompt_length). */
typedef struct {
    int64_t step, pos;
    double kl;                   /* KL(ref || test) over the reference's top-k
                                  * (a test logit outside its top-k counts as its
                                  * k-th value): approximate */
    double ref_margin, test_margin;  /* top-1 minus top-2 logit; NaN when k = 1 */
    int32_t ref_top1, test_top1;
} report_step;

/* The steps both sources' /output hold, from the last prompt position on.
 * *steps is malloc'd (the caller frees; NULL and 0 when there are none).
 * Returns 0 or -1 with e filled on a read error. */
int report_steps_build(const cmp_source *ref, const cmp_source *test, report_step **steps,
                       int64_t *n, kv_err *e);

/* ------------------------------------------------------------------ */
/* A compare result read back from JSON (jsonin.c)                      */

typedef struct {
    cmp_result r;                /* as cmp_compare would have filled it (the stage
                                  * sums are set so cosine and NMSE come out as the
                                  * JSON says) */
    bool has_stages;             /* the JSON carried the per-stage table; otherwise
                                  * r.stages holds only the model-level stages the
                                  * JSON names, with no metrics */
    char *ref_path, *test_path;  /* "inputs" of the JSON, or NULL */
} report_json;

/* Reads the file written by `kvdiff compare --json` (the "stages" table
 * optional). Returns 0, or -1 with e naming the file and the problem (not
 * JSON, a key missing or of the wrong type, an unknown verdict or stage
 * name). j is safe to report_json_free after either. */
int report_json_load(const char *path, report_json *j, kv_err *e);
void report_json_free(report_json *j);   /* accepts NULL */

/* ------------------------------------------------------------------ */
/* Writing a report (report.c, plot.c, html.c, markdown.c)               */

typedef struct {
    int stage;                   /* layer stage for every row plot; -1: the
                                  * heatmap shows the first divergence's stage
                                  * (else x_out) and the other plots x_out */
    int layers[16];              /* layers of the along-positions plot */
    int n_layers;                /* 0: divergence layer, first and last layer */
    const char *gnuplot;         /* program; NULL: $GNUPLOT, else "gnuplot" on PATH */
    const char *ref_path;        /* shown as the inputs (may be NULL) */
    const char *test_path;
    bool has_stages;             /* r carries the per-stage table (always true for
                                  * a fresh comparison) */
    int block_rows;              /* positions per read; <= 0: 64 */
    const char *note;            /* shown under the verdict, e.g. what a suite
                                  * case expected (NULL: none) */
} report_opts;

void report_opts_default(report_opts *o);

enum { REPORT_MAX_PLOTS = 4 };

typedef struct {
    char index_path[4200];       /* outdir/index.html */
    int plots_drawn;             /* images written */
    bool gnuplot_missing;        /* no gnuplot: plots skipped */
    char gnuplot_error[1024];    /* a script gnuplot failed on and its first error
                                  * line ("" when none) */
} report_info;

/* Writes the report for r into outdir (created when missing; its parent
 * must exist). ref and test: the two recordings r was made from, or both
 * NULL (a result from JSON: only the plots the result supports). Writes
 * plots/, result.json and summary.md first and index.html last (through a
 * temporary name), so a folder whose index.html is present is complete; an
 * index.html from an earlier report is removed first. Returns 0 (missing
 * or failing gnuplot is not an error: info says so), or -1 with e filled:
 * outdir not a folder or not writable, a read error, out of memory. */
int report_write(const char *outdir, const cmp_result *r, const cmp_source *ref,
                 const cmp_source *test, const report_opts *o, report_info *info, kv_err *e);

/* The one-line verdict the report opens with, e.g. "diverged: first
 * divergence at position 4, layer 0, stage attn_lse (window: attention
 * read a different key set ...)", or compare's own first line when the
 * runs are the same. Written into buf (n bytes, truncated). */
void report_verdict_line(const cmp_result *r, char *buf, size_t n);

/* The message for a missing gnuplot, one line. */
#define REPORT_NO_GNUPLOT "gnuplot not found; plots skipped (install it: apt-get install gnuplot-nox)"

#endif
