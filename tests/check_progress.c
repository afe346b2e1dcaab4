/* check_progress.c — what a person at a terminal sees while long work runs.
 *
 * The binary runs with its stderr (and stdout) on a pseudo-terminal, as in
 * an interactive shell, and the bytes it draws are read back: a prompt
 * prefilled in one batch moves the bar layer by layer, bisect names each
 * of its four passes, generating or building a preset's weights shows a
 * bar over them. Off a terminal nothing of this is drawn (check_suite.c
 * covers the line's layout and the silence on pipes). */
#define _XOPEN_SOURCE 600
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

static char out[1 << 18];

/* Runs `kvdiff ARGS` with stdout and stderr on a new pseudo-terminal;
 * everything it writes lands in buf (NUL-terminated, cut to n). Returns
 * the exit code, or -1 when no terminal could be had. */
static int run_on_tty(const char *args, char *buf, size_t n)
{
    int master = posix_openpt(O_RDWR | O_NOCTTY);
    if (master < 0 || grantpt(master) < 0 || unlockpt(master) < 0)
        return -1;
    const char *slave_name = ptsname(master);
    if (!slave_name)
        return -1;
    const char *bin = getenv("KVDIFF_BIN");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "exec %s %s", bin ? bin : "./kvdiff", args);
    pid_t pid = fork();
    if (pid == 0) {
        int slave = open(slave_name, O_RDWR);
        if (slave < 0)
            _exit(127);
        dup2(slave, 1);
        dup2(slave, 2);
        close(slave);
        close(master);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    size_t len = 0;
    for (;;) {
        char tmp[4096];
        ssize_t r = read(master, tmp, sizeof tmp);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)   /* EIO once the child closed its side */
            break;
        size_t take = (size_t)r < n - 1 - len ? (size_t)r : n - 1 - len;
        memcpy(buf + len, tmp, take);
        len += take;
    }
    buf[len] = 0;
    close(master);
    int st;
    if (waitpid(pid, &st, 0) < 0)
        return -1;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* A 40-token prompt prefilled at once on 6 layers: before the last layer
 * finishes, the bar shows part of the batch (13 = 40 x 2/6 rows after the
 * second layer), not 0 until all 40 arrive at once. */
START_TEST(test_prefill_moves_per_layer)
{
    int rc = run_on_tty("run --model tiny-gemma3 --prompt-random 40 --max-new 2 --ignore-eos",
                        out, sizeof out);
    ck_assert_msg(rc == 0, "%d: %s", rc, out);
    ck_assert_msg(strstr(out, "] 13/42 positions"), "%s", out);
    ck_assert_msg(strstr(out, "] 40/42 positions"), "%s", out);
    ck_assert_msg(strstr(out, " eta "), "%s", out);
}
END_TEST

/* bisect's four runs each name their phase on the bar. */
START_TEST(test_bisect_phases)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args,
             "bisect --model tiny-gemma3 --prompt-random 40 --seed 4 --max-new 16 --ignore-eos "
             "--engine chunked --chunk 5 --inject window=4 -o %s/b", dir);
    int rc = run_on_tty(args, out, sizeof out);
    ck_assert_msg(rc == 1, "%d: %s", rc, out);
    static const char *const phases[] = {"1/4 ref fingerprints [", "2/4 test fingerprints [",
                                          "3/4 ref rows [", "4/4 test rows ["};
    for (int i = 0; i < 4; i++)
        ck_assert_msg(strstr(out, phases[i]), "%s missing: %s", phases[i], out);
    /* The neighbourhood runs count to its last position (12), not the
     * context (56). */
    ck_assert_msg(strstr(out, "/13 positions"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* Writing a preset and building one to run both show a bar over the
 * weights, tensor by tensor. */
START_TEST(test_weights_bar)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-llama -o %s/m", dir);
    int rc = run_on_tty(args, out, sizeof out);
    ck_assert_msg(rc == 0, "%d: %s", rc, out);
    ck_assert_msg(strstr(out, "writing [") && strstr(out, "k weights"), "%s", out);
    ck_assert_msg(strstr(out, "model.layers.3."), "%s", out);
    rc = run_on_tty("run --model tiny-llama --prompt-random 4 --max-new 1", out, sizeof out);
    ck_assert_msg(rc == 0, "%d: %s", rc, out);
    ck_assert_msg(strstr(out, "weights [") && strstr(out, "k weights") &&
                      strstr(out, "model.layers.3."), "%s", out);
    /* a GGUF export of a preset, and of a folder, too (GGUF tensor names) */
    snprintf(args, sizeof args, "gen --preset tiny-llama --gguf %s/p.gguf", dir);
    rc = run_on_tty(args, out, sizeof out);
    ck_assert_msg(rc == 0, "%d: %s", rc, out);
    ck_assert_msg(strstr(out, "GGUF [") && strstr(out, "k weights") && strstr(out, "blk.3."),
                  "%s", out);
    snprintf(args, sizeof args, "gen --from %s/m --gguf %s/f.gguf", dir, dir);
    rc = run_on_tty(args, out, sizeof out);
    ck_assert_msg(rc == 0 && strstr(out, "GGUF [") && strstr(out, "blk.3."), "%d: %s", rc, out);
    test_rmtree(dir);
}
END_TEST

Suite *progress_suite(void)
{
    Suite *s = suite_create("progress");
    TCase *tc = tcase_create("terminal");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_prefill_moves_per_layer);
    tcase_add_test(tc, test_bisect_phases);
    tcase_add_test(tc, test_weights_bar);
    suite_add_tcase(s, tc);
    return s;
}
