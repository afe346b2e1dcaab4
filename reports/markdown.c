/* markdown.c — summary.md, the report as a CI comment: the verdict line
 * first, then the first divergence, the diagnosis, the tokens and links
 * to the plots. Text from the inputs is escaped so it renders literally. */
#include <math.h>
#include <string.h>

#include "rep_internal.h"
#include "../model/text.h"

/* Backslash-escapes what Markdown (and the HTML it allows) would act on. */
static void md(FILE *f, const char *s)
{
    for (; s && *s; s++) {
        /* a control byte from a file name or a dump string is shown as
         * \xNN (its backslash escaped for Markdown), never passed on */
        if (((unsigned char)*s < 0x20 && *s != '\t') || *s == 0x7f) {
            fprintf(f, "\\\\x%02x", (unsigned char)*s);
            continue;
        }
        if (strchr("\\`*_{}[]|<>&~", *s))
            fputc('\\', f);
        fputc(*s, f);
    }
}

static void point(FILE *f, const char *title, const cmp_divergence *d)
{
    fprintf(f, "- **%s:** position %lld, ", title, (long long)d->pos);
    if (d->layer >= 0) {
        fprintf(f, "layer %d (%s", d->layer, d->layer_sliding ? "sliding" : "global");
        if (d->layer_sliding)
            fprintf(f, ", window %d", d->layer_window);
        fputs(")", f);
    } else {
        fputs("model level", f);
    }
    fprintf(f, ", stage `%s`", stage_name(d->stage));
    if (d->head >= 0)
        fprintf(f, ", head %d", d->head);
    if (!d->hashed)
        fprintf(f, " — ref %.9g, test %.9g (row: max abs %.3g, relative %.3g)", d->ref, d->test,
                d->row_max_abs, d->row_rel);
    fputs("\n", f);
}

/* The diagnosis's evidence, one clause a nested bullet. */
static void evidence(FILE *f, const cmp_diagnosis *g)
{
    if (!g->evidence[0]) {
        fputs("\n", f);
        return;
    }
    fprintf(f, " — %s:\n", cmp_evidence_label(g));
    for (const char *s = g->evidence, *next; s && *s; s = next) {
        size_t n;
        next = cmp_evidence_clause(s, &n);
        char clause[sizeof g->evidence];
        snprintf(clause, sizeof clause, "%.*s", (int)n, s);
        fputs("  - ", f);
        md(f, clause);
        fputs("\n", f);
    }
}

static void tokens(const rep_ctx *c, FILE *f)
{
    const cmp_tokens *t = &c->r->tokens;
    fputs("- **Tokens:** ", f);
    switch (t->kind) {
    case CMP_TOKENS_IDENTICAL:
        fprintf(f, "byte-identical (%lld tokens)", (long long)t->n_ref);
        break;
    case CMP_TOKENS_LENGTH:
        if (t->test_stopped) {
            fprintf(f, "identical over the %lld positions the test ran (it was stopped past "
                    "its first divergence)", (long long)t->n_test);
            break;
        }
        fprintf(f, "token counts differ (reference %lld, test %lld), identical over the "
                "common prefix",
                (long long)t->n_ref, (long long)t->n_test);
        break;
    case CMP_TOKENS_NONE:
        fputs("not recorded", f);
        break;
    case CMP_TOKENS_DIFFER:
        fprintf(f, "first differing %s at position %lld: ref %d (margin ",
                t->step >= 0 ? "generated token" : "prompt token", (long long)t->pos, t->ref_id);
        rep_margin(f, t->ref_margin);
        fprintf(f, ") vs test %d (margin ", t->test_id);
        rep_margin(f, t->test_margin);
        fputs(")", f);
        if (t->step >= 0)
            fprintf(f, ", step %lld", (long long)t->step);
        if (t->near_tie)
            fputs("; a near tie in both runs", f);
        break;
    }
    fputs("\n", f);
}

/* A fence longer than any run of '~' in the text. */
static int fence_len(const char *s)
{
    int run = 0, most = 0;
    for (; s && *s; s++) {
        run = *s == '~' ? run + 1 : 0;
        most = run > most ? run : most;
    }
    return most < 3 ? 3 : most + 1;
}

void rep_markdown_write(const rep_ctx *c, FILE *f)
{
    const cmp_result *r = c->r;
    char verdict[1024];
    report_verdict_line(r, verdict, sizeof verdict);
    fputs("kvdiff: ", f);
    md(f, verdict);
    fputs("\n\n", f);
    if (c->o->note && *c->o->note) {
        fputs("**", f);
        md(f, c->o->note);
        fputs("**\n\n", f);
    }
    fputs("- **Reference:** ", f);
    md(f, c->o->ref_path ? c->o->ref_path : c->ref && c->ref->label ? c->ref->label : "?");
    fputs("\n- **Test:** ", f);
    md(f, c->o->test_path ? c->o->test_path : c->test && c->test->label ? c->test->label : "?");
    fputs("\n", f);
    if (c->partial[0]) {
        fputs("- **Partial recording:** ", f);
        md(f, c->partial);
        fputs("\n", f);
    }
    if (r->first.found)
        point(f, "First divergence", &r->first);
    if (r->beyond.found)
        point(f, "Beyond drift", &r->beyond);
    if (r->diag.kind != CMP_DIAG_NONE) {
        /* in words: the id (cmp_diag_name) is result.json's */
        fputs("- **Diagnosis:** ", f);
        md(f, r->diag.summary);
        if (r->diag.detail[0]) {
            fputs(" ", f);
            md(f, r->diag.detail);
        }
        evidence(f, &r->diag);
    }
    tokens(c, f);
    fputs("\n**Plots:**", f);
    int drawn = 0;
    for (int i = 0; i < PLOT_COUNT; i++)
        if (c->plots[i].drawn)
            fprintf(f, "%s [%s](plots/%s.png) ([svg](plots/%s.svg))", drawn++ ? "," : "",
                    c->plots[i].name, c->plots[i].name, c->plots[i].name);
    if (!drawn)
        fputs(c->gnuplot_missing ? " not drawn (gnuplot not found)" : " none drawn", f);
    fputs("\n", f);
    for (int i = 0; i < PLOT_COUNT; i++)
        if (!c->plots[i].drawn && c->plots[i].why[0] && !c->gnuplot_missing) {
            fprintf(f, "- %s left out: ", c->plots[i].name);
            md(f, c->plots[i].why);
            fputs("\n", f);
        }
    const int n = fence_len(c->text);
    fprintf(f, "\n<details><summary>kvdiff compare output</summary>\n\n%.*s\n", n,
            "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~");
    kv_fputs_escaped(c->text ? c->text : "", f, true);
    if (c->text && c->text[0] && c->text[strlen(c->text) - 1] != '\n')
        fputs("\n", f);
    fprintf(f, "%.*s\n\n</details>\n", n,
            "~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~");
}
