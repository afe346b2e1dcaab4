/* cmd_report.c — `kvdiff report`: compare two dumps (or read a saved
 * `kvdiff compare --json` result) and write an HTML / Markdown report with
 * gnuplot plots into a folder. Exit codes as compare: 0 same, 1 diverged,
 * 2 error; the report is written in both the 0 and 1 cases. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "verbs.h"
#include "../compare/compare.h"
#include "../model/outfile.h"
#include "../reports/report.h"

static void report_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff report REF.h5 TEST.h5 -o DIR [options]\n"
            "       kvdiff report RESULT.json -o DIR [options]\n"
            "\n"
            "Compares two dumps as `kvdiff compare` does (or reads the result it saved\n"
            "with --json) and writes DIR/index.html (verdict, first divergence, diagnosis,\n"
            "tokens, per-stage metrics, plots), DIR/summary.md (the same for a CI comment),\n"
            "DIR/result.json and DIR/plots/ (PNG and SVG, with each plot's .dat and .gp so\n"
            "`gnuplot NAME.gp` there redraws it). gnuplot is found on PATH; GNUPLOT names\n"
            "another. Exit 0 same, 1 diverged, 2 error.\n"
            "\n"
            "  -o, --out DIR      the report folder (created; its parent must exist);\n"
            "                     --output DIR is the same\n"
            "  --stage NAME       layer stage of every row plot (default: the heatmap shows\n"
            "                     the first divergence's stage, the others x_out)\n"
            "  --layers L,L,...   layers of the along-positions plot (at most 16; default:\n"
            "                     the divergence layer, the first and the last)\n"
            "  --note TEXT        a line shown under the verdict (kvdiff suite gives what\n"
            "                     the case expected)\n"
            "comparison (dumps only), as in kvdiff compare:\n"
            "  --exact, --atol X, --rtol X, --ulp N, --noise-floor F.h5, --force\n"
            "\n"
            "Examples:\n"
            "  kvdiff report ref.h5 chk.h5 -o out        # then open out/index.html\n"
            "  kvdiff compare ref.h5 chk.h5 --json > r.json; kvdiff report r.json -o out\n"
            "  kvdiff report ref.h5 chk.h5 -o out --stage k --layers 0,3,5\n");
}

typedef struct {
    cmp_opts co;
    report_opts ro;
    const char *noise, *outdir;
} report_args;

static int parse_layers(const char *s, report_opts *o, kv_err *e)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s", s);
    o->n_layers = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        long v;
        if (o->n_layers == 16)
            return kv_errf(e, "--layers: at most 16 layers");
        if (cli_int("--layers", t, 0, KV_MAX_LAYERS - 1, &v, e) < 0)
            return -1;
        o->layers[o->n_layers++] = (int)v;
    }
    if (o->n_layers == 0)
        return kv_errf(e, "--layers: '%s' names no layer", s);
    return 0;
}

static int parse_report(int argc, char **argv, report_args *a, kv_err *e)
{
    static const struct option longopts[] = {
        {"out", required_argument, 0, 'o'},   {"output", required_argument, 0, 'o'},
        {"stage", required_argument, 0, 0},
        {"layers", required_argument, 0, 0}, {"exact", no_argument, 0, 0},
        {"atol", required_argument, 0, 0}, {"rtol", required_argument, 0, 0},
        {"ulp", required_argument, 0, 0}, {"noise-floor", required_argument, 0, 0},
        {"force", no_argument, 0, 0}, {"note", required_argument, 0, 0},
        {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    int ch, idx;
    const char *exact_with = NULL;
    optind = 0;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, ":ho:", longopts, &idx)) != -1) {
        if (ch == 'h')
            return 1;
        if (ch == 'o') {
            a->outdir = optarg;
            continue;
        }
        if (ch != 0)
            return cli_getopt_error(ch, argv, e);
        const char *n = longopts[idx].name;
        int rc = 0;
        if (!strcmp(n, "stage")) {
            int st = stage_parse(optarg);
            if (st < 0 || st >= STAGE_LAYER_COUNT)
                return kv_errf(e, "--stage: '%s' is not a layer stage (x_in, q, k, v, attn_lse, "
                               "attn_out, h_mid, ffn_out, x_out, ...)", optarg);
            a->ro.stage = st;
        } else if (!strcmp(n, "layers")) rc = parse_layers(optarg, &a->ro, e);
        else if (!strcmp(n, "exact")) a->co.atol = a->co.rtol = 0, a->co.ulp = 0;
        else if (!strcmp(n, "atol")) rc = cli_double("--atol", optarg, 0, 1e30, &a->co.atol, e);
        else if (!strcmp(n, "rtol")) rc = cli_double("--rtol", optarg, 0, 1e30, &a->co.rtol, e);
        else if (!strcmp(n, "ulp")) rc = cli_u64("--ulp", optarg, &a->co.ulp, e);
        else if (!strcmp(n, "noise-floor")) a->noise = optarg;
        else if (!strcmp(n, "force")) a->co.force = true;
        else if (!strcmp(n, "note")) a->ro.note = optarg;
        if (rc == 0)
            rc = cli_tolerance_conflict(n, &exact_with, e);
        if (rc < 0)
            return -1;
    }
    const int np = argc - optind;
    if (np != 1 && np != 2)
        return kv_errf(e, "give two dumps or one compare result: kvdiff report REF.h5 TEST.h5 "
                       "-o DIR, or kvdiff report RESULT.json -o DIR");
    if (!a->outdir)
        return kv_errf(e, "give the report folder: -o DIR");
    return 0;
}

static int check_layers(const report_opts *o, const cmp_source *ref, kv_err *e)
{
    for (int i = 0; i < o->n_layers; i++)
        if (o->layers[i] >= ref->cfg.n_layers)
            return kv_errf(e, "--layers: the model has %d layers (0..%d), not layer %d",
                           ref->cfg.n_layers, ref->cfg.n_layers - 1, o->layers[i]);
    return 0;
}

/* Writes the report, tells the user where it is; returns the exit code. */
static int finish(const char *outdir, const cmp_result *r, const cmp_source *ref,
                  const cmp_source *test, const report_opts *o)
{
    kv_err e = {{0}};
    report_info info;
    if (report_write(outdir, r, ref, test, o, &info, &e) < 0) {
        cli_error("report", &e);
        return EXIT_USAGE;
    }
    if (info.gnuplot_missing)
        fprintf(stderr, "kvdiff report: " REPORT_NO_GNUPLOT "\n");
    else if (info.gnuplot_error[0])
        fprintf(stderr, "kvdiff report: %s\n", info.gnuplot_error);
    char verdict[1024];
    report_verdict_line(r, verdict, sizeof verdict);
    cli_fputs_escaped(verdict, stdout, false);   /* a saved JSON's text: anything */
    printf("\nreport: ");
    cli_fputs_escaped(info.index_path, stdout, false);
    putchar('\n');
    return cmp_exit_code(0, r);
}

static int from_dumps(report_args *a, const char *refp, const char *testp)
{
    kv_err e = {{0}};
    cmp_source ref, test, noise;
    cmp_dump_source *dr = cmp_dump_source_open(refp, &ref, &e);
    cmp_dump_source *dt = dr ? cmp_dump_source_open(testp, &test, &e) : NULL;
    cmp_dump_source *dn = NULL;
    if (dt && a->noise && (dn = cmp_dump_source_open(a->noise, &noise, &e)))
        a->co.noise = &noise;
    int rc = -1;
    cmp_result r;
    memset(&r, 0, sizeof r);
    if (dr && dt && (!a->noise || dn) && check_layers(&a->ro, &ref, &e) == 0)
        rc = cmp_compare(&ref, &test, &a->co, &r, &e);
    int code;
    if (rc < 0) {
        cli_error("report", &e);
        code = EXIT_USAGE;
    } else {
        a->ro.ref_path = refp;
        a->ro.test_path = testp;
        code = finish(a->outdir, &r, &ref, &test, &a->ro);
    }
    cmp_result_free(&r);
    cmp_dump_source_close(dn);
    cmp_dump_source_close(dt);
    cmp_dump_source_close(dr);
    return code;
}

/* A saved result without the per-stage table (compare --json without
 * --stages), whose dumps are at hand: the table is computed again from
 * them with the result's own tolerances, and kept only when that
 * comparison agrees with the saved one (verdict and first divergence), so
 * the page never mixes two different comparisons. True when r got it. */
static bool stages_from_dumps(cmp_result *r, const cmp_source *ref, const cmp_source *test)
{
    if (r->noise)   /* the noise-floor recording is not named in the JSON */
        return false;
    cmp_opts co;
    cmp_opts_default(&co);
    co.atol = r->exact ? 0 : r->atol;
    co.rtol = r->exact ? 0 : r->rtol;
    co.ulp = r->exact ? 0 : r->ulp;
    cmp_result fresh;
    kv_err e = {{0}};
    bool ok = cmp_compare(ref, test, &co, &fresh, &e) == 0 && fresh.verdict == r->verdict &&
              fresh.first.found == r->first.found &&
              (!r->first.found || (fresh.first.pos == r->first.pos &&
                                   fresh.first.layer == r->first.layer &&
                                   fresh.first.stage == r->first.stage));
    if (ok) {
        cmp_stage_result *st = r->stages;
        int n = r->n_stages;
        r->stages = fresh.stages;
        r->n_stages = fresh.n_stages;
        fresh.stages = st;   /* freed with fresh */
        fresh.n_stages = n;
    }
    cmp_result_free(&fresh);
    return ok;
}

/* A dump the JSON names: as written, else relative to the JSON's folder. */
static const char *locate(const char *p, const char *json, char *buf, size_t n)
{
    struct stat sb;
    if (!p)
        return NULL;
    if (stat(p, &sb) == 0 && S_ISREG(sb.st_mode))
        return p;
    const char *slash = strrchr(json, '/');
    if (p[0] == '/' || !slash)
        return NULL;
    snprintf(buf, n, "%.*s/%s", (int)(slash - json), json, p);
    return stat(buf, &sb) == 0 && S_ISREG(sb.st_mode) ? buf : NULL;
}

static int from_json(report_args *a, const char *path)
{
    kv_err e = {{0}};
    report_json j;
    if (report_json_load(path, &j, &e) < 0) {
        cli_error("report", &e);
        return EXIT_USAGE;
    }
    char rb[4200], tb[4200];
    const char *rp = locate(j.ref_path, path, rb, sizeof rb);
    const char *tp = locate(j.test_path, path, tb, sizeof tb);
    cmp_source ref, test;
    cmp_dump_source *dr = NULL, *dt = NULL;
    if (rp && tp) {
        dr = cmp_dump_source_open(rp, &ref, &e);
        dt = dr ? cmp_dump_source_open(tp, &test, &e) : NULL;
        if (!dt)
            fprintf(stderr, "kvdiff report: %s; plots from the JSON alone\n", e.msg);
        else if (ref.n_tokens != j.r.tokens.n_ref || test.n_tokens != j.r.tokens.n_test) {
            fprintf(stderr, "kvdiff report: %s, %s: not the dumps this result was made from "
                    "(token counts differ); plots from the JSON alone\n", rp, tp);
            cmp_dump_source_close(dt);
            dt = NULL;
        } else if (check_layers(&a->ro, &ref, &e) < 0) {
            cli_error("report", &e);
            cmp_dump_source_close(dt);
            cmp_dump_source_close(dr);
            report_json_free(&j);
            return EXIT_USAGE;
        }
    }
    a->ro.ref_path = j.ref_path;
    a->ro.test_path = j.test_path;
    a->ro.has_stages = j.has_stages || (dt && stages_from_dumps(&j.r, &ref, &test));
    int code = finish(a->outdir, &j.r, dt ? &ref : NULL, dt ? &test : NULL, &a->ro);
    cmp_dump_source_close(dt);
    cmp_dump_source_close(dr);
    report_json_free(&j);
    return code;
}

/* The report writes result.json, summary.md and index.html in its folder,
 * and anything in plots/: an input there would be replaced by the report
 * made from it. */
static int not_written_over(const char *outdir, const char *in, kv_err *e)
{
    static const char *const names[] = {"result.json", "summary.md", "index.html"};
    char path[4200];
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(path, sizeof path, "%s/%s", outdir, names[i]);
        if (outfile_same(path, in))
            return kv_errf(e, "-o %s: the report writes its %s over the input %s; refusing",
                           outdir, names[i], in);
    }
    snprintf(path, sizeof path, "%s/plots", outdir);
    char dir[4200];
    cli_parent_dir(in, strrchr(in, '/'), dir, sizeof dir);
    struct stat a, b;
    if (stat(path, &a) == 0 && stat(dir, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
        return kv_errf(e, "-o %s: the input %s is in %s, the folder the report writes its "
                       "plots into; refusing", outdir, in, path);
    return 0;
}

int cmd_report(int argc, char **argv)
{
    report_args a;
    memset(&a, 0, sizeof a);
    cmp_opts_default(&a.co);
    report_opts_default(&a.ro);
    kv_err e = {{0}};
    int pr = parse_report(argc, argv, &a, &e);
    if (pr == 1) {
        report_usage(stdout);
        return EXIT_OK;
    }
    if (pr < 0) {
        cli_usage_error("report", &e);
        return EXIT_USAGE;
    }
    char outdir[4096];
    a.outdir = cli_dir(outdir, sizeof outdir, a.outdir);
    for (int i = optind; i < argc; i++)
        if (not_written_over(a.outdir, argv[i], &e) < 0) {
            cli_error("report", &e);
            return EXIT_USAGE;
        }
    if (argc - optind == 1)
        return from_json(&a, argv[optind]);
    return from_dumps(&a, argv[optind], argv[optind + 1]);
}
