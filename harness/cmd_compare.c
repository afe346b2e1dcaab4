/* cmd_compare.c — `kvdiff compare REF.h5 TEST.h5`: the first divergence,
 * its diagnosis, and whether the generated tokens are byte-identical.
 * Exit codes as h5diff: 0 same (within tolerance), 1 diverged, 2 error. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "progress.h"
#include "verbs.h"
#include "../compare/compare.h"
#include "../reports/report.h"

static void compare_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff compare REF.h5 TEST.h5 [options]\n"
            "\n"
            "Aligns two dumps (ours or another program's, schema v1), finds the first\n"
            "divergence in dataflow order (positions, then layers, then stages, down to\n"
            "the element), says what kind of bug it looks like, and checks the\n"
            "generated tokens. Exit 0 same, 1 diverged, 2 error.\n"
            "\n"
            "  --exact            any differing bit is a divergence (default, unless the\n"
            "                     dumps come from different engines; not with --atol,\n"
            "                     --rtol or --ulp)\n"
            "  --cross-runtime    judge by the drift model of another runtime's rounding\n"
            "                     (default when the engines differ; docs/cross-runtime.md)\n"
            "  --atol X           absolute tolerance\n"
            "  --rtol X           tolerance relative to the row's largest |ref|\n"
            "  --ulp N            tolerance in units in the last place\n"
            "  --noise-floor F    a third dump (e.g. a cascade run with another chunk):\n"
            "                     per layer and stage a relative tolerance of 4 times\n"
            "                     the drift F shows against REF (docs/diagnosis.md)\n"
            "  --force            compare despite a model or prompt mismatch\n"
            "  --no-hashes        read every row, even where both dumps' row hashes agree\n"
            "  --stages           add the per-layer, per-stage metrics table\n"
            "  --json             print the result as JSON (\"schema\": \"" CMP_JSON_SCHEMA "\");\n"
            "                     an error too, as {\"error\": ..., \"exit_code\": 2}\n"
            "  -q, --quiet        no progress bar; print only the verdict line\n"
            "\n"
            "Examples:\n"
            "  kvdiff compare ref.h5 chk.h5\n"
            "  kvdiff compare ref.h5 chk.h5 --json > result.json   # kvdiff report result.json -o out\n"
            "  kvdiff compare ref.h5 cascade.h5 --rtol 1e-5\n"
            "  kvdiff compare ref.h5 cascade.h5 --noise-floor cascade-chunk7.h5\n"
            "  kvdiff compare -q ref.h5 chk.h5 || echo diverged\n");
}

typedef struct {
    cmp_opts co;
    const char *noise;
    bool json;
    bool quiet;
    unsigned flags;
} compare_args;

static int parse_compare(int argc, char **argv, compare_args *a, kv_err *e)
{
    static const struct option longopts[] = {
        {"exact", no_argument, 0, 0},  {"atol", required_argument, 0, 0},
        {"rtol", required_argument, 0, 0}, {"ulp", required_argument, 0, 0},
        {"noise-floor", required_argument, 0, 0}, {"force", no_argument, 0, 0},
        {"stages", no_argument, 0, 0}, {"json", no_argument, 0, 0},
        {"no-hashes", no_argument, 0, 0}, {"quiet", no_argument, 0, 'q'},
        {"cross-runtime", no_argument, 0, 0},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int ch, idx;
    const char *exact_with = NULL;
    optind = 0;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, ":hq", longopts, &idx)) != -1) {
        if (ch == 'h')
            return 1;
        if (ch == 'q') {
            a->quiet = true;
            continue;
        }
        if (ch != 0) {
            /* --json may come after the mistake: the error is JSON then too */
            for (int i = optind; i < argc; i++)
                a->json = a->json || !strcmp(argv[i], "--json");
            return cli_getopt_error(ch, argv, e);
        }
        const char *n = longopts[idx].name;
        int rc = 0;
        if (!strcmp(n, "exact")) a->co.atol = a->co.rtol = 0, a->co.ulp = 0,
                                 a->co.cross_runtime = CMP_XRT_OFF;
        else if (!strcmp(n, "cross-runtime") && exact_with)
            rc = kv_errf(e, "--cross-runtime and --%s: the drift model sets its own "
                         "thresholds; give one or the other", exact_with);
        else if (!strcmp(n, "cross-runtime")) a->co.cross_runtime = CMP_XRT_ON;
        else if (!strcmp(n, "atol")) rc = cli_double("--atol", optarg, 0, 1e30, &a->co.atol, e);
        else if (!strcmp(n, "rtol")) rc = cli_double("--rtol", optarg, 0, 1e30, &a->co.rtol, e);
        else if (!strcmp(n, "ulp")) rc = cli_u64("--ulp", optarg, &a->co.ulp, e);
        else if (!strcmp(n, "noise-floor")) a->noise = optarg;
        else if (!strcmp(n, "force")) a->co.force = true;
        else if (!strcmp(n, "no-hashes")) a->co.no_hashes = true;
        else if (!strcmp(n, "stages")) a->flags |= CMP_RENDER_STAGES;
        else if (!strcmp(n, "json")) a->json = true;
        if (rc == 0)
            rc = cli_tolerance_conflict(n, &exact_with, e);
        if (rc < 0)
            return -1;
    }
    if (a->json && a->quiet)
        return kv_errf(e, "-q and --json: -q prints one line, --json the whole result; "
                          "give one or the other");
    if (exact_with && a->co.cross_runtime == CMP_XRT_ON)
        return kv_errf(e, "--cross-runtime and --%s: the drift model sets its own thresholds; "
                       "give one or the other", exact_with);
    if (argc - optind != 2)
        return kv_errf(e, "give two dumps: kvdiff compare REF.h5 TEST.h5");
    return 0;
}

/* The library's JSON plus the dumps it was made from, so `kvdiff report
 * RESULT.json` can reopen them for the plots. */
static char *render_json(const cmp_result *r, unsigned flags, const char *ref, const char *test)
{
    json_t *j = cmp_result_json(r, flags);
    if (!j)
        return NULL;
    json_object_set_new(j, "inputs", json_pack("{ss ss}", "ref", ref, "test", test));
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return s;
}

/* Positions walked, on a terminal. */
static void compare_progress(void *ctx, int64_t pos, int64_t last)
{
    progress *p = ctx;
    p->total = (long)(last + 1);
    progress_step(p, (long)(pos + 1), "compared");
}

int cmd_compare(int argc, char **argv)
{
    compare_args a;
    memset(&a, 0, sizeof a);
    cmp_opts_default(&a.co);
    kv_err e = {{0}};
    int pr = parse_compare(argc, argv, &a, &e);
    if (pr == 1) {
        compare_usage(stdout);
        return EXIT_OK;
    }
    if (pr < 0) {
        if (a.json)
            cli_json_error("compare", &e, EXIT_USAGE);
        cli_usage_error("compare", &e);
        return EXIT_USAGE;
    }
    cmp_source ref, test, noise;
    cmp_dump_source *dr = cmp_dump_source_open(argv[optind], &ref, &e);
    cmp_dump_source *dt = dr ? cmp_dump_source_open(argv[optind + 1], &test, &e) : NULL;
    cmp_dump_source *dn = NULL;
    if (dt && a.noise && (dn = cmp_dump_source_open(a.noise, &noise, &e)))
        a.co.noise = &noise;
    int rc = -1;
    cmp_result r;
    memset(&r, 0, sizeof r);
    progress bar;
    progress_start(&bar, a.quiet ? NULL : stderr, "positions", 0);
    a.co.progress = compare_progress;
    a.co.progress_ctx = &bar;
    if (dr && dt && (!a.noise || dn))
        rc = cmp_compare(&ref, &test, &a.co, &r, &e);
    progress_end(&bar);
    int code = cmp_exit_code(rc, &r);
    if (rc < 0) {
        if (a.json)
            cli_json_error("compare", &e, code);
        cli_error("compare", &e);
    } else if (a.quiet) {
        char verdict[1024];   /* the line kvdiff report opens with */
        report_verdict_line(&r, verdict, sizeof verdict);
        cli_fputs_escaped(verdict, stdout, false);
        putchar('\n');
    } else {
        char *text = a.json ? render_json(&r, a.flags, argv[optind], argv[optind + 1])
                            : cmp_render_text(&r, a.flags);
        /* JSON escapes by itself; the text quotes dump attributes and file
         * names, and keeps only its own line breaks. */
        if (text && a.json)
            fputs(text, stdout);
        else if (text)
            cli_fputs_escaped(text, stdout, true);
        if (text && text[0] && text[strlen(text) - 1] != '\n')
            putchar('\n');
        free(text);
    }
    cmp_result_free(&r);
    cmp_dump_source_close(dn);
    cmp_dump_source_close(dt);
    cmp_dump_source_close(dr);
    return code;
}
