/* check_dump_writer.c — how the dump writer appends: whatever the sizes
 * of the events rows arrive in (one row, a few, a whole prefill), the
 * datasets hold the same rows, hashes and statistics; and a file size
 * limit hit anywhere in a run (block writes, flushes, closing) is an error
 * the writer reports, never a crash of libhdf5 at exit. */
#include <check.h>
#include <hdf5.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "dump/dump.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "testutil.h"

#define N 45      /* positions: five blocks of 8 and a short one */
#define BLOCK 8

/* ------------------------------------------------------------------ */
/* Rows in events of any size                                           */

/* Row p of a stage: varied values, and rows with NaN, infinities, signed
 * zeros and all zeros, whose statistics have rules of their own. */
static void make_rows(float *x, int cols)
{
    for (int p = 0; p < N; p++)
        for (int j = 0; j < cols; j++) {
            uint32_t h = (uint32_t)(p * 7919 + j * 104729) * 2654435761u;
            x[(size_t)p * cols + j] = ((float)(h >> 8) / 16777216.0f - 0.5f) * (float)(1 + p % 5);
        }
    x[3 * cols + 1] = NAN;
    x[5 * cols] = -INFINITY;
    memset(x + 7 * (size_t)cols, 0, (size_t)cols * sizeof *x);
    x[9 * cols] = -0.0f;
    x[9 * cols + cols - 1] = -3.0e30f;
}

typedef struct {
    kv_config cfg;
    int E;
    float *x_in;    /* (N, E) rows of layer 0 x_in */
    float *stats;   /* (N, 3) rows of layer 0 attn_norm_stats */
} rows_fixture;

static void fixture_init(rows_fixture *fx)
{
    kv_err e = {{0}};
    ck_assert_msg(config_preset("tiny-gemma3", &fx->cfg, &e) == 0, "%s", e.msg);
    fx->E = fx->cfg.hidden;
    fx->x_in = malloc((size_t)N * fx->E * sizeof *fx->x_in);
    fx->stats = malloc((size_t)N * 3 * sizeof *fx->stats);
    ck_assert(fx->x_in && fx->stats);
    make_rows(fx->x_in, fx->E);
    make_rows(fx->stats, 3);
}

static void fixture_free(rows_fixture *fx)
{
    free(fx->x_in);
    free(fx->stats);
}

/* Writes the fixture's rows to path in events of `split` rows (the last
 * one shorter), both stages alternating as an engine emits them. */
static void write_split(const rows_fixture *fx, const char *path, int split, bool fingerprint,
                        bool compress)
{
    kv_err e = {{0}};
    dump_opts o;
    dump_opts_default(&o);
    o.block_rows = BLOCK;
    o.fingerprint = fingerprint;
    o.compress = compress;
    dump_meta meta = {.engine = "test", .cfg = &fx->cfg, .max_positions = N, .prompt_length = N};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    kv_observer *obs = dump_observer(w);
    for (int p = 0; p < N; p++)
        ck_assert_int_eq(obs->token(obs, p, p % 7, 1), 0);
    for (int p0 = 0; p0 < N; p0 += split) {
        int n = N - p0 < split ? N - p0 : split;
        kv_event a = {.stage = STAGE_X_IN, .layer = 0, .pos0 = p0, .nrows = n, .ncols = fx->E,
                      .data = fx->x_in + (size_t)p0 * fx->E};
        kv_event b = {.stage = STAGE_ATTN_NORM_STATS, .layer = 0, .pos0 = p0, .nrows = n,
                      .ncols = 3, .data = fx->stats + (size_t)p0 * 3};
        ck_assert_int_eq(obs->emit(obs, &a), 0);
        ck_assert_int_eq(obs->emit(obs, &b), 0);
    }
    ck_assert_msg(dump_close(w, NULL, &e) == 0, "%s", e.msg);
}

static dump_file *open_ok(const char *path)
{
    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert(dump_is_complete(f));
    return f;
}

/* Full mode: every row reads back bit for bit. */
static void check_rows(const char *path, kv_stage st, const float *want, int cols)
{
    kv_err e = {{0}};
    dump_file *f = open_ok(path);
    dump_dataset_info di = dump_stage_info(f, 0, st);
    ck_assert(di.present && di.rows == N && di.cols == cols && di.first_position == 0);
    float *got = malloc((size_t)N * cols * sizeof *got);
    ck_assert_msg(dump_read_rows(f, 0, st, 0, N, got, &e) == 0, "%s", e.msg);
    ck_assert_msg(memcmp(got, want, (size_t)N * cols * sizeof *got) == 0, "%s: rows differ",
                  stage_name(st));
    ck_assert_int_eq(dump_n_tokens(f), N);
    free(got);
    dump_file_close(f);
}

/* Fingerprint mode: the hash of each row's bytes, its max |x| (exact: NaN
 * never wins), its L2 norm (NaN when the row holds one; else the norm
 * summed in double, to float precision: the summation order is the
 * writer's). Returns the (N) hashes and (N, 2) statistics read. */
static void check_fingerprints(const char *path, kv_stage st, const float *rows, int cols,
                               uint64_t *hash, float *stats)
{
    kv_err e = {{0}};
    dump_file *f = open_ok(path);
    ck_assert_msg(dump_read_hashes(f, 0, st, 0, N, hash, stats, &e) == 0, "%s", e.msg);
    for (int p = 0; p < N; p++) {
        const float *x = rows + (size_t)p * cols;
        double ss = 0;
        float mx = 0;
        bool nan = false;
        for (int j = 0; j < cols; j++) {
            ss += (double)x[j] * x[j];
            nan = nan || isnan(x[j]);
            mx = fabsf(x[j]) > mx ? fabsf(x[j]) : mx;
        }
        ck_assert_msg(hash[p] == XXH3_64bits(x, (size_t)cols * sizeof *x), "%s row %d",
                      stage_name(st), p);
        ck_assert_msg(stats[2 * p + 1] == mx, "%s row %d: max %g, want %g", stage_name(st), p,
                      stats[2 * p + 1], mx);
        if (nan) {
            ck_assert_msg(isnan(stats[2 * p]), "%s row %d: L2 of a row with NaN", stage_name(st), p);
        } else {
            double want = sqrt(ss), got = stats[2 * p];
            ck_assert_msg(isinf(want) ? got == want : fabs(got - want) <= 1e-6 * want,
                          "%s row %d: L2 %.9g, want %.9g", stage_name(st), p, got, want);
        }
    }
    dump_file_close(f);
}

START_TEST(test_event_sizes_do_not_matter)
{
    static const int splits[] = {N, 1, 3, BLOCK, 2 * BLOCK + 1};
    char dir[64], path[128];
    rows_fixture fx;
    fixture_init(&fx);
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    uint64_t hash0[2][N], hash[2][N];
    float stats0[2][2 * N], stats[2][2 * N];
    for (size_t i = 0; i < sizeof splits / sizeof *splits; i++) {
        for (int compress = 0; compress <= 1; compress++) {
            snprintf(path, sizeof path, "%s/full_%d_%d.h5", dir, splits[i], compress);
            write_split(&fx, path, splits[i], false, compress);
            check_rows(path, STAGE_X_IN, fx.x_in, fx.E);
            check_rows(path, STAGE_ATTN_NORM_STATS, fx.stats, 3);
        }
        snprintf(path, sizeof path, "%s/fp_%d.h5", dir, splits[i]);
        write_split(&fx, path, splits[i], true, false);
        check_fingerprints(path, STAGE_X_IN, fx.x_in, fx.E, hash[0], stats[0]);
        check_fingerprints(path, STAGE_ATTN_NORM_STATS, fx.stats, 3, hash[1], stats[1]);
        if (i == 0) {
            memcpy(hash0, hash, sizeof hash);
            memcpy(stats0, stats, sizeof stats);
        }
        /* The statistics are the same bits whatever the events' sizes. */
        ck_assert(memcmp(hash0, hash, sizeof hash) == 0);
        ck_assert_msg(memcmp(stats0, stats, sizeof stats) == 0, "split %d", splits[i]);
    }
    test_rmtree(dir);
    fixture_free(&fx);
}
END_TEST

/* ------------------------------------------------------------------ */
/* A file size limit anywhere in a run                                  */

#define P 40
#define NEW 8

/* In a child: a real run of tiny-gemma3 into path with the file allowed
 * to grow `extra` bytes past its size after creation. Exit status: 0 when
 * the writer behaved (the run completed, or stopped with an error naming
 * the file and "file size limit reached (ulimit -f)" and dump_close failed), else which check
 * failed. A crash of libhdf5 (as at exit, after a failed close) is a
 * signal. */
static int run_limited(const char *path, long extra, bool fingerprint, bool compress, int block)
{
    kv_err e = {{0}};
    kv_model m;
    model_opts mo = {.wtype = KERN_F32};
    if (model_from_preset("tiny-gemma3", 0, &mo, &m, &e) < 0)
        return 10;
    dump_opts o;
    dump_opts_default(&o);
    o.full_logits = true;
    o.block_rows = block;
    o.fingerprint = fingerprint;
    o.compress = compress;
    dump_meta meta = {.engine = "reference", .engine_settings = "{}", .cfg = &m.cfg,
                      .tool_version = "kvdiff test", .max_positions = P + NEW, .prompt_length = P};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    struct stat st;
    if (!w || stat(path, &st) != 0)
        return 11;
    struct rlimit rl = {.rlim_cur = (rlim_t)st.st_size + (rlim_t)extra, .rlim_max = RLIM_INFINITY};
    signal(SIGXFSZ, SIG_IGN);
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0)
        return 12;
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    ref_opts ro = {.max_ctx = P + NEW, .prefill_step = 0};
    kv_engine *eng = ref_create(&m, &kc, &ro, dump_observer(w), &e);
    if (!eng)
        return 13;
    int32_t prompt[P];
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m.cfg.vocab);
    gen_opts go = {.max_new = NEW, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    int rc = generate(eng, &m.cfg, prompt, P, &go, dump_observer(w), &res, &e);
    if (rc == 0)
        gen_result_free(&res);
    engine_free(eng);
    const char *err = dump_error(w);
    bool too_large = err && strstr(err, "file size limit reached (ulimit -f)") && strstr(err, path);
    if (rc != 0 && !too_large)
        return 14;
    int closed = dump_close(w, NULL, &e);
    if (closed != 0 && !(strstr(e.msg, "file size limit reached (ulimit -f)") && strstr(e.msg, path)))
        return 15;
    if (rc != 0 && closed == 0)
        return 16;
    model_free(&m);
    return H5close() < 0 ? 17 : closed == 0 ? 0 : 1;
}

START_TEST(test_file_size_limits)
{
    static const long extras[] = {0, 2048, 8192, 70000, 1 << 22};
    char dir[64], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    int stopped = 0, completed = 0;
    for (int mode = 0; mode < 3; mode++)
        for (int block = BLOCK; block <= 64; block *= 8)
            for (size_t i = 0; i < sizeof extras / sizeof *extras; i++) {
                snprintf(path, sizeof path, "%s/limit_%d_%d_%zu.h5", dir, mode, block, i);
                fflush(NULL);
                pid_t pid = fork();
                ck_assert(pid >= 0);
                if (pid == 0)
                    _exit(run_limited(path, extras[i], mode == 1, mode == 2, block));
                int status;
                ck_assert(waitpid(pid, &status, 0) == pid);
                ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) <= 1,
                              "%s mode %d, blocks of %d, %ld bytes allowed: status %d",
                              path, mode, block, extras[i], status);
                /* What is on disk opens, and says complete only if it is. */
                kv_err e = {{0}};
                dump_file *f = dump_open(path, &e);
                if (f && WEXITSTATUS(status) == 1)
                    ck_assert_str_ne(dump_attr(f, "status"), "complete");
                if (f && WEXITSTATUS(status) == 0)
                    ck_assert_str_eq(dump_attr(f, "status"), "complete");
                dump_file_close(f);
                stopped += WEXITSTATUS(status) == 1;
                completed += WEXITSTATUS(status) == 0;
            }
    /* Both outcomes were exercised. */
    ck_assert_int_gt(stopped, 0);
    ck_assert_int_gt(completed, 0);
    test_rmtree(dir);
}
END_TEST

Suite *dump_writer_suite(void)
{
    Suite *s = suite_create("dump_writer");
    TCase *tc = tcase_create("writer");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_event_sizes_do_not_matter);
    tcase_add_test(tc, test_file_size_limits);
    suite_add_tcase(s, tc);
    return s;
}
