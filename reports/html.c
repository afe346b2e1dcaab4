/* html.c — index.html: one self-contained page (inline CSS, no script,
 * the plots' PNGs embedded as data: URIs) readable from file://, and still
 * whole when copied away from its folder. Every string that comes from the
 * inputs (file names, engine settings, notes) is escaped. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rep_internal.h"

static void esc(FILE *f, const char *s)
{
    for (; s && *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default:
            /* a control byte from a file name or a dump string is shown,
             * not passed on to whatever displays the page's text */
            if (((unsigned char)*s < 0x20 && *s != '\t' && *s != '\n') || *s == 0x7f)
                fprintf(f, "\\x%02x", (unsigned char)*s);
            else
                fputc(*s, f);
        }
    }
}

static const char css[] =
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
    "color:#222;line-height:1.4}\n"
    "h1{font-size:1.5em;margin-bottom:.2em}h2{border-bottom:1px solid #ccc;margin-top:1.6em}\n"
    ".verdict{font-size:1.15em;font-weight:600;padding:.6em .8em;border-radius:4px}\n"
    ".identical,.within_tolerance{background:#e6f4ea;border-left:6px solid #2e7d32}\n"
    ".diverged{background:#fdecea;border-left:6px solid #c62828}\n"
    ".note{font-weight:600;padding:.4em .8em;border-left:6px solid #1565c0;"
    "background:#e3f2fd}\n"
    ".warn{background:#fff4e5;border-left:6px solid #ef6c00;padding:.5em .8em}\n"
    "pre{background:#f6f8fa;padding:.8em;white-space:pre-wrap;overflow-wrap:anywhere;"
    "font-size:.85em}\n"
    /* A narrow window (a phone, a split screen) must not scroll sideways:
     * the wide metrics table scrolls inside itself, images shrink, and
     * long paths and settings wrap. */
    "table{border-collapse:collapse;font-size:.85em;display:block;max-width:100%;"
    "overflow-x:auto}td,th{border:1px solid #ddd;"
    "padding:.2em .5em;text-align:right}th{background:#f0f0f0}td.l,th.l{text-align:left}\n"
    "tr.same td{color:#777}tr.first td{background:#fdecea;font-weight:600}\n"
    "dl{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:.2em 1em}"
    "dt{font-weight:600}dd{margin:0;min-width:0;overflow-wrap:anywhere}\n"
    "figure{margin:1em 0}img{max-width:100%;height:auto;border:1px solid #ddd}"
    "figcaption{font-size:.9em;color:#444}\n"
    ".muted{color:#777}code{font-size:.9em;overflow-wrap:anywhere}\n"
    "p,h1,h2,h3,figcaption{overflow-wrap:anywhere}\n";

static void head(const rep_ctx *c, FILE *f, const char *verdict)
{
    fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>kvdiff "
          "report: ", f);
    esc(f, cmp_verdict_name(c->r->verdict));
    fprintf(f, "</title>\n<style>\n%s</style>\n</head>\n<body>\n<h1>kvdiff report</h1>\n", css);
    fprintf(f, "<p class=\"verdict %s\">", cmp_verdict_name(c->r->verdict));
    esc(f, verdict);
    fputs("</p>\n", f);
}

static void input_row(FILE *f, const char *role, const char *path, const cmp_source *s)
{
    fprintf(f, "<dt>%s</dt><dd><code>", role);
    esc(f, path ? path : s && s->label ? s->label : "(not named)");
    fputs("</code>", f);
    if (s && s->engine) {
        fputs(" — engine <code>", f);
        esc(f, s->engine);
        fputs("</code>", f);
    }
    if (s && s->settings_json) {
        fputs("<br><span class=\"muted\">settings <code>", f);
        esc(f, s->settings_json);
        fputs("</code></span>", f);
    }
    if (s && !s->complete)
        fputs(" <strong>(partial: the run stopped early)</strong>", f);
    fputs("</dd>\n", f);
}

static void inputs(const rep_ctx *c, FILE *f)
{
    fputs("<dl>\n", f);
    input_row(f, "reference", c->o->ref_path, c->ref);
    input_row(f, "test", c->o->test_path, c->test);
    const cmp_result *r = c->r;
    fputs("<dt>mode</dt><dd>", f);
    if (r->xrt.on) {
        /* Another runtime's recording: judged by a drift model, not by a
         * tolerance (docs/cross-runtime.md). */
        const cmp_xrt *x = &r->xrt;
        fputs("cross-runtime: drift model ", f);
        esc(f, x->model);
        fputs(" (", f);
        if (x->compute_precision[0]) {
            fputs("compute ", f);
            esc(f, x->compute_precision);
            if (!x->compute_stated) {
                fputs(" assumed: ", f);
                esc(f, x->compute_assumed_why);
            }
            fprintf(f, ", %g &times; %.3g at every stage; ", x->compute_factor, x->compute_eps);
        }
        fputs("KV cache ", f);
        esc(f, x->kv_precision);
        fprintf(f, "; a row is drift while its relative error is at most max(%g + %g &times; "
                "%.3g at attn_out, %g &times; upstream, %g &times; its stage's earlier rows)); ",
                x->floor_base, x->kv_factor, x->kv_eps, x->gain, x->history);
        if (x->step && x->audit_step)
            fprintf(f, "step in the test's own attention: its attn_out is %.3g from attention "
                    "over its own q, k, v (threshold %.3g)", x->step_err, x->step_threshold);
        else if (x->step)
            fprintf(f, "step: error %.3g against a threshold of %.3g", x->step_err,
                    x->step_threshold);
        else
            fputs("no step above drift", f);
        if (x->audit_skip[0]) {
            fputs("; attention check not run: ", f);
            esc(f, x->audit_skip);
        } else if (x->audit_layers > 0 && x->audit_worst_pos >= 0)
            fprintf(f, "; attention check over %d layers, threshold %.3g, closest residual "
                    "%.3g (position %lld, layer %d)", x->audit_layers, x->audit_threshold,
                    x->audit_worst_residual, (long long)x->audit_worst_pos,
                    x->audit_worst_layer);
        if (x->acc_on && x->acc_pos >= 0)
            fprintf(f, "; f16 accumulation modelled on %lld attn_out rows (llama.cpp's flash "
                    "attention sums values in f16), allowed %g &times; its gap, largest %.3g "
                    "(position %lld, layer %d)", (long long)x->acc_rows, x->acc_factor,
                    x->acc_largest, (long long)x->acc_pos, x->acc_layer);
    } else if (r->exact)
        fputs("exact (any differing bit is a divergence)", f);
    else {
        fprintf(f, "tolerance: atol %g, rtol %g", r->atol, r->rtol);
        if (r->ulp)   /* the ulp tolerance given, not a distance seen */
            fprintf(f, ", %llu ulp", (unsigned long long)r->ulp);
        fputs(r->noise ? ", noise floor" : "", f);
    }
    fputs("</dd>\n</dl>\n", f);
    if (c->partial[0]) {
        fputs("<p class=\"warn\">Partial recording: ", f);
        esc(f, c->partial);
        fputs(". Only what both hold was compared and plotted.</p>\n", f);
    }
}

static void divergence(const rep_ctx *c, FILE *f, const char *title, const cmp_divergence *d)
{
    fprintf(f, "<h2>%s</h2>\n<dl>\n<dt>position</dt><dd>%lld</dd>\n", title, (long long)d->pos);
    if (d->layer >= 0) {
        fprintf(f, "<dt>layer</dt><dd>%d (", d->layer);
        if (d->layer_sliding)
            fprintf(f, "sliding, window %d", d->layer_window);
        else
            fputs("global", f);
        if (d->kv_owner != d->layer)
            fprintf(f, ", reads layer %d's KV", d->kv_owner);
        fputs(")</dd>\n", f);
    } else {
        fputs("<dt>layer</dt><dd>model level</dd>\n", f);
    }
    fprintf(f, "<dt>stage</dt><dd><code>%s</code></dd>\n", stage_name(d->stage));
    if (d->head >= 0)
        fprintf(f, "<dt>head</dt><dd>%d%s</dd>\n", d->head,
                d->stage == STAGE_K || d->stage == STAGE_V ? " (KV head)" : "");
    if (d->hashed)
        fputs("<dt>values</dt><dd>row fingerprints differ (the element is unknown)</dd>\n", f);
    else
        fprintf(f, "<dt>values</dt><dd>ref %.9g, test %.9g (abs %.3g); row: max abs %.3g, "
                   "relative %.3g, %d element%s differ</dd>\n", d->ref, d->test, d->abs_err,
                d->row_max_abs, d->row_rel, d->n_bad, d->n_bad == 1 ? "" : "s");
    fputs("</dl>\n", f);
    (void)c;
}

static void diagnosis(const rep_ctx *c, FILE *f)
{
    const cmp_diagnosis *g = &c->r->diag;
    if (g->kind == CMP_DIAG_NONE)
        return;
    /* in words: the id (cmp_diag_name) is result.json's */
    fputs("<h2>Diagnosis</h2>\n<p><strong>", f);
    esc(f, g->summary);
    fputs("</strong>", f);
    if (g->detail[0]) {
        fputs("<br>", f);
        esc(f, g->detail);
    }
    fputs("</p>\n", f);
    if (g->evidence[0]) {
        fprintf(f, "<p><em>%s</em>:</p>\n<ul class=\"evidence\">\n", cmp_evidence_label(g));
        for (const char *s = g->evidence, *next; s && *s; s = next) {
            size_t n;
            next = cmp_evidence_clause(s, &n);
            char clause[sizeof g->evidence];
            snprintf(clause, sizeof clause, "%.*s", (int)n, s);
            fputs("<li>", f);
            esc(f, clause);
            fputs("</li>\n", f);
        }
        fputs("</ul>\n", f);
    }
}

static void tokens(const rep_ctx *c, FILE *f)
{
    const cmp_tokens *t = &c->r->tokens;
    fputs("<h2>Tokens</h2>\n<p>", f);
    switch (t->kind) {
    case CMP_TOKENS_IDENTICAL:
        fprintf(f, "Byte-identical: %lld tokens (prompt %lld).", (long long)t->n_ref,
                (long long)t->prompt_length);
        break;
    case CMP_TOKENS_LENGTH:
        if (t->test_stopped) {
            fprintf(f, "Identical over the %lld positions the test ran (it was stopped past "
                    "its first divergence).", (long long)t->n_test);
            break;
        }
        fprintf(f, "The token counts differ: reference %lld tokens, test %lld; identical "
                "over the common prefix.",
                (long long)t->n_ref, (long long)t->n_test);
        break;
    case CMP_TOKENS_NONE:
        fputs("Not recorded in one of the runs.", f);
        break;
    case CMP_TOKENS_DIFFER:
        if (t->step >= 0)
            fprintf(f, "First differing generated token at step %lld (position %lld): ",
                    (long long)t->step, (long long)t->pos);
        else
            fprintf(f, "First differing token at prompt position %lld: ", (long long)t->pos);
        fprintf(f, "reference %d (margin ", t->ref_id);
        rep_margin(f, t->ref_margin);
        fprintf(f, ") vs test %d (margin ", t->test_id);
        rep_margin(f, t->test_margin);
        fputs(").", f);
        if (t->near_tie)
            fputs(" A near tie in both runs: a flip rounding alone can cause.", f);
        break;
    }
    fputs("</p>\n", f);
    const cmp_logit_stats *l = &c->r->logits;
    if (l->present)
        fprintf(f, "<p>Logits: KL(ref || test) mean %.3g, max %.3g at position %lld%s; top-1 "
                   "agrees at %lld of %lld positions.</p>\n", l->kl_mean, l->kl_max,
                (long long)l->kl_max_pos, l->from_topk ? " (approximate, from top-k)" : "",
                (long long)l->top1_agree, (long long)l->positions);
}

static bool is_first(const cmp_result *r, const cmp_stage_result *s)
{
    return r->first.found && r->first.layer == s->layer && r->first.stage == s->stage;
}

static void stage_table(const rep_ctx *c, FILE *f)
{
    const cmp_result *r = c->r;
    fputs("<h2>Metrics per layer and stage</h2>\n", f);
    if (!c->o->has_stages) {
        fputs("<p class=\"muted\">The saved compare result has no per-stage table, and its "
              "dumps could not be opened to compute it. Give <code>kvdiff report</code> the two "
              "dumps, or save the result with <code>kvdiff compare --stages --json</code>."
              "</p>\n", f);
        return;
    }
    fputs("<p class=\"muted\">Over every row the walk visited; grey rows are bit-identical, the "
          "highlighted row holds the first divergence.</p>\n<table>\n<tr><th>layer</th>"
          "<th class=\"l\">stage</th><th>rows</th><th>bit-equal</th><th>max abs</th>"
          "<th>max rel</th><th title=\"units in the last place, shown up to 1024; past "
          "that the relative error says it\">max ulp</th><th>cosine</th><th>NMSE</th></tr>\n",
          f);
    for (int i = 0; i < r->n_stages; i++) {
        const cmp_stage_result *s = &r->stages[i];
        const cmp_stats *a = &s->all;
        const char *cls = is_first(r, s) ? "first" : a->bitequal_rows == a->rows ? "same" : "";
        char layer[16];
        snprintf(layer, sizeof layer, s->layer < 0 ? "model" : "%d", s->layer);
        char ulp[24];
        if (a->max_ulp <= CMP_ULP_SHOWN)
            cmp_ulp_text(a->max_ulp, ulp, sizeof ulp);
        else   /* values far apart: the count means nothing (compare.h) */
            snprintf(ulp, sizeof ulp, "&gt;%d", CMP_ULP_SHOWN);
        fprintf(f, "<tr class=\"%s\"><td>%s</td><td class=\"l\">%s%s</td><td>%lld</td>"
                   "<td>%lld</td><td>%.3g</td><td>%.3g</td><td>%s</td><td>%.9f</td>"
                   "<td>%.3g</td></tr>\n", cls, layer, stage_name(s->stage),
                s->hashed ? " (hash)" : "",
                (long long)a->rows, (long long)a->bitequal_rows, a->max_abs, a->max_rel,
                ulp, cmp_stats_cosine(a), cmp_stats_nmse(a));
    }
    fputs("</table>\n", f);
}

/* Writes "data:image/png;base64,..." of dir/name.png to f; false (and
 * nothing written) when the file cannot be read, so the caller links it. */
static bool png_data_uri(FILE *f, const char *dir, const char *name)
{
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char path[4300];
    snprintf(path, sizeof path, "%s/%s.png", dir ? dir : "plots", name);
    FILE *in = fopen(path, "rb");
    if (!in)
        return false;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, in);
        if (n < cap || ferror(in))
            break;
        unsigned char *more = cap < (64u << 20) ? realloc(buf, cap * 2) : NULL;
        if (!more) {
            free(buf);
            buf = NULL;
            break;
        }
        buf = more;
        cap *= 2;
    }
    bool ok = buf && !ferror(in) && n > 0;
    fclose(in);
    if (!ok) {
        free(buf);
        return false;
    }
    fputs("data:image/png;base64,", f);
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)buf[i] << 16 | (i + 1 < n ? (unsigned)buf[i + 1] << 8 : 0) |
                     (i + 2 < n ? buf[i + 2] : 0);
        fputc(b64[v >> 18 & 63], f);
        fputc(b64[v >> 12 & 63], f);
        fputc(i + 1 < n ? b64[v >> 6 & 63] : '=', f);
        fputc(i + 2 < n ? b64[v & 63] : '=', f);
    }
    free(buf);
    return true;
}

static void plots(const rep_ctx *c, FILE *f)
{
    fputs("<h2>Plots</h2>\n", f);
    if (c->gnuplot_missing)
        fputs("<p class=\"warn\">Plots were not drawn: gnuplot was not found (install it: "
              "<code>apt-get install gnuplot-nox</code>). The data and scripts are in "
              "<code>plots/</code>; run <code>gnuplot NAME.gp</code> there.</p>\n", f);
    else if (c->gnuplot_error[0]) {
        fputs("<p class=\"warn\">", f);
        esc(f, c->gnuplot_error);
        fputs("</p>\n", f);
    }
    for (int i = 0; i < PLOT_COUNT; i++) {
        const rep_plot *p = &c->plots[i];
        fprintf(f, "<h3>%s</h3>\n", p->heading);
        if (p->drawn) {
            /* embedded: the page shows its plots wherever it is copied;
             * the files stay in plots/ for the links below */
            fputs("<figure>\n<img src=\"", f);
            if (!png_data_uri(f, c->plots_dir, p->name))
                fprintf(f, "plots/%s.png", p->name);
            fprintf(f, "\" alt=\"%s\">\n<figcaption>", p->heading);
            esc(f, p->caption);
            fprintf(f, " <a href=\"plots/%s.svg\">SVG</a> · <a href=\"plots/%s.dat\">data</a> · "
                       "<a href=\"plots/%s.gp\">gnuplot script</a></figcaption>\n</figure>\n",
                    p->name, p->name, p->name);
        } else {
            fputs("<p class=\"muted\">Left out: ", f);
            esc(f, p->why[0] ? p->why : "not drawn");
            fputs(".", f);
            if (p->data)
                fprintf(f, " Data: <a href=\"plots/%s.dat\">%s.dat</a>, script: "
                           "<a href=\"plots/%s.gp\">%s.gp</a>.", p->name, p->name, p->name,
                        p->name);
            fputs("</p>\n", f);
        }
    }
}

void rep_html_write(const rep_ctx *c, FILE *f)
{
    char verdict[1024];
    report_verdict_line(c->r, verdict, sizeof verdict);
    head(c, f, verdict);
    if (c->o->note && *c->o->note) {
        fputs("<p class=\"note\">", f);
        esc(f, c->o->note);
        fputs("</p>\n", f);
    }
    inputs(c, f);
    const cmp_result *r = c->r;
    if (r->first.found)
        divergence(c, f, "First divergence", &r->first);
    if (r->beyond.found)
        divergence(c, f, "Beyond drift (the first difference larger than rounding drift)",
                   &r->beyond);
    diagnosis(c, f);
    tokens(c, f);
    fputs("<h2>As <code>kvdiff compare</code> reports it</h2>\n<pre>", f);
    esc(f, c->text);
    fputs("</pre>\n", f);
    plots(c, f);
    stage_table(c, f);
    fprintf(f, "<p class=\"muted\">Written by kvdiff. <a href=\"summary.md\">summary.md</a> · "
               "<a href=\"result.json\">result.json</a></p>\n</body>\n</html>\n");
}
