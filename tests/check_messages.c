/* check_messages.c — error messages name the real cause (an outside audit
 * found these naming another one): a FIFO given as a dump is a FIFO, not
 * an "empty file"; a dump a live run is still writing is said to be, not
 * reported as damaged; a string attribute past the limit is too long, not
 * "corrupt variable-length strings"; a dataset 2^31 columns wide is past
 * the width limit, not "not 2-D"; a file is named once, never "X.h5:
 * X.h5:"; non-finite logits are said (which dump, which position), never
 * folded into a KL of 0; and a Gemma 4 checkpoint whose tensors disagree
 * with config.json names the fields that shaped them. */
#include <check.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include "compare/compare.h"
#include "dump/dump.h"
#include "model/err.h"
#include "h5edit.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Helpers                                                              */

static void run_ok(const char *args)
{
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "kvdiff %s\n%s", args, out);
}

/* Runs kvdiff; asserts exit 2 and one line holding want. */
static void one_line_exit2(const char *args, const char *want)
{
    int rc = test_run_cli(args, out, sizeof out);
    ck_assert_msg(rc == 2, "kvdiff %s: exit %d: %s", args, rc, out);
    ck_assert_msg(strstr(out, want), "kvdiff %s: expected '%s' in: %s", args, want, out);
    size_t len = strlen(out);
    ck_assert_msg(len > 0 && strchr(out, '\n') == out + len - 1, "not one line: %s", out);
}

/* A short recording of tiny-llama at path (row hashes, top-k output). */
static void record(const char *path)
{
    char args[512];
    snprintf(args, sizeof args, "run --model tiny-llama --prompt-random 8 --max-new 2 "
             "--threads 1 --dump %s", path);
    run_ok(args);
}

static int count_of(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle))
        n++;
    return n;
}

/* ------------------------------------------------------------------ */
/* 1. A FIFO where a dump is read                                       */

START_TEST(test_fifo_is_named)
{
    char dir[64], fifo[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(fifo, sizeof fifo, "%s/pipe.h5", dir);
    ck_assert_int_eq(mkfifo(fifo, 0600), 0);
    static const char *const verbs[] = {"inspect", "validate"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "%s %s", verbs[i], fifo);
        one_line_exit2(args, "pipe.h5: is a FIFO, not a regular file");
        ck_assert_msg(!strstr(out, "empty file"), "%s", out);
    }
    kv_err e = {{0}};
    ck_assert_ptr_null(dump_open(fifo, &e));
    ck_assert_msg(strstr(e.msg, "is a FIFO, not a regular file"), "%s", e.msg);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* 2. A dump a live run is writing                                      */


START_TEST(test_live_writer_is_named)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/live.h5", dir);
    pid_t writer = test_start_long_run(path);
    ck_assert_msg(writer > 0, "the run ended before it wrote 4 MB");
    /* Held still mid-write: rows of the running batch may be in the file
     * before /tokens grows to cover them. */
    int status;
    ck_assert_int_eq(kill(writer, SIGSTOP), 0);
    ck_assert_int_eq(waitpid(writer, &status, WUNTRACED), writer);
    ck_assert_msg(WIFSTOPPED(status), "the run ended before it was read");
    const char *want = "live.h5: is being written by another process now (status \"partial: "
                       "running\"";
    snprintf(args, sizeof args, "compare %s %s", path, path);
    one_line_exit2(args, want);
    ck_assert_msg(!strstr(out, "covers positions"), "%s", out);
    snprintf(args, sizeof args, "validate %s", path);
    one_line_exit2(args, want);
    ck_assert_msg(strstr(out, "wait for that run to finish"), "%s", out);
    kv_err e = {{0}};
    ck_assert_int_eq(dump_check_not_written(path, &e), -1);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_int_eq(dump_check_file(f, &e), -1);
    ck_assert_msg(strstr(e.msg, "is being written by another process"), "%s", e.msg);
    dump_file_close(f);
    /* Killed, it writes no more: its file reads as the partial file it is. */
    ck_assert_int_eq(kill(writer, SIGKILL), 0);
    ck_assert_int_eq(waitpid(writer, &status, 0), writer);
    ck_assert_int_eq(dump_check_not_written(path, &e), 0);
    snprintf(args, sizeof args, "inspect %s", path);
    run_ok(args);
    ck_assert_msg(strstr(out, "partial: its writer ended without closing it"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* 3. A string attribute past the limit                                 */

START_TEST(test_long_string_attribute)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/long.h5", dir);
    record(path);
    const size_t n = (size_t)50 << 20;
    char *big = malloc(n + 1);
    ck_assert_ptr_nonnull(big);
    memset(big, 'a', n);
    big[n] = 0;
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(f >= 0);
    test_set_str_attr(f, "engine_settings", big);
    H5Fclose(f);
    free(big);
    const char *want = "long.h5: the root attribute engine_settings is a string of 52428800 "
                       "bytes, past the limit of 1048576 bytes (1 MiB) kvdiff reads";
    static const char *const verbs[] = {"inspect", "validate"};
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "%s %s", verbs[i], path);
        one_line_exit2(args, want);
        ck_assert_msg(!strstr(out, "corrupt"), "%s", out);
    }
    snprintf(args, sizeof args, "compare %s %s", path, path);
    one_line_exit2(args, want);
    test_rmtree(dir);
}
END_TEST

/* A layer group's "attention" (read by the reader) too. */
START_TEST(test_long_layer_attribute)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/layer.h5", dir);
    record(path);
    const size_t n = (size_t)2 << 20;
    char *big = malloc(n + 1);
    ck_assert_ptr_nonnull(big);
    memset(big, 'g', n);
    big[n] = 0;
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t g = f >= 0 ? H5Gopen2(f, "layers/1", H5P_DEFAULT) : -1;
    ck_assert(g >= 0);
    test_set_str_attr(g, "attention", big);
    H5Gclose(g);
    H5Fclose(f);
    free(big);
    snprintf(args, sizeof args, "validate %s", path);
    one_line_exit2(args, "layer.h5: /layers/1 attribute attention is a string of 2097152 bytes, "
                   "past the limit");
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* 4. A dataset wider than 2^31 - 1 columns                             */

START_TEST(test_wide_dataset)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/wide.h5", dir);
    record(path);
    /* /layers/0/x_in replaced by one of 2^31 columns, none of its chunks
     * written (so the file stays small). */
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(f >= 0);
    hid_t old = H5Dopen2(f, "layers/0/x_in", H5P_DEFAULT);
    ck_assert(old >= 0);
    hid_t os = H5Dget_space(old);
    hsize_t dims[2], max[2];
    ck_assert_int_eq(H5Sget_simple_extent_dims(os, dims, NULL), 2);
    H5Sclose(os);
    H5Dclose(old);
    ck_assert(H5Ldelete(f, "layers/0/x_in", H5P_DEFAULT) >= 0);
    dims[1] = (hsize_t)1 << 31;
    max[0] = H5S_UNLIMITED;
    max[1] = dims[1];
    hsize_t chunk[2] = {1, 1 << 16};
    hid_t sp = H5Screate_simple(2, dims, max), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    ck_assert(H5Pset_chunk(dcpl, 2, chunk) >= 0);
    hid_t d = H5Dcreate2(f, "layers/0/x_in", H5T_IEEE_F32LE, sp, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    ck_assert(d >= 0);
    hid_t as = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(d, "first_position", H5T_STD_I64LE, as, H5P_DEFAULT, H5P_DEFAULT);
    long long zero = 0;
    ck_assert(a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &zero) >= 0);
    H5Aclose(a);
    H5Sclose(as);
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(sp);
    H5Fclose(f);

    const char *want = "wide.h5: /layers/0/x_in is 2147483648 columns wide, past the limit of "
                       "2147483647";
    kv_err e = {{0}};
    dump_file *df = dump_open(path, &e);
    ck_assert_msg(df != NULL, "%s", e.msg);
    ck_assert_int_eq(dump_check_stage(df, 0, STAGE_X_IN, &e), -1);
    ck_assert_msg(strstr(e.msg, want), "%s", e.msg);
    dump_file_close(df);
    snprintf(args, sizeof args, "compare --no-hashes %s %s", path, path);
    one_line_exit2(args, want);
    ck_assert_msg(!strstr(out, "not 2-D"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* 5. A file named once                                                  */

START_TEST(test_prefix_once)
{
    kv_err e;
    kv_errf(&e, "a.h5: model_config is not valid JSON");
    kv_err_prefix(&e, "a.h5");
    ck_assert_str_eq(e.msg, "a.h5: model_config is not valid JSON");
    kv_errf(&e, "suite.txt:10: unknown key");
    kv_err_prefix(&e, "suite.txt");
    ck_assert_str_eq(e.msg, "suite.txt:10: unknown key");
    kv_errf(&e, "model_config is not valid JSON");
    kv_err_prefix(&e, "a.h5");
    ck_assert_str_eq(e.msg, "a.h5: model_config is not valid JSON");
    /* a name that only begins the message's own is another file */
    kv_errf(&e, "a.h5.bak: truncated");
    kv_err_prefix(&e, "a.h5");
    ck_assert_str_eq(e.msg, "a.h5: a.h5.bak: truncated");
}
END_TEST

/* The case the audit met: compare on a dump whose model_config does not
 * parse said "X.h5: X.h5: ...". */
START_TEST(test_compare_names_file_once)
{
    char dir[64], a[128], b[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(a, sizeof a, "%s/a.h5", dir);
    snprintf(b, sizeof b, "%s/badcfg.h5", dir);
    record(a);
    ck_assert_int_eq(test_copy_file(a, b), 0);
    hid_t f = H5Fopen(b, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(f >= 0);
    test_set_str_attr(f, "model_config", "x");
    H5Fclose(f);
    snprintf(args, sizeof args, "compare %s %s", a, b);
    one_line_exit2(args, "badcfg.h5: model_config is not valid JSON");
    ck_assert_msg(count_of(out, "badcfg.h5") == 1, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* 8. Non-finite logits                                                 */

/* Sets value (row, col) of dataset name in path to NaN. */
static void poison(const char *path, const char *name, hsize_t row, hsize_t col)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = f >= 0 ? H5Dopen2(f, name, H5P_DEFAULT) : -1;
    ck_assert_msg(d >= 0, "%s: no %s", path, name);
    hid_t fs = H5Dget_space(d);
    hsize_t start[2] = {row, col}, count[2] = {1, 1};
    hid_t ms = H5Screate_simple(1, count, NULL);
    const float nan = NAN;
    ck_assert(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0);
    ck_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, &nan) >= 0);
    H5Sclose(ms);
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
}

/* A reference and a chunked run with a window bug (they diverge), on
 * tiny-gemma3; logits: also full logits. */
static void record_pair(const char *dir, bool logits, char *ref, char *test, size_t n)
{
    char args[512];
    snprintf(ref, n, "%s/ref.h5", dir);
    snprintf(test, n, "%s/test.h5", dir);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --max-new 3 --threads 1 %s --dump %s",
             logits ? "--dump-logits" : "", ref);
    run_ok(args);
    snprintf(args, sizeof args, "run --model tiny-gemma3 --max-new 3 --threads 1 --engine "
             "chunked --chunk 5 --inject window=8 %s --dump %s", logits ? "--dump-logits" : "",
             test);
    run_ok(args);
}

START_TEST(test_nan_lse_is_said)
{
    char dir[64], ref[128], test[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record_pair(dir, false, ref, test, sizeof ref);
    /* the first /output row (position 31, the only one compared) */
    hid_t f = H5Fopen(test, H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t d = f >= 0 ? H5Dopen2(f, "output/lse", H5P_DEFAULT) : -1;
    ck_assert(d >= 0);
    const float nan = NAN;
    hid_t fs = H5Dget_space(d);
    hsize_t start = 0, count = 1;
    hid_t ms = H5Screate_simple(1, &count, NULL);
    ck_assert(H5Sselect_hyperslab(fs, H5S_SELECT_SET, &start, NULL, &count, NULL) >= 0);
    ck_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, &nan) >= 0);
    H5Sclose(ms);
    H5Sclose(fs);
    H5Dclose(d);
    H5Fclose(f);
    snprintf(args, sizeof args, "compare %s %s", ref, test);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(!strstr(out, "KL(ref || test) mean 0,"), "%s", out);
    ck_assert_msg(strstr(out, "LOGITS     no KL: a dump's logits are not finite"), "%s", out);
    ck_assert_msg(strstr(out, "test.h5's log-sum-exp is nan at position 31"), "%s", out);
    snprintf(args, sizeof args, "compare --json %s %s", ref, test);
    test_run_cli(args, out, sizeof out);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_msg(j, "%s", out);
    /* in the JSON too (a note: kvdiff report shows it) */
    json_t *notes = json_object_get(j, "notes");
    bool said = false;
    for (size_t i = 0; i < json_array_size(notes); i++)
        said |= strstr(json_string_value(json_array_get(notes, i)),
                       "test.h5's log-sum-exp is nan at position 31") != NULL;
    ck_assert_msg(said, "%s", out);
    ck_assert_msg(json_is_null(json_object_get(j, "logits")), "%s", out);
    json_decref(j);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_nan_logit_is_said)
{
    char dir[64], ref[128], test[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    record_pair(dir, true, ref, test, sizeof ref);
    poison(test, "model/logits", 5, 17);
    snprintf(args, sizeof args, "compare %s %s", ref, test);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 1, "%s", out);
    ck_assert_msg(strstr(out, "test.h5's logit of token 17 is nan at position 5 (1 position "
                          "with logits not finite): left out of the KL"), "%s", out);
    ck_assert_msg(strstr(out, "with finite logits (note below)"), "%s", out);
    ck_assert_msg(!strstr(out, "mean inf") && !strstr(out, "mean nan"), "%s", out);
    test_rmtree(dir);
}
END_TEST

/* cmp's KL from top-k is NaN on a NaN, never 0 (reports plot it). */
START_TEST(test_kl_topk_nan)
{
    const int32_t ids[2] = {3, 5};
    const float v[2] = {1.0f, 0.5f};
    ck_assert(isnan(cmp_kl_topk(NAN, ids, v, 2.0f, ids, v, 2)));
    ck_assert(cmp_kl_topk(2.0f, ids, v, 2.0f, ids, v, 2) == 0.0);
}
END_TEST

/* ------------------------------------------------------------------ */
/* 7. Gemma 4 tensors against config.json                               */

/* dir/g4 (tiny-gemma4) with config.json's key set to v (NULL: removed):
 * `run` refuses it in one line holding want; config.json is put back. */
static void g4_refused(const char *dir, const char *key, json_t *v, const char *want)
{
    char args[512], cfg[256];
    snprintf(cfg, sizeof cfg, "%s/g4/config.json", dir);
    json_t *c = json_load_file(cfg, 0, NULL);
    ck_assert_ptr_nonnull(c);
    json_t *orig = json_deep_copy(c);
    if (v)
        json_object_set_new(c, key, v);
    else
        json_object_del(c, key);
    ck_assert_int_eq(json_dump_file(c, cfg, 0), 0);
    snprintf(args, sizeof args, "run --model %s/g4 --max-new 0 --threads 1", dir);
    one_line_exit2(args, want);
    ck_assert_int_eq(json_dump_file(orig, cfg, 0), 0);
    json_decref(c);
    json_decref(orig);
}

START_TEST(test_gemma4_tensor_fields)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma4 -o %s/g4", dir);
    run_ok(args);
    g4_refused(dir, "num_kv_shared_layers", json_integer(0),
               "is missing (needed by config.json: layer 8 computes its own K/V: "
               "num_kv_shared_layers is 0)");
    g4_refused(dir, "num_kv_shared_layers", json_integer(6),
               "(2 x intermediate_size 96: use_double_wide_mlp, and layer 6 shares K/V as one "
               "of the last num_kv_shared_layers 6)");
    g4_refused(dir, "attention_k_eq_v", json_false(),
               "v_proj.weight' is missing (needed by config.json: layer 3 is full_attention and "
               "attention_k_eq_v is false)");
    g4_refused(dir, "global_head_dim", NULL,
               "(num_attention_heads 4 x global_head_dim (else head_dim) 32: layer 3 is "
               "full_attention)");
    test_rmtree(dir);
}
END_TEST

Suite *messages_suite(void)
{
    Suite *s = suite_create("messages");
    TCase *tc = tcase_create("messages");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_fifo_is_named);
    tcase_add_test(tc, test_live_writer_is_named);
    tcase_add_test(tc, test_long_string_attribute);
    tcase_add_test(tc, test_long_layer_attribute);
    tcase_add_test(tc, test_wide_dataset);
    tcase_add_test(tc, test_prefix_once);
    tcase_add_test(tc, test_compare_names_file_once);
    tcase_add_test(tc, test_nan_lse_is_said);
    tcase_add_test(tc, test_nan_logit_is_said);
    tcase_add_test(tc, test_kl_topk_nan);
    tcase_add_test(tc, test_gemma4_tensor_fields);
    suite_add_tcase(s, tc);
    return s;
}
