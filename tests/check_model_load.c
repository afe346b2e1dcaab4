/* check_model_load.c — what must not change when loading and generating
 * weights get faster: `kvdiff gen` writes the same bytes for the same
 * seed (hashes taken before the generator used threads), and a model
 * loaded or drawn on a thread pool is the model built on one thread. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "model/model.h"
#include "model/pool.h"
#include "model/safetensors.h"
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

/* config.json of dir with `from` replaced by `to` (once). */
static void edit_config(const char *dir, const char *from, const char *to)
{
    char path[512], buf[8192], next[8400];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *at = strstr(buf, from);
    ck_assert_msg(at != NULL, "%s: no '%s'", path, from);
    snprintf(next, sizeof next, "%.*s%s%s", (int)(at - buf), buf, to, at + strlen(from));
    f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(next, f);
    fclose(f);
}

/* Gemma 4 folders kvdiff refuses in one line, exit 2: a per-layer input
 * table of another shape than config.json implies, a MoE config, more
 * shared layers than layers. */
START_TEST(test_gemma4_bad_folders)
{
    static const struct { const char *from, *to, *expect; } cases[] = {
        {"\"hidden_size_per_layer_input\": 16", "\"hidden_size_per_layer_input\": 8",
         "tensor 'model.embed_tokens_per_layer.weight' has shape [256, 192] but config.json "
         "implies [256, 96]"},
        {"\"enable_moe_block\": false", "\"enable_moe_block\": true",
         "enable_moe_block is true; Gemma 4's mixture-of-experts block is not supported"},
        {"\"num_kv_shared_layers\": 4", "\"num_kv_shared_layers\": 13",
         "num_kv_shared_layers is 13 but the model has 12 layers"},
    };
    char dir[64], args[600], out[4096];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "gen --preset tiny-gemma4 -o %s/hf", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "%s/hf", dir);
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        edit_config(args, cases[i].from, cases[i].to);
        char cmd[800];
        snprintf(cmd, sizeof cmd, "run --model %s --prompt-random 4 --max-new 1", args);
        ck_assert_int_eq(test_run_cli(cmd, out, sizeof out), 2);
        ck_assert_msg(strstr(out, cases[i].expect), "expected '%s' in: %s", cases[i].expect, out);
        ck_assert_msg(strchr(out, '\n') == out + strlen(out) - 1, "not one line: %s", out);
        edit_config(args, cases[i].to, cases[i].from);
    }
    test_rmtree(dir);
}
END_TEST

/* On one thread, then on a pool of three (rows drawn by blocks on every
 * thread, the file written by a thread of its own): the same bytes. */
START_TEST(test_gen_bytes_unchanged)
{
    char dir[64], out[600], path[700];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    kern_pool *pool = pool_create(3);
    ck_assert_ptr_nonnull(pool);
    for (int threaded = 0; threaded < 2; threaded++) {
        snprintf(out, sizeof out, "%s/gen%d", dir, threaded);
        ck_assert_msg(model_gen_folder_pool(golden[_i].preset, 5, golden[_i].bf16, out,
                                            threaded ? pool : NULL, NULL, NULL, &e) == 0,
                      "%s", e.msg);
        snprintf(path, sizeof path, "%s/model.safetensors", out);
        uint64_t got = file_hash(path);
        ck_assert_msg(got == golden[_i].hash, "%s bf16=%d, %s: model.safetensors hashes to "
                      "0x%016llx, expected 0x%016llx", golden[_i].preset, golden[_i].bf16,
                      threaded ? "pool of 3" : "one thread", (unsigned long long)got,
                      (unsigned long long)golden[_i].hash);
    }
    pool_free(pool);
    test_rmtree(dir);
}
END_TEST

static const char *const presets[] = {"tiny-llama", "tiny-qwen2", "tiny-gemma3",
                                      "tiny-gemma3-kvshared"};

/* Every packed weight, bias and norm: the fingerprint hashes them all in
 * catalogue order; the first matrix is compared in full as well. */
static void assert_same_model(const kv_model *a, const kv_model *b, const char *what)
{
    ck_assert_msg(a->fingerprint == b->fingerprint, "%s: fingerprint %016llx vs %016llx", what,
                  (unsigned long long)a->fingerprint, (unsigned long long)b->fingerprint);
    ck_assert_int_eq(a->wtype, b->wtype);
    ck_assert_int_eq(a->embed.n_out, b->embed.n_out);
    size_t esz = a->wtype == KERN_BF16 ? 2 : 4;
    size_t panels = ((size_t)a->embed.n_out + KERN_PANEL - 1) / KERN_PANEL;
    ck_assert_msg(memcmp(a->embed.panels, b->embed.panels,
                         panels * (size_t)a->embed.n_in * KERN_PANEL * esz) == 0,
                  "%s: embedding differs", what);
    ck_assert_int_eq(a->nonfinite_tensors, b->nonfinite_tensors);
}

/* Row r of every matrix, read back from the packed panels, is the file's
 * row r: the packing checked against the file rather than against itself. */
static void assert_rows_are_files(const kv_model *m, const char *dir)
{
    char path[700];
    kv_err e = {{0}};
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file *st = st_open(path, &e);
    ck_assert_msg(st != NULL, "%s", e.msg);
    const model_layer *ly = &m->layers[0];
    const struct {
        const char *name;
        const kern_linear *L;
    } mats[] = {
        {"model.embed_tokens.weight", &m->embed},
        {"model.layers.0.self_attn.q_proj.weight", &ly->wq},
        {"model.layers.0.self_attn.o_proj.weight", &ly->wo},
        {"model.layers.0.mlp.up_proj.weight", &ly->w_up},
        {"model.layers.0.mlp.down_proj.weight", &ly->w_down},
    };
    for (size_t i = 0; i < sizeof mats / sizeof *mats; i++) {
        const st_tensor *t = st_find(st, mats[i].name);
        ck_assert_ptr_nonnull(t);
        const kern_linear *L = mats[i].L;
        float *want = malloc((size_t)L->n_in * sizeof *want);
        float *got = malloc((size_t)L->n_in * sizeof *got);
        for (int r = 0; r < L->n_out; r++) {
            ck_assert_int_eq(st_read_f32(t, (uint64_t)r * (uint64_t)L->n_in,
                                         (uint64_t)L->n_in, want, &e), 0);
            kern_linear_get_row(L, r, got);
            ck_assert_msg(memcmp(want, got, (size_t)L->n_in * sizeof *got) == 0,
                          "%s row %d differs from the file", mats[i].name, r);
        }
        free(want);
        free(got);
    }
    st_close(st);
}

/* A preset drawn, and its folder loaded, on pools of 2 and 3 threads
 * (weights converted and packed by blocks of rows, matrices allocated
 * ahead on every thread) is the model built on the caller's thread. */
START_TEST(test_load_on_pool_same_model)
{
    const char *preset = presets[_i / 2];
    const int bf16 = _i % 2;
    char dir[64], out[600], what[200];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(out, sizeof out, "%s/gen", dir);
    ck_assert_msg(model_gen_folder(preset, 3, bf16, out, &e) == 0, "%s", e.msg);
    kv_model one_preset, one_folder;
    model_opts mo = {.wtype = bf16 ? KERN_BF16 : KERN_F32};
    ck_assert_msg(model_from_preset(preset, 3, &mo, &one_preset, &e) == 0, "%s", e.msg);
    ck_assert_msg(model_load_dir(out, &mo, &one_folder, &e) == 0, "%s", e.msg);
    /* (a bf16 folder's norms and biases are rounded to bf16 too: not the preset) */
    snprintf(what, sizeof what, "%s: f32 folder vs preset, one thread", preset);
    if (!bf16)
        assert_same_model(&one_folder, &one_preset, what);
    for (int threads = 2; threads <= 3; threads++) {
        kern_pool *pool = pool_create(threads);
        ck_assert_ptr_nonnull(pool);
        mo.pool = pool;
        kv_model m;
        ck_assert_msg(model_from_preset(preset, 3, &mo, &m, &e) == 0, "%s", e.msg);
        snprintf(what, sizeof what, "%s bf16=%d: preset on %d threads", preset, bf16, threads);
        assert_same_model(&m, &one_preset, what);
        model_free(&m);
        ck_assert_msg(model_load_dir(out, &mo, &m, &e) == 0, "%s", e.msg);
        snprintf(what, sizeof what, "%s bf16=%d: folder on %d threads", preset, bf16, threads);
        assert_same_model(&m, &one_folder, what);
        if (strcmp(preset, "tiny-llama") == 0)   /* its names start with "model." */
            assert_rows_are_files(&m, out);
        model_free(&m);
        pool_free(pool);
    }
    model_free(&one_preset);
    model_free(&one_folder);
    test_rmtree(dir);
}
END_TEST

/* Overwrites `count` values of an F32 tensor of dir/model.safetensors,
 * from element `first`, with NaN and infinities. */
static void poison(const char *dir, const char *tensor, long first, int count)
{
    char path[700];
    kv_err e = {{0}};
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_file *st = st_open(path, &e);
    ck_assert_msg(st != NULL, "%s", e.msg);
    const st_tensor *t = st_find(st, tensor);
    ck_assert_ptr_nonnull(t);
    ck_assert_int_eq(t->dtype, ST_F32);
    /* the data's offset in the file: where the view points into the mapping */
    const unsigned char *base = st_at(st, 0)->data;
    for (size_t i = 1; i < st_count(st); i++)
        if ((const unsigned char *)st_at(st, i)->data < base)
            base = st_at(st, i)->data;
    long offset = (long)((const unsigned char *)t->data - base);
    st_close(st);
    FILE *f = fopen(path, "r+b");
    ck_assert_ptr_nonnull(f);
    unsigned char len8[8];
    ck_assert_int_eq(fread(len8, 1, 8, f), 8);
    long hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | len8[i];
    for (int i = 0; i < count; i++) {
        float v = i % 2 ? INFINITY : NAN;
        ck_assert_int_eq(fseek(f, 8 + hlen + offset + (first + i) * 4, SEEK_SET), 0);
        ck_assert_int_eq(fwrite(&v, sizeof v, 1, f), 1);
    }
    ck_assert_int_eq(fclose(f), 0);
}

/* NaN and infinities spread over the blocks of rows different threads
 * pack are all counted, and the first such tensor named, as on one
 * thread. */
START_TEST(test_nonfinite_counted_on_pool)
{
    char dir[64], out[600];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(out, sizeof out, "%s/gen", dir);
    ck_assert_msg(model_gen_folder("tiny-llama", 1, 0, out, &e) == 0, "%s", e.msg);
    kv_config c;
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    /* the embedding: a value in its first row, in a middle one and its last */
    const long rows = c.vocab, cols = c.hidden;
    poison(out, "model.embed_tokens.weight", 3, 2);
    poison(out, "model.embed_tokens.weight", rows / 2 * cols + 7, 3);
    poison(out, "model.embed_tokens.weight", (rows - 1) * cols, 1);
    poison(out, "model.layers.1.mlp.down_proj.weight", 11, 1);
    kern_pool *pool = pool_create(3);
    ck_assert_ptr_nonnull(pool);
    for (int threaded = 0; threaded < 2; threaded++) {
        model_opts mo = {.wtype = -1, .pool = threaded ? pool : NULL};
        kv_model m;
        ck_assert_msg(model_load_dir(out, &mo, &m, &e) == 0, "%s", e.msg);
        ck_assert_int_eq(m.nonfinite_tensors, 2);
        ck_assert_msg(strstr(m.nonfinite_first, "tensor 'model.embed_tokens.weight' holds 6 "
                                                "NaN or infinite values") != NULL,
                      "%s", m.nonfinite_first);
        model_free(&m);
    }
    pool_free(pool);
    test_rmtree(dir);
}
END_TEST

Suite *model_load_suite(void)
{
    Suite *s = suite_create("model_load");
    TCase *tc = tcase_create("same bytes");
    tcase_set_timeout(tc, 60);
    tcase_add_loop_test(tc, test_gen_bytes_unchanged, 0, (int)(sizeof golden / sizeof *golden));
    tcase_add_loop_test(tc, test_load_on_pool_same_model, 0,
                        2 * (int)(sizeof presets / sizeof *presets));
    tcase_add_test(tc, test_nonfinite_counted_on_pool);
    tcase_add_test(tc, test_gemma4_bad_folders);
    suite_add_tcase(s, tc);
    return s;
}
