/* check_dump.c — the dump module: what a real run writes reads back bit
 * for bit (rows, tokens, /output, attributes, fingerprints, selections,
 * compression), identical runs give identical files, the chunked engine
 * dumps the reference's rows, a writer killed mid-run leaves a readable
 * partial file, write errors are reported, and the reader and validator
 * name what is wrong with bad files (built here with the HDF5 API). */
#include <check.h>
#include <fcntl.h>
#include <hdf5.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "chunked/chunked.h"
#include "dump/dump.h"
#include "dump/dump_internal.h"
#include "model/pool.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "h5edit.h"
#include "testutil.h"

#define P 40            /* prompt: longer than tiny-gemma3's window (12) */
#define NEW 8
#define T (P + NEW)     /* tokens */
#define ROWS (T - 1)    /* positions forwarded: the last token is never fed back */
#define SETTINGS "{\"chunk\":5,\"cache\":\"ring\"}"

/* ------------------------------------------------------------------ */
/* Running engines                                                      */

static void open_model(const char *name, kv_model *m)
{
    kv_err e = {{0}};
    model_opts mo = {.wtype = -1};
    ck_assert_msg(model_from_preset(name, 0, &mo, m, &e) == 0, "%s", e.msg);
}

/* Runs the reference (or the chunked engine, ring cache, chunk 5) on a
 * fixed prompt, emitting to obs; returns generate's code. */
static int run_engine(const kv_model *m, bool chunked, kv_observer *obs)
{
    kv_err e = {{0}};
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    kv_engine *eng;
    if (chunked) {
        chk_opts co;
        chk_opts_default(&co);
        co.cache = CACHE_RING;
        co.chunk = 5;
        co.max_ctx = T;
        eng = chk_create(m, &kc, &co, obs, &e);
    } else {
        ref_opts ro = {.max_ctx = T, .prefill_step = 0};
        eng = ref_create(m, &kc, &ro, obs, &e);
    }
    ck_assert_msg(eng != NULL, "%s", e.msg);
    int32_t prompt[P];
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m->cfg.vocab);
    gen_opts go = {.max_new = NEW, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    int rc = generate(eng, &m->cfg, prompt, P, &go, obs, &res, &e);
    gen_result_free(&res);
    engine_free(eng);
    return rc;
}

static capture *capture_run(const kv_model *m)
{
    capture *c = capture_new(T);
    ck_assert_int_eq(run_engine(m, false, &c->base), 0);
    return c;
}

static dump_meta meta_for(const kv_model *m, const char *engine)
{
    dump_meta meta = {.engine = engine, .engine_settings = SETTINGS, .cfg = &m->cfg,
                      .weight_fingerprint = m->fingerprint, .seed = 7,
                      .tool_version = "kvdiff test", .max_positions = T};
    return meta;
}

/* Writes a whole run to path with options o; the run must complete. */
static void dump_run(const kv_model *m, bool chunked, const char *path, const dump_opts *o)
{
    kv_err e = {{0}};
    dump_meta meta = meta_for(m, chunked ? "chunked" : "reference");
    dump_writer *w = dump_create(path, &meta, o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    ck_assert_int_eq(run_engine(m, chunked, dump_observer(w)), 0);
    ck_assert_ptr_null(dump_error(w));
    ck_assert_msg(dump_close(w, NULL, &e) == 0, "%s", e.msg);
}

static dump_file *open_ok(const char *path)
{
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    return f;
}

static void path_in(char *buf, size_t n, const char *dir, const char *name)
{
    snprintf(buf, n, "%s/%s", dir, name);
}

/* ------------------------------------------------------------------ */
/* Validation reports                                                   */

typedef struct {
    int lines, notes;
    char text[8192];
} report_log;

static void collect(void *ctx, const char *line)
{
    report_log *r = ctx;
    r->lines++;
    r->notes += strncmp(line, "note: ", 6) == 0;
    size_t used = strlen(r->text);
    snprintf(r->text + used, sizeof r->text - used, "%s\n", line);
}

static int validate(const char *path, report_log *r)
{
    kv_err e = {{0}};
    memset(r, 0, sizeof *r);
    int n = dump_validate(path, collect, r, &e);
    if (n < 0)
        snprintf(r->text, sizeof r->text, "%s", e.msg);
    return n;
}

static void assert_valid(const char *path)
{
    report_log r;
    int n = validate(path, &r);
    ck_assert_msg(n == 0 && r.notes == 0, "%s: %d violations:\n%s", path, n, r.text);
}

/* ------------------------------------------------------------------ */
/* Comparing a dump with a capture                                      */

/* Every recorded stage of every layer equals the capture's rows
 * [first, first + rows); returns how many datasets were compared. */
static int compare_full(const dump_file *f, const capture *c, int64_t want_first, int64_t want_rows)
{
    kv_err e = {{0}};
    kv_config cfg;
    ck_assert_msg(dump_model_config(f, &cfg, &e) == 0, "%s", e.msg);
    int compared = 0;
    for (int l = -1; l < cfg.n_layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            if ((st >= STAGE_LAYER_COUNT) != (l == -1))
                continue;
            dump_dataset_info di = dump_stage_info(f, l, st);
            if (!di.present)
                continue;
            int nc;
            const float *want = capture_get(c, st, l, &nc);
            ck_assert_ptr_nonnull(want);
            ck_assert_int_eq(di.cols, nc);
            ck_assert_int_eq(di.first_position, want_first);
            ck_assert_int_eq(di.rows, want_rows);
            float *got = malloc((size_t)di.rows * nc * sizeof(float));
            ck_assert_msg(dump_read_rows(f, l, st, 0, di.rows, got, &e) == 0, "%s", e.msg);
            ck_assert_msg(memcmp(got, want + (size_t)want_first * nc, (size_t)di.rows * nc * 4) == 0,
                          "%s of layer %d differs", stage_name(st), l);
            free(got);
            compared++;
        }
    return compared;
}

static void check_tokens(const dump_file *f, const capture *c, int64_t n, int64_t prompt)
{
    kv_err e = {{0}};
    ck_assert_int_eq(dump_n_tokens(f), n);
    ck_assert_int_eq(dump_prompt_length(f), prompt);
    int32_t *tok = malloc((size_t)n * sizeof *tok + 4);
    ck_assert_msg(dump_read_tokens(f, tok, &e) == 0, "%s", e.msg);
    ck_assert(memcmp(tok, c->tokens, (size_t)n * 4) == 0);
    free(tok);
}

typedef struct {
    int id;
    float v;
} id_val;

static int by_value_then_id(const void *a, const void *b)
{
    const id_val *x = a, *y = b;
    if (x->v != y->v)
        return x->v > y->v ? -1 : 1;
    return x->id - y->id;
}

/* /output against lse and top-k computed here from the captured logits. */
static void check_output(const dump_file *f, const capture *c, int V, int64_t first, int64_t rows)
{
    kv_err e = {{0}};
    dump_dataset_info oi = dump_output_info(f);
    const int K = dump_output_k(f);
    ck_assert(oi.present);
    ck_assert_int_eq(K, 8);
    ck_assert_int_eq(oi.first_position, first);
    ck_assert_int_eq(oi.rows, rows);
    float *lse = malloc((size_t)rows * 4), *vals = malloc((size_t)rows * K * 4);
    int32_t *ids = malloc((size_t)rows * K * 4);
    id_val *sorted = malloc((size_t)V * sizeof *sorted);
    ck_assert_msg(dump_read_output(f, 0, rows, lse, ids, vals, &e) == 0, "%s", e.msg);
    const float *logits = capture_get(c, STAGE_LOGITS, -1, NULL);
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + (size_t)(first + r) * V;
        double m = -INFINITY, s = 0;
        for (int i = 0; i < V; i++)
            m = x[i] > m ? x[i] : m;
        for (int i = 0; i < V; i++)
            s += exp((double)x[i] - m);
        ck_assert_double_eq_tol(lse[r], m + log(s), 1e-5 * fabs(m + log(s)) + 1e-6);
        for (int i = 0; i < V; i++)
            sorted[i] = (id_val){i, x[i]};
        qsort(sorted, (size_t)V, sizeof *sorted, by_value_then_id);
        for (int k = 0; k < K; k++) {
            ck_assert_int_eq(ids[r * K + k], sorted[k].id);
            ck_assert(vals[r * K + k] == sorted[k].v);
        }
    }
    free(lse);
    free(vals);
    free(ids);
    free(sorted);
}

/* ------------------------------------------------------------------ */
/* Round trips                                                          */

START_TEST(test_round_trip_full)
{
    char dir[64], path[128];
    kv_model m;
    kv_err e = {{0}};
    kv_config cfg;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "full.h5");
    open_model("tiny-gemma3", &m);
    capture *c = capture_run(&m);
    dump_opts o;
    dump_opts_default(&o);
    o.block_rows = 16;  /* 47 rows: two full blocks and a short one */
    dump_run(&m, false, path, &o);

    dump_file *f = open_ok(path);
    ck_assert_str_eq(dump_path(f), path);
    ck_assert(dump_is_complete(f));
    ck_assert(!dump_is_fingerprint(f));
    ck_assert_str_eq(dump_attr(f, "format"), DUMP_FORMAT);
    ck_assert_int_eq(dump_attr_int(f, "format_version", 0), DUMP_VERSION);
    ck_assert_str_eq(dump_attr(f, "engine"), "reference");
    ck_assert_str_eq(dump_attr(f, "engine_settings"), SETTINGS);
    ck_assert_str_eq(dump_attr(f, "tool_version"), "kvdiff test");
    ck_assert_int_eq(dump_attr_int(f, "seed", 0), 7);
    char fp[17];
    snprintf(fp, sizeof fp, "%016llx", (unsigned long long)m.fingerprint);
    ck_assert_str_eq(dump_attr(f, "weight_fingerprint"), fp);
    ck_assert_ptr_null(dump_attr(f, "no_such_attribute"));
    ck_assert_int_eq(dump_attr_int(f, "no_such_attribute", -5), -5);

    /* The model config round-trips in the fields the format lists. */
    ck_assert_msg(dump_model_config(f, &cfg, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(cfg.arch, ARCH_GEMMA3);
    ck_assert_str_eq(cfg.model_type, m.cfg.model_type);
    ck_assert_int_eq(cfg.hidden, m.cfg.hidden);
    ck_assert_int_eq(cfg.n_layers, m.cfg.n_layers);
    ck_assert_int_eq(dump_n_layers(f), m.cfg.n_layers);
    ck_assert_int_eq(cfg.n_heads, m.cfg.n_heads);
    ck_assert_int_eq(cfg.n_kv_heads, m.cfg.n_kv_heads);
    ck_assert_int_eq(cfg.head_dim, m.cfg.head_dim);
    ck_assert_int_eq(cfg.intermediate, m.cfg.intermediate);
    ck_assert_int_eq(cfg.vocab, m.cfg.vocab);
    ck_assert_int_eq(cfg.sliding_window, m.cfg.sliding_window);
    ck_assert(cfg.rms_eps == m.cfg.rms_eps && cfg.rope_theta == m.cfg.rope_theta &&
              cfg.rope_local_theta == m.cfg.rope_local_theta);
    ck_assert(memcmp(cfg.layer_type, m.cfg.layer_type, (size_t)cfg.n_layers) == 0);
    ck_assert(memcmp(cfg.kv_owner, m.cfg.kv_owner, (size_t)cfg.n_layers * 2) == 0);

    check_tokens(f, c, T, P);
    /* Every layer stage of every layer, embed and final_norm; no logits. */
    ck_assert_int_eq(compare_full(f, c, 0, ROWS), m.cfg.n_layers * test_layer_stages(&m.cfg) + 1);
    ck_assert(!dump_stage_info(f, -1, STAGE_LOGITS).present);
    ck_assert(!dump_stage_info(f, m.cfg.n_layers, STAGE_Q).present);
    ck_assert(!dump_stage_info(f, 0, STAGE_EMBED).present);
    check_output(f, c, m.cfg.vocab, 0, ROWS);
    dump_file_close(f);

    /* Layer attributes, through HDF5 itself. */
    hid_t h = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    ck_assert(h >= 0);
    for (int l = 0; l < m.cfg.n_layers; l++) {
        char g[32], *att = NULL;
        long long window = -1, owner = -1;
        double theta = 0;
        snprintf(g, sizeof g, "/layers/%d", l);
        hid_t a = H5Aopen_by_name(h, g, "window", H5P_DEFAULT, H5P_DEFAULT);
        ck_assert(a >= 0 && H5Aread(a, H5T_NATIVE_LLONG, &window) >= 0);
        H5Aclose(a);
        a = H5Aopen_by_name(h, g, "kv_owner", H5P_DEFAULT, H5P_DEFAULT);
        ck_assert(a >= 0 && H5Aread(a, H5T_NATIVE_LLONG, &owner) >= 0);
        H5Aclose(a);
        a = H5Aopen_by_name(h, g, "rope_theta", H5P_DEFAULT, H5P_DEFAULT);
        ck_assert(a >= 0 && H5Aread(a, H5T_NATIVE_DOUBLE, &theta) >= 0);
        H5Aclose(a);
        a = H5Aopen_by_name(h, g, "attention", H5P_DEFAULT, H5P_DEFAULT);
        hid_t t = H5Aget_type(a);
        ck_assert(a >= 0 && H5Tis_variable_str(t) > 0 && H5Aread(a, t, &att) >= 0);
        ck_assert_str_eq(att, m.cfg.layer_type[l] == ATTN_SLIDING ? "sliding" : "global");
        H5free_memory(att);
        H5Tclose(t);
        H5Aclose(a);
        ck_assert_int_eq(window, config_layer_window(&m.cfg, l));
        ck_assert_int_eq(owner, m.cfg.kv_owner[l]);
        ck_assert(theta == config_layer_theta(&m.cfg, l));
    }
    H5Fclose(h);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* KV-shared followers have no k/v; full logits are stored when asked. */
START_TEST(test_kv_shared_and_logits)
{
    char dir[64], path[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "shared.h5");
    open_model("tiny-gemma3-kvshared", &m);
    capture *c = capture_run(&m);
    dump_opts o;
    dump_opts_default(&o);
    o.full_logits = true;
    dump_run(&m, false, path, &o);
    dump_file *f = open_ok(path);
    int followers = 0;
    for (int l = 0; l < m.cfg.n_layers; l++) {
        bool owns = m.cfg.kv_owner[l] == l;
        followers += !owns;
        ck_assert(dump_stage_info(f, l, STAGE_K).present == owns);
        ck_assert(dump_stage_info(f, l, STAGE_V).present == owns);
        ck_assert(dump_stage_info(f, l, STAGE_Q).present);
    }
    ck_assert_int_gt(followers, 0);
    ck_assert_int_eq(compare_full(f, c, 0, ROWS),
                     m.cfg.n_layers * test_layer_stages(&m.cfg) - 2 * followers + 2);
    ck_assert(dump_stage_info(f, -1, STAGE_LOGITS).present);
    check_output(f, c, m.cfg.vocab, 0, ROWS);
    dump_file_close(f);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_fingerprint)
{
    char dir[64], path[128];
    kv_model m;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "fp.h5");
    open_model("tiny-gemma3", &m);
    capture *c = capture_run(&m);
    dump_opts o;
    dump_opts_default(&o);
    o.fingerprint = true;
    o.block_rows = 10;
    dump_run(&m, false, path, &o);
    dump_file *f = open_ok(path);
    ck_assert(dump_is_fingerprint(f));
    ck_assert_str_eq(dump_attr(f, "mode"), "fingerprint");
    uint64_t hash[ROWS];
    float stats[ROWS * 2], row[1];
    int checked = 0;
    for (int l = -1; l < m.cfg.n_layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            dump_dataset_info di = dump_stage_info(f, l, st);
            if (!di.present)
                continue;
            int nc;
            const float *want = capture_get(c, st, l, &nc);
            ck_assert_int_eq(di.rows, ROWS);
            ck_assert_int_eq(di.cols, 1);
            ck_assert_msg(dump_read_hashes(f, l, st, 0, ROWS, hash, stats, &e) == 0, "%s", e.msg);
            for (int r = 0; r < ROWS; r++) {
                const float *x = want + (size_t)r * nc;
                double ss = 0;
                float mx = 0;
                for (int j = 0; j < nc; j++) {
                    ss += (double)x[j] * x[j];
                    mx = fabsf(x[j]) > mx ? fabsf(x[j]) : mx;
                }
                ck_assert_msg(hash[r] == XXH3_64bits(x, (size_t)nc * 4), "%s layer %d row %d",
                              stage_name(st), l, r);
                ck_assert(stats[2 * r] == (float)sqrt(ss) && stats[2 * r + 1] == mx);
            }
            checked++;
        }
    ck_assert_int_eq(checked, m.cfg.n_layers * test_layer_stages(&m.cfg) + 1);
    /* Rows are not there to read; /output is as in full mode. */
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_Q, 0, 1, row, &e), -1);
    ck_assert_ptr_nonnull(strstr(e.msg, "fingerprint"));
    check_output(f, c, m.cfg.vocab, 0, ROWS);
    dump_file_close(f);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_selection)
{
    char dir[64], path[128];
    kv_model m;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "sel.h5");
    open_model("tiny-gemma3", &m);
    capture *c = capture_run(&m);
    dump_opts o;
    dump_opts_default(&o);
    ck_assert(dump_parse_layers("2:3", &o, &e) == 0);
    ck_assert(dump_parse_positions("10:20", &o, &e) == 0);
    ck_assert(dump_parse_stages("k,v,x_out", &o, &e) == 0);
    o.block_rows = 4;
    dump_run(&m, false, path, &o);
    dump_file *f = open_ok(path);
    for (int l = -1; l < m.cfg.n_layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            bool want = (l == 2 || l == 3) && (st == STAGE_K || st == STAGE_V || st == STAGE_X_OUT);
            ck_assert_msg(dump_stage_info(f, l, st).present == want, "%s of layer %d",
                          stage_name(st), l);
        }
    ck_assert_int_eq(compare_full(f, c, 10, 11), 6);
    check_tokens(f, c, T, P);      /* tokens are always whole */
    check_output(f, c, m.cfg.vocab, 10, 11);
    dump_file_close(f);
    assert_valid(path);
    /* Positions past the run: nothing recorded, still valid. */
    ck_assert(dump_parse_positions("45:", &o, &e) == 0);
    dump_run(&m, false, path, &o);
    f = open_ok(path);
    ck_assert_int_eq(compare_full(f, c, 45, ROWS - 45), 6);
    dump_file_close(f);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

static bool has_deflate(const char *path, const char *dset)
{
    hid_t h = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT), d = H5Dopen2(h, dset, H5P_DEFAULT);
    hid_t p = H5Dget_create_plist(d);
    bool found = false;
    for (int i = 0; i < H5Pget_nfilters(p); i++) {
        unsigned flags;
        size_t n = 0;
        found |= H5Pget_filter2(p, (unsigned)i, &flags, &n, NULL, 0, NULL, NULL) == H5Z_FILTER_DEFLATE;
    }
    H5Pclose(p);
    H5Dclose(d);
    H5Fclose(h);
    return found;
}

START_TEST(test_compress)
{
    char dir[64], path[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "z.h5");
    open_model("tiny-gemma3", &m);
    capture *c = capture_run(&m);
    dump_opts o;
    dump_opts_default(&o);
    o.compress = true;
    o.block_rows = 7;
    dump_run(&m, false, path, &o);
    ck_assert(has_deflate(path, "/layers/0/q"));
    ck_assert(has_deflate(path, "/tokens"));
    dump_file *f = open_ok(path);
    check_tokens(f, c, T, P);
    ck_assert_int_eq(compare_full(f, c, 0, ROWS), m.cfg.n_layers * test_layer_stages(&m.cfg) + 1);
    check_output(f, c, m.cfg.vocab, 0, ROWS);
    dump_file_close(f);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* Rows [r0, r0 + n) of a stage through dump_read_rows (malloc'd). */
static float *rows_of(const dump_file *f, int l, int st, int64_t r0, int64_t n, int cols)
{
    kv_err e = {{0}};
    float *x = malloc((size_t)(n ? n : 1) * cols * sizeof(float));
    ck_assert_msg(dump_read_rows(f, l, st, r0, n, x, &e) == 0, "%s", e.msg);
    return x;
}

/* Every stage of f reads the same as through libhdf5 (h): whole, and in
 * ranges that cross chunk boundaries; through the parallel reader too
 * when parallel. Returns the stages checked. */
static int same_as_libhdf5(const dump_file *f, const dump_file *h, int layers, bool parallel)
{
    kv_err e = {{0}};
    int checked = 0;
    for (int l = -1; l < layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            dump_dataset_info di = dump_stage_info(f, l, st);
            if (!di.present)
                continue;
            ck_assert_int_eq(dump_rows_parallel(h, l, st), 0);
            ck_assert_int_eq(dump_rows_parallel(f, l, st), parallel);
            for (int64_t r0 = 0; r0 < di.rows; r0 += 5) {
                const int64_t n = r0 == 0 ? di.rows : di.rows - r0 < 9 ? di.rows - r0 : 9;
                const size_t bytes = (size_t)n * di.cols * sizeof(float);
                float *x = rows_of(f, l, st, r0, n, di.cols), *y = rows_of(h, l, st, r0, n, di.cols);
                ck_assert_msg(memcmp(x, y, bytes) == 0, "%s of layer %d, rows %lld+%lld",
                              stage_name(st), l, (long long)r0, (long long)n);
                if (parallel) {
                    memset(x, 0xff, bytes);
                    ck_assert_msg(dump_read_rows_parallel(f, l, st, r0, n, x, &e) == 0, "%s",
                                  e.msg);
                    ck_assert(memcmp(x, y, bytes) == 0);
                }
                free(x);
                free(y);
            }
            uint64_t ha[ROWS], hb[ROWS];
            float sa[2 * ROWS], sb[2 * ROWS];
            ck_assert(di.rows <= ROWS);
            ck_assert(dump_read_hashes(f, l, st, 0, di.rows, ha, sa, &e) == 0);
            ck_assert(dump_read_hashes(h, l, st, 0, di.rows, hb, sb, &e) == 0);
            ck_assert(memcmp(ha, hb, (size_t)di.rows * 8) == 0 &&
                      memcmp(sa, sb, (size_t)di.rows * 8) == 0);
            checked++;
        }
    return checked;
}

/* Plain datasets are read at their chunks' file offsets, past libhdf5,
 * and from several threads; the bytes are libhdf5's, chunk boundaries and
 * the short last chunk included. Compressed files and files with a user
 * block ahead of the HDF5 data are read through libhdf5. */
START_TEST(test_direct_reads)
{
    char dir[64], path[128], zpath[128], jam[128], ub[128], cmd[512];
    kv_model m;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "plain.h5");
    path_in(zpath, sizeof zpath, dir, "z.h5");
    path_in(jam, sizeof jam, dir, "jammed.h5");
    path_in(ub, sizeof ub, dir, "ub.txt");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    o.block_rows = 7;   /* ROWS = 47: six full chunks and a short one */
    dump_run(&m, false, path, &o);
    o.compress = true;
    dump_run(&m, false, zpath, &o);
    dump_set_direct_reads(false);
    dump_file *h = open_ok(path);
    dump_set_direct_reads(true);
    dump_file *f = open_ok(path);
    const int stages = m.cfg.n_layers * test_layer_stages(&m.cfg) + 1;
    ck_assert_int_eq(same_as_libhdf5(f, h, m.cfg.n_layers, true), stages);
    /* the parallel reader checks its range like the others */
    float row[4096];
    ck_assert_int_eq(dump_read_rows_parallel(f, 0, STAGE_X_IN, ROWS - 1, 2, row, &e), -1);
    ck_assert_msg(strstr(e.msg, "rows 46..47") != NULL, "%s", e.msg);

    dump_file *z = open_ok(zpath);
    ck_assert_int_eq(same_as_libhdf5(z, h, m.cfg.n_layers, false), stages);
    dump_file_close(z);

    FILE *fp = fopen(ub, "w");
    ck_assert_ptr_nonnull(fp);
    fputs("a user block written ahead of the HDF5 file\n", fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "h5jam -i %s -u %s -o %s", path, ub, jam);
    ck_assert_msg(system(cmd) == 0, "%s failed (hdf5-tools is a build dependency)", cmd);
    dump_file *j = open_ok(jam);
    ck_assert_int_eq(same_as_libhdf5(j, h, m.cfg.n_layers, false), stages);
    dump_file_close(j);

    dump_file_close(f);
    dump_file_close(h);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* Everything a reader reports of f, against g (the same file, opened
 * without a survey): shapes, index digests (checked), rows both ways,
 * hashes and statistics. Returns the stages seen. */
static int same_as_plain(const dump_file *f, const dump_file *g, int layers)
{
    int seen = 0;
    kv_err e = {{0}};
    for (int l = -1; l < layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            dump_dataset_info a = dump_stage_info(f, l, st), b = dump_stage_info(g, l, st);
            dump_dataset_info ha = dump_hash_info(f, l, st), hb = dump_hash_info(g, l, st);
            ck_assert(a.present == b.present && a.rows == b.rows && a.cols == b.cols &&
                      a.first_position == b.first_position);
            ck_assert(ha.present == hb.present && ha.rows == hb.rows && ha.cols == hb.cols &&
                      ha.first_position == hb.first_position);
            dump_stage_digest da = dump_digest(f, l, st, true), db = dump_digest(g, l, st, true);
            ck_assert(da.present == db.present && da.rows == db.rows &&
                      da.digest[0] == db.digest[0] && da.digest[1] == db.digest[1]);
            if (!a.present)
                continue;
            ck_assert_int_eq(dump_rows_parallel(f, l, st), dump_rows_parallel(g, l, st));
            float *x = rows_of(f, l, st, 0, a.rows, a.cols), *y = rows_of(g, l, st, 0, a.rows, a.cols);
            const size_t bytes = (size_t)a.rows * a.cols * sizeof(float);
            ck_assert(memcmp(x, y, bytes) == 0);
            if (dump_rows_parallel(f, l, st)) {
                memset(x, 0xff, bytes);
                ck_assert(dump_read_rows_parallel(f, l, st, 0, a.rows, x, &e) == 0);
                ck_assert(memcmp(x, y, bytes) == 0);
            }
            free(x);
            free(y);
            uint64_t hx[ROWS], hy[ROWS];
            float sx[2 * ROWS], sy[2 * ROWS];
            ck_assert(a.rows <= ROWS);
            ck_assert(dump_read_hashes(f, l, st, 0, a.rows, hx, sx, &e) == 0);
            ck_assert(dump_read_hashes(g, l, st, 0, a.rows, hy, sy, &e) == 0);
            ck_assert(memcmp(hx, hy, (size_t)a.rows * 8) == 0 && memcmp(sx, sy, (size_t)a.rows * 8) == 0);
            seen++;
        }
    return seen;
}

static void survey_all(dump_file *f, dump_file *g, int layers)
{
    dump_survey_item items[2 * (KV_MAX_LAYERS + 1) * STAGE_COUNT];
    int n = 0;
    for (int l = -1; l < layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++)
            items[n++] = (dump_survey_item){.layer = l, .stage = st, .what = 63};
    memcpy(items + n, items, (size_t)n * sizeof *items);
    dump_file *files[2] = {f, g};
    dump_survey(files, g ? 2 : 1, items, n);
}

/* A report with one well-formed entry that lies (layer 0's x_in as 3 x 5)
 * and then a tag that is none: taken in whole or not at all, so nothing of
 * it may show. */
static void garbage_child(int fd)
{
    unsigned char b[128];
    size_t n = 0;
#define ADD(v) (memcpy(b + n, &(v), sizeof(v)), n += sizeof(v))
    const uint32_t magic = 0x4b565356u;
    const uint8_t tag = 'M', present = 1, bad = 'Q';
    const char path[] = "/layers/0/x_in";
    const uint16_t len = sizeof path - 1;
    const int32_t rank = 2, kind = 0, mapped = -1;
    const uint64_t dims[2] = {3, 5};
    const int64_t first = 0;
    ADD(magic);
    ADD(tag);
    ADD(len);
    memcpy(b + n, path, len), n += len;
    ADD(present);
    ADD(rank);
    ADD(dims[0]);
    ADD(dims[1]);
    ADD(kind);
    ADD(first);
    ADD(mapped);
    ADD(bad);
#undef ADD
    ck_assert(write(fd, b, n) == (ssize_t)n);
}

static void dying_child(int fd)
{
    (void)fd;
    raise(SIGKILL);
}

/* A survey child that sends its pid and then blocks, as a child on a
 * large dump would still be working when its parent is killed. */
static int blocked_pid_fd = -1;

static void blocked_child(int fd)
{
    (void)fd;
    const pid_t me = getpid();
    ck_assert(write(blocked_pid_fd, &me, sizeof me) == (ssize_t)sizeof me);
    for (;;)
        pause();
}

/* The process running a compare is killed while a survey child works: the
 * child must go with it (it outlived it by seconds, reading on). */
START_TEST(test_survey_child_dies_with_its_parent)
{
    char dir[64], path[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "s.h5");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    dump_run(&m, false, path, &o);
    const int layers = m.cfg.n_layers;
    model_free(&m);
    /* orphans come to this process, which can then wait for them */
    ck_assert(prctl(PR_SET_CHILD_SUBREAPER, 1) == 0);
    int p[2];
    ck_assert(pipe(p) == 0);
    const pid_t parent = fork();
    ck_assert(parent >= 0);
    if (parent == 0) {
        close(p[0]);
        blocked_pid_fd = p[1];
        dump_survey_child_hook(blocked_child);
        dump_file *f = open_ok(path);
        survey_all(f, NULL, layers);
        _exit(0);
    }
    close(p[1]);
    pid_t child = -1;
    ck_assert(read(p[0], &child, sizeof child) == (ssize_t)sizeof child && child > 0);
    close(p[0]);
    ck_assert(kill(parent, SIGKILL) == 0);
    int st;
    ck_assert(waitpid(parent, &st, 0) == parent);
    bool gone = false;
    for (int i = 0; i < 12000 && !gone; i++) {  /* up to 2 min; at once when it works */
        gone = waitpid(child, &st, WNOHANG) == child;
        if (!gone)
            nanosleep(&(struct timespec){0, 10000000}, NULL);
    }
    if (!gone) {
        kill(child, SIGKILL);
        waitpid(child, &st, 0);
    }
    ck_assert_msg(gone, "the survey child outlived its killed parent");
    ck_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
    test_rmtree(dir);
}
END_TEST

/* A survey child's findings, taken in by the parent, read back as the
 * file does without them: shapes, chunk maps (direct and parallel reads),
 * checked index rows. A child that writes garbage, or dies, leaves the
 * parent reading as usual. Both files of a pair at once, too. */
START_TEST(test_survey)
{
    char dir[64], path[128], other[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "s.h5");
    path_in(other, sizeof other, dir, "t.h5");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    o.block_rows = 7;
    dump_run(&m, false, path, &o);
    dump_run(&m, true, other, &o);
    const int stages = m.cfg.n_layers * test_layer_stages(&m.cfg) + 1;
    dump_file *plain = open_ok(path), *plain2 = open_ok(other);
    void (*hooks[])(int) = {NULL, garbage_child, dying_child};
    for (size_t k = 0; k < sizeof hooks / sizeof *hooks; k++) {
        dump_survey_child_hook(hooks[k]);
        dump_file *f = open_ok(path), *g = open_ok(other);
        survey_all(f, k == 0 ? g : NULL, m.cfg.n_layers);
        const int64_t before = dump_datasets_opened(f), before2 = dump_datasets_opened(g);
        ck_assert_int_eq(same_as_plain(f, plain, m.cfg.n_layers), stages);
        ck_assert_int_eq(same_as_plain(g, plain2, m.cfg.n_layers), stages);
        /* taken in: the parent opens nothing; else it opens what it reads */
        if (k == 0)
            ck_assert(dump_datasets_opened(f) == before && dump_datasets_opened(g) == before2);
        else
            ck_assert(dump_datasets_opened(f) > before + stages && dump_datasets_opened(g) > before2);
        dump_file_close(f);
        dump_file_close(g);
    }
    dump_survey_child_hook(NULL);
    /* off: a no-op */
    dump_set_survey(false);
    dump_file *f = open_ok(path);
    survey_all(f, NULL, m.cfg.n_layers);
    const int64_t before = dump_datasets_opened(f);
    ck_assert_int_eq(same_as_plain(f, plain, m.cfg.n_layers), stages);
    ck_assert(dump_datasets_opened(f) > before + stages);
    dump_file_close(f);
    dump_set_survey(true);
    dump_file_close(plain);
    dump_file_close(plain2);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* What libhdf5 does on a damaged heap: loops, burning CPU. */
static void preflight_hangs(void)
{
    for (volatile unsigned long x = 0;; x++)
        ;
}

static void preflight_crashes(void)
{
    raise(SIGSEGV);
}

/* libhdf5 crashing or looping on a damaged file's strings, played by the
 * preflight child: the open fails with what happened, within the guard's
 * time; a sound child lets it through. */
START_TEST(test_preflight)
{
    char dir[64], path[128];
    kv_model m;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "p.h5");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    dump_run(&m, false, path, &o);
    dump_hang_guard(1, NULL);
    dump_preflight_child_hook(preflight_hangs);
    ck_assert_ptr_null(dump_open(path, &e));
    ck_assert_msg(strstr(e.msg, "does not return") != NULL, "%s", e.msg);
    dump_preflight_child_hook(preflight_crashes);
    ck_assert_ptr_null(dump_open(path, &e));
    ck_assert_msg(strstr(e.msg, "crashes reading") != NULL, "%s", e.msg);
    /* the same with stdin, stdout and stderr closed: the pipe the parent
     * waits on must not land on a descriptor the child sends to /dev/null */
    dump_preflight_child_hook(preflight_hangs);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(0);
        close(1);
        close(2);
        kv_err ce = {{0}};
        _exit(!dump_open(path, &ce) && strstr(ce.msg, "does not return") ? 0 : 1);
    }
    /* No clock: the child's CPU limit ends the loop (a hang would meet
     * the test's own time-out). */
    int st = -1;
    ck_assert_int_eq(waitpid(pid, &st, 0), pid);
    ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "with the standard descriptors closed the open hangs or succeeds");
    dump_preflight_child_hook(NULL);
    dump_hang_guard(0, NULL);
    dump_file_close(open_ok(path));
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* A dataset of more chunks than DUMP_DIRECT_MAX_CHUNKS is not mapped
 * (finding each chunk's offset would cost in the square of their count);
 * one of exactly that many is, and reads back its bytes. */
START_TEST(test_direct_chunk_cap)
{
    char dir[64], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "chunks.h5");
    hid_t h = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(h >= 0);
    const hsize_t n = DUMP_DIRECT_MAX_CHUNKS + 1;
    float v[(DUMP_DIRECT_MAX_CHUNKS + 1) * 3];
    for (hsize_t i = 0; i < n * 3; i++)
        v[i] = (float)i * 0.5f;
    hsize_t chunk[2] = {1, 3};
    hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    ck_assert(H5Pset_chunk(dcpl, 2, chunk) >= 0);
    for (int k = 0; k < 2; k++) {
        hsize_t dims[2] = {n - (hsize_t)(k == 0), 3};
        hid_t s = H5Screate_simple(2, dims, NULL);
        hid_t d = H5Dcreate2(h, k == 0 ? "at_cap" : "past_cap", H5T_IEEE_F32LE, s, H5P_DEFAULT,
                             dcpl, H5P_DEFAULT);
        ck_assert(d >= 0 && H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
        H5Dclose(d);
        H5Sclose(s);
    }
    H5Pclose(dcpl);
    H5Fclose(h);
    h = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    int fd = open(path, O_RDONLY);
    struct stat st;
    ck_assert(h >= 0 && fd >= 0 && fstat(fd, &st) == 0 && dump_file_plain(h));
    for (int k = 0; k < 2; k++) {
        hid_t d = H5Dopen2(h, k == 0 ? "at_cap" : "past_cap", H5P_DEFAULT);
        dump_rowmap m;
        ck_assert_int_eq(dump_rowmap_build(d, H5T_IEEE_F32LE, fd, st.st_size, &m), k == 0);
        if (k == 0) {
            float back[DUMP_DIRECT_MAX_CHUNKS * 3];
            kv_err e = {{0}};
            ck_assert_int_eq(m.n_off, DUMP_DIRECT_MAX_CHUNKS);
            ck_assert_int_eq(dump_rowmap_read(&m, fd, path, 0, (int64_t)n - 1, back, &e), 0);
            ck_assert(memcmp(back, v, sizeof back) == 0);
        }
        dump_rowmap_free(&m);
        H5Dclose(d);
    }
    close(fd);
    H5Fclose(h);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Identical runs, engines                                              */

static char *slurp(const char *path, size_t *n)
{
    FILE *fp = fopen(path, "rb");
    ck_assert_ptr_nonnull(fp);
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc((size_t)len + 1);
    ck_assert(fread(buf, 1, (size_t)len, fp) == (size_t)len);
    fclose(fp);
    *n = (size_t)len;
    return buf;
}

/* Every stage dataset and /output of a equals b's, bytes for bytes. */
static void assert_same_datasets(const dump_file *a, const dump_file *b, int layers)
{
    kv_err e = {{0}};
    for (int l = -1; l < layers; l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            dump_dataset_info da = dump_stage_info(a, l, st), db = dump_stage_info(b, l, st);
            ck_assert(da.present == db.present);
            if (!da.present)
                continue;
            ck_assert(da.rows == db.rows && da.cols == db.cols &&
                      da.first_position == db.first_position);
            size_t n = (size_t)da.rows * da.cols;
            float *x = malloc(n * 4), *y = malloc(n * 4);
            ck_assert(dump_read_rows(a, l, st, 0, da.rows, x, &e) == 0);
            ck_assert(dump_read_rows(b, l, st, 0, db.rows, y, &e) == 0);
            ck_assert_msg(memcmp(x, y, n * 4) == 0, "%s of layer %d differs", stage_name(st), l);
            free(x);
            free(y);
        }
    dump_dataset_info oa = dump_output_info(a), ob = dump_output_info(b);
    ck_assert(oa.rows == ob.rows && oa.first_position == ob.first_position);
    int K = dump_output_k(a);
    size_t n = (size_t)oa.rows * K;
    float *la = malloc((size_t)oa.rows * 4), *lb = malloc((size_t)oa.rows * 4);
    float *va = malloc(n * 4), *vb = malloc(n * 4);
    int32_t *ia = malloc(n * 4), *ib = malloc(n * 4);
    ck_assert(dump_read_output(a, 0, oa.rows, la, ia, va, &e) == 0);
    ck_assert(dump_read_output(b, 0, ob.rows, lb, ib, vb, &e) == 0);
    ck_assert(memcmp(la, lb, (size_t)oa.rows * 4) == 0 && memcmp(ia, ib, n * 4) == 0 &&
              memcmp(va, vb, n * 4) == 0);
    free(la), free(lb), free(va), free(vb), free(ia), free(ib);
}

START_TEST(test_identical_runs)
{
    char dir[64], p1[128], p2[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(p1, sizeof p1, dir, "a.h5");
    path_in(p2, sizeof p2, dir, "b.h5");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    o.full_logits = true;
    o.compress = _i == 1;
    dump_run(&m, false, p1, &o);
    /* The second hashes and measures rows on two threads: the same bytes. */
    dump_opts o2 = o;
    o2.pool = pool_create(2);
    dump_run(&m, false, p2, &o2);
    pool_free(o2.pool);
    dump_file *a = open_ok(p1), *b = open_ok(p2);
    assert_same_datasets(a, b, m.cfg.n_layers);
    dump_file_close(a);
    dump_file_close(b);
    /* No object records the time it was made (runs a second apart would
     * differ otherwise), every chunk has a defined fill: the whole files
     * are identical. */
    static const char *const objects[] = {"/", "/layers", "/layers/0", "/layers/0/q", "/tokens",
                                          "/output/lse"};
    hid_t h = H5Fopen(p1, H5F_ACC_RDONLY, H5P_DEFAULT);
    for (size_t i = 0; i < sizeof objects / sizeof *objects; i++) {
        H5O_info_t info;
        ck_assert(H5Oget_info_by_name2(h, objects[i], &info, H5O_INFO_TIME, H5P_DEFAULT) >= 0);
        ck_assert_msg(info.btime == 0 && info.mtime == 0 && info.ctime == 0 && info.atime == 0,
                      "%s records a time", objects[i]);
    }
    H5Fclose(h);
    size_t na, nb;
    char *x = slurp(p1, &na), *y = slurp(p2, &nb);
    ck_assert_msg(na == nb && memcmp(x, y, na) == 0, "the two files differ (%zu vs %zu bytes)", na, nb);
    free(x);
    free(y);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_chunked_same_rows)
{
    char dir[64], p1[128], p2[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(p1, sizeof p1, dir, "ref.h5");
    path_in(p2, sizeof p2, dir, "chk.h5");
    open_model(_i ? "tiny-gemma3-kvshared" : "tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    dump_run(&m, false, p1, &o);
    dump_run(&m, true, p2, &o);
    dump_file *a = open_ok(p1), *b = open_ok(p2);
    ck_assert_str_eq(dump_attr(b, "engine"), "chunked");
    assert_same_datasets(a, b, m.cfg.n_layers);
    dump_file_close(a);
    dump_file_close(b);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Crashes and interruptions                                            */

/* Forwards to the dump's observer; on the announcement of token `at`
 * either kills the process (SIGKILL: no cleanup at all) or raises the
 * writer's stop flag, as a SIGINT handler would. */
typedef struct {
    kv_observer base;
    kv_observer *inner;
    int64_t at;
    bool kill;
    volatile sig_atomic_t *flag;
} tripwire;

static int trip_emit(kv_observer *self, const kv_event *ev)
{
    tripwire *t = (tripwire *)self;
    return t->inner->emit(t->inner, ev);
}

static int trip_wants(kv_observer *self, kv_stage st, int layer)
{
    tripwire *t = (tripwire *)self;
    return t->inner->wants(t->inner, st, layer);
}

static int trip_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    tripwire *t = (tripwire *)self;
    if (pos == t->at && t->kill)
        raise(SIGKILL);
    if (pos == t->at)
        *t->flag = 1;
    return t->inner->token(t->inner, pos, id, is_prompt);
}

static tripwire tripwire_on(kv_observer *inner, int64_t at)
{
    tripwire t = {.base = {.emit = trip_emit, .token = trip_token, .wants = trip_wants,
                           .all_logits = inner->all_logits},
                  .inner = inner, .at = at};
    return t;
}

/* Killed when token 44 is announced: positions 0..43 were forwarded, and
 * every row of each, and tokens 0..43, had been flushed: the 40 prompt
 * rows of each dataset as 5 blocks of 8, the decode rows 40..43 of the
 * unfinished sixth block one step at a time. */
START_TEST(test_swmr_crash)
{
    char dir[64], path[128];
    kv_model m;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "killed.h5");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    o.block_rows = 8;
    o.compress = _i == 1;
    o.full_logits = true;
    fflush(NULL);
    pid_t pid = fork();
    ck_assert(pid >= 0);
    if (pid == 0) {
        dump_meta meta = meta_for(&m, "reference");
        dump_writer *w = dump_create(path, &meta, &o, &e);
        if (!w)
            _exit(2);
        tripwire t = tripwire_on(dump_observer(w), 44);
        t.kill = true;
        run_engine(&m, false, &t.base);
        _exit(3);  /* not reached: killed */
    }
    int status;
    ck_assert(waitpid(pid, &status, 0) == pid);
    ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "child status %d", status);

    capture *c = capture_run(&m);
    dump_file *f = open_ok(path);
    /* "partial: running" as written, said as what it is: no writer holds it */
    ck_assert_msg(strstr(dump_attr(f, "status"), "partial: its writer ended without closing it") ==
                      dump_attr(f, "status"), "%s", dump_attr(f, "status"));
    ck_assert(!dump_is_complete(f));
    check_tokens(f, c, 44, 0);  /* prompt_length is only set by dump_close */
    ck_assert_int_eq(compare_full(f, c, 0, 44), m.cfg.n_layers * test_layer_stages(&m.cfg) + 2);
    check_output(f, c, m.cfg.vocab, 0, 44);
    dump_file_close(f);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

START_TEST(test_interrupted)
{
    char dir[64], path[128];
    kv_model m;
    kv_err e = {{0}};
    volatile sig_atomic_t flag = 0;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "int.h5");
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    dump_meta meta = meta_for(&m, "reference");
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    dump_watch_flag(w, &flag);
    tripwire t = tripwire_on(dump_observer(w), 43);
    t.flag = &flag;
    ck_assert_int_eq(run_engine(&m, false, &t.base), 1);  /* stopped by the observer */
    ck_assert_ptr_null(dump_error(w));                    /* a stop is not an error */
    ck_assert_msg(dump_close(w, "interrupted by SIGINT", &e) == 0, "%s", e.msg);
    capture *c = capture_run(&m);
    dump_file *f = open_ok(path);
    ck_assert_str_eq(dump_attr(f, "status"), "partial: interrupted by SIGINT");
    /* Token 43 was refused: positions 0..42 forwarded, 0..42 announced. */
    check_tokens(f, c, 43, P);
    ck_assert_int_eq(compare_full(f, c, 0, 43), m.cfg.n_layers * test_layer_stages(&m.cfg) + 1);
    dump_file_close(f);
    assert_valid(path);
    capture_free(c);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* The observer contract without an engine: rows in order, one per
 * position, of the model's width; tokens from 0. A break is a writer
 * error that stops the run; rows before it are kept. */
START_TEST(test_observer_contract)
{
    char dir[64], path[128];
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "contract.h5");
    ck_assert(config_preset("tiny-gemma3", &cfg, &e) == 0);
    const int E = cfg.hidden;
    dump_opts o;
    dump_opts_default(&o);
    o.block_rows = 4;
    dump_meta meta = {.engine = "test", .cfg = &cfg, .max_positions = 100};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    kv_observer *obs = dump_observer(w);
    ck_assert(obs->wants(obs, STAGE_LOGITS, -1));
    ck_assert(obs->wants(obs, STAGE_Q, 0) && obs->wants(obs, STAGE_EMBED, -1));
    ck_assert(!obs->wants(obs, STAGE_Q, cfg.n_layers) && !obs->wants(obs, STAGE_Q, -1));
    for (int p = 0; p < 6; p++)
        ck_assert_int_eq(obs->token(obs, p, 10 + p, p < 4), 0);
    float *rows = calloc((size_t)2 * E, sizeof *rows);
    rows[E + 3] = 1.5f;
    kv_event ev = {.stage = STAGE_X_IN, .layer = 0, .pos0 = 0, .nrows = 2, .ncols = E, .data = rows};
    ck_assert_int_eq(obs->emit(obs, &ev), 0);
    ev.pos0 = 5;  /* positions 2..4 never came */
    ck_assert_int_eq(obs->emit(obs, &ev), 1);
    ck_assert_msg(dump_error(w) && strstr(dump_error(w), "/layers/0/x_in: the row for position 5 "
                                                          "came when position 2 was due"),
                  "%s", dump_error(w));
    ev.pos0 = 2;
    ck_assert_int_eq(obs->emit(obs, &ev), 1);  /* stopped for good */
    ck_assert_int_eq(obs->token(obs, 6, 1, 0), 1);
    char why[1100];
    snprintf(why, sizeof why, "%s", dump_error(w));
    ck_assert_int_eq(dump_close(w, why, &e), -1);
    ck_assert_str_eq(e.msg, why);
    dump_file *f = open_ok(path);
    ck_assert(strncmp(dump_attr(f, "status"), "partial: ", 9) == 0);
    ck_assert_int_eq(dump_n_tokens(f), 6);
    ck_assert_int_eq(dump_prompt_length(f), 4);
    dump_dataset_info di = dump_stage_info(f, 0, STAGE_X_IN);
    ck_assert(di.present && di.rows == 2 && di.first_position == 0);
    float back[2 * 64];
    ck_assert(E <= 64 && dump_read_rows(f, 0, STAGE_X_IN, 0, 2, back, &e) == 0);
    ck_assert(memcmp(back, rows, (size_t)2 * E * 4) == 0);
    dump_file_close(f);
    assert_valid(path);

    /* A row of the wrong width; a token out of order. */
    w = dump_create(path, &meta, &o, &e);
    obs = dump_observer(w);
    ev = (kv_event){.stage = STAGE_Q, .layer = 1, .pos0 = 0, .nrows = 1, .ncols = 5, .data = rows};
    ck_assert_int_eq(obs->emit(obs, &ev), 1);
    ck_assert_msg(strstr(dump_error(w), "/layers/1/q: the engine emitted 5 columns"), "%s",
                  dump_error(w));
    ck_assert_int_eq(dump_close(w, NULL, &e), -1);
    f = open_ok(path);
    ck_assert_str_eq(dump_attr(f, "status"), "partial: writer error");
    dump_file_close(f);
    w = dump_create(path, &meta, &o, &e);
    obs = dump_observer(w);
    ck_assert_int_eq(obs->token(obs, 3, 1, 1), 1);
    ck_assert_msg(strstr(dump_error(w), "/tokens: the row for position 3 came when position 0"),
                  "%s", dump_error(w));
    ck_assert_int_eq(dump_close(w, NULL, &e), -1);
    free(rows);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Write errors                                                         */

START_TEST(test_unwritable)
{
    char dir[64], path[160];
    kv_model m;
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    dump_meta meta = meta_for(&m, "reference");
    path_in(path, sizeof path, dir, "no/such/folder/x.h5");
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, "No such file"), "%s", e.msg);
    ck_assert_ptr_null(dump_create(dir, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, dir) && strstr(e.msg, "directory"), "%s", e.msg);
    /* Bad metadata and options are refused before any file is made. */
    path_in(path, sizeof path, dir, "x.h5");
    meta.engine_settings = "[1, 2]";
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, "engine_settings"), "%s", e.msg);
    meta.engine_settings = "{\"chunk\":";
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, "engine_settings is not valid JSON"), "%s", e.msg);
    meta.engine_settings = "{}";
    o.layer_lo = o.layer_hi = m.cfg.n_layers;
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, "layers from"), "%s", e.msg);
    dump_opts_default(&o);
    o.topk = m.cfg.vocab + 1;
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, "top-k"), "%s", e.msg);
    struct stat st;
    ck_assert_int_ne(stat(path, &st), 0);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* The file may grow by only a few KiB after creation: the first block
 * write fails with EFBIG, the observer stops the run, dump_close fails,
 * the status is never "complete", and HDF5 still shuts down cleanly.
 * Runs in a child (rlimits stick). */
START_TEST(test_file_size_limit)
{
    char dir[64], path[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "big.h5");
    open_model("tiny-gemma3", &m);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert(pid >= 0);
    if (pid == 0) {
        kv_err e = {{0}};
        dump_opts o;
        dump_opts_default(&o);
        o.full_logits = true;
        o.block_rows = 8;  /* blocks go out during the prefill */
        dump_meta meta = meta_for(&m, "reference");
        dump_writer *w = dump_create(path, &meta, &o, &e);
        struct stat st;
        if (!w || stat(path, &st) != 0)
            _exit(2);
        struct rlimit rl = {.rlim_cur = (rlim_t)st.st_size + 4096, .rlim_max = RLIM_INFINITY};
        signal(SIGXFSZ, SIG_IGN);
        if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
            _exit(3);
        int rc = run_engine(&m, false, dump_observer(w));
        const char *err = dump_error(w);
        if (rc != 1 || !err || !strstr(err, "file size limit reached (ulimit -f)") || !strstr(err, path))
            _exit(4);
        if (dump_close(w, NULL, &e) != -1 || !strstr(e.msg, "file size limit reached (ulimit -f)"))
            _exit(5);
        /* The library must still shut down cleanly (libhdf5 crashed here,
         * at exit, when a close had failed). */
        _exit(H5close() < 0 ? 6 : 0);
    }
    int status;
    ck_assert(waitpid(pid, &status, 0) == pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    if (f)
        ck_assert_str_ne(dump_attr(f, "status"), "complete");
    dump_file_close(f);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Bad files                                                            */

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *fp = fopen(path, "wb");
    ck_assert_ptr_nonnull(fp);
    ck_assert(fwrite(data, 1, n, fp) == n);
    fclose(fp);
}

/* The read calls this process and its reaped children have made
 * (syscr of /proc/self/io), or -1 where the kernel does not count them. */
static long long read_calls(void)
{
    FILE *f = fopen("/proc/self/io", "r");
    if (!f)
        return -1;
    char line[128];
    long long n = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "syscr: %lld", &n) == 1)
            break;
    fclose(f);
    return n;
}

static void expect_open_error(const char *path, const char *what)
{
    kv_err e = {{0}};
    report_log r;
    ck_assert_ptr_null(dump_open(path, &e));
    ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, what), "'%s' lacks '%s'", e.msg, what);
    ck_assert_int_eq(validate(path, &r), -1);
    ck_assert_msg(strstr(r.text, what), "validate: '%s' lacks '%s'", r.text, what);
}

START_TEST(test_not_dumps)
{
    char dir[64], path[128], base[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    unsigned char junk[4096];
    for (size_t i = 0; i < sizeof junk; i++)
        junk[i] = (unsigned char)(i * 2654435761u >> 13);
    path_in(path, sizeof path, dir, "random.bin");
    write_bytes(path, junk, sizeof junk);
    expect_open_error(path, "not an HDF5 file");
    path_in(path, sizeof path, dir, "empty.h5");
    write_bytes(path, "", 0);
    expect_open_error(path, "empty file");
    path_in(path, sizeof path, dir, "missing.h5");
    expect_open_error(path, "No such file");
    expect_open_error(dir, "folder");
    /* A real dump cut at half. */
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    path_in(base, sizeof base, dir, "whole.h5");
    dump_run(&m, false, base, &o);
    size_t n;
    char *bytes = slurp(base, &n);
    path_in(path, sizeof path, dir, "half.h5");
    write_bytes(path, bytes, n / 2);
    expect_open_error(path, "truncated");
    /* A bad superblock checksum fails at once: the SWMR-read retry must
     * not spend seconds re-reading a file no writer is changing. */
    bytes[46] ^= 0x5a;
    path_in(path, sizeof path, dir, "checksum.h5");
    write_bytes(path, bytes, n);
    /* Counted in read calls, not seconds (a busy machine is slow, not
     * wrong): one attempt reads the file about 15 times; libhdf5's
     * default of 100 attempts reads it at least once per attempt, and
     * sleeps between them for minutes. */
    long long reads0 = read_calls();
    expect_open_error(path, "checksum");
    long long reads = read_calls() - reads0;
    ck_assert_msg(reads0 < 0 || reads < 60,
                  "refusing a corrupt file took %lld read calls", reads);
    free(bytes);
    model_free(&m);
    test_rmtree(dir);
}
END_TEST

/* A small valid dump to break in one way per test. */
static void base_dump(const char *path, bool fingerprint)
{
    kv_model m;
    open_model("tiny-gemma3", &m);
    dump_opts o;
    dump_opts_default(&o);
    o.fingerprint = fingerprint;
    o.layer_hi = 1;
    dump_run(&m, false, path, &o);
    model_free(&m);
}

static hid_t open_rw(const char *path)
{
    hid_t h = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    ck_assert(h >= 0);
    return h;
}

static void set_int_attr(hid_t obj, const char *name, long long v)
{
    if (H5Aexists(obj, name) > 0)
        H5Adelete(obj, name);
    hid_t s = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(obj, name, H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(a >= 0 && H5Awrite(a, H5T_NATIVE_LLONG, &v) >= 0);
    H5Aclose(a);
    H5Sclose(s);
}

/* Replaces (or adds) dataset loc/name: type, rows x cols (cols 0: 1-D),
 * filled from data (may be NULL: zeros), with first_position first (< 0:
 * none). */
static void put_dataset(hid_t h, const char *name, hid_t type, hsize_t rows, hsize_t cols,
                        const void *data, long long first)
{
    if (H5Lexists(h, name, H5P_DEFAULT) > 0)
        H5Ldelete(h, name, H5P_DEFAULT);
    hsize_t dims[2] = {rows, cols};
    hid_t s = H5Screate_simple(cols ? 2 : 1, dims, NULL);
    hid_t d = H5Dcreate2(h, name, type, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(d >= 0);
    if (data)
        ck_assert(H5Dwrite(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0);
    if (first >= 0)
        set_int_attr(d, "first_position", first);
    H5Dclose(d);
    H5Sclose(s);
}

typedef enum {
    BREAK_FORMAT, BREAK_VERSION, BREAK_NO_SEED, BREAK_SEED_TYPE, BREAK_MODE, BREAK_SETTINGS,
    BREAK_CONFIG, BREAK_STATUS, BREAK_NO_TOKENS, BREAK_TOKENS_TYPE, BREAK_PROMPT_LENGTH,
    BREAK_LAYER_NAME, BREAK_LAYER_RANGE, BREAK_LAYER_ATTRS, BREAK_STAGE_NAME, BREAK_SHAPE,
    BREAK_DTYPE, BREAK_FIRST_POSITION, BREAK_PAST_TOKENS, BREAK_OUTPUT, BREAK_NAN,
    BREAK_STALE_HASH, BREAK_NO_HASH, BREAK_ROW_HASHES, BREAK_STALE_INDEX, BREAK_INDEX_SHAPE,
    BREAK_INDEX_ROW, BREAK_CONFIG_AND_SHAPE, BREAK_NKEYS_FRACTION, BREAK_FP_TYPES, BREAK_COUNT
} breakage;

/* What each breakage must produce: violations, a phrase in the report,
 * and a phrase dump_open's error must hold (NULL: dump_open succeeds). */
static const struct {
    int violations;
    const char *says;
    const char *open_says;
} broken[BREAK_COUNT] = {
    [BREAK_FORMAT] = {1, "not a kvdiff dump", "not a kvdiff dump (format attribute is 'foo')"},
    [BREAK_VERSION] = {1, "schema version 2", "schema version 2; this kvdiff reads version 1"},
    [BREAK_NO_SEED] = {1, "has no attribute seed", "missing or mistyped root attributes: seed"},
    [BREAK_SEED_TYPE] = {1, "attribute seed is a string, not an integer", "seed (integer)"},
    [BREAK_MODE] = {1, "mode is 'sparse'", "unknown mode 'sparse'"},
    [BREAK_SETTINGS] = {1, "engine_settings is not a JSON object", NULL},
    [BREAK_CONFIG] = {2, "\"head_dim\"", NULL},
    [BREAK_STATUS] = {1, "status is 'done'", NULL},
    [BREAK_NO_TOKENS] = {1, "/tokens is missing", NULL},
    [BREAK_TOKENS_TYPE] = {2, "/tokens is not int32", NULL},
    [BREAK_PROMPT_LENGTH] = {1, "prompt_length 99", NULL},
    [BREAK_LAYER_NAME] = {1, "/layers/abc: the group name is not a layer index", NULL},
    [BREAK_LAYER_RANGE] = {1, "layer 99 is not below num_hidden_layers", NULL},
    [BREAK_LAYER_ATTRS] = {2, "/layers/1 has no attribute window", NULL},
    [BREAK_STAGE_NAME] = {1, "/layers/0/qq: unknown stage dataset name", NULL},
    [BREAK_SHAPE] = {1, "/layers/0/q has 5 columns", NULL},
    [BREAK_DTYPE] = {1, "/layers/0/x_in is float64; it must be float32", NULL},
    [BREAK_FIRST_POSITION] = {2, "/layers/0/k has no attribute first_position", NULL},
    /* ... and its row hashes no longer cover the same positions */
    [BREAK_PAST_TOKENS] = {2, "/layers/1/v covers positions 10..56", NULL},
    [BREAK_OUTPUT] = {1, "/output: lse (47 rows from position 0) and topk_ids (3 rows", NULL},
    [BREAK_NAN] = {0, "note: /layers/0/attn_lse holds 2 NaN and 1 infinite values", NULL},
    [BREAK_STALE_HASH] = {1, "/layers/1/x_out.hash: the hash of row 6 (position 6) is not the "
                             "XXH3-64", NULL},
    [BREAK_NO_HASH] = {1, "/layers/0/q has no q.hash (the dump says row_hashes = 1)", NULL},
    [BREAK_ROW_HASHES] = {1, "row_hashes is 7; it must be 0 or 1", NULL},
    /* rows and hashes rewritten alike, the index left as it was */
    [BREAK_STALE_INDEX] = {1, "/row_hash_index row 7: the digest of /layers/0/attn_lse.hash does "
                              "not match its hashes", NULL},
    [BREAK_INDEX_SHAPE] = {1, "/row_hash_index must be a 2-D uint64 dataset of 9 columns", NULL},
    [BREAK_INDEX_ROW] = {1, "/row_hash_index row 3: no such layer and stage", NULL},
    /* a bad field in model_config does not stop the widths the rest gives
     * from being checked */
    [BREAK_CONFIG_AND_SHAPE] = {3, "/layers/0/q has 5 columns", NULL},
    [BREAK_FP_TYPES] = {2, "/layers/0/q.hash is float32; it must be uint64", NULL},
    /* key counts of 2.5 and -1, hashed as a writer would */
    [BREAK_NKEYS_FRACTION] = {1, "/layers/0/attn_nkeys holds 2 values that are not key counts",
                              NULL},
};

/* Sets one uint64 of /row_hash_index. */
static void set_index_cell(hid_t h, hsize_t row, hsize_t col, uint64_t v)
{
    hid_t d = H5Dopen2(h, "row_hash_index", H5P_DEFAULT);
    ck_assert(d >= 0);
    hid_t fs = H5Dget_space(d);
    hsize_t start[2] = {row, col}, count[2] = {1, 1};
    ck_assert(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL) >= 0);
    hid_t ms = H5Screate_simple(2, count, NULL);
    ck_assert(H5Dwrite(d, H5T_NATIVE_UINT64, ms, fs, H5P_DEFAULT, &v) >= 0);
    H5Sclose(ms);
    H5Sclose(fs);
    H5Dclose(d);
}

static void apply_breakage(hid_t h, breakage b, int E, int H)
{
    static float rows[47 * 64];
    switch (b) {
    case BREAK_FORMAT: test_set_str_attr(h, "format", "foo"); break;
    case BREAK_VERSION: set_int_attr(h, "format_version", 2); break;
    case BREAK_NO_SEED: H5Adelete(h, "seed"); break;
    case BREAK_SEED_TYPE: test_set_str_attr(h, "seed", "7"); break;
    case BREAK_MODE: test_set_str_attr(h, "mode", "sparse"); break;
    case BREAK_SETTINGS: test_set_str_attr(h, "engine_settings", "[1]"); break;
    case BREAK_CONFIG:
        test_set_str_attr(h, "model_config", "{\"model_type\":\"llama\",\"hidden_size\":64,"
                     "\"num_hidden_layers\":6,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
                     "\"head_dim\":\"16\",\"intermediate_size\":128,\"vocab_size\":256,"
                     "\"sliding_window\":0,\"layer_types\":[],\"kv_owner\":[0,1,2,3,4,5],"
                     "\"rms_norm_eps\":1e-6,\"rope_theta\":10000,\"rope_local_base_freq\":10000}");
        break;
    case BREAK_STATUS: test_set_str_attr(h, "status", "done"); break;
    case BREAK_NO_TOKENS: H5Ldelete(h, "tokens", H5P_DEFAULT); break;
    case BREAK_TOKENS_TYPE: put_dataset(h, "tokens", H5T_IEEE_F32LE, 48, 0, NULL, -1); break;
    case BREAK_PROMPT_LENGTH: {
        hid_t d = H5Dopen2(h, "tokens", H5P_DEFAULT);
        set_int_attr(d, "prompt_length", 99);
        H5Dclose(d);
        break;
    }
    case BREAK_LAYER_NAME:
        H5Lcreate_hard(h, "layers/1", h, "layers/abc", H5P_DEFAULT, H5P_DEFAULT);
        break;
    case BREAK_LAYER_RANGE:
        H5Lcreate_hard(h, "layers/1", h, "layers/99", H5P_DEFAULT, H5P_DEFAULT);
        break;
    case BREAK_LAYER_ATTRS: H5Adelete_by_name(h, "layers/1", "window", H5P_DEFAULT);
        H5Adelete_by_name(h, "layers/1", "kv_owner", H5P_DEFAULT);
        break;
    case BREAK_STAGE_NAME:
        put_dataset(h, "layers/0/qq", H5T_NATIVE_FLOAT, 47, (hsize_t)E, rows, 0);
        break;
    case BREAK_SHAPE: put_dataset(h, "layers/0/q", H5T_NATIVE_FLOAT, 47, 5, rows, 0); break;
    case BREAK_CONFIG_AND_SHAPE: {
        char *cfg = NULL;
        ck_assert_int_eq(dump_h5_attr_str(h, "model_config", &cfg), 0);
        json_t *j = json_loads(cfg, 0, NULL);
        ck_assert_ptr_nonnull(j);
        json_object_set_new(j, "rope_theta", json_string("ten thousand"));
        char *text = json_dumps(j, JSON_COMPACT);
        test_set_str_attr(h, "model_config", text);
        free(text);
        json_decref(j);
        free(cfg);
        put_dataset(h, "layers/0/q", H5T_NATIVE_FLOAT, 47, 5, rows, 0);
        break;
    }
    case BREAK_DTYPE: put_dataset(h, "layers/0/x_in", H5T_IEEE_F64LE, 47, (hsize_t)E, NULL, 0); break;
    case BREAK_FIRST_POSITION: H5Adelete_by_name(h, "layers/0/k", "first_position", H5P_DEFAULT);
        H5Adelete_by_name(h, "layers/0/v", "first_position", H5P_DEFAULT);
        break;
    case BREAK_PAST_TOKENS: {
        hid_t d = H5Dopen2(h, "layers/1/v", H5P_DEFAULT);
        set_int_attr(d, "first_position", 10);
        H5Dclose(d);
        break;
    }
    case BREAK_OUTPUT: put_dataset(h, "output/topk_ids", H5T_NATIVE_INT32, 3, 8, NULL, 0); break;
    case BREAK_NAN:
    case BREAK_STALE_INDEX:
    case BREAK_NKEYS_FRACTION: {
        /* a writer that keeps no row hash index (it is optional) */
        if (b != BREAK_STALE_INDEX) {
            H5Ldelete(h, "row_hash_index", H5P_DEFAULT);
        }
        const bool nk = b == BREAK_NKEYS_FRACTION;
        for (int i = 0; i < 47 * H; i++)
            rows[i] = nk ? (i == 5 ? 2.5f : i == 11 ? -1.0f : 1.0f)
                         : (i == 3 || i == 9 ? NAN : i == 20 ? INFINITY : 1.0f);
        const char *name = nk ? "layers/0/attn_nkeys" : "layers/0/attn_lse";
        put_dataset(h, name, H5T_NATIVE_FLOAT, 47, (hsize_t)H, rows, 0);
        {
            /* written as a writer would: hashes of the new rows */
            uint64_t hash[47];
            char hname[64];
            for (int r = 0; r < 47; r++)
                hash[r] = XXH3_64bits(rows + (size_t)r * H, (size_t)H * sizeof(float));
            snprintf(hname, sizeof hname, "%s.hash", name);
            put_dataset(h, hname, H5T_NATIVE_UINT64, 47, 0, hash, 0);
        }
        break;
    }
    case BREAK_STALE_HASH: {
        /* one element of a row changed, its hash not */
        hid_t d = H5Dopen2(h, "layers/1/x_out", H5P_DEFAULT);
        hid_t fs = H5Dget_space(d);
        hsize_t start[2] = {6, 3}, count[2] = {1, 1};
        H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL);
        hid_t ms = H5Screate_simple(2, count, NULL);
        float x = 42.0f;
        ck_assert(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, &x) >= 0);
        H5Sclose(ms);
        H5Sclose(fs);
        H5Dclose(d);
        break;
    }
    case BREAK_NO_HASH:
        H5Ldelete(h, "layers/0/q.hash", H5P_DEFAULT);
        H5Ldelete(h, "layers/0/q.stats", H5P_DEFAULT);
        break;
    case BREAK_INDEX_SHAPE: put_dataset(h, "row_hash_index", H5T_STD_U64LE, 3, 7, NULL, -1); break;
    case BREAK_INDEX_ROW: set_index_cell(h, 3, 1, 99); break;
    case BREAK_ROW_HASHES: {
        int64_t seven = 7;
        H5Adelete(h, "row_hashes");
        hid_t s = H5Screate(H5S_SCALAR);
        hid_t a = H5Acreate2(h, "row_hashes", H5T_STD_I64LE, s, H5P_DEFAULT, H5P_DEFAULT);
        ck_assert(a >= 0 && H5Awrite(a, H5T_NATIVE_INT64, &seven) >= 0);
        H5Aclose(a);
        H5Sclose(s);
        break;
    }
    case BREAK_FP_TYPES:
        put_dataset(h, "layers/0/q.hash", H5T_NATIVE_FLOAT, 47, 0, rows, 0);
        put_dataset(h, "layers/0/k.stats", H5T_NATIVE_FLOAT, 47, 3, rows, 0);
        break;
    default: break;
    }
}


START_TEST(test_broken_dumps)
{
    char dir[64], base[128], path[128];
    kv_model m;
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    open_model("tiny-gemma3", &m);
    const int E = m.cfg.hidden, H = m.cfg.n_heads;
    model_free(&m);
    path_in(base, sizeof base, dir, "base.h5");
    path_in(path, sizeof path, dir, "broken.h5");
    base_dump(base, false);
    size_t n;
    char *bytes = slurp(base, &n);
    char *fp_bytes = NULL;
    size_t fp_n = 0;
    for (int b = 0; b < BREAK_COUNT; b++) {
        if (b == BREAK_FP_TYPES) {
            base_dump(base, true);
            fp_bytes = slurp(base, &fp_n);
        }
        write_bytes(path, fp_bytes ? fp_bytes : bytes, fp_bytes ? fp_n : n);
        hid_t h = open_rw(path);
        apply_breakage(h, (breakage)b, E, H);
        ck_assert(H5Fclose(h) >= 0);
        report_log r;
        int v = validate(path, &r);
        ck_assert_msg(v == broken[b].violations && strstr(r.text, broken[b].says),
                      "breakage %d: %d violations (want %d with '%s'):\n%.3000s", b, v,
                      broken[b].violations, broken[b].says, r.text);
        kv_err e = {{0}};
        dump_file *f = dump_open(path, &e);
        if (broken[b].open_says)
            ck_assert_msg(!f && strstr(e.msg, broken[b].open_says) && strstr(e.msg, path),
                          "breakage %d: dump_open said '%s'", b, f ? "(opened)" : e.msg);
        else
            ck_assert_msg(f != NULL, "breakage %d: %s", b, e.msg);
        dump_file_close(f);
    }
    free(bytes);
    free(fp_bytes);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Reader bounds                                                        */

START_TEST(test_reader_bounds)
{
    char dir[64], path[128];
    kv_err e = {{0}};
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    path_in(path, sizeof path, dir, "b.h5");
    base_dump(path, false);
    dump_file *f = open_ok(path);
    dump_dataset_info di = dump_stage_info(f, 0, STAGE_X_IN);
    float *buf = malloc((size_t)di.rows * di.cols * 4);
    uint64_t h;
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_X_IN, 0, 0, buf, &e), 0);
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_X_IN, di.rows - 2, 2, buf, &e), 0);
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_X_IN, di.rows - 2, 3, buf, &e), -1);
    ck_assert_msg(strstr(e.msg, "/layers/0/x_in has 47 rows") && strstr(e.msg, path), "%s", e.msg);
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_X_IN, -1, 1, buf, &e), -1);
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_X_IN, 0, -1, buf, &e), -1);
    ck_assert_int_eq(dump_read_rows(f, 5, STAGE_X_IN, 0, 1, buf, &e), -1);
    ck_assert_msg(strstr(e.msg, "no dataset /layers/5/x_in"), "%s", e.msg);
    ck_assert_int_eq(dump_read_rows(f, -1, STAGE_X_IN, 0, 1, buf, &e), -1);
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_EMBED, 0, 1, buf, &e), -1);
    /* Row hashes beside the rows: the hash of each row. */
    float stats[2];
    ck_assert(dump_has_row_hashes(f));
    ck_assert_int_eq(dump_read_rows(f, 0, STAGE_Q, 5, 1, buf, &e), 0);
    ck_assert_int_eq(dump_read_hashes(f, 0, STAGE_Q, 5, 1, &h, stats, &e), 0);
    ck_assert_uint_eq(h, XXH3_64bits(buf, (size_t)dump_stage_info(f, 0, STAGE_Q).cols * 4));
    ck_assert_int_eq(dump_read_hashes(f, 0, STAGE_Q, 47, 1, &h, NULL, &e), -1);
    ck_assert_int_eq(dump_read_output(f, 40, 10, buf, NULL, NULL, &e), -1);
    ck_assert(!dump_stage_info(f, 0, STAGE_COUNT).present);
    ck_assert(!dump_stage_info(f, -2, STAGE_Q).present);
    free(buf);
    dump_file_close(f);
    dump_file_close(NULL);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Selection parsing                                                    */

/* RoPE scaling travels in model_config (the comparer's RoPE checks need
 * it): a llama3-scaled model's RoPE offset is diagnosed from the dumps
 * alone, with the offset; bad rope_scaling objects are named. */
static void count_problem(void *ctx, const char *msg)
{
    (void)msg;
    ++*(int *)ctx;
}

START_TEST(test_rope_scaling_in_model_config)
{
    char dir[64], args[1024], out[8192], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(args, sizeof args, "run --model tiny-llama3 --prompt-random 40 --max-new 4 "
             "--dump %s/ref.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "run --model tiny-llama3 --prompt-random 40 --max-new 4 "
             "--engine chunked --chunk 16 --inject rope-offset=3 --dump %s/bug.h5", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(path, sizeof path, "%s/ref.h5", dir);
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    kv_config cfg, want;
    ck_assert_msg(dump_model_config(f, &cfg, &e) == 0, "%s", e.msg);
    ck_assert_int_eq(config_preset("tiny-llama3", &want, &e), 0);
    ck_assert_int_eq(cfg.rope_scaling.type, ROPE_SCALE_LLAMA3);
    ck_assert(memcmp(&cfg.rope_scaling, &want.rope_scaling, sizeof want.rope_scaling) == 0);
    dump_file_close(f);
    snprintf(args, sizeof args, "compare %s/ref.h5 %s/bug.h5", dir, dir);
    ck_assert_int_eq(test_run_cli(args, out, sizeof out), 1);
    ck_assert_msg(strstr(out, "RoPE position offset of +3"), "%s", out);

    static const char *const bad[] = {
        "{\"rope_type\": \"longrope\", \"factor\": 4}", "7",
        "{\"rope_type\": \"linear\"}", "{\"rope_type\": \"linear\", \"factor\": -1}",
        "{\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 4,"
        " \"high_freq_factor\": 1, \"original_max_position_embeddings\": 64}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char text[1024];
        snprintf(text, sizeof text, "{\"model_type\": \"llama\", \"hidden_size\": 64, "
                 "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
                 "\"num_key_value_heads\": 2, \"head_dim\": 16, \"intermediate_size\": 8, "
                 "\"vocab_size\": 8, \"sliding_window\": 0, \"layer_types\": "
                 "[\"full_attention\"], \"kv_owner\": [0], \"rms_norm_eps\": 1e-5, "
                 "\"rope_theta\": 1e4, \"rope_local_base_freq\": 1e4, \"rope_scaling\": %s}",
                 bad[i]);
        int n = 0;
        ck_assert_msg(dump_config_parse(text, &cfg, count_problem, &n) > 0 && n > 0,
                      "rope_scaling %s accepted", bad[i]);
    }
    test_rmtree(dir);
}
END_TEST

/* A dump's model_config names the family; what the family implies (q/k
 * norms, Gemma's 1 + w, sandwich norms, Qwen2's biases) comes back as a
 * config.json gives it, so rules keyed on those flags fire on dumps. */
START_TEST(test_family_flags_from_dump)
{
    static const char *const presets[] = {"tiny-llama", "tiny-qwen2", "tiny-qwen3",
                                          "tiny-gemma3"};
    char dir[64], args[512], out[8192], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    for (size_t i = 0; i < sizeof presets / sizeof *presets; i++) {
        snprintf(args, sizeof args, "run --model %s --prompt-random 4 --max-new 1 "
                 "--dump %s/%s.h5", presets[i], dir, presets[i]);
        ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
        snprintf(path, sizeof path, "%s/%s.h5", dir, presets[i]);
        kv_err e = {{0}};
        dump_file *f = dump_open(path, &e);
        ck_assert_msg(f != NULL, "%s", e.msg);
        kv_config got, want;
        ck_assert_msg(dump_model_config(f, &got, &e) == 0, "%s", e.msg);
        ck_assert_int_eq(config_preset(presets[i], &want, &e), 0);
        ck_assert_msg(got.qk_norm == want.qk_norm && got.norm_plus_one == want.norm_plus_one &&
                      got.sandwich_norms == want.sandwich_norms &&
                      got.qkv_bias == want.qkv_bias && got.act == want.act,
                      "%s: flags qk_norm %d norm_plus_one %d sandwich %d qkv_bias %d act %d",
                      presets[i], got.qk_norm, got.norm_plus_one, got.sandwich_norms,
                      got.qkv_bias, (int)got.act);
        dump_file_close(f);
    }
    test_rmtree(dir);
}
END_TEST

START_TEST(test_parse_selection)
{
    dump_opts o;
    kv_err e = {{0}};
    dump_opts_default(&o);
    ck_assert(o.layer_lo == 0 && o.layer_hi == INT32_MAX && o.pos_lo == 0 && o.pos_hi == INT64_MAX);
    ck_assert(o.topk == 8 && o.block_rows == 64 && !o.full_logits && !o.compress && !o.fingerprint);
    for (int s = 0; s < STAGE_COUNT; s++)
        ck_assert(o.stages[s] == (s != STAGE_LOGITS && s != STAGE_FINAL_NORM));

    ck_assert(dump_parse_layers("10:23", &o, &e) == 0 && o.layer_lo == 10 && o.layer_hi == 23);
    ck_assert(dump_parse_layers("10:", &o, &e) == 0 && o.layer_lo == 10 && o.layer_hi == INT32_MAX);
    ck_assert(dump_parse_layers(":23", &o, &e) == 0 && o.layer_lo == 0 && o.layer_hi == 23);
    ck_assert(dump_parse_layers("7", &o, &e) == 0 && o.layer_lo == 7 && o.layer_hi == 7);
    ck_assert(dump_parse_positions("100:", &o, &e) == 0 && o.pos_lo == 100 && o.pos_hi == INT64_MAX);
    ck_assert(dump_parse_positions("0:0", &o, &e) == 0 && o.pos_lo == 0 && o.pos_hi == 0);

    static const char *const bad[] = {"10:x", "", ":", "a", "-1", "1:2:3", " 1", "1 ", "+3",
                                      "99999999999", "3:-", "1:2x"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        dump_opts_default(&o);
        ck_assert_int_eq(dump_parse_layers(bad[i], &o, &e), -1);
        ck_assert_int_eq(o.layer_hi, INT32_MAX);  /* untouched */
        char want[64];
        snprintf(want, sizeof want, "--dump-layers: '%s' is not a range (A:B, A:, :B or N", bad[i]);
        ck_assert_msg(strstr(e.msg, want), "%s", e.msg);
    }
    ck_assert_int_eq(dump_parse_layers("5:3", &o, &e), -1);
    ck_assert_msg(strstr(e.msg, "--dump-layers: '5:3' is empty"), "%s", e.msg);
    ck_assert_int_eq(dump_parse_positions("20:10", &o, &e), -1);
    ck_assert_msg(strstr(e.msg, "--dump-positions: '20:10'"), "%s", e.msg);
    ck_assert_int_eq(dump_parse_positions("99999999999999999999", &o, &e), -1);
    ck_assert_int_eq(dump_parse_layers(NULL, &o, &e), -1);

    ck_assert(dump_parse_stages("k,v,x_out", &o, &e) == 0);
    for (int s = 0; s < STAGE_COUNT; s++)
        ck_assert(o.stages[s] == (s == STAGE_K || s == STAGE_V || s == STAGE_X_OUT));
    ck_assert(!o.full_logits);
    ck_assert(dump_parse_stages("logits", &o, &e) == 0 && o.full_logits && o.stages[STAGE_LOGITS]);
    dump_opts_default(&o);
    ck_assert_int_eq(dump_parse_stages("k,foo", &o, &e), -1);
    ck_assert_msg(strstr(e.msg, "unknown stage 'foo' (valid: x_in, attn_norm_stats,") &&
                  strstr(e.msg, "final_norm, logits)"), "%s", e.msg);
    ck_assert(o.stages[STAGE_Q]);  /* untouched */
    ck_assert_int_eq(dump_parse_stages("k,,v", &o, &e), -1);
    ck_assert_msg(strstr(e.msg, "empty stage name"), "%s", e.msg);
    ck_assert_int_eq(dump_parse_stages("", &o, &e), -1);
    ck_assert_int_eq(dump_parse_stages("k,", &o, &e), -1);
    ck_assert_int_eq(dump_parse_stages("K", &o, &e), -1);
}
END_TEST

Suite *dump_suite(void)
{
    Suite *s = suite_create("dump");
    TCase *tc = tcase_create("dump");
    tcase_add_test(tc, test_parse_selection);
    tcase_add_test(tc, test_rope_scaling_in_model_config);
    tcase_add_test(tc, test_family_flags_from_dump);
    tcase_add_test(tc, test_round_trip_full);
    tcase_add_test(tc, test_kv_shared_and_logits);
    tcase_add_test(tc, test_fingerprint);
    tcase_add_test(tc, test_selection);
    tcase_add_test(tc, test_compress);
    tcase_add_test(tc, test_direct_reads);
    tcase_add_test(tc, test_direct_chunk_cap);
    tcase_add_test(tc, test_survey);
    tcase_add_test(tc, test_survey_child_dies_with_its_parent);
    tcase_add_test(tc, test_preflight);
    tcase_add_loop_test(tc, test_identical_runs, 0, 2);
    tcase_add_loop_test(tc, test_chunked_same_rows, 0, 2);
    tcase_add_loop_test(tc, test_swmr_crash, 0, 2);
    tcase_add_test(tc, test_interrupted);
    tcase_add_test(tc, test_observer_contract);
    tcase_add_test(tc, test_unwritable);
    tcase_add_test(tc, test_file_size_limit);
    tcase_add_test(tc, test_not_dumps);
    tcase_add_test(tc, test_broken_dumps);
    tcase_add_test(tc, test_reader_bounds);
    suite_add_tcase(s, tc);
    return s;
}
