/* check_dump_cli.c — recording as a user does it: `kvdiff run --dump`,
 * `inspect`, `validate`, and a real run stopped by Ctrl-C or killed with
 * SIGKILL leaving a readable file marked partial. */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <hdf5.h>

#include "dump/dump.h"
#include "testutil.h"

static char out[1 << 16];

START_TEST(test_dump_inspect_validate)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --engine chunked --chunk 7 "
             "--prompt-random 40 --seed 2 --max-new 8 --dump %s/chk.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "dump      "));
    snprintf(args, sizeof args, "inspect %s/chk.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "status    complete"));
    ck_assert_ptr_nonnull(strstr(out, "engine    chunked"));
    ck_assert_ptr_nonnull(strstr(out, "\"chunk\":7"));
    ck_assert_ptr_nonnull(strstr(out, "tokens    48 (prompt 40)"));
    ck_assert_ptr_nonnull(strstr(out, "layer 5"));
    /* Logits only where generation computes them: the last prompt row on. */
    ck_assert_msg(strstr(out, "output    lse and top-8 logits, positions 39..46"), "%s", out);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --max-new 8 "
             "--dump %s/all.h5 --dump-logits", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "inspect %s/all.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "output    lse and top-8 logits, positions 0..46"), "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "model     logits positions 0..46"));
    snprintf(args, sizeof args, "validate %s/chk.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "conforms"));
    /* Selection and fingerprint. */
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --max-new 4 "
             "--dump %s/sel.h5 --dump-layers 2:3 --dump-positions 10:20 --dump-stages k,v,x_out",
             dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "inspect %s/sel.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "layer 2   positions 10..20: k v x_out"));
    ck_assert_ptr_null(strstr(out, "layer 1 "));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 40 --max-new 4 "
             "--dump %s/fp.h5 --fingerprint", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "inspect %s/fp.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_nonnull(strstr(out, "mode      fingerprint"));
    test_rmtree(dir);
}
END_TEST

START_TEST(test_dump_bad_input)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    /* Not HDF5, empty, truncated. */
    snprintf(path, sizeof path, "%s/junk.h5", dir);
    FILE *f = fopen(path, "w");
    fputs("this is not an HDF5 file at all\n", f);
    fclose(f);
    snprintf(args, sizeof args, "inspect %s", path);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_msg(strstr(out, "junk.h5") && strstr(out, "not an HDF5 file"), "%s", out);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-random 30 --max-new 4 "
             "--dump %s/whole.h5", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 0);
    snprintf(path, sizeof path, "%s/whole.h5", dir);
    struct stat sb;
    ck_assert_int_eq(stat(path, &sb), 0);
    ck_assert_int_eq(truncate(path, sb.st_size / 2), 0);
    snprintf(args, sizeof args, "inspect %s", path);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "whole.h5"));
    /* Unwritable output: a folder that does not exist; a folder itself. */
    ck_assert_int_eq(test_run_cli("run --max-new 2 --dump /nonexistent-dir/x.h5", out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "/nonexistent-dir/x.h5"));
    snprintf(args, sizeof args, "run --max-new 2 --dump %s", dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 2);
    ck_assert_int_eq(test_run_cli("run --fingerprint", out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "need --dump"));
    ck_assert_int_eq(test_run_cli("run --dump x.h5 --dump-layers 3:1", out, sizeof out), 2);
    ck_assert_int_eq(test_run_cli("run --dump x.h5 --dump-stages q,bogus", out, sizeof out), 2);
    ck_assert_ptr_nonnull(strstr(out, "bogus"));
    ck_assert_int_eq(test_run_cli("inspect", out, sizeof out), 2);
    test_rmtree(dir);
}
END_TEST

/* Starts a long recorded run, waits until rows are on disk, sends sig. */
static void run_and_signal(const char *path, int sig, int *status)
{
    const char *bin = getenv("KVDIFF_BIN");
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int devnull = open("/dev/null", 1);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execl(bin ? bin : "./kvdiff", "kvdiff", "run", "--model", "tiny-gemma3", "--prompt-random",
              "4000", "--prefill", "token", "--max-new", "90", "--ignore-eos", "--dump", path,
              (char *)NULL);
        _exit(127);
    }
    /* Wait until several blocks of rows are on disk (the first flush
     * alone allocates ~1.4 MB of chunks); this only decides when to pull
     * the plug, nothing is asserted about time. */
    struct stat sb;
    while (stat(path, &sb) != 0 || sb.st_size <= (8 << 20)) {
        ck_assert_msg(waitpid(pid, status, WNOHANG) == 0, "the run ended before it wrote 8 MB");
        usleep(5000);
    }
    kill(pid, sig);
    ck_assert_int_eq(waitpid(pid, status, 0), pid);
}

/* Files on which libhdf5 itself loops forever or crashes (corrupt global
 * heaps under variable-length strings, found by the dump fuzz target):
 * every verb that reads them ends with a one-line error. */
START_TEST(test_libhdf5_hang_is_an_error)
{
    static const char *const verbs[] = {"inspect %s", "validate %s", "compare %s %s",
                                        "report %s %s -o /nonexistent-dir/never"};
    static const char *const files[] = {"tests/data/damaged/vlen-heap-loop.h5",
                                        "tests/data/damaged/vlen-heap-crash.h5"};
    const char *bad = files[_i];
    char args[512];
    setenv("KVDIFF_HDF5_GUARD_SECONDS", "1", 1);
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
        snprintf(args, sizeof args, verbs[i], bad, bad);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s: %s", args, out);
        ck_assert_msg(strstr(out, bad) && strstr(out, "the HDF5 library") &&
                          strstr(out, "(a damaged file") && strchr(out, '\n')[1] == 0,
                      "%s: %s", args, out);
    }
    unsetenv("KVDIFF_HDF5_GUARD_SECONDS");
}
END_TEST

START_TEST(test_ctrl_c_leaves_partial_dump)
{
    /* A run a signal stopped closes its dump "partial: interrupted by SIG"
     * and exits as shells expect, 128 + the signal: SIGINT (Ctrl-C),
     * SIGTERM, SIGHUP (the terminal closed). */
    static const struct {
        int sig;
        const char *name;
    } sigs[] = {{SIGINT, "SIGINT"}, {SIGTERM, "SIGTERM"}, {SIGHUP, "SIGHUP"}};
    char dir[64], path[128], args[256], want[64];
    int status;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) {
        snprintf(path, sizeof path, "%s/%s.h5", dir, sigs[i].name);
        run_and_signal(path, sigs[i].sig, &status);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 128 + sigs[i].sig,
                      "%s: status %d", sigs[i].name, status);
        snprintf(args, sizeof args, "inspect %s", path);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        snprintf(want, sizeof want, "status    partial: interrupted by %s", sigs[i].name);
        ck_assert_msg(strstr(out, want), "%s", out);
    }
    /* what it holds is what was computed up to the signal */
    snprintf(path, sizeof path, "%s/SIGINT.h5", dir);
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert(!dump_is_complete(f));
    dump_dataset_info di = dump_stage_info(f, 5, STAGE_X_OUT);
    ck_assert(di.present);
    ck_assert_int_gt(di.rows, 64);
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_kill_9_leaves_readable_dump)
{
    char dir[64], path[128], args[256];
    int status;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/killed.h5", dir);
    run_and_signal(path, SIGKILL, &status);
    ck_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    snprintf(args, sizeof args, "inspect %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    /* no writer holds the file: it is not said to be running */
    ck_assert_msg(strstr(out, "status    partial: its writer ended without closing it"), "%s",
                  out);
    ck_assert_msg(strstr(out, "(prompt 4000)"), "%s", out);
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    dump_dataset_info di = dump_stage_info(f, 0, STAGE_X_IN);
    ck_assert(di.present);
    ck_assert_int_gt(di.rows, 0);
    /* The rows that made it are whole: read the last one. */
    float row[64];
    ck_assert_msg(dump_read_rows(f, 0, STAGE_X_IN, di.rows - 1, 1, row, &e) == 0, "%s", e.msg);
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

static int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* A full disk (here: a file size limit) is a clear error, and the file
 * never says complete. */
START_TEST(test_file_size_limit)
{
    char dir[64], args[512], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/small.h5", dir);
    const char *bin = getenv("KVDIFF_BIN") ? getenv("KVDIFF_BIN") : "./kvdiff";
    snprintf(args, sizeof args, "sh -c 'ulimit -f 256; exec %s run --model tiny-gemma3 "
             "--prompt-random 2000 --max-new 2 --dump %s'", bin, path);
    /* The limit must apply to kvdiff alone: run it under its own shell. */
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s 2>&1", args);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t len = fread(out, 1, sizeof out - 1, p);
    out[len] = 0;
    int st = pclose(p);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d: %s", st, out);
    ck_assert_msg(strstr(out, "small.h5") && strstr(out, "file size limit reached (ulimit -f)") &&
                  count_lines(out) == 1, "%s", out);
    /* what was written stays, said partial, and not "running": nothing is */
    snprintf(args, sizeof args, "inspect %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "status    partial: its writer ended without closing it"), "%s",
                  out);
    test_rmtree(dir);
}
END_TEST

/* One line and exit 2 for every verb that writes, at any point of its
 * writing: SIGXFSZ killed run while the dump was created (exit 153), a
 * failed last flush crashed at exit (libhdf5's handler, exit 139), report
 * said "out of memory"; a folder or temporary file is never left. */
static int limited(const char *limit_kib, const char *verb, char *buf, size_t n)
{
    const char *bin = getenv("KVDIFF_BIN") ? getenv("KVDIFF_BIN") : "./kvdiff";
    char cmd[1024];
    /* the limit applies to kvdiff alone; bash's ulimit -f counts KiB */
    snprintf(cmd, sizeof cmd, "bash -c 'ulimit -f %s; exec \"%s\" %s' 2>&1", limit_kib, bin,
             verb);
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    size_t len = fread(buf, 1, n - 1, p);
    buf[len] = 0;
    const int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

START_TEST(test_file_size_limit_every_writer)
{
    char dir[64], verb[512], ls[256];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(verb, sizeof verb, "run --model tiny-gemma3 --dump %s/ref.h5", dir);
    ck_assert_msg(test_run_cli(verb, out, sizeof out) == 0, "%s", out);
    snprintf(verb, sizeof verb, "run --model tiny-gemma3 --engine chunked --dump %s/test.h5", dir);
    ck_assert_msg(test_run_cli(verb, out, sizeof out) == 0, "%s", out);
    struct {
        const char *limit, *fmt, *left;
    } c[] = {
        {"8", "run --model tiny-gemma3 --dump %s/d.h5", "d.h5"},
        {"64", "gen --preset tiny-gemma3 -o %s/folder", "folder"},
        {"64", "gen --preset tiny-gemma3 --gguf %s/m.gguf", "m.gguf"},
        {"4", "report %s/ref.h5 %s/test.h5 -o %s/rep", NULL},
    };
    for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
        snprintf(verb, sizeof verb, c[i].fmt, dir, dir, dir);
        const int rc = limited(c[i].limit, verb, out, sizeof out);
        ck_assert_msg(rc == 2 && count_lines(out) == 1 &&
                          strstr(out, "file size limit reached (ulimit -f)"),
                      "%s: exit %d:\n%s", verb, rc, out);
        if (c[i].left) {
            snprintf(ls, sizeof ls, "%s/%s", dir, c[i].left);
            ck_assert_msg(access(ls, F_OK) != 0, "%s left %s", verb, ls);
        }
        /* no temporary file (".NAME.XXXXXXXXXX", gnuplot's .draw.XXXXXX)
         * and no empty file (a plot cut short) anywhere in the folder */
        snprintf(ls, sizeof ls, "find %s -name '.*' ! -name . | grep -q .", dir);
        ck_assert_msg(system(ls) != 0, "%s left a temporary file", verb);
        snprintf(ls, sizeof ls, "find %s -type f -size 0 | grep -q .", dir);
        ck_assert_msg(system(ls) != 0, "%s left an empty file", verb);
    }
    test_rmtree(dir);
}
END_TEST

/* An engine that refuses its options (an injection the model cannot have,
 * in run and in bisect) leaves no dump: none created, none truncated. */
START_TEST(test_refused_run_writes_no_dump)
{
    char dir[64], args[512], path[128], old[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/new.h5", dir);
    snprintf(old, sizeof old, "%s/old.h5", dir);
    FILE *f = fopen(old, "w");
    ck_assert_ptr_nonnull(f);
    fputs("an earlier dump", f);
    fclose(f);
    const char *const fmt[] = {
        "run --model tiny-llama --prompt-random 12 --engine chunked --inject window=4 --dump %s",
        "run --model tiny-llama --prompt-random 12 --engine chunked --inject window=4 --compare "
        "--dump %s"};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 2; i++) {
            char cmd[256];
            snprintf(cmd, sizeof cmd, fmt[k], i ? old : path);
            snprintf(args, sizeof args, "%s", cmd);
            ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s: %s", args, out);
            ck_assert_msg(strstr(out, "no sliding-window layer"), "%s", out);
        }
    struct stat sb;
    ck_assert_int_ne(stat(path, &sb), 0);
    ck_assert_int_eq(stat(old, &sb), 0);
    ck_assert_int_eq(sb.st_size, 15);
    test_rmtree(dir);
}
END_TEST

/* validate says "conforms" only for what every reader reads: /tokens
 * extended (unwritten) to 2^33 entries is a violation there and an error
 * in compare, both naming the limit, never "out of memory". */
START_TEST(test_validate_refuses_what_readers_refuse)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/big.h5", dir);
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-random 6 --max-new 2 --dump %s",
             path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert_int_ge(f, 0);
    hid_t d = H5Dopen2(f, "tokens", H5P_DEFAULT);
    hsize_t n = 1ULL << 33;
    ck_assert_int_ge(H5Dset_extent(d, &n), 0);
    H5Dclose(d);
    H5Fclose(f);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "/tokens claims 8589934592 positions; a dump holds at most "
                              "67108864") && !strstr(out, "conforms"), "%s", out);
    snprintf(args, sizeof args, "compare %s %s", path, path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 2, "%s", out);
    ck_assert_msg(strstr(out, "/tokens claims 8589934592 positions") &&
                      !strstr(out, "out of memory"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* A file name with ESC, CR and LF in it: every line a terminal or a
 * Markdown viewer shows carries it escaped, never raw. */
START_TEST(test_control_characters_escaped)
{
    char dir[64], path[160], args[1024], rep[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/a\033[31mRED\rb\nc.h5", dir);
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-random 6 --max-new 2 "
             "--dump '%s'", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "validate '%s'", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "a\\x1b[31mRED\\x0db\\x0ac.h5: conforms") &&
                      !strchr(out, '\033') && !strchr(out, '\r'), "%s", out);
    ck_assert_int_eq(strchr(out, '\n')[1], 0);   /* one line */
    snprintf(rep, sizeof rep, "%s/rp", dir);
    snprintf(args, sizeof args, "report '%s' '%s' -o %s", path, path, rep);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    static const char *const pages[] = {"summary.md", "index.html"};
    for (int i = 0; i < 2; i++) {
        char p[256];
        snprintf(p, sizeof p, "%s/%s", rep, pages[i]);
        FILE *f = fopen(p, "rb");
        ck_assert_ptr_nonnull(f);
        int c, esc = 0, cr = 0;
        while ((c = fgetc(f)) != EOF) {
            esc += c == 033;
            cr += c == '\r';
        }
        fclose(f);
        ck_assert_msg(esc == 0 && cr == 0, "%s: %d ESC, %d CR", pages[i], esc, cr);
    }
    test_rmtree(dir);
}
END_TEST

Suite *dump_cli_suite(void)
{
    Suite *s = suite_create("dump_cli");
    TCase *tc = tcase_create("binary");
    tcase_add_test(tc, test_dump_inspect_validate);
    tcase_add_test(tc, test_dump_bad_input);
    tcase_add_loop_test(tc, test_libhdf5_hang_is_an_error, 0, 2);
    tcase_add_test(tc, test_ctrl_c_leaves_partial_dump);
    tcase_add_test(tc, test_kill_9_leaves_readable_dump);
    tcase_add_test(tc, test_file_size_limit);
    tcase_add_test(tc, test_file_size_limit_every_writer);
    tcase_add_test(tc, test_refused_run_writes_no_dump);
    tcase_add_test(tc, test_validate_refuses_what_readers_refuse);
    tcase_add_test(tc, test_control_characters_escaped);
    suite_add_tcase(s, tc);
    return s;
}
