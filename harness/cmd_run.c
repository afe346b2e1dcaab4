/* cmd_run.c — `kvdiff run`: generate with one engine and print the tokens. */
#include <getopt.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "verbs.h"
#include "../model/generate.h"
#include "../model/tokenizer.h"
#include "../chunked/chunked.h"
#include "../dump/dump.h"
#include "../reference/reference.h"

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
            "  --weights-seed N   weight seed of a preset (default 0; as `gen --seed`)\n"
            "  --dtype T          weight storage f32 or bf16 (default: as the file; presets f32)\n"
            "prompt (one of):\n"
            "  --prompt-tokens L  ids, e.g. 5,17,42\n"
            "  --prompt-file F    file of ids separated by spaces, commas or newlines\n"
            "  --prompt-random N  N ids drawn with --seed (default: 32 random ids)\n"
            "generation:\n"
            "  --max-new N        tokens to generate (default 16)\n"
            "  --temperature T    0 = greedy (default); > 0 samples with PCG32\n"
            "  --top-k K          sample among the K most likely (default 0 = all)\n"
            "  --top-p P          nucleus sampling mass (default 1)\n"
            "  --seed N           seed of the random prompt and of sampling (default 0)\n"
            "  --ignore-eos       do not stop at an end-of-sequence token\n"
            "engine:\n"
            "  --engine E         reference (default) or chunked\n"
            "  --prefill P        reference: all (default), token, or N tokens per step\n"
            "  --chunk C          chunked: prompt tokens per prefill chunk (default 16)\n"
            "  --cache S          chunked: dense (default), split, or ring\n"
            "  --attn A           chunked: exact (default, bit-identical) or cascade\n"
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
            "Ctrl-C (or SIGTERM) stops the run and leaves the dump readable, marked partial.\n");
}

typedef struct {
    cli_model_opts mo;
    cli_prompt_opts po;
    gen_opts go;
    const char *engine;
    int prefill_step;
    chk_opts co;
    bool chunk_given;
    long max_ctx;
    int verbose;
    int list_injections;
    const char *dump_path;
    dump_opts dopts;
    bool dump_opts_given;
} run_opts;

/* Set by SIGINT / SIGTERM; the dump's observer turns it into a stop. */
static volatile sig_atomic_t stop_signal;

static void on_stop_signal(int signo)
{
    stop_signal = signo;
}

/* Options of the dump; returns 1 if handled, 0 if not, -1 bad. */
static int dump_option(run_opts *o, const char *name, const char *val, kv_err *e)
{
    int rc = 0;
    if (!strcmp(name, "dump")) o->dump_path = val;
    else if (!strcmp(name, "fingerprint")) o->dopts.fingerprint = true;
    else if (!strcmp(name, "dump-layers")) rc = dump_parse_layers(val, &o->dopts, e);
    else if (!strcmp(name, "dump-positions")) rc = dump_parse_positions(val, &o->dopts, e);
    else if (!strcmp(name, "dump-stages")) rc = dump_parse_stages(val, &o->dopts, e);
    else if (!strcmp(name, "dump-logits")) o->dopts.full_logits = true;
    else if (!strcmp(name, "dump-compress")) o->dopts.compress = true;
    else
        return 0;
    if (strcmp(name, "dump"))
        o->dump_opts_given = true;
    return rc < 0 ? -1 : 1;
}

static void list_injections(void)
{
    for (int i = 0; i < INJ_COUNT; i++)
        printf("  %-22s %s\n", chk_injection_name((chk_injection)i),
               chk_injection_help((chk_injection)i));
}

/* Options of the chunked engine; returns 1 if handled, 0 if not, -1 bad. */
static int chunked_option(run_opts *o, const char *name, const char *val, kv_err *e)
{
    long v;
    if (!strcmp(name, "chunk")) {
        if (cli_int("--chunk", val, 0, 1L << 30, &v, e) < 0)
            return -1;
        if (v < 1)
            return kv_errf(e, "--chunk: %ld must be at least 1", v);
        o->co.chunk = (int)v;
        o->chunk_given = true;
    } else if (!strcmp(name, "cache")) {
        if (chk_cache_parse(val, &o->co.cache) < 0)
            return kv_errf(e, "--cache: '%s' is not dense, split or ring", val);
    } else if (!strcmp(name, "attn")) {
        if (strcmp(val, "exact") && strcmp(val, "cascade"))
            return kv_errf(e, "--attn: '%s' is not exact or cascade", val);
        o->co.attn = strcmp(val, "exact") ? CHK_ATTN_CASCADE : CHK_ATTN_EXACT;
    } else if (!strcmp(name, "kv-share")) {
        if (chk_share_parse(val, &o->co.share) < 0)
            return kv_errf(e, "--kv-share: '%s' is not plain, padded or owner-read-only", val);
    } else if (!strcmp(name, "kv-pad")) {
        if (cli_int("--kv-pad", val, 1, 4096, &v, e) < 0)
            return -1;
        o->co.share_pad = (int)v;
    } else if (!strcmp(name, "inject")) {
        if (chk_injection_parse(val, &o->co.inj, e) < 0)
            return -1;
    } else {
        return 0;
    }
    return 1;
}

static int parse_prefill(const char *s, int *step, kv_err *e)
{
    long v;
    if (!strcmp(s, "all"))
        *step = 0;
    else if (!strcmp(s, "token"))
        *step = 1;
    else if (cli_int("--prefill", s, 1, 1 << 30, &v, e) == 0)
        *step = (int)v;
    else
        return kv_errf(e, "--prefill: '%s' is not all, token or a positive count", s);
    return 0;
}

static int parse_run(int argc, char **argv, run_opts *o, kv_err *e)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 0},       {"weights-seed", required_argument, 0, 0},
        {"dtype", required_argument, 0, 0},       {"threads", required_argument, 0, 0},
        {"isa", required_argument, 0, 0},         {"prompt-tokens", required_argument, 0, 0},
        {"prompt-file", required_argument, 0, 0}, {"prompt-random", required_argument, 0, 0},
        {"max-new", required_argument, 0, 0},     {"temperature", required_argument, 0, 0},
        {"top-k", required_argument, 0, 0},       {"top-p", required_argument, 0, 0},
        {"seed", required_argument, 0, 0},        {"ignore-eos", no_argument, 0, 0},
        {"engine", required_argument, 0, 0},      {"prefill", required_argument, 0, 0},
        {"max-ctx", required_argument, 0, 0},     {"verbose", no_argument, 0, 0},
        {"chunk", required_argument, 0, 0},       {"cache", required_argument, 0, 0},
        {"attn", required_argument, 0, 0},        {"kv-share", required_argument, 0, 0},
        {"kv-pad", required_argument, 0, 0},      {"inject", required_argument, 0, 0},
        {"list-injections", no_argument, 0, 0},   {"dump", required_argument, 0, 0},
        {"fingerprint", no_argument, 0, 0},       {"dump-layers", required_argument, 0, 0},
        {"dump-positions", required_argument, 0, 0}, {"dump-stages", required_argument, 0, 0},
        {"dump-logits", no_argument, 0, 0},       {"dump-compress", no_argument, 0, 0},
        {"help", no_argument, 0, 'h'},            {0, 0, 0, 0}};
    int idx, ch;
    long v;
    optind = 0;
    while ((ch = getopt_long(argc, argv, "h", longopts, &idx)) != -1) {
        if (ch == 'h')
            return 1;
        if (ch != 0)
            return kv_errf(e, "see kvdiff run --help");
        const char *name = longopts[idx].name;
        int r = cli_model_option(&o->mo, name, optarg, e);
        if (r == 0)
            r = chunked_option(o, name, optarg, e);
        if (r == 0)
            r = dump_option(o, name, optarg, e);
        if (r < 0)
            return -1;
        if (r > 0)
            continue;
        if (!strcmp(name, "prompt-tokens")) o->po.tokens = optarg;
        else if (!strcmp(name, "prompt-file")) o->po.file = optarg;
        else if (!strcmp(name, "prompt-random")) {
            if (cli_int("--prompt-random", optarg, 1, 1 << 24, &o->po.random_len, e) < 0)
                return -1;
        } else if (!strcmp(name, "max-new")) {
            if (cli_int("--max-new", optarg, 0, 1 << 24, &v, e) < 0)
                return -1;
            o->go.max_new = (int)v;
        } else if (!strcmp(name, "temperature")) {
            if (cli_double("--temperature", optarg, 0, 1e6, &o->go.samp.temperature, e) < 0)
                return -1;
        } else if (!strcmp(name, "top-k")) {
            if (cli_int("--top-k", optarg, 0, 1 << 30, &v, e) < 0)
                return -1;
            o->go.samp.top_k = (int)v;
        } else if (!strcmp(name, "top-p")) {
            if (cli_double("--top-p", optarg, 1e-9, 1, &o->go.samp.top_p, e) < 0)
                return -1;
        } else if (!strcmp(name, "seed")) {
            if (cli_u64("--seed", optarg, &o->po.seed, e) < 0)
                return -1;
            o->go.seed = o->po.seed;
        } else if (!strcmp(name, "ignore-eos")) o->go.ignore_eos = true;
        else if (!strcmp(name, "engine")) o->engine = optarg;
        else if (!strcmp(name, "prefill")) {
            if (parse_prefill(optarg, &o->prefill_step, e) < 0)
                return -1;
        } else if (!strcmp(name, "max-ctx")) {
            if (cli_int("--max-ctx", optarg, 1, 1L << 30, &o->max_ctx, e) < 0)
                return -1;
        } else if (!strcmp(name, "verbose")) o->verbose = 1;
        else if (!strcmp(name, "list-injections")) o->list_injections = 1;
    }
    if (optind < argc)
        return kv_errf(e, "unexpected argument '%s'", argv[optind]);
    if (strcmp(o->engine, "reference") && strcmp(o->engine, "chunked"))
        return kv_errf(e, "--engine: '%s' is not a known engine (reference, chunked)", o->engine);
    bool chunked_opts = o->chunk_given || o->co.cache != CACHE_DENSE ||
                        o->co.attn != CHK_ATTN_EXACT || o->co.share != SHARE_PLAIN;
    for (int i = 0; i < INJ_COUNT; i++)
        chunked_opts = chunked_opts || o->co.inj.on[i];
    if (chunked_opts && strcmp(o->engine, "chunked"))
        return kv_errf(e, "--chunk, --cache, --attn, --kv-share and --inject need --engine chunked");
    if (o->dump_opts_given && !o->dump_path)
        return kv_errf(e, "--fingerprint and --dump-* need --dump FILE");
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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

/* The settings a dump records: enough to re-run the same engine. */
static char *engine_settings_json(const run_opts *o, const kern_ctx *kc, const kv_model *m,
                                  long ctx)
{
    json_t *j = json_object();
    json_object_set_new(j, "engine", json_string(o->engine));
    json_object_set_new(j, "model", json_string(o->mo.model));
    json_object_set_new(j, "weights_seed", json_integer((json_int_t)o->mo.weights_seed));
    json_object_set_new(j, "weights", json_string(m->wtype == KERN_BF16 ? "bf16" : "f32"));
    json_object_set_new(j, "threads", json_integer(pool_threads(kc->pool)));
    json_object_set_new(j, "isa", json_string(kern_isa_name(kc->isa)));
    json_object_set_new(j, "max_ctx", json_integer(ctx));
    if (!strcmp(o->engine, "chunked")) {
        char inj[256];
        chk_injections_describe(&o->co.inj, inj, sizeof inj);
        json_object_set_new(j, "chunk", json_integer(o->co.chunk));
        json_object_set_new(j, "cache", json_string(chk_cache_name(o->co.cache)));
        json_object_set_new(j, "attention", json_string(o->co.attn == CHK_ATTN_EXACT ? "exact" : "cascade"));
        json_object_set_new(j, "kv_share", json_string(chk_share_name(o->co.share)));
        json_object_set_new(j, "inject", json_string(inj));
    } else {
        json_object_set_new(j, "prefill_step", json_integer(o->prefill_step));
    }
    json_object_set_new(j, "temperature", json_real(o->go.samp.temperature));
    json_object_set_new(j, "top_k", json_integer(o->go.samp.top_k));
    json_object_set_new(j, "top_p", json_real(o->go.samp.top_p));
    char *text = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(j);
    return text;
}

static dump_writer *open_dump(const run_opts *o, const kv_model *m, const kern_ctx *kc, long ctx,
                              int n_prompt, kv_err *e)
{
    char *settings = engine_settings_json(o, kc, m, ctx);
    dump_meta meta = {.engine = o->engine, .engine_settings = settings ? settings : "{}",
                      .cfg = &m->cfg, .weight_fingerprint = m->fingerprint, .seed = o->po.seed,
                      .tool_version = "kvdiff " KVDIFF_VERSION, .max_positions = (int)ctx,
                      .prompt_length = n_prompt};
    dump_writer *w = dump_create(o->dump_path, &meta, &o->dopts, e);
    free(settings);
    if (w) {
        stop_signal = 0;
        dump_watch_flag(w, &stop_signal);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_stop_signal;
        sigaction(SIGINT, &sa, NULL);
        sigaction(SIGTERM, &sa, NULL);
        /* A file size limit is a write error the dump reports, not a kill. */
        signal(SIGXFSZ, SIG_IGN);
    }
    return w;
}

/* Closes the dump with the status the run earned. */
static int close_dump(dump_writer *w, int gen_rc, const kv_err *gen_err, kv_err *e)
{
    char why[1100];
    const char *reason = NULL;
    if (stop_signal)
        snprintf(why, sizeof why, "interrupted by %s", stop_signal == SIGINT ? "SIGINT" : "SIGTERM");
    else if (dump_error(w))
        snprintf(why, sizeof why, "%s", dump_error(w));
    else if (gen_rc != 0)
        snprintf(why, sizeof why, "engine error: %s", gen_err->msg);
    if (stop_signal || dump_error(w) || gen_rc != 0)
        reason = why;
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    return dump_close(w, reason, e);
}

static int run_generation(const run_opts *o, const kv_model *m, const kern_ctx *kc,
                          const kv_tokenizer *tok, const int32_t *prompt, int n_prompt,
                          kv_err *e)
{
    const kv_config *c = &m->cfg;
    long ctx = o->max_ctx ? o->max_ctx : (long)n_prompt + o->go.max_new;
    if (ctx < (long)n_prompt + o->go.max_new || ctx > c->max_positions)
        return kv_errf(e, "prompt (%d) + max-new (%d) needs %ld positions; the model "
                          "allows %d and --max-ctx is %ld",
                       n_prompt, o->go.max_new, (long)n_prompt + o->go.max_new,
                       c->max_positions, ctx);
    dump_writer *w = NULL;
    if (o->dump_path && !(w = open_dump(o, m, kc, ctx, n_prompt, e)))
        return -1;
    kv_observer *obs = w ? dump_observer(w) : NULL;
    kv_engine *eng;
    if (!strcmp(o->engine, "chunked")) {
        chk_opts co = o->co;
        co.max_ctx = (int)ctx;
        eng = chk_create(m, kc, &co, obs, e);
    } else {
        ref_opts ro = {.max_ctx = (int)ctx, .prefill_step = o->prefill_step};
        eng = ref_create(m, kc, &ro, obs, e);
    }
    if (!eng) {
        if (w)
            dump_close(w, "engine could not start", NULL);
        return -1;
    }
    gen_result res;
    double t0 = now_s();
    int rc = generate(eng, c, prompt, n_prompt, &o->go, obs, &res, e);
    double t1 = now_s();
    if (w) {
        kv_err ce = {{0}}, we = {{0}};
        /* The writer's own failure (disk full, ...) is what the user needs. */
        if (dump_error(w))
            kv_errf(&we, "%s", dump_error(w));
        int crc = close_dump(w, rc, e, &ce);
        if (we.msg[0]) {
            *e = we;
            rc = -1;
        } else if (rc == 0 && crc < 0) {
            *e = ce;
            rc = -1;
        } else if (rc != 0 && stop_signal) {
            kv_errf(e, "interrupted; %s holds what was computed (status partial)", o->dump_path);
        } else if (rc != 0 && crc == 0) {
            kv_err_prefix(e, "stopped");
        }
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

int cmd_run(int argc, char **argv)
{
    run_opts o;
    memset(&o, 0, sizeof o);
    cli_model_defaults(&o.mo);
    o.engine = "reference";
    o.go.max_new = 16;
    o.go.samp.top_p = 1.0;
    chk_opts_default(&o.co);
    dump_opts_default(&o.dopts);
    kv_err e = {{0}};
    int pr = parse_run(argc, argv, &o, &e);
    if (pr == 1) {
        run_usage(stdout);
        return EXIT_OK;
    }
    if (pr == 0 && o.list_injections) {
        list_injections();
        return EXIT_OK;
    }
    if (pr < 0) {
        cli_error("run", &e);
        return EXIT_USAGE;
    }
    kv_model m;
    kern_ctx kc;
    if (cli_open_model(&o.mo, &m, &kc, &e) < 0) {
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
    /* A folder may carry a vocabulary; presets have none. */
    if (strcmp(m.source, o.mo.model) == 0 && tok_load(o.mo.model, &tok, &e) < 0)
        rc = EXIT_USAGE;
    else if (cli_make_prompt(&o.po, m.cfg.vocab, &prompt, &n_prompt, &e) < 0 ||
             run_generation(&o, &m, &kc, tok, prompt, n_prompt, &e) < 0)
        rc = EXIT_USAGE;
    if (rc != EXIT_OK)
        cli_error("run", &e);
    tok_free(tok);
    free(prompt);
    cli_close_model(&m, &kc);
    return rc;
}
