/* check_words.c — what people read says things in words: no internal ids
 * (`window`, `unclassified`) in the text, the one-line verdict or the
 * report, where JSON keeps them; no ulp count where it means nothing
 * (values far apart: "2.69e+05 ulp", a max_ulp column of 2e9); the
 * evidence one clause a line, not one sentence of 600 characters. */
#include <check.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "compare/compare.h"
#include "testutil.h"

static char out[1 << 18];

/* ------------------------------------------------------------------ */
/* The shared helpers                                                   */

START_TEST(test_ulp_text)
{
    char buf[24];
    ck_assert_str_eq(cmp_ulp_text(0, buf, sizeof buf), "0");
    ck_assert_str_eq(cmp_ulp_text(2, buf, sizeof buf), "2");
    ck_assert_str_eq(cmp_ulp_text(CMP_ULP_SHOWN, buf, sizeof buf), "1024");
    ck_assert_str_eq(cmp_ulp_text(CMP_ULP_SHOWN + 1, buf, sizeof buf), ">1024");
    /* 1 and -1: every float between them */
    ck_assert_str_eq(cmp_ulp_text(cmp_ulp_distance(1.0f, -1.0f), buf, sizeof buf), ">1024");
    ck_assert_str_eq(cmp_ulp_text(UINT64_MAX, buf, sizeof buf), ">1024");
}
END_TEST

/* The clauses of s, each followed by '|'. */
static void clauses(const char *s, char *buf, size_t n)
{
    buf[0] = 0;
    for (const char *next; s && *s; s = next) {
        size_t len;
        next = cmp_evidence_clause(s, &len);
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, "%.*s|", (int)len, s);
    }
}

START_TEST(test_evidence_clauses)
{
    char buf[512];
    clauses("recomputing attention reproduces it (error 7.5e-08); the config's keys do not "
            "(0.059; at 4); 2 other causes tried fail", buf, sizeof buf);
    ck_assert_str_eq(buf, "recomputing attention reproduces it (error 7.5e-08)|the config's "
                          "keys do not (0.059; at 4)|2 other causes tried fail|");
    clauses("one clause (with (nested; parts))", buf, sizeof buf);
    ck_assert_str_eq(buf, "one clause (with (nested; parts))|");
    clauses("a;b; c;  d; ", buf, sizeof buf);   /* "; " alone separates; no empty clause */
    ck_assert_str_eq(buf, "a;b|c|d|");
    clauses("", buf, sizeof buf);
    ck_assert_str_eq(buf, "");
    cmp_diagnosis g;
    memset(&g, 0, sizeof g);
    g.basis = CMP_BASIS_RECOMPUTED;
    ck_assert_str_eq(cmp_evidence_label(&g), "verified");
    g.basis = CMP_BASIS_EXACT_CHECK;
    ck_assert_str_eq(cmp_evidence_label(&g), "exact check");
    g.basis = CMP_BASIS_HEURISTIC;
    ck_assert_str_eq(cmp_evidence_label(&g), "heuristic");
    g.undecided = true;
    ck_assert_str_eq(cmp_evidence_label(&g), "not decided");
}
END_TEST

/* ------------------------------------------------------------------ */
/* The binary                                                           */

/* Element (row, col) of /output/topk_values in path, one ulp up. */
static void nudge_topk(const char *path, hsize_t row, hsize_t col)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = f >= 0 ? H5Dopen2(f, "/output/topk_values", H5P_DEFAULT) : -1;
    ck_assert(f >= 0 && d >= 0);
    hid_t fs = H5Dget_space(d);
    hsize_t dims[2] = {0, 0};
    ck_assert(H5Sget_simple_extent_dims(fs, dims, NULL) == 2 && row < dims[0] && col < dims[1]);
    float *buf = malloc(dims[0] * dims[1] * sizeof *buf);
    ck_assert_ptr_nonnull(buf);
    ck_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    buf[row * dims[1] + col] = nextafterf(buf[row * dims[1] + col], INFINITY);
    ck_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    free(buf);
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
}

static char *slurp(const char *dir, const char *name)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s", path);
    char *s = calloc(1 << 20, 1);
    ck_assert_ptr_nonnull(s);
    size_t n = fread(s, 1, (1 << 20) - 1, f);
    s[n] = 0;
    fclose(f);
    return s;
}

/* A top-k value one ulp off, every stage identical: a cause no rule
 * names. The one-line verdict read "(unclassified: unclassified)"; the
 * text, the line and the report now say it in words, JSON by its id, and
 * a distance of 1 ulp is still said. */
START_TEST(test_unnamed_cause_in_words)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 30 --max-new 4 --dump "
             "%s/a.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --engine chunked --chunk 7 "
             "--prompt-random 30 --max-new 4 --dump %s/b.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "%s/b.h5", dir);
    nudge_topk(args, 2, 1);

    snprintf(args, sizeof args, "compare -q %s/a.h5 %s/b.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_str_eq(out, "diverged: first divergence at position 31, model level, stage logits "
                          "(cause not identified)\n");

    snprintf(args, sizeof args, "compare %s/a.h5 %s/b.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "\nDIAGNOSIS  cause not identified\n") &&
                  strstr(out, ", 1 ulp; row: ") && !strstr(out, "unclassified"), "%s", out);

    snprintf(args, sizeof args, "compare --json %s/a.h5 %s/b.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_ptr_nonnull(j);
    json_t *g = json_object_get(j, "diagnosis");
    ck_assert_str_eq(json_string_value(json_object_get(g, "kind")), "unclassified");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "first_divergence"),
                                                        "ulp")), 1);
    json_decref(j);

    snprintf(args, sizeof args, "report %s/a.h5 %s/b.h5 -o %s/rep", dir, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    snprintf(args, sizeof args, "%s/rep", dir);
    char *md = slurp(args, "summary.md"), *html = slurp(args, "index.html");
    ck_assert_msg(strstr(md, "- **Diagnosis:** cause not identified (") &&
                  !strstr(md, "unclassified"), "%s", md);
    ck_assert_msg(strstr(html, "<h2>Diagnosis</h2>\n<p><strong>cause not identified</strong>") &&
                  !strstr(html, "unclassified"), "%.4000s", html);
    free(md);
    free(html);
    test_rmtree(dir);
}
END_TEST

/* The max_ulp column of a window bug read 2173581352: past 1024 it says
 * ">1024"; no element line gives a count either ("2.69e+05 ulp"). */
START_TEST(test_far_apart_no_ulp_count)
{
    int rc = test_run_cli("run --compare --model tiny-gemma3 --prompt-random 20 --engine chunked "
                          "--chunk 5 --inject window=4 --stages", out, sizeof out);
    ck_assert_msg(rc == 1, "exit %d: %s", rc, out);
    ck_assert_msg(!strstr(out, " ulp") && strstr(out, " max_ulp "), "%s", out);
    int rows = 0, far = 0;
    for (char *save = NULL, *l = strtok_r(out, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        char stage[32], ulp[32];
        long long n, eq;
        int layer;
        double a, r;
        if (sscanf(l, "%d %31s %lld %lld %lf %lf %31s", &layer, stage, &n, &eq, &a, &r, ulp) != 7)
            continue;
        rows++;
        far += !strcmp(ulp, ">1024");
        ck_assert_msg(!strcmp(ulp, ">1024") || strtoull(ulp, NULL, 10) <= CMP_ULP_SHOWN, "%s", l);
    }
    ck_assert_msg(rows > 10 && far > 0, "%d rows, %d far apart", rows, far);
}
END_TEST

/* Cascade attention within --rtol: its largest ulp distance (an element
 * near zero) is past 1024, and the "same within tolerance" line leaves
 * the count out ("max 2097152 ulp" said nothing). */
START_TEST(test_tolerance_line_no_far_ulp)
{
    char dir[64], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 1 --dump "
             "%s/a.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 1 --engine "
             "chunked --chunk 8 --attn cascade --dump %s/b.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "compare --rtol 1e-3 --json --stages %s/a.h5 %s/b.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    json_t *j = json_loads(out, 0, NULL), *st;
    size_t i;
    ck_assert_ptr_nonnull(j);
    json_int_t most = 0;
    json_array_foreach(json_object_get(j, "stages"), i, st) {
        json_int_t u = json_integer_value(json_object_get(json_object_get(st, "all"), "max_ulp"));
        most = u > most ? u : most;
    }
    json_decref(j);
    ck_assert_msg(most > CMP_ULP_SHOWN, "max_ulp %lld", (long long)most);
    snprintf(args, sizeof args, "compare --rtol 1e-3 %s/a.h5 %s/b.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    ck_assert_msg(!strncmp(out, "same within tolerance (atol 0, rtol 0.001): ", 44) &&
                  strstr(out, "(max abs ") && !strstr(out, "ulp"), "%s", out);
    test_rmtree(dir);
}
END_TEST

Suite *words_suite(void)
{
    Suite *s = suite_create("words");
    TCase *tc = tcase_create("helpers");
    tcase_add_test(tc, test_ulp_text);
    tcase_add_test(tc, test_evidence_clauses);
    suite_add_tcase(s, tc);
    tc = tcase_create("binary");
    tcase_add_test(tc, test_unnamed_cause_in_words);
    tcase_add_test(tc, test_far_apart_no_ulp_count);
    tcase_add_test(tc, test_tolerance_line_no_far_ulp);
    suite_add_tcase(s, tc);
    return s;
}
