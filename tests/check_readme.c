/* check_readme.c — the README's commands, run as a reader pastes them.
 *
 * Every ```sh block of README.md runs, in order, in one fresh, empty
 * folder with ./kvdiff standing for the built binary, under `set -e` and a
 * time limit. A block may start with
 *   # readme-test: skip (why)   not run (root, network, minutes of work)
 *   # readme-test: exit N       its last command exits N (default 0)
 * A ```text block right after the line
 *   <!-- readme-test: output of the block above -->
 * is output the README quotes: each of its lines must appear in what the
 * block before it printed (a line ending in " ..." up to there). */
#include <check.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#define MAX_BLOCK 8192
#define OUT_MAX (1 << 20)

typedef struct {
    char dir[64];
    const char *bin;
    char root[PATH_MAX];        /* the source tree: README.md */
    char *out;                  /* what the last block run printed */
    int blocks_run, outputs_checked;
} readme_run;

/* The source tree: the working folder of `make test`, else the one above
 * the binary's build/ folder. */
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

/* Appends src to dst (cap bytes) with every "./kvdiff-llama" as the
 * recorder (KVDIFF_LLAMA_BIN, else the one beside the README) and every
 * other "./kvdiff" as the binary. */
static void substitute(char *dst, size_t cap, const char *src, const char *bin)
{
    size_t used = strlen(dst);
    const char *rec = getenv("KVDIFF_LLAMA_BIN");
    for (const char *p = src; *p && used + 1 < cap;) {
        if (!strncmp(p, "./kvdiff-llama", 14) && rec && *rec) {
            int w = snprintf(dst + used, cap - used, "%s", rec);
            used += w > 0 ? (size_t)w : 0;
            p += 14;
        } else if (!strncmp(p, "./kvdiff", 8)) {
            int w = snprintf(dst + used, cap - used, "%s", bin);
            used += w > 0 ? (size_t)w : 0;
            p += 8;
        } else {
            dst[used++] = *p++;
        }
    }
    dst[used < cap ? used : cap - 1] = 0;
}

/* Runs one block; checks its exit code. Its output stays in r->out. */
static void run_block(readme_run *r, const char *block, int line)
{
    int want = 0;
    if (!strncmp(block, "# readme-test: skip", 19))
        return;
    if (!strncmp(block, "# readme-test: exit ", 20))
        want = atoi(block + 20);
    char path[128], cmd[512];
    snprintf(path, sizeof path, "%s/block.sh", r->dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    static char script[MAX_BLOCK * 2];
    snprintf(script, sizeof script, "set -e\n");
    substitute(script, sizeof script, block, r->bin);
    fputs(script, f);
    fclose(f);
    /* a reader's command that hangs must fail the test, not stall it */
    snprintf(cmd, sizeof cmd, "cd %s && timeout 300 sh block.sh > out.txt 2>&1", r->dir);
    int st = system(cmd);
    int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    snprintf(path, sizeof path, "%s/out.txt", r->dir);
    f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(r->out, 1, OUT_MAX - 1, f);
    r->out[n] = 0;
    fclose(f);
    ck_assert_msg(rc == want, "README.md block at line %d exited %d, the README says %d:\n%s\n"
                  "output:\n%s", line, rc, want, block, r->out);
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
        ck_assert_msg(strstr(r->out, l) != NULL, "README.md line %d quotes output the "
                      "command above it does not print:\n  %s\noutput was:\n%s", line, l,
                      r->out);
    }
    r->outputs_checked++;
}

START_TEST(test_readme_blocks_run_as_written)
{
    readme_run r;
    memset(&r, 0, sizeof r);
    r.bin = getenv("KVDIFF_BIN");
    ck_assert_msg(r.bin && *r.bin, "KVDIFF_BIN is not set");
    ck_assert_msg(find_root(&r) == 0, "README.md not found");
    ck_assert_ptr_nonnull(test_tmpdir(r.dir, sizeof r.dir));
    r.out = calloc(OUT_MAX, 1);
    ck_assert_ptr_nonnull(r.out);
    /* The folder is empty, as the README says: nothing of the source
     * tree is linked in, so a block that needs it fails here too. */
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/README.md", r.root);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
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
                ck_assert_msg(!marker || mode == QUOTED, "README.md line %d: the output "
                              "marker is not followed by a ```text block", lineno);
                marker = false;
                block[0] = 0;
                start = lineno;
            } else if (strstr(line, "<!-- readme-test: output of the block above -->")) {
                marker = true;
            } else if (marker && line[0] != '\n') {
                ck_abort_msg("README.md line %d: text between the output marker and its "
                             "block", lineno);
            }
            continue;
        }
        if (!fence) {
            ck_assert_msg(strlen(block) + strlen(line) < sizeof block,
                          "README.md block at line %d is too long for this test", start);
            strcat(block, line);
            continue;
        }
        if (mode == SH)
            run_block(&r, block, start);
        else if (mode == QUOTED)
            check_output(&r, block, start);
        mode = PROSE;
    }
    fclose(f);
    ck_assert_msg(mode == PROSE, "README.md: a ``` block is not closed");
    /* the README has more than this: a parser that found nothing fails */
    ck_assert_msg(r.blocks_run >= 8 && r.outputs_checked >= 2,
                  "only %d blocks run and %d outputs checked", r.blocks_run,
                  r.outputs_checked);
    free(r.out);
    test_rmtree(r.dir);
}
END_TEST

Suite *readme_suite(void)
{
    Suite *s = suite_create("readme");
    TCase *tc = tcase_create("blocks");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_readme_blocks_run_as_written);
    suite_add_tcase(s, tc);
    return s;
}
