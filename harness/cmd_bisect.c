/* cmd_bisect.c — `kvdiff bisect`: find the first divergence of a long run
 * cheaply. Both engines (the reference, and the one the options name) run
 * once recording only fingerprints (a hash per row: kilobytes whatever the
 * context); comparing the hashes gives the first divergent row. Both then
 * run again recording full rows of that neighbourhood only — every
 * position up to a little past it, for the divergent layer, the layer
 * whose cache it reads and the next one — and those dumps are compared
 * and diagnosed as `kvdiff compare` does. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../model/outfile.h"
#include "run.h"
#include "verbs.h"

static void bisect_usage(FILE *f)
{
    fprintf(f,
            "usage: kvdiff bisect [--model M] [prompt] [engine options] [-o DIR]\n"
            "\n"
            "Runs the reference and the engine the options name (as `kvdiff run`: model,\n"
            "prompt, generation and engine options) recording fingerprints, finds the\n"
            "first divergent row from the hashes, re-runs both recording full rows of\n"
            "that neighbourhood only, and compares those as `kvdiff compare` does.\n"
            "Comparison is exact (fingerprints are). Exit 0 same, 1 diverged, 2 error.\n"
            "\n"
            "  -o, --out DIR      folder for the four dumps (created; default a new\n"
            "                     kvdiff-bisect.XXXXXX under $TMPDIR), printed at the end\n"
            "  --json             the final comparison as JSON\n"
            "  --stages           add the per-layer, per-stage metrics table\n"
            "  --verbose          timings on stderr\n"
            "See kvdiff run --help for the model, prompt and engine options.\n"
            "\n"
            "Examples:\n"
            "  kvdiff bisect --model tiny-gemma3 --prompt-random 200 --engine chunked --chunk 5 \\\n"
            "                --inject window=4 -o bisect\n"
            "  kvdiff bisect --model qwen2.5-0.5b-shape --prompt-random 1024 --engine chunked \\\n"
            "                --chunk 64 -o bisect --json > bisect.json\n");
}

/* Stops a run once it has computed every position a selection records:
 * the engine is asked to stop at the first event of a later forward step
 * (a step is never cut part-way, so every layer of the last one is kept). */
typedef struct {
    kv_observer obs;
    kv_observer *inner;
    int64_t last_pos;            /* last position recorded */
    bool stopped;
} bisect_stop;

static int bs_wants(kv_observer *self, kv_stage st, int layer)
{
    bisect_stop *b = (bisect_stop *)self;
    return !b->inner->wants || b->inner->wants(b->inner, st, layer);
}

static int bs_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    bisect_stop *b = (bisect_stop *)self;
    return b->inner->token ? b->inner->token(b->inner, pos, id, is_prompt) : 0;
}

static int bs_emit(kv_observer *self, const kv_event *ev)
{
    bisect_stop *b = (bisect_stop *)self;
    if (ev->pos0 > b->last_pos) {
        b->stopped = true;
        return 1;
    }
    return b->inner->emit(b->inner, ev);
}

static kv_observer *bisect_stop_init(bisect_stop *b, kv_observer *inner, int64_t last_pos)
{
    memset(b, 0, sizeof *b);
    b->inner = inner;
    b->last_pos = last_pos;
    b->obs.emit = bs_emit;
    b->obs.token = bs_token;
    b->obs.wants = bs_wants;
    b->obs.all_logits = inner->all_logits;
    return &b->obs;
}

/* Records one engine's run at path with selection d; the bar shows phase.
 * A selection that ends before the context (d->pos_hi) stops the engine
 * past it: nothing later would be recorded. */
static int record(const run_opts *o, const dump_opts *d, const char *path, const kv_model *m,
                  const kern_ctx *kc, long ctx, const int32_t *prompt, int n_prompt,
                  const char *phase, kv_err *e)
{
    dump_writer *w = run_open_dump(o, path, d, m, kc, ctx, n_prompt, e);
    if (!w)
        return -1;
    bool cut = d->pos_hi >= 0 && d->pos_hi < ctx - 1;
    bisect_stop stop;
    kv_observer *obs = dump_observer(w);
    if (cut)
        obs = bisect_stop_init(&stop, obs, d->pos_hi);
    run_progress bar;
    obs = run_progress_attach(&bar, obs, &m->cfg, cut ? d->pos_hi + 1 : ctx, "positions", true);
    progress_phase(&bar.bar, phase);
    engine_spec spec = run_engine_spec(o);
    kv_engine *eng = engine_create(&spec, m, kc, ctx, obs, e);
    if (!eng) {
        run_progress_end(&bar);
        dump_close(w, "engine could not start", NULL);
        return -1;
    }
    gen_result res;
    int rc = generate(eng, &m->cfg, prompt, n_prompt, &o->go, obs, &res, e);
    run_progress_end(&bar);
    gen_result_free(&res);
    engine_free(eng);
    bool ours = cut && stop.stopped && rc != 0 && !run_stop_signal;
    char why[128];
    snprintf(why, sizeof why, "stopped after position %lld (the bisect neighbourhood)",
             (long long)d->pos_hi);
    kv_err ge = *e;
    return run_close_dump(w, path, ours ? 0 : rc, &ge, ours ? why : NULL, e);
}

/* Compares two dump files (exact). Returns cmp_compare's code. */
static int compare_files(const char *a, const char *b, cmp_result *r, kv_err *e)
{
    cmp_source sa, sb;
    cmp_opts co;
    cmp_opts_default(&co);
    memset(r, 0, sizeof *r);
    cmp_dump_source *da = cmp_dump_source_open(a, &sa, e);
    cmp_dump_source *db = da ? cmp_dump_source_open(b, &sb, e) : NULL;
    int rc = db ? cmp_compare(&sa, &sb, &co, r, e) : -1;
    cmp_dump_source_close(db);
    cmp_dump_source_close(da);
    return rc;
}

static int make_dir(run_opts *o, char *buf, size_t n, kv_err *e)
{
    if (o->out_dir) {
        /* The user's folder (links and all); the dumps kvdiff names inside
         * it refuse a planted link (outfile.h, the dump writer). */
        if (outfile_user_dir(o->out_dir, NULL, e) < 0)
            return -1;
        cli_dir(buf, n, o->out_dir);   /* "out/" prints as out/ref.h5, not out//ref.h5 */
        return 0;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(buf, n, "%s/kvdiff-bisect.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(buf))
        return kv_errf(e, "%s: cannot create a folder: %s", buf, strerror(errno));
    return 0;
}

/* The full-row selection around the divergent row d. */
static void neighbourhood(const kv_config *c, const cmp_divergence *d, long ctx, dump_opts *n)
{
    dump_opts_default(n);
    int L = c->n_layers;
    if (d->layer >= 0) {
        int owner = c->kv_owner[d->layer];
        n->layer_lo = owner < d->layer ? owner : d->layer;
        n->layer_hi = d->layer + 1 < L ? d->layer + 1 : d->layer;
    } else if (d->stage == STAGE_EMBED) {
        n->layer_lo = n->layer_hi = 0;
    } else {
        n->layer_lo = n->layer_hi = L - 1;
        n->stages[d->stage] = true;
        n->stages[STAGE_FINAL_NORM] = true;
    }
    /* Keys of every earlier position (attention reads them), the row and a
     * few after it (patterns over positions: chunk and decode steps). */
    n->pos_lo = 0;
    n->pos_hi = d->pos + 8 < ctx - 1 ? d->pos + 8 : ctx - 1;
}

static const char *where(const cmp_divergence *d, char *buf, size_t n)
{
    if (d->layer >= 0)
        snprintf(buf, n, "position %lld, layer %d, stage %s", (long long)d->pos, d->layer,
                 stage_name(d->stage));
    else
        snprintf(buf, n, "position %lld, stage %s", (long long)d->pos, stage_name(d->stage));
    return buf;
}

static int bisect(run_opts *o, const kv_model *m, const kern_ctx *kc, const int32_t *prompt,
                  int n_prompt, kv_err *e)
{
    long ctx = run_context(o, &m->cfg, n_prompt, e);
    if (ctx < 0)
        return EXIT_USAGE;
    char dir[4096], ref_fp[4200], test_fp[4200], ref_full[4200], test_full[4200];
    if (make_dir(o, dir, sizeof dir, e) < 0)
        return EXIT_USAGE;
    snprintf(ref_fp, sizeof ref_fp, "%s/ref.fp.h5", dir);
    snprintf(test_fp, sizeof test_fp, "%s/test.fp.h5", dir);
    snprintf(ref_full, sizeof ref_full, "%s/ref.h5", dir);
    snprintf(test_full, sizeof test_full, "%s/test.h5", dir);
    run_opts ro;
    run_opts_reference(o, &ro);

    dump_opts fp;
    dump_opts_default(&fp);
    fp.fingerprint = true;
    double t0 = run_now();
    if (record(&ro, &fp, ref_fp, m, kc, ctx, prompt, n_prompt, "1/4 ref fingerprints", e) < 0 ||
        record(o, &fp, test_fp, m, kc, ctx, prompt, n_prompt, "2/4 test fingerprints", e) < 0)
        return EXIT_USAGE;
    cmp_result r;
    int rc = compare_files(ref_fp, test_fp, &r, e);
    double t1 = run_now();
    char w1[128], w2[128];
    FILE *info = o->json ? stderr : stdout;
    if (rc < 0) {
        cmp_result_free(&r);
        return EXIT_USAGE;
    }
    fprintf(info, "bisect    fingerprints: %lld rows compared by hash", (long long)r.compared.rows);
    if (r.verdict != CMP_DIVERGED || !r.first.found) {
        fprintf(info, ", none differs\n");
        char *text = o->json ? cmp_render_json(&r, o->render_flags) : cmp_render_text(&r, o->render_flags);
        if (text)
            printf("%s%s", text, text[0] && text[strlen(text) - 1] != '\n' ? "\n" : "");
        free(text);
        fprintf(info, "dumps     %s (fingerprints)\n", dir);
        int code = cmp_exit_code(rc, &r);
        cmp_result_free(&r);
        return code;
    }
    cmp_divergence first = r.first;
    /* The neighbourhood runs stop past its last position, before most
     * tokens are generated: the token verdict is the fingerprint runs',
     * which went to the end. */
    cmp_tokens whole_run_tokens = r.tokens;
    cmp_result_free(&r);
    fprintf(info, "; the first divergent row is at %s\n", where(&first, w1, sizeof w1));

    dump_opts full;
    neighbourhood(&m->cfg, &first, ctx, &full);
    fprintf(info, "bisect    full rows of layers %d..%d, positions %lld..%lld\n", full.layer_lo,
            full.layer_hi, (long long)full.pos_lo, (long long)full.pos_hi);
    if (record(&ro, &full, ref_full, m, kc, ctx, prompt, n_prompt, "3/4 ref rows", e) < 0 ||
        record(o, &full, test_full, m, kc, ctx, prompt, n_prompt, "4/4 test rows", e) < 0)
        return EXIT_USAGE;
    rc = compare_files(ref_full, test_full, &r, e);
    double t2 = run_now();
    if (rc < 0) {
        cmp_result_free(&r);
        return EXIT_USAGE;
    }
    r.tokens = whole_run_tokens;
    char *text = o->json ? cmp_render_json(&r, o->render_flags) : cmp_render_text(&r, o->render_flags);
    if (text)
        printf("%s%s", text, text[0] && text[strlen(text) - 1] != '\n' ? "\n" : "");
    free(text);
    /* Every row before the hashed one is identical, so the full dumps must
     * place the divergence at that row; anything else is worth a warning. */
    if (!r.first.found || r.first.pos != first.pos || r.first.layer != first.layer ||
        r.first.stage != first.stage)
        fprintf(info, "warning   the full dumps place the first divergence at %s, the "
                      "fingerprints at %s\n",
                r.first.found ? where(&r.first, w2, sizeof w2) : "none", w1);
    fprintf(info, "dumps     %s (ref.fp.h5, test.fp.h5: fingerprints; ref.h5, test.h5: the "
                  "neighbourhood)\n", dir);
    if (o->verbose)
        fprintf(stderr, "time      fingerprint runs and compare %.3f s, neighbourhood %.3f s\n",
                t1 - t0, t2 - t1);
    int code = cmp_exit_code(rc, &r);
    cmp_result_free(&r);
    return code;
}

int cmd_bisect(int argc, char **argv)
{
    run_opts o;
    run_opts_init(&o);
    o.bisect = true;
    kv_err e = {{0}};
    int pr = run_parse(argc, argv, &o, &e);
    if (pr == 1) {
        bisect_usage(stdout);
        return EXIT_OK;
    }
    if (pr < 0) {
        if (o.json)
            cli_json_error("bisect", &e, EXIT_USAGE);
        cli_usage_error("bisect", &e);
        return EXIT_USAGE;
    }
    kv_model m;
    kern_ctx kc;
    if (cli_open_model(&o.mo, &m, &kc, &e) < 0) {
        if (o.json)
            cli_json_error("bisect", &e, EXIT_USAGE);
        cli_error("bisect", &e);
        return EXIT_USAGE;
    }
    int32_t *prompt = NULL;
    int n_prompt = 0, code = EXIT_USAGE;
    kv_tokenizer *tok = NULL;
    if (cli_open_tokenizer("bisect", &o.mo, &m, &tok, &e) == 0 &&
        cli_make_prompt(&o.po, &o.mo, &m, tok, &prompt, &n_prompt, &e) == 0)
        code = bisect(&o, &m, &kc, prompt, n_prompt, &e);
    tok_free(tok);
    /* Stopped by a signal: its status, as `kvdiff run` (128 + the signal);
     * the message still says which dump holds what was computed. */
    const int stop = run_stop_signal;
    if (code == EXIT_USAGE && stop) {
        cli_error("bisect", &e);
        free(prompt);
        cli_close_model(&m, &kc);
        return 128 + stop;
    }
    if (code == EXIT_USAGE && o.json)
        cli_json_error("bisect", &e, code);
    if (code == EXIT_USAGE)
        cli_error("bisect", &e);
    free(prompt);
    cli_close_model(&m, &kc);
    return code;
}
