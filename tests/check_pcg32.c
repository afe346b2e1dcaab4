/* check_pcg32.c — PCG32 against the published reference outputs. */
#include <check.h>
#include <math.h>

#include "model/pcg32.h"

/* pcg32-demo / pcg-c-basic: pcg32_srandom_r(&rng, 42u, 54u), first outputs. */
START_TEST(test_reference_outputs)
{
    static const uint32_t expect[6] = {0xa15c02b7u, 0x7b47f409u, 0xba1d3330u,
                                       0x83d2f293u, 0xbfa4784bu, 0xcbed606eu};
    pcg32 r;
    pcg32_seed(&r, 42u, 54u);
    ck_assert_uint_eq(r.state, 1753877967969059832ull);
    ck_assert_uint_eq(r.inc, 109u);
    for (int i = 0; i < 6; i++)
        ck_assert_uint_eq(pcg32_next(&r), expect[i]);
}
END_TEST

START_TEST(test_bounded_in_range_and_covers)
{
    pcg32 r;
    pcg32_seed(&r, 7, 1);
    int seen[6] = {0};
    for (int i = 0; i < 6000; i++) {
        uint32_t v = pcg32_bounded(&r, 6);
        ck_assert_uint_lt(v, 6);
        seen[v]++;
    }
    for (int i = 0; i < 6; i++)
        ck_assert_int_gt(seen[i], 800);
}
END_TEST

START_TEST(test_unit_uniform_moments)
{
    pcg32 r;
    pcg32_seed(&r, 3, 3);
    double s = 0, s2 = 0;
    const int n = 200000;
    for (int i = 0; i < n; i++) {
        double v = pcg32_unit_uniform(&r);
        ck_assert(fabs(v) < 1.7321);
        s += v;
        s2 += v * v;
    }
    ck_assert(fabs(s / n) < 0.01);
    ck_assert(fabs(s2 / n - 1.0) < 0.01);
}
END_TEST

START_TEST(test_double_range)
{
    pcg32 r;
    pcg32_seed(&r, 11, 5);
    for (int i = 0; i < 10000; i++) {
        double d = pcg32_double(&r);
        ck_assert(d >= 0.0 && d < 1.0);
    }
}
END_TEST

Suite *pcg32_suite(void)
{
    Suite *s = suite_create("pcg32");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_reference_outputs);
    tcase_add_test(tc, test_bounded_in_range_and_covers);
    tcase_add_test(tc, test_unit_uniform_moments);
    tcase_add_test(tc, test_double_range);
    suite_add_tcase(s, tc);
    return s;
}
