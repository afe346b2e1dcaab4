/* cmd_suite.c — `kvdiff suite FILE.suite`: the release gate. Runs every
 * case of a suite file (docs/suite-format.md), prints a table, writes JUnit
 * XML on request, keeps the files of failed cases. Exit 0 when every case
 * met its expectation, 1 when one did not, 2 on a bad suite file or usage,
 * 130 / 143 when SIGINT / SIGTERM stopped it (what finished is reported). */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "progress.h"
#include "verbs.h"
#include "../model/outfile.h"
#include "../suites/suite.h"

static void suite_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff suite FILE.suite [options]\n"
            "\n"
            "Runs every case of a suite file: engine A and engine B on the same model\n"
            "and prompt, recorded and compared, checked against the case's expectation\n"
            "(identical, within a tolerance, or an injected bug detected at an exact\n"
            "layer, position and stage). Prints a table; exit 0 when every case met its\n"
            "expectation, 1 when one did not, 2 on a bad suite file or usage. Ctrl-C or\n"
            "SIGTERM stops it: running cases are killed and marked skipped with those\n"
            "not started, the table and --junit cover what finished; exit 130 / 143.\n"
            "The format: docs/suite-format.md.\n"
            "\n"
            "  --jobs N        cases run at once, one process each (default 1)\n"
            "  --shard I/N     run the I-th of N shards (I from 1): cases I, I+N, I+2N, ...\n"
            "                  of those the filter selects, in file order\n"
            "  --filter RE     only cases whose name matches RE (POSIX extended)\n"
            "  --junit FILE    also write JUnit XML (checked before any case runs: a link,\n"
            "                  FIFO or device there, or a file the suite reads, is refused)\n"
            "  --keep DIR      work folder (created if missing); default a fresh\n"
            "                  $TMPDIR/kvdiff-suite.XXXXXX, removed when every case passes.\n"
            "                  Each case works in DIR/CASE/, marked by a .kvdiff-case file;\n"
            "                  a failed case keeps it (a.h5, b.h5, compare.json, log.txt,\n"
            "                  report/), a passing case's folder is deleted. A DIR/CASE\n"
            "                  that is there without the mark (not made by kvdiff suite),\n"
            "                  or that holds a file the suite reads, stops the suite before\n"
            "                  any case runs (exit 2) and is left alone\n"
            "  --timeout S     seconds one kvdiff process of a case may take before it is\n"
            "                  killed and the case counts as an error (default 600; 0: none)\n"
            "  --list          print the selected cases and exit\n"
            "  -q, --quiet     no progress bar and no table: the failures and the summary\n"
            "                  line only\n"
            "\n"
            "Examples:\n"
            "  kvdiff suite suites/release.suite --jobs 2 --junit junit.xml\n"
            "  kvdiff suite suites/release.suite --list --filter window\n"
            "  kvdiff suite suites/release.suite --shard 2/4 -q     # CI machine 2 of 4\n"
            "  kvdiff suite my.suite --keep work/     # failed cases' files stay in work/CASE/\n");
}

typedef struct {
    const char *file;
    int jobs;
    int timeout;
    int shard_i, shard_n;
    const char *filter;
    const char *junit;
    const char *keep;
    bool list;
    bool quiet;
} suite_args;

static int parse_suite_args(int argc, char **argv, suite_args *a, kv_err *e)
{
    static const struct option longopts[] = {
        {"jobs", required_argument, 0, 0},  {"timeout", required_argument, 0, 0},  {"shard", required_argument, 0, 0},
        {"filter", required_argument, 0, 0}, {"junit", required_argument, 0, 0},
        {"keep", required_argument, 0, 0},  {"list", no_argument, 0, 0},
        {"quiet", no_argument, 0, 'q'},     {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int ch, idx;
    long v;
    optind = 0;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, ":hq", longopts, &idx)) != -1) {
        if (ch == 'h')
            return 1;
        if (ch == 'q') {
            a->quiet = true;
            continue;
        }
        if (ch != 0)
            return cli_getopt_error(ch, argv, e);
        const char *n = longopts[idx].name;
        if (!strcmp(n, "jobs")) {
            if (cli_int("--jobs", optarg, 1, 64, &v, e) < 0)
                return -1;
            a->jobs = (int)v;
        } else if (!strcmp(n, "timeout")) {
            if (cli_int("--timeout", optarg, 0, 86400, &v, e) < 0)
                return -1;
            a->timeout = (int)v;
        } else if (!strcmp(n, "shard")) {
            if (suite_parse_shard(optarg, &a->shard_i, &a->shard_n, e) < 0)
                return -1;
        } else if (!strcmp(n, "filter")) a->filter = optarg;
        else if (!strcmp(n, "junit")) a->junit = optarg;
        else if (!strcmp(n, "keep")) a->keep = optarg;
        else if (!strcmp(n, "list")) a->list = true;
    }
    if (argc - optind != 1)
        return kv_errf(e, "give one suite file: kvdiff suite FILE.suite");
    a->file = argv[optind];
    return 0;
}

/* ------------------------------------------------------------------ */
/* Output                                                               */

typedef struct {
    progress bar;                /* stderr, on a terminal */
    bool stream;                 /* stdout is no terminal: a line per finished case */
} case_feed;

/* One finished case as a line, for logs that are read while the suite
 * runs (CI): "[3/12] FAIL  window-bug-g3  1.84s  layer 0 position 4 ...". */
static void print_case_line(int done, int total, const suite_case *c, const suite_result *r)
{
    char name[512], where[512];
    printf("[%d/%d] %-7s %s  %.2fs  %s\n", done, total, suite_outcome_name(r->outcome),
           cli_escape(name, sizeof name, c->name, false), r->seconds,
           cli_escape(where, sizeof where, r->where, false));
    fflush(stdout);
}

static void on_case_done(void *ctx, int done, int total, const suite_case *c,
                         const suite_result *r)
{
    case_feed *feed = ctx;
    if (feed->stream)
        print_case_line(done, total, c, r);
    progress_step(&feed->bar, done, c->name);
}

static int name_width(const suite *s, const int *sel, int n)
{
    int w = 4;
    char esc[512];
    for (int i = 0; i < n; i++) {
        int l = (int)strlen(cli_escape(esc, sizeof esc, s->cases[sel[i]].name, false));
        w = l > w ? l : w;
    }
    return w;
}

static void print_table(const suite *s, const int *sel, int n, const suite_result *res)
{
    int w = name_width(s, sel, n), xw = 11;
    char want[256];
    for (int i = 0; i < n; i++) {
        suite_expect_describe(&s->cases[sel[i]].expect, want, sizeof want);
        xw = (int)strlen(want) > xw ? (int)strlen(want) : xw;
    }
    printf("%-*s  %-*s  %-7s  %7s  %s\n", w, "case", xw, "expectation", "outcome", "time",
           "where");
    /* Names come from the suite file, "where" from a compare result:
     * escaped, so no row can fake another. */
    char name[512], where[512];
    for (int i = 0; i < n; i++) {
        suite_expect_describe(&s->cases[sel[i]].expect, want, sizeof want);
        printf("%-*s  %-*s  %-7s  %6.2fs  %s\n", w,
               cli_escape(name, sizeof name, s->cases[sel[i]].name, false), xw, want,
               suite_outcome_name(res[i].outcome), res[i].seconds,
               cli_escape(where, sizeof where, res[i].where, false));
    }
}

/* The failures, each with what was expected, what happened and where its
 * files are. Returns the number of cases that did not pass. */
static int print_failures(const suite *s, const int *sel, int n, const suite_result *res)
{
    int bad = 0;
    for (int i = 0; i < n; i++) {
        const suite_result *r = &res[i];
        if (r->outcome == SUITE_PASS || r->outcome == SUITE_SKIPPED)
            continue;
        if (!bad++)
            printf("\n");
        /* the message and last line quote a step's output: escaped */
        printf("%s ", suite_outcome_name(r->outcome));
        cli_fputs_escaped(s->cases[sel[i]].name, stdout, false);
        fputs(": ", stdout);
        cli_fputs_escaped(r->message, stdout, false);
        putchar('\n');
        if (r->last_line[0]) {
            fputs("    last line: ", stdout);
            cli_fputs_escaped(r->last_line, stdout, false);
            putchar('\n');
        }
        if (r->folder[0]) {
            fputs("    files kept in ", stdout);
            cli_fputs_escaped(r->folder, stdout, false);
            fputs("/\n", stdout);
        }
    }
    return bad;
}

/* ------------------------------------------------------------------ */
/* Work folder and binary                                               */

/* Fills dir with the work folder: --keep DIR (made if missing: *made) or
 * a fresh one under $TMPDIR. *fresh says which. */
static int work_folder(const char *keep, char *dir, size_t n, bool *fresh, bool *made,
                       kv_err *e)
{
    *fresh = keep == NULL;
    *made = false;
    if (keep) {
        if ((size_t)snprintf(dir, n, "%s", keep) >= n)
            return kv_errf(e, "--keep %s: path too long", keep);
        /* work/ and work name one folder; case folders are DIR/CASE */
        for (size_t len = strlen(dir); len > 1 && dir[len - 1] == '/';)
            dir[--len] = 0;
        if (outfile_user_dir(keep, made, e) < 0)
            return kv_err_prefix(e, "--keep");
        return 0;
    }
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp)
        tmp = "/tmp";
    if ((size_t)snprintf(dir, n, "%s/kvdiff-suite.XXXXXX", tmp) >= n)
        return kv_errf(e, "TMPDIR %s: path too long", tmp);
    if (!mkdtemp(dir))
        return kv_errf(e, "cannot create a work folder under %s: %s", tmp, strerror(errno));
    return 0;
}

/* Before any case runs, what would fail or do harm only once they ran:
 * the JUnit target (a link, FIFO, device or one of the run's inputs
 * there), a DIR/CASE of --keep DIR the suite did not make (a user's
 * folder, a model folder a case reads), and a JUnit file inside a case
 * folder (emptied when its case starts, removed when it passes). */
static int check_outputs(const suite_args *a, const suite *s, const int *sel, int n,
                         const char *dir, kv_err *e)
{
    char folder[PATH_MAX], real_case[PATH_MAX], jdir[PATH_MAX], real_j[PATH_MAX];
    bool junit_dir = false;
    if (a->junit) {
        cli_parent_dir(a->junit, strrchr(a->junit, '/'), jdir, sizeof jdir);
        junit_dir = realpath(jdir, real_j) != NULL;
    }
    for (int i = 0; a->keep && i < n; i++) {
        const char *name = s->cases[sel[i]].name;
        if ((size_t)snprintf(folder, sizeof folder, "%s/%s", dir, name) >= sizeof folder)
            return kv_errf(e, "--keep %s: path too long", dir);
        if (suite_case_folder_check(folder, e) < 0)
            return kv_err_prefix(e, "--keep");
        size_t len = realpath(folder, real_case) ? strlen(real_case) : 0;
        if (junit_dir && len && !strncmp(real_j, real_case, len) &&
            (real_j[len] == '/' || !real_j[len]))
            return kv_errf(e, "--junit %s: is inside case %s's folder %s, which the suite "
                           "empties when the case starts; write it elsewhere", a->junit, name,
                           folder);
    }
    return 0;
}

/* The kvdiff binary to execute for every step: this very program. */
static int self_path(char *out, size_t n, kv_err *e)
{
    ssize_t len = readlink("/proc/self/exe", out, n - 1);
    if (len > 0) {
        out[len] = 0;
        return 0;
    }
    const char *env = getenv("KVDIFF_BIN");
    if (env && *env && (size_t)snprintf(out, n, "%s", env) < n)
        return 0;
    return kv_errf(e, "cannot find the kvdiff binary (no /proc/self/exe; set KVDIFF_BIN)");
}

/* ------------------------------------------------------------------ */
/* Interruption                                                         */

/* SIGINT or SIGTERM: the run stops starting cases, kills the running ones
 * and reports what finished (suite_run_opts.stop). */
static volatile sig_atomic_t stop_signal;

static void on_stop(int sig)
{
    stop_signal = sig;
}

static void catch_stop(bool on)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_stop : SIG_DFL;   /* no SA_RESTART: poll returns */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);   /* a closed terminal: workers are in groups of their own */
}

static void print_summary(int n, const suite_result *res, int jobs)
{
    int pass = 0, fail = 0, err = 0, skip = 0;
    double total = 0;
    for (int i = 0; i < n; i++) {
        pass += res[i].outcome == SUITE_PASS;
        fail += res[i].outcome == SUITE_FAIL;
        err += res[i].outcome == SUITE_ERROR;
        skip += res[i].outcome == SUITE_SKIPPED;
        total += res[i].seconds;
    }
    printf("\n%d case%s: %d passed, %d failed", n, n == 1 ? "" : "s", pass, fail);
    if (err)
        printf(", %d error%s", err, err == 1 ? "" : "s");
    if (skip)
        printf(", %d skipped (interrupted by %s)", skip,
               stop_signal == SIGTERM ? "SIGTERM" : stop_signal == SIGHUP ? "SIGHUP" : "SIGINT");
    printf(" (%.1f s of case time, %d job%s)\n", total, jobs, jobs == 1 ? "" : "s");
}

static int run_selected(const suite_args *a, const suite *s, const int *sel, int n, kv_err *e)
{
    char dir[PATH_MAX], bin[PATH_MAX];
    bool fresh, made;
    if (self_path(bin, sizeof bin, e) < 0)
        return -1;
    /* every file the cases read is an input no output may replace; the
     * JUnit target is checked now, not after minutes of cases */
    suite_note_inputs(s, sel, n, bin);
    if (a->junit && outfile_check_target(a->junit, e) < 0)
        return kv_err_prefix(e, "--junit");
    if (work_folder(a->keep, dir, sizeof dir, &fresh, &made, e) < 0)
        return -1;
    if (check_outputs(a, s, sel, n, dir, e) < 0) {
        if (made)
            rmdir(dir);   /* made a moment ago, empty */
        return -1;
    }
    suite_result *res = calloc((size_t)n + 1, sizeof *res);
    if (!res)
        return kv_errf(e, "out of memory");
    /* On a terminal the bar shows progress and the table comes at the end;
     * piped (CI), nothing would show for minutes: each case's line is
     * printed as it finishes, and the table still closes the run. -q: no
     * bar, no lines, no table. */
    case_feed feed = {.stream = !a->quiet && !isatty(fileno(stdout))};
    progress_start(&feed.bar, a->quiet ? NULL : stderr, "cases", n);
    suite_run_opts ro = {.kvdiff = bin, .workdir = dir, .jobs = a->jobs, .step_timeout = a->timeout,
                         .report = suite_has_verb(bin, "report"), .on_done = on_case_done,
                         .ctx = &feed, .stop = &stop_signal};
    catch_stop(true);
    int rc = suite_run(s, sel, n, &ro, res, e);
    catch_stop(false);
    progress_end(&feed.bar);
    if (rc < 0) {
        free(res);
        return -1;
    }
    if (feed.stream)
        putchar('\n');
    if (!a->quiet)
        print_table(s, sel, n, res);
    int bad = print_failures(s, sel, n, res);
    print_summary(n, res, a->jobs);
    if (bad)
        printf("work folder: %s\n", dir);
    else if (fresh)
        rmdir(dir);   /* every case removed its own folder (or was never run) */
    kv_err je = {{0}};
    if (a->junit && suite_write_junit(a->junit, s, sel, n, res, &je) < 0) {
        free(res);
        *e = je;
        return -1;
    }
    free(res);
    if (stop_signal)
        return 128 + stop_signal;
    return bad ? 1 : 0;
}

/* The JUnit file is none of the files a case reads: a prompt file, a
 * dump: side, a GGUF, a model folder's files. Written after every case
 * ran, it would replace the input it was judged on. */
static int junit_not_input(const char *junit, const suite *s, const int *sel, int n, kv_err *e)
{
    char what[512];
    for (int i = 0; i < n; i++) {
        const suite_case *c = &s->cases[sel[i]];
        const suite_prompt *p = &c->prompt;
        snprintf(what, sizeof what, "case %s's prompt", c->name);
        if ((p->kind == SUITE_PROMPT_FILE || p->kind == SUITE_PROMPT_TEXT_FILE) &&
            cli_output_not_input("--junit", junit, what, p->text, e) < 0)
            return -1;
        snprintf(what, sizeof what, "case %s's GGUF", c->name);
        if (cli_output_not_input("--junit", junit, what, c->gguf, e) < 0)
            return -1;
        for (int side = 0; side < 2; side++) {
            snprintf(what, sizeof what, "case %s's dump: side", c->name);
            const char *const *argv = (const char *const *)(side ? c->b : c->a);
            if ((side ? c->kb : c->ka) == SUITE_SIDE_DUMP && argv &&
                cli_output_not_input("--junit", junit, what, argv[0], e) < 0)
                return -1;
        }
        if (cli_output_not_model_file("--junit", junit, c->model, e) < 0)
            return -1;
    }
    return 0;
}

int cmd_suite(int argc, char **argv)
{
    suite_args a = {.jobs = 1, .timeout = 600, .shard_i = 1, .shard_n = 1};
    kv_err e = {{0}};
    int pr = parse_suite_args(argc, argv, &a, &e);
    if (pr == 1) {
        suite_usage(stdout);
        return EXIT_OK;
    }
    if (pr < 0) {
        cli_usage_error("suite", &e);
        return EXIT_USAGE;
    }
    /* The JUnit file is written after every case ran: a folder that does
     * not exist, or the suite file itself, must fail now, not then. */
    if (a.junit && !a.list &&
        (cli_output_writable("--junit", a.junit, &e) < 0 ||
         cli_output_not_input("--junit", a.junit, "the suite file", a.file, &e) < 0)) {
        cli_error("suite", &e);
        return EXIT_USAGE;
    }
    suite s;
    if (suite_load(a.file, &s, &e) < 0) {
        cli_error("suite", &e);
        return EXIT_USAGE;
    }
    int *sel = NULL, n = 0, code = EXIT_OK;
    if (suite_select(&s, a.filter, a.shard_i, a.shard_n, &sel, &n, &e) < 0) {
        code = EXIT_USAGE;
    } else if (a.junit && !a.list && junit_not_input(a.junit, &s, sel, n, &e) < 0) {
        code = EXIT_USAGE;
    } else if (n == 0 && a.filter && a.shard_n == 1) {
        kv_errf(&e, "--filter '%s' matches no case of %s", a.filter, a.file);
        code = EXIT_USAGE;
    } else if (a.list) {
        char want[256];
        int w = name_width(&s, sel, n);
        char name[512];
        for (int i = 0; i < n; i++) {
            suite_expect_describe(&s.cases[sel[i]].expect, want, sizeof want);
            printf("%-*s  %s\n", w, cli_escape(name, sizeof name, s.cases[sel[i]].name, false),
                   want);
        }
    } else {
        int rc = run_selected(&a, &s, sel, n, &e);
        code = rc < 0 ? EXIT_USAGE : rc > 1 ? rc : rc ? EXIT_DIVERGED : EXIT_OK;
    }
    if (code == EXIT_USAGE)
        cli_error("suite", &e);
    free(sel);
    suite_free(&s);
    return code;
}
