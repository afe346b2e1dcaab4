/* check_suite.c — suite files and `kvdiff suite`.
 *
 * The parser: a good file with [defaults], every kind of malformed file
 * refused with its exact "FILE:LINE:", the prompt and expectation forms.
 * Selection (filter, shards), JUnit escaping and the progress bar's line.
 * Then the runner through the binary: a small suite with one deliberately
 * wrong expectation (exit 1, its files kept, named in the table), the same
 * outcomes with --jobs 2, shards that partition, --filter, --list, JUnit
 * XML, and bad suite files or options refused with exit 2, nothing run. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "chunked/chunked.h"
#include "model/observer.h"
#include "harness/progress.h"
/* The CLI's objects are not in libkvdiff.a: the progress bar is compiled in. */
#include "harness/progress.c"
#include "suites/suite.h"
#include "testutil.h"

static char out[1 << 16];

static int parse(const char *text, suite *s, kv_err *e)
{
    return suite_parse(text, strlen(text), "t.suite", s, e);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* ------------------------------------------------------------------ */
/* Parser                                                               */

START_TEST(test_parse_defaults)
{
    const char *text =
        "; a comment\n"
        "[defaults]            ; inherited\n"
        "model = tiny-gemma3\n"
        "prompt = random:40:1\n"
        "max_new = 8\n"
        "a = --engine reference\n"
        "\n"
        "[window-bug-g3]\n"
        "b = --engine chunked --chunk=5 --inject window=4   ; B\n"
        "expect = detects window at layer 0 position 4 stage attn_lse\n"
        "[llama.split]\n"
        "model = tiny-llama\n"
        "weights_seed = 7\n"
        "max_new = 0\n"
        "prompt = 5,17,42\n"
        "a = --engine reference --prefill token\n"
        "b = --engine chunked --cache split --threads 2\n"
        "expect = within atol=1e-6 rtol=1e-4\n";
    suite s;
    kv_err e = {{0}};
    ck_assert_msg(parse(text, &s, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(s.n_cases, 2);
    ck_assert_str_eq(s.name, "t");
    const suite_case *c = &s.cases[0];
    ck_assert_str_eq(c->name, "window-bug-g3");
    ck_assert_int_eq(c->line, 8);
    ck_assert_str_eq(c->model, "tiny-gemma3");
    ck_assert_int_eq(c->prompt.kind, SUITE_PROMPT_RANDOM);
    ck_assert_int_eq(c->prompt.random_len, 40);
    ck_assert_int_eq(c->prompt.seed, 1);
    ck_assert_int_eq(c->max_new, 8);
    ck_assert_int_eq(c->na, 2);
    ck_assert_str_eq(c->a[0], "--engine");
    ck_assert_str_eq(c->a[1], "reference");
    ck_assert_ptr_null(c->a[2]);
    /* "--chunk=5" is split into two words; the inline comment is gone. */
    ck_assert_int_eq(c->nb, 6);
    ck_assert_str_eq(c->b[2], "--chunk");
    ck_assert_str_eq(c->b[3], "5");
    ck_assert_str_eq(c->b[5], "window=4");
    ck_assert_int_eq(c->expect.kind, SUITE_EXPECT_DETECTS);
    ck_assert_int_eq(c->expect.injection, INJ_WINDOW);
    ck_assert_int_eq(c->expect.layer, 0);
    ck_assert_int_eq(c->expect.pos, 4);
    ck_assert_int_eq(c->expect.stage, STAGE_ATTN_LSE);
    c = &s.cases[1];
    ck_assert_str_eq(c->name, "llama.split");
    ck_assert_str_eq(c->model, "tiny-llama");
    ck_assert_int_eq(c->weights_seed, 7);
    ck_assert_int_eq(c->max_new, 0);
    ck_assert_int_eq(c->prompt.kind, SUITE_PROMPT_TOKENS);
    ck_assert_str_eq(c->prompt.text, "5,17,42");
    ck_assert_int_eq(c->na, 4);
    ck_assert_str_eq(c->a[3], "token");
    ck_assert_int_eq(c->expect.kind, SUITE_EXPECT_WITHIN);
    ck_assert(c->expect.atol == 1e-6 && c->expect.rtol == 1e-4 && c->expect.ulp == 0);
    suite_free(&s);
    suite_free(&s);   /* a freed suite is empty: freeing again is harmless */
}
END_TEST

/* Each malformed file is refused with exactly this "t.suite:LINE: ..." start
 * and names the problem. */
static const struct {
    const char *text;
    const char *prefix;          /* "t.suite:LINE: " and the message start */
    const char *names;           /* a further part of the message */
} bad_files[] = {
    {"[c]\nmodle = tiny-llama\n", "t.suite:2: unknown key 'modle'", "expect"},
    {"[c]\na = --engine reference\nb = --engine reference\nexpect = identical\n",
     "t.suite:1: case 'c' has no 'model'", "defaults"},
    {"[defaults]\nmodel = tiny-llama\n\n[c]\nb = --engine reference\nexpect = identical\n",
     "t.suite:4: case 'c' has no 'a'", ""},
    {"[c]\nmodel = tiny-llama\na =\nb =\n", "t.suite:1: case 'c' has no 'expect'", ""},
    {"[c]\nmax_new = 8x\n", "t.suite:2: max_new: '8x' is not an integer", ""},
    {"[c]\nmax_new = -1\n", "t.suite:2: max_new: -1 is outside", ""},
    {"[c]\nweights_seed = -3\n", "t.suite:2: weights_seed: '-3'", "non-negative"},
    {"[c]\n\nprompt = random:0\n", "t.suite:3: prompt: random prompt length: 0", ""},
    {"[c]\nprompt = random:x:1\n", "t.suite:2: prompt: random prompt length: 'x'", ""},
    {"[c]\nprompt = random:4:y\n", "t.suite:2: prompt: random prompt seed: 'y'", ""},
    {"[c]\nprompt = 5,17,banana\n", "t.suite:2: prompt: not random:N[:SEED]", "banana"},
    {"[c]\nprompt = file:no-such-prompt.txt\n", "t.suite:2: prompt: prompt file",
     "no-such-prompt.txt"},
    {"[c]\nexpect = identicall\n", "t.suite:2: expect: 'identicall' is not an expectation", ""},
    {"[c]\nexpect = identical please\n", "t.suite:2: expect: 'identical' takes nothing", ""},
    {"[c]\nexpect = within\n", "t.suite:2: expect: 'within' needs a tolerance", ""},
    {"[c]\nexpect = within rtol=abc\n", "t.suite:2: expect: rtol: 'abc' is not a positive", ""},
    {"[c]\nexpect = within rtol=0\n", "t.suite:2: expect: rtol: '0' is not a positive", ""},
    {"[c]\nexpect = within rtol=1 rtol=2\n", "t.suite:2: expect: 'rtol' is given twice", ""},
    {"[c]\nexpect = within tol=1\n", "t.suite:2: expect: 'tol=1' is not atol=X", ""},
    {"[c]\nexpect = detects window at layer 0 position 5\n",
     "t.suite:2: expect: expected 'detects INJECTION at layer L position P stage S'", ""},
    {"[c]\nexpect = detects nosuch at layer 0 position 5 stage q\n",
     "t.suite:2: expect: 'nosuch' is not an injection", ""},
    {"[c]\nexpect = detects window at layer 0 position 5 stage q_out\n",
     "t.suite:2: expect: stage: 'q_out' is not a layer stage", ""},
    {"[c]\nexpect = detects window at layer x position 5 stage q\n",
     "t.suite:2: expect: layer: 'x' is not an integer", ""},
    {"[c]\nexpect = detects window at layer 0 layer 5 stage q\n",
     "t.suite:2: expect: 'layer' is given twice", ""},
    {"[c]\nexpect = detects window at floor 0 position 5 stage q\n",
     "t.suite:2: expect: 'floor' is not layer", ""},
    {"[c]\nmodel = m\n[d]\nmodel = m\n[c]\nmodel = m\n",
     "t.suite:5: duplicate case name 'c' (first on line 1)", ""},
    {"[c]\nmodel = m\nmodel = n\n", "t.suite:3: 'model' is given twice in [c]", "line 2"},
    {"[c]\nmodel = m\n  more\n", "t.suite:3: 'model' is given twice in [c]", "indented"},
    {"; only a comment\n[defaults]\nmodel = tiny-llama\n", "t.suite:1: no cases", ""},
    {"", "t.suite:1: no cases", ""},
    {"model = tiny-llama\n", "t.suite:1: 'model' is outside any [section]", ""},
    {"[c]\nmodel = m\njust some words\n", "t.suite:3: expected '[case-name]'", ""},
    {"[c]\nmodel = m\n[unclosed\n", "t.suite:3: expected '[case-name]'", ""},
    {"[c]\n[bad name]\n", "t.suite:2: '[bad name]': a case name is", ""},
    {"[../up]\n", "t.suite:1: '[../up]': a case name is", ""},
    {"[c]\na = --engine reference --dump x.h5\n", "t.suite:2: a: '--dump' is not allowed here",
     "kv-share"},
    {"[c]\nb = --temperature 1\n", "t.suite:2: b: '--temperature' is not allowed here", ""},
    {"[c]\nb = chunked\n", "t.suite:2: b: 'chunked' is not an option", ""},
    {"[c]\nb = --chunk 5\n", "t.suite:2: b: --chunk needs --engine chunked", ""},
    {"[c]\nb = --engine chunked --prefill token\n", "t.suite:2: b: --prefill is an option of "
     "--engine reference", ""},
    {"[c]\nb = --engine chunked --chunk 0\n", "t.suite:2: b: --chunk: 0 is outside", ""},
    {"[c]\nb = --engine chunked --chunk\n", "t.suite:2: b: --chunk needs a value", ""},
    {"[c]\nb = --engine chunked --cache tree\n", "t.suite:2: b: --cache: 'tree'", ""},
    {"[c]\nb = --engine chunked --inject bogus\n", "t.suite:2: b: --inject: unknown injection",
     "bogus"},
    {"[c]\nb = --engine chunked --inject window\n", "t.suite:2: b: --inject window needs a value",
     ""},
    {"[c]\nb = --engine turbo\n", "t.suite:2: b: --engine: 'turbo'", ""},
    {"[c]\nb = --engine chunked --engine chunked\n", "t.suite:2: b: --engine is given twice", ""},
    {"[c]\nmodel = tiny-llama\na = --engine reference\nb = --engine chunked\n"
     "expect = detects window at layer 0 position 4 stage attn_lse\n",
     "t.suite:5: case 'c' expects window to be detected but neither a nor b", ""},
    {"[empty]\n[c]\nmodel = m\n", "t.suite:1: case 'empty' has no 'model'", ""},
};

START_TEST(test_parse_errors)
{
    suite s;
    kv_err e = {{0}};
    const char *text = bad_files[_i].text;
    ck_assert_msg(parse(text, &s, &e) == -1, "accepted:\n%s", text);
    ck_assert_msg(!strncmp(e.msg, bad_files[_i].prefix, strlen(bad_files[_i].prefix)),
                  "file:\n%s\nmessage: %s\nwanted: %s", text, e.msg, bad_files[_i].prefix);
    ck_assert_msg(strstr(e.msg, bad_files[_i].names), "%s lacks '%s'", e.msg,
                  bad_files[_i].names);
    ck_assert_msg(!strchr(e.msg, '\n'), "not one line: %s", e.msg);
    ck_assert_int_eq(s.n_cases, 0);
    ck_assert_ptr_null(s.cases);
}
END_TEST

START_TEST(test_parse_odd_bytes)
{
    suite s;
    kv_err e = {{0}};
    const char text[] = "[c]\nmodel = m\0x\n";
    ck_assert_int_eq(suite_parse(text, sizeof text - 1, "t.suite", &s, &e), -1);
    ck_assert_msg(!strncmp(e.msg, "t.suite:2: a NUL byte", 21), "%s", e.msg);
    /* A line longer than inih's buffer would be cut in two: refused. */
    char longline[600];
    snprintf(longline, sizeof longline, "[c]\nmodel = %0450d\n", 7);
    ck_assert_int_eq(parse(longline, &s, &e), -1);
    ck_assert_msg(!strncmp(e.msg, "t.suite:2: line is longer than", 30), "%s", e.msg);
    /* 197 characters is the longest line, whatever the line end. */
    char edge[400];
    for (int crlf = 0; crlf < 2; crlf++) {
        for (int extra = 0; extra < 2; extra++) {
            int len = 197 + extra - 8;   /* "model = " is 8 */
            snprintf(edge, sizeof edge, "[c]%s\nmodel = %0*d%s\na =\nb =\nexpect = identical\n",
                     crlf ? "\r" : "", len, 1, crlf ? "\r" : "");
            int rc = parse(edge, &s, &e);
            ck_assert_msg(rc == (extra ? -1 : 0), "%d %d: %s", crlf, extra, e.msg);
            if (rc == 0)
                ck_assert_int_eq((int)strlen(s.cases[0].model), len);
            else
                ck_assert_msg(!strncmp(e.msg, "t.suite:2: line is longer than 197", 34), "%s",
                              e.msg);
            suite_free(&s);
        }
    }
    /* A byte-order mark and CRLF line ends are fine. */
    ck_assert_msg(parse("\xEF\xBB\xBF[c]\r\nmodel = tiny-llama\r\na =\r\nb =\r\n"
                        "expect = identical\r\n", &s, &e) == 0, "%s", e.msg);
    ck_assert_str_eq(s.cases[0].model, "tiny-llama");
    ck_assert_int_eq(s.cases[0].na, 0);
    suite_free(&s);
}
END_TEST

START_TEST(test_prompt_forms)
{
    suite_prompt p;
    kv_err e = {{0}};
    ck_assert_int_eq(suite_parse_prompt("random:7", NULL, &p, &e), 0);
    ck_assert(p.kind == SUITE_PROMPT_RANDOM && p.random_len == 7 && p.seed == 0);
    ck_assert_int_eq(suite_parse_prompt("random:40:123", NULL, &p, &e), 0);
    ck_assert(p.random_len == 40 && p.seed == 123);
    ck_assert_int_eq(suite_parse_prompt("5,17,42", NULL, &p, &e), 0);
    ck_assert(p.kind == SUITE_PROMPT_TOKENS && !strcmp(p.text, "5,17,42"));
    suite_prompt_free(&p);
    ck_assert_int_eq(suite_parse_prompt("random:", NULL, &p, &e), -1);
    ck_assert_int_eq(suite_parse_prompt("random:5:", NULL, &p, &e), -1);
    ck_assert_int_eq(suite_parse_prompt("file:", NULL, &p, &e), -1);
    ck_assert_int_eq(suite_parse_prompt("", NULL, &p, &e), -1);

    /* file: is relative to the suite file's folder, not the current one. */
    char dir[64], path[128], sub[96];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(sub, sizeof sub, "%s/prompts", dir);
    ck_assert_int_eq(mkdir(sub, 0755), 0);
    snprintf(path, sizeof path, "%s/p.txt", sub);
    write_file(path, "3 1 4 1 5\n");
    snprintf(path, sizeof path, "%s/t.suite", dir);
    write_file(path, "[c]\nmodel = tiny-llama\nprompt = file:prompts/p.txt\na =\nb =\n"
                     "expect = identical\n");
    suite s;
    ck_assert_msg(suite_load(path, &s, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(s.cases[0].prompt.kind, SUITE_PROMPT_FILE);
    snprintf(path, sizeof path, "%s/prompts/p.txt", dir);
    ck_assert_str_eq(s.cases[0].prompt.text, path);
    suite_free(&s);
    /* A prompt file that is no token list is a line-numbered error. */
    snprintf(path, sizeof path, "%s/prompts/p.txt", dir);
    write_file(path, "three one four\n");
    snprintf(path, sizeof path, "%s/t.suite", dir);
    ck_assert_int_eq(suite_load(path, &s, &e), -1);
    ck_assert_msg(strstr(e.msg, "t.suite:3: prompt: prompt file") && strstr(e.msg, "p.txt"),
                  "%s", e.msg);
    snprintf(path, sizeof path, "%s/missing.suite", dir);
    ck_assert_int_eq(suite_load(path, &s, &e), -1);
    ck_assert_msg(strstr(e.msg, "missing.suite: cannot open"), "%s", e.msg);
    ck_assert_int_eq(suite_load(dir, &s, &e), -1);
    ck_assert_msg(strstr(e.msg, dir), "%s", e.msg);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_expect_forms)
{
    suite_expect x;
    kv_err e = {{0}};
    char buf[256];
    ck_assert_int_eq(suite_parse_expect("  identical ", &x, &e), 0);
    ck_assert_int_eq(x.kind, SUITE_EXPECT_IDENTICAL);
    ck_assert_int_eq(suite_parse_expect("within rtol=1e-4", &x, &e), 0);
    ck_assert(x.kind == SUITE_EXPECT_WITHIN && x.rtol == 1e-4 && x.atol == 0 && x.ulp == 0);
    ck_assert_int_eq(suite_parse_expect("within ulp=4 atol=1e-6 rtol=1e-4", &x, &e), 0);
    ck_assert(x.ulp == 4 && x.atol == 1e-6 && x.rtol == 1e-4);
    suite_expect_describe(&x, buf, sizeof buf);
    ck_assert_str_eq(buf, "within atol=1e-06 rtol=0.0001 ulp=4");
    /* The three pairs in any order; the injection as --inject takes it. */
    ck_assert_int_eq(suite_parse_expect("detects window=4 at stage attn_lse position 4 layer 2",
                                        &x, &e), 0);
    ck_assert(x.kind == SUITE_EXPECT_DETECTS && x.injection == INJ_WINDOW && x.layer == 2 &&
              x.pos == 4 && x.stage == STAGE_ATTN_LSE);
    suite_expect_describe(&x, buf, sizeof buf);
    ck_assert_str_eq(buf, "detects window at layer 2 position 4 stage attn_lse");
    ck_assert_int_eq(suite_parse_expect(buf, &x, &e), 0);
    ck_assert_int_eq(suite_parse_expect("detects rope-offset at layer 0 position 40 stage q", &x,
                                        &e), 0);
    ck_assert_str_eq(suite_injection_diagnosis(x.injection), "rope_offset");
    /* Every injection has a diagnosis the comparer names. */
    for (int i = 0; i < INJ_COUNT; i++)
        ck_assert_str_ne(suite_injection_diagnosis(i), "?");
    ck_assert_str_eq(suite_injection_diagnosis(INJ_ISOLATED_CHUNKS), "chunk_isolated");
    ck_assert_str_eq(suite_injection_diagnosis(INJ_SPLIT_MASK_OFF_BY_ONE), "extra_key");
    ck_assert_int_eq(suite_parse_expect("", &x, &e), -1);
    ck_assert_int_eq(suite_parse_expect("within ulp=1.5", &x, &e), -1);
    ck_assert_int_eq(suite_parse_expect("detects window at layer 0 position -1 stage q", &x, &e),
                     -1);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Selection, JUnit, progress                                           */

static const char *five_cases =
    "[defaults]\nmodel = tiny-llama\na =\nb =\nexpect = identical\n"
    "[alpha]\n[beta]\n[gamma]\n[delta]\n[alpha-2]\n";

START_TEST(test_select)
{
    suite s;
    kv_err e = {{0}};
    ck_assert_msg(parse(five_cases, &s, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(s.n_cases, 5);
    int *sel, n, seen[5] = {0};
    for (int shard = 1; shard <= 3; shard++) {
        ck_assert_int_eq(suite_select(&s, NULL, shard, 3, &sel, &n, &e), 0);
        for (int i = 0; i < n; i++) {
            ck_assert_int_eq(sel[i] % 3, shard - 1);
            seen[sel[i]]++;
        }
        free(sel);
    }
    for (int i = 0; i < 5; i++)
        ck_assert_int_eq(seen[i], 1);   /* union = all, disjoint */
    ck_assert_int_eq(suite_select(&s, "^alpha", 1, 1, &sel, &n, &e), 0);
    ck_assert(n == 2 && sel[0] == 0 && sel[1] == 4);
    free(sel);
    /* The filter applies first; shards split what it selects. */
    ck_assert_int_eq(suite_select(&s, "^(beta|gamma|delta)$", 2, 2, &sel, &n, &e), 0);
    ck_assert(n == 1 && sel[0] == 2);   /* beta, gamma, delta: 2/2 is gamma */
    free(sel);
    ck_assert_int_eq(suite_select(&s, "(", 1, 1, &sel, &n, &e), -1);
    ck_assert_msg(strstr(e.msg, "--filter: '(' is not a regular expression"), "%s", e.msg);
    int si, sn;
    ck_assert_int_eq(suite_parse_shard("2/3", &si, &sn, &e), 0);
    ck_assert(si == 2 && sn == 3);
    ck_assert_int_eq(suite_parse_shard("0/3", &si, &sn, &e), -1);
    ck_assert_int_eq(suite_parse_shard("4/3", &si, &sn, &e), -1);
    ck_assert_int_eq(suite_parse_shard("1", &si, &sn, &e), -1);
    ck_assert_int_eq(suite_parse_shard("1/x", &si, &sn, &e), -1);
    suite_free(&s);
}
END_TEST

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

START_TEST(test_junit_escapes)
{
    suite s;
    kv_err e = {{0}};
    ck_assert_int_eq(parse(five_cases, &s, &e), 0);
    int sel[3] = {0, 1, 2};
    suite_result r[3];
    memset(r, 0, sizeof r);
    r[0].outcome = SUITE_PASS;
    r[1].outcome = SUITE_FAIL;
    snprintf(r[1].message, sizeof r[1].message, "expected <identical> & \"more\"\x01\xff");
    r[2].outcome = SUITE_ERROR;
    snprintf(r[2].last_line, sizeof r[2].last_line, "kvdiff run: 'x' < 2");
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    suite_junit_stream(f, &s, sel, 3, r);
    fclose(f);
    ck_assert_int_eq(count(buf, "<testcase "), 3);
    ck_assert_int_eq(count(buf, "<failure "), 1);
    ck_assert_int_eq(count(buf, "<error "), 1);
    ck_assert_ptr_nonnull(strstr(buf, "tests=\"3\" failures=\"1\" errors=\"1\""));
    ck_assert_ptr_nonnull(strstr(buf, "expected &lt;identical&gt; &amp; &quot;more&quot;??"));
    ck_assert_ptr_nonnull(strstr(buf, "kvdiff run: &apos;x&apos; &lt; 2"));
    ck_assert_ptr_null(strchr(buf, '\x01'));
    free(buf);
    suite_free(&s);
}
END_TEST

START_TEST(test_progress_line)
{
    char buf[128];
    size_t n = progress_render(buf, sizeof buf, "cases", 12, 40, "window-bug-g3");
    ck_assert_str_eq(buf, "[######..............] 12/40 cases  window-bug-g3");
    ck_assert_uint_eq(n, strlen(buf));
    progress_render(buf, sizeof buf, "cases", 0, 0, NULL);   /* no total yet: no "0/0" */
    ck_assert_str_eq(buf, "[....................] cases");
    progress_render_full(buf, sizeof buf, "weights", "", 0, 0, 2, NULL);
    ck_assert_str_eq(buf, "weights [....................] 0:02");
    progress_render(buf, sizeof buf, "cases", 50, 40, "");
    ck_assert_str_eq(buf, "[####################] 40/40 cases");
    /* A long name is cut so the line never wraps. */
    char what[200];
    memset(what, 'x', sizeof what - 1);
    what[sizeof what - 1] = 0;
    n = progress_render(buf, sizeof buf, "cases", 1, 3, what);
    ck_assert_uint_eq(n, PROGRESS_LINE_MAX);
    ck_assert(!strncmp(buf, "[######..............] 1/3 cases  xxx", 37));
    n = progress_render(buf, 10, "cases", 1, 3, NULL);   /* cut to the buffer */
    ck_assert_str_eq(buf, "[######..");
    /* Not a terminal: nothing is written at all. */
    char *mem = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&mem, &len);
    progress bar;
    progress_start(&bar, f, "cases", 3);
    progress_step(&bar, 1, "a");
    progress_end(&bar);
    fclose(f);
    ck_assert_uint_eq(len, 0);
    free(mem);
}
END_TEST

/* The phase before the bar, elapsed time and an estimate after the count;
 * a fraction of an item (a batch part-way through its layers) moves the
 * bar and the estimate. */
START_TEST(test_progress_phase_and_times)
{
    char buf[128];
    progress_render_full(buf, sizeof buf, "2/4 test fingerprints", "positions", 10, 40, 12,
                         NULL);
    ck_assert_str_eq(buf, "2/4 test fingerprints [#####...............] 10/40 positions 0:12 "
                          "eta 0:36");
    progress_render_full(buf, sizeof buf, NULL, "cases", 0, 3, 5, "a");
    ck_assert_str_eq(buf, "[....................] 0/3 cases 0:05 eta -:--  a");
    progress_render_full(buf, sizeof buf, "", "positions", 6.5, 13, 3725, NULL);
    ck_assert_str_eq(buf, "[##########..........] 6/13 positions 1:02:05 eta 1:02:05");
    char clk[16];
    progress_clock(clk, sizeof clk, 59.6);
    ck_assert_str_eq(clk, "1:00");
    progress_clock(clk, sizeof clk, -1);
    ck_assert_str_eq(clk, "-:--");
    /* Layer 1 of 6 done with a batch of 40 rows from position 0: 40 x 2/6. */
    ck_assert(progress_batch_done(0, 40, 1, 6) > 13.3 && progress_batch_done(0, 40, 1, 6) < 13.4);
    ck_assert(progress_batch_done(40, 1, 5, 6) == 41);
    ck_assert(progress_batch_done(7, 3, 0, 0) == 10);
}
END_TEST

/* ------------------------------------------------------------------ */
/* The binary                                                           */

static const char *small_suite =
    "[defaults]\n"
    "model = tiny-gemma3\n"
    "prompt = random:40:1\n"
    "max_new = 4\n"
    "a = --engine reference\n"
    "[ring-ok]\n"
    "b = --engine chunked --chunk 5 --cache ring\n"
    "expect = identical\n"
    "[window-bug]\n"
    "b = --engine chunked --chunk 5 --inject window=4\n"
    "expect = detects window at layer 0 position 4 stage attn_lse\n"
    "[cascade]\n"
    "b = --engine chunked --chunk 5 --attn cascade\n"
    "expect = within rtol=1e-5\n"
    "[wrong-place]\n"
    "b = --engine chunked --chunk 5 --inject window=4\n"
    "expect = detects window at layer 0 position 5 stage attn_lse\n";

/* "name outcome where" of each table row, in order, for comparing runs. */
static void table_rows(const char *text, char *rows, size_t n)
{
    const char *names[] = {"ring-ok ", "window-bug ", "cascade ", "wrong-place "};
    rows[0] = 0;
    /* the table, after the lines printed as each case finished */
    const char *table = strstr(text, "  expectation  ");
    ck_assert_msg(table != NULL, "no table:\n%s", text);
    for (size_t i = 0; i < 4; i++) {
        const char *line = strstr(table, names[i]);
        ck_assert_msg(line != NULL, "no row for %s:\n%s", names[i], text);
        const char *eol = strchr(line, '\n');
        const char *o = strstr(line, "  pass  ");
        if (!o || o > eol)
            o = strstr(line, "  FAIL  ");
        ck_assert_msg(o && eol && o < eol, "row: %.120s", line);
        const char *t = o + 8;                 /* then the time, then where */
        while (*t == ' ')
            t++;
        while (*t && *t != ' ')
            t++;
        while (*t == ' ')
            t++;
        size_t used = strlen(rows);
        snprintf(rows + used, n - used, "%s%.4s %.*s\n", names[i], o + 2, (int)(eol - t), t);
    }
}

START_TEST(test_cli_runs_cases)
{
    char dir[64], path[128], args[512], keep[128], rows1[1024], rows2[1024], f[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/small.suite", dir);
    write_file(path, small_suite);
    snprintf(keep, sizeof keep, "%s/work", dir);
    /* work/ names the folder work: no "work//" in what is printed */
    snprintf(args, sizeof args, "suite %s --keep %s/ --junit %s/junit.xml", path, keep, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    /* The table names the failing case and why; its files are kept. */
    ck_assert_msg(strstr(out, "FAIL wrong-place: expected detects window at layer 0 position 5 "
                              "stage attn_lse (diagnosis window); got diverged: window at layer "
                              "0 position 4 stage attn_lse"), "%s", out);
    ck_assert_msg(strstr(out, "4 cases: 3 passed, 1 failed"), "%s", out);
    snprintf(f, sizeof f, "files kept in %s/wrong-place/", keep);
    ck_assert_msg(strstr(out, f), "%s", out);
    const char *kept[] = {"a.h5", "b.h5", "compare.json", "log.txt"};
    for (int i = 0; i < 4; i++) {
        snprintf(f, sizeof f, "%s/wrong-place/%s", keep, kept[i]);
        ck_assert_msg(exists(f), "%s missing", f);
    }
    snprintf(f, sizeof f, "%s/ring-ok", keep);
    ck_assert_msg(!exists(f), "a passing case's folder %s was kept", f);
    /* Piped, each case's line came as it finished, before the table. */
    const char *line = strstr(out, "] FAIL    wrong-place  ");
    ck_assert_msg(line && line < strstr(out, "  expectation  "), "%s", out);
    ck_assert_msg(strstr(out, "] pass    ring-ok  "), "%s", out);
    /* The failure's report says what the case expected. */
    snprintf(f, sizeof f, "%s/wrong-place/report/index.html", keep);
    FILE *rf = fopen(f, "r");
    ck_assert_msg(rf != NULL, "%s missing", f);
    static char page[1 << 18];
    size_t plen = fread(page, 1, sizeof page - 1, rf);
    page[plen] = 0;
    fclose(rf);
    ck_assert_msg(strstr(page, "suite case wrong-place expected: detects window at layer 0 "
                               "position 5 stage attn_lse (diagnosis window)"), "%s", f);
    table_rows(out, rows1, sizeof rows1);
    ck_assert_str_eq(rows1, "ring-ok pass -\n"
                            "window-bug pass layer 0 position 4 attn_lse\n"
                            "cascade pass -\n"
                            "wrong-place FAIL layer 0 position 4 attn_lse\n");
    /* JUnit: one testcase per case, one failure. */
    snprintf(f, sizeof f, "%s/junit.xml", dir);
    FILE *jf = fopen(f, "r");
    ck_assert_ptr_nonnull(jf);
    static char xml[1 << 14];
    size_t len = fread(xml, 1, sizeof xml - 1, jf);
    xml[len] = 0;
    fclose(jf);
    ck_assert_int_eq(count(xml, "<testcase "), 4);
    ck_assert_int_eq(count(xml, "<failure "), 1);
    ck_assert_int_eq(count(xml, "</testsuite>"), 1);
    ck_assert_ptr_nonnull(strstr(xml, "name=\"wrong-place\""));
    if (system("command -v xmllint >/dev/null 2>&1") == 0) {
        snprintf(args, sizeof args, "xmllint --noout %s/junit.xml", dir);
        ck_assert_int_eq(system(args), 0);
    }
    /* --jobs 2: the same outcomes, same places. */
    snprintf(args, sizeof args, "suite %s --jobs 2 --keep %s", path, keep);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    table_rows(out, rows2, sizeof rows2);
    ck_assert_str_eq(rows1, rows2);
    test_rmtree(dir);
}
END_TEST

/* A case whose comparison cannot run is an ERROR: its folder keeps the
 * dumps and the log, but no empty compare.json and no report of dumps the
 * comparison refused. */
START_TEST(test_cli_error_case_leaves_no_debris)
{
    char dir[64], path[128], args[512], keep[128], f[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/err.suite", dir);
    write_file(path, "[other-weights]\n"
                     "model = tiny-gemma3\n"
                     "prompt = random:12:1\n"
                     "max_new = 2\n"
                     "a = --engine reference\n"
                     "b = --engine reference --dtype bf16\n"
                     "expect = identical\n");
    snprintf(keep, sizeof keep, "%s/work", dir);
    snprintf(args, sizeof args, "suite %s --keep %s", path, keep);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "ERROR other-weights: kvdiff compare exited with 2"), "%s", out);
    snprintf(f, sizeof f, "%s/other-weights/b.h5", keep);
    ck_assert_msg(exists(f), "%s missing", f);
    snprintf(f, sizeof f, "%s/other-weights/compare.json", keep);
    struct stat st;
    ck_assert_msg(stat(f, &st) != 0 || st.st_size > 0, "%s is empty", f);
    snprintf(f, sizeof f, "%s/other-weights/report", keep);
    ck_assert_msg(!exists(f), "%s made for an ERROR case", f);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_cli_select_and_list)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/small.suite", dir);
    write_file(path, small_suite);
    snprintf(args, sizeof args, "suite %s --list", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "ring-ok      identical\n"));
    ck_assert_ptr_nonnull(strstr(out, "window-bug   detects window at layer 0 position 4 stage "
                                      "attn_lse\n"));
    ck_assert_int_eq(count(out, "\n"), 4);
    /* Two shards: every case in exactly one. */
    char s1[1024], s2[1024];
    snprintf(args, sizeof args, "suite %s --list --shard 1/2", path);
    ck_assert_int_eq(test_run_cli(args, s1, sizeof s1), 0);
    snprintf(args, sizeof args, "suite %s --list --shard 2/2", path);
    ck_assert_int_eq(test_run_cli(args, s2, sizeof s2), 0);
    const char *names[] = {"ring-ok ", "window-bug ", "cascade ", "wrong-place "};
    for (int i = 0; i < 4; i++)
        ck_assert_msg((strstr(s1, names[i]) != NULL) + (strstr(s2, names[i]) != NULL) == 1,
                      "%s in\n%s---\n%s", names[i], s1, s2);
    ck_assert_int_eq(count(s1, "\n") + count(s2, "\n"), 4);
    /* A shard runs only its cases; the default work folder goes away when
     * they all pass. */
    char tmp[128];
    snprintf(tmp, sizeof tmp, "%s/tmp", dir);
    ck_assert_int_eq(mkdir(tmp, 0755), 0);
    snprintf(args, sizeof args, "suite %s --shard 1/2 --filter '^(ring|window)'", path);
    setenv("TMPDIR", tmp, 1);
    int rc = test_run_cli(args, out, sizeof out);
    unsetenv("TMPDIR");
    ck_assert_msg(rc == 0, "%s", out);
    ck_assert_msg(strstr(out, "1 case: 1 passed") && strstr(out, "ring-ok ") &&
                  !strstr(out, "window-bug "), "%s", out);
    ck_assert_msg(rmdir(tmp) == 0, "work folder left in %s", tmp);
    /* --filter alone; with a failure the fresh work folder stays. */
    snprintf(args, sizeof args, "suite %s --filter 'bug|place' --jobs 2", path);
    setenv("TMPDIR", dir, 1);
    rc = test_run_cli(args, out, sizeof out);
    unsetenv("TMPDIR");
    ck_assert_msg(rc == 1, "%s", out);
    ck_assert_msg(strstr(out, "2 cases: 1 passed, 1 failed") && !strstr(out, "ring-ok "), "%s",
                  out);
    char want[160];
    snprintf(want, sizeof want, "work folder: %s/kvdiff-suite.", dir);
    ck_assert_msg(strstr(out, want), "%s", out);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_cli_refuses)
{
    char dir[64], path[128], args[512], keep[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/bad.suite", dir);
    write_file(path, "[defaults]\nmodel = tiny-gemma3\n\n[c]\nexpect = detects window at layer 0"
                     " position 4\n");
    snprintf(keep, sizeof keep, "%s/work", dir);
    snprintf(args, sizeof args, "suite %s --keep %s", path, keep);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    char want[256];
    snprintf(want, sizeof want, "kvdiff suite: %s:5: expect: expected 'detects INJECTION", path);
    ck_assert_msg(strstr(out, want), "%s", out);
    ck_assert_int_eq(count(out, "\n"), 1);
    ck_assert_msg(!exists(keep), "a bad suite created %s", keep);
    snprintf(path, sizeof path, "%s/small.suite", dir);
    write_file(path, small_suite);
    const char *bad_opts[] = {"--jobs 0", "--shard 3/2", "--shard x", "--filter '('",
                              "--filter nomatch", "--bogus", ""};
    for (int i = 0; i < 7; i++) {
        snprintf(args, sizeof args, "suite %s %s", i == 6 ? "" : path, bad_opts[i]);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s: %s", args, out);
        ck_assert_msg(strstr(out, "kvdiff suite"), "%s", out);
    }
    ck_assert_int_eq(test_run_cli("suite --help", out, sizeof out), 0);
    ck_assert_ptr_nonnull(strstr(out, "--shard I/N"));
    /* --junit over an input a case reads (a prompt file, a dump: side)
     * would replace it once the cases ran: refused before any runs */
    char ids[128], rec[128];
    snprintf(ids, sizeof ids, "%s/ids.txt", dir);
    snprintf(rec, sizeof rec, "%s/rec.h5", dir);
    write_file(ids, "5,17,42\n");
    write_file(rec, "not read: the case never runs\n");
    snprintf(path, sizeof path, "%s/inputs.suite", dir);
    write_file(path, "[defaults]\nmodel = tiny-gemma3\nmax_new = 2\na = --engine reference\n"
                     "b = --engine chunked\n\n[p]\nprompt = file:ids.txt\nexpect = identical\n\n"
                     "[d]\nprompt = 5,17,42\nb = dump: rec.h5\nexpect = identical\n");
    const char *over[] = {ids, rec};
    const char *says[] = {"is the same file as case p's prompt", "is the same file as case d's "
                          "dump: side"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "suite %s --junit %s", path, over[i]);
        const int rc = test_run_cli(args, out, sizeof out);
        ck_assert_msg(rc == 2 && strstr(out, says[i]) && count(out, "\n") == 1, "exit %d: %s",
                      rc, out);
    }
    char text[64] = "";
    FILE *f = fopen(ids, "r");
    ck_assert(f && fgets(text, sizeof text, f));
    fclose(f);
    ck_assert_str_eq(text, "5,17,42\n");
    test_rmtree(dir);
}
END_TEST

START_TEST(test_cli_case_error)
{
    /* tiny-llama has no sliding layer: the engine refuses the injection.
     * The case is an ERROR with the engine's own last line. */
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/err.suite", dir);
    write_file(path, "[no-window]\nmodel = tiny-llama\nprompt = 1,2,3,4,5,6\nmax_new = 2\n"
                     "a = --engine reference\nb = --engine chunked --chunk 4 --inject window=4\n"
                     "expect = detects window at layer 0 position 4 stage attn_lse\n");
    snprintf(args, sizeof args, "suite %s --keep %s/work --junit %s/j.xml", path, dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "ERROR no-window: engine B (kvdiff run) exited with 2"), "%s", out);
    ck_assert_msg(strstr(out, "last line: kvdiff run:") && strstr(out, "sliding"), "%s", out);
    snprintf(path, sizeof path, "%s/j.xml", dir);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    out[fread(out, 1, sizeof out - 1, f)] = 0;
    fclose(f);
    ck_assert_int_eq(count(out, "<error "), 1);
    ck_assert_int_eq(count(out, "<failure "), 0);
    test_rmtree(dir);
}
END_TEST

/* A step that runs past --timeout is killed and its case is an ERROR
 * that says so (a real-shaped model takes seconds just to build). */
START_TEST(test_cli_step_timeout)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/slow.suite", dir);
    write_file(path, "[slow]\nmodel = qwen2.5-0.5b-shape\nprompt = random:8:1\nmax_new = 1\n"
                     "a = --engine reference\nb = --engine chunked --chunk 4\n"
                     "expect = identical\n");
    snprintf(args, sizeof args, "suite %s --keep %s/work --timeout 1", path, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "ERROR slow: engine A (kvdiff run) ran past the step time limit "
                              "(1 s) and was killed"), "%s", out);
    ck_assert_int_eq(test_run_cli("suite x.suite --timeout -1", out, sizeof out), 2);
    test_rmtree(dir);
}
END_TEST

/* SIGINT or SIGTERM to a running suite: what finished is reported (the
 * table, a partial JUnit with the rest skipped), the case that was running
 * is killed and its folder removed, and the exit code says which signal. */
START_TEST(test_cli_interrupted)
{
    static const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
    const int sig = sigs[_i];
    char dir[64], path[128], junit[128], keep[128], folder[192];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/s.suite", dir);
    snprintf(junit, sizeof junit, "%s/j.xml", dir);
    snprintf(keep, sizeof keep, "%s/work", dir);
    /* a quick case, then two that take long enough to be interrupted */
    write_file(path, "[defaults]\nmodel = tiny-llama\na =\nb = --engine chunked --chunk 5\n"
                     "expect = identical\n\n[quick]\nprompt = random:8:1\nmax_new = 2\n\n"
                     "[long-1]\nprompt = random:6000:1\nmax_new = 4\n\n"
                     "[long-2]\nprompt = random:6000:2\nmax_new = 4\n");
    const char *bin = getenv("KVDIFF_BIN");
    int pipefd[2];
    ck_assert_int_eq(pipe(pipefd), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        dup2(pipefd[1], 1);
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        execl(bin ? bin : "./kvdiff", "kvdiff", "suite", path, "--jobs", "1", "--junit", junit,
              "--keep", keep, (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    /* Interrupt once the second case has its folder: the first finished.
     * (This only decides when to send the signal; nothing is timed.) */
    snprintf(folder, sizeof folder, "%s/long-1", keep);
    int early;
    while (!exists(folder)) {
        ck_assert_msg(waitpid(pid, &early, WNOHANG) == 0, "the suite ended before its second case");
        usleep(5000);
    }
    kill(pid, sig);
    size_t got = 0;
    ssize_t r;
    while ((r = read(pipefd[0], out + got, sizeof out - 1 - got)) > 0)
        got += (size_t)r;
    out[got] = 0;
    close(pipefd[0]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 128 + sig, "status %d: %s", st, out);
    ck_assert_msg(strstr(out, "quick") && strstr(out, "pass"), "%s", out);
    ck_assert_msg(strstr(out, "3 cases: 1 passed, 0 failed, 2 skipped (interrupted by "), "%s",
                  out);
    ck_assert_msg(strstr(out, sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "SIGHUP"),
                  "%s", out);
    ck_assert_msg(!exists(folder), "the interrupted case's folder is still there");
    FILE *f = fopen(junit, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = 0;
    fclose(f);
    ck_assert_msg(strstr(out, "tests=\"3\" failures=\"0\" errors=\"0\" skipped=\"2\""), "%s",
                  out);
    ck_assert_msg(strstr(out, "<skipped message=\"interrupted while running"), "%s", out);
    ck_assert_msg(strstr(out, "<skipped message=\"not run: the suite was interrupted"), "%s",
                  out);
    test_rmtree(dir);
}
END_TEST

Suite *suite_suite(void)
{
    Suite *s = suite_create("suite");
    TCase *tc = tcase_create("parser");
    tcase_add_test(tc, test_parse_defaults);
    tcase_add_loop_test(tc, test_parse_errors, 0, (int)(sizeof bad_files / sizeof *bad_files));
    tcase_add_test(tc, test_parse_odd_bytes);
    tcase_add_test(tc, test_prompt_forms);
    tcase_add_test(tc, test_expect_forms);
    tcase_add_test(tc, test_select);
    tcase_add_test(tc, test_junit_escapes);
    tcase_add_test(tc, test_progress_line);
    tcase_add_test(tc, test_progress_phase_and_times);
    suite_add_tcase(s, tc);
    tc = tcase_create("binary");
    tcase_add_test(tc, test_cli_runs_cases);
    tcase_add_test(tc, test_cli_error_case_leaves_no_debris);
    tcase_add_test(tc, test_cli_select_and_list);
    tcase_add_test(tc, test_cli_refuses);
    tcase_add_test(tc, test_cli_case_error);
    tcase_add_test(tc, test_cli_step_timeout);
    tcase_add_loop_test(tc, test_cli_interrupted, 0, 3);
    suite_add_tcase(s, tc);
    return s;
}
