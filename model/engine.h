/* engine.h — what the harness sees of an engine (reference or chunked).
 *
 * An engine holds its own KV cache. forward() appends tokens at the next
 * absolute positions, however the engine chooses to batch them, and
 * returns the logits of the last token appended. */
#ifndef KV_ENGINE_H
#define KV_ENGINE_H

#include <stdint.h>
#include "err.h"

typedef struct kv_engine kv_engine;

struct kv_engine {
    const char *name;
    /* Returns 0; 1 when the observer asked to stop (e filled with why);
     * -1 on error. logits (V floats) may be NULL. */
    int (*forward)(kv_engine *self, const int32_t *tokens, int n, float *logits, kv_err *e);
    /* Tokens appended so far (the next absolute position). */
    int64_t (*position)(const kv_engine *self);
    /* One-line settings for reports, e.g. "reference prefill=all". */
    void (*describe)(const kv_engine *self, char *buf, size_t n);
    /* Bytes of KV cache held. */
    size_t (*cache_bytes)(const kv_engine *self);
    void (*destroy)(kv_engine *self);
};

static inline void engine_free(kv_engine *e)
{
    if (e)
        e->destroy(e);
}

#endif
