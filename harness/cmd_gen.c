/* cmd_gen.c — `kvdiff gen`: write a synthetic preset as a Hugging Face
 * folder (config.json + model.safetensors) and/or as a GGUF file llama.cpp
 * runs; or export an existing Hugging Face folder as GGUF. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "progress.h"
#include "verbs.h"
#include "../model/gguf.h"

static void gen_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff gen --preset NAME [--weights-seed N] [--dtype T] [-o DIR] [--gguf FILE]\n"
            "                  [--threads N]\n"
            "       kvdiff gen --from DIR --gguf FILE [--dtype T]\n"
            "\n"
            "Writes a synthetic model (weights drawn from PCG32) as a Hugging Face\n"
            "folder: config.json and model.safetensors with the tensor names and\n"
            "shapes transformers uses. `kvdiff run --model NAME --weights-seed N`\n"
            "runs the same weights without writing them.\n"
            "\n"
            "--gguf FILE also (or instead) writes the weights as a GGUF file that\n"
            "llama.cpp runs as kvdiff's reference does: tensor names, Llama's q/k\n"
            "row order, Gemma's (1 + w) norms, the attention scale, sliding window,\n"
            "layer pattern and RoPE settings as llama.cpp's own converter writes\n"
            "them (docs/gguf-export.md). With --from DIR it exports that Hugging\n"
            "Face folder (llama, qwen2, qwen3, gemma3, gemma4) instead of a preset,\n"
            "with the tokens of its tokenizer.json. Models llama.cpp cannot run as\n"
            "kvdiff does (Gemma 3 with KV-shared layers: tiny-gemma3-kvshared; a\n"
            "Gemma 4 whose sharing llama.cpp would wire otherwise) are refused.\n"
            "\n"
            "  --preset NAME   one of:");
    for (const char *const *p = config_preset_names(); *p; p++)
        fprintf(f, " %s", *p);
    fprintf(f, "\n"
               "  --weights-seed N  weight seed (default 0), as `kvdiff run --weights-seed`;\n"
               "                  --seed N is its old name, still accepted with a note\n"
               "  --dtype T       f32 or bf16 tensors; f16 too for --gguf alone (GGUF keeps\n"
               "                  norms and biases f32, as llama.cpp's converter does).\n"
               "                  Default: f32 for --preset; for --from, the type of the\n"
               "                  folder's own matrices (a bf16 checkpoint stays bf16),\n"
               "                  f32 when they mix types (the one type holding all)\n"
               "  -o, --out DIR   output folder (created if missing)\n"
               "  --gguf FILE     output GGUF file (written whole or not at all)\n"
               "  --from DIR      Hugging Face folder to export (needs --gguf)\n"
               "  --threads N     threads drawing the folder's weights (default: all\n"
               "                  cores); the bytes are the same for any N\n"
               "\n"
               "Examples:\n"
               "  kvdiff gen --preset tiny-gemma3 --weights-seed 7 -o tiny-g3\n"
               "  kvdiff run --model tiny-g3 --prompt-random 40   # = --model tiny-gemma3 --weights-seed 7\n"
               "  kvdiff gen --preset tiny-llama --dtype bf16 -o tiny-llama-bf16\n"
               "  kvdiff gen --preset tiny-gemma3 --weights-seed 7 --gguf g3.gguf\n"
               "  kvdiff gen --from tiny-g3 --gguf g3-from-folder.gguf --dtype f16\n");
}

/* True when file is dir/config.json or dir/model.safetensors. */
static int is_folder_output(const char *file, const char *dir)
{
    static const char *const names[] = {"config.json", "model.safetensors"};
    struct stat a, b;
    char path[4096];
    if (stat(file, &a) != 0)
        return 0;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (stat(path, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
            return 1;
    }
    return 0;
}

/* A GGUF export (of a preset, or of the folder `from`), with a bar over
 * the weights written on a terminal: a big model takes seconds. */
static int export_with_bar(const char *preset, uint64_t seed, const char *from, gguf_out_type gt,
                           const char *gguf, kv_err *e)
{
    progress bar;
    char note[600] = "";
    progress_start(&bar, stderr, "weights", 0);
    progress_phase(&bar, "GGUF");
    gguf_progress p = {.fn = cli_model_progress, .ctx = &bar};
    int rc = from ? gguf_export_dir_progress(from, gt, gguf, &p, note, sizeof note, e)
                  : gguf_export_preset_progress(preset, seed, gt, gguf, &p, e);
    progress_end(&bar);
    if (rc == 0 && note[0])
        fprintf(stderr, "kvdiff gen: note: %s\n", note);
    return rc;
}

/* --from without --dtype: the checkpoint's own type. */
static int from_out_type(const char *from, gguf_out_type *gt, kv_err *e)
{
    char note[600];
    if (gguf_dir_out_type(from, gt, note, sizeof note, e) < 0)
        return -1;
    if (note[0])
        fprintf(stderr, "kvdiff gen: note: %s\n", note);
    return 0;
}

int cmd_gen(int argc, char **argv)
{
    enum { OPT_GGUF = 256, OPT_FROM, OPT_OLD_SEED, OPT_THREADS };
    static const struct option longopts[] = {
        {"preset", required_argument, 0, 'p'}, {"weights-seed", required_argument, 0, 's'},
        {"seed", required_argument, 0, OPT_OLD_SEED},
        {"dtype", required_argument, 0, 'd'},  {"out", required_argument, 0, 'o'},
        {"gguf", required_argument, 0, OPT_GGUF}, {"from", required_argument, 0, OPT_FROM},
        {"threads", required_argument, 0, OPT_THREADS},
        {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
    const char *preset = NULL, *out = NULL, *gguf = NULL, *from = NULL, *dtype = "f32";
    uint64_t seed = 0;
    gguf_out_type gt = GGUF_OUT_F32;
    int ch, seed_given = 0, dtype_given = 0;
    long online = sysconf(_SC_NPROCESSORS_ONLN), threads = online < 1 ? 1 : online > 64 ? 64 : online;
    kv_err e = {{0}};
    optind = 0;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, ":o:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 'p': preset = optarg; break;
        case 'o': out = optarg; break;
        case OPT_GGUF: gguf = optarg; break;
        case OPT_FROM: from = optarg; break;
        case OPT_THREADS:
            if (cli_int("--threads", optarg, 1, 256, &threads, &e) < 0)
                goto usage_error;
            break;
        case OPT_OLD_SEED:
            /* `run --seed` is the prompt's seed; gen's old --seed (the
             * weights) keeps working, under its new name from now on. */
            fprintf(stderr, "kvdiff gen: note: --seed is the old name of --weights-seed "
                            "(the weight seed, as in kvdiff run --weights-seed)\n");
            /* fall through */
        case 's':
            if (cli_u64(ch == 's' ? "--weights-seed" : "--seed", optarg, &seed, &e) < 0)
                goto usage_error;
            seed_given = 1;
            break;
        case 'd':
            if (gguf_out_type_parse(optarg, &gt, &e) < 0) {
                kv_err_prefix(&e, "--dtype");
                goto usage_error;
            }
            dtype = optarg;
            dtype_given = 1;
            break;
        case 'h': gen_usage(stdout); return EXIT_OK;
        default:
            cli_getopt_error(ch, argv, &e);
            goto usage_error;
        }
    }
    if (optind < argc) {
        kv_errf(&e, "unexpected argument '%s'", argv[optind]);
        goto usage_error;
    }
    /* "dir/" is "dir": no path printed below it shows "//" */
    char from_buf[4096], out_buf[4096];
    if (from)
        from = cli_dir(from_buf, sizeof from_buf, from);
    if (out)
        out = cli_dir(out_buf, sizeof out_buf, out);
    if (from) {
        if (preset || out || seed_given) {
            kv_errf(&e, "--from exports a folder: --preset, --weights-seed and -o do not apply");
            goto usage_error;
        }
        if (!gguf) {
            kv_errf(&e, "--from needs --gguf FILE");
            goto usage_error;
        }
        if (!dtype_given && from_out_type(from, &gt, &e) < 0)
            goto input_error;
        if (export_with_bar(NULL, 0, from, gt, gguf, &e) < 0)
            goto input_error;
        printf("wrote %s (from %s, %s)\n", gguf, from, gguf_out_type_name(gt));
        return EXIT_OK;
    }
    if (!preset || (!out && !gguf)) {
        kv_errf(&e, "--preset and -o are required, or --preset and --gguf");
        goto usage_error;
    }
    if (out && gt == GGUF_OUT_F16) {
        kv_errf(&e, "--dtype f16 is for --gguf alone; the folder is written as f32 or bf16");
        goto usage_error;
    }
    if (gguf) {
        /* Check before writing anything, so a refused model leaves no folder. */
        kv_config c;
        if (config_preset(preset, &c, &e) < 0)
            goto usage_error;
        if (gguf_export_check(&c, &e) < 0) {
            kv_err_prefix(&e, preset);
            goto input_error;
        }
    }
    if (out) {
        kern_pool *pool = threads > 1 ? pool_create((int)threads) : NULL;
        if (threads > 1 && !pool) {
            kv_errf(&e, "cannot start %ld threads", threads);
            goto input_error;
        }
        progress bar;
        progress_start(&bar, stderr, "weights", 0);
        progress_phase(&bar, "writing");
        int rc = model_gen_folder_pool(preset, seed, gt == GGUF_OUT_BF16, out, pool,
                                       cli_model_progress, &bar, &e);
        progress_end(&bar);
        pool_free(pool);
        if (rc < 0)
            goto input_error;
        char cfg[4200], st[4200];
        printf("wrote %s and %s (preset %s, weights seed %llu, %s)\n",
               cli_join(cfg, sizeof cfg, out, "config.json"),
               cli_join(st, sizeof st, out, "model.safetensors"), preset,
               (unsigned long long)seed, dtype);
        if (gguf && is_folder_output(gguf, out)) {
            kv_errf(&e, "%s: is a file of the folder just written; choose another output",
                    gguf);
            goto input_error;
        }
    }
    if (gguf) {
        /* With a folder written, the GGUF is exported from it: the two are
         * then one model (bf16 folders round norms and biases, which a
         * GGUF keeps f32, and a fresh draw would not). */
        if (export_with_bar(out ? NULL : preset, seed, out, gt, gguf, &e) < 0)
            goto input_error;
        printf("wrote %s (preset %s, weights seed %llu, %s)\n", gguf, preset,
               (unsigned long long)seed, dtype);
    }
    return EXIT_OK;
usage_error:
    cli_usage_error("gen", &e);
    return EXIT_USAGE;
input_error:
    cli_error("gen", &e);
    return EXIT_USAGE;
}
