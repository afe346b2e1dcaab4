/* plot.c — the report's plots: for each, a plain-text data file (.dat,
 * columns under a header comment) and a gnuplot script (.gp, relative
 * paths) that draws it as PNG (pngcairo) and SVG, kept side by side in
 * plots/ so a user can restyle and re-run `gnuplot heatmap.gp` there.
 * gnuplot runs as an external program from that folder. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "rep_internal.h"
#include "../model/outfile.h"

/* Bit-identical rows (error 0) are drawn at this floor, or a decade
 * below the smallest non-zero error when that is smaller. */
#define ERR_FLOOR 1e-12
/* Non-finite row errors are written as this in the plotted column. */
#define ERR_CEIL 1e30
#define MAX_LINES 48             /* chunk boundaries drawn at most: past it, about
                                  * 16 pixels a chunk, they would cover the plot */
#define ZOOM_ABOVE 160           /* a heatmap of more positions is drawn around
                                  * the first divergence ... */
#define ZOOM_HALF 48             /* ... this many positions either side */
/* A cross-runtime report draws error / drift threshold on this one scale,
 * whatever the run, so two reports' pictures compare at a glance: 1 is
 * the threshold, in the middle; ratios outside are drawn at its ends. */
#define RATIO_LO 1e-3
#define RATIO_HI 1e3

/* ------------------------------------------------------------------ */
/* Files                                                                */

/* Each file goes through a fresh temporary name and a rename (outfile.h),
 * so a symlink planted at plots/NAME is replaced, never followed. */
typedef struct {
    FILE *f;
    outfile o;
} out_file;

static int out_open(out_file *o, const char *dir, const char *name, kv_err *e)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (outfile_open(&o->o, path, e) < 0)
        return -1;
    o->f = o->o.f;
    return 0;
}

static int out_close(out_file *o, kv_err *e)
{
    if (!o->f)
        return 0;
    o->f = NULL;
    return outfile_commit(&o->o, e);
}

static void num(FILE *f, double x)
{
    if (isnan(x))
        fputs(" NaN", f);
    else if (isinf(x))
        fputs(x > 0 ? " Inf" : " -Inf", f);
    else
        fprintf(f, " %.9g", x);
}

/* ------------------------------------------------------------------ */
/* What the plots show                                                  */

kv_stage rep_growth_stage(const report_opts *o)
{
    return o->stage >= 0 && o->stage < STAGE_LAYER_COUNT ? (kv_stage)o->stage : STAGE_X_OUT;
}

kv_stage rep_heatmap_stage(const cmp_result *r, const report_opts *o)
{
    if (o->stage >= 0 && o->stage < STAGE_LAYER_COUNT)
        return (kv_stage)o->stage;
    if (r->first.found && r->first.layer >= 0 && r->first.stage < STAGE_LAYER_COUNT)
        return r->first.stage;
    return STAGE_X_OUT;
}

typedef struct {
    const rep_ctx *c;
    int window;                  /* the config's sliding window; 0 none */
    long chunk;                  /* the test's prefill chunk; 0 none */
    int64_t prompt;              /* chunks split the prompt only: its length */
    int n_layers;
} geometry;

static long settings_chunk(const cmp_source *s)
{
    if (!s || !s->settings_json)
        return 0;
    json_t *j = json_loads(s->settings_json, 0, NULL);
    json_t *v = json_object_get(j, "chunk");
    long c = json_is_integer(v) && json_integer_value(v) > 0 ? (long)json_integer_value(v) : 0;
    json_decref(j);
    return c;
}

static bool in_threshold(const report_grid *g)
{
    return !g->hashed && g->units == REPORT_UNITS_THRESHOLD;
}

static double grid_floor(const report_grid *g)
{
    if (in_threshold(g))
        return RATIO_LO;
    double lo = INFINITY;
    for (size_t i = 0; i < (size_t)g->n_layers * (size_t)g->n_pos; i++)
        if (g->err[i] > 0 && g->err[i] < lo)
            lo = g->err[i];
    return lo / 10 < ERR_FLOOR ? pow(10, floor(log10(lo / 10))) : ERR_FLOOR;
}

/* The largest finite row error; 0 when every row is bit-identical. */
static double grid_max(const report_grid *g)
{
    double hi = 0;
    for (size_t i = 0; i < (size_t)g->n_layers * (size_t)g->n_pos; i++)
        if (isfinite(g->err[i]) && g->err[i] > hi)
            hi = g->err[i];
    return g->any_nonfinite ? INFINITY : hi;
}

/* Script opening: both terminals are driven from one plot via `replot`.
 * The images go to outdir (default: this folder); the report sets it to a
 * private scratch folder and moves the images into place itself. */
static void gp_head(FILE *f, const char *name, const char *what)
{
    fprintf(f, "# kvdiff report: %s\n# Data: %s.dat. Re-run from this folder: gnuplot %s.gp\n"
               "if (!exists(\"outdir\")) outdir = ''\n"
               "set terminal pngcairo noenhanced size 1000,560 font 'sans,10'\n"
               "set output outdir.'%s.png'\n", what, name, name, name);
}

static void gp_tail(FILE *f, const char *name, const char *plot)
{
    fprintf(f, "%s\n\nset terminal svg noenhanced size 1000,560 dynamic font 'sans,10'\n"
               "set output outdir.'%s.svg'\nreplot\nunset output\n", plot, name);
}

enum { LINE_WINDOW = 1, LINE_CHUNKS = 2, LINE_TOKENS = 4, LINE_CHUNKS_DENSE = 8 };

/* Vertical lines at the sliding-window boundary, the chunk boundaries and
 * the first position whose input token differs, each at the left edge of
 * that position's cell. Chunk lines take chunk_rgb (white on the heatmap's
 * colours, grey on a white plot). Returns the LINE_* drawn, so captions
 * name only what is there. */
static unsigned gp_boundaries(FILE *f, const geometry *g, int64_t lo, int64_t hi,
                              const char *chunk_rgb)
{
    unsigned drawn = 0;
    if (g->window > 0 && g->window > lo && g->window <= hi) {
        fprintf(f, "set arrow from %g, graph 0 to %g, graph 1 nohead lw 2 dt 2 lc rgb '#1f77b4' "
                   "front\nset label 'window %d' at %g, graph 1.02 center tc rgb '#1f77b4'\n",
                g->window - 0.5, g->window - 0.5, g->window, g->window - 0.5);
        drawn |= LINE_WINDOW;
    }
    const int64_t chunk_hi = hi < g->prompt - 1 ? hi : g->prompt - 1;
    if (g->chunk > 0 && chunk_hi > lo && (chunk_hi - lo) / g->chunk > MAX_LINES)
        drawn |= LINE_CHUNKS_DENSE;
    else if (g->chunk > 0)
        for (int64_t p = (lo / g->chunk + 1) * g->chunk; p <= hi && p < g->prompt; p += g->chunk)
            if (p != g->window) {
                fprintf(f, "set arrow from %g, graph 0 to %g, graph 1 nohead lw 1.5 dt 3 "
                           "lc rgb '%s' front\n", p - 0.5, p - 0.5, chunk_rgb);
                drawn |= LINE_CHUNKS;
            }
    const int64_t cut = g->c->r->compared.pos_cut;
    if (cut > lo && cut <= hi) {
        fprintf(f, "set arrow from %g, graph 0 to %g, graph 1 nohead lw 2 lc rgb '#000000' front\n"
                   "set label 'tokens differ' at %g, graph 1.02 center tc rgb '#000000'\n",
                cut - 0.5, cut - 0.5, cut - 0.5);
        drawn |= LINE_TOKENS;
    }
    return drawn;
}

/* The caption's account of the lines gp_boundaries drew (nothing when
 * none): appended to buf. */
static void caption_lines(char *buf, size_t n, unsigned drawn, const geometry *g,
                          const char *chunk_style)
{
    size_t used = strlen(buf);
    if (drawn & LINE_WINDOW)
        used += (size_t)snprintf(buf + used, used < n ? n - used : 0,
                                 " Dashed blue line: the sliding-window boundary (window %d).",
                                 g->window);
    if ((drawn & LINE_CHUNKS) && used < n)
        used += (size_t)snprintf(buf + used, n - used,
                                 " %s lines: the test's prefill chunk boundaries (every %ld "
                                 "positions of the prompt).", chunk_style, g->chunk);
    if ((drawn & LINE_CHUNKS_DENSE) && used < n)
        used += (size_t)snprintf(buf + used, n - used,
                                 " The test's prefill chunk boundaries (every %ld positions) are "
                                 "not drawn: at this scale they would cover the plot.", g->chunk);
    if ((drawn & LINE_TOKENS) && used < n)
        snprintf(buf + used, n - used,
                 " Solid black line: the first position whose input token differs; rows "
                 "from there on have other inputs, are not compared and are left blank.");
}

/* Rows from the first position whose input token differs on are not
 * compared (the comparer stops there): plotted as "not compared" (NaN),
 * never coloured as errors. */
static void grid_cut(report_grid *g, int64_t cut)
{
    if (cut < 0)
        return;
    for (int l = 0; l < g->n_layers; l++)
        for (int64_t p = cut > g->pos_lo ? cut - g->pos_lo : 0; p < g->n_pos; p++)
            g->err[(size_t)l * (size_t)g->n_pos + (size_t)p] = NAN;
}

/* Log axes read the same in every plot: 1e-12 ... 1e+02. */
#define GP_LOG_FORMAT "set format y '%%.0e'\n"   /* inside a printf format */

/* The y axis of a line plot in units of a cross-runtime verdict: log
 * scale over the one range every report uses, values clamped into it
 * (clamp()), and the threshold drawn as a line at 1. */
static void gp_threshold_axis(FILE *f)
{
    fprintf(f, "set ylabel 'error / drift threshold'\nset logscale y\n" GP_LOG_FORMAT
               "set yrange [%g:%g]\nclamp(x) = x < %g ? %g : (x > %g ? %g : x)\n"
               "set arrow from graph 0, first 1 to graph 1, first 1 nohead lw 2 dt 2 "
               "lc rgb '#d62728' front\n"
               "set label 'drift threshold (1)' at graph 0.01, first 1 offset 0,0.6 "
               "tc rgb '#d62728' front\n",
            RATIO_LO, RATIO_HI, RATIO_LO, RATIO_LO, RATIO_HI, RATIO_HI);
}

static const cmp_divergence *main_divergence(const cmp_result *r)
{
    return r->beyond.found ? &r->beyond : &r->first;
}

/* ------------------------------------------------------------------ */
/* 1. heatmap                                                           */

static void heatmap_header(FILE *f, const report_grid *g, double fl)
{
    const char *sn = stage_name(g->stage);
    if (g->hashed)
        fprintf(f, "# kvdiff report: stage %s compared by row fingerprint (hash) only\n"
                   "# columns: position layer differs (0 = same hash, 1 = hash differs; "
                   "NaN = not recorded in both)\n", sn);
    else if (in_threshold(g))
        fprintf(f, "# kvdiff report: stage %s in units of the cross-runtime verdict: each row's "
                   "row-relative error over the drift threshold it was judged against\n"
                   "# (1 = the threshold; above 1: beyond drift; rows after the first "
                   "divergence: over the threshold their stage had there)\n"
                   "# columns: position layer log10_ratio ratio (ratio drawn within "
                   "[%g, %g]; NaN = not compared)\n", sn, RATIO_LO, RATIO_HI);
    else
        fprintf(f, "# kvdiff report: row error of stage %s, max |test - ref| over each row\n"
                   "# columns: position layer log10_error error (error 0 = bit-identical, "
                   "drawn at log10 %g; NaN = not recorded in both; Inf = non-finite on one "
                   "side, drawn at log10 %g)\n", sn, fl, ERR_CEIL);
}

/* The one colour scale of every cross-runtime heatmap: log10 of error /
 * threshold over [RATIO_LO, RATIO_HI], grey to blue below the threshold
 * (drift: calm), a jump at 1, then orange to dark red (beyond drift). */
static void gp_threshold_scale(FILE *f, const char *sn)
{
    const double lo = log10(RATIO_LO), hi = log10(RATIO_HI);
    fprintf(f, "set title 'stage %s: error / drift threshold (cross-runtime verdict: 1 = the "
               "threshold; grey-blue below it is drift, red above it is beyond drift)'\n"
               "set cblabel 'error / drift threshold (log scale)' offset 1.5,0\n"
               "set cbrange [%g:%g]\n"
               "set palette defined (%g '#f2f2f2', %g '#c9d6e3', 0 '#7f9cb8', 0 '#fdae61', "
               "%g '#e34a33', %g '#7f0000')\n"
               "set cbtics 1\nset format cb '1e%%+03.0f'\n",
            sn, lo, hi, lo, lo / 3, hi / 2, hi);
}

static int write_heatmap(rep_ctx *c, const geometry *geo, const report_grid *g, const char *dir,
                         kv_err *e)
{
    rep_plot *pl = &c->plots[PLOT_HEATMAP];
    const char *sn = stage_name(g->stage);
    const double fl = g->hashed ? 0 : grid_floor(g);
    const int64_t lo = g->pos_lo, hi = g->pos_lo + g->n_pos - 1;
    /* A long run's heatmap is drawn around the first divergence, where a
     * cell of a 500-position plot would be one pixel wide; heatmap.dat
     * keeps every position. */
    const cmp_divergence *dv = &c->r->first;
    int64_t xlo = lo, xhi = hi;
    const bool zoom = g->n_pos > ZOOM_ABOVE && dv->found && dv->layer >= 0 && dv->pos >= lo &&
                      dv->pos <= hi;
    if (zoom) {
        xlo = dv->pos - ZOOM_HALF > lo ? dv->pos - ZOOM_HALF : lo;
        xhi = xlo + 2 * ZOOM_HALF < hi ? xlo + 2 * ZOOM_HALF : hi;
        xlo = xhi - 2 * ZOOM_HALF > lo ? xhi - 2 * ZOOM_HALF : lo;
    }
    out_file d = {0}, s = {0};
    if (out_open(&d, dir, "heatmap.dat", e) < 0)
        return -1;
    heatmap_header(d.f, g, fl);
    const double ceil_at = in_threshold(g) ? RATIO_HI : ERR_CEIL;
    for (int l = 0; l < g->n_layers; l++) {
        for (int64_t p = lo; p <= hi; p++) {
            double x = report_grid_at(g, l, p);
            fprintf(d.f, "%lld %d", (long long)p, l);
            if (!g->hashed)
                num(d.f, isnan(x) ? NAN : log10(x >= ceil_at ? ceil_at : x > fl ? x : fl));
            num(d.f, x);
            fputc('\n', d.f);
        }
        fputc('\n', d.f);
    }
    if (out_close(&d, e) < 0 || out_open(&s, dir, "heatmap.gp", e) < 0)
        return -1;
    gp_head(s.f, "heatmap", in_threshold(g) ? "error / drift threshold over layers and positions"
                                            : "row error over layers and positions");
    fputs("set style textbox opaque\n", s.f);
    fprintf(s.f, "set xlabel 'position%s'\nset ylabel 'layer'\nset xrange [%g:%g]\n"
                 "set yrange [%g:%g]\nset ytics 1\n",
            zoom ? " (around the first divergence)" : "", xlo - 0.5, xhi + 0.5, -0.5,
            g->n_layers - 0.5);
    if (in_threshold(g)) {
        gp_threshold_scale(s.f, sn);
    } else if (g->hashed) {
        fprintf(s.f, "set palette rgbformulae 22,13,-31\nset title 'stage %s: rows whose "
                     "fingerprint differs (hashes only: 0 same, 1 differs)'\nset cbrange [0:1]\n"
                     "set cbtics ('same' 0, 'differs' 1)\n", sn);
    } else {
        /* The colour scale is log10 of the error; its ticks are whole
         * decades written as the other plots write them (1e-12). */
        /* The top colour is an error of 1 or more (values are of order
         * 1): a run whose worst row is one ulp off stays in the cool
         * colours instead of painting that ulp the colour of a bug. */
        const double top = grid_max(g) > 1 ? ceil(log10(fmin(grid_max(g), ERR_CEIL))) : 0;
        const double span = top - log10(fl);
        fprintf(s.f, "set palette rgbformulae 22,13,-31\nset title 'stage %s: row error "
                     "max|test - ref| (lowest colour = bit-identical, drawn at %g)'\nset cblabel 'row error (log "
                     "scale)'\nset cbrange [%g:%g]\nset cbtics %g\nset format cb '1e%%+03.0f'\n",
                sn, fl, log10(fl), top > log10(fl) ? top : log10(fl) + 1,
                span > 10 ? ceil(span / 10) : 1);
    }
    if (!g->hashed && grid_max(g) == 0)
        fprintf(s.f, "set label 'every row bit-identical' at graph 0.5, graph 0.5 center "
                     "front boxed\n");
    const unsigned lines = gp_boundaries(s.f, geo, xlo, xhi,
                                         in_threshold(g) ? "#7f7f7f" : "#ffffff");
    /* the label reads into the plot: leftward from a dot in its right half */
    const bool right_half = dv->found && 2 * (dv->pos - xlo) > xhi - xlo;
    if (dv->found && dv->layer >= 0)
        fprintf(s.f, "set label 'first divergence (%s)' at %lld, %d %s point pt 7 ps 1.6 "
                     "lc rgb '#00ff00' offset %s,0.8 tc rgb '#000000' front boxed\n",
                stage_name(dv->stage), (long long)dv->pos, dv->layer,
                right_half ? "right" : "left", right_half ? "-1" : "1");
    if (c->r->beyond.found && c->r->beyond.layer >= 0)
        fprintf(s.f, "set label 'beyond drift (%s)' at %lld, %d point pt 9 ps 1.6 "
                     "lc rgb '#00ffff' offset 1,-0.8 tc rgb '#000000' front boxed\n",
                stage_name(c->r->beyond.stage), (long long)c->r->beyond.pos, c->r->beyond.layer);
    gp_tail(s.f, "heatmap", "plot 'heatmap.dat' using 1:2:3 with image notitle");
    if (out_close(&s, e) < 0)
        return -1;
    if (in_threshold(g))
        pl->heading = "Error over the drift threshold: heatmap";
    snprintf(pl->caption, sizeof pl->caption,
             g->hashed ? "Stage %s, layer by position: which rows' fingerprints differ (the "
                         "recordings hold hashes only, so no magnitudes)."
             : in_threshold(g)
                 ? "Stage %s, layer by position, in units of the cross-runtime verdict: each "
                   "row's error over the drift threshold it was judged against (log scale, "
                   "the same for every report). Grey to blue: below 1, drift; orange to red: "
                   "above 1, beyond drift. Rows after the first divergence are measured "
                   "against the threshold their stage had there; rows not recorded in both "
                   "are blank."
                 : "Stage %s, layer by position: each row's max |test - ref| (log "
                   "scale). Bit-identical rows take the lowest colour; rows not recorded "
                   "in both are blank.", sn);
    caption_lines(pl->caption, sizeof pl->caption, lines, geo,
                  in_threshold(g) ? "Dotted grey" : "Dotted white");
    {
        size_t used = strlen(pl->caption);
        if (zoom && used < sizeof pl->caption)
            used += (size_t)snprintf(pl->caption + used, sizeof pl->caption - used,
                                     " Drawn for positions %lld..%lld, around the first "
                                     "divergence, of the %lld..%lld compared (heatmap.dat "
                                     "holds them all).", (long long)xlo, (long long)xhi,
                                     (long long)lo, (long long)hi);
        if (dv->found && dv->layer >= 0 && used < sizeof pl->caption)
            used += (size_t)snprintf(pl->caption + used, sizeof pl->caption - used,
                                     " The green dot marks the first divergence.");
        if (c->r->beyond.found && c->r->beyond.layer >= 0 && used < sizeof pl->caption)
            snprintf(pl->caption + used, sizeof pl->caption - used,
                     " The cyan marker: the first difference beyond rounding drift.");
    }
    pl->data = true;
    return 0;
}

/* ------------------------------------------------------------------ */
/* 2. error growth per layer                                            */

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int write_growth_rows(rep_ctx *c, const report_grid *g, const char *dir, kv_err *e)
{
    rep_plot *pl = &c->plots[PLOT_GROWTH];
    const char *sn = stage_name(g->stage);
    double *v = malloc((size_t)(g->n_pos > 0 ? g->n_pos : 1) * sizeof *v);
    out_file d = {0}, s = {0};
    if (!v)
        return kv_errf(e, "report: out of memory");
    if (out_open(&d, dir, "growth.dat", e) < 0) {
        free(v);
        return -1;
    }
    fprintf(d.f, "# kvdiff report: stage %s per layer, over the positions both recordings hold\n"
                 "# columns: layer max_row_error median_row_error rows%s\n", sn,
            g->hashed ? " (hashes only: the fraction of rows that differ in both columns)"
            : in_threshold(g) ? " (row errors over their drift threshold: 1 = the threshold)"
                              : "");
    for (int l = 0; l < g->n_layers; l++) {
        int n = 0;
        double mx = 0, sum = 0;
        for (int64_t p = 0; p < g->n_pos; p++) {
            const double x = g->err[(size_t)l * (size_t)g->n_pos + (size_t)p];
            if (isnan(x))
                continue;
            v[n++] = x;
            mx = x > mx ? x : mx;
            sum += x;
        }
        fprintf(d.f, "%d", l);
        if (n && g->hashed) {
            num(d.f, sum / n);
            num(d.f, sum / n);
        } else if (n) {
            qsort(v, (size_t)n, sizeof *v, cmp_double);
            num(d.f, mx);
            num(d.f, n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
        } else {
            num(d.f, NAN);
            num(d.f, NAN);
        }
        fprintf(d.f, " %d\n", n);
    }
    free(v);
    if (out_close(&d, e) < 0 || out_open(&s, dir, "growth.gp", e) < 0)
        return -1;
    gp_head(s.f, "growth", "error growth per layer");
    fprintf(s.f, "set xlabel 'layer'\nset xtics 1\nset xrange [-0.5:%g]\nset grid\n"
                 "set key top left\n", g->n_layers - 0.5);
    if (g->hashed) {
        fprintf(s.f, "set title 'stage %s: fraction of rows whose fingerprint differs, per "
                     "layer (hashes only)'\nset ylabel 'rows differing'\nset yrange [0:1.05]\n",
                sn);
        gp_tail(s.f, "growth", "plot 'growth.dat' using 1:2 with linespoints lw 2 pt 7 "
                               "title 'rows differing'");
    } else if (in_threshold(g)) {
        fprintf(s.f, "set title 'stage %s: error / drift threshold per layer (cross-runtime "
                     "verdict: 1 = the threshold)'\n", sn);
        gp_threshold_axis(s.f);
        gp_tail(s.f, "growth", "plot 'growth.dat' using 1:(clamp($2)) with linespoints lw 2 pt 7 "
                               "title 'max over positions', \\\n     'growth.dat' using "
                               "1:(clamp($3)) with linespoints lw 2 pt 5 title 'median over "
                               "positions'");
    } else {
        const double fl = grid_floor(g);
        fprintf(s.f, "set title 'stage %s: row error max|test - ref| per layer (bit-identical "
                     "drawn at %g)'\nset ylabel 'row error'\nset logscale y\n" GP_LOG_FORMAT
                     "fl = %g\nclamp(x) = x < fl ? fl : (x > %g ? %g : x)\n", sn, fl, fl, ERR_CEIL,
                ERR_CEIL);
        if (grid_max(g) == 0)
            fprintf(s.f, "set yrange [%g:1]\nset label 'every row bit-identical' at graph 0.5, "
                         "graph 0.5 center\n", fl / 10);
        gp_tail(s.f, "growth", "plot 'growth.dat' using 1:(clamp($2)) with linespoints lw 2 pt 7 "
                               "title 'max over positions', \\\n     'growth.dat' using "
                               "1:(clamp($3)) with linespoints lw 2 pt 5 title 'median over "
                               "positions'");
    }
    if (out_close(&s, e) < 0)
        return -1;
    snprintf(pl->caption, sizeof pl->caption,
             g->hashed ? "Stage %s: per layer, the fraction of rows whose fingerprint differs."
             : in_threshold(g)
                 ? "Stage %s: per layer, the largest and the median over positions of each "
                   "row's error over its drift threshold (log scale; dashed red line: the "
                   "threshold, 1). Below it is drift; above it, beyond drift."
                 : "Stage %s: per layer, the largest and the median row error over "
                   "positions (log scale) — where the error is born and how it grows.", sn);
    pl->data = true;
    return 0;
}

/* From the JSON alone: the per-stage metrics of the growth stage. */
/* The step's error over its threshold where the step is at (layer, st);
 * NaN elsewhere. */
static double step_ratio(const cmp_result *r, int layer, kv_stage st)
{
    const cmp_xrt *x = &r->xrt;
    if (!x->step || !r->first.found || r->first.layer != layer || r->first.stage != st ||
        !(x->step_threshold > 0))
        return NAN;
    return x->step_err / x->step_threshold;
}

/* From the JSON alone, a cross-runtime result: per layer, the largest
 * error / threshold of the rows judged drift, and the step's. */
static int write_growth_xrt(rep_ctx *c, kv_stage st, const char *dir, kv_err *e)
{
    rep_plot *pl = &c->plots[PLOT_GROWTH];
    const cmp_result *r = c->r;
    out_file d = {0}, s = {0};
    if (out_open(&d, dir, "growth.dat", e) < 0)
        return -1;
    fprintf(d.f, "# kvdiff report: stage %s per layer, from the cross-runtime result's figures "
                 "(error over the drift threshold: 1 = the threshold)\n"
                 "# columns: layer drift_ratio step_ratio (drift_ratio: the largest over the rows "
                 "judged drift; step_ratio: the first divergence's, NaN where it is not)\n",
            stage_name(st));
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *sr = &r->stages[i];
        if (sr->stage != st || sr->layer < 0 || !(sr->xrt_threshold > 0))
            continue;
        fprintf(d.f, "%d", sr->layer);
        num(d.f, sr->xrt_ratio);
        num(d.f, step_ratio(r, sr->layer, st));
        fputc('\n', d.f);
    }
    if (out_close(&d, e) < 0 || out_open(&s, dir, "growth.gp", e) < 0)
        return -1;
    gp_head(s.f, "growth", "error / drift threshold per layer (from the compare result)");
    fprintf(s.f, "set title 'stage %s: error / drift threshold per layer (from the compare "
                 "result; 1 = the threshold)'\nset xlabel 'layer'\nset xtics 1\nset grid\n"
                 "set key top left\n", stage_name(st));
    gp_threshold_axis(s.f);
    gp_tail(s.f, "growth", "plot 'growth.dat' using 1:(clamp($2)) with linespoints lw 2 pt 7 "
                           "title 'largest over drift rows', \\\n     'growth.dat' using "
                           "1:(clamp($3)) with points pt 9 ps 2 lc rgb '#d62728' "
                           "title 'first divergence'");
    if (out_close(&s, e) < 0)
        return -1;
    snprintf(pl->caption, sizeof pl->caption,
             "Stage %s: per layer, the largest error over its drift threshold among the rows "
             "judged drift, and the first divergence's (log scale; dashed red line: the "
             "threshold, 1), from the compare result's figures (the median needs the dumps).",
             stage_name(st));
    pl->data = true;
    return 0;
}

static bool has_xrt_figures(const cmp_result *r, kv_stage st)
{
    for (int i = 0; r->xrt.on && i < r->n_stages; i++)
        if (r->stages[i].stage == st && r->stages[i].layer >= 0 &&
            r->stages[i].xrt_threshold > 0)
            return true;
    return false;
}

static int write_growth_table(rep_ctx *c, kv_stage st, const char *dir, kv_err *e)
{
    rep_plot *pl = &c->plots[PLOT_GROWTH];
    const cmp_result *r = c->r;
    if (has_xrt_figures(r, st))
        return write_growth_xrt(c, st, dir, e);
    int n = 0;
    for (int i = 0; i < r->n_stages; i++)
        n += r->stages[i].stage == st && r->stages[i].layer >= 0;
    if (!c->o->has_stages || n == 0) {
        snprintf(pl->why, sizeof pl->why, !c->o->has_stages
                 ? "the JSON has no per-stage metrics (run kvdiff compare --stages --json) and "
                   "the dumps are not at hand"
                 : "stage %s was not compared", stage_name(st));
        return 0;
    }
    out_file d = {0}, s = {0};
    if (out_open(&d, dir, "growth.dat", e) < 0)
        return -1;
    fprintf(d.f, "# kvdiff report: stage %s per layer, from the compare result's per-stage "
                 "metrics\n# columns: layer max_abs max_rel rows bitequal_rows\n",
            stage_name(st));
    double lo = INFINITY;
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *sr = &r->stages[i];
        if (sr->stage != st || sr->layer < 0)
            continue;
        fprintf(d.f, "%d", sr->layer);
        num(d.f, sr->all.max_abs);
        num(d.f, sr->all.max_rel);
        fprintf(d.f, " %lld %lld\n", (long long)sr->all.rows, (long long)sr->all.bitequal_rows);
        if (sr->all.max_abs > 0 && sr->all.max_abs < lo)
            lo = sr->all.max_abs;
        if (sr->all.max_rel > 0 && sr->all.max_rel < lo)
            lo = sr->all.max_rel;
    }
    const double fl = lo / 10 < ERR_FLOOR ? pow(10, floor(log10(lo / 10))) : ERR_FLOOR;
    if (out_close(&d, e) < 0 || out_open(&s, dir, "growth.gp", e) < 0)
        return -1;
    gp_head(s.f, "growth", "error growth per layer (from the per-stage metrics)");
    fprintf(s.f, "set title 'stage %s: largest error per layer (from the compare result; "
                 "bit-identical drawn at %g)'\nset xlabel 'layer'\nset ylabel 'error'\n"
                 "set xtics 1\nset grid\nset key top left\nset logscale y\n" GP_LOG_FORMAT
                 "fl = %g\n"
                 "clamp(x) = x < fl ? fl : x\n", stage_name(st), fl, fl);
    gp_tail(s.f, "growth", "plot 'growth.dat' using 1:(clamp($2)) with linespoints lw 2 pt 7 "
                           "title 'max |test - ref|', \\\n     'growth.dat' using 1:(clamp($3)) "
                           "with linespoints lw 2 pt 5 title 'max row-relative error'");
    if (out_close(&s, e) < 0)
        return -1;
    snprintf(pl->caption, sizeof pl->caption,
             "Stage %s: per layer, the largest absolute and row-relative error (log scale), "
             "from the compare result's per-stage metrics (the median needs the dumps).",
             stage_name(st));
    pl->data = true;
    return 0;
}

/* ------------------------------------------------------------------ */
/* 3. error along positions                                             */

static int pick_layers(const rep_ctx *c, int n_layers, int *out)
{
    int n = 0;
    if (c->o->n_layers > 0) {
        for (int i = 0; i < c->o->n_layers; i++)
            if (c->o->layers[i] >= 0 && c->o->layers[i] < n_layers)
                out[n++] = c->o->layers[i];
        return n;
    }
    const cmp_divergence *d = main_divergence(c->r);
    int cand[3] = {d->found && d->layer >= 0 ? d->layer : -1, 0, n_layers - 1};
    for (int i = 0; i < 3; i++) {
        bool dup = cand[i] < 0;
        for (int j = 0; j < n && !dup; j++)
            dup = out[j] == cand[i];
        if (!dup)
            out[n++] = cand[i];
    }
    return n;
}

static int write_positions(rep_ctx *c, const geometry *geo, const report_grid *g,
                           const char *dir, kv_err *e)
{
    rep_plot *pl = &c->plots[PLOT_POSITIONS];
    int layers[16];
    const int nl = pick_layers(c, g->n_layers, layers);
    if (nl == 0) {
        snprintf(pl->why, sizeof pl->why, "none of the chosen layers exists in the model");
        return 0;
    }
    const char *sn = stage_name(g->stage);
    const int64_t lo = g->pos_lo, hi = g->pos_lo + g->n_pos - 1;
    out_file d = {0}, s = {0};
    if (out_open(&d, dir, "positions.dat", e) < 0)
        return -1;
    fprintf(d.f, "# kvdiff report: stage %s, %s per position (NaN: not recorded in both)\n"
                 "# columns: position", sn,
            g->hashed ? "fingerprint differs (0/1)"
            : in_threshold(g) ? "row error over its drift threshold (1 = the threshold)"
                              : "row error max |test - ref|");
    for (int i = 0; i < nl; i++)
        fprintf(d.f, " layer_%d", layers[i]);
    fputc('\n', d.f);
    for (int64_t p = lo; p <= hi; p++) {
        fprintf(d.f, "%lld", (long long)p);
        for (int i = 0; i < nl; i++)
            num(d.f, report_grid_at(g, layers[i], p));
        fputc('\n', d.f);
    }
    if (out_close(&d, e) < 0 || out_open(&s, dir, "positions.gp", e) < 0)
        return -1;
    gp_head(s.f, "positions", "error along positions for chosen layers");
    fprintf(s.f, "set xlabel 'position'\nset xrange [%g:%g]\nset grid\nset key outside right\n",
            lo - 0.5, hi + 0.5);
    if (g->hashed) {
        fprintf(s.f, "set title 'stage %s: rows whose fingerprint differs (hashes only: 0 same, "
                     "1 differs)'\nset ylabel 'differs'\nset yrange [-0.1:1.1]\n"
                     "clamp(x) = x\n", sn);
    } else if (in_threshold(g)) {
        fprintf(s.f, "set title 'stage %s: error / drift threshold along positions "
                     "(cross-runtime verdict: 1 = the threshold)'\n", sn);
        gp_threshold_axis(s.f);
    } else {
        const double fl = grid_floor(g);
        fprintf(s.f, "set title 'stage %s: row error max|test - ref| along positions "
                     "(bit-identical drawn at %g)'\nset ylabel 'row error'\nset logscale y\n"
                     GP_LOG_FORMAT
                     "fl = %g\nclamp(x) = x < fl ? fl : (x > %g ? %g : x)\n", sn, fl, fl,
                ERR_CEIL, ERR_CEIL);
        if (grid_max(g) == 0)
            fprintf(s.f, "set yrange [%g:1]\nset label 'every row bit-identical' at graph 0.5, "
                         "graph 0.5 center\n", fl / 10);
    }
    const unsigned lines = gp_boundaries(s.f, geo, lo, hi, "#7f7f7f");
    char plot[2048];
    size_t used = (size_t)snprintf(plot, sizeof plot, "plot");
    for (int i = 0; i < nl && used < sizeof plot; i++)
        used += (size_t)snprintf(plot + used, sizeof plot - used,
                                 "%s 'positions.dat' using 1:(clamp($%d)) with linespoints lw 2 "
                                 "pt %d ps 0.6 title 'layer %d'", i ? ", \\\n    " : "", i + 2,
                                 5 + 2 * i, layers[i]);
    gp_tail(s.f, "positions", plot);
    if (out_close(&s, e) < 0)
        return -1;
    char ls[128] = "";
    for (int i = 0, u = 0; i < nl; i++)
        u += snprintf(ls + u, sizeof ls - (size_t)u, "%s%d", i ? ", " : "", layers[i]);
    snprintf(pl->caption, sizeof pl->caption, "Stage %s, layers %s: %s along positions.", sn, ls,
             g->hashed ? "whether each row's fingerprint differs"
             : in_threshold(g) ? "each row's error over its drift threshold (log scale; dashed "
                                 "red line: the threshold, 1; above it, beyond drift)"
                               : "the row error (log scale)");
    caption_lines(pl->caption, sizeof pl->caption, lines, geo, "Dotted grey");
    pl->data = true;
    return 0;
}

/* ------------------------------------------------------------------ */
/* 4. per generated step                                                */

/* The first position whose input token differs (-1 none): the steps at
 * it and after are not compared, their inputs differ. */
static int64_t steps_cut(const cmp_result *r)
{
    int64_t cut = r->compared.pos_cut;
    if (r->tokens.kind == CMP_TOKENS_DIFFER && (cut < 0 || r->tokens.pos < cut))
        cut = r->tokens.pos;
    return cut;
}

/* Greys out steps s_cut .. s1 in the steps plot: not compared. */
static void gp_not_compared(FILE *f, int64_t s_cut, int64_t s1)
{
    fprintf(f, "set object 1 rect from %g, graph 0 to %g, graph 1 fc rgb '#d9d9d9' "
               "fs solid 0.7 noborder behind\n"
               "set label 'not compared: inputs differ' at %g, graph 0.5 center "
               "tc rgb '#525252' front\n",
            s_cut - 0.5, s1 + 0.5, (s_cut + s1) / 2.0);
}

static int write_steps(rep_ctx *c, const char *dir, kv_err *e)
{
    rep_plot *pl = &c->plots[PLOT_STEPS];
    report_step *st = NULL;
    int64_t n = 0;
    if (report_steps_build(c->ref, c->test, &st, &n, e) < 0)
        return -1;
    if (n == 0) {
        snprintf(pl->why, sizeof pl->why, "the recordings hold no common /output (top-k "
                 "logits) at generated steps");
        return 0;
    }
    /* Steps from the first differing input on are not written: what the
     * runs predicted there came from other inputs. */
    const int64_t cut = steps_cut(c->r), s0 = st[0].step, s1 = st[n - 1].step;
    int64_t kept = 0;
    while (kept < n && (cut < 0 || st[kept].pos < cut))
        kept++;
    if (kept == 0) {
        snprintf(pl->why, sizeof pl->why, "no generated step was compared: the inputs differ "
                 "from position %lld on", (long long)cut);
        free(st);
        return 0;
    }
    out_file d = {0}, s = {0};
    if (out_open(&d, dir, "steps.dat", e) < 0) {
        free(st);
        return -1;
    }
    fprintf(d.f, "# kvdiff report: per generated step, the next-token distributions of both runs"
                 "\n# kl: KL(ref || test) over the reference's top-k logits (a test logit outside "
                 "its top-k counts as its k-th): approximate\n# margin: top-1 minus top-2 logit\n");
    if (kept < n)
        fprintf(d.f, "# steps %lld to %lld (positions %lld on) are not compared and not listed: "
                     "a generated token differs, so their inputs differ\n",
                (long long)st[kept].step, (long long)s1, (long long)st[kept].pos);
    fprintf(d.f, "# columns: step position kl ref_margin test_margin ref_top1 test_top1\n");
    for (int64_t i = 0; i < kept; i++) {
        fprintf(d.f, "%lld %lld", (long long)st[i].step, (long long)st[i].pos);
        num(d.f, st[i].kl);
        num(d.f, st[i].ref_margin);
        num(d.f, st[i].test_margin);
        fprintf(d.f, " %d %d\n", st[i].ref_top1, st[i].test_top1);
    }
    const int64_t s_cut = kept < n ? st[kept].step : -1;
    double kl_max = 0;
    for (int64_t i = 0; i < kept; i++)
        kl_max = st[i].kl > kl_max ? st[i].kl : kl_max;
    free(st);
    if (out_close(&d, e) < 0 || out_open(&s, dir, "steps.gp", e) < 0)
        return -1;
    gp_head(s.f, "steps", "KL divergence and logit margins per generated step");
    fprintf(s.f, "set title 'per generated step: KL(ref || test) of the next-token distributions "
                 "(approximate, from top-k logits) and logit margins'\n"
                 "set xlabel 'generated step'\nset ylabel 'KL (nats, from top-k)'\n"
                 "set y2label 'margin: top-1 minus top-2 logit'\nset ytics nomirror\n"
                 "set y2tics\nset xrange [%g:%g]\nset yrange [0:%s]\nset grid\n"
                 "set key outside right\nset boxwidth 0.8\n", s0 - 0.5, s1 + 0.5,
            kl_max > 0 ? "*" : "1");
    const cmp_tokens *t = &c->r->tokens;
    if (t->kind == CMP_TOKENS_DIFFER && t->step >= s0 && t->step <= s1)
        /* The label sits inside the plot, right of its line: above the
         * frame it met the title, and at step 0 a tick label. */
        fprintf(s.f, "set arrow from %g, graph 0 to %g, graph 1 nohead lw 2 lc rgb '#000000' "
                     "front\nset label 'tokens differ' at %g, graph 0.96 left offset char 0.5,0 "
                     "tc rgb '#000000' front\n", t->step - 0.5, t->step - 0.5, t->step - 0.5);
    if (s_cut >= 0)
        gp_not_compared(s.f, s_cut, s1);
    gp_tail(s.f, "steps", "plot 'steps.dat' using 1:3 with boxes fs solid 0.4 lc rgb '#9467bd' "
                          "title 'KL (approx.)' axes x1y1, \\\n     'steps.dat' using 1:4 with "
                          "linespoints lw 2 pt 7 title 'ref margin' axes x1y2, \\\n     "
                          "'steps.dat' using 1:5 with linespoints lw 2 pt 5 title 'test margin' "
                          "axes x1y2");
    if (out_close(&s, e) < 0)
        return -1;
    snprintf(pl->caption, sizeof pl->caption,
             "Per generated step: KL(ref || test) between the two runs' next-token "
             "distributions, approximated from each run's top-k logits, and each run's logit "
             "margin (top-1 minus top-2); a small margin is a flip rounding can cause.%s%s",
             t->kind == CMP_TOKENS_DIFFER && t->step >= s0 && t->step <= s1
                 ? " Solid black line: the first step whose generated token differs." : "",
             s_cut >= 0 ? " Grey: the steps after it are not compared (their inputs differ) "
                          "and not drawn." : "");
    pl->data = true;
    return 0;
}

/* ------------------------------------------------------------------ */
/* Running gnuplot                                                      */

/* The program to run: o->gnuplot, else $GNUPLOT, else gnuplot on PATH.
 * 0 with the path in out, or -1 when there is none. */
static int find_gnuplot(const char *prog, char *out, size_t n)
{
    if (!prog || !prog[0])
        prog = getenv("GNUPLOT");
    if (!prog || !prog[0])
        prog = "gnuplot";
    struct stat sb;
    if (strchr(prog, '/')) {
        snprintf(out, n, "%s", prog);
        return stat(prog, &sb) == 0 && S_ISREG(sb.st_mode) && access(prog, X_OK) == 0 ? 0 : -1;
    }
    const char *path = getenv("PATH");
    if (!path)
        path = "/usr/bin:/bin";
    while (*path) {
        const char *end = strchr(path, ':');
        size_t len = end ? (size_t)(end - path) : strlen(path);
        snprintf(out, n, "%.*s/%s", (int)len, len ? path : ".", prog);
        if (stat(out, &sb) == 0 && S_ISREG(sb.st_mode) && access(out, X_OK) == 0)
            return 0;
        path += len + (end != NULL);
    }
    return -1;
}

/* gnuplot's first error line: the `"x.gp" line N: ...` one, else the
 * first non-empty line it printed. */
static void first_error(const char *text, char *out, size_t n)
{
    const char *hit = NULL, *any = NULL;
    for (const char *p = text; *p; ) {
        const char *end = strchr(p, '\n');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *q = p;
        while (q < p + len && (*q == ' ' || *q == '\t' || *q == '^'))
            q++;
        if (q < p + len && !any)
            any = p;
        if (!hit && len > 1 && p[0] == '"' && strstr(p, "\" line ") &&
            (size_t)(strstr(p, "\" line ") - p) < len)
            hit = p;
        p += len + (end != NULL);
    }
    const char *l = hit ? hit : any;
    if (!l) {
        snprintf(out, n, "no message");
        return;
    }
    const char *end = strchr(l, '\n');
    snprintf(out, n, "%.*s", (int)(end ? end - l : (ptrdiff_t)strlen(l)), l);
}

/* Runs `prog -e "outdir='scratch/'" script` in dir with stderr captured.
 * Returns its exit status, 127 when it could not be started, -1 when
 * fork/pipe failed. */
static int run_gnuplot(const char *prog, const char *dir, const char *scratch, const char *script,
                       char *err, size_t n)
{
    char set_out[128];
    snprintf(set_out, sizeof set_out, "outdir='%s/'", scratch);
    int fd[2];
    err[0] = 0;
    if (pipe(fd) < 0)
        return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(fd[0]);
        close(fd[1]);
        return -1;
    }
    if (pid == 0) {
        int null = open("/dev/null", O_RDWR);
        if (null >= 0) {
            dup2(null, 0);
            dup2(null, 1);
        }
        dup2(fd[1], 2);
        close(fd[0]);
        close(fd[1]);
        if (chdir(dir) == 0)
            execl(prog, prog, "-e", set_out, script, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    size_t len = 0;
    ssize_t k;
    char sink[512];
    while ((k = read(fd[0], len + 1 < n ? err + len : sink,
                     len + 1 < n ? n - 1 - len : sizeof sink)) > 0 || (k < 0 && errno == EINTR))
        if (k > 0 && len + 1 < n)
            len += (size_t)k;
    err[len] = 0;
    close(fd[0]);
    int st;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

static bool nonempty(const char *dir, const char *name, const char *ext)
{
    char p[4200];
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s.%s", dir, name, ext);
    return lstat(p, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size > 0;
}

/* Moves scratch/NAME.png and .svg to dir under the output discipline
 * (outfile.h): a link or an input planted at plots/NAME.png is refused,
 * never followed or removed. */
static int place_images(const char *dir, const char *scratch, const char *name, kv_err *e)
{
    static const char *const exts[2] = {"png", "svg"};
    int rc = 0;
    for (int k = 0; k < 2; k++) {
        char from[4300], to[4200];
        snprintf(from, sizeof from, "%s/%s/%s.%s", dir, scratch, name, exts[k]);
        snprintf(to, sizeof to, "%s/%s.%s", dir, name, exts[k]);
        if (rc == 0)
            rc = outfile_place(from, to, e);
        else
            unlink(from);
    }
    return rc;
}

/* Empties and removes the scratch folder this run made: only the names
 * gnuplot was told to write are in it. */
static void drop_scratch(const char *dir, const char *scratch, const rep_ctx *c)
{
    char p[4300];
    for (int i = 0; i < PLOT_COUNT; i++)
        for (int k = 0; k < 2; k++) {
            snprintf(p, sizeof p, "%s/%s/%s.%s", dir, scratch, c->plots[i].name, k ? "svg" : "png");
            unlink(p);
        }
    snprintf(p, sizeof p, "%s/%s", dir, scratch);
    rmdir(p);
}

static void draw(rep_ctx *c, const char *dir)
{
    char prog[4096], out[8192], line[768];
    bool missing = find_gnuplot(c->o->gnuplot, prog, sizeof prog) < 0;
    /* gnuplot opens its outputs by name and would follow a link planted
     * there: it writes into a fresh folder only this run can have made
     * (mkdtemp), and each image is moved into place when it is whole. */
    char scratch_path[4200], scratch[64] = "";
    snprintf(scratch_path, sizeof scratch_path, "%s/.draw.XXXXXX", dir);
    if (!missing && !mkdtemp(scratch_path)) {
        snprintf(c->gnuplot_error, sizeof c->gnuplot_error,
                 "cannot make a scratch folder in %s: %s", dir, strerror(errno));
        for (int i = 0; i < PLOT_COUNT; i++)
            if (c->plots[i].data)
                snprintf(c->plots[i].why, sizeof c->plots[i].why, "not drawn: %.900s",
                         c->gnuplot_error);
        return;
    }
    if (!missing)
        snprintf(scratch, sizeof scratch, "%s", strrchr(scratch_path, '/') + 1);
    for (int i = 0; i < PLOT_COUNT && !missing; i++) {
        rep_plot *pl = &c->plots[i];
        if (!pl->data)
            continue;
        char script[64], sdir[4300];
        snprintf(script, sizeof script, "%s.gp", pl->name);
        snprintf(sdir, sizeof sdir, "%s/%s", dir, scratch);
        int rc = run_gnuplot(prog, dir, scratch, script, out, sizeof out);
        if (rc == 127 && !out[0]) {
            missing = true;
            break;
        }
        kv_err pe = {0};
        if (rc == 0 && nonempty(sdir, pl->name, "png") && nonempty(sdir, pl->name, "svg")) {
            if (place_images(dir, scratch, pl->name, &pe) == 0) {
                pl->drawn = true;
                continue;
            }
            snprintf(line, sizeof line, "%.700s", pe.msg);
        } else if (rc == 0)
            snprintf(line, sizeof line, "no whole %s.png / %s.svg came out (a full disk?)",
                     pl->name, pl->name);
        else if (rc < 0)
            snprintf(line, sizeof line, "could not start it: %s", strerror(errno));
        else
            first_error(out, line, sizeof line);
        snprintf(pl->why, sizeof pl->why, "gnuplot failed on plots/%s: %s", script, line);
        if (!c->gnuplot_error[0])
            snprintf(c->gnuplot_error, sizeof c->gnuplot_error, "gnuplot failed on %s/%s: %s",
                     dir, script, line);
    }
    if (scratch[0])
        drop_scratch(dir, scratch, c);
    if (!missing)
        return;
    c->gnuplot_missing = true;
    for (int i = 0; i < PLOT_COUNT; i++)
        if (c->plots[i].data && !c->plots[i].drawn)
            snprintf(c->plots[i].why, sizeof c->plots[i].why,
                     "not drawn: gnuplot was not found (data and script are in plots/)");
}

/* ------------------------------------------------------------------ */

static void plan(rep_ctx *c)
{
    static const char *const names[PLOT_COUNT] = {"heatmap", "growth", "positions", "steps"};
    static const char *const heads[PLOT_COUNT] = {
        "Row error heatmap", "Error growth per layer", "Error along positions",
        "Per generated step: KL divergence and logit margins"};
    for (int i = 0; i < PLOT_COUNT; i++) {
        memset(&c->plots[i], 0, sizeof c->plots[i]);
        c->plots[i].name = names[i];
        c->plots[i].heading = heads[i];
    }
}

static void no_grid(rep_plot *pl, kv_stage st)
{
    snprintf(pl->why, sizeof pl->why, "stage %s is not recorded in both dumps", stage_name(st));
}

static int build_pair(rep_ctx *c, kv_stage hs, kv_stage gs, report_units u, report_grid *heat,
                      report_grid *grow, kv_err *e)
{
    int (*build)(const cmp_source *, const cmp_source *, kv_stage, int, report_grid *,
                 kv_err *) = u == REPORT_UNITS_REL ? report_grid_build_rel : report_grid_build;
    int rc = build(c->ref, c->test, hs, c->o->block_rows, heat, e);
    if (rc == 0 && gs != hs)
        rc = build(c->ref, c->test, gs, c->o->block_rows, grow, e);
    return rc;
}

/* The heatmap's grid and, when its stage is another, the growth and
 * position plots' one. A cross-runtime result's are in units of its
 * verdict (error / drift threshold); should the comparison run again for
 * the thresholds not give the result's own (the dumps changed since),
 * they fall back to max |test - ref|. */
static int build_grids(rep_ctx *c, kv_stage hs, kv_stage gs, report_grid *heat,
                       report_grid *grow, kv_err *e)
{
    const bool xrt = c->r->xrt.on && c->ref->read && c->test->read;
    int rc = build_pair(c, hs, gs, xrt ? REPORT_UNITS_REL : REPORT_UNITS_ABS, heat, grow, e);
    if (rc < 0 || !xrt)
        return rc;
    report_grid *const gr[2] = {heat, grow};
    rc = report_grids_to_threshold(c->ref, c->test, c->r, gr, gs != hs ? 2 : 1,
                                   c->o->block_rows, e);
    if (rc < 0 || heat->units == REPORT_UNITS_THRESHOLD)
        return rc;
    report_grid_free(heat);
    report_grid_free(grow);
    return build_pair(c, hs, gs, REPORT_UNITS_ABS, heat, grow, e);
}

static int from_sources(rep_ctx *c, const char *dir, kv_err *e)
{
    const kv_stage hs = rep_heatmap_stage(c->r, c->o), gs = rep_growth_stage(c->o);
    geometry geo = {c, c->ref->cfg.sliding_window, settings_chunk(c->test),
                    c->test->prompt_length > 0 ? c->test->prompt_length : INT64_MAX,
                    c->ref->cfg.n_layers};
    report_grid heat, grow;
    memset(&grow, 0, sizeof grow);
    int rc = build_grids(c, hs, gs, &heat, &grow, e);
    const report_grid *g = gs != hs ? &grow : &heat;
    if (rc == 0) {
        grid_cut(&heat, c->r->compared.pos_cut);
        grid_cut(&grow, c->r->compared.pos_cut);
    }
    if (rc == 0 && heat.n_pos > 0)
        rc = write_heatmap(c, &geo, &heat, dir, e);
    else if (rc == 0)
        no_grid(&c->plots[PLOT_HEATMAP], hs);
    if (rc == 0 && g->n_pos > 0)
        rc = write_growth_rows(c, g, dir, e);
    if (rc == 0 && g->n_pos > 0)
        rc = write_positions(c, &geo, g, dir, e);
    else if (rc == 0) {
        no_grid(&c->plots[PLOT_GROWTH], gs);
        no_grid(&c->plots[PLOT_POSITIONS], gs);
    }
    if (rc == 0)
        rc = write_steps(c, dir, e);
    report_grid_free(&heat);
    report_grid_free(&grow);
    return rc;
}

int rep_plots_write(rep_ctx *c, const char *dir, kv_err *e)
{
    plan(c);
    if (c->ref && c->test) {
        if (from_sources(c, dir, e) < 0)
            return -1;
    } else {
        static const char *const why =
            "needs the rows of both dumps, which are not at hand (the JSON names no dumps, or "
            "they no longer exist at its paths)";
        snprintf(c->plots[PLOT_HEATMAP].why, sizeof c->plots[0].why, "%s", why);
        snprintf(c->plots[PLOT_POSITIONS].why, sizeof c->plots[0].why, "%s", why);
        snprintf(c->plots[PLOT_STEPS].why, sizeof c->plots[0].why,
                 "needs both dumps' /output (top-k logits), which are not at hand");
        if (write_growth_table(c, rep_growth_stage(c->o), dir, e) < 0)
            return -1;
    }
    draw(c, dir);
    return 0;
}
