/* cmd_run.c — `kvdiff run`: generate with one engine and print the tokens
 * (run_compare.c: with --compare, against the reference). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "run.h"
#include "verbs.h"
#include "../model/outfile.h"
#include "../model/tokenizer.h"

static void run_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff run [--model PRESET|DIR] [prompt] [options]\n"
            "\n"
            "Runs the prompt through an engine and generates new tokens; prints the\n"
            "prompt and generated token ids.\n"
            "\n"
            "model:\n"
            "  --model M          preset name or Hugging Face folder (default tiny-gemma3)\n"
            "  --weights-seed N   weight seed of a preset (default 0; as `gen --weights-seed`);\n"
            "                     an error with a folder, whose weights are its files\n"
            "  --dtype T          weight storage f32 or bf16 (default: as the file; presets f32)\n"
            "prompt (one of):\n"
            "  --prompt-text S    text, encoded with the model folder's tokenizer.json\n"
            "                     (with its special tokens: BOS where the file adds one)\n"
            "  --prompt-file F    a text file, encoded the same way, byte for byte (a\n"
            "                     final newline is part of the prompt)\n"
            "  --prompt-tokens L  ids, e.g. 5,17,42\n"
            "  --prompt-ids-file F  file of ids separated by spaces, commas or newlines\n"
            "  --prompt-random N  N ids drawn with --seed (default: 32 random ids)\n"
            "  --follow TEST.h5   teacher forcing: TEST.h5's prompt, then its generated tokens\n"
            "                     fed back one at a time in place of sampled ones (--max-new\n"
            "                     implied, no EOS stop); compare the dump with TEST.h5 when\n"
            "                     their tokens differ. With experts, its routing too: each\n"
            "                     row TEST.h5's router_logits record chooses that row's\n"
            "                     experts. Not with --prompt-*, --temperature, --top-k,\n"
            "                     --top-p, --seed\n"
            "generation:\n"
            "  --max-new N        tokens to generate (default 16)\n"
            "  --temperature T    0 = greedy (default); > 0 samples with PCG32\n"
            "  --top-k K          sample among the K most likely (default 0 = all)\n"
            "  --top-p P          nucleus sampling mass (default 1)\n"
            "  --seed N           seed of the random prompt and of sampling (default 0)\n"
            "  --ignore-eos       do not stop at an end-of-sequence token\n"
            "engine:\n"
            "  --engine E         reference (default) or chunked\n"
            "  --prefill P        reference only: all (default), token, or N tokens per step\n"
            "  --chunk C          chunked: prompt tokens per prefill chunk (default 16); a\n"
            "                     chunk longer than the run takes the whole prompt at once\n"
            "  --cache S          chunked: dense (default), split, or ring\n"
            "  --attn A           chunked: exact (default, bit-identical) or cascade\n"
            "  --mla F            chunked, MLA models: expanded (default, bit-identical) or\n"
            "                     absorbed (decode steps fold kv_b_proj into q and the output)\n"
            "  --kv-share K       chunked, KV-shared layers: plain (default), padded, owner-read-only\n"
            "  --kv-pad N         chunked, --kv-share padded: head_dim padded to a multiple of N (64)\n"
            "  --inject I[=V]     chunked: reproduce a cache bug (repeatable)\n"
            "  --list-injections  list the injections and exit\n"
            "  --max-ctx N        cache positions (default: prompt + max-new)\n"
            "  --threads N        worker threads (default: all cores)\n"
            "  --isa I            auto, scalar, avx2, avx512 (same bits either way)\n"
            "  --verbose          model, engine, cache size and speed on stderr\n"
            "recording (docs/dump-format.md):\n"
            "  --dump FILE        record every intermediate to an HDF5 dump\n"
            "  --fingerprint      record a 64-bit hash and L2/absmax per row instead\n"
            "  --dump-layers A:B  layers to record (inclusive; A:, :B, N)\n"
            "  --dump-positions A:B  positions to record (inclusive)\n"
            "  --dump-stages L    comma list of stages (x_in,q,k,v,attn_out,x_out,...)\n"
            "  --dump-logits      also store full logits (top-k and lse are always kept)\n"
            "  --dump-compress    shuffle + deflate the datasets\n"
            "Ctrl-C (SIGTERM, SIGHUP) stops the run and leaves the dump readable, marked\n"
            "partial; the exit status is then 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP).\n"
            "comparing (no files written unless asked):\n"
            "  --compare          run the reference engine (same model, prompt, sampling), then\n"
            "                     this engine against it in memory: every row is checked as it\n"
            "                     is computed and the run stops 8 positions after the forward\n"
            "                     step that produced the first differing one; prints the first\n"
            "                     divergence, its diagnosis and the tokens as `kvdiff compare`.\n"
            "                     --dump-layers/--dump-positions/--dump-stages bound what is\n"
            "                     kept in memory. Exit 0 same, 1 diverged, 2 error.\n"
            "  --dump FILE        with --compare: also record this engine's run\n"
            "  --dump-ref FILE    with --compare: also record the reference run\n"
            "  --exact | --atol X | --rtol X | --ulp N   tolerance (default exact; with a\n"
            "                     tolerance both runs go to the end)\n"
            "  --json             the result as JSON (errors too, as {\"error\": ...});\n"
            "  --stages           add the per-stage table\n"
            "  -q, --quiet        no progress bar; print only the verdict line\n"
            "  --compare-memory S both runs are held in memory (about 2.4 MB a position on\n"
            "                     qwen2.5-0.5b-shape); estimated first: above S (default half\n"
            "                     this machine's memory) the run is refused, above S/2 a warning.\n"
            "                     S in bytes or with K, M, G, T\n"
            "  --force            run even above --compare-memory (with a warning)\n"
            "\n"
            "Examples:\n"
            "  kvdiff run --model tiny-gemma3 --prompt-random 40 --max-new 8\n"
            "  kvdiff run --model gemma-3-1b-it/ --prompt-text \"The capital of France is\"\n"
            "                     # a downloaded HF folder, with its tokenizer.json (the\n"
            "                     # folders kvdiff gen writes have none: give them ids)\n"
            "  kvdiff run --model tiny-gemma3 --engine chunked --chunk 5 --cache ring --dump chk.h5\n"
            "  kvdiff run --compare --model tiny-gemma3 --prompt-random 40 --engine chunked \\\n"
            "             --chunk 5 --inject window=4\n"
            "  kvdiff run --model tiny-gemma3 --follow test.h5 --dump ref-followed.h5\n"
            "  kvdiff run --list-injections\n");
}

static void list_injections(void)
{
    for (int i = 0; i < INJ_COUNT; i++)
        printf("  %-22s %s\n", chk_injection_name((chk_injection)i),
               chk_injection_help((chk_injection)i));
}

/* Prints the decoded text of ids, quoted, with control bytes escaped. */
static void print_text(const char *label, const kv_tokenizer *tok, const int32_t *ids, int n)
{
    size_t cap = (size_t)n * 64 + 1;
    char *buf = malloc(cap);
    if (!buf)
        return;
    buf[0] = 0;
    for (int i = 0; i < n; i++)
        tok_decode(tok, ids[i], buf, cap);
    printf("%s\"", label);
    for (const unsigned char *p = (const unsigned char *)buf; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p == '\n')
            printf("\\n");
        else if (*p < 0x20 || *p == 0x7f)
            printf("\\x%02x", *p);
        else
            putchar(*p);
    }
    printf("\"\n");
    free(buf);
}

static int run_generation(const run_opts *o, const kv_model *m, const kern_ctx *kc,
                          const kv_tokenizer *tok, const int32_t *prompt, int n_prompt,
                          kv_err *e)
{
    const kv_config *c = &m->cfg;
    long ctx = run_context(o, c, n_prompt, e);
    if (ctx < 0)
        return -1;
    dump_writer *w = NULL;
    if (o->dump_path &&
        !(w = run_open_dump(o, o->dump_path, &o->dopts, m, kc, ctx, n_prompt, e)))
        return -1;
    run_progress bar;
    kv_observer *obs = run_progress_attach(&bar, w ? dump_observer(w) : NULL, c, ctx, "positions", true);
    engine_spec spec = run_engine_spec(o);
    kv_engine *eng = engine_create(&spec, m, kc, ctx, obs, e);
    if (!eng) {
        if (w)
            dump_close(w, "engine could not start", NULL);
        return -1;
    }
    gen_result res;
    double t0 = run_now();
    int rc = generate(eng, c, prompt, n_prompt, &o->go, obs, &res, e);
    double t1 = run_now();
    run_progress_end(&bar);
    if (w) {
        kv_err gen_err = *e;
        if (run_close_dump(w, o->dump_path, rc, &gen_err, NULL, e) < 0)
            rc = -1;
    }
    if (rc == 0 && !strcmp(o->engine, "chunked")) {
        /* Tokens from a planted bug must never pass for the model's. */
        char inj[256];
        chk_injections_describe(&o->co.inj, inj, sizeof inj);
        if (strcmp(inj, "none"))
            printf("inject    %s: a cache bug planted on purpose; these tokens are not the "
                   "model's\n", inj);
    }
    if (rc == 0) {
        printf("prompt    %d tokens: ", res.n_prompt);
        cli_print_ids(stdout, res.tokens, res.n_prompt);
        printf("\ngenerated %d tokens: ", res.n_new);
        cli_print_ids(stdout, res.tokens + res.n_prompt, res.n_new);
        printf("\n");
        if (tok) {
            print_text("prompt text    ", tok, res.tokens, res.n_prompt);
            print_text("generated text ", tok, res.tokens + res.n_prompt, res.n_new);
        }
        if (o->follow_path)
            printf("followed  %s: its prompt and its %d generated tokens, fed as given\n",
                   o->follow_path, res.n_new);
        if (res.stopped_at_eos)
            printf("stopped at end-of-sequence token %d\n", res.tokens[res.n_prompt + res.n_new - 1]);
    }
    if (rc == 0 && w)
        printf("dump      %s (%s)\n", o->dump_path, o->dopts.fingerprint ? "fingerprint" : "full");
    if (rc == 0 && o->verbose) {
        char desc[256];
        eng->describe(eng, desc, sizeof desc);
        fprintf(stderr, "engine    %s, %d thread%s, %s, %s weights\n", desc,
                pool_threads(kc->pool), pool_threads(kc->pool) == 1 ? "" : "s",
                kern_isa_name(kc->isa), m->wtype == KERN_BF16 ? "bf16" : "f32");
        fprintf(stderr, "cache     %.1f KiB for %ld positions", (double)eng->cache_bytes(eng) / 1024.0,
                ctx);
        if (!strcmp(o->engine, "chunked"))
            fprintf(stderr, " (sliding layers %.1f KiB, global layers %.1f KiB)",
                    (double)chk_cache_bytes_of(eng, ATTN_SLIDING) / 1024.0,
                    (double)chk_cache_bytes_of(eng, ATTN_GLOBAL) / 1024.0);
        fprintf(stderr, "\n");
        fprintf(stderr, "time      %.3f s for %d + %d tokens\n", t1 - t0, res.n_prompt, res.n_new);
    }
    gen_result_free(&res);
    engine_free(eng);
    return rc == 0 ? 0 : -1;
}

/* A dump written over an input (the prompt file, a model file, the other
 * dump) would destroy it, and half-way through the run: refuse first. */
static int check_outputs(const run_opts *o, kv_err *e)
{
    const char *outs[2] = {o->dump_path, o->dump_ref_path};
    const char *names[2] = {"--dump", "--dump-ref"};
    for (int i = 0; i < 2; i++) {
        if (!outs[i])
            continue;
        if (cli_output_not_input(names[i], outs[i], "--prompt-file", o->po.text_file, e) < 0 ||
            cli_output_not_input(names[i], outs[i], "--prompt-ids-file", o->po.ids_file, e) < 0 ||
            cli_output_not_input(names[i], outs[i], "--follow", o->follow_path, e) < 0 ||
            cli_output_not_model_file(names[i], outs[i], o->mo.model, e) < 0)
            return -1;
    }
    if (outs[0] && outs[1] && outfile_same(outs[0], outs[1]))
        return kv_errf(e, "--dump %s and --dump-ref %s: the same file; give each run its own",
                       outs[0], outs[1]);
    return 0;
}

int cmd_run(int argc, char **argv)
{
    run_opts o;
    run_opts_init(&o);
    kv_err e = {{0}};
    int pr = run_parse(argc, argv, &o, &e);
    if (pr == 1) {
        run_usage(stdout);
        return EXIT_OK;
    }
    if (pr == 0 && o.list_injections) {
        list_injections();
        return EXIT_OK;
    }
    if (pr < 0) {
        if (o.json && o.compare)   /* --json is --compare's */
            cli_json_error("run", &e, EXIT_USAGE);
        cli_usage_error("run", &e);
        return EXIT_USAGE;
    }
    if (check_outputs(&o, &e) < 0) {
        if (o.json && o.compare)   /* --json is --compare's */
            cli_json_error("run", &e, EXIT_USAGE);
        cli_error("run", &e);
        return EXIT_USAGE;
    }
    kv_model m;
    kern_ctx kc;
    if (cli_open_model(&o.mo, &m, &kc, &e) < 0) {
        if (o.json && o.compare)   /* --json is --compare's */
            cli_json_error("run", &e, EXIT_USAGE);
        cli_error("run", &e);
        return EXIT_USAGE;
    }
    if (o.verbose) {
        char desc[512];
        config_describe(&m.cfg, desc, sizeof desc);
        fprintf(stderr, "model     %s (%s, fingerprint %016llx)\n", desc, m.source,
                (unsigned long long)m.fingerprint);
    }
    int32_t *prompt = NULL;
    int n_prompt = 0, rc = EXIT_OK;
    kv_tokenizer *tok = NULL;
    if (cli_open_tokenizer("run", &o.mo, &m, &tok, &e) < 0)
        rc = EXIT_USAGE;
    else if (o.follow_path ? run_follow_load(&o, &m, &prompt, &n_prompt, &e) < 0
                           : cli_make_prompt(&o.po, &o.mo, &m, tok, &prompt, &n_prompt, &e) < 0)
        rc = EXIT_USAGE;
    else if (o.compare) {
        tok_free(tok);
        tok = NULL;
        rc = run_compare(&o, &m, &kc, prompt, n_prompt);
        free(prompt);
        run_follow_free(&o);
        cli_close_model(&m, &kc);
        /* stopped by a signal: the shell's convention, 128 + the signal */
        return run_stop_signal && rc != EXIT_OK ? 128 + run_stop_signal : rc;
    } else if (run_generation(&o, &m, &kc, tok, prompt, n_prompt, &e) < 0)
        rc = run_stop_signal ? 128 + run_stop_signal : EXIT_USAGE;
    if (rc != EXIT_OK && o.json && o.compare)
        cli_json_error("run", &e, rc);
    if (rc != EXIT_OK)
        cli_error("run", &e);
    tok_free(tok);
    free(prompt);
    run_follow_free(&o);
    cli_close_model(&m, &kc);
    return rc;
}
