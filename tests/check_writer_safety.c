/* check_writer_safety.c — what the dump writer promises when things go
 * wrong around it: a second writer of the same path is refused and the
 * first one's file stays sound; a file replaced under a writer is not
 * marked complete. */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include "dump/dump.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Two writers of one path                                              */

/* Starts a long recorded run writing path; returns once it is decoding
 * (the writer locks the path before writing anything). */
static pid_t start_long_run(const char *path)
{
    const char *bin = getenv("KVDIFF_BIN");
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        dup2(devnull, 1);
        dup2(devnull, 2);
        execl(bin ? bin : "./kvdiff", "kvdiff", "run", "--model", "tiny-gemma3", "--prompt-random",
              "96", "--max-new", "4000", "--ignore-eos", "--dump", path, (char *)NULL);
        _exit(127);
    }
    /* Decides only when to go on; nothing is asserted about time. The
     * prompt's rows are about 2 MB. */
    struct stat sb;
    for (int i = 0; i < 4000; i++) {
        if (stat(path, &sb) == 0 && sb.st_size > (4 << 20))
            break;
        usleep(5000);
    }
    return pid;
}

START_TEST(test_second_writer_is_refused)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/shared.h5", dir);
    pid_t first = start_long_run(path);
    /* Held still while the second run tries, so it is surely running. */
    int status;
    ck_assert_int_eq(kill(first, SIGSTOP), 0);
    ck_assert_int_eq(waitpid(first, &status, WUNTRACED), first);
    ck_assert_msg(WIFSTOPPED(status), "the first run ended before the second started");
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 10 --max-new 2 --dump %s",
             path);
    int rc = test_run_cli(args, out, sizeof out);
    kill(first, SIGCONT);
    ck_assert_msg(rc == 2, "second writer: exit %d: %s", rc, out);
    ck_assert_msg(strstr(out, path) && strstr(out, "another kvdiff is writing this file"), "%s",
                  out);
    ck_assert_msg(strchr(out, '\n') && strchr(out, '\n')[1] == 0, "not one line: %s", out);
    /* The first run goes on undisturbed: stopped with Ctrl-C, its file is
     * sound and says so. */
    ck_assert_int_eq(kill(first, SIGINT), 0);
    ck_assert_int_eq(waitpid(first, &status, 0), first);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 2, "status %d", status);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "inspect %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "status    partial: interrupted by SIGINT"), "%s", out);
    ck_assert_msg(strstr(out, "(prompt 96)"), "%s", out);
    /* And once it has ended, the path is free again. */
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 10 --max-new 2 --dump %s",
             path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* In one process too: a second dump_create of a path being written
 * fails, and leaves the first writer's file alone. */
START_TEST(test_second_writer_in_process)
{
    char dir[64], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/twice.h5", dir);
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_msg(config_preset("tiny-llama", &cfg, &e) == 0, "%s", e.msg);
    dump_opts o;
    dump_opts_default(&o);
    dump_meta meta = {.engine = "test", .cfg = &cfg, .max_positions = 4, .prompt_length = 4};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    struct stat before, after;
    ck_assert_int_eq(stat(path, &before), 0);
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, "another kvdiff is writing this file"), "%s", e.msg);
    ck_assert_int_eq(stat(path, &after), 0);
    ck_assert_int_eq(before.st_ino, after.st_ino);
    ck_assert_int_eq(before.st_size, after.st_size);
    ck_assert_msg(dump_close(w, NULL, &e) == 0, "%s", e.msg);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert(dump_is_complete(f));
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

/* A file put in the writer's place while it ran (another program's
 * rename) is not the writer's to mark complete. */
START_TEST(test_replaced_file_keeps_its_status)
{
    char dir[64], path[128], other[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/mine.h5", dir);
    snprintf(other, sizeof other, "%s/other.h5", dir);
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_msg(config_preset("tiny-llama", &cfg, &e) == 0, "%s", e.msg);
    dump_opts o;
    dump_opts_default(&o);
    dump_meta meta = {.engine = "test", .cfg = &cfg, .max_positions = 4, .prompt_length = 4};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    dump_writer *w2 = dump_create(other, &meta, &o, &e);
    ck_assert_msg(w2 != NULL, "%s", e.msg);
    ck_assert_int_eq(dump_close(w2, "made by someone else", &e), 0);
    ck_assert_int_eq(rename(other, path), 0);
    ck_assert_int_eq(dump_close(w, NULL, &e), -1);
    ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, "replaced"), "%s", e.msg);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_str_eq(dump_attr(f, "status"), "partial: made by someone else");
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

Suite *writer_safety_suite(void)
{
    Suite *s = suite_create("writer_safety");
    TCase *tc = tcase_create("safety");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_second_writer_is_refused);
    tcase_add_test(tc, test_second_writer_in_process);
    tcase_add_test(tc, test_replaced_file_keeps_its_status);
    suite_add_tcase(s, tc);
    return s;
}
