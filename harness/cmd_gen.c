/* cmd_gen.c — `kvdiff gen`: write a synthetic preset as a Hugging Face
 * folder (config.json + model.safetensors). */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "verbs.h"

static void gen_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff gen --preset NAME [--seed N] [--dtype f32|bf16] -o DIR\n"
            "\n"
            "Writes a synthetic model (weights drawn from PCG32) as a Hugging Face\n"
            "folder: config.json and model.safetensors with the tensor names and\n"
            "shapes transformers uses. `kvdiff run --model NAME --weights-seed N`\n"
            "runs the same weights without writing them.\n"
            "\n"
            "  --preset NAME   one of:");
    for (const char *const *p = config_preset_names(); *p; p++)
        fprintf(f, " %s", *p);
    fprintf(f, "\n"
               "  --seed N        weight seed (default 0)\n"
               "  --dtype T       f32 (default) or bf16 tensors\n"
               "  -o, --out DIR   output folder (created if missing)\n");
}

int cmd_gen(int argc, char **argv)
{
    static const struct option longopts[] = {
        {"preset", required_argument, 0, 'p'}, {"seed", required_argument, 0, 's'},
        {"dtype", required_argument, 0, 'd'},  {"out", required_argument, 0, 'o'},
        {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
    const char *preset = NULL, *out = NULL;
    uint64_t seed = 0;
    int bf16 = 0, ch;
    kv_err e = {{0}};
    optind = 0;
    while ((ch = getopt_long(argc, argv, "o:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'p': preset = optarg; break;
        case 'o': out = optarg; break;
        case 's':
            if (cli_u64("--seed", optarg, &seed, &e) < 0)
                goto usage_error;
            break;
        case 'd':
            if (strcmp(optarg, "f32") && strcmp(optarg, "bf16")) {
                kv_errf(&e, "--dtype: '%s' is not f32 or bf16", optarg);
                goto usage_error;
            }
            bf16 = !strcmp(optarg, "bf16");
            break;
        case 'h': gen_usage(stdout); return EXIT_OK;
        default: gen_usage(stderr); return EXIT_USAGE;
        }
    }
    if (optind < argc) {
        kv_errf(&e, "unexpected argument '%s'", argv[optind]);
        goto usage_error;
    }
    if (!preset || !out) {
        kv_errf(&e, "--preset and -o are required (see kvdiff gen --help)");
        goto usage_error;
    }
    if (model_gen_folder(preset, seed, bf16, out, &e) < 0)
        goto usage_error;
    printf("wrote %s/config.json and %s/model.safetensors (preset %s, seed %llu, %s)\n", out,
           out, preset, (unsigned long long)seed, bf16 ? "bf16" : "f32");
    return EXIT_OK;
usage_error:
    cli_error("gen", &e);
    return EXIT_USAGE;
}
