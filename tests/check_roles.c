/* check_roles.c — recordings given the wrong way round are said to be,
 * before anything else: in compare's text, its -q verdict line, its JSON,
 * and the report's pages (also when drawn from a saved result). Roles come
 * from what the recordings say of themselves (compare/roles.c): kvdiff's
 * reference engine, an outside runtime against kvdiff's own, a planted
 * bug. A pair in the right order says nothing of roles. */
#include <check.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "h5edit.h"
#include "testutil.h"

static char dir[64];
static char out[1 << 16];

/* dir/NAME.h5: tiny-gemma3 on one 40-token prompt; extra: run options. */
static void record(const char *name, const char *extra)
{
    char args[512];
    snprintf(args, sizeof args,
             "run --model tiny-gemma3 --prompt-random 40 --seed 1 --max-new 4 %s --dump %s/%s.h5",
             extra, dir, name);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s\n%s", args, out);
}

static void setup(void)
{
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record("ref", "");
    record("chunked", "--engine chunked --chunk 5");
    record("bug", "--engine chunked --chunk 5 --inject window=4");
    /* the reference's rows as another runtime's recording */
    char src[128], dst[128];
    snprintf(src, sizeof src, "%s/ref.h5", dir);
    snprintf(dst, sizeof dst, "%s/outside.h5", dir);
    ck_assert_int_eq(test_copy_file(src, dst), 0);
    hid_t f = H5Fopen(dst, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    test_set_str_attr(f, "engine", "pytorch");
    test_set_str_attr(f, "engine_settings", "{\"compute_dtype\":\"f32\",\"cache_type\":\"f32\","
                                            "\"chunk\":40,\"cache\":\"dense\"}");
    H5Fclose(f);
}

static void teardown(void)
{
    test_rmtree(dir);
}

/* kvdiff compare FLAGS dir/A.h5 dir/B.h5, its output in out. */
static int compare(const char *flags, const char *a, const char *b)
{
    char args[512];
    snprintf(args, sizeof args, "compare %s %s/%s.h5 %s/%s.h5", flags, dir, a, dir, b);
    return test_run_cli(args, out, sizeof out);
}

static const struct {
    const char *first, *second;
    const char *why;     /* NULL: the order is right */
} pairs[] = {
    {"chunked", "ref", "the first recording is kvdiff's chunked engine and the second its "
                       "reference"},
    {"bug", "ref", "the first recording is kvdiff's chunked engine and the second its "
                   "reference"},
    {"bug", "chunked", "the first recording carries a planted bug (window=4) and the second "
                       "none"},
    {"outside", "ref", "the first recording is pytorch's and the second kvdiff's reference"},
    {"ref", "chunked", NULL},
    {"ref", "bug", NULL},
    {"chunked", "bug", NULL},
    {"ref", "outside", NULL},
};

START_TEST(test_text_says_so_first)
{
    const char *first = pairs[_i].first, *second = pairs[_i].second, *why = pairs[_i].why;
    compare("", first, second);
    if (!why) {
        ck_assert_msg(!strstr(out, "SWAPPED") && !strstr(out, "swap"), "%s", out);
        return;
    }
    ck_assert_msg(!strncmp(out, "SWAPPED?   the arguments look the wrong way round: ", 51),
                  "not the first line:\n%s", out);
    ck_assert_msg(strstr(out, why) && strstr(out, "swap the two files"), "%s", out);
}
END_TEST

START_TEST(test_verdict_line_says_so)
{
    const char *first = pairs[_i].first, *second = pairs[_i].second, *why = pairs[_i].why;
    compare("-q", first, second);
    if (!why) {
        ck_assert_msg(!strstr(out, "swapped"), "%s", out);
        return;
    }
    char want[512];
    snprintf(want, sizeof want, "arguments look swapped (%s; the reference goes first): ", why);
    ck_assert_msg(!strncmp(out, want, strlen(want)), "%s", out);
    /* then the verdict itself, said once */
    const char *verdict = out + strlen(want);
    ck_assert_msg(!strncmp(verdict, "diverged: first divergence at position 4", 40) ||
                  !strncmp(verdict, "identical", 9) || !strncmp(verdict, "no bug", 6),
                  "%s", out);
    ck_assert_msg(!strstr(out, "SWAPPED?"), "%s", out);
    ck_assert_msg(!strchr(out, '\n') || !strchr(out, '\n')[1], "one line: %s", out);
}
END_TEST

START_TEST(test_json_and_report)
{
    char args[512], path[256];
    /* JSON */
    compare("--json", "chunked", "ref");
    ck_assert_msg(strstr(out, "\"swapped\": \"the first recording is kvdiff's chunked engine"),
                  "%s", out);
    compare("--json", "ref", "chunked");
    ck_assert_msg(strstr(out, "\"swapped\": null"), "%s", out);
    /* the report's pages, from the dumps and from a saved result */
    snprintf(args, sizeof args, "report %s/bug.h5 %s/ref.h5 -o %s/rep", dir, dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    snprintf(args, sizeof args, "compare --json %s/bug.h5 %s/ref.h5 > %s/saved.json", dir, dir,
             dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    snprintf(args, sizeof args, "report %s/saved.json -o %s/rep-saved", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    static const char *const pages[] = {"rep/summary.md", "rep/index.html",
                                        "rep-saved/summary.md", "rep-saved/index.html"};
    for (size_t i = 0; i < sizeof pages / sizeof pages[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, pages[i]);
        FILE *f = fopen(path, "r");
        ck_assert_msg(f != NULL, "%s missing", path);
        size_t n = fread(out, 1, sizeof out - 1, f);
        out[n] = 0;
        fclose(f);
        ck_assert_msg(strstr(out, "arguments look swapped (the first recording is kvdiff"),
                      "%s lacks it", pages[i]);
    }
}
END_TEST

Suite *roles_suite(void)
{
    Suite *s = suite_create("roles");
    TCase *tc = tcase_create("roles");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_add_loop_test(tc, test_text_says_so_first, 0, (int)(sizeof pairs / sizeof pairs[0]));
    tcase_add_loop_test(tc, test_verdict_line_says_so, 0, (int)(sizeof pairs / sizeof pairs[0]));
    tcase_add_test(tc, test_json_and_report);
    tcase_set_timeout(tc, 120);
    suite_add_tcase(s, tc);
    return s;
}
