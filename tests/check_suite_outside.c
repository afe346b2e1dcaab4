/* check_suite_outside.c — suites that gate an engine outside kvdiff.
 *
 * The parser's side kinds (llama.cpp:, exec:, dump:), the exec: command's
 * quoting and placeholders, the gguf key and their errors with FILE:LINE.
 * Then through the binary: llama.cpp and the Python recorder's torch model
 * judged no-bug against the reference, a dump: recording, the placeholders
 * filled in, and exec: commands that fail, hang, write nothing or write
 * junk, each an ERROR with its reason while a good case in the same run
 * still passes. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "suites/suite.h"
#include "testutil.h"

static char out[1 << 16];

static int parse(const char *text, suite *s, kv_err *e)
{
    return suite_parse(text, strlen(text), "dir/t.suite", s, e);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

/* ------------------------------------------------------------------ */
/* Parser                                                               */

START_TEST(test_parse_sides)
{
    const char *text =
        "[defaults]\n"
        "model = tiny-llama\n"
        "a = --engine reference\n"
        "expect = no-bug\n"
        "[ll]\n"
        "gguf = m.gguf\n"
        "b = llama.cpp: --cache-type f16 --threads 2\n"
        "[ex]\n"
        "b = exec: sh -c 'cat {tokens} > {dump}' x{max_new}y \"a b\" --m={model}\n"
        "[du]\n"
        "a = dump: rec/theirs.h5\n"
        "b = dump: /abs/ours.h5\n"
        "expect = within rtol=1e-3\n";
    suite s;
    kv_err e = {{0}};
    ck_assert_msg(parse(text, &s, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(s.n_cases, 3);
    const suite_case *c = &s.cases[0];
    ck_assert_int_eq(c->ka, SUITE_SIDE_KVDIFF);
    ck_assert_int_eq(c->kb, SUITE_SIDE_LLAMA);
    ck_assert_int_eq(c->nb, 4);
    ck_assert_str_eq(c->b[0], "--cache-type");
    ck_assert_str_eq(c->b[3], "2");
    ck_assert_str_eq(c->gguf, "dir/m.gguf");   /* relative to the suite file */
    ck_assert_int_eq(c->expect.kind, SUITE_EXPECT_NO_BUG);
    c = &s.cases[1];
    ck_assert_int_eq(c->kb, SUITE_SIDE_EXEC);
    ck_assert_int_eq(c->nb, 6);
    ck_assert_str_eq(c->b[0], "sh");
    ck_assert_str_eq(c->b[1], "-c");
    ck_assert_str_eq(c->b[2], "cat {tokens} > {dump}");
    ck_assert_str_eq(c->b[3], "x{max_new}y");
    ck_assert_str_eq(c->b[4], "a b");
    ck_assert_str_eq(c->b[5], "--m={model}");
    ck_assert_ptr_null(c->gguf);
    c = &s.cases[2];
    ck_assert_int_eq(c->ka, SUITE_SIDE_DUMP);
    ck_assert_int_eq(c->kb, SUITE_SIDE_DUMP);
    ck_assert_str_eq(c->a[0], "dir/rec/theirs.h5");
    ck_assert_str_eq(c->b[0], "/abs/ours.h5");
    char d[64];
    suite_expect_describe(&s.cases[0].expect, d, sizeof d);
    ck_assert_str_eq(d, "no-bug");
    suite_free(&s);
}
END_TEST

static const struct {
    const char *b;
    const char *msg;   /* the whole message: "FILE:LINE: problem" */
} bad_sides[] = {
    {"b = onnx: model.onnx", "dir/t.suite:4: b: 'onnx:' is not a kind of side (llama.cpp:, "
                             "exec:, dump:, or kvdiff run options)"},
    {"b = exec: run {prompt}", "dir/t.suite:4: b: unknown placeholder '{prompt}' "
                               "(placeholders: {model}, {tokens}, {max_new}, {dump})"},
    {"b = exec: run {dump", "dir/t.suite:4: b: '{dump': '{' without '}' (placeholders: "
                            "{model}, {tokens}, {max_new}, {dump})"},
    {"b = exec: sh -c 'echo", "dir/t.suite:4: b: unterminated single quote"},
    {"b = exec:", "dir/t.suite:4: b: 'exec:' needs a command"},
    {"b = dump:", "dir/t.suite:4: b: 'dump:' needs a path"},
    {"b = llama.cpp: --dump x.h5", "dir/t.suite:4: b: --dump is set by the suite runner (the "
                                   "case's prompt, max_new and dump)"},
    {"b = llama.cpp: --prompt-tokens 1,2", "dir/t.suite:4: b: --prompt-tokens is set by the "
                                           "suite runner (the case's prompt, max_new and dump)"},
    {"b = --engine chunked\ngguf = m.gguf", "dir/t.suite:5: case 'c': 'gguf' is read by a "
                                            "llama.cpp: side only, and neither a nor b is one"},
    {"b = --engine chunked\nexpect = no-bug x", "dir/t.suite:5: expect: 'no-bug' takes nothing "
                                                "after it"},
};

START_TEST(test_parse_side_errors)
{
    char text[512];
    snprintf(text, sizeof text, "[c]\nmodel = tiny-llama\n%s\n%s\n", "a =", bad_sides[_i].b);
    if (!strstr(bad_sides[_i].b, "expect"))
        strcat(text, "expect = no-bug\n");
    suite s;
    kv_err e = {{0}};
    ck_assert_msg(parse(text, &s, &e) < 0, "accepted: %s", bad_sides[_i].b);
    ck_assert_str_eq(e.msg, bad_sides[_i].msg);
    ck_assert_int_eq(s.n_cases, 0);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Through the binary                                                   */

/* llama.cpp on the preset exported to GGUF, f32 and f16 caches: drift
 * only. The recorder comes from KVDIFF_LLAMA_BIN (make test sets it). */
START_TEST(test_llama_no_bug)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/ll.suite", dir);
    write_file(path, "[defaults]\nmodel = tiny-llama\nprompt = random:20:2\nmax_new = 3\n"
                     "a = --engine reference\nexpect = no-bug\n"
                     "[llama-f32]\nb = llama.cpp: --cache-type f32\n"
                     "[llama-f16]\nb = llama.cpp: --cache-type f16\n");
    snprintf(args, sizeof args, "suite %s --jobs 2 --keep %s/work --junit %s/j.xml", path, dir,
             dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "2 cases: 2 passed"), "%s", out);
    /* the same pair, expected bit-identical, is not: the verdict is real */
    write_file(path, "[llama-exact]\nmodel = tiny-llama\nprompt = random:20:2\nmax_new = 3\n"
                     "a = --engine reference\nb = llama.cpp: --cache-type f32\n"
                     "expect = identical\n");
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "FAIL llama-exact: expected identical; got within tolerance"),
                  "%s", out);
    test_rmtree(dir);
}
END_TEST

/* The Python recorder's torch model through exec:, the model folder
 * exported from the preset for {model}. */
START_TEST(test_exec_torch_no_bug)
{
    char dir[64], path[128], args[512], cwd[512];
    ck_assert_ptr_nonnull(getcwd(cwd, sizeof cwd));
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/py.suite", dir);
    char text[1024];
    snprintf(text, sizeof text,
             "[torch]\nmodel = tiny-llama\nprompt = 5,17,42,7,99,3,8,1\nmax_new = 3\n"
             "a = --engine reference\n"
             "b = exec: /usr/bin/python3 %s/python/examples/tiny_torch.py --model {model} "
             "--tokens {tokens} --max-new {max_new} --dump {dump}\n"
             "expect = no-bug\n", cwd);
    write_file(path, text);
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "1 case: 1 passed") || strstr(out, "1 cases: 1 passed"), "%s",
                  out);
    test_rmtree(dir);
}
END_TEST

/* A recording made elsewhere (dump:, relative to the suite file) against
 * a kvdiff engine; and every placeholder filled in for an exec: side. */
START_TEST(test_dump_side_and_placeholders)
{
    char dir[64], path[128], args[512], text[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-tokens 5,17,42 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(path, sizeof path, "%s/d.suite", dir);
    snprintf(text, sizeof text,
             "[defaults]\nmodel = tiny-llama\nprompt = 5,17,42\nmax_new = 2\n"
             "[recorded]\na = dump: ref.h5\nb = --engine chunked --chunk 2\nexpect = identical\n"
             "[placeholders]\na = --engine reference\n"
             "b = exec: sh -c 'test \"$(cat {tokens})\" = \"5 17 42\" && test {max_new} = 2 && "
             "test -f {model}/config.json && cp %s/ref.h5 {dump}'\n"
             "expect = identical\n", dir);
    write_file(path, text);
    snprintf(args, sizeof args, "suite %s --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "2 cases: 2 passed"), "%s", out);
    /* a dump: that is not there is an ERROR naming it */
    write_file(path, "[gone]\nmodel = tiny-llama\na = dump: nowhere.h5\nb =\nexpect = identical\n");
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "ERROR gone: engine A (dump): cannot read ") &&
                  strstr(out, "/nowhere.h5: No such file or directory"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A case folder whose name a shell would act on (`;`, `$(...)`, a quote,
 * blanks): placeholders in `sh -c` code are quoted where they stand (bare,
 * inside "...", inside $(...)), so the command sees the path and runs
 * nothing else. */
START_TEST(test_exec_placeholders_quoted)
{
    char dir[64], path[256], args[1024], text[2048], keep[256], marker[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-tokens 5,17,42 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(marker, sizeof marker, "%s/INJECTED", dir);
    snprintf(keep, sizeof keep, "%s/w ;touch INJECTED; $(touch INJECTED) it's", dir);
    snprintf(path, sizeof path, "%s/q.suite", dir);
    snprintf(text, sizeof text,
             "[defaults]\nmodel = tiny-llama\nprompt = 5,17,42\nmax_new = 2\n"
             "a = --engine reference\nexpect = identical\n"
             "[bare]\nb = exec: sh -c 'test -f {tokens} && cp %s/ref.h5 {dump}'\n"
             "[double]\nb = exec: sh -c 'test -f \"{tokens}\" && cp %s/ref.h5 \"{dump}\"'\n"
             "[subst]\nb = exec: bash -ec 'test \"$(cat {tokens})\" = \"5 17 42\" && "
             "cp %s/ref.h5 {dump}'\n", dir, dir, dir);
    write_file(path, text);
    /* the folder goes to kvdiff's argv as one word; test_run_cli runs it
     * through a shell, so escape it for that one inside "..." */
    char quoted[512], *q = quoted;
    for (const char *s = keep; *s && q < quoted + sizeof quoted - 3; s++) {
        if (strchr("\\\"$`", *s))
            *q++ = '\\';
        *q++ = *s;
    }
    *q = 0;
    snprintf(args, sizeof args, "suite %s --keep \"%s\"", path, quoted);
    unlink("INJECTED");
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "3 cases: 3 passed"), "%s", out);
    ck_assert_msg(access(marker, F_OK) != 0 && access("INJECTED", F_OK) != 0,
                  "a command in the folder's name ran");
    test_rmtree(dir);
}
END_TEST

/* A step past --timeout is killed with what it started: a command that
 * leaves children behind (a shell's background jobs) leaves none running,
 * and the run does not wait for them. */
START_TEST(test_timeout_kills_step_group)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/t.suite", dir);
    write_file(path, "[orphans]\nmodel = tiny-llama\nprompt = 5,17,42\nmax_new = 2\n"
                     "a = --engine reference\n"
                     "b = exec: sh -c 'sleep 61.25 & sleep 61.25 & wait'\nexpect = no-bug\n");
    snprintf(args, sizeof args, "suite %s --timeout 2 --keep %s/work", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "ERROR orphans: engine B (exec) ran past the step time limit (2 s) "
                              "and was killed"), "%s", out);
    ck_assert_msg(system("pgrep -f 'sleep 61[.]25' > /dev/null") != 0,
                  "the step's children outlived its timeout");
    test_rmtree(dir);
}
END_TEST

/* exec: commands that go wrong: each its case's ERROR with the reason,
 * and the good case of the same run passes. */
START_TEST(test_exec_bad_commands)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/bad.suite", dir);
    write_file(path,
               "[defaults]\nmodel = tiny-llama\nprompt = 5,17,42\nmax_new = 2\n"
               "a = --engine reference\nexpect = no-bug\n"
               "[fails]\nb = exec: sh -c 'echo the model exploded >&2 && exit 3'\n"
               "[hangs]\nb = exec: sleep 60\n"
               "[writes-nothing]\nb = exec: true {dump}\n"
               "[writes-junk]\nb = exec: sh -c 'echo junk > {dump}'\n"
               "[no-such-program]\nb = exec: ./no-such-recorder {dump}\n"
               "[good]\nb = --engine chunked --chunk 2\nexpect = identical\n");
    snprintf(args, sizeof args, "suite %s --jobs 2 --timeout 2 --keep %s/work --junit %s/j.xml",
             path, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "ERROR fails: engine B (exec) exited with 3"), "%s", out);
    ck_assert_msg(strstr(out, "last line: the model exploded"), "%s", out);
    ck_assert_msg(strstr(out, "ERROR hangs: engine B (exec) ran past the step time limit (2 s) "
                              "and was killed"), "%s", out);
    ck_assert_msg(strstr(out, "ERROR writes-nothing: engine B (exec) wrote no dump at "), "%s",
                  out);
    ck_assert_msg(strstr(out, "ERROR writes-junk: engine B (exec): ") &&
                  strstr(out, "/writes-junk/b.h5 is not a valid kvdiff dump"), "%s", out);
    ck_assert_msg(strstr(out, "ERROR no-such-program: engine B (exec) exited with 127 (cannot "
                              "execute ./no-such-recorder"), "%s", out);
    ck_assert_msg(strstr(out, "6 cases: 1 passed, 0 failed, 5 errors"), "%s", out);
    /* the failing command's stderr is in its case's log */
    snprintf(path, sizeof path, "%s/work/fails/log.txt", dir);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    fclose(f);
    ck_assert_msg(strstr(out, "$ sh -c echo the model exploded") &&
                  strstr(out, "the model exploded\n"), "%s", out);
    test_rmtree(dir);
}
END_TEST

Suite *suite_outside_suite(void)
{
    Suite *s = suite_create("suite_outside");
    TCase *tc = tcase_create("parser");
    tcase_add_test(tc, test_parse_sides);
    tcase_add_loop_test(tc, test_parse_side_errors, 0,
                        (int)(sizeof bad_sides / sizeof *bad_sides));
    suite_add_tcase(s, tc);
    tc = tcase_create("binary");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_llama_no_bug);
    tcase_add_test(tc, test_exec_torch_no_bug);
    tcase_add_test(tc, test_exec_placeholders_quoted);
    tcase_add_test(tc, test_timeout_kills_step_group);
    tcase_add_test(tc, test_dump_side_and_placeholders);
    tcase_add_test(tc, test_exec_bad_commands);
    suite_add_tcase(s, tc);
    return s;
}
