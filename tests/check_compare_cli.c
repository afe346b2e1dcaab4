/* check_compare_cli.c — `kvdiff compare` on dumps as a user runs it:
 * identical strategies say so (exit 0), an injected bug is located and
 * diagnosed (exit 1), bad input is refused (exit 2). */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "testutil.h"

static char out[1 << 16];

static void record(const char *dir, const char *name, const char *engine_args)
{
    char args[512];
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 4 "
             "--max-new 16 --ignore-eos %s --dump %s/%s", engine_args, dir, name);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

START_TEST(test_compare_verdicts)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    record(dir, "ok.h5", "--engine chunked --chunk 5 --cache ring");
    record(dir, "bad.h5", "--engine chunked --chunk 5 --cache ring --inject window=4");
    record(dir, "casc.h5", "--engine chunked --chunk 5 --attn cascade");
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/ok.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "identical: 6 layers"));
    ck_assert_ptr_nonnull(strstr(out, "tokens byte-identical"));
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/bad.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 4, layer 0 (sliding, window 12), "
                              "stage attn_lse"), "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "keys attended 5 vs 4"));
    ck_assert_ptr_nonnull(strstr(out, "window in test appears to be 4, config says 12"));
    snprintf(args, sizeof args, "compare --json %s/ref.h5 %s/bad.h5 2>/dev/null", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    json_error_t jerr;
    json_t *j = json_loads(out, 0, &jerr);
    ck_assert_msg(j != NULL, "not JSON: %s", jerr.text);
    json_decref(j);
    /* Cascade is drift, not a bug; within a tolerance it is the same. */
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/casc.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "numeric drift"), "%s", out);
    snprintf(args, sizeof args, "compare --rtol 1e-5 %s/ref.h5 %s/casc.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_compare_refusals)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record(dir, "ref.h5", "");
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --seed 9 "
             "--max-new 4 --dump %s/other.h5", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/other.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "prompt"), "%s", out);
    snprintf(path, sizeof path, "%s/junk.h5", dir);
    FILE *f = fopen(path, "w");
    fputs("junk", f);
    fclose(f);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s", dir, path);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "junk.h5"));
    ck_assert_int_eq(test_run_cli("compare only-one.h5", out, sizeof out), 2);
    test_rmtree(dir);
}
END_TEST

Suite *compare_cli_suite(void)
{
    Suite *s = suite_create("compare_cli");
    TCase *tc = tcase_create("binary");
    tcase_add_test(tc, test_compare_verdicts);
    tcase_add_test(tc, test_compare_refusals);
    suite_add_tcase(s, tc);
    return s;
}
