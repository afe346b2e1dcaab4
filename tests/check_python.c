/* check_python.c — the Python recorder (python/kvdiff_record) under its own
 * unittest suite (python/tests): dumps it writes must pass `kvdiff
 * validate` and compare with kvdiff's reference; bad input must raise a
 * clear RecorderError; the PyTorch hooks on a small torch model must come
 * out identical within drift. Run here so `make test` runs it and Check's
 * summary stays the closing line. KVDIFF_PYTHON picks the interpreter
 * (the Makefile passes the one Debian's python3-numpy/h5py/torch serve). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

START_TEST(test_python_recorder_unittests)
{
    const char *py = getenv("KVDIFF_PYTHON");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s -m unittest discover -s python/tests 2>&1",
             py && *py ? py : "python3");
    FILE *p = popen(cmd, "r");
    ck_assert_ptr_nonnull(p);
    static char out[1 << 16];
    size_t len = fread(out, 1, sizeof out - 1, p);
    out[len] = 0;
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0)
        ;
    int st = pclose(p);
    /* The unittest report is the diagnosis: print it when it failed. */
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
        fprintf(stderr, "%s\n", out);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "python recorder tests failed (status %d); report above", st);
    ck_assert_ptr_nonnull(strstr(out, "\nOK"));
}
END_TEST

Suite *python_suite(void)
{
    Suite *s = suite_create("python");
    TCase *tc = tcase_create("recorder");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_python_recorder_unittests);
    suite_add_tcase(s, tc);
    return s;
}
