/* check_bad_weights.c — a checkpoint holding NaN or infinite weights:
 * the load says which tensor and how many values, and kvdiff's own dump
 * of such a run is one its validator accepts (the row hash index flags
 * the stages whose rows are not finite). */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "testutil.h"

static char out[1 << 16];

#define BAD_TENSOR "model.layers.0.mlp.up_proj.weight"

/* Overwrites elements 5, 6 and 7 of an F32 tensor of dir/model.safetensors
 * with NaN, +Inf and NaN. */
static void poison(const char *dir)
{
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    ck_assert_ptr_nonnull(f);
    unsigned char len8[8];
    ck_assert_int_eq(fread(len8, 1, 8, f), 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len8[i];
    char *header = malloc(hlen + 1);
    ck_assert_ptr_nonnull(header);
    ck_assert_int_eq(fread(header, 1, hlen, f), hlen);
    header[hlen] = 0;
    json_error_t jerr;
    json_t *root = json_loads(header, 0, &jerr);
    ck_assert_ptr_nonnull(root);
    json_t *t = json_object_get(root, BAD_TENSOR);
    ck_assert_ptr_nonnull(t);
    ck_assert_str_eq(json_string_value(json_object_get(t, "dtype")), "F32");
    long begin = (long)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0));
    const float bad[3] = {NAN, INFINITY, NAN};
    ck_assert_int_eq(fseek(f, 8 + (long)hlen + begin + 5 * 4, SEEK_SET), 0);
    ck_assert_int_eq(fwrite(bad, sizeof *bad, 3, f), 3);
    ck_assert_int_eq(fclose(f), 0);
    json_decref(root);
    free(header);
}

START_TEST(test_nonfinite_weights_warn_and_validate)
{
    char dir[64], model[128], args[1024];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(model, sizeof model, "%s/gm", dir);
    snprintf(args, sizeof args, "gen --preset tiny-llama -o %s", model);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    poison(model);

    /* The loader counts them. */
    kv_model m;
    kv_err e = {{0}};
    ck_assert_msg(model_load_dir(model, NULL, &m, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(m.nonfinite_tensors, 1);
    ck_assert_msg(strstr(m.nonfinite_first, "tensor '" BAD_TENSOR "' holds 3 NaN or infinite "
                                            "values"), "%s", m.nonfinite_first);
    model_free(&m);

    /* The run says so, once, on stderr, and still runs. */
    const char *const modes[] = {"", "--fingerprint", "--dump-compress"};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "run --model %s --prompt-random 20 --max-new 4 "
                 "--ignore-eos --dump %s/nan%d.h5 %s", model, dir, i, modes[i]);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        char want[512];
        snprintf(want, sizeof want, "kvdiff: warning: %s/model.safetensors: tensor '" BAD_TENSOR
                 "' holds 3 NaN or infinite values; rows computed from it can be NaN or "
                 "infinite\n", model);
        ck_assert_msg(strstr(out, want), "%s", out);
        ck_assert_ptr_null(strstr(strstr(out, "warning") + 1, "warning"));
        /* kvdiff's own dump of it conforms. */
        snprintf(args, sizeof args, "validate %s/nan%d.h5", dir, i);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s: %s", modes[i], out);
        ck_assert_msg(strstr(out, "conforms"), "%s", out);
        snprintf(args, sizeof args, "inspect %s/nan%d.h5", dir, i);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        ck_assert_msg(strstr(out, "status    complete"), "%s", out);
    }
    test_rmtree(dir);
}
END_TEST

/* Clean weights: no warning at all. */
START_TEST(test_finite_weights_say_nothing)
{
    char dir[64], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-llama -o %s/gm", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model %s/gm --prompt-random 8 --max-new 2", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_ptr_null(strstr(out, "warning"));
    ck_assert_ptr_nonnull(strstr(out, "generated 2 tokens"));
    test_rmtree(dir);
}
END_TEST

Suite *bad_weights_suite(void)
{
    Suite *s = suite_create("bad_weights");
    TCase *tc = tcase_create("nonfinite");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_nonfinite_weights_warn_and_validate);
    tcase_add_test(tc, test_finite_weights_say_nothing);
    suite_add_tcase(s, tc);
    return s;
}
