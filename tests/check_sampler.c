/* check_sampler.c — greedy ties, determinism, top-k / top-p limits. */
#include <check.h>
#include <math.h>

#include "model/sampler.h"

START_TEST(test_greedy_lowest_id_on_tie)
{
    float logits[5] = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
    sampler s;
    sampler_opts o = {.temperature = 0, .top_k = 0, .top_p = 1};
    kv_err e;
    ck_assert_int_eq(sampler_init(&s, &o, 1, 5, &e), 0);
    ck_assert_int_eq(sampler_pick(&s, logits), 1);
    float margin;
    ck_assert_int_eq(logits_argmax(logits, 5, &margin), 1);
    ck_assert(margin == 0.0f);
    sampler_free(&s);
}
END_TEST

START_TEST(test_same_seed_same_choices)
{
    float logits[50];
    for (int i = 0; i < 50; i++)
        logits[i] = sinf((float)i);
    sampler_opts o = {.temperature = 1.0, .top_k = 0, .top_p = 1};
    sampler a, b;
    kv_err e;
    sampler_init(&a, &o, 9, 50, &e);
    sampler_init(&b, &o, 9, 50, &e);
    int differ = 0;
    for (int i = 0; i < 200; i++) {
        int32_t x = sampler_pick(&a, logits), y = sampler_pick(&b, logits);
        ck_assert_int_eq(x, y);
        differ += x != logits_argmax(logits, 50, NULL);
    }
    ck_assert_int_gt(differ, 0); /* it really samples */
    sampler_free(&a);
    sampler_free(&b);
}
END_TEST

START_TEST(test_top_k_and_top_p_limit_choices)
{
    float logits[10] = {5, 4, 3, 2, 1, 0, -1, -2, -3, -4};
    kv_err e;
    sampler s;
    sampler_opts k2 = {.temperature = 5.0, .top_k = 2, .top_p = 1};
    sampler_init(&s, &k2, 3, 10, &e);
    for (int i = 0; i < 500; i++)
        ck_assert_int_le(sampler_pick(&s, logits), 1);
    sampler_free(&s);
    /* With T = 1 the top token has p ~ 0.63: top_p 0.5 keeps it alone. */
    sampler_opts p5 = {.temperature = 1.0, .top_k = 0, .top_p = 0.5};
    sampler_init(&s, &p5, 3, 10, &e);
    for (int i = 0; i < 200; i++)
        ck_assert_int_eq(sampler_pick(&s, logits), 0);
    sampler_free(&s);
}
END_TEST

Suite *sampler_suite(void)
{
    Suite *s = suite_create("sampler");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_greedy_lowest_id_on_tie);
    tcase_add_test(tc, test_same_seed_same_choices);
    tcase_add_test(tc, test_top_k_and_top_p_limit_choices);
    suite_add_tcase(s, tc);
    return s;
}
