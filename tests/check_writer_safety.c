/* check_writer_safety.c — what the dump writer promises when things go
 * wrong around it: a second writer of the same path is refused and the
 * first one's file stays sound; a file replaced under a writer is not
 * marked complete; a writer killed with SIGKILL during decode leaves
 * every finished position in the file; a path that is not a regular file
 * (a device, a FIFO, a directory) is refused and left as it was. */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include "dump/dump.h"
#include "gguf_patch.h"
#include "model/generate.h"
#include "reference/reference.h"
#include "testutil.h"

static char out[1 << 16];

/* ------------------------------------------------------------------ */
/* Two writers of one path                                              */


START_TEST(test_second_writer_is_refused)
{
    char dir[64], path[128], args[512];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/shared.h5", dir);
    pid_t first = test_start_long_run(path);
    ck_assert_msg(first > 0, "the run ended before it wrote 4 MB");
    /* Held still while the second run tries, so it is surely running. */
    int status;
    ck_assert_int_eq(kill(first, SIGSTOP), 0);
    ck_assert_int_eq(waitpid(first, &status, WUNTRACED), first);
    ck_assert_msg(WIFSTOPPED(status), "the first run ended before the second started");
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 10 --max-new 2 --dump %s",
             path);
    int rc = test_run_cli(args, out, sizeof out);
    kill(first, SIGCONT);
    ck_assert_msg(rc == 2, "second writer: exit %d: %s", rc, out);
    ck_assert_msg(strstr(out, path) && strstr(out, "another kvdiff is writing this file"), "%s",
                  out);
    ck_assert_msg(strchr(out, '\n') && strchr(out, '\n')[1] == 0, "not one line: %s", out);
    /* The first run goes on undisturbed: stopped with Ctrl-C, its file is
     * sound and says so. */
    ck_assert_int_eq(kill(first, SIGINT), 0);
    ck_assert_int_eq(waitpid(first, &status, 0), first);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 130, "status %d", status);
    snprintf(args, sizeof args, "validate %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "inspect %s", path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "status    partial: interrupted by SIGINT"), "%s", out);
    ck_assert_msg(strstr(out, "(prompt 96)"), "%s", out);
    /* And once it has ended, the path is free again. */
    snprintf(args, sizeof args, "run --model tiny-gemma3 --prompt-random 10 --max-new 2 --dump %s",
             path);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    test_rmtree(dir);
}
END_TEST

/* In one process too: a second dump_create of a path being written
 * fails, and leaves the first writer's file alone. */
START_TEST(test_second_writer_in_process)
{
    char dir[64], path[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/twice.h5", dir);
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_msg(config_preset("tiny-llama", &cfg, &e) == 0, "%s", e.msg);
    dump_opts o;
    dump_opts_default(&o);
    dump_meta meta = {.engine = "test", .cfg = &cfg, .max_positions = 4, .prompt_length = 4};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    struct stat before, after;
    ck_assert_int_eq(stat(path, &before), 0);
    ck_assert_ptr_null(dump_create(path, &meta, &o, &e));
    ck_assert_msg(strstr(e.msg, "another kvdiff is writing this file"), "%s", e.msg);
    ck_assert_int_eq(stat(path, &after), 0);
    ck_assert_int_eq(before.st_ino, after.st_ino);
    ck_assert_int_eq(before.st_size, after.st_size);
    ck_assert_msg(dump_close(w, NULL, &e) == 0, "%s", e.msg);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert(dump_is_complete(f));
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

/* A file put in the writer's place while it ran (another program's
 * rename) is not the writer's to mark complete. */
START_TEST(test_replaced_file_keeps_its_status)
{
    char dir[64], path[128], other[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/mine.h5", dir);
    snprintf(other, sizeof other, "%s/other.h5", dir);
    kv_config cfg;
    kv_err e = {{0}};
    ck_assert_msg(config_preset("tiny-llama", &cfg, &e) == 0, "%s", e.msg);
    dump_opts o;
    dump_opts_default(&o);
    dump_meta meta = {.engine = "test", .cfg = &cfg, .max_positions = 4, .prompt_length = 4};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    ck_assert_msg(w != NULL, "%s", e.msg);
    dump_writer *w2 = dump_create(other, &meta, &o, &e);
    ck_assert_msg(w2 != NULL, "%s", e.msg);
    ck_assert_int_eq(dump_close(w2, "made by someone else", &e), 0);
    ck_assert_int_eq(rename(other, path), 0);
    ck_assert_int_eq(dump_close(w, NULL, &e), -1);
    ck_assert_msg(strstr(e.msg, path) && strstr(e.msg, "replaced"), "%s", e.msg);
    dump_file *f = dump_open(path, &e);
    ck_assert_msg(f != NULL, "%s", e.msg);
    ck_assert_str_eq(dump_attr(f, "status"), "partial: made by someone else");
    dump_file_close(f);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* kill -9 during decode                                                */

#define P 40       /* prompt */
#define NEW 90     /* decode steps the run would take */
#define ANNOUNCE 30  /* the child says so after this many generated tokens */

/* Passes nothing on; after the ANNOUNCE-th generated token (the dump,
 * first in the tee, has taken it) writes a byte to fd and waits to be
 * killed. */
typedef struct {
    kv_observer obs;
    int fd;
    int seen;
} announcer;

static int ann_emit(kv_observer *self, const kv_event *ev)
{
    (void)self;
    (void)ev;
    return 0;
}

static int ann_wants(kv_observer *self, kv_stage st, int layer)
{
    (void)self;
    (void)st;
    (void)layer;
    return 0;
}

static int ann_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    announcer *a = (announcer *)self;
    (void)pos;
    (void)id;
    if (!is_prompt && ++a->seen == ANNOUNCE) {
        if (write(a->fd, "x", 1) != 1)
            _exit(3);
        for (;;)
            pause();
    }
    return 0;
}

/* A real reference run of tiny-gemma3 into path (mode 0 full, 1
 * fingerprint, 2 compressed). announce_fd < 0: runs to the end. Exit
 * status 0 when it did. */
static int decode_run(const char *path, int mode, int announce_fd)
{
    kv_err e = {{0}};
    kv_model m;
    model_opts mo = {.wtype = KERN_F32};
    if (model_from_preset("tiny-gemma3", 0, &mo, &m, &e) < 0)
        return 10;
    dump_opts o;
    dump_opts_default(&o);
    o.fingerprint = mode == 1;
    o.compress = mode == 2;
    dump_meta meta = {.engine = "reference", .engine_settings = "{}", .cfg = &m.cfg,
                      .tool_version = "kvdiff test", .max_positions = P + NEW, .prompt_length = P};
    dump_writer *w = dump_create(path, &meta, &o, &e);
    if (!w)
        return 11;
    announcer ann = {.obs = {.emit = ann_emit, .token = ann_token, .wants = ann_wants},
                     .fd = announce_fd};
    kv_observer_tee tee;
    kv_observer *obs = announce_fd >= 0 ? obs_tee_init(&tee, dump_observer(w), &ann.obs)
                                        : dump_observer(w);
    kern_ctx kc = {.isa = kern_isa_best(), .pool = NULL};
    ref_opts ro = {.max_ctx = P + NEW, .prefill_step = 0};
    kv_engine *eng = ref_create(&m, &kc, &ro, obs, &e);
    if (!eng)
        return 12;
    int32_t prompt[P];
    for (int i = 0; i < P; i++)
        prompt[i] = (int32_t)((i * 53 + 7) % m.cfg.vocab);
    gen_opts go = {.max_new = NEW, .ignore_eos = true, .samp = {.temperature = 0, .top_p = 1}};
    gen_result res;
    if (generate(eng, &m.cfg, prompt, P, &go, obs, &res, &e) != 0)
        return 13;
    gen_result_free(&res);
    engine_free(eng);
    if (dump_close(w, NULL, &e) != 0)
        return 14;
    model_free(&m);
    return 0;
}

/* Rows [0, n) of a stage read the same from both files (row bytes in
 * full mode, hashes and statistics in fingerprint mode). */
static void same_rows(dump_file *a, dump_file *b, int layer, kv_stage st, int64_t n, bool fp)
{
    kv_err e = {{0}};
    dump_dataset_info di = dump_stage_info(a, layer, st);
    size_t cols = fp ? 1 : (size_t)di.cols;
    float *x = malloc((size_t)n * cols * sizeof *x), *y = malloc((size_t)n * cols * sizeof *y);
    uint64_t *hx = malloc((size_t)n * sizeof *hx), *hy = malloc((size_t)n * sizeof *hy);
    ck_assert(x && y && hx && hy);
    if (fp) {
        ck_assert_msg(dump_read_hashes(a, layer, st, 0, n, hx, NULL, &e) == 0, "%s", e.msg);
        ck_assert_msg(dump_read_hashes(b, layer, st, 0, n, hy, NULL, &e) == 0, "%s", e.msg);
        ck_assert_msg(memcmp(hx, hy, (size_t)n * sizeof *hx) == 0, "layer %d %s: hashes differ",
                      layer, stage_name(st));
    } else {
        ck_assert_msg(dump_read_rows(a, layer, st, 0, n, x, &e) == 0, "%s", e.msg);
        ck_assert_msg(dump_read_rows(b, layer, st, 0, n, y, &e) == 0, "%s", e.msg);
        ck_assert_msg(memcmp(x, y, (size_t)n * cols * sizeof *x) == 0,
                      "layer %d %s: rows differ", layer, stage_name(st));
    }
    free(x);
    free(y);
    free(hx);
    free(hy);
}

static void count_violation(void *ctx, const char *line)
{
    (void)line;
    ++*(int *)ctx;
}

START_TEST(test_kill_9_keeps_every_finished_position)
{
    const int mode = _i;
    char dir[64], path[128], whole[128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(path, sizeof path, "%s/killed.h5", dir);
    snprintf(whole, sizeof whole, "%s/whole.h5", dir);
    int p[2];
    ck_assert_int_eq(pipe(p), 0);
    fflush(NULL);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        close(p[0]);
        _exit(decode_run(path, mode, p[1]));
    }
    close(p[1]);
    char byte;
    ck_assert_int_eq(read(p[0], &byte, 1), 1);
    close(p[0]);
    int status;
    ck_assert_int_eq(kill(pid, SIGKILL), 0);
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    /* The same run to its end, to compare the rows with. */
    pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(decode_run(whole, mode, -1));
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "status %d", status);

    kv_err e = {{0}};
    dump_file *f = dump_open(path, &e), *g = dump_open(whole, &e);
    ck_assert_msg(f && g, "%s", e.msg);
    /* written "partial: running"; read as what it is, no writer holding it */
    ck_assert_msg(strstr(dump_attr(f, "status"), "partial: its writer ended without closing "
                                                 "it") == dump_attr(f, "status"),
                  "%s", dump_attr(f, "status"));
    /* ANNOUNCE tokens were generated: positions up to P + ANNOUNCE - 2
     * went through every layer, and the last token is known. */
    const int64_t done = P + ANNOUNCE - 1;
    ck_assert_int_eq(dump_n_tokens(f), P + ANNOUNCE);
    const bool fp = mode == 1;
    int stages = 0;
    for (int l = -1; l < dump_n_layers(f); l++)
        for (int st = 0; st < STAGE_COUNT; st++) {
            dump_dataset_info di = dump_stage_info(f, l, (kv_stage)st);
            if (!di.present)
                continue;
            stages++;
            ck_assert_msg(di.rows >= done, "mode %d layer %d %s: %lld rows of %lld finished "
                          "positions", mode, l, stage_name((kv_stage)st), (long long)di.rows,
                          (long long)done);
            if (!fp) {
                dump_dataset_info hi = dump_hash_info(f, l, (kv_stage)st);
                ck_assert_msg(hi.rows >= done, "layer %d %s: %lld hashes", l,
                              stage_name((kv_stage)st), (long long)hi.rows);
            }
            same_rows(f, g, l, (kv_stage)st, done, fp);
        }
    ck_assert_int_gt(stages, 6 * 10);
    /* /output from the last prompt position: one row per generated token. */
    dump_dataset_info oi = dump_output_info(f);
    ck_assert_int_eq(oi.first_position, P - 1);
    ck_assert_msg(oi.rows >= ANNOUNCE, "%lld output rows", (long long)oi.rows);
    dump_file_close(f);
    dump_file_close(g);
    /* What the crash left is a sound (partial) dump. */
    int violations = 0;
    ck_assert_int_eq(dump_validate(path, count_violation, &violations, &e), 0);
    test_rmtree(dir);
}
END_TEST

/* ------------------------------------------------------------------ */
/* Outputs that are not regular files                                   */

/* `--dump` at a symlink to /dev/null, a FIFO and a directory: kvdiff and
 * kvdiff-llama refuse each in one line, exit 2, and remove nothing (the
 * writer used to truncate /dev/null, fail to switch it to SWMR mode, and
 * unlink the path: on a machine, /dev/null itself). */
START_TEST(test_not_a_regular_file)
{
    char dir[64], args[1024], paths[3][128];
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    snprintf(paths[0], sizeof paths[0], "%s/null.h5", dir);
    snprintf(paths[1], sizeof paths[1], "%s/fifo.h5", dir);
    snprintf(paths[2], sizeof paths[2], "%s/dir.h5", dir);
    ck_assert_int_eq(symlink("/dev/null", paths[0]), 0);
    ck_assert_int_eq(mkfifo(paths[1], 0600), 0);
    ck_assert_int_eq(mkdir(paths[2], 0700), 0);
    static const char *const kinds[] = {"a symbolic link", "a FIFO", "a directory"};
    static const mode_t modes[] = {S_IFLNK, S_IFIFO, S_IFDIR};
    snprintf(args, sizeof args, "gen --preset tiny-llama --gguf %s/m.gguf", dir);
    ck_assert_msg(test_run_cli(args, out, sizeof out) == 0, "%s", out);
    snprintf(args, sizeof args, "5 6 7\n");
    char ids[128];
    snprintf(ids, sizeof ids, "%s/ids.txt", dir);
    FILE *f = fopen(ids, "w");
    ck_assert_ptr_nonnull(f);
    fputs(args, f);
    fclose(f);
    for (int i = 0; i < 3; i++)
        for (int tool = 0; tool < 2; tool++) {
            int rc;
            if (tool == 0) {
                snprintf(args, sizeof args, "run --model tiny-llama --prompt-random 4 --max-new 1 "
                         "--dump %s", paths[i]);
                rc = test_run_cli(args, out, sizeof out);
            } else {
                snprintf(args, sizeof args, "%s/m.gguf --prompt-ids-file %s --max-new 1 "
                         "--threads 1 --dump %s", dir, ids, paths[i]);
                rc = test_run_recorder(args, out, sizeof out);
            }
            ck_assert_msg(rc == 2 && (strstr(out, "not a regular file") ||
                                      strstr(out, "is a symbolic link")) &&
                              strstr(out, kinds[i]) &&
                              strstr(out, paths[i]), "%s %s: exit %d\n%s",
                          tool ? "kvdiff-llama" : "kvdiff", paths[i], rc, out);
            struct stat sb;
            ck_assert_msg(lstat(paths[i], &sb) == 0 && (sb.st_mode & S_IFMT) == modes[i],
                          "%s was removed or replaced", paths[i]);
        }
    struct stat dn;
    ck_assert(stat("/dev/null", &dn) == 0 && S_ISCHR(dn.st_mode));
    test_rmtree(dir);
}
END_TEST

Suite *writer_safety_suite(void)
{
    Suite *s = suite_create("writer_safety");
    TCase *tc = tcase_create("safety");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_second_writer_is_refused);
    tcase_add_test(tc, test_second_writer_in_process);
    tcase_add_test(tc, test_replaced_file_keeps_its_status);
    tcase_add_loop_test(tc, test_kill_9_keeps_every_finished_position, 0, 3);
    tcase_add_test(tc, test_not_a_regular_file);
    suite_add_tcase(s, tc);
    return s;
}
