/* check_dump_attrs.c — every stage dataset of a dump says what its columns
 * mean ("columns" and, where there are any, "units" string attributes), so h5dump and h5py
 * users need not open docs/dump-format.md: norm statistics are
 * mean,rms,absmax, .stats are l2,absmax, .hash the XXH3-64 of the row's
 * bytes, q/k/v their head layout. Full dumps (with row hashes) and
 * fingerprint dumps alike. */
#include <check.h>
#include <hdf5.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static char out[1 << 14];

/* The string attribute name of dataset path in file, into buf ("" when
 * absent). */
static const char *str_attr(hid_t file, const char *path, const char *name, char *buf, size_t n)
{
    buf[0] = 0;
    hid_t d = H5Dopen2(file, path, H5P_DEFAULT);
    ck_assert_msg(d >= 0, "%s missing", path);
    if (H5Aexists(d, name) > 0) {
        hid_t a = H5Aopen(d, name, H5P_DEFAULT);
        hid_t t = H5Aget_type(a);
        char *s = NULL;
        ck_assert(H5Tis_variable_str(t) > 0);
        ck_assert(H5Aread(a, t, &s) >= 0);
        snprintf(buf, n, "%s", s ? s : "");
        H5free_memory(s);
        H5Tclose(t);
        H5Aclose(a);
    }
    H5Dclose(d);
    return buf;
}

START_TEST(test_columns_described)
{
    char dir[64], args[512], path[128], v[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 8 --max-new 2 --dump "
             "%s/full.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 8 --max-new 2 "
             "--fingerprint --dump %s/fp.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);

    snprintf(path, sizeof path, "%s/full.h5", dir);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    ck_assert(f >= 0);
    ck_assert_str_eq(str_attr(f, "/layers/0/attn_norm_stats", "columns", v, sizeof v),
                     "mean,rms,absmax of the norm's input");
    ck_assert_str_eq(str_attr(f, "/layers/1/ffn_norm_stats", "columns", v, sizeof v),
                     "mean,rms,absmax of the norm's input");
    ck_assert_msg(strstr(str_attr(f, "/layers/0/q", "columns", v, sizeof v),
                         "4 heads x 32, head-major"), "%s", v);
    ck_assert_msg(strstr(str_attr(f, "/layers/0/k", "columns", v, sizeof v),
                         "2 KV heads x 32, head-major"), "%s", v);
    ck_assert_str_eq(str_attr(f, "/layers/0/v", "columns", v, sizeof v), "2 KV heads x 32, head-major");
    ck_assert_str_eq(str_attr(f, "/layers/0/attn_lse", "units", v, sizeof v), "nats (natural log)");
    ck_assert_msg(strstr(str_attr(f, "/layers/2/x_out", "columns", v, sizeof v),
                         "64 hidden dims"), "%s", v);
    ck_assert_str_eq(str_attr(f, "/layers/0/x_out.stats", "columns", v, sizeof v), "l2,absmax");
    ck_assert_str_eq(str_attr(f, "/layers/0/x_out.hash", "columns", v, sizeof v),
                     "XXH3-64 of the row's float32 bytes");
    H5Fclose(f);

    snprintf(path, sizeof path, "%s/fp.h5", dir);
    f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    ck_assert(f >= 0);
    ck_assert_msg(strstr(str_attr(f, "/layers/0/q.hash", "columns", v, sizeof v), "XXH3-64"),
                  "%s", v);
    ck_assert_str_eq(str_attr(f, "/layers/0/q.stats", "columns", v, sizeof v), "l2,absmax");
    H5Fclose(f);
    /* The dumps stay valid for every reader and the validator. */
    snprintf(args, sizeof args, "compare %s/full.h5 %s/full.h5", dir, dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    test_rmtree(dir);
}
END_TEST

Suite *dump_attrs_suite(void)
{
    Suite *s = suite_create("dump_attrs");
    TCase *tc = tcase_create("attributes");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_columns_described);
    suite_add_tcase(s, tc);
    return s;
}
