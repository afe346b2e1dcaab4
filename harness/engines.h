/* engines.h — an engine chosen by name with its options, for a run of
 * ctx positions: the reference (reference.h) or the chunked engine
 * (chunked.h). The one place that knows both, so that the command line
 * only parses options into an engine_spec and prints; the loops that feed
 * tokens (prefill steps, chunks, decode) stay inside each engine. */
#ifndef KV_ENGINES_H
#define KV_ENGINES_H

#include "../chunked/chunked.h"

typedef struct {
    const char *name;       /* "reference" or "chunked" */
    int prefill_step;       /* reference: tokens per prefill step (0: all at once) */
    chk_opts chunked;       /* chunked: its options; max_ctx and an over-long chunk
                               are set for the run by engine_chunked_opts */
} engine_spec;

/* Is name an engine? */
bool engine_known(const char *name);

/* The chunked options of s for a run of ctx positions: max_ctx = ctx, and
 * a chunk longer than the run prefills the prompt at once (what --chunk
 * 64 means with a 40-token prompt; the same computation as any chunk of
 * at least the context). */
chk_opts engine_chunked_opts(const engine_spec *s, long ctx);

/* Refuses what the engine would refuse (before a dump file is made). */
int engine_check(const engine_spec *s, const kv_config *c, long ctx, kv_err *e);

/* The engine of s over m for ctx positions; the model, context and
 * observer must outlive it. NULL with e filled on error. */
kv_engine *engine_create(const engine_spec *s, const kv_model *m, const kern_ctx *kc, long ctx,
                         kv_observer *obs, kv_err *e);

#endif
