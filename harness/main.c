/* main.c — the kvdiff command line: dispatches to one verb per file. */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <hdf5.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "../dump/dump.h"
#include "../model/outfile.h"
#include "verbs.h"

typedef struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *what;
} verb;

static const verb verbs[] = {
    {"gen", cmd_gen, "write a synthetic preset as a Hugging Face folder"},
    {"run", cmd_run, "generate with an engine and print the tokens (--dump records it)"},
    {"compare", cmd_compare, "find the first divergence between two dumps and diagnose it"},
    {"bisect", cmd_bisect, "fingerprint both engines, then fully record only where they part"},
    {"report", cmd_report, "compare (or read a saved result) and write an HTML report with plots"},
    {"inspect", cmd_inspect, "show what a dump holds"},
    {"validate", cmd_validate, "check a dump against the open schema"},
    {"suite", cmd_suite, "run a suite file of cases (the release gate), JUnit XML"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvdiff VERB [options]   (kvdiff help VERB, or kvdiff VERB --help)\n"
               "       kvdiff -V | --version\n\n");
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++)
        fprintf(f, "  %-8s %s\n", verbs[i].name, verbs[i].what);
    fprintf(f, "\nWith no verb, kvdiff runs its built-in demo into ./kvdiff-demo: the reference\n"
               "and the chunked engine (with an injected window bug) on tiny-gemma3, the\n"
               "comparison and the HTML report.\n"
               "Exit codes: 0 ok, 1 divergence found, 2 usage or input error.\n"
               "\n"
               "Examples:\n"
               "  kvdiff                                   # the demo, into ./kvdiff-demo\n"
               "  kvdiff run --model tiny-gemma3 --engine chunked --chunk 5 --dump chk.h5\n"
               "  kvdiff compare ref.h5 chk.h5\n"
               "  kvdiff help run\n");
}

/* Runs a verb with its stdout sent to /dev/null (the demo prints its own
 * summary of each step); stderr stays, so errors show. */
static int quiet(int (*fn)(int, char **), char **args)
{
    int argc = 0;
    while (args[argc])
        argc++;
    fflush(stdout);
    int saved = dup(STDOUT_FILENO), null = open("/dev/null", O_WRONLY);
    if (saved >= 0 && null >= 0)
        dup2(null, STDOUT_FILENO);
    int rc = fn(argc, args);
    fflush(stdout);
    if (saved >= 0) {
        dup2(saved, STDOUT_FILENO);
        close(saved);
    }
    if (null >= 0)
        close(null);
    return rc;
}

/* The built-in default job, no arguments, no downloads: the whole product
 * on the tiny-gemma3 preset. The reference and the chunked engine run the
 * same prompt, the chunked one with a sliding window hard-coded to 4 (the
 * config says 12); kvdiff compares the two recordings, says where they
 * part and why, and writes the report. */
static int default_job(void)
{
    const char *dir = "kvdiff-demo";
    printf("kvdiff %s demo: tiny-gemma3 (5 sliding layers, window 12, then 1 global),\n"
           "a 40-token prompt and 16 generated tokens, through the reference engine and\n"
           "through the chunked engine (chunks of 5, ring-buffer cache) with one injected\n"
           "bug: a sliding window hard-coded to 4.\n\n", KVDIFF_VERSION);
    /* kvdiff names this folder: a link planted at its name is refused,
     * never followed (outfile.h). */
    kv_err de = {0};
    if (outfile_tool_dir(dir, NULL, &de) < 0) {
        fprintf(stderr, "kvdiff: %s\n", de.msg);
        return EXIT_USAGE;
    }
    char *ref[] = {"run", "--model", "tiny-gemma3", "--prompt-random", "40", "--seed", "1",
                   "--max-new", "16", "--ignore-eos", "--dump", "kvdiff-demo/ref.h5", NULL};
    char *chk[] = {"run", "--model", "tiny-gemma3", "--prompt-random", "40", "--seed", "1",
                   "--max-new", "16", "--ignore-eos", "--engine", "chunked", "--chunk", "5",
                   "--cache", "ring", "--inject", "window=4", "--dump", "kvdiff-demo/chunked.h5",
                   NULL};
    char *rep[] = {"report", "kvdiff-demo/ref.h5", "kvdiff-demo/chunked.h5", "-o",
                   "kvdiff-demo/report", NULL};
    printf("1/3 reference run        -> %s/ref.h5\n", dir);
    if (quiet(cmd_run, ref) != EXIT_OK)
        return EXIT_USAGE;
    printf("2/3 chunked run (buggy)  -> %s/chunked.h5\n", dir);
    if (quiet(cmd_run, chk) != EXIT_OK)
        return EXIT_USAGE;
    printf("3/3 compare and report   -> %s/report/\n\n", dir);
    fflush(stdout);
    char *cmp[] = {"compare", "kvdiff-demo/ref.h5", "kvdiff-demo/chunked.h5", NULL};
    int rc = cmd_compare(3, cmp);
    printf("\n");
    int rr = cmd_report(5, rep);
    if (rr != EXIT_DIVERGED || rc != EXIT_DIVERGED) {
        fprintf(stderr, "kvdiff: the demo expected a divergence (exit %d, %d)\n", rc, rr);
        return EXIT_USAGE;
    }
    printf("\nThe bug was found where it was planted. Open %s/report/index.html;\n"
           "%s/report/summary.md is the same for a CI comment. kvdiff --help lists the verbs.\n",
           dir, dir);
    return EXIT_OK;
}

/* The verb running, for on_hdf5_hang's "kvdiff VERB: " prefix. */
static const char *hang_verb;

/* SIGALRM context: write(2) only. */
static int on_hdf5_hang(const char *path)
{
    static const char a[] = "kvdiff",
                      b[] = ": the HDF5 library does not return from reading this file's "
                            "metadata (a damaged file: libhdf5 loops on some corrupt "
                            "variable-length strings)\n";
    ssize_t w = write(STDERR_FILENO, a, sizeof a - 1);
    if (hang_verb) {
        w += write(STDERR_FILENO, " ", 1);
        w += write(STDERR_FILENO, hang_verb, strlen(hang_verb));
    }
    w += write(STDERR_FILENO, ": ", 2);
    w += write(STDERR_FILENO, path, strlen(path));
    w += write(STDERR_FILENO, b, sizeof b - 1);
    (void)w;
    return EXIT_USAGE;
}

/* What a verb printed must have reached its reader: a full disk or a
 * closed pipe behind standard output is an error (exit 2), not a success
 * whose JSON or verdict went nowhere. */
static int finish(int rc)
{
    errno = 0;
    if (fflush(stdout) == 0 && !ferror(stdout))
        return rc;
    fprintf(stderr, "kvdiff: cannot write to standard output: %s\n",
            errno ? strerror(errno) : "write error");
    return EXIT_USAGE;
}

static int dispatch(int argc, char **argv);

int main(int argc, char **argv)
{
    return finish(dispatch(argc, argv));
}

static int dispatch(int argc, char **argv)
{
    /* A file-size limit (ulimit -f) must be an error naming the file, not
     * SIGXFSZ killing the process mid-write: past the limit write() then
     * fails with EFBIG, which every writer reports. */
    signal(SIGXFSZ, SIG_IGN);
    /* Ctrl-C during a whole-file write (a GGUF, a report) leaves no
     * temporary file behind; verbs that record dumps handle it themselves. */
    outfile_clean_on_signal();
    /* One process, one run: no output may replace a file it read. */
    outfile_track_inputs(true);
    /* A file libhdf5 could not close (its last flush failed on a full disk
     * or at the size limit) is closed again by libhdf5's exit handler,
     * which crashes on it (H5F__close_cb, 1.10.8). kvdiff closes every file
     * it opens itself; the handler is not installed. */
    H5dont_atexit();
    /* A damaged dump must end in an error, not a hang (dump.h). */
    const char *g = getenv("KVDIFF_HDF5_GUARD_SECONDS");
    dump_hang_guard(g && atoi(g) > 0 ? (unsigned)atoi(g) : 15, on_hdf5_hang);
    if (argc < 2)
        return default_job();
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") ||
        (!strcmp(argv[1], "help") && argc == 2)) {
        usage(stdout);
        return EXIT_OK;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("kvdiff %s\n", KVDIFF_VERSION);
        return EXIT_OK;
    }
    /* `kvdiff help VERB` is `kvdiff VERB --help` */
    bool help = !strcmp(argv[1], "help");
    const char *name = help ? argv[2] : argv[1];
    if (help && argc > 3) {
        fprintf(stderr, "kvdiff help: give one verb: kvdiff help VERB; see kvdiff --help\n");
        return EXIT_USAGE;
    }
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++) {
        if (strcmp(name, verbs[i].name))
            continue;
        hang_verb = verbs[i].name;
        if (!help)
            return verbs[i].fn(argc - 1, argv + 1);
        char *args[] = {argv[2], "--help", NULL};
        return verbs[i].fn(2, args);
    }
    fprintf(stderr, "kvdiff%s: unknown verb '", help ? " help" : "");
    cli_fputs_escaped(name, stderr, false);
    fprintf(stderr, "'; see kvdiff --help\n");
    return EXIT_USAGE;
}
