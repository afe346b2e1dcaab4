/* check_lockstep.c — `kvdiff run --compare` (both engines in memory, the
 * test stopped after its first differing forward step) and `kvdiff bisect`
 * (fingerprints, then full dumps of the neighbourhood) must give the verdict
 * two full dumps give: same first divergence, same diagnosis. */
#include <check.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "testutil.h"

static char out[1 << 16];
static char dumps[1 << 16];

#define PROMPT "--model tiny-gemma3 --prompt-random 40 --seed 4 --max-new 16 --ignore-eos"
#define PROMPT_KVS "--model tiny-gemma3-kvshared --prompt-random 40 --seed 4 --max-new 16 --ignore-eos"

/* The line of text starting with key, copied into buf ("" when absent). */
static const char *line_of(const char *text, const char *key, char *buf, size_t n)
{
    const char *p = strstr(text, key);
    buf[0] = 0;
    if (!p)
        return buf;
    size_t len = strcspn(p, "\n");
    if (len >= n)
        len = n - 1;
    memcpy(buf, p, len);
    buf[len] = 0;
    return buf;
}

/* What two full dumps of the same runs say (the verdict to match). */
static int compare_by_dumps_of(const char *dir, const char *prompt, const char *engine_args)
{
    char args[768];
    snprintf(args, sizeof args, "run %s --dump %s/ref.h5", prompt, dir);
    ck_assert_msg(test_run_cli(args, dumps, sizeof dumps) == 0, "%s", dumps);
    snprintf(args, sizeof args, "run %s %s --dump %s/test.h5", prompt, engine_args, dir);
    ck_assert_msg(test_run_cli(args, dumps, sizeof dumps) == 0, "%s", dumps);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/test.h5", dir, dir);
    return test_run_cli(args, dumps, sizeof dumps);
}

static int compare_by_dumps(const char *dir, const char *engine_args)
{
    return compare_by_dumps_of(dir, PROMPT, engine_args);
}

static void same_verdict(const char *a, const char *b)
{
    static const char *const keys[] = {"FIRST DIVERGENCE", "DIAGNOSIS", "           ("};
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        char la[512], lb[512];
        line_of(a, keys[i], la, sizeof la);
        line_of(b, keys[i], lb, sizeof lb);
        ck_assert_msg(!strcmp(la, lb), "'%s' vs '%s'\n--- one:\n%s\n--- other:\n%s", la, lb, a, b);
    }
}

START_TEST(test_compare_identical)
{
    ck_assert_msg(test_run_cli("run --compare " PROMPT " --engine chunked --chunk 5 --cache ring",
                               out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "identical: 6 layers x 55 positions"), "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "tokens byte-identical"));
    ck_assert_ptr_null(strstr(out, "stopped"));
}
END_TEST

/* Prefill and decode bugs: the lockstep verdict is the two-dump verdict. */
static const char *const bugs[] = {
    "--inject window=4",
    "--inject isolated-chunks",
    "--cache split --inject split-mask-off-by-one",
    "--inject decode-index-stuck",
    "--cache ring --inject ring-no-wrap",
    "--cache split --inject split-decode-blind",
};

START_TEST(test_compare_matches_dumps)
{
    char dir[64], args[768];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    char engine[256];
    snprintf(engine, sizeof engine, "--engine chunked --chunk 5 %s", bugs[_i]);
    ck_assert_int_eq(compare_by_dumps(dir, engine), 1);
    snprintf(args, sizeof args, "run --compare " PROMPT " %s", engine);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    same_verdict(out, dumps);
    test_rmtree(dir);
}
END_TEST

/* Past the divergent step the test runs the positions the diagnosis
 * reads (cmp_diag_span: 32 on tiny-gemma3), then stops. */
START_TEST(test_compare_stops_past_span)
{
    ck_assert_msg(test_run_cli("run --compare --model tiny-gemma3 --prompt-random 40 --seed 4 "
                               "--max-new 60 --ignore-eos --engine chunked --chunk 5 "
                               "--inject window=4", out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "test run  stopped after the forward step of positions 0..4"),
                  "%s", out);
    ck_assert_msg(strstr(out, "window in test appears to be 4, config says 12"), "%s", out);
    /* the stop is said once, as the run's own doing, never as findings */
    ck_assert_msg(!strstr(out, "is partial") && !strstr(out, "overlap only") &&
                  !strstr(out, "token counts differ"), "%s", out);
    /* a divergence deep in a long prompt: the test stops before generating */
    ck_assert_msg(test_run_cli("run --compare --model tiny-gemma3 --prompt-random 100 --seed 4 "
                               "--max-new 8 --ignore-eos --engine chunked --chunk 5 "
                               "--inject window=4", out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "TOKENS     tokens identical over the 100 positions the test ran "
                              "(it was stopped past its first divergence)") &&
                  !strstr(out, "is partial") && !strstr(out, "overlap only") &&
                  !strstr(out, "token counts differ"), "%s", out);
}
END_TEST

START_TEST(test_compare_tolerance_and_files)
{
    char dir[64], args[768];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    /* Cascade: drift in exact mode, the same within a tolerance (the test
     * run then goes to the end). */
    ck_assert_msg(test_run_cli("run --compare " PROMPT " --engine chunked --chunk 5 --attn cascade",
                               out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "numeric drift"), "%s", out);
    ck_assert_msg(test_run_cli("run --compare " PROMPT " --engine chunked --chunk 5 --attn cascade "
                               "--rtol 1e-5", out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_null(strstr(out, "stopped"));
    /* Asked-for dumps: the reference whole, the test partial. */
    snprintf(args, sizeof args, "run --compare " PROMPT " --engine chunked --chunk 5 "
             "--inject window=4 --dump %s/t.h5 --dump-ref %s/r.h5 --json", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    snprintf(args, sizeof args, "inspect %s/r.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "complete"), "%s", out);
    snprintf(args, sizeof args, "inspect %s/t.h5", dir);
    test_run_cli(args, out, sizeof out);
    ck_assert_msg(strstr(out, "partial: stopped after the first divergence"), "%s", out);
    snprintf(args, sizeof args, "compare %s/r.h5 %s/t.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 4, layer 0"), "%s", out);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_compare_json)
{
    ck_assert_int_eq(test_run_cli("run --compare " PROMPT " --engine chunked --chunk 5 "
                                  "--inject window=4 --json 2>/dev/null", out, sizeof out), 1);
    json_error_t jerr;
    json_t *j = json_loads(out, 0, &jerr);
    ck_assert_msg(j != NULL, "not JSON (%s): %s", jerr.text, out);
    ck_assert_str_eq(json_string_value(json_object_get(j, "verdict")), "diverged");
    json_decref(j);
}
END_TEST

START_TEST(test_compare_usage)
{
    static const char *const bad[] = {
        "run --dump-ref x.h5",                     /* needs --compare */
        "run --atol 1e-3",
        "run --json",
        "run --compare --engine chunked --fingerprint",
        "run --compare --atol nope",
        "run -o somewhere",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ck_assert_msg(test_run_cli(bad[i], out, sizeof out) == 2, "%s: %s", bad[i], out);
        /* One line, naming the verb. */
        ck_assert_msg(!strncmp(out, "kvdiff run: ", 12) && strchr(out, '\n') &&
                          strchr(out, '\n')[1] == 0,
                      "%s: %s", bad[i], out);
    }
}
END_TEST

/* bisect: fingerprints find the row, the neighbourhood's full dumps give
 * the verdict two full dumps give. */
static const struct {
    const char *prompt, *engine;
} bisect_cases[] = {
    {PROMPT, "--engine chunked --chunk 5 --inject window=4"},
    {PROMPT, "--engine chunked --chunk 5 --inject decode-index-stuck"},
    {PROMPT, "--engine chunked --chunk 7 --cache ring --inject stale-local"},
    {PROMPT_KVS, "--engine chunked --chunk 5 --inject zero-shared-kv"},
    {PROMPT_KVS, "--engine chunked --chunk 5 --inject rope-offset=3"},
};

START_TEST(test_bisect_matches_dumps)
{
    char dir[64], args[900];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    ck_assert_int_eq(compare_by_dumps_of(dir, bisect_cases[_i].prompt, bisect_cases[_i].engine), 1);
    snprintf(args, sizeof args, "bisect %s %s -o %s/b", bisect_cases[_i].prompt,
             bisect_cases[_i].engine, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    same_verdict(out, dumps);
    ck_assert_msg(strstr(out, "the first divergent row is at position"), "%s", out);
    ck_assert_msg(!strstr(out, "warning"), "%s", out);
    /* The neighbourhood dumps hold fewer layers than the model; the runs
     * stop once past its last position (whole when it reaches the end). */
    snprintf(args, sizeof args, "inspect %s/b/test.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "status    complete") ||
                  strstr(out, "(the bisect neighbourhood)"), "%s", out);
    ck_assert_msg(!strstr(out, "layer 5 "), "%s", out);
    snprintf(args, sizeof args, "inspect %s/b/test.fp.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "fingerprint"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* The second pass stops both engines past the neighbourhood (position 12
 * of 56 here) instead of running them to the end, and the token verdict
 * still covers the whole runs (from the fingerprint pass): the first
 * generated token differs. */
START_TEST(test_bisect_stops_past_neighbourhood)
{
    char dir[64], args[900];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "bisect " PROMPT " --engine chunked --chunk 5 --inject window=4 "
             "-o %s/b", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "positions 0..12"), "%s", out);
    ck_assert_msg(strstr(out, "TOKENS     first differing generated token at step 0 "
                              "(position 40)"), "%s", out);
    static const char *const sides[] = {"ref", "test"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "inspect %s/b/%s.h5", dir, sides[i]);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        ck_assert_msg(strstr(out, "status    partial: stopped after position 12 (the bisect "
                                  "neighbourhood)"), "%s", out);
        ck_assert_msg(strstr(out, "tokens    40 (prompt 40)"), "%s", out);  /* none generated */
    }
    test_rmtree(dir);
}
END_TEST

START_TEST(test_bisect_identical_and_usage)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "bisect " PROMPT " --engine chunked --chunk 3 --cache split -o %s/b",
             dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "none differs"), "%s", out);
    ck_assert_msg(strstr(out, "identical: 6 layers"), "%s", out);
    /* A file where the folder should be. */
    snprintf(args, sizeof args, "bisect " PROMPT " -o %s/b/ref.fp.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "kvdiff bisect: ") && strstr(out, "not a folder"), "%s", out);
    static const char *const bad[] = {"bisect --dump x.h5", "bisect --fingerprint",
                                      "bisect --compare", "bisect --atol 1", "bisect --chunk 0"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        ck_assert_msg(test_run_cli(bad[i], out, sizeof out) == 2, "%s: %s", bad[i], out);
    test_rmtree(dir);
}
END_TEST

Suite *lockstep_suite(void)
{
    Suite *s = suite_create("lockstep");
    TCase *tc = tcase_create("run --compare");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_compare_identical);
    tcase_add_test(tc, test_compare_stops_past_span);
    tcase_add_loop_test(tc, test_compare_matches_dumps, 0, (int)(sizeof bugs / sizeof *bugs));
    tcase_add_test(tc, test_compare_tolerance_and_files);
    tcase_add_test(tc, test_compare_json);
    tcase_add_test(tc, test_compare_usage);
    suite_add_tcase(s, tc);
    tc = tcase_create("bisect");
    tcase_set_timeout(tc, 120);
    tcase_add_loop_test(tc, test_bisect_matches_dumps, 0,
                        (int)(sizeof bisect_cases / sizeof *bisect_cases));
    tcase_add_test(tc, test_bisect_identical_and_usage);
    tcase_add_test(tc, test_bisect_stops_past_neighbourhood);
    suite_add_tcase(s, tc);
    return s;
}
