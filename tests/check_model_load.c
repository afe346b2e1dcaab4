/* check_model_load.c — what must not change when loading and generating
 * weights get faster: `kvdiff gen` writes the same bytes for the same
 * seed (hashes taken before the generator used threads), and a model
 * loaded or drawn on a thread pool is the model built on one thread. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "model/model.h"
#include "model/pool.h"
#include "testutil.h"

static uint64_t file_hash(const char *path)
{
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s", path);
    XXH3_state_t *h = XXH3_createState();
    XXH3_64bits_reset(h);
    static unsigned char buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        XXH3_64bits_update(h, buf, n);
    fclose(f);
    uint64_t d = XXH3_64bits_digest(h);
    XXH3_freeState(h);
    return d;
}

/* XXH3-64 of model.safetensors as `kvdiff gen --preset P --weights-seed 5
 * [--dtype bf16]` wrote it on one thread: every PCG32 stream, the order
 * of tensors, bf16 rounding and the header, in one number. */
static const struct {
    const char *preset;
    int bf16;
    uint64_t hash;
} golden[] = {
    {"tiny-llama", 0, 0xae6fcea7e17572f3ull},
    {"tiny-llama", 1, 0xd37c621692c2bc6dull},
    {"tiny-qwen2", 0, 0xd98044c7a143125bull},
    {"tiny-qwen2", 1, 0x432aea7c96a88591ull},
    {"tiny-gemma3", 0, 0xafed5c0cfa4f223full},
    {"tiny-gemma3", 1, 0x6ae94d2b53e1d83aull},
    {"tiny-gemma3-kvshared", 0, 0x4ad92b20072b4ba9ull},
    {"tiny-gemma3-kvshared", 1, 0xe6a8b889f46b1415ull},
};

START_TEST(test_gen_bytes_unchanged)
{
    char dir[64], out[600], path[700];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(out, sizeof out, "%s/gen", dir);
    ck_assert_msg(model_gen_folder(golden[_i].preset, 5, golden[_i].bf16, out, &e) == 0, "%s",
                  e.msg);
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    uint64_t got = file_hash(path);
    ck_assert_msg(got == golden[_i].hash, "%s bf16=%d: model.safetensors hashes to 0x%016llx, "
                  "expected 0x%016llx", golden[_i].preset, golden[_i].bf16,
                  (unsigned long long)got, (unsigned long long)golden[_i].hash);
    test_rmtree(dir);
}
END_TEST

Suite *model_load_suite(void)
{
    Suite *s = suite_create("model_load");
    TCase *tc = tcase_create("same bytes");
    tcase_add_loop_test(tc, test_gen_bytes_unchanged, 0, (int)(sizeof golden / sizeof *golden));
    suite_add_tcase(s, tc);
    return s;
}
