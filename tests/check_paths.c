/* check_paths.c — what kvdiff writes and where: an output named like an
 * input is refused before any work, temporary files cannot be redirected
 * by a symlink planted at a predictable name, outputs that cannot be
 * written fail at once, contradictory flags are refused, and file contents
 * never reach the terminal raw. */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* The helpers are the binary's, not the library's: compiled in here. */
#include <hdf5.h>
#include <jansson.h>

#include "model/config.h"
#include "reports/report.h"
#include "model/tokenizer.h"
#include "model/tokens.h"
#include "harness/cli.h"
#include "harness/cli.c"
#include "gguf_patch.h"
#include "testutil.h"

static char out[1 << 16];
static char tmp[64];

static void tmp_setup(void)
{
    ck_assert_ptr_nonnull(test_tmpdir(tmp, sizeof tmp));
}

static void tmp_teardown(void)
{
    test_rmtree(tmp);
}

static void put_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    fputs(text, f);
    fclose(f);
}

/* The whole file (at most 4 KiB) as a string, "" when missing. */
static const char *file_text(const char *path)
{
    static char buf[4096];
    buf[0] = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return buf;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

static int cli(const char *fmt, const char *a, const char *b, const char *c)
{
    char args[2048];
    snprintf(args, sizeof args, fmt, a, b, c);
    return test_run_cli(args, out, sizeof out);
}

static bool is_symlink(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode);
}

static bool is_regular(const char *path)
{
    struct stat sb;
    return lstat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static const char *const SUITE_TEXT =
    "[same]\nmodel = tiny-gemma3\nprompt = random:8:1\nmax_new = 2\n"
    "a = --engine reference\nb = --engine chunked --chunk 3\nexpect = identical\n";

/* ------------------------------------------------------------------ */
/* Outputs equal to inputs                                              */

START_TEST(test_dump_over_prompt_file)
{
    char p[128];
    snprintf(p, sizeof p, "%s/p.txt", tmp);
    put_file(p, "1,2,3\n");
    int rc = cli("run --prompt-file %s --max-new 2 --dump %s%s", p, p, "");
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "--dump") && strstr(out, "--prompt-file"), "%s", out);
    ck_assert_str_eq(file_text(p), "1,2,3\n");
    /* the same file under another name (a hard link) is the same input */
    char q[128];
    snprintf(q, sizeof q, "%s/q.txt", tmp);
    ck_assert_int_eq(link(p, q), 0);
    rc = cli("run --prompt-file %s --max-new 2 --dump %s%s", p, q, "");
    ck_assert_msg(rc == 2 && strstr(out, "same file"), "exit %d\n%s", rc, out);
    ck_assert_str_eq(file_text(p), "1,2,3\n");
}
END_TEST

START_TEST(test_dump_over_model_file)
{
    char gm[128], st[160];
    snprintf(gm, sizeof gm, "%s/gm", tmp);
    snprintf(st, sizeof st, "%s/model.safetensors", gm);
    ck_assert_int_eq(cli("gen --preset tiny-gemma3 -o %s%s%s", gm, "", ""), 0);
    struct stat before, after;
    ck_assert_int_eq(stat(st, &before), 0);
    int rc = cli("run --model %s --max-new 2 --dump %s%s", gm, st, "");
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "model.safetensors") && strstr(out, "refusing"), "%s", out);
    ck_assert_int_eq(stat(st, &after), 0);
    ck_assert_int_eq(before.st_size, after.st_size);
    ck_assert_int_eq(before.st_mtime, after.st_mtime);
    /* config.json through a relative spelling of the folder */
    char cfg[200];
    snprintf(cfg, sizeof cfg, "%s/../%s/gm/config.json", gm, strrchr(tmp, '/') + 1);
    rc = cli("run --model %s --max-new 2 --dump %s%s", gm, cfg, "");
    ck_assert_msg(rc == 2 && strstr(out, "config.json"), "exit %d\n%s", rc, out);
    /* a new file in the model folder is no input */
    char ok[160];
    snprintf(ok, sizeof ok, "%s/run.h5", gm);
    rc = cli("run --model %s --max-new 2 --dump %s%s", gm, ok, "");
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
}
END_TEST

START_TEST(test_dump_equals_dump_ref)
{
    char d[128], d2[160];
    snprintf(d, sizeof d, "%s/same.h5", tmp);
    snprintf(d2, sizeof d2, "%s/./same.h5", tmp);
    int rc = cli("run --compare --engine chunked --max-new 2 --dump %s --dump-ref %s%s", d, d2,
                 "");
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "--dump") && strstr(out, "--dump-ref"), "%s", out);
    ck_assert_msg(access(d, F_OK) != 0, "the run went ahead:\n%s", out);
}
END_TEST

START_TEST(test_junit_over_suite_file)
{
    char s[128];
    snprintf(s, sizeof s, "%s/s.suite", tmp);
    put_file(s, SUITE_TEXT);
    int rc = cli("suite %s --junit %s%s", s, s, "");
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "--junit") && strstr(out, "suite file"), "%s", out);
    ck_assert_str_eq(file_text(s), SUITE_TEXT);
}
END_TEST

/* Refused before the first case runs: no table, no case folder. */
START_TEST(test_junit_missing_folder_refused_first)
{
    char s[128], keep[128], j[160], casedir[160];
    snprintf(s, sizeof s, "%s/s.suite", tmp);
    snprintf(keep, sizeof keep, "%s/work", tmp);
    snprintf(j, sizeof j, "%s/no/such/folder/j.xml", tmp);
    snprintf(casedir, sizeof casedir, "%s/same", keep);
    put_file(s, SUITE_TEXT);
    ck_assert_int_eq(mkdir(keep, 0755), 0);
    int rc = cli("suite %s --keep %s --junit %s", s, keep, j);
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "--junit") && !strstr(out, "expectation"), "%s", out);
    ck_assert_msg(access(casedir, F_OK) != 0, "a case ran:\n%s", out);
    /* a folder given as the file */
    rc = cli("suite %s --junit %s%s", s, keep, "");
    ck_assert_msg(rc == 2 && strstr(out, "folder"), "exit %d\n%s", rc, out);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Temporary files and symlinks                                         */

START_TEST(test_junit_tmp_symlink_not_followed)
{
    char s[128], j[128], link_at[160], victim[128];
    snprintf(s, sizeof s, "%s/s.suite", tmp);
    snprintf(j, sizeof j, "%s/j.xml", tmp);
    snprintf(link_at, sizeof link_at, "%s.tmp", j);
    snprintf(victim, sizeof victim, "%s/victim", tmp);
    put_file(s, SUITE_TEXT);
    put_file(victim, "untouched\n");
    ck_assert_int_eq(symlink(victim, link_at), 0);
    int rc = cli("suite %s --junit %s%s", s, j, "");
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
    ck_assert_str_eq(file_text(victim), "untouched\n");
    ck_assert(is_regular(j));
    ck_assert_ptr_nonnull(strstr(file_text(j), "<testsuites"));
}
END_TEST

/* gen -o wrote config.json and model.safetensors through
 * "NAME.tmp.<pid>": a name anyone can predict and plant a symlink at, so
 * the write went to the symlink's target. The pid is known here before
 * the child execs: links planted at every name the old code used leave
 * their targets untouched, and the folder is whole. */
START_TEST(test_gen_tmp_symlinks_not_followed)
{
    char dir[128], victim[128], link_at[256];
    snprintf(dir, sizeof dir, "%s/genout", tmp);
    snprintf(victim, sizeof victim, "%s/gen-victim", tmp);
    ck_assert_int_eq(mkdir(dir, 0700), 0);
    put_file(victim, "untouched\n");
    int go[2];
    ck_assert_int_eq(pipe(go), 0);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        char c;
        close(go[1]);
        if (read(go[0], &c, 1) != 1)
            _exit(126);
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        const char *bin = getenv("KVDIFF_BIN");
        execl(bin ? bin : "./kvdiff", "kvdiff", "gen", "--preset", "tiny-llama", "-o", dir,
              (char *)NULL);
        _exit(127);
    }
    close(go[0]);
    static const char *const names[] = {"config.json.tmp.%ld", "model.safetensors.tmp.%ld",
                                        "model.safetensors.tmp.%ld.0"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char name[96];
        snprintf(name, sizeof name, names[i], (long)pid);
        snprintf(link_at, sizeof link_at, "%s/%s", dir, name);
        ck_assert_int_eq(symlink(victim, link_at), 0);
    }
    ck_assert_int_eq(write(go[1], "x", 1), 1);
    close(go[1]);
    int st;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "gen status %d", st);
    ck_assert_str_eq(file_text(victim), "untouched\n");
    snprintf(link_at, sizeof link_at, "%s/config.json", dir);
    ck_assert(is_regular(link_at));
    snprintf(link_at, sizeof link_at, "%s/model.safetensors", dir);
    ck_assert(is_regular(link_at));
    int rc = cli("run --model %s --prompt-random 4 --max-new 1%s%s", dir, "", "");
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
}
END_TEST

START_TEST(test_report_symlinks_not_followed)
{
    char a[128], b[128], rep[128], plots[160], victim[128];
    snprintf(a, sizeof a, "%s/a.h5", tmp);
    snprintf(b, sizeof b, "%s/b.h5", tmp);
    snprintf(rep, sizeof rep, "%s/rep", tmp);
    snprintf(plots, sizeof plots, "%s/plots", rep);
    snprintf(victim, sizeof victim, "%s/victim", tmp);
    ck_assert_int_eq(cli("run --prompt-random 12 --max-new 3 --dump %s%s%s", a, "", ""), 0);
    ck_assert_int_eq(cli("run --prompt-random 12 --max-new 3 --engine chunked --chunk 5 "
                         "--inject window=4 --dump %s%s%s", b, "", ""), 0);
    ck_assert_int_eq(mkdir(rep, 0755), 0);
    ck_assert_int_eq(mkdir(plots, 0755), 0);
    put_file(victim, "untouched\n");
    /* every name an attacker could predict: the old temporary names and
     * the plot files themselves */
    static const char *const planted[] = {
        ".index.html.tmp", ".summary.md.tmp", ".result.json.tmp", "plots/heatmap.gp",
        "plots/heatmap.dat", "plots/growth.gp", "plots/heatmap.png", "plots/heatmap.svg"};
    char at[256];
    for (size_t i = 0; i < sizeof planted / sizeof *planted; i++) {
        snprintf(at, sizeof at, "%s/%s", rep, planted[i]);
        ck_assert_int_eq(symlink(victim, at), 0);
    }
    /* A link where the report writes one of its names is refused before
     * anything is written: never followed, never removed (it is not the
     * run's to remove). */
    int rc = cli("report %s %s -o %s", a, b, rep);
    ck_assert_msg(rc == 2 && strstr(out, "is a symbolic link") && strstr(out, "plots/heatmap."),
                  "exit %d\n%s", rc, out);
    ck_assert_str_eq(file_text(victim), "untouched\n");
    for (size_t i = 0; i < sizeof planted / sizeof *planted; i++) {
        snprintf(at, sizeof at, "%s/%s", rep, planted[i]);
        ck_assert_msg(is_symlink(at), "%s: the planted link was removed", planted[i]);
    }
    snprintf(at, sizeof at, "%s/index.html", rep);
    ck_assert(!is_regular(at));
    /* The old temporary names are no longer used: with only those planted
     * the report is written, and they stay as they were. */
    for (size_t i = 3; i < sizeof planted / sizeof *planted; i++) {
        snprintf(at, sizeof at, "%s/%s", rep, planted[i]);
        ck_assert_int_eq(unlink(at), 0);
    }
    rc = cli("report %s %s -o %s", a, b, rep);
    ck_assert_msg(rc == 1, "exit %d\n%s", rc, out);
    ck_assert_str_eq(file_text(victim), "untouched\n");
    for (size_t i = 0; i < 3; i++) {
        snprintf(at, sizeof at, "%s/%s", rep, planted[i]);
        ck_assert_msg(is_symlink(at), "%s: the planted link was removed", planted[i]);
    }
    snprintf(at, sizeof at, "%s/index.html", rep);
    ck_assert(is_regular(at));
    /* what a report leaves is as readable as any file the user makes */
    struct stat sb;
    ck_assert_int_eq(stat(at, &sb), 0);
    ck_assert_int_ne(sb.st_mode & 0044, 0);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Contradictory flags                                                  */

START_TEST(test_exact_with_tolerance_refused)
{
    static const char *const cmds[] = {
        "compare x.h5 y.h5 --exact --atol 1e-3",   "compare x.h5 y.h5 --rtol 1e-3 --exact",
        "report x.h5 y.h5 -o r --ulp 4 --exact",   "run --compare --exact --atol 1e-3",
        "run --compare --engine chunked --atol 1e-3 --exact"};
    for (size_t i = 0; i < sizeof cmds / sizeof *cmds; i++) {
        int rc = test_run_cli(cmds[i], out, sizeof out);
        ck_assert_msg(rc == 2, "%s: exit %d\n%s", cmds[i], rc, out);
        ck_assert_msg(strstr(out, "--exact and --"), "%s:\n%s", cmds[i], out);
        ck_assert_msg(strchr(out, '\n') == out + strlen(out) - 1, "one line: %s", out);
    }
    /* tolerances together are no contradiction */
    int rc = test_run_cli("run --compare --engine chunked --max-new 2 --atol 1e-3 --rtol 1e-3",
                          out, sizeof out);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
}
END_TEST

START_TEST(test_prefill_with_chunked_refused)
{
    int rc = test_run_cli("run --engine chunked --prefill token --max-new 2", out, sizeof out);
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "--prefill") && strstr(out, "--engine chunked"), "%s", out);
    rc = test_run_cli("run --prefill token --engine chunked --compare --max-new 2", out,
                      sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, "--prefill"), "exit %d\n%s", rc, out);
    rc = test_run_cli("run --engine reference --prefill token --max-new 2", out, sizeof out);
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Small inputs that are not regular files                              */

/* A FIFO opened for reading blocks until a writer comes: alarm() turns a
 * hang into a failed (forked) test instead of a stuck run. */
START_TEST(test_config_fifo_refused)
{
    char p[128];
    snprintf(p, sizeof p, "%s/config.json", tmp);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    alarm(120);
    kv_config c;
    kv_err e = {{0}};
    ck_assert_int_eq(config_load_json(p, &c, &e), -1);
    alarm(0);
    ck_assert_msg(strstr(e.msg, "config.json") && strstr(e.msg, "not a regular file"), "%s",
                  e.msg);
}
END_TEST

/* A sharded checkpoint's index at a FIFO: refused, not read for ever. */
START_TEST(test_index_fifo_refused)
{
    char dir[128], p[160];
    snprintf(dir, sizeof dir, "%s/fifo-index", tmp);
    ck_assert_int_eq(cli("gen --preset tiny-llama -o %s%s%s", dir, "", ""), 0);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ck_assert_int_eq(unlink(p), 0);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    alarm(120);
    int rc = cli("run --model %s --prompt-random 3 --max-new 1%s%s", dir, "", "");
    alarm(0);
    ck_assert_msg(rc == 2 && strstr(out, "model.safetensors.index.json: not a regular file (a "
                                         "FIFO)"), "exit %d\n%s", rc, out);
}
END_TEST

/* report's result JSON, a suite file and kvdiff-llama's model at a FIFO:
 * each refused in one line, exit 2, where each hung for ever. */
START_TEST(test_report_suite_recorder_fifos_refused)
{
    char j[128], s[128], g[160], args[512];
    snprintf(j, sizeof j, "%s/r-fifo.json", tmp);
    snprintf(s, sizeof s, "%s/s-fifo.suite", tmp);
    snprintf(g, sizeof g, "%s/m-fifo.gguf", tmp);
    ck_assert(mkfifo(j, 0644) == 0 && mkfifo(s, 0644) == 0 && mkfifo(g, 0644) == 0);
    alarm(120);
    int rc = cli("report %s -o %s/rep-fifo%s", j, tmp, "");
    ck_assert_msg(rc == 2 && strstr(out, "r-fifo.json: cannot read it (not a regular file (a "
                                         "FIFO))"), "exit %d\n%s", rc, out);
    rc = cli("suite %s%s%s", s, "", "");
    ck_assert_msg(rc == 2 && strstr(out, "s-fifo.suite: not a regular file (a FIFO)"),
                  "exit %d\n%s", rc, out);
    snprintf(args, sizeof args, "%s --prompt-tokens 1,2 --max-new 1 --dump %s/x.h5", g, tmp);
    rc = test_run_recorder(args, out, sizeof out);
    alarm(0);
    ck_assert_msg(rc == 2 && strstr(out, "m-fifo.gguf: not a regular file (a FIFO)"),
                  "exit %d\n%s", rc, out);
}
END_TEST

START_TEST(test_tokenizer_fifo_refused)
{
    char p[128];
    snprintf(p, sizeof p, "%s/tokenizer.json", tmp);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    alarm(120);
    kv_tokenizer *t = NULL;
    kv_err e = {{0}};
    ck_assert_int_eq(tok_load(tmp, &t, &e), -1);
    alarm(0);
    ck_assert_msg(strstr(e.msg, "tokenizer.json") && strstr(e.msg, "FIFO"), "%s", e.msg);
}
END_TEST

/* Prompt files (token ids, text) are opened as tokenizer.json is: a FIFO
 * with no writer is refused at once, never waited on. */
START_TEST(test_prompt_files_fifo_refused)
{
    char p[128];
    snprintf(p, sizeof p, "%s/prompt.txt", tmp);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    alarm(120);
    int32_t *ids = NULL;
    int n = 0;
    kv_err e = {{0}};
    ck_assert_int_eq(tokens_load(p, 0, &ids, &n, &e), -1);
    ck_assert_msg(strstr(e.msg, "prompt.txt") && strstr(e.msg, "FIFO"), "%s", e.msg);
    char *text = NULL;
    size_t len = 0;
    ck_assert_int_eq(tok_read_text(p, &text, &len, &e), -1);
    ck_assert_msg(strstr(e.msg, "prompt.txt") && strstr(e.msg, "FIFO"), "%s", e.msg);
    alarm(0);
}
END_TEST

/* /dev/zero is refused for what it is, before a byte is read (it used to
 * be read up to the 1 GB bound); a huge regular file for its size. */
START_TEST(test_tokenizer_device_and_size_refused)
{
    char p[128];
    snprintf(p, sizeof p, "%s/tokenizer.json", tmp);
    ck_assert_int_eq(symlink("/dev/zero", p), 0);
    kv_tokenizer *t = NULL;
    kv_err e = {{0}};
    alarm(120);
    ck_assert_int_eq(tok_load(tmp, &t, &e), -1);
    ck_assert_msg(strstr(e.msg, "not a regular file (a device)"), "%s", e.msg);
    ck_assert_int_eq(unlink(p), 0);
    /* sparse: no disk used */
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_int_eq(ftruncate(fileno(f), 300L << 20), 0);
    fclose(f);
    ck_assert_int_eq(tok_load(tmp, &t, &e), -1);
    ck_assert_msg(strstr(e.msg, "314572800 bytes; at most 268435456"), "%s", e.msg);
    alarm(0);
    ck_assert_ptr_null(t);
}
END_TEST

/* The model folder as `run` sees it: a one-line error, no hang. */
START_TEST(test_run_model_fifo_refused)
{
    char gm[128], cfg[160];
    snprintf(gm, sizeof gm, "%s/gm", tmp);
    snprintf(cfg, sizeof cfg, "%s/config.json", gm);
    ck_assert_int_eq(cli("gen --preset tiny-gemma3 -o %s%s%s", gm, "", ""), 0);
    ck_assert_int_eq(unlink(cfg), 0);
    ck_assert_int_eq(mkfifo(cfg, 0644), 0);
    alarm(300);
    int rc = cli("run --model %s --max-new 1%s%s", gm, "", "");
    alarm(0);
    ck_assert_msg(rc == 2 && strstr(out, "config.json: not a regular file"), "exit %d\n%s", rc,
                  out);
}
END_TEST

/* ------------------------------------------------------------------ */
/* A saved compare result with impossible values                        */

/* Sets root.obj.key (obj NULL: root.key) to v and returns the load error. */
static const char *load_with(const char *json, const char *obj, const char *key, json_t *v)
{
    static kv_err e;
    char path[160];
    snprintf(path, sizeof path, "%s/mut.json", tmp);
    json_error_t jerr;
    json_t *root = json_load_file(json, 0, &jerr);
    ck_assert_ptr_nonnull(root);
    json_t *o = obj ? json_object_get(root, obj) : root;
    ck_assert_msg(json_is_object(o), "%s is not an object", obj);
    json_object_set_new(o, key, v);
    ck_assert_int_eq(json_dump_file(root, path, 0), 0);
    json_decref(root);
    report_json j;
    memset(&e, 0, sizeof e);
    if (report_json_load(path, &j, &e) == 0) {
        report_json_free(&j);
        return NULL;
    }
    return e.msg;
}

START_TEST(test_report_json_impossible_values)
{
    char a[128], b[128], json[128], args[512];
    snprintf(a, sizeof a, "%s/a.h5", tmp);
    snprintf(b, sizeof b, "%s/b.h5", tmp);
    snprintf(json, sizeof json, "%s/r.json", tmp);
    ck_assert_int_eq(cli("run --prompt-random 12 --max-new 3 --dump %s%s%s", a, "", ""), 0);
    ck_assert_int_eq(cli("run --prompt-random 12 --max-new 3 --engine chunked --chunk 5 "
                         "--inject window=4 --dump %s%s%s", b, "", ""), 0);
    snprintf(args, sizeof args, "sh -c '\"%s\" compare %s %s --json > %s'",
             getenv("KVDIFF_BIN") ? getenv("KVDIFF_BIN") : "./kvdiff", a, b, json);
    ck_assert_int_eq(system(args) >> 8, 1);
    /* the file as written loads */
    report_json j;
    kv_err e = {{0}};
    ck_assert_msg(report_json_load(json, &j, &e) == 0, "%s", e.msg);
    report_json_free(&j);
    const char *m = load_with(json, "first_divergence", "position", json_integer(1LL << 62));
    ck_assert_msg(m && strstr(m, "first_divergence.position is out of range"), "%s",
                  m ? m : "accepted");
    m = load_with(json, "tokens", "ref_id", json_integer(-1));
    ck_assert_msg(m && strstr(m, "tokens.ref_id is out of range (-1)"), "%s", m ? m : "accepted");
    m = load_with(json, "tokens", "position", json_integer(1LL << 40));
    ck_assert_msg(m && strstr(m, "tokens.position"), "%s", m ? m : "accepted");
    m = load_with(json, NULL, "exit_code", json_integer(77));
    ck_assert_msg(m && strstr(m, "exit_code is out of range (77)"), "%s", m ? m : "accepted");
    /* a possible exit code that the verdict contradicts */
    m = load_with(json, NULL, "exit_code", json_integer(0));
    ck_assert_msg(m && strstr(m, "exit_code is 0, but"), "%s", m ? m : "accepted");
    /* and through the CLI: exit 2, the key named, nothing written */
    char mut[160], rep[160];
    snprintf(mut, sizeof mut, "%s/mut.json", tmp);
    snprintf(rep, sizeof rep, "%s/rep", tmp);
    load_with(json, NULL, "exit_code", json_integer(77));
    int rc = cli("report %s -o %s%s", mut, rep, "");
    ck_assert_msg(rc == 2 && strstr(out, "exit_code"), "exit %d\n%s", rc, out);
    ck_assert(access(rep, F_OK) != 0);
}
END_TEST

/* ------------------------------------------------------------------ */
/* A file that is no token list                                         */

/* Its contents never reach the message: the file, line and byte do. */
START_TEST(test_prompt_file_not_echoed)
{
    char secret[128], s[128];
    snprintf(secret, sizeof secret, "%s/secret.txt", tmp);
    snprintf(s, sizeof s, "%s/s.suite", tmp);
    put_file(secret, "1 2 3\n4 hunter2:x:0:0:root\n");
    put_file(s, "[c]\nmodel = tiny-gemma3\nprompt = file:secret.txt\nmax_new = 2\n"
                "a = --engine reference\nb = --engine reference\nexpect = identical\n");
    int rc = cli("suite %s%s%s", s, "", "");
    ck_assert_msg(rc == 2, "exit %d\n%s", rc, out);
    ck_assert_msg(!strstr(out, "hunter"), "echoed the file: %s", out);
    ck_assert_msg(strstr(out, "secret.txt: line 2, byte 3 (item 5)"), "%s", out);
    rc = cli("run --prompt-ids-file %s%s%s", secret, "", "");
    ck_assert_msg(rc == 2 && !strstr(out, "hunter") && strstr(out, "line 2, byte 3"),
                  "exit %d\n%s", rc, out);
    /* a file's id outside the vocabulary: named by place too */
    put_file(secret, "1 2 999999\n");
    rc = cli("run --prompt-ids-file %s%s%s", secret, "", "");
    ck_assert_msg(rc == 2 && strstr(out, "line 1, byte 5 (item 3)") &&
                  strstr(out, "outside the vocabulary"), "exit %d\n%s", rc, out);
    /* ids typed on the command line are the user's own: still quoted */
    rc = test_run_cli("run --prompt-tokens 1,x", out, sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, "item 2 'x'"), "exit %d\n%s", rc, out);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Control characters from files                                        */

/* Sets the root string attribute name of the dump at path. */
static void set_root_attr(const char *path, const char *name, const char *text)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    if (H5Aexists(f, name) > 0)
        ck_assert_int_ge(H5Adelete(f, name), 0);
    hid_t sp = H5Screate(H5S_SCALAR), t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, strlen(text) + 1);
    hid_t a = H5Acreate2(f, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert_int_ge(a, 0);
    ck_assert_int_ge(H5Awrite(a, t, text), 0);
    H5Aclose(a);
    H5Tclose(t);
    H5Sclose(sp);
    H5Fclose(f);
}

/* No byte the terminal acts on, and no line that starts with fake. */
static void assert_no_raw_control(const char *text, const char *fake)
{
    for (const unsigned char *p = (const unsigned char *)text; *p; p++)
        ck_assert_msg(*p >= 0x20 || *p == '\n' || *p == '\t',
                      "raw control byte 0x%02x in:\n%s", *p, text);
    char line[128];
    snprintf(line, sizeof line, "\n%s", fake);
    ck_assert_msg(!strstr(text, line) && strncmp(text, fake, strlen(fake)),
                  "a faked line '%s' in:\n%s", fake, text);
}

static const char HOSTILE[] = "x\x1b[2J\r\nFAKE: all clear\x07";

START_TEST(test_inspect_escapes_attributes)
{
    char a[128];
    snprintf(a, sizeof a, "%s/a.h5", tmp);
    ck_assert_int_eq(cli("run --prompt-random 6 --max-new 1 --dump %s%s%s", a, "", ""), 0);
    set_root_attr(a, "engine", HOSTILE);
    set_root_attr(a, "tool_version", HOSTILE);
    int rc = cli("inspect %s%s%s", a, "", "");
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
    assert_no_raw_control(out, "FAKE");
    ck_assert_msg(strstr(out, "engine    x\\x1b[2J\\x0d\\x0aFAKE: all clear\\x07"), "%s", out);
}
END_TEST

/* C1 controls: U+009B (CSI, "\xc2\x9b" in UTF-8) starts an escape
 * sequence in terminals as ESC [ does, and a lone 0x9b byte does in
 * 8-bit ones. Both are escaped; other UTF-8 (here "\xc3\xa9") is kept. */
START_TEST(test_inspect_escapes_c1_controls)
{
    char a[128];
    snprintf(a, sizeof a, "%s/c1.h5", tmp);
    ck_assert_int_eq(cli("run --prompt-random 6 --max-new 1 --dump %s%s%s", a, "", ""), 0);
    set_root_attr(a, "engine", "x\xc2\x9b" "2Jy\x9b" "2J\xc3\xa9");
    int rc = cli("inspect %s%s%s", a, "", "");
    ck_assert_msg(rc == 0, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "engine    x\\u009b2Jy\\x9b2J\xc3\xa9"), "%s", out);
    ck_assert_msg(!strstr(out, "\xc2\x9b") && !strstr(out, "y\x9b"), "%s", out);
}
END_TEST

START_TEST(test_compare_text_escapes)
{
    char a[128], b[128];
    snprintf(a, sizeof a, "%s/a.h5", tmp);
    /* a file name the shell passes through with an escape in it */
    snprintf(b, sizeof b, "%s/b\x1b[2J.h5", tmp);
    ck_assert_int_eq(cli("run --prompt-random 6 --max-new 2 --dump %s%s%s", a, "", ""), 0);
    ck_assert_int_eq(cli("run --prompt-random 6 --max-new 2 --dump '%s'%s%s", b, "", ""), 0);
    set_root_attr(b, "status", "partial: stopped");
    int rc = cli("compare %s '%s'%s", a, b, "");
    ck_assert_msg(rc == 2 || rc == 0, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "b\\x1b[2J.h5 is partial"), "%s", out);
    assert_no_raw_control(out, "FAKE");
}
END_TEST

START_TEST(test_report_verdict_line_escapes)
{
    char a[128], b[128], json[128], mut[160], rep[160], args[512];
    snprintf(a, sizeof a, "%s/a.h5", tmp);
    snprintf(b, sizeof b, "%s/b.h5", tmp);
    snprintf(json, sizeof json, "%s/r.json", tmp);
    snprintf(mut, sizeof mut, "%s/mut.json", tmp);
    snprintf(rep, sizeof rep, "%s/rep", tmp);
    ck_assert_int_eq(cli("run --prompt-random 12 --max-new 3 --dump %s%s%s", a, "", ""), 0);
    ck_assert_int_eq(cli("run --prompt-random 12 --max-new 3 --engine chunked --chunk 5 "
                         "--inject window=4 --dump %s%s%s", b, "", ""), 0);
    snprintf(args, sizeof args, "sh -c '\"%s\" compare %s %s --json > %s'",
             getenv("KVDIFF_BIN") ? getenv("KVDIFF_BIN") : "./kvdiff", a, b, json);
    ck_assert_int_eq(system(args) >> 8, 1);
    ck_assert_ptr_null(load_with(json, "diagnosis", "summary", json_string(HOSTILE)));
    int rc = cli("report %s -o %s%s", mut, rep, "");
    ck_assert_msg(rc == 1, "exit %d\n%s", rc, out);
    assert_no_raw_control(out, "FAKE");
    ck_assert_msg(strstr(out, "\\x0aFAKE"), "%s", out);
}
END_TEST

/* A suite value reaches the failure block through the step's last line. */
START_TEST(test_suite_table_escapes)
{
    char s[128], keep[128];
    snprintf(s, sizeof s, "%s/s.suite", tmp);
    snprintf(keep, sizeof keep, "%s/work", tmp);
    put_file(s, "[c]\nmodel = ./no\x1b[2J\rFAKE\nprompt = random:8:1\nmax_new = 2\n"
                "a = --engine reference\nb = --engine reference\nexpect = identical\n");
    int rc = cli("suite %s --keep %s%s", s, keep, "");
    ck_assert_msg(rc == 1, "exit %d\n%s", rc, out);
    ck_assert_msg(strstr(out, "last line: ") && strstr(out, "no\\x1b[2J\\x0dFAKE"), "%s", out);
    assert_no_raw_control(out, "FAKE");
}
END_TEST

/* ------------------------------------------------------------------ */
/* A suite on a full disk                                               */

/* No file can grow (RLIMIT_FSIZE 0: as a full disk, every write fails;
 * log.txt cannot hold the reason either): the case still says why. */
START_TEST(test_suite_full_disk_reason)
{
    char s[128], keep[128], args[1024];
    snprintf(s, sizeof s, "%s/s.suite", tmp);
    snprintf(keep, sizeof keep, "%s/work", tmp);
    put_file(s, SUITE_TEXT);
    const char *bin = getenv("KVDIFF_BIN");
    /* detect_leaks=0: under make check-asan, libhdf5 1.10 leaks 264 bytes
     * when H5Fcreate fails, and LeakSanitizer's exit 1 and summary would
     * stand in for the step's own exit 2 and last line. */
    snprintf(args, sizeof args, "bash -c 'ulimit -f 0; ASAN_OPTIONS=detect_leaks=0 exec \"%s\" "
             "suite %s --keep %s'", bin ? bin : "./kvdiff", s, keep);
    FILE *p = popen(args, "r");
    ck_assert_ptr_nonnull(p);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 1, "status %d\n%s", st, out);
    ck_assert_msg(strstr(out, "ERROR same: engine A (kvdiff run) exited with 2"), "%s", out);
    ck_assert_msg(strstr(out, "last line: ") &&
                  strstr(out, "file size limit reached (ulimit -f)"), "%s", out);
}
END_TEST

/* ------------------------------------------------------------------ */
/* The helpers                                                          */

START_TEST(test_escape)
{
    char buf[64];
    ck_assert_str_eq(cli_escape(buf, sizeof buf, "a\x1b[2Jb\rc\td", false),
                     "a\\x1b[2Jb\\x0dc\td");
    ck_assert_str_eq(cli_escape(buf, sizeof buf, "l1\nl2\x7f", false), "l1\\x0al2\\x7f");
    ck_assert_str_eq(cli_escape(buf, sizeof buf, "l1\nl2", true), "l1\nl2");
    ck_assert_str_eq(cli_escape(buf, sizeof buf, "caf\xc3\xa9", false), "caf\xc3\xa9");
    /* cut at a whole escape, never half of one */
    ck_assert_str_eq(cli_escape(buf, 6, "ab\x01", false), "ab");
}
END_TEST

START_TEST(test_same_file)
{
    char a[128], b[160], c[128];
    snprintf(a, sizeof a, "%s/a", tmp);
    snprintf(b, sizeof b, "%s/./a", tmp);
    snprintf(c, sizeof c, "%s/c", tmp);
    ck_assert(outfile_same(a, b));        /* neither exists: resolved paths */
    ck_assert(!outfile_same(a, c));
    put_file(a, "x");
    ck_assert_int_eq(symlink(a, c), 0);
    ck_assert(outfile_same(a, c));        /* both exist: the inode */
    ck_assert(outfile_same(b, c));
}
END_TEST

Suite *paths_suite(void)
{
    Suite *s = suite_create("paths");
    TCase *t = tcase_create("inputs");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_dump_over_prompt_file);
    tcase_add_test(t, test_dump_over_model_file);
    tcase_add_test(t, test_dump_equals_dump_ref);
    tcase_add_test(t, test_junit_over_suite_file);
    tcase_add_test(t, test_junit_missing_folder_refused_first);
    suite_add_tcase(s, t);
    t = tcase_create("symlinks");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_junit_tmp_symlink_not_followed);
    tcase_add_test(t, test_report_symlinks_not_followed);
    suite_add_tcase(s, t);
    t = tcase_create("flags");
    tcase_add_test(t, test_exact_with_tolerance_refused);
    tcase_add_test(t, test_prefill_with_chunked_refused);
    suite_add_tcase(s, t);
    t = tcase_create("small inputs");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_config_fifo_refused);
    tcase_add_test(t, test_tokenizer_fifo_refused);
    tcase_add_test(t, test_prompt_files_fifo_refused);
    tcase_add_test(t, test_tokenizer_device_and_size_refused);
    tcase_add_test(t, test_run_model_fifo_refused);
    suite_add_tcase(s, t);
    t = tcase_create("report json");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_report_json_impossible_values);
    suite_add_tcase(s, t);
    t = tcase_create("prompt files");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_prompt_file_not_echoed);
    suite_add_tcase(s, t);
    t = tcase_create("control characters");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_inspect_escapes_attributes);
    tcase_add_test(t, test_gen_tmp_symlinks_not_followed);
    tcase_add_test(t, test_index_fifo_refused);
    tcase_add_test(t, test_report_suite_recorder_fifos_refused);
    tcase_add_test(t, test_inspect_escapes_c1_controls);
    tcase_add_test(t, test_compare_text_escapes);
    tcase_add_test(t, test_report_verdict_line_escapes);
    tcase_add_test(t, test_suite_table_escapes);
    suite_add_tcase(s, t);
    t = tcase_create("full disk");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_suite_full_disk_reason);
    suite_add_tcase(s, t);
    t = tcase_create("helpers");
    tcase_add_checked_fixture(t, tmp_setup, tmp_teardown);
    tcase_add_test(t, test_escape);
    tcase_add_test(t, test_same_file);
    suite_add_tcase(s, t);
    return s;
}
