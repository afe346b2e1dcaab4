/* check_cli.c — the kvdiff binary as a user runs it: help on every verb,
 * exit codes, and one-line errors naming the file and the problem. */
#include <check.h>
#include <stdbool.h>
#include <sys/wait.h>
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
    /* a rival ruled out by its key count says so, not "(error inf)" */
    ck_assert_msg(strstr(out, "\n             - one key left out (key 0, from position 4) fails "
                              "at position 4 of layer 5 (it reads 4 keys there, the test 5)\n") &&
                  !strstr(out, "error inf"), "%s", out);
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
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 --weights-seed 7 -o %s/g3", dir);
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


/* stdout alone (stderr dropped) of kvdiff ARGS into buf; the exit code. */
static int run_stdout(const char *args, char *buf, size_t n)
{
    const char *bin = getenv("KVDIFF_BIN");
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s 2>/dev/null", bin ? bin : "./kvdiff", args);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t len = fread(buf, 1, n - 1, p);
    buf[len] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static bool file_has(const char *path, const char *needle)
{
    static char buf[1 << 20];
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return strstr(buf, needle) != NULL;
}

static const char *const all_verbs[] = {"gen", "run", "compare", "bisect", "report",
                                        "inspect", "validate", "suite"};

/* Every verb's help has examples, and `kvdiff help VERB` is that help. */
START_TEST(test_help_examples_and_help_verb)
{
    static char a[1 << 16];
    char args[64];
    for (size_t i = 0; i < sizeof all_verbs / sizeof *all_verbs; i++) {
        snprintf(args, sizeof args, "%s --help", all_verbs[i]);
        ck_assert_int_eq(test_run_cli(args, a, sizeof a), 0);
        ck_assert_msg(strstr(a, "\nExamples:\n  kvdiff "), "%s: no examples:\n%s", args, a);
        snprintf(args, sizeof args, "help %s", all_verbs[i]);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
        ck_assert_str_eq(a, out);
    }
    ck_assert_int_eq(test_run_cli("-V", out, sizeof out), 0);
    ck_assert_str_eq(out, "kvdiff 0.1.0\n");
    expect_error("help nope", "kvdiff help: unknown verb 'nope'; see kvdiff --help");
    expect_error("nope", "kvdiff: unknown verb 'nope'; see kvdiff --help");
}
END_TEST

/* A bad option is one line under the verb's name, never the whole usage
 * nor getopt's own line under another name. */
START_TEST(test_usage_errors_one_line)
{
    char args[64], want[160];
    for (size_t i = 0; i < sizeof all_verbs / sizeof *all_verbs; i++) {
        snprintf(args, sizeof args, "%s --bogus x", all_verbs[i]);
        snprintf(want, sizeof want, "kvdiff %s: unknown option '--bogus'; see kvdiff %s --help",
                 all_verbs[i], all_verbs[i]);
        expect_error(args, want);
    }
    expect_error("run --dump", "kvdiff run: option '--dump' needs a value; see kvdiff run --help");
    expect_error("inspect", "kvdiff inspect: give one dump");
    expect_error("suite --shard 1/0 x.suite", "--shard 1/0: the shard count 0 must be");
    expect_error("suite --shard 3/2 x.suite", "--shard 3/2: shards are numbered 1..2, not 3");
}
END_TEST

/* gen takes --weights-seed as run does; --seed still works, with a note;
 * bf16 weights say so in config.json; no "//" in what it prints. */
START_TEST(test_gen_weights_seed_and_dtype)
{
    char dir[64], args[512], a[4096], p1[128], p2[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-llama --weights-seed 7 -o %s/a/", dir);
    ck_assert_int_eq(test_run_cli(args, a, sizeof a), 0);
    ck_assert_msg(!strstr(a, "//"), "%s", a);
    snprintf(p1, sizeof p1, "%s/a/config.json", dir);
    ck_assert_msg(strstr(a, p1), "%s", a);
    snprintf(args, sizeof args, "gen --preset tiny-llama --seed 7 -o %s/b", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "note: --seed is the old name of --weights-seed"), "%s", out);
    snprintf(args, sizeof args, "cmp -s %s/a/model.safetensors %s/b/model.safetensors", dir, dir);
    ck_assert_int_eq(system(args), 0);
    ck_assert(file_has(p1, "\"torch_dtype\": \"float32\""));
    snprintf(args, sizeof args, "gen --preset tiny-llama --dtype bf16 -o %s/c", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(p2, sizeof p2, "%s/c/config.json", dir);
    ck_assert_msg(file_has(p2, "\"torch_dtype\": \"bfloat16\""), "%s", p2);
    test_rmtree(dir);
}
END_TEST

/* --weights-seed draws a preset's weights: with a folder it is refused
 * (run, bisect, a suite's weights_seed), not silently ignored. */
START_TEST(test_weights_seed_refused_for_folder)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-llama -o %s/m", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "run --model %s/m --weights-seed 3 --max-new 1", dir);
    expect_error(args, "--weights-seed: --model");
    snprintf(args, sizeof args, "bisect --model %s/m --weights-seed 3 --max-new 1", dir);
    expect_error(args, "--weights-seed: --model");
    snprintf(args, sizeof args, "run --model %s/m/ --max-new 1 --prompt-tokens 1,2", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(path, sizeof path, "%s/s.suite", dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fprintf(f, "[one]\nmodel = %s/m\nweights_seed = 3\na = --engine reference\n"
               "b = --engine chunked --chunk 4\nexpect = identical\n", dir);
    fclose(f);
    snprintf(args, sizeof args, "suite %s", path);
    expect_error(args, "weights_seed is the seed of a preset's weights");
    /* without the seed the folder case runs */
    f = fopen(path, "w");
    fprintf(f, "[one]\nmodel = %s/m\nmax_new = 2\na = --engine reference\n"
               "b = --engine chunked --chunk 4\nexpect = identical\n", dir);
    fclose(f);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    test_rmtree(dir);
}
END_TEST

/* A chunk longer than the run prefills the prompt in one chunk, with the
 * reference's tokens. */
START_TEST(test_chunk_longer_than_context)
{
    char a[4096];
    ck_assert_int_eq(test_run_cli("run --prompt-random 40 --max-new 4 --ignore-eos", a,
                                  sizeof a), 0);
    ck_assert_int_eq(test_run_cli("run --prompt-random 40 --max-new 4 --ignore-eos --engine "
                                  "chunked --chunk 64", out, sizeof out), 0);
    ck_assert_str_eq(a, out);
}
END_TEST

/* A selection the model cannot hold is the option's fault, not the file's,
 * and no file is left. */
START_TEST(test_dump_selection_blames_option)
{
    char dir[64], args[256], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/x.h5", dir);
    snprintf(args, sizeof args, "run --max-new 2 --dump %s --dump-layers 10:23", path);
    expect_error(args, "kvdiff run: --dump-layers: layers from 10 selected, but the model has 6");
    ck_assert_msg(!strstr(out, "x.h5"), "%s", out);
    ck_assert_int_ne(access(path, F_OK), 0);
    test_rmtree(dir);
}
END_TEST

/* compare: -q prints the verdict line alone; --json carries its schema,
 * nulls where an index does not apply, and errors as JSON on stdout;
 * two different models are named by their files. */
START_TEST(test_compare_quiet_json_and_models)
{
    char dir[64], args[512], a[1 << 14];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    const char *run = "run --prompt-random 40 --seed 1 --max-new 4 --ignore-eos";
    snprintf(args, sizeof args, "%s --dump %s/r.h5", run, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "%s --engine chunked --chunk 5 --inject window=4 --dump %s/w.h5",
             run, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(args, sizeof args, "run --model tiny-llama --max-new 2 --dump %s/l.h5", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);

    snprintf(args, sizeof args, "compare -q %s/r.h5 %s/w.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(line_count(out) == 1 && !strncmp(out, "diverged: first divergence at "
                  "position 4, layer 0, stage attn_lse", 60), "%s", out);

    snprintf(args, sizeof args, "compare --json %s/r.h5 %s/w.h5 > %s/c.json", dir, dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    snprintf(args, sizeof args, "%s/c.json", dir);
    ck_assert(file_has(args, "\"schema\": \"kvdiff-compare/1\""));
    ck_assert(file_has(args, "\"dim\": null"));
    ck_assert(!file_has(args, ": -1,"));
    snprintf(args, sizeof args, "report %s/c.json -o %s/rep", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);

    snprintf(args, sizeof args, "compare --json %s/r.h5 %s/nope.h5", dir, dir);
    ck_assert_int_eq(run_stdout(args, a, sizeof a), 2);
    ck_assert_msg(strstr(a, "\"error\": ") && strstr(a, "nope.h5") &&
                  strstr(a, "\"exit_code\": 2"), "%s", a);
    snprintf(args, sizeof args, "compare --json --bogus %s/r.h5 %s/w.h5", dir, dir);
    ck_assert_int_eq(run_stdout(args, a, sizeof a), 2);
    ck_assert_msg(strstr(a, "unknown option '--bogus'"), "%s", a);

    snprintf(args, sizeof args, "compare %s/r.h5 %s/l.h5", dir, dir);
    expect_error(args, "are not the same model");
    ck_assert_msg(!strstr(out, "(model)") && strstr(out, "r.h5 and ") && strstr(out, "l.h5"),
                  "%s", out);
    test_rmtree(dir);
}
END_TEST

/* report: -o, --out and --output; the plots are in the page itself; a
 * folder given as "dir/" prints no "//". */
START_TEST(test_report_out_and_embedded_plots)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --max-new 2 --dump %s/r.h5", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    static const char *const spell[] = {"-o", "--out", "--output"};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "report %s/r.h5 %s/r.h5 %s %s/o%d/", dir, dir, spell[i],
                 dir, i);
        ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
        snprintf(path, sizeof path, "report: %s/o%d/index.html\n", dir, i);
        ck_assert_msg(strstr(out, path) && !strstr(out, "//"), "%s", out);
    }
    snprintf(path, sizeof path, "%s/o0/plots/growth.png", dir);
    if (access(path, R_OK) == 0) {   /* gnuplot drew it */
        snprintf(path, sizeof path, "%s/o0/index.html", dir);
        ck_assert(file_has(path, "<img src=\"data:image/png;base64,iVBORw0KGgo"));
        ck_assert(!file_has(path, "<img src=\"plots/"));
    }
    test_rmtree(dir);
}
END_TEST

/* suite -q: no table, the summary line. */
START_TEST(test_suite_quiet)
{
    ck_assert_int_eq(test_run_cli("suite suites/release.suite --filter '^llama-dense-c5$' -q",
                                  out, sizeof out), 0);
    ck_assert_msg(!strstr(out, "expectation") && strstr(out, "1 case: 1 passed"), "%s", out);
}
END_TEST

/* A run with a planted bug says so before its tokens; a clean chunked
 * run says nothing of injections. */
START_TEST(test_run_says_injection)
{
    ck_assert_int_eq(test_run_cli("run --model tiny-gemma3 --engine chunked --chunk 5 "
                                  "--prompt-random 20 --max-new 3 --inject window=4", out,
                                  sizeof out), 0);
    ck_assert_msg(!strncmp(out, "inject    window=4: a cache bug planted on purpose; these "
                                "tokens are not the model's\nprompt ", 88), "%s", out);
    ck_assert_int_eq(test_run_cli("run --model tiny-gemma3 --engine chunked --chunk 5 "
                                  "--prompt-random 20 --max-new 3", out, sizeof out), 0);
    ck_assert_msg(!strstr(out, "inject"), "%s", out);
}
END_TEST

/* run --compare -q prints the verdict line compare -q prints, and only
 * it; -q is --compare's, and not with --json. */
START_TEST(test_run_compare_quiet)
{
    int rc = test_run_cli("run --compare --model tiny-gemma3 --prompt-random 20 --engine chunked "
                          "--chunk 5 --inject window=4 -q", out, sizeof out);
    ck_assert_msg(rc == 1 && line_count(out) == 1 &&
                  !strcmp(out, "diverged: first divergence at position 4, layer 0, stage "
                               "attn_lse (attention read a different key set at the "
                               "sliding-window boundary)\n"), "exit %d: %s", rc, out);
    expect_error("run --model tiny-gemma3 -q", "-q/--quiet is --compare's");
    rc = test_run_cli("run --compare --model tiny-gemma3 --engine chunked -q --json", out,
                      sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, "-q/--quiet and --json: choose one"), "%s", out);
}
END_TEST

/* Standard output on a full disk: every verb's printout is lost, so the
 * exit code says so (2) with one line on stderr, never 0 or 1 as if the
 * verdict or JSON had reached its reader. */
START_TEST(test_stdout_write_error)
{
    ck_assert_msg(access("/dev/full", W_OK) == 0, "this test needs /dev/full");
    const char *bin = getenv("KVDIFF_BIN");
    char dir[64], cmd[1024], err[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(err, sizeof err, "%s/err", dir);
    static const char *const verbs[] = {
        "run --model tiny-llama --prompt-random 4 --max-new 2",
        "suite suites/release.suite --list",
        "--version",
        "run --list-injections",
    };
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
        snprintf(cmd, sizeof cmd, "%s %s > /dev/full 2> %s", bin ? bin : "./kvdiff", verbs[i],
                 err);
        const int st = system(cmd);
        ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "kvdiff %s > /dev/full: status %d",
                      verbs[i], st);
        FILE *f = fopen(err, "r");
        ck_assert_ptr_nonnull(f);
        size_t n = fread(out, 1, sizeof out - 1, f);
        out[n] = 0;
        fclose(f);
        ck_assert_msg(strstr(out, "cannot write to standard output: No space left on device") &&
                          line_count(out) == 1, "kvdiff %s: %s", verbs[i], out);
    }
    test_rmtree(dir);
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
    tcase_add_test(tc, test_help_examples_and_help_verb);
    tcase_add_test(tc, test_usage_errors_one_line);
    tcase_add_test(tc, test_gen_weights_seed_and_dtype);
    tcase_add_test(tc, test_weights_seed_refused_for_folder);
    tcase_add_test(tc, test_chunk_longer_than_context);
    tcase_add_test(tc, test_dump_selection_blames_option);
    tcase_add_test(tc, test_compare_quiet_json_and_models);
    tcase_add_test(tc, test_report_out_and_embedded_plots);
    tcase_add_test(tc, test_suite_quiet);
    tcase_add_test(tc, test_stdout_write_error);
    tcase_add_test(tc, test_run_says_injection);
    tcase_add_test(tc, test_run_compare_quiet);
    suite_add_tcase(s, tc);
    return s;
}
