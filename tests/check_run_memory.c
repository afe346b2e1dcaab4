/* check_run_memory.c — `run --compare` keeps both runs in memory: it
 * estimates how much before running, warns above half its bound and
 * refuses above the bound (half the machine's memory, or
 * --compare-memory) unless --force, saying how to hold less. */
#include <check.h>
#include <stdio.h>
#include <string.h>

#include "testutil.h"

static char out[1 << 16];

/* tiny-gemma3, 200 + 10 positions, every default stage: 40.3 KiB a
 * position for both runs, 8.3 MiB in all. */
#define RUN "run --model tiny-gemma3 --prompt-random 200 --max-new 10 --compare"

START_TEST(test_over_the_bound_is_refused)
{
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory 4M", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "kvdiff run: --compare would hold about 8.3 MiB in memory "
                              "(40.3 KiB per position x 210 positions, both runs), more than "
                              "the bound set by --compare-memory (4.0 MiB)"), "%s", out);
    ck_assert_msg(strstr(out, "--dump-stages") && strstr(out, "two dumps") &&
                      strstr(out, "--force"), "%s", out);
    ck_assert_msg(strchr(out, '\n')[1] == 0, "not one line: %s", out);
    ck_assert_ptr_null(strstr(out, "identical"));   /* nothing ran */
}
END_TEST

START_TEST(test_force_runs_with_a_warning)
{
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory 4M --force", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "kvdiff run: warning: --compare will hold about 8.3 MiB in "
                              "memory"), "%s", out);
    ck_assert_msg(strstr(out, "identical: 6 layers x 209 positions"), "%s", out);
}
END_TEST

START_TEST(test_over_half_the_bound_warns)
{
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory 12M", out, sizeof out), 0);
    ck_assert_msg(strstr(out, "warning: --compare will hold about 8.3 MiB") &&
                      strstr(out, "the bound set by --compare-memory is 12.0 MiB"), "%s", out);
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory 20M", out, sizeof out), 0);
    ck_assert_msg(!strstr(out, "warning"), "%s", out);
}
END_TEST

/* The selection is what is held: k and v alone fit where everything
 * does not. */
START_TEST(test_selection_shrinks_the_estimate)
{
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory 4M --dump-stages k,v", out, sizeof out), 0);
    ck_assert_msg(!strstr(out, "warning") && strstr(out, "identical"), "%s", out);
}
END_TEST

START_TEST(test_options_need_compare)
{
    ck_assert_int_eq(test_run_cli("run --compare-memory 4M", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "need --compare"), "%s", out);
    ck_assert_int_eq(test_run_cli("run --force", out, sizeof out), 2);
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory 4Q", out, sizeof out), 2);
    ck_assert_msg(strstr(out, "--compare-memory: '4Q' is not a size"), "%s", out);
    ck_assert_int_eq(test_run_cli(RUN " --compare-memory -1", out, sizeof out), 2);
}
END_TEST

Suite *run_memory_suite(void)
{
    Suite *s = suite_create("run_memory");
    TCase *tc = tcase_create("estimate");
    tcase_add_test(tc, test_over_the_bound_is_refused);
    tcase_add_test(tc, test_force_runs_with_a_warning);
    tcase_add_test(tc, test_over_half_the_bound_warns);
    tcase_add_test(tc, test_selection_shrinks_the_estimate);
    tcase_add_test(tc, test_options_need_compare);
    suite_add_tcase(s, tc);
    return s;
}
