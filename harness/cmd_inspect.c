/* cmd_inspect.c — `kvdiff inspect` (what a dump holds) and
 * `kvdiff validate` (does a dump conform to schema v1). */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "verbs.h"
#include "../dump/dump.h"

static int wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
    return 0;
}

/* The verb takes exactly one file and no option: 0, or -1 with e saying
 * what is wrong (one line; the usage is --help's). */
static int one_file(int argc, char **argv, kv_err *e)
{
    for (int i = 1; i < argc; i++)
        if (argv[i][0] == '-' && argv[i][1])
            return kv_errf(e, "unknown option '%s'", argv[i]);
    if (argc != 2)
        return kv_errf(e, "give one dump: kvdiff %s FILE.h5 (%d given)", argv[0], argc - 1);
    return 0;
}

/* One line per layer: its attention and each stage's position range. */
static void print_layer(const dump_file *f, int layer)
{
    char line[4096];
    size_t len = 0;
    int64_t lo = -1, hi = -1;
    bool uniform = true;
    for (int st = 0; st < STAGE_LAYER_COUNT; st++) {
        dump_dataset_info di = dump_stage_info(f, layer, (kv_stage)st);
        if (!di.present)
            continue;
        int64_t a = di.first_position, b = di.first_position + di.rows - 1;
        if (lo < 0) {
            lo = a;
            hi = b;
        } else if (a != lo || b != hi) {
            uniform = false;
        }
        int w = snprintf(line + len, sizeof line - len, " %s[%lld..%lld]", stage_name(st),
                         (long long)a, (long long)b);
        if (w > 0 && (size_t)w < sizeof line - len)
            len += (size_t)w;
    }
    if (lo < 0)
        return;
    if (uniform) {
        len = 0;
        for (int st = 0; st < STAGE_LAYER_COUNT; st++)
            if (dump_stage_info(f, layer, (kv_stage)st).present) {
                int w = snprintf(line + len, sizeof line - len, " %s", stage_name(st));
                if (w > 0 && (size_t)w < sizeof line - len)
                    len += (size_t)w;
            }
        printf("layer %-3d positions %lld..%lld:%s\n", layer, (long long)lo, (long long)hi, line);
    } else {
        printf("layer %-3d%s\n", layer, line);
    }
}

/* Prints label, value escaped (cli_escape), tail and a newline. */
static void show(const char *label, const char *value, const char *tail)
{
    fputs(label, stdout);
    cli_fputs_escaped(value, stdout, false);
    fputs(tail, stdout);
    putchar('\n');
}

int cmd_inspect(int argc, char **argv)
{
    kv_err e = {{0}};
    if (wants_help(argc, argv)) {
        printf("usage: kvdiff inspect FILE.h5\n\n"
               "Prints what a dump holds: engine and settings, model, status, tokens,\n"
               "and per layer the recorded stages and positions.\n"
               "\n"
               "Examples:\n"
               "  kvdiff inspect ref.h5\n"
               "  kvdiff inspect bisect/ref.fp.h5     # a fingerprint dump\n");
        return EXIT_OK;
    }
    if (one_file(argc, argv, &e) < 0) {
        cli_usage_error("inspect", &e);
        return EXIT_USAGE;
    }
    dump_file *f = dump_open(argv[1], &e);
    if (!f) {
        cli_error("inspect", &e);
        return EXIT_USAGE;
    }
    /* Attributes are the writer's text, whoever the writer was: escaped. */
    const char *st = dump_attr(f, "status");
    show("file      ", argv[1], "");
    show("status    ", st ? st : "(missing)", "");
    printf("mode      %s\n", dump_is_fingerprint(f)    ? "fingerprint"
                            : dump_has_row_hashes(f) ? "full, with row hashes"
                                                     : "full");
    if (dump_index_problem(f))
        show("index     not used: ", dump_index_problem(f), "");
    else if (dump_index_rows(f) > 0)
        printf("index     row hash index of %lld stages\n", (long long)dump_index_rows(f));
    fputs("engine    ", stdout);
    cli_fputs_escaped(dump_attr(f, "engine") ? dump_attr(f, "engine") : "?", stdout, false);
    show(" ", dump_attr(f, "engine_settings") ? dump_attr(f, "engine_settings") : "", "");
    kv_config c;
    if (dump_model_config(f, &c, &e) == 0) {
        char desc[512];
        config_describe(&c, desc, sizeof desc);
        show("model     ", desc, "");
    } else {
        show("model     (unreadable: ", e.msg, ")");
    }
    show("weights   ", dump_attr(f, "weight_fingerprint") ? dump_attr(f, "weight_fingerprint") : "?", "");
    show("writer    ", dump_attr(f, "tool_version") ? dump_attr(f, "tool_version") : "?", "");
    printf("tokens    %lld (prompt %lld)\n", (long long)dump_n_tokens(f),
           (long long)dump_prompt_length(f));
    int L = dump_n_layers(f);
    for (int l = 0; l < L; l++)
        print_layer(f, l);
    const kv_stage model_stages[] = {STAGE_EMBED, STAGE_FINAL_NORM, STAGE_LOGITS};
    for (size_t i = 0; i < sizeof model_stages / sizeof *model_stages; i++) {
        dump_dataset_info di = dump_stage_info(f, -1, model_stages[i]);
        if (di.present)
            printf("model     %s positions %lld..%lld\n", stage_name(model_stages[i]),
                   (long long)di.first_position, (long long)(di.first_position + di.rows - 1));
    }
    dump_dataset_info oi = dump_output_info(f);
    if (oi.present)
        printf("output    lse and top-%d logits, positions %lld..%lld\n", dump_output_k(f),
               (long long)oi.first_position, (long long)(oi.first_position + oi.rows - 1));
    dump_file_close(f);
    return EXIT_OK;
}

static void print_violation(void *ctx, const char *line)
{
    const char *path = ctx;
    cli_fputs_escaped(path, stdout, false);
    fputs(": ", stdout);
    cli_fputs_escaped(line, stdout, false);
    putchar('\n');
}

int cmd_validate(int argc, char **argv)
{
    kv_err e = {{0}};
    if (wants_help(argc, argv)) {
        printf("usage: kvdiff validate FILE.h5\n\n"
               "Checks a dump (ours or another program's) against the schema in\n"
               "docs/dump-format.md and names every violation, one per line.\n"
               "Exit 0 when it conforms, 2 when it does not or cannot be read.\n"
               "\n"
               "Examples:\n"
               "  kvdiff validate theirs.h5      # a dump written by another program\n"
               "  kvdiff validate ref.h5 && kvdiff compare ref.h5 theirs.h5\n");
        return EXIT_OK;
    }
    if (one_file(argc, argv, &e) < 0) {
        cli_usage_error("validate", &e);
        return EXIT_USAGE;
    }
    /* A dump still growing breaks the schema's row counts by a few rows;
     * said as what it is, not as violations. */
    if (dump_check_not_written(argv[1], &e) < 0) {
        cli_error("validate", &e);
        return EXIT_USAGE;
    }
    int n = dump_validate(argv[1], print_violation, argv[1], &e);
    if (n < 0) {
        cli_error("validate", &e);
        return EXIT_USAGE;
    }
    if (n > 0) {
        fputs("kvdiff validate: ", stderr);
        cli_fputs_escaped(argv[1], stderr, false);   /* a file name: anything */
        fprintf(stderr, ": %d violation%s of the dump schema v%d\n", n, n == 1 ? "" : "s",
                DUMP_VERSION);
        return EXIT_USAGE;
    }
    cli_fputs_escaped(argv[1], stdout, false);
    printf(": conforms to the kvdiff dump schema v%d\n", DUMP_VERSION);
    return EXIT_OK;
}
