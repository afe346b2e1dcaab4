/* check_model.c — loading Hugging Face folders the way real checkpoints
 * come: sharded, F16, Gemma3ForConditionalGeneration prefixes; and the
 * loader's refusals (missing tensor, wrong shape, unreadable dtype). Each
 * variant is made by rewriting a generated folder's tensors. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/model.h"
#include "model/safetensors.h"
#include "testutil.h"

typedef struct {
    const char *skip;        /* tensor left out */
    const char *old_prefix;  /* renamed: old_prefix... -> new_prefix... */
    const char *new_prefix;
    st_dtype dtype;          /* written as */
    const char *as_i64;      /* this tensor written as I64 */
} rewrite_opts;

/* Copies src/model.safetensors to path with the changes in o. */
static void rewrite(const char *src_dir, const char *path, const rewrite_opts *o)
{
    char in[512];
    kv_err e = {{0}};
    snprintf(in, sizeof in, "%s/model.safetensors", src_dir);
    st_file *f = st_open(in, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    size_t n = st_count(f), k = 0;
    st_decl *d = calloc(n, sizeof *d);
    char (*names)[200] = calloc(n, sizeof *names);
    const st_tensor **src = calloc(n, sizeof *src);
    for (size_t i = 0; i < n; i++) {
        const st_tensor *t = st_at(f, i);
        if (o->skip && !strcmp(t->name, o->skip))
            continue;
        size_t plen = o->old_prefix ? strlen(o->old_prefix) : 0;
        if (plen && !strncmp(t->name, o->old_prefix, plen))
            snprintf(names[k], sizeof names[k], "%s%s", o->new_prefix, t->name + plen);
        else
            snprintf(names[k], sizeof names[k], "%s", t->name);
        d[k].name = names[k];
        d[k].dtype = (o->as_i64 && !strcmp(t->name, o->as_i64)) ? ST_I64 : o->dtype;
        d[k].ndim = t->ndim;
        memcpy(d[k].shape, t->shape, sizeof d[k].shape);
        src[k++] = t;
    }
    st_writer *w = st_writer_open(path, d, k, NULL, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    for (size_t i = 0; i < k; i++) {
        float *buf = malloc(src[i]->nelem * sizeof(float) + 8);
        ck_assert_int_eq(st_read_f32(src[i], 0, src[i]->nelem, buf, &e), 0);
        if (d[i].dtype == ST_I64) {
            int64_t *ib = calloc(src[i]->nelem, sizeof *ib);
            ck_assert_int_eq(st_writer_put_raw(w, ib, src[i]->nelem * 8, &e), 0);
            free(ib);
        } else {
            ck_assert_msg(st_writer_put_f32(w, buf, &e) == 0, "%s", e.msg);
        }
        free(buf);
    }
    ck_assert_msg(st_writer_finish(w, &e) == 0, "%s", e.msg);
    free(d);
    free(names);
    free(src);
    st_close(f);
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

static void copy_file(const char *from, const char *to)
{
    ck_assert_msg(test_copy_file(from, to) == 0, "copying %s to %s", from, to);
}

/* A generated folder plus a variant folder holding its config. */
static void setup(char *dir, size_t n, char *gen, char *var, const char *preset)
{
    kv_err e = {{0}};
    char p1[600], p2[600];
    ck_assert_ptr_nonnull(test_tmpdir(dir, n));
    snprintf(gen, 512, "%s/gen", dir);
    snprintf(var, 512, "%s/var", dir);
    ck_assert_msg(model_gen_folder(preset, 5, 0, gen, &e) == 0, "%s", e.msg);
    snprintf(p1, sizeof p1, "%s/config.json", gen);
    snprintf(p2, sizeof p2, "%s", var);
    ck_assert_int_eq(mkdir(p2, 0777), 0);
    snprintf(p2, sizeof p2, "%s/config.json", var);
    copy_file(p1, p2);
}

static int load(const char *dir, kv_model *m, kv_err *e)
{
    model_opts mo = {.wtype = -1};
    return model_load_dir(dir, &mo, m, e);
}

/* Building, loading and writing a model report progress tensor by
 * tensor, in weights, ending at the total: what the CLI's bar shows. */
typedef struct {
    int calls;
    int64_t last, total;
    bool monotonic;
    char name[160];
} progress_log;

static void log_progress(void *ctx, int64_t done, int64_t total, const char *tensor)
{
    progress_log *l = ctx;
    if (done < l->last || (l->calls && total != l->total))
        l->monotonic = false;
    l->calls++;
    l->last = done;
    l->total = total;
    snprintf(l->name, sizeof l->name, "%s", tensor);
}

START_TEST(test_progress_callback)
{
    char dir[64], gen[600];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(gen, sizeof gen, "%s/gen", dir);
    kv_config c;
    ck_assert_int_eq(config_preset("tiny-llama", &c, &e), 0);
    int ntensors = tensors_list(&c, NULL, 0);
    progress_log l = {.monotonic = true};
    ck_assert_msg(model_gen_folder_progress("tiny-llama", 5, 0, gen, log_progress, &l, &e) == 0,
                  "%s", e.msg);
    ck_assert_int_eq(l.calls, ntensors);
    ck_assert(l.monotonic && l.last == l.total && l.total > 100000);
    ck_assert_str_eq(l.name, "lm_head.weight");
    int64_t written = l.total;
    static const char *const how[] = {"preset", "folder"};
    for (int i = 0; i < 2; i++) {
        memset(&l, 0, sizeof l);
        l.monotonic = true;
        model_opts mo = {.wtype = -1, .progress = log_progress, .progress_ctx = &l};
        kv_model m;
        int rc = i == 0 ? model_from_preset("tiny-llama", 5, &mo, &m, &e)
                        : model_load_dir(gen, &mo, &m, &e);
        ck_assert_msg(rc == 0, "%s: %s", how[i], e.msg);
        ck_assert_int_eq(l.calls, ntensors);
        ck_assert(l.monotonic && l.last == written && l.total == written);
        model_free(&m);
    }
    test_rmtree(dir);
}
END_TEST

START_TEST(test_missing_tensor_named)
{
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-llama");
    snprintf(path, sizeof path, "%s/model.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.skip = "model.layers.1.mlp.up_proj.weight", .dtype = ST_F32});
    kv_model m;
    kv_err e = {{0}};
    ck_assert_int_eq(load(var, &m, &e), -1);
    ck_assert_msg(strstr(e.msg, "tensor 'model.layers.1.mlp.up_proj.weight' is missing"), "%s", e.msg);
    ck_assert_ptr_nonnull(strstr(e.msg, var));
    test_rmtree(dir);
}
END_TEST

START_TEST(test_shape_mismatch_named)
{
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-llama");
    snprintf(path, sizeof path, "%s/model.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.dtype = ST_F32});
    /* config.json now claims a wider MLP than the tensors have. */
    snprintf(path, sizeof path, "%s/config.json", var);
    write_text(path, "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":160,"
                     "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                     "\"vocab_size\":256,\"rms_norm_eps\":1e-5,\"rope_theta\":500000.0}");
    kv_model m;
    kv_err e = {{0}};
    ck_assert_int_eq(load(var, &m, &e), -1);
    ck_assert_msg(strstr(e.msg, "mlp.gate_proj.weight' has shape [128, 64] but config.json "
                                "implies [160, 64]"), "%s", e.msg);
    test_rmtree(dir);
}
END_TEST

/* A config cut short (num_hidden_layers 3, the checkpoint holding 4) ran
 * the first 3 layers and called the result the model's. */
START_TEST(test_fewer_layers_than_the_checkpoint_refused)
{
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-llama");
    snprintf(path, sizeof path, "%s/model.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.dtype = ST_F32});
    snprintf(path, sizeof path, "%s/config.json", var);
    write_text(path, "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                     "\"num_hidden_layers\":3,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                     "\"vocab_size\":256,\"rms_norm_eps\":1e-5,\"rope_theta\":500000.0}");
    kv_model m;
    kv_err e = {{0}};
    ck_assert_int_eq(load(var, &m, &e), -1);
    ck_assert_msg(strstr(e.msg, "config.json: num_hidden_layers is 3, but the checkpoint holds "
                                "layer 3 (tensor 'model.layers.3.") && strstr(e.msg, var),
                  "%s", e.msg);
    /* the same folder with its own count loads */
    write_text(path, "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                     "\"num_hidden_layers\":4,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                     "\"vocab_size\":256,\"rms_norm_eps\":1e-5,\"rope_theta\":500000.0}");
    ck_assert_msg(load(var, &m, &e) == 0, "%s", e.msg);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_unreadable_dtype_named)
{
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-llama");
    snprintf(path, sizeof path, "%s/model.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.as_i64 = "model.norm.weight", .dtype = ST_F32});
    kv_model m;
    kv_err e = {{0}};
    ck_assert_int_eq(load(var, &m, &e), -1);
    ck_assert_msg(strstr(e.msg, "'model.norm.weight' has dtype I64"), "%s", e.msg);
    test_rmtree(dir);
}
END_TEST

/* Gemma3ForConditionalGeneration keeps the decoder under another prefix
 * (two spellings, by transformers version); both load to the same model. */
START_TEST(test_gemma3_conditional_generation_prefixes)
{
    static const char *const prefixes[] = {"language_model.model.", "model.language_model."};
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-gemma3");
    kv_model want, got;
    kv_err e = {{0}};
    ck_assert_int_eq(load(gen, &want, &e), 0);
    snprintf(path, sizeof path, "%s/model.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.old_prefix = "model.", .new_prefix = prefixes[_i],
                                       .dtype = ST_F32});
    snprintf(path, sizeof path, "%s/config.json", var);
    write_text(path,
               "{\"architectures\":[\"Gemma3ForConditionalGeneration\"],\"model_type\":\"gemma3\","
               "\"eos_token_id\":[1,106],\"text_config\":{\"model_type\":\"gemma3_text\","
               "\"hidden_size\":64,\"intermediate_size\":128,\"num_hidden_layers\":6,"
               "\"num_attention_heads\":4,\"num_key_value_heads\":2,\"head_dim\":32,"
               "\"vocab_size\":256,\"query_pre_attn_scalar\":24,\"sliding_window\":12,"
               "\"sliding_window_pattern\":6,\"rope_theta\":1000000.0,"
               "\"rope_local_base_freq\":10000.0,\"rms_norm_eps\":1e-06,"
               "\"max_position_embeddings\":4096},"
               "\"vision_config\":{\"hidden_size\":1152}}");
    ck_assert_msg(load(var, &got, &e) == 0, "%s", e.msg);
    ck_assert_uint_eq(got.fingerprint, want.fingerprint);
    ck_assert_str_eq(got.cfg.tensor_prefix, prefixes[_i]);
    model_free(&want);
    model_free(&got);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_sharded_folder_same_model)
{
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-qwen2");
    kv_err e = {{0}};
    char src[600];
    snprintf(src, sizeof src, "%s/model.safetensors", gen);
    /* Shard 1: all but the final norm; shard 2: the final norm only. */
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.skip = "model.norm.weight", .dtype = ST_F32});
    {
        st_file *g = st_open(src, &e);
        const st_tensor *t = st_find(g, "model.norm.weight");
        st_decl d = {.name = "model.norm.weight", .dtype = ST_F32, .ndim = 1,
                     .shape = {t->shape[0]}};
        float buf[64];
        ck_assert_int_eq(st_read_f32(t, 0, t->nelem, buf, &e), 0);
        snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", var);
        st_writer *w = st_writer_open(path, &d, 1, NULL, &e);
        ck_assert_int_eq(st_writer_put_f32(w, buf, &e), 0);
        ck_assert_int_eq(st_writer_finish(w, &e), 0);
        /* The index maps every tensor to its shard. */
        char *json = malloc(1 << 16);
        size_t len = (size_t)snprintf(json, 1 << 16, "{\"metadata\":{},\"weight_map\":{");
        for (size_t i = 0; i < st_count(g); i++) {
            const char *nm = st_at(g, i)->name;
            len += (size_t)snprintf(json + len, (1 << 16) - len, "%s\"%s\":\"model-0000%d-of-00002.safetensors\"",
                                    i ? "," : "", nm, strcmp(nm, "model.norm.weight") ? 1 : 2);
        }
        snprintf(json + len, (1 << 16) - len, "}}");
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", var);
        write_text(path, json);
        free(json);
        st_close(g);
    }
    kv_model want, got;
    ck_assert_int_eq(load(gen, &want, &e), 0);
    ck_assert_msg(load(var, &got, &e) == 0, "%s", e.msg);
    ck_assert_uint_eq(got.fingerprint, want.fingerprint);
    model_free(&want);
    model_free(&got);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_f16_folder_loads_as_f32)
{
    char dir[64], gen[512], var[512], path[600];
    setup(dir, sizeof dir, gen, var, "tiny-llama");
    snprintf(path, sizeof path, "%s/model.safetensors", var);
    rewrite(gen, path, &(rewrite_opts){.dtype = ST_F16});
    kv_model m, ref;
    kv_err e = {{0}};
    ck_assert_msg(load(var, &m, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(m.wtype, KERN_F32);
    ck_assert_int_eq(load(gen, &ref, &e), 0);
    /* Rounded to half precision: a different model, close to the original. */
    ck_assert_uint_ne(m.fingerprint, ref.fingerprint);
    ck_assert_float_eq_tol(m.final_norm[3], ref.final_norm[3], 1e-3);
    model_free(&m);
    model_free(&ref);
    test_rmtree(dir);
}
END_TEST

Suite *model_suite(void)
{
    Suite *s = suite_create("model");
    TCase *tc = tcase_create("folders");
    tcase_add_test(tc, test_missing_tensor_named);
    tcase_add_test(tc, test_progress_callback);
    tcase_add_test(tc, test_shape_mismatch_named);
    tcase_add_test(tc, test_fewer_layers_than_the_checkpoint_refused);
    tcase_add_test(tc, test_unreadable_dtype_named);
    tcase_add_loop_test(tc, test_gemma3_conditional_generation_prefixes, 0, 2);
    tcase_add_test(tc, test_sharded_folder_same_model);
    tcase_add_test(tc, test_f16_folder_loads_as_f32);
    suite_add_tcase(s, tc);
    return s;
}
