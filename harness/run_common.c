/* run_common.c — options, engines and dumps of the engine-running verbs. */
#include <getopt.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "run.h"
#include "engines.h"

volatile sig_atomic_t run_stop_signal;

static struct sigaction saved[3];   /* SIGINT, SIGTERM, SIGHUP before a dump */

static void on_stop_signal(int signo)
{
    run_stop_signal = signo;
}

double run_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void run_opts_init(run_opts *o)
{
    memset(o, 0, sizeof *o);
    cli_model_defaults(&o->mo);
    o->engine = "reference";
    o->go.max_new = 16;
    o->go.samp.top_p = 1.0;
    chk_opts_default(&o->co);
    dump_opts_default(&o->dopts);
    cmp_opts_default(&o->cmp);
}

void run_opts_reference(const run_opts *o, run_opts *ref)
{
    *ref = *o;
    ref->engine = "reference";
    ref->prefill_step = 0;
    chk_opts_default(&ref->co);
    ref->chunk_given = false;
}

/* "512M", "4G", "1.5T", "1000000" (bytes; K, M, G, T are powers of 1024). */
static int parse_size(const char *opt, const char *s, double *out, kv_err *e)
{
    static const char units[] = "KMGT";
    char *end;
    double v = strtod(s, &end);
    double scale = 1;
    if (end != s && *end) {
        const char *u = strchr(units, *end);
        if (u && end[1] == 0)
            for (const char *p = units; p <= u; p++)
                scale *= 1024;
        else
            end = (char *)s;   /* not a size */
    }
    if (end == s || !(v > 0) || v * scale > 1e18)
        return kv_errf(e, "%s: '%s' is not a size (bytes, or a number with K, M, G or T)", opt, s);
    *out = v * scale;
    return 0;
}

/* Options of `run --compare`; returns 1 if handled, 0 if not, -1 bad. */
static int compare_option(run_opts *o, const char *name, const char *val, kv_err *e)
{
    int rc = 0;
    if (!strcmp(name, "compare")) o->compare = true;
    else if (!strcmp(name, "dump-ref")) o->dump_ref_path = val;
    else if (!strcmp(name, "json")) o->json = true;
    else if (!strcmp(name, "stages")) o->render_flags |= CMP_RENDER_STAGES;
    else if (!strcmp(name, "exact")) {
        o->cmp.atol = o->cmp.rtol = 0;
        o->cmp.ulp = 0;
        o->tolerance_given = true;
    } else if (!strcmp(name, "atol")) rc = cli_double("--atol", val, 0, 1e30, &o->cmp.atol, e);
    else if (!strcmp(name, "rtol")) rc = cli_double("--rtol", val, 0, 1e30, &o->cmp.rtol, e);
    else if (!strcmp(name, "ulp")) rc = cli_u64("--ulp", val, &o->cmp.ulp, e);
    else if (!strcmp(name, "compare-memory")) rc = parse_size("--compare-memory", val, &o->compare_memory, e);
    else if (!strcmp(name, "force")) o->force = true;
    else
        return 0;
    if (!strcmp(name, "atol") || !strcmp(name, "rtol") || !strcmp(name, "ulp"))
        o->tolerance_given = true;
    if (rc == 0 && cli_tolerance_conflict(name, &o->exact_with, e) < 0)
        return -1;
    return rc < 0 ? -1 : 1;
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
    } else if (!strcmp(name, "mla")) {
        if (strcmp(val, "expanded") && strcmp(val, "absorbed"))
            return kv_errf(e, "--mla: '%s' is not expanded or absorbed", val);
        o->co.mla_absorbed = !strcmp(val, "absorbed");
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

/* --follow takes the prompt and the generated tokens from its file: an
 * option that would choose either must not pass for one that took effect. */
static int follow_conflict(const run_opts *o, kv_err *e)
{
    const cli_prompt_opts *p = &o->po;
    if (!o->follow_path)
        return 0;
    if (o->bisect)
        return kv_errf(e, "--follow is an option of kvdiff run");
    const char *prompt = p->tokens ? "--prompt-tokens" : p->ids_file ? "--prompt-ids-file"
                         : p->text ? "--prompt-text" : p->text_file ? "--prompt-file"
                         : p->random_len > 0 ? "--prompt-random" : NULL;
    if (prompt)
        return kv_errf(e, "--follow %s and %s: the prompt is %s's own (its first prompt_length "
                          "tokens); give one or the other", o->follow_path, prompt,
                       o->follow_path);
    if (o->sampling_opt)
        return kv_errf(e, "--follow %s and --%s: a followed run samples nothing (it feeds %s's "
                          "generated tokens back)", o->follow_path, o->sampling_opt,
                       o->follow_path);
    return 0;
}

int run_parse(int argc, char **argv, run_opts *o, kv_err *e)
{
    static const struct option longopts[] = {
        {"model", required_argument, 0, 0},       {"weights-seed", required_argument, 0, 0},
        {"dtype", required_argument, 0, 0},       {"threads", required_argument, 0, 0},
        {"isa", required_argument, 0, 0},         {"prompt-tokens", required_argument, 0, 0},
        {"prompt-file", required_argument, 0, 0}, {"prompt-random", required_argument, 0, 0},
        {"prompt-text", required_argument, 0, 0}, {"prompt-ids-file", required_argument, 0, 0},
        {"max-new", required_argument, 0, 0},     {"temperature", required_argument, 0, 0},
        {"top-k", required_argument, 0, 0},       {"top-p", required_argument, 0, 0},
        {"seed", required_argument, 0, 0},        {"ignore-eos", no_argument, 0, 0},
        {"engine", required_argument, 0, 0},      {"prefill", required_argument, 0, 0},
        {"max-ctx", required_argument, 0, 0},     {"verbose", no_argument, 0, 0},
        {"chunk", required_argument, 0, 0},       {"cache", required_argument, 0, 0},
        {"attn", required_argument, 0, 0},        {"kv-share", required_argument, 0, 0},
        {"kv-pad", required_argument, 0, 0},      {"inject", required_argument, 0, 0},
        {"mla", required_argument, 0, 0},
        {"list-injections", no_argument, 0, 0},   {"dump", required_argument, 0, 0},
        {"fingerprint", no_argument, 0, 0},       {"dump-layers", required_argument, 0, 0},
        {"dump-positions", required_argument, 0, 0}, {"dump-stages", required_argument, 0, 0},
        {"dump-logits", no_argument, 0, 0},       {"dump-compress", no_argument, 0, 0},
        {"compare", no_argument, 0, 0},           {"dump-ref", required_argument, 0, 0},
        {"exact", no_argument, 0, 0},             {"atol", required_argument, 0, 0},
        {"rtol", required_argument, 0, 0},        {"ulp", required_argument, 0, 0},
        {"json", no_argument, 0, 0},              {"stages", no_argument, 0, 0},
        {"compare-memory", required_argument, 0, 0}, {"force", no_argument, 0, 0},
        {"out", required_argument, 0, 'o'},       {"help", no_argument, 0, 'h'},
        {"quiet", no_argument, 0, 'q'},           {"follow", required_argument, 0, 0},
        {0, 0, 0, 0}};
    int idx, ch;
    long v;
    optind = 0;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, ":ho:q", longopts, &idx)) != -1) {
        if (ch == 'h')
            return 1;
        if (ch == 'q') {
            o->quiet = true;
            continue;
        }
        if (ch == 'o') {
            o->out_dir = optarg;
            continue;
        }
        if (ch != 0)
            return cli_getopt_error(ch, argv, e);
        const char *name = longopts[idx].name;
        int r = cli_model_option(&o->mo, name, optarg, e);
        if (r == 0)
            r = chunked_option(o, name, optarg, e);
        if (r == 0)
            r = dump_option(o, name, optarg, e);
        if (r == 0)
            r = compare_option(o, name, optarg, e);
        if (r < 0)
            return -1;
        if (r > 0)
            continue;
        if (!o->sampling_opt && (!strcmp(name, "temperature") || !strcmp(name, "top-k") ||
                                 !strcmp(name, "top-p") || !strcmp(name, "seed")))
            o->sampling_opt = longopts[idx].name;
        if (!strcmp(name, "prompt-tokens")) o->po.tokens = optarg;
        else if (!strcmp(name, "prompt-file")) o->po.text_file = optarg;
        else if (!strcmp(name, "prompt-text")) o->po.text = optarg;
        else if (!strcmp(name, "prompt-ids-file")) o->po.ids_file = optarg;
        else if (!strcmp(name, "prompt-random")) {
            if (cli_int("--prompt-random", optarg, 1, 1 << 24, &o->po.random_len, e) < 0)
                return -1;
        } else if (!strcmp(name, "max-new")) {
            if (cli_int("--max-new", optarg, 0, 1 << 24, &v, e) < 0)
                return -1;
            o->go.max_new = (int)v;
            o->max_new_given = true;
        } else if (!strcmp(name, "follow")) o->follow_path = optarg;
        else if (!strcmp(name, "temperature")) {
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
            o->prefill_given = true;
        } else if (!strcmp(name, "max-ctx")) {
            if (cli_int("--max-ctx", optarg, 1, 1L << 30, &o->max_ctx, e) < 0)
                return -1;
        } else if (!strcmp(name, "verbose")) o->verbose = 1;
        else if (!strcmp(name, "list-injections")) o->list_injections = 1;
    }
    if (optind < argc)
        return kv_errf(e, "unexpected argument '%s'", argv[optind]);
    if (o->quiet && !o->compare)
        return kv_errf(e, "-q/--quiet is --compare's: it prints only the verdict line");
    if (o->quiet && o->json)
        return kv_errf(e, "-q/--quiet and --json: choose one (the verdict line or the JSON)");
    if (strcmp(o->engine, "reference") && strcmp(o->engine, "chunked"))
        return kv_errf(e, "--engine: '%s' is not a known engine (reference, chunked)", o->engine);
    bool chunked_opts = o->chunk_given || o->co.cache != CACHE_DENSE ||
                        o->co.attn != CHK_ATTN_EXACT || o->co.share != SHARE_PLAIN ||
                        o->co.mla_absorbed;
    for (int i = 0; i < INJ_COUNT; i++)
        chunked_opts = chunked_opts || o->co.inj.on[i];
    if (chunked_opts && strcmp(o->engine, "chunked"))
        return kv_errf(e, "--chunk, --cache, --attn, --mla, --kv-share and --inject need "
                          "--engine chunked");
    /* The chunked engine prefills in --chunk sized chunks; a --prefill it
     * would ignore must not pass for a setting that took effect. */
    if (o->prefill_given && !strcmp(o->engine, "chunked"))
        return kv_errf(e, "--prefill and --engine chunked: --prefill is an option of the "
                          "reference engine (the chunked one prefills by --chunk)");
    if (follow_conflict(o, e) < 0)
        return -1;
    if (o->bisect) {
        if (o->compare || o->dump_path || o->dump_ref_path || o->dump_opts_given ||
            o->tolerance_given || o->compare_memory > 0 || o->force)
            return kv_errf(e, "bisect records and compares by itself (exactly): --compare, "
                              "--dump*, --fingerprint and tolerances do not apply");
        return 0;
    }
    if (o->out_dir)
        return kv_errf(e, "-o/--out is an option of kvdiff bisect");
    if (o->dump_opts_given && !o->dump_path && !o->compare && !o->dump_ref_path)
        return kv_errf(e, "--fingerprint and --dump-* need --dump FILE");
    if (!o->compare && (o->dump_ref_path || o->json || o->render_flags || o->tolerance_given ||
                        o->compare_memory > 0 || o->force))
        return kv_errf(e, "--dump-ref, --exact, --atol, --rtol, --ulp, --json, --stages, "
                          "--compare-memory and --force need --compare");
    if (o->compare && o->dopts.fingerprint)
        return kv_errf(e, "--compare checks every row as it is computed; --fingerprint does "
                          "not apply (kvdiff bisect compares fingerprints)");
    return 0;
}

/* The settings a dump records: enough to re-run the same engine. */
char *run_settings_json(const run_opts *o, const kern_ctx *kc, const kv_model *m, long ctx)
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
        json_object_set_new(j, "chunk", json_integer(run_effective_chunk(o, ctx)));
        json_object_set_new(j, "cache", json_string(chk_cache_name(o->co.cache)));
        json_object_set_new(j, "attention", json_string(o->co.attn == CHK_ATTN_EXACT ? "exact" : "cascade"));
        json_object_set_new(j, "kv_share", json_string(chk_share_name(o->co.share)));
        if (o->co.mla_absorbed)
            json_object_set_new(j, "mla", json_string("absorbed"));
        json_object_set_new(j, "inject", json_string(inj));
    } else {
        json_object_set_new(j, "prefill_step", json_integer(o->prefill_step));
    }
    if (o->follow_path) {
        /* Fed, not sampled: no temperature, so that no reader takes the
         * followed tokens for this engine's own greedy choices. */
        json_t *f = json_string(o->follow_path);
        json_object_set_new(j, "follow", f ? f : json_string("(a path that is not UTF-8)"));
        /* the router rows whose experts it took (compare: no routing flip) */
        if (m->route_follow)
            json_object_set_new(j, "follow_routing",
                                json_integer((json_int_t)m->route_follow->followed));
    } else {
        json_object_set_new(j, "temperature", json_real(o->go.samp.temperature));
        json_object_set_new(j, "top_k", json_integer(o->go.samp.top_k));
        json_object_set_new(j, "top_p", json_real(o->go.samp.top_p));
    }
    char *text = json_dumps(j, JSON_COMPACT | JSON_SORT_KEYS);
    json_decref(j);
    return text;
}

/* ------------------------------------------------------------------ */
/* --follow                                                             */

/* What compare refuses to pair (cmp_model_mismatch; the weight
 * fingerprints are checked beside it) cannot be followed either. */
static int follow_same_model(const char *path, const char *model, const kv_config *ours,
                             const kv_config *theirs, kv_err *e)
{
    char why[256];
    if (cmp_model_mismatch(theirs, ours, why, sizeof why))
        return kv_errf(e, "%s: recorded with another model than --model %s: %s (the file's "
                          "first)", path, model, why);
    return 0;
}

/* The checks on the file's token list, once read: a prompt inside it, and
 * ids the model has. */
static int follow_check_tokens(const char *path, const int32_t *ids, int64_t n, int64_t p,
                               int vocab, kv_err *e)
{
    if (n < 1)
        return kv_errf(e, "%s: /tokens is empty: there is no prompt to follow", path);
    if (p < 1 || p > n)
        return kv_errf(e, "%s: prompt_length %lld is not within its %lld tokens (1..%lld)",
                       path, (long long)p, (long long)n, (long long)n);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return kv_errf(e, "%s: token %lld at position %lld is outside the model's "
                              "vocabulary (0..%d)", path, (long long)ids[i], (long long)i,
                           vocab - 1);
    return 0;
}

void run_follow_free(run_opts *o)
{
    kv_route_rows *r = o->follow_route;
    if (!r)
        return;
    for (int l = 0; r->rows && l < r->n_layers; l++)
        free(r->rows[l]);
    free(r->rows);
    free(r->first);
    free(r->n);
    free(r);
    o->follow_route = NULL;
}

/* The followed file's router_logits rows, each layer's as recorded (a
 * stage another width than the model's experts is refused). */
static int follow_routes(run_opts *o, kv_model *m, const dump_file *f, kv_err *e)
{
    const kv_config *c = &m->cfg;
    if (c->n_experts <= 0)
        return 0;
    kv_route_rows *r = calloc(1, sizeof *r);
    if (!r || !(r->rows = calloc((size_t)c->n_layers, sizeof *r->rows)) ||
        !(r->first = calloc((size_t)c->n_layers, sizeof *r->first)) ||
        !(r->n = calloc((size_t)c->n_layers, sizeof *r->n))) {
        o->follow_route = r;
        run_follow_free(o);
        return kv_errf(e, "out of memory for the routing of %s", o->follow_path);
    }
    o->follow_route = r;
    r->n_layers = c->n_layers;
    r->X = c->n_experts;
    for (int l = 0; l < c->n_layers; l++) {
        const dump_dataset_info in = dump_stage_info(f, l, STAGE_ROUTER_LOGITS);
        if (!in.present || in.rows <= 0)
            continue;
        if (in.cols != c->n_experts)
            return kv_errf(e, "%s: layer %d's router_logits are %d wide, but the model has %d "
                              "experts", o->follow_path, l, in.cols, c->n_experts);
        if (!(r->rows[l] = malloc((size_t)in.rows * (size_t)r->X * sizeof(float))))
            return kv_errf(e, "out of memory for the routing of %s", o->follow_path);
        if (dump_read_rows(f, l, STAGE_ROUTER_LOGITS, 0, in.rows, r->rows[l], e) < 0)
            return -1;
        r->first[l] = in.first_position;
        r->n[l] = in.rows;
        r->followed += in.rows;
    }
    if (r->followed > 0)
        m->route_follow = r;
    return 0;
}

int run_follow_load(run_opts *o, kv_model *m, int32_t **prompt, int *n_prompt, kv_err *e)
{
    const char *path = o->follow_path;
    *prompt = NULL;
    *n_prompt = 0;
    dump_file *f = dump_open(path, e);
    if (!f)
        return -1;
    kv_config cfg;
    int32_t *ids = NULL;
    int64_t n = dump_n_tokens(f), p = dump_prompt_length(f);
    int rc = dump_check_file(f, e);
    if (rc == 0)
        rc = dump_model_config(f, &cfg, e);
    if (rc == 0)
        rc = follow_same_model(path, o->mo.model, &m->cfg, &cfg, e);
    /* compare would refuse the pair too; say it before the run */
    const char *theirs = dump_attr(f, "weight_fingerprint");
    char ours[32];
    snprintf(ours, sizeof ours, "%016llx", (unsigned long long)m->fingerprint);
    if (rc == 0 && theirs && theirs[0] && m->fingerprint && strcmp(theirs, ours))
        rc = kv_errf(e, "%s: recorded with other weights: its weight_fingerprint is %s, "
                        "--model %s's is %s", path, theirs, o->mo.model, ours);
    if (rc == 0 && n > (int64_t)m->cfg.max_positions)
        rc = kv_errf(e, "%s: %lld tokens, but the model allows %d positions", path,
                     (long long)n, m->cfg.max_positions);
    if (rc == 0 && n > 0 && !(ids = malloc((size_t)n * sizeof *ids)))
        rc = kv_errf(e, "out of memory for the %lld tokens of %s", (long long)n, path);
    if (rc == 0 && n > 0)
        rc = dump_read_tokens(f, ids, e);
    if (rc == 0)
        rc = follow_check_tokens(path, ids, n, p, m->cfg.vocab, e);
    if (rc == 0)
        rc = follow_routes(o, m, f, e);
    dump_file_close(f);
    if (rc == 0 && o->max_new_given && o->go.max_new != n - p)
        rc = kv_errf(e, "--max-new %d and --follow %s: it generated %lld tokens, and a followed "
                        "run generates as many (leave --max-new out)", o->go.max_new, path,
                     (long long)(n - p));
    if (rc < 0) {
        free(ids);
        m->route_follow = NULL;
        run_follow_free(o);
        return -1;
    }
    *prompt = ids;
    *n_prompt = (int)p;
    o->go.max_new = (int)(n - p);
    o->go.follow = ids + p;
    o->go.ignore_eos = true;
    return 0;
}

long run_context(const run_opts *o, const kv_config *c, int n_prompt, kv_err *e)
{
    long ctx = o->max_ctx ? o->max_ctx : (long)n_prompt + o->go.max_new;
    if (ctx < (long)n_prompt + o->go.max_new || ctx > c->max_positions)
        return kv_errf(e, "prompt (%d) + max-new (%d) needs %ld positions; the model "
                          "allows %d and --max-ctx is %ld",
                       n_prompt, o->go.max_new, (long)n_prompt + o->go.max_new,
                       c->max_positions, ctx);
    /* The selection is the command line's, not the dump file's: say so
     * before a file is named (or, with --compare, when none is). */
    const dump_opts *d = &o->dopts;
    if (d->layer_lo >= c->n_layers)
        return kv_errf(e, "--dump-layers: layers from %d selected, but the model has %d "
                          "(0..%d)", d->layer_lo, c->n_layers, c->n_layers - 1);
    if (d->pos_lo >= ctx)
        return kv_errf(e, "--dump-positions: positions from %lld selected, but the run has "
                          "%ld (0..%ld)", (long long)d->pos_lo, ctx, ctx - 1);
    return ctx;
}

engine_spec run_engine_spec(const run_opts *o)
{
    return (engine_spec){.name = o->engine, .prefill_step = o->prefill_step, .chunked = o->co};
}

int run_effective_chunk(const run_opts *o, long ctx)
{
    engine_spec s = run_engine_spec(o);
    return engine_chunked_opts(&s, ctx).chunk;
}

dump_writer *run_open_dump(const run_opts *o, const char *path, const dump_opts *d,
                           const kv_model *m, const kern_ctx *kc, long ctx, int n_prompt,
                           kv_err *e)
{
    /* An engine that will refuse these options must not leave a dump
     * behind (nor truncate one already at path): check them first. */
    engine_spec spec = run_engine_spec(o);
    if (engine_check(&spec, &m->cfg, ctx, e) < 0)
        return NULL;
    char *settings = run_settings_json(o, kc, m, ctx);
    dump_meta meta = {.engine = o->engine, .engine_settings = settings ? settings : "{}",
                      .cfg = &m->cfg, .weight_fingerprint = m->fingerprint, .seed = o->po.seed,
                      .tool_version = "kvdiff " KVDIFF_VERSION, .max_positions = (int)ctx,
                      .prompt_length = n_prompt};
    dump_opts with_pool = *d;
    with_pool.pool = kc->pool;   /* idle while the engine hands rows over */
    dump_writer *w = dump_create(path, &meta, &with_pool, e);
    free(settings);
    if (w) {
        run_stop_signal = 0;
        dump_watch_flag(w, &run_stop_signal);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_stop_signal;
        sigaction(SIGINT, &sa, &saved[0]);
        sigaction(SIGTERM, &sa, &saved[1]);
        sigaction(SIGHUP, &sa, &saved[2]);   /* a closed terminal stops it as Ctrl-C does */
    }
    return w;
}

int run_close_dump(dump_writer *w, const char *path, int gen_rc, const kv_err *gen_err,
                   const char *stopped, kv_err *e)
{
    char why[1100];
    kv_err we = {{0}}, ce = {{0}};
    /* The writer's own failure (disk full, ...) is what the user needs. */
    if (dump_error(w))
        kv_errf(&we, "%s", dump_error(w));
    const char *reason = NULL;
    if (run_stop_signal)
        snprintf(why, sizeof why, "interrupted by %s",
                 run_stop_signal == SIGINT ? "SIGINT" : run_stop_signal == SIGHUP ? "SIGHUP"
                                                                             : "SIGTERM");
    else if (dump_error(w))
        snprintf(why, sizeof why, "%s", dump_error(w));
    else if (stopped)   /* on purpose: partial, but nothing failed */
        snprintf(why, sizeof why, "%s", stopped), gen_rc = 0;
    else if (gen_rc != 0)
        snprintf(why, sizeof why, "engine error: %s", gen_err->msg);
    if (run_stop_signal || dump_error(w) || stopped || gen_rc != 0)
        reason = why;
    /* What was there before the dump (outfile.h's clean-up, or the
     * default) handles a signal from here on. */
    sigaction(SIGINT, &saved[0], NULL);
    sigaction(SIGTERM, &saved[1], NULL);
    sigaction(SIGHUP, &saved[2], NULL);
    int crc = dump_close(w, reason, &ce);
    if (we.msg[0]) {
        *e = we;
        return -1;
    }
    if (gen_rc == 0 && crc < 0) {
        *e = ce;
        return -1;
    }
    if (gen_rc != 0 && run_stop_signal)
        return kv_errf(e, "interrupted; %s holds what was computed (status partial)", path);
    if (gen_rc != 0) {
        *e = *gen_err;
        if (crc == 0)
            kv_err_prefix(e, "stopped");
        return -1;
    }
    return 0;
}

static int rp_wants(kv_observer *self, kv_stage st, int layer)
{
    (void)self;
    (void)layer;
    return st == STAGE_X_OUT;
}

/* Every layer's x_out moves the bar: a batch of rows (a whole prompt
 * prefilled at once) is layers x rows of work, so the bar advances by
 * rows / layers as each layer finishes rather than sitting still until
 * the last one. The rows are only looked at, never changed. */
static int rp_emit(kv_observer *self, const kv_event *ev)
{
    run_progress *p = (run_progress *)self;
    if (ev->stage == STAGE_X_OUT && ev->layer >= 0)
        progress_stepf(&p->bar, progress_batch_done((double)ev->pos0, ev->nrows, ev->layer,
                                                    p->last_layer + 1), NULL);
    return 0;
}

kv_observer *run_progress_attach(run_progress *p, kv_observer *inner, const kv_config *c,
                                 long positions, const char *label, bool shown)
{
    memset(p, 0, sizeof *p);
    progress_start(&p->bar, shown ? stderr : NULL, label, positions);
    if (!p->bar.on)
        return inner;
    p->last_layer = c->n_layers - 1;
    p->obs.emit = rp_emit;
    p->obs.wants = rp_wants;
    return inner ? obs_tee_init(&p->tee, inner, &p->obs) : &p->obs;
}

void run_progress_end(run_progress *p)
{
    progress_end(&p->bar);
}
