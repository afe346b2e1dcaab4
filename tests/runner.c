/* runner.c — runs every Check suite found in tests/ (the list is generated
 * by the Makefile into suites.inc). Forked tests: a crash is a failure.
 * Prints each failure, then Check's summary as the closing line. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>

#define SUITE(fn) Suite *fn(void);
#include "suites.inc"
#undef SUITE

int main(void)
{
    /* Engine tests run whole models: give them room (Check's default is 4 s). */
    setenv("CK_DEFAULT_TIMEOUT", "300", 0);
    /* Timeouts are hang guards, not speed checks: a machine busy with
     * other work (or a sanitizer build) may run every test several times
     * slower, and that must not fail one. */
    setenv("CK_TIMEOUT_MULTIPLIER", "5", 0);
    SRunner *sr = srunner_create(NULL);
#define SUITE(fn) srunner_add_suite(sr, fn());
#include "suites.inc"
#undef SUITE
    srunner_run_all(sr, CK_SILENT);
    TestResult **fails = srunner_failures(sr);
    int nf = srunner_ntests_failed(sr);
    for (int i = 0; i < nf; i++)
        printf("FAIL %s:%d: %s: %s\n", tr_lfile(fails[i]), tr_lno(fails[i]),
               tr_tcname(fails[i]), tr_msg(fails[i]));
    free(fails);
    fflush(stdout);
    srunner_print(sr, CK_MINIMAL);
    srunner_free(sr);
    return nf == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
