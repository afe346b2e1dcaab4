/* check_report_units.c — the report's plots in units of the verdict. A
 * cross-runtime report (reference vs llama.cpp on a gen'd tiny-gemma3)
 * draws each row's error over the drift threshold it was judged against,
 * on one colour scale for every report, with the threshold drawn: a
 * correct run has no value above 1; a bug run (llama.cpp's ubatches of 32
 * seeing only their own keys) has its first divergence as the only value
 * above 1 up to it. An exact report keeps its scale. The per-step series
 * stop where a generated token differs: later steps' inputs differ. */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_patch.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Dumps and reports, made once in the runner process                   */

static char dir[64];
static int ready;

static int cli(const char *fmt, const char *a, const char *b)
{
    char args[1024];
    snprintf(args, sizeof args, fmt, a, b);
    return test_run_cli(args, out, sizeof out);
}

/* llama.cpp on the reference's prompt, 16 generated, extra settings. */
static int llama(const char *name, const char *extra)
{
    char args[1024];
    snprintf(args, sizeof args, "%s/m.gguf --hf %s/hf --prompt-from %s/ref.h5 --max-new 16 "
             "--ignore-eos --threads 1 %s --dump %s/%s", dir, dir, dir, extra, dir, name);
    return test_run_recorder(args, out, sizeof out);
}

/* `kvdiff report a b -o dir/name`: its exit code. */
static int report(const char *a, const char *b, const char *name)
{
    char args[1024];
    snprintf(args, sizeof args, "report %s/%s %s/%s -o %s/%s", dir, a, dir, b, dir, name);
    return test_run_cli(args, out, sizeof out);
}

static void setup(void)
{
    ready = test_tmpdir(dir, sizeof dir) != NULL &&
            cli("gen --preset tiny-gemma3 -o %s/hf --gguf %s/m.gguf", dir, dir) == 0 &&
            cli("run --model %s/hf --prompt-random 100 --seed 3 --max-new 16 --ignore-eos "
                "--dump %s/ref.h5", dir, dir) == 0 &&
            llama("ok.h5", "") == 0 && llama("bug.h5", "--ubatch 32 --fault isolate-ubatch") == 0 &&
            cli("run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 8 --dump %s/%s",
                dir, "a.h5") == 0 &&
            cli("run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 8 --engine "
                "chunked --chunk 5 --inject window=4 --dump %s/%s", dir, "w4.h5") == 0 &&
            report("ref.h5", "ok.h5", "rep-ok") == 0 && report("ref.h5", "bug.h5", "rep-bug") == 1 &&
            report("a.h5", "w4.h5", "rep-exact") == 1;
}

static void teardown(void)
{
    test_rmtree(dir);
}

/* ------------------------------------------------------------------ */
/* Reading what the report wrote                                        */

static char *slurp(const char *rep, const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s/%s", dir, rep, name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s missing", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    s[fread(s, 1, (size_t)n, f)] = 0;
    fclose(f);
    return s;
}

/* The numbers of one data line of a .dat file (NaN as written). */
static int fields(const char *line, double *v, int max)
{
    int n = 0;
    char *end;
    for (const char *p = line; n < max;) {
        while (*p == ' ')
            p++;
        if (!*p || *p == '\n')
            break;
        v[n++] = strtod(p, &end);
        if (end == p)
            return -1;
        p = end;
    }
    return n;
}

/* Calls each(v, n, ctx) for every data line of plots/name (not comments
 * or blank lines); returns how many there were. */
static int each_row(const char *rep, const char *name, void (*each)(const double *, int, void *),
                    void *ctx)
{
    char *s = slurp(rep, name);
    int rows = 0;
    for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
        double v[16];
        if (line[0] == '#')
            continue;
        const int n = fields(line, v, 16);
        ck_assert_msg(n > 0, "%s: bad line '%s'", name, line);
        each(v, n, ctx);
        rows++;
    }
    free(s);
    return rows;
}

static json_t *result(const char *rep)
{
    char *s = slurp(rep, "result.json");
    json_t *j = json_loads(s, 0, NULL);
    free(s);
    ck_assert_ptr_nonnull(j);
    return j;
}

static void assert_has(const char *rep, const char *name, const char *what)
{
    char *s = slurp(rep, name);
    ck_assert_msg(strstr(s, what) != NULL, "%s/%s lacks \"%s\":\n%.400s", rep, name, what, s);
    free(s);
}

static void assert_lacks(const char *rep, const char *name, const char *what)
{
    char *s = slurp(rep, name);
    ck_assert_msg(strstr(s, what) == NULL, "%s/%s has \"%s\"", rep, name, what);
    free(s);
}

/* ------------------------------------------------------------------ */
/* A correct cross-runtime run: calm everywhere                         */

typedef struct {
    int first_col;               /* first column holding a ratio */
    double max;
    int values;
} ratio_max;

static void track_max(const double *v, int n, void *ctx)
{
    ratio_max *m = ctx;
    for (int i = m->first_col; i < n; i++)
        if (!isnan(v[i])) {
            m->max = fmax(m->max, v[i]);
            m->values++;
        }
}

START_TEST(units_correct_run_is_calm)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    assert_has("rep-ok", "plots/heatmap.dat", "over the drift threshold");
    /* heatmap.dat: position layer log10_ratio ratio */
    ratio_max heat = {.first_col = 3};
    each_row("rep-ok", "plots/heatmap.dat", track_max, &heat);
    ck_assert_int_ge(heat.values, 6 * 100);
    ck_assert_msg(heat.max > 0 && heat.max <= 1, "a correct run's ratio reaches %g", heat.max);
    ratio_max pos = {.first_col = 1};
    each_row("rep-ok", "plots/positions.dat", track_max, &pos);
    ck_assert_int_ge(pos.values, 100);
    ck_assert_msg(pos.max > 0 && pos.max <= 1, "positions.dat reaches %g", pos.max);
    /* the threshold is drawn on the line plots, at 1 */
    assert_has("rep-ok", "plots/positions.gp", "set arrow from graph 0, first 1 to graph 1, first 1");
    assert_has("rep-ok", "plots/growth.gp", "set arrow from graph 0, first 1 to graph 1, first 1");
    assert_has("rep-ok", "plots/positions.gp", "set yrange [0.001:1000]");
}
END_TEST

/* growth.dat's ratio columns only (the last is a row count). */
static void growth_max(const double *v, int n, void *ctx)
{
    ratio_max *m = ctx;
    for (int i = 1; i < n - 1; i++)
        if (!isnan(v[i]))
            m->max = fmax(m->max, v[i]);
}

START_TEST(units_correct_growth_is_calm)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    assert_has("rep-ok", "plots/growth.dat", "over their drift threshold");
    ratio_max grow = {0};
    ck_assert_int_eq(each_row("rep-ok", "plots/growth.dat", growth_max, &grow), 6);
    ck_assert_msg(grow.max > 0 && grow.max <= 1, "growth.dat reaches %g", grow.max);
}
END_TEST

/* ------------------------------------------------------------------ */
/* One colour scale for every cross-runtime report                      */

/* The line of heatmap.gp starting with key. */
static char *gp_line(const char *rep, const char *key)
{
    char *s = slurp(rep, "plots/heatmap.gp");
    char *at = strstr(s, key);
    ck_assert_msg(at != NULL, "%s/plots/heatmap.gp lacks %s", rep, key);
    const size_t n = strcspn(at, "\n");
    char *line = malloc(n + 1);
    memcpy(line, at, n);
    line[n] = 0;
    free(s);
    return line;
}

START_TEST(units_one_scale)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    static const char *const keys[] = {"set cbrange", "set palette", "set cbtics"};
    for (int i = 0; i < 3; i++) {
        char *a = gp_line("rep-ok", keys[i]), *b = gp_line("rep-bug", keys[i]);
        ck_assert_str_eq(a, b);
        free(a);
        free(b);
    }
    /* 1 in the middle: log10 of 1e-3 .. 1e3, calm below and hot above */
    assert_has("rep-ok", "plots/heatmap.gp", "set cbrange [-3:3]");
    assert_has("rep-ok", "plots/heatmap.gp", "0 '#7f9cb8', 0 '#fdae61'");
}
END_TEST

/* ------------------------------------------------------------------ */
/* A bug run: the first divergence is the only hot spot up to it        */

typedef struct {
    int64_t pos;
    int layer;
    double at_step, before_max;
    int before;
} hot_spot;

static void track_hot(const double *v, int n, void *ctx)
{
    hot_spot *h = ctx;
    ck_assert_int_eq(n, 4);
    if ((int64_t)v[0] == h->pos && (int)v[1] == h->layer)
        h->at_step = v[3];
    else if ((int64_t)v[0] < h->pos && !isnan(v[3])) {
        h->before_max = fmax(h->before_max, v[3]);
        h->before++;
    }
}

START_TEST(units_bug_one_hot_spot)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    json_t *j = result("rep-bug");
    json_t *d = json_object_get(j, "first_divergence");
    ck_assert_int_eq(json_integer_value(json_object_get(d, "position")), 32);
    ck_assert_int_eq(json_integer_value(json_object_get(d, "layer")), 0);
    ck_assert_str_eq(json_string_value(json_object_get(d, "stage")), "attn_out");
    json_decref(j);
    assert_has("rep-bug", "plots/heatmap.dat", "stage attn_out in units of the cross-runtime");
    hot_spot h = {.pos = 32, .layer = 0, .at_step = NAN};
    each_row("rep-bug", "plots/heatmap.dat", track_hot, &h);
    ck_assert_int_eq(h.before, 6 * 32);
    ck_assert_msg(h.before_max <= 1, "a row before the step reaches %g", h.before_max);
    ck_assert_msg(h.at_step > 1, "the step's row is at %g of its threshold", h.at_step);
}
END_TEST

/* From a saved result alone (no dumps at hand): the growth plot from the
 * result's figures, in the same units, the threshold drawn. */
START_TEST(units_json_alone)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    json_t *j = result("rep-bug");
    json_object_del(j, "inputs");
    char path[256], args[1024];
    snprintf(path, sizeof path, "%s/alone.json", dir);
    ck_assert_int_eq(json_dump_file(j, path, 0), 0);
    json_decref(j);
    snprintf(args, sizeof args, "report %s -o %s/rep-alone", path, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    assert_has("rep-alone", "plots/growth.dat", "error over the drift threshold");
    assert_has("rep-alone", "plots/growth.gp", "set arrow from graph 0, first 1 to graph 1, first 1");
    ratio_max drift = {.first_col = 1};
    ck_assert_int_eq(each_row("rep-alone", "plots/growth.dat", track_max, &drift), 6);
    ck_assert_msg(drift.max > 0 && drift.max <= 1, "x_out's drift rows reach %g", drift.max);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Exact compares keep their scale                                      */

START_TEST(units_exact_keeps_scale)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    assert_has("rep-exact", "plots/heatmap.dat", "max |test - ref| over each row");
    assert_has("rep-exact", "plots/heatmap.gp", "set palette rgbformulae 22,13,-31");
    assert_lacks("rep-exact", "plots/heatmap.gp", "drift threshold");
    assert_lacks("rep-exact", "plots/positions.gp", "drift threshold");
}
END_TEST

/* ------------------------------------------------------------------ */
/* The steps stop where the inputs part                                 */

typedef struct {
    int64_t cut;                 /* first position whose input differs */
    int rows, past;
} steps_seen;

static void track_steps(const double *v, int n, void *ctx)
{
    steps_seen *s = ctx;
    ck_assert_int_eq(n, 7);
    s->past += (int64_t)v[1] >= s->cut;
}

static void assert_steps_stop(const char *rep)
{
    json_t *j = result(rep);
    json_t *t = json_object_get(j, "tokens");
    ck_assert_str_eq(json_string_value(json_object_get(t, "verdict")), "differ");
    steps_seen s = {.cut = json_integer_value(json_object_get(t, "position"))};
    json_decref(j);
    ck_assert_int_gt(s.cut, 0);
    s.rows = each_row(rep, "plots/steps.dat", track_steps, &s);
    ck_assert_int_gt(s.rows, 0);
    ck_assert_msg(s.past == 0, "%s: %d steps at or past position %lld, whose inputs differ", rep,
                  s.past, (long long)s.cut);
    assert_has(rep, "plots/steps.gp", "not compared");
}

START_TEST(units_steps_stop_at_inputs)
{
    ck_assert_msg(ready, "setup failed:\n%.3000s", out);
    assert_steps_stop("rep-bug");
    assert_steps_stop("rep-exact");
}
END_TEST

Suite *report_units_suite(void)
{
    Suite *s = suite_create("report_units");
    TCase *tc = tcase_create("units");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, units_correct_run_is_calm);
    tcase_add_test(tc, units_correct_growth_is_calm);
    tcase_add_test(tc, units_one_scale);
    tcase_add_test(tc, units_bug_one_hot_spot);
    tcase_add_test(tc, units_json_alone);
    tcase_add_test(tc, units_exact_keeps_scale);
    tcase_add_test(tc, units_steps_stop_at_inputs);
    suite_add_tcase(s, tc);
    return s;
}
