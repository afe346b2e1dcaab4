/* check_tokens.c — token-id list parsing, good and bad input. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/tokens.h"

static int parse(const char *text, int vocab, int32_t **ids, int *n, kv_err *e)
{
    return tokens_parse(text, strlen(text), "prompt.txt", vocab, ids, n, e);
}

START_TEST(test_separators)
{
    int32_t *ids;
    int n;
    kv_err e;
    ck_assert_int_eq(parse(" 5,17 ,42\n\t7\r\n", 100, &ids, &n, &e), 0);
    ck_assert_int_eq(n, 4);
    ck_assert_int_eq(ids[0], 5);
    ck_assert_int_eq(ids[1], 17);
    ck_assert_int_eq(ids[2], 42);
    ck_assert_int_eq(ids[3], 7);
    free(ids);
}
END_TEST

START_TEST(test_many_tokens_grow)
{
    char buf[20000] = "";
    for (int i = 0; i < 2000; i++)
        sprintf(buf + strlen(buf), "%d ", i % 300);
    int32_t *ids;
    int n;
    kv_err e;
    ck_assert_int_eq(parse(buf, 300, &ids, &n, &e), 0);
    ck_assert_int_eq(n, 2000);
    ck_assert_int_eq(ids[1999], 1999 % 300);
    free(ids);
}
END_TEST

static void expect_error(const char *text, int vocab, const char *needle)
{
    int32_t *ids = NULL;
    int n = 0;
    kv_err e = {{0}};
    ck_assert_int_eq(parse(text, vocab, &ids, &n, &e), -1);
    ck_assert_ptr_null(ids);
    ck_assert_msg(strstr(e.msg, "prompt.txt") != NULL, "no file name in: %s", e.msg);
    ck_assert_msg(strstr(e.msg, needle) != NULL, "expected '%s' in: %s", needle, e.msg);
    ck_assert_ptr_null(strchr(e.msg, '\n'));
}

START_TEST(test_bad_input)
{
    expect_error("", 10, "no token ids");
    expect_error(" ,\n", 10, "no token ids");
    expect_error("1 2 x3", 10, "item 3 'x3' is not a token id");
    expect_error("1 -2", 10, "item 2 '-2' is not a token id");
    expect_error("1 2.5", 10, "not a token id");
    expect_error("3 10", 10, "item 2: token id 10 is outside the vocabulary (0..9)");
    expect_error("99999999999999999999999", 0, "outside the vocabulary");
}
END_TEST

START_TEST(test_file)
{
    char dir[] = "/tmp/kvtokXXXXXX", path[64];
    ck_assert_ptr_nonnull(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/p.txt", dir);
    FILE *f = fopen(path, "w");
    fputs("76 253 34\n", f);
    fclose(f);
    int32_t *ids;
    int n;
    kv_err e;
    ck_assert_int_eq(tokens_load(path, 256, &ids, &n, &e), 0);
    ck_assert_int_eq(n, 3);
    ck_assert_int_eq(ids[1], 253);
    free(ids);
    ck_assert_int_eq(tokens_load(path, 100, &ids, &n, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, path));
    remove(path);
    ck_assert_int_eq(tokens_load(path, 100, &ids, &n, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "cannot open"));
    rmdir(dir);
}
END_TEST

Suite *tokens_suite(void)
{
    Suite *s = suite_create("tokens");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, test_separators);
    tcase_add_test(tc, test_many_tokens_grow);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_file);
    suite_add_tcase(s, tc);
    return s;
}
