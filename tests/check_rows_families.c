/* check_rows_families.c — bugs the recorded K/V rows show by themselves,
 * planted by editing the reference's recording as a runtime (or a hand)
 * would have written it: K or V alone written as zero from a position on
 * (named with which, not "K = V = 0"), and K or V rows written N
 * positions off (a cache write index off by N: slot q holding the row of
 * q - N), each found at its exact (position, layer, stage) and named.
 *
 * The edits leave the rows' recorded hashes as they were, as an editor
 * that knows nothing of them would: on a dump this small every row
 * settled by hash is hashed again, so the edit is never "identical" (a
 * sample of a thirty-second of each stage missed an edit of one stage). */
#include <check.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static char out[1 << 16];

/* tiny-qwen2 (no sliding window, biases) on 60 random tokens, 4 new. */
static void make_reference(const char *dir)
{
    char args[1024];
    snprintf(args, sizeof args, "run --model tiny-qwen2 --prompt-random 60 --seed 3 --max-new 4 "
             "--ignore-eos --dump %s/ref.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
}

/* The rows of /layers/L/STAGE in the dump at path (rows x cols floats)
 * handed to fn and written back, its hashes left alone. */
typedef void (*rows_fn)(float *a, size_t rows, size_t cols, const void *arg);

static void edit_rows(const char *path, int layer, const char *stage, rows_fn fn, const void *arg)
{
    char name[64];
    snprintf(name, sizeof name, "/layers/%d/%s", layer, stage);
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(f >= 0);
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    ck_assert(d >= 0);
    hid_t sp = H5Dget_space(d);
    hsize_t dims[2];
    ck_assert_int_eq(H5Sget_simple_extent_ndims(sp), 2);
    H5Sget_simple_extent_dims(sp, dims, NULL);
    const size_t rows = (size_t)dims[0], cols = (size_t)dims[1];
    float *a = malloc(rows * cols * sizeof *a);
    ck_assert_ptr_nonnull(a);
    ck_assert(H5Dread(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, a) >= 0);
    fn(a, rows, cols, arg);
    ck_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, a) >= 0);
    free(a);
    H5Sclose(sp);
    H5Dclose(d);
    ck_assert(H5Fclose(f) >= 0);
}

typedef enum { EDIT_ZERO, EDIT_SHIFT, EDIT_ULP } edit_kind;

typedef struct {
    edit_kind how;
    int from, shift;
} edit_arg;

static void edit_fn(float *b, size_t rows, size_t cols, const void *arg)
{
    const edit_arg *e = arg;
    if (e->how == EDIT_ULP) {
        float *x = b + (size_t)e->from * cols + (size_t)e->shift;
        *x = nextafterf(*x, INFINITY);
        return;
    }
    float *a = malloc(rows * cols * sizeof *a);
    ck_assert_ptr_nonnull(a);
    memcpy(a, b, rows * cols * sizeof *a);
    for (size_t q = (size_t)e->from; q < rows; q++) {
        const long srcq = (long)q - e->shift;
        if (e->how == EDIT_ZERO)
            memset(b + q * cols, 0, cols * sizeof *b);
        else if (srcq >= 0 && srcq < (long)rows)
            memcpy(b + q * cols, a + (size_t)srcq * cols, cols * sizeof *b);
    }
    free(a);
}

/* dir/ref.h5 copied to dir/bad.h5 with /layers/L/STAGE's rows from
 * position `from` on zeroed (EDIT_ZERO), or each the row `shift`
 * positions before it (EDIT_SHIFT; negative: after it), or the one
 * element (from, shift) moved up by one ulp (EDIT_ULP), its hashes left
 * alone. */
static void edit_copy(const char *dir, int layer, const char *stage, edit_kind how, int from,
                      int shift)
{
    char src[512], dst[512];
    snprintf(src, sizeof src, "%s/ref.h5", dir);
    snprintf(dst, sizeof dst, "%s/bad.h5", dir);
    ck_assert_int_eq(test_copy_file(src, dst), 0);
    const edit_arg arg = {how, from, shift};
    edit_rows(dst, layer, stage, edit_fn, &arg);
}

/* compare ref.h5 bad.h5: exit 1, the first divergence at (pos, layer,
 * stage), diagnosed as kind with each NULL-terminated phrase in its text,
 * and the stale hash said. */
static void expect(const char *dir, long pos, int layer, const char *stage, const char *kind,
                   ...)
{
    char args[1024];
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/bad.h5 --json", dir, dir);
    const int rc = test_run_cli(args, out, sizeof out);
    json_error_t je;
    json_t *j = json_loads(out, 0, &je);
    ck_assert_msg(j, "%s: %.2000s", je.text, out);
    ck_assert_msg(rc == 1, "exit %d: %.3000s", rc, out);
    json_t *d = json_object_get(j, "first_divergence");
    json_t *g = json_object_get(j, "diagnosis");
    const char *k = json_string_value(json_object_get(g, "kind"));
    ck_assert_msg(json_integer_value(json_object_get(d, "position")) == pos &&
                  json_integer_value(json_object_get(d, "layer")) == layer &&
                  !strcmp(json_string_value(json_object_get(d, "stage")), stage) && k &&
                  !strcmp(k, kind), "expected %ld/%d/%s %s: %.3000s", pos, layer, stage, kind,
                  out);
    ck_assert_msg(json_is_object(json_object_get(json_object_get(j, "hash_check"), "stale")),
                  "the stale hash not said: %.3000s", out);
    char all[4096];
    snprintf(all, sizeof all, "%s %s %s", json_string_value(json_object_get(g, "summary")),
             json_string_value(json_object_get(g, "detail")),
             json_string_value(json_object_get(g, "evidence")));
    va_list ap;
    va_start(ap, kind);
    for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
        ck_assert_msg(strstr(all, s), "'%s' not in: %s", s, all);
    va_end(ap);
    json_decref(j);
}

START_TEST(rows_k_alone_zero)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    make_reference(dir);
    edit_copy(dir, 0, "k", EDIT_ZERO, 20, 0);
    expect(dir, 20, 0, "k", "zero_kv", "K rows written as zero from position 20 on, the V rows "
           "as the reference's", "every position 20..62 of layer 0 is zero", NULL);
    edit_copy(dir, 2, "v", EDIT_ZERO, 33, 0);
    expect(dir, 33, 2, "v", "zero_kv", "V rows written as zero from position 33 on, the K rows "
           "as the reference's", NULL);
    test_rmtree(dir);
}
END_TEST

START_TEST(rows_shifted)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    make_reference(dir);
    edit_copy(dir, 0, "k", EDIT_SHIFT, 21, 1);
    expect(dir, 21, 0, "k", "rows_shifted", "K rows written 1 position off from position 21 on: "
           "the test's row at q is the reference's at q - 1", "rotated for that position",
           "at 8 positions from 21", NULL);
    edit_copy(dir, 1, "v", EDIT_SHIFT, 30, -1);
    expect(dir, 30, 1, "v", "rows_shifted", "V rows written 1 position off from position 30 on: "
           "the test's row at q is the reference's at q + 1", NULL);
    edit_copy(dir, 3, "k", EDIT_SHIFT, 40, 3);
    expect(dir, 40, 3, "k", "rows_shifted", "K rows written 3 positions off", "q - 3", NULL);
    test_rmtree(dir);
}
END_TEST

/* A key count moved by one ulp (31 to 31.0000019): no count, a dump
 * `kvdiff validate` rejects; compare says so, not "keys attended 31 vs
 * 31" and a cause in the values. */
START_TEST(rows_count_not_a_count)
{
    char dir[64];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    make_reference(dir);
    edit_copy(dir, 0, "attn_nkeys", EDIT_ULP, 30, 1);
    expect(dir, 30, 0, "attn_nkeys", "unclassified", "the test's attn_nkeys is no key count: "
           "31.0000019 at position 30, head 1", "the recording is malformed there",
           "validate", NULL);
    test_rmtree(dir);
}
END_TEST

typedef struct {
    int D, pairs;
    double th0, th1;
} turn_arg;

static void turn_fn(float *a, size_t rows, size_t cols, const void *arg)
{
    const turn_arg *t = arg;
    const int D = t->D, half = D / 2;
    for (size_t p = 0; p < rows; p++)
        for (size_t h = 0; h < cols / (size_t)D; h++) {
            float *x = a + p * cols + h * (size_t)D;
            for (int j = 0; j < half; j++) {
                const double t0 = (double)p * pow(t->th0, -2.0 * j / D);
                double u0 = x[j] * cos(t0) + x[j + half] * sin(t0);
                double u1 = x[j + half] * cos(t0) - x[j] * sin(t0);
                if (j < t->pairs) {
                    const double t1 = (double)p * pow(t->th1, -2.0 * j / D);
                    const double r0 = u0 * cos(t1) - u1 * sin(t1);
                    u1 = u1 * cos(t1) + u0 * sin(t1);
                    u0 = r0;
                }
                x[j] = (float)u0;
                x[j + half] = (float)u1;
            }
        }
}

/* Rows of /layers/L/STAGE in dir/bad.h5 (n x cols, D-wide heads) turned
 * back under base th0 on every pair, then forward under base th1 on the
 * first `pairs` pairs at the whole head's frequencies (Gemma 4's full
 * layers' proportional RoPE): a sliding layer rotated as a full one. */
static void turn_rows(const char *dir, int layer, const char *stage, int D, double th0,
                      double th1, int pairs)
{
    char path[512];
    snprintf(path, sizeof path, "%s/bad.h5", dir);
    const turn_arg arg = {D, pairs, th0, th1};
    edit_rows(path, layer, stage, turn_fn, &arg);
}

/* Gemma 4: a sliding layer (0, heads of 32, base 1e4 on all 16 pairs)
 * rotated as a full one turns it (base 1e6 on a quarter of its pairs,
 * 4, at the whole head's frequencies). Named as that convention, the
 * pairs said, where the plain "global base on a sliding layer" (all 16
 * pairs) does not fit. */
START_TEST(rows_gemma4_sliding_turned_as_full)
{
    char dir[64], args[1024], src[512], dst[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-gemma4 --prompt-random 40 --seed 3 --max-new 2 "
             "--ignore-eos --dump %s/ref.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(src, sizeof src, "%s/ref.h5", dir);
    snprintf(dst, sizeof dst, "%s/bad.h5", dir);
    ck_assert_int_eq(test_copy_file(src, dst), 0);
    turn_rows(dir, 0, "q", 32, 1e4, 1e6, 4);
    turn_rows(dir, 0, "k", 32, 1e4, 1e6, 4);
    expect(dir, 1, 0, "q", "rope_convention", "theta 1e+06, the global layers' base, on a "
           "sliding layer, rotating 4 of its 16 pairs as the full layers' partial factor 0.25 "
           "does", NULL);
    test_rmtree(dir);
}
END_TEST

Suite *rows_families_suite(void)
{
    Suite *s = suite_create("rows_families");
    TCase *tc = tcase_create("edited");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, rows_k_alone_zero);
    tcase_add_test(tc, rows_shifted);
    tcase_add_test(tc, rows_count_not_a_count);
    tcase_add_test(tc, rows_gemma4_sliding_turned_as_full);
    suite_add_tcase(s, tc);
    return s;
}
