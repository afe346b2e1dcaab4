/* check_cli.c — the kvdiff binary as a user runs it: help on every verb,
 * exit codes, and one-line errors naming the file and the problem. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

#include "testutil.h"

static char out[1 << 16];

/* The output has exactly one line when it is an error. */
static int line_count(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

static void expect_error(const char *args, const char *needle)
{
    int rc = test_run_cli(args, out, sizeof out);
    ck_assert_msg(rc == 2, "kvdiff %s: exit %d, output: %s", args, rc, out);
    ck_assert_msg(strstr(out, needle) != NULL, "kvdiff %s: expected '%s' in: %s", args,
                  needle, out);
    ck_assert_msg(line_count(out) == 1, "kvdiff %s: not one line: %s", args, out);
}

START_TEST(test_help_everywhere)
{
    ck_assert_int_eq(test_run_cli("--help", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "run"));
    ck_assert_int_eq(test_run_cli("run --help", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "--prompt-tokens"));
    ck_assert_int_eq(test_run_cli("gen --help", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "tiny-gemma3-kvshared"));
    ck_assert_int_eq(test_run_cli("frobnicate", out, sizeof out), 2);
}
END_TEST

/* No arguments: the demo finds the planted window bug where it was
 * planted and leaves a report in ./kvdiff-demo. */
START_TEST(test_default_job)
{
    char dir[64], cmd[512], path[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    const char *bin = getenv("KVDIFF_BIN");
    snprintf(cmd, sizeof cmd, "cd %s && %s 2>&1", dir, bin ? bin : "kvdiff");
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t len = fread(out, 1, sizeof out - 1, p);
    out[len] = 0;
    ck_assert_int_eq(pclose(p), 0);
    ck_assert_msg(strstr(out, "FIRST DIVERGENCE  position 4, layer 0 (sliding, window 12)"), "%s",
                  out);
    ck_assert_msg(strstr(out, "window in test appears to be 4, config says 12"), "%s", out);
    ck_assert_msg(strstr(out, "report: kvdiff-demo/report/index.html"), "%s", out);
    static const char *const files[] = {"ref.h5", "chunked.h5", "report/index.html",
                                        "report/summary.md", "report/result.json"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(path, sizeof path, "%s/kvdiff-demo/%s", dir, files[i]);
        ck_assert_msg(access(path, R_OK) == 0, "%s missing", path);
    }
    test_rmtree(dir);
}
END_TEST

START_TEST(test_run_prints_tokens)
{
    ck_assert_int_eq(test_run_cli("run --model tiny-llama --prompt-tokens 5,17,42 --max-new 4 "
                                  "--ignore-eos", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "prompt    3 tokens: 5 17 42\n"));
    ck_assert_ptr_nonnull(strstr(out, "generated 4 tokens: "));
}
END_TEST

START_TEST(test_gen_then_run_folder_matches_preset)
{
    char dir[64], args[256], a[4096];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 --seed 7 -o %s/g3", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "run --model %s/g3 --prompt-random 30 --seed 3 --max-new 8 "
             "--ignore-eos", dir);
    ck_assert_int_eq(test_run_cli(args, a, sizeof a), 0);
    ck_assert_int_eq(test_run_cli("run --model tiny-gemma3 --weights-seed 7 --prompt-random 30 "
                                  "--seed 3 --max-new 8 --ignore-eos", out, sizeof out), 0);
    ck_assert_str_eq(a, out);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_sampling_is_seeded)
{
    char a[4096];
    const char *args = "run --model tiny-qwen2 --prompt-random 12 --seed 5 --max-new 12 "
                       "--temperature 1.5 --top-k 50 --top-p 0.95 --ignore-eos";
    ck_assert_int_eq(test_run_cli(args, a, sizeof a), 0);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    ck_assert_str_eq(a, out);
}
END_TEST

START_TEST(test_bad_arguments)
{
    expect_error("run --max-new -3", "--max-new: -3 is outside");
    expect_error("run --max-new abc", "--max-new: 'abc' is not an integer");
    expect_error("run --threads 0", "--threads");
    expect_error("run --model no-such-preset", "no-such-preset");
    expect_error("run --model /nonexistent/folder", "/nonexistent/folder");
    expect_error("run --prompt-tokens 1,2,999999", "outside the vocabulary");
    expect_error("run --prompt-tokens 1,x", "--prompt-tokens: item 2 'x' is not a token id");
    expect_error("run --prompt-ids-file /nonexistent.txt", "/nonexistent.txt: cannot open");
    expect_error("run --engine warp", "--engine: 'warp'");
    expect_error("run --prompt-random 5000 --max-new 0", "positions");
    expect_error("run --dtype f8", "--dtype");
    expect_error("gen --preset tiny-llama", "-o are required");
    expect_error("gen --preset nope -o /tmp/kvdiff-test-never", "nope");
    expect_error("run --model tiny-llama extra", "unexpected argument 'extra'");
}
END_TEST

/* A folder whose files lie: the loader names the file and the problem. */
START_TEST(test_bad_model_folders)
{
    char dir[64], path[128], args[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-llama -o %s/m", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    /* Truncate the weights. */
    snprintf(path, sizeof path, "%s/m/model.safetensors", dir);
    FILE *f = fopen(path, "r+");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(ftruncate(fileno(f), 5000), 0);
    fclose(f);
    snprintf(args, sizeof args, "run --model %s/m", dir);
    expect_error(args, "model.safetensors");
    /* A config with an unknown model type. */
    snprintf(path, sizeof path, "%s/m/config.json", dir);
    f = fopen(path, "w");
    fputs("{\"model_type\": \"mistral\", \"hidden_size\": 64}", f);
    fclose(f);
    expect_error(args, "mistral");
    test_rmtree(dir);
}
END_TEST

START_TEST(test_chunked_engine_cli)
{
    char a[1 << 14];
    const char *base = "run --model tiny-gemma3 --prompt-random 200 --seed 3 --max-new 32";
    char args[512];
    snprintf(args, sizeof args, "%s --engine reference", base);
    ck_assert_int_eq(test_run_cli(args, a, sizeof a), 0);
    snprintf(args, sizeof args, "%s --engine chunked --chunk 5 --cache ring", base);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    ck_assert_str_eq(a, out);
    snprintf(args, sizeof args, "%s --engine chunked --chunk 5 --cache ring --inject isolated-chunks",
             base);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    ck_assert_str_ne(a, out);
    ck_assert_int_eq(test_run_cli("run --list-injections", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "ring-no-wrap"));
    ck_assert_ptr_nonnull(strstr(out, "decode-index-stuck"));
    ck_assert_int_eq(test_run_cli("run --engine chunked --cache ring --chunk 4 --verbose "
                                  "--prompt-random 20 --max-new 2", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "sliding layers 40.0 KiB"));
}
END_TEST

START_TEST(test_chunked_bad_arguments)
{
    expect_error("run --engine chunked --chunk 0", "--chunk: 0 must be at least 1");
    expect_error("run --engine chunked --chunk 100 --prompt-random 10 --max-new 2",
                 "--chunk 100 must be between 1 and the context (12)");
    expect_error("run --engine chunked --cache tree", "--cache: 'tree'");
    expect_error("run --engine chunked --inject warp-drive", "unknown injection 'warp-drive'");
    expect_error("run --engine chunked --inject window", "needs a value");
    expect_error("run --engine chunked --inject window=x", "not an integer");
    expect_error("run --engine chunked --inject zero-shared-kv", "no KV-shared layer");
    expect_error("run --engine chunked --inject ring-no-wrap", "needs --cache ring");
    expect_error("run --chunk 4", "need --engine chunked");
    expect_error("run --engine chunked --kv-share mirrored", "--kv-share: 'mirrored'");
}
END_TEST

Suite *cli_suite(void)
{
    Suite *s = suite_create("cli");
    TCase *tc = tcase_create("binary");
    tcase_add_test(tc, test_help_everywhere);
    tcase_add_test(tc, test_default_job);
    tcase_add_test(tc, test_run_prints_tokens);
    tcase_add_test(tc, test_gen_then_run_folder_matches_preset);
    tcase_add_test(tc, test_sampling_is_seeded);
    tcase_add_test(tc, test_bad_arguments);
    tcase_add_test(tc, test_bad_model_folders);
    tcase_add_test(tc, test_chunked_engine_cli);
    tcase_add_test(tc, test_chunked_bad_arguments);
    suite_add_tcase(s, tc);
    return s;
}
