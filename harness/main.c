/* main.c — the kvdiff command line: dispatches to one verb per file. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
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
    fprintf(f, "usage: kvdiff VERB [options]   (kvdiff VERB --help for each)\n\n");
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++)
        fprintf(f, "  %-8s %s\n", verbs[i].name, verbs[i].what);
    fprintf(f, "\nWith no verb, kvdiff runs its built-in default: the reference engine on\n"
               "the tiny-gemma3 preset with a random prompt longer than its window.\n"
               "Exit codes: 0 ok, 1 divergence found, 2 usage or input error.\n");
}

/* The built-in default job: no arguments, no downloads. */
static int default_job(void)
{
    char *args[] = {"run", "--model", "tiny-gemma3", "--prompt-random", "40", "--seed", "1",
                    "--max-new", "16", "--verbose", NULL};
    printf("kvdiff %s: reference engine on the built-in tiny-gemma3 preset\n", KVDIFF_VERSION);
    return cmd_run(10, args);
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return default_job();
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return EXIT_OK;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("kvdiff %s\n", KVDIFF_VERSION);
        return EXIT_OK;
    }
    for (size_t i = 0; i < sizeof verbs / sizeof *verbs; i++)
        if (!strcmp(argv[1], verbs[i].name))
            return verbs[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "kvdiff: unknown verb '%s'\n", argv[1]);
    usage(stderr);
    return EXIT_USAGE;
}
