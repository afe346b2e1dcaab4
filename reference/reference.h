/* reference.h — the continuous reference engine.
 *
 * The plainest correct semantics: one dense K/V cache per layer indexed by
 * absolute position; a query at position i attends keys j with
 * i - W < j <= i on sliding layers (W = the config's window) and j <= i on
 * global layers, visited in ascending j. KV-shared layers read their
 * owner's cache. The prompt is prefilled all at once or `prefill_step`
 * tokens per step; both give the same bits. */
#ifndef KV_REFERENCE_H
#define KV_REFERENCE_H

#include "../model/observer.h"
#include "../model/engine.h"
#include "../model/kernels.h"
#include "../model/model.h"

typedef struct {
    int max_ctx;        /* positions the cache holds (<= config max_positions) */
    int prefill_step;   /* 0: each forward() call in one batch; k: k tokens per batch */
} ref_opts;

/* The model, context and observer must outlive the engine. */
kv_engine *ref_create(const kv_model *m, const kern_ctx *kc, const ref_opts *o,
                      kv_observer *obs, kv_err *e);

#endif
