/* check_report.c — `kvdiff report` as a user runs it (identical and
 * divergent dumps, a saved JSON result, no gnuplot, a failing gnuplot, bad
 * input, a hostile file name) and the report library on in-memory
 * recordings (row-error grids, fingerprint-only sources, steps, partial
 * recordings, the JSON round trip). */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "compare/compare.h"
#include "reports/report.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Files                                                                */

static char *slurp(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    size_t got = fread(s, 1, (size_t)n, f);
    s[got] = 0;
    fclose(f);
    return s;
}

static bool exists(const char *dir, const char *name)
{
    char path[512];
    struct stat sb;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &sb) == 0;
}

static void assert_png(const char *dir, const char *name)
{
    static const unsigned char magic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    char path[512];
    unsigned char head[8] = {0};
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s missing", path);
    ck_assert_int_eq(fread(head, 1, 8, f), 8);
    fclose(f);
    ck_assert_msg(!memcmp(head, magic, 8), "%s is not a PNG", path);
}

static void assert_svg(const char *dir, const char *name)
{
    char *s = slurp(dir, name);
    ck_assert_msg(s != NULL, "%s/%s missing", dir, name);
    ck_assert_msg(!strncmp(s, "<?xml", 5) || !strncmp(s, "<svg", 4), "%s is not SVG", name);
    ck_assert_ptr_nonnull(strstr(s, "</svg>"));
    free(s);
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* ------------------------------------------------------------------ */
/* Dumps, made once per TCase in the runner process                     */

static char dumps[64];
static int dumps_ok;

static int record(const char *name, const char *engine_args)
{
    char args[512];
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 1 "
             "--max-new 8 %s --dump %s/%s", engine_args, dumps, name);
    return test_run_cli(args, out, sizeof out);
}

static void dumps_setup(void)
{
    dumps_ok = test_tmpdir(dumps, sizeof dumps) != NULL && record("a.h5", "") == 0 &&
               record("ok.h5", "--engine chunked --chunk 5") == 0 &&
               record("bad.h5", "--engine chunked --chunk 5 --inject window=4") == 0;
}

static void dumps_teardown(void)
{
    test_rmtree(dumps);
}

static void report_cli(const char *args, int want)
{
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "report %s", args);
    int rc = test_run_cli(cmd, out, sizeof out);
    ck_assert_msg(rc == want, "kvdiff %s: exit %d, want %d\n%s", cmd, rc, want, out);
}

/* Writes j to dumps/name and expects `report` to refuse it in one line
 * holding msg, exit 2, with no report in dumps/outdir. */
static void expect_json_refused(json_t *j, const char *name, const char *outdir,
                                const char *msg)
{
    char path[160], args[512];
    snprintf(path, sizeof path, "%s/%s", dumps, name);
    ck_assert_int_eq(json_dump_file(j, path, 0), 0);
    snprintf(args, sizeof args, "%s -o %s/%s", path, dumps, outdir);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, msg), "%s", out);
    char index[96];
    snprintf(index, sizeof index, "%s/index.html", outdir);
    ck_assert(!exists(dumps, index));
}

static void assert_plots_drawn(const char *dir, const char *const *names, int n)
{
    char plots[256], f[64];
    snprintf(plots, sizeof plots, "%s/plots", dir);
    for (int i = 0; i < n; i++) {
        snprintf(f, sizeof f, "%s.png", names[i]);
        assert_png(plots, f);
        snprintf(f, sizeof f, "%s.svg", names[i]);
        assert_svg(plots, f);
        snprintf(f, sizeof f, "%s.gp", names[i]);
        ck_assert_msg(exists(plots, f), "%s missing", f);
        snprintf(f, sizeof f, "%s.dat", names[i]);
        ck_assert_msg(exists(plots, f), "%s missing", f);
    }
}

static const char *const all_plots[] = {"heatmap", "growth", "positions", "steps"};

/* ------------------------------------------------------------------ */
/* Through the CLI                                                      */

START_TEST(test_identical_report)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128];
    snprintf(dir, sizeof dir, "%s/same", dumps);
    snprintf(args, sizeof args, "%s/a.h5 %s/ok.h5 -o %s", dumps, dumps, dir);
    report_cli(args, 0);
    ck_assert_msg(strstr(out, "identical: 6 layers"), "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "/same/index.html"));
    assert_plots_drawn(dir, all_plots, 4);
    char *html = slurp(dir, "index.html"), *md = slurp(dir, "summary.md");
    ck_assert_ptr_nonnull(html);
    ck_assert_ptr_nonnull(strstr(html, "class=\"verdict identical\">identical: "));
    /* embedded, so the page alone shows it */
    ck_assert_ptr_nonnull(strstr(html, "<img src=\"data:image/png;base64,"));
    ck_assert_ptr_nonnull(strstr(html, "tokens byte-identical"));
    ck_assert_msg(!strncmp(md, "kvdiff: identical: ", 19), "%s", md);
    free(html);
    free(md);
    /* every row bit-identical: the heatmap data say so, row by row */
    char plots[160];
    snprintf(plots, sizeof plots, "%s/plots", dir);
    char *dat = slurp(plots, "heatmap.dat");
    ck_assert_ptr_nonnull(strstr(dat, "\n0 0 -12 0\n"));
    ck_assert_ptr_null(strstr(dat, " 0.")); /* no non-zero error anywhere */
    free(dat);
    /* No divergence, no marker: the caption does not promise one. */
    html = slurp(dir, "index.html");
    char *cap = strstr(html, "<figcaption>Stage x_out, layer by position");
    ck_assert_ptr_nonnull(cap);
    char *cap_end = strstr(cap, "</figcaption>");
    ck_assert_ptr_nonnull(cap_end);
    *cap_end = 0;   /* the caption alone, not the page's embedded images after it */
    ck_assert_msg(!strstr(cap, "marker") && !strstr(cap, "dot") &&
                  strstr(cap, "chunk boundaries (every 5 positions"), "%.400s", cap);
    free(html);
}
END_TEST

/* A saved result without --stages still gets the metrics table when its
 * dumps are at hand: computed again from them (identical pairs too). */
START_TEST(test_json_without_stages_gets_table)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128], json[128];
    static const char *const pairs[] = {"ok.h5", "bad.h5"};
    for (int i = 0; i < 2; i++) {
        snprintf(json, sizeof json, "%s/nostages%d.json", dumps, i);
        snprintf(args, sizeof args, "compare --json %s/a.h5 %s/%s > %s", dumps, dumps, pairs[i],
                 json);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), i);
        snprintf(dir, sizeof dir, "%s/nostages%d", dumps, i);
        snprintf(args, sizeof args, "%s -o %s", json, dir);
        report_cli(args, i);
        char *html = slurp(dir, "index.html");
        ck_assert_msg(strstr(html, "<th class=\"l\">stage</th>"), "%s", pairs[i]);
        ck_assert_int_ge(count(html, i ? "<tr class=\"first\">" : "<tr class=\"same\">"), 1);
        ck_assert_ptr_null(strstr(html, "no per-stage table"));
        free(html);
    }
}
END_TEST

/* --note: a line under the verdict, escaped, on both pages. */
START_TEST(test_report_note)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128];
    snprintf(dir, sizeof dir, "%s/note", dumps);
    snprintf(args, sizeof args, "%s/a.h5 %s/ok.h5 -o %s --note 'expected <identical> *now*'",
             dumps, dumps, dir);
    report_cli(args, 0);
    char *html = slurp(dir, "index.html"), *md = slurp(dir, "summary.md");
    ck_assert_ptr_nonnull(strstr(html, "<p class=\"note\">expected &lt;identical&gt; *now*</p>"));
    ck_assert_msg(strstr(md, "**expected <identical> \\*now\\***") ||
                  strstr(md, "**expected \\<identical\\> \\*now\\***"), "%s", md);
    free(html);
    free(md);
}
END_TEST

START_TEST(test_divergent_report)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128], plots[160];
    snprintf(dir, sizeof dir, "%s/bad", dumps);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s", dumps, dumps, dir);
    report_cli(args, 1);
    /* the diagnosis in words; its id "window" is result.json's alone */
    ck_assert_msg(strstr(out, "diverged: first divergence at position 4, layer 0, stage "
                              "attn_lse (attention read a different key set at the "
                              "sliding-window boundary)\n"), "%s", out);
    assert_plots_drawn(dir, all_plots, 4);
    char *html = slurp(dir, "index.html"), *md = slurp(dir, "summary.md");
    ck_assert_ptr_nonnull(strstr(html, "<dt>position</dt><dd>4</dd>"));
    ck_assert_ptr_nonnull(strstr(html, "<dt>layer</dt><dd>0 (sliding, window 12)</dd>"));
    ck_assert_ptr_nonnull(strstr(html, "<dt>stage</dt><dd><code>attn_lse</code></dd>"));
    ck_assert_ptr_nonnull(strstr(html, "<h2>Diagnosis</h2>\n<p><strong>attention read a "
                                       "different key set at the sliding-window boundary"));
    ck_assert_ptr_nonnull(strstr(html, "window in test appears to be 4, config says 12"));
    ck_assert_ptr_null(strstr(html, "<code>window</code>"));
    /* the evidence one clause an item; ulp counts past 1024 are not printed */
    ck_assert_ptr_nonnull(strstr(html, "<p><em>verified</em>:</p>\n<ul class=\"evidence\">\n"
                                       "<li>recomputing attention from the test&#39;s q, k, v"));
    ck_assert_ptr_nonnull(strstr(html, "</li>\n<li>the config&#39;s key set reproduces the "
                                       "reference"));
    ck_assert_ptr_nonnull(strstr(html, "<td>&gt;1024</td>"));
    ck_assert_ptr_nonnull(strstr(html, "FIRST DIVERGENCE  position 4, layer 0"));
    ck_assert_ptr_nonnull(strstr(html, "<tr class=\"first\"><td>0</td><td class=\"l\">attn_lse"));
    const char *nl = strchr(md, '\n');
    ck_assert_ptr_nonnull(nl);
    static const char md_head[] = "kvdiff: diverged: first divergence at position 4, layer 0, "
                                  "stage attn\\_lse (attention read a different key set at the "
                                  "sliding-window boundary)\n";
    ck_assert_msg(!strncmp(md, md_head, strlen(md_head)), "%.*s", (int)(nl - md), md);
    ck_assert_ptr_nonnull(strstr(md, "- **Diagnosis:** attention read a different key set at the "
                                     "sliding-window boundary (window in test appears to be 4, "
                                     "config says 12) — verified:\n  - recomputing attention "));
    ck_assert_ptr_nonnull(strstr(md, "\n  - the config's key set reproduces the reference"));
    ck_assert_ptr_nonnull(strstr(md, "- **Tokens:** first differing generated token at "
                                     "position 40"));
    ck_assert_ptr_nonnull(strstr(md, "[heatmap](plots/heatmap.png)"));
    free(html);
    free(md);
    /* the heatmap shows the divergence stage with the window (12) and the
     * chunk boundaries (5, 10, ...) and marks the first divergence */
    snprintf(plots, sizeof plots, "%s/plots", dir);
    char *gp = slurp(plots, "heatmap.gp"), *dat = slurp(plots, "heatmap.dat");
    ck_assert_ptr_nonnull(strstr(gp, "stage attn_lse"));
    ck_assert_ptr_nonnull(strstr(gp, "set label 'window 12'"));
    ck_assert_ptr_nonnull(strstr(gp, "set arrow from 4.5, graph 0"));
    ck_assert_ptr_nonnull(strstr(gp, "set label 'first divergence (attn_lse)' at 4, 0"));
    ck_assert_ptr_nonnull(strstr(gp, "set output outdir.'heatmap.svg'"));
    /* positions 0..3 of layer 0 bit-identical, position 4 not */
    ck_assert_ptr_nonnull(strstr(dat, "\n3 0 -12 0\n4 0 "));
    ck_assert_ptr_null(strstr(dat, "\n4 0 -12 0\n"));
    free(gp);
    free(dat);
    char *steps = slurp(plots, "steps.gp");
    ck_assert_ptr_nonnull(strstr(steps, "approximate, from top-k"));
    /* inside the frame, right of its line: clear of the title and ticks */
    ck_assert_ptr_nonnull(strstr(steps, "set label 'tokens differ' at -0.5, graph 0.96 left"));
    free(steps);
    /* From the first position whose input token differs (40) on, rows are
     * not compared: blank (NaN) in the heatmap, not coloured as errors. */
    dat = slurp(plots, "heatmap.dat");
    ck_assert_ptr_nonnull(strstr(dat, "\n39 0 "));
    ck_assert_ptr_null(strstr(dat, "\n39 0 NaN"));
    ck_assert_ptr_nonnull(strstr(dat, "\n40 0 NaN NaN\n"));
    ck_assert_ptr_nonnull(strstr(dat, "\n46 5 NaN NaN\n"));
    free(dat);
    /* The positions plot draws the chunk boundaries its caption names, in
     * a colour that shows on white. */
    char *pgp = slurp(plots, "positions.gp");
    ck_assert_ptr_nonnull(strstr(pgp, "set arrow from 4.5, graph 0 to 4.5, graph 1 nohead lw 1.5 "
                                      "dt 3 lc rgb '#7f7f7f'"));
    free(pgp);
    html = slurp(dir, "index.html");
    const char *cap = strstr(html, "<figcaption>Stage x_out, layers");
    ck_assert_ptr_nonnull(cap);
    ck_assert_ptr_nonnull(strstr(cap, "Dotted grey lines: the test&#39;s prefill chunk"));
    cap = strstr(html, "<figcaption>Stage attn_lse, layer by position");
    ck_assert_ptr_nonnull(cap);
    ck_assert_ptr_nonnull(strstr(cap, "The green dot marks the first divergence."));
    ck_assert_ptr_nonnull(strstr(cap, "are not compared and are left blank"));
    /* A narrow window does not scroll sideways: the table scrolls inside
     * itself, images shrink with their height. */
    ck_assert_ptr_nonnull(strstr(html, "display:block;max-width:100%;overflow-x:auto"));
    ck_assert_ptr_nonnull(strstr(html, "img{max-width:100%;height:auto"));
    free(html);
    /* Log axes are written alike in every plot: 1e-12 ... 1e+02. */
    static const char *const logplots[] = {"growth.gp", "positions.gp"};
    for (int i = 0; i < 2; i++) {
        char *g = slurp(plots, logplots[i]);
        ck_assert_msg(strstr(g, "set format y '%.0e'"), "%s", logplots[i]);
        free(g);
    }
    gp = slurp(plots, "heatmap.gp");
    ck_assert_ptr_nonnull(strstr(gp, "set format cb '1e%+03.0f'"));
    free(gp);
}
END_TEST

START_TEST(test_report_options)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128], plots[160];
    snprintf(dir, sizeof dir, "%s/opts", dumps);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s --stage attn_out --layers 0,3,5",
             dumps, dumps, dir);
    report_cli(args, 1);
    snprintf(plots, sizeof plots, "%s/plots", dir);
    char *pos = slurp(plots, "positions.dat"), *grow = slurp(plots, "growth.gp");
    ck_assert_ptr_nonnull(strstr(pos, "stage attn_out"));
    ck_assert_ptr_nonnull(strstr(pos, "# columns: position layer_0 layer_3 layer_5\n"));
    ck_assert_ptr_nonnull(strstr(grow, "stage attn_out"));
    free(pos);
    free(grow);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s --layers 9", dumps, dumps, dir);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "the model has 6 layers"), "%s", out);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s --stage logits", dumps, dumps, dir);
    report_cli(args, 2);
    report_cli("only.h5", 2);
    ck_assert_ptr_nonnull(strstr(out, "-o DIR"));
    /* dumps compare refuses: compare's error, exit 2 */
    snprintf(args, sizeof args, "%s/a.h5 %s/missing.h5 -o %s/never", dumps, dumps, dumps);
    report_cli(args, 2);
    ck_assert_ptr_nonnull(strstr(out, "missing.h5"));
    ck_assert(!exists(dumps, "never"));
}
END_TEST

START_TEST(test_json_input)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128], json[128];
    snprintf(json, sizeof json, "%s/result.json", dumps);
    snprintf(args, sizeof args, "compare --json --stages %s/a.h5 %s/bad.h5 > %s", dumps, dumps,
             json);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    json_t *saved = json_load_file(json, 0, NULL);
    ck_assert_ptr_nonnull(saved);
    ck_assert_ptr_nonnull(json_object_get(json_object_get(saved, "inputs"), "ref"));
    /* the dumps it names exist: every plot is drawn */
    snprintf(dir, sizeof dir, "%s/fromjson", dumps);
    snprintf(args, sizeof args, "%s -o %s", json, dir);
    report_cli(args, 1);
    ck_assert_msg(strstr(out, "diverged: first divergence at position 4"), "%s", out);
    assert_plots_drawn(dir, all_plots, 4);
    /* the result it writes is the one it read */
    char path[256];
    snprintf(path, sizeof path, "%s/result.json", dir);
    json_t *again = json_load_file(path, 0, NULL);
    ck_assert_msg(json_equal(saved, again), "result.json differs from the input");
    json_decref(again);
    json_decref(saved);
    /* without the dumps: what the JSON supports, and why the rest is not there */
    snprintf(args, sizeof args, "mv %s/a.h5 %s/a.moved", dumps, dumps);
    ck_assert_int_eq(system(args), 0);
    snprintf(dir, sizeof dir, "%s/jsononly", dumps);
    snprintf(args, sizeof args, "report %s -o %s", json, dir);
    int rc = test_run_cli(args, out, sizeof out);
    snprintf(args, sizeof args, "mv %s/a.moved %s/a.h5", dumps, dumps);
    ck_assert_int_eq(system(args), 0);
    ck_assert_msg(rc == 1, "%s", out);
    const char *growth[] = {"growth"};
    assert_plots_drawn(dir, growth, 1);
    ck_assert(!exists(dir, "plots/heatmap.png"));
    ck_assert(!exists(dir, "plots/steps.png"));
    char *html = slurp(dir, "index.html");
    ck_assert_ptr_nonnull(strstr(html, "<h2>Diagnosis</h2>"));
    ck_assert_int_eq(count(html, "Left out: needs"), 3);
    ck_assert_ptr_nonnull(strstr(html, "<tr class=\"first\">"));
    free(html);
}
END_TEST

START_TEST(test_no_gnuplot)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128];
    snprintf(dir, sizeof dir, "%s/nognuplot", dumps);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s", dumps, dumps, dir);
    setenv("GNUPLOT", "/nonexistent", 1);
    report_cli(args, 1);
    unsetenv("GNUPLOT");
    ck_assert_int_eq(count(out, "report: gnuplot not found; plots skipped (install it: apt-get "
                                "install gnuplot-nox)"), 1);
    ck_assert(exists(dir, "index.html") && exists(dir, "summary.md") &&
              exists(dir, "result.json"));
    ck_assert(exists(dir, "plots/heatmap.gp") && exists(dir, "plots/heatmap.dat"));
    ck_assert(!exists(dir, "plots/heatmap.png") && !exists(dir, "plots/steps.svg"));
    char *html = slurp(dir, "index.html");
    ck_assert_ptr_nonnull(strstr(html, "Plots were not drawn: gnuplot was not found"));
    ck_assert_ptr_null(strstr(html, "<img"));
    ck_assert_ptr_nonnull(strstr(html, "<h2>Diagnosis</h2>"));
    free(html);
}
END_TEST

START_TEST(test_gnuplot_fails)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128], fake[128];
    snprintf(fake, sizeof fake, "%s/fake-gnuplot", dumps);
    FILE *f = fopen(fake, "w");
    fprintf(f, "#!/bin/sh\necho 'warning: font not found' >&2\necho '         ^' >&2\n"
               "for a; do last=$a; done\n"
               "echo \"\\\"$last\\\" line 7: undefined variable: nope\" >&2\nexit 1\n");
    fclose(f);
    chmod(fake, 0755);
    snprintf(dir, sizeof dir, "%s/failing", dumps);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s", dumps, dumps, dir);
    setenv("GNUPLOT", fake, 1);
    report_cli(args, 1);
    unsetenv("GNUPLOT");
    ck_assert_msg(strstr(out, "gnuplot failed on ") && strstr(out, "/failing/plots/heatmap.gp: "
                  "\"heatmap.gp\" line 7: undefined variable: nope"), "%s", out);
    char *html = slurp(dir, "index.html");
    ck_assert_ptr_nonnull(strstr(html, "gnuplot failed on plots/steps.gp: &quot;steps.gp&quot; "
                                       "line 7"));
    free(html);
}
END_TEST

START_TEST(test_malformed_json)
{
    static const char *const bad[][2] = {
        {"not json at all", "not JSON"},
        {"[1, 2]", "is not an object"},
        {"{\"mode\": {}}", "verdict is missing"},
        {"{\"verdict\": 1}", "verdict is not a string"},
        {"{\"verdict\": \"maybe\"}", "verdict is not identical"},
        {"{\"verdict\": \"identical\", \"mode\": {\"exact\": 1}}", "mode.exact is not true"},
    };
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(path, sizeof path, "%s/r%zu.json", dir, i);
        FILE *f = fopen(path, "w");
        fputs(bad[i][0], f);
        fclose(f);
        snprintf(args, sizeof args, "%s -o %s/out", path, dir);
        report_cli(args, 2);
        ck_assert_msg(strstr(out, path) && strstr(out, bad[i][1]), "case %zu: %s", i, out);
        ck_assert_int_eq(count(out, "\n"), 1);
        ck_assert(!exists(dir, "out"));
    }
    /* A file that is not there is not "not JSON". */
    snprintf(args, sizeof args, "%s/none.json -o %s/out", dir, dir);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "none.json: cannot read it (No such file or directory)") &&
                  !strstr(out, "not JSON"), "%s", out);
    ck_assert_int_eq(count(out, "\n"), 1);
    test_rmtree(dir);
}
END_TEST

/* A wrong type deep inside a real result is named by its key path. */
START_TEST(test_malformed_json_deep)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], json[128];
    snprintf(json, sizeof json, "%s/deep.json", dumps);
    snprintf(args, sizeof args, "compare --json --stages %s/a.h5 %s/bad.h5 > %s", dumps, dumps,
             json);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    static const char *const edits[][3] = {
        {"tokens", "n_ref", "tokens.n_ref is not an integer"},
        {"first_divergence", "stage", "first_divergence.stage names no known stage"},
        {"diagnosis", "kind", "diagnosis.kind is not a known name"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof *edits; i++) {
        json_t *j = json_load_file(json, 0, NULL);
        json_object_set_new(json_object_get(j, edits[i][0]), edits[i][1], json_string("bogus"));
        char path[160];
        snprintf(path, sizeof path, "%s/deep%zu.json", dumps, i);
        json_dump_file(j, path, 0);
        json_decref(j);
        snprintf(args, sizeof args, "%s -o %s/deepout", path, dumps);
        report_cli(args, 2);
        ck_assert_msg(strstr(out, edits[i][2]), "%s", out);
        ck_assert(!exists(dumps, "deepout/index.html"));
    }
}
END_TEST

START_TEST(test_unwritable_output)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], path[128];
    snprintf(path, sizeof path, "%s/in-the-way", dumps);
    FILE *f = fopen(path, "w");
    fclose(f);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s", dumps, dumps, path);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "in-the-way: exists and is a regular file, not a folder"), "%s",
                  out);
    ck_assert_int_eq(count(out, "\n"), 1);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s/sub", dumps, dumps, path);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "in-the-way/sub: cannot create the folder"), "%s", out);
    /* plots/ in the way */
    snprintf(path, sizeof path, "%s/plots-in-the-way", dumps);
    snprintf(args, sizeof args, "mkdir -p %s && touch %s/plots", path, path);
    ck_assert_int_eq(system(args), 0);
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o %s", dumps, dumps, path);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "plots-in-the-way/plots: exists and is a regular file, not a folder"),
                  "%s", out);
    ck_assert(!exists(path, "index.html"));
    /* a folder nobody may write into (even root cannot create files in /proc/self) */
    snprintf(args, sizeof args, "%s/a.h5 %s/bad.h5 -o /proc/self", dumps, dumps);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "/proc/self: "), "%s", out);
    /* an input inside the folder, where the report writes: refused before
     * it is read, and left as it was */
    char dir[128], json[160];
    snprintf(dir, sizeof dir, "%s/over", dumps);
    snprintf(json, sizeof json, "%s/result.json", dir);
    char setup[1024];
    snprintf(setup, sizeof setup, "mkdir -p %s/plots && cp %s/a.h5 %s/plots/a.h5 && "
             "echo '{\"kept\": 1}' > %s", dir, dumps, dir, json);
    ck_assert_int_eq(system(setup), 0);
    snprintf(args, sizeof args, "%s -o %s", json, dir);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "writes its result.json over the input") &&
                      count(out, "\n") == 1, "%s", out);
    char *kept = slurp(dir, "result.json");
    ck_assert_str_eq(kept, "{\"kept\": 1}\n");
    free(kept);
    snprintf(args, sizeof args, "%s/plots/a.h5 %s/bad.h5 -o %s", dir, dumps, dir);
    report_cli(args, 2);
    ck_assert_msg(strstr(out, "the folder the report writes its plots into"), "%s", out);
    ck_assert(!exists(dir, "index.html"));
}
END_TEST

/* A long run read at a glance: 240 positions in chunks of 3 drew 77
 * chunk lines over the heatmap and made the divergence a one-pixel column
 * with a clipped label; a run off by rounding alone was painted in the
 * colour of a bug. Now the heatmap is drawn around the first divergence
 * (heatmap.dat keeps every position), chunk lines past a density are left
 * out and the caption says so, and the colour scale tops out at an error
 * of 1 or more. */
START_TEST(test_long_run_readable)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    const char *runs[][2] = {{"r.h5", ""},
                             {"bug.h5", "--engine chunked --chunk 3 --inject window=4"},
                             {"drift.h5", "--engine chunked --chunk 3 --attn cascade"}};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 230 --seed 1 "
                 "--max-new 10 --ignore-eos %s --dump %s/%s", runs[i][1], dir, runs[i][0]);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    }
    snprintf(args, sizeof args, "report %s/r.h5 %s/bug.h5 -o %s/bug", dir, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    char sub[128];
    snprintf(sub, sizeof sub, "%s/bug", dir);
    char *gp = slurp(sub, "plots/heatmap.gp"), *html = slurp(sub, "index.html");
    ck_assert_ptr_nonnull(gp);
    ck_assert_ptr_nonnull(html);
    ck_assert_msg(strstr(gp, "set xrange [-0.5:96.5]"), "%s", gp);
    ck_assert_msg(strstr(html, "Drawn for positions 0..96, around the first divergence, of the "
                               "0..238 compared"), "no zoom in the heatmap's caption");
    ck_assert_msg(count(gp, "lc rgb '#ffffff' front") <= 48, "%s", gp);
    free(gp);
    /* the positions plot spans the run: its 77 chunk lines are left out */
    gp = slurp(sub, "plots/positions.gp");
    ck_assert_ptr_nonnull(gp);
    ck_assert_msg(count(gp, "dt 3") == 0, "%s", gp);
    ck_assert_msg(strstr(html, "are not drawn: at this scale they would cover the plot"),
                  "the caption does not say the chunk lines are left out");
    free(gp);
    free(html);
    /* rounding drift alone: cool colours, the scale up to 1e+00 */
    snprintf(args, sizeof args, "report %s/r.h5 %s/drift.h5 -o %s/drift", dir, dir, dir);
    test_run_cli(args, out, sizeof out);
    snprintf(sub, sizeof sub, "%s/drift", dir);
    gp = slurp(sub, "plots/heatmap.gp");
    ck_assert_ptr_nonnull(gp);
    ck_assert_msg(strstr(gp, "set cbrange [-12:0]"), "%s", gp);
    free(gp);
    test_rmtree(dir);
}
END_TEST

/* A dump cut short by a full disk (test_record_cut_short): the report
 * compares what it holds and says, on the page and in the summary, that the
 * recording is partial. */
START_TEST(test_partial_dump_report)
{
    char dir[64], args[768];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    ck_assert_int_eq(test_record_cut_short(dir), 0);
    snprintf(args, sizeof args, "report %s/ref.h5 %s/part.h5 -o %s/out", dir, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);   /* incomplete */
    ck_assert_msg(strstr(out, "INCOMPLETE: no divergence over what both hold"), "%s", out);
    char sub[128];
    snprintf(sub, sizeof sub, "%s/out", dir);
    char *html = slurp(sub, "index.html"), *md = slurp(sub, "summary.md");
    ck_assert_ptr_nonnull(html);
    ck_assert_ptr_nonnull(md);
    ck_assert_msg(strstr(html, "Partial recording: ") && strstr(html, "part.h5"), "%s", html);
    ck_assert_msg(strstr(md, "partial"), "%s", md);
    free(html);
    free(md);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_hostile_name)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    char args[512], dir[128];
    snprintf(args, sizeof args, "cp %s/bad.h5 '%s/<img src=x onerror=alert(1)>&.h5'", dumps,
             dumps);
    ck_assert_int_eq(system(args), 0);
    snprintf(dir, sizeof dir, "%s/hostile", dumps);
    snprintf(args, sizeof args, "%s/a.h5 '%s/<img src=x onerror=alert(1)>&.h5' -o %s", dumps,
             dumps, dir);
    report_cli(args, 1);
    char *html = slurp(dir, "index.html"), *md = slurp(dir, "summary.md");
    ck_assert_ptr_null(strstr(html, "<img src=x"));
    ck_assert_ptr_nonnull(strstr(html, "&lt;img src=x onerror=alert(1)&gt;&amp;.h5"));
    ck_assert_int_eq(count(md, "<img"), count(md, "\\<img"));   /* every one escaped */
    ck_assert_ptr_nonnull(strstr(md, "\\<img src=x onerror=alert(1)\\>\\&.h5"));
    free(html);
    free(md);
}
END_TEST

/* ------------------------------------------------------------------ */
/* The library on in-memory recordings                                  */

enum { T = 20, P = 16 };

/* x_out of every layer and logits from P - 1 on, values from a formula. */
static cmp_memrec *synthetic(const kv_config *cfg, const char *settings)
{
    kv_err e = {{0}};
    cmp_memrec_opts mo;
    cmp_memrec_opts_default(&mo);
    memset(mo.stages, 0, sizeof mo.stages);
    mo.stages[STAGE_X_OUT] = mo.stages[STAGE_LOGITS] = true;
    mo.topk = 4;
    cmp_memrec *m = cmp_memrec_new(cfg, "synthetic", settings, &mo, &e);
    ck_assert_msg(m != NULL, "%s", e.msg);
    kv_observer *o = cmp_memrec_observer(m);
    float *row = malloc((size_t)cfg->vocab * sizeof *row);
    for (int p = 0; p < T; p++) {
        ck_assert_int_eq(o->token(o, p, (p * 7) % cfg->vocab, p < P), 0);
        for (int l = 0; l < cfg->n_layers; l++) {
            for (int i = 0; i < cfg->hidden; i++)
                row[i] = (float)sin(0.1 * p + 0.3 * l + 0.01 * i);
            kv_event ev = {STAGE_X_OUT, l, p, 1, cfg->hidden, row};
            ck_assert_int_eq(o->emit(o, &ev), 0);
        }
        if (p >= P - 1) {
            for (int i = 0; i < cfg->vocab; i++)
                row[i] = (float)(0.01 * ((i * 37 + p) % 101));
            kv_event ev = {STAGE_LOGITS, -1, p, 1, cfg->vocab, row};
            ck_assert_int_eq(o->emit(o, &ev), 0);
        }
    }
    free(row);
    return m;
}

/* A fingerprint-only view of a memrec: row hashes, no rows. */
typedef struct {
    cmp_source inner;
    int cols;
} fp_ctx;

static int fp_info(void *ctx, int layer, kv_stage st, int64_t *first, int64_t *rows, int *cols)
{
    fp_ctx *c = ctx;
    return c->inner.info(c->inner.ctx, layer, st, first, rows, cols);
}

static int fp_hash(void *ctx, int layer, kv_stage st, int64_t pos0, int64_t n, uint64_t *h,
                   kv_err *e)
{
    fp_ctx *c = ctx;
    float row[256];
    for (int64_t i = 0; i < n; i++) {
        if (c->inner.read(c->inner.ctx, layer, st, pos0 + i, 1, row, e) < 0)
            return -1;
        h[i] = XXH3_64bits(row, (size_t)c->cols * sizeof(float));
    }
    return 0;
}

static void fingerprint_view(cmp_memrec *m, fp_ctx *c, cmp_source *view)
{
    cmp_memrec_source(m, &c->inner);
    c->cols = c->inner.cfg.hidden;
    *view = c->inner;
    view->ctx = c;
    view->info = fp_info;
    view->read = NULL;
    view->read_hash = fp_hash;
    view->output_info = NULL;
    view->output = NULL;
}

START_TEST(test_grid_and_steps)
{
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_int_eq(config_preset("tiny-gemma3", &cfg, &e), 0);
    cmp_memrec *a = synthetic(&cfg, NULL), *b = synthetic(&cfg, "{\"chunk\": 5}");
    /* plant one difference of 0.25 at (layer 2, position 7) */
    float *r = cmp_memrec_row(b, 2, STAGE_X_OUT, 7, NULL);
    ck_assert_ptr_nonnull(r);
    r[3] += 0.25f;
    const double want = fabs((double)r[3] - (double)cmp_memrec_row(a, 2, STAGE_X_OUT, 7, NULL)[3]);
    cmp_source sa, sb;
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    report_grid g;
    ck_assert_msg(report_grid_build(&sa, &sb, STAGE_X_OUT, 3, &g, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(g.n_layers, cfg.n_layers);
    ck_assert_int_eq(g.pos_lo, 0);
    ck_assert_int_eq(g.n_pos, T);
    ck_assert(!g.hashed);
    for (int l = 0; l < cfg.n_layers; l++)
        for (int p = 0; p < T; p++)
            ck_assert_msg(report_grid_at(&g, l, p) == (l == 2 && p == 7 ? want : 0),
                          "layer %d position %d: %g", l, p, report_grid_at(&g, l, p));
    ck_assert(isnan(report_grid_at(&g, 0, T)));
    report_grid_free(&g);
    /* a stage neither holds: an empty grid, not an error */
    ck_assert_int_eq(report_grid_build(&sa, &sb, STAGE_Q, 0, &g, &e), 0);
    ck_assert_int_eq(g.n_pos, 0);
    report_grid_free(&g);
    ck_assert_int_eq(report_grid_build(&sa, &sb, STAGE_LOGITS, 0, &g, &e), -1);
    report_grid_free(&g);
    /* fingerprints only: 0 / 1 per row */
    fp_ctx fa, fb;
    cmp_source ha, hb;
    fingerprint_view(a, &fa, &ha);
    fingerprint_view(b, &fb, &hb);
    ck_assert_msg(report_grid_build(&ha, &hb, STAGE_X_OUT, 0, &g, &e) == 0, "%s", e.msg);
    ck_assert(g.hashed);
    ck_assert(report_grid_at(&g, 2, 7) == 1 && report_grid_at(&g, 2, 6) == 0 &&
              report_grid_at(&g, 5, 7) == 0);
    report_grid_free(&g);
    /* rows against fingerprints: the rows are hashed the same way */
    ck_assert_msg(report_grid_build(&sa, &hb, STAGE_X_OUT, 0, &g, &e) == 0, "%s", e.msg);
    ck_assert(g.hashed && report_grid_at(&g, 2, 7) == 1 && report_grid_at(&g, 1, 7) == 0);
    report_grid_free(&g);
    /* steps: same logits, so KL 0 and equal margins at each generated step */
    report_step *st;
    int64_t n;
    ck_assert_msg(report_steps_build(&sa, &sb, &st, &n, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(n, T - P + 1);
    ck_assert_int_eq(st[0].pos, P - 1);
    ck_assert_int_eq(st[0].step, 0);
    for (int64_t i = 0; i < n; i++) {
        ck_assert(st[i].kl == 0);
        ck_assert(st[i].ref_margin == st[i].test_margin && st[i].ref_margin >= 0);
        ck_assert_int_eq(st[i].ref_top1, st[i].test_top1);
    }
    free(st);
    ck_assert_int_eq(report_steps_build(&ha, &hb, &st, &n, &e), 0);
    ck_assert_int_eq(n, 0);
    ck_assert_ptr_null(st);
    cmp_memrec_free(a);
    cmp_memrec_free(b);
}
END_TEST

START_TEST(test_library_report)
{
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_int_eq(config_preset("tiny-gemma3", &cfg, &e), 0);
    cmp_memrec *a = synthetic(&cfg, NULL), *b = synthetic(&cfg, "{\"chunk\": 5}");
    cmp_memrec_row(b, 3, STAGE_X_OUT, 9, NULL)[0] += 1.0f;
    cmp_memrec_set_complete(b, false);
    cmp_source sa, sb;
    cmp_memrec_source(a, &sa);
    cmp_memrec_source(b, &sb);
    cmp_result r;
    ck_assert_msg(cmp_compare(&sa, &sb, NULL, &r, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(r.verdict, CMP_DIVERGED);
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    report_opts o;
    report_opts_default(&o);
    o.gnuplot = "/nonexistent/gnuplot";   /* the library path without images */
    report_info info;
    ck_assert_msg(report_write(dir, &r, &sa, &sb, &o, &info, &e) == 0, "%s", e.msg);
    ck_assert(info.gnuplot_missing);
    ck_assert_int_eq(info.plots_drawn, 0);
    ck_assert_ptr_nonnull(strstr(info.index_path, "/index.html"));
    char *html = slurp(dir, "index.html");
    ck_assert_ptr_nonnull(strstr(html, "Partial recording: the test (synthetic"));
    ck_assert_ptr_nonnull(strstr(html, "<dt>position</dt><dd>9</dd>"));
    ck_assert_ptr_nonnull(strstr(html, "<dt>stage</dt><dd><code>x_out</code></dd>"));
    free(html);
    char plots[128];
    snprintf(plots, sizeof plots, "%s/plots", dir);
    char *dat = slurp(plots, "heatmap.dat"), *gp = slurp(plots, "positions.gp");
    ck_assert_ptr_nonnull(strstr(dat, "\n9 3 0 1\n"));   /* log10(1) = 0, error 1 */
    ck_assert_ptr_nonnull(strstr(dat, "\n8 3 -12 0\n"));
    ck_assert_ptr_nonnull(strstr(gp, "title 'layer 3'"));   /* the divergence layer */
    ck_assert_ptr_nonnull(strstr(gp, "title 'layer 0'"));
    ck_assert_ptr_nonnull(strstr(gp, "title 'layer 5'"));
    ck_assert_ptr_nonnull(strstr(gp, "set arrow from 14.5, graph 0"));   /* chunk 5 */
    free(dat);
    free(gp);
    /* one recording without the other is refused */
    ck_assert_int_eq(report_write(dir, &r, &sa, NULL, &o, &info, &e), -1);
    cmp_result_free(&r);
    cmp_memrec_free(a);
    cmp_memrec_free(b);
    test_rmtree(dir);
}
END_TEST

/* The JSON read back renders exactly as the result it was written from. */
START_TEST(test_json_round_trip)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    static const char *const tests[] = {"bad.h5", "ok.h5"};
    for (int t = 0; t < 2; t++) {
        kv_err e = {{0}};
        char ra[128], rb[128], json[128];
        snprintf(ra, sizeof ra, "%s/a.h5", dumps);
        snprintf(rb, sizeof rb, "%s/%s", dumps, tests[t]);
        snprintf(json, sizeof json, "%s/rt%d.json", dumps, t);
        cmp_source sa, sb;
        cmp_dump_source *da = cmp_dump_source_open(ra, &sa, &e);
        cmp_dump_source *db = cmp_dump_source_open(rb, &sb, &e);
        ck_assert_msg(da && db, "%s", e.msg);
        cmp_result r;
        ck_assert_msg(cmp_compare(&sa, &sb, NULL, &r, &e) == 0, "%s", e.msg);
        json_t *j = cmp_result_json(&r, CMP_RENDER_STAGES);
        ck_assert_int_eq(json_dump_file(j, json, 0), 0);
        json_decref(j);
        report_json back;
        ck_assert_msg(report_json_load(json, &back, &e) == 0, "%s", e.msg);
        ck_assert(back.has_stages);
        ck_assert_ptr_null(back.ref_path);
        char *t1 = cmp_render_text(&r, CMP_RENDER_STAGES);
        char *t2 = cmp_render_text(&back.r, CMP_RENDER_STAGES);
        ck_assert_str_eq(t1, t2);
        free(t1);
        free(t2);
        json_t *j1 = cmp_result_json(&r, CMP_RENDER_STAGES);
        json_t *j2 = cmp_result_json(&back.r, CMP_RENDER_STAGES);
        ck_assert(json_equal(j1, j2));
        json_decref(j1);
        json_decref(j2);
        report_json_free(&back);
        cmp_result_free(&r);
        cmp_dump_source_close(db);
        cmp_dump_source_close(da);
    }
}
END_TEST

/* A compare judged by the cross-runtime drift model, saved as JSON and
 * read back: the report says which model judged, with its figures, as
 * the fresh result does (text and JSON alike), with and without the
 * per-stage table. */
START_TEST(test_json_round_trip_xrt)
{
    ck_assert_msg(dumps_ok, "recording the dumps failed: %s", out);
    static const char *const tests[] = {"bad.h5", "ok.h5"};
    for (int t = 0; t < 4; t++) {
        kv_err e = {{0}};
        char ra[128], rb[128], json[128];
        snprintf(ra, sizeof ra, "%s/a.h5", dumps);
        snprintf(rb, sizeof rb, "%s/%s", dumps, tests[t % 2]);
        snprintf(json, sizeof json, "%s/xrt%d.json", dumps, t);
        const int flags = t < 2 ? CMP_RENDER_STAGES : 0;
        cmp_source sa, sb;
        cmp_dump_source *da = cmp_dump_source_open(ra, &sa, &e);
        cmp_dump_source *db = cmp_dump_source_open(rb, &sb, &e);
        ck_assert_msg(da && db, "%s", e.msg);
        cmp_opts o;
        cmp_opts_default(&o);
        o.cross_runtime = CMP_XRT_ON;
        cmp_result r;
        ck_assert_msg(cmp_compare(&sa, &sb, &o, &r, &e) == 0, "%s", e.msg);
        ck_assert(r.xrt.on);
        json_t *j = cmp_result_json(&r, flags);
        ck_assert_int_eq(json_dump_file(j, json, 0), 0);
        json_decref(j);
        report_json back;
        ck_assert_msg(report_json_load(json, &back, &e) == 0, "%s", e.msg);
        ck_assert(back.r.xrt.on);
        char *t1 = cmp_render_text(&r, flags);
        char *t2 = cmp_render_text(&back.r, flags);
        /* (an identical pair has no drift to speak of) */
        ck_assert_msg(t % 2 || strstr(t2, "drift model drift-step"), "%.1500s", t2);
        ck_assert_str_eq(t1, t2);
        free(t1);
        free(t2);
        json_t *j1 = cmp_result_json(&r, flags);
        json_t *j2 = cmp_result_json(&back.r, flags);
        ck_assert(json_equal(j1, j2));
        json_decref(j1);
        json_decref(j2);
        report_json_free(&back);
        cmp_result_free(&r);
        cmp_dump_source_close(db);
        cmp_dump_source_close(da);
    }
    /* The report made from it says so too. */
    char args[512], dir[128];
    snprintf(dir, sizeof dir, "%s/fromxrt", dumps);
    snprintf(args, sizeof args, "%s/xrt0.json -o %s", dumps, dir);
    report_cli(args, 1);
    char *html = slurp(dir, "index.html");
    /* These dumps (kvdiff's own, judged as another runtime) state no
     * compute precision: the report says what was assumed, as the compare
     * did. */
    ck_assert_msg(strstr(html, "cross-runtime: drift model drift-step (compute f32 assumed: "
                               "kvdiff&#39;s own engines compute in f32") &&
                  strstr(html, "KV cache ") && strstr(html, "step: error "), "%.2000s", html);
    free(html);
    {
        /* A compute block that contradicts itself (stated, yet with the
         * reason it was assumed) is refused with its key path. */
        char cpath[160];
        snprintf(cpath, sizeof cpath, "%s/xrt0.json", dumps);
        json_t *cj = json_load_file(cpath, 0, NULL);
        ck_assert_ptr_nonnull(cj);
        json_t *cx = json_object_get(json_object_get(cj, "mode"), "cross_runtime");
        json_t *cc = json_object_get(cx, "compute");
        ck_assert_msg(json_is_object(cc) &&
                      !strcmp(json_string_value(json_object_get(cc, "precision")), "f32") &&
                      json_is_false(json_object_get(cc, "stated")), "compute block missing");
        json_object_set_new(cc, "stated", json_true());
        expect_json_refused(cj, "xrt-compute.json", "computeout",
                            "mode.cross_runtime.compute.assumed_why does not agree");
        json_decref(cj);
    }

    /* The attention check's block: a run of it read back whole, and one
     * whose fields contradict each other refused with the key path. */
    char path[160], back_json[160];
    snprintf(path, sizeof path, "%s/xrt0.json", dumps);
    json_t *j = json_load_file(path, 0, NULL);
    ck_assert_ptr_nonnull(j);
    json_t *x = json_object_get(json_object_get(j, "mode"), "cross_runtime");
    json_t *ran = json_pack("{sb sn si sf sf sb sn s{si si sf sf}}", "ran", 1, "skipped",
                            "layers", 3, "threshold", 0.0196, "rms_weight", 2.0, "step", 0,
                            "drift_threshold", "closest",
                            "position", 5, "layer", 1, "residual", 0.004, "ratio",
                            0.004 / 0.0196);
    json_object_set_new(x, "attention_check", ran);
    snprintf(back_json, sizeof back_json, "%s/xrt-check.json", dumps);
    ck_assert_int_eq(json_dump_file(j, back_json, 0), 0);
    kv_err e = {{0}};
    report_json back;
    ck_assert_msg(report_json_load(back_json, &back, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(back.r.xrt.audit_layers, 3);
    ck_assert_int_eq(back.r.xrt.audit_worst_pos, 5);
    json_t *j2 = cmp_result_json(&back.r, CMP_RENDER_STAGES);
    ck_assert(json_equal(json_object_get(json_object_get(json_object_get(j2, "mode"),
                                                         "cross_runtime"), "attention_check"),
                         json_object_get(x, "attention_check")));
    char *text = cmp_render_text(&back.r, CMP_RENDER_STAGES);
    ck_assert_msg(strstr(text, "attention check: the test's attn_out against attention "
                                "recomputed") && strstr(text, "position 5, layer 1 (0.004)"),
                  "%.2000s", text);
    free(text);
    json_decref(j2);
    report_json_free(&back);
    json_object_set_new(json_object_get(x, "attention_check"), "skipped",
                        json_string("the test's KV cache type is not recorded"));
    expect_json_refused(j, "xrt-check.json", "checkout",
                        "mode.cross_runtime.attention_check.ran does not agree");
    json_decref(j);
}
END_TEST

Suite *report_suite(void)
{
    Suite *s = suite_create("report");
    TCase *cli = tcase_create("cli");
    tcase_add_unchecked_fixture(cli, dumps_setup, dumps_teardown);
    tcase_set_timeout(cli, 30);
    tcase_add_test(cli, test_identical_report);
    tcase_add_test(cli, test_divergent_report);
    tcase_add_test(cli, test_report_options);
    tcase_add_test(cli, test_json_input);
    tcase_add_test(cli, test_json_round_trip_xrt);
    tcase_add_test(cli, test_json_without_stages_gets_table);
    tcase_add_test(cli, test_report_note);
    tcase_add_test(cli, test_no_gnuplot);
    tcase_add_test(cli, test_gnuplot_fails);
    tcase_add_test(cli, test_malformed_json_deep);
    tcase_add_test(cli, test_unwritable_output);
    tcase_add_test(cli, test_hostile_name);
    tcase_add_test(cli, test_partial_dump_report);
    tcase_add_test(cli, test_json_round_trip);
    tcase_add_test(cli, test_long_run_readable);
    suite_add_tcase(s, cli);
    TCase *lib = tcase_create("library");
    tcase_add_test(lib, test_malformed_json);
    tcase_add_test(lib, test_grid_and_steps);
    tcase_add_test(lib, test_library_report);
    suite_add_tcase(s, lib);
    return s;
}
