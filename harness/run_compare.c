/* run_compare.c — `kvdiff run --compare`: the reference and the engine under
 * test on the same model, prompt and sampling, compared in memory.
 *
 * The reference runs first into an in-memory recording. The engine under
 * test then runs with an observer that records its rows too and checks
 * each one against the reference's as it is emitted; in exact mode, once a
 * row differs, the run finishes the forward step holding it (every layer
 * of that chunk or decode step, so the diagnosis has its evidence) and is
 * stopped at the next one. The comparer then reads both recordings as it
 * reads two dumps. Both engines see exactly the calls `kvdiff run` makes,
 * so the verdict is the one two dumps would give. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "run.h"
#include "../reports/report.h"

typedef struct {
    kv_observer obs;
    kv_observer *rec;            /* the test recording */
    kv_observer *dump;           /* optional --dump writer */
    cmp_memrec *ref;
    bool stop_early;             /* exact mode */
    bool found;                  /* a row differs */
    int64_t pos, step_first, step_last;  /* its position and the step holding it */
    int64_t done_to;             /* last position of the steps run after it */
    int layer;
    kv_stage stage;
    bool stopped;                /* the checker stopped the run */
    int64_t span;                /* positions the diagnosis reads past it */
} live_check;

static int wants_one(kv_observer *o, kv_stage st, int layer)
{
    return o && (!o->wants || o->wants(o, st, layer));
}

static int lc_wants(kv_observer *self, kv_stage st, int layer)
{
    live_check *c = (live_check *)self;
    return wants_one(c->rec, st, layer) || wants_one(c->dump, st, layer);
}

static int lc_token(kv_observer *self, int64_t pos, int32_t id, int is_prompt)
{
    live_check *c = (live_check *)self;
    if (c->rec->token && c->rec->token(c->rec, pos, id, is_prompt))
        return 1;
    return c->dump && c->dump->token ? c->dump->token(c->dump, pos, id, is_prompt) : 0;
}

static int lc_emit(kv_observer *self, const kv_event *ev)
{
    live_check *c = (live_check *)self;
    /* A later forward step has begun: the divergent one is complete, and
     * so are those the diagnosis reads past it. */
    if (c->found && ev->pos0 > c->step_last + c->span) {
        c->stopped = true;
        return 1;
    }
    if (c->found && ev->pos0 + ev->nrows - 1 > c->done_to)
        c->done_to = ev->pos0 + ev->nrows - 1;
    if (wants_one(c->rec, ev->stage, ev->layer) && c->rec->emit(c->rec, ev))
        return 1;
    if (wants_one(c->dump, ev->stage, ev->layer) && c->dump->emit(c->dump, ev))
        return 1;
    if (!c->stop_early || c->found)
        return 0;
    size_t bytes = (size_t)ev->ncols * sizeof(float);
    for (int r = 0; r < ev->nrows; r++) {
        int cols = 0;
        const float *want = cmp_memrec_row(c->ref, ev->layer, ev->stage, ev->pos0 + r, &cols);
        if (!want || cols != ev->ncols)
            continue;
        if (memcmp(want, ev->data + (size_t)r * (size_t)ev->ncols, bytes) != 0) {
            c->found = true;
            c->pos = ev->pos0 + r;
            c->layer = ev->layer;
            c->stage = ev->stage;
            c->step_first = ev->pos0;
            c->step_last = ev->pos0 + ev->nrows - 1;
            c->done_to = c->step_last;
            break;
        }
    }
    return 0;
}

/* What the in-memory recordings keep: the --dump-* selection. */
static void memrec_selection(const dump_opts *d, cmp_memrec_opts *mo)
{
    cmp_memrec_opts_default(mo);
    mo->layer_lo = d->layer_lo;
    mo->layer_hi = d->layer_hi;
    mo->pos_lo = d->pos_lo;
    mo->pos_hi = d->pos_hi;
    for (int s = 0; s < STAGE_COUNT; s++)
        mo->stages[s] = d->stages[s];
    if (d->full_logits)
        mo->stages[STAGE_LOGITS] = true;
    mo->topk = d->topk;
}

/* One engine's run into rec (tee'd to a dump at path when given). For the
 * test run, check != NULL wires the live checker in. Returns 0, or -1 with
 * e filled. */
static int record_run(const run_opts *o, const kv_model *m, const kern_ctx *kc, long ctx,
                      const int32_t *prompt, int n_prompt, cmp_memrec *rec, const char *path,
                      live_check *check, gen_result *res, kv_err *e)
{
    dump_writer *w = NULL;
    if (path && !(w = run_open_dump(o, path, &o->dopts, m, kc, ctx, n_prompt, e)))
        return -1;
    kv_observer_tee tee;
    kv_observer *obs;
    if (check) {
        check->rec = cmp_memrec_observer(rec);
        check->dump = w ? dump_observer(w) : NULL;
        check->obs.emit = lc_emit;
        check->obs.token = lc_token;
        check->obs.wants = lc_wants;
        check->obs.all_logits = 1;
        obs = &check->obs;
    } else {
        obs = obs_tee_init(&tee, cmp_memrec_observer(rec), w ? dump_observer(w) : NULL);
    }
    run_progress bar;
    obs = run_progress_attach(&bar, obs, &m->cfg, ctx, check ? "positions (test)" : "positions (ref)",
                              !o->quiet);
    engine_spec spec = run_engine_spec(o);
    kv_engine *eng = engine_create(&spec, m, kc, ctx, obs, e);
    if (!eng) {
        run_progress_end(&bar);
        if (w)
            dump_close(w, "engine could not start", NULL);
        return -1;
    }
    int rc = generate(eng, &m->cfg, prompt, n_prompt, &o->go, obs, res, e);
    run_progress_end(&bar);
    engine_free(eng);
    bool ours = check && check->stopped && rc == 1;
    if (ours)
        rc = 0;
    if (w) {
        /* A run stopped on purpose leaves a dump marked partial. */
        char why[128];
        snprintf(why, sizeof why, "stopped after the first divergence (position %lld)",
                 ours ? (long long)check->pos : -1LL);
        kv_err ge = *e;
        if (run_close_dump(w, path, rc, &ge, ours ? why : NULL, e) < 0)
            rc = -1;
    }
    if (rc != 0 && cmp_memrec_error(rec))
        kv_errf(e, "in-memory recording: %s", cmp_memrec_error(rec));
    cmp_memrec_set_complete(rec, rc == 0 && !ours);
    return rc == 0 ? 0 : -1;
}

/* "2.4 GiB" */
static void format_bytes(double b, char *buf, size_t n)
{
    static const char *const unit[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024 && u < 4) {
        b /= 1024;
        u++;
    }
    snprintf(buf, n, u ? "%.1f %s" : "%.0f %s", b, unit[u]);
}

/* Both runs are recorded in memory, every selected row of every position:
 * about 2.4 MB a position on qwen2.5-0.5b-shape. The estimate is made
 * before anything runs. Above half the bound (default: half the machine's
 * memory) it is a warning; above the bound an error, unless --force.
 * Returns 0 to go on, -1 with e filled to stop. */
static int check_memory(const run_opts *o, const kv_config *c, long ctx, kv_err *e)
{
    const dump_opts *d = &o->dopts;
    int64_t hi = d->pos_hi < ctx - 1 ? d->pos_hi : ctx - 1;
    int64_t positions = hi >= d->pos_lo ? hi - d->pos_lo + 1 : 0;
    /* rows, and /output's log-sum-exp and top-k of each position */
    double per = (double)dump_position_bytes(c, d) + (1.0 + 2.0 * d->topk) * 4.0;
    double total = 2.0 * per * (double)positions;
    double bound = o->compare_memory;
    const char *which = "the bound set by --compare-memory";
    if (bound <= 0) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        if (pages <= 0 || page <= 0)
            return 0;   /* unknown memory: nothing to compare with */
        bound = (double)pages * (double)page / 2.0;
        which = "half this machine's memory";
    }
    if (total <= bound / 2)
        return 0;
    char tb[32], pb[32], bb[32];
    format_bytes(total, tb, sizeof tb);
    format_bytes(2.0 * per, pb, sizeof pb);
    format_bytes(bound, bb, sizeof bb);
    const char *how = "fewer rows with --dump-stages, --dump-layers or --dump-positions, or two "
                      "dumps (run --dump, then kvdiff compare) instead";
    if (total > bound && !o->force)
        return kv_errf(e, "--compare would hold about %s in memory (%s per position x %lld "
                          "positions, both runs), more than %s (%s); keep %s, or pass --force",
                       tb, pb, (long long)positions, which, bb, how);
    fprintf(stderr, "kvdiff run: warning: --compare will hold about %s in memory (%s per "
                    "position x %lld positions, both runs; %s is %s); to hold less keep %s\n",
            tb, pb, (long long)positions, which, bb, how);
    return 0;
}

static void describe_run(const run_opts *o, long ctx, char *buf, size_t n)
{
    if (!strcmp(o->engine, "reference")) {
        snprintf(buf, n, "reference prefill=%s", o->prefill_step ? "steps" : "all");
        return;
    }
    char inj[200];
    chk_injections_describe(&o->co.inj, inj, sizeof inj);
    snprintf(buf, n, "chunked chunk=%d cache=%s attn=%s%s kv-share=%s%s%.200s",
             run_effective_chunk(o, ctx), chk_cache_name(o->co.cache),
             o->co.attn == CHK_ATTN_EXACT ? "exact" : "cascade",
             o->co.mla_absorbed ? " mla=absorbed" : "", chk_share_name(o->co.share),
             strcmp(inj, "none") ? " inject=" : "", strcmp(inj, "none") ? inj : "");
}

int run_compare(const run_opts *o, const kv_model *m, const kern_ctx *kc,
                const int32_t *prompt, int n_prompt)
{
    kv_err e = {{0}};
    run_opts ro;
    run_opts_reference(o, &ro);
    long ctx = run_context(o, &m->cfg, n_prompt, &e);
    if (ctx < 0) {
        cli_error("run", &e);
        return EXIT_USAGE;
    }
    if (check_memory(o, &m->cfg, ctx, &e) < 0) {
        cli_error("run", &e);
        return EXIT_USAGE;
    }
    cmp_memrec_opts mo;
    memrec_selection(&o->dopts, &mo);
    char *ref_settings = run_settings_json(&ro, kc, m, ctx);
    char *test_settings = run_settings_json(o, kc, m, ctx);
    cmp_memrec *rr = cmp_memrec_new(&m->cfg, "reference", ref_settings, &mo, &e);
    cmp_memrec *tr = rr ? cmp_memrec_new(&m->cfg, o->engine, test_settings, &mo, &e) : NULL;
    free(ref_settings);
    free(test_settings);
    int code = EXIT_USAGE;
    gen_result gref, gtest;
    memset(&gref, 0, sizeof gref);
    memset(&gtest, 0, sizeof gtest);
    cmp_result r;
    memset(&r, 0, sizeof r);
    live_check lc;
    memset(&lc, 0, sizeof lc);
    lc.ref = rr;
    lc.span = cmp_diag_span(&m->cfg);
    lc.stop_early = !o->tolerance_given || (o->cmp.atol == 0 && o->cmp.rtol == 0 && o->cmp.ulp == 0);
    char da[320], db[320];
    describe_run(&ro, ctx, da, sizeof da);
    describe_run(o, ctx, db, sizeof db);
    double t0 = run_now();
    if (!tr ||
        record_run(&ro, m, kc, ctx, prompt, n_prompt, rr, o->dump_ref_path, NULL, &gref, &e) < 0) {
        kv_err_prefix(&e, "reference run");
        goto out;
    }
    double t1 = run_now();
    if (record_run(o, m, kc, ctx, prompt, n_prompt, tr, o->dump_path, &lc, &gtest, &e) < 0) {
        kv_err_prefix(&e, "test run");
        goto out;
    }
    double t2 = run_now();
    cmp_source rs, ts;
    cmp_memrec_source(rr, &rs);
    cmp_memrec_source(tr, &ts);
    rs.label = "reference";
    ts.label = o->engine;
    ts.stopped_on_purpose = lc.stopped;
    int rc = cmp_compare(&rs, &ts, &o->cmp, &r, &e);
    code = cmp_exit_code(rc, &r);
    if (rc < 0)
        goto out;
    if (o->quiet) {
        char verdict[1024];   /* the line compare -q and kvdiff report open with */
        report_verdict_line(&r, verdict, sizeof verdict);
        cli_fputs_escaped(verdict, stdout, false);
        putchar('\n');
        goto out;
    }
    if (!o->json) {
        printf("reference %s\ntest      %s\n", da, db);
        if (lc.stopped && lc.done_to > lc.step_last)
            printf("test run  stopped after the forward step of positions %lld..%lld, which "
                   "holds the first differing row, and those up to position %lld (the "
                   "positions the diagnosis reads); the runs are compared up to there\n",
                   (long long)lc.step_first, (long long)lc.step_last, (long long)lc.done_to);
        else if (lc.stopped)
            printf("test run  stopped after the forward step of positions %lld..%lld, which "
                   "holds the first differing row; the runs are compared up to there\n",
                   (long long)lc.step_first, (long long)lc.step_last);
        if (o->verbose)
            fprintf(stderr, "time      reference %.3f s, test %.3f s, in memory %.1f MiB\n",
                    t1 - t0, t2 - t1,
                    (double)(cmp_memrec_bytes(rr) + cmp_memrec_bytes(tr)) / 1048576.0);
    }
    char *text = o->json ? cmp_render_json(&r, o->render_flags) : cmp_render_text(&r, o->render_flags);
    if (text) {
        fputs(text, stdout);
        if (text[0] && text[strlen(text) - 1] != '\n')
            putchar('\n');
    }
    free(text);
    if (o->dump_ref_path)
        fprintf(o->json ? stderr : stdout, "dump      %s (reference)\n", o->dump_ref_path);
    if (o->dump_path)
        fprintf(o->json ? stderr : stdout, "dump      %s (%s%s)\n", o->dump_path, o->engine,
                lc.stopped ? ", partial: stopped after the first divergence" : "");
out:
    if (code == EXIT_USAGE && o->json)
        cli_json_error("run", &e, code);
    if (code == EXIT_USAGE)
        cli_error("run", &e);
    cmp_result_free(&r);
    gen_result_free(&gref);
    gen_result_free(&gtest);
    cmp_memrec_free(tr);
    cmp_memrec_free(rr);
    return code;
}
