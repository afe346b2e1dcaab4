/* check_readme.c — the docs' commands, run as a reader who installed
 * kvdiff pastes them.
 *
 * README.md's install block (the one starting `# readme-test: install`)
 * runs first, as written, from a copy of the source tree's python/ (pip
 * builds in the folder it installs from), with HOME a fresh folder and
 * `make` standing for `make -C <source tree>` on the already built binary
 * (BUILD the folder of KVDIFF_BIN, nothing rebuilt, man pages made in the
 * test's folder, KVDIFF_LLAMA_BIN as kvdiff-llama) and `python3` for
 * KVDIFF_PYTHON, so nothing is written into the source tree. The PATH that block leaves is what every later
 * block runs with: bare `kvdiff`, `kvdiff-llama` and `kvdiff-record` are
 * the installed ones, and `./kvdiff` (the build's binary, which an
 * installed user does not have) fails the test.
 *
 * Then every ```sh block of README.md runs, in order, in one fresh, empty
 * folder; then those of each docs/ page and of recorders/llamacpp/README.md,
 * each file's in a fresh, empty folder of its own; under `set -e` and a
 * time limit. A block may start with
 *   # readme-test: skip (why)   not run (root, network, minutes of work)
 *   # readme-test: exit N       its last command exits N (default 0)
 * A ```text block right after the line
 *   <!-- readme-test: output of the block above -->
 * is output the file quotes: each of its lines must appear in what the
 * block before it printed (a line ending in " ..." up to there). */
#include <check.h>
#include <dirent.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define MAX_BLOCK 8192
#define OUT_MAX (1 << 20)
#define MAX_DOCS 64

typedef struct {
    char tmp[64];               /* the test's folder: home/, src/, work folders */
    char dir[PATH_MAX];         /* the folder the current file's blocks run in */
    const char *bin;
    char root[PATH_MAX];        /* the source tree: README.md */
    char path_env[8192];        /* PATH after the install block; "" before it */
    char *out;                  /* what the last block run printed */
    const char *file;           /* the file being run, for messages */
    char uninstall_line[1024];  /* the install block's make line, uninstalling */
    int blocks_run, outputs_checked, installs;
} readme_run;

/* The source tree: the working folder of `make test`, else the one above
 * the binary's build folder. */
static int find_root(readme_run *r)
{
    char path[PATH_MAX + 16];
    if (getcwd(r->root, sizeof r->root)) {
        snprintf(path, sizeof path, "%s/README.md", r->root);
        if (access(path, R_OK) == 0)
            return 0;
    }
    const char *slash = strrchr(r->bin, '/');
    if (!slash)
        return -1;
    snprintf(r->root, sizeof r->root, "%.*s/..", (int)(slash - r->bin), r->bin);
    snprintf(path, sizeof path, "%s/README.md", r->root);
    return access(path, R_OK) == 0 ? 0 : -1;
}

/* Runs cmd with system(); its exit code, -1 when it did not exit. */
static int run_shell(const char *cmd)
{
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_file(const char *path, const char *text, mode_t mode)
{
    FILE *f = fopen(path, "w");
    ck_assert_msg(f != NULL, "cannot write %s", path);
    fputs(text, f);
    ck_assert_int_eq(fclose(f), 0);
    ck_assert_int_eq(chmod(path, mode), 0);
}

/* home/, src/python (a copy: pip builds where it installs from) and
 * shim/make, the source tree's make on the built binary. */
static void prepare_install(readme_run *r)
{
    char path[PATH_MAX + 64], cmd[4 * PATH_MAX + 512], build[PATH_MAX];
    snprintf(path, sizeof path, "%s/home", r->tmp);
    ck_assert_int_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/shim", r->tmp);
    ck_assert_int_eq(mkdir(path, 0700), 0);
    snprintf(path, sizeof path, "%s/src", r->tmp);
    ck_assert_int_eq(mkdir(path, 0700), 0);
    snprintf(cmd, sizeof cmd, "cp -R '%s/python' '%s/src/python' && "
             "rm -rf '%s/src/python/build' '%s/src/python'/*.egg-info", r->root, r->tmp,
             r->tmp, r->tmp);
    ck_assert_int_eq(run_shell(cmd), 0);
    ck_assert_msg(realpath(r->bin, build) != NULL, "KVDIFF_BIN %s: not found", r->bin);
    *strrchr(build, '/') = 0;
    const char *llama = getenv("KVDIFF_LLAMA_BIN");
    char llama_arg[PATH_MAX + 32] = "INSTALL_LLAMA=";
    if (llama && *llama && access(llama, X_OK) == 0)
        snprintf(llama_arg, sizeof llama_arg, "INSTALL_LLAMA='%s'", llama);
    const char *path_now = getenv("PATH");
    static char shim[4 * PATH_MAX + 9000];
    snprintf(shim, sizeof shim,
             "#!/bin/sh\n"
             "# the source tree's make, on the binary already built: nothing rebuilt\n"
             "unset MAKEFLAGS MFLAGS MAKELEVEL\n"
             "PATH='%s' exec make -s -C '%s' -o '%s/kvdiff' BUILD='%s' MAN_BUILD='%s/man' %s "
             "\"$@\"\n",
             path_now ? path_now : "/usr/bin:/bin", r->root, build, build, r->tmp, llama_arg);
    snprintf(path, sizeof path, "%s/shim/make", r->tmp);
    write_file(path, shim, 0700);
    /* python3 is the interpreter the tests use (KVDIFF_PYTHON, the Makefile's
     * Debian one): a python3 earlier on PATH (pyenv) lacks Debian's packages */
    const char *py = getenv("KVDIFF_PYTHON");
    if (py && *py) {
        snprintf(shim, sizeof shim, "#!/bin/sh\nexec '%s' \"$@\"\n", py);
        snprintf(path, sizeof path, "%s/shim/python3", r->tmp);
        write_file(path, shim, 0700);
    }
}

/* The environment every block runs in: HOME the test's, MANPATH and
 * PYTHONPATH unset (man finds pages from PATH, python the installed
 * package), pip kept off the network (the install is offline, as the
 * README says), PATH the one the install block left. */
static void block_command(const readme_run *r, const char *cwd, const char *path_env,
                          char *cmd, size_t n)
{
    snprintf(cmd, n, "cd '%s' && unset MANPATH PYTHONPATH VIRTUAL_ENV; HOME='%s/home' "
             "PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "
             "PATH='%s' timeout 300 sh '%s/block.sh' > '%s/out.txt' 2>&1", cwd, r->tmp,
             path_env, r->tmp, r->tmp);
}

static void read_output(readme_run *r)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/out.txt", r->tmp);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(r->out, 1, OUT_MAX - 1, f);
    r->out[n] = 0;
    fclose(f);
}

/* A command an installed user cannot type: the build's ./kvdiff. */
static const char *build_binary_in(const char *block)
{
    for (const char *p = strstr(block, "./kvdiff"); p; p = strstr(p + 1, "./kvdiff"))
        if (strncmp(p + 8, "-demo", 5) != 0)
            return p;
    return NULL;
}

/* The install block: run from src/ with make the shim; keeps its PATH. */
static void run_install(readme_run *r, const char *block, int line)
{
    ck_assert_msg(r->installs == 0, "README.md line %d: a second install block", line);
    ck_assert_msg(!strcmp(r->file, "README.md"), "%s line %d: install blocks belong in "
                  "README.md", r->file, line);
    ck_assert_msg(r->blocks_run == 0, "README.md line %d: %d blocks run before the install "
                  "lines", line, r->blocks_run);
    char path[PATH_MAX + 16], cwd[PATH_MAX], path_env[8192];
    static char script[MAX_BLOCK * 2], cmd[16384];
    const char *make = strstr(block, "make install");
    ck_assert_msg(make != NULL, "README.md line %d: the install block has no make install",
                  line);
    size_t len = strcspn(make, "#\n");
    snprintf(r->uninstall_line, sizeof r->uninstall_line, "make uninstall%.*s",
             (int)(len - strlen("make install")), make + strlen("make install"));
    snprintf(script, sizeof script, "set -e\n%s\necho \"readme-test-path=$PATH\"\n", block);
    snprintf(path, sizeof path, "%s/block.sh", r->tmp);
    write_file(path, script, 0600);
    snprintf(cwd, sizeof cwd, "%s/src", r->tmp);
    snprintf(path_env, sizeof path_env, "%s/shim:%s", r->tmp, getenv("PATH"));
    block_command(r, cwd, path_env, cmd, sizeof cmd);
    int rc = run_shell(cmd);
    read_output(r);
    ck_assert_msg(rc == 0, "README.md install block at line %d exited %d:\n%s\noutput:\n%s",
                  line, rc, block, r->out);
    const char *p = strstr(r->out, "readme-test-path=");
    ck_assert_ptr_nonnull(p);
    p += strlen("readme-test-path=");
    len = strcspn(p, "\n");
    ck_assert(len < sizeof r->path_env);
    memcpy(r->path_env, p, len);
    r->path_env[len] = 0;
    /* the make shim was for the install lines only */
    char shim[PATH_MAX];
    snprintf(shim, sizeof shim, "%s/shim:", r->tmp);
    char *s = strstr(r->path_env, shim);
    if (s)
        memmove(s, s + strlen(shim), strlen(s + strlen(shim)) + 1);
    /* the installed tools, not the build's, answer to their names */
    snprintf(script, sizeof script, "set -e\nfor t in kvdiff kvdiff-record; do\n"
             "  w=$(command -v $t); case \"$w\" in '%s'/home/*) ;; *) echo \"$t is $w\"; "
             "exit 1 ;; esac\ndone\n", r->tmp);
    snprintf(path, sizeof path, "%s/block.sh", r->tmp);
    write_file(path, script, 0600);
    block_command(r, r->tmp, r->path_env, cmd, sizeof cmd);
    rc = run_shell(cmd);
    read_output(r);
    ck_assert_msg(rc == 0, "after README.md's install lines: %s", r->out);
    r->installs++;
}

/* Runs one block; checks its exit code. Its output stays in r->out. */
static void run_block(readme_run *r, const char *block, int line)
{
    int want = 0;
    if (!strncmp(block, "# readme-test: skip", 19))
        return;
    if (!strncmp(block, "# readme-test: install", 22)) {
        run_install(r, block, line);
        return;
    }
    if (!strncmp(block, "# readme-test: exit ", 20))
        want = atoi(block + 20);
    ck_assert_msg(r->installs == 1, "%s line %d: a block runs before README.md's install "
                  "lines (# readme-test: install)", r->file, line);
    ck_assert_msg(build_binary_in(block) == NULL, "%s line %d: ./kvdiff is the build's "
                  "binary; after the install lines it is `kvdiff`:\n%s", r->file, line, block);
    char path[PATH_MAX + 16];
    static char script[MAX_BLOCK * 2], cmd[16384];
    snprintf(script, sizeof script, "set -e\n%s", block);
    snprintf(path, sizeof path, "%s/block.sh", r->tmp);
    write_file(path, script, 0600);
    /* a reader's command that hangs must fail the test, not stall it */
    block_command(r, r->dir, r->path_env, cmd, sizeof cmd);
    int rc = run_shell(cmd);
    read_output(r);
    ck_assert_msg(rc == want, "%s block at line %d exited %d, the file says %d:\n%s\n"
                  "output:\n%s", r->file, line, rc, want, block, r->out);
    r->blocks_run++;
}

/* Each line of the quoted output must be in the last block's output. */
static void check_output(readme_run *r, const char *quoted, int line)
{
    char buf[MAX_BLOCK];
    snprintf(buf, sizeof buf, "%s", quoted);
    for (char *save = NULL, *l = strtok_r(buf, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        size_t len = strlen(l);
        if (len >= 4 && !strcmp(l + len - 4, " ..."))
            l[len - 4] = 0;
        if (!*l)
            continue;
        ck_assert_msg(strstr(r->out, l) != NULL, "%s line %d quotes output the "
                      "command above it does not print:\n  %s\noutput was:\n%s", r->file,
                      line, l, r->out);
    }
    r->outputs_checked++;
}

/* Runs the blocks of root/rel in a fresh, empty folder of its own. */
static void run_file(readme_run *r, const char *rel, int index)
{
    char path[PATH_MAX * 2];
    snprintf(r->dir, sizeof r->dir, "%s/work%d", r->tmp, index);
    ck_assert_int_eq(mkdir(r->dir, 0700), 0);
    r->file = rel;
    snprintf(path, sizeof path, "%s/%s", r->root, rel);
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s: cannot read", rel);
    static char block[MAX_BLOCK];
    char line[4096];
    int lineno = 0, start = 0;
    enum { PROSE, SH, TEXT, QUOTED } mode = PROSE;
    bool marker = false;
    block[0] = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        bool fence = !strncmp(line, "```", 3);
        if (mode == PROSE) {
            if (fence) {
                mode = !strncmp(line, "```sh", 5) ? SH : marker ? QUOTED : TEXT;
                ck_assert_msg(!marker || mode == QUOTED, "%s line %d: the output "
                              "marker is not followed by a ```text block", rel, lineno);
                marker = false;
                block[0] = 0;
                start = lineno;
            } else if (strstr(line, "<!-- readme-test: output of the block above -->")) {
                marker = true;
            } else if (marker && line[0] != '\n') {
                ck_abort_msg("%s line %d: text between the output marker and its "
                             "block", rel, lineno);
            }
            continue;
        }
        if (!fence) {
            ck_assert_msg(strlen(block) + strlen(line) < sizeof block,
                          "%s block at line %d is too long for this test", rel, start);
            strcat(block, line);
            continue;
        }
        if (mode == SH)
            run_block(r, block, start);
        else if (mode == QUOTED)
            check_output(r, block, start);
        mode = PROSE;
    }
    fclose(f);
    ck_assert_msg(mode == PROSE, "%s: a ``` block is not closed", rel);
}

/* make uninstall with the README's install line's own PREFIX (the line
 * with `install` made `uninstall`) leaves the prefix as it found it: a file
 * of someone else's there stays, none of the install's does. */
static void check_uninstall(readme_run *r)
{
    static char script[MAX_BLOCK], cmd[16384], path_env[8192 + 128];
    char path[PATH_MAX + 16];
    snprintf(script, sizeof script,
             "set -e\nprefix=$(dirname \"$(dirname \"$(command -v kvdiff)\")\")\n"
             "echo mine > \"$prefix/bin/not-kvdiffs\"\n"
             "%s\n"
             "echo left:; find \"$prefix\" -type f\n", r->uninstall_line);
    snprintf(path, sizeof path, "%s/block.sh", r->tmp);
    write_file(path, script, 0600);
    snprintf(path_env, sizeof path_env, "%s/shim:%s", r->tmp, r->path_env);
    block_command(r, r->tmp, path_env, cmd, sizeof cmd);
    int rc = run_shell(cmd);
    read_output(r);
    ck_assert_msg(rc == 0, "make uninstall failed:\n%s\n%s", script, r->out);
    const char *left = strstr(r->out, "left:\n");
    ck_assert_ptr_nonnull(left);
    left += strlen("left:\n");
    const char *nl = strchr(left, '\n'), *mine = strstr(left, "/bin/not-kvdiffs\n");
    ck_assert_msg(nl && mine && mine + strlen("/bin/not-kvdiffs") == nl && nl[1] == 0,
                  "after make uninstall the prefix should hold only bin/not-kvdiffs:\n%s",
                  r->out);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The docs/ pages, sorted, as "docs/NAME.md" (malloc'd). */
static int list_docs(const readme_run *r, char **names, int cap)
{
    char path[PATH_MAX + 8];
    snprintf(path, sizeof path, "%s/docs", r->root);
    DIR *d = opendir(path);
    ck_assert_msg(d != NULL, "%s: cannot list", path);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) && n < cap;) {
        size_t len = strlen(e->d_name);
        if (len < 4 || strcmp(e->d_name + len - 3, ".md"))
            continue;
        names[n] = malloc(len + 6);
        ck_assert_ptr_nonnull(names[n]);
        snprintf(names[n], len + 6, "docs/%s", e->d_name);
        n++;
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, by_name);
    return n;
}

START_TEST(test_docs_blocks_run_as_written)
{
    readme_run r;
    memset(&r, 0, sizeof r);
    r.bin = getenv("KVDIFF_BIN");
    ck_assert_msg(r.bin && *r.bin, "KVDIFF_BIN is not set");
    ck_assert_msg(find_root(&r) == 0, "README.md not found");
    ck_assert_ptr_nonnull(test_tmpdir(r.tmp, sizeof r.tmp));
    r.out = calloc(OUT_MAX, 1);
    ck_assert_ptr_nonnull(r.out);
    prepare_install(&r);
    /* The folders are empty, as the docs say: nothing of the source tree
     * is linked in, so a block that needs it fails here too. */
    run_file(&r, "README.md", 0);
    /* the README has more than this: a parser that found nothing fails */
    ck_assert_msg(r.installs == 1 && r.blocks_run >= 8 && r.outputs_checked >= 3,
                  "README.md: %d install blocks, %d blocks run and %d outputs checked",
                  r.installs, r.blocks_run, r.outputs_checked);
    int readme_blocks = r.blocks_run;
    char *docs[MAX_DOCS];
    int n = list_docs(&r, docs, MAX_DOCS);
    for (int i = 0; i < n; i++) {
        run_file(&r, docs[i], i + 1);
        free(docs[i]);
    }
    run_file(&r, "recorders/llamacpp/README.md", n + 1);
    ck_assert_msg(r.blocks_run >= readme_blocks + 4, "the docs' blocks: only %d run",
                  r.blocks_run - readme_blocks);
    check_uninstall(&r);
    free(r.out);
    test_rmtree(r.tmp);
}
END_TEST

Suite *readme_suite(void)
{
    Suite *s = suite_create("readme");
    TCase *tc = tcase_create("blocks");
    tcase_set_timeout(tc, 900);
    tcase_add_test(tc, test_docs_blocks_run_as_written);
    suite_add_tcase(s, tc);
    return s;
}
