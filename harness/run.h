/* run.h — what the engine-running verbs (run, run --compare, bisect) share:
 * their options, building an engine from them, recording to a dump. */
#ifndef KV_RUN_H
#define KV_RUN_H

#include <signal.h>
#include <stdbool.h>

#include "cli.h"
#include "progress.h"
#include "engines.h"
#include "../compare/compare.h"
#include "../dump/dump.h"
#include "../model/generate.h"

typedef struct {
    cli_model_opts mo;
    cli_prompt_opts po;
    gen_opts go;
    bool max_new_given;
    const char *sampling_opt;    /* the first of --temperature, --top-k, --top-p, --seed given */
    const char *follow_path;     /* --follow TEST.h5: its prompt, then its generated tokens
                                  * fed back in place of sampling (run_follow_load) */
    kv_route_rows *follow_route; /* and its routing, where it records router_logits
                                  * (run_follow_load; run_follow_free) */
    const char *engine;          /* "reference" or "chunked" */
    int prefill_step;            /* reference: 0 all, else tokens per step */
    bool prefill_given;
    chk_opts co;
    bool chunk_given;
    long max_ctx;
    int verbose;
    int list_injections;
    const char *dump_path;
    dump_opts dopts;
    bool dump_opts_given;
    /* run --compare */
    bool compare;
    const char *dump_ref_path;   /* --dump-ref: record the reference too */
    cmp_opts cmp;
    bool json;
    bool quiet;                  /* -q: no progress bar, only the verdict line */
    unsigned render_flags;
    bool tolerance_given;
    const char *exact_with;      /* --exact and this tolerance option both given */
    double compare_memory;       /* --compare-memory bytes; 0: half the machine's memory */
    bool force;                  /* --force: run past that bound */
    /* bisect */
    bool bisect;                 /* parsing bisect's options */
    const char *out_dir;
} run_opts;

void run_opts_init(run_opts *o);

/* Parses the options of `run` (and of `bisect`, which takes the same engine,
 * model and prompt options). Returns 1 for --help, 0, or -1 with e filled. */
int run_parse(int argc, char **argv, run_opts *o, kv_err *e);

/* --follow: reads o->follow_path's /tokens (refused, one line naming the
 * file, when it is no dump, has no tokens, a prompt_length of 0 or past
 * them, a model other than m's (shapes, or weight fingerprints when both
 * are known), or an id past m's vocabulary, or when an
 * explicit --max-new disagrees). *prompt (malloc'd, the caller frees) is
 * then the whole token list, *n_prompt its prompt_length; o->go.follow
 * views the generated ids inside *prompt (valid while it lives), and
 * o->go.max_new is their count. */
int run_follow_load(run_opts *o, kv_model *m, int32_t **prompt, int *n_prompt, kv_err *e);
/* With experts, the followed run's routing too: every router_logits row it
 * records becomes the row that layer's experts are chosen by at that
 * position (m->route_follow, owned by o); its own router still weighs the
 * chosen experts and records its own rows. A followed run then routes as
 * the followed one did, and a compare of the pair sees every position
 * (after a rounding flip at a near tie too). Frees what it loaded. */
void run_follow_free(run_opts *o);

/* The reference side of a comparison: o with the engine set to the
 * reference and every chunked-engine option dropped. */
void run_opts_reference(const run_opts *o, run_opts *ref);

/* Cache positions the run needs, checked against the model; -1 on error. */
long run_context(const run_opts *o, const kv_config *c, int n_prompt, kv_err *e);

/* The engine the options name, for engine_create (harness/engines.h). */
engine_spec run_engine_spec(const run_opts *o);

/* The chunk the chunked engine uses for a run of ctx positions (for the
 * settings it records and reports). */
int run_effective_chunk(const run_opts *o, long ctx);

/* Engine settings as JSON text (malloc'd): enough to re-run the same engine. */
char *run_settings_json(const run_opts *o, const kern_ctx *kc, const kv_model *m, long ctx);

/* Creates the dump at path with the selection d. SIGINT/SIGTERM then stop
 * the run (the dump is closed partial); run_close_dump restores them. */
dump_writer *run_open_dump(const run_opts *o, const char *path, const dump_opts *d,
                           const kv_model *m, const kern_ctx *kc, long ctx, int n_prompt,
                           kv_err *e);

/* Closes w with the status the run earned (gen_rc from generate()); a run
 * stopped on purpose passes why as stopped (NULL otherwise): the dump is
 * then "partial: <stopped>" and that is no failure. On failure e says why:
 * the writer's own error first, then the interruption, then the engine's.
 * Returns 0 when the run and the dump are whole (or stopped on purpose). */
int run_close_dump(dump_writer *w, const char *path, int gen_rc, const kv_err *gen_err,
                   const char *stopped, kv_err *e);

/* A progress bar over positions on a terminal (stderr): it watches every
 * layer's x_out, which engines compute anyway, so a batch of many rows
 * moves the bar layer by layer. */
typedef struct {
    kv_observer obs;
    progress bar;
    int last_layer;
    kv_observer_tee tee;
} run_progress;

/* inner with the bar beside it when stderr is a terminal and shown (not
 * -q), else inner itself (NULL stays NULL: no observer, no cost). Call
 * run_progress_end after the run. */
kv_observer *run_progress_attach(run_progress *p, kv_observer *inner, const kv_config *c,
                                 long positions, const char *label, bool shown);
void run_progress_end(run_progress *p);

/* Set by SIGINT / SIGTERM while a dump is open. */
extern volatile sig_atomic_t run_stop_signal;

/* run --compare (run_compare.c): exit code. */
int run_compare(const run_opts *o, const kv_model *m, const kern_ctx *kc,
                const int32_t *prompt, int n_prompt);

double run_now(void);

#endif
