/* report.c — report_write: the output folder, result.json, the plots,
 * summary.md, and index.html last, so a folder with an index.html is a
 * complete report. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rep_internal.h"
#include "../model/outfile.h"

void report_opts_default(report_opts *o)
{
    memset(o, 0, sizeof *o);
    o->stage = -1;
    o->has_stages = true;
    o->block_rows = 64;
}

/* Every name the report writes, checked before anything is written: a
 * link, a device or one of the run's inputs (a noise floor kept in the
 * report folder) at any of them stops the report whole (outfile.h). */
static int check_targets(const char *outdir, const char *plots, kv_err *e)
{
    static const char *const top[] = {"result.json", "summary.md", "index.html"};
    static const char *const names[] = {"heatmap", "growth", "positions", "steps"};
    static const char *const exts[] = {"dat", "gp", "png", "svg"};
    char path[4300];
    for (size_t i = 0; i < sizeof top / sizeof *top; i++) {
        snprintf(path, sizeof path, "%s/%s", outdir, top[i]);
        if (outfile_check_target(path, e) < 0)
            return -1;
    }
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        for (size_t k = 0; k < sizeof exts / sizeof *exts; k++) {
            snprintf(path, sizeof path, "%s/%s.%s", plots, names[i], exts[k]);
            if (outfile_check_target(path, e) < 0)
                return -1;
        }
    return 0;
}

typedef void (*writer_fn)(const rep_ctx *c, FILE *f);

/* Writes dir/name through a fresh temporary file beside it and a rename
 * (outfile.h): a symlink planted in the folder is never followed. */
static int write_file(const char *dir, const char *name, writer_fn fn, const rep_ctx *c,
                      const json_t *j, kv_err *e)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    outfile o;
    if (outfile_open(&o, path, e) < 0)
        return -1;
    if (fn)
        fn(c, o.f);
    else if (json_dumpf(j, o.f, JSON_INDENT(2) | JSON_PRESERVE_ORDER) == 0)
        fputc('\n', o.f);
    else {
        /* jansson says nothing of why: a full disk or the file-size limit
         * fails the stream's writes, else it ran out of memory */
        const int err = ferror(o.f) ? errno : 0;
        outfile_abort(&o);
        return kv_errf(e, "%s: write failed: %s", path, err ? strerror(err) : "out of memory");
    }
    return outfile_commit(&o, e);
}

static json_t *result_json(const rep_ctx *c)
{
    json_t *j = cmp_result_json(c->r, c->o->has_stages ? CMP_RENDER_STAGES : 0);
    if (!j)
        return NULL;
    json_t *in = json_object();
    json_object_set_new(in, "ref", c->o->ref_path ? json_string(c->o->ref_path) : json_null());
    json_object_set_new(in, "test", c->o->test_path ? json_string(c->o->test_path) : json_null());
    json_object_set_new(j, "inputs", in);
    return j;
}

/* Which recording stopped early, from the sources or (from JSON) the
 * comparer's notes. */
static void find_partial(rep_ctx *c)
{
    size_t used = 0;
    c->partial[0] = 0;
    const cmp_source *s[2] = {c->ref, c->test};
    const char *role[2] = {"reference", "test"};
    for (int i = 0; i < 2; i++)
        if (s[i] && !s[i]->complete) {
            int w = snprintf(c->partial + used, sizeof c->partial - used, "%sthe %s (%s)",
                             used ? " and " : "", role[i], s[i]->label ? s[i]->label : "?");
            used += w > 0 && (size_t)w < sizeof c->partial - used ? (size_t)w : 0;
        }
    if (c->ref || c->test)
        return;
    for (int i = 0; i < c->r->n_notes && !used; i++)
        if (strstr(c->r->notes[i], " is partial ")) {
            snprintf(c->partial, sizeof c->partial, "%s", c->r->notes[i]);
            used = 1;
        }
}

int report_write(const char *outdir, const cmp_result *r, const cmp_source *ref,
                 const cmp_source *test, const report_opts *o, report_info *info, kv_err *e)
{
    report_opts dflt;
    if (!o) {
        report_opts_default(&dflt);
        o = &dflt;
    }
    memset(info, 0, sizeof *info);
    if ((ref == NULL) != (test == NULL))
        return kv_errf(e, "report: give both recordings or neither");
    char plots[4200], index[4200];
    snprintf(plots, sizeof plots, "%s/plots", outdir);
    snprintf(index, sizeof index, "%s/index.html", outdir);
    /* The folder the user named is taken as given; plots/ inside it is
     * kvdiff's and must be a real folder, never a link to elsewhere. */
    if (outfile_user_dir(outdir, NULL, e) < 0 || outfile_tool_dir(plots, NULL, e) < 0 ||
        check_targets(outdir, plots, e) < 0)
        return -1;
    /* The earlier report's page goes first (a regular file, checked
     * above): a report that fails midway leaves no page that looks whole. */
    if (unlink(index) != 0 && errno != ENOENT)
        return kv_errf(e, "%s: cannot replace the earlier report: %s", index, strerror(errno));
    rep_ctx c;
    memset(&c, 0, sizeof c);
    c.r = r;
    c.o = o;
    c.ref = ref;
    c.test = test;
    find_partial(&c);
    c.plots_dir = plots;
    c.text = cmp_render_text(r, 0);
    json_t *j = result_json(&c);
    int rc = c.text && j ? 0 : kv_errf(e, "report: out of memory");
    if (rc == 0)
        rc = write_file(outdir, "result.json", NULL, &c, j, e);
    json_decref(j);
    if (rc == 0)
        rc = rep_plots_write(&c, plots, e);
    if (rc == 0)
        rc = write_file(outdir, "summary.md", rep_markdown_write, &c, NULL, e);
    if (rc == 0)
        rc = write_file(outdir, "index.html", rep_html_write, &c, NULL, e);
    if (rc == 0) {
        snprintf(info->index_path, sizeof info->index_path, "%s", index);
        for (int i = 0; i < PLOT_COUNT; i++)
            info->plots_drawn += c.plots[i].drawn;
        info->gnuplot_missing = c.gnuplot_missing;
        snprintf(info->gnuplot_error, sizeof info->gnuplot_error, "%s", c.gnuplot_error);
    }
    free(c.text);
    return rc;
}
