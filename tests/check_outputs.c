/* check_outputs.c — the one output discipline (model/outfile.h), tried on
 * every writer kvdiff and kvdiff-llama have, as a user would meet it.
 *
 * At each writer's output path the test plants, in turn, a symbolic link
 * to a victim file, a FIFO, a character device (where mknod is allowed)
 * and one of the run's own inputs (a hard link: the same file under the
 * output's name). Each must be refused with exit 2 and a message naming
 * the path, the planted thing must be left exactly as it was, and no
 * temporary file may be left beside it. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "testutil.h"
#include "gguf_patch.h"
#include "../model/outfile.h"

static char out[16384];

enum { PLANT_LINK, PLANT_FIFO, PLANT_DEVICE, PLANT_INPUT, PLANT_COUNT };
static const char *const plant_names[PLANT_COUNT] = {"symlink", "FIFO", "device", "input"};

typedef struct {
    const char *what;      /* the writer, in words */
    bool recorder;         /* kvdiff-llama rather than kvdiff */
    const char *args;      /* %1$s: the test folder */
    const char *target;    /* the output path inside the test folder */
    const char *input;     /* one of the run's inputs (in the test folder), or NULL */
} writer;

static const writer writers[] = {
    {"run --dump", false,
     "run --model %1$s/m --prompt-ids-file %1$s/ids.txt --max-new 1 --dump %1$s/out.h5",
     "out.h5", "ids.txt"},
    {"kvdiff-llama --dump", true,
     "%1$s/m.gguf --prompt-ids-file %1$s/ids.txt --max-new 1 --threads 1 --dump %1$s/out.h5",
     "out.h5", "ids.txt"},
    {"gen --gguf (preset)", false, "gen --preset tiny-llama --gguf %1$s/out.gguf", "out.gguf",
     NULL},
    {"gen --from --gguf", false, "gen --from %1$s/m --gguf %1$s/out.gguf", "out.gguf",
     "m/config.json"},
    {"gen -o (config.json)", false, "gen --preset tiny-llama -o %1$s/g", "g/config.json", NULL},
    {"gen -o (safetensors)", false, "gen --preset tiny-llama -o %1$s/g", "g/model.safetensors",
     NULL},
    {"report index.html", false, "report %1$s/ref.h5 %1$s/t.h5 -o %1$s/rp", "rp/index.html",
     "ref.h5"},
    {"report summary.md", false, "report %1$s/ref.h5 %1$s/t.h5 -o %1$s/rp", "rp/summary.md",
     "t.h5"},
    {"report plot", false, "report %1$s/ref.h5 %1$s/t.h5 -o %1$s/rp", "rp/plots/heatmap.png",
     "ref.h5"},
    {"report plot data", false, "report %1$s/ref.h5 %1$s/t.h5 -o %1$s/rp",
     "rp/plots/steps.dat", "t.h5"},
    {"bisect fingerprints", false,
     "bisect --model %1$s/m --prompt-random 8 --max-new 1 --engine chunked --inject window=2 "
     "-o %1$s/bo", "bo/test.fp.h5", NULL},
};
#define N_WRITERS (sizeof writers / sizeof *writers)

static char dir[128];
static bool ready;

static void setup(void)
{
    outfile_track_inputs(false);
    ck_assert_ptr_nonnull(test_tmpdir(dir, sizeof dir));
    char args[1024];
    snprintf(args, sizeof args, "gen --preset tiny-gemma3 -o %s/m --gguf %s/m.gguf", dir, dir);
    ready = test_run_cli(args, out, sizeof out) == 0;
    snprintf(args, sizeof args, "run --model %s/m --prompt-random 12 --max-new 2 --dump %s/ref.h5",
             dir, dir);
    ready = ready && test_run_cli(args, out, sizeof out) == 0;
    snprintf(args, sizeof args, "run --model %s/m --prompt-random 12 --max-new 2 --engine chunked "
             "--chunk 5 --inject window=4 --dump %s/t.h5", dir, dir);
    ready = ready && test_run_cli(args, out, sizeof out) == 0;
    char ids[200];
    snprintf(ids, sizeof ids, "%s/ids.txt", dir);
    FILE *f = fopen(ids, "w");
    ready = ready && f && fputs("5 6 7\n", f) >= 0;
    if (f)
        fclose(f);
}

static void teardown(void)
{
    test_rmtree(dir);
}

/* A file's bytes (malloc'd), to see that a planted input is unchanged. */
static char *bytes_of(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *b = NULL;
    size_t cap = 0;
    *n = 0;
    for (;;) {
        if (*n + 65536 > cap) {
            cap = 2 * cap + 65536;
            b = realloc(b, cap);
        }
        size_t k = fread(b + *n, 1, cap - *n, f);
        *n += k;
        if (k == 0)
            break;
    }
    fclose(f);
    return b;
}

/* Names starting with "." in folder: a temporary file left behind. */
static int hidden_entries(const char *folder)
{
    DIR *d = opendir(folder);
    if (!d)
        return 0;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        n += de->d_name[0] == '.' && strcmp(de->d_name, ".") && strcmp(de->d_name, "..");
    closedir(d);
    return n;
}

static void mkdirs_for(const char *path)
{
    char p[512];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = strchr(p + 1, '/'); s; s = strchr(s + 1, '/')) {
        *s = 0;
        mkdir(p, 0755);
        *s = '/';
    }
}

START_TEST(test_every_writer_refuses_what_it_did_not_create)
{
    ck_assert_msg(ready, "setting up the models and dumps failed: %s", out);
    const writer *w = &writers[_i / PLANT_COUNT];
    const int kind = _i % PLANT_COUNT;
    if (kind == PLANT_INPUT && !w->input)
        return;   /* this writer reads no file of the user's */
    if (w->recorder && !getenv("KVDIFF_LLAMA_BIN") && access("kvdiff-llama", X_OK) != 0)
        return;   /* no llama.cpp recorder built */
    char target[512], victim[512], input[512], args[2048], folder[512];
    snprintf(target, sizeof target, "%s/%s", dir, w->target);
    snprintf(victim, sizeof victim, "%s/victim.txt", dir);
    mkdirs_for(target);
    unlink(target);   /* what an earlier case left when it failed */
    snprintf(folder, sizeof folder, "%s", target);
    *strrchr(folder, '/') = 0;
    FILE *f = fopen(victim, "w");
    ck_assert_ptr_nonnull(f);
    fputs("the user's file\n", f);
    fclose(f);
    mode_t want = 0;
    switch (kind) {
    case PLANT_LINK:
        ck_assert_int_eq(symlink(victim, target), 0);
        want = S_IFLNK;
        break;
    case PLANT_FIFO:
        ck_assert_int_eq(mkfifo(target, 0600), 0);
        want = S_IFIFO;
        break;
    case PLANT_DEVICE:
        /* /dev/null's numbers: harmless if a writer did open it */
        if (mknod(target, S_IFCHR | 0600, makedev(1, 3)) != 0)
            return;   /* not allowed here (not root): the other kinds still run */
        want = S_IFCHR;
        break;
    default:
        snprintf(input, sizeof input, "%s/%s", dir, w->input);
        ck_assert_int_eq(link(input, target), 0);
        want = S_IFREG;
    }
    size_t n0 = 0, n1 = 0;
    char *before = kind == PLANT_INPUT ? bytes_of(target, &n0) : NULL;
    snprintf(args, sizeof args, w->args, dir);
    int rc = w->recorder ? test_run_recorder(args, out, sizeof out)
                         : test_run_cli(args, out, sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, strrchr(target, '/') + 1), "%s with a %s at %s: exit %d\n%s", w->what,
                  plant_names[kind], w->target, rc, out);
    struct stat sb;
    ck_assert_msg(lstat(target, &sb) == 0 && (sb.st_mode & S_IFMT) == want,
                  "%s: the planted %s was removed or replaced", w->what, plant_names[kind]);
    char *victim_now = bytes_of(victim, &n1);
    ck_assert_msg(victim_now && n1 == 16 && !memcmp(victim_now, "the user's file\n", 16),
                  "%s: the file the link points to was written", w->what);
    free(victim_now);
    if (kind == PLANT_INPUT) {
        char *after = bytes_of(target, &n1);
        ck_assert_msg(after && n0 == n1 && !memcmp(before, after, n0),
                      "%s: the input %s was changed", w->what, w->input);
        free(after);
    }
    free(before);
    ck_assert_msg(hidden_entries(folder) == 0, "%s: a temporary file was left in %s", w->what,
                  folder);
    unlink(target);
}
END_TEST

/* A folder kvdiff names inside an output folder (the report's plots/) or
 * in the working folder (the demo's kvdiff-demo/) is never a link it
 * follows; the folder the user names is taken as given. */
START_TEST(test_tool_folders_are_not_followed)
{
    ck_assert_msg(ready, "setting up the models and dumps failed: %s", out);
    char p[256], q[600], args[1024];
    snprintf(p, sizeof p, "%s/elsewhere", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(q, sizeof q, "%s/tf-rp", dir);
    ck_assert_int_eq(mkdir(q, 0755), 0);
    snprintf(q, sizeof q, "%s/tf-rp/plots", dir);
    ck_assert_int_eq(symlink(p, q), 0);
    snprintf(args, sizeof args, "report %s/ref.h5 %s/t.h5 -o %s/tf-rp", dir, dir, dir);
    int rc = test_run_cli(args, out, sizeof out);
    ck_assert_msg(rc == 2 && strstr(out, "tf-rp/plots: is a symbolic link"), "exit %d\n%s", rc, out);
    ck_assert_int_eq(hidden_entries(p), 0);
    struct stat sb;
    snprintf(q, sizeof q, "%s/heatmap.dat", p);
    ck_assert_int_ne(lstat(q, &sb), 0);
    /* the user's own folder may be a link: -o LINK writes through it */
    snprintf(q, sizeof q, "%s/rp-link", dir);
    ck_assert_int_eq(symlink(p, q), 0);
    snprintf(args, sizeof args, "report %s/ref.h5 %s/t.h5 -o %s/rp-link", dir, dir, dir);
    rc = test_run_cli(args, out, sizeof out);
    ck_assert_msg(rc == 1, "exit %d\n%s", rc, out);
    snprintf(q, sizeof q, "%s/index.html", p);
    ck_assert_int_eq(lstat(q, &sb), 0);
    ck_assert_int_eq(hidden_entries(p), 0);
    /* the demo's folder */
    snprintf(p, sizeof p, "%s/work", dir);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(q, sizeof q, "%s/kvdiff-demo", p);
    char target[256];
    snprintf(target, sizeof target, "%s/elsewhere", dir);
    ck_assert_int_eq(symlink(target, q), 0);
    /* The demo writes into the working folder: go there for this one run
     * and come back before any check (without a fork per test, a later
     * test would run in a removed folder). */
    int home = open(".", O_RDONLY | O_DIRECTORY);
    ck_assert_int_ge(home, 0);
    ck_assert_int_eq(chdir(p), 0);
    rc = test_run_cli("", out, sizeof out);
    ck_assert_int_eq(fchdir(home), 0);
    close(home);
    ck_assert_msg(rc == 2 && strstr(out, "kvdiff-demo: is a symbolic link"), "exit %d\n%s", rc,
                  out);
    snprintf(q, sizeof q, "%s/ref.h5", target);
    ck_assert_int_ne(lstat(q, &sb), 0);
}
END_TEST

/* The outfile API itself: a target that changes while the file is written
 * is checked again before the rename. */
START_TEST(test_commit_checks_again)
{
    char d[128], path[256], victim[256];
    ck_assert_ptr_nonnull(test_tmpdir(d, sizeof d));
    snprintf(path, sizeof path, "%s/out.txt", d);
    snprintf(victim, sizeof victim, "%s/victim", d);
    outfile o;
    kv_err e = {{0}};
    ck_assert_int_eq(outfile_open(&o, path, &e), 0);
    fputs("new\n", o.f);
    ck_assert_int_eq(symlink(victim, path), 0);
    ck_assert_int_eq(outfile_commit(&o, &e), -1);
    ck_assert_msg(strstr(e.msg, "is a symbolic link"), "%s", e.msg);
    struct stat sb;
    ck_assert(lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode));
    ck_assert_int_eq(hidden_entries(d), 0);
    ck_assert_int_eq(unlink(path), 0);
    /* an input noted while tracking is on */
    FILE *f = fopen(path, "w");
    fputs("input\n", f);
    fclose(f);
    outfile_track_inputs(true);
    outfile_note_input(path);
    ck_assert_int_eq(outfile_open(&o, path, &e), -1);
    ck_assert_msg(strstr(e.msg, "is one of this run's inputs"), "%s", e.msg);
    outfile_forget_inputs();
    ck_assert_int_eq(outfile_open(&o, path, &e), 0);
    fputs("replaced\n", o.f);
    ck_assert_int_eq(outfile_commit(&o, &e), 0);
    outfile_track_inputs(false);
    ck_assert_int_eq(hidden_entries(d), 0);
    test_rmtree(d);
}
END_TEST

Suite *outputs_suite(void)
{
    Suite *s = suite_create("outputs");
    TCase *tc = tcase_create("outputs");
    tcase_add_unchecked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, test_every_writer_refuses_what_it_did_not_create, 0,
                        (int)(N_WRITERS * PLANT_COUNT));
    tcase_add_test(tc, test_tool_folders_are_not_followed);
    tcase_add_test(tc, test_commit_checks_again);
    suite_add_tcase(s, tc);
    return s;
}
